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
"""

import os
import subprocess
import sys

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
