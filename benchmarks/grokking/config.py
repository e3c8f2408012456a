"""What determines a run but its arm and seed: `Config`, its presets, and a
run's name (its identity: `harness.run_identity(cfg.to_dict(), data id)`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from benchmarks.grokking.data import DEFAULT_PRIME

# The mechanism probe (Q/K frames on fixed-step RSGD), beside the study's
# arms (`study.Study.arms`).
PROBE_ARM = "rsgd"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run (with the data's md5 and the library
  version, its identity)."""
  p: int = DEFAULT_PRIME
  op: str = "+"
  train_fraction: float = 0.5
  d_model: int = 32
  num_heads: int = 4
  d_mlp: int = 128
  num_layers: int = 1
  learning_rate: float = 1e-3
  stiefel_learning_rate: Optional[float] = None   # None: learning_rate
  weight_decay: float = 1.0
  b1: float = 0.9
  b2: float = 0.98
  max_step_norm: float = 0.1
  rsgd_learning_rate: float = 0.1
  log_every: int = 50
  target_acc: float = 0.95

  def to_dict(self) -> dict:
    """The configuration as a run records it and its identity hashes it."""
    return dataclasses.asdict(self)


DEFAULT = Config()
QUICK = Config(p=23, d_model=16, num_heads=2, d_mlp=64, log_every=25)
PRESETS = {"default": DEFAULT, "full": DEFAULT, "quick": QUICK}


def run_name(arm: str, seed: int) -> str:
  return f"{arm}_seed{seed}"
