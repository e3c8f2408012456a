"""What every benchmark shares: run identity, atomic writes, resumable run
stores, seed lists, the machine record, output folders, the command-line
conventions and the generated sections of RESULTS.md (the study itself,
tuning, plan and runner, is `benchmarks.study`).

Identity. A saved run is reused (not trained again) only if its `identity`
equals `run_identity(config, data)` of the run about to be made (the one
identity every experiment computes, from its configuration as a run records
it, `Config.to_dict()`, and its data's content id): a hash of the
configuration's content, the data's md5 (never its path) and the library's
numerics version (`stiefel_optax.NUMERICS_VERSION`: the release whose
numbers the code reproduces, bumped only when what the library computes
changes). No path or hostname enters it. The hash of the code that
made a run (`code_hash()`: the stiefel_optax and benchmarks sources) is
recorded beside it as provenance only, so committed runs keep matching
while the library changes under one numerics version. A report takes the
runs of the asked configuration and data whatever library version made
them (`RunStore.load_matching`: the identity recomputed from the run's own
numerics version) and says which versions those were.

Names. Every experiment names its runs by one rule, `run_name`: the run's
parts (its arm, and what else sets it apart in its store), its seed and,
where a store holds runs of several configurations, a key to the
configuration and data, spelled by the experiment's `Naming` (grokking:
adamw_seed3; the LM: adamw_seed0_85bd1ed3; CIFAR: adamw__n8068__s0,
tune__stiefel__cap0.1_lr0.3__s1000, adamw__eta0.01__s1000__ce1a92fa).

Outputs. By default every experiment writes under runs/<experiment>/ at the
repository root, which git ignores. The committed reference results under
benchmarks/results/ are rewritten only when `--out` names them.

The command line is the one driver's (`benchmarks.driver`: `python -m
benchmarks <experiment>`); seeds are a list or range (`parse_seeds`: 0-11,
500,501,502, 0-3,7); `--results-md PATH` rewrites the experiment's section
of that RESULTS.md from the raw runs and the notes files, never by hand.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import re
import shlex
import time
from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
RUNS_ROOT = REPO / "runs"
REFERENCE_ROOT = REPO / "benchmarks" / "results"
RESULTS_MD = REPO / "benchmarks" / "RESULTS.md"
POLICY_FILE = REFERENCE_ROOT / "claims_policy.md"
POLICY_HEADING = "## Claims policy"
INDEX_FILE = REFERENCE_ROOT / "index.md"
INDEX_HEADING = "## At a glance"
# Seeds fixed before looking (see the claims policy): a comparison found on
# discovery seeds is a finding only once it holds on the confirmation seeds.
DISCOVERY_SEEDS = tuple(range(12))
CONFIRMATION_SEEDS = tuple(range(500, 512))


# --------------------------------------------------------------------------
# Identity and provenance.


def digest(obj, length: int = 12) -> str:
  """A short sha1 of the JSON of `obj` (keys sorted)."""
  blob = json.dumps(obj, sort_keys=True)
  return hashlib.sha1(blob.encode()).hexdigest()[:length]


def md5_arrays(*arrays: np.ndarray) -> str:
  """md5 of the arrays' dtypes, shapes and bytes (data made in memory)."""
  h = hashlib.md5()
  for a in arrays:
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def library_version() -> str:
  """The installed stiefel_optax release (provenance)."""
  import stiefel_optax  # pylint: disable=g-import-not-at-top
  return stiefel_optax.__version__


def numerics_version() -> str:
  """The release whose numbers the installed library computes (identity)."""
  import stiefel_optax  # pylint: disable=g-import-not-at-top
  return stiefel_optax.NUMERICS_VERSION


def versions() -> dict:
  """What a run records of the library: both of the above."""
  return {"library_version": library_version(),
          "numerics_version": numerics_version()}


def run_identity(config: Mapping, data: str,
                 version: Optional[str] = None) -> str:
  """The run identity: configuration content, data id (its md5) and the
  library's numerics version. Never a path, a hostname or a code hash."""
  return digest({"config": config, "data": data,
                 "version": numerics_version() if version is None
                 else version})


def recorded_version(rec: Mapping) -> str:
  """The numerics version a saved run records (runs older than 0.4.0
  record only their release, which was then the numerics version)."""
  return rec.get("numerics_version", rec.get("library_version", ""))


def matches(rec: Mapping, config: Optional[Mapping] = None,
            data: Optional[str] = None) -> bool:
  """Whether a saved run's identity is that of `config` (default: its own)
  and `data` under the numerics version it records (`recorded_version`)."""
  return rec.get("identity") == run_identity(
      rec.get("config") if config is None else config,
      rec.get("data") if data is None else data, recorded_version(rec))


class Naming(NamedTuple):
  """How an experiment spells its runs' names (`run_name`): the separator
  between the parts, the seed's prefix, and the key that ends the name
  where one store holds runs of several configurations: None (no key),
  "identity" (the first 8 digits of `run_identity`: a new numerics
  version names new runs) or "content" (of the configuration and data
  alone, `digest([config, data], 8)`: the name outlives a numerics
  version, the identity in the record decides reuse)."""
  sep: str = "_"
  seed: str = "seed"
  key: Optional[str] = None


def run_name(parts, seed: Optional[int], naming: Naming = Naming(), *,
             config: Optional[Mapping] = None, data: Optional[str] = None,
             version: Optional[str] = None) -> str:
  """The one rule every experiment names its runs by: its parts (the arm,
  a str, or the arm with what else sets the run apart in its store: its
  stage, tuning point, size or rate), the seed (None: none, a store of one
  tuning seed) and, by `naming.key`, a key to the configuration `config`
  and data id `data` (under `version`, default this library's, for the
  "identity" key), joined by `naming.sep`.

  >>> run_name("adamw", 3)                                     # grokking
  'adamw_seed3'
  >>> lm = Naming(key="content")
  >>> run_name("adamw", 0, lm, config={"arm": "adamw"}, data="d")
  'adamw_seed0_cd004189'
  >>> cifar = Naming("__", "s")
  >>> run_name(("tune", "stiefel", "cap0.1_lr0.3"), 1000, cifar)
  'tune__stiefel__cap0.1_lr0.3__s1000'
  >>> run_name(("adamw", "eta0.01"), 0, cifar._replace(key="identity"),
  ...          config={}, data="d", version="0.4.0")
  'adamw__eta0.01__s0__f20c4082'
  """
  parts = [parts] if isinstance(parts, str) else list(parts)
  if seed is not None:
    parts.append(f"{naming.seed}{seed}")
  if naming.key == "content":
    parts.append(digest([config, data], 8))
  elif naming.key == "identity":
    parts.append(run_identity(config, data, version)[:8])
  elif naming.key is not None:
    raise ValueError(f"Naming.key: None, 'identity' or 'content'; got"
                     f" {naming.key!r}.")
  return naming.sep.join(parts)


@functools.lru_cache(maxsize=None)
def code_hash() -> str:
  """sha256 (16 hex digits) of the stiefel_optax and benchmarks sources
  that are running: provenance, recorded in each run, not identity."""
  import stiefel_optax  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for root in (pathlib.Path(stiefel_optax.__file__).parent,
               pathlib.Path(__file__).parent):
    for path in sorted(root.rglob("*.py")):
      h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
      h.update(path.read_bytes() + b"\0")
  return h.hexdigest()[:16]


def machine() -> dict:
  """CPU count, architecture, platform, Python, jax/jaxlib and backend: no
  hostname."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count())
  return {"cpus": os.cpu_count(), "usable_cpus": usable,
          "arch": platform.machine(), "platform": platform.platform(),
          "python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "backend": jax.default_backend()}


def machine_line(m: Mapping) -> str:
  """One line for a machine record (whichever fields it has)."""
  parts = [m.get("arch"), f"{m['cpus']} CPUs" if m.get("cpus") else None,
           m.get("platform"),
           f"python {m['python']}" if m.get("python") else None,
           (f"jax {m['jax']}" + (f" (jaxlib {m['jaxlib']})" if m.get("jaxlib")
                                 else "")) if m.get("jax") else None,
           f"backend {m['backend']}" if m.get("backend") else None]
  return ", ".join(p for p in parts if p)


def load_average() -> Optional[float]:
  try:
    return float(os.getloadavg()[0])
  except OSError:
    return None


def now_utc() -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def portable(path: os.PathLike) -> str:
  """`path` relative to the repository root (posix) if inside it, else its
  last component: what a committed file may say about a location."""
  p = pathlib.Path(path).resolve()
  try:
    return p.relative_to(REPO).as_posix()
  except ValueError:
    return p.name


PATH_OPTIONS = ("--out", "--data", "--data-dir", "--hp-from", "--results-md")


def command_line(module: str, argv: Sequence[str]) -> str:
  """`python -m module argv...` as a record may keep it: the values of the
  path options made `portable`; a module given with its experiment
  ("benchmarks grokking", the one driver's form) stays two words.

  >>> command_line("benchmarks grokking", ["--preset", "frac0.5"])
  'python -m benchmarks grokking --preset frac0.5'
  """
  out, prev = ["python", "-m", *module.split()], None
  for arg in argv:
    opt, eq, val = arg.partition("=")
    if prev in PATH_OPTIONS:
      arg = portable(arg)
    elif eq and opt in PATH_OPTIONS:
      arg = f"{opt}={portable(val)}"
    out.append(arg)
    prev = arg
  return shlex.join(out)


# --------------------------------------------------------------------------
# Atomic writes and resumable run stores.


def temp_path(path: os.PathLike) -> pathlib.Path:
  """A sibling temporary name that keeps the suffix (np.savez adds .npz)."""
  path = pathlib.Path(path)
  return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def write_text(path: os.PathLike, text: str) -> None:
  """Writes `text` to a temporary sibling, then renames it over `path`."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = temp_path(path)
  tmp.write_text(text)
  os.replace(tmp, path)


def write_json(path: os.PathLike, obj, indent: Optional[int] = None) -> None:
  write_text(path, json.dumps(obj, indent=indent))


# Significant digits of the floats a report derives (`stated_precision`).
REPORT_DIGITS = 10


def stated_precision(obj, digits: int = REPORT_DIGITS):
  """`obj` with every float rounded to `digits` significant digits (lists,
  tuples and dicts recursed), so that a report's derived floats print the
  same on any CPU: numpy's exp and log (geometric means) differ in the last
  ulp between instruction sets (SVML on AVX-512, not on AVX2), a relative
  1e-16 that 10 digits absorb unless a value sits within 1e-16 of a
  rounding boundary."""
  if isinstance(obj, float):
    return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
  if isinstance(obj, dict):
    return {k: stated_precision(v, digits) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [stated_precision(v, digits) for v in obj]
  return obj


def json_value(x):
  """A number or array as a run records it: floats (lists for an array),
  a non-finite float (or None) as None.

  >>> json_value(np.float32(0.5)), json_value([1.0, np.inf]), json_value(None)
  (0.5, [1.0, None], None)
  """
  if x is None:
    return None
  a = np.asarray(x, np.float64)
  if a.ndim:
    return [json_value(v) for v in a]
  return float(a) if np.isfinite(a) else None


def read_json(path: os.PathLike):
  path = pathlib.Path(path)
  return json.loads(path.read_text()) if path.is_file() else None


class RunStore:
  """An experiment's saved runs, <folder>/runs/<name>.json, each written
  atomically and reused only under the same identity."""

  def __init__(self, folder: os.PathLike, indent: Optional[int] = None):
    self.folder = pathlib.Path(folder)
    self.dir = self.folder / "runs"
    self.indent = indent

  def path(self, name: str, suffix: str = ".json") -> pathlib.Path:
    return self.dir / f"{name}{suffix}"

  def load(self, name: str, ident: Optional[str] = None) -> Optional[dict]:
    """The saved record, or None if absent or (given `ident`) made under
    another identity (for resuming: `ident` of the current version)."""
    rec = read_json(self.path(name))
    if rec is None or (ident is not None and rec.get("identity") != ident):
      return None
    return rec

  def load_matching(self, name: str, config: Mapping,
                    data: str) -> Optional[dict]:
    """The saved record if it was made with this configuration and data
    under any library version (for reporting), else None."""
    rec = read_json(self.path(name))
    return rec if rec is not None and matches(rec, config, data) else None

  def save(self, name: str, rec: dict) -> None:
    write_json(self.path(name), rec, self.indent)

  def records(self) -> list:
    """Every saved record, in file-name order."""
    return [json.loads(p.read_text()) for p in sorted(self.dir.glob("*.json"))]


def recorded_data(records: Iterable[dict],
                  preferred: Optional[str] = None) -> Optional[str]:
  """The data id a report of these runs is about, read from what they
  record (no data at hand): `preferred` (the published data) if any run
  used it, else the first (sorted) that a run used; None without runs."""
  ids = sorted({r["data"] for r in records})
  return preferred if preferred in ids else (ids[0] if ids else None)


def finished_runs(records: Iterable[dict], current_version: bool) -> dict:
  """{name: record} of the finished runs (those with their `final`
  results) whose identity checks: under this library's numerics version
  (what a study reuses instead of training again, as RunStore.load with
  the current identity does) or under the version each one records
  (`matches`: what a report shows)."""
  ok = ((lambda r: r.get("identity") == run_identity(r["config"],
                                                      r["data"]))
        if current_version else matches)
  return {r["name"]: r for r in records
          if r.get("final") is not None and ok(r)}


# --------------------------------------------------------------------------
# Seeds and the command line.


def parse_seeds(spec) -> tuple:
  """'0-11' -> (0, ..., 11); '500,501,502'; '0-3,7'; '5' -> (5,).
  Order kept, repeats dropped."""
  if isinstance(spec, int):
    return (spec,)
  if not isinstance(spec, str):
    return tuple(dict.fromkeys(int(s) for s in spec))
  seeds = []
  for part in spec.replace(" ", "").split(","):
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
    if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
      raise ValueError(f"seeds: {spec!r} is not a list or range of seeds"
                       " (e.g. 0-11, 500,501,502 or 0-3,7).")
    seeds += range(int(m[1]), int(m[2] or m[1]) + 1)
  return tuple(dict.fromkeys(seeds))


def format_seeds(seeds: Iterable[int]) -> str:
  """(0, 1, 2, 5) -> '0-2,5' (what parse_seeds reads back)."""
  seeds, out = sorted(set(seeds)), []
  for s in seeds:
    if out and s == out[-1][1] + 1:
      out[-1][1] = s
    else:
      out.append([s, s])
  return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def seeds_type(value: str) -> tuple:
  try:
    return parse_seeds(value)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def seed_block(seed: int) -> str:
  """'confirmation' for seeds from the confirmation range on, else
  'discovery'."""
  return "confirmation" if seed >= CONFIRMATION_SEEDS[0] else "discovery"


def default_out(*parts: str) -> pathlib.Path:
  """runs/<parts...> at the repository root (git-ignored)."""
  return RUNS_ROOT.joinpath(*parts)


# --------------------------------------------------------------------------
# Reports: plots, notes files, generated sections of RESULTS.md.


def markdown_table(header: Sequence[str], align: str,
                   rows: Iterable[Sequence]) -> list:
  """The lines of a markdown table: `header`, the alignment row (one
  character per column of `align`: "l" left, "r" right) and `rows` (cells
  already formatted; str() of anything else; an empty one is "| |").

  >>> markdown_table(["arm", "ms", ""], "lrl", [["adamw", 1.5, ""]])
  ['| arm | ms | |', '|---|---:|---|', '| adamw | 1.5 | |']
  """
  if len(align) != len(header):
    raise ValueError(f"align {align!r} has {len(align)} columns, the header"
                     f" {len(header)}.")
  cell = lambda c: f" {c} " if str(c) else " "      # an empty cell: "| |"
  line = lambda cells: "|" + "|".join(cell(c) for c in cells) + "|"
  marks = {"l": "---", "r": "---:"}
  return ([line(header), "|" + "|".join(marks[a] for a in align) + "|"]
          + [line(r) for r in rows])


def fmt_p(p: float) -> str:
  """A p-value in two significant digits ("n/a": no test)."""
  return "n/a" if not np.isfinite(p) else f"{p:.2g}"


def fmt_t(t: float) -> str:
  """A t statistic ("": no test)."""
  return f"{t:.2f}" if np.isfinite(t) else ""


def fmt_signed(x: float, digits: int) -> str:
  return f"{x:+.{digits}f}" if np.isfinite(x) else "nan"


def fmt_diff(r: Mapping, digits: int, unit: str = "") -> str:
  """A row's treatment - baseline with its 95% CI: '+1.20 pp [+0.30,
  +2.10]'."""
  return (f"{fmt_signed(r['mean_diff'], digits)}{' ' + unit if unit else ''}"
          f" [{fmt_signed(r['ci_low'], digits)},"
          f" {fmt_signed(r['ci_high'], digits)}]")


def fmt_interval(r: Mapping, digits: int) -> str:
  """A row's bootstrap interval (`stats.paired_row`): '[+0.30, +2.10]'."""
  return (f"[{fmt_signed(r['boot_low'], digits)},"
          f" {fmt_signed(r['boot_high'], digits)}]")


def comparison_lines(rows: Sequence[Mapping], metric: str, digits: int = 2,
                     loss_digits: int = 3, size: Optional[str] = None
                     ) -> list:
  """The lines of a paired-comparison table (`stats.comparison_rows`): per
  row the arms, (with `size`, a column so headed holding the row's
  'size'), the seeds, both arms' mean `metric` with their mean training
  loss in brackets where the row has it (the regime each is in),
  treatment - baseline with its 95% CI (and, where the rows have it, the
  bootstrap interval beside), paired t and p, Holm p across the table and
  the seeds the treatment wins."""
  sized = [size] if size else []
  boot = bool(rows) and "boot_low" in rows[0]
  mean = lambda r, role: f"{r['mean_' + role]:.{digits}f}" + (
      f" ({r['loss_' + role]:.{loss_digits}f})" if "loss_" + role in r
      else "")
  return markdown_table(
      ["treatment", "baseline", *sized, "seeds", f"treatment {metric} (train"
       " loss)", f"baseline {metric} (train loss)", "difference [95% CI]",
       *(["bootstrap 95% CI"] if boot else []),
       "t", "p", "p (Holm)", "wins"],
      "ll" + "r" * len(sized) + "lrrl" + "l" * boot + "rrrr",
      [[r["treatment"], r["baseline"], *([r["size"]] if size else []),
        format_seeds(r["seeds"]), mean(r, "treatment"), mean(r, "baseline"),
        fmt_diff(r, digits), *([fmt_interval(r, digits)] if boot else []),
        fmt_t(r["t"]), fmt_p(r["p"]), fmt_p(r["p_holm"]),
        f"{r['wins']}/{r['n']}"]
       for r in rows])


def finding_text(r: Mapping, unit: str, digits: int = 2,
                 size: Optional[str] = None) -> str:
  """One comparison in a sentence: 'stiefel - adamw, n = 1000: +1.20 pp
  [+0.30, +2.10], Holm p = 0.012, wins 7/8' (`size`: the size's name)."""
  where = f", {size} = {r['size']}" if size else ""
  return (f"{r['treatment']} - {r['baseline']}{where}:"
          f" {fmt_diff(r, digits, unit)}, Holm p = {fmt_p(r['p_holm'])}, wins"
          f" {r['wins']}/{r['n']}")


def pyplot():
  """matplotlib.pyplot on the Agg backend (no display)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def label_axes(ax, xlabel: str, ylabel: str, title: str,
               legend_size: int = 8) -> None:
  """The benchmarks' panel style: labels, title, a light grid, a small
  legend."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=legend_size)


def save_figure(fig, path: os.PathLike, dpi: int) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)


def read_notes(path: os.PathLike) -> str:
  """A notes file's text (stripped), '' if there is none."""
  path = pathlib.Path(path)
  return path.read_text().strip() if path.is_file() else ""


def replace_section(text: str, heading: str, body: str) -> str:
  r"""Replaces the '## ' section starting at `heading` (up to the next '## '
  heading) by body, or appends body; other sections are left untouched.
  The body is one section: a second '## ' heading in it would end the
  section there, and the next rewrite would keep its rest twice.

  >>> replace_section("# R\n\n## A\nold\n## B\nb\n", "## A", "## A\nnew")
  '# R\n\n## A\nnew\n\n## B\nb\n'
  """
  inner = [l for l in body.splitlines()[1:] if l.startswith("## ")]
  if inner:
    raise ValueError(f"the section {heading!r} holds another '## ' heading,"
                     f" {inner[0]!r}: make it '### ' so that the section is"
                     " rewritten whole.")
  lines = text.splitlines(keepends=True)
  start = next((i for i, l in enumerate(lines) if l.strip() == heading), None)
  body = body.rstrip("\n") + "\n"
  if start is None:
    sep = "" if not text or text.endswith("\n\n") else (
        "\n" if text.endswith("\n") else "\n\n")
    return text + sep + body
  end = next((i for i in range(start + 1, len(lines))
              if lines[i].startswith("## ")), len(lines))
  tail = "".join(lines[end:])
  return "".join(lines[:start]) + body + ("\n" + tail if tail else "")


def with_policy(text: str, policy: str,
                heading: str = POLICY_HEADING) -> str:
  r"""The claims-policy section (policy, starting with heading) replaced,
  or inserted right after the title (the index's too: INDEX_HEADING).

  >>> t = with_policy("# R\n\n## A\na\n", "## Claims policy\np")
  >>> with_policy(t, "## At a glance\ni", INDEX_HEADING)
  '# R\n\n## At a glance\ni\n\n## Claims policy\np\n\n## A\na\n'
  """
  if any(l.strip() == heading for l in text.splitlines()):
    return replace_section(text, heading, policy)
  lines = text.splitlines(keepends=True)
  title = next((i for i, l in enumerate(lines) if l.startswith("# ")), None)
  if title is None:
    return policy.rstrip("\n") + "\n\n" + text
  rest = "".join(lines[title + 1:]).lstrip("\n")
  return ("".join(lines[:title + 1]) + "\n" + policy.rstrip("\n") + "\n"
          + ("\n" + rest if rest else ""))


def write_section(md_path: os.PathLike, heading: str, body: str) -> None:
  """Rewrites one experiment's section of a RESULTS.md (and at its top the
  index, from INDEX_FILE, then the claims policy, from POLICY_FILE); other
  sections stay as they are."""
  md_path = pathlib.Path(md_path)
  text = md_path.read_text() if md_path.is_file() else "# Benchmark results\n"
  text = replace_section(text, heading, body)
  if POLICY_FILE.is_file():
    text = with_policy(text, POLICY_FILE.read_text())
  if INDEX_FILE.is_file():
    text = with_policy(text, INDEX_FILE.read_text(), INDEX_HEADING)
  write_text(md_path, text)


DIRECTIVE = re.compile(r"^<!-- ([a-z_]+): (.+?) -->$")


def expand(template: str, handlers: Mapping[str, Callable[..., str]]) -> str:
  """A notes template with its directive lines `<!-- name: arg ... -->`
  replaced by handlers[name](*args): text written verbatim around tables
  generated from the raw runs."""
  out = []
  for line in template.splitlines():
    m = DIRECTIVE.match(line.strip())
    out.append(handlers[m[1]](*m[2].split()).rstrip("\n") if m else line)
  return "\n".join(out) + "\n"
