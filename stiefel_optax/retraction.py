"""The polar retraction of a Stiefel chain: `retract_polar`, its state.

The last link of the chains of `transforms` (and of the aliases' one-pass
update): it lands W + xi on the manifold by the polar factor
(`geometry.retract`), and, for frames stored below float32, keeps a float32
master copy of them in its state (`MasterFramesState`) so that steps below
their storage's rounding do not stall.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from stiefel_optax import arrays, checks, geometry, newton_schulz


class MasterFramesState(NamedTuple):
  """State of `retract_polar` where some frames are stored below float32.

  Attributes:
    master: for each frame leaf stored below float32 (bfloat16, float16),
      its frames in float32 (the leaf's shape); for any other leaf a
      float32 zero of shape () in its place.
  """
  master: optax.Params


def needs_master(w) -> bool:
  """Whether a frame leaf is stored below its compute dtype (bf16, f16)."""
  return arrays.compute_dtype(w.dtype) != jnp.dtype(w.dtype)


def init_master(params, master_frames: bool, name: str):
  """The retraction link's state: `MasterFramesState` with a float32 copy
  of the frames stored below float32, when master_frames and there are
  such frames; else `optax.EmptyState` (float32 and float64 frames: the
  state is as it always was). With master_frames=False and such frames,
  a warning says that they stall."""
  low = [(p, w) for p, w in jax.tree_util.tree_leaves_with_path(params)
         if needs_master(w)]
  if not low:
    return optax.EmptyState()
  if not master_frames:
    where = ", ".join(f"{jax.tree_util.keystr(tuple(p)) or '<root>'}"
                      f" {jnp.dtype(w.dtype).name}" for p, w in low[:4])
    warnings.warn(
        f"{name}: frames stored below float32 ({where}"
        f"{', ...' if len(low) > 4 else ''}) with master_frames=False: a"
        " step of Frobenius norm lr spreads over d x r entries, most of"
        " them below the dtype's rounding spacing, so most entries never"
        " change and the frames stall (bf16 at lr 1e-3: a fraction of"
        " float32's movement). Keep master_frames=True (a float32 copy of"
        " the frames in the optimizer state) or keep the parameters in"
        " float32 and cast them for the forward pass (README, Mixed"
        " precision).", UserWarning, stacklevel=3)
    return optax.EmptyState()

  def copy(w):
    if not needs_master(w):
      return jnp.zeros((), jnp.float32)
    cdtype = arrays.compute_dtype(w.dtype)
    if isinstance(w, jax.ShapeDtypeStruct):   # an abstract init (a restore)
      return jnp.zeros_like(w, dtype=cdtype)
    return w.astype(cdtype)

  return MasterFramesState(jax.tree.map(copy, params))


def start_frames(state, params):
  """The frames a step starts from: params, or, for a leaf with a float32
  master (`MasterFramesState`), the master wherever it still rounds to the
  stored frame and the stored frame elsewhere (frames changed outside the
  optimizer, a restore of the params alone, an abstract init's zeros): an
  out-of-date master is never used."""
  if not isinstance(state, MasterFramesState):
    return params

  def leaf(m, w):
    if not needs_master(w):
      return w
    m = arrays.like(m, w)
    return jnp.where(m.astype(w.dtype) == w, m, w.astype(m.dtype))

  return jax.tree.map(leaf, state.master, params)


def land(new, state, params):
  """(updates, state) taking `params` to the retracted frames `new`
  (compute dtype). Without a master: new - W in W's dtype. A leaf with a
  master keeps `new` as its master and gets the update round(new) - W,
  which `optax.apply_updates` adds exactly (the difference of two nearby
  bf16 numbers is a bf16 number; where it is not, `start_frames` takes
  the stored frame at the next step)."""
  def update(n, w):
    if not needs_master(w):
      return (n - w.astype(n.dtype)).astype(w.dtype)
    return (n.astype(w.dtype).astype(n.dtype) - w.astype(n.dtype)
            ).astype(w.dtype)

  u = jax.tree.map(update, new, params)
  if not isinstance(state, MasterFramesState):
    return u, state
  master = jax.tree.map(lambda n, m, w: n if needs_master(w) else m,
                        new, state.master, params)
  return u, MasterFramesState(master)


def retract_polar(method: str = "newton_schulz", *,
                  max_step_norm: Optional[chex.Numeric] = None,
                  tangent: bool = True, master_frames: bool = True
                  ) -> optax.GradientTransformation:
  """Turns a step xi into the additive update polar(W + xi) - W.

  `optax.apply_updates(W, update)` then lands on the retracted frame, for
  any full-rank W + xi (`geometry.retract`): method="eigh" is exact;
  method="newton_schulz" (matmul only) runs a fixed, derived step count
  sized for steps ||xi||_F <= max_step_norm on an orthonormal W (see
  `newton_schulz.newton_schulz_steps`), checks the result with a run-time
  certificate, and falls back (on device) to an iteration scaled from
  (W + xi)^T (W + xi) itself when the certificate fails: a longer step, a W
  that is not orthonormal. A rank-deficient W + xi (a zero head) gets a
  finite frame that cannot be orthonormal.

  Args:
    method: "newton_schulz" (default) or "eigh".
    max_step_norm: the trust-region radius of the steps it receives (put
      `clip_frame_norm(max_step_norm)` before it), which fixes the
      Newton–Schulz count at trace time. None (default): no trust region;
      the count is found at run time from the actual step norms, right for
      every step length. A traced `max_step_norm`
      (`optax.inject_hyperparams`) is treated as None.
    tangent: False when the incoming steps are not tangent (no projection
      before it): the fixed count then uses the bound for any step and needs
      max_step_norm < 1; with max_step_norm=None the M-scaled iteration
      runs directly.
    master_frames: for frames stored below float32 (bfloat16, float16):
      True (default) keeps a float32 copy of them in the state
      (`MasterFramesState`), retracts from it and stores the result there,
      so that steps below the dtype's rounding spacing accumulate instead
      of being rounded away; the update lands the params on the copy
      rounded to their dtype. False: retract from the stored frames (a
      warning at init says that they stall). No effect on float32 and
      float64 frames.

  Returns:
    An `optax.GradientTransformation`; its update needs params. Its state
    is `optax.EmptyState`, or `MasterFramesState` where a frame is stored
    below float32 (with master_frames).

  Raises:
    ValueError: for an unknown `method` or an invalid `max_step_norm` (at
      once); at init, for a leaf that cannot hold frames; at update,
      without params or for a step whose shape is not its frame's.

  References:
    P.-A. Absil, R. Mahony and R. Sepulchre, "Optimization Algorithms on
    Matrix Manifolds", Princeton University Press, 2008.

  Example:
    >>> import jax, optax, stiefel_optax as so
    >>> w = so.random_frames(jax.random.key(0), (8, 3))
    >>> xi = 0.3 * so.geometry.project_tangent(w, jax.random.normal(jax.random.key(1), (8, 3)))
    >>> tx = so.retract_polar()
    >>> u, _ = tx.update(xi, tx.init(w), w)
    >>> bool(so.isometry_error(optax.apply_updates(w, u)) < 1e-5)
    True

    bf16 frames step from a float32 copy, which a step far below bf16's
    spacing still moves:

    >>> import jax.numpy as jnp
    >>> w16 = w.astype(jnp.bfloat16)
    >>> state = tx.init(w16)
    >>> type(state).__name__, state.master.dtype
    ('MasterFramesState', dtype('float32'))
    >>> _, state = tx.update(1e-3 * xi, state, w16)
    >>> bool(jnp.any(state.master != w16.astype(jnp.float32)))
    True
  """
  checks.check_choice("retract_polar", "method", method, geometry.RETRACTIONS)
  # static_max_step_norm: max_step_norm as a Python float when it is
  # concrete, None when it is absent or traced (injected): only a static
  # value can fix the Newton–Schulz count at trace time.
  static_max_step_norm = (
      None if max_step_norm is None
      else checks.check_max_step_norm("retract_polar", max_step_norm))
  if static_max_step_norm is not None and not tangent:  # and < 1, any step
    try:
      newton_schulz.newton_schulz_steps(static_max_step_norm, tangent=tangent)
    except ValueError as err:
      raise ValueError(f"retract_polar: {err}") from None

  def init_fn(params):
    checks.check_frame_leaves(params, "retract_polar")
    return init_master(params, master_frames, "retract_polar")

  def update_fn(updates, state, params=None):
    checks.require_params(params, "retract_polar")
    checks.check_update_shapes(updates, params, "retract_polar")
    if not isinstance(state, MasterFramesState):
      return retraction_updates(updates, params, method, static_max_step_norm,
                                tangent), state
    new = retracted(updates, start_frames(state, params), method,
                    static_max_step_norm, tangent)
    return land(new, state, params)

  return optax.GradientTransformation(init_fn, update_fn)


def retracted(xis, ws, method: str, static_max_step_norm: Optional[float],
              tangent: bool = True, step_norms=None):
  """polar(W + xi) of every leaf of the tree `xis` (W from `ws`, of the
  same structure), in W's compute dtype (`geometry.retract` per leaf).

  `step_norms` (||xi||_F per frame, where the caller has them) spare
  `geometry.retract` its own pass over xi. `static_max_step_norm`: the
  trust region's max_step_norm as a Python float, None when there is none
  or it is traced (then the Newton–Schulz count is found at run time).
  The leaves' certificates are checked together (`certified_polars`):
  leaves of one shape, dtype and sharding share one compiled fallback, and
  each leaf's result is the one `geometry.retract` gives it alone.
  """
  leaves, treedef = jax.tree.flatten(xis)
  w_leaves = treedef.flatten_up_to(ws)
  n_leaves = ([None] * len(leaves) if step_norms is None
              else treedef.flatten_up_to(step_norms))
  parts = []
  for xi, w, norm in zip(leaves, w_leaves, n_leaves):
    cdtype = arrays.compute_dtype(w.dtype)
    # The fast path's count follows from max_step_norm and the compute dtype.
    parts.append(geometry.retract_parts(
        w.astype(cdtype), xi.astype(cdtype), method,
        max_step_norm=static_max_step_norm, tangent=tangent,
        step_norm=norm))
  return treedef.unflatten(newton_schulz.certified_polars(parts))


def retraction_updates(xis, ws, method: str,
                       static_max_step_norm: Optional[float],
                       tangent: bool = True, step_norms=None):
  """polar(W + xi) - W of every leaf (`retracted`), computed in W's
  compute dtype and cast to W's dtype."""
  new = retracted(xis, ws, method, static_max_step_norm, tangent, step_norms)
  return jax.tree.map(lambda n, w: (n - w.astype(n.dtype)).astype(w.dtype),
                      new, ws)
