"""One partition of a parameter tree into Stiefel frames and the rest.

`frame_partition(stiefel_tx, euclidean_tx, frames)` is `optax.partition` with
sub-leaf resolution: the frame selector (`specs`) gives each leaf a
`FrameSpec` or None; `stiefel_tx` sees the frame views (batch..., d, r) of
the selected leaves, `euclidean_tx` sees every other leaf unchanged and, of a
fused leaf, the parts that are not frames. Both see the parameter tree's
structure, the other group's leaves as `optax.MaskedNode` (as
`optax.partition` hands them), so tree-structured options of either
transform keep working.

With `stack_frames=True` (a multi-tensor apply) the frame views of equal
shape and dtype from different leaves are stacked on a new leading axis,
and `stiefel_tx` sees a tuple of those stacks instead of the tree: every
product of the step is then one batched GEMM per stack, not one per leaf
(24 leaves of GPT-2 small's Q/K kernels make one (24, 12, 768, 64) stack),
and every whole-batch decision (the retraction's certificate, the
cancellation guard) is taken once per stack. That saves per-operation
overhead (kernel launches on an accelerator) but costs a copy of W and G
into the stack and of the update out of it, and on a CPU a stack larger
than its caches makes every pass of the step go to memory (the
measurements: docs/performance.rst). `stack_frames="auto"` therefore
stacks only up to AUTO_STACK_BYTES per stack and leaves larger frames per
leaf.
Stacking along a new axis keeps each leaf's sharding of its own axes, so
leaves sharded alike stack without moving data; stack only leaves that are
sharded alike (a stack of leaves sharded differently makes XLA reshard one
of them).
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
  (`views.split_frames`).

  Args:
    tree: a tree of the parameters' structure.
    items: ``[(path, leaf, FrameSpec | None)]`` for its leaves in
      flattening order, as `specs.frame_specs(params, frames)` gives.

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
  return treedef.unflatten(frames), treedef.unflatten(rest)


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


def _inner_params(f_params, stack_frames):
  """What the Stiefel transform sees under a `stack_frames` setting."""
  limit = stack_limit(stack_frames)
  return f_params if limit is None else stack(f_params, stack_plan(f_params,
                                                                    limit))


def check_state(stiefel_tx, state, f_params, stack_frames) -> None:
  """A clear error when the Stiefel group's state was not made by this
  optimizer's `stack_frames` setting (a checkpoint of another setting, or
  of another model), naming the setting that would fit it."""
  made = lambda setting: jax.tree.structure(jax.eval_shape(
      stiefel_tx.init, _inner_params(f_params, setting)))
  have = jax.tree.structure(state)
  try:
    expected = made(stack_frames)
  except Exception:  # pylint: disable=broad-except
    return   # an init that cannot run abstractly: nothing to compare with
  if have == expected:
    return
  fits = [repr(st) for st in STACK_FRAMES
          if st != stack_frames and made(st) == have]
  hint = (f" It fits stack_frames={' or '.join(fits)}: restore it into an"
          " optimizer with that setting" if fits else
          " It fits no stack_frames setting for these parameters (a state of"
          " another model?): restore it into the optimizer that made it")
  raise ValueError(
      f"frame_partition: the Stiefel group's state ({have.num_leaves}"
      f" arrays) is not the one this optimizer makes with"
      f" stack_frames={stack_frames!r} ({expected.num_leaves}"
      f" arrays).{hint}, or start a new state with tx.init(params).")


def frame_partition(stiefel_tx: optax.GradientTransformation,
                    euclidean_tx: Optional[optax.GradientTransformation],
                    frames: specs_lib.Selector = None, *,
                    orthonormal_start: str = "check",
                    stack_frames=False
                    ) -> optax.GradientTransformation:
  """`stiefel_tx` on the selected frames, `euclidean_tx` on everything else.

  `optax.partition` with sub-leaf resolution: for each leaf x with spec
  S = FrameSpec | None from the selector `frames`::

      (F, R) = split_frames(x, S)           # frame view (batch..., d, r), rest
      u = merge_frames(stiefel_tx(F), euclidean_tx(R), S, x.shape)

  and u = euclidean_tx(x) for a leaf that holds no frame. Each transform sees
  the parameter tree's structure, the other group's leaves as
  `optax.MaskedNode`.

  Args:
    stiefel_tx: a transform over frames (batch..., d, r), e.g.
      `stiefel_adam`; it needs params.
    euclidean_tx: the transform of every other leaf and of the parts of
      fused leaves that are not frames (e.g. `optax.adamw`); None: those
      get zero updates.
    frames: the frame selector (`specs`): a preset name, a FrameSpec, a
      mapping {path_regex: FrameSpec | None} or a callable.
    orthonormal_start: "check" (default): `init` on concrete params raises
      a ValueError naming any selected leaf whose frames are not
      orthonormal; "project": accepted, and the first step's polar
      retraction lands them on the manifold (the model's function changes
      at that step). Rank-deficient frames are an error either way. This
      is the one start check of `init`: `stiefel_tx`'s own (its
      `orthonormal_start`) is skipped there, its leaf checks still run.
    stack_frames: True: `stiefel_tx` sees a tuple of stacks (k, ``*view``) of
      the frame views of equal shape and dtype (see the module docstring)
      instead of the tree (its tree-structured options no longer apply),
      and its state is over those stacks; a frame view with no equal
      partner stands in the tuple as it is. "auto": the same, stacks of at
      most AUTO_STACK_BYTES (larger frames stand alone). False (default):
      one frame view per leaf, in the tree's structure.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `FramePartitionState`; its update needs params (extra arguments go to
    `euclidean_tx`).

  Raises:
    ValueError: for an invalid `orthonormal_start` or `stack_frames` (at
      once); at init, as `frame_specs` or for a selected frame that is
      rank-deficient or (orthonormal_start="check") not orthonormal; at
      update, without params, for updates whose tree differs from params',
      or for a Stiefel state made with another `stack_frames` setting.

  Example (a raw frame tree, all leaves frames):

    >>> import jax, optax, stiefel_optax as so
    >>> w = {"q": so.random_frames(jax.random.key(0), (2, 16, 4)
    ...                            ).transpose(1, 0, 2)}     # (d, heads, r)
    >>> tx = so.frame_partition(so.stiefel_adam(1e-2), None,
    ...                         frames=so.FrameSpec(rows=0, cols=2))
    >>> state = tx.init(w)
    >>> u, state = tx.update(jax.tree.map(jax.numpy.ones_like, w), state, w)
    >>> bool(so.max_isometry_error(optax.apply_updates(w, u),
    ...                            frames=so.FrameSpec(rows=0, cols=2)) < 1e-5)
    True
  """
  checks.check_choice("frame_partition", "orthonormal_start",
                      orthonormal_start, checks.ORTHONORMAL_STARTS)
  limit = stack_limit(stack_frames)
  rest_tx = euclidean_tx if euclidean_tx is not None else optax.set_to_zero()

  def init_fn(params):
    checks.require_params(params, "frame_partition")
    from stiefel_optax import sharding   # (sharding imports this module)
    if sharding.has_variables(params):
      # Flax NNX (nnx.Optimizer): the state is made from the values, and
      # its leaves come back in Variables whose shardings fit them.
      return sharding.variable_state(
          init_fn(sharding.unwrap_variables(params)), params, frames)
    warn_if_boxed(params)   # its boxes would mislabel the state
    items = specs_lib.frame_specs(params, frames)
    # The one start check of init, naming each kernel (`checks.check_start`).
    for path, x, spec in items:
      if spec is not None and checks.is_concrete(x):
        view = views.to_frames(x, spec, path)
        checks.check_start(
            f"{path}: shape {tuple(x.shape)}, frames {view.shape} under"
            f" {spec}", view, orthonormal_start,
            fix="Call params = stiefel_optax.orthonormalize(params,"
            " frames=...) before creating the optimizer state. ")
    f_params, r_params = split_groups(params, items)
    # The start is checked (above, naming the kernels): the Stiefel
    # transform's init skips its own start check, its leaf checks still run.
    with checks.start_checked():
      s_state = stiefel_tx.init(_inner_params(f_params, stack_frames))
    return FramePartitionState(s_state, rest_tx.init(r_params))

  def update_fn(updates, state, params=None, **extra_args):
    checks.require_params(params, "frame_partition")
    items = specs_lib.frame_specs(params, frames)
    checks.check_same_structure(updates, params, "frame_partition")
    f_updates, r_updates = split_groups(updates, items)
    f_params, r_params = split_groups(params, items)
    check_state(stiefel_tx, state.stiefel, f_params, stack_frames)
    if limit is not None:
      plan = stack_plan(f_params, limit)
      f_new, s_state = stiefel_tx.update(stack(f_updates, plan),
                                         state.stiefel, stack(f_params, plan))
      f_new = unstack(f_new, plan, f_updates)
    else:
      f_new, s_state = stiefel_tx.update(f_updates, state.stiefel, f_params)
    r_new, e_state = optax.with_extra_args_support(rest_tx).update(
        r_updates, state.euclidean, r_params, **extra_args)
    f_leaves = jax.tree.leaves(f_new, is_leaf=_masked)
    r_leaves = jax.tree.leaves(r_new, is_leaf=_masked)
    out = []
    for (path, x, spec), f, r in zip(items, f_leaves, r_leaves):
      if spec is None:
        out.append(r)
      else:
        out.append(views.merge_frames(f, None if _masked(r) else r, spec, x.shape))
    return (jax.tree.structure(updates).unflatten(out),
            FramePartitionState(s_state, e_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
