"""The benchmarks' one transformer (Flax linen), configured per benchmark.

    input      integer tokens (`nn.Embed`) or images cut into square patches
               (`nn.Dense` on `patchify`), plus a learned position embedding;
    blocks     `depth` residual blocks x + Attn(LN x), then x + MLP(LN x),
               attention `flax.linen.MultiHeadDotProductAttention` (optionally
               causal), MLP activation ReLU or GELU, LayerNorm on or off;
    readout    logits from the last position, from the mean over positions,
               or at every position (a language model).

The attention query/key kernels have shape (d_model, heads, head_dim) at
`block_<i>/attn/{query,key}/kernel`, the layout `stiefel_optax` selects by
default ("flax").

Users: grokking (`benchmarks.grokking.model.make_model`), CIFAR
(`PatchViTConfig` below), the speed benchmark's causal LM
(`benchmarks.speed.train_step`; both `pre_ln_gelu`); the long-run drift
benchmark trains one `self_attention` layer alone.

`GPT` (end of the file) is nanoGPT's model for the language-model benchmark
(`benchmarks.lm`), kept as nanoGPT writes it so that its published losses
are the reference: a fused c_attn (d, 3d) projection, whose q and k thirds
`stiefel_optax.fused_qkv(n_head)` selects, no biases, a head tied to the
token embedding, dropout, optional RMSNorm on the per-head queries and keys
(the qk_norm arm).
`tests/benchmarks/test_models.py` pins the parameters and outputs these benchmarks'
recorded runs were made with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

INPUTS = ("tokens", "patches")
READOUTS = ("last", "mean", "all")
ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The model. Defaults: grokking's one-layer model (no LayerNorm, no
  biases in attention or readout, ReLU, last-token readout)."""
  d_model: int
  num_heads: int
  d_mlp: int
  num_classes: int                 # logits per read-out position
  depth: int = 1
  inputs: str = "tokens"           # "tokens" | "patches"
  vocab_size: int = 0              # tokens only
  seq_len: Optional[int] = None    # positions; None: the input's (patches)
  patch: int = 4                   # patches only: the side of a patch
  activation: str = "relu"         # "relu" | "gelu"
  layer_norm: bool = False         # pre-LN blocks and a final LayerNorm
  attn_bias: bool = False
  head_bias: bool = False
  causal: bool = False
  readout: str = "last"            # "last" | "mean" | "all"
  pos_std: Optional[float] = None  # init std of the position (and token)
                                   # embeddings; None: 1 / sqrt(d_model)
  qk_norm: bool = False            # flax's normalize_qk: LayerNorm (no bias)
                                   # on each head's queries and keys

  def __post_init__(self):
    for name, value, allowed in (("inputs", self.inputs, INPUTS),
                                 ("readout", self.readout, READOUTS),
                                 ("activation", self.activation, ACTIVATIONS)):
      if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}; got {value!r}.")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model = {self.d_model} is not divisible by"
                       f" num_heads = {self.num_heads}.")
    if self.inputs == "tokens" and (self.vocab_size < 1 or not self.seq_len):
      raise ValueError("a token model needs vocab_size and seq_len.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


# Flax derives each parameter's initial value from its module path, so these
# names are part of the numerics: token models keep the names the grokking
# runs were made with, patch models those of the CIFAR runs.
_NAMES = {"tokens": dict(pos="pos_embed", ln="ln_final", head="unembed"),
          "patches": dict(pos="pos", ln="ln_out", head="head")}


def patchify(images: jnp.ndarray, patch: int) -> jnp.ndarray:
  """(B, H, W, C) -> (B, (H/p)(W/p), p*p*C), row-major over patches."""
  b, h, w, c = images.shape
  if h % patch or w % patch:
    raise ValueError(f"image {h}x{w} is not divisible into {patch}x{patch} patches.")
  x = images.reshape(b, h // patch, patch, w // patch, patch, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


def self_attention(num_heads: int, head_dim: int, out_features: int, *,
                   use_bias: bool = False, qk_norm: bool = False,
                   dtype=None, name: Optional[str] = None
                   ) -> nn.MultiHeadDotProductAttention:
  """Every benchmark's attention layer: flax's MultiHeadDotProductAttention
  with query/key/value kernels (d, num_heads, head_dim) and an out kernel
  (num_heads, head_dim, out_features), computed in `dtype` (None: the
  inputs' and parameters' promoted dtype)."""
  return nn.MultiHeadDotProductAttention(
      num_heads=num_heads, qkv_features=num_heads * head_dim,
      out_features=out_features, use_bias=use_bias, normalize_qk=qk_norm,
      dtype=dtype, name=name)


class Block(nn.Module):
  """x + Attn(LN x), then x + MLP(LN x) (LN: identity when layer_norm is
  off). `last_only`: attend from the last position alone, for a last-token
  readout (the same logits without the unread positions' work)."""
  cfg: TransformerConfig
  last_only: bool = False

  def _norm(self, name, x):
    return nn.LayerNorm(name=name)(x) if self.cfg.layer_norm else x

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    h = self._norm("ln_attn", x)
    # The last position's causal mask row admits every key: no mask needed.
    mask = (nn.make_causal_mask(x[..., 0]) if cfg.causal and not self.last_only
            else None)
    q = h[:, -1:] if self.last_only else h
    x = (x[:, -1:] if self.last_only else x) + self_attention(
        cfg.num_heads, cfg.head_dim, cfg.d_model, use_bias=cfg.attn_bias,
        qk_norm=cfg.qk_norm, name="attn")(q, h, mask=mask)
    h = self._norm("ln_mlp", x)
    h = ACTIVATIONS[cfg.activation](nn.Dense(cfg.d_mlp, name="mlp_in")(h))
    return x + nn.Dense(cfg.d_model, name="mlp_out")(h)


class Transformer(nn.Module):
  """Logits (batch, num_classes), or (batch, seq, num_classes) for
  readout "all"; see the module docstring."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x):
    cfg, names = self.cfg, _NAMES[self.cfg.inputs]
    std = (1.0 / jnp.sqrt(cfg.d_model)) if cfg.pos_std is None else cfg.pos_std
    if cfg.inputs == "tokens":
      x = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed",
                   embedding_init=nn.initializers.normal(std))(x)
    else:
      x = nn.Dense(cfg.d_model, name="embed")(patchify(x, cfg.patch))
    if cfg.seq_len is not None and x.shape[1] != cfg.seq_len:
      raise ValueError(f"the input has {x.shape[1]} positions; the model was"
                       f" built for seq_len = {cfg.seq_len}.")
    x = x + self.param(names["pos"], nn.initializers.normal(std), x.shape[1:])
    for i in range(cfg.depth):
      x = Block(cfg, last_only=cfg.readout == "last" and i == cfg.depth - 1,
                name=f"block_{i}")(x)
    if cfg.layer_norm:
      x = nn.LayerNorm(name=names["ln"])(x)
    if cfg.readout == "last":
      x = x[:, -1]
    elif cfg.readout == "mean":
      x = x.mean(axis=1)
    return nn.Dense(cfg.num_classes, use_bias=cfg.head_bias,
                    name=names["head"])(x)


def pre_ln_gelu(**fields) -> TransformerConfig:
  """The GPT-2-style model of CIFAR's patch ViT and the speed benchmark's
  causal LM: pre-LN GELU blocks, biases in attention and head, positions
  (and tokens) initialised with std 0.02; `fields` name the rest.

  >>> pre_ln_gelu(d_model=8, num_heads=2, d_mlp=16, num_classes=5,
  ...             vocab_size=5, seq_len=4).activation
  'gelu'
  """
  return TransformerConfig(activation="gelu", layer_norm=True, attn_bias=True,
                           head_bias=True, pos_std=0.02, **fields)


def init_params(model: Transformer, key: jax.Array, inputs=None):
  """The model's parameters, initialised on `inputs` (default: zero tokens
  of shape (1, seq_len))."""
  if inputs is None:
    inputs = jnp.zeros((1, model.cfg.seq_len), jnp.int32)
  return model.init(key, inputs)["params"]


@dataclasses.dataclass(frozen=True)
class PatchViTConfig:
  """The CIFAR benchmark's model, in the sizes its runs record: these
  fields (`dataclasses.asdict`) are part of each CIFAR run's identity, so
  they stay as they are. Defaults: the scaled-down model. `build()` is the
  `Transformer` they name: pre-LN GELU blocks with attention biases,
  positions initialised with std 0.02, LayerNorm, mean pool, a biased head."""
  patch: int = 4
  dim: int = 32
  heads: int = 2
  depth: int = 1
  mlp_ratio: int = 2
  num_classes: int = 10

  def config(self) -> TransformerConfig:
    return pre_ln_gelu(
        d_model=self.dim, num_heads=self.heads, d_mlp=self.mlp_ratio * self.dim,
        num_classes=self.num_classes, depth=self.depth, inputs="patches",
        patch=self.patch, readout="mean")

  def build(self, qk_norm: bool = False) -> Transformer:
    """The model; qk_norm (an arm's architecture change, not a field: the
    fields are the runs' identity) adds flax's per-head query/key norm."""
    return Transformer(dataclasses.replace(self.config(), qk_norm=qk_norm))


# --------------------------------------------------------------------------
# nanoGPT's GPT (the language-model benchmark).


class _GPTLayer(nn.Module):
  """The fields nanoGPT's attention and block share."""
  n_head: int
  n_layer: int
  dropout: float = 0.0
  qk_norm: bool = False


class GPTAttention(_GPTLayer):
  """nanoGPT's CausalSelfAttention: one fused c_attn (d, 3d) Dense."""

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    b, t, c = x.shape
    hd = c // self.n_head
    qkv = nn.Dense(3 * c, use_bias=False, name="c_attn",
                   kernel_init=nn.initializers.normal(0.02))(x)
    q, k, v = (a.reshape(b, t, self.n_head, hd)
               for a in jnp.split(qkv, 3, axis=-1))
    if self.qk_norm:
      q = nn.RMSNorm(epsilon=1e-6, name="q_norm")(q)
      k = nn.RMSNorm(epsilon=1e-6, name="k_norm")(k)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    # The logit records (the robustness sweep, MuonClip's maxima): sown
    # only where "intermediates" is mutable, else never computed. Per head
    # max |q_i . k_j| / sqrt(hd) over the causal pairs; per layer the bound
    # ||x_i|| ||x_j|| / sqrt(hd) that orthonormal q and k frames guarantee.
    self.sow("intermediates", "max_logit",
             jnp.max(jnp.where(causal, jnp.abs(att), 0.0), axis=(0, 2, 3)))
    norm = jnp.linalg.norm(x, axis=-1)
    self.sow("intermediates", "logit_bound", jnp.max(jnp.where(
        causal, norm[:, :, None] * norm[:, None, :], 0.0)) / math.sqrt(hd))
    att = jnp.where(causal, att, jnp.finfo(att.dtype).min)
    att = nn.Dropout(self.dropout)(jax.nn.softmax(att, axis=-1),
                                   deterministic=deterministic)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, c)
    y = nn.Dense(c, use_bias=False, name="c_proj", kernel_init=(
        nn.initializers.normal(0.02 / math.sqrt(2 * self.n_layer))))(y)
    return nn.Dropout(self.dropout)(y, deterministic=deterministic)


class GPTBlock(_GPTLayer):
  """nanoGPT's Block: x + attn(ln_1 x), then x + mlp(ln_2 x)."""

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    c = x.shape[-1]
    ln = lambda name: nn.LayerNorm(epsilon=1e-5, use_bias=False, name=name)
    x = x + GPTAttention(self.n_head, self.n_layer, self.dropout,
                         self.qk_norm, name="attn")(ln("ln_1")(x),
                                                    deterministic)
    h = nn.Dense(4 * c, use_bias=False, name="c_fc",
                 kernel_init=nn.initializers.normal(0.02))(ln("ln_2")(x))
    h = nn.Dense(c, use_bias=False, name="c_proj", kernel_init=(
        nn.initializers.normal(0.02 / math.sqrt(2 * self.n_layer))))(
            nn.gelu(h, approximate=False))
    return x + nn.Dropout(self.dropout)(h, deterministic=deterministic)


class GPT(nn.Module):
  """nanoGPT's GPT: logits (batch, time, vocab), head tied to `wte`."""
  vocab_size: int
  block_size: int
  n_layer: int
  n_head: int
  n_embd: int
  dropout: float = 0.0
  qk_norm: bool = False

  @nn.compact
  def __call__(self, idx, deterministic: bool = True):
    t = idx.shape[-1]
    if t > self.block_size:
      raise ValueError(f"sequence of {t} > block_size {self.block_size}")
    init = nn.initializers.normal(0.02)
    wte = nn.Embed(self.vocab_size, self.n_embd, embedding_init=init,
                   name="wte")
    wpe = nn.Embed(self.block_size, self.n_embd, embedding_init=init,
                   name="wpe")
    x = wte(idx) + wpe(jnp.arange(t))
    x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
    for i in range(self.n_layer):
      x = GPTBlock(self.n_head, self.n_layer, self.dropout, self.qk_norm,
                   name=f"h_{i}")(x, deterministic)
    x = nn.LayerNorm(epsilon=1e-5, use_bias=False, name="ln_f")(x)
    return wte.attend(x)
