"""The model of a configuration (`benchmarks.models.Transformer`), its
evaluation and each arm's initial parameters."""

from __future__ import annotations

import jax

import stiefel_optax as so
from benchmarks import models, training
from benchmarks.grokking.arms import ARMS
from benchmarks.grokking.config import Config
from benchmarks.grokking.data import vocab_size


def make_model(cfg: Config) -> models.Transformer:
  """The answer's logits from the tokens [a, b, =] (models' defaults: no
  LayerNorm, no attention or readout bias, ReLU, last-token readout)."""
  return models.Transformer(models.TransformerConfig(
      vocab_size=vocab_size(cfg.p), seq_len=3, num_classes=cfg.p,
      d_model=cfg.d_model, num_heads=cfg.num_heads, d_mlp=cfg.d_mlp,
      depth=cfg.num_layers))


def evaluate(model: models.Transformer, params, tokens, labels):
  """Mean cross-entropy on the answer token, and accuracy."""
  return training.loss_and_accuracy(
      model.apply({"params": params}, tokens), labels)


def initial_params(cfg: Config, arm: str, seed: int):
  """The seed's initialisation; the arms that start orthonormal (the
  Stiefel arms) replace each Q/K head by its nearest orthonormal frame
  (polar factor), every other weight identical."""
  params = models.init_params(make_model(cfg), jax.random.PRNGKey(seed))
  return so.orthonormalize(params) if ARMS[arm].orthonormal else params
