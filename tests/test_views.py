"""Frame views (stiefel_optax/views.py) of a FrameSpec: which axes of a leaf
are its frames' rows and columns, which parts of a fused leaf are frames,
and the exact inverse (split_frames, merge_frames, to_frames, from_frames).

A Flax (d, heads, head_dim) kernel is one frame per head; a fused (d, 3d)
kernel's q and k thirds split into heads; gemma's (2, K, D, H) kv_einsum is
frames in its key half only. `frame_partition`, which trains on these
views, is tested in tests/test_partition.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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
    # transformers' Flax GPT-2 c_attn, stored (3 * heads * hd, d).
    (so.fused_qkv(2, transposed=True), (12, 8), (2, 2, 8, 2),
     lambda k, i: k[4 * (i // 2) + 2 * (i % 2):][:2].T),
    # MaxText fused qkv_proj, scanned GQA (embed, layers, 2 q + 1 k + 1 v,
    # hd): the q and k heads, not the v head.
    (so.maxtext_fused_qkv(2, 1), (8, 2, 4, 2), (3, 2, 1, 8, 2),
     lambda k, i: k[:, i % 2, i // 2]),
    # ... over 2 tensor shards, heads [q k v | q k v].
    (so.maxtext_fused_qkv(2, 2, tensor_parallelism=2), (8, 6, 2),
     (4, 1, 8, 2), lambda k, i: k[:, (0, 1, 3, 4)[i]]),
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
  take = r"take must list distinct parts in increasing order, each in \[0, 3\)"
  for bad, why in ((dict(parts=3, take=(3,)), take),
                   (dict(parts=3, take=(1, 0)), take), (dict(parts=3), take),
                   (dict(take=(0,)), "take/part_axis need parts"),
                   (dict(heads=0), "heads must be a positive int")):
    with pytest.raises(ValueError, match=why):
      FrameSpec(0, 1, **bad)
  tx = so.frame_partition(so.stiefel_adam(0.1), None,
                          frames=FrameSpec(0, (1, 2)))
  with pytest.raises(ValueError, match=r"w: shape \(8, 4, 3\) gives frames of \(d, r\) = \(8, 12\)"):
    tx.init({"w": jnp.zeros((8, 4, 3))})
  with pytest.raises(ValueError, match="params"):
    p = {"w": so.random_frames(jax.random.key(0), (8, 2))}
    tx = so.frame_partition(so.stiefel_adam(0.1), None, frames=FrameSpec())
    tx.update(p, tx.init(p), None)




def test_named_specs_view_what_haliax_and_penzai_read_by_name():
  """A named spec, resolved against a leaf's names, views each frame as the
  libraries' own name-based reads lay it out: Haliax's `rearrange` to
  (..., embed, head_size), penzai's `unwrap(..., 'embedding',
  'projection')`; and the views round-trip."""
  import haliax as hax
  from penzai import pz
  axes = tuple(hax.Axis(n, s) for n, s in (
      ("layers", 2), ("kv_heads", 2), ("q_heads_per_group", 3),
      ("head_size", 4), ("embed", 8)))
  w = hax.named(arange(tuple(a.size for a in axes)), axes)
  spec = so.FrameSpec(rows="embed", cols="head_size").resolve(
      tuple(a.name for a in axes))
  np.testing.assert_array_equal(
      so.to_frames(w.array, spec),
      hax.rearrange(w, (..., "embed", "head_size")).array)
  np.testing.assert_array_equal(
      so.from_frames(so.to_frames(w.array, spec), spec, w.array.shape),
      w.array)
  p = pz.nx.wrap(arange((8, 2, 3, 4))).tag(
      "embedding", "head_groups", "query_heads", "projection")
  spec = so.FrameSpec(rows="embedding", cols="projection").resolve(
      so.named_axes.axis_names({"w": p})["w/data_array"])
  np.testing.assert_array_equal(
      so.to_frames(p.data_array, spec),
      p.unwrap("head_groups", "query_heads", "embedding", "projection"))
