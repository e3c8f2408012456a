"""The language model's record for the driver (`benchmarks.driver`):
`python -m benchmarks lm [options]` (or `python -m benchmarks.lm`): a sweep
of configurations and seeds (`--set learning_rate=1e-3,3e-3` sweeps a
`Config` field), a probe, the study (`--study`), the learning-rate sweep
(`--robustness`), the report."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Mapping, Optional

from benchmarks import driver, harness, study as study_lib, sweep as sweep_lib
from benchmarks.lm.arms import other_fields
from benchmarks.lm.config import PRESETS, Config, check_config, run_name
from benchmarks.lm.data import Corpus, default_data, load_corpus
from benchmarks.lm import robustness
from benchmarks.lm.study import (REFERENCE_DIR, STUDIES, Study, remaining,
                                 task_config, write_report)
from benchmarks.lm.timing import (estimate, estimate_text, iteration_rates,
                                  measure_steps, probe, run_seconds,
                                  timing_key)
from benchmarks.lm.train import train_run
from benchmarks.reports import lm as report_lib


def configs(opts: driver.Options) -> list:
  """Every Config the command asks for: preset, --set overrides (a comma
  list sweeps), arms. The sweep is a product grid of the study's planner
  (`benchmarks.study.grid_points`, one axis per overridden key, its values
  as given), each point applied by the driver's `override`; an arm's grid
  leaves out the other arms' fields (`arms.other_fields`)."""
  base = PRESETS[opts.preset]
  arms = (opts.arms or ("adamw,stiefel" if opts.quick else "adamw")).split(",")
  driver.check_settings(opts.overrides,
                        [k for k in driver.settings(base) if k != "arm"])
  axes = [(key, text.split(",")) for key, text in opts.overrides.items()]
  out = []
  for arm in arms:
    others = other_fields(arm)
    for point in study_lib.grid_points(
        [(k, v) for k, v in axes if k not in others]):
      cfg = driver.override(dataclasses.replace(base, arm=arm), point)
      if "max_iters" in point and "lr_decay_iters" not in opts.overrides:
        cfg = dataclasses.replace(cfg, lr_decay_iters=cfg.max_iters)
      check_config(cfg)
      if cfg not in out:
        out.append(cfg)
  return out


def check_study_args(opts: driver.Options) -> None:
  """--study fixes its arms, seeds and settings: refuse options that would
  quietly change them (--robustness: `benchmarks.sweep.configure`)."""
  if opts.study and opts.robustness:
    raise SystemExit("give one of --study and --robustness.")
  if opts.study:
    driver.refuse(opts, "--study", "benchmarks/lm/study.py STUDY",
                  ("arms", "seeds", "preset", "set"))


def train_sweep(opts: driver.Options, corpus: Corpus, out: pathlib.Path,
                log) -> bool:
  """The configurations and seeds the options ask for (seed-major); False
  if --dry-run stopped after the probe."""
  seeds = opts.seeds or (0,)
  cfgs = configs(opts)
  store = harness.RunStore(out)
  todo = [(c, s) for c in cfgs for s in seeds
          if (r := store.load(run_name(c, s, corpus.data_id))) is None
          or r.get("final") is None or not harness.matches(r)]
  if opts.probe and todo:
    probe(todo[0][0], todo[0][1], corpus, opts.probe, [c for c, _ in todo],
          log)
    if opts.dry_run:
      return False
  command = opts.command
  per_seed = []

  def execute(seed: int) -> dict:   # seed-major: a stop leaves whole pairs
    ts = time.time()
    for cfg in cfgs:
      rec = train_run(cfg, seed, corpus, out, command=command, log=log)
      f = rec["final"]
      log(f"{rec['name']}: train {f['train_loss']:.4f}, val"
          f" {f['val_loss']:.4f}, val (whole split) {f['val_loss_full']:.4f},"
          f" {rec['wall_s']:.0f} s")
    per_seed.append(time.time() - ts)
    return {}

  # A seed's runs take as long as the slowest seed so far, with a margin.
  # (train_run reuses the finished runs.)
  study_lib.run_list(seeds, execute, desc="lm",
                     describe=lambda seed, _: f"seed {seed} done",
                     expected_s=lambda _: 1.1 * max(per_seed, default=0.0),
                     time_budget=opts.time_budget, log=log, progress=False)
  return True


def run_study(study: Study, corpus: Corpus, out: pathlib.Path, *,
              command: str = "", log=print, time_budget: float = 0.0,
              rates: Optional[Mapping] = None, on_paired=None) -> int:
  """Runs the study's unfinished runs in plan order
  (`benchmarks.study.run_study`: the plan recomputed after each, so a
  tuning grid widens as its runs come in); stops before a run expected to
  end past time_budget seconds. on_paired() after each paired run (the
  tables so far). Returns the number of runs trained."""
  done = harness.finished_runs(harness.RunStore(out).records(),
                               current_version=True)
  rates = dict(rates or {})

  def execute(task: study_lib.Task) -> dict:
    cfg = task_config(study, task)
    rec = train_run(cfg, task.seed, corpus, out, command=command, log=log)
    if rec["name"] != run_name(cfg, task.seed, corpus.data_id) or rec.get(
        "final") is None:
      raise RuntimeError(f"{rec['name']}: not the finished run planned.")
    done[rec["name"]] = rec
    return rec

  def describe(task: study_lib.Task, rec: dict) -> str:
    f = rec["final"]
    return (f"{task.stage} {rec['name']}: train {f['train_loss']:.4f}, val"
            f" (whole split) {f['val_loss_full']:.4f}, {rec['wall_s']:.0f} s")

  return study_lib.run_study(
      lambda: remaining(study, done, corpus.data_id), execute,
      on_paired=on_paired, desc="lm study", describe=describe,
      expected_s=lambda t: run_seconds(task_config(study, t), rates),
      time_budget=time_budget, log=log, progress=False)


def train_study(name: str, opts: driver.Options, corpus: Corpus,
                out: pathlib.Path,
                log) -> Optional[dict]:
  """Prints the study's time estimate (from --probe, else from the finished
  runs' wall times), then runs what is left of it, writing the report
  after each paired run; with --dry-run returns the estimate instead."""
  study = STUDIES[name]
  records = harness.RunStore(out).records()
  done = harness.finished_runs(records, current_version=True)
  rates = iteration_rates(records)
  probed = None
  left = remaining(study, done, corpus.data_id, assume=True)
  if opts.probe and left:
    per_step, compile_s, steps = measure_steps(
        task_config(study, left[0]), left[0].seed, corpus, opts.probe)
    probed = (per_step, compile_s)
    log(f"probe: {steps} steps of {left[0].arm} in {per_step * steps:.1f} s"
        f" ({1e3 * per_step:.1f} ms/step, about {compile_s:.0f} s to"
        " compile)")
  est = estimate(study, done, corpus.data_id, rates, probed)
  size = timing_key(dataclasses.asdict(study.base))
  n_timed = sum(r.get("final") is not None and timing_key(r["config"]) == size
                for r in records)
  log(estimate_text(study, est, n_timed))
  if opts.dry_run:
    return est
  run_study(study, corpus, out,
            command=opts.command, log=log,
            time_budget=opts.time_budget, rates=rates,
            on_paired=lambda: write_report(out, name))
  return None


def run(opts: driver.Options) -> dict:
  log = opts.log
  if (opts.worker or opts.sweep) and not opts.robustness:
    raise SystemExit("--worker and --sweep are --robustness's; add it.")
  check_study_args(opts)
  if opts.robustness:
    return sweep_lib.main(robustness.SWEEP_EXPERIMENT, opts)
  study = ("quick" if opts.quick else "full") if opts.study else None
  folder = "lm" if study is None else "lm_study" + "_quick" * opts.quick
  out = opts.out or (REFERENCE_DIR if opts.report_only and opts.results_md
                     else harness.default_out(folder))
  if opts.note:
    harness.write_text(out / "notes.md", opts.note.strip() + "\n")
  if not opts.report_only:
    corpus = load_corpus(str(opts.data or default_data()))
    if study is None:
      if not train_sweep(opts, corpus, out, log):
        return {}
    elif (est := train_study(study, opts, corpus, out, log)) is not None:
      return dict(estimate=est)
  rep = write_report(out, study)
  if opts.results_md:
    report_lib.write_section(opts.results_md, rep)
  log(rep["table"])
  log(f"results: {harness.portable(out)}")
  return rep


EXPERIMENT = driver.Experiment(
    name="lm",
    summary="Character-level language model (nanoGPT's Shakespeare): AdamW"
            " against the Stiefel arms on the attention Q/K frames.",
    presets=PRESETS, default="cpu", run=run, seeds="0",
    quick="toy size (2 layers, d 32, context 16, 30 iters), arms adamw and"
          " stiefel, seed 0: well under a minute",
    options=("study", "robustness", "sweep", "arms", "worker", "dry_run",
             "data", "probe"))


def main(argv=None) -> dict:
  """`python -m benchmarks.lm [options]`."""
  return driver.run(EXPERIMENT, argv)
