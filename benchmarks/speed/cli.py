"""`python -m benchmarks speed`: the tables of one run, their speed.json and
speed.md, and the record the driver runs (`EXPERIMENT`; see the package
docstring and `benchmarks.driver`)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any, Dict, Optional, Sequence

import benchmarks.speed
from benchmarks import driver, harness
from benchmarks.reports import speed as report_lib
from benchmarks.speed import (gram, layout, muon, peer, retraction, state,
                              train_step)
from benchmarks.speed import trees, update

ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS", "XLA_FLAGS")
# Runs write under runs/ (git-ignored); `--out benchmarks/results` refreshes
# the committed reference figures.
DEFAULT_OUT = str(harness.default_out("speed"))
DEFAULT_PEER_OUT = str(harness.default_out("speed_peer"))   # --peer-only


def machine_text() -> str:
  """The machine as speed.md's first paragraph names it, from the shared
  machine record."""
  m = harness.machine()
  return f"{m['arch']}, {m['cpus']} CPU cores, jax {m['jax']} on {m['backend']}"


def command(quick: bool, peer_only: bool, peer_threads: Optional[int]
            ) -> str:
  """The command line a run records (its timing options only).

  >>> command(True, False, 2)
  'python -m benchmarks speed --quick --peer-threads 2'
  """
  return ("python -m benchmarks speed" + (" --quick" if quick else "")
          + (" --peer-only" if peer_only else "")
          + (f" --peer-threads {peer_threads}" if peer_threads else ""))


def run(quick: bool = False, out: Optional[str] = None,
        iters: Optional[int] = None, timeout: float = 300.0,
        peer_python: Optional[str] = peer.DEFAULT_PEER_PYTHON,
        peer_only: bool = False,
        peer_threads: Optional[int] = None) -> Dict[str, Any]:
  """Every table (or, with `peer_only`, only the geoopt comparison); the
  peer comparison runs under `peer_python` and is skipped without it."""
  iters = iters or (3 if quick else 11)
  load_before = [round(x, 2) for x in os.getloadavg()]
  cfgs = ((trees.GPT2_QUICK, trees.VIT_QUICK) if quick
          else (trees.GPT2_SMALL, trees.PATCH_VIT))
  res = {
      "quick": quick,
      "peer_only": peer_only,
      "command": command(quick, peer_only, peer_threads),
      "machine": machine_text(),
      "env": {k: os.environ.get(k) for k in ENV_KEYS},
      "load_before": load_before,
      "seconds": {},
  }

  def section(name, fn):
    start = time.perf_counter()
    res[name] = fn()
    res["seconds"][name] = round(time.perf_counter() - start, 1)

  # --quick times the update on its first tree only: the second tree's row
  # runs the same code as the first's, less the profile, and would only
  # compile four more programs; the state table, which compiles nothing,
  # keeps both trees.
  update_trees = cfgs[:1] if quick else cfgs
  if not peer_only:
    section("update", lambda: [
        update.update_comparison(cfg, iters, profile=i == 0)
        for i, cfg in enumerate(update_trees)])
    section("train_step", lambda: train_step.train_step_comparison(
        train_step.LM_QUICK if quick else train_step.LM_FULL, iters))
    section("state", lambda: [state.qk_state_bytes(cfg) for cfg in cfgs])
    shapes = retraction.RETRACTION_SHAPES
    section("retraction", lambda: retraction.retraction_table(
        shapes[:1] if quick else shapes, iters, timeout, quick))
  section("peer", lambda: peer.peer_comparison(
      peer_python, peer.PEER_QUICK if quick else peer.PEER_WORKLOADS, iters,
      timeout, peer_threads))
  section("muon", lambda: muon.muon_table(
      peer.PEER_QUICK if quick else peer.PEER_WORKLOADS,
      train_step.LM_QUICK if quick else train_step.LM_FULL, iters))
  if not peer_only:
    section("layout", lambda: layout.layout_comparison(
        *((2, 64, 4, 16) if quick else layout.LAYOUT_WORKLOAD), iters))
    section("gram", lambda: gram.gram_table(
        gram.GRAM_QUICK if quick else gram.GRAM_SHAPES, iters))
  if res["peer"]["status"] != "ok":
    print(f"peer comparison (geoopt) {res['peer']['status']}:"
          f" {res['peer']['message']}", file=sys.stderr)
  res["load_after"] = [round(x, 2) for x in os.getloadavg()]
  if out:
    harness.write_json(pathlib.Path(out) / "speed.json", res, indent=1)
  res["markdown"] = write_report(out, res)
  return res


def write_report(out: Optional[str], res: Dict[str, Any]) -> str:
  """speed.md of `res` (beside its speed.json in `out`, if given);
  returns the markdown."""
  md = report_lib.markdown(res)
  if out:
    harness.write_text(pathlib.Path(out) / "speed.md", md)
  return md


def arguments(parser: argparse.ArgumentParser) -> None:
  """The speed run's own options, beside the driver's --quick, --out and
  --report-only; `--retraction-child` is the retraction table's child
  process."""
  parser.add_argument("--iters", type=int, default=None,
                      help="timed calls per function, and rounds of the"
                      " peer comparison (default 11; 3 quick)")
  parser.add_argument("--timeout", type=float, default=300.0,
                      help="seconds for each eigh / SVD child process, and"
                      " for each answer of the peer child")
  parser.add_argument("--peer-python", default=peer.DEFAULT_PEER_PYTHON,
                      help="a Python with torch and geoopt for the peer"
                      " comparison (default: runs/peer-venv/bin/python;"
                      " skipped where absent)")
  parser.add_argument("--peer-only", action="store_true",
                      help="only the geoopt comparison")
  parser.add_argument("--peer-threads", type=int, default=None,
                      help="torch.set_num_threads of the peer (default: the"
                      " cores jax may use, os.sched_getaffinity)")
  parser.add_argument("--retraction-child", default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--shapes", default=None, help=argparse.SUPPRESS)


def run_command(opts: driver.Options) -> Optional[Dict[str, Any]]:
  """What the parsed command asks: the retraction table's child, speed.md
  again from a speed.json (--report-only), or a run."""
  if opts.retraction_child:
    retraction.child_main(opts.retraction_child, opts.shapes, opts.iters or 11)
    return None
  # A peer-only run has its own default folder, so that it does not replace
  # a full run's speed.json with one table.
  default = (None if opts.quick else
             DEFAULT_PEER_OUT if opts.peer_only else DEFAULT_OUT)
  out = str(opts.out) if opts.out is not None else default
  if opts.report_only:
    if not out:
      opts.error("--report-only reads <--out>/speed.json: name --out.")
    path = pathlib.Path(out) / "speed.json"
    if not path.is_file():
      opts.error(f"--report-only: no {path}; run the benchmark first.")
    print(write_report(out, json.loads(path.read_text())))
    return None
  res = run(opts.quick, out, opts.iters, opts.timeout, opts.peer_python,
            opts.peer_only, opts.peer_threads)
  print(res["markdown"])
  if out:
    print(f"wrote {os.path.join(out, 'speed.json')} and speed.md")
  return res


EXPERIMENT = driver.Experiment(
    name="speed", summary=benchmarks.speed.__doc__.split("\n")[0],
    presets={}, default="full", run=run_command,
    quick="tiny shapes (the update timed on one tree) and 3 timed calls: a"
          " smoke test",
    common=("quick", "out", "report_only"), arguments=arguments,
    help={"out": "directory for speed.json / speed.md (default: runs/speed,"
                 " runs/speed_peer with --peer-only, none with --quick)",
          "report_only": "no timing: speed.md again from the speed.json in"
                         " --out (e.g. benchmarks/results)"})


def main(argv: Optional[Sequence[str]] = None):
  """`python -m benchmarks.speed [options]`: `python -m benchmarks speed`."""
  return driver.run(EXPERIMENT, argv)
