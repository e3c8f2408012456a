"""MaxText: ``opt_type: stiefel_attention`` (or ``stiefel_muon``).

MaxText picks its optimizer in ``maxtext/optimizers/optimizers.py``'s
``get_optimizer(config, learning_rate_schedule, model=None, mesh=None)``
from a closed list (``opt_type``, validated by ``configs/types.py``).
`get_optimizer` here has the same signature and returns the optax
transformation for the two Stiefel choices, built from MaxText's own
settings, so MaxText's ``train.py`` plumbing (its learning-rate schedule, its
``nnx.Optimizer`` in ``TrainStateNNX``, its sharding, its gradient clipping,
which runs before the optimizer) is unchanged. Routing ``opt_type`` to it
takes a few lines in MaxText (`ROUTE`; docs/families.md, "MaxText").

What each MaxText setting becomes:

* ``stiefel_attention``: the query/key frames (one per head, found by the
  ``self_attention/`` path of MaxText's kernels) on Stiefel-Adam, every
  other parameter on exactly MaxText's ``opt_type: adamw``
  (``optax.adamw`` with ``adam_b1``, ``adam_b2``, ``adam_eps``,
  ``adam_eps_root``, ``adam_weight_decay``, ``mu_dtype`` and the
  ``adamw_mask`` patterns). The frames use ``adam_b1``, ``adam_b2``,
  ``adam_eps`` and ``mu_dtype`` too, and get no weight decay.
* ``stiefel_muon``: the frames on `stiefel_optax.stiefel_muon` (momentum
  ``muon_beta``), the rest as above.
* The frames' learning rate: MaxText's schedule (warmup, cosine or WSD)
  scaled by ``stiefel_learning_rate / learning_rate`` (the same shape, its
  own peak); ``stiefel_learning_rate`` 0 (the default) means
  ``learning_rate``.
* ``stiefel_max_step_norm``: the trust region per frame (0: none; default
  0.1, the library's default for ``stiefel_attention``).
* ``stiefel_frames``: a preset name of `stiefel_optax.frame_specs`
  ("maxtext", ...); empty (default): the library's default selector.
* ``stiefel_orthonormal_start``: "project" (default: MaxText initialises
  the kernels randomly, so the first step retracts the frames onto the
  manifold) or "check" (for a checkpoint that is already orthonormal).

A setting the ``ROUTE`` lines did not add to MaxText's config takes its
default here, so only ``opt_type`` is required.
"""

from __future__ import annotations

from typing import Any, Callable

import optax

import stiefel_optax as so

#: The Stiefel choices of ``opt_type``.
OPT_TYPES = ("stiefel_attention", "stiefel_muon")

#: Defaults of the optional MaxText settings (``ROUTE`` adds them).
DEFAULTS = {"stiefel_learning_rate": 0.0, "stiefel_max_step_norm": 0.1,
            "stiefel_frames": "", "stiefel_orthonormal_start": "project"}

#: The lines that route ``opt_type`` here, as (file under MaxText's package
#: folder, the line after which they go, the lines). Applied by hand as
#: docs/families.md shows, or by `route` (the integration suite does).
ROUTE = (
    ("configs/types.py", '  MUON = "muon"\n',
     '  STIEFEL_ATTENTION = "stiefel_attention"\n'
     '  STIEFEL_MUON = "stiefel_muon"\n'),
    ("configs/types.py",
     '  muon_beta: float = Field(0.95, description="Decay rate for the'
     ' exponentially weighted average of grads.")\n',
     '  stiefel_learning_rate: float = Field(0.0, description="Peak learning'
     ' rate of the Stiefel frames (0: learning_rate).")\n'
     '  stiefel_max_step_norm: float = Field(0.1, description="Trust region'
     ' per frame (0: none).")\n'
     '  stiefel_frames: str = Field("", description="stiefel_optax frame'
     ' preset (empty: the default selector).")\n'
     '  stiefel_orthonormal_start: str = Field("project", description='
     '"project or check.")\n'),
    ("optimizers/optimizers.py",
     '  elif config.opt_type == "sgd":\n'
     '    base_opt = optax.sgd(learning_rate_schedule)\n',
     '  elif config.opt_type in ("stiefel_attention", "stiefel_muon"):\n'
     '    from stiefel_optax.integrations import maxtext as stiefel_maxtext\n'
     '    base_opt = stiefel_maxtext.get_optimizer(config,'
     ' learning_rate_schedule)\n'),
)


def route(package_dir) -> list:
  """Adds the `ROUTE` lines to the MaxText package in `package_dir` (the
  folder of ``import maxtext``), once; returns the files changed. Raises,
  naming the file and the line, where a line to insert after is missing
  (another MaxText release: apply the lines by hand)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  changed = []
  for rel, anchor, lines in ROUTE:
    path = pathlib.Path(package_dir) / rel
    text = path.read_text(encoding="utf-8")
    if lines in text:
      continue
    if text.count(anchor) != 1:
      raise ValueError(
          f"stiefel_optax.integrations.maxtext.route: {path} has the line"
          f" {anchor.strip()!r} {text.count(anchor)} times, not once (another"
          " MaxText release?): add these lines by hand where opt_type is"
          f" chosen:\n{lines}")
    path.write_text(text.replace(anchor, anchor + lines), encoding="utf-8")
    changed.append(str(path))
  return changed


def _setting(config, name):
  value = getattr(config, name, None)
  return DEFAULTS[name] if value is None else value


def _opt_type(config) -> str:
  value = getattr(config.opt_type, "value", config.opt_type)
  if value not in OPT_TYPES:
    raise ValueError(
        f"stiefel_optax.integrations.maxtext.get_optimizer: config.opt_type"
        f" is {value!r}; it serves {' and '.join(OPT_TYPES)} only. Route"
        " only those opt_type values here (docs/families.md, MaxText).")
  return value


def _adamw_mask(config):
  """MaxText's own `adamw_mask` (weight decay off where a pattern
  matches)."""
  # pylint: disable=import-outside-toplevel
  from maxtext.optimizers.optimizers import get_adamw_mask
  return get_adamw_mask(config)


def frame_learning_rate(config, learning_rate_schedule: Callable) -> Any:
  """The frames' schedule: MaxText's, scaled to peak at
  ``stiefel_learning_rate`` (``learning_rate`` when it is 0)."""
  peak = float(_setting(config, "stiefel_learning_rate"))
  if peak < 0:
    raise ValueError(
        f"stiefel_optax.integrations.maxtext: stiefel_learning_rate is {peak};"
        " give a peak learning rate >= 0 (0: learning_rate).")
  if peak == 0 or peak == config.learning_rate:
    return learning_rate_schedule
  if not config.learning_rate > 0:
    raise ValueError(
        "stiefel_optax.integrations.maxtext: stiefel_learning_rate ="
        f" {peak} scales MaxText's schedule by stiefel_learning_rate /"
        f" learning_rate, and learning_rate is {config.learning_rate}; set"
        " learning_rate > 0.")
  scale = peak / config.learning_rate
  return lambda step: learning_rate_schedule(step) * scale


def get_optimizer(config, learning_rate_schedule, model=None, mesh=None
                  ) -> optax.GradientTransformation:
  """MaxText's ``get_optimizer`` for ``opt_type`` "stiefel_attention" and
  "stiefel_muon" (the module docstring maps each setting).

  Args:
    config: MaxText's config (``pyconfig.HyperParameters``), or any object
      with its attributes.
    learning_rate_schedule: MaxText's schedule
      (``maxtext_utils.create_learning_rate_schedule(config)``).
    model, mesh: accepted for MaxText's signature; unused (the frames are
      found in the parameter tree at ``init``).

  Returns:
    The optax transformation (a `stiefel_optax.frame_partition`; its
    update needs params, which ``nnx.Optimizer`` passes).

  Raises:
    ValueError: for another ``opt_type`` or an invalid Stiefel setting.
  """
  del model, mesh
  opt_type = _opt_type(config)
  mu_dtype = config.mu_dtype or None
  rest = optax.adamw(
      learning_rate_schedule, b1=config.adam_b1, b2=config.adam_b2,
      eps=config.adam_eps, eps_root=config.adam_eps_root,
      weight_decay=config.adam_weight_decay, mu_dtype=mu_dtype,
      mask=_adamw_mask(config))
  cap = _setting(config, "stiefel_max_step_norm")
  cap = float(cap) if cap else None
  start = _setting(config, "stiefel_orthonormal_start")
  lr = frame_learning_rate(config, learning_rate_schedule)
  if opt_type == "stiefel_attention":
    frames_tx = so.stiefel_adam(lr, config.adam_b1, config.adam_b2,
                                config.adam_eps, max_step_norm=cap,
                                mu_dtype=mu_dtype, orthonormal_start=start)
  else:
    frames_tx = so.stiefel_muon(lr, config.muon_beta, max_step_norm=cap,
                                mu_dtype=mu_dtype, orthonormal_start=start)
  return so.frame_partition(frames_tx, rest,
                            _setting(config, "stiefel_frames") or None,
                            orthonormal_start=start)
