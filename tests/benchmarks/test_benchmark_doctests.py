"""The benchmarks' docstring examples run (pytest collects doctests from
the library only: benchmarks/ runs from the checkout, not installed)."""

from __future__ import annotations

import doctest

import pytest

from benchmarks import (driver, harness, models, stats, study, sweep,
                        training)
from benchmarks.cifar_patches import config as cifar_config
from benchmarks.grokking import arms as grokking_arms
from benchmarks.lm import (arms as lm_arms, config as lm_config,
                           robustness as lm_robustness, study as lm_study)
from benchmarks.reports import cifar as cifar_report, robustness
from benchmarks.speed import arms, cli, layout, peer, timing, trees


@pytest.mark.parametrize(
    "module", [driver, harness, models, stats, study, sweep, training, cifar_config,
               grokking_arms,
               lm_arms, lm_config, lm_robustness, lm_study, cifar_report,
               robustness, arms, cli, layout, peer, timing, trees],
    ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
