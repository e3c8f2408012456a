"""The language-model experiment's report: from the saved run records of a
results folder (`benchmarks.lm` writes them: one record per (arm, seed,
configuration), its evaluations and final losses) to the tables of every
run grouped by configuration (nanoGPT's published losses beside ours, each
arm paired against adamw over common seeds, Holm across the report), the
study's report (its tuning grids with their scores and choices, the nanoGPT
reference, the paired discovery and confirmation comparisons and the
findings), the provenance footer, results.json and table.md, and the
generated RESULTS.md section.

The experiment's arms, their own fields and its named settings come in as
an `Experiment`; a study comes in as its Study (read by field) with its
state, the plan read against the finished runs
(`benchmarks.lm.study.study_state`: which runs are each grid point's, each
arm's choice and paired runs).
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from benchmarks import harness, stats, study as study_lib

# `benchmarks.lm`'s Study: a `benchmarks.study.Study` with the LM's base
# configuration, tuning schedule and reference seeds (read by field: a report
# never imports its experiment).
Study = Any

SECTION = "## Language model"
# nanoGPT's published val losses (README) of its character-level Shakespeare
# runs: the small CPU command and the shakespeare_char (GPU) config.
PUBLISHED = {"cpu": 1.88, "gpu": 1.4697}
TOLERANCE = 0.05   # |ours - published| accepted for the reference check
# The fields that make a configuration one of nanoGPT's settings (whatever
# its evaluation cadence).
MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                "dropout", "max_iters", "lr_decay_iters", "warmup_iters",
                "learning_rate", "min_lr", "beta1", "beta2", "weight_decay",
                "grad_clip")
LR_FIELDS = ("learning_rate", "min_lr")
AXIS_LABELS = {"learning_rate": "lr", "weight_decay": "wd",
               "stiefel_learning_rate": "Q/K lr", "max_step_norm": "cap",
               "max_step_ratio": "cap / Q/K lr",
               "rsgd_learning_rate": "Q/K lr",
               "stiefel_muon_learning_rate": "Q/K lr",
               "muon_learning_rate": "Q/K lr"}


class Experiment(NamedTuple):
  """What the report reads of `benchmarks.lm` (passed in: a report never
  imports its experiment).

  arms: every arm, in the tables' order. arm_fields: {arm: the Config
  fields that arm alone reads}. presets: {name: configuration (a dict)} of
  the named settings (those in PUBLISHED are nanoGPT's). own_adamw: the
  arms that tune their own AdamW lr and weight decay. lr_floor: an AdamW
  lr's floor is lr / lr_floor.
  """
  arms: tuple
  arm_fields: Mapping
  presets: Mapping
  own_adamw: tuple
  lr_floor: int


def preset_of(config: Mapping, presets: Mapping) -> Optional[str]:
  """'cpu' / 'gpu' when config is that published AdamW setting (whatever its
  evaluation cadence), else None; presets as `Experiment.presets`."""
  for name, ref in presets.items():
    if name in PUBLISHED and all(config.get(f) == ref[f] for f in MODEL_FIELDS):
      return name
  return None


# --------------------------------------------------------------------------
# Report: every run of a folder, grouped by configuration.


def group_key(rec: dict) -> str:
  return harness.digest([rec["config"], rec["data"]])


def groups(records: Sequence[dict]) -> dict:
  """{key: {"config", "data", "runs": {seed: rec}}} of the finished runs
  whose identity checks, in first-seen order."""
  out = {}
  for r in records:
    if r.get("final") is None or not harness.matches(r):
      continue
    g = out.setdefault(group_key(r), dict(config=r["config"], data=r["data"],
                                          runs={}))
    g["runs"][r["seed"]] = r
  return out


def shared(config: dict, arm_fields: Mapping) -> dict:
  """The configuration without the arm and the arms' own fields
  (arm_fields: {arm: its fields})."""
  own = {f for fs in arm_fields.values() for f in fs}
  return {k: v for k, v in config.items() if k != "arm" and k not in own}


def arm_label(config: dict, arm_fields: Mapping) -> str:
  own = arm_fields.get(config["arm"], ())
  short = {"stiefel_learning_rate": "lr", "max_step_norm": "cap",
           "rsgd_learning_rate": "lr", "stiefel_muon_learning_rate": "lr",
           "muon_learning_rate": "lr"}
  return config["arm"] + "".join(f" {short[f]} {config[f]:g}" for f in own)


def setting(config: dict, presets: Mapping) -> str:
  c = config
  name = preset_of(c, presets)
  return (f"{c['n_layer']}L x {c['n_head']}H x {c['n_embd']}, ctx"
          f" {c['block_size']}, batch {c['batch_size']}, dropout"
          f" {c['dropout']:g}, {c['max_iters']} iters (decay to"
          f" {c['lr_decay_iters']}, warmup {c['warmup_iters']}), eval_iters"
          f" {c['eval_iters']}" + (f"; nanoGPT's {name} config at lr 1e-3"
                                   if name else ""))


def lr_text(c: dict) -> str:
  return f"{c['learning_rate']:g} -> {c['min_lr']:g}"


def mean(xs):
  return float(np.mean(xs)) if len(xs) else float("nan")


def summarize(g: dict, arm_fields: Mapping) -> dict:
  runs = [g["runs"][s] for s in sorted(g["runs"])]
  f = lambda k: [r["final"][k] for r in runs]
  return dict(arm=arm_label(g["config"], arm_fields),
              seeds=sorted(g["runs"]),
              train_loss=mean(f("train_loss")), val_loss=mean(f("val_loss")),
              val_loss_full=mean(f("val_loss_full")),
              best_val_loss=mean([min(r["history"]["val_loss"]) for r in runs]),
              val_loss_full_sd=float(np.std(f("val_loss_full"), ddof=1))
              if len(runs) > 1 else float("nan"),
              qk_iso=mean(f("qk_iso")), wall_s=mean([r["wall_s"] for r in runs]),
              n_params=runs[0]["n_params"])


def comparisons(gs: dict, arm_fields: Mapping) -> list:
  """Each non-adamw group against every adamw group of the same shared
  configuration up to the learning rate (AdamW's lr and floor; the arm's
  Euclidean group keeps its own), paired over their common seeds
  (val_loss_full, arm - adamw: negative favours the arm), Holm-adjusted
  across the list."""
  drop = lambda c: {k: v for k, v in shared(c, arm_fields).items()
                    if k not in LR_FIELDS}
  pairs = []
  for key, g in gs.items():
    if g["config"]["arm"] == "adamw":
      continue
    for bkey, base in gs.items():
      if (base["config"]["arm"] != "adamw" or base["data"] != g["data"]
          or drop(base["config"]) != drop(g["config"])
          or len(set(g["runs"]) & set(base["runs"])) < 2):
        continue
      bc = base["config"]
      pairs.append(dict(
          treatment=arm_label(g["config"], arm_fields),
          baseline=f"adamw lr {bc['learning_rate']:g}", group=key,
          base_group=bkey,
          same_lr=bc["learning_rate"] == g["config"]["learning_rate"]))
  group = {"treatment": "group", "baseline": "base_group"}
  rows = stats.comparison_rows(
      pairs, lambda c, role: {s: r["final"]["val_loss_full"] for s, r in
                              gs[c[group[role]]]["runs"].items()},
      lower_is_better=True)
  for r in rows:
    r["blocks"] = sorted({harness.seed_block(s) for s in r["seeds"]})
  return rows


def reference_checks(gs: dict, experiment: Experiment) -> list:
  """Each adamw group at a published setting: ours against nanoGPT's."""
  out = []
  for g in gs.values():
    name = preset_of(g["config"], experiment.presets)
    if g["config"]["arm"] != "adamw" or name is None:
      continue
    s = summarize(g, experiment.arm_fields)
    best = s["best_val_loss"]
    per_seed = {sd: min(r["history"]["val_loss"])
                for sd, r in sorted(g["runs"].items())}
    out.append(dict(preset=name, published=PUBLISHED[name], seeds=s["seeds"],
                    best_val_loss_per_seed=per_seed,
                    val_loss=s["val_loss"], best_val_loss=best,
                    val_loss_full=s["val_loss_full"],
                    train_loss=s["train_loss"], wall_s=s["wall_s"],
                    diff=best - PUBLISHED[name],
                    within=abs(best - PUBLISHED[name]) <= TOLERANCE))
  return out


def setting_tables(gs: dict, refs: list, comps: list,
                   experiment: Experiment) -> list:
  """The lines of the reference check (refs), then one table of runs per
  setting with its paired comparisons (comps)."""
  lines = []
  if refs:
    lines += ["External reference (nanoGPT README, AdamW). Ours: nanoGPT's"
              " estimate_loss (the same estimator and eval_iters) at the"
              " last step and its best over the evaluations (what nanoGPT's"
              " best_val_loss tracks; the difference is taken from it), the"
              " loss over the whole validation split, and the train"
              " estimate at the last step:", ""]
    lines += harness.markdown_table(
        ["setting", "seeds", "published val", "our val, last", "our val, best",
         "best, per seed", "our val, whole split", "our train", "difference",
         f"within {TOLERANCE:g}", "wall s/run"], "llrrrlrrrlr",
        [[f"nanoGPT {r['preset']}", harness.format_seeds(r["seeds"]),
          f"{r['published']:.4g}", f"{r['val_loss']:.4f}",
          f"{r['best_val_loss']:.4f}",
          ", ".join(f"{v:.4f}" for v in r["best_val_loss_per_seed"].values()),
          f"{r['val_loss_full']:.4f}", f"{r['train_loss']:.4f}",
          f"{r['diff']:+.4f}", "yes" if r["within"] else "no",
          f"{r['wall_s']:.0f}"] for r in refs])
    lines.append("")
  # One table per setting (the configuration up to the arm and the
  # learning rate); rows by arm, lr, the arm's own fields.
  arm_fields = experiment.arm_fields
  without_lr = lambda c: {k: v for k, v in shared(c, arm_fields).items()
                          if k not in LR_FIELDS}
  by_setting = {}
  for key, g in gs.items():
    by_setting.setdefault(harness.digest([without_lr(g["config"]),
                                          g["data"]]), []).append(key)

  def order(key):
    c = gs[key]["config"]
    return (experiment.arms.index(c["arm"]), c["learning_rate"],
            tuple(c[f] for f in arm_fields.get(c["arm"], ())))

  def setting_order(keys_):
    c = gs[keys_[0]]["config"]
    return (preset_of(c, experiment.presets) is None, -c["max_iters"])

  for keys_ in sorted(by_setting.values(), key=setting_order):
    keys_ = sorted(keys_, key=order)
    cfg0 = gs[keys_[0]]["config"]
    rows = []
    for key in keys_:
      s = summarize(gs[key], arm_fields)
      sd = (f"{s['val_loss_full_sd']:.4f}"
            if np.isfinite(s["val_loss_full_sd"]) else "")
      rows.append([s["arm"], lr_text(gs[key]["config"]),
                   harness.format_seeds(s["seeds"]), f"{s['train_loss']:.4f}",
                   f"{s['val_loss']:.4f}", f"{s['val_loss_full']:.4f}", sd,
                   f"{s['qk_iso']:.2g}", f"{s['wall_s']:.0f}"])
    title = f"Setting: {setting(cfg0, experiment.presets)}."
    lines += [title, ""] + harness.markdown_table(
        ["arm", "lr (non-Q/K)", "seeds", "train loss", "val loss (estimate)",
         "val loss, whole split", "sd", "Q/K isometry error", "wall s/run"],
        "lllrrrrrr", rows)
    here = [c for c in comps if c["group"] in keys_]
    if here:
      lines += ["", "Paired against adamw (val loss over the whole"
                " validation split, arm - adamw; negative favours the arm;"
                " each arm against every adamw lr run on the same seeds;"
                " Holm across every comparison of this report):", ""]
      lines += harness.markdown_table(
          ["arm", "baseline", "seeds", "block", "difference [95% CI]", "wins",
           "t", "p", "p (Holm)"], "lllllrrrr",
          [[c["treatment"], c["baseline"], harness.format_seeds(c["seeds"]),
            "+".join(c["blocks"]), harness.fmt_diff(c, 4),
            f"{c['wins']}/{c['n']}", harness.fmt_t(c["t"]),
            harness.fmt_p(c["p"]), harness.fmt_p(c["p_holm"])] for c in here])
    lines.append("")
  return lines


def footer(meta: dict) -> list:
  """The lines saying what trained the runs, where, and how to regenerate."""
  lines = [
      f"Training: {meta['runs']} runs, {meta['run_wall_s']:.0f} s wall and"
      f" {meta['run_cpu_s']:.0f} s CPU summed; stiefel_optax"
      f" {', '.join(meta['library_versions'])}; corpus"
      f" {', '.join(meta['data'])}; machine:"
      f" {'; '.join(meta['machines']) or 'not recorded'}."]
  if meta["commands"]:
    lines += ["", "Trained by: " + "; ".join(f"`{c}`" for c in
                                            meta["commands"]) + "."]
  lines += ["", f"Regenerate: `{meta['regenerate']}` (with `--results-md"
            " benchmarks/RESULTS.md`, also this section of RESULTS.md)."]
  return lines


def markdown(gs: dict, refs: list, comps: list, meta: dict,
             experiment: Experiment, notes: str = "") -> str:
  lines = setting_tables(gs, refs, comps, experiment)
  if notes:
    lines += [notes, ""]
  return "\n".join(lines + footer(meta)).rstrip("\n") + "\n"


# --------------------------------------------------------------------------
# The study's report: tuning grids with their scores, chosen points and the
# paired comparisons, from the study's state (its plan read against the
# finished runs of any library version).


def hp_text(point: Mapping) -> str:
  return ", ".join(f"{AXIS_LABELS.get(k, k)} {v:g}" for k, v in point.items())


def tuning_summary(study: Study, arm: str, grid: Optional[Mapping]) -> dict:
  """The arm's grid, every point's runs and mean scores, and its choice,
  from its tuning as the plan reads it (`benchmarks.study.tuning_runs`; None
  while it waits on adamw's tuning)."""
  if grid is None:
    return dict(arm=arm, status="waits for adamw's tuning", base=None,
                axes=None, points=[], chosen=None, widenings=0, runs=0)
  points = []
  for p, recs in grid["points"]:
    points.append(dict(
        point=p, seeds=sorted(recs),
        val_loss_full={s: r["final"]["val_loss_full"] for s, r in recs.items()},
        val=mean([r["final"]["val_loss_full"] for r in recs.values()]),
        train=mean([r["final"]["train_loss"] for r in recs.values()]),
        wall_s=sum(r["wall_s"] for r in recs.values())))
  runs = sum(len(p["seeds"]) for p in points)
  status = ("finished" if grid["finished"] else
            f"{runs} of {len(points) * len(study.tune_seeds)} runs")
  if grid["on_edge"]:
    status += f" (best on an edge after {grid['widenings']} widening(s))"
  return dict(arm=arm, status=status, base=grid["base"],
              axes=[[n, list(v)] for n, v in grid["axes"]], points=points,
              chosen=grid["chosen"], widenings=grid["widenings"], runs=runs)


def comparison_table(study: Study, runs: Mapping, block: str) -> list:
  """`stats.comparison_rows` of whole-split validation loss (treatment -
  baseline, negative favours the treatment) over the seeds of `block` both
  arms have, with their train losses; Holm-adjusted across the table."""
  pick = lambda arm, key: {s: r["final"][key]
                           for s, r in runs.get(arm, {}).items()
                           if harness.seed_block(s) == block}
  return stats.comparison_rows(
      [dict(treatment=t, baseline=b)
       for t, b in study_lib.comparison_pairs(study.names)],
      lambda c, role: pick(c[role], "val_loss_full"),
      lambda c, role: pick(c[role], "train_loss"), lower_is_better=True)


def baseline_checks(paired: Mapping, other: Mapping) -> list:
  """How the study's rows move with its AdamW choice: for each adamw group
  outside the plan (`other`, as `groups` gives) that differs from the
  study's adamw runs only in lr, floor and weight decay (its setting),
  under the same numerics version, every study arm's paired runs
  (`paired`: {arm: {seed: rec}}) minus that group's, then each arm's runs
  outside the plan at its study configuration but with that setting for
  its AdamW, per seed block, Holm across each block's rows. Sensitivity,
  never findings: the study's own tables are its Holm family."""
  ref = next(iter(paired.get("adamw", {}).values()), None)
  if ref is None:
    return []
  free = LR_FIELDS + ("weight_decay",)
  fixed = lambda c: {k: v for k, v in c.items() if k not in free}
  version = harness.recorded_version(ref)

  def moved(arm: str, setting: Mapping) -> list:
    """The groups of `other` that are arm's study runs moved to setting."""
    study_config = next(iter(paired[arm].values()))["config"]
    return [{sd: r for sd, r in g["runs"].items()
             if harness.recorded_version(r) == version}
            for g in other.values()
            if g["config"]["arm"] == arm and g["data"] == ref["data"]
            and fixed(g["config"]) == fixed(study_config)
            and all(g["config"][k] == setting[k] for k in free)]

  out = []
  for c in (g["config"] for g in other.values()
            if g["config"]["arm"] == "adamw" and g["data"] == ref["data"]):
    base = next(iter(moved("adamw", c)), None)   # this group, if it moved
    if base is None:
      continue
    setting = f"lr {c['learning_rate']:g}, wd {c['weight_decay']:g}"
    arms = dict(paired)
    for a in paired:
      if a != "adamw":
        for runs in moved(a, c):
          arms[f"{a}, AdamW at {setting}"] = runs
    for block in ("discovery", "confirmation"):
      pick = lambda runs, key: {sd: r["final"][key] for sd, r in runs.items()
                                if harness.seed_block(sd) == block}
      runs_of = lambda cmp, role: (arms[cmp["treatment"]]
                                   if role == "treatment" else base)
      rows = stats.comparison_rows(
          [dict(treatment=a, baseline=f"adamw {setting}") for a in arms],
          lambda cmp, role: pick(runs_of(cmp, role), "val_loss_full"),
          lambda cmp, role: pick(runs_of(cmp, role), "train_loss"),
          lower_is_better=True)
      if rows:
        out.append(dict(baseline=f"adamw {setting}", config=c, block=block,
                        rows=rows))
  return out


def baseline_check_lines(checks: Sequence[Mapping]) -> list:
  """The tables of `baseline_checks`."""
  if not checks:
    return []
  lines = ["Sensitivity to the AdamW choice (not in the study's plan; not"
           " findings): each arm's paired runs against AdamW at another"
           " setting run in this folder at the study's configuration, and"
           " the arms run with that setting for their own AdamW weights"
           " (rows named \"arm, AdamW at ...\"), per seed block, Holm"
           " across each table's rows.", ""]
  for ch in checks:
    lines += [f"Against {ch['baseline']} (floor"
              f" {ch['config']['min_lr']:g}), {ch['block']} seeds:", ""]
    lines += harness.comparison_lines(ch["rows"], "val", 4, 4) + [""]
  return lines


def study_summary(study: Study, state: Mapping) -> dict:
  """Everything the study's report says, from the study's state
  (`benchmarks.lm.study.study_state`: the plan read against the finished
  runs)."""
  tunings = {a: tuning_summary(study, a, state["tuning"][a])
             for a in study.names}
  runs, ref = state["paired"], state["reference"]
  disc, conf = (comparison_table(study, runs, b)
                for b in ("discovery", "confirmation"))
  planned, left = state["planned"], state["left"]
  arms = {}
  for a in study.names:
    c = state["choices"][a]
    arms[a] = dict(chosen=None if c is None else c[0],
                   base=None if c is None else c[1],
                   seeds=sorted(runs[a]), planned_seeds=list(study.seeds(a)))
  return dict(
      data=state["data"], tuning=tunings, arms=arms,
      reference=dict(seeds=sorted(ref), runs=ref),
      discovery=disc, confirmation=conf,
      findings=stats.confirmed(disc, conf, arms=study.names),
      done=len(planned) - len(left), planned=len(planned),
      next=None if not left else f"{left[0].stage} {left[0].arm}",
      complete=not left and len(planned) > len(study.reference_seeds)
      and all(t["status"].startswith("finished") for t in tunings.values()))


def fmt_loss(x) -> str:
  return "" if not np.isfinite(x) else f"{x:.4f}"


def study_setting(study: Study) -> str:
  c = study.base
  return (f"{c.n_layer}L x {c.n_head}H x {c.n_embd}, ctx {c.block_size},"
          f" batch {c.batch_size}, dropout {c.dropout:g},"
          f" {c.max_iters} iterations (decay to {c.lr_decay_iters}, warmup"
          f" {c.warmup_iters}), eval_iters {c.eval_iters}")


def grid_density(study: Study) -> str:
  """What the starting grids have in common (fair tuning: the same number
  of points per hyperparameter for every arm)."""
  sizes = sorted({len(v) for a in study.arms for _, v in a.axes})
  if len(sizes) == 1:
    return (f"every arm's grid starts at {sizes[0]} points per"
            " hyperparameter, half a decade apart")
  return ("the starting grids are toy grids of "
          + " to ".join(str(n) for n in (sizes[0], sizes[-1]))
          + " points per hyperparameter")


def study_markdown(study: Study, s: dict, reference: Mapping,
                   experiment: Experiment) -> list:
  """The lines of the study's report (s: `study_summary`; reference: the
  nanoGPT reference's configuration)."""
  seeds = harness.format_seeds
  lines = [
      f"**Study** (fair tuning on validation, then paired seeds) at"
      f" {study_setting(study)}: {s['done']} of the {s['planned']} runs"
      " planned so far are done (the plan grows as tuning grids widen and"
      " choices are made)" + (f"; next: {s['next']}" if s["next"] else "")
      + ".", ""]
  if s["findings"]:
    lines += ["Findings (confirmed under the claims policy: Holm p < 0.05 on"
              " the confirmation seeds, the same sign as on discovery;"
              " differences in whole-split validation loss):", ""]
    lines += [f"- {harness.finding_text(r, '', 4)}"
              for r in s["findings"]]
  else:
    lines.append("Findings: none" + ("." if s["complete"] else
                                     " yet (the study is unfinished)."))
  lines.append("")
  # The reference: nanoGPT's recipe as published, its own record.
  ref = s["reference"]
  rc = reference
  if ref["seeds"]:
    runs = [ref["runs"][sd] for sd in ref["seeds"]]
    pub = PUBLISHED.get(preset_of(rc, experiment.presets))
    best = mean([min(r["history"]["val_loss"]) for r in runs])
    lines += [
        "nanoGPT reference (AdamW at nanoGPT's published settings, lr"
        f" {rc['learning_rate']:g} -> {rc['min_lr']:g}, weight decay"
        f" {rc['weight_decay']:g}; its own record, not the tuned adamw):", ""]
    final = lambda k: f"{mean([r['final'][k] for r in runs]):.4f}"
    lines += harness.markdown_table(
        ["seeds", "published val", "val, last", "val, best",
         "val, whole split", "train", "difference", "wall s/run"], "lrrrrrrr",
        [[seeds(ref["seeds"]), "" if pub is None else f"{pub:.4g}",
          final("val_loss"), f"{best:.4f}", final("val_loss_full"),
          final("train_loss"), "" if pub is None else f"{best - pub:+.4f}",
          f"{mean([r['wall_s'] for r in runs]):.0f}"]]) + [""]
  lines += [
      f"Tuning on validation: {study.tune_iters} iterations (decay to"
      f" {study.tune_iters}, warmup {study.base.warmup_iters}), tuning seeds"
      f" {seeds(study.tune_seeds)}; a point's score is the mean over the"
      " tuning seeds of the whole-split validation loss (lower is better);"
      f" {grid_density(study)}, widened geometrically past an edge its best"
      f" point lands on (at most {study.max_extensions} widening(s)); an"
      f" AdamW lr brings its floor lr / {experiment.lr_floor}. The non-Q/K"
      " weights of every arm but the AdamW recipes (adamw, qk_norm,"
      " orthogonal_init) train with adamw's chosen lr and weight decay.", ""]
  rows = []
  for a in study.names:
    t = s["tuning"][a]
    grid = ("" if t["axes"] is None else " x ".join(
        f"{AXIS_LABELS.get(n, n)} {{{', '.join(f'{v:g}' for v in vals)}}}"
        for n, vals in t["axes"]))
    nonqk = ("own" if a in experiment.own_adamw else
             "" if t["base"] is None else hp_text(t["base"]))
    chosen = "" if t["chosen"] is None else hp_text(t["chosen"])
    rows.append([a, chosen, nonqk, grid, t["runs"], t["status"]])
  lines += harness.markdown_table(
      ["arm", "chosen", "non-Q/K AdamW", "grid", "tuning runs", "status"],
      "llllrl", rows) + [""]
  for a in study.names:
    t = s["tuning"][a]
    if not t["runs"]:
      continue
    names = [n for n, _ in t["axes"]]
    lines += [f"Tuning grid of {a}:", ""] + harness.markdown_table(
        [AXIS_LABELS.get(n, n) for n in names]
        + ["val loss per tuning seed", "mean val loss", "mean train loss", ""],
        "r" * len(names) + "lrrl",
        [[f"{p['point'][n]:g}" for n in names]
         + [", ".join(f"{p['val_loss_full'][sd]:.4f}" for sd in p["seeds"]),
            fmt_loss(p["val"]), fmt_loss(p["train"]),
            "chosen" if p["point"] == t["chosen"] else ""]
         for p in t["points"]]) + [""]
  lines += [
      f"Paired runs at {study_setting(study)}, each arm at its chosen point"
      " (the same data, batches, evaluation batches and initial weights"
      " outside Q/K per seed). Seeds planned: "
      + "; ".join(f"{a} {seeds(study.seeds(a))}" for a in study.names)
      + ". Done: " + "; ".join(
          f"{a} {seeds(s['arms'][a]['seeds']) or 'none'}" for a in study.names)
      + ".", "",
      "Each row: treatment - baseline in validation loss over the whole"
      " split (negative favours the treatment), its 95% CI, paired t and p,"
      " Holm-adjusted p across the rows of the table, and the seeds the"
      " treatment wins; mean validation loss of each arm with its train loss"
      " (nanoGPT's estimate at the last step) in brackets.", ""]
  for block in ("discovery", "confirmation"):
    rows = s[block]
    lines.append(f"{block.capitalize()} seeds:")
    lines.append("")
    if not rows:
      lines += ["(no paired runs yet)", ""]
      continue
    lines += harness.comparison_lines(rows, "val", 4, 4) + [""]
  return lines


# --------------------------------------------------------------------------
# The folder's report and its RESULTS.md section.


def report(out: pathlib.Path, records: Sequence[dict], experiment: Experiment,
           study: Optional[str] = None, spec: Optional[Study] = None,
           state: Optional[Mapping] = None) -> dict:
  """results.json and table.md of `out` from its saved runs (`records`, as
  `harness.RunStore(out).records()` reads them) and notes.md; returns
  dict(table, references, comparisons, meta) and, for a study, its summary.

  study (a key of `benchmarks.lm.study.STUDIES`), with spec (that Study)
  and state (`benchmarks.lm.study.study_state` of these records): the
  study's report first (its tuning, choices, paired comparisons and
  findings), then the tables of the folder's runs outside the study's
  plan, without their ad hoc comparisons (the study's tables are the only
  Holm family)."""
  gs = groups(records)
  if not gs:
    raise SystemExit(f"{harness.portable(out)}: no finished runs to report.")
  done = [r for g in gs.values() for r in g["runs"].values()]
  cmds = []
  for e in sorted((e for r in done for e in r["trained_by"] if e["command"]),
                  key=lambda e: e["started_utc"]):
    if e["command"] not in cmds:
      cmds.append(e["command"])
  flags = "" if study is None else " --study" + (
      "" if study == "full" else f" --{study}")
  meta = dict(
      runs=len(done), run_wall_s=sum(r["wall_s"] for r in done),
      run_cpu_s=sum(r["cpu_s"] for r in done),
      library_versions=sorted({r["library_version"] for r in done}),
      data=sorted({r["data"] for r in done}),
      machines=sorted({harness.machine_line(r["machine"]) for r in done}),
      commands=cmds,
      regenerate=f"python -m benchmarks.lm{flags} --report-only --out"
                 f" {harness.portable(out)}")
  notes = harness.read_notes(out / "notes.md")
  if study is None:
    refs, comps = (reference_checks(gs, experiment),
                   comparisons(gs, experiment.arm_fields))
    table = markdown(gs, refs, comps, meta, experiment, notes)
    extra = {}
  else:
    summary = study_summary(spec, state)
    other = groups([r for r in records if r["name"] not in state["planned"]])
    refs, comps = [], []
    lines = study_markdown(spec, summary, state["reference_config"],
                           experiment)
    checks = baseline_checks(state["paired"], other)
    lines += baseline_check_lines(checks)
    if other:
      lines += ["The other runs in this folder (not in the study's plan;"
                " no comparisons beyond the sensitivity tables above):", ""]
      lines += setting_tables(other, [], [], experiment)
    if notes:
      lines += [notes, ""]
    table = "\n".join(lines + footer(meta)).rstrip("\n") + "\n"
    # The reference's records reduce to their names (the runs are saved).
    summary["reference"]["runs"] = {sd: r["name"] for sd, r in
                                    summary["reference"]["runs"].items()}
    extra = dict(study=dict(name=study, **summary,
                            baseline_checks=[{k: v for k, v in ch.items()
                                              if k != "config"}
                                             for ch in checks]))
  harness.write_json(out / "results.json", dict(
      meta=meta, references=refs, comparisons=comps,
      groups={k: dict(config=g["config"], data=g["data"],
                      **summarize(g, experiment.arm_fields))
              for k, g in gs.items()}, **extra), indent=1)
  harness.write_text(out / "table.md", table)
  return dict(table=table, references=refs, comparisons=comps, meta=meta,
              **extra)


def write_section(path: pathlib.Path, rep: dict) -> None:
  """Rewrites the language model's section (SECTION) of the RESULTS.md at
  `path` with the table of a report (`report`'s return value)."""
  harness.write_section(path, SECTION, f"{SECTION}\n\n{rep['table']}")
