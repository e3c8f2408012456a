"""stiefel_optax: Stiefel attention training with Optax.

The query and key kernels of attention live on St(d, r) and are trained by a
Riemannian Adam with one scalar second moment per frame, a trust-region cap
and a polar retraction; everything else keeps AdamW.
"""

from stiefel_optax.geometry import (
    isometry_error, newton_schulz_steps, polar, project_tangent,
    random_frames, retract, sym)
from stiefel_optax.layouts import (
    FLAX_PER_HEAD, FLAX_WHOLE, FrameLayout, from_frames, to_frames,
    with_frame_layout)
from stiefel_optax.transforms import (
    ScaleByFrameAdamState, clip_frame_norm, project_to_tangent,
    retract_polar, scale_by_frame_adam)
from stiefel_optax.aliases import riemannian_sgd, stiefel_adam
from stiefel_optax.partition import (
    DEFAULT_QK_PATTERNS, EUCLIDEAN, STIEFEL, check_labels, frames_transform,
    kernel_layout, map_frames, orthonormal_heads_init, orthonormalize,
    path_str, qk_labels, stiefel_attention)
from stiefel_optax.diagnostics import (
    check_frames, frame_isometry_errors, frame_movement, max_isometry_error)

__version__ = "0.1.0"
