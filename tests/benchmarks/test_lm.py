"""The language-model benchmark (benchmarks/lm/): the model is nanoGPT's,
the schedule and weight decay are nanoGPT's, the arms do what they say
(Stiefel Q/K frames stay orthonormal while the v third follows AdamW; Muon
acts on each head's q/k matrix), the study is planned fairly and in order,
`python -m benchmarks.lm --study --quick` runs its whole path, resumes and
is reused on rerun; `TOY=1 bash benchmarks/accelerator.sh` runs."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
import benchmarks.lm.arms
import benchmarks.lm.experiment
import benchmarks.lm.config
import benchmarks.lm.data
import benchmarks.lm.model
import benchmarks.lm.study
import benchmarks.lm.timing
import benchmarks.lm.train
from benchmarks import driver, harness, lm, stats, study as study_lib
from benchmarks.reports import lm as report_lib
from tests.helpers import ROOT

# The quick study's toy model: the unit tests and the study share its
# compiled operations (nanoGPT's initialisation runs op by op).
Q = lm.study.QUICK_STUDY_BASE
# Toy sizes: compiled without LLVM's optimisation (most of the compile time).
jit = functools.partial(jax.jit,
                        compiler_options={"xla_backend_optimization_level": 0})
VOCAB = 65
DATA = lm.data.default_data()
needs_data = pytest.mark.skipif(not DATA.is_file(),
                                reason=f"no corpus at {DATA}")


def test_cpu_config_is_nanogpts_small_model():
  """0.80M parameters without the position embedding (nanoGPT's count),
  head tied to wte (no separate head matrix), no biases."""
  model = lm.model.make_model(lm.config.CPU, VOCAB)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, 64), jnp.int32))["params"]
  paths = {so.path_str(p): x.shape for p, x in
           jax.tree_util.tree_leaves_with_path(shapes)}
  assert sum(math.prod(s) for s in paths.values()) - 64 * 128 == 795904
  assert paths["h_0/attn/c_attn/kernel"] == (128, 384)
  assert not any("bias" in p or "head" in p for p in paths)


@functools.lru_cache(maxsize=None)
def _params(arm="adamw"):
  return lm.model.initial_params(dataclasses.replace(Q, arm=arm), VOCAB, 0)


def test_attention_is_causal():
  apply = jit(lm.model.make_model(Q, VOCAB).apply)
  params = _params()
  x = jnp.arange(Q.block_size)[None] % VOCAB
  k = Q.block_size // 2
  y = x.at[0, k:].set(3)
  a, b = apply({"params": params}, x), apply({"params": params}, y)
  np.testing.assert_allclose(a[0, :k], b[0, :k], atol=1e-6)
  assert not np.allclose(a[0, k:], b[0, k:])


def test_lr_schedule_is_nanogpts_get_lr():
  cfg = lm.config.CPU

  def get_lr(it):   # nanoGPT train.py
    if it < cfg.warmup_iters:
      return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
      return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)

  sched = lm.arms.lr_schedule(cfg, cfg.learning_rate)
  for it in (0, 1, 50, 99, 100, 101, 777, 1999, 2000, 2001, 3000):
    np.testing.assert_allclose(float(sched(it)), get_lr(it), rtol=1e-5)
  np.testing.assert_allclose(float(lm.arms.lr_schedule(cfg, 0.03)(2000)), 0.003,
                             rtol=1e-5)


def test_weight_decay_on_rank_2_parameters_only():
  params = _params()
  mask = {so.path_str(p): m for p, m in
          jax.tree_util.tree_leaves_with_path(lm.arms.decay_mask(params))}
  assert mask["wte/embedding"] and mask["wpe/embedding"]
  assert mask["h_0/attn/c_attn/kernel"] and mask["h_0/c_fc/kernel"]
  assert not mask["h_0/ln_1/scale"] and not mask["ln_f/scale"]


def test_get_batch_is_shifted_and_seeded():
  data = jnp.arange(1000, dtype=jnp.int32)
  x, y = lm.data.get_batch(data, jax.random.PRNGKey(3), 5, 8)
  np.testing.assert_array_equal(y, x + 1)
  x2, _ = lm.data.get_batch(data, jax.random.PRNGKey(3), 5, 8)
  np.testing.assert_array_equal(x, x2)
  assert x.shape == (5, 8) and int(y.max()) < 1000


def _random_grads(params, seed):
  """N(0, 1e-6) per leaf, from NumPy (no jax.random compilation per leaf
  shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(
      1e-3 * rng.standard_normal(x.shape), x.dtype), params)


def _thirds(params, path="h_0/attn/c_attn/kernel"):
  leaves = {so.path_str(p): x for p, x in
            jax.tree_util.tree_leaves_with_path(params)}
  return jnp.split(leaves[path], 3, axis=1)


def test_stiefel_arm_keeps_qk_orthonormal_and_v_on_adamw():
  cfg = dataclasses.replace(Q, arm="stiefel", stiefel_learning_rate=0.1)
  start = _params("stiefel")
  sel = lm.arms.frames(cfg)
  assert float(so.max_isometry_error(start, sel)) < 1e-5
  grads = [_random_grads(start, i) for i in range(3)]
  runs = {}
  for arm in ("stiefel", "orthogonal_init"):   # the same start, then AdamW
    tx = lm.arms.make_optimizer(dataclasses.replace(cfg, arm=arm))
    update, p = jit(tx.update), start
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
  tx = lm.arms.make_optimizer(cfg)
  u, _ = jit(tx.update)(grads, tx.init(params), params)
  hd = cfg.n_embd // cfg.n_head
  ref = optax.contrib.muon(lm.arms.lr_schedule(cfg, cfg.muon_learning_rate),
                           beta=0.95, weight_decay=cfg.weight_decay,
                           consistent_rms=0.2)
  ref_update = jit(ref.update)   # one compile: every head has one shape
  for third in (0, 1):   # q, k
    for h in range(cfg.n_head):
      cols = slice(third * cfg.n_embd + h * hd, third * cfg.n_embd + (h + 1) * hd)
      w = {"w": _thirds(params)[third][:, h * hd:(h + 1) * hd]}
      g = {"w": _thirds(grads)[third][:, h * hd:(h + 1) * hd]}
      want, _ = ref_update(g, ref.init(w), w)
      got = jnp.concatenate(_thirds(u), 1)[:, cols]
      np.testing.assert_allclose(got, want["w"], rtol=1e-4, atol=1e-8)


@needs_data
def test_quick_study_tunes_pairs_reports_and_resumes(tmp_path, capsys):
  """`--study --quick`, the whole study path at toy size: its estimate
  first; tuning on validation with a grid widened past its edge; the
  other arms on adamw's choice; discovery before confirmation seeds; the
  paired tables with Holm and the findings rule; a rerun trains nothing,
  --report-only gives the same bytes, a stopped run resumes to the same
  numbers."""
  out, md = tmp_path / "lm", tmp_path / "RESULTS.md"
  md.write_text("# Benchmark results\n\n## Grokking\n\nother text\n")
  rep = lm.experiment.main(["--study", "--quick", "--out", str(out), "--results-md",
                 str(md)])
  printed = capsys.readouterr().out
  assert printed.startswith("study: 17 runs to do (1 reference, 4 tuning")
  runs = [line.split("] ")[1].split()[:2] for line in printed.splitlines()
          if line.startswith("[")]   # "[N planned left] stage name: ..."
  stages = [st for st, _ in runs]
  assert len(stages) == 18 and stages[0] == "reference"
  for arms in (("adamw", "stiefel"), ("orthogonal_init",)):
    at = lambda stage, arms=arms: [i for i, (st, name) in enumerate(runs)
                                   if st == stage
                                   and name.split("_seed")[0] in arms]
    assert max(at("tune")) < min(at("discovery"))
    assert max(at("discovery")) < min(at("confirmation"))
  assert max(i for i, (st, name) in enumerate(runs) if st != "reference"
             and not name.startswith("orthogonal_init")) < min(
                 i for i, (_, name) in enumerate(runs)
                 if name.startswith("orthogonal_init"))
  s = rep["study"]
  assert s["done"] == s["planned"] == 18 and s["complete"]
  # adamw's 2-point grid: its best is on an edge, so it is widened once
  tune = s["tuning"]["adamw"]
  assert tune["widenings"] == 1 and len(tune["points"]) == 3
  assert all(p["seeds"] == [100] for p in tune["points"])
  assert tune["chosen"] == min(tune["points"], key=lambda p: p["val"])["point"]
  recs = {p.stem: json.loads(p.read_text())
          for p in (out / "runs").glob("*.json")}
  assert len(recs) == 18 and not list((out / "runs").glob("*.npz"))
  stiefel = [r for r in recs.values() if r["arm"] == "stiefel"]
  assert len(stiefel) == 5   # 1 tuning point + 4 paired seeds
  for r in stiefel:   # on adamw's chosen lr and weight decay, orthonormal
    assert r["config"]["learning_rate"] == tune["chosen"]["learning_rate"]
    assert r["config"]["weight_decay"] == tune["chosen"]["weight_decay"]
    assert r["final"]["qk_iso"] < 1e-5
  ortho = s["tuning"]["orthogonal_init"]   # its own AdamW grid
  assert ortho["base"] == {} and ortho["chosen"]["learning_rate"] == 1e-2
  assert all(r["data"] == f"tinyshakespeare:md5={lm.data.CORPUS_MD5}"
             for r in recs.values())
  assert str(tmp_path) not in json.dumps(recs)
  pairs = [("stiefel", "adamw"), ("orthogonal_init", "adamw"),
           ("stiefel", "orthogonal_init")]
  for block, seeds in (("discovery", [0, 1]), ("confirmation", [500, 501])):
    rows = s[block]
    assert [(r["treatment"], r["baseline"]) for r in rows] == pairs
    assert all(r["seeds"] == seeds for r in rows)
    np.testing.assert_allclose([r["p_holm"] for r in rows],
                               stats.holm([r["p"] for r in rows]))
  first = {(r["treatment"], r["baseline"]): r for r in s["discovery"]}
  assert s["findings"] == [
      r for r in s["confirmation"] if r["p_holm"] < 0.05
      and np.sign(r["mean_diff"]) == np.sign(
          first[r["treatment"], r["baseline"]]["mean_diff"])]
  table = rep["table"]
  for text in ("Tuning grid of adamw:", "Confirmation seeds:",
               "| stiefel | adamw | 0-1 |", "| 0.001 | 0.1 | ",
               "nanoGPT reference"):
    assert text in table
  text = md.read_text()
  assert "other text" in text and text.rstrip().endswith(table.rstrip())
  assert report_lib.SECTION in text and str(tmp_path) not in text
  # rerun: nothing trained, the same files; the report regenerates the
  # same bytes from the raw runs
  files = {p.name: p.read_bytes() for p in (out / "runs").iterdir()}
  table_bytes = (out / "table.md").read_bytes()
  lm.experiment.main(["--study", "--quick", "--out", str(out), "--quiet"])
  assert {p.name: p.read_bytes() for p in (out / "runs").iterdir()} == files
  lm.experiment.main(["--study", "--quick", "--report-only", "--out", str(out),
           "--quiet"])
  assert (out / "table.md").read_bytes() == table_bytes
  assert lm.experiment.main(["--study", "--quick", "--dry-run", "--out", str(out),
                  "--quiet"])["estimate"]["total_runs"] == 0
  # stopped after step 20 (saved at 10), then resumed: the same numbers
  rec = next(r for r in stiefel if r["seed"] == 500)
  cfg = lm.config.Config(**rec["config"])
  corpus = lm.data.load_corpus(str(DATA))

  def stop(msg):
    if "step 20" in msg:
      raise KeyboardInterrupt

  other = tmp_path / "other"
  with pytest.raises(KeyboardInterrupt):
    lm.train.train_run(cfg, 500, corpus, other, save_every_s=0, log=stop)
  part = harness.read_json(other / "runs" / f"{rec['name']}.json")
  assert part["final"] is None and part["history"]["step"][-1] == 10
  done = lm.train.train_run(cfg, 500, corpus, other, log=lambda *_: None)
  assert done["final"] == rec["final"]
  assert done["history"]["val_loss"] == rec["history"]["val_loss"]
  assert not list((other / "runs").glob("*.npz"))
  # AdamW at another lr, off the plan, in the study's folder: a plain
  # --report-only keeps the study's report and adds the sensitivity rows
  # (every arm's paired runs against it, per seed block)
  base = next(r for r in recs.values() if r["arm"] == "adamw"
              and r["seed"] == 0 and r["config"]["max_iters"]
              == rec["config"]["max_iters"])["config"]
  alt = lm.config.Config(**{**base, "learning_rate": 3e-3, "min_lr": 3e-4})
  for seed in (0, 1, 500, 501):
    lm.train.train_run(alt, seed, corpus, out, log=lambda *_: None)
  # and stiefel with that AdamW setting for its other weights, seeds 0-1
  moved = lm.config.Config(**{**rec["config"], "learning_rate": 3e-3,
                              "min_lr": 3e-4})
  for seed in (0, 1):
    lm.train.train_run(moved, seed, corpus, out, log=lambda *_: None)
  rep = lm.experiment.main(["--report-only", "--out", str(out), "--quiet"])
  assert "Tuning grid of adamw:" in rep["table"]
  checks = rep["study"]["baseline_checks"]
  assert [c["block"] for c in checks] == ["discovery", "confirmation"]
  setting = f"lr 0.003, wd {base['weight_decay']:g}"
  for c, extra in zip(checks, ([f"stiefel, AdamW at {setting}"], [])):
    assert c["baseline"] == f"adamw {setting}"
    assert [r["treatment"] for r in c["rows"]] == list(s["arms"]) + extra
    np.testing.assert_allclose([r["p_holm"] for r in c["rows"]],
                               stats.holm([r["p"] for r in c["rows"]]))
  assert (f"Against adamw {setting} (floor 0.0003), confirmation seeds:"
          in rep["table"])


def _fake_runs(study, data, loss, arms, done=None):
  """`done` with fake finished tuning runs of `arms` (score loss(cfg)),
  added as the plan asks for them, until it asks for no more."""
  done = dict(done or {})
  while left := [t for t in lm.study.remaining(study, done, data)
                 if t.stage == "tune" and t.arm in arms]:
    for t in left:
      v = loss(lm.study.task_config(study, t))
      done[lm.study.task_name(study, t, data)] = {"final": {"val_loss_full": v,
                                               "train_loss": v}, "wall_s": 1.0}
  return done


def test_tuning_grids_widen_past_their_edges():
  """study: product grids, best point (higher or lower is better), and
  widening until the best is interior, at most max_extensions times."""
  axes = (("lr", (1e-3, 3e-3, 1e-2)), ("wd", (0.1,)))
  assert study_lib.grid_points(axes) == [{"lr": 1e-3, "wd": 0.1},
                                       {"lr": 3e-3, "wd": 0.1},
                                       {"lr": 1e-2, "wd": 0.1}]
  scores = {"lr0.001_wd0.1": 1.0, "lr0.003_wd0.1": 2.0, "lr0.01_wd0.1": 2.0}
  assert study_lib.best_point(axes, scores) == {"lr": 3e-3, "wd": 0.1}
  assert study_lib.best_point(axes, scores, higher_is_better=False)["lr"] == 1e-3
  assert study_lib.extend_axes(axes, {"lr": 1e-2, "wd": 0.1}) == (
      ("lr", (1e-3, 3e-3, 1e-2, 0.0333)), ("wd", (0.1,)))
  assert study_lib.extend_axes(axes, {"lr": 3e-3, "wd": 0.1}) is None
  far = lambda axes: {study_lib.point_key(p): -p["lr"]
                      for p in study_lib.grid_points(axes)}
  t = study_lib.tuned_axes(axes, far, 3, higher_is_better=False)
  assert t.finished and t.widenings == 3 and t.axes[0][1][-1] == 0.37
  assert study_lib.tuned_axes(axes, lambda _: None, 3) == study_lib.Tuning(
      axes, None, False, 0)


def test_study_plan_is_fair_ordered_and_reuses_committed_runs():
  """The study at the CPU config, planned without training: every arm 3
  half-decade points per hyperparameter, 3 tuning seeds outside the
  discovery and confirmation seeds, 500-iteration tuning, adamw and
  stiefel at 8 + 8 seeds and the others at 6 + 6, discovery before
  confirmation (the main arms' pairs before the others' tuning), the
  non-Q/K AdamW at adamw's choice; the committed runs'
  names (their identity) unchanged; and the time estimate."""
  st, data = lm.study.STUDY, lm.study.study_data([])
  for arm in st.arms:
    for _, vals in arm.axes:
      assert len(vals) == 3
      assert all(2.99 < b / a < 3.34 for a, b in zip(vals, vals[1:]))
  assert len(st.tune_seeds) >= 3 and st.tune_iters == 500
  assert not set(st.tune_seeds) & set(harness.DISCOVERY_SEEDS
                                      + harness.CONFIRMATION_SEEDS)
  # nothing run: the reference, then adamw's grid; the rest waits on it
  first = lm.study.plan(st, {}, data)
  assert [t.stage for t in first] == ["reference"] * 4 + ["tune"] * 27
  cfg = lambda t: lm.study.task_config(st, t)
  name = lambda t: lm.study.task_name(st, t, data)
  assert all(cfg(t) == lm.config.CPU for t in first[:4])
  assert [name(t) for t in first[:4]] == [
      f"adamw_seed{s}_85bd1ed3" for s in range(4)]   # the committed runs
  assert "adamw_seed100_a8e4024a" in {name(t) for t in first}
  whole = lm.study.plan(st, {}, data, assume=True)
  count = lambda stage: sum(t.stage == stage for t in whole)
  assert [count(x) for x in lm.study.STAGES] == [4, 135, 46, 46]
  assert all(cfg(t).max_iters == cfg(t).lr_decay_iters == 500
             for t in whole if t.stage == "tune")
  # per group (the main arms together, then each other arm): its tuning,
  # its discovery seeds, its confirmation seeds; the main arms first
  main_arms = tuple(a.name for a in st.arms if a.main)
  assert main_arms == ("adamw", "stiefel")
  groups = [main_arms] + [(a,) for a in st.names if a not in main_arms]
  for arms in groups:
    at = lambda stage, arms=arms: [i for i, t in enumerate(whole)
                                   if t.arm in arms and t.stage == stage]
    assert max(at("tune")) < min(at("discovery"))
    assert max(at("discovery")) < min(at("confirmation"))
  main_end = max(i for i, t in enumerate(whole) if t.arm in main_arms)
  assert all(t.arm not in main_arms for t in whole[main_end + 1:])
  for arm in st.names:
    paired = sorted(t.seed for t in whole
                    if t.arm == arm and t.stage in ("discovery",
                                                    "confirmation"))
    n = 8 if arm in ("adamw", "stiefel") else 6
    assert paired == list(range(n)) + list(range(500, 500 + n))
  # adamw's best lands on the grid's edge twice: widened twice, then
  # interior; stiefel's keeps improving: widened 3 times, then stopped
  ll = lambda x: math.log10(x)
  loss = lambda c: ((ll(c.learning_rate) + 1.7) ** 2
                    + (ll(c.weight_decay) + 1) ** 2
                    - (c.arm == "stiefel") * (c.stiefel_learning_rate
                                              - abs(ll(c.max_step_norm))))
  done = _fake_runs(st, data, loss, ("adamw", "stiefel"))
  runs = lm.study.finished(st, done, data)
  ad, sf = (report_lib.tuning_summary(st, a,
                                      study_lib.tuning_runs(st, runs, a))
            for a in ("adamw", "stiefel"))
  assert ad["widenings"] == 2 and ad["status"] == "finished"
  assert ad["chosen"] == {"learning_rate": 0.0333, "weight_decay": 0.1}
  assert sf["widenings"] == 3 and "edge after 3" in sf["status"]
  # its cap is relative: at lr 37 the ratio 0.0333 puts it nearest 1
  assert sf["chosen"] == {"stiefel_learning_rate": 37.0,
                          "max_step_ratio": 0.0333}
  tuned = [t for t in lm.study.plan(st, done, data) if t.arm == "stiefel"]
  assert all(cfg(t).learning_rate == 0.0333 and cfg(t).min_lr == 0.00333
             for t in tuned)
  assert {t.stage for t in lm.study.remaining(st, done, data)} == {
      "reference", "discovery", "confirmation", "tune"}   # main pairs, then
  # the next arm's tuning
  # with adamw at nanoGPT's (1e-3, 0.1) and stiefel at (0.3, 0.3), the
  # committed runs are the study's
  near = lambda c: (ll(c.learning_rate) + 3) ** 2 + (
      ll(c.weight_decay) + 1) ** 2 + (c.arm == "stiefel") * (
          abs(ll(c.stiefel_learning_rate / 0.3))
          + abs(ll(c.max_step_norm / 0.3)))
  names = {name(t) for t in lm.study.plan(
      st, _fake_runs(st, data, near, ("adamw", "stiefel")), data)}
  committed = {p.stem for p in (lm.study.REFERENCE_DIR / "runs").glob("*.json")}
  assert {"adamw_seed0_85bd1ed3", "stiefel_seed3_7d17bf48",
          "stiefel_seed100_f83e6c5e", "stiefel_seed100_2fa4f422"} <= (
              names & committed)
  # the estimate: at 0.125 s per iteration (a 2,000-iteration run in 250 s)
  rec = dict(config=lm.config.CPU.to_dict(), wall_s=250.0,
             final=dict(step=2000))
  est = lm.timing.estimate(st, {}, data, lm.timing.iteration_rates([rec]))
  assert est["total_runs"] == 231
  assert est["total_seconds"] == 0.125 * (4 * 2000 + 135 * 500 + 92 * 2000)
  assert est["widening_runs"] == 4 * 27 * 3 + 3 * 3 * 3
  assert "231 runs to do" in lm.timing.estimate_text(st, est, 1)
  assert "9.0 h" in lm.timing.estimate_text(st, est, 1)
  # from a probe: one compilation per configuration, not per run
  whole = lm.study.remaining(st, {}, data, assume=True)
  probed = lm.timing.estimate(st, {}, data, {}, probed=(0.1, 10.0))
  assert probed["total_seconds"] == pytest.approx(
      lm.timing.projected_seconds([cfg(t) for t in whole], 0.1, 0.0)
      + 10.0 * len({lm.train.train_config(cfg(t)) for t in whole}))


def test_default_output_is_git_ignored():
  def parse(*argv):
    return driver.parse(lm.experiment.EXPERIMENT, argv)

  args = parse("--quick")
  assert args.out is None
  assert harness.default_out("lm") == harness.RUNS_ROOT / "lm"
  assert [c.arm for c in lm.experiment.configs(args)] == ["adamw", "stiefel"]
  with pytest.raises(SystemExit, match="drop --seeds, --set learning_rate"):
    lm.experiment.check_study_args(parse("--study", "--seeds", "0", "--set",
                                         "learning_rate=0.01"))
  swept = lm.experiment.configs(parse(
      "--arms", "adamw,stiefel", "--set", "stiefel_learning_rate=0.01,0.1",
      "--set", "max_iters=500"))
  assert [(c.arm, c.stiefel_learning_rate, c.lr_decay_iters)
          for c in swept] == [("adamw", 0.3, 500), ("stiefel", 0.01, 500),
                              ("stiefel", 0.1, 500)]


@pytest.mark.slow
@needs_data
def test_accelerator_script_toy(tmp_path):
  """The script end to end at toy size on CPU: the machine record and the
  LM's paired seeds (its speed part runs the functions test_speed.py
  already runs as a child process, so it is skipped here: SPEED=0)."""
  # XLA_FLAGS kept: the suite's compile settings (conftest.py) reach the
  # child as they reach this process (TOY=1 adds the same level-0 flag).
  # PYTHON: the script runs this interpreter, not whichever python is on
  # PATH (the suite may run as /path/to/venv/bin/python -m pytest).
  env = dict(os.environ, TOY="1", OUT=str(tmp_path / "acc"), SEEDS="0",
             SPEED="0", PYTHON=sys.executable)
  proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "accelerator.sh")],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  acc = tmp_path / "acc"
  assert (acc / "machine.txt").is_file()
  assert (acc / "lm" / "table.md").is_file()
  assert len(list((acc / "lm" / "runs").glob("*.json"))) == 2


def test_other_arms_build_and_keep_their_constraints():
  params = _params("stiefel")
  grads = _random_grads(params, 0)
  sel = lm.arms.frames(Q)
  for arm in ("rsgd", "stiefel_muon"):   # frames stay on the manifold
    tx = lm.arms.make_optimizer(dataclasses.replace(Q, arm=arm))
    u, _ = jit(tx.update)(grads, tx.init(params), params)
    assert float(so.max_isometry_error(optax.apply_updates(params, u),
                                       sel)) < 1e-5
  qkn = _params("qk_norm")   # per-head RMSNorm scales, not decayed
  mask = {so.path_str(p): m for p, m in
          jax.tree_util.tree_leaves_with_path(lm.arms.decay_mask(qkn))}
  assert mask["h_0/attn/q_norm/scale"] is False
  assert mask["h_0/attn/k_norm/scale"] is False
  assert len(mask) == len(jax.tree.leaves(_params())) + 2 * Q.n_layer
  with pytest.raises(ValueError, match="arm must be one of"):
    lm.arms.make_optimizer(dataclasses.replace(Q, arm="sgd"))
