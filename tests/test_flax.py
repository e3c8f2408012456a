"""Flax integration: frame selection, stiefel_attention with linen and nnx,
composition with optax wrappers, orthonormal start and diagnostics.

Models are tiny (d = 16, 2 heads); the two 50-step trainings are jitted once.
"""

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import stiefel_optax as so

D, HEADS, HEAD_DIM = 16, 2, 8
LR, WD = 1e-2, 0.1
STEPS = 50
ISO_TOL = 1e-5


# --------------------------------------------------------------------------
# Models and helpers.


class LinenBlock(nn.Module):
  """Pre-norm transformer block: attention + MLP, linen."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=D, name="attn")(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(2 * D, name="mlp_in")(nn.LayerNorm()(x)))
    return x + nn.Dense(D, name="mlp_out")(h)


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


def _data(seed=0, batch=4, seq=6):
  kx, ky = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kx, (batch, seq, D)),
          jax.random.normal(ky, (batch, seq, D)))


def _leaves_by_path(tree):
  return {so.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _frame_adam_states(opt_state):
  is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_fs) if is_fs(x)]


def _real(tree):
  """The array leaves of a tree (MaskedNode is an empty pytree)."""
  return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def _grads_like(params, seed):
  """Standard normal gradients from NumPy (jax.random would compile a
  program for every leaf shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda w: jnp.asarray(rng.standard_normal(w.shape), w.dtype), params)


def _assert_euclidean_match(params, ref_params, frames=None):
  got, want = _leaves_by_path(params), _leaves_by_path(ref_params)
  sel = so.selected_frames(params, frames)
  euclid = [p for p in got if p not in sel]
  assert len(euclid) >= 8, euclid
  for p in euclid:
    # Bit-identical on XLA:CPU; the tolerance only allows for a different
    # fusion of the same arithmetic (a few float32 ulps after 50 steps).
    np.testing.assert_allclose(got[p], want[p], rtol=1e-6, atol=1e-7,
                               err_msg=p)
  return euclid


# One injected optimizer, its update jitted once, shared by two tests.
INJECTED = optax.inject_hyperparams(so.stiefel_attention)(
    learning_rate=LR, weight_decay=WD)
injected_update = jax.jit(INJECTED.update)


@pytest.fixture(scope="module")
def linen_params():
  x, _ = _data()
  return jax.jit(lambda k: so.orthonormalize(
      LinenBlock().init(k, x)["params"]))(jax.random.key(1))


# --------------------------------------------------------------------------
# The two 50-step trainings.


def test_linen_train_state_50_steps_frames_on_manifold_rest_is_adamw(
    linen_params):
  model = LinenBlock()
  x, y = _data()
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
  before = _leaves_by_path(linen_params)
  after = _leaves_by_path(state.params)
  for p in ("attn/value/kernel", "attn/out/kernel", "mlp_in/kernel",
            "mlp_out/kernel"):
    assert p in euclid
    assert float(jnp.max(jnp.abs(after[p] - before[p]))) > 1e-2, p
  # Unconstrained AdamW lets the same Q/K kernels leave the manifold.
  assert float(so.max_isometry_error(ref_params)) > 1e-2


def test_nnx_optimizer_50_steps_frames_on_manifold_rest_is_adamw():
  model = NnxBlock(nnx.Rngs(0))
  nnx.update(model, so.orthonormalize(nnx.state(model, nnx.Param)))
  x, y = _data(1)
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
  (fs,) = _frame_adam_states(nnx.as_pure(optimizer.opt_state))
  mu, nu = _leaves_by_path(fs.mu), _leaves_by_path(fs.nu)
  assert set(mu) == set(nu) == {"attn/query/kernel", "attn/key/kernel"}
  for p in mu:
    assert mu[p].size == params["attn"][p.split("/")[1]]["kernel"].size
    assert nu[p].shape == (HEADS,)


def test_optimizer_state_one_moment_per_element_one_scalar_per_frame(
    linen_params):
  params = linen_params
  tx = so.stiefel_attention(LR)
  state = tx.init(params)
  (fs,) = _frame_adam_states(state)
  leaves = _leaves_by_path(params)
  stiefel = sorted(so.selected_frames(params))
  assert sorted(stiefel) == ["attn/key/kernel", "attn/query/kernel"]
  mu, nu = _leaves_by_path(fs.mu), _leaves_by_path(fs.nu)
  assert sorted(mu) == sorted(nu) == sorted(stiefel)
  for p in stiefel:
    assert mu[p].shape == (HEADS, D, HEAD_DIM)        # the frame view
    assert mu[p].size == leaves[p].size
    assert nu[p].shape == (HEADS,)                     # one scalar per head
  # AdamW's moments hold every other leaf, element by element.
  (adam,) = [x for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(x, optax.ScaleByAdamState)]
  assert sum(x.size for x in _real(adam.nu)) == sum(
      x.size for p, x in leaves.items() if p not in stiefel)
  assert sum(x.size for x in _real(adam.nu)) + sum(
      x.size for x in _real(fs.mu)) == sum(x.size for x in leaves.values())


def test_scanned_layers_kernels_batch_their_frames(linen_params):
  # nn.scan stacks layers in front: (layers, d, heads, head_dim).
  q = linen_params["attn"]["query"]["kernel"]
  params = {"layers": {"query": {"kernel": jnp.stack([q, -q, 2 * q])}}}
  # A 4-D kernel is nn.scan's or MaxText's: auto refuses to guess.
  with pytest.raises(ValueError, match=r"layers/query/kernel: shape \(3, 16, 2, 8\).*'flax'.*'maxtext'"):
    so.orthonormalize(params)
  assert float(so.max_isometry_error(params, "flax")) > 1.0   # the 2 * q layer
  params = so.orthonormalize(params, "flax")
  errs = so.frame_isometry_errors(params, "flax")
  assert errs["layers/query/kernel"].shape == (3, HEADS)
  assert float(jnp.max(errs["layers/query/kernel"])) <= ISO_TOL
  np.testing.assert_allclose(params["layers"]["query"]["kernel"][2], q,
                             atol=1e-5)
  (fs,) = _frame_adam_states(
      so.stiefel_attention(LR, frames="flax").init(params))
  assert _leaves_by_path(fs.nu)["layers/query/kernel"].shape == (3, HEADS)
  assert _leaves_by_path(fs.mu)["layers/query/kernel"].shape == (
      3, HEADS, D, HEAD_DIM)


# --------------------------------------------------------------------------
# Weight decay.


def test_weight_decay_leaves_frames_untouched(linen_params):
  params = linen_params
  sel = so.selected_frames(params)
  start = _leaves_by_path(params)

  def run_injected(weight_decay):          # jitted once, decay as an array
    p, state = params, INJECTED.init(params)
    state.hyperparams["weight_decay"] = jnp.float32(weight_decay)
    for t in range(5):
      u, state = injected_update(_grads_like(params, t), state, p)
      p = optax.apply_updates(p, u)
    return _leaves_by_path(p)

  def run_default(weight_decay):           # the plain factory, a float decay
    tx = so.stiefel_attention(LR, weight_decay=weight_decay)
    p, state, update = params, tx.init(params), jax.jit(tx.update)
    for t in range(3):
      u, state = update(_grads_like(params, t), state, p)
      p = optax.apply_updates(p, u)
    return _leaves_by_path(p)

  # One compiled program (injected decay): bit for bit. Two programs (the
  # decay a constant): XLA may fuse the Stiefel step differently around the
  # AdamW group, so they agree to rounding, 1e-6; a decay reaching a frame
  # would move it by about lr * wd = 5e-4 per step.
  for run, atol in ((run_injected, 0.0), (run_default, 1e-6)):
    no_decay, decay = run(0.0), run(0.5)
    for p in start:
      if p in sel:
        np.testing.assert_allclose(decay[p], no_decay[p], rtol=0, atol=atol,
                                   err_msg=f"{p} ({run.__name__})")
        assert float(jnp.max(jnp.abs(decay[p] - start[p]))) > 1e-3
    # The decay acts on every Euclidean kernel: smaller than without it.
    for p in ("attn/value/kernel", "attn/out/kernel", "mlp_in/kernel",
              "mlp_out/kernel"):
      assert float(jnp.linalg.norm(decay[p])) < 0.995 * float(
          jnp.linalg.norm(no_decay[p])), (run.__name__, p)


# --------------------------------------------------------------------------
# Labels and layouts.


def _random_tree(shapes, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, shapes.items())}


def _one_step_and_state(tx, params, seed=1):
  """One eager update from tx.init: (new params, state). Eager, because
  the small per-op programs are cached across tests and tiny trees."""
  state = tx.init(params)
  grads = jax.tree.map(
      lambda w: jax.random.normal(jax.random.key(seed), w.shape), params)
  upd, state = tx.update(grads, state, params)
  return optax.apply_updates(params, upd), state


def test_regex_mapping_and_callable_selectors():
  params = {"blk": _random_tree(
      {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D)})}
  whole = so.FrameSpec(rows=0, cols=1)
  by_regex = {r"/wq$": whole, r"/wk$": whole}
  by_callable = lambda path, leaf: (
      whole if path.split("/")[-1] in ("wq", "wk") else None)
  want = {"blk/wq": whole, "blk/wk": whole}
  assert so.selected_frames(params, by_regex) == want
  assert so.selected_frames(params, by_callable) == want
  assert so.selected_frames(params, {r"wq": whole}) == {"blk/wq": whole}
  params = so.orthonormalize(params, by_regex)
  new, _ = _one_step_and_state(so.stiefel_attention(LR, frames=by_regex),
                               params)
  errs = so.frame_isometry_errors(new, by_regex)
  assert set(errs) == {"blk/wq", "blk/wk"}
  assert max(float(jnp.max(e)) for e in errs.values()) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["blk"]["wv"] - params["blk"]["wv"]))) > 0
  # An entry that matches nothing is an error naming it, never dropped.
  with pytest.raises(ValueError, match=r"entry '/wz\$' matches no parameter path; nearby paths: .*blk/w"):
    so.stiefel_attention(LR, frames={**by_regex, r"/wz$": whole}).init(params)


def test_einsum_heads_d_head_dim_kernels_with_spec():
  pat = r"/(q|k)_einsum$"
  params = {"attn": _random_tree(
      {"q_einsum": (HEADS, D, HEAD_DIM), "k_einsum": (HEADS, D, HEAD_DIM),
       "v_einsum": (HEADS, D, HEAD_DIM)})}
  spec = so.FrameSpec(rows=1, cols=2)
  # Rows on the heads axis (2) give d < head_dim: named, with the fix.
  with pytest.raises(ValueError, match=r"attn/[kq]_einsum: shape \(2, 16, 8\).*\(d, r\) = \(2, 8\).*FrameSpec\(rows=1, cols=2\) fits"):
    so.stiefel_attention(LR, frames={pat: so.FrameSpec(rows=0, cols=2)}
                         ).init(params)
  params = so.orthonormalize(params, {pat: spec})
  new, state = _one_step_and_state(so.stiefel_attention(LR, frames={pat: spec}),
                                   params)
  (fs,) = _frame_adam_states(state)
  assert _leaves_by_path(fs.nu)["attn/q_einsum"].shape == (HEADS,)
  for name in ("q_einsum", "k_einsum"):
    for h in range(HEADS):
      w = new["attn"][name][h]                       # (d, head_dim)
      err = jnp.linalg.norm(w.T @ w - jnp.eye(HEAD_DIM))
      assert float(err) <= ISO_TOL, (name, h, err)
    assert float(jnp.max(jnp.abs(new["attn"][name] - params["attn"][name]))) > 1e-3


def test_2d_kernels_split_into_heads_with_grouped_query_key():
  # 2-D kernels: query (d, heads * head_dim), key with one KV head.
  params = {"attn": {"query": {"kernel": jax.random.normal(jax.random.key(0), (D, HEADS * HEAD_DIM))},
                     "key": {"kernel": jax.random.normal(jax.random.key(1), (D, HEAD_DIM))},
                     "value": {"kernel": jax.random.normal(jax.random.key(2), (D, HEAD_DIM))}}}
  # Auto cannot know the heads of a 2-D kernel: it says which spec fits.
  with pytest.raises(ValueError, match=r"attn/key/kernel: shape \(16, 8\).*FrameSpec\(rows=0, cols=1, heads=H\)"):
    so.selected_frames(params)
  frames = {r"query/kernel$": so.FrameSpec(rows=0, cols=1, heads=HEADS),
            r"key/kernel$": so.FrameSpec(rows=0, cols=1, heads=1)}
  params = so.orthonormalize(params, frames)
  q = params["attn"]["query"]["kernel"]
  # Per-head frames, not one (16, 16) frame: each head's columns orthonormal.
  for h in range(HEADS):
    blk = q[:, h * HEAD_DIM:(h + 1) * HEAD_DIM]
    assert float(jnp.linalg.norm(blk.T @ blk - jnp.eye(HEAD_DIM))) <= ISO_TOL
  assert float(jnp.linalg.norm(q.T @ q - jnp.eye(D))) > 1e-2
  new, state = _one_step_and_state(so.stiefel_attention(LR, frames=frames),
                                   params)
  nu = _leaves_by_path(_frame_adam_states(state)[0].nu)
  assert nu["attn/query/kernel"].shape == (HEADS,)
  assert nu["attn/key/kernel"].shape == (1,)
  errs = so.frame_isometry_errors(new, frames)
  assert errs["attn/query/kernel"].shape == (HEADS,)
  assert float(so.max_isometry_error(new, frames)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["attn"]["key"]["kernel"]
                               - params["attn"]["key"]["kernel"]))) > 1e-3
  with pytest.raises(ValueError, match=r"attn/key/kernel: shape \(16, 8\) has 8 columns.*heads = 3"):
    so.stiefel_attention(LR, frames={r"key/kernel$": so.FrameSpec(
        rows=0, cols=1, heads=3)}).init(params)


def test_grouped_query_3d_key_kernel_fewer_heads(linen_params):
  params = {"query": {"kernel": linen_params["attn"]["query"]["kernel"]},
            "key": {"kernel": linen_params["attn"]["key"]["kernel"][:, :1]}}
  new, state = _one_step_and_state(so.stiefel_attention(LR), params)
  (fs,) = _frame_adam_states(state)
  nu = _leaves_by_path(fs.nu)
  assert nu == {"query/kernel": nu["query/kernel"], "key/kernel": nu["key/kernel"]}
  assert nu["query/kernel"].shape == (HEADS,) and nu["key/kernel"].shape == (1,)
  errs = so.frame_isometry_errors(new)
  assert errs["key/kernel"].shape == (1,)
  assert float(so.max_isometry_error(new)) <= ISO_TOL


def test_whole_projection_frame(linen_params):
  params = {"query": {"kernel": linen_params["attn"]["query"]["kernel"]},
            "key": {"kernel": linen_params["attn"]["key"]["kernel"]}}
  whole = {r"(query|key)/kernel$": so.FrameSpec(rows=0, cols=(1, 2))}
  # Per-head frames are not a whole-projection frame...
  assert float(so.max_isometry_error(params, whole)) > 1e-2
  params = so.orthonormalize(params, whole)
  w = params["query"]["kernel"].reshape(D, HEADS * HEAD_DIM)
  assert float(jnp.linalg.norm(w.T @ w - jnp.eye(D))) <= ISO_TOL
  new, state = _one_step_and_state(so.stiefel_attention(LR, frames=whole),
                                   params)
  (fs,) = _frame_adam_states(state)
  assert all(v.shape == () for v in _leaves_by_path(fs.nu).values())
  assert all(m.shape == (D, HEADS * HEAD_DIM)
             for m in _leaves_by_path(fs.mu).values())
  errs = so.frame_isometry_errors(new, whole)
  assert all(e.shape == () for e in errs.values())
  assert float(so.max_isometry_error(new, whole)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["query"]["kernel"] - params["query"]["kernel"]))) > 1e-3


def test_head_dim_larger_than_d_names_path_and_shape():
  params = {"attn": {"query": {"kernel": jnp.ones((4, 2, 8))},
                     "key": {"kernel": jnp.ones((8, 2, 8))}}}
  with pytest.raises(ValueError, match=r"attn/query/kernel: shape \(4, 2, 8\)"):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"attn/query/kernel.*\(4, 2, 8\)"):
    so.orthonormalize(params)


def test_nothing_selected_lists_paths():
  params = {"encoder": {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}}}
  with pytest.raises(ValueError, match=r"selects no leaf.*encoder/dense/kernel"):
    so.selected_frames(params)
  with pytest.raises(ValueError, match=r"encoder/dense/bias"):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"'wq\$' matches no parameter path"):
    so.selected_frames(params, {r"wq$": so.FrameSpec()})
  with pytest.raises(ValueError, match=r"not a preset"):
    so.selected_frames(params, "llama")


def test_bad_selector_values_name_the_path(linen_params):
  with pytest.raises(ValueError, match=r"attn/key/kernel: the frame selector returned 'adam'"):
    so.stiefel_attention(LR, frames=lambda path, leaf: (
        "adam" if path.endswith("key/kernel") else None)).init(linen_params)
  with pytest.raises(ValueError, match=r"frames\['query'\] = 'adam'"):
    so.selected_frames(linen_params, {"query": "adam"})
  with pytest.raises(ValueError, match=r"is not a frame selector"):
    so.selected_frames(linen_params, 3)
  with pytest.raises(ValueError, match=r"several frames= entries"):
    so.selected_frames(linen_params, {"query": so.FrameSpec(rows=0, cols=2),
                               "attn/q": so.FrameSpec(rows=0, cols=(1, 2))})
  state = so.stiefel_attention(LR, frames={"query/kernel$": so.FrameSpec(
      rows=0, cols=2)}).init(linen_params)
  assert len(_leaves_by_path(_frame_adam_states(state)[0].nu)) == 1


# --------------------------------------------------------------------------
# Composition with optax wrappers.


def _assert_trees_close(a, b, atol=1e-6):
  for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5, err_msg=so.path_str(p))


def test_inject_hyperparams_change_learning_rate_between_steps(linen_params):
  params = linen_params
  istate = INJECTED.init(params)
  assert set(istate.hyperparams) >= {"learning_rate", "weight_decay", "b1",
                                     "max_step_norm"}
  update = injected_update
  plain1 = so.stiefel_attention(LR, weight_decay=WD)
  plain2 = so.stiefel_attention(LR / 4, weight_decay=WD)
  pstate = plain1.init(params)
  p_inj = p_ref = params
  for t in range(3):
    if t == 2:
      istate.hyperparams["learning_rate"] = jnp.asarray(LR / 4)
    g = _grads_like(params, t)
    u_inj, istate = update(g, istate, p_inj)
    u_ref, pstate = (plain1 if t < 2 else plain2).update(g, pstate, p_ref)
    _assert_trees_close(u_inj, u_ref)
    p_inj = optax.apply_updates(p_inj, u_inj)
    p_ref = optax.apply_updates(p_ref, u_ref)
  assert float(so.max_isometry_error(p_inj)) <= ISO_TOL
  # The last step really was smaller on the Euclidean kernels.
  assert float(jnp.max(jnp.abs(u_inj["mlp_in"]["kernel"]))) < 0.5 * LR

  # Schedules work too; an injected radius too large for Newton–Schulz is
  # refused, and shape arguments must be static.
  sched = optax.inject_hyperparams(so.stiefel_attention)(
      learning_rate=optax.linear_schedule(LR, 0.0, 4))
  s = sched.init(params)
  for t in range(2):
    u, s = sched.update(_grads_like(params, 5), s, params)
  assert float(s.hyperparams["learning_rate"]) == pytest.approx(LR * 3 / 4)
  with pytest.raises(ValueError, match="max_step_norm must be > 0"):
    optax.inject_hyperparams(so.stiefel_attention)(
        learning_rate=LR, max_step_norm=0.0).init(params)
  # An injected radius is traced: Newton–Schulz sizes itself at run time, so
  # a radius raised between steps (to 2, far past its fixed-count sizing)
  # still lands every frame on the manifold, with steps longer than 1.
  istate.hyperparams["max_step_norm"] = jnp.asarray(2.0)
  istate.hyperparams["learning_rate"] = jnp.asarray(10.0)
  u, _ = update(_grads_like(params, 6), istate, p_inj)
  assert float(jnp.max(jnp.linalg.norm(
      u["attn"]["query"]["kernel"], axis=(0, 2)))) > 1.0
  assert float(so.max_isometry_error(optax.apply_updates(p_inj, u))) <= ISO_TOL
  # Selectors: a preset, a spec mapping need no static_args; a callable
  # selector (which inject_hyperparams would take for a schedule) does.
  spec = so.FrameSpec(rows=0, cols=2)
  for frames in ("flax", {r"query/kernel$": spec}):
    ok = optax.inject_hyperparams(so.stiefel_attention)(
        learning_rate=LR, frames=frames)
    assert len(_frame_adam_states(ok.init(params))) == 1
  ok = optax.inject_hyperparams(so.stiefel_attention, static_args=("frames",))(
      learning_rate=LR, frames=lambda path, leaf: (
          spec if path.endswith("query/kernel") else None))
  assert len(_frame_adam_states(ok.init(params))) == 1


def test_multi_steps_accumulates_then_takes_one_stiefel_step(linen_params):
  params = linen_params
  tx = optax.MultiSteps(so.stiefel_attention(LR), every_k_schedule=2)
  update = jax.jit(tx.update)
  state = tx.init(params)
  g1, g2 = _grads_like(params, 1), _grads_like(params, 2)
  u1, state = update(g1, state, params)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(u1))
  u2, state = update(g2, state, params)
  plain = so.stiefel_attention(LR)
  want, _ = plain.update(jax.tree.map(lambda a, b: (a + b) / 2, g1, g2),
                         plain.init(params), params)
  _assert_trees_close(u2, want)
  new = optax.apply_updates(params, u2)
  assert float(so.max_isometry_error(new)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["attn"]["query"]["kernel"]
                               - params["attn"]["query"]["kernel"]))) > 1e-3


def test_apply_if_finite_skips_non_finite_steps(linen_params):
  params = linen_params
  tx = optax.apply_if_finite(so.stiefel_attention(LR), max_consecutive_errors=3)
  update = jax.jit(tx.update)
  state = tx.init(params)
  for where in (("mlp_in", "kernel"), ("attn", "query", "kernel")):
    g = _grads_like(params, 3)
    leaf = g
    for k in where[:-1]:
      leaf = leaf[k]
    leaf[where[-1]] = leaf[where[-1]].at[0, 0].set(jnp.nan)
    u, state = update(g, state, params)
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))
  assert int(state.notfinite_count) == 2
  g = _grads_like(params, 4)
  u, state = update(g, state, params)
  plain = so.stiefel_attention(LR)
  want, _ = plain.update(g, plain.init(params), params)
  _assert_trees_close(u, want)
  assert int(state.notfinite_count) == 0
  assert float(so.max_isometry_error(optax.apply_updates(params, u))) <= ISO_TOL


# --------------------------------------------------------------------------
# Orthonormal start and diagnostics.


def test_orthonormal_heads_init_gives_orthonormal_per_head_frames():
  init = so.orthonormal_heads_init()
  w = init(jax.random.key(0), (D, HEADS, HEAD_DIM))
  assert w.shape == (D, HEADS, HEAD_DIM) and w.dtype == jnp.float32
  for h in range(HEADS):
    f = w[:, h, :]
    assert float(jnp.linalg.norm(f.T @ f - jnp.eye(HEAD_DIM))) <= ISO_TOL
  assert float(jnp.max(jnp.abs(w[:, 0] - w[:, 1]))) > 1e-2
  # As the kernel initializer of a linen parameter.

  class QK(nn.Module):
    @nn.compact
    def __call__(self, x):
      q = self.param("query", init, (D, HEADS, HEAD_DIM))
      return jnp.einsum("bd,dhk->bhk", x, q)

  p = QK().init(jax.random.key(1), jnp.ones((1, D)))["params"]
  assert float(so.max_isometry_error(p, {"query": so.FrameSpec(
      rows=0, cols=2)})) <= ISO_TOL
  with pytest.raises(ValueError, match=r"\(d, heads, head_dim\)"):
    init(jax.random.key(0), (D, HEAD_DIM))
  with pytest.raises(ValueError, match=r"head_dim = 8 > d = 4"):
    init(jax.random.key(0), (4, HEADS, HEAD_DIM))


def test_check_frames_names_leaf_and_error(linen_params):
  so.check_frames(linen_params)          # orthonormalized: passes
  bad = jax.tree.map(lambda x: x, linen_params)
  bad["attn"]["key"]["kernel"] = bad["attn"]["key"]["kernel"] * 1.01
  err = float(so.max_isometry_error(bad))
  assert err > 1e-2
  with pytest.raises(ValueError) as info:
    so.check_frames(bad)
  msg = str(info.value)
  assert "attn/key/kernel" in msg and f"{err:.3g}" in msg
  assert "(16, 2, 8)" in msg and "attn/query/kernel" not in msg
  so.check_frames(bad, atol=2 * err)
  # Raw initial kernels are far off the manifold.
  raw = LinenBlock().init(jax.random.key(1), _data()[0])["params"]
  with pytest.raises(ValueError, match="attn/query/kernel"):
    so.check_frames(raw)


# --------------------------------------------------------------------------
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
