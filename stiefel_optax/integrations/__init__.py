"""Entry points for training frameworks that are configured by files.

Nothing here is imported by ``import stiefel_optax``; each module imports
its framework and is imported by the user (or by the framework's config):

* `stiefel_optax.integrations.levanter`: Levanter / marin
  `OptimizerConfig` choices ``stiefel_attention`` and ``stiefel_muon``
  (importing the module registers them).
* `stiefel_optax.integrations.maxtext`: a `get_optimizer(config,
  learning_rate_schedule)` for MaxText's ``opt_type: stiefel_attention`` /
  ``stiefel_muon``.

docs/families.md ("Config-file frameworks") has the YAML and the lines
each framework needs.
"""
