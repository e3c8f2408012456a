"""Grokking's paired studies on the shared study (the two five-seed studies,
the slingshot pilot): presets, the new Config fields leaving every 0.1.0
run's identity and report as they were, the pilot's rules on synthetic
records, and tiny smoke runs of both study paths through the driver."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from benchmarks import driver, grokking, harness, training
from benchmarks.grokking import study as study_lib
from benchmarks.grokking.train import batch_of, data_key
from benchmarks.reports import grokking as report_lib

TINY = ["--set", "p=11", "--set", "d_model=16", "--set", "num_heads=2",
        "--set", "d_mlp=32", "--set", "num_layers=1", "--set", "log_every=10",
        "--set", "steps=20", "--quiet", "--no-plots"]
REFERENCE = harness.REFERENCE_ROOT / "grokking"
FOLDERS = tuple(f"history_0.1.0/{f}" for f in (
    "default", "full", "full_long_seed3", "long_frac0.3"))


def _configure(argv):
  return grokking.configure(driver.parse(grokking.EXPERIMENT, argv))


def test_presets_name_the_studies():
  cfg, study, out, _ = _configure(["--preset", "frac0.3"])
  assert cfg.train_fraction == 0.3 and out.name == "frac0.3"
  assert study == study_lib.PairedStudy(
      steps=10000, seeds=(0, 1, 2, 3, 4, 500, 501, 502, 503, 504))
  assert _configure(["--preset", "frac0.5"])[1].steps == 3000
  cfg, study, *_ = _configure(["--preset", "slingshot", "--set",
                               "steps=2000", "--seeds", "0-4"])
  assert (cfg.batch_size, cfg.warmup_steps, cfg.eps, cfg.learning_rate,
          cfg.b1, cfg.b2) == (512, 10, 1e-8, 1e-3, 0.9, 0.98)
  assert study.arms == ("adam", "stiefel_nodecay", "stiefel_targeted",
                        "adamw_targeted")
  assert (study.steps, study.seeds) == (2000, (0, 1, 2, 3, 4))
  # --study on a 0.1.0 preset: its paired study, in a folder of its own;
  # --arms (the reference first)
  _, study, out, _ = _configure(["--quick", "--study", "--arms",
                                 "adam,stiefel"])
  assert isinstance(study, study_lib.PairedStudy) and out.name == "quick_study"
  assert study.arms == ("adam", "stiefel")
  with pytest.raises(SystemExit, match="each once"):
    _configure(["--quick", "--study", "--arms", "adamw,nope"])
  # discovery seeds first, then confirmation, seed-major
  cfg, study, *_ = _configure(["--preset", "frac0.5"])
  order = study_lib.jobs(cfg, study, None)
  assert order[:4] == [("adamw", 0, 3000), ("stiefel", 0, 3000),
                       ("adamw", 1, 3000), ("stiefel", 1, 3000)]
  assert [s for _, s, _ in order[10:12]] == [500, 500]


def test_new_fields_keep_the_committed_identities():
  """Fields at their defaults stay out of to_dict, so every committed
  0.1.0 run is still found under its recorded configuration."""
  assert grokking.Config().to_dict() == json.loads(
      (REFERENCE / FOLDERS[0] / "study.json").read_text())["config"]
  assert grokking.Config(batch_size=512, eps=1e-6).to_dict()["eps"] == 1e-6
  cfg, study, runs = grokking.load_study(REFERENCE / FOLDERS[0])
  assert all(len(runs[a]) == 5 for a in ("adamw", "stiefel", "rsgd"))


def test_committed_reports_regenerate(tmp_path):
  """Each committed folder's table.md and results.json come back byte for
  byte from its runs (the regenerate line names the copy's folder)."""
  for folder in FOLDERS:
    src, out = REFERENCE / folder, tmp_path / folder
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.png"))
    report_lib.report(out, *grokking.load_study(out), grokking.PROBE_ARM,
                      plots=False)
    for name in ("table.md", "results.json"):
      want = src.joinpath(name).read_text().replace(
          f"--report-only --out benchmarks/results/grokking/{folder}",
          f"--report-only --out {harness.portable(out)}")
      assert out.joinpath(name).read_text() == want, (folder, name)


@pytest.mark.parametrize("folder", ["frac0.5", "frac0.3", "slingshot"])
def test_committed_paired_studies_regenerate(tmp_path, folder):
  """The two five-seed studies' and the slingshot pilot's table.md and
  results.json come back byte for byte from their runs (the regenerate
  line names the copy)."""
  src, out = REFERENCE / folder, tmp_path / folder
  shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.png", "*.npz"))
  report_lib.paired_report(out, *grokking.load_study(out), plots=False)
  for name in ("table.md", "results.json"):
    want = src.joinpath(name).read_text().replace(
        f"--report-only --out benchmarks/results/grokking/{folder}",
        f"--report-only --out {harness.portable(out)}")
    assert out.joinpath(name).read_text() == want, (folder, name)


def test_cycle_rule_on_synthetic_records():
  assert report_lib.CycleRule()[:4] == (10.0, 0.5, 20, 0.01)   # the plan's
  rule = report_lib.CycleRule(window=5, separation=500)
  steps = list(range(0, 3000, 100))
  loss = [None] + [0.01] * 29
  norm = list(np.linspace(1.0, 2.0, 30))
  for i in (10, 11, 12, 25):   # a burst of three, then one apart
    loss[i] = 1.0
  assert report_lib.count_cycles(steps, loss, norm, rule) == [1000, 2500]
  # under the floor (0.4 > 10 x 0.01, but < 0.5): no cycle
  low = [None if x is None else (0.4 if x == 1.0 else x) for x in loss]
  assert report_lib.count_cycles(steps, low, norm, rule) == []
  # no rise of the last layer's norm before the spike: no cycle
  assert report_lib.count_cycles(steps, loss, [1.0] * 30, rule) == []
  # a spike the records before do not dwarf: not 10x the median
  high = [None] + [0.5] * 29
  high[10] = 4.0
  assert report_lib.count_cycles(steps, high, norm, rule) == []
  # closer cycles count apart when the separation allows
  assert report_lib.count_cycles(steps, loss, norm, rule._replace(
      separation=100)) == [1000, 1100, 1200, 2500]


def test_stable_grokking_rule():
  st = report_lib.stability
  steps = [0, 100, 200, 300, 400, 500]
  assert st(steps, [0.1, 0.95, 0.92, 0.91, 0.99, 1.0]) == dict(
      grok_step=100, stable=True, falls=0, deepest=None, min_after=0.91,
      records_below=0)
  fell = st(steps, [0.1, 0.97, 0.5, 0.96, 0.89, 0.99])
  assert (fell["stable"], fell["falls"], fell["deepest"],
          fell["records_below"]) == (False, 2, 0.5, 2)
  assert st(steps, [0.1] * 6)["grok_step"] is None
  assert not st(steps, [0.1] * 6)["stable"]


def test_holm_runs_across_a_blocks_three_endpoints():
  """The plan's family is a seed block's comparisons on all three
  endpoints: a two-arm study's three rows are adjusted together (a
  one-row table per endpoint would leave them unadjusted)."""
  rng = np.random.default_rng(0)
  summaries = {arm: {seed: dict(
      steps_to_target=float(500 + 100 * i + rng.integers(0, 50)),
      final_val_acc=float(0.9 + 0.02 * i + 0.01 * rng.random()),
      min_val_acc_after=float(0.8 + 0.05 * i + 0.01 * rng.random()))
      for seed in (0, 1, 2, 3, 4)} for i, arm in enumerate(("adamw",
                                                            "stiefel"))}
  tables = report_lib.endpoint_tables(("adamw", "stiefel"), summaries,
                                      "discovery", 95)
  rows = [r for t in tables for r in t["rows"]]
  assert len(rows) == 3
  expected = report_lib.stats.holm([r["p"] for r in rows])
  assert [r["p_holm"] for r in rows] == expected
  assert max(r["p_holm"] / r["p"] for r in rows) > 1.0


def test_minibatches_are_per_epoch_shuffles():
  x = np.arange(20)
  b = batch_of(8)
  epoch0 = [np.asarray(b(t, data_key(3), x, x)[0]) for t in (0, 1)]
  assert len(set(np.concatenate(epoch0).tolist())) == 16   # no repeats
  again = np.asarray(b(0, data_key(3), x, x)[0])
  np.testing.assert_array_equal(again, epoch0[0])           # from the seed
  assert not np.array_equal(np.asarray(b(2, data_key(3), x, x)[0]), epoch0[0])
  assert batch_of(0)(5, None, x, x)[0] is x


def test_paired_study_smoke(tmp_path):
  """--quick --study (toy sizes): discovery and confirmation tables per
  endpoint, the per-run rules, --report-only the same bytes."""
  out = tmp_path / "paired"
  rep = grokking.main(["--quick", "--study", "--seeds", "0,500", "--out",
                       str(out)] + TINY)
  res = json.loads((out / "results.json").read_text())
  assert json.loads((out / "study.json").read_text())["study"]["kind"] == (
      "paired")
  for block in ("discovery", "confirmation"):
    assert [t["endpoint"] for t in res["tables"][block]] == [
        "steps_to_target", "final_val_acc", "min_val_acc_after"]
    (row,) = res["tables"][block][0]["rows"]
    assert (row["treatment"], row["baseline"]) == ("stiefel", "adamw")
    assert row["mean_treatment"] == 21       # never reached: budget + 1
  s = res["summaries"]["stiefel"]["500"]
  assert s["cycles"] == [] and s["iso_max"] < 1e-5
  assert res["summaries"]["adamw"]["0"]["iso_max"] > 1e-2   # raw kernels
  assert res["iso_ratios"][0]["geomean"] > 1e3
  table = (out / "table.md").read_bytes()
  assert b"censored" in table and b"Confirmation seeds" in table
  grokking.main(["--out", str(out), "--report-only", "--no-plots"])
  assert (out / "table.md").read_bytes() == table
  assert rep["study"].seeds == (0, 500)


def test_slingshot_pilot_smoke(tmp_path):
  """The pilot's preset at toy size: minibatches, warmup, the four arms;
  every record holds what the rules read."""
  out = tmp_path / "pilot"
  with training.toy_compiler(True):
    grokking.main(["--preset", "slingshot", "--set", "batch_size=16",
                   "--seeds", "0", "--out", str(out)] + TINY)
  run = json.loads((out / "runs" / "adamw_targeted_seed0.json").read_text())
  h = run["history"]
  assert run["config"]["batch_size"] == 16 and h["step"] == [0, 10, 20]
  assert h["batch_loss_max"][0] is None
  assert all(mx >= mn for mx, mn in zip(h["batch_loss_max"][1:],
                                        h["batch_loss_mean"][1:]))
  assert "unembed/kernel" in h["norms"][-1]
  assert len(h["iso"][-1]["block_0/attn/query/kernel"]) == 2
  res = json.loads((out / "results.json").read_text())
  assert list(res["summaries"]) == ["adam", "stiefel_nodecay",
                                    "stiefel_targeted", "adamw_targeted"]
  # the plan's per-seed ratio, unconstrained ablation over the Stiefel arm
  ratio = next(r for r in res["iso_ratios"] if r["baseline"] ==
               "adamw_targeted" and r["treatment"] == "stiefel_targeted")
  assert list(ratio["per_seed"]) == ["0"] and ratio["per_seed"]["0"] > 1.0
  # seeds 0-2 only: a pilot, so no "confirmation incomplete" claim
  assert "no confirmation seeds in this study" in (out / "table.md").read_text()


@pytest.mark.parametrize("module", ["benchmarks.grokking.config",
                                    "benchmarks.grokking.train",
                                    "benchmarks.reports.grokking"])
def test_docstring_examples_run(module):
  """The rules', the batches' and the identity's docstring examples (the
  shared doctest list, tests/benchmarks/test_benchmark_doctests.py, names
  other experiments' modules)."""
  import doctest
  import importlib
  result = doctest.testmod(importlib.import_module(module),
                           optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
