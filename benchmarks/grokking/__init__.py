"""Modular-arithmetic grokking: AdamW against Stiefel attention, paired seeds.

    python -m benchmarks grokking            # the main job (below): the
                                             # confirmed finding reduced,
                                             # beside the null; minutes
    python -m benchmarks grokking --preset frac0.3_demo   # its first cell
    python -m benchmarks grokking --preset default        # its second cell
    python -m benchmarks grokking --preset full   # the longer study, resumable
    python -m benchmarks grokking --preset full --time-budget 3600
                                             # stops itself between jobs
    python -m benchmarks grokking --quick    # a smoke run, under a minute
    python -m benchmarks grokking --set train_fraction=0.3 --set steps=10000 \
        --seeds 0-4 --worker 0/2             # one of two parallel processes
    python -m benchmarks grokking --report-only --results-md benchmarks/RESULTS.md
                                             # the committed tables and section
    python -m benchmarks grokking --preset frac0.3 --worker 0/2
                                             # a five-seed study: discovery
                                             # seeds, then confirmation seeds
    python -m benchmarks grokking --preset slingshot --seeds 0-2
                                             # the slingshot pilot's 4 arms
    python -m benchmarks grokking --quick --study   # its smoke run

The main job (`python -m benchmarks grokking`, or `python -m benchmarks
grokking`, with no preset, setting, seed, arm or folder named) runs the two
cells of `study.MAIN_JOB`, each in its own folder under runs/grokking/, and
ends with a summary of both:

  1. frac0.3_demo: the confirmed finding, reduced to a demonstration (not a
     new claim). The five-seed study benchmarks/results/grokking/frac0.3
     confirmed that at train fraction 0.3 Stiefel groks and AdamW does not
     (final val acc at 10,000 steps, stiefel - adamw +0.60, Holm p = 0.025,
     5/5 confirmation seeds); this cell trains its configuration (the same
     run identity) on its discovery seeds 0-4 for 2000 steps, where the
     committed runs already separate (stiefel's val acc above adamw's on 9
     of their 10 seeds, 5 of 5 discovery seeds): 10 runs of 2000 steps.
  2. default: the 0.1.0 list at train fraction 0.5 (1000 steps, seeds 0-4,
     an rsgd probe), the null: both arms grok, and the five-seed study
     benchmarks/results/grokking/frac0.5 found no difference.

Task: (a op b) mod p (p = 97) from the tokens [a, b, =], a seeded share of all
equations for training, the rest for validation, full-batch training
(generated, never downloaded).
Model: `benchmarks.models.Transformer` (flax.linen attention), one layer,
no LayerNorm, ReLU MLP, read out at the last token.
Arms (same data split, same initialisation of every non-Q/K weight, same
full-batch order for a seed):

  adamw    every weight on AdamW, weight decay 1.0.
  stiefel  the Q/K kernels' per-head frames orthonormalised at the start and
           trained by `stiefel_optax.stiefel_attention`; the rest AdamW, wd 1.0.
  rsgd     (mechanism probe only) Q/K frames on fixed-step `riemannian_sgd`.
  adam, stiefel_nodecay, stiefel_targeted, adamw_targeted
           the slingshot pilot's: adamw's and stiefel's recipes with the
           AdamW decay off, or on the embeddings, MLP kernels and
           unembedding only (arms.DECAY).

Studies: the 0.1.0 fixed list (presets default, full, quick: the main job's
second cell and the committed reference folders), and the paired studies on
the shared study `benchmarks.study` (presets frac0.5, frac0.3, slingshot,
frac0.3_demo (the main job's first cell), or --study on any preset;
`study.PAIRED`): the arms at fixed rates, discovery
seeds then confirmation seeds, per-endpoint paired tables with Holm, and
per run the slingshot cycles and stable-grokking figures
(`benchmarks.reports.grokking.count_cycles`, `stability`).

Every `log_every` steps each run records train/validation accuracy and loss,
the isometry error ||W^T W - I||_F of every Q/K frame (the AdamW arm's raw
kernels, per head), the Frobenius norm of every other weight (the last
layer's as unembed/kernel), the mean per-step movement ||W_{t+1} - W_t||_F
of each Q/K frame over the chunk, and the mean and largest batch loss of
the chunk's steps (a spike between records is not missed).
Runs are saved per (arm, seed) with a checkpoint, so a stopped study resumes;
a saved run is reused only under the same identity
(`harness.run_identity` of the configuration, the equations' md5 and the
library numerics version). Output goes to
runs/grokking/<preset>/ (ignored by git) unless `--out` names a
folder, e.g. one of the committed reference folders under
benchmarks/results/grokking/. Each folder holds study.json (what was asked),
runs/, an optional notes.md (included verbatim) and the results.json,
table.md and plots that `benchmarks.reports.grokking` generates from the
saved runs (as it does the RESULTS.md section).

The modules, as every experiment has them (config, arms, data, model,
train, study, experiment):

    config.py      `Config`, its presets (`PRESETS`: default, full,
                   quick, frac0.5, frac0.3, frac0.3_demo, slingshot) and a
                   run's name
    arms.py        the arms (`ARMS`: name -> `benchmarks.training.Arm`)
                   and an arm's optimizer
    data.py        the equations, their seeded split and content id
    model.py       the Transformer of a configuration, its evaluation and
                   each arm's initial parameters
    train.py       the jitted training chunk and measurement, and
                   `train_run`: one run, saved and resumable
    study.py       `Study` and `PairedStudy` and their presets
                   (`STUDIES`, `PAIRED`), the main job's cells
                   (`MAIN_JOB`), the study's jobs in order, split into
                   parts, run with a time budget
                   (`benchmarks.study.run_list`), and what the report
                   reads: a folder's study and saved runs
    experiment.py  the record the driver runs (`benchmarks.driver`): a
                   study, its report, the section

Run stores, identities and the machine record are `benchmarks.harness`'s;
the resumable training loop and the arm record are `benchmarks.training`'s,
the runner of the study's jobs `benchmarks.study`'s; the tables, plots and
section are `benchmarks.reports.grokking`'s. The names below are what the
tests and other modules use.
"""

from benchmarks.grokking.arms import ARMS, make_optimizer
from benchmarks.grokking.experiment import EXPERIMENT, configure, main
from benchmarks.grokking.config import PRESETS, PROBE_ARM, Config, run_name
from benchmarks.grokking.model import initial_params, make_model
from benchmarks.grokking.study import STUDIES, Study, load_study
from benchmarks.grokking.train import train_run

__all__ = ["ARMS", "EXPERIMENT", "PRESETS", "PROBE_ARM", "STUDIES", "Config", "Study",
           "configure", "initial_params", "load_study", "main",
           "make_model", "make_optimizer", "run_name",
           "train_run"]
