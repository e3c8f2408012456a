"""Frame layouts: which axes of a kernel are the rows (d) and columns (r) of
its frames, the remaining axes being a batch of frames.

One reshape/transpose pair (`to_frames` / `from_frames`) is the single
mechanism by which every transform sees kernels as arrays (..., d, r).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

Axes = Union[int, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class FrameLayout:
  """Which axes of a leaf form the frames' rows and columns.

  Attributes:
    rows: axis (or axes, merged in order) of the frame's d rows.
    cols: axis (or axes, merged in order) of the frame's r columns.
    heads: if set, the (merged) column axis of size heads * r is split into
      `heads` frames of r columns each (head-major, as Flax lays out fused
      projections), the heads becoming the last batch axis.

  All other axes are batch axes, kept in their order. Examples for a Flax
  (d, heads, head_dim) attention kernel: `FrameLayout(0, 2)` gives one frame
  per head, `FrameLayout(0, (1, 2))` one (d, heads * head_dim) frame; for a
  2-D (d, heads * head_dim) kernel `FrameLayout(0, 1, heads=h)` gives one
  frame per head.
  """
  rows: Axes = -2
  cols: Axes = -1
  heads: Optional[int] = None

  def _axes(self, ndim: int, name: str):
    def norm(axes):
      axes = (axes,) if isinstance(axes, int) else tuple(axes)
      if not axes:
        raise ValueError(f"{name}: a layout needs at least one row and column axis.")
      for a in axes:
        if not -ndim <= a < ndim:
          raise ValueError(
              f"{name}: layout {self} names axis {a}, but the leaf has rank"
              f" {ndim}; a Stiefel frame needs rank >= 2.")
      return tuple(a % ndim for a in axes)
    rows, cols = norm(self.rows), norm(self.cols)
    if len(set(rows + cols)) != len(rows) + len(cols):
      raise ValueError(f"{name}: layout {self} repeats an axis.")
    batch = tuple(a for a in range(ndim) if a not in rows + cols)
    return batch, rows, cols

  def frame_shape(self, shape, name: str = "leaf"):
    """The (batch..., d, r) shape of the frame view of a leaf of `shape`."""
    shape = tuple(shape)
    batch, rows, cols = self._axes(len(shape), name)
    d = math.prod(shape[a] for a in rows)
    r = math.prod(shape[a] for a in cols)
    bshape = tuple(shape[a] for a in batch)
    if self.heads is not None:
      if self.heads < 1 or r % self.heads:
        raise ValueError(
            f"{name}: shape {shape} has {r} columns, not divisible into"
            f" heads = {self.heads}.")
      bshape, r = bshape + (self.heads,), r // self.heads
    return bshape + (d, r)


PER_LAST_TWO = FrameLayout(-2, -1)
FLAX_PER_HEAD = FrameLayout(0, 2)          # (d, heads, head_dim) per head
FLAX_WHOLE = FrameLayout(0, (1, 2))        # (d, heads, head_dim) as one frame

LayoutSpec = Union[FrameLayout, Callable[[tuple, jax.Array], FrameLayout]]


def to_frames(x: jax.Array, layout: FrameLayout, name: str = "leaf") -> jax.Array:
  """The frame view (batch..., d, r) of a leaf."""
  batch, rows, cols = layout._axes(x.ndim, name)
  view = layout.frame_shape(x.shape, name)
  y = jnp.transpose(x, batch + rows + cols)
  if layout.heads is None:
    return y.reshape(view)
  # (..., d, heads * r) -> (..., heads, d, r)
  y = y.reshape(view[:-3] + (view[-2], view[-3], view[-1]))
  return jnp.swapaxes(y, -3, -2)


def from_frames(y: jax.Array, layout: FrameLayout, shape) -> jax.Array:
  """Inverse of `to_frames` for a leaf of the given original shape."""
  shape = tuple(shape)
  batch, rows, cols = layout._axes(len(shape), "leaf")
  if layout.heads is not None:
    y = jnp.swapaxes(y, -3, -2)
  perm = batch + rows + cols
  y = y.reshape(tuple(shape[a] for a in perm))
  return jnp.transpose(y, tuple(sorted(range(len(shape)), key=perm.__getitem__)))


def resolve_layout(layout: LayoutSpec, path, leaf) -> FrameLayout:
  return layout(path, leaf) if callable(layout) else layout


class FrameLayoutState(NamedTuple):
  """State of `with_frame_layout`: the inner state over the frame views."""
  inner_state: optax.OptState


def with_frame_layout(inner: optax.GradientTransformation,
                      layout: LayoutSpec = PER_LAST_TWO
                      ) -> optax.GradientTransformation:
  """Runs `inner` on the frame view of every leaf and maps updates back.

  Args:
    inner: a transform over leaves of shape (..., d, r), e.g. `stiefel_adam`.
    layout: one `FrameLayout` for every leaf, or a callable
      `(path, leaf) -> FrameLayout` (paths as `jax.tree_util` key paths).
  """

  def views(tree, params):
    return jax.tree_util.tree_map_with_path(
        lambda p, x, w: to_frames(x, resolve_layout(layout, p, w),
                                  jax.tree_util.keystr(p)), tree, params)

  def init_fn(params):
    return FrameLayoutState(inner.init(views(params, params)))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("with_frame_layout needs params (the frames) in update.")
    new_updates, inner_state = inner.update(
        views(updates, params), state.inner_state, views(params, params))
    new_updates = jax.tree_util.tree_map_with_path(
        lambda p, u, w: from_frames(u, resolve_layout(layout, p, w), w.shape),
        new_updates, params)
    return new_updates, FrameLayoutState(inner_state)

  return optax.GradientTransformation(init_fn, update_fn)
