"""The learning-rate sweep on CIFAR (issue 30 item 5; its plan is the
dated CIFAR section of benchmarks/results/lm/robustness_plan.md): the LM's
sweep (`benchmarks.sweep`) on the patch transformer, every arm on the base
learning rate eta of its AdamW-trained weights, its Q/K rate and cap
moving with eta by the CIFAR study's ratios; each run trained on the
tuning pool and scored on the validation split after every epoch, stopped
where it diverges. Here: the sweeps (`SWEEPS`), a point's hyperparameters
(`point`), a run's name and its training (`train_run`), and what the
sweep's command (`benchmarks.sweep.main`) is handed (`SWEEP_EXPERIMENT`):
the runs' training (`prepare`) and the report (`robustness_report`).

>>> point(SWEEP, "stiefel", 1e-3)
({'lr': 1.11, 'cap': 0.01}, {'lr': 0.001, 'weight_decay': 0.25})
>>> point(SWEEP, "qk_norm", 1e-3)[0]       # its own AdamW at eta
{'lr': 0.001, 'weight_decay': 0.25}
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

import jax.numpy as jnp
import numpy as np

import stiefel_optax as so
from benchmarks import harness, sweep as sweep_lib, training
from benchmarks.cifar_patches.arms import ARMS, frames_of
from benchmarks.cifar_patches.config import DEFAULT, QUICK, SWEEP_NAMING, Config
from benchmarks.cifar_patches import data as cifar_data
from benchmarks.cifar_patches.data import seed_stream
from benchmarks.cifar_patches.train import STEPPED, Trainer, init_params
from benchmarks.reports import robustness as report_lib

SECTION = "## Learning-rate robustness (CIFAR)"
PLAN = "benchmarks/results/lm/robustness_plan.md"


@dataclasses.dataclass(frozen=True)
class Sweep(sweep_lib.Sweep):
  """`benchmarks.sweep.Sweep` (ratios {arm: {hp: multiple of eta}}) with
  the weight decay of every AdamW recipe and base, the run configuration."""
  weight_decay: float
  base: Config


# The study's choices against adamw's lr 1e-2 (results/cifar/summary.json
# chosen): stiefel lr 11.1 with cap 0.1, rsgd 10; weight decay 0.25.
RATIOS = {"stiefel": {"lr": 1110.0, "cap": 10.0}, "rsgd": {"lr": 1000.0}}
SWEEP = Sweep(arms=("adamw", "stiefel", "rsgd", "qk_norm"),
              grid=(1e-3, 3e-3, 1e-2, 3e-2, 0.1), extension=(0.3, 1.0),
              ratios=RATIOS, seeds=(1000, 1001, 1002), weight_decay=0.25,
              base=DEFAULT)
# The same path at toy size (`--robustness --quick`, well under a minute).
QUICK_SWEEP = Sweep(arms=("adamw", "stiefel"), grid=(1e-2, 30.0),
                    extension=(300.0,), ratios=RATIOS, seeds=(1000,),
                    weight_decay=0.25, base=QUICK)
SWEEPS = {"full": SWEEP, "quick": QUICK_SWEEP}
# Arms whose own AdamW sets every weight (no separate Q/K rate).
OWN_BASE = ("adamw", "qk_norm")


def point(sweep: Sweep, arm: str, eta: float) -> tuple:
  """(hp, base) of the arm at eta: its Q/K hyperparameters and the AdamW of
  the other weights (`arms.make_optimizer`)."""
  base = {"lr": eta, "weight_decay": sweep.weight_decay}
  return (dict(base) if arm in OWN_BASE else sweep.rates(arm, eta)), base


def run_config(sweep: Sweep, arm: str, eta: float) -> dict:
  """What a run's identity hashes besides the data: the configuration, the
  arm and its point."""
  hp, base = point(sweep, arm, eta)
  return dict(sweep.base.to_dict(), arm=arm, hp=hp, base=base)


def task_name(sweep: Sweep, task: tuple, data_id: str) -> str:
  """<arm>__eta<eta>__s<seed>__<identity[:8]>."""
  arm, eta, seed = task
  return harness.run_name((arm, f"eta{eta:g}"), seed, SWEEP_NAMING,
                          config=run_config(sweep, arm, eta), data=data_id)


def names(sweep: Sweep, data_id: str) -> sweep_lib.Names:
  return lambda task: task_name(sweep, task, data_id)


def train_run(trainer: Trainer, sweep: Sweep, task: tuple,
              out: Optional[pathlib.Path], *, command: str = "",
              log=print) -> dict:
  """Trains one sweep run on the tuning pool, an epoch per chunk, the
  validation loss and accuracy recorded at the start and after each epoch
  (with the Stiefel arms' step records), stopped by the divergence rule;
  saved under out/runs/ (None: not saved)."""
  arm, eta, seed = task
  cfg, name_ = trainer.cfg, task_name(sweep, task, trainer.data_id)
  hp, base = point(sweep, arm, eta)
  config = run_config(sweep, arm, eta)
  ident = harness.run_identity(config, trainer.data_id)
  n = len(trainer.pool)
  tx, epoch = trainer.epoch_fn(arm, hp, base, n, records=True)
  evaluate = trainer.accuracy(ARMS[arm], with_loss=True)
  xv, yv = trainer.x[trainer.val], trainer.y[trainer.val]
  idx = seed_stream(seed, trainer.pool, n, cfg)
  steps = n // cfg.batch

  def start():
    params = init_params(trainer.model_of(ARMS[arm]), ARMS[arm], seed)
    run = dict(name=name_, arm=arm, eta=eta, seed=seed, hp=hp, base=base,
               n=n, config=config, identity=ident, data=trainer.data_id,
               **harness.versions(), machine=harness.machine(),
               trained_by=[], wall_s=0.0, cpu_s=0.0, final=None,
               history={k: [] for k in HISTORY})
    return run, (params, tx.init(params))

  def chunk(carry, it):
    carry, loss, aux = epoch(carry, jnp.asarray(idx[it // steps]),
                             trainer.x, trainer.y)
    return carry, (loss, aux)

  def record(run, carry, it, out_, wall_s):
    hist = run["history"]
    loss, acc = evaluate(carry[0], xv, yv)
    train_loss, aux = (None, {}) if out_ is None else (out_[0], out_[1] or {})
    hist["step"].append(it)
    vals = dict(val_loss=loss, val_acc=acc, train_loss=train_loss,
                qk_iso=so.max_isometry_error(carry[0], frames_of(ARMS[arm])),
                **{k: aux.get(k) for k in ("step_norm", "cap_binds")})
    for k, v in vals.items():
      hist[k].append(harness.json_value(v))
    hist["wall_s"].append(round(wall_s, 2))
    log(f"  {name_} step {it}: train {hist['train_loss'][-1]}, val"
        f" {hist['val_loss'][-1]} ({hist['wall_s'][-1]:.0f} s)")
    return sweep_lib.divergence(hist, ("val_loss",))

  def finish(run, carry):
    hist = run["history"]
    return dict(step=hist["step"][-1], val_loss=hist["val_loss"][-1],
                val_acc=hist["val_acc"][-1], train_loss=hist["train_loss"][-1],
                qk_iso=hist["qk_iso"][-1])

  store = harness.RunStore(out) if out is not None else None
  return training.train_run(store, name_, ident, start=start, chunk=chunk,
                            record=record, every=steps,
                            stop=steps * cfg.epochs, finish=finish,
                            command=command, save_every_s=float("inf"))


HISTORY = ("step", "val_loss", "val_acc", "train_loss", "qk_iso",
           "step_norm", "cap_binds", "wall_s")


# --------------------------------------------------------------------------
# CIFAR's side of the sweep's command (`benchmarks.sweep.main`).


def prepare(sweep: Sweep, out: pathlib.Path, opts) -> tuple:
  """(data_id, execute, run's other arguments) of the sweep on the data
  (--quick: synthetic images; else --data, --download): each run trained
  by `train_run`, its expected time the median of out's finished runs'."""
  data = (cifar_data.synthetic(448, sweep.base.val_size) if opts.quick
          else cifar_data.load_cifar10(opts.data,
                                       download_missing=opts.download))
  trainer, store = Trainer(data, sweep.base), harness.RunStore(out)

  def expected_s(_task) -> Optional[float]:
    walls = [r["wall_s"] for r in store.records() if r.get("final")]
    return float(np.median(walls)) if walls else None

  def describe(task, rec: dict) -> str:
    f = rec["final"]
    return (f"{rec['name']}: val loss {f['val_loss']}, acc {f['val_acc']},"
            f" {rec['wall_s']:.0f}s" + sweep_lib.stopped_text(rec))

  return data.source, lambda t: train_run(
      trainer, sweep, t, out, command=opts.command, log=opts.log), dict(
          describe=describe, expected_s=expected_s, desc="cifar robustness")


def robustness_report(sweep: Sweep, preset: str, out: pathlib.Path,
                      data_id: Optional[str] = None,
                      results_md: Optional[pathlib.Path] = None) -> dict:
  """`benchmarks.reports.robustness.report` of out's runs of the sweep on
  the data `data_id` (None: the data the runs record,
  `harness.recorded_data`; its plots linked from results_md's folder)."""
  done = sweep_lib.saved(out)
  data_id = data_id or harness.recorded_data(done.values()) or ""
  name_of = names(sweep, data_id)
  # A name holds its run's identity, which a new numerics version changes:
  # the runs of this sweep made under any version, under today's names.
  done = {name_of((r["arm"], r["eta"], r["seed"])): r for r in done.values()
          if harness.matches(r, run_config(sweep, r["arm"], r["eta"]),
                             data_id)}
  m = sweep.base.model
  return report_lib.report(
      out, sweep_lib.rows(sweep, done, name_of), plan=PLAN,
      grid=sweep_lib.grid(sweep, done, name_of), seeds=sweep.seeds,
      left=len(sweep_lib.remaining(sweep, done, name_of)),
      figures=sweep_lib.figures(out, results_md),
      heading=SECTION, title="CIFAR", loss_key="val_loss", step_arms=STEPPED,
      loss_text=f"validation loss on the {sweep.base.val_size:,}-image"
      " validation split",
      setting=(
          f"The CIFAR study's {'toy' if preset == 'quick' else 'main'}"
          f" configuration (patch ViT d {m.dim}, {m.heads} heads, depth"
          f" {m.depth}, batch {sweep.base.batch}, {sweep.base.epochs}"
          f" epochs), trained on the tuning pool and scored on the"
          f" validation split, data {data_id}; weight decay"
          f" {sweep.weight_decay:g}; an arm's Q/K rates move with eta by its"
          f" study ratio ({sweep.ratio_text()});"
          " adamw and qk_norm train every weight at eta."))


SWEEP_EXPERIMENT = sweep_lib.SweepExperiment(
    sweeps=SWEEPS, folder="cifar_robustness", section=SECTION, names=names,
    prepare=prepare, report=robustness_report)
