"""The one-pass aliases' state layout, pinned (issue 42).

`one_pass_chain` (and so `stiefel_adam`, `riemannian_sgd`) keeps the state
of the unfused chain

    (*lead links, scale_by_learning_rate, [clip_frame_norm,] retract_polar)

as a tuple, one entry per link. A checkpoint stores that tuple's leaves in
this order; reordering the chain (or adding, dropping or renaming a state
field) would make saved checkpoints fail to restore. The literals below are
the layout a checkpoint holds: change them only with a migration of the
saved states. The learning rate is a schedule so that its link has a state
of its own (a constant rate gives an EmptyState like the cap's and the
retraction's, whose mutual order the state cannot show and a checkpoint
does not depend on).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so


def layout(state):
  """([(link state type, its fields)], [(leaf path, shape, dtype)]), in
  order."""
  links = [(type(s).__name__, tuple(getattr(s, "_fields", ()))) for s in state]
  leaves = [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
  return links, leaves


def params():
  return {"k": so.random_frames(jax.random.key(0), (2, 8, 4)),
          "q": so.random_frames(jax.random.key(1), (8, 2)).astype(
              jnp.bfloat16)}


LR = optax.linear_schedule(0.1, 0.01, 10)

ADAM_LEAVES = [("[1].count", (), "int32"),
               ("[1].mu['k']", (2, 8, 4), "float32"),
               ("[1].mu['q']", (8, 2), "bfloat16"),
               ("[1].nu['k']", (2,), "float32"),
               ("[1].nu['q']", (), "float32"),
               ("[2].count", (), "int32")]
ADAM_LINKS = [("EmptyState", ()),                          # start check
              ("ScaleByFrameAdamState", ("count", "mu", "nu")),
              ("ScaleByScheduleState", ("count",))]        # learning rate
EMPTY = ("EmptyState", ())
# The retraction's state where a frame is stored below float32 (issue 55):
# the float32 master copy of the bf16 leaf 'q', a float32 () placeholder for
# the float32 leaf 'k' (float32-only trees keep EMPTY there).
MASTER = ("MasterFramesState", ("master",))


def master_leaves(link: int):
  return [(f"[{link}].master['k']", (), "float32"),
          (f"[{link}].master['q']", (8, 2), "float32")]


LAYOUTS = {
    # (check_orthonormal_start, scale_by_frame_adam, lr, clip, retract)
    "stiefel_adam": (lambda: so.stiefel_adam(LR),
                     (ADAM_LINKS + [EMPTY, MASTER],
                      ADAM_LEAVES + master_leaves(4))),
    # no cap: (check, adam, lr, retract)
    "stiefel_adam, no cap": (lambda: so.stiefel_adam(LR, max_step_norm=None),
                             (ADAM_LINKS + [MASTER],
                              ADAM_LEAVES + master_leaves(3))),
    # a constant rate: its link's state is empty too
    "stiefel_adam, constant lr": (
        lambda: so.stiefel_adam(0.1),
        (ADAM_LINKS[:2] + [EMPTY, EMPTY, MASTER],
         ADAM_LEAVES[:-1] + master_leaves(4))),
    # without the float32 master: the retraction's state is empty
    "stiefel_adam, no master": (
        lambda: so.stiefel_adam(LR, master_frames=False),
        (ADAM_LINKS + [EMPTY, EMPTY], ADAM_LEAVES)),
    # (project_to_tangent, lr, clip, retract)
    "riemannian_sgd": (
        lambda: so.riemannian_sgd(LR, max_step_norm=0.1),
        ([EMPTY, ("ScaleByScheduleState", ("count",)), EMPTY, MASTER],
         [("[1].count", (), "int32")] + master_leaves(3))),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_state_layout_is_pinned(name):
  make, expected = LAYOUTS[name]
  state = make().init(params())
  assert type(state) is tuple, type(state)    # pylint: disable=unidiomatic-typecheck
  assert layout(state) == expected


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_flat_checkpoint_restores_into_a_fresh_state(name):
  """A state saved as its flat leaves (as a checkpointer stores them)
  restores into the structure of a freshly initialised optimizer, and the
  run goes on exactly as without the round trip."""
  tx = LAYOUTS[name][0]()
  p = params()
  grads = jax.tree.map(
      lambda w, i: jax.random.normal(jax.random.key(i), w.shape, w.dtype),
      p, {"k": 2, "q": 3})
  state = tx.init(p)
  for _ in range(2):
    u, state = tx.update(grads, state, p)
    p = optax.apply_updates(p, u)
  saved = [np.asarray(x) for x in jax.tree.leaves(state)]
  fresh = tx.init(params())
  restored = jax.tree.unflatten(
      jax.tree.structure(fresh),
      [jnp.asarray(x, y.dtype) for x, y in zip(saved, jax.tree.leaves(fresh),
                                               strict=True)])
  chex.assert_trees_all_equal_structs(restored, state)
  chex.assert_trees_all_equal(restored, state)
  u, new = tx.update(grads, state, p)
  u_r, new_r = tx.update(grads, restored, p)
  chex.assert_trees_all_equal(u_r, u)
  chex.assert_trees_all_equal(new_r, new)
