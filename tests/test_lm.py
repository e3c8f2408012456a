"""The language-model benchmark (benchmarks/lm.py): the model is nanoGPT's,
the schedule and weight decay are nanoGPT's, the arms do what they say
(Stiefel Q/K frames stay orthonormal while the v third follows AdamW; Muon
acts on each head's q/k matrix), and `python -m benchmarks.lm --quick` runs,
resumes and is reused on rerun; `TOY=1 bash benchmarks/accelerator.sh` runs."""

import dataclasses
import functools
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from benchmarks import harness, lm

Q = lm.QUICK
VOCAB = 65
DATA = lm.default_data()
needs_data = pytest.mark.skipif(not DATA.is_file(),
                                reason=f"no corpus at {DATA}")


def test_cpu_config_is_nanogpts_small_model():
  """0.80M parameters without the position embedding (nanoGPT's count),
  head tied to wte (no separate head matrix), no biases."""
  model = lm.make_model(lm.CPU, VOCAB)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, 64), jnp.int32))["params"]
  paths = {so.path_str(p): x.shape for p, x in
           jax.tree_util.tree_leaves_with_path(shapes)}
  assert sum(math.prod(s) for s in paths.values()) - 64 * 128 == 795904
  assert paths["h_0/attn/c_attn/kernel"] == (128, 384)
  assert not any("bias" in p or "head" in p for p in paths)


@functools.lru_cache(maxsize=None)
def _params(arm="adamw"):
  return lm.initial_params(dataclasses.replace(Q, arm=arm), VOCAB, 0)


def test_attention_is_causal():
  apply = jax.jit(lm.make_model(Q, VOCAB).apply)
  params = _params()
  x = jnp.arange(Q.block_size)[None] % VOCAB
  y = x.at[0, 9:].set(3)
  a, b = apply({"params": params}, x), apply({"params": params}, y)
  np.testing.assert_allclose(a[0, :9], b[0, :9], atol=1e-6)
  assert not np.allclose(a[0, 9:], b[0, 9:])


def test_lr_schedule_is_nanogpts_get_lr():
  cfg = lm.CPU

  def get_lr(it):   # nanoGPT train.py
    if it < cfg.warmup_iters:
      return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
      return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)

  sched = lm.lr_schedule(cfg, cfg.learning_rate)
  for it in (0, 1, 50, 99, 100, 101, 777, 1999, 2000, 2001, 3000):
    np.testing.assert_allclose(float(sched(it)), get_lr(it), rtol=1e-5)
  np.testing.assert_allclose(float(lm.lr_schedule(cfg, 0.03)(2000)), 0.003,
                             rtol=1e-5)


def test_weight_decay_on_rank_2_parameters_only():
  params = _params()
  mask = {so.path_str(p): m for p, m in
          jax.tree_util.tree_leaves_with_path(lm.decay_mask(params))}
  assert mask["wte/embedding"] and mask["wpe/embedding"]
  assert mask["h_0/attn/c_attn/kernel"] and mask["h_1/c_fc/kernel"]
  assert not mask["h_0/ln_1/scale"] and not mask["ln_f/scale"]


def test_get_batch_is_shifted_and_seeded():
  data = jnp.arange(1000, dtype=jnp.int32)
  x, y = lm.get_batch(data, jax.random.PRNGKey(3), 5, 8)
  np.testing.assert_array_equal(y, x + 1)
  x2, _ = lm.get_batch(data, jax.random.PRNGKey(3), 5, 8)
  np.testing.assert_array_equal(x, x2)
  assert x.shape == (5, 8) and int(y.max()) < 1000


def _random_grads(params, seed):
  leaves, tdef = jax.tree.flatten(params)
  ks = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return tdef.unflatten([1e-3 * jax.random.normal(k, x.shape)
                         for k, x in zip(ks, leaves)])


def _thirds(params, path="h_0/attn/c_attn/kernel"):
  leaves = {so.path_str(p): x for p, x in
            jax.tree_util.tree_leaves_with_path(params)}
  return jnp.split(leaves[path], 3, axis=1)


def test_stiefel_arm_keeps_qk_orthonormal_and_v_on_adamw():
  cfg = dataclasses.replace(Q, arm="stiefel", stiefel_learning_rate=0.1)
  start = _params("stiefel")
  sel = lm.frames(cfg)
  assert float(so.max_isometry_error(start, sel)) < 1e-5
  grads = [_random_grads(start, i) for i in range(3)]
  runs = {}
  for arm in ("stiefel", "orthogonal_init"):   # the same start, then AdamW
    tx = lm.make_optimizer(dataclasses.replace(cfg, arm=arm))
    update, p = jax.jit(tx.update), start
    state = tx.init(p)   # checks the orthonormal start
    for g in grads:
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
    runs[arm] = p
  assert float(so.max_isometry_error(runs["stiefel"], sel)) < 1e-5
  assert float(so.max_isometry_error(runs["orthogonal_init"], sel)) > 1e-3
  (qs, ks, vs), (qa, ka, va) = _thirds(runs["stiefel"]), _thirds(
      runs["orthogonal_init"])
  np.testing.assert_allclose(vs, va, atol=1e-7)
  assert not np.allclose(qs, qa) and not np.allclose(ks, ka)
  # every weight outside c_attn identical too
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(runs["stiefel"]),
                          jax.tree.leaves(runs["orthogonal_init"])):
    if "c_attn" not in so.path_str(path):
      np.testing.assert_allclose(a, b, atol=1e-7)


def test_muon_arm_is_optax_muon_on_each_head():
  cfg = dataclasses.replace(Q, arm="muon")
  params = _params()
  grads = _random_grads(params, 0)
  u, _ = lm.make_optimizer(cfg).update(grads, lm.make_optimizer(cfg).init(
      params), params)
  hd = cfg.n_embd // cfg.n_head
  ref = optax.contrib.muon(lm.lr_schedule(cfg, cfg.muon_learning_rate),
                           beta=0.95, weight_decay=cfg.weight_decay,
                           consistent_rms=0.2)
  for third in (0, 1):   # q, k
    for h in range(cfg.n_head):
      cols = slice(third * cfg.n_embd + h * hd, third * cfg.n_embd + (h + 1) * hd)
      w = {"w": _thirds(params)[third][:, h * hd:(h + 1) * hd]}
      g = {"w": _thirds(grads)[third][:, h * hd:(h + 1) * hd]}
      want, _ = ref.update(g, ref.init(w), w)
      got = jnp.concatenate(_thirds(u), 1)[:, cols]
      np.testing.assert_allclose(got, want["w"], rtol=1e-4, atol=1e-8)


@pytest.fixture
def fast_compile(monkeypatch):
  """Toy sizes: skip LLVM's optimisation (most of the compile time)."""
  caches = (lm.chunk_fn, lm.estimate_fn, lm.full_loss_fn)
  monkeypatch.setattr(lm, "COMPILER_OPTIONS",
                      {"xla_backend_optimization_level": 0})
  for c in caches:
    c.cache_clear()
  yield
  for c in caches:
    c.cache_clear()


@needs_data
def test_quick_run_resumes_and_is_reused(tmp_path, fast_compile):
  out = tmp_path / "lm"
  md = tmp_path / "RESULTS.md"
  md.write_text("# Benchmark results\n\n## Grokking\n\nother text\n")
  rep = lm.main(["--quick", "--out", str(out), "--quiet", "--results-md",
                 str(md)])
  text = md.read_text()
  assert "other text" in text and text.rstrip().endswith(rep["table"].rstrip())
  assert lm.SECTION in text and str(tmp_path) not in text
  names = sorted(p.name for p in (out / "runs").glob("*"))
  assert len(names) == 2 and all(n.endswith(".json") for n in names)
  first = {n: json.loads((out / "runs" / n).read_text()) for n in names}
  rec = next(r for r in first.values() if r["arm"] == "stiefel")
  assert rec["final"]["qk_iso"] < 1e-5
  assert rec["data"] == f"tinyshakespeare:md5={lm.CORPUS_MD5}"
  assert str(tmp_path) not in json.dumps(first)
  assert "| stiefel lr 0.3 cap 0.3 | 0.001 -> 0.0001 | 0 |" in rep["table"]
  # rerun: nothing trained, the same files; the report regenerates the
  # same bytes from the raw runs
  table = (out / "table.md").read_bytes()
  lm.main(["--quick", "--out", str(out), "--quiet"])
  assert {n: json.loads((out / "runs" / n).read_text())
          for n in names} == first
  lm.main(["--report-only", "--out", str(out), "--quiet"])
  assert (out / "table.md").read_bytes() == table
  # stopped after step 20 (saved at 10), then resumed: the same final losses
  cfg = dataclasses.replace(Q, arm="stiefel")
  corpus = lm.load_corpus(str(DATA))

  def stop(msg):
    if "step 20" in msg:
      raise KeyboardInterrupt

  other = tmp_path / "other"
  with pytest.raises(KeyboardInterrupt):
    lm.train_run(cfg, 0, corpus, other, save_every_s=0, log=stop)
  part = harness.read_json(other / "runs" / f"{rec['name']}.json")
  assert part["final"] is None and part["history"]["step"][-1] == 10
  done = lm.train_run(cfg, 0, corpus, other, log=lambda *_: None)
  assert done["final"] == rec["final"]
  assert done["history"]["val_loss"] == rec["history"]["val_loss"]
  assert not list((other / "runs").glob("*.npz"))


def test_default_output_is_git_ignored():
  args = lm.parse_args(["--quick"])
  assert args.out is None
  assert harness.default_out("lm") == harness.RUNS_ROOT / "lm"
  assert [c.arm for c in lm.configs(args)] == ["adamw", "stiefel"]
  swept = lm.configs(lm.parse_args(["--arms", "adamw,stiefel",
                                    "--stiefel-learning-rate", "0.01,0.1",
                                    "--max-iters", "500"]))
  assert [(c.arm, c.stiefel_learning_rate, c.lr_decay_iters)
          for c in swept] == [("adamw", 0.3, 500), ("stiefel", 0.01, 500),
                              ("stiefel", 0.1, 500)]


@pytest.mark.slow
@needs_data
def test_accelerator_script_toy(tmp_path):
  """The script end to end at toy size on CPU: the machine record and the
  LM's paired seeds (its speed part runs the functions tests/test_speed.py
  already runs as a child process, so it is skipped here: SPEED=0)."""
  env = dict(os.environ, TOY="1", OUT=str(tmp_path / "acc"), SEEDS="0",
             SPEED="0")
  env.pop("XLA_FLAGS", None)
  root = pathlib.Path(__file__).resolve().parent.parent
  proc = subprocess.run(["bash", str(root / "benchmarks" / "accelerator.sh")],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  acc = tmp_path / "acc"
  assert (acc / "machine.txt").is_file()
  assert (acc / "lm" / "table.md").is_file()
  assert len(list((acc / "lm" / "runs").glob("*.json"))) == 2


def test_other_arms_build_and_keep_their_constraints():
  params = _params("stiefel")
  grads = _random_grads(params, 0)
  sel = lm.frames(Q)
  for arm in ("rsgd", "stiefel_muon"):   # frames stay on the manifold
    tx = lm.make_optimizer(dataclasses.replace(Q, arm=arm))
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(so.max_isometry_error(optax.apply_updates(params, u),
                                       sel)) < 1e-5
  qkn = _params("qk_norm")   # per-head RMSNorm scales, not decayed
  mask = {so.path_str(p): m for p, m in
          jax.tree_util.tree_leaves_with_path(lm.decay_mask(qkn))}
  assert mask["h_0/attn/q_norm/scale"] is False
  assert mask["h_0/attn/k_norm/scale"] is False
  assert len(mask) == len(jax.tree.leaves(_params())) + 2 * Q.n_layer
  with pytest.raises(ValueError, match="arm must be one of"):
    lm.make_optimizer(dataclasses.replace(Q, arm="sgd"))
