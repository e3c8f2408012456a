"""gemma: a tiny `gm.nn.Transformer` (google-deepmind's `gemma` package)
trained with `stiefel_attention` in a plain optax loop.

    python gemma_transformer.py bfloat16 mha    # gemma's default param dtype
    python gemma_transformer.py float32 gqa

`mha` (num_kv_heads == num_heads): gemma's attention fuses q, k and v into
one `qkv_einsum` (3, N, D, H), whose q and k parts are the frames; `gqa`:
`q_einsum` (N, D, H) and `kv_einsum` (2, K, D, H), whose k part is. Each
case trains twice, with the default selector and with `frames="gemma"`,
which must select the same leaves and train alike. The rest: the same
gradients fed to `optax.adamw` beside it (the AdamW group of
`stiefel_attention` is optax.adamw on float32 and bfloat16 leaves alike:
every whole non-frame leaf must equal its twin exactly, in both dtypes; the
v parts of the fused kernels to 4 eps, see `rest`).

bfloat16: the frames keep a float32 master copy (the library's default,
`master_frames=True`); the bf16 parameters are that master rounded, so the
isometry bound is the library's own for the dtype,
`stiefel_optax.checks.start_tolerance(bfloat16, head_dim)`.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from gemma import gm

import stiefel_optax as so
from stiefel_optax import checks

import common

LR, WD = 1e-3, 1e-4
VOCAB, EMBED, HIDDEN, HEADS, HEAD_DIM, LAYERS = 64, 32, 64, 4, 8, 2


def build(dtype, kv_heads):
  """The tiny model and its orthonormal start (the `params` collection)."""
  config = gm.nn.config.TransformerConfig(
      num_embed=VOCAB, embed_dim=EMBED, hidden_dim=HIDDEN, num_heads=HEADS,
      head_dim=HEAD_DIM, num_kv_heads=kv_heads, final_logit_softcap=None,
      use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=True,
      attention_types=gm.nn.config.make_attention_layers_types(
          (gm.nn.config.AttentionType.LOCAL_SLIDING,
           gm.nn.config.AttentionType.GLOBAL), num_layers=LAYERS),
      sliding_window_size=4)
  model = gm.nn.Transformer(config=config, dtype=dtype)
  tokens = jnp.arange(32, dtype=jnp.int32).reshape(4, 8) % VOCAB
  params = model.init(jax.random.key(0), tokens=tokens)["params"]
  return model, tokens, so.orthonormalize(params)


def rest(label, ours, theirs, frames, dtype):
  """The rest against AdamW's twin: every whole non-frame leaf exactly;
  the v parts of the fused kernels (`qkv_einsum`'s third, `kv_einsum`'s
  second half), which the library splits off, runs through AdamW and joins
  back, to the rounding of the dtype: 4 eps relative (measured: float32
  1.0e-07, an ulp of the weight; bfloat16 0)."""
  a, b = common._parts(ours, frames), common._parts(theirs, frames)
  if a.keys() != b.keys():
    raise AssertionError(f"{label}: the twins' trees differ")
  whole = [k for k in a if not k.endswith(" (rest)")]
  fused = [k for k in a if k.endswith(" (rest)")]

  def dev(keys):
    worst, where = 0.0, None
    for k in keys:
      scale = max(float(np.max(np.abs(b[k]), initial=0.0)), 1e-30)
      d = float(np.max(np.abs(a[k] - b[k]), initial=0.0)) / scale
      if d >= worst:
        worst, where = d, k
    return worst, where

  w, w_at = dev(whole)
  f, f_at = dev(fused)
  fused_tol = 4 * float(jnp.finfo(dtype).eps)
  common.say(label, "rest", f"{len(whole)} whole non-frame leaves equal"
             f" AdamW's twin: max relative difference {w:.1e} ({w_at});"
             f" {len(fused)} v parts of fused kernels: {f:.1e} ({f_at},"
             f" bound {fused_tol:.1e})")
  if not w == 0.0:
    raise AssertionError(f"{label}: {w_at} differs from AdamW's twin by"
                         f" {w:.3e}")
  if not f <= fused_tol:
    raise AssertionError(f"{label}: {f_at} differs from AdamW's twin by"
                         f" {f:.3e} > {fused_tol:.1e}")


def main():
  dtype_name, attn = sys.argv[1], sys.argv[2]
  dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype_name]
  kv_heads = {"mha": HEADS, "gqa": HEADS // 2}[attn]
  name = common.case_name()
  model, tokens, start = build(dtype, kv_heads)
  dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(start)})
  common.say(name, "model", f"gm.nn.Transformer, {LAYERS} layers, embed"
             f" {EMBED}, {HEADS} heads of {HEAD_DIM}, {kv_heads} kv heads;"
             f" params {dtypes}")

  def grad_fn(params):
    def loss(params):
      logits = model.apply({"params": params}, tokens=tokens).logits
      return optax.softmax_cross_entropy_with_integer_labels(
          logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()
    return jax.grad(loss)(params)

  tol = checks.start_tolerance(dtype, HEAD_DIM)
  trained = {}
  for frames in (None, "gemma"):
    label = f"{name} frames={frames or 'default'}"
    picked = common.selected(label, start, frames)
    want = {"mha": "qkv_einsum/w", "gqa": "q_einsum/w"}[attn]
    if len(picked) != (LAYERS if attn == "mha" else 2 * LAYERS) or not all(
        p.endswith(("qkv_einsum/w", "q_einsum/w", "kv_einsum/w"))
        for p in picked) or not any(p.endswith(want) for p in picked):
      raise AssertionError(f"{label}: selected {sorted(picked)}")
    tx = so.stiefel_attention(LR, weight_decay=WD, frames=frames)
    ours, theirs = common.twin(tx, optax.adamw(LR, weight_decay=WD), start,
                               grad_fn)
    err = float(so.max_isometry_error(ours, frames))
    common.say(label, "isometry", f"{err:.2e} after {common.STEPS} steps in"
               f" {dtype_name} (bound start_tolerance = {tol:.3g})")
    if not err <= tol:
      raise AssertionError(f"{label}: isometry {err:.3e} > {tol:.3g}")
    moved = max(float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                      - b.astype(jnp.float32))))
                for a, b in zip(jax.tree.leaves(ours),
                                jax.tree.leaves(start)))
    if not moved > 0:
      raise AssertionError(f"{label}: the parameters did not move")
    dtypes_after = sorted({str(x.dtype) for x in jax.tree.leaves(ours)})
    if dtypes_after != dtypes:
      raise AssertionError(f"{label}: dtypes {dtypes} -> {dtypes_after}")
    rest(label, ours, theirs, frames, dtype)
    trained[frames] = ours
  same = all(np.array_equal(np.asarray(a, np.float32),
                            np.asarray(b, np.float32))
             for a, b in zip(jax.tree.leaves(trained[None]),
                             jax.tree.leaves(trained["gemma"])))
  common.say(name, "presets", "default and frames='gemma' train"
             + (" identically" if same else " differently"))
  if not same:
    raise AssertionError(f"{name}: default and frames='gemma' differ")
  common.done(name)


if __name__ == "__main__":
  main()
