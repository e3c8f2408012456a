"""Long-run drift: do Stiefel frames stay on the manifold over many steps?

A tiny teacher/student multi-head attention (the benchmarks' attention
layer, `models.self_attention`: flax's MultiHeadDotProductAttention, its
parameters at attn/{query,key,value,out}/kernel) is trained with
`stiefel_optax.stiefel_attention` on fresh random inputs every step, so the
frames keep moving for the whole run. The steps run in `jax.lax.scan`
chunks; after every chunk the script records, over all frames:

  max_isometry_error      max_t max_frames ||W^T W - I||_F over the chunk
                          (measured at every single step, in float32, on
                          the frames as stored in their dtype)
  end_isometry_error      the same at the chunk's last step
  movement                ||W_t - W_0||_F (max over frames) at the chunk's end
  path_length             sum over the chunk's steps of max_frames
                          ||W_{t+1} - W_t||_F: the frames keep moving
  loss                    mean training loss over the chunk

    python -m benchmarks long_run                   # full: float32 100,000
                                                    # steps, bf16/f16 10,000
    python -m benchmarks long_run --quick           # float32 5,000 steps

The full mode writes runs/long_run/long_run.json (and rewrites it after
every chunk, so an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import driver, harness, models

# Runs write under runs/ (git-ignored); `--out benchmarks/results/long_run.json`
# refreshes the committed reference record.
RESULTS = str(harness.default_out("long_run", "long_run.json"))
# The bar: every frame's isometry error over the whole run.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def init_params(key, d: int = 16, heads: int = 4, head_dim: int = 4,
                dtype=jnp.float32, orthonormal: bool = True):
  """Flax-linen-shaped attention parameters; query/key per-head orthonormal
  (or Gaussian, for the teacher, which the student then cannot represent
  exactly: the loss stays positive and the frames keep moving)."""
  kq, kk, kv, ko = jax.random.split(key, 4)
  scale = 1.0 / np.sqrt(d)
  qk_init = (so.orthonormal_heads_init() if orthonormal else
             lambda k, shape: 2.0 * jax.random.normal(k, shape) / np.sqrt(d))
  attn = {
      "query": {"kernel": qk_init(kq, (d, heads, head_dim))},
      "key": {"kernel": qk_init(kk, (d, heads, head_dim))},
      "value": {"kernel": scale * jax.random.normal(kv, (d, heads, head_dim))},
      "out": {"kernel": scale * jax.random.normal(ko, (heads, head_dim, d))},
  }
  return jax.tree.map(lambda x: x.astype(dtype), {"attn": attn})


def attention(params, x):
  """Self-attention of x (batch, seq, d) by `models.self_attention` with
  the shapes of `params`, computed in float32 whatever the parameters'
  dtype."""
  _, heads, head_dim = params["attn"]["query"]["kernel"].shape
  layer = models.self_attention(heads, head_dim, x.shape[-1],
                                dtype=jnp.float32)
  return layer.apply({"params": params["attn"]}, x)


def make_chunk(tx, teacher, *, chunk: int, batch: int, seq: int):
  """A jitted function running `chunk` steps under lax.scan."""
  d = teacher["attn"]["query"]["kernel"].shape[0]

  def loss_fn(params, x):
    return jnp.mean(jnp.square(attention(params, x) - attention(teacher, x)))

  def errors(params):
    f32 = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    errs = so.frame_isometry_errors(f32)
    return jnp.max(jnp.stack([jnp.max(e) for e in errs.values()]))

  def step(carry, t):
    params, state, key = carry
    x = jax.random.normal(jax.random.fold_in(key, t), (batch, seq, d))
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    moved = so.frame_movement(params, new)
    step_norm = jnp.max(jnp.stack([jnp.max(m) for m in moved.values()]))
    # The error of the frames this step starts from: the scan carry is
    # stored in the params' dtype, whereas `new` inside the step may still
    # hold excess float32 precision (XLA's xla_allow_excess_precision), which
    # would hide bfloat16/float16 rounding.
    return (new, state, key), (loss, errors(params), step_norm)

  @jax.jit
  def run(params, state, key, start):
    ts = start + jnp.arange(chunk)
    (params, state, key), (loss, err, step_norm) = jax.lax.scan(
        step, (params, state, key), ts)
    return params, state, jnp.mean(loss), jnp.max(err), jnp.sum(step_norm)

  return run, jax.jit(errors)


def movement(params, start):
  moved = so.frame_movement(
      jax.tree.map(lambda w: w.astype(jnp.float32), start),
      jax.tree.map(lambda w: w.astype(jnp.float32), params))
  return float(max(jnp.max(m) for m in moved.values()))


def long_run(steps: int = 5_000, *, chunk: int = 1_000, dtype="float32",
             seed: int = 0, learning_rate: float = 1e-2, d: int = 16,
             heads: int = 4, head_dim: int = 4, batch: int = 4, seq: int = 8,
             euclidean_dtype=None, verbose: bool = False,
             on_chunk=None) -> dict:
  """Trains for `steps` steps and returns the drift record (see module doc).

  `dtype` is that of every parameter, or only of the query/key frames when
  `euclidean_dtype` gives the other leaves' dtype. (optax.adamw on float16
  leaves overflows: its eps = 1e-8 and (1 - b2) g^2 underflow to 0 in float16,
  so m / (sqrt(v) + eps) becomes Inf/NaN; the full run keeps those leaves in
  float32 for the float16 frames.)
  """
  if steps % chunk:
    raise ValueError(f"steps = {steps} is not a multiple of chunk = {chunk}.")
  dtype = jnp.dtype(dtype)
  key_t, key_s, key_x = jax.random.split(jax.random.PRNGKey(seed), 3)
  teacher = init_params(key_t, d, heads, head_dim, orthonormal=False)
  params = init_params(key_s, d, heads, head_dim, dtype)
  if euclidean_dtype is not None:
    frames = so.selected_frames(params)
    params = jax.tree_util.tree_map_with_path(
        lambda p, w: w if so.path_str(p) in frames else
        w.astype(euclidean_dtype), params)
  start = params
  tx = so.stiefel_attention(learning_rate)
  state = tx.init(params)
  run, end_error = make_chunk(tx, teacher, chunk=chunk, batch=batch, seq=seq)
  record = {
      "dtype": dtype.name, "steps": steps, "chunk": chunk, "seed": seed,
      "learning_rate": learning_rate, "frames": 2 * heads,
      "frame_shape": [d, head_dim], "tolerance": TOLERANCE.get(dtype.name),
      "euclidean_dtype": (jnp.dtype(euclidean_dtype).name if euclidean_dtype
                          is not None else dtype.name),
      "initial_isometry_error": float(so.max_isometry_error(
          jax.tree.map(lambda w: w.astype(jnp.float32), params))),
      "chunks": []}
  t0 = time.perf_counter()
  for i in range(steps // chunk):
    params, state, loss, err_max, path = run(
        params, state, key_x, jnp.int32(i * chunk))
    # The chunk's last frames, as stored (materialised in their dtype).
    err_end = end_error(params)
    err_max = jnp.maximum(err_max, err_end)
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in
                 jax.tree.leaves((params, state)) if hasattr(x, "dtype")
                 and jnp.issubdtype(x.dtype, jnp.inexact))
    row = {"step": (i + 1) * chunk, "max_isometry_error": float(err_max),
           "end_isometry_error": float(err_end), "loss": float(loss),
           "movement": movement(params, start), "path_length": float(path),
           "finite": finite,
           "seconds": round(time.perf_counter() - t0, 2)}
    record["chunks"].append(row)
    if verbose:
      print(f"{dtype.name} step {row['step']:>7}: max isometry"
            f" {row['max_isometry_error']:.3g} end {row['end_isometry_error']:.3g}"
            f" loss {row['loss']:.4g} movement {row['movement']:.3g}"
            f" path {row['path_length']:.3g}"
            f" ({row['seconds']} s)", flush=True)
    if on_chunk is not None:
      on_chunk(record)
  errs = [c["max_isometry_error"] for c in record["chunks"]]
  record["max_isometry_error"] = max(errs)
  record["final_isometry_error"] = record["chunks"][-1]["end_isometry_error"]
  record["all_finite"] = all(c["finite"] for c in record["chunks"])
  # Growth: the worst error of the last chunk against that of the first.
  record["growth_last_over_first_chunk"] = errs[-1] / max(errs[0], 1e-30)
  record["passed"] = bool(record["all_finite"] and record["tolerance"] is not None
                          and record["max_isometry_error"] <= record["tolerance"])
  record["seconds"] = round(time.perf_counter() - t0, 2)
  return record


def arguments(parser: argparse.ArgumentParser) -> None:
  """The drift run's own options, beside the driver's --quick and --out."""
  parser.add_argument("--steps", type=int, default=100_000)
  parser.add_argument("--low-precision-steps", type=int, default=10_000)
  parser.add_argument("--chunk", type=int, default=10_000)


def run_command(opts: driver.Options) -> dict:
  """What the parsed command asks: --quick's float32 run, printed, or the
  full runs, written to --out (a JSON file) after every chunk."""
  if opts.quick:
    rec = long_run(5_000, chunk=1_000, verbose=True)
    print(json.dumps({k: v for k, v in rec.items() if k != "chunks"}))
    return {"float32": rec}
  out = str(opts.out or RESULTS)

  results = {"platform": platform.platform(), "jax": jax.__version__,
             "backend": jax.default_backend(), "runs": {}}

  low, steps = opts.low_precision_steps, opts.steps
  # name: (dtype, euclidean leaves' dtype, steps, chunk, model size)
  runs = {
      "bfloat16": ("bfloat16", None, low, low // 10, {}),
      "float16": ("float16", "float32", low, low // 10, {}),
      "float32": ("float32", None, steps, opts.chunk, {}),
      "float32_d64_r16": ("float32", None, steps, opts.chunk,
                          dict(d=64, heads=4, head_dim=16)),
  }
  for name, (dtype, euclid, n, chunk, size) in runs.items():

    def save(rec, name=name):
      results["runs"][name] = rec
      os.makedirs(os.path.dirname(out), exist_ok=True)
      with open(out, "w") as f:
        json.dump(results, f, indent=1)

    rec = long_run(n, chunk=chunk, dtype=dtype, euclidean_dtype=euclid,
                   verbose=True, on_chunk=save, **size)
    save(rec)
    print(f"{name}: {n} steps, frames {rec['frame_shape']}, max isometry"
          f" error {rec['max_isometry_error']:.3g} (tolerance"
          f" {rec['tolerance']}, passed {rec['passed']})", flush=True)
  return results


EXPERIMENT = driver.Experiment(
    name="long_run", summary=__doc__.split("\n\n")[0], presets={},
    default="full", run=run_command,
    quick="float32 only, 5,000 steps, nothing written",
    common=("quick", "out"), arguments=arguments,
    help={"out": "the JSON file written (default"
                 " runs/long_run/long_run.json)"})


def main(argv: Optional[list] = None) -> dict:
  """`python -m benchmarks.long_run [options]`: `python -m benchmarks
  long_run`."""
  return driver.run(EXPERIMENT, argv)


if __name__ == "__main__":
  main()
