"""Sphinx configuration of the stiefel_optax API reference.

Built by tests/test_docs.py (warnings as errors) and by hand with

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import inspect
import os
import re
import sys
import types

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


def _library_modules() -> list:
  """The library's modules that `import stiefel_optax` loads, by name."""
  return sorted((name, module) for name, module in list(sys.modules.items())
                if module is not None and name.startswith("stiefel_optax."))


def _find_constant(name: str):
  """(module name, value) of a module constant of the library, or None."""
  for module_name, module in _library_modules():
    if name in vars(module):
      return module_name, vars(module)[name]
  return None


# `Selector` reads as the one documented name in every signature, however a
# module spells it (`Selector` in its home module, `specs_lib.Selector`
# where imported as a module), also after the modules are regrouped.
for _module_name, _module in _library_modules():
  if vars(_module).get("Selector") is stiefel_optax.Selector:
    autodoc_type_aliases["Selector"] = "stiefel_optax.Selector"
  for _alias, _value in vars(_module).items():
    if (isinstance(_value, types.ModuleType)
        and getattr(_value, "Selector", None) is stiefel_optax.Selector):
      autodoc_type_aliases[f"{_alias}.Selector"] = "stiefel_optax.Selector"

# The module constants that the API page's descriptions name (an upper-case
# name in a docstring that is a number, string or tuple of a library module
# and not itself public), and the defaults' constants: listed with their
# values on the page (api.rst, "Constants": the line |constants| there
# becomes this list), so that each is defined there.
_UPPER = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
_docs = [module.__doc__ or "" for _, module in _library_modules()]
_docs += [getattr(stiefel_optax, n).__doc__ or "" for n in stiefel_optax.__all__]
_named = set(_UPPER.findall("\n".join(_docs)))
_named |= {n for _, module in _library_modules() for n in vars(module)
           if n.startswith("DEFAULT_")}
_constants = []
for _name in sorted(_named - set(stiefel_optax.__all__)):
  _found = _find_constant(_name)
  if _found and isinstance(_found[1], (int, float, str, tuple)):
    _constants.append(f"* ``{_found[0]}.{_name} = {_found[1]!r}``")
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
  found = _find_constant(match.group(1))
  if found is None:
    raise ValueError(f"docs/conf.py: no library module defines"
                     f" {match.group(1)}, which a signature names.")
  return repr(found[1])


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


def _no_builtin_docstring(app, what, name, obj, options, lines):
  """A constant without a docstring of its own (`FRAME_PRESETS`, a tuple)
  would show its type's (`tuple.__doc__`: "Built-in immutable sequence...");
  api.rst describes it instead."""
  del app, name, options
  builtin = inspect.getdoc(type(obj))
  if what == "data" and builtin and lines and (
      lines[0].strip() == builtin.splitlines()[0].strip()):
    lines.clear()


def _constants_list(app, docname, source):
  del app
  if docname == "api":
    source[0] = source[0].replace("\n|constants|\n",
                                  "\n" + "\n".join(_constants) + "\n")


def setup(app):
  app.connect("autodoc-process-signature", _plain_signature)
  app.connect("source-read", _constants_list)
  # Before napoleon (priority 500) reads the lines.
  app.connect("autodoc-process-docstring", _no_builtin_docstring,
              priority=400)
