"""MaxText 0.2.5: a tiny llama2-style decoder with ``opt_type:
stiefel_attention`` (or ``stiefel_muon``), routed as docs/families.md shows.

    python maxtext_decoder.py ROUTE [scan|unscanned] [gqa|mha] [fused_qkv] [muon]

ROUTE:
  train      MaxText's own train.py loop (`train.initialize` with the
             config overrides a user passes, `train.train_loop`: its
             TrainStateNNX + nnx.Optimizer, schedule, sharding, synthetic
             data) for 5 steps; then the frames of the state it returns.
             The rest: TrainStateNNX.apply_gradients with our optimizer
             beside one with MaxText's opt_type adamw, the same gradients.
  nnx_state  optax on MaxText's nnx.State (`nnx.split(model, nnx.Param,
             ...)`, tx.init / tx.update in a jitted step), beside
             MaxText's adamw.
  linen      MaxText's Linen route (`transformer_as_linen`, init/apply on a
             params dict), optax beside MaxText's adamw.

The route lines (`stiefel_optax.integrations.maxtext.ROUTE`) are added to
the installed MaxText first, as a user adds them to theirs.
"""

import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import maxtext
from stiefel_optax.integrations import maxtext as stiefel_maxtext

# The route, in the installed MaxText, before MaxText's modules load.
PKG = os.path.dirname(maxtext.__file__)
stiefel_maxtext.route(PKG)

from maxtext.common import train_state_nnx  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.optimizers import optimizers  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils  # noqa: E402
from maxtext.models import models  # noqa: E402

import stiefel_optax as so  # noqa: E402
import common  # noqa: E402

ARGS = sys.argv[1:]
ROUTE = ARGS[0] if ARGS else "train"
SCAN = "unscanned" not in ARGS
GQA = "mha" not in ARGS
FUSED = "fused_qkv" in ARGS
OPT = "stiefel_muon" if "muon" in ARGS else "stiefel_attention"
NAME = "maxtext " + " ".join([ROUTE, "scan" if SCAN else "unscanned",
                              "gqa" if GQA else "mha"]
                             + (["fused_qkv"] if FUSED else []) + [OPT])

# What a MaxText user passes (the config lines of docs/families.md): the
# optimizer lines, on a tiny model for the CPU.
OVERRIDES = {
    "opt_type": OPT, "learning_rate": 1e-3, "stiefel_learning_rate": 1e-2,
    "warmup_steps_fraction": 0.2, "adam_weight_decay": 0.1,
    "run_name": "stiefel", "base_output_directory": tempfile.mkdtemp(),
    "hardware": "cpu", "dataset_type": "synthetic",
    "steps": common.STEPS, "enable_checkpointing": False,
    "per_device_batch_size": 2, "max_target_length": 16,
    "base_emb_dim": 32, "base_num_query_heads": 4,
    "base_num_kv_heads": 2 if GQA else 4, "head_dim": 8, "base_mlp_dim": 64,
    "base_num_decoder_layers": 2, "vocab_size": 128,
    "scan_layers": SCAN, "fused_qkv": FUSED, "attention": "dot_product",
    "dtype": "float32", "weight_dtype": "float32",
    "enable_goodput_recording": False, "log_period": common.STEPS,
    "skip_first_n_steps_for_profiler": 0, "enable_tensorboard": False,
    "skip_jax_distributed_system": True,
}


def config_of(**changes):
  argv = [None, os.path.join(PKG, "configs", "base.yml")] + [
      f"{k}={v}" for k, v in {**OVERRIDES, **changes}.items()]
  return pyconfig.initialize(argv)


def tokens(config, seed=0):
  batch = int(config.global_batch_size_to_train_on)
  t = jax.random.randint(jax.random.PRNGKey(seed),
                         (batch, config.max_target_length), 0,
                         config.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(config.max_target_length), t.shape)
  return t, pos


def xent(logits, t):
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, t[:, 1:, None], -1))


def adamw_of(config):
  """MaxText's own opt_type adamw, with the same settings."""
  return optimizers.get_optimizer(config_of(opt_type="adamw"),
                                  maxtext_utils.create_learning_rate_schedule(
                                      config))


def nnx_model(config):
  mesh = maxtext_utils.get_mesh_from_config(config)
  make = model_creation_utils.get_nnx_create_model_fn(config, mesh=mesh)
  return make(), mesh


def pure(tree):
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def run_train():
  config, recorder = train.initialize([None, os.path.join(
      PKG, "configs", "base.yml")] + [f"{k}={v}" for k, v in
                                      OVERRIDES.items()])
  common.say(NAME, "config", f"opt_type {config.opt_type.value}: "
             f"{type(optimizers.get_optimizer(config, lambda s: 1e-3)).__name__}")
  state = train.train_loop(config, recorder)
  params = pure(state["model"]) if "model" in state else pure(state)
  common.selected(NAME, params)
  steps = int(np.asarray(pure(state)["optimizer"]["step"]))
  common.say(NAME, "trainer", f"{steps} steps by MaxText's train_loop")
  assert steps == common.STEPS, steps
  common.isometry(NAME, params)

  # The rest: MaxText's TrainStateNNX + nnx.Optimizer, ours beside adamw's.
  schedule = maxtext_utils.create_learning_rate_schedule(config)
  tx = optimizers.get_optimizer(config, schedule)
  model, mesh = nnx_model(config)
  twin_model = nnx.clone(model)
  ours = train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx,
                                                            wrt=nnx.Param))
  theirs = train_state_nnx.TrainStateNNX(
      twin_model, nnx.Optimizer(twin_model, adamw_of(config), wrt=nnx.Param))
  t, pos = tokens(config)

  @nnx.jit
  def step(ours, theirs):
    grads = nnx.grad(lambda m: xent(m(t, pos, enable_dropout=False), t))(
        ours.model)
    ours.apply_gradients(grads)
    theirs.apply_gradients(grads)

  with jax.set_mesh(mesh):
    for _ in range(common.STEPS):
      step(ours, theirs)
  a = pure(nnx.state(ours.model, nnx.Param))
  b = pure(nnx.state(theirs.model, nnx.Param))
  common.rest_equals(NAME + " (TrainStateNNX)", a, b)
  common.isometry(NAME + " (TrainStateNNX)", a)


def run_nnx_state():
  config = config_of()
  schedule = maxtext_utils.create_learning_rate_schedule(config)
  tx = optimizers.get_optimizer(config, schedule)
  model, mesh = nnx_model(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  common.selected(NAME, params)
  t, pos = tokens(config)

  def grad_fn(p):
    return jax.grad(lambda p: xent(nnx.merge(graphdef, p, rest)(
        t, pos, enable_dropout=False), t))(p)

  with jax.set_mesh(mesh):
    ours, theirs = common.twin(tx, adamw_of(config), params, grad_fn)
  common.rest_equals(NAME, pure(ours), pure(theirs))
  common.isometry(NAME, pure(ours))


def run_linen():
  config = config_of()
  schedule = maxtext_utils.create_learning_rate_schedule(config)
  tx = optimizers.get_optimizer(config, schedule)
  mesh = maxtext_utils.get_mesh_from_config(config)
  quant = None
  model = models.transformer_as_linen(config, mesh, quant=quant)
  t, pos = tokens(config)
  with jax.set_mesh(mesh):
    variables = model.init({"params": jax.random.PRNGKey(0),
                            "dropout": jax.random.PRNGKey(1)}, t, pos,
                           enable_dropout=False)
    params = jax.tree.map(lambda x: x, variables["params"])
    params = jax.tree.map(
        lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
        is_leaf=lambda x: hasattr(x, "unbox"))
    common.selected(NAME, params)

    def grad_fn(p):
      return jax.grad(lambda p: xent(model.apply(
          {"params": p}, t, pos, enable_dropout=False), t))(p)

    ours, theirs = common.twin(tx, adamw_of(config), params, grad_fn)
  common.rest_equals(NAME, ours, theirs)
  common.isometry(NAME, ours)


def main():
  {"train": run_train, "nnx_state": run_nnx_state, "linen": run_linen}[
      ROUTE]()
  common.done(NAME)


if __name__ == "__main__":
  main()
