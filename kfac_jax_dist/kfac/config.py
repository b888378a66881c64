"""K-FAC's settings: one frozen, validated record that every stage reads.

`KfacConfig` is built once per `scale_by_kfac` (and, under
`optax.inject_hyperparams`, once per update with array values: the checks of
numbers then apply to Python numbers only). `max_factor_dim` decides the
layout, read at init and checked against the state at every update: an array
from `optax.inject_hyperparams` must be concrete there (traced under `jit`:
name it in `static_args`). The stages of `transform` (factors,
decompositions, preconditioning) take it as their first argument; nothing
else carries settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.core import settings
from kfac_jax_dist.kfac import layout as layout_lib

Method = Literal["eigen", "inverse"]
METHODS: tuple[Method, ...] = ("eigen", "inverse")
Correction = Literal["ekfac"]
CORRECTIONS: tuple[Correction, ...] = ("ekfac",)


@dataclasses.dataclass(frozen=True, eq=False)
class KfacConfig:
  """The settings of `scale_by_kfac` (see its docstring for each)."""

  damping: cadence.ScalarOrSchedule = 1e-3
  factor_decay: float = 0.95
  factor_update_every: cadence.ScalarOrSchedule = 1
  inverse_update_every: cadence.ScalarOrSchedule = 1
  method: Method = "eigen"
  kl_clip: cadence.ScalarOrSchedule | None = None
  learning_rate: cadence.ScalarOrSchedule | None = None
  factor_dtype: Any = None
  second_order_dtype: Any = None
  skip: Sequence[str] = ()
  max_factor_dim: int | None = None
  distribution: distribution_lib.Distribution | None = None
  stale_threshold: float | None = None
  eigenvalue_correction: Correction | None = None

  def __post_init__(self):
    object.__setattr__(self, "skip", settings.check_patterns("skip", self.skip))
    object.__setattr__(self, "max_factor_dim",
                       settings.static("max_factor_dim", self.max_factor_dim))
    settings.check_floating_dtype("factor_dtype", self.factor_dtype)
    if self.factor_dtype is None:
      object.__setattr__(self, "factor_dtype", jnp.float32)
    self._check_second_order_dtype()
    if self.method not in METHODS:
      raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
    settings.check_positive("damping", self.damping)
    settings.check_normal("damping", self.damping, self.compute_dtype)
    settings.check_range("factor_decay", self.factor_decay, 0.0, 1.0, schedule=False)
    for name in ("factor_update_every", "inverse_update_every"):
      settings.check_interval(name, getattr(self, name))
    if self.kl_clip is not None:
      settings.check_positive("kl_clip", self.kl_clip)
      if self.learning_rate is None:
        raise ValueError("kl_clip needs the learning_rate (KAISA Eq. 5.1 uses η²).")
    if self.learning_rate is not None:
      settings.check_positive("learning_rate", self.learning_rate, allow_zero=True)
    settings.check_optional_positive_int("max_factor_dim", self.max_factor_dim)
    if self.distribution is not None and not isinstance(
        self.distribution, distribution_lib.Distribution):
      raise TypeError(f"distribution must be a kd.Distribution or None, got "
                      f"{type(self.distribution).__name__}")
    if self.stale_threshold is not None:
      settings.check_positive("stale_threshold", self.stale_threshold, allow_zero=True,
                              schedule=False)
      self._check_stale()
    if self.eigenvalue_correction is not None:
      self._check_correction()

  def settings_ok(self, count: jax.Array) -> jax.Array:
    """The run-time check of the values only the step knows (arrays from
    `optax.inject_hyperparams`, schedules' values at `count`)."""
    checks = [lambda: settings.positive_ok("damping", self.damping, count),
              lambda: settings.range_ok("factor_decay", self.factor_decay, count, 0.0, 1.0),
              lambda: settings.interval_ok("factor_update_every", self.factor_update_every,
                                           count),
              lambda: settings.interval_ok("inverse_update_every", self.inverse_update_every,
                                           count)]
    if self.kl_clip is not None:
      checks.append(lambda: settings.positive_ok("kl_clip", self.kl_clip, count))
    if self.learning_rate is not None:
      checks.append(lambda: settings.positive_ok("learning_rate", self.learning_rate, count,
                                                 allow_zero=True))
    return settings.all_ok(checks)

  def _check_second_order_dtype(self) -> None:
    settings.check_floating_dtype("second_order_dtype", self.second_order_dtype)
    if self.second_order_dtype is not None and jnp.dtype(
        self.second_order_dtype) == jnp.float16:
      raise ValueError(
          "second_order_dtype=float16 cannot hold the second-order state: eigenvalues "
          "of the factors and damped inverses (up to 1/damping) overflow its 65504. "
          "Use jnp.bfloat16 (float32's range in 16 bits).")

  def _check_stale(self) -> None:
    every = (self.factor_update_every, self.inverse_update_every)
    if not all(isinstance(e, int) and e == 1 for e in every):
      raise ValueError("stale_threshold chooses every factor's refresh steps itself: "
                       "leave factor_update_every and inverse_update_every at 1.")

  def _check_correction(self) -> None:
    if self.eigenvalue_correction not in CORRECTIONS:
      raise ValueError(f"eigenvalue_correction must be None or one of {CORRECTIONS}, "
                       f"got {self.eigenvalue_correction!r}")
    if self.method != "eigen":
      raise ValueError('eigenvalue_correction="ekfac" rescales the eigenbases: it needs '
                       'method="eigen".')

  @property
  def compute_dtype(self) -> Any:
    """The dtype of decompositions and preconditioning: float32 at least."""
    return jnp.promote_types(self.factor_dtype, jnp.float32)

  @property
  def second_dtype(self) -> Any:
    """The storage dtype of the second-order state (eigenbases and
    eigenvalues, or inverses): `second_order_dtype`, else the compute dtype
    (the products that read it run in the compute dtype)."""
    return (self.compute_dtype if self.second_order_dtype is None
            else jnp.dtype(self.second_order_dtype))

  @property
  def gradient_reduction(self) -> str:
    return "none" if self.distribution is None else self.distribution.gradient_reduction

  @property
  def model_axes(self) -> tuple[str, ...]:
    """The tensor-parallel mesh axes (`()`: none)."""
    return () if self.distribution is None else self.distribution.model_axes

  @property
  def factor_reduction(self) -> str | None:
    return None if self.distribution is None else self.distribution.factor_reduction

  @property
  def local_factors(self) -> bool:
    """DP-KFAC: each owner builds its factors from its own local batch."""
    return self.factor_reduction == "local"

  @property
  def factor_storage(self) -> str:
    """Owners keep their own factors when each builds them itself (DP-KFAC),
    receives them all anyway (KAISA's all-reduce) or refreshes them one by one
    (stale statistics); a reduce-scatter leaves tight chunks (see `layout`)."""
    if self.stale_threshold is not None or self.factor_reduction in ("local",
                                                                     "all_reduce"):
      return layout_lib.OWNER
    return layout_lib.CHUNKED
