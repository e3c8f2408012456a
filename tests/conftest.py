"""Shared fixtures: float64 scope, jit/no-jit variants, certificate record,
inputs (`frames`, `normal`) and the Flax block's params (`linen_params`).
The plain functions they use, and the tests import, are in tests/helpers.py.

float64 is enabled per test through the thread-local `jax.enable_x64`
context manager, so no test changes the global `jax_enable_x64` flag that
the other test modules (float32) rely on.

Transform tests written as `chex.TestCase` methods use
`chex.variants(with_jit=True, without_jit=True)` (`self.variant`) and get
these fixtures through `pytest.mark.usefixtures("x64")` and an autouse
method fixture (`helpers.TestCase`, see tests/test_transforms.py); the
`variant` fixture below is the same pair for plain pytest functions.
"""

from __future__ import annotations

import collections

import jax
import pytest

import stiefel_optax as so
from tests import helpers

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


@pytest.fixture
def frames():
  """`frames(seed, shape, dtype=None)` -> jnp array of Haar frames (float64
  under the `x64` fixture, else float32)."""
  return helpers.frames


@pytest.fixture
def normal():
  """`normal(seed, shape, dtype=None)` -> jnp standard normal array."""
  return helpers.normal


@pytest.fixture(scope="module")
def linen_params():
  """The Flax block's (`helpers.LinenBlock`) params, orthonormalized."""
  x, _ = helpers.block_data()
  return jax.jit(lambda k: so.orthonormalize(
      helpers.LinenBlock().init(k, x)["params"]))(jax.random.key(1))
