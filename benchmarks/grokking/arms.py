"""The arms (`ARMS`: name -> `benchmarks.training.Arm`) and an arm's
optimizer: the Q/K frames on the arm's recipe, the rest on AdamW."""

from __future__ import annotations

import optax

from benchmarks import training
from benchmarks.training import Arm

ARMS = {
    "adamw": Arm(),
    "stiefel": Arm(training.qk_stiefel, orthonormal=True,
                   fields=("stiefel_learning_rate", "max_step_norm")),
    "rsgd": Arm(training.qk_rsgd, orthonormal=True,
                fields=("rsgd_learning_rate",)),   # the mechanism probe
}


def make_optimizer(cfg, arm: str) -> optax.GradientTransformation:
  """The arm's optimizer (cfg: a `config.Config`): AdamW on every weight
  (adamw), or the Q/K frames on Stiefel-Adam (stiefel) or on fixed-step
  RSGD (the rsgd probe) at the arm's Q/K lr (stiefel: None means
  learning_rate) and every other weight on AdamW."""
  if arm not in ARMS:
    raise ValueError(f"arm must be one of {tuple(ARMS)}; got {arm!r}.")
  a = ARMS[arm]
  adamw = optax.adamw(cfg.learning_rate, cfg.b1, cfg.b2,
                      weight_decay=cfg.weight_decay)
  lr = getattr(cfg, a.fields[0]) if a.fields else None
  return training.arm_optimizer(
      a, adamw, cfg.learning_rate if lr is None else lr, b1=cfg.b1,
      b2=cfg.b2, cap=cfg.max_step_norm)
