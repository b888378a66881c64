"""Adaptive K-FAC: learning rate, momentum and damping from the exact quadratic model.

Martens & Grosse 2015, §6-7 (kfac-jax's `use_adaptive_learning_rate`,
`use_adaptive_momentum`, `use_adaptive_damping`). With `Δ` K-FAC's
preconditioned gradient (damped with `λ + w`: the weight decay's curvature
is `wI` exactly, as kfac-jax adds its `l2_reg` to its damping), `v` the previous
update, `∇` the mean gradient of the objective `L(θ) + (w/2)|θ|²` (`w` the
weight decay) and `C` the exact Gauss-Newton matrix of the mean loss on the
current batch (`kd.value_and_grad(...).gauss_newton_gram`), the update is

    d = α Δ + μ v,   (α, μ) = argmin M(d),
    M(d) = ½ dᵀ (C + w I + λ I) d + ∇ᵀd,

a 2×2 linear system in the Gram matrix of `(Δ, v)` (α alone while `v = 0`, on
the first step). A fixed `learning_rate` fixes `α = −learning_rate` and a
fixed `momentum` fixes `μ`; the other is solved for. With both fixed (the
damping alone adapted: kfac-jax's `use_adaptive_damping` without the other
two) the model is needed only for the reduction ratio below: it is then
computed on the adaptation steps alone, for `d` itself (one tangent pass
every T steps instead of two every step).

Levenberg-Marquardt damping (`adapt_damping=True`): every
`damping_adaptation_interval` (T) updates the reduction ratio

    ρ = (L(θ + d) − L(θ)) / M₀(d),   M₀: M without the λ term,

on the same batch moves `λ`: × ω^T when ρ > ¾, ÷ ω^T when ρ < ¼ (ω =
`damping_adaptation_decay`), clipped to `[min_damping, max_damping]`. The
defaults are kfac-jax's (T = 5, ω = 0.9, λ ≥ 1e-8 with no upper bound).

Step rejection (`reject_steps=True`, kfac-jax's `use_step_rejection`): every
update whose objective on the batch goes up (`L(θ + d) > L(θ)`, or NaN) is
rejected: the parameters and `v` stay, λ is multiplied by
`reject_damping_increase_factor` ≥ 1 (after the rule above, on its steps;
clipped to `[min_damping, max_damping]` too), the
K-FAC state keeps the step's statistics. One forward pass each step (and one
more for `L(θ)` with both coefficients fixed, which have no model then).

Under a tensor-parallel `Distribution` each model shard preconditions its
local shard (`core.tensor_parallel`) and the model's inner products sum the
shards (replicated parameters once), so α, μ and λ are the whole model's.

KL clipping is off in adaptive mode: the quadratic model already sets the
step's length (kfac-jax turns its norm constraint off by default there for
the same reason), and KAISA's clip is defined through a fixed learning rate.
With the damping alone adapted a `kl_clip` given applies to `Δ` (KAISA's
clip with the fixed learning rate); the reduction ratio measures the clipped
update.
The fault policy is K-FAC's: a faulty step (or a degenerate model: a
non-finite α, μ or λ) is skipped, the state unchanged but `skipped`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import batches, registry
from kfac_jax_dist.core import cadence, faults, settings, states, tensor_parallel
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import linalg
from kfac_jax_dist.kfac import transform
from kfac_jax_dist.kfac.config import KfacConfig
from kfac_jax_dist.kfac.state import ScaleByKfacState

_HI = lax.Precision.HIGHEST


class Batch(NamedTuple):
  """The arguments `grad_fn` received after the parameters: `kfac_batch`
  (positional) and `kfac_batch_kwargs` (by keyword, e.g. a loss mask)."""

  args: tuple
  kwargs: dict


# The Levenberg-Marquardt rule's settings (read with `adapt_damping` only).
DAMPING_RULE = ("damping_adaptation_interval", "damping_adaptation_decay", "min_damping",
                "max_damping", "damping_lower_threshold", "damping_upper_threshold")


@dataclasses.dataclass(frozen=True, eq=False)
class AdaptiveConfig:
  """The adaptive settings (see the module docstring); None: adapted."""

  learning_rate: cadence.ScalarOrSchedule | None = None
  momentum: cadence.ScalarOrSchedule | None = None
  weight_decay: float = 0.0
  adapt_damping: bool = True
  damping_adaptation_interval: int = 5
  damping_adaptation_decay: float = 0.9
  min_damping: float = 1e-3
  max_damping: float | None = None
  damping_lower_threshold: float = 0.25
  damping_upper_threshold: float = 0.75
  micro_batches: int = 1
  reject_steps: bool = False
  reject_damping_increase_factor: float = 1.0

  def __post_init__(self):
    batches.check(self.micro_batches, "kfac")
    if self.learning_rate is not None:
      settings.check_positive("learning_rate", self.learning_rate, allow_zero=True)
    if self.momentum is not None:
      settings.check_range("momentum", self.momentum, 0.0, 1.0)
    settings.check_positive("weight_decay", self.weight_decay, allow_zero=True)
    settings.check_interval("damping_adaptation_interval",
                            self.damping_adaptation_interval)
    settings.check_range("damping_adaptation_decay", self.damping_adaptation_decay, 0.0,
                         1.0, closed_low=False, schedule=False)
    settings.check_positive("min_damping", self.min_damping, allow_zero=True,
                            schedule=False)
    if self.max_damping is not None:
      settings.check_positive("max_damping", self.max_damping, allow_zero=True,
                              schedule=False)
    if (cadence.is_number(self.max_damping) and cadence.is_number(self.min_damping)
        and self.max_damping < self.min_damping):
      raise ValueError(f"max_damping ({self.max_damping}) must be >= min_damping "
                       f"({self.min_damping})")
    factor = self.reject_damping_increase_factor   # (an array: checked at run time)
    settings.check_positive("reject_damping_increase_factor", factor, schedule=False)
    if cadence.is_number(factor) and factor < 1:
      raise ValueError(f"reject_damping_increase_factor must be >= 1 (a rejected step's "
                       f"model was too optimistic: λ grows), got {factor!r}")
    if cadence.is_number(factor) and factor != 1 and not (self.reject_steps and
                                                          self.adapt_damping):
      raise ValueError("reject_damping_increase_factor multiplies the adapted damping of "
                       "a rejected step: it needs reject_steps=True and "
                       "adapt_damping=True.")
    if not 0 <= self.damping_lower_threshold < self.damping_upper_threshold:
      raise ValueError("need 0 <= damping_lower_threshold < damping_upper_threshold, got "
                       f"{self.damping_lower_threshold}, {self.damping_upper_threshold}")
    if not self.adapt_damping:
      self._check_no_damping_rule()

  def _check_no_damping_rule(self) -> None:
    """Without `adapt_damping`, the Levenberg-Marquardt rule's settings do
    nothing: one other than its default is refused by name."""
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in DAMPING_RULE and settings.differs_from_default(value, field.default):
        raise ValueError(f"{field.name}={value!r} sets the damping's adaptation: it "
                         "needs adapt_damping=True.")

  def settings_ok(self, count: jax.Array) -> jax.Array:
    """The run-time check of the values only the step knows (arrays from
    `optax.inject_hyperparams`, schedules' values at `count`)."""
    checks = []
    if self.learning_rate is not None:
      # 0: a warm-up's first value, a decay's last (a zero step, as plain K-FAC's)
      checks.append(lambda: settings.positive_ok("learning_rate", self.learning_rate,
                                                 count, allow_zero=True))
    if self.momentum is not None:
      checks.append(lambda: settings.range_ok("momentum", self.momentum, count, 0.0, 1.0))
    checks.append(lambda: settings.positive_ok("weight_decay", self.weight_decay, count,
                                               allow_zero=True))
    if self.reject_steps:
      checks.append(lambda: settings.range_ok("reject_damping_increase_factor",
                                              self.reject_damping_increase_factor,
                                              count, 1.0, math.inf))
    return settings.all_ok(checks)

  @property
  def coefficients_fixed(self) -> bool:
    """Both α and μ given: only the damping is adapted."""
    return self.learning_rate is not None and self.momentum is not None

  @property
  def momentum_zero(self) -> bool:
    """The momentum fixed at the number 0: `v`'s tangent pass is skipped."""
    return cadence.is_number(self.momentum) and self.momentum == 0

  @property
  def damping_factor(self) -> float:
    """ω^T, the factor λ moves by on an adaptation step."""
    return self.damping_adaptation_decay ** self.damping_adaptation_interval


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kfac", "damping", "velocity", "learning_rate", "momentum", "rho",
                 "count", "skipped", "rejected"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AdaptiveKfacState(states.PreconditionerState):
  """State of `scale_by_adaptive_kfac`.

  Attributes:
    kfac: the K-FAC state (factors, second-order state) of the preconditioner.
    damping: `λ`, the damping of the preconditioner and of the quadratic model.
    velocity: `v`, the previous update (parameter-shaped).
    learning_rate, momentum: the last step's `−α` and `μ` (for logging).
    rho: the last reduction ratio `ρ` (0 until the first adaptation: a finite
      start, so that `jax_debug_nans` passes the state).
    count: accepted updates (rejected ones included); skipped: skipped ones.
    rejected: updates rejected by `reject_steps` (the loss went up).
  """

  kfac: ScaleByKfacState
  damping: jax.Array
  velocity: Any
  learning_rate: jax.Array
  momentum: jax.Array
  rho: jax.Array
  count: jax.Array
  skipped: jax.Array
  rejected: jax.Array

  def partition_specs(self) -> AdaptiveKfacState:
    """The K-FAC state's own specs; everything else replicated."""
    replicated = PartitionSpec()
    rest = jax.tree_util.tree_map(lambda _: replicated, dataclasses.replace(
        self, kfac=None))
    return dataclasses.replace(rest, kfac=self.kfac.partition_specs())


ADAPTED = ("learning_rate", "momentum", "damping", "rho")


def adapted_values(opt_state: Any) -> dict[str, jax.Array]:
  """`{"learning_rate": η = −α, "momentum": μ, "damping": λ, "rho": ρ}` of the
  first adaptive K-FAC state inside an optax state (the last step's values;
  ρ is 0 until the first damping adaptation), for logging. Under a
  tensor-parallel `Distribution`, pass `kd.model_shard(opt_state, 0)`."""
  found = states.find_states(opt_state, AdaptiveKfacState)
  if not found:
    raise ValueError("adapted_values: opt_state holds no adaptive K-FAC state (make it "
                     "with kd.kfac(learning_rate=None and/or momentum=None, ...)).")
  return {name: getattr(found[0], name) for name in ADAPTED}


# -------------------------------------------------------------- the model

def tree_vdot(a: Any, b: Any) -> jax.Array:
  """`Σ_leaves ⟨a, b⟩` in float32 at least."""
  dots = [jnp.vdot(x.astype(jnp.promote_types(x.dtype, jnp.float32)), y,
                   precision=_HI)
          for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
  return sum(dots) if dots else jnp.zeros([])


Dot = Callable[[Any, Any], jax.Array]


def inner_product(kfac_config: KfacConfig) -> Dot:
  """`⟨a, b⟩` of two parameter-shaped trees as the optimizer sees them: local
  shards under a tensor-parallel `Distribution`, summed over the model axes,
  a leaf replicated over some of them (the same on those shards) counted
  once, typed invariant over the axes; `tree_vdot` else."""
  if not kfac_config.model_axes:
    return tree_vdot
  dist, axes = kfac_config.distribution, kfac_config.model_axes

  def dot(a: Any, b: Any) -> jax.Array:
    replicated = tensor_parallel.replicated_axes(a, dist)
    local = jnp.zeros([])
    for (name, x), y in zip(registry.named_leaves(a), jax.tree_util.tree_leaves(b)):
      over = replicated[name]
      local = local + jnp.where(tensor_parallel.on_shard_zero(over), tree_vdot(x, y),
                                0.0)
    return lax.psum(_compat.as_varying(local, axes), axes)
  return dot


def _mean_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return lax.pmean(x, axes) if axes else x


def quadratic_model(gram: jax.Array, vectors: tuple[Any, Any], grads: Any,
                    weight_decay: Any, dot: Dot = tree_vdot
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(A, D, b)` of the model in the span of `vectors`: `A = VᵀCV + w VᵀV`,
  `D = VᵀV` (the damping's), `b = Vᵀ∇` (averaged over the axes the local
  gradients vary over: the vectors are the same on every device)."""
  k = len(vectors)
  upper = {(i, j): dot(vectors[i], vectors[j]) for i in range(k) for j in range(i, k)}
  dots = jnp.stack([jnp.stack([upper[min(i, j), max(i, j)] for j in range(k)])
                    for i in range(k)])
  b = jnp.stack([dot(grads, v) for v in vectors])
  b = _mean_over(b, _compat.varying_axes(b))
  return gram + weight_decay * dots, dots, b


# Both coefficients solved for only where `det(A_damped) > _SINGULAR·ε·a₀₀a₁₁`:
# `Δ` and `v` collinear (in the model's metric) to rounding make the 2 × 2
# system singular, and `α` alone is then its minimiser.
_SINGULAR = 100.0


def solve_coefficients(a_damped: jax.Array, b: jax.Array, learning_rate: Any,
                       momentum: Any, first: jax.Array) -> jax.Array:
  """`(α, μ)` minimising `½ wᵀ A_damped w + bᵀw` with the fixed one fixed
  (`α = −learning_rate`; on the first step, or with `v = 0`, `μ = 0`); at
  least one of them adapted (`_fixed_coefficients` else). Degenerate models
  give finite coefficients, not a skipped step: `Δ = 0` (a zero gradient)
  `α = 0`; both adapted with `v ∥ Δ`, `α` alone. A NaN in the model stays one
  (the step is skipped)."""
  a00, a01, a11 = a_damped[0, 0], a_damped[0, 1], a_damped[1, 1]
  moving, no_velocity = a00 != 0, first | (a11 == 0)
  det = a00 * a11 - a01 * a01
  eps = jnp.finfo(a_damped.dtype).eps
  alone = no_velocity | (det <= _SINGULAR * eps * a00 * a11)
  # The solves read a dropped entry as 1: a singular system would make NaNs
  # that the selects drop, but that `jax_debug_nans` reports outside jit.
  safe00, safe11 = jnp.where(moving, a00, 1), jnp.where(no_velocity, 1, a11)
  if learning_rate is None and momentum is None:
    alpha_only = jnp.where(moving, -b[0] / safe00, 0.0)
    safe = jnp.where(alone, jnp.diag(jnp.stack([safe00, jnp.ones_like(a00)])), a_damped)
    both = -linalg.one_matrix_per_call(jnp.linalg.solve)(safe, b)
    return jnp.where(alone, jnp.stack([alpha_only, 0.0]), both)
  if learning_rate is not None:              # μ alone
    alpha = -jnp.asarray(learning_rate, b.dtype)
    mu = -(b[1] + a01 * alpha) / safe11
    return jnp.stack([alpha, jnp.where(no_velocity, 0.0, mu)])
  mu = jnp.where(no_velocity, 0.0, jnp.asarray(momentum, b.dtype))
  alpha = jnp.where(moving, -(b[0] + a01 * mu) / safe00, 0.0)
  return jnp.stack([alpha, mu])


def model_change(a: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
  """`M₀(w) = ½ wᵀAw + bᵀw` (no damping term)."""
  return 0.5 * jnp.dot(w, jnp.dot(a, w, precision=_HI), precision=_HI) + jnp.dot(b, w)


def new_damping(config: AdaptiveConfig, damping: jax.Array, rho: jax.Array
                ) -> jax.Array:
  """The Levenberg-Marquardt rule: λ × ω^T when ρ > upper, ÷ ω^T when ρ < lower
  (a NaN ρ counts as below), clipped to `[min_damping, max_damping]`."""
  rho = jnp.nan_to_num(rho, nan=-100.0)
  factor = config.damping_factor
  moved = jnp.where(rho > config.damping_upper_threshold, damping * factor,
                    jnp.where(rho < config.damping_lower_threshold, damping / factor,
                              damping))
  return jnp.clip(moved, config.min_damping, config.max_damping)  # None: no upper bound


# ------------------------------------------------------------------ the step

def _objective(config: AdaptiveConfig, dot: Dot, loss: jax.Array, params: Any
               ) -> jax.Array:
  """`L(θ) + (w/2)|θ|²`, `loss` = L(θ) on the batch."""
  return loss + 0.5 * config.weight_decay * dot(params, params)


def _one_per_model(kfac_config: KfacConfig, x: jax.Array) -> jax.Array:
  """`x`, computed alike by every model shard (tensor parallelism), as model
  shard 0's value typed replicated; unchanged without a model axis."""
  return tensor_parallel.from_shard_zero(x, kfac_config.model_axes)


def _typed_like_params(kfac_config: KfacConfig, tree: Any) -> Any:
  """A parameter-shaped `tree` computed from the per-shard state (typed
  varying over every model axis) with each leaf that the parameters
  replicate over some model axes typed replicated over them, as the model
  expects its parameters and their tangents (a scan's carry, say, must keep
  its type). Those leaves are the same on the shards (the same program on
  the same statistics and gradients): a typed no-op, no communication."""
  if not kfac_config.model_axes:
    return tree
  replicated = tensor_parallel.replicated_axes(tree, kfac_config.distribution)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), [
      _compat.equal_over(x, replicated[name]) for name, x in registry.named_leaves(tree)])


def _objectives(config: AdaptiveConfig, kfac_config: KfacConfig, grad_fn: Any,
                params: Any, batch: Batch, update: Any, loss: jax.Array | None
                ) -> tuple[jax.Array, jax.Array]:
  """The objective `L + (w/2)|·|²` on the batch at `θ` and at `θ + d`: one
  forward pass for `L(θ + d)`, and one for `L(θ)` unless given (`loss`, from
  the linearisation of the model)."""
  dot = inner_product(kfac_config)
  new_params = jax.tree_util.tree_map(jnp.add, params,
                                      _typed_like_params(kfac_config, update))
  if loss is None:
    loss = grad_fn.loss(params, *batch.args, micro_batches=config.micro_batches,
                        **batch.kwargs)
  new_loss = grad_fn.loss(new_params, *batch.args, micro_batches=config.micro_batches,
                          **batch.kwargs)
  return (_objective(config, dot, loss, params),
          _objective(config, dot, new_loss, new_params))


def _damping_step(config: AdaptiveConfig, kfac_config: KfacConfig,
                  objectives: tuple[jax.Array, jax.Array], change: jax.Array,
                  damping: jax.Array, rho: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(λ', ρ') of an adaptation step, `ρ' = (L(θ + d) − L(θ)) / M₀(d)` from the
  `objectives` at `θ` and `θ + d` and the model's `change` M₀(d). A zero step
  (`M₀(d) = 0`: a zero gradient, an all-masked batch) says nothing of the
  model's fit: λ and ρ stay (before, 0/0 counted as a bad fit and raised λ
  at every adaptation, without bound by default)."""
  before, after = objectives
  defined = change != 0
  ratio = _one_per_model(kfac_config, (after - before) / jnp.where(defined, change, 1))
  # In the state's dtype: a float64 model's loss is float64, its state float32.
  return (jnp.where(defined, new_damping(config, damping, ratio), damping).astype(
              damping.dtype),
          jnp.where(defined, ratio, rho).astype(damping.dtype))


def _reject_if_worse(config: AdaptiveConfig, kfac_config: KfacConfig,
                     objectives: tuple[jax.Array, jax.Array], update: Any,
                     velocity: Any, damping: jax.Array
                     ) -> tuple[Any, Any, jax.Array, jax.Array]:
  """kfac-jax's step rejection: where `L(θ + d) > L(θ)` on the batch (or is
  NaN), `(0, v, λ·reject_damping_increase_factor, True)`: the parameters and
  the velocity stay, the damping grows; else `(d, d, λ, False)`."""
  before, after = objectives
  worse = (jnp.isnan(after) | (after > before)).astype(jnp.float32)
  rejected = _one_per_model(kfac_config, worse) > 0
  kept = jax.tree_util.tree_map(lambda d: jnp.where(rejected, jnp.zeros_like(d), d),
                                update)
  new_velocity = jax.tree_util.tree_map(lambda d, v: jnp.where(rejected, v, d), update,
                                        velocity)
  grown = jnp.clip(damping * config.reject_damping_increase_factor, config.min_damping,
                   config.max_damping).astype(damping.dtype)
  return kept, new_velocity, jnp.where(rejected, grown, damping), rejected


def _model_in_span(config: AdaptiveConfig, kfac_config: KfacConfig, grad_fn: Any,
                   params: Any, batch: Batch, vectors: tuple[Any, ...], grads: Any
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`(A, D, b)` of `quadratic_model` in the span of `vectors`, and `L(θ)`,
  from one linearisation of the model (a tangent pass per vector)."""
  used = tuple(_typed_like_params(kfac_config, v) for v in vectors)
  gram, loss = grad_fn.gauss_newton_gram(params, used, *batch.args, with_loss=True,
                                         micro_batches=config.micro_batches,
                                         **batch.kwargs)
  gram = _one_per_model(kfac_config, gram)
  a, dots, b = quadratic_model(gram, used, grads, config.weight_decay,
                               inner_product(kfac_config))
  return a, dots, b, loss


def _model_of_direction(config: AdaptiveConfig, kfac_config: KfacConfig, grad_fn: Any,
                        params: Any, batch: Batch, direction: Any, velocity: Any,
                        grads: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`_model_in_span` of `(Δ, v)`. With the momentum fixed at 0, `v`'s tangent
  pass is skipped: its row and column of `A` and `D` and its `b` are zeros."""
  if not config.momentum_zero:
    return _model_in_span(config, kfac_config, grad_fn, params, batch,
                          (direction, velocity), grads)
  a, dots, b, loss = _model_in_span(config, kfac_config, grad_fn, params, batch,
                                    (direction,), grads)
  return jnp.pad(a, (0, 1)), jnp.pad(dots, (0, 1)), jnp.pad(b, (0, 1)), loss


def _fixed_coefficients(config: AdaptiveConfig, count: jax.Array, dtype: Any
                        ) -> jax.Array:
  """`(α, μ) = (−learning_rate, momentum)` at `count` (the damping alone adapted)."""
  return jnp.stack([-jnp.asarray(cadence.value_at(config.learning_rate, count), dtype),
                    jnp.asarray(cadence.value_at(config.momentum, count), dtype)])


def check_no_kl_clip(kl_clip: Any) -> None:
  """Adaptive mode has no KL clip: it is defined through a fixed learning rate
  (kfac-jax, too, turns its norm constraint off in adaptive mode)."""
  if kl_clip is not None:
    raise ValueError("kl_clip is defined through a fixed learning rate: pass "
                     "kl_clip=None with an adapted learning_rate or momentum.")


def _check_initial_damping(config: AdaptiveConfig, damping: Any) -> None:
  """With `adapt_damping`, the initial λ (a number) lies in `[min_damping,
  max_damping]`: the Levenberg-Marquardt rule would move it there at its first
  adaptation, so a λ₀ outside is a setting that does not do what it says; a
  schedule, read only at count 0, likewise."""
  if config.adapt_damping and callable(damping) and not hasattr(damping, "dtype"):
    raise TypeError("damping is the initial λ of adapt_damping=True, which the "
                    "Levenberg-Marquardt rule then moves: pass a number, not a schedule.")
  if not (config.adapt_damping and cadence.is_number(damping)):
    return
  lo, hi = config.min_damping, config.max_damping    # (arrays: injected, not checked)
  if (cadence.is_number(lo) and damping < lo) or (cadence.is_number(hi) and damping > hi):
    raise ValueError(
        f"damping={damping!r} (the initial λ) is outside [min_damping, max_damping] = "
        f"[{lo!r}, {hi!r}] of adapt_damping=True; move the bound "
        "(e.g. min_damping) or the initial damping.")


def _checked_batch(params: Any, batch: Any, batch_kwargs: Any) -> Batch:
  """The `Batch` of `update`'s `kfac_batch`, a tuple (a list) of the positional
  arguments `grad_fn` received after the parameters, and `kfac_batch_kwargs`,
  a dict of its keyword arguments (None: none)."""
  if params is None or batch is None:
    raise ValueError("adaptive K-FAC needs the parameters and the batch: call "
                     "tx.update(grads, opt_state, params, kfac_stats=stats, "
                     "kfac_batch=(x, y)) with the arguments grad_fn received after "
                     "the parameters.")
  if not isinstance(batch, (tuple, list)):
    raise TypeError("kfac_batch must be the tuple of arguments grad_fn received after "
                    f"the parameters, e.g. kfac_batch=(x, y); got {type(batch).__name__}.")
  if not isinstance(batch_kwargs, (dict, type(None))):
    raise TypeError("kfac_batch_kwargs must be the dict of keyword arguments grad_fn "
                    "received (e.g. kfac_batch_kwargs={'mask': mask}); got "
                    f"{type(batch_kwargs).__name__}.")
  return Batch(tuple(batch), dict(batch_kwargs or {}))


def _coefficients(config: AdaptiveConfig, kfac_config: KfacConfig, grad_fn: Any,
                  params: Any, batch: Batch, grads: Any, direction: Any,
                  state: AdaptiveKfacState, lam: jax.Array
                  ) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
  """`(α, μ)` and the model `(A, b, L(θ))` they minimise in the span of
  `(Δ, v)`; with both fixed, no model (None) and no tangent pass."""
  count = state.count
  if config.coefficients_fixed:
    return _fixed_coefficients(config, count, state.rho.dtype), None
  a, dots, b, loss = _model_of_direction(config, kfac_config, grad_fn, params, batch,
                                         direction, state.velocity, grads)
  value = lambda x: None if x is None else cadence.value_at(x, count)
  w = solve_coefficients(a + lam * dots, b, value(config.learning_rate),
                         value(config.momentum), count == 0)
  return w, (a, b, loss)


def _adapted_damping(config: AdaptiveConfig, kfac_config: KfacConfig, grad_fn: Any,
                     params: Any, batch: Batch, grads: Any, update: Any, w: jax.Array,
                     model: tuple[jax.Array, ...] | None, state: AdaptiveKfacState,
                     objectives: tuple[jax.Array, jax.Array] | None, lam: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """`(λ', ρ)` of the Levenberg-Marquardt rule on every T-th update from the
  current `λ`, `(λ, ρ)` between. Without `model` (the coefficients fixed) the model
  of `d` alone is computed here, on those updates only: one tangent pass; the
  `objectives` at `θ` and `θ + d` too, unless given (step rejection's)."""
  def adapt() -> tuple[jax.Array, jax.Array]:
    if model is None:
      a, _, b, loss = _model_in_span(config, kfac_config, grad_fn, params, batch,
                                     (update,), grads)
      change = model_change(a, b, jnp.ones(1, a.dtype))
    else:
      a, b, loss = model
      change = model_change(a, b, w)
    objs = (objectives if objectives is not None else
            _objectives(config, kfac_config, grad_fn, params, batch, update, loss))
    return _damping_step(config, kfac_config, objs, change, lam, state.rho)
  due = (state.count + 1) % config.damping_adaptation_interval == 0
  return lax.cond(due, adapt, lambda: (lam, state.rho))


def update_state(config: AdaptiveConfig, kfac_config: KfacConfig,
                 comm: collectives_lib.Collectives, grad_fn: Any, grads: Any,
                 state: AdaptiveKfacState, params: Any, stats: Any, batch: Batch
                 ) -> tuple[Any, AdaptiveKfacState]:
  """One adaptive update: K-FAC's direction with the current λ, the model's
  coefficients, the update, every T steps the new λ, and with `reject_steps`
  no update where the objective goes up."""
  count, wd = state.count, config.weight_decay
  dtypes = jax.tree_util.tree_map(lambda g: g.dtype, grads)   # the updates' (v: f32+)
  # Adapted: within the bounds of this transform (a state saved under others).
  lam = (jnp.clip(state.damping, config.min_damping, config.max_damping)
         if config.adapt_damping else cadence.value_at(kfac_config.damping, count))
  lam = jnp.asarray(lam, state.damping.dtype)
  if not (isinstance(wd, (int, float)) and wd == 0):
    grads = jax.tree_util.tree_map(lambda g, p: g + wd * p, grads, params)
  # The objective's curvature is the loss's plus wI: K-FAC's damping takes w.
  step_config = dataclasses.replace(kfac_config, damping=lam + wd)
  direction, kfac_state = transform.update_state(step_config, comm, grads, state.kfac,
                                                 stats)
  w, model = _coefficients(config, kfac_config, grad_fn, params, batch, grads, direction,
                           state, lam)
  update = jax.tree_util.tree_map(lambda x, v: (w[0] * x + w[1] * v).astype(v.dtype),
                                  direction, state.velocity)
  taken, velocity, damping, rho, rejected = _adapt_and_reject(
      config, kfac_config, grad_fn, params, batch, grads, update, w, model, state, lam)
  cast = lambda tree: jax.tree_util.tree_map(lambda x, t: x.astype(t), tree, dtypes)
  # The proposed update's values, rejected or not, in the updates' dtypes (a
  # float16 may overflow there).
  with jax.named_scope(faults.SCOPE):
    ok = (kfac_state.skipped == state.kfac.skipped) & config.settings_ok(count) & (
        faults.all_finite([w, damping] + jax.tree_util.tree_leaves(cast(update))))
    ok = faults.computed_once(faults.agree(ok, _compat.varying_axes(ok)))
  # The state keeps its types (damping and rho are cast in `_damping_step`).
  typed = lambda x: jnp.asarray(x, state.rho.dtype)
  new_state = dataclasses.replace(
      state, kfac=kfac_state, damping=damping, velocity=velocity,
      learning_rate=typed(-w[0]), momentum=typed(w[1]), rho=rho, count=count + 1,
      rejected=state.rejected + rejected.astype(state.rejected.dtype))
  return _accept_or_skip(ok, cast(taken), new_state, state)


def _adapt_and_reject(config: AdaptiveConfig, kfac_config: KfacConfig, grad_fn: Any,
                      params: Any, batch: Batch, grads: Any, update: Any, w: jax.Array,
                      model: tuple[jax.Array, ...] | None, state: AdaptiveKfacState,
                      lam: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array]:
  """`(update taken, velocity, λ', ρ, rejected)` after the proposed `update`:
  the Levenberg-Marquardt rule on its steps, then step rejection."""
  objectives = (_objectives(config, kfac_config, grad_fn, params, batch, update,
                            None if model is None else model[2])
                if config.reject_steps else None)
  damping, rho = lam, state.rho
  if config.adapt_damping:
    damping, rho = _adapted_damping(config, kfac_config, grad_fn, params, batch, grads,
                                    update, w, model, state, objectives, lam)
  if not config.reject_steps:
    return update, update, damping, rho, jnp.zeros([], bool)
  taken, velocity, damping, rejected = _reject_if_worse(
      config, kfac_config, objectives, update, state.velocity, damping)
  return taken, velocity, damping, rho, rejected


def _accept_or_skip(ok: jax.Array, update: Any, new_state: AdaptiveKfacState,
                    state: AdaptiveKfacState) -> tuple[Any, AdaptiveKfacState]:
  """`(update, new_state)`, or on a skip zeros and `state` with the skip
  counted. The K-FAC state is selected once (on a skip: the old one, its
  `skipped` counting the step whether K-FAC's direction or the adaptive
  model failed); the rest of the state by `faults.accept_or_skip`."""
  updates, out = faults.accept_or_skip(
      ok, update, dataclasses.replace(new_state, kfac=None),
      dataclasses.replace(state, kfac=None))
  kfac_on_skip = dataclasses.replace(state.kfac, skipped=state.kfac.skipped + 1)
  return updates, dataclasses.replace(out, kfac=faults.select(ok, new_state.kfac,
                                                               kfac_on_skip))


def scale_by_adaptive_kfac(
    layers: registry.LayerRegistry | None,
    grad_fn: Callable,
    *,
    kfac_config: KfacConfig,
    adaptive_config: AdaptiveConfig,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC whose learning rate, momentum and damping come from the exact
  quadratic model (module docstring); `update` takes `kfac_stats=`,
  `kfac_batch=` (and `kfac_batch_kwargs=`), and returns the whole update `d`
  (no SGD after it)."""
  registry.check_layers(layers)
  comm = collectives_lib.Collectives(kfac_config.distribution)
  if not hasattr(grad_fn, "gauss_newton_gram"):
    raise TypeError("adaptive K-FAC needs grad_fn=kd.value_and_grad(loss_fn) (it "
                    "computes the exact curvature products of the registered loss).")
  if not adaptive_config.coefficients_fixed:
    check_no_kl_clip(kfac_config.kl_clip)
  _check_initial_damping(adaptive_config, kfac_config.damping)

  def init_fn(params: Any) -> AdaptiveKfacState:
    inner = transform.init_state(kfac_config, comm, layers, params)
    states.check_device_memory(inner, "kd.kfac", transform.KFAC_REMEDIES)
    dtype = inner.factor_weight.dtype
    scalar = lambda x: jnp.asarray(x, dtype)
    return AdaptiveKfacState(
        kfac=inner, damping=scalar(cadence.value_at(kfac_config.damping, 0)),
        velocity=jax.tree_util.tree_map(
            lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)),
            params),
        learning_rate=scalar(0.0), momentum=scalar(0.0), rho=scalar(0.0),
        count=jnp.zeros([], jnp.int32), skipped=jnp.zeros([], jnp.int32),
        rejected=jnp.zeros([], jnp.int32))

  @_compat.updates_on_auto_axes
  def update_fn(updates: Any, state: AdaptiveKfacState, params: Any = None, *,
                kfac_stats: Any = None, kfac_batch: tuple | None = None,
                kfac_batch_kwargs: dict | None = None,
                **extra_args: Any) -> tuple[Any, AdaptiveKfacState]:
    transform.check_extra_args(extra_args, "kfac")
    states.check_kind(state, AdaptiveKfacState, "kfac")
    return update_state(adaptive_config, kfac_config, comm, grad_fn, updates, state,
                        params, kfac_stats,
                        _checked_batch(params, kfac_batch, kfac_batch_kwargs))

  return tensor_parallel.for_model_shards(
      optax.GradientTransformationExtraArgs(init_fn, update_fn), kfac_config.distribution,
      "kfac",
      lambda sharding: tensor_parallel.check_kfac_layers(layers or (), sharding))
