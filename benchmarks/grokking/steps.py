"""Training and measurement, jitted: a chunk of `log_every` full-batch
steps (`lax.scan`) and the measurement logged after it, cached per
configuration (and arm)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import stiefel_optax as so
from benchmarks import training
from benchmarks.grokking.arms import make_optimizer
from benchmarks.grokking.config import Config
from benchmarks.grokking.model import evaluate, make_model


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
