"""One fault policy for both preconditioners: a faulty step is skipped everywhere.

A step is faulty when anything it consumes or produces is not finite: a
gradient, a curvature statistic it reads, or the update it returns. A faulty
step returns zero updates and leaves the state as it was, except the
`skipped` counter; `count` does not advance, so the cadence and the schedules
see the accepted steps only, and a run with a faulty batch inserted equals,
bit for bit, the run without it. Inside `shard_map` the devices agree on the
verdict (`agree`: one device's NaN skips the step on all of them).

`skip_faulty_steps` extends this to a whole optax chain (momentum, schedules'
counts): `kd.kfac` and `kd.shampoo` wrap their chains in it. Inside it, a
preconditioner leaves the zeroing of a faulty step's updates to the wrapper,
which zeroes the whole chain's anyway: one select per parameter less in every
fused update (PERF_NOTES §11).

Decompositions fail differently: a factor or statistic whose decomposition
(eigenbasis, inverse, inverse root) is not finite keeps its previous one, and
the step goes on; that is each preconditioner's own business.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
from jax import lax
import optax

from kfac_jax_dist import _compat
from kfac_jax_dist.core import settings
from kfac_jax_dist.core import states as states_lib

SCOPE = "kfac_fault_check"     # the named scope of the checks (benchmarks read it)

# True while `skip_faulty_steps` traces its inner transform: the wrapper then
# zeroes a skipped step's updates, so the preconditioners need not.
_ZEROED_BY_WRAPPER = contextvars.ContextVar("kd_zeroed_by_wrapper", default=False)


def _zero_or_nan(x: jax.Array, axis: int | None = None) -> jax.Array:
  """`Σ |x|·0` over `axis` (float32): 0 where every number is finite, NaN where
  one is a NaN or ±∞ (∞·0 = NaN), exactly. One reduction (`all(isfinite(x))`
  is an elementwise test and a reduction: on the LM's update the fault checks
  were 40% of the launched kernels; see benchmarks/gpu_probe.py)."""
  return jnp.sum(jnp.abs(x) * 0, axis=axis, dtype=jnp.float32)


def all_finite(arrays: Iterable[Any]) -> jax.Array:
  """Whether every inexact array of `arrays` is finite (a scalar bool)."""
  zeros = [_zero_or_nan(x) for x in arrays
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.isfinite(jnp.sum(jnp.stack(zeros))) if zeros else jnp.asarray(True)


def finite_rows(x: jax.Array) -> jax.Array:
  """`[k]`: whether row i of `x` (`[k, ...]`) is finite."""
  return jnp.isfinite(_zero_or_nan(x.reshape(x.shape[0], -1), axis=1))


def agree(ok: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """True on every device iff `ok` on every device of `axes` (a psum of the
  failures); `ok` itself without axes."""
  if not axes:
    return ok
  failures = _compat.as_varying((~ok).astype(jnp.int32), axes)
  return lax.psum(failures, axes) == 0


def computed_once(flag: jax.Array, if_true: Any = True, if_false: Any = False
                  ) -> jax.Array:
  """`where(flag, if_true, if_false)` for a scalar `flag`, computed once (the
  default: `flag` itself). XLA fuses (duplicates) a chain of cheap scalar ops
  into each consumer; the verdict (an `and` of one check per gradient and
  statistic) has tens of consumers (the cadence conds, the update and state
  selects), and the KL clip's `ν` (a sum over every layer) one per layer,
  so the chain would be copied into each: O(L²) instructions for L layers.
  On CPU a `lax.cond` (not fused: its result is one value; 8% fewer HLO
  instructions than a barrier on the step_time CNN); elsewhere an
  optimization barrier, since a GPU conditional is a host round trip (see
  `kd.value_and_grad`)."""
  if_true = jnp.asarray(if_true)
  if_false = jnp.asarray(if_false, if_true.dtype)
  axes = _compat.varying_axes(flag, if_true, if_false)

  def on_cpu(f: jax.Array) -> jax.Array:
    return lax.cond(f, lambda: _compat.as_varying(if_true, axes),
                    lambda: _compat.as_varying(if_false, axes))

  def elsewhere(f: jax.Array) -> jax.Array:
    return lax.optimization_barrier(jnp.where(f, if_true, if_false))
  return lax.platform_dependent(flag, cpu=on_cpu, default=elsewhere)


def pick(flag: jax.Array, if_true: jax.Array, if_false: jax.Array) -> jax.Array:
  """`if_true` if the scalar `flag`, else `if_false`, number by number.

  As `jnp.where(flag, ...)`, but the predicate compares the innermost axis's
  index with 0 or that axis's length: XLA:CPU's LLVM unswitches a fused loop
  on a loop-invariant select, one copy of the loop per value, and not on a
  predicate that varies along the loop (with the wrapper's zeroing, the
  step_time CNN's update kernels went from 9152 to 3692 lines of LLVM IR,
  SGD's being 2763: PERF_NOTES §11)."""
  shape = jnp.broadcast_shapes(jnp.shape(if_true), jnp.shape(if_false))
  if not shape:
    return jnp.where(flag, if_true, if_false)
  bound = jnp.where(flag, shape[-1], 0)
  inner = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
  return jnp.where(inner < bound, if_true, if_false)


def zeros_unless(ok: jax.Array, updates: Any) -> Any:
  """`updates` where `ok`, else zeros of their shapes and dtypes (`pick`)."""
  return jax.tree_util.tree_map(
      lambda u: pick(ok, u, jnp.zeros(u.shape, u.dtype)), updates)


def select(ok: jax.Array, new: Any, old: Any) -> Any:
  """`new` where `ok`, else `old`, leaf by leaf: `pick` for matrices (adaptive
  K-FAC's velocity, whose fused update kernels LLVM unswitched: the step_time
  MLP's adaptive step fell from 31749 to 30798 lines of IR), `jnp.where` for
  vectors (a 1-D `pick` was unswitched where the plain select was not: the
  LM's running factors; benchmarks/ir_census.py)."""
  return jax.tree_util.tree_map(
      lambda n, o: pick(ok, n, o) if jnp.ndim(n) > 1 else jnp.where(ok, n, o), new, old)


def accept_or_skip(ok: jax.Array, updates: Any, new_state: states_lib.S,
                   old_state: states_lib.S) -> tuple[Any, states_lib.S]:
  """`(updates, new_state)` of an accepted step; for a faulty one (`ok`
  False), zero updates and `old_state` with one more `skipped`. Inside
  `skip_faulty_steps` a faulty step's updates are left as computed: the
  wrapper replaces them (and everything after them in its chain) by zeros."""
  if not _ZEROED_BY_WRAPPER.get():
    updates = zeros_unless(ok, updates)
  skipped = old_state.skipped + (~ok).astype(old_state.skipped.dtype)
  kept = dataclasses.replace(old_state, skipped=skipped)
  return updates, select(ok, dataclasses.replace(new_state, skipped=skipped), kept)


def poison_unless(run_time: settings.RunTimeChecks
                  ) -> list[optax.GradientTransformation]:
  """A first link for a preconditioner's chain that makes the step faulty when
  a run-time check fails: the gradients become NaN, so the preconditioner
  after it skips the step its own way (every device, state unchanged). The
  checks see the chain's update count, which the link keeps when one of them
  evaluates a schedule (`ScaleByScheduleState`, advanced as optax's schedules'
  counts are: a skipped step leaves it where it was). No link (`[]`) when
  there is nothing to check."""
  if not run_time.checks:
    return []

  def init_fn(params: Any) -> Any:
    del params
    if not run_time.counted:
      return optax.EmptyState()
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    del params
    count = getattr(state, "count", jnp.zeros([], jnp.int32))
    ok = settings.all_ok([functools.partial(check, count) for check in run_time.checks])
    poisoned = jax.tree_util.tree_map(
        lambda g: jnp.where(ok, g, jnp.nan).astype(g.dtype), updates)
    if run_time.counted:
      state = optax.ScaleByScheduleState(count=optax.safe_increment(state.count))
    return poisoned, state
  return [optax.GradientTransformation(init_fn, update_fn)]


def narrower(dtype: Any, than: Any) -> bool:
  """Whether floating `dtype` has a smaller range than `than` (float16 than
  float32: a cast into it may overflow where the value was finite)."""
  return (jnp.issubdtype(dtype, jnp.floating)
          and jnp.finfo(dtype).max < jnp.finfo(than).max)


def _narrow_leaves_finite(updates: Any) -> jax.Array | None:
  """Whether the leaves of a smaller range than float32 (float16) are finite,
  agreed by the devices their values vary over (None: no such leaf). The
  preconditioners check what they produce; a tail after them may still
  overflow such a leaf."""
  narrow = [u for u in jax.tree_util.tree_leaves(updates)
            if narrower(u.dtype, jnp.float32)]
  if not narrow:
    return None
  return agree(all_finite(narrow), _compat.varying_axes(*narrow))


def _check_update_arguments(state: Any, more: tuple) -> None:
  """`update(updates, state, params)`: more positional arguments (the
  statistics, which go by keyword), or a state holding no preconditioner's
  (another optimizer's, the arguments swapped), raise naming what to pass."""
  if more:
    raise TypeError(f"update takes (updates, state, params) positionally, got {len(more)} "
                    "more: K-FAC's statistics and batch go by keyword (kfac_stats=, "
                    "kfac_batch=).")
  if not states_lib.find_states(state):
    raise TypeError(f"update: the state ({type(state).__name__}) holds no K-FAC, Shampoo "
                    "or SOAP state: pass the state this transform's init returned, as "
                    "update(updates, state, params) (skip_faulty_steps wraps transforms "
                    "that hold one).")


def skip_faulty_steps(inner: optax.GradientTransformation
                      ) -> optax.GradientTransformationExtraArgs:
  """Makes a step that a preconditioner skips a no-op for the whole of `inner`.

  `inner` is any optax transform holding K-FAC or Shampoo states (e.g. a chain
  with momentum). On a step where one of them skipped (see the module
  docstring), the returned updates are zeros and the state of every transform
  in `inner` is the previous one, so momentum, schedules' counts and the like
  neither decay nor advance (zeros alone would still decay a momentum trace
  and move the parameters). The preconditioner states count the skip in their
  `skipped` field. A step whose final updates overflow a float16 leaf (e.g. a
  momentum trace kept in the parameters' dtype) is skipped too. Stateless: the
  state is `inner`'s own.
  """
  inner = optax.with_extra_args_support(inner)
  is_state = lambda x: isinstance(x, states_lib.PreconditionerState)

  @_compat.updates_on_auto_axes
  def update_fn(updates: Any, state: Any, params: Any = None, *more: Any,
                **extra_args: Any) -> tuple[Any, Any]:
    _check_update_arguments(state, more)
    token = _ZEROED_BY_WRAPPER.set(True)
    try:
      new_updates, new_state = inner.update(updates, state, params, **extra_args)
    except ValueError as error:
      if "number of updates and states has to be the same in chain" not in str(error):
        raise
      parts = len(state) if isinstance(state, (tuple, list)) else 1
      raise TypeError(
          f"update: the state has {parts} part(s) at its top level, not this "
          "transform's: another optimizer's (e.g. a hand-built optax.chain("
          "kd.scale_by_kfac(...), optax.sgd(...))'s given to kd.kfac). Pass the state "
          "this transform's init returned.") from error
    finally:
      _ZEROED_BY_WRAPPER.reset(token)
    old, new = states_lib.find_states(state), states_lib.find_states(new_state)
    skipped = jnp.any(jnp.stack([n.skipped != o.skipped for o, n in zip(old, new)]))
    finite = _narrow_leaves_finite(new_updates)
    overflown = None if finite is None else ~finite & ~skipped
    if overflown is not None:
      skipped = skipped | overflown

    def keep(before: Any, after: Any) -> Any:
      if not is_state(after):
        return pick(skipped, before, after)
      if overflown is None:     # already unchanged but for its `skipped` count
        return after
      return select(overflown, dataclasses.replace(before, skipped=before.skipped + 1),
                    after)
    kept = jax.tree_util.tree_map(keep, state, new_state, is_leaf=is_state)
    return zeros_unless(~skipped, new_updates), kept

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
