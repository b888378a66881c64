"""When a preconditioner refreshes its statistics and its decompositions.

Both preconditioners count their accepted updates (`count`, from 0; a skipped
step does not advance it, see `faults`) and refresh some work every `every`
updates:

    due(every, count) = count % every(count) == 0,

where `every` is an int or an optax-style schedule of `count` (so an interval
may grow during training). Shampoo's roots additionally wait for a start step
`s` and are also refreshed at `s` itself, so that the first preconditioned step
has roots of its own statistics (Anil et al. 2020, §5; Google's
`distributed_shampoo` computes roots at every multiple of its interval from
step 0 whatever the start, and its first preconditioned step uses the last
multiple's):

    due_from(s, every, count) = count ≥ s(count) and (due(every, count) or count = s(count)).

A refresh runs under `lax.cond` on these flags, so a step that refreshes
nothing does none of that work.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

ScalarOrSchedule = Union[float, int, Callable[[jax.Array], Any]]


def value_at(value: ScalarOrSchedule, count: jax.Array) -> Any:
  """`value(count)` for a schedule, else `value`."""
  return value(count) if callable(value) else value


def is_number(value: Any) -> bool:
  """A Python or NumPy int or float (not a bool, an array or a schedule)."""
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool))


def due(every: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """Whether the work refreshed every `every` updates is due at `count`."""
  return jnp.asarray(count % jnp.asarray(value_at(every, count), count.dtype) == 0)


def due_from(start: ScalarOrSchedule, every: ScalarOrSchedule, count: jax.Array
             ) -> jax.Array:
  """`due` from the start step `start` on, and at `start` itself."""
  first = jnp.asarray(value_at(start, count), count.dtype)
  return (count >= first) & (due(every, count) | (count == first))


def always(every: ScalarOrSchedule, start: ScalarOrSchedule = 0) -> bool:
  """Whether the work is statically due at every count (no `lax.cond` needed)."""
  return is_number(every) and every == 1 and is_number(start) and start == 0


def cond_unless_always(every: ScalarOrSchedule, ready: jax.Array, new: Callable[[], Any],
                       old: Callable[[], Any], start: ScalarOrSchedule = 0) -> Any:
  """`lax.cond(ready, new, old)`, or `new()` alone when the work is `always`
  due (no conditional: on a GPU each is a host round trip)."""
  return new() if always(every, start) else jax.lax.cond(ready, new, old)


def when_due(every: ScalarOrSchedule, count: jax.Array, new: Callable[[], Any],
             old: Callable[[], Any], start: ScalarOrSchedule | None = None) -> Any:
  """`new()` when the work is due at `count` (`due`, or `due_from(start, …)`),
  else `old()` (`cond_unless_always`)."""
  ready = due(every, count) if start is None else due_from(start, every, count)
  return cond_unless_always(every, ready, new, old, 0 if start is None else start)
