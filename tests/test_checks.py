"""The checks (stiefel_optax/checks.py) as every transform and alias runs
them: an update or init without params, a leaf that is no frame (rank,
r > d, dtype), a bad retraction or radius, each a ValueError naming the
problem (and the leaf's path); the start check runs once per init.

Errors of frame selection are in tests/test_specs.py, bad inputs to a whole
model's optimizer in tests/test_reliability.py.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import stiefel_optax as so
from stiefel_optax import muon

from tests.helpers import TestCase, frames, normal


def all_transforms():
  return {
      "project_to_tangent": so.project_to_tangent(),
      "scale_by_frame_adam": so.scale_by_frame_adam(),
      "clip_frame_norm": so.clip_frame_norm(1.0),
      "retract_polar": so.retract_polar(),
      "stiefel_adam": so.stiefel_adam(0.1),
      "riemannian_sgd": so.riemannian_sgd(0.1),
      "stiefel_muon": muon.stiefel_muon(0.1),
  }


class ErrorsTest(TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*[(n,) for n in sorted(all_transforms())])
  def test_update_without_params_raises(self, name):
    tx = all_transforms()[name]
    w = {"w": frames(26, (8, 4))}
    state = tx.init(w)
    with pytest.raises(ValueError, match=f"^{name} needs params"):
      self.variant(tx.update)(w, state, None)
    with pytest.raises(ValueError, match=f"^{name} needs params"):
      tx.init(None)


BAD_LEAVES = [
    (np.ones((5,), np.float32), r"\(5,\)"),               # rank 1
    (np.ones((), np.float32), r"\(\)"),                   # rank 0
    (np.ones((3, 4), np.float32), r"\(3, 4\)"),           # r > d
    (np.ones((2, 3, 5), np.float32), r"\(2, 3, 5\)"),     # r > d, batched
    (np.ones((4, 2), np.int32), "int32"),                 # not floating
]


@pytest.mark.parametrize("name", sorted(all_transforms()))
@pytest.mark.parametrize("leaf,match", BAD_LEAVES)
def test_bad_leaf_raises_naming_path_and_shape(name, leaf, match):
  params = {"layer": {"query": jnp.asarray(leaf)}}
  with pytest.raises(ValueError, match=match) as info:
    all_transforms()[name].init(params)
  assert "layer" in str(info.value) and "query" in str(info.value)


def test_bad_method_and_radius_raise():
  for make in (lambda: so.retract_polar("svd"),
               lambda: so.stiefel_adam(0.1, retraction="svd"),
               lambda: so.riemannian_sgd(0.1, retraction="svd"),
               lambda: muon.stiefel_muon(0.1, retraction="svd")):
    with pytest.raises(ValueError, match="svd"):
      make()
  for bad in (0.0, -1.0):
    with pytest.raises(ValueError, match="max_step_norm"):
      so.clip_frame_norm(bad)
    with pytest.raises(ValueError, match="max_(step_)?norm"):
      so.stiefel_adam(0.1, max_step_norm=bad)


# ---------------------------------------------------------------------------
# The start check


def test_start_check_runs_once_per_init(monkeypatch):
  """frame_partition checks the start of every selected kernel, naming its
  path; the Stiefel chain inside does not check it again. A standalone
  optimizer checks its own start."""
  calls = []
  check_start = so.checks.check_start
  monkeypatch.setattr(so.checks, "check_start",
                      lambda name, *a, **k: (calls.append(name),
                                             check_start(name, *a, **k))[1])
  kernel = lambda seed: jnp.transpose(frames(seed, (2, 16, 4)), (1, 0, 2))
  params = {"attn": {"query": {"kernel": kernel(52)},
                     "key": {"kernel": kernel(53)}},
            "out": {"kernel": normal(54, (2, 4, 16))}}
  for tx in (so.stiefel_attention(1e-2), so.stiefel_attention(
      1e-2, orthonormal_start="project", stack_frames=True),
             so.stiefel_attention(1e-2, stiefel_tx=so.stiefel_muon(1e-2))):
    calls.clear()
    tx.init(params)
    # One per kernel, by frame_partition (named by path).
    assert len(calls) == 2 and all(c.startswith("attn/") for c in calls), calls
  calls.clear()
  w = frames(55, (2, 16, 4))
  so.stiefel_adam(1e-2).init(w)
  assert len(calls) == 1, calls
  with pytest.raises(ValueError, match=r"stiefel_optax.polar\(w\)"):
    so.stiefel_adam(1e-2).init(2.0 * w)
  # "project" through the partition: the inner chain (whose own setting
  # is "check") is not asked to check frames that are not orthonormal.
  raw = jax.tree.map(lambda x: 2.0 * x, params)
  so.stiefel_attention(1e-2, orthonormal_start="project").init(raw)
  with pytest.raises(ValueError, match="attn/key/kernel: shape"):
    so.stiefel_attention(1e-2).init(raw)


# ---------------------------------------------------------------------------
# The start check of a traced init (issue 55): never silent, no cost per step


def _attention_params(scale_key=1.0):
  """A (16, 2, 4) query and key kernel; the key's frames scaled."""
  kernel = lambda seed: jnp.transpose(frames(seed, (2, 16, 4)), (1, 0, 2))
  return {"attn": {"query": {"kernel": kernel(61)},
                   "key": {"kernel": scale_key * kernel(62)}},
          "out": {"kernel": normal(63, (2, 4, 16))}}


def _traced_error(fn, *args):
  """The message of the error that running fn under jit raises (the start
  check's ValueError, reaching the caller wrapped in a JaxRuntimeError)."""
  with pytest.raises(Exception) as info:     # noqa: PT011 (checked below)
    jax.block_until_ready(jax.jit(fn)(*args))
  assert isinstance(info.value, (ValueError, jax.errors.JaxRuntimeError))
  return str(info.value)


def test_traced_init_raises_on_frames_that_are_not_orthonormal():
  """`jax.jit(tx.init)` (the sharded recipes' init) on frames not
  orthonormal raises the eager init's error, naming the kernel, when the
  init runs; before issue 55 it was accepted silently. Orthonormal frames
  pass, and the eager init keeps its error."""
  bad = _attention_params(scale_key=2.0)
  tx = so.stiefel_attention(1e-2)
  message = _traced_error(tx.init, bad)
  # ||(2W)^T (2W) - I||_F = ||3 I_4||_F = 6.
  assert re.search(r"ValueError: attn/key/kernel: shape \(16, 2, 4\), frames"
                   r" \(2, 16, 4\) under .*not orthonormal \(isometry error"
                   r" .* = 6 at frame \(\d,\)", message), message
  assert "stiefel_optax.orthonormalize(params" in message
  assert "traced init" in message
  with pytest.raises(ValueError, match="^attn/key/kernel: shape"):
    tx.init(bad)
  good = _attention_params()
  chex.assert_trees_all_equal(jax.jit(tx.init)(good), tx.init(good))


def test_traced_init_raises_on_rank_deficient_frames_and_any_alias():
  """"project" accepts frames off the manifold but not rank-deficient
  ones, traced too; a frame-only alias's traced init checks its leaves."""
  deficient = _attention_params()
  k = deficient["attn"]["query"]["kernel"]
  deficient["attn"]["query"]["kernel"] = k.at[:, 1, 3].set(0.0)
  project = so.stiefel_attention(1e-2, orthonormal_start="project")
  message = _traced_error(project.init, deficient)
  assert re.search(r"attn/query/kernel: .*frame \(1,\) is rank-deficient",
                   message), message
  jax.block_until_ready(jax.jit(project.init)(_attention_params(2.0)))
  w = frames(64, (3, 8, 4))
  message = _traced_error(so.stiefel_adam(1e-2).init, w.at[2].multiply(1.5))
  assert re.search(r"check_orthonormal_start: parameter <root> \(shape"
                   r" \(3, 8, 4\)\): not orthonormal .* at frame \(2,\)",
                   message), message


def test_traced_start_check_costs_no_step_and_no_abstract_init():
  """The check is in the init's program only: the update's program has no
  host callback (no host sync per step), and `jax.eval_shape(tx.init)`
  on bad frames runs nothing."""
  tx = so.stiefel_attention(1e-2)
  good = _attention_params()
  state = tx.init(good)
  text = str(jax.make_jaxpr(tx.update)(good, state, good))
  assert "callback" not in text
  assert "callback" in str(jax.make_jaxpr(tx.init)(good))
  abstract = jax.eval_shape(tx.init, _attention_params(scale_key=2.0))
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
