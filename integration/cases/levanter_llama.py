"""Levanter: a tiny Llama trained by Levanter's own `Trainer` with
``optimizer: {type: stiefel_attention}`` (or ``stiefel_muon``) read from a
YAML by draccus, as a Levanter user writes it.

    python levanter_llama.py [stiefel_attention|stiefel_muon] [default|haliax]

1. The YAML below is parsed into Levanter's config classes (the import of
   `stiefel_optax.integrations.levanter` registers the choices).
2. Levanter's `Trainer` (its mesh, axis mapping, mixed precision, jitted
   step, `TrainerState`) trains the Llama for 5 steps on random tokens.
3. The frames Levanter's trainer ended with are on the manifold.
4. The rest equals Levanter's own ``type: adam`` (``AdamConfig``, the same
   fields) fed the same gradients from the same start.
"""

import dataclasses
import sys
import tempfile

import draccus
import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import yaml
from levanter.data.dataset import ListAsyncDataset
from levanter.models.llama import LlamaConfig
from levanter.models.lm_model import LmConfig, LmExample
from levanter.optim import config as optim_config
from levanter.trainer import Trainer, TrainerConfig
import levanter.trainer

import stiefel_optax.integrations.levanter as stiefel_levanter  # registers
import stiefel_optax as so

import common

OPT = sys.argv[1] if len(sys.argv) > 1 else "stiefel_attention"
FRAMES = sys.argv[2] if len(sys.argv) > 2 else "default"
NAME = f"levanter llama {OPT} frames={FRAMES}"

# What a Levanter user writes: the optimizer block is the change (the type
# line, plus the Stiefel hyperparameters they want to set).
YAML = f"""
trainer:
  num_train_steps: {common.STEPS}
  train_batch_size: 4
  tracker: {{type: noop}}
  require_accelerator: false
  checkpointer: {{base_path: {tempfile.mkdtemp()}}}
  log_dir: {tempfile.mkdtemp()}
model:
  type: llama
  max_seq_len: 16
  hidden_dim: 32
  intermediate_dim: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  gradient_checkpointing: false
optimizer:
  type: {OPT}
  learning_rate: 1e-3
  weight_decay: 0.1
  warmup: 0.2
  stiefel_learning_rate: 1e-2
{"  frames: haliax" if FRAMES == "haliax" else ""}
"""


@dataclasses.dataclass
class Config:
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  model: LmConfig = dataclasses.field(default_factory=LlamaConfig)
  optimizer: optim_config.OptimizerConfig = dataclasses.field(
      default_factory=optim_config.AdamConfig)


def main():
  config = draccus.decode(Config, yaml.safe_load(YAML))
  common.say(NAME, "config", f"optimizer: {type(config.optimizer).__name__}"
             f" (type: {OPT})")
  assert isinstance(config.optimizer, (stiefel_levanter.StiefelAttentionConfig,
                                       stiefel_levanter.StiefelMuonConfig))
  frames = None if config.optimizer.frames is None else config.optimizer.frames
  levanter.trainer.initialize(config)
  optimizer = config.optimizer.build(config.trainer.num_train_steps)
  Vocab = hax.Axis("vocab", 64)
  Pos = config.model.max_Pos

  def loss_fn(model, example, *, key=None):
    return model.compute_next_token_loss(example, key=key)

  tokens = jax.random.randint(jax.random.PRNGKey(0), (8 * common.STEPS, Pos.size), 0,
                              Vocab.size)
  data = ListAsyncDataset([LmExample.causal(hax.named(t, Pos))
                           for t in tokens])
  with Trainer(config.trainer, optimizer, loss_fn) as trainer:
    state = trainer.initial_state(
        jax.random.PRNGKey(1),
        model_init=lambda: config.model.build(Vocab, key=jax.random.PRNGKey(2)))
    # a copy: Levanter's step donates the state's buffers
    start = jax.tree.map(lambda x: jnp.array(x, copy=True)
                         if eqx.is_array(x) else x, state.model)
    common.selected(NAME, eqx.filter(start, eqx.is_inexact_array), frames)
    loader = trainer.data_loader(data)
    batch = next(iter(loader))          # the twins' batch, as Levanter loads it
    info = trainer.train(state, loader)
    trained = info.state.model
    common.say(NAME, "trainer", f"{int(info.state.step)} steps by Levanter's"
               f" Trainer, loss {float(info.loss):.4f}")
    assert int(info.state.step) == common.STEPS, int(info.state.step)
  common.isometry(NAME, eqx.filter(trained, eqx.is_inexact_array), frames)

  # The rest against Levanter's own AdamW (type: adam, the same fields).
  c = config.optimizer
  adam = optim_config.AdamConfig(
      learning_rate=c.learning_rate, weight_decay=c.weight_decay,
      warmup=c.warmup, min_lr_ratio=c.min_lr_ratio, lr_schedule=c.lr_schedule,
      beta1=c.beta1, beta2=c.beta2, epsilon=c.epsilon,
      max_grad_norm=c.max_grad_norm).build(config.trainer.num_train_steps)
  params = eqx.filter(start, eqx.is_inexact_array)

  def grad_fn(p):
    model = eqx.combine(p, start)
    return eqx.filter_grad(lambda m: hax.mean(
        loss_fn(m, batch)).scalar())(model)

  ours, theirs = common.twin(optimizer, adam, params, grad_fn,
                             apply=eqx.apply_updates)
  common.rest_equals(NAME, ours, theirs, frames)
  common.isometry(NAME + " (twin)", ours, frames)
  common.done(NAME)


if __name__ == "__main__":
  main()
