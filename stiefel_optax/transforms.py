"""Optax transforms of the Riemannian Adam on Stiefel frames.

Each transform acts on leaves whose last two axes are one frame (d, r) and
needs `params` (the current frames W). Chained as in `aliases.stiefel_adam`::

    project_to_tangent -> scale_by_frame_adam -> scale_by_learning_rate
      -> clip_frame_norm -> retract_polar

(`aliases.one_pass_chain` computes such a chain in one pass). Their argument
and leaf checks, and the start check, are in `checks`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from stiefel_optax import arrays, checks, geometry


def _per_frame(fn, updates, params, *, with_params: bool = False):
  """fn(update) (with_params: fn(update, frame)) leafwise, computed in at
  least float32 (`arrays.compute_dtype` of both dtypes) and cast to the
  params' dtype: an update has its parameter's dtype, as optax's do, so
  that bf16 gradients of float32 frames give float32 updates (rounding
  them to bf16 would round the step's result too)."""
  def leaf(u, w):
    cdtype = arrays.compute_dtype(jnp.promote_types(u.dtype, w.dtype))
    args = (u.astype(cdtype),) + ((w.astype(cdtype),) if with_params else ())
    return fn(*args).astype(w.dtype)
  return jax.tree.map(leaf, updates, params)


def unzip(treedef, tree, n: int):
  """Splits a tree of n-tuples (with outer structure treedef) into n trees."""
  leaves = treedef.flatten_up_to(tree)
  return tuple(treedef.unflatten([leaf[i] for leaf in leaves])
               for i in range(n))


# --------------------------------------------------------------------------
# Tangent projection.


def _start_link(name: str, orthonormal_start: str, fn):
  """A chain's first link, `name`: `orthonormal_start` checked at once; its
  init checks the leaves and, once per init, the start
  (`checks.check_start_leaves`), naming the leaf; its update requires
  params, checks the update's shapes and returns fn(updates, params)."""
  checks.check_choice(name, "orthonormal_start", orthonormal_start,
                      checks.ORTHONORMAL_STARTS)

  def init_fn(params):
    checks.check_start_leaves(params, name, orthonormal_start)
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    checks.require_params(params, name)
    checks.check_update_shapes(updates, params, name)
    return fn(updates, params), state

  return optax.GradientTransformation(init_fn, update_fn)


def project_to_tangent(orthonormal_start: str = "check"
                       ) -> optax.GradientTransformation:
  """Replaces each gradient G by its Riemannian gradient P_W(G).

  P_W(G) = G - W sym(W^T G) (embedded metric). P_W(W) = 0 for W on the
  manifold, so Euclidean weight decay placed before this transform has no
  effect on a frame.

  As the first link of a Stiefel chain it also checks the start: `init`
  on concrete frames raises a ValueError naming the leaf when a frame is
  rank-deficient or (orthonormal_start="check") not orthonormal; with
  "project" the first retraction lands such frames on the manifold.

  Args:
    orthonormal_start: "check" (default) or "project".

  Returns:
    An `optax.GradientTransformation` (state `optax.EmptyState`); its update
    needs params.

  Raises:
    ValueError: for an unknown `orthonormal_start` (at once); at init, for a
      leaf that cannot hold frames (rank < 2, r > d, not floating point) or
      a frame that is rank-deficient or, with "check", not orthonormal; at
      update, without params or for an update whose shape is not its
      frame's.

  References:
    P.-A. Absil, R. Mahony and R. Sepulchre, "Optimization Algorithms on
    Matrix Manifolds", Princeton University Press, 2008.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 2))
    >>> tx = so.project_to_tangent()
    >>> g, _ = tx.update(jnp.ones((8, 2)), tx.init(w), w)
    >>> bool(jnp.abs(w.T @ g + g.T @ w).max() < 1e-6)     # tangent at w
    True
  """
  return _start_link(
      "project_to_tangent", orthonormal_start,
      lambda updates, params: _per_frame(
          lambda g, w: geometry.project_tangent(w, g), updates, params,
          with_params=True))


def check_orthonormal_start(orthonormal_start: str = "check"
                 ) -> optax.GradientTransformation:
  """The start check of `project_to_tangent`, without the projection.

  The first link of a chain whose next link projects itself
  (`scale_by_frame_adam(project=True)`, as in `stiefel_adam`). `init`
  raises as `project_to_tangent`'s does; `update` checks shapes and passes
  the gradients through unchanged: u = G.

  Args:
    orthonormal_start: "check" (default) or "project".

  Returns:
    An `optax.GradientTransformation` (state `optax.EmptyState`); its update
    needs params.

  Raises:
    ValueError: as `project_to_tangent`.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 2))
    >>> tx = so.check_orthonormal_start()
    >>> g, _ = tx.update(jnp.ones((8, 2)), tx.init(w), w)
    >>> bool((g == 1).all())
    True
  """
  return _start_link("check_orthonormal_start", orthonormal_start,
                     lambda updates, params: updates)


# --------------------------------------------------------------------------
# Scale-free Adam moment.


class ScaleByFrameAdamState(NamedTuple):
  """State of `scale_by_frame_adam`.

  Attributes:
    count: steps taken, shape ().
    mu: first moment, one entry per element.
    nu: second moment, ONE scalar per frame (shape leaf.shape[:-2]).
  """
  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates


# Below this fraction of ||G||^2, ||P_W G||^2 is taken from the explicit
# projection instead of ||G||^2 - ||sym(W^T G)||^2: the difference has an
# absolute error of a few float32 roundings (and W's own isometry error)
# times ||G||^2, so it keeps >= 4 digits above the threshold.
CANCELLATION_THRESHOLD = 1e-2


def tangent_sq_norm(w: jax.Array, g: jax.Array, a: jax.Array) -> jax.Array:
  """||P_W(G)||_F^2 per frame, given A = W^T G, for W on the manifold.

  ||P_W G||^2 = ||G||^2 - ||sym(A)||^2 (P_W G = G - W sym(A) and W sym(A)
  is the normal part), so no d x r projection is formed. Where that
  difference is below CANCELLATION_THRESHOLD ||G||^2 (a gradient nearly
  normal to the manifold) float32 cancellation would spoil it, and the
  frames of the leaf get the explicit ||G - W sym(A)||^2 instead (one more
  d x r x r product, only when some frame of the leaf needs it).

  Args:
    w: frames on the manifold, shape (..., d, r).
    g: gradients of the same shape.
    a: W^T G, shape (..., r, r).

  Returns:
    ||P_W(G)||_F^2 per frame, shape ``w.shape[:-2]``.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 3))
    >>> g = jax.random.normal(jax.random.key(1), (8, 3))
    >>> exact = jnp.sum(so.geometry.project_tangent(w, g) ** 2)
    >>> bool(jnp.allclose(so.tangent_sq_norm(w, g, w.T @ g), exact, rtol=1e-5))
    True
  """
  total = jnp.sum(jnp.square(g), axis=(-2, -1))
  fast = total - jnp.sum(jnp.square(geometry.sym(a)), axis=(-2, -1))
  cancels = fast < CANCELLATION_THRESHOLD * total

  def explicit(_):
    exact = jnp.sum(jnp.square(g - w @ geometry.sym(a)), axis=(-2, -1))
    return jnp.where(cancels, exact, fast)

  # A non-finite total fails `cancels`: it stays non-finite (skipped).
  return jax.lax.cond(jnp.any(cancels), explicit, lambda _: fast, None)


def scale_by_frame_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        *, mu_dtype: Optional[Any] = None,
                        transport_momentum: bool = True,
                        project: bool = False
                        ) -> optax.GradientTransformation:
  """Riemannian Adam with one scalar second moment per frame.

  With g the incoming (tangent) gradient of a frame W::

      m = b1 * P_W(m) + (1 - b1) * g
      v = b2 * v + (1 - b2) * ||g||_F^2
      u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

  P_W carries the momentum, tangent at the previous frame, to the tangent
  space at W (projection as vector transport). Because v is one scalar per
  frame, u is invariant to any rescaling of the gradient when eps = 0, and
  the step commutes with W -> QW for Q in O(d).

  With project=True the incoming updates are Euclidean gradients G and the
  transform takes g = P_W(G) itself, at the arithmetic floor: P_W is
  linear, so m = P_W(b1 m + (1 - b1) G) is one projection of the momentum
  mix, and ||g||^2 = ||G||^2 - ||sym(W^T G)||^2 (`tangent_sq_norm`): three
  d x r x r products per frame (W^T G, W^T m, W S), against four for
  `project_to_tangent` followed by this transform. Equal to that chain up
  to rounding.

  Non-finite gradients: the library skips the frame. A frame whose gradient
  holds a NaN or Inf (or one so large that ||g||_F^2 overflows, which would
  otherwise set v to Inf for good) keeps its moments and gets a zero step
  (the count still advances), so one bad frame never corrupts the others or
  the state. The Euclidean AdamW group of `stiefel_attention` does not skip
  (optax's AdamW lets the NaN into its leaf); to skip the whole step, wrap
  the whole optimizer in `optax.apply_if_finite(tx, max_consecutive_errors)`.
  With v = 0 (a zero gradient so far) the step is zero, never NaN, even
  with eps = 0.

  Args:
    b1: decay rate of the first moment, as in `optax.scale_by_adam`.
    b2: decay rate of the second moment (here one scalar per frame), as in
      `optax.scale_by_adam`.
    eps: offset added to the denominator sqrt(v_hat), as in
      `optax.scale_by_adam`.
    mu_dtype: dtype of the first moment (default: that of the params).
    transport_momentum: if False, m is not projected (ablation).
    project: if True, the updates are Euclidean gradients, projected here
      (needs transport_momentum).

  Returns:
    An `optax.GradientTransformation` whose state is a
    `ScaleByFrameAdamState`; its update needs params.

  Raises:
    ValueError: for project=True with transport_momentum=False (at once);
      at init, for a leaf that cannot hold frames; at update, without params
      or for an update whose shape is not its frame's.

  References:
    R. D. Guerrero, "Stiefel Attention: When the Geometry of Transformer
    Projection Matrices Dominates Optimizer Choice — and When It Does Not",
    arXiv 2609.19363, 2026.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (2, 8, 3))
    >>> g = so.geometry.project_tangent(w, jax.random.normal(jax.random.key(1), w.shape))
    >>> tx = so.scale_by_frame_adam()
    >>> state = tx.init(w)
    >>> u, state = tx.update(g, state, w)
    >>> state.nu.shape                     # one second moment per frame
    (2,)
    >>> u2, _ = tx.update(1e3 * g, tx.init(w), w)   # scale-free (up to eps)
    >>> bool(jnp.allclose(u, u2, atol=1e-5))
    True
  """
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  if project and not transport_momentum:
    raise ValueError(
        "scale_by_frame_adam: project=True projects the momentum mix, so it"
        " needs transport_momentum=True; for the ablation without transport"
        " put project_to_tangent() before scale_by_frame_adam("
        "transport_momentum=False).")

  def init_fn(params):
    checks.check_frame_leaves(params, "scale_by_frame_adam")
    mu = jax.tree.map(
        lambda w: jnp.zeros_like(w, dtype=mu_dtype or w.dtype), params)
    # One scalar per frame, sharded as the frames' batch axes.
    nu = jax.tree.map(
        lambda w: jnp.zeros(w.shape[:-2], arrays.compute_dtype(w.dtype),
                            out_sharding=arrays.frame_scalar_sharding(w)),
        params)
    return ScaleByFrameAdamState(jnp.zeros([], jnp.int32), mu, nu)

  def update_fn(updates, state, params=None):
    checks.require_params(params, "scale_by_frame_adam")
    checks.check_update_shapes(updates, params, "scale_by_frame_adam")
    m, scale, state = frame_adam_moments(updates, state, params, b1, b2, eps,
                                         transport_momentum, project)
    # In the params' dtype (optax's rule), whatever the gradients' dtype.
    u = jax.tree.map(lambda m, s, w: (m * s[..., None, None]).astype(w.dtype),
                     m, scale, params)
    return u, state

  return optax.GradientTransformation(init_fn, update_fn)


def frame_adam_moments(updates, state: ScaleByFrameAdamState, params,
                       b1, b2, eps, transport_momentum: bool = True,
                       project: bool = False):
  """`scale_by_frame_adam`'s update as (m, scale, new state): its step is
  u = m * scale per frame, m the new first moment in the compute dtype and
  scale = 1 / ((1 - b1^t) (sqrt(v / (1 - b2^t)) + eps)) one scalar per
  frame, 0 for a skipped frame (non-finite gradient; its m is its old
  moment) and for v = 0. Kept apart so that a fused step can take
  ||u||_F = ||m||_F scale without writing u out.
  """
  count = optax.safe_increment(state.count)

  def leaf(g_in, m, v, w):
    cdtype = arrays.compute_dtype(w.dtype)
    # Bias corrections in the frame's compute dtype (float64 frames get
    # float64 corrections, not float32 ones).
    t = count.astype(cdtype)
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    # Under Explicit mesh axes a state placed apart from the frames is
    # resharded as they are (no op where it already is, or without them).
    m = arrays.like(m, w)
    v = arrays.reshard_to(v, arrays.frame_scalar_sharding(w))
    g, m_c, w = g_in.astype(cdtype), m.astype(cdtype), w.astype(cdtype)
    # ||g||^2 is NaN or Inf iff g holds a NaN or Inf (or overflows it):
    # the reduction that v needs anyway is the finiteness test, with no
    # boolean array written. A non-finite g then only reaches values that
    # the selects below replace, so g itself needs no select.
    if project:
      mix = b1 * m_c + (1.0 - b1) * g
      # W^T mix from W^T m and W^T G: the second also gives ||P_W G||^2.
      a = arrays.gram(w, g)
      g_sq = tangent_sq_norm(w, g, a)
      m_new = mix - w @ geometry.sym(b1 * arrays.gram(w, m_c)
                                     + (1.0 - b1) * a)
    else:
      g_sq = jnp.sum(jnp.square(g), axis=(-2, -1))
      if transport_momentum:
        m_c = geometry.project_tangent(w, m_c)
      m_new = b1 * m_c + (1.0 - b1) * g
    finite = jnp.isfinite(g_sq)
    v_new = b2 * v + (1.0 - b2) * g_sq
    m_new = jnp.where(finite[..., None, None], m_new, m.astype(cdtype))
    v_new = jnp.where(finite, v_new, v)
    denom = jnp.sqrt(v_new / bc2) + eps
    live = finite & (denom > 0)
    scale = jnp.where(live, 1.0 / (bc1 * jnp.where(live, denom, 1.0)), 0.0)
    return m_new, scale, v_new

  out = jax.tree.map(leaf, updates, state.mu, state.nu, params)
  m, scale, nu = unzip(jax.tree.structure(updates), out, 3)
  mu = jax.tree.map(lambda m_new, m: m_new.astype(m.dtype), m, state.mu)
  return m, scale, ScaleByFrameAdamState(count, mu, nu)


# --------------------------------------------------------------------------
# Trust region.


@checks.renamed_keywords(max_norm="max_step_norm")
def clip_frame_norm(max_step_norm: chex.Numeric
                    ) -> optax.GradientTransformation:
  """Trust region: xi <- xi * min(1, max_step_norm / ||xi||_F), per frame.

  Applied after the learning rate, so it caps the actual step. It bounds the
  spectrum of (W + xi)^T (W + xi) = I + xi^T xi within [1, 1 + max_step_norm^2].
  `max_step_norm` may be an array, traced under jit
  (`optax.inject_hyperparams`).

  Args:
    max_step_norm: the trust-region radius (Frobenius, per frame), > 0;
      the same quantity as the aliases' `max_step_norm`. (Formerly
      `max_norm`: that keyword still works, with a DeprecationWarning.)

  Returns:
    An `optax.GradientTransformation` (state `optax.EmptyState`); its update
    needs params.

  Raises:
    ValueError: for a concrete `max_step_norm` that is not finite and > 0 (at
      once); at init, for a leaf that cannot hold frames; at update, without
      params or for a step whose shape is not its frame's.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> tx = so.clip_frame_norm(0.1)
    >>> u, _ = tx.update(jnp.ones((2, 4, 1)), tx.init(jnp.eye(4, 1)[None].repeat(2, 0)),
    ...                  jnp.eye(4, 1)[None].repeat(2, 0))
    >>> so.geometry.frame_norm(u)
    Array([0.1, 0.1], dtype=float32)
  """
  checks.check_max_step_norm("clip_frame_norm", max_step_norm,
                             optional=False)

  def init_fn(params):
    checks.check_frame_leaves(params, "clip_frame_norm")
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    checks.require_params(params, "clip_frame_norm")
    checks.check_update_shapes(updates, params, "clip_frame_norm")

    def clip(xi):
      factor = cap_factor(arrays.frame_norm(xi), max_step_norm)
      return xi * factor[..., None, None]

    return _per_frame(clip, updates, params), state

  return optax.GradientTransformation(init_fn, update_fn)


@checks.renamed_keywords(max_norm="max_step_norm")
def cap_factor(norm, max_step_norm):
  """min(1, max_step_norm / ||xi||_F) per frame from the step's norm, 1 for a
  zero step: what `clip_frame_norm` (and the aliases' one-pass update,
  from a norm it has already) scale a step by."""
  return jnp.minimum(1.0, max_step_norm / jnp.maximum(norm, max_step_norm))
