"""Parameter trees that copy real model layouts, trained by `stiefel_attention`.

Each family's tree copies its source's names, shapes and axis order exactly
(small sizes):

* Gemma (`gemma/gm/nn/_modules.py`): `layer_i/attn/q_einsum/w` (N, D, H),
  `attn/kv_einsum/w` (2, K, D, H) ([0] key, [1] value), or
  `attn/qkv_einsum/w` (3, N, D, H) when K == N; `attn/attn_vec_einsum/w`
  (N, H, D); `attn/_query_norm/scale`, `attn/_key_norm/scale` (H,); the
  `mlp/gating_einsum` (2, D, hidden) and `mlp/linear` (hidden, D); the RMSNorm
  scales; `embedder/input_embedding` (vocab, D); `final_norm/scale`. GQA
  (K = 2 < N), MQA (K = 1) and fused (K == N).
* MaxText, scanned (param_scan_axis = 1):
  `decoder/layers/self_attention/{query,key,value}/kernel`
  (embed, layers, heads, head_dim), `out/kernel` (heads, layers, head_dim,
  embed), `mlp/wi_0|wi_1|wo/kernel`, the norms' (embed, layers) scales.
* nanoGPT (`model.py`, as its Flax ports store it):
  `transformer/h_i/attn/c_attn/kernel` (d, 3d) + bias, `c_proj`, `mlp/c_fc`,
  `mlp/c_proj`, `ln_1`, `ln_2`, `wte`, `wpe`, `ln_f`.
* a real flax.linen model with `nn.scan` over a block holding
  `nn.MultiHeadDotProductAttention`: `layers/attn/query/kernel`
  (layers, d, heads, head_dim).
* a real flax.nnx GQA module: `nnx.LinearGeneral` query (d, N, H) and
  key/value (d, K, H) kernels.

For each: the selector picks exactly the Q/K frames (`so.selected_frames`, and the
default where it applies); `orthonormalize` touches nothing else
(bit-identical); 20 steps of `stiefel_attention` keep the frames on the
manifold (<= 1e-5, by `max_isometry_error` and by plain indexing of the
kernels as the model uses them) and move them, while every other leaf and
every part of a fused leaf that is not a frame equals plain `optax.adamw`
(stiefel_attention's defaults) fed the same gradients: to 1e-6 of the leaf's
largest entry at every step (whole leaves come out bit-identical; the parts
of fused leaves within 1-3 ulp of an update, XLA's rounding of the sliced
arithmetic, which an elementwise rtol would flag on entries near zero).
Then the error cases: every one a ValueError naming the path and the shape.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stiefel_optax as so
from stiefel_optax import views

from tests.helpers import plain_isometry

D, N, K, H = 32, 4, 2, 8          # embed, heads, kv heads, head_dim
HIDDEN, VOCAB, LAYERS, CTX = 48, 40, 2, 16
LR, STEPS = 1e-2, 20
# stiefel_attention's AdamW defaults.
ADAMW = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)

# XLA's CPU backend (LLVM) optimisation is most of the compile time of these
# small programs and none of what they test: the HLO passes (fusion,
# simplification) still run; only the machine code is less optimised.
jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _normal(rng, *shape, scale=0.2):
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


# --------------------------------------------------------------------------
# The trees.


def gemma_params(num_kv_heads: int, seed: int = 0, layers: int = LAYERS):
  """A Gemma `Transformer`'s params (`gm.nn`), `num_kv_heads` == N fuses
  q, k and v in qkv_einsum as the gemma package does."""
  rng = np.random.default_rng(seed)
  n = lambda *s: _normal(rng, *s)

  def layer():
    attn = {"attn_vec_einsum": {"w": n(N, H, D)},
            "_query_norm": {"scale": n(H)},
            "_key_norm": {"scale": n(H)}}
    if num_kv_heads == N:
      attn["qkv_einsum"] = {"w": n(3, N, D, H)}
    else:
      attn["q_einsum"] = {"w": n(N, D, H)}
      attn["kv_einsum"] = {"w": n(2, num_kv_heads, D, H)}
    return {"pre_attention_norm": {"scale": n(D)},
            "attn": attn,
            "post_attention_norm": {"scale": n(D)},
            "pre_ffw_norm": {"scale": n(D)},
            "mlp": {"gating_einsum": n(2, D, HIDDEN), "linear": n(HIDDEN, D)},
            "post_ffw_norm": {"scale": n(D)}}

  tree = {"embedder": {"input_embedding": n(VOCAB, D)},
          "final_norm": {"scale": n(D)}}
  for i in range(layers):
    tree[f"layer_{i}"] = layer()
  return tree


def maxtext_params(seed: int = 1):
  """MaxText's decoder with scanned layers (layer axis 1 of every kernel)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: _normal(rng, *s)
  return {
      "token_embedder": {"embedding": n(VOCAB, D)},
      "decoder": {
          "decoder_norm": {"scale": n(D)},
          "layers": {
              "pre_self_attention_layer_norm": {"scale": n(D, LAYERS)},
              "self_attention": {
                  "query": {"kernel": n(D, LAYERS, N, H)},
                  "key": {"kernel": n(D, LAYERS, K, H)},
                  "value": {"kernel": n(D, LAYERS, K, H)},
                  "out": {"kernel": n(N, LAYERS, H, D)}},
              "post_self_attention_layer_norm": {"scale": n(D, LAYERS)},
              "mlp": {"wi_0": {"kernel": n(D, LAYERS, HIDDEN)},
                      "wi_1": {"kernel": n(D, LAYERS, HIDDEN)},
                      "wo": {"kernel": n(HIDDEN, LAYERS, D)}}}}}


def nanogpt_params(seed: int = 2):
  """nanoGPT's GPT (n_embd = D, n_head = N) as a Flax port stores it."""
  rng = np.random.default_rng(seed)
  n = lambda *s: _normal(rng, *s)
  ln = lambda: {"scale": n(D), "bias": n(D)}
  dense = lambda i, o: {"kernel": n(i, o), "bias": n(o)}
  tree = {"wte": {"embedding": n(VOCAB, D)}, "wpe": {"embedding": n(CTX, D)},
          "ln_f": ln()}
  for i in range(LAYERS):
    tree[f"h_{i}"] = {"ln_1": ln(),
                      "attn": {"c_attn": dense(D, 3 * D),
                               "c_proj": dense(D, D)},
                      "ln_2": ln(),
                      "mlp": {"c_fc": dense(D, 4 * D),
                              "c_proj": dense(4 * D, D)}}
  return {"transformer": tree}


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    y = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * H,
                                        name="attn")(nn.LayerNorm()(x))
    x = x + y
    x = x + nn.Dense(D)(nn.gelu(nn.Dense(HIDDEN)(nn.LayerNorm()(x))))
    return x, None


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    stack = nn.scan(LinenBlock, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=LAYERS)
    x, _ = stack(name="layers")(x, None)
    return nn.Dense(VOCAB)(x)


TOKENS = jnp.arange(8, dtype=jnp.int32)[None] % VOCAB


def _random_like(tree, seed):
  """`tree`'s structure and shapes (abstract leaves are fine), random values:
  the module's own initialisers, run eagerly, cost seconds of op-by-op
  compilation that the tests do not need."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: _normal(rng, *x.shape), tree)


@functools.lru_cache(maxsize=None)
def _linen_shapes():
  return jax.eval_shape(LinenModel().init, jax.random.key(0), TOKENS)["params"]


def linen_scan_params(seed: int = 3):
  """The params of the real linen model (shapes from `LinenModel.init`)."""
  return _random_like(_linen_shapes(), seed)


class NnxGQA(nnx.Module):
  """Grouped-query attention: flax.nnx.MultiHeadAttention has no GQA, so
  key and value are `nnx.LinearGeneral`s with num_kv_heads heads."""

  def __init__(self, *, rngs):
    self.query = nnx.LinearGeneral(D, (N, H), rngs=rngs)
    self.key = nnx.LinearGeneral(D, (K, H), rngs=rngs)
    self.value = nnx.LinearGeneral(D, (K, H), rngs=rngs)
    self.out = nnx.LinearGeneral((N, H), D, axis=(-2, -1), rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    q = self.query(x).reshape(b, t, K, N // K, H)
    k, v = self.key(x), self.value(x)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(H)
    o = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(logits, -1), v)
    return self.out(o.reshape(b, t, N, H))


class NnxBlock(nnx.Module):
  def __init__(self, *, rngs):
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.attn = NnxGQA(rngs=rngs)
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm(x))
    return x + self.mlp(x)


class NnxModel(nnx.Module):
  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.layers = nnx.List([NnxBlock(rngs=rngs) for _ in range(LAYERS)])

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return x


@functools.lru_cache(maxsize=None)
def _nnx_abstract():
  return nnx.split(nnx.eval_shape(lambda: NnxModel(rngs=nnx.Rngs(0))))


def nnx_model(seed: int = 4):
  """The real nnx model (structure from `nnx.eval_shape`), random params."""
  graphdef, state = _nnx_abstract()
  state = jax.tree.map(lambda x: x, state)
  nnx.replace_by_pure_dict(state, _random_like(nnx.to_pure_dict(state), seed))
  return nnx.merge(graphdef, state)


def nnx_params(seed: int = 4):
  graphdef, state = _nnx_abstract()
  return _random_like(nnx.to_pure_dict(state), seed)


# --------------------------------------------------------------------------
# Families: (tree builder, frames= to train with, {path: FrameSpec} expected).


def _expect(paths, spec):
  return {p: spec for p in paths}


def _layers(fmt):
  return [fmt.format(i=i) for i in range(LAYERS)]


GEMMA_QK = sum(([f"layer_{i}/attn/kv_einsum/w", f"layer_{i}/attn/q_einsum/w"]
                for i in range(LAYERS)), [])
GEMMA_QKV = ["layer_0/attn/qkv_einsum/w"]          # one layer
MAXTEXT_QK = ["decoder/layers/self_attention/key/kernel",
              "decoder/layers/self_attention/query/kernel"]
NANOGPT_QK = _layers("transformer/h_{i}/attn/c_attn/kernel")
LINEN_QK = ["layers/attn/key/kernel", "layers/attn/query/kernel"]
NNX_QK = sum(([f"layers/{i}/attn/key/kernel", f"layers/{i}/attn/query/kernel"]
              for i in range(LAYERS)), [])

NANOGPT_FRAMES = {r"c_attn/kernel$": so.fused_qkv(N)}

FAMILIES = {
    "gemma_gqa": (lambda: gemma_params(K), "gemma", {
        **_expect(GEMMA_QK[1::2], so.families.GEMMA_Q),
        **_expect(GEMMA_QK[0::2], so.families.GEMMA_KV)}),
    # MQA and fused: one layer each (compilation is most of the run time).
    "gemma_mqa": (lambda: gemma_params(1, layers=1), "gemma", {
        GEMMA_QK[1]: so.families.GEMMA_Q, GEMMA_QK[0]: so.families.GEMMA_KV}),
    "gemma_fused": (lambda: gemma_params(N, layers=1), "gemma",
                    _expect(GEMMA_QKV, so.families.GEMMA_QKV)),
    "maxtext_scanned": (maxtext_params, "maxtext",
                        _expect(MAXTEXT_QK, so.families.MAXTEXT)),
    "nanogpt": (nanogpt_params, NANOGPT_FRAMES,
                _expect(NANOGPT_QK, so.fused_qkv(N))),
    "linen_scan": (linen_scan_params, "flax",
                   _expect(LINEN_QK, so.families.FLAX)),
    "nnx_gqa": (nnx_params, None, _expect(NNX_QK, so.families.FLAX)),
}
# Where the default (auto) must agree with the preset.
AUTO_AGREES = ("gemma_gqa", "gemma_mqa", "gemma_fused", "maxtext_scanned",
               "nnx_gqa")

# The frame view shapes (batch..., d, r) of one selected leaf per family.
FRAME_SHAPES = {
    "gemma_gqa": {"layer_0/attn/q_einsum/w": (N, D, H),
                  "layer_0/attn/kv_einsum/w": (1, 1, K, D, H)},
    "gemma_mqa": {"layer_0/attn/kv_einsum/w": (1, 1, 1, D, H)},
    "gemma_fused": {"layer_0/attn/qkv_einsum/w": (2, 1, N, D, H)},
    "maxtext_scanned": {MAXTEXT_QK[0]: (LAYERS, K, D, H),
                        MAXTEXT_QK[1]: (LAYERS, N, D, H)},
    "nanogpt": {NANOGPT_QK[0]: (2, N, D, D // N)},
    "linen_scan": {LINEN_QK[1]: (LAYERS, N, D, H)},
    "nnx_gqa": {NNX_QK[0]: (K, D, H), NNX_QK[1]: (N, D, H)},
}




def _plain_frames(family, tree):
  """The Q/K frames of a family's tree cut out by plain indexing, as the
  model uses them (independent of `FrameSpec` and the views): a spec on the
  wrong axes would still pass `max_isometry_error` under that spec."""
  a = lambda x: np.asarray(x, np.float64)
  out = []
  if family.startswith("gemma"):
    for name, layer in tree.items():
      if not name.startswith("layer_"):
        continue
      attn = layer["attn"]
      if "qkv_einsum" in attn:
        w = a(attn["qkv_einsum"]["w"])                 # (3, N, D, H)
        out += [w[c, n] for c in (0, 1) for n in range(w.shape[1])]
      else:
        q, kv = a(attn["q_einsum"]["w"]), a(attn["kv_einsum"]["w"])
        out += [q[n] for n in range(q.shape[0])]       # (N, D, H)
        out += [kv[0, k] for k in range(kv.shape[1])]  # (2, K, D, H)
  elif family == "maxtext_scanned":
    attn = tree["decoder"]["layers"]["self_attention"]
    for name in ("query", "key"):
      w = a(attn[name]["kernel"])                      # (D, L, heads, H)
      out += [w[:, l, n] for l in range(w.shape[1]) for n in range(w.shape[2])]
  elif family == "nanogpt":
    hd = D // N
    for i in range(LAYERS):
      w = a(tree["transformer"][f"h_{i}"]["attn"]["c_attn"]["kernel"])
      # q, k, v = split(c_attn(x), n_embd); each .view(B, T, n_head, hd)
      out += [w[:, t * D + h * hd: t * D + (h + 1) * hd]
              for t in (0, 1) for h in range(N)]
  elif family == "linen_scan":
    for name in ("query", "key"):
      w = a(tree["layers"]["attn"][name]["kernel"])    # (L, D, heads, H)
      out += [w[l, :, n] for l in range(w.shape[0]) for n in range(w.shape[2])]
  elif family == "nnx_gqa":
    for i in range(LAYERS):
      for name in ("query", "key"):
        w = a(tree["layers"][i]["attn"][name]["kernel"])   # (D, heads, H)
        out += [w[:, n] for n in range(w.shape[1])]
  return out


# Frames per family: N query heads and K key heads per layer.
NUM_FRAMES = {"gemma_gqa": LAYERS * (N + K), "gemma_mqa": N + 1,
              "gemma_fused": 2 * N, "maxtext_scanned": LAYERS * (N + K),
              "nanogpt": LAYERS * 2 * N, "linen_scan": LAYERS * 2 * N,
              "nnx_gqa": LAYERS * (N + K)}


# --------------------------------------------------------------------------
# Training against AdamW.


def _targets(params, seed=10):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(rng.uniform(0.5, 2.0, x.shape), x.dtype), params)


def _loss(params, targets):
  """Touches every entry of every leaf, with a gradient that varies."""
  return sum(jnp.sum(jnp.sin(x * t))
             for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets)))


def _euclidean_parts(params, frames):
  """{path: array} of everything AdamW trains: the leaves that are not frames
  and, of a fused leaf, the parts that are not frames."""
  out = {}
  for path, x, spec in so.frame_specs(params, frames):
    if spec is None:
      out[path] = x
    else:
      rest = views.split_frames(x, spec, path)[1]
      if rest is not None:
        out[path + " (rest)"] = rest
  return out


def _deviation(a, b):
  """{path: max |a - b| / max |b|}: AdamW's updates are elementwise, but XLA
  may round the sliced parts' arithmetic differently from the whole leaf's
  (1 ulp of an update of ~lr, seen in the fused Gemma and nanoGPT leaves),
  which is large relative to an entry near zero, not to the leaf."""
  return {p: jnp.max(jnp.abs(a[p] - b[p])) / jnp.maximum(
      jnp.max(jnp.abs(b[p])), jnp.finfo(b[p].dtype).tiny) for p in a}


def train_against_adamw(params, frames, steps=STEPS):
  """`steps` of stiefel_attention; beside it, optax.adamw (stiefel_attention's
  defaults) on a reference copy fed the same gradients, taken at the Stiefel
  run's params. Returns (final params, final reference, {path: largest
  deviation of its Euclidean part over the steps}) and asserts that
  deviation <= 1e-6 at every step."""
  tx = so.stiefel_attention(LR, frames=frames)
  ref_tx = optax.adamw(LR, **ADAMW)
  targets = _targets(params)

  @jit
  def step(p, s, r, rs):
    g = jax.grad(_loss)(p, targets)
    u, s = tx.update(g, s, p)
    ru, rs = ref_tx.update(g, rs, r)
    p, r = optax.apply_updates(p, u), optax.apply_updates(r, ru)
    return p, s, r, rs, _deviation(_euclidean_parts(p, frames),
                                   _euclidean_parts(r, frames))

  p, s, r, rs = params, tx.init(params), params, ref_tx.init(params)
  worst = {}
  for i in range(steps):
    p, s, r, rs, dev = step(p, s, r, rs)
    for path, d in dev.items():
      worst[path] = max(worst.get(path, 0.0), float(d))
      assert float(d) <= 1e-6, (i, path, float(d))
  return p, r, worst


@functools.lru_cache(maxsize=None)
def _trained(family):
  """A family's raw tree, orthonormalized tree, trained tree, AdamW
  reference, {path: deviation} and diagnostics, computed once per session
  (the tests only read them; jitted, since op by op the diagnostics cost
  more compilation than the training step)."""
  build, frames, _ = FAMILIES[family]
  raw = build()
  params = jit(lambda p: so.orthonormalize(p, frames))(raw)
  trained, ref, worst = train_against_adamw(params, frames)
  diagnostics = jit(lambda a, b: dict(
      start=so.max_isometry_error(a, frames),
      end=so.max_isometry_error(b, frames),
      moved=so.frame_movement(a, b, frames)))(params, trained)
  return raw, params, trained, ref, worst, diagnostics


def _copy(tree):
  """New containers, same arrays (tests that edit a cached tree)."""
  return jax.tree.map(lambda x: x, tree)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_selects_orthonormalizes_and_trains(family, certificate):
  build, frames, expected = FAMILIES[family]
  raw = build()
  assert so.selected_frames(raw, frames) == expected
  if family in AUTO_AGREES:
    assert so.selected_frames(raw) == expected
  shapes = so.map_frames(lambda w: w.shape, raw, frames, back=False)
  for path, shape in FRAME_SHAPES[family].items():
    assert shapes[path] == shape, path

  raw, params, trained, _, worst, diagnostics = _trained(family)
  # orthonormalize moves only the frames: every other leaf and every part
  # that is not a frame is bit-identical.
  before, after = (_euclidean_parts(raw, frames),
                   _euclidean_parts(params, frames))
  assert before.keys() == after.keys()
  for path in before:
    np.testing.assert_array_equal(before[path], after[path], err_msg=path)
  assert float(diagnostics["start"]) <= 1e-5
  assert len(_plain_frames(family, params)) == NUM_FRAMES[family]
  assert plain_isometry(_plain_frames(family, params)) <= 1e-5
  assert plain_isometry(_plain_frames(family, raw)) > 0.5

  iso = float(diagnostics["end"])
  certificate(f"real layouts: isometry after {STEPS} steps, {family}", iso)
  certificate(f"real layouts: deviation from adamw, {family}",
              max(worst.values()))
  assert iso <= 1e-5
  assert plain_isometry(_plain_frames(family, trained)) <= 1e-5
  moved = diagnostics["moved"]
  assert moved.keys() == expected.keys()
  for path, m in moved.items():
    assert float(jnp.min(m)) > 1e-2, (path, m)   # every frame moved


def test_gemma_trains_only_q_and_k_on_the_manifold():
  """frames="gemma": the value half of kv_einsum (and the v third of
  qkv_einsum) is neither orthonormalized nor constrained."""
  value = {r"kv_einsum/w$": so.FrameSpec(rows=-2, cols=-1, parts=2,
                                         take=(1,), part_axis=0)}
  raw, params, trained, ref, worst, _ = _trained("gemma_gqa")
  for i in range(LAYERS):
    kv_raw = raw[f"layer_{i}"]["attn"]["kv_einsum"]["w"]
    kv = params[f"layer_{i}"]["attn"]["kv_einsum"]["w"]
    np.testing.assert_array_equal(kv[1], kv_raw[1])         # value untouched
    assert not np.array_equal(kv[0], kv_raw[0])             # key projected
  assert float(so.max_isometry_error(params, value)) > 0.5  # V is no frame
  assert float(so.max_isometry_error(trained, value)) > 0.5
  assert float(so.max_isometry_error(trained, "gemma")) <= 1e-5
  for i in range(LAYERS):
    assert worst[f"layer_{i}/attn/kv_einsum/w (rest)"] <= 1e-6
    np.testing.assert_allclose(
        trained[f"layer_{i}"]["attn"]["kv_einsum"]["w"][1],
        ref[f"layer_{i}"]["attn"]["kv_einsum"]["w"][1], rtol=1e-6, atol=1e-6)
  # The selector names only Q and K: no value leaf or value part.
  assert set(so.selected_frames(raw, "gemma")) == set(GEMMA_QK)

  raw, fused, trained, _, _, _ = _trained("gemma_fused")
  v_third = {r"qkv_einsum/w$": so.FrameSpec(rows=-2, cols=-1, parts=3,
                                            take=(2,), part_axis=0)}
  np.testing.assert_array_equal(fused["layer_0"]["attn"]["qkv_einsum"]["w"][2],
                                raw["layer_0"]["attn"]["qkv_einsum"]["w"][2])
  assert float(so.max_isometry_error(fused, v_third)) > 0.5
  assert float(so.max_isometry_error(trained, v_third)) > 0.5


def test_nnx_module_runs_with_trained_params():
  """The nnx.State itself selects the same paths as its pure dict, and the
  trained params go back into the module, which still runs."""
  model = nnx_model()
  state = nnx.state(model, nnx.Param)
  assert so.selected_frames(state) == so.selected_frames(nnx.to_pure_dict(state))
  assert so.selected_frames(state) == FAMILIES["nnx_gqa"][2]
  trained = _trained("nnx_gqa")[2]
  nnx.replace_by_pure_dict(state, trained)
  nnx.update(model, state)
  assert float(so.max_isometry_error(nnx.state(model, nnx.Param))) <= 1e-5
  out = nnx.jit(lambda m, x: m(x))(model, TOKENS)
  assert out.shape == (1, 8, D) and bool(jnp.all(jnp.isfinite(out)))


def test_linen_scan_model_runs_with_trained_params():
  trained = _trained("linen_scan")[2]
  logits = jit(LinenModel().apply)({"params": trained}, TOKENS)
  assert logits.shape == (1, 8, VOCAB) and bool(jnp.all(jnp.isfinite(logits)))


# --------------------------------------------------------------------------
# Error cases: a ValueError naming the path and the shape.


def test_mapping_entry_matching_no_leaf_names_entry_and_nearby_paths():
  params = gemma_params(K)
  with pytest.raises(ValueError, match=r"'kv_einsum/w/0\$' matches no"
                     r" parameter path; nearby paths:.*kv_einsum/w"):
    so.stiefel_attention(LR, frames={r"kv_einsum/w/0$": so.FrameSpec()}
                         ).init(params)
  # Also when another entry does match (the silent drop of issue 10).
  with pytest.raises(ValueError, match=r"'kv_einsum/w/0\$'.*nearby paths"):
    so.selected_frames(params, {r"q_einsum/w$": so.families.GEMMA_Q,
                         r"kv_einsum/w/0$": so.FrameSpec()})


def test_auto_refuses_a_stacked_kernel_without_self_attention():
  params = linen_scan_params()
  with pytest.raises(ValueError, match=(
      r"layers/attn/(query|key)/kernel: shape \(2, 32, 4, 8\).*"
      r"frames='flax'.*frames='maxtext'")):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"frames='flax'.*frames='maxtext'"):
    so.selected_frames(params)


def test_auto_refuses_a_fused_c_attn():
  params = nanogpt_params()
  with pytest.raises(ValueError, match=(
      r"transformer/h_0/attn/c_attn/kernel: shape \(32, 96\).*fused_qkv")):
    so.selected_frames(params)
  with pytest.raises(ValueError, match=r"c_attn/kernel: shape \(32, 96\)"):
    so.stiefel_attention(LR).init(params)


def test_spec_that_does_not_fit_names_path_shape_and_spec():
  params = gemma_params(K)
  bad = {r"q_einsum/w$": so.FrameSpec(rows=0, cols=2)}  # (N, D, H): d=4, r=8
  with pytest.raises(ValueError, match=(
      r"layer_0/attn/q_einsum/w: shape \(4, 32, 8\) gives frames of \(d, r\)"
      r" = \(4, 8\) under FrameSpec\(rows=0, cols=2\): r > d.*"
      r"FrameSpec\(rows=1, cols=2\) fits")):
    so.stiefel_attention(LR, frames=bad).init(params)
  # Heads that do not divide the columns are named with the shape.
  with pytest.raises(ValueError, match=(
      r"c_attn/kernel: shape \(32, 96\) has 32 columns.*heads = 5")):
    so.selected_frames(nanogpt_params(), {r"c_attn/kernel$": so.fused_qkv(5)})


def test_callable_returning_a_non_spec_names_the_path():
  params = gemma_params(K)
  pick = lambda path, leaf: "gemma" if path.endswith("q_einsum/w") else None
  with pytest.raises(ValueError, match=(
      r"layer_0/attn/q_einsum/w: the frame selector returned 'gemma'")):
    so.stiefel_attention(LR, frames=pick).init(params)


def test_non_orthonormal_start_names_path_and_orthonormalize():
  with pytest.raises(ValueError, match=(
      r"layer_0/attn/(kv|q)_einsum/w: shape \((2, 2|4), 32, 8\).*not"
      r" orthonormal.*orthonormalize")):
    so.stiefel_attention(LR, frames="gemma").init(gemma_params(K))
  with pytest.raises(ValueError, match=r"c_attn/kernel: shape \(32, 96\).*"
                     r"not orthonormal.*orthonormalize"):
    so.stiefel_attention(LR, frames=NANOGPT_FRAMES).init(nanogpt_params())


def test_project_start_trains_onto_the_manifold():
  """orthonormal_start='project' from raw (not orthonormalized) one-layer
  Gemma trees whose frames' singular values are far below 1 (std 0.02) and
  far above (std 1, i.e. sqrt(D) +- sqrt(H)): the first retraction must be
  right for any full-rank W + xi (the safety rule: any input is safe); after 8
  steps the Q/K frames are on the manifold and everything is finite."""
  tx = so.stiefel_attention(LR, frames="gemma", orthonormal_start="project")
  base = gemma_params(K, seed=5, layers=1)
  targets = _targets(base)

  @jit
  def step(p, s):
    u, s = tx.update(jax.grad(_loss)(p, targets), s, p)
    return optax.apply_updates(p, u), s

  for std in (0.02, 1.0):
    params = jax.tree.map(lambda x: x * (std / 0.2), base)
    assert float(so.max_isometry_error(params, "gemma")) > 1.0
    state = tx.init(params)
    for _ in range(8):
      params, state = step(params, state)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    assert float(so.max_isometry_error(params, "gemma")) <= 1e-5, std


def test_zero_head_raises_even_with_project():
  params = _copy(_trained("gemma_gqa")[1])
  w = params["layer_1"]["attn"]["q_einsum"]["w"]
  params["layer_1"]["attn"]["q_einsum"]["w"] = w.at[2].set(0.0)
  for start in ("check", "project"):
    with pytest.raises(ValueError, match=(
        r"layer_1/attn/q_einsum/w: shape \(4, 32, 8\).*frame \(2,\) is"
        r" rank-deficient")):
      so.stiefel_attention(LR, frames="gemma",
                           orthonormal_start=start).init(params)
  # A zero key head in kv_einsum too; a zero value head is no frame: fine.
  params["layer_1"]["attn"]["q_einsum"]["w"] = w
  kv = params["layer_0"]["attn"]["kv_einsum"]["w"]
  params["layer_0"]["attn"]["kv_einsum"]["w"] = kv.at[0, 1].set(0.0)
  with pytest.raises(ValueError, match=(
      r"layer_0/attn/kv_einsum/w: shape \(2, 2, 32, 8\).*rank-deficient")):
    so.stiefel_attention(LR, frames="gemma",
                         orthonormal_start="project").init(params)
  params["layer_0"]["attn"]["kv_einsum"]["w"] = kv.at[1, 1].set(0.0)
  so.stiefel_attention(LR, frames="gemma").init(params)


def test_inject_hyperparams_with_preset_mapping_and_callable():
  """A preset name or mapping needs no static_args; a callable selector
  does. All three give the same step (one jitted program, so that the
  identical updates compile once)."""
  params = _trained("gemma_mqa")[1]
  grads = _random_like(params, seed=11)
  mapping = {r"q_einsum/w$": so.families.GEMMA_Q,
             r"kv_einsum/w$": so.families.GEMMA_KV}

  def select(path, leaf):          # the mapping as a callable selector
    del leaf
    return (so.families.GEMMA_Q if path.endswith("/q_einsum/w") else
            so.families.GEMMA_KV if path.endswith("/kv_einsum/w") else None)

  assert "gemma" in so.FRAME_PRESETS
  inject = optax.inject_hyperparams(so.stiefel_attention)
  inject_static = optax.inject_hyperparams(so.stiefel_attention,
                                           static_args=("frames",))
  txs = [inject(learning_rate=1e-3, frames="gemma"),
         inject(learning_rate=1e-3, frames=mapping),
         inject_static(learning_rate=1e-3, frames=select)]
  states = [tx.init(params) for tx in txs]
  for state in states:
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
    assert "frames" not in state.hyperparams

  @jit
  def steps(states):
    return [optax.apply_updates(params, tx.update(grads, s, params)[0])
            for tx, s in zip(txs, states)]

  results = steps(states)
  for new in results:
    assert float(so.max_isometry_error(new, "gemma")) <= 1e-5
  for leaves in zip(*(jax.tree.leaves(r) for r in results)):
    for other in leaves[1:]:
      np.testing.assert_array_equal(leaves[0], other)
