"""pytest start-up, before anything imports jax.

The suite is compile-bound (hundreds of small XLA programs, each compiled
once): skipping LLVM's optimisation passes for the CPU backend cuts its time
by about a third and changes no test's meaning (every comparison is made
between programs compiled the same way). Benchmarks do not run under this.
"""

import os

_FLAG = "--xla_backend_optimization_level=0"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
