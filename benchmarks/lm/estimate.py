"""The study's time estimate: the runs left per stage, their expected wall
time, and the line printed before a study starts."""

from __future__ import annotations

from typing import Mapping, Optional

from benchmarks import harness, study as study_lib
from benchmarks.lm.steps import train_config
from benchmarks.lm.study import (STAGES, Study, finished, remaining,
                                 task_config)
from benchmarks.lm.timing import run_seconds


def estimate(study: Study, done: Mapping, data_id: str, rates: Mapping,
             probed: Optional[tuple] = None) -> dict:
  """The runs left to do per stage and their expected wall seconds
  (`benchmarks.study.estimate`; untimed where no run of that size has
  been timed), and the widening bound (`benchmarks.study.widening_bound`)."""
  compiled = set()
  seconds = lambda t: run_seconds(task_config(study, t), rates, probed)

  def expected_s(task: study_lib.Task) -> Optional[float]:
    s, tc = seconds(task), train_config(task_config(study, task))
    if probed is not None and tc not in compiled:
      compiled.add(tc)   # one compilation per config
      s += probed[1]
    return s

  est = study_lib.estimate(remaining(study, done, data_id, assume=True),
                           expected_s, STAGES)
  widen = study_lib.widening_bound(study, finished(study, done, data_id))
  n = len(study.tune_seeds)
  compile_s = 0.0 if probed is None else probed[1]
  return dict(est, widening_runs=sum(k * n for _, k in widen),
              widening_seconds=sum(k * (n * (seconds(t) or 0.0) + compile_s)
                                   for t, k in widen),
              source="probe" if probed else "records")


def estimate_text(study: Study, est: dict, n_timed: int) -> str:
  """The estimate as the line printed before a study starts."""
  r, s = est["runs"], est["seconds"]
  hours = lambda x: f"{x / 3600:.1f} h" if x >= 3600 else f"{x / 60:.1f} min"
  parts = [f"{r['reference']} reference",
           f"{r['tune']} tuning ({study.tune_iters} iterations, seeds"
           f" {harness.format_seeds(study.tune_seeds)})",
           f"{r['discovery'] + r['confirmation']} paired"
           f" ({study.base.max_iters} iterations: {r['discovery']} discovery,"
           f" {r['confirmation']} confirmation)"]
  src = ("the probe" if est["source"] == "probe" else
         f"the wall time per iteration of {n_timed} finished run(s) of this"
         " size, per arm where it has run, else of every arm")
  text = (f"study: {est['total_runs']} runs to do ({', '.join(parts)});"
          f" estimated {hours(est['total_seconds'])} wall on this machine"
          f" (tuning {hours(s['tune'])}, paired"
          f" {hours(s['discovery'] + s['confirmation'])}), from {src}")
  if est["untimed"] == est["total_runs"] and est["total_runs"]:
    text += ("; but no run of this size has been timed yet (--probe N"
             " times one)")
  elif est["untimed"]:
    text += (f"; {est['untimed']} run(s) of a size never timed are not"
             " counted (--probe N times one)")
  if est["provisional"]:
    text += (f"; {est['provisional']} run(s) wait on a tuning choice and are"
             " counted at their grid's centre")
  if est["widening_runs"]:
    text += (f"; up to {est['widening_runs']} more tuning runs"
             f" ({hours(est['widening_seconds'])}) if every unfinished grid"
             f" widens on every axis {study.max_extensions} time(s)")
  return text + "."
