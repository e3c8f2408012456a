"""What the report (`benchmarks.reports.grokking`) reads: a results
folder's study (its study.json) and every saved run of it, partial ones
included, under any library version."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import harness
from benchmarks.grokking.config import PROBE_ARM, Config, Study, run_name
from benchmarks.grokking.data import data_id
from benchmarks.grokking.study import schedule


def load_run(cfg: Config, arm: str, seed: int, out: Path,
             runs_from: Sequence[str] = ()) -> Optional[dict]:
  """The saved (possibly partial) run of this configuration under any
  library version (what a report shows), from out or else from the folders
  `runs_from` (relative to out), or None."""
  for folder in [out] + [out / r for r in runs_from]:
    run = harness.RunStore(folder).load_matching(
        run_name(arm, seed), dataclasses.asdict(cfg), data_id(cfg.p, cfg.op))
    if run is not None:
      return run
  return None


def saved_study(cfg: Config, study: Study, out: Path,
                runs_from: Sequence[str] = ()) -> dict:
  """Every saved run of the study as it is (partial runs included)."""
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  for arm, seed, _ in schedule(study):
    run = load_run(cfg, arm, seed, out, runs_from)
    if run is not None:
      runs[arm][seed] = run
  return runs


def load_spec(out: Path):
  """(cfg, study, runs_from) from <out>/study.json, or None."""
  spec = harness.read_json(out / "study.json")
  if spec is None:
    return None
  return (Config(**spec["config"]), Study.from_dict(spec["study"]),
          tuple(spec.get("runs_from", ())))


def load_study(out: Path) -> tuple:
  """(cfg, study, runs) of the study saved in `out` (its study.json and
  every saved run, partial ones included): what its report reads."""
  cfg, study, runs_from = load_spec(out)
  return cfg, study, saved_study(cfg, study, out, runs_from)
