"""The API reference (docs/) builds with no warning, reads as a user sees
it, its pages' examples run, and it documents exactly
`stiefel_optax.__all__`.

The build runs Sphinx in a child process with this interpreter
(sys.executable) into a temporary folder, once per test session:

    python -m sphinx -W --keep-going -b html docs <tmpdir>

and the tests below open the built HTML: the signatures show plain
defaults (no sentinel or Sphinx-internal text), each parameter has its own
description, and the Markdown pages (docs/*.md, read by MyST) are pages of
the site, the families guide linked from the index.

The docstrings' own examples run as the suite's doctests
(--doctest-modules over stiefel_optax/); the examples on the pages
(docs/*.rst) run here, with Python's doctest; the ```python blocks of
docs/*.md run in tests/test_readme_snippets.py.
"""

from __future__ import annotations

import doctest
import html
import inspect
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import stiefel_optax

from tests.helpers import ROOT, once_per_session

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.rst"))
MD_PAGES = sorted(DOCS.glob("*.md"))
# Names documented by an autodoc or py directive on docs/api.rst.
DIRECTIVE = re.compile(
    r"^\.\. (?:auto)?(?:function|class|data|exception)::\s+"
    r"(?:stiefel_optax\.)?(\w+)\s*$", re.M)
# The pages whose examples (>>>) this file runs, and the pages that hold
# none: api.rst's examples are in the docstrings (run by --doctest-modules),
# the others are prose, math and tables. A page that loses its examples, or
# a new page, has to be placed here, so no page passes by running nothing.
EXAMPLE_PAGES = {"index.rst", "proofs.rst"}
NO_EXAMPLE_PAGES = {"api.rst", "changelog.rst", "performance.rst"}
# Text that only a leak of the implementation puts in a signature: the
# sentinels of `stiefel_attention` (attention.py), Sphinx's wrappers of
# preserved defaults and of aliased annotations, a default without a repr.
LEAKS = ("_DefaultFloat", "_Default(", "TypeAliasForwardRef", "ForwardRef(",
         "DefaultValue", " object at 0x")
# An object's signature (<dt>) and its description (<dd>), up to the next.
SIGNATURE = re.compile(
    r'<dt class="sig sig-object py" id="stiefel_optax\.(\w+)">(.*?)</dt>'
    r'\s*<dd>(.*?)(?=<dt class="sig sig-object py"|\Z)', re.S)
PARAMETERS = re.compile(
    r'Parameters<span class="colon">:</span></dt>\s*<dd[^>]*>(.*?)</dd>',
    re.S)
PARAMETER = re.compile(r"<strong>(\w+)</strong> – (.*?)</p>", re.S)
MD_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def documented_names() -> list:
  return DIRECTIVE.findall((DOCS / "api.rst").read_text())


def _text(fragment: str) -> str:
  """What a reader sees of an HTML fragment: no tags, entities decoded,
  whitespace collapsed, no permalink marks."""
  text = html.unescape(re.sub(r"<[^>]+>", "", fragment)).replace("\u00b6", "")
  return re.sub(r"\s+", " ", text).strip()


def _build(out: pathlib.Path) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "html", str(DOCS), str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  return {"returncode": proc.returncode, "html": str(out),
          "log": proc.stdout[-3000:] + proc.stderr[-6000:]}


@pytest.fixture(scope="module")
def site(tmp_path_factory, worker_id):
  """The built site's folder (built once per session, across workers)."""
  if worker_id == "master":
    out = tmp_path_factory.mktemp("docs") / "html"
  else:
    out = tmp_path_factory.getbasetemp().parent / "docs_html"
  built = once_per_session(tmp_path_factory, worker_id, "docs_html",
                           lambda: _build(out))
  assert built["returncode"] == 0, built["log"]
  return pathlib.Path(built["html"])


def _api_objects(site) -> dict:
  """{name: (signature text, description HTML)} of api.html's objects."""
  page = (site / "api.html").read_text(encoding="utf-8")
  return {m.group(1): (_text(m.group(2)), m.group(3))
          for m in SIGNATURE.finditer(page)}


def test_docs_build_without_warnings(site):
  """Sphinx with warnings as errors (the fixture asserts it): a docstring
  whose reST does not parse, an autodoc target that does not import, a
  broken link between pages fail here. Every public name has its entry."""
  page = (site / "api.html").read_text(encoding="utf-8")
  for name in stiefel_optax.__all__:
    assert f'id="stiefel_optax.{name}"' in page, name


def test_signatures_show_plain_defaults(site):
  """No signature on api.html shows a sentinel or Sphinx's internals
  (`weight_decay: float = _DefaultFloat(1e-4)`,
  `TypeAliasForwardRef('optax.ScalarOrSchedule')`), and every default that
  is a sentinel reads as the value it stands for."""
  objects = _api_objects(site)
  page = _text((site / "api.html").read_text(encoding="utf-8"))
  leaks = {leak: page.count(leak) for leak in LEAKS if leak in page}
  assert not leaks, leaks
  sentinels = 0
  for name in FUNCTIONS:
    sig = objects[name][0]
    for param in inspect.signature(getattr(stiefel_optax, name)
                                   ).parameters.values():
      default = param.default
      if type(default).__name__ in ("_DefaultFloat", "_Default"):
        sentinels += 1
        shown = repr(float(default) if isinstance(default, float)
                     else default.value)
        assert re.search(rf"\b{param.name}: [^=]*= {re.escape(shown)}[,)]",
                         sig), (name, param.name, shown, sig)
  assert sentinels >= 8          # stiefel_attention's, at least


def test_each_parameter_has_its_own_description(site):
  """Every public function's Parameters list names each of its parameters
  once, in order, each with a description of its own: a docstring line
  `b1, b2, eps: ...` gives all three the same paragraph."""
  objects = _api_objects(site)
  for name in FUNCTIONS:
    params = list(inspect.signature(getattr(stiefel_optax, name)).parameters)
    field = PARAMETERS.search(objects[name][1])
    items = PARAMETER.findall(field.group(1)) if field else []
    assert [n for n, _ in items] == params, name
    descriptions = [_text(d) for _, d in items]
    same = {d for d in descriptions if descriptions.count(d) > 1}
    assert not same, (name, same)
  # The three that shared one paragraph (written about eps) in
  # stiefel_attention: each now says what it is.
  field = PARAMETERS.search(objects["stiefel_attention"][1]).group(1)
  desc = {n: _text(d) for n, d in PARAMETER.findall(field)}
  assert "first moment" in desc["b1"] and "eps" not in desc["b1"]
  assert "second moment" in desc["b2"] and "eps" not in desc["b2"]
  assert "denominator" in desc["eps"]


def test_markdown_pages_are_in_the_site(site):
  """docs/*.md are pages of the site (MyST): each has its title and its
  ```python blocks as highlighted code, and the index links each; the
  families guide is in the index's table of contents."""
  assert {p.name for p in MD_PAGES} >= {"families.md", "benchmarks.md"}
  index = (site / "index.html").read_text(encoding="utf-8")
  for page in MD_PAGES:
    source = page.read_text(encoding="utf-8")
    built = site / f"{page.stem}.html"
    assert built.is_file(), f"{page.name} is not in the site"
    text = built.read_text(encoding="utf-8")
    title = re.search(r"^# (.+)$", source, re.M).group(1).replace("`", "")
    h1s = [_text(h) for h in re.findall(r"<h1>(.*?)</h1>", text, re.S)]
    assert h1s == [title], (page.name, h1s)
    assert (text.count('<div class="highlight-python')
            == len(MD_BLOCK.findall(source))), page.name
    assert f'href="{page.stem}.html"' in index, (
        f"index.html does not link {page.stem}.html")
  toctree = re.search(r'<div class="toctree-wrapper compound">(.*?)</div>',
                      index, re.S)
  assert toctree and 'href="families.html"' in toctree.group(1)


def _examples(page):
  return doctest.DocTestParser().get_examples(page.read_text(), page.name)


def test_every_page_is_placed():
  """Each docs/*.rst page either holds examples (run below) or is named
  as holding none; a page whose examples vanished fails here."""
  with_examples = {p.name for p in PAGES if _examples(p)}
  assert with_examples == EXAMPLE_PAGES
  assert {p.name for p in PAGES} - with_examples == NO_EXAMPLE_PAGES


@pytest.mark.parametrize("page", sorted(EXAMPLE_PAGES))
def test_page_examples_run(page):
  """Every >>> example on the page runs and prints what it shows."""
  path = DOCS / page
  parser = doctest.DocTestParser()
  test = parser.get_doctest(path.read_text(), {"__name__": "__docs__"},
                            page, str(path), 0)
  runner = doctest.DocTestRunner(
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out = []
  result = runner.run(test, out=out.append)
  assert result.failed == 0, "".join(out)
  assert result.attempted == len(test.examples) > 0, page


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
