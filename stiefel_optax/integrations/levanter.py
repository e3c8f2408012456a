"""Levanter / marin: ``optimizer: {type: stiefel_attention}`` in a config.

Importing this module registers two choices of Levanter's
``levanter.optim.OptimizerConfig`` (a draccus ``ChoiceRegistry``), so a
training YAML selects them by ``type``:

* ``stiefel_attention`` (`StiefelAttentionConfig`): the query/key frames of
  every ``q_proj``/``k_proj`` ``haliax.nn.Linear`` (one frame per head, found
  by the Haliax axis names) on Stiefel-Adam, every other parameter on the
  AdamW of Levanter's ``type: adam`` (``AdamConfig``) with the same
  ``beta1``, ``beta2``, ``epsilon``, ``weight_decay`` and weight-decay mask
  (``weight_decay_modules``, ``default_weight_decay_mask``).
* ``stiefel_muon`` (`StiefelMuonConfig`): the same frames on
  `stiefel_optax.stiefel_muon`, the rest as above.

Both take Levanter's learning-rate schedule (``learning_rate``,
``lr_schedule``, ``warmup``, ``decay``, ``min_lr_ratio``, cycles, ...): the
rest follows it, the frames follow the same schedule with their own peak
``stiefel_learning_rate`` (the same shape, as Levanter's ``MuonConfig`` does
for its two groups). ``max_grad_norm`` clips the global norm of the whole
gradient before either group sees it, as ``AdamConfig`` does. Both log the
learning rates (``optax.inject_hyperparams``).

Levanter initialises the projections randomly, so ``orthonormal_start``
defaults to "project": the first step retracts each frame onto the manifold
(the model changes at that step). Use "check" when training from a
checkpoint whose frames are orthonormal (`stiefel_optax.orthonormalize`).

Run Levanter's LM trainer with the choices registered::

    python -m stiefel_optax.integrations.train_lm --config_path my.yaml

(``levanter.main.train_lm`` after this import), or import this module in
your own launcher before draccus parses the config. docs/families.md
("Levanter / marin") has the YAML.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import optax

try:
  import haliax
  from levanter.optim.config import OptimizerConfig
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      "stiefel_optax.integrations.levanter needs Levanter (pip install"
      " marin-levanter); `import stiefel_optax` alone does not.") from e

import stiefel_optax as so

_STARTS = ("project", "check")


def _check(name, value, ok, fix):
  if not ok:
    raise ValueError(f"optimizer.{name}: {value!r}; {fix}")


@dataclasses.dataclass(frozen=True)
class _StiefelBase(OptimizerConfig):
  """The fields and checks both Stiefel choices share."""

  beta1: float = 0.9
  """AdamW's first-moment decay (Levanter's AdamConfig default)."""
  beta2: float = 0.95
  """AdamW's second-moment decay (Levanter's AdamConfig default)."""
  epsilon: float = 1e-8
  max_grad_norm: Optional[float] = 1.0
  """Clip the whole gradient to this global norm first (None: no clip)."""
  stiefel_learning_rate: Optional[float] = None
  """The frames' peak learning rate on Levanter's schedule."""
  max_step_norm: Optional[float] = None
  """Trust region per frame (Frobenius norm of a step)."""
  frames: Optional[str] = None
  """A preset of `stiefel_optax.frame_specs` ("haliax", ...); None: the
  default selector (which finds Levanter's q_proj/k_proj by axis names)."""
  orthonormal_start: str = "project"
  """"project": the first step puts the frames on the manifold; "check":
  init raises unless they already are."""
  retraction: str = "newton_schulz"
  stack_frames: Union[bool, str] = False

  def __post_init__(self):
    _check("orthonormal_start", self.orthonormal_start,
           self.orthonormal_start in _STARTS,
           f"use one of {_STARTS} (Levanter initialises the projections"
           " randomly: \"project\")")
    _check("frames", self.frames,
           self.frames is None or self.frames in so.FRAME_PRESETS,
           f"use a preset of stiefel_optax.FRAME_PRESETS {so.FRAME_PRESETS}"
           " or leave it out (None: the default selector)")
    for name in ("stiefel_learning_rate", "max_step_norm", "max_grad_norm"):
      value = getattr(self, name)
      _check(name, value, value is None or value > 0,
             "give a positive number or leave it out")

  def _frames_peak(self) -> float:
    raise NotImplementedError

  def _frames_tx(self, learning_rate) -> optax.GradientTransformation:
    raise NotImplementedError

  def _rest_tx(self, learning_rate) -> optax.GradientTransformation:
    """Levanter's AdamConfig chain, without its clip (which runs first, on
    the whole gradient): scale_by_adam, the masked decayed weights, -lr."""
    links = [optax.scale_by_adam(self.beta1, self.beta2, self.epsilon)]
    if self.weight_decay > 0:
      links.append(optax.add_decayed_weights(self.weight_decay,
                                             self._weight_decay_mask()))
    links.append(optax.scale(-learning_rate))
    return optax.chain(*links)

  def _weight_decay_mask(self):
    """Levanter's weight-decay mask (`build_weight_decay_mask`: its
    ``weight_decay_modules`` and default rules, by module and path), for
    the tree AdamW sees here: the frames' NamedArrays hold
    `optax.MaskedNode` (the other group's leaves), which Levanter's mask
    cannot read, so each is shown to it as a NamedArray of the same axes
    (its decision depends on the path and module only)."""
    mask_fn = self.build_weight_decay_mask()
    if mask_fn is None:
      return None

    def stand_in(x):
      if haliax.is_named_array(x) and isinstance(x.array, optax.MaskedNode):
        shape = (1,) * len(x.axis_names)
        return haliax.NamedArray(jax.ShapeDtypeStruct(shape, jnp.float32),
                                 x.axis_names)
      return x

    return lambda params: mask_fn(jax.tree.map(
        stand_in, params, is_leaf=haliax.is_named_array))

  def build(self, num_train_steps: int) -> optax.GradientTransformation:
    """The optimizer: clip (max_grad_norm), then the frames on the Stiefel
    transform and the rest on AdamW, with Levanter's schedule for each."""
    schedules = dict(
        learning_rate=self.lr_scheduler(num_train_steps),
        stiefel_learning_rate=self.lr_scheduler(
            num_train_steps, override_lr=self._frames_peak()))

    def optimizer(learning_rate, stiefel_learning_rate):
      tx = so.frame_partition(
          self._frames_tx(stiefel_learning_rate),
          self._rest_tx(learning_rate), self.frames,
          orthonormal_start=self.orthonormal_start,
          stack_frames=self.stack_frames)
      if self.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(self.max_grad_norm), tx)
      return tx

    return optax.inject_hyperparams(optimizer)(**schedules)


@OptimizerConfig.register_subclass("stiefel_attention")
@dataclasses.dataclass(frozen=True)
class StiefelAttentionConfig(_StiefelBase):
  """``type: stiefel_attention``: Stiefel-Adam on the query/key frames
  (`stiefel_optax.stiefel_adam`, with ``beta1``, ``beta2``, ``epsilon``; one
  scalar second moment per frame), Levanter's AdamW on the rest."""

  max_step_norm: Optional[float] = 0.1
  """Trust region per frame (the library's default); None: none."""

  def _frames_peak(self) -> float:
    return (self.learning_rate if self.stiefel_learning_rate is None
            else self.stiefel_learning_rate)

  def _frames_tx(self, learning_rate):
    return so.stiefel_adam(learning_rate, self.beta1, self.beta2,
                           self.epsilon, max_step_norm=self.max_step_norm,
                           retraction=self.retraction,
                           orthonormal_start=self.orthonormal_start)


@OptimizerConfig.register_subclass("stiefel_muon")
@dataclasses.dataclass(frozen=True)
class StiefelMuonConfig(_StiefelBase):
  """``type: stiefel_muon``: manifold Muon on the query/key frames
  (`stiefel_optax.stiefel_muon`), Levanter's AdamW on the rest."""

  stiefel_learning_rate: Optional[float] = 0.02
  """The frames' peak spectral step size (Levanter's MuonConfig ``lr``)."""
  momentum: float = 0.95
  nesterov: bool = True
  msign_steps: int = 10

  def _frames_peak(self) -> float:
    return self.stiefel_learning_rate or self.learning_rate

  def _frames_tx(self, learning_rate):
    return so.stiefel_muon(learning_rate, self.momentum,
                           nesterov=self.nesterov,
                           msign_steps=self.msign_steps,
                           max_step_norm=self.max_step_norm,
                           retraction=self.retraction,
                           orthonormal_start=self.orthonormal_start)
