"""The learning-rate robustness sweep (issue 30, benchmarks/lm/robustness.py
and benchmarks/reports/robustness.py): `--robustness --quick` runs its
whole path (a finished and a diverged run per arm, the diverged one stopped
and counted at its initial loss), a rerun trains nothing and --report-only
gives the same bytes; the logit records hold their bound on orthonormal
frames; qk_clip rescales the heads above tau; the cap records read the
trust region; the grid extends only while AdamW finishes its top point."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import benchmarks.lm.experiment
from benchmarks import harness, lm, sweep as sweep_lib, training
from benchmarks.lm import robustness
from benchmarks.reports import robustness as report_lib

DATA = lm.data.default_data()


def corpus_args(tmp_path) -> list:
  """--data: the corpus where it is, else a synthetic text of words (so
  that the sweep's path runs on a clean machine without ../shared)."""
  if DATA.is_file():
    return []
  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), n))
           for n in rng.integers(2, 8, 400)]
  text = " ".join(rng.choice(words, 40000)) + "\n"
  path = tmp_path / "synthetic.txt"
  path.write_text(text)
  return ["--data", str(path)]


def test_quick_sweep_runs_diverges_resumes_and_reports(tmp_path, capsys):
  out, md = tmp_path / "rob", tmp_path / "RESULTS.md"
  md.write_text("# Benchmark results\n\n## Grokking\n\nother text\n")
  data = corpus_args(tmp_path)
  rep = lm.experiment.main(["--robustness", "--quick", "--out", str(out),
                     "--results-md", str(md), *data])
  printed = capsys.readouterr().out
  sweep = robustness.QUICK_SWEEP
  recs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
  claims = [r for r in recs if r["seed"] not in sweep.seeds]
  recs = [r for r in recs if r["seed"] in sweep.seeds]
  assert len(recs) == len(sweep.arms) * len(sweep.grid)
  # the claims after the sweep: every arm at its best (0.01) and at the
  # high rate (AdamW's best is its top finishing point: the next, 3), on
  # every discovery and confirmation seed
  assert sorted((r["arm"], r["config"]["learning_rate"], r["seed"])
                for r in claims) == sorted(
      (a, e, s) for a in sweep.arms for e in sweep.grid
      for s in (0, 1, 500, 501))
  order = [line.split("] ")[1].split()[0] for line in printed.splitlines()
           if line.startswith("[")]
  # the sweep (tuning seed 100), then discovery, then confirmation seeds
  stage = lambda n: (lambda s: 0 if s == 100 else 1 if s < 500 else 2)(
      int(n.split("_seed")[1].split("_")[0]))
  assert [stage(n) for n in order] == sorted(stage(n) for n in order)
  assert "#### (a) each arm at its own best" in rep["markdown"]
  assert "#### (b) each arm against AdamW at the high rate" in rep["markdown"]
  assert "Findings: " in rep["markdown"]
  assert not list((out / "runs").glob("*.npz"))
  by = {(r["arm"], r["config"]["learning_rate"]): r for r in recs}
  for arm in sweep.arms:
    ok, bad = by[(arm, sweep.grid[0])], by[(arm, sweep.grid[-1])]
    assert ok.get("stopped") is None and ok["history"]["step"][-1] == 20
    # diverged: stopped at its first evaluation, kept, counted at L0
    assert bad["stopped"]["diverged_at"] == 10 and bad["final"] is not None
    assert bad["history"]["step"] == [0, 10]
    l0 = bad["history"]["val_loss"][0]
    point = rep["curves"][arm][sweep.grid[-1]]
    assert point["losses"] == [l0] and point["diverged"] == [(100, 10)]
    h = ok["history"]
    assert len(h["max_logit"][0]) == sweep.base.n_layer
  # AdamW diverged at the top point: no extension to 30
  assert "Grid of eta: 0.01, 3;" in rep["markdown"]
  # orthonormal frames: every recorded logit within its bound
  st = by[("stiefel", sweep.grid[0])]["history"]
  for logit, bound in zip(st["max_logit"], st["logit_bound"]):
    assert max(logit) <= max(bound) * (1 + 1e-5)
  assert st["cap_binds"][0] is None and 0 <= st["cap_binds"][1] <= 1
  assert st["step_norm"][1] > 0
  assert "diverged at 10" in printed
  text = md.read_text()
  assert "## Grokking\n\nother text" in text
  assert "## Learning-rate robustness (language model)" in text
  assert (out / "robustness.png").is_file()
  assert (out / "robustness_logits.png").is_file()
  # a rerun trains nothing; --report-only gives the same bytes
  before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
  lm.experiment.main(["--robustness", "--quick", "--out", str(out), "--quiet",
               *data])
  lm.experiment.main(["--robustness", "--quick", "--report-only", "--out",
               str(out), "--quiet", "--results-md", str(md)])
  after = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
  assert after == before
  assert md.read_text() == text   # the section rewritten whole, once
  with pytest.raises(SystemExit, match="--robustness fixes"):
    lm.experiment.main(["--robustness", "--quick", "--seeds", "5"])


def test_a_sweep_of_another_width_is_its_own_runs():
  """--robustness with --arms (the reference first) and --set (the base
  configuration): the same sweep at another width, under other run names;
  its seeds stay fixed."""
  from benchmarks import driver
  parse = lambda *a: driver.parse(lm.experiment.EXPERIMENT, ["--robustness",
                                                             *a])
  wide = sweep_lib.configure(robustness.SWEEP_EXPERIMENT, parse(
      "--arms", "adamw,stiefel,stiefel_muon,qk_norm", "--set", "n_embd=256",
      "--set", "n_head=8"))
  assert wide.arms == ("adamw", "stiefel", "stiefel_muon", "qk_norm")
  assert (wide.base.n_embd, wide.base.n_head) == (256, 8)   # head_dim 32
  assert wide.seeds == robustness.SWEEP.seeds
  assert wide.base.max_iters == robustness.SWEEP.base.max_iters
  task = ("stiefel", 1e-3, 100)
  assert robustness.sweep_config(wide, *task[:2]).n_embd == 256
  assert (robustness.task_name(wide, task, "d")
          != robustness.task_name(robustness.SWEEP, task, "d"))
  for bad in (["--arms", "stiefel,adamw"], ["--set", "width=3"]):
    with pytest.raises(SystemExit, match="reference adamw|not a setting"):
      sweep_lib.configure(robustness.SWEEP_EXPERIMENT, parse(*bad))


def test_grid_extends_while_adamw_finishes_its_top_point():
  sweep = robustness.SWEEP
  data = "d"
  name = lambda eta, seed: robustness.task_name(sweep, ("adamw", eta, seed),
                                                data)
  fin = dict(final={"val_loss_full": 2.0})
  assert robustness.grid(sweep, {}, data) == sweep.grid
  done = {name(1.0, 101): fin}          # finished on one seed: extend
  assert robustness.grid(sweep, done, data) == sweep.grid + (3.0,)
  done[name(3.0, 100)] = dict(fin, stopped={"diverged_at": 250})
  assert robustness.grid(sweep, done, data) == sweep.grid + (3.0,)
  done[name(3.0, 102)] = fin
  assert robustness.grid(sweep, done, data) == sweep.grid + (3.0, 10.0)
  # seed-major, AdamW's points first within a seed
  tasks = sweep_lib.tasks(sweep, {}, robustness.names(sweep, data))
  assert len(tasks) == 6 * 9 * 3
  assert [t[2] for t in tasks] == sorted(t[2] for t in tasks)
  assert tasks[:9] == [("adamw", e, 100) for e in sweep.grid]
  c = robustness.sweep_config(sweep, "rsgd", 3e-4)
  assert (c.rsgd_learning_rate, c.min_lr, c.weight_decay,
          c.max_iters) == (0.3, 3e-5, 0.03, 2000)


def test_divergence_rule():
  h = dict(step=[0, 250], train_loss=[4.2, 2.0], val_loss=[4.19, 4.3])
  assert lm.train.diverged(h)["diverged_at"] == 250
  h["val_loss"][1] = None
  assert "non-finite" in lm.train.diverged(h)["reason"]
  h["val_loss"][1] = 2.1
  assert lm.train.diverged(h) is None
  assert harness.json_value(jnp.array([1.0, jnp.nan])) == [1.0, None]


def test_training_stops_where_record_says_and_keeps_the_run(tmp_path):
  """`training.train_run`: a record that returns a reason stops the run
  there; the stopped run is finished and returned as it is later."""
  import optax
  from benchmarks import harness
  tx = optax.sgd(0.25)
  step = jax.jit(training.train_chunk(lambda p: jnp.sum((p - 1.0) ** 2), tx,
                                      lambda _: (), length=2))

  def start():
    p = jnp.zeros(2)
    return dict(identity="v1", wall_s=0.0, history=dict(step=[])), (
        p, tx.init(p))

  def record(run, carry, it, out, wall_s):
    run["history"]["step"].append(it)
    return {"diverged_at": it} if it == 4 else None

  calls = []
  kw = dict(start=start, record=record, every=2, stop=10,
            finish=lambda run, carry: {"p": float(carry[0][0])},
            chunk=lambda c, it: (calls.append(it), step(c, None)[:2])[1])
  store = harness.RunStore(tmp_path)
  run = training.train_run(store, "toy", "v1", **kw)
  assert run["history"]["step"] == [0, 2, 4] and run["stopped"] == {
      "diverged_at": 4} and run["final"] is not None
  again = training.train_run(store, "toy", "v1", **kw)
  assert again == run and calls == [0, 2]


def test_qk_clip_rescales_only_heads_above_tau():
  cfg = dataclasses.replace(robustness.QUICK_SWEEP.base, arm="qk_clip",
                            n_head=2)
  params = lm.model.initial_params(cfg, 65, 0)
  tx = lm.arms.qk_clip(cfg.n_head, tau=1.0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  u, _ = tx.update(zeros, tx.init(params), params,
                   max_logit=jnp.array([[4.0, 0.5]]))
  w = params["h_0"]["attn"]["c_attn"]["kernel"]
  new = w + u["h_0"]["attn"]["c_attn"]["kernel"]
  d, hd = w.shape[0], w.shape[0] // 2
  np.testing.assert_allclose(new[:, :hd], 0.5 * w[:, :hd], rtol=1e-6)
  np.testing.assert_allclose(new[:, d:d + hd], 0.5 * w[:, d:d + hd],
                             rtol=1e-6)
  np.testing.assert_array_equal(new[:, hd:d], w[:, hd:d])
  np.testing.assert_array_equal(new[:, 2 * d:], w[:, 2 * d:])
  assert all(float(jnp.abs(x).max()) == 0 for p, x in
             jax.tree_util.tree_leaves_with_path(u)
             if "c_attn" not in jax.tree_util.keystr(p))
  with pytest.raises(ValueError, match="max_logit"):
    tx.update(zeros, tx.init(params), params)


def test_report_sensitivity_and_range():
  rec = lambda loss, stopped=None: dict(
      final=dict(val_loss_full=loss), stopped=stopped,
      history=dict(val_loss=[4.0]))
  rows = [dict(arm="a", eta=e, seed=s, record=rec(l + 0.01 * s))
          for s in (0, 1) for e, l in ((1e-3, 2.04), (3e-3, 2.0),
                                       (1e-2, 2.03), (3e-2, 2.2))]
  rows.append(dict(arm="a", eta=0.1, seed=0,
                   record=rec(None, {"diverged_at": 250})))
  s = report_lib.summary(report_lib.curves(rows, "val_loss_full")["a"])
  assert s["best_eta"] == 3e-3 and s["range"] == (1e-3, 1e-2)
  assert s["diverged"] == 1 and s["runs"] == 9
  means = [2.045, 2.005, 2.035, 2.205, 4.0]
  assert s["sensitivity"] == pytest.approx(np.mean(means) - 2.005)


def test_cifar_quick_sweep_diverges_resumes_and_reports(tmp_path, capsys):
  """The CIFAR sweep (benchmarks/cifar_patches/robustness.py) on its toy
  path: every arm finishes at 0.01 and diverges at 30 (stopped there,
  counted at L0), so the grid does not extend; the Stiefel run records its
  cap; a rerun trains nothing; --report-only gives the same bytes."""
  from benchmarks.cifar_patches import experiment as cifar_cli
  from benchmarks.cifar_patches import robustness as cifar_rob
  out, md = tmp_path / "rob", tmp_path / "RESULTS.md"
  md.write_text("# Benchmark results\n\n## Grokking\n\nother text\n")
  rep = cifar_cli.main(["--robustness", "--quick", "--out", str(out),
                        "--results-md", str(md)])
  sweep = cifar_rob.QUICK_SWEEP
  recs = {(r["arm"], r["eta"]): r for r in
          (json.loads(p.read_text()) for p in (out / "runs").glob("*.json"))}
  assert sorted(recs) == sorted((a, e) for a in sweep.arms
                                for e in sweep.grid)
  for arm in sweep.arms:
    ok, bad = recs[arm, 1e-2], recs[arm, 30.0]
    assert "stopped" not in ok and ok["final"]["val_loss"] < (
        ok["history"]["val_loss"][0])
    assert bad["stopped"]["diverged_at"] == bad["history"]["step"][1]
    l0 = bad["history"]["val_loss"][0]
    assert rep["curves"][arm][30.0]["losses"] == [l0]
  binds = recs["stiefel", 1e-2]["history"]["cap_binds"]
  assert binds[0] is None and all(0 <= b <= 1 for b in binds[1:])
  assert all(b is None for b in recs["adamw", 1e-2]["history"]["cap_binds"])
  text = md.read_text()
  assert "## Learning-rate robustness (CIFAR)" in text and "other text" in text
  report = (out / "robustness.md").read_bytes()
  capsys.readouterr()
  cifar_cli.main(["--robustness", "--quick", "--out", str(out)])
  assert "planned left]" not in capsys.readouterr().out   # nothing trained
  cifar_cli.main(["--robustness", "--quick", "--report-only", "--out",
                  str(out)])
  assert (out / "robustness.md").read_bytes() == report
  with pytest.raises(SystemExit, match="--robustness fixes"):
    cifar_cli.main(["--robustness", "--quick", "--seeds", "5"])


def test_a_worker_done_with_its_share_takes_the_others_unstarted_runs(
    tmp_path):
  """sweep.run with --worker: its own share first, then the other worker's
  runs last first, skipping the one that worker is training (its claim),
  never a run twice; its claims are gone when it stops."""
  from benchmarks import harness, sweep as sweep_lib
  s = sweep_lib.Sweep(arms=("adamw", "stiefel"), grid=(1e-3, 1e-2, 0.1),
                      extension=(), ratios={}, seeds=(100, 101))
  name = lambda t: f"{t[0]}_{t[1]:g}_{t[2]}"
  store, trained = harness.RunStore(tmp_path), []

  def execute(task):
    assert sweep_lib.Claims(store.dir, "x").path(name(task)).read_text() \
        == "0/2"
    cfg = {"arm": task[0], "eta": task[1], "seed": task[2]}
    rec = dict(name=name(task), config=cfg, data="d", final={"loss": 1.0},
               identity=harness.run_identity(cfg, "d"))
    store.save(name(task), rec)
    trained.append(task)
    return rec

  planned = sweep_lib.tasks(s, {}, name)
  mine = sweep_lib.worker_share("0/2")
  theirs = [t for t in planned if not mine(name(t))]
  assert theirs and len(theirs) < len(planned)
  busy = theirs[0]                      # being trained by worker 1/2
  sweep_lib.Claims(store.dir, "1/2").take(name(busy))
  n = sweep_lib.run(s, tmp_path, name, execute, describe=lambda t, r: "",
                    expected_s=lambda t: None, desc="x", worker="0/2",
                    log=lambda *a: None)
  own = [t for t in planned if mine(name(t))]
  assert trained == own + [t for t in reversed(theirs) if t != busy]
  assert n == len(planned) - 1
  assert {p.name for p in store.dir.glob("*.claim")} == {
      f"{name(busy)}.claim"}


def test_dry_run_counts_every_planned_run_not_only_those_startable_now(
    tmp_path):
  """sweep.run's --dry-run counts total(done), every run still planned,
  where plan(done) offers only those that may start now (a stage); without
  total it counts plan's."""
  from benchmarks import sweep as sweep_lib
  s = sweep_lib.Sweep(arms=("adamw",), grid=(1e-3, 1e-2, 0.1), extension=(),
                      ratios={}, seeds=(100, 101))
  name = lambda t: f"{t[0]}_{t[1]:g}_{t[2]}"
  every = sweep_lib.tasks(s, {}, name)
  logged = []

  def dry(**kwargs):
    sweep_lib.run(s, tmp_path, name, lambda t: {}, describe=None,
                  expected_s=lambda t: None, desc="x", dry_run=True,
                  log=logged.append, plan=lambda done: every[:2], **kwargs)
    return logged.pop().split(" runs planned left")[0]

  assert dry(total=lambda done: every) == str(len(every)) == "6"
  assert dry() == "2"


@pytest.mark.parametrize("bench", ["lm", "cifar_patches"])
@pytest.mark.parametrize("bump", [False, True])
def test_committed_sweep_reports_regenerate_without_the_data(bench, bump,
                                                              tmp_path,
                                                              monkeypatch):
  """The committed robustness reports come back byte for byte from their
  raw runs with --report-only, with no data at hand (the runs' recorded
  data id is read), and after a numerics version bump (bump: a CIFAR
  sweep run's name holds its identity, which the bump changes)."""
  from benchmarks.cifar_patches import experiment as cifar_cli
  folder = {"lm": "lm_robustness", "cifar_patches": "cifar_robustness"}[bench]
  if bump:
    monkeypatch.setattr(harness, "numerics_version", lambda: "99.0.0")
  main = {"lm": lm.experiment.main, "cifar_patches": cifar_cli.main}[bench]
  assert_report_regenerates(
      folder, tmp_path, lambda out: main(
          ["--robustness", "--report-only", "--out", str(out), "--data",
           str(tmp_path / "absent")] + (["--quiet"] if bench == "lm" else [])))


def assert_report_regenerates(folder: str, tmp_path, regenerate):
  """regenerate(out) on a copy (out) of benchmarks/results/<folder>, its
  runs without their checkpoints and claims (and without the width
  folders inside it), gives every robustness* file back byte for byte."""
  import shutil
  src, out = harness.REFERENCE_ROOT / folder, tmp_path / "out"
  shutil.copytree(src, out, ignore=shutil.ignore_patterns(
      "*.npz", "*.claim", "d128", "d256"))
  regenerate(out)
  files = sorted(src.glob("robustness*"))
  assert files
  for f in files:
    assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_width_sweeps_as_the_width_plan_fixes_them():
  """--sweep width64/width128/width256 (benchmarks/results/lm/width_plan.md):
  d 64 is the committed sweep with only the width changed, its runs named
  as `--arms ... --set n_embd=64 --set n_head=2` names them; d 128 is the
  committed sweep's runs on the four arms, every one of them committed (so
  nothing is left to run); d 256 the trimmed grid, two seeds, the downward
  point and the claims."""
  from benchmarks import driver
  parse = lambda *a: driver.parse(lm.experiment.EXPERIMENT, ["--robustness",
                                                             *a])
  arms = ("adamw", "stiefel", "stiefel_muon", "qk_norm")
  data = "tinyshakespeare:md5=6fb458f1232090904fb40fe944165e91"
  by_set = sweep_lib.configure(robustness.SWEEP_EXPERIMENT, parse(
      "--arms", ",".join(arms), "--set", "n_embd=64", "--set", "n_head=2"))
  w64 = sweep_lib.configure(robustness.SWEEP_EXPERIMENT,
                            parse("--sweep", "width64"))
  assert (w64.arms, w64.grid, w64.extension, w64.seeds, w64.claims) == (
      arms, robustness.SWEEP.grid, (3.0, 10.0), (100, 101, 102), ())
  planned = sweep_lib.tasks(w64, {}, robustness.names(w64, data))
  assert len(planned) == 4 * 9 * 3
  assert [robustness.task_name(w64, t, data) for t in planned] == [
      robustness.task_name(by_set, t, data) for t in planned]
  # d 128: the committed runs, read from their folder
  w128 = robustness.SWEEPS["width128"]
  assert w128.base == robustness.SWEEP.base and w128.arms == arms
  done = harness.finished_runs(sweep_lib.reused(w128), current_version=True)
  name = robustness.names(w128, data)
  full = robustness.names(robustness.SWEEP, data)
  planned = sweep_lib.tasks(w128, done, name)
  assert len(planned) == 108 and all(
      name(t) == full(t) and name(t) in done for t in planned)
  assert robustness.remaining(w128, done, data) == []
  # d 256
  w256 = robustness.SWEEPS["width256"]
  assert (w256.base.n_embd, w256.base.n_head, w256.seeds, w256.below) == (
      256, 8, (100, 101), (3e-4,))
  assert w256.grid == (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
  assert w256.extension == (3.0, 10.0)
  assert w256.claim_seeds == {"discovery": (0, 1, 2, 3),
                              "confirmation": (500, 501, 502, 503, 504)}
  with pytest.raises(SystemExit, match="--sweep: one of"):
    sweep_lib.configure(robustness.SWEEP_EXPERIMENT,
                        parse("--sweep", "width512"))
  with pytest.raises(SystemExit, match="give one of them"):
    sweep_lib.configure(robustness.SWEEP_EXPERIMENT,
                        parse("--quick", "--sweep", "width64"))


def test_width256_opens_its_downward_point_once_and_orders_its_claims():
  """The d 256 downward rule on a synthetic `done`: 3e-4 is added for every
  arm on both seeds once every run of the grid is in and some arm's best
  mean is at 1e-3, never a second point; then the claims: per stage (b),
  (a), then the d 64 terms of (c), and no confirmation seed before the d 64
  sweep is complete."""
  w256, data = robustness.SWEEPS["width256"], "d"
  name = robustness.names(w256, data)
  cfg = {"n_embd": 256}
  rec = lambda loss, stopped=None: dict(
      final={"val_loss_full": loss}, stopped=stopped, config=cfg, data=data,
      numerics_version=harness.numerics_version(),
      identity=harness.run_identity(cfg, data), history={"val_loss": [4.2]})
  # AdamW diverges at 1 (no extension); every curve bottoms out at 3e-3
  loss = lambda arm, eta: 4.3 if eta == 1.0 else 2.0 + abs(
      np.log10(eta / 3e-3))
  done = {name(t): rec(loss(t[0], t[1]), {"diverged_at": 250}
                       if t[1] == 1.0 else None)
          for t in sweep_lib.tasks(w256, {}, name)}
  assert robustness.grid(w256, done, data) == w256.grid
  low = ("stiefel_muon", 1e-3, 101)
  del done[name(low)]
  assert robustness.grid(w256, done, data) == w256.grid
  done[name(low)] = rec(1.0)        # its best (mean of two seeds) at 1e-3
  assert robustness.grid(w256, done, data) == (3e-4,) + w256.grid
  left = robustness.remaining(w256, done, data)
  assert left == [(a, 3e-4, s) for s in (100, 101)
                  for a in w256.arms]
  for t in left:                    # best at 3e-4 too: no second point
    done[name(t)] = rec(0.5)
  assert robustness.grid(w256, done, data) == (3e-4,) + w256.grid
  plan = robustness.claim_plan(w256, done, data)
  assert plan["trend"] is None      # the d 64 sweep not run here
  claims = robustness.remaining(w256, done, data)
  assert {t[2] for t in claims} == {0, 1, 2, 3}   # no confirmation seed
  assert claims[:4] == [(a, plan["high"], 0) for a in w256.arms]
  plan["trend"] = 0.03
  tasks = robustness.claim_tasks(w256, plan)
  stage = [0 if t[2] < 500 else 1 for t in tasks]
  assert stage == sorted(stage)
  d64 = [t for t in tasks if len(t) > 3]
  assert d64 and all(t[1] == 0.03 and t[3] == "width64" for t in d64)
  assert len(d64) == 4 * 9
  first = tasks.index(d64[0])
  assert all(t[2] < 500 for t in tasks[:first]) and tasks[first - 1][2] < 500
  assert (robustness.task_name(w256, d64[0], data) == robustness.task_name(
      robustness.SWEEPS["width64"], d64[0][:3], data))


def test_width_report_on_two_toy_widths_with_a_width_missing(tmp_path):
  """The cross-width report (benchmarks/reports/width.py) on two toy widths
  of synthetic finished runs and a third without any: the common rates are
  those both widths measured, the missing width is named and tabulated as
  missing, and the bytes (markdown and the three figures) come back the
  same on a second run."""
  data = "tinyshakespeare:md5=" + lm.study.CORPUS_MD5
  base = robustness.QUICK_SWEEP
  widths = {}
  for d, grid in ((8, (1e-2, 0.1, 1.0)), (16, (1e-3, 1e-2, 0.1)),
                  (32, (1e-2, 0.1))):
    sweep = dataclasses.replace(
        base, arms=("adamw", "stiefel"), grid=grid, extension=(),
        claims=(), base=dataclasses.replace(base.base, n_embd=d))
    folder = tmp_path / f"d{d}"
    widths[d] = (sweep, folder)
    if d == 32:
      continue                      # a width without runs
    store = harness.RunStore(folder)
    for arm, eta, seed in sweep_lib.tasks(sweep, {}, robustness.names(
        sweep, data)):
      cfg = robustness.sweep_config(sweep, arm, eta)
      loss = 2.0 + abs(np.log10(eta / 1e-2)) * (0.5 if arm == "stiefel"
                                                 else 1.0) + d / 100
      rec = dict(name=lm.config.run_name(cfg, seed, data),
                 config=dataclasses.asdict(cfg), data=data,
                 numerics_version=harness.numerics_version(),
                 final={"val_loss_full": loss},
                 history={"val_loss": [4.0], "step": [0]})
      rec["identity"] = harness.run_identity(rec["config"], data)
      store.save(rec["name"], rec)
  out = tmp_path / "width"
  rep = robustness.width_report(out, widths)
  text = rep["markdown"]
  assert "common to every width with runs, for every arm: 0.01, 0.1." in text
  assert "without any: d 32" in text
  assert "Missing (no run): adamw at d 32, stiefel at d 32." in text
  tab = rep["table"]
  assert tab["adamw"][32] is None and tab["stiefel"][8]["best_eta"] == 1e-2
  assert tab["adamw"][8]["common"] == pytest.approx(0.5)   # (0 + 1) / 2
  files = {p.name: p.read_bytes() for p in out.iterdir()}
  assert set(files) == {"width.md", "width_sensitivity.png",
                        "width_best_eta.png", "width_transfer.png"}
  robustness.width_report(out, widths)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == files


def test_width_report_with_a_width_still_running(tmp_path):
  """A width with runs left, one arm not yet run there: no crash, the arm
  named missing there, and its partial grid does not narrow the common
  rates (the complete widths' rates stand)."""
  from benchmarks.reports import width as width_lib
  pt = lambda m: dict(mean=m, losses=[m], seeds=[0], diverged=[])
  cs = {8: {"a": {1e-2: pt(2.0), 0.1: pt(3.0)},
            "b": {1e-2: pt(2.5), 0.1: pt(2.6)}},
        16: {"a": {0.1: pt(2.2)}}}
  rep = width_lib.report(tmp_path, cs, ["a", "b"], [8, 16], heading="## W",
                         plan="plan.md", left={8: 0, 16: 3})
  assert "for every arm: 0.01, 0.1. A width with sweep runs left" in (
      rep["markdown"])
  assert rep["table"]["b"][16] is None
  assert rep["table"]["a"][16]["common"] is None
  assert rep["table"]["a"][8]["common"] == pytest.approx(0.5)
  assert "Missing (no run): b at d 16." in rep["markdown"]


def test_trend_table_is_each_widths_gap_to_adamw_paired_by_seed():
  """The width plan's (c): per seed T = D(d 256) - D(d 64), D = the arm's
  capped loss - adamw's at that width's own high rate; the table's mean is
  T's, its wins the seeds with T < 0, its bootstrap interval holds the
  mean and regenerates the same; rows of the other rate are not read; and
  before the smaller width's rate is fixed the table says so."""
  rec = lambda loss: dict(final={"val_loss_full": loss}, stopped=None,
                          history={"val_loss": [9.0]})
  seeds = (0, 1, 2, 3)
  # at d 256 (eta 0.1) stiefel is 1.0 + s / 10 below adamw; at d 64
  # (eta 0.3) 0.5 below: T = -0.5 - s / 10
  big = [dict(arm=a, eta=0.1, seed=s, record=rec(
      3.0 if a == "adamw" else 2.0 - s / 10)) for s in seeds
         for a in ("adamw", "stiefel")]
  big += [dict(arm="stiefel", eta=0.01, seed=s, record=rec(0.0))
          for s in seeds]                  # another rate: not read
  small = [dict(arm=a, eta=0.3, seed=s, record=rec(
      2.5 if a == "adamw" else 2.0)) for s in seeds
           for a in ("adamw", "stiefel")]
  plan = dict(best={"adamw": 0.01, "stiefel": 0.01}, high=0.1, trend=0.3)
  [row] = report_lib.trend_rows(big, small, plan, ["adamw", "stiefel"],
                                "val_loss_full", bootstrap=True)
  assert row["mean_diff"] == pytest.approx(-0.65)
  assert row["mean_treatment"] == pytest.approx(-1.15)   # D at d 256
  assert row["mean_baseline"] == pytest.approx(-0.5)     # D at d 64
  assert row["wins"] == 4 and row["seeds"] == list(seeds)
  assert row["boot_low"] < -0.65 < row["boot_high"] <= -0.5
  claims = {"plan": plan, "discovery": big, "confirmation": [],
            "trend": {"discovery": small, "confirmation": []}}
  lines = report_lib.claim_lines(claims, ["adamw", "stiefel"],
                                 "val_loss_full", "loss", bootstrap=True)
  text = "\n".join(lines)
  assert "#### (c) the trend with width" in text
  assert "| stiefel | 0-3 | -0.5000 | -1.1500 | -0.6500 [" in text
  # (b) and (c) on discovery seeds; (a) has no adamw run at 0.01, no row
  assert text.count("bootstrap 95% CI") == 2
  assert text == "\n".join(report_lib.claim_lines(
      claims, ["adamw", "stiefel"], "val_loss_full", "loss", bootstrap=True))
  plan["trend"] = None
  text = "\n".join(report_lib.claim_lines(claims, ["adamw", "stiefel"],
                                          "val_loss_full", "loss"))
  assert "its high rate, and so this table, is not fixed yet" in text
  assert "bootstrap" not in text


@pytest.mark.parametrize("sweep,folder", [
    ("width64", "lm_width/d64"), ("width256", "lm_width/d256"),
    ("bound_pilot", "lm_bound"), ("bound128", "lm_bound/d128"),
    ("bound256", "lm_bound/d256")])
def test_committed_width_and_bound_sweep_reports_regenerate(sweep, folder,
                                                            tmp_path):
  """Each committed per-width and bound sweep report comes back byte for
  byte from its folder's finished runs with --report-only."""
  assert_report_regenerates(folder, tmp_path, lambda out: lm.experiment.main(
      ["--robustness", "--sweep", sweep, "--report-only", "--out", str(out),
       "--quiet"]))


@pytest.mark.parametrize("study", ["lm_width", "lm_bound"])
def test_committed_width_report_regenerates(study, tmp_path):
  """The committed cross-width reports (benchmarks/results/lm_width, and
  the bound study's in lm_bound) come back byte for byte from the
  committed runs of every width."""
  src = harness.REFERENCE_ROOT / study
  robustness.width_report(tmp_path, study={
      s.home: s for s in robustness.STUDIES.values()}[study])
  files = sorted(src.glob("width*"))
  assert files
  for f in files:
    assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_worker_waits_for_the_others_runs_that_may_plan_more(
    tmp_path, monkeypatch):
  """While every planned run left is another worker's live claim, a worker
  waits instead of stopping: once that run is saved the plan may grow (the
  downward point, the claims), and the waiting worker trains what it
  opens. A claim older than twice its run's expected time (its worker
  killed) is not waited for."""
  from benchmarks import harness, sweep as sweep_lib
  s = sweep_lib.Sweep(arms=("adamw",), grid=(1e-3,), extension=(),
                      ratios={}, seeds=(100,))
  name = lambda t: f"{t[0]}_{t[1]:g}_{t[2]}"
  store, trained, waits = harness.RunStore(tmp_path), [], []
  busy, opened = ("adamw", 1e-3, 100), ("adamw", 3e-4, 100)
  rec = lambda t: dict(name=name(t), final={"loss": 1.0}, data="d",
                       numerics_version=harness.numerics_version(),
                       config={"t": list(t)},
                       identity=harness.run_identity({"t": list(t)}, "d"))
  other = sweep_lib.Claims(store.dir, "1/2")

  def sleep(seconds):                 # the other worker, meanwhile
    waits.append(seconds)
    if len(waits) == 2:               # saves its run
      store.save(name(busy), rec(busy))
      other.release(name(busy))

  monkeypatch.setattr(sweep_lib.time, "sleep", sleep)
  plan = lambda done: [t for t in ([busy, opened] if name(busy) in done
                                   else [busy]) if name(t) not in done]

  def execute(task):
    store.save(name(task), rec(task))
    trained.append(task)
    return rec(task)

  run = lambda: sweep_lib.run(
      s, tmp_path, name, execute, describe=lambda t, r: "",
      expected_s=lambda t: 60.0, desc="x", worker="0/2", plan=plan,
      log=lambda *a: None, poll_s=5.0)
  other.take(name(busy))
  assert (run(), trained, waits) == (1, [opened], [5.0, 5.0])
  # a stale claim (older than 2 x 60 s) ends the wait at once
  store.dir.joinpath(f"{name(busy)}.json").unlink()
  store.dir.joinpath(f"{name(opened)}.json").unlink()
  trained.clear(), waits.clear()
  other.take(name(busy))
  os.utime(other.path(name(busy)), (0, 0))
  waits.extend([0, 0])                # never saved now
  assert (run(), trained, waits) == (0, [], [0, 0])


def test_bound_study_sweeps_plan_only_the_new_box_runs():
  """The bound study's sweeps (benchmarks/results/lm_bound/study_plan.md):
  the width sweeps with `stiefel_box` added at stiefel's ratio and cap;
  every committed run of the four width arms (and at d 128 the pilot's box
  runs) read, so what is left is exactly the plan's new box runs: 17 at
  d 128 (9 points x 3 seeds less the pilot's 10), 14 on the d 256 grid."""
  data = "tinyshakespeare:md5=6fb458f1232090904fb40fe944165e91"
  for d, new, grid in ((128, 17, robustness.SWEEP.grid),
                       (256, 14, robustness.SWEEPS["width256"].grid)):
    s = robustness.SWEEPS[f"bound{d}"]
    assert s.arms == robustness.WIDTH_ARMS + ("stiefel_box",)
    assert (s.base.n_embd, s.grid) == (d, grid)
    assert s.plan == robustness.BOUND_STUDY_PLAN
    box = robustness.sweep_config(s, "stiefel_box", 1e-2)
    ref = robustness.sweep_config(s, "stiefel", 1e-2)
    assert (box.stiefel_learning_rate, box.max_step_norm) == (
        ref.stiefel_learning_rate, ref.max_step_norm)
    done = harness.finished_runs(sweep_lib.reused(s), current_version=True)
    left = robustness.remaining(s, done, data)
    assert len(left) == new and {t[0] for t in left} == {"stiefel_box"}


def test_bound256_claims_plan_the_box_rows_and_reuse_the_width_claims():
  """The bound study's claims at d 256 on the committed runs and a synthetic
  box sweep (best at 3e-3): the rates are the plan's (10x = 1e-2, 30x =
  3e-2, 100x = 0.1); on the discovery seeds only the runs the width study
  did not make are planned (the box at 3e-3, 1e-2 and 3e-2, qk_norm and
  stiefel at 3e-2), every discovery run before any confirmation run, and
  table (d) (0.1) after both blocks of (a) and (b); the workers start a
  stage only once the one before has finished (`startable`)."""
  s, data = robustness.SWEEPS["bound256"], (
      "tinyshakespeare:md5=6fb458f1232090904fb40fe944165e91")
  name = robustness.names(s, data)
  done = harness.finished_runs(sweep_lib.reused(s), current_version=True)
  cfg = {"n_embd": 256}
  rec = lambda loss: dict(
      final={"val_loss_full": loss}, stopped=None, config=cfg, data=data,
      numerics_version=harness.numerics_version(),
      identity=harness.run_identity(cfg, data), history={"val_loss": [4.2]})
  box = [t for t in sweep_lib.tasks(s, done, name) if t[0] == "stiefel_box"]
  for t in box + [("stiefel_box", 3e-4, sd) for sd in (100, 101)]:
    done[name(t)] = rec(1.5 + abs(np.log10(t[1] / 3e-3)))
  assert robustness.grid(s, done, data) == (3e-4,) + s.grid
  plan = robustness.claim_plan(s, done, data)
  assert plan["best"]["stiefel_box"] == 3e-3 and plan["high"] == 1e-2
  rate = lambda r: report_lib.rate_eta(plan, "stiefel_box", r)
  assert (rate("high+1"), rate("high+2")) == (3e-2, 0.1)
  left = robustness.remaining(s, done, data)
  first = [t for t in left[:-18] if t[2] == 0]
  assert sorted(first) == sorted(
      [("stiefel_box", e, 0) for e in (3e-3, 1e-2, 3e-2)]
      + [(a, 3e-2, 0) for a in ("stiefel", "qk_norm")])
  stage = [t[2] >= 500 for t in left]
  last = [t[1] == 0.1 for t in left]
  assert last.index(True) == len(left) - 18 and all(last[-18:])
  assert stage[:-18] == sorted(stage[:-18]) and not any(stage[:16])
  assert len(left) == 5 * 9 + 2 * 9
  # The workers' plan: one stage at a time, the next only once every run
  # of the one before has finished (not merely started by another worker).
  discovery = [t for t in left[:-18] if t[2] < 500]
  assert robustness.startable(s, done, data) == discovery
  for t in discovery[:-1]:
    done[name(t)] = rec(1.7)
  assert robustness.startable(s, done, data) == discovery[-1:]
  done[name(discovery[-1])] = rec(1.7)
  assert robustness.startable(s, done, data) == left[len(discovery):-18]
  assert robustness.remaining(s, done, data) == left[len(discovery):]
  # (d), marked last, waits for the d 128 sweep (`last_after`): no run of
  # it is startable while that sweep is incomplete (here: read from a
  # folder that has none of its new box runs), and it is once that sweep
  # is complete (here a committed complete sweep stands in for it).
  for t in left[len(discovery):-18]:
    done[name(t)] = rec(1.7)
  assert s.last_after == ("bound128", "lm_bound/d128")
  waiting = dataclasses.replace(s, last_after=("bound128", "lm_bound/none"))
  assert not robustness.complete(*waiting.last_after, data)
  assert robustness.startable(waiting, done, data) == []
  assert robustness.remaining(waiting, done, data) == left[-18:]
  ready = dataclasses.replace(s, last_after=("width128", "lm_robustness"))
  assert robustness.complete(*ready.last_after, data)
  assert robustness.startable(ready, done, data) == left[-18:-10]


def test_claims_tables_of_the_box_key_their_rows_by_rate():
  """A sweep's own claims table (report_lib.Table): rows that share their
  arms at two rates are two comparisons (an eta column, each its own
  confirmation twin and finding), the header names the baselines' word and
  the rates; (a) and (b) of every arm read as before."""
  rec = lambda loss: dict(final={"val_loss_full": loss}, stopped=None,
                          history={"val_loss": [9.0]})
  plan = dict(best={"qk_norm": 0.01, "stiefel_box": 0.01}, high=0.1,
              points=[0.01, 0.1, 0.3])
  table = report_lib.Table("(b) box against qk_norm", tuple(
      (("stiefel_box", r), ("qk_norm", r)) for r in ("high", "high+1")))

  def runs(seeds, gap):
    return [dict(arm=a, eta=e, seed=sd, record=rec(
        2.0 + (gap(e) + sd % 100 / 1000 if a == "stiefel_box" else 0)))
            for sd in seeds for e in (0.1, 0.3)
            for a in ("qk_norm", "stiefel_box")]
  gap = lambda e: -0.2 if e == 0.1 else 0.3
  claims = {"plan": plan, "tables": [table],
            "discovery": runs((0, 1, 2, 3), gap),
            "confirmation": runs((500, 501, 502, 503), gap)}
  text = "\n".join(report_lib.claim_lines(
      claims, ["qk_norm", "stiefel_box"], "val_loss_full", "loss"))
  assert "### Claims (the plan's table (b))" in text
  assert "high+1: eta 0.3" in text and "treatment - qk_norm" in text
  assert "| stiefel_box | qk_norm | 0.1 | 500-503 |" in text
  assert "| stiefel_box | qk_norm | 0.3 | 500-503 |" in text
  assert ("Findings: stiefel_box - qk_norm, eta = 0.1: -0.1985" in text
          and "; stiefel_box - qk_norm, eta = 0.3: +0.3015" in text)
  # a sign that flips between the blocks is no finding
  claims["confirmation"] = runs((500, 501, 502, 503), lambda e: -gap(e))
  text = "\n".join(report_lib.claim_lines(
      claims, ["qk_norm", "stiefel_box"], "val_loss_full", "loss"))
  assert "Findings: none." in text


def test_bound_lines_count_the_box_evaluations_above_its_certified_bound(
    tmp_path):
  """The bound study's logit section on a toy sweep: the certified bound
  of the box is d / sqrt(head_dim); an evaluation above it by more than
  the relative tolerance (or not finite) is counted, one within it is not;
  the table shows each arm's largest logit per rate and the figure is
  written."""
  sweep = dataclasses.replace(
      robustness.QUICK_SWEEP, arms=("adamw", "stiefel_box"),
      grid=(1e-2, 0.1), extension=(), claims=(),
      ratios={"stiefel_box": {"stiefel_learning_rate": 30.0}})
  d, hd = sweep.base.n_embd, sweep.base.n_embd // sweep.base.n_head
  bound = d / np.sqrt(hd)
  data = "d"
  name = robustness.names(sweep, data)
  logits = {("stiefel_box", 1e-2): [[bound * 0.5, bound * (1 + 1e-5)]],
            ("stiefel_box", 0.1): [[bound * 1.01], [None]],
            ("adamw", 1e-2): [[1e3]], ("adamw", 0.1): [[1e4]]}
  cfg = {"n_embd": d}
  done = {name(t): dict(
      arm=t[0], config=cfg, final={"val_loss_full": 2.0}, stopped=None,
      data=data, numerics_version=harness.numerics_version(),
      identity=harness.run_identity(cfg, data),
      history={"val_loss": [4.0], "max_logit": logits[t[:2]]})
          for t in sweep_lib.tasks(sweep, {}, name)}
  lines = robustness.bound_lines({d: (sweep, done, data)}, tmp_path)
  text = "\n".join(lines)
  row = [ln for ln in lines if ln.startswith(f"| d {d} | stiefel_box |")]
  assert row == [f"| d {d} | stiefel_box | 2 | 4 | 2 | 1.0100 |"]
  assert "| adamw | 1000 | 1e+04 | |" in text
  assert (tmp_path / "bound_logits.png").stat().st_size > 0
