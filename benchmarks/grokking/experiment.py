"""The grokking experiment's record for the driver (`benchmarks.driver`):
`python -m benchmarks grokking [options]` (or `python -m
benchmarks.grokking`): a study's runs, its report, the RESULTS.md
section. `--set` takes a field of `Config` or of `Study` (steps,
long_steps, long_seed, probe_steps); `--worker I/N` trains part I of N
parallel processes."""

from __future__ import annotations

import dataclasses
import time

from benchmarks import driver, harness
from benchmarks.grokking.config import PRESETS, PROBE_ARM
from benchmarks.grokking.study import (STUDIES, load_spec, load_study,
                                       run_study, saved_study)
from benchmarks.reports import grokking as report_lib


def configure(opts: driver.Options) -> tuple:
  """(cfg, study, out, runs_from); --report-only on a folder with a
  study.json reports the study saved there."""
  out = opts.out or harness.default_out("grokking", opts.preset)
  if opts.report_only and (spec := load_spec(out)) is not None:
    return (*spec[:2], out, spec[2])
  cfg, study = PRESETS[opts.preset], STUDIES[opts.preset]
  cfg_set, study_set = driver.split(opts.overrides, cfg, study)
  if "d_model" in cfg_set and "d_mlp" not in cfg_set:
    cfg_set["d_mlp"] = str(4 * int(cfg_set["d_model"]))
  cfg = driver.override(cfg, cfg_set)
  study = driver.override(study, study_set)
  if opts.seeds:
    study = dataclasses.replace(study, seeds=opts.seeds)
  for name in ("steps", "long_steps", "probe_steps"):
    n = getattr(study, name)
    if n % cfg.log_every:
      raise SystemExit(f"{name} = {n} must be a multiple of log_every ="
                       f" {cfg.log_every}.")
  return cfg, study, out, ()


def run(opts: driver.Options) -> dict:
  t0 = time.time()
  if opts.report_only and opts.results_md and opts.out is None:
    report_lib.write_section(opts.results_md, load_study, PROBE_ARM,
                             plots=not opts.no_plots)
    print(f"{opts.results_md}: {report_lib.SECTION} regenerated from"
          f" {harness.portable(report_lib.SECTION_TEMPLATE)} and the runs it"
          " names")
    return {}
  cfg, study, out, runs_from = configure(opts)
  if opts.note:
    harness.write_text(out / "notes.md", opts.note.strip() + "\n")
  if not opts.report_only:
    harness.write_json(out / "study.json", dict(
        config=cfg.to_dict(), study=dataclasses.asdict(study)), indent=1)
    part, parts = driver.check_worker(opts.worker or "0/1")
    run_study(cfg, study, out, not opts.quiet, part, parts, opts.command,
              opts.time_budget)
  rep = report_lib.report(out, cfg, study,
                          saved_study(cfg, study, out, runs_from), PROBE_ARM,
                          plots=not opts.no_plots)
  if opts.results_md:
    report_lib.write_section(opts.results_md, load_study, PROBE_ARM,
                             plots=not opts.no_plots)
  print(rep["table"])
  print(f"\nresults: {out} ({time.time() - t0:.0f} s this invocation)")
  return rep


EXPERIMENT = driver.Experiment(
    name="grokking",
    summary="Grokking on modular arithmetic: AdamW against Stiefel-Adam on"
            " the Q/K frames, steps to generalise over paired seeds.",
    presets=PRESETS, default="default", run=run, seeds="0-4",
    quick="a smoke run (under a minute): p = 23, d = 16, 2 seeds x 100"
          " steps",
    options=("worker", "no_plots"))


def main(argv=None) -> dict:
  """`python -m benchmarks.grokking [options]`."""
  return driver.run(EXPERIMENT, argv)
