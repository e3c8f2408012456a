"""Frame specs and views: which axes of a leaf are its frames' rows and
columns, which parts of a fused leaf are frames, and the exact inverse.

A Flax (d, heads, head_dim) kernel is one frame per head; a fused (d, 3d)
kernel's q and k thirds split into heads; gemma's (2, K, D, H) kv_einsum is
frames in its key half only.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from stiefel_optax import FrameSpec


def arange(shape):
  return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


CASES = [
    # (spec, leaf shape, frame-view shape, frame i (flat batch index) as numpy)
    (FrameSpec(0, 2), (8, 3, 2), (3, 8, 2), lambda k, i: k[:, i, :]),
    (FrameSpec(0, (1, 2)), (8, 3, 2), (8, 6), lambda k, i: k.reshape(8, 6)),
    (FrameSpec(0, 1, heads=3), (8, 6), (3, 8, 2),
     lambda k, i: k[:, 2 * i:2 * i + 2]),
    (FrameSpec(-3, -1), (2, 8, 3, 2), (2, 3, 8, 2),          # nn.scan stack
     lambda k, i: k[i // 3, :, i % 3, :]),
    (FrameSpec(0, 3), (8, 2, 3, 2), (2, 3, 8, 2),            # maxtext scan
     lambda k, i: k[:, i // 3, i % 3, :]),
    (FrameSpec(2, 0), (2, 3, 8), (3, 8, 2), lambda k, i: k[:, i, :].T),
    # fused c_attn (d, 3 * heads * hd): q and k thirds, per head.
    (so.fused_qkv(2), (8, 12), (2, 2, 8, 2),
     lambda k, i: k[:, 4 * (i // 2) + 2 * (i % 2):][:, :2]),
    # gemma kv_einsum (2, K, D, H): the key half.
    (FrameSpec(-2, -1, parts=2, take=(0,), part_axis=0), (2, 3, 8, 2),
     (1, 1, 3, 8, 2), lambda k, i: k[0, i]),
    # gemma qkv_einsum (3, N, D, H): q and k.
    (FrameSpec(-2, -1, parts=3, take=(0, 1), part_axis=0), (3, 2, 8, 2),
     (2, 1, 2, 8, 2), lambda k, i: k[i // 2, i % 2]),
    # non-contiguous parts (0, 2) of 3 along the columns.
    (FrameSpec(0, 1, parts=3, take=(0, 2)), (8, 6), (2, 8, 2),
     lambda k, i: k[:, 4 * i:4 * i + 2]),
]


@pytest.mark.parametrize("spec,shape,view,frame", CASES)
def test_split_gives_the_documented_frames_and_merge_inverts(
    spec, shape, view, frame):
  k = arange(shape)
  f, rest = so.split_frames(k, spec)
  assert f.shape == view == spec.frame_shape(shape)
  flat = np.asarray(f).reshape((-1,) + view[-2:])
  for i in range(flat.shape[0]):
    np.testing.assert_array_equal(flat[i], frame(np.asarray(k), i),
                                  err_msg=f"frame {i}")
  np.testing.assert_array_equal(so.merge_frames(f, rest, spec, shape), k)
  # Every entry is either in a frame or in the rest, exactly once.
  n_rest = 0 if rest is None else rest.size
  assert f.size + n_rest == k.size
  got = np.concatenate([np.ravel(f)] + ([] if rest is None else
                                         [np.ravel(rest)]))
  np.testing.assert_array_equal(np.sort(got), np.ravel(k))
  # from_frames with no rest fills the other parts with zeros.
  back = so.from_frames(f, spec, shape)
  np.testing.assert_array_equal(so.to_frames(back, spec), f)
  assert float(jnp.sum(back)) == pytest.approx(float(jnp.sum(f)))


def test_rest_keeps_the_leaf_axis_order():
  """The parts that are not frames keep the leaf's layout: AdamW sees the
  value third of a fused kernel as a (d, d) block of it."""
  k = arange((8, 12))
  _, rest = so.split_frames(k, so.fused_qkv(2))
  np.testing.assert_array_equal(rest, k[:, 8:])
  k = arange((2, 3, 8, 2))
  _, rest = so.split_frames(k, FrameSpec(-2, -1, parts=2, take=(0,), part_axis=0))
  np.testing.assert_array_equal(rest, k[1:])


def test_spec_errors_name_the_leaf_and_the_fix():
  k = jnp.zeros((8, 3, 2))
  with pytest.raises(ValueError, match="rank 1"):
    so.to_frames(jnp.zeros((8,)), FrameSpec(0, 2))
  with pytest.raises(ValueError, match="twice"):
    so.to_frames(k, FrameSpec(0, (0, 2)))
  with pytest.raises(ValueError, match=r"\(8, 6\).*heads = 4"):
    so.to_frames(jnp.zeros((8, 6)), FrameSpec(0, 1, heads=4))
  with pytest.raises(ValueError, match=r"\(8, 7\).*parts = 3"):
    so.to_frames(jnp.zeros((8, 7)), so.fused_qkv(1))
  with pytest.raises(ValueError, match=r"takes 2 of 3 parts.*\(8, 12\)"):
    so.merge_frames(so.to_frames(jnp.zeros((8, 12)), so.fused_qkv(2)), None,
             so.fused_qkv(2), (8, 12))
  for bad in (dict(parts=3, take=(3,)), dict(parts=3, take=(1, 0)),
              dict(parts=3), dict(take=(0,)), dict(heads=0)):
    with pytest.raises(ValueError):
      FrameSpec(0, 1, **bad)
  tx = so.frame_partition(so.stiefel_adam(0.1), None,
                          frames=FrameSpec(0, (1, 2)))
  with pytest.raises(ValueError, match=r"w: shape \(8, 4, 3\) gives frames of \(d, r\) = \(8, 12\)"):
    tx.init({"w": jnp.zeros((8, 4, 3))})
  with pytest.raises(ValueError, match="params"):
    p = {"w": so.random_frames(jax.random.key(0), (8, 2))}
    tx = so.frame_partition(so.stiefel_adam(0.1), None, frames=FrameSpec())
    tx.update(p, tx.init(p), None)


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
