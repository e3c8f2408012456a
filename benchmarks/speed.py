"""What the Stiefel step costs: `stiefel_attention` against `optax.adamw`.

    python -m benchmarks.speed              # full tables (about 5 min on 2
                                            # CPU cores; 10-20 min where
                                            # OpenBLAS settings slow LAPACK)
    python -m benchmarks.speed --quick      # tiny shapes: a smoke test
    python -m benchmarks.speed --peer-only  # table 6 alone (geoopt)
    python -m benchmarks.speed --report-only --out benchmarks/results
                                            # speed.md from speed.json

The full run's time is mostly LAPACK: the SVD of 32 (4096, 128) frames may
use its whole child-process timeout (--timeout, 300 s) and report a hang.

Every time is the median, over repeated calls after two warm-up calls, of a
`jax.jit`-compiled function timed to `block_until_ready`. The functions of
one comparison are called in alternation (A, B, A, B, ...) in the same run,
so a change of machine load hits both sides alike; ratios are of medians.

Tables:

1. One optimizer update (`tx.update`, jitted; the apply is not timed) on
   (a) a GPT-2-small-shaped Flax-linen parameter tree: 12 layers, d = 768,
   12 heads of 64, MLP 3072, query/key/value kernels (768, 12, 64) and out
   kernels (12, 64, 768) as `MultiHeadDotProductAttention` names them, token
   embedding reduced to 8192 x 768; (b) a small patch ViT tree (d = 64,
   4 heads of 16, 64 tokens, 6 layers). Both optimizers see the same tree;
   `stiefel_attention` trains the 24 (resp. 12) query/key kernels per head.
   `stiefel_attention` is also timed with `stack_frames=True` and "auto"
   (equal-shape frames of all leaves as one batch; stacks up to 1 MiB), in
   the same alternation, and against its floor (table 2).
2. Where the update's time goes on the GPT-2 tree: AdamW on the Q/K leaves
   and on the rest, the Stiefel group alone, and the floor: the d x r x r
   products that any Stiefel step needs, timed on the same frames.
3. One training step (forward, backward, update, apply) of a small causal
   transformer language model, both optimizers.
4. Optimizer-state bytes of the Q/K kernels under both optimizers.
5. The polar retraction polar(W + xi) by `eigh` (of the r x r Gram matrix),
   Newton–Schulz (matmul only) and a thin SVD of W + xi, on a batch of
   d / r heads of (d, r) frames: time, and the isometry error
   max ||Q^T Q - I||_F for a tangent step of norm delta = 0.1 (the default
   trust region) and delta = 1. `eigh` and SVD run in a child process with
   a timeout: jaxlib's batched LAPACK calls can hang on some small CPU
   machines, and a hang is reported as such instead of stopping the run.

6. The peer library geoopt (PyTorch, CPU): one step of
   `geoopt.optim.RiemannianAdam` on `geoopt.EuclideanStiefel`
   `ManifoldParameter`s (`optimizer.step()`, gradients already set) beside
   one jitted `stiefel_adam` update plus `optax.apply_updates`, same lr
   (1e-3), same float32 frames and gradients (NumPy, fixed seed), on
   workload A, 24 leaves of (12, 768, 64) (GPT-2 small's Q/K kernels, one
   frame per head), and B, 8 leaves of (4, 64, 16) (the patch ViT's): ms
   per step of each, the ratio geoopt / ours, and the isometry error of
   each after 20 steps from the same frames. Both Adams keep one second
   moment per frame; ours caps the step (0.1) and retracts by polar
   (Newton–Schulz), geoopt retracts by QR. geoopt runs in a long-lived
   child process (benchmarks/peer_geoopt.py) under its own Python
   environment, so torch never enters ours; the parent asks it over a pipe
   to time k steps, then times k of ours, and so on in alternation; medians
   over the rounds. torch gets as many threads as the cores jax may use
   (`os.sched_getaffinity`). Where no peer Python is found, or it cannot
   import torch and geoopt, the table says "skipped" and why, and the rest
   of the run is unaffected. Set up the peer environment once (runs/ is
   git-ignored; torch is PyTorch's CPU build, from its index or from a
   wheel file of that build where there is no internet):

       python3 -m venv runs/peer-venv
       runs/peer-venv/bin/pip install torch \\
           --index-url https://download.pytorch.org/whl/cpu
       runs/peer-venv/bin/pip install geoopt numpy

   runs/peer-venv/bin/python is the default `--peer-python`; `--quick` runs
   the comparison on tiny shapes when it exists. `--peer-only --iters 3`
   took 5 min on 2 CPU cores that another job kept busy, mostly workload A
   (one geoopt step of its 288 frames: seconds).

7. The native layout (issue 13, item 1): the step's five products per
   leaf on GPT-2 small's 24 Q/K kernels (768, 12, 64), as einsums over the
   kernel's own axes with the momentum in kernel layout, against the frame
   view the library uses; ms, alternated, and the transposes and copies in
   each optimized program (`transposes`), which show where XLA moves data.

Results: `--out DIR` (default runs/speed for a full run, runs/speed_peer
with --peer-only, none for --quick; `--out benchmarks/results` refreshes the
committed figures) receives speed.json and speed.md (rendered by
`benchmarks.reports.speed`; `--report-only --out DIR` renders speed.md
again from DIR/speed.json). Machine load (`os.getloadavg`) is recorded
before and after, with the BLAS environment variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness
from benchmarks import peer_geoopt
from benchmarks.reports import speed as report_lib
from stiefel_optax import geometry

QK = re.compile(so.specs.QK_KERNEL)
ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS", "XLA_FLAGS")
# Runs write under runs/ (git-ignored); `--out benchmarks/results` refreshes
# the committed reference figures.
DEFAULT_OUT = str(harness.default_out("speed"))
DEFAULT_PEER_OUT = str(harness.default_out("speed_peer"))   # --peer-only


# --------------------------------------------------------------------------
# Timing.


def _versus_adamw(wall: dict, cpu: dict) -> dict:
  """Both optimizers' medians (ms) and the stiefel_attention / adamw ratios,
  wall-clock and CPU time."""
  return {"adamw_ms": 1e3 * wall["adamw"],
          "stiefel_ms": 1e3 * wall["stiefel_attention"],
          "ratio": wall["stiefel_attention"] / wall["adamw"],
          "adamw_cpu_ms": 1e3 * cpu["adamw"],
          "stiefel_cpu_ms": 1e3 * cpu["stiefel_attention"],
          "cpu_ratio": cpu["stiefel_attention"] / cpu["adamw"]}


def _stacked(wall: dict) -> dict:
  """The stack_frames settings' medians (ms) and ratios to adamw."""
  return {"stacked_ms": 1e3 * wall[STACKED],
          "stacked_ratio": wall[STACKED] / wall["adamw"],
          "auto_ms": 1e3 * wall[AUTO], "auto_ratio": wall[AUTO] / wall["adamw"]}


def median_times(fns: Dict[str, Callable[[], Any]], iters: int,
                 warmup: int = 2, cpu: Optional[dict] = None
                 ) -> Dict[str, float]:
  """Median wall-clock seconds per call of each zero-argument jitted closure.

  Each function is called `warmup` times first (compilation), then the
  functions are called in alternation `iters` times each, every call timed
  to `jax.block_until_ready` of its result. If `cpu` is a dict it receives
  the median process CPU seconds per call (all threads): on a machine that
  other jobs share, wall time includes waiting for a core and CPU time does
  not, so CPU-time ratios are the steadier measure of the work done.
  """
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  wall = {name: [] for name in fns}
  proc = {name: [] for name in fns}
  for _ in range(iters):
    for name, fn in fns.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      proc[name].append(time.process_time() - start_cpu)
      wall[name].append(time.perf_counter() - start)
  if cpu is not None:
    cpu.update({name: statistics.median(s) for name, s in proc.items()})
  return {name: statistics.median(s) for name, s in wall.items()}


def _call(fn, *args):
  return lambda: fn(*args)


# --------------------------------------------------------------------------
# Parameter trees (Flax linen naming).


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  name: str
  layers: int
  d: int
  heads: int
  head_dim: int
  mlp: int
  vocab: int           # token embedding rows (GPT-2: reduced) or patch dim
  tokens: int          # position embedding rows
  classes: int = 0     # a classifier head (ViT) if > 0


GPT2_SMALL = TreeConfig("GPT-2 small (12 x d768, 12 heads of 64, MLP 3072,"
                        " vocab reduced to 8192)", 12, 768, 12, 64, 3072,
                        8192, 1024)
PATCH_VIT = TreeConfig("patch ViT (6 x d64, 4 heads of 16, MLP 256, 64"
                       " tokens)", 6, 64, 4, 16, 256, 48, 64, classes=10)
GPT2_QUICK = TreeConfig("GPT-2-like, quick (1 x d128, 2 heads of 64)", 1, 128,
                        2, 64, 512, 256, 64)
VIT_QUICK = TreeConfig("patch ViT, quick (1 x d64, 4 heads of 16)", 1, 64, 4,
                       16, 256, 48, 64, classes=10)


def np_frames(rng, shape):
  """Haar frames (..., d, r) from NumPy (sign-corrected QR), float32."""
  q, r = np.linalg.qr(rng.standard_normal(shape))
  q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  return q.astype(np.float32)


def param_tree(cfg: TreeConfig, seed: int = 0):
  """A nested dict shaped like the Flax linen params of a pre-LN transformer
  with `MultiHeadDotProductAttention` (query/key/value kernels
  (d, heads, head_dim), out kernel (heads, head_dim, d)); the query/key
  kernels have orthonormal per-head frames."""
  rng = np.random.default_rng(seed)
  d, h, hd = cfg.d, cfg.heads, cfg.head_dim

  def normal(*shape):
    return jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)

  def frames():
    return jnp.asarray(np.transpose(np_frames(rng, (h, d, hd)), (1, 0, 2)))

  def norm():
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

  def dense(n_in, n_out):
    return {"kernel": normal(n_in, n_out), "bias": jnp.zeros(n_out)}

  params = {"embed": ({"embedding": normal(cfg.vocab, d)} if not cfg.classes
                      else dense(cfg.vocab, d)),
            "pos_embed": normal(cfg.tokens, d)}
  for i in range(cfg.layers):
    params[f"block_{i}"] = {
        "ln_1": norm(),
        "attn": {"query": {"kernel": frames(), "bias": jnp.zeros((h, hd))},
                 "key": {"kernel": frames(), "bias": jnp.zeros((h, hd))},
                 "value": {"kernel": normal(d, h, hd),
                           "bias": jnp.zeros((h, hd))},
                 "out": {"kernel": normal(h, hd, d), "bias": jnp.zeros(d)}},
        "ln_2": norm(),
        "mlp": {"fc": dense(d, cfg.mlp), "proj": dense(cfg.mlp, d)}}
  params["ln_f"] = norm()
  if cfg.classes:
    params["head"] = dense(d, cfg.classes)
  return params


def _gradients(params, seed: int = 1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(1e-3 * rng.standard_normal(x.shape), x.dtype),
      params)


def _is_qk(path) -> bool:
  return bool(QK.search(so.path_str(path)))


def _split_qk(tree):
  """(Q/K leaves, other leaves) as two flat dicts keyed by path."""
  qk, rest = {}, {}
  for p, x in jax.tree_util.tree_leaves_with_path(tree):
    (qk if _is_qk(p) else rest)[so.path_str(p)] = x
  return qk, rest


STACKED = "stiefel_attention, stack_frames"
AUTO = "stiefel_attention, stack_frames auto"


def optimizers(lr: float = 1e-3):
  return {"adamw": optax.adamw(lr, weight_decay=1e-4),
          "stiefel_attention": so.stiefel_attention(lr, weight_decay=1e-4),
          STACKED: so.stiefel_attention(lr, weight_decay=1e-4,
                                        stack_frames=True),
          AUTO: so.stiefel_attention(lr, weight_decay=1e-4,
                                     stack_frames="auto")}


def _jit_update(tx, params, grads):
  """A jitted update and a state after one step (so the moments are
  non-zero)."""
  update = jax.jit(tx.update)
  state = tx.init(params)
  _, state = update(grads, state, params)
  return update, state


def update_comparison(cfg: TreeConfig, iters: int,
                      profile: bool = False) -> Dict[str, Any]:
  """One update of each optimizer on the tree of `cfg`, alternated.

  With `profile`, the parts of the update are timed in the same alternation:
  AdamW on the Q/K kernels and on the other leaves, `stiefel_adam` on the
  Q/K frames alone, and the floor (`_floor_products` on the same frames).
  """
  params = param_tree(cfg)
  grads = _gradients(params)
  qk, rest = _split_qk(params)
  gqk, grest = _split_qk(grads)
  parts = {name: (tx, params, grads) for name, tx in optimizers().items()}
  if profile:
    view = so.FrameSpec(rows=0, cols=2)       # (d, heads, head_dim)
    qk_frames = {k: so.to_frames(x, view) for k, x in qk.items()}
    gqk_frames = {k: so.to_frames(x, view) for k, x in gqk.items()}
    parts.update({
        "adamw, other leaves": (optimizers()["adamw"], rest, grest),
        "adamw, Q/K kernels": (optimizers()["adamw"], qk, gqk),
        "stiefel_adam, Q/K frames (frame view given)": (
            so.stiefel_adam(1e-3), qk_frames, gqk_frames)})
  fns = {}
  for name, (tx, p, g) in parts.items():
    update, state = _jit_update(tx, p, g)
    fns[name] = _call(update, g, state, p)
  if profile:
    w = jnp.concatenate(list(qk_frames.values()))
    g = jnp.concatenate(list(gqk_frames.values()))
    fns[FLOOR] = _call(jax.jit(_floor_products), w, g, g)
  c = {}
  t = median_times(fns, iters, cpu=c)
  res = {"tree": cfg.name,
         "params": sum(x.size for x in jax.tree.leaves(params)),
         "qk_params": sum(x.size for x in qk.values()),
         "qk_frames": sum(x.size // (cfg.d * cfg.head_dim) for x in qk.values()),
         **_versus_adamw(t, c),
         **_stacked(t)}
  if profile:
    frames, d, r = w.shape
    floor = t["adamw, other leaves"] + t[FLOOR]
    floor_cpu = c["adamw, other leaves"] + c[FLOOR]
    res["floor_ms"] = 1e3 * floor
    res["floor_ratio"] = t["stiefel_attention"] / floor
    res["floor_cpu_ratio"] = c["stiefel_attention"] / floor_cpu
    res["stacked_floor_ratio"] = t[STACKED] / floor
    res["auto_floor_ratio"] = t[AUTO] / floor
    res["profile"] = {
        "frames": int(frames), "d": int(d), "r": int(r),
        "parts_ms": {k: 1e3 * v for k, v in t.items()},
        "parts_cpu_ms": {k: 1e3 * v for k, v in c.items()},
        "floor_gflops_per_s": 5 * 2 * frames * d * r * r / t[FLOOR] / 1e9}
  return res


FLOOR = "floor: 5 products d*r*r per frame"


def _floor_products(w, g, m):
  """Five batched d x r x r products, the arithmetic any Stiefel step needs:
  W^T G, W^T m, W S (projection of the momentum mix), (W + xi)^T (W + xi)
  and (W + xi) Z (the retraction)."""
  b = geometry.gram(w, g)
  c = geometry.gram(w, m)
  m_new = m - w @ (b + c)
  a = w + 1e-3 * m_new
  return a @ geometry.gram(a)


# --------------------------------------------------------------------------
# The native layout: the step's products as einsums over the kernel's own
# axes, against the frame view.

NATIVE = "native layout: einsums over (d, heads, r), momentum in kernel layout"
VIEW = "frame view: (heads, d, r) views, momentum in view layout"


def _step_products(w, g, m, gram, times):
  """The five products of `_floor_products`, for one layout's `gram`
  (W^T G per head) and `times` (frame times an r x r matrix per head);
  returns the step and the new momentum."""
  m_new = m - times(w, gram(w, g) + gram(w, m))
  a = w + 1e-3 * m_new
  return times(a, gram(a, a)) - w, m_new


def _native_step(w, g, m):
  """On (d, heads, r) kernels: nothing is transposed in this program."""
  gram = lambda a, b: jnp.einsum("dhr,dhs->hrs", a, b)
  times = lambda a, s: jnp.einsum("dhr,hrs->dhs", a, s)
  return _step_products(w, g, m, gram, times)


def _view_step(w, g, m):
  """As the library does it: W and G viewed as (heads, d, r) frames, the
  momentum kept in that view, the step put back in the kernel's layout."""
  view = lambda x: jnp.swapaxes(x, 0, 1)
  u, m_new = _step_products(view(w), view(g), m, geometry.gram,
                            lambda a, s: a @ s)
  return view(u), m_new


def transposes(compiled_text: str) -> int:
  """Transpose and copy instructions in an optimized HLO module's text
  (inside fusions included): the data movement the layout costs."""
  return len(re.findall(r"\b(?:transpose|copy)\(", compiled_text))


# GPT-2 small's 24 Q/K kernels (d, heads, head_dim).
LAYOUT_WORKLOAD = (24, 768, 12, 64)


def layout_comparison(leaves: int, d: int, heads: int, r: int, iters: int
                      ) -> Dict[str, Any]:
  """The step's five products on `leaves` (d, heads, r) kernels, in the
  native layout and through the frame view, alternated: ms and the
  transposes XLA's optimized program holds for each (item 1 of the speed
  issue: does computing in the kernel's layout remove the copies?)."""
  rng = np.random.default_rng(0)
  w, g = ([jnp.asarray(rng.standard_normal((d, heads, r)), jnp.float32)
           for _ in range(leaves)] for _ in "wg")
  m_view = [jnp.swapaxes(x, 0, 1) for x in g]
  step = {NATIVE: (_native_step, g), VIEW: (_view_step, m_view)}
  fns, count = {}, {}
  for name, (fn, m) in step.items():
    # One program for all leaves, each leaf its own products (as the
    # library's per-leaf update).
    per_leaf = jax.jit(lambda w, g, m, fn=fn: jax.tree.map(fn, w, g, m))
    count[name] = transposes(per_leaf.lower(w, g, m).compile().as_text())
    fns[name] = _call(per_leaf, w, g, m)
  t = median_times(fns, iters)
  return {"leaves": leaves, "kernel": [d, heads, r],
          "backend": jax.default_backend(),
          "rows": [{"layout": name, "ms": 1e3 * t[name],
                    "transposes": count[name]} for name in step],
          "native_over_view": t[NATIVE] / t[VIEW]}


# --------------------------------------------------------------------------
# Training step of a small causal transformer LM (Flax linen).


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """The workload: a causal LM (`benchmarks.models`: pre-LN GELU blocks,
  logits at every position) and its batch."""
  vocab: int = 512
  seq: int = 64
  batch: int = 16
  d: int = 128
  heads: int = 4
  layers: int = 4
  mlp: int = 512

  def describe(self) -> str:
    return (f"causal LM: {self.layers} x d{self.d}, {self.heads} heads of"
            f" {self.d // self.heads}, MLP {self.mlp}, vocab {self.vocab},"
            f" batch {self.batch} x {self.seq} tokens")

  def model(self):
    # Imported here: flax is needed by this table only.
    from benchmarks import models  # pylint: disable=g-import-not-at-top
    return models.Transformer(models.pre_ln_gelu(
        d_model=self.d, num_heads=self.heads, d_mlp=self.mlp,
        num_classes=self.vocab, depth=self.layers, vocab_size=self.vocab,
        seq_len=self.seq, causal=True, readout="all"))


LM_FULL, LM_QUICK = LMConfig(), LMConfig(vocab=64, seq=16, batch=4, d=32,
                                         heads=2, layers=1, mlp=64)


def train_step_comparison(cfg: LMConfig, iters: int) -> Dict[str, Any]:
  model = cfg.model()
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  # Orthonormal per-head Q/K frames (NumPy QR: no compilation).
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.asarray(np.transpose(np_frames(
          rng, (x.shape[1], x.shape[0], x.shape[2])), (1, 0, 2)))
      if _is_qk(p) else x, params)

  def loss_fn(p, batch):
    logits = model.apply({"params": p}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()

  fns = {}
  for name, tx in optimizers().items():
    @jax.jit
    def step(p, s, batch, tx=tx):
      loss, g = jax.value_and_grad(loss_fn)(p, batch)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    p1, s1, _ = step(params, tx.init(params), tokens)
    fns[name] = _call(step, p1, s1, tokens)
  c = {}
  t = median_times(fns, iters, cpu=c)
  return {"model": cfg.describe(),
          "params": sum(x.size for x in jax.tree.leaves(params)),
          **_versus_adamw(t, c), **_stacked(t)}


# --------------------------------------------------------------------------
# Optimizer-state bytes of the Q/K kernels.


def _nbytes(x) -> int:
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def qk_state_bytes(cfg: TreeConfig) -> Dict[str, Any]:
  """Bytes of optimizer state held for the Q/K kernels.

  AdamW: its mu and nu leaves at Q/K paths. stiefel_attention: every array
  in the Stiefel group's state (mu in the frame view, one nu per frame, the
  step count).
  """
  params = param_tree(cfg)
  txs = optimizers()
  adamw = jax.eval_shape(txs["adamw"].init, params)
  adamw_bytes = sum(_nbytes(x) for p, x in
                    jax.tree_util.tree_leaves_with_path(adamw) if _is_qk(p))
  st = jax.eval_shape(txs["stiefel_attention"].init, params)
  group = st.stiefel
  st_bytes = sum(_nbytes(x) for x in jax.tree.leaves(group))
  qk, _ = _split_qk(params)
  return {"tree": cfg.name, "qk_param_bytes": sum(_nbytes(x) for x in qk.values()),
          "adamw_bytes": adamw_bytes, "stiefel_bytes": st_bytes,
          "ratio": st_bytes / adamw_bytes}


# --------------------------------------------------------------------------
# Retractions.

RETRACTION_SHAPES = ((64, 16), (768, 64), (4096, 128))
DELTAS = (0.1, 1.0)


def _tangent_step(w, delta, seed):
  """A tangent step at w of Frobenius norm delta per frame (NumPy)."""
  w = np.asarray(w, np.float64)
  g = np.random.default_rng(seed).standard_normal(w.shape)
  wtg = np.swapaxes(w, -1, -2) @ g
  xi = g - w @ (0.5 * (wtg + np.swapaxes(wtg, -1, -2)))
  xi *= delta / np.linalg.norm(xi, axis=(-2, -1), keepdims=True)
  return jnp.asarray(xi, jnp.float32)


def isometry_error_f64(q) -> float:
  """max ||Q^T Q - I||_F over the frames, Q^T Q formed in float64 (NumPy),
  so that it measures the float32 frame, not the rounding of its Gram
  matrix in float32."""
  q = np.asarray(q, np.float64)
  gram = np.swapaxes(q, -1, -2) @ q
  return float(np.max(np.linalg.norm(gram - np.eye(q.shape[-1]),
                                     axis=(-2, -1))))


def _svd_polar(a):
  u, _, vt = jnp.linalg.svd(a, full_matrices=False)
  return u @ vt


def retraction_fn(method: str, delta: float):
  """polar(W + xi) by `method`; Newton–Schulz sized for steps <= delta."""
  if method == "svd":
    return jax.jit(lambda w, xi: _svd_polar(w + xi))
  if method == "eigh":
    return jax.jit(lambda w, xi: so.retract(w, xi, "eigh"))
  return jax.jit(lambda w, xi: so.retract(w, xi, "newton_schulz",
                                          max_step_norm=delta))


def retraction_rows(method: str, shapes, iters: int, emit=None):
  """Rows of `_retraction_rows` for each of the comma-separated methods."""
  return [row for m in method.split(",")
          for row in _retraction_rows(m, shapes, iters, emit)]


def _retraction_rows(method: str, shapes, iters: int, emit=None):
  """Time (delta = 0.1) and isometry errors (delta = 0.1 and 1) of one
  retraction method on each (d, r) with d // r heads; `emit(row)` is called
  after each shape (the child process prints it at once)."""
  rows = []
  for d, r in shapes:
    heads = d // r
    w = jnp.asarray(np_frames(np.random.default_rng(d), (heads, d, r)))
    row = {"method": method, "d": d, "r": r, "heads": heads}
    for delta in DELTAS:
      fn = retraction_fn(method, delta)
      xi = _tangent_step(w, delta, seed=r)
      out = jax.block_until_ready(fn(w, xi))
      row[f"iso_err_delta_{delta:g}"] = isometry_error_f64(out)
      if method == "newton_schulz":
        row[f"ns_steps_delta_{delta:g}"] = so.newton_schulz_steps(delta)
      if delta == DELTAS[0]:
        n = max(3, iters // (1 + d // 1024))
        row["ms"] = 1e3 * median_times({"f": _call(fn, w, xi)}, n)["f"]
    rows.append(row)
    if emit:
      emit(row)
  return rows


def _child_retraction(method: str, shapes, iters: int, timeout: float,
                      env: Optional[dict] = None):
  """Runs `retraction_rows` for method in a child process; shapes not done
  within `timeout` seconds are reported as status 'timeout (hang?)'."""
  cmd = [sys.executable, "-m", "benchmarks.speed", "--retraction-child",
         method, "--iters", str(iters), "--shapes",
         ",".join(f"{d}x{r}" for d, r in shapes)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=env or os.environ.copy())
  status = "ok"
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    status = "timeout (hang?)"
  rows = [json.loads(l[len("ROW "):]) for l in out.splitlines()
          if l.startswith("ROW ")]
  if status == "ok" and proc.returncode != 0:
    status = f"failed (rc {proc.returncode}): {err.strip()[-300:]}"
  done = {(row["method"], row["d"], row["r"]) for row in rows}
  for m in method.split(","):
    for d, r in shapes:
      if (m, d, r) not in done:
        rows.append({"method": m, "d": d, "r": r, "heads": d // r,
                     "status": status})
  return rows


def retraction_table(shapes, iters: int, timeout: float, quick: bool = False):
  """Newton–Schulz in this process; eigh and SVD in child processes (one
  each; both in one with `quick`)."""
  rows = retraction_rows("newton_schulz", shapes, iters)
  for methods in (("eigh,svd",) if quick else ("eigh", "svd")):
    rows += _child_retraction(methods, shapes, iters, timeout)
  return rows


# --------------------------------------------------------------------------
# Peer comparison: geoopt's RiemannianAdam, in a child process under its own
# Python environment (torch stays out of ours).


@dataclasses.dataclass(frozen=True)
class PeerWorkload:
  name: str
  leaves: int
  shape: tuple         # (heads, d, r): one frame (d, r) per head
  k: int               # steps per timed batch of each side


PEER_WORKLOADS = (
    PeerWorkload("A: GPT-2 small Q/K kernels", 24, (12, 768, 64), 3),
    PeerWorkload("B: patch ViT Q/K kernels", 8, (4, 64, 16), 50))
PEER_QUICK = (PeerWorkload("A, quick", 2, (2, 64, 16), 5),
              PeerWorkload("B, quick", 2, (2, 16, 4), 5))
PEER_LR = 1e-3
PEER_ISO_STEPS = 20
PEER_SEED = 0
DEFAULT_PEER_PYTHON = str(harness.REPO / "runs" / "peer-venv" / "bin" / "python")
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "peer_geoopt.py")
PEER_SETUP_HINT = ("set up runs/peer-venv as benchmarks/speed.py's docstring"
                   " shows, or pass --peer-python")


class PeerError(RuntimeError):
  """The peer child did not answer, answered an error, or exited."""


class PeerChild:
  """benchmarks/peer_geoopt.py running under `python`, driven by JSON lines
  (one request, one answer; see that module's docstring).

  A reader thread queues the child's stdout lines, so that every answer is
  awaited at most `timeout` seconds; stderr goes to a temporary file whose
  tail explains a failure.
  """

  def __init__(self, python: str, threads: int, timeout: float):
    self.timeout = timeout
    self._err = tempfile.TemporaryFile(mode="w+")
    try:
      self._proc = subprocess.Popen(
          [python, PEER_SCRIPT, "--threads", str(threads)],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
          text=True, bufsize=1)
    except OSError as e:
      self._err.close()
      raise PeerError(f"cannot start {python}: {e}") from e
    self._lines = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    try:
      self.hello = self._answer()
    except PeerError:
      self.close()
      raise

  def _read(self):
    for line in self._proc.stdout:
      self._lines.put(line)
    self._lines.put(None)             # EOF: the child exited

  def _stderr_tail(self) -> str:
    self._err.seek(0)
    return self._err.read().strip()[-1000:]

  def _answer(self) -> dict:
    try:
      line = self._lines.get(timeout=self.timeout)
    except queue.Empty:
      raise PeerError(f"no answer within {self.timeout:g} s") from None
    if line is None:
      raise PeerError(f"the peer exited (rc {self._proc.wait()}):"
                      f" {self._stderr_tail()}")
    msg = json.loads(line)
    if "error" in msg:
      raise PeerError(msg["error"])
    return msg

  def ask(self, **request) -> dict:
    """Sends one request and returns its answer."""
    try:
      self._proc.stdin.write(json.dumps(request) + "\n")
      self._proc.stdin.flush()
    except (BrokenPipeError, OSError) as e:
      raise PeerError(f"the peer exited: {e}; {self._stderr_tail()}") from e
    return self._answer()

  def close(self):
    try:
      self._proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
      self._proc.stdin.close()
      self._proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
      self._proc.kill()
      self._proc.wait()
    self._err.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _peer_arrays(w: PeerWorkload, seed: int = PEER_SEED):
  """The workload's frames and gradients as lists of jax arrays: the same
  NumPy values the peer builds from the same seed."""
  return ([jnp.asarray(x) for x in peer_geoopt.frames(seed, w.leaves, w.shape)],
          [jnp.asarray(g)
           for g in peer_geoopt.gradients(seed, w.leaves, w.shape)])


def our_step(lr: float = PEER_LR, stacked=False):
  """(tx, step): `stiefel_adam(lr)` and one jitted update plus apply,
  step(params, state, grads) -> (params, state). The leaves are stacks of
  frames (heads, d, r), the heads a batch axis; `stacked` (True or
  "auto") stacks the leaves of equal shape (`frame_partition(...,
  stack_frames=stacked)`)."""
  tx = so.stiefel_adam(lr)
  if stacked:
    tx = so.frame_partition(tx, None, so.FrameSpec(), stack_frames=stacked)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


def time_our_steps(step, params, state, grads, k: int):
  """(wall s, CPU s) per step over k steps in a row, the last one timed to
  `block_until_ready`, and the (params, state) they end with."""
  start, start_cpu = time.perf_counter(), time.process_time()
  for _ in range(k):
    params, state = step(params, state, grads)
  jax.block_until_ready(params)
  return ((time.perf_counter() - start) / k,
          (time.process_time() - start_cpu) / k), params, state


def our_isometry_after(step, tx, params, grads, steps: int) -> float:
  """`peer_geoopt.isometry_error_f64` after `steps` steps from a fresh
  state."""
  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state, grads)
  return peer_geoopt.isometry_error_f64([np.asarray(p) for p in params])


def peer_row(child: PeerChild, w: PeerWorkload, rounds: int,
             lr: float = PEER_LR, iso_steps: int = PEER_ISO_STEPS,
             warmup: int = 2) -> Dict[str, Any]:
  """One workload: `rounds` alternated batches (geoopt's k steps in the
  child, then ours k), medians of the per-step times of the batches, and
  both sides' isometry errors after `iso_steps` steps from the same
  frames."""
  params, grads = _peer_arrays(w)
  ours = {}                              # name: [tx, step, params, state]
  for name, stacked in (("ours", False), ("ours_stacked", True),
                        ("ours_auto", "auto")):
    tx, step = our_step(lr, stacked)
    p, s = params, tx.init(params)
    for _ in range(warmup):              # compilation, then a warm step
      p, s = jax.block_until_ready(step(p, s, grads))
    ours[name] = [tx, step, p, s]
  child.ask(cmd="setup", leaves=w.leaves, shape=list(w.shape), lr=lr,
            seed=PEER_SEED, warmup=warmup)
  times = {"geoopt": [], **{k: [] for k in ours}}
  cpus = {"geoopt": [], **{k: [] for k in ours}}
  for _ in range(rounds):
    peer = child.ask(cmd="time", k=w.k)
    times["geoopt"].append(peer["wall_s"])
    cpus["geoopt"].append(peer["cpu_s"])
    for name, o in ours.items():
      (wall, cpu), o[2], o[3] = time_our_steps(o[1], o[2], o[3], grads, w.k)
      times[name].append(wall)
      cpus[name].append(cpu)
  t = {k: statistics.median(v) for k, v in times.items()}
  c = {k: statistics.median(v) for k, v in cpus.items()}
  start_params, _ = _peer_arrays(w)
  peer_iso = child.ask(cmd="isometry", steps=iso_steps)
  return {"workload": w.name, "leaves": w.leaves, "shape": list(w.shape),
          "frames": w.leaves * w.shape[0], "k": w.k, "rounds": rounds,
          "ours_ms": 1e3 * t["ours"], "geoopt_ms": 1e3 * t["geoopt"],
          "ratio": t["geoopt"] / t["ours"],
          "ours_cpu_ms": 1e3 * c["ours"], "geoopt_cpu_ms": 1e3 * c["geoopt"],
          "cpu_ratio": c["geoopt"] / c["ours"],
          "ours_stacked_ms": 1e3 * t["ours_stacked"],
          "ratio_stacked": t["geoopt"] / t["ours_stacked"],
          "ours_auto_ms": 1e3 * t["ours_auto"],
          "ratio_auto": t["geoopt"] / t["ours_auto"],
          "iso_steps": iso_steps,
          "ours_iso_err": our_isometry_after(ours["ours"][1], ours["ours"][0],
                                             start_params, grads, iso_steps),
          "geoopt_iso_err": peer_iso["iso_err"],
          "start_iso_err": peer_iso["start"]}


def peer_missing(python: Optional[str]) -> Optional[str]:
  """Why the peer cannot run at all (no such interpreter), or None."""
  if not python:
    return f"no peer Python given; {PEER_SETUP_HINT}"
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    return f"no peer Python at {python}; {PEER_SETUP_HINT}"
  return None


def peer_comparison(python: Optional[str], workloads=PEER_WORKLOADS,
                    rounds: int = 11, timeout: float = 300.0,
                    threads: Optional[int] = None) -> Dict[str, Any]:
  """Table 6, or {"status": "skipped" | "failed", "message": why}.

  torch gets `threads` threads (default: as many as the cores jax may use).
  Skipped: no peer Python, or it cannot import torch and geoopt. Failed:
  the peer broke off mid-run (the rows done so far are kept).
  """
  missing = peer_missing(python)
  if missing:
    return {"status": "skipped", "message": missing}
  cores = len(os.sched_getaffinity(0))
  where = harness.portable(python) if python else python   # no machine path
  res = {"peer_python": where, "threads": cores, "lr": PEER_LR, "rows": []}
  try:
    child = PeerChild(python, threads or cores, timeout)
  except PeerError as e:
    return {"status": "skipped", "message": f"{e}; {PEER_SETUP_HINT}",
            "peer_python": where}
  with child:
    res.update(torch=child.hello["torch"], geoopt=child.hello["geoopt"],
               torch_threads=child.hello["threads"])
    try:
      for w in workloads:
        res["rows"].append(peer_row(child, w, rounds))
    except PeerError as e:
      return {**res, "status": "failed", "message": str(e)}
  return {**res, "status": "ok"}


def _command(quick: bool, peer_only: bool, peer_threads: Optional[int]
             ) -> str:
  return ("python -m benchmarks.speed" + (" --quick" if quick else "")
          + (" --peer-only" if peer_only else "")
          + (f" --peer-threads {peer_threads}" if peer_threads else ""))


def run(quick: bool = False, out: Optional[str] = None,
        iters: Optional[int] = None, timeout: float = 300.0,
        peer_python: Optional[str] = DEFAULT_PEER_PYTHON,
        peer_only: bool = False,
        peer_threads: Optional[int] = None) -> Dict[str, Any]:
  """Every table (or, with `peer_only`, only the geoopt comparison); the
  peer comparison runs under `peer_python` and is skipped without it."""
  iters = iters or (3 if quick else 11)
  load_before = [round(x, 2) for x in os.getloadavg()]
  trees = (GPT2_QUICK, VIT_QUICK) if quick else (GPT2_SMALL, PATCH_VIT)
  res = {
      "quick": quick,
      "peer_only": peer_only,
      "command": _command(quick, peer_only, peer_threads),
      "machine": (f"{platform.machine()}, {os.cpu_count()} CPU cores, jax"
                  f" {jax.__version__} on {jax.default_backend()}"),
      "env": {k: os.environ.get(k) for k in ENV_KEYS},
      "load_before": load_before,
      "seconds": {},
  }

  def section(name, fn):
    start = time.perf_counter()
    res[name] = fn()
    res["seconds"][name] = round(time.perf_counter() - start, 1)

  # --quick times the update on its first tree only: the second tree's row
  # runs the same code as the first's, less the profile, and would only
  # compile four more programs; the state table, which compiles nothing,
  # keeps both trees.
  update_trees = trees[:1] if quick else trees
  if not peer_only:
    section("update", lambda: [update_comparison(cfg, iters, profile=i == 0)
                               for i, cfg in enumerate(update_trees)])
    section("train_step", lambda: train_step_comparison(
        LM_QUICK if quick else LM_FULL, iters))
    section("state", lambda: [qk_state_bytes(cfg) for cfg in trees])
    section("retraction", lambda: retraction_table(
        RETRACTION_SHAPES[:1] if quick else RETRACTION_SHAPES, iters,
        timeout, quick))
  section("peer", lambda: peer_comparison(
      peer_python, PEER_QUICK if quick else PEER_WORKLOADS, iters, timeout,
      peer_threads))
  if not peer_only:
    section("layout", lambda: layout_comparison(
        *((2, 64, 4, 16) if quick else LAYOUT_WORKLOAD), iters))
  if res["peer"]["status"] != "ok":
    print(f"peer comparison (geoopt) {res['peer']['status']}:"
          f" {res['peer']['message']}", file=sys.stderr)
  res["load_after"] = [round(x, 2) for x in os.getloadavg()]
  if out:
    harness.write_json(pathlib.Path(out) / "speed.json", res, indent=1)
  res["markdown"] = write_report(out, res)
  return res


def write_report(out: Optional[str], res: Dict[str, Any]) -> str:
  """speed.md of `res` (beside its speed.json in `out`, if given);
  returns the markdown."""
  md = report_lib.markdown(res)
  if out:
    harness.write_text(pathlib.Path(out) / "speed.md", md)
  return md


def main(argv: Optional[Sequence[str]] = None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny shapes (the update timed on one tree)"
                      " and 3 timed calls: a smoke test")
  parser.add_argument("--out", default=None,
                      help="directory for speed.json / speed.md (default:"
                      " runs/speed, runs/speed_peer with --peer-only, none"
                      " with --quick)")
  parser.add_argument("--iters", type=int, default=None,
                      help="timed calls per function, and rounds of the"
                      " peer comparison (default 11; 3 quick)")
  parser.add_argument("--timeout", type=float, default=300.0,
                      help="seconds for each eigh / SVD child process, and"
                      " for each answer of the peer child")
  parser.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON,
                      help="a Python with torch and geoopt for the peer"
                      " comparison (default: runs/peer-venv/bin/python;"
                      " skipped where absent)")
  parser.add_argument("--peer-only", action="store_true",
                      help="only the geoopt comparison")
  parser.add_argument("--peer-threads", type=int, default=None,
                      help="torch.set_num_threads of the peer (default: the"
                      " cores jax may use, os.sched_getaffinity)")
  parser.add_argument("--report-only", action="store_true",
                      help="no timing: speed.md again from the speed.json in"
                      " --out (e.g. benchmarks/results)")
  parser.add_argument("--retraction-child", default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--shapes", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.retraction_child:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    retraction_rows(args.retraction_child, shapes, args.iters or 11,
                    emit=lambda row: print("ROW " + json.dumps(row), flush=True))
    return
  # A peer-only run has its own default folder, so that it does not replace
  # a full run's speed.json with one table.
  default = (None if args.quick else
             DEFAULT_PEER_OUT if args.peer_only else DEFAULT_OUT)
  out = args.out if args.out is not None else default
  if args.report_only:
    if not out:
      parser.error("--report-only reads <--out>/speed.json: name --out.")
    path = pathlib.Path(out) / "speed.json"
    if not path.is_file():
      parser.error(f"--report-only: no {path}; run the benchmark first.")
    print(write_report(out, json.loads(path.read_text())))
    return
  res = run(args.quick, out, args.iters, args.timeout, args.peer_python,
            args.peer_only, args.peer_threads)
  print(res["markdown"])
  if out:
    print(f"wrote {os.path.join(out, 'speed.json')} and speed.md")


if __name__ == "__main__":
  main()
