"""Geometry of the Stiefel manifold St(d, r) = {W in R^(d x r) : W^T W = I_r}.

Every function acts on arrays of shape (..., d, r): the last two axes are one
frame, any leading axes are a batch of frames. All functions are pure jnp /
jax.lax and jit friendly. Arrays that must agree (W and G, W and xi) must
have equal shapes: nothing is broadcast, and a mismatch is a ValueError that
names both shapes.

The polar factor and the retraction run the matmul-only Newton–Schulz
iteration of `newton_schulz` (a fixed step count from the step norm, a
run-time certificate, a fallback correct for any full-rank A; see
`retract`, and docs/proofs.rst for the derivations). The array primitives
(compute dtype, sharding helpers, `gram`, `frame_norm`) live in `arrays`;
import them, and the Newton–Schulz step counts, from there. `gram` and
`frame_norm`, which the geometry uses, stay reachable here as
``geometry.gram`` and ``geometry.frame_norm``, the names the documentation
uses.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from stiefel_optax.arrays import (
    _check_matrices, compute_dtype, frame_norm, frame_scalar_sharding, gram,
    like, reshard_to)
from stiefel_optax.newton_schulz import (
    PolarParts, _fast_path_steps, _newton_schulz_counted,
    _newton_schulz_fixed, _polar_newton_schulz, certified_polars,
    newton_schulz_accept_tol, newton_schulz_max_steps, newton_schulz_tol,
    polar_parts, step_spectrum)

RETRACTIONS = ("newton_schulz", "eigh")

# The public names 0.7.0 re-exported here that geometry no longer imports
# itself, by their home now: reached through `geometry` they still work, with a DeprecationWarning that says
# where to import them from (module __getattr__, PEP 562).
_MOVED = {
    **{n: "arrays" for n in ("explicit_spec", "gram_sharding")},
    **{n: "newton_schulz" for n in (
        "inv_sqrt_newton_schulz", "newton_schulz_fallback_steps",
        "newton_schulz_residual", "newton_schulz_steps")}}


def __getattr__(name: str):
  """A moved name, with a DeprecationWarning naming its home.

  >>> import warnings
  >>> with warnings.catch_warnings(record=True) as w:
  ...   warnings.simplefilter("always")
  ...   from stiefel_optax.geometry import newton_schulz_steps
  >>> "stiefel_optax.newton_schulz.newton_schulz_steps" in str(w[0].message)
  True
  """
  home = _MOVED.get(name)
  if home is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  import importlib  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.warn(
      f"stiefel_optax.geometry.{name} moved: import it as"
      f" stiefel_optax.{home}.{name} (the re-export goes in a later"
      " release)", DeprecationWarning, stacklevel=2)
  return getattr(importlib.import_module(f"stiefel_optax.{home}"), name)


# --------------------------------------------------------------------------
# Shape checks.


def check_frame_shape(shape, name: str = "array") -> None:
  """Raises ValueError unless `shape` is (..., d, r) with d >= r >= 1."""
  shape = tuple(shape)
  if len(shape) < 2:
    raise ValueError(
        f"{name}: a Stiefel frame needs rank >= 2 with shape (..., d, r); got"
        f" shape {shape}.")
  d, r = shape[-2], shape[-1]
  if r > d:
    raise ValueError(
        f"{name}: shape {shape} has r = {r} columns > d = {d} rows; an"
        " orthonormal frame needs d >= r.")
  if r < 1:
    raise ValueError(f"{name}: shape {shape} has no columns.")


def check_same_shape(fn: str, a_name: str, a_shape, b_name: str,
                     b_shape) -> None:
  """Raises ValueError naming both shapes unless they are equal.

  Geometry never broadcasts two frames against each other: a (d, 1) array
  passed as the gradient of a (d, 3) frame is an error, not a projection of
  three copies.
  """
  a_shape, b_shape = tuple(a_shape), tuple(b_shape)
  if a_shape != b_shape:
    raise ValueError(
        f"{fn}: {a_name} has shape {a_shape} but {b_name} has shape"
        f" {b_shape}; they must be equal (one (d, r) frame per batch entry,"
        " same batch axes, no broadcasting).")

# --------------------------------------------------------------------------
# Elementary maps.


def sym(a: jax.Array) -> jax.Array:
  """sym(A) = (A + A^T) / 2 over the last two axes (square matrices).

  Args:
    a: square matrices, shape (..., n, n).

  Returns:
    The symmetric part of each matrix, of the shape of `a`.

  Raises:
    ValueError: if `a` has rank < 2 or is not square over its last two
      axes.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> so.geometry.sym(jnp.array([[0.0, 2.0], [0.0, 0.0]]))
    Array([[0., 1.],
           [1., 0.]], dtype=float32)
  """
  _check_matrices("sym", "a", a.shape)
  if a.shape[-1] != a.shape[-2]:
    raise ValueError(
        f"sym: a needs square matrices over its last two axes; got shape"
        f" {tuple(a.shape)}.")
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))

def project_tangent(w: jax.Array, g: jax.Array) -> jax.Array:
  """P_W(G) = G - W sym(W^T G): the orthogonal projection onto T_W St.

  For W on the manifold the result xi satisfies W^T xi + xi^T W = 0 and
  G - P_W(G) = W sym(W^T G) is normal (embedded metric).

  Args:
    w: frames, shape (..., d, r) with d >= r.
    g: matrices of the same shape (nothing is broadcast).

  Returns:
    P_W(G), of the shape of `w`.

  Raises:
    ValueError: if `w` is not (..., d, r) with d >= r >= 1, or if `g`'s
      shape differs from `w`'s.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 3))
    >>> xi = so.geometry.project_tangent(w, jax.random.normal(jax.random.key(1), (8, 3)))
    >>> bool(jnp.abs(w.T @ xi + xi.T @ w).max() < 1e-5)
    True
  """
  check_frame_shape(w.shape, "project_tangent: w")
  check_same_shape("project_tangent", "w", w.shape, "g", g.shape)
  return g - w @ sym(gram(w, g))


def isometry_error(w: jax.Array) -> jax.Array:
  """||W^T W - I||_F per frame: how far each frame is from St(d, r).

  Computed in at least float32 (`compute_dtype`): in bfloat16 the Gram
  matrix's own rounding (about eps_bf16 per entry, as large as the error
  it measures) would make the reading unreliable (about 10 % low for
  frames rounded to bf16).

  Args:
    w: frames, shape (..., d, r) with d >= r.

  Returns:
    The isometry error of each frame, shape ``w.shape[:-2]``, in
    `compute_dtype(w.dtype)` (float32 for bf16/f16 frames).

  Raises:
    ValueError: if `w` is not (..., d, r) with d >= r >= 1.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> float(so.isometry_error(jnp.eye(4, 2)))
    0.0
  """
  check_frame_shape(w.shape, "isometry_error: w")
  r = w.shape[-1]
  w = w.astype(compute_dtype(w.dtype))
  return frame_norm(gram(w) - jnp.eye(r, dtype=w.dtype))


def random_frames(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  """Haar-distributed orthonormal frames of shape (..., d, r).

  QR of a Gaussian matrix with the signs of diag(R) folded into Q, which
  makes Q exactly Haar on St(d, r).

  Args:
    key: a JAX PRNG key.
    shape: (..., d, r) with d >= r >= 1; leading axes are a batch of
      independent frames.
    dtype: the frames' dtype (drawn in at least float32, then cast).

  Returns:
    Orthonormal frames of `shape` and `dtype`.

  Raises:
    ValueError: if `shape` is not (..., d, r) with d >= r >= 1.

  References:
    F. Mezzadri, "How to generate random matrices from the classical
    compact groups", Notices of the AMS 54(5), 2007.

  Example:
    >>> import jax, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (4, 8, 3))       # 4 frames
    >>> w.shape, bool(so.isometry_error(w).max() < 1e-5)
    ((4, 8, 3), True)
  """
  shape = tuple(shape)
  check_frame_shape(shape, "random_frames: shape")
  gauss = jax.random.normal(key, shape, dtype=compute_dtype(dtype))
  q, r = jnp.linalg.qr(gauss)
  signs = jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))
  signs = jnp.where(signs == 0, 1.0, signs).astype(q.dtype)
  return (q * signs[..., None, :]).astype(dtype)


def _inv_sqrt_eigh(m: jax.Array) -> jax.Array:
  """M^(-1/2) for symmetric positive definite M via an r x r eigh."""
  lam, v = jnp.linalg.eigh(m)
  tiny = jnp.finfo(m.dtype).tiny
  inv_root = jax.lax.rsqrt(jnp.maximum(lam, tiny))
  return (v * inv_root[..., None, :]) @ jnp.swapaxes(v, -1, -2)

def _wider_than_float32(dtype) -> bool:
  """Whether `retract` takes the step norm from xi itself, ignoring a
  caller's `step_norm`: in compute dtypes finer than float32 (float64).

  The Newton–Schulz scale c (from the step norm) enters twice, in
  Y = M/c and in the unscale Q = A Z / sqrt(c); the certificate checks
  Z Y only, so the two must read the same c. XLA does not promise that:
  it recomputes a cheap per-frame scalar inside each fusion that consumes
  it, and copies of a float32 value (an optax schedule under x64 returns
  float32, which reaches a caller's step norm through the learning rate)
  can differ by a float32 ulp, e.g. where LLVM contracts
  (1 - t/T) (a - b) + b into an FMA in one kernel and not in another. A
  float64 frame then came back with ||Q^T Q - I||_F ~ 2e-9 under a passed
  certificate (XLA_FLAGS="--xla_backend_optimization_level=0
  --xla_cpu_use_fusion_emitters=false", `stiefel_adam` on
  `optax.linear_schedule`; tests/test_geometry.py,
  test_retract_float64_scale_is_consistent). The norm of xi is a reduction,
  computed once, and what follows it is float64 arithmetic, whose copies
  agree to float64 rounding. In float32 the copies agree to float32
  rounding, which the acceptance tolerance already allows, so float32
  (and bf16/f16, computed in float32) keeps the caller's norm and its
  one pass fewer over xi."""
  return bool(jnp.finfo(dtype).eps < jnp.finfo(jnp.float32).eps)


def _check_method(fn: str, method: str) -> None:
  if method not in RETRACTIONS:
    raise ValueError(
        f"{fn}: method must be one of {RETRACTIONS}; got {method!r}.")

# --------------------------------------------------------------------------
# Polar factor and retraction.


def polar(a: jax.Array, method: str = "eigh", *,
          num_steps: Optional[int] = None) -> jax.Array:
  """Polar factor polar(A) = A (A^T A)^(-1/2) per frame, shape (..., d, r).

  The nearest orthonormal frame to A in Frobenius norm. Only r x r
  matrices are factorised; no d x r SVD. With method="newton_schulz" and
  s = ||A^T A - I||_F, six coupled steps on M = A^T A (its spectrum lies in
  [1 - s, 1 + s], so for s <= 1/2 they reach e_6 < 1e-24) are checked by
  the run-time certificate; when it fails (s large, A far from
  orthonormal) the M-scaled fallback of `retract` runs instead. A
  rank-deficient A gets a finite frame that is not orthonormal.

  Args:
    a: full-rank matrices, shape (..., d, r) with d >= r.
    method: "eigh" (default): the exact inverse square root by a symmetric
      eigendecomposition; "newton_schulz": matmul only, correct for any
      full-rank A, not reverse-mode differentiable by default (its
      fallback is a `lax.while_loop`).
    num_steps: Newton–Schulz only: exactly that many steps, no certificate
      and no fallback (e.g. a polish of a nearly orthonormal A).

  Returns:
    The polar factors, of the shape and dtype of `a` (computed in at least
    float32).

  Raises:
    ValueError: if `a` is not (..., d, r) with d >= r >= 1, or `method` is
      not one of "eigh", "newton_schulz".

  Example:
    >>> import jax, stiefel_optax as so
    >>> a = 3.0 * jax.random.normal(jax.random.key(0), (8, 3))   # any full rank
    >>> bool(so.isometry_error(so.polar(a, "newton_schulz")) < 1e-5)
    True
  """
  check_frame_shape(a.shape, "polar: a")
  _check_method("polar", method)
  a_c = a.astype(compute_dtype(a.dtype))
  m = gram(a_c)
  if method == "eigh":
    return (a_c @ _inv_sqrt_eigh(m)).astype(a.dtype)
  # Centred on 1 (lo + hi = 2): |1 - p| <= s for every eigenvalue.
  c = jnp.ones(m.shape[:-2], m.dtype)
  out = _polar_newton_schulz(a_c, m, c, num_steps,
                             lambda y: _newton_schulz_fixed(y, num_steps=6))
  return out.astype(a.dtype)


def retract(w: jax.Array, xi: jax.Array, method: str = "newton_schulz", *,
            max_step_norm: Optional[float] = None,
            num_steps: Optional[int] = None,
            tangent: bool = True,
            step_norm: Optional[jax.Array] = None) -> jax.Array:
  """Polar retraction R_W(xi) = polar(W + xi), correct for any full-rank W + xi.

  The r x r matrix inverted is M = (W + xi)^T (W + xi), formed from W + xi
  itself so that a frame which rounding moved slightly off the manifold is
  pulled back onto it. method="newton_schulz" (matmul only) has three parts
  (derivations, step counts and tables: docs/proofs.rst):

  * Fast path. For tangent xi and W on the manifold M = I + xi^T xi, whose
    spectrum lies in [1, 1 + ||xi||_F^2]; the coupled Newton–Schulz
    iteration scales by that per-frame bound and runs a step count sized
    for it: `newton_schulz_steps(max_step_norm, newton_schulz_tol(dtype))`
    (2 for the default trust region 0.1 in float32), or, with
    max_step_norm=None, a count found at run time from the actual step
    norms.
  * Certificate. With R = Z Y - I of the last step, rho = ||R||_F bounds
    the returned frame's isometry error by rho^2 (3 + rho) / 4, at no
    extra product, and 1 + ||M - I||_F <= 5/2 c excludes a non-principal
    square root. If any frame fails (W not orthonormal, a step longer than
    max_step_norm, a non-finite frame), a `lax.cond` on device runs the
    fallback for the whole batch; on the fast path's domain both tests
    pass by construction.
  * Fallback. The iteration scaled by c = min(||M||_F, 1 + ||M - I||_F) >=
    lambda_max(M), in a `lax.while_loop` until certified, in two passes
    (the second from the first result's Gram matrix). A rank-deficient
    W + xi (a zero head) gets a finite frame that is not orthonormal: no
    NaN.

  Costs and limits. Fast path: two d x r x r products (M and A Z), one
  r x r product for the first step and three for each other, two O(r^2)
  reductions and the cond. Under `jax.vmap` the cond becomes a select and
  both branches run (batch frames along leading axes instead, as the
  library does). Newton–Schulz is not reverse-mode differentiable (the
  fallback and the run-time count are while loops); forward mode works,
  and `num_steps` or method="eigh" give a differentiable retraction.

  Args:
    w: frames, shape (..., d, r) with d >= r.
    xi: steps of the same shape (nothing is broadcast).
    method: "newton_schulz" (default, matmul only) or "eigh" (exact, any
      step).
    max_step_norm: the trust-region radius, a bound on ||xi||_F, which
      fixes the fast path's step count at trace time; None (default):
      counted at run time from the step norms.
    num_steps: exactly that many steps with the scale from the step norm,
      no certificate and no fallback (to measure the iteration).
    tangent: False when xi is not tangent at W: the fixed count then uses
      the bound for any step, with max_step_norm < 1; with
      max_step_norm=None the fallback runs directly.
    step_norm: ||xi||_F per frame (shape xi.shape[:-2]) where the caller
      already has it (`stiefel_adam` takes it from its momentum), so that
      xi is not read once more; None: computed here. Only the Newton–Schulz
      scale uses it, and the certificate checks the result, so a value off
      by rounding (or by more) costs at most the fallback. Float32
      compute only: float64 measures xi itself and ignores it
      (`_wider_than_float32` says why).

  Returns:
    The retracted frames polar(W + xi), of the shape and dtype of `w`
    (computed in at least float32).

  Raises:
    ValueError: if `w` is not (..., d, r) with d >= r >= 1, `xi` (or
      `step_norm`) has another shape, `method` is unknown, or
      `max_step_norm` is not valid (not > 0; not < 1 with
      tangent=False).

  Example:
    >>> import jax, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 3))
    >>> xi = so.geometry.project_tangent(w, jax.random.normal(jax.random.key(1), (8, 3)))
    >>> bool(so.isometry_error(so.retract(w, 0.1 * xi)) < 1e-5)
    True
  """
  parts = retract_parts(w, xi, method, max_step_norm=max_step_norm,
                        num_steps=num_steps, tangent=tangent,
                        step_norm=step_norm)
  return certified_polars([parts])[0].astype(w.dtype)


def retract_parts(w: jax.Array, xi: jax.Array, method: str = "newton_schulz",
                  *, max_step_norm: Optional[float] = None,
                  num_steps: Optional[int] = None, tangent: bool = True,
                  step_norm: Optional[jax.Array] = None):
  """`retract` before its certificate is checked: the retracted frames in
  the compute dtype (method="eigh", or num_steps given), else their
  `PolarParts`, for `certified_polars` to check (several leaves' at once
  share one fallback: `retraction.retracted`)."""
  check_frame_shape(w.shape, "retract: w")
  check_same_shape("retract", "w", w.shape, "xi", xi.shape)
  _check_method("retract", method)
  cdtype = compute_dtype(w.dtype)
  xi_c = xi.astype(cdtype)
  a = w.astype(cdtype) + xi_c
  m = gram(a)
  if method == "eigh":
    return a @ _inv_sqrt_eigh(m)
  if num_steps is None and max_step_norm is None and not tangent:
    # No bound from the step: an infinite certificate selects the fallback
    # (through the same compiled cond as the other paths).
    eye = like(jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=cdtype), m.shape),
               m)
    inf = reshard_to(jnp.full(m.shape[:-2], jnp.inf, cdtype),
                     frame_scalar_sharding(m))
    return PolarParts(a, m, eye, inf)
  if step_norm is not None:
    check_same_shape("retract", "step_norm", jnp.shape(step_norm),
                     "the frames of xi", xi.shape[:-2])
  if step_norm is None or _wider_than_float32(cdtype):
    step_norm = frame_norm(xi_c)
  lo, hi = step_spectrum(jnp.asarray(step_norm, cdtype), tangent)
  c = 0.5 * (lo + hi)
  tol = newton_schulz_tol(cdtype)
  r = w.shape[-1]
  accept = newton_schulz_accept_tol(cdtype, r)
  if max_step_norm is not None:
    steps = _fast_path_steps(max_step_norm, tol, accept, r, tangent)
    counted = lambda y: _newton_schulz_fixed(y, num_steps=steps)
  else:
    p = lo / c
    # A non-finite step (one bad frame) must not set the others' count.
    p0 = jnp.min(jnp.where(jnp.isfinite(p), p, 1.0)).astype(cdtype)
    max_steps = newton_schulz_max_steps(cdtype, r)
    counted = lambda y: _newton_schulz_counted(
        y, p0, tol=tol, accept=accept, r=r, max_steps=max_steps)
  return polar_parts(a, m, c, num_steps, counted)
