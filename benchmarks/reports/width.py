"""The learning-rate sweep across widths (issue 43, benchmarks/results/lm/
width_plan.md): from each width's sweep curves (`benchmarks.reports.
robustness.curves`, {width: {arm: {eta: point}}}) to the cross-width
table and its three figures. Each width's own report is the sweep
report's; here what compares them: the sensitivity over the rates common
to every width (the points every width measured, for every arm), beside
each width's own-grid sensitivity; the best eta and loss per width; and
three figures: sensitivity against width per arm, best eta against width
per arm, loss against eta (one panel per arm, one curve per width).

A width or an arm without runs is shown as missing (a table cell "missing",
no point in a figure, named under the table), never dropped silently; the
common rates are those of the widths that have runs, and the report says
which widths those are.

>>> pt = lambda m: dict(mean=m, losses=[m], seeds=[0], diverged=[])
>>> cs = {64: {"a": {1e-3: pt(2.0), 1e-2: pt(1.5), 0.1: pt(3.0)}},
...       128: {"a": {1e-2: pt(1.4), 0.1: pt(2.0)}}}
>>> common_rates(cs, ["a"])
(0.01, 0.1)
>>> round(sensitivity(cs[64]["a"], common_rates(cs, ["a"])), 3)  # (0+1.5)/2
0.75
"""

from __future__ import annotations

import math
import pathlib
from typing import Mapping, Optional, Sequence

from benchmarks import harness
from benchmarks.reports.robustness import fmt_eta, summary

MISSING = "missing"


def common_rates(cs: Mapping, arms: Sequence[str]) -> tuple:
  """The rates every width with runs measured for every arm it has run
  (ascending)."""
  sets = [set(c[a]) for c in cs.values() if c for a in arms if a in c]
  return tuple(sorted(set.intersection(*sets))) if sets else ()


def sensitivity(curve: Mapping, rates: Sequence[float]) -> Optional[float]:
  """Wortsman et al.'s sensitivity over `rates` (mean of min(L, L0) - min
  L, the capped means of the curve's points there); None without them."""
  if not rates or any(e not in curve for e in rates):
    return None
  return summary({e: curve[e] for e in rates})["sensitivity"]


def table(cs: Mapping, arms: Sequence[str], widths: Sequence[int],
          rates: Sequence[float]) -> dict:
  """{arm: {width: row or None}}: row {common, own, best_eta, best, n}
  (sensitivity over the common rates and over the width's own grid, its
  best point, its number of points); None where the width has no run of
  the arm; the common sensitivity None where the curve lacks one of
  `rates`."""
  out = {}
  for arm in arms:
    out[arm] = {}
    for w in widths:
      curve = (cs.get(w) or {}).get(arm)
      if not curve:
        out[arm][w] = None
        continue
      s = summary(curve)
      out[arm][w] = dict(common=sensitivity(curve, rates),
                         own=s["sensitivity"], best_eta=s["best_eta"],
                         best=s["best"], n=s["n_points"])
  return out


def table_lines(tab: Mapping, widths: Sequence[int]) -> list:
  rows = []
  for arm, by in tab.items():
    for w in widths:
      r = by[w]
      rows.append([arm, f"d {w}"] + ([MISSING] * 4 if r is None else [
          MISSING if r["common"] is None else f"{r['common']:.3f}",
          f"{r['own']:.3f} ({r['n']} pts)", fmt_eta(r["best_eta"]),
          f"{r['best']:.4f}"]))
  return harness.markdown_table(
      ["arm", "width", "sensitivity (common rates)", "sensitivity (own grid)",
       "best eta", "best loss"], "llrrlr", rows)


def tenfold(cs: Mapping, arms: Sequence[str], widths: Sequence[int]) -> dict:
  """The plan's descriptive table: {arm: (eta, {width: mean loss or None})},
  eta ten times the arm's best at the smallest width (None where the arm
  has no run there), the mean capped loss at eta at every width where the
  curve has that point (None where it has not).

  >>> pt = lambda m: dict(mean=m, losses=[m], seeds=[0], diverged=[])
  >>> cs = {64: {"a": {3e-3: pt(1.0), 3e-2: pt(2.0)}}, 256: {"a": {3e-2: pt(3.0)}}}
  >>> tenfold(cs, ["a"], [64, 256])
  {'a': (0.03, {64: 2.0, 256: 3.0})}
  """
  small = cs.get(min(widths)) or {}
  out = {}
  for arm in arms:
    if not small.get(arm):
      out[arm] = (None, {})
      continue
    target = 10 * summary(small[arm])["best_eta"]
    row = {}
    for w in widths:
      curve = (cs.get(w) or {}).get(arm) or {}
      hit = [e for e in curve if math.isclose(e, target, rel_tol=1e-6)]
      row[w] = curve[hit[0]]["mean"] if hit else None
    out[arm] = (target, row)
  return out


def tenfold_lines(ten: Mapping, widths: Sequence[int]) -> list:
  rows = [[arm, MISSING if eta is None else fmt_eta(eta)] + [
      MISSING if by.get(w) is None else f"{by[w]:.4f}" for w in widths]
          for arm, (eta, by) in ten.items()]
  return harness.markdown_table(
      ["arm", f"10 x its d {min(widths)} best eta"]
      + [f"loss at d {w}" for w in widths], "ll" + "r" * len(widths), rows)


def plot_sensitivity(tab: Mapping, widths: Sequence[int], key: str,
                     ylabel: str, path: pathlib.Path, log: bool) -> None:
  """One line per arm against width (a missing width: no point there)."""
  plt = harness.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for arm, by in tab.items():
    ws = [w for w in widths if by[w] is not None and by[w][key] is not None]
    ax.plot(ws, [by[w][key] for w in ws], marker="o", label=arm)
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(widths), [str(w) for w in widths])
  if log:
    ax.set_yscale("log")
  ax.set_xlabel("width d (head_dim 32)")
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  harness.save_figure(fig, path, dpi=110)


def plot_transfer(cs: Mapping, arms: Sequence[str], widths: Sequence[int],
                  path: pathlib.Path) -> None:
  """Loss against eta: one panel per arm, one curve per width."""
  plt = harness.pyplot()
  fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms), 3.8),
                           squeeze=False, sharey=True)
  for ax, arm in zip(axes[0], arms):
    for w in widths:
      curve = (cs.get(w) or {}).get(arm)
      if curve:
        etas = list(curve)
        ax.plot(etas, [curve[e]["mean"] for e in etas], marker="o",
                label=f"d {w}")
    ax.set_xscale("log")
    ax.set_xlabel("eta")
    ax.set_title(arm)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0][0].set_ylabel("final val loss, capped at L0 (mean of seeds)")
  harness.save_figure(fig, path, dpi=110)


def report(out: pathlib.Path, cs: Mapping, arms: Sequence[str],
           widths: Sequence[int], *, heading: str, plan: str,
           left: Mapping, more: Sequence[str] = (),
           figures: str = "") -> dict:
  """Writes out/width.md and its three figures from {width: curves}
  (left: {width: planned sweep runs not finished}; more: lines after the
  figures, e.g. the claims); returns {markdown, section, table, heading}:
  section is the markdown with the figures' links prefixed by `figures`
  (out as the RESULTS.md that holds it sees it)."""
  # A width still running (sweep runs left) does not narrow the common
  # rates: its partial grid would shrink every width's sensitivity.
  rates = common_rates({w: c for w, c in cs.items() if not left.get(w)}, arms)
  tab = table(cs, arms, widths, rates)
  have = [w for w in widths if cs.get(w)]
  missing = [w for w in widths if not cs.get(w)]
  lines = [heading, "", f"Plan (fixed before any run): `{plan}`. Widths"
           f" with runs: {', '.join(f'd {w}' for w in have) or 'none'}"
           + (f"; without any: {', '.join(f'd {w}' for w in missing)}"
              if missing else "")
           + "; planned sweep runs left (a claim's run is not one): "
           + ", ".join(f"d {w} {left.get(w, MISSING)}" for w in widths)
           + ".", "",
           "Rates common to every width with runs, for every arm: "
           + (", ".join(fmt_eta(e) for e in rates) or "none") + ". A width"
           " with sweep runs left does not narrow them.", ""]
  lines += table_lines(tab, widths) + [""]
  gaps = [f"{a} at d {w}" for a, by in tab.items() for w in widths
          if by[w] is None]
  if gaps:
    lines += ["Missing (no run): " + ", ".join(gaps) + ".", ""]
  lines += [f"Descriptive, not a claim: each arm's mean capped loss (tuning"
            f" seeds) at ten times its own best eta at d {min(widths)}, at"
            f" every width (missing where that width's grid lacks the"
            f" point):", ""] + tenfold_lines(tenfold(cs, arms, widths),
                                             widths) + [""]
  plot_sensitivity(tab, widths, "common", "sensitivity over the common rates",
                   out / "width_sensitivity.png", log=False)
  plot_sensitivity(tab, widths, "best_eta", "best eta (tuning seeds)",
                   out / "width_best_eta.png", log=True)
  plot_transfer(cs, arms, widths, out / "width_transfer.png")
  lines += ["![sensitivity against width](FIGURES/width_sensitivity.png)",
            "", "![best eta against width](FIGURES/width_best_eta.png)", "",
            "![loss against eta per width](FIGURES/width_transfer.png)", ""]
  text = "\n".join(lines + list(more)).rstrip("\n") + "\n"
  link = lambda prefix: text.replace("](FIGURES/", f"]({prefix}")
  harness.write_text(out / "width.md", link(""))
  return dict(markdown=link(""), section=link(figures), table=tab,
              heading=heading)
