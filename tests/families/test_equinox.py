"""Equinox: `eqx.nn.MultiheadAttention` models trained by `stiefel_attention`.

The real `equinox` package. Its `query_proj`/`key_proj` are `eqx.nn.Linear`
with weights in (out, in) layout, (num_heads * qk_size, query_size),
head-major (`MultiheadAttention._project` reshapes the projection to
(seq, num_heads, qk_size)): head h's frame is W[h k:(h + 1) k, :]^T. The
head count is read from each module, so two blocks with different head
counts in one list of blocks get different specs.

For a model with a list of blocks: the preset (and the default) selects
exactly the Q/K weights; the frame views are the plain slices; orthonormalize
returns the Module and leaves every other leaf bit-identical; 20 steps of
`eqx.filter_grad` / `eqx.apply_updates` keep the frames orthonormal (by plain
slicing) and move them, while every other leaf equals `optax.adamw` fed the
same gradients. Then blocks stacked by `eqx.filter_vmap` (a leading layer
axis), and the error cases, each a ValueError naming the path, the shape and
the fix.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from stiefel_optax import views

from tests.helpers import plain_isometry, train_beside_adamw

D, QK, VOCAB, T = 32, 8, 24, 6
HEADS = (4, 2)                    # per block: query/key weights (32|16, 32)
LR, STEPS = 1e-2, 20
ADAMW = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)


class Block(eqx.Module):
  norm: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  mlp: eqx.nn.MLP

  def __init__(self, num_heads, key):
    k1, k2 = jax.random.split(key)
    self.norm = eqx.nn.LayerNorm(D)
    self.attn = eqx.nn.MultiheadAttention(num_heads, D, qk_size=QK, key=k1)
    self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, key=k2)

  def __call__(self, x):
    y = jax.vmap(self.norm)(x)
    x = x + self.attn(y, y, y)
    return x + jax.vmap(self.mlp)(x)


class Model(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, len(HEADS) + 2)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
    self.blocks = [Block(h, k) for h, k in zip(HEADS, keys[1:-1])]
    self.head = eqx.nn.Linear(D, VOCAB, key=keys[-1])

  def __call__(self, tokens):
    x = jax.vmap(self.embed)(tokens)
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(x)


TOKENS = jnp.arange(2 * T, dtype=jnp.int32).reshape(2, T) % VOCAB
TARGETS = (TOKENS * 7 + 3) % VOCAB


def loss_fn(model):
  logits = jax.vmap(model)(TOKENS)
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         TARGETS).mean()


QK_PATHS = {f"blocks/{i}/attn/{p}_proj/weight": so.FrameSpec(
    rows=-1, cols=-2, heads=h) for i, h in enumerate(HEADS)
            for p in ("query", "key")}


def params_of(model):
  return eqx.filter(model, eqx.is_inexact_array)


def plain_frames(model):
  """Each head's (query_size, qk_size) frame by plain slicing, as
  MultiheadAttention uses the weight (independent of FrameSpec)."""
  out = []
  for block in model.blocks:
    for proj in (block.attn.query_proj, block.attn.key_proj):
      w = np.asarray(proj.weight, np.float64)
      out += [w[h * QK:(h + 1) * QK].T for h in range(block.attn.num_heads)]
  return out


def non_frame_leaves(model):
  return {p: x for p, x, s in so.frame_specs(params_of(model), "equinox")
          if s is None}


def test_preset_and_default_select_the_qk_weights_with_each_modules_heads():
  model = Model(jax.random.key(0))
  for tree in (params_of(model), model):        # filtered, or the model
    assert so.selected_frames(tree, "equinox") == QK_PATHS
    assert so.selected_frames(tree) == QK_PATHS
  shapes = so.map_frames(lambda w: w.shape, params_of(model), "equinox",
                         back=False)
  assert shapes["blocks/0/attn/query_proj/weight"] == (4, D, QK)
  assert shapes["blocks/1/attn/key_proj/weight"] == (2, D, QK)


def test_views_are_the_plain_head_slices_and_round_trip():
  rng = np.random.default_rng(0)
  for shape, heads in (((4 * QK, D), 4), ((3, 2 * QK, D), 2)):
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    spec = so.FrameSpec(rows=-1, cols=-2, heads=heads)
    frames, rest = views.split_frames(w, spec)
    assert rest is None and frames.shape == shape[:-2] + (heads, D, QK)
    for h in range(heads):
      np.testing.assert_array_equal(
          frames[..., h, :, :], jnp.swapaxes(w[..., h * QK:(h + 1) * QK, :],
                                             -1, -2))
    np.testing.assert_array_equal(views.merge_frames(frames, rest, spec, shape), w)
    np.testing.assert_array_equal(views.from_frames(frames, spec, shape), w)


def test_orthonormalize_returns_the_module_and_touches_only_qk():
  model = Model(jax.random.key(0))
  assert plain_isometry(plain_frames(model)) > 0.5
  ortho = so.orthonormalize(model, "equinox")
  assert type(ortho) is Model and type(ortho.blocks) is list
  assert all(type(b) is Block for b in ortho.blocks)
  assert ortho.blocks[1].attn.num_heads == 2
  assert plain_isometry(plain_frames(ortho)) <= 1e-5
  before, after = non_frame_leaves(model), non_frame_leaves(ortho)
  assert before.keys() == after.keys() and len(before) > 10
  for path in before:
    np.testing.assert_array_equal(before[path], after[path], err_msg=path)
  # Non-array fields (the MLP's activation, dropout's p) are kept.
  assert ortho.blocks[0].mlp.activation is model.blocks[0].mlp.activation
  assert so.orthonormalize(params_of(model)).blocks[0].attn.num_heads == 4


def test_training_keeps_frames_orthonormal_and_the_rest_adamw(certificate):
  model = so.orthonormalize(Model(jax.random.key(1)))
  tx = so.stiefel_attention(LR)                  # the default finds them
  ref_tx = optax.adamw(LR, **ADAMW)
  opt_state = tx.init(params_of(model))
  ref = model
  ref_state = ref_tx.init(params_of(ref))

  @eqx.filter_jit
  def step(model, opt_state, ref, ref_state):
    grads = eqx.filter_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, params_of(model))
    ref_updates, ref_state = ref_tx.update(grads, ref_state, params_of(ref))
    return (eqx.apply_updates(model, updates), opt_state,
            eqx.apply_updates(ref, ref_updates), ref_state)

  start = model
  model, losses, worst = train_beside_adamw(
      step, model, opt_state, ref_state, STEPS, non_frame_leaves, loss_fn)
  certificate("equinox: deviation from adamw", worst)
  iso = certificate("equinox: isometry after 20 steps",
                    plain_isometry(plain_frames(model)))
  assert iso <= 1e-5
  assert float(so.max_isometry_error(model)) <= 1e-5
  moved = so.frame_movement(start, model)
  assert moved.keys() == QK_PATHS.keys()
  assert all(float(jnp.min(m)) > 1e-2 for m in moved.values()), moved
  assert losses[-1] < losses[0]
  assert type(model) is Model and model.blocks[1].attn.num_heads == 2


def test_blocks_stacked_by_filter_vmap():
  """A leading layer axis (eqx.filter_vmap over the block constructor, run
  by jax.lax.scan): a batch of frames; one step keeps them orthonormal."""
  layers = 3
  make = lambda k: eqx.nn.MultiheadAttention(2, D, qk_size=QK, key=k)
  stack = eqx.filter_vmap(make)(jax.random.split(jax.random.key(2), layers))
  assert stack.query_proj.weight.shape == (layers, 2 * QK, D)
  assert so.selected_frames(stack) == {
      p: so.FrameSpec(rows=-1, cols=-2, heads=2)
      for p in ("query_proj/weight", "key_proj/weight")}
  stack = so.orthonormalize(stack)
  params, static = eqx.partition(stack, eqx.is_inexact_array)
  x = jax.random.normal(jax.random.key(3), (T, D))

  def loss(params):
    def body(x, layer):
      attn = eqx.combine(layer, static)
      return x + attn(x, x, x), None
    return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

  tx = so.stiefel_attention(LR, frames="equinox")
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(jax.grad(loss)(params), state, params)
  new = eqx.apply_updates(params, updates)
  for name in ("query_proj", "key_proj"):
    w = np.asarray(getattr(new, name).weight, np.float64)
    assert plain_isometry([w[l, h * QK:(h + 1) * QK].T for l in range(layers)
                           for h in range(2)]) <= 1e-5
  assert float(jnp.min(so.frame_movement(params, new)["query_proj/weight"])
               ) > 1e-3


# --------------------------------------------------------------------------
# Error cases.


def test_equinox_preset_on_a_tree_without_multihead_attention():
  model = Model(jax.random.key(0))
  as_dict = {so.path_str(p): x for p, x in
             jax.tree_util.tree_leaves_with_path(params_of(model))}
  with pytest.raises(ValueError, match=(
      r"frames='equinox': params holds no eqx.nn.MultiheadAttention \(leaves:"
      r".*blocks/0/attn/query_proj/weight \(32, 32\).*pass the Module tree"
      r" itself, eqx.filter\(model, eqx.is_inexact_array\)")):
    so.stiefel_attention(LR, frames="equinox").init(as_dict)
  with pytest.raises(ValueError, match=r"holds no eqx.nn.MultiheadAttention"):
    so.selected_frames(model.blocks[0].mlp, "equinox")


def test_weight_whose_rows_do_not_split_into_the_modules_heads():
  model = Model(jax.random.key(0))
  bad = eqx.tree_at(lambda m: m.blocks[1].attn.key_proj.weight, model,
                    jnp.ones((15, D)))
  with pytest.raises(ValueError, match=(
      r"blocks/1/attn/key_proj/weight: shape \(15, 32\) is the weight of an"
      r" eqx.nn.MultiheadAttention with num_heads = 2.*FrameSpec\(rows=-1,"
      r" cols=-2, heads=H\)")):
    so.selected_frames(bad, "equinox")
  with pytest.raises(ValueError, match=r"key_proj/weight: shape \(15, 32\)"):
    so.stiefel_attention(LR).init(params_of(bad))


def test_qk_size_above_query_size_is_refused_with_the_shape():
  mha = eqx.nn.MultiheadAttention(2, 4, qk_size=8, key=jax.random.key(0))
  with pytest.raises(ValueError, match=(
      r"query_proj/weight: shape \(16, 4\) gives frames of \(d, r\) = \(4, 8\)"
      r".*r > d")):
    so.selected_frames(mha, "equinox")


def test_non_orthonormal_start_names_the_path_and_orthonormalize():
  model = Model(jax.random.key(0))
  with pytest.raises(ValueError, match=(
      r"blocks/0/attn/(query|key)_proj/weight: shape \(32, 32\).*not"
      r" orthonormal.*orthonormalize")):
    so.stiefel_attention(LR).init(params_of(model))


def test_the_library_does_not_import_equinox(library_imports):
  for when in ("import", "select"):   # nor when it selects frames
    assert not {"equinox", "haiku"} & set(library_imports[when]), when
