"""The two stages of a K-FAC step with stale statistics (SP-NGD §4.3).

`refresh_due_factors` (Algorithm 1): only the factors whose refresh step has
come (`next_step ≤ count`) are communicated (each in its own all-reduce: a
fused reduce-scatter cannot leave stale factors out) and averaged into their
running factors; their owners compare them with their last two refreshed
values and set the next interval (Algorithm 2, `stale.next_interval`).
`decompose_due_factors`: eigendecompositions (or π-damped inverses) of those
factors only. The schedule math is in `stale`.

The program holds code per run of a stacked layer's blocks and per batch of
equal factors, not per factor: a loop over a run's due blocks communicates
them, each owner updates its batches with the due flags read through
`Layout.factor_numbers`, and the decompositions loop over a batch's due
factors (`decompositions.DueFactors`). Code per factor (a conditional, an
all-reduce, an update and an eigh each) made GPT-2-XL's update 209,473
operations on 8 devices, and a 96-block scan 547,745 HLO instructions
(benchmarks/results/PERF_NOTES.md §22-23).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.kfac import decompositions
from kfac_jax_dist.kfac import factors
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import stale
from kfac_jax_dist.kfac.config import KfacConfig
from kfac_jax_dist.kfac.state import ScaleByKfacState


def _due_blocks_reduced(comm: collectives_lib.Collectives, packed: jax.Array,
                        due: jax.Array) -> jax.Array:
  """`packed` (`[k, size]`, a run's factor of k blocks) with each due block
  (`due`, `[k]`) averaged over the devices: one all-reduce per due block, in a
  loop over them (the same on every device, as `due` is); the others keep
  this device's statistics, which nothing reads. Each all-reduce sits in a
  conditional on its block's flag (always true in the loop): an all-reduce
  written straight into the loop's carry is moved out of the loop by XLA
  (`WhileLoopAllReduceCodeMotion`), which then all-reduces every block at
  every factor step."""
  order = jnp.argsort(~due, stable=True)

  def reduce_one(i: jax.Array, out: jax.Array) -> jax.Array:
    j = order[i]

    def reduced() -> jax.Array:
      row = comm.all_reduce_factors(lax.dynamic_slice_in_dim(packed, j, 1))
      return lax.dynamic_update_slice_in_dim(out, row.astype(out.dtype), j, 0)
    return lax.cond(due[j], reduced, lambda: out)
  return lax.fori_loop(0, jnp.sum(due.astype(jnp.int32)), reduce_one, packed)


def _due_statistics(config: KfacConfig, comm: collectives_lib.Collectives,
                    layout: layout_lib.Layout, stats: factors.Stats, due: jax.Array
                    ) -> jax.Array:
  """This device's `[L]` batch statistics, laid out as its running factors:
  averaged over the devices where due, or the owner's own with local factors
  (DP-KFAC)."""
  runs = factors.packed_runs(config, layout, stats)
  if comm.active and not config.local_factors:
    reduced, first = [], 0
    for run in runs:             # factor w of block j: number first + j·len(run) + w
      blocks = run[0].shape[0]
      reduced.append([_due_blocks_reduced(
          comm, x, due[np.arange(first + w, first + blocks * len(run), len(run))])
                      for w, x in enumerate(run)])
      first += blocks * len(run)
    runs = reduced
  return factors.owner_copies(config, comm, layout, factors.joined_runs(runs))


def _rows(x: jax.Array, batch: layout_lib.Batch, size: int) -> jax.Array:
  """The batch's factors in a `[L]` segment laid out as the running factors."""
  return x[batch.offset:batch.offset + batch.count * size].reshape(batch.count, size)


def _owner_update(config: KfacConfig, comm: collectives_lib.Collectives,
                  state: ScaleByKfacState, batch: jax.Array, due: jax.Array,
                  weight: jax.Array) -> tuple[jax.Array, ...]:
  """Each owner's new running factors, `X₋₂` and similarity bits `[F, 2]`
  (to `X₋₁`, to `X₋₂`; Algorithm 2), batch by batch: a due factor becomes
  `(decay·w·X + (1 − decay)·S) / w'`, the others are unchanged. `X₋₁` is the
  running factor before the refresh (it changes only at refreshes); a
  refresh makes it `X₋₂`."""
  layout, r, dtype = state.layout, state.refresh, config.compute_dtype
  decay = jnp.asarray(config.factor_decay, r.weight.dtype)   # an injected array may be wider

  def owner(device: int) -> tuple[jax.Array, ...]:
    pieces, befores = [], []
    bits = jnp.zeros([len(due), 2], jnp.int32)
    for b in layout.batches[device]:
      size = layout_lib.storage_size(b.dim, b.form, layout.packed)
      numbers = decompositions.batch_factor_numbers(comm, layout, device, b)
      now = due[numbers][:, None]
      last = _rows(state.factors, b, size)
      old = last.astype(dtype)
      mixed = (decay * r.weight[numbers][:, None] * old
               + (1.0 - decay) * _rows(batch, b, size)) / weight[numbers][:, None]
      new = jnp.where(now, mixed, old).astype(config.factor_dtype)
      before = _rows(r.before_last, b, size)
      similar = [(r.refreshes[numbers] >= k) & (stale.relative_changes(
          new.astype(dtype), y.astype(dtype), b.form, b.dim, layout.packed)
          < config.stale_threshold) for k, y in ((1, last), (2, before))]
      bits = bits.at[numbers].max(jnp.stack(similar, axis=1).astype(jnp.int32))
      pieces.append(new)
      befores.append(jnp.where(now, last, before))
    pad = functools.partial(collectives_lib.pad_to, length=layout.segment,
                            dtype=config.factor_dtype)
    return pad(pieces), pad(befores), bits
  return comm.per_device(owner, layout.decomposition_branches)


def refresh_due_factors(config: KfacConfig, comm: collectives_lib.Collectives,
                        state: ScaleByKfacState, stats: factors.Stats
                        ) -> tuple[jax.Array, stale.RefreshState, jax.Array]:
  """SP-NGD Algorithm 1: (running factors, refresh state, due flags)."""
  layout, r, count = state.layout, state.refresh, state.count
  decay = jnp.asarray(config.factor_decay, r.weight.dtype)
  due = r.next_step <= count                  # the same on every device
  due = due & factors.reached(layout, stats)[_layer_of(layout)]   # unreached stays due
  if layout_lib.sit_out_plans(layout):
    # a layer that did not run stays due; one that ran on some devices only
    # is averaged over every position it saw (`factors.weighted_by_positions`)
    counts = factors.positions(comm, layout, stats)
    due = due & counts.ran(layout)[_layer_of(layout)]
    stats = factors.weighted_by_positions(comm, counts, stats)
  weight = jnp.where(due, decay * r.weight + (1.0 - decay), r.weight)
  batch = _due_statistics(config, comm, layout, stats, due)
  running, before, bits = _owner_update(config, comm, state, batch, due, weight)
  if comm.active:                            # owners tell everyone
    bits = lax.psum(bits, layout.axis)
  if config.model_axes:     # one schedule on every model shard: similar where all are
    bits = lax.pmin(bits, config.model_axes)
  interval = stale.next_interval(bits[:, 0] > 0, bits[:, 1] > 0, r.interval,
                                 r.previous_interval)
  refreshed_any = jnp.any(due).astype(jnp.int32)
  if config.model_axes:     # the same on every model shard, so typed alike (a scalar)
    refreshed_any = lax.pmax(refreshed_any, config.model_axes)
  refresh = dataclasses.replace(
      r, weight=weight, before_last=before,
      next_step=jnp.where(due, count + interval, r.next_step),
      interval=jnp.where(due, interval, r.interval),
      previous_interval=jnp.where(due, r.interval, r.previous_interval),
      refreshes=r.refreshes + due.astype(jnp.int32),
      refresh_steps=r.refresh_steps + refreshed_any)
  return running, refresh, due


def _layer_of(layout: layout_lib.Layout) -> np.ndarray:
  """`[F]`: the index in `layout.plans` of each factor's layer."""
  return np.asarray([k for k, plan in enumerate(layout.plans) for _ in plan.places],
                    np.int32)


def layers_due(layout: layout_lib.Layout, due: jax.Array) -> jax.Array:
  """`[len(layout.plans)]`: whether a layer has a due factor (`due`, `[F]`):
  its second-order state changes this step."""
  return jax.ops.segment_max(due.astype(jnp.int32), _layer_of(layout),
                             num_segments=len(layout.plans)) > 0


def with_layer_partners(layout: layout_lib.Layout, due: jax.Array) -> jax.Array:
  """`due` (`[F]`) widened to every factor of a layer with a due factor.

  A π-damped inverse (`method="inverse"`) depends on both factors' traces
  (π² = (tr A/d_A)/(tr G/d_G), Martens & Grosse 2015 §6.3): when one factor
  of a layer refreshes, both are inverted again at the new π, so that the
  layer's two inverses always share one π, as a plain inverse step's do."""
  return layers_due(layout, due)[_layer_of(layout)]


def decompose_due_factors(config: KfacConfig, comm: collectives_lib.Collectives,
                          state: ScaleByKfacState, running: jax.Array, due: jax.Array,
                          gamma: jax.Array) -> jax.Array:
  """Decompositions of the due factors only (with `method="inverse"`, of
  every factor of a layer with a due one: `with_layer_partners`); the others
  keep theirs. An inverse keeps the damping `gamma` of the step that made it."""
  if config.method != "eigen":
    due = with_layer_partners(state.layout, due)
  return lax.cond(jnp.any(due), lambda: decompositions.decompose(
      config, comm, state.layout, running, gamma, state.second_order, due=due),
                  lambda: state.second_order)
