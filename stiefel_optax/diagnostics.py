"""Diagnostics: how far frames are from the manifold and how far they move."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stiefel_optax import geometry, partition


def _by_path(tree) -> dict:
  """{path: leaf} for a tree of per-frame values (None leaves dropped)."""
  return {partition.path_str(p): e for p, e in
          jax.tree_util.tree_leaves_with_path(tree)}


def frame_isometry_errors(params, labels=None, **kwargs):
  """{path: per-frame ||W^T W - I||_F} for every labelled kernel.

  Keyword arguments are those of `partition.map_frames` (patterns, per_head,
  num_heads, head_dim, layout). Works on any kernel, orthonormal or not (the
  paper measures an AdamW arm's raw kernels this way).
  """
  tree = partition.map_frames(geometry.isometry_error, params, labels,
                              back=False, **kwargs)
  return _by_path(tree)


def max_isometry_error(params, labels=None, **kwargs) -> jax.Array:
  """The largest isometry error over all labelled frames."""
  errs = frame_isometry_errors(params, labels, **kwargs)
  return jnp.max(jnp.stack([jnp.max(e) for e in errs.values()]))


def check_frames(params, labels=None, atol: float = 1e-5, **kwargs) -> None:
  """Raises ValueError naming each labelled leaf with a frame off the
  manifold (isometry error > atol), with its error and shape."""
  errs = frame_isometry_errors(params, labels, **kwargs)
  leaves = {partition.path_str(p): x for p, x in
            jax.tree_util.tree_leaves_with_path(params)}
  bad = [f"{path} (shape {tuple(leaves[path].shape)}): max isometry error"
         f" {float(jnp.max(e)):.3g}" for path, e in errs.items()
         if not float(jnp.max(e)) <= atol]
  if bad:
    raise ValueError(
        f"check_frames: {len(bad)} kernel(s) off the Stiefel manifold"
        f" (atol {atol}): " + "; ".join(bad) +
        ". Call stiefel_optax.orthonormalize(params) before training.")


def frame_movement(old_params, new_params, labels=None, **kwargs):
  """{path: per-frame ||W_new - W_old||_F} for every labelled kernel."""
  diff = jax.tree.map(lambda a, b: b - a, old_params, new_params)
  lab = partition._resolve_labels(
      old_params, labels, kwargs.pop("patterns", partition.DEFAULT_QK_PATTERNS))
  tree = partition.map_frames(geometry.frame_norm, diff, lab, back=False,
                              **kwargs)
  return _by_path(tree)
