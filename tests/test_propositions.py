"""The paper's five propositions and the gauge negative result,
certified numerically in float64 to <= 1e-12 relative; the attention-logit
bound of orthonormal Q/K frames; and Propositions 2 and 4 as property tests
(hypothesis) of the whole step over (batch, d, r, dtype).

Each certificate is recorded (see conftest.py) and printed in the terminal
summary. Each proposition also has a control that the same measurement
fails when the property is absent, so the certificates can fail.

The logit bound. If each head's query and key frames W_Q, W_K (d, r) are
orthonormal (W^T W = I_r), then for any tokens x_i, x_j and biases b_q, b_k

    |(W_Q^T x_i + b_q) . (W_K^T x_j + b_k)| / sqrt(r)
        <= (||x_i|| + ||b_q||) (||x_j|| + ||b_k||) / sqrt(r),

because ||W^T x|| <= ||x|| for an orthonormal W (its spectral norm is 1),
then Cauchy-Schwarz and the triangle inequality. Without biases the bound is
||x_i|| ||x_j|| / sqrt(r). The certificate measures the largest ratio of
logit to bound over every head and token pair of a linen attention layer
whose kernels `so.orthonormalize` made orthonormal (it must be <= 1); the
control runs the same measurement on nanoGPT-scaled Gaussian kernels
(std 1, not orthonormal), where the bound fails, so the certificate can
fail.

The property tests compare a transformed run with the base run (rotated
inputs, scaled gradients); the hypothesis helpers are shared with
tests/test_geometry.py (tests/helpers.py).
"""

from __future__ import annotations

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st

import stiefel_optax as so
from stiefel_optax import geometry

from tests import equivariance
from tests.helpers import (
    SETTINGS, cases, data, fro, haar_reflection, np64, precision, project,
    quadratic, rel, runner)


TOL = 1e-12


METHODS = geometry.RETRACTIONS


SHAPE = (2, 8, 4)                 # two frames in St(8, 4)


# Learning rate: early steps are capped by the trust region (0.1), late
# ones are not, so both branches of the cap are in every certificate.
LR = optax.linear_schedule(0.3, 0.02, 20)


def inner(a, b):
  """Frobenius inner product per frame."""
  return jnp.sum(a * b, axis=(-2, -1))


def skew(a):
  return 0.5 * (a - jnp.swapaxes(a, -1, -2))


# ---------------------------------------------------------------------------
# P1: steepest descent


def test_p1_riemannian_gradient_is_steepest_ascent(x64, frames, normal,
                                                   certificate):
  """g = P_W(G) is tangent (W^T g + g^T W = 0), G - g = W S with S
  symmetric is normal, <G, xi> = <g, xi> for every tangent xi, hence
  g / ||g|| maximises <G, xi> over unit tangent xi (value ||g||). (The
  measurements run as one jitted float64 program.)"""
  w, big_g = frames(1, SHAPE), normal(2, SHAPE)
  # 256 random unit tangent directions per frame.
  many = (SHAPE[0], 256) + SHAPE[1:]
  noise = normal(3, many)
  # The first stiefel_adam step (eps = 0, no cap hit) is -lr g / ||g||.
  tx = so.stiefel_adam(0.01, eps=0.0, retraction="eigh")
  state = tx.init(w)

  @jax.jit
  def measure(w, big_g, noise, state):
    g = so.geometry.project_tangent(w, big_g)
    n_g = jnp.linalg.norm(big_g, axis=(-2, -1))
    wtg = jnp.einsum("...di,...dj->...ij", w, g)
    normal_part = big_g - g
    s = jnp.einsum("...di,...dj->...ij", w, normal_part)
    xis = so.geometry.project_tangent(jnp.broadcast_to(w[:, None], many), noise)
    xis = xis / jnp.linalg.norm(xis, axis=(-2, -1), keepdims=True)
    g_norm = jnp.linalg.norm(g, axis=(-2, -1))
    along = inner(big_g[:, None], xis)
    errs = {
        "tangent": jnp.linalg.norm(wtg + jnp.swapaxes(wtg, -1, -2),
                                   axis=(-2, -1)) / n_g,
        "normal = W S": jnp.linalg.norm(normal_part - w @ s,
                                        axis=(-2, -1)) / n_g,
        "S symmetric": jnp.linalg.norm(skew(s), axis=(-2, -1)) / n_g,
        "<G, xi> = <g, xi>": jnp.abs(along - inner(g[:, None], xis))
                             / n_g[:, None],
        "<G, g/|g|> = |g|": jnp.abs(inner(big_g, g) / g_norm - g_norm)
                            / g_norm,
    }
    best = jnp.max(along / g_norm[:, None])
    # Control: the Euclidean direction G / ||G|| is not tangent.
    wtG = jnp.einsum("...di,...dj->...ij", w, big_g)
    control = jnp.min(jnp.linalg.norm(
        wtG + jnp.swapaxes(wtG, -1, -2), axis=(-2, -1)) / n_g)
    u, _ = tx.update(big_g, state, w)
    steepest = so.retract(w, -0.01 * g / g_norm[:, None, None], "eigh")
    return errs, best, control, u, steepest - w

  errs, best, control, u, steepest_step = measure(w, big_g, noise, state)
  for name, e in errs.items():
    err = certificate(f"P1 steepest descent: {name}", jnp.max(e))
    assert err <= TOL, name
  # No unit tangent direction does better than g / ||g||.
  assert float(best) <= 1.0 + TOL
  assert float(control) > 0.1
  err = certificate("P1 first stiefel_adam step = R_W(-lr g/|g|)",
                    rel(u, steepest_step))
  assert err <= TOL


# ---------------------------------------------------------------------------
# P2: gradient-scale independence


@pytest.mark.parametrize("method", METHODS)
def test_p2_trajectory_independent_of_gradient_scale(method, x64, frames,
                                                     certificate):
  """With eps = 0, gradients c G give the same 20-step trajectory as G for
  c in {1e-3, 7.5, 1e4} (the cap is hit on some steps, not all)."""
  a, b = quadratic(4)
  w0 = frames(5, SHAPE)
  run = runner(so.stiefel_adam(LR, eps=0.0, max_step_norm=0.1,
                               retraction=method))
  base = run(w0, a, b, 1.0)
  moves = np.linalg.norm(np.diff(np.asarray(base), axis=0), axis=(-2, -1))
  assert moves.min() < 0.05 and moves.max() > 0.099     # cap hit sometimes
  for c in (1e-3, 7.5, 1e4):
    err = certificate(f"P2 scale independence ({method})",
                      rel(run(w0, a, b, c), base))
    assert err <= TOL, c
  if method != "eigh":
    return
  # Controls: eps > 0 at a small gradient scale, and fixed-step SGD.
  run_eps = runner(so.stiefel_adam(LR, eps=1e-3, max_step_norm=0.1,
                                   retraction=method))
  assert rel(run_eps(w0, a, b, 1e-3), run_eps(w0, a, b, 1.0)) > 1e-4
  run_sgd = runner(so.riemannian_sgd(0.01, retraction=method))
  assert rel(run_sgd(w0, a, b, 7.5), run_sgd(w0, a, b, 1.0)) > 1e-2


# ---------------------------------------------------------------------------
# P3: well-conditioning of the retraction


def test_p3_singular_values_of_w_plus_xi(x64, frames, normal, certificate):
  """For tangent xi with ||xi||_F <= delta the singular values of W + xi
  lie in [1, sqrt(1 + delta^2)]; exactly, sigma_i^2 = 1 + lambda_i(xi^T xi).
  The bound is attained by a rank-one step (sigma_max) and by any step
  with rank < r (sigma_min)."""
  n, d, r = 64, SHAPE[-2], SHAPE[-1]
  w = frames(6, (n, d, r))
  xi = so.geometry.project_tangent(w, normal(7, (n, d, r)))
  radius = jnp.asarray(np.random.default_rng(8).uniform(0.0, 1.0, n))
  worst = 0.0
  for delta in (0.1, 1.0, 3.0):
    step = xi * (delta * radius / jnp.linalg.norm(xi, axis=(-2, -1)))[
        :, None, None]
    sv = np.linalg.svd(np.asarray(w + step), compute_uv=False)
    lam = np.linalg.eigvalsh(np.asarray(
        jnp.einsum("...di,...dj->...ij", step, step)))[..., ::-1]
    worst = max(worst, rel(sv ** 2, 1.0 + lam))
    assert sv.min() >= 1.0 - TOL
    assert sv.max() <= np.sqrt(1.0 + delta ** 2) * (1.0 + TOL)
    # Attained: xi = delta u v^T with u a unit vector orthogonal to span(W)
    # (the normal-complement part of a random vector), v a unit r-vector.
    u = normal(9, (d,))
    u = u - w[0] @ (w[0].T @ u)
    v = jnp.ones(r) / np.sqrt(r)
    rank_one = delta * jnp.outer(u / jnp.linalg.norm(u), v)
    # W^T xi = 0 (so xi is tangent, with xi^T xi = delta^2 v v^T of rank
    # one), and the projection leaves it unchanged.
    assert float(jnp.linalg.norm(w[0].T @ rank_one)) <= TOL * delta
    assert rel(so.geometry.project_tangent(w[0], rank_one), rank_one) <= TOL
    sv1 = np.linalg.svd(np.asarray(w[0] + rank_one), compute_uv=False)
    worst = max(worst, abs(sv1.max() / np.sqrt(1.0 + delta ** 2) - 1.0),
                abs(sv1.min() - 1.0))
  err = certificate("P3 sigma(W + xi)^2 = 1 + eig(xi^T xi)", worst)
  assert err <= TOL
  # Control: a normal (non-tangent) step of the same size shrinks W.
  e1 = jnp.zeros((r, r)).at[0, 0].set(1.0)
  sv = np.linalg.svd(np.asarray(w[0] - 0.5 * w[0] @ e1), compute_uv=False)
  assert sv.min() < 0.6


# ---------------------------------------------------------------------------
# P4: O(d)-equivariance


def p4_optimizers():
  """Every Stiefel optimizer (`equivariance.stiefel_optimizers`), plus
  stiefel_adam on the LR schedule whose early steps hit the trust region
  (so the cap's branch is in the certificate too)."""
  txs = dict(equivariance.stiefel_optimizers())
  for method in METHODS:
    txs[f"stiefel_adam/{method}, capped"] = so.stiefel_adam(
        LR, max_step_norm=0.1, retraction=method)
  return txs


@pytest.mark.parametrize("name", sorted(p4_optimizers()))
def test_p4_equivariance_over_20_steps(name, x64, frames, certificate):
  """For Q in O(d) (det Q = -1): the trajectory from Q W0 on the rotated
  problem (gradients Q G(Q^T W), i.e. A' = Q A Q^T, B' = Q B) is Q times
  the trajectory from W0, and the state (momentum) is Q times the state,
  so every step from (QW, QG, Qm) is Q times the step from (W, G, m)."""
  a, b = quadratic(10)
  w0 = frames(11, SHAPE)
  q = equivariance.haar_orthogonal(12, SHAPE[-2], det=-1)
  err = equivariance.assert_od_equivariant(
      p4_optimizers()[name], w0, lambda w, t: -a @ w + b, q, steps=20,
      atol=1e-13, min_motion=0.1)                 # the frames moved
  err = certificate(f"P4 O(d)-equivariance, 20 steps ({name})", err)
  assert err <= TOL


def test_p4_one_step_from_rotated_state(x64, frames, normal, certificate):
  """One step of the full chain from a mid-run state (W, G, m, v): the
  state (QW, QG, Qm, v) gives Q times the step, and the new moment is Qm."""
  w, g = frames(13, SHAPE), normal(14, SHAPE)
  m = so.geometry.project_tangent(w, normal(15, SHAPE))
  q = haar_reflection(16, SHAPE[-2])
  tx = so.stiefel_adam(0.05, retraction="newton_schulz")

  @jax.jit                         # one compilation for both calls
  def step(w, g, m):
    state = list(tx.init(w))
    state[1] = so.ScaleByFrameAdamState(jnp.asarray(4, jnp.int32), m,
                                        jnp.full(SHAPE[:-2], 2.0))
    u, new_state = tx.update(g, tuple(state), w)
    return u, new_state[1].mu

  u, mu = step(w, g, m)
  u_q, mu_q = step(q @ w, q @ g, q @ m)
  chex.assert_trees_all_close((u_q, mu_q), (q @ u, q @ mu), atol=1e-13)
  err = certificate("P4 one step from (QW, QG, Qm)",
                    max(rel(u_q, q @ u), rel(mu_q, q @ mu)))
  assert err <= TOL


def test_p4_per_coordinate_adam_is_not_equivariant(x64, frames):
  """Negative control: a per-coordinate second moment breaks the
  equivariance, both for plain optax.adam on the frames and for the
  Stiefel chain with optax.scale_by_adam in place of the frame moment;
  the same check as above fails on them."""
  a, b = quadratic(10)
  w0 = frames(11, SHAPE)
  q = equivariance.haar_orthogonal(12, SHAPE[-2], det=-1)
  grads = lambda w, t: -a @ w + b
  per_coordinate = {
      "optax.adam": optax.adam(0.05),
      "riemannian chain + scale_by_adam": optax.chain(
          so.project_to_tangent(), optax.scale_by_adam(eps=0.0),
          optax.scale_by_learning_rate(0.05), so.clip_frame_norm(0.1),
          so.retract_polar("eigh", max_step_norm=0.1)),
  }
  for name, tx in per_coordinate.items():
    dev = equivariance.od_deviation(tx, w0, grads, q, steps=20)
    assert dev > 1e-3, (name, dev)
    with pytest.raises(AssertionError):
      equivariance.assert_od_equivariant(tx, w0, grads, q, steps=20,
                                         atol=1e-6)


# ---------------------------------------------------------------------------
# P5: weight decay has zero Riemannian gradient


def test_p5_weight_decay_changes_nothing(x64, frames, normal, certificate):
  """P_W(W) = 0, so decay added to the gradient anywhere a projection
  follows it (before the whole `stiefel_adam`, or inside the chain between
  two projections) leaves the 20-step trajectory unchanged for lambda in
  {1e-4, 0.1, 10}. (Default retraction: P_W(W) = 0 needs W on St(d, r) to
  rounding, which Newton–Schulz keeps in float64.)"""
  method = "newton_schulz"
  w = frames(17, SHAPE)
  err = certificate("P5 P_W(W) = 0", rel(so.geometry.project_tangent(w, w) + w, w))
  assert err <= TOL
  a, b = quadratic(18)
  base = runner(so.stiefel_adam(LR, max_step_norm=0.1,
                                retraction=method))(w, a, b, 1.0)
  placements = {
      "before": lambda lam: optax.chain(
          optax.add_decayed_weights(lam),
          so.stiefel_adam(LR, max_step_norm=0.1, retraction=method)),
      "inside": lambda lam: optax.chain(
          so.project_to_tangent(), optax.add_decayed_weights(lam),
          so.project_to_tangent(), so.scale_by_frame_adam(),
          optax.scale_by_learning_rate(LR), so.clip_frame_norm(0.1),
          so.retract_polar(method, max_step_norm=0.1)),
  }
  for where, make in placements.items():
    run = runner(make)
    # Against the same optimizer without decay: `stiefel_adam` computes its
    # chain in one pass, equal to the explicit chain only to rounding.
    plain = run(w, a, b, 1.0, 0.0)
    assert rel(plain, base) <= 1e-6
    for lam in (1e-4, 0.1, 10.0):
      err = certificate(f"P5 decay changes nothing ({where}, {method})",
                        rel(run(w, a, b, 1.0, lam), plain))
      assert err <= TOL, (where, lam)
  # Control: decay added to the step after the moments (AdamW's position,
  # no projection after it) does change the trajectory.
  adamw_position = optax.chain(
      so.project_to_tangent(), so.scale_by_frame_adam(),
      optax.add_decayed_weights(0.1), optax.scale_by_learning_rate(LR),
      so.clip_frame_norm(0.1), so.retract_polar(method, max_step_norm=0.1))
  assert rel(runner(adamw_position)(w, a, b, 1.0), base) > 1e-4


# ---------------------------------------------------------------------------
# Negative result: the gauge W_Q -> W_Q O, W_K -> W_K O carries no gradient


def attention_loss(wq, wk, x, targets):
  """Cross-entropy of per-head attention patterns softmax(X W_Q W_K^T X^T)
  against fixed target distributions; depends on (W_Q, W_K) only through
  W_Q W_K^T per head."""
  logits = jnp.einsum("nd,hdr,her,me->hnm", x, wq, wk, x)
  return -jnp.sum(targets * jax.nn.log_softmax(logits, axis=-1))


def test_gauge_direction_carries_no_gradient(x64, frames, normal,
                                             certificate):
  """L(W_Q O, W_K O) = L(W_Q, W_K) for O in O(r), so along the gauge
  tangent (W_Q Omega, W_K Omega), Omega skew, the derivative
  <G_Q, W_Q Omega> + <G_K, W_K Omega> vanishes for every Omega:
  skew(W_Q^T G_Q + W_K^T G_K) = 0. Each term alone is far from 0."""
  wq, wk = frames(19, SHAPE), frames(20, SHAPE)
  x = normal(21, (6, SHAPE[-2]))
  t = jax.nn.softmax(normal(22, (SHAPE[0], 6, 6)), axis=-1)
  o = jnp.stack([haar_reflection(23 + h, SHAPE[-1]) for h in range(SHAPE[0])])
  omega = skew(normal(25, (SHAPE[0], SHAPE[-1], SHAPE[-1])))

  @jax.jit
  def measure(wq, wk, x, t, o, omega):
    loss = attention_loss(wq, wk, x, t)
    err_inv = jnp.abs(attention_loss(wq @ o, wk @ o, x, t) - loss) / jnp.abs(
        loss)
    gq, gk = jax.grad(attention_loss, argnums=(0, 1))(wq, wk, x, t)
    sq = skew(jnp.einsum("hdi,hdj->hij", wq, gq))
    sk = skew(jnp.einsum("hdi,hdj->hij", wk, gk))
    scale = jnp.linalg.norm(sq, axis=(-2, -1))
    # Each term alone is far from zero (the cancellation is not trivial).
    alone = jnp.min(scale / jnp.linalg.norm(gq, axis=(-2, -1)))
    err_grad = jnp.max(jnp.linalg.norm(sq + sk, axis=(-2, -1)) / scale)
    # The same for the Riemannian gradients: (P(G_Q), P(G_K)) is orthogonal
    # to the (tangent) gauge direction.
    rq, rk = so.geometry.project_tangent(wq, gq), so.geometry.project_tangent(wk, gk)
    deriv = inner(rq, wq @ omega) + inner(rk, wk @ omega)
    err_riem = jnp.max(jnp.abs(deriv) / jnp.abs(inner(rq, wq @ omega)))
    # Control: a non-gauge rotation (W_Q only) does change the loss.
    control = jnp.abs(attention_loss(wq @ o, wk, x, t) - loss) / jnp.abs(loss)
    return err_inv, err_grad, err_riem, alone, control

  err_inv, err_grad, err_riem, alone, control = map(
      float, measure(wq, wk, x, t, o, omega))
  assert alone > 1e-2 and control > 1e-3
  err = certificate("gauge: invariance, no gradient along W O",
                    max(err_inv, err_grad, err_riem))
  assert err <= TOL


# ---------------------------------------------------------------------------
# The attention-logit bound of orthonormal per-head Q/K frames


D, HEADS, HEAD_DIM, T = 16, 4, 4, 12


def logit_to_bound(params, x):
  """max over heads and token pairs of |q_i . k_j| / bound_ij, for linen
  query/key kernels (d, heads, r) with biases (heads, r)."""
  q_p, k_p = params["query"], params["key"]
  q = jnp.einsum("td,dhr->htr", x, q_p["kernel"]) + q_p["bias"][:, None]
  k = jnp.einsum("td,dhr->htr", x, k_p["kernel"]) + k_p["bias"][:, None]
  logits = jnp.abs(jnp.einsum("hir,hjr->hij", q, k)) / np.sqrt(HEAD_DIM)
  xn = jnp.linalg.norm(x, axis=-1)                       # (T,)
  bq = jnp.linalg.norm(q_p["bias"], axis=-1)             # (heads,)
  bk = jnp.linalg.norm(k_p["bias"], axis=-1)
  bound = ((xn[None, :, None] + bq[:, None, None])
           * (xn[None, None, :] + bk[:, None, None])) / np.sqrt(HEAD_DIM)
  return float(jnp.max(logits / bound))


def attention_params(seed):
  """A linen MultiHeadDotProductAttention's parameters in float64, biases
  drawn large so that they matter in the bound."""
  mha = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                        qkv_features=HEADS * HEAD_DIM,
                                        param_dtype=jnp.float64)
  x = jnp.zeros((1, T, D), jnp.float64)
  params = mha.init(jax.random.PRNGKey(seed), x)["params"]
  for name in ("query", "key"):
    params[name]["bias"] = jax.random.normal(
        jax.random.PRNGKey(seed + 100), (HEADS, HEAD_DIM), jnp.float64)
  return params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logit_bound_orthonormal_frames(x64, seed, certificate):
  params = so.orthonormalize(attention_params(seed))
  assert so.max_isometry_error(params) < 1e-12
  # Tokens aligned with a query direction make the bound nearly tight.
  x = jax.random.normal(jax.random.PRNGKey(seed + 7), (T, D), jnp.float64)
  x = x.at[0].set(3.0 * params["query"]["kernel"][:, 0, 0])
  x = x.at[1].set(3.0 * params["key"]["kernel"][:, 0, 0])
  ratio = certificate(f"logit bound: max logit / bound (seed {seed})",
                      logit_to_bound(params, x))
  assert ratio <= 1.0 + 1e-12
  assert ratio > 0.3          # the measurement sees logits near the bound


def test_logit_bound_fails_without_orthonormal_frames(x64):
  params = attention_params(0)
  for name in ("query", "key"):
    params[name]["kernel"] = jax.random.normal(
        jax.random.PRNGKey(3), params[name]["kernel"].shape, jnp.float64)
  x = jax.random.normal(jax.random.PRNGKey(7), (T, D), jnp.float64)
  assert so.max_isometry_error(params) > 0.1
  assert logit_to_bound(params, x) > 1.0


# ---------------------------------------------------------------------------
# Properties (hypothesis): Propositions 4 and 2 over shapes and dtypes


# One optimizer for the equivariance and the scale properties (eps = 0,
# the scale-free variant), so that they share one compiled step per
# (shape, dtype) (`equivariance.trajectory` caches it).
TX = so.stiefel_adam(0.05, eps=0.0)


def run(w, grads):
  """The frames after each step of TX."""
  return equivariance.trajectory(TX, w, grads)[0]


@jax.jit
def first_adam_step(g, w):
  """The first step of scale_by_frame_adam with eps > 0: g / (||g|| + eps)."""
  tx = so.scale_by_frame_adam(eps=1e-6)
  return tx.update(g, tx.init(w), w)[0]


@SETTINGS
@given(cases(), st.sampled_from([1, -1]))
def test_step_is_equivariant_under_orthogonal_maps(case, det):
  """Proposition 4 over three steps (so the momentum transport is
  included): frames and momentum from (QW, QG) are Q times those from
  (W, G), second moments equal. The base run must move (`min_motion`);
  optax.adam, a per-coordinate second moment, fails the same check
  (tests/test_aliases.py)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, gs = data(batch, d, r, dtype, seed, n_grads=3)
    q = equivariance.haar_orthogonal(seed + 1, d, det=det)
    # Rounding Q W and Q G to the dtype already differs at its epsilon;
    # each step is well conditioned, so the difference stays at that level.
    atol = 16 * eps if name != "bfloat16" else 4 * eps
    # The momentum sums projected gradients: where it cancels (d = 2,
    # r = 1 has a one-dimensional tangent space), its rounding is relative
    # to the gradients, not to itself. A momentum that does not rotate is
    # off by O(1).
    state_atol = min(1024 * eps, 0.1)
    equivariance.assert_od_equivariant(TX, w, gs, q, atol=atol,
                                       state_atol=state_atol, min_motion=1e-2)


@SETTINGS
@given(cases(), st.integers(-8, 8), st.floats(1e-3, 1e3))
def test_scale_independence_with_eps_zero(case, k, c):
  """Proposition 2: with eps = 0, gradients c G give the trajectory of G;
  for c = 2^k (exact in floating point) bit for bit. The trajectory moves,
  and with eps > 0 a tiny gradient gives a shorter step (the property is
  not that of a constant map)."""
  batch, d, r, name, seed = case
  ctx, dtype, eps = precision(name)
  with ctx:
    w, gs = data(batch, d, r, dtype, seed, n_grads=3)
    base = run(w, gs)
    assert np.all(fro(np64(base[0]) - np64(w)) > 1e-2)      # it moves
    pow2 = run(w, [g * jnp.asarray(2.0 ** k, dtype) for g in gs])
    for a, b in zip(base, pow2):
      np.testing.assert_array_equal(np64(a), np64(b))
    scaled = run(w, [jnp.asarray(np64(g) * c, dtype) for g in gs])
    for a, b in zip(base, scaled):
      # c G rounds in the dtype: equal up to a few of its epsilons.
      assert np.all(fro(np64(a) - np64(b)) <= 16 * eps * math.sqrt(d * r))
    # eps > 0 is not scale-free: a tiny gradient gives a smaller step.
    if name != "bfloat16":
      g = project(w, gs[0])
      u_base = fro(first_adam_step(g, w))
      u_tiny = fro(first_adam_step(g * jnp.asarray(1e-9, dtype), w))
      assert np.all(u_tiny < 0.5 * u_base)
