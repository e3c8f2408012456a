"""Every committed run keeps its name and identity under the one run-name
rule (`benchmarks.harness.run_name`): each run's name recomputed from its
stored record, with its experiment's `Naming`, is its file's name (and the
name it records), and its identity checks (`harness.matches`)."""

import collections
import json

from benchmarks import harness, study as study_lib
from benchmarks.cifar_patches import config as cifar_config
from benchmarks.grokking import config as grokking_config
from benchmarks.lm import config as lm_config


def name_of(folder: str, rec: dict) -> str:
  """The run's name by the rule, from what its record holds."""
  if folder.startswith("lm"):       # lm, lm_robustness, lm_width, lm_bound
    return harness.run_name(rec["arm"], rec["seed"], lm_config.NAMING,
                            config=rec["config"], data=rec["data"])
  if folder == "cifar_robustness":
    return harness.run_name(
        (rec["arm"], f"eta{rec['eta']:g}"), rec["seed"],
        cifar_config.SWEEP_NAMING, config=rec["config"], data=rec["data"],
        version=harness.recorded_version(rec))
  if folder.startswith("cifar"):    # cifar, cifar_tiny and its variants
    if rec["kind"] != "tune":
      return harness.run_name((rec["arm"], f"n{rec['n']}"), rec["seed"],
                              cifar_config.NAMING)
    # the first protocol had one tuning seed (its config's tune_seed), and
    # named its tuning runs without it
    seed = None if "tune_seed" in rec["config"] else rec["seed"]
    return harness.run_name(("tune", rec["arm"],
                             study_lib.point_key(rec["hp"])), seed,
                            cifar_config.NAMING)
  if folder == "grokking":
    name = harness.run_name(rec["arm"], rec["seed"])
    assert name == grokking_config.run_name(rec["arm"], rec["seed"])
    return name
  raise AssertionError(f"no naming for benchmarks/results/{folder}")


def test_every_committed_run_keeps_its_name_and_identity():
  seen, wrong = collections.Counter(), []
  for path in sorted(harness.REFERENCE_ROOT.rglob("runs/*.json")):
    rec = json.loads(path.read_text())
    folder = path.relative_to(harness.REFERENCE_ROOT).parts[0]
    name = name_of(folder, rec)
    seen[folder] += 1
    if name != path.stem or rec.get("name", name) != name or not (
        harness.matches(rec)):
      wrong.append((str(path.relative_to(harness.REPO)), name))
  assert not wrong, wrong[:5]
  assert set(seen) == {"cifar", "cifar_robustness", "cifar_tiny", "grokking",
                       "lm", "lm_bound", "lm_robustness", "lm_width"}, seen


def test_the_rule_is_each_experiments_own():
  """The experiments name their runs through the rule."""
  cfg = lm_config.CPU
  assert lm_config.run_name(cfg, 0, "d") == harness.run_name(
      "adamw", 0, lm_config.NAMING, config=cfg.to_dict(), data="d")
  task = study_lib.Task("discovery", "adamw", {}, {}, 0, 8068)
  assert cifar_config.run_name(task) == "adamw__n8068__s0"
