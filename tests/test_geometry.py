"""Geometry of St(d, r): projection, polar factor, retraction, Newton–Schulz.

Shapes are tiny (d <= 16, r <= 4). float64 checks run under the `x64`
fixture; float32 checks use the default precision.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stiefel_optax import geometry
import stiefel_optax as so


# float64 Newton–Schulz is sized for `newton_schulz_tol(float64)` ~ 1.1e-15
# per eigenvalue of Q^T Q (sqrt(r) tol = 2.2e-15 for r = 4) and certified at
# `newton_schulz_accept_tol` (8 sqrt(r) eps = 3.6e-15 for r = 4); the
# measurement itself rounds at a few 1e-16. This is the level promised.
F64_NS = 1e-14


def rel(a, b):
  """||a - b||_F / ||b||_F over the whole array, as a float."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def np_polar(a):
  """polar(A) = U V^T from a float64 SVD A = U S V^T (reference)."""
  u, _, vt = np.linalg.svd(np.asarray(a, np.float64), full_matrices=False)
  return u @ vt


def np_polar_batch(a):
  return np.stack([np_polar(x) for x in np.asarray(a)])


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
  """Both forms of A^T B (`geometry.gram` takes the materialised one on
  CPU, the contraction elsewhere) match NumPy to rounding, jitted, vmapped
  and differentiated (the optimization barrier has autodiff rules)."""
  dtype = jnp.dtype(dtype)
  a = normal(7, (3, 16, 4)).astype(dtype)
  b = normal(8, (3, 16, 5)).astype(dtype)
  want = np.einsum("bdr,bds->brs", np.asarray(a, np.float64),
                   np.asarray(b, np.float64))
  tol = 1e-5 if dtype == jnp.float32 else 1e-12
  for fn in (geometry.gram, geometry._gram_cpu, geometry._gram_contraction):  # pylint: disable=protected-access
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
      float(jnp.max(geometry.frame_norm(skew + jnp.swapaxes(skew, -1, -2)))
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
    xi = xi0 * (delta / geometry.frame_norm(xi0))[:, None, None]
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
    assert geometry.newton_schulz_residual(d * d, k) <= 1e-8
    if k > 1:
      assert geometry.newton_schulz_residual(d * d, k - 1) > 1e-8


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
  for tol in (1e-8, geometry.newton_schulz_tol(jnp.float64)):
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
          assert geometry.newton_schulz_residual(delta ** 2, steps) > tol
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
  tol, accept = (geometry.newton_schulz_tol(cdtype),
                 geometry.newton_schulz_accept_tol(cdtype, r))
  steps = geometry._fast_path_steps(delta, tol, accept, r, True)
  c = 1.0 + jnp.sum(jnp.square(xi)) / 2.0
  _, cert = geometry._newton_schulz_fixed(geometry.gram(w + xi) / c, steps)
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
  z, cert = geometry._newton_schulz_fixed(y, 2)
  z_ref, res = _stepped(y, 2)
  _, cert_ref = geometry._residual_bounds(res)
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
      tol = geometry.newton_schulz_tol(dt)
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
    tol = geometry.newton_schulz_accept_tol(dt, 64)
    got = [geometry.newton_schulz_fallback_steps(k, 64, tol)
           for k in (1.0, 1e2, 1e4, 1e6, 1e8, 1e12)]
    assert got == want
  assert geometry.newton_schulz_max_steps(f32, 64) == 26
  assert geometry.newton_schulz_max_steps(f64, 64) == 52
  assert geometry.newton_schulz_accept_tol(f32, 64) == pytest.approx(7.63e-6,
                                                                     rel=1e-3)
  with pytest.raises(ValueError, match="condition_number"):
    geometry.newton_schulz_fallback_steps(0.5, 4, 1e-8)


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
  tol = geometry.newton_schulz_accept_tol(jnp.float64, r)
  max_steps = geometry.newton_schulz_max_steps(jnp.float64, r)
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
    _, steps, _ = geometry.inv_sqrt_newton_schulz(
        geometry.gram(a), math.sqrt(tol), max_steps=max_steps)
    assert int(steps) <= geometry.newton_schulz_fallback_steps(
        kappa ** 2, r, math.sqrt(tol))


def test_retract_defaults_are_sized_for_the_step(frames, normal):
  """||xi||_F = 3 at the defaults (run-time count) and under a radius that
  is too small (certificate fails, fallback): float32 rounding either way,
  the exact polar retraction. At HEAD the defaults gave isometry 3.5e-4."""
  w = frames(42, (3, 8, 4))
  xi = so.geometry.project_tangent(w, normal(43, w.shape))
  xi = 3.0 * xi / geometry.frame_norm(xi)[:, None, None]
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
      (lambda: geometry.gram(w, normal(54, (7, 3))), "gram",
       [r"\(8, 3\)", r"\(7, 3\)"]),
      (lambda: so.geometry.sym(w), "sym", [r"\(8, 3\)"]),
      (lambda: geometry.frame_norm(jnp.ones(5)), "frame_norm", [r"\(5,\)"]),
  ]
  for fn, name, shapes in cases:
    with pytest.raises(ValueError) as info:
      fn()
    msg = str(info.value)
    assert msg.startswith(name + ":"), msg
    for shape in shapes:
      assert re.search(shape, msg), (shape, msg)
  # gram of frames with different column counts is A^T B, (3, 2).
  assert geometry.gram(w, normal(55, (8, 2))).shape == (3, 2)


def test_bad_method_raises(frames):
  w = frames(17, (4, 2))
  with pytest.raises(ValueError, match="svd"):
    so.polar(w, method="svd")
  with pytest.raises(ValueError, match="svd"):
    so.retract(w, w, method="svd")
