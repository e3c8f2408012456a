"""`stack_frames=True`: equal-shape frames of different leaves updated as one
batch give the per-leaf updates, state per stack, any selector."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from stiefel_optax import partition


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
  found = [s for s in jax.tree.leaves(
      state.stiefel, is_leaf=lambda s: isinstance(s, so.ScaleByFrameAdamState))
           if isinstance(s, so.ScaleByFrameAdamState)]
  assert len(found) == 1
  return found[0]


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
