"""Geometry of the Stiefel manifold St(d, r) = {W in R^(d x r) : W^T W = I_r}.

Every function acts on arrays of shape (..., d, r): the last two axes are one
frame, any leading axes are a batch of frames. All functions are pure jnp and
jit/vmap friendly.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

RETRACTIONS = ("newton_schulz", "eigh")


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


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype the geometry runs in: at least float32 (bf16/f16 upcast)."""
  return jnp.promote_types(dtype, jnp.float32)


def sym(a: jax.Array) -> jax.Array:
  """sym(A) = (A + A^T) / 2 over the last two axes."""
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def gram(a: jax.Array, b: Optional[jax.Array] = None) -> jax.Array:
  """A^T B per frame (A^T A when b is None)."""
  b = a if b is None else b
  return jnp.einsum("...dr,...ds->...rs", a, b)


def frame_norm(x: jax.Array) -> jax.Array:
  """||x||_F per frame; shape x.shape[:-2]."""
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1)))


def project_tangent(w: jax.Array, g: jax.Array) -> jax.Array:
  """P_W(G) = G - W sym(W^T G): the orthogonal projection onto T_W St.

  For W on the manifold the result xi satisfies W^T xi + xi^T W = 0 and
  G - P_W(G) = W sym(W^T G) is normal (embedded metric).
  """
  check_frame_shape(w.shape, "w")
  return g - w @ sym(gram(w, g))


def isometry_error(w: jax.Array) -> jax.Array:
  """||W^T W - I||_F per frame; shape w.shape[:-2]."""
  check_frame_shape(w.shape, "w")
  r = w.shape[-1]
  return frame_norm(gram(w) - jnp.eye(r, dtype=w.dtype))


def random_frames(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  """Haar-distributed orthonormal frames of shape (..., d, r).

  QR of a Gaussian matrix with the signs of diag(R) folded into Q (Mezzadri
  2007), which makes Q exactly Haar on St(d, r).
  """
  shape = tuple(shape)
  check_frame_shape(shape, "shape")
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


def step_spectrum(step_norm, tangent: bool = True):
  """Bounds [lo, hi] on the spectrum of (W + xi)^T (W + xi), W orthonormal.

  Tangent xi: (W + xi)^T (W + xi) = I + xi^T xi, so [1, 1 + n^2] with
  n = ||xi||_F >= ||xi||_2. Any xi with n < 1: the singular values of W + xi
  lie in [1 - n, 1 + n] (Weyl), so [(1 - n)^2, (1 + n)^2].
  """
  if tangent:
    return 1.0 + 0.0 * step_norm, 1.0 + step_norm ** 2
  return (1.0 - step_norm) ** 2, (1.0 + step_norm) ** 2


def newton_schulz_residual(spread: float, num_steps: int, *,
                           tangent: bool = True) -> float:
  """Worst-case eigenvalue residual after `num_steps` Newton–Schulz steps.

  `spread` is ||xi||_F^2. With the spectrum of M in [lo, hi]
  (`step_spectrum`), scale by c = (lo + hi) / 2, so every eigenvalue p of
  M/c has |1 - p| <= e_0 = (hi - lo) / (hi + lo): s / (2 + s) for tangent
  steps, 2n / (1 + n^2) otherwise. The coupled iteration
  T = (3I - Z Y)/2, Y <- Y T, Z <- T Z keeps Z Y a polynomial in M/c, and in
  each eigen-direction p_k = z_k y_k obeys p_{k+1} = p_k (3 - p_k)^2 / 4, i.e.
  with e = 1 - p:  e_{k+1} = e_k^2 (3 + e_k) / 4  (quadratic convergence; the
  case p > 1 maps to a smaller residual, so e_0 bounds both ends).
  At the end (A Z / sqrt(c))^T (A Z / sqrt(c)) has eigenvalues 1 - e_K.
  """
  lo, hi = step_spectrum(math.sqrt(spread), tangent)
  e = (hi - lo) / (hi + lo)
  for _ in range(num_steps):
    e = e * e * (3.0 + e) / 4.0
  return e


def newton_schulz_tol(dtype) -> float:
  """Residual the Newton–Schulz retraction aims for in `dtype`: 1e-8 for
  float32 (below its rounding) and narrower, about 5 ulp for float64 (one
  more step), so float64 frames stay on the manifold to float64 rounding."""
  return min(1e-8, 5.0 * float(jnp.finfo(compute_dtype(dtype)).eps))


def newton_schulz_steps(max_step_norm: float = 1.0, tol: float = 1e-8, *,
                        tangent: bool = True) -> int:
  """Fewest Newton–Schulz steps that retract any step with ||xi||_F <= delta.

  For tangent xi at W, (W + xi)^T (W + xi) = I + xi^T xi with spectrum in
  [1, 1 + ||xi||_2^2] subset [1, 1 + delta^2]; see `newton_schulz_residual`.
  delta = 1 needs 4 steps, delta = 0.1 needs 2 (tol = 1e-8, below float32
  rounding; `retract` uses `newton_schulz_tol(dtype)`, one step more in
  float64). Non-tangent steps (tangent=False) need delta < 1 and more
  steps (delta = 0.1: 4).
  """
  if not max_step_norm > 0 or not math.isfinite(max_step_norm):
    raise ValueError(f"max_step_norm must be finite and > 0; got {max_step_norm}.")
  if not tangent and not max_step_norm < 1:
    raise ValueError(
        "a non-tangent step can make W + xi singular unless max_step_norm < 1;"
        f" got {max_step_norm}. Use method='eigh' or a smaller cap.")
  spread = max_step_norm ** 2
  steps = 0
  while newton_schulz_residual(spread, steps, tangent=tangent) > tol:
    steps += 1
  return max(steps, 1)


def _newton_schulz_step(y, z, eye):
  """One coupled step: T = (3I - Z Y) / 2, Y <- Y T, Z <- T Z."""
  t = 0.5 * (3.0 * eye - z @ y)
  return y @ t, t @ z


def _inv_sqrt_newton_schulz(m: jax.Array, lo: jax.Array, hi: jax.Array,
                            num_steps: int) -> jax.Array:
  """M^(-1/2) for M with spectrum in [lo, hi] (per frame), matmuls only.

  Scales by c = (lo + hi) / 2 so that |1 - p| < 1 for every eigenvalue p of
  M / c; converges whenever lo > 0.
  """
  r = m.shape[-1]
  c = (0.5 * (lo + hi))[..., None, None]
  eye = jnp.eye(r, dtype=m.dtype)
  y = m / c
  if num_steps < 1:
    return jnp.broadcast_to(eye, m.shape) * jax.lax.rsqrt(c)
  # The first step from Z = I needs one product (Z Y = Y, T Z = T), the
  # others three.
  t = 0.5 * (3.0 * eye - y)
  y, z = y @ t, t
  for _ in range(num_steps - 1):
    y, z = _newton_schulz_step(y, z, eye)
  return z * jax.lax.rsqrt(c)


def _inv_sqrt_newton_schulz_adaptive(m: jax.Array, lo: jax.Array,
                                     hi: jax.Array, tol: float = 1e-8,
                                     max_steps: int = 100) -> jax.Array:
  """`_inv_sqrt_newton_schulz` with as many steps as the batch needs.

  For steps of unbounded length (no trust region), where no step count can
  be fixed in advance. Alongside the iteration it runs the worst-case
  scalar recursion of `newton_schulz_residual` on the smallest scaled
  eigenvalue p = min 2 lo / (lo + hi), p <- p (3 - p)^2 / 4 (tracking p,
  not e = 1 - p, keeps it exact for very long steps where p is tiny), and
  stops once 1 - p <= tol (a `lax.while_loop`).
  """
  r = m.shape[-1]
  c = (0.5 * (lo + hi))[..., None, None]
  eye = jnp.eye(r, dtype=m.dtype)
  p = 2.0 * lo / (lo + hi)
  # A non-finite step (one bad frame) must not stop the others' iteration.
  p0 = jnp.min(jnp.where(jnp.isfinite(p), p, 1.0)).astype(m.dtype)

  def cond(carry):
    _, _, p, k = carry
    return (1.0 - p > tol) & (k < max_steps)

  def body(carry):
    y, z, p, k = carry
    y, z = _newton_schulz_step(y, z, eye)
    return y, z, p * jnp.square(3.0 - p) / 4.0, k + 1

  init = (m / c, jnp.broadcast_to(eye, m.shape), p0, jnp.zeros([], jnp.int32))
  _, z, _, _ = jax.lax.while_loop(cond, body, init)
  return z * jax.lax.rsqrt(c)


def _polar_factor(a: jax.Array, method: str, newton_schulz) -> jax.Array:
  """A (A^T A)^(-1/2), the r x r inverse square root by "eigh" or by
  `newton_schulz(M)` (which knows the spectral bound that fits its caller)."""
  m = gram(a)
  if method == "eigh":
    inv_root = _inv_sqrt_eigh(m)
  elif method == "newton_schulz":
    inv_root = newton_schulz(m)
  else:
    raise ValueError(f"method must be one of {RETRACTIONS}; got {method!r}.")
  return a @ inv_root


def polar(a: jax.Array, method: str = "eigh", *,
          num_steps: Optional[int] = None) -> jax.Array:
  """Polar factor polar(A) = A (A^T A)^(-1/2) per frame, shape (..., d, r).

  Only r x r matrices are factorised; no d x r SVD.
  method="eigh": exact inverse square root by a symmetric eigendecomposition.
  method="newton_schulz": matmul-only, for near-orthonormal A (the spectrum
  of A^T A within [1 - s, 1 + s], s = ||A^T A - I||_F < 1); `num_steps`
  defaults to 6. For retractions prefer `retract`, which knows a tighter
  bound from the step norm.
  """
  check_frame_shape(a.shape, "a")
  steps = 6 if num_steps is None else num_steps

  def newton_schulz(m):
    s = frame_norm(m - jnp.eye(m.shape[-1], dtype=m.dtype))
    return _inv_sqrt_newton_schulz(m, 1.0 - s, 1.0 + s, steps)

  a_c = a.astype(compute_dtype(a.dtype))
  return _polar_factor(a_c, method, newton_schulz).astype(a.dtype)


def retract(w: jax.Array, xi: jax.Array, method: str = "newton_schulz", *,
            max_step_norm: Optional[float] = 1.0,
            num_steps: Optional[int] = None,
            tangent: bool = True) -> jax.Array:
  """Polar retraction R_W(xi) = polar(W + xi).

  The r x r matrix inverted is M = (W + xi)^T (W + xi), formed from W + xi
  itself so that a frame which rounding moved slightly off the manifold is
  pulled back onto it. For tangent xi and W on the manifold M = I + xi^T xi,
  whose spectrum lies in [1, 1 + ||xi||_F^2]; Newton–Schulz scales by that
  per-frame bound and runs `newton_schulz_steps(max_step_norm, tol)` steps
  with tol = `newton_schulz_tol(dtype)`, which is exact to rounding (float32
  or float64) whenever ||xi||_F <= max_step_norm.
  tangent=False uses the bound for any xi (`step_spectrum`) instead, for
  steps that were not projected. max_step_norm=None (and no num_steps):
  steps of any length, with the step count found at run time from the
  actual step norms (`_inv_sqrt_newton_schulz_adaptive`).

  Newton–Schulz iteration count, from the bound. With delta =
  max_step_norm and s = ||xi||_F^2 <= delta^2, M / c with c = 1 + s/2 has
  its eigenvalues p in [1 - e_0, 1 + e_0], e_0 = s / (2 + s). In each
  eigen-direction one coupled step maps e = 1 - p to
  e^2 (3 + e) / 4, and after K steps the returned frame Q = A Z satisfies
  Q^T Q = I - E with the eigenvalues of E in [0, e_K], so
  ||Q^T Q - I||_F <= sqrt(r) e_K. K is the least with e_K <= tol:

      delta = 0.1: e_0 = 5.0e-3, e_1 = 1.9e-5, e_2 = 2.6e-10   -> K = 2
      delta = 0.5: e_0 = 0.11, ..., e_3 = 3.6e-9               -> K = 3
      delta = 1:   e_0 = 1/3, 9.3e-2, 6.6e-3, 3.3e-5, 8.2e-10  -> K = 4

  (tol = 1e-8 for float32, so sqrt(r) e_K stays far below float32 rounding
  of ~1e-7 sqrt(r), which then sets the isometry error; float64's tol
  ~1e-15 adds one step.) The first step costs one r x r product, the
  others three; with the two d x r x r products of M and A Z this is the
  whole retraction.
  """
  check_frame_shape(w.shape, "w")
  cdtype = compute_dtype(w.dtype)

  def newton_schulz(m):
    lo, hi = step_spectrum(frame_norm(xi.astype(cdtype)), tangent)
    tol = newton_schulz_tol(cdtype)
    if num_steps is None and max_step_norm is None:
      return _inv_sqrt_newton_schulz_adaptive(m, lo, hi, tol)
    steps = num_steps
    if steps is None:
      steps = newton_schulz_steps(max_step_norm, tol, tangent=tangent)
    return _inv_sqrt_newton_schulz(m, lo, hi, steps)

  a = w.astype(cdtype) + xi.astype(cdtype)
  return _polar_factor(a, method, newton_schulz).astype(w.dtype)
