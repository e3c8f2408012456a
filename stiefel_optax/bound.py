"""The attention-logit bound, closed: the pre-attention norm's gains held on a
constraint set, and the largest logit a model can produce, certified.

Orthonormal per-head query/key frames bound every attention logit by the
token norms: abs(q_i . k_j) / sqrt(r) <= ||x_i|| ||x_j|| / sqrt(r). The tokens
x entering attention come out of a norm layer (LayerNorm or RMSNorm) with a
trained gain g (and, for LayerNorm, a bias b):

    x = g * n + b,    n = (y - mu) / sqrt(var + eps)   (RMSNorm: mu = 0,
                                                        var = mean(y^2))

and ||n||_2^2 = d var / (var + eps) <= d for every input y and every
eps >= 0, so ||x|| <= ||g||_inf sqrt(d) + ||b||_2. A gain that trains
freely lets the bound grow with it; constraining g (`project_gains`: a box
abs(g) <= g_max, a sphere ||g||_2 = sqrt(d), or held fixed) closes it:
abs(logit) <= (g_max sqrt(d) + ||b||)^2 / sqrt(r).

The gains are selected as `FrameSpec` selects the frames: by a preset name,
a `{path_regex: GainSpec | None}` mapping or a callable (`gains`).

`attention_logit_bound` reads the bound of a parameter tree: per attention
block, the largest logit any input can produce.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stiefel_optax import checks, selector, views
from stiefel_optax.gains import (
    Gain, GainSelector, _module_of, gain_specs, leaf_names)


# --------------------------------------------------------------------------
# The projection.

#: The constraint sets of `project_gains`.
GAIN_CONSTRAINTS = ("box", "sphere", "fixed")


def _project(x, gain: Gain, constraint: str, g_max: float, bias_max: float):
  """The projection of a leaf's new value x onto its constraint set, in the
  leaf's effective gain (offset + x); float32 at least."""
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(dtype)
  if gain.spec.bias:
    return jnp.clip(x, -bias_max, bias_max)
  g = x + gain.spec.offset
  if constraint == "box":
    g = jnp.clip(g, -g_max, g_max)
  else:                                     # sphere, per norm layer
    d = x.shape[gain.axis]
    norm = jnp.linalg.norm(g, axis=gain.axis, keepdims=True)
    # A zero gain has no direction: it goes to the all-ones gain (norm
    # sqrt(d) too), the norm layers' usual start.
    g = jnp.where(norm > 0, g * (math.sqrt(d) / jnp.where(norm > 0, norm, 1)),
                  jnp.ones_like(g))
  return g - gain.spec.offset


def project_gains(constraint: str = "box", *, gains: GainSelector = None,
                  g_max: float = 1.0, bias_max: float = 1.0
                  ) -> optax.GradientTransformationExtraArgs:
  """After the step, the pre-attention norm gains projected onto a constraint.

  For each selected gain leaf s with effective gain g = offset + s (Gemma:
  1 + scale) and update u, the new gain g+ = offset + s + u is projected::

      box:     g  <- clip(g+, -g_max, g_max)               per coordinate
      sphere:  g  <- sqrt(d) g+ / ||g+||_2                 per norm layer
               (a zero gain goes to the all-ones gain)
      fixed:   g  <- g                                     (zero update)

  and a selected norm bias b+ = b + u to abs(b) <= bias_max per coordinate
  (fixed: held). Like the retraction, the update returned is
  target - s, so `optax.apply_updates` lands on the projection (to one
  rounding of that addition). Every other leaf's update passes unchanged.

  Then every token entering attention has ||x|| <= ||g||_inf sqrt(d) +
  ||b||_2 (`attention_logit_bound`): box, g_max sqrt(d) + bias_max sqrt(d);
  sphere, at most d (||g||_inf <= ||g||_2); fixed, the gains as they are.

  Args:
    constraint: "box", "sphere" or "fixed" (`GAIN_CONSTRAINTS`).
    gains: the gain selector (`gain_specs`): a preset name (None: "auto"),
      a mapping {path_regex: GainSpec | None} or a callable.
    g_max: the box's half-width on the effective gain (box only), > 0.
    bias_max: the box on each norm bias coordinate (box and sphere), >= 0.

  Returns:
    An `optax.GradientTransformationExtraArgs` with an `optax.EmptyState`;
    its update needs params (extra arguments are ignored).

  Raises:
    ValueError: for an unknown constraint or a bound that is not positive
      (at once); at init and update, as `gain_specs`, and without params.

  Example:
    >>> import jax.numpy as jnp, optax, stiefel_optax as so
    >>> params = {"h_0": {"ln_1": {"scale": jnp.array([0.5, 1.0, 3.0])}}}
    >>> tx = so.project_gains("box", gains="nanogpt", g_max=2.0)
    >>> u, _ = tx.update({"h_0": {"ln_1": {"scale": jnp.ones(3)}}},
    ...                  tx.init(params), params)
    >>> optax.apply_updates(params, u)["h_0"]["ln_1"]["scale"].tolist()
    [1.5, 2.0, 2.0]
  """
  checks.check_choice("project_gains", "constraint", constraint,
                      GAIN_CONSTRAINTS)
  for arg, value, low in (("g_max", g_max, "> 0"),
                          ("bias_max", bias_max, ">= 0")):
    bad = (not isinstance(value, (int, float)) or isinstance(value, bool)
           or not math.isfinite(value) or value < 0
           or (low == "> 0" and value == 0))
    if bad:
      raise ValueError(f"project_gains: {arg}={value!r} must be a finite"
                       f" number {low}.")

  def init_fn(params):
    checks.require_params(params, "project_gains")
    gain_specs(params, gains)          # a selection that fails fails here
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    checks.require_params(params, "project_gains")
    checks.check_same_structure(updates, params, "project_gains")
    items = gain_specs(params, gains)
    out = []
    for (path, p, gain), u in zip(items, jax.tree.leaves(updates)):
      if gain is None:
        out.append(u)
      elif constraint == "fixed":
        out.append(jnp.zeros_like(u))
      else:
        p32 = p.astype(jnp.promote_types(p.dtype, jnp.float32))
        target = _project(p32 + u, gain, constraint, g_max, bias_max)
        out.append((target - p32).astype(u.dtype))
    return jax.tree.structure(updates).unflatten(out), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------
# The certified bound.


def _token_norm(gain, bias, axis: int, nu: float):
  """max over the batch of norm layers of ||g||_inf nu + ||b||_2."""
  g = np.moveaxis(np.abs(gain), axis, -1).max(-1) * nu
  if bias is not None:
    g = g + np.linalg.norm(np.moveaxis(bias, axis, -1), axis=-1)
  return float(np.max(g))


def _block_of(name: str) -> str:
  """The block of a norm leaf: its name without the norm module and the
  leaf ('h_0/ln_1/scale' -> 'h_0')."""
  return _module_of(_module_of(name))


def _qk_bias(params_by_path: dict, path: str, x, spec) -> Optional[np.ndarray]:
  """The frames' bias view (batch..., 1, r) of a kernel's sibling bias
  ('kernel'/'w'/'weight' -> 'bias'/'b'), or None. The bias has the kernel's
  shape without its row axes; a size-1 axis in their place makes it a
  (1 x r) 'frame' under the kernel's own spec."""
  head, _, leaf = path.rpartition("/")
  sibling = {"kernel": "bias", "w": "b", "weight": "bias"}.get(leaf)
  b = params_by_path.get(f"{head}/{sibling}" if head else sibling)
  if sibling is None or b is None:
    return None
  _, rows, _, _ = spec.axes(x.ndim, path)
  want = tuple(1 if i in rows else n for i, n in enumerate(x.shape))
  kept = tuple(n for i, n in enumerate(x.shape) if i not in rows)
  if tuple(b.shape) != kept:
    raise ValueError(
        f"{head}/{sibling}: shape {tuple(b.shape)} is the bias beside the"
        f" query/key kernel {path} of shape {tuple(x.shape)}, which expects"
        f" {kept} (the kernel's shape without its row axes). A bias that is"
        " not the projection's cannot be bounded here: rename it, or pass"
        " frames= that leaves this kernel out.")
  return np.asarray(views.to_frames(jnp.reshape(b, want), spec, path))


def attention_logit_bound(params, *, gains: GainSelector = None,
                          frames: selector.Selector = None,
                          epsilon: float = 0.0,
                          max_input_norm: Optional[float] = None) -> dict:
  """The largest attention logit any input can produce, per attention block.

  A block holds one pre-attention norm (selected by `gains`) and the
  query/key frames (selected by `frames`) under its path: the norm
  'h_0/ln_1/scale' is block 'h_0', and every frame whose path (or penzai
  label) starts with 'h_0/' is its attention. The token x = g n + b that
  enters attention has ||n||_2^2 = d v / (v + eps) for the normalized input
  n of a LayerNorm or RMSNorm with variance (mean square) v: at most d for
  every input and every eps >= 0, approached as ||y|| grows; with
  `max_input_norm` R (v <= R^2 / d), at most nu^2 = d R^2 / (R^2 + d eps).
  So ||x|| <= X = ||g||_inf nu + ||b||_2 (nu = sqrt(d) without R). Per head,
  q = W_Q^T x + b_q and k = W_K^T x + b_k, so by Cauchy-Schwarz::

      |q_i . k_j| / sqrt(r) <= (s_Q X + ||b_q||)(s_K X + ||b_k||) / sqrt(r)

  with s = sigma_max(W) (1 for an orthonormal frame). The block's bound is
  max over its frames f of (s_f X + ||b_f||)^2 / sqrt(r), X the max over
  its norm layers (a scanned stack is one block: the max over its layers).
  Rotary embeddings preserve norms and leave it unchanged.

  Computed on the host in float64 from the parameters' values.

  Args:
    params: the parameter tree (concrete values).
    gains: the gain selector (`gain_specs`); None: "auto".
    frames: the frame selector (`stiefel_optax.frame_specs`); None: "auto".
      Each selected kernel's sibling 'bias' ('b' beside 'w') is its q/k bias.
    epsilon: the norm's epsilon (>= 0); it lowers the bound only with
      `max_input_norm`.
    max_input_norm: a bound R on the norm layer's input ||y||_2, if one is
      known; None: no bound (the supremum over all inputs).

  Returns:
    {block: bound (float)}, one per attention block, in tree order.

  Raises:
    ValueError: as `gain_specs` and `frame_specs`; for a negative epsilon
      or max_input_norm, abstract (traced) params, a frame that lies under no
      selected norm's block, or a q/k bias that does not fit its kernel.

  Example (nanoGPT's block: fused c_attn, ln_1 of gain 2, orthonormal heads):

    >>> import jax, jax.numpy as jnp, stiefel_optax as so
    >>> d, heads = 16, 2
    >>> kernel = jax.random.normal(jax.random.key(0), (d, 3 * d))
    >>> params = {"h_0": {"ln_1": {"scale": 2.0 * jnp.ones(d)},
    ...                   "attn": {"c_attn": {"kernel": kernel}}}}
    >>> frames = {r"c_attn/kernel$": so.fused_qkv(heads)}
    >>> params = so.orthonormalize(params, frames)
    >>> bound = so.attention_logit_bound(params, gains="nanogpt", frames=frames)
    >>> {k: round(v, 4) for k, v in bound.items()}
    {'h_0': 22.6274}
    >>> round(2.0 ** 2 * d / (d // heads) ** 0.5, 4)   # g_max^2 d / sqrt(r)
    22.6274
  """
  if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
    raise ValueError(f"attention_logit_bound: epsilon={epsilon!r} must be a"
                     " number >= 0 (the norm layer's epsilon).")
  if max_input_norm is not None and not (
      isinstance(max_input_norm, (int, float)) and max_input_norm >= 0):
    raise ValueError(f"attention_logit_bound: max_input_norm="
                     f"{max_input_norm!r} must be None or a number >= 0.")
  leaves = jax.tree.leaves(params)
  if not all(checks.is_concrete(x) for x in leaves):
    raise ValueError("attention_logit_bound reads the parameters' values:"
                     " call it outside jit, on concrete params.")
  g_items = gain_specs(params, gains)
  by_path = {p: x for p, x, _ in g_items}
  names = {p: n for p, n, _ in leaf_names(params)}
  # Token norm per norm layer, then per block.
  gain_of = {_module_of(g.name): (x, g) for _, x, g in g_items
             if g is not None and not g.spec.bias}
  bias_of = {_module_of(g.name): x for _, x, g in g_items
             if g is not None and g.spec.bias}
  token = {}
  for module, (x, g) in gain_of.items():
    d = x.shape[g.axis]
    if max_input_norm is None:
      nu = math.sqrt(d)
    else:
      r2 = float(max_input_norm) ** 2
      nu = math.sqrt(d * r2 / (r2 + d * epsilon)) if r2 > 0 else 0.0
    eff = np.asarray(x, np.float64) + g.spec.offset
    b = bias_of.get(module)
    t = _token_norm(eff, None if b is None else np.asarray(b, np.float64),
                    g.axis, nu)
    block = _block_of(g.name)
    token[block] = max(token.get(block, 0.0), t)
  out = {}
  for path, x, spec in selector.frame_specs(params, frames):
    if spec is None:
      continue
    name = names[path]
    blocks = [b for b in token if b == "" or name.startswith(b + "/")]
    if not blocks:
      raise ValueError(
          f"{path}: shape {tuple(x.shape)}, a query/key kernel, lies under no"
          f" selected pre-attention norm's block (blocks: {sorted(token)}):"
          " its token norm is unknown. Select that block's norm with gains="
          " (a mapping {path_regex: GainSpec}), whose block (the path above"
          " the norm module) contains this kernel.")
    block = max(blocks, key=len)
    w = np.asarray(views.to_frames(jnp.asarray(x), spec, path), np.float64)
    sigma = np.linalg.norm(w, ord=2, axis=(-2, -1))       # per frame
    bq = _qk_bias(by_path, path, x, spec)
    beta = (np.zeros_like(sigma) if bq is None else
            np.linalg.norm(np.asarray(bq, np.float64), axis=(-2, -1)))
    r = w.shape[-1]
    bound = float(np.max(sigma * token[block] + beta)) ** 2 / math.sqrt(r)
    out[block] = max(out.get(block, 0.0), bound)
  return out
