"""The grokking benchmark: data, pairing of the arms, and a tiny end-to-end
run of `python -m benchmarks.grokking` (same code path, small sizes): run
identity, resumption, the report regenerated from the raw runs, and the
RESULTS.md section built from a notes template."""

import json
import shutil

import jax
import numpy as np
import pytest

import stiefel_optax as so
from benchmarks import driver, grokking, harness
from benchmarks.grokking import data
from benchmarks.reports import grokking as report_lib

TINY_CFG = grokking.Config(p=11, d_model=16, num_heads=2, d_mlp=32,
                           log_every=10, train_fraction=0.5)
TINY = ["--set", "p=11", "--set", "d_model=16", "--set", "num_heads=2",
        "--set", "d_mlp=32", "--set", "steps=20", "--seeds", "0-1",
        "--set", "long_steps=30", "--set", "probe_steps=10",
        "--set", "log_every=10", "--set", "train_fraction=0.5", "--quiet"]


@pytest.mark.parametrize("op", data.OPS)
def test_equations_are_correct(op):
  p = 11
  x, y = data.all_equations(p, op)
  assert x.shape == ((p * (p - 1) if op == "/" else p * p), 3)
  assert np.all(x[:, 2] == p)
  a, b = x[:, 0], x[:, 1]
  if op == "+":
    np.testing.assert_array_equal(y, (a + b) % p)
  elif op == "-":
    np.testing.assert_array_equal(y, (a - b) % p)
  else:
    np.testing.assert_array_equal((y * b) % p, a)


def test_split_is_seeded_and_disjoint():
  s0, s0b, s1 = (data.make_split(13, "+", 0.4, s) for s in (0, 0, 1))
  np.testing.assert_array_equal(s0.train_x, s0b.train_x)
  assert not np.array_equal(s0.train_x, s1.train_x)
  assert s0.train_x.shape[0] == round(0.4 * 169)
  rows = {tuple(r) for r in s0.train_x} | {tuple(r) for r in s0.val_x}
  assert len(rows) == 169 == s0.train_x.shape[0] + s0.val_x.shape[0]
  with pytest.raises(ValueError, match="train_fraction"):
    data.split(s0.train_x, s0.train_y, 1.0, 0)


def test_arms_share_every_non_qk_weight():
  pa = grokking.initial_params(TINY_CFG, "adamw", 3)
  ps = grokking.initial_params(TINY_CFG, "stiefel", 3)
  frames = so.selected_frames(pa)
  n_qk = 0
  for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(pa),
                          jax.tree.leaves(ps)):
    if so.path_str(path) not in frames:
      np.testing.assert_array_equal(a, s)
    else:
      n_qk += 1
      assert not np.allclose(a, s)
  assert n_qk == 2
  so.check_frames(ps, atol=1e-5)
  with pytest.raises(ValueError, match="off the Stiefel manifold"):
    so.check_frames(pa, atol=1e-5)


def test_statistics_of_histories():
  h = dict(step=[0, 10, 20, 30], val_acc=[0.0, 0.96, 0.5, 0.97])
  assert report_lib.steps_to_target(h, 0.95) == 10
  assert report_lib.min_after(h, 10) == 0.5
  assert report_lib.steps_to_target(h, 0.99) is None
  assert report_lib.min_after(h, None) is None
  assert report_lib.censored([None, 5], 31) == [31, 5]


def _summary(hit, final):
  return dict(steps_to_target=hit, final_val_acc=final,
              min_val_acc_after=None if hit is None else final)


@pytest.mark.parametrize("faster", ["adamw", "stiefel"])
def test_verdict_names_the_faster_arm(faster):
  slow, fast = [400, 500, None, 450], [300, 350, 400, 320]
  hits = dict(adamw=fast, stiefel=slow) if faster == "adamw" else dict(
      adamw=slow, stiefel=fast)
  summ = {arm: {s: _summary(h, 0.9 + 0.01 * s + (arm == faster) * 0.001)
                for s, h in enumerate(hits[arm])}
          for arm in ("adamw", "stiefel")}
  comp = report_lib.compare_arms(summ, steps=1000)
  assert comp["n_never_" + ("stiefel" if faster == "adamw" else "adamw")] == 1
  verdict = report_lib.winner(comp)
  assert verdict.startswith(f"Grokking speed: {faster} ahead")
  assert f"{faster} first in 4," in verdict


def test_verdict_names_neither_arm_when_the_difference_rounds_to_zero():
  # stiefel 0.25 steps faster and 0.0000025 more accurate on the mean:
  # both print as 0, so neither arm is named ahead.
  hits = dict(adamw=[300, 400, 500, 600], stiefel=[301, 399, 501, 598])
  more = dict(adamw=[0.0] * 4, stiefel=[1e-5, -2e-5, 3e-5, -1e-5])
  base = [0.5, 0.7, 0.9, 0.6]
  summ = {arm: {s: _summary(h, base[s] + more[arm][s])
                for s, h in enumerate(hits[arm])}
          for arm in ("adamw", "stiefel")}
  verdict = report_lib.winner(report_lib.compare_arms(summ, steps=1000))
  assert verdict.startswith("Grokking speed: neither arm ahead"), verdict
  assert "stiefel - adamw +0 steps" in verdict
  assert "Final validation accuracy: neither arm higher" in verdict


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
  """The TINY study trained once: (its folder, main()'s result)."""
  out = tmp_path_factory.mktemp("tiny") / "grok"
  return out, grokking.main(TINY + ["--out", str(out)])


def test_tiny_study_end_to_end_and_resume(tiny_study, tmp_path):
  out = tmp_path / "grok"
  shutil.copytree(tiny_study[0], out)
  res = tiny_study[1]
  assert grokking.configure(driver.parse(grokking.EXPERIMENT, TINY))[0] == TINY_CFG
  saved = json.loads((out / "results.json").read_text())
  assert saved["meta"]["regenerate"] == (
      "python -m benchmarks.grokking --report-only --out grok")
  assert "CPUs" in saved["meta"]["machines"][0]
  assert saved["meta"]["run_wall_s"] > 0
  assert saved["meta"]["trained_by"][0]["command"] == (
      harness.command_line("benchmarks.grokking", TINY + ["--out", "grok"]))
  assert (out / "study.png").stat().st_size > 0
  assert (out / "long_run.png").stat().st_size > 0
  assert "| steps to 95% val acc" in (out / "table.md").read_text()
  summ = saved["summaries"]
  assert set(summ) == {"adamw", "stiefel"} and len(summ["adamw"]) == 2
  for arm in ("adamw", "stiefel"):
    for r in summ[arm].values():
      assert r["steps"] == 20 and 0.0 <= r["final_val_acc"] <= 1.0
  # The Stiefel frames stay orthonormal; AdamW's raw kernels do not.
  iso = saved["isometry_ratio"]
  assert iso["stiefel_max"] < 1e-5 and iso["adamw_mean"] > 1e-2
  assert iso["geomean"] > 1e3
  assert saved["movement"]["adamw_over_rsgd"]["steps"] == 10
  assert saved["long"]["summaries"]["stiefel"]["steps"] == 30
  # 20 steps on 11 x 11 equations is too short to grok: no winner named.
  assert res["results"]["verdict"].startswith("Neither arm reached")
  # Every (arm, seed) was saved with a checkpoint; a rerun resumes from them
  # without training again (the histories are identical).
  runs = sorted(p.name for p in (out / "runs").glob("*.json"))
  assert runs[0] == "adamw_seed0.json" and len(runs) == 2 * 2 + 2
  rec = json.loads((out / "runs" / runs[0]).read_text())
  ident = harness.run_identity(TINY_CFG.to_dict(),
                               data.data_id(TINY_CFG.p, TINY_CFG.op))
  assert rec["identity"] == ident
  assert rec["library_version"] == so.__version__
  assert rec["trained_by"][0]["code_hash"] == harness.code_hash()
  assert "/tmp" not in json.dumps(rec)        # no machine path
  before = (out / "runs" / runs[0]).read_text()
  table = (out / "table.md").read_bytes()
  again = grokking.main(TINY + ["--out", str(out), "--no-plots"])
  assert (out / "runs" / runs[0]).read_text() == before
  def plain(x):
    return json.loads(json.dumps(x))
  assert plain(again["results"]["summaries"]) == plain(
      res["results"]["summaries"])
  # --report-only needs only the folder (its study.json) and regenerates the
  # same bytes.
  report = grokking.main(["--out", str(out), "--report-only", "--no-plots"])
  assert plain(report["results"]["summaries"]) == plain(
      res["results"]["summaries"])
  assert (out / "table.md").read_bytes() == table
  # A run made under another identity is not reused: it is trained again.
  rec["identity"] = "other"
  (out / "runs" / runs[0]).write_text(json.dumps(rec))
  run = grokking.train_run(TINY_CFG, "adamw", 0, 20, out)
  assert run["identity"] == ident
  assert len(run["trained_by"]) == 1


def test_results_section_from_template(tiny_study, tmp_path):
  out = tmp_path / "study_a"
  shutil.copytree(tiny_study[0], out)
  (out / "notes.md").write_text("How study_a was trained.\n")
  template = tmp_path / "section.md"
  template.write_text("## Grokking\n\nProse kept verbatim.\n\n"
                      "<!-- report: study_a -->\n\nMore prose.\n\n"
                      "<!-- report: study_a long -->\n")
  body = report_lib.section_text(grokking.load_study, grokking.PROBE_ARM,
                                 template, plots=False)
  table = (out / "table.md").read_text()
  assert body.startswith("## Grokking\n\nProse kept verbatim.\n\n" + table)
  assert "How study_a was trained." in table and "More prose." in body
  long = json.loads((out / "results.json").read_text())["long"]["table"]
  assert long.startswith("| long run") and body.rstrip("\n").endswith(long)
  md = tmp_path / "RESULTS.md"
  md.write_text("# Benchmark results\n\n## CIFAR-10 patch benchmark\n\nkept\n")
  harness.write_section(md, report_lib.SECTION, body)
  text = md.read_text()
  assert text.index(harness.POLICY_HEADING) < text.index("## CIFAR-10")
  assert "kept" in text and text.endswith(body)
  # the index (results/index.md) on top, then the policy; a rewrite of a
  # section leaves both where they are, once
  index = harness.INDEX_FILE.read_text()
  assert text.startswith("# Benchmark results\n\n" + index.rstrip("\n")
                         + "\n\n" + harness.POLICY_HEADING)
  harness.write_section(md, "## CIFAR-10 patch benchmark",
                        "## CIFAR-10 patch benchmark\n\nnew")
  again = md.read_text()
  assert again.count(harness.INDEX_HEADING) == 1 and again.startswith(
      text[:len(index)]) and "new" in again and again.endswith(body)


def test_default_output_is_outside_the_tracked_tree():
  cfg, study, out, _ = grokking.configure(driver.parse(grokking.EXPERIMENT,
                                                      []))
  assert out == harness.RUNS_ROOT / "grokking" / "default"
  assert study == grokking.STUDIES["default"] and cfg == grokking.Config()
  assert cfg == grokking.PRESETS["default"]
  quick = grokking.configure(driver.parse(grokking.EXPERIMENT,
                                          ["--quick", "--seeds", "3,5"]))
  assert quick[1].seeds == (3, 5) and quick[2].name == "quick"
  # one way to override: --set a field of the Config or the Study; an
  # unknown key, or a step count off the log grid, is refused
  cfg, study, *_ = grokking.configure(driver.parse(grokking.EXPERIMENT, [
      "--preset", "full", "--set", "train_fraction=0.3", "--set",
      "steps=1000", "--set", "d_model=64"]))
  assert (cfg.train_fraction, cfg.d_mlp, study.steps, study.long_steps) == (
      0.3, 256, 1000, grokking.STUDIES["full"].long_steps)
  for bad, match in ((["--set", "width=3"], "not a setting"),
                     (["--set", "steps=7"], "multiple of log_every"),
                     (["--worker", "2/2"], "0 <= I < N")):
    with pytest.raises(SystemExit, match=match):
      grokking.configure(driver.parse(grokking.EXPERIMENT, bad))
  ignore = (harness.REPO / ".gitignore").read_text().split()
  assert "/runs/" in ignore          # the root runs/ folder only


def test_records_hold_every_quantity():
  # The same configuration as TINY: the compiled chunk is reused.
  run = grokking.train_run(TINY_CFG, "adamw", 0, 20)
  h = run["history"]
  assert h["step"] == [0, 10, 20] and h["move"][0] is None
  for key in ("block_0/attn/query/kernel", "block_0/attn/key/kernel"):
    assert len(h["iso"][-1][key]) == 2 and len(h["move"][-1][key]) == 2
    assert all(m > 0 for m in h["move"][-1][key])
  assert "block_0/mlp_in/kernel" in h["norms"][-1]
  assert not any("query" in k or "key/" in k for k in h["norms"][-1])


def test_time_budget_stops_between_jobs_and_says_so(tmp_path, capsys):
  out = tmp_path / "grok"
  # The first job always runs; the budget stops the study before the next,
  # and with one arm's run alone there is nothing to pair: said, not a table.
  with pytest.raises(SystemExit, match="nothing to report"):
    grokking.main(TINY + ["--out", str(out), "--time-budget", "1e-9",
                          "--no-plots"])
  assert len(list((out / "runs").glob("*.json"))) == 1
  err = capsys.readouterr().err
  assert "time budget" in err and "the same command resumes them" in err


def test_slingshot_arms_decay_only_where_they_say():
  """The pilot's arms: with a zero gradient AdamW's step is its decay
  alone, so a leaf moves exactly where the arm decays it (adam and
  stiefel_nodecay: nowhere; the targeted arms: embeddings, MLP kernels,
  unembedding); the study takes them by name through --set arms=..."""
  import optax
  cfg = grokking.PRESETS["quick"]
  for arm, decayed in (("adam", set()), ("stiefel_nodecay", set()),
                       ("adamw_targeted", {"embed/embedding", "pos_embed",
                                           "block_0/mlp_in/kernel",
                                           "block_0/mlp_out/kernel",
                                           "unembed/kernel"}),
                       ("stiefel_targeted", {"embed/embedding", "pos_embed",
                                             "block_0/mlp_in/kernel",
                                             "block_0/mlp_out/kernel",
                                             "unembed/kernel"}),
                       ("adamw", None)):   # None: every weight
    params = grokking.initial_params(cfg, arm, 0)
    tx = grokking.make_optimizer(cfg, arm)
    zero = jax.tree.map(np.zeros_like, params)
    upd, _ = tx.update(zero, tx.init(params), params)
    moved = {so.path_str(p) for p, u in jax.tree_util.tree_leaves_with_path(
        upd) if np.abs(np.asarray(u)).max() > 1e-6}   # not rounding
    names = {so.path_str(p) for p, _ in
             jax.tree_util.tree_leaves_with_path(params)}
    zero_init = {"block_0/mlp_in/bias", "block_0/mlp_out/bias"}
    assert moved == (names - zero_init if decayed is None else decayed), (
        arm, moved)
  _, study, *_ = grokking.configure(driver.parse(grokking.EXPERIMENT, [
      "--set", "arms=adam,stiefel_nodecay,stiefel_targeted,adamw_targeted"]))
  assert study.arms == ("adam", "stiefel_nodecay", "stiefel_targeted",
                        "adamw_targeted")


def test_main_job_plans_both_cells(tmp_path):
  """`python -m benchmarks.grokking` (nothing named) plans the main job's
  two cells (study.MAIN_JOB), no training here: the confirmed finding
  reduced (frac0.3's configuration, so its runs share the committed
  study's identity, its discovery seeds cut to 2000 steps) and the 0.1.0
  list at train fraction 0.5, each in its own folder under runs/. The
  committed frac0.3 runs, cut to the demo's 2000 steps, already show it:
  stiefel ahead on final val acc on 5 of 5 seeds; the summary names the
  confirmed finding, the null and the committed studies."""
  from benchmarks.grokking import study as study_lib
  opts = driver.parse(grokking.EXPERIMENT, [])
  assert grokking.experiment.is_main_job(opts)
  for argv in (["--preset", "default"], ["--quick"], ["--seeds", "0"],
               ["--set", "steps=50"], ["--out", str(tmp_path)]):
    assert not grokking.experiment.is_main_job(
        driver.parse(grokking.EXPERIMENT, argv)), argv
  (demo, (cfg3, study3, out3, _)), (null, (cfg5, study5, out5, _)) = (
      grokking.experiment.main_job(opts))
  assert (demo.preset, null.preset) == ("frac0.3_demo", "default")
  assert (out3, out5) == (harness.RUNS_ROOT / "grokking" / "frac0.3_demo",
                          harness.RUNS_ROOT / "grokking" / "default")
  assert cfg3 == grokking.PRESETS["frac0.3"] and cfg3.train_fraction == 0.3
  assert study3 == study_lib.PairedStudy(steps=2000, seeds=(0, 1, 2, 3, 4))
  assert study_lib.jobs(cfg3, study3, None) == [
      (arm, seed, 2000) for seed in range(5) for arm in ("adamw", "stiefel")]
  assert (cfg5, study5) == (grokking.Config(), grokking.STUDIES["default"])
  assert len(study_lib.jobs(cfg5, study5, None)) == 15
  committed = harness.REFERENCE_ROOT / "grokking" / "frac0.3"
  ident = harness.run_identity(cfg3.to_dict(), data.data_id(cfg3.p, cfg3.op))
  assert json.loads((committed / "runs" / "stiefel_seed0.json").read_text())[
      "identity"] == ident
  # the demo's numbers as the committed runs give them (their first 2000
  # steps), and the job's summary of both cells
  cfg = grokking.load_study(committed)[0]
  runs = study_lib.saved_study(cfg, study3, committed)
  rep3 = report_lib.paired_report(tmp_path / "demo", cfg, study3, runs,
                                  plots=False)
  final = rep3["results"]["tables"]["discovery"][1]
  (row,) = final["rows"]
  assert final["endpoint"] == "final_val_acc" and row["wins"] == 5
  assert row["mean_diff"] > 0.2
  old = tmp_path / "null"
  shutil.copytree(harness.REFERENCE_ROOT / "grokking" / "history_0.1.0" /
                  "default", old, ignore=shutil.ignore_patterns("*.png"))
  rep5 = report_lib.report(old, *grokking.load_study(old), grokking.PROBE_ARM,
                           plots=False)
  text = grokking.experiment.summary([(demo, cfg3, study3, out3, rep3),
                                      (null, cfg5, study5, out5, rep5)])
  assert "CONFIRMED" in text and "NULL" in text and "not a new claim" in text
  assert "benchmarks/results/grokking/frac0.3" in text
  assert "benchmarks/results/grokking/frac0.5" in text
  assert "wins 5/5" in text and "final val acc at 2000 steps" in text
  print(text)
