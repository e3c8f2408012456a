"""benchmarks/models.py: the one transformer of grokking, CIFAR and speed.

The recorded grokking and CIFAR runs (and a CIFAR study resumed from disk)
depend on the exact initial parameters, so those are pinned to the models
these runs were made with (benchmarks/transformer.py and
benchmarks/patch_vit.py before they were merged here, which gave these
parameters bit for bit): parameter paths and shapes exactly, values by one
random projection per weight. The projections and logits are pinned to a
tolerance, not to the bit: float rounding depends on the XLA build and its
flags (the suite compiles without LLVM optimisation, conftest.py).
Every option is also checked against an independent plain-jnp forward pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cifar_patches as cp, grokking, models

TOKENS = np.arange(6, dtype=np.int32).reshape(2, 3)
IMAGES = np.linspace(-1, 1, 2 * 32 * 32 * 3, dtype=np.float32).reshape(2, 32, 32, 3)


def shapes(params) -> dict:
  """{"block_0/attn/query/kernel": shape, ...}"""
  return {"/".join(k.key for k in path): x.shape
          for path, x in jax.tree_util.tree_leaves_with_path(params)}


def projections(params) -> dict:
  """{path: <x, r>} with r a fixed Gaussian per leaf, for every leaf that
  is not all zeros or all ones (biases and LayerNorm scales at their init):
  a renamed module, another initialiser or another RNG split moves it by
  O(1), rounding by ~1e-7."""
  out = {}
  for i, (name, x) in enumerate(zip(shapes(params), jax.tree.leaves(params))):
    x = np.asarray(x, np.float64)
    if not (np.all(x == 0) or np.all(x == 1)):
      out[name] = float(np.sum(x * np.random.default_rng(i).standard_normal(x.shape)))
  return out


def assert_pinned(got: dict, want: dict):
  assert set(got) == set(want)
  np.testing.assert_allclose([got[k] for k in want], list(want.values()),
                             rtol=1e-5, atol=1e-5)


def block_shapes(i, d, heads, mlp, biases):
  hd = d // heads
  out = {f"block_{i}/attn/{n}/kernel": (d, heads, hd)
         for n in ("query", "key", "value")}
  out[f"block_{i}/attn/out/kernel"] = (heads, hd, d)
  if biases:
    out.update({f"block_{i}/attn/{n}/bias": (heads, hd)
                for n in ("query", "key", "value")})
    out[f"block_{i}/attn/out/bias"] = (d,)
    out.update({f"block_{i}/{n}/{p}": (d,) for n in ("ln_attn", "ln_mlp")
                for p in ("scale", "bias")})
  out.update({f"block_{i}/mlp_in/kernel": (d, mlp), f"block_{i}/mlp_in/bias": (mlp,),
              f"block_{i}/mlp_out/kernel": (mlp, d), f"block_{i}/mlp_out/bias": (d,)})
  return out


def test_cifar_model_is_the_recorded_one():
  mcfg = cp.Config().model
  # Part of every CIFAR run's identity (its Config.to_dict()).
  assert dataclasses.asdict(mcfg) == dict(patch=4, dim=64, heads=4, depth=2,
                                          mlp_ratio=2, num_classes=10)
  model = mcfg.build()
  # Jitted: the same values as the benchmark's eager call (to rounding,
  # ~1e-8, far inside the pins), one program instead of op-by-op compiles.
  params = jax.jit(lambda: cp.init_params(model, cp.ARMS["adamw"], 0))()
  want = {"embed/kernel": (48, 64), "embed/bias": (64,), "pos": (64, 64),
          "ln_out/scale": (64,), "ln_out/bias": (64,),
          "head/kernel": (64, 10), "head/bias": (10,)}
  for i in range(2):
    want.update(block_shapes(i, 64, 4, 128, biases=True))
  assert shapes(params) == want
  assert_pinned(projections(params), {
      "block_0/attn/key/kernel": 9.338667, "block_0/attn/out/kernel": 0.8255926,
      "block_0/attn/query/kernel": 10.54054, "block_0/attn/value/kernel": -6.835325,
      "block_0/mlp_in/kernel": 6.169795, "block_0/mlp_out/kernel": 11.08242,
      "block_1/attn/key/kernel": -4.569212, "block_1/attn/out/kernel": -0.9379779,
      "block_1/attn/query/kernel": 0.4312031, "block_1/attn/value/kernel": -6.513,
      "block_1/mlp_in/kernel": 17.96458, "block_1/mlp_out/kernel": 1.412808,
      "embed/kernel": -3.973557, "head/kernel": 0.1362373, "pos": 0.7353141})
  logits = jax.jit(model.apply)({"params": params}, IMAGES)
  np.testing.assert_allclose(logits[:, :4], [
      [-1.4371912, -1.1452081, 1.2429695, 0.46352422],
      [2.0011656, 0.07644157, -1.1477815, 0.57829845]], rtol=1e-4, atol=1e-5)


def test_grokking_model_is_the_recorded_one():
  model = grokking.make_model(grokking.Config())
  # Jitted, as in test_cifar_model_is_the_recorded_one.
  params = jax.jit(lambda: grokking.initial_params(grokking.Config(), "adamw",
                                                   0))()
  want = {"embed/embedding": (98, 32), "pos_embed": (3, 32),
          "unembed/kernel": (32, 97), **block_shapes(0, 32, 4, 128, biases=False)}
  assert shapes(params) == want
  assert_pinned(projections(params), {
      "block_0/attn/key/kernel": 8.000833, "block_0/attn/out/kernel": -2.830647,
      "block_0/attn/query/kernel": 4.656369, "block_0/attn/value/kernel": -9.810611,
      "block_0/mlp_in/kernel": -5.921234, "block_0/mlp_out/kernel": 6.231999,
      "embed/embedding": 9.306429, "pos_embed": -2.406406,
      "unembed/kernel": -3.810055})
  logits = jax.jit(model.apply)({"params": params}, TOKENS)
  np.testing.assert_allclose(logits[:, :4], [
      [-0.19209911, 0.6242281, 0.5967154, 0.1626725],
      [0.41493273, 0.56038415, 0.261406, -0.18733117]], rtol=1e-4, atol=1e-5)


# ------------------------------------------------- an independent forward


def _ln(p, x):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / jnp.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def _dense(p, x, eq="...i,io->...o"):
  y = jnp.einsum(eq, x, p["kernel"])
  return y + p["bias"] if "bias" in p else y


def reference(cfg: models.TransformerConfig, params, x):
  """The model of the models.py docstring, written out in jnp."""
  if cfg.inputs == "tokens":
    x = params["embed"]["embedding"][x]
  else:
    s = cfg.patch
    x = jnp.stack([x[:, r:r + s, c:c + s].reshape(len(x), -1)
                  for r in range(0, x.shape[1], s)
                  for c in range(0, x.shape[2], s)], 1)
    x = _dense(params["embed"], x)
  x = x + params["pos_embed" if cfg.inputs == "tokens" else "pos"]
  norm = _ln if cfg.layer_norm else (lambda p, h: h)
  act = {"relu": jax.nn.relu,
         "gelu": lambda h: jax.nn.gelu(h, approximate=True)}[cfg.activation]
  n = x.shape[1]
  for i in range(cfg.depth):
    p = params[f"block_{i}"]
    h = norm(p.get("ln_attn"), x)
    q, k, v = (_dense(p["attn"][m], h, "bsd,dhk->bshk")
               for m in ("query", "key", "value"))
    logits = jnp.einsum("bshk,bthk->bhst", q, k) / np.sqrt(cfg.head_dim)
    if cfg.causal:
      logits = jnp.where(np.tril(np.ones((n, n), bool)), logits, -1e30)
    o = jnp.einsum("bhst,bthk->bshk", jax.nn.softmax(logits, -1), v)
    x = x + _dense(p["attn"]["out"], o, "bshk,hkd->bsd")
    h = act(_dense(p["mlp_in"], norm(p.get("ln_mlp"), x)))
    x = x + _dense(p["mlp_out"], h)
  if cfg.layer_norm:
    x = _ln(params["ln_final" if cfg.inputs == "tokens" else "ln_out"], x)
  x = {"last": lambda: x[:, -1], "mean": lambda: x.mean(1),
       "all": lambda: x}[cfg.readout]()
  return _dense(params["unembed" if cfg.inputs == "tokens" else "head"], x)


CASES = {
    # grokking's options plus what it leaves off: 2 layers, LN, biases
    # (the last block attends from the last position alone).
    "tokens_last_ln_bias": models.TransformerConfig(
        d_model=16, num_heads=2, d_mlp=32, num_classes=7, depth=2,
        vocab_size=9, seq_len=5, layer_norm=True, attn_bias=True,
        head_bias=True),
    "cifar_quick": cp.PRESETS["quick"].model.config(),
    "causal_lm": models.TransformerConfig(     # speed's LM
        d_model=16, num_heads=4, d_mlp=32, num_classes=9, depth=2,
        vocab_size=9, seq_len=6, activation="gelu", layer_norm=True,
        attn_bias=True, head_bias=True, causal=True, readout="all",
        pos_std=0.02),
}


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_an_independent_implementation(name):
  cfg = CASES[name]
  rng = np.random.default_rng(0)
  x = (rng.integers(0, cfg.vocab_size, (3, cfg.seq_len)).astype(np.int32)
       if cfg.inputs == "tokens" else IMAGES)
  model = models.Transformer(cfg)
  params = jax.jit(model.init)(jax.random.PRNGKey(1), x)["params"]
  # Non-zero biases and LN parameters, so that each one is exercised.
  params = jax.tree.map(
      lambda a: a + 0.1 * rng.standard_normal(a.shape).astype(np.float32), params)
  apply = jax.jit(model.apply)
  np.testing.assert_allclose(
      apply({"params": params}, x),
      jax.jit(reference, static_argnums=0)(cfg, params, x), rtol=2e-4, atol=2e-5)
  if cfg.inputs == "tokens":
    with pytest.raises(ValueError, match="seq_len"):
      apply({"params": params}, x[:, :-1])


def test_config_is_checked():
  with pytest.raises(ValueError, match="readout"):
    models.TransformerConfig(8, 2, 16, 3, vocab_size=5, seq_len=3, readout="cls")
  with pytest.raises(ValueError, match="divisible"):
    models.TransformerConfig(8, 3, 16, 3, vocab_size=5, seq_len=3)
  with pytest.raises(ValueError, match="vocab_size and seq_len"):
    models.TransformerConfig(8, 2, 16, 3)
