"""The shared study (`benchmarks.study`): its plan, without training (fake
finished runs stand in for the experiments' records), and its runner."""

from __future__ import annotations

import itertools
import math

import pytest

from benchmarks import study as S

ADAMW = S.PlanArm("adamw", (("lr", (1e-3, 3e-3, 1e-2)),))
STIEFEL = S.PlanArm("stiefel", (("lr", (0.1, 0.3, 1.0)),))
OWN = S.PlanArm("own", (("lr", (1e-3, 3e-3, 1e-2)),), own_base=True, main=False)
ABLATION = S.PlanArm("ablation", None, tune_from="stiefel", main=False)
FROZEN = S.PlanArm("frozen", (), main=False)
STUDY = S.Study(arms=(ADAMW, STIEFEL, OWN, ABLATION, FROZEN),
                tune_seeds=(100, 101), main_seeds=(0, 1, 500, 501),
                other_seeds=(0, 500), sizes=(4000, 1000))


def key(t: S.Task):
  return (t.stage, t.arm, S.point_key(t.point),
          S.point_key(t.base), t.seed, t.size)


def finished(done: dict, best: dict) -> S.Finished:
  """Runs in `done` (by key); a tuning run scores -|log10(lr / best)|."""
  def record(t):
    return done.get(key(t))
  def score(r):
    return -abs(math.log10(r["lr"] / best[r["arm"]]))
  return S.Finished(record, score)


def run_all(study, best):
  """Runs the plan to its end, as a runner does: the first unfinished run,
  then the plan asked anew. Returns the runs in the order made."""
  done, order = {}, []
  while left := S.remaining(study, finished(done, best)):
    t = left[0]
    done[key(t)] = {"arm": t.arm, "lr": t.point.get("lr", 1.0)}
    order.append(t)
  return order, finished(done, best)


def test_plan_tunes_then_pairs_main_arms_before_the_others():
  order, runs = run_all(STUDY, {"adamw": 3e-3, "stiefel": 0.3, "own": 2e-3})
  stages = [(t.stage, t.arm) for t in order]
  # the main arms: adamw's grid, stiefel's on adamw's choice, then pairs at
  # each size, discovery seeds before confirmation seeds, seed-major
  assert stages[:12] == [("tune", "adamw")] * 6 + [("tune", "stiefel")] * 6
  main = [(t.stage, t.seed, t.size, t.arm) for t in order[12:28]]
  assert main == [(b, s, n, a) for b, seeds in (("discovery", (0, 1)),
                                                ("confirmation", (500, 501)))
                  for n in (4000, 1000) for s in seeds
                  for a in ("adamw", "stiefel")]
  # then each other arm: its own tuning, then its pairs at the first size
  rest = [(t.stage, t.arm, t.seed, t.size) for t in order[28:]]
  assert rest == ([("tune", "own", s, None) for s in (100, 101)] * 3
                  + [("discovery", "own", 0, 4000),
                     ("confirmation", "own", 500, 4000),
                     ("discovery", "ablation", 0, 4000),
                     ("confirmation", "ablation", 500, 4000),
                     ("discovery", "frozen", 0, 4000),
                     ("confirmation", "frozen", 500, 4000)])
  # the choices: each arm's best; the non-Q/K AdamW is adamw's, except for
  # adamw itself and the arm that sets its own
  c = {t.arm: (dict(t.point), dict(t.base)) for t in order
       if t.stage != "tune"}
  assert c["adamw"] == ({"lr": 3e-3}, {})
  assert c["stiefel"] == ({"lr": 0.3}, {"lr": 3e-3})
  assert c["own"] == ({"lr": 3e-3}, {})
  assert c["ablation"] == ({"lr": 0.3}, {"lr": 3e-3})   # stiefel's choice
  assert c["frozen"] == ({}, {"lr": 3e-3})
  assert S.remaining(STUDY, runs) == []


def test_plan_stops_at_an_unfinished_grid_and_widens_it():
  # adamw's best lies past the grid's top: widened to 0.0333, where the
  # best lands on the edge again, so once more, to 0.111
  order, runs = run_all(STUDY, {"adamw": 3e-2, "stiefel": 0.3, "own": 1e-2})
  adamw = [t.point["lr"] for t in order if t.stage == "tune"
           and t.arm == "adamw"]
  assert adamw == ([1e-3] * 2 + [3e-3] * 2 + [1e-2] * 2 + [0.0333] * 2
                   + [0.111] * 2)
  t = S.tuning(STUDY, runs, "adamw", {})
  assert t.finished and t.widenings == 2
  assert S.choice(STUDY, runs, "adamw") == ({"lr": 0.0333}, {})
  # before any run: only adamw's grid is planned; stiefel waits on it
  nothing = finished({}, {})
  assert {t.arm for t in S.plan(STUDY, nothing)} == {"adamw"}
  assert S.choice(STUDY, nothing, "stiefel") is None


def test_assume_lists_the_whole_study_with_guesses_marked():
  whole = S.plan(STUDY, finished({}, {}), assume=True)
  counts = {st: sum(t.stage == st for t in whole) for st in S.STAGES}
  # tuning: 3 points x 2 seeds for adamw, stiefel and own; pairs: 2 main
  # arms x 4 seeds x 2 sizes, 3 others x 2 seeds
  assert counts == {"tune": 18, "discovery": 8 + 3, "confirmation": 8 + 3}
  # nothing is chosen: every run built on a choice is provisional, and a
  # grid's centre stands in for it
  assert [t.provisional for t in whole if t.arm == "adamw"
          and t.stage == "tune"] == [False] * 6
  assert all(t.provisional for t in whole if t.stage != "tune")
  assert {t.point["lr"] for t in whole if t.arm == "stiefel"
          and t.stage == "discovery"} == {0.3}
  # the estimate counts the same runs; untimed ones (None) count 0 s
  est = S.estimate(whole, lambda t: None if t.arm == "own" else (
      10.0 if t.stage == "tune" else t.size / 100))
  assert est["runs"] == counts and est["total_runs"] == len(whole)
  assert est["untimed"] == sum(t.arm == "own" for t in whole) == 6 + 2
  assert est["provisional"] == sum(t.provisional for t in whole)
  assert est["seconds"]["tune"] == 10.0 * 12
  assert est["seconds"]["discovery"] == 4 * (40 + 10) + 2 * 40
  assert est["total_seconds"] == sum(est["seconds"].values())


def test_an_arm_in_the_study_for_its_choice_is_tuned_not_paired():
  only = S.Study(**{**STUDY.__dict__, "arms": (
      ADAMW._replace(paired=False), STIEFEL._replace(paired=False),
      ABLATION)})
  order, _ = run_all(only, {"adamw": 3e-3, "stiefel": 0.3})
  assert {t.arm for t in order if t.stage == "tune"} == {"adamw", "stiefel"}
  assert [(t.stage, t.arm, t.seed, dict(t.point)) for t in order
          if t.stage != "tune"] == [
              ("discovery", "ablation", 0, {"lr": 0.3}),
              ("confirmation", "ablation", 500, {"lr": 0.3})]


def test_a_study_whose_arm_builds_on_a_later_or_missing_arm_is_refused():
  with pytest.raises(ValueError, match="'stiefel' builds on 'adamw'"):
    S.Study(arms=(STIEFEL, ADAMW), tune_seeds=(1,), main_seeds=(0,),
            other_seeds=(0,))
  with pytest.raises(ValueError, match="'ablation' builds on 'stiefel'"):
    S.Study(arms=(ADAMW, ABLATION), tune_seeds=(1,), main_seeds=(0,),
            other_seeds=(0,))
  # a main arm cannot wait on an arm tuned after the main pairs
  with pytest.raises(ValueError, match="'ablation' builds on 'stiefel'"):
    S.Study(arms=(ADAMW, STIEFEL._replace(main=False),
                  ABLATION._replace(main=True)), tune_seeds=(1,),
            main_seeds=(0,), other_seeds=(0,))
  with pytest.raises(KeyError, match="no arm 'sgd'"):
    STUDY.arm("sgd")


def test_fixed_choices_are_not_tuned_and_names_deduplicate():
  fixed = S.Study(**{**STUDY.__dict__, "fixed": (("adamw", {"lr": 1e-2}),)})
  first = S.plan(fixed, finished({}, {}))
  assert first[0].arm == "stiefel" and first[0].base == {"lr": 1e-2}
  # a run two stages name is listed once, at the first
  ref = S.Task("reference", "adamw", {}, {}, 0)
  same = lambda t: "adamw" if t.arm == "adamw" else str(key(t))
  tasks = S.plan(STUDY, finished({}, {})._replace(name=same), first=[ref])
  assert tasks[0] == ref and all(t.arm != "adamw" for t in tasks[1:])


def test_runner_follows_a_plan_that_grows_and_reports_each_run():
  # A plan whose second stage appears only once the first is done (as a
  # tuning grid widens, or paired runs wait on a tuning choice).
  done, lines, after = [], [], []

  def remaining():
    first = [t for t in ("a", "b") if t not in done]
    second = [] if first else [t for t in ("c",) if t not in done]
    return first + second

  def execute(task):
    done.append(task)
    return {"score": len(done)}

  made = S.run_tasks(remaining, execute, desc="t",
                           describe=lambda t, r: f"{t}={r['score']}",
                           after=lambda t, r: after.append(t),
                           log=lines.append, progress=False)
  assert made == 3 and done == ["a", "b", "c"] and after == done
  assert lines == ["[1 planned left] a=1", "[0 planned left] b=2",
                   "[0 planned left] c=3"]


def test_run_list_runs_each_task_once_and_returns_what_a_budget_left(
    monkeypatch):
  done, lines = [], []
  assert S.run_list(["a", "b"], lambda t: done.append(t) or {}, desc="t",
                    describe=lambda t, _: t, log=lines.append,
                    progress=False) == []
  assert done == ["a", "b"]
  assert lines == ["[1 planned left] a", "[0 planned left] b"]
  clock = itertools.count(0.0, 10.0)          # each call: 10 s later
  monkeypatch.setattr(S.time, "time", lambda: next(clock))
  assert S.run_list(range(5), lambda t: {}, desc="t",
                    describe=lambda t, _: "", expected_s=lambda t: 100.0,
                    time_budget=120.0, log=lines.append,
                    progress=False) == [1, 2, 3, 4]


def test_runner_stops_before_a_run_past_its_time_budget(monkeypatch):
  clock = itertools.count(0.0, 10.0)          # each call: 10 s later
  monkeypatch.setattr(S.time, "time", lambda: next(clock))
  done, lines = [], []
  made = S.run_tasks(
      lambda: [t for t in range(5) if t not in done],
      lambda t: done.append(t) or {}, desc="t",
      describe=lambda t, _: str(t), expected_s=lambda t: 100.0,
      time_budget=120.0, log=lines.append, progress=False)
  # The first run always runs; the second would end past 120 s (at 30 + 100 s).
  assert made == 1 and done == [0]
  assert lines[-1].startswith("time budget 120 s: stopping with 4 planned")
  # Without a budget every run is made.
  done.clear()
  assert S.run_tasks(lambda: [t for t in range(5) if t not in done],
                           lambda t: done.append(t) or {}, desc="t",
                           describe=lambda t, _: "", log=lines.append,
                           progress=False) == 5


def test_comparison_pairs_put_every_arm_against_adamw_then_stiefel_first():
  assert S.comparison_pairs(["adamw", "stiefel", "rsgd", "frozen"]) == [
      ("stiefel", "adamw"), ("rsgd", "adamw"), ("frozen", "adamw"),
      ("stiefel", "rsgd"), ("stiefel", "frozen")]
  # without the method, only the baseline comparisons
  assert S.comparison_pairs(["adamw", "rsgd"]) == [("rsgd", "adamw")]


def test_tuning_grid_is_a_product_widened_past_its_edges():
  axes = (("lr", (1e-3, 3e-3, 1e-2)), ("weight_decay", (0.01, 0.05)))
  points = S.grid_points(axes)
  assert len(points) == 6 and points[0] == {"lr": 1e-3, "weight_decay": 0.01}
  scores = {S.point_key(p): p["lr"] for p in points}       # best: largest lr
  best = S.best_point(axes, scores, higher_is_better=True)
  assert best == {"lr": 1e-2, "weight_decay": 0.01}       # tie: grid order
  wider = S.extend_axes(axes, best)
  assert wider == (("lr", (1e-3, 3e-3, 1e-2, 0.0333)),
                   ("weight_decay", (0.002, 0.01, 0.05)))
  interior = {"lr": 3e-3, "weight_decay": 0.05}
  assert S.extend_axes((("lr", (1e-3, 3e-3, 1e-2)),), interior) is None
  assert S.extend_axes((("lr", (1e-3,)),), {"lr": 1e-3}) is None


def test_state_reads_the_plan_against_the_finished_runs():
  named = lambda runs: runs._replace(name=lambda t: str(key(t)))
  order, runs = run_all(STUDY, {"adamw": 3e-3, "stiefel": 0.3, "own": 2e-3})
  st = S.state(STUDY, named(runs))
  assert st["left"] == [] and list(st["planned"].values()) == order
  t = st["tuning"]["adamw"]
  assert t["finished"] and t["chosen"] == {"lr": 3e-3} and not t["on_edge"]
  assert t["base"] == {} and t["widenings"] == 0
  assert [(p["lr"], sorted(r)) for p, r in t["points"]] == [
      (1e-3, [100, 101]), (3e-3, [100, 101]), (1e-2, [100, 101])]
  assert st["tuning"]["stiefel"]["base"] == {"lr": 3e-3}
  assert st["tuning"]["ablation"] is None and st["tuning"]["frozen"] is None
  assert st["choices"]["ablation"] == ({"lr": 0.3}, {"lr": 3e-3})
  # paired runs at the first size, every seed of the arm
  assert sorted(st["paired"]["stiefel"]) == [0, 1, 500, 501]
  assert sorted(st["paired"]["own"]) == [0, 500]
  assert S.paired_task(STUDY, runs, "stiefel", 500, 1000) == S.Task(
      "confirmation", "stiefel", {"lr": 0.3}, {"lr": 3e-3}, 500, 1000)
  assert STUDY.own_base("adamw") and STUDY.own_base("own")
  assert not STUDY.own_base("stiefel")
  assert S.widening_bound(STUDY, runs) == []        # every grid finished
  # before any run: adamw's grid is planned, the rest waits on its choice
  nothing = named(finished({}, {}))
  st = S.state(STUDY, nothing)
  assert st["tuning"]["stiefel"] is None and st["paired"]["adamw"] == {}
  assert st["choices"]["adamw"] is None and len(st["left"]) == 6
  assert st["tuning"]["adamw"]["points"][0][1] == {}
  with pytest.raises(RuntimeError, match="stiefel: tuning runs unfinished"):
    S.paired_task(STUDY, nothing, "stiefel", 0)
  # each unfinished grid of 3 points could widen 3 times on its one axis:
  # 3 more points each, counted from a run at its centre (on adamw's)
  assert [(t.arm, t.point, t.base, t.seed, t.provisional, n)
          for t, n in S.widening_bound(STUDY, nothing)] == [
              ("adamw", {"lr": 3e-3}, {}, 100, True, 3),
              ("stiefel", {"lr": 0.3}, {"lr": 3e-3}, 100, True, 3),
              ("own", {"lr": 3e-3}, {}, 100, True, 3)]


def test_run_study_writes_the_tables_after_each_paired_run():
  tasks = [S.Task("tune", "a", {}, {}, 100),
           S.Task("discovery", "a", {}, {}, 0),
           S.Task("confirmation", "a", {}, {}, 500)]
  done, reports = [], []
  made = S.run_study(lambda: [t for t in tasks if t not in done],
                     lambda t: done.append(t) or {},
                     on_paired=lambda: reports.append(len(done)), desc="t",
                     describe=lambda t, _: t.stage, log=lambda _: None,
                     progress=False)
  assert made == 3 and done == tasks and reports == [2, 3]
