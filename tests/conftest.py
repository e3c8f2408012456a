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
import os

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
def library_imports(tmp_path_factory, worker_id):
  """{"import": the top-level modules a fresh process holds after `import
  stiefel_optax`, "select": after it also selects frames} (one child per
  session): what the library imports of the optional frameworks."""
  code = ("import sys, json, stiefel_optax, jax.numpy as jnp; "
          "top = lambda: sorted({m.split('.')[0] for m in sys.modules}); "
          "a = top(); "
          "stiefel_optax.selected_frames({'a/query/kernel': jnp.zeros((8, 2, 4))}); "
          "print('RESULT ' + json.dumps({'import': a, 'select': top()}))")
  return helpers.once_per_session(tmp_path_factory, worker_id,
                                  "library_imports",
                                  lambda: helpers.run_child(code))


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


# --------------------------------------------------------------------------
# Order: the costliest modules first.
#
# pytest-xdist's worksteal gives each worker a contiguous half of the
# collection and, when one runs dry, moves half of the other's queue from
# its tail. The wall time is then the larger half unless the last tests are
# short: a 60-second test near the end (the alphabetical place of
# test_multiprocess.py, test_sharding.py) runs alone while the other worker
# idles. So the modules below, the slowest in a `--durations=60` run of the
# whole suite (2026-12-07, 2 cores; seconds of setup + call of the module's
# listed tests, under load, used only to rank), run first, costliest first;
# the rest keep their place after them and the doctests of stiefel_optax/
# stay last. A module moves whole, its tests in their order: a module split
# apart would set its module fixtures up twice, and a once-per-session
# child (`helpers.once_per_session`) read by tests on both workers would
# keep one worker waiting on the other's lock. The order changes no test:
# each is independent of what ran before it (pytest-xdist already runs them
# in any split); `-k` and node-id selections reorder only what they select.
MODULE_COST_S = {
    "tests/test_readme_snippets.py": 170,   # docs/families.md's blocks
    "tests/benchmarks/test_speed.py": 120,  # `--quick` child + peer CLI runs
    "tests/benchmarks/test_robustness.py": 95,
    "tests/benchmarks/test_lm.py": 85,
    "tests/families/test_penzai.py": 75,
    "tests/test_multiprocess.py": 67,       # 2 processes at once
    "tests/test_sharded_recipes.py": 64,     # 6 recipes, one child
    "tests/families/test_haliax.py": 60,
    "tests/test_sharding.py": 59,
    "tests/test_training_patterns.py": 58,
    "tests/test_attention.py": 50,
    "tests/test_docs.py": 41,               # the Sphinx build
    "tests/test_specs.py": 39,
    "tests/test_sharded_step.py": 37,
    "tests/test_explicit_mesh.py": 35,
    "tests/families/test_equinox.py": 33,
    "tests/test_checkpoint.py": 31,
    "tests/test_notebooks.py": 30,
    "tests/families/test_layouts.py": 28,
    "tests/test_partition.py": 25,
    "tests/families/test_flax.py": 24,
    "tests/test_muon.py": 15,
    "tests/benchmarks/test_cifar_patches.py": 14,
    "tests/test_propositions.py": 12,
    "tests/test_bound.py": 12,
    "tests/test_diagnostics.py": 11,
    "stiefel_optax/attention.py": 11,       # doctests
    "tests/benchmarks/test_models.py": 10,
    "tests/test_reliability.py": 10,
    "stiefel_optax/transforms.py": 9,       # doctests
}


def pytest_collection_modifyitems(config, items):
  """The costliest modules (`MODULE_COST_S`) first, each whole; a stable
  sort, so every other item keeps its order (deterministic: every
  pytest-xdist worker must collect the same order)."""
  root = str(config.rootpath)

  def module(item):
    path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
    return MODULE_COST_S.get(path, 0)

  items[:] = sorted(items, key=lambda item: -module(item))
