"""`python -m benchmarks.grokking`: `python -m benchmarks grokking` (see
the package docstring and `benchmarks.driver`)."""

from benchmarks.grokking import experiment

if __name__ == "__main__":
  experiment.main()
