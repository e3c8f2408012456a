"""`python -m benchmarks.lm`: `python -m benchmarks lm` (see the package
docstring and `benchmarks.driver`)."""

from benchmarks.lm import experiment

if __name__ == "__main__":
  experiment.main()
