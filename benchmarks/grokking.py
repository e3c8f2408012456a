"""Modular-arithmetic grokking: AdamW against Stiefel attention, paired seeds.

    python -m benchmarks.grokking            # reduced default, a few minutes
    python -m benchmarks.grokking --full     # the longer study, resumable
    python -m benchmarks.grokking --quick    # a smoke run, under a minute
    python -m benchmarks.grokking --report-only --results-md benchmarks/RESULTS.md
                                             # the committed tables and section

Task: (a op b) mod p (p = 97) from the tokens [a, b, =], a seeded share of all
equations for training, the rest for validation, full-batch training.
Model: `benchmarks.models.Transformer` (flax.linen attention), one layer,
no LayerNorm, ReLU MLP, read out at the last token.
Arms (same data split, same initialisation of every non-Q/K weight, same
full-batch order for a seed):

  adamw    every weight on AdamW, weight decay 1.0.
  stiefel  the Q/K kernels' per-head frames orthonormalised at the start and
           trained by `stiefel_optax.stiefel_attention`; the rest AdamW, wd 1.0.
  rsgd     (mechanism probe only) Q/K frames on fixed-step `riemannian_sgd`.

Every `log_every` steps each run records train/validation accuracy and loss,
the isometry error ||W^T W - I||_F of every Q/K frame (the AdamW arm's raw
kernels, per head), the Frobenius norm of every other weight, and the mean
per-step movement ||W_{t+1} - W_t||_F of each Q/K frame over the chunk.
Runs are saved per (arm, seed) with a checkpoint, so a stopped study resumes;
a saved run is reused only under the same identity (configuration, the
equations' md5, library version: `benchmarks.harness`). Output goes to
runs/grokking/<default|full|quick>/ (ignored by git) unless `--out` names a
folder, e.g. one of the committed reference folders under
benchmarks/results/grokking/. Each folder holds study.json (what was asked),
runs/, an optional notes.md (included verbatim) and the generated
results.json, table.md and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness, models, modular, stats, study as study_lib
from benchmarks import training

ARMS = ("adamw", "stiefel")
PROBE_ARM = "rsgd"
REFERENCE_DIR = harness.REFERENCE_ROOT / "grokking"
SECTION = "## Grokking"
SECTION_TEMPLATE = REFERENCE_DIR / "section.md"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run (with the data's md5 and the library
  version, its identity)."""
  p: int = modular.DEFAULT_PRIME
  op: str = "+"
  train_fraction: float = 0.5
  d_model: int = 32
  num_heads: int = 4
  d_mlp: int = 128
  num_layers: int = 1
  learning_rate: float = 1e-3
  stiefel_learning_rate: Optional[float] = None   # None: learning_rate
  weight_decay: float = 1.0
  b1: float = 0.9
  b2: float = 0.98
  max_step_norm: float = 0.1
  rsgd_learning_rate: float = 0.1
  log_every: int = 50
  target_acc: float = 0.95


@dataclasses.dataclass(frozen=True)
class Study:
  """Which runs: `seeds` x arms to `steps`; `long_seed` continued to
  `long_steps` (0: none); the rsgd probe for `probe_steps` on each seed."""
  steps: int
  seeds: tuple
  long_steps: int = 0
  long_seed: int = 0
  probe_steps: int = 0
  arms: tuple = ARMS


  @classmethod
  def from_dict(cls, d: dict) -> "Study":
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in d.items()})


DEFAULT_STUDY = Study(steps=1000, seeds=(0, 1, 2, 3, 4), probe_steps=200)
FULL_STUDY = Study(steps=3000, seeds=(0, 1, 2, 3, 4), long_steps=20000,
                   probe_steps=500)
QUICK_STUDY = Study(steps=100, seeds=(0, 1), probe_steps=50)
QUICK_CONFIG = dict(p=23, d_model=16, num_heads=2, d_mlp=64, log_every=25)


# --------------------------------------------------------------------------
# Model, data, optimizers.


def make_model(cfg: Config) -> models.Transformer:
  """The answer's logits from the tokens [a, b, =] (models' defaults: no
  LayerNorm, no attention or readout bias, ReLU, last-token readout)."""
  return models.Transformer(models.TransformerConfig(
      vocab_size=modular.vocab_size(cfg.p), seq_len=3, num_classes=cfg.p,
      d_model=cfg.d_model, num_heads=cfg.num_heads, d_mlp=cfg.d_mlp,
      depth=cfg.num_layers))


def loss_and_accuracy(model: models.Transformer, params, tokens, labels):
  """Mean cross-entropy on the answer token, and accuracy."""
  logits = model.apply({"params": params}, tokens)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()
  acc = jnp.mean(jnp.argmax(logits, -1) == labels)
  return loss, acc


@functools.lru_cache(maxsize=None)
def data_id(p: int, op: str) -> str:
  """The task's content id: md5 of every equation and its label."""
  return f"modular:md5={harness.md5_arrays(*modular.all_equations(p, op))}"


def run_identity(cfg: Config) -> str:
  return harness.identity(dataclasses.asdict(cfg), data_id(cfg.p, cfg.op))


def make_data(cfg: Config, seed: int) -> modular.Split:
  """The seed's split as device arrays (the same for every arm)."""
  sp = modular.make_split(cfg.p, cfg.op, cfg.train_fraction, seed)
  return modular.Split(*(jnp.asarray(a) for a in sp))


def initial_params(cfg: Config, arm: str, seed: int):
  """The seed's initialisation; Stiefel arms replace each Q/K head by its
  nearest orthonormal frame (polar factor), every other weight identical."""
  params = models.init_params(make_model(cfg), jax.random.PRNGKey(seed))
  return params if arm == "adamw" else so.orthonormalize(params)


def make_optimizer(cfg: Config, arm: str) -> optax.GradientTransformation:
  adamw = optax.adamw(cfg.learning_rate, cfg.b1, cfg.b2,
                      weight_decay=cfg.weight_decay)
  if arm == "adamw":
    return adamw
  if arm == "stiefel":
    return so.stiefel_attention(
        cfg.learning_rate, stiefel_learning_rate=cfg.stiefel_learning_rate,
        weight_decay=cfg.weight_decay, b1=cfg.b1, b2=cfg.b2,
        max_step_norm=cfg.max_step_norm)
  if arm == PROBE_ARM:
    return so.stiefel_attention(
        cfg.learning_rate, stiefel_tx=so.riemannian_sgd(cfg.rsgd_learning_rate),
        euclidean_tx=adamw)
  raise ValueError(f"arm must be one of {ARMS + (PROBE_ARM,)}; got {arm!r}.")


# --------------------------------------------------------------------------
# Training: jit over a chunk of `log_every` steps (lax.scan).


def other_norms(params) -> dict:
  """{path: ||x||_F} for every weight that is not a Q/K kernel."""
  frames = so.selected(params)
  return {so.path_str(p): jnp.linalg.norm(x.ravel())
          for p, x in jax.tree_util.tree_leaves_with_path(params)
          if so.path_str(p) not in frames}


@functools.lru_cache(maxsize=None)
def chunk_fn(cfg: Config, arm: str):
  """jit(carry, None, train_x, train_y) -> (carry, mean loss, mean Q/K
  movement): `log_every` full-batch steps of `training.train_chunk`."""
  model, tx = make_model(cfg), make_optimizer(cfg, arm)
  loss = lambda p, x, y: loss_and_accuracy(model, p, x, y)[0]
  return jax.jit(training.train_chunk(loss, tx, lambda _, x, y: (x, y),
                                      aux_fn=so.frame_movement,
                                      length=cfg.log_every))


@functools.lru_cache(maxsize=None)
def measure_fn(cfg: Config):
  """jit(params, data) -> accuracies, losses, isometry errors, norms."""
  model = make_model(cfg)

  def measure(params, data):
    tl, ta = loss_and_accuracy(model, params, data.train_x, data.train_y)
    vl, va = loss_and_accuracy(model, params, data.val_x, data.val_y)
    return dict(train_loss=tl, train_acc=ta, val_loss=vl, val_acc=va,
                iso=so.frame_isometry_errors(params),
                norms=other_norms(params))

  return jax.jit(measure)


def empty_history() -> dict:
  return {k: [] for k in ("step", "train_loss", "train_acc", "val_loss",
                          "val_acc", "iso", "norms", "move")}


def record(hist: dict, step: int, m: dict, move: Optional[dict]) -> None:
  """Appends one measurement (arrays as lists) to the history."""
  m = jax.tree.map(lambda x: np.asarray(x).tolist(), m)
  hist["step"].append(step)
  for k in ("train_loss", "train_acc", "val_loss", "val_acc", "iso", "norms"):
    hist[k].append(m[k])
  hist["move"].append(None if move is None else
                      jax.tree.map(lambda x: np.asarray(x).tolist(), move))


# --------------------------------------------------------------------------
# One run, saved and resumable.


def run_name(arm: str, seed: int) -> str:
  return f"{arm}_seed{seed}"


def train_run(cfg: Config, arm: str, seed: int, steps: int,
              out: Optional[Path] = None, progress=None,
              save_every_s: float = 60.0, command: str = "") -> dict:
  """Trains (arm, seed) to `steps` (a multiple of cfg.log_every), resuming
  from `out`'s saved run of the same identity if there is one (a finished
  one is returned as it is); returns the run's record."""
  if steps % cfg.log_every:
    raise ValueError(f"steps = {steps} is not a multiple of log_every ="
                     f" {cfg.log_every}.")
  store = harness.RunStore(out) if out is not None else None
  name, ident = run_name(arm, seed), run_identity(cfg)
  saved = store.load(name, ident) if store is not None else None
  if saved is not None and saved["history"]["step"][-1] >= steps:
    if progress is not None:
      progress.update(steps)
    return saved
  ckpt = store.path(name, ".npz") if store is not None else None
  data = make_data(cfg, seed)
  params = initial_params(cfg, arm, seed)
  carry = (params, make_optimizer(cfg, arm).init(params))
  run = dict(arm=arm, seed=seed, config=dataclasses.asdict(cfg),
             identity=ident, data=data_id(cfg.p, cfg.op),
             **harness.versions(),
             machine=harness.machine(), trained_by=[],
             n_train=int(data.train_x.shape[0]), n_val=int(data.val_x.shape[0]),
             wall_s=0.0, cpu_s=0.0, history=empty_history())
  if saved is not None and ckpt.exists():
    run = saved
    carry = training.load_carry(ckpt, carry)
  hist = run["history"]
  if not hist["step"]:
    record(hist, 0, measure_fn(cfg)(carry[0], data), None)
  done = hist["step"][-1]
  run.setdefault("trained_by", []).append(dict(
      command=command, started_utc=harness.now_utc(), from_step=done,
      loadavg_start=harness.load_average(), code_hash=harness.code_hash()))
  if progress is not None:
    progress.update(min(done, steps))
  chunk, measure = chunk_fn(cfg, arm), measure_fn(cfg)
  t0, last_save, c0 = time.time(), time.time(), time.process_time()
  while done < steps:
    carry, _, move = chunk(carry, None, data.train_x, data.train_y)
    done += cfg.log_every
    record(hist, done, measure(carry[0], data), move)
    if progress is not None:
      progress.update(cfg.log_every)
    if store is not None and (time.time() - last_save > save_every_s
                              or done >= steps):
      run["wall_s"] += time.time() - t0
      run["cpu_s"] = run.get("cpu_s", 0.0) + time.process_time() - c0
      t0 = last_save = time.time()
      c0 = time.process_time()
      training.save_carry(ckpt, carry)
      store.save(name, run)
  if store is None:   # saved runs were timed at their last save
    run["wall_s"] += time.time() - t0
    run["cpu_s"] = run.get("cpu_s", 0.0) + time.process_time() - c0
  return run


def load_run(cfg: Config, arm: str, seed: int, out: Path,
             runs_from: Sequence[str] = ()) -> Optional[dict]:
  """The saved (possibly partial) run of this configuration under any
  library version (what a report shows), from out or else from the folders
  `runs_from` (relative to out), or None."""
  for folder in [out] + [out / r for r in runs_from]:
    run = harness.RunStore(folder).load_matching(
        run_name(arm, seed), dataclasses.asdict(cfg), data_id(cfg.p, cfg.op))
    if run is not None:
      return run
  return None


def truncate(run: dict, steps: int) -> dict:
  """The run's record up to `steps` (the long run's prefix in the study)."""
  n = sum(1 for s in run["history"]["step"] if s <= steps)
  hist = {k: v[:n] for k, v in run["history"].items()}
  return dict(run, history=hist)


# --------------------------------------------------------------------------
# Per-run summaries.


def steps_to_target(hist: dict, target: float,
                    key: str = "val_acc") -> Optional[int]:
  """First logged step with validation (or `key`) accuracy >= target
  (None: never)."""
  for s, a in zip(hist["step"], hist[key]):
    if a >= target:
      return s
  return None


def min_after(hist: dict, step: Optional[int]) -> Optional[float]:
  """Lowest validation accuracy from `step` on (None if step is None)."""
  if step is None:
    return None
  return min(a for s, a in zip(hist["step"], hist["val_acc"]) if s >= step)


def mean_frames(per_path: dict) -> float:
  """Mean over every Q/K frame (all kernels, all heads) of one record."""
  vals = np.concatenate([np.ravel(v) for v in per_path.values()])
  return float(vals.mean())


def iso_curve(hist: dict) -> np.ndarray:
  return np.array([mean_frames(r) for r in hist["iso"]])


def move_curve(hist: dict) -> np.ndarray:
  """Mean per-step Q/K frame movement of each chunk (step 0 has none)."""
  return np.array([mean_frames(r) for r in hist["move"] if r is not None])


def other_norm_curve(hist: dict) -> np.ndarray:
  """sqrt(sum of squared norms) of every non-Q/K weight, per record."""
  return np.array([math.sqrt(sum(v * v for v in r.values()))
                   for r in hist["norms"]])


def run_summary(run: dict, target: float) -> dict:
  h = run["history"]
  hit = steps_to_target(h, target)
  return dict(arm=run["arm"], seed=run["seed"], steps=h["step"][-1],
              steps_to_target=hit,
              steps_to_train_target=steps_to_target(h, target, "train_acc"),
              final_val_acc=h["val_acc"][-1],
              final_train_acc=h["train_acc"][-1],
              max_val_acc=max(h["val_acc"]), min_val_acc_after=min_after(h, hit),
              mean_iso=float(iso_curve(h)[1:].mean()),
              mean_move=float(move_curve(h).mean()),
              final_other_norm=float(other_norm_curve(h)[-1]),
              wall_s=run["wall_s"])


# --------------------------------------------------------------------------
# Statistics over seeds.


fmt_p = harness.fmt_p


def censored(values: Sequence[Optional[int]], ceiling: int) -> list:
  """Never-reached (None) counted at the ceiling: a lower bound."""
  return [ceiling if v is None else v for v in values]


def compare_arms(summaries: dict, steps: int) -> dict:
  """Paired (stiefel vs adamw) tests over the seeds both arms ran."""
  a, s = summaries["adamw"], summaries["stiefel"]
  seeds = sorted(set(a) & set(s))
  a, s = [a[k] for k in seeds], [s[k] for k in seeds]
  hit_a = [r["steps_to_target"] for r in a]
  hit_s = [r["steps_to_target"] for r in s]
  ceil = steps + 1
  out = dict(seeds=seeds, ceiling=ceil, n_never_adamw=hit_a.count(None),
             n_never_stiefel=hit_s.count(None))
  by_seed = lambda values: dict(zip(seeds, values))
  # wins: the seeds where stiefel is better (fewer steps; higher accuracy)
  out["steps_to_target"] = stats.paired_row(
      by_seed(censored(hit_s, ceil)), by_seed(censored(hit_a, ceil)),
      lower_is_better=True)
  out["final_val_acc"] = stats.paired_row(
      by_seed([r["final_val_acc"] for r in s]),
      by_seed([r["final_val_acc"] for r in a]))
  out["min_val_acc_after"] = stats.unpaired_comparison(
      [r["min_val_acc_after"] for r in s if r["min_val_acc_after"] is not None],
      [r["min_val_acc_after"] for r in a if r["min_val_acc_after"] is not None])
  # Holm across the table's three comparisons (paired t, paired t, Welch).
  tests = ("steps_to_target", "final_val_acc", "min_val_acc_after")
  for k, h in zip(tests, stats.holm([out[k].get("p", float("nan"))
                                     for k in tests])):
    out[k]["holm"] = h
  return out


def winner(comp: dict) -> str:
  """Plain sentence: which arm groks first, and final accuracy."""
  st, fv = comp["steps_to_target"], comp["final_val_acc"]
  n = st["n"]
  if comp["n_never_adamw"] == comp["n_never_stiefel"] == n:
    return (f"Neither arm reached the target in any of {n} seeds: no"
            " grokking winner.")
  if st["mean_diff"] == 0:
    faster = "neither arm"
  else:
    faster = "stiefel" if st["mean_diff"] < 0 else "adamw"
  sig = ("significant at 0.05 after Holm" if st["holm"] < 0.05
         else "not significant at 0.05 after Holm")
  higher = ("stiefel" if fv["mean_diff"] > 0 else
            "adamw" if fv["mean_diff"] < 0 else "neither arm")
  return (f"Grokking speed: {faster} ahead on the mean ({sig}; mean"
          f" difference stiefel - adamw {st['mean_diff']:+.0f} steps, paired"
          f" t p = {fmt_p(st['p'])}, Holm p = {fmt_p(st['holm'])}); stiefel"
          f" first in {st['wins']}, adamw first in {st['losses']}, tied in"
          f" {st['ties']} of {n} seeds. Final validation accuracy: {higher}"
          f" higher on the mean ({fv['mean_diff']:+.4f}, paired t p ="
          f" {fmt_p(fv['p'])}, Holm p = {fmt_p(fv['holm'])}); stiefel"
          f" higher in {fv['wins']}, adamw higher in {fv['losses']}, tied in"
          f" {fv['ties']} of {fv['n']} seeds.")


def iso_ratio(runs_a: list, runs_s: list) -> dict:
  """adamw / stiefel mean Q/K isometry error at each common logged step
  after step 0 (seeds averaged per arm): geometric mean, min and max."""
  n = min(len(r["history"]["step"]) for r in runs_a + runs_s)
  ia = np.mean([iso_curve(r["history"])[:n] for r in runs_a], 0)
  is_ = np.mean([iso_curve(r["history"])[:n] for r in runs_s], 0)
  ratio = ia[1:] / np.maximum(is_[1:], np.finfo(np.float32).tiny)
  return dict(geomean=float(np.exp(np.log(ratio).mean())),
              min=float(ratio.min()), max=float(ratio.max()),
              adamw_mean=float(ia[1:].mean()), stiefel_mean=float(is_[1:].mean()),
              stiefel_max=float(is_[1:].max()), steps=int(runs_a[0]["history"]["step"][n - 1]))


def movement_ratios(runs: dict, probe: dict, probe_steps: int) -> dict:
  """Per-step Q/K frame movement over the first `probe_steps` steps of each
  seed, adamw / rsgd and adamw / stiefel: the ratio of the window means per
  seed, and the ratio chunk by chunk (median and range over chunks and
  seeds; fixed-step SGD moves in proportion to the gradient, which changes
  by orders of magnitude within the window)."""
  out = {}
  for other, src in (("rsgd", probe), ("stiefel", runs["stiefel"])):
    per_seed, chunks = {}, []
    for seed, r in src.items():
      if seed not in runs["adamw"]:
        continue
      n = probe_steps // r["config"]["log_every"]
      ma = move_curve(runs["adamw"][seed]["history"])[:n]
      mo = move_curve(r["history"])[:n]
      chunks += list(ma / mo)
      per_seed[seed] = dict(adamw=float(ma.mean()), other=float(mo.mean()),
                            ratio=float(ma.mean() / mo.mean()))
    if per_seed:
      rat = [v["ratio"] for v in per_seed.values()]
      out[f"adamw_over_{other}"] = dict(
          per_seed=per_seed, mean=float(np.mean(rat)), min=float(min(rat)),
          max=float(max(rat)), chunk_median=float(np.median(chunks)),
          chunk_min=float(min(chunks)), chunk_max=float(max(chunks)),
          steps=probe_steps)
  return out


# --------------------------------------------------------------------------
# Reports: JSON, markdown, plots.


def _fmt(xs: Sequence, fmt: str = "{:.4f}") -> str:
  xs = [x for x in xs if x is not None]
  if not xs:
    return "n/a"
  m = fmt.format(float(np.mean(xs)))
  return m if len(xs) < 2 else f"{m} ± {fmt.format(float(np.std(xs, ddof=1)))}"


def study_table(summaries: dict, comp: dict, target: float) -> str:
  a = [summaries["adamw"][k] for k in comp["seeds"]]
  s = [summaries["stiefel"][k] for k in comp["seeds"]]
  st, fv, mn = (comp["steps_to_target"], comp["final_val_acc"],
                comp["min_val_acc_after"])
  pct = int(round(100 * target))
  ceil = comp["ceiling"]
  col = lambda runs, key, fmt="{:.4f}": _fmt([r[key] for r in runs], fmt)
  steps = lambda runs: _fmt(censored([r["steps_to_target"] for r in runs],
                                     ceil), "{:.0f}")
  return "\n".join(harness.markdown_table(
      ["metric (mean ± sd over seeds)", "adamw", "stiefel", "stiefel − adamw",
       "test (Holm: adjusted across the table's three tests)",
       "seeds stiefel better / adamw better"], "llllll",
      [[f"steps to {pct}% val acc (never reached: counted as {ceil})",
        f"{steps(a)} (never {comp['n_never_adamw']})",
        f"{steps(s)} (never {comp['n_never_stiefel']})",
        f"{st['mean_diff']:+.0f}",
        f"paired t p = {fmt_p(st['p'])} (Holm {fmt_p(st['holm'])}), Wilcoxon"
        f" p = {fmt_p(st['wilcoxon_p'])}", f"{st['wins']} / {st['losses']}"],
       [f"steps to {pct}% train acc (memorisation)",
        col(a, "steps_to_train_target", "{:.0f}"),
        col(s, "steps_to_train_target", "{:.0f}"), "", "", ""],
       ["final val acc", col(a, "final_val_acc"), col(s, "final_val_acc"),
        f"{fv['mean_diff']:+.4f}",
        f"paired t p = {fmt_p(fv['p'])} (Holm {fmt_p(fv['holm'])})",
        f"{fv['wins']} / {fv['losses']}"],
       [f"min val acc after reaching {pct}%", col(a, "min_val_acc_after"),
        col(s, "min_val_acc_after"), "",
        f"Welch p = {fmt_p(mn.get('p', float('nan')))} (Holm"
        f" {fmt_p(mn['holm'])})",
        ""],
       ["final train acc", col(a, "final_train_acc"),
        col(s, "final_train_acc"), "", "", ""],
       ["mean Q/K isometry error (per frame)", col(a, "mean_iso", "{:.3g}"),
        col(s, "mean_iso", "{:.3g}"), "", "", ""],
       ["mean per-step Q/K movement (per frame)",
        col(a, "mean_move", "{:.3g}"), col(s, "mean_move", "{:.3g}"), "", "",
        ""],
       ["final norm of all non-Q/K weights",
        col(a, "final_other_norm", "{:.2f}"),
        col(s, "final_other_norm", "{:.2f}"), "", "", ""]]))


def mechanism_table(iso: dict, moves: dict, log_every: int) -> str:
  rows = []
  for key, label in (("adamw_over_rsgd", "riemannian_sgd"),
                     ("adamw_over_stiefel", "stiefel_adam")):
    if key in moves:
      m = moves[key]
      rows.append([
          f"per-step Q/K movement, AdamW / {label}, first {m['steps']}"
          f" steps: ratio of window means (per-seed range); per"
          f" {log_every}-step chunk median (range)",
          f"{m['mean']:.1f}x ({m['min']:.1f}–{m['max']:.1f}x);"
          f" {m['chunk_median']:.1f}x"
          f" ({m['chunk_min']:.2g}–{m['chunk_max']:.3g}x)",
          "24–40x (CIFAR, riemannian_sgd)" if label == "riemannian_sgd"
          else "—"])
  rows.append(["Q/K isometry error, AdamW / Stiefel through training"
               " (geometric mean over logged steps, range)",
               f"{iso['geomean']:.3g} ({iso['min']:.3g}–{iso['max']:.3g})",
               "~1e6"])
  rows.append(["Stiefel arm's largest mean isometry error",
               f"{iso['stiefel_max']:.3g}", ""])
  return "\n".join(harness.markdown_table(
      ["mechanism number", "measured", "paper"], "lll", rows))


def long_table(long_runs: dict, target: float, iso: Optional[dict]) -> str:
  rows = []
  for arm, run in long_runs.items():
    h = run["history"]
    hit = steps_to_target(h, target)
    below = (sum(1 for s, a in zip(h["step"], h["val_acc"])
                 if s >= hit and a < 0.9) if hit is not None else None)
    mn = min_after(h, hit)
    after = [i for i, s in enumerate(h["step"]) if hit is not None and s >= hit]
    norms = other_norm_curve(h)
    spread = (f"{norms[after].min():.2f}–{norms[after].max():.2f}"
              if after else "n/a")
    max_loss = (f"{max(h['train_loss'][i] for i in after):.2g}"
                if after else "n/a")
    rows.append([f"{arm} (seed {run['seed']})", h["step"][-1],
                 f"{h['val_acc'][-1]:.4f}", f"{max(h['val_acc']):.4f}",
                 "n/a" if mn is None else f"{mn:.4f}",
                 "n/a" if below is None else below, max_loss, spread,
                 f"{norms[-1]:.2f}"])
  lines = harness.markdown_table(
      ["long run (one seed)", "steps", "final val acc", "max val acc",
       f"min val acc after {int(round(100 * target))}%",
       "logged steps below 90% after it", "max train loss after it",
       "non-Q/K norm min–max after it", "final non-Q/K norm"], "l" * 9, rows)
  if iso is not None:
    lines.append(f"\nIsometry error ratio AdamW / Stiefel over the long run:"
                 f" geometric mean {iso['geomean']:.3g}, range"
                 f" {iso['min']:.3g}–{iso['max']:.3g}.")
  return "\n".join(lines)


def plot_runs(runs: dict, path: Path, title: str) -> None:
  """Validation accuracy, Q/K isometry error and non-Q/K weight norm
  against step, every seed of both arms."""
  plt = harness.pyplot()
  colors = {"adamw": "tab:red", "stiefel": "tab:blue"}
  fig, axes = plt.subplots(1, 4, figsize=(20, 4))
  for arm, by_seed in runs.items():
    for i, (seed, r) in enumerate(sorted(by_seed.items())):
      h = r["history"]
      lab = arm if i == 0 else None
      axes[0].plot(h["step"], h["val_acc"], color=colors[arm], alpha=0.7,
                   lw=1, label=lab)
      axes[1].semilogy(h["step"], iso_curve(h), color=colors[arm], alpha=0.7,
                       lw=1, label=lab)
      axes[2].plot(h["step"], other_norm_curve(h), color=colors[arm],
                   alpha=0.7, lw=1, label=lab)
      axes[3].semilogy(h["step"], np.maximum(h["train_loss"], 1e-12),
                       color=colors[arm], alpha=0.7, lw=1, label=lab)
  for ax, ylabel in zip(axes, ("validation accuracy",
                               "Q/K isometry error ||W^T W - I||_F (mean frame)",
                               "norm of non-Q/K weights",
                               "train loss (floored at 1e-12)")):
    ax.set_xlabel("step (full batch = epoch)")
    ax.set_ylabel(ylabel)
    ax.legend()
  fig.suptitle(title)
  harness.save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------
# The study.


def schedule(study: Study) -> list:
  """(arm, seed, steps) in run order: the seed study first, then the long
  seed continued, then the rsgd probe."""
  jobs = [(arm, seed, study.steps) for seed in study.seeds
          for arm in study.arms]
  if study.probe_steps:
    jobs += [(PROBE_ARM, seed, study.probe_steps) for seed in study.seeds]
  if study.long_steps > study.steps:
    jobs += [(arm, study.long_seed, study.long_steps) for arm in study.arms]
  return jobs


def saved_study(cfg: Config, study: Study, out: Path,
                runs_from: Sequence[str] = ()) -> dict:
  """Every saved run of the study as it is (partial runs included)."""
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  for arm, seed, _ in schedule(study):
    run = load_run(cfg, arm, seed, out, runs_from)
    if run is not None:
      runs[arm][seed] = run
  return runs


def remaining(cfg: Config, job: tuple, out: Optional[Path]) -> int:
  arm, seed, steps = job
  run = (harness.RunStore(out).load(run_name(arm, seed), run_identity(cfg))
         if out is not None else None)
  return max(0, steps - (run["history"]["step"][-1] if run else 0))


def part_of(cfg: Config, jobs: list, out: Optional[Path], part: int,
            parts: int) -> list:
  """The jobs of `part` (0-based) of `parts` processes: jobs of the same
  (arm, seed) stay together, groups go greedily (largest remaining steps
  first) to the least loaded part, so parallel processes balance and never
  train the same run."""
  groups = {}
  for job in jobs:
    groups.setdefault(job[:2], []).append(job)
  load, assign = [0] * parts, [[] for _ in range(parts)]
  for key in sorted(groups, key=lambda k: -max(
      remaining(cfg, j, out) for j in groups[k])):
    i = load.index(min(load))
    load[i] += max(remaining(cfg, j, out) for j in groups[key])
    assign[i] += groups[key]
  return [j for j in jobs if j in assign[part]]


def run_study(cfg: Config, study: Study, out: Optional[Path],
              show_progress: bool = False, part: int = 0,
              parts: int = 1, command: str = "") -> dict:
  """Runs (or resumes) every job (or one part of them); returns the runs
  keyed arm -> seed."""
  jobs = schedule(study)
  if parts > 1:
    jobs = part_of(cfg, jobs, out, part, parts)
  bar = None
  if show_progress:
    from tqdm import tqdm
    bar = tqdm(total=sum(j[2] for j in jobs), unit="step", desc="grokking",
               mininterval=5.0)
  runs = {arm: {} for arm in study.arms + (PROBE_ARM,)}
  left = list(jobs)

  def execute(job):
    arm, seed, steps = job
    if bar is not None:
      bar.set_postfix_str(f"{arm} seed {seed} -> {steps}")
    runs[arm][seed] = train_run(cfg, arm, seed, steps, out, bar,
                                command=command)
    left.remove(job)
    return runs[arm][seed]

  # The shared runner; the bar counts steps here (a run's length varies).
  study_lib.run_tasks(lambda: left, execute, desc="grokking",
                      describe=lambda job, _: f"{job[0]} seed {job[1]}:"
                      f" step {job[2]}", log=lambda _: None, progress=False)
  if bar is not None:
    bar.close()
  return runs


def reached_study(study: Study, runs: dict) -> Study:
  """The study cut to what the saved runs reached (for a partial report):
  seeds whose both arms reached `steps`, steps cut to the common minimum."""
  def last(arm, seed):
    r = runs[arm].get(seed)
    return r["history"]["step"][-1] if r else 0
  seeds = tuple(s for s in study.seeds
                if all(last(a, s) > 0 for a in study.arms))
  steps = min([min(last(a, s), study.steps) for s in seeds
               for a in study.arms] or [0])
  long_steps = min([last(a, study.long_seed) for a in study.arms] or [0])
  probe = min([last(PROBE_ARM, s) for s in seeds] or [0])
  return dataclasses.replace(study, seeds=seeds, steps=steps,
                             long_steps=long_steps if long_steps > steps else 0,
                             probe_steps=probe)


def long_runs(study: Study, runs: dict) -> dict:
  """The long seed's runs of both arms, cut to a common step."""
  return {arm: truncate(runs[arm][study.long_seed], study.long_steps)
          for arm in study.arms}


def analyse(cfg: Config, study: Study, runs: dict) -> dict:
  """Statistics, mechanism numbers and the long run from the raw runs."""
  if not study.seeds or not study.steps:
    raise SystemExit("no seed has saved runs of both arms yet; nothing to"
                     " report.")
  main = {arm: {s: truncate(runs[arm][s], study.steps) for s in study.seeds}
          for arm in study.arms}
  summaries = {arm: {s: run_summary(r, cfg.target_acc) for s, r in by.items()}
               for arm, by in main.items()}
  comp = compare_arms(summaries, study.steps)
  res = dict(summaries=summaries, comparison=comp, verdict=winner(comp),
             isometry_ratio=iso_ratio(list(main["adamw"].values()),
                                      list(main["stiefel"].values())),
             movement=movement_ratios(main, runs[PROBE_ARM], study.probe_steps)
             if study.probe_steps else {})
  if study.long_steps > study.steps:
    longs = long_runs(study, runs)
    res["long"] = dict(
        summaries={a: run_summary(r, cfg.target_acc) for a, r in longs.items()},
        isometry_ratio=iso_ratio([longs["adamw"]], [longs["stiefel"]]))
  return res


def provenance(runs: dict, out: Path) -> dict:
  """Where the runs came from, from the run files alone: summed training
  time, the machines and the commands that trained them (earliest start of
  each), and the command that regenerates this report."""
  recs = [r for by in runs.values() for r in by.values()]
  first = {}
  for e in sorted((e for r in recs for e in r.get("trained_by", [])
                   if e.get("command")), key=lambda e: e["started_utc"]):
    first.setdefault(e["command"], {k: e.get(k) for k in
                                    ("command", "started_utc", "loadavg_start")})
  return dict(
      regenerate=("python -m benchmarks.grokking --report-only --out"
                  f" {harness.portable(out)}"),
      runs=len(recs),
      run_wall_s=sum(r["wall_s"] for r in recs),
      run_cpu_s=sum(r.get("cpu_s", 0.0) for r in recs),
      run_wall_s_each={f"{a}_seed{s}": r["wall_s"]
                       for a, by in runs.items() for s, r in by.items()},
      machines=sorted({harness.machine_line(r["machine"]) for r in recs
                       if r.get("machine")}),
      library_versions=sorted({r["library_version"] for r in recs}),
      trained_by=list(first.values()))


def provenance_text(meta: dict) -> str:
  text = (f"Training: {meta['runs']} run files, {meta['run_wall_s']:.0f} s wall"
          f" and {meta['run_cpu_s']:.0f} s CPU (all threads) summed over the"
          " runs' training (every invocation, resumed ones included);"
          f" stiefel_optax {', '.join(meta['library_versions'])}; machine:"
          f" {'; '.join(meta['machines']) or 'not recorded'}.")
  if meta["trained_by"]:
    text += " Trained by " + "; ".join(
        f"`{e['command']}` (started {e['started_utc']}"
        + (f", load average at start {e['loadavg_start']:.1f}"
           if e.get("loadavg_start") is not None else "") + ")"
        for e in meta["trained_by"]) + "."
  return text + f"\n\nRegenerate: `{meta['regenerate']}`."


def markdown(cfg: Config, study: Study, res: dict, meta: dict,
             notes: str = "") -> str:
  parts = [
      f"Task (a {cfg.op} b) mod {cfg.p}, train fraction {cfg.train_fraction},"
      f" full batch; {cfg.num_layers}-layer transformer d = {cfg.d_model},"
      f" {cfg.num_heads} heads, MLP {cfg.d_mlp}; AdamW lr {cfg.learning_rate}"
      f" (b1 {cfg.b1}, b2 {cfg.b2}), weight decay {cfg.weight_decay};"
      f" Stiefel lr {cfg.stiefel_learning_rate or cfg.learning_rate}, trust"
      f" region {cfg.max_step_norm}; rsgd lr {cfg.rsgd_learning_rate}."
      f" Seeds {list(study.seeds)} x {study.steps} steps"
      + (f"; seed {study.long_seed} continued to {study.long_steps} steps"
         if study.long_steps > study.steps else "") + ".",
      "",
      study_table(res["summaries"], res["comparison"], cfg.target_acc),
      "",
      "**" + res["verdict"] + "**",
      "",
      mechanism_table(res["isometry_ratio"], res["movement"], cfg.log_every),
  ]
  if "long" in res:
    parts += ["", res["long"]["table"]]
  if notes:
    parts += ["", notes]
  parts += ["", provenance_text(meta)]
  return "\n".join(parts)


def report(out: Path, cfg: Config, study: Study, runs_from: Sequence[str] = (),
           plots: bool = True) -> dict:
  """results.json, table.md and the plots of `out`, from its saved runs
  (cut to what they reached), its study and its notes.md alone."""
  runs = saved_study(cfg, study, out, runs_from)
  study = reached_study(study, runs)
  res = analyse(cfg, study, runs)
  if "long" in res:
    res["long"]["table"] = long_table(long_runs(study, runs), cfg.target_acc,
                                      res["long"]["isometry_ratio"])
  meta = provenance(runs, out)
  table = markdown(cfg, study, res, meta, harness.read_notes(out / "notes.md"))
  harness.write_json(out / "results.json", dict(
      meta=meta, config=dataclasses.asdict(cfg),
      study=dataclasses.asdict(study), **res))
  harness.write_text(out / "table.md", table + "\n")
  if plots:
    main_runs = {a: {s: truncate(runs[a][s], study.steps) for s in study.seeds}
                 for a in study.arms}
    plot_runs(main_runs, out / "study.png",
              f"(a {cfg.op} b) mod {cfg.p}: {len(study.seeds)} seeds per arm")
    if "long" in res:
      plot_runs({a: {study.long_seed: r}
                 for a, r in long_runs(study, runs).items()},
                out / "long_run.png",
                f"long run, seed {study.long_seed}")
  return dict(meta=meta, results=res, table=table, study=study)


def load_spec(out: Path):
  """(cfg, study, runs_from) from <out>/study.json, or None."""
  spec = harness.read_json(out / "study.json")
  if spec is None:
    return None
  return (Config(**spec["config"]), Study.from_dict(spec["study"]),
          tuple(spec.get("runs_from", ())))


def section_text(template: Path = SECTION_TEMPLATE, plots: bool = True) -> str:
  """The Grokking section of RESULTS.md: the template verbatim, each
  `<!-- report: FOLDER [long] -->` line replaced by that study's report
  (regenerated from its raw runs; `long`: its long-run table only)."""
  def study(folder: str, part: str = "all") -> str:
    out = template.parent / folder
    rep = report(out, *load_spec(out), plots=plots)
    return rep["table"] if part == "all" else rep["results"]["long"]["table"]
  return harness.expand(template.read_text(), {"report": study})


def parse_args(argv):
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.grokking", description=__doc__.split("\n")[0])
  harness.add_common_args(
      p, default_out_dir="runs/grokking/<default|full|quick>",
      seeds_default="0-4",
      quick_help="a smoke run (under a minute): p = 23, d = 16, 2 seeds x"
                 " 100 steps")
  p.add_argument("--full", action="store_true",
                 help="the longer study (5 seeds per arm + one long run)")
  p.add_argument("--steps", type=int, help="steps per seed")
  p.add_argument("--long-steps", type=int, help="long run's steps (0: none)")
  p.add_argument("--long-seed", type=int, help="the seed of the long run")
  p.add_argument("--probe-steps", type=int, help="rsgd probe steps (0: none)")
  p.add_argument("--log-every", type=int, help="steps per logged record")
  p.add_argument("--p", type=int, help="the prime modulus")
  p.add_argument("--train-fraction", type=float)
  p.add_argument("--op", choices=modular.OPS)
  p.add_argument("--d-model", type=int)
  p.add_argument("--num-heads", type=int)
  p.add_argument("--d-mlp", type=int)
  p.add_argument("--num-layers", type=int)
  p.add_argument("--learning-rate", type=float)
  p.add_argument("--no-plots", action="store_true")
  p.add_argument("--part", default="0/1",
                 help="K/N: run only part K of N parallel processes (then"
                      " report with --report-only)")
  p.add_argument("--note", default="",
                 help="free text written to <out>/notes.md, which every"
                      " report of that folder includes verbatim")
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def configure(args) -> tuple:
  """(cfg, study, out, runs_from); --report-only on a folder with a
  study.json reports the study saved there."""
  preset = "quick" if args.quick else "full" if args.full else "default"
  out = args.out or harness.default_out("grokking", preset)
  if args.report_only and (spec := load_spec(out)) is not None:
    return (*spec[:2], out, spec[2])
  cfg = Config(**(QUICK_CONFIG if args.quick else {}))
  overrides = {k: getattr(args, k) for k in
               ("p", "log_every", "train_fraction", "op", "d_model",
                "num_heads", "d_mlp", "num_layers", "learning_rate") if getattr(args, k) is not None}
  if args.d_model and not args.d_mlp:
    overrides["d_mlp"] = 4 * args.d_model
  cfg = dataclasses.replace(cfg, **overrides)
  study = dict(quick=QUICK_STUDY, full=FULL_STUDY).get(preset, DEFAULT_STUDY)
  study = dataclasses.replace(
      study,
      steps=args.steps if args.steps is not None else study.steps,
      seeds=args.seeds or study.seeds,
      long_steps=args.long_steps if args.long_steps is not None
      else study.long_steps,
      long_seed=args.long_seed if args.long_seed is not None
      else study.long_seed,
      probe_steps=args.probe_steps if args.probe_steps is not None
      else study.probe_steps)
  for name in ("steps", "long_steps", "probe_steps"):
    n = getattr(study, name)
    if n % cfg.log_every:
      raise SystemExit(f"--{name.replace('_', '-')} = {n} must be a multiple"
                       f" of log_every = {cfg.log_every}.")
  return cfg, study, out, ()


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  t0 = time.time()
  if args.report_only and args.results_md and args.out is None:
    harness.write_section(args.results_md, SECTION,
                          section_text(plots=not args.no_plots))
    print(f"{args.results_md}: {SECTION} regenerated from"
          f" {harness.portable(SECTION_TEMPLATE)} and the runs it names")
    return {}
  cfg, study, out, runs_from = configure(args)
  if args.note:
    harness.write_text(out / "notes.md", args.note.strip() + "\n")
  if not args.report_only:
    harness.write_json(out / "study.json", dict(
        config=dataclasses.asdict(cfg), study=dataclasses.asdict(study)),
                       indent=1)
    part, parts = (int(x) for x in args.part.split("/"))
    run_study(cfg, study, out, not args.no_progress, part, parts,
              harness.command_line("benchmarks.grokking", argv))
  rep = report(out, cfg, study, runs_from, plots=not args.no_plots)
  if args.results_md:
    harness.write_section(args.results_md, SECTION,
                          section_text(plots=not args.no_plots))
  print(rep["table"])
  print(f"\nresults: {out} ({time.time() - t0:.0f} s this invocation)")
  return rep


if __name__ == "__main__":
  main()
