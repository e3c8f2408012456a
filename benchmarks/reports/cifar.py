"""The CIFAR-10 patch benchmark's report: from the run records of a results
folder (`benchmarks.cifar_patches` writes them) to the paired comparison
tables (test accuracy in pp, training loss beside, Holm across each table),
the claims status (discovery against confirmation seeds), the paper's
numbers beside ours, the tuning grids and choices, the plots, summary.json
and table.md, and the generated RESULTS.md section.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Mapping, Optional, Sequence

import numpy as np

from benchmarks import harness, stats, study as study_lib

REFERENCE_OUT = harness.REFERENCE_ROOT / "cifar"
SECTION = "## CIFAR-10 patch benchmark"


def section_heading(out: pathlib.Path) -> str:
  """The RESULTS.md heading of a results folder: SECTION for the main
  protocol's (results/cifar), SECTION plus the folder's name for another
  (e.g. the earlier tiny protocol, results/cifar_tiny)."""
  name = pathlib.Path(out).resolve().name
  return SECTION if name == REFERENCE_OUT.name else f"{SECTION}: `{name}`"


def collect(out: pathlib.Path, data: Optional[str] = None,
            config: Optional[dict] = None) -> list:
  """The saved records of `out` made on `data` with `config` (default:
  each record's own, e.g. in the supplementary folders) under whatever
  library version each records; every record if data is None."""
  recs = harness.RunStore(out).records()
  if data is None:
    return recs
  return [r for r in recs if harness.matches(r, config, data)]


def accuracies(recs, arm: str, n: int, block: str = "discovery") -> dict:
  return {r["seed"]: 100.0 * r["test_acc"] for r in recs
          if r["kind"] == "run" and r["arm"] == arm and r["n"] == n
          and harness.seed_block(r["seed"]) == block}


def final_losses(recs, arm: str, n: int, block: str = "discovery") -> dict:
  """{seed: mean training loss of the last epoch}."""
  return {r["seed"]: r["train_loss"][-1] for r in recs
          if r["kind"] == "run" and r["arm"] == arm and r["n"] == n
          and harness.seed_block(r["seed"]) == block}


def comparison_rows(recs, pairs: Sequence[Mapping],
                    block: str = "discovery") -> list:
  """`stats.comparison_rows` of test accuracy (pp) over the seeds of `block`
  (discovery or confirmation) both arms finished at the comparison's
  size."""
  return stats.comparison_rows(
      pairs, lambda c, role: accuracies(recs, c[role], c["size"], block),
      lambda c, role: final_losses(recs, c[role], c["size"], block))


def compare(recs, treatment: str, baseline: str, n: int,
            block: str = "discovery") -> Optional[dict]:
  """The one comparison of treatment against baseline at n (None: no
  common seed)."""
  rows = comparison_rows(
      recs, [dict(treatment=treatment, baseline=baseline, size=n)], block)
  return rows[0] if rows else None


# What makes two rows of a comparison table the same comparison.
COMPARISON_KEY = ("treatment", "baseline", "size")


def family_pairs(arms: Sequence[str]) -> list:
  """The comparisons of a family of arms: of `study_lib.comparison_pairs`
  over adamw, stiefel and the family's arms (each against adamw, then
  stiefel against each other), those that involve an arm of the family.

  >>> family_pairs(["adamw", "stiefel", "rsgd"])
  [('stiefel', 'adamw'), ('rsgd', 'adamw'), ('stiefel', 'rsgd')]
  >>> family_pairs(["no_cap"])
  [('no_cap', 'adamw'), ('stiefel', 'no_cap')]
  """
  every = list(dict.fromkeys(["adamw", "stiefel", *arms]))
  return [p for p in study_lib.comparison_pairs(every) if set(p) & set(arms)]


def comparisons(recs, arms: Sequence[str], block: str = "discovery") -> list:
  """A family's table: at every n, its comparisons (`family_pairs`) where
  both arms ran, Holm-adjusted across them."""
  sizes = sorted({r["n"] for r in recs if r["kind"] == "run"})
  return comparison_rows(
      recs, [dict(treatment=t, baseline=b, size=n) for n in sizes
             for t, b in family_pairs(list(arms))], block)


def as_families(arms) -> list:
  """[(family name, arms)]: `arms` given as (name, arms) pairs, or as a
  flat list of names (one family, named None)."""
  if arms and all(isinstance(a, str) for a in arms):
    return [(None, list(arms))]
  return [(name, list(a)) for name, a in arms]


def all_arms(arms) -> list:
  """Every arm of the families, in order."""
  return [a for _, f in as_families(arms) for a in f]


def family_tables(recs, arms, block: str = "discovery") -> list:
  """Every family's table (`comparisons`: Holm within the family), its
  rows marked with the family's name, one list: the claims policy's unit
  is a family, fixed before any run (the study's groups of arms)."""
  return [dict(r, family=name) for name, f in as_families(arms)
          for r in comparisons(recs, f, block)]


def by_family(rows) -> dict:
  """{family name: its rows}, in the rows' order."""
  out = {}
  for r in rows:
    out.setdefault(r.get("family"), []).append(r)
  return out


def chosen_table(recs) -> dict:
  """{arm: {hp: [mean val_acc, tuning seeds]}} from the tuning runs."""
  accs = {}
  for r in recs:
    if r["kind"] == "tune":
      point = study_lib.point_key(r["hp"])
      accs.setdefault(r["arm"], {}).setdefault(point, []).append(r["val_acc"])
  return {a: {k: [float(np.mean(v)), len(v)] for k, v in g.items()}
          for a, g in accs.items()}


def markdown_table(rows) -> str:
  return "\n".join(harness.comparison_lines(rows, "acc %", size="n"))


def family_title(name: Optional[str], rows) -> str:
  arms = sorted({a for r in rows for a in (r["treatment"], r["baseline"])})
  return f"Family `{name}` ({', '.join(arms)}; Holm across its rows)"


def family_markdown(rows, level: str = "####") -> str:
  """The table of each family under its title (one family: the table)."""
  fams = by_family(rows)
  if len(fams) <= 1:
    return markdown_table(rows)
  return "\n\n".join(f"{level} {family_title(name, r)}\n\n{markdown_table(r)}"
                     for name, r in fams.items())


# The paper's Stiefel - AdamW gains (pp) by training-set size.
PAPER_GAIN = {1000: 1.9, 10000: 6.79, 50000: 6.7}


def plot_gain_vs_n(rows, path: pathlib.Path) -> None:
  plt = harness.pyplot()
  sel = sorted((r for r in rows if r["treatment"] == "stiefel"
                and r["baseline"] == "adamw"), key=lambda r: r["size"])
  fig, ax = plt.subplots(figsize=(5, 3.5))
  if sel:
    ns = [r["size"] for r in sel]
    g = np.array([r["mean_diff"] for r in sel])
    lo = g - np.array([r["ci_low"] for r in sel])
    hi = np.array([r["ci_high"] for r in sel]) - g
    ax.errorbar(ns, g, yerr=[lo, hi], marker="o", capsize=4,
                label="ours: stiefel - adamw (95% CI)")
    ax.plot(list(PAPER_GAIN), list(PAPER_GAIN.values()), "x--", color="gray",
            label="paper (Guerrero 2026)")
    ax.set_xscale("log")
    ax.legend(loc="best", fontsize=8)
  ax.axhline(0, color="gray", lw=0.8)
  ax.set_xlabel("training images n")
  ax.set_ylabel("test accuracy gain (pp)")
  ax.set_title("Stiefel-Adam on Q/K vs AdamW, paired seeds")
  harness.save_figure(fig, path, dpi=120)


def plot_curves(recs, n: int, arms: Sequence[str],
                path: pathlib.Path) -> None:
  plt = harness.pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for k, arm in enumerate(arms):
    cs = [r["test_curve"] for r in recs
          if r["kind"] == "run" and r["arm"] == arm and r["n"] == n]
    if not cs:
      continue
    c = 100.0 * np.array(cs)
    ep = np.arange(1, c.shape[1] + 1)
    m, s = c.mean(0), c.std(0)
    color = plt.cm.tab20(2 * k % 20 + (2 * k // 20))
    ax.plot(ep, m, label=f"{arm} ({len(cs)})", color=color)
    ax.fill_between(ep, m - s, m + s, alpha=0.12, color=color)
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy % (mean ± sd over seeds)")
  ax.set_title(f"CIFAR-10 patch transformer, n = {n}")
  ax.legend(fontsize=7, ncol=2)
  harness.save_figure(fig, path, dpi=120)


def frame_summary(runs, key: str) -> dict:
  """{arm: mean of key} at the largest n: how far the Q/K frames moved
  from their start (Frobenius, summed over frames) and how orthonormal
  they ended."""
  if not runs:
    return {}
  n = max(r["n"] for r in runs)
  vals = {}
  for r in runs:
    if r["n"] == n:
      vals.setdefault(r["arm"], []).append(r[key])
  return {a: float(np.mean(v)) for a, v in vals.items()}


def report(out: pathlib.Path, arms: Sequence[str], data: Optional[str] = None,
           config: Optional[dict] = None, plots: bool = True) -> dict:
  """Writes summary.json, table.md and (plots) the PNGs from the finished
  runs (those of `collect(out, data, config)`): a table per family of
  `arms` ((name, arms) pairs, or a flat list: one family, `as_families`)
  and the curves in that order; returns the summary."""
  recs = collect(out, data, config)
  configs = {json.dumps(r["config"], sort_keys=True) for r in recs}
  if len(configs) > 1:
    raise ValueError(
        f"{harness.portable(out)} holds runs of {len(configs)} configurations;"
        " a report covers one. Move the others to their own folder, or run"
        " without --report-only to report the current configuration's runs:"
        f" {sorted(configs)}")
  rows = family_tables(recs, arms)
  runs = [r for r in recs if r["kind"] == "run"]
  blocks = {}
  for r in runs:
    blocks.setdefault(harness.seed_block(r["seed"]), set()).add(r["seed"])
  summary = {
      "families": as_families(arms),     # the planned arms, run or not
      "comparisons": rows, "paper_rows": paper_comparisons(recs),
      "paper_rows_confirmation": paper_comparisons(recs, "confirmation"),
      "confirmation": family_tables(recs, arms, "confirmation"),
      "seeds": {b: harness.format_seeds(s) for b, s in sorted(blocks.items())},
      "tuning": chosen_table(recs),
      "chosen": {r["arm"]: r["hp"] for r in runs},
      "base": next((r.get("base", {"lr": r.get("base_lr")}) for r in runs
                    if r["arm"] != "adamw"), None),
      "qk_movement": frame_summary(runs, "qk_movement"),
      "qk_isometry_error": frame_summary(runs, "qk_isometry_error"),
      "runs": len(runs), "tuning_runs": len(recs) - len(runs),
      "run_wall_s": float(sum(r["wall_s"] for r in runs)),
      "tuning_wall_s": float(sum(r["wall_s"] for r in recs if r["kind"] == "tune")),
      "data": sorted({r["data"] for r in recs}),
      "library_version": sorted({r["library_version"] for r in recs}),
      "config": recs[0]["config"] if recs else None,
      "machine": sorted({harness.machine_line(r["machine"]) for r in recs}),
  }
  harness.write_json(out / "summary.json", summary, indent=1)
  harness.write_text(out / "table.md", family_markdown(rows) + "\n")
  if runs and plots:
    plot_gain_vs_n(rows, out / "gain_vs_n.png")
    plot_curves(recs, max(r["n"] for r in runs), all_arms(arms),
                out / "curves.png")
  return summary


# --------------------------------------------------------------------------
# benchmarks/RESULTS.md: our numbers beside the paper's.

# (label, treatment, baseline, n or None for the largest, paper's number)
PAPER_ROWS = (
    ("Stiefel-Adam - AdamW, largest n", "stiefel", "adamw", None,
     "+6.79 pp at n = 10k (12/12, t = 38.33); later version +8.98 pp (t = 60.6)"),
    ("Stiefel-Adam - AdamW, n = 4,000", "stiefel", "adamw", 4000,
     "(between +1.9 at 1k and +6.79 at 10k)"),
    ("Stiefel-Adam - AdamW, n = 1,000", "stiefel", "adamw", 1000, "+1.9 pp"),
    ("Stiefel-Adam - AdamW, n = 50,000", "stiefel", "adamw", 50000,
     "+6.7 pp"),
    ("RSGD - AdamW", "rsgd", "adamw", None, "+1.97 pp"),
    ("frozen orthonormal Q/K - AdamW", "frozen", "adamw", None, "+1.69 pp"),
    ("RSGD - frozen", "rsgd", "frozen", None, "+0.28 pp (freezing costs 0.28)"),
    ("Stiefel - per-coordinate v (scale-free step)", "stiefel",
     "per_coordinate_v", None, "+4.63 pp"),
    ("Stiefel - no projection", "stiefel", "no_projection", None,
     "nothing measurable"),
    ("Stiefel - no trust-region cap", "stiefel", "no_cap", None, "(not reported)"),
    ("Stiefel per head - one frame per projection", "stiefel", "whole_frame",
     None, "(equivariance: nothing measurable)"),
    ("Stiefel (eps 1e-8) - eps 1e-3", "stiefel", "eps_0.001", None, "(sweep)"),
    ("Stiefel (eps 1e-8) - eps 1e-2", "stiefel", "eps_0.01", None, "(sweep)"),
    ("Stiefel (eps 1e-8) - eps 0.1", "stiefel", "eps_0.1", None,
     "+2.6 pp (p < 0.001)"),
)


def paper_comparisons(recs, block: str = "discovery") -> list:
  """compare() on the seeds of `block` for each row of PAPER_ROWS (None
  where not run); n = None means the largest n both arms ran at."""
  out = []
  for _, t, b, n in ((r[0], r[1], r[2], r[3]) for r in PAPER_ROWS):
    if n is None:
      common = ({r["n"] for r in recs if r["kind"] == "run" and r["arm"] == t}
                & {r["n"] for r in recs if r["kind"] == "run" and r["arm"] == b})
      n = max(common) if common else None
    out.append(compare(recs, t, b, n, block) if n is not None else None)
  return stats.with_holm(out)


def _ours(r) -> str:
  if r is None:
    return "not run"
  t = harness.fmt_t(r["t"]) or "n/a"
  return (f"{harness.fmt_diff(r, 2, 'pp')} at n = {r['size']}, t = {t},"
          f" p = {harness.fmt_p(r['p'])}, Holm p = {harness.fmt_p(r['p_holm'])},"
          f" wins {r['wins']}/{r['n']}")


def paper_table(rows, confirmation=None) -> str:
  """The paper's numbers beside ours on the discovery seeds and, where any
  ran, on the confirmation seeds (Holm across each column)."""
  head = ["comparison", "paper", "ours, discovery seeds (mean gain, 95% CI,"
          " paired t, Holm-adjusted p across this column, wins)"]
  cols = [rows]
  if any(confirmation or ()):
    head.append("ours, confirmation seeds (the same; which are findings:"
                " the claims status)")
    cols.append(confirmation)
  return "\n".join(harness.markdown_table(
      head, "l" * len(head),
      [[label, paper] + [_ours(c[i]) for c in cols]
       for i, (label, _, _, _, paper) in enumerate(PAPER_ROWS)]))


def supplementary_text(out: pathlib.Path, arms: Sequence[str],
                       data: str) -> str:
  """The tables of runs kept in subfolders of out (other configurations,
  e.g. --set model.dim=64 or --set epochs=15 with --hp-from), each
  subfolder's report regenerated from its raw runs."""
  parts = []
  for sub in sorted(p for p in pathlib.Path(out).iterdir() if p.is_dir()):
    recs = [r for r in collect(sub, data=data) if r["kind"] == "run"]
    if not recs:
      continue
    sm = report(sub, arms, data=data)
    src = sorted({str(r.get("hp_from")) for r in recs})
    parts.append(
        f"#### Supplementary `{sub.name}`\n\nConfiguration: `{json.dumps(sm['config'])}`;"
        f" hyperparameters from {', '.join(src)} (not re-tuned); chosen"
        f" {json.dumps(sm['chosen'])}; {sm['runs']} runs,"
        f" {sm['run_wall_s'] / 60:.1f} min.\n\n{family_markdown(sm['comparisons'], '#####')}\n")
  return "\n".join(parts)


def family_claims(disc: list, conf: list, unrun: Sequence[str] = ()
                  ) -> tuple:
  """(status line, lines that follow) of one family under the claims
  policy: no confirmation runs; an unfinished family (arms of it not run
  yet: its Holm family will grow) or confirmation stage (an interim table,
  not a test); or the confirmed comparisons."""
  if not conf:
    return ("No confirmation runs are in this folder yet, so none of these"
            " comparisons is a finding yet.", [])
  interim = ["", "Confirmation runs so far (interim):", "",
             markdown_table(conf)]
  if unrun:
    return (f"The family is unfinished ({', '.join(unrun)}: no paired runs"
            " yet), so none of these comparisons is a finding yet. The"
            " tables are not tests: the Holm family grows with the arms"
            " still to run.", interim)
  if not stats.confirmation_complete(disc, conf, COMPARISON_KEY):
    return ("The confirmation stage is unfinished (not every comparison of"
            " the discovery table has as many confirmation seeds yet), so"
            " none of these comparisons is a finding yet. The interim"
            " confirmation table below is not a test: its seeds and its Holm"
            " family are partial.", interim)
  found = stats.confirmed(disc, conf, COMPARISON_KEY)
  return (f"{len(found)} of {len(conf)} comparisons confirmed (Holm p < 0.05"
          " on the confirmation seeds, same sign as on discovery):",
          [f"- {harness.finding_text(r, 'pp', size='n')}" for r in found]
          + ["", "Confirmation runs, all comparisons:", "",
             markdown_table(conf)])


def claims_text(summary: dict) -> str:
  """Which comparisons are findings under the claims policy, family by
  family (each family its own Holm correction and confirmation stage)."""
  seeds = summary.get("seeds", {})
  head = (f"**Claims status** (generated; see the claims policy). The tables"
          f" below are on the discovery seeds"
          f" ({seeds.get('discovery', 'none')}), with p-values Holm-adjusted"
          " across each table.")
  if "confirmation" in seeds:
    head += f" Confirmation seeds run: {seeds['confirmation']}."
  disc, conf = by_family(summary["comparisons"]), by_family(
      summary.get("confirmation", []))
  planned = dict(summary.get("families", []))
  lines = [head]
  for name, rows in disc.items():
    status, rest = family_claims(rows, conf.get(name, []),
                                 stats.unrun_arms(rows, planned.get(name, ())))
    if name is not None:
      lines += ["", f"{family_title(name, rows)}: {status}"]
    else:
      lines[0] += " " + status
    lines += rest
  return "\n".join(lines)


def section_text(summary: dict, out: pathlib.Path, arms: Sequence[str],
                 data: str, notes: str = "",
                 md_dir: pathlib.Path = harness.RESULTS_MD.parent) -> str:
  """The section: notes verbatim, then what the raw runs give (the
  supplementary subfolders' reports regenerated too)."""
  cfg = summary["config"] or {}
  rel = pathlib.Path(os.path.relpath(pathlib.Path(out).resolve(),
                                     pathlib.Path(md_dir).resolve())).as_posix()
  hp = "\n".join(f"- `{a}`: {json.dumps(h)}" for a, h in
                 sorted(summary["chosen"].items()))
  grid = "\n".join(f"- `{a}`: " + ", ".join(
      f"{k} -> {100 * v:.2f}% ({c})"
      for k, (v, c) in ((k, v if isinstance(v, list) else [v, 1])
                        for k, v in g.items()))
                   for a, g in summary["tuning"].items())
  frames = "\n".join(
      f"- `{a}`: moved {m:.2f}, isometry error"
      f" {summary['qk_isometry_error'].get(a, float('nan')):.1e}"
      for a, m in summary.get("qk_movement", {}).items())
  return f"""{section_heading(out)}

{notes.strip()}

Data: {", ".join(summary["data"])}. Model and training: `{json.dumps(cfg)}`.
Library: stiefel_optax {", ".join(summary["library_version"])} (the version each
run file records; runs made since issue 12 also record the code's hash).
Machine: {"; ".join(summary["machine"])}. Finished runs: {summary["runs"]}
({summary["run_wall_s"] / 60:.1f} min of run time) plus {summary["tuning_runs"]}
tuning runs ({summary["tuning_wall_s"] / 60:.1f} min).

{claims_text(summary)}

### Ours beside the paper

{paper_table(summary["paper_rows"], summary.get("paper_rows_confirmation"))}

### All paired comparisons (test accuracy, pp)

{family_markdown(summary["comparisons"])}

Validation accuracy of each tuning point (mean over the tuning seeds
{harness.format_seeds(cfg.get("tune_seeds", [cfg.get("tune_seed")]))} that have
finished, their count in brackets; trained on the training images minus the
{cfg.get("val_size")} validation images; a grid is widened past any edge
its best point falls on):

{grid}

Chosen (the AdamW arm's learning rate is also every arm's learning rate for
the non-Q/K parameters, with its weight decay: {json.dumps(summary["base"])}):

{hp}

Q/K frames at the largest n, mean over seeds: total distance moved from
the start, sum over frames of ||W_end - W_start||_F, and the final
max ||W^T W - I||_F:

{frames}

{supplementary_text(out, arms, data)}
Plots: `{rel}/gain_vs_n.png` (gain against n with 95% intervals),
`{rel}/curves.png` (test accuracy per epoch per arm at the largest n).
Raw runs: `{rel}/runs/*.json`; summary: `{rel}/summary.json`.
"""


def write_section(path: pathlib.Path, summary: dict, out: pathlib.Path,
                  arms: Sequence[str], data: str) -> None:
  """The CIFAR section of the RESULTS.md at `path`: <out>/notes.md verbatim,
  then everything generated from the raw runs."""
  notes = harness.read_notes(pathlib.Path(out) / "notes.md")
  harness.write_section(path, section_heading(out), section_text(
      summary, out, arms, data, notes, pathlib.Path(path).parent))


