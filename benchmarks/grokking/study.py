"""The studies: which runs, their jobs (arm, seed, steps) in order, split
between parallel processes and run in order (`benchmarks.study.run_list`),
each resumable, with an optional time budget; and what the report
(`benchmarks.reports.grokking`) reads: a results folder's study (its
study.json) and every saved run of it, partial ones included, under any
library version.

Two kinds:

- `PairedStudy` (`PAIRED`: the two five-seed studies `frac0.5` and
  `frac0.3`, the slingshot pilot `slingshot`, `frac0.3_demo` (the main
  job's reduced train-fraction-0.3 cell) and `quick`): the shared
  study (`benchmarks.study`) of its arms at the configuration's fixed
  rates, nothing tuned: discovery seeds first, then the confirmation seeds
  (`harness.seed_block`: 500 on), seed-major, every run `steps` long. Its
  report gives paired tables per endpoint and seed block, Holm across the rows
  of all three endpoints of a block, and the claims policy's findings.
- `Study` (`STUDIES`: default, full, quick): the 0.1.0 fixed list (the
  main job's train-fraction-0.5 cell and the committed reference
  folders): every seed a discovery seed, a long run that continues one
  seed's run and an rsgd probe, runs of different lengths (so the
  progress bar counts steps, not runs).

The main job (`MAIN_JOB`): the cells `python -m benchmarks grokking` runs
when nothing is named, the confirmed finding reduced beside the null.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from benchmarks import harness, study as study_lib
from benchmarks.grokking.config import PROBE_ARM, Config, run_name
from benchmarks.grokking.data import data_id
from benchmarks.grokking.train import train_run


@dataclasses.dataclass(frozen=True)
class Study:
  """Which runs: `seeds` x arms to `steps`; `long_seed` continued to
  `long_steps` (0: none); the rsgd probe for `probe_steps` on each seed."""
  steps: int
  seeds: tuple
  long_steps: int = 0
  long_seed: int = 0
  probe_steps: int = 0
  arms: tuple = ("adamw", "stiefel")

  @classmethod
  def from_dict(cls, d: dict) -> "Study":
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in d.items()})


STUDIES = {
    "default": Study(steps=1000, seeds=(0, 1, 2, 3, 4), probe_steps=200),
    "full": Study(steps=3000, seeds=(0, 1, 2, 3, 4), long_steps=20000,
                  probe_steps=500),
    "quick": Study(steps=100, seeds=(0, 1), probe_steps=50),
}


@dataclasses.dataclass(frozen=True)
class PairedStudy:
  """The shared study (`shared`) of `arms` (the reference first) on `seeds`
  (those below 500 the discovery block, the others the confirmation block,
  fixed before any run), every run `steps` long (runs that never reach
  the target accuracy are censored there)."""
  steps: int
  seeds: tuple
  arms: tuple = ("adamw", "stiefel")
  kind: str = "paired"

  @classmethod
  def from_dict(cls, d: dict) -> "PairedStudy":
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in d.items()})


FIVE_AND_FIVE = (0, 1, 2, 3, 4, 500, 501, 502, 503, 504)
SLINGSHOT_ARMS = ("adam", "stiefel_nodecay", "stiefel_targeted",
                  "adamw_targeted")
# The paired studies of the presets of the same names (config.PRESETS);
# --study runs the one of the preset (frac0.5, frac0.3 and slingshot are
# paired studies with or without it). Step budgets: train fraction 0.5
# groks in about 500 steps (0.1.0 runs), 0.3 in thousands or never within
# 10,000; the slingshot pilot's 100,000 steps and 3 seeds are the plan's
# (the budget's limit).
PAIRED = {
    "frac0.5": PairedStudy(steps=3000, seeds=FIVE_AND_FIVE),
    "frac0.3": PairedStudy(steps=10000, seeds=FIVE_AND_FIVE),
    "slingshot": PairedStudy(steps=100000, seeds=(0, 1, 2),
                             arms=SLINGSHOT_ARMS),
    "quick": PairedStudy(steps=100, seeds=(0, 500)),
    "default": PairedStudy(steps=1000, seeds=FIVE_AND_FIVE),
    "full": PairedStudy(steps=3000, seeds=FIVE_AND_FIVE),
    # the main job's demonstration of frac0.3's confirmed finding: its
    # discovery seeds cut to 2000 steps, where its committed runs already
    # separate (stiefel's val acc above adamw's on 9 of 10 seeds, 5 of 5
    # discovery seeds); no confirmation seeds, so it claims nothing
    "frac0.3_demo": PairedStudy(steps=2000, seeds=(0, 1, 2, 3, 4)),
}


class Cell(NamedTuple):
  """A cell of the main job: a preset (its study, `PAIRED` or `STUDIES`,
  in its default folder) and what it stands for against the committed
  studies (`standing`: the report's notes and the job's summary)."""
  preset: str
  title: str
  standing: str


# The main job (`python -m benchmarks grokking` with no preset, setting,
# seed, arm or folder named): these cells in order, then a summary of both
# (`experiment.summary`). The confirmed finding first, reduced, then the
# 0.1.0 list at train fraction 0.5, where the five-seed study found nothing.
MAIN_JOB = (
    Cell("frac0.3_demo",
         "train fraction 0.3: the CONFIRMED finding, reduced to a"
         " demonstration",
         "A demonstration of a confirmed finding, not a new claim: the"
         " five-seed study `benchmarks/results/grokking/frac0.3` (10,000"
         " steps; discovery seeds 0-4, confirmation seeds 500-504) confirmed"
         " that at train fraction 0.3 Stiefel groks and AdamW does not (final"
         " val acc stiefel - adamw +0.60 on the confirmation seeds, Holm p ="
         " 0.025, wins 5/5). This cell trains its configuration and"
         " discovery seeds for 2000 steps only, where its committed runs"
         " already separate (there: stiefel's val acc above adamw's on 9 of"
         " 10 seeds); five seeds and no confirmation block, so its p-values"
         " are descriptive."),
    Cell("default",
         "train fraction 0.5: the NULL (the 0.1.0 list)",
         "The null: at train fraction 0.5 both arms usually grok within"
         " these 1000 steps, and the five-seed study"
         " `benchmarks/results/grokking/frac0.5` (3000 steps) found no"
         " confirmed difference on any endpoint (findings: none)."),
)


def shared(study: PairedStudy) -> study_lib.Study:
  """The study as `benchmarks.study` plans it: every arm main, nothing to
  tune (no grid: its choice is the configuration's rates), the reference
  arm the base."""
  return study_lib.Study(
      arms=tuple(study_lib.PlanArm(a, ()) for a in study.arms),
      tune_seeds=(), main_seeds=tuple(study.seeds), other_seeds=(),
      base_arm=study.arms[0])


def finished(cfg: Config, study: PairedStudy,
             out: Optional[Path]) -> study_lib.Finished:
  """The study's finished runs in `out` (under this identity, at `steps`)
  as `benchmarks.study` reads them."""
  ident = harness.run_identity(cfg.to_dict(), data_id(cfg.p, cfg.op))
  store = harness.RunStore(out) if out is not None else None

  def record(task):
    run = (store.load(run_name(task.arm, task.seed), ident)
           if store is not None else None)
    return run if run and run["history"]["step"][-1] >= study.steps else None

  return study_lib.Finished(record, lambda _: 0.0,
                            lambda t: run_name(t.arm, t.seed))


def jobs(cfg: Config, study, out: Optional[Path]) -> list:
  """(arm, seed, steps) in run order: the paired study's plan
  (`benchmarks.study.plan`: discovery seeds, then confirmation seeds,
  seed-major), or the fixed list's `schedule`."""
  if isinstance(study, PairedStudy):
    return [(t.arm, t.seed, study.steps) for t in study_lib.plan(
        shared(study), finished(cfg, study, out))]
  return schedule(study)


def schedule(study: Study) -> list:
  """(arm, seed, steps) in run order: the seed study first, then the rsgd
  probe, then the long seed continued."""
  jobs = [(arm, seed, study.steps) for seed in study.seeds
          for arm in study.arms]
  if study.probe_steps:
    jobs += [(PROBE_ARM, seed, study.probe_steps) for seed in study.seeds]
  if study.long_steps > study.steps:
    jobs += [(arm, study.long_seed, study.long_steps) for arm in study.arms]
  return jobs


def remaining(cfg: Config, job: tuple, out: Optional[Path]) -> int:
  """The steps the job has left after `out`'s saved run of it."""
  arm, seed, steps = job
  ident = harness.run_identity(cfg.to_dict(), data_id(cfg.p, cfg.op))
  run = (harness.RunStore(out).load(run_name(arm, seed), ident)
         if out is not None else None)
  return max(0, steps - (run["history"]["step"][-1] if run else 0))


def part_of(cfg: Config, jobs: list, out: Optional[Path], part: int,
            parts: int) -> list:
  """The jobs of `part` (0-based) of `parts` processes: jobs of the same
  (arm, seed) stay together, groups go greedily (largest remaining steps
  first) to the least loaded part, so parallel processes balance and never
  train the same run."""
  groups = {}
  for job in jobs:
    groups.setdefault(job[:2], []).append(job)
  load, assign = [0] * parts, [[] for _ in range(parts)]
  for key in sorted(groups, key=lambda k: -max(
      remaining(cfg, j, out) for j in groups[k])):
    i = load.index(min(load))
    load[i] += max(remaining(cfg, j, out) for j in groups[key])
    assign[i] += groups[key]
  return [j for j in jobs if j in assign[part]]


def run_study(cfg: Config, study: Study, out: Optional[Path],
              show_progress: bool = False, part: int = 0,
              parts: int = 1, command: str = "",
              time_budget: float = 0.0) -> dict:
  """Runs (or resumes) every job (or one part of them); returns the runs
  keyed arm -> seed. With time_budget > 0 it stops before a job expected
  to end past that many seconds (the steps it has left, at the seconds per
  step trained so far in this call); the first job always runs."""
  todo = jobs(cfg, study, out)
  if parts > 1:
    todo = part_of(cfg, todo, out, part, parts)
  bar = None
  if show_progress:
    from tqdm import tqdm
    bar = tqdm(total=sum(j[2] for j in todo), unit="step", desc="grokking",
               mininterval=5.0)
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  spent = [0.0, 0]   # seconds and steps trained so far (resumed ones not)

  def execute(job):
    arm, seed, steps = job
    if bar is not None:
      bar.set_postfix_str(f"{arm} seed {seed} -> {steps}")
    todo, t0 = remaining(cfg, job, out), time.time()
    runs[arm][seed] = train_run(cfg, arm, seed, steps, out, bar,
                                command=command)
    spent[0] += time.time() - t0
    spent[1] += todo
    return runs[arm][seed]

  def expected_s(job) -> Optional[float]:
    return (remaining(cfg, job, out) * spent[0] / spent[1] if spent[1]
            else None)

  # The shared runner; the bar counts steps here (a run's length varies).
  left = study_lib.run_list(
      todo, execute, desc="grokking", describe=lambda job, _: f"{job[0]}"
      f" seed {job[1]}: step {job[2]}", log=lambda _: None, progress=False,
      expected_s=expected_s, time_budget=time_budget)
  if bar is not None:
    bar.close()
  if left:   # stopped by the time budget: say so (the bar does not)
    print(f"time budget {time_budget:.0f} s: stopped with {len(left)} job(s)"
          " left; the same command resumes them.", file=sys.stderr)
  return runs


# --------------------------------------------------------------------------
# What the report reads.


def load_run(cfg: Config, arm: str, seed: int, out: Path,
             runs_from: Sequence[str] = ()) -> Optional[dict]:
  """The saved (possibly partial) run of this configuration under any
  library version (what a report shows), from out or else from the folders
  `runs_from` (relative to out), or None."""
  for folder in [out] + [out / r for r in runs_from]:
    run = harness.RunStore(folder).load_matching(
        run_name(arm, seed), cfg.to_dict(), data_id(cfg.p, cfg.op))
    if run is not None:
      return run
  return None


def saved_study(cfg: Config, study: Study, out: Path,
                runs_from: Sequence[str] = ()) -> dict:
  """Every saved run of the study as it is (partial runs included)."""
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  for arm, seed, _ in jobs(cfg, study, None):
    run = load_run(cfg, arm, seed, out, runs_from)
    if run is not None:
      runs[arm][seed] = run
  return runs


def load_spec(out: Path):
  """(cfg, study, runs_from) from <out>/study.json, or None."""
  spec = harness.read_json(out / "study.json")
  if spec is None:
    return None
  kind = (PairedStudy if spec["study"].get("kind") == "paired" else Study)
  return (Config(**spec["config"]), kind.from_dict(spec["study"]),
          tuple(spec.get("runs_from", ())))


def load_study(out: Path) -> tuple:
  """(cfg, study, runs) of the study saved in `out` (its study.json and
  every saved run, partial ones included): what its report reads."""
  cfg, study, runs_from = load_spec(out)
  return cfg, study, saved_study(cfg, study, out, runs_from)
