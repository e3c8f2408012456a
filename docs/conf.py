"""Sphinx configuration of the stiefel_optax API reference.

Built by tests/test_docs.py (warnings as errors) and by hand with

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import inspect
import os
import re
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
    # The Markdown pages (families.md, benchmarks.md), CommonMark + MyST.
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# `page.md#a-heading` links between the Markdown pages resolve (levels 1-3),
# with GitHub's anchors, so the same links work on GitHub and in the site.
myst_heading_anchors = 3
# Their links to repository files outside docs/ (`../benchmarks/RESULTS.md`)
# have no page in the site: they read as their text there (and stay links on
# GitHub). Only those are exempt; a broken link between pages still fails.
_REPO = os.path.abspath("..")
nitpick_ignore_regex = [("myst", re.escape(_REPO) + r"/(?!docs/).+")]

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
    "selector.Selector": "stiefel_optax.Selector",
}
# Literal blocks are math in ASCII, not code: no highlighting.
highlight_language = "none"
# `name` in a docstring links to that object where Sphinx knows it.
default_role = "py:obj"

exclude_patterns = ["_build"]

# The preset lists the pages quote, generated from the tuples themselves so
# that a new preset cannot be left out of the docs.
_names = lambda names: ", ".join(f"``{n!r}``" for n in names)
rst_epilog = f"""
.. |frame_presets| replace:: {_names(stiefel_optax.FRAME_PRESETS)}
.. |gain_presets| replace:: {_names(stiefel_optax.GAIN_PRESETS)}
"""
html_theme = "alabaster"
# Alabaster's fixed 940 px page clips long code lines (the index's key line
# lost its end at 1280 px): a page as wide as the window up to 1400 px, a
# body with no maximum, and code that scrolls instead of clipping
# (_static/wide.css).
html_theme_options = {"nosidebar": False, "page_width": "min(100%, 1400px)",
                      "body_max_width": "none"}
html_static_path = ["_static"]
html_css_files = ["wide.css"]


# Defaults as a user passes them. `autodoc_preserve_defaults` keeps the
# source text of a default (`jnp.float32`, `DEFAULT_MSIGN_STEPS`), which for
# `stiefel_attention` would be its sentinels (`_DefaultFloat(1e-4)`,
# `_Default(None)`: they tell a default from the same value passed); those
# print as their reprs, the plain values. And Sphinx prints an aliased
# annotation inside a union as `TypeAliasForwardRef('optax.ScalarOrSchedule')`:
# it reads as the alias's name.
_SENTINELS = ("_DefaultFloat", "_Default")
_SENTINEL_SOURCE = r"_Default(?:Float)?\((?:[^()]|\([^()]*\))*\)"
_FORWARD_REF = re.compile(r"TypeAliasForwardRef\('([^']*)'\)")


def _defaults(obj) -> dict:
  """A function's own default values (`inspect.signature` would give the
  source-text stand-ins that autodoc_preserve_defaults installs)."""
  code = getattr(obj, "__code__", None)
  if code is None:
    return {}
  positional = code.co_varnames[:code.co_argcount]
  values = obj.__defaults__ or ()
  out = dict(zip(positional[len(positional) - len(values):], values))
  out.update(obj.__kwdefaults__ or {})
  return out


# Module constants a signature may name as a default (the source text that
# `autodoc_preserve_defaults` keeps): shown as their values, so every default
# reads one way, as a user passes it (`max_step_norm=0.1` everywhere).
_CONSTANT = re.compile(r"\b(DEFAULT_[A-Z_]+)\b")


def _constant_value(match):
  for module in (stiefel_optax.aliases, stiefel_optax.muon):
    if hasattr(module, match.group(1)):
      return repr(getattr(module, match.group(1)))
  raise ValueError(f"docs/conf.py: no value for {match.group(1)} in a"
                   " signature: add its module to _constant_value.")


def _plain_signature(app, what, name, obj, options, signature,
                     return_annotation):
  del app, what, name, options
  if signature is None:
    return None
  signature = _CONSTANT.sub(_constant_value, signature)
  for pname, default in _defaults(obj).items():
    if type(default).__name__ in _SENTINELS:
      signature = re.sub(
          rf"(\b{pname}\b[^,=]*=\s*){_SENTINEL_SOURCE}",
          lambda m, d=default: m.group(1) + repr(d), signature)
  signature = _FORWARD_REF.sub(r"\1", signature)
  if return_annotation:
    return_annotation = _FORWARD_REF.sub(r"\1", return_annotation)
  return signature, return_annotation


def setup(app):
  app.connect("autodoc-process-signature", _plain_signature)
