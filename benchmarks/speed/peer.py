"""Table 6, our side: geoopt's RiemannianAdam against `stiefel_adam`.

geoopt runs in a long-lived child process, `peer_geoopt.py` under its own
Python environment (torch stays out of ours), driven over a pipe by JSON
lines; the parent asks it to time k steps, then times k of ours, and so on
in alternation. Both sides start from the same NumPy frames and gradients
(`peer_geoopt.frames`, `peer_geoopt.gradients`) and measure the isometry
error by the same formula (`peer_geoopt.isometry_error_f64`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stiefel_optax as so
from benchmarks import harness
from benchmarks.speed import peer_geoopt


@dataclasses.dataclass(frozen=True)
class PeerWorkload:
  """`leaves` stacks of frames of `shape`, each side timed k steps a batch."""
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
DEFAULT_PEER_PYTHON = str(harness.RUNS_ROOT / "peer-venv" / "bin" / "python")
PEER_SCRIPT = peer_geoopt.__file__       # run by path: no package, no jax
PEER_SETUP_HINT = ("set up runs/peer-venv as benchmarks/speed/__init__.py's"
                   " docstring shows, or pass --peer-python")


class PeerError(RuntimeError):
  """The peer child did not answer, answered an error, or exited."""


class PeerChild:
  """benchmarks/speed/peer_geoopt.py (PEER_SCRIPT) running under `python`,
  driven by JSON lines
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


def peer_arrays(w: PeerWorkload, seed: int = PEER_SEED):
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
  return tx, jitted_step(tx)


def as_kernels(leaves) -> dict:
  """The workload's (heads, d, r) frame stacks as the default user path
  sees them: Flax linen query/key kernels (d, heads, r), alternately named
  query and key, one attention module per pair.

  >>> import jax.numpy as jnp
  >>> t = as_kernels([jnp.zeros((2, 8, 4))] * 3)
  >>> jax.tree.map(lambda x: x.shape, t)["layer_0"]["attn"]["key"]
  {'kernel': (8, 2, 4)}
  >>> len(jax.tree.leaves(t))
  3
  """
  tree: dict = {}
  for i, w in enumerate(leaves):
    attn = tree.setdefault(f"layer_{i // 2}", {}).setdefault("attn", {})
    attn[("query", "key")[i % 2]] = {"kernel": jnp.transpose(w, (1, 0, 2))}
  return tree


def default_step(lr: float = PEER_LR):
  """(tx, step) of the default user path: `stiefel_attention(lr)` with
  every default (frames "auto", per leaf) on `as_kernels` trees."""
  tx = so.stiefel_attention(lr)
  return tx, jitted_step(tx)


def jitted_step(tx: optax.GradientTransformation):
  """step(params, state, grads) -> (params, state): one jitted `tx` update
  plus `optax.apply_updates`."""

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


# Instructions of a compiled entry computation that launch no work.
_FREE_OPS = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")


def compiled_ops(step, *args) -> int:
  """Operations in `step`'s compiled entry computation that launch work
  (fusions, dots, conditionals, copies: one kernel or thunk each on CPU).
  Where the frames are small, time per step follows this count, not the
  arithmetic."""
  text = step.lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  ops = re.findall(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][\w-]*)\(", entry,
                   flags=re.M)
  return sum(op not in _FREE_OPS for op in ops)


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
  params, grads = peer_arrays(w)
  ours = {}                              # name: [tx, step, params, state]
  # optax.adamw on the same leaves: no Riemannian work, so its time is
  # what the per-operation dispatch alone costs for these leaves (the
  # ceiling of geoopt / ours for any optax transform on many small frames).
  adamw = optax.adamw(lr)
  inputs = {"ours_default": (as_kernels(params), as_kernels(grads))}
  for name, (tx, step) in (("ours", our_step(lr, False)),
                           ("ours_default", default_step(lr)),
                           ("ours_stacked", our_step(lr, True)),
                           ("ours_auto", our_step(lr, "auto")),
                           ("adamw", (adamw, jitted_step(adamw)))):
    p0, g = inputs.get(name, (params, grads))
    p, s = p0, tx.init(p0)
    for _ in range(warmup):              # compilation, then a warm step
      p, s = jax.block_until_ready(step(p, s, g))
    ours[name] = [tx, step, p, s, g]
  ops = {name: compiled_ops(step, p, s, g)
         for name, (_, step, p, s, g) in ours.items()}
  child.ask(cmd="setup", leaves=w.leaves, shape=list(w.shape), lr=lr,
            seed=PEER_SEED, warmup=warmup)
  times = {"geoopt": [], **{k: [] for k in ours}}
  cpus = {"geoopt": [], **{k: [] for k in ours}}
  for _ in range(rounds):
    peer = child.ask(cmd="time", k=w.k)
    times["geoopt"].append(peer["wall_s"])
    cpus["geoopt"].append(peer["cpu_s"])
    for name, o in ours.items():
      (wall, cpu), o[2], o[3] = time_our_steps(o[1], o[2], o[3], o[4], w.k)
      times[name].append(wall)
      cpus[name].append(cpu)
  t = {k: statistics.median(v) for k, v in times.items()}
  c = {k: statistics.median(v) for k, v in cpus.items()}
  start_params, _ = peer_arrays(w)
  peer_iso = child.ask(cmd="isometry", steps=iso_steps)
  return {"workload": w.name, "leaves": w.leaves, "shape": list(w.shape),
          "frames": w.leaves * w.shape[0], "k": w.k, "rounds": rounds,
          "ours_ms": 1e3 * t["ours"], "geoopt_ms": 1e3 * t["geoopt"],
          "ratio": t["geoopt"] / t["ours"],
          "ours_cpu_ms": 1e3 * c["ours"], "geoopt_cpu_ms": 1e3 * c["geoopt"],
          "cpu_ratio": c["geoopt"] / c["ours"],
          "cpu_ratio_stacked": c["geoopt"] / c["ours_stacked"],
          "cpu_ratio_auto": c["geoopt"] / c["ours_auto"],
          "ours_default_ms": 1e3 * t["ours_default"],
          "ratio_default": t["geoopt"] / t["ours_default"],
          "cpu_ratio_default": c["geoopt"] / c["ours_default"],
          "ours_stacked_ms": 1e3 * t["ours_stacked"],
          "ratio_stacked": t["geoopt"] / t["ours_stacked"],
          "ours_auto_ms": 1e3 * t["ours_auto"],
          "ratio_auto": t["geoopt"] / t["ours_auto"],
          "adamw_ms": 1e3 * t["adamw"],
          "ratio_adamw": t["geoopt"] / t["adamw"],
          "compiled_ops": ops,
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
    # the portable form: the message lands in committed reports
    return (f"no peer Python at {harness.portable(python)};"
            f" {PEER_SETUP_HINT}")
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
