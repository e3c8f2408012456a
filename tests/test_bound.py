"""The closed logit bound (`stiefel_optax.bound`): the gain projection, its
presets and its one-line switch in `stiefel_attention`, and the certified
bound `attention_logit_bound`, checked in float64 against adversarial and
random inputs, with a control that fails without the constraint.

The certificate. For a pre-attention norm x = g n + b (LayerNorm or RMSNorm,
||n||^2 = d v / (v + eps) <= d) and per-head q = W_Q^T x + b_q, k = W_K^T x +
b_k, |q . k| / sqrt(r) <= (s X + ||b||)^2 / sqrt(r) with X = ||g||_inf
sqrt(d) + ||b_norm|| and s the frames' largest singular value. The test
measures max |logit| / bound over every head and token pair of inputs built
to reach it (tokens along the largest gain's coordinate, tokens whose gained
normalisation lies along a frame's top singular vector, huge and tiny
tokens) and random ones; it must be <= 1 + TOL. Tolerance: both sides are
computed in float64 from the same values; each is a few inner products of
length <= 3 d and one SVD (backward stable), so each carries relative error
below c d u with u = 2^-53 and c < 100 at these sizes (Higham, Accuracy and
Stability, Thm 3.5 and 3.7 for the products): 100 * 96 * 1.1e-16 ~ 1e-12 =
TOL. The control: the same measurement against the bound at unit gains
(d / sqrt(r), what orthonormal frames would promise if the gains stayed at
their start) exceeds 1 once the gains grow, and holds again once
`project_gains("box", g_max=1)` has projected them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import stiefel_optax as so

TOL = 1e-12
# One float32 rounding of apply_updates' addition p + (target - p), and one
# of the subtraction: at most 2 u max(|p|, |target|), u = 2^-24.
F32 = 2.0 ** -24


# --------------------------------------------------------------------------
# A pre-LN attention block in float64 numpy: nanoGPT's fused c_attn.


def _block(rng, d, heads, *, orthonormal, layer_bias, qk_bias, gain_scale):
  r = d // heads
  w = rng.standard_normal((d, 3 * d))
  if orthonormal:
    for col in range(2 * heads):             # q and k frames, per head
      q, _ = np.linalg.qr(w[:, col * r:(col + 1) * r])
      w[:, col * r:(col + 1) * r] = q
  ln = {"scale": gain_scale * rng.standard_normal(d)}
  if layer_bias:
    ln["bias"] = rng.standard_normal(d)
  attn = {"kernel": w}
  if qk_bias:
    attn["bias"] = rng.standard_normal(3 * d)
  return {"h_0": {"ln_1": ln, "attn": {"c_attn": attn}}}


FRAMES = lambda heads: {r"c_attn/kernel$": so.fused_qkv(heads)}


def _normalize(y, eps, rms):
  mu = 0.0 if rms else y.mean(-1, keepdims=True)
  v = ((y - mu) ** 2).mean(-1, keepdims=True)
  return (y - mu) / np.sqrt(v + eps)


def _max_logit(params, y, heads, eps, rms, gains_offset=0.0):
  """max |q_i . k_j| / sqrt(r) over all pairs of tokens y (T, d), all heads."""
  p = params["h_0"]
  d = y.shape[-1]
  r = d // heads
  x = (gains_offset + p["ln_1"]["scale"]) * _normalize(y, eps, rms)
  x = x + p["ln_1"].get("bias", 0.0)
  qkv = x @ p["attn"]["c_attn"]["kernel"] + p["attn"]["c_attn"].get("bias", 0.0)
  q = qkv[:, :d].reshape(-1, heads, r)
  k = qkv[:, d:2 * d].reshape(-1, heads, r)
  return float(np.abs(np.einsum("ihr,jhr->hij", q, k)).max() / math.sqrt(r))


def _adversarial(rng, params, heads, n=24):
  """Tokens built to reach the bound, and random ones, (T, d)."""
  p = params["h_0"]
  g = p["ln_1"]["scale"]
  d = g.size
  r = d // heads
  w = p["attn"]["c_attn"]["kernel"]
  toks = []
  k = int(np.argmax(np.abs(g)))
  for t in (1e-3, 1.0, 1e6):
    toks += [t * np.eye(d)[k], -t * np.eye(d)[k]]
  for col in range(2 * heads):                 # top singular vectors
    u = np.linalg.svd(w[:, col * r:(col + 1) * r])[0][:, 0]
    safe = np.where(np.abs(g) > 1e-9, g, 1e-9)
    toks += [1e6 * u / safe, 1e6 * u, -1e6 * u / safe]
  toks += list(rng.standard_normal((n, d)) * rng.choice([1e-2, 1.0, 1e3], n)[:, None])
  return np.stack(toks)


CASES = st.tuples(
    st.integers(0, 2 ** 31 - 1), st.sampled_from([(4, 1), (8, 2), (16, 4)]),
    st.booleans(), st.booleans(), st.booleans(), st.booleans(),
    st.sampled_from([0.0, 1e-6, 1e-2]), st.sampled_from([0.3, 1.0, 5.0]))


@settings(max_examples=15, deadline=None, print_blob=True)
@given(CASES)
def test_no_input_exceeds_the_certified_bound(case):
  """max |logit| / attention_logit_bound <= 1 + TOL over adversarial and
  random tokens, LayerNorm or RMSNorm, any epsilon, orthonormal or Gaussian
  frames (the spectral norm then enters), with and without norm and q/k
  biases."""
  seed, (d, heads), ortho, layer_bias, qk_bias, rms, eps, scale = case
  rng = np.random.default_rng(seed)
  params = _block(rng, d, heads, orthonormal=ortho, layer_bias=layer_bias,
                  qk_bias=qk_bias, gain_scale=scale)
  with jax.enable_x64(True):
    bound = so.attention_logit_bound(params, gains="nanogpt",
                                     frames=FRAMES(heads), epsilon=eps)
  assert list(bound) == ["h_0"]
  y = _adversarial(rng, params, heads)
  ratio = _max_logit(params, y, heads, eps, rms) / bound["h_0"]
  assert ratio <= 1 + TOL, (case, ratio)


def test_the_bound_is_reached():
  """RMSNorm, orthonormal frames sharing the largest gain's coordinate, no
  biases: the token t e_k reaches the bound as t grows (ratio -> 1), so the
  certificate is tight and the measurement above can come close to it."""
  d, heads = 8, 2
  rng = np.random.default_rng(0)
  params = _block(rng, d, heads, orthonormal=True, layer_bias=False,
                  qk_bias=False, gain_scale=1.0)
  g = params["h_0"]["ln_1"]["scale"]
  k = int(np.argmax(np.abs(g)))
  w = params["h_0"]["attn"]["c_attn"]["kernel"]
  r = d // heads
  for col in (0, heads):                     # head 0's q and k frames
    frame = np.concatenate([np.eye(d)[:, [k]], rng.standard_normal((d, r - 1))],
                           axis=1)
    w[:, col * r:(col + 1) * r] = np.linalg.qr(frame)[0]
  with jax.enable_x64(True):
    bound = so.attention_logit_bound(params, gains="nanogpt",
                                     frames=FRAMES(heads), epsilon=1e-6)["h_0"]
  ratio = _max_logit(params, 1e6 * np.eye(d)[[k]], heads, 1e-6, True) / bound
  # (1 + d eps / t^2)^-1 = 1 - 8e-18: equal to 1 up to TOL.
  assert abs(ratio - 1) <= TOL, ratio


def test_max_input_norm_uses_epsilon():
  """With ||y|| <= R the bound shrinks by sqrt(R^2 / (R^2 + d eps)) per
  token, and tokens of norm R still stay within it."""
  d, heads, eps, big_r = 8, 2, 0.5, 1.0
  rng = np.random.default_rng(1)
  params = _block(rng, d, heads, orthonormal=True, layer_bias=False,
                  qk_bias=False, gain_scale=1.0)
  with jax.enable_x64(True):
    free = so.attention_logit_bound(params, gains="nanogpt",
                                    frames=FRAMES(heads), epsilon=eps)["h_0"]
    tight = so.attention_logit_bound(params, gains="nanogpt",
                                     frames=FRAMES(heads), epsilon=eps,
                                     max_input_norm=big_r)["h_0"]
  np.testing.assert_allclose(tight / free, big_r ** 2 / (big_r ** 2 + d * eps),
                             rtol=TOL)
  y = _adversarial(rng, params, heads)
  y = y / np.linalg.norm(y, axis=-1, keepdims=True) * big_r
  assert _max_logit(params, y, heads, eps, rms=True) <= tight * (1 + TOL)


def test_control_unit_gain_bound_fails_until_the_box_closes_it():
  """Control: with gains grown to 3, the bound at unit gains (d / sqrt(r) for
  orthonormal frames, what the frames alone promise) is exceeded; after
  project_gains("box", g_max=1) the same tokens stay within it."""
  d, heads = 16, 4
  rng = np.random.default_rng(2)
  params = _block(rng, d, heads, orthonormal=True, layer_bias=False,
                  qk_bias=False, gain_scale=1.0)
  params["h_0"]["ln_1"]["scale"] = 3.0 * np.sign(params["h_0"]["ln_1"]["scale"])
  unit = d / math.sqrt(d // heads)
  y = _adversarial(rng, params, heads)
  assert _max_logit(params, y, heads, 1e-5, rms=False) > 1.5 * unit
  with jax.enable_x64(True):
    tx = so.project_gains("box", gains="nanogpt", g_max=1.0)
    zero = jax.tree.map(np.zeros_like, params)
    u, _ = tx.update(zero, tx.init(params), params)
    boxed = jax.tree.map(np.asarray, optax.apply_updates(params, u))
    bound = so.attention_logit_bound(boxed, gains="nanogpt",
                                     frames=FRAMES(heads))["h_0"]
  np.testing.assert_allclose(bound, unit, rtol=TOL)
  assert _max_logit(boxed, y, heads, 1e-5, rms=False) <= unit * (1 + TOL)


# --------------------------------------------------------------------------
# The projection.


def _tree():
  return {"h_0": {"ln_1": {"scale": jnp.array([0.5, -2.0, 3.0, 0.0]),
                           "bias": jnp.array([0.1, -4.0, 2.0, 0.0])},
                  "ln_2": {"scale": jnp.array([5.0, 5.0, 5.0, 5.0])},
                  "attn": {"c_attn": {"kernel": jnp.ones((4, 12))}}}}


@pytest.mark.parametrize("constraint", so.GAIN_CONSTRAINTS)
def test_projection_lands_on_the_set(constraint):
  params = _tree()
  step = jax.tree.map(lambda x: 0.75 * jnp.ones_like(x), params)
  tx = so.project_gains(constraint, gains="nanogpt", g_max=2.0, bias_max=1.0)
  u, state = jax.jit(tx.update)(step, tx.init(params), params)
  assert state == optax.EmptyState()
  new = optax.apply_updates(params, u)
  g, b = new["h_0"]["ln_1"]["scale"], new["h_0"]["ln_1"]["bias"]
  g0, b0 = params["h_0"]["ln_1"]["scale"], params["h_0"]["ln_1"]["bias"]
  tol = lambda *xs: 2 * F32 * max(float(jnp.abs(x).max()) for x in xs)
  if constraint == "box":
    np.testing.assert_allclose(g, jnp.clip(g0 + 0.75, -2, 2), atol=tol(g0, 2))
    np.testing.assert_allclose(b, jnp.clip(b0 + 0.75, -1, 1), atol=tol(b0, 1))
  elif constraint == "sphere":
    np.testing.assert_allclose(jnp.linalg.norm(g), 2.0, atol=4 * tol(g0, g))
    want = (g0 + 0.75) / jnp.linalg.norm(g0 + 0.75) * 2.0
    np.testing.assert_allclose(g, want, atol=4 * tol(g0, g))
  else:
    np.testing.assert_array_equal(u["h_0"]["ln_1"]["scale"], 0.0)
    np.testing.assert_array_equal(u["h_0"]["ln_1"]["bias"], 0.0)
  # Every leaf that is not ln_1's passes unchanged (ln_2 follows attention).
  for path in (("ln_2", "scale"), ("attn", "c_attn", "kernel")):
    a, b_ = u["h_0"], step["h_0"]
    for key in path:
      a, b_ = a[key], b_[key]
    np.testing.assert_array_equal(a, b_)


def test_gemma_constrains_one_plus_scale():
  """Gemma's RMSNorm scales by 1 + scale: the box holds |1 + scale| <= g_max
  and the sphere ||1 + scale|| = sqrt(d)."""
  params = {"layer_0": {"pre_attention_norm": {"scale": jnp.array(
      [-3.0, 0.5, 2.0, 0.0])}, "attn": {"q_einsum": {"w": jnp.ones((2, 4, 2))}}}}
  zero = jax.tree.map(jnp.zeros_like, params)
  for gains in ("gemma", "auto"):
    box = so.project_gains("box", gains=gains, g_max=1.0)
    new = optax.apply_updates(params, box.update(zero, box.init(params),
                                                 params)[0])
    np.testing.assert_allclose(new["layer_0"]["pre_attention_norm"]["scale"],
                               [-2.0, 0.0, 0.0, 0.0], atol=8 * F32)
  sphere = so.project_gains("sphere", gains="gemma")
  new = optax.apply_updates(params, sphere.update(zero, sphere.init(params),
                                                  params)[0])
  eff = 1.0 + new["layer_0"]["pre_attention_norm"]["scale"]
  np.testing.assert_allclose(jnp.linalg.norm(eff), 2.0, rtol=8 * F32)


def test_maxtext_scanned_sphere_is_per_layer():
  """MaxText's scanned scale is (embed, layers): the sphere holds each
  layer's column at norm sqrt(embed); a zero gain goes to all ones."""
  scale = jnp.stack([jnp.arange(1.0, 9.0), jnp.zeros(8)], axis=1)   # (8, 2)
  params = {"decoder": {"layers": {
      "pre_self_attention_layer_norm": {"scale": scale},
      "self_attention": {"query": {"kernel": jnp.ones((8, 2, 2, 4))}}}}}
  tx = so.project_gains("sphere", gains="maxtext")
  u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                   params)
  new = optax.apply_updates(params, u)["decoder"]["layers"][
      "pre_self_attention_layer_norm"]["scale"]
  np.testing.assert_allclose(jnp.linalg.norm(new, axis=0), [math.sqrt(8)] * 2,
                             rtol=8 * F32)
  np.testing.assert_allclose(new[:, 1], 1.0, rtol=8 * F32)


def test_presets_select_the_pre_attention_norm():
  """The presets' names, on hand-made trees of each layout."""
  one = jnp.ones(4)
  cases = {
      "flax": ({"block_0": {"ln_attn": {"scale": one, "bias": one},
                            "ln_mlp": {"scale": one}}},
               ["block_0/ln_attn/scale", "block_0/ln_attn/bias"]),
      "haiku": ({"tf/~/ln_1": {"scale": one, "offset": one},
                 "tf/~/ln_2": {"scale": one}},
                ["tf/~/ln_1/offset", "tf/~/ln_1/scale"]),
      "equinox": ({"blocks": [{"input_layernorm": {"weight": one},
                               "post_attention_layernorm": {"weight": one}}]},
                  ["blocks/0/input_layernorm/weight"]),
      "nanogpt": ({"h_0": {"ln_1": {"weight": one, "bias": one},
                           "ln_2": {"weight": one}}},
                  ["h_0/ln_1/bias", "h_0/ln_1/weight"]),
  }
  for preset, (tree, want) in cases.items():
    got = [p for p, _, g in so.gain_specs(tree, preset) if g is not None]
    assert sorted(got) == sorted(want), preset
    auto = [p for p, _, g in so.gain_specs(tree) if g is not None]
    assert sorted(auto) == sorted(want), preset


def test_errors_name_the_leaves_and_the_fix():
  tree = {"block_0": {"LayerNorm_0": {"scale": jnp.ones(4)},
                      "attn": {"query": {"kernel": jnp.ones((4, 1, 4))}}}}
  with pytest.raises(ValueError, match=r"LayerNorm_0/scale \(4,\).*GainSpec"):
    so.project_gains("box").init(tree)
  with pytest.raises(ValueError, match="not one of|constraint"):
    so.project_gains("ball")
  with pytest.raises(ValueError, match="g_max=0"):
    so.project_gains("box", g_max=0)
  with pytest.raises(ValueError, match="matches no parameter path"):
    so.gain_specs(tree, {r"nope/scale$": so.GainSpec()})
  with pytest.raises(ValueError, match=r"h_0/ln_1/bias.*no selected gain"):
    so.gain_specs({"h_0": {"ln_1": {"bias": jnp.ones(4)}, "ln_2": {
        "scale": jnp.ones(4)}}}, {r"ln_1/bias$": so.GainSpec(bias=True),
                                   r"ln_2/scale$": so.GainSpec()})
  with pytest.raises(ValueError, match="lies under no selected"):
    so.attention_logit_bound(
        {"a": {"ln_1": {"scale": jnp.ones(4)}},
         "b": {"query": {"kernel": jnp.eye(4).reshape(4, 1, 4)}}})
  with pytest.raises(ValueError, match="gain_constraint='ball'"):
    so.stiefel_attention(1e-3, gain_constraint="ball")


# --------------------------------------------------------------------------
# The one-line switch.


@functools.lru_cache(maxsize=None)
def _model():
  """A linen pre-LN attention block's parameters (nn.LayerNorm "ln_1",
  nn.MultiHeadDotProductAttention "attn": d 8, 2 heads of 4), orthonormal
  query/key heads, and one fixed gradient (the steps below reuse it: the
  optimizer does not care where it comes from, and each optimizer compiles
  only its update)."""
  rng = np.random.default_rng(0)
  frames = lambda: np.stack([np.linalg.qr(rng.standard_normal((8, 4)))[0]
                             for _ in range(2)], axis=1)       # (8, 2, 4)
  params = {"ln_1": {"scale": np.ones(8), "bias": np.zeros(8)},
            "attn": {"query": {"kernel": frames(), "bias": np.zeros((2, 4))},
                     "key": {"kernel": frames(), "bias": np.zeros((2, 4))},
                     "value": {"kernel": frames(), "bias": np.zeros((2, 4))},
                     "out": {"kernel": rng.standard_normal((2, 4, 8)),
                             "bias": np.zeros(8)}}}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape),
                                             jnp.float32), params)
  return params, grads


@functools.lru_cache(maxsize=None)
def _train(tx, steps):
  params, grads = _model()
  update, state = jax.jit(tx.update), tx.init(params)
  for _ in range(steps):
    u, state = update(grads, state, params)
    params = optax.apply_updates(params, u)
  return params, state


LR = 0.5
OFF = so.stiefel_attention(LR)
BOX = so.stiefel_attention(LR, gain_constraint="box")


def test_switch_off_is_bit_identical():
  """gain_constraint=None is the optimizer as it was: the same parameters
  and state, bit for bit, over two steps."""
  a = _train(OFF, 2)
  b = _train(so.stiefel_attention(LR, gain_constraint=None), 2)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_switch_on_projects_only_the_gains():
  """gain_constraint="box" at a rate that drives the gains out of the box:
  they end inside it, every other leaf is what the unconstrained optimizer
  gives, bit for bit, and the certified bound is the box's."""
  off, _ = _train(OFF, 2)
  on, _ = _train(BOX, 2)
  assert float(jnp.abs(off["ln_1"]["scale"]).max()) > 1.2
  assert float(jnp.abs(on["ln_1"]["scale"]).max()) <= 1 + 2 * F32 * 2
  assert float(jnp.abs(on["ln_1"]["bias"]).max()) <= 1 + 2 * F32 * 2
  for x, y in zip(jax.tree.leaves(off["attn"]), jax.tree.leaves(on["attn"])):
    np.testing.assert_array_equal(x, y)
  bound = so.attention_logit_bound(on, epsilon=1e-6)[""]
  d, r = 8, 4
  # box g_max = 1, bias_max = 1: ||x|| <= 2 sqrt(d); the frames orthonormal
  # (to float32 rounding, sigma <= 1 + 1e-5); the q/k biases as trained.
  beta = max(float(jnp.linalg.norm(on["attn"][n]["bias"], axis=-1).max())
             for n in ("query", "key"))
  assert bound <= ((2 * math.sqrt(d)) * (1 + 1e-5) + beta) ** 2 / math.sqrt(r)
