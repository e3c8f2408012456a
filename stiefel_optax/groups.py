"""The two groups of a partitioned tree, and where their state lives.

What `frame_partition` (`stiefel_optax.partition`) and `state_shardings`
(`stiefel_optax.sharding`) both read, so that neither imports the other
for it: the partition's state (`FramePartitionState`), the split of a tree
into its frame views and the rest (`split_groups`), the stacking of equal
frame views (`stack_plan`, `stack`, `unstack`, under a `stack_frames`
setting: `stack_limit`), and the Flax partitioning boxes a tree may hold
(`boxed_paths`).
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stiefel_optax import checks, specs as specs_lib, views


def flax_meta():
  # Without flax imported a tree holds no Flax box: never import it.
  return sys.modules.get("flax.core.meta")


def boxed_paths(tree) -> list:
  """Paths of the Flax partitioning boxes (`nn.Partitioned`,
  `nn.LogicallyPartitioned`) in `tree`; [] when flax is not imported."""
  meta = flax_meta()
  if meta is None:
    return []
  is_box = lambda x: isinstance(x, meta.AxisMetadata)
  return [specs_lib.path_str(p) for p, x in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
          if is_box(x)]


def warn_if_boxed(params) -> None:
  """The warning of `frame_partition`'s init on a tree of Flax boxes: the
  state's boxes would name the kernels' axes, which do not fit the frame
  view."""
  paths = boxed_paths(params)
  if paths:
    warnings.warn(
        f"stiefel_optax: tx.init got Flax partitioning boxes ({paths[0]}"
        f"{' ...' if len(paths) > 1 else ''}); the Stiefel group's state is"
        " in the frame view (heads, d, r) with a (heads,) second moment, so"
        " the axis names the boxes give it (nn.get_partition_spec of the"
        " state) are the kernels' and do not fit it. Derive the state's"
        " shardings with stiefel_optax.state_shardings(tx, params,"
        " param_specs), and init the state from unboxed params"
        " (nn.unbox(params)).", UserWarning, stacklevel=3)


def _named_array_type():
  # Without haliax imported a tree holds no NamedArray: never import it.
  core = sys.modules.get("haliax.core")
  return None if core is None else core.NamedArray


def has_named(tree) -> bool:
  """Whether `tree` holds Haliax NamedArrays."""
  named = _named_array_type()
  is_named = lambda x: named is not None and isinstance(x, named)
  return any(map(is_named, jax.tree.leaves(tree, is_leaf=is_named)))


def strip_named(tree):
  """`tree` with each Haliax `NamedArray` node replaced by its array.

  A leaf's NamedArray names the kernel's axes; its frame view (batch...,
  d, r) and the per-frame state made from it have other axes and ranks, so
  the Stiefel group sees plain arrays, and `wrapped_state.named_state` names its
  state by the view's axes. The tree itself where it holds no NamedArray.
  """
  if not has_named(tree):
    return tree
  named = _named_array_type()
  is_named = lambda x: isinstance(x, named)
  return jax.tree.map(lambda x: x.array if is_named(x) else x, tree,
                      is_leaf=is_named)


class FramePartitionState(NamedTuple):
  """State of `frame_partition`: each group's inner state.

  Attributes:
    stiefel: the state of the Stiefel transform, over the frame views (or,
      with `stack_frames`, over their stacks).
    euclidean: the state of the Euclidean transform, over the other leaves
      and parts.
  """
  stiefel: optax.OptState
  euclidean: optax.OptState


def split_groups(tree, items):
  """The two groups of `frame_partition`: (frame views, the rest).

  A pure function of the tree (params, updates or their shapes under
  `jax.eval_shape`): each group keeps the structure of `tree`, with the
  other group's leaves as `optax.MaskedNode` (as `optax.partition` hands
  them). A selected leaf gives its frame view (batch..., d, r) to the first
  group and its parts that are not frames, if any, to the second
  (`views.split_frames`). The first group holds no Haliax `NamedArray`
  node (`strip_named`): a leaf's names are the kernel's axes, not its view's.

  Args:
    tree: a tree of the parameters' structure.
    items: ``[(path, leaf, FrameSpec | None)]`` for its leaves in
      flattening order, as `selector.frame_specs(params, frames)` gives.

  Returns:
    (frames, rest), two trees of the structure of `tree`.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> from stiefel_optax import partition
    >>> tree = {"c_attn": jnp.zeros((16, 48)), "ln": jnp.ones(16)}
    >>> items = so.frame_specs(tree, {"c_attn": so.fused_qkv(2)})
    >>> frames, rest = partition.split_groups(tree, items)
    >>> frames["c_attn"].shape, frames["ln"], rest["c_attn"].shape
    ((2, 2, 16, 8), MaskedNode(), (16, 16))
  """
  masked = optax.MaskedNode()
  frames, rest = [], []
  for x, (path, _, spec) in zip(jax.tree.leaves(tree), items):
    if spec is None:
      frames.append(masked)
      rest.append(x)
      continue
    view, other = views.split_frames(x, spec, path)
    frames.append(view)
    rest.append(masked if other is None else other)
  treedef = jax.tree.structure(tree)
  return strip_named(treedef.unflatten(frames)), treedef.unflatten(rest)


def _masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


# "auto" stacks frames of one shape up to this many bytes per stack: small
# frames, whose step is per-operation overhead, stack; frames whose stack
# would outgrow a CPU's caches stay per leaf.
AUTO_STACK_BYTES = 1 << 20

STACK_FRAMES = (False, True, "auto")


def stack_limit(stack_frames) -> Optional[float]:
  """Bytes per stack for a `stack_frames` setting (None: no stacking)."""
  checks.check_choice("frame_partition", "stack_frames", stack_frames,
                      STACK_FRAMES)
  if stack_frames is True:
    return float("inf")
  if stack_frames is False:
    return None
  return float(AUTO_STACK_BYTES)


def stack_plan(frame_tree, max_bytes: float = float("inf")) -> tuple:
  """The stacks of `stack_frames`: leaf indices (in `jax.tree.leaves` order,
  MaskedNode included) of the frame views, grouped by (shape, dtype) in
  order of first appearance, each group cut into stacks of at most
  `max_bytes` (a larger leaf stands alone)."""
  groups = {}
  for i, x in enumerate(jax.tree.leaves(frame_tree, is_leaf=_masked)):
    if _masked(x):
      continue
    stacks = groups.setdefault((tuple(x.shape), jnp.dtype(x.dtype)), [[]])
    size = x.size * jnp.dtype(x.dtype).itemsize
    if stacks[-1] and (len(stacks[-1]) + 1) * size > max_bytes:
      stacks.append([])
    stacks[-1].append(i)
  return tuple(tuple(st) for g in groups.values() for st in g)


def stack(frame_tree, plan) -> tuple:
  """One array (k, *view shape) per group of `plan`; a group of one is the
  leaf's view itself (no copy, no new axis)."""
  leaves = jax.tree.leaves(frame_tree, is_leaf=_masked)
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
    # Abstract views (an init on ShapeDtypeStructs): the stacks' shapes.
    return jax.eval_shape(lambda t: stack(t, plan), frame_tree)
  return tuple(leaves[g[0]] if len(g) == 1 else
               jnp.stack([leaves[i] for i in g]) for g in plan)


def unstack(stacks, plan, like):
  """Inverse of `stack`: the tree of `like` (a frame tree) with each
  frame view taken from its stack."""
  leaves = list(jax.tree.leaves(like, is_leaf=_masked))
  for group, st in zip(plan, stacks):
    if len(group) == 1:
      leaves[group[0]] = st
      continue
    for j, i in enumerate(group):
      leaves[i] = st[j]
  return jax.tree.structure(like, is_leaf=_masked).unflatten(leaves)
