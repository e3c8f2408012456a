"""The arms (`ARMS`: name -> `benchmarks.training.Arm`): each one's Q/K
recipe (an optax transform of the library's for the query/key frames; the
shared ones are `benchmarks.training`'s, the ablations' are here), start
and frame layout; and an arm's whole-model optimizer (`make_optimizer`).
How each arm is tuned and paired is the study's (`study.GROUPS`). `cfg`
throughout: a `config.Config`."""

from __future__ import annotations

import optax

import stiefel_optax as so
from benchmarks import training
from benchmarks.training import (Arm, qk_adamw, qk_muon, qk_rsgd, qk_stiefel,
                                 qk_stiefel_muon)


# --------------------------------------------------------------------------
# The ablations' Q/K recipes, (..., d, r) frames.


def qk_frozen(lr=None, **_):
  """Q/K kept at their orthonormal start."""
  del lr
  return optax.set_to_zero()


def qk_no_projection(lr, *, max_step_norm=so.aliases.DEFAULT_MAX_STEP_NORM,
                     eps=1e-8, **_):
  """Ablation: no tangent projection of gradient or momentum; the polar
  retraction (its Newton–Schulz sized for non-tangent steps) still keeps W
  on the manifold."""
  return optax.chain(
      so.scale_by_frame_adam(eps=eps, transport_momentum=False),
      optax.scale_by_learning_rate(lr),
      so.clip_frame_norm(max_step_norm),
      so.retract_polar(max_step_norm=max_step_norm, tangent=False))


def qk_per_coordinate(lr, *, max_step_norm=so.aliases.DEFAULT_MAX_STEP_NORM,
                      eps=1e-8, **_):
  """Ablation: Adam's per-coordinate second moment instead of one scalar
  per frame (not scale-free per frame, not O(d)-equivariant); the step is
  projected back to the tangent space before the trust region and
  retraction."""
  return optax.chain(
      so.project_to_tangent(),
      optax.scale_by_adam(eps=eps),
      so.project_to_tangent(),
      optax.scale_by_learning_rate(lr),
      so.clip_frame_norm(max_step_norm),
      so.retract_polar(max_step_norm=max_step_norm))


def qk_no_cap(lr, *, eps=1e-8, **_):
  """Ablation: Stiefel-Adam without the trust-region cap."""
  return so.stiefel_adam(lr, eps=eps, max_step_norm=None)


# The Q/K frames of the patch transformer's (d, heads, head_dim) kernels: one
# frame per head (the library's default), or one (d, heads * head_dim) frame
# per projection (the `whole_frame` ablation).
PER_HEAD = "flax"
WHOLE_FRAME = {so.families.QK_KERNEL: so.FrameSpec(rows=-3, cols=(-2, -1))}

# Every arm trains the Q/K frames on its recipe and the rest on AdamW; all
# but adamw, muon and qk_norm start from orthonormal frames.
ARMS = {
    "adamw": Arm(qk_adamw),
    "stiefel": Arm(qk_stiefel, orthonormal=True),
    "rsgd": Arm(qk_rsgd, orthonormal=True),
    "frozen": Arm(qk_frozen, orthonormal=True),
    "no_projection": Arm(qk_no_projection, orthonormal=True),
    "per_coordinate_v": Arm(qk_per_coordinate, orthonormal=True),
    "no_cap": Arm(qk_no_cap, orthonormal=True),
    "whole_frame": Arm(qk_stiefel, orthonormal=True, frames=WHOLE_FRAME),
    "stiefel_muon": Arm(qk_stiefel_muon, orthonormal=True),
    "muon": Arm(qk_muon),
    "qk_norm": Arm(qk_adamw, qk_norm=True),
    "orthogonal_init": Arm(qk_adamw, orthonormal=True),
    **{f"eps_{eps:g}": Arm(qk_stiefel, orthonormal=True, fixed=(("eps", eps),))
       for eps in (1e-3, 1e-2, 1e-1)},
}


def frames_of(arm: Arm):
  """The frame selector of an arm's layout."""
  return PER_HEAD if arm.frames is None else arm.frames


# --------------------------------------------------------------------------
# An arm's optimizer: its recipe on Q/K, AdamW on the rest.


def schedule(peak: float, total_steps: int, cfg):
  warmup = max(1, int(cfg.warmup_frac * total_steps))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup,
                                            max(total_steps, warmup + 1))


BASE_KEYS = ("lr", "weight_decay")
# A tuned hyperparameter's recorded name (in a run's `hp`, its tuning run's
# name and the sweep's ratios, so kept: the committed runs' identities) ->
# the recipe's keyword: Stiefel's `cap` is the trust-region radius,
# max_step_norm.
RECIPE_KEYWORDS = {"cap": "max_step_norm"}


def recipe_keywords(hp: dict) -> dict:
  """The recipe's keywords of the hyperparameters hp (those of BASE_KEYS
  left out: the base AdamW's).

  >>> recipe_keywords({"lr": 0.3, "cap": 0.1})
  {'max_step_norm': 0.1}
  """
  return {RECIPE_KEYWORDS.get(k, k): v for k, v in hp.items()
          if k not in BASE_KEYS}


def make_optimizer(cfg, arm: str, hp: dict, base: dict,
                   total_steps: int) -> optax.GradientTransformation:
  """AdamW(base lr, base weight decay) on every parameter except Q/K, the
  arm's recipe there at its hyperparameters hp (with the same weight decay
  where it takes one); arms that start off the manifold (adamw) train raw
  kernels: no start check (`training.arm_optimizer`)."""
  qk_lr = schedule(hp["lr"], total_steps, cfg) if "lr" in hp else None
  rest_lr = schedule(base["lr"], total_steps, cfg)
  return training.arm_optimizer(
      ARMS[arm], optax.adamw(rest_lr, weight_decay=base["weight_decay"]),
      qk_lr, PER_HEAD, weight_decay=base["weight_decay"],
      **recipe_keywords(hp))
