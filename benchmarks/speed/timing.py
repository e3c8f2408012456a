"""How every table times its functions: medians of alternated calls.

>>> import jax.numpy as jnp
>>> cpu = {}
>>> t = median_times({"a": call(jnp.add, 1.0, 2.0), "b": call(jnp.ones, 3)},
...                  iters=3, cpu=cpu)
>>> sorted(t), sorted(cpu), all(v > 0 for v in t.values())
(['a', 'b'], ['a', 'b'], True)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional

import jax


def median_times(fns: Dict[str, Callable[[], Any]], iters: int,
                 warmup: int = 2, cpu: Optional[dict] = None
                 ) -> Dict[str, float]:
  """Median wall-clock seconds per call of each zero-argument jitted closure.

  Each function is called `warmup` times first (compilation), then the
  functions are called in alternation `iters` times each, every call timed
  to `jax.block_until_ready` of its result. If `cpu` is a dict it receives
  the median process CPU seconds per call (all threads): on a machine that
  other jobs share, wall time includes waiting for a core and CPU time does
  not, so CPU-time ratios are the steadier measure of the work done.
  """
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  wall = {name: [] for name in fns}
  proc = {name: [] for name in fns}
  for _ in range(iters):
    for name, fn in fns.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      proc[name].append(time.process_time() - start_cpu)
      wall[name].append(time.perf_counter() - start)
  if cpu is not None:
    cpu.update({name: statistics.median(s) for name, s in proc.items()})
  return {name: statistics.median(s) for name, s in wall.items()}


def call(fn, *args) -> Callable[[], Any]:
  """fn(*args) as a zero-argument closure, what `median_times` times."""
  return lambda: fn(*args)
