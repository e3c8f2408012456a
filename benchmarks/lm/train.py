"""One run, saved and resumable (`benchmarks.training.train_run`): the
compiled functions it calls (training and evaluation, jitted, `lax.scan`
over chunks of steps), cached per the part of its configuration they read,
and its history of evaluations and its final losses."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import optax

import stiefel_optax as so
from benchmarks import harness, sweep, training
from benchmarks.lm.arms import frames, lr_schedule, make_optimizer
from benchmarks.lm.config import Config, check_config, run_name
from benchmarks.lm.data import Corpus, get_batch
from benchmarks.lm.model import initial_params, loss_fn, make_model, n_params

# --------------------------------------------------------------------------
# The compiled steps.

# stiefel_adam's default eps, which the stiefel arm keeps.
ADAM_EPS = 1e-8


def keys(seed: int):
  """(batch, dropout, eval) root keys of a seed; per step: fold_in(step)."""
  root = jax.random.PRNGKey(seed)
  return tuple(jax.random.fold_in(root, i) for i in (1, 2, 3))


def train_config(cfg: Config) -> Config:
  """cfg as one training chunk reads it: orthogonal_init trains as adamw
  (it differs in its start only), and the run's length and evaluation size
  are not read. Runs that agree here share one compiled chunk (the same
  function, so the same numbers)."""
  arm = "adamw" if cfg.arm == "orthogonal_init" else cfg.arm
  return dataclasses.replace(cfg, arm=arm, max_iters=0, eval_iters=0)


def eval_config(cfg: Config) -> Config:
  """cfg as the evaluations read it (the model, batch and evaluation
  sizes, not the optimizer): runs that agree here share one compiled
  evaluation."""
  return Config(arm="qk_norm" if cfg.arm == "qk_norm" else "adamw",
                n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                block_size=cfg.block_size, batch_size=cfg.batch_size,
                dropout=cfg.dropout, eval_iters=cfg.eval_iters)


@training.cached_builder
def chunk_fn(cfg: Config, vocab_size: int):
  """jit(carry, start, train, seed keys) -> (carry, mean train loss) over
  `eval_interval` steps of `training.train_chunk`, step `it`'s batch (and
  dropout key) folded from the seed's keys."""
  model, tx = make_model(cfg, vocab_size), make_optimizer(cfg)

  def batch_of(it, data, batch_key, drop_key):
    x, y = get_batch(data, jax.random.fold_in(batch_key, it), cfg.batch_size,
                     cfg.block_size)
    return x, y, jax.random.fold_in(drop_key, it) if cfg.dropout > 0 else None

  clip = cfg.arm == "qk_clip"

  def loss(p, x, y, dk):
    if not clip:
      return loss_fn(model, p, x, y, dk)
    value, rec = loss_fn(model, p, x, y, dk, logits=True)
    return value, dict(max_logit=jax.lax.stop_gradient(rec["max_logit"]))

  train = training.train_chunk(loss, tx, batch_of, update_args=clip,
                               aux_fn=step_records(cfg))

  def chunk(carry, start, data, batch_key, drop_key):
    carry, loss, aux = train(carry, start + jnp.arange(cfg.eval_interval),
                             data, batch_key, drop_key)
    return carry, (loss, aux)

  return training.jit(chunk, donate_argnums=0)


def step_records(cfg: Config):
  """The Stiefel arms' per-step records (`training.frame_step_records`;
  None for the other arms): `step_norm`; for `stiefel`, whose trust region
  caps the step, also `cap_binds`. rsgd and stiefel_muon run uncapped
  (their cap never binds)."""
  if cfg.arm not in STEPPED:
    return None
  return training.frame_step_records(
      frames(cfg), lr_schedule(cfg, cfg.stiefel_learning_rate),
      max_step_norm=cfg.max_step_norm if cfg.arm == "stiefel" else None,
      b1=cfg.beta1, b2=cfg.beta2, eps=ADAM_EPS)


@training.cached_builder
def estimate_fn(cfg: Config, vocab_size: int):
  """jit(params, train, val, eval key, step) -> nanoGPT's estimate_loss:
  mean loss of eval_iters random batches of each split, and the isometry
  error of the Q/K frames (mean over every head)."""
  model = make_model(cfg, vocab_size)

  def split_loss(params, data, key):
    def one(k):
      return loss_fn(model, params, *get_batch(data, k, cfg.batch_size,
                                               cfg.block_size))
    return jax.lax.map(one, jax.random.split(key, cfg.eval_iters)).mean()

  def estimate(params, train, val, key, it):
    # The logit records' fixed batch: the first validation batch of the
    # step-0 evaluation, the same at every evaluation of the seed.
    fixed = get_batch(val, jax.random.split(jax.random.fold_in(
        jax.random.fold_in(key, 0), 1), cfg.eval_iters)[0], cfg.batch_size,
                      cfg.block_size)
    _, rec = loss_fn(model, params, *fixed, logits=True)
    key = jax.random.fold_in(key, it)
    iso = so.frame_isometry_errors(params, frames(cfg))
    return dict(train_loss=split_loss(params, train, jax.random.fold_in(key, 0)),
                val_loss=split_loss(params, val, jax.random.fold_in(key, 1)),
                qk_iso=training.mean_of(iso.values()),
                max_logit=rec["max_logit"].max(-1), logit_bound=rec["bound"])

  return training.jit(estimate)


@training.cached_builder
def full_loss_fn(cfg: Config, vocab_size: int, batch: int = 64):
  """jit(params, tokens) -> mean loss over every next-token prediction in
  the non-overlapping windows of block_size (tokens beyond the last full
  window dropped)."""
  model = make_model(cfg, vocab_size)

  def full(params, tokens):
    n = (tokens.shape[0] - 1) // cfg.block_size
    idx = jnp.arange(n * cfg.block_size)
    x = tokens[idx].reshape(n, cfg.block_size)
    y = tokens[idx + 1].reshape(n, cfg.block_size)
    pad = -n % batch
    x = jnp.concatenate([x, jnp.zeros((pad, cfg.block_size), x.dtype)])
    y = jnp.concatenate([y, jnp.zeros((pad, cfg.block_size), y.dtype)])
    w = (jnp.arange(n + pad) < n).astype(jnp.float32)

    def one(args):
      xb, yb, wb = args
      logits = model.apply({"params": params}, xb)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
      return (ce.mean(-1) * wb).sum()

    shape = lambda a: a.reshape((-1, batch) + a.shape[1:])
    return jax.lax.map(one, (shape(x), shape(y), shape(w))).sum() / n

  return training.jit(full)


# --------------------------------------------------------------------------
# One run.


HISTORY = ("step", "train_loss", "val_loss", "qk_iso", "max_logit",
           "logit_bound", "lr", "chunk_loss", "step_norm", "cap_binds",
           "wall_s")
# The chunk's per-step means (`step_records`; None for other arms), and
# the arms that record them.
STEP_RECORDS = ("step_norm", "cap_binds")
STEPPED = ("stiefel", "rsgd", "stiefel_muon")


def diverged(hist: dict) -> Optional[dict]:
  """The divergence rule of the robustness plan (`benchmarks.sweep.
  divergence`) on the training and validation estimates; its result stops
  the run (`training.train_run`)."""
  return sweep.divergence(hist, ("train_loss", "val_loss"))


def train_run(cfg: Config, seed: int, corpus: Corpus,
              out: Optional[pathlib.Path] = None, *, command: str = "",
              save_every_s: float = 60.0, log=print,
              max_iters: Optional[int] = None) -> dict:
  """Trains (cfg, seed) to cfg.max_iters (or, not saved, to `max_iters`: a
  timing probe), resuming from out's saved run of the same identity
  (`training.train_run`); a finished saved run is returned as it is."""
  check_config(cfg)
  ident = harness.run_identity(cfg.to_dict(), corpus.data_id)
  name = run_name(cfg, seed, corpus.data_id)
  train, val = jnp.asarray(corpus.train), jnp.asarray(corpus.val)
  bkey, dkey, ekey = keys(seed)
  estimate, chunk = (estimate_fn(eval_config(cfg), corpus.vocab_size),
                     chunk_fn(train_config(cfg), corpus.vocab_size))
  lr = lr_schedule(cfg, cfg.learning_rate)

  def start():
    params = initial_params(cfg, corpus.vocab_size, seed)
    run = dict(name=name, arm=cfg.arm, seed=seed,
               block=harness.seed_block(seed), config=cfg.to_dict(),
               identity=ident, data=corpus.data_id, **harness.versions(),
               machine=harness.machine(), trained_by=[],
               n_params=n_params(params), wall_s=0.0, cpu_s=0.0, final=None,
               history={k: [] for k in HISTORY})
    return run, (params, make_optimizer(cfg).init(params))

  def record(run, carry, it, out, wall_s):
    hist = run["history"]
    m = estimate(carry[0], train, val, ekey, it)
    chunk_loss, steps = (None, {}) if out is None else (out[0], out[1] or {})
    m.update(chunk_loss=chunk_loss, lr=lr(max(it - 1, 0)),
             **{k: steps.get(k) for k in STEP_RECORDS})
    for k, v in m.items():
      hist.setdefault(k, []).append(harness.json_value(v))
    hist["step"].append(it)
    hist["wall_s"].append(round(wall_s, 2))
    log(f"  {run['name']} step {it}: train {hist['train_loss'][-1]}, val"
        f" {hist['val_loss'][-1]} ({hist['wall_s'][-1]:.0f} s)")
    return diverged(hist)

  def finish(run, carry):
    hist = run["history"]
    full = full_loss_fn(eval_config(cfg), corpus.vocab_size)(carry[0], val)
    return dict(step=hist["step"][-1], train_loss=hist["train_loss"][-1],
                val_loss=hist["val_loss"][-1], val_loss_full=harness.json_value(full),
                qk_iso=hist["qk_iso"][-1])

  store = (harness.RunStore(out) if out is not None and max_iters is None
           else None)
  return training.train_run(
      store, name, ident, start=start,
      chunk=lambda carry, it: chunk(carry, jnp.int32(it), train, bkey, dkey),
      record=record, every=cfg.eval_interval,
      stop=cfg.max_iters if max_iters is None else max_iters,
      finish=finish if max_iters is None else None, command=command,
      save_every_s=save_every_s)
