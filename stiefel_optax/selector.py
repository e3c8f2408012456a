"""Where the frames of a model are: one selector, resolved leaf by leaf.

A `FrameSpec` says which axes of one parameter leaf are the rows (d) and the
columns (r) of its Stiefel frames, whether the columns split into heads, and
whether only some equal parts of the leaf are frames (a fused Q/K/V kernel).
A *selector* maps a whole parameter tree to one spec (or None, Euclidean) per
leaf; it is one of

* a preset name: ``"flax"``, ``"gemma"``, ``"maxtext"``, ``"equinox"``
  (reads each ``eqx.nn.MultiheadAttention``'s head count from the module),
  ``"haliax"`` (Levanter's ``q_proj``/``k_proj`` ``haliax.nn.Linear`` leaves, by
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
import re
from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp

from stiefel_optax.families import FRAME_PRESETS, PRESETS, Undecided
from stiefel_optax.named_axes import axis_names
from stiefel_optax.specs import FrameSpec, _nearby, path_str


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
    >>> so.selector.looks_like_qk("model/layers/0/self_attn/q_proj/kernel", w)
    True
    >>> so.selector.looks_like_qk("model/layers/0/self_attn/q_proj/bias", w)
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
    if frames not in PRESETS:
      raise ValueError(f"frames={frames!r} is not a preset; the presets are"
                       f" {list(FRAME_PRESETS)} (or pass a mapping"
                       " {path_regex: FrameSpec} or a callable).")
    return _bind(PRESETS[frames], params), {}, f"preset {frames!r}"
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
    except Undecided as err:
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
