"""The Optax transforms and aliases against the paper's step.

Every transform test is a `chex.TestCase` method under `chex.variants`
(`self.variant`). In eager mode the library runs the same code as under
jit (its loops are jitted either way, its Python-side checks run at trace
time), so the eager (without_jit) variant is kept on a representative
subset: the float64 references of stiefel_adam and riemannian_sgd (the
fused moment, the cap, a schedule, both retractions, the run-time
Newton–Schulz count), the float64 O(d)-equivariance of every optimizer,
the per-coordinate Adam control, the concrete-value checks of
project_to_tangent, scale_by_frame_adam (state, first step, a bfloat16
mu), clip_frame_norm, the momentum transport, the zero gradient and a NaN
frame, and the errors; the other tests run jitted only. float64 runs (the
`x64` fixture, applied to whole classes) are compared with a NumPy
reference of the step written from the paper; their errors are recorded
through the `certificate` fixture. Every Stiefel optimizer is checked for
O(d)-equivariance with `equivariance.assert_od_equivariant` (Q with det +1
and -1).
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
from stiefel_optax import geometry
from stiefel_optax import muon

import equivariance
from conftest import default_dtype, np_frames, np_normal

METHODS = geometry.RETRACTIONS
RETRACTION_PARAMS = [(m,) for m in METHODS]


def frames(seed, shape, dtype=None):
  """Haar frames (float64 under the `x64` fixture, else float32)."""
  return jnp.asarray(np_frames(seed, shape, default_dtype(dtype)))


def normal(seed, shape, dtype=None):
  """Standard normal array (float64 under `x64`, else float32)."""
  return jnp.asarray(np_normal(seed, shape, default_dtype(dtype)))


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class TestCase(chex.TestCase):
  """chex.TestCase with the `certificate` fixture as `self.certificate`."""

  @pytest.fixture(autouse=True)
  def _certificate(self, certificate):
    self.certificate = certificate


# ---------------------------------------------------------------------------
# NumPy reference of the step (the paper's step, exactly), float64.


def np_project(w, g):
  wtg = np.swapaxes(w, -1, -2) @ g
  return g - w @ (0.5 * (wtg + np.swapaxes(wtg, -1, -2)))


def np_polar(a):
  u, _, vt = np.linalg.svd(a, full_matrices=False)
  return u @ vt


def np_frobenius(x):
  return np.sqrt(np.sum(x * x, axis=(-2, -1)))


def reference_stiefel_adam(w, grad_fn, steps, lr, b1, b2, eps, delta):
  """Frames after each step; lr is a function of the step index (0, 1, ...).
  delta=None: no trust region; b1=None: plain Riemannian SGD."""
  m, v, out = np.zeros_like(w), np.zeros(w.shape[:-2]), []
  for t in range(1, steps + 1):
    g = np_project(w, grad_fn(w))
    if b1 is None:
      u = g
    else:
      m = b1 * np_project(w, m) + (1 - b1) * g
      v = b2 * v + (1 - b2) * np_frobenius(g) ** 2
      u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)[..., None,
                                                                     None]
    xi = -lr(t - 1) * u
    if delta is not None:
      n = np_frobenius(xi)
      xi = xi * np.minimum(1.0, delta / np.maximum(n, 1e-300))[..., None, None]
    w = np_polar(w + xi)
    out.append(w)
  return np.stack(out)


def quadratic_problem(d, batch, seed=0):
  """G(W) = -A W + B: the gradient of -tr(W^T A W) / 2 + <B, W> per frame."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((d, d))
  a = a + a.T
  b = rng.standard_normal(batch + (d, 1)) * np.ones(batch + (d, 4)) / 2
  b = b + rng.standard_normal(b.shape) / 2
  return a, b


def trajectory(tx, w, grad_fn, steps, wrap):
  """The frames after each of `steps` steps of `tx`, stacked (a Python loop
  over the step wrapped by `wrap`: chex's `self.variant`)."""
  out, _ = equivariance.trajectory(tx, w, lambda w, t: grad_fn(w), steps,
                                   wrap)
  return jax.tree.map(lambda *ws: jnp.stack(ws), *out)


def scan_steps(tx, w, grad_fn, xs):
  """lax.scan of `tx` steps; grad_fn(w, x) with x from `xs` per step."""

  def body(carry, x):
    w, state = carry
    u, state = tx.update(grad_fn(w, x), state, w)
    w = optax.apply_updates(w, u)
    return (w, state), None

  (w, _), _ = jax.lax.scan(body, (w, tx.init(w)), xs)
  return w


@pytest.mark.usefixtures("x64")
class Float64ReferenceTest(TestCase):
  """float64 trajectories against the NumPy reference, <= 1e-12."""

  def setUp(self):
    super().setUp()
    chex.assert_type(frames(0, (2, 1)), jnp.float64)   # the x64 fixture is on

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*RETRACTION_PARAMS)
  def test_stiefel_adam_matches_reference(self, method):
    """10 steps of `stiefel_adam` (with a learning-rate schedule, some steps
    capped by the trust region) equal the NumPy reference of the paper's step to
    <= 1e-12 relative, with the exact (eigh) retraction and with
    Newton–Schulz, whose float64 step count is derived for a residual of
    ~5 ulp (`geometry.newton_schulz_tol`)."""
    a, b = quadratic_problem(8, (2,))
    w0 = frames(0, (2, 8, 4))
    lr = optax.exponential_decay(0.3, 1, 0.7)
    kw = dict(b1=0.9, b2=0.99, eps=1e-8)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    tx = so.stiefel_adam(lr, **kw, max_step_norm=0.2, retraction=method)
    got = trajectory(tx, w0, lambda w: -ja @ w + jb, 10, self.variant)
    chex.assert_shape(got, (10, 2, 8, 4))
    # optax evaluates the schedule at an int32 count (a float32 value).
    ref = reference_stiefel_adam(np.asarray(w0), lambda w: -a @ w + b, 10,
                                 lambda t: float(lr(jnp.int32(t))),
                                 delta=0.2, **kw)
    # Both the cap and the learning-rate schedule are exercised.
    steps = np.linalg.norm(np.diff(ref, axis=0), axis=(-2, -1))
    assert steps.max() > 0.15 and steps.min() < 0.1
    err = self.certificate(
        f"transforms: stiefel_adam vs reference ({method}, f64)",
        rel(got, ref))
    assert err <= 1e-12

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(max_step_norm=(None, 0.05), method=METHODS)
  def test_riemannian_sgd_matches_reference(self, max_step_norm, method):
    """W+ = polar(W - lr P_W(G)) (capped when asked), both retractions;
    uncapped Newton–Schulz counts its steps at run time."""
    a, b = quadratic_problem(8, (2,), seed=1)
    w0 = frames(1, (2, 8, 4))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    tx = so.riemannian_sgd(0.02, max_step_norm=max_step_norm,
                           retraction=method)
    got = trajectory(tx, w0, lambda w: -ja @ w + jb, 5, self.variant)
    ref = reference_stiefel_adam(np.asarray(w0), lambda w: -a @ w + b, 5,
                                 lambda t: 0.02, None, None, None,
                                 max_step_norm)
    err = self.certificate(
        f"transforms: riemannian_sgd vs reference ({method}, f64)",
        rel(got, ref))
    assert err <= 1e-12

  # jit only: the eager float64 runs above cover the batched (2, 8, 4)
  # step; here eager dispatch cost 2x the jitted run.
  @chex.variants(with_jit=True)
  def test_batched_frames_equal_a_loop_over_single_frames(self):
    """One (2, 2, 8, 4) leaf == a loop over its four (8, 4) frames, each run
    on its own (one compiled (8, 4) step serves the four), over 3 steps."""
    a, b = quadratic_problem(8, (2, 2), seed=2)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    w0 = frames(20, (2, 2, 8, 4))
    tx = so.stiefel_adam(0.1, eps=0.0)
    batched = trajectory(tx, w0, lambda w: -ja @ w + jb, 3, self.variant)
    err = 0.0
    for i in range(2):
      for j in range(2):
        single = trajectory(tx, w0[i, j], lambda w: -ja @ w + jb[i, j], 3,
                            self.variant)
        err = max(err, rel(single, batched[:, i, j]))
    self.certificate("transforms: batched vs loop over frames (f64)", err)
    assert err <= 1e-12


# ---------------------------------------------------------------------------
# O(d)-equivariance of every Stiefel optimizer


OPTIMIZERS = sorted(equivariance.stiefel_optimizers())


class EquivarianceTest(TestCase):
  """run(QW, QG) == Q run(W, G) over 3 steps (the momentum is carried
  twice), frames and state, for Q in O(d) with det +1 and -1
  (`equivariance.assert_od_equivariant`), every Stiefel optimizer."""

  def _check(self, name, det, atol):
    w = frames(40, (2, 8, 4))
    grads = [normal(41 + t, w.shape) for t in range(3)]
    q = equivariance.haar_orthogonal(50 + det, 8, det=det)
    tx = equivariance.stiefel_optimizers()[name]
    return equivariance.assert_od_equivariant(tx, w, grads, q, atol=atol,
                                              wrap=self.variant)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*[(n,) for n in OPTIMIZERS])
  @pytest.mark.usefixtures("x64")
  def test_float64(self, name):
    chex.assert_type(frames(0, (2, 1)), jnp.float64)   # the x64 fixture is on
    for det in (1, -1):
      err = self._check(name, det, atol=1e-13)
      err = self.certificate(
          f"transforms: O(d)-equivariance, 3 steps ({name})", err)
      assert err <= 1e-12, det

  # float32: jit only (the float64 check above runs every optimizer both
  # ways; eager float32 dispatch would repeat it at float32's tolerance).
  @chex.variants(with_jit=True)
  @parameterized.parameters(*[(n,) for n in OPTIMIZERS])
  def test_float32(self, name):
    self._check(name, -1, atol=2e-6)

  @chex.variants(with_jit=True, without_jit=True)
  @pytest.mark.usefixtures("x64")
  def test_per_coordinate_adam_is_not_equivariant(self):
    """Negative control: the same check fails for optax.adam (a per-
    coordinate second moment), so it can fail."""
    w = frames(40, (2, 8, 4))
    grads = [normal(41 + t, w.shape) for t in range(3)]
    q = equivariance.haar_orthogonal(49, 8, det=-1)
    tx = optax.adam(0.05)
    dev = equivariance.od_deviation(tx, w, grads, q, wrap=self.variant)
    assert dev > 1e-3, dev
    with pytest.raises(AssertionError):
      equivariance.assert_od_equivariant(tx, w, grads, q, atol=1e-6,
                                         wrap=self.variant)


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
# float32 long runs


class LongRunTest(TestCase):
  """jit only: lax.scan compiles its body with or without an outer jit, so
  a without_jit variant would run the same compiled program again."""

  @chex.variants(with_jit=True)
  @parameterized.parameters(*RETRACTION_PARAMS)
  def test_isometry_after_2000_float32_steps(self, method):
    """2,000 steps of `stiefel_adam` on noisy gradients in float32: every
    frame keeps ||W^T W - I||_F <= 1e-5 (no drift accumulates)."""
    w0 = frames(27, (4, 16, 4), np.float32)
    noise = normal(28, (2000,) + w0.shape, np.float32)
    a, _ = quadratic_problem(16, (), seed=3)
    ja = jnp.asarray(a, jnp.float32)
    tx = so.stiefel_adam(0.05, retraction=method)
    w = self.variant(lambda w, xs: scan_steps(
        tx, w, lambda w, x: -ja @ w + x, xs))(w0, noise)
    chex.assert_tree_all_finite(w)
    err = float(jnp.max(so.isometry_error(w)))
    self.certificate(
        f"transforms: isometry after 2000 f32 steps ({method})", err)
    assert err <= 1e-5
    assert rel(w, w0) > 0.5                  # the frames really moved

  @chex.variants(with_jit=True)
  def test_convergence_to_top_eigenspace(self):
    """Maximising tr(W^T A W) over St(d, r) reaches the sum of the top-r
    eigenvalues of A (Ky Fan) within 1e-4 relative, from random starts
    (float32)."""
    d, r = 16, 4
    rng = np.random.default_rng(4)
    x = rng.standard_normal((d, d))
    a = (x @ x.T / d).astype(np.float32)        # Wishart: positive spectrum
    target = float(np.sum(np.linalg.eigvalsh(a.astype(np.float64))[-r:]))
    w0 = jnp.asarray(
        np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0]
                  for _ in range(3)]).astype(np.float32))
    ja = jnp.asarray(a)
    tx = so.stiefel_adam(optax.cosine_decay_schedule(0.05, 1500, alpha=1e-3))
    w = self.variant(lambda w: scan_steps(tx, w, lambda w, _: -2.0 * ja @ w,
                                          jnp.zeros(1500)))(w0)
    values = np.asarray(jnp.einsum("bdi,de,bei->b", w, ja, w), np.float64)
    err = float(np.max(np.abs(values - target)) / target)
    self.certificate("transforms: tr(W^T A W) vs top-r eigensum (f32)", err)
    assert err <= 1e-4


# ---------------------------------------------------------------------------
# Errors


def all_transforms():
  return {
      "project_to_tangent": so.project_to_tangent(),
      "scale_by_frame_adam": so.scale_by_frame_adam(),
      "clip_frame_norm": so.clip_frame_norm(1.0),
      "retract_polar": so.retract_polar(),
      "stiefel_adam": so.stiefel_adam(0.1),
      "riemannian_sgd": so.riemannian_sgd(0.1),
      "stiefel_muon": muon.stiefel_muon(0.1),
  }


class ErrorsTest(TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*[(n,) for n in sorted(all_transforms())])
  def test_update_without_params_raises(self, name):
    tx = all_transforms()[name]
    w = {"w": frames(26, (8, 4))}
    state = tx.init(w)
    with pytest.raises(ValueError, match=f"^{name} needs params"):
      self.variant(tx.update)(w, state, None)
    with pytest.raises(ValueError, match=f"^{name} needs params"):
      tx.init(None)


BAD_LEAVES = [
    (np.ones((5,), np.float32), r"\(5,\)"),               # rank 1
    (np.ones((), np.float32), r"\(\)"),                   # rank 0
    (np.ones((3, 4), np.float32), r"\(3, 4\)"),           # r > d
    (np.ones((2, 3, 5), np.float32), r"\(2, 3, 5\)"),     # r > d, batched
    (np.ones((4, 2), np.int32), "int32"),                 # not floating
]


@pytest.mark.parametrize("name", sorted(all_transforms()))
@pytest.mark.parametrize("leaf,match", BAD_LEAVES)
def test_bad_leaf_raises_naming_path_and_shape(name, leaf, match):
  params = {"layer": {"query": jnp.asarray(leaf)}}
  with pytest.raises(ValueError, match=match) as info:
    all_transforms()[name].init(params)
  assert "layer" in str(info.value) and "query" in str(info.value)


def test_bad_method_and_radius_raise():
  for make in (lambda: so.retract_polar("svd"),
               lambda: so.stiefel_adam(0.1, retraction="svd"),
               lambda: so.riemannian_sgd(0.1, retraction="svd"),
               lambda: muon.stiefel_muon(0.1, retraction="svd")):
    with pytest.raises(ValueError, match="svd"):
      make()
  for bad in (0.0, -1.0):
    with pytest.raises(ValueError, match="max_norm"):
      so.clip_frame_norm(bad)
    with pytest.raises(ValueError, match="max_(step_)?norm"):
      so.stiefel_adam(0.1, max_step_norm=bad)


# ------------------------------------------------ the step at its floor


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
  a = geometry.gram(w, g)
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


def test_stiefel_adam_state_keeps_the_unfused_chains_structure():
  """A checkpoint of 0.2's stiefel_adam (project_to_tangent first) restores
  into today's: the same state tree, the same leaves' shapes."""
  w = frames(7, (2, 16, 4))
  old = optax.chain(so.project_to_tangent(), so.scale_by_frame_adam(),
                    optax.scale_by_learning_rate(0.1), so.clip_frame_norm(0.1),
                    so.retract_polar(max_step_norm=0.1))
  new_state, old_state = so.stiefel_adam(0.1).init(w), old.init(w)
  assert jax.tree.structure(new_state) == jax.tree.structure(old_state)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, old_state)


def _stiefel_adam_chain(learning_rate, max_step_norm=0.1,
                        retraction="newton_schulz", mu_dtype=None):
  """`stiefel_adam`'s links as a plain `optax.chain` (the reference of its
  one-pass update)."""
  cap = ([] if max_step_norm is None else [so.clip_frame_norm(max_step_norm)])
  radius = max_step_norm if isinstance(max_step_norm, float) else None
  return optax.chain(
      so.check_orthonormal_start(),
      so.scale_by_frame_adam(mu_dtype=mu_dtype, project=True),
      optax.scale_by_learning_rate(learning_rate), *cap,
      so.retract_polar(retraction, max_step_norm=radius))


ONE_PASS_CASES = {
    "default": (dict(learning_rate=0.05), jnp.float32, 1e-4),
    "long steps, capped": (dict(learning_rate=3.0), jnp.float32, 1e-4),
    "no cap": (dict(learning_rate=0.05, max_step_norm=None), jnp.float32,
               1e-4),
    "schedule": (dict(learning_rate=optax.cosine_decay_schedule(0.3, 6)),
                 jnp.float32, 1e-4),
    "eigh": (dict(learning_rate=0.05, retraction="eigh"), jnp.float32, 1e-4),
    "bf16 moment": (dict(learning_rate=0.05, mu_dtype=jnp.bfloat16),
                    jnp.float32, 1e-4),
    "bf16 frames": (dict(learning_rate=0.05), jnp.bfloat16, 2e-2),
}


@pytest.mark.parametrize("case", list(ONE_PASS_CASES))
def test_stiefel_adam_one_pass_equals_its_chain(case):
  """`stiefel_adam`'s update (the links hand on per-frame scalars, xi is
  never written out) equals the explicit chain of its links over 6 steps
  on moving frames, with the same state tree: one step's gradient holds a
  NaN in one frame (skipped by both), one is nearly normal (the
  cancellation branch). bf16 frames: the chain rounds the step to bf16
  between links, the one-pass update does not."""
  kw, dtype, tol = ONE_PASS_CASES[case]
  params = {"a": frames(40, (3, 32, 8), dtype), "b": frames(41, (16, 4), dtype)}
  one, ref = so.stiefel_adam(**kw), _stiefel_adam_chain(**kw)
  s_one, s_ref = one.init(params), ref.init(params)
  assert jax.tree.structure(s_one) == jax.tree.structure(s_ref)
  step = jax.jit(lambda tx, g, s, w: tx.update(g, s, w), static_argnums=0)
  w = params
  for t in range(6):
    g = jax.tree.map(lambda x, k: normal(50 + 10 * t + k, x.shape, dtype),
                     w, {"a": 0, "b": 1})
    if t == 2:
      g["a"] = g["a"].at[1, 0, 0].set(jnp.nan)
    if t == 3:
      g["a"] = (300.0 * w["a"].astype(jnp.float32) @ geometry.sym(
          normal(60, (3, 8, 8))) + 1e-2 * g["a"]).astype(dtype)
    v_before = s_one[1].nu["a"][1]
    u_one, s_one = step(one, g, s_one, w)
    u_ref, s_ref = step(ref, g, s_ref, w)
    for k in w:
      assert rel(u_one[k], u_ref[k]) < tol, (t, k)
    # The NaN frame is skipped: its second moment stays, and it moves by
    # polar(W) - W only (rounding; bf16 frames round far off the manifold).
    assert bool(s_one[1].nu["a"][1] == v_before) == (t == 2), t
    if t == 2 and dtype == jnp.float32:
      assert float(jnp.max(jnp.abs(u_one["a"][1]))) < 1e-6
    chex.assert_trees_all_equal_shapes_and_dtypes(s_one, s_ref)
    chex.assert_trees_all_close(s_one, s_ref, rtol=tol, atol=tol)
    w = optax.apply_updates(w, u_one)
  chex.assert_tree_all_finite(w)


@pytest.mark.parametrize("max_step_norm", [None, 0.1, 1.0])
def test_riemannian_sgd_one_pass_equals_its_chain(max_step_norm):
  """`riemannian_sgd` shares the one-pass update: equal to project_to_tangent
  -> scale_by_learning_rate -> clip_frame_norm -> retract_polar over 4
  steps (a schedule; long steps, capped or not), the same state tree."""
  lr = optax.linear_schedule(1.0, 0.1, 4)
  cap = [] if max_step_norm is None else [so.clip_frame_norm(max_step_norm)]
  ref = optax.chain(so.project_to_tangent(), optax.scale_by_learning_rate(lr),
                    *cap, so.retract_polar(max_step_norm=max_step_norm))
  one = so.riemannian_sgd(lr, max_step_norm=max_step_norm)
  w = frames(45, (3, 16, 4))
  s_one, s_ref = one.init(w), ref.init(w)
  assert jax.tree.structure(s_one) == jax.tree.structure(s_ref)
  step = jax.jit(lambda tx, g, s, w: tx.update(g, s, w), static_argnums=0)
  for t in range(4):
    g = normal(80 + t, w.shape)
    u_one, s_one = step(one, g, s_one, w)
    u_ref, s_ref = step(ref, g, s_ref, w)
    assert rel(u_one, u_ref) < 1e-4, t
    chex.assert_trees_all_equal(s_one, s_ref)
    w = optax.apply_updates(w, u_one)
  assert float(jnp.max(so.isometry_error(w))) < 3e-6


def test_one_pass_aliases_take_extra_args_as_the_chain_did():
  """optax.chain accepted (and passed on) extra args such as value=; the
  one-pass aliases accept them too."""
  w = frames(46, (2, 16, 4))
  for tx in (so.stiefel_adam(0.1), so.riemannian_sgd(0.1),
             so.stiefel_muon(0.1)):
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    u, _ = tx.update(normal(47, w.shape), tx.init(w), w, value=1.0)
    chex.assert_tree_all_finite(u)


def _project_lead(project):
  """The lead of `riemannian_sgd`: m = P_W(G), c = 1."""
  def lead(updates, states, params):
    g, project_state = project.update(updates, states[0], params)
    return g, None, (project_state,)
  return lead


@pytest.mark.parametrize("max_step_norm", [None, 0.05])
def test_one_pass_chain_builds_the_aliases(max_step_norm):
  """`one_pass_chain` is public: riemannian_sgd written with it is
  riemannian_sgd, bit for bit, state included."""
  project = so.project_to_tangent()
  mine = so.one_pass_chain([project], _project_lead(project), 0.1,
                           max_step_norm=max_step_norm, name="my_sgd")
  ref = so.riemannian_sgd(0.1, max_step_norm=max_step_norm)
  w = frames(48, (2, 16, 4))
  g = normal(49, w.shape)
  s_mine, s_ref = mine.init(w), ref.init(w)
  chex.assert_trees_all_equal(s_mine, s_ref)
  u_mine, s_mine = jax.jit(mine.update)(g, s_mine, w)
  u_ref, s_ref = jax.jit(ref.update)(g, s_ref, w)
  np.testing.assert_array_equal(u_mine, u_ref)
  chex.assert_trees_all_equal(s_mine, s_ref)


def test_one_pass_chain_errors_name_the_optimizer():
  project = so.project_to_tangent()
  make = lambda **kw: so.one_pass_chain([project], _project_lead(project),
                                        0.1, name="my_sgd", **kw)
  with pytest.raises(ValueError, match="^my_sgd: retraction must be one of"):
    make(retraction="svd")
  with pytest.raises(ValueError, match="^my_sgd: max_step_norm must be > 0"):
    make(max_step_norm=0.0)
  with pytest.raises(ValueError, match="^my_sgd: max_step_norm must be > 0"):
    make(max_step_norm=float("inf"))
  tx, w = make(), {"w": frames(50, (16, 4))}
  state = tx.init(w)
  with pytest.raises(ValueError, match="^my_sgd needs params"):
    tx.init(None)
  with pytest.raises(ValueError, match="^my_sgd needs params"):
    tx.update(w, state)
  with pytest.raises(ValueError, match=r"^my_sgd: parameter \['w'\] has shape"
                     r" \(16, 4\) but its update has shape \(16, 1\)"):
    tx.update({"w": normal(51, (16, 1))}, state, w)


def test_start_check_runs_once_per_init(monkeypatch):
  """frame_partition checks the start of every selected kernel, naming its
  path; the Stiefel chain inside does not check it again. A standalone
  optimizer checks its own start."""
  calls = []
  check_start = so.checks.check_start
  monkeypatch.setattr(so.checks, "check_start",
                      lambda name, *a, **k: (calls.append(name),
                                             check_start(name, *a, **k))[1])
  kernel = lambda seed: jnp.transpose(frames(seed, (2, 16, 4)), (1, 0, 2))
  params = {"attn": {"query": {"kernel": kernel(52)},
                     "key": {"kernel": kernel(53)}},
            "out": {"kernel": normal(54, (2, 4, 16))}}
  for tx in (so.stiefel_attention(1e-2), so.stiefel_attention(
      1e-2, orthonormal_start="project", stack_frames=True),
             so.stiefel_attention(1e-2, stiefel_tx=so.stiefel_muon(1e-2))):
    calls.clear()
    tx.init(params)
    # One per kernel, by frame_partition (named by path).
    assert len(calls) == 2 and all(c.startswith("attn/") for c in calls), calls
  calls.clear()
  w = frames(55, (2, 16, 4))
  so.stiefel_adam(1e-2).init(w)
  assert len(calls) == 1, calls
  with pytest.raises(ValueError, match=r"stiefel_optax.polar\(w\)"):
    so.stiefel_adam(1e-2).init(2.0 * w)
  # "project" through the partition: the inner chain (whose own setting
  # is "check") is not asked to check frames that are not orthonormal.
  raw = jax.tree.map(lambda x: 2.0 * x, params)
  so.stiefel_attention(1e-2, orthonormal_start="project").init(raw)
  with pytest.raises(ValueError, match="attn/key/kernel: shape"):
    so.stiefel_attention(1e-2).init(raw)


def _attention_tree():
  kernel = lambda seed: jnp.transpose(frames(seed, (2, 16, 4)), (1, 0, 2))
  return {"attn": {"query": {"kernel": kernel(56)}},
          "out": {"kernel": normal(57, (2, 4, 16))}}


IGNORED_ARGUMENTS = [
    # (replaced groups, arguments, the names the message lists)
    ("stiefel_tx", dict(max_step_norm=0.2), "max_step_norm"),
    ("stiefel_tx", dict(max_step_norm=0.1), "max_step_norm"),   # the default
    ("stiefel_tx", dict(max_step_norm=None), "max_step_norm"),
    ("stiefel_tx", dict(retraction="newton_schulz"), "retraction"),
    ("stiefel_tx", dict(retraction="eigh", stiefel_learning_rate=1e-3),
     "stiefel_learning_rate, retraction"),
    ("stiefel_tx", dict(stiefel_learning_rate=None), "stiefel_learning_rate"),
    ("euclidean_tx", dict(weight_decay=1e-4), "weight_decay"),
    ("both", dict(b1=0.9, mu_dtype=None), "b1, mu_dtype"),
    ("both", dict(eps=1e-8, b2=0.999, weight_decay=0.0),
     "weight_decay, b2, eps"),
]


def _replaced(which):
  stiefel, euclid = so.riemannian_sgd(1e-2), optax.sgd(1e-2)
  return {"stiefel_tx": dict(stiefel_tx=stiefel),
          "euclidean_tx": dict(euclidean_tx=euclid),
          "both": dict(stiefel_tx=stiefel, euclidean_tx=euclid)}[which]


@pytest.mark.parametrize("which,kw,names", IGNORED_ARGUMENTS)
def test_stiefel_attention_refuses_what_a_given_transform_ignores(
    which, kw, names):
  """With stiefel_tx / euclidean_tx given, the arguments only the replaced
  transform would take are refused, even passed at their defaults."""
  with pytest.raises(ValueError,
                     match=f"^stiefel_attention: {names} would be ignored:"
                     r".*Pass them to your own transform"):
    so.stiefel_attention(1e-2, **_replaced(which), **kw)


def test_stiefel_attention_takes_what_the_other_group_uses():
  """The arguments the remaining group uses are taken; the defaults are
  the values they document; optax.inject_hyperparams injects the same
  hyperparameters as before, given transforms or not."""
  params = _attention_tree()
  grads = jax.tree.map(lambda x: normal(58, x.shape), params)
  so.stiefel_attention(1e-2, **_replaced("stiefel_tx"), b1=0.8, b2=0.99,
                       eps=1e-6, weight_decay=0.1, mu_dtype=jnp.bfloat16,
                       orthonormal_start="project").init(params)
  so.stiefel_attention(1e-2, **_replaced("euclidean_tx"), b1=0.8,
                       max_step_norm=0.2, retraction="eigh",
                       stiefel_learning_rate=1e-3,
                       mu_dtype=jnp.bfloat16).init(params)
  explicit = so.stiefel_attention(
      1e-2, stiefel_learning_rate=None, weight_decay=1e-4, b1=0.9, b2=0.999,
      eps=1e-8, max_step_norm=0.1, retraction="newton_schulz", mu_dtype=None)
  default = so.stiefel_attention(1e-2)
  u_explicit, _ = explicit.update(grads, explicit.init(params), params)
  u_default, _ = default.update(grads, default.init(params), params)
  chex.assert_trees_all_equal(u_explicit, u_default)

  inject = optax.inject_hyperparams(so.stiefel_attention)
  for kw in ({}, _replaced("stiefel_tx"), _replaced("both")):
    tx = inject(learning_rate=1e-2, **kw)
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "weight_decay", "b1",
                                      "b2", "eps", "max_step_norm"}
    u, _ = jax.jit(tx.update)(grads, state, params)
    chex.assert_tree_all_finite(u)
  # What inject_hyperparams passes through untouched is still refused.
  with pytest.raises(ValueError, match="^stiefel_attention: retraction"):
    inject(learning_rate=1e-2, retraction="eigh",
           **_replaced("stiefel_tx")).init(params)


def test_stiefel_adam_one_pass_with_injected_hyperparameters():
  """A traced learning rate and trust region (`optax.inject_hyperparams`)
  change between steps as they do in the explicit chain."""
  w = frames(42, (2, 16, 4))
  one = optax.inject_hyperparams(so.stiefel_adam)(0.1, max_step_norm=0.1)
  ref = optax.inject_hyperparams(_stiefel_adam_chain)(0.1, max_step_norm=0.1)
  s_one, s_ref = one.init(w), ref.init(w)
  step = jax.jit(lambda tx, g, s, w: tx.update(g, s, w), static_argnums=0)
  for t, (lr, cap) in enumerate([(0.1, 0.1), (2.0, 0.05), (0.01, 1.0)]):
    for s in (s_one, s_ref):
      s.hyperparams["learning_rate"] = jnp.asarray(lr)
      s.hyperparams["max_step_norm"] = jnp.asarray(cap)
    g = normal(70 + t, w.shape)
    u_one, s_one = step(one, g, s_one, w)
    u_ref, s_ref = step(ref, g, s_ref, w)
    assert rel(u_one, u_ref) < 1e-4, t
    assert float(jnp.max(geometry.frame_norm(u_one))) <= cap * 1.01
    w = optax.apply_updates(w, u_one)


def test_retract_takes_the_callers_step_norm():
  """`retract(..., step_norm=n)` with n = ||xi||_F equals the retraction
  that measures xi itself; a wrong n (or one of the wrong shape) is caught:
  the certificate sends it to the fallback, the shape check raises."""
  w = frames(43, (3, 16, 4))
  xi = 0.1 * so.geometry.project_tangent(w, normal(44, w.shape))
  own = geometry.retract(w, xi, max_step_norm=0.5)
  given = geometry.retract(w, xi, max_step_norm=0.5,
                           step_norm=geometry.frame_norm(xi))
  assert rel(given, own) < 1e-6
  off = geometry.retract(w, 10.0 * xi, max_step_norm=0.5,
                         step_norm=jnp.zeros(3))       # far too small
  assert float(jnp.max(so.isometry_error(off))) < 1e-5
  assert rel(off, geometry.retract(w, 10.0 * xi, "eigh")) < 1e-5
  with pytest.raises(ValueError, match="step_norm"):
    geometry.retract(w, xi, step_norm=jnp.zeros(2))


def test_fused_moment_needs_transport():
  with pytest.raises(ValueError, match="transport_momentum=True"):
    so.scale_by_frame_adam(project=True, transport_momentum=False)
