"""Where the frames of a model are: `FrameSpec`, the presets, one selector.

A `FrameSpec` says which axes of one parameter leaf are the rows (d) and the
columns (r) of its Stiefel frames, whether the columns split into heads, and
whether only some equal parts of the leaf are frames (a fused Q/K/V kernel).
A *selector* maps a whole parameter tree to one spec (or None, Euclidean) per
leaf; it is one of

* a preset name: ``"flax"``, ``"gemma"``, ``"maxtext"``, ``"equinox"``
  (reads each ``eqx.nn.MultiheadAttention``'s head count from the module),
  ``"haliax"`` (Levanter's ``q_proj``/``k_proj`` ``haliax.nn.Linear``s, by
  their axis names), ``"penzai"`` (penzai's query/key Parameters, by label
  and axis names), or ``"auto"`` (the default, ``None``), which recognises
  all of them by paths and shapes, module types and axis names, and never
  leaves a leaf that looks like a query/key projection (`looks_like_qk`)
  to the Euclidean transform silently: it selects it or raises, naming it;
* ``haiku_mha(num_heads)``, a mapping for ``hk.MultiHeadAttention``;
* ``fused_qkv(num_heads, transposed=False)`` for a fused (d, 3 d) kernel
  (transposed: transformers' Flax GPT-2's (3 d, d)), and
  ``maxtext_fused_qkv(num_query_heads, num_kv_heads)`` for MaxText's fused
  ``qkv_proj`` (which "maxtext" and the default take by themselves);
* a mapping ``{path_regex: FrameSpec | None}`` (regexes searched in the
  '/'-joined path; every entry must match a leaf);
* a callable ``(path, leaf) -> FrameSpec | None``;
* one `FrameSpec` for every leaf (trees that hold only frames).

A `FrameSpec` gives its axes by position, or by name for leaves that carry
names (Haliax, penzai): FrameSpec(rows="embed", cols="head_size").

The selector drives everything that touches frames: the partition of
`stiefel_attention`, the frame views, `orthonormalize` and the diagnostics
(as `optax.contrib.muon`'s dimension numbers drive Muon).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

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
  not named being a batch axis. A named spec is `resolve`d against each
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
      ValueError: naming `name`, when the spec does not fit the shape (axes,
      parts or heads that do not divide).
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


# --------------------------------------------------------------------------
# Presets.

QK_KERNEL = r"(^|/)(query|key)/kernel$"
_GEMMA_Q = r"(^|/)q_einsum/w$"
_GEMMA_KV = r"(^|/)kv_einsum/w$"
_GEMMA_QKV = r"(^|/)qkv_einsum/w$"
_FUSED = r"(^|/)c_attn/kernel$"
# transformers' Flax Llama (`modeling_flax_llama.py`): nn.Dense kernels
# `model/layers/{i}/self_attn/q_proj/kernel` (d, num_attention_heads *
# head_dim) and `k_proj/kernel` (d, num_key_value_heads * head_dim).
_LLAMA_QK = r"(^|/)(q_proj|k_proj)/kernel$"
_LLAMA_FRAMES_HINT = (
    "{r'q_proj/kernel$': FrameSpec(rows=0, cols=1,"
    " heads=config.num_attention_heads), r'k_proj/kernel$': FrameSpec("
    "rows=0, cols=1, heads=config.num_key_value_heads)}")
# hk.MultiHeadAttention: {name}/query/w, {name}/key/w, (d, num_heads * key_size).
HAIKU_QK = r"(^|/)(query|key)/w$"

# flax linen MultiHeadDotProductAttention / nnx MultiHeadAttention:
# (d, heads, head_dim), nn.scan stacks (layers, d, heads, head_dim).
FLAX = FrameSpec(rows=-3, cols=-1)
# MaxText: (embed, heads, head_dim), scanned (embed, layers, heads, head_dim).
MAXTEXT = FrameSpec(rows=0, cols=-1)
# gemma: q_einsum (N, D, H); kv_einsum (2, K, D, H), [0] = key;
# qkv_einsum (3, N, D, H), [0] = q, [1] = k (when K == N).
GEMMA_Q = FrameSpec(rows=-2, cols=-1)
GEMMA_KV = FrameSpec(rows=-2, cols=-1, parts=2, take=(0,), part_axis=0)
GEMMA_QKV = FrameSpec(rows=-2, cols=-1, parts=3, take=(0, 1), part_axis=0)


def fused_qkv(num_heads: int, transposed: bool = False) -> FrameSpec:
  """The spec of a fused q/k/v kernel: nanoGPT's (d, 3 d) `c_attn`.

  Its q and k thirds are frames, one per head; the v third is trained as
  the rest. transformers' Flax GPT-2 stores the same kernel transposed,
  (3 d, d) (its `FlaxConv1D` keeps (features, in) and multiplies by the
  transpose): pass `transposed=True` for it. A spec of one orientation on a
  kernel of the other is refused by name (a (3 d, d) kernel whose d the
  heads divide would otherwise train the wrong frames).

  Args:
    num_heads: the model's number of heads (GPT-2: `config.n_head`).
    transposed: True for a (3 d, d) kernel (transformers' Flax GPT-2).

  Returns:
    FrameSpec(rows=0, cols=1, parts=3, take=(0, 1), heads=num_heads), rows
    and columns swapped when `transposed`.

  Raises:
    ValueError: if `num_heads` is not a positive int.

  Example:
    >>> from stiefel_optax import fused_qkv
    >>> fused_qkv(4).frame_shape((128, 384))
    (2, 4, 128, 32)
    >>> fused_qkv(4, transposed=True).frame_shape((384, 128))  # HF GPT-2
    (2, 4, 128, 32)
  """
  rows, cols = (1, 0) if transposed else (0, 1)
  return FrameSpec(rows=rows, cols=cols, parts=3, take=(0, 1),
                   heads=num_heads)


def maxtext_fused_qkv(num_query_heads: int, num_kv_heads: Optional[int] = None,
                      tensor_parallelism: int = 1) -> FrameSpec:
  """The spec of MaxText's fused `qkv_proj` kernel (`fused_qkv=True`).

  MaxText (`maxtext/layers/attentions.py`, `init_qkv_w`, since its GQA
  support of July 2026, release 0.2.4 on) stores q, k and v heads on one
  axis: (embed, Nq + 2 Nkv, head_dim), scanned (embed, layers, Nq + 2 Nkv,
  head_dim), and splits each tensor-parallel shard's heads into its q, k
  and v heads (`split_qkv` under `shard_map`), so with the heads sharded
  `tensor_parallelism` ways the kernel holds that many [q | k | v] blocks.
  The q and k heads are frames (rows embed, columns head_dim); the v heads
  are trained as the rest. The preset "maxtext" and the default read Nq
  from the sibling `out/kernel` and assume no tensor parallelism over the
  heads; pass this spec when the heads are sharded.

  Args:
    num_query_heads: Nq, the model's `num_query_heads`.
    num_kv_heads: Nkv, its `num_kv_heads` (default: Nq, plain MHA).
    tensor_parallelism: the number of shards of the heads axis in the
      attention's `shard_map` (MaxText's tensor parallelism; 1: none).

  Returns:
    FrameSpec(rows=0, cols=-1, parts=..., take=..., part_axis=-2): the
    heads axis cut into units of Nkv / tensor_parallelism heads, the q and
    k units taken.

  Raises:
    ValueError: when Nkv does not divide Nq (MaxText refuses it too) or the
      tensor parallelism does not divide Nkv.

  Example:
    >>> from stiefel_optax import maxtext_fused_qkv
    >>> spec = maxtext_fused_qkv(4, 2)          # GQA: 4 q, 2 k, 2 v heads
    >>> spec.frame_shape((32, 3, 8, 16))        # scanned: 3 layers
    (3, 3, 2, 32, 16)
  """
  nq, nkv, t = num_query_heads, (
      num_query_heads if num_kv_heads is None else num_kv_heads), (
          tensor_parallelism)
  if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
             for n in (nq, nkv, t)):
    raise ValueError(
        f"maxtext_fused_qkv({nq}, {nkv}, tensor_parallelism={t}): head counts"
        " and tensor parallelism must be positive ints.")
  if nq % nkv or nkv % t:
    raise ValueError(
        f"maxtext_fused_qkv({nq}, {nkv}, tensor_parallelism={t}): num_kv_heads"
        " must divide num_query_heads (MaxText's GQA) and tensor_parallelism"
        " must divide num_kv_heads (each shard holds whole k and v heads).")
  # Units of nkv / t heads: per shard nq / nkv q units, one k and one v unit.
  per = nq // nkv + 2
  take = tuple(s * per + j for s in range(t) for j in range(per - 1))
  return FrameSpec(rows=0, cols=-1, parts=t * per, take=take, part_axis=-2)


def haiku_mha(num_heads: int, module: Optional[str] = None) -> dict:
  """The selector of `hk.MultiHeadAttention`'s query and key projections.

  Haiku stores them as `{module}/query/w` and `{module}/key/w` of shape
  (d, num_heads * key_size), head h in columns [h k, (h + 1) k): 2-D, so the
  head count is not in the shape and the default refuses them. Each head's
  frame is W[:, h k:(h + 1) k], of shape (d, key_size); a leading layer axis
  (`hk.layer_stack`) is a batch of frames.

  Args:
    num_heads: the module's `num_heads`.
    module: the module's Haiku name (e.g. "encoder/~/multi_head_attention");
      default: every `.../query/w` and `.../key/w` leaf. Modules with
      different head counts: merge one mapping per module,
      `{**haiku_mha(8, "enc/~/mha"), **haiku_mha(4, "dec/~/mha")}`.

  Returns:
    {path_regex: FrameSpec(rows=-2, cols=-1, heads=num_heads)}, a `frames=`.

  Raises:
    ValueError: if `num_heads` is not a positive int or `module` is not a
      non-empty str.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> params = {"mha/query": {"w": jnp.zeros((16, 16)), "b": jnp.zeros(16)}}
    >>> so.selected_frames(params, so.haiku_mha(num_heads=2))
    {'mha/query/w': FrameSpec(rows=-2, cols=-1, heads=2)}
  """
  spec = FrameSpec(rows=-2, cols=-1, heads=num_heads)
  if module is None:
    return {HAIKU_QK: spec}
  if not isinstance(module, str) or not module:
    raise ValueError(f"haiku_mha: module={module!r} must be the module's"
                     " Haiku name (a non-empty str), or None for every one.")
  return {rf"(^|/){re.escape(module.strip('/'))}/(query|key)/w$": spec}


def _reads_tree(make):
  """Marks a preset that reads the whole tree (a head count that only a
  module holds): make(params) -> (path, leaf) -> FrameSpec | None."""
  make.reads_tree = True
  return make


class _Undecided(ValueError):
  """A preset recognised a leaf by name but cannot fix its layout."""


def _shape_error(path, shape, preset, wanted):
  return _Undecided(
      f"{path}: shape {tuple(shape)} does not fit preset {preset!r}"
      f" (expects {wanted}). Pass frames={{{path!r}: FrameSpec(...)}} with the"
      " leaf's row and column axes.")


def _qk_kernels(spec: FrameSpec, preset: str, wanted: str):
  """The preset that gives `spec` to rank-3/4 .../query|key/kernel leaves."""
  def select(path, leaf):
    if not re.search(QK_KERNEL, path):
      return None
    if leaf.ndim in (3, 4):
      return spec
    raise _shape_error(path, leaf.shape, preset, wanted)
  return select


_flax = _qk_kernels(FLAX, "flax", "(d, heads, head_dim) or nn.scan's"
                    " (layers, d, heads, head_dim)")
_maxtext_qk = _qk_kernels(MAXTEXT, "maxtext", "(embed, heads, head_dim) or"
                          " scanned (embed, layers, heads, head_dim)")

# MaxText's fused_qkv=True kernel. Since release 0.2.4 (`init_qkv_w`):
# (embed, Nq + 2 Nkv, head_dim), kernel_axes ("embed", "heads", "kv"); before
# (MHA only): (embed, 3, heads, head_dim), ("embed", "qkv", "heads", "kv").
# Scanned layers add axis 1 (param_scan_axis). The head counts are not in
# its shape: Nq is the first axis of the sibling out projection, `out/kernel`
# (Nq, head_dim, embed), scanned (Nq, layers, head_dim, embed).
_MAXTEXT_QKV = r"(^|/)qkv_proj/kernel$"
MAXTEXT_QKV3 = FrameSpec(rows=0, cols=-1, parts=3, take=(0, 1), part_axis=-3)


def _axis_shards(leaf, axis: int) -> int:
  """How many ways a concrete array's sharding cuts `axis` (1: unknown)."""
  try:
    sharding = leaf.sharding
    entry = tuple(sharding.spec)[axis] if axis < len(sharding.spec) else None
    names = (() if entry is None else (entry,) if isinstance(entry, str)
             else tuple(entry))
    return math.prod(sharding.mesh.shape[n] for n in names)
  except Exception:       # tracers, abstract values, other shardings
    return 1


def _maxtext_fused_specs(params) -> dict:
  """{path: spec, or the message of the fix} of every MaxText fused
  `.../qkv_proj/kernel` of `params`."""
  leaves = {path_str(p): x for p, x in
            jax.tree_util.tree_leaves_with_path(params)}
  out = {}
  for path, leaf in leaves.items():
    if not re.search(_MAXTEXT_QKV, path) or not hasattr(leaf, "shape"):
      continue
    shape = tuple(leaf.shape)
    sibling = path[:-len("qkv_proj/kernel")] + "out/kernel"
    o = tuple(getattr(leaves.get(sibling), "shape", ()))
    fix = (f" Pass frames={{{path!r}: stiefel_optax.maxtext_fused_qkv("
           "num_query_heads, num_kv_heads)} with the model's head counts.")
    if len(o) not in (3, 4):
      out[path] = (
          f"{path}: shape {shape} looks like MaxText's fused q/k/v kernel"
          " (fused_qkv=True: (embed, [layers,] Nq + 2 Nkv, head_dim)), whose"
          " query and key heads cannot be told from its shape, and the tree"
          f" has no out projection {sibling!r} of shape (Nq, [layers,]"
          f" head_dim, embed) to read Nq from ({o or 'no such leaf'})." + fix)
      continue
    scanned, nq = len(o) == 4, o[0]
    head_dim, embed = o[-2], o[-1]
    spec = None
    if (len(shape) == 4 + scanned and shape[-3] == 3 and shape[-2] == nq
        and shape[-1] == head_dim and shape[0] == embed):
      spec, heads_axis = MAXTEXT_QKV3, len(shape) - 2  # before release 0.2.4
    elif (len(shape) == 3 + scanned and shape[-1] == head_dim
          and shape[0] == embed and shape[-2] > nq
          and (shape[-2] - nq) % 2 == 0 and nq % ((shape[-2] - nq) // 2) == 0):
      spec = maxtext_fused_qkv(nq, (shape[-2] - nq) // 2)
      heads_axis = len(shape) - 2
    if spec is None:
      out[path] = (
          f"{path}: shape {shape} does not fit MaxText's fused q/k/v kernel"
          f" beside its out projection {sibling!r} of shape {o} (Nq = {nq}):"
          f" expected (embed, {'layers, ' if scanned else ''}Nq + 2 Nkv,"
          f" head_dim) or (embed, {'layers, ' if scanned else ''}3, Nq,"
          " head_dim)." + fix)
      continue
    shards = _axis_shards(leaf, heads_axis)
    if shards > 1 and spec is not MAXTEXT_QKV3:
      nkv = (shape[-2] - nq) // 2
      out[path] = (
          f"{path}: shape {shape}, MaxText's fused q/k/v kernel (Nq = {nq},"
          f" Nkv = {nkv}), has its heads axis sharded {shards} ways; MaxText"
          " splits each tensor-parallel shard's heads into q, k and v, so"
          " which heads are q and k depends on the attention's tensor"
          f" parallelism. Pass frames={{{path!r}:"
          f" stiefel_optax.maxtext_fused_qkv({nq}, {nkv},"
          " tensor_parallelism=T)} with T the shards of the activations'"
          " heads axis.")
      continue
    out[path] = spec
  return out


@_reads_tree
def _maxtext(params):
  fused = _named_leaf(_maxtext_fused_specs(params))
  return lambda path, leaf: fused(path, leaf) or _maxtext_qk(path, leaf)


def _gemma(path, leaf):
  shape = tuple(getattr(leaf, "shape", ()))
  if re.search(_GEMMA_Q, path):
    if len(shape) == 3:
      return GEMMA_Q
    raise _shape_error(path, shape, "gemma", "q_einsum (N, D, H)")
  if re.search(_GEMMA_KV, path):
    if len(shape) == 4 and shape[0] == 2:
      return GEMMA_KV
    raise _shape_error(path, shape, "gemma", "kv_einsum (2, K, D, H)")
  if re.search(_GEMMA_QKV, path):
    if len(shape) == 4 and shape[0] == 3:
      return GEMMA_QKV
    raise _shape_error(path, shape, "gemma", "qkv_einsum (3, N, D, H)")
  return None


def _auto(path, leaf):
  """The presets, recognised by path and shape; never a silent guess."""
  spec = _gemma(path, leaf)
  if spec is not None:
    return spec
  if re.search(QK_KERNEL, path):
    if leaf.ndim == 3:
      return FLAX          # flax and (unscanned) MaxText agree here
    if leaf.ndim == 4 and re.search(r"(^|/)self_attention/", path):
      return MAXTEXT
    if leaf.ndim == 4:
      raise _Undecided(
          f"{path}: shape {tuple(leaf.shape)} is a stacked attention kernel"
          " whose layer axis cannot be told from the path: pass"
          " frames='flax' for nn.scan's (layers, d, heads, head_dim) or"
          " frames='maxtext' for (embed, layers, heads, head_dim).")
    if leaf.ndim == 2:
      raise _Undecided(
          f"{path}: shape {tuple(leaf.shape)} is a 2-D attention kernel whose"
          " heads cannot be told from its shape: pass"
          f" frames={{{QK_KERNEL!r}: FrameSpec(rows=0, cols=1, heads=H)}}"
          " (one frame per head) or FrameSpec(rows=0, cols=1) (one frame).")
  if re.search(_LLAMA_QK, path) and leaf.ndim == 2:
    raise _Undecided(
        f"{path}: shape {tuple(leaf.shape)} is a 2-D q_proj/k_proj kernel"
        " (d, heads * head_dim), as transformers' Flax Llama (and Mistral,"
        " Gemma, Qwen2) stores it, whose heads cannot be told from its shape:"
        f" pass frames={_LLAMA_FRAMES_HINT}.")
  if re.search(HAIKU_QK, path) and leaf.ndim in (2, 3):
    raise _Undecided(
        f"{path}: shape {tuple(leaf.shape)} is an attention projection in"
        " hk.MultiHeadAttention's layout (d, num_heads * key_size), whose heads"
        " cannot be told from its shape: pass"
        " frames=stiefel_optax.haiku_mha(num_heads), i.e."
        f" {{{HAIKU_QK!r}: FrameSpec(rows=-2, cols=-1, heads=num_heads)}}.")
  if re.search(_FUSED, path):
    raise _Undecided(f"{path}: {_fused_advice(leaf.shape)}")
  return None


def _fused_advice(shape) -> str:
  """What a fused c_attn kernel of `shape` is, and the spec that fits it."""
  shape = tuple(shape)
  if len(shape) == 2 and shape[0] == 3 * shape[1]:
    d, helper, spec = shape[1], "fused_qkv(num_heads, transposed=True)", (
        "FrameSpec(rows=1, cols=0, parts=3, take=(0, 1), heads=num_heads)")
    what = ("a fused q/k/v kernel stored (3 d, d), as transformers' Flax"
            " GPT-2 stores c_attn (FlaxConv1D keeps (features, in))")
  elif len(shape) == 2 and shape[1] == 3 * shape[0]:
    d, helper, spec = shape[0], "fused_qkv(num_heads)", (
        "FrameSpec(rows=0, cols=1, parts=3, take=(0, 1), heads=num_heads)")
    what = "a fused q/k/v kernel stored (d, 3 d), as nanoGPT's c_attn"
  else:
    return (f"shape {shape} looks like a fused q/k/v kernel but is neither"
            " (d, 3 d) nor (3 d, d): pass frames={path_regex: FrameSpec("
            "rows=<its input axis>, cols=<its output axis>, parts=3, take=(0,"
            " 1), heads=num_heads)} (the q and k thirds as frames), or None"
            " to train it as the rest.")
  return (f"shape {shape} is {what}: pass frames={{{_FUSED!r}:"
          f" stiefel_optax.{helper}}}, i.e. {spec}, with num_heads the"
          f" model's head count (a divisor of d = {d}; GPT-2: config.n_head).")


# Names of query/key projections in real code, one path component each
# (matched case-insensitively): flax/MaxText/haiku/t5x query, key; Llama-style
# q_proj, k_proj; Meta's wq, wk; gemma's q_einsum, kv_einsum, qkv_einsum;
# nanoGPT/GPT-2 c_attn (and GPT-2's cross-attention q_attn); MaxText's
# qkv_proj; GPT-NeoX query_key_value; MosaicBERT Wqkv; torch's in_proj;
# diffusers to_q/to_k; DistilBERT q_lin/k_lin; Equinox query_proj/key_proj.
_QK_NAMES = frozenset((
    "query", "key", "q", "k", "wq", "wk", "w_q", "w_k", "q_proj", "k_proj",
    "query_proj", "key_proj", "q_lin", "k_lin", "to_q", "to_k", "q_attn",
    "q_einsum", "kv_einsum", "qkv_einsum", "qkv", "qkv_proj", "wqkv",
    "w_qkv", "c_attn", "query_key_value", "in_proj", "to_qkv", "kv",
    "kv_proj", "wkv", "qk", "qk_proj"))
# Of those, the ones that fuse several projections in one kernel.
_FUSED_NAMES = frozenset((
    "kv_einsum", "qkv_einsum", "qkv", "qkv_proj", "wqkv", "w_qkv", "c_attn",
    "query_key_value", "in_proj", "to_qkv", "kv", "kv_proj", "wkv", "qk",
    "qk_proj"))
# The other projections of an attention layer.
_ATTN_NAMES = _QK_NAMES | frozenset((
    "value", "v", "wv", "wo", "w_v", "w_o", "v_proj", "o_proj", "out_proj",
    "value_proj", "output_proj", "v_lin", "out_lin", "to_v", "to_out",
    "attn_vec_einsum", "c_proj", "out"))
# A leaf whose last component is one of these is no projection kernel.
_NOT_KERNEL = frozenset(("bias", "b", "scale", "offset"))


def _components(path: str):
  parts = [c.lower() for c in path.split("/") if c]
  return parts, set(parts[:-1]) | ({parts[-1]} if parts else set())


def _is_matrix(leaf) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return (len(getattr(leaf, "shape", ())) >= 2 and dtype is not None
          and jnp.issubdtype(dtype, jnp.floating))


def looks_like_qk(path: str, leaf) -> bool:
  """Whether a leaf looks like a query/key projection kernel.

  A floating leaf of rank >= 2 with a path component named as real code
  names query/key projections (query, key, q_proj, k_proj, wq, wk, qkv,
  qkv_proj, c_attn, q_einsum, kv_einsum, ...; any case), not a bias or a
  scale. The default selector ("auto") refuses to leave such a leaf to the
  Euclidean transform silently.

  Args:
    path: the leaf's '/'-joined path (`path_str`).
    leaf: the leaf (an array, or anything with shape and dtype).

  Returns:
    True when it looks like a query/key projection.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> w = jnp.zeros((64, 64))
    >>> so.specs.looks_like_qk("model/layers/0/self_attn/q_proj/kernel", w)
    True
    >>> so.specs.looks_like_qk("model/layers/0/self_attn/q_proj/bias", w)
    False
  """
  parts, names = _components(path)
  return bool(parts) and parts[-1] not in _NOT_KERNEL and _is_matrix(
      leaf) and bool(names & _QK_NAMES)


def _looks_like_attention(path: str, leaf) -> bool:
  """A leaf that looks like any attention projection (q, k, v or out)."""
  parts, names = _components(path)
  return bool(parts) and parts[-1] not in _NOT_KERNEL and _is_matrix(leaf) and (
      bool(names & _ATTN_NAMES)
      or any("attn" in c or "attention" in c for c in parts[:-1]))


def _looks_fused(path: str, leaf) -> bool:
  parts, names = _components(path)
  shape = tuple(leaf.shape)
  return bool(names & _FUSED_NAMES) or (
      len(shape) == 2 and max(shape) in (2 * min(shape), 3 * min(shape)))


def _describe_leaf(path: str, leaf) -> str:
  fused = " (looks fused)" if _looks_fused(path, leaf) else ""
  return f"{path} {tuple(leaf.shape)}{fused}"


def _is_eqx_mha(x) -> bool:
  # Without equinox imported a tree holds no Equinox module: never import it.
  eqx = sys.modules.get("equinox")
  return eqx is not None and isinstance(x, eqx.nn.MultiheadAttention)


def equinox_specs(params) -> dict:
  """The specs of every `eqx.nn.MultiheadAttention`'s query/key weights.

  The head count is read from each module.

  `eqx.nn.Linear` stores W in (out, in) layout, here (num_heads * qk_size,
  query_size), head-major: head h's frame is W[h k:(h + 1) k, :]^T, of shape
  (query_size, qk_size), i.e. FrameSpec(rows=-1, cols=-2, heads=num_heads);
  a leading axis (blocks stacked by `eqx.filter_vmap`) is a batch of frames.
  Equinox is never imported here: without it a tree holds no Equinox module.

  Args:
    params: a tree that may hold `eqx.nn.MultiheadAttention` modules (the
      Module itself, or `eqx.filter(model, eqx.is_inexact_array)`).

  Returns:
    {path: FrameSpec(rows=-1, cols=-2, heads=num_heads)} for the query and
    key weights of every such module ({} when there is none).

  Example:
    >>> import equinox as eqx, jax, stiefel_optax as so
    >>> mha = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    >>> so.equinox_specs({"attn": mha})["attn/query_proj/weight"]
    FrameSpec(rows=-1, cols=-2, heads=2)
  """
  leaves = jax.tree_util.tree_flatten_with_path(params,
                                                is_leaf=_is_eqx_mha)[0]
  out = {}
  for path, module in leaves:
    if _is_eqx_mha(module):
      spec = FrameSpec(rows=-1, cols=-2, heads=int(module.num_heads))
      for proj in ("query_proj", "key_proj"):
        out[path_str(tuple(path) + (jax.tree_util.GetAttrKey(proj),
                                    jax.tree_util.GetAttrKey("weight")))] = spec
  return out


def _equinox_leaf(specs: dict):
  """(path, leaf) -> the spec of an Equinox MHA's query/key weight (shape
  checked against the module's num_heads), else None."""
  def select(path, leaf):
    spec = specs.get(path)
    if spec is None:
      return None
    shape = tuple(getattr(leaf, "shape", ()))
    if len(shape) < 2 or shape[-2] % spec.heads:
      raise _Undecided(
          f"{path}: shape {shape} is the weight of an eqx.nn.MultiheadAttention"
          f" with num_heads = {spec.heads}, which expects (num_heads * qk_size,"
          " query_size) (a leading layer axis allowed), rows that split into"
          f" {spec.heads} heads. Give the module a weight of that shape (or a"
          " num_heads that divides its rows), or pass"
          f" frames={{{path!r}: FrameSpec(rows=-1, cols=-2, heads=H)}}.")
    return spec
  return select


@_reads_tree
def _equinox(params):
  specs = equinox_specs(params)
  if not specs:
    items = jax.tree_util.tree_leaves_with_path(params)
    seen = ", ".join(f"{path_str(p)} {tuple(getattr(x, 'shape', ()))}"
                     for p, x in items[:6]) or "(no leaves)"
    why = ("equinox is not imported, so " if "equinox" not in sys.modules
           else "")
    raise ValueError(
        f"frames='equinox': {why}params holds no eqx.nn.MultiheadAttention"
        f" (leaves: {seen}{' ...' if len(items) > 6 else ''}). The preset"
        " reads num_heads from the modules: pass the Module tree itself,"
        " eqx.filter(model, eqx.is_inexact_array), not a dict or list of its"
        " arrays; for other attention layers pass frames={path_regex:"
        " FrameSpec(rows=-1, cols=-2, heads=num_heads)} for (out, in)"
        " weights.")
  return _equinox_leaf(specs)


# --------------------------------------------------------------------------
# Named axes: Haliax (Levanter) and penzai carry a name on every axis, so
# their frames are found by module type and axis names. Neither library is
# ever imported here: without it a tree holds none of its arrays.

# Levanter's attention: q_proj / k_proj are `haliax.nn.Linear`s from the
# model width (their `In`) to (kv_head, q_heads_per_group, head_size) or
# (kv_head, head_size) (`levanter/layers/attention.py`, out_first); under
# `Stacked` a leading `layer` axis (`levanter/models/llama.py`).
HALIAX_QK = ("q_proj", "k_proj")
HALIAX_HEAD = "head_size"
# penzai's attention (`pz.nn.Attention` of the llama-like models): the query
# and key `pz.nn.Linear`s' Parameters are labelled '{name}/query.weights' and
# '{name}/key.weights', axes 'embedding', the heads ('heads'; GQA:
# 'head_groups', 'query_heads'), 'projection'; a `LayerStack` adds its axis.
PENZAI_QK = r"(^|/)(query|key)\.weights$"
PENZAI = FrameSpec(rows="embedding", cols="projection")


def _module(name):
  return sys.modules.get(name)


def _is_named_array(x) -> bool:
  hax_core, pz_axes = _module("haliax.core"), _module("penzai.core.named_axes")
  return ((hax_core is not None and isinstance(x, hax_core.NamedArray)) or
          (pz_axes is not None and isinstance(x, pz_axes.NamedArrayBase)))


def _data_names(x) -> tuple:
  """A named array's axis names in the order of its data (None: an axis
  without a name, e.g. penzai's positional axes)."""
  if hasattr(x, "axis_names"):                              # Haliax
    return tuple(x.axis_names)
  ndim = len(x.data_array.shape)
  if hasattr(x, "data_axis_for_name"):                      # penzai view
    names = [None] * ndim
    for n, i in x.data_axis_for_name.items():
      names[i] = n
    return tuple(names)
  named = tuple(x.named_axes)                               # penzai
  return (None,) * (ndim - len(named)) + named


def axis_names(params) -> dict:
  """The axis names of every leaf of `params` that carries them.

  Haliax's `NamedArray` and penzai's `NamedArray` / `NamedArrayView` name
  their axes; a named `FrameSpec` is resolved against these names.

  Args:
    params: a parameter tree.

  Returns:
    {path: names}, one name (or None, an unnamed axis) per axis of the
    array leaf at `path` (`path_str`), in its data order; {} for a tree
    without named arrays.

  Example:
    >>> import jax, haliax as hax, stiefel_optax as so
    >>> w = hax.zeros((hax.Axis("embed", 8), hax.Axis("head_size", 4)))
    >>> so.specs.axis_names({"q_proj": {"weight": w}})
    {'q_proj/weight': ('embed', 'head_size')}
  """
  if _module("haliax.core") is None and _module(
      "penzai.core.named_axes") is None:
    return {}
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=_is_named_array)[0]:
    if _is_named_array(x):
      names = _data_names(x)
      for sub, _ in jax.tree_util.tree_leaves_with_path(x):
        out[path_str(tuple(path) + tuple(sub))] = names
  return out


def check_axis_mapping(params, mapping):
  """Checks a name -> mesh-axis mapping against the tree's axis names.

  Haliax's `infer_resource_partitions` / `hax.axis_mapping` and penzai's
  `name_to_name_sharding` shard an axis only where its name is a key of
  the mapping, and ignore a key that names no axis: a mapping written with
  another model's names ('layers' for Levanter's 'layer', 'kv_heads' for
  its 'kv_head') shards nothing, silently. This raises instead.

  Args:
    params: a tree of named arrays (a Haliax model or
      `eqx.filter(model, eqx.is_inexact_array)`; penzai's ParameterValues).
    mapping: {axis name: mesh axis (or axes), or None}; a sequence of
      (name, mesh axes) pairs is read as such a mapping.

  Returns:
    `mapping`, unchanged, so the check can wrap it where it is made.

  Raises:
    ValueError: naming every key mapped to a mesh axis that names no axis
      of `params`, the tree's axis names and the closest of them; or when
      `params` carries no axis names at all.

  Example:
    >>> import haliax as hax, stiefel_optax as so
    >>> w = hax.zeros((hax.Axis("layer", 2), hax.Axis("kv_head", 4),
    ...                hax.Axis("head_size", 8), hax.Axis("embed", 16)))
    >>> so.check_axis_mapping({"q_proj": {"weight": w}}, {"kv_head": "model"})
    {'kv_head': 'model'}
    >>> so.check_axis_mapping({"q_proj": {"weight": w}}, {"kv_heads": "model"})
    Traceback (most recent call last):
    ...
    ValueError: axis mapping {'kv_heads': 'model'}: 'kv_heads' names no axis ...
  """
  pairs = list(mapping.items() if isinstance(mapping, Mapping) else mapping)
  names = sorted({n for axes in axis_names(params).values() for n in axes
                  if n is not None})
  if not names:
    raise ValueError(
        f"axis mapping {dict(pairs)}: params carries no axis names (no Haliax"
        " or penzai named arrays), so no name can be checked. Pass the tree"
        " of named arrays the mapping shards (a Haliax model, or"
        " eqx.filter(model, eqx.is_inexact_array); penzai's values).")
  unknown = [k for k, v in pairs if v is not None and k not in names]
  if unknown:
    close = {k: ", ".join(map(repr, difflib.get_close_matches(k, names, 3,
                                                              0.5)))
             for k in unknown}
    near = "; ".join(f"{k!r} names no axis (closest: {close[k] or 'none'})"
                     for k in unknown)
    raise ValueError(
        f"axis mapping {dict(pairs)}: {near}. The tree's axes are {names};"
        " a key that names no axis shards nothing (Levanter names its axes"
        " 'layer', 'kv_head', 'q_heads_per_group', 'head_size', 'heads',"
        " 'embed', 'mlp'). Use the model's own axis names.")
  return mapping


def _axis_spec_names(spec) -> tuple:
  """The names of a Haliax AxisSpec (an Axis, a name, or a sequence)."""
  if isinstance(spec, str) or hasattr(spec, "name"):
    spec = (spec,)
  return tuple(a if isinstance(a, str) else a.name for a in spec)


def _haliax_specs(params) -> dict:
  """{weight path: named spec, or the message of a layout that does not
  fit} of every Levanter-style `q_proj` / `k_proj` `haliax.nn.Linear`:
  rows its `In` axes (what it contracts), columns its 'head_size' axis,
  every other axis (heads, groups, layers) a batch axis."""
  linear = _module("haliax.nn.linear")
  if linear is None:
    return {}
  is_linear = lambda x: isinstance(x, linear.Linear)
  out = {}
  for path, module in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=is_linear)[0]:
    if not (is_linear(module) and path and isinstance(
        path[-1], jax.tree_util.GetAttrKey) and path[-1].name in HALIAX_QK):
      continue
    where = path_str(tuple(path) + (jax.tree_util.GetAttrKey("weight"),))
    rows, cols = _axis_spec_names(module.In), _axis_spec_names(module.Out)
    if HALIAX_HEAD in cols and HALIAX_HEAD not in rows:
      out[where] = FrameSpec(rows=rows, cols=HALIAX_HEAD)
    else:
      out[where] = (
          f"{where}: a haliax.nn.Linear named {path[-1].name} (Levanter's"
          f" attention projection) from {rows} to {cols}, with no"
          f" {HALIAX_HEAD!r} output axis to take as the frames' columns."
          f" Pass frames={{{where!r}: FrameSpec(rows={rows[0]!r},"
          " cols=<the head dimension's axis name>)}, or Euclidean: None.")
  return out


def _penzai_value_type(name):
  variables = _module("penzai.core.variables")
  return None if variables is None else getattr(variables, name)


def _penzai_specs(params) -> dict:
  """{array path: named spec, or the message of a leaf that does not fit}
  of every penzai query/key weight Parameter (by label); penzai Parameters
  (mutable variables, not arrays) get the message of the fix."""
  value_t, var_t = (_penzai_value_type("ParameterValue"),
                    _penzai_value_type("AbstractVariable"))
  if value_t is None:
    return {}
  is_param = lambda x: isinstance(x, (value_t, var_t))
  out = {}
  for path, p in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=is_param)[0]:
    if isinstance(p, var_t):
      where = path_str(path)
      out[where] = (
          f"{where}: a penzai {type(p).__name__} (label {p.label!r}), a"
          " mutable variable, not an array. The optimizer takes the"
          " parameters' values, as penzai's StatefulTrainer passes them:"
          " `_, params = pz.unbind_params(model)`, then"
          " pz.freeze_params(params) (a tuple of ParameterValues).")
      continue
    if not (is_param(p) and re.search(PENZAI_QK, str(p.label))):
      continue
    value = p.value
    leaves = jax.tree_util.tree_leaves_with_path(value)
    names = _data_names(value) if _is_named_array(value) else ()
    for sub, _ in leaves:
      where = path_str(tuple(path) + (jax.tree_util.GetAttrKey("value"),)
                       + tuple(sub))
      if {"embedding", "projection"} <= set(names):
        out[where] = PENZAI
      else:
        out[where] = (
            f"{where}: penzai Parameter {p.label!r} (an attention"
            f" projection) has axes {names or 'without names'}, not"
            " 'embedding' and 'projection'. Pass frames={"
            f"{where!r}: FrameSpec(rows=<its input axis>, cols=<its head"
            " dimension>)} (names or positions), or Euclidean: None.")
  return out


def _named_leaf(specs: dict):
  """(path, leaf) -> the named spec of `specs` at path (raising its message
  for a layout that does not fit), else None."""
  def select(path, leaf):
    spec = specs.get(path)
    if isinstance(spec, str):
      raise _Undecided(spec)
    return spec
  return select


def _named_preset(name, find, what, fix):
  @_reads_tree
  def preset(params):
    specs = find(params)
    if not specs:
      items = jax.tree_util.tree_leaves_with_path(params)
      seen = ", ".join(f"{path_str(p)} {tuple(getattr(x, 'shape', ()))}"
                       for p, x in items[:6]) or "(no leaves)"
      raise ValueError(
          f"frames={name!r}: params holds no {what} (leaves: {seen}"
          f"{' ...' if len(items) > 6 else ''}). {fix}")
    return _named_leaf(specs)
  return preset


_haliax = _named_preset(
    "haliax", _haliax_specs, "haliax.nn.Linear named q_proj or k_proj",
    "The preset reads the modules and their axis names: pass the model (or"
    " eqx.filter(model, eqx.is_inexact_array)), not a dict of its arrays; for"
    " other names pass frames={path_regex: FrameSpec(rows='embed',"
    " cols='head_size')}.")
_penzai = _named_preset(
    "penzai", _penzai_specs, "penzai query/key weight ParameterValue (labels"
    " ending in '/query.weights' or '/key.weights')",
    "Pass the ParameterValues the optimizer gets (StatefulTrainer's:"
    " pz.freeze_params(pz.unbind_params(model)[1])); for other labels pass"
    " frames={path_regex: FrameSpec(rows='embedding', cols='projection')}.")


@_reads_tree
def _auto_tree(params):
  """`_auto`, and the query/key weights of Equinox MHA modules, Levanter's
  Haliax q_proj/k_proj, penzai's query/key Parameters and MaxText's fused
  qkv_proj kernels; leaves that are
  no arrays (an Equinox model's floats, bools, functions) are not frames,
  except a penzai Parameter, which is an error naming the fix."""
  eqx_leaf = _equinox_leaf(equinox_specs(params))
  named = _named_leaf({**_haliax_specs(params), **_penzai_specs(params),
                       **_maxtext_fused_specs(params)})
  return lambda path, leaf: named(path, leaf) or (
      None if not hasattr(leaf, "ndim") else (
          eqx_leaf(path, leaf) or _auto(path, leaf)))


#: The names of the preset selectors, each a ``frames=`` value: ``"auto"``
#: (the default, ``frames=None``) recognises the others by path, shape,
#: module type and axis names.
FRAME_PRESETS = ("auto", "equinox", "flax", "gemma", "haliax", "maxtext",
                 "penzai")
_PRESETS = dict(zip(FRAME_PRESETS, (_auto_tree, _equinox, _flax, _gemma,
                                    _haliax, _maxtext, _penzai)))

def compile_rules(rules: Mapping, arg: str, spec_type: type) -> dict:
  """{pattern: (compiled regex, spec)} of a `{path_regex: spec | None}`
  selector mapping passed as `arg` (``frames=``, ``gains=``), each key and
  spec checked: a ValueError names the entry and what it must be."""
  entries = {}
  for pattern, spec in rules.items():
    if not isinstance(pattern, str):
      raise ValueError(f"{arg}: key {pattern!r} must be a path regex (str).")
    if spec is not None and not isinstance(spec, spec_type):
      raise ValueError(f"{arg}[{pattern!r}] = {spec!r}: expected a"
                       f" {spec_type.__name__} or None.")
    try:
      entries[pattern] = (re.compile(pattern), spec)
    except re.error as err:
      raise ValueError(f"{arg}: {pattern!r} is not a valid regex: {err}.")
  return entries


Selector = Union[None, str, FrameSpec, Mapping[str, Optional[FrameSpec]],
                 Callable[[str, Any], Optional[FrameSpec]]]


# --------------------------------------------------------------------------
# Resolution: one spec (or None) per leaf, checked.


def _resolve(spec, path, leaf, names):
  """A named spec on `leaf` (whose axis names are `names`, None: none), as
  positions."""
  shape = tuple(leaf.shape)
  if names is None:
    raise ValueError(
        f"{path}: shape {shape} is selected by {spec}, which names its axes,"
        " but the leaf carries no axis names (a plain array). Pass the tree"
        " of named arrays (a Haliax model, or eqx.filter(model,"
        " eqx.is_inexact_array); penzai's ParameterValues) or a FrameSpec of"
        " positions, e.g. FrameSpec(rows=0, cols=-1).")
  if len(names) != len(shape):
    raise ValueError(f"{path}: shape {shape} has axis names {names} of"
                     " another rank; the tree's named arrays are malformed.")
  return spec.resolve(names, f"{path} (shape {shape})")


def _describe(leaf) -> str:
  """What a leaf that is no array is, for error messages."""
  kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
  label = getattr(leaf, "label", None)
  return f"a {kind}" + (f" (label {label!r})" if label is not None else "")


def _check_spec(spec, path, leaf):
  if spec is None:
    return None
  if not isinstance(spec, FrameSpec):
    raise ValueError(
        f"{path}: the frame selector returned {spec!r}; expected a FrameSpec"
        " or None (Euclidean).")
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise ValueError(
        f"{path}: {_describe(leaf)}, not an array, is selected as frames by"
        f" {spec}. Pass the tree of arrays the optimizer updates (Equinox:"
        " eqx.filter(model, eqx.is_inexact_array); penzai: the"
        " ParameterValues of pz.freeze_params(pz.unbind_params(model)[1]),"
        " as its StatefulTrainer does).")
  shape = tuple(getattr(leaf, "shape", ()))
  dtype = getattr(leaf, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{path}: shape {shape} with dtype {dtype} is selected"
                     f" as frames by {spec}; a Stiefel frame must be floating"
                     " point.")
  if len(shape) < 2:
    raise ValueError(f"{path}: shape {shape} is selected as frames by {spec};"
                     " a frame needs rank >= 2.")
  _check_orientation(spec, path, shape)
  view = spec.frame_shape(shape, path)
  d, r = view[-2:]
  if r > d:
    hint = ""
    if len(shape) == 3 and shape[-1] <= shape[0]:
      hint = (" If this is a (d, heads, head_dim) kernel, FrameSpec(rows=0,"
              " cols=2) fits.")
    elif len(shape) == 3 and shape[-1] <= shape[-2]:
      hint = (" If this is a (heads, d, head_dim) kernel, FrameSpec(rows=1,"
              " cols=2) fits.")
    raise ValueError(
        f"{path}: shape {shape} gives frames of (d, r) = ({d}, {r}) under"
        f" {spec}: r > d, so they cannot be orthonormal.{hint} Or leave the"
        " leaf out of frames= (Euclidean).")
  return spec


def _check_orientation(spec, path, shape):
  """Refuses a fused spec whose rows are the fused axis of a 2-D kernel.

  A fused (d, 3 d) spec (`fused_qkv`) on a kernel stored (3 d, d)
  (transformers' Flax GPT-2) cuts the wrong axis into parts; where the
  heads divide d / 3 nothing else would fail and the wrong frames would
  train. The shape tells: the part axis is 3 (or 2) times shorter than the
  other, while a (d, 3 d) kernel's part axis is the longer one."""
  if len(shape) != 2 or spec.parts not in (2, 3) or spec.named:
    return
  _, rows, cols, part = spec.axes(2, path)
  (other,) = rows if part == cols[0] else cols
  if shape[other] != spec.parts * shape[part]:
    return
  fixed = dataclasses.replace(spec, rows=cols, cols=rows,
                              part_axis=None if spec.part_axis is None
                              else other)
  helper = ""
  if spec.parts == 3 and spec.take == (0, 1) and spec.heads is not None:
    helper = (f" (stiefel_optax.fused_qkv({spec.heads}, transposed="
              f"{fixed.rows == (1,)}))")
  raise ValueError(
      f"{path}: shape {tuple(shape)} is cut into {spec.parts} parts along"
      f" axis {part} by {spec}, but its axis {other} is {spec.parts} times"
      f" longer: the fused axis is axis {other}, so this spec would train"
      " the wrong frames. A fused kernel stored (3 d, d), as transformers'"
      " Flax GPT-2 stores c_attn, takes the transposed spec: pass"
      f" {fixed}{helper}.")


def _bind(fn, params):
  """A per-leaf selector: a tree-reading preset bound to `params`."""
  return fn(params) if getattr(fn, "reads_tree", False) else fn


def _selector_fn(frames: Selector, params=None):
  """(fn(path, leaf) -> spec | None, entries that must each match a leaf,
  description) for the tree `params`."""
  if frames is None:
    frames = "auto"
  if isinstance(frames, str):
    if frames not in _PRESETS:
      raise ValueError(f"frames={frames!r} is not a preset; the presets are"
                       f" {list(FRAME_PRESETS)} (or pass a mapping"
                       " {path_regex: FrameSpec} or a callable).")
    return _bind(_PRESETS[frames], params), {}, f"preset {frames!r}"
  if isinstance(frames, FrameSpec):
    return (lambda path, leaf: frames), {}, repr(frames)
  if isinstance(frames, Mapping):
    entries = compile_rules(frames, "frames", FrameSpec)

    def fn(path, leaf):
      hits = [(p, s) for p, (c, s) in entries.items() if c.search(path)]
      if len({s for _, s in hits}) > 1:
        raise ValueError(
            f"{path}: matched by several frames= entries with different"
            f" specs: {hits}. Make the regexes disjoint.")
      return hits[0][1] if hits else None

    return fn, {p: c for p, (c, _) in entries.items()}, "frames mapping"
  if callable(frames):
    return (_bind(frames, params), {},
            f"callable {getattr(frames, '__name__', frames)!r}")
  raise ValueError(
      f"frames={frames!r} is not a frame selector: pass a preset name"
      f" {list(FRAME_PRESETS)}, a FrameSpec, a mapping {{path_regex: FrameSpec}},"
      " or a callable (path, leaf) -> FrameSpec | None. (Under"
      " optax.inject_hyperparams a callable selector is taken for a schedule"
      " unless static_args=('frames',).)")


def frame_specs(params, frames: Selector = None) -> list:
  """Resolves a frame selector on a parameter tree: one spec per leaf.

  The selector is a preset name ("auto", the default, "equinox", "flax",
  "gemma", "haliax", "maxtext", "penzai"), a `FrameSpec` for every leaf
  (a named one is resolved against each leaf's axis names), a mapping
  {path_regex: FrameSpec | None} (regexes searched in the '/'-joined path;
  every entry must match a leaf) or a callable (path, leaf) -> FrameSpec |
  None (see the module docstring).

  Args:
    params: a parameter tree (dict, Flax/nnx state, Equinox Module, ...).
    frames: the selector; None: "auto".

  Returns:
    [(path, leaf, FrameSpec | None)] for the leaves of `params` in
    flattening order, every selected leaf checked, every spec in positions
    (a named spec resolved against the leaf's `axis_names`).

  Raises:
    ValueError: naming the path, the shape and a spec that fits, when a
      leaf's layout cannot be decided, a spec does not fit its leaf (r > d,
      parts or heads that do not divide, a fused spec on the transposed
      orientation), a mapping entry matches no leaf, nothing is selected at
      all (listing every leaf that looks like an attention projection), the
      default leaves a query/key lookalike unselected, or `params` is None
      or empty.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> tree = {"c_attn": {"kernel": jnp.zeros((16, 48))}, "ln": jnp.ones(16)}
    >>> [(p, s) for p, _, s in so.frame_specs(
    ...     tree, {r"c_attn/kernel$": so.fused_qkv(2)})]
    [('c_attn/kernel', FrameSpec(rows=0, cols=1, heads=2, parts=3, take=(0, 1))), ('ln', None)]
  """
  if params is None or not jax.tree.leaves(params):
    raise ValueError(
        f"params is {'None' if params is None else 'a tree with no arrays'}:"
        " the Stiefel frames are part of the step, so init and update need"
        " the parameter tree (tx.init(params), tx.update(grads, state,"
        " params)).")
  fn, must_match, what = _selector_fn(frames, params)
  items = [(path_str(p), x) for p, x in
           jax.tree_util.tree_leaves_with_path(params)]
  paths = [p for p, _ in items]
  if len(set(paths)) != len(paths):
    dup = sorted({p for p in paths if paths.count(p) > 1})
    raise ValueError(f"params has several leaves with the same path {dup[:4]};"
                     " frame selection needs unique paths.")
  out, names = [], None
  for path, leaf in items:
    try:
      spec = fn(path, leaf)
    except _Undecided as err:
      raise ValueError(str(err)) from None
    if isinstance(spec, FrameSpec) and spec.named and hasattr(leaf, "shape"):
      if names is None:
        names = axis_names(params)
      spec = _resolve(spec, path, leaf, names.get(path))
    out.append((path, leaf, _check_spec(spec, path, leaf)))
  for pattern, compiled in must_match.items():
    if not any(compiled.search(p) for p in paths):
      raise ValueError(
          f"frames: entry {pattern!r} matches no parameter path; nearby paths:"
          f" {_nearby(pattern, paths)}. Fix the regex or drop the entry.")
  if all(spec is None for _, _, spec in out):
    # Every leaf that looks like an attention projection, however many:
    # the one the user means must be in the message.
    attn = [_describe_leaf(p, x) for p, x, _ in out
            if _looks_like_attention(p, x)]
    others = [p for p, x, _ in out if not _looks_like_attention(p, x)]
    listed = (f" These look like attention projections: {', '.join(attn)}."
              if attn else " None looks like an attention projection.")
    fused = (" A kernel that looks fused holds several projections: select"
             " its query and key parts (parts/take: fused_qkv,"
             " maxtext_fused_qkv)." if any("(looks fused)" in a for a in attn)
             else "")
    raise ValueError(
        f"frames: {what} selects no leaf as frames; the tree has"
        f" {len(paths)} leaves.{listed}{fused} Other leaves:"
        f" {', '.join(others[:12]) or '(none)'}"
        f"{' ...' if len(others) > 12 else ''}. Pass frames= (a preset, a"
        " mapping {path_regex: FrameSpec} or a callable) that names the"
        " query/key kernels.")
  if frames is None or frames == "auto":
    _refuse_unselected_qk(out)
  return out


def _regex_of(paths) -> str:
  """An anchored regex matching exactly `paths`."""
  alt = "|".join(re.escape(p) for p in paths)
  return f"^{alt}$" if len(paths) == 1 else f"^(?:{alt})$"


def _refuse_unselected_qk(out):
  """The default never leaves a query/key lookalike on AdamW silently."""
  missed = [(p, x) for p, x, spec in out
            if spec is None and looks_like_qk(p, x)]
  if not missed:
    return
  chosen = {}
  for p, _, spec in out:
    if spec is not None:
      chosen.setdefault(spec, []).append(p)
  keep = ", ".join(f"{_regex_of(ps)!r}: {spec}" for spec, ps in chosen.items())
  names = ", ".join(_describe_leaf(p, x) for p, x in missed)
  n = sum(map(len, chosen.values()))
  looks = ("it looks like a query/key projection" if len(missed) == 1 else
           "they look like query/key projections")
  raise ValueError(
      f"frames: the default (auto) selects {n}"
      f" {'leaf' if n == 1 else 'leaves'} as frames"
      f" but leaves {names} on AdamW, though"
      f" {looks}"
      " (a second tower, or a layout the default does not know). Name every"
      " query/key kernel: pass frames={"
      f"{keep}, {_regex_of([p for p, _ in missed])!r}: FrameSpec(rows=<input"
      " axis>, cols=<head dimension axis>, heads=<heads, for a 2-D kernel>)}"
      " (fused kernels: stiefel_optax.fused_qkv, maxtext_fused_qkv), or"
      " None in its place to train it with AdamW.")


def selected_frames(params, frames: Selector = None) -> dict:
  """The leaves `frames` selects: what a user checks before training.

  Args:
    params: a parameter tree.
    frames: the frame selector (`frame_specs`); None: "auto".

  Returns:
    {path: FrameSpec} of the selected leaves.

  Raises:
    ValueError: as `frame_specs`.

  Example:
    >>> import jax.numpy as jnp
    >>> from stiefel_optax import selected_frames
    >>> tree = {"attn": {"query": {"kernel": jnp.zeros((8, 2, 4))},
    ...                  "value": {"kernel": jnp.zeros((8, 2, 4))}}}
    >>> selected_frames(tree)
    {'attn/query/kernel': FrameSpec(rows=-3, cols=-1)}
  """
  return {p: s for p, _, s in frame_specs(params, frames) if s is not None}
