"""Character-level language model on tiny Shakespeare: nanoGPT in Flax, the
Stiefel attention optimizer and its alternatives as arms.

    python -m benchmarks.lm                  # the external reference: AdamW,
                                             # nanoGPT's small CPU config, seed 0
    python -m benchmarks.lm --probe 100      # time 100 steps, print the
                                             # projected wall time, then run
    python -m benchmarks.lm --arms stiefel --seeds 100 --max-iters 500 \\
        --stiefel-learning-rate 0.03,0.1 --max-step-norm 0.1
                                             # a sweep (--max-iters sets
                                             # lr_decay_iters too)
    python -m benchmarks.lm --arms adamw,stiefel --seeds 0-2 \\
        --stiefel-learning-rate 0.3 --max-step-norm 0.3   # paired seeds
    python -m benchmarks.lm --quick          # toy size, 2 arms, well under 60 s
    python -m benchmarks.lm --report-only --out benchmarks/results/lm \\
        --results-md benchmarks/RESULTS.md   # the committed tables and section
    python -m benchmarks.lm --study --out benchmarks/results/lm \\
        --results-md benchmarks/RESULTS.md   # the whole study, one resumable
                                             # command (its estimate first)
    python -m benchmarks.lm --study --dry-run --out benchmarks/results/lm
                                             # the study's time estimate only
    python -m benchmarks.lm --study --quick  # the study's path at toy size
    python -m benchmarks.lm --study --report-only --out benchmarks/results/lm
                                             # the study's tables, from the runs

Model (`benchmarks.models.GPT`): nanoGPT's `model.py` with its
`train_shakespeare_char` settings: token and learned position embeddings,
pre-LayerNorm blocks (LayerNorm without bias, eps 1e-5; nanoGPT's default
bias=False, so no Dense has a bias either), causal self-attention through a
fused `c_attn` Dense (d, 3 d) whose column thirds are q, k and v, each
head-major (nanoGPT's `.view(B, T, n_head, head_dim)`), `c_proj`, a GELU
(exact) MLP of width 4 d, a final LayerNorm, and the head tied to the token
embedding (nanoGPT ties them: `wte.weight = lm_head.weight`). Initialisation
as nanoGPT: N(0, 0.02) for every kernel and embedding, N(0, 0.02 /
sqrt(2 n_layer)) for both `c_proj`s. Dropout (nanoGPT's places: embeddings,
attention probabilities, both residual branches) is 0 at the CPU config.
One architecture flag, `qk_norm` (the `qk_norm` arm): RMSNorm, with a
learned per-channel scale, on each head's queries and keys (Gemma 3, OLMo 2).

Data: `--data` (default ../shared/data/tinyshakespeare.txt from the
repository root), its md5 checked against the published corpus's and
recorded (never its path); characters sorted into a 65-symbol vocabulary,
first 90 % for training, last 10 % for validation (nanoGPT's prepare.py).
Batches as nanoGPT's get_batch: `batch_size` random offsets, seeded by the
run's seed and the step, the same for every arm of a seed.

Training (nanoGPT's train.py): AdamW (b1 0.9, b2 0.99, eps 1e-8), weight
decay 0.1 on every parameter of rank >= 2, which in nanoGPT includes the
token and position embeddings, none on the LayerNorm (and qk-norm) scales;
learning rate warmed up linearly for `warmup_iters` (100, as the
shakespeare_char config that nanoGPT's CPU command starts from) and
cosine-decayed to `min_lr` at `lr_decay_iters`; the gradient clipped to
global norm 1.0. `max_iters` steps, jitted, `lax.scan` over chunks of
`eval_interval` steps. Evaluation as nanoGPT's estimate_loss at every
`eval_interval` (and at 0): the mean loss of `eval_iters` random batches of
each split (20, as nanoGPT's CPU command), drawn from a key of the seed and
the step (the same batches for every arm of a seed); at the end also the
loss over every token of the validation split in non-overlapping windows
of `block_size` (`val_loss_full`, the comparisons' measure).

Arms (the same data, batches, evaluation batches and initial weights
outside the Q/K parts; each a recipe of library pieces):

  adamw            nanoGPT's AdamW on everything.
  stiefel          `stiefel_attention` with frames={"c_attn/kernel$":
                   fused_qkv(n_head)}: each head's q and k (d, head_dim)
                   frames on Stiefel-Adam (peak lr `stiefel_learning_rate`,
                   trust region `max_step_norm`) from an orthonormalised
                   start, the v third and everything else on AdamW.
  rsgd             the same frames on `riemannian_sgd(rsgd_learning_rate)`.
  stiefel_muon     the same frames on `stiefel_muon(stiefel_muon_learning_rate)`.
  muon             `optax.contrib.muon` on the same per-head q and k views,
                   unconstrained (see `make_optimizer`), from nanoGPT's init.
  qk_norm          AdamW, model with `qk_norm` on.
  orthogonal_init  the orthonormalised Q/K start of `stiefel`, then AdamW.

Every group's learning rate follows the same warmup + cosine shape, its own
peak decayed to peak * min_lr / learning_rate. Gradient clipping is the
same for every arm: the global norm of the whole gradient is clipped to
`grad_clip` before any optimizer sees it (Stiefel-Adam and both Muons are
invariant to the gradient's scale; RSGD and AdamW are not).

The study (`--study`, `STUDY`; issue 14 under the fair-tuning rule of
issue 12) turns the comparison into claims. (1) The nanoGPT reference: AdamW
at nanoGPT's published settings, its own record (seeds 0-3), not the tuned
adamw (if tuning lands on the same point the two share their runs). (2)
Tuning on validation, every arm the same grid density: 3 half-decade points
per hyperparameter (adamw, qk_norm and orthogonal_init: lr x weight decay;
stiefel: Q/K lr x cap / Q/K lr; rsgd, stiefel_muon, muon: Q/K lr; the
non-Q/K weights of these four on adamw's chosen lr and weight decay), tuning
seeds 100-102, a point's score the mean over them of the whole-split
validation loss, each grid widened geometrically past an edge its best point
lands on (at most 3 times; `benchmarks.study`). Tuning runs use the
500-iteration schedule (decay to 500) on which the earlier tuning was done.
(3) Paired runs at the CPU config: adamw and stiefel at discovery seeds 0-7
and confirmation seeds 500-507, the other arms at 0-5 and 500-505, each
arm's discovery seeds before its confirmation seeds, the main pair's before
any other arm's tuning (`benchmarks.study`, the plan CIFAR shares). (4) The
report: each arm against adamw and stiefel against each other arm, treatment
minus baseline in validation loss with its 95% CI, paired t, p,
Holm-adjusted p across each table, wins and both arms' train loss,
separately for discovery and confirmation seeds; a comparison is a finding
only when its confirmation Holm p < 0.05 with the sign it had on discovery.
The plan is a pure function of the finished runs, recomputed after each run:
a rerun skips what is done, and `--study --report-only` regenerates the same
bytes.

Runs are saved per (arm, seed, configuration) under <out>/runs/, with a
checkpoint while training, so a stopped study resumes; a saved run is reused
only under the same identity (`benchmarks.harness`: the configuration's
content, the corpus's md5 and the library numerics version). Output goes to
runs/lm/ (ignored by git) unless `--out` names a folder (the committed
reference runs: benchmarks/results/lm). The report (table.md, results.json
and the RESULTS.md section: `benchmarks.reports.lm`) is generated from every
run in the folder; a study's report from its plan read against those runs
(`study_state`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import math
import pathlib
import sys
import time
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness, study as study_lib, training
from benchmarks.models import GPT
from benchmarks.reports import lm as report_lib

REFERENCE_DIR = harness.REFERENCE_ROOT / "lm"
DEFAULT_DATA = pathlib.Path("..") / "shared" / "data" / "tinyshakespeare.txt"
CORPUS_MD5 = "6fb458f1232090904fb40fe944165e91"
ARMS = ("adamw", "stiefel", "rsgd", "stiefel_muon", "muon", "qk_norm",
        "orthogonal_init")
# Arms whose Q/K parts start orthonormal (the polar factor of nanoGPT's init).
ORTHONORMAL_START = ("stiefel", "rsgd", "stiefel_muon", "orthogonal_init")
# Fields that only one arm reads: kept out of the other arms' identity, so
# tuning one arm never invalidates another's runs.
ARM_FIELDS = {"stiefel": ("stiefel_learning_rate", "max_step_norm"),
              "rsgd": ("rsgd_learning_rate",),
              "stiefel_muon": ("stiefel_muon_learning_rate",),
              "muon": ("muon_learning_rate",)}


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run but its seed (nanoGPT's names)."""
  arm: str = "adamw"
  n_layer: int = 4
  n_head: int = 4
  n_embd: int = 128
  block_size: int = 64
  batch_size: int = 12
  dropout: float = 0.0
  max_iters: int = 2000
  lr_decay_iters: int = 2000
  warmup_iters: int = 100
  learning_rate: float = 1e-3
  min_lr: float = 1e-4
  beta1: float = 0.9
  beta2: float = 0.99
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  eval_interval: int = 250
  eval_iters: int = 20
  # Stiefel Q/K peak lr and trust region: chosen on validation (seed 100,
  # 500 iters) from (0.03, 0.1), (0.1, 0.1), (0.3, 0.3), (1, 1).
  stiefel_learning_rate: float = 0.3
  max_step_norm: float = 0.3
  rsgd_learning_rate: float = 0.1
  stiefel_muon_learning_rate: float = 0.01
  muon_learning_rate: float = 1e-3


# nanoGPT's published character-level Shakespeare runs (README): the small
# CPU command and the shakespeare_char (GPU) config (their val losses:
# `benchmarks.reports.lm.PUBLISHED`).
# GPU: evaluated every 500 iterations (nanoGPT: 250) with nanoGPT's 200
# batches, to leave time for more seeds on one GPU.
CPU = Config()
GPU = Config(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64,
             dropout=0.2, max_iters=5000, lr_decay_iters=5000,
             eval_interval=500, eval_iters=200)
QUICK = Config(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=8,
               max_iters=30, lr_decay_iters=30, warmup_iters=5,
               eval_interval=10, eval_iters=4)
PRESETS = {"cpu": CPU, "gpu": GPU, "quick": QUICK}


def identity_config(cfg: Config) -> dict:
  """The configuration as a run's identity sees it: without the fields of
  the other arms."""
  others = {f for arm, fs in ARM_FIELDS.items() if arm != cfg.arm for f in fs}
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in others}


# --------------------------------------------------------------------------
# Data.


def default_data() -> pathlib.Path:
  return (harness.REPO / DEFAULT_DATA).resolve()


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray   # int32 token ids
  val: np.ndarray
  vocab_size: int
  md5: str

  @property
  def data_id(self) -> str:
    return f"tinyshakespeare:md5={self.md5}"


@functools.lru_cache(maxsize=4)
def load_corpus(path: str) -> Corpus:
  """The corpus at `path`: vocabulary of its sorted characters, 90/10 split
  (nanoGPT's prepare.py). Warns if it is not the published corpus."""
  raw = pathlib.Path(path).read_bytes()
  md5 = hashlib.md5(raw).hexdigest()
  if md5 != CORPUS_MD5:
    print(f"warning: {pathlib.Path(path).name} has md5 {md5}, not tiny"
          f" Shakespeare's {CORPUS_MD5}; the published references do not"
          " apply.", file=sys.stderr)
  text = raw.decode("utf-8")
  chars = sorted(set(text))
  stoi = {c: i for i, c in enumerate(chars)}
  ids = np.array([stoi[c] for c in text], dtype=np.int32)
  n = int(len(ids) * 0.9)
  return Corpus(ids[:n], ids[n:], len(chars), md5)


def get_batch(data: jax.Array, key: jax.Array, batch_size: int,
              block_size: int):
  """nanoGPT's get_batch: `batch_size` random windows and their shifts."""
  ix = jax.random.randint(key, (batch_size,), 0, data.shape[0] - block_size)
  window = lambda i: jax.lax.dynamic_slice(data, (i,), (block_size + 1,))
  w = jax.vmap(window)(ix)
  return w[:, :-1], w[:, 1:]


def make_model(cfg: Config, vocab_size: int) -> GPT:
  return GPT(vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
             cfg.dropout, qk_norm=cfg.arm == "qk_norm")


def frames(cfg: Config) -> dict:
  """The frame selector of the fused kernel: q and k thirds, per head."""
  return {r"c_attn/kernel$": so.fused_qkv(cfg.n_head)}


def initial_params(cfg: Config, vocab_size: int, seed: int):
  """nanoGPT's initialisation from the seed (the same for every arm); the
  orthonormal-start arms replace each head's q and k by its polar factor."""
  model = make_model(cfg, vocab_size)
  x = jnp.zeros((1, cfg.block_size), jnp.int32)
  params = model.init(jax.random.fold_in(jax.random.PRNGKey(seed), 0),
                      x)["params"]
  if cfg.arm in ORTHONORMAL_START:
    params = so.orthonormalize(params, frames(cfg))
  return params


def n_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def loss_fn(model: GPT, params, x, y, dropout_key=None):
  rngs = None if dropout_key is None else {"dropout": dropout_key}
  logits = model.apply({"params": params}, x,
                       deterministic=dropout_key is None, rngs=rngs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --------------------------------------------------------------------------
# Optimizers.


def lr_schedule(cfg: Config, peak: float) -> optax.Schedule:
  """nanoGPT's get_lr with peak `peak` and floor peak * min_lr / lr:
  linear warmup peak (it + 1) / (warmup + 1), cosine to the floor at
  lr_decay_iters, the floor after."""
  floor = peak * cfg.min_lr / cfg.learning_rate

  def lr(it):
    it = jnp.asarray(it, jnp.float32)
    warm = peak * (it + 1) / (cfg.warmup_iters + 1)
    ratio = jnp.clip((it - cfg.warmup_iters)
                     / max(cfg.lr_decay_iters - cfg.warmup_iters, 1), 0, 1)
    cos = floor + 0.5 * (1 + jnp.cos(jnp.pi * ratio)) * (peak - floor)
    return jnp.where(it < cfg.warmup_iters, warm,
                     jnp.where(it > cfg.lr_decay_iters, floor, cos))

  return lr


def decay_mask(params):
  """nanoGPT's configure_optimizers: decay every parameter of rank >= 2
  (kernels and both embeddings), not the LayerNorm / RMSNorm scales."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def nanogpt_adamw(cfg: Config) -> optax.GradientTransformation:
  return optax.adamw(lr_schedule(cfg, cfg.learning_rate), cfg.beta1,
                     cfg.beta2, eps=1e-8, weight_decay=cfg.weight_decay,
                     mask=decay_mask)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """The arm's optimizer, after one global-norm clip of the whole gradient.

  `muon` (`training.per_head_muon`): optax.contrib.muon's dimension
  numbers address whole axes of a leaf, not the q and k thirds of a fused
  (d, 3 d) kernel split per head; `so.frame_partition` hands it exactly
  those views, (2, n_head, d, head_dim) per layer, the same per-head
  matrices the Stiefel arms train, and maps its update back into the fused
  kernel (the v third and every other weight on nanoGPT's AdamW). It runs
  unconstrained (orthonormal_start='project' only skips the start check;
  Muon has no retraction).
  """
  adamw = nanogpt_adamw(cfg)
  sched = functools.partial(lr_schedule, cfg)
  sel = frames(cfg)
  if cfg.arm in ("adamw", "qk_norm", "orthogonal_init"):
    tx = adamw
  elif cfg.arm == "stiefel":
    tx = so.stiefel_attention(
        sched(cfg.learning_rate), frames=sel,
        stiefel_learning_rate=sched(cfg.stiefel_learning_rate),
        b1=cfg.beta1, b2=cfg.beta2, max_step_norm=cfg.max_step_norm,
        euclidean_tx=adamw)
  elif cfg.arm == "rsgd":
    tx = so.stiefel_attention(
        sched(cfg.learning_rate), frames=sel,
        stiefel_tx=so.riemannian_sgd(sched(cfg.rsgd_learning_rate)),
        euclidean_tx=adamw)
  elif cfg.arm == "stiefel_muon":
    tx = so.stiefel_attention(
        sched(cfg.learning_rate), frames=sel,
        stiefel_tx=so.stiefel_muon(sched(cfg.stiefel_muon_learning_rate)),
        euclidean_tx=adamw)
  elif cfg.arm == "muon":
    muon = training.per_head_muon(sched(cfg.muon_learning_rate),
                                  cfg.weight_decay)
    tx = so.frame_partition(muon, adamw, sel, orthonormal_start="project")
  else:
    raise ValueError(f"arm must be one of {ARMS}; got {cfg.arm!r}.")
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)


# --------------------------------------------------------------------------
# Training and evaluation (jitted; lax.scan over chunks of steps).


def keys(seed: int):
  """(batch, dropout, eval) root keys of a seed; per step: fold_in(step)."""
  root = jax.random.PRNGKey(seed)
  return tuple(jax.random.fold_in(root, i) for i in (1, 2, 3))


def train_config(cfg: Config) -> Config:
  """cfg as one training chunk reads it: orthogonal_init trains as adamw
  (it differs in its start only), and the run's length and evaluation size
  are not read. Runs that agree here share one compiled chunk (the same
  function, so the same numbers)."""
  arm = "adamw" if cfg.arm == "orthogonal_init" else cfg.arm
  return dataclasses.replace(cfg, arm=arm, max_iters=0, eval_iters=0)


def eval_config(cfg: Config) -> Config:
  """cfg as the evaluations read it (the model, batch and evaluation
  sizes, not the optimizer): runs that agree here share one compiled
  evaluation."""
  return Config(arm="qk_norm" if cfg.arm == "qk_norm" else "adamw",
                n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                block_size=cfg.block_size, batch_size=cfg.batch_size,
                dropout=cfg.dropout, eval_iters=cfg.eval_iters)


@functools.lru_cache(maxsize=None)
def chunk_fn(cfg: Config, vocab_size: int):
  """jit(carry, start, train, seed keys) -> (carry, mean train loss) over
  `eval_interval` steps of `training.train_chunk`, step `it`'s batch (and
  dropout key) folded from the seed's keys."""
  model, tx = make_model(cfg, vocab_size), make_optimizer(cfg)

  def batch_of(it, data, batch_key, drop_key):
    x, y = get_batch(data, jax.random.fold_in(batch_key, it), cfg.batch_size,
                     cfg.block_size)
    return x, y, jax.random.fold_in(drop_key, it) if cfg.dropout > 0 else None

  train = training.train_chunk(lambda p, x, y, dk: loss_fn(model, p, x, y, dk),
                               tx, batch_of)

  def chunk(carry, start, data, batch_key, drop_key):
    carry, loss, _ = train(carry, start + jnp.arange(cfg.eval_interval), data,
                           batch_key, drop_key)
    return carry, loss

  return training.jit(chunk, donate_argnums=0)


@functools.lru_cache(maxsize=None)
def estimate_fn(cfg: Config, vocab_size: int):
  """jit(params, train, val, eval key, step) -> nanoGPT's estimate_loss:
  mean loss of eval_iters random batches of each split, and the isometry
  error of the Q/K frames (mean over every head)."""
  model = make_model(cfg, vocab_size)

  def split_loss(params, data, key):
    def one(k):
      return loss_fn(model, params, *get_batch(data, k, cfg.batch_size,
                                               cfg.block_size))
    return jax.lax.map(one, jax.random.split(key, cfg.eval_iters)).mean()

  def estimate(params, train, val, key, it):
    key = jax.random.fold_in(key, it)
    iso = so.frame_isometry_errors(params, frames(cfg))
    return dict(train_loss=split_loss(params, train, jax.random.fold_in(key, 0)),
                val_loss=split_loss(params, val, jax.random.fold_in(key, 1)),
                qk_iso=jnp.mean(jnp.concatenate(
                    [e.ravel() for e in iso.values()])))

  return training.jit(estimate)


@functools.lru_cache(maxsize=None)
def full_loss_fn(cfg: Config, vocab_size: int, batch: int = 64):
  """jit(params, tokens) -> mean loss over every next-token prediction in
  the non-overlapping windows of block_size (tokens beyond the last full
  window dropped)."""
  model = make_model(cfg, vocab_size)

  def full(params, tokens):
    n = (tokens.shape[0] - 1) // cfg.block_size
    idx = jnp.arange(n * cfg.block_size)
    x = tokens[idx].reshape(n, cfg.block_size)
    y = tokens[idx + 1].reshape(n, cfg.block_size)
    pad = -n % batch
    x = jnp.concatenate([x, jnp.zeros((pad, cfg.block_size), x.dtype)])
    y = jnp.concatenate([y, jnp.zeros((pad, cfg.block_size), y.dtype)])
    w = (jnp.arange(n + pad) < n).astype(jnp.float32)

    def one(args):
      xb, yb, wb = args
      logits = model.apply({"params": params}, xb)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
      return (ce.mean(-1) * wb).sum()

    shape = lambda a: a.reshape((-1, batch) + a.shape[1:])
    return jax.lax.map(one, (shape(x), shape(y), shape(w))).sum() / n

  return training.jit(full)


# --------------------------------------------------------------------------
# One run, saved and resumable.


def run_name(cfg: Config, seed: int, data_id: str) -> str:
  """<arm>_seed<seed>_<hash of the configuration and data>."""
  return f"{cfg.arm}_seed{seed}_{harness.digest([identity_config(cfg), data_id], 8)}"


def check_config(cfg: Config) -> None:
  if cfg.arm not in ARMS:
    raise SystemExit(f"arm must be one of {', '.join(ARMS)}; got {cfg.arm!r}.")
  if cfg.max_iters % cfg.eval_interval:
    raise SystemExit(f"max_iters = {cfg.max_iters} must be a multiple of"
                     f" eval_interval = {cfg.eval_interval}.")
  if cfg.n_embd % cfg.n_head:
    raise SystemExit(f"n_embd = {cfg.n_embd} is not divisible by n_head ="
                     f" {cfg.n_head}.")


def train_run(cfg: Config, seed: int, corpus: Corpus,
              out: Optional[pathlib.Path] = None, *, command: str = "",
              save_every_s: float = 60.0, log=print,
              max_iters: Optional[int] = None) -> dict:
  """Trains (cfg, seed) to cfg.max_iters (or, not saved, to `max_iters`: a
  timing probe), resuming from out's saved run of the same identity
  (`training.train_run`); a finished saved run is returned as it is."""
  check_config(cfg)
  ident = harness.identity(identity_config(cfg), corpus.data_id)
  name = run_name(cfg, seed, corpus.data_id)
  train, val = jnp.asarray(corpus.train), jnp.asarray(corpus.val)
  bkey, dkey, ekey = keys(seed)
  estimate, chunk = (estimate_fn(eval_config(cfg), corpus.vocab_size),
                     chunk_fn(train_config(cfg), corpus.vocab_size))
  lr = lr_schedule(cfg, cfg.learning_rate)

  def start():
    params = initial_params(cfg, corpus.vocab_size, seed)
    run = dict(name=name, arm=cfg.arm, seed=seed,
               block=harness.seed_block(seed), config=identity_config(cfg),
               identity=ident, data=corpus.data_id, **harness.versions(),
               machine=harness.machine(), trained_by=[],
               n_params=n_params(params), wall_s=0.0, cpu_s=0.0, final=None,
               history={k: [] for k in ("step", "train_loss", "val_loss",
                                        "qk_iso", "lr", "chunk_loss",
                                        "wall_s")})
    return run, (params, make_optimizer(cfg).init(params))

  def record(run, carry, it, chunk_loss, wall_s):
    hist = run["history"]
    m = {k: float(v) for k, v in estimate(carry[0], train, val, ekey,
                                          it).items()}
    for k, v in m.items():
      hist[k].append(v)
    hist["step"].append(it)
    hist["lr"].append(float(lr(max(it - 1, 0))))
    hist["chunk_loss"].append(None if chunk_loss is None
                              else float(chunk_loss))
    hist["wall_s"].append(round(wall_s, 2))
    log(f"  {run['name']} step {it}: train {m['train_loss']:.4f}, val"
        f" {m['val_loss']:.4f} ({hist['wall_s'][-1]:.0f} s)")

  def finish(run, carry):
    hist = run["history"]
    full = float(full_loss_fn(eval_config(cfg), corpus.vocab_size)(carry[0],
                                                                  val))
    return dict(step=hist["step"][-1], train_loss=hist["train_loss"][-1],
                val_loss=hist["val_loss"][-1], val_loss_full=full,
                qk_iso=hist["qk_iso"][-1])

  store = (harness.RunStore(out) if out is not None and max_iters is None
           else None)
  return training.train_run(
      store, name, ident, start=start,
      chunk=lambda carry, it: chunk(carry, jnp.int32(it), train, bkey, dkey),
      record=record, every=cfg.eval_interval,
      stop=cfg.max_iters if max_iters is None else max_iters,
      finish=finish if max_iters is None else None, command=command,
      save_every_s=save_every_s)


# --------------------------------------------------------------------------
# The study (issue 14): fair tuning on validation, then paired seeds, as one
# resumable command (`--study`). `benchmarks.study` plans it from the
# finished runs, so a rerun recomputes the same plan, skips what is done and
# picks up where it stopped; what is the LM's own is below: its grids, the
# configuration of each planned run, the nanoGPT reference and its timing.

# The AdamW recipes tune AdamW's own lr and weight decay; every other arm
# tunes its Q/K group on top of adamw's chosen lr and weight decay (its
# non-Q/K weights are trained by that AdamW).
OWN_ADAMW = ("adamw", "qk_norm", "orthogonal_init")
# min_lr = lr / 10: nanoGPT's floor, and that of every run made so far.
LR_FLOOR = 10
# 3 half-decade points per hyperparameter, for every arm (fair tuning).
ADAMW_GRID = (("learning_rate", (1e-3, 3e-3, 1e-2)),
              ("weight_decay", (0.03, 0.1, 0.3)))
STAGES = ("reference",) + study_lib.STAGES


@dataclasses.dataclass(frozen=True)
class Study(study_lib.Study):
  """The shared study (`benchmarks.study.Study`: arms with their grids,
  axes ((Config field, values), ...), tuning seeds, main and other seeds)
  at the LM's settings, each tuning point scored by the mean over the
  tuning seeds of the whole-split validation loss (lower is better).

  base: the paired runs' configuration (its arm is ignored); the nanoGPT
  reference is base as it is (AdamW at nanoGPT's published settings), its
  own record at reference_seeds. tune_iters: the tuning runs' schedule
  (max_iters = lr_decay_iters; the rest as base).
  """
  higher_is_better: bool = False
  base: Config = CPU
  tune_iters: int = 500
  reference_seeds: tuple = ()


def study_arms(grids: Sequence[tuple], main=("adamw", "stiefel")) -> tuple:
  """The arms of grids ((arm, axes), ...), in that order: the main ones
  tuned and paired first, the AdamW recipes (OWN_ADAMW) on their own
  non-Q/K AdamW, the others on adamw's choice."""
  return tuple(study_lib.Arm(a, axes, own_base=a in OWN_ADAMW, main=a in main)
               for a, axes in grids)


# The study at nanoGPT's CPU config. Tuning on the 500-iteration schedule
# (decay to 500) on which the earlier tuning runs were made (those runs
# count where their identity, library version included, matches); tuning
# seeds 100-102 are neither discovery nor confirmation seeds.
# Grid centres: AdamW's earlier short-schedule best (4e-3, on its edge) and
# nanoGPT's weight decay; Stiefel's earlier choice (0.3, 0.3); for RSGD the
# Q/K tangent gradients' Frobenius norm per head (about 3e-3 at the start,
# after the clip), so that lr 10 moves a frame as far as Stiefel-Adam's
# lr 0.03-0.3; Stiefel-Muon's step is lr sqrt(head_dim) in Frobenius (so
# 0.03 is about Stiefel-Adam's 0.2); Muon's consistent-RMS lr reads as
# AdamW's. Stiefel-Muon and Muon have nothing else to tune here (momentum
# 0.95 with Nesterov, Muon's defaults, as every Muon arm).
# Stiefel's cap is tuned relative to its lr (cap = ratio x lr): the step's
# norm is lr ||m|| / sqrt(v) with ||m|| <= sqrt(v) nearly always, so a cap
# at or above the lr does not bind (the CIFAR study's lr 0.1 runs at caps
# 0.1, 0.3 and 1 were one run), and an absolute cap axis would spend a
# third of the grid on copies of one point. Ratio 1 is the uncapped step.
STUDY = Study(
    arms=study_arms((
        ("adamw", ADAMW_GRID),
        ("stiefel", (("stiefel_learning_rate", (0.1, 0.3, 1.0)),
                     ("max_step_ratio", (0.1, 0.3, 1.0)))),
        ("rsgd", (("rsgd_learning_rate", (3.0, 10.0, 30.0)),)),
        ("stiefel_muon", (("stiefel_muon_learning_rate", (0.01, 0.03, 0.1)),)),
        ("muon", (("muon_learning_rate", (1e-3, 3e-3, 1e-2)),)),
        ("qk_norm", ADAMW_GRID),
        ("orthogonal_init", ADAMW_GRID))),
    tune_seeds=(100, 101, 102),
    main_seeds=harness.DISCOVERY_SEEDS[:8] + harness.CONFIRMATION_SEEDS[:8],
    other_seeds=harness.DISCOVERY_SEEDS[:6] + harness.CONFIRMATION_SEEDS[:6],
    base=CPU, tune_iters=500, reference_seeds=(0, 1, 2, 3))
# The whole path at toy size (`--study --quick`, well under a minute): one
# tuning seed, a 2-point AdamW grid (its best is on an edge, so it is
# widened once), one point for the others, one non-main arm, two seeds per
# block. Tuning on the paired schedule, so that each tuned configuration is
# compiled once for both. Width 8 (2 heads of 4): each run ends with the
# loss over the whole validation split, whose cost grows with the width.
QUICK_STUDY_BASE = dataclasses.replace(
    QUICK, n_layer=1, n_embd=8, block_size=8, max_iters=20,
    lr_decay_iters=20, eval_interval=10, eval_iters=2)
QUICK_STUDY = Study(
    arms=study_arms((
        ("adamw", (("learning_rate", (1e-3, 1e-2)), ("weight_decay", (0.1,)))),
        ("stiefel", (("stiefel_learning_rate", (0.3,)),
                     ("max_step_ratio", (1.0,)))),
        ("orthogonal_init", (("learning_rate", (1e-2,)),
                             ("weight_decay", (0.1,)))))),
    tune_seeds=(100,), main_seeds=(0, 1, 500, 501),
    other_seeds=(0, 1, 500, 501), max_extensions=1,
    base=QUICK_STUDY_BASE, tune_iters=20, reference_seeds=(0,))
STUDIES = {"full": STUDY, "quick": QUICK_STUDY}


def point_config(base: Config, arm: str, hp: Mapping, iters: int) -> Config:
  """base for `arm` on a schedule of `iters` iterations (decayed to the
  end) with the hyperparameters hp; an AdamW lr brings its floor lr / 10,
  a cap given relative to the Q/K lr (max_step_ratio) is that times it."""
  hp = dict(hp)
  if "learning_rate" in hp:
    hp["min_lr"] = float(f"{hp['learning_rate'] / LR_FLOOR:.6g}")
  if "max_step_ratio" in hp:
    hp["max_step_norm"] = float(
        f"{hp.pop('max_step_ratio') * hp['stiefel_learning_rate']:.6g}")
  return dataclasses.replace(base, arm=arm, max_iters=iters,
                             lr_decay_iters=iters, **hp)


def reference_config(study: Study) -> Config:
  """nanoGPT's AdamW at its published settings (the base as it is)."""
  return dataclasses.replace(study.base, arm="adamw")


def reference_tasks(study: Study) -> list:
  """The nanoGPT reference's runs: planned before the study's own."""
  return [study_lib.Task("reference", "adamw", {}, {}, s)
          for s in study.reference_seeds]


def task_config(study: Study, task: study_lib.Task) -> Config:
  """The configuration of a planned run: the reference as it is, a tuning
  run on the tuning schedule, a paired run on the base's."""
  if task.stage == "reference":
    return reference_config(study)
  iters = study.tune_iters if task.stage == "tune" else study.base.max_iters
  return point_config(study.base, task.arm, {**task.base, **task.point},
                      iters)


def task_name(study: Study, task: study_lib.Task, data_id: str) -> str:
  """The planned run's file name (`run_name`)."""
  return run_name(task_config(study, task), task.seed, data_id)


def finished(study: Study, done: Mapping, data_id: str) -> study_lib.Finished:
  """The finished runs `done` ({name: record}) as the shared study reads
  them, scored by the whole-split validation loss."""
  return study_lib.indexed(done, lambda t: task_name(study, t, data_id),
                           lambda r: r["final"]["val_loss_full"])


def plan(study: Study, done: Mapping, data_id: str,
         assume: bool = False) -> list:
  """Every run of the study that the finished runs `done` let us name, in
  the order to run them (`benchmarks.study.plan`): the nanoGPT reference,
  then the study's stages. A run two stages name (the tuned adamw at
  nanoGPT's point is the reference) is listed once, at the first."""
  return study_lib.plan(study, finished(study, done, data_id), assume,
                        reference_tasks(study))


def remaining(study: Study, done: Mapping, data_id: str,
              assume: bool = False) -> list:
  """The plan's runs that are not finished."""
  return study_lib.remaining(study, finished(study, done, data_id), assume,
                             reference_tasks(study))


# Timing: what the runs so far took, per iteration, at the same size.
TIMING_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                 "dropout", "eval_interval", "eval_iters")


def timing_key(config: Mapping) -> str:
  """The fields that set a run's time per iteration (not its lr)."""
  return harness.digest([config[f] for f in TIMING_FIELDS])


def iteration_rates(records: Sequence[dict]) -> dict:
  """{(timing key, arm or None): wall seconds per iteration} of the
  finished runs (compilation and evaluations included), per arm and pooled
  over the arms."""
  wall, iters = {}, {}
  for r in records:
    if r.get("final") is None or not r["final"].get("step"):
      continue
    for k in ((timing_key(r["config"]), r["config"]["arm"]),
              (timing_key(r["config"]), None)):
      wall[k] = wall.get(k, 0.0) + r["wall_s"]
      iters[k] = iters.get(k, 0) + r["final"]["step"]
  return {k: wall[k] / iters[k] for k in wall}


def run_seconds(cfg: Config, rates: Mapping,
                probed: Optional[tuple] = None) -> Optional[float]:
  """A run's expected wall time: from a probe (per_step, compile_s) if
  given (not counting the compilation: see `estimate`), else from the
  rates of the arm's runs of this size, else of any arm's (compilation
  included); None if nothing of this size has run."""
  if probed is not None:
    return projected_seconds([cfg], probed[0], 0.0)
  key = timing_key(dataclasses.asdict(cfg))
  rate = rates.get((key, cfg.arm), rates.get((key, None)))
  return None if rate is None else rate * cfg.max_iters


def estimate(study: Study, done: Mapping, data_id: str, rates: Mapping,
             probed: Optional[tuple] = None) -> dict:
  """The runs left to do per stage and their expected wall seconds
  (`benchmarks.study.estimate`; untimed where no run of that size has
  been timed), and the widening bound (`benchmarks.study.widening_bound`)."""
  compiled = set()
  seconds = lambda t: run_seconds(task_config(study, t), rates, probed)

  def expected_s(task: study_lib.Task) -> Optional[float]:
    s, tc = seconds(task), train_config(task_config(study, task))
    if probed is not None and tc not in compiled:
      compiled.add(tc)   # one compilation per config
      s += probed[1]
    return s

  est = study_lib.estimate(remaining(study, done, data_id, assume=True),
                           expected_s, STAGES)
  widen = study_lib.widening_bound(study, finished(study, done, data_id))
  n = len(study.tune_seeds)
  compile_s = 0.0 if probed is None else probed[1]
  return dict(est, widening_runs=sum(k * n for _, k in widen),
              widening_seconds=sum(k * (n * (seconds(t) or 0.0) + compile_s)
                                   for t, k in widen),
              source="probe" if probed else "records")


def estimate_text(study: Study, est: dict, n_timed: int) -> str:
  """The estimate as the line printed before a study starts."""
  r, s = est["runs"], est["seconds"]
  hours = lambda x: f"{x / 3600:.1f} h" if x >= 3600 else f"{x / 60:.1f} min"
  parts = [f"{r['reference']} reference",
           f"{r['tune']} tuning ({study.tune_iters} iterations, seeds"
           f" {harness.format_seeds(study.tune_seeds)})",
           f"{r['discovery'] + r['confirmation']} paired"
           f" ({study.base.max_iters} iterations: {r['discovery']} discovery,"
           f" {r['confirmation']} confirmation)"]
  src = ("the probe" if est["source"] == "probe" else
         f"the wall time per iteration of {n_timed} finished run(s) of this"
         " size, per arm where it has run, else of every arm")
  text = (f"study: {est['total_runs']} runs to do ({', '.join(parts)});"
          f" estimated {hours(est['total_seconds'])} wall on this machine"
          f" (tuning {hours(s['tune'])}, paired"
          f" {hours(s['discovery'] + s['confirmation'])}), from {src}")
  if est["untimed"] == est["total_runs"] and est["total_runs"]:
    text += ("; but no run of this size has been timed yet (--probe N"
             " times one)")
  elif est["untimed"]:
    text += (f"; {est['untimed']} run(s) of a size never timed are not"
             " counted (--probe N times one)")
  if est["provisional"]:
    text += (f"; {est['provisional']} run(s) wait on a tuning choice and are"
             " counted at their grid's centre")
  if est["widening_runs"]:
    text += (f"; up to {est['widening_runs']} more tuning runs"
             f" ({hours(est['widening_seconds'])}) if every unfinished grid"
             f" widens on every axis {study.max_extensions} time(s)")
  return text + "."



def run_study(study: Study, corpus: Corpus, out: pathlib.Path, *,
              command: str = "", log=print, time_budget: float = 0.0,
              rates: Optional[Mapping] = None, on_paired=None) -> int:
  """Runs the study's unfinished runs in plan order
  (`benchmarks.study.run_study`: the plan recomputed after each, so a
  tuning grid widens as its runs come in); stops before a run expected to
  end past time_budget seconds. on_paired() after each paired run (the
  tables so far). Returns the number of runs trained."""
  done = harness.finished_runs(harness.RunStore(out).records(),
                               current_version=True)
  rates = dict(rates or {})

  def execute(task: study_lib.Task) -> dict:
    cfg = task_config(study, task)
    rec = train_run(cfg, task.seed, corpus, out, command=command, log=log)
    if rec["name"] != run_name(cfg, task.seed, corpus.data_id) or rec.get(
        "final") is None:
      raise RuntimeError(f"{rec['name']}: not the finished run planned.")
    done[rec["name"]] = rec
    return rec

  def describe(task: study_lib.Task, rec: dict) -> str:
    f = rec["final"]
    return (f"{task.stage} {rec['name']}: train {f['train_loss']:.4f}, val"
            f" (whole split) {f['val_loss_full']:.4f}, {rec['wall_s']:.0f} s")

  return study_lib.run_study(
      lambda: remaining(study, done, corpus.data_id), execute,
      on_paired=on_paired, desc="lm study", describe=describe,
      expected_s=lambda t: run_seconds(task_config(study, t), rates),
      time_budget=time_budget, log=log, progress=False)


# The report (`benchmarks.reports.lm`): what it reads of the experiment,
# and the study's state, the plan read against the finished runs (any
# library version), which it turns into the study's tables.
REPORT = report_lib.Experiment(
    arms=ARMS, arm_fields=ARM_FIELDS,
    presets={n: dataclasses.asdict(c) for n, c in PRESETS.items()},
    own_adamw=OWN_ADAMW, lr_floor=LR_FLOOR)


def study_data(records) -> str:
  """The corpus a study's report is about: the published one if any run
  used it, else the first (sorted) that a run used."""
  ids = sorted({r["data"] for r in records})
  ref = f"tinyshakespeare:md5={CORPUS_MD5}"
  return ref if ref in ids or not ids else ids[0]


def study_state(study: Study, done: Mapping, data_id: str) -> dict:
  """The study's plan read against the finished runs `done` on `data_id`,
  as `benchmarks.reports.lm.study_summary` takes it: `benchmarks.study.state`
  (per arm its tuning, choice and paired runs; the planned runs and those
  not done) with the nanoGPT reference's configuration (a dict) and runs
  ({seed: record})."""
  runs, ref = finished(study, done, data_id), reference_tasks(study)
  return dict(
      study_lib.state(study, runs, ref),
      data=data_id, reference_config=dataclasses.asdict(
          reference_config(study)),
      reference={t.seed: r for t in ref if (r := runs.record(t)) is not None})


def write_report(out: pathlib.Path, study: Optional[str] = None) -> dict:
  """`benchmarks.reports.lm.report` of out's saved runs (results.json and
  table.md; its return value); with study (a key of STUDIES), the study's
  report from its state read from those runs."""
  records = harness.RunStore(out).records()
  if study is None:
    return report_lib.report(out, records, REPORT)
  spec = STUDIES[study]
  index = harness.finished_runs(records, current_version=False)
  return report_lib.report(out, records, REPORT, study, spec,
                           study_state(spec, index, study_data(index.values())))


# --------------------------------------------------------------------------
# Command line.


def _field_type(f: dataclasses.Field):
  return {"int": int, "float": float, "str": str}[
      f.type if isinstance(f.type, str) else f.type.__name__]


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks.lm",
                              description=__doc__.split("\n\n")[0])
  harness.add_common_args(
      p, default_out_dir="runs/lm", seeds_default="0",
      quick_help="toy size (2 layers, d 32, context 16, 30 iters), arms"
                 " adamw and stiefel, seed 0: well under a minute")
  p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                 help="cpu: nanoGPT's small CPU command (default); gpu: its"
                      " shakespeare_char config; quick: toy")
  p.add_argument("--arms", default=None,
                 help=f"comma list of {', '.join(ARMS)} (default adamw;"
                      " --quick: adamw,stiefel)")
  p.add_argument("--data", type=pathlib.Path, default=None,
                 help="the corpus (default ../shared/data/tinyshakespeare.txt"
                      " from the repository root)")
  p.add_argument("--study", action="store_true",
                 help="the whole study, resumable: every arm tuned on"
                      " validation (the same grid density), then paired"
                      " discovery and confirmation seeds, then its report;"
                      " prints its time estimate first (--quick: the same"
                      " path at toy size, well under a minute)")
  p.add_argument("--probe", type=int, default=0,
                 help="first time this many steps of the first run (not"
                      " saved) and print the projected wall time")
  p.add_argument("--dry-run", action="store_true",
                 help="with --probe or --study: print the projection and"
                      " stop")
  harness.add_time_budget_arg(p, "seed (--study: no run)")
  p.add_argument("--note", default="",
                 help="text written to <out>/notes.md (in every report)")
  p.add_argument("--quiet", action="store_true")
  for f in dataclasses.fields(Config):
    if f.name != "arm":
      p.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                     default=None,
                     help=f"{_field_type(f).__name__}; a comma list sweeps")
  return p.parse_args(argv)


def configs(args) -> list:
  """Every Config the command asks for: preset, overrides, sweeps, arms."""
  preset = args.preset or ("quick" if args.quick else "cpu")
  base = PRESETS[preset]
  arms = (args.arms or ("adamw,stiefel" if args.quick else "adamw")).split(",")
  sweeps = {}
  for f in dataclasses.fields(Config):
    val = getattr(args, f.name, None) if f.name != "arm" else None
    if val is not None:
      sweeps[f.name] = [_field_type(f)(v) for v in val.split(",")]
  out = []
  for arm in arms:
    names = [k for k in sweeps if k not in
             {x for a, fs in ARM_FIELDS.items() if a != arm for x in fs}]
    for vals in itertools.product(*(sweeps[k] for k in names)):
      cfg = dataclasses.replace(base, arm=arm, **dict(zip(names, vals)))
      if "max_iters" in names and "lr_decay_iters" not in sweeps:
        cfg = dataclasses.replace(cfg, lr_decay_iters=cfg.max_iters)
      check_config(cfg)
      if cfg not in out:
        out.append(cfg)
  return out


def measure_steps(cfg: Config, seed: int, corpus: Corpus,
                  steps: int) -> tuple:
  """(seconds per step, seconds to compile, steps timed): `steps` steps of
  cfg timed after one compiled chunk (nothing saved)."""
  pcfg = dataclasses.replace(cfg, eval_interval=math.gcd(steps,
                                                         cfg.max_iters))
  steps = max(steps, pcfg.eval_interval)
  t0 = time.time()
  train_run(pcfg, seed, corpus, None, max_iters=pcfg.eval_interval,
            log=lambda *_: None)
  t1 = time.time()
  train_run(pcfg, seed, corpus, None, max_iters=steps, log=lambda *_: None)
  t2 = time.time()
  compile_s = max(t1 - t0 - (t2 - t1) * pcfg.eval_interval / steps, 0.0)
  return (t2 - t1) / steps, compile_s, steps


def projected_seconds(cfgs: Sequence[Config], per_step: float,
                      compile_s: float) -> float:
  """The wall time of runs of cfgs at per_step seconds per training step
  (an evaluation of eval_iters batches of both splits costing about 2/3
  of a step per batch) and compile_s each to compile."""
  return sum(c.max_iters * per_step * (1 + 2 * c.eval_iters / 3
                                       / c.eval_interval) + compile_s
             for c in cfgs)


def probe(cfg: Config, seed: int, corpus: Corpus, steps: int, todo: list,
          log=print) -> float:
  """Times `steps` steps (after one compiled chunk) of cfg; returns and
  prints the projected wall time of the runs in `todo`."""
  per_step, compile_s, steps = measure_steps(cfg, seed, corpus, steps)
  total = projected_seconds(todo, per_step, compile_s)
  log(f"probe: {steps} steps of {cfg.arm} in {per_step * steps:.1f} s"
      f" ({1e3 * per_step:.1f} ms/step, about {compile_s:.0f} s to compile);"
      f" projected wall time of the {len(todo)} run(s) to do:"
      f" {total / 60:.1f} min")
  return total


def check_study_args(args) -> None:
  """--study fixes its arms, seeds and settings: refuse options that would
  quietly change them."""
  names = ("arms", "seeds", "preset") + tuple(
      f.name for f in dataclasses.fields(Config) if f.name != "arm")
  given = [f"--{n.replace('_', '-')}" for n in harness.given(args, names)]
  if given:
    raise SystemExit(f"--study fixes its arms, seeds and settings (see"
                     f" benchmarks/lm.py STUDY); drop {', '.join(given)}.")


def train_sweep(args, argv, corpus: Corpus, out: pathlib.Path, log) -> bool:
  """The configurations and seeds the options ask for (seed-major); False
  if --dry-run stopped after the probe."""
  seeds = args.seeds or (0,)
  cfgs = configs(args)
  store = harness.RunStore(out)
  todo = [(c, s) for c in cfgs for s in seeds
          if (r := store.load(run_name(c, s, corpus.data_id))) is None
          or r.get("final") is None or not harness.matches(r)]
  if args.probe and todo:
    probe(todo[0][0], todo[0][1], corpus, args.probe, [c for c, _ in todo],
          log)
    if args.dry_run:
      return False
  command = harness.command_line("benchmarks.lm", argv)
  per_seed = []

  def execute(seed: int) -> dict:   # seed-major: a stop leaves whole pairs
    ts = time.time()
    for cfg in cfgs:
      rec = train_run(cfg, seed, corpus, out, command=command, log=log)
      f = rec["final"]
      log(f"{rec['name']}: train {f['train_loss']:.4f}, val"
          f" {f['val_loss']:.4f}, val (whole split) {f['val_loss_full']:.4f},"
          f" {rec['wall_s']:.0f} s")
    per_seed.append(time.time() - ts)
    return {}

  # A seed's runs take as long as the slowest seed so far, with a margin.
  # (train_run reuses the finished runs.)
  study_lib.run_list(seeds, execute, desc="lm",
                     describe=lambda seed, _: f"seed {seed} done",
                     expected_s=lambda _: 1.1 * max(per_seed, default=0.0),
                     time_budget=args.time_budget, log=log, progress=False)
  return True


def train_study(name: str, args, argv, corpus: Corpus, out: pathlib.Path,
                log) -> Optional[dict]:
  """Prints the study's time estimate (from --probe, else from the finished
  runs' wall times), then runs what is left of it, writing the report
  after each paired run; with --dry-run returns the estimate instead."""
  study = STUDIES[name]
  records = harness.RunStore(out).records()
  done = harness.finished_runs(records, current_version=True)
  rates = iteration_rates(records)
  probed = None
  left = remaining(study, done, corpus.data_id, assume=True)
  if args.probe and left:
    per_step, compile_s, steps = measure_steps(
        task_config(study, left[0]), left[0].seed, corpus, args.probe)
    probed = (per_step, compile_s)
    log(f"probe: {steps} steps of {left[0].arm} in {per_step * steps:.1f} s"
        f" ({1e3 * per_step:.1f} ms/step, about {compile_s:.0f} s to"
        " compile)")
  est = estimate(study, done, corpus.data_id, rates, probed)
  size = timing_key(dataclasses.asdict(study.base))
  n_timed = sum(r.get("final") is not None and timing_key(r["config"]) == size
                for r in records)
  log(estimate_text(study, est, n_timed))
  if args.dry_run:
    return est
  run_study(study, corpus, out,
            command=harness.command_line("benchmarks.lm", argv), log=log,
            time_budget=args.time_budget, rates=rates,
            on_paired=lambda: write_report(out, name))
  return None


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  log = (lambda *_: None) if args.quiet else functools.partial(print,
                                                               flush=True)
  study = None
  if args.study:
    check_study_args(args)
    study = "quick" if args.quick else "full"
  folder = "lm" if study is None else f"lm_study{'_quick' * args.quick}"
  out = args.out or (REFERENCE_DIR if args.report_only and args.results_md
                     else harness.default_out(folder))
  if args.note:
    harness.write_text(out / "notes.md", args.note.strip() + "\n")
  with training.toy_compiler(args.quick):
    if not args.report_only:
      corpus = load_corpus(str(args.data or default_data()))
      if study is None:
        if not train_sweep(args, argv, corpus, out, log):
          return {}
      elif (est := train_study(study, args, argv, corpus, out,
                               log)) is not None:
        return dict(estimate=est)
  rep = write_report(out, study)
  if args.results_md:
    report_lib.write_section(args.results_md, rep)
  log(rep["table"])
  log(f"results: {harness.portable(out)}")
  return rep


if __name__ == "__main__":
  main()
