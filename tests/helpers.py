"""Helpers shared by the test files (plain functions; the fixtures built on
them are in tests/conftest.py).

* Paths and processes: `ROOT`, `run_on_8_devices`, `once_per_session`.
* Inputs from NumPy: `np_frames`, `np_normal`, `frames`, `normal`,
  `default_dtype`, `quadratic`, `haar_reflection`.
* float64 references: `rel`, `np_polar`, `np_polar_batch`, `np_project`.
* Runs and states: `runner` (a jitted lax.scan of steps),
  `frame_adam_states`, `leaves_by_path`, `plain_isometry`,
  `max_deviation`; `TestCase` (chex's, with `self.certificate`).
* Hypothesis: `SETTINGS`, `cases`, `precision`, `haar`, `data`, `np64`,
  `t`, `fro`, `project`.
* Sharded programs: `collectives` (the HLO collectives counter, also run by
  the 8-device child scripts) and `operands`.
* The Flax block: `D`, `HEADS`, `HEAD_DIM`, `LinenBlock`, `block_data`
  (the `linen_params` fixture).

Test inputs come from NumPy so that the tests do not pay a `jax.random`
compilation for every new shape.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import pathlib
import re
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import settings, strategies as st

import stiefel_optax as so

from tests import equivariance

# The repository root (the tests' subprocesses run from it).
ROOT = pathlib.Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Processes.


def run_child(source: str, env: dict | None = None) -> dict:
  """Runs `source` with this interpreter in a child process (environment
  `env`, default this one's), from the repository root (so that it can
  import `tests.helpers`); returns the JSON of its last line
  "RESULT <json>"."""
  proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
  return json.loads(line[-1][len("RESULT "):])


def run_on_8_devices(source: str) -> dict:
  """`run_child` in a child that sees 8 simulated CPU devices (the flag
  must be set before jax starts), lowering into one MLIR context as the
  suite does (the root conftest.py's `share_one_ir_context`)."""
  source = "import conftest; conftest.share_one_ir_context()\n" + source
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  return run_child(source, env)


def spec_entries(spec, ndim: int) -> list:
  """A PartitionSpec as a list, one entry (a mesh axis or None) per axis
  of an ndim array (a one-axis tuple entry as that axis), JSON-able."""
  e = list(spec) + [None] * (ndim - len(tuple(spec)))
  return [x[0] if isinstance(x, tuple) and len(x) == 1 else x for x in e]


def once_per_session(tmp_path_factory, worker_id: str, name: str, make):
  """make() (JSON-able) computed once per test session, also across
  pytest-xdist workers: the first worker computes it under a file lock in
  the session's shared temporary folder, the others read it (the pattern
  of pytest-xdist's documentation, with fcntl for the lock). For module
  fixtures that spawn a costly subprocess (speed, sharding)."""
  if worker_id == "master":
    return make()
  root = tmp_path_factory.getbasetemp().parent
  path = root / f"{name}.json"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if path.is_file():
      return json.loads(path.read_text())
    data = make()
    path.write_text(json.dumps(data))
    return data


# --------------------------------------------------------------------------
# Inputs.


def np_frames(seed, shape, dtype=np.float64):
  """Haar frames of `shape` (..., d, r) from NumPy (sign-corrected QR)."""
  rng = np.random.default_rng(seed)
  q, r = np.linalg.qr(rng.standard_normal(shape))
  q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  return q.astype(dtype)


def np_normal(seed, shape, dtype=np.float64):
  """Standard normal array from NumPy."""
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def default_dtype(dtype=None):
  """float64 inside `jax.enable_x64`, float32 outside (dtype=None)."""
  if dtype is None:
    return jax.dtypes.canonicalize_dtype(np.float64)
  return dtype


def frames(seed, shape, dtype=None):
  """Haar frames as a jnp array (float64 under the `x64` fixture, else
  float32)."""
  return jnp.asarray(np_frames(seed, shape, default_dtype(dtype)))


def normal(seed, shape, dtype=None):
  """Standard normal jnp array (float64 under `x64`, else float32)."""
  return jnp.asarray(np_normal(seed, shape, default_dtype(dtype)))


def quadratic(seed, d=8, batch=(2,), r=4):
  """(A, B) of G(W) = -A W + B, the gradient of -tr(W^T A W)/2 + <B, W>,
  for frames (batch..., d, r)."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((d, d))
  return jnp.asarray(a + a.T), jnp.asarray(rng.standard_normal(batch + (d, r)))


def haar_reflection(seed, d):
  """Q in O(d) with det Q = -1 (a reflection, the harder half of O(d)), as
  a jnp array (`equivariance.haar_orthogonal`)."""
  return jnp.asarray(equivariance.haar_orthogonal(seed, d, det=-1))


# --------------------------------------------------------------------------
# float64 references.


def rel(a, b):
  """||a - b||_F / ||b||_F over the whole array, as a float (float64)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def np_polar(a):
  """polar(A) = U V^T per frame from a float64 SVD A = U S V^T (the
  reference); of a rank-deficient A, the part of its nonzero singular
  values only (below 1e-13 of the largest: zero)."""
  u, s, vt = np.linalg.svd(np.asarray(a, np.float64), full_matrices=False)
  keep = s > s.max(axis=-1, keepdims=True) * 1e-13
  return (u * keep[..., None, :]) @ vt


def np_polar_batch(a):
  """np_polar of each frame of a batch, stacked."""
  return np.stack([np_polar(x) for x in np.asarray(a)])


def np_project(w, g):
  """P_W(G) = G - W sym(W^T G) in NumPy."""
  wtg = np.swapaxes(w, -1, -2) @ g
  return g - w @ (0.5 * (wtg + np.swapaxes(wtg, -1, -2)))


# --------------------------------------------------------------------------
# Runs and states.


def runner(tx, steps=20):
  """jit(w0, a, b, c, h=0.) -> the frames after each of `steps` steps of
  `tx` on the gradients c (-A W + B), a lax.scan; one compilation serves
  every (a, b, c, h). `tx` may be a function of a (traced) hyperparameter
  h."""

  @jax.jit
  def run(w0, a, b, c, h=0.0):
    tx_h = tx(h) if callable(tx) else tx

    def body(carry, _):
      w, state = carry
      u, state = tx_h.update(c * (-a @ w + b), state, w)
      w = optax.apply_updates(w, u)
      return (w, state), w

    _, traj = jax.lax.scan(body, (w0, tx_h.init(w0)), None, length=steps)
    return traj

  return run


def frame_adam_states(state) -> list:
  """Every ScaleByFrameAdamState inside an optimizer state."""
  is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
  return [x for x in jax.tree.leaves(state, is_leaf=is_fs) if is_fs(x)]


def leaves_by_path(tree) -> dict:
  """{path string: leaf} of a tree."""
  return {so.path_str(p): x
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def plain_isometry(frames) -> float:
  """max ||W^T W - I||_F over a list of (d, r) NumPy frames (cut out of a
  model's weights by plain indexing)."""
  return max(np.linalg.norm(w.T @ w - np.eye(w.shape[1])) for w in frames)


def max_deviation(ours: dict, theirs: dict, tol: float) -> float:
  """max over paths of max |ours - theirs| / max |theirs|, each asserted
  <= tol (the path named). Measured in NumPy float64 (exact differences of
  float32 values): jnp would compile four programs per new leaf shape."""
  worst = 0.0
  for path in ours:
    a, b = np64(ours[path]), np64(theirs[path])
    dev = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    worst = max(worst, dev)
    assert dev <= tol, path
  return worst


def train_beside_adamw(step, model, opt_state, ref_state, steps: int,
                       non_frame_leaves, loss_fn, tol: float = 1e-6):
  """Trains `model` and its AdamW twin (the same start) for `steps` calls
  of step(model, opt_state, ref, ref_state) -> the four again; returns
  (model, [loss before, loss after], the worst `max_deviation` of the
  non-frame leaves from the twin's, each step's asserted <= tol)."""
  ref, losses, worst = model, [float(loss_fn(model))], 0.0
  for _ in range(steps):
    model, opt_state, ref, ref_state = step(model, opt_state, ref, ref_state)
    worst = max(worst, max_deviation(non_frame_leaves(model),
                                     non_frame_leaves(ref), tol))
  return model, losses + [float(loss_fn(model))], worst


class TestCase(chex.TestCase):
  """chex.TestCase with the `certificate` fixture as `self.certificate`."""

  @pytest.fixture(autouse=True)
  def _certificate(self, certificate):
    self.certificate = certificate


# --------------------------------------------------------------------------
# Hypothesis: (batch, d, r, dtype) cases and float64 measurements.

# The example count: 50 each (STIEFEL_HYPOTHESIS_EXAMPLES=500 for a longer
# search).
EXAMPLES = int(os.environ.get("STIEFEL_HYPOTHESIS_EXAMPLES", "50"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, print_blob=True)
DTYPES = ("float32", "float64", "bfloat16")

# (batch, d, r): a single column, a square frame (d = r, where the tangent
# space is W times the skew matrices) and a batch of general frames. Every
# new (shape, dtype) costs a compilation of each check, so the pool is
# small and the examples vary the values (frames, gradients, steps, Q,
# scales) instead.
SHAPES = (((), 2, 1), ((), 3, 3), ((2,), 5, 3))


@st.composite
def cases(draw, dtypes=DTYPES):
  """(batch, d, r, dtype, seed)."""
  batch, d, r = draw(st.sampled_from(SHAPES))
  dtype = draw(st.sampled_from(dtypes))
  seed = draw(st.integers(0, 2**32 - 1))
  return batch, d, r, dtype, seed


def precision(dtype):
  """x64 context when needed, the dtype, and its machine epsilon."""
  ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
  return ctx, jnp.dtype(dtype), float(jnp.finfo(jnp.dtype(dtype)).eps)


def haar(rng, shape):
  """Haar frames (float64 NumPy), sign-corrected QR."""
  q, r = np.linalg.qr(rng.standard_normal(shape))
  return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def data(batch, d, r, dtype, seed, n_grads=1):
  """Frames W (rounded to dtype) and n_grads standard normal gradients."""
  rng = np.random.default_rng(seed)
  w = jnp.asarray(haar(rng, batch + (d, r)), dtype)
  gs = [jnp.asarray(rng.standard_normal(batch + (d, r)), dtype)
        for _ in range(n_grads)]
  return w, gs


def np64(x):
  return np.asarray(x).astype(np.float64)


def t(x):
  return np.swapaxes(x, -1, -2)


def fro(x):
  """||x||_F per frame (float64)."""
  return np.linalg.norm(np64(x), axis=(-2, -1))


project = jax.jit(so.geometry.project_tangent)


# --------------------------------------------------------------------------
# Sharded programs.


def collectives(text):
  """{op: [result shape of each instance]} in a compiled HLO module; an
  async pair (op-start / op-done) counts once, a combined op as one tuple."""
  out = {}
  for op in ("all-gather", "all-to-all", "all-reduce", "collective-permute",
             "reduce-scatter"):
    shapes = []
    for m in re.finditer(r"= (\([^=]*?\)|\S+) " + op + r"(-start)?\(", text):
      shapes.append(re.sub(r"\{[^}]*\}", "", m.group(1)))
    out[op] = sorted(shapes)
  return out


def run_sharded(tx, params, shardings, make_grads, jit, reference=None):
  """`tx`'s steps (update, then apply_updates) unsharded on the gradients
  `make_grads()` (or, given `reference` = (gradients, unsharded final
  params) of an earlier run on the same params, not again), then sharded:
  jitted with in/out shardings (p_sh, s_sh) = shardings(initial state) for
  the params and gradients and for the state. Returns (sharded final
  params, final state, the compiled sharded step: the executable that ran,
  reference). `jit` is the caller's jax.jit (its compiler options); the
  state is built by one jitted program, not an eager op per leaf shape.
  For the 8-device child scripts."""
  def step(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state0 = jax.device_get(jit(tx.init)(params))
  if reference is None:
    grads = make_grads()
    ref_p, ref_s, ref_step = params, state0, jit(step)
    for g in grads:
      ref_p, ref_s = ref_step(g, ref_s, ref_p)
    reference = grads, jax.device_get(ref_p)
  grads = reference[0]
  p_sh, s_sh = shardings(state0)
  p, s = jax.device_put(params, p_sh), jax.device_put(state0, s_sh)
  compiled = jit(step, in_shardings=(p_sh, s_sh, p_sh),
                 out_shardings=(p_sh, s_sh)).lower(
                     jax.device_put(grads[0], p_sh), s, p).compile()
  for g in grads:
    p, s = compiled(jax.device_put(g, p_sh), s, p)
  return p, s, compiled, reference


def operands(shapes):
  """{operand shape: count} over all-reduce results; XLA's all-reduce
  combiner groups operands into tuples in ways that vary with its version,
  so the operands are what is pinned."""
  counts = collections.Counter()
  for shape in shapes:
    counts.update(shape.strip("()").split(", "))
  return dict(counts)


# --------------------------------------------------------------------------
# The Flax block (tests/test_specs.py, test_attention.py, test_diagnostics.py,
# families/test_flax.py): d = 16, 2 heads of 8.

D, HEADS, HEAD_DIM = 16, 2, 8


class LinenBlock(nn.Module):
  """Pre-norm transformer block: attention + MLP, linen."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=D, name="attn")(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(2 * D, name="mlp_in")(nn.LayerNorm()(x)))
    return x + nn.Dense(D, name="mlp_out")(h)


def block_data(seed=0, batch=4, seq=6):
  """(x, y) of shape (batch, seq, D) for the block."""
  kx, ky = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kx, (batch, seq, D)),
          jax.random.normal(ky, (batch, seq, D)))
