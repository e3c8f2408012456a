"""The arms (`ARMS`: name -> `benchmarks.training.Arm`) and an arm's
optimizer: its recipe on the Q/K frames (each head's q and k thirds of the
fused c_attn), nanoGPT's AdamW, learning-rate schedule and weight-decay
mask on the rest. `cfg` throughout: a `config.Config` (which imports this
module: the registry's `fields` decide its identity)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import stiefel_optax as so
from benchmarks import training
from benchmarks.training import Arm


# `fields`: the Config fields only that arm reads (its Q/K lr first), kept
# out of the other arms' identity, so tuning one arm never invalidates
# another's runs.
ARMS = {
    "adamw": Arm(),
    "stiefel": Arm(training.qk_stiefel, orthonormal=True,
                   fields=("stiefel_learning_rate", "max_step_norm")),
    "rsgd": Arm(training.qk_rsgd, orthonormal=True,
                fields=("rsgd_learning_rate",)),
    "stiefel_muon": Arm(training.qk_stiefel_muon, orthonormal=True,
                        fields=("stiefel_muon_learning_rate",)),
    "muon": Arm(training.qk_muon, fields=("muon_learning_rate",)),
    "qk_norm": Arm(qk_norm=True),
    "orthogonal_init": Arm(orthonormal=True),
    "qk_clip": Arm(qk_clip=True),
}

# The closed bound (issue 52; benchmarks/results/lm_bound/plan.md): the
# stiefel arm (its Q/K lr and cap) with each block's pre-attention norm gain
# (nanoGPT's ln_1 scale; the model has no norm bias) projected after every
# step onto a constraint set (`so.project_gains`): the box |g| <= 1, the
# sphere ||g||_2 = sqrt(d) per layer, or held at its start (ones). With
# orthonormal frames every logit is then at most d / sqrt(head_dim) (box,
# fixed) or ||g||_inf^2 d / sqrt(head_dim) <= d^2 / sqrt(head_dim)
# (sphere): `so.attention_logit_bound`. {arm: (constraint, g_max)}.
BOUND_ARMS = {"stiefel_box": ("box", 1.0), "stiefel_sphere": ("sphere", 1.0),
              "stiefel_fixed": ("fixed", 1.0)}
for _arm in BOUND_ARMS:
  ARMS[_arm] = ARMS["stiefel"]
GAINS = "nanogpt"          # the gain preset: each block's ln_1 scale


def gain_projection(arm: str) -> optax.GradientTransformation:
  """The bound arm's projection of the ln_1 gains after the step.

  >>> import jax.numpy as jnp
  >>> g = {"h_0": {"ln_1": {"scale": jnp.array([0.5, 2.0])}}}
  >>> tx = gain_projection("stiefel_box")
  >>> (g["h_0"]["ln_1"]["scale"] + tx.update(g, tx.init(g), g)[0]["h_0"][
  ...     "ln_1"]["scale"]).tolist()                   # 2 g, boxed at 1
  [1.0, 1.0]
  """
  constraint, g_max = BOUND_ARMS[arm]
  return so.project_gains(constraint, gains=GAINS, g_max=g_max)


def other_fields(arm: str) -> set:
  """The Config fields that other arms read and `arm` does not: kept out of
  its runs' identity and its --set sweeps. An arm keeps its own fields even
  where another arm reads them too (the bound arms read stiefel's); before
  those the arms' fields were disjoint, so no earlier run's identity
  changed.

  >>> sorted(other_fields("stiefel_box")) == sorted(other_fields("stiefel"))
  True
  """
  own = set(ARMS[arm].fields) if arm in ARMS else set()
  return {f for a, other in ARMS.items() if a != arm
          for f in other.fields} - own


def frames(cfg) -> dict:
  """The frame selector of the fused kernel: q and k thirds, per head."""
  return {r"c_attn/kernel$": so.fused_qkv(cfg.n_head)}


def lr_schedule(cfg, peak: float) -> optax.Schedule:
  """nanoGPT's get_lr with peak `peak` and floor peak * min_lr / lr:
  linear warmup peak (it + 1) / (warmup + 1), cosine to the floor at
  lr_decay_iters, the floor after."""
  floor = peak * cfg.min_lr / cfg.learning_rate

  def lr(it):
    it = jnp.asarray(it, jnp.float32)
    warm = peak * (it + 1) / (cfg.warmup_iters + 1)
    ratio = jnp.clip((it - cfg.warmup_iters)
                     / max(cfg.lr_decay_iters - cfg.warmup_iters, 1), 0, 1)
    cos = floor + 0.5 * (1 + jnp.cos(jnp.pi * ratio)) * (peak - floor)
    return jnp.where(it < cfg.warmup_iters, warm,
                     jnp.where(it > cfg.lr_decay_iters, floor, cos))

  return lr


def decay_mask(params):
  """nanoGPT's configure_optimizers: decay every parameter of rank >= 2
  (kernels and both embeddings), not the LayerNorm / RMSNorm scales."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def nanogpt_adamw(cfg) -> optax.GradientTransformation:
  return optax.adamw(lr_schedule(cfg, cfg.learning_rate), cfg.beta1,
                     cfg.beta2, eps=1e-8, weight_decay=cfg.weight_decay,
                     mask=decay_mask)


# MuonClip's threshold (Kimi K2).
QK_CLIP_TAU = 100.0


def qk_clip(n_head: int, tau: float = QK_CLIP_TAU
            ) -> optax.GradientTransformationExtraArgs:
  """MuonClip's QK-clip (Kimi K2, arXiv 2507.20534), after the step it
  follows: with S_h this step's forward-pass max |q . k| / sqrt(head_dim)
  of head h, W+ = W + u, then head h's q and k columns of each layer's
  fused c_attn (d, 3 d) are multiplied by sqrt(tau / S_h) where S_h > tau
  (so that S_h would be tau); other leaves and heads are left as u moved
  them. update(u, state, params, *, max_logit): max_logit (n_layer,
  n_head), as `logit_records` gives it.

  >>> import jax.numpy as jnp
  >>> w = {"h_0": {"attn": {"c_attn": {"kernel": jnp.ones((4, 12))}}}}
  >>> tx = qk_clip(n_head=2, tau=100.0)
  >>> u, _ = tx.update(jax.tree.map(jnp.zeros_like, w), tx.init(w), w,
  ...                  max_logit=jnp.array([[400.0, 50.0]]))
  >>> (u["h_0"]["attn"]["c_attn"]["kernel"][0] + 1).tolist()  # q, k of head 0
  [0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  """

  def update(updates, state, params=None, *, max_logit=None, **extra):
    del extra
    if params is None or max_logit is None:
      raise ValueError("qk_clip needs params and max_logit (the forward"
                       " pass's per-head maxima, (n_layer, n_head)).")
    updates = dict(updates)
    for i in range(max_logit.shape[0]):
      layer = f"h_{i}"
      w = params[layer]["attn"]["c_attn"]["kernel"]
      s = max_logit[i]
      head = jnp.where(s > tau, jnp.sqrt(tau / jnp.where(s > tau, s, tau)),
                       1.0)
      qk = jnp.repeat(head, w.shape[0] // n_head)
      col = jnp.concatenate([qk, qk, jnp.ones(w.shape[1] - 2 * qk.size)])
      u = updates[layer]["attn"]["c_attn"]["kernel"]
      updates[layer] = {**updates[layer], "attn": {
          **updates[layer]["attn"], "c_attn": {
              "kernel": ((w + u) * col - w).astype(u.dtype)}}}
    return updates, state

  return optax.GradientTransformationExtraArgs(
      lambda params: optax.EmptyState(), update)


def make_optimizer(cfg) -> optax.GradientTransformation:
  """The arm's optimizer (`training.arm_optimizer`: its recipe on the Q/K
  frames at its own peak lr, on nanoGPT's schedule, nanoGPT's AdamW on the
  rest), after one global-norm clip of the whole gradient.

  `muon` (`training.per_head_muon`): optax.contrib.muon's dimension
  numbers address whole axes of a leaf, not the q and k thirds of a fused
  (d, 3 d) kernel split per head; `so.frame_partition` hands it exactly
  those views, (2, n_head, d, head_dim) per layer, the same per-head
  matrices the Stiefel arms train, and maps its update back into the fused
  kernel (the v third and every other weight on nanoGPT's AdamW). It runs
  unconstrained (orthonormal_start='project' only skips the start check;
  Muon has no retraction).
  """
  if cfg.arm not in ARMS:
    raise ValueError(f"arm must be one of {tuple(ARMS)}; got {cfg.arm!r}.")
  arm = ARMS[cfg.arm]
  lr = (lr_schedule(cfg, getattr(cfg, arm.fields[0])) if arm.fields
        else None)
  tx = training.arm_optimizer(
      arm, nanogpt_adamw(cfg), lr, frames(cfg), b1=cfg.beta1, b2=cfg.beta2,
      max_step_norm=cfg.max_step_norm, weight_decay=cfg.weight_decay)
  if arm.qk_clip:
    tx = optax.chain(tx, qk_clip(cfg.n_head))
  if cfg.arm in BOUND_ARMS:
    tx = optax.chain(tx, gain_projection(cfg.arm))
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
