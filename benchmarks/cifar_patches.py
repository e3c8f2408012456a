"""CIFAR-10 patch benchmark: Stiefel-Adam on the attention Q/K kernels
against AdamW, with data scaling, baselines and ablations (paired seeds).

    python -m benchmarks.cifar_patches            # the full protocol, resumable
    python -m benchmarks.cifar_patches --quick    # synthetic images, < 1 minute
    python -m benchmarks.cifar_patches --data PATH --seeds 500-511 --out DIR
    python -m benchmarks.cifar_patches ... --dry-run   # runs left, hours
    python -m benchmarks.cifar_patches ... --time-budget 9000  # stops itself
    python -m benchmarks.cifar_patches --report-only --out benchmarks/results/cifar \
        --data PATH --results-md benchmarks/RESULTS.md   # the committed tables

Every arm trains the same patch transformer (`benchmarks.models`,
`PatchViTConfig`) with the same AdamW on every parameter
except the attention query/key kernels, whose optimizer is the arm's recipe
(an `optax.chain` of the library's transforms). Seed s fixes the training
subset, the non-Q/K initialisation and the batch order for every arm. Each
arm's hyperparameters (AdamW: lr x weight decay, also every arm's non-Q/K
AdamW; Stiefel: Q/K lr x cap; RSGD: lr) are chosen on a validation split
carved from the training images, by the mean over three tuning seeds, on
grids widened until the choice is interior; the test images are only
evaluated.
Each finished run is written at once to <out>/runs/ (default runs/cifar/,
ignored by git); a rerun skips it if its identity (configuration, data md5,
library version: `benchmarks.harness`) is unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import time
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import cifar_data, harness, stats, study as study_lib, training
from benchmarks.models import PatchViTConfig, Transformer

REFERENCE_OUT = harness.REFERENCE_ROOT / "cifar"
SECTION = "## CIFAR-10 patch benchmark"


def section_heading(out: pathlib.Path) -> str:
  """The RESULTS.md heading of a results folder: SECTION for the main
  protocol's (results/cifar), SECTION plus the folder's name for another
  (e.g. the earlier tiny protocol, results/cifar_tiny)."""
  name = pathlib.Path(out).resolve().name
  return SECTION if name == REFERENCE_OUT.name else f"{SECTION}: `{name}`"


# --------------------------------------------------------------------------
# Q/K recipes: each arm's optimizer for the query/key frames, (..., d, r).


def qk_adamw(lr, *, weight_decay, **_):
  """The baseline: the same AdamW as the rest of the model."""
  return optax.adamw(lr, weight_decay=weight_decay)


def qk_stiefel(lr, *, cap=so.aliases.DEFAULT_MAX_STEP_NORM, eps=1e-8, **_):
  """Stiefel-Adam: project, one scalar v per frame, lr, cap, retract."""
  return so.stiefel_adam(lr, eps=eps, max_step_norm=cap)


def qk_rsgd(lr, **_):
  """Fixed-step Riemannian SGD: W+ = polar(W - lr P_W(G))."""
  return so.riemannian_sgd(lr)


def qk_frozen(lr=None, **_):
  """Q/K kept at their orthonormal start."""
  del lr
  return optax.set_to_zero()


def qk_no_projection(lr, *, cap=so.aliases.DEFAULT_MAX_STEP_NORM, eps=1e-8, **_):
  """Ablation: no tangent projection of gradient or momentum; the polar
  retraction (its Newton–Schulz sized for non-tangent steps) still keeps W
  on the manifold."""
  return optax.chain(
      so.scale_by_frame_adam(eps=eps, transport_momentum=False),
      optax.scale_by_learning_rate(lr),
      so.clip_frame_norm(cap),
      so.retract_polar(max_step_norm=cap, tangent=False))


def qk_per_coordinate(lr, *, cap=so.aliases.DEFAULT_MAX_STEP_NORM, eps=1e-8, **_):
  """Ablation: Adam's per-coordinate second moment instead of one scalar
  per frame (not scale-free per frame, not O(d)-equivariant); the step is
  projected back to the tangent space before cap and retraction."""
  return optax.chain(
      so.project_to_tangent(),
      optax.scale_by_adam(eps=eps),
      so.project_to_tangent(),
      optax.scale_by_learning_rate(lr),
      so.clip_frame_norm(cap),
      so.retract_polar(max_step_norm=cap))


def qk_stiefel_muon(lr, **_):
  """Manifold Muon: polar(W - lr P_W(msign(tangent momentum)))."""
  return so.stiefel_muon(lr)


def qk_muon(lr, *, weight_decay, **_):
  """optax.contrib.muon on each head's (d, head_dim) view, unconstrained,
  with Moonlight's consistent-RMS scale 0.2 (so its lr reads like AdamW's)
  and the model's weight decay."""
  dims = lambda params: jax.tree.map(
      lambda _: optax.contrib.MuonDimensionNumbers(reduction_axis=-2,
                                                   output_axis=-1), params)
  return optax.contrib.muon(lr, beta=0.95, nesterov=True,
                            weight_decay=weight_decay, consistent_rms=0.2,
                            muon_weight_dimension_numbers=dims)


def qk_no_cap(lr, *, eps=1e-8, **_):
  """Ablation: Stiefel-Adam without the trust-region cap."""
  return so.stiefel_adam(lr, eps=eps, max_step_norm=None)


# The Q/K frames of the patch transformer's (d, heads, head_dim) kernels: one frame per
# head (the library's default), or one (d, heads * head_dim) frame per
# projection (the `whole_frame` ablation).
PER_HEAD = "flax"
WHOLE_FRAME = {so.specs.QK_KERNEL: so.FrameSpec(rows=-3, cols=(-2, -1))}


def frames_of(per_head: bool):
  """The frame selector of an arm's layout."""
  return PER_HEAD if per_head else WHOLE_FRAME


class Arm(NamedTuple):
  """One arm: the Q/K recipe, its start, frame layout and tuning grid.

  grid: the axes ((name, values), ...) of a product grid of
  hyperparameters tried on the validation split; None inherits the chosen
  point of `tune_from` (ablations change one ingredient at the tuned
  setting). An axis whose best value lies on its edge is extended
  geometrically (`benchmarks.study.tuning`) until the best is interior. fixed:
  hyperparameters of the recipe that are not tuned (e.g. eps).
  """
  name: str
  recipe: Callable[..., optax.GradientTransformation]
  orthonormal: bool = True
  per_head: bool = True
  grid: Optional[tuple] = None
  tune_from: Optional[str] = None
  fixed: tuple = ()
  group: str = "main"
  own_base: bool = False     # a whole-model AdamW recipe: its own lr, wd
  qk_norm: bool = False      # the model with per-head query/key norm


def make_arms() -> dict:
  """The registry of arms, in the order the sweep runs them. Every tuned
  arm gets 3 half-decade points per hyperparameter (fair tuning): AdamW lr
  x weight decay (which also sets every arm's non-Q/K AdamW), Stiefel Q/K
  lr x cap, RSGD lr."""
  arms = [
      Arm("adamw", qk_adamw, orthonormal=False,
          grid=(("lr", (1e-3, 3e-3, 1e-2)), ("weight_decay", (0.01, 0.05, 0.25)))),
      Arm("stiefel", qk_stiefel,
          grid=(("lr", (0.1, 0.3, 1.0)), ("cap", (0.1, 0.3, 1.0)))),
      Arm("rsgd", qk_rsgd, grid=(("lr", (3.0, 10.0, 30.0)),)),
      Arm("frozen", qk_frozen, grid=(), group="baseline"),
      Arm("no_projection", qk_no_projection, tune_from="stiefel", group="ablation"),
      Arm("per_coordinate_v", qk_per_coordinate, tune_from="stiefel", group="ablation"),
      Arm("no_cap", qk_no_cap, tune_from="stiefel", group="ablation"),
      Arm("whole_frame", qk_stiefel, per_head=False, tune_from="stiefel",
          group="ablation"),
  ]
  adamw_grid = arms[0].grid
  arms += [   # the strongest alternatives (issue 14), at the largest n
      Arm("stiefel_muon", qk_stiefel_muon,
          grid=(("lr", (0.01, 0.03, 0.1)),), group="competitor"),
      Arm("muon", qk_muon, orthonormal=False,
          grid=(("lr", (1e-3, 3e-3, 1e-2)),), group="competitor"),
      Arm("qk_norm", qk_adamw, orthonormal=False, grid=adamw_grid,
          own_base=True, qk_norm=True, group="competitor"),
      Arm("orthogonal_init", qk_adamw, grid=adamw_grid, own_base=True,
          group="competitor"),
  ]
  for eps in (1e-3, 1e-2, 1e-1):
    arms.append(Arm(f"eps_{eps:g}", qk_stiefel, tune_from="stiefel",
                    fixed=(("eps", eps),), group="eps"))
  return {a.name: a for a in arms}


ARMS = make_arms()


# --------------------------------------------------------------------------
# Configuration and paired data streams.


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run's result depends on besides (arm, hp, seed, n)."""
  model: PatchViTConfig = PatchViTConfig(dim=64, heads=4, depth=2)
  batch: int = 128
  epochs: int = 20
  warmup_frac: float = 0.05
  val_size: int = 1000
  val_seed: int = 12345
  tune_seeds: tuple = (1000, 1001, 1002)
  max_extensions: int = 3

  def to_dict(self):
    return dataclasses.asdict(self)


def fingerprint(cfg: Config, source: str) -> str:
  """The runs' identity: configuration, data content id (md5) and library
  version; runs with another identity are not reused."""
  return harness.identity(cfg.to_dict(), source)


def validation_split(n_train: int, cfg: Config):
  """(pool, val) indices: a fixed random val split of the training images."""
  perm = np.random.default_rng(cfg.val_seed).permutation(n_train)
  return np.sort(perm[cfg.val_size:]), np.sort(perm[:cfg.val_size])


def seed_stream(seed: int, pool: np.ndarray, n: int, cfg: Config):
  """The training subset (n of pool) and the per-epoch batch order for
  `seed`: the same for every arm. Returns idx (epochs, steps, batch)."""
  if n > len(pool):
    raise ValueError(f"n = {n} exceeds the {len(pool)} training images.")
  if n < cfg.batch:
    raise ValueError(f"n = {n} is smaller than a batch ({cfg.batch}).")
  rng = np.random.default_rng(seed)
  subset = pool[rng.permutation(len(pool))[:n]]
  steps = n // cfg.batch
  order = [subset[rng.permutation(n)[:steps * cfg.batch]] for _ in range(cfg.epochs)]
  return np.stack(order).reshape(cfg.epochs, steps, cfg.batch).astype(np.int32)


# --------------------------------------------------------------------------
# Model, optimizer and training.


def init_params(model: Transformer, arm: Arm, seed: int):
  """The seed's standard init; Q/K replaced by their polar factor
  (nearest orthonormal frames) for arms that start on the manifold."""
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 32, 32, 3)))["params"]
  if arm.orthonormal:
    params = orthonormal_start(params, per_head=arm.per_head)
  return params


def orthonormal_start(params, *, per_head: bool, passes: int = 2):
  """`so.orthonormalize` applied `passes` times. One eigh-based polar of a
  square (d, d) Gaussian kernel (per_head=False) squares its condition
  number and leaves ||W^T W - I|| ~ 1e-3 in float32; a second polar of the
  nearly orthonormal result is exact to rounding (and changes a per-head
  frame only at rounding level)."""
  for _ in range(passes):
    params = so.orthonormalize(params, frames_of(per_head))
  return params


def schedule(peak: float, total_steps: int, cfg: Config):
  warmup = max(1, int(cfg.warmup_frac * total_steps))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup,
                                            max(total_steps, warmup + 1))


BASE_KEYS = ("lr", "weight_decay")


def make_tx(arm: Arm, hp: dict, base: dict, total_steps: int, cfg: Config):
  """AdamW(base lr, base weight decay) on every parameter except Q/K, the
  arm's recipe there (with the same weight decay where it takes one)."""
  kw = dict(arm.fixed)
  kw.update({k: v for k, v in hp.items() if k not in BASE_KEYS})
  qk_lr = schedule(hp["lr"], total_steps, cfg) if "lr" in hp else None
  rest_lr = schedule(base["lr"], total_steps, cfg)
  # Arms that start off the manifold (adamw) train raw kernels: no start check.
  return so.stiefel_attention(
      rest_lr, frames=frames_of(arm.per_head),
      orthonormal_start="check" if arm.orthonormal else "project",
      stiefel_tx=arm.recipe(qk_lr, weight_decay=base["weight_decay"], **kw),
      euclidean_tx=optax.adamw(rest_lr, weight_decay=base["weight_decay"]))


def normalize(x_uint8, mean, std):
  return (x_uint8.astype(jnp.float32) / 255.0 - mean) / std


def make_epoch_fn(model: Transformer, tx, mean, std):
  """jit(carry, idx (steps, batch), x, y) -> (carry, mean loss, None): one
  epoch of `training.train_chunk`, a step per row of idx."""

  def loss_fn(params, xb, yb):
    logits = model.apply({"params": params}, normalize(xb, mean, std))
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  return jax.jit(training.train_chunk(loss_fn, tx,
                                      lambda i, x, y: (x[i], y[i])))


def make_eval_fn(model: Transformer, mean, std):
  @jax.jit
  def accuracy(params, x, y):
    logits = model.apply({"params": params}, normalize(x, mean, std))
    return jnp.mean(jnp.argmax(logits, -1) == y)
  return accuracy


Task = study_lib.Task
hp_key = study_lib.point_key


def run_name(task: Task) -> str:
  """A run's file name: tune__<arm>__<point>__s<seed> for a tuning run,
  <arm>__n<n>__s<seed> for a paired run."""
  if task.stage == "tune":
    return f"tune__{task.arm}__{hp_key(task.point)}__s{task.seed}"
  return f"{task.arm}__n{task.size}__s{task.seed}"


# --------------------------------------------------------------------------
# Tuning: product grids (study_lib.grid_points), the mean over tuning seeds,
# edges widened (study_lib.extend_axes) until the best point is interior.

grid_points = study_lib.grid_points
extend_axes = study_lib.extend_axes


def best_point(axes, scores: dict) -> dict:
  """The grid point of highest mean validation accuracy (ties: first)."""
  return study_lib.best_point(axes, scores, higher_is_better=True)


# The order arms run in (`benchmarks.study`): the main arms together, then
# each other arm, group by group.
GROUPS = ("main", "competitor", "baseline", "ablation", "eps")


def study_arm(arm: Arm, paired: bool = True) -> study_lib.Arm:
  return study_lib.Arm(arm.name, arm.grid, arm.tune_from, arm.own_base,
                       arm.group == "main", paired)


def with_dependencies(registry: dict, names: Sequence[str]) -> list:
  """`names` with the arms they build on (adamw, whose choice every arm's
  non-Q/K AdamW is; the arm an ablation takes its choice from), in the
  registry's run order (GROUPS). Those join the study for their choice
  only: tuned if need be, not paired."""
  unknown = sorted(set(names) - set(registry))
  if unknown:
    raise ValueError(f"unknown arms {unknown}; known: {list(registry)}.")
  need, todo = set(), ["adamw", *names]
  while todo:
    a = todo.pop()
    if a not in need:
      need.add(a)
      todo += [registry[a].tune_from] if registry[a].tune_from else []
  return [a for g in GROUPS for a in registry
          if a in need and registry[a].group == g]


class Bench:
  """Data on device, jitted functions cached per (arm, hp, n), results."""

  def __init__(self, data: cifar_data.Dataset, cfg: Config, out: pathlib.Path,
               arms: Optional[dict] = None, inherit: Optional[dict] = None,
               inherit_from: Optional[str] = None):
    self.cfg, self.out, self.data = cfg, pathlib.Path(out), data
    self.arms = dict(arms or ARMS)
    # {arm: hp} chosen elsewhere (--hp-from): those arms are not re-tuned.
    self.inherit, self.inherit_from = dict(inherit or {}), inherit_from
    self.fp = fingerprint(cfg, data.source)
    self.store = harness.RunStore(out, indent=1)
    self.model = cfg.model.build()
    self._models = {False: self.model}
    mean, std = cifar_data.channel_stats(data.x_train)
    self.mean, self.std = jnp.asarray(mean), jnp.asarray(std)
    self.x = jnp.asarray(data.x_train)
    self.y = jnp.asarray(data.y_train.astype(np.int32))
    self.x_test = jnp.asarray(data.x_test)
    self.y_test = jnp.asarray(data.y_test.astype(np.int32))
    self.pool, self.val = validation_split(len(data.x_train), cfg)
    self.all_train = np.arange(len(data.x_train))
    self._accuracy = {}
    self._epoch_fns = {}
    self._records = {}   # name -> record read or written
    (self.out / "runs").mkdir(parents=True, exist_ok=True)

  # the study ---------------------------------------------------------------
  def study(self, sizes: Sequence[int] = (None,), main_seeds=(),
            other_seeds=(), arms: Optional[Sequence[str]] = None
            ) -> study_lib.Study:
    """The study of `arms` (default: every arm) and the arms they build on,
    the main ones at each of `sizes` (largest first), the others at the
    largest; tuned by mean validation accuracy (higher is better)."""
    asked = list(self.arms) if arms is None else list(arms)
    names = with_dependencies(self.arms, asked)
    return study_lib.Study(
        arms=tuple(study_arm(self.arms[a], a in asked) for a in names),
        tune_seeds=self.cfg.tune_seeds, main_seeds=tuple(main_seeds),
        other_seeds=tuple(other_seeds),
        sizes=tuple(sorted(sizes, key=lambda n: -1 if n is None else -n)),
        max_extensions=self.cfg.max_extensions, higher_is_better=True,
        fixed=tuple((a, dict(hp)) for a, hp in self.inherit.items()))

  def finished(self) -> study_lib.Finished:
    return study_lib.Finished(self.load, lambda r: r["val_acc"])

  def paired_task(self, arm: str, seed: int, n: int) -> Task:
    """The paired run of `arm` at (seed, n) at the arm's chosen point."""
    c = study_lib.choice(self.study(), self.finished(), arm)
    if c is None:
      raise RuntimeError(f"{arm}: tuning runs unfinished.")
    return Task(harness.seed_block(seed), arm, c[0], c[1], seed, n)

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
    if rec.get("hp") != dict(task.point) or (
        not self.own_base(task.arm) and rec.get("base") != dict(task.base)):
      return None
    return rec

  def own_base(self, arm: str) -> bool:
    """Whether the arm's hyperparameters set its non-Q/K AdamW (adamw and
    the whole-model AdamW recipes), rather than adamw's choice."""
    return arm == "adamw" or self.arms[arm].own_base

  # one run ----------------------------------------------------------------
  def epoch_fn(self, arm: Arm, hp: dict, base: dict, n: int):
    key = (arm.name, hp_key(hp), hp_key(base), n)
    if key not in self._epoch_fns:
      steps = (n // self.cfg.batch) * self.cfg.epochs
      tx = make_tx(arm, hp, base, steps, self.cfg)
      self._epoch_fns[key] = (tx, make_epoch_fn(self.model_of(arm), tx,
                                                self.mean, self.std))
    return self._epoch_fns[key]

  def model_of(self, arm: Arm) -> Transformer:
    if arm.qk_norm not in self._models:
      self._models[arm.qk_norm] = self.cfg.model.build(qk_norm=arm.qk_norm)
    return self._models[arm.qk_norm]

  def accuracy(self, arm: Arm):
    if arm.qk_norm not in self._accuracy:
      self._accuracy[arm.qk_norm] = make_eval_fn(self.model_of(arm), self.mean,
                                                 self.std)
    return self._accuracy[arm.qk_norm]

  def size(self, task: Task) -> int:
    """Training images: the tuning split's for a tuning run."""
    return len(self.pool) if task.stage == "tune" else task.size

  def execute(self, task: Task) -> dict:
    """Trains one paired run or one tuning point and writes its JSON."""
    done = self.load(task)
    if done is not None:
      return done
    arm, cfg = self.arms[task.arm], self.cfg
    tuning = task.stage == "tune"
    hp = dict(task.point)
    # adamw and the whole-model AdamW recipes set their own non-Q/K AdamW
    base = ({k: hp[k] for k in BASE_KEYS} if self.own_base(task.arm)
            else dict(task.base))
    n = self.size(task)
    pool = self.pool if tuning else self.all_train
    ex, ey = ((self.x[self.val], self.y[self.val]) if tuning
              else (self.x_test, self.y_test))
    t0 = time.time()
    idx = seed_stream(task.seed, pool, n, cfg)
    tx, epoch = self.epoch_fn(arm, hp, base, n)
    params = init_params(self.model_of(arm), arm, task.seed)
    start = params
    opt_state = tx.init(params)
    curve, losses = [], []
    for e in range(cfg.epochs):
      (params, opt_state), loss, _ = epoch(
          (params, opt_state), jnp.asarray(idx[e]), self.x, self.y)
      losses.append(float(loss))
      curve.append(float(self.accuracy(arm)(params, ex, ey)))
    iso = float(so.max_isometry_error(params, frames_of(arm.per_head)))
    move = so.frame_movement(start, params, frames_of(arm.per_head))
    rec = {
        "kind": "tune" if tuning else "run", "arm": task.arm,
        "seed": task.seed, "n": n,
        "hp": hp, "base": base, "fixed": dict(arm.fixed),
        "hp_from": (self.inherit_from if task.arm in self.inherit and not tuning
                    else None),
        "per_head": arm.per_head, "orthonormal_start": arm.orthonormal,
        ("val_acc" if tuning else "test_acc"): curve[-1],
        ("val_curve" if tuning else "test_curve"): curve,
        "train_loss": losses, "qk_isometry_error": iso,
        "qk_movement": float(sum(float(jnp.sum(m)) for m in move.values())),
        "wall_s": time.time() - t0, "data": self.data.source,
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
# The plan (`benchmarks.study`): most important results first.


def remaining(bench: Bench, study: study_lib.Study) -> list:
  """The study's unfinished runs, in order: the main arms' tuning (each
  grid extended until its best point is interior), their paired runs at
  each n (largest first), discovery seeds before confirmation seeds; then
  the competitors, the baseline, the ablations and the eps sweep at the
  largest n. It ends at the first tuning with runs left."""
  return study_lib.remaining(study, bench.finished())


def estimate(bench: Bench, study: study_lib.Study) -> dict:
  """The study's unfinished runs (every point of each tuning grid as far
  as it has widened, every paired run) and their expected wall seconds
  (`Bench.expected_s`)."""
  return study_lib.estimate(
      study_lib.remaining(study, bench.finished(), assume=True),
      bench.expected_s)


def estimate_text(est: dict) -> str:
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


def run_plan(bench: Bench, study: study_lib.Study, report_fn=None,
             time_budget: float = 0.0) -> int:
  """Runs the study's unfinished runs in order (`study_lib.run_tasks`: the
  plan asked anew after each run); report_fn() after each paired run.
  Returns the number of runs made."""
  def after(task, _):
    if task.stage != "tune" and report_fn:   # the tables so far
      report_fn()

  return study_lib.run_tasks(lambda: remaining(bench, study), bench.execute,
                             desc="cifar", describe=describe, after=after,
                             expected_s=bench.expected_s,
                             time_budget=time_budget)


# --------------------------------------------------------------------------
# Statistics, tables, plots.


def collect(out: pathlib.Path, data: Optional[str] = None,
            config: Optional[dict] = None) -> list:
  """The saved records of `out` made on `data` with `config` (default:
  each record's own, e.g. in the supplementary folders) under whatever
  library version each records; every record if data is None."""
  recs = harness.RunStore(out).records()
  if data is None:
    return recs
  return [r for r in recs if harness.matches(r, config, data)]


def accuracies(recs, arm: str, n: int, block: str = "discovery") -> dict:
  return {r["seed"]: 100.0 * r["test_acc"] for r in recs
          if r["kind"] == "run" and r["arm"] == arm and r["n"] == n
          and harness.seed_block(r["seed"]) == block}


def final_losses(recs, arm: str, n: int, block: str = "discovery") -> dict:
  """{seed: mean training loss of the last epoch}."""
  return {r["seed"]: r["train_loss"][-1] for r in recs
          if r["kind"] == "run" and r["arm"] == arm and r["n"] == n
          and harness.seed_block(r["seed"]) == block}


def comparison_rows(recs, pairs: Sequence[Mapping],
                    block: str = "discovery") -> list:
  """`stats.comparison_rows` of test accuracy (pp) over the seeds of `block`
  (discovery or confirmation) both arms finished at the comparison's
  size."""
  return stats.comparison_rows(
      pairs, lambda c, role: accuracies(recs, c[role], c["size"], block),
      lambda c, role: final_losses(recs, c[role], c["size"], block))


def compare(recs, treatment: str, baseline: str, n: int,
            block: str = "discovery") -> Optional[dict]:
  """The one comparison of treatment against baseline at n (None: no
  common seed)."""
  rows = comparison_rows(
      recs, [dict(treatment=treatment, baseline=baseline, size=n)], block)
  return rows[0] if rows else None


# What makes two rows of a comparison table the same comparison.
COMPARISON_KEY = ("treatment", "baseline", "size")


def comparisons(recs, block: str = "discovery") -> list:
  """At every n, each arm against adamw, then stiefel against each other
  arm (`study_lib.comparison_pairs`), where both ran; Holm-adjusted across
  them."""
  sizes = sorted({r["n"] for r in recs if r["kind"] == "run"})
  return comparison_rows(
      recs, [dict(treatment=t, baseline=b, size=n) for n in sizes
             for t, b in study_lib.comparison_pairs(list(ARMS))], block)


def chosen_table(recs) -> dict:
  """{arm: {hp: [mean val_acc, tuning seeds]}} from the tuning runs."""
  accs = {}
  for r in recs:
    if r["kind"] == "tune":
      accs.setdefault(r["arm"], {}).setdefault(hp_key(r["hp"]), []).append(
          r["val_acc"])
  return {a: {k: [float(np.mean(v)), len(v)] for k, v in g.items()}
          for a, g in accs.items()}


def markdown_table(rows) -> str:
  return "\n".join(harness.comparison_lines(rows, "acc %", size="n"))


# The paper's Stiefel - AdamW gains (pp) by training-set size.
PAPER_GAIN = {1000: 1.9, 10000: 6.79, 50000: 6.7}


def plot_gain_vs_n(rows, path: pathlib.Path) -> None:
  plt = harness.pyplot()
  sel = sorted((r for r in rows if r["treatment"] == "stiefel"
                and r["baseline"] == "adamw"), key=lambda r: r["size"])
  fig, ax = plt.subplots(figsize=(5, 3.5))
  if sel:
    ns = [r["size"] for r in sel]
    g = np.array([r["mean_diff"] for r in sel])
    lo = g - np.array([r["ci_low"] for r in sel])
    hi = np.array([r["ci_high"] for r in sel]) - g
    ax.errorbar(ns, g, yerr=[lo, hi], marker="o", capsize=4,
                label="ours: stiefel - adamw (95% CI)")
    ax.plot(list(PAPER_GAIN), list(PAPER_GAIN.values()), "x--", color="gray",
            label="paper (Guerrero 2026)")
    ax.set_xscale("log")
    ax.legend(loc="best", fontsize=8)
  ax.axhline(0, color="gray", lw=0.8)
  ax.set_xlabel("training images n")
  ax.set_ylabel("test accuracy gain (pp)")
  ax.set_title("Stiefel-Adam on Q/K vs AdamW, paired seeds")
  harness.save_figure(fig, path, dpi=120)


def plot_curves(recs, n: int, path: pathlib.Path) -> None:
  plt = harness.pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for k, arm in enumerate(ARMS):
    cs = [r["test_curve"] for r in recs
          if r["kind"] == "run" and r["arm"] == arm and r["n"] == n]
    if not cs:
      continue
    c = 100.0 * np.array(cs)
    ep = np.arange(1, c.shape[1] + 1)
    m, s = c.mean(0), c.std(0)
    color = plt.cm.tab20(2 * k % 20 + (2 * k // 20))
    ax.plot(ep, m, label=f"{arm} ({len(cs)})", color=color)
    ax.fill_between(ep, m - s, m + s, alpha=0.12, color=color)
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy % (mean ± sd over seeds)")
  ax.set_title(f"CIFAR-10 patch transformer, n = {n}")
  ax.legend(fontsize=7, ncol=2)
  harness.save_figure(fig, path, dpi=120)


def frame_summary(runs, key: str) -> dict:
  """{arm: mean of key} at the largest n: how far the Q/K frames moved
  from their start (Frobenius, summed over frames) and how orthonormal
  they ended."""
  if not runs:
    return {}
  n = max(r["n"] for r in runs)
  vals = {}
  for r in runs:
    if r["n"] == n:
      vals.setdefault(r["arm"], []).append(r[key])
  return {a: float(np.mean(v)) for a, v in vals.items()}


def report(out: pathlib.Path, data: Optional[str] = None,
           config: Optional[dict] = None, plots: bool = True) -> dict:
  """Writes summary.json, table.md and (plots) the PNGs from the finished
  runs (those of `collect(out, data, config)`)."""
  recs = collect(out, data, config)
  configs = {json.dumps(r["config"], sort_keys=True) for r in recs}
  if len(configs) > 1:
    raise ValueError(
        f"{harness.portable(out)} holds runs of {len(configs)} configurations;"
        " a report covers one. Move the others to their own folder, or run"
        " without --report-only to report the current configuration's runs:"
        f" {sorted(configs)}")
  rows = comparisons(recs)
  runs = [r for r in recs if r["kind"] == "run"]
  blocks = {}
  for r in runs:
    blocks.setdefault(harness.seed_block(r["seed"]), set()).add(r["seed"])
  summary = {
      "comparisons": rows, "paper_rows": paper_comparisons(recs),
      "confirmation": comparisons(recs, "confirmation"),
      "seeds": {b: harness.format_seeds(s) for b, s in sorted(blocks.items())},
      "tuning": chosen_table(recs),
      "chosen": {r["arm"]: r["hp"] for r in runs},
      "base": next((r.get("base", {"lr": r.get("base_lr")}) for r in runs
                    if r["arm"] != "adamw"), None),
      "qk_movement": frame_summary(runs, "qk_movement"),
      "qk_isometry_error": frame_summary(runs, "qk_isometry_error"),
      "runs": len(runs), "tuning_runs": len(recs) - len(runs),
      "run_wall_s": float(sum(r["wall_s"] for r in runs)),
      "tuning_wall_s": float(sum(r["wall_s"] for r in recs if r["kind"] == "tune")),
      "data": sorted({r["data"] for r in recs}),
      "library_version": sorted({r["library_version"] for r in recs}),
      "config": recs[0]["config"] if recs else None,
      "machine": sorted({harness.machine_line(r["machine"]) for r in recs}),
  }
  harness.write_json(out / "summary.json", summary, indent=1)
  harness.write_text(out / "table.md", markdown_table(rows) + "\n")
  if runs and plots:
    plot_gain_vs_n(rows, out / "gain_vs_n.png")
    plot_curves(recs, max(r["n"] for r in runs), out / "curves.png")
  return summary


# --------------------------------------------------------------------------
# benchmarks/RESULTS.md: our numbers beside the paper's.

# (label, treatment, baseline, n or None for the largest, paper's number)
PAPER_ROWS = (
    ("Stiefel-Adam - AdamW, largest n", "stiefel", "adamw", None,
     "+6.79 pp at n = 10k (12/12, t = 38.33); later version +8.98 pp (t = 60.6)"),
    ("Stiefel-Adam - AdamW, n = 4,000", "stiefel", "adamw", 4000,
     "(between +1.9 at 1k and +6.79 at 10k)"),
    ("Stiefel-Adam - AdamW, n = 1,000", "stiefel", "adamw", 1000, "+1.9 pp"),
    ("Stiefel-Adam - AdamW, n = 50,000", "stiefel", "adamw", 50000,
     "+6.7 pp"),
    ("RSGD - AdamW", "rsgd", "adamw", None, "+1.97 pp"),
    ("frozen orthonormal Q/K - AdamW", "frozen", "adamw", None, "+1.69 pp"),
    ("RSGD - frozen", "rsgd", "frozen", None, "+0.28 pp (freezing costs 0.28)"),
    ("Stiefel - per-coordinate v (scale-free step)", "stiefel",
     "per_coordinate_v", None, "+4.63 pp"),
    ("Stiefel - no projection", "stiefel", "no_projection", None,
     "nothing measurable"),
    ("Stiefel - no trust-region cap", "stiefel", "no_cap", None, "(not reported)"),
    ("Stiefel per head - one frame per projection", "stiefel", "whole_frame",
     None, "(equivariance: nothing measurable)"),
    ("Stiefel (eps 1e-8) - eps 1e-3", "stiefel", "eps_0.001", None, "(sweep)"),
    ("Stiefel (eps 1e-8) - eps 1e-2", "stiefel", "eps_0.01", None, "(sweep)"),
    ("Stiefel (eps 1e-8) - eps 0.1", "stiefel", "eps_0.1", None,
     "+2.6 pp (p < 0.001)"),
)


def paper_comparisons(recs) -> list:
  """compare() for each row of PAPER_ROWS (None where not run); n = None
  means the largest n both arms ran at."""
  out = []
  for _, t, b, n in ((r[0], r[1], r[2], r[3]) for r in PAPER_ROWS):
    if n is None:
      common = ({r["n"] for r in recs if r["kind"] == "run" and r["arm"] == t}
                & {r["n"] for r in recs if r["kind"] == "run" and r["arm"] == b})
      n = max(common) if common else None
    out.append(compare(recs, t, b, n) if n is not None else None)
  return stats.with_holm(out)


def _ours(r) -> str:
  if r is None:
    return "not run"
  t = harness.fmt_t(r["t"]) or "n/a"
  return (f"{harness.fmt_diff(r, 2, 'pp')} at n = {r['size']}, t = {t},"
          f" p = {harness.fmt_p(r['p'])}, Holm p = {harness.fmt_p(r['p_holm'])},"
          f" wins {r['wins']}/{r['n']}")


def paper_table(rows) -> str:
  return "\n".join(harness.markdown_table(
      ["comparison", "paper", "ours (mean gain, 95% CI, paired t,"
       " Holm-adjusted p across this table, wins)"], "lll",
      [[label, paper, _ours(r)]
       for (label, _, _, _, paper), r in zip(PAPER_ROWS, rows)]))


def supplementary_text(out: pathlib.Path, data: str) -> str:
  """The tables of runs kept in subfolders of out (other configurations,
  e.g. --dim 64 or --epochs 15 with --hp-from), each subfolder's report
  regenerated from its raw runs."""
  parts = []
  for sub in sorted(p for p in pathlib.Path(out).iterdir() if p.is_dir()):
    recs = [r for r in collect(sub, data=data) if r["kind"] == "run"]
    if not recs:
      continue
    sm = report(sub, data=data)
    src = sorted({str(r.get("hp_from")) for r in recs})
    parts.append(
        f"#### Supplementary `{sub.name}`\n\nConfiguration: `{json.dumps(sm['config'])}`;"
        f" hyperparameters from {', '.join(src)} (not re-tuned); chosen"
        f" {json.dumps(sm['chosen'])}; {sm['runs']} runs,"
        f" {sm['run_wall_s'] / 60:.1f} min.\n\n{markdown_table(sm['comparisons'])}\n")
  return "\n".join(parts)


def claims_text(summary: dict) -> str:
  """Which comparisons are findings under the claims policy."""
  seeds = summary.get("seeds", {})
  head = (f"**Claims status** (generated; see the claims policy). The tables"
          f" below are on the discovery seeds"
          f" ({seeds.get('discovery', 'none')}), with p-values Holm-adjusted"
          " across each table.")
  conf = summary.get("confirmation", [])
  if not conf:
    return (head + " No confirmation runs (seeds"
            f" {harness.format_seeds(harness.CONFIRMATION_SEEDS)}) are in this"
            " folder, so none of these comparisons is a finding yet.")
  found = stats.confirmed(summary["comparisons"], conf, COMPARISON_KEY)
  lines = [head + f" Confirmation seeds run: {seeds.get('confirmation')};"
           f" {len(found)} of {len(conf)} comparisons confirmed (Holm p < 0.05"
           " on the confirmation seeds, same sign as on discovery):"]
  lines += [f"- {harness.finding_text(r, 'pp', size='n')}" for r in found]
  lines += ["", "Confirmation runs, all comparisons:", "", markdown_table(conf)]
  return "\n".join(lines)


def section_text(summary: dict, out: pathlib.Path, data: str, notes: str = "",
                 md_dir: pathlib.Path = harness.RESULTS_MD.parent) -> str:
  """The section: notes verbatim, then what the raw runs give (the
  supplementary subfolders' reports regenerated too)."""
  cfg = summary["config"] or {}
  rel = pathlib.Path(os.path.relpath(pathlib.Path(out).resolve(),
                                     pathlib.Path(md_dir).resolve())).as_posix()
  hp = "\n".join(f"- `{a}`: {json.dumps(h)}" for a, h in
                 sorted(summary["chosen"].items()))
  grid = "\n".join(f"- `{a}`: " + ", ".join(
      f"{k} -> {100 * v:.2f}% ({c})"
      for k, (v, c) in ((k, v if isinstance(v, list) else [v, 1])
                        for k, v in g.items()))
                   for a, g in summary["tuning"].items())
  frames = "\n".join(
      f"- `{a}`: moved {m:.2f}, isometry error"
      f" {summary['qk_isometry_error'].get(a, float('nan')):.1e}"
      for a, m in summary.get("qk_movement", {}).items())
  return f"""{section_heading(out)}

{notes.strip()}

Data: {", ".join(summary["data"])}. Model and training: `{json.dumps(cfg)}`.
Library: stiefel_optax {", ".join(summary["library_version"])} (the version each
run file records; runs made since issue 12 also record the code's hash).
Machine: {"; ".join(summary["machine"])}. Finished runs: {summary["runs"]}
({summary["run_wall_s"] / 60:.1f} min of run time) plus {summary["tuning_runs"]}
tuning runs ({summary["tuning_wall_s"] / 60:.1f} min).

{claims_text(summary)}

### Ours beside the paper

{paper_table(summary["paper_rows"])}

### All paired comparisons (test accuracy, pp)

{markdown_table(summary["comparisons"])}

Validation accuracy of each tuning point (mean over the tuning seeds
{harness.format_seeds(cfg.get("tune_seeds", [cfg.get("tune_seed")]))} that have
finished, their count in brackets; trained on the training images minus the
{cfg.get("val_size")} validation images; a grid is widened past any edge
its best point falls on):

{grid}

Chosen (the AdamW arm's learning rate is also every arm's learning rate for
the non-Q/K parameters, with its weight decay: {json.dumps(summary["base"])}):

{hp}

Q/K frames at the largest n, mean over seeds: total distance moved from
the start, sum over frames of ||W_end - W_start||_F, and the final
max ||W^T W - I||_F:

{frames}

{supplementary_text(out, data)}
Plots: `{rel}/gain_vs_n.png` (gain against n with 95% intervals),
`{rel}/curves.png` (test accuracy per epoch per arm at the largest n).
Raw runs: `{rel}/runs/*.json`; summary: `{rel}/summary.json`.
"""


def write_section(path: pathlib.Path, summary: dict, out: pathlib.Path,
                  data: str) -> None:
  """The CIFAR section of the RESULTS.md at `path`: <out>/notes.md verbatim,
  then everything generated from the raw runs."""
  notes = harness.read_notes(pathlib.Path(out) / "notes.md")
  harness.write_section(path, section_heading(out), section_text(
      summary, out, data, notes, pathlib.Path(path).parent))


# --------------------------------------------------------------------------
# Command line.


def quick_config() -> Config:
  return Config(model=PatchViTConfig(dim=16, heads=2, depth=1, mlp_ratio=2),
                batch=32, epochs=2, val_size=64, tune_seeds=(1000,))


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.cifar_patches",
                              description=__doc__.split("\n\n")[0])
  harness.add_common_args(
      p, default_out_dir="runs/cifar (runs/cifar_quick with --quick)",
      seeds_default=harness.format_seeds(harness.DISCOVERY_SEEDS),
      quick_help="synthetic images, tiny model, two arms (< 1 minute)",
      seeds_help="seeds of the adamw and stiefel arms")
  harness.add_time_budget_arg(p)
  p.add_argument("--dry-run", action="store_true",
                 help="print the runs left and their expected time, then stop")
  p.add_argument("--other-seeds", type=harness.seeds_type, default=None,
                 help="seeds of the other arms (default"
                      f" {harness.format_seeds(harness.DISCOVERY_SEEDS[:6])})")
  p.add_argument("--data", "--data-dir", dest="data", default=None,
                 help="any CIFAR-10 source: the subset's .npz, the"
                      f" {cifar_data.FOLDER}/ folder or a folder holding it"
                      f" (default ${cifar_data.ENV_VAR}, else"
                      f" ../shared/data/{cifar_data.SUBSET_NAME})")
  p.add_argument("--download", action="store_true",
                 help="download the official tarball into the --data folder"
                      " if missing")
  p.add_argument("--sizes", type=int, nargs="*", default=None,
                 help="training-set sizes n (default 1000 4000 all)")
  p.add_argument("--arms", nargs="*", default=None,
                 help=f"subset of {list(ARMS)}; the arms they build on"
                      " (adamw, and the arm an ablation takes its choice"
                      " from) join them")
  p.add_argument("--epochs", type=int, default=None)
  p.add_argument("--dim", type=int, default=None, help="model width d")
  p.add_argument("--heads", type=int, default=None)
  p.add_argument("--depth", type=int, default=None)
  p.add_argument("--hp-from", type=pathlib.Path, default=None,
                 help="reuse the hyperparameters chosen in this results folder"
                      " (its summary.json) instead of tuning those arms")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.quick:
    cfg = quick_config()
    data = cifar_data.synthetic(448, cfg.val_size)
    sizes = args.sizes or [len(data.x_train) - cfg.val_size]
    arms = args.arms or ["adamw", "stiefel"]
    seeds, other_seeds = args.seeds or (0, 1), args.other_seeds or (0, 1)
    out = args.out or harness.default_out("cifar_quick")
    registry = {k: v._replace(grid=tuple((a, vals[:1]) for a, vals in v.grid)
                              if v.grid else v.grid)
                for k, v in ARMS.items()}
  else:
    cfg = Config()
    data = cifar_data.load_cifar10(args.data, download_missing=args.download)
    sizes = args.sizes or [1000, 4000, len(data.x_train)]
    arms = args.arms or list(ARMS)
    seeds = args.seeds or harness.DISCOVERY_SEEDS
    other_seeds = args.other_seeds or harness.DISCOVERY_SEEDS[:6]
    out = args.out or harness.default_out("cifar")
    registry = ARMS
  if args.epochs:
    cfg = dataclasses.replace(cfg, epochs=args.epochs)
  model = {k: v for k, v in (("dim", args.dim), ("heads", args.heads),
                             ("depth", args.depth)) if v}
  if model:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
  inherit = None
  if args.hp_from:
    inherit = json.loads((args.hp_from / "summary.json").read_text())["chosen"]
  bench = Bench(data, cfg, out, registry, inherit,
                harness.portable(args.hp_from) if args.hp_from else None)
  if not args.report_only:
    study = bench.study(sizes, seeds, other_seeds, arms)
    print(f"data {data.source} ({data.location or 'in memory'}); identity"
          f" {bench.fp}; out {out}", flush=True)
    print(estimate_text(estimate(bench, study)), flush=True)
    if args.dry_run:
      return {}
    t0 = time.time()
    run_plan(bench, study, lambda: report(out, data.source, cfg.to_dict(),
                                          plots=False), args.time_budget)
    print(f"sweep wall time {time.time() - t0:.0f}s", flush=True)
  # --report-only reports the folder's runs under their own configuration
  # (a reference folder holds one: the tiny protocol's, the main one's).
  summary = report(out, data.source, None if args.report_only else cfg.to_dict())
  if args.results_md:
    write_section(args.results_md, summary, out, data.source)
  print(f"results: {out}")
  return summary


if __name__ == "__main__":
  main()
