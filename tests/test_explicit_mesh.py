"""Explicit and Auto meshes, and Flax NNX's own sharding recipe, on 8
simulated CPU devices (issue 41).

One child process (`helpers.run_on_8_devices`) runs:

* nnx: `nnx.Optimizer(model, stiefel_attention(...), wrt=nnx.Param)` on an
  `nnx.MultiHeadAttention` built under `jax.set_mesh` and
  `nnx.logical_axis_rules` with `nnx.with_partitioning` kernels (Flax's
  recipe), eager sharding on and off, Auto and Explicit mesh axes, the
  heads or d (FSDP) sharded. The optimizer's state must carry the sharding
  its kernel implies (`nnx.get_partition_spec`), and a jitted step must
  add no collective that AdamW's step does not move (all-gathers,
  all-to-alls, permutes, reduce-scatters), only all-reduces of r x r blocks,
  per-frame scalars and decisions. Before the fix nnx.Optimizer raised (a
  ValueError of rank, or a bare AssertionError) or, with eager sharding
  off, gave mu the kernel's spec.
* Explicit axes (`jax.make_mesh`'s default): `tx.init`, `jax.jit(tx.update)`
  (equal to the unsharded update), `orthonormalize` and the diagnostics in
  every layout the library shards: heads, heads stacked
  (`stack_frames=True`), FSDP, scanned layers sharded over d, a fused
  c_attn sharded over d. Before the fix the heads layouts raised "select
  cases must have the same shardings" and the d-sharded ones "contracting
  dimensions are sharded".
"""

from __future__ import annotations

import collections

import pytest

from tests.helpers import once_per_session, run_on_8_devices

CHILD = r'''
import json
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import stiefel_optax as so
from tests.helpers import collectives, spec_entries as norm

assert jax.device_count() == 8
rng = np.random.default_rng(0)


def error(e):
  return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


# ---- Flax NNX's recipe.
RULES = {"heads": (("embed", None), ("heads", "model"), ("kv", None)),
         "fsdp": (("embed", "model"), ("heads", None), ("kv", None))}
lecun = nnx.initializers.lecun_normal()
is_p = lambda x: isinstance(x, P)


def nnx_case(layout, axis_type, eager):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  # Flax's own attention cannot contract a heads-sharded out kernel under
  # Explicit axes (its einsum names no out_sharding): there the out kernel's
  # heads stay unsharded; the query/key kernels are sharded as always.
  out_heads = None if (layout, axis_type) == ("heads", AxisType.Explicit) \
      else "heads"
  out = {}
  with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES[layout]), \
       nnx.use_eager_sharding(eager):
    for name, tx in (("adamw", optax.adamw(1e-3)),
                     ("stiefel", so.stiefel_attention(1e-3))):
      try:
        m = nnx.MultiHeadAttention(
            num_heads=4, in_features=32, decode=False, use_bias=False,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(lecun, ("embed", "heads", "kv")),
            out_kernel_init=nnx.with_partitioning(
                lecun, (out_heads, "kv", "embed")))
        nnx.update(m, so.orthonormalize(nnx.state(m, nnx.Param)))
        opt = nnx.Optimizer(m, tx, wrt=nnx.Param)
      except Exception as e:  # the failure before the fix, recorded
        out[name] = {"error": error(e)}
        continue
      graphdef, state = nnx.split((m, opt))
      specs = nnx.as_pure(nnx.get_partition_spec(state))
      pure = jax.device_put(nnx.as_pure(state), jax.tree.map(
          lambda s: NamedSharding(mesh, s), specs, is_leaf=is_p))

      def step(pure, x):
        m, opt = nnx.merge(graphdef, pure)
        opt.update(m, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(m))
        return nnx.as_pure(nnx.state((m, opt)))

      x = jax.device_put(jnp.asarray(rng.standard_normal((4, 6, 32)),
                                     jnp.float32),
                         NamedSharding(mesh, P("data")))
      compiled = jax.jit(step).lower(pure, x).compile()
      new = compiled(pure, x)
      out[name] = {
          "specs": {so.path_str(p): norm(s, len(s)) for p, s in
                    jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_p)},
          "arrays": {so.path_str(p): norm(a.sharding.spec, a.ndim)
                     for p, a in jax.tree_util.tree_leaves_with_path(new)},
          "collectives": collectives(compiled.as_text()),
          "iso": float(so.max_isometry_error(
              nnx.state(nnx.merge(graphdef, new)[0], nnx.Param))),
      }
  return out


result = {"devices": jax.device_count(), "nnx": {}}
for layout, axis_type, eager in (
    ("heads", AxisType.Auto, True), ("heads", AxisType.Auto, False),
    ("heads", AxisType.Explicit, True), ("fsdp", AxisType.Auto, False),
    ("fsdp", AxisType.Explicit, True)):
  key = f"{layout}/{axis_type.name}/{'eager' if eager else 'lazy'}"
  try:
    result["nnx"][key] = nnx_case(layout, axis_type, eager)
  except Exception as e:   # e.g. a state the placement refuses: recorded
    result["nnx"][key] = {n: {"error": error(e)} for n in ("adamw", "stiefel")}


# ---- Explicit axes: every entry point in every layout.
def kernel(*shape):
  """(..., d, heads, head_dim), each head's (d, head_dim) frame orthonormal."""
  d, h, hd = shape[-3:]
  q, r = np.linalg.qr(rng.standard_normal(shape[:-3] + (h, d, hd)))
  q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  return np.moveaxis(q, -3, -2).astype(np.float32)


def attn(d, h, hd, lead=()):
  return {"attn": {"query": {"kernel": kernel(*lead, d, h, hd)},
                   "key": {"kernel": kernel(*lead, d, h, hd)},
                   "value": {"kernel": rng.standard_normal(
                       lead + (d, h, hd)).astype(np.float32)}}}


def c_attn(d, h):
  q, k = (kernel(d, h, d // h).reshape(d, d) for _ in range(2))
  v = rng.standard_normal((d, d)).astype(np.float32)
  return {"h_0": {"c_attn": {"kernel": np.concatenate([q, k, v], 1)}}}


LAYOUTS = {   # params, sharding of every leaf, frames, stack_frames
    "heads": (attn(32, 8, 4), P(None, "x", None), None, False),
    "heads_stacked": (attn(32, 8, 4), P(None, "x", None), None, True),
    "fsdp": (attn(64, 4, 16), P("x", None, None), None, False),
    "scan_fsdp": (attn(64, 4, 16, (2,)), P(None, "x", None, None), "flax",
                  False),
    "fused_fsdp": (c_attn(64, 4), P("x", None),
                   {r"c_attn/kernel$": so.fused_qkv(4)}, False),
}
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
result["explicit"] = {}
for name, (params, spec, frames, stack) in LAYOUTS.items():
  tx = so.stiefel_attention(1e-2, frames=frames, stack_frames=stack)
  grads = jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)
                                  ).astype(np.float32), params)
  ref = jax.device_get(jax.jit(tx.update)(grads, tx.init(params), params)[0])
  got = {}
  with jax.set_mesh(mesh):
    sh = NamedSharding(mesh, spec)
    p, g = jax.device_put(params, sh), jax.device_put(grads, sh)
    calls = {
        "init": lambda: tx.init(p),
        "update": lambda: jax.jit(tx.update)(g, tx.init(p), p)[0],
        "orthonormalize": lambda: so.orthonormalize(p, frames),
        "check_frames": lambda: so.check_frames(p, frames),
        "frame_isometry_errors": lambda: so.frame_isometry_errors(p, frames),
        "max_isometry_error": lambda: so.max_isometry_error(p, frames),
        "frame_movement": lambda: so.frame_movement(p, p, frames),
    }
    for call, f in calls.items():
      try:
        out = jax.block_until_ready(f())
        got[call] = "ok"
      except Exception as e:
        got[call] = error(e)
        continue
      if call == "update":
        got["update_diff"] = max(
            float(np.max(np.abs(np.asarray(a) - b))) for a, b in
            zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        got["update_specs"] = sorted({str(norm(a.sharding.spec, a.ndim))
                                      for a in jax.tree.leaves(out)})
    # A start kept on one device, the model sharded since: a clear error
    # naming the leaf (jax alone refuses the difference naming none).
    try:
      so.frame_movement(jax.device_put(params, jax.devices()[0]), p, frames)
      got["movement_from_one_device"] = "ok"
    except Exception as e:
      got["movement_from_one_device"] = error(e)
  result["explicit"][name] = got
print("RESULT " + json.dumps(result))
'''


@pytest.fixture(scope="module")
def child(tmp_path_factory, worker_id):
  return once_per_session(tmp_path_factory, worker_id, "explicit_mesh",
                          lambda: run_on_8_devices(CHILD))


NO_MOVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")
NNX_CASES = ("heads/Auto/eager", "heads/Auto/lazy", "heads/Explicit/eager",
             "fsdp/Auto/lazy", "fsdp/Explicit/eager")
Q = "0/query/kernel"


@pytest.mark.parametrize("case", NNX_CASES)
def test_nnx_optimizer_state_is_sharded_as_its_kernel(child, case):
  """Heads sharded: mu (heads, d, kv) and nu (heads,) over the heads; FSDP:
  mu over d, nu replicated; AdamW's moments as their kernels."""
  assert child["devices"] == 8
  got = child["nnx"][case]["stiefel"]
  assert "error" not in got, got
  specs = got["specs"]
  kernel = specs[Q]                    # (embed, heads, kv) on the mesh
  view = [kernel[1], kernel[0], kernel[2]]
  assert view == (["model", None, None] if case.startswith("heads")
                  else [None, "model", None])
  for k in ("query", "key"):
    assert specs[f"1/opt_state/stiefel/1/mu/{k}/kernel"] == view, specs
    assert specs[f"1/opt_state/stiefel/1/nu/{k}/kernel"] == view[:1], specs
    # the arrays the jitted step returns are sharded so
    assert got["arrays"][f"1/opt_state/stiefel/1/mu/{k}/kernel"] == view
  for k in ("value", "out"):
    for moment in ("mu", "nu"):
      assert specs[f"1/opt_state/euclidean/0/{moment}/{k}/kernel"] == \
          specs[f"0/{k}/kernel"]
  assert got["iso"] <= 1e-5


@pytest.mark.parametrize("case", NNX_CASES)
def test_nnx_step_adds_no_collective_adamw_does_not(child, case):
  """The Stiefel step moves no array AdamW's step does not move; what it
  adds are all-reduces of r x r blocks (8 x 8; the query and key kernels'
  shared retraction fallback reduces them stacked, 2 x 4 x 8 x 8),
  per-frame scalars (4 heads) and whole-batch decisions (pred[]). Counted
  by operand: XLA combines all-reduces into tuples differently in the
  two programs."""
  got = child["nnx"][case]
  assert "error" not in got["stiefel"] and "error" not in got["adamw"], got
  stiefel, adamw = got["stiefel"]["collectives"], got["adamw"]["collectives"]
  for op in NO_MOVES:
    # (Flax's attention itself gathers under Explicit axes: AdamW's too)
    assert sorted(stiefel[op]) == sorted(adamw[op]), (op, stiefel[op])
  count = lambda ops: collections.Counter(
      o for s in ops for o in s.strip("()").split(", "))
  ours, theirs = count(stiefel["all-reduce"]), count(adamw["all-reduce"])
  assert not theirs - ours, theirs - ours    # AdamW's reductions, all kept
  assert set(ours - theirs) <= {"pred[]", "f32[4,8,8]", "f32[2,4,8,8]",
                                "f32[4]"}, ours - theirs


LAYOUTS = ("heads", "heads_stacked", "fsdp", "scan_fsdp", "fused_fsdp")
CALLS = ("init", "update", "orthonormalize", "check_frames",
         "frame_isometry_errors", "max_isometry_error", "frame_movement")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_explicit_mesh_every_entry_point(child, layout):
  got = child["explicit"][layout]
  assert {c: got[c] for c in CALLS} == {c: "ok" for c in CALLS}
  assert got["update_diff"] <= 1e-6, got["update_diff"]
  # the updates keep the params' sharding (one spec for every leaf)
  assert len(got["update_specs"]) == 1 and "x" in got["update_specs"][0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frame_movement_from_a_start_on_another_device_names_the_leaf(
    child, layout):
  got = child["explicit"][layout]["movement_from_one_device"]
  assert got.startswith("ValueError: frame_movement: parameter "), got
  assert "kernel" in got and "on 1 device(s) and the new one on 8" in got, got
