"""What determines a run but its seed: `Config` (nanoGPT's names), its
presets, and a run's name (its identity: `harness.run_identity(
cfg.to_dict(), corpus id)`).

A run's name is its arm, seed and the digest of its configuration as its
identity sees it and corpus; an arm's own fields stay out of the others':

>>> run_name(CPU, 0, "tinyshakespeare:md5=6fb458f1232090904fb40fe944165e91")
'adamw_seed0_85bd1ed3'
>>> stiefel = dataclasses.replace(CPU, arm="stiefel")
>>> [f for f in ("max_step_norm", "muon_learning_rate")
...  if f in stiefel.to_dict()]
['max_step_norm']
"""

from __future__ import annotations

import dataclasses

from benchmarks import harness
from benchmarks.lm.arms import ARMS, other_fields


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run but its seed (nanoGPT's names)."""
  arm: str = "adamw"
  n_layer: int = 4
  n_head: int = 4
  n_embd: int = 128
  block_size: int = 64
  batch_size: int = 12
  dropout: float = 0.0
  max_iters: int = 2000
  lr_decay_iters: int = 2000
  warmup_iters: int = 100
  learning_rate: float = 1e-3
  min_lr: float = 1e-4
  beta1: float = 0.9
  beta2: float = 0.99
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  eval_interval: int = 250
  eval_iters: int = 20
  # Stiefel Q/K peak lr and trust region: chosen on validation (seed 100,
  # 500 iters) from (0.03, 0.1), (0.1, 0.1), (0.3, 0.3), (1, 1).
  stiefel_learning_rate: float = 0.3
  max_step_norm: float = 0.3
  rsgd_learning_rate: float = 0.1
  stiefel_muon_learning_rate: float = 0.01
  muon_learning_rate: float = 1e-3

  def to_dict(self) -> dict:
    """The configuration as a run records it and its identity hashes it:
    without the fields of the other arms (`arms.ARMS[...].fields`)."""
    others = other_fields(self.arm)
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in others}


# nanoGPT's published character-level Shakespeare runs (README): the small
# CPU command and the shakespeare_char (GPU) config (their val losses:
# `benchmarks.reports.lm.PUBLISHED`).
# GPU: evaluated every 500 iterations (nanoGPT: 250) with nanoGPT's 200
# batches, to leave time for more seeds on one GPU.
CPU = Config()
GPU = Config(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64,
             dropout=0.2, max_iters=5000, lr_decay_iters=5000,
             eval_interval=500, eval_iters=200)
QUICK = Config(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=8,
               max_iters=30, lr_decay_iters=30, warmup_iters=5,
               eval_interval=10, eval_iters=4)
PRESETS = {"cpu": CPU, "gpu": GPU, "quick": QUICK}


# <arm>_seed<seed>_<digest of the configuration and corpus> (`harness.run_name`).
NAMING = harness.Naming(key="content")


def run_name(cfg: Config, seed: int, data_id: str) -> str:
  """The run's name (`harness.run_name`: the arm, the seed and the key to
  its configuration and corpus)."""
  return harness.run_name(cfg.arm, seed, NAMING, config=cfg.to_dict(),
                          data=data_id)


def check_config(cfg: Config) -> None:
  if cfg.arm not in ARMS:
    raise SystemExit(f"arm must be one of {', '.join(ARMS)}; got {cfg.arm!r}.")
  if cfg.max_iters % cfg.eval_interval:
    raise SystemExit(f"max_iters = {cfg.max_iters} must be a multiple of"
                     f" eval_interval = {cfg.eval_interval}.")
  if cfg.n_embd % cfg.n_head:
    raise SystemExit(f"n_embd = {cfg.n_embd} is not divisible by n_head ="
                     f" {cfg.n_head}.")
