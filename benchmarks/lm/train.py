"""One run, saved and resumable (`benchmarks.training.train_run`): its
history of evaluations and its final losses."""

from __future__ import annotations

import pathlib
from typing import Optional

import jax.numpy as jnp
import numpy as np

from benchmarks import harness, training
from benchmarks.lm.arms import lr_schedule, make_optimizer
from benchmarks.lm.config import Config, check_config, identity_config, run_name
from benchmarks.lm.data import Corpus
from benchmarks.lm.model import initial_params, n_params
from benchmarks.lm.steps import (chunk_fn, estimate_fn, eval_config,
                                 full_loss_fn, keys, train_config)


HISTORY = ("step", "train_loss", "val_loss", "qk_iso", "max_logit",
           "logit_bound", "lr", "chunk_loss", "step_norm", "cap_binds",
           "wall_s")
# The chunk's per-step means (`steps.step_records`; None for other arms).
STEP_RECORDS = ("step_norm", "cap_binds")


def json_value(x):
  """x as JSON: floats (lists per layer), a non-finite float as None."""
  if x is None:
    return None
  a = np.asarray(x, np.float64)
  if a.ndim:
    return [json_value(v) for v in a]
  return float(a) if np.isfinite(a) else None


def diverged(hist: dict) -> Optional[dict]:
  """The divergence rule of the robustness plan at the last evaluation:
  its training or validation estimate non-finite (None) or above that
  split's initial estimate (step 0's); then {"diverged_at": step,
  "reason": ...}, which stops the run (`training.train_run`)."""
  for k in ("train_loss", "val_loss"):
    v, first = hist[k][-1], hist[k][0]
    if v is None or first is None or v > first:
      return dict(diverged_at=hist["step"][-1], reason=(
          f"{k} non-finite" if v is None or first is None
          else f"{k} {v:.4f} above the initial {first:.4f}"))
  return None


def train_run(cfg: Config, seed: int, corpus: Corpus,
              out: Optional[pathlib.Path] = None, *, command: str = "",
              save_every_s: float = 60.0, log=print,
              max_iters: Optional[int] = None) -> dict:
  """Trains (cfg, seed) to cfg.max_iters (or, not saved, to `max_iters`: a
  timing probe), resuming from out's saved run of the same identity
  (`training.train_run`); a finished saved run is returned as it is."""
  check_config(cfg)
  ident = harness.identity(identity_config(cfg), corpus.data_id)
  name = run_name(cfg, seed, corpus.data_id)
  train, val = jnp.asarray(corpus.train), jnp.asarray(corpus.val)
  bkey, dkey, ekey = keys(seed)
  estimate, chunk = (estimate_fn(eval_config(cfg), corpus.vocab_size),
                     chunk_fn(train_config(cfg), corpus.vocab_size))
  lr = lr_schedule(cfg, cfg.learning_rate)

  def start():
    params = initial_params(cfg, corpus.vocab_size, seed)
    run = dict(name=name, arm=cfg.arm, seed=seed,
               block=harness.seed_block(seed), config=identity_config(cfg),
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
      hist.setdefault(k, []).append(json_value(v))
    hist["step"].append(it)
    hist["wall_s"].append(round(wall_s, 2))
    log(f"  {run['name']} step {it}: train {hist['train_loss'][-1]}, val"
        f" {hist['val_loss'][-1]} ({hist['wall_s'][-1]:.0f} s)")
    return diverged(hist)

  def finish(run, carry):
    hist = run["history"]
    full = full_loss_fn(eval_config(cfg), corpus.vocab_size)(carry[0], val)
    return dict(step=hist["step"][-1], train_loss=hist["train_loss"][-1],
                val_loss=hist["val_loss"][-1], val_loss_full=json_value(full),
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
