"""The sharding of one leaf's frame view, from the leaf's own sharding.

Each axis of a frame view (batch..., d, r) comes from one kernel axis (or a
run of them), as `FrameSpec.axes`, `part_shape` and `frame_shape` say, and
takes that axis's sharding where it stays one block per device
(`view_entries`; the rules are in `sharding`'s docstring). `frame_view_spec`
is the public form, for one leaf; `sharding.state_shardings` maps a whole
optimizer state with it.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

from jax.sharding import NamedSharding, PartitionSpec

from stiefel_optax.specs import FrameSpec

_SHARDING_TYPES = (NamedSharding, PartitionSpec)


def _is_sharding(x) -> bool:
  return isinstance(x, _SHARDING_TYPES)


def _axis_names(entry) -> tuple:
  """The names of one PartitionSpec entry: () for None."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _shard_count(entry, mesh_shape) -> Optional[int]:
  """Devices an entry splits its axis over; None where the mesh is not known
  (logical names)."""
  if mesh_shape is None:
    return None
  return math.prod(mesh_shape[n] for n in _axis_names(entry))


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
  entries = tuple(spec)
  return entries + (None,) * (ndim - len(entries))


def view_entries(spec: FrameSpec, shape, entries, mesh_shape=None,
                 name: str = "leaf"):
  """(frame view entries, rest entries or None, notes) for a leaf of
  `shape` whose axes are sharded by `entries` (one PartitionSpec entry per
  axis).

  The view (`views.split_frames`) is (take?, batch..., [heads,] d, r): the taken
  parts (never sharded), the batch axes (each its kernel axis's entry), the
  heads (the column axes' entry where the shard count divides the heads, or
  always where `mesh_shape` is None), d (the row axes') and r (the column
  axes', or None with heads). `rest`, the parts that are not frames, keeps
  the leaf's axes and entries, its part axis unsharded. `notes` says what
  was dropped, one string each.
  """
  shape = tuple(shape)
  batch, rows, cols, part = spec.axes(len(shape), name)
  sub = spec.part_shape(shape, name)
  spec.frame_shape(shape, name)           # heads that do not divide: refused
  e = list(entries)
  notes = []
  rest = None
  if part is not None:
    if e[part] is not None:
      notes.append(
          f"axis {part} is sharded by {e[part]!r} but cut into {spec.parts}"
          f" parts by {spec}: the frames and the other parts are replicated"
          " along it (the split gathers the leaf along that axis; shard"
          " another axis, e.g. the rows)")
      e[part] = None
    if len(spec.take) < spec.parts:
      rest = tuple(e)

  def merged(axes, what):
    sharded = [a for a in axes if e[a] is not None]
    if not sharded:
      return None
    first = axes.index(sharded[0])
    if len(sharded) == 1 and all(sub[a] == 1 for a in axes[:first]):
      return e[sharded[0]]
    notes.append(
        f"the frames' {what} merge axes {axes} (sharded by"
        f" {[e[a] for a in axes]}), which is not one block per device: the"
        f" frames are replicated along their {what}")
    return None

  lead = (None,) if part is not None else ()
  b = tuple(e[a] for a in batch)
  d, r = merged(rows, "rows"), merged(cols, "columns")
  if spec.heads is None:
    return lead + b + (d, r), rest, notes
  k = None if r is None else _shard_count(r, mesh_shape)
  if k is not None and spec.heads % k:
    notes.append(
        f"the columns are sharded by {r!r} over {k} devices, which does not"
        f" divide heads = {spec.heads} (no whole heads per device): the frames"
        " are replicated along their heads")
    r = None
  return lead + b + (r, d, None), rest, notes


def _rebuild(sharding, entries):
  """A sharding of the kind of `sharding` with `entries`."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(*entries),
                         memory_kind=sharding.memory_kind)
  return PartitionSpec(*entries)


def _warn(notes):
  if notes:
    warnings.warn("stiefel_optax.state_shardings: " + "; ".join(notes) + ".",
                  UserWarning, stacklevel=3)


def frame_view_spec(spec: FrameSpec, shape, sharding, *, name: str = "leaf"):
  """The sharding of a leaf's frame view, and of its other parts.

  Maps the sharding of a leaf of `shape` (a `NamedSharding`, or a
  `PartitionSpec` of mesh or logical axis names) to that of its frame view
  (batch..., d, r) under `spec`, as `views.split_frames` lays it out, and to that of
  the parts that are not frames (None where every part is a frame). Each
  view axis takes the sharding of the kernel axis it comes from; a split
  axis keeps it only where it stays one block per device (module
  docstring), otherwise the view is replicated along it and a UserWarning
  names the leaf.

  Args:
    spec: the leaf's FrameSpec.
    shape: the leaf's shape.
    sharding: the leaf's NamedSharding or PartitionSpec.
    name: the leaf's path, for messages.

  Returns:
    (frames' sharding, rest's sharding or None), of the kind of `sharding`.

  Raises:
    ValueError: naming `name`, when `spec` does not fit `shape`.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> import stiefel_optax as so
    >>> so.frame_view_spec(so.FrameSpec(rows=0, cols=2), (32, 4, 8),
    ...                    P("embed", "heads", "kv"))     # linen (d, heads, hd)
    (P('heads', 'embed', 'kv'), None)
    >>> so.frame_view_spec(so.fused_qkv(4), (64, 192), P("embed", None))
    (P(None, None, 'embed', None), P('embed', None))
  """
  shape = tuple(shape)
  pspec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  mesh_shape = (dict(sharding.mesh.shape) if isinstance(sharding, NamedSharding)
                else None)
  view, rest, notes = view_entries(spec, shape, _padded(pspec, len(shape)),
                                   mesh_shape, name)
  _warn([f"{name}: {n}" for n in notes])
  return (_rebuild(sharding, view),
          None if rest is None else _rebuild(sharding, rest))
