"""Table 5: the polar retraction polar(W + xi) by Newton–Schulz, eigh and a
thin SVD on a batch of d / r heads of (d, r) frames: time, and the isometry
error after a tangent step of norm 0.1 and 1.

Newton–Schulz runs in this process; eigh and SVD in a child process
(`python -m benchmarks speed --retraction-child METHODS`) with a timeout,
since jaxlib's batched LAPACK calls can hang on some small CPU machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import stiefel_optax as so
from benchmarks import harness
from benchmarks.speed import peer_geoopt, timing

RETRACTION_SHAPES = ((64, 16), (768, 64), (4096, 128))
# The trust-region radii (max_step_norm) timed and measured; a row records
# them as iso_err_delta_<radius> and ns_steps_delta_<radius>.
MAX_STEP_NORMS = (0.1, 1.0)
ROW = "ROW "          # the child's line prefix of a finished row (JSON)


def tangent_step(w, norm, seed):
  """A tangent step at w of Frobenius norm `norm` per frame (NumPy)."""
  w = np.asarray(w, np.float64)
  g = np.random.default_rng(seed).standard_normal(w.shape)
  wtg = np.swapaxes(w, -1, -2) @ g
  xi = g - w @ (0.5 * (wtg + np.swapaxes(wtg, -1, -2)))
  xi *= norm / np.linalg.norm(xi, axis=(-2, -1), keepdims=True)
  return jnp.asarray(xi, jnp.float32)


def svd_polar(a):
  """The polar factor U V^T of a thin SVD."""
  u, _, vt = jnp.linalg.svd(a, full_matrices=False)
  return u @ vt


def retraction_fn(method: str, max_step_norm: float):
  """polar(W + xi) by `method`; Newton–Schulz sized for steps <=
  max_step_norm."""
  if method == "svd":
    return jax.jit(lambda w, xi: svd_polar(w + xi))
  if method == "eigh":
    return jax.jit(lambda w, xi: so.retract(w, xi, "eigh"))
  return jax.jit(lambda w, xi: so.retract(w, xi, "newton_schulz",
                                          max_step_norm=max_step_norm))


def retraction_rows(method: str, shapes, iters: int, emit=None):
  """Rows of `method_rows` for each of the comma-separated methods."""
  return [row for m in method.split(",")
          for row in method_rows(m, shapes, iters, emit)]


def method_rows(method: str, shapes, iters: int, emit=None):
  """Time (max_step_norm 0.1) and isometry errors (max_step_norm 0.1 and
  1, each of a tangent step of that norm) of one retraction method on each
  (d, r) with d // r heads; `emit(row)` is called after each shape (the
  child process prints it at once)."""
  rows = []
  for d, r in shapes:
    heads = d // r
    w = jnp.asarray(peer_geoopt.haar_frames(np.random.default_rng(d),
                                            (heads, d, r)))
    row = {"method": method, "d": d, "r": r, "heads": heads}
    for radius in MAX_STEP_NORMS:
      fn = retraction_fn(method, radius)
      xi = tangent_step(w, radius, seed=r)
      out = jax.block_until_ready(fn(w, xi))
      row[f"iso_err_delta_{radius:g}"] = peer_geoopt.isometry_error_f64([out])
      if method == "newton_schulz":
        row[f"ns_steps_delta_{radius:g}"] = so.newton_schulz_steps(radius)
      if radius == MAX_STEP_NORMS[0]:
        n = max(3, iters // (1 + d // 1024))
        row["ms"] = 1e3 * timing.median_times(
            {"f": timing.call(fn, w, xi)}, n)["f"]
    rows.append(row)
    if emit:
      emit(row)
  return rows


def child_retraction(method: str, shapes, iters: int, timeout: float,
                     env: Optional[dict] = None):
  """Runs `retraction_rows` for method in a child process; shapes not done
  within `timeout` seconds are reported as status 'timeout (hang?)'."""
  cmd = [sys.executable, "-m", "benchmarks", "speed", "--retraction-child",
         method, "--iters", str(iters), "--shapes",
         ",".join(f"{d}x{r}" for d, r in shapes)]    # read by `child_main`
  proc = subprocess.Popen(cmd, cwd=harness.REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=env or os.environ.copy())
  status = "ok"
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    status = "timeout (hang?)"
  rows = [json.loads(l[len(ROW):]) for l in out.splitlines()
          if l.startswith(ROW)]
  if status == "ok" and proc.returncode != 0:
    status = f"failed (rc {proc.returncode}): {err.strip()[-300:]}"
  done = {(row["method"], row["d"], row["r"]) for row in rows}
  for m in method.split(","):
    for d, r in shapes:
      if (m, d, r) not in done:
        rows.append({"method": m, "d": d, "r": r, "heads": d // r,
                     "status": status})
  return rows


def child_main(method: str, shapes: str, iters: int) -> None:
  """The child's side of `child_retraction` (`--retraction-child method
  --shapes 64x16,768x64`): prints each row as it is done."""
  shapes = [tuple(int(v) for v in s.split("x")) for s in shapes.split(",")]
  retraction_rows(method, shapes, iters,
                  emit=lambda row: print(ROW + json.dumps(row), flush=True))


def retraction_table(shapes, iters: int, timeout: float, quick: bool = False):
  """Newton–Schulz in this process; eigh and SVD in child processes (one
  each; both in one with `quick`)."""
  rows = retraction_rows("newton_schulz", shapes, iters)
  for methods in (("eigh,svd",) if quick else ("eigh", "svd")):
    rows += child_retraction(methods, shapes, iters, timeout)
  return rows
