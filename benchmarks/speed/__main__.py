"""`python -m benchmarks.speed`: `python -m benchmarks speed` (see the package
docstring, `cli.EXPERIMENT` and `benchmarks.driver`)."""

from benchmarks.speed import cli

if __name__ == "__main__":
  cli.main()
