"""`python -m benchmarks.cifar_patches`: the command line (see the package
docstring): the study's plan and estimate, its runs, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import benchmarks.cifar_patches
from benchmarks import harness, study as study_lib
from benchmarks.cifar_patches import data as cifar_data, robustness
from benchmarks.cifar_patches.arms import ARMS
from benchmarks.cifar_patches.config import PRESETS
from benchmarks.cifar_patches.train import Trainer
from benchmarks.cifar_patches.study import (GROUPS, MAIN_SEEDS, OTHER_SEEDS,
                                            Bench, describe, estimate_text,
                                            families, quick_groups)
from benchmarks.reports import cifar as report_lib


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.cifar_patches",
      description=benchmarks.cifar_patches.__doc__.split("\n\n")[0])
  harness.add_common_args(
      p, default_out_dir="runs/cifar (runs/cifar_quick with --quick)",
      seeds_default=harness.format_seeds(MAIN_SEEDS),
      quick_help="synthetic images, tiny model, two arms (< 1 minute)",
      seeds_help="seeds of the main arms (adamw, stiefel, rsgd)")
  harness.add_time_budget_arg(p)
  p.add_argument("--dry-run", action="store_true",
                 help="print the runs left and their expected time, then stop")
  p.add_argument("--other-seeds", type=harness.seeds_type, default=None,
                 help="seeds of the other arms (default"
                      f" {harness.format_seeds(OTHER_SEEDS)})")
  p.add_argument("--data", "--data-dir", dest="data", default=None,
                 help="any CIFAR-10 source: the subset's .npz, the"
                      f" {cifar_data.FOLDER}/ folder or a folder holding it"
                      f" (default ${cifar_data.ENV_VAR}, else"
                      f" ../shared/data/{cifar_data.SUBSET_NAME})")
  p.add_argument("--download", action="store_true",
                 help="download the official tarball into the --data folder"
                      " if missing")
  p.add_argument("--sizes", type=int, nargs="*", default=None,
                 help="training-set sizes n (default 1000 4000 all)")
  p.add_argument("--arms", nargs="*", default=None,
                 help=f"subset of {list(ARMS)}; the arms they build on"
                      " (adamw, and the arm an ablation takes its choice"
                      " from) join them")
  p.add_argument("--epochs", type=int, default=None)
  p.add_argument("--dim", type=int, default=None, help="model width d")
  p.add_argument("--heads", type=int, default=None)
  p.add_argument("--depth", type=int, default=None)
  p.add_argument("--robustness", action="store_true",
                 help="the learning-rate sweep (issue 30; plan:"
                      " benchmarks/results/lm/robustness_plan.md, its CIFAR"
                      " section): its arms, grid and seeds are fixed"
                      " (benchmarks/cifar_patches/robustness.py SWEEP)")
  p.add_argument("--worker", default=None, metavar="I/N",
                 help="with --robustness: train this worker's share of"
                      " the runs, then the others' unstarted ones (workers"
                      " sharing --out see each other's)")
  p.add_argument("--hp-from", type=pathlib.Path, default=None,
                 help="reuse the hyperparameters chosen in this results folder"
                      " (its summary.json) instead of tuning those arms")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.robustness:
    return main_robustness(args, argv)
  cfg = PRESETS["quick" if args.quick else "default"]
  if args.quick:
    data = cifar_data.synthetic(448, cfg.val_size)
    sizes = args.sizes or [len(data.x_train) - cfg.val_size]
    arms = args.arms or ["adamw", "stiefel"]
    seeds, other_seeds = args.seeds or (0, 1), args.other_seeds or (0, 1)
    out = args.out or harness.default_out("cifar_quick")
    groups = quick_groups()
  else:
    data = cifar_data.load_cifar10(args.data, download_missing=args.download)
    sizes = args.sizes or [1000, 4000, len(data.x_train)]
    arms = args.arms or list(ARMS)
    seeds = args.seeds or MAIN_SEEDS
    other_seeds = args.other_seeds or OTHER_SEEDS
    out = args.out or harness.default_out("cifar")
    groups = GROUPS
  if args.epochs:
    cfg = dataclasses.replace(cfg, epochs=args.epochs)
  model = {k: v for k, v in (("dim", args.dim), ("heads", args.heads),
                             ("depth", args.depth)) if v}
  if model:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
  inherit = None
  if args.hp_from:
    inherit = json.loads((args.hp_from / "summary.json").read_text())["chosen"]
  bench = Bench(data, cfg, out, groups, inherit,
                harness.portable(args.hp_from) if args.hp_from else None)
  if not args.report_only:
    study, runs = bench.study(sizes, seeds, other_seeds, arms), bench.finished()
    print(f"data {data.source} ({data.location or 'in memory'}); identity"
          f" {bench.fp}; out {out}", flush=True)
    print(estimate_text(study_lib.estimate(
        study_lib.remaining(study, runs, assume=True), bench.expected_s)),
          flush=True)
    if args.dry_run:
      return {}
    t0 = time.time()
    study_lib.run_study(   # the plan asked anew after each run
        lambda: study_lib.remaining(study, runs), bench.execute,
        on_paired=lambda: report_lib.report(   # the tables so far
            out, families(), data.source, cfg.to_dict(), plots=False),
        desc="cifar", describe=describe, expected_s=bench.expected_s,
        time_budget=args.time_budget)
    print(f"sweep wall time {time.time() - t0:.0f}s", flush=True)
  # --report-only reports the folder's runs under their own configuration
  # (a reference folder holds one: the tiny protocol's, the main one's).
  summary = report_lib.report(out, families(), data.source,
                              None if args.report_only else cfg.to_dict())
  if args.results_md:
    report_lib.write_section(args.results_md, summary, out, families(),
                             data.source)
  print(f"results: {out}")
  return summary


def main_robustness(args, argv) -> dict:
  """--robustness: the sweep's runs (unless --report-only), then its report
  (and its RESULTS.md section with --results-md)."""
  fixed = [f for f, v in (("--sizes", args.sizes), ("--arms", args.arms),
                          ("--seeds", args.seeds), ("--epochs", args.epochs),
                          ("--dim", args.dim), ("--heads", args.heads),
                          ("--depth", args.depth), ("--hp-from", args.hp_from),
                          ("--other-seeds", args.other_seeds)) if v]
  if fixed:
    raise SystemExit(f"--robustness fixes its arms, grid, seeds and model"
                     f" (benchmarks/cifar_patches/robustness.py SWEEP);"
                     f" drop {', '.join(fixed)}.")
  name = "quick" if args.quick else "full"
  sweep = robustness.SWEEPS[name]
  out = args.out or harness.default_out(
      "cifar_robustness" + "_quick" * args.quick)
  data_id = None      # --report-only: the one its runs record
  if not args.report_only:
    data = (cifar_data.synthetic(448, sweep.base.val_size) if args.quick
            else cifar_data.load_cifar10(args.data,
                                         download_missing=args.download))
    data_id = data.source
    robustness.run_robustness(
        sweep, Trainer(data, sweep.base), out,
        command=harness.command_line("benchmarks.cifar_patches", argv or []),
        time_budget=args.time_budget, dry_run=args.dry_run,
        worker=args.worker)
    if args.dry_run:
      return {}
  rep = robustness.robustness_report(out, name, data_id, args.results_md)
  if args.results_md:
    harness.write_section(args.results_md, robustness.SECTION,
                          rep["section"])
  print(f"results: {out}")
  return rep
