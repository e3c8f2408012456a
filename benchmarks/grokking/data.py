"""Modular arithmetic data: every equation (a op b) mod p = c, split by a seed.

Each example is the token sequence [a, b, EQ] with EQ = p (so the vocabulary
has p + 1 tokens) and the label c in [0, p). The data is generated, never
downloaded; the split is a seeded permutation, so seed s gives every arm the
same training and validation sets. Its content id (`data_id`, the md5 of
every equation and label) is part of each run's identity.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from benchmarks import harness

DEFAULT_PRIME = 97
OPS = ("+", "-", "/")


class Split(NamedTuple):
  """Token sequences (n, 3) int32 and labels (n,) int32 of both halves."""
  train_x: np.ndarray
  train_y: np.ndarray
  val_x: np.ndarray
  val_y: np.ndarray


def vocab_size(p: int = DEFAULT_PRIME) -> int:
  """p residues and the '=' token."""
  return p + 1


def apply_op(a: np.ndarray, b: np.ndarray, op: str, p: int) -> np.ndarray:
  """(a op b) mod p; division is a * b^(p-2) mod p (p prime, b != 0)."""
  if op == "+":
    return (a + b) % p
  if op == "-":
    return (a - b) % p
  if op == "/":
    inv = np.array([pow(int(x), p - 2, p) for x in b], dtype=np.int64)
    return (a * inv) % p
  raise ValueError(f"op must be one of {OPS}; got {op!r}.")


def all_equations(p: int = DEFAULT_PRIME, op: str = "+"):
  """All (a, b) pairs (b != 0 for division) as [a, b, EQ] and their labels."""
  a, b = np.meshgrid(np.arange(p), np.arange(p), indexing="ij")
  a, b = a.ravel().astype(np.int64), b.ravel().astype(np.int64)
  if op == "/":
    keep = b != 0
    a, b = a[keep], b[keep]
  c = apply_op(a, b, op, p)
  x = np.stack([a, b, np.full_like(a, p)], axis=1)
  return x.astype(np.int32), c.astype(np.int32)


def split(x: np.ndarray, y: np.ndarray, train_fraction: float,
          seed: int) -> Split:
  """A seeded random split with round(train_fraction * n) training examples."""
  if not 0.0 < train_fraction < 1.0:
    raise ValueError(f"train_fraction must lie in (0, 1); got {train_fraction}.")
  n = x.shape[0]
  perm = np.random.default_rng(seed).permutation(n)
  n_train = int(round(train_fraction * n))
  tr, va = perm[:n_train], perm[n_train:]
  return Split(x[tr], y[tr], x[va], y[va])


def make_split(p: int = DEFAULT_PRIME, op: str = "+",
               train_fraction: float = 0.4, seed: int = 0) -> Split:
  """The equations of (a op b) mod p split for seed `seed`."""
  x, y = all_equations(p, op)
  return split(x, y, train_fraction, seed)


@functools.lru_cache(maxsize=None)
def data_id(p: int, op: str) -> str:
  """The task's content id: md5 of every equation and its label."""
  return f"modular:md5={harness.md5_arrays(*all_equations(p, op))}"


def make_data(cfg, seed: int) -> Split:
  """The seed's split as device arrays (the same for every arm) of the task
  of cfg (a `config.Config`: its p, op and train_fraction)."""
  sp = make_split(cfg.p, cfg.op, cfg.train_fraction, seed)
  return Split(*(jnp.asarray(a) for a in sp))
