"""The sharded-training recipes of docs/families.md for Equinox, Haiku,
Haliax and penzai, run on 8 simulated CPU devices.

tests/test_readme_snippets.py runs every block of the page in the test
process (one device, where every sharding is trivial); here the blocks of
the section "Sharded training: Equinox, Haiku, Haliax, penzai" run in one
child process that sees 8 devices, each in a fresh namespace. After its
steps, every Stiefel first moment must be sharded as `state_shardings`
said (`state_sh`), split over the mesh (not replicated), its frames
orthonormal, and the mesh must span all 8 devices.
"""

from __future__ import annotations

import json
import re

from tests.helpers import ROOT, run_on_8_devices

PAGE = ROOT / "docs" / "families.md"
SECTION = "## Sharded training: Equinox, Haiku, Haliax, penzai"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def recipe_blocks() -> dict:
  """{### heading: python source} of the section's blocks."""
  text = PAGE.read_text(encoding="utf-8")
  start = text.index(SECTION)
  end = text.find("\n## ", start + len(SECTION))
  section = text[start:end if end >= 0 else None]
  out = {}
  for part in section.split("\n### ")[1:]:
    heading = part.splitlines()[0].strip()
    (source,) = BLOCK.findall(part)
    out[heading] = source
  return out


CHILD = r"""
import json
import jax, jax.numpy as jnp
import stiefel_optax as so

is_fs = lambda x: isinstance(x, so.ScaleByFrameAdamState)
out = {}
for name, source in json.loads(SOURCES).items():
  ns = {"__name__": "__main__"}
  exec(compile(source, f"families.md[{name}]", "exec"), ns)
  (fs,) = [x for x in jax.tree.leaves(ns["opt_state"], is_leaf=is_fs) if is_fs(x)]
  (target,) = [x for x in jax.tree.leaves(ns["state_sh"], is_leaf=is_fs) if is_fs(x)]
  params = ns["params"] if "params" in ns else ns["model"]
  mu = jax.tree.leaves(fs.mu)
  out[name] = {
      "devices": len(jax.devices()), "mesh": int(ns["mesh"].size),
      "steps": int(fs.count), "leaves": len(mu),
      "as_said": all(x.sharding.is_equivalent_to(t, x.ndim)
                     for x, t in zip(mu, jax.tree.leaves(target.mu))),
      "split": all(not x.sharding.is_fully_replicated for x in mu),
      "isometry": float(so.max_isometry_error(params, ns.get("frames")))}
print("RESULT " + json.dumps(out))
"""


def test_sharded_recipes_run_on_8_devices_with_the_state_sharded():
  blocks = recipe_blocks()
  assert set(blocks) == {"Equinox", "Haiku", "Haliax (Levanter)", "penzai"}
  for source in blocks.values():
    assert "stiefel_optax.state_shardings(" in source
  result = run_on_8_devices(
      f"SOURCES = {json.dumps(json.dumps(blocks))}\n" + CHILD)
  assert set(result) == set(blocks)
  for name, r in result.items():
    assert r["devices"] == 8 and r["mesh"] == 8, (name, r)
    assert r["steps"] == 3 and r["leaves"] >= 2, (name, r)
    assert r["as_said"] and r["split"], (name, r)
    assert r["isometry"] <= 1e-5, (name, r)
