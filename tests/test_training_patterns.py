"""The matrix of training patterns (issue 55): every way the supported
frameworks' users drive an optax optimizer, each with `stiefel_attention`.

Frameworks: Flax linen, Flax NNX, Equinox and Haiku, each a tiny model
(one attention of 2 heads on d = 8, then a linear head). Cells (the rows of
the issue's matrix): eager; a `jax.jit` update; a `jax.jit` init (also with
`out_shardings` from `state_shardings`); `jax.eval_shape(tx.init, ...)`
and `tx.init` on a tree of `jax.ShapeDtypeStruct`s; several steps inside
`jax.lax.scan`; an orbax restore into the abstract state, then steps equal
to the uninterrupted run; and the framework's own wrappers: `nnx.Optimizer`
(eager and under `nnx.jit`), NNX's functional pattern (`nnx.split`, then
`tx.update` on the `nnx.State` under `jax.jit`, sharded or not), linen's
`TrainState`. (For NNX the generic cells run on the `nnx.State` of
`nnx.split`: Variables, the functional pattern.)

Every cell checks the two promises of the optimizer: the frames stay on
the manifold (isometry error within `ISO_TOL`), and every other parameter
equals, bit for bit, plain `optax.adamw` fed the same gradients (its twin:
AdamW's step of a leaf reads only that leaf, its gradient and its state,
so with the same gradients the two runs hold the same bits wherever the
same program computes them; the twin runs in the same program as ours).

Cost: one module-scope fixture per framework compiles its step once (the
gradient, our update and the twin's, one program) and the reference run
that the cells compare with; the whole file runs in a few seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import chex
import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import stiefel_optax as so

from tests.helpers import leaves_by_path

D, HEADS, OUT, BATCH, SEQ = 8, 2, 3, 2, 4
LR, WD = 3e-2, 1e-4
STEPS = 3
# A frame after a polar retraction in float32: ||W^T W - I||_F is a few
# eps * sqrt(r) per step (the retraction's certificate; r = 4), 2e-6 after
# three steps with a wide margin.
ISO_TOL = 2e-6

FRAMEWORKS = ("linen", "nnx", "equinox", "haiku")


def _data():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((BATCH, SEQ, D)), jnp.float32),
          jnp.asarray(rng.standard_normal((BATCH, OUT)), jnp.float32))


# ---------------------------------------------------------------------------
# The models: params (as the framework's users hand them to optax), the
# frame selector, and loss(params, x, y).


class _Linen(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(x)
    return nn.Dense(OUT)(jnp.mean(h, axis=1))


class _Nnx(nnx.Module):

  def __init__(self, rngs, kernel_init=None):
    kw = {} if kernel_init is None else {"kernel_init": kernel_init}
    self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D,
                                       qkv_features=D, decode=False,
                                       rngs=rngs, **kw)
    self.head = nnx.Linear(D, OUT, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.mean(self.attn(x), axis=1))


class _Eqx(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.attn = eqx.nn.MultiheadAttention(num_heads=HEADS, query_size=D,
                                          key=k1)
    self.head = eqx.nn.Linear(D, OUT, key=k2)

  def __call__(self, x):
    h = jax.vmap(lambda s: self.attn(s, s, s))(x)
    return jax.vmap(self.head)(jnp.mean(h, axis=1))


def _haiku_forward(x):
  h = hk.MultiHeadAttention(num_heads=HEADS, key_size=D // HEADS,
                            model_size=D,
                            w_init=hk.initializers.VarianceScaling())(x, x, x)
  return hk.Linear(OUT)(jnp.mean(h, axis=1))


def _mse(y_hat, y):
  return jnp.mean((y_hat - y) ** 2)


@dataclasses.dataclass
class Setup:
  """One framework's model as optax sees it."""
  name: str
  params: Any                # orthonormal frames; the optimizer's tree
  frames: Any                # the selector
  loss: Callable             # loss(params, x, y)
  extra: dict = dataclasses.field(default_factory=dict)


# The nnx model is sharded by Flax NNX's own recipe (`nnx.with_partitioning`
# on logical names, a mesh, `nnx.logical_axis_rules`), on one device: its
# Variables carry `out_sharding`, and the optimizer's init hands the state
# Variables with the mapped one, the case of issue 55's regression.
NNX_RULES = (("embed", None), ("heads", "model"), ("kv", None))


def _nnx_mesh():
  return jax.make_mesh((1, 1), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _np_polar(w):
  """The polar factor of each frame, from a NumPy SVD (no program to
  compile; `orthonormalize` has its own tests)."""
  u, _, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
  return jnp.asarray(u @ vt, jnp.float32)


def _setup(name) -> Setup:
  """The framework's model, its frames orthonormal."""
  x, _ = _data()
  key = jax.random.key(1)
  if name == "linen":
    model = _Linen()
    params = so.map_frames(_np_polar, jax.jit(model.init)(key, x)["params"])
    return Setup(name, params, None,
                 lambda p, x, y: _mse(model.apply({"params": p}, x), y),
                 {"model": model})
  if name == "nnx":
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                 ("embed", "heads", "kv"))
    with jax.set_mesh(_nnx_mesh()), nnx.logical_axis_rules(NNX_RULES):
      model = _Nnx(nnx.Rngs(1), kernel_init=init)
    # The values taken off the mesh (the metadata stays): arrays committed
    # to a mesh would make every program here compile twice.
    nnx.update(model, jax.tree.map(jnp.asarray, jax.device_get(
        so.map_frames(_np_polar, nnx.state(model, nnx.Param)))))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return Setup(name, params, None,
                 lambda p, x, y: _mse(nnx.merge(graphdef, p, rest)(x), y),
                 {"model": model})
  if name == "equinox":
    model = so.map_frames(_np_polar, _Eqx(key))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return Setup(name, params, None,
                 lambda p, x, y: _mse(eqx.combine(p, static)(x), y))
  model = hk.without_apply_rng(hk.transform(_haiku_forward))
  frames = so.haiku_mha(num_heads=HEADS)
  params = so.map_frames(_np_polar, jax.jit(model.init)(key, x), frames)
  return Setup(name, params, frames,
               lambda p, x, y: _mse(model.apply(p, x), y))


def _tx(setup):
  return so.stiefel_attention(LR, weight_decay=WD, frames=setup.frames)


TWIN = optax.adamw(LR, weight_decay=WD)


def _frame_paths(setup) -> set:
  return {path for path, _, spec in so.frame_specs(setup.params, setup.frames)
          if spec is not None}


def _values(tree):
  """{path: array} of a tree (Flax NNX Variables by their values)."""
  return leaves_by_path(so.wrapped_state.unwrap_variables(tree))


def assert_trained(setup, params, twin_params, start=None):
  """The two promises: frames on the manifold (and moved), every other
  leaf bitwise equal to the AdamW twin's."""
  iso = float(so.max_isometry_error(so.wrapped_state.unwrap_variables(params),
                                    setup.frames))
  assert iso <= ISO_TOL, (setup.name, iso)
  ours, twin = _values(params), _values(twin_params)
  frames = _frame_paths(setup)
  assert set(ours) == set(twin) and frames < set(ours), (frames, set(ours))
  for path in sorted(set(ours) - frames):
    np.testing.assert_array_equal(ours[path], twin[path], err_msg=path)
  if start is not None:
    first = _values(start)
    moved = max(float(jnp.max(jnp.abs(ours[p] - first[p]))) for p in frames)
    assert moved > 1e-3, (setup.name, moved)   # the frames did train


class Runs:
  """Every framework's reference run, and the compiled programs the cells
  share: XLA compiles a Stiefel update in about a second whatever its size,
  so each program steps (or inits) all four frameworks at once.

  A carry is (params, state, twin params, twin state); `step` maps
  {framework: carry} to the carries one step on, each framework's
  gradients fed to its optimizer and to its AdamW twin.
  """

  def __init__(self):
    self.setups = {n: _setup(n) for n in FRAMEWORKS}
    self.txs = {n: _tx(s) for n, s in self.setups.items()}
    self.x, self.y = _data()
    self.params = {n: s.params for n, s in self.setups.items()}
    self.state0 = {n: tx.init(self.params[n]) for n, tx in self.txs.items()}
    self.twin0 = {n: TWIN.init(p) for n, p in self.params.items()}
    model = self.setups["linen"].extra["model"]
    make = lambda tx: train_state.TrainState.create(
        apply_fn=model.apply, params=self.params["linen"], tx=tx)
    self.train_states = (make(self.txs["linen"]), make(TWIN))
    self.step = jax.jit(self.step_fn)
    self.scan = jax.jit(lambda carries: jax.lax.scan(
        lambda c, _: (self.step_fn(c), None), carries, None,
        length=STEPS)[0])
    self.init = jax.jit(self.init_fn)
    # The reference: STEPS jitted steps from the eager init.
    self.trajectory = [self.start(self.state0)]
    for _ in range(STEPS):
      self.trajectory.append(self.step(self.trajectory[-1]))

  def one_step(self, name, params, state, twin_params, twin_state):
    setup, tx = self.setups[name], self.txs[name]
    grads = jax.grad(setup.loss)(params, self.x, self.y)
    u, state = tx.update(grads, state, params)
    tu, twin_state = TWIN.update(grads, twin_state, twin_params)
    return (optax.apply_updates(params, u), state,
            optax.apply_updates(twin_params, tu), twin_state)

  def step_fn(self, carries):
    out = {n: self.one_step(n, *carries[n]) for n in FRAMEWORKS}
    if "train_state" in carries:   # linen's TrainState and its twin
      ours, twin = carries["train_state"]
      grads = jax.grad(self.setups["linen"].loss)(ours.params, self.x, self.y)
      out["train_state"] = (ours.apply_gradients(grads=grads),
                            twin.apply_gradients(grads=grads))
    return out

  def init_fn(self, params):
    return {n: self.txs[n].init(p) for n, p in params.items()}

  def start(self, states):
    """The carries from `states` (and linen's TrainStates from theirs)."""
    return {n: (self.params[n], states[n], self.params[n], self.twin0[n])
            for n in FRAMEWORKS} | {"train_state": self.train_states}

  def run_from(self, states):
    carries = self.start(states)
    for _ in range(STEPS):
      carries = self.step(carries)
    return carries


@functools.lru_cache(maxsize=None)
def _runs():
  return Runs()


@pytest.fixture(scope="module")
def runs():
  return _runs()


def _same(a, b):
  """Bitwise equal trees of the same structure (Variables and all)."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  chex.assert_trees_all_equal(a, b)


# ---------------------------------------------------------------------------
# The generic cells, for every framework.

framework = pytest.mark.parametrize("name", FRAMEWORKS)


@functools.lru_cache(maxsize=None)
def _eager():
  """Two eager steps of every framework: eager init, eager updates (op by
  op); the models' gradients jitted (one program for all four)."""
  runs = _runs()
  grads = jax.jit(lambda p: {n: jax.grad(runs.setups[n].loss)(
      p[n], runs.x, runs.y) for n in FRAMEWORKS})
  p = dict(runs.params)
  s = {n: runs.txs[n].init(p[n]) for n in FRAMEWORKS}
  tp, ts = dict(runs.params), dict(runs.twin0)
  for _ in range(2):
    g = grads(p)
    for n in FRAMEWORKS:
      u, s[n] = runs.txs[n].update(g[n], s[n], p[n])
      tu, ts[n] = TWIN.update(g[n], ts[n], tp[n])
      p[n], tp[n] = optax.apply_updates(p[n], u), optax.apply_updates(tp[n],
                                                                       tu)
  return p, s, tp


@framework
def test_eager(runs, name):
  """Eager init, eager update."""
  p, s, tp = (x[name] for x in _eager())
  assert jax.tree.structure(s) == jax.tree.structure(runs.state0[name])
  assert_trained(runs.setups[name], p, tp, runs.params[name])


@framework
def test_jit_update(runs, name):
  """The reference run: eager init, jitted steps; the state keeps its
  structure (a jit output, Variables and all)."""
  p, s, tp, _ = runs.trajectory[-1][name]
  assert jax.tree.structure(s) == jax.tree.structure(runs.state0[name])
  assert_trained(runs.setups[name], p, tp, runs.params[name])


@functools.lru_cache(maxsize=None)
def _jit_init_run():
  runs = _runs()
  states = runs.init(runs.params)
  return states, runs.run_from(states)


@framework
def test_jit_init(runs, name):
  """`jax.jit(tx.init)` gives the eager init's state, bit for bit, and the
  run from it is the reference run."""
  states, carries = _jit_init_run()
  _same(states[name], runs.state0[name])
  _same(carries[name], runs.trajectory[-1][name])
  assert_trained(runs.setups[name], carries[name][0], carries[name][2])


@functools.lru_cache(maxsize=None)
def _sharded_init():
  """`jax.jit(init, out_shardings=...)`, the states' shardings from
  `state_shardings` (on a one-device mesh; tests/test_sharded_recipes.py
  runs 8 devices)."""
  runs = _runs()
  values = {n: so.wrapped_state.unwrap_variables(p)
            for n, p in runs.params.items()}
  mesh = jax.make_mesh((1,), ("model",))
  shardings = {n: so.state_shardings(
      runs.txs[n], v, jax.tree.map(lambda _: NamedSharding(mesh, P()), v),
      frames=runs.setups[n].frames) for n, v in values.items()}
  init = jax.jit(lambda p: {n: runs.txs[n].init(x) for n, x in p.items()},
                 out_shardings=shardings)
  return init(values), shardings


@framework
def test_jit_init_with_out_shardings(runs, name):
  """The sharded recipes' init, `jax.jit(tx.init, out_shardings=...)` on
  the params' values: the shardings asked for, the eager init's values;
  the run from it (fetched to the host: committed arrays would compile
  another program) is the reference run."""
  states, shardings = _sharded_init()
  state = states[name]
  assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(
      shardings[name])
  _same(state, so.wrapped_state.unwrap_variables(runs.state0[name]))
  back = so.wrapped_state.rewrap_like(runs.state0[name], jax.device_get(state))
  carries = runs.run_from(runs.state0 | {name: back})
  _same(carries[name], runs.trajectory[-1][name])


@framework
def test_eval_shape_and_abstract_init(runs, name):
  """`jax.eval_shape(tx.init, abstract)` (how checkpoints are restored)
  and `tx.init(abstract)` on a tree of ShapeDtypeStructs (as optax's
  transforms take it) give the state's structure, shapes and dtypes."""
  tx, state0 = runs.txs[name], runs.state0[name]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          runs.params[name])
  want = [(x.shape, x.dtype) for x in jax.tree.leaves(state0)]
  for state in (jax.eval_shape(tx.init, abstract), tx.init(abstract)):
    assert jax.tree.structure(state) == jax.tree.structure(state0)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(state)] == want


@functools.lru_cache(maxsize=None)
def _scanned():
  runs = _runs()
  return runs.scan(runs.start(runs.state0))


@framework
def test_steps_inside_lax_scan(runs, name):
  """STEPS steps as one `lax.scan` (the state a scan carry; the twin in
  the same scan)."""
  p, s, tp, _ = _scanned()[name]
  assert jax.tree.structure(s) == jax.tree.structure(runs.state0[name])
  assert_trained(runs.setups[name], p, tp, runs.params[name])


def test_orbax_restore_into_the_abstract_state(runs, tmp_path):
  """Every framework's run saved after one step (one checkpoint: orbax's
  start-up is paid once), restored into the abstract tree
  (`jax.eval_shape`, as a restore with a target does: the state's exact
  structure), then continued: the same bits as the uninterrupted run."""
  values = so.wrapped_state.unwrap_variables
  saved = {n: [values(x) for x in runs.trajectory[1][n]] for n in FRAMEWORKS}
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", saved)
  ckpt.wait_until_finished()
  start = runs.start(runs.state0)
  target = jax.eval_shape(lambda: {
      n: [values(x) for x in start[n]] for n in FRAMEWORKS})
  # (Fetched to the host: orbax's arrays are committed to a device, which
  # would compile the step again.)
  restored = jax.device_get(ckpt.restore(tmp_path / "ckpt", target))
  # Back into the frameworks' trees (NNX: the Variables) and on.
  carries = {n: tuple(so.wrapped_state.rewrap_like(like, new) for like, new in
                      zip(runs.trajectory[1][n], restored[n]))
             for n in FRAMEWORKS}
  carries["train_state"] = runs.trajectory[1]["train_state"]
  for _ in range(STEPS - 1):
    carries = runs.step(carries)
  for name in FRAMEWORKS:
    _same(carries[name], runs.trajectory[-1][name])


# ---------------------------------------------------------------------------
# The frameworks' own wrappers.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_optimizer(jit):
  """`nnx.Optimizer(model, tx, wrt=nnx.Param)`, eager and under
  `nnx.jit`, beside `nnx.Optimizer(twin, optax.adamw)`. (The model without
  sharding metadata: nnx.Optimizer of a sharded model is docs/families.md's
  recipe, run on 8 devices by tests/test_sharded_recipes.py.)"""
  x, y = _data()
  # The matrix's nnx model without its sharding metadata (its values
  # copied into an abstract twin: no eager initializers to run).
  model = nnx.eval_shape(lambda: _Nnx(nnx.Rngs(1)))
  nnx.update(model, so.wrapped_state.unwrap_variables(_runs().params["nnx"]))
  start = jax.tree.map(lambda v: v, nnx.state(model, nnx.Param))  # a copy
  setup = Setup("nnx", start, None, None)
  twin = nnx.clone(model)
  opt = nnx.Optimizer(model, _tx(setup), wrt=nnx.Param)
  twin_opt = nnx.Optimizer(twin, TWIN, wrt=nnx.Param)

  grad = nnx.jit(nnx.grad(lambda m: _mse(m(x), y)))   # the optimizer eager

  def step(model, opt, twin, twin_opt):
    grads = grad(model)
    opt.update(model, grads)
    twin_opt.update(twin, grads)

  step = nnx.jit(step) if jit else step
  for _ in range(2):
    step(model, opt, twin, twin_opt)
  assert_trained(setup, nnx.state(model, nnx.Param),
                 nnx.state(twin, nnx.Param), start)


def test_linen_train_state(runs):
  """Linen's `TrainState.create` (tx.init) and `apply_gradients` under jit
  (in the shared step program), beside a TrainState of `optax.adamw`."""
  ours, twin = runs.trajectory[-1]["train_state"]
  assert int(ours.step) == STEPS and isinstance(ours, train_state.TrainState)
  assert_trained(runs.setups["linen"], ours.params, twin.params,
                 runs.params["linen"])


def test_nnx_state_variables_carry_the_mapped_sharding():
  """The nnx model's state (init on the sharded `nnx.State`): each leaf
  that mirrors a kernel is a Variable whose `out_sharding` names the axes
  of the frame view (mu (heads, embed, kv) of the (embed, heads, kv)
  query kernel), which the functional update hands back unchanged."""
  runs = _runs()
  for state in (runs.state0["nnx"], runs.trajectory[-1]["nnx"][1]):
    mu = state.stiefel[1].mu["attn"]["query"]["kernel"]
    assert isinstance(mu, nnx.Param)
    assert mu.get_metadata()["out_sharding"] == ("heads", "embed", "kv")
    assert mu.get_value().shape == (HEADS, D, D // HEADS)
