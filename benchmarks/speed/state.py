"""Table 4: the optimizer-state bytes held for the Q/K kernels (shapes only:
`jax.eval_shape`, nothing allocated or timed)."""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.speed import arms, trees


def nbytes(x) -> int:
  """Bytes of an array or a `jax.ShapeDtypeStruct`."""
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def qk_state_bytes(cfg: trees.TreeConfig) -> Dict[str, Any]:
  """Bytes of optimizer state held for the Q/K kernels.

  AdamW: its mu and nu leaves at Q/K paths. stiefel_attention: every array
  in the Stiefel group's state (mu in the frame view, one nu per frame, the
  step count).
  """
  params = trees.param_tree(cfg)
  txs = arms.optimizers()
  adamw = jax.eval_shape(txs["adamw"].init, params)
  adamw_bytes = sum(nbytes(x) for p, x in
                    jax.tree_util.tree_leaves_with_path(adamw)
                    if trees.is_qk(p))
  st = jax.eval_shape(txs["stiefel_attention"].init, params)
  group = st.stiefel
  st_bytes = sum(nbytes(x) for x in jax.tree.leaves(group))
  qk, _ = trees.split_qk(params)
  return {"tree": cfg.name,
          "qk_param_bytes": sum(nbytes(x) for x in qk.values()),
          "adamw_bytes": adamw_bytes, "stiefel_bytes": st_bytes,
          "ratio": st_bytes / adamw_bytes}
