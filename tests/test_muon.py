"""`stiefel_muon` and its transforms (stiefel_optax/muon.py): float64 certificates of the polar factor, the tangent step
and its norm bounds, scale freedom and O(d)-equivariance; float32
convergence on tr(W^T A W); the schedule's convergence by interval
arithmetic. Transforms run with and without jit (`variant` fixture).
The module's docstring examples run as the suite's doctests
(`--doctest-modules` over stiefel_optax/, pyproject.toml).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stiefel_optax import geometry, muon

from tests.helpers import (
    haar_reflection, np_polar, np_project, quadratic, rel, runner)

TOL = 1e-12
RETRACTIONS = geometry.RETRACTIONS
SHAPE = (2, 8, 4)                    # two frames in St(8, 4)


def gram(a, b=None):
  b = a if b is None else b
  return jnp.einsum("...di,...dj->...ij", a, b)


def tangent_error(w, d):
  """||W^T D + D^T W||_F / ||D||_F per frame (max)."""
  wtd = gram(w, d)
  return float(jnp.max(jnp.linalg.norm(wtd + jnp.swapaxes(wtd, -1, -2),
                                       axis=(-2, -1))
                       / jnp.linalg.norm(d, axis=(-2, -1))))


def with_singular_values(seed, d, sv, dtype=np.float64):
  """A d x len(sv) matrix with singular values sv (Haar singular vectors)."""
  rng = np.random.default_rng(seed)
  r = len(sv)
  u, _ = np.linalg.qr(rng.standard_normal((d, r)))
  v, _ = np.linalg.qr(rng.standard_normal((r, r)))
  return jnp.asarray(((u * np.asarray(sv)) @ v.T).astype(dtype))


# ---------------------------------------------------------------------------
# The coefficient schedule


def scalar_map(sigma, num_steps, coefficients=None):
  """The singular-value map of `msign` on x = sigma / ||X||_F (float64)."""
  x = np.asarray(sigma, np.float64) / 1.01
  for a, b, c in coefficients or muon.msign_coefficients(num_steps):
    x = a * x + b * x ** 3 + c * x ** 5
  return x


def poly_range(abc, lo, hi):
  """[min, max] of a x + b x^3 + c x^5 over [lo, hi] (critical points)."""
  a, b, c = abc
  xs = [lo, hi]
  disc = 9 * b * b - 20 * a * c
  if disc >= 0:
    for sgn in (1.0, -1.0):
      y = (-3 * b + sgn * np.sqrt(disc)) / (10 * c)
      if y > 0 and lo < np.sqrt(y) < hi:
        xs.append(np.sqrt(y))
  vals = [a * x + b * x ** 3 + c * x ** 5 for x in xs]
  return min(vals), max(vals)


def test_schedule_converges_by_interval_arithmetic(certificate):
  """Every Polar Express step is positive on the interval its inputs can
  occupy, after the seven steps all singular values lie in (0, 1), and the
  Newton–Schulz tail is monotone with q(x) > x on (0, 1): the iteration
  converges for every nonzero singular value. The documented thresholds
  (docs/proofs.rst, 10 steps) hold; Muon's fixed polynomial, the control,
  does not converge."""
  coeffs = muon.msign_coefficients(7)
  assert coeffs == muon.POLAR_EXPRESS_COEFFICIENTS
  lo, hi = 1e-30, 1.0 / 1.01
  for abc in coeffs:
    lo, hi = poly_range(abc, lo, hi)
    assert lo > 0                      # no singular value reaches 0
  assert hi < 1.0                      # all in (0, 1) for the tail
  a, b, c = muon.NEWTON_SCHULZ_QUINTIC
  x = np.linspace(1e-6, 1 - 1e-6, 10001)
  q = a * x + b * x ** 3 + c * x ** 5
  assert np.all(q > x) and np.all(np.diff(q) > 0) and a + b + c == 1.0
  # Thresholds of the module docstring (float64 rows; tol 1e-16 was found
  # in exact arithmetic, here float64 rounding adds a few ulp).
  sigma = np.geomspace(1e-7, 1.0, 20001)
  for steps, tau in ((9, 6.0e-4), (10, 3.3e-4), (12, 9.3e-5), (16, 7.6e-6)):
    err = np.abs(1 - scalar_map(sigma, steps))
    above = certificate(f"stiefel_muon: msign scalar map, {steps} steps,"
                        " sigma/|X|_F >= tau", err[sigma >= tau].max())
    assert above <= 1e-15, steps
    assert err[sigma <= tau / 3].min() > 1e-8, steps   # tau is not loose
  # float32 row (tol 1e-7) at the default 10 steps.
  assert np.abs(1 - scalar_map(sigma, 10))[sigma >= 2.1e-4].max() <= 1e-7
  # Control: Muon's (3.4445, -4.775, 2.0315) plateaus far from 1.
  jordan = [(3.4445, -4.775, 2.0315)] * 30
  assert np.abs(1 - scalar_map(sigma[sigma > 1e-2], 0, jordan)).max() > 0.2


# ---------------------------------------------------------------------------
# msign


@pytest.mark.parametrize("shape,method", [
    ((8, 4), "polar_express"), ((16, 16), "polar_express"),
    ((2, 3, 12, 5), "polar_express"), ((16, 16), "eigh"),
    ((2, 3, 12, 5), "eigh")])
def test_msign_is_the_polar_factor(shape, method, x64, normal, certificate):
  """msign(X) = U V^T of the SVD and U^T U = I for full-rank X, float64."""
  x = normal(20, shape)
  u = muon.msign(x, method=method)
  assert u.shape == x.shape and u.dtype == x.dtype
  eye = np.eye(shape[-1])
  ortho = certificate(f"stiefel_muon: msign U^T U = I ({method})",
                      np.abs(np.asarray(gram(u)) - eye).max())
  match = certificate(f"stiefel_muon: msign vs SVD polar ({method})",
                      rel(u, np_polar(x)))
  # eigh squares the condition number (16 x 16 Gaussian: kappa ~ 100).
  assert ortho <= TOL and match <= (TOL if method == "polar_express" else 1e-11)


def test_msign_rank_deficient_zero_and_scale(x64, normal, certificate):
  """Zero singular values stay zero (U_k V_k^T), msign(0) = 0 exactly (no
  NaN), msign(c X) = msign(X) for c from 1e-300 to 1e300. A rank-deficient
  X formed in floating point has rounding-level singular values, which
  grow by at most g = 2.2e4 (docs/proofs.rst): error <= g eps sqrt(r)."""
  exact = jnp.concatenate([normal(21, (8, 2)), jnp.zeros((8, 2))], axis=1)
  err = certificate("stiefel_muon: msign exact rank 2 vs SVD",
                    rel(muon.msign(exact), np_polar(exact)))
  assert err <= TOL
  x = normal(21, (8, 2)) @ normal(22, (2, 4))           # rank 2 + rounding
  err = certificate("stiefel_muon: msign rounded rank 2 vs SVD (<= g eps)",
                    rel(muon.msign(x), np_polar(x)))
  assert err <= 2.2e4 * np.finfo(np.float64).eps * 2
  for method in muon.MSIGN_METHODS:
    assert rel(muon.msign(x, method=method), np_polar(x)) <= 1e-10
    zero = muon.msign(jnp.zeros((3, 8, 4)), method=method)
    assert not np.any(np.isnan(zero)) and float(jnp.max(jnp.abs(zero))) == 0
  x = normal(23, (8, 4))
  base = muon.msign(x)
  for c in (1e-300, 1e-3, 7.5, 1e300):
    err = certificate("stiefel_muon: msign(cX) = msign(X)",
                      rel(muon.msign(c * x), base))
    assert err <= TOL, c


def test_msign_float32_range_and_zero(normal):
  """float32: no overflow or underflow in ||X||_F (X scaled by max |x|
  first), zero gives zero."""
  x = normal(24, (8, 4))
  f = muon.msign
  base = f(x)
  assert float(jnp.max(jnp.abs(gram(base) - jnp.eye(4)))) <= 1e-6
  for c in (1e-30, 1e30):
    assert rel(f(c * x), base) <= 1e-6, c
  assert float(jnp.max(jnp.abs(f(jnp.zeros((8, 4)))))) == 0.0
  u16 = f(x.astype(jnp.bfloat16))
  assert u16.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype,tau,tol", [(np.float64, 3.3e-4, 1e-12),
                                           (np.float32, 2.1e-4, 1e-6)])
def test_msign_small_singular_value_threshold(dtype, tau, tol, x64,
                                              certificate):
  """The documented threshold at the default 10 steps: a singular value
  with sigma / ||X||_F >= tau maps to 1 (to rounding); at tau / 3 it does
  not (partly orthogonalised). Measured on matrices, not the scalar map."""
  head = np.array([1.0, 0.6, 0.3])
  for ratio, converged in ((tau, True), (tau / 3, False)):
    small = ratio * np.linalg.norm(head) / np.sqrt(1 - ratio ** 2)
    x = with_singular_values(25, 12, np.append(head, small), dtype)
    u = muon.msign(x)
    assert u.dtype == dtype
    sv = np.linalg.svd(np.asarray(u, np.float64), compute_uv=False)
    err = np.abs(sv - 1).max()
    if converged:
      name = "float32" if dtype == np.float32 else "float64"
      err = certificate(f"stiefel_muon: msign sigma >= tau -> 1 ({name})",
                        err)
      assert err <= tol
    else:
      assert err > 1e-4


# ---------------------------------------------------------------------------
# The direction and its bounds


def test_direction_is_tangent_and_obeys_the_bounds(x64, frames, normal,
                                                   certificate):
  """D = P_W(msign(m)) for tangent m: W^T D + D^T W = 0, ||D||_F <= sqrt(r),
  1 <= ||D||_2 <= 2/sqrt(3) (r = 1: = 1), <D, m> = ||m||_* > 0, over random
  frames and momenta of several conditionings."""
  worst_ratio = 0.0
  for d, r in ((8, 4), (5, 2), (6, 1), (4, 4)):
    n = 64
    w = frames(30 + r, (n, d, r))
    scales = np.geomspace(1.0, 0.1, r)           # unequal column scales
    m = geometry.project_tangent(w, normal(40 + r, (n, d, r)) * scales)
    dirn = muon.tangent_msign(w, m)
    err = certificate("stiefel_muon: direction tangent", tangent_error(w, dirn))
    assert err <= TOL
    dn = np.asarray(dirn)
    spec = np.linalg.norm(dn, 2, axis=(-2, -1))
    frob = np.linalg.norm(dn, axis=(-2, -1))
    bound = muon.SPECTRAL_BOUND if r > 1 else 1.0
    assert spec.max() <= bound * (1 + TOL) and spec.min() >= 1 - TOL
    assert frob.max() <= np.sqrt(r) * (1 + TOL)
    if r > 1:
      worst_ratio = max(worst_ratio, spec.max() / bound)
    nuclear = np.linalg.svd(np.asarray(m), compute_uv=False).sum(-1)
    err = certificate("stiefel_muon: <D, m> = ||m||_*",
                      np.max(np.abs(np.sum(dn * np.asarray(m), (-2, -1))
                                    - nuclear) / nuclear))
    assert err <= TOL
  # Random momenta come close to the bound: it is not loose.
  assert worst_ratio > 0.98


def test_spectral_bound_is_attained(x64, frames, certificate):
  """W = [w1, w2], w3 normal to W: X = U diag(3, 1) with
  U = [-w2/3 + sqrt(8/9) w3, w1] is tangent, msign(X) = U, and
  ||P_W(U)||_2 = 2/sqrt(3) exactly."""
  basis = frames(50, (5, 3))
  w, w3 = basis[:, :2], basis[:, 2]
  u = jnp.stack([-w[:, 1] / 3 + np.sqrt(8 / 9) * w3, w[:, 0]], axis=1)
  x = u @ jnp.diag(jnp.array([3.0, 1.0]))
  assert tangent_error(w, x) <= TOL
  assert rel(muon.msign(x), u) <= TOL
  spec = float(np.linalg.norm(np.asarray(muon.tangent_msign(w, x)), 2))
  err = certificate("stiefel_muon: ||D||_2 = 2/sqrt(3) attained",
                    abs(spec / muon.SPECTRAL_BOUND - 1))
  assert err <= TOL


# ---------------------------------------------------------------------------
# The transform


def test_scale_by_tangent_msign_state_and_steps(variant, x64, frames, normal,
                                                certificate):
  """State: mu like the params. Three steps (the frame moving in between)
  equal the NumPy reference m = b1 P_W(m) + (1 - b1) g,
  D = P_W(polar(n)) with and without Nesterov; mu_dtype is honoured."""
  ws = [frames(60 + k, SHAPE) for k in range(3)]
  gs = [geometry.project_tangent(w, normal(70 + k, SHAPE))
        for k, w in enumerate(ws)]
  for nesterov in (True, False):
    tx = muon.scale_by_tangent_msign(b1=0.9, nesterov=nesterov)
    state = tx.init(ws[0])
    assert isinstance(state, muon.ScaleByTangentMsignState)
    assert state.mu.shape == SHAPE and state.mu.dtype == ws[0].dtype
    update = variant(tx.update)
    m = np.zeros(SHAPE)
    for w, g in zip(ws, gs):
      d, state = update(g, state, w)
      w_, g_ = np.asarray(w), np.asarray(g)
      m = 0.9 * np_project(w_, m) + 0.1 * g_
      n = 0.9 * m + 0.1 * g_ if nesterov else m
      ref = np_project(w_, np_polar(n))
      err = certificate("stiefel_muon: scale_by_tangent_msign vs reference",
                        max(rel(d, ref), rel(state.mu, m)))
      assert err <= TOL, nesterov
  tx16 = muon.scale_by_tangent_msign(mu_dtype=jnp.bfloat16)
  d16, s16 = tx16.update(gs[0], tx16.init(ws[0]), ws[0])
  assert s16.mu.dtype == jnp.bfloat16 and d16.dtype == ws[0].dtype


def test_scale_by_tangent_msign_trees_and_bad_frames(variant, frames, normal):
  """A tree of float32 and bf16 leaves; a frame whose gradient holds a NaN
  keeps its momentum and gets a zero step, the others are unaffected; zero
  gradients give zero steps (not NaN)."""
  w = frames(80, (3, 8, 4))
  g = geometry.project_tangent(w, normal(81, (3, 8, 4)))
  params = {"a": w, "b": w[0].astype(jnp.bfloat16)}
  tx = muon.scale_by_tangent_msign()
  update = variant(tx.update)
  state = tx.init(params)
  d, state = update({"a": g, "b": g[0].astype(jnp.bfloat16)}, state, params)
  assert d["b"].dtype == jnp.bfloat16 and state.mu["b"].dtype == jnp.bfloat16
  mu_before = state.mu["a"]
  bad = g.at[1, 0, 0].set(jnp.nan)
  d, state = update({"a": bad, "b": g[0].astype(jnp.bfloat16)}, state, params)
  assert float(jnp.max(jnp.abs(d["a"][1]))) == 0.0
  assert np.array_equal(state.mu["a"][1], mu_before[1])
  assert np.all(np.isfinite(d["a"])) and float(jnp.min(
      jnp.linalg.norm(d["a"][jnp.array([0, 2])], axis=(-2, -1)))) > 0.5
  zero, _ = update(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                   params)
  assert all(float(jnp.max(jnp.abs(z))) == 0.0 for z in jax.tree.leaves(zero))


def test_errors_name_the_problem(frames):
  with pytest.raises(ValueError, match="num_steps"):
    muon.scale_by_tangent_msign(num_steps=0)
  with pytest.raises(ValueError, match="method"):
    muon.stiefel_muon(0.1, msign_method="svd")
  with pytest.raises(ValueError, match="max_step_norm"):
    muon.stiefel_muon(0.1, max_step_norm=0.0)
  tx = muon.stiefel_muon(0.1)
  with pytest.raises(ValueError, match=r"\['bad'\].*r = 8 columns > d = 4"):
    tx.init({"bad": jnp.zeros((4, 8))})
  with pytest.raises(ValueError, match="^stiefel_muon needs params"):
    tx.update(frames(0, (8, 4)), tx.init(frames(0, (8, 4))))
  # The update's shape is checked as the other transforms check it.
  msign_tx, w = muon.scale_by_tangent_msign(), {"w": frames(0, (8, 4))}
  with pytest.raises(ValueError, match=r"^scale_by_tangent_msign: parameter"
                     r" \['w'\] has shape \(8, 4\) but its update has shape"
                     r" \(8, 1\)"):
    msign_tx.update({"w": frames(1, (8, 1))}, msign_tx.init(w), w)
  with pytest.raises(ValueError, match="^stiefel_muon: msign_steps"):
    muon.stiefel_muon(0.1, msign_steps=0)
  with pytest.raises(ValueError, match="^stiefel_muon: retraction"):
    muon.stiefel_muon(0.1, retraction="svd")


# ---------------------------------------------------------------------------
# The optimizer


def reference_muon(w, grad_fn, steps, lr, b1, delta=None):
  """NumPy stiefel_muon (Nesterov), exact polar factors by SVD."""
  m, out = np.zeros_like(w), []
  for t in range(steps):
    g = np_project(w, grad_fn(w))
    m = b1 * np_project(w, m) + (1 - b1) * g
    xi = -lr(t) * np_project(w, np_polar(b1 * m + (1 - b1) * g))
    if delta is not None:
      n = np.linalg.norm(xi, axis=(-2, -1), keepdims=True)
      xi = xi * np.minimum(1.0, delta / n)
    w = np_polar(w + xi)
    out.append(w)
  return np.stack(out)


@pytest.mark.parametrize("retraction", RETRACTIONS)
def test_stiefel_muon_matches_reference(retraction, variant, x64, frames,
                                        certificate):
  """8 steps (2 without jit; a decaying learning-rate schedule; with and
  without a cap that binds on some steps) equal the NumPy reference."""
  a, b = quadratic(1)
  w0 = frames(2, SHAPE)
  lr = optax.exponential_decay(0.2, 1, 0.8)
  a_, b_ = np.asarray(a), np.asarray(b)
  steps = 8 if variant is jax.jit else 2        # eager dispatch is slow
  # None: the run-time Newton–Schulz count; 0.3: the fixed count.
  for delta in ((None, 0.3) if retraction == "newton_schulz" else (0.3,)):
    tx = muon.stiefel_muon(lr, b1=0.9, max_step_norm=delta,
                           retraction=retraction)
    state, w, got = tx.init(w0), w0, []
    update = variant(tx.update)
    for _ in range(steps):
      u, state = update(-a @ w + b, state, w)
      w = optax.apply_updates(w, u)
      got.append(w)
    ref = reference_muon(np.asarray(w0), lambda w: -a_ @ w + b_, steps,
                         lambda t: float(lr(jnp.int32(t))), 0.9, delta)
    err = certificate(f"stiefel_muon: vs reference ({retraction})",
                      rel(jnp.stack(got), ref))
    assert err <= TOL, delta
    if delta is not None and steps == 8:
      moves = np.linalg.norm(np.diff(ref, axis=0), axis=(-2, -1))
      assert moves.max() > 0.29 and moves.min() < 0.25     # cap binds sometimes


def test_step_norm_is_set_by_the_learning_rate(x64, frames):
  """Along a trajectory, the tangent step xi = -lr D (the chain before the
  retraction) has lr <= ||xi||_2 <= lr 2/sqrt(3) and ||xi||_F <= lr sqrt(r)
  at every gradient scale: a cap max_step_norm >= lr sqrt(r) never binds
  (it only fixes the Newton–Schulz step count)."""
  a, b = quadratic(3)
  w0 = frames(4, SHAPE)
  lr, r = 0.05, SHAPE[-1]
  tx = muon.stiefel_muon(lr)
  inner = optax.chain(muon.transforms.project_to_tangent(),
                      muon.scale_by_tangent_msign(),
                      optax.scale_by_learning_rate(lr))
  inner_update, update = jax.jit(inner.update), jax.jit(tx.update)
  for c in (1e-3, 1.0, 1e4):
    w, state = w0, tx.init(w0)
    for _ in range(10):
      g = c * (-a @ w + b)
      xi, _ = inner_update(g, tuple(state[:3]), w)
      assert tangent_error(w, xi) <= TOL
      spec = np.linalg.norm(np.asarray(xi), 2, axis=(-2, -1))
      frob = np.linalg.norm(np.asarray(xi), axis=(-2, -1))
      assert spec.max() <= lr * muon.SPECTRAL_BOUND * (1 + TOL)
      assert spec.min() >= lr * (1 - TOL)   # ||D||_2 >= 1
      assert frob.max() <= lr * np.sqrt(r) * (1 + TOL)
      u, state = update(g, state, w)
      w = optax.apply_updates(w, u)
  assert rel(w, w0) > 0.1                   # the frames moved


def test_scale_freedom_over_20_steps(x64, frames, certificate):
  """Gradients c G for c in {1e-3, 7.5, 1e4} give the same 20-step
  trajectory; the control, Riemannian SGD, does not."""
  a, b = quadratic(5)
  w0 = frames(6, SHAPE)
  run = runner(muon.stiefel_muon(optax.linear_schedule(0.2, 0.02, 20)))
  base = run(w0, a, b, 1.0)
  for c in (1e-3, 7.5, 1e4):
    err = certificate("stiefel_muon: scale freedom, 20 steps",
                      rel(run(w0, a, b, c), base))
    assert err <= TOL, c
  assert rel(base[-1], w0) > 0.3                  # the frames moved


def test_equivariance_over_20_steps(x64, frames, certificate):
  """For Q in O(d), det Q = -1: the trajectory from (QW, QG) is Q times the
  trajectory from (W, G)."""
  a, b = quadratic(7)
  w0 = frames(8, SHAPE)
  q = haar_reflection(9, SHAPE[-2])
  run = runner(muon.stiefel_muon(optax.linear_schedule(0.2, 0.02, 20),
                                 max_step_norm=0.3))
  base = run(w0, a, b, 1.0)
  rotated = run(q @ w0, q @ a @ q.T, q @ b, 1.0)
  err = certificate("stiefel_muon: O(d)-equivariance, 20 steps",
                    rel(rotated, q @ base))
  assert err <= TOL
  assert rel(base[-1], w0) > 0.3


def test_converges_to_the_top_eigenspace_float32(certificate):
  """Maximise tr(W^T A W) on St(8, 2), float32, learning rate 0.2 * 0.97^t
  for 300 steps, three random symmetric A: the objective reaches the sum of
  the top two eigenvalues of A to 1e-6 relative (measured in float64 at the
  polar factor of the float32 frame; to 1e-5 in float32 itself), and the
  frames stay on the manifold to 1e-5 at every step."""
  tx = muon.stiefel_muon(optax.exponential_decay(0.2, 1, 0.97))

  @jax.jit
  def run(w0, a):
    def body(carry, _):
      w, state = carry
      u, state = tx.update(-2.0 * a @ w, state, w)
      w = optax.apply_updates(w, u)
      return (w, state), geometry.isometry_error(w)

    (w, _), iso = jax.lax.scan(body, (w0, tx.init(w0)), None, length=300)
    return w, iso

  for seed in range(3):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((8, 8))
    a64 = (m + m.T) / 2
    a = jnp.asarray(a64, jnp.float32)
    top = np.linalg.eigvalsh(a64)[-2:].sum()
    w, iso = run(geometry.random_frames(jax.random.key(seed), (8, 2)), a)
    assert w.dtype == jnp.float32
    p = np_polar(w)
    err = certificate("stiefel_muon: tr(W^T A W) vs top-2 sum (float32 run)",
                      abs(top - np.trace(p.T @ a64 @ p)) / abs(top))
    assert err <= 1e-6, seed
    assert abs(top - float(jnp.trace(w.T @ a @ w))) / abs(top) <= 1e-5
    iso_max = certificate("stiefel_muon: isometry error, 300 float32 steps"
                          " (float32)", jnp.max(iso))
    assert iso_max <= 1e-5


# ---------------------------------------------------------------------------
# optax.inject_hyperparams without static_args (issue 55)


def _muon_run(tx, steps=3, jit=True):
  """`steps` updates of tx on fixed gradients (NumPy) from Haar frames."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE),
                  jnp.float32)
  w = jnp.asarray(np_polar(w), jnp.float32)
  g = jnp.asarray(np.random.default_rng(1).standard_normal(SHAPE),
                  jnp.float32)
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(w)
  for _ in range(steps):
    u, state = update(g, state, w)
    w = optax.apply_updates(w, u)
  return w, state


def test_inject_hyperparams_needs_no_static_args():
  """`optax.inject_hyperparams(stiefel_muon)(learning_rate)` works under
  jit, as `optax.contrib.muon`'s does (before issue 55: a
  ConcretizationTypeError in check_count): msign_steps' default (None) is
  not a number, so it is not injected and the steps are the static ones,
  bit for bit those of `static_args=("msign_steps",)`. An int given is
  injected (traced under jit): msign then loops over it
  (`lax.fori_loop`), the same arithmetic, equal within rounding; a bad
  one is refused where it is concrete (at init)."""
  inject = optax.inject_hyperparams(muon.stiefel_muon)
  w, state = _muon_run(inject(learning_rate=0.05))
  assert "msign_steps" not in state.hyperparams
  w_static, _ = _muon_run(optax.inject_hyperparams(
      muon.stiefel_muon, static_args=("msign_steps",))(learning_rate=0.05))
  np.testing.assert_array_equal(w, w_static)
  for steps in (3, 10):
    w_traced, state = _muon_run(inject(learning_rate=0.05,
                                       msign_steps=steps))
    assert int(state.hyperparams["msign_steps"]) == steps
    w_fixed, _ = _muon_run(optax.inject_hyperparams(
        muon.stiefel_muon, static_args=("msign_steps",))(
            learning_rate=0.05, msign_steps=steps))
    # The same arithmetic in another order of fusion: each of the 3 steps
    # moves W by lr * D with ||D||_2 <= 2/sqrt(3); msign's rounding is
    # O(steps * r * eps) per entry (about 1e-5 at float32 for 10 steps of
    # r = 4), times lr = 0.05, summed over 3 steps: < 1e-5.
    np.testing.assert_allclose(w_traced, w_fixed, rtol=0, atol=1e-5)
    assert float(jnp.max(geometry.isometry_error(w_traced))) < 1e-5
  with pytest.raises(ValueError, match="^stiefel_muon: msign_steps"):
    inject(learning_rate=0.05, msign_steps=0).init(jnp.eye(8, 4))
  # The traced loop is msign's own: equal to the unrolled one to rounding.
  x = jnp.asarray(np.random.default_rng(2).standard_normal(SHAPE),
                  jnp.float32)
  traced = jax.jit(muon.msign)(x, 9)
  np.testing.assert_allclose(traced, muon.msign(x, 9), rtol=0, atol=1e-5)
