"""What a run takes: timed by a probe of a few steps, or read from the
finished runs' wall time per iteration at the same size."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping, Optional, Sequence

from benchmarks import harness
from benchmarks.lm.config import Config
from benchmarks.lm.data import Corpus
from benchmarks.lm.train import train_run


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
