"""Array primitives that the geometry and the Newton–Schulz iteration share.

The dtype the library computes in, the helpers that keep Explicit mesh
shardings consistent, the Gram product A^T B and the per-frame Frobenius
norm. Every function acts on arrays of shape (..., rows, cols), the last two
axes one matrix. `newton_schulz` and `geometry` build on them (and the
library's other modules import them from here); this module imports
neither, so the three are acyclic.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp


def _check_matrices(fn: str, name: str, shape) -> None:
  shape = tuple(shape)
  if len(shape) < 2:
    raise ValueError(
        f"{fn}: {name} needs shape (..., rows, cols) with rank >= 2; got"
        f" shape {shape}.")

def compute_dtype(dtype) -> jnp.dtype:
  """The dtype the geometry runs in: at least float32 (bf16/f16 upcast)."""
  return jnp.promote_types(dtype, jnp.float32)

# --------------------------------------------------------------------------
# Explicit sharding: where a mesh's axes are Explicit (`jax.make_mesh`'s
# default in jax 0.10), an array's sharding is part of its type and every
# op's operands must agree. These helpers read it; on one device, or under
# Auto axes, they return None / their input, and the ops are written
# exactly as without them.


def explicit_spec(x) -> Optional[tuple]:
  """x's PartitionSpec entries (one per axis) where x is sharded over an
  Explicit mesh axis; None otherwise (no mesh, Auto axes, replicated)."""
  try:
    sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    return None
  mesh = getattr(sharding, "mesh", None)
  spec = getattr(sharding, "spec", None)
  if mesh is None or spec is None or mesh.empty:
    return None
  explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit}
  entries = tuple(spec) + (None,) * (jnp.ndim(x) - len(tuple(spec)))
  names = [n for e in entries if e is not None
           for n in (e if isinstance(e, tuple) else (e,))]
  return entries if any(n in explicit for n in names) else None


def gram_sharding(a, b) -> Optional[jax.sharding.PartitionSpec]:
  """The sharding of A^T B where A's or B's rows d are sharded over
  Explicit mesh axes, for which jax asks (the sum over the row blocks is
  an all-reduce of the r x s blocks): A's batch axes, the block replicated.
  None where d is not so sharded (the product needs no annotation)."""
  specs = [explicit_spec(x) for x in (a, b)]
  if not any(s is not None and s[-2] is not None for s in specs):
    return None
  batch = next(s for s in specs if s is not None)[:-2]
  return jax.sharding.PartitionSpec(*batch, None, None)


def frame_scalar_sharding(w) -> Optional[jax.sharding.NamedSharding]:
  """The sharding of one scalar per frame of w (..., d, r) (a second
  moment, a step scale): w's batch axes, where w is sharded over Explicit
  mesh axes; None otherwise."""
  spec = explicit_spec(w)
  if spec is None:
    return None
  return jax.sharding.NamedSharding(jax.typeof(w).sharding.mesh,
                                    jax.sharding.PartitionSpec(*spec[:-2]))


def reshard_to(x, sharding):
  """x resharded to `sharding` (a NamedSharding, or None: x itself) where
  it is not sharded so already: a state made or placed apart from the
  step's arrays, so that the selects and products that mix them agree
  under Explicit mesh axes. No op otherwise."""
  if sharding is None:
    return x
  want = tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  if (explicit_spec(x) or (None,) * jnp.ndim(x)) == want:
    return x
  return jax.sharding.reshard(x, sharding)


def like(x, ref):
  """x sharded as ref where ref is sharded over Explicit mesh axes
  (`reshard_to`); x itself otherwise."""
  if explicit_spec(ref) is None:
    return x
  return reshard_to(x, jax.typeof(ref).sharding)

# --------------------------------------------------------------------------
# Products and norms.


def gram(a: jax.Array, b: Optional[jax.Array] = None) -> jax.Array:
  """A^T B per frame (A^T A when b is None), shape (..., r, s).

  A (..., d, r) and B (..., d, s) must agree in d and in the batch axes.
  Where d is sharded over Explicit mesh axes (FSDP under
  `jax.make_mesh`'s default), the product is a sum over the row blocks, and
  the result is the r x s block per frame, sharded as A's batch axes
  (`gram_sharding`).
  """
  _check_matrices("gram", "a", a.shape)
  if b is None:
    b = a
  else:
    _check_matrices("gram", "b", b.shape)
    if a.shape[:-1] != b.shape[:-1]:
      raise ValueError(
          f"gram: a has shape {tuple(a.shape)} but b has shape"
          f" {tuple(b.shape)}; A^T B needs the same rows d and batch axes"
          " (shape[:-1] equal).")
  out = gram_sharding(a, b)
  if out is None:
    return jax.lax.platform_dependent(a, b, cpu=_gram_cpu,
                                      default=_gram_contraction)
  return jax.lax.platform_dependent(
      a, b, cpu=functools.partial(_gram_cpu, out_sharding=out),
      default=functools.partial(_gram_contraction, out_sharding=out))


def _gram_contraction(a: jax.Array, b: jax.Array,
                      out_sharding=None) -> jax.Array:
  """A^T B as one contraction over d: the form GPU and TPU dots take
  natively (a transposed operand is a flag of the GEMM, not a copy)."""
  if out_sharding is None:
    return jnp.einsum("...dr,...ds->...rs", a, b)
  return jnp.einsum("...dr,...ds->...rs", a, b, out_sharding=out_sharding)


def _gram_cpu(a: jax.Array, b: jax.Array, out_sharding=None) -> jax.Array:
  """A^T B on CPU: A^T materialised, then a plain batched matmul.

  XLA's CPU backend (jaxlib 0.10) sends a batched dot whose left operand
  contracts over its second-to-last axis to a generic loop over the batch,
  but a plain (..., r, d) @ (..., d, s) matmul to its batched GEMM library;
  the barrier keeps the algebraic simplifier from folding the transpose
  back into the dot. Faster on CPU in `python -m benchmarks.speed`'s table 8
  (the measurements: docs/performance.rst). Where A is both operands or
  several products share it, the one copy of A^T serves them all (common
  subexpressions). The summation order differs from the contraction's:
  results agree to rounding.
  """
  a_t = jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))
  if out_sharding is None:
    return a_t @ b
  return jnp.matmul(a_t, b, out_sharding=out_sharding)


def frame_norm(x: jax.Array) -> jax.Array:
  """||x||_F per frame; shape x.shape[:-2], computed (and returned) in at
  least float32: a sum of d r squares in bfloat16 would round each partial
  sum to 8 bits."""
  _check_matrices("frame_norm", "x", x.shape)
  x = x.astype(compute_dtype(x.dtype))
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1)))
