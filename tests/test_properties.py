"""Property tests (hypothesis) over (batch, d, r, dtype).

Projection idempotent and tangent, retraction on the manifold, exact
O(d)-equivariance of the whole Stiefel-Adam step, gradient-scale
independence with eps = 0. Shapes are tiny and drawn from a small pool and
examples are few: every new shape recompiles. Tolerances are multiples of
the dtype's machine epsilon (float64 runs under `jax.enable_x64`).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings, strategies as st

import stiefel_optax as so
from stiefel_optax import geometry

DTYPES = ("float32", "float64", "bfloat16")
SETTINGS = settings(max_examples=5, deadline=None, derandomize=True,
                    print_blob=True)


@st.composite
def cases(draw):
  """(batch, d, r, dtype, seed)."""
  d = draw(st.sampled_from([2, 3, 5]))
  r = draw(st.integers(1, min(d, 3)))
  batch = draw(st.sampled_from([(), (2,)]))
  dtype = draw(st.sampled_from(DTYPES))
  seed = draw(st.integers(0, 2**16))
  return batch, d, r, dtype, seed


def precision(dtype):
  """x64 context when needed, the dtype, and its machine epsilon."""
  ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
  return ctx, jnp.dtype(dtype), float(jnp.finfo(jnp.dtype(dtype)).eps)


def data(batch, d, r, dtype, seed, n_grads=1):
  kw, *kg = jax.random.split(jax.random.PRNGKey(seed), 1 + n_grads)
  w = so.random_frames(kw, batch + (d, r), dtype)
  gs = [jax.random.normal(k, batch + (d, r), jnp.float32).astype(dtype)
        for k in kg]
  return w, gs


def np64(x):
  return np.asarray(x).astype(np.float64)


def norm(x):
  """||x||_F in float64 (so float64 results are not judged in float32)."""
  return float(np.linalg.norm(np64(x).ravel()))


# Newton–Schulz is sized to reach this residual (`newton_schulz_steps`): the
# float32 rounding level, which bounds its float64 accuracy.
NS_TOL = 1e-8


@SETTINGS
@given(cases())
def test_projection_idempotent_and_tangent(case):
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, (g,) = data(batch, d, r, dtype, seed)
    xi = so.project_tangent(w, g)
    assert xi.dtype == dtype and xi.shape == g.shape
    tol = 16 * eps * math.sqrt(d * r) * (1.0 + norm(g))
    assert norm(so.project_tangent(w, xi) - xi) <= tol
    # Tangent: W^T xi is skew (measured in float64).
    wtx = np.swapaxes(np64(w), -1, -2) @ np64(xi)
    assert norm(wtx + np.swapaxes(wtx, -1, -2)) <= tol
    # The normal part G - P(G) = W sym(W^T G) is orthogonal to the tangent
    # part (Proposition 1's decomposition).
    assert abs(float(np.sum((np64(g) - np64(xi)) * np64(xi)))) <= tol * (
        1 + norm(g))


@SETTINGS
@given(cases(), st.floats(0.0, 1.0), st.sampled_from(["newton_schulz", "eigh"]))
def test_retraction_lands_on_the_manifold(case, step, method):
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, (g,) = data(batch, d, r, dtype, seed)
    xi = so.project_tangent(w.astype(geometry.compute_dtype(dtype)),
                            g.astype(geometry.compute_dtype(dtype)))
    scale = step / jnp.maximum(geometry.frame_norm(xi), 1e-30)
    xi = xi * scale[..., None, None]
    new = so.retract(w, xi, method)
    assert new.dtype == dtype and new.shape == w.shape
    n = np64(new)
    gram = np.swapaxes(n, -1, -2) @ n
    err = float(np.max(np.linalg.norm(gram - np.eye(r), axis=(-2, -1))))
    tol = 8 * eps * math.sqrt(r) + (
        NS_TOL * math.sqrt(r) if method == "newton_schulz" else 0.0)
    assert err <= tol, err
    # It is the polar factor of W + xi: moves by at most ||xi|| (+ rounding).
    moved = np.linalg.norm(n - np64(w), axis=(-2, -1))
    assert float(np.max(moved)) <= step + 8 * eps * math.sqrt(d * r) + NS_TOL


@jax.jit
def run_adam(w, grads, eps=1e-8, learning_rate=0.05):
  """Frames after len(grads) stiefel_adam steps (eps and the learning rate
  are traced: one compile per shape and dtype)."""
  tx = so.stiefel_adam(learning_rate, eps=eps)
  state = tx.init(w)
  out = []
  for g in grads:
    u, state = tx.update(g, state, w)
    w = optax.apply_updates(w, u)
    out.append(w)
  return out


@SETTINGS
@given(cases())
def test_step_is_equivariant_under_orthogonal_maps(case):
  """Proposition 4: the step from (QW, QG) is Q times the step from (W, G),
  over two steps (so the momentum transport is included)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, gs = data(batch, d, r, dtype, seed, n_grads=2)
    q = np64(so.random_frames(jax.random.PRNGKey(seed + 1), (d, d),
                              geometry.compute_dtype(dtype)))
    rot = lambda x: jnp.asarray(np.einsum("ij,...jr->...ir", q, np64(x)),
                                dtype)
    plain = run_adam(w, gs)
    turned = run_adam(rot(w), [rot(g) for g in gs])
    for a, b in zip(plain, turned):
      diff = norm(np.einsum("ij,...jr->...ir", q, np64(a)) - np64(b))
      # Rounding QW and QG to the dtype already differs at its epsilon.
      assert diff <= 64 * eps * math.sqrt(d * r * (1 + len(batch))), diff


@SETTINGS
@given(cases(), st.integers(-8, 8), st.floats(1e-3, 1e3))
def test_scale_independence_with_eps_zero(case, k, c):
  """Proposition 2: with eps = 0, gradients c G give the trajectory of G;
  for c = 2^k (exact in floating point) bit for bit."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, gs = data(batch, d, r, dtype, seed, n_grads=2)
    base = run_adam(w, gs, eps=0.0)
    pow2 = run_adam(w, [g * jnp.asarray(2.0 ** k, dtype) for g in gs], eps=0.0)
    for a, b in zip(base, pow2):
      np.testing.assert_array_equal(np64(a), np64(b))
    scaled = run_adam(w, [jnp.asarray(np64(g) * c, dtype) for g in gs],
                      eps=0.0)
    for a, b in zip(base, scaled):
      # c G rounds in the dtype: equal up to a few of its epsilons.
      assert norm(np64(a) - np64(b)) <= 64 * eps * math.sqrt(
          d * r * (1 + len(batch)))
    # eps > 0 is not scale-free: a tiny gradient gives a smaller step.
    if name != "bfloat16":
      tiny = run_adam(w, [g * jnp.asarray(1e-9, dtype) for g in gs], eps=1e-6)
      assert norm(np64(tiny[0]) - np64(w)) < 0.5 * norm(np64(base[0]) - np64(w))
