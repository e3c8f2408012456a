"""The ```python blocks of README.md and docs/*.md, and what a training
block must leave behind: read by tests/test_readme_snippets.py (every
block, in the test process) and tests/test_sharded_recipes.py (the blocks
of the sharded-training sections, in a child that sees 8 devices).

A block runs in a fresh namespace (the snippets are self-contained). A
block that trains (a TrainState, an nnx.Optimizer, or a plain optax loop
with `tx` and its state) must have taken a step, and its Q/K frames must
have moved from where `orthonormalize` put them while staying orthonormal
(`check_trained`): `record_orthonormalize` records what each
`stiefel_optax.orthonormalize` call returned (inside `jax.jit` too).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import stiefel_optax as so
from tests.helpers import ROOT

README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README] + DOC_PAGES
FAMILIES = ROOT / "docs" / "families.md"
# The sections whose blocks shard over a mesh: they run on 8 devices
# (tests/test_sharded_recipes.py), not in the one-device test process.
SHARDED_SECTIONS = ("## Sharded training (`state_shardings`)",
                    "## Sharded training: Equinox, Haiku, Haliax, penzai")
# A frame that took a step has moved more than this (Frobenius): rounding
# moves one that did not (a zero learning rate) by about 1e-7, and a first
# Stiefel-Adam step moves each frame by its learning rate (1e-3 in the
# snippets).
MOVE_FLOOR = 1e-5
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(page=README) -> list:
  return BLOCK.findall(page.read_text(encoding="utf-8"))


def name(page) -> str:
  return page.relative_to(ROOT).as_posix()


def section_blocks(section: str, page=FAMILIES) -> dict:
  """{### heading: python source} of the section's blocks (one each)."""
  text = page.read_text(encoding="utf-8")
  start = text.index(section)
  end = text.find("\n## ", start + len(section))
  out = {}
  for part in text[start:end if end >= 0 else None].split("\n### ")[1:]:
    (source,) = BLOCK.findall(part)
    out[part.splitlines()[0].strip()] = source
  return out


def sharded_blocks() -> dict:
  """{heading: source} of every block of the SHARDED_SECTIONS."""
  return {h: s for section in SHARDED_SECTIONS
          for h, s in section_blocks(section).items()}


def trained(ns):
  """(params, opt_state, steps) a training snippet left behind, else None."""
  if "optimizer" in ns and "model" in ns:                 # nnx.Optimizer
    from flax import nnx
    return (nnx.as_pure(nnx.state(ns["model"], nnx.Param)),
            nnx.as_pure(ns["optimizer"].opt_state),
            int(ns["optimizer"].step[...]))
  if "state" in ns and hasattr(ns["state"], "opt_state"):  # TrainState
    st = ns["state"]
    return st.params, st.opt_state, int(st.step)
  if "tx" in ns and "state" in ns and "updates" in ns:     # a plain optax loop
    fs = frame_adam_states(ns["state"])
    return ns["params"], ns["state"], int(fs[0].count) if fs else 0
  if "tx" in ns and "opt_state" in ns:   # a loop step: Haiku, or Equinox's
    params = ns["params"] if "params" in ns else ns["model"]   # Module
    fs = frame_adam_states(ns["opt_state"])
    return params, ns["opt_state"], int(fs[0].count) if fs else 0
  return None


def frame_adam_states(tree) -> list:
  """The Stiefel group's `ScaleByFrameAdamState`s in an optimizer state."""
  is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_fs) if is_fs(x)]


def arrays(tree) -> dict:
  """{path: array leaf} of a parameter tree (a Module, an nnx State, a dict)."""
  return {so.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
          if isinstance(x, (jax.Array, np.ndarray))}


def record_orthonormalize(setattr_) -> list:
  """Makes `stiefel_optax.orthonormalize` record each result ({path: array})
  in the list it returns (setattr_: pytest's `monkeypatch.setattr`, or
  `setattr` in a child process); under jax.jit the values arrive by a debug
  callback when the compiled call runs."""
  starts = []
  orthonormalize = so.orthonormalize

  def recording(*args, **kwargs):
    out = orthonormalize(*args, **kwargs)
    found = arrays(out)
    # Kept on the host (NumPy): a value the callback hands back sits on
    # one device, where the trained frames may be sharded over many.
    keep = lambda a: starts.append({p: np.array(x) for p, x in a.items()})
    if any(isinstance(x, jax.core.Tracer) for x in found.values()):
      jax.debug.callback(keep, found)
    else:
      keep(found)
    return out

  setattr_(so, "orthonormalize", recording)
  return starts


def check_trained(ns, trained, starts, dtype=None):
  """The trained snippet's Q/K frames are orthonormal (float32: to 1e-5;
  below float32: to their dtype's rounding, `check_frames`' tolerance),
  moved from where `orthonormalize` put them, and the Stiefel group's
  moments are set; `dtype`: every frame leaf has it."""
  params, opt_state, steps = trained
  assert steps >= 1
  errs = so.frame_isometry_errors(params, ns.get("frames"))
  assert errs, "no query/key frame found in the snippet's model"
  so.check_frames(params, ns.get("frames"))   # the dtype-aware tolerance
  kernels = {p: x for p, x, s in so.frame_specs(params, ns.get("frames"))
             if s is not None}
  for path, e in errs.items():
    assert dtype is None or kernels[path].dtype == dtype, path
    if kernels[path].dtype == jnp.float32:
      assert float(jnp.max(e)) <= 1e-5, path
  # The frames moved: each Q/K leaf differs from where orthonormalize put it.
  jax.effects_barrier()         # the values recorded inside jax.jit
  start = [s for s in starts if set(errs) <= set(s)]
  assert start, ("the snippet trains frames it did not start with"
                 " stiefel_optax.orthonormalize: nothing to measure the"
                 f" move from (recorded: {[sorted(s) for s in starts]})")
  # Per frame, so that the AdamW-trained rest of a fused leaf (a value
  # part) does not count.
  before = jax.tree_util.tree_map_with_path(
      lambda p, x: start[-1].get(so.path_str(p), x), params)
  moved = {p: float(jnp.min(m)) for p, m in
           so.frame_movement(before, params, ns.get("frames")).items()}
  assert set(moved) == set(errs)
  assert all(m > MOVE_FLOOR for m in moved.values()), (
      f"a frame did not move (least ||W - W_0||_F per leaf): {moved}")
  # The Stiefel group took the step: its moments are set, one scalar per frame.
  (fs,) = frame_adam_states(opt_state)
  assert int(fs.count) == steps
  nu = {so.path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(fs.nu)}
  assert set(nu) == set(errs)
  assert all(v.shape == errs[p].shape and float(jnp.min(v)) > 0
             for p, v in nu.items())
