"""``python -m stiefel_optax.integrations.train_lm --config_path my.yaml``:
Levanter's ``levanter.main.train_lm`` with the ``stiefel_attention`` and
``stiefel_muon`` optimizer choices registered (`integrations.levanter`).
Every argument is Levanter's."""

import stiefel_optax.integrations.levanter  # noqa: F401  (registers them)

if __name__ == "__main__":
  import levanter.config
  from levanter.main import train_lm

  levanter.config.main(train_lm.main)()
