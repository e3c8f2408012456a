"""Fused and transposed q/k/v kernels as real packages store them (issue 55).

MaxText needs Python >= 3.12 and transformers' Flax models a 4.x release, so
neither is in the test environment: the trees here copy the exact paths and
shapes their code produces (small sizes, except GPT-2's where the sizes are
the point):

* MaxText `fused_qkv=True` (`src/maxtext/layers/attentions.py`):
  `init_qkv_w` is a DenseGeneral from embed to (Nq + 2 Nkv, head_dim),
  kernel_axes ("embed", "heads", "kv") (since the GQA support of July 2026,
  release 0.2.4 on); before it, (3, Nq, head_dim), ("embed", "qkv", "heads",
  "kv"), MHA only. `init_out_w`: `out/kernel` (Nq, head_dim, embed). Scanned
  layers (`scan_layers: true`, `param_scan_axis: 1` in configs/base.yml) add
  a layer axis at 1 of every kernel. `qkv_projection` splits the heads axis
  at [Nq, Nq + Nkv] per tensor-parallel shard (`split_qkv` under shard_map).
* transformers' Flax GPT-2 (`models/gpt2/modeling_flax_gpt2.py`):
  `FlaxConv1D` keeps its kernel (features, in), so `c_attn/kernel` is
  (3 d, d) and the layer computes x @ kernel.T, then `jnp.split(., 3)` and
  `_split_heads`; blocks are named `transformer/h/{i}`.
* transformers' Flax Llama (`models/llama/modeling_flax_llama.py`, 4.x):
  `model/layers/{i}/self_attn/{q,k,v,o}_proj/kernel`, nn.Dense kernels (d,
  num_attention_heads * head_dim) for q and (d, num_key_value_heads *
  head_dim) for k and v.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so

from tests.helpers import plain_isometry

D, L, HD = 32, 2, 8          # embed, scanned layers, head_dim

# As in test_layouts.py: LLVM's optimisation is most of the compile time of
# these small programs and none of what they test.
jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _normal(rng, *shape):
  return jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32)


def maxtext_fused(nq, nkv, *, scanned=True, before_0_2_4=False, seed=0):
  """MaxText's decoder layer params with fused_qkv=True."""
  rng = np.random.default_rng(seed)
  n = lambda *s: _normal(rng, *s)
  lay = (L,) if scanned else ()
  heads = (3, nq) if before_0_2_4 else (nq + 2 * nkv,)
  layer = {
      "pre_self_attention_layer_norm": {"scale": n(D, *lay)},
      "self_attention": {"qkv_proj": {"kernel": n(D, *lay, *heads, HD)},
                         "out": {"kernel": n(nq, *lay, HD, D)}},
      "post_self_attention_layer_norm": {"scale": n(D, *lay)},
      "mlp": {"wi_0": {"kernel": n(D, *lay, 48)},
              "wi_1": {"kernel": n(D, *lay, 48)},
              "wo": {"kernel": n(48, *lay, D)}}}
  return {"token_embedder": {"embedding": n(40, D)},
          "decoder": {"decoder_norm": {"scale": n(D)},
                      "layers" if scanned else "layers_0": layer}}


QKV = "self_attention/qkv_proj/kernel"


def _qkv(tree):
  (path,) = [p for p in so.selected_frames(tree) if p.endswith(QKV)]
  return path


def _plain_qk_heads(w, nq, nkv, before_0_2_4=False, tp=1):
  """The q and k heads of a fused kernel (embed, [layers,] heads, hd), cut
  by plain indexing as MaxText's split_qkv does (per tensor shard), each
  (embed, hd)."""
  w = np.asarray(w)
  if w.ndim == 3 + before_0_2_4:            # unscanned: add a layer axis
    w = w[:, None]
  out = []
  for l in range(w.shape[1]):
    if before_0_2_4:
      out += [w[:, l, c, h] for c in (0, 1) for h in range(nq)]
      continue
    per = (nq + 2 * nkv) // tp
    for s in range(tp):
      block = w[:, l, s * per:(s + 1) * per]
      out += [block[:, h] for h in range(nq // tp + nkv // tp)]
  return out


def _v_heads(w, nq, nkv, before_0_2_4=False):
  w = np.asarray(w)
  return w[..., 2, :, :] if before_0_2_4 else w[..., nq + nkv:, :]


@pytest.mark.parametrize("nq,nkv,scanned,before", [
    (4, 2, True, False),       # GQA, scanned: (embed, layers, Nq + 2 Nkv, hd)
    (4, 2, False, False),      # GQA, unscanned
    (4, 4, True, False),       # MHA, scanned
    (2, 1, False, False),      # MQA-like groups of 2
    (4, 4, True, True),        # before 0.2.4: (embed, layers, 3, Nq, hd)
    (4, 4, False, True)])
def test_default_and_maxtext_preset_take_the_fused_qkv_proj(
    nq, nkv, scanned, before):
  tree = maxtext_fused(nq, nkv, scanned=scanned, before_0_2_4=before)
  auto, preset = so.selected_frames(tree), so.selected_frames(tree, "maxtext")
  assert auto == preset and len(auto) == 1
  path = _qkv(tree)
  # The frames are exactly the q and k heads (plain indexing), in order.
  w = tree["decoder"]["layers" if scanned else "layers_0"][
      "self_attention"]["qkv_proj"]["kernel"]
  view = so.to_frames(w, auto[path], path)
  got = np.asarray(view).reshape(-1, D, HD)
  want = _plain_qk_heads(w, nq, nkv, before)
  assert got.shape[0] == len(want) == (L if scanned else 1) * (nq + (
      nq if before else nkv))
  assert {a.tobytes() for a in got} == {a.tobytes() for a in want}


def test_fused_qkv_trains_q_k_on_the_manifold_and_v_as_adamw():
  raw = maxtext_fused(4, 2)
  tree = jit(so.orthonormalize)(raw)
  get = lambda t: t["decoder"]["layers"]["self_attention"]["qkv_proj"][
      "kernel"]
  # orthonormalize: the q and k heads orthonormal, the v heads untouched.
  assert plain_isometry(_plain_qk_heads(get(raw), 4, 2)) > 0.5
  assert plain_isometry(_plain_qk_heads(get(tree), 4, 2)) <= 1e-5
  np.testing.assert_array_equal(_v_heads(get(tree), 4, 2),
                                _v_heads(get(raw), 4, 2))
  tx, ref = so.stiefel_attention(1e-2), optax.adamw(
      1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
  grads = jax.tree.map(lambda x: jnp.cos(3.0 * x) + 0.1, tree)

  @jit
  def step(p, r, s, rs):
    u, s = tx.update(grads, s, p)
    ru, rs = ref.update(grads, rs, r)
    return optax.apply_updates(p, u), optax.apply_updates(r, ru), s, rs

  p, r, s, rs = tree, tree, tx.init(tree), ref.init(tree)
  for _ in range(3):
    p, r, s, rs = step(p, r, s, rs)
  assert plain_isometry(_plain_qk_heads(get(p), 4, 2)) <= 1e-5
  assert float(jnp.max(jnp.abs(get(p) - get(tree))[..., :6, :])) > 1e-3
  np.testing.assert_allclose(_v_heads(get(p), 4, 2), _v_heads(get(r), 4, 2),
                             rtol=0, atol=1e-6)
  out = lambda t: t["decoder"]["layers"]["self_attention"]["out"]["kernel"]
  np.testing.assert_array_equal(out(p), out(r))


def test_maxtext_fused_qkv_with_tensor_parallelism_takes_each_shards_heads():
  # Nq = 4, Nkv = 2 over 2 tensor shards: [q q k v | q q k v].
  spec = so.maxtext_fused_qkv(4, 2, tensor_parallelism=2)
  assert spec == so.FrameSpec(rows=0, cols=-1, parts=8, take=(0, 1, 2, 4, 5, 6),
                              part_axis=-2)
  w = maxtext_fused(4, 2)["decoder"]["layers"]["self_attention"][
      "qkv_proj"]["kernel"]
  got = np.asarray(so.to_frames(w, spec)).reshape(-1, D, HD)
  want = _plain_qk_heads(w, 4, 2, tp=2)
  assert {a.tobytes() for a in got} == {a.tobytes() for a in want}
  assert len(want) == L * 6
  with pytest.raises(ValueError, match=r"num_kv_heads must divide"):
    so.maxtext_fused_qkv(4, 3)
  with pytest.raises(ValueError, match=r"tensor_parallelism must divide"):
    so.maxtext_fused_qkv(4, 2, tensor_parallelism=4)


def test_fused_qkv_proj_sharded_over_its_heads_is_refused():
  """Sharded over tensor parallelism, which heads are q and k depends on the
  shard count: the default does not guess (an abstract mesh of 2 shards,
  so that no devices are needed)."""
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
  tree = maxtext_fused(4, 2)
  attn = tree["decoder"]["layers"]["self_attention"]
  kernel = attn["qkv_proj"]["kernel"]
  attn["qkv_proj"]["kernel"] = jax.ShapeDtypeStruct(
      kernel.shape, kernel.dtype, sharding=NamedSharding(
          AbstractMesh((2,), ("tensor",)), P(None, None, "tensor", None)))
  with pytest.raises(ValueError, match=(
      r"qkv_proj/kernel: shape \(32, 2, 8, 8\), MaxText's fused q/k/v kernel"
      r" \(Nq = 4, Nkv = 2\), has its heads axis sharded 2 ways.*"
      r"maxtext_fused_qkv\(4, 2, tensor_parallelism=T\)")):
    so.selected_frames(tree)
  spec = so.maxtext_fused_qkv(4, 2, tensor_parallelism=2)
  assert so.selected_frames(tree, {r"qkv_proj/kernel$": spec}) == {
      "decoder/layers/" + QKV: spec}


def test_fused_qkv_proj_without_its_out_kernel_names_the_fix():
  tree = maxtext_fused(4, 2)
  del tree["decoder"]["layers"]["self_attention"]["out"]
  for frames in (None, "maxtext"):
    with pytest.raises(ValueError, match=(
        r"decoder/layers/self_attention/qkv_proj/kernel: shape \(32, 2, 8, 8\)"
        r" looks like MaxText's fused q/k/v kernel.*no out projection.*"
        r"maxtext_fused_qkv\(num_query_heads, num_kv_heads\)")):
      so.selected_frames(tree, frames)
  # With the spec given, it trains.
  spec = so.maxtext_fused_qkv(4, 2)
  assert so.selected_frames(tree, {r"qkv_proj/kernel$": spec}) == {
      "decoder/layers/self_attention/qkv_proj/kernel": spec}


# --------------------------------------------------------------------------
# Two towers: the default selects every query/key kernel, or refuses.


def _linen_tower(seed=3):
  rng = np.random.default_rng(seed)
  return {name: {"kernel": _normal(rng, D, 4, HD)}
          for name in ("query", "key", "value")}


def test_two_towers_the_fused_one_is_selected_too():
  tree = {"vision": {"attn": _linen_tower()},
          "text": maxtext_fused(4, 2)}
  chosen = so.selected_frames(tree)
  assert set(chosen) == {"vision/attn/query/kernel", "vision/attn/key/kernel",
                         "text/decoder/layers/" + QKV}


@pytest.mark.parametrize("name,shape", [
    ("wq", (D, D)), ("to_q", (D, 4 * HD)), ("qkv", (D, 3 * D)),
    ("W_K", (4, D, HD))])
def test_default_refuses_a_lookalike_it_leaves_on_adamw(name, shape):
  rng = np.random.default_rng(0)
  tree = {"vision": {"attn": _linen_tower()},
          "text": {"blocks_0": {"attention": {
              name: {"kernel": _normal(rng, *shape)},
              "bias": _normal(rng, shape[-1])}}}}
  path = f"text/blocks_0/attention/{name}/kernel"
  with pytest.raises(ValueError, match=(
      rf"default \(auto\) selects 2 leaves as frames but leaves {path}"
      rf" {re.escape(str(shape))}.* on AdamW.*query/key projection.*"
      rf"'\^{path}\$': FrameSpec\(rows=<input axis>.*or None in its place")):
    so.stiefel_attention(1e-3).init(tree)
  # The fix the message gives works both ways: frames, or AdamW by name.
  keep = {r"^vision/attn/(?:query|key)/kernel$": so.FrameSpec(rows=-3, cols=-1),
          rf"^{path}$": None}
  assert set(so.selected_frames(tree, keep)) == {
      "vision/attn/query/kernel", "vision/attn/key/kernel"}


def test_selects_no_leaf_lists_every_attention_leaf_and_fused_ones():
  rng = np.random.default_rng(0)
  layers = {str(i): {"self_attn": {
      f"{p}_proj": {"kernel": _normal(rng, D, D)} for p in "qkvo"},
      "mlp": {"up_proj": {"kernel": _normal(rng, D, 48)}}} for i in range(20)}
  layers["20"] = {"attn": {"c_attn": {"kernel": _normal(rng, D, 3 * D)}}}
  tree = {"model": {"layers": layers}}
  with pytest.raises(ValueError) as err:
    so.selected_frames(tree, "flax")
  msg = str(err.value)
  assert "selects no leaf" in msg
  for i in range(20):                           # all 80, not the first 12
    for p in "qkvo":
      assert f"model/layers/{i}/self_attn/{p}_proj/kernel ({D}, {D})" in msg
  assert f"model/layers/20/attn/c_attn/kernel ({D}, {3 * D}) (looks fused)" in msg
  assert "select its query and key parts" in msg
  assert "up_proj" in msg.split("Other leaves:")[1]


# --------------------------------------------------------------------------
# transformers' Flax GPT-2: c_attn (3 d, d).


def hf_gpt2(d, heads, layers=1, seed=0, scale=0.02):
  """FlaxGPT2LMHeadModel's params (tied lm_head: no lm_head leaf)."""
  del heads
  rng = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
  ln = lambda: {"scale": jnp.ones(d), "bias": jnp.zeros(d)}
  conv = lambda features, inputs: {"kernel": n(features, inputs),
                                   "bias": jnp.zeros(features)}
  h = {str(i): {"ln_1": ln(),
                "attn": {"c_attn": conv(3 * d, d), "c_proj": conv(d, d)},
                "ln_2": ln(),
                "mlp": {"c_fc": conv(4 * d, d), "c_proj": conv(d, 4 * d)}}
       for i in range(layers)}
  return {"transformer": {"wte": {"embedding": n(50, d)},
                          "wpe": {"embedding": n(16, d)},
                          "h": h, "ln_f": ln()}}


def test_gpt2_real_sizes_default_names_the_transposed_spec():
  tree = hf_gpt2(768, 12)
  with pytest.raises(ValueError, match=(
      r"transformer/h/0/attn/c_attn/kernel: shape \(2304, 768\) is a fused"
      r" q/k/v kernel stored \(3 d, d\).*fused_qkv\(num_heads,"
      r" transposed=True\).*a divisor of d = 768")) as err:
    so.selected_frames(tree)
  assert "divisor of 256" not in str(err.value)
  # The nanoGPT spec on it is refused, naming the transposed one.
  with pytest.raises(ValueError, match=(
      r"c_attn/kernel: shape \(2304, 768\) is cut into 3 parts along axis 1.*"
      r"would train the wrong frames.*fused_qkv\(12, transposed=True\)")):
    so.selected_frames(tree, {r"c_attn/kernel$": so.fused_qkv(12)})
  spec = so.fused_qkv(12, transposed=True)
  assert so.selected_frames(tree, {r"attn/c_attn/kernel$": spec}) == {
      "transformer/h/0/attn/c_attn/kernel": spec}
  assert so.to_frames(tree["transformer"]["h"]["0"]["attn"]["c_attn"][
      "kernel"], spec).shape == (2, 12, 768, 64)


def test_gpt2_transposed_spec_takes_the_true_frames():
  """Sizes where the (d, 3 d) spec fits the shape too (d / 3 divisible by
  the heads): it is refused, and the transposed spec's frames are the
  heads' columns of x @ kernel.T, as FlaxGPT2Attention computes them."""
  d, heads = 48, 4
  hd = d // heads
  tree = hf_gpt2(d, heads, layers=2)
  with pytest.raises(ValueError, match=r"would train the wrong frames"):
    so.stiefel_attention(1e-2, frames={r"c_attn/kernel$": so.fused_qkv(heads)}
                         ).init(tree)
  frames = {r"attn/c_attn/kernel$": so.fused_qkv(heads, transposed=True)}

  def true_frames(t):
    out = []
    for i in ("0", "1"):
      k = np.asarray(t["transformer"]["h"][i]["attn"]["c_attn"]["kernel"])
      w = k.T                                     # (d, 3 d): y = x @ k.T
      out += [w[:, p * d + h * hd: p * d + (h + 1) * hd]
              for p in (0, 1) for h in range(heads)]
    return out

  views = so.map_frames(lambda w: w, tree, frames, back=False)
  got = np.concatenate([np.asarray(v).reshape(-1, d, hd)
                        for v in views.values()])
  want = true_frames(tree)
  assert len(want) == 2 * 2 * heads
  assert {a.tobytes() for a in got} == {a.tobytes() for a in want}
  ortho = jit(lambda t: so.orthonormalize(t, frames))(tree)
  assert plain_isometry(true_frames(tree)) > 0.5
  assert plain_isometry(true_frames(ortho)) <= 1e-5
  for i in ("0", "1"):                            # the v third untouched
    np.testing.assert_array_equal(
        ortho["transformer"]["h"][i]["attn"]["c_attn"]["kernel"][2 * d:],
        tree["transformer"]["h"][i]["attn"]["c_attn"]["kernel"][2 * d:])


# --------------------------------------------------------------------------
# transformers' Flax Llama: q_proj / k_proj (d, heads * head_dim).


def hf_llama(d=D, heads=4, kv_heads=2, layers=2, seed=0):
  """FlaxLlamaForCausalLM's params (4.x, with num_key_value_heads)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: _normal(rng, *s)
  hd = d // heads
  layer = lambda: {
      "input_layernorm": {"weight": jnp.ones(d)},
      "self_attn": {"q_proj": {"kernel": n(d, heads * hd)},
                    "k_proj": {"kernel": n(d, kv_heads * hd)},
                    "v_proj": {"kernel": n(d, kv_heads * hd)},
                    "o_proj": {"kernel": n(heads * hd, d)}},
      "post_attention_layernorm": {"weight": jnp.ones(d)},
      "mlp": {"gate_proj": {"kernel": n(d, 48)},
              "up_proj": {"kernel": n(d, 48)},
              "down_proj": {"kernel": n(48, d)}}}
  return {"model": {"embed_tokens": {"embedding": n(40, d)},
                    "layers": {str(i): layer() for i in range(layers)},
                    "norm": {"weight": jnp.ones(d)}},
          "lm_head": {"kernel": n(d, 40)}}


def test_llama_default_refuses_with_the_one_line_spec():
  tree = hf_llama()
  with pytest.raises(ValueError, match=(
      r"model/layers/0/self_attn/[qk]_proj/kernel: shape \(32, (32|16)\) is a"
      r" 2-D q_proj/k_proj kernel.*transformers' Flax Llama.*"
      r"heads=config.num_attention_heads.*heads=config.num_key_value_heads")):
    so.selected_frames(tree)
  # The one line, with Llama's config values: q 4 heads, k 2 heads of 8.
  frames = {r"q_proj/kernel$": so.FrameSpec(rows=0, cols=1, heads=4),
            r"k_proj/kernel$": so.FrameSpec(rows=0, cols=1, heads=2)}
  shapes = so.map_frames(lambda w: w.shape, tree, frames, back=False)
  assert shapes == {f"model/layers/{i}/self_attn/{p}_proj/kernel": (h, D, 8)
                    for i in range(2) for p, h in (("q", 4), ("k", 2))}
