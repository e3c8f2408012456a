"""The peer side of `benchmarks.speed`'s comparison: geoopt's RiemannianAdam.

This file runs as a long-lived child process under a separate Python
environment that has torch and geoopt but not jax (see `benchmarks.speed`'s
docstring for its setup), so that torch never enters the project's own
environment. It imports only torch, geoopt, NumPy and the standard library,
and the first two only in `main` and the functions it calls: the NumPy
helpers below (Haar frames, the workload's frames and gradients, the
isometry error) are also imported by `benchmarks.speed`'s tables, so both
sides start from the same arrays and measure the error by the same formula,
and the speed benchmark has one home for each.

    PEER_PYTHON benchmarks/speed/peer_geoopt.py --threads N

Protocol: JSON lines, one request on stdin, one answer on stdout.

    (on start)                               -> {"ready": true, "torch": ..,
                                                 "geoopt": .., "threads": N}
                                                or {"error": ..} (then exits)
    {"cmd": "setup", "leaves": L, "shape": [h, d, r], "lr": lr, "seed": s,
     "warmup": w}                            -> {"ok": true}
    {"cmd": "time", "k": k}                  -> {"wall_s": .., "cpu_s": ..}
    {"cmd": "isometry", "steps": n}          -> {"iso_err": .., "start": ..}
    {"cmd": "quit"}                          -> (exits)

Any failure of a request answers {"error": traceback} and the child stays up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import List, Sequence, Tuple

import numpy as np

GRAD_SCALE = 1e-3


# --------------------------------------------------------------------------
# Shared NumPy helpers (both sides).


def haar_frames(rng: np.random.Generator, shape: Sequence[int]
                ) -> np.ndarray:
  """A float32 stack of Haar frames of `shape` (..., d, r): QR of a
  Gaussian, signs corrected so that R has a positive diagonal."""
  q, r = np.linalg.qr(rng.standard_normal(tuple(shape)))
  q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  return q.astype(np.float32)


def frames(seed: int, leaves: int, shape: Sequence[int]) -> List[np.ndarray]:
  """`leaves` stacks of `haar_frames` of `shape`, from `seed`."""
  rng = np.random.default_rng(seed)
  return [haar_frames(rng, shape) for _ in range(leaves)]


def gradients(seed: int, leaves: int, shape: Sequence[int]
              ) -> List[np.ndarray]:
  """`leaves` float32 Euclidean gradients of `shape`, GRAD_SCALE times a
  standard normal (the scale is immaterial to either Adam but for eps)."""
  rng = np.random.default_rng(seed + 1)
  return [(GRAD_SCALE * rng.standard_normal(tuple(shape))).astype(np.float32)
          for _ in range(leaves)]


def isometry_error_f64(qs) -> float:
  """max ||Q^T Q - I||_F over every frame of every leaf, Q^T Q formed in
  float64, so that it measures the float32 frames, not the rounding of
  their Gram matrices."""
  errors = []
  for q in qs:
    q = np.asarray(q, np.float64)
    gram = np.swapaxes(q, -1, -2) @ q
    errors.append(np.max(np.linalg.norm(gram - np.eye(q.shape[-1]),
                                        axis=(-2, -1))))
  return float(np.max(errors))      # np.max: a NaN frame shows as NaN


# --------------------------------------------------------------------------
# The geoopt side (torch imported lazily: see the module docstring).


def make_peer(leaves: int, shape: Sequence[int], lr: float, seed: int):
  """(parameters, optimizer): one `ManifoldParameter` on `EuclideanStiefel`
  per leaf, from `frames(seed, ...)`, its `.grad` set to
  `gradients(seed, ...)`, and `RiemannianAdam(lr)` over them.

  The gradients stay set: with weight_decay 0, `step()` leaves `.grad`'s
  values unchanged, so each step sees the same gradients, as ours does.
  """
  import geoopt  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  manifold = geoopt.EuclideanStiefel()
  params = []
  for w, g in zip(frames(seed, leaves, shape), gradients(seed, leaves, shape)):
    p = geoopt.ManifoldParameter(torch.from_numpy(w), manifold=manifold)
    p.grad = torch.from_numpy(g)
    params.append(p)
  return params, geoopt.optim.RiemannianAdam(params, lr=lr)


def time_steps(optimizer, k: int) -> Tuple[float, float]:
  """(wall, process CPU) seconds per `optimizer.step()`, over k steps in a
  row. Torch's CPU ops are synchronous, so the clock stops when they end."""
  start, start_cpu = time.perf_counter(), time.process_time()
  for _ in range(k):
    optimizer.step()
  return ((time.perf_counter() - start) / k,
          (time.process_time() - start_cpu) / k)


def isometry_after(leaves: int, shape: Sequence[int], lr: float, seed: int,
                   steps: int) -> Tuple[float, float]:
  """(error after `steps` steps from a fresh optimizer, error at the
  start) by `isometry_error_f64`."""
  params, optimizer = make_peer(leaves, shape, lr, seed)
  start = isometry_error_f64([p.detach().numpy() for p in params])
  for _ in range(steps):
    optimizer.step()
  return isometry_error_f64([p.detach().numpy() for p in params]), start


def serve(requests, reply) -> None:
  """Answers each request (a dict) with `reply(dict)` until "quit"."""
  setup = None
  optimizer = None
  for req in requests:
    cmd = req.get("cmd")
    if cmd == "quit":
      return
    try:
      if cmd == "setup":
        setup = (req["leaves"], req["shape"], req["lr"], req["seed"])
        _, optimizer = make_peer(*setup)
        # Warm-up: allocator, thread pool and the Adam state's creation.
        time_steps(optimizer, req.get("warmup", 2))
        reply({"ok": True})
      elif cmd == "time":
        wall, cpu = time_steps(optimizer, req["k"])
        reply({"wall_s": wall, "cpu_s": cpu})
      elif cmd == "isometry":
        err, start = isometry_after(*setup, steps=req["steps"])
        reply({"iso_err": err, "start": start})
      else:
        reply({"error": f"unknown request {req!r}"})
    except Exception:  # pylint: disable=broad-except
      reply({"error": traceback.format_exc()[-2000:]})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--threads", type=int, required=True,
                      help="torch.set_num_threads: the cores jax uses")
  args = parser.parse_args(argv)
  # The protocol owns stdout: anything else printed goes to stderr.
  channel, sys.stdout = sys.stdout, sys.stderr

  def reply(msg):
    channel.write(json.dumps(msg) + "\n")
    channel.flush()

  try:
    import geoopt  # pylint: disable=g-import-not-at-top
    import torch  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    reply({"error": f"cannot import torch / geoopt under {sys.executable}:"
                    f" {type(e).__name__}: {e}"})
    return
  torch.set_num_threads(args.threads)
  reply({"ready": True, "torch": torch.__version__,
         "geoopt": getattr(geoopt, "__version__", "?"),
         "threads": torch.get_num_threads(), "python": sys.executable})
  serve((json.loads(line) for line in sys.stdin if line.strip()), reply)


if __name__ == "__main__":
  main()
