"""Benchmarks of stiefel_optax: models, data, paired-seed experiments, speed."""
