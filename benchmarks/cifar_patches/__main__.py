"""`python -m benchmarks.cifar_patches`: `python -m benchmarks
cifar_patches` (see the package docstring and `benchmarks.driver`)."""

from benchmarks.cifar_patches import experiment

if __name__ == "__main__":
  experiment.main()
