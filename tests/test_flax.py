"""Flax integration: labels, layouts, stiefel_attention with linen and nnx,
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
  return jax.tree.map(
      lambda w: jax.random.normal(jax.random.key(seed), w.shape, w.dtype), params)


def _assert_euclidean_match(params, ref_params, labels):
  got, want = _leaves_by_path(params), _leaves_by_path(ref_params)
  lab = _leaves_by_path(labels)
  euclid = [p for p, l in lab.items() if l == so.EUCLIDEAN]
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
  labels = so.qk_labels(linen_params)
  assert _leaves_by_path(labels)["attn/query/kernel"] == so.STIEFEL
  assert _leaves_by_path(labels)["attn/key/kernel"] == so.STIEFEL
  assert _leaves_by_path(labels)["attn/value/kernel"] == so.EUCLIDEAN
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

  euclid = _assert_euclidean_match(state.params, ref_params, labels)
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
  labels = so.qk_labels(start)
  # Labels computed on the nnx.State of Variables apply to the pure dicts
  # that nnx.Optimizer.update passes (the default, labels=None, is covered by
  # the README snippet test).
  state_labels = so.qk_labels(nnx.state(model, nnx.Param))
  assert jax.tree.structure(state_labels) != jax.tree.structure(labels)
  optimizer = nnx.Optimizer(
      model, so.stiefel_attention(LR, weight_decay=WD, labels=state_labels),
      wrt=nnx.Param)
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
  _assert_euclidean_match(params, ref_params, labels)
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
  labels = _leaves_by_path(so.qk_labels(params))
  leaves = _leaves_by_path(params)
  stiefel = [p for p, l in labels.items() if l == so.STIEFEL]
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
      x.size for p, x in leaves.items() if labels[p] == so.EUCLIDEAN)
  assert sum(x.size for x in _real(adam.nu)) + sum(
      x.size for x in _real(fs.mu)) == sum(x.size for x in leaves.values())


def test_scanned_layers_kernels_batch_their_frames(linen_params):
  # nn.scan stacks layers in front: (layers, d, heads, head_dim).
  q = linen_params["attn"]["query"]["kernel"]
  params = {"layers": {"query": {"kernel": jnp.stack([q, -q, 2 * q])}}}
  assert float(so.max_isometry_error(params)) > 1.0          # the 2 * q layer
  params = so.orthonormalize(params)
  errs = so.frame_isometry_errors(params)
  assert errs["layers/query/kernel"].shape == (3, HEADS)
  assert float(jnp.max(errs["layers/query/kernel"])) <= ISO_TOL
  np.testing.assert_allclose(params["layers"]["query"]["kernel"][2], q,
                             atol=1e-5)
  (fs,) = _frame_adam_states(so.stiefel_attention(LR).init(params))
  assert _leaves_by_path(fs.nu)["layers/query/kernel"].shape == (3, HEADS)
  assert _leaves_by_path(fs.mu)["layers/query/kernel"].shape == (
      3, HEADS, D, HEAD_DIM)


# --------------------------------------------------------------------------
# Weight decay.


def test_weight_decay_leaves_frames_untouched(linen_params):
  params = linen_params
  labels = _leaves_by_path(so.qk_labels(params))
  start = _leaves_by_path(params)

  def run_injected(weight_decay):          # jitted once, decay as an array
    p, state = params, INJECTED.init(params)
    state.hyperparams["weight_decay"] = jnp.float32(weight_decay)
    for t in range(5):
      u, state = injected_update(_grads_like(params, t), state, p)
      p = optax.apply_updates(p, u)
    return _leaves_by_path(p)

  def run_default(weight_decay):           # the plain factory, eagerly
    tx = so.stiefel_attention(LR, weight_decay=weight_decay)
    p, state = params, tx.init(params)
    for t in range(3):
      u, state = tx.update(_grads_like(params, t), state, p)
      p = optax.apply_updates(p, u)
    return _leaves_by_path(p)

  for run in (run_injected, run_default):
    no_decay, decay = run(0.0), run(0.5)
    for p, l in labels.items():
      if l == so.STIEFEL:
        np.testing.assert_array_equal(decay[p], no_decay[p], err_msg=p)
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


def test_regex_list_and_callable_patterns():
  params = {"blk": _random_tree(
      {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D)})}
  by_regex = so.qk_labels(params, [r"/wq$", r"/wk$"])
  by_callable = so.qk_labels(
      params, lambda path, leaf: path.split("/")[-1] in ("wq", "wk"))
  want = {"blk/wq": so.STIEFEL, "blk/wk": so.STIEFEL,
          "blk/wv": so.EUCLIDEAN, "blk/wo": so.EUCLIDEAN}
  assert _leaves_by_path(by_regex) == want
  assert _leaves_by_path(by_callable) == want
  assert _leaves_by_path(so.qk_labels(params, r"wq")) == {
      **want, "blk/wk": so.EUCLIDEAN}
  params = so.orthonormalize(params, by_regex)
  tx = so.stiefel_attention(LR, patterns=[r"/wq$", r"/wk$"])
  new, _ = _one_step_and_state(tx, params)
  errs = so.frame_isometry_errors(new, patterns=[r"/wq$", r"/wk$"])
  assert set(errs) == {"blk/wq", "blk/wk"}
  assert max(float(jnp.max(e)) for e in errs.values()) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["blk"]["wv"] - params["blk"]["wv"]))) > 0


def test_einsum_heads_d_head_dim_kernels_with_layout():
  pat = r"/(q|k)_einsum$"
  params = {"attn": _random_tree(
      {"q_einsum": (HEADS, D, HEAD_DIM), "k_einsum": (HEADS, D, HEAD_DIM),
       "v_einsum": (HEADS, D, HEAD_DIM)})}
  lay = so.FrameLayout(1, 2)
  # Without the layout the leading axis (2) would be read as d < head_dim.
  with pytest.raises(ValueError, match=r"attn/[kq]_einsum: shape \(2, 16, 8\)"):
    so.stiefel_attention(LR, patterns=pat).init(params)
  params = so.orthonormalize(params, patterns=pat, layout=lay)
  tx = so.stiefel_attention(LR, patterns=pat, layout=lay)
  new, state = _one_step_and_state(tx, params)
  (fs,) = _frame_adam_states(state)
  assert _leaves_by_path(fs.nu)["attn/q_einsum"].shape == (HEADS,)
  for name in ("q_einsum", "k_einsum"):
    for h in range(HEADS):
      w = new["attn"][name][h]                       # (d, head_dim)
      err = jnp.linalg.norm(w.T @ w - jnp.eye(HEAD_DIM))
      assert float(err) <= ISO_TOL, (name, h, err)
    assert float(jnp.max(jnp.abs(new["attn"][name] - params["attn"][name]))) > 1e-3


def test_fused_2d_kernels_split_by_num_heads_with_grouped_query_key():
  # 2-D fused kernels: query (d, heads * head_dim), key with one KV head.
  params = {"attn": {"query": {"kernel": jax.random.normal(jax.random.key(0), (D, HEADS * HEAD_DIM))},
                     "key": {"kernel": jax.random.normal(jax.random.key(1), (D, HEAD_DIM))},
                     "value": {"kernel": jax.random.normal(jax.random.key(2), (D, HEAD_DIM))}}}
  params = so.orthonormalize(params, num_heads=HEADS)
  q = params["attn"]["query"]["kernel"]
  # Per-head frames, not one (16, 16) frame: each head's columns orthonormal.
  for h in range(HEADS):
    blk = q[:, h * HEAD_DIM:(h + 1) * HEAD_DIM]
    assert float(jnp.linalg.norm(blk.T @ blk - jnp.eye(HEAD_DIM))) <= ISO_TOL
  assert float(jnp.linalg.norm(q.T @ q - jnp.eye(D))) > 1e-2
  for kwargs in ({"num_heads": HEADS}, {"head_dim": HEAD_DIM}):
    (fs,) = _frame_adam_states(so.stiefel_attention(LR, **kwargs).init(params))
    nu = _leaves_by_path(fs.nu)
    assert nu["attn/query/kernel"].shape == (HEADS,)
    assert nu["attn/key/kernel"].shape == (1,)
  new, _ = _one_step_and_state(so.stiefel_attention(LR, num_heads=HEADS), params)
  errs = so.frame_isometry_errors(new, num_heads=HEADS)
  assert errs["attn/query/kernel"].shape == (HEADS,)
  assert errs["attn/key/kernel"].shape == (1,)
  assert float(so.max_isometry_error(new, num_heads=HEADS)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["attn"]["key"]["kernel"]
                               - params["attn"]["key"]["kernel"]))) > 1e-3
  # Without num_heads/head_dim a 2-D kernel is one frame.
  _, state = _one_step_and_state(so.stiefel_attention(LR), params)
  (fs,) = _frame_adam_states(state)
  assert _leaves_by_path(fs.nu)["attn/query/kernel"].shape == ()
  with pytest.raises(ValueError, match=r"attn/key/kernel: shape \(16, 8\).*head_dim = 5"):
    so.stiefel_attention(LR, head_dim=5).init(params)


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


def test_per_head_false_is_one_whole_projection_frame(linen_params):
  params = {"query": {"kernel": linen_params["attn"]["query"]["kernel"]},
            "key": {"kernel": linen_params["attn"]["key"]["kernel"]}}
  # Per-head frames are not a whole-projection frame...
  assert float(so.max_isometry_error(params, per_head=False)) > 1e-2
  params = so.orthonormalize(params, per_head=False)
  whole = params["query"]["kernel"].reshape(D, HEADS * HEAD_DIM)
  assert float(jnp.linalg.norm(whole.T @ whole - jnp.eye(D))) <= ISO_TOL
  new, state = _one_step_and_state(so.stiefel_attention(LR, per_head=False),
                                   params)
  (fs,) = _frame_adam_states(state)
  assert all(v.shape == () for v in _leaves_by_path(fs.nu).values())
  assert all(m.shape == (D, HEADS * HEAD_DIM)
             for m in _leaves_by_path(fs.mu).values())
  errs = so.frame_isometry_errors(new, per_head=False)
  assert all(e.shape == () for e in errs.values())
  assert float(so.max_isometry_error(new, per_head=False)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["query"]["kernel"] - params["query"]["kernel"]))) > 1e-3


def test_head_dim_larger_than_d_names_path_and_shape():
  params = {"attn": {"query": {"kernel": jnp.ones((4, 2, 8))},
                     "key": {"kernel": jnp.ones((8, 2, 8))}}}
  with pytest.raises(ValueError, match=r"attn/query/kernel: shape \(4, 2, 8\)"):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"attn/query/kernel.*\(4, 2, 8\)"):
    so.orthonormalize(params)


def test_no_match_lists_paths():
  params = {"encoder": {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}}}
  with pytest.raises(ValueError, match=r"encoder/dense/kernel.*"):
    so.qk_labels(params)
  with pytest.raises(ValueError, match=r"encoder/dense/bias"):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"no parameter path matches"):
    so.qk_labels(params, [r"wq$"])


def test_labels_tree_mismatch_and_bad_values(linen_params):
  labels = so.qk_labels(linen_params)
  missing = {k: v for k, v in labels.items() if k != "mlp_out"}
  with pytest.raises(ValueError, match=r"only in params \['mlp_out/bias', 'mlp_out/kernel'\]"):
    so.stiefel_attention(LR, labels=missing).init(linen_params)
  with pytest.raises(ValueError, match=r"only in labels \['extra'\]"):
    so.check_labels(linen_params, {**labels, "extra": so.EUCLIDEAN})
  bad = jax.tree.map(lambda l: "adam" if l == so.STIEFEL else l, labels)
  with pytest.raises(ValueError, match=r"attn/key/kernel='adam'"):
    so.stiefel_attention(LR, labels=bad).init(linen_params)
  # A correct tree or a callable is accepted.
  for lab in (labels, lambda p: so.qk_labels(p, r"query/kernel$")):
    state = so.stiefel_attention(LR, labels=lab).init(linen_params)
    assert len(_frame_adam_states(state)) == 1


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
  with pytest.raises(ValueError, match=r"static_args=\('num_heads',\)"):
    optax.inject_hyperparams(so.stiefel_attention)(
        learning_rate=LR, num_heads=2).init(params)
  ok = optax.inject_hyperparams(so.stiefel_attention, static_args=("num_heads",))(
      learning_rate=LR, num_heads=HEADS)
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
  assert float(so.max_isometry_error(p, patterns="query")) <= ISO_TOL
  with pytest.raises(ValueError, match=r"\(d, heads, head_dim\)"):
    init(jax.random.key(0), (D, HEAD_DIM))
  with pytest.raises(ValueError, match=r"r = 8 columns > d = 4"):
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
    n = sum(l == so.STIEFEL for l in jax.tree.leaves(so.qk_labels(p0)))
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
