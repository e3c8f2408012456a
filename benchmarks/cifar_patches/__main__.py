"""`python -m benchmarks.cifar_patches`: see the package docstring and
`cli.main`."""

from benchmarks.cifar_patches import cli

if __name__ == "__main__":
  cli.main()
