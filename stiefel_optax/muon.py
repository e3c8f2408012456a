"""Manifold Muon on St(d, r): the step is the polar factor of the momentum.

Three pieces, each small and pure:

* `msign(x)`: the orthogonal polar factor U V^T of any x = U S V^T of shape
  (..., d, r), d >= r, by matmuls only (Polar Express, then Newton–Schulz).
* `scale_by_tangent_msign`: momentum on the tangent space and the direction
  P_W(msign(m)), an Optax transform with a NamedTuple state.
* `stiefel_muon`: the optimizer, an `optax.chain` of the library's tangent
  projection, this transform, the learning rate and the polar retraction.

The polar factor of the tangent momentum.
-----------------------------------------
msign(X) = U V^T for X = U S V^T (thin SVD); a zero singular value maps to
zero (so msign(0) = 0), and for full-rank X, msign(X) = X (X^T X)^(-1/2).
Matmul-only: X_0 = X / (1.01 ||X||_F) puts every singular value in
(0, 1/1.01], and each step applies an odd polynomial to the singular values,

    X_{k+1} = a_k X_k + b_k X_k S_k + c_k X_k S_k^2,   S_k = X_k^T X_k,

i.e. sigma <- p_k(sigma) = a_k sigma + b_k sigma^3 + c_k sigma^5, with two
d x r x r products (S_k and X_k P_k) and one r x r x r product per step (no
d x d matrix is formed). The coefficients are those of the Polar Express
(Amsel, Persson, Musco and Gower, "The Polar Express: Optimal Matrix Sign
Methods and Their Application to the Muon Algorithm", arXiv 2505.16932,
Algorithm 1, degree 5, designed for sigma in [1e-3, 1]): seven minimax-
optimal steps p_1..p_7, each divided by its 1.01 safety factor
(p_k(x / 1.01)), then the fixed tail q(x) = (15 x - 10 x^3 + 3 x^5) / 8
repeated. Why it converges (checked by interval arithmetic in the tests,
`test_schedule_converges_by_interval_arithmetic`): every p_k is positive on
the interval its inputs can occupy, and after the seven steps every
singular value lies in (0, 1); the tail has q(1) = 1,
q'(x) = 15 (1 - x^2)^2 / 8 >= 0 and q(x) - x = x (1 - x^2)(7 - 3 x^2) / 8 > 0
on (0, 1), so from (0, 1) the iterates rise monotonically to 1, with
1 - q(1 - e) <= 5 e^3 / 2 (cubic convergence; q'(1) = 0, so the fixed point
also absorbs rounding). Muon's fixed (3.4445, -4.775, 2.0315) is NOT used:
it has no fixed point at 1 and stalls at an error near 0.3.

Small singular values. A singular value sigma of X with
sigma / ||X||_F < tau is not mapped to 1 to rounding (its direction is only
partly orthogonalised; below about tau / 3000 it barely moves: a tiny
sigma only grows by the product of the a_k). From the scalar map, exact
arithmetic, tau for num_steps steps (the first error <= eps reached for
every larger sigma; tol 1e-7 for float32, 1e-16 for float64):

    num_steps    8        9        10 (default)   12       16
    float32   6.8e-4   3.8e-4   2.1e-4        5.8e-5   4.7e-6
    float64   ~1e-3*   6.0e-4   3.3e-4        9.3e-5   7.6e-6

(* 8 steps reach 2.7e-16 in float64, a few ulp.) Each step past the eighth
halves tau (the tail's slope at 0 is 15/8). A tiny sigma grows by at most
g = prod a_k / 1.01 (6.3e3 at 8 steps, 2.2e4 at 10, 7.8e4 at 12), which
also bounds what rounding does to a rank-deficient X: its rounding-level
singular values (~eps ||X||_F) come out at most ~g eps, about 5e-12 in
float64 and 3e-3 in float32 at 10 steps, far below 1, so the bounds on the
direction below still hold. In terms of conditioning:
sigma_min / ||X||_F >= 1 / (sqrt(r) kappa(X)), so num_steps = 10 is exact
to rounding for kappa(X) <= 1 / (2.1e-4 sqrt(r)) in float32 (r = 64:
kappa <= 590). num_steps < 8 stops inside the Polar Express phase (like
Muon's 5 steps): an approximation with singular values in about
[0.7, 1.2], not the polar factor. method="eigh" gives the exact factor
from an r x r eigendecomposition of X^T X instead (with eigenvalues below
r eps lambda_max treated as zero); it is the slow path on GPU for r > 32.

The step and its norm.
----------------------
With W orthonormal and U = msign(m), ||U||_2 <= 1 (= 1 unless m = 0), the
direction is re-projected, D = P_W(U) = U - W sym(W^T U), since U itself is
not tangent in general. Bounds on D (certified in the tests):

    ||D||_F <= ||U||_F = sqrt(rank m) <= sqrt(r)     (P_W is an orthogonal
                                                      projection)
    1 <= ||D||_2 <= 2 / sqrt(3) ~= 1.1547            (m != 0; the upper bound
                                                      tight for d >= 3, r >= 2;
                                                      ||D||_2 = 1 for r = 1)

Proof of the spectral bound: write U = W A + W_perp B (A = W^T U r x r,
B = W_perp^T U), so D = W skew(A) + W_perp B. For a unit vector v,
||D v||^2 = ||skew(A) v||^2 + ||B v||^2, with ||B v||^2 = ||U v||^2 -
||A v||^2 <= 1 - a^2 (a = ||A v||) and ||skew(A) v|| <= (||A v|| +
||A^T v||) / 2 <= (a + 1) / 2 (||A||_2 <= ||U||_2 <= 1). So
||D v||^2 <= 1 - a^2 + (a + 1)^2 / 4 = 5/4 + a/2 - 3 a^2 / 4 <= 4/3, the
maximum at a = 1/3. Equality: r = 2, U = [-w2/3 + sqrt(8/9) w3, w1] (W =
[w1, w2], w3 normal to W) is orthonormal and equals msign(X) for the
tangent X = U diag(3, 1) (W^T X = [[0, 1], [-1, 0]]), and ||D e_1||^2 = 4/3.
For r = 1, skew(A) = 0 and ||D||_2 = ||B||_2 <= 1. From below: for tangent
m != 0, <D, m> = <U, m> = ||m||_* (nuclear norm; P_W is self-adjoint and
P_W(m) = m), and <D, m> <= ||D||_2 ||m||_* (the spectral and nuclear norms
are dual), so ||D||_2 >= 1: re-projection never shortens the step below the
ambient Muon step, and D is a descent direction for the momentum.

Trust-region consequence: the step xi = -lr D has
lr <= ||xi||_2 <= 1.155 lr and ||xi||_F <= lr sqrt(r), whatever the
gradient's scale. So for tangent xi the
retraction's matrix (W + xi)^T (W + xi) = I + xi^T xi has its spectrum in
[1, 1 + 4 lr^2 / 3], and the Newton–Schulz step count of
`geometry.newton_schulz_steps(max_step_norm)` with max_step_norm =
lr_max sqrt(r) is valid without any clipping: a cap clip_frame_norm(delta)
with delta >= lr_max sqrt(r) never binds and only fixes that count.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stiefel_optax import aliases, geometry, transforms

# Polar Express, degree 5 (arXiv 2505.16932, Algorithm 1): (a, b, c) of
# p(x) = a x + b x^3 + c x^5, before the 1.01 safety factor.
_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
_SAFETY = 1.01
# The convergent tail: degree-5 Newton–Schulz, q(x) = (15x - 10x^3 + 3x^5)/8.
NEWTON_SCHULZ_QUINTIC = (1.875, -1.25, 0.375)
# p_k(x / 1.01) for the seven Polar Express steps.
POLAR_EXPRESS_COEFFICIENTS = tuple(
    (a / _SAFETY, b / _SAFETY ** 3, c / _SAFETY ** 5)
    for a, b, c in _POLAR_EXPRESS)
DEFAULT_MSIGN_STEPS = 10
MSIGN_METHODS = ("polar_express", "eigh")


def msign_coefficients(num_steps: int = DEFAULT_MSIGN_STEPS):
  """The (a, b, c) of each of `num_steps` steps: the seven Polar Express
  steps (fewer if num_steps < 7), then the Newton–Schulz quintic."""
  if int(num_steps) != num_steps or num_steps < 1:
    raise ValueError(f"num_steps must be an integer >= 1; got {num_steps}.")
  head = POLAR_EXPRESS_COEFFICIENTS[:num_steps]
  return head + (NEWTON_SCHULZ_QUINTIC,) * (num_steps - len(head))


def _normalize(x: jax.Array) -> jax.Array:
  """x / (1.01 ||x||_F) per frame, overflow- and underflow-safe (scaled by
  max |x| first), and 0 for x = 0 (never NaN)."""
  big = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
  safe = jnp.where(big > 0, big, 1.0)
  y = x / safe
  n = jnp.sqrt(jnp.sum(jnp.square(y), axis=(-2, -1), keepdims=True))
  return y / (_SAFETY * jnp.where(big > 0, n, 1.0))


def _msign_eigh(x: jax.Array) -> jax.Array:
  """X (X^T X)^(+1/2) by an r x r eigh; eigenvalues at or below
  r eps lambda_max count as zero (rank-deficient X gives U_k V_k^T)."""
  lam, v = jnp.linalg.eigh(geometry.gram(x))
  r = x.shape[-1]
  floor = r * jnp.finfo(x.dtype).eps * jnp.max(lam, axis=-1, keepdims=True)
  keep = lam > floor
  inv_root = jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, lam, 1.0)), 0.0)
  return x @ ((v * inv_root[..., None, :]) @ jnp.swapaxes(v, -1, -2))


def msign(x: jax.Array, num_steps: int = DEFAULT_MSIGN_STEPS, *,
          method: str = "polar_express") -> jax.Array:
  """The orthogonal polar factor U V^T of x = U S V^T, per frame.

  x has shape (..., d, r) with d >= r; the result has the same shape and
  dtype (computed in at least float32). msign(0) = 0 and zero singular
  values stay zero. method="polar_express" (default): matmul only,
  `num_steps` odd-polynomial steps (Polar Express, then the Newton–Schulz
  quintic; see the module docstring for the coefficients, the convergence
  argument and the singular-value threshold, 2.1e-4 ||x||_F in float32 at
  the default 10 steps). The result is scale free: msign(c x) = msign(x)
  for c > 0. method="eigh": exact, by an r x r eigendecomposition.

  >>> import jax, stiefel_optax as so
  >>> u = so.msign(jax.random.normal(jax.random.key(0), (8, 3)))
  >>> bool(so.isometry_error(u) < 1e-5)
  True
  """
  geometry.check_frame_shape(x.shape, "x")
  if method not in MSIGN_METHODS:
    raise ValueError(f"method must be one of {MSIGN_METHODS}; got {method!r}.")
  coefficients = msign_coefficients(num_steps)
  cdtype = geometry.compute_dtype(x.dtype)
  y = _normalize(x.astype(cdtype))
  if method == "eigh":
    return _msign_eigh(y).astype(x.dtype)
  eye = jnp.eye(x.shape[-1], dtype=cdtype)
  for a, b, c in coefficients:
    s = geometry.gram(y)
    y = y @ (a * eye + s @ (b * eye + c * s))
  return y.astype(x.dtype)


def tangent_msign(w: jax.Array, m: jax.Array,
                  num_steps: int = DEFAULT_MSIGN_STEPS, *,
                  method: str = "polar_express") -> jax.Array:
  """D = P_W(msign(m)): the polar factor re-projected to T_W St.

  For W orthonormal and tangent m != 0, ||D||_F <= sqrt(r) and
  1 <= ||D||_2 <= 2 / sqrt(3) (tight); see the module docstring.

  >>> import jax, jax.numpy as jnp, stiefel_optax as so
  >>> w = so.random_frames(jax.random.key(0), (8, 3))
  >>> d = so.tangent_msign(w, so.project_tangent(
  ...     w, jax.random.normal(jax.random.key(1), (8, 3))))
  >>> bool(jnp.abs(w.T @ d + d.T @ w).max() < 1e-5)
  True
  """
  return geometry.project_tangent(w, msign(m, num_steps, method=method))


# The tight bound ||P_W(msign(m))||_2 <= SPECTRAL_BOUND for W on St(d, r).
SPECTRAL_BOUND = 2.0 / 3.0 ** 0.5


class ScaleByTangentMsignState(NamedTuple):
  """State of `scale_by_tangent_msign`: mu, the tangent momentum, one entry
  per element (no count: the polar factor is scale free, so Adam-style bias
  corrections would change nothing)."""
  mu: optax.Updates


def scale_by_tangent_msign(b1: float = 0.95, nesterov: bool = True, *,
                           num_steps: int = DEFAULT_MSIGN_STEPS,
                           method: str = "polar_express",
                           mu_dtype: Optional[Any] = None
                           ) -> optax.GradientTransformation:
  """Momentum on the tangent space; the update is P_W(msign(momentum)).

  With g the incoming (tangent) gradient of a frame W:

      m = P_W(b1 m + (1 - b1) g)          = b1 P_W(m) + (1 - b1) g
      n = b1 m + (1 - b1) g   (nesterov)  or   n = m
      D = P_W(msign(n))

  The momentum, tangent at the previous frame, is carried to T_W St by
  projection (as in `scale_by_frame_adam`; projecting the mix once costs
  the same as projecting m alone and also makes a not-quite-tangent g
  tangent). The (1 - b1) weighting keeps m at the gradient's magnitude (so
  a low-precision mu_dtype is safe); since msign is scale free it gives the
  same D as m = b1 P_W(m) + g. D has 1 <= ||D||_2 <= 2/sqrt(3) and
  ||D||_F <= sqrt(r) whatever the gradient's scale, and D commutes with
  W -> QW for Q in O(d).

  Defaults b1 = 0.95, nesterov=True: those of Muon (Jordan et al. 2024)
  and `optax.contrib.muon`. The normalisation throws away the momentum's
  magnitude, so b1 only averages directions; Muon's tuned value is kept.

  Non-finite gradients: a frame whose gradient holds a NaN or Inf keeps its
  momentum and gets a zero step, as in `scale_by_frame_adam`. A zero
  momentum gives a zero step, never NaN.

  Args:
    b1: momentum decay.
    nesterov: use the Nesterov look-ahead n = b1 m + (1 - b1) g.
    num_steps, method: of `msign`.
    mu_dtype: dtype of the momentum (default: that of the params).

  >>> import jax, jax.numpy as jnp, stiefel_optax as so
  >>> w = so.random_frames(jax.random.key(0), (8, 3))
  >>> tx = so.scale_by_tangent_msign()
  >>> g = so.project_tangent(w, jax.random.normal(jax.random.key(1), (8, 3)))
  >>> d, _ = tx.update(g, tx.init(w), w)
  >>> bool(1.0 - 1e-4 <= float(jnp.linalg.norm(d, 2)) <= 1.155)   # ||D||_2
  True
  """
  msign_coefficients(num_steps)          # validates num_steps now
  if method not in MSIGN_METHODS:
    raise ValueError(
        f"scale_by_tangent_msign: method must be one of {MSIGN_METHODS}; got"
        f" {method!r}.")
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

  def init_fn(params):
    transforms.check_frame_leaves(params, "scale_by_tangent_msign")
    return ScaleByTangentMsignState(jax.tree.map(
        lambda w: jnp.zeros_like(w, dtype=mu_dtype or w.dtype), params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
          "scale_by_tangent_msign needs params: the current frames W are part"
          " of the Stiefel step. Call tx.update(grads, state, params).")

    def leaf(g_in, m, w):
      cdtype = geometry.compute_dtype(w.dtype)
      g, m_c, w = g_in.astype(cdtype), m.astype(cdtype), w.astype(cdtype)
      finite = jnp.isfinite(jnp.sum(jnp.square(g), axis=(-2, -1)))
      m_new = geometry.project_tangent(w, b1 * m_c + (1.0 - b1) * g)
      m_new = jnp.where(finite[..., None, None], m_new, m_c)
      n = b1 * m_new + (1.0 - b1) * g if nesterov else m_new
      n = jnp.where(finite[..., None, None], n, 0.0)
      d = tangent_msign(w, n, num_steps, method=method)
      return d.astype(g_in.dtype), m_new.astype(m.dtype)

    out = jax.tree.map(leaf, updates, state.mu, params)
    treedef = jax.tree.structure(updates)
    leaves = treedef.flatten_up_to(out)
    d = treedef.unflatten([x[0] for x in leaves])
    mu = treedef.unflatten([x[1] for x in leaves])
    return d, ScaleByTangentMsignState(mu)

  return optax.GradientTransformation(init_fn, update_fn)


def stiefel_muon(learning_rate: optax.ScalarOrSchedule,
                 b1: float = 0.95, *, nesterov: bool = True,
                 msign_steps: int = DEFAULT_MSIGN_STEPS,
                 msign_method: str = "polar_express",
                 max_step_norm: Optional[float] = None,
                 retraction: str = "newton_schulz",
                 mu_dtype: Optional[Any] = None,
                 orthonormal_start: str = "check"
                 ) -> optax.GradientTransformation:
  """Manifold Muon on St(d, r): W+ = polar(W - lr P_W(msign(momentum))).

  Per frame W with Euclidean gradient G:

      g  = P_W(G) = G - W sym(W^T G)
      m  = b1 P_W(m) + (1 - b1) g,   n = b1 m + (1 - b1) g   (nesterov)
      D  = P_W(msign(n)),            msign(U S V^T) = U V^T
      xi = -lr D                     [xi min(1, max_step_norm / ||xi||_F)]
      W+ = polar(W + xi)

  This is the one-step form of manifold Muon (J. Bernstein, "Modular
  Manifolds", Thinking Machines Lab, 2025), which seeks the tangent
  direction of steepest descent under the spectral norm,
  argmin {<G, xi> : xi tangent at W, ||xi||_2 <= lr}: instead of solving
  that problem exactly (by dual ascent), it takes the spectral-norm steepest
  direction of the ambient space, msign, of the tangent momentum and projects
  it back to the tangent space (F. Cesista's heuristic for steepest descent
  on the Stiefel manifold under the spectral norm, 2025). Re-projection
  changes the norm: 1 <= ||D||_2 <= 2/sqrt(3) (tight) and
  ||D||_F <= sqrt(r), so the step's size is set by the learning rate alone,
  whatever the gradient's scale (derivation in the `stiefel_optax.muon`
  docstring), and the direction is a descent direction, <D, n> = ||n||_*.

  Trust region: ||xi||_F <= lr sqrt(r) already, so no cap is needed
  (max_step_norm=None; the Newton–Schulz retraction then counts its steps
  at run time from the step norms). A cap max_step_norm >= lr_max sqrt(r)
  never binds and fixes the Newton–Schulz step count in advance; a smaller
  one shortens the long steps.

  Cost per frame and step, in d x r x r products: 2 for the gradient's
  projection, 2 for the momentum's, 2 per msign step (20 at the default
  10), 2 for the re-projection and 2 for the retraction: 28, against 6 for
  `stiefel_adam`. r x r work is extra (one product per msign step).

  Example (the top-2 eigenspace of A, i.e. maximise tr(W^T A W)):

  >>> import jax, jax.numpy as jnp, optax
  >>> from stiefel_optax import geometry
  >>> from stiefel_optax.muon import stiefel_muon
  >>> a = jnp.diag(jnp.arange(8.0))               # top-2 sum: 7 + 6 = 13
  >>> loss = lambda w: -jnp.trace(w.T @ a @ w)
  >>> w = geometry.random_frames(jax.random.key(0), (8, 2))
  >>> tx = stiefel_muon(optax.exponential_decay(0.1, 1, 0.97))
  >>> state = tx.init(w)
  >>> @jax.jit
  ... def step(w, state):
  ...   updates, state = tx.update(jax.grad(loss)(w), state, w)
  ...   return optax.apply_updates(w, updates), state
  >>> for _ in range(300):
  ...   w, state = step(w, state)
  >>> print(f"{-loss(w):.4f}", bool(geometry.isometry_error(w) < 1e-5))
  13.0000 True

  Args:
    learning_rate: a float or an optax schedule (the spectral step size).
    b1, nesterov: momentum decay and Nesterov look-ahead (Muon's defaults).
    msign_steps, msign_method: `num_steps` and `method` of `msign` (10
      matmul-only steps by default).
    max_step_norm: an optional trust-region radius (Frobenius, per frame);
      may be injected (traced).
    retraction: "newton_schulz" (matmul only, default) or "eigh".
    mu_dtype: dtype of the momentum.
    orthonormal_start: as in `stiefel_adam`.
  """
  # optax.chain(project, msign, lr, cap, retract), computed in one pass as
  # `stiefel_adam`'s (`aliases._one_pass`), with that chain's state.
  lead = [transforms.project_to_tangent(orthonormal_start),
          scale_by_tangent_msign(b1, nesterov, num_steps=msign_steps,
                                 method=msign_method, mu_dtype=mu_dtype)]

  def direction(updates, states, params):
    g, project_state = lead[0].update(updates, states[0], params)
    d, msign_state = lead[1].update(g, states[1], params)
    return d, None, (project_state, msign_state)

  return aliases._one_pass(lead, direction, learning_rate, max_step_norm,  # pylint: disable=protected-access
                           retraction)
