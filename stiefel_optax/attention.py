"""`stiefel_attention`: the attention query/key frames on the Stiefel
manifold, every other parameter on AdamW, in one line.

    tx = stiefel_optax.stiefel_attention(1e-3)      # was: optax.adamw(1e-3)
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stiefel_optax import (
    aliases, bound as bound_lib, gains as gains_lib, partition, selector)


class _DefaultFloat(float):
  """A number default of `stiefel_attention`, told apart from the same value
  passed explicitly (`_given`). `optax.inject_hyperparams` still takes it for
  a number and injects it, converted as a Python float is (its `dtype`)."""
  __slots__ = ()
  dtype = np.dtype(float)


class _Default:
  """Any other default of `stiefel_attention` (None, a str), told apart
  from the same value passed explicitly; it reads as its value."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __repr__(self):
    return repr(self.value)


def _value(x):
  """An argument's value: a default's own value, else the argument."""
  if isinstance(x, _DefaultFloat):
    return float(x)
  return x.value if isinstance(x, _Default) else x


def _given(x) -> bool:
  """Whether an argument was passed: not a default, and not an array
  (`optax.inject_hyperparams` passes every number as an array, passed or
  not, so those cannot be told apart)."""
  return not isinstance(x, (_DefaultFloat, _Default, jax.Array))


# The arguments each given transform makes stiefel_attention ignore.
_STIEFEL_ONLY = ("stiefel_learning_rate", "max_step_norm", "retraction")
_SHARED = ("b1", "b2", "eps", "mu_dtype")


def _check_ignored(stiefel_tx, euclidean_tx, args: dict) -> None:
  """Refuses the arguments that a given `stiefel_tx` / `euclidean_tx` would
  make `stiefel_attention` ignore silently."""
  ignored = set()
  if stiefel_tx is not None:
    ignored.update(_STIEFEL_ONLY)
  if euclidean_tx is not None:
    ignored.add("weight_decay")
  if stiefel_tx is not None and euclidean_tx is not None:
    ignored.update(_SHARED)
  names = [n for n in args if n in ignored and _given(args[n])]
  if not names:
    return
  if stiefel_tx is not None and euclidean_tx is not None:
    why = "stiefel_tx and euclidean_tx train both groups as they are"
  elif stiefel_tx is not None:
    why = "stiefel_tx trains the frames as it is"
  else:
    why = "euclidean_tx trains every other parameter as it is"
  raise ValueError(
      f"stiefel_attention: {', '.join(names)} would be ignored: {why}. Pass"
      " them to your own transform instead (e.g. stiefel_tx="
      "stiefel_optax.stiefel_adam(lr, max_step_norm=...), euclidean_tx="
      "optax.adamw(lr, weight_decay=...)), or leave them out.")


def _euclidean_eps(eps):
  """AdamW's eps: `eps`, or optax's default 1e-8 where eps = 0 (AdamW would
  divide 0 / 0 on coordinates with zero gradient). Works for an eps that
  `optax.inject_hyperparams` passes as an array."""
  if isinstance(eps, (int, float)):
    return eps if eps > 0 else 1e-8
  return jnp.where(eps > 0, eps, 1e-8)


def stiefel_attention(
    learning_rate: optax.ScalarOrSchedule, *,
    stiefel_learning_rate: Optional[optax.ScalarOrSchedule] = _Default(None),
    weight_decay: float = _DefaultFloat(1e-4),
    b1: float = _DefaultFloat(0.9), b2: float = _DefaultFloat(0.999),
    eps: float = _DefaultFloat(1e-8),
    max_step_norm: Optional[float] = _DefaultFloat(
        aliases.DEFAULT_MAX_STEP_NORM),
    frames: selector.Selector = None,
    orthonormal_start: str = "check",
    retraction: str = _Default("newton_schulz"),
    mu_dtype: Optional[Any] = _Default(None),
    stiefel_tx: Optional[optax.GradientTransformation] = None,
    euclidean_tx: Optional[optax.GradientTransformation] = None,
    stack_frames: bool = False,
    gain_constraint: Optional[Any] = None,
) -> optax.GradientTransformation:
  """Stiefel-Adam on the attention query/key frames, AdamW on the rest.

  Per frame W (one per head by default) with gradient G
  (`stiefel_adam`)::

      g  = P_W(G),  m = b1 P_W(m) + (1 - b1) g,  v = b2 v + (1 - b2) ||g||_F^2
      xi = -lr m_hat / (sqrt(v_hat) + eps),  capped at ||xi||_F <= max_step_norm
      W+ = polar(W + xi)

  Every other leaf, and the parts of fused kernels that are not frames, get
  `optax.adamw`, computed in float32 on float16 leaves and cast back
  (`aliases.upcast_float16`: in float16 AdamW's eps and small second
  moments round to zero, and optax.adamw returns NaN); every other dtype
  exactly as optax.adamw.

  Args:
    learning_rate: AdamW's learning rate (float or schedule).
    stiefel_learning_rate: the frames' (default: learning_rate).
    weight_decay: AdamW's decoupled weight decay (the frames get none; it
      would have zero Riemannian gradient anyway).
    b1: decay rate of the first moment (the momentum), in both groups.
    b2: decay rate of the second moment, in both groups: one scalar per
      frame for the frames, one per coordinate in AdamW.
    eps: offset added to the denominator sqrt(v_hat), in both groups,
      except that eps = 0 (the scale-free Stiefel step) gives AdamW optax's
      default 1e-8: AdamW divides per coordinate, and a coordinate whose
      gradient has been zero would be 0 / 0 = NaN. Pass `euclidean_tx` for
      any other AdamW eps.
    max_step_norm: trust-region radius per frame; None disables it.
    frames: where the frames are (`selector`): None / "auto" recognises Flax
      (linen, nnx), Gemma and MaxText layouts by path and shape, and
      Equinox `eqx.nn.MultiheadAttention` modules (heads read from each),
      and raises where it cannot decide; any other name of
      `FRAME_PRESETS` forces that preset (Haliax and penzai trees are
      named by their axes: "haliax", "penzai"); a mapping {path_regex: FrameSpec | None} or
      a callable (path, leaf) -> FrameSpec | None describes any other model
      (a fused nanoGPT `c_attn`: {r"c_attn/kernel$": fused_qkv(num_heads)};
      Haiku's `hk.MultiHeadAttention`: `haiku_mha(num_heads)`).
    orthonormal_start: "check" (default: `init` names any frame that is not
      orthonormal; call `orthonormalize` first) or "project" (the first
      step retracts such frames onto the manifold, changing the model).
    retraction: "newton_schulz" (default, matmul only) or "eigh".
    mu_dtype: first-moment dtype of both groups.
    stiefel_tx: replaces the frames' transform, e.g.
      `stiefel_tx=stiefel_optax.riemannian_sgd(1e-2)`. The arguments only
      the replaced transform would take are then refused rather than
      ignored, even at their defaults: `stiefel_learning_rate`,
      `max_step_norm` and `retraction`.
    euclidean_tx: replaces the transform of every other parameter (AdamW);
      `weight_decay` is then refused. With both given, `b1`, `b2`, `eps` and
      `mu_dtype` are refused too (and `learning_rate` is not used). Under
      `optax.inject_hyperparams`, which passes every number whether given
      or not, only `retraction` and `mu_dtype` can be refused.
    stack_frames: True: update the frames of equal shape from all leaves
      as one batch (`frame_partition`): fewer, larger products, one kernel
      launch per product on an accelerator; "auto": only up to
      `partition.AUTO_STACK_BYTES` per stack (on a CPU large stacks outgrow
      the caches and run slower); False (default): per leaf. Stacked, the
      optimizer state holds one stack per shape instead of one moment per
      leaf, so a checkpoint restores only into an optimizer with the same
      setting. Stack only kernels that are sharded alike.
    gain_constraint: None (default: the gains train as the rest); "box",
      "sphere" or "fixed": after the step, the pre-attention norm gains are
      projected onto that set (`project_gains` with its defaults, g_max 1),
      found by the gain preset of the same name as `frames` (a preset name;
      else "auto"), so that every logit stays within
      `attention_logit_bound`; or a `project_gains(...)` transform of your
      own (its constraint, bounds and gain selector). The whole optimizer
      is then `optax.chain(frame_partition(...), project_gains(...))`.

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
    ValueError: for an invalid option or one that a given `stiefel_tx` or
      `euclidean_tx` would make it ignore (at once); at init, when the selector
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
  args = dict(stiefel_learning_rate=stiefel_learning_rate,
              weight_decay=weight_decay, b1=b1, b2=b2, eps=eps,
              max_step_norm=max_step_norm, retraction=retraction,
              mu_dtype=mu_dtype)
  _check_ignored(stiefel_tx, euclidean_tx, args)
  (stiefel_learning_rate, weight_decay, b1, b2, eps, max_step_norm,
   retraction, mu_dtype) = (_value(v) for v in args.values())
  inner = stiefel_tx or aliases.stiefel_adam(
      stiefel_learning_rate if stiefel_learning_rate is not None
      else learning_rate, b1, b2, eps, max_step_norm=max_step_norm,
      retraction=retraction, mu_dtype=mu_dtype,
      orthonormal_start=orthonormal_start)
  # AdamW in float32 on float16 leaves (`aliases.upcast_float16`: optax's
  # eps and v underflow there, a silent NaN); every other leaf as optax.adamw.
  rest = euclidean_tx or aliases.upcast_float16(optax.adamw(
      learning_rate, b1, b2, _euclidean_eps(eps), weight_decay=weight_decay,
      mu_dtype=mu_dtype))
  tx = partition.frame_partition(inner, rest, frames,
                                 orthonormal_start=orthonormal_start,
                                 stack_frames=stack_frames)
  if gain_constraint is None:
    return tx                  # the option off: exactly the partition
  return optax.chain(tx, _gain_projection(gain_constraint, frames))


def _gain_projection(gain_constraint, frames) -> optax.GradientTransformation:
  """`stiefel_attention`'s gain_constraint as a transform: a constraint
  name with the gain preset named as `frames` (else "auto"), or the user's
  own transform."""
  if isinstance(gain_constraint, str):
    gains = (frames if isinstance(frames, str)
             and frames in gains_lib.GAIN_PRESETS else "auto")
    if gain_constraint not in bound_lib.GAIN_CONSTRAINTS:
      raise ValueError(
          f"stiefel_attention: gain_constraint={gain_constraint!r} is not one"
          f" of {list(bound_lib.GAIN_CONSTRAINTS)}; pass one of those, None,"
          " or stiefel_optax.project_gains(constraint, gains=..., g_max=...).")
    return bound_lib.project_gains(gain_constraint, gains=gains)
  if isinstance(gain_constraint, optax.GradientTransformation):
    return gain_constraint
  raise ValueError(
      f"stiefel_attention: gain_constraint={gain_constraint!r} must be None,"
      f" one of {list(bound_lib.GAIN_CONSTRAINTS)} or a transform"
      " (stiefel_optax.project_gains(...)).")
