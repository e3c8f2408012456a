"""A learning-rate sweep (issue 30), the same for every benchmark: each arm
over one grid of a base learning rate eta (the rate of the AdamW-trained
weights; an arm's other rates move with it by fixed ratios), on a few
tuning seeds, run seed-major; the grid extended upward while the reference
arm still finishes its top point, and downward (`below`, where a sweep has
it) once every run of the grid is in and some arm's best mean lies at its
lowest point; a run that diverges stopped, kept and counted (its record's
`stopped`); the finished runs of other folders (`reuse`) read as its own. An experiment says how a run is named
from its task (arm, eta, seed) (`name`: a function of the task, whose
result changes with whatever the run depends on), and how one is trained
(`execute`); this module plans the runs (`grid`, `tasks`, `unfinished`,
`remaining`), reads them (`finished`, `runs`), shares them among workers
(`worker_share`) and runs them (`run`). Reports: `benchmarks.reports.
robustness`.

>>> s = Sweep(arms=("adamw", "stiefel"), grid=(1e-3, 1e-2), extension=(0.1,),
...           ratios={"stiefel": {"lr": 30.0}}, seeds=(100, 101))
>>> s.rates("stiefel", 1e-3), s.rates("adamw", 1e-3), s.ratio_text()
({'lr': 0.03}, {}, 'stiefel lr = 30 eta')
>>> name = lambda t: f"{t[0]}_{t[1]:g}_{t[2]}"
>>> tasks(s, {}, name)[:3]       # seed-major, the reference's points first
[('adamw', 0.001, 100), ('adamw', 0.01, 100), ('stiefel', 0.001, 100)]
>>> done = {"adamw_0.01_101": {"final": {"loss": 1.0}}}
>>> grid(s, done, name)          # adamw finished its top point: one more
(0.001, 0.01, 0.1)
>>> done["adamw_0.01_101"]["stopped"] = {"diverged_at": 250}
>>> grid(s, done, name)          # ... not if that run diverged
(0.001, 0.01)

The downward rule (`below`): its points are added in turn, each once
every run of the grid so far is finished and some arm's mean capped loss
over the seeds (`loss_key`) is lowest at the grid's lowest point.

>>> s = Sweep(arms=("adamw", "stiefel"), grid=(1e-3, 1e-2), extension=(),
...           ratios={}, seeds=(100,), below=(3e-4,), loss_key="loss")
>>> run = lambda loss: {"final": {"loss": loss}, "history": {"val_loss": [4.]}}
>>> done = {name(t): run(2.0 if t[1] < 0.01 else 1.5)
...         for t in tasks(s, {}, name)}
>>> grid(s, done, name)          # every best above the lowest point
(0.001, 0.01)
>>> done["stiefel_0.001_100"] = run(1.0)
>>> grid(s, done, name)          # stiefel best at 1e-3: 3e-4 opened
(0.0003, 0.001, 0.01)
>>> del done["adamw_0.01_100"]   # ... only once every run is in
>>> grid(s, done, name)
(0.001, 0.01)
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from benchmarks import driver, harness, study as study_lib
from benchmarks.reports.robustness import capped_loss

# A run's name from its task (arm, eta, seed).
Names = Callable[[tuple], str]


@dataclasses.dataclass(frozen=True)
class Sweep:
  """arms (the first is the reference, AdamW), grid of eta, extension (the
  points added upward, in turn, while the reference finishes at the top
  point on any seed), ratios {arm: {hyperparameter: multiple of eta}},
  seeds (the tuning seeds, run seed-major); below (the points added
  downward, in turn, once every run of the grid is finished and some arm's
  best mean over the seeds of the capped `loss_key` of its records lies at
  the grid's lowest point; each is added once), reuse (folders under
  benchmarks/results whose finished runs the sweep reads as its own; it
  never writes there). An experiment's sweep adds what else its runs
  depend on (its base configuration)."""
  arms: tuple
  grid: tuple
  extension: tuple
  ratios: Mapping
  seeds: tuple
  below: tuple = dataclasses.field(default=(), kw_only=True)
  loss_key: str = dataclasses.field(default="", kw_only=True)
  reuse: tuple = dataclasses.field(default=(), kw_only=True)

  def rates(self, arm: str, eta: float) -> dict:
    """{hyperparameter: ratio x eta} of the arm (6 significant digits)."""
    return {k: float(f"{r * eta:.6g}")
            for k, r in self.ratios.get(arm, {}).items()}

  def ratio_text(self) -> str:
    """The ratios of the sweep's arms in words, as its report states them."""
    return ", ".join(f"{a} {k} = {r:g} eta" for a, d in self.ratios.items()
                     if a in self.arms for k, r in d.items())


def finished(rec: Optional[Mapping]) -> bool:
  """A run that reached its end, diverged or not."""
  return rec is not None and rec.get("final") is not None


def diverged(rec: Mapping) -> bool:
  """A run stopped by the divergence rule (`divergence`)."""
  return bool(rec.get("stopped"))


def divergence(hist: Mapping, keys: Sequence[str]) -> Optional[dict]:
  """The divergence rule at a run's last evaluation: a loss of `keys`
  non-finite (None) or above its own initial value (the first evaluation's,
  step 0); then {"diverged_at": step, "reason": ...}, which stops the run.

  >>> h = dict(step=[0, 250], val_loss=[4.2, 4.3])
  >>> divergence(h, ["val_loss"])
  {'diverged_at': 250, 'reason': 'val_loss 4.3000 above the initial 4.2000'}
  """
  for k in keys:
    v, first = hist[k][-1], hist[k][0]
    if v is None or first is None or v > first:
      return dict(diverged_at=hist["step"][-1], reason=(
          f"{k} non-finite" if v is None or first is None
          else f"{k} {v:.4f} above the initial {first:.4f}"))
  return None


def stopped_text(rec: Mapping) -> str:
  """"; diverged at <step>: <reason>" for a stopped run, else ""."""
  why = rec.get("stopped")
  return f"; diverged at {why['diverged_at']}: {why['reason']}" if why else ""


def grid(sweep: Sweep, done: Mapping, name: Names) -> tuple:
  """The grid with the extension points the reference's finished runs
  open: the next point up while the reference finished the top point
  without diverging on any seed (done: {name: record}); then the points
  of `below`, in turn, while `lowest_is_best`."""
  points = tuple(sweep.grid)
  for nxt in sweep.extension:
    runs = [done.get(name((sweep.arms[0], points[-1], s)))
            for s in sweep.seeds]
    if not any(finished(r) and not diverged(r) for r in runs):
      break
    points += (nxt,)
  for low in sweep.below:
    if not lowest_is_best(sweep, points, done, name):
      break
    points = (low,) + points
  return points


def lowest_is_best(sweep: Sweep, points: Sequence[float], done: Mapping,
                   name: Names) -> bool:
  """Every run of the arms at points on the seeds finished, and some arm's
  mean capped loss over the seeds (`benchmarks.reports.robustness.
  capped_loss` of sweep.loss_key, as the report reads it) lowest at
  points[0] (the first of equal means, as the report's best)."""
  recs = {(a, e): [done.get(name((a, e, s))) for s in sweep.seeds]
          for a in sweep.arms for e in points}
  if not all(finished(r) for rs in recs.values() for r in rs):
    return False
  for arm in sweep.arms:
    means = [float(np.mean([capped_loss(r, sweep.loss_key)
                            for r in recs[arm, e]])) for e in points]
    if int(np.argmin(means)) == 0:
      return True
  return False


def tasks(sweep: Sweep, done: Mapping, name: Names) -> list:
  """Every (arm, eta, seed) the finished runs let us name, seed-major (all
  arms at every point at the first seed, then the next), the reference's
  points first within a seed so that its extension is known in time."""
  points = grid(sweep, done, name)
  return [(arm, eta, seed) for seed in sweep.seeds for arm in sweep.arms
          for eta in points]


def unfinished(planned: Sequence[tuple], done: Mapping, name: Names) -> list:
  """The tasks of `planned` without a finished run in `done`."""
  return [t for t in planned if not finished(done.get(name(t)))]


def remaining(sweep: Sweep, done: Mapping, name: Names) -> list:
  """The sweep's unfinished runs, in plan order."""
  return unfinished(tasks(sweep, done, name), done, name)


def runs(planned: Sequence[tuple], done: Mapping, name: Names) -> list:
  """The finished runs of `planned` whose identity checks
  (`harness.matches`), as rows {arm, eta, seed, record}: what a report
  reads."""
  rows = []
  for t in planned:
    rec = done.get(name(t))
    if finished(rec) and harness.matches(rec):
      rows.append(dict(arm=t[0], eta=t[1], seed=t[2], record=rec))
  return rows


def worker_share(spec: Optional[str]):
  """--worker I/N as a predicate on run names (None: every run).

  >>> mine = worker_share("1/2")
  >>> [mine(n) for n in ("a", "b", "c")] == [
  ...     not worker_share("0/2")(n) for n in ("a", "b", "c")]
  True
  """
  if spec is None:
    return lambda name: True
  i, n = driver.check_worker(spec)
  return lambda name: int(harness.digest(name, 8), 16) % n == i


class Claims:
  """Which worker trains which run: runs/<name>.claim holds the worker's
  I/N while it trains the run (taken by exclusive creation, removed once
  the record is saved), so that a worker done with its own share takes the
  other workers' unstarted runs, last first, and no run is trained twice.
  A worker starting again drops the claims it left.

  >>> import tempfile
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> a, b = Claims(d, "0/2"), Claims(d, "1/2")
  >>> a.take("x"), b.take("x"), b.take("y")
  (True, False, True)
  >>> sorted(Claims(d, "0/2").held())       # 0/2 restarted: its claim is gone
  ['y']
  """

  def __init__(self, folder: pathlib.Path, worker: str):
    self.dir, self.worker = pathlib.Path(folder), worker
    self.dir.mkdir(parents=True, exist_ok=True)
    self.drop()

  def drop(self) -> None:
    """Removes this worker's claims."""
    for p in self.dir.glob("*.claim"):
      try:
        if p.read_text() == self.worker:
          p.unlink()
      except FileNotFoundError:   # released meanwhile by its worker
        pass

  def path(self, name: str) -> pathlib.Path:
    return self.dir / f"{name}.claim"

  def take(self, name: str) -> bool:
    try:
      with open(self.path(name), "x") as f:
        f.write(self.worker)
    except FileExistsError:
      return False
    return True

  def release(self, name: str) -> None:
    self.path(name).unlink(missing_ok=True)

  def held(self) -> set:
    """The names of the runs being trained now."""
    return {p.name[:-len(".claim")] for p in self.dir.glob("*.claim")}

  def live(self, name: str, expected_s: Optional[float]) -> bool:
    """Whether the run's claim is younger than twice its expected time (a
    claim left by a worker killed mid-run is older; without an expected
    time, no claim counts as live)."""
    try:
      age = time.time() - self.path(name).stat().st_mtime
    except FileNotFoundError:
      return False
    return expected_s is not None and age < 2 * expected_s


def run(sweep: Sweep, out: pathlib.Path, name: Names, execute: Callable, *,
        describe: Callable, expected_s: Callable, desc: str,
        plan: Optional[Callable[[Mapping], list]] = None,
        total: Optional[Callable[[Mapping], list]] = None,
        worker: Optional[str] = None, time_budget: float = 0.0, log=print,
        dry_run: bool = False, poll_s: float = 30.0) -> int:
  """Runs the unfinished runs of plan(done) (default: `remaining`) in plan
  order, execute(task) training one and returning its record (saved under
  out/runs/ as name(task)); the finished runs (`harness.finished_runs`
  under this numerics version) are read anew from `out` before each, so
  that workers sharing it see each other's, and a worker trains only its
  share (`worker_share`), then the others' unstarted runs, last first
  (`Claims`); while every planned run left is another worker's live claim
  (`Claims.live`), it waits (polling every poll_s seconds), since what
  those finish may plan more (the grid's extension, the downward point,
  the claims). Stops before a run expected (expected_s(task): seconds or
  None) to end past time_budget seconds. Returns the number of runs
  trained (dry_run: logs how many of its share are left and their
  expected time, trains none; total(done), default plan, lists every run
  still planned where plan offers only those that may start now)."""
  store, mine = harness.RunStore(out), worker_share(worker)
  plan = plan or (lambda done: remaining(sweep, done, name))
  done: dict = {}     # read from `out` by every left()

  def planned(which: Optional[Callable] = None) -> list:
    done.update(harness.finished_runs(reused(sweep) + store.records(),
                                      current_version=True))
    return (which or plan)(done)

  if dry_run:
    todo = [t for t in planned(total) if mine(name(t))]
    known = [s for s in map(expected_s, todo) if s is not None]
    log(f"{len(todo)} runs planned left"
        + (" (the grid may still extend)" if sweep.extension else "")
        + f"; about {sum(known) / 3600:.1f} h for the {len(known)} of them"
        " with a timed configuration, at full length (a diverged run"
        " stops early)")
    return 0

  claims = Claims(store.dir, worker) if worker else None

  def left() -> list:
    """The share's unclaimed runs, else the others' last first; the first
    of them claimed for this worker (the one run_tasks trains next)."""
    while True:
      planned_now = planned()
      if claims is None:
        return [t for t in planned_now if mine(name(t))]
      held = claims.held()
      free = [t for t in planned_now if name(t) not in held]
      todo = [t for t in free if mine(name(t))] or [
          t for t in reversed(free) if not mine(name(t))]
      for i, t in enumerate(todo):
        if claims.take(name(t)):
          return todo[i:]
      if not any(claims.live(name(t), expected_s(t)) for t in planned_now):
        return []
      time.sleep(poll_s)

  def one(task) -> dict:
    try:
      rec = execute(task)
      done[name(task)] = rec
    finally:
      if claims is not None:
        claims.release(name(task))
    return rec

  try:
    return study_lib.run_tasks(left, one, desc=desc, describe=describe,
                               expected_s=expected_s,
                               time_budget=time_budget, log=log,
                               progress=False)
  finally:
    if claims is not None:   # the claim of a run a time budget stopped
      claims.drop()


# --------------------------------------------------------------------------
# The command: one flow for every experiment's sweep (`--robustness`).


def rows(sweep: Sweep, done: Mapping, name: Names) -> list:
  """The sweep's finished runs as rows {arm, eta, seed, record} (what
  `benchmarks.reports.robustness.report` reads)."""
  return runs(tasks(sweep, done, name), done, name)


def reused(sweep: Sweep) -> list:
  """The records of the sweep's `reuse` folders (under benchmarks/results),
  in folder and file-name order."""
  return [r for f in sweep.reuse
          for r in harness.RunStore(harness.REFERENCE_ROOT / f).records()]


def saved(out: pathlib.Path, sweep: Optional[Sweep] = None) -> dict:
  """{name: record} of out's finished runs (and those of the sweep's
  `reuse` folders) under any numerics version (what a report reads)."""
  records = (reused(sweep) if sweep else []) + harness.RunStore(
      out).records()
  return harness.finished_runs(records, current_version=False)


def figures(out: pathlib.Path, results_md: Optional[pathlib.Path]) -> str:
  """The folder of out's plots as the RESULTS.md at results_md sees it
  ('' without one)."""
  if results_md is None:
    return ""
  return pathlib.Path(os.path.relpath(
      out.resolve(), pathlib.Path(results_md).resolve().parent)).as_posix() + "/"


@dataclasses.dataclass(frozen=True)
class SweepExperiment:
  """An experiment as the sweep's command sees it (its side of its sweep,
  handed to `main`; cf. `driver.Experiment`): its sweeps
  ({name: a `Sweep` with a `base` configuration}: `full`, `quick` and any
  other that --sweep names), the default results folder (runs/<folder>,
  `_<name>` added for a sweep other than `full`), its RESULTS.md heading,
  names(sweep, data_id) -> `Names`, prepare(sweep, out, opts) -> (data_id,
  execute, the other keyword arguments of `run`: describe, expected_s,
  desc, plan, total), and report(sweep, name, out, data_id, results_md)
  -> dict with its RESULTS.md section (and its `heading` where it is not the
  experiment's; data_id None: the one the runs record)."""
  sweeps: Mapping
  folder: str
  section: str
  names: Callable
  prepare: Callable
  report: Callable


def sweep_name(bench: SweepExperiment, opts) -> str:
  """The sweep the command names: --sweep NAME (a key of the experiment's
  sweeps), else `quick` with --quick, else `full`."""
  name = getattr(opts, "sweep", None)
  if name is None:
    return "quick" if opts.quick else "full"
  if opts.quick and name != "quick":
    raise SystemExit("--quick is --sweep quick; give one of them.")
  if name not in bench.sweeps:
    raise SystemExit(f"--sweep: one of {', '.join(bench.sweeps)};"
                     f" got {name!r}.")
  return name


def configure(bench: SweepExperiment, opts) -> Sweep:
  """The named sweep (`sweep_name`), its arms narrowed by --arms (the
  reference, its first, kept first) and its base configuration changed by
  --set (each run's name follows its configuration, so a changed base is
  another sweep's runs); its seeds are fixed."""
  sweep = bench.sweeps[sweep_name(bench, opts)]
  if opts.arms:
    arms = tuple(opts.arms.split(","))
    unknown = [a for a in arms if a not in sweep.arms]
    if unknown or arms[0] != sweep.arms[0]:
      raise SystemExit(f"--arms: a list of {', '.join(sweep.arms)} that"
                       f" starts with the reference {sweep.arms[0]}.")
    sweep = dataclasses.replace(sweep, arms=arms)
  if opts.overrides:
    sweep = dataclasses.replace(
        sweep, base=driver.override(sweep.base, opts.overrides))
  return sweep


def main(bench: SweepExperiment, opts) -> dict:
  """--robustness [--sweep NAME]: the sweep's runs (unless --report-only;
  `run`, with --worker, --time-budget and --dry-run), then its report, and
  its RESULTS.md section with --results-md (under the report's heading,
  else the experiment's). Its default folder: runs/<folder>, or
  runs/<folder>_<NAME> for a sweep other than `full`."""
  driver.refuse(opts, "--robustness", "its SWEEP", ("seeds", "hp_from"))
  sweep, preset = configure(bench, opts), sweep_name(bench, opts)
  out = opts.out or harness.default_out(
      bench.folder + ("" if preset == "full" else "_" + preset))
  if opts.note:
    harness.write_text(out / "notes.md", opts.note.strip() + "\n")
  data_id = None      # --report-only: the one its runs record
  if not opts.report_only:
    data_id, execute, kwargs = bench.prepare(sweep, out, opts)
    run(sweep, out, bench.names(sweep, data_id), execute,
        worker=opts.worker, time_budget=opts.time_budget, log=opts.log,
        dry_run=opts.dry_run, **kwargs)
    if opts.dry_run:
      return {}
  rep = bench.report(sweep, preset, out, data_id, opts.results_md)
  if opts.results_md:
    harness.write_section(opts.results_md, rep.get("heading", bench.section),
                          rep["section"])
  opts.log(f"results: {harness.portable(out)}")
  return rep
