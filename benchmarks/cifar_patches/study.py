"""The study (`benchmarks.study`): which arms, tuned and paired how
(`GROUPS`: each arm's tuning grid, group by group), and the report's
families of comparisons; `StudyRuns`, the study's runs planned, read from
and written to <out>/runs/, and timed; the lines a study prints."""

from __future__ import annotations

import datetime
import pathlib
from typing import Optional, Sequence

import numpy as np

from benchmarks import harness, study as study_lib
from benchmarks.cifar_patches.arms import ARMS, BASE_KEYS
from benchmarks.cifar_patches.config import Config, Task, run_name
from benchmarks.cifar_patches.data import Dataset
from benchmarks.cifar_patches.train import Trainer
from benchmarks.study import PlanArm

# --------------------------------------------------------------------------
# The study (`benchmarks.study`): which arms, tuned and paired how.

# The study's arms, group by group in the order they run (the main arms
# together, then each other group), each with its tuning grid (axes; ():
# nothing to tune; None: the choice of the arm it ablates, tune_from) and
# whether its own grid sets its non-Q/K AdamW (own_base: a whole-model
# AdamW recipe). Every tuned arm gets 3 half-decade points per
# hyperparameter (fair tuning): AdamW lr x weight decay (which also sets
# every arm's non-Q/K AdamW), Stiefel Q/K lr x cap, RSGD lr. Each group is
# one family of the report's comparisons (`families`).
ADAMW_GRID = (("lr", (1e-3, 3e-3, 1e-2)), ("weight_decay", (0.01, 0.05, 0.25)))
GROUPS = {
    "main": (PlanArm("adamw", ADAMW_GRID),
             PlanArm("stiefel", (("lr", (0.1, 0.3, 1.0)),
                             ("cap", (0.1, 0.3, 1.0)))),
             PlanArm("rsgd", (("lr", (3.0, 10.0, 30.0)),))),
    # the strongest alternatives (issue 14), at the largest n
    "competitor": (PlanArm("stiefel_muon", (("lr", (0.01, 0.03, 0.1)),)),
                   PlanArm("muon", (("lr", (1e-3, 3e-3, 1e-2)),)),
                   PlanArm("qk_norm", ADAMW_GRID, own_base=True),
                   PlanArm("orthogonal_init", ADAMW_GRID, own_base=True)),
    "baseline": (PlanArm("frozen", ()),),
    "ablation": tuple(PlanArm(a, None, tune_from="stiefel") for a in (
        "no_projection", "per_coordinate_v", "no_cap", "whole_frame")),
    "eps": tuple(PlanArm(f"eps_{eps:g}", None, tune_from="stiefel")
                 for eps in (1e-3, 1e-2, 1e-1)),
}
# The protocol's paired seeds (issue 12), fixed before any run: 8 + 8 for
# the main arms, 6 + 6 for the others.
MAIN_SEEDS = harness.DISCOVERY_SEEDS[:8] + harness.CONFIRMATION_SEEDS[:8]
OTHER_SEEDS = harness.DISCOVERY_SEEDS[:6] + harness.CONFIRMATION_SEEDS[:6]


def families(groups: dict = GROUPS) -> list:
  """The report's families of comparisons, one per group of arms, fixed
  here before any run: each its own table, Holm correction and
  confirmation stage, so that arms added later never change the main
  arms' findings."""
  return [(g, [a.name for a in arms]) for g, arms in groups.items()]


def study_arms(groups: dict = GROUPS) -> tuple:
  """The groups' arms as the study plans them, in run order (the main
  group's arms main)."""
  return tuple(a._replace(main=g == "main") for g, arms in groups.items()
               for a in arms)


def quick_groups(groups: dict = GROUPS) -> dict:
  """The groups with every grid cut to its first point (`--quick`)."""
  return {g: tuple(a._replace(axes=tuple((k, v[:1]) for k, v in a.axes))
                   if a.axes else a for a in arms)
          for g, arms in groups.items()}


class StudyRuns:
  """The study's runs: planned (`study`), read from and written to
  <out>/runs/ (`load`, `execute`: trained by its `Trainer`), timed
  (`expected_s`)."""

  def __init__(self, data: Dataset, cfg: Config, out: pathlib.Path,
               groups: Optional[dict] = None, inherit: Optional[dict] = None,
               inherit_from: Optional[str] = None):
    self.cfg, self.out, self.data = cfg, pathlib.Path(out), data
    self.arms = study_arms(GROUPS if groups is None else groups)
    self.plan = {a.name: a for a in self.arms}
    # {arm: hp} chosen elsewhere (--hp-from): those arms are not re-tuned.
    self.inherit, self.inherit_from = dict(inherit or {}), inherit_from
    self.fp = harness.run_identity(cfg.to_dict(), data.source)
    self.store = harness.RunStore(out, indent=1)
    self.trainer = Trainer(data, cfg)
    self._records = {}   # name -> record read or written
    (self.out / "runs").mkdir(parents=True, exist_ok=True)

  # the study ---------------------------------------------------------------
  def study(self, sizes: Sequence[int] = (None,), main_seeds=(),
            other_seeds=(), arms: Optional[Sequence[str]] = None
            ) -> study_lib.Study:
    """The study of `arms` (default: every arm) and the arms they build on,
    the main ones at each of `sizes` (largest first), the others at the
    largest; tuned by mean validation accuracy (higher is better)."""
    asked = list(self.plan) if arms is None else list(arms)
    return study_lib.Study(
        arms=study_lib.with_dependencies(self.arms, asked),
        tune_seeds=self.cfg.tune_seeds, main_seeds=tuple(main_seeds),
        other_seeds=tuple(other_seeds),
        sizes=tuple(sorted(sizes, key=lambda n: -1 if n is None else -n)),
        max_extensions=self.cfg.max_extensions, higher_is_better=True,
        fixed=tuple((a, dict(hp)) for a, hp in self.inherit.items()))

  def finished(self) -> study_lib.Finished:
    return study_lib.Finished(self.load, lambda r: r["val_acc"])

  # results on disk --------------------------------------------------------
  def load(self, task: Task) -> Optional[dict]:
    """The task's finished record, or None: absent, of another identity,
    or made at other hyperparameters than the task's (stale: the choice,
    or the adamw choice it trains on, has changed since)."""
    name = run_name(task)
    rec = self._records.get(name)
    if rec is None:
      rec = self.store.load(name, self.fp)
      if rec is None:
        return None
      self._records[name] = rec   # runs change only through `execute`
    own = study_lib.sets_own_base(self.plan[task.arm])
    if rec.get("hp") != dict(task.point) or (
        not own and rec.get("base") != dict(task.base)):
      return None
    return rec

  # one run ----------------------------------------------------------------
  def size(self, task: Task) -> int:
    """Training images: the tuning split's for a tuning run."""
    return len(self.trainer.pool) if task.stage == "tune" else task.size

  def execute(self, task: Task) -> dict:
    """Trains one paired run or one tuning point and writes its JSON."""
    done = self.load(task)
    if done is not None:
      return done
    arm, cfg = ARMS[task.arm], self.cfg
    tuning = task.stage == "tune"
    hp = dict(task.point)
    # adamw and the whole-model AdamW recipes set their own non-Q/K AdamW
    own = study_lib.sets_own_base(self.plan[task.arm])
    base = {k: hp[k] for k in BASE_KEYS} if own else dict(task.base)
    n = self.size(task)
    got = self.trainer.train(task.arm, hp, base, task.seed, n, tuning)
    curve = got["curve"]
    rec = {
        "kind": "tune" if tuning else "run", "arm": task.arm,
        "seed": task.seed, "n": n,
        "hp": hp, "base": base, "fixed": dict(arm.fixed),
        "hp_from": (self.inherit_from if task.arm in self.inherit and not tuning
                    else None),
        "per_head": arm.frames is None, "orthonormal_start": arm.orthonormal,
        ("val_acc" if tuning else "test_acc"): curve[-1],
        ("val_curve" if tuning else "test_curve"): curve,
        "train_loss": got["losses"],
        "qk_isometry_error": got["isometry_error"],
        "qk_movement": got["movement"], "wall_s": got["wall_s"],
        "data": self.data.source,
        "identity": self.fp, **harness.versions(),
        "code_hash": harness.code_hash(), "config": cfg.to_dict(),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": harness.machine(),
    }
    self.store.save(run_name(task), rec)
    self._records[run_name(task)] = rec
    return rec

  def expected_s(self, task: Task) -> Optional[float]:
    """The median wall time of the runs read or made of the task's kind,
    arm and n; else the median time per training image of every run read
    or made, times n (None before any run)."""
    kind, n = ("tune" if task.stage == "tune" else "run"), self.size(task)
    recs = self._records.values()
    walls = [r["wall_s"] for r in recs
             if (r["kind"], r["arm"], r["n"]) == (kind, task.arm, n)]
    if walls:
      return float(np.median(walls))
    per_image = [r["wall_s"] / r["n"] for r in recs]
    return float(np.median(per_image)) * n if per_image else None


# --------------------------------------------------------------------------
# The plan (`benchmarks.study`): most important results first. The main
# arms' tuning (each grid extended until its best point is interior), their
# paired runs at each n (largest first), discovery seeds before
# confirmation seeds; then the competitors, the baseline, the ablations and
# the eps sweep at the largest n.


def estimate_text(est: dict) -> str:
  """`benchmarks.study.estimate` of the runs left as one line."""
  r = est["runs"]
  text = (f"to do: {r['tune']} tuning and"
          f" {r['discovery'] + r['confirmation']} paired runs, about"
          f" {est['total_seconds'] / 3600:.1f} h on this machine (from the"
          " finished runs' wall times; a tuning grid that widens adds"
          " more; runs waiting on a choice counted at its grid's centre)")
  if est["untimed"]:
    text += f"; {est['untimed']} run(s) not timed"
  return text + "."


def describe(task: Task, rec: dict) -> str:
  acc = rec.get("test_acc", rec.get("val_acc"))
  return (f"{run_name(task)}: acc {100 * acc:.2f}%, train loss"
          f" {rec['train_loss'][-1]:.3f}, {rec['wall_s']:.1f}s")
