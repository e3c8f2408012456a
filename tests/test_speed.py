"""`python -m benchmarks.speed --quick` runs and reports every table.

Speed targets are checked by the benchmark's medians and ratios, never by
timed assertions here: this test checks that the script works and that what
it reports is well formed (positive times, the Q/K state ratio, the
retractions' isometry errors).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("speed")
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.speed", "--quick", "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out / "speed.json") as f:
    res = json.load(f)
  return res, (out / "speed.md").read_text(), proc.stdout


def test_prints_and_writes_the_tables(quick):
  res, md, stdout = quick
  assert res["quick"]
  for title in ("One optimizer update", "Where the update's time goes",
                "One training step", "Optimizer state of the Q/K kernels",
                "Polar retraction"):
    assert title in md and title in stdout


def test_times_and_ratios_are_positive(quick):
  res, _, _ = quick
  rows = res["update"] + [res["train_step"]]
  for row in rows:
    assert row["adamw_ms"] > 0 and row["stiefel_ms"] > 0
    assert row["ratio"] == pytest.approx(row["stiefel_ms"] / row["adamw_ms"])
    assert row["cpu_ratio"] > 0
  parts = res["update"][0]["profile"]["parts_ms"]
  assert len(parts) == 6 and all(v > 0 for v in parts.values())


def test_qk_state_is_half_of_adamw(quick):
  res, _, _ = quick
  for s in res["state"]:
    # AdamW: mu and nu per element; Stiefel: mu per element, nu per frame.
    assert s["adamw_bytes"] == 2 * s["qk_param_bytes"]
    assert s["qk_param_bytes"] < s["stiefel_bytes"] <= 0.51 * s["adamw_bytes"]


def test_retractions_report_isometry(quick):
  res, _, _ = quick
  methods = {r["method"] for r in res["retraction"]}
  assert methods == {"newton_schulz", "eigh", "svd"}
  for r in res["retraction"]:
    if r["method"] == "newton_schulz":
      assert r["iso_err_delta_0.1"] <= 1e-5 and r["iso_err_delta_1"] <= 1e-5
    elif "status" not in r:   # eigh / SVD may report a LAPACK hang instead
      assert r["iso_err_delta_0.1"] <= 1e-4
