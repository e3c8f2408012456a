"""One run, saved and resumable (`benchmarks.training.train_run`): its
history of measurements, one every `log_every` steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from benchmarks import harness, training
from benchmarks.grokking.arms import make_optimizer
from benchmarks.grokking.config import Config, run_identity, run_name
from benchmarks.grokking.data import data_id, make_data
from benchmarks.grokking.model import initial_params
from benchmarks.grokking.steps import chunk_fn, measure_fn


def empty_history() -> dict:
  return {k: [] for k in ("step", "train_loss", "train_acc", "val_loss",
                          "val_acc", "iso", "norms", "move")}


def record(hist: dict, step: int, m: dict, move: Optional[dict]) -> None:
  """Appends one measurement (arrays as lists) to the history."""
  m = jax.tree.map(lambda x: np.asarray(x).tolist(), m)
  hist["step"].append(step)
  for k in ("train_loss", "train_acc", "val_loss", "val_acc", "iso", "norms"):
    hist[k].append(m[k])
  hist["move"].append(None if move is None else
                      jax.tree.map(lambda x: np.asarray(x).tolist(), move))


def train_run(cfg: Config, arm: str, seed: int, steps: int,
              out: Optional[Path] = None, progress=None,
              save_every_s: float = 60.0, command: str = "") -> dict:
  """Trains (arm, seed) to `steps` (a multiple of cfg.log_every), resuming
  from `out`'s saved run of the same identity if there is one (a finished
  one is returned as it is; its checkpoint is kept, so that a longer run
  continues it): `training.train_run`. Returns the run's record."""
  if steps % cfg.log_every:
    raise ValueError(f"steps = {steps} is not a multiple of log_every ="
                     f" {cfg.log_every}.")
  data, measure = make_data(cfg, seed), measure_fn(cfg)
  chunk = chunk_fn(cfg, arm)

  def start():
    params = initial_params(cfg, arm, seed)
    run = dict(arm=arm, seed=seed, config=dataclasses.asdict(cfg),
               identity=run_identity(cfg), data=data_id(cfg.p, cfg.op),
               **harness.versions(),
               machine=harness.machine(), trained_by=[],
               n_train=int(data.train_x.shape[0]),
               n_val=int(data.val_x.shape[0]),
               wall_s=0.0, cpu_s=0.0, history=empty_history())
    return run, (params, make_optimizer(cfg, arm).init(params))

  def advance(carry, _):   # full batch: the step number is not read
    carry, _, move = chunk(carry, None, data.train_x, data.train_y)
    return carry, move

  return training.train_run(
      harness.RunStore(out) if out is not None else None,
      run_name(arm, seed), run_identity(cfg), start=start, chunk=advance,
      record=lambda run, carry, it, move, _: record(
          run["history"], it, measure(carry[0], data), move),
      every=cfg.log_every, stop=steps, progress=progress, command=command,
      save_every_s=save_every_s)
