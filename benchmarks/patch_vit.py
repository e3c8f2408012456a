"""A small patch transformer (Flax linen) for the CIFAR-10 benchmark.

Images (B, 32, 32, 3) are cut into 4x4 patches (64 tokens of 48 values),
embedded to `dim`, given a learned position embedding and passed through
`depth` pre-LayerNorm blocks of `flax.linen.MultiHeadDotProductAttention`
and an MLP; the tokens are mean-pooled and classified. The attention
query/key kernels have shape (dim, heads, head_dim) at paths
`block_<i>/attn/{query,key}/kernel`, the layout `stiefel_optax` expects.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PatchViTConfig:
  """Model size. Defaults: the scaled-down model the benchmark runs."""
  patch: int = 4
  dim: int = 32
  heads: int = 2
  depth: int = 1
  mlp_ratio: int = 2
  num_classes: int = 10

  @property
  def head_dim(self) -> int:
    if self.dim % self.heads:
      raise ValueError(f"dim = {self.dim} is not divisible by heads = {self.heads}.")
    return self.dim // self.heads


def patchify(images: jnp.ndarray, patch: int) -> jnp.ndarray:
  """(B, H, W, C) -> (B, (H/p)(W/p), p*p*C), row-major over patches."""
  b, h, w, c = images.shape
  if h % patch or w % patch:
    raise ValueError(f"image {h}x{w} is not divisible into {patch}x{patch} patches.")
  x = images.reshape(b, h // patch, patch, w // patch, patch, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: x + attn(LN x), then x + mlp(LN x)."""
  cfg: PatchViTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    h = nn.LayerNorm(name="ln_attn")(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=cfg.heads, qkv_features=cfg.dim, out_features=cfg.dim,
        name="attn")(h, h)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.Dense(cfg.mlp_ratio * cfg.dim, name="mlp_in")(h)
    h = nn.Dense(cfg.dim, name="mlp_out")(nn.gelu(h))
    return x + h


class PatchViT(nn.Module):
  """Patch transformer classifier; see the module docstring."""
  cfg: PatchViTConfig = PatchViTConfig()

  @nn.compact
  def __call__(self, images):
    cfg = self.cfg
    x = nn.Dense(cfg.dim, name="embed")(patchify(images, cfg.patch))
    pos = self.param("pos", nn.initializers.normal(0.02), x.shape[1:])
    x = x + pos
    for i in range(cfg.depth):
      x = Block(cfg, name=f"block_{i}")(x)
    x = nn.LayerNorm(name="ln_out")(x).mean(axis=1)
    return nn.Dense(cfg.num_classes, name="head")(x)
