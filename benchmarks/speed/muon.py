"""Table 9: what a Muon user pays for the constraint. `stiefel_muon`
(manifold Muon: the tangent msign step, then the polar retraction) against
the optimizer its users would otherwise pick, `optax.contrib.muon` on the
same per-head matrices (`benchmarks.training.per_head_muon`, unconstrained),
and `optax.adamw`: one jitted update plus apply on the peer workloads'
frames (A, B), and one training step of table 3's language model (Muon on
the per-head Q/K views that `frame_partition` hands it, AdamW elsewhere),
alternated; medians, and the operations in each compiled program.
"""

from __future__ import annotations

from typing import Any, Dict

import optax

import stiefel_optax as so
from benchmarks import training
from benchmarks.speed import peer, timing, train_step

LR, WD = 1e-3, 1e-4


def frame_optimizers() -> Dict[str, optax.GradientTransformation]:
  """The three optimizers on frame stacks (heads, d, r)."""
  return {"stiefel_muon": so.stiefel_muon(LR),
          "optax muon": training.per_head_muon(LR, WD),
          "adamw": optax.adamw(LR, weight_decay=WD)}


def model_optimizers() -> Dict[str, optax.GradientTransformation]:
  """The same three on a whole model: Muon on the Q/K frames, AdamW on the
  rest (and on everything, for adamw)."""
  adamw = optax.adamw(LR, weight_decay=WD)
  return {"stiefel_muon": so.stiefel_attention(
              LR, stiefel_tx=so.stiefel_muon(LR), euclidean_tx=adamw),
          "optax muon": so.frame_partition(
              training.per_head_muon(LR, WD), adamw,
              orthonormal_start="project"),
          "adamw": adamw}


def ratios(t: dict, c: dict) -> dict:
  return {"ms": {k: 1e3 * v for k, v in t.items()},
          "cpu_ms": {k: 1e3 * v for k, v in c.items()},
          "over_muon": t["stiefel_muon"] / t["optax muon"],
          "over_adamw": t["stiefel_muon"] / t["adamw"],
          "muon_over_adamw": t["optax muon"] / t["adamw"]}


def workload_row(w: peer.PeerWorkload, iters: int) -> Dict[str, Any]:
  params, grads = peer.peer_arrays(w)
  fns, ops = {}, {}
  for name, tx in frame_optimizers().items():
    step = peer.jitted_step(tx)
    p, s = step(params, tx.init(params), grads)
    fns[name] = timing.call(step, p, s, grads)
    ops[name] = peer.compiled_ops(step, p, s, grads)
  c = {}
  t = timing.median_times(fns, iters, cpu=c)
  return {"workload": w.name, "leaves": w.leaves, "shape": list(w.shape),
          **ratios(t, c), "compiled_ops": ops}


def muon_table(workloads, lm: train_step.LMConfig,
               iters: int) -> Dict[str, Any]:
  rows = [workload_row(w, iters) for w in workloads]
  t, c, n = train_step.train_step_times(lm, iters, model_optimizers())
  return {"lr": LR, "rows": rows,
          "train_step": {"model": lm.describe(), "params": n,
                         **ratios(t, c)}}
