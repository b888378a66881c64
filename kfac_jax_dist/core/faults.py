"""One fault policy for both preconditioners: a faulty step is skipped everywhere.

A step is faulty when anything it consumes or produces is not finite: a
gradient, a curvature statistic it reads, or the update it returns. A faulty
step returns zero updates and leaves the state as it was, except the
`skipped` counter; `count` does not advance, so the cadence and the schedules
see the accepted steps only, and a run with a faulty batch inserted equals,
bit for bit, the run without it. Inside `shard_map` the devices agree on the
verdict (`agree`: one device's NaN skips the step on all of them).

`skip_faulty_steps` extends this to a whole optax chain (momentum, schedules'
counts): `kd.kfac` and `kd.shampoo` wrap their chains in it.

Decompositions fail differently: a factor or statistic whose decomposition
(eigenbasis, inverse, inverse root) is not finite keeps its previous one, and
the step goes on; that is each preconditioner's own business.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp
from jax import lax
import optax

from kfac_jax_dist import _compat
from kfac_jax_dist.core import states as states_lib

SCOPE = "kfac_fault_check"     # the named scope of the checks (benchmarks read it)


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


def computed_once(flag: jax.Array) -> jax.Array:
  """`flag`, computed once. XLA fuses (duplicates) a chain of cheap scalar ops
  into each consumer; the verdict (an `and` of one check per gradient and
  statistic) has tens of consumers (the cadence conds, the update and state
  selects), so its chain would be copied into each. On CPU a `lax.cond`
  (not fused: its result is one value; 8% fewer HLO instructions than a
  barrier on the step_time CNN); elsewhere an optimization barrier, since a
  GPU conditional is a host round trip (see `kd.value_and_grad`)."""
  axes = _compat.varying_axes(flag)

  def on_cpu(f: jax.Array) -> jax.Array:
    return lax.cond(f, lambda: _compat.as_varying(jnp.asarray(True), axes),
                    lambda: _compat.as_varying(jnp.asarray(False), axes))
  return lax.platform_dependent(flag, cpu=on_cpu, default=lax.optimization_barrier)


def select(ok: jax.Array, new: Any, old: Any) -> Any:
  """`new` where `ok`, else `old`, leaf by leaf."""
  return jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)


def accept_or_skip(ok: jax.Array, updates: Any, new_state: states_lib.S,
                   old_state: states_lib.S) -> tuple[Any, states_lib.S]:
  """`(updates, new_state)` of an accepted step; for a faulty one (`ok`
  False), zero updates and `old_state` with one more `skipped`."""
  zeros = jax.tree_util.tree_map(
      lambda u: jnp.where(ok, u, jnp.zeros(u.shape, u.dtype)), updates)
  skipped = old_state.skipped + (~ok).astype(old_state.skipped.dtype)
  kept = dataclasses.replace(old_state, skipped=skipped)
  return zeros, select(ok, dataclasses.replace(new_state, skipped=skipped), kept)


def skip_faulty_steps(inner: optax.GradientTransformation
                      ) -> optax.GradientTransformationExtraArgs:
  """Makes a step that a preconditioner skips a no-op for the whole of `inner`.

  `inner` is any optax transform holding K-FAC or Shampoo states (e.g. a chain
  with momentum). On a step where one of them skipped (see the module
  docstring), the returned updates are zeros and the state of every transform
  in `inner` is the previous one, so momentum, schedules' counts and the like
  neither decay nor advance (zeros alone would still decay a momentum trace
  and move the parameters). The preconditioner states count the skip in their
  `skipped` field. Stateless: the state is `inner`'s own.
  """
  inner = optax.with_extra_args_support(inner)
  is_state = lambda x: isinstance(x, states_lib.PreconditionerState)

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any
                ) -> tuple[Any, Any]:
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    old, new = states_lib.find_states(state), states_lib.find_states(new_state)
    if not new:
      raise ValueError("skip_faulty_steps wraps a transform with no scale_by_kfac "
                       "or scale_by_shampoo.")
    skipped = jnp.any(jnp.stack([n.skipped != o.skipped for o, n in zip(old, new)]))

    def keep(before: Any, after: Any) -> Any:
      if is_state(after):       # already unchanged but for its `skipped` count
        return after
      return jnp.where(skipped, before, after)
    kept = jax.tree_util.tree_map(keep, state, new_state, is_leaf=is_state)
    zeros = jax.tree_util.tree_map(
        lambda u: jnp.where(skipped, jnp.zeros(u.shape, u.dtype), u), new_updates)
    return zeros, kept

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
