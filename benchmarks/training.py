"""The one training loop every benchmark runs (`train_chunk`), the one
resumable, checkpointed run around it (`train_run`: grokking's and the
LM's), the one evaluation of a classifier's logits, and the arms: the one
record of an arm (`Arm`, what each experiment's registry `ARMS = {name:
Arm(...)}` holds), the Q/K recipes the experiments share (`qk_stiefel`,
`qk_rsgd`, ...; the Muon baseline `per_head_muon`) and an arm's optimizer
(`arm_optimizer`: its recipe on the Q/K frames, the experiment's AdamW on
the rest).

A chunk is `k` optimizer steps in one `lax.scan`: per step

    batch = batch_of(x_i, *data)
    loss, g = value_and_grad(loss_fn)(params, *batch)
    u, opt_state = tx.update(g, opt_state, params)
    params = optax.apply_updates(params, u)

and the chunk returns the new carry (params, opt_state), the mean loss over
its steps and, if `aux_fn(old, new)` is given, the mean of that per-step
quantity (e.g. the Q/K frames' movement). The experiments differ only in
what `x_i` is (CIFAR: an index batch; the LM: an iteration number whose
batch is drawn from a key; grokking: nothing, full batch) and how often
they evaluate between chunks.

A run (`train_run`) is such chunks to a given step, an evaluation recorded
at 0 and after each chunk, the record saved with a checkpoint of the carry
every minute, so that a stopped run resumes where its last save left it
and computes the same numbers; an experiment supplies its start, chunk,
evaluation and final results (grokking: none, so that a longer run
continues a finished one; the LM: the whole-split loss). `jit` and
`toy_compiler` set the compiler options of the jitted pieces.

>>> import jax.numpy as jnp, optax
>>> chunk = train_chunk(lambda p, x: jnp.sum((p - x) ** 2), optax.sgd(0.25),
...                     lambda x: (x,))
>>> p = jnp.zeros(2)
>>> (p, _), loss, _ = chunk((p, optax.sgd(0.25).init(p)), jnp.ones((3, 2)))
>>> p.tolist(), float(loss)        # 1 - 0.5^3 after three halvings
([0.875, 0.875], 0.875)
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness


# Options for the compiler of every function built by `jit` (`toy_compiler`
# sets them for toy sizes, as tests do); {}: compiled as jax.jit does.
COMPILER_OPTIONS: dict = {}


def jit(fn: Callable, **kwargs) -> Callable:
  """jax.jit(fn, **kwargs) under COMPILER_OPTIONS as they are when it is
  built (an experiment caches what it builds per options:
  `cached_builder`)."""
  return jax.jit(fn, compiler_options=COMPILER_OPTIONS or None, **kwargs)


def cached_builder(build: Callable) -> Callable:
  """`build` (a function of hashable arguments that returns `jit`
  functions) cached per argument and per COMPILER_OPTIONS as they are at the
  call: what a --quick run built under the toy compiler is never handed to
  a run compiled as jax.jit does, in the same process.

  >>> calls = []
  >>> build = cached_builder(lambda n: calls.append(n) or n)
  >>> build(1), build(1)
  (1, 1)
  >>> with toy_compiler(True):
  ...   build(1)
  1
  >>> calls
  [1, 1]
  """
  cached = functools.lru_cache(maxsize=None)(
      lambda options, *args, **kwargs: build(*args, **kwargs))

  @functools.wraps(build)
  def builder(*args, **kwargs):
    return cached(tuple(sorted(COMPILER_OPTIONS.items())), *args, **kwargs)

  builder.cache_clear = cached.cache_clear
  return builder


@contextlib.contextmanager
def toy_compiler(enabled: bool):
  """With `enabled` (a --quick run: the driver sets it), `jit` compiles
  without LLVM's optimisation: at toy sizes that is most of the compile
  time. The options are restored after.

  >>> from benchmarks import training
  >>> with toy_compiler(True):
  ...   training.COMPILER_OPTIONS
  {'xla_backend_optimization_level': 0}
  >>> training.COMPILER_OPTIONS
  {}
  """
  global COMPILER_OPTIONS
  saved = COMPILER_OPTIONS
  if enabled:
    COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, **saved}
  try:
    yield
  finally:
    COMPILER_OPTIONS = saved


def train_chunk(loss_fn: Callable, tx: optax.GradientTransformation,
                batch_of: Callable, *, aux_fn: Optional[Callable] = None,
                length: Optional[int] = None,
                update_args: bool = False) -> Callable:
  """chunk(carry, xs, *data) -> (carry, mean loss, mean aux or None): one
  step per element of `xs` (or `length` steps when xs is None), not jitted
  (callers choose donation and compiler options).

  aux_fn(old params, new params, new opt_state): a per-step quantity.
  update_args: loss_fn returns (loss, kwargs), the kwargs handed to
  `tx.update` (an `optax.GradientTransformationExtraArgs`), as MuonClip
  takes the forward pass's attention-logit maxima.
  """

  def step(carry, x, data):
    params, opt_state = carry
    out, grads = jax.value_and_grad(loss_fn, has_aux=update_args)(
        params, *batch_of(x, *data))
    loss, kwargs = out if update_args else (out, {})
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    new = optax.apply_updates(params, updates)
    aux = aux_fn(params, new, opt_state) if aux_fn is not None else None
    return (new, opt_state), (loss, aux)

  def chunk(carry, xs, *data):
    carry, (losses, aux) = jax.lax.scan(
        lambda c, x: step(c, x, data), carry, xs, length=length)
    return carry, losses.mean(), jax.tree.map(lambda a: a.mean(0), aux)

  return chunk


def frame_step_records(frames, lr: Callable, *,
                       max_step_norm: Optional[float] = None,
                       b1: float = 0.9, b2: float = 0.999,
                       eps: float = 1e-8) -> Callable:
  """aux_fn(old, new, opt_state) for `train_chunk`: a Stiefel recipe's
  per-step records on the Q/K frames of the selector `frames`.

  `step_norm`: the mean over the frames of ||W+ - W||_F. With
  `max_step_norm` (the recipe's trust-region radius), also `cap_binds` (the
  runs' recorded name): the fraction of
  frames whose uncapped step lr(t - 1) ||m^||_F / (sqrt(v^) + eps) (Adam's
  bias-corrected moments, b1 and b2 the recipe's, read from the one
  `ScaleByFrameAdamState` of the new state) exceeds the radius, i.e.
  where the step is max_step_norm m / ||m|| and the second moment plays no
  part.
  """
  is_adam = lambda s: isinstance(s, so.ScaleByFrameAdamState)

  def records(old, new, opt_state):
    out = dict(step_norm=mean_of(so.frame_movement(old, new, frames).values()))
    if max_step_norm is not None:
      (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam)
                 if is_adam(s)]
      t = adam.count.astype(jnp.float32)
      uncapped = [lr(t - 1) * jnp.linalg.norm(m, axis=(-2, -1))
                  / ((1 - b1 ** t) * (jnp.sqrt(v / (1 - b2 ** t)) + eps))
                  for m, v in zip(jax.tree.leaves(adam.mu),
                                  jax.tree.leaves(adam.nu))]
      out["cap_binds"] = mean_of(n > max_step_norm for n in uncapped)
    return out

  return records


def mean_of(arrays) -> jax.Array:
  """The mean over every element of the arrays (float32)."""
  return jnp.mean(jnp.concatenate([jnp.ravel(a).astype(jnp.float32)
                                   for a in arrays]))


def loss_and_accuracy(logits: jax.Array, labels: jax.Array):
  """(mean cross-entropy in float32, accuracy) of `logits` (..., classes)
  against integer `labels` (...): grokking's answer token, CIFAR's image
  class.

  >>> import jax.numpy as jnp
  >>> loss, acc = loss_and_accuracy(jnp.array([[0.0, 9.0], [0.0, 9.0]]),
  ...                               jnp.array([1, 0]))
  >>> float(acc), round(float(loss), 3)      # one right, one wrong by 9
  (0.5, 4.5)
  """
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()
  return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


# --------------------------------------------------------------------------
# The arms: one record, the shared Q/K recipes, an arm's optimizer.


class Arm(NamedTuple):
  """One arm as its experiment's registry lists it (`ARMS = {name: Arm(...)}`
  in each experiment's arms.py): what its runs do otherwise than the other
  arms' (the same data, seeds, batches and initialisation elsewhere).

  qk: the Q/K frames' optimizer, qk(lr, **hyperparameters) (each recipe
    takes the keywords it reads: `qk_stiefel`, `qk_rsgd`, ... below), with
    the experiment's AdamW on every other weight (`arm_optimizer`); None:
    that AdamW on every weight, the Q/K kernels included.
  orthonormal: the Q/K frames start at the polar factor (the nearest
    orthonormal frame) of the seed's initialisation; else as initialised
    (a recipe then runs unconstrained, or retracts at its first step).
  qk_norm: the model normalises each head's queries and keys.
  qk_clip: MuonClip's QK-clip after each step (the LM's `qk_clip`).
  frames: the Q/K frame selector (None: the experiment's, one frame per
    head).
  fixed: ((name, value), ...) hyperparameters of its recipe that are not
    tuned (e.g. eps), recorded with each run.
  fields: the configuration fields only this arm reads, its Q/K learning
    rate first (where a configuration holds every arm's fields: the LM
    keeps them out of the other arms' identity).
  """
  qk: Optional[Callable[..., optax.GradientTransformation]] = None
  orthonormal: bool = False
  qk_norm: bool = False
  qk_clip: bool = False
  frames: Any = None
  fixed: tuple = ()
  fields: tuple = ()


def qk_adamw(lr, *, weight_decay, **_):
  """AdamW on the Q/K frames, the same as on the rest of the model."""
  return optax.adamw(lr, weight_decay=weight_decay)


def qk_stiefel(lr, *, b1=0.9, b2=0.999, eps=1e-8,
               max_step_norm=so.aliases.DEFAULT_MAX_STEP_NORM, **_):
  """Stiefel-Adam: project, one scalar v per frame, lr, trust region,
  retract. `max_step_norm` is the trust-region radius itself, not a ratio
  of the lr (the LM study's max_step_ratio is: max_step_norm =
  max_step_ratio x Q/K lr)."""
  return so.stiefel_adam(lr, b1, b2, eps, max_step_norm=max_step_norm)


def qk_rsgd(lr, **_):
  """Fixed-step Riemannian SGD: W+ = polar(W - lr P_W(G))."""
  return so.riemannian_sgd(lr)


def qk_stiefel_muon(lr, **_):
  """Manifold Muon: polar(W - lr P_W(msign(tangent momentum)))."""
  return so.stiefel_muon(lr)


def qk_muon(lr, *, weight_decay, **_):
  """optax.contrib.muon on each head's (d, head_dim) view, unconstrained
  (`per_head_muon`)."""
  return per_head_muon(lr, weight_decay)


def arm_optimizer(arm: Arm, rest: optax.GradientTransformation, lr,
                  frames: Any = None, **hp) -> optax.GradientTransformation:
  """The arm's optimizer: `rest` (the experiment's AdamW) on every weight
  where arm.qk is None; else arm.qk(lr, **fixed, **hp) on the Q/K frames
  (arm.frames, else `frames`) and `rest` on every other weight
  (`so.frame_partition`), the frames checked orthonormal at init where the
  arm starts them so, else retracted (or left) as the recipe does.

  >>> import optax
  >>> rest = optax.adamw(1e-3)
  >>> arm_optimizer(Arm(), rest, 1e-3) is rest
  True
  """
  if arm.qk is None:
    return rest
  return so.frame_partition(
      arm.qk(lr, **{**dict(arm.fixed), **hp}), rest,
      frames if arm.frames is None else arm.frames,
      orthonormal_start="check" if arm.orthonormal else "project")


def per_head_muon(learning_rate, weight_decay: float
                  ) -> optax.GradientTransformation:
  """The `muon` arm of the attention benchmarks: `optax.contrib.muon` on
  frame views (..., d, head_dim), rows reduced and columns out, so that it
  sees each head's W_q (d, head_dim) as a matrix x W = y (as it would
  with separate per-head kernels); unconstrained, with Nesterov momentum
  0.95 (Muon's default), Moonlight's consistent-RMS scale 0.2 (so its lr
  reads like AdamW's) and the model's weight decay, as AdamW decays the
  same weights.

  >>> import jax.numpy as jnp
  >>> tx = per_head_muon(1e-3, weight_decay=0.1)
  >>> w = {"q": jnp.ones((2, 8, 4))}         # two heads' (d, head_dim) views
  >>> u, _ = tx.update(w, tx.init(w), w)
  >>> u["q"].shape
  (2, 8, 4)
  """
  dims = lambda params: jax.tree.map(
      lambda _: optax.contrib.MuonDimensionNumbers(reduction_axis=-2,
                                                   output_axis=-1), params)
  return optax.contrib.muon(learning_rate, beta=0.95, nesterov=True,
                            weight_decay=weight_decay, consistent_rms=0.2,
                            muon_weight_dimension_numbers=dims)


def save_carry(path: os.PathLike, carry) -> None:
  """The carry's leaves, atomically, as one .npz."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = harness.temp_path(path)
  np.savez(tmp, *[np.asarray(x) for x in jax.tree.leaves(carry)])
  tmp.replace(path)


def load_carry(path: os.PathLike, like):
  """`save_carry`'s leaves in the structure of `like`."""
  with np.load(path) as f:
    leaves = [jax.numpy.asarray(f[f"arr_{i}"]) for i in range(len(f.files))]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


# --------------------------------------------------------------------------
# One run, saved and resumable.


def train_run(store: Optional[harness.RunStore], name: str, ident: str, *,
              start: Callable[[], tuple], chunk: Callable, record: Callable,
              every: int, stop: int, finish: Optional[Callable] = None,
              progress: Any = None, command: str = "",
              save_every_s: float = 60.0) -> dict:
  """Trains a run to step `stop` in chunks of `every` steps, saved in
  `store` (None: not saved) as `name` and resumed from its saved record and
  checkpoint of the same identity `ident`; returns the run's record.

  The experiment supplies its pieces:
    start() -> (record, carry): a fresh record (its identity `ident`,
      wall_s 0, its `history` lists empty) and the initial carry (the
      structure a checkpoint is read into);
    chunk(carry, step) -> (carry, out): `every` steps from `step`;
    record(run, carry, step, out, wall_s): appends the evaluation at `step`
      to run["history"] (out: the chunk's output, None at step 0; wall_s:
      the run's wall seconds so far); a non-empty return (e.g. why the run
      diverged) stops the run there, kept as run["stopped"], and the run
      ends as at `stop` (a diverged run is a result: it is finished, saved
      and returned as it is later, never rerun);
    finish(run, carry) -> dict: the final results, set as run["final"] at
      the end (the checkpoint is then deleted); without it the run ends at
      `stop` with its checkpoint, so that a later call can continue it.
  A saved run already at `stop` (with its final results, if `finish`) is
  returned as it is. The record is saved, with a checkpoint of the carry,
  every `save_every_s` seconds and at the end; `trained_by` gets an entry
  per call (command, start time, step, load, code hash), wall_s and cpu_s
  add up over the calls. progress: a tqdm-like bar counting steps.

  >>> import tempfile, jax.numpy as jnp, optax
  >>> tx = optax.sgd(0.25)
  >>> step = jax.jit(train_chunk(lambda p: jnp.sum((p - 1.0) ** 2), tx,
  ...                            lambda _: (), length=2))
  >>> def start():
  ...   p = jnp.zeros(2)
  ...   run = dict(identity="v1", wall_s=0.0, history=dict(step=[], p=[]))
  ...   return run, (p, tx.init(p))
  >>> def record(run, carry, it, out, wall_s):
  ...   run["history"]["step"].append(it)
  ...   run["history"]["p"].append(float(carry[0][0]))
  >>> kw = dict(start=start, chunk=lambda c, it: step(c, None)[:2],
  ...           record=record, every=2)
  >>> store = harness.RunStore(tempfile.mkdtemp())
  >>> run = train_run(store, "toy", "v1", stop=2, **kw)
  >>> run = train_run(store, "toy", "v1", stop=4, **kw)   # continued
  >>> run["history"], len(run["trained_by"])
  ({'step': [0, 2, 4], 'p': [0.0, 0.75, 0.9375]}, 2)
  """
  saved = store.load(name, ident) if store is not None else None
  if saved is not None and (saved["history"]["step"][-1] >= stop
                            or saved.get("stopped")) and (
      finish is None or saved.get("final") is not None):
    if progress is not None:
      progress.update(stop)
    return saved
  ckpt = store.path(name, ".npz") if store is not None else None
  run, carry = start()
  if saved is not None and ckpt.exists():
    run, carry = saved, load_carry(ckpt, carry)
  hist = run["history"]
  t0, c0, last_save = time.time(), time.process_time(), time.time()
  wall = lambda: run["wall_s"] + time.time() - t0

  def timing():   # adds the time since the last call to the record's
    nonlocal t0, c0
    run["wall_s"] += time.time() - t0
    run["cpu_s"] = run.get("cpu_s", 0.0) + time.process_time() - c0
    t0, c0 = time.time(), time.process_time()

  def stop_early(why):
    if why:
      run["stopped"] = why

  if not hist["step"]:
    stop_early(record(run, carry, 0, None, wall()))
  done = hist["step"][-1]
  run.setdefault("trained_by", []).append(dict(
      command=command, started_utc=harness.now_utc(), from_step=done,
      loadavg_start=harness.load_average(), code_hash=harness.code_hash()))
  if progress is not None:
    progress.update(min(done, stop))
  while done < stop and not run.get("stopped"):
    carry, out = chunk(carry, done)
    done += every
    stop_early(record(run, carry, done, out, wall()))
    if progress is not None:
      progress.update(every)
    ended = done >= stop or bool(run.get("stopped"))
    if store is not None and (time.time() - last_save > save_every_s
                              or ended):
      timing()
      last_save = time.time()
      if not ended or finish is None:   # a finished run saves below
        save_carry(ckpt, carry)
        store.save(name, run)
  if finish is not None:
    final = finish(run, carry)
    timing()
    run["final"] = final
    if store is not None:
      store.save(name, run)
      if ckpt.exists():
        ckpt.unlink()
  elif store is None:   # saved runs were timed at their last save
    timing()
  return run
