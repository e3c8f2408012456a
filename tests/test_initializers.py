"""Initializers (stiefel_optax/initializers.py): `orthonormal_heads_init`
gives orthonormal per-head frames, also as a linen parameter's initializer.

`orthonormalize` is tested on every model family (tests/families/), where
it must touch nothing but the frames.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import stiefel_optax as so

from tests.helpers import D, HEADS, HEAD_DIM

ISO_TOL = 1e-5


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


def test_orthonormal_heads_init_as_linen_and_nnx_attention_kernel_init():
  """Flax's attention modules call kernel_init with the flat (d, heads *
  head_dim) shape (linen's DenseGeneral, nnx's LinearGeneral) and reshape
  it; given head_dim, every query and key head starts orthonormal, also
  the key's kv heads of nnx's grouped-query attention."""
  from flax import nnx
  init = so.orthonormal_heads_init(head_dim=HEAD_DIM)
  seen = []

  def spy(key, shape, dtype=jnp.float32):
    seen.append(tuple(shape))
    return init(key, shape, dtype)

  linen = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D,
                                          kernel_init=spy)
  p = linen.init(jax.random.key(0), jnp.ones((1, 3, D)))["params"]
  assert seen[0] == (D, HEADS * HEAD_DIM)          # linen passes it flat
  assert p["query"]["kernel"].shape == (D, HEADS, HEAD_DIM)
  assert float(so.max_isometry_error(p)) <= ISO_TOL
  seen.clear()
  model = nnx.MultiHeadAttention(num_heads=4, num_kv_heads=2, in_features=D,
                                 qkv_features=4 * HEAD_DIM, kernel_init=spy,
                                 decode=False, rngs=nnx.Rngs(1))
  assert (D, 4 * HEAD_DIM) in seen and (D, 2 * HEAD_DIM) in seen   # flat
  state = nnx.state(model, nnx.Param)
  assert so.selected_frames(state).keys() == {"query/kernel", "key/kernel"}
  assert model.key.kernel.shape == (D, 2, HEAD_DIM)
  assert float(so.max_isometry_error(state)) <= ISO_TOL
  # Plain slicing agrees: head h of the flat kernel is columns [h k, (h+1) k).
  w = init(jax.random.key(2), (D, 3 * HEAD_DIM))
  for h in range(3):
    f = w[:, h * HEAD_DIM:(h + 1) * HEAD_DIM]
    assert float(jnp.linalg.norm(f.T @ f - jnp.eye(HEAD_DIM))) <= ISO_TOL
  with pytest.raises(ValueError, match=(
      r"shape \(16, 12\) has 12 columns, not divisible into heads of"
      r" head_dim = 8")):
    init(jax.random.key(0), (D, 12))
  with pytest.raises(ValueError, match=(
      r"expects \(d, heads, head_dim\); got \(16, 16\)\. Use"
      r" orthonormal_heads_init\(head_dim=\.\.\.\)")):
    so.orthonormal_heads_init()(jax.random.key(0), (D, D))
  with pytest.raises(ValueError, match=r"head_dim=0 must be a positive int"):
    so.orthonormal_heads_init(head_dim=0)
