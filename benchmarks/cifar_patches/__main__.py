"""`python -m benchmarks.cifar_patches`: see the package docstring and
`main`."""

from benchmarks import cifar_patches

if __name__ == "__main__":
  cifar_patches.main()
