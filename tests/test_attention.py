"""`stiefel_attention` (stiefel_optax/attention.py): the arguments it takes
and those it refuses when a transform is given; on the Flax block
(`helpers.LinenBlock`, the `linen_params` fixture) its state (one moment
per element, one scalar per frame), weight decay that leaves the frames
untouched, and its composition with optax's wrappers (inject_hyperparams,
MultiSteps, apply_if_finite).

Model-family trainings are in tests/families/, frame selection in
tests/test_specs.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so

from tests.helpers import (
    D, HEADS, HEAD_DIM, frame_adam_states, frames, leaves_by_path, normal)

LR, WD = 1e-2, 0.1
ISO_TOL = 1e-5


# ---------------------------------------------------------------------------
# Arguments: taken, or refused where a given transform ignores them


def _attention_tree():
  kernel = lambda seed: jnp.transpose(frames(seed, (2, 16, 4)), (1, 0, 2))
  return {"attn": {"query": {"kernel": kernel(56)}},
          "out": {"kernel": normal(57, (2, 4, 16))}}


IGNORED_ARGUMENTS = [
    # (replaced groups, arguments, the names the message lists)
    ("stiefel_tx", dict(max_step_norm=0.2), "max_step_norm"),
    ("stiefel_tx", dict(max_step_norm=0.1), "max_step_norm"),   # the default
    ("stiefel_tx", dict(max_step_norm=None), "max_step_norm"),
    ("stiefel_tx", dict(retraction="newton_schulz"), "retraction"),
    ("stiefel_tx", dict(retraction="eigh", stiefel_learning_rate=1e-3),
     "stiefel_learning_rate, retraction"),
    ("stiefel_tx", dict(stiefel_learning_rate=None), "stiefel_learning_rate"),
    ("euclidean_tx", dict(weight_decay=1e-4), "weight_decay"),
    ("both", dict(b1=0.9, mu_dtype=None), "b1, mu_dtype"),
    ("both", dict(eps=1e-8, b2=0.999, weight_decay=0.0),
     "weight_decay, b2, eps"),
]


def _replaced(which):
  stiefel, euclid = so.riemannian_sgd(1e-2), optax.sgd(1e-2)
  return {"stiefel_tx": dict(stiefel_tx=stiefel),
          "euclidean_tx": dict(euclidean_tx=euclid),
          "both": dict(stiefel_tx=stiefel, euclidean_tx=euclid)}[which]


@pytest.mark.parametrize("which,kw,names", IGNORED_ARGUMENTS)
def test_stiefel_attention_refuses_what_a_given_transform_ignores(
    which, kw, names):
  """With stiefel_tx / euclidean_tx given, the arguments only the replaced
  transform would take are refused, even passed at their defaults."""
  with pytest.raises(ValueError,
                     match=f"^stiefel_attention: {names} would be ignored:"
                     r".*Pass them to your own transform"):
    so.stiefel_attention(1e-2, **_replaced(which), **kw)


def test_stiefel_attention_takes_what_the_other_group_uses():
  """The arguments the remaining group uses are taken; the defaults are
  the values they document; optax.inject_hyperparams injects the same
  hyperparameters as before, given transforms or not."""
  params = _attention_tree()
  grads = jax.tree.map(lambda x: normal(58, x.shape), params)
  so.stiefel_attention(1e-2, **_replaced("stiefel_tx"), b1=0.8, b2=0.99,
                       eps=1e-6, weight_decay=0.1, mu_dtype=jnp.bfloat16,
                       orthonormal_start="project").init(params)
  so.stiefel_attention(1e-2, **_replaced("euclidean_tx"), b1=0.8,
                       max_step_norm=0.2, retraction="eigh",
                       stiefel_learning_rate=1e-3,
                       mu_dtype=jnp.bfloat16).init(params)
  explicit = so.stiefel_attention(
      1e-2, stiefel_learning_rate=None, weight_decay=1e-4, b1=0.9, b2=0.999,
      eps=1e-8, max_step_norm=0.1, retraction="newton_schulz", mu_dtype=None)
  default = so.stiefel_attention(1e-2)
  u_explicit, _ = explicit.update(grads, explicit.init(params), params)
  u_default, _ = default.update(grads, default.init(params), params)
  chex.assert_trees_all_equal(u_explicit, u_default)

  inject = optax.inject_hyperparams(so.stiefel_attention)
  for kw in ({}, _replaced("stiefel_tx"), _replaced("both")):
    tx = inject(learning_rate=1e-2, **kw)
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "weight_decay", "b1",
                                      "b2", "eps", "max_step_norm"}
    u, _ = jax.jit(tx.update)(grads, state, params)
    chex.assert_tree_all_finite(u)
  # What inject_hyperparams passes through untouched is still refused.
  with pytest.raises(ValueError, match="^stiefel_attention: retraction"):
    inject(learning_rate=1e-2, retraction="eigh",
           **_replaced("stiefel_tx")).init(params)


# ---------------------------------------------------------------------------
# The state, on the Flax block


def _real(tree):
  """The array leaves of a tree (MaskedNode is an empty pytree)."""
  return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def _grads_like(params, seed):
  """Standard normal gradients from NumPy (jax.random would compile a
  program for every leaf shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda w: jnp.asarray(rng.standard_normal(w.shape), w.dtype), params)


# One injected optimizer, its update jitted once, shared by two tests.
# One injected optimizer, its update jitted once, shared by two tests.
INJECTED = optax.inject_hyperparams(so.stiefel_attention)(
    learning_rate=LR, weight_decay=WD)
injected_update = jax.jit(INJECTED.update)


def test_optimizer_state_one_moment_per_element_one_scalar_per_frame(
    linen_params):
  params = linen_params
  tx = so.stiefel_attention(LR)
  state = tx.init(params)
  (fs,) = frame_adam_states(state)
  leaves = leaves_by_path(params)
  stiefel = sorted(so.selected_frames(params))
  assert sorted(stiefel) == ["attn/key/kernel", "attn/query/kernel"]
  mu, nu = leaves_by_path(fs.mu), leaves_by_path(fs.nu)
  assert sorted(mu) == sorted(nu) == sorted(stiefel)
  for p in stiefel:
    assert mu[p].shape == (HEADS, D, HEAD_DIM)        # the frame view
    assert mu[p].size == leaves[p].size
    assert nu[p].shape == (HEADS,)                     # one scalar per head
  # AdamW's moments hold every other leaf, element by element.
  (adam,) = [x for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(x, optax.ScaleByAdamState)]
  assert sum(x.size for x in _real(adam.nu)) == sum(
      x.size for p, x in leaves.items() if p not in stiefel)
  assert sum(x.size for x in _real(adam.nu)) + sum(
      x.size for x in _real(fs.mu)) == sum(x.size for x in leaves.values())


# ---------------------------------------------------------------------------
# Weight decay.


def test_weight_decay_leaves_frames_untouched(linen_params):
  params = linen_params
  sel = so.selected_frames(params)
  start = leaves_by_path(params)

  def run_injected(weight_decay):          # jitted once, decay as an array
    p, state = params, INJECTED.init(params)
    state.hyperparams["weight_decay"] = jnp.float32(weight_decay)
    for t in range(5):
      u, state = injected_update(_grads_like(params, t), state, p)
      p = optax.apply_updates(p, u)
    return leaves_by_path(p)

  def run_default(weight_decay):           # the plain factory, a float decay
    tx = so.stiefel_attention(LR, weight_decay=weight_decay)
    p, state, update = params, tx.init(params), jax.jit(tx.update)
    for t in range(3):
      u, state = update(_grads_like(params, t), state, p)
      p = optax.apply_updates(p, u)
    return leaves_by_path(p)

  # One compiled program (injected decay): bit for bit. Two programs (the
  # decay a constant): XLA may fuse the Stiefel step differently around the
  # AdamW group, so they agree to rounding, 1e-6; a decay reaching a frame
  # would move it by about lr * wd = 5e-4 per step.
  for run, atol in ((run_injected, 0.0), (run_default, 1e-6)):
    no_decay, decay = run(0.0), run(0.5)
    for p in start:
      if p in sel:
        np.testing.assert_allclose(decay[p], no_decay[p], rtol=0, atol=atol,
                                   err_msg=f"{p} ({run.__name__})")
        assert float(jnp.max(jnp.abs(decay[p] - start[p]))) > 1e-3
    # The decay acts on every Euclidean kernel: smaller than without it.
    for p in ("attn/value/kernel", "attn/out/kernel", "mlp_in/kernel",
              "mlp_out/kernel"):
      assert float(jnp.linalg.norm(decay[p])) < 0.995 * float(
          jnp.linalg.norm(no_decay[p])), (run.__name__, p)


# ---------------------------------------------------------------------------
# Composition with optax wrappers.


def _assert_trees_close(a, b, atol=1e-6):
  for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5, err_msg=so.path_str(p))


def test_inject_hyperparams_change_learning_rate_between_steps(linen_params):
  params = linen_params
  istate = INJECTED.init(params)
  assert set(istate.hyperparams) >= {"learning_rate", "weight_decay", "b1",
                                     "max_step_norm"}
  update = injected_update
  plain1 = so.stiefel_attention(LR, weight_decay=WD)
  plain2 = so.stiefel_attention(LR / 4, weight_decay=WD)
  pstate = plain1.init(params)
  p_inj = p_ref = params
  for t in range(3):
    if t == 2:
      istate.hyperparams["learning_rate"] = jnp.asarray(LR / 4)
    g = _grads_like(params, t)
    u_inj, istate = update(g, istate, p_inj)
    u_ref, pstate = (plain1 if t < 2 else plain2).update(g, pstate, p_ref)
    _assert_trees_close(u_inj, u_ref)
    p_inj = optax.apply_updates(p_inj, u_inj)
    p_ref = optax.apply_updates(p_ref, u_ref)
  assert float(so.max_isometry_error(p_inj)) <= ISO_TOL
  # The last step really was smaller on the Euclidean kernels.
  assert float(jnp.max(jnp.abs(u_inj["mlp_in"]["kernel"]))) < 0.5 * LR

  # Schedules work too; an injected radius too large for Newton–Schulz is
  # refused, and shape arguments must be static.
  sched = optax.inject_hyperparams(so.stiefel_attention)(
      learning_rate=optax.linear_schedule(LR, 0.0, 4))
  s = sched.init(params)
  for t in range(2):
    u, s = sched.update(_grads_like(params, 5), s, params)
  assert float(s.hyperparams["learning_rate"]) == pytest.approx(LR * 3 / 4)
  with pytest.raises(ValueError, match="max_step_norm must be > 0"):
    optax.inject_hyperparams(so.stiefel_attention)(
        learning_rate=LR, max_step_norm=0.0).init(params)
  # An injected radius is traced: Newton–Schulz sizes itself at run time, so
  # a radius raised between steps (to 2, far past its fixed-count sizing)
  # still lands every frame on the manifold, with steps longer than 1.
  istate.hyperparams["max_step_norm"] = jnp.asarray(2.0)
  istate.hyperparams["learning_rate"] = jnp.asarray(10.0)
  u, _ = update(_grads_like(params, 6), istate, p_inj)
  assert float(jnp.max(jnp.linalg.norm(
      u["attn"]["query"]["kernel"], axis=(0, 2)))) > 1.0
  assert float(so.max_isometry_error(optax.apply_updates(p_inj, u))) <= ISO_TOL
  # Selectors: a preset, a spec mapping need no static_args; a callable
  # selector (which inject_hyperparams would take for a schedule) does.
  spec = so.FrameSpec(rows=0, cols=2)
  for frames in ("flax", {r"query/kernel$": spec}):
    ok = optax.inject_hyperparams(so.stiefel_attention)(
        learning_rate=LR, frames=frames)
    assert len(frame_adam_states(ok.init(params))) == 1
  ok = optax.inject_hyperparams(so.stiefel_attention, static_args=("frames",))(
      learning_rate=LR, frames=lambda path, leaf: (
          spec if path.endswith("query/kernel") else None))
  assert len(frame_adam_states(ok.init(params))) == 1


def test_multi_steps_accumulates_then_takes_one_stiefel_step(linen_params):
  params = linen_params
  tx = optax.MultiSteps(so.stiefel_attention(LR), every_k_schedule=2)
  update = jax.jit(tx.update)
  state = tx.init(params)
  g1, g2 = _grads_like(params, 1), _grads_like(params, 2)
  u1, state = update(g1, state, params)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(u1))
  u2, state = update(g2, state, params)
  plain = so.stiefel_attention(LR)
  want, _ = plain.update(jax.tree.map(lambda a, b: (a + b) / 2, g1, g2),
                         plain.init(params), params)
  _assert_trees_close(u2, want)
  new = optax.apply_updates(params, u2)
  assert float(so.max_isometry_error(new)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["attn"]["query"]["kernel"]
                               - params["attn"]["query"]["kernel"]))) > 1e-3


def test_apply_if_finite_skips_non_finite_steps(linen_params):
  params = linen_params
  tx = optax.apply_if_finite(so.stiefel_attention(LR), max_consecutive_errors=3)
  update = jax.jit(tx.update)
  state = tx.init(params)
  for where in (("mlp_in", "kernel"), ("attn", "query", "kernel")):
    g = _grads_like(params, 3)
    leaf = g
    for k in where[:-1]:
      leaf = leaf[k]
    leaf[where[-1]] = leaf[where[-1]].at[0, 0].set(jnp.nan)
    u, state = update(g, state, params)
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))
  assert int(state.notfinite_count) == 2
  g = _grads_like(params, 4)
  u, state = update(g, state, params)
  plain = so.stiefel_attention(LR)
  want, _ = plain.update(g, plain.init(params), params)
  _assert_trees_close(u, want)
  assert int(state.notfinite_count) == 0
  assert float(so.max_isometry_error(optax.apply_updates(params, u))) <= ISO_TOL
