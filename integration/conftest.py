"""The integration suite is not pytest's: `python3 integration/run.py` runs
each case in its framework's own environment. pytest (whose testpaths are
tests/ and stiefel_optax/) collects nothing here even when pointed at it."""

collect_ignore_glob = ["*.py", "cases/*.py"]
