"""The learning-rate robustness report (issue 30): from a sweep's finished
runs (rows {arm, eta, seed, record}) to each arm's curve of final loss
against the base learning rate eta, its best point, its learning-rate
sensitivity and its range within 0.05 of its best, the max-logit records
beside their bound, the Stiefel arms' step records, two plots and the
markdown. Any benchmark whose records carry `history` (step, val_loss,
max_logit, logit_bound, step_norm, cap_binds) and `final` (`loss_key`)
reads the same way; the benchmark hands in what is its own (which loss,
its words, its name, the arms whose step records are tabulated).

A run that diverged (record["stopped"]) or whose final loss is not finite
counts at its initial loss L0 (the first evaluation's validation loss), and
every loss at min(L, L0) (Wortsman et al. 2023, arXiv 2309.14322). The
sensitivity of an arm over the grid G is theirs,

    S = mean over eta in G of min(L(eta), L0) - min over eta of L(eta),

L(eta) the mean over the tuning seeds at eta, here over the points of G
where the arm has runs (the report says how many).

>>> rec = lambda loss, stopped=None: dict(final=dict(val_loss_full=loss),
...     stopped=stopped, history=dict(val_loss=[4.0]))
>>> rows = [dict(arm="a", eta=e, seed=0, record=rec(l))
...         for e, l in ((0.1, 2.0), (0.3, 1.5), (1.0, 9.0))]
>>> c = curves(rows, "val_loss_full")
>>> s = summary(c["a"])
>>> s["best_eta"], s["best"], round(s["sensitivity"], 4)  # (0.5+0+2.5)/3
(0.3, 1.5, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Mapping, Optional, Sequence

import numpy as np

from benchmarks import harness, stats

WITHIN = 0.05   # the range of rates within this much of an arm's best


def initial_loss(rec: Mapping) -> float:
  return rec["history"]["val_loss"][0]


def capped_loss(rec: Mapping, loss_key: str) -> float:
  """min(L, L0); L0 for a diverged run or a non-finite L."""
  l0 = initial_loss(rec)
  loss = (rec.get("final") or {}).get(loss_key)
  if rec.get("stopped") or loss is None or not math.isfinite(loss):
    return l0
  return min(loss, l0)


def curves(rows: Sequence[Mapping], loss_key: str) -> dict:
  """{arm: {eta: {mean, losses, seeds, diverged: [(seed, step), ...]}}},
  arms and rates in the rows' order and ascending eta."""
  out: dict = {}
  for r in rows:
    pt = out.setdefault(r["arm"], {}).setdefault(
        r["eta"], dict(losses=[], seeds=[], diverged=[]))
    pt["losses"].append(capped_loss(r["record"], loss_key))
    pt["seeds"].append(r["seed"])
    if r["record"].get("stopped"):
      pt["diverged"].append((r["seed"],
                             r["record"]["stopped"]["diverged_at"]))
  for arm, pts in out.items():
    out[arm] = {e: dict(pts[e], mean=float(np.mean(pts[e]["losses"])))
                for e in sorted(pts)}
  return out


def summary(curve: Mapping) -> dict:
  """An arm's best point, sensitivity and range within WITHIN of its best
  (the contiguous grid span around the best point)."""
  etas = list(curve)
  means = [curve[e]["mean"] for e in etas]
  i = int(np.argmin(means))
  lo = hi = i
  while lo > 0 and means[lo - 1] <= means[i] + WITHIN:
    lo -= 1
  while hi < len(etas) - 1 and means[hi + 1] <= means[i] + WITHIN:
    hi += 1
  return dict(best_eta=etas[i], best=means[i],
              sensitivity=float(np.mean(means) - means[i]),
              n_points=len(etas), range=(etas[lo], etas[hi]),
              decades=math.log10(etas[hi] / etas[lo]),
              diverged=sum(len(curve[e]["diverged"]) for e in etas),
              runs=sum(len(curve[e]["losses"]) for e in etas))


def adamw_points(curve: Mapping) -> tuple:
  """(AdamW's best eta, the highest eta where it finishes on every seed
  run there): where the logit records are compared."""
  best = summary(curve)["best_eta"]
  fin = [e for e, p in curve.items() if not p["diverged"]]
  return best, max(fin) if fin else best


def layer_max(v):
  """A per-layer record's max over its finite layers (None: none finite)."""
  if not isinstance(v, list):
    return v
  finite = [x for x in v if x is not None]
  return max(finite) if finite else None


def history_of(rows: Sequence[Mapping], arm: str, eta: float,
               key: str) -> list:
  """[(seed, steps, values)] of the arm's runs at eta for a history key
  (values per evaluation; a per-layer list reduced by its max)."""
  out = []
  for r in rows:
    if r["arm"] == arm and r["eta"] == eta:
      h = r["record"]["history"]
      vals = [layer_max(v) for v in h.get(key, [None] * len(h["step"]))]
      out.append((r["seed"], h["step"], vals))
  return out


def step_records(rows: Sequence[Mapping], arm: str) -> dict:
  """{eta: (mean cap-binding fraction or None, mean step norm)} over the
  arm's runs and their chunks (each chunk's per-step means, equal weight)."""
  out: dict = {}
  for r in rows:
    if r["arm"] != arm:
      continue
    h = r["record"]["history"]
    for key in ("cap_binds", "step_norm"):
      vals = [v for v in h.get(key, []) if v is not None]
      out.setdefault(r["eta"], {}).setdefault(key, []).extend(vals)
  return {e: tuple(float(np.mean(d[k])) if d.get(k) else None
                   for k in ("cap_binds", "step_norm"))
          for e, d in sorted(out.items())}


def fmt_eta(eta: float) -> str:
  return f"{eta:g}"


def curve_table(cs: Mapping) -> list:
  """Arms by rows, rates by columns: the mean capped loss (n seeds;
  diverged runs marked d)."""
  etas = sorted({e for c in cs.values() for e in c})
  rows = []
  for arm, c in cs.items():
    cells = []
    for e in etas:
      p = c.get(e)
      cells.append("" if p is None else f"{p['mean']:.3f}"
                   + (f" ({len(p['diverged'])}d/{len(p['losses'])})"
                      if p["diverged"] else ""))
    rows.append([arm] + cells)
  return harness.markdown_table(["arm \\ eta"] + [fmt_eta(e) for e in etas],
                                "l" + "r" * len(etas), rows)


def summary_table(cs: Mapping) -> list:
  rows = []
  for arm, c in cs.items():
    s = summary(c)
    rows.append([arm, fmt_eta(s["best_eta"]), f"{s['best']:.4f}",
                 f"{s['sensitivity']:.3f} ({s['n_points']} pts)",
                 f"{fmt_eta(s['range'][0])} - {fmt_eta(s['range'][1])}"
                 f" ({s['decades']:.1f} decades)",
                 f"{s['diverged']}/{s['runs']}"])
  return harness.markdown_table(
      ["arm", "best eta", "best loss", "sensitivity", f"within {WITHIN}",
       "diverged"], "llrrll", rows)


def logit_table(rows: Sequence[Mapping], cs: Mapping,
                etas: Sequence[float]) -> list:
  """Per arm and eta: the last and the largest recorded max logit (max over
  layers, mean over seeds) and the bound at the last evaluation."""
  out = []
  for eta in etas:
    for arm in cs:
      logit = history_of(rows, arm, eta, "max_logit")
      bound = history_of(rows, arm, eta, "logit_bound")
      # runs made before the logit records have None at every evaluation
      if not logit or any(vs[0] is None for _, _, vs in logit):
        continue
      finite = lambda vs: [v for v in vs if v is not None]
      last = np.mean([finite(vs)[-1] for _, _, vs in logit])
      peak = np.mean([max(finite(vs)) for _, _, vs in logit])
      b = np.mean([finite(vs)[-1] for _, _, vs in bound])
      out.append([fmt_eta(eta), arm, f"{last:.2f}", f"{peak:.2f}",
                  f"{b:.2f}"])
  return harness.markdown_table(
      ["eta", "arm", "max logit (end)", "max logit (peak)", "bound (end)"],
      "llrrr", out)


def step_table(rows: Sequence[Mapping], arms: Sequence[str]) -> list:
  out = []
  for arm in arms:
    for eta, (binds, norm) in step_records(rows, arm).items():
      out.append([arm, fmt_eta(eta),
                  "uncapped" if binds is None else f"{binds:.3f}",
                  "" if norm is None else f"{norm:.3g}"])
  return harness.markdown_table(
      ["arm", "eta", "cap binds (fraction of frame-steps)",
       "mean frame step (Frobenius norm of W+ - W)"], "lrrr", out)


CLAIMS = {"best": "(a) each arm at its own best sweep point against AdamW"
                   " at its own best",
          "high": "(b) each arm against AdamW at the high rate"}
TREND = ("(c) the trend with width: each arm's difference from AdamW at the"
         " high rate, at this width against the smaller width")


def capped_losses(rows: Sequence[Mapping], arm: str, eta: float,
                  loss_key: str) -> dict:
  """{seed: capped final loss} of the arm's runs at eta."""
  return {r["seed"]: capped_loss(r["record"], loss_key) for r in rows
          if r["arm"] == arm and r["eta"] == eta}


def rate_eta(plan: Mapping, arm: str, rate: str) -> float:
  """The eta a claims table's rate names: "best", the arm's own best sweep
  point; "high", plan["high"]; "high+k", the sweep's grid point k above it
  (plan["points"], the grid in order).

  >>> plan = dict(best={"a": 1e-3}, high=1e-2, points=[1e-3, 1e-2, 3e-2])
  >>> [rate_eta(plan, "a", r) for r in ("best", "high", "high+1")]
  [0.001, 0.01, 0.03]
  """
  if rate == "best":
    return plan["best"][arm]
  pts, (_, _, up) = plan.get("points", ()), rate.partition("+")
  return pts[pts.index(plan["high"]) + int(up)] if up else plan["high"]


@dataclasses.dataclass(frozen=True)
class Table:
  """A claims table, fixed before its runs: its title and its rows, each
  ((treatment arm, rate), (baseline arm, rate)) with a `rate_eta` rate;
  one Holm family. `last`: its runs follow every other table's, both seed
  blocks."""
  title: str
  rows: tuple
  last: bool = False

  def arms(self) -> list:
    return list(dict.fromkeys(a for row in self.rows for a, _ in row))


def every_arm(which: str, arms: Sequence[str],
              reference: str = "adamw") -> Table:
  """The sweeps' own tables: every arm against the reference, both at
  their best sweep points ("best", table (a)) or at the high rate ("high",
  table (b))."""
  return Table(CLAIMS[which], tuple(((a, which), (reference, which))
                                    for a in arms if a != reference))


def claim_rows(rows: Sequence[Mapping], plan: Mapping, table: Table,
               loss_key: str, bootstrap: bool = False) -> list:
  """A claims table's rows (`stats.comparison_rows`, Holm across it): each
  treatment against its baseline at their rates; the capped final loss,
  paired by seed (with `bootstrap`, each row's bootstrap interval beside
  its t-interval). Where the table's rows name more than one rate, each
  row's treatment eta is its 'size' (a column)."""
  sized = len({r for row in table.rows for _, r in row}) > 1
  pairs = []
  for (a, ra), (b, rb) in table.rows:
    eta = rate_eta(plan, a, ra)
    pairs.append(dict(treatment=a, baseline=b, eta=eta,
                      baseline_eta=rate_eta(plan, b, rb),
                      **({"size": fmt_eta(eta)} if sized else {})))
  score = lambda c, role: capped_losses(
      rows, c[role], c["eta" if role == "treatment" else "baseline_eta"],
      loss_key)
  return stats.comparison_rows(pairs, score, lower_is_better=True,
                               bootstrap=bootstrap)


def gap(rows: Sequence[Mapping], arm: str, eta: float, loss_key: str,
        reference: str = "adamw") -> dict:
  """{seed: D}, D = the arm's capped loss - the reference's, both at eta,
  on the seeds both ran."""
  a = capped_losses(rows, arm, eta, loss_key)
  b = capped_losses(rows, reference, eta, loss_key)
  return {s: a[s] - b[s] for s in sorted(a.keys() & b.keys())}


def trend_rows(rows: Sequence[Mapping], trend: Sequence[Mapping],
               plan: Mapping, arms: Sequence[str], loss_key: str,
               reference: str = "adamw", bootstrap: bool = False) -> list:
  """The trend table (the width plan's (c)): per arm and seed, T = D(this
  width) - D(the smaller width), D = `gap` at each width's own high rate
  (plan["high"] on `rows`, plan["trend"] on `trend`, the smaller width's
  runs); paired by seed (`stats.comparison_rows`: mean_diff is T's mean,
  wins the seeds where T < 0, i.e. where the arm's advantage over the
  reference grew with width), Holm across the arms."""
  score = lambda c, role: (
      gap(rows, c["treatment"], plan["high"], loss_key, reference)
      if role == "treatment" else
      gap(trend, c["treatment"], plan["trend"], loss_key, reference))
  pairs = [dict(treatment=a, baseline=reference) for a in arms
           if a != reference]
  return stats.comparison_rows(pairs, score, lower_is_better=True,
                               bootstrap=bootstrap)


def trend_lines(rows: list, digits: int = 4) -> list:
  """The trend table's lines: per arm, the seeds, D at the smaller width
  and at this width (means), T with its t-interval and (where the rows
  have it) the bootstrap interval, t, p, Holm p, the seeds where T < 0."""
  boot = bool(rows) and "boot_low" in rows[0]
  return harness.markdown_table(
      ["arm", "seeds", "D (smaller width)", "D (this width)", "T [95% CI]",
       *(["bootstrap 95% CI"] if boot else []), "t", "p", "p (Holm)",
       "T < 0"], "llrrl" + "l" * boot + "rrrr",
      [[r["treatment"], harness.format_seeds(r["seeds"]),
        harness.fmt_signed(r["mean_baseline"], digits),
        harness.fmt_signed(r["mean_treatment"], digits),
        harness.fmt_diff(r, digits),
        *([harness.fmt_interval(r, digits)] if boot else []),
        harness.fmt_t(r["t"]), harness.fmt_p(r["p"]),
        harness.fmt_p(r["p_holm"]), f"{r['wins']}/{r['n']}"]
       for r in rows])


# A row of a claims table is its arms at their rates.
ROW_KEY = ("treatment", "baseline", "eta", "baseline_eta")


def findings_lines(tables: Mapping, arms: Sequence[str],
                   key: Sequence[str] = ("treatment", "baseline")) -> list:
  """The claims policy's findings from a table's discovery and
  confirmation rows (a row's twin: the row agreeing on `key`)."""
  found = stats.confirmed(tables["discovery"], tables["confirmation"],
                          key=key, arms=arms)
  complete = stats.confirmation_complete(
      tables["discovery"], tables["confirmation"], key=key, arms=arms)
  return ["Findings: " + ("; ".join(
      harness.finding_text(r, "", digits=4,
                           size="eta" if "size" in r else None)
      for r in found) or "none")
          + ("." if complete else " (confirmation not complete: none"
             " can be read yet)."), ""]


def claim_tables(claims: Mapping, arms: Sequence[str]) -> list:
  """The claims' tables in the report's order (by title): claims["tables"]
  where the sweep fixes its own, else (a) and (b) of every arm."""
  tables = claims.get("tables") or [every_arm(w, arms) for w in CLAIMS]
  return sorted(tables, key=lambda t: t.title)


def claim_lines(claims: Mapping, arms: Sequence[str], loss_key: str,
                loss_text: str, bootstrap: bool = False) -> list:
  """The claims tables ((a) and (b) of every arm, or the sweep's own), and
  (c) where the claims hold the trend's runs, on discovery and
  confirmation seeds, and the findings by the claims policy (with
  `bootstrap`, each row's bootstrap interval)."""
  plan = claims["plan"]
  trend = "trend" in claims
  tables = claim_tables(claims, arms)
  names = [t.title.split(" ", 1)[0] for t in tables] + (
      ["(c)"] if trend else [])
  against = {b for t in tables for _, (b, _) in t.rows}
  rates = sorted({r for t in tables for row in t.rows for _, r in row
                  if r.startswith("high+")})
  out = ["### Claims (the plan's " + (
      f"tables {', '.join(names[:-1])} and {names[-1]})" if len(names) > 1
      else f"table {names[0]})"), "",
         "Best sweep points (tuning seeds): " + ", ".join(
             f"{a} {fmt_eta(e)}" for a, e in plan["best"].items())
         + f"; the high rate: eta {fmt_eta(plan['high'])}"
         + "".join(f"; {r}: eta {fmt_eta(rate_eta(plan, '', r))}"
                   for r in rates)
         + f". Loss: the capped final {loss_text}; difference: treatment"
         + (f" - {next(iter(against))}" if len(against) == 1 else
            " - baseline")
         + " (negative: the treatment is better); wins: seeds where"
         " it is lower." + (" Intervals: the t-interval, and beside it the"
                            " percentile bootstrap over seeds (10,000"
                            " resamples, generator seed 0)." if bootstrap
                            else ""), ""]
  for table in tables:
    rows = {st: claim_rows(claims[st], plan, table, loss_key=loss_key,
                           bootstrap=bootstrap)
            for st in ("discovery", "confirmation")}
    out += [f"#### {table.title}", ""]
    for st, r in rows.items():
      out += [f"{st.capitalize()} seeds:", ""]
      out += (harness.comparison_lines(
          r, "loss", digits=4, size="eta" if r and "size" in r[0] else None)
              if r else ["Not run yet."]) + [""]
    out += findings_lines(rows, table.arms(), ROW_KEY)
  if trend:
    out += [f"#### {TREND}", ""]
    if plan["trend"] is None:
      return out + ["The smaller width's sweep is not complete: its high"
                    " rate, and so this table, is not fixed yet.", ""]
    out += [f"D = the arm's loss - adamw's at each width's own high rate"
            f" (here eta {fmt_eta(plan['high'])}, at the smaller width eta"
            f" {fmt_eta(plan['trend'])}); T = D(this width) - D(smaller"
            " width) per seed. T < 0: the arm's advantage over AdamW at ten"
            " times AdamW's best rate grew with width; T > 0: it shrank.",
            ""]
    tables = {st: trend_rows(claims[st], claims["trend"][st], plan, arms,
                             loss_key, bootstrap=bootstrap)
              for st in ("discovery", "confirmation")}
    for st, rows in tables.items():
      out += [f"{st.capitalize()} seeds:", ""]
      out += (trend_lines(rows) if rows else ["Not run yet."]) + [""]
    out += findings_lines(tables, arms)
  return out


def plot_curves(cs: Mapping, path: pathlib.Path, title: str) -> None:
  plt = harness.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for arm, c in cs.items():
    etas = list(c)
    line, = ax.plot(etas, [c[e]["mean"] for e in etas], marker="o",
                    label=arm)
    div = [e for e in etas if c[e]["diverged"]]
    ax.plot(div, [c[e]["mean"] for e in div], "x", color=line.get_color(),
            markersize=10)
  ax.set_xscale("log")
  ax.set_xlabel("base learning rate eta (x: a tuning seed diverged)")
  ax.set_ylabel("final val loss, capped at L0 (mean of seeds)")
  ax.set_title(title)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  harness.save_figure(fig, path, dpi=110)


def plot_logits(rows: Sequence[Mapping], arms: Sequence[str],
                etas: Sequence[float], path: pathlib.Path) -> None:
  plt = harness.pyplot()
  fig, axes = plt.subplots(1, len(etas), figsize=(5.5 * len(etas), 4),
                           squeeze=False)
  for ax, eta in zip(axes[0], etas):
    for arm in arms:
      runs = history_of(rows, arm, eta, "max_logit")
      if not runs:
        continue
      _, steps, vals = runs[0]           # the first tuning seed
      ax.plot(steps, [np.nan if v is None else v for v in vals], label=arm)
    ax.set_yscale("log")
    harness.label_axes(ax, "step",
                       "max |q.k|/sqrt(hd) over layers (first seed)",
                       f"eta = {fmt_eta(eta)}")
  harness.save_figure(fig, path, dpi=110)


def report(out: pathlib.Path, rows: Sequence[Mapping], *, plan: str,
           grid: Sequence[float], seeds: Sequence[int], left: int,
           reference: str = "adamw", heading: str, setting: str,
           title: str, loss_key: str, loss_text: str,
           step_arms: Sequence[str], claims: Optional[Mapping] = None,
           bootstrap: bool = False, figures: str = "") -> dict:
  """Writes out/robustness.md with its plots; returns {markdown, section,
  curves, heading}: section is the markdown with the plots' links prefixed by
  `figures` (the folder as the RESULTS.md that holds it sees it). left:
  the planned runs not yet finished; claims: the claims' runs by stage
  with their plan (none before the sweep is complete), their rows with
  bootstrap intervals where `bootstrap`; title, loss_key,
  loss_text: the benchmark's name in the plot, the `final` loss read and
  its words; step_arms: the arms whose step records are tabulated (those
  of them the rows hold). The logit plot and table appear where the runs record
  `max_logit`."""
  cs = curves(rows, loss_key)
  lines = [heading, "", setting, "",
           f"Plan (fixed before any run): `{plan}`. Grid of eta:"
           f" {', '.join(fmt_eta(e) for e in grid)}; tuning seeds"
           f" {harness.format_seeds(seeds)}; {len(rows)} sweep runs"
           f" finished, {left} planned runs left"
           + (" (the claims' runs)." if claims else
              " (a partial sweep: curves may miss seeds)." if left else "."),
           ""]
  if not cs:
    lines.append("No finished run yet.")
  else:
    plot_curves(cs, out / "robustness.png",
                f"{title}: final loss against eta")
    lines += ["![loss against eta](FIGURES/robustness.png)", "",
              f"Mean capped final {loss_text} (n d/k: n of k"
              " tuning seeds diverged, counted at their initial loss):", ""]
    lines += curve_table(cs) + [""]
    lines += [f"Per arm: best point, learning-rate sensitivity (Wortsman et"
              f" al.: mean over the grid of min(L, L0) - min L), the span of"
              f" rates whose mean stays within {WITHIN} of the best, runs"
              f" diverged:", ""] + summary_table(cs) + [""]
    if reference in cs and any("max_logit" in r["record"]["history"]
                               for r in rows):
      pts = sorted(set(adamw_points(cs[reference])))
      plot_logits(rows, list(cs), pts, out / "robustness_logits.png")
      lines += [f"Attention logits at {reference}'s best eta and at the"
                f" highest eta where it finishes on every seed (the"
                f" bound ||x_i|| ||x_j|| / sqrt(head_dim) holds for"
                f" orthonormal frames only):", "",
                "![max logit against step](FIGURES/robustness_logits.png)",
                ""]
      lines += logit_table(rows, cs, pts) + [""]
    stiefel = [a for a in cs if a in step_arms]
    if stiefel:
      lines += ["Where the Stiefel arms' step comes from (means over all"
                " steps and tuning seeds):", ""]
      lines += step_table(rows, stiefel) + [""]
  if claims:
    lines += claim_lines(claims, list(cs), loss_key, loss_text, bootstrap)
  text = "\n".join(lines).rstrip("\n") + "\n"
  link = lambda prefix: text.replace("](FIGURES/", f"]({prefix}")
  harness.write_text(out / "robustness.md", link(""))
  return dict(markdown=link(""), section=link(figures), curves=cs,
              heading=heading)
