"""Diagnostics: how far frames are from the manifold and how far they move.

Every helper takes the same frame selector `frames=` as `stiefel_attention`.
On a cluster (`jax.distributed`, each process holding only its shards) they
take global arrays: every process calls them, reads the same values and
`check_frames` raises on every process or on none.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from stiefel_optax import arrays, checks, geometry, selector, specs, views


def _per_frame(fn, params, frames) -> dict:
  """{path: fn(frame view)}, each readable whole on every process
  (`checks.replicated`: a global array's per-frame values are all-gathered)."""
  out = views.map_frames(fn, params, frames, back=False)
  return {path: checks.replicated(v) for path, v in out.items()}


def frame_isometry_errors(params, frames: selector.Selector = None) -> dict:
  """{path: per-frame ||W^T W - I||_F} for every selected leaf.

  Works on any kernel, orthonormal or not (e.g. an AdamW arm's raw kernels).

  Args:
    params: a parameter tree (dict, Flax/nnx state, Equinox Module, ...).
    frames: the frame selector (`frame_specs`); None: the default "auto".

  Returns:
    A dict from each selected leaf's '/'-joined path to its frames' isometry
    errors, shape of the frame view's batch axes (replicated where the
    frames span several processes, so that each process can read them).

  Raises:
    ValueError: as `frame_specs`, when the selector cannot decide a leaf or
      selects nothing.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> so.frame_isometry_errors({"query": {"kernel": jnp.zeros((4, 1, 2))}})
    {'query/kernel': Array([1.4142135], dtype=float32)}
  """
  return _per_frame(geometry.isometry_error, params, frames)


def max_isometry_error(params, frames: selector.Selector = None) -> jax.Array:
  """The largest isometry error ||W^T W - I||_F over all selected frames.

  Args:
    params: a parameter tree.
    frames: the frame selector (`frame_specs`); None: the default "auto".

  Returns:
    A scalar array.

  Raises:
    ValueError: as `frame_specs`.

  Example:
    >>> import jax.numpy as jnp, stiefel_optax as so
    >>> float(so.max_isometry_error({"key": {"kernel": jnp.zeros((4, 1, 1))}}))
    1.0
  """
  errs = frame_isometry_errors(params, frames)
  return jnp.max(jnp.stack([jnp.max(e) for e in errs.values()]))


def check_frames(params, frames: selector.Selector = None,
                 atol: Optional[float] = None) -> None:
  """Checks that every selected frame is on the manifold.

  The tolerance is the one `init`'s start check uses
  (`checks.start_tolerance`): a frame that `init` accepts passes here, and
  `orthonormalize`'s frames pass in every dtype. A frame stored in bf16 or
  float16 is orthonormal only to its dtype's rounding (at worst sqrt(r)
  eps in ||W^T W - I||_F: 3.1e-2 for bf16 at r = 16), so its tolerance follows
  its dtype and its column count r.

  Args:
    params: a parameter tree.
    frames: the frame selector (`frame_specs`); None: the default "auto".
    atol: the largest isometry error ||W^T W - I||_F accepted, for every
      leaf; None (default): each leaf's dtype-aware tolerance,
      `checks.start_tolerance(dtype, r)`.

  Returns:
    None.

  Raises:
    ValueError: naming each selected leaf with a frame off the manifold
      (isometry error > its tolerance), with its error, shape, dtype and
      tolerance, and the fix; or as `frame_specs`.

  Example:
    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> w = so.orthonormal_heads_init()(jax.random.key(0), (8, 2, 4))
    >>> so.check_frames({"query": {"kernel": w}})            # passes
    >>> so.check_frames({"query": {"kernel": w.astype(jnp.bfloat16)}})  # too
    >>> so.check_frames({"query": {"kernel": 2 * w}})
    Traceback (most recent call last):
    ...
    ValueError: check_frames: 1 kernel(s) off the Stiefel manifold ...
  """
  selected = [(p, x, s) for p, x, s in selector.frame_specs(params, frames)
              if s is not None]
  # Each leaf's worst error, read whole on every process (`host_value`): the
  # same decision everywhere.
  worst = {path: float(checks.host_value(jnp.max(e))) for path, e in
           frame_isometry_errors(params, frames).items()}
  bad, below_rounding = [], []
  for path, x, spec in selected:
    r = spec.frame_shape(x.shape, path)[-1]
    dtype_tol = checks.start_tolerance(x.dtype, r)
    tol = dtype_tol if atol is None else atol
    e = worst[path]
    if not e <= tol:
      bad.append(f"{path} (shape {tuple(x.shape)}): max isometry error"
                 f" {e:.3g} > tolerance {tol:.3g} ({jnp.dtype(x.dtype).name},"
                 f" r = {r})")
      if e <= dtype_tol:
        below_rounding.append(f"{jnp.dtype(x.dtype).name} (r = {r}):"
                              f" {dtype_tol:.3g}")
  if not bad:
    return
  if below_rounding:
    fix = (" These frames are orthonormal to their dtype's rounding, which"
           f" atol={atol} asks more of ({'; '.join(below_rounding)}"
           " is the rounding-aware tolerance): drop atol to use it, or keep"
           " the frames in float32 (see the README's mixed-precision"
           " recipe).")
  else:
    fix = (" Call params = stiefel_optax.orthonormalize(params, frames=...)"
           " to put them back on the manifold (it changes the model's"
           " function); its frames pass this check in every dtype.")
  raise ValueError(
      f"check_frames: {len(bad)} kernel(s) off the Stiefel manifold"
      " (isometry error ||W^T W - I||_F above its tolerance): "
      + "; ".join(bad) + "." + fix)


def frame_movement(old_params, new_params,
                   frames: selector.Selector = None) -> dict:
  """{path: per-frame ||W_new - W_old||_F} for every selected leaf.

  Args:
    old_params: a parameter tree.
    new_params: a parameter tree of the same structure.
    frames: the frame selector (`frame_specs`); None: the default "auto".

  Returns:
    A dict from each selected leaf's path to the Frobenius distance each of
    its frames moved (replicated where the frames span several processes).

  Raises:
    ValueError: as `frame_specs`, when the trees' structures differ, or
      when a leaf's two arrays sit on different devices (e.g. a start kept
      on one device and a model sharded since), naming the leaf.

  Example:
    >>> import jax, stiefel_optax as so
    >>> w = so.orthonormal_heads_init()(jax.random.key(0), (8, 2, 4))
    >>> moved = so.frame_movement({"query": {"kernel": w}},
    ...                            {"query": {"kernel": -w}})
    >>> moved["query/kernel"].round(4)       # ||-W - W||_F = 2 sqrt(r), per head
    Array([4., 4.], dtype=float32)
  """
  # Leaves that are no arrays (an Equinox model's functions, flags) are
  # never frames: carried as they are. The difference is taken in at least
  # float32: two bf16 frames a step apart differ by a few ulps, which a
  # bf16 subtraction would round again.
  def diff_leaf(path, a, b):
    if not hasattr(b, "shape"):
      return b
    _check_same_devices(path, a, b)
    if not jnp.issubdtype(b.dtype, jnp.floating):
      return b - a
    cdtype = arrays.compute_dtype(jnp.promote_types(a.dtype, b.dtype))
    return b.astype(cdtype) - a.astype(cdtype)

  diff = jax.tree_util.tree_map_with_path(diff_leaf, old_params, new_params)
  return _per_frame(arrays.frame_norm, diff, frames)


def _check_same_devices(path, a, b) -> None:
  """Raises a ValueError naming the leaf when its old and new arrays are
  committed to different devices (jax would refuse their difference with
  no parameter named); NumPy arrays and tracers pass."""
  if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
             for x in (a, b)):
    return
  old, new = a.sharding.device_set, b.sharding.device_set
  if old != new:
    raise ValueError(
        f"frame_movement: parameter {specs.path_str(path)} {tuple(b.shape)}:"
        f" the old array is on {len(old)} device(s) and the new one on"
        f" {len(new)} ({sorted(d.id for d in old)[:8]} against"
        f" {sorted(d.id for d in new)[:8]}). Put both on the same devices,"
        " e.g. old_params = jax.device_put(old_params, <the new params'"
        " shardings>), or keep the start as NumPy arrays"
        " (jax.device_get(old_params)).")
