"""The learning-rate sweep of issue 30 (`--robustness`), as its plan fixes
it (benchmarks/results/lm/robustness_plan.md): every arm on one shared
x-axis, the base learning rate eta of its AdamW-trained weights, its other
rates moving with eta by the ratio its study tuning chose; the full
2,000-iteration schedule; three tuning seeds per point, seed-major; a run
that diverges is stopped, kept and counted at its initial loss. Here: the
sweep (`Sweep`, its presets `SWEEPS`), each point's configuration, the
plan (the grid extended as the reference's runs come in, then the claims'
runs), its runner (`run_robustness`, shared by workers) and its report
(`robustness_report`: `benchmarks.reports.robustness`).

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

from benchmarks import harness, study as study_lib
from benchmarks.lm.config import CPU, QUICK, Config, run_name
from benchmarks.lm.data import Corpus
from benchmarks.lm.study import REFERENCE_DIR, point_config, study_data
from benchmarks.lm.timing import iteration_rates, run_seconds
from benchmarks.lm.train import train_run
from benchmarks.reports import robustness as report_lib

SECTION = "## Learning-rate robustness (language model)"


@dataclasses.dataclass(frozen=True)
class Sweep:
  """arms (the first is the reference, AdamW), grid of eta, extension (the
  points added upward, in turn, while the reference finishes at the top
  point on any seed), ratios {arm: {Config field: multiple of eta}},
  cap_ratio (stiefel: max_step_norm = cap_ratio x its Q/K lr), seeds (run
  seed-major), base (the configuration, its schedule the runs')."""
  arms: tuple
  grid: tuple
  extension: tuple
  ratios: Mapping
  cap_ratio: float
  seeds: tuple
  base: Config
  claim_seeds: Mapping = dataclasses.field(default_factory=lambda: {
      "discovery": harness.DISCOVERY_SEEDS[:8],
      "confirmation": harness.CONFIRMATION_SEEDS[:8]})


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
    seeds=(100, 101, 102), base=dataclasses.replace(CPU, weight_decay=0.03))
# The same path at toy size (`--robustness --quick`, well under a minute):
# at eta 3 and 30 the toy AdamW diverges.
QUICK_SWEEP = Sweep(
    arms=("adamw", "stiefel", "qk_clip"), grid=(1e-2, 3.0),
    extension=(30.0,), ratios=RATIOS, cap_ratio=0.3, seeds=(100,),
    claim_seeds={"discovery": (0, 1), "confirmation": (500, 501)},
    base=dataclasses.replace(QUICK, n_layer=1, n_embd=8, block_size=8,
                             max_iters=20, lr_decay_iters=20,
                             eval_interval=10, eval_iters=2))
SWEEPS = {"full": SWEEP, "quick": QUICK_SWEEP}


def sweep_config(sweep: Sweep, arm: str, eta: float) -> Config:
  """The arm's configuration at base learning rate eta (its floor eta / 10,
  as every LM run; its Q/K rates eta times its ratios)."""
  hp = {"learning_rate": eta}
  hp.update({k: float(f"{r * eta:.6g}")
             for k, r in sweep.ratios.get(arm, {}).items()})
  if arm == "stiefel":
    hp["max_step_ratio"] = sweep.cap_ratio
  return point_config(sweep.base, arm, hp, sweep.base.max_iters)


def finished(rec: Optional[Mapping]) -> bool:
  """A run that reached its end, diverged or not."""
  return rec is not None and rec.get("final") is not None


def grid(sweep: Sweep, done: Mapping, data_id: str = "") -> tuple:
  """The grid with the extension points the reference's finished runs
  open: the next point up while the reference finished the top point
  without diverging on any seed (done: {name: record})."""
  points = tuple(sweep.grid)
  for nxt in sweep.extension:
    cfg = sweep_config(sweep, sweep.arms[0], points[-1])
    runs = [done.get(run_name(cfg, s, data_id)) for s in sweep.seeds]
    if not any(finished(r) and not r.get("stopped") for r in runs):
      break
    points += (nxt,)
  return points


def tasks(sweep: Sweep, done: Mapping, data_id: str) -> list:
  """Every (arm, eta, seed) the finished runs let us name, seed-major (all
  arms at every point at the first seed, then the next), the reference's
  points first within a seed so that its extension is known in time."""
  points = grid(sweep, done, data_id)
  return [(arm, eta, seed) for seed in sweep.seeds for arm in sweep.arms
          for eta in points]


def unfinished(sweep: Sweep, planned: list, done: Mapping,
               data_id: str) -> list:
  """The tasks of `planned` without a finished run in `done`."""
  return [t for t in planned
          if not finished(done.get(task_name(sweep, t, data_id)))]


def remaining(sweep: Sweep, done: Mapping, data_id: str) -> list:
  """The sweep's unfinished runs; once it is complete, the claims'
  (`claim_tasks`)."""
  left = unfinished(sweep, tasks(sweep, done, data_id), done, data_id)
  if left:
    return left
  return unfinished(sweep, claim_tasks(sweep, claim_plan(sweep, done,
                                                          data_id)),
                    done, data_id)


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
  """{"best": {arm: its best sweep eta}, "high": eta_high} on the tuning
  seeds (the sweep complete)."""
  cs = report_lib.curves(sweep_runs(sweep, done, data_id))
  return dict(best={a: report_lib.summary(cs[a])["best_eta"]
                    for a in sweep.arms},
              high=eta_high(cs[sweep.arms[0]]))


def claim_tasks(sweep: Sweep, plan: Mapping) -> list:
  """The claims' runs, (arm, eta, seed): every arm at its best and at the
  high rate, every discovery seed before any confirmation seed."""
  out = []
  for stage in ("discovery", "confirmation"):
    for seed in sweep.claim_seeds[stage]:
      for arm in sweep.arms:
        for eta in (plan["best"][arm], plan["high"]):
          if (arm, eta, seed) not in out:
            out.append((arm, eta, seed))
  return out


def claim_runs(sweep: Sweep, done: Mapping, data_id: str) -> dict:
  """{"plan": claim_plan, stage: rows {arm, eta, seed, record}} of the
  claims' finished runs; {} while the sweep is not complete."""
  if unfinished(sweep, tasks(sweep, done, data_id), done, data_id):
    return {}
  plan = claim_plan(sweep, done, data_id)
  out = {"plan": plan, "discovery": [], "confirmation": []}
  for t in claim_tasks(sweep, plan):
    rec = done.get(task_name(sweep, t, data_id))
    if finished(rec):
      out[harness.seed_block(t[2])].append(
          dict(arm=t[0], eta=t[1], seed=t[2], record=rec))
  return out


def task_name(sweep: Sweep, task: tuple, data_id: str) -> str:
  arm, eta, seed = task
  return run_name(sweep_config(sweep, arm, eta), seed, data_id)


def sweep_runs(sweep: Sweep, done: Mapping, data_id: str) -> list:
  """The sweep's finished runs as rows {arm, eta, seed, record}."""
  rows = []
  for t in tasks(sweep, done, data_id):
    rec = done.get(task_name(sweep, t, data_id))
    if finished(rec) and harness.matches(rec):
      rows.append(dict(arm=t[0], eta=t[1], seed=t[2], record=rec))
  return rows


# --------------------------------------------------------------------------
# The runner and the report.


def worker_share(spec: Optional[str]):
  """--worker I/N as a predicate on run names (None: every run)."""
  if spec is None:
    return lambda name: True
  try:
    i, n = (int(x) for x in spec.split("/"))
  except ValueError:
    i, n = -1, 0
  if not 0 <= i < n:
    raise SystemExit(f"--worker must be I/N with 0 <= I < N; got {spec!r}.")
  return lambda name: int(harness.digest(name, 8), 16) % n == i


def run_robustness(sweep: Sweep, corpus: Corpus,
                   out: pathlib.Path, *, command: str = "", log=print,
                   time_budget: float = 0.0, dry_run: bool = False,
                   worker: Optional[str] = None) -> int:
  """Runs the sweep's unfinished runs in plan order (the grid extended as
  the reference's runs come in, the finished runs read anew from `out`
  before each, so that workers sharing it see each other's); stops before
  a run expected to end past time_budget seconds. Returns the number of
  runs trained (dry_run: prints how many are left and their expected
  time, trains none)."""
  store, mine = harness.RunStore(out), worker_share(worker)
  records = store.records()
  done: dict = {}     # read from `out` by every left()

  def left() -> list:
    done.update(harness.finished_runs(store.records(), current_version=True))
    return [t for t in remaining(sweep, done, corpus.data_id)
            if mine(task_name(sweep, t, corpus.data_id))]

  # Iteration rates from these runs, else the study's of the same size.
  rates = {**iteration_rates(harness.RunStore(REFERENCE_DIR).records()),
           **iteration_rates(records)}
  if dry_run:
    todo = left()
    secs = [run_seconds(sweep_config(sweep, a, e), rates)
            for a, e, _ in todo]
    known = [s for s in secs if s is not None]
    log(f"{len(todo)} runs planned left (the grid may still extend);"
        f" about {sum(known) / 3600:.1f} h for the {len(known)} of them"
        " with a timed configuration, at full length (a diverged run"
        " stops early)")
    return 0

  def execute(task) -> dict:
    rec = train_run(sweep_config(sweep, task[0], task[1]),
                    task[2], corpus, out, command=command, log=log)
    done[rec["name"]] = rec
    return rec

  def describe(task, rec: dict) -> str:
    f, why = rec["final"], rec.get("stopped")
    return (f"{rec['name']} (eta {task[1]:g}): val (whole split)"
            f" {f['val_loss_full']}, {rec['wall_s']:.0f} s"
            + (f"; diverged at {why['diverged_at']}: {why['reason']}"
               if why else ""))

  return study_lib.run_tasks(
      left, execute, desc="lm robustness", describe=describe,
      expected_s=lambda t: run_seconds(
          sweep_config(sweep, t[0], t[1]), rates),
      time_budget=time_budget, log=log, progress=False)


def robustness_report(out: pathlib.Path, name: str,
                      results_md: Optional[pathlib.Path] = None) -> dict:
  """`benchmarks.reports.robustness.report` of out's runs of the sweep
  (its plots linked from results_md's folder in the section)."""
  sweep = SWEEPS[name]
  done = harness.finished_runs(harness.RunStore(out).records(),
                               current_version=False)
  data_id = study_data(done.values())
  cfg = sweep.base
  return report_lib.report(
      out, sweep_runs(sweep, done, data_id),
      plan="benchmarks/results/lm/robustness_plan.md",
      grid=grid(sweep, done, data_id), seeds=sweep.seeds,
      left=len(remaining(sweep, done, data_id)),
      claims=claim_runs(sweep, done, data_id),
      figures="" if results_md is None else pathlib.Path(os.path.relpath(
          out.resolve(), pathlib.Path(results_md).resolve().parent
      )).as_posix() + "/",
      heading=SECTION, setting=(
          f"nanoGPT's {'toy' if name == 'quick' else 'CPU'} configuration"
          f" ({cfg.n_layer} layers, d {cfg.n_embd}, {cfg.n_head} heads,"
          f" {cfg.max_iters} iterations, weight decay {cfg.weight_decay}),"
          f" corpus {data_id}; an arm's Q/K rates move with eta by its"
          f" study ratio ({', '.join(f'{a} {k} = {r:g} eta' for a, d in sweep.ratios.items() if a in sweep.arms for k, r in d.items())};"
          f" stiefel's cap {sweep.cap_ratio:g} x its Q/K lr)."))
