"""The report (`benchmarks.reports.lm`): what it reads of the experiment,
and the study's state, the plan read against the finished runs (any
library version), which it turns into the study's tables."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Mapping, Optional

from benchmarks import harness, study as study_lib
from benchmarks.lm.config import ARM_FIELDS, ARMS, PRESETS
from benchmarks.lm.data import CORPUS_MD5
from benchmarks.lm.study import (LR_FLOOR, OWN_ADAMW, STUDIES, Study,
                                 finished, reference_config, reference_tasks)
from benchmarks.reports import lm as report_lib

REPORT = report_lib.Experiment(
    arms=ARMS, arm_fields=ARM_FIELDS,
    presets={n: dataclasses.asdict(c) for n, c in PRESETS.items()},
    own_adamw=OWN_ADAMW, lr_floor=LR_FLOOR)


def study_data(records) -> str:
  """The corpus a study's report is about: the published one if any run
  used it, else the first (sorted) that a run used."""
  ids = sorted({r["data"] for r in records})
  ref = f"tinyshakespeare:md5={CORPUS_MD5}"
  return ref if ref in ids or not ids else ids[0]


def study_state(study: Study, done: Mapping, data_id: str) -> dict:
  """The study's plan read against the finished runs `done` on `data_id`,
  as `benchmarks.reports.lm.study_summary` takes it: `benchmarks.study.state`
  (per arm its tuning, choice and paired runs; the planned runs and those
  not done) with the nanoGPT reference's configuration (a dict) and runs
  ({seed: record})."""
  runs, ref = finished(study, done, data_id), reference_tasks(study)
  return dict(
      study_lib.state(study, runs, ref),
      data=data_id, reference_config=dataclasses.asdict(
          reference_config(study)),
      reference={t.seed: r for t in ref if (r := runs.record(t)) is not None})


def previous_study(out: pathlib.Path) -> Optional[str]:
  """The study whose report out's results.json holds, or None."""
  path = out / "results.json"
  if not path.is_file():
    return None
  return (json.loads(path.read_text()).get("study") or {}).get("name")


def write_report(out: pathlib.Path, study: Optional[str] = None) -> dict:
  """`benchmarks.reports.lm.report` of out's saved runs (results.json and
  table.md; its return value); with study (a key of STUDIES), the study's
  report from its state read from those runs. Without study, a folder
  whose report is a study's (its results.json names it) keeps it: runs
  added outside the plan, or a plain `--report-only`, never turn a study's
  report into the per-configuration tables."""
  records = harness.RunStore(out).records()
  if study is None:
    study = previous_study(out)
  if study is None:
    return report_lib.report(out, records, REPORT)
  spec = STUDIES[study]
  index = harness.finished_runs(records, current_version=False)
  return report_lib.report(out, records, REPORT, study, spec,
                           study_state(spec, index, study_data(index.values())))
