"""Diagnostics (stiefel_optax/diagnostics.py): `check_frames` names the
leaf and its error, on the Flax block's params (the `linen_params`
fixture).

`max_isometry_error`, `frame_isometry_errors` and `frame_movement` are the
measurements of every training test (tests/families/, tests/test_attention.py,
tests/test_reliability.py).
"""

import jax
import pytest

import stiefel_optax as so

from tests.helpers import LinenBlock, block_data


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
  raw = LinenBlock().init(jax.random.key(1), block_data()[0])["params"]
  with pytest.raises(ValueError, match="attn/query/kernel"):
    so.check_frames(raw)
