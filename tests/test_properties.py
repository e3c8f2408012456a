"""Property tests (hypothesis) over (batch, d, r, dtype).

The projection is the orthogonal projection onto T_W St; the retraction
lands on the manifold at the polar factor of W + xi (short and long steps,
orthonormal and non-orthonormal starts) and stays finite for a
rank-deficient W + xi; the whole Stiefel-Adam step is
O(d)-equivariant (`equivariance.assert_od_equivariant`, Q with det +1 and
-1); with eps = 0 it is independent of the gradient's scale; mismatched
shapes are an error naming both. Each property compares against an
independent float64 NumPy computation or a transformed run, so a no-op or a
wrong map fails it (see each docstring for what would make it fail).

Tolerances are multiples of the dtype's machine epsilon (float64 runs under
`jax.enable_x64`). Shapes are drawn from a small pool and each check is one
jitted function, so an example costs a compilation only the first time its
(shape, dtype) is drawn. The example count is `SETTINGS` (50 each;
STIEFEL_HYPOTHESIS_EXAMPLES=500 for a longer search).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import stiefel_optax as so
from stiefel_optax import geometry

import equivariance

DTYPES = ("float32", "float64", "bfloat16")
EXAMPLES = int(os.environ.get("STIEFEL_HYPOTHESIS_EXAMPLES", "50"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, print_blob=True)


# (batch, d, r): a single column, a square frame (d = r, where the tangent
# space is W times the skew matrices) and a batch of general frames. Every
# new (shape, dtype) costs a compilation of each check, so the pool is
# small and the examples vary the values (frames, gradients, steps, Q,
# scales) instead.
SHAPES = (((), 2, 1), ((), 3, 3), ((2,), 5, 3))


@st.composite
def cases(draw, dtypes=DTYPES):
  """(batch, d, r, dtype, seed)."""
  batch, d, r = draw(st.sampled_from(SHAPES))
  dtype = draw(st.sampled_from(dtypes))
  seed = draw(st.integers(0, 2**32 - 1))
  return batch, d, r, dtype, seed


def precision(dtype):
  """x64 context when needed, the dtype, and its machine epsilon."""
  ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
  return ctx, jnp.dtype(dtype), float(jnp.finfo(jnp.dtype(dtype)).eps)


def haar(rng, shape):
  """Haar frames (float64 NumPy), sign-corrected QR."""
  q, r = np.linalg.qr(rng.standard_normal(shape))
  return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def data(batch, d, r, dtype, seed, n_grads=1):
  """Frames W (rounded to dtype) and n_grads standard normal gradients."""
  rng = np.random.default_rng(seed)
  w = jnp.asarray(haar(rng, batch + (d, r)), dtype)
  gs = [jnp.asarray(rng.standard_normal(batch + (d, r)), dtype)
        for _ in range(n_grads)]
  return w, gs


def np64(x):
  return np.asarray(x).astype(np.float64)


def t(x):
  return np.swapaxes(x, -1, -2)


def fro(x):
  """||x||_F per frame (float64)."""
  return np.linalg.norm(np64(x), axis=(-2, -1))


def np_polar(a):
  u, _, vt = np.linalg.svd(a, full_matrices=False)
  return u @ vt


project = jax.jit(so.geometry.project_tangent)


@functools.partial(jax.jit, static_argnames=("method",))
def retract(w, xi, method):
  return so.retract(w, xi, method)


# ---------------------------------------------------------------------------
# Projection


@SETTINGS
@given(cases())
def test_projection_is_the_orthogonal_projection(case):
  """xi = P_W(G) is tangent (W^T xi skew), P_W(xi) = xi, and the removed
  part N = G - xi is normal: N = W S with S = W^T N symmetric. Together
  these pin P_W down (P = 0 fails N = W S, P = identity fails tangency)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, (g,) = data(batch, d, r, dtype, seed)
    xi = project(w, g)
    assert xi.dtype == dtype and xi.shape == g.shape
    w64, g64, xi64 = np64(w), np64(g), np64(xi)
    # Rounding of W^T G and W S in the dtype, per frame.
    tol = 8 * eps * math.sqrt(d * r) * (1.0 + fro(g64))
    assert np.all(fro(np64(project(w, xi)) - xi64) <= tol)
    wtx = t(w64) @ xi64
    assert np.all(fro(wtx + t(wtx)) <= tol)
    normal = g64 - xi64
    s = t(w64) @ normal
    assert np.all(fro(s - t(s)) <= tol)
    assert np.all(fro(normal - w64 @ s) <= tol)
    # The reference: G - W sym(W^T G) in float64.
    wtg = t(w64) @ g64
    ref = g64 - w64 @ (0.5 * (wtg + t(wtg)))
    assert np.all(fro(xi64 - ref) <= tol)


@SETTINGS
@given(cases(), st.integers(0, 3))
def test_mismatched_shapes_are_an_error_naming_both(case, which):
  """project_tangent and retract never broadcast: a gradient (or step)
  whose shape differs from the frame's is a ValueError naming both shapes
  (a (d, 1) gradient for a (d, r) frame would otherwise project r copies)."""
  batch, d, r, _, _ = case
  w_shape = batch + (d, r)
  wrong = [batch + ((d, 1) if r > 1 else (d, 2)),      # too few/many columns
           batch + (d + 1, r),                           # rows
           (3,) + w_shape,                               # extra batch axis
           (1,) + w_shape][which]                        # broadcastable
  w = np.zeros(w_shape, np.float32)
  g = np.zeros(wrong, np.float32)
  for fn in (so.geometry.project_tangent, lambda w, g: so.retract(w, g, "eigh")):
    with pytest.raises(ValueError, match=re.escape(str(w_shape))) as info:
      fn(w, g)
    assert str(tuple(wrong)) in str(info.value)


# ---------------------------------------------------------------------------
# Retraction


def isometry_tol(method, dtype, d, r, eps, kappa_m=1.0):
  """What `retract` promises for ||Q^T Q - I||_F: Newton–Schulz certifies
  ||Z Y - I||_F <= `newton_schulz_accept_tol` (8 sqrt(r) eps of the compute
  dtype), eigh is exact up to rounding, and rounding the result to dtype
  adds ~ 2 sqrt(r) eps(dtype). kappa_m = kappa((W + xi)^T (W + xi)): both
  methods form M = A^T A, whose rounding (~eps kappa(M) relative in its
  smallest eigenvalue) the certificate does not see; measured for tangent
  steps of norm 30 in float32 (kappa(M) = 901): up to ~310 sqrt(r) eps
  (0.34 kappa(M)), so the term below has a ~3x margin. kappa_m = 1 for
  steps within the trust region (||xi||_F <= 1, kappa(M) <= 2) keeps the
  documented level."""
  cdtype = geometry.compute_dtype(dtype)
  ceps = float(jnp.finfo(cdtype).eps)
  tol = geometry.newton_schulz_accept_tol(cdtype, r) if (
      method == "newton_schulz") else 8 * math.sqrt(r * d) * ceps
  return tol + math.sqrt(r) * (ceps * kappa_m + 4 * eps)


@SETTINGS
@given(cases(), st.floats(0.0, 1.0), st.sampled_from([1.0, 30.0]),
       st.sampled_from(geometry.RETRACTIONS))
def test_retraction_is_the_polar_factor(case, fraction, longest, method):
  """R_W(xi) for tangent xi with ||xi||_F up to 1 (the trust region's
  range) or 30 (no trust region): on St(d, r) to what the retraction
  promises, and equal to polar(W + xi) from a float64 SVD (a retraction
  that returns W, or any other frame, fails the second check)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  step = fraction * longest
  with ctx:
    w, (g,) = data(batch, d, r, dtype, seed)
    cdtype = geometry.compute_dtype(dtype)
    xi = project(w.astype(cdtype), g.astype(cdtype))
    xi = xi * (step / np.maximum(fro(xi), 1e-30))[..., None, None].astype(
        cdtype)
    new = retract(w, xi, method)
    assert new.dtype == dtype and new.shape == w.shape
    n = np64(new)
    err = fro(t(n) @ n - np.eye(r))
    kappa_m = 1.0 if step <= 1.0 else 1.0 + step ** 2
    assert np.all(err <= isometry_tol(method, dtype, d, r, eps, kappa_m)), err
    # polar(W + xi) is well conditioned (singular values >= 1): the result
    # is its value up to the rounding of W + xi, of M and of the output.
    ref = np_polar(np64(w) + np64(xi))
    ceps = float(jnp.finfo(cdtype).eps)
    tol = (4 * eps + 64 * ceps + ceps * kappa_m) * math.sqrt(d * r)
    assert np.all(fro(n - ref) <= tol), fro(n - ref)


@SETTINGS
@given(cases(dtypes=("float32", "float64")), st.floats(-1.0, 1.0),
       st.floats(0.0, 0.5), st.sampled_from(geometry.RETRACTIONS))
def test_retraction_from_a_non_orthonormal_start(case, log10_spread, step,
                                                 method):
  """W with singular values spread over [10^-s, 10^s] (s <= 1, e.g. a
  pretrained or Flax-scaled kernel) and any step: R_W(xi) = polar(W + xi)
  and lands on the manifold (the fixed Newton–Schulz count alone diverges
  here: its certificate must send it to the fallback)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  rng = np.random.default_rng(seed)
  u, v = haar(rng, batch + (d, r)), haar(rng, batch + (r, r))
  sigma = 10.0 ** (log10_spread * rng.uniform(-1.0, 1.0, batch + (r,)))
  w64 = (u * sigma[..., None, :]) @ t(v)
  # ||xi||_F <= sigma_min(W) / 2, so W + xi keeps full rank (kappa(W + xi)
  # <= 3 kappa(W) <= 300).
  xi64 = rng.standard_normal(w64.shape)
  xi64 *= (step * np.min(sigma, axis=-1) / fro(xi64))[..., None, None]
  with ctx:
    w, xi = jnp.asarray(w64, dtype), jnp.asarray(xi64, dtype)
    new = np64(retract(w, xi, method))
    ref = np_polar(np64(w) + np64(xi))
    a = np64(w) + np64(xi)
    sv = np.linalg.svd(a, compute_uv=False)
    kappa = sv[..., 0] / sv[..., -1]
    err = fro(t(new) @ new - np.eye(r))
    assert np.all(err <= isometry_tol(method, dtype, d, r, eps,
                                      np.max(kappa) ** 2)), err
    # polar(A) moves by ~eps kappa(A) under a rounding of A.
    tol = 64 * eps * math.sqrt(d * r) * kappa
    assert np.all(fro(new - ref) <= tol), (fro(new - ref), tol)


@SETTINGS
@given(cases(dtypes=("float32", "float64")), st.floats(0.0, 2.0),
       st.floats(0.0, 0.5), st.sampled_from(geometry.RETRACTIONS))
def test_retraction_of_a_rank_deficient_frame_is_finite(case, c, step,
                                                        method):
  """W + xi with one column c times another (c = 0: a zero head), so
  (W + xi)^T (W + xi) is singular and no polar factor exists: the result
  must still be finite with the frame's shape and dtype, never NaN or Inf
  (an unguarded inverse square root of the zero eigenvalue, or a
  Newton–Schulz iterate that a rounded-negative eigenvalue makes grow like
  (9/4)^k, fails it). Which finite frame comes back is not specified (the
  rounding of the null direction decides it), so nothing else is checked;
  `init` is where a rank-deficient start is reported."""
  batch, d, r, name, seed = case
  r = max(r, 2)                     # every pool shape has d >= 2
  ctx, dtype, _ = precision(name)
  rng = np.random.default_rng(seed)
  w64 = haar(rng, batch + (d, r))
  xi64 = rng.standard_normal(w64.shape)
  xi64 *= (step / fro(xi64))[..., None, None]
  j, k = rng.choice(r, 2, replace=False)
  w64[..., :, j] = c * w64[..., :, k]
  xi64[..., :, j] = c * xi64[..., :, k]
  with ctx:
    w, xi = jnp.asarray(w64, dtype), jnp.asarray(xi64, dtype)
    new = retract(w, xi, method)
    assert new.dtype == dtype and new.shape == w.shape
    assert np.all(np.isfinite(np64(new))), new


# ---------------------------------------------------------------------------
# The Stiefel-Adam step


# One optimizer for the equivariance and the scale properties (eps = 0,
# the scale-free variant), so that they share one compiled step per
# (shape, dtype) (`equivariance.trajectory` caches it).
TX = so.stiefel_adam(0.05, eps=0.0)


def run(w, grads):
  """The frames after each step of TX."""
  return equivariance.trajectory(TX, w, grads)[0]


@jax.jit
def first_adam_step(g, w):
  """The first step of scale_by_frame_adam with eps > 0: g / (||g|| + eps)."""
  tx = so.scale_by_frame_adam(eps=1e-6)
  return tx.update(g, tx.init(w), w)[0]


@SETTINGS
@given(cases(), st.sampled_from([1, -1]))
def test_step_is_equivariant_under_orthogonal_maps(case, det):
  """Proposition 4 over three steps (so the momentum transport is
  included): frames and momentum from (QW, QG) are Q times those from
  (W, G), second moments equal. The base run must move (`min_motion`);
  optax.adam, a per-coordinate second moment, fails the same check
  (tests/test_transforms.py)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, gs = data(batch, d, r, dtype, seed, n_grads=3)
    q = equivariance.haar_orthogonal(seed + 1, d, det=det)
    # Rounding Q W and Q G to the dtype already differs at its epsilon;
    # each step is well conditioned, so the difference stays at that level.
    atol = 16 * eps if name != "bfloat16" else 4 * eps
    # The momentum sums projected gradients: where it cancels (d = 2,
    # r = 1 has a one-dimensional tangent space), its rounding is relative
    # to the gradients, not to itself. A momentum that does not rotate is
    # off by O(1).
    state_atol = min(1024 * eps, 0.1)
    equivariance.assert_od_equivariant(TX, w, gs, q, atol=atol,
                                       state_atol=state_atol, min_motion=1e-2)


@SETTINGS
@given(cases(), st.integers(-8, 8), st.floats(1e-3, 1e3))
def test_scale_independence_with_eps_zero(case, k, c):
  """Proposition 2: with eps = 0, gradients c G give the trajectory of G;
  for c = 2^k (exact in floating point) bit for bit. The trajectory moves,
  and with eps > 0 a tiny gradient gives a shorter step (the property is
  not that of a constant map)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, gs = data(batch, d, r, dtype, seed, n_grads=3)
    base = run(w, gs)
    assert np.all(fro(np64(base[0]) - np64(w)) > 1e-2)      # it moves
    pow2 = run(w, [g * jnp.asarray(2.0 ** k, dtype) for g in gs])
    for a, b in zip(base, pow2):
      np.testing.assert_array_equal(np64(a), np64(b))
    scaled = run(w, [jnp.asarray(np64(g) * c, dtype) for g in gs])
    for a, b in zip(base, scaled):
      # c G rounds in the dtype: equal up to a few of its epsilons.
      assert np.all(fro(np64(a) - np64(b)) <= 16 * eps * math.sqrt(d * r))
    # eps > 0 is not scale-free: a tiny gradient gives a smaller step.
    if name != "bfloat16":
      g = project(w, gs[0])
      u_base = fro(first_adam_step(g, w))
      u_tiny = fro(first_adam_step(g * jnp.asarray(1e-9, dtype), w))
      assert np.all(u_tiny < 0.5 * u_base)
