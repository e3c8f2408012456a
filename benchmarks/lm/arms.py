"""Each arm's optimizer, a recipe of library pieces on nanoGPT's AdamW,
learning-rate schedule and weight-decay mask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

import stiefel_optax as so
from benchmarks import training
from benchmarks.lm.config import ARMS, Config
from benchmarks.lm.model import frames


def lr_schedule(cfg: Config, peak: float) -> optax.Schedule:
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


def nanogpt_adamw(cfg: Config) -> optax.GradientTransformation:
  return optax.adamw(lr_schedule(cfg, cfg.learning_rate), cfg.beta1,
                     cfg.beta2, eps=1e-8, weight_decay=cfg.weight_decay,
                     mask=decay_mask)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """The arm's optimizer, after one global-norm clip of the whole gradient.

  `muon` (`training.per_head_muon`): optax.contrib.muon's dimension
  numbers address whole axes of a leaf, not the q and k thirds of a fused
  (d, 3 d) kernel split per head; `so.frame_partition` hands it exactly
  those views, (2, n_head, d, head_dim) per layer, the same per-head
  matrices the Stiefel arms train, and maps its update back into the fused
  kernel (the v third and every other weight on nanoGPT's AdamW). It runs
  unconstrained (orthonormal_start='project' only skips the start check;
  Muon has no retraction).
  """
  adamw = nanogpt_adamw(cfg)
  sched = functools.partial(lr_schedule, cfg)
  sel = frames(cfg)
  if cfg.arm in ("adamw", "qk_norm", "orthogonal_init"):
    tx = adamw
  elif cfg.arm == "stiefel":
    tx = so.stiefel_attention(
        sched(cfg.learning_rate), frames=sel,
        stiefel_learning_rate=sched(cfg.stiefel_learning_rate),
        b1=cfg.beta1, b2=cfg.beta2, max_step_norm=cfg.max_step_norm,
        euclidean_tx=adamw)
  elif cfg.arm == "rsgd":
    tx = so.stiefel_attention(
        sched(cfg.learning_rate), frames=sel,
        stiefel_tx=so.riemannian_sgd(sched(cfg.rsgd_learning_rate)),
        euclidean_tx=adamw)
  elif cfg.arm == "stiefel_muon":
    tx = so.stiefel_attention(
        sched(cfg.learning_rate), frames=sel,
        stiefel_tx=so.stiefel_muon(sched(cfg.stiefel_muon_learning_rate)),
        euclidean_tx=adamw)
  elif cfg.arm == "muon":
    muon = training.per_head_muon(sched(cfg.muon_learning_rate),
                                  cfg.weight_decay)
    tx = so.frame_partition(muon, adamw, sel, orthonormal_start="project")
  else:
    raise ValueError(f"arm must be one of {ARMS}; got {cfg.arm!r}.")
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
