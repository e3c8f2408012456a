"""The attention-logit bound of orthonormal per-head Q/K frames, certified
in float64.

Proposition. If each head's query and key frames W_Q, W_K (d, r) are
orthonormal (W^T W = I_r), then for any tokens x_i, x_j and biases b_q, b_k

    |(W_Q^T x_i + b_q) . (W_K^T x_j + b_k)| / sqrt(r)
        <= (||x_i|| + ||b_q||) (||x_j|| + ||b_k||) / sqrt(r),

because ||W^T x|| <= ||x|| for an orthonormal W (its spectral norm is 1),
then Cauchy-Schwarz and the triangle inequality. Without biases the bound is
||x_i|| ||x_j|| / sqrt(r). The certificate measures the largest ratio of
logit to bound over every head and token pair of a linen attention layer
whose kernels `so.orthonormalize` made orthonormal (it must be <= 1); the
control runs the same measurement on nanoGPT-scaled Gaussian kernels
(std 1, not orthonormal), where the bound fails, so the certificate can
fail.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stiefel_optax as so

D, HEADS, HEAD_DIM, T = 16, 4, 4, 12


def logit_to_bound(params, x):
  """max over heads and token pairs of |q_i . k_j| / bound_ij, for linen
  query/key kernels (d, heads, r) with biases (heads, r)."""
  q_p, k_p = params["query"], params["key"]
  q = jnp.einsum("td,dhr->htr", x, q_p["kernel"]) + q_p["bias"][:, None]
  k = jnp.einsum("td,dhr->htr", x, k_p["kernel"]) + k_p["bias"][:, None]
  logits = jnp.abs(jnp.einsum("hir,hjr->hij", q, k)) / np.sqrt(HEAD_DIM)
  xn = jnp.linalg.norm(x, axis=-1)                       # (T,)
  bq = jnp.linalg.norm(q_p["bias"], axis=-1)             # (heads,)
  bk = jnp.linalg.norm(k_p["bias"], axis=-1)
  bound = ((xn[None, :, None] + bq[:, None, None])
           * (xn[None, None, :] + bk[:, None, None])) / np.sqrt(HEAD_DIM)
  return float(jnp.max(logits / bound))


def attention_params(seed):
  """A linen MultiHeadDotProductAttention's parameters in float64, biases
  drawn large so that they matter in the bound."""
  mha = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                        qkv_features=HEADS * HEAD_DIM,
                                        param_dtype=jnp.float64)
  x = jnp.zeros((1, T, D), jnp.float64)
  params = mha.init(jax.random.PRNGKey(seed), x)["params"]
  for name in ("query", "key"):
    params[name]["bias"] = jax.random.normal(
        jax.random.PRNGKey(seed + 100), (HEADS, HEAD_DIM), jnp.float64)
  return params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logit_bound_orthonormal_frames(x64, seed, certificate):
  params = so.orthonormalize(attention_params(seed))
  assert so.max_isometry_error(params) < 1e-12
  # Tokens aligned with a query direction make the bound nearly tight.
  x = jax.random.normal(jax.random.PRNGKey(seed + 7), (T, D), jnp.float64)
  x = x.at[0].set(3.0 * params["query"]["kernel"][:, 0, 0])
  x = x.at[1].set(3.0 * params["key"]["kernel"][:, 0, 0])
  ratio = certificate(f"logit bound: max logit / bound (seed {seed})",
                      logit_to_bound(params, x))
  assert ratio <= 1.0 + 1e-12
  assert ratio > 0.3          # the measurement sees logits near the bound


def test_logit_bound_fails_without_orthonormal_frames(x64):
  params = attention_params(0)
  for name in ("query", "key"):
    params[name]["kernel"] = jax.random.normal(
        jax.random.PRNGKey(3), params[name]["kernel"].shape, jnp.float64)
  x = jax.random.normal(jax.random.PRNGKey(7), (T, D), jnp.float64)
  assert so.max_isometry_error(params) > 0.1
  assert logit_to_bound(params, x) > 1.0
