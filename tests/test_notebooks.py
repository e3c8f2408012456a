"""Executes notebooks/quickstart.ipynb and checks what it computed.

The code cells run in-process, in order, in one namespace, with matplotlib's
Agg backend: no Jupyter kernel is started, so the test does not depend on
which interpreter a `python3` kernelspec points to, and it reuses this
process's JAX (the same venv that CI creates). How long it takes is not
asserted here: timing belongs in the benchmarks.
"""

import matplotlib
import nbformat
import numpy as np
import pytest

from tests.helpers import ROOT

NOTEBOOKS = ROOT / "notebooks"


def run_notebook(path):
  """Runs the code cells of `path` in a fresh namespace; returns it."""
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  cells = [c for c in nb.cells if c.cell_type == "code"]
  assert cells, f"{path} has no code cell"
  namespace = {"__name__": "__main__"}
  for i, cell in enumerate(cells):
    assert not cell.source.lstrip().startswith(("%", "!")), (
        f"cell {i} uses IPython syntax; keep the notebook plain Python")
    exec(compile(cell.source, f"{path.name}[cell {i}]", "exec"), namespace)
  return namespace


@pytest.fixture(scope="module")
def quickstart():
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  plt.close("all")
  ns = run_notebook(NOTEBOOKS / "quickstart.ipynb")
  yield ns
  plt.close("all")


def test_quickstart_runs(quickstart):
  """Every code cell executed (the fixture) and the run is the documented
  one: at least 200 training steps."""
  assert quickstart["STEPS"] >= 200


def test_quickstart_trains_and_keeps_frames_on_manifold(quickstart):
  steps = quickstart["STEPS"]
  stiefel, adamw = quickstart["stiefel_run"], quickstart["adamw_run"]
  for run in (stiefel, adamw):
    loss = run["loss"]
    assert loss.shape == (steps,) and np.all(np.isfinite(loss))
    # log(8) ~ 2.08 at chance; reversal is learned.
    assert loss[:5].mean() > 1.5
    assert loss[-20:].mean() < 0.1 * loss[:5].mean(), loss[-20:]
  # One error per query/key frame (2 kernels x HEADS heads), every step.
  heads = quickstart["HEADS"]
  for run in (stiefel, adamw):
    assert sorted(run["isometry"]) == ["block/attn/key/kernel",
                                      "block/attn/query/kernel"]
    assert all(e.shape == (steps, heads) for e in run["isometry"].values())
  assert max(e.max() for e in stiefel["isometry"].values()) <= 1e-5
  assert min(e[-1].min() for e in adamw["isometry"].values()) > 1e-3


def test_quickstart_plots_loss_and_isometry(quickstart):
  fig = quickstart["fig"]
  assert isinstance(fig, matplotlib.figure.Figure)
  ax_loss, ax_iso = fig.axes[:2]
  steps, heads = quickstart["STEPS"], quickstart["HEADS"]
  assert len(ax_loss.get_lines()) == 2
  lines = ax_iso.get_lines()
  assert len(lines) == 2 * 2 * heads                 # 2 runs x 2 kernels x heads
  assert all(len(l.get_ydata()) == steps for l in lines)
  assert ax_iso.get_yscale() == "log"
