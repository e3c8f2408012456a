"""Frame selection (stiefel_optax/specs.py, families.py, named_axes.py,
selector.py): presets, the default (auto), regex mappings, callables and
FrameSpecs on the Flax block's kernels (`helpers.LinenBlock`, the
`linen_params` fixture) and on hand-built ones: scanned layers, einsum
(heads, d, head_dim) kernels, 2-D kernels split into heads with grouped
query/key, whole-projection frames. Every selection
error names the path, the shape and the fix.

The selection of the model families' real layouts is in tests/families/,
the frame views of a spec in tests/test_views.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stiefel_optax as so

from tests.helpers import (
    D, HEADS, HEAD_DIM, frame_adam_states, leaves_by_path)

LR = 1e-2
ISO_TOL = 1e-5


def _random_tree(shapes, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, shapes.items())}


def _one_step_and_state(tx, params, seed=1):
  """One eager update from tx.init: (new params, state). Eager, because
  the small per-op programs are cached across tests and tiny trees."""
  state = tx.init(params)
  grads = jax.tree.map(
      lambda w: jax.random.normal(jax.random.key(seed), w.shape), params)
  upd, state = tx.update(grads, state, params)
  return optax.apply_updates(params, upd), state


def test_scanned_layers_kernels_batch_their_frames(linen_params):
  # nn.scan stacks layers in front: (layers, d, heads, head_dim).
  q = linen_params["attn"]["query"]["kernel"]
  params = {"layers": {"query": {"kernel": jnp.stack([q, -q, 2 * q])}}}
  # A 4-D kernel is nn.scan's or MaxText's: auto refuses to guess.
  with pytest.raises(ValueError, match=r"layers/query/kernel: shape \(3, 16, 2, 8\).*'flax'.*'maxtext'"):
    so.orthonormalize(params)
  assert float(so.max_isometry_error(params, "flax")) > 1.0   # the 2 * q layer
  params = so.orthonormalize(params, "flax")
  errs = so.frame_isometry_errors(params, "flax")
  assert errs["layers/query/kernel"].shape == (3, HEADS)
  assert float(jnp.max(errs["layers/query/kernel"])) <= ISO_TOL
  np.testing.assert_allclose(params["layers"]["query"]["kernel"][2], q,
                             atol=1e-5)
  (fs,) = frame_adam_states(
      so.stiefel_attention(LR, frames="flax").init(params))
  assert leaves_by_path(fs.nu)["layers/query/kernel"].shape == (3, HEADS)
  assert leaves_by_path(fs.mu)["layers/query/kernel"].shape == (
      3, HEADS, D, HEAD_DIM)


def test_regex_mapping_and_callable_selectors():
  params = {"blk": _random_tree(
      {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D)})}
  whole = so.FrameSpec(rows=0, cols=1)
  by_regex = {r"/wq$": whole, r"/wk$": whole}
  by_callable = lambda path, leaf: (
      whole if path.split("/")[-1] in ("wq", "wk") else None)
  want = {"blk/wq": whole, "blk/wk": whole}
  assert so.selected_frames(params, by_regex) == want
  assert so.selected_frames(params, by_callable) == want
  assert so.selected_frames(params, {r"wq": whole}) == {"blk/wq": whole}
  params = so.orthonormalize(params, by_regex)
  new, _ = _one_step_and_state(so.stiefel_attention(LR, frames=by_regex),
                               params)
  errs = so.frame_isometry_errors(new, by_regex)
  assert set(errs) == {"blk/wq", "blk/wk"}
  assert max(float(jnp.max(e)) for e in errs.values()) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["blk"]["wv"] - params["blk"]["wv"]))) > 0
  # An entry that matches nothing is an error naming it, never dropped.
  with pytest.raises(ValueError, match=r"entry '/wz\$' matches no parameter path; nearby paths: .*blk/w"):
    so.stiefel_attention(LR, frames={**by_regex, r"/wz$": whole}).init(params)


def test_einsum_heads_d_head_dim_kernels_with_spec():
  pat = r"/(q|k)_einsum$"
  params = {"attn": _random_tree(
      {"q_einsum": (HEADS, D, HEAD_DIM), "k_einsum": (HEADS, D, HEAD_DIM),
       "v_einsum": (HEADS, D, HEAD_DIM)})}
  spec = so.FrameSpec(rows=1, cols=2)
  # Rows on the heads axis (2) give d < head_dim: named, with the fix.
  with pytest.raises(ValueError, match=r"attn/[kq]_einsum: shape \(2, 16, 8\).*\(d, r\) = \(2, 8\).*FrameSpec\(rows=1, cols=2\) fits"):
    so.stiefel_attention(LR, frames={pat: so.FrameSpec(rows=0, cols=2)}
                         ).init(params)
  params = so.orthonormalize(params, {pat: spec})
  new, state = _one_step_and_state(so.stiefel_attention(LR, frames={pat: spec}),
                                   params)
  (fs,) = frame_adam_states(state)
  assert leaves_by_path(fs.nu)["attn/q_einsum"].shape == (HEADS,)
  for name in ("q_einsum", "k_einsum"):
    for h in range(HEADS):
      w = new["attn"][name][h]                       # (d, head_dim)
      err = jnp.linalg.norm(w.T @ w - jnp.eye(HEAD_DIM))
      assert float(err) <= ISO_TOL, (name, h, err)
    assert float(jnp.max(jnp.abs(new["attn"][name] - params["attn"][name]))) > 1e-3


def test_2d_kernels_split_into_heads_with_grouped_query_key():
  # 2-D kernels: query (d, heads * head_dim), key with one KV head.
  params = {"attn": {"query": {"kernel": jax.random.normal(jax.random.key(0), (D, HEADS * HEAD_DIM))},
                     "key": {"kernel": jax.random.normal(jax.random.key(1), (D, HEAD_DIM))},
                     "value": {"kernel": jax.random.normal(jax.random.key(2), (D, HEAD_DIM))}}}
  # Auto cannot know the heads of a 2-D kernel: it says which spec fits.
  with pytest.raises(ValueError, match=r"attn/key/kernel: shape \(16, 8\).*FrameSpec\(rows=0, cols=1, heads=H\)"):
    so.selected_frames(params)
  frames = {r"query/kernel$": so.FrameSpec(rows=0, cols=1, heads=HEADS),
            r"key/kernel$": so.FrameSpec(rows=0, cols=1, heads=1)}
  params = so.orthonormalize(params, frames)
  q = params["attn"]["query"]["kernel"]
  # Per-head frames, not one (16, 16) frame: each head's columns orthonormal.
  for h in range(HEADS):
    blk = q[:, h * HEAD_DIM:(h + 1) * HEAD_DIM]
    assert float(jnp.linalg.norm(blk.T @ blk - jnp.eye(HEAD_DIM))) <= ISO_TOL
  assert float(jnp.linalg.norm(q.T @ q - jnp.eye(D))) > 1e-2
  new, state = _one_step_and_state(so.stiefel_attention(LR, frames=frames),
                                   params)
  nu = leaves_by_path(frame_adam_states(state)[0].nu)
  assert nu["attn/query/kernel"].shape == (HEADS,)
  assert nu["attn/key/kernel"].shape == (1,)
  errs = so.frame_isometry_errors(new, frames)
  assert errs["attn/query/kernel"].shape == (HEADS,)
  assert float(so.max_isometry_error(new, frames)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["attn"]["key"]["kernel"]
                               - params["attn"]["key"]["kernel"]))) > 1e-3
  with pytest.raises(ValueError, match=r"attn/key/kernel: shape \(16, 8\) has 8 columns.*heads = 3"):
    so.stiefel_attention(LR, frames={r"key/kernel$": so.FrameSpec(
        rows=0, cols=1, heads=3)}).init(params)


def test_grouped_query_3d_key_kernel_fewer_heads(linen_params):
  params = {"query": {"kernel": linen_params["attn"]["query"]["kernel"]},
            "key": {"kernel": linen_params["attn"]["key"]["kernel"][:, :1]}}
  new, state = _one_step_and_state(so.stiefel_attention(LR), params)
  (fs,) = frame_adam_states(state)
  nu = leaves_by_path(fs.nu)
  assert nu == {"query/kernel": nu["query/kernel"], "key/kernel": nu["key/kernel"]}
  assert nu["query/kernel"].shape == (HEADS,) and nu["key/kernel"].shape == (1,)
  errs = so.frame_isometry_errors(new)
  assert errs["key/kernel"].shape == (1,)
  assert float(so.max_isometry_error(new)) <= ISO_TOL


def test_whole_projection_frame(linen_params):
  params = {"query": {"kernel": linen_params["attn"]["query"]["kernel"]},
            "key": {"kernel": linen_params["attn"]["key"]["kernel"]}}
  whole = {r"(query|key)/kernel$": so.FrameSpec(rows=0, cols=(1, 2))}
  # Per-head frames are not a whole-projection frame...
  assert float(so.max_isometry_error(params, whole)) > 1e-2
  params = so.orthonormalize(params, whole)
  w = params["query"]["kernel"].reshape(D, HEADS * HEAD_DIM)
  assert float(jnp.linalg.norm(w.T @ w - jnp.eye(D))) <= ISO_TOL
  new, state = _one_step_and_state(so.stiefel_attention(LR, frames=whole),
                                   params)
  (fs,) = frame_adam_states(state)
  assert all(v.shape == () for v in leaves_by_path(fs.nu).values())
  assert all(m.shape == (D, HEADS * HEAD_DIM)
             for m in leaves_by_path(fs.mu).values())
  errs = so.frame_isometry_errors(new, whole)
  assert all(e.shape == () for e in errs.values())
  assert float(so.max_isometry_error(new, whole)) <= ISO_TOL
  assert float(jnp.max(jnp.abs(new["query"]["kernel"] - params["query"]["kernel"]))) > 1e-3


# ---------------------------------------------------------------------------
# Errors naming the path, the shape and the fix


def test_head_dim_larger_than_d_names_path_and_shape():
  params = {"attn": {"query": {"kernel": jnp.ones((4, 2, 8))},
                     "key": {"kernel": jnp.ones((8, 2, 8))}}}
  with pytest.raises(ValueError, match=r"attn/query/kernel: shape \(4, 2, 8\)"):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"attn/query/kernel.*\(4, 2, 8\)"):
    so.orthonormalize(params)


def test_nothing_selected_lists_paths():
  params = {"encoder": {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}}}
  with pytest.raises(ValueError, match=r"selects no leaf.*encoder/dense/kernel"):
    so.selected_frames(params)
  with pytest.raises(ValueError, match=r"encoder/dense/bias"):
    so.stiefel_attention(LR).init(params)
  with pytest.raises(ValueError, match=r"'wq\$' matches no parameter path"):
    so.selected_frames(params, {r"wq$": so.FrameSpec()})
  with pytest.raises(ValueError, match=r"not a preset"):
    so.selected_frames(params, "llama")


def test_bad_selector_values_name_the_path(linen_params):
  with pytest.raises(ValueError, match=r"attn/key/kernel: the frame selector returned 'adam'"):
    so.stiefel_attention(LR, frames=lambda path, leaf: (
        "adam" if path.endswith("key/kernel") else None)).init(linen_params)
  with pytest.raises(ValueError, match=r"frames\['query'\] = 'adam'"):
    so.selected_frames(linen_params, {"query": "adam"})
  with pytest.raises(ValueError, match=r"is not a frame selector"):
    so.selected_frames(linen_params, 3)
  with pytest.raises(ValueError, match=r"several frames= entries"):
    so.selected_frames(linen_params, {"query": so.FrameSpec(rows=0, cols=2),
                               "attn/q": so.FrameSpec(rows=0, cols=(1, 2))})
  state = so.stiefel_attention(LR, frames={"query/kernel$": so.FrameSpec(
      rows=0, cols=2)}).init(linen_params)
  assert len(leaves_by_path(frame_adam_states(state)[0].nu)) == 1


# --------------------------------------------------------------------------
# Named axes (Haliax, penzai): a FrameSpec by names, resolved per leaf.


def test_named_spec_resolves_against_each_leafs_names():
  spec = so.FrameSpec(rows="embed", cols="head_size")
  assert spec.named and repr(spec) == "FrameSpec(rows='embed', cols='head_size')"
  # Haliax (embed, heads, head_size) and Levanter's stacked GQA out_first.
  assert spec.resolve(("embed", "heads", "head_size")) == so.FrameSpec(
      rows=0, cols=2)
  assert spec.resolve(("layers", "kv_heads", "q_heads_per_group",
                       "head_size", "embed")) == so.FrameSpec(rows=4, cols=3)
  # Unnamed (positional) axes are batch axes; heads and parts are kept.
  fused = so.FrameSpec(rows="d", cols="qkv", parts=3, take=(0, 1),
                       part_axis="qkv", heads=2)
  assert fused.resolve((None, "d", "qkv")) == so.FrameSpec(
      rows=1, cols=2, parts=3, take=(0, 1), part_axis=2, heads=2)
  positional = so.FrameSpec(rows=0, cols=1)
  assert positional.resolve(("a", "b")) is positional and not positional.named
  with pytest.raises(ValueError, match=(
      r"q: FrameSpec\(rows='embed', cols='head_size'\) names axis 'embed',"
      r" but the leaf's axes are \('heads', 'head_size'\) \(no such name\)")):
    spec.resolve(("heads", "head_size"), "q")
  with pytest.raises(ValueError, match=r"names axis 'embed', but the leaf's"
                     r" axes are \('embed', 'embed', 'head_size'\)\. Pass"):
    spec.resolve(("embed", "embed", "head_size"))
  with pytest.raises(ValueError, match=r"names its axes; resolve it"):
    spec.frame_shape((4, 2))
  with pytest.raises(ValueError, match=r"mixes axis names and positions"):
    so.FrameSpec(rows="embed", cols=-1)
  with pytest.raises(ValueError, match=r"axes must be ints"):
    so.FrameSpec(rows=(1.5,), cols=0)


def test_path_str_drops_a_keyless_nodes_only_child_index():
  """Haliax's NamedArray (registered without keys, one child): its array's
  path ends in FlattenedIndexKey(0), which is dropped; a list's index is
  not."""
  import haliax as hax
  w = hax.zeros((hax.Axis("embed", 8), hax.Axis("head_size", 4)))
  tree = {"q_proj": {"weight": w}, "layers": [jnp.zeros(2)]}
  paths = [so.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert paths == ["layers/0", "q_proj/weight"]
  assert so.named_axes.axis_names(tree) == {
      "q_proj/weight": ("embed", "head_size")}
  assert so.selected_frames(tree, {"q_proj": so.FrameSpec(
      rows="embed", cols="head_size")}) == {
          "q_proj/weight": so.FrameSpec(rows=0, cols=1)}


def test_penzai_views_and_positional_axes_give_their_names():
  from penzai import pz
  a = pz.nx.wrap(jnp.zeros((3, 8, 2, 4))).tag_prefix("embedding")
  assert so.named_axes.axis_names({"w": a}) == {
      "w/data_array": ("embedding", None, None, None)}
  b = pz.nx.wrap(jnp.zeros((8, 2, 4))).tag("embedding", "heads", "projection")
  view = b.untag("heads").tag("heads")          # a NamedArrayView
  names = so.named_axes.axis_names({"w": view})
  assert names == {"w/data_array": ("embedding", "heads", "projection")}


def test_the_library_imports_neither_haliax_nor_penzai(library_imports):
  for when in ("import", "select"):   # nor when it selects frames
    assert not {"haliax", "penzai"} & set(library_imports[when]), when


def test_query_key_lookalikes_and_what_is_not_one():
  """What the default refuses to leave on AdamW: floating kernels (rank >= 2)
  under a query/key projection's name, in any case; never a bias, a norm
  scale, a PRNG key or a vector."""
  look = so.selector.looks_like_qk
  w = jnp.zeros((8, 8))
  for path in ("enc/query/kernel", "model/layers/0/self_attn/q_proj/kernel",
               "blk/attention/Wqkv/weight", "h/0/attn/c_attn/kernel",
               "layer_0/attn/kv_einsum/w", "blocks/W_K", "attn/in_proj/w"):
    assert look(path, w), path
  for path, x in (("enc/query/bias", w), ("attn/q_proj/b", w),
                  ("attn/_query_norm/scale", jnp.zeros(8)),
                  ("rngs/default/key", jnp.zeros((2, 2), jnp.uint32)),
                  ("attn/query/kernel", jnp.zeros(8)),
                  ("attn/value/kernel", w), ("mlp/wi_0/kernel", w)):
    assert not look(path, x), path
  # A tree whose lookalikes the default selects passes untouched.
  tree = {"attn": {"query": {"kernel": jnp.zeros((8, 2, 4)),
                             "bias": jnp.zeros((2, 4))},
                   "key": {"kernel": jnp.zeros((8, 2, 4))}}}
  assert set(so.selected_frames(tree)) == {"attn/query/kernel",
                                           "attn/key/kernel"}
