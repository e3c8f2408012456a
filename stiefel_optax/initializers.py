"""Orthonormal starts: the nearest orthonormal frames of a trained model, and
an initializer for fresh kernels."""

from __future__ import annotations

import jax.numpy as jnp

from stiefel_optax import geometry, selector, views


def orthonormalize(params, frames: selector.Selector = None, *,
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


def orthonormal_heads_init(dtype=jnp.float32, *, head_dim=None):
  """An initializer of attention kernels whose heads are orthonormal frames.

  Each head's (d, head_dim) frame is Haar-random orthonormal
  (`random_frames`). It makes (d, heads, head_dim) kernels, and, given
  `head_dim`, the flat (d, heads * head_dim) kernels, head h in columns
  [h head_dim, (h + 1) head_dim), that Flax's attention modules ask of their
  `kernel_init`: linen's `MultiHeadDotProductAttention` (through
  `DenseGeneral`) and nnx's `MultiHeadAttention` (through `LinearGeneral`)
  both call it with the flat shape and reshape the result to (d, heads,
  head_dim). `head_dim`, not the head count, fixes the split, so one
  initializer serves the query (heads) and, under grouped-query attention,
  the key and value (kv heads). Given as `kernel_init`, it also initializes
  the value projection, and the output projection unless `out_kernel_init`
  is given (its (heads * head_dim, d) kernel then has orthonormal blocks of
  head_dim columns, a valid start for any kernel).

  Args:
    dtype: the default dtype of the kernels it makes.
    head_dim: the columns per head of a flat (d, heads * head_dim) kernel;
      None: only (d, heads, head_dim) kernels.

  Returns:
    init(key, shape, dtype=dtype), a JAX initializer (as
    `nn.initializers.*` return); it raises ValueError, naming the shape and
    the fix, unless shape is (d, heads, head_dim) (its last axis equal to
    `head_dim` if given) or, given `head_dim`, (d, n) with head_dim dividing
    n; and unless d >= head_dim.

  Example:
    >>> import jax, stiefel_optax as so
    >>> w = so.orthonormal_heads_init()(jax.random.key(0), (16, 2, 4))
    >>> bool(so.max_isometry_error({"query": {"kernel": w}}) < 1e-5)
    True

    As Flax attention's `kernel_init` (the flat shape; nnx alike):

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> attn = nn.MultiHeadDotProductAttention(
    ...     num_heads=2, qkv_features=8,
    ...     kernel_init=so.orthonormal_heads_init(head_dim=4))
    >>> params = attn.init(jax.random.key(1), jnp.ones((1, 3, 16)))["params"]
    >>> bool(so.max_isometry_error(params) < 1e-5)
    True
  """
  if head_dim is not None and not (isinstance(head_dim, int)
                                   and head_dim >= 1):
    raise ValueError(f"orthonormal_heads_init: head_dim={head_dim!r} must be"
                     " a positive int (the columns per head).")

  def init(key, shape, dtype=dtype):
    shape = tuple(shape)
    flat = len(shape) == 2 and head_dim is not None
    if flat and shape[1] % head_dim:
      raise ValueError(
          f"orthonormal_heads_init: shape {shape} has {shape[1]} columns, not"
          f" divisible into heads of head_dim = {head_dim}; pass the model's"
          " head_dim.")
    if not flat and (len(shape) != 3 or (head_dim is not None
                                         and shape[2] != head_dim)):
      fix = ("orthonormal_heads_init(head_dim=...) for the flat (d, heads *"
             " head_dim) shape that Flax's attention modules pass"
             if head_dim is None else f"head_dim = {head_dim}")
      raise ValueError(
          f"orthonormal_heads_init: expects (d, heads, head_dim); got {shape}."
          f" Use {fix}.")
    d, heads, r = ((shape[0], shape[1] // head_dim, head_dim) if flat
                   else shape)
    if r > d:
      raise ValueError(
          f"orthonormal_heads_init: shape {shape} has head_dim = {r} >"
          f" d = {d}; an orthonormal frame needs d >= head_dim.")
    frames = geometry.random_frames(key, (heads, d, r), dtype)
    return jnp.transpose(frames, (1, 0, 2)).reshape(shape)

  return init
