"""Optimizer-state shardings that follow the parameters'.

The Stiefel group's state lives in the frame view, not in the kernel's
layout: for a linen kernel (d, heads, head_dim) the first moment is
(heads, d, head_dim) and the second moment one scalar per frame, (heads,).
A sharding copied from the kernel onto its state (what Flax's boxes and
MaxText's `nn.get_partition_spec(jax.eval_shape(tx.init, params))` do) puts
the d axis's sharding on the heads axis, and a three-axis spec on the
(heads,) moment. `state_shardings` maps the parameters' shardings to the
state's instead::

    state_specs = stiefel_optax.state_shardings(tx, params, param_specs)

Each axis of a frame view comes from one kernel axis (or a run of them), as
`FrameSpec.axes`, `part_shape` and `frame_shape` say, and takes that axis's
sharding; the per-frame scalars take the view's batch axes; the AdamW
group's state follows its leaves (and, of a fused leaf, the parts that are
not frames, which keep the leaf's own axis order); counts, hyperparameters
and other scalars are replicated. Where a kernel axis is split, the
sharding is kept only where it stays one block per device:

* heads: a column axis of heads * r columns split into (heads, r) (a 2-D
  kernel such as Haiku's or nanoGPT's) keeps its sharding on the heads axis
  when the shard count divides the heads (whole heads per device); otherwise
  the view is replicated along it.
* parts: the part axis of a fused leaf (c_attn's columns, Gemma's leading
  2 or 3) is cut into parts of which only some are frames, so its sharding
  cannot follow; the frames and the other parts are replicated along it (the
  split then gathers the leaf along that axis; shard another axis instead,
  e.g. d).
* merged rows or columns (a spec with several row or column axes) keep the
  sharding of one sharded axis when every axis before it has size 1.

Every dropped sharding is reported in one `UserWarning` naming the leaf.
With logical axis names (`nn.get_partition_spec`) the shard counts are not
known, so a name on a split column axis goes to the heads axis; pass the
result to `nn.logical_to_mesh_sharding`, and jax's own check at `jit`
refuses a count that does not divide.

Flax NNX needs no call: `nnx.Optimizer(model, tx, wrt=nnx.Param)` hands
`tx.init` the parameters as Variables and copies the metadata of the
Variables it gets back onto the optimizer state (sharding them at once
under flax 0.12's eager sharding). `frame_partition`'s init therefore
returns, for Variables, a state whose leaves are Variables carrying the
`out_sharding` mapped here (`wrapped_state.variable_state`), so
`nnx.get_partition_spec` of the optimizer is right, eager or not.

Haliax (Levanter) needs no call either: Levanter's Trainer shards the
optimizer state by axis names (`infer_resource_partitions` of the state under
`named_jit`), so `frame_partition`'s init names the Stiefel group's state by
the frame view's axes (`wrapped_state.named_state`): the first moment of
Levanter's q_proj weight (layer, kv_head, q_heads_per_group, head_size,
embed) is a NamedArray (layer, kv_head, q_heads_per_group, embed,
head_size), its second moment (layer, kv_head, q_heads_per_group), not the
weight's five names around a rank-3 array.

The alternative, keeping the state in the kernel's layout, was not taken:
the step computes in the frame view, so a kernel-layout moment would be
transposed in and out of the view at every step (measured in
docs/performance.rst, "The frame view against the native layout"), the
per-frame second moment has no kernel layout at all, and the state's
structure, hence every checkpoint, would change. Mapping the shardings changes none of the numbers
and puts each state leaf where the step computes, so the sharded step moves
no state between devices (`tests/test_sharding.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from stiefel_optax import groups, selector, specs as specs_lib
from stiefel_optax.view_sharding import (
    _axis_names, _is_sharding, _padded, _rebuild, _warn, view_entries)


# --------------------------------------------------------------------------
# The state.


@dataclasses.dataclass
class _Target:
  """A tree of the state's that mirrors a tree of (some) parameters: its
  structure, and per leaf (path, shape, entries, the parameter's sharding)."""
  treedef: Any
  leaves: list
  conflict: Optional[str] = None   # why a stack has no one sharding


def _target(tree, leaves):
  return _Target(jax.tree.structure(tree), leaves)


class _Mapper:
  """Walks an optimizer state, giving each leaf its sharding."""

  def __init__(self, params, shardings, frames, replicated, make=None,
               other=None, items=None):
    self.params, self.shardings, self.frames = params, shardings, frames
    self.items = items     # frame_specs(params, frames), where known
    self.replicated = replicated
    # make(state leaf, its target (path, shape, entries, sharding), its
    # entries): what a leaf that mirrors a parameter becomes; other(leaf):
    # what any other leaf becomes. By default their shardings.
    self.make = make or (lambda x, target, entries: _rebuild(target[3],
                                                             entries))
    self.other = other or (lambda x: self.replicated)
    self.notes, self.unmatched = [], []
    self._groups = None

  # Targets -----------------------------------------------------------------

  def param_target(self):
    leaves = [(path, _shape(x), _padded(_spec(s), len(_shape(x))), s)
              for (path, x), s in zip(self._param_items(), self.shardings)]
    return _target(self.params, leaves)

  def _param_items(self):
    return [(specs_lib.path_str(p), x) for p, x in
            jax.tree_util.tree_leaves_with_path(self.params)]

  def groups(self):
    """(frame targets, rest target), computed once."""
    if self._groups is not None:
      return self._groups
    try:
      items = (self.items if self.items is not None else
               selector.frame_specs(self.params, self.frames))
    except ValueError as err:
      raise ValueError(
          f"state_shardings: {err} (state_shardings selects the frames as"
          " the optimizer does: pass it the optimizer's own frames=.)"
      ) from None
    f_tree, r_tree = jax.eval_shape(
        lambda p: groups.split_groups(p, items), self.params)
    f_leaves, r_leaves, per_leaf = [], [], []
    for (path, x, spec), s in zip(items, self.shardings):
      entries = _padded(_spec(s), len(_shape(x)))
      if spec is None:
        r_leaves.append((path, _shape(x), entries, s))
        per_leaf.append(None)
        continue
      mesh_shape = (dict(s.mesh.shape) if isinstance(s, NamedSharding)
                    else None)
      view, rest, notes = view_entries(spec, x.shape, entries, mesh_shape,
                                       path)
      self.notes += [f"{path} (shape {tuple(x.shape)}): {n}" for n in notes]
      leaf = (path, spec.frame_shape(x.shape, path), view, s)
      f_leaves.append(leaf)
      per_leaf.append(leaf)
      if rest is not None:
        r_shape = jax.tree.leaves(r_tree)[len(r_leaves)].shape
        r_leaves.append((path, tuple(r_shape), rest, s))
    frame_targets = [_target(f_tree, f_leaves)]
    for setting in (True, "auto"):
      frame_targets.append(self._stack_target(f_tree, per_leaf, setting))
    self._groups = frame_targets, _target(r_tree, r_leaves)
    return self._groups

  def _stack_target(self, f_tree, per_leaf, setting):
    """The tuple of stacks that `stack_frames=setting` hands the Stiefel
    transform, each stack sharded as its members (which must agree)."""
    # per_leaf follows the params' leaves, as stack_plan's indices (with
    # MaskedNode standing for the unselected ones) do.
    plan = groups.stack_plan(f_tree, groups.stack_limit(setting))
    leaves, conflict = [], None
    for group in plan:
      members = [per_leaf[i] for i in group]
      path, shape, view, s = members[0]
      if len(group) == 1:
        leaves.append(members[0])
        continue
      for other in members[1:]:
        if other[2] != view and conflict is None:
          conflict = (
              f"stack_frames={setting!r} stacks the frames of {path}"
              f" (sharded {PartitionSpec(*view)} in the frame view) with"
              f" those of {other[0]} (sharded {PartitionSpec(*other[2])}):"
              " a stack has one sharding, so one of them would be resharded"
              " at every step. Shard the kernels of equal shape alike, or"
              " build the optimizer with stack_frames=False")
      leaves.append((path, (len(group),) + tuple(shape), (None,) + view, s))
    return _Target(jax.tree.structure(tuple(range(len(plan)))), leaves,
                   conflict)

  # The walk ----------------------------------------------------------------

  def walk(self, node, path, targets, group):
    if isinstance(node, groups.FramePartitionState):
      frame_targets, rest_target = self.groups()
      # The frame targets hold no Haliax NamedArray (split_groups); the
      # state's, named by the frame view (named_state), are put back after.
      plain = groups.strip_named(node.stiefel)
      stiefel = self.walk(plain, path + ".stiefel", frame_targets, "stiefel")
      if plain is not node.stiefel:
        stiefel = rewrap_named(node.stiefel, stiefel)
      euclidean = self.walk(node.euclidean, path + ".euclidean",
                            [rest_target], "euclidean")
      return groups.FramePartitionState(stiefel, euclidean)
    treedef = jax.tree.structure(node)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:   # an array
      return self.leaf(node, path, group, None)
    same = [t for t in targets if t.leaves and treedef == t.treedef]
    if same:
      # Of the targets of this structure, the one whose shapes fit (the
      # stacks of True and "auto" may differ in shapes only).
      fits = [t for t in same if _fits(node, t)]
      return self.fit(node, path, (fits or same)[0], group)
    kids, inner = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node)
    return inner.unflatten([
        self.walk(x, path + jax.tree_util.keystr(k), targets, group)
        for k, x in kids])

  def fit(self, node, path, target, group):
    """A state tree that mirrors `target`: each leaf the sharding of its
    parameter's (or frame view's) leading axes."""
    if target.conflict and _fits(node, target):
      raise ValueError(f"state_shardings: {target.conflict}.")
    out = []
    for (k, x), leaf in zip(jax.tree_util.tree_leaves_with_path(node),
                            target.leaves):
      p_path, shape, entries, _ = leaf
      xs = tuple(getattr(x, "shape", ()))
      if xs == shape[:len(xs)]:
        out.append(self.make(x, leaf, entries[:len(xs)]))
      else:
        out.append(self.leaf(x, path + jax.tree_util.keystr(k), group,
                             f"{p_path}'s {shape}"))
    return jax.tree.structure(node).unflatten(out)

  def leaf(self, x, path, group, expected):
    shape = tuple(getattr(x, "shape", ()))
    if shape:
      if group == "stiefel":
        sel = [leaf[0] for leaf in self.groups()[0][0].leaves]
        raise ValueError(
            f"state_shardings: the Stiefel group's state leaf {path} of shape"
            f" {shape} fits no frame view of the leaves frames="
            f"{self.frames!r} selects ({', '.join(sel)}"
            f"{'; expected ' + expected if expected else ''}). Pass"
            " state_shardings the params and the frames= the optimizer was"
            " built with.")
      self.unmatched.append(f"{path} {shape}")
    return self.other(x)


def _fits(node, target) -> bool:
  """Every leaf of `node` has its target's shape or a leading part of it."""
  return all(_shape(x) == shape[:len(_shape(x))]
             for x, (_, shape, _, _) in zip(jax.tree.leaves(node),
                                            target.leaves))


def _shape(x) -> tuple:
  return tuple(getattr(x, "shape", ()))


def _spec(sharding) -> PartitionSpec:
  return sharding.spec if isinstance(sharding, NamedSharding) else sharding


def _check_shardings(params, param_shardings) -> list:
  """The parameters' shardings in params' leaf order, checked: one per leaf,
  rank and (with a mesh) divisibility."""
  items = [(specs_lib.path_str(p), x) for p, x in
           jax.tree_util.tree_leaves_with_path(params)]
  given = jax.tree_util.tree_leaves_with_path(
      param_shardings, is_leaf=_is_sharding)
  by_path = {}
  for p, s in given:
    by_path[specs_lib.path_str(p)] = s
  missing = [(p, _shape(x)) for p, x in items if by_path.get(p) is None]
  extra = sorted(set(by_path) - {p for p, _ in items})
  fix = (" Fix: give param_shardings the structure of params, one"
         " NamedSharding or PartitionSpec per array, e.g."
         " nn.get_partition_spec(boxed_params) or the tree passed to jit as"
         " the params' in_shardings.")
  if missing or extra:
    what = []
    if missing:
      what.append("no sharding for " + ", ".join(
          f"{p} (shape {s})" for p, s in missing[:4]) +
                  (" ..." if len(missing) > 4 else ""))
    if extra:
      what.append("shardings for paths that are no parameter: " +
                  ", ".join(extra[:4]) + (" ..." if len(extra) > 4 else ""))
    raise ValueError("state_shardings: param_shardings does not match"
                     f" params: {'; '.join(what)}.{fix}")
  out, meshes = [], {}
  for path, x in items:
    s = by_path[path]
    shape = _shape(x)
    if not _is_sharding(s):
      raise ValueError(
          f"state_shardings: {path} (shape {shape}) has sharding {s!r};"
          " expected a jax.sharding.NamedSharding or PartitionSpec (of mesh"
          f" axes, or of Flax logical axis names).{fix}")
    spec = _spec(s)
    if len(tuple(spec)) > len(shape):
      raise ValueError(
          f"state_shardings: {path} has shape {shape} (rank {len(shape)}) but"
          f" its sharding {spec} names {len(tuple(spec))} axes. Fix: one"
          " entry per axis of the parameter (None for an unsharded one):"
          " is this the sharding of another parameter, or of the optimizer"
          " state?")
    if isinstance(s, NamedSharding):
      mesh_shape = dict(s.mesh.shape)
      meshes.setdefault(str(mesh_shape), path)
      for axis, entry in enumerate(_padded(spec, len(shape))):
        names = _axis_names(entry)
        unknown = [n for n in names if n not in mesh_shape]
        if unknown:
          raise ValueError(
              f"state_shardings: {path} (shape {shape}) is sharded by {spec},"
              f" but the mesh has no axis {unknown[0]!r} (axes"
              f" {mesh_shape}).{fix}")
        k = math.prod(mesh_shape[n] for n in names)
        if shape[axis] % k:
          raise ValueError(
              f"state_shardings: {path} has shape {shape}, but its sharding"
              f" {spec} splits axis {axis} of size {shape[axis]} over {k}"
              f" devices ({names}), which does not divide it. Fix: shard that"
              " axis over mesh axes whose size divides it, or leave it"
              " unsharded (None).")
    out.append(s)
  if len(meshes) > 1:
    raise ValueError(
        "state_shardings: the parameters' NamedShardings use different"
        f" meshes ({', '.join(f'{m} at {p}' for m, p in meshes.items())});"
        " the state's scalars need one mesh to be replicated over.")
  return out


def state_shardings(tx: optax.GradientTransformation, params,
                    param_shardings=None, *,
                    frames: selector.Selector = None):
  """The optimizer state's shardings, from the parameters'.

  Maps a tree of parameter shardings to one for `tx.init(params)`, as
  `optax.tree_utils.tree_map_params` does for optimizers whose state mirrors
  the parameters, but through the frame views of `stiefel_attention` /
  `frame_partition`:

  * the Stiefel group's per-frame state (Stiefel-Adam's first moment,
    (batch..., d, r)) takes each view axis's sharding from the kernel axis
    it comes from (`frame_view_spec`), e.g. a linen query kernel (d, heads,
    head_dim) sharded P('embed', 'heads', 'kv') gives its first moment
    (heads, d, head_dim) P('heads', 'embed', 'kv') and its second moment
    (heads,) P('heads');
  * with `stack_frames=True` / "auto" (read off the state's structure) a
    stack ``(k, *view)`` is sharded ``(None, *view's)`` when its members' views are
    sharded alike; otherwise a ValueError names the leaves and the option;
  * the AdamW group's state follows its leaves (a fused leaf's parts that
    are not frames keep the leaf's sharding; its part axis is unsharded);
  * any other tree of the state with the parameters' structure (e.g.
    `optax.MultiSteps`' accumulated gradients) follows the parameters;
  * counts, hyperparameters and other scalars are replicated (a state leaf
    with axes that mirrors nothing is replicated too, with a warning).

  A split axis keeps its sharding only where it stays one block per device
  (the module docstring; a UserWarning names what was replicated).

  Args:
    tx: the optimizer (`stiefel_attention`, `frame_partition`, or any optax
      transform around them, e.g. `optax.inject_hyperparams`,
      `optax.apply_if_finite`, `optax.chain`).
    params: the parameters (arrays or `jax.ShapeDtypeStruct` leaves); a tree of
      Flax boxes (`nn.with_logical_partitioning`) is unboxed first.
    param_shardings: the parameters' shardings, a tree of `NamedSharding`
      or of `PartitionSpec` (mesh axis names, or Flax logical axis names as
      `nn.get_partition_spec` gives them) in the structure of params; None:
      `nn.get_partition_spec(params)` of boxed params.
    frames: the optimizer's frame selector (`stiefel_attention(...,
      frames=...)`), as for `orthonormalize` and `check_frames`.

  Returns:
    A tree in the structure of `jax.eval_shape(tx.init, params)` (unboxed),
    of the kind of the input: NamedShardings (scalars replicated over the
    parameters' mesh), or PartitionSpecs (logical ones go through
    `nn.logical_to_mesh_sharding(specs, mesh, rules)`). Use it as the
    state's `in_shardings` / `out_shardings` of `jax.jit`.

  Raises:
    ValueError: param_shardings does not fit params (a missing or extra
      path, a spec longer than the leaf's rank, an axis it does not divide,
      a leaf that is no sharding), naming the path, the shape and the fix;
      the state does not fit the frames (pass the optimizer's frames=);
      stacked frames of one stack are sharded differently.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import stiefel_optax as so
    >>> params = {"query": {"kernel": so.random_frames(
    ...     jax.random.key(0), (4, 32, 8)).transpose(1, 0, 2)},   # (d, heads, hd)
    ...           "out": {"kernel": jnp.zeros((4, 8, 32))}}
    >>> specs = {"query": {"kernel": P("embed", "heads", "kv")},
    ...          "out": {"kernel": P("heads", "kv", "embed")}}
    >>> tx = so.stiefel_attention(1e-3)
    >>> state_specs = so.state_shardings(tx, params, specs)
    >>> for path, s in jax.tree_util.tree_leaves_with_path(
    ...     state_specs, is_leaf=lambda x: isinstance(x, P)):
    ...   print(jax.tree_util.keystr(path), s)
    .stiefel[1].count P()
    .stiefel[1].mu['query']['kernel'] P('heads', 'embed', 'kv')
    .stiefel[1].nu['query']['kernel'] P('heads',)
    .euclidean[0].count P()
    .euclidean[0].mu['out']['kernel'] P('heads', 'kv', 'embed')
    .euclidean[0].nu['out']['kernel'] P('heads', 'kv', 'embed')
  """
  meta = groups.flax_meta()
  if groups.boxed_paths(params):
    if param_shardings is None:
      param_shardings = meta.get_partition_spec(params)
    params = meta.unbox(params)
  elif param_shardings is None:
    raise ValueError(
        "state_shardings: pass param_shardings (a tree of NamedSharding or"
        " PartitionSpec in the structure of params); it can be left out only"
        " for Flax-boxed params (nn.with_logical_partitioning), whose"
        " nn.get_partition_spec it then uses.")
  if groups.boxed_paths(param_shardings):
    param_shardings = meta.get_partition_spec(param_shardings)
  shardings = _check_shardings(params, param_shardings)
  mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)),
              None)
  replicated = (PartitionSpec() if mesh is None else
                NamedSharding(mesh, PartitionSpec()))
  state = jax.eval_shape(tx.init, params)
  mapper = _Mapper(params, shardings, frames, replicated)
  out = mapper.walk(state, "", [mapper.param_target()], None)
  notes = list(mapper.notes)
  if mapper.unmatched:
    notes.append("these state leaves mirror no parameter and are replicated: "
                 + ", ".join(mapper.unmatched[:6])
                 + (" ..." if len(mapper.unmatched) > 6 else ""))
  _warn(notes)
  return out


# --------------------------------------------------------------------------
# Haliax (Levanter): the walk puts a named Stiefel state back in its
# NamedArrays.


def rewrap_named(like, values):
  """`values` (a tree of `groups.strip_named(like)`'s structure, or of
  shardings in its place) in the NamedArray nodes of `like`, as
  `rewrap_like` does for Variables (a jit output or a scan carry keeps
  its tree)."""
  have = jax.tree.structure(values, is_leaf=_is_sharding)
  if jax.tree.structure(groups.strip_named(like)) != have:
    raise ValueError(
        "stiefel_optax: internal error: a tree computed from a state of"
        " Haliax NamedArrays lost its structure:"
        f" {jax.tree.structure(groups.strip_named(like))} vs {have}.")
  # A NamedArray is a pytree node of one leaf, its array: the leaves of
  # `like` and of `values` come in the same order.
  return jax.tree.structure(like).unflatten(
      jax.tree.leaves(values, is_leaf=_is_sharding))
