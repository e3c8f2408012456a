"""CIFAR-10 for the patch benchmark: the official python-version batches,
the lossless subset (an .npz, e.g. ../shared/data/cifar10-subset.npz), or
tiny synthetic images; the validation split carved from the training
images, and each seed's paired stream (its training subset and batch
order, the same for every arm).

    ds = load_cifar10()                       # $CIFAR10_DIR, else the subset
    ds = load_cifar10("path/cifar10-subset.npz")     # any source: an .npz,
    ds = load_cifar10("~/data")               # a folder holding cifar-10-batches-py/
    ds = load_cifar10("~/data", download_missing=True)   # fetch the tarball

Every `Dataset` records in `source` which data it holds by content, never by
location: 'full:md5=<md5>' (md5 of the six batch files' md5s),
'subset:md5=<the .npz file's md5>' or 'synthetic:<seed>:md5=<arrays' md5>'.
`location` says where it was read from (for messages only; never recorded).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import pickle
import tarfile
import urllib.request
from typing import NamedTuple, Optional

import numpy as np

from benchmarks import harness
from benchmarks.cifar_patches.config import Config

ENV_VAR = "CIFAR10_DIR"
FOLDER = "cifar-10-batches-py"
TARBALL = "cifar-10-python.tar.gz"
TARBALL_URL = "https://www.cs.toronto.edu/~kriz/" + TARBALL
TARBALL_MD5 = "c58f30108f718f92721af3b95e74349a"
TRAIN_FILES = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
}
TEST_FILES = {"test_batch": "40351d587109b95175f43aff81a1287e"}
SUBSET_NAME = "cifar10-subset.npz"
SUBSET_MD5 = "d26b63af856610ac67efd3ae4cff67e3"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
           "horse", "ship", "truck")


class Dataset(NamedTuple):
  """uint8 images (N, 32, 32, 3) HWC RGB, uint8 labels (N,), `source` (the
  content id: kind and md5) and `location` (where it was read, or '')."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  source: str
  location: str = ""


def md5sum(path: os.PathLike, chunk: int = 1 << 20) -> str:
  h = hashlib.md5()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(chunk), b""):
      h.update(block)
  return h.hexdigest()


def check_md5(path: os.PathLike, expected: str, got: Optional[str] = None) -> str:
  """The file's md5 (given or computed), which must equal `expected`."""
  got = got or md5sum(path)
  if got != expected:
    raise ValueError(f"{path}: md5 {got}, expected {expected}; the file is"
                     " corrupt or not the official CIFAR-10 file.")
  return got


def batches_dir(data_dir: os.PathLike) -> pathlib.Path:
  """`data_dir` itself if it is the batches folder, else data_dir/FOLDER."""
  p = pathlib.Path(data_dir).expanduser()
  return p if p.name == FOLDER else p / FOLDER


def missing_files(folder: pathlib.Path) -> list[str]:
  names = list(TRAIN_FILES) + list(TEST_FILES)
  return [n for n in names if not (folder / n).is_file()]


def download(data_dir: os.PathLike, url: str = TARBALL_URL) -> pathlib.Path:
  """Downloads the official tarball into data_dir, checks its md5 and
  extracts cifar-10-batches-py/. Returns the batches folder."""
  root = pathlib.Path(data_dir).expanduser()
  root.mkdir(parents=True, exist_ok=True)
  tar_path = root / TARBALL
  if not tar_path.is_file():
    urllib.request.urlretrieve(url, tar_path)
  check_md5(tar_path, TARBALL_MD5)
  with tarfile.open(tar_path, "r:gz") as tar:
    members = [m for m in tar.getmembers() if m.name.startswith(FOLDER + "/")]
    tar.extractall(root, members=members)
  return root / FOLDER


def read_batch(path: os.PathLike) -> tuple[np.ndarray, np.ndarray]:
  """One python-version batch: (N, 3072) CHW rows -> (N, 32, 32, 3) uint8."""
  with open(path, "rb") as f:
    d = pickle.load(f, encoding="bytes")
  data = np.asarray(d[b"data"], dtype=np.uint8)
  x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(x), np.asarray(d[b"labels"], dtype=np.uint8)


def write_batch(path: os.PathLike, x: np.ndarray, y: np.ndarray) -> None:
  """Writes images in the python-version batch format (for tests)."""
  data = np.asarray(x, np.uint8).transpose(0, 3, 1, 2).reshape(len(x), -1)
  with open(path, "wb") as f:
    pickle.dump({b"data": data, b"labels": [int(v) for v in y]}, f)


def load_batches(data_dir: os.PathLike, *, verify_md5: bool = True) -> Dataset:
  """Reads cifar-10-batches-py/ (data_batch_1..5, test_batch).

  Raises FileNotFoundError naming each missing file, ValueError on an md5
  mismatch (verify_md5=False skips the check, e.g. for test fixtures).
  """
  folder = batches_dir(data_dir)
  missing = missing_files(folder)
  if missing:
    raise FileNotFoundError(
        f"CIFAR-10 folder {folder} lacks {', '.join(missing)}. Put the"
        f" extracted {TARBALL} there, pass download=True (--download), or"
        f" give the subset's .npz (--data PATH).")
  parts, md5s = {}, []
  for name, md5 in {**TRAIN_FILES, **TEST_FILES}.items():
    got = md5sum(folder / name)
    if verify_md5:
      check_md5(folder / name, md5, got)
    md5s.append(f"{name} {got}")
    parts[name] = read_batch(folder / name)
  x_tr = np.concatenate([parts[n][0] for n in TRAIN_FILES])
  y_tr = np.concatenate([parts[n][1] for n in TRAIN_FILES])
  x_te, y_te = parts["test_batch"]
  digest = hashlib.md5("\n".join(md5s).encode()).hexdigest()
  return Dataset(x_tr, y_tr, x_te, y_te, f"full:md5={digest}", str(folder))


def default_subset_path() -> pathlib.Path:
  """../shared/data/cifar10-subset.npz relative to the repository root."""
  return harness.REPO.parent / "shared" / "data" / SUBSET_NAME


def load_subset(path: Optional[os.PathLike] = None, *,
                verify_md5: bool = True) -> Dataset:
  """The lossless subset (8,068 train / 1,017 test images)."""
  path = (pathlib.Path(path).expanduser() if path is not None
          else default_subset_path())
  if not path.is_file():
    raise FileNotFoundError(
        f"{path} not found: neither a CIFAR-10 folder (--data PATH or"
        f" ${ENV_VAR}) nor the subset {SUBSET_NAME} is available.")
  got = md5sum(path)
  if verify_md5:
    check_md5(path, SUBSET_MD5, got)
  with np.load(path) as z:
    return Dataset(z["x_train"], z["y_train"], z["x_test"], z["y_test"],
                   f"subset:md5={got}", str(path))


def load_cifar10(data: Optional[os.PathLike] = None, *,
                 download_missing: bool = False,
                 subset_path: Optional[os.PathLike] = None,
                 verify_md5: bool = True) -> Dataset:
  """Any CIFAR-10 source: `data` (else $CIFAR10_DIR) is the subset's .npz
  file, the cifar-10-batches-py folder or a folder holding it; with neither,
  the subset at `subset_path` (default ../shared/data beside the repository).

  A folder that is given but incomplete is an error (naming the missing
  files) unless download_missing, which fetches the official tarball.
  """
  data = data or os.environ.get(ENV_VAR) or None
  if data is None:
    return load_subset(subset_path, verify_md5=verify_md5)
  path = pathlib.Path(data).expanduser()
  if path.is_file() or path.suffix == ".npz":
    return load_subset(path, verify_md5=verify_md5)
  if download_missing and missing_files(batches_dir(path)):
    download(batches_dir(path).parent)
  return load_batches(path, verify_md5=verify_md5)


def synthetic(n_train: int = 512, n_test: int = 128, seed: int = 0) -> Dataset:
  """Tiny learnable images: each class is a fixed random low-frequency
  pattern plus noise. Same dtypes and shapes as CIFAR-10."""
  rng = np.random.default_rng(seed)
  protos = rng.normal(size=(len(CLASSES), 8, 8, 3))
  protos = np.repeat(np.repeat(protos, 4, axis=1), 4, axis=2)

  def make(n):
    y = rng.integers(0, len(CLASSES), n)
    x = 128 + 50 * protos[y] + 25 * rng.normal(size=(n, 32, 32, 3))
    return np.clip(x, 0, 255).astype(np.uint8), y.astype(np.uint8)

  x_tr, y_tr = make(n_train)
  x_te, y_te = make(n_test)
  md5 = harness.md5_arrays(x_tr, y_tr, x_te, y_te)
  return Dataset(x_tr, y_tr, x_te, y_te, f"synthetic:{seed}:md5={md5}")


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and std of uint8 images, in [0, 1] units."""
  xf = np.asarray(x, np.float64) / 255.0
  return (xf.mean(axis=(0, 1, 2)).astype(np.float32),
          xf.std(axis=(0, 1, 2)).astype(np.float32))


# --------------------------------------------------------------------------
# The validation split and the paired streams.


def validation_split(n_train: int, cfg: Config):
  """(pool, val) indices: a fixed random val split of the training images."""
  perm = np.random.default_rng(cfg.val_seed).permutation(n_train)
  return np.sort(perm[cfg.val_size:]), np.sort(perm[:cfg.val_size])


def seed_stream(seed: int, pool: np.ndarray, n: int, cfg: Config):
  """The training subset (n of pool) and the per-epoch batch order for
  `seed`: the same for every arm. Returns idx (epochs, steps, batch)."""
  if n > len(pool):
    raise ValueError(f"n = {n} exceeds the {len(pool)} training images.")
  if n < cfg.batch:
    raise ValueError(f"n = {n} is smaller than a batch ({cfg.batch}).")
  rng = np.random.default_rng(seed)
  subset = pool[rng.permutation(len(pool))[:n]]
  steps = n // cfg.batch
  order = [subset[rng.permutation(n)[:steps * cfg.batch]] for _ in range(cfg.epochs)]
  return np.stack(order).reshape(cfg.epochs, steps, cfg.batch).astype(np.int32)
