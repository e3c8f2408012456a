"""`python -m benchmarks.speed`: see the package docstring and `cli.main`."""

from benchmarks.speed import cli

if __name__ == "__main__":
  cli.main()
