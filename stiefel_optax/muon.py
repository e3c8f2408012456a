"""Manifold Muon on St(d, r): the step is the polar factor of the momentum.

Three pieces, each small and pure:

* `msign(x)`: the orthogonal polar factor U V^T of any x = U S V^T of shape
  (..., d, r), d >= r, by matmuls only (Polar Express, then Newton–Schulz).
* `scale_by_tangent_msign`: momentum on the tangent space and the direction
  P_W(msign(m)), an Optax transform with a NamedTuple state.
* `stiefel_muon`: the optimizer, an `optax.chain` of the library's tangent
  projection, this transform, the learning rate and the polar retraction.

msign iterates X_{k+1} = a_k X_k + b_k X_k S_k + c_k X_k S_k^2 with
S_k = X_k^T X_k from X_0 = X / (1.01 ||X||_F): seven Polar Express steps
(Amsel, Persson, Musco and Gower, arXiv 2505.16932, Algorithm 1, degree 5),
each divided by its 1.01 safety factor, then the quintic
q(x) = (15 x - 10 x^3 + 3 x^5) / 8 repeated. The direction
D = P_W(msign(m)) has 1 <= ||D||_2 <= 2 / sqrt(3) (tight) and
||D||_F <= sqrt(r). Why the schedule converges, the singular-value
threshold by step count, the bounds on D with their proof and the
trust-region consequence: docs/proofs.rst ("Manifold Muon").
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stiefel_optax import aliases, arrays, checks, geometry, transforms

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
  num_steps = int(num_steps)   # a concrete array (injected) counts as well
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
  lam, v = jnp.linalg.eigh(arrays.gram(x))
  r = x.shape[-1]
  floor = r * jnp.finfo(x.dtype).eps * jnp.max(lam, axis=-1, keepdims=True)
  keep = lam > floor
  inv_root = jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, lam, 1.0)), 0.0)
  return x @ ((v * inv_root[..., None, :]) @ jnp.swapaxes(v, -1, -2))


def _msign_loop(y: jax.Array, num_steps, eye: jax.Array) -> jax.Array:
  """`msign`'s iteration for a traced step count (`optax.inject_hyperparams`
  injects an integer as an array): the same steps, the k-th with the
  (a, b, c) of row min(k, 7) of the schedule (the seven Polar Express
  steps, then the quintic), in a `lax.fori_loop` of `num_steps` trips.
  The same arithmetic as the unrolled loop, so equal within rounding (XLA
  may fuse the unrolled steps differently)."""
  table = jnp.asarray(POLAR_EXPRESS_COEFFICIENTS + (NEWTON_SCHULZ_QUINTIC,),
                      y.dtype)
  last = len(POLAR_EXPRESS_COEFFICIENTS)

  def step(k, y):
    a, b, c = table[jnp.minimum(k, last)]
    s = arrays.gram(y)
    return y @ (a * eye + s @ (b * eye + c * s))

  return jax.lax.fori_loop(0, num_steps, step, y)


def msign(x: jax.Array, num_steps: int = DEFAULT_MSIGN_STEPS, *,
          method: str = "polar_express") -> jax.Array:
  """The orthogonal polar factor U V^T of x = U S V^T, per frame.

  msign(0) = 0 and zero singular values stay zero; for full-rank x,
  msign(x) = x (x^T x)^(-1/2). The result is scale free: msign(c x) =
  msign(x) for c > 0. From X_0 = x / (1.01 ||x||_F) each step applies an
  odd polynomial to the singular values,

  ::

      X_{k+1} = a_k X_k + b_k X_k S_k + c_k X_k S_k^2,   S_k = X_k^T X_k,

  two d x r x r products and one r x r x r product per step (no d x d
  matrix is formed): the seven Polar Express steps, then the Newton–Schulz
  quintic (15 x - 10 x^3 + 3 x^5) / 8. A singular value below about
  2.1e-4 ||x||_F (float32, 10 steps) is not mapped to 1 to rounding; the
  threshold by step count and why the schedule converges: docs/proofs.rst.

  Args:
    x: matrices, shape (..., d, r) with d >= r.
    num_steps: polynomial steps (method="polar_express"); below 8 the result
      is an approximation with singular values in about [0.7, 1.2], not the
      polar factor. May be traced (an integer `optax.inject_hyperparams`
      injects): then the steps run in a `lax.fori_loop`.
    method: "polar_express" (default, matmul only) or "eigh" (exact, by an
      r x r eigendecomposition of x^T x; eigenvalues below r eps lambda_max
      count as zero).

  Returns:
    msign(x), of the shape and dtype of `x` (computed in at least float32).

  Raises:
    ValueError: if `x` is not (..., d, r) with d >= r >= 1, `num_steps` is
      not an integer >= 1, or `method` is unknown.

  References:
    N. Amsel, D. Persson, C. Musco and R. M. Gower, "The Polar Express:
    Optimal Matrix Sign Methods and Their Application to the Muon
    Algorithm", arXiv 2505.16932, 2025.

  Example:
    >>> import jax, stiefel_optax as so
    >>> u = so.msign(jax.random.normal(jax.random.key(0), (8, 3)))
    >>> bool(so.isometry_error(u) < 1e-5)
    True
  """
  geometry.check_frame_shape(x.shape, "x")
  if method not in MSIGN_METHODS:
    raise ValueError(f"method must be one of {MSIGN_METHODS}; got {method!r}.")
  traced = isinstance(num_steps, jax.core.Tracer)
  coefficients = None if traced else msign_coefficients(num_steps)
  cdtype = arrays.compute_dtype(x.dtype)
  y = _normalize(x.astype(cdtype))
  if method == "eigh":
    return _msign_eigh(y).astype(x.dtype)
  eye = jnp.eye(x.shape[-1], dtype=cdtype)
  if traced:
    return _msign_loop(y, num_steps, eye).astype(x.dtype)
  for a, b, c in coefficients:
    s = arrays.gram(y)
    y = y @ (a * eye + s @ (b * eye + c * s))
  return y.astype(x.dtype)


def tangent_msign(w: jax.Array, m: jax.Array,
                  num_steps: int = DEFAULT_MSIGN_STEPS, *,
                  method: str = "polar_express") -> jax.Array:
  """D = P_W(msign(m)): the polar factor re-projected to T_W St.

  For W orthonormal and tangent m != 0, ||D||_F <= sqrt(r) and
  1 <= ||D||_2 <= 2 / sqrt(3) (tight; proof in docs/proofs.rst).

  Args:
    w: frames, shape (..., d, r) with d >= r.
    m: momenta of the same shape.
    num_steps: `msign`'s number of steps.
    method: `msign`'s method, "polar_express" (default) or "eigh".

  Returns:
    D, of the shape of `w`, tangent at W.

  Raises:
    ValueError: as `msign` and `project_tangent`.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 3))
    >>> d = so.tangent_msign(w, so.geometry.project_tangent(
    ...     w, jax.random.normal(jax.random.key(1), (8, 3))))
    >>> bool(jnp.abs(w.T @ d + d.T @ w).max() < 1e-5)
    True
  """
  return geometry.project_tangent(w, msign(m, num_steps, method=method))


# The tight bound ||P_W(msign(m))||_2 <= SPECTRAL_BOUND for W on St(d, r).
SPECTRAL_BOUND = 2.0 / 3.0 ** 0.5


class ScaleByTangentMsignState(NamedTuple):
  """State of `scale_by_tangent_msign`.

  No count: the polar factor is scale free, so Adam-style bias corrections
  would change nothing.

  Attributes:
    mu: the tangent momentum, one entry per element of each frame.
  """
  mu: optax.Updates


def scale_by_tangent_msign(b1: float = 0.95, nesterov: bool = True, *,
                           num_steps: int = DEFAULT_MSIGN_STEPS,
                           method: str = "polar_express",
                           mu_dtype: Optional[Any] = None
                           ) -> optax.GradientTransformation:
  """Momentum on the tangent space; the update is P_W(msign(momentum)).

  With g the incoming (tangent) gradient of a frame W::

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
    num_steps: `msign`'s number of steps.
    method: `msign`'s method, "polar_express" (default) or "eigh".
    mu_dtype: dtype of the momentum (default: that of the params).

  Returns:
    An `optax.GradientTransformation` whose state is a
    `ScaleByTangentMsignState`; its update needs params.

  Raises:
    ValueError: if `num_steps` or `method` is invalid (at once); at init,
      if a leaf cannot hold frames; at update, without params or for a
      gradient whose shape is not its frame's.

  References:
    K. Jordan et al., "Muon: An optimizer for hidden layers in neural
    networks", 2024, https://kellerjordan.github.io/posts/muon/.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 3))
    >>> tx = so.scale_by_tangent_msign()
    >>> g = so.geometry.project_tangent(w, jax.random.normal(jax.random.key(1), (8, 3)))
    >>> d, _ = tx.update(g, tx.init(w), w)
    >>> bool(1.0 - 1e-4 <= float(jnp.linalg.norm(d, 2)) <= 1.155)   # ||D||_2
    True
  """
  checks.check_count("scale_by_tangent_msign", "num_steps", num_steps)
  checks.check_choice("scale_by_tangent_msign", "method", method,
                      MSIGN_METHODS)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

  def init_fn(params):
    checks.check_frame_leaves(params, "scale_by_tangent_msign")
    return ScaleByTangentMsignState(jax.tree.map(
        lambda w: jnp.zeros_like(w, dtype=mu_dtype or w.dtype), params))

  def update_fn(updates, state, params=None):
    checks.require_params(params, "scale_by_tangent_msign")
    checks.check_update_shapes(updates, params, "scale_by_tangent_msign")

    def leaf(g_in, m, w):
      cdtype = arrays.compute_dtype(w.dtype)
      g, m_c, w = g_in.astype(cdtype), m.astype(cdtype), w.astype(cdtype)
      finite = jnp.isfinite(jnp.sum(jnp.square(g), axis=(-2, -1)))
      m_new = geometry.project_tangent(w, b1 * m_c + (1.0 - b1) * g)
      m_new = jnp.where(finite[..., None, None], m_new, m_c)
      n = b1 * m_new + (1.0 - b1) * g if nesterov else m_new
      n = jnp.where(finite[..., None, None], n, 0.0)
      d = tangent_msign(w, n, num_steps, method=method)
      return d.astype(g_in.dtype), m_new.astype(m.dtype)

    out = jax.tree.map(leaf, updates, state.mu, params)
    d, mu = transforms.unzip(jax.tree.structure(updates), out, 2)
    return d, ScaleByTangentMsignState(mu)

  return optax.GradientTransformation(init_fn, update_fn)


def stiefel_muon(learning_rate: optax.ScalarOrSchedule,
                 b1: float = 0.95, *, nesterov: bool = True,
                 msign_steps: Optional[int] = None,
                 msign_method: str = "polar_express",
                 max_step_norm: Optional[float] = None,
                 retraction: str = "newton_schulz",
                 mu_dtype: Optional[Any] = None,
                 orthonormal_start: str = "check"
                 ) -> optax.GradientTransformation:
  """Manifold Muon on St(d, r): W+ = polar(W - lr P_W(msign(momentum))).

  Per frame W with Euclidean gradient G::

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
  whatever the gradient's scale (derivation in docs/proofs.rst), and the direction is a descent direction, <D, n> = ||n||_*.

  Trust region: ||xi||_F <= lr sqrt(r) already, so no cap is needed
  (max_step_norm=None; the Newton–Schulz retraction then counts its steps
  at run time from the step norms). A cap max_step_norm >= lr_max sqrt(r)
  never binds and fixes the Newton–Schulz step count in advance; a smaller
  one shortens the long steps.

  Cost per frame and step, in d x r x r products: 2 for the gradient's
  projection, 2 for the momentum's, 2 per msign step (20 at the default
  10), 2 for the re-projection and 2 for the retraction: 28, against 6 for
  `stiefel_adam`. r x r work is extra (one product per msign step).

  Args:
    learning_rate: a float or an optax schedule (the spectral step size).
    b1: momentum decay (Muon's default).
    nesterov: use the Nesterov look-ahead (Muon's default).
    msign_steps: `num_steps` of `msign`; None (default):
      DEFAULT_MSIGN_STEPS, 10 matmul-only steps. None is not a number, so
      `optax.inject_hyperparams(stiefel_muon)(learning_rate)` leaves it
      static (no `static_args` needed: the same steps, bit for bit, as
      `stiefel_muon(learning_rate)`); an int passed through
      `inject_hyperparams` is injected and traced under jit, and `msign`
      then loops over it (`lax.fori_loop`, equal within rounding).
    msign_method: `method` of `msign`.
    max_step_norm: an optional trust-region radius (Frobenius, per frame);
      may be injected (traced).
    retraction: "newton_schulz" (matmul only, default) or "eigh".
    mu_dtype: dtype of the momentum.
    orthonormal_start: as in `stiefel_adam`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with the state of the chain
    project_to_tangent, scale_by_tangent_msign, scale_by_learning_rate
    (and clip_frame_norm), retract_polar; its update needs params.

  Raises:
    ValueError: for an invalid `msign_steps`, `msign_method`, `retraction`,
      `orthonormal_start` or `max_step_norm` (at once); at init, for a leaf
      that cannot hold frames or a frame that is rank-deficient or
      (orthonormal_start="check") not orthonormal; at update, without
      params or for a gradient whose shape is not its frame's.

  References:
    J. Bernstein, "Modular Manifolds", Thinking Machines Lab, 2025.
    F. Cesista, steepest descent on the Stiefel manifold under the spectral
    norm, 2025.

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
  """
  # optax.chain(project, msign, lr, cap, retract), computed in one pass
  # (`one_pass_chain`), with that chain's state; one_pass_chain checks
  # max_step_norm and retraction, naming stiefel_muon.
  if msign_steps is None:
    msign_steps = DEFAULT_MSIGN_STEPS
  checks.check_count("stiefel_muon", "msign_steps", msign_steps)
  checks.check_choice("stiefel_muon", "msign_method", msign_method,
                      MSIGN_METHODS)
  checks.check_choice("stiefel_muon", "orthonormal_start", orthonormal_start,
                      checks.ORTHONORMAL_STARTS)
  lead = [transforms.project_to_tangent(orthonormal_start),
          scale_by_tangent_msign(b1, nesterov, num_steps=msign_steps,
                                 method=msign_method, mu_dtype=mu_dtype)]

  def direction(updates, states, params):
    g, project_state = lead[0].update(updates, states[0], params)
    d, msign_state = lead[1].update(g, states[1], params)
    return d, None, (project_state, msign_state)

  return aliases.one_pass_chain(lead, direction, learning_rate,
                                max_step_norm=max_step_norm,
                                retraction=retraction, name="stiefel_muon")
