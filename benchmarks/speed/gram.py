"""Table 8: the Gram product A^T B in its two forms, one batched call each.

`arrays.gram` picks its form by platform: one contraction over d
(`_gram_contraction`, GPU and TPU) or, on CPU, A^T materialised and a plain
batched matmul (`_gram_cpu`). This table times both on the frames of the
peer workloads and of GPT-2 small, alternated, so that the CPU choice is
measured where it is made.
"""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.speed import timing
from stiefel_optax import arrays

# (frames, d, r): workload B stacked (8 leaves of 4 frames) and one of its
# leaves; one GPT-2 small Q/K kernel (12 heads of 768 x 64).
GRAM_SHAPES = ((32, 64, 16), (4, 64, 16), (12, 768, 64))
GRAM_QUICK = ((4, 16, 4),)
FORMS = {"contraction (einsum over d)": arrays._gram_contraction,  # pylint: disable=protected-access
         "A^T materialised, batched matmul": arrays._gram_cpu}  # pylint: disable=protected-access


# The calls take 0.01-1 ms, where one call's dispatch and a stray
# scheduling delay weigh as much as the product: ten times the other
# tables' alternated calls (still under a second in all).
CALLS_PER_ITER = 10


def gram_table(shapes, iters: int) -> Dict[str, Any]:
  """Median ms of W^T G per form for each (frames, d, r) in `shapes`
  (CALLS_PER_ITER * iters alternated calls each), and contraction / CPU
  form; `arrays.gram` uses the second on CPU."""
  rng = np.random.default_rng(0)
  calls = CALLS_PER_ITER * iters
  first, second = FORMS
  rows = []
  for shape in shapes:
    w, g = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for _ in "wg")
    t = timing.median_times(
        {name: timing.call(jax.jit(fn), w, g) for name, fn in FORMS.items()},
        calls)
    rows.append({"shape": list(shape),
                 "ms": {name: 1e3 * t[name] for name in FORMS},
                 "contraction_over_cpu_form": t[first] / t[second]})
  return {"backend": jax.default_backend(), "calls": calls, "rows": rows}
