"""One partition of a parameter tree into Stiefel frames and the rest.

`frame_partition(stiefel_tx, euclidean_tx, frames)` is `optax.partition` with
sub-leaf resolution: the frame selector (`selector`) gives each leaf a
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

from typing import Optional

import jax
import optax

from stiefel_optax import checks, selector, sharding, views, wrapped_state
# The groups and the state layout live in `groups` (sharding reads them
# too); their names stay importable from here.
from stiefel_optax.groups import (  # noqa: F401
    AUTO_STACK_BYTES, STACK_FRAMES, FramePartitionState, _masked,
    boxed_paths, flax_meta, has_named, split_groups, stack, stack_limit,
    stack_plan, strip_named, unstack, warn_if_boxed)


def _inner_params(f_params, stack_frames):
  """What the Stiefel transform sees under a `stack_frames` setting."""
  limit = stack_limit(stack_frames)
  return f_params if limit is None else stack(f_params, stack_plan(f_params,
                                                                    limit))


def _node(x) -> str:
  """A short description of one pytree node or leaf, for messages."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array {tuple(x.shape)} {x.dtype}"
  if x is None:
    return "None"
  name = type(x).__name__
  kids = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
  if not kids:
    return f"{name}()"        # an empty node: MaskedNode(), EmptyState()
  if isinstance(x, (dict, list, tuple)) or len(kids) > 1:
    return name
  # A wrapper (a Flax NNX Variable): what it wraps.
  return f"{name}({_node(kids[0])})"


def first_difference(have, want, path: str = ""):
  """(path, what `have` holds there, what `want` holds there) at the first
  place, in flattening order, where the two trees' structures differ; None
  when they are equal.

  Compares node by node (type and auxiliary data, e.g. a dict's keys or a
  Flax NNX Variable's metadata, then the children), so that two trees with
  the same number of leaves but different nodes (a `MaskedNode` where the
  other has a Variable around one) are told apart and located.
  """
  if jax.tree.structure(have) == jax.tree.structure(want):
    return None
  one = lambda t: jax.tree_util.tree_flatten_with_path(
      t, is_leaf=lambda x: x is not t)
  kids_h, def_h = one(have)
  kids_w, def_w = one(want)
  leaf_h = jax.tree.structure(have).num_nodes == 1 and def_h.num_leaves == 1
  leaf_w = jax.tree.structure(want).num_nodes == 1 and def_w.num_leaves == 1
  keys_h, keys_w = [k for k, _ in kids_h], [k for k, _ in kids_w]
  if not (leaf_h or leaf_w) and type(have) is type(want) and keys_h != keys_w:
    # The same kind of node with other entries (a dict of other keys):
    # name the first entry that one has and the other lacks.
    for k, x in kids_w:
      if k not in keys_h:
        return path + jax.tree_util.keystr(k), "nothing", _node(x)
    for k, x in kids_h:
      if k not in keys_w:
        return path + jax.tree_util.keystr(k), _node(x), "nothing"
  if leaf_h or leaf_w or def_h != def_w or keys_h != keys_w:
    got, want_ = _node(have), _node(want)
    if got == want_:   # the same type with other auxiliary data
      got, want_ = (f"{got} {def_h.node_data()[1]!r}",
                    f"{want_} {def_w.node_data()[1]!r}")
    return path or "<root>", got, want_
  for (k, h), (_, w) in zip(kids_h, kids_w):
    found = first_difference(h, w, path + jax.tree_util.keystr(k))
    if found is not None:
      return found
  return path or "<root>", _node(have), _node(want)


def check_state(stiefel_tx, state, f_params, stack_frames) -> None:
  """A clear error when the Stiefel group's state was not made by this
  optimizer's `stack_frames` setting (a checkpoint of another setting, or
  of another model), naming the first place where it differs and the
  setting that would fit it."""
  made = lambda setting: jax.eval_shape(
      stiefel_tx.init, _inner_params(f_params, setting))
  have = jax.tree.structure(state)
  try:
    expected = made(stack_frames)
  except Exception:  # pylint: disable=broad-except
    return   # an init that cannot run abstractly: nothing to compare with
  if have == jax.tree.structure(expected):
    return
  where, got, want = first_difference(state, expected)
  fits = [repr(st) for st in STACK_FRAMES
          if st != stack_frames and jax.tree.structure(made(st)) == have]
  hint = (f" It fits stack_frames={' or '.join(fits)}: restore it into an"
          " optimizer with that setting" if fits else
          " It fits no stack_frames setting for these parameters (a state of"
          " another model?): restore it into the optimizer that made it")
  raise ValueError(
      f"frame_partition: the Stiefel group's state is not the one this"
      f" optimizer makes with stack_frames={stack_frames!r}: at"
      f" state.stiefel{'' if where == '<root>' else where} it holds {got},"
      f" where this optimizer's state holds {want}.{hint}, or start a new"
      " state with tx.init(params).")


def frame_partition(stiefel_tx: optax.GradientTransformation,
                    euclidean_tx: Optional[optax.GradientTransformation],
                    frames: selector.Selector = None, *,
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
    frames: the frame selector (`selector`): a preset name, a FrameSpec, a
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
    if wrapped_state.has_variables(params):
      # Flax NNX (nnx.Optimizer): the state is made from the values, and
      # its leaves come back in Variables whose shardings fit them.
      return wrapped_state.variable_state(
          init_fn(wrapped_state.unwrap_variables(params)), params, frames)
    warn_if_boxed(params)   # its boxes would mislabel the state
    items = selector.frame_specs(params, frames)
    # The one start check of init, naming each kernel (`checks.check_start`;
    # traced frames, an init under jit, are checked when the init runs).
    for path, x, spec in items:
      if spec is not None and not isinstance(x, jax.ShapeDtypeStruct):
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
    if limit is None and has_named(params):
      # Haliax (Levanter shards the state by axis names): the state's frame
      # views are NamedArrays of the view's axes, not the kernel's.
      s_state = wrapped_state.named_state(s_state, params, items)
    return FramePartitionState(s_state, rest_tx.init(r_params))

  def update_fn(updates, state, params=None, **extra_args):
    checks.require_params(params, "frame_partition")
    if any(wrapped_state.has_variables(t) for t in (updates, state, params)):
      # Flax NNX's functional pattern (nnx.split, then tx.update on the
      # nnx.State of Variables, the state from init's Variables): the step
      # is computed on the values, and the updates and the state come back
      # in the Variables they came in (their structure unchanged, as a
      # jit output or a scan carry needs). nnx.Optimizer passes values.
      values = wrapped_state.unwrap_variables
      u, s = update_fn(values(updates), values(state), values(params),
                       **extra_args)
      return (wrapped_state.rewrap_like(updates, u),
              wrapped_state.rewrap_like(state, s))
    items = selector.frame_specs(params, frames)
    checks.check_same_structure(updates, params, "frame_partition")
    f_updates, r_updates = split_groups(updates, items)
    f_params, r_params = split_groups(params, items)
    # The Stiefel transform sees plain arrays (split_groups); a state named
    # by the frame view (Haliax: init's named_state) comes back so named.
    s_state = plain = strip_named(state.stiefel)
    check_state(stiefel_tx, s_state, f_params, stack_frames)
    if limit is not None:
      plan = stack_plan(f_params, limit)
      f_new, s_state = stiefel_tx.update(stack(f_updates, plan),
                                         s_state, stack(f_params, plan))
      f_new = unstack(f_new, plan, f_updates)
    else:
      f_new, s_state = stiefel_tx.update(f_updates, s_state, f_params)
    if plain is not state.stiefel:
      s_state = sharding.rewrap_named(state.stiefel, s_state)
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
