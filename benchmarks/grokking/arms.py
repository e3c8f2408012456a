"""Each arm's optimizer: AdamW, and the Stiefel and RSGD recipes of
`stiefel_optax.stiefel_attention` (the Q/K frames on the manifold, the
rest on AdamW)."""

from __future__ import annotations

import optax

import stiefel_optax as so
from benchmarks.grokking.config import ARMS, PROBE_ARM, Config


def make_optimizer(cfg: Config, arm: str) -> optax.GradientTransformation:
  """The arm's optimizer: AdamW on every weight (adamw), or the Q/K frames
  on Stiefel-Adam (stiefel) or on fixed-step RSGD (the rsgd probe) and
  every other weight on AdamW."""
  adamw = optax.adamw(cfg.learning_rate, cfg.b1, cfg.b2,
                      weight_decay=cfg.weight_decay)
  if arm == "adamw":
    return adamw
  if arm == "stiefel":
    return so.stiefel_attention(
        cfg.learning_rate, stiefel_learning_rate=cfg.stiefel_learning_rate,
        weight_decay=cfg.weight_decay, b1=cfg.b1, b2=cfg.b2,
        max_step_norm=cfg.max_step_norm)
  if arm == PROBE_ARM:
    return so.stiefel_attention(
        cfg.learning_rate, stiefel_tx=so.riemannian_sgd(cfg.rsgd_learning_rate),
        euclidean_tx=adamw)
  raise ValueError(f"arm must be one of {ARMS + (PROBE_ARM,)}; got {arm!r}.")
