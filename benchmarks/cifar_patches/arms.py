"""The arms: each one's Q/K recipe (an `optax.chain` of the library's
transforms for the query/key frames), start, frame layout and tuning grid,
the registry `ARMS`, and an arm's whole-model optimizer (`make_tx`)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import optax

import stiefel_optax as so
from benchmarks import training
from benchmarks.cifar_patches.config import Config

# --------------------------------------------------------------------------
# Q/K recipes: each arm's optimizer for the query/key frames, (..., d, r).


def qk_adamw(lr, *, weight_decay, **_):
  """The baseline: the same AdamW as the rest of the model."""
  return optax.adamw(lr, weight_decay=weight_decay)


def qk_stiefel(lr, *, cap=so.aliases.DEFAULT_MAX_STEP_NORM, eps=1e-8, **_):
  """Stiefel-Adam: project, one scalar v per frame, lr, cap, retract."""
  return so.stiefel_adam(lr, eps=eps, max_step_norm=cap)


def qk_rsgd(lr, **_):
  """Fixed-step Riemannian SGD: W+ = polar(W - lr P_W(G))."""
  return so.riemannian_sgd(lr)


def qk_frozen(lr=None, **_):
  """Q/K kept at their orthonormal start."""
  del lr
  return optax.set_to_zero()


def qk_no_projection(lr, *, cap=so.aliases.DEFAULT_MAX_STEP_NORM, eps=1e-8, **_):
  """Ablation: no tangent projection of gradient or momentum; the polar
  retraction (its Newton–Schulz sized for non-tangent steps) still keeps W
  on the manifold."""
  return optax.chain(
      so.scale_by_frame_adam(eps=eps, transport_momentum=False),
      optax.scale_by_learning_rate(lr),
      so.clip_frame_norm(cap),
      so.retract_polar(max_step_norm=cap, tangent=False))


def qk_per_coordinate(lr, *, cap=so.aliases.DEFAULT_MAX_STEP_NORM, eps=1e-8, **_):
  """Ablation: Adam's per-coordinate second moment instead of one scalar
  per frame (not scale-free per frame, not O(d)-equivariant); the step is
  projected back to the tangent space before cap and retraction."""
  return optax.chain(
      so.project_to_tangent(),
      optax.scale_by_adam(eps=eps),
      so.project_to_tangent(),
      optax.scale_by_learning_rate(lr),
      so.clip_frame_norm(cap),
      so.retract_polar(max_step_norm=cap))


def qk_stiefel_muon(lr, **_):
  """Manifold Muon: polar(W - lr P_W(msign(tangent momentum)))."""
  return so.stiefel_muon(lr)


def qk_muon(lr, *, weight_decay, **_):
  """optax.contrib.muon on each head's (d, head_dim) view, unconstrained
  (`training.per_head_muon`, the LM's muon too)."""
  return training.per_head_muon(lr, weight_decay)


def qk_no_cap(lr, *, eps=1e-8, **_):
  """Ablation: Stiefel-Adam without the trust-region cap."""
  return so.stiefel_adam(lr, eps=eps, max_step_norm=None)


# The Q/K frames of the patch transformer's (d, heads, head_dim) kernels: one frame per
# head (the library's default), or one (d, heads * head_dim) frame per
# projection (the `whole_frame` ablation).
PER_HEAD = "flax"
WHOLE_FRAME = {so.specs.QK_KERNEL: so.FrameSpec(rows=-3, cols=(-2, -1))}


def frames_of(per_head: bool):
  """The frame selector of an arm's layout."""
  return PER_HEAD if per_head else WHOLE_FRAME


class Arm(NamedTuple):
  """One arm: the Q/K recipe, its start, frame layout and tuning grid.

  grid: the axes ((name, values), ...) of a product grid of
  hyperparameters tried on the validation split; None inherits the chosen
  point of `tune_from` (ablations change one ingredient at the tuned
  setting). An axis whose best value lies on its edge is extended
  geometrically (`benchmarks.study.tuning`) until the best is interior. fixed:
  hyperparameters of the recipe that are not tuned (e.g. eps).
  """
  name: str
  recipe: Callable[..., optax.GradientTransformation]
  orthonormal: bool = True
  per_head: bool = True
  grid: Optional[tuple] = None
  tune_from: Optional[str] = None
  fixed: tuple = ()
  group: str = "main"
  own_base: bool = False     # a whole-model AdamW recipe: its own lr, wd
  qk_norm: bool = False      # the model with per-head query/key norm


def make_arms() -> dict:
  """The registry of arms (the study runs them group by group, in GROUPS
  order: `study_arms`). Every tuned
  arm gets 3 half-decade points per hyperparameter (fair tuning): AdamW lr
  x weight decay (which also sets every arm's non-Q/K AdamW), Stiefel Q/K
  lr x cap, RSGD lr."""
  arms = [
      Arm("adamw", qk_adamw, orthonormal=False,
          grid=(("lr", (1e-3, 3e-3, 1e-2)), ("weight_decay", (0.01, 0.05, 0.25)))),
      Arm("stiefel", qk_stiefel,
          grid=(("lr", (0.1, 0.3, 1.0)), ("cap", (0.1, 0.3, 1.0)))),
      Arm("rsgd", qk_rsgd, grid=(("lr", (3.0, 10.0, 30.0)),)),
      Arm("frozen", qk_frozen, grid=(), group="baseline"),
      Arm("no_projection", qk_no_projection, tune_from="stiefel", group="ablation"),
      Arm("per_coordinate_v", qk_per_coordinate, tune_from="stiefel", group="ablation"),
      Arm("no_cap", qk_no_cap, tune_from="stiefel", group="ablation"),
      Arm("whole_frame", qk_stiefel, per_head=False, tune_from="stiefel",
          group="ablation"),
  ]
  adamw_grid = arms[0].grid
  arms += [   # the strongest alternatives (issue 14), at the largest n
      Arm("stiefel_muon", qk_stiefel_muon,
          grid=(("lr", (0.01, 0.03, 0.1)),), group="competitor"),
      Arm("muon", qk_muon, orthonormal=False,
          grid=(("lr", (1e-3, 3e-3, 1e-2)),), group="competitor"),
      Arm("qk_norm", qk_adamw, orthonormal=False, grid=adamw_grid,
          own_base=True, qk_norm=True, group="competitor"),
      Arm("orthogonal_init", qk_adamw, grid=adamw_grid, own_base=True,
          group="competitor"),
  ]
  for eps in (1e-3, 1e-2, 1e-1):
    arms.append(Arm(f"eps_{eps:g}", qk_stiefel, tune_from="stiefel",
                    fixed=(("eps", eps),), group="eps"))
  return {a.name: a for a in arms}


ARMS = make_arms()


# --------------------------------------------------------------------------
# An arm's optimizer: its recipe on Q/K, AdamW on the rest.


def schedule(peak: float, total_steps: int, cfg: Config):
  warmup = max(1, int(cfg.warmup_frac * total_steps))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup,
                                            max(total_steps, warmup + 1))


BASE_KEYS = ("lr", "weight_decay")


def make_tx(arm: Arm, hp: dict, base: dict, total_steps: int, cfg: Config):
  """AdamW(base lr, base weight decay) on every parameter except Q/K, the
  arm's recipe there (with the same weight decay where it takes one)."""
  kw = dict(arm.fixed)
  kw.update({k: v for k, v in hp.items() if k not in BASE_KEYS})
  qk_lr = schedule(hp["lr"], total_steps, cfg) if "lr" in hp else None
  rest_lr = schedule(base["lr"], total_steps, cfg)
  # Arms that start off the manifold (adamw) train raw kernels: no start check.
  return so.stiefel_attention(
      rest_lr, frames=frames_of(arm.per_head),
      orthonormal_start="check" if arm.orthonormal else "project",
      stiefel_tx=arm.recipe(qk_lr, weight_decay=base["weight_decay"], **kw),
      euclidean_tx=optax.adamw(rest_lr, weight_decay=base["weight_decay"]))
