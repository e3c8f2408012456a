"""One run: its start (the seed's init, Q/K orthonormal for the arms that
start on the manifold), its jitted epoch and evaluation, and `Trainer`,
which holds the images on device and trains a run epoch by epoch."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import study as study_lib, training
from benchmarks.cifar_patches.arms import (ARMS, frames_of, make_optimizer,
                                           schedule)
from benchmarks.cifar_patches.config import Config
from benchmarks.cifar_patches.data import (Dataset, channel_stats, seed_stream,
                                           validation_split)
from benchmarks.models import Transformer
from benchmarks.training import Arm


def init_params(model: Transformer, arm: Arm, seed: int):
  """The seed's standard init; Q/K replaced by their polar factor
  (nearest orthonormal frames) for arms that start on the manifold."""
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 32, 32, 3)))["params"]
  if arm.orthonormal:
    params = orthonormal_start(params, frames_of(arm))
  return params


def orthonormal_start(params, frames, passes: int = 2):
  """`so.orthonormalize` applied `passes` times. One eigh-based polar of a
  square (d, d) Gaussian kernel (the whole-frame layout) squares its
  condition number and leaves ||W^T W - I|| ~ 1e-3 in float32; a second
  polar of the nearly orthonormal result is exact to rounding (and changes
  a per-head frame only at rounding level)."""
  for _ in range(passes):
    params = so.orthonormalize(params, frames)
  return params


def normalize(x_uint8, mean, std):
  return (x_uint8.astype(jnp.float32) / 255.0 - mean) / std


def make_epoch_fn(model: Transformer, tx, mean, std, aux_fn=None):
  """jit(carry, idx (steps, batch), x, y) -> (carry, mean loss, mean aux
  or None): one epoch of `training.train_chunk`, a step per row of idx
  (aux_fn: its per-step records)."""

  def loss_fn(params, xb, yb):
    logits = model.apply({"params": params}, normalize(xb, mean, std))
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  return training.jit(training.train_chunk(loss_fn, tx,
                                           lambda i, x, y: (x[i], y[i]),
                                           aux_fn=aux_fn))


def make_eval_fn(model: Transformer, mean, std, with_loss: bool = False):
  """jit(params, x, y) -> accuracy on the images x (uint8) and labels y
  (with_loss: (mean cross-entropy, accuracy))."""
  @training.jit
  def evaluate(params, x, y):
    logits = model.apply({"params": params}, normalize(x, mean, std))
    loss, acc = training.loss_and_accuracy(logits, y)
    return (loss, acc) if with_loss else acc
  return evaluate


# The arms with per-step records (`step_records`).
STEPPED = ("stiefel", "rsgd")


def step_records(cfg: Config, arm: str, hp: dict, total_steps: int):
  """The per-step records of the Stiefel arms on the Q/K frames
  (`training.frame_step_records`: step_norm, and for stiefel, whose trust
  region's radius max_step_norm is hp["cap"], cap_binds); None for the
  others."""
  if arm not in STEPPED:
    return None
  return training.frame_step_records(
      frames_of(ARMS[arm]), schedule(hp["lr"], total_steps, cfg),
      max_step_norm=hp["cap"] if arm == "stiefel" else None)


class Trainer:
  """The images on device and the jitted functions, cached per model and
  per (arm, hp, base, n): trains one run of a named arm (`train`)."""

  def __init__(self, data: Dataset, cfg: Config):
    self.cfg, self.data_id = cfg, data.source
    self.model = cfg.model.build()
    self._models = {False: self.model}
    mean, std = channel_stats(data.x_train)
    self.mean, self.std = jnp.asarray(mean), jnp.asarray(std)
    self.x = jnp.asarray(data.x_train)
    self.y = jnp.asarray(data.y_train.astype(np.int32))
    self.x_test = jnp.asarray(data.x_test)
    self.y_test = jnp.asarray(data.y_test.astype(np.int32))
    self.pool, self.val = validation_split(len(data.x_train), cfg)
    self.all_train = np.arange(len(data.x_train))
    self._accuracy = {}
    self._epoch_fns = {}

  def epoch_fn(self, arm: str, hp: dict, base: dict, n: int,
               records: bool = False):
    """(tx, jitted epoch) of the arm at (hp, base) on n images; records:
    the epoch also returns the Stiefel arms' step records
    (`step_records`)."""
    key = (arm, study_lib.point_key(hp), study_lib.point_key(base), n,
           records)
    if key not in self._epoch_fns:
      steps = (n // self.cfg.batch) * self.cfg.epochs
      tx = make_optimizer(self.cfg, arm, hp, base, steps)
      aux = step_records(self.cfg, arm, hp, steps) if records else None
      self._epoch_fns[key] = (tx, make_epoch_fn(self.model_of(ARMS[arm]), tx,
                                                self.mean, self.std, aux))
    return self._epoch_fns[key]

  def model_of(self, arm: Arm) -> Transformer:
    if arm.qk_norm not in self._models:
      self._models[arm.qk_norm] = self.cfg.model.build(qk_norm=arm.qk_norm)
    return self._models[arm.qk_norm]

  def accuracy(self, arm: Arm, with_loss: bool = False):
    """The jitted evaluation of the arm's model (`make_eval_fn`)."""
    key = (arm.qk_norm, with_loss)
    if key not in self._accuracy:
      self._accuracy[key] = make_eval_fn(self.model_of(arm), self.mean,
                                         self.std, with_loss)
    return self._accuracy[key]

  def train(self, name: str, hp: dict, base: dict, seed: int, n: int,
            tuning: bool) -> dict:
    """Trains the arm `name` at (hp, base) from `seed` on n images: of the tuning
    pool, evaluated on the validation split after each epoch, for a tuning
    run; of every training image, evaluated on the test images, for a
    paired run. Returns the accuracy after each epoch (curve), the mean
    training loss of each epoch (losses), the Q/K frames' isometry error
    and movement, and the wall seconds."""
    cfg, arm = self.cfg, ARMS[name]
    pool = self.pool if tuning else self.all_train
    ex, ey = ((self.x[self.val], self.y[self.val]) if tuning
              else (self.x_test, self.y_test))
    t0 = time.time()
    idx = seed_stream(seed, pool, n, cfg)
    tx, epoch = self.epoch_fn(name, hp, base, n)
    params = init_params(self.model_of(arm), arm, seed)
    start = params
    opt_state = tx.init(params)
    curve, losses = [], []
    for e in range(cfg.epochs):
      (params, opt_state), loss, _ = epoch(
          (params, opt_state), jnp.asarray(idx[e]), self.x, self.y)
      losses.append(float(loss))
      curve.append(float(self.accuracy(arm)(params, ex, ey)))
    iso = float(so.max_isometry_error(params, frames_of(arm)))
    move = so.frame_movement(start, params, frames_of(arm))
    movement = float(sum(float(jnp.sum(m)) for m in move.values()))
    return dict(curve=curve, losses=losses, isometry_error=iso,
                movement=movement, wall_s=time.time() - t0)
