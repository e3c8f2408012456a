"""Argument and leaf checks of the transforms: one wording for each error.

Every transform of the library validates its options when it is built and
its leaves at `init` and `update` through these functions, so each mistake
reads the same wherever it is made: the message starts with the transform's
name, names the parameter path and the shape that is wrong, and says how to
fix it. The pure array functions of `geometry` check their own arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from stiefel_optax import arrays, geometry

ORTHONORMAL_STARTS = ("check", "project")


# --------------------------------------------------------------------------
# Options.


def check_choice(name: str, arg: str, value: Any, choices: Sequence) -> None:
  """Raises ValueError unless `value` is one of `choices`.

  Strings compare by value, anything else by identity (so that 1 is not
  taken for True).
  """
  if not any(value is c or (isinstance(c, str) and isinstance(value, str)
                            and value == c) for c in choices):
    raise ValueError(
        f"{name}: {arg} must be one of {tuple(choices)}; got {value!r}.")


def check_count(name: str, arg: str, value: Any) -> None:
  """Raises ValueError unless `value` is an integer >= 1.

  A traced value passes: `optax.inject_hyperparams` injects an integer
  hyperparameter (a step count) as an array, checked here where it is
  concrete (the wrapped transform is built with its values at init) and
  traced under jit at update.
  """
  if isinstance(value, jax.core.Tracer):
    return
  if isinstance(value, bool) or int(value) != value or value < 1:
    raise ValueError(f"{name}: {arg} must be an integer >= 1; got {value!r}.")


def static_float(x) -> Optional[float]:
  """x as a Python float, or None when it is traced (as
  `optax.inject_hyperparams` passes hyperparameters under jit)."""
  try:
    return float(x)
  except (jax.errors.ConcretizationTypeError, TypeError):
    return None


def check_max_step_norm(name: str, value, arg: str = "max_step_norm",
                        optional: bool = True) -> Optional[float]:
  """A `max_step_norm` (the trust-region radius), checked: finite and > 0
  where it is concrete.

  Returns it as a Python float, or None when it is traced (as
  `optax.inject_hyperparams` injects it); `optional` says in the message
  that None turns the trust region off.
  """
  max_step_norm = static_float(value)
  if max_step_norm is not None and not (
      max_step_norm > 0 and np.isfinite(max_step_norm)):
    off = " (or None for no trust region)" if optional else ""
    raise ValueError(
        f"{name}: {arg} must be > 0 and finite{off}; got {max_step_norm}.")
  return max_step_norm


def check_radius(name: str, value, arg: str = "max_step_norm",
                 optional: bool = True) -> Optional[float]:
  """Deprecated: `check_max_step_norm` (the library's one name for the
  trust-region radius)."""
  warnings.warn("stiefel_optax.checks.check_radius is deprecated; use"
                " check_max_step_norm.", DeprecationWarning, stacklevel=2)
  return check_max_step_norm(name, value, arg, optional)


def renamed_keywords(**renames: str):
  """Decorator: `fn` keeps accepting each old keyword (renames maps old to
  new name), with a DeprecationWarning naming the new one.

  Passing both the old and the new keyword is a TypeError.
  """
  def decorate(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      for old, new in renames.items():
        if old in kwargs:
          warnings.warn(
              f"{fn.__name__}: the keyword {old!r} is deprecated; use"
              f" {new!r}.", DeprecationWarning, stacklevel=2)
          if new in kwargs:
            raise TypeError(f"{fn.__name__}: got both {old!r} and its new"
                            f" name {new!r}.")
          kwargs[new] = kwargs.pop(old)
      return fn(*args, **kwargs)
    return wrapper
  return decorate


# --------------------------------------------------------------------------
# Leaves.


def leaf_name(name: str, path) -> str:
  """'name: parameter ['layer']['query']', as every leaf error starts."""
  return f"{name}: parameter {jax.tree_util.keystr(tuple(path)) or '<root>'}"


def kernel_hint(shape) -> str:
  """The fix for a kernel of rank >= 3 given to a transform over frames."""
  if len(shape) < 3:
    return ""
  return (f" Its last two axes are taken as the frames (d, r) ="
          f" {tuple(shape[-2:])}; if this is a (d, heads, head_dim) kernel,"
          " train it through stiefel_optax.stiefel_attention(...,"
          " frames=...) or frame_partition(tx, None,"
          " frames=FrameSpec(rows=0, cols=2)).")


def require_params(params, name: str) -> None:
  """Raises ValueError when `params` is None: the Stiefel step needs the
  current frames."""
  if params is None:
    raise ValueError(
        f"{name} needs params (got None): the current frames W are part of"
        " the Stiefel step. Call tx.init(params) and tx.update(grads, state,"
        " params).")


def _check_leaf(path, leaf, name: str) -> None:
  where = leaf_name(name, path)
  if not hasattr(leaf, "shape"):
    raise ValueError(f"{where} is {type(leaf).__name__}, not an array.")
  if not jnp.issubdtype(leaf.dtype, jnp.floating):
    raise ValueError(
        f"{where} with shape {tuple(leaf.shape)} has dtype {leaf.dtype}; a"
        " Stiefel frame must be floating point.")
  try:
    geometry.check_frame_shape(leaf.shape, where)
  except ValueError as err:
    raise ValueError(f"{err}{kernel_hint(leaf.shape)}") from None


def check_frame_leaves(params, name: str) -> None:
  """Raises ValueError naming the leaf path and shape of any leaf that cannot
  hold Stiefel frames (rank < 2, r > d, non-float dtype), or for params
  None."""
  require_params(params, name)
  jax.tree_util.tree_map_with_path(
      lambda p, x: _check_leaf(p, x, name), params)


def check_update_shapes(updates, params, name: str) -> None:
  """Raises ValueError naming the leaf path and both shapes where an update
  (gradient or step) does not have the shape of its frame: the geometry
  never broadcasts one against the other."""
  def check(path, w, u):
    u_shape, w_shape = getattr(u, "shape", None), getattr(w, "shape", None)
    if u_shape is not None and w_shape is not None and (
        tuple(u_shape) != tuple(w_shape)):
      raise ValueError(
          f"{leaf_name(name, path)} has shape {tuple(w_shape)} but its"
          f" update has shape {tuple(u_shape)}; they must be equal.")
  jax.tree_util.tree_map_with_path(check, params, updates)


def check_same_structure(updates, params, name: str) -> None:
  """Raises ValueError when updates and params are different trees."""
  if jax.tree.structure(updates) != jax.tree.structure(params):
    raise ValueError(
        f"{name}: updates and params have different tree structures:"
        f" {jax.tree.structure(updates)} vs {jax.tree.structure(params)}."
        " Pass the gradients of these params.")


# --------------------------------------------------------------------------
# The starting frames.


def is_concrete(x) -> bool:
  """True for an array with values (not traced under jit, not abstract)."""
  return hasattr(x, "dtype") and not isinstance(
      x, (jax.core.Tracer, jax.ShapeDtypeStruct))


# --------------------------------------------------------------------------
# Values on a cluster: each process holds only its shards of a global array
# (`jax.distributed`), so reading one takes a collective that every process
# joins, and then every process reads the same bits and decides alike (a
# process that raised while the others wait in a collective would hang the
# job). An array this process holds whole is read as it is: no collective,
# so a check run by one process alone never waits for the others.


def spans_processes(x) -> bool:
  """True for a concrete jax.Array with shards on other processes' devices."""
  return is_concrete(x) and not getattr(x, "is_fully_addressable", True)


def host_value(x) -> np.ndarray:
  """x as a NumPy array, the same bits on every process.

  np.asarray(x) where this process holds x whole; for a global array
  (`spans_processes`) its all-gather (`multihost_utils.process_allgather`),
  which every process holding a shard of x must call.
  """
  if spans_processes(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _identity(x):
  return x


def replicated(x):
  """x, readable whole (np.asarray) on every process that holds a shard.

  x itself where this process holds it whole, or under jit; a global array
  (`spans_processes`) is copied onto all its devices (an all-gather every
  process joins; the values are unchanged).
  """
  if not spans_processes(x):
    return x
  if isinstance(x.sharding, NamedSharding):
    whole = NamedSharding(x.sharding.mesh, PartitionSpec(),
                          memory_kind=x.sharding.memory_kind)
    return jax.jit(_identity, out_shardings=whole)(x)
  return jnp.asarray(host_value(x))


@jax.jit
def _frame_stats(w):
  """(isometry error, smallest and largest eigenvalue of W^T W) per frame."""
  w = w.astype(arrays.compute_dtype(w.dtype))
  lam = jnp.linalg.eigvalsh(arrays.gram(w))
  return geometry.isometry_error(w), lam[..., 0], lam[..., -1]


def start_tolerance(dtype, r: int) -> float:
  """The isometry error ||W^T W - I||_F accepted for a frame of `dtype`
  with r columns: the one tolerance of the start check (`check_start`,
  hence `init`) and of `check_frames`, so that a frame one accepts the
  other accepts.

  max(1e-4, 4 sqrt(r) eps), eps the dtype's machine epsilon. The bound:
  an orthonormal frame rounded once to its dtype is W + E with
  |E_ij| <= (eps / 2) |W_ij|, so ||E||_F <= (eps / 2) sqrt(r) and
  ||W^T W - I||_F = ||W^T E + E^T W + E^T E||_F <= 2 ||E||_F + ||E||_F^2
  ~ sqrt(r) eps. The factor 4 covers a frame rounded twice (a float32
  polar factor cast to the dtype, then an update added in the dtype by
  `optax.apply_updates`: 2 sqrt(r) eps) with a margin of 2. bf16 (eps =
  2^-7), r = 16: 0.125; float16, r = 16: 1.6e-2. float32 and float64 get
  the 1e-4 floor: a start a little off the manifold is pulled back by the
  first retraction, which forms its polar factor from W + xi itself.
  """
  return max(1e-4, 4.0 * np.sqrt(r) * float(jnp.finfo(dtype).eps))


def _raise_start(name, r, tol, orthonormal_start, fix, hint, traced,
                 deficient, k, lo, hi, bad, j, iso) -> None:
  """The start check's decision, from its summary: `deficient` (a frame is
  rank-deficient; the first is frame `k`, with W^T W's smallest and largest
  eigenvalues `lo`, `hi`), `bad` (a frame's isometry error exceeds `tol`;
  the worst is frame `j`, error `iso`). Frame indices are tuples."""
  traced_note = (
      " (Found by the start check of a traced init, e.g."
      " jax.jit(tx.init): it runs once, on the device, when that init runs;"
      " no update step pays for it.)" if traced else "")
  if deficient:
    raise ValueError(
        f"{name}: frame {k} is rank-deficient (smallest singular value"
        f" {np.sqrt(max(float(lo), 0.0)):.3g}, largest"
        f" {np.sqrt(max(float(hi), 0.0)):.3g}), so no orthonormal frame"
        " is near it. Reinitialise it (e.g. stiefel_optax.random_frames)"
        f" before training.{hint}{traced_note}")
  if orthonormal_start == "check" and bad:
    raise ValueError(
        f"{name}: not orthonormal (isometry error ||W^T W - I||_F ="
        f" {float(iso):.3g} at frame {j}, tolerance {tol:.3g}). {fix}"
        "Or pass orthonormal_start='project' to retract the first step onto"
        " the manifold (this changes the model's function at that"
        f" step).{hint}{traced_note}")


def _check_start_traced(name, frames, orthonormal_start, fix, hint) -> None:
  """The start check of frames traced by an init under `jax.jit` (or any
  trace that runs): summarised on the device and decided by a host
  callback when the traced init runs, raising there.

  The summary (any rank-deficient frame, the first one, its eigenvalues;
  any frame off the manifold, the worst one, its error) is a handful of
  scalars, reduced over every frame (all shards): each is replicated, so
  with `partitioned=True` the callback runs on every device of every
  process with the same bits, and every process raises alike (a callback
  on one device, jax.debug.callback's default under automatic sharding,
  would fail one process while the others wait in their next collective).
  Under `jax.eval_shape` nothing runs: an abstract init checks nothing.
  The error reaches the caller as a `JaxRuntimeError` whose message ends
  with this ValueError's, when the init's result is computed (at once on
  CPU; with asynchronous dispatch, at the latest when its state is used).
  """
  iso, lo, hi = _frame_stats(frames)
  r = frames.shape[-1]
  batch = frames.shape[:-2]
  eps = float(jnp.finfo(arrays.compute_dtype(frames.dtype)).eps)
  tol = start_tolerance(frames.dtype, r)
  iso, lo, hi = iso.ravel(), lo.ravel(), hi.ravel()
  deficient = lo <= r * eps * hi
  k = jnp.argmax(deficient)                      # the first one
  bad = ~(iso <= tol)                            # NaN is off the manifold
  j = jnp.argmax(jnp.where(jnp.isnan(iso), jnp.inf, iso))   # the worst

  def decide(any_deficient, k, lo_k, hi_k, any_bad, j, iso_j):
    index = lambda i: tuple(int(a) for a in np.unravel_index(int(i), batch))
    _raise_start(name, r, tol, orthonormal_start, fix, hint, True,
                 bool(any_deficient), index(k), lo_k, hi_k,
                 bool(any_bad), index(j), iso_j)

  jax.debug.callback(decide, deficient.any(), k, lo[k], hi[k], bad.any(), j,
                     iso[j], partitioned=True)


def check_start(name: str, frames, orthonormal_start: str = "check",
                fix: str = "", hint: str = "") -> None:
  """Raises ValueError, starting with `name`, when frames (..., d, r) hold a
  rank-deficient frame (smallest eigenvalue of W^T W <= r eps times its
  largest), or (orthonormal_start="check") one that is not orthonormal
  (||W^T W - I||_F > `start_tolerance`).

  The one start check of the library: `frame_partition`'s init runs it on
  each selected kernel's frame view, a transform's init on each leaf
  (`check_start_leaves`). Concrete frames are checked at once. Traced
  frames (an init under `jax.jit`, as the sharded recipes' `jax.jit(tx.init,
  out_shardings=...)`) are checked when that traced init runs, on the
  device, by one host callback that raises the same error
  (`_check_start_traced`): a forgotten orthonormalization is never silent,
  and no update step pays for the check. Abstract frames
  (`jax.ShapeDtypeStruct`, `jax.eval_shape`) have no values to check.
  Frames that span several processes (a global array on a cluster) are
  measured inside jit and read whole on every process (`host_value`), so
  every process raises the same error or none. `fix` ends the
  not-orthonormal message (how to orthonormalize), `hint` both messages.
  """
  if isinstance(frames, jax.core.Tracer):
    _check_start_traced(name, frames, orthonormal_start, fix, hint)
    return
  if not is_concrete(frames):
    return
  # Read whole on every process (`host_value`): one decision everywhere.
  iso, lo, hi = (host_value(v) for v in _frame_stats(frames))
  r = frames.shape[-1]
  eps = float(jnp.finfo(arrays.compute_dtype(frames.dtype)).eps)
  deficient = lo <= r * eps * hi
  k = (tuple(int(i) for i in np.argwhere(deficient)[0])
       if deficient.any() else None)
  j = tuple(int(i) for i in np.unravel_index(iso.argmax(), iso.shape))
  _raise_start(name, r, start_tolerance(frames.dtype, r), orthonormal_start,
               fix, hint, False, deficient.any(), k,
               lo[k] if k is not None else 0.0,
               hi[k] if k is not None else 0.0,
               not iso.max() <= start_tolerance(frames.dtype, r), j,
               iso.max())


_START_CHECKED = contextvars.ContextVar("stiefel_optax_start_checked",
                                        default=False)


@contextlib.contextmanager
def start_checked():
  """Within this context `check_start_leaves` skips the start check: the
  caller (`frame_partition`) has checked the same frames, naming their
  kernels, so the check runs once per init. The leaf checks still run."""
  token = _START_CHECKED.set(True)
  try:
    yield
  finally:
    _START_CHECKED.reset(token)


def check_start_leaves(params, name: str, orthonormal_start: str) -> None:
  """The init check of a chain's first link: every leaf can hold frames
  (`check_frame_leaves`), and its frames are a valid start (`check_start`),
  each error naming the leaf."""
  check_frame_leaves(params, name)
  if _START_CHECKED.get():
    return

  def check(path, w):
    check_start(f"{leaf_name(name, path)} (shape {tuple(w.shape)})", w,
                orthonormal_start,
                fix="Orthonormalize it first (stiefel_optax.polar(w)). ",
                hint=kernel_hint(w.shape))

  jax.tree_util.tree_map_with_path(check, params)
