"""Optimizers for Stiefel frames, each an `optax.chain` of the transforms,
its update computed in one pass (`_one_pass`), with the chain's state.

The leaves are frames (..., d, r); wrap with `partition.frame_partition` for
kernels whose frames lie along other axes, or use `stiefel_attention`
for a whole Flax model.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from stiefel_optax import geometry, transforms

DEFAULT_MAX_STEP_NORM = 0.1


def _cap_and_retract(max_step_norm, retraction: str):
  """The trust region (if any) and the polar retraction sized for it.

  Without a cap, or with a radius traced under jit (`optax.inject_hyperparams`
  may change it between steps), no Newton–Schulz step count can be fixed in
  advance: the retraction then counts its steps at run time from the actual
  step norms (`retract_polar(max_step_norm=None)`).
  """
  if max_step_norm is None:
    return [transforms.retract_polar(retraction, max_step_norm=None)]
  radius = transforms.static_float(max_step_norm)
  if radius is not None and not radius > 0:
    raise ValueError(
        f"max_step_norm must be > 0 (or None for no trust region); got {radius}.")
  return [transforms.clip_frame_norm(max_step_norm),
          transforms.retract_polar(retraction, max_step_norm=radius)]


def stiefel_adam(learning_rate: optax.ScalarOrSchedule,
                 b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                 max_step_norm: Optional[float] = DEFAULT_MAX_STEP_NORM,
                 retraction: str = "newton_schulz",
                 mu_dtype: Optional[Any] = None,
                 orthonormal_start: str = "check"
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
    b1, b2, eps: Adam's decay rates and denominator offset.
    max_step_norm: the trust-region radius delta (Frobenius, per frame);
      None disables the cap (ablation); may be injected (traced).
    retraction: "newton_schulz" (matmul only, default) or "eigh".
    mu_dtype: dtype of the first moment.
    orthonormal_start: "check" (init names a frame that is not
      orthonormal) or "project" (the first step retracts it onto the
      manifold); see `transforms.project_to_tangent`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with the state of the chain
    check_orthonormal_start, scale_by_frame_adam, scale_by_learning_rate,
    clip_frame_norm, retract_polar, its update computed in one pass; the
    update needs params.

  Raises:
    ValueError: for an invalid `max_step_norm`, `retraction` or
      `orthonormal_start` (at once); at init, for a leaf that cannot hold
      frames or a frame that is rank-deficient or (orthonormal_start=
      "check") not orthonormal; at update, without params.

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
  check = transforms.check_orthonormal_start(orthonormal_start)

  def moment(updates, states, params):
    updates, check_state = check.update(updates, states[0], params)
    m, scale, adam_state = transforms.frame_adam_moments(
        updates, states[1], params, b1, b2, eps, project=True)
    return m, scale, (check_state, adam_state)

  return _one_pass(
      [check, transforms.scale_by_frame_adam(b1, b2, eps, mu_dtype=mu_dtype,
                                             project=True)],
      moment, learning_rate, max_step_norm, retraction)


def _one_pass(lead_links, lead, learning_rate, max_step_norm,
              retraction: str) -> optax.GradientTransformationExtraArgs:
  """optax.chain(*lead_links, scale_by_learning_rate(learning_rate),
  *_cap_and_retract(...)), with that chain's state, its update computed in
  one pass: the links hand on per-frame scalars instead of steps.

  `lead(updates, lead_states, params) -> (m, scale, new lead_states)` does
  the lead links' work (scale None: 1 per frame). The step is xi = m s per
  frame with s = -lr scale min(1, delta / (lr scale ||m||_F)), so the cap
  and the Newton–Schulz scale take ||xi||_F = |s| ||m||_F from m (for
  `stiefel_adam` the new moment, which the state stores anyway), and XLA
  fuses m s into W + xi: xi is never written out. The chain writes the
  lead links' step and the capped step and reads each once more for its
  norm (four more passes over the frames; on CPU also a recomputation
  each, as XLA's reductions there do not absorb the selects that skip a
  non-finite frame). Equal to the chain up to rounding
  (tests/test_transforms.py); frames below float32 keep the step in
  float32 between the links, where the chain rounds it to their dtype.
  """
  links = [*lead_links, optax.scale_by_learning_rate(learning_rate),
           *_cap_and_retract(max_step_norm, retraction)]
  n = len(lead_links)
  radius = (None if max_step_norm is None
            else transforms.static_float(max_step_norm))

  def capped(m, s):
    """(s, ||xi||_F) per frame after the cap."""
    norm = geometry.frame_norm(m) * jnp.abs(s)
    if max_step_norm is None:
      return s, norm
    factor = transforms.cap_factor(norm, max_step_norm)
    return s * factor, norm * factor

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args    # as optax.chain: no link here takes any
    m, scale, lead_states = lead(updates, state[:n], params)
    if scale is None:
      scale = jax.tree.map(
          lambda w: jnp.ones(w.shape[:-2], geometry.compute_dtype(w.dtype)),
          params)
    s, lr_state = links[n].update(scale, state[n])       # -lr scale
    s, norm = transforms.unzip(jax.tree.structure(updates),
                               jax.tree.map(capped, m, s), 2)
    u = jax.tree.map(
        lambda m, s, norm, w, g: transforms.retraction_update(
            m * s[..., None, None], w, retraction, radius, step_norm=norm,
            out_dtype=g.dtype),
        m, s, norm, params, updates)
    # The cap and the retraction keep no state (EmptyState).
    return u, (*lead_states, lr_state, *state[n + 1:])

  return optax.GradientTransformationExtraArgs(optax.chain(*links).init,
                                               update_fn)


def riemannian_sgd(learning_rate: optax.ScalarOrSchedule, *,
                   max_step_norm: Optional[float] = None,
                   retraction: str = "newton_schulz",
                   orthonormal_start: str = "check"
                   ) -> optax.GradientTransformation:
  """Fixed-step Riemannian SGD: W+ = polar(W - lr P_W(G)).

  Unlike `stiefel_adam` the step is proportional to the gradient's scale.
  orthonormal_start as in `stiefel_adam`. The chain project_to_tangent ->
  scale_by_learning_rate -> clip_frame_norm -> retract_polar, computed in
  one pass as `stiefel_adam`'s.

  Args:
    learning_rate: a float or an optax schedule.
    max_step_norm: an optional trust-region radius (Frobenius, per frame);
      None (default): no cap.
    retraction: "newton_schulz" (matmul only, default) or "eigh".
    orthonormal_start: as in `stiefel_adam`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with that chain's state; its
    update needs params.

  Raises:
    ValueError: as `stiefel_adam`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 2))
    >>> tx = so.riemannian_sgd(0.1)
    >>> u, _ = tx.update(jnp.ones((8, 2)), tx.init(w), w)
    >>> bool(so.isometry_error(optax.apply_updates(w, u)) < 1e-5)
    True
  """
  project = transforms.project_to_tangent(orthonormal_start)

  def tangent(updates, states, params):
    g, project_state = project.update(updates, states[0], params)
    return g, None, (project_state,)

  return _one_pass([project], tangent, learning_rate, max_step_norm,
                   retraction)
