"""Modular-arithmetic grokking: AdamW against Stiefel attention, paired seeds.

    python -m benchmarks.grokking            # reduced default, a few minutes
    python -m benchmarks.grokking --full     # the longer study, resumable
    python -m benchmarks.grokking --full --time-budget 3600
                                             # stops itself between jobs
    python -m benchmarks.grokking --quick    # a smoke run, under a minute
    python -m benchmarks.grokking --report-only --results-md benchmarks/RESULTS.md
                                             # the committed tables and section

Task: (a op b) mod p (p = 97) from the tokens [a, b, =], a seeded share of all
equations for training, the rest for validation, full-batch training.
Model: `benchmarks.models.Transformer` (flax.linen attention), one layer,
no LayerNorm, ReLU MLP, read out at the last token.
Arms (same data split, same initialisation of every non-Q/K weight, same
full-batch order for a seed):

  adamw    every weight on AdamW, weight decay 1.0.
  stiefel  the Q/K kernels' per-head frames orthonormalised at the start and
           trained by `stiefel_optax.stiefel_attention`; the rest AdamW, wd 1.0.
  rsgd     (mechanism probe only) Q/K frames on fixed-step `riemannian_sgd`.

Every `log_every` steps each run records train/validation accuracy and loss,
the isometry error ||W^T W - I||_F of every Q/K frame (the AdamW arm's raw
kernels, per head), the Frobenius norm of every other weight, and the mean
per-step movement ||W_{t+1} - W_t||_F of each Q/K frame over the chunk.
Runs are saved per (arm, seed) with a checkpoint, so a stopped study resumes;
a saved run is reused only under the same identity (configuration, the
equations' md5, library numerics version: `benchmarks.harness`). Output goes to
runs/grokking/<default|full|quick>/ (ignored by git) unless `--out` names a
folder, e.g. one of the committed reference folders under
benchmarks/results/grokking/. Each folder holds study.json (what was asked),
runs/, an optional notes.md (included verbatim) and the results.json,
table.md and plots that `benchmarks.reports.grokking` generates from the
saved runs (as it does the RESULTS.md section).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness, models, modular, study as study_lib
from benchmarks import training
from benchmarks.reports import grokking as report_lib

ARMS = ("adamw", "stiefel")
PROBE_ARM = "rsgd"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run (with the data's md5 and the library
  version, its identity)."""
  p: int = modular.DEFAULT_PRIME
  op: str = "+"
  train_fraction: float = 0.5
  d_model: int = 32
  num_heads: int = 4
  d_mlp: int = 128
  num_layers: int = 1
  learning_rate: float = 1e-3
  stiefel_learning_rate: Optional[float] = None   # None: learning_rate
  weight_decay: float = 1.0
  b1: float = 0.9
  b2: float = 0.98
  max_step_norm: float = 0.1
  rsgd_learning_rate: float = 0.1
  log_every: int = 50
  target_acc: float = 0.95


@dataclasses.dataclass(frozen=True)
class Study:
  """Which runs: `seeds` x arms to `steps`; `long_seed` continued to
  `long_steps` (0: none); the rsgd probe for `probe_steps` on each seed."""
  steps: int
  seeds: tuple
  long_steps: int = 0
  long_seed: int = 0
  probe_steps: int = 0
  arms: tuple = ARMS


  @classmethod
  def from_dict(cls, d: dict) -> "Study":
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in d.items()})


DEFAULT_STUDY = Study(steps=1000, seeds=(0, 1, 2, 3, 4), probe_steps=200)
FULL_STUDY = Study(steps=3000, seeds=(0, 1, 2, 3, 4), long_steps=20000,
                   probe_steps=500)
QUICK_STUDY = Study(steps=100, seeds=(0, 1), probe_steps=50)
QUICK_CONFIG = dict(p=23, d_model=16, num_heads=2, d_mlp=64, log_every=25)


# --------------------------------------------------------------------------
# Model, data, optimizers.


def make_model(cfg: Config) -> models.Transformer:
  """The answer's logits from the tokens [a, b, =] (models' defaults: no
  LayerNorm, no attention or readout bias, ReLU, last-token readout)."""
  return models.Transformer(models.TransformerConfig(
      vocab_size=modular.vocab_size(cfg.p), seq_len=3, num_classes=cfg.p,
      d_model=cfg.d_model, num_heads=cfg.num_heads, d_mlp=cfg.d_mlp,
      depth=cfg.num_layers))


def evaluate(model: models.Transformer, params, tokens, labels):
  """Mean cross-entropy on the answer token, and accuracy."""
  return training.loss_and_accuracy(
      model.apply({"params": params}, tokens), labels)


@functools.lru_cache(maxsize=None)
def data_id(p: int, op: str) -> str:
  """The task's content id: md5 of every equation and its label."""
  return f"modular:md5={harness.md5_arrays(*modular.all_equations(p, op))}"


def run_identity(cfg: Config) -> str:
  return harness.identity(dataclasses.asdict(cfg), data_id(cfg.p, cfg.op))


def make_data(cfg: Config, seed: int) -> modular.Split:
  """The seed's split as device arrays (the same for every arm)."""
  sp = modular.make_split(cfg.p, cfg.op, cfg.train_fraction, seed)
  return modular.Split(*(jnp.asarray(a) for a in sp))


def initial_params(cfg: Config, arm: str, seed: int):
  """The seed's initialisation; Stiefel arms replace each Q/K head by its
  nearest orthonormal frame (polar factor), every other weight identical."""
  params = models.init_params(make_model(cfg), jax.random.PRNGKey(seed))
  return params if arm == "adamw" else so.orthonormalize(params)


def make_optimizer(cfg: Config, arm: str) -> optax.GradientTransformation:
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


# --------------------------------------------------------------------------
# Training: jit over a chunk of `log_every` steps (lax.scan).


def other_norms(params) -> dict:
  """{path: ||x||_F} for every weight that is not a Q/K kernel."""
  frames = so.selected(params)
  return {so.path_str(p): jnp.linalg.norm(x.ravel())
          for p, x in jax.tree_util.tree_leaves_with_path(params)
          if so.path_str(p) not in frames}


@functools.lru_cache(maxsize=None)
def chunk_fn(cfg: Config, arm: str):
  """jit(carry, None, train_x, train_y) -> (carry, mean loss, mean Q/K
  movement): `log_every` full-batch steps of `training.train_chunk`."""
  model, tx = make_model(cfg), make_optimizer(cfg, arm)
  loss = lambda p, x, y: evaluate(model, p, x, y)[0]
  return jax.jit(training.train_chunk(loss, tx, lambda _, x, y: (x, y),
                                      aux_fn=so.frame_movement,
                                      length=cfg.log_every))


@functools.lru_cache(maxsize=None)
def measure_fn(cfg: Config):
  """jit(params, data) -> accuracies, losses, isometry errors, norms."""
  model = make_model(cfg)

  def measure(params, data):
    tl, ta = evaluate(model, params, data.train_x, data.train_y)
    vl, va = evaluate(model, params, data.val_x, data.val_y)
    return dict(train_loss=tl, train_acc=ta, val_loss=vl, val_acc=va,
                iso=so.frame_isometry_errors(params),
                norms=other_norms(params))

  return jax.jit(measure)


def empty_history() -> dict:
  return {k: [] for k in ("step", "train_loss", "train_acc", "val_loss",
                          "val_acc", "iso", "norms", "move")}


def record(hist: dict, step: int, m: dict, move: Optional[dict]) -> None:
  """Appends one measurement (arrays as lists) to the history."""
  m = jax.tree.map(lambda x: np.asarray(x).tolist(), m)
  hist["step"].append(step)
  for k in ("train_loss", "train_acc", "val_loss", "val_acc", "iso", "norms"):
    hist[k].append(m[k])
  hist["move"].append(None if move is None else
                      jax.tree.map(lambda x: np.asarray(x).tolist(), move))


# --------------------------------------------------------------------------
# One run, saved and resumable.


def run_name(arm: str, seed: int) -> str:
  return f"{arm}_seed{seed}"


def train_run(cfg: Config, arm: str, seed: int, steps: int,
              out: Optional[Path] = None, progress=None,
              save_every_s: float = 60.0, command: str = "") -> dict:
  """Trains (arm, seed) to `steps` (a multiple of cfg.log_every), resuming
  from `out`'s saved run of the same identity if there is one (a finished
  one is returned as it is; its checkpoint is kept, so that a longer run
  continues it): `training.train_run`. Returns the run's record."""
  if steps % cfg.log_every:
    raise ValueError(f"steps = {steps} is not a multiple of log_every ="
                     f" {cfg.log_every}.")
  data, measure = make_data(cfg, seed), measure_fn(cfg)
  chunk = chunk_fn(cfg, arm)

  def start():
    params = initial_params(cfg, arm, seed)
    run = dict(arm=arm, seed=seed, config=dataclasses.asdict(cfg),
               identity=run_identity(cfg), data=data_id(cfg.p, cfg.op),
               **harness.versions(),
               machine=harness.machine(), trained_by=[],
               n_train=int(data.train_x.shape[0]),
               n_val=int(data.val_x.shape[0]),
               wall_s=0.0, cpu_s=0.0, history=empty_history())
    return run, (params, make_optimizer(cfg, arm).init(params))

  def advance(carry, _):   # full batch: the step number is not read
    carry, _, move = chunk(carry, None, data.train_x, data.train_y)
    return carry, move

  return training.train_run(
      harness.RunStore(out) if out is not None else None,
      run_name(arm, seed), run_identity(cfg), start=start, chunk=advance,
      record=lambda run, carry, it, move, _: record(
          run["history"], it, measure(carry[0], data), move),
      every=cfg.log_every, stop=steps, progress=progress, command=command,
      save_every_s=save_every_s)


def load_run(cfg: Config, arm: str, seed: int, out: Path,
             runs_from: Sequence[str] = ()) -> Optional[dict]:
  """The saved (possibly partial) run of this configuration under any
  library version (what a report shows), from out or else from the folders
  `runs_from` (relative to out), or None."""
  for folder in [out] + [out / r for r in runs_from]:
    run = harness.RunStore(folder).load_matching(
        run_name(arm, seed), dataclasses.asdict(cfg), data_id(cfg.p, cfg.op))
    if run is not None:
      return run
  return None


# --------------------------------------------------------------------------
# The study.


def schedule(study: Study) -> list:
  """(arm, seed, steps) in run order: the seed study first, then the rsgd
  probe, then the long seed continued."""
  jobs = [(arm, seed, study.steps) for seed in study.seeds
          for arm in study.arms]
  if study.probe_steps:
    jobs += [(PROBE_ARM, seed, study.probe_steps) for seed in study.seeds]
  if study.long_steps > study.steps:
    jobs += [(arm, study.long_seed, study.long_steps) for arm in study.arms]
  return jobs


def saved_study(cfg: Config, study: Study, out: Path,
                runs_from: Sequence[str] = ()) -> dict:
  """Every saved run of the study as it is (partial runs included)."""
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  for arm, seed, _ in schedule(study):
    run = load_run(cfg, arm, seed, out, runs_from)
    if run is not None:
      runs[arm][seed] = run
  return runs


def remaining(cfg: Config, job: tuple, out: Optional[Path]) -> int:
  arm, seed, steps = job
  run = (harness.RunStore(out).load(run_name(arm, seed), run_identity(cfg))
         if out is not None else None)
  return max(0, steps - (run["history"]["step"][-1] if run else 0))


def part_of(cfg: Config, jobs: list, out: Optional[Path], part: int,
            parts: int) -> list:
  """The jobs of `part` (0-based) of `parts` processes: jobs of the same
  (arm, seed) stay together, groups go greedily (largest remaining steps
  first) to the least loaded part, so parallel processes balance and never
  train the same run."""
  groups = {}
  for job in jobs:
    groups.setdefault(job[:2], []).append(job)
  load, assign = [0] * parts, [[] for _ in range(parts)]
  for key in sorted(groups, key=lambda k: -max(
      remaining(cfg, j, out) for j in groups[k])):
    i = load.index(min(load))
    load[i] += max(remaining(cfg, j, out) for j in groups[key])
    assign[i] += groups[key]
  return [j for j in jobs if j in assign[part]]


def run_study(cfg: Config, study: Study, out: Optional[Path],
              show_progress: bool = False, part: int = 0,
              parts: int = 1, command: str = "",
              time_budget: float = 0.0) -> dict:
  """Runs (or resumes) every job (or one part of them); returns the runs
  keyed arm -> seed. With time_budget > 0 it stops before a job expected
  to end past that many seconds (the steps it has left, at the seconds per
  step trained so far in this call); the first job always runs."""
  jobs = schedule(study)
  if parts > 1:
    jobs = part_of(cfg, jobs, out, part, parts)
  bar = None
  if show_progress:
    from tqdm import tqdm
    bar = tqdm(total=sum(j[2] for j in jobs), unit="step", desc="grokking",
               mininterval=5.0)
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  spent = [0.0, 0]   # seconds and steps trained so far (resumed ones not)

  def execute(job):
    arm, seed, steps = job
    if bar is not None:
      bar.set_postfix_str(f"{arm} seed {seed} -> {steps}")
    todo, t0 = remaining(cfg, job, out), time.time()
    runs[arm][seed] = train_run(cfg, arm, seed, steps, out, bar,
                                command=command)
    spent[0] += time.time() - t0
    spent[1] += todo
    return runs[arm][seed]

  def expected_s(job) -> Optional[float]:
    return (remaining(cfg, job, out) * spent[0] / spent[1] if spent[1]
            else None)

  # The shared runner; the bar counts steps here (a run's length varies).
  left = study_lib.run_list(
      jobs, execute, desc="grokking", describe=lambda job, _: f"{job[0]}"
      f" seed {job[1]}: step {job[2]}", log=lambda _: None, progress=False,
      expected_s=expected_s, time_budget=time_budget)
  if bar is not None:
    bar.close()
  if left:   # stopped by the time budget: say so (the bar does not)
    print(f"time budget {time_budget:.0f} s: stopped with {len(left)} job(s)"
          " left; the same command resumes them.", file=sys.stderr)
  return runs


def load_spec(out: Path):
  """(cfg, study, runs_from) from <out>/study.json, or None."""
  spec = harness.read_json(out / "study.json")
  if spec is None:
    return None
  return (Config(**spec["config"]), Study.from_dict(spec["study"]),
          tuple(spec.get("runs_from", ())))


def load_study(out: Path) -> tuple:
  """(cfg, study, runs) of the study saved in `out` (its study.json and
  every saved run, partial ones included): what its report reads."""
  cfg, study, runs_from = load_spec(out)
  return cfg, study, saved_study(cfg, study, out, runs_from)


def parse_args(argv):
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.grokking", description=__doc__.split("\n")[0])
  harness.add_common_args(
      p, default_out_dir="runs/grokking/<default|full|quick>",
      seeds_default="0-4",
      quick_help="a smoke run (under a minute): p = 23, d = 16, 2 seeds x"
                 " 100 steps")
  p.add_argument("--full", action="store_true",
                 help="the longer study (5 seeds per arm + one long run)")
  p.add_argument("--steps", type=int, help="steps per seed")
  p.add_argument("--long-steps", type=int, help="long run's steps (0: none)")
  p.add_argument("--long-seed", type=int, help="the seed of the long run")
  p.add_argument("--probe-steps", type=int, help="rsgd probe steps (0: none)")
  p.add_argument("--log-every", type=int, help="steps per logged record")
  p.add_argument("--p", type=int, help="the prime modulus")
  p.add_argument("--train-fraction", type=float)
  p.add_argument("--op", choices=modular.OPS)
  p.add_argument("--d-model", type=int)
  p.add_argument("--num-heads", type=int)
  p.add_argument("--d-mlp", type=int)
  p.add_argument("--num-layers", type=int)
  p.add_argument("--learning-rate", type=float)
  p.add_argument("--no-plots", action="store_true")
  p.add_argument("--part", default="0/1",
                 help="K/N: run only part K of N parallel processes (then"
                      " report with --report-only)")
  p.add_argument("--note", default="",
                 help="free text written to <out>/notes.md, which every"
                      " report of that folder includes verbatim")
  p.add_argument("--no-progress", action="store_true")
  harness.add_time_budget_arg(p, "job")
  return p.parse_args(argv)


def configure(args) -> tuple:
  """(cfg, study, out, runs_from); --report-only on a folder with a
  study.json reports the study saved there."""
  preset = "quick" if args.quick else "full" if args.full else "default"
  out = args.out or harness.default_out("grokking", preset)
  if args.report_only and (spec := load_spec(out)) is not None:
    return (*spec[:2], out, spec[2])
  cfg = Config(**(QUICK_CONFIG if args.quick else {}))
  overrides = harness.given(args, (
      "p", "log_every", "train_fraction", "op", "d_model", "num_heads",
      "d_mlp", "num_layers", "learning_rate"))
  if args.d_model and not args.d_mlp:
    overrides["d_mlp"] = 4 * args.d_model
  cfg = dataclasses.replace(cfg, **overrides)
  study = dict(quick=QUICK_STUDY, full=FULL_STUDY).get(preset, DEFAULT_STUDY)
  study = dataclasses.replace(
      study, seeds=args.seeds or study.seeds, **harness.given(
          args, ("steps", "long_steps", "long_seed", "probe_steps")))
  for name in ("steps", "long_steps", "probe_steps"):
    n = getattr(study, name)
    if n % cfg.log_every:
      raise SystemExit(f"--{name.replace('_', '-')} = {n} must be a multiple"
                       f" of log_every = {cfg.log_every}.")
  return cfg, study, out, ()


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  t0 = time.time()
  if args.report_only and args.results_md and args.out is None:
    report_lib.write_section(args.results_md, load_study, PROBE_ARM,
                             plots=not args.no_plots)
    print(f"{args.results_md}: {report_lib.SECTION} regenerated from"
          f" {harness.portable(report_lib.SECTION_TEMPLATE)} and the runs it"
          " names")
    return {}
  cfg, study, out, runs_from = configure(args)
  if args.note:
    harness.write_text(out / "notes.md", args.note.strip() + "\n")
  if not args.report_only:
    harness.write_json(out / "study.json", dict(
        config=dataclasses.asdict(cfg), study=dataclasses.asdict(study)),
                       indent=1)
    part, parts = (int(x) for x in args.part.split("/"))
    run_study(cfg, study, out, not args.no_progress, part, parts,
              harness.command_line("benchmarks.grokking", argv),
              args.time_budget)
  rep = report_lib.report(out, cfg, study,
                          saved_study(cfg, study, out, runs_from), PROBE_ARM,
                          plots=not args.no_plots)
  if args.results_md:
    report_lib.write_section(args.results_md, load_study, PROBE_ARM,
                             plots=not args.no_plots)
  print(rep["table"])
  print(f"\nresults: {out} ({time.time() - t0:.0f} s this invocation)")
  return rep


if __name__ == "__main__":
  main()
