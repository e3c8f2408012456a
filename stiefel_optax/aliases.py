"""Optimizers for Stiefel frames, each an `optax.chain` of the transforms,
its update computed in one pass (`one_pass_chain`), with the chain's state.

The leaves are frames (..., d, r); wrap with `partition.frame_partition` for
kernels whose frames lie along other axes, or use `stiefel_attention`
for a whole Flax model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
import optax

from stiefel_optax import (
    arrays, checks, geometry, retraction as retraction_lib, transforms)

DEFAULT_MAX_STEP_NORM = 0.1


def _cap_and_retract(max_step_norm, static_max_step_norm: Optional[float],
                     retraction: str, master_frames: bool = True):
  """The trust region (if any) and the polar retraction sized for it.

  `max_step_norm` is the trust region's radius as given (a float or a
  traced value), which the cap uses; `static_max_step_norm` the same as a
  Python float, None when it is traced under jit (`optax.inject_hyperparams`
  may change it between steps). Without a cap, or with a traced one, no
  Newton–Schulz step count can be fixed in advance: the retraction then
  counts its steps at run time from the actual step norms
  (`retract_polar(max_step_norm=None)`).
  """
  if max_step_norm is None:
    return [retraction_lib.retract_polar(retraction, max_step_norm=None,
                                     master_frames=master_frames)]
  return [transforms.clip_frame_norm(max_step_norm),
          retraction_lib.retract_polar(retraction,
                                   max_step_norm=static_max_step_norm,
                                   master_frames=master_frames)]


def stiefel_adam(learning_rate: optax.ScalarOrSchedule,
                 b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                 max_step_norm: Optional[float] = DEFAULT_MAX_STEP_NORM,
                 retraction: str = "newton_schulz",
                 mu_dtype: Optional[Any] = None,
                 orthonormal_start: str = "check",
                 master_frames: bool = True
                 ) -> optax.GradientTransformation:
  """Riemannian Adam on St(d, r), one scalar second moment per frame.

  Per frame W with Euclidean gradient G::

      g   = P_W(G) = G - W sym(W^T G)
      m   = b1 P_W(m) + (1 - b1) g = P_W(b1 m + (1 - b1) G)
      v   = b2 v + (1 - b2) ||g||_F^2,  ||g||_F^2 = ||G||_F^2 - ||sym(W^T G)||_F^2
      xi  = -lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
      xi  = xi min(1, max_step_norm / ||xi||_F)
      W+  = polar(W + xi)

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay rate of the first moment (the momentum, carried to the
      current tangent space by projection).
    b2: decay rate of the second moment, one scalar per frame.
    eps: offset added to the denominator sqrt(v_hat); 0 gives the
      scale-free step.
    max_step_norm: the trust-region radius (Frobenius, per frame);
      None disables the cap (ablation); may be injected (traced).
    retraction: "newton_schulz" (matmul only, default) or "eigh".
    mu_dtype: dtype of the first moment.
    orthonormal_start: "check" (init names a frame that is not
      orthonormal) or "project" (the first step retracts it onto the
      manifold); see `transforms.project_to_tangent`.
    master_frames: for frames stored below float32 (bfloat16, float16):
      True (default) keeps a float32 copy of them in the state, which the
      step starts from and retracts into; the params get that copy rounded
      to their dtype. Without it a step of norm lr, spread over d x r
      entries, falls mostly below bf16's rounding spacing and the frames
      stall (False warns so at init). No effect on float32 and float64
      frames (their state and updates are as without it).

  Returns:
    An `optax.GradientTransformationExtraArgs` with the state of the chain
    check_orthonormal_start, scale_by_frame_adam, scale_by_learning_rate,
    clip_frame_norm, retract_polar, its update computed in one pass
    (`one_pass_chain`); the update needs params. The state is the tuple
    ``(EmptyState, ScaleByFrameAdamState(count, mu, nu), <lr state>,
    EmptyState, EmptyState)``: [0] the start check, [1] the moments, [2]
    the learning rate's (``ScaleByScheduleState(count)`` for a schedule,
    else EmptyState), [3] the cap, [4] the retraction (EmptyState, or
    `MasterFramesState` with the float32 copies of frames stored below
    float32); without a cap (max_step_norm=None) entry [3] is the
    retraction. Checkpoints store this order (pinned by
    tests/test_state_layout.py).

  Raises:
    ValueError: for an invalid `max_step_norm`, `retraction` or
      `orthonormal_start` (at once); at init, for a leaf that cannot hold
      frames or a frame that is rank-deficient or (orthonormal_start=
      "check") not orthonormal; at update, without params or for a gradient
      whose shape is not its frame's.

  References:
    R. D. Guerrero, "Stiefel Attention: When the Geometry of Transformer
    Projection Matrices Dominates Optimizer Choice — and When It Does Not",
    arXiv 2609.19363, 2026.

  Example (the top-2 eigenspace of A, i.e. maximise tr(W^T A W)):

    >>> import jax, jax.numpy as jnp, optax, stiefel_optax as so
    >>> a = jnp.diag(jnp.arange(8.0))         # maximise tr(W^T A W): 7 + 6
    >>> w = so.random_frames(jax.random.key(0), (8, 2))
    >>> tx = so.stiefel_adam(0.05)
    >>> state = tx.init(w)
    >>> @jax.jit
    ... def step(w, state):
    ...   g = jax.grad(lambda w: -jnp.trace(w.T @ a @ w))(w)
    ...   u, state = tx.update(g, state, w)
    ...   return optax.apply_updates(w, u), state
    >>> for _ in range(300):
    ...   w, state = step(w, state)
    >>> round(float(jnp.trace(w.T @ a @ w)), 3), bool(so.isometry_error(w) < 1e-5)
    (13.0, True)
  """
  # The moment projects the momentum mix itself (one projection, five
  # d x r x r products per step with the retraction); the first link only
  # checks the start. The state has the structure of the unfused chain
  # (project_to_tangent, scale_by_frame_adam, ...), so checkpoints restore.
  # (one_pass_chain checks max_step_norm and retraction, naming the alias.)
  checks.check_choice("stiefel_adam", "orthonormal_start", orthonormal_start,
                      checks.ORTHONORMAL_STARTS)
  check = transforms.check_orthonormal_start(orthonormal_start)

  def moment(updates, states, params):
    updates, check_state = check.update(updates, states[0], params)
    m, scale, adam_state = transforms.frame_adam_moments(
        updates, states[1], params, b1, b2, eps, project=True)
    return m, scale, (check_state, adam_state)

  return one_pass_chain(
      [check, transforms.scale_by_frame_adam(b1, b2, eps, mu_dtype=mu_dtype,
                                             project=True)],
      moment, learning_rate, max_step_norm=max_step_norm,
      retraction=retraction, name="stiefel_adam", master_frames=master_frames)


def one_pass_chain(
    lead_links: Sequence[optax.GradientTransformation],
    lead: Callable[..., tuple],
    learning_rate: optax.ScalarOrSchedule, *,
    max_step_norm: Optional[chex.Numeric] = None,
    retraction: str = "newton_schulz",
    name: str = "one_pass_chain",
    master_frames: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """A Stiefel chain that ends in lr, trust region and retraction, in one pass.

  The chain::

      optax.chain(*lead_links, optax.scale_by_learning_rate(learning_rate),
                  clip_frame_norm(max_step_norm),       # if max_step_norm
                  retract_polar(retraction, max_step_norm=max_step_norm))

  with that chain's state, its update computed in one pass: the lead links
  hand on per-frame scalars instead of steps. `lead` gives, per frame W, a
  direction m and a scalar c; the update is::

      s  = -lr c min(1, max_step_norm / (lr c ||m||_F))   (no min without it)
      xi = s m
      u  = polar(W + xi) - W

  so the cap and the Newton–Schulz scale take ||xi||_F = abs(s) ||m||_F
  from m (for `stiefel_adam` the new first moment, which the state stores
  anyway), and XLA fuses s m into W + xi: xi is never written out (float64
  frames measure ||xi||_F once more for the scale: `geometry.retract`,
  `step_norm`). Equal to
  the chain up to rounding; frames below float32 keep the step in float32
  between the links, where the chain rounds it to their dtype. The passes
  it saves: docs/performance.rst ("The one-pass update").

  Args:
    lead_links: the chain's first transforms over frames (..., d, r); their
      inits make the lead states, and the first one checks the start
      (`check_orthonormal_start` or `project_to_tangent`).
    lead: ``lead(updates, lead_states, params) -> (m, c, new_lead_states)``,
      the lead links' update: m the direction (a tree of the updates'
      structure, each leaf of its frame's shape), c one scalar per frame
      (shape leaf.shape[:-2]) or None for 1, and the links' new states as a
      tuple.
    learning_rate: a float or an optax schedule.
    max_step_norm: the trust-region radius (Frobenius, per frame);
      None (default): no cap. May be injected (traced).
    retraction: "newton_schulz" (default, matmul only) or "eigh".
    name: the optimizer's name, which its error messages start with.
    master_frames: frames stored below float32 (bf16, f16) keep a float32
      copy in the retraction's state and the whole step starts from it
      (`retract_polar`); no effect on float32 and float64 frames.

  Returns:
    An `optax.GradientTransformationExtraArgs` with the state of the chain
    above; its update needs params, and accepts and ignores extra arguments
    (as `optax.chain` does). State layout, a tuple with one entry per link
    (the order checkpoints store; tests/test_state_layout.py pins it):
    ``state[:n]`` the n lead links' states, ``state[n]`` the learning
    rate's (``ScaleByScheduleState`` for a schedule, else EmptyState), then
    the cap's EmptyState (only with max_step_norm) and the retraction's
    EmptyState (`retraction.MasterFramesState` where frames are stored
    below float32, with master_frames). Reordering the links breaks saved
    checkpoints.

  Raises:
    ValueError: for an invalid `max_step_norm` or `retraction` (at once); at
      init, as the links' inits; at update, without params or for an update
      whose shape is not its frame's.

  Example (`riemannian_sgd` by hand: m = P_W(G), c = 1):

    >>> import jax, jax.numpy as jnp, optax, stiefel_optax as so
    >>> project = so.project_to_tangent()
    >>> def lead(updates, states, params):
    ...   g, project_state = project.update(updates, states[0], params)
    ...   return g, None, (project_state,)
    >>> tx = so.one_pass_chain([project], lead, 0.1)
    >>> chain = optax.chain(project, optax.scale_by_learning_rate(0.1),
    ...                     so.retract_polar())
    >>> w = so.random_frames(jax.random.key(0), (8, 2))
    >>> g = jax.random.normal(jax.random.key(1), (8, 2))
    >>> u, _ = tx.update(g, tx.init(w), w)
    >>> u_chain, _ = chain.update(g, chain.init(w), w)
    >>> bool(jnp.allclose(u, u_chain, atol=1e-6))
    True
  """
  # static_max_step_norm: max_step_norm as a Python float, None when it is
  # absent or traced (injected); only a static value fixes the Newton–Schulz
  # count at trace time, while the cap itself uses max_step_norm as given.
  static_max_step_norm = (
      None if max_step_norm is None
      else checks.check_max_step_norm(name, max_step_norm))
  checks.check_choice(name, "retraction", retraction, geometry.RETRACTIONS)
  links = [*lead_links, optax.scale_by_learning_rate(learning_rate),
           *_cap_and_retract(max_step_norm, static_max_step_norm, retraction,
                             master_frames)]
  n = len(lead_links)
  chain_init = optax.chain(*links).init

  def init_fn(params):
    checks.require_params(params, name)
    return chain_init(params)

  def capped(m, s):
    """(s, ||xi||_F) per frame after the cap."""
    norm = arrays.frame_norm(m) * jnp.abs(s)
    if max_step_norm is None:
      return s, norm
    factor = transforms.cap_factor(norm, max_step_norm)
    return s * factor, norm * factor

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args    # as optax.chain: no link here takes any
    checks.require_params(params, name)
    checks.check_update_shapes(updates, params, name)
    # The frames the step starts from: params, or their float32 masters
    # (frames stored below float32, `retraction.start_frames`).
    frames = retraction_lib.start_frames(state[-1], params)
    m, scale, lead_states = lead(updates, state[:n], frames)
    if scale is None:
      scale = jax.tree.map(
          lambda w: jnp.ones(w.shape[:-2], arrays.compute_dtype(w.dtype),
                             out_sharding=arrays.frame_scalar_sharding(w)),
          params)
    s, lr_state = links[n].update(scale, state[n])       # -lr scale
    s, norm = transforms.unzip(jax.tree.structure(updates),
                               jax.tree.map(capped, m, s), 2)
    xi = jax.tree.map(lambda m, s: m * s[..., None, None], m, s)
    if not isinstance(state[-1], retraction_lib.MasterFramesState):
      u = retraction_lib.retraction_updates(
          xi, params, retraction, static_max_step_norm, step_norms=norm)
      # The cap and the retraction keep no state (EmptyState).
      return u, (*lead_states, lr_state, *state[n + 1:])
    new = retraction_lib.retracted(xi, frames, retraction,
                                   static_max_step_norm, step_norms=norm)
    u, master = retraction_lib.land(new, state[-1], params)
    return u, (*lead_states, lr_state, *state[n + 1:-1], master)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def riemannian_sgd(learning_rate: optax.ScalarOrSchedule, *,
                   max_step_norm: Optional[float] = None,
                   retraction: str = "newton_schulz",
                   orthonormal_start: str = "check",
                   master_frames: bool = True
                   ) -> optax.GradientTransformation:
  """Fixed-step Riemannian SGD: W+ = polar(W - lr P_W(G)).

  Unlike `stiefel_adam` the step is proportional to the gradient's scale.
  orthonormal_start as in `stiefel_adam`. The chain project_to_tangent ->
  scale_by_learning_rate -> clip_frame_norm -> retract_polar, computed in
  one pass (`one_pass_chain`).

  Args:
    learning_rate: a float or an optax schedule.
    max_step_norm: an optional trust-region radius (Frobenius, per frame);
      None (default): no cap.
    retraction: "newton_schulz" (matmul only, default) or "eigh".
    orthonormal_start: as in `stiefel_adam`.
    master_frames: True (default): frames stored below float32 keep a
      float32 copy in the retraction's state, which the step starts from
      (see `stiefel_adam`); no effect on float32 and float64 frames.

  Returns:
    An `optax.GradientTransformationExtraArgs` with that chain's state; its
    update needs params.

  Raises:
    ValueError: as `stiefel_adam`.

  References:
    S. Bonnabel, "Stochastic gradient descent on Riemannian manifolds",
    IEEE Transactions on Automatic Control 58(9), 2013.

  Example:
    >>> import jax, jax.numpy as jnp, optax, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 2))
    >>> tx = so.riemannian_sgd(0.1)
    >>> u, _ = tx.update(jnp.ones((8, 2)), tx.init(w), w)
    >>> bool(so.isometry_error(optax.apply_updates(w, u)) < 1e-5)
    True
  """
  checks.check_choice("riemannian_sgd", "orthonormal_start",
                      orthonormal_start, checks.ORTHONORMAL_STARTS)
  project = transforms.project_to_tangent(orthonormal_start)

  def tangent(updates, states, params):
    g, project_state = project.update(updates, states[0], params)
    return g, None, (project_state,)

  return one_pass_chain([project], tangent, learning_rate,
                        max_step_norm=max_step_norm, retraction=retraction,
                        name="riemannian_sgd", master_frames=master_frames)


# --------------------------------------------------------------------------
# float16 parameters.


def _narrow_float(x) -> bool:
  """A floating-point leaf whose exponent range is narrower than float32's
  (float16, the float8 types): squares of its small gradients, and Adam's
  eps = 1e-8, underflow to zero there. bfloat16 has float32's range."""
  dtype = getattr(x, "dtype", None)
  return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
          and jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp)


def upcast_float16(inner: optax.GradientTransformation
                   ) -> optax.GradientTransformationExtraArgs:
  """`inner` computed in float32 on float16 leaves, its updates cast back.

  For each leaf x of a dtype with a narrower exponent range than float32
  (float16, float8)::

      state = inner.init(float32(params)),
      u     = dtype(inner.update(float32(G), state, float32(params)))

  Every other leaf (float32, bfloat16, float64) is handed to `inner` as it
  is, so where no leaf is float16 the wrapper changes nothing, bit for bit
  (same state, same updates). Why: `optax.adamw` on float16 parameters
  divides by sqrt(v) + eps where eps = 1e-8 and every v = g^2 below 6e-8
  round to zero in float16, so a coordinate with a small gradient gets
  m / 0 = Inf, one with a zero gradient 0 / 0 = NaN, at the first update
  and with no error.
  `stiefel_attention` wraps its default AdamW in it; wrap your own
  `euclidean_tx` the same way when it runs on float16 leaves. The state of
  float16 leaves is then float32 (twice the memory of a float16 state).

  Args:
    inner: any `optax.GradientTransformation` (extra arguments of its
      update are passed through).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `inner`'s.

  Example:
    >>> import jax.numpy as jnp, optax, stiefel_optax as so
    >>> p = {"w": jnp.ones(3, jnp.float16)}
    >>> g = {"w": jnp.array([0.0, 1e-3, 1.0], jnp.float16)}
    >>> tx = optax.adamw(1e-3)                 # v and eps round to 0
    >>> tx.update(g, tx.init(p), p)[0]["w"]
    Array([   nan,   -inf, -0.001], dtype=float16)
    >>> tx = so.aliases.upcast_float16(optax.adamw(1e-3))
    >>> tx.update(g, tx.init(p), p)[0]["w"]
    Array([-1.e-07, -1.e-03, -1.e-03], dtype=float16)
  """
  inner = optax.with_extra_args_support(inner)

  def up(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if _narrow_float(x) else x, tree)

  def init_fn(params):
    return inner.init(up(params))

  def update_fn(updates, state, params=None, **extra_args):
    new, state = inner.update(up(updates), state,
                              None if params is None else up(params),
                              **extra_args)
    # Back to the parameter's dtype (the update's where there are no
    # params), on the float16 leaves only.
    like = updates if params is None else params
    new = jax.tree.map(
        lambda u, x: u.astype(x.dtype) if _narrow_float(x) else u, new, like)
    return new, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
