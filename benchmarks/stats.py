"""Paired-seed statistics shared by the experiments (scipy.stats), and the
Holm step-down correction across the comparisons of one table."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
from scipy import stats


def paired_comparison(treatment: Sequence[float], baseline: Sequence[float],
                      confidence: float = 0.95) -> dict:
  """Paired comparison of two arms over the same seeds.

  Returns the mean difference (treatment - baseline) with its t-interval,
  the paired t statistic and two-sided p-value (scipy.stats.ttest_rel), the
  Wilcoxon signed-rank p-value where defined, and the wins k of N.
  """
  a = np.asarray(treatment, dtype=np.float64)
  b = np.asarray(baseline, dtype=np.float64)
  if a.shape != b.shape or a.ndim != 1:
    raise ValueError(f"paired arms need equal 1-D shapes; got {a.shape}, {b.shape}")
  diff = a - b
  n = diff.size
  out = {"n": int(n), "mean_diff": float(diff.mean()) if n else float("nan"),
         "wins": int(np.sum(diff > 0)), "losses": int(np.sum(diff < 0)),
         "ties": int(np.sum(diff == 0))}
  if n >= 2 and np.std(diff) > 0:
    t = stats.ttest_rel(a, b)
    ci = stats.t.interval(confidence, n - 1, loc=diff.mean(),
                          scale=stats.sem(diff))
    out.update(t=float(t.statistic), p=float(t.pvalue),
               ci_low=float(ci[0]), ci_high=float(ci[1]))
    try:
      out["wilcoxon_p"] = float(stats.wilcoxon(a, b).pvalue)
    except ValueError:
      out["wilcoxon_p"] = float("nan")
  else:
    out.update(t=float("nan"), p=float("nan"), ci_low=out["mean_diff"],
               ci_high=out["mean_diff"], wilcoxon_p=float("nan"))
  return out


def bootstrap_interval(diff: Sequence[float], confidence: float = 0.95,
                       n_resamples: int = 10_000, seed: int = 0) -> tuple:
  """Percentile bootstrap interval of the mean of paired differences over
  seeds (scipy.stats.bootstrap, `n_resamples` resamples of the seeds with a
  fixed generator, so a report regenerates byte for byte); (mean, mean)
  where the differences do not vary or there are fewer than two.

  >>> lo, hi = bootstrap_interval([0.1, 0.3, 0.2, 0.4])
  >>> 0.1 <= lo < 0.25 < hi <= 0.4
  True
  """
  d = np.asarray(diff, dtype=np.float64)
  if d.size < 2 or np.std(d) == 0:
    m = float(d.mean()) if d.size else float("nan")
    return m, m
  ci = stats.bootstrap((d,), np.mean, confidence_level=confidence,
                       n_resamples=n_resamples, method="percentile",
                       rng=np.random.default_rng(seed)).confidence_interval
  return float(ci.low), float(ci.high)


def paired_row(treatment: Mapping[int, float], baseline: Mapping[int, float],
               loss_treatment: Optional[Mapping[int, float]] = None,
               loss_baseline: Optional[Mapping[int, float]] = None, *,
               lower_is_better: bool = False,
               bootstrap: bool = False) -> Optional[dict]:
  """One row of a comparison table: `paired_comparison` of {seed: metric}
  maps over their common seeds (None if there are none), mean_diff always
  treatment - baseline, wins the seeds where the treatment is better (for
  a metric where lower is better: lower), with both arms' means and, when
  given, their mean training losses (so a reader sees the regime); with
  `bootstrap`, the percentile bootstrap interval of mean_diff beside the
  t-interval (boot_low, boot_high: `bootstrap_interval`)."""
  seeds = sorted(set(treatment) & set(baseline))
  if not seeds:
    return None
  a = [treatment[s] for s in seeds]
  b = [baseline[s] for s in seeds]
  if lower_is_better:   # count the treatment's wins as seeds where it is lower
    row = paired_comparison(b, a)
    row.update(mean_diff=-row["mean_diff"], ci_low=-row["ci_high"],
               ci_high=-row["ci_low"], t=-row["t"])
  else:
    row = paired_comparison(a, b)
  row.update(seeds=seeds, mean_treatment=float(np.mean(a)),
             mean_baseline=float(np.mean(b)))
  if bootstrap:
    row["boot_low"], row["boot_high"] = bootstrap_interval(
        np.subtract(a, b))
  if loss_treatment is not None and loss_baseline is not None:
    row.update(loss_treatment=float(np.mean([loss_treatment[s] for s in seeds])),
               loss_baseline=float(np.mean([loss_baseline[s] for s in seeds])))
  return row


ROLES = ("treatment", "baseline")


def comparison_rows(pairs: Sequence[Mapping], score, loss=None, *,
                    lower_is_better: bool = False,
                    bootstrap: bool = False) -> list:
  """One comparison table: for each comparison of `pairs` (a dict naming
  its 'treatment' and 'baseline' arms, and whatever else tells it apart,
  e.g. a 'size'), the `paired_row` of score(comparison, role) ({seed:
  metric} of the arm in that role, "treatment" or "baseline"), with
  loss(comparison, role) ({seed: training loss}) beside; a comparison
  without a common seed is left out; p-values Holm-adjusted across the
  table (`with_holm`); with `bootstrap`, each row's bootstrap interval
  (`paired_row`).

  >>> acc = {"a": {0: 0.6, 1: 0.7}, "b": {0: 0.5, 1: 0.5}}
  >>> [r] = comparison_rows([dict(treatment="a", baseline="b")],
  ...                       lambda c, role: acc[c[role]])
  >>> r["treatment"], round(r["mean_diff"], 3), r["wins"]
  ('a', 0.15, 2)
  """
  rows = []
  for c in pairs:
    scores = [score(c, role) for role in ROLES]
    losses = [None if loss is None else loss(c, role) for role in ROLES]
    row = paired_row(*scores, *losses, lower_is_better=lower_is_better,
                     bootstrap=bootstrap)
    if row is not None:
      rows.append({**c, **row})
  return with_holm(rows)


def unpaired_comparison(a: Sequence[float], b: Sequence[float]) -> dict:
  """Welch's t-test and Mann–Whitney U for arms without pairing (e.g. a
  statistic that is undefined for some seeds)."""
  a = np.asarray(a, dtype=np.float64)
  b = np.asarray(b, dtype=np.float64)
  out = {"n_a": int(a.size), "n_b": int(b.size),
         "mean_a": float(a.mean()) if a.size else float("nan"),
         "mean_b": float(b.mean()) if b.size else float("nan")}
  if a.size >= 2 and b.size >= 2:
    t = stats.ttest_ind(a, b, equal_var=False)
    out.update(t=float(t.statistic), p=float(t.pvalue),
               mannwhitney_p=float(stats.mannwhitneyu(a, b).pvalue))
  return out


def holm(pvalues: Sequence[float]) -> list:
  """Holm-Bonferroni step-down adjusted p-values, in the input order.

  With the m finite p-values sorted, p_(1) <= ... <= p_(m), the k-th
  (0-based) is adjusted to max over j <= k of min(1, (m - j) p_(j)). NaN
  (no test) stays NaN and does not count in the family.
  """
  p = np.asarray(pvalues, dtype=np.float64)
  out = np.full(p.shape, np.nan)
  finite = np.flatnonzero(np.isfinite(p))
  running = 0.0
  for k, i in enumerate(finite[np.argsort(p[finite], kind="stable")]):
    running = max(running, min(1.0, (finite.size - k) * p[i]))
    out[i] = running
  return out.tolist()


def with_holm(rows: list) -> list:
  """rows (dicts with a paired-t 'p'; None for a comparison not run) with
  'p_holm': their p-values Holm-adjusted across the table."""
  run = [r for r in rows if r is not None]
  for r, p in zip(run, holm([r["p"] for r in run])):
    r["p_holm"] = p
  return rows


def _by_comparison(rows: list, key: Sequence[str]) -> dict:
  """{the values of `key`: row}: the rows of a table by their comparison."""
  return {tuple(r[k] for k in key): r for r in rows if r is not None}


def unrun_arms(rows: list, arms: Sequence[str]) -> list:
  """The planned `arms` that no row of a comparison table (rows with
  'treatment' and 'baseline'; None for a comparison not run) compares yet.

  >>> unrun_arms([dict(treatment="muon", baseline="adamw"), None],
  ...            ["muon", "qk_norm"])
  ['qk_norm']
  """
  seen = {a for r in rows if r is not None
          for a in (r["treatment"], r["baseline"])}
  return [a for a in arms if a not in seen]


def confirmation_complete(discovery: list, confirmation: list,
                          key: Sequence[str] = ("treatment", "baseline"),
                          arms: Sequence[str] = ()) -> bool:
  """Whether the confirmation table is complete: every planned arm (`arms`)
  is in the discovery table (`unrun_arms`), and every comparison of the
  discovery table has its confirmation twin (rows agreeing on `key`) on at
  least as many seeds (the studies plan equal blocks, e.g. 8 + 8). Before
  that, the Holm family or the confirmation seeds are partial, and reading
  findings off them would be optional stopping."""
  second = _by_comparison(confirmation, key)
  return bool(discovery) and not unrun_arms(discovery, arms) and all(
      c in second and len(second[c]["seeds"]) >= len(d["seeds"])
      for c, d in _by_comparison(discovery, key).items())


def confirmed(discovery: list, confirmation: list,
              key: Sequence[str] = ("treatment", "baseline"),
              arms: Sequence[str] = ()) -> list:
  """The claims policy: the confirmation rows that are findings, i.e. Holm
  p < 0.05 across the confirmation table (`with_holm`) and a mean
  difference of the same sign as the same comparison's (rows agreeing on
  `key`) on the discovery seeds; none until the confirmation table is
  complete (`confirmation_complete`, with the planned `arms`). A row
  without a discovery twin is no finding.

  >>> d = [dict(treatment="a", baseline="b", seeds=[0, 1], mean_diff=1.0)]
  >>> c = dict(treatment="a", baseline="b", mean_diff=0.5, p_holm=0.01)
  >>> full, short = dict(c, seeds=[500, 501]), dict(c, seeds=[500])
  >>> len(confirmed(d, [full])), len(confirmed(d, [short]))
  (1, 0)
  """
  if not confirmation_complete(discovery, confirmation, key, arms):
    return []
  first = _by_comparison(discovery, key)
  out = []
  for c, r in _by_comparison(confirmation, key).items():
    d = first.get(c)
    if (d is not None and np.isfinite(r["p_holm"]) and r["p_holm"] < 0.05
        and np.sign(r["mean_diff"]) == np.sign(d["mean_diff"]) != 0):
      out.append(r)
  return out
