"""The Optax transforms (stiefel_optax/transforms.py): project_to_tangent,
scale_by_frame_adam (its state, first step, momentum transport, the fused
projection of the momentum mix, tangent_sq_norm), clip_frame_norm and
retract_polar, alone and in chains.

Every test of a transform is a `chex.TestCase` method under
`chex.variants` (`self.variant`). In eager mode the library runs the same
code as under jit (its loops are jitted either way, its Python-side checks
run at trace time), so the eager (without_jit) variant is kept on a
representative subset: the concrete-value checks of project_to_tangent,
scale_by_frame_adam (state, first step, a bfloat16 mu), clip_frame_norm,
the momentum transport, the zero gradient and a NaN frame; the other tests
run jitted only. The aliases built from these transforms are tested in
tests/test_aliases.py, their errors in tests/test_checks.py.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import stiefel_optax as so
from stiefel_optax import arrays, checks, geometry, transforms

from tests.helpers import (
    TestCase, frames, normal, np_frames, np_normal, np_polar, np_project,
    rel)


METHODS = geometry.RETRACTIONS


RETRACTION_PARAMS = [(m,) for m in METHODS]


# ---------------------------------------------------------------------------
# Individual transforms (float32)


class TransformsTest(TestCase):

  @chex.variants(with_jit=True)
  @parameterized.parameters(*RETRACTION_PARAMS)
  def test_uncapped_large_steps_land_on_the_manifold(self, method):
    """Without a trust region the step can be arbitrarily long; the
    retraction must still land on St(d, r) (float32). One compiled update
    (learning rate 1) takes the three step lengths from the gradient's
    scale, which riemannian_sgd passes on linearly (P_W(lr G) = lr P_W(G)).
    (The eager run-time count is exercised by the float64 reference runs of
    riemannian_sgd without a cap.)"""
    w, g = frames(2, (3, 8, 4)), normal(3, (3, 8, 4))
    tx = so.riemannian_sgd(1.0, retraction=method)
    update = self.variant(tx.update)
    for lr in (0.1, 1.0, 30.0):
      u, _ = update(lr * g, tx.init(w), w)
      new = optax.apply_updates(w, u)
      chex.assert_tree_all_finite(new)
      assert float(jnp.max(so.isometry_error(new))) <= 3e-6, lr
      ref = np.stack([np_polar(x) for x in np.asarray(
          w - lr * so.geometry.project_tangent(w, g), np.float64)])
      assert rel(new, ref) <= 1e-5

  @chex.variants(with_jit=True, without_jit=True)
  def test_project_to_tangent(self):
    w, g = frames(4, (2, 8, 4)), normal(5, (2, 8, 4))
    params = {"f32": w, "bf16": w[0].astype(jnp.bfloat16)}
    grads = {"f32": g, "bf16": g[0].astype(jnp.bfloat16)}
    tx = so.project_to_tangent()
    out, state = self.variant(tx.update)(grads, tx.init(params), params)
    assert state == optax.EmptyState()
    chex.assert_trees_all_equal_shapes_and_dtypes(out, grads)
    chex.assert_trees_all_close(out["f32"], so.geometry.project_tangent(w, g),
                                atol=1e-6)
    wtp = jnp.einsum("...di,...dj->...ij", w, out["f32"])
    assert float(jnp.max(jnp.abs(wtp + jnp.swapaxes(wtp, -1, -2)))) <= 1e-5

  @chex.variants(with_jit=True, without_jit=True)
  def test_scale_by_frame_adam_state_and_first_step(self):
    """State: count (), mu like the leaf, nu ONE scalar per frame. First
    step: m = (1 - b1) g, v = (1 - b2) ||g||^2, so u = g / (||g|| + eps)."""
    w = frames(6, (2, 3, 8, 4))
    g = so.geometry.project_tangent(w, normal(7, w.shape))
    tx = so.scale_by_frame_adam(b1=0.8, b2=0.95, eps=0.0)
    state = tx.init(w)
    assert isinstance(state, so.ScaleByFrameAdamState)
    chex.assert_shape(state.count, ())
    chex.assert_trees_all_equal_shapes_and_dtypes(state.mu, w)
    chex.assert_shape(state.nu, (2, 3))
    u, state = self.variant(tx.update)(g, state, w)
    n = jnp.linalg.norm(g, axis=(-2, -1))
    assert int(state.count) == 1
    chex.assert_trees_all_close(state.nu, 0.05 * n ** 2, rtol=1e-5)
    chex.assert_trees_all_close(state.mu, 0.2 * g, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(u, g / n[..., None, None], rtol=1e-4,
                                atol=1e-6)
    # mu_dtype is honoured.
    tx16 = so.scale_by_frame_adam(mu_dtype=jnp.bfloat16)
    s16 = tx16.init(w)
    assert s16.mu.dtype == jnp.bfloat16
    u16, s16 = self.variant(tx16.update)(g, s16, w)
    assert s16.mu.dtype == jnp.bfloat16
    chex.assert_trees_all_equal_shapes_and_dtypes(u16, w)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(True, False)
  def test_momentum_is_carried_to_the_current_tangent_space(self, transport):
    """After the frame moved, the update is tangent at the current frame
    only if the momentum is transported (projected); without it the old
    momentum leaks a normal component (ablation control)."""
    w0, w1 = frames(8, (8, 4)), frames(9, (8, 4))
    g0 = so.geometry.project_tangent(w0, normal(10, (8, 4)))
    g1 = so.geometry.project_tangent(w1, normal(11, (8, 4)))
    tx = so.scale_by_frame_adam(transport_momentum=transport)
    update = self.variant(tx.update)
    _, state = update(g0, tx.init(w0), w0)
    u, _ = update(g1, state, w1)
    defect = jnp.linalg.norm(so.geometry.sym(w1.T @ u)) / jnp.linalg.norm(u)
    if transport:
      assert float(defect) <= 1e-5
    else:
      assert float(defect) >= 1e-2

  @chex.variants(with_jit=True, without_jit=True)
  def test_clip_frame_norm(self):
    """xi <- xi min(1, delta / ||xi||_F) per frame."""
    xi = normal(12, (4, 8, 4)) * jnp.array([0.0, 0.01, 1.0, 10.0])[:, None,
                                                                    None]
    w = frames(13, (4, 8, 4))
    tx = so.clip_frame_norm(0.5)
    out, _ = self.variant(tx.update)(xi, tx.init(w), w)
    chex.assert_tree_all_finite(out)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, xi)
    n_in = np.linalg.norm(xi, axis=(-2, -1))
    n_out = np.linalg.norm(out, axis=(-2, -1))
    chex.assert_trees_all_close(n_out, np.minimum(n_in, 0.5), rtol=1e-5)
    chex.assert_trees_all_close(out[:2], xi[:2])     # under the cap: untouched
    chex.assert_trees_all_close(out[3] / n_out[3], xi[3] / n_in[3],
                                rtol=1e-5, atol=1e-7)  # direction kept

  def test_clip_frame_norm_old_keyword(self):
    """clip_frame_norm(max_norm=...) (and cap_factor's) still works, with a
    DeprecationWarning naming max_step_norm; the same update."""
    xi = normal(14, (3, 8, 4))
    w = frames(15, (3, 8, 4))
    with pytest.warns(DeprecationWarning, match="'max_step_norm'"):
      old = so.clip_frame_norm(max_norm=0.3)
    new = so.clip_frame_norm(max_step_norm=0.3)
    chex.assert_trees_all_equal(old.update(xi, old.init(w), w)[0],
                                new.update(xi, new.init(w), w)[0])
    norm = jnp.asarray([0.0, 0.1, 1.0])
    with pytest.warns(DeprecationWarning, match="'max_step_norm'"):
      old_factor = transforms.cap_factor(norm, max_norm=0.3)
    chex.assert_trees_all_equal(old_factor,
                                transforms.cap_factor(norm, max_step_norm=0.3))
    with pytest.raises(TypeError, match="max_norm"):
      with pytest.warns(DeprecationWarning):
        so.clip_frame_norm(max_norm=0.3, max_step_norm=0.3)
    with pytest.warns(DeprecationWarning, match="check_max_step_norm"):
      assert checks.check_radius("x", 0.3) == 0.3
    with pytest.raises(ValueError, match="max_step_norm"):
      with pytest.warns(DeprecationWarning):
        so.clip_frame_norm(max_norm=-1.0)

  # jit only: the eager retraction (both methods) is run by the float64
  # reference tests.
  @chex.variants(with_jit=True)
  @parameterized.parameters(*RETRACTION_PARAMS)
  def test_retract_polar_lands_on_the_frame(self, method):
    """W + update == polar(W + xi), an orthonormal frame."""
    w = frames(14, (3, 8, 4))
    xi = so.geometry.project_tangent(w, normal(15, w.shape))
    xi = xi * (0.5 / jnp.linalg.norm(xi, axis=(-2, -1)))[:, None, None]
    tx = so.retract_polar(method, max_step_norm=0.5)
    u, _ = self.variant(tx.update)(xi, tx.init(w), w)
    new = optax.apply_updates(w, u)
    chex.assert_trees_all_equal_shapes_and_dtypes(new, w)
    assert float(jnp.max(so.isometry_error(new))) <= 3e-6
    ref = np.stack([np_polar(x) for x in np.asarray(w + xi, np.float64)])
    assert rel(new, ref) <= 1e-5

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*RETRACTION_PARAMS)
  def test_zero_gradient_gives_zero_step(self, method):
    """eps = 0 and G = 0: v = 0 and the Adam step xi is exactly zero, never
    NaN. The whole chain then returns polar(W) - W: zero up to the rounding
    defect of W that the retraction removes. The first nonzero gradient
    afterwards gives a finite step."""
    w = frames(16, (2, 8, 4))
    adam = so.scale_by_frame_adam(eps=0.0)
    tx = so.stiefel_adam(0.1, eps=0.0, retraction=method)
    adam_update, update = self.variant(adam.update), self.variant(tx.update)
    adam_state, state = adam.init(w), tx.init(w)
    for _ in range(3):
      xi, adam_state = adam_update(jnp.zeros_like(w), adam_state, w)
      chex.assert_trees_all_equal(xi, jnp.zeros_like(w))
      u, state = update(jnp.zeros_like(w), state, w)
      chex.assert_tree_all_finite((u, state))
      assert float(jnp.max(jnp.abs(u))) <= 1e-6
    u, state = update(normal(17, w.shape), state, w)
    chex.assert_tree_all_finite((u, state))
    assert float(jnp.max(jnp.abs(u))) > 1e-3
    assert float(jnp.max(so.isometry_error(w + u))) <= 3e-6

  @chex.variants(with_jit=True)
  def test_default_retraction_is_newton_schulz(self):
    """The default chain equals the explicit newton_schulz chain bit for bit
    and the eigh chain to float32 rounding."""
    w = frames(18, (2, 8, 4))
    g = normal(19, w.shape)
    out = {}
    for name, tx in [("default", so.stiefel_adam(0.1)),
                     ("ns", so.stiefel_adam(0.1, retraction="newton_schulz")),
                     ("eigh", so.stiefel_adam(0.1, retraction="eigh"))]:
      out[name] = self.variant(tx.update)(g, tx.init(w), w)[0]
    chex.assert_trees_all_equal(out["default"], out["ns"])
    assert rel(out["ns"], out["eigh"]) <= 1e-4

  # jit only: eager bf16 and mu_dtype handling is checked by
  # test_scale_by_frame_adam_state_and_first_step (both variants).
  @chex.variants(with_jit=True)
  @parameterized.parameters(*RETRACTION_PARAMS)
  def test_shapes_and_dtypes_are_preserved(self, method):
    """Updates, moments and the new frames keep each leaf's shape and dtype;
    nu has one entry per frame; low precision is computed in float32."""
    params = {"a": frames(21, (8, 4)), "b": frames(22, (2, 16, 4)),
              "c": frames(23, (2, 3, 4, 4), jnp.bfloat16)}
    grads = jax.tree.map(lambda w: normal(25, w.shape, w.dtype), params)
    tx = so.stiefel_adam(0.05, retraction=method)
    state = tx.init(params)
    u, state = self.variant(tx.update)(grads, state, params)
    new = optax.apply_updates(params, u)
    chex.assert_trees_all_equal_shapes_and_dtypes(u, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(new, params)
    chex.assert_tree_all_finite(new)
    for k, w in new.items():
      err = float(jnp.max(so.isometry_error(w.astype(jnp.float32))))
      assert err <= {"a": 3e-6, "b": 3e-6, "c": 0.05}[k], (k, err)
    adam_state = state[1]
    chex.assert_trees_all_equal_shapes_and_dtypes(adam_state.mu, params)
    for k, w in params.items():
      chex.assert_shape(adam_state.nu[k], w.shape[:-2])

  @chex.variants(with_jit=True)
  def test_small_tangent_part_of_a_large_gradient(self):
    """G = W S (normal, S symmetric, ||G|| ~ 1e3) plus a tangent part of
    norm ~1e-2: the first Adam step is u = g / ||g|| with ||u||_F = 1 and
    finite. Computing ||g||^2 as ||G||^2 - ||sym(W^T G)||^2 would cancel to
    noise (or a negative v) here in float32; v must come from g itself."""
    w = frames(31, (3, 8, 4))
    s = so.geometry.sym(normal(32, (3, 4, 4)))
    tangent = so.geometry.project_tangent(w, normal(33, w.shape))
    g_big = 300.0 * w @ s + 1e-2 * tangent
    tx = optax.chain(so.project_to_tangent(), so.scale_by_frame_adam(eps=0.0))
    u, state = self.variant(tx.update)(g_big, tx.init(w), w)
    chex.assert_tree_all_finite((u, state))
    chex.assert_trees_all_close(jnp.linalg.norm(u, axis=(-2, -1)),
                                jnp.ones(3), rtol=1e-4)
    assert float(jnp.min(state[1].nu)) > 0.0

  @chex.variants(with_jit=True, without_jit=True)
  def test_uncapped_newton_schulz_one_bad_frame_does_not_stop_the_others(
      self):
    """The run-time step count ignores a frame whose step is not finite."""
    w = frames(29, (3, 8, 4))
    xi = 3.0 * so.geometry.project_tangent(w, normal(30, w.shape))
    xi = xi.at[1].set(jnp.nan)
    retract = self.variant(lambda w, xi: so.retract(
        w, xi, "newton_schulz", max_step_norm=None))
    out = retract(w, xi)
    chex.assert_tree_all_finite(out[jnp.array([0, 2])])
    good = np.asarray(so.isometry_error(out[jnp.array([0, 2])]))
    assert good.max() <= 3e-6


# ---------------------------------------------------------------------------
# The step at its floor: tangent_sq_norm and the fused projection


def _unfused_adam(**kw):
  return optax.chain(so.project_to_tangent(), so.scale_by_frame_adam(**kw))


def _fused_adam(**kw):
  return optax.chain(so.check_orthonormal_start(),
                     so.scale_by_frame_adam(project=True, **kw))


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-6])
def test_tangent_sq_norm_against_the_explicit_form(scale):
  """||G||^2 - ||sym(W^T G)||^2 where it is accurate, the explicit
  ||G - W sym(W^T G)||^2 where g is small relative to G (a gradient nearly
  normal to the manifold): float32 within 1e-4 of the float64 value."""
  w64 = np_frames(3, (4, 64, 8))
  a = np_normal(4, (4, 8, 8))
  g64 = w64 @ (a + np.swapaxes(a, -1, -2)) + scale * np_project(
      w64, np_normal(5, w64.shape))
  exact = np.sum(np_project(w64, g64) ** 2, axis=(-2, -1))
  w, g = jnp.asarray(w64, jnp.float32), jnp.asarray(g64, jnp.float32)
  a = arrays.gram(w, g)
  got = np.asarray(so.tangent_sq_norm(w, g, a))
  explicit32 = np.asarray(jnp.sum(geometry.project_tangent(w, g) ** 2, (-2, -1)))
  np.testing.assert_allclose(got, explicit32, rtol=1e-5)   # the unfused value
  # float32 itself limits the explicit form once g << G (scale 1e-6).
  np.testing.assert_allclose(got, exact, rtol=1e-4 if scale > 1e-4 else 1e-2)
  if scale < 1e-2:   # the identity alone is ruined by cancellation there
    total = jnp.sum(g ** 2, axis=(-2, -1))
    identity = np.asarray(total - jnp.sum(geometry.sym(a) ** 2, axis=(-2, -1)))
    assert np.abs(identity - exact).max() > 1e-2 * exact.max()


def _fused_equals_unfused(dtype, tol):
  """scale_by_frame_adam(project=True) on Euclidean gradients == project_to_tangent
  then scale_by_frame_adam, over 6 steps on a moving frame (one step's
  gradient nearly normal, one frame's gradient NaN: skipped in both)."""
  w = jnp.asarray(np_frames(6, (3, 32, 8)), dtype)
  old, new = _unfused_adam(), _fused_adam()
  s_old, s_new = old.init(w), new.init(w)
  assert jax.tree.structure(s_old) == jax.tree.structure(s_new)
  step = jax.jit(lambda tx, g, s, w: tx.update(g, s, w), static_argnums=0)
  # The frame moves by the exact (eigh) retraction, one small program: how
  # it moves is not what is compared (the Newton–Schulz retraction's
  # fallback would compile a larger one).
  move = jax.jit(lambda w, u: geometry.retract(w, -0.05 * u, "eigh"))
  for t in range(6):
    g = jnp.asarray(np_normal(10 + t, w.shape), dtype)
    if t == 2:
      g = w @ geometry.sym(jnp.asarray(np_normal(30, (3, 8, 8)), dtype)) + 1e-4 * g
    if t == 4:
      g = g.at[1, 0, 0].set(jnp.nan)
    u_old, s_old = step(old, g, s_old, w)
    u_new, s_new = step(new, g, s_new, w)
    assert rel(u_new, u_old) < tol, t
    assert rel(s_new[1].nu, s_old[1].nu) < tol and rel(s_new[1].mu, s_old[1].mu) < tol
    assert bool(jnp.isfinite(u_new).all())
    w = move(w, u_new)
  assert int(s_new[1].count) == 6


def test_projecting_the_momentum_mix_once_equals_the_unfused_chain():
  _fused_equals_unfused(jnp.float32, 2e-5)


@pytest.mark.usefixtures("x64")
def test_projecting_the_momentum_mix_once_equals_the_unfused_chain_f64():
  _fused_equals_unfused(jnp.float64, 1e-12)


def test_fused_moment_needs_transport():
  with pytest.raises(ValueError, match="transport_momentum=True"):
    so.scale_by_frame_adam(project=True, transport_momentum=False)
