"""One run, saved and resumable (`benchmarks.training.train_run`): the
jitted chunk of `log_every` full-batch steps (`lax.scan`) and the
measurement logged after it, cached per configuration (and arm), and the
run's history of measurements, one every `log_every` steps."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import stiefel_optax as so
from benchmarks import harness, training
from benchmarks.grokking.arms import make_optimizer
from benchmarks.grokking.config import Config, run_name
from benchmarks.grokking.data import data_id, make_data
from benchmarks.grokking.model import evaluate, initial_params, make_model

# --------------------------------------------------------------------------
# The jitted steps.


def other_norms(params) -> dict:
  """{path: ||x||_F} for every weight that is not a Q/K kernel."""
  frames = so.selected_frames(params)
  return {so.path_str(p): jnp.linalg.norm(x.ravel())
          for p, x in jax.tree_util.tree_leaves_with_path(params)
          if so.path_str(p) not in frames}


@functools.lru_cache(maxsize=None)
def chunk_fn(cfg: Config, arm: str):
  """jit(carry, None, train_x, train_y) -> (carry, mean loss, mean Q/K
  movement): `log_every` full-batch steps of `training.train_chunk`."""
  model, tx = make_model(cfg), make_optimizer(cfg, arm)
  loss = lambda p, x, y: evaluate(model, p, x, y)[0]
  moved = lambda old, new, _: so.frame_movement(old, new)
  return jax.jit(training.train_chunk(loss, tx, lambda _, x, y: (x, y),
                                      aux_fn=moved, length=cfg.log_every))


@functools.lru_cache(maxsize=None)
def measure_fn(cfg: Config):
  """jit(params, data) -> accuracies, losses, isometry errors, norms."""
  model = make_model(cfg)

  def measure(params, data):
    tl, ta = evaluate(model, params, data.train_x, data.train_y)
    vl, va = evaluate(model, params, data.val_x, data.val_y)
    return dict(train_loss=tl, train_acc=ta, val_loss=vl, val_acc=va,
                iso=so.frame_isometry_errors(params),
                norms=other_norms(params))

  return jax.jit(measure)


# --------------------------------------------------------------------------
# One run.


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
  ident = harness.run_identity(cfg.to_dict(), data_id(cfg.p, cfg.op))

  def start():
    params = initial_params(cfg, arm, seed)
    run = dict(arm=arm, seed=seed, config=cfg.to_dict(), identity=ident,
               data=data_id(cfg.p, cfg.op), **harness.versions(),
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
      run_name(arm, seed), ident, start=start, chunk=advance,
      record=lambda run, carry, it, move, _: record(
          run["history"], it, measure(carry[0], data), move),
      every=cfg.log_every, stop=steps, progress=progress, command=command,
      save_every_s=save_every_s)
