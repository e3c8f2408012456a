"""The grokking experiment's record for the driver (`benchmarks.driver`):
`python -m benchmarks grokking [options]` (or `python -m
benchmarks.grokking`): a study's runs, its report, the RESULTS.md
section. `--set` takes a field of `Config` or of the study (steps,
long_steps, long_seed, probe_steps; a paired study's steps); `--worker
I/N` trains part I of N parallel processes.

`--study` (implied by the presets frac0.5, frac0.3 and slingshot) runs the
preset's paired study (`study.PAIRED`: the shared study's discovery, then
confirmation seeds), `--arms` its arms (the reference first):

    python -m benchmarks grokking --preset frac0.5 --worker 0/2
    python -m benchmarks grokking --preset frac0.3 --worker 0/2
    python -m benchmarks grokking --preset slingshot --set steps=100000
    python -m benchmarks grokking --quick --study      # a smoke run
"""

from __future__ import annotations

import dataclasses
import time

from benchmarks import driver, harness, training
from benchmarks.grokking.arms import ARMS
from benchmarks.grokking.config import PRESETS, PROBE_ARM
from benchmarks.grokking.study import (PAIRED, STUDIES, PairedStudy,
                                       load_spec, load_study, run_study,
                                       saved_study)
from benchmarks.reports import grokking as report_lib


def configure(opts: driver.Options) -> tuple:
  """(cfg, study, out, runs_from); --report-only on a folder with a
  study.json reports the study saved there."""
  paired = bool(opts.study) or opts.preset not in STUDIES
  folder = opts.preset + ("_study" if paired and opts.preset in STUDIES
                          else "")
  out = opts.out or harness.default_out("grokking", folder)
  if opts.report_only and (spec := load_spec(out)) is not None:
    return (*spec[:2], out, spec[2])
  cfg = PRESETS[opts.preset]
  study = PAIRED[opts.preset] if paired else STUDIES[opts.preset]
  cfg_set, study_set = driver.split(opts.overrides, cfg, study)
  if "d_model" in cfg_set and "d_mlp" not in cfg_set:
    cfg_set["d_mlp"] = str(4 * int(cfg_set["d_model"]))
  cfg = driver.override(cfg, cfg_set)
  study = driver.override(study, study_set)
  if opts.seeds:
    study = dataclasses.replace(study, seeds=opts.seeds)
  if opts.arms:
    study = dataclasses.replace(study, arms=tuple(
        a.strip() for a in opts.arms.split(",")))
  unknown = [a for a in study.arms if a not in ARMS]
  if unknown or len(set(study.arms)) != len(study.arms):
    raise SystemExit(f"arms {list(study.arms)}: each once, of"
                     f" {', '.join(ARMS)}.")
  for name in ("steps",) if paired else ("steps", "long_steps",
                                         "probe_steps"):
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
    with training.toy_compiler(opts.quick):   # --quick: compiled fast
      run_study(cfg, study, out, not opts.quiet, part, parts, opts.command,
                opts.time_budget)
  runs = saved_study(cfg, study, out, runs_from)
  if isinstance(study, PairedStudy):
    rep = report_lib.paired_report(out, cfg, study, runs,
                                   plots=not opts.no_plots)
  else:
    rep = report_lib.report(out, cfg, study, runs, PROBE_ARM,
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
    options=("study", "arms", "worker", "no_plots"))


def main(argv=None) -> dict:
  """`python -m benchmarks.grokking [options]`."""
  return driver.run(EXPERIMENT, argv)
