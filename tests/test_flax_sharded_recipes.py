"""The Flax linen and nnx sharded-training recipes of docs/families.md
("Sharded training (`state_shardings`)"), run on 8 simulated CPU devices.

tests/test_readme_snippets.py runs every block of the page in the test
process (one device, where every sharding is trivial); here the section's
"### Flax linen" and "### Flax nnx" blocks run in one child process that
sees 8 devices, each in a fresh namespace. After the step, the query
kernel's Stiefel moments must be split over the 8 heads (one head's
(d, head_dim) first moment and one second moment per device), as the
recipe's own shardings say, and the frames must stay orthonormal.
"""

from __future__ import annotations

import re

from tests.helpers import ROOT, run_on_8_devices

PAGE = ROOT / "docs" / "families.md"
SECTION = "## Sharded training (`state_shardings`)"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def recipe_blocks() -> dict:
  """{### heading: python source} of the section's blocks."""
  text = PAGE.read_text(encoding="utf-8")
  start = text.index(SECTION)
  end = text.find("\n## ", start + len(SECTION))
  out = {}
  for part in text[start:end].split("\n### ")[1:]:
    (source,) = BLOCK.findall(part)
    out[part.splitlines()[0].strip()] = source
  return out


CHILD = r"""
import json, sys
import jax, numpy as np
from flax import nnx
import stiefel_optax as so

blocks = json.loads(sys.argv[1])
assert jax.device_count() == 8
out = {}

def spec(a):
  e = list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec))
  return [x[0] if isinstance(x, tuple) and len(x) == 1 else x for x in e]

ns = {"__name__": "__main__"}
exec(blocks["Flax linen"], ns)
fs = ns["opt_state"].stiefel[1]
want = ns["state_sh"].stiefel[1]
mu, nu = fs.mu["query"]["kernel"], fs.nu["query"]["kernel"]
out["linen"] = {
    "mu": spec(mu), "nu": spec(nu),
    "want_mu": list(want.mu["query"]["kernel"].spec),
    "mu_shard": list(mu.addressable_shards[0].data.shape),
    "nu_shard": list(nu.addressable_shards[0].data.shape),
    "count": int(fs.count),
    "iso": float(so.max_isometry_error(ns["params"])),
    "mesh": ns["mesh"].size}

ns = {"__name__": "__main__"}
exec(blocks["Flax nnx"], ns)
fs = nnx.as_pure(ns["optimizer"].opt_state).stiefel[1]
mu, nu = fs.mu["query"]["kernel"], fs.nu["query"]["kernel"]
specs = nnx.as_pure(ns["specs"]).opt_state.stiefel[1]
out["nnx"] = {
    "mu": spec(mu), "nu": spec(nu),
    "want_mu": list(specs.mu["query"]["kernel"]),
    "mu_shard": list(mu.addressable_shards[0].data.shape),
    "nu_shard": list(nu.addressable_shards[0].data.shape),
    "count": int(fs.count),
    "iso": float(so.max_isometry_error(
        nnx.as_pure(nnx.state(ns["model"], nnx.Param)))),
    "mesh": ns["mesh"].size}
print("RESULT " + json.dumps(out))
"""


def test_flax_sharded_recipes_split_the_state_on_8_devices():
  import json
  blocks = recipe_blocks()
  assert set(blocks) == {"Flax linen", "Flax nnx"}, set(blocks)
  result = run_on_8_devices(
      f"import sys; sys.argv[1:] = [{json.dumps(json.dumps(blocks))}]\n"
      + CHILD)
  for name in ("linen", "nnx"):
    got = result[name]
    assert got["mesh"] == 8, got
    assert got["mu"] == got["want_mu"] == ["model", None, None], got
    assert got["nu"] == ["model"], got
    assert got["mu_shard"] == [1, 64, 8] and got["nu_shard"] == [1], got
    assert got["count"] == 1 and got["iso"] <= 1e-5, got
