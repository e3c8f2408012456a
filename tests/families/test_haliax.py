"""Haliax (Levanter): `haliax.nn.Linear` attention trained by `stiefel_attention`.

The real `marin-haliax` package (imports as `haliax`). Levanter's attention
keeps `q_proj` and `k_proj` as `hnn.Linear`s from the model width `embed`
to (kv_head, q_heads_per_group, head_size) and (kv_head, head_size),
`out_first`: their weights are NamedArrays of axes (kv_head,
q_heads_per_group, head_size, embed), under `hnn.Stacked` with a leading
`layer` axis (Levanter's own names: `levanter/layers/attention.py`,
`AttentionConfig.KVHeads` / `QHeadsPerGroup` / `HeadSize` / `Heads`;
`levanter/models/llama.py`, `LlamaConfig.Layers`; Levanter itself needs
Python >= 3.12, so the modules are built here from haliax with its names),
and their tree paths end in `/weight/0` (`path_str` drops the `/0`). A
plain-Haliax MHA layout, (heads, head_size), is tested too. The default selector finds them by module type (an `hnn.Linear`
named q_proj / k_proj) and axis names (rows its `In`, columns `head_size`,
every other axis a batch of frames), with no mapping.

For a GQA model (blocks in a list), a plain MHA model and a GQA model under
`hnn.Stacked` (`fold`, a scan): the default and `frames="haliax"` select
exactly the Q/K weights; orthonormalize returns the model, every other leaf
bit-identical; 8 steps of Haliax's own loop (`eqx.filter_value_and_grad`,
`eqx.apply_updates`) keep each head's (embed, head_size) frame orthonormal,
read by Haliax's own `rearrange`, and move it, while every other leaf equals
`optax.adamw` fed the same gradients. Then the error cases.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so

from tests.helpers import plain_isometry, train_beside_adamw

Embed, Vocab, Pos = hax.Axis("embed", 16), hax.Axis("vocab", 13), hax.Axis(
    "position", 6)
KPos = Pos.alias("key_position")
HeadSize, Mlp, Layers, Batch = (hax.Axis("head_size", 4), hax.Axis("mlp", 32),
                                hax.Axis("layer", 2), hax.Axis("batch", 2))
LR, STEPS = 1e-2, 8
ADAMW = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)

# (query head axes, key/value head axes): Levanter's GQA, and plain MHA.
GQA = ((hax.Axis("kv_head", 2), hax.Axis("q_heads_per_group", 2)),
       (hax.Axis("kv_head", 2),))
MHA = ((hax.Axis("heads", 4),), (hax.Axis("heads", 4),))


class Attention(eqx.Module):
  """Levanter's attention projections: q/k/v/o_proj, `out_first`."""
  q_proj: hnn.Linear
  k_proj: hnn.Linear
  v_proj: hnn.Linear
  o_proj: hnn.Linear

  @staticmethod
  def init(heads, *, key):
    q_heads, kv_heads = heads
    k = jax.random.split(key, 4)
    lin = lambda i, o, key: hnn.Linear.init(In=i, Out=o, key=key,
                                            use_bias=False, out_first=True)
    return Attention(lin(Embed, (*q_heads, HeadSize), k[0]),
                     lin(Embed, (*kv_heads, HeadSize), k[1]),
                     lin(Embed, (*kv_heads, HeadSize), k[2]),
                     lin((*q_heads, HeadSize), Embed, k[3]))

  def __call__(self, x):
    q = self.q_proj(x)
    k = self.k_proj(x).rename({"position": "key_position"})
    v = self.v_proj(x).rename({"position": "key_position"})
    mask = hax.nn.attention.causal_mask(Pos, KPos)
    y = hnn.attention.dot_product_attention(KPos, HeadSize, q, k, v, mask=mask)
    return self.o_proj(y)


class Block(eqx.Module):
  norm: hnn.LayerNorm
  self_attn: Attention
  mlp_in: hnn.Linear
  mlp_out: hnn.Linear

  @staticmethod
  def init(heads, *, key):
    k = jax.random.split(key, 3)
    return Block(hnn.LayerNorm.init(Embed), Attention.init(heads, key=k[0]),
                 hnn.Linear.init(Embed, Mlp, key=k[1]),
                 hnn.Linear.init(Mlp, Embed, key=k[2]))

  def __call__(self, x):
    x = x + self.self_attn(self.norm(x))
    return x + self.mlp_out(hnn.gelu(self.mlp_in(x)))


class Model(eqx.Module):
  embed: hnn.Embedding
  layers: object                   # hnn.Stacked, or a list of Blocks
  lm_head: hnn.Linear

  @staticmethod
  def init(heads, stacked, *, key):
    k = jax.random.split(key, 3)
    keys = jax.random.split(k[1], Layers.size)
    layers = (hnn.Stacked.init(Layers, Block)(heads, key=keys) if stacked
              else [Block.init(heads, key=kk) for kk in keys])
    return Model(hnn.Embedding.init(Vocab, Embed, key=k[0]), layers,
                 hnn.Linear.init(Embed, Vocab, key=k[2]))

  def __call__(self, tokens):
    x = self.embed(tokens)
    if isinstance(self.layers, hnn.Stacked):
      x = self.layers.fold(x)
    else:
      for block in self.layers:
        x = block(x)
    return self.lm_head(x)


TOKENS = hax.named(jnp.arange(Batch.size * Pos.size).reshape(2, 6) % 13,
                   (Batch, Pos))
TARGETS = (TOKENS * 7 + 3) % Vocab.size


def loss_fn(model):
  logits = model(TOKENS).array                   # (batch, position, vocab)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, TARGETS.array).mean()


def params_of(model):
  return eqx.filter(model, eqx.is_inexact_array)


def qk_weights(model):
  """{path: NamedArray} of the q_proj / k_proj weights, by attribute."""
  prefix = "layers/stacked" if isinstance(model.layers, hnn.Stacked) else None
  blocks = ([(prefix, model.layers.stacked)] if prefix else
            [(f"layers/{i}", b) for i, b in enumerate(model.layers)])
  return {f"{p}/self_attn/{n}/weight": getattr(b.self_attn, n).weight
          for p, b in blocks for n in ("q_proj", "k_proj")}


def plain_frames(model):
  """Each head's (embed, head_size) frame, cut out by Haliax's own
  `rearrange` (independent of FrameSpec)."""
  out = []
  for w in qk_weights(model).values():
    a = np.asarray(hax.rearrange(w, (..., "embed", "head_size")).array,
                   np.float64)
    out += list(a.reshape(-1, Embed.size, HeadSize.size))
  return out


def non_frame_leaves(model):
  return {p: x for p, x, s in so.frame_specs(params_of(model)) if s is None}


CASES = {"gqa": (GQA, False), "mha": (MHA, False), "gqa_stacked": (GQA, True)}


@pytest.mark.parametrize("case", CASES)
def test_default_and_preset_select_the_qk_weights_by_axis_names(case):
  heads, stacked = CASES[case]
  model = Model.init(heads, stacked, key=jax.random.key(0))
  expected = {}
  for path, w in qk_weights(model).items():
    names = tuple(a.name for a in w.axes)
    expected[path] = so.FrameSpec(rows=names.index("embed"),
                                  cols=names.index("head_size"))
  for tree in (model, params_of(model)):
    assert so.selected_frames(tree) == expected
    assert so.selected_frames(tree, "haliax") == expected
    assert so.selected_frames(tree, {r"(q|k)_proj/weight$": so.FrameSpec(
        rows="embed", cols="head_size")}) == expected      # one named spec
  n_heads = 4 * (Layers.size if stacked else 1)
  shapes = so.map_frames(lambda w: w.shape, model, back=False)
  q_path = next(p for p in expected if "q_proj" in p)
  assert shapes[q_path][-2:] == (Embed.size, HeadSize.size)
  assert np.prod(shapes[q_path][:-2]) == n_heads


def test_levanter_gqa_layout_and_paths():
  """Levanter's q_proj weight is (kv_head, q_heads_per_group, head_size,
  embed); stacked, (layer, ...); the path has no trailing /0."""
  model = Model.init(GQA, True, key=jax.random.key(0))
  w = model.layers.stacked.self_attn.q_proj.weight
  assert tuple(a.name for a in w.axes) == (
      "layer", "kv_head", "q_heads_per_group", "head_size", "embed")
  (path, _), = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(model)
                if x is w.array]
  assert isinstance(path[-1], jax.tree_util.FlattenedIndexKey)
  assert so.path_str(path) == "layers/stacked/self_attn/q_proj/weight"
  assert so.selected_frames(model)[so.path_str(path)] == so.FrameSpec(
      rows=4, cols=3)


@pytest.mark.parametrize("case", CASES)
def test_training_keeps_frames_orthonormal_and_the_rest_adamw(case,
                                                              certificate):
  heads, stacked = CASES[case]
  model = Model.init(heads, stacked, key=jax.random.key(1))
  assert plain_isometry(plain_frames(model)) > 0.5
  ortho = so.orthonormalize(model)               # the default finds them
  assert type(ortho) is Model and type(ortho.layers) is type(model.layers)
  assert plain_isometry(plain_frames(ortho)) <= 1e-5
  before, after = non_frame_leaves(model), non_frame_leaves(ortho)
  assert before.keys() == after.keys() and len(before) > 8
  for path in before:
    np.testing.assert_array_equal(before[path], after[path], err_msg=path)
  model = ortho

  tx = so.stiefel_attention(LR)
  ref_tx = optax.adamw(LR, **ADAMW)
  opt_state, ref_state = tx.init(params_of(model)), ref_tx.init(
      params_of(model))

  @eqx.filter_jit
  def step(model, opt_state, ref, ref_state):
    _, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, params_of(model))
    ref_updates, ref_state = ref_tx.update(grads, ref_state, params_of(ref))
    return (eqx.apply_updates(model, updates), opt_state,
            eqx.apply_updates(ref, ref_updates), ref_state)

  start = model
  model, losses, worst = train_beside_adamw(
      step, model, opt_state, ref_state, STEPS, non_frame_leaves, loss_fn)
  certificate(f"haliax {case}: deviation from adamw", worst)
  iso = certificate(f"haliax {case}: isometry after {STEPS} steps",
                    plain_isometry(plain_frames(model)))
  assert iso <= 1e-5
  so.check_frames(model)
  moved = so.frame_movement(start, model)
  assert moved.keys() == qk_weights(model).keys()
  assert all(float(jnp.min(m)) > 1e-3 for m in moved.values()), moved
  assert losses[-1] < losses[0]


# --------------------------------------------------------------------------
# Error cases.


def test_q_proj_without_a_head_size_axis_names_the_fix():
  flat = hax.Axis("q_out", 16)
  attn = Attention.init(MHA, key=jax.random.key(0))
  attn = eqx.tree_at(lambda a: a.q_proj, attn, hnn.Linear.init(
      Embed, flat, key=jax.random.key(1), use_bias=False))
  with pytest.raises(ValueError, match=(
      r"q_proj/weight: a haliax.nn.Linear named q_proj .* from \('embed',\)"
      r" to \('q_out',\), with no 'head_size' output axis.*FrameSpec\(rows="
      r"'embed', cols=<the head dimension's axis name>\)")):
    so.selected_frames(attn)


def test_named_specs_need_named_arrays():
  model = Model.init(MHA, False, key=jax.random.key(0))
  arrays = {so.path_str(p): x for p, x in
            jax.tree_util.tree_leaves_with_path(params_of(model))}
  with pytest.raises(ValueError, match=(
      r"frames='haliax': params holds no haliax.nn.Linear named q_proj or"
      r" k_proj \(leaves: .*pass the model")):
    so.selected_frames(arrays, "haliax")
  with pytest.raises(ValueError, match=(
      r"layers/0/self_attn/q_proj/weight: shape \(4, 4, 16\) is selected by"
      r" FrameSpec\(rows='embed', cols='head_size'\), which names its axes,"
      r" but the leaf carries no axis names")):
    so.selected_frames(arrays, {r"q_proj/weight$": so.FrameSpec(
        rows="embed", cols="head_size")})
  with pytest.raises(ValueError, match=(
      r"q_proj/weight \(shape \(4, 4, 16\)\): FrameSpec\(rows='embd',"
      r" cols='head_size'\) names axis 'embd', but the leaf's axes are"
      r" \('heads', 'head_size', 'embed'\) \(no such name\)")):
    so.selected_frames(model, {r"q_proj/weight$": so.FrameSpec(
        rows="embd", cols="head_size")})


# --------------------------------------------------------------------------
# Axis names: docs/families.md and sharding maps use Levanter's own names.

# Levanter's axis names (levanter/layers/attention.py, AttentionConfig:
# KVHeads "kv_head", QHeadsPerGroup "q_heads_per_group", HeadSize
# "head_size", Heads "heads"; levanter/models/llama.py, LlamaConfig: Embed
# "embed", Layers "layer", Mlp "mlp"; Pos "position", KeyPos "key_position").
LEVANTER_AXES = {"embed", "kv_head", "q_heads_per_group", "head_size", "heads",
                 "layer", "mlp", "position", "key_position", "batch", "vocab"}


def _haliax_doc_blocks():
  import re
  from tests.helpers import ROOT
  text = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
  blocks = re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.S | re.M)
  return [b for b in blocks if "import haliax" in b]


def test_family_docs_use_levanters_axis_names():
  """Every haliax axis and every sharding-map key in the docs is one of
  Levanter's own names: a map written with other names ("layers",
  "kv_heads") shards nothing on Levanter's real Llama."""
  import re
  blocks = _haliax_doc_blocks()
  assert len(blocks) == 2                         # training, and sharded
  for block in blocks:
    names = set(re.findall(r'hax\.Axis\("(\w+)"', block))
    for call in re.findall(r"flatten_axes\((.*)\)", block):
      names |= set(re.findall(r'"(\w+)"', call))
    assert {"embed", "head_size"} <= names, names
    assert names <= LEVANTER_AXES, names - LEVANTER_AXES
  (mapping,) = re.findall(r"check_axis_mapping\(\s*arrays, (\{[^}]*\})",
                          blocks[1])
  keys = set(re.findall(r'"(\w+)":', mapping))
  assert keys == {"kv_head", "heads"}, keys


def test_an_axis_mapping_with_other_names_raises_instead_of_sharding_nothing():
  model = Model.init(GQA, True, key=jax.random.key(0))
  arrays = eqx.filter(model, eqx.is_inexact_array)
  mesh = jax.make_mesh((1,), ("model",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  q_spec = lambda sh: tuple(sh.layers.stacked.self_attn.q_proj.weight.spec)
  # Haliax shards by the names it finds and ignores the others: silently.
  wrong = {"kv_heads": "model", "layers": None}
  sh = hax.partitioning.infer_resource_partitions(arrays, wrong, mesh=mesh)
  assert all(e is None for e in q_spec(sh))
  with pytest.raises(ValueError, match=(
      r"axis mapping \{'kv_heads': 'model', 'layers': None\}: 'kv_heads'"
      r" names no axis \(closest: 'kv_head'.*\)\. The tree's axes are \[.*"
      r"'kv_head'.*'layer'.*\]")):
    so.check_axis_mapping(arrays, wrong)
  with pytest.raises(ValueError, match=r"'layers' names no axis \(closest:"
                     r" 'layer'"):
    so.check_axis_mapping(arrays, [("layers", "data")])
  # Levanter's names: checked, and the q/k weights split over kv_head.
  right = so.check_axis_mapping(arrays, {"kv_head": "model"})
  sh = hax.partitioning.infer_resource_partitions(arrays, right, mesh=mesh)
  assert q_spec(sh)[1] == "model"                 # (layer, kv_head, ...)
  with pytest.raises(ValueError, match=r"carries no axis names"):
    so.check_axis_mapping({"w": jnp.zeros((2, 2))}, right)


# --------------------------------------------------------------------------
# The optimizer state under Haliax's name-based sharding (Levanter's Trainer).


def _named_arrays(tree):
  is_named = lambda x: isinstance(x, hax.NamedArray)
  return {jax.tree_util.keystr(p): x for p, x in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named)[0]
          if is_named(x) and hasattr(x.array, "shape")}


@pytest.mark.parametrize("stiefel", ["adam", "muon"])
def test_state_is_named_by_the_frame_view_and_shards_by_name(stiefel):
  """Levanter shards the optimizer state by axis names (Haliax's
  `infer_resource_partitions` under `named_jit`). The Stiefel group's state
  is in the frame view: its NamedArrays name the view's axes (the first
  moment (layer, kv_head, q_heads_per_group, embed, head_size), the
  per-frame second moment (layer, kv_head, q_heads_per_group)), never the
  kernel's five names around a rank-3 array, so the jitted init and step
  shard it as the weights' axes of those names are."""
  model = so.orthonormalize(Model.init(GQA, True, key=jax.random.key(0)))
  params = params_of(model)
  frames_tx = (so.stiefel_adam(LR) if stiefel == "adam" else
               so.stiefel_muon(LR))
  tx = so.frame_partition(frames_tx, optax.adamw(LR, **ADAMW))
  state = tx.init(params)
  named = _named_arrays(state)
  for path, x in named.items():
    assert len(x.axis_names) == x.array.ndim, (path, x.axis_names,
                                               x.array.shape)
  q = ".layers.stacked.self_attn.q_proj.weight"
  view = ("layer", "kv_head", "q_heads_per_group", "embed", "head_size")
  mu = next(x for p, x in named.items() if p.startswith(".stiefel")
            and p.endswith(q) and x.array.ndim == 5)
  assert mu.axis_names == view and mu.array.shape == (2, 2, 2, 16, 4)
  if stiefel == "adam":
    nu = named[".stiefel[1].nu" + q]
    assert nu.axis_names == view[:3] and nu.array.shape == (2, 2, 2)
  # The AdamW group's state keeps the kernels' own names.
  assert named[".euclidean[0].mu.lm_head.weight"].axis_names == tuple(
      params.lm_head.weight.axis_names)

  mesh = jax.make_mesh((1, 1), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  mapping = {"embed": "data", "kv_head": "model"}

  def step(params, state):
    grads = eqx.filter_grad(lambda p: loss_fn(eqx.combine(p, model)))(params)
    updates, state = tx.update(grads, state, params)
    return eqx.apply_updates(params, updates), state

  with jax.set_mesh(mesh), hax.axis_mapping(mapping):
    state = hax.named_jit(tx.init, axis_resources=mapping)(params)
    params, state = hax.named_jit(step, axis_resources=mapping)(params, state)
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
  after = _named_arrays(state)
  spec = lambda path: tuple(after[path].array.sharding.spec)
  mu_path = next(p for p, x in named.items() if x is mu)
  assert spec(mu_path)[:5] == (None, "model", None, "data", None)
  if stiefel == "adam":
    assert spec(".stiefel[1].nu" + q)[:3] == (None, "model", None)
  assert so.max_isometry_error(params) <= 1e-5
