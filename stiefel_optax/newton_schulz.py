"""The Newton–Schulz polar factor: step counts, iteration, certificates.

The polar factor polar(A) = A (A^T A)^(-1/2) is computed matmul-only by a
coupled Newton–Schulz iteration on the r x r matrix M = A^T A. Its fast path
runs a fixed step count derived from a bound on the spectrum of M (for a
retraction: from the step norm, assuming W^T W = I); a run-time certificate
computed from the iterates checks the result, and a fallback that takes its
scale from M itself, correct for any full-rank A, runs when the certificate
fails (the derivations are in the documentation's Proofs page,
docs/proofs.rst). `geometry.polar` and `geometry.retract` are the entry
points; this module holds the machinery behind them: the spectral bounds
and step counts (Python floats, static), the iteration and its certificate
(jnp), and the certified polar with its fallback.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from stiefel_optax.arrays import (
    compute_dtype, frame_norm, frame_scalar_sharding, gram, like, reshard_to)


# --------------------------------------------------------------------------
# Newton–Schulz: spectral bounds and step counts (Python floats, static).


def step_spectrum(step_norm, tangent: bool = True):
  """Bounds [lo, hi] on the spectrum of (W + xi)^T (W + xi), W orthonormal.

  Tangent xi: (W + xi)^T (W + xi) = I + xi^T xi, so [1, 1 + n^2] with
  n = ||xi||_F >= ||xi||_2. Any xi with n < 1: the singular values of W + xi
  lie in [1 - n, 1 + n] (Weyl), so [(1 - n)^2, (1 + n)^2].
  These bounds assume W^T W = I; the retraction checks its result at run
  time (`retract`), so a W that is not orthonormal is still handled.
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
  """Fewest Newton–Schulz steps that retract any ||xi||_F <= max_step_norm.

  For tangent xi at W, (W + xi)^T (W + xi) = I + xi^T xi with spectrum in
  [1, 1 + ||xi||_2^2] subset [1, 1 + max_step_norm^2]; see
  `newton_schulz_residual` and the Proofs page. max_step_norm = 1 needs 4
  steps, 0.1 needs 2 (tol = 1e-8, below float32 rounding; `retract` uses
  `newton_schulz_tol(dtype)`, one step more in float64). Non-tangent steps
  (tangent=False) need max_step_norm < 1 and more steps (0.1: 4).

  Args:
    max_step_norm: the trust-region radius, a bound on ||xi||_F (finite,
      > 0).
    tol: the worst-case eigenvalue residual to reach.
    tangent: whether the steps are tangent at W; False uses the bound for
      any step and needs max_step_norm < 1.

  Returns:
    The step count, an int >= 1.

  Raises:
    ValueError: if `max_step_norm` is not finite and > 0, or if it is
      >= 1 with tangent=False.

  Example:
    >>> import stiefel_optax as so
    >>> so.newton_schulz_steps(0.1), so.newton_schulz_steps(1.0)
    (2, 4)
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


def newton_schulz_accept_tol(dtype, r: int) -> float:
  """Largest certified ||Q^T Q - I||_F the retraction accepts: 8 sqrt(r) eps.

  Eight ulps per eigenvalue of Q^T Q, the level at which rounding in
  forming Q = A Z in `dtype` (float32 for bf16/f16) already sets the
  isometry error. The fixed counts aim lower (`newton_schulz_tol`, <= 5 ulp
  per eigenvalue), so on the fast path the certificate passes with margin:
  float32, r = 64: 7.6e-6; float64, r = 64: 1.4e-14.
  """
  eps = float(jnp.finfo(compute_dtype(dtype)).eps)
  return 8.0 * math.sqrt(r) * eps


def _step_bound_from_worst_eigenvalue(e: float, r: int) -> float:
  """Upper bound on the certificate (`_residual_bounds`) when every
  eigenvalue p of Z Y has |1 - p| <= e: rho = ||R||_F <= sqrt(r) e."""
  rs = math.sqrt(r)
  return rs * e * rs * e * (3.0 + rs * e) / 4.0


def newton_schulz_fallback_steps(condition_number: float, r: int,
                                 tol: float) -> int:
  """Steps of the M-scaled iteration (`inv_sqrt_newton_schulz`) that
  certify ||Z Y - I||_F <= tol for any SPD M with kappa(M) <= condition_number.

  The iteration scales by c = min(||M||_F, 1 + ||M - I||_F), both >=
  lambda_max, so every scaled eigenvalue lies in (0, 1], and
  c <= ||M||_F <= sqrt(r) lambda_max gives p_min >= p_0 = 1 / (sqrt(r) kappa).
  On (0, 1] the map p <- p (3 - p)^2 / 4 is increasing and p_min converges
  last, so e_k = 1 - p_k from p_0 is the worst case; the loop stops after
  the step whose certificate (at most r e_k^2 (3 + sqrt(r) e_k) / 4) is
  <= tol. Each step costs three r x r products. The two phases of the
  count and its table by condition number: docs/proofs.rst.
  """
  if not condition_number >= 1 or not math.isfinite(condition_number):
    raise ValueError(
        f"condition_number must be finite and >= 1; got {condition_number}.")
  p = 1.0 / (math.sqrt(r) * condition_number)
  steps = 0
  while _step_bound_from_worst_eigenvalue(1.0 - p, r) > tol:
    p = p * (3.0 - p) ** 2 / 4.0
    steps += 1
    if steps > 10_000:
      raise ValueError(f"tol = {tol} cannot be certified for r = {r}.")
  return steps + 1


def _fast_path_steps(max_step_norm: float, tol: float, accept: float,
                     r: int, tangent: bool) -> int:
  """The fast path's fixed count: `newton_schulz_steps(max_step_norm, tol)`,
  plus a step where the worst case of the certificate from the last-but-one
  residual e_{K-1} (`_step_bound_from_worst_eigenvalue`) could exceed
  `accept`, so that a step within max_step_norm never falls back. Only long
  float64 steps need it (max_step_norm = 2: 7 steps instead of 6); float32
  counts are unchanged for r <= 4096.
  """
  steps = newton_schulz_steps(max_step_norm, tol, tangent=tangent)
  spread = max_step_norm ** 2
  while _step_bound_from_worst_eigenvalue(
      newton_schulz_residual(spread, steps - 1, tangent=tangent), r) > accept:
    steps += 1
  return steps


def newton_schulz_max_steps(dtype, r: int) -> int:
  """Bound on the steps of one pass of the M-scaled iteration: the count
  (`newton_schulz_fallback_steps`) for kappa(M) = 1 / eps(dtype), the
  largest condition number that M = A^T A can carry in the dtype. A frame
  that is rank-deficient (or numerically so) never certifies; this bounds
  its loop (float32, r = 64: 26 steps; float64: 52)."""
  eps = float(jnp.finfo(compute_dtype(dtype)).eps)
  return newton_schulz_fallback_steps(
      1.0 / eps, r, newton_schulz_accept_tol(dtype, r))


# --------------------------------------------------------------------------
# Newton–Schulz: the iteration and its certificate (jnp).


def _residual_bounds(res: jax.Array):
  """(rho, certificate) for R = Z Y - I before one coupled step, rho =
  ||R||_F.

  With E = -R (symmetric, a polynomial in M), the step maps R to
  R' = -R^2 (3I - R) / 4 (each eigenvalue 1 - p to (1 - p)^2 (3 + 1 - p) / 4),
  so ||R'||_F <= ||R||_F ||R||_2 (3 + ||R||_2) / 4 <= rho^2 (3 + rho) / 4.
  The certificate rho^2 (3 + rho) / 4 thus bounds the isometry error of the
  frame after the step, ||Q^T Q - I||_F = ||Z' Y' - I||_F, in exact
  arithmetic. It needs one reduction and no product beyond the Z Y that the
  step itself forms, and rounding in R enters it squared, so a converged
  frame is never rejected for rounding.
  """
  rho = jnp.sqrt(jnp.sum(jnp.square(res), axis=(-2, -1)))
  return rho, rho * rho * (3.0 + rho) / 4.0


def _lambda_max_bound(m: jax.Array) -> jax.Array:
  """min(||M||_F, 1 + ||M - I||_F) >= lambda_max(M) for symmetric PSD M
  (Weyl for the second), per frame; the second is the tight one for nearly
  orthonormal frames, the first for frames of any scale."""
  eye = jnp.eye(m.shape[-1], dtype=m.dtype)
  return jnp.minimum(frame_norm(m), 1.0 + frame_norm(m - eye))


def _newton_schulz_step(y, z, res, eye):
  """One coupled step from R = Z Y - I: T = (3I - Z Y) / 2 = I - R / 2,
  Y <- Y T, Z <- T Z. Z Y stays a polynomial in M/c, and
  Q^T Q = Z (M/c) Z = Z Y for Q = A Z / sqrt(c)."""
  t = eye - 0.5 * res
  return y @ t, t @ z


def _newton_schulz_fixed(y: jax.Array, num_steps: int):
  """`num_steps` >= 1 coupled steps from Y = M/c, Z = I.

  Returns (Z, certificate): Z ~ (M/c)^(-1/2) and a per-frame bound on
  ||Z Y - I||_F after the last step (`_residual_bounds`, from the last R).
  The first step from Z = I needs one product (Z Y = Y, T Z = T), the others
  three; the certificate adds no product (Y after the last step is not
  needed), only the reduction rho.

  Two steps (the float32 fast path under the default trust region) are
  evaluated as the polynomial they are: all iterates are polynomials in
  E = Y - I, so Z_1 = I - E/2, R_1 = Z_1 Y_1 - I = (E^3 - 3 E^2) / 4 and
  Z_2 = (I - R_1/2) Z_1 = I - E/2 + 3E^2/8 - 5E^3/16 + E^4/16. The same
  three products (E^2, then E^3 and E^4, which do not wait for each other)
  with fewer elementwise passes between them; equal to stepping up to
  rounding.
  """
  eye = jnp.eye(y.shape[-1], dtype=y.dtype)
  if num_steps == 2:
    e = y - eye
    e2 = e @ e
    e3, e4 = e2 @ e, e2 @ e2
    z = eye - 0.5 * e + 0.375 * e2 - 0.3125 * e3 + 0.0625 * e4
    _, bound = _residual_bounds(0.25 * (e3 - 3.0 * e2))
    return z, bound
  res = y - eye
  t = eye - 0.5 * res
  y, z = y @ t, t
  for _ in range(num_steps - 1):
    res = z @ y - eye
    y, z = _newton_schulz_step(y, z, res, eye)
  _, bound = _residual_bounds(res)
  return z, bound


# The loops are jitted so that eager calls (outside any jit) compile each
# once per shape instead of retracing it on every call; inside a jit they
# are inlined.
@functools.partial(jax.jit,
                   static_argnames=("tol", "accept", "r", "max_steps"))
def _newton_schulz_counted(y: jax.Array, p0, tol: float, accept: float,
                           r: int, max_steps: int):
  """Coupled steps from Y = M/c, Z = I, counted at run time (a
  `lax.while_loop`): as many as the scalar worst case p <- p (3 - p)^2 / 4
  from p0 needs to reach e = 1 - p <= tol with a certificate guaranteed to
  pass (`_fast_path_steps`), at least one and at most max_steps.

  For steps of unbounded length (no trust region), where no count can be
  fixed in advance; p0 = min 2 lo / (lo + hi) over the batch. The scalar
  runs in the compute dtype, so it tracks p while p < 1/2 (exact for very
  long steps, where p is tiny) and e = 1 - p after (e <- e^2 (3 + e) / 4;
  in float32, p itself would stall at 1 - 2^-24 and never certify).
  Returns (Z, certificate) as `_newton_schulz_fixed` does.
  """
  eye = jnp.eye(y.shape[-1], dtype=y.dtype)

  def cond(carry):
    *_, e, e_prev, k = carry
    unsure = ((e > tol)
              | (_step_bound_from_worst_eigenvalue(e_prev, r) > accept))
    return (k < 1) | (unsure & (k < max_steps))

  def body(carry):
    y, z, _, p, e, _, k = carry
    res = z @ y - eye
    _, bound = _residual_bounds(res)
    y, z = _newton_schulz_step(y, z, res, eye)
    small = p < 0.5
    p_small = p * jnp.square(3.0 - p) / 4.0
    e_big = e * e * (3.0 + e) / 4.0
    p_new = jnp.where(small, p_small, 1.0 - e_big)
    e_new = jnp.where(small, 1.0 - p_small, e_big)
    return y, z, bound, p_new, e_new, e, k + 1

  # The carry sharded as Y (no op without Explicit mesh axes).
  per_frame = frame_scalar_sharding(y)
  bound0 = reshard_to(jnp.full(y.shape[:-2], jnp.inf, y.dtype), per_frame)
  init = (y, like(jnp.broadcast_to(eye, y.shape), y), bound0, p0, 1.0 - p0,
          1.0 - p0, jnp.zeros([], jnp.int32))
  _, z, bound, *_ = jax.lax.while_loop(cond, body, init)
  return z, bound


@functools.partial(jax.jit, static_argnames=("max_steps",))
def inv_sqrt_newton_schulz(m: jax.Array, tol, max_steps: int):
  """M^(-1/2) for any symmetric positive definite M (..., r, r), matmuls only.

  Scales by c = min(||M||_F, 1 + ||M - I||_F) (each >= lambda_max, so every
  eigenvalue p of M/c lies in (0, 1], where the iteration cannot diverge;
  the second is the tighter one for nearly orthonormal frames), then runs
  coupled steps in a `lax.while_loop` until every frame's certificate
  (`_residual_bounds`) is <= tol or max_steps is reached
  (`newton_schulz_fallback_steps` gives the count for a condition number).

  A frame stops (keeps its iterate) once certified, and also once ||Z Y - I||_F
  exceeds twice its smallest value so far: in exact arithmetic it decreases
  at every step, so growth means rounding has taken over, as for a
  rank-deficient M whose zero eigenvalue rounded negative (p < 0 would grow
  like (9/4)^k and overflow). A frame with non-finite entries stops at once
  (NaN in, NaN out) and does not keep the others iterating. A rank-deficient
  frame thus gets a finite, non-orthonormal factor in at most max_steps.

  Not reverse-mode differentiable (`lax.while_loop`); forward mode works.

  Returns (inv_root, steps, certificate): steps is the loop count (the
  slowest frame's), certificate the per-frame bound on ||Z Y - I||_F.
  """
  r = m.shape[-1]
  eye = jnp.eye(r, dtype=m.dtype)
  c = _lambda_max_bound(m)
  # A zero frame (M = 0) gets a zero factor rather than 0 / 0.
  c = jnp.maximum(c, jnp.finfo(m.dtype).tiny)[..., None, None]
  batch = m.shape[:-2]

  def cond(carry):
    *_, active, k = carry
    return jnp.any(active) & (k < max_steps)

  def body(carry):
    y, z, bound, best, active, k = carry
    res = z @ y - eye
    rho, new_bound = _residual_bounds(res)
    # NaN rho fails the comparison: a non-finite frame stops here.
    moving = active & (rho <= 2.0 * best)
    y_new, z_new = _newton_schulz_step(y, z, res, eye)
    keep = moving[..., None, None]
    y = jnp.where(keep, y_new, y)
    z = jnp.where(keep, z_new, z)
    bound = jnp.where(moving, new_bound, bound)
    return (y, z, bound, jnp.minimum(best, rho), moving & (new_bound > tol),
            k + 1)

  # The carry sharded as M (no op without Explicit mesh axes).
  per_frame = lambda x: reshard_to(x, frame_scalar_sharding(m))
  init = (m / c, like(jnp.broadcast_to(eye, m.shape), m),
          per_frame(jnp.full(batch, jnp.inf, m.dtype)),
          per_frame(jnp.full(batch, jnp.inf, m.dtype)),
          per_frame(jnp.ones(batch, bool)), jnp.zeros([], jnp.int32))
  _, z, bound, _, _, steps = jax.lax.while_loop(cond, body, init)
  return z * jax.lax.rsqrt(c), steps, bound


@jax.jit
def _polar_fallback(a: jax.Array, m: jax.Array) -> jax.Array:
  """polar(A) for any full-rank A (..., d, r), from M = A^T A: two passes of
  the M-scaled iteration (`inv_sqrt_newton_schulz`).

  Pass 1, Q_1 = A M^(-1/2) to tol_1 = sqrt(tol): forming M rounds its small
  eigenvalues by ~eps lambda_max, so Q_1 is accurate only to ~eps kappa(M)
  whatever the iteration does. Pass 2 polishes Q_1 from its own Gram
  matrix, now well conditioned, to tol = `newton_schulz_accept_tol`; the
  square-root tolerance of pass 1 is all that one quadratic step of pass 2
  needs. Two passes reach tol whenever eps kappa(M) << 1, i.e.
  kappa(A) << eps^(-1/2) (float64: 6.7e7; float32: 2.9e3). A rank-deficient
  A gets a finite frame that is not orthonormal.
  """
  r = a.shape[-1]
  tol = newton_schulz_accept_tol(a.dtype, r)
  max_steps = newton_schulz_max_steps(a.dtype, r)
  tols = jnp.asarray([math.sqrt(tol), tol], a.dtype)

  # One loop over the passes, so that the iteration is compiled once.
  def one_pass(i, carry):
    q, m = carry
    inv_root, _, _ = inv_sqrt_newton_schulz(m, tols[i], max_steps=max_steps)
    q = q @ inv_root
    return q, gram(q)

  q, _ = jax.lax.fori_loop(0, 2, one_pass, (a, m))
  return q


@jax.jit
def _certified_polar(a: jax.Array, m: jax.Array, inv_root: jax.Array,
                     certificate: jax.Array) -> jax.Array:
  """A @ inv_root when every frame's certificate is <= the accepted
  tolerance (`newton_schulz_accept_tol`), else `_polar_fallback` for the
  whole batch, chosen on device by `lax.cond` (no host round trip).

  A NaN certificate fails the test, so a diverged fast path always falls
  back. Under `jax.vmap` the cond becomes a select and both branches run
  (the library never vmaps the retraction: batches are leading axes).
  """
  tol = newton_schulz_accept_tol(a.dtype, a.shape[-1])
  ok = jnp.all(certificate <= tol)
  return jax.lax.cond(ok, lambda a, z, m: a @ z,
                      lambda a, z, m: _polar_fallback(a, m), a, inv_root, m)


class PolarParts(NamedTuple):
  """A certified polar factor before its check: A @ inv_root is polar(A)
  where every frame's certificate is <= the accepted tolerance, else the
  fallback (from M = A^T A) is (`certified_polars`)."""
  a: jax.Array
  m: jax.Array
  inv_root: jax.Array
  certificate: jax.Array


@jax.jit
def _certified_polar_group(parts: tuple) -> tuple:
  """`_certified_polar` of several leaves of one shape, dtype and sharding,
  with one fallback for all of them: each leaf gets A @ inv_root when its
  own certificates pass and the fallback of its own frames otherwise,
  exactly as from `_certified_polar` alone, but the fallback (two while
  loops, about half of a Stiefel update's compile time) is compiled once
  for the group instead of once per leaf.

  One `lax.cond` on "every leaf passes": its fast branch is the leaves'
  products, so the step that passes (every step on the fast path's domain)
  computes what per-leaf conds compute and nothing more; the other runs
  the fallback on the stacked frames and keeps each passing leaf's
  product. The fallback's frames are independent (each stops once
  certified, `inv_sqrt_newton_schulz`), so a frame's result does not
  depend on the frames stacked beside it.
  """
  a0 = parts[0].a
  tol = newton_schulz_accept_tol(a0.dtype, a0.shape[-1])
  oks = [jnp.all(p.certificate <= tol) for p in parts]
  operands = [(p.a, p.inv_root, p.m) for p in parts]

  def fast(ops):
    return tuple(a @ z for a, z, _ in ops)

  def slow(ops):
    polar = _polar_fallback(jnp.stack([a for a, _, _ in ops]),
                            jnp.stack([m for _, _, m in ops]))
    return tuple(jnp.where(ok, a @ z, polar[i])
                 for i, (ok, (a, z, _)) in enumerate(zip(oks, ops)))

  return jax.lax.cond(jnp.all(jnp.stack(oks)), fast, slow, operands)


def _group_key(x: jax.Array):
  """Leaves that may share a fallback: the same shape and dtype, and, under
  Explicit mesh axes, the same sharding (a stack of differently sharded
  leaves is refused there)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  try:
    hash(sharding)
  except TypeError:
    sharding = repr(sharding)
  return tuple(x.shape), jnp.dtype(x.dtype), sharding


def certified_polars(items: list) -> list:
  """Each item's polar factor: an array is its own result; `PolarParts`
  are checked as `_certified_polar` checks them, one fallback per group of
  equal shape, dtype and sharding (`_certified_polar_group`)."""
  out = list(items)
  groups = {}
  for i, item in enumerate(items):
    if isinstance(item, PolarParts):
      groups.setdefault(_group_key(item.a), []).append(i)
  for members in groups.values():
    if len(members) == 1:
      (i,) = members
      out[i] = _certified_polar(*items[i])
      continue
    for i, res in zip(members, _certified_polar_group(
        tuple(items[i] for i in members))):
      out[i] = res
  return out


def _polar_newton_schulz(a: jax.Array, m: jax.Array, c: jax.Array,
                         num_steps: Optional[int], counted=None) -> jax.Array:
  """polar(A) by Newton–Schulz from M = A^T A scaled by c (per frame).

  num_steps given: exactly that many steps, no certificate (for callers
  that size the count themselves, and to measure the iteration).
  Otherwise `counted(Y)` returns (Z, certificate) for Y = M/c (a fixed or
  run-time count), and `_certified_polar` checks it.
  """
  return certified_polars([polar_parts(a, m, c, num_steps, counted)])[0]


def polar_parts(a: jax.Array, m: jax.Array, c: jax.Array,
                num_steps: Optional[int], counted=None):
  """`_polar_newton_schulz` before its certificate is checked: the result
  itself (num_steps given), else its `PolarParts` for `certified_polars`."""
  c = c[..., None, None]
  y = m / c
  if num_steps is not None:
    if num_steps < 1:
      inv_root = like(
          jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape), m)
    else:
      inv_root, _ = _newton_schulz_fixed(y, num_steps=num_steps)
    return a @ (inv_root * jax.lax.rsqrt(c))
  z, certificate = counted(y)
  # Z Y -> I only says Z^2 = (M/c)^(-1): an eigenvalue p > 3 of M/c makes
  # T = (3 - p)/2 < 0 and flips that direction's sign, which converges to
  # another square root (a frame U S V^T, S a sign matrix, not polar(A)).
  # p <= 5/2 for all of them rules this out: T > 0 at every step (after one
  # step all p lie in (0, 1]). On the fast path's domain p < 2.
  # lambda_max(M) <= 1 + ||M - I||_F (Weyl): one reduction; on the fast
  # path M - I = xi^T xi has ||M - I||_F <= s, so p <= (1 + s) / (1 + s/2).
  eye = jnp.eye(m.shape[-1], dtype=m.dtype)
  principal = 1.0 + frame_norm(m - eye) <= 2.5 * c[..., 0, 0]
  certificate = jnp.where(principal, certificate, jnp.inf)
  return PolarParts(a, m, z * jax.lax.rsqrt(c), certificate)
