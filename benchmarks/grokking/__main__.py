"""`python -m benchmarks.grokking`: see the package docstring and
`cli.main`."""

from benchmarks.grokking import cli

if __name__ == "__main__":
  cli.main()
