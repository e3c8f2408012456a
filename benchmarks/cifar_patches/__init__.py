r"""CIFAR-10 patch benchmark: Stiefel-Adam on the attention Q/K kernels
against AdamW, with data scaling, baselines and ablations (paired seeds).

    python -m benchmarks.cifar_patches            # the full protocol, resumable
    python -m benchmarks.cifar_patches --quick    # synthetic images, < 1 minute
    python -m benchmarks.cifar_patches --data PATH --arms adamw stiefel rsgd \
        --out DIR                                 # the main arms only
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
library numerics version: `benchmarks.harness`) is unchanged. The protocol's
seeds are the defaults: the main arms (adamw, stiefel, rsgd) at discovery
seeds 0-7 and confirmation seeds 500-507 at every n, the other arms at 0-5
and 500-505 at the largest n, all fixed before any run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness, study as study_lib, training
from benchmarks.cifar_patches import data as cifar_data
from benchmarks.models import PatchViTConfig, Transformer
from benchmarks.reports import cifar as report_lib

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
  """optax.contrib.muon on each head's (d, head_dim) view, unconstrained
  (`training.per_head_muon`, the LM's muon too)."""
  return training.per_head_muon(lr, weight_decay)


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
  """The registry of arms (the study runs them group by group, in GROUPS
  order: `study_arms`). Every tuned
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
  """jit(params, x, y) -> accuracy on the images x (uint8) and labels y."""
  @jax.jit
  def accuracy(params, x, y):
    logits = model.apply({"params": params}, normalize(x, mean, std))
    return training.loss_and_accuracy(logits, y)[1]
  return accuracy


Task = study_lib.Task


def run_name(task: Task) -> str:
  """A run's file name: tune__<arm>__<point>__s<seed> for a tuning run,
  <arm>__n<n>__s<seed> for a paired run."""
  if task.stage == "tune":
    return f"tune__{task.arm}__{study_lib.point_key(task.point)}__s{task.seed}"
  return f"{task.arm}__n{task.size}__s{task.seed}"


# --------------------------------------------------------------------------
# The study (`benchmarks.study`): which arms, tuned and paired how.

# The order arms run in: the main arms together, then
# each other arm, group by group.
GROUPS = ("main", "competitor", "baseline", "ablation", "eps")
# The protocol's paired seeds (issue 12), fixed before any run: 8 + 8 for
# the main arms, 6 + 6 for the others.
MAIN_SEEDS = harness.DISCOVERY_SEEDS[:8] + harness.CONFIRMATION_SEEDS[:8]
OTHER_SEEDS = harness.DISCOVERY_SEEDS[:6] + harness.CONFIRMATION_SEEDS[:6]


def families(registry: dict) -> list:
  """The report's families of comparisons, one per group of arms (GROUPS),
  fixed here before any run: each its own table, Holm correction and
  confirmation stage, so that arms added later never change the main
  arms' findings."""
  return [(g, [a for a in registry if registry[a].group == g])
          for g in GROUPS if any(registry[a].group == g for a in registry)]


def study_arms(registry: dict) -> tuple:
  """The registry's arms as the study plans them, in run order (GROUPS)."""
  return tuple(study_lib.Arm(a.name, a.grid, a.tune_from, a.own_base,
                             a.group == "main")
               for g in GROUPS for a in registry.values() if a.group == g)


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
    return study_lib.Study(
        arms=study_lib.with_dependencies(study_arms(self.arms), asked),
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
    own = study_lib.sets_own_base(self.arms[task.arm])
    if rec.get("hp") != dict(task.point) or (
        not own and rec.get("base") != dict(task.base)):
      return None
    return rec

  # one run ----------------------------------------------------------------
  def epoch_fn(self, arm: Arm, hp: dict, base: dict, n: int):
    key = (arm.name, study_lib.point_key(hp), study_lib.point_key(base), n)
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
    own = study_lib.sets_own_base(self.arms[task.arm])
    base = {k: hp[k] for k in BASE_KEYS} if own else dict(task.base)
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
      seeds_default=harness.format_seeds(MAIN_SEEDS),
      quick_help="synthetic images, tiny model, two arms (< 1 minute)",
      seeds_help="seeds of the main arms (adamw, stiefel, rsgd)")
  harness.add_time_budget_arg(p)
  p.add_argument("--dry-run", action="store_true",
                 help="print the runs left and their expected time, then stop")
  p.add_argument("--other-seeds", type=harness.seeds_type, default=None,
                 help="seeds of the other arms (default"
                      f" {harness.format_seeds(OTHER_SEEDS)})")
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
    seeds = args.seeds or MAIN_SEEDS
    other_seeds = args.other_seeds or OTHER_SEEDS
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
    study, runs = bench.study(sizes, seeds, other_seeds, arms), bench.finished()
    print(f"data {data.source} ({data.location or 'in memory'}); identity"
          f" {bench.fp}; out {out}", flush=True)
    print(estimate_text(study_lib.estimate(
        study_lib.remaining(study, runs, assume=True), bench.expected_s)),
          flush=True)
    if args.dry_run:
      return {}
    t0 = time.time()
    study_lib.run_study(   # the plan asked anew after each run
        lambda: study_lib.remaining(study, runs), bench.execute,
        on_paired=lambda: report_lib.report(   # the tables so far
            out, families(ARMS), data.source, cfg.to_dict(), plots=False),
        desc="cifar", describe=describe, expected_s=bench.expected_s,
        time_budget=args.time_budget)
    print(f"sweep wall time {time.time() - t0:.0f}s", flush=True)
  # --report-only reports the folder's runs under their own configuration
  # (a reference folder holds one: the tiny protocol's, the main one's).
  summary = report_lib.report(out, families(ARMS), data.source,
                              None if args.report_only else cfg.to_dict())
  if args.results_md:
    report_lib.write_section(args.results_md, summary, out, families(ARMS),
                             data.source)
  print(f"results: {out}")
  return summary

