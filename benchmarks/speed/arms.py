"""The optimizers every table compares, and their ratios to AdamW.

`stiefel_attention` is timed per leaf, with `stack_frames=True` (STACKED)
and with `stack_frames="auto"` (AUTO), against `optax.adamw`; all four with
the same learning rate and weight decay.

>>> wall = {"adamw": 0.002, "stiefel_attention": 0.003, STACKED: 0.004,
...         AUTO: 0.001}
>>> versus_adamw(wall, wall)["ratio"], stacked_ratios(wall)["auto_ratio"]
(1.5, 0.5)
"""

from __future__ import annotations

from typing import Dict

import optax

import stiefel_optax as so

STACKED = "stiefel_attention, stack_frames"
AUTO = "stiefel_attention, stack_frames auto"


def optimizers(lr: float = 1e-3) -> Dict[str, optax.GradientTransformation]:
  """adamw, stiefel_attention, STACKED and AUTO, in the order timed."""
  return {"adamw": optax.adamw(lr, weight_decay=1e-4),
          "stiefel_attention": so.stiefel_attention(lr, weight_decay=1e-4),
          STACKED: so.stiefel_attention(lr, weight_decay=1e-4,
                                        stack_frames=True),
          AUTO: so.stiefel_attention(lr, weight_decay=1e-4,
                                     stack_frames="auto")}


def versus_adamw(wall: dict, cpu: dict) -> dict:
  """Both optimizers' medians (ms) and the stiefel_attention / adamw ratios,
  wall-clock and CPU time."""
  return {"adamw_ms": 1e3 * wall["adamw"],
          "stiefel_ms": 1e3 * wall["stiefel_attention"],
          "ratio": wall["stiefel_attention"] / wall["adamw"],
          "adamw_cpu_ms": 1e3 * cpu["adamw"],
          "stiefel_cpu_ms": 1e3 * cpu["stiefel_attention"],
          "cpu_ratio": cpu["stiefel_attention"] / cpu["adamw"]}


def stacked_ratios(wall: dict) -> dict:
  """The stack_frames settings' medians (ms) and ratios to adamw."""
  return {"stacked_ms": 1e3 * wall[STACKED],
          "stacked_ratio": wall[STACKED] / wall["adamw"],
          "auto_ms": 1e3 * wall[AUTO], "auto_ratio": wall[AUTO] / wall["adamw"]}
