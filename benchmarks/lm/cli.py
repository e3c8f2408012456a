"""`python -m benchmarks.lm`: the command line (see the package docstring):
a sweep of configurations and seeds, a probe, the study, the report."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import pathlib
import sys
import time
from typing import Mapping, Optional

import benchmarks.lm
from benchmarks import harness, study as study_lib, training
from benchmarks.lm.arms import ARMS
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


def _field_type(f: dataclasses.Field):
  return {"int": int, "float": float, "str": str}[
      f.type if isinstance(f.type, str) else f.type.__name__]


def parse_args(argv):
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.lm",
      description=benchmarks.lm.__doc__.split("\n\n")[0])
  harness.add_common_args(
      p, default_out_dir="runs/lm", seeds_default="0",
      quick_help="toy size (2 layers, d 32, context 16, 30 iters), arms"
                 " adamw and stiefel, seed 0: well under a minute")
  p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                 help="cpu: nanoGPT's small CPU command (default); gpu: its"
                      " shakespeare_char config; quick: toy")
  p.add_argument("--arms", default=None,
                 help=f"comma list of {', '.join(ARMS)} (default adamw;"
                      " --quick: adamw,stiefel)")
  p.add_argument("--data", type=pathlib.Path, default=None,
                 help="the corpus (default ../shared/data/tinyshakespeare.txt"
                      " from the repository root)")
  p.add_argument("--study", action="store_true",
                 help="the whole study, resumable: every arm tuned on"
                      " validation (the same grid density), then paired"
                      " discovery and confirmation seeds, then its report;"
                      " prints its time estimate first (--quick: the same"
                      " path at toy size, well under a minute)")
  p.add_argument("--robustness", action="store_true",
                 help="the learning-rate sweep of issue 30, resumable (its"
                      " plan: benchmarks/results/lm/robustness_plan.md):"
                      " every arm over one grid of base rates, three tuning"
                      " seeds, seed-major, then its report (--quick: the"
                      " same path at toy size, well under a minute)")
  p.add_argument("--worker", default=None, metavar="I/N",
                 help="with --robustness: train this worker's share of"
                      " the runs (those whose name hashes to I mod N), then"
                      " the others' unstarted ones, so that N processes,"
                      " each on its own core, share the sweep (on 2 cores"
                      " two single-threaded workers train about 1.5x as"
                      " many runs per hour as one process)")
  p.add_argument("--probe", type=int, default=0,
                 help="first time this many steps of the first run (not"
                      " saved) and print the projected wall time")
  p.add_argument("--dry-run", action="store_true",
                 help="with --probe or --study: print the projection and"
                      " stop")
  harness.add_time_budget_arg(p, "seed (--study: no run)")
  p.add_argument("--note", default="",
                 help="text written to <out>/notes.md (in every report)")
  p.add_argument("--quiet", action="store_true")
  for f in dataclasses.fields(Config):
    if f.name != "arm":
      p.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                     default=None,
                     help=f"{_field_type(f).__name__}; a comma list sweeps")
  return p.parse_args(argv)


def configs(args) -> list:
  """Every Config the command asks for: preset, overrides, sweeps, arms."""
  preset = args.preset or ("quick" if args.quick else "cpu")
  base = PRESETS[preset]
  arms = (args.arms or ("adamw,stiefel" if args.quick else "adamw")).split(",")
  sweeps = {}
  for f in dataclasses.fields(Config):
    val = getattr(args, f.name, None) if f.name != "arm" else None
    if val is not None:
      sweeps[f.name] = [_field_type(f)(v) for v in val.split(",")]
  out = []
  for arm in arms:
    others = {f for a, other in ARMS.items() if a != arm
              for f in other.fields}
    names = [k for k in sweeps if k not in others]
    for vals in itertools.product(*(sweeps[k] for k in names)):
      cfg = dataclasses.replace(base, arm=arm, **dict(zip(names, vals)))
      if "max_iters" in names and "lr_decay_iters" not in sweeps:
        cfg = dataclasses.replace(cfg, lr_decay_iters=cfg.max_iters)
      check_config(cfg)
      if cfg not in out:
        out.append(cfg)
  return out


def check_study_args(args) -> None:
  """--study and --robustness fix their arms, seeds and settings: refuse
  options that would quietly change them."""
  flag, where = (("--robustness", "benchmarks/lm/robustness.py SWEEP")
                 if args.robustness else
                 ("--study", "benchmarks/lm/study.py STUDY"))
  names = ("arms", "seeds", "preset") + tuple(
      f.name for f in dataclasses.fields(Config) if f.name != "arm")
  given = [f"--{n.replace('_', '-')}" for n in harness.given(args, names)]
  if args.study and args.robustness:
    given.append("one of --study and --robustness")
  if given:
    raise SystemExit(f"{flag} fixes its arms, seeds and settings (see"
                     f" {where}); drop {', '.join(given)}.")


def train_sweep(args, argv, corpus: Corpus, out: pathlib.Path, log) -> bool:
  """The configurations and seeds the options ask for (seed-major); False
  if --dry-run stopped after the probe."""
  seeds = args.seeds or (0,)
  cfgs = configs(args)
  store = harness.RunStore(out)
  todo = [(c, s) for c in cfgs for s in seeds
          if (r := store.load(run_name(c, s, corpus.data_id))) is None
          or r.get("final") is None or not harness.matches(r)]
  if args.probe and todo:
    probe(todo[0][0], todo[0][1], corpus, args.probe, [c for c, _ in todo],
          log)
    if args.dry_run:
      return False
  command = harness.command_line("benchmarks.lm", argv)
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
                     time_budget=args.time_budget, log=log, progress=False)
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


def train_study(name: str, args, argv, corpus: Corpus, out: pathlib.Path,
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
  if args.probe and left:
    per_step, compile_s, steps = measure_steps(
        task_config(study, left[0]), left[0].seed, corpus, args.probe)
    probed = (per_step, compile_s)
    log(f"probe: {steps} steps of {left[0].arm} in {per_step * steps:.1f} s"
        f" ({1e3 * per_step:.1f} ms/step, about {compile_s:.0f} s to"
        " compile)")
  est = estimate(study, done, corpus.data_id, rates, probed)
  size = timing_key(dataclasses.asdict(study.base))
  n_timed = sum(r.get("final") is not None and timing_key(r["config"]) == size
                for r in records)
  log(estimate_text(study, est, n_timed))
  if args.dry_run:
    return est
  run_study(study, corpus, out,
            command=harness.command_line("benchmarks.lm", argv), log=log,
            time_budget=args.time_budget, rates=rates,
            on_paired=lambda: write_report(out, name))
  return None


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  log = (lambda *_: None) if args.quiet else functools.partial(print,
                                                               flush=True)
  study = None
  if args.study or args.robustness:
    check_study_args(args)
    study = "quick" if args.quick else "full"
  folder = ("lm" if study is None else
            f"lm_{'robustness' if args.robustness else 'study'}"
            f"{'_quick' * args.quick}")
  out = args.out or (REFERENCE_DIR if args.report_only and args.results_md
                     else harness.default_out(folder))
  if args.note:
    harness.write_text(out / "notes.md", args.note.strip() + "\n")
  with training.toy_compiler(args.quick):
    if args.robustness:
      if not args.report_only:
        robustness.run_robustness(
            robustness.SWEEPS[study],
            load_corpus(str(args.data or default_data())), out,
            command=harness.command_line("benchmarks.lm", argv), log=log,
            time_budget=args.time_budget, dry_run=args.dry_run,
            worker=args.worker)
        if args.dry_run:
          return {}
      rep = robustness.robustness_report(out, study, args.results_md)
      if args.results_md:
        harness.write_section(args.results_md, robustness.SECTION,
                              rep["section"])
      log(rep["markdown"])
      return rep
    if not args.report_only:
      corpus = load_corpus(str(args.data or default_data()))
      if study is None:
        if not train_sweep(args, argv, corpus, out, log):
          return {}
      elif (est := train_study(study, args, argv, corpus, out,
                               log)) is not None:
        return dict(estimate=est)
  rep = write_report(out, study)
  if args.results_md:
    report_lib.write_section(args.results_md, rep)
  log(rep["table"])
  log(f"results: {harness.portable(out)}")
  return rep


if __name__ == "__main__":
  main()
