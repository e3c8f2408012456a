"""Table 7: the step's products as einsums over the kernel's own axes (the
native layout), against the frame view the library uses.

>>> transposes("%t = f32[3,2]{1,0} transpose(f32[2,3]{1,0} %x), dims={1,0}")
1
"""

from __future__ import annotations

import re
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.speed import timing
from stiefel_optax import geometry

NATIVE = "native layout: einsums over (d, heads, r), momentum in kernel layout"
VIEW = "frame view: (heads, d, r) views, momentum in view layout"
# GPT-2 small's 24 Q/K kernels (d, heads, head_dim).
LAYOUT_WORKLOAD = (24, 768, 12, 64)


def step_products(w, g, m, gram, times):
  """The five products of `update.floor_products`, for one layout's `gram`
  (W^T G per head) and `times` (frame times an r x r matrix per head);
  returns the step and the new momentum."""
  m_new = m - times(w, gram(w, g) + gram(w, m))
  a = w + 1e-3 * m_new
  return times(a, gram(a, a)) - w, m_new


def native_step(w, g, m):
  """On (d, heads, r) kernels: nothing is transposed in this program."""
  gram = lambda a, b: jnp.einsum("dhr,dhs->hrs", a, b)
  times = lambda a, s: jnp.einsum("dhr,hrs->dhs", a, s)
  return step_products(w, g, m, gram, times)


def view_step(w, g, m):
  """As the library does it: W and G viewed as (heads, d, r) frames, the
  momentum kept in that view, the step put back in the kernel's layout."""
  view = lambda x: jnp.swapaxes(x, 0, 1)
  u, m_new = step_products(view(w), view(g), m, geometry.gram,
                           lambda a, s: a @ s)
  return view(u), m_new


def transposes(compiled_text: str) -> int:
  """Transpose and copy instructions in an optimized HLO module's text
  (inside fusions included): the data movement the layout costs."""
  return len(re.findall(r"\b(?:transpose|copy)\(", compiled_text))


def layout_comparison(leaves: int, d: int, heads: int, r: int, iters: int
                      ) -> Dict[str, Any]:
  """The step's five products on `leaves` (d, heads, r) kernels, in the
  native layout and through the frame view, alternated: ms and the
  transposes XLA's optimized program holds for each (item 1 of the speed
  issue: does computing in the kernel's layout remove the copies?)."""
  rng = np.random.default_rng(0)
  w, g = ([jnp.asarray(rng.standard_normal((d, heads, r)), jnp.float32)
           for _ in range(leaves)] for _ in "wg")
  m_view = [jnp.swapaxes(x, 0, 1) for x in g]
  step = {NATIVE: (native_step, g), VIEW: (view_step, m_view)}
  fns, count = {}, {}
  for name, (fn, m) in step.items():
    # One program for all leaves, each leaf its own products (as the
    # library's per-leaf update).
    per_leaf = jax.jit(lambda w, g, m, fn=fn: jax.tree.map(fn, w, g, m))
    count[name] = transposes(per_leaf.lower(w, g, m).compile().as_text())
    fns[name] = timing.call(per_leaf, w, g, m)
  t = timing.median_times(fns, iters)
  return {"leaves": leaves, "kernel": [d, heads, r],
          "backend": jax.default_backend(),
          "rows": [{"layout": name, "ms": 1e3 * t[name],
                    "transposes": count[name]} for name in step],
          "native_over_view": t[NATIVE] / t[VIEW]}
