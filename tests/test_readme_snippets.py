"""Every ```python block of README.md and of the docs/*.md pages runs as
written.

Each block runs in a fresh namespace (the snippets are self-contained). A
snippet that builds a TrainState or an nnx.Optimizer must have taken a step,
and its Q/K frames must have moved while staying orthonormal. The docs/*.md
pages (the long forms of the README's sections, e.g. docs/families.md) are
held to the same rules, and the README links each of them.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import stiefel_optax as so

from tests.helpers import ROOT

README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README] + DOC_PAGES
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
def test_python_block_runs(page, index):
  source = python_blocks(page)[index]
  ns = {"__name__": "__main__"}
  exec(compile(source, f"{_name(page)}[python block {index}]", "exec"), ns)
  trained = _trained(ns)
  if trained is None:
    return                      # not a training snippet: running it is the test
  params, opt_state, steps = trained
  assert steps >= 1
  errs = so.frame_isometry_errors(params, ns.get("frames"))
  assert errs, "no query/key frame found in the snippet's model"
  assert max(float(jnp.max(e)) for e in errs.values()) <= 1e-5
  # The Stiefel group took the step: its moments are set, one scalar per frame.
  is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
  (fs,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_fs) if is_fs(x)]
  assert int(fs.count) == steps
  nu = {so.path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(fs.nu)}
  assert set(nu) == set(errs)
  assert all(v.shape == errs[p].shape and float(jnp.min(v)) > 0
             for p, v in nu.items())
