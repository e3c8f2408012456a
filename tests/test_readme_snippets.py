"""Every ```python block of README.md and of the docs/*.md pages runs as
written.

Each block runs in a fresh namespace (the snippets are self-contained). A
snippet that trains (a TrainState, an nnx.Optimizer, or a plain optax loop
with `tx` and its state) must have taken a step, and its Q/K frames must have
moved from where `orthonormalize` put them while staying orthonormal: the
test records what each `stiefel_optax.orthonormalize` call returned (inside
`jax.jit` too) and compares every frame leaf with the trained one. The
docs/*.md pages (the long forms of the README's sections, e.g.
docs/families.md) are held to the same rules, and the README links each of
them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stiefel_optax as so

from tests.helpers import ROOT

README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README] + DOC_PAGES
# A frame that took a step has moved more than this (Frobenius): rounding
# moves one that did not (a zero learning rate) by about 1e-7, and a first
# Stiefel-Adam step moves each frame by its learning rate (1e-3 in the
# snippets).
MOVE_FLOOR = 1e-5
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(page=README):
  return BLOCK.findall(page.read_text(encoding="utf-8"))


def _name(page):
  return page.relative_to(ROOT).as_posix()


# (page, index) of every ```python block, README.md first.
BLOCKS = [(page, index) for page in PAGES
          for index in range(len(python_blocks(page)))]


def _trained(ns):
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
    fs = [x for x in jax.tree.leaves(ns["state"], is_leaf=_is_fs) if _is_fs(x)]
    return ns["params"], ns["state"], int(fs[0].count) if fs else 0
  if "tx" in ns and "opt_state" in ns:   # a loop step: Haiku, or Equinox's
    params = ns["params"] if "params" in ns else ns["model"]   # Module
    fs = [x for x in jax.tree.leaves(ns["opt_state"], is_leaf=_is_fs)
          if _is_fs(x)]
    return params, ns["opt_state"], int(fs[0].count) if fs else 0
  return None


def _is_fs(x):
  return isinstance(x, so.ScaleByFrameAdamState)


def _arrays(tree) -> dict:
  """{path: array leaf} of a parameter tree (a Module, an nnx State, a dict)."""
  return {so.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
          if isinstance(x, (jax.Array, np.ndarray))}


def _record_orthonormalize(monkeypatch) -> list:
  """Makes `stiefel_optax.orthonormalize` record each result ({path: array})
  in the list it returns; under jax.jit the values arrive by a debug
  callback when the compiled call runs."""
  starts = []
  orthonormalize = so.orthonormalize

  def recording(*args, **kwargs):
    out = orthonormalize(*args, **kwargs)
    arrays = _arrays(out)
    if any(isinstance(x, jax.core.Tracer) for x in arrays.values()):
      jax.debug.callback(lambda a: starts.append(dict(a)), arrays)
    else:
      starts.append({p: np.array(x) for p, x in arrays.items()})
    return out

  monkeypatch.setattr(so, "orthonormalize", recording)
  return starts


def test_readme_has_the_two_one_line_switch_snippets():
  blocks = python_blocks()
  assert len(blocks) >= 2, f"README.md has {len(blocks)} ```python block(s)"
  joined = "\n".join(blocks)
  assert "TrainState.create(" in joined and "nnx.Optimizer(" in joined
  assert joined.count("stiefel_optax.stiefel_attention(") >= 2
  # The switch is two lines, and the heading says so.
  assert joined.count("stiefel_optax.orthonormalize(") >= 2


def test_readme_links_every_docs_page():
  """A section moved out of the README to docs/*.md stays one click away."""
  text = README.read_text(encoding="utf-8")
  assert DOC_PAGES, "no docs/*.md page"
  for page in DOC_PAGES:
    assert f"({_name(page)}" in text, f"README.md does not link {_name(page)}"


@pytest.mark.parametrize(
    "page,index", BLOCKS,
    ids=[f"{_name(page)}[{index}]" for page, index in BLOCKS])
def test_python_block_runs(page, index, monkeypatch):
  source = python_blocks(page)[index]
  ns = {"__name__": "__main__"}
  starts = _record_orthonormalize(monkeypatch)
  exec(compile(source, f"{_name(page)}[python block {index}]", "exec"), ns)
  trained = _trained(ns)
  if trained is None:
    return                      # not a training snippet: running it is the test
  _check_trained(ns, trained, starts)


def _check_trained(ns, trained, starts, dtype=None):
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
  is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
  (fs,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_fs) if is_fs(x)]
  assert int(fs.count) == steps
  nu = {so.path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(fs.nu)}
  assert set(nu) == set(errs)
  assert all(v.shape == errs[p].shape and float(jnp.min(v)) > 0
             for p, v in nu.items())


# The two one-line-switch snippets (a linen TrainState, an nnx.Optimizer).
SWITCH = [index for index, block in enumerate(python_blocks())
          if "orthonormalize(" in block and ("TrainState.create(" in block
                                             or "nnx.Optimizer(" in block)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("index", SWITCH)
def test_switch_snippets_run_as_written_with_low_precision_params(
    index, dtype, monkeypatch):
  """The README's switch snippets, unchanged, with the parameters stored in
  bf16 (gemma's default) or float16: `orthonormalize` hands them back in
  that dtype, and the snippet trains, ends with its own `check_frames`
  (which raised on bf16 frames before), and leaves finite parameters in
  that dtype whose frames moved (float16: optax.adamw's first update was
  NaN before)."""
  assert len(SWITCH) >= 2
  low = jnp.dtype(dtype)
  starts = _record_orthonormalize(monkeypatch)
  recording = so.orthonormalize

  def orthonormalize_low(*args, **kwargs):
    out = recording(*args, **kwargs)
    return jax.tree.map(
        lambda x: x.astype(low) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, out)

  monkeypatch.setattr(so, "orthonormalize", orthonormalize_low)
  ns = {"__name__": "__main__"}
  exec(compile(python_blocks()[index],
               f"README.md[python block {index}, {dtype} params]", "exec"), ns)
  trained = _trained(ns)
  assert trained is not None
  params = trained[0]
  assert all(bool(jnp.isfinite(x).all()) for x in _arrays(params).values())
  _check_trained(ns, trained, [{p: np.asarray(x).astype(low) for p, x in
                                s.items()} for s in starts], dtype=low)
