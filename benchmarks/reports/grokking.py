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
from typing import Any, Callable, Optional, Sequence

import numpy as np

from benchmarks import harness, stats
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
  harness.write_json(out / "results.json", dict(
      meta=meta, config=dataclasses.asdict(cfg),
      study=dataclasses.asdict(study), **res))
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
  (regenerated from its raw runs; `long`: its long-run table only).

  load: a study folder -> (cfg, study, runs) as `report` takes them (the
  experiment reads its study.json and saved runs)."""
  def study(folder: str, part: str = "all") -> str:
    out = template.parent / folder
    rep = report(out, *load(out), probe_arm, plots=plots)
    return rep["table"] if part == "all" else rep["results"]["long"]["table"]
  return harness.expand(template.read_text(), {"report": study})


def write_section(path: Path, load: Callable[[Path], tuple], probe_arm: str,
                  plots: bool = True) -> None:
  """The Grokking section (`section_text`) into the RESULTS.md at `path`."""
  harness.write_section(path, SECTION, section_text(load, probe_arm,
                                                    plots=plots))
