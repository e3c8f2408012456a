"""The Stiefel step sharded over attention heads on 8 simulated CPU devices.

XLA reads `--xla_force_host_platform_device_count` when jax initialises its
CPU backend, so the sharded program runs in a child process that sets
XLA_FLAGS before importing jax; it prints one JSON line that the tests read.

With the query/key kernels (d, heads, head_dim) sharded over the heads axis,
every frame lies whole on one device: the jitted `stiefel_attention` update
must equal the unsharded one, and the compiled program of the Stiefel part
must move no frame between devices (no all-gather, no all-to-all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, re
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import stiefel_optax as so

assert jax.device_count() == 8, jax.devices()
D, H, HD, MLP = 32, 8, 4, 48
rng = np.random.default_rng(0)

def frames():
  q, r = np.linalg.qr(rng.standard_normal((H, D, HD)))
  q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  return jnp.asarray(np.transpose(q, (1, 0, 2)), jnp.float32)

def normal(*shape):
  return jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32)

def layer():
  return {"attn": {"query": {"kernel": frames(), "bias": jnp.zeros((H, HD))},
                   "key": {"kernel": frames(), "bias": jnp.zeros((H, HD))},
                   "value": {"kernel": normal(D, H, HD)},
                   "out": {"kernel": normal(H, HD, D)}},
          "mlp": {"kernel": normal(D, MLP), "bias": jnp.zeros(MLP)}}

params = {"layer_0": layer(), "layer_1": layer(), "embed": normal(40, D)}
grads = [jax.tree.map(lambda x: normal(*x.shape), params) for _ in range(3)]
qk = lambda path: bool(re.search(so.DEFAULT_QK_PATTERNS[0], so.path_str(path)))

mesh = Mesh(np.array(jax.devices()), ("heads",))
rep = NamedSharding(mesh, P())
def spec(path, x):
  """Q/K kernels (d, heads, head_dim) and their (heads, d, head_dim) frame
  views over the heads axis; nu (heads,) too; everything else replicated."""
  if x.shape == (D, H, HD) and qk(path):
    return NamedSharding(mesh, P(None, "heads", None))
  if x.shape == (H, D, HD):
    return NamedSharding(mesh, P("heads", None, None))
  if x.shape == (H,):
    return NamedSharding(mesh, P("heads"))
  return rep
shard = lambda tree: jax.tree_util.tree_map_with_path(spec, tree)

def stiefel_part_hlo():
  """Compiled HLO of the Stiefel group alone (`stiefel_adam` on the frame
  views, as `stiefel_attention` runs it) on the sharded Q/K kernels."""
  pick = lambda tree: {so.path_str(p): x for p, x in
                       jax.tree_util.tree_leaves_with_path(tree) if qk(p)}
  qk_params, qk_grads = pick(params), pick(grads[0])
  inner = so.frames_transform(so.stiefel_adam(1e-2))
  state = inner.init(qk_params)
  ps, ss = shard(qk_params), shard(state)
  fn = jax.jit(inner.update, in_shardings=(ps, ss, ps), out_shardings=(ps, ss))
  return fn.lower(*jax.device_put((qk_grads, state, qk_params), (ps, ss, ps))
                  ).compile().as_text()

tx = so.stiefel_attention(1e-2)

# Unsharded reference: three steps on one device.
ref_p, ref_s = params, tx.init(params)
upd = jax.jit(tx.update)
for g in grads:
  u, ref_s = upd(g, ref_s, ref_p)
  ref_p = optax.apply_updates(ref_p, u)

# Sharded: the same three steps, inputs and outputs sharded over heads.
p_sh = shard(params)
state0 = tx.init(params)
s_sh = shard(state0)
step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
    *tx.update(g, s, p)), in_shardings=(p_sh, s_sh, p_sh),
    out_shardings=(p_sh, s_sh))
p, s = jax.device_put(params, p_sh), jax.device_put(state0, s_sh)
for g in grads:
  p, s = step(jax.device_put(g, p_sh), s, p)

diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
           zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)))
qk_leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(p) if qk(path)]
full_hlo = step.lower(jax.device_put(grads[0], p_sh), s, p).compile().as_text()
part_hlo = stiefel_part_hlo()

def collectives(text):
  return {op: len(re.findall(r"\b" + op + r"(-start)?\(", text))
          for op in ("all-gather", "all-to-all", "all-reduce",
                     "collective-permute", "reduce-scatter")}

print("RESULT " + json.dumps({
    "devices": jax.device_count(),
    "max_abs_diff": diff,
    "qk_shardings": sorted({tuple(x.sharding.spec) for x in qk_leaves}, key=str),
    "qk_shards_per_leaf": sorted({len(x.addressable_shards) for x in qk_leaves}),
    "qk_shard_shape": sorted({tuple(x.addressable_shards[0].data.shape)
                              for x in qk_leaves}),
    "part_collectives": collectives(part_hlo),
    "full_collectives": collectives(full_hlo),
    # the per-device frame view (1 head, d, head_dim) appears in the program
    "part_is_partitioned": f"f32[1,{D},{HD}]" in part_hlo,
    "max_isometry_error": float(max(jnp.max(so.isometry_error(
        so.to_frames(x, so.FLAX_PER_HEAD))) for x in qk_leaves)),
}))
'''


@pytest.fixture(scope="module")
def sharded():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
  return json.loads(line[-1][len("RESULT "):])


def test_runs_on_eight_devices_sharded_over_heads(sharded):
  assert sharded["devices"] == 8
  assert sharded["qk_shardings"] == [[None, "heads", None]]
  assert sharded["qk_shards_per_leaf"] == [8]
  assert sharded["qk_shard_shape"] == [[32, 1, 4]]


def test_sharded_update_equals_unsharded(sharded):
  assert sharded["max_abs_diff"] <= 1e-6
  assert sharded["max_isometry_error"] <= 1e-5


def test_stiefel_part_moves_no_frame_between_devices(sharded):
  assert sharded["part_is_partitioned"]
  assert sharded["part_collectives"]["all-gather"] == 0
  assert sharded["part_collectives"]["all-to-all"] == 0
  assert sharded["part_collectives"]["collective-permute"] == 0


def test_whole_update_gathers_nothing(sharded):
  # The rest of the tree is replicated here, so nothing needs gathering.
  assert sharded["full_collectives"]["all-gather"] == 0
  assert sharded["full_collectives"]["all-to-all"] == 0
