"""stiefel_optax: Stiefel attention training with Optax.

The query and key kernels of attention live on St(d, r) and are trained by a
Riemannian Adam with one scalar second moment per frame, a trust-region cap
and a polar retraction; everything else keeps AdamW.
"""

from stiefel_optax.geometry import (
    isometry_error, newton_schulz_steps, polar, project_tangent,
    random_frames, retract, sym)
from stiefel_optax.transforms import (
    ScaleByFrameAdamState, check_orthonormal_start, clip_frame_norm,
    project_to_tangent, retract_polar, scale_by_frame_adam, tangent_sq_norm)
from stiefel_optax.aliases import riemannian_sgd, stiefel_adam
from stiefel_optax.muon import (
    ScaleByTangentMsignState, msign, scale_by_tangent_msign, stiefel_muon,
    tangent_msign)
from stiefel_optax.specs import (
    PRESETS, FrameSpec, equinox_specs, frame_specs, fused_qkv, haiku_mha,
    path_str, selected)
from stiefel_optax.views import from_frames, map_frames, merge, split, to_frames
from stiefel_optax.partition import FramePartitionState, frame_partition
from stiefel_optax.sharding import frame_view_spec, state_shardings
from stiefel_optax.attention import stiefel_attention
from stiefel_optax.initializers import orthonormal_heads_init, orthonormalize
from stiefel_optax.diagnostics import (
    check_frames, frame_isometry_errors, frame_movement, max_isometry_error)

__version__ = "0.6.0"
# The release whose numbers this code reproduces with every option at its
# default: bumped only by a change to what a default-configured transform
# computes (0.4.0 added the opt-in `stack_frames`; its defaults computed what
# 0.3.0 did; 0.5.0 forms A^T B on CPU as a materialised transpose and a
# plain matmul, the same products summed in another order, equal to
# rounding; 0.6.0 computes the aliases' chains (`stiefel_adam`,
# `riemannian_sgd`, `stiefel_muon`) in one pass, the step's norm taken from
# its direction, and two Newton–Schulz steps as one polynomial, both equal
# to rounding). Benchmark run identities use it, so a study keeps its runs
# across releases that leave the numbers alone.
NUMERICS_VERSION = "0.6.0"
