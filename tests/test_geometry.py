"""Geometry of St(d, r) (stiefel_optax/geometry.py): projection, polar
factor, retraction, Newton–Schulz.

* Examples. Shapes are tiny (d <= 16, r <= 4). float64 checks run under
  the `x64` fixture; float32 checks use the default precision.
* Properties (hypothesis) over (batch, d, r, dtype). The projection is the
  orthogonal projection onto T_W St; the retraction lands on the manifold
  at the polar factor of W + xi (short and long steps, orthonormal and
  non-orthonormal starts) and stays finite for a rank-deficient W + xi;
  mismatched shapes are an error naming both. Each property compares
  against an independent float64 NumPy computation, so a no-op or a wrong
  map fails it (see each docstring for what would make it fail).
  Tolerances are multiples of the dtype's machine epsilon (float64 runs
  under `jax.enable_x64`). Shapes are drawn from a small pool
  (`helpers.SHAPES`) and each check is one jitted function, so an example
  costs a compilation only the first time its (shape, dtype) is drawn. The
  example count is `helpers.SETTINGS` (50 each;
  STIEFEL_HYPOTHESIS_EXAMPLES=500 for a longer search).
* Safe on any input (hypothesis). Whatever W + xi a user passes, the
  retraction lands on the manifold or, when W + xi is rank-deficient,
  stays finite: starts that are not orthonormal (condition numbers up to
  1e6, any scale), rank-deficient frames (a zero head, a zero column, low
  rank), long steps (||xi||_F up to 10) under any radius, and shapes that
  do not agree (an error naming both). Examples are random (not
  derandomized) and many. The frames have one shape, that of the examples
  above, so the compiled retraction is reused across examples and tests
  (each new shape compiles its loops, about a second on a small CPU); the
  shape checks, which compile nothing, draw any shapes.

The properties of the whole step (Propositions 2 and 4 over shapes and
dtypes) share the hypothesis helpers (tests/helpers.py) and are in
tests/test_propositions.py.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from stiefel_optax import arrays, geometry, newton_schulz
import stiefel_optax as so

from tests.helpers import (
    SETTINGS, cases, data, fro, frames, haar, normal, np64, np_polar,
    np_polar_batch, precision, project, rel, t)


# float64 Newton–Schulz is sized for `newton_schulz_tol(float64)` ~ 1.1e-15
# per eigenvalue of Q^T Q (sqrt(r) tol = 2.2e-15 for r = 4) and certified at
# `newton_schulz_accept_tol` (8 sqrt(r) eps = 3.6e-15 for r = 4); the
# measurement itself rounds at a few 1e-16. This is the level promised.
F64_NS = 1e-14


def worst_tangent_step(w, delta):
  """A rank-one tangent step xi = delta u v^T with u in the complement of
  span(W): ||xi||_F = ||xi||_2 = delta, so (W + xi)^T (W + xi) = I + xi^T xi
  has eigenvalues 1 (r - 1 times) and 1 + delta^2, the extremes of the
  trust-region bound."""
  d, r = w.shape[-2:]
  x = jnp.zeros((d,), w.dtype).at[0].set(1.0).at[d - 1].set(1.0)
  u = x - w @ (w.T @ x)
  u = u / jnp.linalg.norm(u)
  v = jnp.ones((r,), w.dtype) / math.sqrt(r)
  return delta * jnp.outer(u, v)


# ---------------------------------------------------------------------------
# random_frames, isometry_error, sym


def test_random_frames_are_haar():
  """Orthonormal frames of the requested shape and dtype, Haar distributed:
  E[W] = 0 and E[W W^T] = (r / d) I. A plain QR (signs of diag(R) not
  folded in) has E[W_00] far from 0, so this can fail."""
  shape = (2, 2000, 4, 2)
  w = so.random_frames(jax.random.key(2), shape)
  assert w.shape == shape and w.dtype == jnp.float32
  err = so.isometry_error(w)
  assert err.shape == shape[:-2] and float(jnp.max(err)) <= 1e-5
  n, (d, r) = 4000, shape[-2:]
  w = np.asarray(w, np.float64).reshape((n, d, r))
  se = 1.0 / math.sqrt(d * n)          # std of the mean of one entry
  assert np.max(np.abs(w.mean(axis=0))) <= 5 * se
  proj = np.einsum("nij,nkj->ik", w, w) / n
  assert np.max(np.abs(proj - (r / d) * np.eye(d))) <= 0.05


def test_random_frames_float64(x64):
  w = so.random_frames(jax.random.key(1), (8, 4), jnp.float64)
  assert w.dtype == jnp.float64 and w.shape == (8, 4)
  assert float(so.isometry_error(w)) <= 1e-13


def test_isometry_error_is_frobenius_defect(normal):
  a = normal(3, (3, 8, 4))
  expected = np.linalg.norm(
      np.einsum("bdi,bdj->bij", a, a) - np.eye(4), axis=(-2, -1))
  np.testing.assert_allclose(so.isometry_error(a), expected, rtol=1e-5)


def test_sym(normal):
  a = normal(4, (3, 4, 4))
  s = so.geometry.sym(a)
  np.testing.assert_allclose(s, jnp.swapaxes(s, -1, -2))
  np.testing.assert_allclose(s + (a - jnp.swapaxes(a, -1, -2)) / 2, a,
                             atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gram_forms_agree_and_differentiate(x64, normal, dtype):
  """Both forms of A^T B (`arrays.gram` takes the materialised one on
  CPU, the contraction elsewhere) match NumPy to rounding, jitted, vmapped
  and differentiated (the optimization barrier has autodiff rules)."""
  dtype = jnp.dtype(dtype)
  a = normal(7, (3, 16, 4)).astype(dtype)
  b = normal(8, (3, 16, 5)).astype(dtype)
  want = np.einsum("bdr,bds->brs", np.asarray(a, np.float64),
                   np.asarray(b, np.float64))
  tol = 1e-5 if dtype == jnp.float32 else 1e-12
  for fn in (arrays.gram, arrays._gram_cpu, arrays._gram_contraction):  # pylint: disable=protected-access
    np.testing.assert_allclose(jax.jit(fn)(a, b), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(jax.vmap(fn)(a, b), want, rtol=tol, atol=tol)
    # d/dA sum(A^T B) = B summed over its columns, in every row.
    grad = jax.grad(lambda x, fn=fn: jnp.sum(fn(x, b)))(a)
    np.testing.assert_allclose(
        grad, np.broadcast_to(np.asarray(b).sum(-1, keepdims=True), a.shape),
        rtol=tol, atol=tol)


# ---------------------------------------------------------------------------
# Tangent projection


def test_project_tangent_float64(x64, certificate, frames, normal):
  """P_W is the orthogonal projector onto T_W St: W^T P(G) + P(G)^T W = 0,
  P(P(G)) = P(G), <P(X), Y> = <X, P(Y)>, P(W) = 0; batched = per frame."""
  w = frames(5, (3, 8, 4))
  g, y = normal(6, w.shape), normal(7, w.shape)
  p = so.geometry.project_tangent(w, g)
  assert p.shape == g.shape and p.dtype == jnp.float64
  skew = jnp.einsum("bdi,bdj->bij", w, p)
  errs = [
      float(jnp.max(arrays.frame_norm(skew + jnp.swapaxes(skew, -1, -2)))
            / jnp.linalg.norm(g)),
      rel(so.geometry.project_tangent(w, p), p),
      abs(float(jnp.vdot(so.geometry.project_tangent(w, g), y)
                - jnp.vdot(g, so.geometry.project_tangent(w, y))))
      / float(jnp.linalg.norm(g) * jnp.linalg.norm(y)),
      float(jnp.linalg.norm(so.geometry.project_tangent(w, w))),
  ]
  certificate("geometry: projector identities (f64)", max(errs))
  assert max(errs) <= 1e-13
  loop = jnp.stack([so.geometry.project_tangent(w[i], g[i]) for i in range(3)])
  assert rel(p, loop) <= 1e-14


# ---------------------------------------------------------------------------
# Polar factor


def test_polar_eigh_matches_svd_float64(x64, certificate, normal):
  """polar(A) = A (A^T A)^(-1/2) from an r x r eigh equals U V^T (square
  and tall frames)."""
  for shape in [(4, 4), (3, 8, 4)]:
    a = normal(6, shape)
    p = so.polar(a, method="eigh")
    assert p.shape == shape and p.dtype == jnp.float64
    ref = np.stack([np_polar(x) for x in np.reshape(a, (-1,) + shape[-2:])])
    err = rel(p, ref.reshape(shape))
    certificate("geometry: polar eigh vs SVD (f64)", err)
    assert err <= 1e-12


def test_polar_newton_schulz_near_orthonormal(x64, frames, normal):
  """For A near a frame, matmul-only Newton–Schulz agrees with eigh."""
  w = frames(7, (3, 8, 4))
  a = w + 0.05 * normal(8, w.shape)
  assert float(jnp.max(so.isometry_error(a))) < 0.5
  ns = so.polar(a, method="newton_schulz")
  assert rel(ns, so.polar(a, method="eigh")) <= F64_NS
  assert float(jnp.max(so.isometry_error(ns))) <= F64_NS


def test_polar_of_a_frame_is_the_frame(frames):
  w = frames(8, (3, 8, 4))
  for method in geometry.RETRACTIONS:
    assert rel(so.polar(w, method=method), w) <= 1e-6


def test_polar_preserves_low_precision_dtype(frames):
  w = frames(9, (8, 4), jnp.bfloat16)
  for method in geometry.RETRACTIONS:
    p = so.polar(w, method=method)
    assert p.dtype == jnp.bfloat16 and p.shape == w.shape


# ---------------------------------------------------------------------------
# Retraction and Newton–Schulz


@pytest.mark.parametrize("method", geometry.RETRACTIONS)
def test_retract_zero_step_is_identity(method, frames):
  w = frames(10, (3, 8, 4))
  out = so.retract(w, jnp.zeros_like(w), method)
  assert bool(jnp.all(jnp.isfinite(out)))
  assert rel(out, w) <= 1e-6


@pytest.mark.parametrize("method", geometry.RETRACTIONS)
def test_retract_pulls_drifted_frame_back(method, frames, normal):
  """A frame that rounding moved off St(d, r) lands back on it."""
  w = frames(11, (3, 8, 4))
  drifted = w + 1e-3 * normal(12, w.shape)
  assert float(jnp.min(so.isometry_error(drifted))) > 1e-4
  out = so.retract(drifted, jnp.zeros_like(w), method)
  # float32 eigh of an r x r matrix is accurate to a few ulp of 1.
  assert float(jnp.max(so.isometry_error(out))) <= 3e-6


def test_retract_methods_agree(x64, certificate, frames, normal):
  """Newton–Schulz sized for the trust region equals the exact (eigh)
  polar retraction for tangent steps with ||xi||_F = delta, and without a
  radius (max_step_norm=None: step count found at run time)."""
  w = frames(12, (3, 8, 4))
  xi0 = so.geometry.project_tangent(w, normal(13, w.shape))
  for delta in (0.1, 0.5, 1.0, 2.0):
    xi = xi0 * (delta / arrays.frame_norm(xi0))[:, None, None]
    exact = so.retract(w, xi, "eigh")
    ns = so.retract(w, xi, "newton_schulz", max_step_norm=delta)
    assert rel(so.retract(w, xi, "newton_schulz", max_step_norm=None),
               exact) <= F64_NS
    assert rel(so.retract(w, xi), exact) <= F64_NS     # the defaults
    err = rel(ns, exact)
    certificate("geometry: retract NS vs eigh (f64)", err)
    assert err <= F64_NS         # float64 runs to newton_schulz_tol(f64)
    assert float(jnp.max(so.isometry_error(ns))) <= F64_NS
    assert rel(exact, np.stack([np_polar(x) for x in (w + xi)])) <= 1e-12


def test_newton_schulz_step_counts():
  """The derived counts for the documented radii, and monotone in delta."""
  counts = {d: so.newton_schulz_steps(d) for d in (0.1, 0.5, 1.0)}
  assert counts == {0.1: 2, 0.5: 3, 1.0: 4}
  radii = [0.01, 0.1, 0.3, 0.5, 1.0, 2.0, 4.0]
  steps = [so.newton_schulz_steps(d) for d in radii]
  assert steps == sorted(steps)
  for d, k in zip(radii, steps):
    assert newton_schulz.newton_schulz_residual(d * d, k) <= 1e-8
    if k > 1:
      assert newton_schulz.newton_schulz_residual(d * d, k - 1) > 1e-8


def predicted_isometry(delta, r, steps):
  """Exact isometry error of the Newton–Schulz retraction of the rank-one
  step `worst_tangent_step`: M / c has eigenvalues 1 / c (r - 1 times) and
  (1 + delta^2) / c, c = 1 + delta^2 / 2, and each eigenvalue p of the
  final Gram matrix follows p <- p (3 - p)^2 / 4."""
  c = 1.0 + delta ** 2 / 2.0
  ps = np.array([1.0 / c] * (r - 1) + [(1.0 + delta ** 2) / c])
  for _ in range(steps):
    ps = ps * (3.0 - ps) ** 2 / 4.0
  return float(np.linalg.norm(1.0 - ps))


def test_newton_schulz_count_is_tight_float64(x64, certificate, frames):
  """Worst case of the trust region: a rank-one tangent step with
  ||xi||_F = ||xi||_2 = delta. With the derived count K every eigenvalue
  residual is <= tol = 1e-8; with K - 1 steps the measured residual is
  the predicted e_{K-1} > tol, so the count cannot be lowered."""
  w = frames(13, (16, 4))
  r = w.shape[-1]
  retract = jax.jit(so.retract, static_argnames=("method", "num_steps"))
  # tol = 1e-8 (the float32 count) and the float64 target of `retract`.
  for tol in (1e-8, newton_schulz.newton_schulz_tol(jnp.float64)):
    for delta in (0.1, 0.5, 1.0):
      xi = worst_tangent_step(w, delta)
      assert abs(float(jnp.linalg.norm(xi)) - delta) <= 1e-14
      k = so.newton_schulz_steps(delta, tol)
      for steps in (k, k - 1):
        out = retract(w, xi, method="newton_schulz", num_steps=steps)
        measured = float(so.isometry_error(out))
        predicted = predicted_isometry(delta, r, steps)
        if steps == k:
          assert measured <= math.sqrt(r) * tol + 1e-14
        else:
          # The analysis is exact: measured == predicted up to rounding.
          err = abs(measured / predicted - 1.0)
          certificate(
              "geometry: NS K-1 residual, measured vs analysis (f64)", err)
          assert err <= 1e-5
          assert newton_schulz.newton_schulz_residual(delta ** 2, steps) > tol
          assert measured > tol


def test_newton_schulz_float32_worst_case(certificate, frames):
  """float32: the derived count reaches isometry error <= 1e-6 for the
  worst-case step of each trust region, and agrees with eigh."""
  retract = so.retract
  for shape, deltas in [((16, 4), (0.1, 0.5, 1.0))]:
    w = frames(14, shape)
    for delta in deltas:
      xi = worst_tangent_step(w, delta)
      out = retract(w, xi, method="newton_schulz", max_step_norm=delta)
      err = float(so.isometry_error(out))
      certificate("geometry: NS worst-case isometry (f32)", err)
      assert err <= 1e-6
      assert rel(out, retract(w, xi, method="eigh")) <= 1e-5


@pytest.mark.parametrize("delta", [0.05, 0.5])
def test_newton_schulz_non_tangent_steps(delta, x64, frames, normal):
  """tangent=False: any xi with ||xi||_F = delta < 1, including the worst
  cases +-delta W e1 e1^T (singular values 1 -+ delta), is retracted."""
  w = frames(15, (8, 4))
  e1 = jnp.zeros((4, 4), jnp.float64).at[0, 0].set(1.0)
  rand = normal(16, w.shape)
  for xi in (-delta * w @ e1, delta * w @ e1,
             delta * rand / jnp.linalg.norm(rand)):
    out = so.retract(w, xi, "newton_schulz", max_step_norm=delta,
                     tangent=False)
    assert float(so.isometry_error(out)) <= F64_NS
    assert rel(out, np_polar(w + xi)) <= F64_NS
    # No radius: the M-scaled iteration, same result.
    out = so.retract(w, xi, "newton_schulz", tangent=False)
    assert float(so.isometry_error(out)) <= F64_NS
    assert rel(out, np_polar(w + xi)) <= F64_NS
  with pytest.raises(ValueError, match="max_step_norm < 1"):
    so.newton_schulz_steps(1.0, tangent=False)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_newton_schulz_steps_rejects_bad_radius(bad):
  with pytest.raises(ValueError, match="max_step_norm"):
    so.newton_schulz_steps(bad)


# ---------------------------------------------------------------------------
# Certificate and fallback: any full-rank W + xi, no silent slow path


def fast_path_certificate(w, xi, delta):
  """The fast path's count and its certificate for the step xi (the
  retraction falls back iff the certificate exceeds the accepted tol)."""
  cdtype = w.dtype
  r = w.shape[-1]
  tol, accept = (newton_schulz.newton_schulz_tol(cdtype),
                 newton_schulz.newton_schulz_accept_tol(cdtype, r))
  steps = newton_schulz._fast_path_steps(delta, tol, accept, r, True)
  c = 1.0 + jnp.sum(jnp.square(xi)) / 2.0
  _, cert = newton_schulz._newton_schulz_fixed(arrays.gram(w + xi) / c, steps)
  return steps, float(cert) / accept


def _stepped(y, num_steps):
  """Coupled Newton–Schulz by its definition, step by step: (Z, R of the
  last step)."""
  eye = jnp.eye(y.shape[-1], dtype=y.dtype)
  z = jnp.broadcast_to(eye, y.shape)
  for _ in range(num_steps):
    res = z @ y - eye
    t = eye - 0.5 * res
    y, z = y @ t, t @ z
  return z, res


def test_two_newton_schulz_steps_as_one_polynomial(x64, certificate):
  """`_newton_schulz_fixed(y, 2)` evaluates the two steps as a polynomial in
  E = Y - I: Z and the certificate equal stepping's, over the whole fast
  path domain (spectrum of Y in (0, 2)) and beyond it (p = 2.4)."""
  rng = np.random.default_rng(3)
  q, _ = np.linalg.qr(rng.standard_normal((5, 6, 6)))
  spectra = np.stack([np.linspace(lo, hi, 6) for lo, hi in
                      [(0.99, 1.01), (0.5, 1.5), (0.05, 1.95), (0.9, 2.4),
                       (1.0, 1.0)]])
  y = jnp.asarray(q @ (spectra[..., None] * np.swapaxes(q, -1, -2)))
  z, cert = newton_schulz._newton_schulz_fixed(y, 2)
  z_ref, res = _stepped(y, 2)
  _, cert_ref = newton_schulz._residual_bounds(res)
  err = certificate("geometry: two Newton–Schulz steps, polynomial vs stepped",
                    rel(z, z_ref))
  assert err <= 1e-14
  np.testing.assert_allclose(cert, cert_ref, rtol=1e-10, atol=1e-30)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fast_path_certificate_passes_on_its_domain(dtype, certificate,
                                                    frames, normal):
  """On the fast path's domain (orthonormal W, tangent ||xi||_F <= delta) the
  certificate always passes, with margin, for the worst-case rank-one step
  and a generic one: the fallback never runs there. The counts are
  `newton_schulz_steps` at the dtype's tol (float64, delta = 2: one more)."""
  with jax.enable_x64(dtype == "float64"):
    dt = jnp.dtype(dtype)
    w = frames(40, (16, 4), dt)
    generic = so.geometry.project_tangent(w, normal(41, w.shape, dt))
    for delta in (0.01, 0.1, 0.5, 1.0, 2.0, 4.0):
      tol = newton_schulz.newton_schulz_tol(dt)
      for xi in (worst_tangent_step(w, delta),
                 delta * generic / jnp.linalg.norm(generic)):
        steps, ratio = fast_path_certificate(w, xi, delta)
        certificate(f"geometry: fast-path certificate / accepted ({dtype})",
                    ratio)
        assert ratio <= 0.9, (delta, ratio)
        extra = steps - so.newton_schulz_steps(delta, tol)
        assert extra == 0 or (extra == 1 and dtype == "float64"), extra


def test_fallback_step_counts():
  """The derived counts of the M-scaled iteration (docs/proofs.rst table) and
  the loop bounds; monotone in the condition number."""
  f32, f64 = jnp.float32, jnp.float64
  table = {f32: [7, 13, 18, 24, 30, 41], f64: [8, 14, 19, 25, 31, 42]}
  for dt, want in table.items():
    tol = newton_schulz.newton_schulz_accept_tol(dt, 64)
    got = [newton_schulz.newton_schulz_fallback_steps(k, 64, tol)
           for k in (1.0, 1e2, 1e4, 1e6, 1e8, 1e12)]
    assert got == want
  assert newton_schulz.newton_schulz_max_steps(f32, 64) == 26
  assert newton_schulz.newton_schulz_max_steps(f64, 64) == 52
  assert newton_schulz.newton_schulz_accept_tol(f32, 64) == pytest.approx(7.63e-6,
                                                                     rel=1e-3)
  with pytest.raises(ValueError, match="condition_number"):
    newton_schulz.newton_schulz_fallback_steps(0.5, 4, 1e-8)


def spread_frames(seed, batch, d, r, kappa):
  """Frames A = U diag(s) V^T with singular values from 1 to kappa
  (log-uniform inside, both ends attained) times a random overall scale."""
  rng = np.random.default_rng(seed)
  u = np.linalg.qr(rng.standard_normal((batch, d, r)))[0]
  v = np.linalg.qr(rng.standard_normal((batch, r, r)))[0]
  s = np.exp(rng.uniform(0.0, math.log(kappa), (batch, r)))
  s[:, 0], s[:, -1] = 1.0, kappa
  s = s * np.exp(rng.uniform(-3.0, 3.0, (batch, 1)))
  return np.einsum("bdr,br,bsr->bds", u, s, v)


def test_fallback_certified_float64(x64, certificate):
  """Any full-rank W + xi lands on the manifold to <= 1e-12 in float64, for
  kappa(W + xi) up to 1e6; each pass takes no more steps than derived for
  kappa(M) = kappa^2, and the result is polar(W + xi) up to its conditioning
  (the error of a Gram-based factor grows like eps kappa^2)."""
  d, r = 8, 4
  tol = newton_schulz.newton_schulz_accept_tol(jnp.float64, r)
  max_steps = newton_schulz.newton_schulz_max_steps(jnp.float64, r)
  for kappa in (1.0, 1e2, 1e4, 1e6):
    a = jnp.asarray(spread_frames(int(kappa), 3, d, r, kappa))
    xi = 0.3 * so.geometry.project_tangent(jnp.asarray(np_polar_batch(a)), a)
    w = a - xi
    for radius in (None, 0.1):
      out = so.retract(w, xi, max_step_norm=radius)
      iso = float(jnp.max(so.isometry_error(out)))
      certificate("geometry: fallback isometry, kappa <= 1e6 (f64)", iso)
      assert iso <= 1e-12, (kappa, iso)
      assert rel(out, np_polar_batch(a)) <= 1e-14 * kappa ** 2 + F64_NS
    _, steps, _ = newton_schulz.inv_sqrt_newton_schulz(
        arrays.gram(a), math.sqrt(tol), max_steps=max_steps)
    assert int(steps) <= newton_schulz.newton_schulz_fallback_steps(
        kappa ** 2, r, math.sqrt(tol))


def test_retract_defaults_are_sized_for_the_step(frames, normal):
  """||xi||_F = 3 at the defaults (run-time count) and under a radius that
  is too small (certificate fails, fallback): float32 rounding either way,
  the exact polar retraction. At HEAD the defaults gave isometry 3.5e-4."""
  w = frames(42, (3, 8, 4))
  xi = so.geometry.project_tangent(w, normal(43, w.shape))
  xi = 3.0 * xi / arrays.frame_norm(xi)[:, None, None]
  exact = so.retract(w, xi, "eigh")
  for kwargs in ({}, {"max_step_norm": 1.0}, {"max_step_norm": 0.1}):
    out = so.retract(w, xi, **kwargs)
    assert float(jnp.max(so.isometry_error(out))) <= 3e-6, kwargs
    assert rel(out, exact) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_non_orthonormal_w_lands_on_the_manifold(dtype, frames, normal):
  """W three times a frame (a kernel at 3x the Flax default scale) with a
  small tangent step: the fixed iteration alone diverges (p = 9 > 3), the
  certificate catches it, the result is polar(W + xi)."""
  with jax.enable_x64(dtype == "float64"):
    dt = jnp.dtype(dtype)
    base = frames(44, (3, 8, 4), dt)
    w = 3.0 * base + 0.3 * normal(45, base.shape, dt)
    xi = 0.05 * so.geometry.project_tangent(base, normal(46, base.shape, dt))
    raw = so.retract(w, xi, max_step_norm=0.1,
                     num_steps=so.newton_schulz_steps(0.1))
    # What the fixed count alone returns (HEAD's retraction): far off.
    assert float(jnp.min(so.isometry_error(raw))) > 1.0
    exact = np_polar_batch(w + xi)
    tol = 3e-6 if dtype == "float32" else F64_NS
    for out in (so.retract(w, xi, max_step_norm=0.1), so.retract(w, xi),
                so.polar(w + xi, "newton_schulz")):
      assert out.dtype == dt
      assert float(jnp.max(so.isometry_error(out))) <= tol
      assert rel(out, exact) <= (1e-5 if dtype == "float32" else 1e-13)


def test_rank_deficient_frames_stay_finite(frames, normal):
  """A zero head (W + xi = 0) and a rank-two frame with a zero column: no
  NaN or Inf, whatever path runs; the full-rank frame of the batch is still
  retracted to rounding, the zero head stays zero."""
  w = frames(47, (3, 8, 4))
  xi = 0.05 * so.geometry.project_tangent(w, normal(48, w.shape))
  w, xi = w.at[1].set(0.0), xi.at[1].set(0.0)                 # zero head
  low = normal(49, (8, 2)) @ normal(50, (2, 4))
  w, xi = w.at[2].set(low.at[:, 1].set(0.0)), xi.at[2].set(0.0)
  for out in (so.retract(w, xi), so.retract(w, xi, max_step_norm=0.1),
              so.retract(w, xi, tangent=False),
              so.polar(w + xi, "newton_schulz")):
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.max(jnp.abs(out))) <= 10.0
    assert float(so.isometry_error(out[0])) <= 3e-6
    assert float(jnp.max(jnp.abs(out[1]))) == 0.0


def test_retract_under_vmap_equals_batched(frames, normal):
  """Under jax.vmap the cond is a select (both branches run): same result."""
  w = frames(49, (3, 8, 4))
  w = w.at[0].multiply(3.0)                   # one frame needs the fallback
  xi = 0.05 * so.geometry.project_tangent(w, normal(50, w.shape))
  batched = so.retract(w, xi, max_step_norm=0.1)
  mapped = jax.vmap(lambda a, b: so.retract(a, b, max_step_norm=0.1))(w, xi)
  assert rel(mapped, batched) <= 1e-6
  assert float(jnp.max(so.isometry_error(mapped))) <= 3e-6


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_leaves_of_one_shape_share_one_fallback(wrap, frames, normal):
  """`retraction.retracted` checks a tree's leaves together: two leaves of
  one shape share one fallback, whose loops appear once in the program
  (as for a single leaf), and every leaf's result is bit for bit the one
  `retract` gives it alone, whether it took the fallback (a start at 3x
  the manifold), a mix of both (one frame of the batch off), or the fast
  path."""
  from stiefel_optax import retraction
  w = {"a": 3.0 * frames(51, (3, 8, 4)),
       "b": frames(52, (3, 8, 4)).at[1].multiply(3.0),
       "c": frames(53, (3, 8, 4)), "d": frames(54, (2, 8, 4))}
  xi = {k: 0.05 * so.geometry.project_tangent(v, normal(55, v.shape))
        for k, v in w.items()}
  tree = wrap(lambda xi, w: retraction.retracted(xi, w, "newton_schulz",
                                                 0.1))(xi, w)
  for k in w:
    alone = so.retract(w[k], xi[k], max_step_norm=0.1)
    np.testing.assert_array_equal(np.asarray(tree[k]), np.asarray(alone),
                                  err_msg=k)
    assert float(jnp.max(so.isometry_error(tree[k]))) <= 3e-6, k
  # The fallback's loops (a fori_loop of passes around the iteration's
  # while loop) once per group in the compiled program (XLA inlines each
  # call of a function, so per-leaf fallbacks would be copies): "a", "b",
  # "c" make one group, "d" another.
  loops = lambda f, *args: len(re.findall(
      r"\bwhile\(", jax.jit(f).lower(*args).compile().as_text()))
  per_group = loops(lambda xi, w: so.retract(w, xi, max_step_norm=0.1),
                    xi["a"], w["a"])
  assert per_group >= 2
  assert loops(lambda xi, w: retraction.retracted(
      xi, w, "newton_schulz", 0.1), xi, w) == 2 * per_group


def test_retract_takes_the_callers_step_norm():
  """`retract(..., step_norm=n)` with n = ||xi||_F equals the retraction
  that measures xi itself; a wrong n (or one of the wrong shape) is caught:
  the certificate sends it to the fallback, the shape check raises."""
  w = frames(43, (3, 16, 4))
  xi = 0.1 * so.geometry.project_tangent(w, normal(44, w.shape))
  own = geometry.retract(w, xi, max_step_norm=0.5)
  given = geometry.retract(w, xi, max_step_norm=0.5,
                           step_norm=arrays.frame_norm(xi))
  assert rel(given, own) < 1e-6
  off = geometry.retract(w, 10.0 * xi, max_step_norm=0.5,
                         step_norm=jnp.zeros(3))       # far too small
  assert float(jnp.max(so.isometry_error(off))) < 1e-5
  assert rel(off, geometry.retract(w, 10.0 * xi, "eigh")) < 1e-5
  with pytest.raises(ValueError, match="step_norm"):
    geometry.retract(w, xi, step_norm=jnp.zeros(2))


def test_retract_float64_scale_is_consistent(x64):
  """A float64 retraction lands on St(d, r) to float64 rounding when the
  caller's step norm comes from a float32 learning rate (an optax schedule
  under x64), as in `stiefel_adam`'s one-pass update. The Newton–Schulz
  scale c enters Y = M/c and the unscale rsqrt(c); XLA recomputed c in
  each fusion, from copies of the float32 schedule value that differed by
  one ulp (an FMA in one kernel, none in the other, under the suite's
  XLA flags, conftest.py), so the frame came back 1.3e-9 off the manifold
  under a passed certificate (counts 1 and 2 of this schedule are the
  ones whose two roundings differ). float64 now measures xi itself, so a
  caller's norm cannot move the result at all, under any flags: a wrong
  one (0.06 for 0.0858) gives the same frame bit for bit."""
  w = so.random_frames(jax.random.key(0), (2, 8, 4), jnp.float64)
  g = geometry.project_tangent(
      w, jax.random.normal(jax.random.key(1), w.shape, jnp.float64))
  unit = g / arrays.frame_norm(g)[..., None, None]
  schedule = optax.linear_schedule(0.3, 0.02, 20)       # float32 under x64

  @jax.jit
  def step(count, norm):
    s = -0.3 * schedule(count) * jnp.ones(2, jnp.float64)   # |s| < 0.1
    xi = unit * s[..., None, None]
    return (geometry.retract(w, xi, max_step_norm=0.1, step_norm=jnp.abs(s)),
            geometry.retract(w, xi, max_step_norm=0.1, step_norm=norm))

  from_lr, off = step(jnp.int32(1), jnp.full(2, 0.06))    # |s| = 0.0858
  accept = newton_schulz.newton_schulz_accept_tol(jnp.float64, 4)
  assert float(jnp.max(so.isometry_error(from_lr))) <= accept
  np.testing.assert_array_equal(off, from_lr)


# ---------------------------------------------------------------------------
# Errors naming the shape


BAD_SHAPES = [((5,), "rank >= 2"), ((), "rank >= 2"), ((3, 4), r"\(3, 4\)"),
              ((2, 2, 5), r"\(2, 2, 5\)")]


@pytest.mark.parametrize("shape,match", BAD_SHAPES)
def test_bad_shapes_raise(shape, match):
  x = jnp.ones(shape)
  for fn in (lambda: so.geometry.project_tangent(x, x), lambda: so.polar(x),
             lambda: so.retract(x, x), lambda: so.isometry_error(x),
             lambda: so.random_frames(jax.random.key(0), shape)):
    with pytest.raises(ValueError, match=match):
      fn()


def test_mismatched_shapes_name_both(frames, normal):
  """No silent broadcasting: a (8, 1) gradient of a (8, 3) frame, a step of
  another shape, A^T B with different rows; the error names both shapes
  and the public function."""
  w = frames(51, (8, 3))
  cases = [
      (lambda: so.geometry.project_tangent(w, normal(52, (8, 1))), "project_tangent",
       [r"\(8, 3\)", r"\(8, 1\)"]),
      (lambda: so.geometry.project_tangent(w, normal(52, (2, 8, 3))), "project_tangent",
       [r"\(8, 3\)", r"\(2, 8, 3\)"]),
      (lambda: so.retract(w, normal(53, (8, 2))), "retract",
       [r"\(8, 3\)", r"\(8, 2\)"]),
      (lambda: so.retract(w, normal(53, (8, 2)), "eigh"), "retract",
       [r"\(8, 3\)", r"\(8, 2\)"]),
      (lambda: arrays.gram(w, normal(54, (7, 3))), "gram",
       [r"\(8, 3\)", r"\(7, 3\)"]),
      (lambda: so.geometry.sym(w), "sym", [r"\(8, 3\)"]),
      (lambda: arrays.frame_norm(jnp.ones(5)), "frame_norm", [r"\(5,\)"]),
  ]
  for fn, name, shapes in cases:
    with pytest.raises(ValueError) as info:
      fn()
    msg = str(info.value)
    assert msg.startswith(name + ":"), msg
    for shape in shapes:
      assert re.search(shape, msg), (shape, msg)
  # gram of frames with different column counts is A^T B, (3, 2).
  assert arrays.gram(w, normal(55, (8, 2))).shape == (3, 2)


def test_bad_method_raises(frames):
  w = frames(17, (4, 2))
  with pytest.raises(ValueError, match="svd"):
    so.polar(w, method="svd")
  with pytest.raises(ValueError, match="svd"):
    so.retract(w, w, method="svd")


# ---------------------------------------------------------------------------
# Properties (hypothesis): projection


@functools.partial(jax.jit, static_argnames=("method",))
def retract(w, xi, method):
  return so.retract(w, xi, method)


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
# Properties (hypothesis): retraction


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
  cdtype = arrays.compute_dtype(dtype)
  ceps = float(jnp.finfo(cdtype).eps)
  tol = newton_schulz.newton_schulz_accept_tol(cdtype, r) if (
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
    cdtype = arrays.compute_dtype(dtype)
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
# Safe on any input (hypothesis)


# The `certificate` fixture is a stateless recorder: safe to share between
# the examples of one test.
RECORDING = settings(SETTINGS, suppress_health_check=[
    HealthCheck.function_scoped_fixture])


SAFE_SHAPES = [(3, 8, 4)]                 # (batch, d, r)


RADII = [None, 0.1, 1.0]                  # retract's max_step_norm


def iso(x):
  """Largest ||X^T X - I||_F of the batch, measured in float64."""
  x = np.asarray(x, np.float64)
  gram = np.swapaxes(x, -1, -2) @ x
  return float(np.max(np.linalg.norm(gram - np.eye(x.shape[-1]),
                                     axis=(-2, -1))))


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
  shape = draw(st.sampled_from(SAFE_SHAPES))
  kappa = 10.0 ** draw(st.floats(0.0, max_log_kappa))
  scale = 10.0 ** draw(st.floats(-3.0, 3.0))
  step = draw(st.floats(0.0, 10.0))
  radius = draw(st.sampled_from(RADII))
  return shape, kappa, scale, step, radius, draw(st.integers(0, 2**31 - 1))


# ---------------------------------------------------------------------------
# Safe on any input: full-rank starts that are not orthonormal


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
    tol = math.sqrt(newton_schulz.newton_schulz_accept_tol(jnp.float64, r))
    _, steps, _ = newton_schulz.inv_sqrt_newton_schulz(
        arrays.gram(a), tol,
        max_steps=newton_schulz.newton_schulz_max_steps(jnp.float64, r))
    assert int(steps) <= newton_schulz.newton_schulz_fallback_steps(
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
# Safe on any input: rank-deficient frames


@SETTINGS
@given(st.sampled_from(SAFE_SHAPES), st.sampled_from(["float32", "float64"]),
       st.sampled_from(["zero head", "zero column", "low rank"]),
       st.floats(-3.0, 3.0), st.sampled_from(RADII), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_rank_deficient_frames_stay_finite_on_every_path(
    shape, dtype, kind, log_scale, radius, tangent_step, seed):
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
  ctx, dt, _ = precision(dtype)
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
# Safe on any input: long steps from an orthonormal frame


@SETTINGS
@given(st.sampled_from(SAFE_SHAPES), st.sampled_from(["float32", "float64"]),
       st.floats(0.0, 10.0), st.sampled_from(RADII), st.integers(0, 2**31 - 1))
def test_long_tangent_steps_under_any_radius(shape, dtype, step, radius, seed):
  """Orthonormal W, tangent ||xi||_F up to 10, radius smaller or larger than
  the step (or none): exactly the eigh retraction, on the manifold to the
  dtype's rounding; also through `retract_polar` and `optax.apply_updates`."""
  rng = np.random.default_rng(seed)
  w = np.linalg.qr(rng.standard_normal(shape))[0]
  xi = tangent(rng, w, step)
  ctx, dt, _ = precision(dtype)
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
# Safe on any input: shapes that do not agree


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
      arrays.gram(w, g)
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


def test_newton_schulz_and_arrays_sit_below_geometry():
  """The Newton–Schulz machinery lives in stiefel_optax.newton_schulz, the
  array primitives in stiefel_optax.arrays, and the library calls them
  there: every `geometry.X` in the library's code names a function geometry
  defines itself. `geometry.gram` and `geometry.frame_norm` (which geometry
  uses, and which the documentation names) are arrays' objects. Neither
  lower module imports geometry (no import cycle)."""
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  assert geometry.gram is arrays.gram
  assert geometry.frame_norm is arrays.frame_norm
  assert so.newton_schulz_steps is newton_schulz.newton_schulz_steps
  package = pathlib.Path(geometry.__file__).parent
  own = {n.name for n in ast.parse(pathlib.Path(geometry.__file__)
                                    .read_text()).body
         if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
  own |= {t.id for n in ast.parse(pathlib.Path(geometry.__file__).read_text())
          .body if isinstance(n, ast.Assign) for t in n.targets
          if isinstance(t, ast.Name)}
  through = sorted(
      f"{path.name}: geometry.{n.attr}" for path in package.rglob("*.py")
      for n in ast.walk(ast.parse(path.read_text()))
      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
      and n.value.id == "geometry" and n.attr not in own)
  assert not through, through
  for module in (arrays, newton_schulz):
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
    assert not any("geometry" in m for m in imported), (module, imported)
    assert module is arrays or "stiefel_optax.arrays" in imported
