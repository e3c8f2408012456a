"""penzai: llama-like `pz.nn` transformers trained by `stiefel_attention`.

The real `penzai` package. Its attention's query and key `pz.nn.Linear`s
hold Parameters labelled '{block}/attention/query.weights' and
'.../key.weights', named arrays of axes `embedding`, the heads (`heads`;
GQA `head_groups`, `query_heads`) and `projection`; a `LayerStack` adds
its stack axis. penzai's `StatefulTrainer` hands the optimizer a tuple of
ParameterValues, whose tree paths carry no names ('3/value/data_array'):
the default selector finds the frames by the values' labels and axis names
(rows `embedding`, columns `projection`, every other axis a batch), with no
mapping.

For a GQA model, a `LayerStack`ed GQA model and a plain MHA model: the
default and `frames="penzai"` select exactly the Q/K weights; orthonormalize
leaves every other value bit-identical; 6 steps of penzai's own
`StatefulTrainer` keep each head's (embedding, projection) frame orthonormal,
read by penzai's own `unwrap`, and move it, while every other parameter
equals a `StatefulTrainer` with `optax.adamw` on the same start. Then the
error cases.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai import pz
from penzai.models.transformer.variants import llamalike_common
from penzai.toolshed import basic_training

import stiefel_optax as so

from tests.helpers import plain_isometry, train_beside_adamw

D, P, VOCAB, T = 16, 4, 11, 6
LR, STEPS = 1e-2, 6
ADAMW = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
# (num_kv_heads, query_head_multiplier, use_layer_stack)
CASES = {"gqa": (2, 2, False), "gqa_stacked": (2, 2, True),
         "mha": (4, 1, False)}
QK_LABEL = re.compile(r"/(query|key)\.weights$")


def build(case, seed=0):
  kv, mult, stack = CASES[case]
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv, query_head_multiplier=mult, embedding_dim=D,
      projection_dim=P, mlp_hidden_dim=2 * D, num_decoder_blocks=2,
      vocab_size=VOCAB, mlp_variant="swiglu", tie_embedder_and_logits=False,
      use_layer_stack=stack)
  return llamalike_common.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(seed))


def values(model):
  """The ParameterValues, as StatefulTrainer hands them to the optimizer."""
  return pz.freeze_params(pz.unbind_params(model)[1])


def assign(model, new_values):
  for param, value in zip(pz.unbind_params(model)[1], new_values):
    param.value = value.value


TOKENS = pz.nx.wrap(jnp.arange(2 * T).reshape(2, T) % VOCAB).tag("batch", "seq")
TARGETS = (TOKENS * 7 + 3) % VOCAB


def lm_loss(model):
  logits = model(TOKENS)
  losses = pz.nx.nmap(optax.softmax_cross_entropy_with_integer_labels)(
      logits.untag("vocabulary"), TARGETS)
  return losses.unwrap("batch", "seq").mean()


def trainer_loss(*, model, state, rng, **kwargs):
  del rng, kwargs
  return lm_loss(model), state, None


def qk_paths(params):
  """The paths of the query/key values' arrays, from their labels."""
  return [f"{i}/value/data_array" for i, v in enumerate(params)
          if QK_LABEL.search(v.label)]


def plain_frames(params):
  """Each head's (embedding, projection) frame, by penzai's own `unwrap`
  (independent of FrameSpec)."""
  out = []
  for v in params:
    if QK_LABEL.search(v.label):
      names = [n for n in v.value.named_shape
               if n not in ("embedding", "projection")]
      a = np.asarray(v.value.unwrap(*names, "embedding", "projection"),
                     np.float64)
      out += list(a.reshape(-1, D, P))
  return out


def non_frame_leaves(params):
  return {p: x for p, x, s in so.frame_specs(params) if s is None}


@pytest.mark.parametrize("case", CASES)
def test_default_and_preset_select_the_qk_weights_by_label_and_names(case):
  params = values(build(case))
  expected = qk_paths(params)
  assert len(expected) == (2 if CASES[case][2] else 4)
  assert sorted(so.selected_frames(params)) == sorted(expected)
  assert so.selected_frames(params, "penzai") == so.selected_frames(params)
  heads = CASES[case][0] * CASES[case][1]
  n_frames = {"key": CASES[case][0], "query": heads}
  for path, shape in so.map_frames(lambda w: w.shape, params,
                                   back=False).items():
    label = params[int(path.split("/")[0])].label
    kind = "query" if label.endswith("query.weights") else "key"
    layers = 2 if CASES[case][2] else 1
    assert shape[-2:] == (D, P)
    assert np.prod(shape[:-2]) == n_frames[kind] * layers, (label, shape)


@pytest.mark.parametrize("case", CASES)
def test_stateful_trainer_keeps_frames_orthonormal_and_the_rest_adamw(
    case, certificate):
  model, ref_model = build(case, 1), build(case, 1)
  start = values(model)
  assert plain_isometry(plain_frames(start)) > 0.5
  ortho = so.orthonormalize(start)               # the default finds them
  assert plain_isometry(plain_frames(ortho)) <= 1e-5
  before, after = non_frame_leaves(start), non_frame_leaves(ortho)
  assert before.keys() == after.keys() and len(before) > 8
  for path in before:
    np.testing.assert_array_equal(before[path], after[path], err_msg=path)
  assign(model, ortho)
  assign(ref_model, ortho)

  trainer = basic_training.StatefulTrainer.build(
      root_rng=jax.random.key(2), model=model,
      optimizer_def=so.stiefel_attention(LR), loss_fn=trainer_loss)
  ref = basic_training.StatefulTrainer.build(
      root_rng=jax.random.key(2), model=ref_model,
      optimizer_def=optax.adamw(LR, **ADAMW), loss_fn=trainer_loss)

  def step(trainer, _, ref, __):
    trainer.step()
    ref.step()
    return trainer, None, ref, None

  trainer, losses, worst = train_beside_adamw(
      step, trainer, None, None, STEPS,
      lambda t: non_frame_leaves(values(t.model)),
      lambda t: lm_loss(t.model))
  certificate(f"penzai {case}: deviation from adamw", worst)
  params = values(trainer.model)
  iso = certificate(f"penzai {case}: isometry after {STEPS} steps",
                    plain_isometry(plain_frames(params)))
  assert iso <= 1e-5
  so.check_frames(params)
  moved = so.frame_movement(ortho, params)
  assert sorted(moved) == sorted(qk_paths(params))
  assert all(float(jnp.min(m)) > 1e-3 for m in moved.values()), moved
  assert losses[-1] < losses[0]


# --------------------------------------------------------------------------
# Error cases.


def test_a_parameter_where_an_array_was_expected_says_what_it_is():
  model = build("mha")
  with pytest.raises(ValueError, match=(
      r"a penzai Parameter \(label 'transformer/embedder.embeddings'\), a"
      r" mutable variable, not an array.*pz.freeze_params\(params\)")):
    so.stiefel_attention(LR).init(model)
  _, params = pz.unbind_params(model)
  with pytest.raises(ValueError, match=(
      r"^0: a penzai.core.variables.Parameter \(label"
      r" 'transformer/embedder.embeddings'\), not an array, is selected as"
      r" frames by FrameSpec\(rows=0, cols=1\).*ParameterValues of"
      r" pz.freeze_params")):
    so.selected_frames(params, {"^0$": so.FrameSpec(rows=0, cols=1)})


def test_a_query_weight_without_projection_axis_names_the_fix():
  params = list(values(build("mha")))
  i = next(i for i, v in enumerate(params) if QK_LABEL.search(v.label))
  params[i] = pz.ParameterValue(
      label=params[i].label,
      value=params[i].value.untag("heads").tag("heads_x"))
  params[i] = pz.ParameterValue(
      label=params[i].label,
      value=params[i].value.untag("projection").tag("head_dim"))
  with pytest.raises(ValueError, match=(
      rf"{i}/value/data_array: penzai Parameter '[^']*/query.weights' \(an"
      r" attention projection\) has axes \('embedding', 'heads_x',"
      r" 'head_dim'\), not 'embedding' and 'projection'")):
    so.selected_frames(tuple(params))
  with pytest.raises(ValueError, match=(
      r"frames='penzai': params holds no penzai query/key weight")):
    so.selected_frames({"w": jnp.zeros((4, 2))}, "penzai")
