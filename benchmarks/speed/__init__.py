"""What the Stiefel step costs: `stiefel_attention` against `optax.adamw`.

    python -m benchmarks speed              # full tables (about 5 min on 2
                                            # CPU cores; 10-20 min where
                                            # OpenBLAS settings slow LAPACK)
    python -m benchmarks speed --quick      # tiny shapes: a smoke test
    python -m benchmarks speed --peer-only  # table 6 alone (geoopt)
    python -m benchmarks speed --report-only --out benchmarks/results
                                            # speed.md from speed.json

The full run's time is mostly LAPACK: the SVD of 32 (4096, 128) frames may
use its whole child-process timeout (--timeout, 300 s) and report a hang.

Every time is the median, over repeated calls after two warm-up calls, of a
`jax.jit`-compiled function timed to `block_until_ready`. The functions of
one comparison are called in alternation (A, B, A, B, ...) in the same run,
so a change of machine load hits both sides alike; ratios are of medians.

Tables:

1. One optimizer update (`tx.update`, jitted; the apply is not timed) on
   (a) a GPT-2-small-shaped Flax-linen parameter tree: 12 layers, d = 768,
   12 heads of 64, MLP 3072, query/key/value kernels (768, 12, 64) and out
   kernels (12, 64, 768) as `MultiHeadDotProductAttention` names them, token
   embedding reduced to 8192 x 768; (b) a small patch ViT tree (d = 64,
   4 heads of 16, 64 tokens, 6 layers). Both optimizers see the same tree;
   `stiefel_attention` trains the 24 (resp. 12) query/key kernels per head.
   `stiefel_attention` is also timed with `stack_frames=True` and "auto"
   (equal-shape frames of all leaves as one batch; stacks up to 1 MiB), in
   the same alternation, and against its floor (table 2).
2. Where the update's time goes on the GPT-2 tree: AdamW on the Q/K leaves
   and on the rest, the Stiefel group alone, and the floor: the d x r x r
   products that any Stiefel step needs, timed on the same frames.
3. One training step (forward, backward, update, apply) of a small causal
   transformer language model, both optimizers.
4. Optimizer-state bytes of the Q/K kernels under both optimizers.
5. The polar retraction polar(W + xi) by `eigh` (of the r x r Gram matrix),
   Newton–Schulz (matmul only) and a thin SVD of W + xi, on a batch of
   d / r heads of (d, r) frames: time, and the isometry error
   max ||Q^T Q - I||_F for a tangent step of norm delta = 0.1 (the default
   trust region) and delta = 1. `eigh` and SVD run in a child process with
   a timeout: jaxlib's batched LAPACK calls can hang on some small CPU
   machines, and a hang is reported as such instead of stopping the run.

6. The peer library geoopt (PyTorch, CPU): one step of
   `geoopt.optim.RiemannianAdam` on `geoopt.EuclideanStiefel`
   `ManifoldParameter`s (`optimizer.step()`, gradients already set) beside
   one jitted `stiefel_adam` update plus `optax.apply_updates`, same lr
   (1e-3), same float32 frames and gradients (NumPy, fixed seed), on
   workload A, 24 leaves of (12, 768, 64) (GPT-2 small's Q/K kernels, one
   frame per head), and B, 8 leaves of (4, 64, 16) (the patch ViT's): ms
   per step of each, the ratio geoopt / ours, and the isometry error of
   each after 20 steps from the same frames. Both Adams keep one second
   moment per frame; ours caps the step (0.1) and retracts by polar
   (Newton–Schulz), geoopt retracts by QR. geoopt runs in a long-lived
   child process (benchmarks/speed/peer_geoopt.py) under its own Python
   environment, so torch never enters ours; the parent asks it over a pipe
   to time k steps, then times k of ours, and so on in alternation; medians
   over the rounds. torch gets as many threads as the cores jax may use
   (`os.sched_getaffinity`). Where no peer Python is found, or it cannot
   import torch and geoopt, the table says "skipped" and why, and the rest
   of the run is unaffected. Set up the peer environment once (runs/ is
   git-ignored; torch is PyTorch's CPU build, from its index or from a
   wheel file of that build where there is no internet):

       python3 -m venv runs/peer-venv
       runs/peer-venv/bin/pip install torch \\
           --index-url https://download.pytorch.org/whl/cpu
       runs/peer-venv/bin/pip install geoopt numpy

   runs/peer-venv/bin/python is the default `--peer-python`; `--quick` runs
   the comparison on tiny shapes when it exists. `--peer-only --iters 3`
   took 5 min on 2 CPU cores that another job kept busy, mostly workload A
   (one geoopt step of its 288 frames: seconds).

7. The native layout (issue 13, item 1): the step's five products per
   leaf on GPT-2 small's 24 Q/K kernels (768, 12, 64), as einsums over the
   kernel's own axes with the momentum in kernel layout, against the frame
   view the library uses; ms, alternated, and the transposes and copies in
   each optimized program (`layout.transposes`), which show where XLA
   moves data.

8. The Gram product W^T G in its two forms (`geometry.gram` picks one by
   platform): one contraction over d, and A^T materialised then a plain
   batched matmul (the CPU form), on workload B's stack and leaf and one
   GPT-2 small kernel; ms, alternated.

Results: `--out DIR` (default runs/speed for a full run, runs/speed_peer
with --peer-only, none for --quick; `--out benchmarks/results` refreshes the
committed figures) receives speed.json and speed.md (rendered by
`benchmarks.reports.speed`; `--report-only --out DIR` renders speed.md
again from DIR/speed.json). Machine load (`os.getloadavg`) is recorded
before and after, with the BLAS environment variables.

One module per concept, one table module per table (each holds its
workloads, what it times and the row it returns):

    arms.py          the optimizers compared (adamw, stiefel_attention per
                     leaf, stacked, auto) and their ratios to adamw
    timing.py        `median_times`: alternated medians, wall and CPU time
    trees.py         the Flax-linen-shaped parameter trees (GPT-2 small,
                     patch ViT) and their Q/K leaves
    update.py        tables 1 and 2: one update, its parts and its floor
    train_step.py    table 3: one training step of a causal LM
    state.py         table 4: optimizer-state bytes
    retraction.py    table 5, eigh and SVD in child processes
    peer.py          table 6, the parent side; peer_geoopt.py the child
                     side (torch and geoopt, no jax)
    layout.py        table 7: native layout against the frame view
    gram.py          table 8: the two forms of the Gram product
    cli.py           `run` (the tables of one run), speed.json and speed.md,
                     the record the driver runs (`python -m benchmarks
                     speed`)

The markdown is rendered by the report layer, `benchmarks.reports.speed`;
the machine record, output folders and atomic writes are
`benchmarks.harness`'s; the causal LM is a `benchmarks.models.Transformer`.
"""
