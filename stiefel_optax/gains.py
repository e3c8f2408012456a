"""Which leaves are the gains (and biases) of the norm before attention.

One per-leaf description, `GainSpec` (the feature axis, Gemma's `1 + scale`
offset, whether the leaf is the norm's bias), given by a preset name, a
`{path_regex: GainSpec | None}` mapping or a callable `(path, leaf) ->
GainSpec | None`, selects the gains, as `FrameSpec` selects the frames:

* ``"flax"`` (linen and nnx), ``"equinox"``, ``"haiku"``: the norm module
  before attention by its name, one of `NORM_NAMES` (nanoGPT's ``ln_1``, the
  benchmark models' ``ln_attn``, Llama's ``input_layernorm`` and
  ``attention_norm``, ...), its gain ``scale`` / ``weight`` and its bias
  ``bias`` (Haiku: ``offset``);
* ``"nanogpt"``: ``ln_1`` only, in any framework;
* ``"gemma"``: ``pre_attention_norm/scale``, gain 1 + scale;
* ``"maxtext"``: ``pre_self_attention_layer_norm/scale`` (and
  ``pre_self_attention_norm``, ``_local`` / ``_global``), shape (embed,)
  or scanned (embed, layers) (MaxText's default param_scan_axis 1);
* ``"haliax"``: Levanter's ``input_layernorm`` (Llama-style) and ``ln_1``
  (GPT-2) ``weight`` / ``bias`` (axis ``embed``);
* ``"penzai"``: Parameters labelled ``.../pre_attention_norm/scale.weights``
  and ``.../pre_attention_norm/shift.bias`` (axis ``embedding``);
* ``"auto"``: every name above (Gemma's offset where the tree holds Gemma's
  einsum kernels).

`gain_specs` resolves a selector on a parameter tree; `bound` holds the
gains on their constraint set and reads the logit bound they give.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from stiefel_optax import named_axes, selector, specs as specs_lib


@dataclasses.dataclass(frozen=True)
class GainSpec:
  """How one leaf of a norm layer enters the token norm.

  Attributes:
    axis: the feature axis (d), a position or, for leaves that carry axis
      names (Haliax, penzai), a name; every other axis is a batch of norm
      layers (a scanned stack's layer axis).
    offset: the effective gain is offset + leaf (Gemma's RMSNorm scales by
      1 + scale: offset 1.0); ignored for a bias.
    bias: the leaf is the norm's bias (LayerNorm's bias, Haiku's offset,
      penzai's shift), added after the gain.

  Example:
    >>> from stiefel_optax import GainSpec
    >>> GainSpec(offset=1.0)                          # gemma
    GainSpec(axis=-1, offset=1.0, bias=False)
  """
  axis: Union[int, str] = -1
  offset: float = 0.0
  bias: bool = False

  def __post_init__(self):
    if isinstance(self.axis, bool) or not isinstance(self.axis, (int, str)):
      raise ValueError(f"{self}: axis must be an int (position) or a str"
                       " (axis name).")
    if not math.isfinite(self.offset):
      raise ValueError(f"{self}: offset must be a finite float.")


# --------------------------------------------------------------------------
# Presets: the names of the norm that precedes attention.

#: Module names of the norm that precedes attention in common code: nanoGPT
#: (`ln_1`), the benchmark models (`ln_attn`), Llama ports (`input_layernorm`,
#: `attention_norm`), and others' `attn_norm`, `pre_attn_norm`, `norm1`.
#: Gemma's and penzai's `pre_attention_norm` is the "gemma" / "penzai" presets'.
NORM_NAMES = ("ln_1", "ln_attn", "input_layernorm", "attention_norm",
              "attn_norm", "pre_attn_norm", "norm1")
_NAMES = "|".join(NORM_NAMES)


def _rules(gain: str, bias: Optional[str], spec: GainSpec = GainSpec(),
           bias_spec: Optional[GainSpec] = None) -> dict:
  out = {gain: spec}
  if bias is not None:
    out[bias] = bias_spec or dataclasses.replace(spec, offset=0.0, bias=True)
  return out


_FLAX = _rules(rf"(^|/)({_NAMES})/(scale|weight)$", rf"(^|/)({_NAMES})/bias$")
_EQUINOX = _rules(rf"(^|/)({_NAMES})/weight$", rf"(^|/)({_NAMES})/bias$")
_HAIKU = _rules(rf"(^|/)({_NAMES})/scale$", rf"(^|/)({_NAMES})/offset$")
_NANOGPT = _rules(r"(^|/)ln_1/(scale|weight)$", r"(^|/)ln_1/bias$")
_GEMMA = _rules(r"(^|/)pre_attention_norm/scale$", None, GainSpec(offset=1.0))
# MaxText scans with param_scan_axis 1 (its default): the (embed,) scale
# becomes (embed, layers), so its feature axis is 0 (a config with
# param_scan_axis 0 needs GainSpec(axis=-1)). Its Gemma checkpoints store
# 1 + scale (the converters add the 1), so the gain is the leaf itself;
# Gemma 3's interleaved layers add _local / _global.
_MAXTEXT = _rules(
    r"(^|/)pre_self_attention_(layer_)?norm(_local|_global)?/scale$", None,
    GainSpec(axis=0))
# Levanter: Llama-style decoders' input_layernorm, GPT-2's ln_1 (hnn
# LayerNorm / RmsNorm weight and bias, axis "embed"; under Stacked a leading
# layers axis).
_HALIAX = _rules(r"(^|/)(input_layernorm|ln_1)/weight$",
                 r"(^|/)(input_layernorm|ln_1)/bias$", GainSpec(axis="embed"))
# penzai names its Parameters by label; its converters fold Gemma's 1 + into
# the stored weights, so the gain is the leaf itself.
_PENZAI = _rules(r"(^|/)pre_attention_norm/scale\.weights$",
                 r"(^|/)pre_attention_norm/shift\.bias$",
                 GainSpec(axis="embedding"))
_GEMMA_KERNELS = r"(^|/)(q_einsum|kv_einsum|qkv_einsum)/w$"

#: The names of the preset gain selectors, each a ``gains=`` value.
GAIN_PRESETS = ("auto", "equinox", "flax", "gemma", "haiku", "haliax",
                "maxtext", "nanogpt", "penzai")
_PRESETS = {"equinox": _EQUINOX, "flax": _FLAX, "gemma": _GEMMA,
            "haiku": _HAIKU, "haliax": _HALIAX, "maxtext": _MAXTEXT,
            "nanogpt": _NANOGPT, "penzai": _PENZAI}

GainSelector = Union[None, str, Mapping[str, Optional[GainSpec]],
                     Callable[[str, Any], Optional[GainSpec]]]

# Leaves that look like a norm's parameters: named in an error that finds
# no gain, so the user sees what the tree holds.
_CANDIDATE = re.compile(r"(norm|ln|layer_?norm)[^/]*/[^/]+$", re.IGNORECASE)


def _penzai_labels(params) -> dict:
  """{array path: the label of its penzai ParameterValue} (penzai's
  optimizer trees are tuples of ParameterValues; their labels, not their
  tuple positions, name them). penzai is never imported here."""
  variables = sys.modules.get("penzai.core.variables")
  if variables is None:
    return {}
  value_t = variables.ParameterValue
  out = {}
  for path, p in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, value_t))[0]:
    if isinstance(p, value_t):
      for sub, _ in jax.tree_util.tree_leaves_with_path(p.value):
        out[specs_lib.path_str(tuple(path) + (
            jax.tree_util.GetAttrKey("value"),) + tuple(sub))] = str(p.label)
  return out


def leaf_names(params) -> list:
  """[(path, name, leaf)] of the array leaves: name is the path, or a penzai
  Parameter's label (what selectors and bound blocks read)."""
  labels = _penzai_labels(params)
  out = []
  for p, x in jax.tree_util.tree_leaves_with_path(params):
    path = specs_lib.path_str(p)
    out.append((path, labels.get(path, path), x))
  return out


def _mapping_fn(rules: Mapping, what: str):
  compiled = selector.compile_rules(rules, "gains", GainSpec)

  def fn(name, leaf):
    hits = {s for c, s in compiled.values() if c.search(name)}
    if len(hits) > 1:
      raise ValueError(f"{name}: matched by several {what} entries with"
                       f" different specs {sorted(map(repr, hits))}. Make the"
                       " regexes disjoint.")
    return hits.pop() if hits else None
  return fn


def _selector(gains: GainSelector, names: list):
  if gains is None:
    gains = "auto"
  if isinstance(gains, str):
    if gains not in GAIN_PRESETS:
      raise ValueError(
          f"gains={gains!r} is not a preset; the presets are"
          f" {list(GAIN_PRESETS)} (or pass a mapping {{path_regex: GainSpec}}"
          " or a callable (path, leaf) -> GainSpec | None).")
    if gains == "auto":
      gemma = any(re.search(_GEMMA_KERNELS, n) for _, n, _ in names)
      # Levanter's input_layernorm is the flax rules' (its feature axis
      # last, by position); Haiku's and Equinox's names are flax's.
      rules = {**_FLAX, **_HAIKU, **_EQUINOX, **_MAXTEXT, **_PENZAI,
               **(_GEMMA if gemma else {})}
      return _mapping_fn(rules, "preset 'auto'"), f"preset {gains!r}", {}
    return (_mapping_fn(_PRESETS[gains], f"preset {gains!r}"),
            f"preset {gains!r}", {})
  if isinstance(gains, Mapping):
    return _mapping_fn(gains, "gains mapping"), "gains mapping", {
        p: re.compile(p) for p in gains}
  if callable(gains):
    return gains, f"callable {getattr(gains, '__name__', gains)!r}", {}
  raise ValueError(
      f"gains={gains!r} is not a gain selector: pass a preset name"
      f" {list(GAIN_PRESETS)}, a mapping {{path_regex: GainSpec | None}} or a"
      " callable (path, leaf) -> GainSpec | None.")


def _resolve_axis(spec: GainSpec, path: str, shape, names) -> int:
  """The spec's feature axis on a leaf of `shape` as a position."""
  if isinstance(spec.axis, str):
    if names is None or spec.axis not in names:
      raise ValueError(
          f"{path}: shape {tuple(shape)} is selected as a norm gain by"
          f" {spec}, whose feature axis is named {spec.axis!r}, but the leaf's"
          f" axes are {names or 'without names'}. Pass gains={{{path!r}:"
          " GainSpec(axis=<its feature axis, a position or a name>)}}.")
    return names.index(spec.axis)
  if not -len(shape) <= spec.axis < len(shape):
    raise ValueError(
        f"{path}: shape {tuple(shape)} is selected as a norm gain by {spec},"
        f" whose feature axis {spec.axis} is out of range. Pass gains="
        f"{{{path!r}: GainSpec(axis=<its feature axis>)}}.")
  return spec.axis % len(shape)


class Gain(NamedTuple):
  """One selected leaf: its path, its name (path or penzai label), its
  spec and its feature axis as a position."""
  path: str
  name: str
  spec: GainSpec
  axis: int


def gain_specs(params, gains: GainSelector = None) -> list:
  """Resolves a gain selector on a parameter tree: one entry per leaf.

  Args:
    params: a parameter tree (dict, Flax/nnx state, Equinox Module, Haiku
      params, Haliax model, penzai ParameterValues).
    gains: a preset name (`GAIN_PRESETS`; None: "auto"), a mapping
      {path_regex: GainSpec | None} (regexes searched in the '/'-joined path,
      or a penzai Parameter's label; every entry must match a leaf) or a
      callable (path, leaf) -> GainSpec | None.

  Returns:
    [(path, leaf, GainSpec | None)] for the leaves in flattening order.

  Raises:
    ValueError: when nothing is selected (naming the leaves that look like
      a norm's parameters), a mapping entry matches no leaf, a selected
      leaf is not a floating array of rank >= 1, its feature axis does not
      fit, or a bias has no gain of its shape in its norm layer. Each
      message names the path, the shape and the fix.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> tree = {"h_0": {"ln_1": {"scale": jnp.ones(8)},
    ...                 "ln_2": {"scale": jnp.ones(8)}}}
    >>> [(p, g.spec) for p, _, g in so.gain_specs(tree, "nanogpt") if g]
    [('h_0/ln_1/scale', GainSpec(axis=-1, offset=0.0, bias=False))]
  """
  if params is None or not jax.tree.leaves(params):
    raise ValueError("params is None or holds no arrays: the gain projection"
                     " reads the current gains (tx.init(params),"
                     " tx.update(updates, state, params)).")
  names = leaf_names(params)
  fn, what, must_match = _selector(gains, names)
  axis_names = None
  out = []
  for path, name, leaf in names:
    spec = fn(name, leaf)
    if spec is None:
      out.append((path, leaf, None))
      continue
    if not isinstance(spec, GainSpec):
      raise ValueError(f"{path}: the gain selector returned {spec!r};"
                       " expected a GainSpec or None.")
    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    if (dtype is None or not jnp.issubdtype(dtype, jnp.floating)
        or not shape):
      raise ValueError(
          f"{path}: {type(leaf).__name__} of shape {shape} and dtype {dtype}"
          f" is selected as a norm {'bias' if spec.bias else 'gain'} by"
          f" {what}; it must be a floating array of rank >= 1 (its feature"
          " axis). Fix the selector (gains=) so that it names the norm's"
          " scale and bias only.")
    if axis_names is None:
      axis_names = named_axes.axis_names(params)
    axis = _resolve_axis(spec, path, shape, axis_names.get(path))
    out.append((path, leaf, Gain(path, name, spec, axis)))
  for pattern, compiled in must_match.items():
    if not any(compiled.search(n) for _, n, _ in names):
      raise ValueError(
          f"gains: entry {pattern!r} matches no parameter path; nearby paths:"
          f" {specs_lib._nearby(pattern, [n for _, n, _ in names])}. Fix the"
          " regex or drop the entry.")
  if not any(g is not None and not g.spec.bias for _, _, g in out):
    cands = [f"{n} {tuple(getattr(x, 'shape', ()))}" for _, n, x in names
             if _CANDIDATE.search(n)]
    raise ValueError(
        f"gains: {what} selects no pre-attention norm gain. Candidates (leaves"
        f" that look like a norm's parameters): {', '.join(cands[:12]) or 'none'}"
        f"{' ...' if len(cands) > 12 else ''}. Pass gains= a preset"
        f" {list(GAIN_PRESETS)} or a mapping {{path_regex: GainSpec}} that"
        " names the scale of the norm before each attention layer, e.g."
        " {r'block_\\d+/ln_attn/scale$': GainSpec()}.")
  _check_biases(out)
  return out


def _module_of(name: str) -> str:
  """The norm layer of a leaf name: the name without its last component
  (penzai: 'block_0/pre_attention_norm/scale.weights' and '.../shift.bias'
  are one norm's)."""
  return name.rsplit("/", 1)[0] if "/" in name else ""


def _check_biases(items) -> None:
  gains = {_module_of(g.name): (x, g) for _, x, g in items
           if g is not None and not g.spec.bias}
  for _, x, g in items:
    if g is None or not g.spec.bias:
      continue
    mate = gains.get(_module_of(g.name))
    if mate is None or tuple(mate[0].shape) != tuple(x.shape):
      raise ValueError(
          f"{g.path}: the norm bias of shape {tuple(x.shape)} has no selected"
          f" gain of its shape in its norm layer {_module_of(g.name)!r}"
          f"{'' if mate is None else f' (its gain has shape {tuple(mate[0].shape)})'}."
          " Select the norm's scale too, or leave the bias out of gains=.")
