"""One run, saved and resumable (`benchmarks.training.train_run`): its
history of evaluations and its final losses."""

from __future__ import annotations

import pathlib
from typing import Optional

import jax.numpy as jnp

from benchmarks import harness, training
from benchmarks.lm.arms import lr_schedule, make_optimizer
from benchmarks.lm.config import Config, check_config, identity_config, run_name
from benchmarks.lm.data import Corpus
from benchmarks.lm.model import initial_params, n_params
from benchmarks.lm.steps import (chunk_fn, estimate_fn, eval_config,
                                 full_loss_fn, keys, train_config)


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
               history={k: [] for k in ("step", "train_loss", "val_loss",
                                        "qk_iso", "lr", "chunk_loss",
                                        "wall_s")})
    return run, (params, make_optimizer(cfg).init(params))

  def record(run, carry, it, chunk_loss, wall_s):
    hist = run["history"]
    m = {k: float(v) for k, v in estimate(carry[0], train, val, ekey,
                                          it).items()}
    for k, v in m.items():
      hist[k].append(v)
    hist["step"].append(it)
    hist["lr"].append(float(lr(max(it - 1, 0))))
    hist["chunk_loss"].append(None if chunk_loss is None
                              else float(chunk_loss))
    hist["wall_s"].append(round(wall_s, 2))
    log(f"  {run['name']} step {it}: train {m['train_loss']:.4f}, val"
        f" {m['val_loss']:.4f} ({hist['wall_s'][-1]:.0f} s)")

  def finish(run, carry):
    hist = run["history"]
    full = float(full_loss_fn(eval_config(cfg), corpus.vocab_size)(carry[0],
                                                                  val))
    return dict(step=hist["step"][-1], train_loss=hist["train_loss"][-1],
                val_loss=hist["val_loss"][-1], val_loss_full=full,
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
