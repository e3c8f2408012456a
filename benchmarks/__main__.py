"""`python -m benchmarks <experiment> [options]`: one driver for every
experiment (`benchmarks.driver`); each experiment's record is its
module's `EXPERIMENT` (a study's `<package>.experiment`, the speed tables'
`speed.cli`, the drift run's `long_run`), imported only when named."""

import importlib

from benchmarks import driver


def _record(module: str):
  return lambda: importlib.import_module(f"benchmarks.{module}").EXPERIMENT


EXPERIMENTS = {name: _record(module) for name, module in (
    ("grokking", "grokking.experiment"), ("lm", "lm.experiment"),
    ("cifar_patches", "cifar_patches.experiment"), ("speed", "speed.cli"),
    ("long_run", "long_run"))}

if __name__ == "__main__":
  driver.main(EXPERIMENTS)
