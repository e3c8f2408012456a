"""penzai: a tiny llama-like transformer (GQA, LayerStack) trained by
penzai's own `basic_training.StatefulTrainer` with `stiefel_attention`.

    python penzai_llamalike.py

The trainer hands the optimizer a tuple of ParameterValues; the default
selector finds the query/key weights by their labels and axis names. The
rest: the same gradients (penzai's loss on the Stiefel model) fed to
`stiefel_attention` and `optax.adamw` beside each other.
"""

import jax
import jax.numpy as jnp
import optax
from penzai import pz
from penzai.models.transformer.variants import llamalike_common
from penzai.toolshed import basic_training

import stiefel_optax as so

import common

NAME = "penzai llamalike"
LR, WD = 1e-3, 1e-4


def loss_fn(*, model, state, rng, tokens):
  logits = model(tokens)
  loss = pz.nx.nmap(optax.softmax_cross_entropy_with_integer_labels)(
      logits[{"seq": pz.slice[:-1]}].untag("vocabulary"),
      tokens[{"seq": pz.slice[1:]}])
  return loss.unwrap("batch", "seq").mean(), state, None


def build():
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=2, embedding_dim=32,
      projection_dim=8, mlp_hidden_dim=64, num_decoder_blocks=2,
      vocab_size=50, mlp_variant="swiglu", tie_embedder_and_logits=False,
      use_layer_stack=True)
  model = llamalike_common.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(0))
  _, params = pz.unbind_params(model)
  values = so.orthonormalize(pz.freeze_params(params))
  for param, value in zip(params, values):
    param.value = value.value
  return model


def main():
  tokens = pz.nx.wrap(jnp.arange(32).reshape(4, 8) % 50).tag("batch", "seq")
  model = build()
  values = pz.freeze_params(pz.unbind_params(model)[1])
  common.selected(NAME, values)
  tx = so.stiefel_attention(LR, weight_decay=WD)
  trainer = basic_training.StatefulTrainer.build(
      root_rng=jax.random.key(1), model=model, optimizer_def=tx,
      loss_fn=loss_fn)
  for _ in range(common.STEPS):
    trainer.step(tokens=tokens)
  trained = pz.freeze_params(pz.unbind_params(model)[1])
  common.say(NAME, "trainer", f"{common.STEPS} steps by penzai's"
             " StatefulTrainer")
  common.isometry(NAME, trained)

  # The rest: the same gradients to stiefel_attention and optax.adamw.
  twin_model = build()
  unbound, params = pz.unbind_params(twin_model)
  start = pz.freeze_params(params)

  def grad_fn(values):
    def loss(values):
      m = pz.bind_variables(unbound, values)   # frozen values: traceable
      return loss_fn(model=m, state=None, rng=None, tokens=tokens)[0]
    return jax.grad(loss)(values)

  ours, theirs = common.twin(tx, optax.adamw(LR, weight_decay=WD), start,
                             grad_fn)
  common.rest_equals(NAME, ours, theirs)
  common.isometry(NAME + " (twin)", ours)
  common.done(NAME)


if __name__ == "__main__":
  main()
