"""What a run's result depends on besides its arm, hyperparameters, seed
and n: `Config`, its presets, and a run's name (the runs' identity:
`harness.run_identity(cfg.to_dict(), data source)`)."""

from __future__ import annotations

import dataclasses

from benchmarks import harness, study as study_lib
from benchmarks.models import PatchViTConfig

Task = study_lib.Task


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run's result depends on besides (arm, hp, seed, n)."""
  model: PatchViTConfig = PatchViTConfig(dim=64, heads=4, depth=2)
  batch: int = 128
  epochs: int = 20
  warmup_frac: float = 0.05
  val_size: int = 1000
  val_seed: int = 12345
  tune_seeds: tuple = (1000, 1001, 1002)
  max_extensions: int = 3

  def to_dict(self) -> dict:
    """The configuration as a run records it and its identity hashes it."""
    return dataclasses.asdict(self)


DEFAULT = Config()
QUICK = Config(model=PatchViTConfig(dim=16, heads=2, depth=1, mlp_ratio=2),
               batch=32, epochs=2, val_size=64, tune_seeds=(1000,))
PRESETS = {"default": DEFAULT, "quick": QUICK}


# The CIFAR runs' spelling of `harness.run_name`: parts joined by "__", the
# seed as s<seed>; a sweep's runs end in their identity's key.
NAMING = harness.Naming("__", "s")
SWEEP_NAMING = NAMING._replace(key="identity")


def run_name(task: Task) -> str:
  """A run's file name (`harness.run_name`): tune__<arm>__<point>__s<seed>
  for a tuning run, <arm>__n<n>__s<seed> for a paired run.

  >>> run_name(Task("tune", "stiefel", {"lr": 0.3, "cap": 0.1}, {}, 1000))
  'tune__stiefel__cap0.1_lr0.3__s1000'
  >>> run_name(Task("discovery", "adamw", {}, {}, 0, 8068))
  'adamw__n8068__s0'
  """
  parts = (("tune", task.arm, study_lib.point_key(task.point))
           if task.stage == "tune" else (task.arm, f"n{task.size}"))
  return harness.run_name(parts, task.seed, NAMING)
