"""pytest (``--doctest-modules`` over stiefel_optax/): the Levanter modules
import Levanter, which the main environment does not have; the
integration suite (integration/) runs them in its own environment."""

collect_ignore = ["levanter.py", "train_lm.py"]
