"""A cluster on this machine: 2 processes x 4 CPU devices joined by
`jax.distributed` (localhost, gloo CPU collectives), each holding only its
shards of every parameter (tests/multiprocess_child.py).

The host-side entry points (tx.init's start check through linen's
`TrainState.create` and `nnx.Optimizer`, `check_frames`,
`frame_isometry_errors`, `max_isometry_error`, `frame_movement`,
`orthonormalize`, `state_shardings`) must work on arrays no process holds
whole, and reach the same decision on every process: a bad start raises
the same error on both (a process that raised alone would leave the other
waiting in a collective). Layouts: heads split across the processes, FSDP
(d split), data x model. The nnx model trains by Flax NNX's own sharding
recipe as a user writes it (kernels' logical names, `jax.make_mesh`'s
default mesh, Explicit axes in jax 0.10, a plain `nnx.Optimizer`): its
state is split as its kernels. The trained parameters equal, to rounding,
those of the same script run as one process of 8 devices, saved in
tests/multiprocess_reference.npz by

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m tests.multiprocess_child /tmp/ref
    cp /tmp/ref/params.npz tests/multiprocess_reference.npz

(a numerics change that moves sharded results beyond rounding must remake
it). Both children are bounded by a timeout and killed, by their own
handles, if they outlive it.

Before the fix of issue 41 item 3 both children failed at tx.init:
`checks.check_start` fetched per-frame statistics with np.asarray
("Fetching value for `jax.Array` that spans non-addressable devices").
The last two tests run the cluster's reading path on one process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import stiefel_optax as so
from stiefel_optax import checks

from tests.helpers import ROOT, frames

# Each child takes about 16 s of CPU (2 x 4 devices, 3 layouts): about 20 s
# on an idle 2-core machine, more when the cores are shared.
TIMEOUT_S = 300
REFERENCE = ROOT / "tests" / "multiprocess_reference.npz"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_cluster(out, nproc: int = 2) -> None:
  """Runs the child as `nproc` processes of 4 CPU devices each; fails the
  test, with every child's stderr, unless all exit 0 within TIMEOUT_S. Once
  one fails the others are killed (they would wait for it in a collective
  until the timeout)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4"
  port, procs, logs, late = free_port(), [], [], ""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for i in range(nproc):
      logs.append(open(out / f"stderr_{i}.txt", "w+"))
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "tests.multiprocess_child", str(out),
           str(i), str(nproc), str(port)],
          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=logs[-1]))
    while True:
      codes = [p.poll() for p in procs]
      if None not in codes or any(c not in (None, 0) for c in codes):
        break
      if time.monotonic() > deadline:
        late = f"timed out after {TIMEOUT_S} s\n"
        break
      time.sleep(0.2)
  finally:
    for p in procs:          # only the processes this test started
      if p.poll() is None:
        p.kill()
        p.wait()
  codes, errs = [p.returncode for p in procs], []
  for i, f in enumerate(logs):
    f.seek(0)
    errs.append(f"--- process {i} (exit {codes[i]}):\n{f.read()[-3000:]}")
    f.close()
  assert codes == [0] * nproc, late + "\n".join(errs)


def test_two_processes_decide_alike_and_train_as_one(tmp_path):
  run_cluster(tmp_path)
  results = [json.loads((tmp_path / f"result_{i}.json").read_text())
             for i in range(2)]
  # One decision, one message, on every process.
  assert results[0] == results[1]
  for layout, r in results[0].items():
    assert r["check_frames"] is None and r["create"] is None, layout
    assert r["iso"] == [[8], True] and r["max_iso_fixed"], layout
    assert r["max_iso_bad"] == pytest.approx(np.sqrt(18), abs=1e-3)
    assert r["moved"] == [0.0, pytest.approx(np.sqrt(2), abs=1e-3)]
    assert "key/kernel (shape (16, 8, 2))" in r["check_frames_bad"]
    assert re.match(r"key/kernel: shape \(16, 8, 2\).*not orthonormal",
                    r["create_bad"])
    assert re.match(r"query/kernel: .*frame \(5,\) is rank-deficient",
                    r["init_deficient"])
    assert re.match(r"check_orthonormal_start: parameter \['w'\] .* not"
                    " orthonormal", r["adam_init_bad"])
  # nnx.Optimizer, plain, on jax.make_mesh's default mesh (Explicit axes in
  # jax 0.10): the state is split as its kernel (mu (heads, d, kv)).
  for layout, mu in (("heads", ["model", None, None]),
                     ("fsdp", [None, "model", None]),
                     ("data_model", ["model", None, None])):
    nnx_state = results[0][layout]["nnx"]
    assert nnx_state["mu"] == mu, (layout, nnx_state)
    assert nnx_state["nu"] == mu[:1], (layout, nnx_state)
    if jax.make_mesh((1,), ("x",)).axis_types == (AxisType.Explicit,):
      assert nnx_state["axis_types"] == ["Explicit"] * 2, nnx_state
  assert results[0]["heads"]["restored"] is True   # orbax, bit for bit
  # The cluster's training is the single process's, to rounding.
  got, want = np.load(tmp_path / "params.npz"), np.load(REFERENCE)
  assert sorted(got.files) == sorted(want.files)
  for k in want.files:
    np.testing.assert_allclose(got[k], want[k], rtol=0,
                               atol=1e-5 * np.abs(want[k]).max(), err_msg=k)


# --------------------------------------------------------------------------
# The same code on one process: what the cluster reads is what one process
# reads, and an array a process holds whole takes no collective.


def test_arrays_held_whole_are_read_as_they_are():
  x = jnp.arange(6.0).reshape(2, 3)
  assert not checks.spans_processes(x) and checks.replicated(x) is x
  np.testing.assert_array_equal(checks.host_value(x), np.asarray(x))
  for other in (np.ones(3), jax.ShapeDtypeStruct((3,), jnp.float32)):
    assert not checks.spans_processes(other)

  @jax.jit
  def traced(t):
    assert not checks.spans_processes(t) and checks.replicated(t) is t
    return t

  traced(x)


def test_the_cluster_reading_gives_the_same_answers(monkeypatch):
  """Every entry point with each array taken for a global one (read through
  the all-gather and the replicated copy) answers as with the plain reads:
  values bit for bit, the same errors naming the leaf."""
  mesh = jax.make_mesh((1,), ("x",))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P()))
  w = put(jnp.transpose(frames(70, (2, 16, 4)), (1, 0, 2)))
  params = {"attn": {"query": {"kernel": w}, "key": {"kernel": 2.0 * w}}}
  deficient = {"attn": {"query": {"kernel": w.at[:, 1, 0].set(0.0)}}}

  def answers():
    return {
        "iso": so.frame_isometry_errors(params),
        "max": so.max_isometry_error(params),
        "moved": so.frame_movement(params, so.orthonormalize(params)),
        "check_frames": error_text(lambda: so.check_frames(params)),
        "init": error_text(lambda: so.stiefel_attention(1e-2).init(params)),
        "deficient": error_text(lambda: so.stiefel_attention(
            1e-2, orthonormal_start="project").init(deficient)),
        "adam": error_text(lambda: so.stiefel_adam(1e-2).init(2.0 * w[:, 0])),
    }

  plain = answers()
  monkeypatch.setattr(checks, "spans_processes", checks.is_concrete)
  cluster = answers()
  assert "attn/key/kernel" in plain["check_frames"]
  assert "attn/key/kernel: shape (16, 2, 4)" in plain["init"]
  assert "rank-deficient" in plain["deficient"]
  assert "not orthonormal" in plain["adam"]
  assert jax.tree.structure(plain) == jax.tree.structure(cluster)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(cluster)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def error_text(fn):
  try:
    fn()
  except ValueError as err:
    return str(err)
  return None
