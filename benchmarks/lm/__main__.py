"""`python -m benchmarks.lm`: see the package docstring and `cli.main`."""

from benchmarks.lm import cli

if __name__ == "__main__":
  cli.main()
