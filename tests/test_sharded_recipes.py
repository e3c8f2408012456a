"""The sharded-training recipes of docs/families.md, run on 8 simulated CPU
devices: the sections "Sharded training (`state_shardings`)" (Flax linen
and nnx) and "Sharded training: Equinox, Haiku, Haliax, penzai"
(`snippets.SHARDED_SECTIONS`).

One child process (`helpers.run_on_8_devices`, once per session) runs
every block of those sections as written, each in a fresh namespace, and
holds each to two rules:

* the snippet rule of every docs block (tests/test_readme_snippets.py runs
  the other blocks in the test process): the block trained, its Q/K frames
  moved from where `orthonormalize` put them and stayed orthonormal, and
  the Stiefel group's moments are set (`snippets.check_trained`);
* its sharding: the mesh spans all 8 devices and every Stiefel first
  moment is sharded as the recipe's own state shardings say (`state_sh`,
  or nnx's `specs`), split over the mesh, not replicated. For linen and
  nnx, sharded over the 8 heads: the query kernel's mu (heads, embed, kv)
  one head's (d, head_dim) block per device, its nu (heads,) one scalar.
"""

from __future__ import annotations

import json

import pytest

from tests import snippets
from tests.helpers import once_per_session, run_on_8_devices

CHILD = r"""
import json, traceback
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P
import stiefel_optax as so
from tests import snippets
from tests.helpers import spec_entries as norm

assert jax.device_count() == 8


out = {}
for name, source in snippets.sharded_blocks().items():
  starts = snippets.record_orthonormalize(setattr)
  ns = {"__name__": "__main__"}
  exec(compile(source, f"docs/families.md[{name}]", "exec"), ns)
  trained = snippets.trained(ns)
  try:
    assert trained is not None, "the block left nothing trained behind"
    snippets.check_trained(ns, trained, starts)
    rule = None
  except AssertionError:
    rule = traceback.format_exc(limit=2)
  (fs,) = snippets.frame_adam_states(trained[1])
  if "specs" in ns:               # nnx: the state's PartitionSpecs
    want = nnx.as_pure(ns["specs"]).opt_state.stiefel[1].mu
    as_said = lambda x, t: norm(x.sharding.spec, x.ndim) == norm(t, x.ndim)
  else:                           # a tree of NamedShardings
    (want,) = snippets.frame_adam_states(ns["state_sh"])
    want = want.mu
    as_said = lambda x, t: x.sharding.is_equivalent_to(t, x.ndim)
  mu = {so.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(fs.mu)}
  nu = {so.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(fs.nu)}
  targets = jax.tree.leaves(want, is_leaf=lambda t: isinstance(t, P))
  q = next((p for p in mu if "query" in p), None)
  out[name] = {
      "rule": rule, "mesh": int(ns["mesh"].size), "steps": int(fs.count),
      "leaves": len(mu),
      "as_said": len(targets) == len(mu) and all(
          as_said(x, t) for x, t in zip(jax.tree.leaves(fs.mu), targets)),
      "split": all(not x.sharding.is_fully_replicated for x in mu.values()),
      "query": q and {
          "path": q, "mu": norm(mu[q].sharding.spec, mu[q].ndim),
          "nu": norm(nu[q].sharding.spec, nu[q].ndim),
          "mu_shard": list(mu[q].addressable_shards[0].data.shape),
          "nu_shard": list(nu[q].addressable_shards[0].data.shape)},
  }
print("RESULT " + json.dumps(out))
"""

BLOCKS = {"Flax linen": 1, "Flax nnx": 1, "Equinox": 3, "Haiku": 3,
          "Haliax (Levanter)": 3, "penzai": 3}      # heading: its steps


@pytest.fixture(scope="module")
def child(tmp_path_factory, worker_id):
  return once_per_session(tmp_path_factory, worker_id, "sharded_recipes",
                          lambda: run_on_8_devices(CHILD))


def test_the_sections_hold_the_recipes_and_shard_the_state_by_the_library():
  blocks = snippets.sharded_blocks()
  assert set(blocks) == set(BLOCKS), set(blocks)
  for name, source in blocks.items():
    assert ("stiefel_optax.state_shardings(" in source
            or "nnx.Optimizer(" in source), name
    assert "stiefel_optax.orthonormalize(" in source, name


@pytest.mark.parametrize("name", BLOCKS)
def test_recipe_runs_and_trains_by_the_snippet_rule(child, name):
  assert child[name]["rule"] is None, child[name]["rule"]
  assert child[name]["steps"] == BLOCKS[name], child[name]


@pytest.mark.parametrize("name", BLOCKS)
def test_recipe_shards_the_state_as_it_says_over_8_devices(child, name):
  r = child[name]
  assert r["mesh"] == 8 and r["leaves"] >= 2, r
  assert r["as_said"] and r["split"], r
  if name.startswith("Flax"):     # 8 heads over 8 devices
    q = r["query"]
    assert q is not None, r
    assert q["mu"] == ["model", None, None] and q["nu"] == ["model"], q
    assert q["mu_shard"] == [1, 64, 8] and q["nu_shard"] == [1], q
