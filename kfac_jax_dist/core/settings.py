"""Checks of hyperparameters, shared by the optimizers' configs.

A setting is checked where its value is known: a Python number (or dtype, or
pattern list) when the config is built, with a `ValueError` / `TypeError` that
names the argument and says what is allowed; an array (under
`optax.inject_hyperparams`) or a schedule's value only at run time, where a
bad value makes the step faulty (`core.faults`: skipped on every device,
state unchanged but `skipped`). `*_ok` return that run-time verdict (a scalar
bool; for Python numbers a NumPy bool computed while tracing in the dtype a
traced value would have, so the step's program holds no equation for them).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax_dist.capture.registry import check_patterns  # noqa: F401  (shared with tags)
from kfac_jax_dist.core import cadence


def _number(value: Any) -> float | None:
  return float(value) if cadence.is_number(value) else None


def _check_number_or_later(name: str, value: Any, schedule: bool = True) -> None:
  """Not a number: an array (`optax.inject_hyperparams`) or, where the option
  takes one (`schedule`), a schedule, checked at run time; anything else (a
  bool, a string, None; a schedule where none is taken) raises."""
  if hasattr(value, "dtype"):
    _check_scalar(name, value)
    return
  if not schedule:
    raise TypeError(f"{name} must be a number or an array (it takes no schedule), got "
                    f"{value!r}")
  if not callable(value):
    raise TypeError(f"{name} must be a number, an array or a schedule (a callable of "
                    f"the update count), got {value!r}")


def _check_scalar(name: str, value: Any, schedule: bool = False) -> None:
  """A hyperparameter is one number: an array of another shape (or a schedule
  returning one) would scale each entry it broadcasts against differently,
  silently, or change a parameter's shape."""
  if jnp.ndim(value) != 0:
    what = "its schedule returned" if schedule else "got"
    raise ValueError(f"{name} must be one number (a scalar): {what} a value of shape "
                     f"{jnp.shape(value)}.")


def check_positive(name: str, value: Any, *, allow_zero: bool = False,
                   schedule: bool = True) -> None:
  """A number must be finite and > 0 (≥ 0 with `allow_zero`); arrays and
  schedules (where the option takes one) are checked at run time
  (`positive_ok`)."""
  x = _number(value)
  if x is None:
    _check_number_or_later(name, value, schedule)
    return
  if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
    bound = "≥ 0" if allow_zero else "> 0"
    raise ValueError(f"{name} must be finite and {bound}, got {value!r}")


def check_normal(name: str, value: Any, dtype: Any) -> None:
  """A positive number must stay positive in `dtype` (not round to 0 or a
  subnormal there): at least its smallest normal number."""
  x, dtype = _number(value), jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
  tiny = float(jnp.finfo(dtype).tiny)
  if x is not None and 0 < x < tiny:
    raise ValueError(f"{name}={value!r} is below the smallest normal {dtype.name} "
                     f"number ({tiny:.3g}), the dtype it is applied in: it would "
                     "round to 0.")


def check_range(name: str, value: Any, low: float, high: float, *,
                closed_low: bool = True, closed_high: bool = False,
                schedule: bool = True) -> None:
  """A number must lie in the interval; arrays (and schedules, where the
  option takes one) are checked at run time."""
  x = _number(value)
  if x is None:
    _check_number_or_later(name, value, schedule)
    return
  above = x >= low if closed_low else x > low
  below = x <= high if closed_high else x < high
  if not (math.isfinite(x) and above and below):
    interval = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
    raise ValueError(f"{name} must be in {interval}, got {value!r}")


def check_first_order_tail(learning_rate: Any, momentum: Any = None,
                           weight_decay: Any = 0.0) -> None:
  """The optax steps that `kd.kfac`, `kd.shampoo` and `kd.soap` chain after
  their preconditioner: `learning_rate` ≥ 0 (0: a warm-up's first value),
  `momentum` None or in [0, 1) (no schedule), `weight_decay` ≥ 0. Numbers are
  checked here; arrays and schedules at run time (`first_order_tail_checks`)."""
  check_positive("learning_rate", learning_rate, allow_zero=True)
  if callable(momentum) and not hasattr(momentum, "dtype"):
    raise TypeError(f"momentum must be a number or an array (optax's momentum trace "
                    f"takes no schedule), got {momentum!r}")
  if momentum is not None:
    check_range("momentum", momentum, 0.0, 1.0)
  check_positive("weight_decay", weight_decay, allow_zero=True)


def first_order_tail(learning_rate: Any, momentum: Any, weight_decay: Any,
                     nesterov: bool) -> tuple[optax.GradientTransformation, ...]:
  """The optax steps after a preconditioner: `add_decayed_weights(weight_decay)`,
  then `sgd(learning_rate, momentum, nesterov)`. A momentum of the number 0
  keeps no trace (optax's own would keep a parameter-sized buffer of zeros)."""
  if cadence.is_number(momentum) and momentum == 0:
    momentum = None
  return (optax.add_decayed_weights(weight_decay),
          optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov))


def differs_from_default(value: Any, default: Any) -> bool:
  """Whether an option was given another value than its `default` (an array,
  from `optax.inject_hyperparams`, which injects the defaults too, cannot be
  told from the default: False)."""
  return not hasattr(value, "dtype") and value != default


def positive_int(value: Any) -> bool:
  """Whether `value` is a number that is a positive integer (NaN and ±∞ are not)."""
  return (cadence.is_number(value) and math.isfinite(value) and int(value) == value
          and value >= 1)


def check_interval(name: str, value: Any) -> None:
  """An interval: a positive int, or a schedule of the update count (its
  values are checked at run time)."""
  if not cadence.is_number(value) and (callable(value) or hasattr(value, "dtype")):
    return
  if not positive_int(value):
    raise ValueError(f"{name} must be a positive integer or a schedule, got {value!r}")


def check_floating_dtype(name: str, dtype: Any) -> None:
  """`dtype` must be a floating dtype (None: the default). An array is what
  `optax.inject_hyperparams` makes of a dtype: callable, it is taken for a
  schedule, whose value is an array of the parameters' dtype."""
  if dtype is None:
    return
  if isinstance(dtype, (jax.Array, np.ndarray)):
    raise TypeError(f"{name} must be a floating dtype (e.g. jnp.float32, jnp.bfloat16), "
                    f"got an array: optax.inject_hyperparams takes a dtype (a callable) "
                    f"for a schedule; name {name} in static_args, e.g. "
                    f"optax.inject_hyperparams(..., static_args=({name!r},)).")
  try:
    floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError as e:
    raise TypeError(f"{name} must be a floating dtype (e.g. jnp.float32, jnp.bfloat16), "
                    f"got {dtype!r}") from e
  if not floating:
    raise TypeError(f"{name} must be a floating dtype (e.g. jnp.float32, jnp.bfloat16), "
                    f"got {jnp.dtype(dtype).name}")


def check_optional_positive_int(name: str, value: Any) -> None:
  """A positive int or None (an array, from `optax.inject_hyperparams`, passes)."""
  if value is None or (hasattr(value, "dtype") and not cadence.is_number(value)):
    return
  if not positive_int(value):
    raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


# ------------------------------------------------- structural options

class StaticDefault:
  """A numeric default that `optax.inject_hyperparams` passes through
  unchanged: not a number, so it is not turned into an array (traced under
  `jax.eval_shape` or `jit`, and no longer recognisable as the default) as
  numeric defaults are. For structural options (the state's shapes) and
  defaults that depend on other options (`kd.kfac`'s KL clip). Reads as its
  value (`int()`, `float()`, `==`; `repr` as `text`, default the value's);
  `concrete` unwraps it."""

  def __init__(self, value: int | float, text: str | None = None):
    self.value, self.text = value, text

  def __index__(self) -> int:
    return operator.index(self.value)

  def __int__(self) -> int:
    return int(self.value)

  def __float__(self) -> float:
    return float(self.value)

  def __eq__(self, other: Any) -> bool:
    return other is self or other == self.value

  def __hash__(self) -> int:
    return hash(self.value)

  def __repr__(self) -> str:
    return repr(self.value) if self.text is None else self.text


def concrete(value: Any) -> Any:
  """`value` as a Python number where it is known: a `StaticDefault`'s value,
  a concrete scalar array's item (`optax.inject_hyperparams` at a concrete
  `init`, or an eager `update`), a NumPy scalar's; anything else (a tracer, a
  number, None, a bool) unchanged."""
  if isinstance(value, StaticDefault):
    return value.value
  if isinstance(value, np.generic) or (
      isinstance(value, (jax.Array, np.ndarray))
      and not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0):
    return np.asarray(value).item()
  return value


def static(name: str, value: Any) -> Any:
  """A structural option's value, known when tracing (`concrete`); a traced
  array raises, naming `name` and `static_args`."""
  value = concrete(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} decides the optimizer state's shapes or program, so it must be known "
        f"when tracing, but it is a traced array: optax.inject_hyperparams turns every "
        f"number passed to it into an array, traced under jax.eval_shape and jit: pass "
        f"optax.inject_hyperparams(..., static_args=({name!r},)).")
  return value


# ------------------------------------------------------------------ run time

Verdict = jax.Array | np.bool_     # a Python number's verdict is known when tracing


def _value(name: str, value: Any, count: jax.Array) -> jax.Array | np.ndarray:
  """The value of hyperparameter `name` at `count` (one number, else an
  error); a Python number as the NumPy array of the dtype
  `jnp.asarray` would give it (float32 unless x64), so that its verdict is
  computed exactly as a traced one would be, but while tracing (no equations).
  A number beyond that dtype's range is its infinity, as `jnp.asarray` gives
  it (NumPy's overflow warning silenced)."""
  if cadence.is_number(value):
    with np.errstate(over="ignore"):
      return np.asarray(value, jax.dtypes.canonicalize_dtype(np.asarray(value).dtype))
  x = jnp.asarray(cadence.value_at(value, count))
  _check_scalar(name, x, callable(value))
  return x


def _xnp(x: Any) -> Any:
  return np if isinstance(x, np.ndarray) else jnp


def positive_ok(name: str, value: Any, count: jax.Array, allow_zero: bool = False
                ) -> Verdict:
  x = _value(name, value, count)
  xnp = _xnp(x)
  return xnp.all(xnp.isfinite(x) & ((x >= 0) if allow_zero else (x > 0)))


def range_ok(name: str, value: Any, count: jax.Array, low: float, high: float,
             closed_low: bool = True, closed_high: bool = False) -> Verdict:
  x = _value(name, value, count)
  above = (x >= low) if closed_low else (x > low)
  below = (x <= high) if closed_high else (x < high)
  xnp = _xnp(x)
  return xnp.all(xnp.isfinite(x) & above & below)


def interval_ok(name: str, value: Any, count: jax.Array) -> Verdict:
  """An interval's value at `count` is a whole number ≥ 1 (a schedule's 2.5
  would run every 2 steps: truncated)."""
  x = _value(name, value, count)
  xnp = _xnp(x)
  return xnp.all((x >= 1) & (xnp.floor(x) == x))


class RunTimeChecks(NamedTuple):
  """Checks of values only the step knows, each a function of the optax
  chain's update count; `counted`: one of them evaluates a schedule there
  (whoever runs them must then keep the count)."""
  checks: tuple[Callable[[jax.Array], jax.Array], ...]
  counted: bool


def first_order_tail_checks(learning_rate: Any, momentum: Any = None,
                            weight_decay: Any = 0.0) -> RunTimeChecks:
  """The run-time checks of `check_first_order_tail` for the values it could
  not check: arrays (`optax.inject_hyperparams` passes every numeric
  hyperparameter as one) and schedules (their value at the count, as optax's
  own count evaluates them: a cosine decay to a negative floor, a linear one
  past zero)."""
  named = ((learning_rate, functools.partial(positive_ok, "learning_rate", allow_zero=True)),
           (momentum, functools.partial(range_ok, "momentum", low=0.0, high=1.0)),
           (weight_decay, functools.partial(positive_ok, "weight_decay", allow_zero=True)))
  run_time = [(value, check) for value, check in named
              if hasattr(value, "dtype") or callable(value)]
  return RunTimeChecks(
      tuple(functools.partial(check, value) for value, check in run_time),
      any(not hasattr(value, "dtype") for value, _ in run_time))


def all_ok(checks: Sequence[Callable[[], Verdict]]) -> jax.Array:
  """The `and` of the run-time checks (those of Python numbers folded while
  tracing)."""
  known, traced = True, []
  for check in checks:
    verdict = check()
    if isinstance(verdict, (bool, np.bool_)):
      known = known and bool(verdict)
    else:
      traced.append(verdict)
  ok = jnp.asarray(known)
  for verdict in traced:
    ok = ok & verdict
  return ok
