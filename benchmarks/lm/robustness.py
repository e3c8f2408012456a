"""The learning-rate sweep of issue 30 (`--robustness`), as its plan fixes
it (benchmarks/results/lm/robustness_plan.md): every arm on one shared
x-axis, the base learning rate eta of its AdamW-trained weights, its other
rates moving with eta by the ratio its study tuning chose; the full
2,000-iteration schedule; three tuning seeds per point, seed-major; a run
that diverges is stopped, kept and counted at its initial loss. The sweep
itself (grid and extension, seed-major order, what is left, worker shares,
the runner) is `benchmarks.sweep`'s; here its LM side: the sweep (`Sweep`,
its presets `SWEEPS`), each point's configuration and run name, the
claims' runs after the sweep, and what the sweep's command
(`benchmarks.sweep.main`) is handed (`SWEEP_EXPERIMENT`): the runs' training
(`prepare`) and the report (`robustness_report`:
`benchmarks.reports.robustness`).

>>> c = sweep_config(SWEEP, "stiefel", 1e-3)
>>> c.learning_rate, c.min_lr, c.stiefel_learning_rate, c.max_step_norm
(0.001, 0.0001, 0.03, 0.009)
>>> grid(SWEEP, {}) == SWEEP.grid      # no extension before AdamW's top run
True
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Mapping, Optional

from benchmarks import harness, sweep as sweep_lib
from benchmarks.lm.arms import BOUND_ARMS
from benchmarks.lm.config import CPU, QUICK, Config, run_name
from benchmarks.lm.data import default_data, load_corpus
from benchmarks.lm.study import REFERENCE_DIR, point_config, study_data
from benchmarks.lm.timing import iteration_rates, run_seconds
from benchmarks.lm.train import STEPPED, train_run
from benchmarks.reports import bound as bound_lib
from benchmarks.reports import robustness as report_lib
from benchmarks.reports import width as width_lib

SECTION = "## Learning-rate robustness (language model)"
# What the report reads of a run: its whole-split validation loss.
LOSS_KEY = "val_loss_full"


@dataclasses.dataclass(frozen=True)
class Sweep(sweep_lib.Sweep):
  """`benchmarks.sweep.Sweep` (arms, grid, extension, ratios {arm: {Config
  field: multiple of eta}}, seeds; below, reuse) with cap_ratio (stiefel:
  max_step_norm = cap_ratio x its Q/K lr), base (the configuration, its
  schedule the runs'), the claims' seeds, the claim tables whose runs
  follow the sweep (`claims`, in the order they are run: "best", every
  arm at its own best sweep point; "high", every arm at `eta_high`),
  `trend` (the name in SWEEPS of a smaller width's sweep whose runs at its
  own eta_high, on the claims' seeds, are run here after this sweep's
  claims of each stage: the other width's terms of the trend claim), and
  the plan and heading its report names; `bootstrap`: the claims tables
  carry a percentile bootstrap interval beside the t-interval;
  `last_after` (a sweep's name in SWEEPS and its folder under
  benchmarks/results): the tables marked `last` start only once that
  sweep is complete (the plan's order, kept by the workers too)."""
  cap_ratio: float
  base: Config
  claim_seeds: Mapping = dataclasses.field(default_factory=lambda: {
      "discovery": harness.DISCOVERY_SEEDS[:8],
      "confirmation": harness.CONFIRMATION_SEEDS[:8]})
  claims: tuple = ("best", "high")
  trend: Optional[str] = None
  plan: str = "benchmarks/results/lm/robustness_plan.md"
  heading: str = SECTION
  bootstrap: bool = False
  last_after: Optional[tuple] = None


# The study's choices against adamw's lr 1e-2 (results/lm/results.json
# study/tuning/*/chosen): stiefel 0.3 with cap 0.3 x 0.3, rsgd 10,
# stiefel_muon 0.01, muon 0.01; weight decay 0.03 for every AdamW recipe.
RATIOS = {"stiefel": {"stiefel_learning_rate": 30.0},
          "rsgd": {"rsgd_learning_rate": 1000.0},
          "stiefel_muon": {"stiefel_muon_learning_rate": 1.0},
          "muon": {"muon_learning_rate": 1.0}}
SWEEP = Sweep(
    arms=("adamw", "stiefel", "rsgd", "stiefel_muon", "qk_norm", "qk_clip"),
    grid=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
    extension=(3.0, 10.0), ratios=RATIOS, cap_ratio=0.3,
    seeds=(100, 101, 102), base=dataclasses.replace(CPU, weight_decay=0.03),
    loss_key=LOSS_KEY)
# The same path at toy size (`--robustness --quick`, well under a minute):
# at eta 3 and 30 the toy AdamW diverges.
QUICK_SWEEP = Sweep(
    arms=("adamw", "stiefel", "qk_clip"), grid=(1e-2, 3.0),
    extension=(30.0,), ratios=RATIOS, cap_ratio=0.3, seeds=(100,),
    claim_seeds={"discovery": (0, 1), "confirmation": (500, 501)},
    base=dataclasses.replace(QUICK, n_layer=1, n_embd=8, block_size=8,
                             max_iters=20, lr_decay_iters=20,
                             eval_interval=10, eval_iters=2),
    loss_key=LOSS_KEY)

# The sweep across widths (issue 43), as benchmarks/results/lm/width_plan.md
# fixes it: d 64, 128 and 256 at head_dim 32 (n_head = d / 32), the four
# arms; d 64 the committed sweep's grid, seeds and rules with only the
# width changed (its runs named as `--robustness --arms ... --set n_embd=64
# --set n_head=2` names them); d 128 the committed sweep's runs
# (benchmarks/results/lm_robustness, read, never written); d 256 the
# trimmed grid 1e-3 - 1, two tuning seeds, the downward point 3e-4, then
# the claims (b) and (a) and the d 64 terms of (c) at eta_high(64),
# discovery seeds 0-3 before confirmation seeds 500-504.
WIDTH_ARMS = ("adamw", "stiefel", "stiefel_muon", "qk_norm")
WIDTH_PLAN = "benchmarks/results/lm/width_plan.md"
WIDTH_CLAIM_SEEDS = {"discovery": harness.DISCOVERY_SEEDS[:4],
                     "confirmation": harness.CONFIRMATION_SEEDS[:5]}
# Where each width's runs are committed (under benchmarks/results).
WIDTH_FOLDERS = {64: "lm_width/d64", 128: "lm_robustness",
                 256: "lm_width/d256"}


def width_heading(d: int) -> str:
  return f"## Learning-rate robustness across width: d {d} (language model)"


def at_width(d: int, **changes) -> Sweep:
  """The committed sweep on the four arms at width d (head_dim 32)."""
  return dataclasses.replace(SWEEP, **{
      "arms": WIDTH_ARMS, "claims": (), "plan": WIDTH_PLAN,
      "heading": width_heading(d),
      "base": dataclasses.replace(SWEEP.base, n_embd=d, n_head=d // 32),
      **changes})


SWEEPS = {"full": SWEEP, "quick": QUICK_SWEEP,
          "width64": at_width(64),
          "width128": at_width(128, reuse=(WIDTH_FOLDERS[128],)),
          "width256": at_width(
              256, grid=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
              seeds=(100, 101), below=(3e-4,), claims=("high", "best"),
              claim_seeds=WIDTH_CLAIM_SEEDS, trend="width64",
              reuse=(WIDTH_FOLDERS[64],), bootstrap=True)}


# The closed bound's pilot (issue 52), as benchmarks/results/lm_bound/
# plan.md fixes it: the three gain constraints on Stiefel-Adam (its ratio and
# cap) at d 128 at AdamW's best eta (3e-3), Stiefel-Adam's best (1e-2) and
# 10x, 33x and 100x AdamW's best (3e-2, 0.1, 0.3), tuning seeds 100 and 101;
# adamw, stiefel and qk_norm at those points are the committed sweep's runs
# (benchmarks/results/lm_robustness, read, never written).
BOUND_PLAN = "benchmarks/results/lm_bound/plan.md"
BOUND_PILOT = dataclasses.replace(
    SWEEP, arms=("adamw", "stiefel", "qk_norm") + tuple(BOUND_ARMS),
    grid=(3e-3, 1e-2, 3e-2, 0.1, 0.3), extension=(), seeds=(100, 101),
    ratios={**RATIOS, **{a: RATIOS["stiefel"] for a in BOUND_ARMS}},
    claims=(), plan=BOUND_PLAN, reuse=("lm_robustness",),
    heading="## The closed logit bound: the pilot (language model)")
SWEEPS["bound_pilot"] = BOUND_PILOT

# The closed bound's study (issue 52), as benchmarks/results/lm_bound/
# study_plan.md fixes it: the pilot's choice, `stiefel_box`, added to the
# width study's sweeps at d 128 and d 256 (their grids, seeds, ratios and
# rules; every committed run of the four width arms read, never written;
# at d 128 the pilot's box runs too). Each writes its own folder.
BOUND_STUDY_PLAN = "benchmarks/results/lm_bound/study_plan.md"
BOUND_STUDY_ARMS = WIDTH_ARMS + ("stiefel_box",)
BOUND_FOLDERS = {128: "lm_bound/d128", 256: "lm_bound/d256"}


def bound_study(d: int, **changes) -> Sweep:
  """The width study's sweep at d with the box arm (the stiefel arm's
  ratio and cap)."""
  return dataclasses.replace(SWEEPS[f"width{d}"], **{
      "arms": BOUND_STUDY_ARMS,
      "ratios": {**RATIOS, "stiefel_box": RATIOS["stiefel"]},
      "plan": BOUND_STUDY_PLAN, "claims": (), "trend": None,
      "heading": f"## The closed logit bound: the sweep at d {d} (language"
                 " model)", **changes})


# The claims at d 256 (the plan's (a), (b) and (d); (c) is a count, in the
# study's report): the box against each reference at their rates
# (`report_lib.rate_eta`: at d 256 AdamW's best is 1e-3, so "high" is 1e-2,
# 10x, and "high+1" 3e-2, "high+2" 0.1); one Holm family each.
BOX = "stiefel_box"
BOUND_CLAIMS = (
    report_lib.Table(
        "(a) the box at its own best sweep point against AdamW, QK-norm and"
        " Stiefel-Adam, each at its own best",
        tuple(((BOX, "best"), (a, "best"))
              for a in ("adamw", "qk_norm", "stiefel"))),
    report_lib.Table(
        "(b) the box against QK-norm and Stiefel-Adam at 10x and 30x"
        " AdamW's best rate (both arms of a row at the same rate)",
        tuple(((BOX, r), (a, r)) for r in ("high", "high+1")
              for a in ("qk_norm", "stiefel"))),
    report_lib.Table(
        "(d) the box against QK-norm at 100x AdamW's best rate",
        (((BOX, "high+2"), ("qk_norm", "high+2")),), last=True))
SWEEPS["bound128"] = bound_study(128, reuse=("lm_robustness", "lm_bound"))
SWEEPS["bound256"] = bound_study(256, reuse=(WIDTH_FOLDERS[256],),
                                 claims=BOUND_CLAIMS,
                                 last_after=("bound128", BOUND_FOLDERS[128]))


def sweep_config(sweep: Sweep, arm: str, eta: float) -> Config:
  """The arm's configuration at base learning rate eta (its floor eta / 10,
  as every LM run; its Q/K rates eta times its ratios)."""
  hp = {"learning_rate": eta}
  hp.update(sweep.rates(arm, eta))
  if arm == "stiefel" or arm in BOUND_ARMS:
    hp["max_step_ratio"] = sweep.cap_ratio
  return point_config(sweep.base, arm, hp, sweep.base.max_iters)


def task_sweep(sweep: Sweep, task: tuple) -> Sweep:
  """The sweep a task's run belongs to: (arm, eta, seed) this one's,
  (arm, eta, seed, name) the sweep SWEEPS[name]'s (the trend's terms)."""
  return SWEEPS[task[3]] if len(task) > 3 else sweep


def task_config(sweep: Sweep, task: tuple) -> Config:
  return sweep_config(task_sweep(sweep, task), task[0], task[1])


def task_name(sweep: Sweep, task: tuple, data_id: str) -> str:
  return run_name(task_config(sweep, task), task[2], data_id)


def names(sweep: Sweep, data_id: str) -> sweep_lib.Names:
  """The sweep's run names on the corpus data_id (`benchmarks.sweep`'s
  `name`)."""
  return lambda task: task_name(sweep, task, data_id)


def grid(sweep: Sweep, done: Mapping, data_id: str = "") -> tuple:
  """`benchmarks.sweep.grid`: the grid with the points AdamW's finished
  runs open."""
  return sweep_lib.grid(sweep, done, names(sweep, data_id))


def remaining(sweep: Sweep, done: Mapping, data_id: str) -> list:
  """The sweep's unfinished runs; once it is complete, the claims'
  (`claim_tasks`)."""
  name = names(sweep, data_id)
  return sweep_lib.remaining(sweep, done, name) or sweep_lib.unfinished(
      claim_tasks(sweep, claim_plan(sweep, done, data_id)), done, name)


def startable(sweep: Sweep, done: Mapping, data_id: str) -> list:
  """The runs a worker may start now (the workers' plan): the sweep's
  unfinished runs; once it is complete, those of the claims' first stage
  (`claim_stages`) with any unfinished. A stage starts only when every run
  of the stages before it has finished, so that with several workers too
  every row is run on the discovery seeds before any confirmation seed: a
  worker done with its share of a stage takes the others' unstarted runs
  of it, then waits (`sweep.run`). The stages of the tables marked `last`
  wait, too, for the sweep `last_after` names to be complete (`complete`):
  until then a worker done with the others stops. `remaining` lists them
  all."""
  name = names(sweep, data_id)
  left = sweep_lib.remaining(sweep, done, name)
  if left:
    return left
  waits = sweep.last_after and not complete(*sweep.last_after, data_id)
  for stage in claim_stages(sweep, claim_plan(sweep, done, data_id),
                            last=not waits):
    left = sweep_lib.unfinished(stage, done, name)
    if left:
      return left
  return []


def complete(sweep_name: str, folder: str, data_id: str) -> bool:
  """Whether SWEEPS[sweep_name] has no run left (claims included) on the
  finished runs of its folder under benchmarks/results and of its
  `reuse` folders, under this numerics version."""
  other = SWEEPS[sweep_name]
  done = harness.finished_runs(
      sweep_lib.reused(other) + harness.RunStore(
          harness.REFERENCE_ROOT / folder).records(), current_version=True)
  return not remaining(other, done, data_id)


def eta_high(curve: Mapping) -> float:
  """The plan's high rate, from AdamW's curve ({eta: point}): two grid
  points (a decade) above its best, capped at the highest point where it
  finished on at least one tuning seed; if that is its best, the next
  point up.

  >>> p = lambda d: dict(mean=0.0, losses=[0, 0], diverged=[0] * d)
  >>> c = {1e-3: p(0), 1e-2: p(0), 0.1: p(1), 1.0: p(2)}
  >>> c[1e-3]["mean"] = -1                # best at 1e-3: 0.1, two up
  >>> eta_high(c), eta_high({**c, 0.1: p(2)})   # capped: 1e-2
  (0.1, 0.01)
  """
  pts = sorted(curve)
  best = pts.index(report_lib.summary(
      {e: curve[e] for e in pts})["best_eta"])
  top = max(i for i, e in enumerate(pts)
            if len(curve[e]["diverged"]) < len(curve[e]["losses"]))
  high = min(best + 2, top)
  return pts[min(high if high > best else best + 1, len(pts) - 1)]


def claim_plan(sweep: Sweep, done: Mapping, data_id: str) -> dict:
  """{"best": {arm: its best sweep eta}, "high": eta_high, "points": the
  grid in order} on the tuning seeds (the sweep complete); with a `trend`,
  "trend": eta_high of that sweep's curves (None while it is not
  complete)."""
  cs = report_lib.curves(sweep_lib.rows(sweep, done, names(sweep, data_id)),
                         LOSS_KEY)
  plan = dict(best={a: report_lib.summary(cs[a])["best_eta"]
                    for a in sweep.arms},
              high=eta_high(cs[sweep.arms[0]]),
              points=sorted(cs[sweep.arms[0]]))
  if sweep.trend:
    other = SWEEPS[sweep.trend]
    name = names(other, data_id)
    plan["trend"] = None if sweep_lib.remaining(other, done, name) else (
        eta_high(report_lib.curves(sweep_lib.rows(other, done, name),
                                   LOSS_KEY)[other.arms[0]]))
  return plan


def claim_tables(sweep: Sweep) -> list:
  """The sweep's claims tables in the order their runs are planned: its
  `claims`, each a `report_lib.Table` or "best" / "high" (every arm
  against AdamW there)."""
  return [report_lib.every_arm(c, sweep.arms) if isinstance(c, str) else c
          for c in sweep.claims]


def claim_stages(sweep: Sweep, plan: Mapping, last: bool = True) -> list:
  """The claims' runs, (arm, eta, seed), as the stages they run in, each a
  list: every discovery seed before any confirmation seed, the tables in
  turn (per seed, the table's arms in the sweep's order at their rates; a
  run two tables share once), then the trend's terms (arm, eta, seed,
  trend): every arm of that sweep at its eta_high; a table marked `last`
  after both stages of the others (last=False: without them). While the
  trend's sweep is not complete, no confirmation seed is planned (every
  row of every table is run on discovery seeds first)."""
  seen, stages = set(), []

  def add(tables, stage) -> list:
    out = []
    for table in tables:
      used = [(a, r) for row in table.rows for a, r in row]
      for seed in sweep.claim_seeds[stage]:
        for arm in sweep.arms:
          for a, r in dict.fromkeys(used):
            t = (arm, report_lib.rate_eta(plan, arm, r), seed)
            if a == arm and t not in seen:
              seen.add(t)
              out.append(t)
    return out

  tables = claim_tables(sweep)
  for stage in ("discovery", "confirmation"):
    runs = add([t for t in tables if not t.last], stage)
    if sweep.trend:
      if plan["trend"] is None:
        return stages + [runs]
      runs += [(arm, plan["trend"], seed, sweep.trend)
               for seed in sweep.claim_seeds[stage]
               for arm in SWEEPS[sweep.trend].arms]
    stages.append(runs)
  if not last:
    return stages
  return stages + [add([t for t in tables if t.last], stage)
                   for stage in ("discovery", "confirmation")]


def claim_tasks(sweep: Sweep, plan: Mapping) -> list:
  """The claims' runs in their order: the stages of `claim_stages`, one
  after the other."""
  return [t for stage in claim_stages(sweep, plan) for t in stage]


def claim_runs(sweep: Sweep, done: Mapping, data_id: str) -> dict:
  """{"plan": claim_plan, stage: rows {arm, eta, seed, record}} of the
  claims' finished runs (the trend's terms under "trend", by stage); {}
  while the sweep is not complete, or where it has no claims."""
  if (not sweep.claims and not sweep.trend) or sweep_lib.remaining(
      sweep, done, names(sweep, data_id)):
    return {}
  plan = claim_plan(sweep, done, data_id)
  out = {"plan": plan, "tables": claim_tables(sweep),
         "discovery": [], "confirmation": [],
         "trend": {"discovery": [], "confirmation": []}}
  for t in claim_tasks(sweep, plan):
    rec = done.get(task_name(sweep, t, data_id))
    if sweep_lib.finished(rec):
      row = dict(arm=t[0], eta=t[1], seed=t[2], record=rec)
      (out["trend"] if len(t) > 3 else out)[
          harness.seed_block(t[2])].append(row)
  if not sweep.trend:
    del out["trend"]
  return out


# --------------------------------------------------------------------------
# The LM's side of the sweep's command (`benchmarks.sweep.main`).


def prepare(sweep: Sweep, out: pathlib.Path, opts) -> tuple:
  """(data_id, execute, run's other arguments) of the sweep on the corpus
  (--data): each run trained by `train_run`, its expected time from the
  iteration rates of out's runs, else of the study's of the same size; the
  claims' runs after the sweep (`remaining`)."""
  corpus = load_corpus(str(opts.data or default_data()))
  rates = {**iteration_rates(harness.RunStore(REFERENCE_DIR).records()),
           **iteration_rates(harness.RunStore(out).records())}

  def execute(task) -> dict:
    return train_run(task_config(sweep, task), task[2], corpus, out,
                     command=opts.command, log=opts.log)

  def describe(task, rec: dict) -> str:
    return (f"{rec['name']} (eta {task[1]:g}): val (whole split)"
            f" {rec['final']['val_loss_full']}, {rec['wall_s']:.0f} s"
            + sweep_lib.stopped_text(rec))

  return corpus.data_id, execute, dict(
      plan=lambda done: startable(sweep, done, corpus.data_id),
      total=lambda done: remaining(sweep, done, corpus.data_id),
      describe=describe, desc="lm robustness",
      expected_s=lambda t: run_seconds(task_config(sweep, t), rates))


def robustness_report(sweep: Sweep, preset: str, out: pathlib.Path,
                      data_id: Optional[str] = None,
                      results_md: Optional[pathlib.Path] = None) -> dict:
  """`benchmarks.reports.robustness.report` of out's runs of the sweep
  (its plots linked from results_md's folder in the section). A width
  sweep's RESULTS.md section (with results_md) is the cross-width one:
  `width_report` of the plan's folders, rewritten into
  benchmarks/results/lm_width after this width's own report."""
  if results_md is not None and sweep.plan in STUDIES:
    study = STUDIES[sweep.plan]
    robustness_report(sweep, preset, out, data_id)
    return width_report(harness.REFERENCE_ROOT / study.home,
                        results_md=results_md, study=study)
  done = sweep_lib.saved(out, sweep)
  data_id = study_data(done.values())
  cfg = sweep.base
  return report_lib.report(
      out, sweep_lib.rows(sweep, done, names(sweep, data_id)),
      plan=sweep.plan,
      grid=grid(sweep, done, data_id), seeds=sweep.seeds,
      left=len(remaining(sweep, done, data_id)),
      claims=claim_runs(sweep, done, data_id), bootstrap=sweep.bootstrap,
      figures=sweep_lib.figures(out, results_md),
      heading=sweep.heading, title="LM", loss_key=LOSS_KEY,
      loss_text="whole-split validation loss", step_arms=STEPPED, setting=(
          f"nanoGPT's {'toy' if preset == 'quick' else 'CPU'} configuration"
          f" ({cfg.n_layer} layers, d {cfg.n_embd}, {cfg.n_head} heads,"
          f" {cfg.max_iters} iterations, weight decay {cfg.weight_decay}),"
          f" corpus {data_id}; an arm's Q/K rates move with eta by its"
          f" study ratio ({sweep.ratio_text()};"
          f" stiefel's cap {sweep.cap_ratio:g} x its Q/K lr)."))


WIDTH_SECTION = "## Learning-rate robustness across width (language model)"


@dataclasses.dataclass(frozen=True)
class WidthStudy:
  """A cross-width report: its plan, heading, folder (`home`, under
  benchmarks/results), {d: (SWEEPS name, folder under benchmarks/results)}
  and the sweep whose `--report-only` regenerates it (its largest width's);
  `bound`: the closed bound's tables and figure after the claims."""
  plan: str
  heading: str
  home: str
  widths: Mapping
  bound: bool = False

  def default_widths(self) -> dict:
    return {d: (SWEEPS[s], harness.REFERENCE_ROOT / f)
            for d, (s, f) in self.widths.items()}


WIDTH_STUDY = WidthStudy(
    WIDTH_PLAN, WIDTH_SECTION, "lm_width",
    {d: (f"width{d}", f) for d, f in WIDTH_FOLDERS.items()})
BOUND_STUDY = WidthStudy(
    BOUND_STUDY_PLAN, "## The closed logit bound across width (language"
    " model)", "lm_bound",
    {64: ("width64", WIDTH_FOLDERS[64]),
     **{d: (f"bound{d}", f) for d, f in BOUND_FOLDERS.items()}}, bound=True)
STUDIES = {s.plan: s for s in (WIDTH_STUDY, BOUND_STUDY)}


def width_report(out: pathlib.Path, widths: Optional[Mapping] = None,
                 results_md: Optional[pathlib.Path] = None,
                 study: WidthStudy = WIDTH_STUDY) -> dict:
  """The study's cross-width report (`benchmarks.reports.width`) written
  to out: widths {d: (its sweep, its folder)}, default the study's; a
  folder without runs is a width shown as missing. After the figures: the
  largest width's claims tables (once its sweep is complete), for the
  bound study its logits against the certified bound (`bound_lines`), and
  a link to each width's own report; its figures linked from results_md's
  folder in the returned section."""
  widths = widths or study.default_widths()
  cs, left, read = {}, {}, {}
  for d, (sweep, folder) in sorted(widths.items()):
    done = sweep_lib.saved(folder, sweep)
    data_id = study_data(done.values())
    name = names(sweep, data_id)
    cs[d] = report_lib.curves(sweep_lib.rows(sweep, done, name), LOSS_KEY)
    # the sweep's own runs: its claims' runs do not change its curves
    left[d] = len(sweep_lib.remaining(sweep, done, name))
    read[d] = (sweep, done, data_id)
  arms = list(dict.fromkeys(a for sw, _ in widths.values() for a in sw.arms))
  top = max(widths)
  sweep, done, data_id = read[top]
  runs = claim_runs(sweep, done, data_id)   # {} until its sweep is complete
  claims_left = len(remaining(sweep, done, data_id))
  home = harness.REFERENCE_ROOT / study.home
  # FIGURES/: the report's folder as the RESULTS.md that shows the section
  # sees it; each link is written as from the study's home, so a report
  # written elsewhere (a test's copy) has the same bytes
  link = lambda folder: "FIGURES/" + pathlib.Path(os.path.relpath(
      pathlib.Path(folder, "robustness.md").resolve(),
      home.resolve())).as_posix()
  regen, regen_folder = study.widths[max(study.widths)]
  more = ["Each width's own report (curves, logits, step records): "
          + ", ".join(f"[d {d}]({link(folder)})"
                      for d, (_, folder) in sorted(widths.items())) + ".",
          "", "Regenerate (each width's report, then this one):"
          f" `python -m benchmarks lm --robustness --sweep {regen}"
          f" --report-only --out benchmarks/results/{regen_folder}"
          " --results-md benchmarks/RESULTS.md`.", ""]
  if study.bound:
    more += bound_lines(read, out)
  more += [f"The claims at the largest width, d {top}"
           + (f" ({claims_left} of their planned runs left):" if runs else
              ": not run yet (its sweep is not complete)."), ""]
  if runs:
    more += report_lib.claim_lines(runs, arms, LOSS_KEY,
                                   "whole-split validation loss",
                                   sweep.bootstrap)
  return width_lib.report(
      out, cs, arms, sorted(widths), plan=study.plan, left=left, more=more,
      figures=sweep_lib.figures(out, results_md), heading=study.heading)


def bound_lines(read: Mapping, out: pathlib.Path) -> list:
  """The bound study's logits (`benchmarks.reports.bound`): per width the
  largest logit of every arm at every rate beside the box's certified
  bound, its figure, and the plan's count (c) over every box run of the
  width (sweep and claims)."""
  rows, bounds, counts = {}, {}, {}
  for d, (sweep, done, data_id) in sorted(read.items()):
    rows[d] = sweep_lib.rows(sweep, done, names(sweep, data_id))
    cfg = dataclasses.asdict(sweep.base)
    bounds[d] = {a: bound_lib.certified(cfg, *BOUND_ARMS[a])
                 for a in sweep.arms if a in BOUND_ARMS}
    for a, b in bounds[d].items():
      counts[(d, a)] = [
          bound_lib.layer_counts(r["history"].get("max_logit", []), b)
          for r in done.values()
          if r.get("arm") == a and r["config"]["n_embd"] == d
          and sweep_lib.finished(r) and harness.matches(r)]
  arms = list(dict.fromkeys(a for sw, _, _ in read.values()
                            for a in sw.arms))
  bound_lib.plot_logits(rows, arms, bounds, out / "bound_logits.png")
  return (["The largest attention logit (max over tuning seeds, layers and"
           " evaluations) at every rate, beside the certified bound of the"
           " box (d / sqrt(head_dim) with |g| <= 1; the other arms certify"
           " none: their gains train freely):", ""]
          + bound_lib.logit_lines(rows, arms, bounds)
          + ["![largest logit against eta](FIGURES/bound_logits.png)", "",
             "The plan's (c), a count, not a test: every run of the box at"
             " each width (sweep and claims), its per-layer evaluations and"
             " those whose largest logit exceeds the certified bound:", ""]
          + bound_lib.count_lines(counts) + [""])


SWEEP_EXPERIMENT = sweep_lib.SweepExperiment(
    sweeps=SWEEPS, folder="lm_robustness", section=SECTION, names=names,
    prepare=prepare, report=robustness_report)
