"""Table 3: one training step (forward, backward, update, apply) of a small
causal transformer language model (`benchmarks.models`), both optimizers."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.speed import arms, timing, trees


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """The workload: a causal LM (`benchmarks.models`: pre-LN GELU blocks,
  logits at every position) and its batch."""
  vocab: int = 512
  seq: int = 64
  batch: int = 16
  d: int = 128
  heads: int = 4
  layers: int = 4
  mlp: int = 512

  def describe(self) -> str:
    return (f"causal LM: {self.layers} x d{self.d}, {self.heads} heads of"
            f" {self.d // self.heads}, MLP {self.mlp}, vocab {self.vocab},"
            f" batch {self.batch} x {self.seq} tokens")

  def model(self):
    # Imported here: flax is needed by this table only.
    from benchmarks import models  # pylint: disable=g-import-not-at-top
    return models.Transformer(models.pre_ln_gelu(
        d_model=self.d, num_heads=self.heads, d_mlp=self.mlp,
        num_classes=self.vocab, depth=self.layers, vocab_size=self.vocab,
        seq_len=self.seq, causal=True, readout="all"))


LM_FULL, LM_QUICK = LMConfig(), LMConfig(vocab=64, seq=16, batch=4, d=32,
                                         heads=2, layers=1, mlp=64)


def train_step_comparison(cfg: LMConfig, iters: int) -> Dict[str, Any]:
  """One jitted training step of each optimizer on `cfg`'s model and one
  batch of random tokens, alternated."""
  t, c, n = train_step_times(cfg, iters, arms.optimizers())
  return {"model": cfg.describe(), "params": n, **arms.versus_adamw(t, c),
          **arms.stacked_ratios(t)}


def train_step_times(cfg: LMConfig, iters: int, optimizers: Dict) -> tuple:
  """(wall, CPU) medians (s) of one jitted training step of each of
  `optimizers` ({name: tx}) on `cfg`'s model and one batch of random
  tokens, alternated, and the model's parameter count."""
  model = cfg.model()
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  # Orthonormal per-head Q/K frames, as in the update's trees.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: trees.qk_kernel(rng, *x.shape) if trees.is_qk(p) else x,
      params)

  def loss_fn(p, batch):
    logits = model.apply({"params": p}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()

  fns = {}
  for name, tx in optimizers.items():
    @jax.jit
    def step(p, s, batch, tx=tx):
      loss, g = jax.value_and_grad(loss_fn)(p, batch)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    p1, s1, _ = step(params, tx.init(params), tokens)
    fns[name] = timing.call(step, p1, s1, tokens)
  c = {}
  t = timing.median_times(fns, iters, cpu=c)
  return t, c, sum(x.size for x in jax.tree.leaves(params))
