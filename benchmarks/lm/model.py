"""The model of a configuration (`benchmarks.models.GPT`), its initial
parameters and its loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import stiefel_optax as so
from benchmarks.lm.arms import ARMS, frames
from benchmarks.lm.config import Config
from benchmarks.models import GPT


def make_model(cfg: Config, vocab_size: int) -> GPT:
  return GPT(vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
             cfg.dropout, qk_norm=ARMS[cfg.arm].qk_norm)


def initial_params(cfg: Config, vocab_size: int, seed: int):
  """nanoGPT's initialisation from the seed (the same for every arm); the
  orthonormal-start arms replace each head's q and k by its polar factor."""
  model = make_model(cfg, vocab_size)
  x = jnp.zeros((1, cfg.block_size), jnp.int32)
  params = model.init(jax.random.fold_in(jax.random.PRNGKey(seed), 0),
                      x)["params"]
  if ARMS[cfg.arm].orthonormal:
    params = so.orthonormalize(params, frames(cfg))
  return params


def n_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def loss_fn(model: GPT, params, x, y, dropout_key=None, logits=False):
  """Mean next-token cross-entropy; with logits=True, (loss, its forward
  pass's attention-logit records `logit_records`)."""
  kw = dict(deterministic=dropout_key is None,
            rngs=None if dropout_key is None else {"dropout": dropout_key})
  if not logits:
    out = model.apply({"params": params}, x, **kw)
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
  out, sown = model.apply({"params": params}, x, mutable=["intermediates"],
                          **kw)
  loss = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
  return loss, logit_records(sown)


def logit_records(sown) -> dict:
  """{"max_logit": (n_layer, n_head) max |q . k| / sqrt(head_dim), "bound":
  (n_layer,) max ||x_i|| ||x_j|| / sqrt(head_dim)} over a forward pass's
  causal pairs, from what `GPTAttention` sowed."""
  layers = sorted(sown["intermediates"], key=lambda n: int(n.split("_")[1]))
  attn = [sown["intermediates"][n]["attn"] for n in layers]
  return dict(max_logit=jnp.stack([a["max_logit"][0] for a in attn]),
              bound=jnp.stack([a["logit_bound"][0] for a in attn]))
