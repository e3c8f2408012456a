"""One reusable O(d)-equivariance check for Stiefel optimizers, on chex asserts.

Proposition 4 of the paper: for Q in O(d) a Stiefel optimizer commutes with
W -> Q W. The step from (Q W, Q G, Q m) is Q times the step from (W, G, m),
so over several steps the trajectory from (Q W_0, Q G_t) is Q times the
trajectory from (W_0, G_t): the frames, and every frame-shaped state leaf
(the momentum, tangent at W, becomes Q m), while every other state leaf
(the step count, the one-scalar-per-frame second moment) is unchanged.

`assert_od_equivariant(tx, w, grads, q, atol=...)` runs both trajectories
and checks all of that with chex asserts; `od_deviation` returns the
measured deviation without asserting (for negative controls such as
`optax.adam`, whose per-coordinate second moment breaks the symmetry).

The gradients are either a fixed sequence of trees G_1..G_T (rotated to
Q G_t) or a function `grads(w, t)` of the current frames, in which case the
rotated run gets the gradients of the rotated problem, Q grads(Q^T w, t).
Rotations are applied in float64 (NumPy) and rounded once to each leaf's
dtype, so the rotated inputs are the correctly rounded Q W and Q G. A leaf
is frame-shaped (rotates) when it is floating with ndim >= 2 and
shape[-2] == d; the library's states have no other leaf of that shape.

`stiefel_optimizers()` lists every Stiefel optimizer of the library (one
shared instance each, so that the jitted step compiles once per shape).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from stiefel_optax import geometry, muon

Grads = Union[Sequence[Any], Callable[[Any, int], Any]]


def haar_orthogonal(seed: int, d: int, det: int = -1) -> np.ndarray:
  """A Haar-random Q in O(d) (float64) with det Q = `det` (+1 or -1; -1 is
  a reflection, the half of O(d) that SO(d)-only arguments miss)."""
  if det not in (1, -1):
    raise ValueError(f"det must be +1 or -1; got {det}.")
  rng = np.random.default_rng(seed)
  q, r = np.linalg.qr(rng.standard_normal((d, d)))
  q = q * np.sign(np.diag(r))
  if np.sign(np.linalg.det(q)) != det:
    q[:, 0] = -q[:, 0]
  return q


def _is_frame_shaped(x, d: int) -> bool:
  return np.ndim(x) >= 2 and np.shape(x)[-2] == d and jnp.issubdtype(
      jnp.result_type(x), jnp.floating)


def rotate(q: np.ndarray, tree, *, as_numpy: bool = False):
  """Q x for every frame-shaped leaf x (..., d, r) of `tree` (d = Q's
  size; computed in float64); other leaves are returned as they are.

  as_numpy=False: rotated leaves are rounded to their own dtype (inputs of
  a run). as_numpy=True: every leaf comes back as a float64 NumPy array
  (for comparisons).
  """
  q = np.asarray(q, np.float64)
  d = q.shape[0]

  def leaf(x):
    if _is_frame_shaped(x, d):
      y = np.einsum("ij,...jr->...ir", q, np.asarray(x).astype(np.float64))
      return y if as_numpy else jnp.asarray(y, jnp.result_type(x))
    return np.asarray(x).astype(np.float64) if as_numpy else x

  return jax.tree.map(leaf, tree)


# (tx, wrap) -> the wrapped step, so that repeated checks of one optimizer
# (the base and the rotated run, hypothesis examples) compile once per shape.
_STEPS = {}


def _step(tx: optax.GradientTransformation, wrap):
  """wrap(step): one tx.update and apply_updates, cached per (tx, wrap)
  (chex's `self.variant` is a new wrapper in every test, so under it the
  cache spans the runs of one test)."""
  key = (tx, wrap)
  if key not in _STEPS:

    def step(w, state, g):
      u, state = tx.update(g, state, w)
      return optax.apply_updates(w, u), state

    _STEPS[key] = wrap(step)
  return _STEPS[key]


def trajectory(tx: optax.GradientTransformation, params, grads: Grads,
               steps: int | None = None, wrap=jax.jit):
  """(frames after each step, states after each step), two lists, of
  `tx` from `params`. grads: a sequence of gradient trees (one per step)
  or a function grads(w, t). wrap: jax.jit, chex's `self.variant`, or the
  identity; the step (tx.update + apply_updates) is wrapped once per
  (tx, wrap) (`_step`)."""

  step = _step(tx, wrap)
  if steps is None:
    if callable(grads):
      raise ValueError("steps is needed when grads is a function.")
    steps = len(grads)
  w, state = params, tx.init(params)
  frames, states = [], []
  for t in range(steps):
    g = grads(w, t) if callable(grads) else grads[t]
    w, state = step(w, state, g)
    frames.append(w)
    states.append(state)
  return frames, states


def _rotated_grads(q: np.ndarray, grads: Grads) -> Grads:
  if not callable(grads):
    return [rotate(q, g) for g in grads]
  qt = np.asarray(q).T
  return lambda w, t: rotate(q, grads(rotate(qt, w), t))


def _numpy64(tree):
  """Every leaf as a float64 NumPy array."""
  return jax.tree.map(lambda x: np.asarray(x).astype(np.float64), tree)


def _rel(a, b) -> float:
  """||a - b|| / ||b|| over all leaves (||a - b|| where b = 0)."""
  la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
  lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
  if not lb:
    return 0.0
  diff = np.linalg.norm(np.concatenate(la) - np.concatenate(lb))
  scale = np.linalg.norm(np.concatenate(lb))
  return float(diff / scale) if scale > 0 else float(diff)


def _run_both(tx, params, grads, q, steps, wrap):
  q = np.asarray(q, np.float64)
  chex.assert_shape(q, (q.shape[0], q.shape[0]))
  base = trajectory(tx, params, grads, steps, wrap)
  turned = trajectory(tx, rotate(q, params), _rotated_grads(q, grads), steps,
                      wrap)
  return q, base, turned


def _deviations(q, params, base, turned):
  """Relative deviations (frames, states) of the rotated run from Q times
  the base run, and the base run's motion max_t ||W_t - W_0|| / ||W_0||."""
  frames = _rel(turned[0], rotate(q, base[0], as_numpy=True))
  states = _rel(_numpy64(turned[1]), rotate(q, base[1], as_numpy=True))
  motion = max((_rel(w, params) for w in base[0]), default=0.0)
  return frames, states, motion


def od_deviation(tx: optax.GradientTransformation, params, grads: Grads,
                 q: np.ndarray, *, steps: int | None = None,
                 wrap=jax.jit) -> float:
  """max(frames, states) relative deviation ||run(QW, QG) - Q run(W, G)||
  / ||Q run(W, G)|| over the whole trajectory (no assertion)."""
  q, base, turned = _run_both(tx, params, grads, q, steps, wrap)
  frames, states, _ = _deviations(q, params, base, turned)
  return max(frames, states)


def assert_od_equivariant(tx: optax.GradientTransformation, params,
                          grads: Grads, q: np.ndarray, *, atol: float,
                          rtol: float = 0.0, steps: int | None = None,
                          wrap=jax.jit, check_state: bool = True,
                          state_atol: float | None = None,
                          min_motion: float = 1e-2) -> float:
  """Asserts run(QW, QG) == Q run(W, G), frames and state, over all steps.

  Args:
    tx: the optimizer (any pytree of frames (..., d, r) as params).
    params: the start W_0.
    grads: a sequence of gradient trees, or a function grads(w, t).
    q: a d x d orthogonal matrix (e.g. `haar_orthogonal(seed, d, det=-1)`).
    atol, rtol: elementwise tolerance of `chex.assert_trees_all_close` on
      the frames, and (state_atol, default atol) on each state leaf divided
      by its largest entry over the trajectory (so that a momentum of any
      scale is judged relative to itself). A momentum is a sum of projected
      gradients and can cancel well below their size, so its rounding can
      be larger than the frames'; a state that does not rotate is off by
      O(1).
    steps: required when grads is a function.
    wrap: how the step is compiled: jax.jit (default), chex's
      `self.variant`, or the identity.
    check_state: also compare the states (frame-shaped leaves rotate,
      the others are equal).
    min_motion: the base trajectory must move, max_t ||W_t - W_0|| /
      ||W_0|| > min_motion, so that a no-op (trivially equivariant) cannot
      pass.

  Returns:
    The measured relative deviation (max over frames and states), for the
    certificate record.
  """
  q, base, turned = _run_both(tx, params, grads, q, steps, wrap)
  base_frames, base_states = base
  turned_frames, turned_states = turned
  chex.assert_tree_all_finite(base_frames)
  chex.assert_tree_all_finite(turned_frames)
  chex.assert_trees_all_equal_shapes_and_dtypes(turned_frames, base_frames)
  frames, states, motion = _deviations(q, params, base, turned)
  assert motion > min_motion, (
      f"the base trajectory moved only {motion:.3e} <= min_motion ="
      f" {min_motion:.1e}: the check would hold trivially")
  chex.assert_trees_all_close(
      _numpy64(turned_frames),
      rotate(q, base_frames, as_numpy=True), atol=atol, rtol=rtol)
  if check_state:
    chex.assert_trees_all_equal_shapes_and_dtypes(turned_states, base_states)
    chex.assert_tree_all_finite(turned_states)
    # Each state leaf stacked over the steps and divided by its largest
    # entry over the whole trajectory (not per step: a momentum that
    # cancels to nearly zero at one step is judged at its usual size).
    stack = lambda states: jax.tree.map(lambda *xs: np.stack(xs), *states)
    expected = stack(rotate(q, base_states, as_numpy=True))
    got = stack(_numpy64(turned_states))

    def normalized(x, ref):
      scale = np.max(np.abs(ref)) if np.size(ref) else 0.0
      return x / scale if scale > 0 else x

    state_atol = atol if state_atol is None else state_atol
    chex.assert_trees_all_close(
        jax.tree.map(normalized, got, expected),
        jax.tree.map(normalized, expected, expected), atol=state_atol,
        rtol=rtol)
    return max(frames, states)
  return frames


# One instance of each optimizer, shared by the test modules so that the
# jitted step (`_step`) compiles once per optimizer, shape and dtype.
_OPTIMIZERS = {}


def stiefel_optimizers(learning_rate: float = 0.05):
  """Every Stiefel optimizer the library offers, in every retraction, at
  its defaults otherwise: {name: GradientTransformation}."""
  if learning_rate not in _OPTIMIZERS:
    txs = {}
    for method in geometry.RETRACTIONS:
      txs[f"stiefel_adam/{method}"] = so.stiefel_adam(
          learning_rate, retraction=method)
      txs[f"riemannian_sgd/{method}"] = so.riemannian_sgd(
          learning_rate, retraction=method)
      txs[f"stiefel_muon/{method}"] = muon.stiefel_muon(
          learning_rate, retraction=method)
    _OPTIMIZERS[learning_rate] = txs
  return _OPTIMIZERS[learning_rate]
