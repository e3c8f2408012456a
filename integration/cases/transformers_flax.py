"""transformers' Flax models (a 4.x release): GPT-2 and Llama, tiny, with
`stiefel_attention` in a plain optax loop on the model's params dict (as
transformers' Flax examples train).

    python transformers_flax.py gpt2|llama

GPT-2 keeps q, k and v in one fused `c_attn` kernel stored (3 d, d); Llama
keeps `q_proj` and `k_proj` flat, (d, heads * head_dim). Neither shape
tells the head count, so the default selector refuses them (naming the
mapping to pass) and the user passes it, with the config's head counts, as
the error says; the rest (GPT-2's v third included) on AdamW.
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
    frames = {r"(^|/)c_attn/kernel$": so.fused_qkv(config.n_head,
                                                   transposed=True)}
    return transformers.FlaxGPT2LMHeadModel(config, seed=0), frames
  config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=16)
  frames = {
      r"q_proj/kernel$": so.FrameSpec(rows=0, cols=1,
                                      heads=config.num_attention_heads),
      r"k_proj/kernel$": so.FrameSpec(rows=0, cols=1,
                                      heads=config.num_key_value_heads)}
  return transformers.FlaxLlamaForCausalLM(config, seed=0), frames


def main():
  model, frames = build()
  params = model.params
  try:                                  # the default: a clear refusal
    so.selected_frames(params)
    common.say(NAME, "default", "the default selector accepted the tree")
  except ValueError as e:
    common.say(NAME, "default", f"refused: {str(e)[:160]}...")
  common.selected(NAME, params, frames)
  params = so.orthonormalize(params, frames)
  tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)

  def loss(p):
    logits = model(tokens, params=p).logits[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  tx = so.stiefel_attention(LR, weight_decay=WD, frames=frames)
  ours, theirs = common.twin(tx, optax.adamw(LR, weight_decay=WD), params,
                             jax.grad(loss))
  common.isometry(NAME, ours, frames)
  common.rest_equals(NAME, ours, theirs, frames)
  common.done(NAME)


if __name__ == "__main__":
  main()
