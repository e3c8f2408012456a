"""The grokking study's report: from the saved runs of a results folder
(`benchmarks.grokking` writes them: one record per (arm, seed), its history
logged every `log_every` steps) to the per-run summaries (steps to the target
validation accuracy, final and minimum accuracy after it, Q/K isometry error
and movement, norm of the other weights), the paired stiefel-against-adamw
statistics over seeds and the verdict sentence, the mechanism numbers
(isometry-error and movement ratios, the rsgd probe), the long run's table,
the plots, the provenance read from the run files, results.json and
table.md, and the generated RESULTS.md section (its template's prose
verbatim around each study's table).

The experiment's Config and Study (dataclasses) are passed in and read by
field; the runs come as {arm: {seed: record}} with the probe arm's runs
under its name, and the section's studies through a loader.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from benchmarks import harness, stats, study as study_lib
from benchmarks.harness import fmt_p

# `benchmarks.grokking`'s Config and Study: duck-typed here, since a report
# never imports its experiment.
Config = Study = Any

SECTION = "## Grokking"
SECTION_TEMPLATE = harness.REFERENCE_ROOT / "grokking" / "section.md"


# --------------------------------------------------------------------------
# Per-run summaries.


def truncate(run: dict, steps: int) -> dict:
  """The run's record up to `steps` (the long run's prefix in the study)."""
  n = sum(1 for s in run["history"]["step"] if s <= steps)
  hist = {k: v[:n] for k, v in run["history"].items()}
  return dict(run, history=hist)


def steps_to_target(hist: dict, target: float,
                    key: str = "val_acc") -> Optional[int]:
  """First logged step with validation (or `key`) accuracy >= target
  (None: never)."""
  for s, a in zip(hist["step"], hist[key]):
    if a >= target:
      return s
  return None


def min_after(hist: dict, step: Optional[int]) -> Optional[float]:
  """Lowest validation accuracy from `step` on (None if step is None)."""
  if step is None:
    return None
  return min(a for s, a in zip(hist["step"], hist["val_acc"]) if s >= step)


def mean_frames(per_path: dict) -> float:
  """Mean over every Q/K frame (all kernels, all heads) of one record."""
  vals = np.concatenate([np.ravel(v) for v in per_path.values()])
  return float(vals.mean())


def iso_curve(hist: dict) -> np.ndarray:
  return np.array([mean_frames(r) for r in hist["iso"]])


def move_curve(hist: dict) -> np.ndarray:
  """Mean per-step Q/K frame movement of each chunk (step 0 has none)."""
  return np.array([mean_frames(r) for r in hist["move"] if r is not None])


def other_norm_curve(hist: dict) -> np.ndarray:
  """sqrt(sum of squared norms) of every non-Q/K weight, per record."""
  return np.array([math.sqrt(sum(v * v for v in r.values()))
                   for r in hist["norms"]])


def run_summary(run: dict, target: float) -> dict:
  h = run["history"]
  hit = steps_to_target(h, target)
  return dict(arm=run["arm"], seed=run["seed"], steps=h["step"][-1],
              steps_to_target=hit,
              steps_to_train_target=steps_to_target(h, target, "train_acc"),
              final_val_acc=h["val_acc"][-1],
              final_train_acc=h["train_acc"][-1],
              max_val_acc=max(h["val_acc"]), min_val_acc_after=min_after(h, hit),
              mean_iso=float(iso_curve(h)[1:].mean()),
              mean_move=float(move_curve(h).mean()),
              final_other_norm=float(other_norm_curve(h)[-1]),
              wall_s=run["wall_s"])


# --------------------------------------------------------------------------
# Statistics over seeds.


def censored(values: Sequence[Optional[int]], ceiling: int) -> list:
  """Never-reached (None) counted at the ceiling: a lower bound."""
  return [ceiling if v is None else v for v in values]


def compare_arms(summaries: dict, steps: int) -> dict:
  """Paired (stiefel vs adamw) tests over the seeds both arms ran."""
  a, s = summaries["adamw"], summaries["stiefel"]
  seeds = sorted(set(a) & set(s))
  a, s = [a[k] for k in seeds], [s[k] for k in seeds]
  hit_a = [r["steps_to_target"] for r in a]
  hit_s = [r["steps_to_target"] for r in s]
  ceil = steps + 1
  out = dict(seeds=seeds, ceiling=ceil, n_never_adamw=hit_a.count(None),
             n_never_stiefel=hit_s.count(None))
  by_seed = lambda values: dict(zip(seeds, values))
  # wins: the seeds where stiefel is better (fewer steps; higher accuracy)
  out["steps_to_target"] = stats.paired_row(
      by_seed(censored(hit_s, ceil)), by_seed(censored(hit_a, ceil)),
      lower_is_better=True)
  out["final_val_acc"] = stats.paired_row(
      by_seed([r["final_val_acc"] for r in s]),
      by_seed([r["final_val_acc"] for r in a]))
  out["min_val_acc_after"] = stats.unpaired_comparison(
      [r["min_val_acc_after"] for r in s if r["min_val_acc_after"] is not None],
      [r["min_val_acc_after"] for r in a if r["min_val_acc_after"] is not None])
  # Holm across the table's three comparisons (paired t, paired t, Welch).
  tests = ("steps_to_target", "final_val_acc", "min_val_acc_after")
  for k, h in zip(tests, stats.holm([out[k].get("p", float("nan"))
                                     for k in tests])):
    out[k]["holm"] = h
  return out


def winner(comp: dict) -> str:
  """Plain sentence: which arm groks first, and final accuracy."""
  st, fv = comp["steps_to_target"], comp["final_val_acc"]
  n = st["n"]
  if comp["n_never_adamw"] == comp["n_never_stiefel"] == n:
    return (f"Neither arm reached the target in any of {n} seeds: no"
            " grokking winner.")
  # The arm ahead is named from the difference as printed, so a mean that
  # rounds to 0 steps (or 0.0000 accuracy) reads "neither arm".
  steps, acc = round(st["mean_diff"]), round(fv["mean_diff"], 4)
  faster = ("stiefel" if steps < 0 else "adamw" if steps > 0
            else "neither arm")
  sig = ("significant at 0.05 after Holm" if st["holm"] < 0.05
         else "not significant at 0.05 after Holm")
  higher = ("stiefel" if acc > 0 else "adamw" if acc < 0 else "neither arm")
  # `z`: a difference that rounds to zero reads +0, not -0 (as in the table).
  return (f"Grokking speed: {faster} ahead on the mean ({sig}; mean"
          f" difference stiefel - adamw {st['mean_diff']:+z.0f} steps, paired"
          f" t p = {fmt_p(st['p'])}, Holm p = {fmt_p(st['holm'])}); stiefel"
          f" first in {st['wins']}, adamw first in {st['losses']}, tied in"
          f" {st['ties']} of {n} seeds. Final validation accuracy: {higher}"
          f" higher on the mean ({fv['mean_diff']:+z.4f}, paired t p ="
          f" {fmt_p(fv['p'])}, Holm p = {fmt_p(fv['holm'])}); stiefel"
          f" higher in {fv['wins']}, adamw higher in {fv['losses']}, tied in"
          f" {fv['ties']} of {fv['n']} seeds.")


def iso_ratio(runs_a: list, runs_s: list) -> dict:
  """adamw / stiefel mean Q/K isometry error at each common logged step
  after step 0 (seeds averaged per arm): geometric mean, min and max."""
  n = min(len(r["history"]["step"]) for r in runs_a + runs_s)
  ia = np.mean([iso_curve(r["history"])[:n] for r in runs_a], 0)
  is_ = np.mean([iso_curve(r["history"])[:n] for r in runs_s], 0)
  ratio = ia[1:] / np.maximum(is_[1:], np.finfo(np.float32).tiny)
  return dict(geomean=float(np.exp(np.log(ratio).mean())),
              min=float(ratio.min()), max=float(ratio.max()),
              adamw_mean=float(ia[1:].mean()), stiefel_mean=float(is_[1:].mean()),
              stiefel_max=float(is_[1:].max()), steps=int(runs_a[0]["history"]["step"][n - 1]))


def movement_ratios(runs: dict, probe: dict, probe_steps: int) -> dict:
  """Per-step Q/K frame movement over the first `probe_steps` steps of each
  seed, adamw / rsgd and adamw / stiefel: the ratio of the window means per
  seed, and the ratio chunk by chunk (median and range over chunks and
  seeds; fixed-step SGD moves in proportion to the gradient, which changes
  by orders of magnitude within the window)."""
  out = {}
  for other, src in (("rsgd", probe), ("stiefel", runs["stiefel"])):
    per_seed, chunks = {}, []
    for seed, r in src.items():
      if seed not in runs["adamw"]:
        continue
      n = probe_steps // r["config"]["log_every"]
      ma = move_curve(runs["adamw"][seed]["history"])[:n]
      mo = move_curve(r["history"])[:n]
      chunks += list(ma / mo)
      per_seed[seed] = dict(adamw=float(ma.mean()), other=float(mo.mean()),
                            ratio=float(ma.mean() / mo.mean()))
    if per_seed:
      rat = [v["ratio"] for v in per_seed.values()]
      out[f"adamw_over_{other}"] = dict(
          per_seed=per_seed, mean=float(np.mean(rat)), min=float(min(rat)),
          max=float(max(rat)), chunk_median=float(np.median(chunks)),
          chunk_min=float(min(chunks)), chunk_max=float(max(chunks)),
          steps=probe_steps)
  return out


# --------------------------------------------------------------------------
# Reports: JSON, markdown, plots.


def _fmt(xs: Sequence, fmt: str = "{:.4f}") -> str:
  xs = [x for x in xs if x is not None]
  if not xs:
    return "n/a"
  m = fmt.format(float(np.mean(xs)))
  return m if len(xs) < 2 else f"{m} ± {fmt.format(float(np.std(xs, ddof=1)))}"


def study_table(summaries: dict, comp: dict, target: float) -> str:
  a = [summaries["adamw"][k] for k in comp["seeds"]]
  s = [summaries["stiefel"][k] for k in comp["seeds"]]
  st, fv, mn = (comp["steps_to_target"], comp["final_val_acc"],
                comp["min_val_acc_after"])
  pct = int(round(100 * target))
  ceil = comp["ceiling"]
  # `z` on the differences: one that rounds to zero reads +0, not -0.
  col = lambda runs, key, fmt="{:.4f}": _fmt([r[key] for r in runs], fmt)
  steps = lambda runs: _fmt(censored([r["steps_to_target"] for r in runs],
                                     ceil), "{:.0f}")
  return "\n".join(harness.markdown_table(
      ["metric (mean ± sd over seeds)", "adamw", "stiefel", "stiefel − adamw",
       "test (Holm: adjusted across the table's three tests)",
       "seeds stiefel better / adamw better"], "llllll",
      [[f"steps to {pct}% val acc (never reached: counted as {ceil})",
        f"{steps(a)} (never {comp['n_never_adamw']})",
        f"{steps(s)} (never {comp['n_never_stiefel']})",
        f"{st['mean_diff']:+z.0f}",
        f"paired t p = {fmt_p(st['p'])} (Holm {fmt_p(st['holm'])}), Wilcoxon"
        f" p = {fmt_p(st['wilcoxon_p'])}", f"{st['wins']} / {st['losses']}"],
       [f"steps to {pct}% train acc (memorisation)",
        col(a, "steps_to_train_target", "{:.0f}"),
        col(s, "steps_to_train_target", "{:.0f}"), "", "", ""],
       ["final val acc", col(a, "final_val_acc"), col(s, "final_val_acc"),
        f"{fv['mean_diff']:+z.4f}",
        f"paired t p = {fmt_p(fv['p'])} (Holm {fmt_p(fv['holm'])})",
        f"{fv['wins']} / {fv['losses']}"],
       [f"min val acc after reaching {pct}%", col(a, "min_val_acc_after"),
        col(s, "min_val_acc_after"), "",
        f"Welch p = {fmt_p(mn.get('p', float('nan')))} (Holm"
        f" {fmt_p(mn['holm'])})",
        ""],
       ["final train acc", col(a, "final_train_acc"),
        col(s, "final_train_acc"), "", "", ""],
       ["mean Q/K isometry error (per frame)", col(a, "mean_iso", "{:.3g}"),
        col(s, "mean_iso", "{:.3g}"), "", "", ""],
       ["mean per-step Q/K movement (per frame)",
        col(a, "mean_move", "{:.3g}"), col(s, "mean_move", "{:.3g}"), "", "",
        ""],
       ["final norm of all non-Q/K weights",
        col(a, "final_other_norm", "{:.2f}"),
        col(s, "final_other_norm", "{:.2f}"), "", "", ""]]))


def mechanism_table(iso: dict, moves: dict, log_every: int) -> str:
  rows = []
  for key, label in (("adamw_over_rsgd", "riemannian_sgd"),
                     ("adamw_over_stiefel", "stiefel_adam")):
    if key in moves:
      m = moves[key]
      rows.append([
          f"per-step Q/K movement, AdamW / {label}, first {m['steps']}"
          f" steps: ratio of window means (per-seed range); per"
          f" {log_every}-step chunk median (range)",
          f"{m['mean']:.1f}x ({m['min']:.1f}–{m['max']:.1f}x);"
          f" {m['chunk_median']:.1f}x"
          f" ({m['chunk_min']:.2g}–{m['chunk_max']:.3g}x)",
          "24–40x (CIFAR, riemannian_sgd)" if label == "riemannian_sgd"
          else "—"])
  rows.append(["Q/K isometry error, AdamW / Stiefel through training"
               " (geometric mean over logged steps, range)",
               f"{iso['geomean']:.3g} ({iso['min']:.3g}–{iso['max']:.3g})",
               "~1e6"])
  rows.append(["Stiefel arm's largest mean isometry error",
               f"{iso['stiefel_max']:.3g}", ""])
  return "\n".join(harness.markdown_table(
      ["mechanism number", "measured", "paper"], "lll", rows))


def long_table(long_runs: dict, target: float, iso: Optional[dict]) -> str:
  rows = []
  for arm, run in long_runs.items():
    h = run["history"]
    hit = steps_to_target(h, target)
    below = (sum(1 for s, a in zip(h["step"], h["val_acc"])
                 if s >= hit and a < 0.9) if hit is not None else None)
    mn = min_after(h, hit)
    after = [i for i, s in enumerate(h["step"]) if hit is not None and s >= hit]
    norms = other_norm_curve(h)
    spread = (f"{norms[after].min():.2f}–{norms[after].max():.2f}"
              if after else "n/a")
    max_loss = (f"{max(h['train_loss'][i] for i in after):.2g}"
                if after else "n/a")
    rows.append([f"{arm} (seed {run['seed']})", h["step"][-1],
                 f"{h['val_acc'][-1]:.4f}", f"{max(h['val_acc']):.4f}",
                 "n/a" if mn is None else f"{mn:.4f}",
                 "n/a" if below is None else below, max_loss, spread,
                 f"{norms[-1]:.2f}"])
  lines = harness.markdown_table(
      ["long run (one seed)", "steps", "final val acc", "max val acc",
       f"min val acc after {int(round(100 * target))}%",
       "logged steps below 90% after it", "max train loss after it",
       "non-Q/K norm min–max after it", "final non-Q/K norm"], "l" * 9, rows)
  if iso is not None:
    lines.append(f"\nIsometry error ratio AdamW / Stiefel over the long run:"
                 f" geometric mean {iso['geomean']:.3g}, range"
                 f" {iso['min']:.3g}–{iso['max']:.3g}.")
  return "\n".join(lines)


def plot_runs(runs: dict, path: Path, title: str) -> None:
  """Validation accuracy, Q/K isometry error and non-Q/K weight norm
  against step, every seed of both arms."""
  plt = harness.pyplot()
  colors = {"adamw": "tab:red", "stiefel": "tab:blue"}
  fig, axes = plt.subplots(1, 4, figsize=(20, 4))
  for arm, by_seed in runs.items():
    for i, (seed, r) in enumerate(sorted(by_seed.items())):
      h = r["history"]
      lab = arm if i == 0 else None
      axes[0].plot(h["step"], h["val_acc"], color=colors[arm], alpha=0.7,
                   lw=1, label=lab)
      axes[1].semilogy(h["step"], iso_curve(h), color=colors[arm], alpha=0.7,
                       lw=1, label=lab)
      axes[2].plot(h["step"], other_norm_curve(h), color=colors[arm],
                   alpha=0.7, lw=1, label=lab)
      axes[3].semilogy(h["step"], np.maximum(h["train_loss"], 1e-12),
                       color=colors[arm], alpha=0.7, lw=1, label=lab)
  for ax, ylabel in zip(axes, ("validation accuracy",
                               "Q/K isometry error ||W^T W - I||_F (mean frame)",
                               "norm of non-Q/K weights",
                               "train loss (floored at 1e-12)")):
    ax.set_xlabel("step (full batch = epoch)")
    ax.set_ylabel(ylabel)
    ax.legend()
  fig.suptitle(title)
  harness.save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------
# The study's report and the RESULTS.md section.


def reached_study(study: Study, runs: dict, probe_arm: str) -> Study:
  """The study cut to what the saved runs reached (for a partial report):
  seeds whose both arms reached `steps`, steps cut to the common minimum."""
  def last(arm, seed):
    r = runs[arm].get(seed)
    return r["history"]["step"][-1] if r else 0
  seeds = tuple(s for s in study.seeds
                if all(last(a, s) > 0 for a in study.arms))
  steps = min([min(last(a, s), study.steps) for s in seeds
               for a in study.arms] or [0])
  long_steps = min([last(a, study.long_seed) for a in study.arms] or [0])
  probe = min([last(probe_arm, s) for s in seeds] or [0])
  return dataclasses.replace(study, seeds=seeds, steps=steps,
                             long_steps=long_steps if long_steps > steps else 0,
                             probe_steps=probe)


def long_runs(study: Study, runs: dict) -> dict:
  """The long seed's runs of both arms, cut to a common step."""
  return {arm: truncate(runs[arm][study.long_seed], study.long_steps)
          for arm in study.arms}


def analyse(cfg: Config, study: Study, runs: dict, probe_arm: str) -> dict:
  """Statistics, mechanism numbers and the long run from the raw runs."""
  if not study.seeds or not study.steps:
    raise SystemExit("no seed has saved runs of both arms yet; nothing to"
                     " report.")
  main = {arm: {s: truncate(runs[arm][s], study.steps) for s in study.seeds}
          for arm in study.arms}
  summaries = {arm: {s: run_summary(r, cfg.target_acc) for s, r in by.items()}
               for arm, by in main.items()}
  comp = compare_arms(summaries, study.steps)
  res = dict(summaries=summaries, comparison=comp, verdict=winner(comp),
             isometry_ratio=iso_ratio(list(main["adamw"].values()),
                                      list(main["stiefel"].values())),
             movement=movement_ratios(main, runs[probe_arm], study.probe_steps)
             if study.probe_steps else {})
  if study.long_steps > study.steps:
    longs = long_runs(study, runs)
    res["long"] = dict(
        summaries={a: run_summary(r, cfg.target_acc) for a, r in longs.items()},
        isometry_ratio=iso_ratio([longs["adamw"]], [longs["stiefel"]]))
  return res


def provenance(runs: dict, out: Path) -> dict:
  """Where the runs came from, from the run files alone: summed training
  time, the machines and the commands that trained them (earliest start of
  each), and the command that regenerates this report."""
  recs = [r for by in runs.values() for r in by.values()]
  first = {}
  for e in sorted((e for r in recs for e in r.get("trained_by", [])
                   if e.get("command")), key=lambda e: e["started_utc"]):
    first.setdefault(e["command"], {k: e.get(k) for k in
                                    ("command", "started_utc", "loadavg_start")})
  return dict(
      regenerate=("python -m benchmarks.grokking --report-only --out"
                  f" {harness.portable(out)}"),
      runs=len(recs),
      run_wall_s=sum(r["wall_s"] for r in recs),
      run_cpu_s=sum(r.get("cpu_s", 0.0) for r in recs),
      run_wall_s_each={f"{a}_seed{s}": r["wall_s"]
                       for a, by in runs.items() for s, r in by.items()},
      machines=sorted({harness.machine_line(r["machine"]) for r in recs
                       if r.get("machine")}),
      library_versions=sorted({r["library_version"] for r in recs}),
      trained_by=list(first.values()))


def provenance_text(meta: dict) -> str:
  text = (f"Training: {meta['runs']} run files, {meta['run_wall_s']:.0f} s wall"
          f" and {meta['run_cpu_s']:.0f} s CPU (all threads) summed over the"
          " runs' training (every invocation, resumed ones included);"
          f" stiefel_optax {', '.join(meta['library_versions'])}; machine:"
          f" {'; '.join(meta['machines']) or 'not recorded'}.")
  if meta["trained_by"]:
    text += " Trained by " + "; ".join(
        f"`{e['command']}` (started {e['started_utc']}"
        + (f", load average at start {e['loadavg_start']:.1f}"
           if e.get("loadavg_start") is not None else "") + ")"
        for e in meta["trained_by"]) + "."
  return text + f"\n\nRegenerate: `{meta['regenerate']}`."


def markdown(cfg: Config, study: Study, res: dict, meta: dict,
             notes: str = "") -> str:
  parts = [
      f"Task (a {cfg.op} b) mod {cfg.p}, train fraction {cfg.train_fraction},"
      f" full batch; {cfg.num_layers}-layer transformer d = {cfg.d_model},"
      f" {cfg.num_heads} heads, MLP {cfg.d_mlp}; AdamW lr {cfg.learning_rate}"
      f" (b1 {cfg.b1}, b2 {cfg.b2}), weight decay {cfg.weight_decay};"
      f" Stiefel lr {cfg.stiefel_learning_rate or cfg.learning_rate}, trust"
      f" region {cfg.max_step_norm}; rsgd lr {cfg.rsgd_learning_rate}."
      f" Seeds {list(study.seeds)} x {study.steps} steps"
      + (f"; seed {study.long_seed} continued to {study.long_steps} steps"
         if study.long_steps > study.steps else "") + ".",
      "",
      study_table(res["summaries"], res["comparison"], cfg.target_acc),
      "",
      "**" + res["verdict"] + "**",
      "",
      mechanism_table(res["isometry_ratio"], res["movement"], cfg.log_every),
  ]
  if "long" in res:
    parts += ["", res["long"]["table"]]
  if notes:
    parts += ["", notes]
  parts += ["", provenance_text(meta)]
  return "\n".join(parts)


def report(out: Path, cfg: Config, study: Study, runs: dict, probe_arm: str,
           plots: bool = True) -> dict:
  """results.json, table.md and the plots of `out`, from its saved runs
  (cut to what they reached), its study and its notes.md alone; returns
  dict(meta, results, table, study) (study: the one reported, cut).

  runs: {arm: {seed: record}} of the study's arms and of `probe_arm` (the
  rsgd probe), as saved, partial runs included."""
  study = reached_study(study, runs, probe_arm)
  res = analyse(cfg, study, runs, probe_arm)
  if "long" in res:
    res["long"]["table"] = long_table(long_runs(study, runs), cfg.target_acc,
                                      res["long"]["isometry_ratio"])
  meta = provenance(runs, out)
  table = markdown(cfg, study, res, meta, harness.read_notes(out / "notes.md"))
  harness.write_json(out / "results.json", harness.stated_precision(dict(
      meta=meta, config=cfg.to_dict(),
      study=dataclasses.asdict(study), **res)))
  harness.write_text(out / "table.md", table + "\n")
  if plots:
    main_runs = {a: {s: truncate(runs[a][s], study.steps) for s in study.seeds}
                 for a in study.arms}
    plot_runs(main_runs, out / "study.png",
              f"(a {cfg.op} b) mod {cfg.p}: {len(study.seeds)} seeds per arm")
    if "long" in res:
      plot_runs({a: {study.long_seed: r}
                 for a, r in long_runs(study, runs).items()},
                out / "long_run.png",
                f"long run, seed {study.long_seed}")
  return dict(meta=meta, results=res, table=table, study=study)


def section_text(load: Callable[[Path], tuple], probe_arm: str,
                 template: Path = SECTION_TEMPLATE, plots: bool = True) -> str:
  """The Grokking section of RESULTS.md: the template verbatim, each
  `<!-- report: FOLDER [long] -->` line replaced by that study's report
  (regenerated from its raw runs; `long`: its long-run table only; a
  paired study's folder: `paired_report`'s).

  load: a study folder -> (cfg, study, runs) as `report` takes them (the
  experiment reads its study.json and saved runs)."""
  def study(folder: str, part: str = "all") -> str:
    out = template.parent / folder
    cfg, spec, runs = load(out)
    if getattr(spec, "kind", None) == "paired":
      return paired_report(out, cfg, spec, runs, plots=plots)["table"]
    rep = report(out, cfg, spec, runs, probe_arm, plots=plots)
    return rep["table"] if part == "all" else rep["results"]["long"]["table"]
  return harness.expand(template.read_text(), {"report": study})


def write_section(path: Path, load: Callable[[Path], tuple], probe_arm: str,
                  plots: bool = True) -> None:
  """The Grokking section (`section_text`) into the RESULTS.md at `path`."""
  harness.write_section(path, SECTION, section_text(load, probe_arm,
                                                    plots=plots))


# --------------------------------------------------------------------------
# Paired studies (the shared study, `benchmarks.grokking.study.PairedStudy`):
# per-endpoint paired tables per seed block, Holm across every row of a
# block's endpoints, the claims policy's findings; and, per arm, the slingshot pilot's rules.

LAST_LAYER = "unembed/kernel"   # the unembedding: the pilot's "last layer"

# The endpoints of the paired tables: (key, label, digits, lower is better).
ENDPOINTS = (("steps_to_target", "steps to {pct}% val acc", 0, True),
             ("final_val_acc", "final val acc", 4, False),
             ("min_val_acc_after", "min val acc after first {pct}%", 4,
              False))


class CycleRule(NamedTuple):
  """The slingshot-cycle rule's constants, as the pilot's plan fixes them
  (benchmarks/results/grokking/plan.md: floor 0.5 and rise 1 %, set after
  the d 128 probe, where batch-loss maxima up to 0.42 were noise around a
  grokked model and the last layer's norm grew about 1-2 % per 2,000
  steps).

  ratio, floor: a record is a spike where its largest batch loss exceeds
    both `ratio` times the median of the largest batch losses of the
    `window` records before it and the absolute `floor` (a loss near 0 that
    jumps 10x is no collapse).
  window: the records of the running median, and of the norm's rise.
  rise: the spike must follow a rise of the last layer's norm: at the
    record before the spike that norm is at least (1 + rise) times its
    smallest value over the `window` records before the spike.
  separation: spikes closer than this many steps to the previous spike
    belong to one cycle (a burst of spikes counts once).
  """
  ratio: float = 10.0
  floor: float = 0.5
  window: int = 20
  rise: float = 0.01
  separation: int = 1000


def count_cycles(steps: Sequence[int], loss_max: Sequence[Optional[float]],
                 last_norm: Sequence[float],
                 rule: CycleRule = CycleRule()) -> list:
  """The slingshot cycles of a run's records: the steps at which a cycle's
  spike is counted. A record is a spike when its largest batch loss since
  the previous record (`loss_max`, None where not recorded) is above
  `rule.ratio` x the median over the `rule.window` records before it and
  above `rule.floor`, and the last layer's norm (`last_norm`) rose before
  it (at the record before the spike, >= (1 + rule.rise) x its minimum over
  those records). A spike within `rule.separation` steps of the previous
  spike (counted or not) continues that cycle; any other starts a new one.

  >>> steps = list(range(0, 1300, 100))
  >>> loss = [None] + [0.01] * 5 + [2.0] + [0.01] * 5 + [3.0]
  >>> norm = [1, 1, 1.1, 1.2, 1.3, 1.4, 1.4, 1.4, 1.5, 1.6, 1.7, 1.8, 1.8]
  >>> count_cycles(steps, loss, norm, CycleRule(window=4, separation=300))
  [600, 1200]
  >>> count_cycles(steps, loss, [1.0] * 13, CycleRule(window=4))  # no rise
  []
  """
  cycles, last_spike = [], None
  for i in range(1, len(steps)):
    x = loss_max[i]
    lo = max(0, i - rule.window)
    before = [v for v in loss_max[lo:i] if v is not None]
    if x is None or not before:
      continue
    norms = last_norm[lo:i]
    if not (x > rule.floor and x > rule.ratio * float(np.median(before))
            and norms[-1] >= (1.0 + rule.rise) * min(norms)):
      continue
    if last_spike is None or steps[i] - last_spike >= rule.separation:
      cycles.append(steps[i])
    last_spike = steps[i]
  return cycles


def stability(steps: Sequence[int], val_acc: Sequence[float],
              target: float = 0.95, floor: float = 0.9) -> dict:
  """"Stable grokking": after validation accuracy first reaches `target`,
  it never falls below `floor`. Returns grok_step (the first record at or
  above target; None: never), stable (grokked and never fell), falls (the
  number of separate falls: maximal runs of consecutive records below
  floor after grok_step), deepest (the lowest validation accuracy in a
  fall; None without one), min_after (the lowest from grok_step on) and
  records_below (records below floor after grok_step).

  >>> s = stability([0, 1, 2, 3, 4, 5, 6], [0.1, 0.96, 0.8, 0.95, 0.85,
  ...               0.7, 0.99])
  >>> s["grok_step"], s["stable"], s["falls"], s["deepest"], s["records_below"]
  (1, False, 2, 0.7, 3)
  >>> stability([0, 1], [0.1, 0.5])["grok_step"] is None
  True
  """
  hit = next((i for i, a in enumerate(val_acc) if a >= target), None)
  if hit is None:
    return dict(grok_step=None, stable=False, falls=None, deepest=None,
                min_after=None, records_below=None)
  after = list(val_acc[hit:])
  below = [a < floor for a in after]
  falls = sum(1 for i, b in enumerate(below) if b and (i == 0 or not
                                                       below[i - 1]))
  return dict(grok_step=steps[hit], stable=falls == 0, falls=falls,
              deepest=min(a for a in after if a < floor) if falls else None,
              min_after=min(after), records_below=sum(below))


def last_norm_curve(hist: dict) -> list:
  """The last layer's (the unembedding's) norm at each record."""
  return [r[LAST_LAYER] for r in hist["norms"]]


def pilot_summary(run: dict, target: float, steps: int,
                  rule: CycleRule = CycleRule()) -> dict:
  """One run's paired-study summary: its endpoints (steps to target,
  censored at steps + 1 where never reached; final validation accuracy;
  minimum after the first target), its stability (`stability`), its
  slingshot cycles (`count_cycles`; none in a run without batch-loss
  records) and its Q/K isometry error: the mean frame's over the run
  (geometric mean over records after step 0, maximum) and the largest at
  the records of its cycles (the records at and after each spike)."""
  h = run["history"]
  st = stability(h["step"], h["val_acc"], target)
  loss_max = h.get("batch_loss_max") or [None] * len(h["step"])
  cycles = count_cycles(h["step"], loss_max, last_norm_curve(h), rule)
  iso = np.maximum(iso_curve(h), np.finfo(np.float32).tiny)
  iso_run = iso[1:] if iso.size > 1 else iso     # step 0: the start
  at = [i for i, s in enumerate(h["step"]) for c in cycles
        if s in (c, c + (h["step"][1] - h["step"][0]))]
  return dict(
      arm=run["arm"], seed=run["seed"], steps=h["step"][-1],
      steps_to_target=(steps + 1 if st["grok_step"] is None
                       else st["grok_step"]),
      grokked=st["grok_step"] is not None, final_val_acc=h["val_acc"][-1],
      final_train_acc=h["train_acc"][-1], min_val_acc_after=st["min_after"],
      stable=st["stable"], falls=st["falls"], deepest=st["deepest"],
      records_below=st["records_below"], cycles=cycles,
      iso_geomean=float(np.exp(np.log(iso_run).mean())),
      iso_max=float(iso_run.max()),
      iso_max_at_cycles=float(iso[at].max()) if at else None,
      final_last_norm=float(last_norm_curve(h)[-1]), wall_s=run["wall_s"])


def method_arm(arms: Sequence[str]) -> str:
  """The study's Stiefel arm, which `benchmarks.study.comparison_pairs`
  also sets against every other arm (else the first after the reference)."""
  return next((a for a in ("stiefel", "stiefel_targeted") if a in arms),
              arms[min(1, len(arms) - 1)])


def endpoint_tables(arms: Sequence[str], summaries: dict, block: str,
                    pct: int) -> list:
  """The paired tables of one seed block: per endpoint (`ENDPOINTS`) the
  rows of `stats.comparison_rows` (`benchmarks.study.comparison_pairs`:
  each arm against the reference arms[0], then the Stiefel arm against
  each other). Holm runs across every row of every endpoint of the block
  (the plan's family: a study's comparisons on its three endpoints), so
  a two-arm study's three endpoint rows are adjusted together. The
  minimum after the target pairs only the seeds where both arms reached
  it."""
  method = method_arm(arms)
  pairs = [dict(treatment=t, baseline=b) for t, b in
           study_lib.comparison_pairs(arms, arms[0], method)]
  out = []
  for key, label, digits, lower in ENDPOINTS:
    score = lambda c, role, key=key: {
        s: r[key] for s, r in summaries.get(c[role], {}).items()
        if harness.seed_block(s) == block and r[key] is not None}
    out.append(dict(endpoint=key, label=label.format(pct=pct),
                    digits=digits, rows=stats.comparison_rows(
                        pairs, score, lower_is_better=lower)))
  stats.with_holm([r for table in out for r in table["rows"]])
  return out


def findings(disc: list, conf: list, arms: Sequence[str]) -> list:
  """The claims policy per endpoint (`stats.confirmed`): the confirmation
  rows that are findings."""
  return [dict(endpoint=d["endpoint"], rows=stats.confirmed(
      d["rows"], c["rows"], arms=arms)) for d, c in zip(disc, conf)]


def pilot_table(arms: Sequence[str], summaries: dict) -> list:
  """Per arm and seed: the slingshot cycles, the grokking step, the
  stability figures and the Q/K isometry error (through the collapses)."""
  fmt = lambda x, f="{:.3g}": "n/a" if x is None else f.format(x)
  rows = []
  for arm in arms:
    for seed, r in sorted(summaries.get(arm, {}).items()):
      rows.append([arm, seed, len(r["cycles"]),
                   ", ".join(str(c) for c in r["cycles"][:8])
                   + (" ..." if len(r["cycles"]) > 8 else ""),
                   fmt(r["steps_to_target"] if r["grokked"] else None,
                       "{:.0f}"),
                   "n/a" if not r["grokked"] else
                   ("yes" if r["stable"] else "no"),
                   fmt(r["falls"], "{:d}"), fmt(r["deepest"], "{:.4f}"),
                   f"{r['final_val_acc']:.4f}", fmt(r["iso_geomean"]),
                   fmt(r["iso_max"]), fmt(r["iso_max_at_cycles"]),
                   f"{r['final_last_norm']:.2f}"])
  return harness.markdown_table(
      ["arm", "seed", "cycles", "cycle steps", "grokked at",
       "stable (never < 90% after)", "falls < 90%", "deepest fall",
       "final val acc", "Q/K iso error (geo. mean)", "max", "max at cycles",
       "final last-layer norm"], "lr" + "r" * 11, rows)


def iso_ratios(arms: Sequence[str], summaries: dict) -> list:
  """Per pair of arms (`benchmarks.study.comparison_pairs`, reference
  arms[0]): baseline / treatment of the Q/K isometry error, geometric
  mean over the seeds of each run's geometric mean and of its maximum,
  and per seed both arms ran, the ratio of the runs' geometric means."""
  geo = lambda arm, key: float(np.exp(np.mean(np.log(
      [r[key] for r in summaries[arm].values()]))))
  method = method_arm(arms)
  out = []
  for t, b in study_lib.comparison_pairs(arms, arms[0], method):
    if summaries.get(t) and summaries.get(b):
      seeds = sorted(set(summaries[t]) & set(summaries[b]))
      out.append(dict(treatment=t, baseline=b,
                      geomean=geo(b, "iso_geomean") / geo(t, "iso_geomean"),
                      max=geo(b, "iso_max") / geo(t, "iso_max"),
                      per_seed={str(s): summaries[b][s]["iso_geomean"]
                                / summaries[t][s]["iso_geomean"]
                                for s in seeds}))
  return out


def plot_arms(runs: dict, summaries: dict, path: Path, title: str) -> None:
  """One column per arm, every seed: validation (solid) and training
  (dotted) accuracy, the last layer's norm, the Q/K isometry error (log
  y) and the largest batch loss per record (log y), the counted cycles
  marked, all against step."""
  plt = harness.pyplot()
  arms = [a for a in runs if runs[a]]
  fig, axes = plt.subplots(4, len(arms), figsize=(4.5 * len(arms), 12),
                           squeeze=False, sharex="col", sharey="row")
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for j, arm in enumerate(arms):
    for i, (seed, r) in enumerate(sorted(runs[arm].items())):
      h, c = r["history"], colors[i % len(colors)]
      axes[0, j].plot(h["step"], h["val_acc"], color=c, lw=1,
                      label=f"seed {seed}")
      axes[0, j].plot(h["step"], h["train_acc"], color=c, lw=1, ls=":")
      axes[1, j].plot(h["step"], last_norm_curve(h), color=c, lw=1)
      axes[2, j].semilogy(h["step"], np.maximum(iso_curve(h), 1e-12),
                          color=c, lw=1)
      lm = [(s, v) for s, v in zip(h["step"], h.get("batch_loss_max") or [])
            if v is not None]
      if lm:
        axes[3, j].semilogy(*zip(*lm), color=c, lw=1)
      for cyc in summaries[arm][seed]["cycles"]:
        axes[3, j].axvline(cyc, color=c, lw=0.5, ls="--")
    axes[0, j].set_title(arm)
    axes[0, j].legend(fontsize=7)
    axes[3, j].set_xlabel("step")
  for ax, label in zip(axes[:, 0], (
      "accuracy (val solid, train dotted)", "last-layer (unembedding) norm",
      "Q/K isometry error (mean frame)",
      "largest batch loss per record\n(counted cycles dashed)")):
    ax.set_ylabel(label, fontsize=9)
  fig.suptitle(title)
  harness.save_figure(fig, path, dpi=90)


def paired_markdown(cfg: Config, study: Study, res: dict, meta: dict,
                    notes: str = "") -> str:
  pct = int(round(100 * cfg.target_acc))
  batch = (f"minibatches of {cfg.batch_size} (per-epoch shuffle)"
           if getattr(cfg, "batch_size", 0) else "full batch")
  warm = getattr(cfg, "warmup_steps", 0)
  parts = [
      f"Task (a {cfg.op} b) mod {cfg.p}, train fraction {cfg.train_fraction},"
      f" {batch}; {cfg.num_layers}-layer transformer d = {cfg.d_model},"
      f" {cfg.num_heads} heads, MLP {cfg.d_mlp}; AdamW lr {cfg.learning_rate}"
      f" (b1 {cfg.b1}, b2 {cfg.b2}, eps {getattr(cfg, 'eps', 1e-8):g}"
      + (f", {warm} warmup steps" if warm else "") + f"), weight decay"
      f" {cfg.weight_decay} (where the arm decays); Stiefel lr"
      f" {cfg.stiefel_learning_rate or cfg.learning_rate}, trust region"
      f" {cfg.max_step_norm}. Arms {', '.join(study.arms)} (reference"
      f" {study.arms[0]}), {study.steps} steps each, at fixed rates (nothing"
      " tuned).",
      "",
      f"Steps to {pct}% are read on the {cfg.log_every}-step logging grid; a"
      f" run that never reaches {pct}% is counted at {study.steps + 1} (the"
      " step budget + 1: censored, so its difference is a lower bound) and"
      " the never-reached runs are counted per arm below. The minimum"
      f" validation accuracy after the first {pct}% pairs only the seeds"
      f" where both arms reached {pct}%. Paired t over seeds"
      " (`benchmarks/stats.py`), Holm across the rows of all three endpoints"
      " of a seed block; a finding"
      " needs Holm p < 0.05 on the confirmation seeds and the same sign on"
      " the discovery seeds (the claims policy).",
  ]
  for block in ("discovery", "confirmation"):
    seeds = sorted({s for by in res["summaries"].values() for s in by
                    if harness.seed_block(s) == block})
    if not seeds:
      continue
    never = ", ".join(
        f"{a} {sum(not r['grokked'] for s, r in res['summaries'][a].items() if harness.seed_block(s) == block)}"
        f"/{sum(harness.seed_block(s) == block for s in res['summaries'][a])}"
        for a in study.arms if res["summaries"].get(a))
    parts += ["", f"**{block.capitalize()} seeds** {harness.format_seeds(seeds)}"
              f" (never reached {pct}%: {never}).", ""]
    for t in res["tables"][block]:
      parts += [f"{t['label']}" + (" (censored)" if t["endpoint"] ==
                                   "steps_to_target" else "") + ":", ""]
      parts += (harness.comparison_lines(t["rows"], t["label"], t["digits"])
                if t["rows"] else ["(no common seeds yet)"]) + [""]
  found = [f"{f['endpoint']}: " + "; ".join(
      harness.finding_text(r, "", 4) for r in f["rows"])
      for f in res["findings"] if f["rows"]]
  if all(harness.seed_block(s) == "discovery" for s in study.seeds):
    none = ("none: no confirmation seeds in this study (a pilot: its numbers"
            " are descriptive, not findings)")
  else:
    none = "none" + ("" if res["complete"] else " (confirmation incomplete)")
  parts += ["Findings (confirmed): " + ("; ".join(found) if found else none)
            + ".", ""]
  parts += ["Per run: slingshot cycles (`count_cycles`: largest batch loss"
            f" > {res['rule']['ratio']:g}x its median over the"
            f" {res['rule']['window']} records before and > "
            f"{res['rule']['floor']:g}, after a last-layer norm rise of"
            f" >= {100 * res['rule']['rise']:g}%, spikes"
            f" {res['rule']['separation']} steps apart), stable grokking"
            f" (`stability`: never below 90% after the first {pct}%) and the"
            " Q/K isometry error ||W^T W - I||_F of the mean head frame (raw"
            " kernels for the unconstrained arms):", ""]
  parts += pilot_table(study.arms, res["summaries"])
  if res["partial"]:
    parts += ["", "Runs in progress, in no table yet: " + ", ".join(
        f"{p['arm']} seed {p['seed']} (step {p['step']})"
        for p in res["partial"]) + "."]
  if res["iso_ratios"]:
    parts += ["", "Q/K isometry error, baseline / treatment: " + "; ".join(
        f"{r['baseline']} / {r['treatment']} {r['geomean']:.3g} (geometric"
        f" means), {r['max']:.3g} (maxima); per seed " + ", ".join(
            f"{s}: {x:.3g}" for s, x in r["per_seed"].items())
        for r in res["iso_ratios"]) + "."]
  if notes:
    parts += ["", notes]
  parts += ["", provenance_text(meta)]
  return "\n".join(parts)


def paired_report(out: Path, cfg: Config, study: Study, runs: dict,
                  plots: bool = True, rule: CycleRule = CycleRule()) -> dict:
  """results.json, table.md and arms.png of a paired study's folder from
  its saved runs (the finished ones, cut to study.steps; those still in
  progress are named, in no table), its study and its notes.md; returns
  dict(meta, results, table, study)."""
  done = lambda r: r["history"]["step"][-1] >= study.steps
  main = {a: {s: truncate(r, study.steps) for s, r in runs.get(a, {}).items()
              if done(r)} for a in study.arms}
  partial = [dict(arm=a, seed=s, step=r["history"]["step"][-1])
             for a in study.arms for s, r in sorted(runs.get(a, {}).items())
             if not done(r)]
  summaries = {a: {s: pilot_summary(r, cfg.target_acc, study.steps, rule)
                   for s, r in by.items()} for a, by in main.items()}
  pct = int(round(100 * cfg.target_acc))
  tables = {b: endpoint_tables(study.arms, summaries, b, pct)
            for b in ("discovery", "confirmation")}
  disc, conf = tables["discovery"], tables["confirmation"]
  res = dict(summaries=summaries, tables=tables, rule=rule._asdict(),
             findings=findings(disc, conf, study.arms),
             # every run counts in steps to target (censored): its
             # tables say whether the confirmation block is complete
             complete=stats.confirmation_complete(
                 disc[0]["rows"], conf[0]["rows"], arms=study.arms),
             iso_ratios=iso_ratios(study.arms, summaries), partial=partial)
  meta = provenance({a: by for a, by in runs.items() if by}, out)
  table = paired_markdown(cfg, study, res, meta,
                          harness.read_notes(out / "notes.md"))
  harness.write_json(out / "results.json", harness.stated_precision(dict(
      meta=meta, config=cfg.to_dict(),
      study=dataclasses.asdict(study), **res)))
  harness.write_text(out / "table.md", table + "\n")
  if plots and any(main.values()):
    plot_arms(main, summaries, out / "arms.png",
              f"(a {cfg.op} b) mod {cfg.p}, train fraction"
              f" {cfg.train_fraction}: every seed, one column per arm")
  return dict(meta=meta, results=res, table=table, study=study)
