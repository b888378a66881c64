"""Registered losses: the mean loss plus the predictive distribution it implies.

Each function returns the mean loss over the examples (the positions of every
axis but the last, weighted by `mask`) exactly as an ordinary loss would. Inside
`kd.value_and_grad` it also registers

* `n`, the number of examples the mean runs over, which rescales the captured
  output cotangents `ĝ = g / n` into per-example gradients for `G`;
* how to draw targets from the model's predictive distribution, which the Monte
  Carlo Fisher (`fisher="mc"`) uses: categorical for softmax, Bernoulli for
  sigmoid, a unit-variance Gaussian for the squared error, `N(μ, σ²)` for the
  Gaussian with a predicted variance, Poisson for counts (Martens & Grosse,
  2015, §5);
* its input, each example's curvature weight `w` (its mask weight, times a
  target distribution's sum `Σt` for the softmax) and its output Hessian `H`
  per example in closed form, which the exact Gauss-Newton products
  (`capture.curvature`) use: softmax `diag(p) − p pᵀ` (times `w`'s `Σt`),
  sigmoid `diag(p(1−p))`, squared error `I`, Poisson `diag(exp η)`,
  otherwise independent of the targets; for the Gaussian with a predicted
  variance, whose Hessian depends on the targets, its expectation over them,
  the Fisher `diag(1/σ², 1/(2σ⁴))` in `(μ, σ²)` (Martens 2014, §9.2: the
  generalised Gauss-Newton matrix of a non-canonical link).

A loss function may register several (a multi-task model's heads, a policy
and a value head): their curvatures add up, each times the derivative of the
value the function returns in that loss (`capture.curvature`).

Integer labels outside `[0, classes)` (at a position the mask keeps) make the
loss and every gradient NaN, so the step is skipped (`core.faults`) instead of
training on the clamped or zero-filled values an out-of-range gather gives;
so do a negative target distribution's entry and a sigmoid label outside
`[0, 1]`, which make the loss unbounded below. Target distributions need not
sum to 1: the cross-entropy's Hessian in the logits is `(Σt)(diag(p) − p pᵀ)`,
so each example's curvature is weighted by its `Σt` (a zero row, padding,
has none), in the Gauss-Newton products and the Monte Carlo Fisher alike.
"""

from __future__ import annotations

import jax
from jax.typing import ArrayLike
import jax.numpy as jnp

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import context as _context


def _at_least_f32(x: jax.Array) -> jax.Array:
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _mean(per_example: jax.Array, mask: jax.Array | None):
  """`(Σ w l / Σ w, Σ w)` (a masked position's targets are 0 by then:
  `_kept_targets`)."""
  if mask is None:
    return jnp.mean(per_example), jnp.asarray(per_example.size, per_example.dtype)
  mask = jnp.broadcast_to(mask, per_example.shape).astype(per_example.dtype)
  n = jnp.sum(mask)
  return jnp.sum(per_example * mask) / _context.denominator(n), n


def _poisoned(value: jax.Array, invalid: jax.Array, mask: jax.Array | None) -> jax.Array:
  """`value`, times NaN if any kept example is `invalid`: the loss and, through
  the chain rule, every gradient and statistic become NaN."""
  if mask is not None:
    invalid = invalid & (jnp.broadcast_to(mask, invalid.shape) != 0)
  return value * jnp.where(jnp.any(invalid), jnp.nan, 1.0).astype(value.dtype)


def _softmax_hessian(logits: jax.Array, u: jax.Array, w: jax.Array) -> jax.Array:
  """`uᵀ (diag(p) − p pᵀ) w` per example, `p = softmax(logits)`."""
  p = jax.nn.softmax(logits, axis=-1)
  return (jnp.sum(p * u * w, axis=-1)
          - jnp.sum(p * u, axis=-1) * jnp.sum(p * w, axis=-1))


def _sigmoid_hessian(logits: jax.Array, u: jax.Array, w: jax.Array) -> jax.Array:
  """`uᵀ diag(p (1 − p)) w` per example, `p = sigmoid(logits)`."""
  p = jax.nn.sigmoid(logits)
  return jnp.sum(p * (1 - p) * u * w, axis=-1)


def _squared_error_hessian(predictions: jax.Array, u: jax.Array, w: jax.Array
                           ) -> jax.Array:
  """`uᵀ w` per example (the Hessian of `½‖y − t‖²` is the identity)."""
  del predictions
  return jnp.sum(u * w, axis=-1)


def _gaussian_fisher(inputs: jax.Array, u: jax.Array, w: jax.Array) -> jax.Array:
  """`uᵀ diag(1/σ², 1/(2σ⁴)) w` per example, `inputs` `[..., 2d]` the means
  then the variances: the Fisher of `N(μ, σ²)` in `(μ, σ²)`."""
  precision = 1 / inputs[..., inputs.shape[-1] // 2:]
  return jnp.sum(jnp.concatenate([precision, 0.5 * precision ** 2], axis=-1) * u * w,
                 axis=-1)


def _poisson_hessian(log_rates: jax.Array, u: jax.Array, w: jax.Array) -> jax.Array:
  """`uᵀ diag(exp η) w` per example, `η` the log-rates."""
  return jnp.sum(jnp.exp(log_rates) * u * w, axis=-1)


def _check_targets(name: str, inputs: jax.Array, targets: jax.Array,
                   expected: tuple[int, ...], allowed: str, what: str = "targets"
                   ) -> None:
  """`targets` (the argument `what`) must have the `expected` shape
  (broadcasting, e.g. `[B]` targets against `[B, 1]` predictions, would
  silently pair every example with every target); `allowed` says what may be
  passed."""
  if jnp.shape(targets) != tuple(expected):
    raise ValueError(f"kd.losses.{name}: {what} of shape {jnp.shape(targets)} for "
                     f"inputs of shape {jnp.shape(inputs)}; expected {allowed}.")


def _mask_shape_error(shape: tuple, target: tuple) -> str | None:
  """Why a mask of `shape` cannot weigh values of shape `target` (None: it
  can): a scalar, or one axis per axis of `target`, each of its size or 1. A mask
  of fewer axes would be matched from the right: a per-image `[B]` weight of
  `[B, H, W]` pixels weighed the columns where `W = B`."""
  if not shape or (len(shape) == len(target)
                   and all(m in (1, t) for m, t in zip(shape, target))):
    return None
  hint = ""
  if 0 < len(shape) < len(target) and shape == target[:len(shape)]:
    index = ", ".join([":"] * len(shape) + ["None"] * (len(target) - len(shape)))
    hint = f" (a weight per leading axis: mask[{index}])"
  return f"give it one axis per axis of {target}, each of that size or 1{hint}"


def _check_examples(name: str, inputs: jax.Array) -> None:
  """Inside `kd.value_and_grad`, refuses `[B]` inputs of a loss whose outputs
  are the last axis: they are one example of `B` outputs (a squeezed `[B, 1]`
  would silently make the mean a sum, `n = 1`, and `G` `B` times larger).
  Elsewhere (evaluation, a per-example loss under `jax.vmap`) the value is
  what it always is."""
  if jnp.ndim(inputs) < 2 and _context.current() is not None:
    raise ValueError(
        f"kd.losses.{name}: inputs of shape {jnp.shape(inputs)}; the last axis holds "
        "each example's outputs, so give B examples of one output as [B, 1] "
        "(x[:, None], and the targets likewise), one example of several outputs as "
        "[1, O] (x[None]).")


def _check_mask(name: str, inputs: jax.Array, mask: jax.Array | None) -> None:
  """`mask` must weigh the examples, `inputs.shape[:-1]` (`_mask_shape_error`)."""
  examples = tuple(jnp.shape(inputs)[:-1])
  why = None if mask is None else _mask_shape_error(tuple(jnp.shape(mask)), examples)
  if why and tuple(jnp.shape(mask)) == tuple(jnp.shape(inputs)):
    why += (" (a weight per output, e.g. missing targets: make each output an example, "
            "inputs[..., None] and targets[..., None], with this mask)")
  if why:
    raise ValueError(f"kd.losses.{name}: mask of shape {jnp.shape(mask)} for examples "
                     f"of shape {examples} (the inputs' {jnp.shape(inputs)} without "
                     f"the last axis): {why}.")


def _zeroed_where_masked(rows: jax.Array, mask: jax.Array, examples: tuple,
                         fill: float = 0.0) -> jax.Array:
  """`rows` (`[*examples, k]`) with the rows that `mask` leaves out set to
  `fill` (0)."""
  kept = jnp.broadcast_to(mask, examples) != 0
  return jnp.where(kept[..., None], rows, jnp.full_like(rows, fill))


def _kept_inputs(name: str, inputs: jax.Array, mask: jax.Array | None) -> jax.Array:
  """`inputs`, the mask checked, with the masked rows' set to 0: padding's
  logits may be `-inf` (a padded contrastive batch), whose loss `inf` would
  reach the mean as `0 · inf` and the curvature's products as NaN; their
  cotangents are 0."""
  _check_mask(name, inputs, mask)
  if mask is None:
    return inputs
  return _zeroed_where_masked(inputs, mask, jnp.shape(inputs)[:-1])


def _kept_targets(targets: jax.Array, mask: jax.Array | None, inputs: jax.Array
                  ) -> jax.Array:
  """Floating `targets` with the masked positions' set to 0: a NaN target
  there (padding) would otherwise reach the gradient as `0 · NaN`."""
  if mask is None or not jnp.issubdtype(targets.dtype, jnp.floating):
    return targets
  return _zeroed_where_masked(targets, mask, jnp.shape(inputs)[:-1])


def _curvature_weights(mask: jax.Array | None, scale: jax.Array | None,
                       shape: tuple[int, ...], dtype) -> jax.Array | None:
  """`w_x`, the weight of each example's curvature: its mask weight times the
  output Hessian's scale (None for both: 1 everywhere)."""
  parts = [jnp.broadcast_to(x, shape).astype(dtype) for x in (mask, scale) if x is not None]
  return None if not parts else parts[0] if len(parts) == 1 else parts[0] * parts[1]


def _register(name: str, loss_of_targets, targets, sample, mask, inputs,
              output_hessian, invalid: jax.Array | None = None,
              hessian_scale: jax.Array | None = None):
  """Registers the loss (`hessian_scale`: per example, the factor the output
  Hessian `H(z)` takes with these targets, e.g. a target distribution's sum;
  `inputs` are `_kept_inputs`', the mask checked there)."""
  kept = _kept_targets(jnp.asarray(targets), mask, inputs)
  per_example = loss_of_targets(kept)
  value, n = _mean(per_example, mask)
  weights = _curvature_weights(mask, None if hessian_scale is None else hessian_scale(kept),
                               per_example.shape, per_example.dtype)
  if mask is not None:      # weights: a negative (signed advantages) or NaN one poisons
    negative = ~(jnp.broadcast_to(jnp.asarray(mask), per_example.shape) >= 0)
    invalid = negative if invalid is None else invalid | negative
  if invalid is not None:
    value = _poisoned(value, invalid, mask)
  trace = _context.current()
  unweighted, share = value, None
  if mask is not None:     # n differs between devices or slices: weighed as a share
    value, share = _context.weighted(value, n)
  if trace is not None and per_example.size == 0:
    raise ValueError(
        f"kd.losses.{name}: inputs of shape {jnp.shape(inputs)}, no examples (an empty "
        "batch: a data loader's last one, an empty shard): the mean loss is NaN and the "
        "step would still move the parameters by its momentum. Leave such a batch out "
        "(drop the remainder) or pad it with masked rows.")
  if trace is not None and trace.loss_offset is not None:
    value = value + jnp.asarray(_context.offset_of(trace), value.dtype)
  if trace is not None and trace.mode == _context.DISCOVER and (
      _compat.inside_another_trace(trace.top)):
    raise ValueError(
        f"kd.losses.{name} ran inside a JAX transform within the loss function "
        "(jax.checkpoint, jax.jit, lax.scan, vmap, cond, ...); K-FAC reads the loss's "
        "inputs after the pass, outside the transform. Call it at the loss function's "
        "top level, on the model's output (checkpoint the model with kd.remat, "
        "nn.remat or nnx.remat, not the loss).")
  if trace is not None:
    def sampled_loss(rng: jax.Array) -> jax.Array:
      """`Σ √w l(ŷ) / n` on drawn targets `ŷ`: its per-example cotangents
      `√w ∂l/n` make `G = (1/n) Σ w ∂l ∂lᵀ`, whose expectation is the Gauss-
      Newton matrix `(1/n) Σ w JᵀHJ` of the weighted mean (w itself would count
      each weight twice)."""
      per_draw = loss_of_targets(jax.lax.stop_gradient(sample(rng)))
      if weights is None:
        return jnp.mean(per_draw)
      root = jnp.sqrt(jax.lax.stop_gradient(weights)).astype(per_draw.dtype)
      return jnp.sum(root * per_draw) / _context.denominator(n)
    trace.losses.append(_context.RegisteredLoss(
        name, value, n, sampled_loss, inputs=inputs, weights=weights,
        output_hessian=output_hessian,
        static_num_examples=per_example.size if mask is None else None,
        unweighted=unweighted, share=share))
  return value


def softmax_cross_entropy(logits: ArrayLike, labels: ArrayLike,
                          mask: ArrayLike | None = None) -> jax.Array:
  """Mean of `-log softmax(logits)[label]`; `labels` are integer classes of shape
  `logits.shape[:-1]` or target distributions of shape `logits.shape`."""
  logits = _kept_inputs("softmax_cross_entropy", logits, mask)
  classes = logits.shape[-1]
  if classes == 1:
    raise ValueError(
        f"kd.losses.softmax_cross_entropy: logits of shape {logits.shape}, one class: "
        "its softmax is 1 whatever the logit (loss 0, gradients 0). For one binary "
        "output use kd.losses.sigmoid_cross_entropy.")
  logits32 = _at_least_f32(logits)
  log_probs = jax.nn.log_softmax(logits32, axis=-1)

  def loss_of(targets: jax.Array) -> jax.Array:
    if jnp.issubdtype(targets.dtype, jnp.integer):
      safe = jnp.clip(targets, 0, classes - 1)
      return -jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    return -jnp.sum(targets * log_probs, axis=-1)

  def sample(rng: jax.Array) -> jax.Array:
    return jax.random.categorical(rng, jax.lax.stop_gradient(logits32), axis=-1)

  labels = jnp.asarray(labels)
  integer = jnp.issubdtype(labels.dtype, jnp.integer)
  one_hot = integer and labels.shape == logits.shape
  _check_targets("softmax_cross_entropy", logits, labels,
                 logits.shape[:-1] if integer else logits.shape,
                 f"integer classes of shape {logits.shape[:-1]} or floating target "
                 f"distributions of shape {logits.shape}" + (
                     " (integer one-hot rows: pass them as floats, or their argmax)"
                     if one_hot else ""))
  if integer:
    invalid, scale = (labels < 0) | (labels >= classes), None
  else:     # a negative weight: unbounded below; the Hessian is (Σt)(diag(p) − p pᵀ)
    invalid = jnp.any(labels < 0, axis=-1)
    scale = lambda kept: jnp.sum(_at_least_f32(kept), axis=-1)
  return _register("softmax_cross_entropy", loss_of, labels, sample, mask, logits,
                   _softmax_hessian, invalid, scale)


def sigmoid_cross_entropy(logits: ArrayLike, labels: ArrayLike,
                          mask: ArrayLike | None = None) -> jax.Array:
  """Mean over examples of the binary cross-entropies summed over the last axis
  (independent Bernoulli outputs); `labels` in [0, 1], shaped like `logits`."""
  _check_examples("sigmoid_cross_entropy", logits)
  _check_targets("sigmoid_cross_entropy", logits, labels, jnp.shape(logits),
                 f"labels of shape {jnp.shape(logits)}")
  logits = _kept_inputs("sigmoid_cross_entropy", logits, mask)
  logits32 = _at_least_f32(logits)
  labels = jnp.asarray(labels)

  def loss_of(targets: jax.Array) -> jax.Array:
    targets = targets.astype(logits32.dtype)
    per_output = (jnp.maximum(logits32, 0) - logits32 * targets
                  + jnp.log1p(jnp.exp(-jnp.abs(logits32))))
    return jnp.sum(per_output, axis=-1)

  def sample(rng: jax.Array) -> jax.Array:
    probs = jax.nn.sigmoid(jax.lax.stop_gradient(logits32))
    return jax.random.bernoulli(rng, probs).astype(probs.dtype)

  outside = jnp.any((labels < 0) | (labels > 1), axis=-1)   # unbounded below
  return _register("sigmoid_cross_entropy", loss_of, labels, sample, mask, logits,
                   _sigmoid_hessian, outside)


def squared_error(predictions: ArrayLike, targets: ArrayLike,
                  mask: ArrayLike | None = None) -> jax.Array:
  """Mean over examples of `½ Σ (prediction − target)²` over the last axis: the
  negative log-likelihood of a unit-variance Gaussian, up to a constant;
  `targets` shaped like `predictions`."""
  _check_examples("squared_error", predictions)
  _check_targets("squared_error", predictions, targets, jnp.shape(predictions),
                 f"targets of shape {jnp.shape(predictions)}")
  predictions = _kept_inputs("squared_error", predictions, mask)
  predictions32 = _at_least_f32(predictions)

  def loss_of(t: jax.Array) -> jax.Array:
    return 0.5 * jnp.sum(jnp.square(predictions32 - t.astype(predictions32.dtype)), axis=-1)

  def sample(rng: jax.Array) -> jax.Array:
    mean = jax.lax.stop_gradient(predictions32)
    return mean + jax.random.normal(rng, mean.shape, mean.dtype)

  return _register("squared_error", loss_of, targets, sample, mask, predictions,
                   _squared_error_hessian)


def gaussian_nll(means: ArrayLike, variances: ArrayLike, targets: ArrayLike,
                 mask: ArrayLike | None = None) -> jax.Array:
  """Mean over examples of `½ Σ (log σ² + (t − μ)²/σ²)` over the last axis:
  the negative log-likelihood of a Gaussian whose mean `μ` and variance `σ²`
  the model predicts (e.g. `σ² = exp(s)` or `softplus(s)`), up to `½ log 2π`
  per output; `variances` and `targets` shaped like `means`. Registered on
  `(μ, σ²)` with the Fisher `diag(1/σ², 1/(2σ⁴))` (kfac-jax's
  `NormalMeanVarianceNegativeLogProbLoss`); a variance ≤ 0 at a kept example
  makes the loss NaN (a skipped step)."""
  name = "gaussian_nll"
  _check_examples(name, means)
  for what, value in (("variances", variances), ("targets", targets)):
    _check_targets(name, means, value, jnp.shape(means), f"{what} of shape "
                   f"{jnp.shape(means)}, as the means", what)
  means = _kept_inputs(name, means, mask)
  variances = jnp.asarray(variances)
  if mask is not None:                  # (a masked row's variance 0: log 0)
    variances = _zeroed_where_masked(variances, mask, jnp.shape(means)[:-1], fill=1.0)
  dtype = jnp.result_type(means, variances)
  inputs = jnp.concatenate([means.astype(dtype), variances.astype(dtype)], axis=-1)
  inputs32 = _at_least_f32(inputs)
  mu, var = jnp.split(inputs32, 2, axis=-1)

  def loss_of(t: jax.Array) -> jax.Array:
    return 0.5 * jnp.sum(jnp.log(var) + jnp.square(t.astype(mu.dtype) - mu) / var, axis=-1)

  def sample(rng: jax.Array) -> jax.Array:
    m, v = jax.lax.stop_gradient((mu, var))
    return m + jnp.sqrt(v) * jax.random.normal(rng, m.shape, m.dtype)

  return _register(name, loss_of, targets, sample, mask, inputs, _gaussian_fisher,
                   jnp.any(~(var > 0), axis=-1))


# The rate above which the Monte Carlo Fisher draws a Poisson count's normal
# approximation (its mean and variance exact; skewness 1/√λ ≤ 0.03).
_POISSON_NORMAL_ABOVE = 1e3


def poisson_nll(log_rates: ArrayLike, counts: ArrayLike,
                mask: ArrayLike | None = None) -> jax.Array:
  """Mean over examples of `Σ (exp(η) − t η)` over the last axis: the negative
  log-likelihood of independent Poisson counts `t` with rates `exp(η)`, up to
  `log t!`; `counts` shaped like `log_rates`. Its Hessian in `η`, the Fisher,
  is `diag(exp η)`; a negative count at a kept example makes the loss NaN (a
  skipped step)."""
  name = "poisson_nll"
  _check_examples(name, log_rates)
  _check_targets(name, log_rates, counts, jnp.shape(log_rates),
                 f"counts of shape {jnp.shape(log_rates)}", "counts")
  log_rates = _kept_inputs(name, log_rates, mask)
  eta = _at_least_f32(log_rates)
  counts = jnp.asarray(counts)

  def loss_of(t: jax.Array) -> jax.Array:
    return jnp.sum(jnp.exp(eta) - t.astype(eta.dtype) * eta, axis=-1)

  def sample(rng: jax.Array) -> jax.Array:
    """Poisson counts; above `_POISSON_NORMAL_ABOVE` their normal
    approximation `λ + √λ·ε`, whose variance is λ too (jax's sampler draws
    int32 counts, saturating at 2³¹, and loses its variance to rounding from
    λ ≈ 1e6: `G` came out up to 1e10 times too large)."""
    rates = jnp.exp(jax.lax.stop_gradient(eta))
    small, large = jax.random.split(rng)
    large_rates = rates > _POISSON_NORMAL_ABOVE
    counts = jax.random.poisson(small, jnp.where(large_rates, 1.0, rates), rates.shape)
    normal = rates + jnp.sqrt(rates) * jax.random.normal(large, rates.shape, rates.dtype)
    return jnp.where(large_rates, normal, counts.astype(rates.dtype))

  return _register(name, loss_of, counts, sample, mask, log_rates, _poisson_hessian,
                   jnp.any(counts < 0, axis=-1))


def masked_mean(values: ArrayLike, mask: ArrayLike) -> jax.Array:
  """`Σ mask·values / Σ mask` over every axis (0 for an all-zero mask): a term
  of the loss besides the registered one averaged over masked positions, e.g.
  a z-loss over the real tokens. Not registered (no curvature); inside
  `kd.value_and_grad`, in `shard_map` or `accumulate`'s slices, weighted as
  the registered loss is, by its share of the global batch's (`shares`), so
  that it comes out the global batch's mean: a hand-written masked mean comes
  out the plain mean of the local batches' means."""
  values = jnp.asarray(values)
  why = _mask_shape_error(tuple(jnp.shape(mask)), tuple(jnp.shape(values)))
  if why:
    raise ValueError(f"kd.losses.masked_mean: mask of shape {jnp.shape(mask)} for "
                     f"values of shape {jnp.shape(values)}: {why}.")
  mask = jnp.broadcast_to(mask, jnp.shape(values))
  mask = mask.astype(jnp.promote_types(values.dtype, jnp.float32))
  n = jnp.sum(mask)
  trace = _context.current()
  if trace is not None and trace.top is not None and (
      _compat.inside_another_trace(trace.top)):
    raise ValueError(
        "kd.losses.masked_mean ran inside a JAX transform within the loss function "
        "(lax.scan, nn.scan, jax.checkpoint, vmap, cond, ...), where its share of "
        "the global batch cannot be counted: return the values and mask out of the "
        "transform and average them at the loss function's top level, or average "
        "them with plain jnp there (the local batch's mean).")
  return _context.weighted(jnp.sum(values * mask) / _context.denominator(n), n)[0]
