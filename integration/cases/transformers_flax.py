"""transformers' Flax models (a 4.x release): GPT-2 and Llama, tiny, with
`stiefel_attention` and the default selector, in a plain optax loop on the
model's params dict (as transformers' Flax examples train).

    python transformers_flax.py gpt2|llama

GPT-2 keeps q, k and v in one fused `c_attn` kernel; Llama keeps `q_proj`
and `k_proj` flat, (d, heads * head_dim). The selector must find the query
and key heads of both (the rest, GPT-2's v third included, on AdamW).
"""

import sys

import jax
import jax.numpy as jnp
import optax
import transformers

import stiefel_optax as so

import common

MODEL = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
NAME = f"transformers flax {MODEL} ({transformers.__version__})"
LR, WD = 1e-3, 1e-4


def build():
  if MODEL == "gpt2":
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                     n_layer=2, n_head=4)
    return transformers.FlaxGPT2LMHeadModel(config, seed=0)
  config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=16)
  return transformers.FlaxLlamaForCausalLM(config, seed=0)


def main():
  model = build()
  params = model.params
  common.selected(NAME, params)
  params = so.orthonormalize(params)
  tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)

  def loss(p):
    logits = model(tokens, params=p).logits[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  tx = so.stiefel_attention(LR, weight_decay=WD)
  ours, theirs = common.twin(tx, optax.adamw(LR, weight_decay=WD), params,
                             jax.grad(loss))
  common.isometry(NAME, ours)
  common.rest_equals(NAME, ours, theirs)
  common.done(NAME)


if __name__ == "__main__":
  main()
