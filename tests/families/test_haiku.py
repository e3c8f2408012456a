"""Haiku: `hk.MultiHeadAttention` models trained by `stiefel_attention`.

The real `dm-haiku` package. `hk.MultiHeadAttention` stores
`{name}/query/w` and `{name}/key/w` of shape (d, num_heads * key_size),
head-major (`_linear_projection` reshapes to (..., num_heads, key_size)):
head h's frame is W[:, h k:(h + 1) k]. The head count is not in the shape:
the default refuses these leaves naming `haiku_mha`, which builds the
selector from the head count (one mapping per module when modules differ).

For a transformed model with two attention modules of different head
counts: `haiku_mha` selects exactly their Q/K weights; the frame views are
the plain slices; orthonormalize leaves every other leaf bit-identical; 20
steps keep the frames orthonormal (by plain slicing) and move them, while
every other leaf equals `optax.adamw` fed the same gradients. Then
`hk.layer_stack` (a leading layer axis) and the error cases.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so
from stiefel_optax import views

from tests.helpers import plain_isometry, train_beside_adamw

D, KEY_SIZE, VOCAB, T = 32, 8, 24, 6
HEADS = {"attn_0": 4, "attn_1": 2}
LR, STEPS = 1e-2, 20
ADAMW = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)


def forward(tokens):
  x = hk.Embed(VOCAB, D)(tokens)
  for name, heads in HEADS.items():
    y = hk.LayerNorm(-1, True, True)(x)
    x = x + hk.MultiHeadAttention(
        num_heads=heads, key_size=KEY_SIZE, model_size=D,
        w_init=hk.initializers.VarianceScaling(), name=name)(y, y, y)
    x = x + hk.nets.MLP([2 * D, D])(x)
  return hk.Linear(VOCAB)(x)


model = hk.without_apply_rng(hk.transform(forward))
TOKENS = jnp.arange(2 * T, dtype=jnp.int32).reshape(2, T) % VOCAB
TARGETS = (TOKENS * 7 + 3) % VOCAB
FRAMES = {**so.haiku_mha(4, "attn_0"), **so.haiku_mha(2, "attn_1")}
QK_PATHS = {f"{name}/{p}/w": so.FrameSpec(rows=-2, cols=-1, heads=h)
            for name, h in HEADS.items() for p in ("query", "key")}


def loss_fn(params):
  logits = model.apply(params, TOKENS)
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         TARGETS).mean()


def init_params(seed=0):
  return model.init(jax.random.key(seed), TOKENS)


def plain_frames(params):
  """Each head's (d, key_size) frame by plain slicing (not FrameSpec)."""
  out = []
  for name, heads in HEADS.items():
    for proj in ("query", "key"):
      w = np.asarray(params[f"{name}/{proj}"]["w"], np.float64)
      out += [w[:, h * KEY_SIZE:(h + 1) * KEY_SIZE] for h in range(heads)]
  return out


def non_frame_leaves(params):
  return {p: x for p, x, s in so.frame_specs(params, FRAMES) if s is None}


def test_haiku_mha_selects_the_qk_weights_and_the_default_refuses():
  params = init_params()
  assert so.selected_frames(params, FRAMES) == QK_PATHS
  # One head count for every module: no module name needed.
  uniform = {k: v for k, v in params.items() if not k.startswith("attn_1")}
  assert so.selected_frames(uniform, so.haiku_mha(4)) == {
      p: s for p, s in QK_PATHS.items() if p.startswith("attn_0")}
  shapes = so.map_frames(lambda w: w.shape, params, FRAMES, back=False)
  assert shapes["attn_0/query/w"] == (4, D, KEY_SIZE)
  assert shapes["attn_1/key/w"] == (2, D, KEY_SIZE)
  for call in (lambda: so.selected_frames(params),
               lambda: so.stiefel_attention(LR).init(params)):
    with pytest.raises(ValueError, match=(
        r"attn_0/(query|key)/w: shape \(32, 32\) is an attention projection"
        r" in hk.MultiHeadAttention's layout.*"
        r"frames=stiefel_optax.haiku_mha\(num_heads\)")):
      call()


def test_views_are_the_plain_head_slices_and_round_trip():
  rng = np.random.default_rng(0)
  for shape, heads in (((D, 4 * KEY_SIZE), 4), ((3, D, 2 * KEY_SIZE), 2)):
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    (spec,) = so.haiku_mha(heads).values()
    frames, rest = views.split_frames(w, spec)
    assert rest is None and frames.shape == shape[:-2] + (heads, D, KEY_SIZE)
    for h in range(heads):
      np.testing.assert_array_equal(
          frames[..., h, :, :], w[..., h * KEY_SIZE:(h + 1) * KEY_SIZE])
    np.testing.assert_array_equal(views.merge_frames(frames, rest, spec, shape), w)


def test_orthonormalize_touches_only_qk():
  params = init_params()
  assert plain_isometry(plain_frames(params)) > 0.5
  ortho = so.orthonormalize(params, FRAMES)
  assert plain_isometry(plain_frames(ortho)) <= 1e-5
  before, after = non_frame_leaves(params), non_frame_leaves(ortho)
  assert before.keys() == after.keys() and len(before) > 10
  for path in before:
    np.testing.assert_array_equal(before[path], after[path], err_msg=path)


def test_training_keeps_frames_orthonormal_and_the_rest_adamw(certificate):
  params = so.orthonormalize(init_params(1), FRAMES)
  tx = so.stiefel_attention(LR, frames=FRAMES)
  ref_tx = optax.adamw(LR, **ADAMW)

  @jax.jit
  def step(params, opt_state, ref, ref_state):
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    ref_updates, ref_state = ref_tx.update(grads, ref_state, ref)
    return (optax.apply_updates(params, updates), opt_state,
            optax.apply_updates(ref, ref_updates), ref_state)

  start = params
  params, losses, worst = train_beside_adamw(
      step, params, tx.init(params), ref_tx.init(params), STEPS,
      non_frame_leaves, loss_fn)
  certificate("haiku: deviation from adamw", worst)
  iso = certificate("haiku: isometry after 20 steps",
                    plain_isometry(plain_frames(params)))
  assert iso <= 1e-5
  assert float(so.max_isometry_error(params, FRAMES)) <= 1e-5
  moved = so.frame_movement(start, params, FRAMES)
  assert moved.keys() == QK_PATHS.keys()
  assert all(float(jnp.min(m)) > 1e-2 for m in moved.values()), moved
  assert losses[-1] < losses[0]


def test_layer_stack():
  """hk.layer_stack: (layers, d, num_heads * key_size), a batch of frames;
  one step keeps them orthonormal."""
  layers = 3

  def stacked(x):
    def layer(x):
      return x + hk.MultiHeadAttention(
          num_heads=2, key_size=KEY_SIZE, model_size=D,
          w_init=hk.initializers.VarianceScaling())(x, x, x)
    return hk.layer_stack(layers)(layer)(x)

  net = hk.without_apply_rng(hk.transform(stacked))
  x = jax.random.normal(jax.random.key(3), (T, D))
  frames = so.haiku_mha(2)
  params = so.orthonormalize(net.init(jax.random.key(4), x), frames)
  assert set(so.selected_frames(params, frames)) == {
      f"__layer_stack_no_per_layer/multi_head_attention/{p}/w"
      for p in ("query", "key")}
  tx = so.stiefel_attention(LR, frames=frames)
  state = tx.init(params)
  grads = jax.grad(lambda p: jnp.mean(net.apply(p, x) ** 2))(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  for proj in ("query", "key"):
    w = np.asarray(new[f"__layer_stack_no_per_layer/multi_head_attention/"
                       f"{proj}"]["w"], np.float64)
    assert w.shape == (layers, D, 2 * KEY_SIZE)
    assert plain_isometry([w[l, :, h * KEY_SIZE:(h + 1) * KEY_SIZE]
                           for l in range(layers) for h in range(2)]) <= 1e-5


# --------------------------------------------------------------------------
# Error cases.


def test_heads_that_do_not_divide_the_width():
  params = init_params()
  with pytest.raises(ValueError, match=(
      r"attn_0/(query|key)/w: shape \(32, 32\) has 32 columns per frame block,"
      r" not divisible into heads = 3.*model's own number of heads")):
    so.stiefel_attention(LR, frames=so.haiku_mha(3, "attn_0")).init(params)


def test_a_module_name_that_matches_nothing_names_nearby_paths():
  with pytest.raises(ValueError, match=(
      r"matches no parameter path; nearby paths:.*attn_\d/(query|key)/w")):
    so.selected_frames(init_params(), {**FRAMES, **so.haiku_mha(4, "attn_2")})
  with pytest.raises(ValueError, match=r"module='' must be the module's"):
    so.haiku_mha(4, "")


def test_overlapping_selectors_with_different_heads():
  with pytest.raises(ValueError, match=(
      r"attn_1/(query|key)/w: matched by several frames= entries")):
    so.selected_frames(init_params(), {**so.haiku_mha(4), **so.haiku_mha(2, "attn_1")})


def test_non_orthonormal_start_names_the_path_and_orthonormalize():
  with pytest.raises(ValueError, match=(
      r"attn_0/(query|key)/w: shape \(32, 32\).*not orthonormal.*"
      r"orthonormalize")):
    so.stiefel_attention(LR, frames=FRAMES).init(init_params())
