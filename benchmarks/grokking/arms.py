"""The arms (`ARMS`: name -> `benchmarks.training.Arm`) and an arm's
optimizer: the Q/K frames on the arm's recipe, the rest on AdamW; the
slingshot pilot's arms (`DECAY`) change only where that AdamW decays."""

from __future__ import annotations

import jax
import optax

import stiefel_optax as so
from benchmarks import training
from benchmarks.training import Arm

ARMS = {
    "adamw": Arm(),
    "stiefel": Arm(training.qk_stiefel, orthonormal=True,
                   fields=("stiefel_learning_rate", "max_step_norm")),
    "rsgd": Arm(training.qk_rsgd, orthonormal=True,
                fields=("rsgd_learning_rate",)),   # the mechanism probe
}
# The slingshot pilot's arms: adamw's and stiefel's recipes with the AdamW
# weight decay off ("none") or only on the embeddings, the MLP kernels and
# the unembedding ("targeted": never an attention weight nor a bias). In a
# study: --set arms=adam,stiefel_nodecay,stiefel_targeted,adamw_targeted.
DECAY = {"adam": "none", "stiefel_nodecay": "none",
         "stiefel_targeted": "targeted", "adamw_targeted": "targeted"}
ARMS.update({name: ARMS["stiefel" if name.startswith("stiefel") else "adamw"]
             for name in DECAY})
TARGETED = (("embed/", "pos_embed", "unembed/"),
            ("mlp_in/kernel", "mlp_out/kernel"))


def targeted(params):
  """The targeted decay's mask: True on the embeddings, the MLP kernels and
  the unembedding.

  >>> targeted({"embed": {"embedding": 0}, "block_0": {"attn": {"out": {
  ...     "kernel": 0}}, "mlp_in": {"kernel": 0, "bias": 0}}})
  {'block_0': {'attn': {'out': {'kernel': False}}, 'mlp_in': {'bias': False, 'kernel': True}}, 'embed': {'embedding': True}}
  """
  def on(path, _):
    name = so.path_str(path)
    return name.startswith(TARGETED[0]) or name.endswith(TARGETED[1])
  return jax.tree_util.tree_map_with_path(on, params)


def schedule(cfg, lr: float):
  """lr, or a linear warmup from 0 at step 0 to lr at cfg.warmup_steps
  (then constant) where cfg.warmup_steps > 0.

  >>> from benchmarks.grokking.config import Config
  >>> round(float(schedule(Config(warmup_steps=10), 1e-3)(5)), 8)
  0.0005
  """
  if not cfg.warmup_steps:
    return lr
  return optax.linear_schedule(0.0, lr, cfg.warmup_steps)


def make_optimizer(cfg, arm: str) -> optax.GradientTransformation:
  """The arm's optimizer (cfg: a `config.Config`): AdamW on every weight
  (adamw), or the Q/K frames on Stiefel-Adam (stiefel) or on fixed-step
  RSGD (the rsgd probe) at the arm's Q/K lr (stiefel: None means
  learning_rate) and every other weight on AdamW, its decay as `DECAY`
  says (default: cfg.weight_decay on every weight it trains); both with
  cfg.eps and cfg.warmup_steps' linear warmup (`schedule`)."""
  if arm not in ARMS:
    raise ValueError(f"arm must be one of {tuple(ARMS)}; got {arm!r}.")
  a, decay = ARMS[arm], DECAY.get(arm)
  adamw = optax.adamw(schedule(cfg, cfg.learning_rate), cfg.b1, cfg.b2,
                      cfg.eps,
                      weight_decay=0.0 if decay == "none" else cfg.weight_decay,
                      **({"mask": targeted} if decay == "targeted" else {}))
  lr = getattr(cfg, a.fields[0]) if a.fields else None
  return training.arm_optimizer(
      a, adamw, schedule(cfg, cfg.learning_rate if lr is None else lr),
      b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, max_step_norm=cfg.max_step_norm)
