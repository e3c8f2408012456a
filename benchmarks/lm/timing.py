"""What a run takes, timed by a probe of a few steps or read from the
finished runs' wall time per iteration at the same size, and the study's
time estimate: the runs left per stage, their expected wall time, and the
line printed before a study starts."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping, Optional, Sequence

from benchmarks import harness, study as study_lib
from benchmarks.lm.config import Config
from benchmarks.lm.data import Corpus
from benchmarks.lm.study import (STAGES, Study, finished, remaining,
                                 task_config)
from benchmarks.lm.train import train_config, train_run


def measure_steps(cfg: Config, seed: int, corpus: Corpus,
                  steps: int) -> tuple:
  """(seconds per step, seconds to compile, steps timed): `steps` steps of
  cfg timed after one compiled chunk (nothing saved)."""
  pcfg = dataclasses.replace(cfg, eval_interval=math.gcd(steps,
                                                         cfg.max_iters))
  steps = max(steps, pcfg.eval_interval)
  t0 = time.time()
  train_run(pcfg, seed, corpus, None, max_iters=pcfg.eval_interval,
            log=lambda *_: None)
  t1 = time.time()
  train_run(pcfg, seed, corpus, None, max_iters=steps, log=lambda *_: None)
  t2 = time.time()
  compile_s = max(t1 - t0 - (t2 - t1) * pcfg.eval_interval / steps, 0.0)
  return (t2 - t1) / steps, compile_s, steps


def projected_seconds(cfgs: Sequence[Config], per_step: float,
                      compile_s: float) -> float:
  """The wall time of runs of cfgs at per_step seconds per training step
  (an evaluation of eval_iters batches of both splits costing about 2/3
  of a step per batch) and compile_s each to compile."""
  return sum(c.max_iters * per_step * (1 + 2 * c.eval_iters / 3
                                       / c.eval_interval) + compile_s
             for c in cfgs)


def probe(cfg: Config, seed: int, corpus: Corpus, steps: int, todo: list,
          log=print) -> float:
  """Times `steps` steps (after one compiled chunk) of cfg; returns and
  prints the projected wall time of the runs in `todo`."""
  per_step, compile_s, steps = measure_steps(cfg, seed, corpus, steps)
  total = projected_seconds(todo, per_step, compile_s)
  log(f"probe: {steps} steps of {cfg.arm} in {per_step * steps:.1f} s"
      f" ({1e3 * per_step:.1f} ms/step, about {compile_s:.0f} s to compile);"
      f" projected wall time of the {len(todo)} run(s) to do:"
      f" {total / 60:.1f} min")
  return total


# What the runs so far took, per iteration, at the same size.
TIMING_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                 "dropout", "eval_interval", "eval_iters")


def timing_key(config: Mapping) -> str:
  """The fields that set a run's time per iteration (not its lr)."""
  return harness.digest([config[f] for f in TIMING_FIELDS])


def iteration_rates(records: Sequence[dict]) -> dict:
  """{(timing key, arm or None): wall seconds per iteration} of the
  finished runs (compilation and evaluations included), per arm and pooled
  over the arms."""
  wall, iters = {}, {}
  for r in records:
    if r.get("final") is None or not r["final"].get("step"):
      continue
    for k in ((timing_key(r["config"]), r["config"]["arm"]),
              (timing_key(r["config"]), None)):
      wall[k] = wall.get(k, 0.0) + r["wall_s"]
      iters[k] = iters.get(k, 0) + r["final"]["step"]
  return {k: wall[k] / iters[k] for k in wall}


def run_seconds(cfg: Config, rates: Mapping,
                probed: Optional[tuple] = None) -> Optional[float]:
  """A run's expected wall time: from a probe (per_step, compile_s) if
  given (not counting the compilation: see `estimate`), else from the
  rates of the arm's runs of this size, else of any arm's (compilation
  included); None if nothing of this size has run."""
  if probed is not None:
    return projected_seconds([cfg], probed[0], 0.0)
  key = timing_key(dataclasses.asdict(cfg))
  rate = rates.get((key, cfg.arm), rates.get((key, None)))
  return None if rate is None else rate * cfg.max_iters


# --------------------------------------------------------------------------
# The study's estimate.


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
