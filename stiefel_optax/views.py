"""Frame views: a leaf under its `FrameSpec` as frames (batch..., d, r), and
back.

One pair of maps is the single mechanism by which every transform and helper
sees kernels as frames::

    split_frames(x, spec)          -> (frames (batch..., d, r), rest or None)
    merge_frames(frames, rest, spec, shape) -> the leaf

`rest` holds the parts of a fused leaf that are not frames, in the leaf's own
axis order (only the part axis is shorter), so the Euclidean transform
trains them exactly as if the leaf were whole.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from stiefel_optax import selector
from stiefel_optax.specs import FrameSpec


def _runs(indices):
  """Maximal runs of consecutive indices, as (start, stop) pairs."""
  runs = []
  for i in indices:
    if runs and runs[-1][1] == i:
      runs[-1][1] = i + 1
    else:
      runs.append([i, i + 1])
  return runs


def _gather(y, indices):
  """y[indices] along axis 0 for static indices, by slices (no gather op)."""
  pieces = [y[a:b] for a, b in _runs(indices)]
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, 0)


def _parts_first(x, parts: int, part: int):
  """(parts, ...): the part axis cut into `parts` blocks, moved first."""
  n = x.shape[part]
  y = x.reshape(x.shape[:part] + (parts, n // parts)
                + x.shape[part + 1:])
  return jnp.moveaxis(y, part, 0)


def _parts_back(y, part: int):
  """Inverse of `_parts_first` for any number of leading parts."""
  y = jnp.moveaxis(y, 0, part)
  return y.reshape(y.shape[:part] + (y.shape[part] * y.shape[part + 1],)
                   + y.shape[part + 2:])


def _frame_perm(spec: FrameSpec, ndim: int, name: str):
  """(perm of the frame block to batch + rows + cols, its rank)."""
  batch, rows, cols, part = spec.axes(ndim, name)
  if part is None:
    return batch + rows + cols
  shift = lambda axes: tuple(a + 1 for a in axes)
  return (0,) + shift(batch) + shift(rows) + shift(cols)


def split_frames(x: jax.Array, spec: FrameSpec, name: str = "leaf"):
  """A leaf's frame view (batch..., d, r), and its parts that are not frames.

  The frames are the parts `spec` takes; rest the other parts (None when
  every part is a frame).

  Args:
    x: a leaf.
    spec: its `FrameSpec`.
    name: the leaf's name in error messages.

  Returns:
    (frames, rest): the frame view of shape `spec.frame_shape(x.shape)`,
    and the parts that are not frames in the leaf's own axis order (only
    the part axis shorter), or None.

  Raises:
    ValueError: naming `name`, when `spec` does not fit the leaf's shape.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> frames, rest = so.split_frames(jnp.zeros((16, 48)), so.fused_qkv(2))
    >>> frames.shape, rest.shape          # q and k heads; the v third as is
    ((2, 2, 16, 8), (16, 16))
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    # An abstract leaf (tx.init on a tree of ShapeDtypeStructs, as optax's
    # transforms take it): the views' shapes, dtypes and shardings.
    return jax.eval_shape(lambda y: split_frames(y, spec, name), x)
  view = spec.frame_shape(x.shape, name)
  _, _, _, part = spec.axes(x.ndim, name)
  rest = None
  block = x
  if part is not None:
    y = _parts_first(x, spec.parts, part)
    block = _gather(y, spec.take)
    others = [i for i in range(spec.parts) if i not in spec.take]
    if others:
      rest = _parts_back(_gather(y, others), part)
  perm = _frame_perm(spec, x.ndim, name)
  y = jnp.transpose(block, perm)
  if spec.heads is None:
    return y.reshape(view), rest
  # (..., d, heads * r) -> (..., heads, d, r)
  y = y.reshape(view[:-3] + (view[-2], view[-3], view[-1]))
  return jnp.swapaxes(y, -3, -2), rest


def to_frames(x: jax.Array, spec: FrameSpec, name: str = "leaf") -> jax.Array:
  """The frame view (batch..., d, r) of a leaf (its taken parts only).

  Args:
    x: a leaf.
    spec: its `FrameSpec`.
    name: the leaf's name in error messages.

  Returns:
    The frames, shape `spec.frame_shape(x.shape)`.

  Raises:
    ValueError: as `split_frames`.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> so.to_frames(jnp.zeros((16, 2, 4)), so.FrameSpec(rows=0, cols=2)).shape
    (2, 16, 4)
  """
  return split_frames(x, spec, name)[0]


def merge_frames(frames: jax.Array, rest, spec: FrameSpec, shape) -> jax.Array:
  """Inverse of `split_frames` for a leaf of `shape`.

  Args:
    frames: the frame view, shape `spec.frame_shape(shape)`.
    rest: the parts that are not frames, as `split_frames` returns them (None when
      every part is a frame).
    spec: the leaf's `FrameSpec`.
    shape: the leaf's shape.

  Returns:
    The leaf, of `shape`.

  Raises:
    ValueError: when `rest` is None but `spec` leaves parts out (use
      `from_frames`, which fills them with zeros), or `spec` does not fit
      `shape`.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> x = jnp.arange(16.0 * 48).reshape(16, 48)
    >>> spec = so.fused_qkv(2)
    >>> bool((so.merge_frames(*so.split_frames(x, spec), spec, x.shape) == x).all())
    True
  """
  shape = tuple(shape)
  ndim = len(shape)
  _, _, _, part = spec.axes(ndim)
  perm = _frame_perm(spec, ndim, "leaf")
  block_shape = spec.part_shape(shape)
  if part is not None:
    block_shape = (len(spec.take),) + block_shape
  y = frames
  if spec.heads is not None:
    y = jnp.swapaxes(y, -3, -2)
  y = y.reshape(tuple(block_shape[a] for a in perm))
  block = jnp.transpose(y, tuple(sorted(range(len(perm)), key=perm.__getitem__)))
  if part is None:
    return block
  if rest is None:
    if len(spec.take) < spec.parts:
      # The leaf's other parts are part of its shape: never drop them.
      raise ValueError(
          f"merge_frames: {spec} takes {len(spec.take)} of {spec.parts} parts"
          f" of a leaf of shape {shape}; pass the other parts as rest (or use"
          " from_frames, which fills them with zeros).")
    return _parts_back(block, part)
  rest_parts = _parts_first(rest, spec.parts - len(spec.take), part)
  pieces, t, o = [], 0, 0
  for i in range(spec.parts):
    if i in spec.take:
      pieces.append(block[t:t + 1]); t += 1
    else:
      pieces.append(rest_parts[o:o + 1]); o += 1
  return _parts_back(jnp.concatenate(pieces, 0), part)


def from_frames(frames: jax.Array, spec: FrameSpec, shape, rest=None):
  """Inverse of `to_frames`.

  Args:
    frames: the frame view, shape `spec.frame_shape(shape)`.
    spec: the leaf's `FrameSpec`.
    shape: the leaf's shape.
    rest: the parts that are not frames; None: zeros (as for an update
      that only moves frames).

  Returns:
    The leaf, of `shape`.

  Raises:
    ValueError: when `spec` does not fit `shape`.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> spec = so.FrameSpec(rows=0, cols=2)
    >>> so.from_frames(jnp.ones((2, 16, 4)), spec, (16, 2, 4)).shape
    (16, 2, 4)
  """
  _, _, _, part = spec.axes(len(shape))
  if part is not None and rest is None and len(spec.take) < spec.parts:
    sub = list(spec.part_shape(shape))
    sub[part] *= spec.parts - len(spec.take)
    rest = jnp.zeros(sub, frames.dtype)
  return merge_frames(frames, rest, spec, shape)


def map_frames(fn: Callable[[jax.Array], jax.Array], params,
               frames: selector.Selector = None, *, back: bool = True):
  """Applies fn to the frame view (batch..., d, r) of every selected leaf.

  Args:
    fn: a function of one frame view.
    params: a parameter tree.
    frames: the frame selector (`frame_specs`); None: the default "auto".
    back: True: fn's result (of the view's shape) replaces the frames;
      False: collect fn's results by path.

  Returns:
    back=True: the tree of `params` with every selected leaf's frames
    replaced by fn's result, everything else (other leaves, parts that are
    not frames) unchanged; back=False: {path: fn(view)} for the selected
    leaves.

  Raises:
    ValueError: as `frame_specs`.

  Example:
    >>> import jax.numpy as jnp
    >>> from stiefel_optax import map_frames
    >>> tree = {"query": {"kernel": jnp.ones((8, 2, 4))}}
    >>> map_frames(lambda w: w.shape, tree, back=False)
    {'query/kernel': (2, 8, 4)}
  """
  items = selector.frame_specs(params, frames)
  if not back:
    return {path: fn(to_frames(x, spec, path))
            for path, x, spec in items if spec is not None}
  leaves = []
  for path, x, spec in items:
    if spec is None:
      leaves.append(x)
      continue
    view, rest = split_frames(x, spec, path)
    leaves.append(merge_frames(fn(view), rest, spec, x.shape))
  return jax.tree.structure(params).unflatten(leaves)
