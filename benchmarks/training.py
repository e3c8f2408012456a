"""The one training loop every benchmark runs, its checkpoint, the one
evaluation of a classifier's logits and the one Muon baseline of the
attention benchmarks (`per_head_muon`).

A chunk is `k` optimizer steps in one `lax.scan`: per step

    batch = batch_of(x_i, *data)
    loss, g = value_and_grad(loss_fn)(params, *batch)
    u, opt_state = tx.update(g, opt_state, params)
    params = optax.apply_updates(params, u)

and the chunk returns the new carry (params, opt_state), the mean loss over
its steps and, if `aux_fn(old, new)` is given, the mean of that per-step
quantity (e.g. the Q/K frames' movement). The experiments differ only in
what `x_i` is (CIFAR: an index batch; the LM: an iteration number whose
batch is drawn from a key; grokking: nothing, full batch) and how often
they evaluate between chunks.

>>> import jax.numpy as jnp, optax
>>> chunk = train_chunk(lambda p, x: jnp.sum((p - x) ** 2), optax.sgd(0.25),
...                     lambda x: (x,))
>>> p = jnp.zeros(2)
>>> (p, _), loss, _ = chunk((p, optax.sgd(0.25).init(p)), jnp.ones((3, 2)))
>>> p.tolist(), float(loss)        # 1 - 0.5^3 after three halvings
([0.875, 0.875], 0.875)
"""

from __future__ import annotations

import os
import pathlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness


def train_chunk(loss_fn: Callable, tx: optax.GradientTransformation,
                batch_of: Callable, *, aux_fn: Optional[Callable] = None,
                length: Optional[int] = None) -> Callable:
  """chunk(carry, xs, *data) -> (carry, mean loss, mean aux or None): one
  step per element of `xs` (or `length` steps when xs is None), not jitted
  (callers choose donation and compiler options)."""

  def step(carry, x, data):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch_of(x, *data))
    updates, opt_state = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    aux = aux_fn(params, new) if aux_fn is not None else None
    return (new, opt_state), (loss, aux)

  def chunk(carry, xs, *data):
    carry, (losses, aux) = jax.lax.scan(
        lambda c, x: step(c, x, data), carry, xs, length=length)
    return carry, losses.mean(), jax.tree.map(lambda a: a.mean(0), aux)

  return chunk


def loss_and_accuracy(logits: jax.Array, labels: jax.Array):
  """(mean cross-entropy in float32, accuracy) of `logits` (..., classes)
  against integer `labels` (...): grokking's answer token, CIFAR's image
  class.

  >>> import jax.numpy as jnp
  >>> loss, acc = loss_and_accuracy(jnp.array([[0.0, 9.0], [0.0, 9.0]]),
  ...                               jnp.array([1, 0]))
  >>> float(acc), round(float(loss), 3)      # one right, one wrong by 9
  (0.5, 4.5)
  """
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()
  return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def per_head_muon(learning_rate, weight_decay: float
                  ) -> optax.GradientTransformation:
  """The `muon` arm of the attention benchmarks: `optax.contrib.muon` on
  frame views (..., d, head_dim), rows reduced and columns out, so that it
  sees each head's W_q (d, head_dim) as a matrix x W = y (as it would
  with separate per-head kernels); unconstrained, with Nesterov momentum
  0.95 (Muon's default), Moonlight's consistent-RMS scale 0.2 (so its lr
  reads like AdamW's) and the model's weight decay, as AdamW decays the
  same weights.

  >>> import jax.numpy as jnp
  >>> tx = per_head_muon(1e-3, weight_decay=0.1)
  >>> w = {"q": jnp.ones((2, 8, 4))}         # two heads' (d, head_dim) views
  >>> u, _ = tx.update(w, tx.init(w), w)
  >>> u["q"].shape
  (2, 8, 4)
  """
  dims = lambda params: jax.tree.map(
      lambda _: optax.contrib.MuonDimensionNumbers(reduction_axis=-2,
                                                   output_axis=-1), params)
  return optax.contrib.muon(learning_rate, beta=0.95, nesterov=True,
                            weight_decay=weight_decay, consistent_rms=0.2,
                            muon_weight_dimension_numbers=dims)


def save_carry(path: os.PathLike, carry) -> None:
  """The carry's leaves, atomically, as one .npz."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = harness.temp_path(path)
  np.savez(tmp, *[np.asarray(x) for x in jax.tree.leaves(carry)])
  tmp.replace(path)


def load_carry(path: os.PathLike, like):
  """`save_carry`'s leaves in the structure of `like`."""
  with np.load(path) as f:
    leaves = [jax.numpy.asarray(f[f"arr_{i}"]) for i in range(len(f.files))]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)
