"""The study's runs: its jobs (arm, seed, steps) in order, split between
parallel processes, and run in order (`benchmarks.study.run_list`), each
resumable, with an optional time budget.

Grokking's study is a fixed list, not a plan: no tuning, every seed a
discovery seed, a long run that continues one seed's run and an rsgd probe,
and a run's length varies (so the progress bar counts steps, not runs).
What `benchmarks.study` plans (tuning grids, discovery and confirmation
blocks) does not apply; its runner does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks import harness, study as study_lib
from benchmarks.grokking.config import (PROBE_ARM, Config, Study,
                                        run_identity, run_name)
from benchmarks.grokking.train import train_run


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
  run = (harness.RunStore(out).load(run_name(arm, seed), run_identity(cfg))
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
  jobs = schedule(study)
  if parts > 1:
    jobs = part_of(cfg, jobs, out, part, parts)
  bar = None
  if show_progress:
    from tqdm import tqdm
    bar = tqdm(total=sum(j[2] for j in jobs), unit="step", desc="grokking",
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
      jobs, execute, desc="grokking", describe=lambda job, _: f"{job[0]}"
      f" seed {job[1]}: step {job[2]}", log=lambda _: None, progress=False,
      expected_s=expected_s, time_budget=time_budget)
  if bar is not None:
    bar.close()
  if left:   # stopped by the time budget: say so (the bar does not)
    print(f"time budget {time_budget:.0f} s: stopped with {len(left)} job(s)"
          " left; the same command resumes them.", file=sys.stderr)
  return runs
