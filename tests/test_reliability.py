"""Reliability: faults, bad inputs, low precision and long runs never lose a
frame or the training state.

A tiny Flax-linen-shaped attention (attn/{query,key,value,out}/kernel,
d = 8, 2 heads of 4, so 4 Stiefel frames) is shared with
`benchmarks.long_run`. Faults are injected as data (not as new shapes), so
one jitted step serves every case.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from benchmarks import long_run as lr
from tests.helpers import frame_adam_states

D, HEADS, HEAD_DIM = 8, 2, 4
LR = 1e-2
TEACHER = lr.init_params(jax.random.PRNGKey(1), D, HEADS, HEAD_DIM,
                         orthonormal=False)


def make_params(dtype=jnp.float32):
  return lr.init_params(jax.random.PRNGKey(0), D, HEADS, HEAD_DIM, dtype)


def loss_fn(params, t):
  x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(2), t),
                        (4, 6, D))
  return jnp.mean(jnp.square(lr.attention(params, x) - lr.attention(TEACHER, x)))


grad_at = jax.jit(jax.grad(loss_fn))
loss_at = jax.jit(loss_fn)


def make_step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates
  return step


def frame_moments(state):
  """{path: (mu, nu)} of the Stiefel leaves (frame views; MaskedNodes out)."""
  (fs,) = frame_adam_states(state)
  out = {}
  for (p, mu), nu in zip(jax.tree_util.tree_leaves_with_path(fs.mu),
                         jax.tree.leaves(fs.nu)):
    out[so.path_str(p)] = (np.asarray(mu), np.asarray(nu))
  return out


def max_err(params):
  return float(so.max_isometry_error(
      jax.tree.map(lambda w: w.astype(jnp.float32), params)))


def all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


def set_frame_entry(grads, leaf, head, value):
  """grads with one entry of frame `head` of `leaf` (a (d, heads, head_dim)
  kernel) replaced by value; head=None poisons every frame of every
  Stiefel leaf."""
  grads = jax.tree.map(lambda x: x, grads)
  if head is None:
    for name in ("query", "key"):
      k = grads["attn"][name]["kernel"]
      grads["attn"][name]["kernel"] = k.at[1, :, 2].set(value)
    return grads
  k = grads["attn"][leaf]["kernel"]
  grads["attn"][leaf]["kernel"] = k.at[3, head, 1].set(value)
  return grads


@pytest.fixture(scope="module")
def warm():
  """stiefel_attention after 3 good steps: (tx, step, params, state)."""
  tx = so.stiefel_attention(LR)
  step = make_step(tx)
  params = make_params()
  state = tx.init(params)
  for t in range(3):
    params, state, _ = step(params, state, grad_at(params, t))
  return tx, step, params, state


# ---------------------------------------------------------------------------
# 1. Non-finite gradients.

# (fault value, leaf, head): one entry of one frame, or every frame (None).
FRAME_FAULTS = [
    (np.nan, "query", 0),
    (np.inf, "key", 1),
    (-np.inf, "query", 1),
    (np.nan, "key", 0),
    (np.nan, None, None),
]


@pytest.mark.parametrize("value,leaf,head", FRAME_FAULTS,
                         ids=["nan-q0", "inf-k1", "-inf-q1", "nan-k0", "nan-all"])
def test_library_skips_nonfinite_frame(warm, value, leaf, head):
  """The library's own behaviour: a frame whose gradient has a NaN/Inf gets
  a zero step and keeps its moments; every other frame steps normally."""
  tx, step, params, state = warm
  good = grad_at(params, 3)
  bad = set_frame_entry(good, leaf, head, value)
  new, new_state, _ = step(params, state, bad)
  ref, ref_state, _ = step(params, state, good)

  assert all_finite(new) and all_finite(new_state)
  assert max_err(new) <= 1e-5
  # Euclidean leaves had finite gradients: their step is the normal one.
  for name in ("value", "out"):
    np.testing.assert_allclose(new["attn"][name]["kernel"],
                               ref["attn"][name]["kernel"], rtol=0, atol=1e-7)

  moved = so.frame_movement(params, new)
  ref_moved = so.frame_movement(params, ref)
  mom, mom_before, mom_ref = (frame_moments(s) for s in
                              (new_state, state, ref_state))
  skipped = 0
  for name in ("query", "key"):
    path = f"attn/{name}/kernel"
    for h in range(HEADS):
      hit = head is None or (name == leaf and h == head)
      if hit:
        skipped += 1
        # Zero tangent step: only the retraction's re-polarisation (rounding).
        assert float(moved[path][h]) <= 1e-6
        np.testing.assert_array_equal(mom[path][0][h], mom_before[path][0][h])
        np.testing.assert_array_equal(mom[path][1][h], mom_before[path][1][h])
      else:
        assert float(ref_moved[path][h]) > 1e-4  # a real step was taken
        np.testing.assert_allclose(moved[path][h], ref_moved[path][h],
                                   rtol=1e-5)
        np.testing.assert_allclose(mom[path][0][h], mom_ref[path][0][h],
                                   rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(mom[path][1][h], mom_ref[path][1][h],
                                   rtol=1e-5)
  assert skipped == (2 * HEADS if head is None else 1)

  # Training continues: frames stay finite and on the manifold, the skipped
  # frame moves again and the loss keeps falling.
  start_loss = float(loss_at(new, 4))
  p, s = new, new_state
  for t in range(4, 16):
    p, s, _ = step(p, s, grad_at(p, t))
    assert all_finite(p)
  assert all_finite(s) and max_err(p) <= 1e-5
  later = so.frame_movement(new, p)
  assert min(float(jnp.min(m)) for m in later.values()) > 1e-3
  assert float(loss_at(p, 4)) < start_loss


def test_euclidean_group_does_not_skip(warm):
  """AdamW (the Euclidean group) is optax's: a NaN gradient poisons its
  leaf. The frames are untouched by it; `apply_if_finite` is the remedy."""
  tx, step, params, state = warm
  bad = grad_at(params, 3)
  bad["attn"]["out"]["kernel"] = bad["attn"]["out"]["kernel"].at[0, 0, 0].set(
      np.nan)
  new, new_state, _ = step(params, state, bad)
  assert not bool(jnp.all(jnp.isfinite(new["attn"]["out"]["kernel"])))
  assert all_finite({k: new["attn"][k] for k in ("query", "key", "value")})
  assert max_err(new) <= 1e-5
  assert all_finite(frame_adam_states(new_state))


# Bad steps inserted into a run under apply_if_finite: which gradients go bad.
IF_FINITE_FAULTS = ["nan-euclidean", "inf-frame", "nan-everywhere"]


def poison(grads, kind):
  if kind == "nan-euclidean":
    grads = jax.tree.map(lambda x: x, grads)
    grads["attn"]["value"]["kernel"] = grads["attn"]["value"]["kernel"].at[
        0, 1, 2].set(np.nan)
    return grads
  if kind == "inf-frame":
    return set_frame_entry(grads, "key", 0, np.inf)
  return jax.tree.map(lambda x: jnp.full_like(x, np.nan), grads)


def test_apply_if_finite_skips_the_whole_step(warm):
  """optax.apply_if_finite around stiefel_attention: a step with any
  non-finite gradient is skipped as a whole (zero update, inner state
  bit-identical), and the run continues exactly as if it had not happened."""
  tx = optax.apply_if_finite(so.stiefel_attention(LR), max_consecutive_errors=5)
  step = make_step(tx)
  params0 = make_params()
  # Reference: 6 good steps under the same wrapper.
  p, s = params0, tx.init(params0)
  ref = []
  for t in range(6):
    p, s, _ = step(p, s, grad_at(p, t))
    ref.append(p)
  # Same run with a bad step before steps 1, 3 and 5.
  p, s = params0, tx.init(params0)
  bad_before = {1: IF_FINITE_FAULTS[0], 3: IF_FINITE_FAULTS[1],
                5: IF_FINITE_FAULTS[2]}
  skipped = 0
  for t in range(6):
    if t in bad_before:
      new_p, new_s, upd = step(p, s, poison(grad_at(p, t), bad_before[t]))
      assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(upd))
      jax.tree.map(np.testing.assert_array_equal, new_p, p)
      jax.tree.map(np.testing.assert_array_equal, new_s.inner_state,
                   s.inner_state)
      assert int(new_s.notfinite_count) == 1 and not bool(new_s.last_finite)
      skipped += 1
      assert int(new_s.total_notfinite) == skipped
      p, s = new_p, new_s
    p, s, _ = step(p, s, grad_at(p, t))
    assert int(s.notfinite_count) == 0
    jax.tree.map(np.testing.assert_array_equal, p, ref[t])
  assert skipped == len(IF_FINITE_FAULTS)
  assert max_err(p) <= 1e-5 and all_finite(s)
  # Unwrapped, the same optimizer takes the same good steps (the `warm`
  # fixture's stiefel_attention(LR) and its compiled step, from the start).
  plain, plain_step, _, _ = warm
  q, qs = params0, plain.init(params0)
  for t in range(6):
    q, qs, _ = plain_step(q, qs, grad_at(q, t))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), q, p)


def test_docstrings_state_the_nonfinite_behaviour():
  """The docs say which behaviour the library has (it skips the frame) and
  that the Euclidean group needs apply_if_finite."""
  for fn in (so.scale_by_frame_adam, so.stiefel_attention):
    doc = " ".join(fn.__doc__.split())
    assert "skips the frame" in doc, fn.__name__
    assert "apply_if_finite" in doc, fn.__name__


# ---------------------------------------------------------------------------
# 2. Low precision.

LOW_PRECISION = [("bfloat16", None, 2e-2), ("float16", "float32", 5e-3)]


@pytest.mark.parametrize("dtype,euclidean_dtype,tol", LOW_PRECISION,
                         ids=["bfloat16", "float16"])
def test_low_precision_isometry_does_not_grow(dtype, euclidean_dtype, tol):
  """bf16/f16 frames: isometry error at the dtype's rounding level, not
  growing over 2,000 jitted steps (10,000 in benchmarks/long_run.py).
  (float16 keeps the AdamW leaves in float32: optax.adamw's eps = 1e-8
  underflows in float16.)"""
  rec = lr.long_run(2_000, chunk=500, dtype=dtype,
                    euclidean_dtype=euclidean_dtype, d=D, heads=HEADS,
                    head_dim=HEAD_DIM)
  eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
  errs = [c["max_isometry_error"] for c in rec["chunks"]]
  assert rec["all_finite"]
  assert rec["max_isometry_error"] <= tol
  # Rounding level: a few ulps, and above float32's (the dtype is real).
  assert eps / 16 < rec["max_isometry_error"] <= 8 * eps
  # Not growing: the last chunk's worst error is no worse than twice the
  # first chunk's (drift would compound).
  assert errs[-1] <= 2 * errs[0], errs
  assert all(c["path_length"] > 0.1 for c in rec["chunks"])  # frames move


def test_low_precision_dtypes_and_mu_dtype():
  """Params and updates keep their dtype, the per-frame second moment is
  float32 (compute dtype), mu follows mu_dtype (default: the params')."""
  params = make_params(jnp.bfloat16)
  grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16),
                       grad_at(jax.tree.map(lambda w: w.astype(jnp.float32),
                                            params), 0))
  for mu_dtype, want_mu in ((None, jnp.bfloat16), (jnp.float32, jnp.float32)):
    tx = so.stiefel_attention(LR, mu_dtype=mu_dtype)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    # Stiefel updates come back in the params' dtype (AdamW's follow
    # mu_dtype, as in optax); apply_updates keeps every leaf's dtype.
    assert {updates["attn"][k]["kernel"].dtype for k in ("query", "key")} == {
        jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}
    (fs,) = frame_adam_states(state)
    assert {x.dtype for x in jax.tree.leaves(fs.mu)} == {jnp.dtype(want_mu)}
    assert {x.dtype for x in jax.tree.leaves(fs.nu)} == {jnp.dtype(jnp.float32)}
    assert max_err(new) <= 2e-2 and all_finite(new)
  # mu_dtype lowers precision too: float32 frames, bfloat16 first moment.
  tx = so.stiefel_adam(LR, mu_dtype="bfloat16")
  w = so.random_frames(jax.random.PRNGKey(3), (2, 8, 4))
  (fs,) = frame_adam_states(tx.init({"w": w}))
  assert fs.mu["w"].dtype == jnp.bfloat16 and fs.nu["w"].dtype == jnp.float32


def test_low_precision_geometry_runs_in_float32():
  """Each Stiefel transform, given bf16 (or f16) frames, gradients and state,
  returns exactly its float32 result on the upcast inputs, rounded once to
  the dtype: the geometry runs in float32 inside and casts back."""
  w32 = so.random_frames(jax.random.PRNGKey(4), (3, 16, 4))
  g32 = jax.random.normal(jax.random.PRNGKey(5), w32.shape)
  # A tangent step of norm ~0.2 per frame, for the retraction.
  xi32 = 0.05 * so.geometry.project_tangent(w32, g32)
  up = lambda x: x.astype(jnp.float32)
  for low in (jnp.bfloat16, jnp.float16):
    w = w32.astype(low)
    # (The upcast bf16 frames are off by bf16's rounding, which a float32
    # start check would name; the check is not what this test is about.)
    for tx, g in ((so.project_to_tangent("project"), g32),
                  (so.scale_by_frame_adam(), g32),
                  (so.clip_frame_norm(0.1), xi32),
                  # (Without the float32 master, whose update lands the
                  # frame on round(polar(W + xi)) instead: tests/
                  # test_precision.py.)
                  (so.retract_polar(master_frames=False), xi32)):
      g = g.astype(low)
      state = tx.init(w)
      u_low, s_low = tx.update(g, state, w)
      u_32, s_32 = tx.update(up(g), tx.init(up(w)), up(w))
      assert u_low.dtype == low
      np.testing.assert_array_equal(np.asarray(u_low),
                                    np.asarray(u_32.astype(low)))
      for a, b in zip(jax.tree.leaves(s_low), jax.tree.leaves(s_32)):
        np.testing.assert_array_equal(np.asarray(a),
                                      np.asarray(b.astype(a.dtype)))
    # A low-precision frame retracts to within one rounding of orthonormal.
    new = optax.apply_updates(w, so.retract_polar().update(
        jnp.zeros_like(w), None, w)[0])
    assert float(jnp.max(so.isometry_error(up(new)))) <= 8 * float(
        jnp.finfo(low).eps)


# ---------------------------------------------------------------------------
# 3. Long runs (100,000 steps: python -m benchmarks.long_run).


def test_long_run_quick_5000_steps():
  """benchmarks/long_run.py --quick: 5,000 float32 steps, every frame's
  isometry error <= 1e-5 at every step, and the frames keep moving."""
  (rec,) = lr.main(["--quick"]).values()
  assert rec["steps"] == 5_000 and len(rec["chunks"]) == 5
  assert rec["all_finite"] and rec["passed"]
  assert rec["max_isometry_error"] <= 1e-5
  assert all(c["path_length"] > 0.5 for c in rec["chunks"])
  assert rec["chunks"][-1]["loss"] < rec["chunks"][0]["loss"]


# ---------------------------------------------------------------------------
# 4. Bad inputs: each a ValueError naming the leaf path and the shape.


def _tree(**changes):
  p = make_params()
  p = {"attn": dict(p["attn"]), "bias": jnp.zeros((3,))}
  for path, value in changes.items():
    *outer, last = path.split("__")
    node = p
    for k in outer:
      node[k] = dict(node[k])
      node = node[k]
    node[last] = value
  return p


def _with(**extra):
  """The default selection plus `extra` {path regex: FrameSpec}."""
  return {r"(^|/)(query|key)/kernel$": so.FrameSpec(rows=0, cols=2), **extra}


def _update(tx, params, grads=None, update_params="same"):
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params) if grads is None else grads
  tx.update(grads, state, params if update_params == "same" else update_params)


def _off_manifold(scale):
  return _tree(attn__query={"kernel": make_params()["attn"]["query"]["kernel"]
                            * scale})


# name -> (callable raising, regexes the message must contain)
BAD_INPUTS = {
    "rank-1 leaf selected": (
        lambda: so.stiefel_attention(LR, frames=_with(
            bias=so.FrameSpec())).init(_tree()),
        [r"bias", r"\(3,\)"]),
    "scalar leaf selected": (
        lambda: so.stiefel_attention(LR, frames=_with(
            bias=so.FrameSpec())).init(_tree(bias=jnp.zeros(()))),
        [r"bias", r"\(\)"]),
    "rank-1 leaf in stiefel_adam": (
        lambda: so.stiefel_adam(LR).init({"w": jnp.zeros((5,))}),
        [r"\['w'\]", r"\(5,\)"]),
    "scalar leaf in stiefel_adam": (
        lambda: so.stiefel_adam(LR).init({"w": jnp.zeros(())}),
        [r"\['w'\]", r"\(\)"]),
    "head_dim > d, (d, heads, head_dim) kernel": (
        lambda: so.stiefel_attention(LR).init(
            _tree(attn__query={"kernel": jnp.zeros((4, 2, 8))})),
        [r"attn/query/kernel", r"\(4, 2, 8\)"]),
    "head_dim > d, fused 2-D kernel": (
        lambda: so.stiefel_attention(
            LR, frames={r"^fused$": so.FrameSpec(0, 1, heads=2)}).init(
                {"fused": jnp.zeros((4, 16)), "b": jnp.zeros((3,))}),
        [r"fused", r"\(4, 16\)"]),
    "r > d in stiefel_adam": (
        lambda: so.stiefel_adam(LR).init({"w": jnp.zeros((4, 8))}),
        [r"\['w'\]", r"\(4, 8\)"]),
    "int32 kernel": (
        lambda: so.stiefel_attention(LR).init(
            _tree(attn__key={"kernel": jnp.zeros((D, HEADS, HEAD_DIM),
                                                 jnp.int32)})),
        [r"attn/key/kernel", r"\(8, 2, 4\)", r"int32"]),
    "uint8 frame in stiefel_adam": (
        lambda: so.stiefel_adam(LR).init({"w": jnp.zeros((8, 4), jnp.uint8)}),
        [r"\['w'\]", r"\(8, 4\)", r"uint8"]),
    "bool frame in stiefel_adam": (
        lambda: so.stiefel_adam(LR).init({"w": jnp.zeros((8, 4), bool)}),
        [r"\['w'\]", r"\(8, 4\)", r"bool"]),
    "params=None in stiefel_attention.update": (
        lambda: _update(so.stiefel_attention(LR), _tree(), update_params=None),
        [r"params"]),
    "params=None in stiefel_adam.update": (
        lambda: _update(so.stiefel_adam(LR), {"w": jnp.eye(4)},
                        update_params=None),
        [r"params"]),
    "params=None in stiefel_attention.init": (
        lambda: so.stiefel_attention(LR).init(None),
        [r"params", r"None"]),
    "params=None in stiefel_adam.init": (
        lambda: so.stiefel_adam(LR).init(None),
        [r"params"]),
    "selector returning an invalid value": (
        lambda: so.stiefel_attention(LR, frames=lambda path, leaf: (
            "adam" if path == "attn/query/kernel" else None)).init(_tree()),
        [r"attn/query/kernel: the frame selector returned 'adam'"]),
    "mapping entry matching nothing": (
        lambda: so.stiefel_attention(LR, frames=_with(
            **{r"(^|/)q_proj/kernel$": so.FrameSpec()})).init(_tree()),
        [r"q_proj", r"matches no parameter path", r"attn/query/kernel"]),
    "selector selecting nothing (callable)": (
        lambda: so.stiefel_attention(
            LR, frames=lambda path, leaf: None).init(_tree()),
        [r"selects no leaf", r"attn/key/kernel"]),
    "start off the manifold at init": (
        lambda: so.stiefel_attention(LR).init(_off_manifold(1.01)),
        [r"attn/query/kernel", r"\(8, 2, 4\)", r"not orthonormal",
         r"orthonormalize"]),
    "rank-deficient head at init": (
        lambda: so.stiefel_attention(LR, orthonormal_start="project").init(
            _tree(attn__key={"kernel": make_params()["attn"]["key"][
                "kernel"].at[:, 1].set(0.0)})),
        [r"attn/key/kernel", r"\(8, 2, 4\)", r"frame \(1,\)",
         r"rank-deficient"]),
    "start off the manifold (scaled)": (
        lambda: so.check_frames(_off_manifold(1.01)),
        [r"attn/query/kernel", r"\(8, 2, 4\)"]),
    "start off the manifold (Gaussian kernel)": (
        lambda: so.check_frames(_tree(attn__key={"kernel": jax.random.normal(
            jax.random.PRNGKey(9), (D, HEADS, HEAD_DIM))})),
        [r"attn/key/kernel", r"\(8, 2, 4\)"]),
    "start with a NaN frame": (
        lambda: so.check_frames(_off_manifold(np.nan)),
        [r"attn/query/kernel", r"\(8, 2, 4\)", r"nan"]),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_naming_path_and_shape(name):
  fn, patterns = BAD_INPUTS[name]
  with pytest.raises(ValueError) as info:
    fn()
  msg = str(info.value)
  for pat in patterns:
    assert re.search(pat, msg), f"{pat!r} not in {msg!r}"


def test_good_inputs_pass_the_same_checks():
  """The checks are not trigger-happy: the valid versions raise nothing."""
  p = _tree()
  so.check_frames(p)
  so.check_frames(_off_manifold(1.0 + 1e-7))
  state = so.stiefel_attention(LR).init(p)  # validates frames and start
  assert len(frame_adam_states(state)) == 1
  _update(so.stiefel_adam(LR), {"w": so.random_frames(jax.random.PRNGKey(0),
                                                       (8, 8))})  # r = d


@pytest.mark.parametrize("which", ["stiefel_adam", "stiefel_attention"])
def test_zero_gradient_with_eps_zero(which):
  """eps = 0 and a zero gradient (v = 0): a zero step, never NaN, for
  several steps, and a real gradient afterwards still trains."""
  if which == "stiefel_adam":
    params = {"w": so.random_frames(jax.random.PRNGKey(6), (3, 8, 4))}
    tx = so.stiefel_adam(LR, eps=0.0)
  else:
    params = make_params()
    tx = so.stiefel_attention(LR, eps=0.0)
  step = make_step(tx)
  state = tx.init(params)
  p = params
  zeros = jax.tree.map(jnp.zeros_like, params)
  for _ in range(3):
    p, state, upd = step(p, state, zeros)
    assert all_finite(upd) and all_finite(state)
    # The Stiefel step is the retraction's re-polarisation only (rounding).
    assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(upd)) <= 1e-6
  (fs,) = frame_adam_states(state)
  assert all(bool(jnp.all(v == 0)) for v in jax.tree.leaves(fs.nu))
  if which == "stiefel_adam":
    g = {"w": jax.random.normal(jax.random.PRNGKey(7), (3, 8, 4))}
  else:
    g = grad_at(p, 0)
  new, state, _ = step(p, state, g)
  assert all_finite(new) and all_finite(state)
  if which == "stiefel_adam":
    moved = so.arrays.frame_norm(new["w"] - p["w"])
  else:
    moved = jnp.concatenate(list(so.frame_movement(p, new).values()))
  assert float(jnp.min(moved)) > 1e-3
