"""Reduced precision (issue 55, part 3): the rules users expect from optax.

* An update has its parameter's dtype, computed in at least float32: bf16
  gradients of float32 frames give float32 updates, so the retraction's
  result is not rounded to bf16.
* Diagnostics compute in at least float32; `check_frames` uses the start
  check's dtype-aware tolerance (`checks.start_tolerance`), so the frames
  `orthonormalize` returns pass in every dtype, and its advice works.
* Frames stored below float32 keep a float32 master copy in the
  retraction's state (`master_frames=True`): they move as float32 frames
  do instead of stalling (steps of norm lr spread over d x r entries fall
  below bf16's spacing). Without it a warning says so.
* float16 params never give a silent NaN: `stiefel_attention`'s AdamW runs
  in float32 on float16 leaves (`aliases.upcast_float16`).

Tolerances: eps is the dtype's machine epsilon; a frame rounded once to its
dtype has ||W^T W - I||_F <= sqrt(r) eps (`checks.start_tolerance`, which
takes 4 times that), and a float32 retraction certifies 8 sqrt(r) eps_f32
(`newton_schulz_accept_tol`).
"""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stiefel_optax as so
from stiefel_optax import aliases, checks, retraction

D, HEADS, HEAD_DIM = 16, 2, 8
LOW = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def eps(dtype) -> float:
  return float(jnp.finfo(dtype).eps)


def rounding_bound(dtype, r: int) -> float:
  """||W^T W - I||_F of an orthonormal frame rounded once to `dtype`, at
  worst: sqrt(r) eps (`checks.start_tolerance` derives it)."""
  return np.sqrt(r) * eps(dtype)


@functools.lru_cache(maxsize=None)
def linen_params(dtype):
  """Orthonormalized params of a Flax linen attention layer stored in
  `dtype` (biases included: the key bias's gradient is exactly 0, which
  AdamW divides as 0 / (0 + eps))."""
  model = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D,
                                          param_dtype=dtype)
  x = jnp.ones((1, 4, D))
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  return model, so.orthonormalize(params)


def nnx_model(dtype):
  model = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D,
                                 decode=False, param_dtype=dtype,
                                 rngs=nnx.Rngs(0))
  nnx.update(model, so.orthonormalize(nnx.state(model, nnx.Param)))
  return model


def qk(tree):
  """The query/key kernels of a linen params dict."""
  return {k: tree[k]["kernel"] for k in ("query", "key")}


# --------------------------------------------------------------------------
# Updates in the params' dtype.


TRANSFORMS = {
    "project_to_tangent": lambda: so.project_to_tangent(),
    "scale_by_frame_adam": lambda: so.scale_by_frame_adam(),
    "clip_frame_norm": lambda: so.clip_frame_norm(0.1),
    "retract_polar": lambda: so.retract_polar(),
    "stiefel_adam": lambda: so.stiefel_adam(0.1),
    "riemannian_sgd": lambda: so.riemannian_sgd(0.1),
    "stiefel_muon": lambda: so.stiefel_muon(0.1),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_bf16_gradients_give_updates_in_the_params_dtype(name):
  """float32 frames, bf16 gradients: a float32 update (it was bf16)."""
  w = so.random_frames(jax.random.key(1), (2, 8, 4))
  g = (0.1 * jax.random.normal(jax.random.key(2), w.shape)).astype(
      jnp.bfloat16)
  tx = TRANSFORMS[name]()
  u, _ = tx.update(g, tx.init(w), w)
  assert u.dtype == jnp.float32, name


def test_bf16_gradients_keep_float32_frames_on_the_manifold():
  """One step of norm 0.1 from bf16 gradients (a loop that casts them for
  an all-reduce) on a Flax-layout tree: every update is float32 and the
  new frames are orthonormal to float32's certificate, 8 sqrt(r) eps_f32,
  not to bf16's rounding (2e-4 before)."""
  k = jax.random.split(jax.random.key(3), 4)
  params = {name: {"kernel": so.random_frames(
      k[i], (HEADS, D, HEAD_DIM)).transpose(1, 0, 2)}
            for i, name in enumerate(("query", "key"))}
  params["value"] = {"kernel": jax.random.normal(k[2], (D, HEADS, HEAD_DIM))}
  grads = jax.tree.map(
      lambda x: jax.random.normal(k[3], x.shape, jnp.bfloat16), params)
  tx = so.stiefel_attention(0.1)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert {u.dtype for u in jax.tree.leaves(updates)} == {
      jnp.dtype(jnp.float32)}
  new = optax.apply_updates(params, updates)
  moved = so.frame_movement(params, new)
  assert all(float(jnp.min(m)) > 0.05 for m in moved.values())  # a real step
  tol = so.newton_schulz.newton_schulz_accept_tol(jnp.float32, HEAD_DIM)
  assert float(so.max_isometry_error(new)) <= tol


# --------------------------------------------------------------------------
# Diagnostics and check_frames.


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_diagnostics_compute_in_float32(dtype):
  """max_isometry_error, frame_isometry_errors and frame_movement of bf16 /
  f16 frames equal their float32 values on the upcast frames, bit for bit
  (in bf16 the Gram matrix's rounding read about 10 % low)."""
  _, params = linen_params(LOW[dtype])
  up = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  errs, ref = so.frame_isometry_errors(params), so.frame_isometry_errors(up)
  for path in ref:
    assert errs[path].dtype == jnp.float32
    np.testing.assert_array_equal(errs[path], ref[path])
  assert float(so.max_isometry_error(params)) == float(
      so.max_isometry_error(up))
  # A rounded frame is off by its rounding, at most sqrt(r) eps.
  assert 0 < float(so.max_isometry_error(params)) <= rounding_bound(
      LOW[dtype], HEAD_DIM)
  moved = jax.tree.map(lambda x: (-x).astype(x.dtype), params)
  for path, m in so.frame_movement(params, moved).items():
    np.testing.assert_array_equal(
        m, so.frame_movement(up, jax.tree.map(lambda x: -x, up))[path])


@pytest.mark.parametrize("dtype", list(LOW))
def test_check_frames_accepts_what_init_accepts(dtype):
  """Frames fresh from `orthonormalize` in bf16 / f16 pass `check_frames`
  (it raised at atol 1e-5 and advised orthonormalize, circularly); frames
  really off the manifold raise, and the advice (orthonormalize) fixes
  them; an explicit atol below the dtype's rounding is named as such."""
  low = LOW[dtype]
  params = linen_params(low)[1]
  so.check_frames(params)
  so.stiefel_attention(1e-3).init(params)             # the same tolerance
  r = HEAD_DIM
  assert checks.start_tolerance(low, r) == 4 * rounding_bound(low, r)
  bad = jax.tree.map(lambda x: (1.2 * x).astype(x.dtype), params)
  with pytest.raises(ValueError) as info:
    so.check_frames(bad)
  msg = str(info.value)
  assert "key/kernel" in msg and f"({D}, {HEADS}, {HEAD_DIM})" in msg
  assert dtype in msg and "orthonormalize" in msg
  so.check_frames(so.orthonormalize(bad))             # the advice works
  with pytest.raises(ValueError, match="drop atol"):
    so.check_frames(params, atol=1e-5)


# --------------------------------------------------------------------------
# Low-precision params train: linen and nnx, bf16 and f16.


@pytest.mark.parametrize("dtype", list(LOW))
def test_linen_low_precision_params_train(dtype):
  """Two jitted steps of `stiefel_attention` on a linen layer stored in
  bf16 / f16: updates in the params' dtype, all finite (f16: optax.adamw's
  key-bias update was 0 / 0 = NaN at the first step), frames moved and
  still orthonormal to their dtype (`check_frames`)."""
  low = LOW[dtype]
  model, params = linen_params(low)
  x = jax.random.normal(jax.random.key(4), (2, 4, D))
  tx = so.stiefel_attention(1e-3)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: jnp.mean(
        model.apply({"params": p}, x).astype(jnp.float32) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  start = params
  for _ in range(2):
    params, state, updates = step(params, state)
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
    assert u.dtype == low and p.dtype == low
    assert bool(jnp.isfinite(u).all()) and bool(jnp.isfinite(p).all())
  moved = so.frame_movement(start, params)
  assert all(float(jnp.min(m)) > 1e-3 for m in moved.values())
  so.check_frames(params)


@pytest.mark.parametrize("dtype", list(LOW))
def test_nnx_low_precision_params_train(dtype):
  """The same through `nnx.Optimizer` and `nnx.jit` on an nnx layer; its
  orthonormalized start passes `check_frames` as the linen one does."""
  low = LOW[dtype]
  model = nnx_model(low)
  start = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  so.check_frames(nnx.state(model, nnx.Param))
  optimizer = nnx.Optimizer(model, so.stiefel_attention(1e-3), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(5), (2, 4, D))

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    optimizer.update(model, grads)

  for _ in range(2):
    step(model, optimizer)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for p in jax.tree.leaves(params):
    assert p.dtype == low and bool(jnp.isfinite(p).all())
  moved = so.frame_movement(start, params)
  assert all(float(jnp.min(m)) > 1e-3 for m in moved.values())
  so.check_frames(params)


def test_upcast_float16_is_float32_adamw_rounded_and_a_no_op_elsewhere():
  """float16 leaves: optax.adamw's float32 update rounded once to float16;
  every other leaf (float32, bf16) bit for bit optax.adamw's, state too."""
  p = {"h": jnp.array([1.0, 1.0, 1.0], jnp.float16),
       "f": jnp.array([1.0, 2.0]), "b": jnp.array([1.0, 2.0], jnp.bfloat16)}
  g = {"h": jnp.array([0.0, 1e-3, 1.0], jnp.float16),
       "f": jnp.array([0.0, 1e-3]), "b": jnp.array([0.0, 1e-3], jnp.bfloat16)}
  adamw = optax.adamw(1e-3)
  tx = aliases.upcast_float16(adamw)
  u, s = tx.update(g, tx.init(p), p)
  ref_h, _ = adamw.update(g["h"].astype(jnp.float32),
                          adamw.init(p["h"].astype(jnp.float32)),
                          p["h"].astype(jnp.float32))
  assert u["h"].dtype == jnp.float16 and bool(jnp.isfinite(u["h"]).all())
  np.testing.assert_array_equal(u["h"], ref_h.astype(jnp.float16))
  plain = {k: p[k] for k in ("f", "b")}
  ref, ref_s = adamw.update({k: g[k] for k in plain}, adamw.init(plain), plain)
  for k in plain:
    assert u[k].dtype == p[k].dtype
    np.testing.assert_array_equal(u[k], ref[k])
  assert jax.tree.leaves(s)[0].dtype == jnp.int32          # the count
  for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(tx.init(p))):
    assert a.dtype == b.dtype


# --------------------------------------------------------------------------
# Stalling: the float32 master copy.


def _trace_run(w0, tx, steps: int):
  """`steps` steps maximising tr(W^T A W) per frame in one jitted
  lax.scan; returns the final frames and the per-step isometry errors
  (float32)."""
  a = jax.random.normal(jax.random.key(6), (w0.shape[-2],) * 2)
  a = a + a.T

  def step(carry, _):
    w, state = carry
    g = jax.grad(lambda v: -jnp.sum(
        (jnp.swapaxes(v, -1, -2) @ a @ v) * jnp.eye(w0.shape[-1])))(
            w.astype(jnp.float32)).astype(w.dtype)
    u, state = tx.update(g, state, w)
    w = optax.apply_updates(w, u)
    return (w, state), jnp.max(so.isometry_error(w))

  (w, _), iso = jax.jit(lambda w: jax.lax.scan(
      step, (w, tx.init(w)), length=steps))(w0)
  return w, iso


def test_bf16_frames_drift_1000_steps():
  """1,000 bf16 steps at lr 1e-3 (one jitted scan, tiny frames): the frames
  move as the float32 run's do (they moved about 0.25 of it, with a fifth
  of their entries ever changing, before the master copy), end near the
  float32 run, and stay orthonormal to bf16's rounding without drift."""
  w32 = so.random_frames(jax.random.key(7), (2, 16, 4))
  w16 = w32.astype(jnp.bfloat16)
  r = w32.shape[-1]
  f32, _ = _trace_run(w32, so.stiefel_adam(1e-3), 1000)
  low, iso = _trace_run(w16, so.stiefel_adam(1e-3), 1000)
  up = lambda x: x.astype(jnp.float32)
  move32 = float(jnp.linalg.norm(f32 - w32))
  move16 = float(jnp.linalg.norm(up(low) - up(w16)))
  assert 0.8 < move16 / move32 < 1.25, move16 / move32
  assert float(jnp.mean(low != w16)) > 0.8       # entries change
  # The bf16 run tracks the float32 one: apart by far less than it moved.
  assert float(jnp.linalg.norm(up(low) - f32)) < 0.2 * move32
  iso = np.asarray(iso)
  assert np.isfinite(iso).all()
  assert iso.max() <= rounding_bound(jnp.bfloat16, r)
  # No drift: the last 100 steps' worst error is within the first 100's
  # rounding level (both are single roundings of an orthonormal master).
  assert iso[-100:].max() <= max(2 * iso[:100].max(),
                                 rounding_bound(jnp.bfloat16, r) / 2)


def test_master_frames_off_warns_and_float32_frames_are_unchanged():
  """master_frames=False: an EmptyState and a warning that the frames
  stall; float32 frames: an EmptyState and no warning either way."""
  w32 = so.random_frames(jax.random.key(8), (2, 8, 4))
  with pytest.warns(UserWarning, match="stall"):
    state = so.stiefel_adam(1e-3, master_frames=False).init(
        w32.astype(jnp.bfloat16))
  assert isinstance(state[-1], optax.EmptyState)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for master in (True, False):
      state = so.stiefel_adam(1e-3, master_frames=master).init(w32)
      assert isinstance(state[-1], optax.EmptyState)
    state = so.stiefel_adam(1e-3).init(w32.astype(jnp.bfloat16))
  assert isinstance(state[-1], retraction.MasterFramesState)
  assert state[-1].master.dtype == jnp.float32


def test_master_lands_exactly_and_yields_to_changed_params():
  """The update lands the bf16 params on the master rounded to bf16; where
  the params no longer round from the master (changed outside the
  optimizer), the step starts from the params."""
  w = so.random_frames(jax.random.key(9), (2, 8, 4)).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.key(10), w.shape).astype(jnp.bfloat16)
  tx = so.stiefel_adam(1e-2)
  u, state = tx.update(g, tx.init(w), w)
  new = optax.apply_updates(w, u)
  master = state[-1].master
  # Exact where round(master) - w is a bf16 number (Sterbenz: nearly all).
  assert float(jnp.mean(new == master.astype(jnp.bfloat16))) > 0.99
  start = retraction.start_frames(state[-1], new)
  same = new == master.astype(jnp.bfloat16)
  np.testing.assert_array_equal(jnp.where(same, start, 0),
                                jnp.where(same, master, 0))
  other = so.random_frames(jax.random.key(11), w.shape).astype(jnp.bfloat16)
  np.testing.assert_array_equal(retraction.start_frames(state[-1], other),
                                other.astype(jnp.float32))


def test_one_pass_master_equals_its_chain():
  """bf16 frames with the float32 master: `stiefel_adam`'s one-pass update
  and its explicit chain (whose links round the step to bf16 in between;
  only its retraction has the master) keep masters equal to that rounding
  (2^-8 of a step, a step being <= 0.1 here) and land the frames within one
  bf16 spacing of each other."""
  w = so.random_frames(jax.random.key(12), (3, 16, 4)).astype(jnp.bfloat16)
  one = so.stiefel_adam(0.05)
  ref = optax.chain(so.check_orthonormal_start(),
                    so.scale_by_frame_adam(project=True),
                    optax.scale_by_learning_rate(0.05), so.clip_frame_norm(0.1),
                    so.retract_polar(max_step_norm=0.1))
  s_one, s_ref = one.init(w), ref.init(w)
  assert jax.tree.structure(s_one) == jax.tree.structure(s_ref)
  for t in range(3):
    g = jax.random.normal(jax.random.key(20 + t), w.shape).astype(jnp.bfloat16)
    u_one, s_one = one.update(g, s_one, w)
    u_ref, s_ref = ref.update(g, s_ref, w)
    m_one, m_ref = s_one[-1].master, s_ref[-1].master
    # Each step entry is <= 0.1 (the cap) and the chain rounds it to bf16
    # twice (2^-8 relative each): 4 such roundings is the margin.
    assert float(jnp.max(jnp.abs(m_one - m_ref))) <= 4 * 0.1 * 2.0 ** -8, t
    new_one = optax.apply_updates(w, u_one).astype(jnp.float32)
    new_ref = optax.apply_updates(w, u_ref).astype(jnp.float32)
    # eps |x| >= one bf16 spacing at x.
    spacing = eps(jnp.bfloat16) * jnp.maximum(jnp.abs(new_one),
                                              jnp.abs(new_ref))
    assert bool(jnp.all(jnp.abs(new_one - new_ref) <= spacing)), t
    w = optax.apply_updates(w, u_one)
