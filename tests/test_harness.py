"""The study runner every benchmark shares (`harness.run_tasks`)."""

from __future__ import annotations

import itertools

from benchmarks import harness


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

  made = harness.run_tasks(remaining, execute, desc="t",
                           describe=lambda t, r: f"{t}={r['score']}",
                           after=lambda t, r: after.append(t),
                           log=lines.append, progress=False)
  assert made == 3 and done == ["a", "b", "c"] and after == done
  assert lines == ["[1 planned left] a=1", "[0 planned left] b=2",
                   "[0 planned left] c=3"]


def test_runner_stops_before_a_run_past_its_time_budget(monkeypatch):
  clock = itertools.count(0.0, 10.0)          # each call: 10 s later
  monkeypatch.setattr(harness.time, "time", lambda: next(clock))
  done, lines = [], []
  made = harness.run_tasks(
      lambda: [t for t in range(5) if t not in done],
      lambda t: done.append(t) or {}, desc="t",
      describe=lambda t, _: str(t), expected_s=lambda t: 100.0,
      time_budget=120.0, log=lines.append, progress=False)
  # The first run always runs; the second would end past 120 s (at 30 + 100 s).
  assert made == 1 and done == [0]
  assert lines[-1].startswith("time budget 120 s: stopping with 4 planned")
  # Without a budget every run is made.
  done.clear()
  assert harness.run_tasks(lambda: [t for t in range(5) if t not in done],
                           lambda t: done.append(t) or {}, desc="t",
                           describe=lambda t, _: "", log=lines.append,
                           progress=False) == 5
