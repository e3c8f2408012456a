"""Safe on any input: property tests (hypothesis) of the polar retraction.

Whatever W + xi a user passes, the retraction lands on the manifold or, when
W + xi is rank-deficient, stays finite: starts that are not orthonormal
(condition numbers up to 1e6, any scale), rank-deficient frames (a zero
head, a zero column, low rank), long steps (||xi||_F up to 10) under any
radius, and shapes that do not agree (an error naming both).

Examples are random (not derandomized) and many. The frames have one shape,
that of tests/test_geometry.py, so the compiled retraction is reused across
examples and files (each new shape compiles its loops, about a second on a
small CPU); the shape checks, which compile nothing, draw any shapes.
float64 runs under `jax.enable_x64`.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import stiefel_optax as so
from stiefel_optax import geometry

SETTINGS = settings(max_examples=50, deadline=None, print_blob=True)
# The `certificate` fixture is a stateless recorder: safe to share between
# the examples of one test.
RECORDING = settings(SETTINGS, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
SHAPES = [(3, 8, 4)]                      # (batch, d, r)
RADII = [None, 0.1, 1.0]                  # retract's max_step_norm
# float64 isometry promised by the Newton–Schulz retraction (sqrt(r) times
# newton_schulz_tol, certified at 8 sqrt(r) eps), with room for measuring.
F64_NS = 1e-14


def precision(dtype):
  ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
  return ctx, jnp.dtype(dtype)


def np_polar(a):
  """polar(A) = U V^T per frame, from a float64 SVD (reference)."""
  u, _, vt = np.linalg.svd(np.asarray(a, np.float64), full_matrices=False)
  return u @ vt


def iso(x):
  """Largest ||X^T X - I||_F of the batch, measured in float64."""
  x = np.asarray(x, np.float64)
  gram = np.swapaxes(x, -1, -2) @ x
  return float(np.max(np.linalg.norm(gram - np.eye(x.shape[-1]),
                                     axis=(-2, -1))))


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def spread(rng, shape, kappa, scale):
  """A = U diag(s) V^T with singular values spanning exactly [1, kappa]
  (log-uniform inside) times `scale`: a full-rank frame that is not
  orthonormal, of condition number kappa."""
  batch, d, r = shape
  u = np.linalg.qr(rng.standard_normal((batch, d, r)))[0]
  v = np.linalg.qr(rng.standard_normal((batch, r, r)))[0]
  s = np.exp(rng.uniform(0.0, math.log(kappa), (batch, r)))
  s[:, 0], s[:, -1] = 1.0, kappa
  return scale * np.einsum("bdr,br,bsr->bds", u, s, v)


def with_norm(x, norm):
  """x rescaled to ||x||_F = norm per frame."""
  n = np.linalg.norm(x, axis=(-2, -1), keepdims=True)
  return x * (norm / np.maximum(n, 1e-300))


def tangent(rng, w, norm):
  """A random tangent step at the orthonormal frames w, ||xi||_F = norm."""
  g = rng.standard_normal(w.shape)
  wtg = np.swapaxes(w, -1, -2) @ g
  xi = g - w @ (0.5 * (wtg + np.swapaxes(wtg, -1, -2)))
  return with_norm(xi, norm)


@st.composite
def starts(draw, max_log_kappa):
  """(shape, kappa, scale, step norm, radius, seed)."""
  shape = draw(st.sampled_from(SHAPES))
  kappa = 10.0 ** draw(st.floats(0.0, max_log_kappa))
  scale = 10.0 ** draw(st.floats(-3.0, 3.0))
  step = draw(st.floats(0.0, 10.0))
  radius = draw(st.sampled_from(RADII))
  return shape, kappa, scale, step, radius, draw(st.integers(0, 2**31 - 1))


# ---------------------------------------------------------------------------
# Full-rank starts that are not orthonormal


@RECORDING
@given(case=starts(max_log_kappa=6.0))
def test_any_full_rank_start_lands_on_the_manifold_float64(case, certificate):
  """kappa(W + xi) up to 1e6, any scale, any step, any radius: isometry
  <= 1e-12, polar(W + xi) up to its conditioning (a Gram-based factor is
  accurate to ~eps kappa^2), and the M-scaled pass takes no more steps
  than derived for kappa(M) = kappa^2."""
  shape, kappa, scale, step, radius, seed = case
  rng = np.random.default_rng(seed)
  with jax.enable_x64(True):
    a = spread(rng, shape, kappa, scale)
    xi = with_norm(rng.standard_normal(shape), step)
    w = jnp.asarray(a - xi)
    out = so.retract(w, jnp.asarray(xi), max_step_norm=radius)
    assert out.dtype == jnp.float64 and out.shape == w.shape
    certificate("safety: isometry, any full-rank start (f64)", iso(out))
    assert iso(out) <= 1e-12
    # The reference from W + xi as rounded (a - xi + xi is not a when the
    # step dwarfs A).
    ref = np_polar(np.asarray(w) + xi)
    assert rel(out, ref) <= 1e-14 * kappa ** 2 + 1e-13
    # The same through the transform, told the steps are not tangent;
    # optax's W + (Q - W) rounds at eps |W|, which can be large here.
    tx = so.retract_polar(tangent=False)
    update, _ = tx.update(jnp.asarray(xi), tx.init(w), w)
    big = float(np.max(np.abs(np.asarray(w))))
    assert iso(optax.apply_updates(w, update)) <= 1e-12 + 1e-14 * big
    a = jnp.asarray(a)
    p = so.polar(a, "newton_schulz")
    assert iso(p) <= 1e-12
    assert rel(p, np_polar(a)) <= 1e-14 * kappa ** 2 + 1e-13
    r = shape[-1]
    tol = math.sqrt(geometry.newton_schulz_accept_tol(jnp.float64, r))
    _, steps, _ = geometry.inv_sqrt_newton_schulz(
        geometry.gram(a), tol,
        max_steps=geometry.newton_schulz_max_steps(jnp.float64, r))
    assert int(steps) <= geometry.newton_schulz_fallback_steps(
        kappa ** 2, r, tol)


@RECORDING
@given(case=starts(max_log_kappa=2.0))
def test_moderately_conditioned_start_float32(case, certificate):
  """float32, kappa(W + xi) up to 1e2: isometry <= 1e-5."""
  shape, kappa, scale, step, radius, seed = case
  rng = np.random.default_rng(seed)
  a = spread(rng, shape, kappa, scale)
  xi = with_norm(rng.standard_normal(shape), step)
  w = jnp.asarray(a - xi, jnp.float32)
  xi = jnp.asarray(xi, jnp.float32)
  out = so.retract(w, xi, max_step_norm=radius)
  assert out.dtype == jnp.float32
  certificate("safety: isometry, kappa <= 1e2 start (f32)", iso(out))
  assert iso(out) <= 1e-5
  # kappa(M) = 1e4 costs float32 ~ eps kappa^2 in the factor itself.
  assert rel(out, np_polar(np.asarray(w, np.float64) + np.asarray(xi))) <= (
      1e-6 * kappa ** 2 + 1e-5)
  assert iso(so.polar(w + xi, "newton_schulz")) <= 1e-5


# ---------------------------------------------------------------------------
# Rank-deficient frames


@SETTINGS
@given(st.sampled_from(SHAPES), st.sampled_from(["float32", "float64"]),
       st.sampled_from(["zero head", "zero column", "low rank"]),
       st.floats(-3.0, 3.0), st.sampled_from(RADII), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_rank_deficient_frames_stay_finite(shape, dtype, kind, log_scale,
                                           radius, tangent_step, seed):
  """Frame 1 of the batch is rank-deficient: the result is finite (and
  bounded) on every path; frame 0 (full rank) still lands on the manifold."""
  rng = np.random.default_rng(seed)
  batch, d, r = shape
  a = spread(rng, shape, 10.0, 10.0 ** log_scale)
  if kind == "zero head":
    a[1] = 0.0
  elif kind == "zero column":
    a[1, :, rng.integers(r)] = 0.0
  else:
    rank = int(rng.integers(1, r))
    a[1] = rng.standard_normal((d, rank)) @ rng.standard_normal((rank, r))
  ctx, dt = precision(dtype)
  with ctx:
    xi = np.zeros(shape)
    if tangent_step:   # the step is part of W + xi: move it into W
      xi = with_norm(rng.standard_normal(shape), 0.05)
    w, xi = jnp.asarray(a - xi, dt), jnp.asarray(xi, dt)
    outs = [so.retract(w, xi, max_step_norm=radius),
            so.retract(w, xi, tangent=False),
            so.polar(w + xi, "newton_schulz")]
    for out in outs:
      assert out.dtype == dt
      assert bool(jnp.all(jnp.isfinite(out)))
      assert float(jnp.max(jnp.abs(out))) <= 1e3
      assert iso(out[0]) <= (1e-5 if dtype == "float32" else 1e-12)


# ---------------------------------------------------------------------------
# Long steps from an orthonormal frame


@SETTINGS
@given(st.sampled_from(SHAPES), st.sampled_from(["float32", "float64"]),
       st.floats(0.0, 10.0), st.sampled_from(RADII), st.integers(0, 2**31 - 1))
def test_long_tangent_steps_under_any_radius(shape, dtype, step, radius, seed):
  """Orthonormal W, tangent ||xi||_F up to 10, radius smaller or larger than
  the step (or none): exactly the eigh retraction, on the manifold to the
  dtype's rounding; also through `retract_polar` and `optax.apply_updates`."""
  rng = np.random.default_rng(seed)
  w = np.linalg.qr(rng.standard_normal(shape))[0]
  xi = tangent(rng, w, step)
  ctx, dt = precision(dtype)
  with ctx:
    w, xi = jnp.asarray(w, dt), jnp.asarray(xi, dt)
    out = so.retract(w, xi, max_step_norm=radius)
    exact = np_polar(np.asarray(w, np.float64) + np.asarray(xi, np.float64))
    f32 = dtype == "float32"
    assert iso(out) <= (3e-6 if f32 else F64_NS)
    # kappa(W + xi) <= sqrt(1 + step^2) <= 10.
    assert rel(out, exact) <= (1e-5 if f32 else 1e-13)
    tx = so.retract_polar(max_step_norm=radius)
    update, _ = tx.update(xi, tx.init(w), w)
    moved = optax.apply_updates(w, update)
    assert iso(moved) <= (3e-6 if f32 else F64_NS)


# ---------------------------------------------------------------------------
# Shapes that do not agree


@st.composite
def mismatched(draw):
  """Two different shapes (..., d, r) with d >= r >= 1 for the frame."""
  d = draw(st.integers(1, 6))
  r = draw(st.integers(1, d))
  batch = draw(st.sampled_from([(), (2,), (1, 3)]))
  frame = batch + (d, r)
  other = (draw(st.sampled_from([(), (2,), (3,)]))
           + draw(st.tuples(st.integers(1, 7), st.integers(1, 7))))
  if other == frame:
    other = frame[:-1] + (r + 1,)
  return frame, other


def names_both(info, fn, a, b):
  msg = str(info.value)
  assert msg.startswith(fn + ":"), msg
  assert str(tuple(a)) in msg and str(tuple(b)) in msg, msg


@SETTINGS
@given(mismatched())
def test_mismatched_shapes_raise_naming_both(shapes):
  """project_tangent and retract never broadcast W against G or xi, and
  the transforms name the leaf path with both shapes."""
  frame, other = shapes
  # NumPy inputs: the checks run before any jnp op, so nothing compiles.
  w, g = np.ones(frame, np.float32), np.ones(other, np.float32)
  with pytest.raises(ValueError) as info:
    so.geometry.project_tangent(w, g)
  names_both(info, "project_tangent", frame, other)
  with pytest.raises(ValueError) as info:
    so.retract(w, g)
  names_both(info, "retract", frame, other)
  if frame[:-1] != other[:-1]:
    with pytest.raises(ValueError) as info:
      geometry.gram(w, g)
    names_both(info, "gram", frame, other)
  for name, tx in (("project_to_tangent", so.project_to_tangent()),
                   ("retract_polar", so.retract_polar())):
    # Orthonormal frames, so that init's start check passes. init runs
    # abstractly (its leaf checks run, the concrete start statistics, a
    # compiled program per drawn shape, are skipped): the state is empty.
    params = {"attn": {"query": np.broadcast_to(
        np.eye(frame[-2], frame[-1], dtype=np.float32), frame)}}
    state = jax.eval_shape(tx.init, params)
    with pytest.raises(ValueError) as info:
      tx.update({"attn": {"query": g}}, state, params)
    names_both(info, name, frame, other)
    assert "['attn']['query']" in str(info.value)
