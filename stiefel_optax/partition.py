"""Label a model's query/key kernels and train them on the Stiefel manifold.

    tx = stiefel_optax.stiefel_attention(1e-3)          # one line

returns one `optax.partition` of the parameter tree: the Flax attention
query/key kernels get `stiefel_adam` on their frames (one per head by
default), every other leaf gets `optax.adamw`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stiefel_optax import aliases, geometry, layouts

STIEFEL = "stiefel"
EUCLIDEAN = "euclidean"

# Query/key kernels of flax.linen.MultiHeadDotProductAttention and
# flax.nnx.MultiHeadAttention: .../query/kernel and .../key/kernel.
DEFAULT_QK_PATTERNS = (r"(^|/)(query|key)/kernel$",)

Patterns = Union[str, Sequence[str], Callable[[str, Any], bool]]


def path_str(path) -> str:
  """'a/b/0/kernel' for a jax key path (nnx's trailing '.value' dropped)."""
  names = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      names.append(str(k))
  if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      names[-1] == "value"):
    names.pop()
  return "/".join(names)


def _matcher(patterns: Patterns) -> Callable[[str, Any], bool]:
  if callable(patterns):
    return patterns
  if isinstance(patterns, str):
    patterns = (patterns,)
  compiled = [re.compile(p) for p in patterns]
  return lambda path, leaf: any(c.search(path) for c in compiled)


def qk_labels(params, patterns: Patterns = DEFAULT_QK_PATTERNS):
  """Labels each leaf STIEFEL or EUCLIDEAN by its path.

  Args:
    params: the parameter tree (linen `variables['params']`, an nnx State...).
    patterns: regexes searched in the '/'-joined path (e.g.
      'encoder/layers_0/attn/query/kernel'), or a callable (path, leaf) -> bool.

  Raises:
    ValueError when nothing matches, listing some of the paths that exist.
  """
  match = _matcher(patterns)
  labels = jax.tree_util.tree_map_with_path(
      lambda p, x: STIEFEL if match(path_str(p), x) else EUCLIDEAN, params)
  if STIEFEL not in jax.tree.leaves(labels):
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    shown = ", ".join(paths[:12]) + (" ..." if len(paths) > 12 else "")
    raise ValueError(
        f"qk_labels: no parameter path matches {patterns!r}; the tree has"
        f" {len(paths)} leaves: {shown}. Pass patterns= (regexes or a callable"
        " on the path) that name the query/key kernels.")
  return labels


def check_labels(params, labels):
  """Returns `labels` in the structure of `params`, checked.

  A labels tree whose structure differs from that of `params` but whose
  leaves have the same paths (as `path_str` writes them) is rebuilt in the
  structure of `params`: labels computed on an `nnx.State` of Variables then
  apply to the pure dicts that `nnx.Optimizer.update` passes, and vice versa.

  Raises:
    ValueError when the paths differ (listing those only in params and those
    only in labels) or a label is not STIEFEL / EUCLIDEAN.
  """
  pdef, ldef = jax.tree.structure(params), jax.tree.structure(labels)
  if pdef != ldef:
    pitems = jax.tree_util.tree_leaves_with_path(params)
    litems = jax.tree_util.tree_leaves_with_path(labels)
    ppaths = [path_str(p) for p, _ in pitems]
    by_path = {path_str(p): l for p, l in litems}
    if (len(by_path) != len(litems) or len(set(ppaths)) != len(ppaths)
        or set(ppaths) != set(by_path)):
      raise ValueError(
          "labels do not match the params tree: only in params"
          f" {sorted(set(ppaths) - set(by_path))[:8]}, only in labels"
          f" {sorted(set(by_path) - set(ppaths))[:8]} ({len(pitems)} param"
          f" leaves, {len(litems)} labels). Compute them with"
          " stiefel_optax.qk_labels(params) on the tree the optimizer sees.")
    labels = pdef.unflatten([by_path[p] for p in ppaths])
  bad = [f"{path_str(p)}={l!r}" for p, l in
         jax.tree_util.tree_leaves_with_path(labels) if l not in (STIEFEL, EUCLIDEAN)]
  if bad:
    raise ValueError(f"labels must be {STIEFEL!r} or {EUCLIDEAN!r}; got {bad[:8]}.")
  return labels


def _resolve_labels(params, labels, patterns):
  if params is None or not jax.tree.leaves(params):
    raise ValueError(
        f"params is {'None' if params is None else 'a tree with no arrays'}:"
        " the Stiefel frames are part of the step, so init and update need"
        " the parameter tree (tx.init(params), tx.update(grads, state,"
        " params)).")
  if labels is None:
    return qk_labels(params, patterns)
  if callable(labels):
    labels = labels(params)
  return check_labels(params, labels)


def kernel_layout(leaf_shape, *, per_head: bool = True,
                  head_dim: Optional[int] = None,
                  path: str = "leaf") -> layouts.FrameLayout:
  """The frame layout of one query/key kernel.

  (..., d, heads, head_dim) (Flax's layout; leading axes, e.g. of scanned
  layers, are a batch): one frame per head, or one (d, heads * head_dim)
  frame when per_head=False. (d, cols): one frame, or frames of `head_dim`
  columns when per_head and head_dim are given. Other conventions, such as
  einsum-style (heads, d, head_dim) kernels, need `layout=` (here
  `FrameLayout(1, 2)`).
  """
  ndim = len(leaf_shape)
  if ndim == 3:
    return layouts.FLAX_PER_HEAD if per_head else layouts.FLAX_WHOLE
  if ndim > 3:
    return (layouts.FrameLayout(-3, -1) if per_head
            else layouts.FrameLayout(-3, (-2, -1)))
  if ndim == 2 and per_head and head_dim is not None:
    cols = leaf_shape[1]
    if cols % head_dim:
      raise ValueError(
          f"{path}: shape {tuple(leaf_shape)} has {cols} columns, not a"
          f" multiple of head_dim = {head_dim}.")
    return layouts.FrameLayout(0, 1, heads=cols // head_dim)
  if ndim < 2:
    raise ValueError(
        f"{path}: shape {tuple(leaf_shape)} is labelled {STIEFEL!r} but a frame"
        " needs rank >= 2.")
  return layouts.PER_LAST_TWO


def layout_fn(params, *, per_head: bool = True,
              num_heads: Optional[int] = None,
              head_dim: Optional[int] = None,
              layout: Optional[layouts.LayoutSpec] = None):
  """The `(path, leaf) -> FrameLayout` for the Stiefel leaves of `params`.

  For 2-D fused kernels, `num_heads` gives head_dim = (widest 2-D kernel's
  columns) / num_heads, so grouped-query key kernels with fewer heads split
  into frames of the query's head_dim.
  """
  if layout is not None:
    return layout
  if head_dim is None and num_heads is not None:
    widths = [x.shape[-1] for x in jax.tree.leaves(params) if x.ndim == 2]
    if widths:
      head_dim = max(widths) // num_heads
  return lambda path, leaf: kernel_layout(
      leaf.shape, per_head=per_head, head_dim=head_dim, path=path_str(path))


def frames_transform(inner: optax.GradientTransformation,
                     **layout_kwargs) -> optax.GradientTransformation:
  """Runs `inner` (a transform over (..., d, r) frames) on the frame view of
  every leaf it is given, the layout derived by `layout_fn` from the leaves'
  shapes (under `optax.partition` only the Stiefel leaves are real)."""

  def wrapped(params):
    return layouts.with_frame_layout(inner, layout_fn(params, **layout_kwargs))

  return optax.GradientTransformation(
      lambda params: wrapped(params).init(params),
      lambda updates, state, params=None: wrapped(params).update(
          updates, state, params))


def check_frame_view(params, labels, layout) -> None:
  """Raises ValueError naming path and shapes of a labelled leaf whose frame
  view cannot be a frame (rank < 2, head_dim > d, non-float dtype)."""
  for (p, x), l in zip(jax.tree_util.tree_leaves_with_path(params),
                       jax.tree.leaves(labels)):
    if l != STIEFEL:
      continue
    name = path_str(p)
    shape = tuple(getattr(x, "shape", ()))
    if not jnp.issubdtype(getattr(x, "dtype", jnp.float32), jnp.floating):
      raise ValueError(f"{name}: shape {shape} has dtype {x.dtype}; a Stiefel"
                       " frame must be floating point.")
    lay = layouts.resolve_layout(layout, p, x)
    view = lay.frame_shape(shape, name)
    if view[-1] > view[-2]:
      raise ValueError(
          f"{name}: shape {shape} gives frames of (d, r) = {view[-2:]} under"
          f" {lay}: r (head_dim) > d, so it cannot be orthonormal. Label it"
          f" {EUCLIDEAN!r} or change the layout.")


def checked_labels_and_layout(params, labels=None,
                              patterns: Patterns = DEFAULT_QK_PATTERNS,
                              **layout_kwargs):
  """(labels, per-leaf layout) of `params`, every labelled leaf checked to
  have a valid frame view (`check_frame_view`)."""
  lab = _resolve_labels(params, labels, patterns)
  stiefel_only = jax.tree.map(lambda x, l: x if l == STIEFEL else None,
                              params, lab)
  lay = layout_fn(stiefel_only, **layout_kwargs)
  check_frame_view(params, lab, lay)
  return lab, lay


def _static_int(value, name: str) -> Optional[int]:
  """num_heads / head_dim as a Python int: they fix the frames' shapes."""
  if value is None or isinstance(value, (int, np.integer)):
    return None if value is None else int(value)
  raise ValueError(
      f"stiefel_attention: {name} = {value!r} must be a Python int: it fixes"
      " the frames' shapes and cannot be a traced hyperparameter. With"
      f" optax.inject_hyperparams pass static_args=({name!r},).")


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
    per_head: bool = True,
    num_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    labels=None,
    patterns: Patterns = DEFAULT_QK_PATTERNS,
    layout: Optional[layouts.LayoutSpec] = None,
    retraction: str = "newton_schulz",
    mu_dtype: Optional[Any] = None,
    stiefel_tx: Optional[optax.GradientTransformation] = None,
    euclidean_tx: Optional[optax.GradientTransformation] = None,
) -> optax.GradientTransformation:
  """Stiefel-Adam on the attention query/key frames, AdamW on the rest.

  Args:
    learning_rate: AdamW's learning rate (float or schedule).
    stiefel_learning_rate: the Stiefel group's (default: learning_rate).
    weight_decay: AdamW's decoupled weight decay (the frames get none; it
      would have zero Riemannian gradient anyway).
    b1, b2, eps: shared by both groups, except that eps = 0 (the
      scale-free Stiefel step) gives AdamW optax's default 1e-8: AdamW
      divides per coordinate, and a coordinate whose gradient has been zero
      (an unused embedding row) would be 0 / 0 = NaN. Pass `euclidean_tx`
      for any other AdamW eps.
    max_step_norm: trust-region radius per frame; None disables it.
    per_head: one frame per head (default) or one per whole projection.
    num_heads, head_dim: how 2-D fused (d, heads * head_dim) kernels split.
    labels: a tree of STIEFEL/EUCLIDEAN, or a callable params -> labels;
      default `qk_labels(params, patterns)`.
    patterns: regexes or a callable on the path for `qk_labels`.
    layout: a `FrameLayout` or `(path, leaf) -> FrameLayout` overriding the
      per-kernel default (e.g. `FrameLayout(1, 2)` for (heads, d, head_dim)).
    retraction: "newton_schulz" (default) or "eigh".
    mu_dtype: first-moment dtype of both groups.
    stiefel_tx, euclidean_tx: replace either group's transform (ablations).

  Non-finite gradients: the library skips the frame (a Stiefel frame whose
  gradient holds a NaN or Inf gets a zero step and keeps its moments; see
  `scale_by_frame_adam`); the Euclidean AdamW group does not, so a NaN
  there reaches its leaf. To skip the whole step, wrap the whole optimizer:
  `optax.apply_if_finite(stiefel_attention(...), max_consecutive_errors)`.

  Composes with `optax.inject_hyperparams`, which may schedule or change
  between steps learning_rate, stiefel_learning_rate, weight_decay, b1, b2,
  eps and max_step_norm (a traced radius sizes the Newton–Schulz retraction
  at run time; see `aliases.stiefel_adam`):

      tx = optax.inject_hyperparams(stiefel_attention)(learning_rate=1e-3)
      state.hyperparams['learning_rate'] = 3e-4     # between steps

  num_heads and head_dim fix shapes, and inject_hyperparams treats every
  callable as a schedule, so pass those (and callable labels, patterns or
  layout, and mu_dtype given as a dtype class) as `static_args`.
  """
  num_heads = _static_int(num_heads, "num_heads")
  head_dim = _static_int(head_dim, "head_dim")
  layout_kwargs = dict(per_head=per_head, num_heads=num_heads,
                       head_dim=head_dim, layout=layout)

  def labels_fn(params):
    return checked_labels_and_layout(params, labels, patterns,
                                     **layout_kwargs)[0]

  inner = stiefel_tx or aliases.stiefel_adam(
      stiefel_learning_rate if stiefel_learning_rate is not None
      else learning_rate, b1, b2, eps, max_step_norm=max_step_norm,
      retraction=retraction, mu_dtype=mu_dtype)
  rest = euclidean_tx or optax.adamw(learning_rate, b1, b2,
                                     _euclidean_eps(eps),
                                     weight_decay=weight_decay,
                                     mu_dtype=mu_dtype)
  return optax.partition(
      {STIEFEL: frames_transform(inner, **layout_kwargs), EUCLIDEAN: rest},
      labels_fn)


def map_frames(fn: Callable[[jax.Array], jax.Array], params, labels=None, *,
               patterns: Patterns = DEFAULT_QK_PATTERNS, back: bool = True,
               **layout_kwargs):
  """Applies fn to the frame view (..., d, r) of every STIEFEL leaf.

  With back=True the result is mapped back to the leaf's shape and the
  EUCLIDEAN leaves are returned unchanged; with back=False the tree holds
  fn's raw outputs at STIEFEL leaves and None elsewhere.
  """
  lab, lay = checked_labels_and_layout(params, labels, patterns,
                                       **layout_kwargs)

  def leaf(path, x, l):
    if l != STIEFEL:
      return x if back else None
    spec = layouts.resolve_layout(lay, path, x)
    out = fn(layouts.to_frames(x, spec, path_str(path)))
    return layouts.from_frames(out, spec, x.shape) if back else out

  return jax.tree_util.tree_map_with_path(leaf, params, lab)


def orthonormalize(params, labels=None, *, method: str = "eigh",
                   **layout_kwargs):
  """Replaces each labelled kernel's frames by their polar factor.

  The nearest orthonormal frame in Frobenius norm (the polar factor of A is
  argmin ||Q - A||_F over St(d, r)); other leaves are returned unchanged.
  The factor from `method` is polished by two Newton–Schulz steps, which
  converge quadratically from a nearly orthonormal frame, so that an
  ill-conditioned A (e.g. a whole-projection frame) still lands on the
  manifold to the rounding of its dtype.
  """

  def fn(a):
    q = geometry.polar(a, method)
    polished = geometry.polar(q, "newton_schulz", num_steps=2)
    # Keep the polish only where it helped (it cannot when A was so close to
    # rank-deficient that the first factor is far off the manifold).
    better = geometry.isometry_error(polished) <= geometry.isometry_error(q)
    return jnp.where(better[..., None, None], polished, q)

  return map_frames(fn, params, labels, **layout_kwargs)


def orthonormal_heads_init(dtype=jnp.float32):
  """A Flax initializer for (d, heads, head_dim) kernels whose per-head
  (d, head_dim) frames are Haar-random orthonormal."""

  def init(key, shape, dtype=dtype):
    shape = tuple(shape)
    if len(shape) != 3:
      raise ValueError(
          f"orthonormal_heads_init: expects (d, heads, head_dim); got {shape}.")
    frames = geometry.random_frames(key, (shape[1], shape[0], shape[2]), dtype)
    return jnp.transpose(frames, (1, 0, 2))

  return init
