"""Character-level language model on tiny Shakespeare: nanoGPT in Flax, the
Stiefel attention optimizer and its alternatives as arms.

    python -m benchmarks lm                  # the external reference: AdamW,
                                             # nanoGPT's small CPU config, seed 0
    python -m benchmarks lm --probe 100      # time 100 steps, print the
                                             # projected wall time, then run
    python -m benchmarks lm --arms stiefel --seeds 100 --set max_iters=500 \\
        --set stiefel_learning_rate=0.03,0.1 --set max_step_norm=0.1
                                             # a sweep (max_iters sets
                                             # lr_decay_iters too)
    python -m benchmarks lm --arms adamw,stiefel --seeds 0-2 \\
        --set stiefel_learning_rate=0.3 --set max_step_norm=0.3  # paired
    python -m benchmarks lm --quick          # toy size, 2 arms, well under 60 s
    python -m benchmarks lm --report-only --out benchmarks/results/lm \\
        --results-md benchmarks/RESULTS.md   # the committed tables and section
    python -m benchmarks lm --study --out benchmarks/results/lm \\
        --results-md benchmarks/RESULTS.md   # the whole study, one resumable
                                             # command (its estimate first)
    python -m benchmarks lm --study --dry-run --out benchmarks/results/lm
                                             # the study's time estimate only
    python -m benchmarks lm --study --quick  # the study's path at toy size
    python -m benchmarks lm --study --report-only --out benchmarks/results/lm
                                             # the study's tables, from the runs
    python -m benchmarks lm --robustness --out benchmarks/results/lm_robustness \
        --results-md benchmarks/RESULTS.md   # the learning-rate sweep (issue
                                             # 30), then its claims; resumable
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        taskset -c 0 python -m benchmarks lm --robustness --worker 0/2 \
        --out benchmarks/results/lm_robustness   # one of two single-threaded
                                             # workers (the other: -c 1, 1/2)
    python -m benchmarks lm --robustness --quick   # its path at toy size
    python -m benchmarks lm --robustness --sweep width64 --worker 0/2 \
        --out benchmarks/results/lm_width/d64     # the sweep across widths
                                             # (issue 43; width_plan.md):
                                             # --sweep width64, width128
                                             # (the committed d 128 runs,
                                             # read), width256 (then its
                                             # claims and the trend's d 64
                                             # terms); XLA_FLAGS and taskset
                                             # as above

Model (`benchmarks.models.GPT`): nanoGPT's `model.py` with its
`train_shakespeare_char` settings: token and learned position embeddings,
pre-LayerNorm blocks (LayerNorm without bias, eps 1e-5; nanoGPT's default
bias=False, so no Dense has a bias either), causal self-attention through a
fused `c_attn` Dense (d, 3 d) whose column thirds are q, k and v, each
head-major (nanoGPT's `.view(B, T, n_head, head_dim)`), `c_proj`, a GELU
(exact) MLP of width 4 d, a final LayerNorm, and the head tied to the token
embedding (nanoGPT ties them: `wte.weight = lm_head.weight`). Initialisation
as nanoGPT: N(0, 0.02) for every kernel and embedding, N(0, 0.02 /
sqrt(2 n_layer)) for both `c_proj`s. Dropout (nanoGPT's places: embeddings,
attention probabilities, both residual branches) is 0 at the CPU config.
One architecture flag, `qk_norm` (the `qk_norm` arm): RMSNorm, with a
learned per-channel scale, on each head's queries and keys (Gemma 3, OLMo 2).

Data: `--data` (default ../shared/data/tinyshakespeare.txt from the
repository root), its md5 checked against the published corpus's and
recorded (never its path); characters sorted into a 65-symbol vocabulary,
first 90 % for training, last 10 % for validation (nanoGPT's prepare.py).
Batches as nanoGPT's get_batch: `batch_size` random offsets, seeded by the
run's seed and the step, the same for every arm of a seed.

Training (nanoGPT's train.py): AdamW (b1 0.9, b2 0.99, eps 1e-8), weight
decay 0.1 on every parameter of rank >= 2, which in nanoGPT includes the
token and position embeddings, none on the LayerNorm (and qk-norm) scales;
learning rate warmed up linearly for `warmup_iters` (100, as the
shakespeare_char config that nanoGPT's CPU command starts from) and
cosine-decayed to `min_lr` at `lr_decay_iters`; the gradient clipped to
global norm 1.0. `max_iters` steps, jitted, `lax.scan` over chunks of
`eval_interval` steps. Evaluation as nanoGPT's estimate_loss at every
`eval_interval` (and at 0): the mean loss of `eval_iters` random batches of
each split (20, as nanoGPT's CPU command), drawn from a key of the seed and
the step (the same batches for every arm of a seed); at the end also the
loss over every token of the validation split in non-overlapping windows
of `block_size` (`val_loss_full`, the comparisons' measure).

Arms (the same data, batches, evaluation batches and initial weights
outside the Q/K parts; each a recipe of library pieces):

  adamw            nanoGPT's AdamW on everything.
  stiefel          `stiefel_attention` with frames={"c_attn/kernel$":
                   fused_qkv(n_head)}: each head's q and k (d, head_dim)
                   frames on Stiefel-Adam (peak lr `stiefel_learning_rate`,
                   trust region `max_step_norm`) from an orthonormalised
                   start, the v third and everything else on AdamW.
  rsgd             the same frames on `riemannian_sgd(rsgd_learning_rate)`.
  stiefel_muon     the same frames on `stiefel_muon(stiefel_muon_learning_rate)`.
  muon             `optax.contrib.muon` on the same per-head q and k views,
                   unconstrained (see `arms.make_optimizer`), from
                   nanoGPT's init.
  qk_norm          AdamW, model with `qk_norm` on.
  orthogonal_init  the orthonormalised Q/K start of `stiefel`, then AdamW.

Every group's learning rate follows the same warmup + cosine shape, its own
peak decayed to peak * min_lr / learning_rate. Gradient clipping is the
same for every arm: the global norm of the whole gradient is clipped to
`grad_clip` before any optimizer sees it (Stiefel-Adam and both Muons are
invariant to the gradient's scale; RSGD and AdamW are not).

The study (`--study`, `study.STUDY`; issue 14 under the fair-tuning rule of
issue 12) turns the comparison into claims. (1) The nanoGPT reference: AdamW
at nanoGPT's published settings, its own record (seeds 0-3), not the tuned
adamw (if tuning lands on the same point the two share their runs). (2)
Tuning on validation, every arm the same grid density: 3 half-decade points
per hyperparameter (adamw, qk_norm and orthogonal_init: lr x weight decay;
stiefel: Q/K lr x max_step_ratio; rsgd, stiefel_muon, muon: Q/K lr; the
non-Q/K weights of these four on adamw's chosen lr and weight decay), tuning
seeds 100-102, a point's score the mean over them of the whole-split
validation loss, each grid widened geometrically past an edge its best point
lands on (at most 3 times; `benchmarks.study`). Tuning runs use the
500-iteration schedule (decay to 500) on which the earlier tuning was done.
(3) Paired runs at the CPU config: adamw and stiefel at discovery seeds 0-7
and confirmation seeds 500-507, the other arms at 0-5 and 500-505, each
arm's discovery seeds before its confirmation seeds, the main pair's before
any other arm's tuning (`benchmarks.study`, the plan CIFAR shares). (4) The
report: each arm against adamw and stiefel against each other arm, treatment
minus baseline in validation loss with its 95% CI, paired t, p,
Holm-adjusted p across each table, wins and both arms' train loss,
separately for discovery and confirmation seeds; a comparison is a finding
only when its confirmation Holm p < 0.05 with the sign it had on discovery.
The plan is a pure function of the finished runs, recomputed after each run:
a rerun skips what is done, and `--study --report-only` regenerates the same
bytes.

Runs are saved per (arm, seed, configuration) under <out>/runs/, with a
checkpoint while training, so a stopped study resumes; a saved run is reused
only under the same identity (`harness.run_identity` of the configuration's
content, the corpus's md5 and the library numerics version). Output goes to
runs/lm/ (ignored by git) unless `--out` names a folder (the committed
reference runs: benchmarks/results/lm). The report (table.md, results.json
and the RESULTS.md section: `benchmarks.reports.lm`) is generated from every
run in the folder; a study's report from its plan read against those runs
(`study.study_state`).

The modules, as every experiment has them (config, arms, data, model,
train, study, experiment), and the LM's timing and robustness sweep:

    config.py      `Config` and its presets (`PRESETS`: cpu, gpu, quick),
                   a run's name
    arms.py        the arms (`ARMS`: name -> `benchmarks.training.Arm`),
                   their Q/K frames and each arm's optimizer: nanoGPT's
                   AdamW, schedule and decay mask, the arm's recipe
    data.py        the corpus and its batches
    model.py       the GPT of a configuration, its initial parameters and
                   loss
    train.py       the jitted training chunk, evaluation and whole-split
                   loss, and `train_run`: one run, saved and resumable
    study.py       the study (`STUDIES`: full, quick), each planned run's
                   configuration, the plan against the finished runs, and
                   what the report reads: the study's state, `write_report`
    timing.py      a run's time (probed, or from the finished runs) and the
                   study's time estimate with its printed line
    robustness.py  the learning-rate sweep (`SWEEPS`: full, quick and the
                   widths' width64, width128, width256, named by --sweep),
                   its plan, runner and report
    experiment.py  the record the driver runs (`benchmarks.driver`):
                   sweep, probe, study, robustness, report-only

The model is `benchmarks.models.GPT`; run stores, identities and the
machine record are `benchmarks.harness`'s; the resumable training loop,
the arm record and the shared Q/K recipes are `benchmarks.training`'s; the
study's plan, estimate and runner are `benchmarks.study`'s; the tables are
`benchmarks.reports.lm`'s and `benchmarks.reports.robustness`'s.
"""
