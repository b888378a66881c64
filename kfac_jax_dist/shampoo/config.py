"""Shampoo's settings: one frozen, validated record that every stage reads.

Built once per `scale_by_shampoo` (under `optax.inject_hyperparams`, once per
update with array values: the checks of numbers apply to Python numbers
only). The shape options are read at init only, as Python numbers: their
defaults stay static, and a value passed through `optax.inject_hyperparams`
must be concrete there or named in `static_args`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Sequence

import jax

from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.core import settings
from kfac_jax_dist.shampoo import roots

GraftType = Literal["sgd", "adagrad", "rmsprop", "adam", "none"]
Grafting = Literal["block", "layer"]
GRAFT_TYPES: tuple[GraftType, ...] = ("sgd", "adagrad", "rmsprop", "adam", "none")
GRAFTINGS: tuple[Grafting, ...] = ("block", "layer")
# The options that decide the layout of the blocks (`shape_options`): read at
# init, where an array from `optax.inject_hyperparams` must be concrete.
SHAPE_OPTIONS = ("block_size", "merge_small_dims", "max_preconditioner_dim",
                 "exponent_override")
# Their numeric defaults (Shampoo's and SOAP's), which `optax.inject_hyperparams`
# leaves static, so that `jax.eval_shape(tx.init, params)` needs no `static_args`.
BLOCK_SIZE: Any = settings.StaticDefault(128)
MAX_PRECONDITIONER_DIM: Any = settings.StaticDefault(4096)


def stack_patterns(stacked: Any) -> tuple[tuple[str, int], ...]:
  """`stacked` as `(pattern, stack axes)` pairs: a sequence of regular
  expressions (one leading stack axis each) or a mapping of them to their
  number of leading stack axes (nested scans: 2)."""
  if isinstance(stacked, Mapping):
    pairs = tuple(stacked.items())
    settings.check_patterns("stacked", [p for p, _ in pairs])
    for pattern, n in pairs:
      if isinstance(n, bool) or not settings.positive_int(n):
        raise ValueError(f"stacked: {pattern!r} must map to a positive number of leading "
                         f"stack axes, got {n!r}")
    return tuple((p, int(n)) for p, n in pairs)
  return tuple((p, 1) for p in settings.check_patterns("stacked", stacked))


@dataclasses.dataclass(frozen=True, eq=False)
class ShampooConfig:
  """The settings of `scale_by_shampoo` (see its docstring for each)."""

  block_size: int | None = BLOCK_SIZE
  beta2: float = 1.0
  epsilon: float = 1e-6
  graft_type: GraftType = "sgd"
  grafting: Grafting = "block"
  graft_beta2: float | None = None
  graft_epsilon: float = 1e-10
  start_preconditioning_step: cadence.ScalarOrSchedule = 1
  statistics_compute_steps: cadence.ScalarOrSchedule = 1
  preconditioning_compute_steps: cadence.ScalarOrSchedule = 1
  merge_small_dims: bool | int = True
  max_preconditioner_dim: int | None = MAX_PRECONDITIONER_DIM
  exponent_override: float | None = None
  root_method: roots.Method = "eigh"
  ridge_epsilon: float = 1e-6
  newton_max_iterations: int = 100
  newton_tolerance: float = 1e-6
  root_failure_threshold: float = 0.1
  skip: Sequence[str] = ()
  statistics_dtype: Any = None
  distribution: distribution_lib.Distribution | None = None
  stacked: Sequence[str] | Mapping[str, int] = ()

  def __post_init__(self):
    object.__setattr__(self, "skip", settings.check_patterns("skip", self.skip))
    object.__setattr__(self, "stacked", stack_patterns(self.stacked))
    for name in SHAPE_OPTIONS:   # numbers where known, checked as numbers
      object.__setattr__(self, name, settings.concrete(getattr(self, name)))
    settings.check_floating_dtype("statistics_dtype", self.statistics_dtype)
    for name, value, allowed in (("graft_type", self.graft_type, GRAFT_TYPES),
                                 ("grafting", self.grafting, GRAFTINGS),
                                 ("root_method", self.root_method, roots.METHODS)):
      if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    settings.check_range("beta2", self.beta2, 0.0, 1.0, closed_low=False, closed_high=True,
                         schedule=False)
    self._check_shape_options()
    settings.check_positive("epsilon", self.epsilon, schedule=False)
    settings.check_positive("ridge_epsilon", self.ridge_epsilon, allow_zero=True,
                            schedule=False)
    # graft_epsilon 0: 0/0 on a zero gradient
    settings.check_positive("graft_epsilon", self.graft_epsilon, schedule=False)
    if self.distribution is not None and not isinstance(
        self.distribution, distribution_lib.Distribution):
      raise TypeError(f"distribution must be a kd.Distribution or None, got "
                      f"{type(self.distribution).__name__}")
    self._check_cadence()
    self._check_roots()
    self._check_grafting()

  def settings_ok(self, count: jax.Array) -> jax.Array:
    """The run-time check of the values only the step knows (arrays from
    `optax.inject_hyperparams`, schedules' values at `count`)."""
    checks = [lambda: settings.range_ok("beta2", self.beta2, count, 0.0, 1.0,
                                        closed_low=False, closed_high=True),
              lambda: settings.positive_ok("epsilon", self.epsilon, count),
              lambda: settings.interval_ok("statistics_compute_steps",
                                           self.statistics_compute_steps, count),
              lambda: settings.interval_ok("preconditioning_compute_steps",
                                           self.preconditioning_compute_steps, count),
              lambda: settings.positive_ok("start_preconditioning_step",
                                           self.start_preconditioning_step, count,
                                           allow_zero=True)]
    if self.graft_type in ("rmsprop", "adam"):
      checks.append(lambda: settings.range_ok(
          "beta2" if self.graft_beta2 is None else "graft_beta2", self.graft_moment, count,
          0.0, 1.0))
    return settings.all_ok(checks)

  def _check_shape_options(self) -> None:
    """Numbers only (an injected array is read at init, `shape_options`)."""
    for name in ("block_size", "max_preconditioner_dim"):
      settings.check_optional_positive_int(name, getattr(self, name))
    merge = self.merge_small_dims
    if not (isinstance(merge, bool) or settings.positive_int(merge)
            or (hasattr(merge, "dtype") and not cadence.is_number(merge))):
      raise ValueError(f"merge_small_dims must be True, False or a positive integer (the "
                       f"merged dimensions' largest size), got {merge!r}")
    if self.exponent_override is not None:
      settings.check_positive("exponent_override", self.exponent_override,
                              schedule=False)

  def _check_cadence(self) -> None:
    for name in ("statistics_compute_steps", "preconditioning_compute_steps"):
      settings.check_interval(name, getattr(self, name))
    start = self.start_preconditioning_step
    if cadence.is_number(start) and not (start == 0 or settings.positive_int(start)):
      raise ValueError(f"start_preconditioning_step must be an integer >= 0 or a "
                       f"schedule, got {start!r}")

  def _check_roots(self) -> None:
    settings.check_optional_positive_int("newton_max_iterations", self.newton_max_iterations)
    settings.check_positive("newton_tolerance", self.newton_tolerance, allow_zero=True,
                            schedule=False)
    settings.check_positive("root_failure_threshold", self.root_failure_threshold,
                            schedule=False)
    p = self.exponent_override
    if self.root_method == "newton" and cadence.is_number(p) and int(p) != p:
      raise ValueError("root_method='newton' needs an integer exponent_override")

  def _check_grafting(self) -> None:
    beta = self.graft_moment
    if self.graft_beta2 is not None:
      settings.check_range("graft_beta2", self.graft_beta2, 0.0, 1.0, closed_high=True,
                           schedule=False)
    if (self.graft_type in ("rmsprop", "adam") and cadence.is_number(beta)
        and not 0.0 <= beta < 1.0):
      raise ValueError(f"graft_type={self.graft_type!r} needs a moving average: pass "
                       f"graft_beta2 < 1 (beta2 is {self.beta2}).")
    if self.reduce_scatter and self.graft_type not in ("sgd", "none"):
      raise ValueError(
          'scale_by_shampoo: gradient_reduction="reduce_scatter" leaves each device '
          "the averaged gradient of its group's blocks only, but the "
          f"{self.graft_type!r} grafting accumulators (replicated, like momentum) need "
          'every averaged gradient on every device: use graft_type "sgd" or "none", '
          'or gradient_reduction "all_reduce".')

  @property
  def graft_moment(self) -> Any:
    """`β` of the "rmsprop"/"adam" grafting: `graft_beta2`, else `beta2`."""
    return self.beta2 if self.graft_beta2 is None else self.graft_beta2

  @property
  def accumulates(self) -> bool:
    """Whether the grafting keeps per-parameter accumulators."""
    return self.graft_type in ("adagrad", "rmsprop", "adam")

  @property
  def reduce_scatter(self) -> bool:
    """SP-NGD-style routing: each owner group receives its blocks' gradients."""
    dist = self.distribution
    return (dist is not None and dist.num_groups > 1
            and dist.gradient_reduction == "reduce_scatter")

  def shape_options(self) -> dict[str, Any]:
    """The options of `blocks.build_layout`, as Python numbers (a traced one,
    from `optax.inject_hyperparams` under `jax.eval_shape` or `jit`, raises)."""
    block, merge, dim, p = (settings.static(name, getattr(self, name))
                            for name in SHAPE_OPTIONS)
    block = None if block is None else int(block)
    if merge is True:
      merge = block
    elif merge is False:
      merge = None
    else:
      merge = int(merge)
    return dict(block_size=block, merge_threshold=merge,
                max_preconditioner_dim=None if dim is None else int(dim),
                exponent_override=None if p is None else float(p))
