"""`frame_partition` (stiefel_optax/partition.py): the Stiefel transform on
the frame views of the selected leaves, mapped back, and the Euclidean one
on the rest (the parts of a fused leaf that are not frames included);
`stack_frames=True`: equal-shape frames of different leaves updated as one
batch give the per-leaf updates, state per stack, any selector."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from stiefel_optax import FrameSpec, partition

from tests.helpers import frame_adam_states


def _tree(seed):
  """Three layers of (16, 2, 8) Q/K kernels, one of (16, 4, 4), a fused
  nanoGPT-style c_attn (16, 48) under fused_qkv(2) and non-frame leaves.
  (Values from NumPy: jax.random would compile a program per shape.)"""
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)
  layer = lambda h, r: {"query": {"kernel": normal(16, h, r)},
                        "key": {"kernel": normal(16, h, r)},
                        "value": {"kernel": normal(16, h, r)}}
  tree = {f"layer_{i}": layer(2, 8) for i in range(3)}
  tree["odd"] = layer(4, 4)
  tree["gpt"] = {"c_attn": {"kernel": normal(16, 48)}, "bias": normal(48)}
  return tree


SELECTOR = {r"(query|key)/kernel$": so.FrameSpec(rows=0, cols=2),
            r"c_attn/kernel$": so.fused_qkv(2)}


@functools.lru_cache(maxsize=None)
def _params():
  """_tree(0) orthonormalized (jitted: one program instead of the eager
  polar factors' per-op compilations), shared by the tests, which only
  read it."""
  return jax.jit(lambda p: so.orthonormalize(p, frames=SELECTOR))(_tree(0))


def _grads(params, t):
  """Gradient t (the same for every run), from NumPy."""
  rng = np.random.default_rng(10 + t)
  return jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)


@functools.lru_cache(maxsize=None)
def _run(stacked: bool, steps: int = 3, nan_step: int = 1):
  """(params, state) after `steps` jitted updates; at `nan_step` one head
  of one leaf gets a NaN gradient (that frame alone is skipped)."""
  params = _params()
  tx = so.stiefel_attention(3e-2, frames=SELECTOR, stack_frames=stacked)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    grads = _grads(params, t)
    if t == nan_step:
      k = grads["layer_1"]["query"]["kernel"]
      grads["layer_1"]["query"]["kernel"] = k.at[3, 1, 0].set(jnp.nan)
    u, state = update(grads, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def _adam(state) -> so.ScaleByFrameAdamState:
  (found,) = frame_adam_states(state.stiefel)
  return found


def test_frame_spec_of_the_tree_is_what_it_says():
  params = _tree(0)
  views = so.map_frames(lambda w: w.shape, params, SELECTOR, back=False)
  assert views["layer_0/query/kernel"] == (2, 16, 8)
  assert views["odd/key/kernel"] == (4, 16, 4)
  assert views["gpt/c_attn/kernel"] == (2, 2, 16, 8)


def test_stacked_equals_per_leaf():
  a, _ = _run(False)
  b, _ = _run(True)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree.leaves(b)):
    # The same per-frame arithmetic in larger batches (XLA's blocking of
    # the batched products may differ: rounding, 9e-8 here).
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  assert float(so.max_isometry_error(b, SELECTOR)) < 1e-5
  assert bool(jnp.all(jnp.isfinite(b["layer_1"]["query"]["kernel"])))


def test_state_holds_one_stack_per_shape_with_the_per_leaf_moments():
  per_leaf, stacked = _adam(_run(False)[1]), _adam(_run(True)[1])
  # 6 leaves of (2, 16, 8), 2 of (4, 16, 4), the fused one (2, 2, 16, 8)
  # in the order of their first leaf (gpt, layer_0, ..., odd).
  # A stack of one is the leaf's own view.
  assert [m.shape for m in stacked.mu] == [(2, 2, 16, 8), (6, 2, 16, 8),
                                           (2, 4, 16, 4)]
  assert [v.shape for v in stacked.nu] == [(2, 2), (6, 2), (2, 4)]
  plan = partition.stack_plan(per_leaf.mu)
  for moments, stacks in ((per_leaf.mu, stacked.mu),
                          (per_leaf.nu, stacked.nu)):
    back = partition.unstack(stacks, plan, moments)
    for x, y in zip(jax.tree.leaves(moments), jax.tree.leaves(back)):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  # The frame that saw a NaN kept finite moments, as per leaf.
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in stacked.nu)


def test_plan_groups_by_shape_and_dtype_in_order():
  tree = {"a": jnp.zeros((2, 8, 4)), "b": optax.MaskedNode(),
          "c": jnp.zeros((2, 8, 4), jnp.bfloat16), "d": jnp.zeros((2, 8, 4)),
          "e": jnp.zeros((3, 8, 4))}
  plan = partition.stack_plan(tree)
  assert plan == ((0, 3), (2,), (4,))
  stacks = partition.stack(tree, plan)
  assert [s.shape for s in stacks] == [(2, 2, 8, 4), (2, 8, 4), (3, 8, 4)]
  assert stacks[1] is tree["c"]                      # no copy for one leaf
  back = partition.unstack(stacks, plan, tree)
  assert jax.tree.structure(back, is_leaf=lambda x: isinstance(
      x, optax.MaskedNode)) == jax.tree.structure(
          tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  assert back["c"].dtype == jnp.bfloat16 and back["e"].shape == (3, 8, 4)
  # A byte limit cuts a group into stacks; a leaf over it stands alone.
  leaf = 2 * 8 * 4 * 4                               # bytes of one f32 view
  more = dict(tree, f=jnp.zeros((2, 8, 4)), g=jnp.zeros((2, 8, 4)))
  assert partition.stack_plan(more, 2 * leaf) == ((0, 3), (5, 6), (2,), (4,))
  assert partition.stack_plan(more, leaf / 2) == ((0,), (3,), (5,), (6,),
                                                  (2,), (4,))


def test_auto_stacks_small_frames_and_refuses_unknown_settings():
  assert partition.stack_limit("auto") == partition.AUTO_STACK_BYTES
  assert partition.stack_limit(False) is None
  with pytest.raises(ValueError, match="stack_frames must be one of"):
    so.stiefel_attention(1e-3, stack_frames="yes")
  params = _params()
  shapes = lambda setting: [m.shape for m in jax.tree.leaves(_adam(
      so.stiefel_attention(1e-3, frames=SELECTOR, stack_frames=setting
                           ).init(params)).mu)]
  assert shapes("auto") == shapes(True)     # 6 KB of frames: one stack each


def test_project_start_stacked_equals_per_leaf():
  """A start off the manifold runs the retraction's fallback for the whole
  stack: the same polar factors within rounding."""
  params = _tree(1)                           # not orthonormal
  out = []
  for stacked in (False, True):
    tx = so.stiefel_attention(1e-2, frames=SELECTOR, orthonormal_start="project",
                              stack_frames=stacked)
    state = tx.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    u, _ = jax.jit(tx.update)(g, state, params)
    out.append(optax.apply_updates(params, u))
  for x, y in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
  assert float(so.max_isometry_error(out[1], SELECTOR)) < 1e-5


def test_a_state_of_another_setting_is_named_not_misread():
  params = _params()
  grads = jax.tree.map(jnp.ones_like, params)
  per_leaf = so.stiefel_attention(1e-3, frames=SELECTOR)
  stacked = so.stiefel_attention(1e-3, frames=SELECTOR, stack_frames=True)
  with pytest.raises(ValueError, match=r"stack_frames=True.*It fits"
                     r" stack_frames=False"):
    stacked.update(grads, per_leaf.init(params), params)
  with pytest.raises(ValueError, match=r"It fits stack_frames=True"):
    per_leaf.update(grads, stacked.init(params), params)
  # The extra (16, 1, 8) kernel is an orthonormal frame as it stands.
  other = params | {"extra": {
      "query": {"kernel": jnp.eye(16, 8)[:, None, :]}}}
  with pytest.raises(ValueError, match="fits no stack_frames setting"):
    per_leaf.update(jax.tree.map(jnp.ones_like, other), per_leaf.init(params),
                    other)


# ---------------------------------------------------------------------------
# frame_partition on the frame views


def _kernel(seed, d=8, heads=3, hd=2):
  rng = np.random.default_rng(seed)
  q = np.stack([np.linalg.qr(rng.standard_normal((d, hd)))[0]
                for _ in range(heads)], axis=1)         # (d, heads, hd)
  return jnp.asarray(q, jnp.float32)


class FramePartitionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_equals_inner_on_the_frame_view(self):
    """frame_partition(stiefel_adam) on a (d, heads, head_dim) kernel is
    stiefel_adam on the stacked per-head frames, mapped back."""
    kernel = _kernel(0)
    grad = jnp.asarray(np.random.default_rng(1).standard_normal(kernel.shape),
                       jnp.float32)
    spec = FrameSpec(0, 2)
    inner = so.stiefel_adam(0.05)
    tx = so.frame_partition(inner, None, frames=spec)
    state = tx.init(kernel)
    u, state = self.variant(tx.update)(grad, state, kernel)
    chex.assert_trees_all_equal_shapes_and_dtypes(u, kernel)
    frames = so.to_frames(kernel, spec)
    u_ref, _ = jax.jit(inner.update)(so.to_frames(grad, spec),
                                     inner.init(frames), frames)
    chex.assert_trees_all_close(so.to_frames(u, spec), u_ref, atol=1e-6)
    new = optax.apply_updates(kernel, u)
    errs = so.isometry_error(so.to_frames(new, spec))
    chex.assert_shape(errs, (3,))
    assert float(jnp.max(errs)) <= 3e-6
    # Control: the whole (d, heads * hd) projection is NOT orthonormal
    # after per-head steps (heads are independent frames).
    assert float(so.isometry_error(so.to_frames(new, FrameSpec(0, (1, 2))))
                 ) > 1e-2
    is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
    (fs,) = [x for x in jax.tree.leaves(state.stiefel, is_leaf=is_fs)
             if is_fs(x)]
    chex.assert_shape(fs.nu, (3,))                    # one scalar per head

  # jit only: frame_partition's update has no eager-only path (its Python
  # checks run at trace time); its eager run is covered by
  # test_equals_inner_on_the_frame_view__without_jit, the eager split and
  # merge of fused leaves by test_split_gives_the_documented_frames_and_...
  @chex.variants(with_jit=True)
  def test_fused_rest_gets_exactly_the_euclidean_update(self):
    """The value third of a fused kernel is trained by the Euclidean
    transform exactly as if the leaf were whole."""
    rng = np.random.default_rng(2)
    d, heads, hd = 8, 2, 4
    qk = [np.linalg.qr(rng.standard_normal((d, hd)))[0]
          for _ in range(2 * heads)]
    kernel = jnp.asarray(np.concatenate(
        qk + [rng.standard_normal((d, heads * hd))], axis=1), jnp.float32)
    params = {"c_attn": {"kernel": kernel}}
    frames = {r"c_attn/kernel$": so.fused_qkv(heads)}
    tx = so.frame_partition(so.stiefel_adam(0.05), optax.adamw(1e-2),
                            frames=frames)
    ref = optax.adamw(1e-2)
    state, rstate = tx.init(params), ref.init(params)
    update = self.variant(tx.update)
    p, rp = params, params
    for t in range(3):
      g = {"c_attn": {"kernel": jnp.asarray(
          rng.standard_normal(kernel.shape), jnp.float32)}}
      u, state = update(g, state, p)
      ru, rstate = ref.update(g, rstate, rp)
      p, rp = optax.apply_updates(p, u), optax.apply_updates(rp, ru)
    got, want = p["c_attn"]["kernel"], rp["c_attn"]["kernel"]
    chex.assert_trees_all_close(got[:, 2 * d:], want[:, 2 * d:], rtol=1e-6,
                                atol=1e-7)
    assert float(so.max_isometry_error(p, frames)) <= 3e-6
    assert float(jnp.max(jnp.abs(got[:, :2 * d] - kernel[:, :2 * d]))) > 1e-3


# ---------------------------------------------------------------------------
# Flax NNX's functional pattern, and the state check's message (issue 55)


def test_nnx_split_state_trains_under_jit():
  """`nnx.split(model, nnx.Param, ...)`, `tx.init(params)` on the
  nnx.State of Variables and a jitted `tx.update`: the updates and the
  state come back in their Variables (a jit output keeps its tree), and
  the frames stay orthonormal. Before issue 55 the update raised "the
  Stiefel group's state (5 arrays) is not the one this optimizer makes
  ... (5 arrays)": init's state holds MaskedNode where the params' split
  holds a Variable around one."""
  from flax import nnx
  model = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                 decode=False, rngs=nnx.Rngs(0))
  nnx.update(model, so.orthonormalize(nnx.state(model, nnx.Param)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = so.stiefel_attention(1e-2)
  state = tx.init(params)
  x = jnp.ones((1, 3, 8))

  @jax.jit
  def step(params, state):
    grads = jax.grad(
        lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(x) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  new, state2, updates = step(params, state)
  new, state2, _ = step(new, state2)
  assert jax.tree.structure(state2) == jax.tree.structure(state)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert float(so.max_isometry_error(nnx.as_pure(new))) < 1e-5


def test_a_state_check_names_the_first_differing_place():
  """Two trees of equal leaf counts but different nodes are told apart
  and located (the message of issue 55 compared "5 arrays" with "5
  arrays"); keys one tree lacks are named."""
  from flax import nnx
  masked = optax.MaskedNode()
  have = {"a": {"bias": masked, "kernel": jnp.zeros(2)}}
  want = {"a": {"bias": nnx.Param(masked), "kernel": jnp.zeros(2)}}
  assert partition.first_difference(have, want) == (
      "['a']['bias']", "MaskedNode()", "Param(MaskedNode())")
  assert partition.first_difference(have, have) is None
  assert partition.first_difference(
      {"a": 1.0}, {"a": 1.0, "b": jnp.zeros(3)})[:2] == ("['b']", "nothing")
  # Through the optimizer: a state of as many arrays whose Stiefel group
  # holds one where the optimizer's holds none, and none where it holds one.
  params = _params()
  tx = so.stiefel_attention(1e-3, frames=SELECTOR)
  state = tx.init(params)
  mu = dict(state.stiefel[1].mu)
  layer = mu["layer_0"]
  mu["layer_0"] = {**layer, "query": {"kernel": masked},
                   "value": {"kernel": layer["query"]["kernel"]}}
  bad = state._replace(stiefel=(state.stiefel[0],
                                state.stiefel[1]._replace(mu=mu))
                       + tuple(state.stiefel[2:]))
  assert len(jax.tree.leaves(bad)) == len(jax.tree.leaves(state))
  with pytest.raises(ValueError, match=r"at state\.stiefel\[1\]\.mu"
                     r"\['layer_0'\]\['query'\]\['kernel'\] it holds"
                     r" MaskedNode\(\), where this optimizer's state holds an"
                     r" array \(2, 16, 8\) float32") as info:
    tx.update(jax.tree.map(jnp.ones_like, params), bad, params)
  assert "arrays)" not in str(info.value)
