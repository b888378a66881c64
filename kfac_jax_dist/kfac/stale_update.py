"""The two stages of a K-FAC step with stale statistics (SP-NGD §4.3).

`refresh_due_factors` (Algorithm 1): only the factors whose refresh step has
come (`next_step ≤ count`) are communicated (each in its own all-reduce: a
fused reduce-scatter cannot leave stale factors out) and averaged into their
running factors; their owners compare them with their last two refreshed
values and set the next interval (Algorithm 2, `stale.next_interval`).
`decompose_due_factors`: eigendecompositions of those factors only. The
schedule math is in `stale`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import statistics
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import faults
from kfac_jax_dist.kfac import factors
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import linalg
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac import stale
from kfac_jax_dist.kfac.config import KfacConfig
from kfac_jax_dist.kfac.decompositions import distribute_second
from kfac_jax_dist.kfac.state import ScaleByKfacState


def _factor_index(layout: layout_lib.Layout) -> dict[tuple[str, str], int]:
  return {(plan.layer.name, which): f
          for f, (plan, which, _) in enumerate(stale.factor_order(layout))}


def _due_statistics(config: KfacConfig, comm: collectives_lib.Collectives,
                    layout: layout_lib.Layout, stats: factors.Stats, due: jax.Array
                    ) -> list[jax.Array]:
  """Every factor's batch statistic, packed: averaged over the devices when it
  is due (zeros otherwise), or the owner's own with local factors (DP-KFAC)."""
  out = []
  for f, (plan, which, place) in enumerate(stale.factor_order(layout)):
    x = packing.pack_factor(
        factors.layer_statistic(stats, plan, which, layout.packed).astype(
            config.compute_dtype),
        place.form, layout.packed)
    if config.local_factors:
      out.append(x)
    else:
      zeros = _compat.as_varying(jnp.zeros(x.shape, x.dtype), config.model_axes)
      out.append(lax.cond(due[f], lambda x=x: comm.all_reduce_factors(x),
                          lambda zeros=zeros: zeros))
  return out


def refresh_due_factors(config: KfacConfig, comm: collectives_lib.Collectives,
                        state: ScaleByKfacState, stats: factors.Stats
                        ) -> tuple[jax.Array, stale.RefreshState, jax.Array]:
  """SP-NGD Algorithm 1: (running factors, refresh state, due flags)."""
  layout, r, count = state.layout, state.refresh, state.count
  index, dtype = _factor_index(layout), config.compute_dtype
  decay = jnp.asarray(config.factor_decay, r.weight.dtype)   # an injected array may be wider
  due = r.next_step <= count                  # the same on every device
  batch = _due_statistics(config, comm, layout, stats, due)
  weight = jnp.where(due, decay * r.weight + (1.0 - decay), r.weight)

  def owner_update(device: int) -> tuple[jax.Array, ...]:
    pieces, lasts, befores = [], [], []
    bits = jnp.zeros([len(index), 2], jnp.int32)
    for place, plan, which in layout.owned(device):
      f = index[(plan.layer.name, which)]
      span = slice(place.offset, place.offset + place.size)
      old = state.factors[span].astype(dtype)
      new = (decay * r.weight[f] * old + (1.0 - decay) * batch[f]) / weight[f]
      new = jnp.where(due[f], new, old).astype(config.factor_dtype)
      last, before = r.last[span], r.before_last[span]
      similar = [(r.refreshes[f] >= k) & (stale.relative_change(
          new.astype(dtype), y.astype(dtype), place, layout.packed)
          < config.stale_threshold) for k, y in ((1, last), (2, before))]
      bits = bits.at[f].set(jnp.stack(similar).astype(jnp.int32))
      pieces.append(new)
      lasts.append(jnp.where(due[f], new, last))
      befores.append(jnp.where(due[f], last, before))
    pad = functools.partial(collectives_lib.pad_to, length=layout.segment,
                            dtype=config.factor_dtype)
    return pad(pieces), pad(lasts), pad(befores), bits

  running, last, before, bits = comm.per_device(owner_update, layout.device_branches)
  if comm.active:                            # owners tell everyone
    bits = lax.psum(bits, layout.axis)
  if config.model_axes:     # one schedule on every model shard: similar where all are
    bits = lax.pmin(bits, config.model_axes)
  interval = stale.next_interval(bits[:, 0] > 0, bits[:, 1] > 0, r.interval,
                                 r.previous_interval)
  refresh = dataclasses.replace(
      r, weight=weight, last=last, before_last=before,
      next_step=jnp.where(due, count + interval, r.next_step),
      interval=jnp.where(due, interval, r.interval),
      previous_interval=jnp.where(due, r.interval, r.previous_interval),
      refreshes=r.refreshes + due.astype(jnp.int32))
  return running, refresh, due


def _fresh_parts(config: KfacConfig, layout: layout_lib.Layout, running: jax.Array,
                 one: layout_lib.Batch) -> tuple[jax.Array, ...]:
  """New second-order parts of one factor: (vectors, values), (values,) or
  (F,) for a unit-wise block."""
  dtype = config.compute_dtype
  value = packing.unpack_batch(running, one, layout.packed)
  if one.form == statistics.UNIT:
    return (value.reshape(-1).astype(dtype),)
  vectors, values = linalg.eigh(value)
  lo, hi = one.columns or (0, one.dim)          # a split factor keeps its columns
  values = values[..., lo:hi].astype(dtype).reshape(-1)
  return (values,) if vectors is None else (
      vectors[..., lo:hi].astype(dtype).reshape(-1), values)


def _fresh_or_kept(config: KfacConfig, layout: layout_lib.Layout, running: jax.Array,
                   one: layout_lib.Batch, kept: tuple[jax.Array, ...]
                   ) -> tuple[jax.Array, ...]:
  """`_fresh_parts`, or the factor's previous parts `kept` where the new ones
  are not finite (a failed decomposition, or a non-finite running factor)."""
  fresh = _fresh_parts(config, layout, running, one)
  ok = faults.all_finite(fresh)
  return tuple(jnp.where(ok, new, old) for new, old in zip(fresh, kept))


def decompose_due_factors(config: KfacConfig, comm: collectives_lib.Collectives,
                          state: ScaleByKfacState, running: jax.Array, due: jax.Array
                          ) -> jax.Array:
  """Eigendecompositions of the due factors only; the others keep theirs."""
  layout, old, index = state.layout, state.second_order, _factor_index(state.layout)

  def owner_segment(device: int) -> jax.Array:
    group = device // layout.group_size
    by_offset = {place.offset: (place, index[(plan.layer.name, which)])
                 for place, plan, which in layout.owned(device)}
    pieces = []
    for batch in layout.batches[device]:
      size = layout_lib.storage_size(batch.dim, batch.form, layout.packed)
      mats, vecs = [], []
      for j in range(batch.count):
        place, f = by_offset[batch.offset + j * size]
        base = layout.second_base(place, group)
        kept = ((packing.read_matrix(old, base, place).reshape(-1),)
                if place.matrix_offset is not None else ()) + (
                    packing.read_vector(old, base, place).reshape(-1),)
        if comm.active:          # replicated (COMM-OPT) state vs local results
          kept = _compat.as_varying(kept, (layout.axis,))
        one = dataclasses.replace(batch, count=1, offset=place.offset)
        out = lax.cond(due[f], functools.partial(_fresh_or_kept, config, layout, running,
                                                 one, kept), lambda kept=kept: kept)
        mats += list(out[:-1])
        vecs.append(out[-1])
      pieces += mats + vecs
    return collectives_lib.pad_to(pieces, layout.second_segment, config.compute_dtype)

  local = comm.per_device(owner_segment, layout.device_branches)
  return lax.cond(jnp.any(due), lambda: distribute_second(comm, layout, local),
                  lambda: state.second_order)
