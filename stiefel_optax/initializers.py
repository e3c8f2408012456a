"""Orthonormal starts: the nearest orthonormal frames of a trained model, and
an initializer for fresh kernels."""

from __future__ import annotations

import jax.numpy as jnp

from stiefel_optax import geometry, specs as specs_lib, views


def orthonormalize(params, frames: specs_lib.Selector = None, *,
                   method: str = "eigh"):
  """Replaces the selected frames by their polar factors.

  Everything else (other leaves, parts of fused leaves that are not frames)
  is unchanged.

  polar(A) = A (A^T A)^(-1/2) is the nearest orthonormal frame in Frobenius
  norm, argmin ||Q - A||_F over St(d, r). The factor from `method` is
  polished by two Newton–Schulz steps, which converge quadratically from a
  nearly orthonormal frame, so that an ill-conditioned A still lands on the
  manifold to the rounding of its dtype.

  Args:
    params: a parameter tree (dict, Flax/nnx state, Equinox Module, ...).
    frames: the frame selector (`frame_specs`); None: the default "auto".
    method: the polar factor's method (`polar`): "eigh" (default) or
      "newton_schulz".

  Returns:
    A tree of the structure of `params` (a dict for a dict, an
    `eqx.Module` for an Equinox model, its non-array fields kept) with the
    selected frames orthonormal.

  Raises:
    ValueError: as `frame_specs`, or for an unknown `method`.

  Example:
    >>> import jax, stiefel_optax as so
    >>> params = {"attn": {"query": {"kernel": jax.random.normal(
    ...     jax.random.key(0), (16, 2, 4))}}}
    >>> bool(so.max_isometry_error(so.orthonormalize(params)) < 1e-5)
    True

    An Equinox model stays a Module:

    >>> import equinox as eqx
    >>> mha = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    >>> mha = so.orthonormalize(mha)
    >>> type(mha).__name__, bool(so.max_isometry_error(mha) < 1e-5)
    ('MultiheadAttention', True)
  """

  def fn(a):
    q = geometry.polar(a, method)
    polished = geometry.polar(q, "newton_schulz", num_steps=2)
    # Keep the polish only where it helped (it cannot when A was so close to
    # rank-deficient that the first factor is far off the manifold).
    better = geometry.isometry_error(polished) <= geometry.isometry_error(q)
    return jnp.where(better[..., None, None], polished, q)

  return views.map_frames(fn, params, frames)


def orthonormal_heads_init(dtype=jnp.float32):
  """A Flax initializer of (d, heads, head_dim) kernels of orthonormal heads.

  Each head's (d, head_dim) frame is Haar-random orthonormal
  (`random_frames`).

  Args:
    dtype: the default dtype of the kernels it makes.

  Returns:
    init(key, shape, dtype=dtype), a JAX initializer (as
    `nn.initializers.*` return); it raises ValueError unless shape is
    (d, heads, head_dim) with d >= head_dim.

  Example:
    >>> import jax, stiefel_optax as so
    >>> w = so.orthonormal_heads_init()(jax.random.key(0), (16, 2, 4))
    >>> bool(so.max_isometry_error({"query": {"kernel": w}}) < 1e-5)
    True
  """

  def init(key, shape, dtype=dtype):
    shape = tuple(shape)
    if len(shape) != 3:
      raise ValueError(
          f"orthonormal_heads_init: expects (d, heads, head_dim); got {shape}.")
    if shape[2] > shape[0]:
      raise ValueError(
          f"orthonormal_heads_init: shape {shape} has head_dim = {shape[2]} >"
          f" d = {shape[0]}; an orthonormal frame needs d >= head_dim.")
    frames = geometry.random_frames(key, (shape[1], shape[0], shape[2]), dtype)
    return jnp.transpose(frames, (1, 0, 2))

  return init
