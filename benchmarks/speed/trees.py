"""The parameter trees an update is timed on: nested dicts named as Flax
linen names a pre-LN transformer's parameters, built in NumPy (no model, no
compilation), and their query/key kernels.

>>> params = param_tree(VIT_QUICK)
>>> qk, rest = split_qk(params)
>>> sorted(qk), qk["block_0/attn/query/kernel"].shape
(['block_0/attn/key/kernel', 'block_0/attn/query/kernel'], (64, 4, 16))
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

import stiefel_optax as so
from benchmarks.speed import peer_geoopt

QK = re.compile(so.families.QK_KERNEL)


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  name: str
  layers: int
  d: int
  heads: int
  head_dim: int
  mlp: int
  vocab: int           # token embedding rows (GPT-2: reduced) or patch dim
  tokens: int          # position embedding rows
  classes: int = 0     # a classifier head (ViT) if > 0


GPT2_SMALL = TreeConfig("GPT-2 small (12 x d768, 12 heads of 64, MLP 3072,"
                        " vocab reduced to 8192)", 12, 768, 12, 64, 3072,
                        8192, 1024)
PATCH_VIT = TreeConfig("patch ViT (6 x d64, 4 heads of 16, MLP 256, 64"
                       " tokens)", 6, 64, 4, 16, 256, 48, 64, classes=10)
GPT2_QUICK = TreeConfig("GPT-2-like, quick (1 x d128, 2 heads of 64)", 1, 128,
                        2, 64, 512, 256, 64)
VIT_QUICK = TreeConfig("patch ViT, quick (1 x d64, 4 heads of 16)", 1, 64, 4,
                       16, 256, 48, 64, classes=10)


def qk_kernel(rng, d: int, heads: int, head_dim: int) -> jnp.ndarray:
  """A query/key kernel (d, heads, head_dim) whose per-head (d, head_dim)
  frames are Haar-orthonormal (NumPy QR: no compilation)."""
  return jnp.asarray(np.transpose(
      peer_geoopt.haar_frames(rng, (heads, d, head_dim)), (1, 0, 2)))


def param_tree(cfg: TreeConfig, seed: int = 0):
  """A nested dict shaped like the Flax linen params of a pre-LN transformer
  with `MultiHeadDotProductAttention` (query/key/value kernels
  (d, heads, head_dim), out kernel (heads, head_dim, d)); the query/key
  kernels have orthonormal per-head frames."""
  rng = np.random.default_rng(seed)
  d, h, hd = cfg.d, cfg.heads, cfg.head_dim

  def normal(*shape):
    return jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)

  def qk():
    return {"kernel": qk_kernel(rng, d, h, hd), "bias": jnp.zeros((h, hd))}

  def norm():
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

  def dense(n_in, n_out):
    return {"kernel": normal(n_in, n_out), "bias": jnp.zeros(n_out)}

  params = {"embed": ({"embedding": normal(cfg.vocab, d)} if not cfg.classes
                      else dense(cfg.vocab, d)),
            "pos_embed": normal(cfg.tokens, d)}
  for i in range(cfg.layers):
    params[f"block_{i}"] = {
        "ln_1": norm(),
        "attn": {"query": qk(), "key": qk(),
                 "value": {"kernel": normal(d, h, hd),
                           "bias": jnp.zeros((h, hd))},
                 "out": {"kernel": normal(h, hd, d), "bias": jnp.zeros(d)}},
        "ln_2": norm(),
        "mlp": {"fc": dense(d, cfg.mlp), "proj": dense(cfg.mlp, d)}}
  params["ln_f"] = norm()
  if cfg.classes:
    params["head"] = dense(d, cfg.classes)
  return params


def gradients(params, seed: int = 1):
  """Gradients for `params`: 1e-3 times a standard normal (NumPy)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(1e-3 * rng.standard_normal(x.shape), x.dtype),
      params)


def is_qk(path) -> bool:
  """Whether a key path is a query/key kernel's (the library's default)."""
  return bool(QK.search(so.path_str(path)))


def split_qk(tree):
  """(Q/K leaves, other leaves) as two flat dicts keyed by path."""
  qk, rest = {}, {}
  for p, x in jax.tree_util.tree_leaves_with_path(tree):
    (qk if is_qk(p) else rest)[so.path_str(p)] = x
  return qk, rest
