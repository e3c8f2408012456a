"""An optimizer state in its framework's wrappers: NNX Variables, Haliax names.

Flax NNX's `nnx.Optimizer` hands `tx.init` the parameters as Variables and
copies the metadata of the Variables it gets back onto the optimizer state:
`frame_partition` unwraps them (`unwrap_variables`), computes on the
values, and wraps its state in Variables whose `out_sharding` is the one
`sharding.state_shardings` maps for each leaf (`variable_state`); an update
handed in as Variables comes back as Variables (`rewrap_like`). Levanter
shards the state by axis names: the Stiefel group's state is named by the
frame view's axes (`named_state`). The reasons are in `sharding`'s
docstring.
"""

from __future__ import annotations

import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec

from stiefel_optax import groups, named_axes, selector, specs as specs_lib
from stiefel_optax.sharding import _check_shardings, _Mapper
from stiefel_optax.view_sharding import _is_sharding, _rebuild, _warn


# --------------------------------------------------------------------------
# Flax NNX: a state whose Variables carry their own shardings.


def _variable_type():
  """flax.nnx's Variable class, or None where flax.nnx is not imported (a
  tree then holds no Variable: never import it)."""
  module = sys.modules.get("flax.nnx.variablelib")
  return None if module is None else module.Variable


def has_variables(tree) -> bool:
  """Whether `tree` holds Flax NNX Variables (`nnx.state(model, nnx.Param)`
  does; `nnx.as_pure` of it does not)."""
  var = _variable_type()
  if var is None:
    return False
  is_var = lambda x: isinstance(x, var)
  return any(is_var(x) for x in jax.tree.leaves(tree, is_leaf=is_var))


def unwrap_variables(tree):
  """`tree` with each Flax NNX Variable replaced by its value (other leaves,
  e.g. an optimizer state's counts, as they are)."""
  var = _variable_type()
  if var is None:
    return tree
  is_var = lambda x: isinstance(x, var)
  return jax.tree.map(lambda v: v.get_value() if is_var(v) else v, tree,
                      is_leaf=is_var)


def rewrap_like(like, values):
  """`values` (a tree of `unwrap_variables(like)`'s structure) in the
  Variables of `like`: each Variable of `like`, with its type and
  metadata, holds the new value of its place.

  The inverse of `unwrap_variables` for a tree computed from its values,
  so that a state or an update handed in as Variables (Flax NNX's
  functional pattern: `nnx.split`, then `tx.update` on the `nnx.State`)
  comes back with the structure it came in (a `jax.jit` output or a
  `lax.scan` carry must keep its tree).
  """
  treedef = jax.tree.structure(like)
  leaves = jax.tree.leaves(values)
  if jax.tree.structure(unwrap_variables(like)) != jax.tree.structure(values):
    raise ValueError(
        "stiefel_optax: internal error: a tree computed from the values of"
        " Flax NNX Variables lost their structure:"
        f" {jax.tree.structure(unwrap_variables(like))} vs"
        f" {jax.tree.structure(values)}.")
  # A Variable is a pytree node of one leaf, its value: the leaves of
  # `like` and of its values come in the same order.
  return treedef.unflatten(leaves)


# The Variable metadata that shards a state: flax's `out_sharding` (set by
# nnx.with_partitioning), and `optimizer_sharding`, which nnx.Optimizer
# puts in its place on the state when a parameter has it.
_OUT, _OPT = "out_sharding", "optimizer_sharding"


def _can_shard(meta) -> bool:
  """Whether a Variable made with this metadata can be sharded at once (its
  constructor does it under eager sharding, and needs a mesh: its own
  NamedSharding, a `mesh` entry, or the context's)."""
  if not meta.get("eager_sharding") or not meta.get(_OUT):
    return True
  if meta.get("mesh") is not None or isinstance(meta[_OUT], NamedSharding):
    return True
  return not jax.sharding.get_abstract_mesh().empty


def variable_state(state, params, frames: selector.Selector = None):
  """The state `state` (made from the values of `params`) with each leaf
  that mirrors a parameter in a Variable of that parameter's type and
  metadata, its sharding mapped to the leaf's layout.

  Flax NNX's `nnx.Optimizer(model, tx, wrt=nnx.Param)` calls
  `tx.init(nnx.state(model, nnx.Param))` and copies the metadata of every
  Variable in the state it gets onto the optimizer state's Variables; with
  eager sharding (flax 0.12's default) it shards each at once by its
  `out_sharding`, and `nnx.get_partition_spec` reads it. A parameter's
  own `out_sharding` names the kernel's axes, which do not fit its frame
  view; here each state leaf gets the `out_sharding` that
  `state_shardings` maps for it (mu (heads, d, r) of a (d, heads, r)
  kernel ('embed', 'heads', 'kv') is ('heads', 'embed', 'kv'), nu (heads,)
  is ('heads',)), from the parameter's `optimizer_sharding` where it has one
  (then removed, so that nnx.Optimizer keeps the mapped one), else its
  `out_sharding`. A parameter without either gives Variables without
  `out_sharding`. Leaves that mirror no parameter (counts) stay arrays,
  as optax's do.

  Args:
    state: the optimizer state made from `unwrap_variables(params)`.
    params: the parameters, a tree of Flax NNX Variables.
    frames: the optimizer's frame selector.

  Returns:
    `state` with Variables in place of the leaves that mirror parameters.

  Raises:
    ValueError: as `state_shardings`.
  """
  var = _variable_type()
  is_var = lambda x: isinstance(x, var)
  values = unwrap_variables(params)
  variables = {specs_lib.path_str(p): v for p, v in
               jax.tree_util.tree_leaves_with_path(params, is_leaf=is_var)}
  sources, unsharded = {}, set()
  for path, v in variables.items():
    meta = v.get_metadata() if is_var(v) else {}
    spec = meta.get(_OPT) or meta.get(_OUT)
    if not spec:
      unsharded.add(path)
      spec = PartitionSpec()
    elif not _is_sharding(spec):
      spec = PartitionSpec(*spec)
    sources[path] = spec
  shardings = _check_shardings(
      values, jax.tree_util.tree_map_with_path(
          lambda p, _: sources[specs_lib.path_str(p)], values))

  def make(x, target, entries):
    path, sharding = target[0], target[3]
    v = variables[path]
    if not is_var(v):
      return x
    meta = {k: m for k, m in v.get_metadata().items() if k not in (_OUT, _OPT)}
    if path not in unsharded:
      out = _rebuild(sharding, entries)
      meta[_OUT] = out if isinstance(out, NamedSharding) else tuple(out)
    if _can_shard(meta):
      return type(v)(x, **meta)      # sharded at once (eager sharding)
    # No mesh to shard by (tx.init outside `jax.set_mesh` on the nnx.State of
    # a model built inside one): the Variable as a pytree rebuilds it, as
    # plain optax's tree_map over the params' Variables does; nnx.Optimizer
    # and jit's shardings shard it later.
    return type(v).from_metadata(x, meta)

  mapper = _Mapper(values, shardings, frames, None, make=make,
                   other=lambda x: x)
  out = mapper.walk(state, "", [mapper.param_target()], None)
  _warn(mapper.notes)
  return out


# --------------------------------------------------------------------------
# Haliax (Levanter): a Stiefel state named by the frame view's axes.


def named_state(state, params, items):
  """The Stiefel group's state `state` (made from the plain frame views of
  the Haliax tree `params`), each leaf that mirrors a frame view in a
  `haliax.NamedArray` of the view's axes.

  Levanter shards the optimizer state by axis names (Haliax's
  `infer_resource_partitions`), so a state leaf kept in the kernel's
  NamedArray would get the kernel's rank and axes. A frame view (batch...,
  d, r) takes its names from the kernel axes it comes from (`view_entries`
  on the names, as on logical axis names): Levanter's q_proj weight
  (layer, kv_head, q_heads_per_group, head_size, embed) gives the first
  moment (layer, kv_head, q_heads_per_group, embed, head_size) and the
  per-frame second moment (layer, kv_head, q_heads_per_group), sharded as
  the weight's axes of those names are. A view axis that no one kernel axis
  names (merged rows or columns, heads split from a column axis, a fused
  leaf's parts) leaves its leaf a plain array (replicated by Levanter), as
  are counts and stacks (`stack_frames`).

  Args:
    state: the Stiefel transform's state over `groups.split_groups(params,
      items)[0]` (stack_frames=False).
    params: the parameters, a tree holding Haliax NamedArrays.
    items: `selector.frame_specs(params, frames)`.

  Returns:
    `state` with NamedArrays in place of the leaves that mirror frame views.
  """
  named = groups._named_array_type()  # pylint: disable=protected-access
  names = named_axes.axis_names(params)
  shardings = [PartitionSpec(*(names.get(path) or ()))
               for path, _, _ in items]

  def make(x, target, entries):
    if entries and all(isinstance(e, str) for e in entries):
      return named(x, tuple(entries))
    return x

  mapper = _Mapper(params, shardings, None, None, make=make,
                   other=lambda x: x, items=items)
  return mapper.walk(state, "", mapper.groups()[0][:1], None)
