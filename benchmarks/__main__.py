"""`python -m benchmarks <experiment> [options]`: one driver for every
experiment (`benchmarks.driver`); each experiment's record is its
package's `experiment.EXPERIMENT`, imported only when named."""

import importlib

from benchmarks import driver


def _record(name: str):
  return lambda: importlib.import_module(
      f"benchmarks.{name}.experiment").EXPERIMENT


EXPERIMENTS = {name: _record(name)
               for name in ("grokking", "lm", "cifar_patches")}

if __name__ == "__main__":
  driver.main(EXPERIMENTS)
