"""What determines a run but its arm and seed (`Config`), which runs a
study makes (`Study`), their presets, and a run's identity and name."""

from __future__ import annotations

import dataclasses
from typing import Optional

from benchmarks import harness
from benchmarks.grokking.data import DEFAULT_PRIME, data_id

ARMS = ("adamw", "stiefel")
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


@dataclasses.dataclass(frozen=True)
class Study:
  """Which runs: `seeds` x arms to `steps`; `long_seed` continued to
  `long_steps` (0: none); the rsgd probe for `probe_steps` on each seed."""
  steps: int
  seeds: tuple
  long_steps: int = 0
  long_seed: int = 0
  probe_steps: int = 0
  arms: tuple = ARMS


  @classmethod
  def from_dict(cls, d: dict) -> "Study":
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in d.items()})


DEFAULT_STUDY = Study(steps=1000, seeds=(0, 1, 2, 3, 4), probe_steps=200)
FULL_STUDY = Study(steps=3000, seeds=(0, 1, 2, 3, 4), long_steps=20000,
                   probe_steps=500)
QUICK_STUDY = Study(steps=100, seeds=(0, 1), probe_steps=50)
QUICK_CONFIG = dict(p=23, d_model=16, num_heads=2, d_mlp=64, log_every=25)


def run_identity(cfg: Config) -> str:
  return harness.identity(dataclasses.asdict(cfg), data_id(cfg.p, cfg.op))


def run_name(arm: str, seed: int) -> str:
  return f"{arm}_seed{seed}"
