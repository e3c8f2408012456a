"""What the Stiefel step costs: `stiefel_attention` against `optax.adamw`.

    python -m benchmarks.speed            # full tables (10-20 min on 2 CPU cores)
    python -m benchmarks.speed --quick    # tiny shapes: a smoke test

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

Results: `--out DIR` (default benchmarks/results for a full run; none for
--quick) receives speed.json and speed.md. Machine load (`os.getloadavg`)
is recorded before and after, with the BLAS environment variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness
from stiefel_optax import geometry

QK = re.compile(so.specs.QK_KERNEL)
ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS", "XLA_FLAGS")
# Runs write under runs/ (git-ignored); `--out benchmarks/results` refreshes
# the committed reference figures.
DEFAULT_OUT = str(harness.default_out("speed"))


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


def optimizers(lr: float = 1e-3):
  return {"adamw": optax.adamw(lr, weight_decay=1e-4),
          "stiefel_attention": so.stiefel_attention(lr, weight_decay=1e-4)}


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
         **_versus_adamw(t, c)}
  if profile:
    frames, d, r = w.shape
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
# Training step of a small causal transformer LM (Flax linen).


@dataclasses.dataclass(frozen=True)
class LMConfig:
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


LM_FULL, LM_QUICK = LMConfig(), LMConfig(vocab=64, seq=16, batch=4, d=32,
                                         heads=2, layers=1, mlp=64)


def _lm(cfg: LMConfig):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      h = nn.LayerNorm(name="ln_1")(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=cfg.heads,
                                              name="attn")(h, mask=mask)
      h = nn.LayerNorm(name="ln_2")(x)
      h = nn.gelu(nn.Dense(cfg.mlp, name="fc")(h))
      return x + nn.Dense(cfg.d, name="proj")(h)

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(cfg.vocab, cfg.d, name="embed")(tokens)
      x = x + self.param("pos_embed", nn.initializers.normal(0.02),
                         (cfg.seq, cfg.d))
      mask = nn.make_causal_mask(tokens)
      for i in range(cfg.layers):
        x = Block(name=f"block_{i}")(x, mask)
      return nn.Dense(cfg.vocab, name="unembed")(nn.LayerNorm(name="ln_f")(x))

  return LM()


def train_step_comparison(cfg: LMConfig, iters: int) -> Dict[str, Any]:
  model = _lm(cfg)
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
          **_versus_adamw(t, c)}


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
# Report.


def _fmt_ms(x):
  return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def markdown(res: Dict[str, Any]) -> str:
  out = [f"# Speed: stiefel_attention vs optax.adamw{' (quick)' if res['quick'] else ''}",
         "",
         f"Command: `{res['command']}`. {res['machine']}. Load average"
         f" (1/5/15 min) before {res['load_before']}, after"
         f" {res['load_after']}. Times: medians of jitted calls after"
         " warm-up, both sides alternated in the same run; ms are wall-clock,"
         " CPU ms the process's CPU time per call (all threads; steadier"
         " when other jobs share the cores).", ""]
  out += ["## One optimizer update", "",
          "| tree | params | Q/K frames | adamw ms | stiefel_attention ms | ratio"
          " | ratio of CPU time |",
          "|---|---:|---:|---:|---:|---:|---:|"]
  for u in res["update"]:
    out.append(f"| {u['tree']} | {u['params'] / 1e6:.2f} M | {u['qk_frames']}"
               f" | {_fmt_ms(u['adamw_ms'])} | {_fmt_ms(u['stiefel_ms'])} |"
               f" {u['ratio']:.2f} | {u['cpu_ratio']:.2f} |")
  prof = res["update"][0]["profile"]
  out += ["", f"## Where the update's time goes ({res['update'][0]['tree']})", "",
          "| part | ms | CPU ms |", "|---|---:|---:|"]
  for k, v in prof["parts_ms"].items():
    out.append(f"| {k} | {_fmt_ms(v)} | {_fmt_ms(prof['parts_cpu_ms'][k])} |")
  out += ["", f"{prof['frames']} frames of ({prof['d']}, {prof['r']}); the"
          f" floor's products run at {prof['floor_gflops_per_s']:.1f} GFLOP/s."]
  t = res["train_step"]
  out += ["", "## One training step (forward, backward, update, apply)", "",
          "| model | params | adamw ms | stiefel_attention ms | ratio |"
          " ratio of CPU time |",
          "|---|---:|---:|---:|---:|---:|",
          f"| {t['model']} | {t['params'] / 1e6:.2f} M | {_fmt_ms(t['adamw_ms'])}"
          f" | {_fmt_ms(t['stiefel_ms'])} | {t['ratio']:.3f} |"
          f" {t['cpu_ratio']:.3f} |"]
  out += ["", "## Optimizer state of the Q/K kernels", "",
          "| tree | Q/K params MB | adamw MB | stiefel_attention MB | ratio |",
          "|---|---:|---:|---:|---:|"]
  for s in res["state"]:
    out.append(f"| {s['tree']} | {s['qk_param_bytes'] / 2**20:.2f} |"
               f" {s['adamw_bytes'] / 2**20:.2f} | {s['stiefel_bytes'] / 2**20:.2f}"
               f" | {s['ratio']:.4f} |")
  out += ["", "## Polar retraction of a batch of d / r heads, float32", "",
          "| method | (d, r) x heads | ms | isometry error, delta 0.1 |"
          " isometry error, delta 1 |",
          "|---|---|---:|---:|---:|"]
  for r in res["retraction"]:
    name = r["method"]
    if "ns_steps_delta_0.1" in r:
      name += (f" ({r['ns_steps_delta_0.1']} / {r['ns_steps_delta_1']} steps)")
    shape = f"({r['d']}, {r['r']}) x {r['heads']}"
    if "status" in r:
      out.append(f"| {name} | {shape} | {r['status']} | | |")
    else:
      out.append(f"| {name} | {shape} | {_fmt_ms(r['ms'])} |"
                 f" {r['iso_err_delta_0.1']:.1e} | {r['iso_err_delta_1']:.1e} |")
  out += ["", "Isometry error: max ||Q^T Q - I||_F of the float32 result,"
          " Q^T Q formed in float64. Newton–Schulz is timed sized for"
          " delta = 0.1 (the default cap); its delta = 1 error uses the steps"
          " sized for delta = 1."]
  return "\n".join(out) + "\n"


def run(quick: bool = False, out: Optional[str] = None,
        iters: Optional[int] = None, timeout: float = 300.0) -> Dict[str, Any]:
  iters = iters or (3 if quick else 11)
  load_before = [round(x, 2) for x in os.getloadavg()]
  trees = (GPT2_QUICK, VIT_QUICK) if quick else (GPT2_SMALL, PATCH_VIT)
  res = {
      "quick": quick,
      "command": "python -m benchmarks.speed" + (" --quick" if quick else ""),
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

  section("update", lambda: [update_comparison(cfg, iters, profile=i == 0)
                             for i, cfg in enumerate(trees)])
  section("train_step", lambda: train_step_comparison(
      LM_QUICK if quick else LM_FULL, iters))
  section("state", lambda: [qk_state_bytes(cfg) for cfg in trees])
  section("retraction", lambda: retraction_table(
      RETRACTION_SHAPES[:1] if quick else RETRACTION_SHAPES, iters, timeout,
      quick))
  res["load_after"] = [round(x, 2) for x in os.getloadavg()]
  res["markdown"] = markdown(res)
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "speed.json"), "w") as f:
      json.dump({k: v for k, v in res.items() if k != "markdown"}, f, indent=1)
    with open(os.path.join(out, "speed.md"), "w") as f:
      f.write(res["markdown"])
  return res


def main(argv: Optional[Sequence[str]] = None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny shapes and 3 timed calls: a smoke test")
  parser.add_argument("--out", default=None,
                      help="directory for speed.json / speed.md (default:"
                      " benchmarks/results, or none with --quick)")
  parser.add_argument("--iters", type=int, default=None,
                      help="timed calls per function (default 11; 3 quick)")
  parser.add_argument("--timeout", type=float, default=300.0,
                      help="seconds for each eigh / SVD child process")
  parser.add_argument("--retraction-child", default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--shapes", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.retraction_child:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    retraction_rows(args.retraction_child, shapes, args.iters or 11,
                    emit=lambda row: print("ROW " + json.dumps(row), flush=True))
    return
  out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
  res = run(args.quick, out, args.iters, args.timeout)
  print(res["markdown"])
  if out:
    print(f"wrote {os.path.join(out, 'speed.json')} and speed.md")


if __name__ == "__main__":
  main()
