"""Sphinx configuration of the stiefel_optax API reference.

Built by tests/test_docs.py (warnings as errors) and by hand with

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import stiefel_optax  # noqa: E402

project = "stiefel_optax"
author = "stiefel_optax developers"
copyright = "2026, stiefel_optax developers"  # pylint: disable=redefined-builtin
version = release = stiefel_optax.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    # `-b doctest` runs the pages' and docstrings' examples.
    "sphinx.ext.doctest",
]

# Google-style docstrings (Args, Returns, Raises, References, Example), as
# optax writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Keep the annotations' names rather than their expansions.
autodoc_type_aliases = {
    "optax.ScalarOrSchedule": "optax.ScalarOrSchedule",
    "chex.Numeric": "chex.Numeric",
    "specs_lib.Selector": "stiefel_optax.specs.Selector",
}
# Literal blocks are math in ASCII, not code: no highlighting.
highlight_language = "none"
# `name` in a docstring links to that object where Sphinx knows it.
default_role = "py:obj"

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []
html_theme_options = {"nosidebar": False}
