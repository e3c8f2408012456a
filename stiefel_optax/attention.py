"""`stiefel_attention`: the attention query/key frames on the Stiefel
manifold, every other parameter on AdamW, in one line.

    tx = stiefel_optax.stiefel_attention(1e-3)      # was: optax.adamw(1e-3)
"""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
import optax

from stiefel_optax import aliases, partition, specs as specs_lib


def _euclidean_eps(eps):
  """AdamW's eps: `eps`, or optax's default 1e-8 where eps = 0 (AdamW would
  divide 0 / 0 on coordinates with zero gradient). Works for an eps that
  `optax.inject_hyperparams` passes as an array."""
  if isinstance(eps, (int, float)):
    return eps if eps > 0 else 1e-8
  return jnp.where(eps > 0, eps, 1e-8)


def stiefel_attention(
    learning_rate: optax.ScalarOrSchedule, *,
    stiefel_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    weight_decay: float = 1e-4,
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
    max_step_norm: Optional[float] = aliases.DEFAULT_MAX_STEP_NORM,
    frames: specs_lib.Selector = None,
    orthonormal_start: str = "check",
    retraction: str = "newton_schulz",
    mu_dtype: Optional[Any] = None,
    stiefel_tx: Optional[optax.GradientTransformation] = None,
    euclidean_tx: Optional[optax.GradientTransformation] = None,
    stack_frames: bool = False,
) -> optax.GradientTransformation:
  """Stiefel-Adam on the attention query/key frames, AdamW on the rest.

  Per frame W (one per head by default) with gradient G
  (`stiefel_adam`)::

      g  = P_W(G),  m = b1 P_W(m) + (1 - b1) g,  v = b2 v + (1 - b2) ||g||_F^2
      xi = -lr m_hat / (sqrt(v_hat) + eps),  capped at ||xi||_F <= max_step_norm
      W+ = polar(W + xi)

  Every other leaf, and the parts of fused kernels that are not frames, get
  `optax.adamw`.

  Args:
    learning_rate: AdamW's learning rate (float or schedule).
    stiefel_learning_rate: the frames' (default: learning_rate).
    weight_decay: AdamW's decoupled weight decay (the frames get none; it
      would have zero Riemannian gradient anyway).
    b1, b2, eps: shared by both groups, except that eps = 0 (the
      scale-free Stiefel step) gives AdamW optax's default 1e-8: AdamW
      divides per coordinate, and a coordinate whose gradient has been zero
      would be 0 / 0 = NaN. Pass `euclidean_tx` for any other AdamW eps.
    max_step_norm: trust-region radius per frame; None disables it.
    frames: where the frames are (`specs`): None / "auto" recognises Flax
      (linen, nnx), Gemma and MaxText layouts by path and shape, and
      Equinox `eqx.nn.MultiheadAttention` modules (heads read from each),
      and raises where it cannot decide; "flax", "gemma", "maxtext",
      "equinox" force a preset; a mapping {path_regex: FrameSpec | None} or
      a callable (path, leaf) -> FrameSpec | None describes any other model
      (a fused nanoGPT `c_attn`: {r"c_attn/kernel$": fused_qkv(num_heads)};
      Haiku's `hk.MultiHeadAttention`: `haiku_mha(num_heads)`).
    orthonormal_start: "check" (default: `init` names any frame that is not
      orthonormal; call `orthonormalize` first) or "project" (the first
      step retracts such frames onto the manifold, changing the model).
    retraction: "newton_schulz" (default, matmul only) or "eigh".
    mu_dtype: first-moment dtype of both groups.
    stiefel_tx, euclidean_tx: replace either group's transform, e.g.
      `stiefel_tx=stiefel_optax.riemannian_sgd(1e-2)`.
    stack_frames: True: update the frames of equal shape from all leaves
      as one batch (`frame_partition`): fewer, larger products, one kernel
      launch per product on an accelerator; "auto": only up to
      `partition.AUTO_STACK_BYTES` per stack (on a CPU large stacks outgrow
      the caches and run slower); False (default): per leaf. Stacked, the
      optimizer state holds one stack per shape instead of one moment per
      leaf, so a checkpoint restores only into an optimizer with the same
      setting. Stack only kernels that are sharded alike.

  Non-finite gradients: the library skips the frame (a Stiefel frame whose
  gradient holds a NaN or Inf gets a zero step and keeps its moments; see
  `scale_by_frame_adam`); the AdamW group does not skip. To skip whole steps wrap the whole optimizer:
  `optax.apply_if_finite(stiefel_attention(...), max_consecutive_errors)`.

  Composes with `optax.inject_hyperparams` (learning rates, weight_decay,
  b1, b2, eps and max_step_norm may be scheduled; a preset name, FrameSpec
  or mapping passed as `frames` needs no static_args, a callable selector
  does: static_args=("frames",)).

  Returns:
    An `optax.GradientTransformationExtraArgs` (`frame_partition`) whose
    state is a `FramePartitionState`; its update needs params.

  Raises:
    ValueError: for an invalid option (at once); at init, when the selector
      cannot decide a leaf's layout or selects nothing, or a selected frame
      is rank-deficient or (orthonormal_start="check") not orthonormal; at
      update, without params or for a state made with another
      `stack_frames` setting. Each message names the leaf and a fix.

  References:
    R. D. Guerrero, "Stiefel Attention: When the Geometry of Transformer
    Projection Matrices Dominates Optimizer Choice — and When It Does Not",
    arXiv 2609.19363, 2026.

  Example (a Flax linen attention layer; flax is the ``flax`` extra):

    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import stiefel_optax as so
    >>> model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    >>> x = jnp.ones((1, 4, 16))
    >>> params = so.orthonormalize(model.init(jax.random.key(0), x)["params"])
    >>> tx = so.stiefel_attention(1e-3)
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x)))(params)
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> bool(so.max_isometry_error(optax.apply_updates(params, updates)) < 1e-5)
    True
  """
  inner = stiefel_tx or aliases.stiefel_adam(
      stiefel_learning_rate if stiefel_learning_rate is not None
      else learning_rate, b1, b2, eps, max_step_norm=max_step_norm,
      retraction=retraction, mu_dtype=mu_dtype,
      orthonormal_start=orthonormal_start)
  rest = euclidean_tx or optax.adamw(learning_rate, b1, b2,
                                     _euclidean_eps(eps),
                                     weight_decay=weight_decay,
                                     mu_dtype=mu_dtype)
  return partition.frame_partition(inner, rest, frames,
                                   orthonormal_start=orthonormal_start,
                                   stack_frames=stack_frames)
