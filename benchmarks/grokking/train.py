"""One run, saved and resumable (`benchmarks.training.train_run`): the
jitted chunk of `log_every` steps (`lax.scan` of the one training step,
`training.train_chunk`), full batch or on the seed's minibatches
(`batch_of`), and the measurement logged after it, cached per
configuration (and arm), and the run's history of measurements, one every
`log_every` steps.

A record (one per `log_every` steps, and one at step 0) holds: step;
train_loss, train_acc, val_loss, val_acc on the whole training and
validation sets; iso, the isometry error ||W^T W - I||_F of every Q/K head
({kernel path: [per head]}, every arm alike: an unconstrained arm's raw
kernels, the same measure as a Stiefel arm's frames); norms, the Frobenius
norm of every other weight ({path: norm}, the last layer's as
`unembed/kernel`); move, the mean per-step movement ||W_{t+1} - W_t||_F of
each Q/K head over the interval; batch_loss_mean and batch_loss_max, the
mean and the largest training loss of the interval's steps, each on its
(mini)batch, so that a spike between two records is not missed (None at
step 0; absent from runs made before they were recorded).
"""

from __future__ import annotations

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


def data_key(seed: int) -> jax.Array:
  """The key of the seed's minibatch order (apart from the
  initialisation's PRNGKey(seed))."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), 0x6261)


def batch_of(batch_size: int):
  """batch(step, key, train_x, train_y) -> (x, y): the whole training set
  (batch_size 0), else the step's minibatch: epoch e = step // k (k = n //
  batch_size batches per epoch) is the permutation of fold_in(key, e), cut
  into k batches in order (the last n mod batch_size equations of an epoch
  left out).

  >>> import jax.numpy as jnp
  >>> x = jnp.arange(10)
  >>> b = [batch_of(4)(t, data_key(0), x, x)[0].tolist() for t in range(3)]
  >>> len(set(b[0] + b[1])), b[2] == b[0]    # one epoch: 8 distinct, reshuffled
  (8, False)
  """
  if not batch_size:
    return lambda _, __, x, y: (x, y)

  def batch(step, key, x, y):
    n = x.shape[0]
    if batch_size > n:
      raise ValueError(f"batch_size {batch_size} exceeds the {n} training"
                       " equations.")
    k = n // batch_size
    perm = jax.random.permutation(jax.random.fold_in(key, step // k), n)
    idx = jax.lax.dynamic_slice(perm, ((step % k) * batch_size,),
                                (batch_size,))
    return x[idx], y[idx]

  return batch


@training.cached_builder
def chunk_fn(cfg: Config, arm: str):
  """jit(carry, step, key, train_x, train_y) -> (carry, dict(batch_loss_mean,
  batch_loss_max, move)): the `log_every` steps from `step` (each one step
  of `training.train_chunk`, on `batch_of`'s batch), the mean and the
  largest of their batch losses and their mean Q/K movement."""
  model, tx = make_model(cfg), make_optimizer(cfg, arm)
  loss = lambda p, x, y: evaluate(model, p, x, y)[0]
  moved = lambda old, new, _: so.frame_movement(old, new)
  one = training.train_chunk(loss, tx, batch_of(cfg.batch_size),
                             aux_fn=moved, length=1)

  def chunk(carry, step, key, x, y):
    def body(c, t):
      c, loss_t, move_t = one(c, t[None], key, x, y)
      return c, (loss_t, move_t)
    carry, (losses, moves) = jax.lax.scan(
        body, carry, step + jnp.arange(cfg.log_every))
    return carry, dict(batch_loss_mean=losses.mean(),
                       batch_loss_max=losses.max(),
                       move=jax.tree.map(lambda m: m.mean(0), moves))

  return training.jit(chunk)


@training.cached_builder
def measure_fn(cfg: Config):
  """jit(params, data) -> accuracies, losses, isometry errors, norms."""
  model = make_model(cfg)

  def measure(params, data):
    tl, ta = evaluate(model, params, data.train_x, data.train_y)
    vl, va = evaluate(model, params, data.val_x, data.val_y)
    return dict(train_loss=tl, train_acc=ta, val_loss=vl, val_acc=va,
                iso=so.frame_isometry_errors(params),
                norms=other_norms(params))

  return training.jit(measure)


# --------------------------------------------------------------------------
# One run.


BATCH_KEYS = ("batch_loss_mean", "batch_loss_max")


def empty_history() -> dict:
  return {k: [] for k in ("step", "train_loss", "train_acc", "val_loss",
                          "val_acc", "iso", "norms", "move") + BATCH_KEYS}


def record(hist: dict, step: int, m: dict, out: Optional[dict]) -> None:
  """Appends one measurement (arrays as lists) and the chunk's output
  (None at step 0) to the history (a run saved before the batch losses
  were recorded gets them as None for its earlier records)."""
  m = jax.tree.map(lambda x: np.asarray(x).tolist(), m)
  out = None if out is None else jax.tree.map(
      lambda x: np.asarray(x).tolist(), out)
  for k in BATCH_KEYS:
    hist.setdefault(k, [None] * len(hist["step"]))
  hist["step"].append(step)
  for k in ("train_loss", "train_acc", "val_loss", "val_acc", "iso", "norms"):
    hist[k].append(m[k])
  for k in ("move",) + BATCH_KEYS:
    hist[k].append(None if out is None else out[k])


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
  chunk, key = chunk_fn(cfg, arm), data_key(seed)
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

  def advance(carry, step):
    return chunk(carry, step, key, data.train_x, data.train_y)

  return training.train_run(
      harness.RunStore(out) if out is not None else None,
      run_name(arm, seed), ident, start=start, chunk=advance,
      record=lambda run, carry, it, out, _: record(
          run["history"], it, measure(carry[0], data), out),
      every=cfg.log_every, stop=steps, progress=progress, command=command,
      save_every_s=save_every_s)
