"""The API reference (docs/) builds with no warning, its pages' examples
run, and it documents exactly `stiefel_optax.__all__`.

The build runs Sphinx in a child process with this interpreter
(sys.executable) into a temporary folder:

    python -m sphinx -W --keep-going -b html docs <tmpdir>

The docstrings' own examples run as the suite's doctests
(--doctest-modules over stiefel_optax/); the examples on the pages
(docs/*.rst) run here, with Python's doctest.
"""

from __future__ import annotations

import doctest
import inspect
import os
import re
import subprocess
import sys
import types

import pytest

import stiefel_optax

from tests.helpers import ROOT

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.rst"))
# Names documented by an autodoc or py directive on docs/api.rst.
DIRECTIVE = re.compile(
    r"^\.\. (?:auto)?(?:function|class|data|exception)::\s+"
    r"(?:stiefel_optax\.)?(\w+)\s*$", re.M)


def documented_names() -> list:
  return DIRECTIVE.findall((DOCS / "api.rst").read_text())


def test_docs_build_without_warnings(tmp_path):
  """Sphinx with warnings as errors: a docstring whose reST does not parse,
  an autodoc target that does not import, a broken cross-document link
  fail here."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "html", str(DOCS), str(tmp_path / "html")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  html = (tmp_path / "html" / "api.html").read_text()
  for name in stiefel_optax.__all__:
    assert f'id="stiefel_optax.{name}"' in html, name


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run(page):
  """Every >>> example on the docs pages runs and prints what it shows."""
  parser = doctest.DocTestParser()
  test = parser.get_doctest(page.read_text(), {"__name__": "__docs__"},
                            page.name, str(page), 0)
  runner = doctest.DocTestRunner(
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out = []
  runner.run(test, out=out.append)
  assert runner.failures == 0, "".join(out)


def test_all_is_what_the_docs_document():
  """__all__ lists each name once, and docs/api.rst documents exactly
  those names, in the same groups and order: a new public name without
  docs (or a documented name not exported) fails here."""
  names = stiefel_optax.__all__
  assert len(set(names)) == len(names), [n for n in names if
                                         names.count(n) > 1]
  assert documented_names() == list(names)
  for name in names:
    assert hasattr(stiefel_optax, name), name


def test_every_public_name_is_in_all():
  """Every name the package exposes (not a submodule, not private) is in
  __all__, so it is also documented."""
  public = {name for name, value in vars(stiefel_optax).items()
            if not name.startswith("_")
            and not isinstance(value, types.ModuleType)}
  assert public == set(stiefel_optax.__all__), (
      f"not in __all__: {sorted(public - set(stiefel_optax.__all__))};"
      f" in __all__ but absent: {sorted(set(stiefel_optax.__all__) - public)}")


FUNCTIONS = [n for n in stiefel_optax.__all__
             if inspect.isfunction(getattr(stiefel_optax, n))]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_functions_are_documented_in_optax_form(name):
  """Each public function's docstring has Args (when it takes arguments),
  Returns and an Example that runs (a doctest)."""
  fn = getattr(stiefel_optax, name)
  doc = inspect.getdoc(fn) or ""
  if inspect.signature(fn).parameters:
    assert "\nArgs:\n" in doc, name
  assert "\nReturns:\n" in doc, name
  assert re.search(r"\nExamples?\b.*:\n", doc), name
  assert ">>> " in doc, name


def test_one_version_literal():
  """pyproject.toml takes its version from stiefel_optax.__version__; the
  numerics identity is a separate constant."""
  text = (ROOT / "pyproject.toml").read_text()
  project = text.split("[project]", 1)[1].split("\n[", 1)[0]
  assert not re.search(r'(?m)^version\s*=', project)
  assert 'dynamic = ["version"]' in text
  assert 'attr = "stiefel_optax.__version__"' in text
  assert re.fullmatch(r"\d+\.\d+\.\d+", stiefel_optax.__version__)
  assert re.fullmatch(r"\d+\.\d+\.\d+", stiefel_optax.NUMERICS_VERSION)
  assert (f"numerics {stiefel_optax.NUMERICS_VERSION}"
          in (ROOT / "CHANGELOG.md").read_text())
