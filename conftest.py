"""pytest start-up, before anything imports jax.

The suite is compile-bound (hundreds of small XLA programs, each compiled
once), so it compiles for speed, not for fast programs: LLVM's optimisation
passes are skipped for the CPU backend (about a third off the suite) and
XLA's older loop emitters replace its MLIR fusion emitters (40-45 % less
compile time per test file, measured on 13 files), and each program's
LLVM code is generated as one module instead of being split for parallel
codegen (about 30 % less compile CPU on small optimizer steps, 12 % less
CPU on tests/test_aliases.py and tests/test_training_patterns.py: the
suite runs one compile per core already). None changes a
test's meaning: every comparison is made between programs compiled the
same way, and results move at rounding level. Benchmarks do not run under
this.

XLA aborts a process on a flag it does not know (one a later jaxlib drops),
so the flags are first tried in a child process, and any it refuses is left
out; pytest-xdist's workers and the tests' own subprocesses inherit the
result through XLA_FLAGS.

Once jax is imported (`pytest_configure`), each thread of a pytest process
lowers every program into one MLIR context instead of a fresh one per
program (`share_one_ir_context`).
"""

import os
import subprocess
import sys
import threading

_FLAGS = ("--xla_backend_optimization_level=0",
          "--xla_cpu_use_fusion_emitters=false",
          "--xla_cpu_parallel_codegen_split_count=1")
_PROBED = "STIEFEL_OPTAX_TEST_XLA_FLAGS"     # set once the flags are chosen


def _accepted(flags) -> bool:
  env = dict(os.environ, XLA_FLAGS=" ".join(flags))
  probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
  return subprocess.run([sys.executable, "-c", probe], env=env,
                        capture_output=True, timeout=300).returncode == 0


if _PROBED not in os.environ:
  have = os.environ.get("XLA_FLAGS", "").split()
  wanted = have + [f for f in _FLAGS if f not in have]
  if not _accepted(wanted):
    wanted = have + [f for f in _FLAGS
                     if f not in have and _accepted(have + [f])]
  os.environ["XLA_FLAGS"] = " ".join(wanted)
  os.environ[_PROBED] = "1"


def share_one_ir_context() -> bool:
  """Makes jax lower every program of a thread into one MLIR context.

  jax builds a new MLIR context for each program it lowers, loading every
  dialect: about 5 ms each (8.4 s for 1,800 in one worker over six test
  files). The whole-suite saving below is nearly three times what building
  them takes, the rest being their teardown and allocator churn (system time
  fell from 40 to 24 s). The suite lowers about 6,000 programs per run,
  eager single ops included. One context per thread is how MLIR is meant to
  be used: the context only interns types, attributes and dialects, and the
  module text handed to XLA is the same (tests/test_harness.py checks that,
  and the bit-identical resume in a fresh, unpatched process in
  tests/test_checkpoint.py checks the numbers). Measured on the whole suite,
  2 cores, back to back: 580 and 569 CPU-s before, 496 and 498 after
  (304/301 s -> 264/265 s wall), and the largest process's peak memory fell
  from 4.1 to 1.6 GB. Changed: this pytest process, its xdist workers and
  the children that call this too (the 8-device ones,
  `helpers.run_on_8_devices`, and the multi-process cluster's); the other
  children, the benchmarks' command lines and every user run jax as it is.
  If jax moves the function, nothing is changed and the suite is only slower
  (tests/test_harness.py then skips, saying so). Returns whether the patch
  is in place."""
  try:
    from jax._src.interpreters import mlir
  except ImportError:
    return False
  fresh = getattr(mlir, "make_ir_context", None)
  if fresh is None:
    return False
  if hasattr(fresh, "fresh"):          # already the per-thread one
    return True
  local = threading.local()

  def per_thread():
    context = getattr(local, "context", None)
    if context is None:
      context = local.context = fresh()
    return context

  per_thread.fresh = fresh
  mlir.make_ir_context = per_thread
  return True


def pytest_configure(config):
  share_one_ir_context()
