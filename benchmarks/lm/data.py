"""The corpus (tiny Shakespeare, nanoGPT's prepare.py) and its batches
(nanoGPT's get_batch)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sys

import jax
import numpy as np

from benchmarks import harness

DEFAULT_DATA = pathlib.Path("..") / "shared" / "data" / "tinyshakespeare.txt"
CORPUS_MD5 = "6fb458f1232090904fb40fe944165e91"


def default_data() -> pathlib.Path:
  return (harness.REPO / DEFAULT_DATA).resolve()


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray   # int32 token ids
  val: np.ndarray
  vocab_size: int
  md5: str

  @property
  def data_id(self) -> str:
    return f"tinyshakespeare:md5={self.md5}"


@functools.lru_cache(maxsize=4)
def load_corpus(path: str) -> Corpus:
  """The corpus at `path`: vocabulary of its sorted characters, 90/10 split
  (nanoGPT's prepare.py). Warns if it is not the published corpus."""
  raw = pathlib.Path(path).read_bytes()
  md5 = hashlib.md5(raw).hexdigest()
  if md5 != CORPUS_MD5:
    print(f"warning: {pathlib.Path(path).name} has md5 {md5}, not tiny"
          f" Shakespeare's {CORPUS_MD5}; the published references do not"
          " apply.", file=sys.stderr)
  text = raw.decode("utf-8")
  chars = sorted(set(text))
  stoi = {c: i for i, c in enumerate(chars)}
  ids = np.array([stoi[c] for c in text], dtype=np.int32)
  n = int(len(ids) * 0.9)
  return Corpus(ids[:n], ids[n:], len(chars), md5)


def get_batch(data: jax.Array, key: jax.Array, batch_size: int,
              block_size: int):
  """nanoGPT's get_batch: `batch_size` random windows and their shifts."""
  ix = jax.random.randint(key, (batch_size,), 0, data.shape[0] - block_size)
  window = lambda i: jax.lax.dynamic_slice(data, (i,), (block_size + 1,))
  w = jax.vmap(window)(ix)
  return w[:, :-1], w[:, 1:]
