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

The main job, `python -m benchmarks grokking` with no preset, setting,
seed, arm or folder named, runs the cells of `study.MAIN_JOB` in order,
each in its own folder under runs/grokking/ (a reduced train-fraction-0.3
cell, `--preset frac0.3_demo`, then the 0.1.0 list, `--preset default`),
and ends with a summary saying which is the confirmed finding and which
the null (`summary`).
"""

from __future__ import annotations

import dataclasses
import time

from benchmarks import driver, harness
from benchmarks.grokking.arms import ARMS
from benchmarks.grokking.config import PRESETS, PROBE_ARM
from benchmarks.grokking.study import (MAIN_JOB, PAIRED, STUDIES,
                                       PairedStudy, load_spec, load_study,
                                       run_study, saved_study)
from benchmarks.reports import grokking as report_lib


def configure(opts: driver.Options, preset: str = "") -> tuple:
  """(cfg, study, out, runs_from) of `preset` (default: the options');
  --report-only on a folder with a study.json reports the study saved
  there."""
  preset = preset or opts.preset
  paired = bool(opts.study) or preset not in STUDIES
  folder = preset + ("_study" if paired and preset in STUDIES else "")
  out = opts.out or harness.default_out("grokking", folder)
  if opts.report_only and (spec := load_spec(out)) is not None:
    return (*spec[:2], out, spec[2])
  cfg = PRESETS[preset]
  study = PAIRED[preset] if paired else STUDIES[preset]
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


def is_main_job(opts: driver.Options) -> bool:
  """Whether the options ask for the main job (`MAIN_JOB`): no preset,
  setting, seed, arm, --study or --out named."""
  return (opts.args.preset is None and not opts.quick and not opts.overrides
          and opts.seeds is None and not opts.arms and not opts.study
          and opts.out is None)


def main_job(opts: driver.Options) -> list:
  """The main job's cells, planned: [(cell, (cfg, study, out,
  runs_from))], the configuration of each cell's preset."""
  return [(cell, configure(opts, cell.preset)) for cell in MAIN_JOB]


def run_cell(opts: driver.Options, cfg, study, out, runs_from,
             note: str = "") -> dict:
  """Trains (unless --report-only) and reports one study in `out`."""
  note = "\n\n".join(n.strip() for n in (note, opts.note) if n)
  if note:
    harness.write_text(out / "notes.md", note + "\n")
  if not opts.report_only:
    harness.write_json(out / "study.json", dict(
        config=cfg.to_dict(), study=dataclasses.asdict(study)), indent=1)
    part, parts = driver.check_worker(opts.worker or "0/1")
    run_study(cfg, study, out, not opts.quiet, part, parts, opts.command,
              opts.time_budget)
  runs = saved_study(cfg, study, out, runs_from)
  if isinstance(study, PairedStudy):
    return report_lib.paired_report(out, cfg, study, runs,
                                    plots=not opts.no_plots)
  return report_lib.report(out, cfg, study, runs, PROBE_ARM,
                           plots=not opts.no_plots)


def key_numbers(cfg, study, rep: dict) -> str:
  """A cell's result in a sentence: final val acc of both arms and their
  paired difference (a paired study's discovery row), or the 0.1.0
  report's verdict."""
  res = rep["results"]
  if not isinstance(study, PairedStudy):
    fv = res["comparison"]["final_val_acc"]
    return (f"final val acc at {study.steps} steps, seeds"
            f" {harness.format_seeds(study.seeds)}: stiefel"
            f" {fv['mean_treatment']:.2f}, adamw {fv['mean_baseline']:.2f}."
            f" {res['verdict']}")
  lines = []
  for block in ("discovery", "confirmation"):
    final = next(t for t in res["tables"][block]
                 if t["endpoint"] == "final_val_acc")
    for r in final["rows"]:
      lines.append(
          f"final val acc at {study.steps} steps, {block} seeds"
          f" {harness.format_seeds(r['seeds'])}: {r['treatment']}"
          f" {r['mean_treatment']:.2f}, {r['baseline']}"
          f" {r['mean_baseline']:.2f}; per seed " + ", ".join(
              f"{s}: {res['summaries'][r['treatment']][s]['final_val_acc']:.2f}"
              f" vs {res['summaries'][r['baseline']][s]['final_val_acc']:.2f}"
              for s in r["seeds"]) + "; "
          + harness.finding_text(r, "", 4) + ".")
  return " ".join(lines) or "no pair of finished runs yet."


def summary(cells: list) -> str:
  """The main job's last word: per cell [(cell, cfg, study, out, rep)]
  its title, its key numbers, what it stands for and its folder."""
  parts = [f"Main job: {len(cells)} cells (their tables above)."]
  for i, (cell, cfg, study, out, rep) in enumerate(cells, 1):
    parts += ["", f"{i}. {cell.title} ({harness.portable(out)}):",
              "   " + key_numbers(cfg, study, rep),
              "   " + cell.standing]
  return "\n".join(parts)


def run(opts: driver.Options) -> dict:
  t0 = time.time()
  if opts.report_only and opts.results_md and opts.out is None:
    report_lib.write_section(opts.results_md, load_study, PROBE_ARM,
                             plots=not opts.no_plots)
    print(f"{opts.results_md}: {report_lib.SECTION} regenerated from"
          f" {harness.portable(report_lib.SECTION_TEMPLATE)} and the runs it"
          " names")
    return {}
  if is_main_job(opts):
    cells = []
    for cell, (cfg, study, out, runs_from) in main_job(opts):
      opts.log(f"== {cell.title}: --preset {cell.preset} ==")
      rep = run_cell(opts, cfg, study, out, runs_from, note=cell.standing)
      print(rep["table"] + "\n", flush=True)
      cells.append((cell, cfg, study, out, rep))
    if opts.results_md:
      report_lib.write_section(opts.results_md, load_study, PROBE_ARM,
                               plots=not opts.no_plots)
    text = summary(cells)
    print(text)
    print(f"\n({time.time() - t0:.0f} s this invocation)")
    return dict(cells={c[0].preset: c[4] for c in cells}, summary=text)
  cfg, study, out, runs_from = configure(opts)
  rep = run_cell(opts, cfg, study, out, runs_from)
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
