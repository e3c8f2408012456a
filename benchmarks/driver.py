"""One driver for every experiment, after nanoGPT's `train.py` +
`configurator.py`: `python -m benchmarks <experiment> [options]` (or the
same options on `python -m benchmarks.<experiment>`). An experiment is a
record (`Experiment`): its `Config` presets, its arms, the options it
takes beyond the common ones, and `run(opts)`, which trains what the
parsed options ask and writes the report; the driver parses, checks and
hands it the options (`Options`), and never imports an experiment itself
(`benchmarks/__main__.py` names them).

One parser (`parser`), one way to override a configuration:
`--set key=value` (repeatable; a key is a field of the experiment's
`Config` or study, `model.dim` a nested one; a comma list sweeps where the
experiment sweeps, e.g. the language model's learning rates), presets
(`--preset NAME`, `--quick` the toy one), seeds (`--seeds 0-4,500`),
`--worker I/N` (this process's share of the runs), `--study`,
`--robustness` (`--sweep NAME`: which of its sweeps; a sweep is not a
`Config` preset, so --preset does not name one), `--report-only`,
`--dry-run`, `--out`. A command that is no study (`speed`, `long_run`)
takes only the common options it names (`Experiment.common`) and adds its
own to the same parser (`Experiment.arguments`).

>>> opts = parse(EXAMPLE, ["--quick", "--set", "lr=0.1", "--seeds", "0-2"])
>>> opts.preset, opts.seeds, opts.overrides
('quick', (0, 1, 2), {'lr': '0.1'})
>>> override(Point(), {"lr": "0.1", "inner.n": "3"})
Point(lr=0.1, steps=10, inner=Inner(n=3))
>>> override(Point(), {"size": "1"})
Traceback (most recent call last):
...
SystemExit: --set size: not a setting (known: inner.n, lr, steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

from benchmarks import harness

# The common options (every experiment's unless its record names fewer:
# `Experiment.common`) and their values where an experiment does not take
# one.
COMMON = {"preset": None, "quick": False, "set": (), "seeds": None,
          "out": None, "report_only": False, "results_md": None,
          "time_budget": 0, "note": "", "quiet": False}
# The options beyond the common ones, each taken by the experiments whose
# record names it (`Experiment.options`).
EXTRA = ("study", "robustness", "sweep", "arms", "worker", "dry_run",
         "data", "download", "hp_from", "probe", "no_plots")


@dataclasses.dataclass(frozen=True)
class Experiment:
  """An experiment as the driver sees it: its name (the package
  benchmarks.<name>), a line of description, its presets (name ->
  Config; `default` the one without --preset or --quick), what --quick
  does, the default seeds (text), the extra options it takes (of EXTRA),
  and run(opts) -> dict: train what the options ask, then report. A
  command that is no study names the common options it takes (`common`,
  of COMMON), adds its own (`arguments(parser)`) and may word the common
  ones' help its own way (`help`: {name: text})."""
  name: str
  summary: str
  presets: Mapping[str, Any]
  default: str
  run: Callable[["Options"], dict]
  quick: str = "the toy size of the same path (under a minute)"
  seeds: str = "0"
  options: tuple = ()
  common: tuple = tuple(COMMON)
  arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
  help: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Options:
  """The parsed command: the experiment's options, its preset (named, or
  quick), the --set overrides {key: text}, the command line as the runs
  record it, log (print, or nothing with --quiet) and the parser (its
  `error`: a usage error, exit status 2)."""
  args: argparse.Namespace
  preset: str
  overrides: Mapping[str, str]
  command: str
  log: Callable
  parser: Optional[argparse.ArgumentParser] = None

  def __getattr__(self, name: str):
    return getattr(self.args, name)

  def error(self, message: str):
    """argparse's usage error: the message on stderr, exit status 2."""
    self.parser.error(message)


def parser(exp: Experiment, prog: str) -> argparse.ArgumentParser:
  """The one parser: the common options, and those of EXTRA the
  experiment takes."""
  p = argparse.ArgumentParser(prog=prog, description=exp.summary)
  quick = (f"--preset quick: {exp.quick}" if "preset" in exp.common
           else exp.quick)
  common = {
      "preset": dict(choices=sorted(exp.presets), default=None,
                     help=f"the configuration (default {exp.default})"),
      "quick": dict(action="store_true", help=quick),
      "set": dict(action="append", default=[], metavar="KEY=VALUE",
                  help="override one setting of the preset (repeatable)"),
      "seeds": dict(type=harness.seeds_type, default=None,
                    help="a list or range, e.g. 0-11, 500-511 or"
                         f" 500,501,502 (default {exp.seeds})"),
      "out": dict(type=pathlib.Path, default=None,
                  help="results folder (default under runs/, ignored by"
                       " git; name a folder under benchmarks/results/ to"
                       " rewrite the committed reference results)"),
      "report_only": dict(action="store_true",
                          help="no training: report the saved runs"),
      "results_md": dict(type=pathlib.Path, default=None,
                         help="also rewrite this experiment's section of"
                              " this RESULTS.md (e.g."
                              " benchmarks/RESULTS.md)"),
      "time_budget": dict(type=float, default=0, metavar="SECONDS",
                          help="stop before a run expected to end past"
                               " this many seconds from the start (0: no"
                               " limit)"),
      "note": dict(default="",
                   help="text written to <out>/notes.md (in every"
                        " report)"),
      "quiet": dict(action="store_true",
                    help="no progress bar or log lines"),
  }
  for name in COMMON:
    if name in exp.common:
      kwargs = dict(common[name])
      kwargs["help"] = exp.help.get(name, kwargs["help"])
      p.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)
  if exp.arguments is not None:
    exp.arguments(p)
  extra = {
      "study": dict(action="store_true",
                    help="the fair study, resumable: every arm tuned, then"
                         " paired discovery and confirmation seeds"),
      "robustness": dict(action="store_true",
                         help="the learning-rate sweep (issue 30),"
                              " resumable"),
      "sweep": dict(default=None, metavar="NAME",
                    help="with --robustness: which of the experiment's"
                         " sweeps (default full; --quick its toy one)"),
      "arms": dict(default=None, help="comma list of arms"),
      "worker": dict(default=None, metavar="I/N",
                     help="train this process's share of the runs (N"
                          " processes sharing --out)"),
      "dry_run": dict(action="store_true",
                      help="print the runs left and their expected time,"
                           " then stop"),
      "data": dict(default=None, help="the data (a path)"),
      "download": dict(action="store_true",
                       help="download the data into --data if missing"),
      "hp_from": dict(type=pathlib.Path, default=None,
                      help="reuse the hyperparameters chosen in this"
                           " results folder (its summary.json)"),
      "probe": dict(type=int, default=0,
                    help="first time this many steps of the first run and"
                         " print the projected wall time"),
      "no_plots": dict(action="store_true", help="no figures"),
  }
  for name in exp.options:
    flags = ["--" + name.replace("_", "-")] + (
        ["--data-dir"] if name == "data" else [])
    p.add_argument(*flags, dest=name, **extra[name])
  return p


def parse(exp: Experiment, argv: Sequence[str],
          prog: Optional[str] = None) -> Options:
  """The options of `argv` for the experiment, checked."""
  prog = prog or f"python -m benchmarks.{exp.name}"
  p = parser(exp, prog)
  args = p.parse_args(list(argv))
  for name, value in COMMON.items():
    if name not in exp.common:
      setattr(args, name, value)
  for name in EXTRA:
    if name not in exp.options:
      setattr(args, name, {"probe": 0}.get(name, None))
  if args.quick and args.preset not in (None, "quick"):
    raise SystemExit("--quick is --preset quick; give one of them.")
  preset = "quick" if args.quick else args.preset or exp.default
  if args.worker is not None:
    check_worker(args.worker)
  overrides = {}
  for item in args.set:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"--set takes KEY=VALUE; got {item!r}.")
    overrides[key.strip().replace("-", "_")] = value.strip()
  args.quick = preset == "quick"
  log = ((lambda *_, **__: None) if args.quiet
         else functools.partial(print, flush=True))
  return Options(args, preset, overrides,
                 harness.command_line(prog.split("python -m ", 1)[-1],
                                      argv), log, p)


def check_worker(spec: str) -> tuple:
  """(I, N) of --worker I/N, 0 <= I < N.

  >>> check_worker("1/2")
  (1, 2)
  """
  try:
    i, n = (int(x) for x in spec.split("/"))
  except ValueError:
    i, n = -1, 0
  if not 0 <= i < n:
    raise SystemExit(f"--worker must be I/N with 0 <= I < N; got {spec!r}.")
  return i, n


def settings(obj) -> dict:
  """{key: field} of a dataclass's settings, nested ones as a.b."""
  out = {}
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      out.update({f"{f.name}.{k}": v for k, v in settings(value).items()})
    else:
      out[f.name] = f
  return out


def value_of(field: dataclasses.Field, current, text: str):
  """text as the field's type (that of its annotation, else of its value):
  int, float, str, bool, a tuple of seeds (ints), or a comma list of names
  where the value holds names (arms)."""
  kind = field.type if isinstance(field.type, str) else getattr(
      field.type, "__name__", str(field.type))
  if "tuple" in kind or isinstance(current, tuple):
    if current and not all(isinstance(v, int) for v in current):
      return tuple(v.strip() for v in text.split(","))   # names: arms
    return harness.parse_seeds(text)
  if text.lower() == "none" and "Optional" in kind:
    return None
  for name, cast in (("bool", lambda t: t.lower() in ("1", "true", "yes")),
                     ("int", int), ("float", float)):
    if name in kind:
      return cast(text)
  return text


def override(obj, overrides: Mapping[str, str]):
  """obj (a frozen dataclass) with the overrides {key: text} applied, a
  nested key as a.b; an unknown key refused."""
  check_settings(overrides, settings(obj))
  return _replace(obj, overrides)


def check_settings(keys, known) -> None:
  """The one refusal of a --set key that is not a setting: SystemExit
  naming the known keys (sorted).

  >>> check_settings(["lr"], ["steps", "lr"])
  >>> check_settings(["size"], ["steps", "lr"])
  Traceback (most recent call last):
  ...
  SystemExit: --set size: not a setting (known: lr, steps).
  """
  for key in keys:
    if key not in known:
      raise SystemExit(f"--set {key}: not a setting (known:"
                       f" {', '.join(sorted(known))}).")


def _replace(obj, overrides: Mapping[str, str]):
  changes = {}
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      inner = {k.split(".", 1)[1]: v for k, v in overrides.items()
               if k.startswith(f.name + ".")}
      if inner:
        changes[f.name] = _replace(value, inner)
    elif f.name in overrides:
      changes[f.name] = value_of(f, value, overrides[f.name])
  return dataclasses.replace(obj, **changes)


def split(overrides: Mapping[str, str], *objs) -> list:
  """The overrides divided among objs (dataclasses): [{key: text} of
  each]; a key none of them has refused."""
  parts = [{} for _ in objs]
  for key, text in overrides.items():
    check_settings([key], [k for o in objs for k in settings(o)])
    owner = next(i for i, o in enumerate(objs) if key in settings(o))
    parts[owner][key] = text
  return parts


def refuse(opts: Options, what: str, where: str,
           names: Sequence[str]) -> None:
  """Refuses the options of `names` (dests, or 'set' for any --set) that
  would quietly change what `what` (e.g. --robustness) fixes in `where`."""
  given = [("--set " + ",".join(opts.overrides)) if n == "set" else
           "--" + n.replace("_", "-") for n in names
           if (opts.overrides if n == "set" else getattr(opts.args, n))]
  if given:
    raise SystemExit(f"{what} fixes its arms, seeds and settings (see"
                     f" {where}); drop {', '.join(given)}.")


def run(exp: Experiment, argv: Optional[Sequence[str]] = None,
        prog: Optional[str] = None) -> dict:
  """Parses argv (default: the process's) for the experiment and runs it;
  under --quick every function `training.jit` builds compiles as a toy
  (`training.toy_compiler`), whichever experiment it is.

  >>> from benchmarks import training
  >>> probe = dataclasses.replace(
  ...     EXAMPLE, run=lambda opts: dict(training.COMPILER_OPTIONS))
  >>> run(probe, ["--quick"]), run(probe, [])
  ({'xla_backend_optimization_level': 0}, {})
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  opts = parse(exp, argv, prog)
  from benchmarks import training  # pylint: disable=g-import-not-at-top
  with training.toy_compiler(getattr(opts.args, "quick", False)):
    return exp.run(opts)


def main(experiments: Mapping[str, Callable[[], Experiment]],
         argv: Optional[Sequence[str]] = None) -> dict:
  """`python -m benchmarks <experiment> [options]`: experiments {name:
  a function returning its record}."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] not in experiments:
    names = ", ".join(experiments)
    print(f"usage: python -m benchmarks {{{names}}} [options]"
          "\n\nOne driver for every experiment; `python -m benchmarks"
          " <experiment> --help` lists its options.", file=sys.stderr)
    raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
  return run(experiments[argv[0]](), argv[1:],
             prog=f"python -m benchmarks {argv[0]}")


# The doctest's experiment.
@dataclasses.dataclass(frozen=True)
class Inner:
  n: int = 1


@dataclasses.dataclass(frozen=True)
class Point:
  lr: float = 1.0
  steps: int = 10
  inner: Inner = Inner()


EXAMPLE = Experiment(name="example", summary="a doctest",
                     presets={"default": Point(), "quick": Point(steps=1)},
                     default="default", run=lambda opts: {})
