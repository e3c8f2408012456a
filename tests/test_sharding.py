"""`state_shardings` (stiefel_optax/sharding.py): the optimizer state
sharded as its parameters, on 8 simulated CPU devices.

As a MaxText user does: a linen model whose kernels carry logical axis names
(`nn.with_logical_partitioning`), `nn.get_partition_spec` of the boxed
params, then `stiefel_optax.state_shardings(tx, params, specs)` and
`nn.logical_to_mesh_sharding` for the state. The step (update + apply) is
jitted with those in/out shardings and run against the unsharded one; the
state it returns is read leaf by leaf, and the compiled program's
collectives are counted (`helpers.collectives`). The sharded programs run
in a child process that sets XLA_FLAGS before importing jax (as
`tests/test_sharded_step.py` does), which prints one JSON line.

Cases (the Stiefel parts have the shapes of `tests/test_sharded_step.py`'s,
so its pinned collectives are the bound):

* heads: two attention blocks (32, 8, 4) whose Q/K/V kernels are logically
  ("embed", "heads", "kv"), with the rule heads -> x: every frame whole on
  one device, no array moved; only the 12 pred[] decisions all-reduced.
* heads, stack_frames=True: the stack and its moments over the heads; 3
  pred[].
* heads, naive: the kernels' specs copied onto the state leaves by path
  (what the boxes of `jax.eval_shape(tx.init, boxed_params)` do): the
  first moment's d axis gets the heads' sharding, and the step reshards.
  The control that the collective count sees it.
* FSDP: blocks (64, 4, 32) with the rule embed -> x: the frames cut into
  row blocks; only (r x r) Gram blocks and per-frame scalars all-reduced.
* fused FSDP: a nanoGPT c_attn (64, 192) model, its NamedShardings (rows
  over x) passed directly.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import stiefel_optax as so
from tests.helpers import (
    frame_adam_states, once_per_session, operands, run_on_8_devices)


CHILD = r'''
import functools, json, re
import jax, jax.numpy as jnp, numpy as np, optax
import flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import stiefel_optax as so
from tests.helpers import collectives, run_sharded

assert jax.device_count() == 8, jax.devices()
rng = np.random.default_rng(0)
mesh = Mesh(np.array(jax.devices()), ("x",))
jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def boxed_init(names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
  heads: int
  qkv: int

  @nn.compact
  def __call__(self, x):
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.heads, qkv_features=self.qkv,
        kernel_init=boxed_init(("embed", "heads", "kv")),
        out_kernel_init=boxed_init(("heads", "kv", "embed")), name="attn")(x)
    d = x.shape[-1]
    return x + y + nn.Dense(d, kernel_init=boxed_init(("embed", "mlp")),
                            name="mlp")(x + y)


class Model(nn.Module):
  heads: int
  qkv: int

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(self.heads, self.qkv, name=f"layer_{i}")(x)
    return x


class GPT(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      d = x.shape[-1]
      qkv = nn.Dense(3 * d, kernel_init=boxed_init(("embed", "qkv")),
                     name=f"c_attn_{i}")(x)
      q, k, v = jnp.split(qkv, 3, axis=-1)
      split = lambda a: a.reshape(a.shape[:-1] + (self.heads, d // self.heads))
      y = nn.dot_product_attention(split(q), split(k), split(v))
      x = x + nn.Dense(d, kernel_init=boxed_init(("embed", "mlp")),
                       name=f"c_proj_{i}")(y.reshape(x.shape))
    return x


def norm_spec(spec, ndim):
  """A PartitionSpec as a list of ndim entries (None or one axis name)."""
  entries = list(spec) + [None] * (ndim - len(tuple(spec)))
  return [e[0] if isinstance(e, tuple) and len(e) == 1 else
          (list(e) if isinstance(e, tuple) else e) for e in entries]


def leaves_table(tree):
  return [{"path": jax.tree_util.keystr(p), "shape": list(x.shape),
           "spec": norm_spec(x.sharding.spec, x.ndim),
           "shard": list(x.addressable_shards[0].data.shape)}
          for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def init(model, d, frames):
  x = np.zeros((1, 4, d), np.float32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  params = nn.unbox(jit(model.init)(jax.random.key(0), x)["params"])
  params = jax.device_get(jit(lambda p: so.orthonormalize(p, frames))(params))
  return boxed, params


def naive(state, logical_params):
  """The kernels' specs copied onto the state leaves whose path ends with
  the parameter's (rank permitting), else replicated: the layout the state
  gets from the parameters' boxes."""
  by_path = {so.path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(
      logical_params, is_leaf=lambda x: isinstance(x, P))}
  def one(path, x):
    key = so.path_str(path)
    for p, s in by_path.items():
      if key.endswith(p) and len(tuple(s)) == x.ndim:
        return s
    return P()
  return jax.tree_util.tree_map_with_path(one, state)


def run_case(model, d, rules, frames=None, stack=False, steps=2,
             reference=None, how="logical"):
  boxed, params = init(model, d, frames)
  logical = nn.get_partition_spec(boxed)
  tx = so.stiefel_attention(1e-2, frames=frames, stack_frames=stack)
  p_sh = nn.logical_to_mesh_sharding(logical, mesh, rules)
  if how == "logical":       # the MaxText route: logical names throughout
    s_sh = nn.logical_to_mesh_sharding(
        so.state_shardings(tx, params, logical, frames=frames), mesh, rules)
  elif how == "named":       # NamedShardings in, NamedShardings out
    s_sh = so.state_shardings(tx, params, p_sh, frames=frames)
  else:                      # the kernels' specs copied onto the state
    s_sh = nn.logical_to_mesh_sharding(
        naive(jax.eval_shape(tx.init, params), logical), mesh, rules)

  p, s, compiled, reference = run_sharded(
      tx, params, lambda _: (p_sh, s_sh),
      lambda: [jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)
                                       ).astype(np.float32), params)
               for _ in range(steps)], jit, reference)
  grads, ref_p = reference
  host_p = jax.device_get(p)
  return {
      "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in
                          zip(jax.tree.leaves(host_p), jax.tree.leaves(ref_p))),
      "params": {so.path_str(q): norm_spec(x.sharding.spec, x.ndim)
                 for q, x in jax.tree_util.tree_leaves_with_path(p)},
      "state": leaves_table(s),
      "collectives": collectives(compiled.as_text()),
  }, reference


HEADS_RULES = (("heads", "x"), ("embed", None), ("kv", None), ("mlp", None))
FSDP_RULES = (("embed", "x"), ("heads", None), ("kv", None), ("mlp", None))
result = {"devices": jax.device_count()}
heads_model = Model(heads=8, qkv=32)             # kernels (32, 8, 4)
result["heads"], ref = run_case(heads_model, 32, HEADS_RULES)
result["heads_stacked"], _ = run_case(heads_model, 32, HEADS_RULES,
                                      stack=True, reference=ref)
result["heads_naive"], _ = run_case(heads_model, 32, HEADS_RULES,
                                    reference=ref, how="naive")
result["fsdp"], _ = run_case(Model(heads=4, qkv=128), 64, FSDP_RULES)
result["fused_fsdp"], _ = run_case(
    GPT(heads=4), 64, FSDP_RULES + (("qkv", None),),
    frames={r"c_attn_\d/kernel$": so.fused_qkv(4)}, how="named")
print("RESULT " + json.dumps(result))
'''


def run_child():
  return run_on_8_devices(CHILD)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, worker_id):
  return once_per_session(tmp_path_factory, worker_id, "state_sharding",
                          run_child)


NO_MOVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def expected_state_spec(case, leaf, stacked=False):
  """What a state leaf's sharding must be, from its kernel's, written out
  per layout (independently of the library's mapping): the linen kernel
  (d, heads, hd) -> frames (heads, d, hd); nu (heads,); a stack (k, heads,
  d, hd); the fused c_attn (d, 3d) under fused_qkv -> (2, heads, d, hd),
  nu (2, heads), its v third (d, d) as the kernel; AdamW's moments as their
  leaves; counts replicated."""
  path, ndim = leaf["path"], len(leaf["shape"])
  params = case["params"]
  if path.endswith(".count") or ndim == 0:
    return [None] * ndim
  if stacked and ".stiefel" in path:
    kernels = [s for p, s in params.items()
               if p.endswith(("query/kernel", "key/kernel"))]
    assert all(s == kernels[0] for s in kernels)
    e = kernels[0]
    return ([None, e[1], e[0], e[2]] if ".mu" in path else [None, e[1]])
  key = path.split(".mu", 1)[-1] if ".mu" in path else path.split(".nu", 1)[-1]
  key = "/".join(re.findall(r"\['([^']*)'\]", key))
  e = params[key]
  if ".stiefel" not in path:
    return e                                   # AdamW follows its leaf
  if key.split("/")[-2].startswith("c_attn"):  # fused: the part axis unsharded
    view = [None, None, e[0], None]
  else:                                        # linen (d, heads, hd)
    view = [e[1], e[0], e[2]]
  return view if ".mu" in path else view[:ndim]



@pytest.mark.parametrize("case", ["heads", "heads_stacked", "fsdp",
                                  "fused_fsdp"])
def test_state_is_sharded_as_its_kernel(sharded, case):
  assert sharded["devices"] == 8
  got = sharded[case]
  assert got["max_abs_diff"] <= 1e-6
  stacked = case == "heads_stacked"
  moments = [l for l in got["state"] if ".stiefel" in l["path"]
             and l["shape"]]
  assert moments, got["state"]
  for leaf in got["state"]:
    assert leaf["spec"] == expected_state_spec(got, leaf, stacked), leaf


def test_heads_state_shards_hold_whole_frames(sharded):
  """Heads over 8 devices: each device holds one head's frame, first moment
  and second moment; FSDP: an 8-row block of every frame."""
  shards = {l["path"]: l["shard"] for l in sharded["heads"]["state"]}
  q = "['layer_0']['attn']['query']['kernel']"
  assert shards[".stiefel[1].mu" + q] == [1, 32, 4]
  assert shards[".stiefel[1].nu" + q] == [1]
  shards = {l["path"]: l["shard"] for l in sharded["fsdp"]["state"]}
  assert shards[".stiefel[1].mu" + q] == [4, 8, 32]
  assert shards[".stiefel[1].nu" + q] == [4]
  st = {l["path"]: l["shard"] for l in sharded["heads_stacked"]["state"]}
  assert st[".stiefel[1].mu[0]"] == [4, 1, 32, 4]


# The bound: what tests/test_sharded_step.py pins for the same Stiefel shapes
# (its state shardings written by hand), nothing more.
# (The four kernels of one shape share one retraction fallback,
# `newton_schulz.certified_polars`: its loop decision and its stacked Q^T Q
# block appear once, tests/test_sharded_step.py.)
PINNED = {"heads": {"pred[]": 9}, "heads_stacked": {"pred[]": 3},
          "fsdp": {"f32[4,32,32]": 12, "f32[4,4,32,32]": 1, "f32[4]": 12},
          "fused_fsdp": {"f32[2,4,16,16]": 6, "f32[2,2,4,16,16]": 1,
                         "f32[2,4]": 6}}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_step_adds_no_resharding(sharded, case):
  collect = sharded[case]["collectives"]
  for op in NO_MOVES:
    assert collect[op] == [], (case, op, collect[op])
  assert operands(collect["all-reduce"]) == PINNED[case], collect


def test_kernel_specs_copied_onto_the_state_reshard(sharded):
  """The control: with the kernels' specs on the state (the d axis of the
  first moment sharded where the step computes over heads), the same step
  moves data between devices, and the count above sees it."""
  collect = sharded["heads_naive"]["collectives"]
  assert sharded["heads_naive"]["max_abs_diff"] <= 1e-6
  assert sum(len(collect[op]) for op in NO_MOVES) > 0, collect


# --------------------------------------------------------------------------
# In process: the mapping and its errors (abstract meshes and specs).

MESH = AbstractMesh((8,), ("x",))


def qk_params(d=32, h=8, hd=4):
  s = jax.ShapeDtypeStruct
  return {"attn": {"query": {"kernel": s((d, h, hd), jnp.float32)},
                   "key": {"kernel": s((d, h, hd), jnp.float32)},
                   "value": {"kernel": s((d, h, hd), jnp.float32)}}}


def specs_for(params, spec):
  return jax.tree.map(lambda _: spec, params)


def test_issue_example_logical_names_follow_the_axes():
  """The issue's example: the query kernel (32, 4, 8) labelled ('embed',
  'heads', 'kv'); its first moment (4, 32, 8) is (heads, embed, kv) and its
  second moment (4,) is (heads,)."""
  params = qk_params(32, 4, 8)
  specs = so.state_shardings(so.stiefel_attention(1e-3), params,
                             specs_for(params, P("embed", "heads", "kv")))
  adam = specs.stiefel[1]
  assert adam.mu["attn"]["query"]["kernel"] == P("heads", "embed", "kv")
  assert adam.nu["attn"]["query"]["kernel"] == P("heads")
  assert specs.euclidean[0].mu["attn"]["value"]["kernel"] == P(
      "embed", "heads", "kv")
  assert adam.count == P() and specs.euclidean[0].count == P()


def test_boxed_params_need_no_shardings_and_tx_init_warns():
  import flax.linen as nn
  model = nn.MultiHeadDotProductAttention(
      num_heads=4, qkv_features=32, kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), ("embed", "heads", "kv")))
  boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 4, 32)))
  tx = so.stiefel_attention(1e-3)
  specs = so.state_shardings(tx, boxed["params"])
  assert specs.stiefel[1].mu["query"]["kernel"] == P("heads", "embed", "kv")
  assert specs.stiefel[1].nu["key"]["kernel"] == P("heads")
  with pytest.warns(UserWarning, match=r"state_shardings\(tx, params"):
    jax.eval_shape(tx.init, boxed["params"])


def test_named_shardings_keep_the_mesh_and_replicate_scalars():
  params = qk_params()
  sh = specs_for(params, NamedSharding(MESH, P(None, "x", None)))
  specs = so.state_shardings(so.stiefel_attention(1e-3), params, sh)
  mu = specs.stiefel[1].mu["attn"]["query"]["kernel"]
  assert mu.mesh == MESH and mu.spec == P("x", None, None)
  assert specs.stiefel[1].count == NamedSharding(MESH, P())


def test_stacked_frames_sharded_alike_stack_and_unlike_are_refused():
  params = qk_params()
  tx = so.stiefel_attention(1e-3, stack_frames=True)
  specs = so.state_shardings(tx, params, specs_for(params, P(None, "x")))
  assert specs.stiefel[1].mu == (P(None, "x", None, None),)
  assert specs.stiefel[1].nu == (P(None, "x"),)
  mixed = specs_for(params, P(None, "x"))
  mixed["attn"]["key"]["kernel"] = P("x")
  with pytest.raises(ValueError, match=r"stack_frames=True.*attn/key/kernel"
                     r".*stack_frames=False"):
    so.state_shardings(tx, params, mixed)


def test_split_axes_keep_the_sharding_only_where_it_divides():
  fused = so.fused_qkv(4)
  assert so.frame_view_spec(fused, (64, 192), P("x", None)) == (
      P(None, None, "x", None), P("x", None))
  with pytest.warns(UserWarning, match=r"c_attn: axis 1 .*cut into 3 parts"):
    view, rest = so.frame_view_spec(fused, (64, 192),
                                    NamedSharding(MESH, P(None, "x")),
                                    name="c_attn")
  assert view.spec == P(None, None, None, None) and rest.spec == P(None, None)
  haiku = so.FrameSpec(rows=-2, cols=-1, heads=8)
  assert so.frame_view_spec(haiku, (32, 32), NamedSharding(MESH, P(None, "x"))
                            )[0].spec == P("x", None, None)
  with pytest.warns(UserWarning, match=r"does not divide heads = 4"):
    view, _ = so.frame_view_spec(so.FrameSpec(rows=-2, cols=-1, heads=4),
                                 (32, 32), NamedSharding(MESH, P(None, "x")))
  assert view.spec == P(None, None, None)
  gemma_kv = so.families.GEMMA_KV          # (2, K, D, H), the key half
  assert so.frame_view_spec(gemma_kv, (2, 2, 32, 8),
                            P(None, "kv_heads", "embed", None)) == (
      P(None, None, "kv_heads", "embed", None),
      P(None, "kv_heads", "embed", None))


def test_wrong_shardings_name_the_path_the_shape_and_the_fix():
  params = qk_params()
  tx = so.stiefel_attention(1e-3)
  missing = specs_for(params, P())
  del missing["attn"]["key"]
  with pytest.raises(ValueError, match=r"no sharding for attn/key/kernel"
                     r" \(shape \(32, 8, 4\)\).*Fix: give param_shardings"):
    so.state_shardings(tx, params, missing)
  long = specs_for(params, P())
  long["attn"]["query"]["kernel"] = P("x", None, None, None)
  with pytest.raises(ValueError, match=r"attn/query/kernel has shape"
                     r" \(32, 8, 4\) \(rank 3\).*names 4 axes.*Fix"):
    so.state_shardings(tx, params, long)
  odd = specs_for(params, NamedSharding(MESH, P()))
  odd["attn"]["query"]["kernel"] = NamedSharding(MESH, P(None, None, "x"))
  with pytest.raises(ValueError, match=r"attn/query/kernel has shape"
                     r" \(32, 8, 4\).*axis 2 of size 4 over 8 devices.*Fix"):
    so.state_shardings(tx, params, odd)
  bad = specs_for(params, P())
  bad["attn"]["value"]["kernel"] = "x"
  with pytest.raises(ValueError, match=r"attn/value/kernel \(shape"
                     r" \(32, 8, 4\)\) has sharding 'x'.*NamedSharding or"
                     r" PartitionSpec"):
    so.state_shardings(tx, params, bad)
  with pytest.raises(ValueError, match=r"pass param_shardings"):
    so.state_shardings(tx, params)


def test_frames_that_do_not_fit_the_state_are_named():
  """A state made with another selector than the one state_shardings is
  told: the error names the state leaf, the selection and the fix."""
  params = qk_params()
  tx = so.stiefel_attention(1e-3, frames={r"query/kernel$": so.FrameSpec(
      rows=0, cols=2)})
  with pytest.raises(ValueError, match=r"Stiefel group's state leaf .*fits no"
                     r" frame view.*frames= the optimizer was built with"):
    so.state_shardings(tx, params, specs_for(params, P()))
  fused = {"c_attn": {"kernel": jax.ShapeDtypeStruct((16, 48), jnp.float32)}}
  tx = so.stiefel_attention(1e-3, frames={r"c_attn/kernel$": so.fused_qkv(2)})
  with pytest.raises(ValueError, match=r"fused_qkv.*optimizer's own frames="):
    so.state_shardings(tx, fused, specs_for(fused, P()))


def test_no_warning_where_every_sharding_follows():
  params = qk_params()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    so.state_shardings(so.stiefel_attention(1e-3), params,
                       specs_for(params, NamedSharding(MESH, P("x"))))


def _frame_adam(state):
  (fs,) = frame_adam_states(state)
  return fs


def test_equinox_out_in_weights_sharded_over_heads():
  """eqx.nn.MultiheadAttention's (heads * qk, d) weights sharded over
  their rows (the heads): frames (heads, d, qk) over the heads."""
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MultiheadAttention(num_heads=8, query_size=32,
                                    key=jax.random.key(0))
  params = eqx.filter(model, eqx.is_inexact_array)
  sh = jax.tree.map(lambda x: NamedSharding(
      MESH, P("x", None) if x.ndim == 2 else P()), params)
  fs = _frame_adam(so.state_shardings(so.stiefel_attention(1e-3), params, sh))
  assert fs.mu.query_proj.weight.spec == P("x", None, None)
  assert fs.nu.key_proj.weight.spec == P("x")


def test_haiku_2d_weights_sharded_over_heads():
  """hk.MultiHeadAttention's (d, heads * key_size) weights sharded over
  their columns: frames (heads, d, key_size) over the heads."""
  hk = pytest.importorskip("haiku")
  def forward(x):
    return hk.MultiHeadAttention(
        num_heads=8, key_size=4, model_size=32,
        w_init=hk.initializers.VarianceScaling())(x, x, x)
  model = hk.without_apply_rng(hk.transform(forward))
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 4, 32)))
  frames = so.haiku_mha(8)
  sh = jax.tree.map(lambda x: NamedSharding(
      MESH, P(None, "x") if x.shape[-1] == 32 and x.ndim == 2 else P()),
      params)
  fs = _frame_adam(so.state_shardings(
      so.stiefel_attention(1e-3, frames=frames), params, sh, frames=frames))
  mha = "multi_head_attention"
  assert fs.mu[f"{mha}/query"]["w"].spec == P("x", None, None)
  assert fs.nu[f"{mha}/key"]["w"].spec == P("x")
