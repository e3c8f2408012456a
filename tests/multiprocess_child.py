"""One process of tests/test_multiprocess.py: a cluster's training, or the
single-process run it is compared with.

    python -m tests.multiprocess_child OUT                # 1 process, 8 devices
    python -m tests.multiprocess_child OUT PID NPROC PORT # process PID of NPROC

In a cluster (`jax.distributed` over localhost, gloo CPU collectives, 4 CPU
devices per process) every parameter spans both processes: no process
holds one whole. For each layout (heads split across the processes; FSDP,
d split; data x model) it runs every host-side entry point on the global
parameters and `TrainState.create` (tx.init outside jit), and trains an
nnx model 3 steps by Flax NNX's own sharding recipe, unchanged
(`nnx.with_partitioning`, `nnx.logical_axis_rules`, `jax.set_mesh` on
`jax.make_mesh`'s default mesh, Explicit axes in jax 0.10, and a plain
`nnx.Optimizer`); in the heads layout it also trains the linen model
(Auto axes, `state_shardings`), its optimizer state saved and restored
with orbax by every process between steps 2 and 3. It writes
OUT/result_<PID>.json (each entry point's answers, which must be the same
on every process) and, from process 0, OUT/params.npz (the final
parameters, whole).

Importing this module does nothing (pytest's doctest collection imports it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import stiefel_optax as so

# Kernels (16, 8, 2), no biases (the key's has a zero gradient, so Adam's
# step on it is rounding noise that no two layouts share).
D, HEADS, BATCH, SEQ = 16, 8, 4, 6
LR = 1e-2

# name: ((data, model) mesh shape, logical axis -> mesh axis). The mesh
# follows jax.devices(): process 0's 4 devices, then process 1's.
LAYOUTS = {
    "heads": ((1, 8), {"heads": "model"}),
    "fsdp": ((1, 8), {"embed": "model"}),
    "data_model": ((2, 4), {"heads": "model", "batch": "data"}),
}


def shardings(tree, mesh, rules):
  """A NamedSharding per kernel of an attention (no biases): (embed,
  heads, kv), the output's (heads, kv, embed), each logical axis on its
  mesh axis under `rules`."""
  def one(path, x):
    out = "out" in jax.tree_util.keystr(path)
    names = ("heads", "kv", "embed") if out else ("embed", "heads", "kv")
    return NamedSharding(mesh, P(*(rules.get(n) for n in names)))
  return jax.tree_util.tree_map_with_path(one, tree)


def spec(a):
  """A global array's PartitionSpec, one entry (mesh axis or None) per
  axis."""
  e = list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec))
  return [x[0] if isinstance(x, tuple) and len(x) == 1 else x for x in e]


def put(tree, sh):
  """Host values (the same on every process) as global arrays."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(
          x.shape, s, lambda idx, x=np.asarray(x): x[idx]), tree, sh)


def whole(tree):
  """A tree of global arrays as NumPy, on every process."""
  return jax.tree.map(np.asarray,
                      multihost_utils.process_allgather(tree, tiled=True))


def error_of(fn):
  """fn()'s ValueError message, or None."""
  try:
    fn()
  except ValueError as err:
    return str(err)
  return None


def loss(y_hat, y):
  return jnp.mean((y_hat - y) ** 2)


def entry_points(params, tx):
  """Each host-side entry point's answer on global, orthonormal `params`
  (and on copies made bad); every process must give the same."""
  q = "query/kernel"
  bad = jax.tree.map(lambda a: a, params)
  bad["key"]["kernel"] = 2.0 * bad["key"]["kernel"]
  deficient = jax.tree.map(lambda a: a, params)
  deficient["query"]["kernel"] = params["query"]["kernel"].at[:, 5, 1].set(0)
  create = lambda p: train_state.TrainState.create(apply_fn=None, params=p,
                                                   tx=tx)
  answers = {     # in this order: tx.init first, where the cluster failed
      "create": error_of(lambda: create(params)),
      "create_bad": error_of(lambda: create(bad)),
      "init_deficient": error_of(lambda: so.stiefel_attention(
          LR, orthonormal_start="project").init(deficient)),
      "adam_init_bad": error_of(lambda: so.stiefel_adam(LR).init(
          {"w": jnp.transpose(bad["key"]["kernel"], (1, 0, 2))})),
      "check_frames": error_of(lambda: so.check_frames(params)),
      "check_frames_bad": error_of(lambda: so.check_frames(bad)),
  }
  errs = so.frame_isometry_errors(params)
  fixed = so.orthonormalize(bad)
  moved = so.frame_movement(params, bad)       # ||2W - W||_F = sqrt(2)
  return answers | {
      "iso": [list(errs[q].shape), bool(np.asarray(errs[q]).max() < 1e-5)],
      "max_iso_bad": round(float(so.max_isometry_error(bad)), 3),
      "max_iso_fixed": bool(float(so.max_isometry_error(fixed)) < 1e-5),
      "moved": [round(float(np.asarray(moved[q]).max()), 3),
                round(float(np.asarray(moved["key/kernel"]).max()), 3)],
  }


def linen_params(mesh, rules, x):
  """A linen attention's params, orthonormalized under jit, sharded."""
  model = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D,
                                          use_bias=False)
  init = lambda: so.orthonormalize(model.init(jax.random.key(0), x)["params"])
  p_sh = shardings(jax.eval_shape(init), mesh, rules)
  return model, jax.jit(init, out_shardings=p_sh)(), p_sh


def run_linen(model, params, p_sh, x, y, ckpt):
  """TrainState.create on global params (tx.init outside jit, as flax
  does), 2 steps, the optimizer state saved and restored with orbax, 1 step
  more. Returns (final params, whether the restored state is the saved
  one, bit for bit on this process's shards)."""
  tx = so.stiefel_attention(LR)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  s_sh = so.state_shardings(tx, params, p_sh)
  state = state.replace(opt_state=jax.device_put(state.opt_state, s_sh))
  state_sh = state.replace(step=NamedSharding(p_sh["query"]["kernel"].mesh,
                                              P()),
                           params=p_sh, opt_state=s_sh)

  def step(state, x, y):
    grads = jax.grad(lambda p: loss(state.apply_fn({"params": p}, x), y))(
        state.params)
    return state.apply_gradients(grads=grads)

  step = jax.jit(step, out_shardings=state_sh)
  for _ in range(2):
    state = step(state, x, y)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(ckpt, state.opt_state)
  ckptr.wait_until_finished()
  restored = ckptr.restore(ckpt, jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      state.opt_state, s_sh))
  same = all(
      a.sharding == b.sharding and all(
          np.array_equal(sa.data, sb.data)
          for sa, sb in zip(a.addressable_shards, b.addressable_shards))
      for a, b in zip(jax.tree.leaves(state.opt_state),
                      jax.tree.leaves(restored)))
  state = step(state.replace(opt_state=restored), x, y)
  return whole(state.params), same


class NnxAttention(nnx.Module):
  """An nnx attention whose kernels carry Flax logical axis names: the
  output kernel's heads are `out_heads` (see run_nnx)."""

  def __init__(self, rngs, out_heads="heads"):
    init = nnx.initializers.lecun_normal()
    self.attn = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=D, qkv_features=D, decode=False,
        use_bias=False, rngs=rngs,
        kernel_init=nnx.with_partitioning(init, ("embed", "heads", "kv")),
        out_kernel_init=nnx.with_partitioning(init,
                                              (out_heads, "kv", "embed")))

  def __call__(self, x):
    return self.attn(x)


def run_nnx(shape, rules, xy):
  """Flax NNX's own sharding recipe, as a user writes it on the cluster:
  kernels with `nnx.with_partitioning`, a mesh from `jax.make_mesh`'s
  defaults (Explicit axes in jax 0.10) set by `jax.set_mesh`,
  `nnx.logical_axis_rules`, and a plain `nnx.Optimizer` (the state's
  shardings follow the kernels'; no `state_shardings`, no device_put).
  Orthonormalized on the global params, 3 steps. Returns the final
  params and {the mesh's axis types, the query kernel's mu and nu
  shardings}."""
  mesh = jax.make_mesh(shape, ("data", "model"))
  explicit = AxisType.Explicit in mesh.axis_types
  # Flax's attention cannot contract a heads-sharded output kernel under
  # Explicit axes (its einsum names no out_sharding; AdamW's too): there
  # the output kernel's heads stay whole. Auto axes shard them as well.
  out_heads = None if explicit and rules.get("heads") else "heads"
  logical = tuple((n, rules.get(n)) for n in ("embed", "heads", "kv"))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(logical):
    model = NnxAttention(nnx.Rngs(0), out_heads)
    nnx.update(model, so.orthonormalize(nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, so.stiefel_attention(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
      grads = nnx.grad(lambda m: loss(m(x), y))(model)
      optimizer.update(model, grads)

    x, y = put(xy, [NamedSharding(mesh, P(rules.get("batch")))] * 2)
    for _ in range(3):
      step(model, optimizer, x, y)
  fs = nnx.as_pure(optimizer.opt_state).stiefel[1]
  return whole(nnx.as_pure(nnx.state(model, nnx.Param))), {
      "axis_types": [t.name for t in mesh.axis_types],
      "mu": spec(fs.mu["attn"]["query"]["kernel"]),
      "nu": spec(fs.nu["attn"]["query"]["kernel"])}


def main(out, pid=0, nproc=1, port=0):
  if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid, initialization_timeout=60)
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  xy = [rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
        for _ in range(2)]
  results, final, start = {}, {}, time.time()
  for name, (shape, rules) in LAYOUTS.items():
    print(f"{time.time() - start:.1f}s: {name}", file=sys.stderr, flush=True)
    # The entry points and linen's recipe: Auto axes (nnx: run_nnx's mesh).
    mesh = jax.make_mesh(shape, ("data", "model"),
                         axis_types=(AxisType.Auto,) * 2)
    batch = NamedSharding(mesh, P(rules.get("batch")))
    x, y = put(xy, [batch] * 2)
    model, params, p_sh = linen_params(mesh, rules, x)
    results[name] = entry_points(params, so.stiefel_attention(LR))
    trained = {}
    trained["nnx"], results[name]["nnx"] = run_nnx(shape, rules, xy)
    if name == "heads":
      trained["linen"], results[name]["restored"] = run_linen(
          model, params, p_sh, x, y, os.path.join(out, "ckpt"))
    for prefix, tree in trained.items():
      for path, a in jax.tree_util.tree_leaves_with_path(tree):
        final[f"{name}/{prefix}{jax.tree_util.keystr(path)}"] = a
  print(f"{time.time() - start:.1f}s: done ({time.process_time():.1f} s of"
        " CPU in all)", file=sys.stderr, flush=True)
  with open(os.path.join(out, f"result_{pid}.json"), "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  if pid == 0:
    np.savez(os.path.join(out, "params.npz"), **final)


if __name__ == "__main__":
  import conftest           # lower as the suite does: one MLIR context
  conftest.share_one_ir_context()
  main(sys.argv[1], *map(int, sys.argv[2:5]))
