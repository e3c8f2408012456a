"""Tables 1 and 2: one optimizer update on a parameter tree, where its time
goes, and its floor (the d x r x r products any Stiefel step needs)."""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp

import stiefel_optax as so
from benchmarks.speed import arms, timing, trees
from stiefel_optax import geometry

FLOOR = "floor: 5 products d*r*r per frame"


def floor_products(w, g, m):
  """Five batched d x r x r products, the arithmetic any Stiefel step needs:
  W^T G, W^T m, W S (projection of the momentum mix), (W + xi)^T (W + xi)
  and (W + xi) Z (the retraction)."""
  b = geometry.gram(w, g)
  c = geometry.gram(w, m)
  m_new = m - w @ (b + c)
  a = w + 1e-3 * m_new
  return a @ geometry.gram(a)


def jit_update(tx, params, grads):
  """A jitted update and a state after one step (so the moments are
  non-zero)."""
  update = jax.jit(tx.update)
  state = tx.init(params)
  _, state = update(grads, state, params)
  return update, state


def update_comparison(cfg: trees.TreeConfig, iters: int,
                      profile: bool = False) -> Dict[str, Any]:
  """One update of each optimizer on the tree of `cfg`, alternated.

  With `profile`, the parts of the update are timed in the same alternation:
  AdamW on the Q/K kernels and on the other leaves, `stiefel_adam` on the
  Q/K frames alone, and the floor (`floor_products` on the same frames).
  """
  params = trees.param_tree(cfg)
  grads = trees.gradients(params)
  qk, rest = trees.split_qk(params)
  gqk, grest = trees.split_qk(grads)
  parts = {name: (tx, params, grads) for name, tx in arms.optimizers().items()}
  if profile:
    view = so.FrameSpec(rows=0, cols=2)       # (d, heads, head_dim)
    qk_frames = {k: so.to_frames(x, view) for k, x in qk.items()}
    gqk_frames = {k: so.to_frames(x, view) for k, x in gqk.items()}
    parts.update({
        "adamw, other leaves": (arms.optimizers()["adamw"], rest, grest),
        "adamw, Q/K kernels": (arms.optimizers()["adamw"], qk, gqk),
        "stiefel_adam, Q/K frames (frame view given)": (
            so.stiefel_adam(1e-3), qk_frames, gqk_frames)})
  fns = {}
  for name, (tx, p, g) in parts.items():
    update, state = jit_update(tx, p, g)
    fns[name] = timing.call(update, g, state, p)
  if profile:
    w = jnp.concatenate(list(qk_frames.values()))
    g = jnp.concatenate(list(gqk_frames.values()))
    fns[FLOOR] = timing.call(jax.jit(floor_products), w, g, g)
  c = {}
  t = timing.median_times(fns, iters, cpu=c)
  res = {"tree": cfg.name,
         "params": sum(x.size for x in jax.tree.leaves(params)),
         "qk_params": sum(x.size for x in qk.values()),
         "qk_frames": sum(x.size // (cfg.d * cfg.head_dim)
                          for x in qk.values()),
         **arms.versus_adamw(t, c),
         **arms.stacked_ratios(t)}
  if profile:
    frames, d, r = w.shape
    floor = t["adamw, other leaves"] + t[FLOOR]
    floor_cpu = c["adamw, other leaves"] + c[FLOOR]
    res["floor_ms"] = 1e3 * floor
    res["floor_ratio"] = t["stiefel_attention"] / floor
    res["floor_cpu_ratio"] = c["stiefel_attention"] / floor_cpu
    res["stacked_floor_ratio"] = t[arms.STACKED] / floor
    res["auto_floor_ratio"] = t[arms.AUTO] / floor
    res["profile"] = {
        "frames": int(frames), "d": int(d), "r": int(r),
        "parts_ms": {k: 1e3 * v for k, v in t.items()},
        "parts_cpu_ms": {k: 1e3 * v for k, v in c.items()},
        "floor_gflops_per_s": 5 * 2 * frames * d * r * r / t[FLOOR] / 1e9}
  return res
