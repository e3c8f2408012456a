"""`FrameSpec`: where the frames of one leaf are; the paths that name leaves.

A `FrameSpec` says which axes of one parameter leaf are the rows (d) and the
columns (r) of its Stiefel frames, whether the columns split into heads, and
whether only some equal parts of the leaf are frames (a fused Q/K/V kernel).
It gives its axes by position, or by name for leaves that carry names
(Haliax, penzai): FrameSpec(rows="embed", cols="head_size"). `path_str` is
the '/'-joined path by which selectors, diagnostics and error messages name
a leaf.

The presets that know each framework's layouts are in `families` (the
named-axes frameworks' finders in `named_axes`); the selector that gives
every leaf of a tree its spec is in `selector`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Optional, Sequence, Tuple, Union

import jax

Axes = Union[int, str, Sequence[int], Sequence[str]]


def _as_axes(axes: Axes) -> Tuple[Union[int, str], ...]:
  return (axes,) if isinstance(axes, (int, str)) else tuple(axes)


def _is_name(axis) -> bool:
  return isinstance(axis, str)


@dataclasses.dataclass(frozen=True)
class FrameSpec:
  """Where the frames of one leaf are.

  Attributes:
    rows: axis (or axes, merged in order) of the frames' d rows.
    cols: axis (or axes, merged in order) of the frames' r columns.
    heads: if set, the (merged) columns split into `heads` frames of
      r / heads columns each, head-major (as Flax and nanoGPT lay out
      fused projections); the heads become the last batch axis.
    parts: if set, the leaf is `parts` equal blocks along `part_axis`, of
      which only those in `take` are frames; the others are trained by the
      Euclidean transform exactly as if the leaf were whole.
    take: the indices of the parts that are frames (needs `parts`).
    part_axis: the axis cut into parts; default: the first axis that is
      neither a row nor a column axis, else the column axis (a fused
      (d, 3d) Dense kernel is cut along its columns).

  Every other axis is a batch of frames. Axes count on the whole leaf, so a
  spec reads like the leaf's shape.

  Axes may instead be *names* (str), for leaves that carry their axes' names
  (Haliax's NamedArray, penzai's NamedArray): FrameSpec(rows="embed",
  cols="head_size") fits Haliax's (embed, heads, head_size) and Levanter's
  (layer, kv_head, q_heads_per_group, head_size, embed) alike, every axis
  not named being a batch axis. A named spec is resolved (`resolve`) against each
  leaf's names (`frame_specs` does it), giving the positional spec that the
  views, the step and `state_shardings` use. A spec names all its axes or
  none.

  Raises:
    ValueError: at construction, for a spec with no row or column axis, a
      `heads` or `parts` that is not a positive int, `take` or `part_axis`
      without `parts`, a `take` that does not list distinct parts in
      increasing order, or a spec that mixes names and positions.

  Example:
    >>> from stiefel_optax import FrameSpec
    >>> FrameSpec(rows=0, cols=2).frame_shape((64, 4, 16))       # linen MHA
    (4, 64, 16)
    >>> FrameSpec(rows=-2, cols=-1, parts=2, take=(0,)).frame_shape(
    ...     (2, 1, 64, 16))                                 # gemma kv_einsum
    (1, 1, 1, 64, 16)
    >>> FrameSpec(rows=0, cols=1, parts=3, take=(0, 1), heads=4).frame_shape(
    ...     (64, 192))                                      # nanoGPT c_attn
    (2, 4, 64, 16)
    >>> FrameSpec(rows="embed", cols="head_size").resolve(   # Levanter q_proj
    ...     ("layer", "kv_head", "q_heads_per_group", "head_size", "embed"))
    FrameSpec(rows=4, cols=3)
  """
  rows: Axes = -2
  cols: Axes = -1
  heads: Optional[int] = None
  parts: Optional[int] = None
  take: Tuple[int, ...] = ()
  part_axis: Optional[int] = None

  def __post_init__(self):
    object.__setattr__(self, "rows", _as_axes(self.rows))
    object.__setattr__(self, "cols", _as_axes(self.cols))
    object.__setattr__(self, "take", tuple(int(t) for t in _as_axes(self.take)))
    if not self.rows or not self.cols:
      raise ValueError(f"{self}: a frame needs at least one row and one"
                       " column axis.")
    axes = self.rows + self.cols + (
        () if self.part_axis is None else (self.part_axis,))
    if any(not isinstance(a, (int, str)) or isinstance(a, bool)
           for a in axes):
      raise ValueError(f"{self}: axes must be ints (positions) or strs"
                       " (names).")
    if len({_is_name(a) for a in axes}) > 1:
      raise ValueError(
          f"{self}: mixes axis names and positions; name every axis (for"
          " leaves that carry names) or give every axis by position.")
    if self.heads is not None and not (isinstance(self.heads, int)
                                       and self.heads >= 1):
      raise ValueError(f"{self}: heads must be a positive int.")
    if self.parts is None:
      if self.take or self.part_axis is not None:
        raise ValueError(f"{self}: take/part_axis need parts.")
    else:
      if not (isinstance(self.parts, int) and self.parts >= 1):
        raise ValueError(f"{self}: parts must be a positive int.")
      if (not self.take or len(set(self.take)) != len(self.take)
          or any(not 0 <= t < self.parts for t in self.take)
          or tuple(sorted(self.take)) != self.take):
        raise ValueError(
            f"{self}: take must list distinct parts in increasing order,"
            f" each in [0, {self.parts}).")

  @property
  def named(self) -> bool:
    """Whether the spec names its axes (str) instead of giving positions."""
    return _is_name(self.rows[0])

  def resolve(self, names: Sequence[Optional[str]],
              name: str = "leaf") -> "FrameSpec":
    """The positional spec of a named spec on a leaf whose axes are `names`.

    Each named axis is the position of its name; every axis not named
    (including unnamed, positional axes, given as None) is a batch axis.
    A positional spec is returned as is.

    Args:
      names: the leaf's axis names in its data order (None for an axis
        without a name).
      name: the leaf's name in error messages.

    Returns:
      A FrameSpec of positions, the same heads and parts.

    Raises:
      ValueError: naming `name` and its axes, when a named axis is not among
        `names` or is there twice.

    Example:
      >>> from stiefel_optax import FrameSpec
      >>> FrameSpec(rows="embedding", cols="projection").resolve(
      ...     ("embedding", "heads", "projection"))               # penzai
      FrameSpec(rows=0, cols=2)
    """
    if not self.named:
      return self
    names = tuple(names)

    def pos(axis):
      hits = [i for i, n in enumerate(names) if n == axis]
      if len(hits) != 1:
        raise ValueError(
            f"{name}: {self} names axis {axis!r}, but the leaf's axes are"
            f" {names}{'' if hits else ' (no such name)'}. Pass a FrameSpec"
            " that names the leaf's own row axis (the model width) and"
            " column axis (the head dimension), each once.")
      return hits[0]

    return dataclasses.replace(
        self, rows=tuple(pos(a) for a in self.rows),
        cols=tuple(pos(a) for a in self.cols),
        part_axis=None if self.part_axis is None else pos(self.part_axis))

  def __repr__(self):
    fields = [f"rows={_fmt(self.rows)}", f"cols={_fmt(self.cols)}"]
    for name in ("heads", "parts"):
      if getattr(self, name) is not None:
        fields.append(f"{name}={getattr(self, name)}")
    if self.take:
      fields.append(f"take={self.take}")
    if self.part_axis is not None:
      fields.append(f"part_axis={self.part_axis!r}")
    return f"FrameSpec({', '.join(fields)})"

  def axes(self, ndim: int, name: str = "leaf"):
    """The spec's axes on a leaf of rank `ndim`.

    Args:
      ndim: the leaf's rank.
      name: the leaf's name in error messages.

    Returns:
      (batch, rows, cols, part_axis): tuples of non-negative axes, and the
      part axis (None without parts).

    Raises:
      ValueError: naming `name`, for an axis out of range or used twice, or
        a named spec (`resolve` it against the leaf's names first).
    """
    if self.named:
      raise ValueError(
          f"{name}: {self} names its axes; resolve it against the leaf's axis"
          " names first (spec.resolve(names)); frame_specs does that for"
          " leaves that carry names (Haliax, penzai).")
    def norm(axes):
      for a in axes:
        if not -ndim <= a < ndim:
          raise ValueError(
              f"{name}: {self} names axis {a}, but the leaf has rank {ndim}.")
      return tuple(a % ndim for a in axes)
    rows, cols = norm(self.rows), norm(self.cols)
    if len(set(rows + cols)) != len(rows) + len(cols):
      raise ValueError(f"{name}: {self} uses an axis twice.")
    batch = tuple(a for a in range(ndim) if a not in rows + cols)
    part = None
    if self.parts is not None:
      if self.part_axis is not None:
        (part,) = norm((self.part_axis,))
      else:
        part = batch[0] if batch else cols[0]
    return batch, rows, cols, part

  def part_shape(self, shape, name: str = "leaf"):
    """Shape of one part of a leaf of `shape` (the leaf's without parts).

    Args:
      shape: the leaf's shape.
      name: the leaf's name in error messages.

    Returns:
      The shape with the part axis divided by `parts`.

    Raises:
      ValueError: naming `name`, when `parts` does not divide the part axis.
    """
    shape = tuple(shape)
    _, _, _, part = self.axes(len(shape), name)
    if part is None:
      return shape
    if shape[part] % self.parts:
      raise ValueError(
          f"{name}: shape {shape} has {shape[part]} entries along axis"
          f" {part}, not divisible into parts = {self.parts} ({self}).")
    return shape[:part] + (shape[part] // self.parts,) + shape[part + 1:]

  def frame_shape(self, shape, name: str = "leaf"):
    """The (batch..., d, r) shape of the frames of a leaf of `shape`.

    Args:
      shape: the leaf's shape.
      name: the leaf's name in error messages.

    Returns:
      The frame view's shape: the taken parts (if any) first, then the
      batch axes in order, then heads, then (d, r).

    Raises:
      ValueError: naming `name`, when the spec does not fit the shape
        (axes, parts or heads that do not divide).
    """
    shape = tuple(shape)
    batch, rows, cols, _ = self.axes(len(shape), name)
    sub = self.part_shape(shape, name)
    d = math.prod(sub[a] for a in rows)
    r = math.prod(sub[a] for a in cols)
    bshape = ((len(self.take),) if self.parts else ()) + tuple(
        sub[a] for a in batch)
    if self.heads is not None:
      if r % self.heads:
        raise ValueError(
            f"{name}: shape {shape} has {r} columns per frame block, not"
            f" divisible into heads = {self.heads} ({self}). Pass the"
            f" model's own number of heads (a divisor of {r}).")
      bshape, r = bshape + (self.heads,), r // self.heads
    return bshape + (d, r)


def _fmt(axes):
  return repr(axes[0]) if len(axes) == 1 else repr(axes)


# --------------------------------------------------------------------------
# Paths.


def path_str(path) -> str:
  """The '/'-joined path of a leaf, as selectors and diagnostics name it.

  nnx's trailing 'value' is dropped, so that an `nnx.State` of Variables and
  its pure dict have the same paths; so is the trailing index 0 of a node
  registered without keys (the array inside Haliax's NamedArray), so that a
  Haliax weight is 'q_proj/weight', not 'q_proj/weight/0'.

  Args:
    path: a jax key path (`jax.tree_util.tree_leaves_with_path`).

  Returns:
    A str such as 'layers/0/kernel'.

  Example:
    >>> import jax, stiefel_optax as so
    >>> [so.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(
    ...     {"layers": [{"kernel": 1.0}]})]
    ['layers/0/kernel']
  """
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == "value") and len(path) > 1:
    path = path[:-1]
  elif path and isinstance(path[-1], jax.tree_util.FlattenedIndexKey) and (
      path[-1].key == 0) and len(path) > 1:
    path = path[:-1]
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _nearby(target: str, paths: Sequence[str], n: int = 6) -> str:
  close = difflib.get_close_matches(target, paths, n=n, cutoff=0.0)
  return ", ".join(close) if close else "(no leaves)"
