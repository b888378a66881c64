"""Shares of the global batch: local losses weighted so that plain means are exact.

A registered loss with a mask averages over `n` examples, a number that
differs between the devices of a data-parallel mesh and between the slices
of `accumulate`; the global batch's loss averages over `N = Σ n`. Each of the
`m` local batches (`P` devices times `k` slices) weighs its registered loss's
value by its share

    w = m·n / N      (`loss_weight`; 0 for an empty local batch),

inside the loss function (`context.weighted`), so that the plain mean of the
whole losses the function returns, `(1/m) Σ (w·ℓ + r)`, is the global
batch's `Σ n·ℓ / N + (1/m) Σ r` for the other terms `r`: exact for a
batch-independent penalty (L2) and a mean over every position (a z-loss, a
load-balancing loss); a term masked its own way is exact written with
`kd.losses.masked_mean`, weighted by its own share the same way (a masked
mean written by hand is the mean of the local means). Gradients follow from
the loss. The statistics quadratic in the output cotangents
(`G`, `F`, EK-FAC's `S`), which carry `w²`, are computed unweighted and
weighted by `w` where a strategy averages them (`weigh_statistics`).

Without a mask `n` is the local batch's size, known when tracing and equal
everywhere (`w = 1`): nothing is weighted. With `k > 1` slices, `N` is
counted before the pass over the slices (`total_examples`): a pass over
the count alone, which under `jit` compiles down to the masks' sums.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import batches
from kfac_jax_dist.capture import context as _context

# (n, i) -> the weight of the i-th masked mean of the loss, over n examples.
LossWeight = Callable[[Any, int], jax.Array]


def _count_dtype(n: Any) -> Any:
  return jnp.promote_types(jnp.result_type(n), jnp.float32)


def _weight(axes: tuple[str, ...], slices: int, totals: Any) -> LossWeight:
  """`(n, i) → m·n / N_i`, `m = slices · P` (`P` the devices over `axes`),
  `N_i` the global batch's `totals[i]` (None: `psum(n)` over `axes`, one
  slice)."""
  def of(n: Any, i: int) -> jax.Array:
    n = jnp.asarray(n, _count_dtype(n))
    count = slices * (jax.lax.psum(1, axes) if axes else 1)
    every = (jax.lax.psum(_compat.as_varying(n, axes), axes) if totals is None
             else totals[i])
    return jax.lax.stop_gradient(count * n / _context.denominator(every.astype(n.dtype)))
  return of


def total_examples(fun: Callable, params: Any, args: tuple, kwargs: dict, k: int,
                   axes: tuple[str, ...], caller: str) -> jax.Array | None:
  """`[N_i]`: the examples of each masked mean of the loss (the registered
  loss's, `kd.losses.masked_mean`'s, in the order they run) summed over the
  `k` slices of `args` and over `axes`; None where there is none."""
  def counts(p: Any, a: tuple, kw: dict) -> jax.Array:
    _, trace = _context.run_plain(fun, p, a, kw)
    dtype = functools.reduce(jnp.promote_types, map(_count_dtype, trace.counts))
    return jnp.stack([jnp.asarray(n, dtype) for n in trace.counts])

  if not jax.eval_shape(lambda p, a: _context.run_plain(fun, p, a, kwargs)[1].counts,
                        params, args):
    return None
  n = batches.summed(counts, params, args, kwargs, k, caller,
                     _compat.varying_axes(params, args, kwargs))
  return jax.lax.psum(n, axes) if axes else n


def loss_weight(fun: Callable, params: Any, args: tuple, kwargs: dict, k: int,
                caller: str) -> LossWeight | None:
  """The weights of the masked means (the registered loss's,
  `kd.losses.masked_mean`'s) of each of the `k` slices of `args` on this
  device (see the module docstring); None for one slice outside `shard_map`,
  or several without a masked mean (weights of 1)."""
  axes = _compat.varying_axes(args, kwargs)
  if k == 1:
    return _weight(axes, 1, None) if axes else None
  total = total_examples(fun, params, args, kwargs, k, axes, caller)
  return None if total is None else _weight(axes, k, total)


def mean_of_shares(total: jax.Array, k: int, axes: tuple[str, ...]) -> jax.Array:
  """The global batch's loss from `total`, this device's sum of its `k`
  slices' weighted losses: their plain mean over slices and devices."""
  mean = total / k
  return jax.lax.pmean(_compat.as_varying(mean, axes), axes) if axes else mean


def unweighted_scale(n: Any, weight: Any) -> Any:
  """The scale that makes statistics quadratic in the cotangents of a loss
  weighted by `weight` those of the unweighted loss over `n` examples:
  `n / w²` (`n` where `w` is None; 0 for an empty batch, `n = w = 0`)."""
  if weight is None:
    return n
  return n / _context.denominator(weight * weight).astype(jnp.result_type(n))


def weigh_statistics(stats: dict, weight: Any, axes: tuple[str, ...],
                     weighed: frozenset[str]) -> dict:
  """Inside `shard_map`, the statistics named in `weighed` (of `G`/`F`/`S`)
  weighted by this device's share `w = P·n / N` of the registered loss's
  examples (`weight`, the mean of its slices'), so that their plain mean
  over the batch's `axes` is the global batch's; e.g. `G = n Σ ĝ ĝᵀ` with
  `ĝ = g/n` gives `Σ_d w_d G_d / P = Σ_d n_d G_d / N`. Nothing to do outside
  `shard_map` or without a mask (`weight` None: `w = 1`). `A`, a mean over
  every device's positions, needs none."""
  if not axes or weight is None:
    return stats
  times = lambda x: (x * weight.astype(x.dtype)).astype(x.dtype)
  return {name: {key: times(v) if key in weighed else v for key, v in layer.items()}
          for name, layer in stats.items()}
