"""The CIFAR experiment's record for the driver (`benchmarks.driver`):
`python -m benchmarks cifar_patches [options]` (or `python -m
benchmarks.cifar_patches`): the study's plan and estimate, its runs, the
report; `--robustness` the learning-rate sweep. `--set` takes a field of
`Config` (model.dim, epochs, ...) or of `Plan` (sizes, other_seeds)."""

from __future__ import annotations

import dataclasses
import json
import time

from benchmarks import driver, harness, study as study_lib, sweep as sweep_lib
from benchmarks.cifar_patches import data as cifar_data, robustness
from benchmarks.cifar_patches.arms import ARMS
from benchmarks.cifar_patches.config import PRESETS
from benchmarks.cifar_patches.study import (GROUPS, MAIN_SEEDS, OTHER_SEEDS,
                                            StudyRuns, describe,
                                            estimate_text, families,
                                            quick_groups)
from benchmarks.reports import cifar as report_lib


@dataclasses.dataclass(frozen=True)
class Plan:
  """The study's sizes n and the other arms' seeds (`--set sizes=1000,4000`,
  `--set other_seeds=500-505`); empty: the preset's."""
  sizes: tuple = ()
  other_seeds: tuple = ()


def configure(opts: driver.Options) -> tuple:
  """(cfg, plan) of the preset with the --set overrides (a Config field,
  model.dim and the like, sizes, other_seeds)."""
  cfg = PRESETS[opts.preset]
  cfg_set, plan_set = driver.split(opts.overrides, cfg, Plan())
  return driver.override(cfg, cfg_set), driver.override(Plan(), plan_set)


def run(opts: driver.Options) -> dict:
  if opts.robustness:
    return sweep_lib.main(robustness.SWEEP_EXPERIMENT, opts)
  if opts.worker or opts.sweep:
    raise SystemExit("--worker and --sweep are --robustness's; add it.")
  cfg, plan = configure(opts)
  if opts.quick:
    data = cifar_data.synthetic(448, cfg.val_size)
    sizes = list(plan.sizes) or [len(data.x_train) - cfg.val_size]
    arms = opts.arms.split(",") if opts.arms else ["adamw", "stiefel"]
    seeds, other_seeds = opts.seeds or (0, 1), plan.other_seeds or (0, 1)
    out = opts.out or harness.default_out("cifar_quick")
    groups = quick_groups()
  else:
    data = cifar_data.load_cifar10(opts.data, download_missing=opts.download)
    sizes = list(plan.sizes) or [1000, 4000, len(data.x_train)]
    arms = opts.arms.split(",") if opts.arms else list(ARMS)
    seeds = opts.seeds or MAIN_SEEDS
    other_seeds = plan.other_seeds or OTHER_SEEDS
    out = opts.out or harness.default_out("cifar")
    groups = GROUPS
  inherit = None
  if opts.hp_from:
    inherit = json.loads((opts.hp_from / "summary.json").read_text())["chosen"]
  study_runs = StudyRuns(
      data, cfg, out, groups, inherit,
      harness.portable(opts.hp_from) if opts.hp_from else None)
  if not opts.report_only:
    study = study_runs.study(sizes, seeds, other_seeds, arms)
    runs = study_runs.finished()
    print(f"data {data.source} ({data.location or 'in memory'}); identity"
          f" {study_runs.fp}; out {out}", flush=True)
    print(estimate_text(study_lib.estimate(
        study_lib.remaining(study, runs, assume=True),
        study_runs.expected_s)),
          flush=True)
    if opts.dry_run:
      return {}
    t0 = time.time()
    study_lib.run_study(   # the plan asked anew after each run
        lambda: study_lib.remaining(study, runs), study_runs.execute,
        on_paired=lambda: report_lib.report(   # the tables so far
            out, families(), data.source, cfg.to_dict(), plots=False),
        desc="cifar", describe=describe, expected_s=study_runs.expected_s,
        time_budget=opts.time_budget)
    print(f"sweep wall time {time.time() - t0:.0f}s", flush=True)
  # --report-only reports the folder's runs under their own configuration
  # (a reference folder holds one: the tiny protocol's, the main one's).
  summary = report_lib.report(out, families(), data.source,
                              None if opts.report_only else cfg.to_dict())
  if opts.results_md:
    report_lib.write_section(opts.results_md, summary, out, families(),
                             data.source)
  print(f"results: {out}")
  return summary


EXPERIMENT = driver.Experiment(
    name="cifar_patches",
    summary="CIFAR-10 patch transformer: Stiefel-Adam on the attention Q/K"
            " kernels against AdamW, data scaling, baselines, ablations.",
    presets=PRESETS, default="default", run=run,
    seeds=harness.format_seeds(MAIN_SEEDS) + " (the main arms; other arms:"
          f" --set other_seeds=..., default {harness.format_seeds(OTHER_SEEDS)})",
    quick="synthetic images, tiny model, two arms (< 1 minute)",
    options=("robustness", "sweep", "arms", "worker", "dry_run", "data",
             "download", "hp_from"))


def main(argv=None) -> dict:
  """`python -m benchmarks.cifar_patches [options]`."""
  return driver.run(EXPERIMENT, argv)
