"""What determines a run but its arm and seed: `Config` and its presets.
A run is named by the one rule, `harness.run_name(arm, seed)`
(`<arm>_seed<seed>`); its identity is `harness.run_identity(
cfg.to_dict(), data id)`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from benchmarks.grokking.data import DEFAULT_PRIME
from benchmarks.harness import run_name  # noqa: F401  (the one rule: <arm>_seed<seed>)

# The mechanism probe (Q/K frames on fixed-step RSGD), beside the study's
# arms (`study.Study.arms`).
PROBE_ARM = "rsgd"

# The fields added after the 0.1.0 runs, with the defaults that reproduce
# what those runs did (full batch, no warmup, optax's Adam eps 1e-8, which
# the Stiefel recipe shared). `Config.to_dict` leaves a field of these out
# while it holds that default, so every run made before the field existed
# keeps its identity and every committed report still finds its runs.
LATER_FIELDS = {"batch_size": 0, "warmup_steps": 0, "eps": 1e-8}


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run (with the data's md5 and the library
  version, its identity).

  batch_size: 0 trains full batch (one step is one epoch, the 0.1.0 runs);
    B > 0 trains on minibatches of B training equations, drawn by a
    per-epoch shuffle without replacement (the permutation of epoch e is
    `jax.random.permutation(fold_in(PRNGKey(seed) data key, e))`, the last
    n mod B equations of an epoch left out), the same batches for every
    arm of a seed.
  warmup_steps: the learning rate (AdamW's and the Q/K recipe's) rises
    linearly from 0 at step 0 to its value at this step (0: none).
  eps: Adam's epsilon, AdamW's and Stiefel-Adam's.
  """
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
  batch_size: int = 0
  warmup_steps: int = 0
  eps: float = 1e-8

  def to_dict(self) -> dict:
    """The configuration as a run records it and its identity hashes it:
    every field, but those of `LATER_FIELDS` only where they differ from
    the default that reproduces the runs made before they existed.

    >>> "batch_size" in Config().to_dict(), Config(batch_size=512).to_dict()["batch_size"]
    (False, 512)
    """
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in LATER_FIELDS or v != LATER_FIELDS[k]}


DEFAULT = Config()
QUICK = Config(p=23, d_model=16, num_heads=2, d_mlp=64, log_every=25)
# Slingshot conditions (Thilak et al. 2022, arXiv 2206.04817): Adam, lr
# 1e-3, betas (0.9, 0.98), eps 1e-8, 10 warmup steps, minibatches of 512;
# the weight decay is the targeted arms' (the other arms decay nothing,
# arms.DECAY). Two layers of width 128 and 4 heads: the model of Power et
# al. 2022, which Thilak et al. train (ours without LayerNorm). Logged
# every 100 steps, the batch losses' max in between.
SLINGSHOT = Config(d_model=128, num_heads=4, d_mlp=512, num_layers=2,
                   learning_rate=1e-3, b1=0.9, b2=0.98, eps=1e-8,
                   warmup_steps=10, batch_size=512, weight_decay=1.0,
                   log_every=100)
FRAC03 = Config(train_fraction=0.3)
PRESETS = {"default": DEFAULT, "full": DEFAULT, "quick": QUICK,
           # the two five-seed studies (study.PAIRED): the default model
           "frac0.5": DEFAULT, "frac0.3": FRAC03,
           # the main job's reduced train-fraction-0.3 cell (study.MAIN_JOB):
           # frac0.3's configuration, so its runs share those runs' identity
           "frac0.3_demo": FRAC03,
           "slingshot": SLINGSHOT}

