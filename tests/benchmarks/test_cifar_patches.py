"""CIFAR-10 patch benchmark: loader, model, paired streams, arm recipes and
the --quick end-to-end run (synthetic images through the same code path);
the shared harness (seeds, identity, atomic writes, run store) and the Holm
correction."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from benchmarks import cifar_patches as cp, driver, harness, stats
from benchmarks.cifar_patches import data as cifar_data
from benchmarks import study as study_lib
from benchmarks.models import PatchViTConfig, patchify
from benchmarks.reports import cifar as cifar_report
# Test inputs from NumPy: no jax.random compilation per shape.
from tests.helpers import np_frames, np_normal


# ---------------------------------------------------------------- data


def _fake_folder(tmp_path, n=20):
  ds = cifar_data.synthetic(5 * n, n, seed=3)
  folder = tmp_path / cifar_data.FOLDER
  folder.mkdir()
  for i, name in enumerate(cifar_data.TRAIN_FILES):
    sl = slice(i * n, (i + 1) * n)
    cifar_data.write_batch(folder / name, ds.x_train[sl], ds.y_train[sl])
  cifar_data.write_batch(folder / "test_batch", ds.x_test, ds.y_test)
  return ds, folder


def test_python_batches_roundtrip(tmp_path):
  ds, folder = _fake_folder(tmp_path)
  got = cifar_data.load_batches(tmp_path, verify_md5=False)
  np.testing.assert_array_equal(got.x_train, ds.x_train)
  np.testing.assert_array_equal(got.y_test, ds.y_test)
  assert got.x_train.dtype == np.uint8 and got.x_train.shape[1:] == (32, 32, 3)
  # the source names the content, never the folder
  assert got.source.startswith("full:md5=") and str(tmp_path) not in got.source
  assert got.location == str(folder)
  # the folder itself is accepted too, and so is the environment variable
  again = cifar_data.load_cifar10(folder, verify_md5=False)
  assert again.x_train.shape == ds.x_train.shape and again.source == got.source


def test_any_npz_path_is_a_source_named_by_content(tmp_path):
  ds = cifar_data.synthetic(40, 10, seed=5)
  for name in ("a/one.npz", "b/two.npz"):
    (tmp_path / name).parent.mkdir()
    np.savez(tmp_path / name, x_train=ds.x_train, y_train=ds.y_train,
             x_test=ds.x_test, y_test=ds.y_test)
  one = cifar_data.load_cifar10(tmp_path / "a/one.npz", verify_md5=False)
  two = cifar_data.load_cifar10(str(tmp_path / "b/two.npz"), verify_md5=False)
  np.testing.assert_array_equal(one.x_test, ds.x_test)
  assert one.source == two.source and one.source.startswith("subset:md5=")
  assert harness.run_identity(cp.Config().to_dict(), one.source) == (
      harness.run_identity(cp.Config().to_dict(), two.source))
  with pytest.raises(ValueError, match="md5"):
    cifar_data.load_cifar10(tmp_path / "a/one.npz")


def test_env_var_selects_folder(tmp_path, monkeypatch):
  _fake_folder(tmp_path)
  monkeypatch.setenv(cifar_data.ENV_VAR, str(tmp_path))
  assert cifar_data.load_cifar10(verify_md5=False).source.startswith("full:")


def test_md5_mismatch_is_an_error(tmp_path):
  _fake_folder(tmp_path)
  with pytest.raises(ValueError, match="md5"):
    cifar_data.load_batches(tmp_path, verify_md5=True)


def test_missing_files_are_named(tmp_path):
  _, folder = _fake_folder(tmp_path)
  (folder / "data_batch_3").unlink()
  (folder / "test_batch").unlink()
  with pytest.raises(FileNotFoundError, match="data_batch_3, test_batch"):
    cifar_data.load_cifar10(tmp_path, verify_md5=False)


def test_subset_fallback_records_its_source(tmp_path, monkeypatch):
  monkeypatch.delenv(cifar_data.ENV_VAR, raising=False)
  with pytest.raises(FileNotFoundError, match="subset"):
    cifar_data.load_cifar10(subset_path=tmp_path / "none.npz")
  path = cifar_data.default_subset_path()
  if not path.is_file():
    pytest.skip(f"{path} not present")
  ds = cifar_data.load_cifar10()
  assert ds.source == f"subset:md5={cifar_data.SUBSET_MD5}"
  assert cifar_data.load_cifar10(path).source == ds.source   # --data PATH
  assert ds.x_train.shape == (8068, 32, 32, 3) and ds.x_test.shape == (1017, 32, 32, 3)


# ---------------------------------------------------------------- model


def test_patchify_and_model_shapes():
  x = jnp.arange(2 * 32 * 32 * 3, dtype=jnp.float32).reshape(2, 32, 32, 3)
  p = patchify(x, 4)
  assert p.shape == (2, 64, 48)
  np.testing.assert_array_equal(p[0, 1], x[0, 0:4, 4:8].reshape(-1))
  model = PatchViTConfig(dim=16, heads=2).build()
  # initialised as init_params does (one image: the same compiled operations
  # as the other tests'); the forward's values: test_models.py
  params = model.init(jax.random.PRNGKey(0), x[:1])["params"]
  assert jax.eval_shape(model.apply, {"params": params}, x).shape == (2, 10)
  assert len(so.selected_frames(params)) == 2
  assert params["block_0"]["attn"]["query"]["kernel"].shape == (16, 2, 8)


# ---------------------------------------------------------------- protocol


def test_seed_stream_is_paired_and_drawn_from_pool():
  cfg = cp.Config(batch=8, epochs=3, val_size=20)
  pool, val = cp.validation_split(100, cfg)
  assert not set(pool) & set(val) and len(pool) + len(val) == 100
  a = cp.seed_stream(4, pool, 40, cfg)
  np.testing.assert_array_equal(a, cp.seed_stream(4, pool, 40, cfg))
  assert a.shape == (3, 5, 8)
  assert set(a.ravel()) <= set(pool)
  assert not np.array_equal(a, cp.seed_stream(5, pool, 40, cfg))
  with pytest.raises(ValueError, match="exceeds"):
    cp.seed_stream(0, pool, 81, cfg)


def test_paired_init_shares_non_qk_parameters():
  model = PatchViTConfig(dim=16, heads=2).build()
  a = cp.init_params(model, cp.ARMS["adamw"], 7)
  b = cp.init_params(model, cp.ARMS["stiefel"], 7)
  frames = so.selected_frames(a)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    if so.path_str(path) not in frames:
      np.testing.assert_array_equal(x, y)
  assert float(so.max_isometry_error(b)) < 1e-5
  assert float(so.max_isometry_error(a)) > 1e-2
  whole = cp.init_params(model, cp.ARMS["whole_frame"], 7)
  assert float(so.max_isometry_error(whole, cp.WHOLE_FRAME)) < 1e-5
  assert float(so.max_isometry_error(b, cp.WHOLE_FRAME)) > 1e-2   # per head only


RETRACTING = [a for a, arm in cp.ARMS.items()
              if arm.qk not in (cp.qk_adamw, cp.qk_muon)]


@pytest.mark.parametrize("name", RETRACTING)
def test_recipes_keep_frames_orthonormal(name):
  arm = cp.ARMS[name]
  hp = {"lr": 0.05, "cap": 0.1}
  kw = dict(arm.fixed)
  kw.update(max_step_norm=hp["cap"])
  tx = arm.qk(hp["lr"], weight_decay=0.1, **kw)
  w = jnp.asarray(np_frames(1, (3, 12, 4), np.float32))
  state = tx.init(w)
  w0 = w
  for k in range(3):
    g = jnp.asarray(np_normal(10 + k, w.shape, np.float32))
    u, state = tx.update(g, state, w)
    w = optax.apply_updates(w, u)
  assert float(jnp.max(so.isometry_error(w))) < 1e-4
  moved = float(jnp.max(jnp.abs(w - w0)))
  assert (moved == 0.0) == (name == "frozen")


def test_an_arm_brings_the_arms_it_builds_on(tmp_path):
  # every arm trains on adamw's choice; an ablation takes stiefel's
  deps = lambda names: [a.name for a in study_lib.with_dependencies(
      cp.study_arms(), names)]
  assert deps(["no_cap"]) == ["adamw", "stiefel", "no_cap"]
  assert deps(["eps_0.1", "rsgd", "adamw"]) == [
      "adamw", "stiefel", "rsgd", "eps_0.1"]
  with pytest.raises(ValueError, match="unknown arms"):
    deps(["sgd"])
  # they join for their choice only: tuned, not paired
  cfg = cp.PRESETS["quick"]
  study_runs = cp.StudyRuns(cifar_data.synthetic(448, cfg.val_size), cfg,
                            tmp_path)
  st = study_runs.study([384], (0,), (0,), ["no_cap"])
  assert [(a.name, a.paired) for a in st.arms] == [
      ("adamw", False), ("stiefel", False), ("no_cap", True)]


def test_competitor_arms_train(tmp_path):
  """muon and qk_norm train a quick model (their recipe and model are
  trained nowhere else): qk_norm's model has the per-head norms and its
  AdamW is its own (lr, weight decay), muon's is the adamw arm's; both move
  their Q/K. The starts of every competitor are checked. stiefel_muon and
  orthogonal_init are not trained here, each ingredient of theirs is
  elsewhere: the stiefel_muon recipe keeps frames orthonormal in
  test_recipes_keep_frames_orthonormal, the per-head stiefel_attention
  wrapper with its start check trains the stiefel arm in
  test_quick_end_to_end_and_resume, qk_adamw trains adamw there, an own
  (lr, weight decay) trains qk_norm here; test_lm.py also trains
  orthogonal_init in the LM's quick study and steps stiefel_muon through
  stiefel_attention on the manifold."""
  cfg = cp.PRESETS["quick"]
  data = cifar_data.synthetic(448, cfg.val_size)
  inherit = {"adamw": {"lr": 3e-3, "weight_decay": 0.05},
             "muon": {"lr": 3e-3},
             "qk_norm": {"lr": 1e-2, "weight_decay": 0.01}}
  study_runs = cp.StudyRuns(data, cfg, tmp_path, inherit=inherit)
  study, runs = study_runs.study(), study_runs.finished()
  recs = {a: study_runs.execute(study_lib.paired_task(study, runs, a, 0, 384))
          for a in inherit if a != "adamw"}
  assert all(np.isfinite(r["test_acc"]) for r in recs.values())
  assert recs["muon"]["base"] == inherit["adamw"]
  assert recs["muon"]["hp"] == inherit["muon"]
  assert recs["qk_norm"]["base"] == inherit["qk_norm"]
  assert recs["muon"]["qk_movement"] > 0 and recs["qk_norm"]["qk_movement"] > 0
  params = cp.init_params(study_runs.trainer.model_of(cp.ARMS["qk_norm"]), cp.ARMS["qk_norm"], 0)
  assert "query_ln" in params["block_0"]["attn"] and "key_ln" in params["block_0"]["attn"]
  start = cp.init_params(study_runs.trainer.model, cp.ARMS["orthogonal_init"], 0)
  assert float(so.max_isometry_error(start, "flax")) < 1e-5
  plain = cp.init_params(study_runs.trainer.model, cp.ARMS["muon"], 0)
  assert float(so.max_isometry_error(plain, "flax")) > 0.1
  assert float(so.max_isometry_error(cp.init_params(
      study_runs.trainer.model, cp.ARMS["stiefel_muon"], 0), "flax")) < 1e-5


def test_per_coordinate_ablation_is_not_scale_free():
  # the shape of test_recipes_keep_frames_orthonormal's frames: the same
  # compiled operations
  w = jnp.asarray(np_frames(2, (3, 12, 4), np.float32))
  g = jnp.asarray(np_normal(3, w.shape, np.float32))
  scale = np.ones(w.shape, np.float32)
  scale[..., 0] = 100.0   # one column's gradient larger, in each frame

  def step(recipe, grad):
    tx = recipe(0.05, weight_decay=0.0, max_step_norm=1.0)
    u, _ = tx.update(grad, tx.init(w), w)
    return u

  a, b = step(cp.qk_stiefel, g), step(cp.qk_stiefel, 7.0 * g)
  np.testing.assert_allclose(a, b, atol=1e-5)
  c, d = step(cp.qk_per_coordinate, g), step(cp.qk_per_coordinate, g * scale)
  assert float(jnp.max(jnp.abs(c - d))) > 1e-3


def test_paired_statistics_and_sections(tmp_path):
  recs = []
  for s in range(4):
    recs.append({"kind": "run", "arm": "adamw", "n": 100, "seed": s, "test_acc": 0.30 + 0.01 * s, "train_loss": [2.0, 1.5]})
    recs.append({"kind": "run", "arm": "stiefel", "n": 100, "seed": s, "test_acc": 0.33 + 0.01 * s + 0.001 * s * s, "train_loss": [2.0, 1.0 + s]})
  recs.append({"kind": "run", "arm": "stiefel", "n": 100, "seed": 9, "test_acc": 0.9, "train_loss": [9.0]})  # unpaired
  row = cifar_report.compare(recs, "stiefel", "adamw", 100)
  assert row["n"] == 4 and row["wins"] == 4 and row["seeds"] == [0, 1, 2, 3]
  assert 3.0 < row["mean_diff"] < 3.5 and row["ci_low"] < row["mean_diff"] < row["ci_high"]
  assert row["loss_treatment"] == 2.5 and row["loss_baseline"] == 1.5
  assert "34.85 (2.500)" in cifar_report.markdown_table(stats.with_holm([row]))
  # the paper's table: a confirmation column only where confirmation ran
  disc = cifar_report.paper_comparisons(recs)
  conf = cifar_report.paper_comparisons(recs, "confirmation")
  assert disc[0]["seeds"] == [0, 1, 2, 3] and not any(conf)
  assert "confirmation seeds" not in cifar_report.paper_table(disc, conf)
  fresh = [dict(r, seed=r["seed"] + 500) for r in recs if r["seed"] < 4]
  conf = cifar_report.paper_comparisons(recs + fresh, "confirmation")
  assert conf[0]["seeds"] == [500, 501, 502, 503]
  table = cifar_report.paper_table(disc, conf).splitlines()
  assert "confirmation seeds" in table[0] and table[2].count("wins 4/4") == 2
  text = "# R\n\n## Grokking\n\nkeep me\n\n## CIFAR-10 patch benchmark\n\nold\n\n## Other\n\nkeep too\n"
  new = harness.replace_section(text, cifar_report.SECTION, "## CIFAR-10 patch benchmark\n\nnew")
  assert "old" not in new and "new" in new
  assert "keep me" in new and "keep too" in new
  assert harness.replace_section("# R\n", cifar_report.SECTION, cifar_report.SECTION + "\n\nx").endswith("x\n")
  policy = harness.POLICY_HEADING + "\n\nrules\n"
  first = harness.with_policy(text, policy)
  assert first.startswith("# R\n\n" + policy + "\n## Grokking")
  assert harness.with_policy(first, policy) == first


def test_arms_get_the_same_grid_density_and_three_tuning_seeds():
  grids = {a.name: a.axes for a in cp.study_arms()}
  for name in ("adamw", "stiefel", "rsgd"):   # 3 points per hyperparameter
    assert all(len(v) == 3 for _, v in grids[name])
  assert [a for a, _ in grids["adamw"]] == ["lr", "weight_decay"]
  assert [a for a, _ in grids["stiefel"]] == ["lr", "cap"]
  assert len(cp.Config().tune_seeds) >= 3


def test_holm_step_down():
  np.testing.assert_allclose(stats.holm([0.01, 0.04, 0.03, 0.005]),
                             [0.03, 0.06, 0.06, 0.02])
  adj = stats.holm([0.02, float("nan"), 0.04, 0.9])   # NaN: not in the family
  np.testing.assert_allclose([adj[0], adj[2], adj[3]], [0.06, 0.08, 0.9])
  assert math.isnan(adj[1])
  np.testing.assert_allclose(stats.holm([0.3, 0.2]), [0.4, 0.4])
  assert stats.holm([0.7, 0.6]) == [1.0, 1.0] and stats.holm([]) == []
  # Holm never rejects less than Bonferroni, nor more than uncorrected.
  p = np.random.default_rng(0).uniform(0, 0.2, 9)
  h = np.array(stats.holm(p))
  assert np.all(h >= p) and np.all(h <= np.minimum(1, 9 * p))


def test_paired_row_keeps_treatment_minus_baseline_and_counts_better_seeds():
  t = {0: 1.0, 1: 2.0, 2: 3.5}
  b = {0: 1.5, 1: 2.2, 2: 3.0, 7: 9.0}          # seed 7 has no pair
  hi = stats.paired_row(t, b)
  lo = stats.paired_row(t, b, lower_is_better=True)
  assert hi["seeds"] == lo["seeds"] == [0, 1, 2]
  assert hi["mean_diff"] == pytest.approx(-0.2 / 3)
  assert lo["mean_diff"] == pytest.approx(hi["mean_diff"])
  assert (hi["wins"], hi["losses"]) == (1, 2)     # higher is better
  assert (lo["wins"], lo["losses"]) == (2, 1)     # lower is better
  for k in ("ci_low", "ci_high", "t", "p"):
    assert lo[k] == pytest.approx(hi[k])
  assert hi["mean_treatment"] == pytest.approx(6.5 / 3)
  assert "loss_treatment" not in hi
  assert stats.paired_row({0: 1.0}, {1: 1.0}) is None


def test_comparison_rows_holm_across_the_table_and_one_rendering():
  acc = {"a": {0: 0.6, 1: 0.7, 2: 0.9}, "b": {0: 0.5, 1: 0.5, 2: 0.6},
         "c": {5: 0.1}}                          # c shares no seed with a
  loss = {"a": {0: 1.0, 1: 1.0, 2: 1.0}, "b": {0: 2.0, 1: 2.0, 2: 2.0},
          "c": {5: 3.0}}
  pairs = [dict(treatment="a", baseline="b", size=10),
           dict(treatment="b", baseline="a", size=10),
           dict(treatment="a", baseline="c", size=10)]
  rows = stats.comparison_rows(pairs, lambda c, role: acc[c[role]],
                               lambda c, role: loss[c[role]])
  assert [(r["treatment"], r["baseline"], r["size"]) for r in rows] == [
      ("a", "b", 10), ("b", "a", 10)]            # no common seed: left out
  assert rows[0]["mean_diff"] == pytest.approx(0.2)
  assert rows[1]["mean_diff"] == pytest.approx(-0.2)
  assert (rows[0]["wins"], rows[1]["wins"]) == (3, 0)
  assert rows[0]["p_holm"] == pytest.approx(min(1.0, 2 * rows[0]["p"]))
  low = stats.comparison_rows(pairs[:1], lambda c, role: loss[c[role]],
                              lower_is_better=True)
  assert low[0]["wins"] == 3 and low[0]["mean_diff"] == pytest.approx(-1.0)
  lines = harness.comparison_lines(rows, "acc %", size="n")
  assert lines[0].startswith("| treatment | baseline | n | seeds |")
  assert "| a | b | 10 | 0-2 | 0.73 (1.000) | 0.53 (2.000) | +0.20 [" in lines[2]
  assert lines[2].endswith("| 3/3 |") and len(lines) == 4
  assert harness.finding_text(rows[0], "pp", size="n").startswith(
      "a - b, n = 10: +0.20 pp [")


def _row(t, n, diff, p, seeds):
  return dict(treatment=t, baseline="adamw", size=n, mean_diff=diff, p=p,
              seeds=seeds, n=len(seeds), mean_treatment=50.0 + diff,
              mean_baseline=50.0, ci_low=diff - 1.0, ci_high=diff + 1.0,
              t=3.0, wins=len(seeds), ties=0)


def test_findings_need_confirmation_on_fresh_seeds():
  key = cifar_report.COMPARISON_KEY
  disc = stats.with_holm([_row("stiefel", 1000, 0.75, 0.002, [0]),
                          _row("rsgd", 8068, 1.5, 0.004, [0])])
  conf = stats.with_holm([_row("stiefel", 1000, 0.13, 0.6, [500]),
                          _row("rsgd", 8068, 1.4, 0.01, [500])])
  assert [r["treatment"] for r in stats.confirmed(disc, conf, key)] == ["rsgd"]
  flipped = stats.with_holm([_row("stiefel", 1000, 0.13, 0.6, [500]),
                             _row("rsgd", 8068, -1.4, 0.01, [500])])
  assert stats.confirmed(disc, flipped, key) == []
  # Another n is another comparison: no discovery twin, no finding.
  other_n = stats.with_holm([_row("stiefel", 1000, 0.13, 0.6, [500]),
                             _row("rsgd", 8068, 0.1, 0.6, [500]),
                             _row("rsgd", 4000, 1.4, 0.01, [500])])
  assert stats.confirmed(disc, other_n, key) == []
  # Holm runs across the confirmation table: p = 0.03 alone is a finding,
  # beside two null comparisons (adjusted 3 x 0.03 = 0.09) it is not.
  one = [_row("rsgd", 8068, 1.5, 0.004, [0])]
  three = stats.with_holm(one + [_row("stiefel", 1000, 0.1, 0.01, [0]),
                                 _row("stiefel", 8068, 0.1, 0.01, [0])])
  alone = stats.with_holm([_row("rsgd", 8068, 1.4, 0.03, [500])])
  crowded = stats.with_holm([_row("rsgd", 8068, 1.4, 0.03, [500]),
                             _row("stiefel", 1000, 0.1, 0.5, [500]),
                             _row("stiefel", 8068, 0.1, 0.6, [500])])
  assert len(stats.confirmed(stats.with_holm(one), alone, key)) == 1
  assert stats.confirmed(three, crowded, key) == []
  # An unfinished confirmation stage confirms nothing: a comparison without
  # its confirmation row, or with fewer seeds than on discovery.
  disc2 = stats.with_holm([_row("stiefel", 1000, 0.75, 0.002, [0, 1]),
                           _row("rsgd", 8068, 1.5, 0.004, [0, 1])])
  partial = stats.with_holm([_row("rsgd", 8068, 1.4, 0.001, [500, 501])])
  short = stats.with_holm([_row("stiefel", 1000, 0.7, 0.001, [500]),
                           _row("rsgd", 8068, 1.4, 0.001, [500, 501])])
  done = stats.with_holm([_row("stiefel", 1000, 0.7, 0.001, [500, 501]),
                          _row("rsgd", 8068, 1.4, 0.001, [500, 501])])
  assert not stats.confirmation_complete(disc2, partial, key)
  assert stats.confirmed(disc2, partial, key) == []
  assert stats.confirmed(disc2, short, key) == []
  assert stats.confirmation_complete(disc2, done, key)
  assert len(stats.confirmed(disc2, done, key)) == 2
  # ... and so is a study whose planned arms have not all run.
  assert stats.confirmed(disc2, done, key, arms=["stiefel", "muon"]) == []
  assert len(stats.confirmed(disc2, done, key, arms=["stiefel", "rsgd"])) == 2
  summary = dict(seeds=dict(discovery="0-1", confirmation="500-501"),
                 comparisons=disc2, confirmation=short)
  text = cifar_report.claims_text(summary)
  assert "unfinished" in text and "confirmed" not in text
  assert "2 of 2 comparisons confirmed" in cifar_report.claims_text(
      dict(summary, confirmation=done))
  assert harness.seed_block(11) == "discovery"
  assert harness.seed_block(500) == "confirmation"


def test_each_family_has_its_own_holm_and_confirmation():
  # The main arms on discovery and confirmation seeds; then an ablation
  # joins on discovery seeds only: the main family's table, Holm p-values
  # and findings stay as they were, and the ablation's claims wait.
  rng = np.random.default_rng(0)
  gains = {"adamw": 0.0, "stiefel": 0.03, "rsgd": 0.031, "no_cap": 0.02}
  noise = {s: 0.005 * rng.standard_normal(4) for s in (0, 1, 2, 3, 500, 501, 502, 503)}
  def runs(arms, seeds):
    return [{"kind": "run", "arm": a, "n": 100, "seed": s, "train_loss": [1.0],
             "test_acc": 0.5 + gains[a] + noise[s][i]}
            for s in seeds for i, a in enumerate(arms)]
  main = [("main", ["adamw", "stiefel", "rsgd"])]
  recs = runs(["adamw", "stiefel", "rsgd"], noise)
  fams = main + [("ablation", ["no_cap"])]
  more = recs + runs(["no_cap"], (0, 1, 2, 3))
  before = cifar_report.family_tables(recs, main)
  after = cifar_report.family_tables(more, fams)
  assert [(r["treatment"], r["baseline"]) for r in before] == [
      ("stiefel", "adamw"), ("rsgd", "adamw"), ("stiefel", "rsgd")]
  assert after[:3] == before and {r["family"] for r in after[3:]} == {"ablation"}
  assert [(r["treatment"], r["baseline"]) for r in after[3:]] == [
      ("no_cap", "adamw"), ("stiefel", "no_cap")]
  summary = dict(seeds=dict(discovery="0-3", confirmation="500-503"),
                 comparisons=after,
                 confirmation=cifar_report.family_tables(more, fams, "confirmation"))
  text = cifar_report.claims_text(summary)
  main_text, ablation_text = text.split("Family `ablation`")
  assert "2 of 3 comparisons confirmed" in main_text
  assert "No confirmation runs" in ablation_text and "confirmed" not in ablation_text
  assert cifar_report.as_families(["adamw", "stiefel"]) == [(None, ["adamw", "stiefel"])]
  # A family with a planned arm not run yet confirms nothing, although
  # every comparison in its tables has its confirmation seeds: its Holm
  # family will grow when that arm runs.
  planned = dict(summary, families=[("main", ["adamw", "stiefel", "rsgd"]),
                                    ("ablation", ["no_cap", "whole_frame"])])
  more_conf = more + runs(["no_cap"], (500, 501, 502, 503))
  planned["confirmation"] = cifar_report.family_tables(more_conf, fams,
                                                       "confirmation")
  main_text, ablation_text = cifar_report.claims_text(planned).split(
      "Family `ablation`")
  assert "2 of 3 comparisons confirmed" in main_text
  assert "unfinished (whole_frame: no paired runs yet)" in ablation_text
  assert "confirmed" not in ablation_text
  assert "comparisons confirmed" in cifar_report.claims_text(
      dict(planned, families=fams)).split("Family `ablation`")[1]


def test_seeds_identity_and_run_store(tmp_path, capsys):
  assert harness.parse_seeds("0-11") == tuple(range(12))
  assert harness.parse_seeds("500,501,502") == (500, 501, 502)
  assert harness.parse_seeds("0-3,7,2") == (0, 1, 2, 3, 7)
  assert harness.parse_seeds("5") == (5,)
  for bad in ("", "3-1", "a", "1,,2"):
    with pytest.raises(ValueError, match="seeds"):
      harness.parse_seeds(bad)
  assert harness.format_seeds([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
  assert harness.parse_seeds(harness.format_seeds(range(500, 512))) == tuple(
      range(500, 512))
  opts = driver.parse(cp.EXPERIMENT, ["--seeds", "500-511", "--set",
                                      "other_seeds=500,501", "--set",
                                      "model.dim=32"])
  cfg, plan = cp.experiment.configure(opts)
  assert opts.seeds == tuple(range(500, 512)) and plan.other_seeds == (500, 501)
  assert cfg.model.dim == 32 and cfg.epochs == cp.PRESETS["default"].epochs
  capsys.readouterr()
  with pytest.raises(SystemExit, match="^2$"):   # argparse's error exit
    driver.parse(cp.EXPERIMENT, ["--seeds", "x"])
  assert ("argument --seeds: seeds: 'x' is not a list or range of seeds"
          in capsys.readouterr().err)
  # identity: content only; the version enters, paths never do
  cfg = {"a": 1}
  assert harness.run_identity(cfg, "d:md5=1") == harness.run_identity(dict(cfg), "d:md5=1")
  assert harness.run_identity(cfg, "d:md5=1") != harness.run_identity(cfg, "d:md5=2")
  assert harness.run_identity(cfg, "d", "0.1.0") != harness.run_identity(cfg, "d", "9")
  assert set(harness.machine()) == {"cpus", "usable_cpus", "arch", "platform",
                                    "python", "jax", "jaxlib", "backend"}
  # atomic writes leave no temporary behind; the store checks identity
  store = harness.RunStore(tmp_path / "x")
  rec = {"identity": harness.run_identity(cfg, "d", "0.1.0"), "config": cfg,
         "data": "d", "library_version": "0.1.0"}
  store.save("r", rec)
  assert [p.name for p in store.dir.iterdir()] == ["r.json"]
  assert store.load("r", rec["identity"]) == rec and store.load("r", "no") is None
  assert store.load_matching("r", cfg, "d") == rec       # any version
  assert store.load_matching("r", {"a": 2}, "d") is None
  # The numerics version, not the release, is the identity's: a run of a
  # release with the same numerics (0.4.0 over 0.3.0) keeps matching, and a
  # record older than 0.4.0 (its release only) matches under that release.
  assert harness.run_identity(cfg, "d") == harness.run_identity(
      cfg, "d", so.NUMERICS_VERSION)
  new = {"identity": harness.run_identity(cfg, "d"), "config": cfg, "data": "d",
         **harness.versions()}
  assert new["numerics_version"] == so.NUMERICS_VERSION
  assert new["library_version"] == so.__version__
  assert harness.matches(new) and harness.matches(rec)
  assert not harness.matches({**new, "numerics_version": "9"})
  assert harness.portable(harness.REPO / "benchmarks" / "x") == "benchmarks/x"
  assert harness.portable(tmp_path / "y") == "y"
  assert harness.command_line("benchmarks.x", [
      "--out", str(tmp_path / "o"), f"--data={tmp_path}/d.npz", "--seeds",
      "0-3"]) == "python -m benchmarks.x --out o --data=d.npz --seeds 0-3"


# ---------------------------------------------------------------- end to end


def test_quick_end_to_end_and_resume(tmp_path, capsys):
  out = tmp_path / "cifar"
  md = tmp_path / "RESULTS.md"
  md.write_text("# Results\n\n## Grokking\n\nother helper's text\n")
  # --dry-run counts the plan (2 arms x 2 seeds, and each arm's one tuning
  # point x 1 tuning seed) and trains nothing.
  assert cp.main(["--quick", "--seeds", "0,1", "--out", str(out),
                  "--dry-run"]) == {}
  assert "to do: 2 tuning and 4 paired runs" in capsys.readouterr().out
  assert not list((out / "runs").glob("*.json"))
  # a time budget stops before the first run expected to end past it (here:
  # the second; the first always runs)
  cp.main(["--quick", "--seeds", "0,1", "--out", str(out), "--time-budget",
           "1e-3"])
  assert len(list((out / "runs").glob("*.json"))) == 1
  assert "time budget 0 s: stopping with 1 planned" in capsys.readouterr().out
  summary = cp.main(["--quick", "--seeds", "0,1", "--out", str(out),
                     "--results-md", str(md)])
  runs = sorted((out / "runs").glob("*.json"))
  names = {p.stem for p in runs}
  assert {"adamw__n384__s0", "stiefel__n384__s1"} <= names
  rec = json.loads((out / "runs" / "stiefel__n384__s0.json").read_text())
  assert rec["data"].startswith("synthetic:0:md5=") and rec["qk_isometry_error"] < 1e-4
  assert rec["hp"] and rec["base"]["lr"] > 0 and rec["base"]["weight_decay"] > 0 and len(rec["test_curve"]) == 2
  assert rec["identity"] == harness.run_identity(
      cp.PRESETS["quick"].to_dict(), rec["data"])
  assert rec["library_version"] == so.__version__
  assert rec["code_hash"] == harness.code_hash()
  assert set(rec["machine"]) == set(harness.machine())   # no hostname
  assert str(tmp_path) not in json.dumps(rec)
  row = next(r for r in summary["comparisons"]
             if r["treatment"] == "stiefel" and r["baseline"] == "adamw")
  assert row["n"] == 2 and row["seeds"] == [0, 1]
  for f in ("summary.json", "table.md", "gain_vs_n.png", "curves.png"):
    assert (out / f).stat().st_size > 0
  text = md.read_text()
  assert "other helper's text" in text and cifar_report.SECTION in text and "+6.79" in text
  assert "Holm p" in text and "none of these comparisons is a finding" in text
  assert str(tmp_path) not in text
  mtimes = {p: p.stat().st_mtime_ns for p in runs}
  capsys.readouterr()
  cp.main(["--quick", "--out", str(out)])         # resumes: nothing reruns
  assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
  assert "to do: 0 tuning and 0 paired runs" in capsys.readouterr().out
  # the report regenerates the same bytes from the raw runs
  before = {f: (out / f).read_bytes() for f in ("summary.json", "table.md")}
  cp.main(["--quick", "--out", str(out), "--report-only", "--results-md", str(md)])
  assert md.read_text() == text
  assert all((out / f).read_bytes() == b for f, b in before.items())
