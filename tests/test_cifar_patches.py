"""CIFAR-10 patch benchmark: loader, model, paired streams, arm recipes and
the --quick end-to-end run (synthetic images through the same code path)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from benchmarks import cifar_data, cifar_patches as cp
from benchmarks.patch_vit import PatchViT, PatchViTConfig, patchify


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
  assert got.source == f"full:{folder}"
  # the folder itself is accepted too, and so is the environment variable
  assert cifar_data.load_batches(folder, verify_md5=False).x_train.shape == ds.x_train.shape


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
  assert ds.source == f"subset:{path}"
  assert ds.x_train.shape == (8068, 32, 32, 3) and ds.x_test.shape == (1017, 32, 32, 3)


# ---------------------------------------------------------------- model


def test_patchify_and_model_shapes():
  x = jnp.arange(2 * 32 * 32 * 3, dtype=jnp.float32).reshape(2, 32, 32, 3)
  p = patchify(x, 4)
  assert p.shape == (2, 64, 48)
  np.testing.assert_array_equal(p[0, 1], x[0, 0:4, 4:8].reshape(-1))
  cfg = PatchViTConfig(dim=16, heads=2)
  model = PatchViT(cfg)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  assert model.apply({"params": params}, x).shape == (2, 10)
  labels = so.qk_labels(params)
  qk = [l for l in jax.tree.leaves(labels) if l == so.STIEFEL]
  assert len(qk) == 2
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
  model = PatchViT(PatchViTConfig(dim=16, heads=2))
  a = cp.init_params(model, cp.ARMS["adamw"], 7)
  b = cp.init_params(model, cp.ARMS["stiefel"], 7)
  labels = so.qk_labels(a)
  for x, y, l in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(labels)):
    if l == so.EUCLIDEAN:
      np.testing.assert_array_equal(x, y)
  assert float(so.max_isometry_error(b)) < 1e-5
  assert float(so.max_isometry_error(a)) > 1e-2
  whole = cp.init_params(model, cp.ARMS["whole_frame"], 7)
  assert float(so.max_isometry_error(whole, per_head=False)) < 1e-5


@pytest.mark.parametrize("name", [a for a in cp.ARMS if a != "adamw"])
def test_recipes_keep_frames_orthonormal(name):
  arm = cp.ARMS[name]
  hp = {"lr": 0.05, "cap": 0.1}
  kw = dict(arm.fixed)
  kw.update(cap=hp["cap"])
  tx = arm.recipe(hp["lr"], weight_decay=0.1, **kw)
  w = so.random_frames(jax.random.PRNGKey(1), (3, 12, 4))
  state = tx.init(w)
  w0 = w
  for k in range(3):
    g = jax.random.normal(jax.random.PRNGKey(10 + k), w.shape)
    u, state = tx.update(g, state, w)
    w = optax.apply_updates(w, u)
  assert float(jnp.max(so.isometry_error(w))) < 1e-4
  moved = float(jnp.max(jnp.abs(w - w0)))
  assert (moved == 0.0) == (name == "frozen")


def test_per_coordinate_ablation_is_not_scale_free():
  w = so.random_frames(jax.random.PRNGKey(2), (12, 4))
  g = jax.random.normal(jax.random.PRNGKey(3), w.shape)
  scale = jnp.ones_like(g).at[:, 0].set(100.0)   # one column's gradient larger

  def step(recipe, grad):
    tx = recipe(0.05, weight_decay=0.0, cap=1.0)
    u, _ = tx.update(grad, tx.init(w), w)
    return u

  a, b = step(cp.qk_stiefel, g), step(cp.qk_stiefel, 7.0 * g)
  np.testing.assert_allclose(a, b, atol=1e-5)
  c, d = step(cp.qk_per_coordinate, g), step(cp.qk_per_coordinate, g * scale)
  assert float(jnp.max(jnp.abs(c - d))) > 1e-3


def test_paired_statistics_and_sections(tmp_path):
  recs = []
  for s in range(4):
    recs.append({"kind": "run", "arm": "adamw", "n": 100, "seed": s, "test_acc": 0.30 + 0.01 * s})
    recs.append({"kind": "run", "arm": "stiefel", "n": 100, "seed": s, "test_acc": 0.33 + 0.01 * s + 0.001 * s * s})
  recs.append({"kind": "run", "arm": "stiefel", "n": 100, "seed": 9, "test_acc": 0.9})  # unpaired
  row = cp.compare(recs, "stiefel", "adamw", 100)
  assert row["n"] == 4 and row["wins"] == 4 and row["seeds"] == [0, 1, 2, 3]
  assert 3.0 < row["mean_diff"] < 3.5 and row["ci_low"] < row["mean_diff"] < row["ci_high"]
  text = "# R\n\n## Grokking\n\nkeep me\n\n## CIFAR-10 patch benchmark\n\nold\n\n## Other\n\nkeep too\n"
  new = cp.replace_section(text, cp.SECTION, "## CIFAR-10 patch benchmark\n\nnew")
  assert "old" not in new and "new" in new
  assert "keep me" in new and "keep too" in new
  assert cp.replace_section("# R\n", cp.SECTION, cp.SECTION + "\n\nx").endswith("x\n")


# ---------------------------------------------------------------- end to end


def test_quick_end_to_end_and_resume(tmp_path):
  out = tmp_path / "cifar"
  md = tmp_path / "RESULTS.md"
  md.write_text("# Results\n\n## Grokking\n\nother helper's text\n")
  summary = cp.main(["--quick", "--out", str(out), "--results-md", str(md)])
  runs = sorted((out / "runs").glob("*.json"))
  names = {p.stem for p in runs}
  assert {"adamw__n384__s0", "stiefel__n384__s1"} <= names
  rec = json.loads((out / "runs" / "stiefel__n384__s0.json").read_text())
  assert rec["data"] == "synthetic:0" and rec["qk_isometry_error"] < 1e-4
  assert rec["hp"] and rec["base_lr"] > 0 and len(rec["test_curve"]) == 2
  row = next(r for r in summary["comparisons"]
             if r["treatment"] == "stiefel" and r["baseline"] == "adamw")
  assert row["n"] == 2 and row["seeds"] == [0, 1]
  for f in ("summary.json", "table.md", "gain_vs_n.png", "curves.png"):
    assert (out / f).stat().st_size > 0
  text = md.read_text()
  assert "other helper's text" in text and cp.SECTION in text and "+6.79" in text
  mtimes = {p: p.stat().st_mtime_ns for p in runs}
  cp.main(["--quick", "--out", str(out)])         # resumes: nothing reruns
  assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
