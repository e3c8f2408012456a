"""`python -m benchmarks.grokking`: the command line (see the package
docstring): a study's runs, its report, the RESULTS.md section."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import benchmarks.grokking
from benchmarks import harness
from benchmarks.grokking.config import PRESETS, PROBE_ARM
from benchmarks.grokking.data import OPS
from benchmarks.grokking.study import (STUDIES, load_spec, load_study,
                                       run_study, saved_study)
from benchmarks.reports import grokking as report_lib


def parse_args(argv):
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.grokking",
      description=benchmarks.grokking.__doc__.split("\n")[0])
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
  p.add_argument("--op", choices=OPS)
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
  cfg = PRESETS[preset]
  overrides = harness.given(args, (
      "p", "log_every", "train_fraction", "op", "d_model", "num_heads",
      "d_mlp", "num_layers", "learning_rate"))
  if args.d_model and not args.d_mlp:
    overrides["d_mlp"] = 4 * args.d_model
  cfg = dataclasses.replace(cfg, **overrides)
  study = STUDIES[preset]
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
        config=cfg.to_dict(), study=dataclasses.asdict(study)), indent=1)
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
