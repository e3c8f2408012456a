"""The suite's own start-up (the root conftest.py): it must not change what
the tests measure."""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import stiefel_optax as so
from tests.helpers import frames

mlir = pytest.importorskip("jax._src.interpreters.mlir")


# Where jax no longer has the function, the suite runs unpatched (only
# slower), and these tests say so as a skip.
needs_the_patch = pytest.mark.skipif(
    not conftest.share_one_ir_context(),
    reason="jax._src.interpreters.mlir.make_ir_context is gone: the suite "
    "lowers each program into a fresh MLIR context (slower, same results)")


@needs_the_patch
def test_one_ir_context_per_thread():
  assert mlir.make_ir_context() is mlir.make_ir_context()
  other = []
  t = threading.Thread(target=lambda: other.append(mlir.make_ir_context()))
  t.start()
  t.join()
  assert other[0] is not mlir.make_ir_context()


@needs_the_patch
def test_the_shared_context_lowers_and_compiles_what_a_fresh_one_does(
    monkeypatch):
  """The Stiefel update, lowered and compiled once in the shared context and
  once in a fresh one (new functions, so no cache answers): the same
  StableHLO, the same optimized HLO (less its source lines: the two calls
  of `build` sit on different lines), the same numbers bit for bit."""
  strip = lambda hlo: re.sub(r"(?m)^\d+ \{file_name_id=.*$", "", hlo)
  w = jnp.transpose(frames(3, (2, 16, 4)), (1, 0, 2))
  params = {"attn": {"query": {"kernel": w}, "key": {"kernel": w}}}
  grads = jax.tree.map(lambda p: 0.1 * jnp.cos(p), params)

  def build():
    tx = so.stiefel_attention(1e-2)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    lowered = step.lower(grads, tx.init(params), params)
    compiled = lowered.compile()
    return (lowered.as_text(), compiled.as_text(),
            compiled(grads, tx.init(params), params))

  shared = build()
  monkeypatch.setattr(mlir, "make_ir_context", mlir.make_ir_context.fresh)
  fresh = build()
  assert shared[0] == fresh[0]
  assert strip(shared[1]) == strip(fresh[1])
  for a, b in zip(jax.tree.leaves(shared[2]), jax.tree.leaves(fresh[2])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
