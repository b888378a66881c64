"""Running Kronecker factors: the statistics of a batch reach their owners and
join the running averages.

Running factors (KAISA Eq. 2.10, `factor_decay` = the weight of the *old*
value): with `w` the total weight so far,

    w' = decay·w + (1 − decay),   F' = (decay·w·F + (1 − decay)·F_batch) / w',

so the first update gives exactly the first batch's statistics. `F_batch` is
the average over the devices of their local statistics (a reduce-scatter into
tight chunks, or KAISA's all-reduce of every factor), or, for DP-KFAC, the
owner's own local statistics.

A layer that the loss's backward pass did not reach keeps its factors (`β =
0` below): its output unused by the loss (a multi-task model's other head,
trained by another loss that shares the state), JAX never ran its backward
pass, and the capture marks its statistics, all zero, `UNREACHED` (known when
tracing: no cost to the others). So does a DP-KFAC owner whose own batch had
no example of the loss (`G = 0` on its device: `_own_examples`). It shares
the running weight `w`: its next batch is mixed in with `β = (1 − decay) /
w'`, not with the larger one of its own average (the same after a few dozen
steps, as `w → 1`).

A layer that may sit out a pass (`TaggedLayer.may_sit_out`: run in a
`lax.cond` / `lax.switch` branch or a `lax.while_loop` body; `partly_sits_out`:
some of its applications), or whose rows a mask leaves out of `A`
(`row_masked`, `tags.row_mask`), has a running weight of its
own, `w_l` (`ScaleByKfacState.marked_weight`), and its statistics come with
this device's positions `N_d` (`statistics.POSITIONS`). With `N = Σ_d N_d`
(one psum of the counts), its `A_d` is weighted `N_d / mean_d N_d` before the
devices' mean, which is then `Σ_d N_d A_d / N`, the mean over every position
the layer saw (`G`, a sum over positions divided by the loss's examples, needs
no weight). A layer with `N > 0` ran: `w_l' = decay·w_l + (1 − decay)` and
`F' = (1 − β) F + β F_batch`, `β = (1 − decay) / w_l'` (the running average
above); one that did not keeps `F` and `w_l` (`β = 0`). DP-KFAC's owners
average their own batches: there each device keeps its own `w_l` and asks
whether the layer ran on its own batch (`N_d > 0`).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_dist.capture import statistics, triangles
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import offsets
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac.config import KfacConfig
from kfac_jax_dist.kfac.state import ScaleByKfacState

Stats = dict[str, dict[str, jax.Array]]


def _is_concrete_false(flag: Any) -> bool:
  """Whether `flag` is a known (not traced) False."""
  return not isinstance(flag, jax.core.Tracer) and not bool(flag)


def check_stats(layout: layout_lib.Layout, stats: Stats | None, update_flag: Any) -> bool:
  """Validates `kfac_stats` against the layout; returns whether they are used.

  Statistics may be omitted (None) only on a step known, outside `jit`, to
  update no factor; a traced step may be a factor step and needs them.
  """
  if stats is None:
    if _is_concrete_false(update_flag):
      return False
    raise ValueError(
        "scale_by_kfac.update needs the curvature statistics on a factor step (or "
        "under jit, where the step is not known): call tx.update(grads, opt_state, "
        "params, kfac_stats=stats) with the stats returned by kd.value_and_grad.")
  known = {plan.layer.stats_name for plan in layout.plans} | set(layout.skipped)
  unknown = sorted(set(stats) - known)
  if unknown:
    raise ValueError(
        f"kfac_stats has statistics of tagged layers the K-FAC state does not know: "
        f"{unknown} (it was laid out for {sorted(known)}). Build the transform with "
        "layers=grad_fn.discover(params, *batch) of this model, and exclude layers with "
        "skip= rather than leaving them out of `layers`.")
  for plan in layout.plans:
    name = plan.layer.stats_name
    if name not in stats:
      raise ValueError(f"kfac_stats has no statistics for tagged layer '{name}' "
                       f"(it has {sorted(stats)}).")
    keys = [which.upper() for which, _ in plan.places]
    for key in keys:
      if key not in stats[name]:
        raise ValueError(f"kfac_stats['{name}'] has no statistic {key!r} "
                         f"(it has {sorted(stats[name])}).")
    if (statistics.POSITIONS in stats[name]) != plan.layer.counted:
      _refuse_other_counting(name, plan.layer.counted)
  _warn_full_of_diagonal(layout, stats)
  return True


def _refuse_other_counting(name: str, counted: bool) -> None:
  """Statistics that count a layer's positions where the state's layer does
  not (or the reverse): the capture saw it under a row mask or in a branch
  the discovery did not, and its `A` would be averaged the other way."""
  seen, state = ("does not count", "counts") if counted else ("counts", "does not count")
  raise ValueError(
      f"kfac_stats['{name}'] {seen} the layer's positions, but the K-FAC state's layer "
      f"{state} them: the capture saw it run under kd.tags.row_mask (or inside a "
      "lax.cond / lax.switch branch) where the discovery the state was built from did "
      "not, or the reverse (a mask passed on some calls only). Build the transform with "
      "layers=grad_fn.discover(params, *batch) of the batch the steps receive, mask "
      "included.")


def _warn_full_of_diagonal(layout: layout_lib.Layout, stats: Stats) -> None:
  """One warning naming the factors kept diagonal whose statistics came as
  full `d × d` matrices: the capture, not given `opt_state=`, formed `d²`
  numbers (a vocabulary-sized output's: gigabytes) of which the update
  reads the `d` on the diagonal."""
  full = sorted({f"'{plan.layer.stats_name}' {which.upper()} ({place.dim}×{place.dim})"
                 for plan in layout.plans for which, place in plan.places
                 if place.form == statistics.DIAG
                 and jnp.ndim(stats[plan.layer.stats_name][which.upper()])
                 == len(plan.layer.stack) + 2})
  if full:
    warnings.warn(
        f"kfac_jax_dist: kfac_stats has full statistics of factors the K-FAC state keeps "
        f"diagonal: {', '.join(full)}. Pass opt_state= to grad_fn so that the capture "
        "forms only their diagonals.", stacklevel=4)


def _checked_shape(stat: jax.Array, place: layout_lib.FactorPlace, name: str,
                   key: str, packed: bool) -> jax.Array:
  """`stat` (`[k, ...]`: `k` blocks' statistics) in the form of `place` (a
  full statistic of a diagonal factor gives its diagonal; a full factor of a
  `packed` layout may come packed, as the capture delivers it), or an error
  naming the layer."""
  expected = {statistics.FULL: (place.dim, place.dim), statistics.DIAG: (place.dim,),
              statistics.UNIT: (place.dim, 3)}[place.form]
  shape = stat.shape[1:]
  if place.form == statistics.DIAG and shape == (place.dim, place.dim):
    return jnp.diagonal(stat, axis1=-2, axis2=-1)
  if (packed and place.form == statistics.FULL
      and shape == statistics.statistic_shape(place.dim, statistics.PACKED)):
    return stat
  if shape != expected:
    raise ValueError(f"Statistic {key} of layer '{name}' has shape {shape}; "
                     f"the optimizer state expects {place.form} factors of dimension "
                     f"{place.dim}.")
  return stat


def layer_statistics(stats: Stats, plans: Sequence[layout_lib.LayerPlan], which: str,
                     packed: bool) -> jax.Array:
  """The batch statistic `which` ("a", "g", "f") of one layer, or of
  consecutive blocks of a stacked one (`layout.block_runs`: one slice of the
  stacked statistic), `[k, ...]`; a full one may come packed when the layout
  is `packed`."""
  key, layer = which.upper(), plans[0].layer
  stat = stats[layer.stats_name][key]
  if layer.stack_index is not None:
    if tuple(stat.shape[:len(layer.stack)]) != layer.stack:
      raise ValueError(f"Statistic {key} of stacked layer '{layer.stats_name}' has "
                       f"shape {stat.shape}; expected leading stack axes {layer.stack}.")
  stat = stat.reshape((-1,) + stat.shape[len(layer.stack):])
  start = layer.block_number or 0
  return _checked_shape(stat[start:start + len(plans)], getattr(plans[0], which),
                        layer.name, key, packed)


def layer_statistic(stats: Stats, plan: layout_lib.LayerPlan, which: str, packed: bool
                    ) -> jax.Array:
  """`layer_statistics` of one plan (its block's, for a block of a stacked layer)."""
  return layer_statistics(stats, (plan,), which, packed)[0]


def all_statistics(layout: layout_lib.Layout, stats: Stats) -> list[jax.Array]:
  """Every statistic the layout consumes, a stacked layer's blocks together
  (for the fault check)."""
  return [layer_statistics(stats, run, w, layout.packed)
          for run in layout_lib.block_runs(layout.plans) for w, _ in run[0].places]


def stats_segments(layout: layout_lib.Layout, stats: Stats, dtype: Any) -> jax.Array:
  """The batch statistics laid out as the running factors, `[P·length]`,
  consecutive blocks of a stacked layer read and packed together."""
  return packing.all_segments(
      layout, lambda plans, w: layer_statistics(stats, plans, w, layout.packed), dtype,
      batched=True)


def _copied(summed: jax.Array, owned: list[tuple[tuple, int]]) -> list[jax.Array]:
  """A device's factors `(place, plan, which)` copied out of the all-reduced
  buffer from their starts in it: the same factor of consecutive blocks of a
  stack (`packing.stored_together`), whose starts advance by one stride (each
  block's factors, plan order), as one slice `[k, stride]` whose rows'
  first `size` numbers are the factors; any other factor, one slice."""
  runs = layout_lib.block_runs(owned, lambda t: t[0][1],
                               lambda now, before: packing.stored_together(now[0], before[0]))
  pieces = []
  for run in runs:
    size, first, k = run[0][0][0].size, run[0][1], len(run)
    stride = run[1][1] - first if k > 1 else size
    if k == 1 or stride < size or any(b[1] - a[1] != stride for a, b in zip(run, run[1:])):
      pieces += [summed[s:s + q.size] for (q, _, _), s in run]
      continue
    rows = k if first + k * stride <= summed.shape[0] else k - 1   # the buffer's end
    pieces.append(summed[first:first + rows * stride].reshape(rows, stride)[:, :size]
                  .reshape(-1))
    pieces += [summed[s:s + size] for _, s in run[rows:]]
  return pieces


def packed_runs(config: KfacConfig, layout: layout_lib.Layout, stats: Stats
                ) -> list[list[jax.Array]]:
  """Each run of blocks of a stacked layer (`block_runs`, a layer split over
  groups too: its factors are whole; any other layer a run of its own), its
  factors packed, `[k, size]` each, in plan order (`tight_offsets`)."""
  return [[packing.pack_factors(
      layer_statistics(stats, run, w, layout.packed).astype(config.compute_dtype), place,
      layout.packed).reshape(len(run), -1) for w, place in run[0].places]
          for run in layout_lib.block_runs(layout.plans, pieces=True)]


def joined_runs(runs: list[list[jax.Array]]) -> jax.Array:
  """`packed_runs` as one unpadded buffer of every factor (`tight_offsets`):
  a stack's blocks `[k, size_A + size_G]`."""
  return jnp.concatenate([packing.joined(run, axis=1).reshape(-1) for run in runs])


def owner_copies(config: KfacConfig, comm: collectives_lib.Collectives,
                 layout: layout_lib.Layout, summed: jax.Array) -> jax.Array:
  """Each owner's factors copied out of a buffer of every factor
  (`joined_runs`) into its `[L]` segment (devices owning factors of the same
  sizes share one branch of that copy: `Layout.copy_branches`)."""
  dtype = config.compute_dtype
  offsets = layout_lib.tight_offsets(layout)
  starts = [[offsets[(p.layer.name, w)] for _, p, w in layout.owned(d)]
            for d in range(layout.num_devices)]
  reps = layout.copy_branches
  if len(set(reps)) < len(reps):     # a branch shared: read at offsets of `[P, C]` rows
    shared = jnp.pad(summed, (0, -summed.shape[0] % comm.num_devices))

  def own(device: int) -> jax.Array:
    owned = layout.owned(device)
    if comm.num_devices == 1 or reps.count(device) == 1:
      pieces = _copied(summed, list(zip(owned, starts[device])))
    else:     # devices of the same sizes share this branch, each at its offsets
      pieces = [comm.range_at(shared, [s[k] if k < len(s) else 0 for s in starts], q.size)
                for k, (q, _, _) in enumerate(owned)]
    return collectives_lib.pad_to(pieces, layout.segment, dtype)
  return comm.per_device(own, reps)


def _all_reduced(config: KfacConfig, comm: collectives_lib.Collectives,
                 layout: layout_lib.Layout, stats: Stats) -> jax.Array:
  """KAISA: all-reduce the unpadded buffer of every factor, then each owner
  copies its own factors into its segment."""
  flat = joined_runs(packed_runs(config, layout, stats))
  return owner_copies(config, comm, layout, comm.all_reduce_factors(flat))


def batch_factors(config: KfacConfig, comm: collectives_lib.Collectives,
                  layout: layout_lib.Layout, stats: Stats) -> jax.Array:
  """This device's part of `F_batch`, in the running factors' storage."""
  if config.factor_reduction == "all_reduce":
    return _all_reduced(config, comm, layout, stats)
  return comm.reduce_factors(stats_segments(layout, stats, config.compute_dtype),
                             layout.factor_shard)


def marked_plans(layout: layout_lib.Layout) -> np.ndarray:
  """Indices in `layout.plans` of the layers that count their positions
  (`TaggedLayer.counted`; the order of `ScaleByKfacState.marked_weight`)."""
  return np.asarray([k for k, plan in enumerate(layout.plans) if plan.layer.counted],
                    np.int32)


class Positions(NamedTuple):
  """The positions of the layers that may sit out a pass, in one step."""

  local: dict[str, jax.Array]    # stats name -> this device's `N_d`, `[*stack]`
  total: dict[str, jax.Array]    # stats name -> `N = Σ_d N_d` (one psum), or `N_d`
  pooled: bool                   # `total` sums several devices' counts

  def ran(self, layout: layout_lib.Layout) -> jax.Array:
    """`[len(layout.plans)]`: whether each layer (block) had a position on
    any device (True for the layers that cannot sit out)."""
    flags = jnp.ones([len(layout.plans)], bool)
    for name, (plans, blocks) in _blocks_of(layout).items():
      if name in self.total:
        flags = flags.at[plans].set(self.total[name].reshape(-1)[blocks] > 0)
    return flags


def _blocks_of(layout: layout_lib.Layout) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Stats name -> (indices in `layout.plans`, their blocks' numbers in the
  stacked statistic) of each layer's plans."""
  found: dict[str, list[tuple[int, int]]] = {}
  for k, plan in enumerate(layout.plans):
    found.setdefault(plan.layer.stats_name, []).append((k, plan.layer.block_number or 0))
  return {name: tuple(np.asarray(v, np.int32) for v in zip(*pairs))
          for name, pairs in found.items()}


def positions(comm: collectives_lib.Collectives, layout: layout_lib.Layout, stats: Stats,
              pooled: bool | None = None) -> Positions:
  """`Positions` of the statistics: summed over the devices (one psum over
  the factors' axis) where `pooled` (default: unless DP-KFAC's owners keep
  their own batches' factors)."""
  names = sorted({p.layer.stats_name for p in layout_lib.sit_out_plans(layout)})
  local = {name: stats[name][statistics.POSITIONS] for name in names}
  pooled = not layout.local_factors if pooled is None else pooled
  if comm.active and pooled:
    return Positions(local, jax.lax.psum(local, layout.axis), True)
  return Positions(local, local, False)


def weighted_by_positions(comm: collectives_lib.Collectives, counts: Positions,
                          stats: Stats) -> Stats:
  """`stats` with the `A` of each layer that may sit out weighted by `N_d /
  mean_d N_d` (0 where `N = 0`), so that the devices' mean of it is `Σ_d N_d
  A_d / N`; unpooled counts (one device, DP-KFAC) leave them as given."""
  if not counts.pooled or not counts.local:
    return stats
  out = dict(stats)
  for name, local in counts.local.items():
    if "A" not in stats[name]:          # a unit-wise layer: F needs no weight
      continue
    total, a = counts.total[name], stats[name]["A"]
    weight = jnp.where(total > 0, comm.num_devices * local / jnp.where(total > 0, total, 1),
                       0)
    weight = statistics.per_block(weight.astype(a.dtype), a)
    out[name] = {**stats[name], "A": (a * weight).astype(a.dtype)}
  return out


def _own_part(config: KfacConfig, comm: collectives_lib.Collectives,
              layout: layout_lib.Layout, values: Stats) -> jax.Array:
  """This device's part of `values` laid out as the running factors, where
  `batch_factors` places the batch's, with no communication: `values` the
  same on every device, or (DP-KFAC, each owner's part its own) each
  device's own."""
  if config.factor_reduction == "all_reduce":
    return owner_copies(config, comm, layout, joined_runs(packed_runs(config, layout,
                                                                      values)))
  segments = stats_segments(layout, values, config.compute_dtype)
  if not comm.active:
    return segments
  return offsets.segment_at(segments, layout.factor_shard, comm.device_index())


def _per_number(config: KfacConfig, comm: collectives_lib.Collectives,
                layout: layout_lib.Layout, stats: Stats, per_plan: jax.Array
                ) -> jax.Array:
  """`per_plan` (`[len(layout.plans)]`) repeated over each layer's stored
  factor numbers, this device's part (`_own_part` of statistics filled with
  it)."""
  filled = {}
  for name, (plans, blocks) in _blocks_of(layout).items():
    first = layout.plans[plans[0]]
    values = jnp.zeros([int(np.prod(first.layer.stack, dtype=np.int64))], per_plan.dtype)
    values = values.at[blocks].set(per_plan[plans]).reshape(tuple(first.layer.stack))
    filled[name] = {key: jnp.broadcast_to(statistics.per_block(values, stats[name][key]),
                                          stats[name][key].shape)
                    for key in (w.upper() for w, _ in first.places)}
  return _own_part(config, comm, layout, filled)


def reached(layout: layout_lib.Layout, stats: Stats) -> np.ndarray:
  """`[len(layout.plans)]`, known when tracing: False for the layers whose
  statistics say that the loss's backward pass did not reach them
  (`statistics.UNREACHED`: the loss does not use their outputs)."""
  return np.asarray([statistics.UNREACHED not in stats[plan.layer.stats_name]
                     for plan in layout.plans])


def _own_examples(layout: layout_lib.Layout, stats: Stats) -> jax.Array:
  """DP-KFAC: `[len(layout.plans)]`, whether this device's statistic of
  output cotangents, `G` (a unit-wise layer's `F`), has a nonzero entry on
  its diagonal: where no example of the loss was on the device it is 0 and
  the owner keeps its factors. (Not read elsewhere: one more read of every
  statistic cost the CNN step's program 80 instructions.)"""
  flags = []
  for plan in layout.plans:
    which, place = ("g", plan.g) if plan.g is not None else ("f", plan.f)
    stat = layer_statistic(stats, plan, which, layout.packed)
    if place.form == statistics.FULL:        # the diagonal: sums of squares
      stat = (jnp.diagonal(stat) if stat.ndim == 2 else
              stat[triangles.row_starts(np.arange(place.dim), place.dim)])
    flags.append(jnp.any(stat != 0))
  return jnp.stack(flags)


def update_running_factors(config: KfacConfig, comm: collectives_lib.Collectives,
                           state: ScaleByKfacState, stats: Stats
                           ) -> tuple[jax.Array, tuple, jax.Array]:
  """The new running factors (this device's part), total weights `(w',
  w_l')` (`w_l'`: of the layers that may sit out a pass, None without), and
  the batch's factors that were mixed in (this device's part: what the step
  consumes of the statistics, reduced over the data axis)."""
  layout = state.layout
  if (state.marked_weight is not None or layout.local_factors
      or not reached(layout, stats).all()):
    return _update_per_layer(config, comm, state, stats)
  batch = batch_factors(config, comm, layout, stats)
  w = state.factor_weight
  decay = jnp.asarray(config.factor_decay, w.dtype)   # an injected array may be wider
  new_w = decay * w + (1.0 - decay)
  mixed = (decay * w * state.factors.astype(config.compute_dtype)
           + (1.0 - decay) * batch.astype(config.compute_dtype)) / new_w
  return mixed.astype(config.factor_dtype), (new_w, None), batch


def _update_per_layer(config: KfacConfig, comm: collectives_lib.Collectives,
                      state: ScaleByKfacState, stats: Stats
                      ) -> tuple[jax.Array, tuple, jax.Array]:
  """`update_running_factors` of a layout with layers that may not run or
  not reach the loss in a pass (see the module docstring): `F' = (1 − β) F +
  β F_batch`, `β` per layer, 0 for one that did not."""
  layout, w, marked = state.layout, state.factor_weight, marked_plans(state.layout)
  ran = jnp.asarray(reached(layout, stats))
  if layout.local_factors:
    ran = ran & _own_examples(layout, stats)
  counts = positions(comm, layout, stats)
  if counts.local:
    ran = ran & counts.ran(layout)
  batch = batch_factors(config, comm, layout, weighted_by_positions(comm, counts, stats))
  decay = jnp.asarray(config.factor_decay, w.dtype)   # an injected array may be wider
  new_w = decay * w + (1.0 - decay)
  beta = jnp.where(ran, (1.0 - decay) / new_w, 0.0).astype(w.dtype)
  mine = state.marked_weight
  if mine is not None:
    mine = jnp.where(ran[marked], decay * mine + (1.0 - decay), mine)
    beta = beta.at[marked].set(jnp.where(ran[marked], (1.0 - decay) / mine, 0.0))
  old = state.factors.astype(config.compute_dtype)
  coefficient = _per_number(config, comm, layout, stats, beta.astype(old.dtype))
  mixed = (1.0 - coefficient) * old + coefficient * batch.astype(old.dtype)
  return mixed.astype(config.factor_dtype), (new_w, mine), batch
