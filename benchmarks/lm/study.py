"""The study (issue 14): fair tuning on validation, then paired seeds, as one
resumable command (`--study`). `benchmarks.study` plans it from the
finished runs, so a rerun recomputes the same plan, skips what is done and
picks up where it stopped; what is the LM's own is here: its grids and
studies (`STUDIES`), the configuration of each planned run and the nanoGPT
reference; and what the report (`benchmarks.reports.lm`) reads: the
study's state, the plan read against the finished runs (any library
version), which it turns into the study's tables (`write_report`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Mapping, Optional, Sequence

from benchmarks import harness, study as study_lib
from benchmarks.lm.arms import ARMS
from benchmarks.lm.config import CPU, PRESETS, QUICK, Config, run_name
from benchmarks.lm.data import CORPUS_MD5
from benchmarks.reports import lm as report_lib

# The committed study's runs (also the timing reference of other runs).
REFERENCE_DIR = harness.REFERENCE_ROOT / "lm"
# The AdamW recipes tune AdamW's own lr and weight decay; every other arm
# tunes its Q/K group on top of adamw's chosen lr and weight decay (its
# non-Q/K weights are trained by that AdamW).
OWN_ADAMW = ("adamw", "qk_norm", "orthogonal_init")
# min_lr = lr / 10: nanoGPT's floor, and that of every run made so far.
LR_FLOOR = 10
# 3 half-decade points per hyperparameter, for every arm (fair tuning).
ADAMW_GRID = (("learning_rate", (1e-3, 3e-3, 1e-2)),
              ("weight_decay", (0.03, 0.1, 0.3)))
STAGES = ("reference",) + study_lib.STAGES


@dataclasses.dataclass(frozen=True)
class Study(study_lib.Study):
  """The shared study (`benchmarks.study.Study`: arms with their grids,
  axes ((Config field, values), ...), tuning seeds, main and other seeds)
  at the LM's settings, each tuning point scored by the mean over the
  tuning seeds of the whole-split validation loss (lower is better).

  base: the paired runs' configuration (its arm is ignored); the nanoGPT
  reference is base as it is (AdamW at nanoGPT's published settings), its
  own record at reference_seeds. tune_iters: the tuning runs' schedule
  (max_iters = lr_decay_iters; the rest as base).
  """
  higher_is_better: bool = False
  base: Config = CPU
  tune_iters: int = 500
  reference_seeds: tuple = ()


def study_arms(grids: Sequence[tuple], main=("adamw", "stiefel")) -> tuple:
  """The arms of grids ((arm, axes), ...), in that order: the main ones
  tuned and paired first, the AdamW recipes (OWN_ADAMW) on their own
  non-Q/K AdamW, the others on adamw's choice."""
  return tuple(study_lib.PlanArm(a, axes, own_base=a in OWN_ADAMW, main=a in main)
               for a, axes in grids)


# The study at nanoGPT's CPU config. Tuning on the 500-iteration schedule
# (decay to 500) on which the earlier tuning runs were made (those runs
# count where their identity, library version included, matches); tuning
# seeds 100-102 are neither discovery nor confirmation seeds.
# Grid centres: AdamW's earlier short-schedule best (4e-3, on its edge) and
# nanoGPT's weight decay; Stiefel's earlier choice (0.3, 0.3); for RSGD the
# Q/K tangent gradients' Frobenius norm per head (about 3e-3 at the start,
# after the clip), so that lr 10 moves a frame as far as Stiefel-Adam's
# lr 0.03-0.3; Stiefel-Muon's step is lr sqrt(head_dim) in Frobenius (so
# 0.03 is about Stiefel-Adam's 0.2); Muon's consistent-RMS lr reads as
# AdamW's. Stiefel-Muon and Muon have nothing else to tune here (momentum
# 0.95 with Nesterov, Muon's defaults, as every Muon arm).
# Stiefel's trust-region radius is tuned relative to its lr (max_step_norm
# = max_step_ratio x lr): the step's norm is lr ||m|| / sqrt(v) with ||m||
# <= sqrt(v) nearly always, so a radius at or above the lr does not bind
# (the CIFAR study's lr 0.1 runs at caps 0.1, 0.3 and 1 were one run), and
# an absolute radius axis would spend a
# third of the grid on copies of one point. Ratio 1 is the uncapped step.
STUDY = Study(
    arms=study_arms((
        ("adamw", ADAMW_GRID),
        ("stiefel", (("stiefel_learning_rate", (0.1, 0.3, 1.0)),
                     ("max_step_ratio", (0.1, 0.3, 1.0)))),
        ("rsgd", (("rsgd_learning_rate", (3.0, 10.0, 30.0)),)),
        ("stiefel_muon", (("stiefel_muon_learning_rate", (0.01, 0.03, 0.1)),)),
        ("muon", (("muon_learning_rate", (1e-3, 3e-3, 1e-2)),)),
        ("qk_norm", ADAMW_GRID),
        ("orthogonal_init", ADAMW_GRID))),
    tune_seeds=(100, 101, 102),
    main_seeds=harness.DISCOVERY_SEEDS[:8] + harness.CONFIRMATION_SEEDS[:8],
    other_seeds=harness.DISCOVERY_SEEDS[:6] + harness.CONFIRMATION_SEEDS[:6],
    base=CPU, tune_iters=500, reference_seeds=(0, 1, 2, 3))
# The whole path at toy size (`--study --quick`, well under a minute): one
# tuning seed, a 2-point AdamW grid (its best is on an edge, so it is
# widened once), one point for the others, one non-main arm, two seeds per
# block. Tuning on the paired schedule, so that each tuned configuration is
# compiled once for both. Width 8 (2 heads of 4): each run ends with the
# loss over the whole validation split, whose cost grows with the width.
QUICK_STUDY_BASE = dataclasses.replace(
    QUICK, n_layer=1, n_embd=8, block_size=8, max_iters=20,
    lr_decay_iters=20, eval_interval=10, eval_iters=2)
QUICK_STUDY = Study(
    arms=study_arms((
        ("adamw", (("learning_rate", (1e-3, 1e-2)), ("weight_decay", (0.1,)))),
        ("stiefel", (("stiefel_learning_rate", (0.3,)),
                     ("max_step_ratio", (1.0,)))),
        ("orthogonal_init", (("learning_rate", (1e-2,)),
                             ("weight_decay", (0.1,)))))),
    tune_seeds=(100,), main_seeds=(0, 1, 500, 501),
    other_seeds=(0, 1, 500, 501), max_extensions=1,
    base=QUICK_STUDY_BASE, tune_iters=20, reference_seeds=(0,))
STUDIES = {"full": STUDY, "quick": QUICK_STUDY}


def point_config(base: Config, arm: str, hp: Mapping, iters: int) -> Config:
  """base for `arm` on a schedule of `iters` iterations (decayed to the
  end) with the hyperparameters hp; an AdamW lr brings its floor lr / 10,
  a max_step_norm given relative to the Q/K lr (max_step_ratio) is that
  times it.

  >>> c = point_config(CPU, "stiefel", {"learning_rate": 3e-3,
  ...     "stiefel_learning_rate": 0.3, "max_step_ratio": 0.3}, 500)
  >>> c.arm, c.min_lr, c.max_step_norm, c.max_iters, c.lr_decay_iters
  ('stiefel', 0.0003, 0.09, 500, 500)
  """
  hp = dict(hp)
  if "learning_rate" in hp:
    hp["min_lr"] = float(f"{hp['learning_rate'] / LR_FLOOR:.6g}")
  if "max_step_ratio" in hp:
    hp["max_step_norm"] = float(
        f"{hp.pop('max_step_ratio') * hp['stiefel_learning_rate']:.6g}")
  return dataclasses.replace(base, arm=arm, max_iters=iters,
                             lr_decay_iters=iters, **hp)


def reference_config(study: Study) -> Config:
  """nanoGPT's AdamW at its published settings (the base as it is)."""
  return dataclasses.replace(study.base, arm="adamw")


def reference_tasks(study: Study) -> list:
  """The nanoGPT reference's runs: planned before the study's own."""
  return [study_lib.Task("reference", "adamw", {}, {}, s)
          for s in study.reference_seeds]


def task_config(study: Study, task: study_lib.Task) -> Config:
  """The configuration of a planned run: the reference as it is, a tuning
  run on the tuning schedule, a paired run on the base's."""
  if task.stage == "reference":
    return reference_config(study)
  iters = study.tune_iters if task.stage == "tune" else study.base.max_iters
  return point_config(study.base, task.arm, {**task.base, **task.point},
                      iters)


def task_name(study: Study, task: study_lib.Task, data_id: str) -> str:
  """The planned run's file name (`run_name`)."""
  return run_name(task_config(study, task), task.seed, data_id)


def finished(study: Study, done: Mapping, data_id: str) -> study_lib.Finished:
  """The finished runs `done` ({name: record}) as the shared study reads
  them, scored by the whole-split validation loss."""
  return study_lib.indexed(done, lambda t: task_name(study, t, data_id),
                           lambda r: r["final"]["val_loss_full"])


def plan(study: Study, done: Mapping, data_id: str,
         assume: bool = False) -> list:
  """Every run of the study that the finished runs `done` let us name, in
  the order to run them (`benchmarks.study.plan`): the nanoGPT reference,
  then the study's stages. A run two stages name (the tuned adamw at
  nanoGPT's point is the reference) is listed once, at the first."""
  return study_lib.plan(study, finished(study, done, data_id), assume,
                        reference_tasks(study))


def remaining(study: Study, done: Mapping, data_id: str,
              assume: bool = False) -> list:
  """The plan's runs that are not finished."""
  return study_lib.remaining(study, finished(study, done, data_id), assume,
                             reference_tasks(study))


# --------------------------------------------------------------------------
# What the report reads.

REPORT = report_lib.Experiment(
    arms=tuple(ARMS), arm_fields={a: arm.fields for a, arm in ARMS.items()
                                  if arm.fields},
    presets={n: dataclasses.asdict(c) for n, c in PRESETS.items()},
    own_adamw=OWN_ADAMW, lr_floor=LR_FLOOR)


def study_data(records) -> str:
  """The corpus a study's report is about: the published one if any run
  used it, else the first (sorted) that a run used."""
  ref = f"tinyshakespeare:md5={CORPUS_MD5}"
  return harness.recorded_data(records, ref) or ref


def study_state(study: Study, done: Mapping, data_id: str) -> dict:
  """The study's plan read against the finished runs `done` on `data_id`,
  as `benchmarks.reports.lm.study_summary` takes it: `benchmarks.study.state`
  (per arm its tuning, choice and paired runs; the planned runs and those
  not done) with the nanoGPT reference's configuration (a dict) and runs
  ({seed: record})."""
  runs, ref = finished(study, done, data_id), reference_tasks(study)
  return dict(
      study_lib.state(study, runs, ref),
      data=data_id, reference_config=dataclasses.asdict(
          reference_config(study)),
      reference={t.seed: r for t in ref if (r := runs.record(t)) is not None})


def previous_study(out: pathlib.Path) -> Optional[str]:
  """The study whose report out's results.json holds, or None."""
  path = out / "results.json"
  if not path.is_file():
    return None
  return (json.loads(path.read_text()).get("study") or {}).get("name")


def write_report(out: pathlib.Path, study: Optional[str] = None) -> dict:
  """`benchmarks.reports.lm.report` of out's saved runs (results.json and
  table.md; its return value); with study (a key of STUDIES), the study's
  report from its state read from those runs. Without study, a folder
  whose report is a study's (its results.json names it) keeps it: runs
  added outside the plan, or a plain `--report-only`, never turn a study's
  report into the per-configuration tables."""
  records = harness.RunStore(out).records()
  if study is None:
    study = previous_study(out)
  if study is None:
    return report_lib.report(out, records, REPORT)
  spec = STUDIES[study]
  index = harness.finished_runs(records, current_version=False)
  return report_lib.report(out, records, REPORT, study, spec,
                           study_state(spec, index, study_data(index.values())))
