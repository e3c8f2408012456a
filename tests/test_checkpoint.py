"""Checkpoint and resume with orbax: bit-identical trajectories.

A small Flax linen model (MultiHeadDotProductAttention, 2 heads of 4 on
d = 8, then a Dense classifier) is trained with `stiefel_attention`. The run
is saved with orbax mid-way, restored in a FRESH python process (this file
run as a script), continued there, and compared leaf by leaf, bit for bit,
with the uninterrupted run.

The optimizer state of `optax.partition` holds `MaskedNode` and
`EmptyState` leaves (empty NamedTuples), which orbax does not store: a
restore without a target returns dicts with None in their place. `restore`
below restores against the abstract tree of `tx.init(params)`, which gives
back the exact state structure.

    python tests/test_checkpoint.py resume CKPT_DIR OUT.npz
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import stiefel_optax as so

TOTAL, SAVE_AT = 8, 4
D, HEADS, SEQ, BATCH, CLASSES = 8, 2, 5, 4, 3


class Model(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=D,
        kernel_init=nn.initializers.normal(0.3))(x)
    return nn.Dense(CLASSES)(jnp.mean(h, axis=1))


MODEL = Model()
TX = so.stiefel_attention(3e-2)
# Labels from a fixed random linear rule, so that the model can learn them.
RULE = jax.random.normal(jax.random.PRNGKey(123), (D, CLASSES))


# Jitted (one compiled program each, in this process and in the fresh one,
# instead of one per operation): both processes run the same programs, so
# the comparison stays bit for bit.
@jax.jit
def batch(seed, t):
  x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(seed), t),
                        (BATCH, SEQ, D))
  return x, jnp.argmax(jnp.mean(x, axis=1) @ RULE, axis=-1)


@jax.jit
def _start(seed):
  x, _ = batch(seed, 10_000)  # an input for shapes, not a training batch
  return so.orthonormalize(MODEL.init(jax.random.PRNGKey(seed), x)["params"])


def setup(seed):
  """(params, opt_state) from the seed; frames orthonormalised (TX.init on
  the concrete params: it checks that they are)."""
  params = _start(seed)
  return params, TX.init(params)


def loss_fn(params, x, y):
  logits = MODEL.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


eval_loss = jax.jit(loss_fn)


@jax.jit
def step(params, state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
  updates, state = TX.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


def train(seed, params, state, start, stop):
  losses = []
  for t in range(start, stop):
    params, state, loss = step(params, state, *batch(seed, t))
    losses.append(loss)
  return params, state, np.asarray(losses)


def save(path, params, state, step):
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": params, "opt_state": state, "step": step})


def restore(path, tx, params_like):
  """Restores against the abstract tree of tx.init: MaskedNode/EmptyState
  leaves, NamedTuple states and dtypes come back exactly. params_like:
  arrays or their shapes and dtypes (nothing is computed for the target:
  jax.eval_shape)."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      {"params": params_like,
       "opt_state": jax.eval_shape(tx.init, params_like)})
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(path, {**abstract, "step": 0})


def library_sources():
  """{file name: bytes} of the stiefel_optax package as this process found
  it when it imported it."""
  root = os.path.dirname(so.__file__)
  out = {}
  for name in sorted(os.listdir(root)):
    if name.endswith(".py"):
      with open(os.path.join(root, name), "rb") as f:
        out[name] = f.read()
  return out


def library_hash(sources):
  h = hashlib.sha256()
  for name, text in sorted(sources.items()):
    h.update(name.encode() + text)
  return h.hexdigest()


# Read at import: a resume can only be bit-identical if both processes run
# the same code, so the fresh process imports this snapshot (the sources
# may be edited while the suite runs).
LIBRARY = library_sources()
LIBRARY_HASH = library_hash(LIBRARY)


def flat(tree):
  """[(path, leaf)] of every array leaf (MaskedNode/EmptyState hold none)."""
  return [(jax.tree_util.keystr(p), np.asarray(x))
          for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def assert_bitwise_equal(a, b):
  fa, fb = flat(a), flat(b)
  assert [p for p, _ in fa] == [p for p, _ in fb]
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (p, x), (_, y) in zip(fa, fb):
    assert x.dtype == y.dtype and x.shape == y.shape, p
    assert x.tobytes() == y.tobytes(), f"{p} differs"


def resume_main(ckpt_dir, out, seed=0):
  """Fresh process: restore, continue to TOTAL, write leaves to out.npz."""
  params_like = jax.eval_shape(_start, seed)   # shapes only: all is restored
  restored = restore(ckpt_dir, TX, params_like)
  params, state, losses = train(seed, restored["params"],
                                restored["opt_state"], int(restored["step"]),
                                TOTAL)
  leaves = flat({"params": params, "opt_state": state})
  np.savez(out, losses=losses, start=int(restored["step"]),
           library=LIBRARY_HASH, library_file=so.__file__,
           paths=np.array([p for p, _ in leaves]),
           **{f"leaf{i}": x for i, (_, x) in enumerate(leaves)})


# ---------------------------------------------------------------------------
# Tests.


def run_full(seed):
  return train(seed, *setup(seed), 0, TOTAL)


def test_same_seed_same_result_and_seed_matters():
  a = run_full(0)
  b = run_full(0)
  assert_bitwise_equal(a[:2], b[:2])
  np.testing.assert_array_equal(a[2], b[2])
  c = run_full(1)
  assert not np.array_equal(flat(a[0])[0][1], flat(c[0])[0][1])
  # It trains: the loss on held-out batches falls.
  start = setup(0)[0]
  held_out = [batch(7, t) for t in range(4)]
  before = np.mean([eval_loss(start, *xy) for xy in held_out])
  after = np.mean([eval_loss(a[0], *xy) for xy in held_out])
  assert after < before


def test_restore_needs_and_uses_the_target_structure(tmp_path):
  params, state, _ = train(0, *setup(0), 0, 2)
  path = str(tmp_path / "ckpt")
  save(path, params, state, 2)
  restored = restore(path, TX, setup(0)[0])
  assert int(restored["step"]) == 2
  assert_bitwise_equal(restored["params"], params)
  assert_bitwise_equal(restored["opt_state"], state)
  # MaskedNode / EmptyState are where the live state has them.
  def kinds(tree):
    return sorted(type(x).__name__ for x in jax.tree.leaves(
        tree, is_leaf=lambda x: isinstance(x, (optax.MaskedNode,
                                               optax.EmptyState))))
  assert kinds(restored["opt_state"]) == kinds(state)
  assert "MaskedNode" in kinds(state) and "EmptyState" in kinds(state)
  # Without the target the structure is lost (why restore passes one).
  with ocp.StandardCheckpointer() as ckpt:
    raw = ckpt.restore(path)
  assert jax.tree.structure(raw["opt_state"]) != jax.tree.structure(state)


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
  seed = 0
  full_params, full_state, full_losses = run_full(seed)
  params, state, first = train(seed, *setup(seed), 0, SAVE_AT)
  np.testing.assert_array_equal(first, full_losses[:SAVE_AT])
  ckpt_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "resumed.npz")
  save(ckpt_dir, params, state, SAVE_AT)

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  lib = tmp_path / "lib"
  (lib / "stiefel_optax").mkdir(parents=True)
  for name, text in LIBRARY.items():
    (lib / "stiefel_optax" / name).write_bytes(text)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(lib), repo] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "resume", ckpt_dir, out],
      cwd=repo, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]

  res = np.load(out)
  assert str(res["library_file"]).startswith(str(lib))
  assert str(res["library"]) == LIBRARY_HASH
  assert int(res["start"]) == SAVE_AT
  np.testing.assert_array_equal(res["losses"], full_losses[SAVE_AT:])
  want = flat({"params": full_params, "opt_state": full_state})
  assert list(res["paths"]) == [p for p, _ in want]
  for i, (p, x) in enumerate(want):
    got = res[f"leaf{i}"]
    assert got.dtype == x.dtype and got.tobytes() == x.tobytes(), p
  # The resumed run really moved on from the checkpoint.
  assert not np.array_equal(flat(params)[0][1], flat(full_params)[0][1])
  assert float(so.max_isometry_error(full_params)) <= 1e-5


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "resume":
    resume_main(sys.argv[2], sys.argv[3])
  else:
    sys.exit(f"usage: {sys.argv[0]} resume CKPT_DIR OUT.npz")
