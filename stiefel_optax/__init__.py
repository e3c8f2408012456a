"""stiefel_optax: Stiefel attention training with Optax.

The query and key kernels of attention live on St(d, r) and are trained by a
Riemannian Adam with one scalar second moment per frame, a trust-region cap
and a polar retraction; everything else keeps AdamW.
"""

from stiefel_optax.geometry import (
    isometry_error, polar, random_frames, retract)
from stiefel_optax.newton_schulz import newton_schulz_steps
from stiefel_optax.transforms import (
    ScaleByFrameAdamState, check_orthonormal_start, clip_frame_norm,
    project_to_tangent, scale_by_frame_adam, tangent_sq_norm)
from stiefel_optax.retraction import MasterFramesState, retract_polar
from stiefel_optax.aliases import (
    one_pass_chain, riemannian_sgd, stiefel_adam, upcast_float16)
from stiefel_optax.muon import (
    ScaleByTangentMsignState, msign, scale_by_tangent_msign, stiefel_muon,
    tangent_msign)
from stiefel_optax.specs import FrameSpec, path_str
from stiefel_optax.families import (
    FRAME_PRESETS, equinox_specs, fused_qkv, haiku_mha, maxtext_fused_qkv)
from stiefel_optax.named_axes import check_axis_mapping
from stiefel_optax.selector import Selector, frame_specs, selected_frames
from stiefel_optax.views import (
    from_frames, map_frames, merge_frames, split_frames, to_frames)
from stiefel_optax.partition import FramePartitionState, frame_partition
from stiefel_optax.sharding import state_shardings
from stiefel_optax.view_sharding import frame_view_spec
from stiefel_optax.attention import stiefel_attention
from stiefel_optax.gains import GAIN_PRESETS, GainSpec, gain_specs
from stiefel_optax.bound import (
    GAIN_CONSTRAINTS, attention_logit_bound, project_gains)
from stiefel_optax.initializers import orthonormal_heads_init, orthonormalize
from stiefel_optax.diagnostics import (
    check_frames, frame_isometry_errors, frame_movement, max_isometry_error)

#: The release. The one version literal: pyproject.toml reads it
#: (``[tool.setuptools.dynamic]``).
__version__ = "0.7.0"

#: The numerics identity, a different concept from the release. The release
#: whose numbers this code reproduces with every option at its default. It
#: is bumped only by a change to what a default-configured transform
#: computes (to rounding or more), not by new options, APIs or speed-ups
#: that leave the numbers alone; so it may lag `__version__`. Benchmark run
#: identities use it, so a study keeps its
#: runs across releases that leave the numbers alone. Which release changed
#: the numbers, and how: CHANGELOG.md.
NUMERICS_VERSION = "0.6.0"

# Grouped as the API reference (docs/api.rst); tests/test_docs.py checks
# that the two list the same names.
__all__ = [
    # Aliases: the one-line switch, and the optimizers of frames.
    "stiefel_attention", "stiefel_adam", "riemannian_sgd", "stiefel_muon",
    # Transforms.
    "project_to_tangent", "check_orthonormal_start", "scale_by_frame_adam",
    "ScaleByFrameAdamState", "clip_frame_norm", "retract_polar",
    "MasterFramesState", "scale_by_tangent_msign", "ScaleByTangentMsignState",
    # Combining transforms: a one-pass chain, a partition of the tree, a
    # float32 compute for float16 leaves.
    "one_pass_chain", "frame_partition", "FramePartitionState",
    "upcast_float16",
    # Frame selection.
    "FrameSpec", "FRAME_PRESETS", "Selector", "frame_specs", "selected_frames",
    "fused_qkv", "maxtext_fused_qkv", "haiku_mha", "equinox_specs",
    "path_str", "check_axis_mapping",
    # Frame views.
    "split_frames", "merge_frames", "to_frames", "from_frames", "map_frames",
    # Model helpers: orthonormal starts, optimizer-state shardings.
    "orthonormalize", "orthonormal_heads_init", "state_shardings",
    "frame_view_spec",
    # The logit bound: the pre-attention norm gains, constrained and read.
    "project_gains", "GainSpec", "GAIN_PRESETS", "GAIN_CONSTRAINTS",
    "gain_specs", "attention_logit_bound",
    # Diagnostics.
    "check_frames", "frame_isometry_errors", "max_isometry_error",
    "frame_movement",
    # Geometry.
    "tangent_sq_norm", "isometry_error",
    "random_frames", "polar", "retract", "newton_schulz_steps", "msign",
    "tangent_msign",
    # Versions.
    "NUMERICS_VERSION",
]
