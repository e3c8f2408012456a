"""Flax: `stiefel_attention` trains the Flax block (`helpers.LinenBlock`,
d = 16, 2 heads) with linen's TrainState and the same block in nnx with
nnx.Optimizer, 50 steps each (jitted once): the frames on the manifold at
every step, every other leaf AdamW's; and a jitted step of a model with 8
Q/K kernels, both retractions, in a child process.

What these trainings rest on is tested module by module: selection
(tests/test_specs.py), stiefel_attention's state and optax wrappers
(tests/test_attention.py), check_frames (tests/test_diagnostics.py).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import stiefel_optax as so

from tests.helpers import (
    D, HEADS, LinenBlock, block_data, frame_adam_states, leaves_by_path)

LR, WD = 1e-2, 0.1
STEPS = 50
ISO_TOL = 1e-5


# ---------------------------------------------------------------------------
# The nnx block


class NnxBlock(nnx.Module):
  """The same block in nnx."""

  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=D, qkv_features=D, decode=False,
        rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.mlp_in = nnx.Linear(D, 2 * D, rngs=rngs)
    self.mlp_out = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))


def _assert_euclidean_match(params, ref_params, frames=None):
  got, want = leaves_by_path(params), leaves_by_path(ref_params)
  sel = so.selected_frames(params, frames)
  euclid = [p for p in got if p not in sel]
  assert len(euclid) >= 8, euclid
  for p in euclid:
    # Bit-identical on XLA:CPU; the tolerance only allows for a different
    # fusion of the same arithmetic (a few float32 ulps after 50 steps).
    np.testing.assert_allclose(got[p], want[p], rtol=1e-6, atol=1e-7,
                               err_msg=p)
  return euclid


# ---------------------------------------------------------------------------
# The two 50-step trainings.


def test_linen_train_state_50_steps_frames_on_manifold_rest_is_adamw(
    linen_params):
  model = LinenBlock()
  x, y = block_data()
  assert so.selected_frames(linen_params) == {
      "attn/query/kernel": so.FrameSpec(rows=-3, cols=-1),
      "attn/key/kernel": so.FrameSpec(rows=-3, cols=-1)}
  so.check_frames(linen_params)

  state = train_state.TrainState.create(
      apply_fn=model.apply, params=linen_params,
      tx=so.stiefel_attention(LR, weight_decay=WD))
  ref_tx = optax.adamw(LR, weight_decay=WD)
  ref_params = linen_params
  ref_state = ref_tx.init(ref_params)

  def loss_fn(p):
    return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

  @jax.jit
  def step(state, ref_params, ref_state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads)
    # Pure AdamW fed the very same gradients.
    upd, ref_state = ref_tx.update(grads, ref_state, ref_params)
    return (state, optax.apply_updates(ref_params, upd), ref_state, loss,
            so.max_isometry_error(state.params))

  losses, isos = [], []
  for _ in range(STEPS):
    state, ref_params, ref_state, loss, iso = step(state, ref_params, ref_state)
    losses.append(float(loss))
    isos.append(float(iso))

  assert losses[-1] < 0.8 * losses[0], losses
  assert max(isos) <= ISO_TOL, max(isos)             # at every step
  errs = so.frame_isometry_errors(state.params)
  assert set(errs) == {"attn/query/kernel", "attn/key/kernel"}
  assert all(e.shape == (HEADS,) for e in errs.values())
  assert float(so.max_isometry_error(state.params)) <= ISO_TOL
  moved = so.frame_movement(linen_params, state.params)
  assert all(float(jnp.min(m)) > 1e-2 for m in moved.values()), moved

  euclid = _assert_euclidean_match(state.params, ref_params)
  before = leaves_by_path(linen_params)
  after = leaves_by_path(state.params)
  for p in ("attn/value/kernel", "attn/out/kernel", "mlp_in/kernel",
            "mlp_out/kernel"):
    assert p in euclid
    assert float(jnp.max(jnp.abs(after[p] - before[p]))) > 1e-2, p
  # Unconstrained AdamW lets the same Q/K kernels leave the manifold.
  assert float(so.max_isometry_error(ref_params)) > 1e-2


def test_nnx_optimizer_50_steps_frames_on_manifold_rest_is_adamw():
  model = NnxBlock(nnx.Rngs(0))
  nnx.update(model, so.orthonormalize(nnx.state(model, nnx.Param)))
  x, y = block_data(1)
  start = nnx.as_pure(nnx.state(model, nnx.Param))
  # init sees an nnx.State of Variables, update the pure dicts: the paths
  # (and so the selected frames) are the same.
  assert so.selected_frames(nnx.state(model, nnx.Param)) == so.selected_frames(start)
  optimizer = nnx.Optimizer(
      model, so.stiefel_attention(LR, weight_decay=WD), wrt=nnx.Param)
  ref_tx = optax.adamw(LR, weight_decay=WD)
  ref_params = start
  ref_state = ref_tx.init(ref_params)

  @nnx.jit
  def step(model, optimizer, ref_params, ref_state):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    upd, ref_state = ref_tx.update(nnx.as_pure(grads), ref_state, ref_params)
    iso = so.max_isometry_error(nnx.state(model, nnx.Param))
    return optax.apply_updates(ref_params, upd), ref_state, loss, iso

  losses, isos = [], []
  for _ in range(STEPS):
    ref_params, ref_state, loss, iso = step(model, optimizer, ref_params,
                                            ref_state)
    losses.append(float(loss))
    isos.append(float(iso))

  params = nnx.as_pure(nnx.state(model, nnx.Param))
  assert losses[-1] < 0.8 * losses[0], losses
  assert max(isos) <= ISO_TOL, max(isos)             # at every step
  errs = so.frame_isometry_errors(params)
  assert set(errs) == {"attn/query/kernel", "attn/key/kernel"}
  assert float(so.max_isometry_error(params)) <= ISO_TOL
  assert all(float(jnp.min(m)) > 1e-2
             for m in so.frame_movement(start, params).values())
  _assert_euclidean_match(params, ref_params)
  assert float(so.max_isometry_error(ref_params)) > 1e-2

  # The optimizer state: one first-moment entry per element, one scalar
  # second moment per frame (per head).
  (fs,) = frame_adam_states(nnx.as_pure(optimizer.opt_state))
  mu, nu = leaves_by_path(fs.mu), leaves_by_path(fs.nu)
  assert set(mu) == set(nu) == {"attn/query/kernel", "attn/key/kernel"}
  for p in mu:
    assert mu[p].size == params["attn"][p.split("/")[1]]["kernel"].size
    assert nu[p].shape == (HEADS,)


# ---------------------------------------------------------------------------
# Many kernels: a jitted step with 8 Q/K kernels, both retractions.


_MANY_KERNELS = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp, optax
    import stiefel_optax as so

    # Four attention layers as Flax lays them out, (d, heads, head_dim):
    # 8 query/key kernels with orthonormal per-head frames (numpy QR).
    rng = np.random.default_rng(0)
    def frames():
      q = np.linalg.qr(rng.standard_normal((2, 16, 8)))[0]   # (heads, d, r)
      return jnp.asarray(q.transpose(1, 0, 2), jnp.float32)
    p0 = {f"layers_{i}": {n: {"kernel": frames(), "bias": jnp.zeros((2, 8))}
                          for n in ("query", "key", "value")} for i in range(4)}
    n = len(so.selected_frames(p0))
    for retraction in sys.argv[1:]:
      tx = so.stiefel_attention(1e-2, retraction=retraction)

      @jax.jit
      def step(p, s, key):
        g = jax.tree.map(lambda w: jax.random.normal(key, w.shape), p)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        moved = jnp.min(jnp.stack([jnp.min(m) for m in
                                   so.frame_movement(p0, p).values()]))
        return p, s, so.max_isometry_error(p), moved

      p, s = p0, tx.init(p0)
      for t in range(3):
        p, s, err, moved = step(p, s, jax.random.key(t))
      print(retraction, n, float(err), float(moved), flush=True)
""")


def test_many_kernel_model_jitted_step_both_retractions():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  try:
    proc = subprocess.run(
        [sys.executable, "-c", _MANY_KERNELS, "newton_schulz", "eigh"],
        capture_output=True, text=True, timeout=240, env=env)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"jitted many-kernel step hung (eigh deadlock?): {e.stdout!r}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l.split() for l in proc.stdout.strip().splitlines()]
  assert [l[0] for l in lines] == ["newton_schulz", "eigh"], proc.stdout
  for name, n, err, moved in lines:
    assert int(n) == 8, name
    assert float(err) <= ISO_TOL, (name, err)
    assert float(moved) > 1e-3, (name, moved)
