"""Every ```python block of README.md and of the docs/*.md pages runs as
written.

Each block runs in a fresh namespace (the snippets are self-contained). A
snippet that trains must have taken a step, and its Q/K frames must have
moved from where `orthonormalize` put them while staying orthonormal
(`tests/snippets.py`: `check_trained`). The docs/*.md pages (the long
forms of the README's sections, e.g. docs/families.md) are held to the
same rules, and the README links each of them. The blocks of the
sharded-training sections (`snippets.SHARDED_SECTIONS`) run, under the
same rules, on the 8 devices they shard over
(tests/test_sharded_recipes.py), not here on one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stiefel_optax as so

from tests import snippets
from tests.snippets import DOC_PAGES, README, python_blocks

SHARDED = set(snippets.sharded_blocks().values())
# (page, index) of every ```python block, README.md first, but those of the
# sharded sections.
BLOCKS = [(page, index) for page in snippets.PAGES
          for index, source in enumerate(python_blocks(page))
          if source not in SHARDED]


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
    assert f"({snippets.name(page)}" in text, (
        f"README.md does not link {snippets.name(page)}")


@pytest.mark.parametrize(
    "page,index", BLOCKS,
    ids=[f"{snippets.name(page)}[{index}]" for page, index in BLOCKS])
def test_python_block_runs(page, index, monkeypatch):
  source = python_blocks(page)[index]
  ns = {"__name__": "__main__"}
  starts = snippets.record_orthonormalize(monkeypatch.setattr)
  exec(compile(source, f"{snippets.name(page)}[python block {index}]",
               "exec"), ns)
  trained = snippets.trained(ns)
  if trained is None:
    return                      # not a training snippet: running it is the test
  snippets.check_trained(ns, trained, starts)


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
  starts = snippets.record_orthonormalize(monkeypatch.setattr)
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
  trained = snippets.trained(ns)
  assert trained is not None
  params = trained[0]
  assert all(bool(jnp.isfinite(x).all())
             for x in snippets.arrays(params).values())
  snippets.check_trained(
      ns, trained, [{p: np.asarray(x).astype(low) for p, x in s.items()}
                    for s in starts], dtype=low)
