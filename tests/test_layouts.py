"""Frame layouts: which kernel axes are a frame's rows and columns.

A Flax (d, heads, head_dim) attention kernel is one frame per head
(`FLAX_PER_HEAD`) or one (d, heads * head_dim) frame (`FLAX_WHOLE`); a
fused 2-D (d, heads * head_dim) kernel splits into heads with
`FrameLayout(0, 1, heads=h)`; other axes are batch axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from stiefel_optax.layouts import FrameLayout


def arange(shape):
  return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


CASES = [
    # (layout, kernel shape, frame-view shape, the frame as numpy slices)
    (so.FLAX_PER_HEAD, (8, 3, 2), (3, 8, 2), lambda k, h: k[:, h, :]),
    (so.FLAX_WHOLE, (8, 3, 2), (8, 6), None),
    (FrameLayout(0, 1, heads=3), (8, 6), (3, 8, 2),
     lambda k, h: k[:, 2 * h:2 * h + 2]),
    (FrameLayout(1, 3), (2, 8, 3, 2), (2, 3, 8, 2),
     lambda k, h: k[:, :, h, :]),                  # leading layer axis
    (FrameLayout(-2, -1), (4, 8, 2), (4, 8, 2), lambda k, h: k[h]),
    (FrameLayout(2, 0), (2, 3, 8), (3, 8, 2), lambda k, h: k[:, h, :].T),
]


@pytest.mark.parametrize("layout,shape,view,frame", CASES)
def test_to_frames_and_back(layout, shape, view, frame):
  """to_frames gives the documented frames; from_frames inverts it."""
  k = arange(shape)
  f = so.to_frames(k, layout)
  assert f.shape == view == layout.frame_shape(shape)
  if frame is None:                         # whole projection: one frame
    np.testing.assert_array_equal(f, np.reshape(k, view))
  elif len(view) == 3:
    for h in range(view[0]):
      np.testing.assert_array_equal(f[h], frame(np.asarray(k), h))
  else:
    for h in range(view[1]):
      np.testing.assert_array_equal(f[:, h], frame(np.asarray(k), h))
  np.testing.assert_array_equal(so.from_frames(f, layout, shape), k)


def test_with_frame_layout_equals_inner_on_the_frame_view(variant):
  """with_frame_layout(stiefel_adam) on a (d, heads, head_dim) kernel is
  stiefel_adam on the stacked per-head frames, mapped back; every head
  stays orthonormal."""
  d, heads, hd = 8, 3, 2
  rng = np.random.default_rng(0)
  q = np.stack([np.linalg.qr(rng.standard_normal((d, hd)))[0]
                for _ in range(heads)], axis=1)         # (d, heads, hd)
  kernel = jnp.asarray(q, jnp.float32)
  grad = jnp.asarray(rng.standard_normal(kernel.shape), jnp.float32)
  inner = so.stiefel_adam(0.05)
  tx = so.with_frame_layout(inner, so.FLAX_PER_HEAD)
  update = variant(tx.update)
  state = tx.init(kernel)
  u, state = update(grad, state, kernel)
  assert u.shape == kernel.shape and u.dtype == kernel.dtype
  frames = so.to_frames(kernel, so.FLAX_PER_HEAD)
  u_ref, _ = jax.jit(inner.update)(so.to_frames(grad, so.FLAX_PER_HEAD),
                                   inner.init(frames), frames)
  np.testing.assert_allclose(so.to_frames(u, so.FLAX_PER_HEAD), u_ref,
                             atol=1e-6)
  new = optax.apply_updates(kernel, u)
  errs = so.isometry_error(so.to_frames(new, so.FLAX_PER_HEAD))
  assert errs.shape == (heads,) and float(jnp.max(errs)) <= 3e-6
  # Control: the whole (d, heads * hd) projection is NOT orthonormal after
  # per-head steps (heads are independent frames).
  whole = so.isometry_error(so.to_frames(new, so.FLAX_WHOLE))
  assert float(whole) > 1e-2
  # The state holds one second-moment scalar per head.
  assert state.inner_state[1].nu.shape == (heads,)


def test_with_frame_layout_callable_per_leaf(variant):
  """A callable layout picks each leaf's layout from its path."""
  rng = np.random.default_rng(1)
  whole = np.linalg.qr(rng.standard_normal((8, 6)))[0].reshape(8, 3, 2)
  params = {"q": jnp.asarray(whole, jnp.float32),
            "k": jnp.asarray(whole, jnp.float32)}
  grads = jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)

  def layout(path, leaf):
    del leaf
    return so.FLAX_WHOLE if jax.tree_util.keystr(path) == "['q']" else (
        so.FLAX_PER_HEAD)

  tx = so.with_frame_layout(so.stiefel_adam(0.05), layout)
  state = tx.init(params)
  u, state = variant(tx.update)(grads, state, params)
  new = optax.apply_updates(params, u)
  assert state.inner_state[1].nu["q"].shape == ()
  assert state.inner_state[1].nu["k"].shape == (3,)
  assert float(so.isometry_error(so.to_frames(new["q"], so.FLAX_WHOLE))) <= 3e-6
  assert float(jnp.max(so.isometry_error(
      so.to_frames(new["k"], so.FLAX_PER_HEAD)))) <= 3e-6


def test_layout_errors_name_the_shape():
  k = jnp.zeros((8, 3, 2))
  with pytest.raises(ValueError, match="rank"):
    so.to_frames(jnp.zeros((8,)), so.FLAX_PER_HEAD)         # axis 2 missing
  with pytest.raises(ValueError, match="repeats"):
    so.to_frames(k, FrameLayout(0, (0, 2)))
  with pytest.raises(ValueError, match=r"\(8, 6\).*heads = 4"):
    so.to_frames(jnp.zeros((8, 6)), FrameLayout(0, 1, heads=4))
  # A layout whose frames have more columns than rows: r = 12 > d = 8.
  tx = so.with_frame_layout(so.stiefel_adam(0.1), so.FLAX_WHOLE)
  with pytest.raises(ValueError, match=r"\(8, 12\)"):
    tx.init({"w": jnp.zeros((8, 4, 3))})
  with pytest.raises(ValueError, match="params"):
    tx.update({"w": k}, tx.init({"w": k}), None)
