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
