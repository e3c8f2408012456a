"""The Stiefel step sharded on 8 simulated CPU devices, both ways.

XLA reads `--xla_force_host_platform_device_count` when jax initialises its
CPU backend, so the sharded programs run in a child process that sets
XLA_FLAGS before importing jax; it prints one JSON line that the tests read.
Each case runs 3 steps of `stiefel_attention` unsharded and sharded (the
stacked heads case against the per-leaf case's unsharded run, on the same
params and gradients), and reads the collectives of the compiled sharded
update (the executable that ran).

* Heads-sharded: the query/key kernels (d, heads, head_dim) sharded over the
  heads axis put every frame whole on one device; the update must equal the
  unsharded one and move no array between devices (only the retraction's
  whole-batch pred[] decisions are all-reduced).
* FSDP: the kernels, and every other leaf with d rows, sharded over d
  (axis 0, the model axis) cut every frame into row blocks. The step needs
  only r x r Gram blocks (W^T G, W^T m, (W + xi)^T (W + xi), and Q^T Q in
  the retraction's fallback branch) and per-frame norms, sums over rows, so
  the compiled update must hold no all-gather, all-to-all, collective-permute
  or reduce-scatter: only all-reduces of (r x r) blocks and per-frame
  scalars, whose operands (shape and number) are pinned below. The same for
  a nanoGPT-style fused c_attn leaf (d, 3d) selected by `fused_qkv(heads)`:
  the q and k thirds are frames, the v third is AdamW's.
"""

from __future__ import annotations

import pytest

from tests.helpers import once_per_session, operands, run_on_8_devices


CHILD = r'''
import functools, json, re
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import stiefel_optax as so
from tests.helpers import collectives, run_sharded

assert jax.device_count() == 8, jax.devices()
rng = np.random.default_rng(0)
mesh = Mesh(np.array(jax.devices()), ("x",))
REP = NamedSharding(mesh, P())
QK = so.families.QK_KERNEL
# LLVM's optimisation of the CPU code is most of the compile time and none of
# what is tested: the SPMD partitioner and the HLO passes that place the
# collectives run as always.
jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# The trees, gradients and states are built, moved and compared as NumPy
# arrays on the host: jax would compile a small program for each eager op
# on each leaf shape and sharding (zeros, casts, resharding copies,
# differences), several seconds that test nothing; the steps alone are jax.


def frames(d, h, hd):
  """(d, heads, head_dim) kernel whose per-head (d, head_dim) frames are
  orthonormal."""
  q, r = np.linalg.qr(rng.standard_normal((h, d, hd)))
  q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  return np.transpose(q, (1, 0, 2)).astype(np.float32)


def normal(*shape):
  return (0.1 * rng.standard_normal(shape)).astype(np.float32)


def zeros(*shape):
  return np.zeros(shape, np.float32)


def mha_params(d, h, hd, mlp=48):
  def layer():
    return {"attn": {"query": {"kernel": frames(d, h, hd),
                               "bias": zeros(h, hd)},
                     "key": {"kernel": frames(d, h, hd),
                             "bias": zeros(h, hd)},
                     "value": {"kernel": normal(d, h, hd)},
                     "out": {"kernel": normal(h, hd, d)}},
            "mlp": {"kernel": normal(d, mlp), "bias": zeros(mlp)}}
  return {"layer_0": layer(), "layer_1": layer(), "embed": normal(40, d)}


def gpt_params(d, h):
  """Two nanoGPT blocks; c_attn's q and k thirds orthonormal per head."""
  hd = d // h
  def c_attn():
    q = frames(d, h, hd).reshape(d, d)
    k = frames(d, h, hd).reshape(d, d)
    v = normal(d, d)
    return np.concatenate([q, k, v], 1)
  def block():
    return {"attn": {"c_attn": {"kernel": c_attn(), "bias": zeros(3 * d)},
                     "c_proj": {"kernel": normal(d, d), "bias": zeros(d)}},
            "ln_1": {"scale": np.ones(d, np.float32)}}
  return {"transformer": {"h_0": block(), "h_1": block(),
                          "wte": {"embedding": normal(40, d)}}}


def sharder(rules):
  """tree -> shardings: the first (predicate, PartitionSpec) rule that
  fits a leaf (path string, shape), else replicated."""
  def one(path, x):
    for fits, spec in rules:
      if fits(so.path_str(path), tuple(x.shape)):
        return NamedSharding(mesh, spec)
    return REP
  return lambda tree: jax.tree_util.tree_map_with_path(one, tree)


def fsdp_sharder(d, view_shape, view_spec):
  """Frame views (and Stiefel-Adam's first moment) of `view_shape` by
  `view_spec`; every other leaf of rank >= 2 with d rows over axis 0 (FSDP)."""
  def one(path, x):
    s = tuple(x.shape)
    if s == view_shape:
      return NamedSharding(mesh, view_spec)
    if len(s) >= 2 and s[0] == d:
      return NamedSharding(mesh, P("x", *(None,) * (len(s) - 1)))
    return REP
  return lambda tree: jax.tree_util.tree_map_with_path(one, tree)


def run_case(params, frames_sel, shard, steps=3, stack=False,
             reference=None):
  """`steps` of stiefel_attention, unsharded (one device) and sharded by
  `shard` (inputs, outputs and state); the sharded program's compiled HLO is
  that of the executable that ran. Returns the case's result and its
  reference (gradients, unsharded final params); `reference` reuses an
  earlier case's, on the same params, instead of running the unsharded
  steps again."""
  tx = so.stiefel_attention(1e-2, frames=frames_sel, stack_frames=stack)
  p, _, compiled, reference = run_sharded(
      tx, params, lambda state0: (shard(params), shard(state0)),
      lambda: [jax.tree.map(lambda x: normal(*x.shape), params)
               for _ in range(steps)], jit, reference)
  grads, ref_p = reference
  hlo = compiled.as_text()

  sel = so.selected_frames(params, frames_sel)
  leaves = dict((so.path_str(q), x) for q, x in
                jax.tree_util.tree_leaves_with_path(p))
  host_p = jax.device_get(p)
  return {
      "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in
                          zip(jax.tree.leaves(host_p), jax.tree.leaves(ref_p))),
      "max_isometry_error": float(
          jit(lambda q: so.max_isometry_error(q, frames_sel))(host_p)),
      "selected": sorted(sel),
      "frame_shardings": sorted({tuple(leaves[k].sharding.spec) for k in sel},
                                key=str),
      "frame_shard_shapes": sorted({str(tuple(
          leaves[k].addressable_shards[0].data.shape)) for k in sel}),
      "collectives": collectives(hlo),
      "hlo_has": {t: t in hlo for t in ("f32[1,32,4]", "f32[4,8,32]",
                                        "f32[2,4,8,16]")},
  }, reference


result = {"devices": jax.device_count()}

# Heads-sharded: (32, 8, 4) kernels over their 8 heads; their frame views
# (8, 32, 4), the moments, and nu (8,) over the heads too.
D, H, HD = 32, 8, 4
is_qk = lambda path, shape: bool(re.search(QK, path))
HEADS = mha_params(D, H, HD)
result["heads"], per_leaf = run_case(HEADS, "flax", sharder([
    (lambda p, s: s == (D, H, HD) and is_qk(p, s), P(None, "x", None)),
    (lambda p, s: s == (H, D, HD), P("x", None, None)),
    (lambda p, s: s == (H,), P("x"))]))

# The same, the four kernels' frames stacked (stack_frames=True): the
# stack (4, 8, 32, 4) and its first moment over axis 1 (the heads), nu
# (4, 8) too. Same params and gradients as above, checked against the same
# unsharded per-leaf run: stacking gives the per-leaf update (to 1e-6,
# tests/test_partition.py), so a second, stacked unsharded run would
# only compile one more program.
result["heads_stacked"], _ = run_case(HEADS, "flax", sharder([
    (lambda p, s: s == (D, H, HD) and is_qk(p, s), P(None, "x", None)),
    (lambda p, s: s == (4, H, D, HD), P(None, "x", None, None)),
    (lambda p, s: s == (4, H), P(None, "x"))]), stack=True, reference=per_leaf)

# FSDP: every leaf with d rows, the (64, 4, 32) Q/K kernels among them,
# over d (axis 0), and their AdamW moments alike; the frame views
# (4, 64, 32) and Stiefel-Adam's first moment over d too; nu (4,), biases,
# embeddings and out (4, 32, 64) replicated.
D, H, HD = 64, 4, 32
result["fsdp"], _ = run_case(mha_params(D, H, HD), "flax",
                             fsdp_sharder(D, (H, D, HD), P(None, "x", None)))

# FSDP on a fused nanoGPT c_attn (64, 192) and the other (64, ...) leaves:
# frames (2, 4, 64, 16) over d; the v third (64, 64) that AdamW trains, and
# its moments, over d as well.
D, H = 64, 4
result["fused_fsdp"], _ = run_case(
    gpt_params(D, H), {r"c_attn/kernel$": so.fused_qkv(H)},
    fsdp_sharder(D, (2, H, D, D // H), P(None, None, "x", None)))

print("RESULT " + json.dumps(result))
'''


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, worker_id):
  return once_per_session(tmp_path_factory, worker_id, "sharding", run_child)


def run_child():
  return run_on_8_devices(CHILD)


NO_MOVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def test_runs_on_eight_devices_sharded_over_heads(sharded):
  heads = sharded["heads"]
  assert sharded["devices"] == 8
  assert heads["selected"] == [f"layer_{i}/attn/{n}/kernel"
                               for i in range(2) for n in ("key", "query")]
  assert heads["frame_shardings"] == [[None, "x", None]]
  assert heads["frame_shard_shapes"] == ["(32, 1, 4)"]


def test_heads_sharded_update_equals_unsharded(sharded):
  assert sharded["heads"]["max_abs_diff"] <= 1e-6
  assert sharded["heads"]["max_isometry_error"] <= 1e-5


def test_heads_sharded_moves_no_frame_between_devices(sharded):
  heads = sharded["heads"]
  # the per-device frame view (1 head, d, head_dim) appears in the program
  assert heads["hlo_has"]["f32[1,32,4]"]
  for op in NO_MOVES:
    assert heads["collectives"][op] == [], op
  # No array data crosses devices: only whole-batch decisions, per frame
  # leaf one pred for "every frame certified" (the lax.cond of
  # newton_schulz.certified_polars) and one for "some frame's ||G||^2 -
  # ||sym(W^T G)||^2 cancels" (transforms.tangent_sq_norm), and one for the
  # fallback loop's "any frame still active" (inside the cond's fallback
  # branch), which the four kernels of one shape share.
  assert operands(heads["collectives"]["all-reduce"]) == {"pred[]": 9}


def test_stacked_heads_sharded_moves_nothing_and_decides_once(sharded):
  """stack_frames=True on the heads-sharded kernels: the four kernels'
  frames stacked on a new axis keep their heads sharding, so still nothing
  moves between devices, and the three whole-batch decisions are taken once
  for the stack instead of once per kernel."""
  st = sharded["heads_stacked"]
  assert st["max_abs_diff"] <= 1e-6 and st["max_isometry_error"] <= 1e-5
  assert st["frame_shard_shapes"] == ["(32, 1, 4)"]
  for op in NO_MOVES:
    assert st["collectives"][op] == [], op
  assert operands(st["collectives"]["all-reduce"]) == {"pred[]": 3}


def test_fsdp_sharded_update_equals_unsharded(sharded):
  fsdp = sharded["fsdp"]
  assert fsdp["frame_shardings"] == [["x", None, None]]
  assert fsdp["frame_shard_shapes"] == ["(8, 4, 32)"]
  assert fsdp["hlo_has"]["f32[4,8,32]"]       # the local row blocks
  assert fsdp["max_abs_diff"] <= 1e-6
  assert fsdp["max_isometry_error"] <= 1e-5


def test_fsdp_reduces_only_gram_blocks_and_scalars(sharded):
  """Four (64, 4, 32) kernels, frames (4, 64, 32) cut into 8-row blocks.
  Per kernel: the (r x r) = (32 x 32) blocks W^T G (projection), W^T m
  (moment transport) and (W + xi)^T (W + xi) (retraction); once for the
  four, stacked, Q^T Q in the retraction's shared fallback branch (not run
  on the fast path); and per kernel the
  per-frame scalars ||G||_F^2 and, in the cancellation branch of
  `tangent_sq_norm` (not run unless a gradient is nearly normal),
  ||P_W G||_F^2 (second moment), and ||m||_F of the new moment, which gives
  ||xi||_F for the trust region and the Newton-Schulz bound
  (`stiefel_adam`'s one-pass update). Nothing moves a frame or a row
  block."""
  collect = sharded["fsdp"]["collectives"]
  for op in NO_MOVES:
    assert collect[op] == [], (op, collect[op])
  assert operands(collect["all-reduce"]) == {"f32[4,32,32]": 12,
                                             "f32[4,4,32,32]": 1,
                                             "f32[4]": 12}


def test_fused_fsdp_update_equals_unsharded(sharded):
  fused = sharded["fused_fsdp"]
  assert fused["selected"] == [f"transformer/h_{i}/attn/c_attn/kernel"
                               for i in range(2)]
  assert fused["frame_shardings"] == [["x", None]]
  assert fused["frame_shard_shapes"] == ["(8, 192)"]
  assert fused["hlo_has"]["f32[2,4,8,16]"]    # the local row blocks
  assert fused["max_abs_diff"] <= 1e-6
  assert fused["max_isometry_error"] <= 1e-5


def test_fused_fsdp_reduces_only_gram_blocks_and_scalars(sharded):
  """Two (64, 192) c_attn kernels under fused_qkv(4): frames (2, 4, 64, 16)
  (q and k thirds, 4 heads); the same (16 x 16) blocks (the fallback's
  stacked for the two kernels) and three per-frame scalars per kernel as
  above, and nothing for the v third, whose AdamW is elementwise on its own
  row blocks."""
  collect = sharded["fused_fsdp"]["collectives"]
  for op in NO_MOVES:
    assert collect[op] == [], (op, collect[op])
  assert operands(collect["all-reduce"]) == {"f32[2,4,16,16]": 6,
                                             "f32[2,2,4,16,16]": 1,
                                             "f32[2,4]": 6}
