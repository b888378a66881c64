"""`kd.kfac`: K-FAC as a whole optimizer, with SGD after it or adaptive.

The non-adaptive optimizer is KAISA's: `scale_by_kfac`, weight decay, SGD with
momentum. The adaptive one (`kfac.adaptive`) chooses the learning rate and
momentum from the exact quadratic model, and optionally the damping (or,
with both fixed, the damping alone). Both are wrapped in `skip_faulty_steps`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import optax

from kfac_jax_dist.capture import registry
from kfac_jax_dist.core import cadence, faults, settings
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.kfac import adaptive
from kfac_jax_dist.kfac.config import Correction, KfacConfig, Method
from kfac_jax_dist.kfac.transform import scale_by_kfac


# KAISA's κ = 1e-3 as `kd.kfac`'s default, off in adaptive mode unless a value
# is passed: static, so recognisable as the default under inject_hyperparams.
KL_CLIP = settings.StaticDefault(1e-3, "1e-3")
# kd.kfac's damping and decomposition cadence when none is given: the
# preconditioner's own defaults (1e-3, every step), and adaptive mode's.
DAMPING = KfacConfig.damping
INVERSE_UPDATE_EVERY = KfacConfig.inverse_update_every
ADAPTIVE_DAMPING = 0.1     # the initial λ
ADAPTIVE_INVERSE_UPDATE_EVERY = 10


def _kaisa_chain(layers: registry.LayerRegistry | None, learning_rate: Any, momentum: Any,
                 weight_decay: float, nesterov: bool, kl_clip: Any, options: dict
                 ) -> optax.GradientTransformationExtraArgs:
  """The non-adaptive `kd.kfac`: K-FAC, weight decay, SGD (see `kfac`)."""
  settings.check_first_order_tail(learning_rate, momentum, weight_decay)
  return faults.skip_faulty_steps(optax.chain(
      # The learning rate is scale_by_kfac's to check (KfacConfig.settings_ok).
      *faults.poison_unless(settings.first_order_tail_checks(None, momentum, weight_decay)),
      scale_by_kfac(layers, kl_clip=kl_clip, learning_rate=learning_rate, **options),
      *settings.first_order_tail(learning_rate, momentum, weight_decay, nesterov)))


def _adaptive_chain(layers: registry.LayerRegistry | None, learning_rate: Any, momentum: Any,
                    weight_decay: float, nesterov: bool, kl_clip: Any, options: dict, *,
                    grad_fn: Callable | None, adaptive_options: dict[str, Any]
                    ) -> optax.GradientTransformationExtraArgs:
  """The adaptive `kd.kfac` (`kfac.adaptive`): K-FAC's direction scaled by the
  quadratic model's coefficients (or fixed ones, the damping adapted), no SGD
  after it (see `kfac`). `adaptive_options` are `AdaptiveConfig`'s other
  fields, checked after nesterov and the KL clip."""
  if nesterov:
    raise ValueError("nesterov applies to the SGD of the non-adaptive mode; adaptive "
                     "momentum is the model's.")
  kl_clip = None if kl_clip is KL_CLIP else kl_clip
  if learning_rate is None or momentum is None:
    # Before KfacConfig, whose own message would ask for a learning rate.
    adaptive.check_no_kl_clip(kl_clip)
  kfac_config = KfacConfig(kl_clip=kl_clip, learning_rate=learning_rate, **options)
  config = adaptive.AdaptiveConfig(learning_rate=learning_rate, momentum=momentum,
                                   weight_decay=weight_decay, **adaptive_options)
  return faults.skip_faulty_steps(adaptive.scale_by_adaptive_kfac(
      layers, grad_fn, kfac_config=kfac_config, adaptive_config=config))


# `kd.kfac`'s options that only adaptive mode reads.
ADAPTIVE_ONLY = ("micro_batches", "reject_steps", "reject_damping_increase_factor",
                 "damping_adaptation_interval", "damping_adaptation_decay",
                 "min_damping", "max_damping")


def _check_no_adaptive_options(arguments: dict[str, Any]) -> None:
  """Outside adaptive mode, its own options (of `kd.kfac`'s `arguments`)
  other than their defaults are refused by name: they would do nothing."""
  defaults = inspect.signature(kfac).parameters
  for name in ADAPTIVE_ONLY:
    value = arguments[name]
    if settings.differs_from_default(value, defaults[name].default):
      raise ValueError(f"{name}={value!r} needs adaptive mode: learning_rate=None, "
                       "momentum=None or adapt_damping=True (and grad_fn).")


def _mode_defaults(adaptive_mode: bool, damping: Any, inverse_update_every: Any,
                   stale_threshold: float | None) -> tuple[Any, Any]:
  """`damping` and `inverse_update_every`, a None replaced by the mode's
  default (stale statistics refresh at their own intervals: every step)."""
  if damping is None:
    damping = ADAPTIVE_DAMPING if adaptive_mode else DAMPING
  if inverse_update_every is None:
    adaptive_cadence = adaptive_mode and stale_threshold is None
    inverse_update_every = (ADAPTIVE_INVERSE_UPDATE_EVERY if adaptive_cadence
                            else INVERSE_UPDATE_EVERY)
  return damping, inverse_update_every


def kfac(learning_rate: cadence.ScalarOrSchedule | None, momentum: float | None = 0.9,
         weight_decay: float = 0.0, nesterov: bool = False,
         layers: registry.LayerRegistry | None = None, *,
         damping: cadence.ScalarOrSchedule | None = None, factor_decay: float = 0.95,
         factor_update_every: cadence.ScalarOrSchedule = 1,
         inverse_update_every: cadence.ScalarOrSchedule | None = None,
         method: Method = "eigen",
         kl_clip: cadence.ScalarOrSchedule | None = KL_CLIP, factor_dtype: Any = None,
         second_order_dtype: Any = None,
         skip: Sequence[str] = (), max_factor_dim: int | None = None,
         distribution: distribution_lib.Distribution | None = None,
         stale_threshold: float | None = None, grad_fn: Callable | None = None,
         adapt_damping: bool = False, damping_adaptation_interval: int = 5,
         damping_adaptation_decay: float = 0.9, min_damping: float = 1e-3,
         max_damping: float | None = None, micro_batches: int | None = None,
         reject_steps: bool = False, reject_damping_increase_factor: float = 1.0,
         eigenvalue_correction: Correction | None = None,
         ) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning followed by SGD with momentum, as in KAISA, or adaptive.

  `skip_faulty_steps(optax.chain(scale_by_kfac(...),
  add_decayed_weights(weight_decay), sgd(learning_rate, momentum, nesterov)))`:
  weight decay is added to the preconditioned gradient and goes through
  momentum, like PyTorch SGD after KAISA's `preconditioner.step()`, and a step
  that K-FAC skips (non-finite gradient, statistic or update) changes nothing in the
  chain's state. Works with `optax.inject_hyperparams` (the options that shape
  the state or program in its `static_args`, else a clear error: docs/api.md).

  Adaptive mode (Martens & Grosse 2015, §6-7; `kfac.adaptive`): with
  `learning_rate=None` and/or `momentum=None` the update is `αΔ + μv` with the
  adapted coefficients minimising the exact quadratic model on the batch
  (`grad_fn` computes the curvature products; `update` then takes
  `kfac_batch=`, the arguments `grad_fn` received after the parameters);
  `adapt_damping=True` adapts the damping too (Levenberg-Marquardt), or alone
  with both numbers given (`d = −ηΔ + μv`, kfac-jax's `use_adaptive_damping`
  by itself). No SGD follows; weight decay enters the objective's gradient and
  curvature and K-FAC's damping (`λ + w`); the KL clip is off unless given
  (with both numbers only).

  Args:
    learning_rate: `η`, a float or an optax schedule of the update count; the
      KL clip uses it too. None: adapted (needs `grad_fn`).
    momentum: heavy-ball momentum of the SGD step, in [0, 1). KAISA's 0.9;
      where the KL clip binds on a small problem, 0 often works better (the
      number 0 keeps no momentum trace). None: adapted (needs `grad_fn`).
    weight_decay: coefficient added to the preconditioned gradient times the
      parameters (`optax.add_decayed_weights`), ≥ 0.
    nesterov: Nesterov momentum instead of heavy ball.
    layers: the `LayerRegistry` of `kd.value_and_grad(loss_fn).discover(params,
      *batch)`; `init` needs it: it fixes the state's layout.
    damping: `γ` of `(A ⊗ G + γI)⁻¹`, positive; a float or a schedule (with method
      "inverse" a new value acts at the next inverse update). None: `DAMPING` (1e-3),
      or in adaptive mode `ADAPTIVE_DAMPING` (0.1) as the initial λ (1e-2 diverged
      on the digits CNN: docs/concepts.md, adaptive K-FAC).
    factor_decay: weight of the *old* value in the running factor averages,
      in [0, 1) (the papers' ξ is `1 − factor_decay`).
    factor_update_every: compute the statistics and update the running factors
      (and send them, when distributed) when `count % factor_update_every ==
      0`; a positive int or a schedule. The default 1 does this every step;
      KAISA uses 10.
    inverse_update_every: recompute the eigendecompositions or inverses when
      `count % inverse_update_every == 0`; a positive int or a schedule. None:
      `INVERSE_UPDATE_EVERY` (1: every factor decomposed every step, `O(d³)` each,
      K-FAC's costliest part; KAISA uses 100), or in adaptive mode
      `ADAPTIVE_INVERSE_UPDATE_EVERY` (10; 1 with `stale_threshold`).
    method: "eigen" (exact `(A⊗G + γI)⁻¹` from eigendecompositions; four
      matrix products per layer and step) or "inverse" (π-damped Cholesky
      inverses, an approximation; two products).
    kl_clip: `κ` of KAISA's KL clip (Eq. 5.1), a float or a schedule; None
      turns it off. The default 1e-3 is KAISA's; when the clip binds, the
      step no longer depends on `learning_rate`.
    factor_dtype, second_order_dtype: storage dtypes of the running factors
      (None: float32) and of the eigenbases and eigenvalues or inverses (None:
      the compute dtype; KAISA's `inv_dtype`); `jnp.bfloat16` halves either;
      decompositions and products run in float32 at least.
    skip: regular expressions searched in the layer names; matching layers
      (e.g. a vocabulary-sized output layer) pass through unpreconditioned. A
      pattern that matches no layer raises.
    max_factor_dim: factors of larger dimension are kept diagonal (never formed
      as matrices, given `opt_state=`); None: all full (refused past 30000).
    distribution: a `kd.Distribution`: `update` then runs inside `shard_map`
      over its axis, with the state's specs from `kd.partition_specs`. None:
      one device.
    stale_threshold: `α` of SP-NGD's stale statistics (the paper uses 0.1):
      each factor is refreshed at its own adaptive interval. Needs both
      intervals at 1; with method "inverse" a refresh of either factor of a
      layer inverts both (π couples them). None: off.
    eigenvalue_correction: "ekfac": eigenvalue-corrected K-FAC (George et
      al. 2018, `kfac.correction`): Dense and Conv layers are scaled by the
      measured second moment of the per-example gradients in K-FAC's
      eigenbasis; pass `opt_state=` to `grad_fn`. Method "eigen". None:
      K-FAC's eigenvalues.
    grad_fn: the `kd.value_and_grad(loss_fn)` whose statistics feed this
      transform; needed in adaptive mode (exact curvature products, the
      loss for the damping's reduction ratio).
    adapt_damping: adapt `damping` (its initial value) by the
      Levenberg-Marquardt rule every `damping_adaptation_interval` steps by
      `damping_adaptation_decay ** interval`, within `[min_damping,
      max_damping]` (kfac-jax's defaults but the floor); selects adaptive mode.
      One forward pass on those steps (and with both numbers given, `d`'s
      tangent pass; none on the other steps).
    damping_adaptation_interval: `T` of the rule above.
    damping_adaptation_decay: `ω` of the rule above, in (0, 1).
    min_damping: lower bound of the adapted damping, in the units of the mean
      loss's curvature. Not kfac-jax's 1e-8: where the network fits each
      batch, ρ ≈ 1 and λ sinks to the floor, where training can diverge;
      1e-3 kept the three example tasks stable (docs/troubleshooting.md).
    max_damping: upper bound of the adapted damping (None: none).
    micro_batches: adaptive mode only: compute the curvature products and the
      reduction ratio's losses over this many slices of `kfac_batch`, one at a
      time (the `k` of `grad_fn.accumulate(..., micro_batches=k)`: the memory
      of one slice, the same numbers); None: the whole batch at once. It
      shapes the program: with `optax.inject_hyperparams`, name it in
      `static_args`.
    reject_steps: adaptive mode only: an update that raises the objective on
      its batch is not taken (kfac-jax's `use_step_rejection`; the state counts
      it in `rejected`); one forward pass each step (two with both numbers given).
    reject_damping_increase_factor: λ's factor on a rejected step, ≥ 1, the
      result kept within the damping bounds (needs `adapt_damping`);
      kfac-jax's default 1.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update(grads, state,
    params, kfac_stats=stats)` takes the statistics of `kd.value_and_grad`
    (and, in adaptive mode, `kfac_batch=`).
  """
  adaptive_mode = learning_rate is None or momentum is None or adapt_damping
  damping, inverse_update_every = _mode_defaults(adaptive_mode, damping,
                                                 inverse_update_every, stale_threshold)
  options = dict(damping=damping, factor_decay=factor_decay,
                 factor_update_every=factor_update_every,
                 inverse_update_every=inverse_update_every, method=method,
                 factor_dtype=factor_dtype, second_order_dtype=second_order_dtype,
                 skip=skip, max_factor_dim=max_factor_dim,
                 distribution=distribution, stale_threshold=stale_threshold,
                 eigenvalue_correction=eigenvalue_correction)
  if not adaptive_mode:
    _check_no_adaptive_options(locals())
    return _kaisa_chain(layers, learning_rate, momentum, weight_decay, nesterov,
                        KL_CLIP.value if kl_clip is KL_CLIP else kl_clip, options)
  return _adaptive_chain(layers, learning_rate, momentum, weight_decay, nesterov,
                         kl_clip, options, grad_fn=grad_fn, adaptive_options=dict(
                             adapt_damping=adapt_damping,
                             damping_adaptation_interval=damping_adaptation_interval,
                             damping_adaptation_decay=damping_adaptation_decay,
                             min_damping=min_damping, max_damping=max_damping,
                             micro_batches=settings.static(
                                 "micro_batches", 1 if micro_batches is None else micro_batches),
                             reject_steps=reject_steps,
                             reject_damping_increase_factor=reject_damping_increase_factor))
