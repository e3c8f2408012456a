"""The closed logit bound's study (issue 52, benchmarks/results/lm_bound/
study_plan.md): what it adds to the cross-width report. Per width, every
arm's largest attention logit against eta beside the certified bound of the
arms that have one (a table and one figure, one panel per width), and the
plan's count (c): of every run of a bounded arm, the per-layer evaluations
whose largest logit exceeds its certified bound.

A bounded arm's certified bound is `so.attention_logit_bound`'s for its
constraint: with orthonormal frames and no norm or q/k bias, every logit
is at most ||g||_inf^2 d / sqrt(head_dim); the box and the fixed gain hold
||g||_inf <= g_max, so d g_max^2 / sqrt(head_dim) at every step (the
sphere's worst case, d^2 / sqrt(head_dim), is no useful count).

>>> b = certified(dict(n_embd=256, n_head=8), "box", 1.0)  # 256 / sqrt(32)
>>> round(b, 4)
45.2548
>>> n, over, ratio = layer_counts([[10.0, 46.0], [None, 45.0]], b)
>>> n, over, round(ratio, 4)          # None (not finite) counts as above
(4, 2, 1.0165)
"""

from __future__ import annotations

import math
import pathlib
from typing import Mapping, Optional, Sequence

import numpy as np

from benchmarks import harness
from benchmarks.reports.robustness import fmt_eta

# float32 rounding of a logit against its bound: the frames' isometry error
# (~1e-6) and a length-d product's rounding (~d x 6e-8 at d 256), the plan's.
RTOL = 2e-5


def certified(cfg: Mapping, constraint: str, g_max: float) -> Optional[float]:
  """The certified bound of a constrained arm's logits (None where the
  constraint certifies no fixed bound)."""
  if constraint not in ("box", "fixed"):
    return None
  return g_max ** 2 * cfg["n_embd"] / math.sqrt(cfg["n_embd"] // cfg["n_head"])


def layer_counts(history: Sequence, bound: float) -> tuple:
  """(per-layer evaluations, those above bound (1 + RTOL), the largest
  logit / bound) of a run's `max_logit` history (per evaluation, a value or
  a per-layer list; None where not finite, counted as above)."""
  vals = [v for ev in history for v in (ev if isinstance(ev, list) else [ev])]
  over = sum(v is None or v > bound * (1 + RTOL) for v in vals)
  finite = [v for v in vals if v is not None]
  return len(vals), over, (max(finite) / bound if finite else math.inf)


def peak(rows: Sequence[Mapping], arm: str, eta: float) -> Optional[float]:
  """The arm's largest recorded logit at eta: max over its tuning seeds,
  evaluations and layers (None without records)."""
  vals = [v for r in rows if r["arm"] == arm and r["eta"] == eta
          for ev in r["record"]["history"].get("max_logit", [])
          for v in (ev if isinstance(ev, list) else [ev]) if v is not None]
  return max(vals) if vals else None


def logit_lines(rows: Mapping, arms: Sequence[str], bounds: Mapping) -> list:
  """Per width, arms by rows and rates by columns: the largest logit
  (`peak`), and the bounded arms' certified bound (bounds {width: {arm:
  bound}})."""
  out = []
  for d, rs in sorted(rows.items()):
    etas = sorted({r["eta"] for r in rs})
    cells = [[a] + [_fmt(peak(rs, a, e)) for e in etas]
             + [_fmt(bounds[d].get(a))] for a in arms
             if any(r["arm"] == a for r in rs)]
    out += [f"d {d}:", ""] + harness.markdown_table(
        ["arm \\ eta"] + [fmt_eta(e) for e in etas] + ["certified bound"],
        "l" + "r" * (len(etas) + 1), cells) + [""]
  return out


def _fmt(v: Optional[float]) -> str:
  return "" if v is None else f"{v:.4g}"


def count_lines(counts: Mapping) -> list:
  """The plan's (c): {(width, arm): [(evaluations, over, ratio) per run]}."""
  cells = []
  for (d, arm), runs in sorted(counts.items()):
    cells.append([f"d {d}", arm, str(len(runs)),
                  str(sum(n for n, _, _ in runs)),
                  str(sum(o for _, o, _ in runs)),
                  f"{max(r for _, _, r in runs):.4f}" if runs else ""])
  return harness.markdown_table(
      ["width", "arm", "runs", "per-layer evaluations",
       f"above the bound (relative tolerance {RTOL:g})",
       "largest logit / bound"], "llrrrr", cells)


def plot_logits(rows: Mapping, arms: Sequence[str], bounds: Mapping,
                path: pathlib.Path) -> None:
  """Largest logit against eta, one panel per width, one line per arm; the
  bounded arms' certified bound dashed."""
  plt = harness.pyplot()
  widths = sorted(rows)
  fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 4),
                           squeeze=False)
  for ax, d in zip(axes[0], widths):
    etas = sorted({r["eta"] for r in rows[d]})
    for i, arm in enumerate(arms):
      ys = [peak(rows[d], arm, e) for e in etas]
      if any(y is not None for y in ys):
        line, = ax.plot(etas, [np.nan if y is None else y for y in ys],
                        marker="o", label=arm, color=f"C{i}")
        if bounds[d].get(arm) is not None:
          ax.axhline(bounds[d][arm], ls="--", color=line.get_color(),
                     label=f"{arm}: certified bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    harness.label_axes(
        ax, "eta", "largest |q.k|/sqrt(hd) (tuning seeds, layers, steps)",
        f"d {d}", legend_size=7)
  harness.save_figure(fig, path, dpi=110)
