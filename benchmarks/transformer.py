"""A small Flax linen transformer that classifies from the last token.

Generic in vocabulary, sequence length, width, heads and depth. Attention is
`flax.linen.MultiHeadDotProductAttention`, so its query/key kernels sit at
`.../attn/query/kernel` and `.../attn/key/kernel` with shape
(d_model, heads, head_dim), the layout `stiefel_optax.stiefel_attention`
labels by default. Residual blocks, ReLU MLP, optional pre-LayerNorm (off by
default, as in the grokking literature's one-layer models).

Only the last position's output is read, so the last block attends from the
last position alone (`inputs_q = x[:, -1:]`): the same logits as a full
forward pass, without the unread positions' work.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Block(nn.Module):
  """x + Attn(x), then + MLP; `last_only` attends from the last position."""
  d_model: int
  num_heads: int
  d_mlp: int
  layer_norm: bool = False
  attn_bias: bool = False
  last_only: bool = False

  def _norm(self, name, x):
    return nn.LayerNorm(name=name)(x) if self.layer_norm else x

  @nn.compact
  def __call__(self, x):
    h = self._norm("ln_attn", x)
    q = h[:, -1:] if self.last_only else h
    x = (x[:, -1:] if self.last_only else x) + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, qkv_features=self.d_model,
        out_features=self.d_model, use_bias=self.attn_bias,
        name="attn")(q, h)
    h = self._norm("ln_mlp", x)
    h = nn.relu(nn.Dense(self.d_mlp, name="mlp_in")(h))
    return x + nn.Dense(self.d_model, name="mlp_out")(h)


class Transformer(nn.Module):
  """Token + learned position embeddings, `num_layers` blocks, unembedding
  of the last position to `num_classes` logits, shape (batch, num_classes)."""
  vocab_size: int
  seq_len: int
  num_classes: int
  d_model: int = 128
  num_heads: int = 4
  d_mlp: int = 512
  num_layers: int = 1
  layer_norm: bool = False
  attn_bias: bool = False

  @nn.compact
  def __call__(self, tokens):
    if tokens.shape[-1] != self.seq_len:
      raise ValueError(f"tokens have length {tokens.shape[-1]}; the model was"
                       f" built for seq_len = {self.seq_len}.")
    init = nn.initializers.normal(1.0 / jnp.sqrt(self.d_model))
    x = nn.Embed(self.vocab_size, self.d_model, embedding_init=init,
                 name="embed")(tokens)
    pos = self.param("pos_embed", init, (self.seq_len, self.d_model))
    x = x + pos[None]
    for i in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, self.d_mlp, self.layer_norm,
                self.attn_bias, last_only=i == self.num_layers - 1,
                name=f"block_{i}")(x)
    if self.layer_norm:
      x = nn.LayerNorm(name="ln_final")(x)
    return nn.Dense(self.num_classes, use_bias=False, name="unembed")(x[:, -1])


def init_params(model: Transformer, key: jax.Array, batch: int = 1):
  """The model's parameters for integer tokens of shape (batch, seq_len)."""
  tokens = jnp.zeros((batch, model.seq_len), jnp.int32)
  return model.init(key, tokens)["params"]


def loss_and_accuracy(model: Transformer, params, tokens, labels):
  """Mean cross-entropy on the answer token, and accuracy."""
  logits = model.apply({"params": params}, tokens)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()
  acc = jnp.mean(jnp.argmax(logits, -1) == labels)
  return loss, acc


def loss_fn(model: Transformer, params, tokens, labels):
  """Scalar training loss (cross-entropy on the answer token)."""
  return loss_and_accuracy(model, params, tokens, labels)[0]
