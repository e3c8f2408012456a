"""The grokking benchmark: data, pairing of the arms, and a tiny end-to-end
run of `python -m benchmarks.grokking` (same code path, small sizes)."""

import json

import jax
import numpy as np
import pytest

import stiefel_optax as so
from benchmarks import grokking, modular, transformer

TINY_CFG = grokking.Config(p=11, d_model=16, num_heads=2, d_mlp=32,
                           log_every=10, train_fraction=0.5)
TINY = ["--p", "11", "--d-model", "16", "--num-heads", "2", "--d-mlp", "32",
        "--steps", "20", "--seeds", "2", "--long-steps", "30",
        "--probe-steps", "10", "--log-every", "10", "--train-fraction", "0.5",
        "--no-progress"]


@pytest.mark.parametrize("op", modular.OPS)
def test_equations_are_correct(op):
  p = 11
  x, y = modular.all_equations(p, op)
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
  s0, s0b, s1 = (modular.make_split(13, "+", 0.4, s) for s in (0, 0, 1))
  np.testing.assert_array_equal(s0.train_x, s0b.train_x)
  assert not np.array_equal(s0.train_x, s1.train_x)
  assert s0.train_x.shape[0] == round(0.4 * 169)
  rows = {tuple(r) for r in s0.train_x} | {tuple(r) for r in s0.val_x}
  assert len(rows) == 169 == s0.train_x.shape[0] + s0.val_x.shape[0]
  with pytest.raises(ValueError, match="train_fraction"):
    modular.split(s0.train_x, s0.train_y, 1.0, 0)


def test_arms_share_every_non_qk_weight():
  pa = grokking.initial_params(TINY_CFG, "adamw", 3)
  ps = grokking.initial_params(TINY_CFG, "stiefel", 3)
  labels = so.qk_labels(pa)
  n_qk = 0
  for a, s, l in zip(jax.tree.leaves(pa), jax.tree.leaves(ps),
                     jax.tree.leaves(labels)):
    if l == so.EUCLIDEAN:
      np.testing.assert_array_equal(a, s)
    else:
      n_qk += 1
      assert not np.allclose(a, s)
  assert n_qk == 2
  so.check_frames(ps, atol=1e-5)
  with pytest.raises(ValueError, match="off the Stiefel manifold"):
    so.check_frames(pa, atol=1e-5)


def test_transformer_reads_the_last_token():
  model = transformer.Transformer(vocab_size=12, seq_len=3, num_classes=11,
                                  d_model=16, num_heads=2, d_mlp=32,
                                  num_layers=2)
  params = transformer.init_params(model, jax.random.PRNGKey(0))
  tokens = np.array([[1, 2, 11], [3, 4, 11]], np.int32)
  assert model.apply({"params": params}, tokens).shape == (2, 11)
  with pytest.raises(ValueError, match="seq_len"):
    model.apply({"params": params}, tokens[:, :2])


def test_statistics_of_histories():
  h = dict(step=[0, 10, 20, 30], val_acc=[0.0, 0.96, 0.5, 0.97])
  assert grokking.steps_to_target(h, 0.95) == 10
  assert grokking.min_after(h, 10) == 0.5
  assert grokking.steps_to_target(h, 0.99) is None
  assert grokking.min_after(h, None) is None
  assert grokking.censored([None, 5], 31) == [31, 5]


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
  comp = grokking.compare_arms(summ, steps=1000)
  assert comp["n_never_" + ("stiefel" if faster == "adamw" else "adamw")] == 1
  verdict = grokking.winner(comp)
  assert verdict.startswith(f"Grokking speed: {faster} ahead")
  assert f"{faster} first in 4," in verdict


def test_tiny_study_end_to_end_and_resume(tmp_path):
  out = tmp_path / "grok"
  res = grokking.main(TINY + ["--out", str(out)])
  assert grokking.configure(grokking.parse_args(TINY))[0] == TINY_CFG
  saved = json.loads((out / "results.json").read_text())
  assert saved["meta"]["command"].startswith("python -m benchmarks.grokking")
  assert saved["meta"]["machine"]["nproc"] >= 1
  assert saved["meta"]["wall_s"] > 0
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
  assert len(runs) == 2 * 2 + 2
  before = (out / "runs" / runs[0]).read_text()
  again = grokking.main(TINY + ["--out", str(out), "--no-plots"])
  assert (out / "runs" / runs[0]).read_text() == before
  def plain(x):
    return json.loads(json.dumps(x))
  assert plain(again["results"]["summaries"]) == plain(
      res["results"]["summaries"])
  report = grokking.main(TINY + ["--out", str(out), "--no-plots",
                                 "--report-only"])
  assert plain(report["results"]["summaries"]) == plain(
      res["results"]["summaries"])


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
