"""What every integration case reports, in the same words.

A case trains a tiny model of a real package with the library and prints
three lines, each starting with the case's name:

  selected  the leaves the selector took (path: spec), and how many;
  isometry  max ||W^T W - I||_F over those frames after STEPS steps;
  rest      max |ours - AdamW's| / max |AdamW's| over every parameter that
            is not a frame (and the parts of fused leaves that are not),
            against `optax.adamw` (or the framework's own AdamW) fed the
            same gradients from the same start.

and ends with ``CASE <name> PASS`` or raises (run.py reports the error's
last line). Only the library and NumPy are imported here.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax

import stiefel_optax as so

STEPS = 5
#: float32 frames after a few steps; bf16 parameters get their own bound.
ISOMETRY_TOL = {"float32": 1e-5, "bfloat16": 3e-2}
#: the rest against AdamW, relative (the same float32 arithmetic: rounding).
REST_TOL = 1e-5


def case_name() -> str:
  return os.environ.get("STIEFEL_CASE", os.path.basename(sys.argv[0]))


def say(name: str, what: str, text: str) -> None:
  print(f"{name} | {what} | {text}", flush=True)


def selected(name: str, params, frames=None) -> dict:
  """Prints and returns {path: FrameSpec} of what `frames` selects."""
  picked = so.selected_frames(params, frames)
  say(name, "selected", f"{len(picked)} leaves")
  for path, spec in picked.items():
    say(name, "selected", f"  {path}: {spec}")
  return picked


def isometry(name: str, params, frames=None, dtype="float32") -> float:
  """Prints and checks the largest isometry error of the selected frames."""
  err = float(so.max_isometry_error(params, frames))
  tol = ISOMETRY_TOL["bfloat16" if "bfloat16" in str(dtype) else "float32"]
  say(name, "isometry", f"{err:.2e} after {STEPS} steps (bound {tol:g})")
  if not err <= tol:
    raise AssertionError(f"{name}: isometry {err:.3e} > {tol:g} after"
                         f" {STEPS} steps")
  return err


def _parts(params, frames) -> dict:
  """{path: array} of everything that is not a frame: whole leaves the
  selector leaves alone, and the non-frame parts of fused leaves."""
  out = {}
  for path, leaf, spec in so.frame_specs(params, frames):
    name = path if isinstance(path, str) else so.path_str(path)
    if spec is None:
      out[name] = np.asarray(leaf, np.float32)
    else:
      rest = so.split_frames(leaf, spec, name)[1]
      if rest is not None:
        out[name + " (rest)"] = np.asarray(rest, np.float32)
  return out


def rest_equals(name: str, ours, theirs, frames=None, tol=REST_TOL) -> float:
  """Prints and checks that every non-frame part of `ours` equals
  `theirs` (AdamW's twin) to `tol` relative."""
  a, b = _parts(ours, frames), _parts(theirs, frames)
  if a.keys() != b.keys():
    raise AssertionError(f"{name}: the twins' trees differ:"
                         f" {sorted(a.keys() ^ b.keys())}")
  worst, where = 0.0, None
  for path in a:
    scale = max(float(np.max(np.abs(b[path]), initial=0.0)), 1e-30)
    dev = float(np.max(np.abs(a[path] - b[path]), initial=0.0)) / scale
    if dev > worst:
      worst, where = dev, path
  say(name, "rest", f"{len(a)} non-frame parts equal AdamW's twin: max"
      f" relative difference {worst:.1e}" + (f" ({where})" if where else ""))
  if not worst <= tol:
    raise AssertionError(f"{name}: {where} differs from AdamW's twin by"
                         f" {worst:.3e} > {tol:g}")
  return worst


def twin(tx, ref_tx, params, grad_fn, steps=STEPS, apply=optax.apply_updates,
         filt=lambda p: p):
  """Trains `params` with `tx` and its twin with `ref_tx`, both fed the
  gradient grad_fn(ours) of `tx`'s model each step; returns (ours, theirs).
  `filt` maps a model to the tree the optimizers see (Equinox's
  eqx.filter); `apply` applies updates (eqx.apply_updates)."""

  @jax.jit
  def step(p, s, r, rs):
    g = grad_fn(p)
    u, s = tx.update(g, s, filt(p))
    ru, rs = ref_tx.update(g, rs, filt(r))
    return apply(p, u), s, apply(r, ru), rs

  s, rs = tx.init(filt(params)), ref_tx.init(filt(params))
  p = r = params
  for _ in range(steps):
    p, s, r, rs = step(p, s, r, rs)
  return p, r


def done(name: str) -> None:
  print(f"CASE {name} PASS", flush=True)
