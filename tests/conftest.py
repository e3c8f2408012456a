"""Shared fixtures: float64 scope, jit/no-jit variants, certificate record.

float64 is enabled per test through the thread-local `jax.enable_x64`
context manager, so no test changes the global `jax_enable_x64` flag that
the other test modules (float32) rely on.

Transform tests written as `chex.TestCase` methods use
`chex.variants(with_jit=True, without_jit=True)` (`self.variant`) and get
these fixtures through `pytest.mark.usefixtures("x64")` and an autouse
method fixture (see tests/test_transforms.py); the `variant` fixture below
is the same pair for plain pytest functions.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

def run_on_8_devices(source: str) -> dict:
  """Runs `source` with this interpreter in a child process that sees 8
  simulated CPU devices (the flag must be set before jax starts), from the
  repository root; returns the JSON of its last line "RESULT <json>"."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", source], cwd=root, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
  return json.loads(line[-1][len("RESULT "):])


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


# Certificates: name -> largest measured relative error (float64 unless the
# name says otherwise). Printed at the end of the session (`pytest -q -s` or
# see the terminal summary).
CERTIFICATES = collections.defaultdict(float)


def record(name: str, value) -> float:
  """Records a measured error under `name` (keeps the maximum) and returns
  it as a float."""
  value = float(value)
  CERTIFICATES[name] = max(CERTIFICATES[name], value)
  return value


@pytest.fixture
def certificate(request):
  """The `record(name, value)` function; the value also travels with the
  test's report, so that the summary holds it when pytest-xdist runs the
  test in a worker process."""
  def rec(name, value):
    value = record(name, value)
    request.node.user_properties.append((f"certificate:{name}", value))
    return value
  return rec


def pytest_runtest_logreport(report):
  for key, value in getattr(report, "user_properties", ()):
    if isinstance(key, str) and key.startswith("certificate:"):
      record(key[len("certificate:"):], value)


def pytest_terminal_summary(terminalreporter):
  if not CERTIFICATES:
    return
  terminalreporter.section("stiefel_optax certificates (max measured error)")
  for name in sorted(CERTIFICATES):
    terminalreporter.write_line(f"{name:<58s} {CERTIFICATES[name]:.3e}")


@pytest.fixture
def x64():
  """Runs the test with 64-bit types enabled (restored afterwards)."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(params=[True, False], ids=["jit", "nojit"])
def variant(request):
  """`jax.jit` or the identity: run each transform with and without jit
  (for plain pytest functions; `chex.TestCase` methods use chex.variants)."""
  return jax.jit if request.param else (lambda f, **_: f)


def np_frames(seed, shape, dtype=np.float64):
  """Haar frames of `shape` (..., d, r) from NumPy (sign-corrected QR).

  Test inputs come from NumPy so that the tests do not pay a
  `jax.random` compilation for every new shape.
  """
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


@pytest.fixture
def frames():
  """`frames(seed, shape, dtype=None)` -> jnp array of Haar frames (float64
  under the `x64` fixture, else float32)."""
  return lambda seed, shape, dtype=None: jax.numpy.asarray(
      np_frames(seed, shape, default_dtype(dtype)))


@pytest.fixture
def normal():
  """`normal(seed, shape, dtype=None)` -> jnp standard normal array."""
  return lambda seed, shape, dtype=None: jax.numpy.asarray(
      np_normal(seed, shape, default_dtype(dtype)))
