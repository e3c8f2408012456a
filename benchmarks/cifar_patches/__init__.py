r"""CIFAR-10 patch benchmark: Stiefel-Adam on the attention Q/K kernels
against AdamW, with data scaling, baselines and ablations (paired seeds).

    python -m benchmarks cifar_patches            # the full protocol, resumable
    python -m benchmarks cifar_patches --quick    # synthetic images, < 1 minute
    python -m benchmarks cifar_patches --data PATH --arms adamw,stiefel,rsgd \
        --out DIR                                 # the main arms only
    python -m benchmarks cifar_patches --set model.dim=128 --set epochs=30 \
        --set sizes=1000 --out DIR                # another model, one n
    python -m benchmarks cifar_patches ... --dry-run   # runs left, hours
    python -m benchmarks cifar_patches ... --time-budget 9000  # stops itself
    python -m benchmarks cifar_patches --report-only --out benchmarks/results/cifar \
        --data PATH --results-md benchmarks/RESULTS.md   # the committed tables
    python -m benchmarks cifar_patches --robustness --out \
        benchmarks/results/cifar_robustness   # the learning-rate sweep (issue 30)

Every arm trains the same patch transformer (`benchmarks.models`,
`PatchViTConfig`) with the same AdamW on every parameter
except the attention query/key kernels, whose optimizer is the arm's recipe
(an `optax.chain` of the library's transforms). Seed s fixes the training
subset, the non-Q/K initialisation and the batch order for every arm. Each
arm's hyperparameters (AdamW: lr x weight decay, also every arm's non-Q/K
AdamW; Stiefel: Q/K lr x cap; RSGD: lr) are chosen on a validation split
carved from the training images, by the mean over three tuning seeds, on
grids widened until the choice is interior; the test images are only
evaluated.
Each finished run is written at once to <out>/runs/ (default runs/cifar/,
ignored by git); a rerun skips it if its identity (configuration, data md5,
library numerics version: `benchmarks.harness`) is unchanged. The protocol's
seeds are the defaults: the main arms (adamw, stiefel, rsgd) at discovery
seeds 0-7 and confirmation seeds 500-507 at every n, the other arms at 0-5
and 500-505 at the largest n, all fixed before any run.

The modules, as every experiment has them (config, arms, data, train,
study, experiment; the model is `benchmarks.models`' patch transformer):

    config.py   `Config`, its presets (`PRESETS`: default, quick) and a
                run's file name (`run_name`)
    arms.py     the arms (`ARMS`: name -> `benchmarks.training.Arm`): each
                one's Q/K recipe, start and frame layout, and an arm's
                whole-model optimizer
    data.py     the CIFAR-10 sources (the official batches, the subset's
                .npz, synthetic images), the validation split and each
                seed's paired stream
    train.py    a run's start, its jitted epoch and evaluation, `Trainer`
                (the images on device; one run, epoch by epoch)
    study.py    the arms' groups (each arm's tuning grid) and seeds, the
                report's families, `StudyRuns` (the study's runs planned,
                read, written and timed), the lines a study prints
    robustness.py  the learning-rate sweep (`benchmarks.sweep` on this
                model: its grid, ratios and seeds, one run epoch by epoch
                with its divergence stop, the report)
    experiment.py  the record the driver runs (`benchmarks.driver`): plan
                and estimate, the runs, the report

Run stores, identities (`harness.run_identity`) and the machine record are
`benchmarks.harness`'s; the scanned epoch, the arm record and the shared
Q/K recipes (the per-head Muon among them) are `benchmarks.training`'s;
the plan, estimate and runner are `benchmarks.study`'s; the tables and the
RESULTS.md section are `benchmarks.reports.cifar`'s.
"""

# The names the code using this package (the tests) reads, e.g.
# `from benchmarks import cifar_patches as cp; cp.ARMS`.
from benchmarks.cifar_patches.arms import (
    ARMS, BASE_KEYS, PER_HEAD, WHOLE_FRAME, frames_of, make_optimizer,
    qk_adamw, qk_frozen, qk_muon, qk_no_cap, qk_no_projection,
    qk_per_coordinate, qk_rsgd, qk_stiefel, qk_stiefel_muon, schedule)
from benchmarks.cifar_patches.experiment import EXPERIMENT, main
from benchmarks.cifar_patches.config import PRESETS, Config, Task, run_name
from benchmarks.cifar_patches.data import seed_stream, validation_split
from benchmarks.cifar_patches.study import (GROUPS, MAIN_SEEDS, OTHER_SEEDS,
                                            StudyRuns, describe,
                                            estimate_text, families,
                                            quick_groups, study_arms)
from benchmarks.cifar_patches.train import (Trainer, init_params,
                                            make_epoch_fn, make_eval_fn,
                                            normalize, orthonormal_start)

__all__ = ["ARMS", "BASE_KEYS", "EXPERIMENT", "GROUPS", "MAIN_SEEDS", "OTHER_SEEDS",
           "PER_HEAD", "PRESETS", "StudyRuns", "WHOLE_FRAME", "Config", "Task",
           "Trainer", "describe", "estimate_text", "families", "frames_of",
           "init_params", "main", "make_epoch_fn", "make_eval_fn",
           "make_optimizer", "normalize", "orthonormal_start",
           "qk_adamw", "qk_frozen", "qk_muon", "qk_no_cap",
           "qk_no_projection", "qk_per_coordinate", "qk_rsgd", "qk_stiefel",
           "qk_stiefel_muon", "quick_groups", "run_name", "schedule",
           "seed_stream", "study_arms", "validation_split"]
