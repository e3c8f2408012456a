"""Named axes: the frames of Haliax (Levanter) and penzai trees.

Haliax and penzai carry a name on every axis, so their frames are found by
module type and axis names (`axis_names`), and a name -> mesh-axis mapping
can be checked against the names a tree carries (`check_axis_mapping`).
Neither library is ever imported here: without it a tree holds none of its
arrays.
"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Mapping

import jax

from stiefel_optax.specs import FrameSpec, path_str


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
    >>> so.named_axes.axis_names({"q_proj": {"weight": w}})
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


def haliax_specs(params) -> dict:
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


def penzai_specs(params) -> dict:
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
