"""The presets: each framework's attention layouts, found in a tree.

One preset per framework of docs/families.md, each a ``frames=`` value
(`FRAME_PRESETS`): "flax" (linen, nnx), "maxtext" (also its fused
``qkv_proj``), "gemma", "equinox" (reads each ``eqx.nn.MultiheadAttention``'s
head count from the module), "haliax" and "penzai" (by module type, labels
and axis names, `named_axes`), and "auto", which recognises all of them by
paths and shapes and refuses what it cannot decide (transformers' Flax
Llama, Haiku and nanoGPT kernels, whose heads are not in their shapes, are
refused with the spec that fits). The helpers that build a selector for a
layout whose head count is not in its shape: `fused_qkv`,
`maxtext_fused_qkv`, `haiku_mha`, `equinox_specs`.

A preset is a callable (path, leaf) -> FrameSpec | None, or, marked by
`_reads_tree`, a function of the whole tree that returns one; a preset that
recognises a leaf but cannot fix its layout raises `Undecided`, which the
selector (`selector.frame_specs`) turns into the ValueError that names it.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Optional

import jax

from stiefel_optax.named_axes import haliax_specs, penzai_specs
from stiefel_optax.specs import FrameSpec, path_str


# --------------------------------------------------------------------------
# Presets by path and shape.

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


class Undecided(ValueError):
  """A preset recognised a leaf by name but cannot fix its layout."""


def _shape_error(path, shape, preset, wanted):
  return Undecided(
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
      raise Undecided(
          f"{path}: shape {tuple(leaf.shape)} is a stacked attention kernel"
          " whose layer axis cannot be told from the path: pass"
          " frames='flax' for nn.scan's (layers, d, heads, head_dim) or"
          " frames='maxtext' for (embed, layers, heads, head_dim).")
    if leaf.ndim == 2:
      raise Undecided(
          f"{path}: shape {tuple(leaf.shape)} is a 2-D attention kernel whose"
          " heads cannot be told from its shape: pass"
          f" frames={{{QK_KERNEL!r}: FrameSpec(rows=0, cols=1, heads=H)}}"
          " (one frame per head) or FrameSpec(rows=0, cols=1) (one frame).")
  if re.search(_LLAMA_QK, path) and leaf.ndim == 2:
    raise Undecided(
        f"{path}: shape {tuple(leaf.shape)} is a 2-D q_proj/k_proj kernel"
        " (d, heads * head_dim), as transformers' Flax Llama (and Mistral,"
        " Gemma, Qwen2) stores it, whose heads cannot be told from its shape:"
        f" pass frames={_LLAMA_FRAMES_HINT}.")
  if re.search(HAIKU_QK, path) and leaf.ndim in (2, 3):
    raise Undecided(
        f"{path}: shape {tuple(leaf.shape)} is an attention projection in"
        " hk.MultiHeadAttention's layout (d, num_heads * key_size), whose heads"
        " cannot be told from its shape: pass"
        " frames=stiefel_optax.haiku_mha(num_heads), i.e."
        f" {{{HAIKU_QK!r}: FrameSpec(rows=-2, cols=-1, heads=num_heads)}}.")
  if re.search(_FUSED, path):
    raise Undecided(f"{path}: {_fused_advice(leaf.shape)}")
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


# --------------------------------------------------------------------------
# Presets that read the whole tree: a head count that only a module holds,
# or axis names.


def _named_leaf(specs: dict):
  """(path, leaf) -> the named spec of `specs` at path (raising its message
  for a layout that does not fit), else None."""
  def select(path, leaf):
    spec = specs.get(path)
    if isinstance(spec, str):
      raise Undecided(spec)
    return spec
  return select


def _tree_preset(name, find, what, fix, leaf=_named_leaf,
                 why=lambda: ""):
  """A preset that reads the whole tree: `find(params)` -> {path: spec, or
  the message of a layout that does not fit}, and `leaf(found)` the
  per-leaf selector. A tree where `find` finds nothing is an error naming
  its first leaves, `why()` (a cause, or "") and the `fix`."""
  @_reads_tree
  def preset(params):
    specs = find(params)
    if not specs:
      items = jax.tree_util.tree_leaves_with_path(params)
      seen = ", ".join(f"{path_str(p)} {tuple(getattr(x, 'shape', ()))}"
                       for p, x in items[:6]) or "(no leaves)"
      raise ValueError(
          f"frames={name!r}: {why()}params holds no {what} (leaves: {seen}"
          f"{' ...' if len(items) > 6 else ''}). {fix}")
    return leaf(specs)
  return preset


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
      raise Undecided(
          f"{path}: shape {shape} is the weight of an eqx.nn.MultiheadAttention"
          f" with num_heads = {spec.heads}, which expects (num_heads * qk_size,"
          " query_size) (a leading layer axis allowed), rows that split into"
          f" {spec.heads} heads. Give the module a weight of that shape (or a"
          " num_heads that divides its rows), or pass"
          f" frames={{{path!r}: FrameSpec(rows=-1, cols=-2, heads=H)}}.")
    return spec
  return select


_equinox = _tree_preset(
    "equinox", equinox_specs, "eqx.nn.MultiheadAttention",
    "The preset reads num_heads from the modules: pass the Module tree"
    " itself, eqx.filter(model, eqx.is_inexact_array), not a dict or list of"
    " its arrays; for other attention layers pass frames={path_regex:"
    " FrameSpec(rows=-1, cols=-2, heads=num_heads)} for (out, in) weights.",
    leaf=_equinox_leaf,
    why=lambda: ("equinox is not imported, so " if "equinox" not in
                 sys.modules else ""))
_haliax = _tree_preset(
    "haliax", haliax_specs, "haliax.nn.Linear named q_proj or k_proj",
    "The preset reads the modules and their axis names: pass the model (or"
    " eqx.filter(model, eqx.is_inexact_array)), not a dict of its arrays; for"
    " other names pass frames={path_regex: FrameSpec(rows='embed',"
    " cols='head_size')}.")
_penzai = _tree_preset(
    "penzai", penzai_specs, "penzai query/key weight ParameterValue (labels"
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
  named = _named_leaf({**haliax_specs(params), **penzai_specs(params),
                       **_maxtext_fused_specs(params)})
  return lambda path, leaf: named(path, leaf) or (
      None if not hasattr(leaf, "ndim") else (
          eqx_leaf(path, leaf) or _auto(path, leaf)))


#: The names of the preset selectors, each a ``frames=`` value: ``"auto"``
#: (the default, ``frames=None``) recognises the others by path, shape,
#: module type and axis names.
FRAME_PRESETS = ("auto", "equinox", "flax", "gemma", "haliax", "maxtext",
                 "penzai")
PRESETS = dict(zip(FRAME_PRESETS, (_auto_tree, _equinox, _flax, _gemma,
                                   _haliax, _maxtext, _penzai)))
