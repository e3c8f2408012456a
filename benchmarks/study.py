"""The study every benchmark runs: fair tuning on validation, then paired
seeds, planned from the finished runs (so it resumes anywhere).

A `Study` names its arms, its tuning seeds, its paired seeds and the sizes
its main arms run at; an experiment says how to find a finished run, how
to score one and what it is called (`Finished`; `indexed` for runs held
as {name: record}). This module decides the rest, the same way for the
CIFAR and the language-model benchmarks:

- **Tuning.** An arm's grid is a product of axes ((name, values), ...). A
  point's score is the mean over the tuning seeds of the experiment's
  validation score; the best point is chosen (ties: the first), and an
  axis whose best value lies on its edge is widened by one geometric step,
  at most `max_extensions` times, until the best is interior
  (`tuned_axes`). The base arm (AdamW) is tuned first: its choice
  is the non-Q/K AdamW (`Task.base`) of every arm that does not set its own
  (`PlanArm.own_base`, e.g. a whole-model AdamW recipe).
- **Plan.** The main arms' tuning, then their paired runs: at each size in
  order, discovery seeds before confirmation seeds (the seeds of
  `harness.seed_block`, fixed before any run), seed-major so that a
  stopped study leaves whole pairs; then each other arm in turn: its
  tuning, then its paired runs at the first size. The plan stops at the
  first tuning with runs left (run those, then ask again: the grid may
  widen); with `assume` (estimates only) a grid's centre stands in for a
  choice not yet made, and the whole study is listed, the runs that rest
  on such a guess marked provisional. An arm asked for alone brings the
  arms it builds on, for their choice only (`with_dependencies`).
- **Estimate.** The runs left per stage and their expected seconds
  (`estimate`), and how many more a grid could still add (`widening_bound`).
- **State.** What a report reads: per arm its tuning grid with each
  point's runs, its choice and its paired runs, and the runs planned and
  left (`state`).
- **Runner.** `run_tasks` runs the first unfinished run of a plan, then
  asks for the plan again, until nothing is left or a time budget would
  be overrun; `run_study` also calls back after each paired run (the
  tables so far); `run_list` runs a fixed list (grokking's jobs, the LM's
  seeds).

This module is the benchmarks' one planner: the paired study here; the
learning-rate sweep (`benchmarks.sweep`: its grid and seed-major tasks,
run by `run_tasks`); a command's list of configurations (the LM's
`experiment.configs`: the product grid of its --set values, `grid_points`,
each point applied by `driver.override`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from benchmarks import harness

# --------------------------------------------------------------------------
# Fair tuning: product grids scored on validation, the best point, and the
# grid widened geometrically past any edge its best point lands on (every
# arm the same density, so no arm wins by a finer search).


def point_key(point: Mapping) -> str:
  """A grid point {name: value} as a name: 'lr0.001_weight_decay0.1'
  (names sorted, values %g; 'none' for the empty point)."""
  return "_".join(f"{k}{v:g}" for k, v in sorted(point.items())) or "none"


def grid_points(axes) -> list:
  """The points {name: value} of the product grid of `axes` ((name,
  values), ...), in order (the last axis varies fastest)."""
  names = [name for name, _ in axes]
  return [dict(zip(names, vals))
          for vals in itertools.product(*(v for _, v in axes))]


def best_point(axes, scores: Mapping, higher_is_better: bool = True,
               key: Callable[[Mapping], str] = point_key) -> dict:
  """The grid point with the best score (ties: the first in grid order);
  scores maps key(point) to the point's score (e.g. the mean over the
  tuning seeds of a validation accuracy, higher_is_better=True, or of a
  validation loss, higher_is_better=False)."""
  points = grid_points(axes)
  sign = 1.0 if higher_is_better else -1.0
  return max(points, key=lambda p: (sign * scores[key(p)], -points.index(p)))


def extend_axes(axes, best: Mapping) -> Optional[tuple]:
  """`axes` with every axis whose best value is its first or last value
  extended one geometric step beyond it (the ratio of the edge to its
  neighbour, rounded to 3 significant digits); None when the best is
  interior on every axis (an axis of a single value has no edge to
  extend)."""
  out, changed = [], False
  for name, vals in axes:
    vals = tuple(vals)
    if len(vals) >= 2 and best[name] in (vals[0], vals[-1]):
      lo = best[name] == vals[0]
      a, b = (vals[0], vals[1]) if lo else (vals[-1], vals[-2])
      new = float(f"{a * a / b:.3g}")
      vals = (new,) + vals if lo else vals + (new,)
      changed = True
    out.append((name, vals))
  return tuple(out) if changed else None


class Tuning(NamedTuple):
  """Where a tuning grid stands: its axes (widened as far as the finished
  runs call for), the scores of those axes' points (None while a run is
  missing), whether it is finished (every run done, and the best interior
  or max_extensions widenings made) and how many widenings were made."""
  axes: tuple
  scores: Optional[dict]
  finished: bool
  widenings: int


def tuned_axes(axes, scores_of: Callable[[tuple], Optional[dict]],
               max_extensions: int, higher_is_better: bool = True,
               key: Callable[[Mapping], str] = point_key) -> Tuning:
  """Widens `axes` past the edges its best point lands on, at most
  max_extensions times. scores_of(axes) is {key(point): score} for every
  point of axes, or None while some run of them is unfinished (then the
  grid stops growing: run those, then ask again)."""
  axes = tuple((name, tuple(vals)) for name, vals in axes)
  for widenings in range(max_extensions + 1):
    scores = scores_of(axes)
    if scores is None:
      return Tuning(axes, None, False, widenings)
    wider = extend_axes(axes, best_point(axes, scores, higher_is_better, key))
    if wider is None or widenings == max_extensions:
      return Tuning(axes, scores, True, widenings)
    axes = wider
  raise AssertionError("unreachable")


# --------------------------------------------------------------------------
# The plan.

STAGES = ("tune", "discovery", "confirmation")
PAIRED = STAGES[1:]


class PlanArm(NamedTuple):
  """An arm as the plan sees it.

  axes: its tuning grid; () when it has nothing to tune; None when it takes
  the choice of `tune_from` (an ablation at the tuned setting). own_base:
  its grid sets its non-Q/K AdamW itself. main: run at every size and
  tuned first. paired: False for an arm in the study only for its choice
  (one that another arm builds on): tuned, never paired.
  """
  name: str
  axes: Optional[tuple] = ()
  tune_from: Optional[str] = None
  own_base: bool = False
  main: bool = True
  paired: bool = True


def sets_own_base(arm, base_arm: str = "adamw") -> bool:
  """Whether the arm's own hyperparameters set its non-Q/K AdamW (the base
  arm, an arm with own_base: e.g. a whole-model AdamW recipe) rather than
  the base arm's choice; `arm`: anything with a name and own_base.

  >>> sets_own_base(PlanArm("adamw")), sets_own_base(PlanArm("stiefel"))
  (True, False)
  """
  return arm.name == base_arm or arm.own_base


@dataclasses.dataclass(frozen=True)
class Study:
  """arms: in run order. main_seeds / other_seeds: the paired seeds of the
  main and the other arms (discovery and confirmation seeds alike).
  sizes: the main arms' paired runs run at each (in order; None: the
  experiment has one size), the others at the first. fixed: ((arm, point),
  ...) chosen elsewhere, not tuned."""
  arms: tuple
  tune_seeds: tuple
  main_seeds: tuple
  other_seeds: tuple
  sizes: tuple = (None,)
  base_arm: str = "adamw"
  max_extensions: int = 3
  higher_is_better: bool = True
  fixed: tuple = ()

  def __post_init__(self):
    # An arm's choice must be made before its runs are planned: what it
    # builds on comes earlier, and is a main arm if it is one.
    names = self.names
    for i, a in enumerate(self.arms):
      needs = ([] if self.own_base(a.name) else [self.base_arm]) + (
          [a.tune_from] if a.axes is None else [])
      for need in needs:
        if need not in names or names.index(need) > i or (
            a.main and not self.arm(need).main):
          raise ValueError(
              f"study: arm {a.name!r} builds on {need!r}, which must be an"
              f" arm of the study before it (and a main arm if {a.name!r}"
              f" is one); arms in order: {list(names)}.")

  def own_base(self, name: str) -> bool:
    """Whether the arm sets its own non-Q/K AdamW (`sets_own_base`)."""
    return sets_own_base(self.arm(name), self.base_arm)

  @property
  def names(self) -> tuple:
    return tuple(a.name for a in self.arms)

  def arm(self, name: str) -> PlanArm:
    for a in self.arms:
      if a.name == name:
        return a
    raise KeyError(f"study: no arm {name!r}; arms: {list(self.names)}.")

  def seeds(self, name: str) -> tuple:
    return self.main_seeds if self.arm(name).main else self.other_seeds


def with_dependencies(arms: Sequence[PlanArm], names: Sequence[str],
                      base_arm: str = "adamw") -> tuple:
  """The arms of `arms` (in run order) that `names` asks for, with the
  arms they build on: the base arm (whose choice is every other arm's
  non-Q/K AdamW) and, transitively, the arm each takes its choice from
  (`tune_from`). Those join for their choice only: paired=False.

  >>> arms = (PlanArm("adamw", ()), PlanArm("stiefel", ()),
  ...         PlanArm("no_cap", None, tune_from="stiefel", main=False))
  >>> [(a.name, a.paired) for a in with_dependencies(arms, ["no_cap"])]
  [('adamw', False), ('stiefel', False), ('no_cap', True)]
  """
  by_name = {a.name: a for a in arms}
  unknown = sorted(set(names) - set(by_name))
  if unknown:
    raise ValueError(f"unknown arms {unknown}; known: {list(by_name)}.")
  need, todo = set(), [base_arm, *names]
  while todo:
    a = todo.pop()
    if a not in need:
      need.add(a)
      todo += [by_name[a].tune_from] if by_name[a].tune_from else []
  return tuple(a._replace(paired=a.name in names) for a in arms
               if a.name in need)


class Task(NamedTuple):
  """One run: its stage (STAGES, or an experiment's own), arm, the arm's
  hyperparameters (point), the non-Q/K AdamW it trains on (base: {} for
  the base arm and the arms that set their own), seed and size (None for
  tuning runs, which train on the tuning split)."""
  stage: str
  arm: str
  point: Mapping
  base: Mapping
  seed: int
  size: Optional[int] = None
  provisional: bool = False


class Finished(NamedTuple):
  """How a study reads the finished runs: record(task) is the run's record
  (None while it is not finished under this identity); score(record) its
  validation score; name(task) (if given) the run's name in its store, so
  that a run two stages name is planned once."""
  record: Callable[[Task], Optional[dict]]
  score: Callable[[dict], float]
  name: Optional[Callable[[Task], str]] = None


def indexed(done: Mapping[str, dict], name: Callable[[Task], str],
            score: Callable[[dict], float]) -> Finished:
  """The finished runs `done` ({run name: record}) as a study reads them:
  a task's record is done[name(task)]; name is the runs' name.

  >>> runs = indexed({"adamw_s0": {"acc": 0.5}}, lambda t: f"{t.arm}_s{t.seed}",
  ...                lambda r: r["acc"])
  >>> runs.record(Task("discovery", "adamw", {}, {}, 0))
  {'acc': 0.5}
  """
  return Finished(lambda t: done.get(name(t)), score, name)


def centre(axes) -> dict:
  """The middle point of a grid (what an estimate assumes before tuning)."""
  return {name: vals[len(vals) // 2] for name, vals in axes}


def tune_task(arm: str, point: Mapping, base: Mapping, seed: int,
              provisional: bool = False) -> Task:
  return Task("tune", arm, dict(point), dict(base), seed, None, provisional)


def tuning(study: Study, runs: Finished, arm: str,
           base: Mapping) -> Tuning:
  """The arm's grid (on top of the non-Q/K AdamW `base`), widened as far as
  its finished runs call for, with their mean scores."""
  def scores_of(axes):
    out = {}
    for p in grid_points(axes):
      recs = [runs.record(tune_task(arm, p, base, s))
              for s in study.tune_seeds]
      if any(r is None for r in recs):
        return None
      out[point_key(p)] = float(np.mean([runs.score(r) for r in recs]))
    return out
  return tuned_axes(study.arm(arm).axes, scores_of, study.max_extensions,
                    study.higher_is_better)


def base_of(study: Study, runs: Finished, arm: str,
            assume: bool = False) -> Optional[dict]:
  """The non-Q/K AdamW of the arm's runs: {} for the base arm and the arms
  that set their own, else the base arm's choice (None until it is made)."""
  if study.own_base(arm):
    return {}
  c = choice(study, runs, study.base_arm, assume)
  return None if c is None else dict(c[0])


def choice(study: Study, runs: Finished, arm: str,
           assume: bool = False) -> Optional[tuple]:
  """(point, base): the arm's chosen hyperparameters and its non-Q/K AdamW,
  or None while its tuning (or one it builds on) is unfinished; with
  assume, the centre of the current grid stands in (estimates only)."""
  base = base_of(study, runs, arm, assume)
  if base is None:
    return None
  fixed = dict(study.fixed)
  a = study.arm(arm)
  if arm in fixed:
    return dict(fixed[arm]), base
  if a.axes is None:
    c = choice(study, runs, a.tune_from, assume)
    return None if c is None else (c[0], base)
  if not a.axes:
    return {}, base
  t = tuning(study, runs, arm, base)
  if t.finished:
    return best_point(t.axes, t.scores, study.higher_is_better), base
  return (centre(t.axes), base) if assume else None


def _tuned(study: Study, runs: Finished, arm: str, assume: bool):
  """(the tuning runs of the arm's current grid, its choice (point, base,
  provisional) or None while it is not made); provisional: resting on a
  guess (assume), as every run that waits on an unmade choice."""
  base = base_of(study, runs, arm, assume)
  if base is None:
    return [], None
  guessed = base_of(study, runs, arm) is None
  tasks = []
  if study.arm(arm).axes and arm not in dict(study.fixed):
    tasks = [tune_task(arm, p, base, s, guessed)
             for p in grid_points(tuning(study, runs, arm, base).axes)
             for s in study.tune_seeds]
  c = choice(study, runs, arm, assume)
  if c is None:
    return tasks, None
  # Without assume the choice is made; with it, it may be a guess.
  return tasks, (*c, assume and choice(study, runs, arm) is None)


def stages(study: Study, runs: Finished, assume: bool = False) -> list:
  """Every run the finished runs let us name, in the order of the plan
  (see the module's docstring)."""
  tasks = []
  main = [a.name for a in study.arms if a.main]
  groups = [(main, study.sizes)] + [([a.name], study.sizes[:1])
                                     for a in study.arms if not a.main]
  for arms, sizes in groups:
    chosen = {}
    for arm in arms:
      tune, c = _tuned(study, runs, arm, assume)
      tasks += tune
      if c is None:
        return tasks
      chosen[arm] = c
    for block in ("discovery", "confirmation"):
      for size in sizes:
        seeds = sorted({s for a in arms for s in study.seeds(a)
                        if harness.seed_block(s) == block})
        tasks += [Task(block, a, chosen[a][0], chosen[a][1], s, size,
                       chosen[a][2])
                  for s in seeds for a in arms
                  if s in study.seeds(a) and study.arm(a).paired]
  return tasks


def plan(study: Study, runs: Finished, assume: bool = False,
         first=()) -> list:
  """`first` (an experiment's own runs, e.g. an external reference), then
  the study's `stages`; a run named twice (by `runs.name`) is listed once,
  at the first."""
  tasks = list(first) + stages(study, runs, assume)
  if runs.name is None:
    return tasks
  seen = set()
  return [t for t in tasks
          if not ((n := runs.name(t)) in seen or seen.add(n))]


def remaining(study: Study, runs: Finished, assume: bool = False,
              first=()) -> list:
  """The plan's runs that are not finished."""
  return [t for t in plan(study, runs, assume, first)
          if runs.record(t) is None]


def paired_task(study: Study, runs: Finished, arm: str, seed: int,
                size: Optional[int] = None) -> Task:
  """The paired run of `arm` at (seed, size), at the arm's choice."""
  c = choice(study, runs, arm)
  if c is None:
    raise RuntimeError(f"{arm}: tuning runs unfinished.")
  return Task(harness.seed_block(seed), arm, c[0], c[1], seed, size)


# --------------------------------------------------------------------------
# The study's state, as its report reads it: the plan against the runs.


def tuning_runs(study: Study, runs: Finished, arm: str) -> Optional[dict]:
  """The arm's tuning as the plan reads it from the finished runs:
  dict(base, axes, finished, widenings, points, chosen, on_edge): its
  non-Q/K AdamW, its grid as far as it is widened, each grid point with its
  finished runs ([(point, {seed: record})]), its chosen point (None while
  unfinished) and whether that lies on an edge the widenings left. None
  while it waits on the base arm's tuning, or when it tunes nothing (no
  grid, or a choice fixed elsewhere)."""
  base = base_of(study, runs, arm)
  if base is None or not study.arm(arm).axes or arm in dict(study.fixed):
    return None
  t = tuning(study, runs, arm, base)
  points = [(p, {s: r for s in study.tune_seeds
                 if (r := runs.record(tune_task(arm, p, base, s))) is not None})
            for p in grid_points(t.axes)]
  chosen = (best_point(t.axes, t.scores, study.higher_is_better)
            if t.finished else None)
  return dict(base=base, axes=t.axes, finished=t.finished,
              widenings=t.widenings, points=points, chosen=chosen,
              on_edge=t.finished and extend_axes(t.axes, chosen) is not None)


def paired_runs(study: Study, runs: Finished, arm: str,
                size: Optional[int] = None) -> dict:
  """{seed: record} of the arm's finished paired runs at its choice (at
  `size`)."""
  c = choice(study, runs, arm)
  if c is None:
    return {}
  return {s: r for s in study.seeds(arm) if (r := runs.record(Task(
      harness.seed_block(s), arm, c[0], c[1], s, size))) is not None}


def state(study: Study, runs: Finished, first=()) -> dict:
  """The study's plan read against the finished runs (named: runs.name):
  per arm its tuning (`tuning_runs`), its choice and its paired runs (at
  the first size); the planned runs ({name: Task}, `plan` with `first`)
  and those not done."""
  planned = {runs.name(t): t for t in plan(study, runs, False, first)}
  return dict(
      tuning={a: tuning_runs(study, runs, a) for a in study.names},
      choices={a: choice(study, runs, a) for a in study.names},
      paired={a: paired_runs(study, runs, a, study.sizes[0])
              for a in study.names},
      planned=planned,
      left=[t for t in planned.values() if runs.record(t) is None])


def comparison_pairs(arms: Sequence[str], baseline: str = "adamw",
                     method: str = "stiefel") -> list:
  """The (treatment, baseline) pairs a study reports, in order: each arm
  against `baseline`, then `method` against each other arm (the method
  against every alternative to it, so a positive difference always reads
  the same way for it)."""
  out = [(a, baseline) for a in arms if a != baseline]
  if method in arms:
    out += [(method, a) for a in arms if a not in (baseline, method)]
  return out


def estimate(tasks: Sequence, expected_s: Callable[[Any], Optional[float]],
             stages_: Sequence[str] = STAGES) -> dict:
  """The runs of `tasks` (anything with a stage and provisional flag, e.g.
  `remaining(..., assume=True)`) per stage of `stages_` and their expected
  wall seconds (expected_s(task), called in task order; None: untimed,
  counted as 0 s), with how many are untimed and how many stand in for a
  choice not yet made."""
  secs = [expected_s(t) for t in tasks]
  seconds = {st: sum(x or 0.0 for t, x in zip(tasks, secs) if t.stage == st)
             for st in stages_}
  return dict(runs={st: sum(t.stage == st for t in tasks) for st in stages_},
              seconds=seconds, untimed=sum(x is None for x in secs),
              provisional=sum(bool(t.provisional) for t in tasks),
              total_runs=len(tasks), total_seconds=sum(seconds.values()))


def widening_bound(study: Study, runs: Finished) -> list:
  """[(tuning Task, extra points)]: per unfinished grid, a run at its
  centre (provisional) and how many more points it would have if every
  axis of it widened at each widening left (an upper bound; the plan
  counts the current grid only)."""
  out = []
  for a in study.arms:
    if not a.axes or a.name in dict(study.fixed):
      continue
    base = base_of(study, runs, a.name, assume=True)
    if base is None:
      continue
    t = tuning(study, runs, a.name, base)
    if t.finished:
      continue
    left = study.max_extensions - t.widenings
    now = math.prod(len(v) for _, v in t.axes)
    most = math.prod(len(v) + (left if len(v) >= 2 else 0) for _, v in t.axes)
    out.append((tune_task(a.name, centre(t.axes), base, study.tune_seeds[0],
                          True), most - now))
  return out


# --------------------------------------------------------------------------
# The study runner: every experiment's plan, run in order, resumable.


def run_study(remaining: Callable[[], Sequence], execute: Callable, *,
              on_paired: Optional[Callable[[], Any]] = None, **kwargs) -> int:
  """`run_tasks` of a study's plan (`remaining()`: its unfinished runs,
  asked anew after each run), calling on_paired() after each paired run
  (e.g. to write the tables so far). kwargs: `run_tasks`'s."""
  def after(task, _):
    if on_paired is not None and task.stage in PAIRED:
      on_paired()
  return run_tasks(remaining, execute, after=after, **kwargs)


def run_list(tasks: Sequence, execute: Callable, **kwargs) -> list:
  """`run_tasks` of a fixed list of tasks (no plan to ask again: each runs
  once, in order); returns those a time budget left (none when all ran).
  kwargs: `run_tasks`'s.

  >>> run_list([1, 2], lambda t: {}, desc="x", describe=lambda t, _: f"{t}",
  ...          progress=False)
  [1 planned left] 1
  [0 planned left] 2
  []
  """
  left = list(tasks)

  def execute_one(task):
    rec = execute(task)
    left.remove(task)
    return rec

  run_tasks(lambda: left, execute_one, **kwargs)
  return left


def run_tasks(remaining: Callable[[], Sequence], execute: Callable, *,
              desc: str, describe: Callable, after: Optional[Callable] = None,
              expected_s: Optional[Callable] = None, time_budget: float = 0.0,
              log: Callable = print, progress: bool = True) -> int:
  """Runs `remaining()[0]` until `remaining()` is empty: the list is asked
  anew after each run, so a plan that depends on finished runs (a tuning
  grid that widens, paired runs waiting on a tuning choice) follows them.

  execute(task) trains one run and returns its record; log gets
  describe(task, record) after it, then after(task, record) runs (the
  tables so far). With time_budget > 0 the runner stops before a run
  expected to end past that many seconds from its start (expected_s(task),
  else the longest run so far). Returns the number of runs made.
  """
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(desc=desc, unit="run", mininterval=5)
  t0, made, longest = time.time(), 0, 0.0
  while left := remaining():
    task = left[0]
    if bar is not None:
      bar.total = made + len(left)
      bar.refresh()
    expect = (expected_s(task) if expected_s else None) or longest
    if time_budget and made and time.time() - t0 + expect > time_budget:
      log(f"time budget {time_budget:.0f} s: stopping with {len(left)}"
          f" planned run(s) left (the next expected to take {expect:.0f} s)")
      break
    ts, after_this = time.time(), len(left) - 1   # before execute changes it
    rec = execute(task)
    longest = max(longest, time.time() - ts)
    made += 1
    line = f"[{after_this} planned left] {describe(task, rec)}"
    if bar is not None:
      bar.write(line)
      bar.update(1)
    else:
      log(line)
    if after is not None:
      after(task, rec)
  if bar is not None:
    bar.close()
  return made
