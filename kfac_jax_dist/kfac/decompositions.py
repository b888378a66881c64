"""Decompositions: each owner turns its running factors into second-order state.

Method "eigen" keeps each factor's eigenbasis and eigenvalues (KAISA §4.1:
`(A ⊗ G + γI)⁻¹` is then exact); method "inverse" keeps the damped inverses
`(A + π√γ I)⁻¹`, `(G + √γ/π I)⁻¹` (Martens & Grosse 2015, §6.3), whose π
couples a layer's two factors. Each device decomposes the factors it owns
(`layout.batches`: one batched call per run of equal form and dimension),
then the owner group gathers its members' segments (`distribute_second`).

A factor whose running value or decomposition is not finite keeps its
previous second-order state, slot by slot (`keep_failed`; with method
"inverse" its layer's other factor too: `paired_failures`; a decomposition
failure is not a step fault: see `core.faults`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import statistics
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import faults
from kfac_jax_dist.core import offsets
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import linalg
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac.config import KfacConfig


Runs = tuple[tuple[int, int, int, int], ...]   # (start, count, size, first slot)


_CHUNK = 1 << 16     # numbers per iteration of `keep_failed`'s selection loops


class SlotRuns(NamedTuple):
  """Where a device's factors lie: `new` in its new `[L₂]` segment, `running`
  in its owned running factors (`Runs` each), `slots` factors in all."""
  new: Runs
  running: Runs
  slots: int


def run_table(runs: Runs, rows: int = 0) -> np.ndarray:
  """`[max(R, rows), 4]` int32 rows `(start, end, size, first slot)` of
  `runs`, sorted by start; padded with runs that no position falls in."""
  table = [(start, start + count * size, max(size, 1), first)
           for start, count, size, first in sorted(runs)]
  table += [(offsets.INT32_MAX, offsets.INT32_MAX, 1, 0)] * (rows - len(table))
  return offsets.int32_table(np.asarray(table, np.int64).reshape(-1, 4))


def _slot_ids(at: jax.Array, table: jax.Array, slots: int) -> jax.Array:
  """The slot of each position `at` of an array laid out in runs (`table`,
  `run_table`'s rows: run r covers `[start, end)` in slots of `size`
  numbers, numbered from `first slot`); positions outside every run get the
  extra slot `slots`. The run of `at` is the last one starting at or before
  it (a count of `[len(at), runs]` comparisons, never materialised); then one
  truncating `lax.div` by its size (a `//` by every run's size, with its
  remainder and sign fix-ups, were vector integer divisions that LLVM
  expands: PERF_NOTES §10)."""
  if not table.shape[0]:
    return jnp.full(at.shape, slots, jnp.int32)
  r = jnp.sum((at[:, None] >= table[None, :, 0]).astype(jnp.int32), axis=1) - 1
  run = table[jnp.maximum(r, 0)]      # its row, by one gather (not one per column)
  inside = (r >= 0) & (at < run[:, 1])
  return jnp.where(inside, run[:, 3] + lax.div(at - run[:, 0], run[:, 2]), slots)


def _chunked(length: int, body: Callable[[jax.Array, jax.Array, Any], Any], init: Any,
             run: jax.Array | bool = True) -> Any:
  """`body(start, positions, carry)` over the array in chunks of at most
  `_CHUNK` numbers (the last one shifted back to end at `length`: its first
  numbers are visited twice), so that no temporary is array-sized; no chunk
  where `run` is False."""
  size = min(length, _CHUNK)
  if size == 0:
    return init

  def step(c: jax.Array, carry: Any) -> Any:
    start = jnp.minimum(c * size, length - size)
    return body(start, start + lax.iota(jnp.int32, size), carry)
  chunks = -(-length // size)
  return lax.fori_loop(0, chunks if run is True else jnp.where(run, chunks, 0), step, init)


def _failed_slots(x: jax.Array, table: jax.Array, slots: int, failed: jax.Array,
                  run: jax.Array | bool = True) -> jax.Array:
  """`failed` (`[slots + 1]` int32) with every slot of the runs `table`
  holding a non-finite number of `x` set to 1."""
  def body(start: jax.Array, at: jax.Array, failed: jax.Array) -> jax.Array:
    bad = ~jnp.isfinite(lax.dynamic_slice_in_dim(x, start, at.shape[0]))
    return failed.at[_slot_ids(at, table, slots)].max(bad.astype(jnp.int32))
  return _chunked(x.shape[0], body, failed, run)


def keep_failed(new: jax.Array, previous: jax.Array, new_runs: Runs | jax.Array,
                running: jax.Array, running_runs: Runs | jax.Array, slots: int,
                couple: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
  """`new`, except that each of the `slots` factors whose running value (in
  `running`) or new second-order numbers are not finite keeps its `previous`
  numbers (the runs, or their `run_table`s, say where each factor's numbers
  lie in each array). `couple` (`[slots + 1]` failure flags → those to keep)
  adds the factors that must be kept with a failed one (`paired_failures`).

  One finiteness check of the two whole arrays (`faults.all_finite`: a sum
  each, where `all(isfinite(·))`'s boolean reductions were 9 kernels of the
  CNN step's compile); only when it fails, the factor-by-factor selection:
  loops over chunks of slot ids, so that neither its program nor its memory
  grows with the number of batches or the segment's size (per-batch checks
  and selects were a quarter of the autoencoder's step compile), run zero
  times when nothing failed. Loops, not a `lax.cond`: a conditional's output
  is one more segment-sized buffer at a decomposition step's peak, where the
  loops write into `new` (benchmarks/results/PERF_NOTES.md §46)."""
  axes = _compat.varying_axes(new, previous, running)
  new_table, running_table = (runs if isinstance(runs, jax.Array)
                              else jnp.asarray(run_table(runs))
                              for runs in (new_runs, running_runs))

  ok = faults.all_finite((new, running))
  failed = _compat.as_varying(jnp.zeros(slots + 1, jnp.int32), axes)
  failed = _failed_slots(running, running_table, slots,
                         _failed_slots(new, new_table, slots, failed, ~ok), ~ok)
  if couple is not None:
    failed = couple(failed)
    ok = ~jnp.any(failed > 0)

  def select(start: jax.Array, at: jax.Array, out: jax.Array) -> jax.Array:
    kept = failed[_slot_ids(at, new_table, slots)] > 0
    chunk = jnp.where(kept, lax.dynamic_slice_in_dim(previous, start, at.shape[0]),
                      lax.dynamic_slice_in_dim(out, start, at.shape[0]))
    return lax.dynamic_update_slice_in_dim(out, chunk, start, 0)
  return _chunked(new.shape[0], select, _compat.as_varying(new, axes), ~ok)


BatchDecomposer = Callable[[layout_lib.Batch, jax.Array, int], list[jax.Array]]


def _new_segment(config: KfacConfig, layout: layout_lib.Layout, device: int,
                 owned: jax.Array, decompose_batch: BatchDecomposer
                 ) -> tuple[jax.Array, SlotRuns]:
  """The device's new `[L₂]` segment, `decompose_batch(batch, running, at)`
  of each of its batches (`at`: where its parts start in the segment), each
  part `[count, ...]` (a unit-wise batch keeps its `F`, solved in closed form
  when applied), and where its factors lie (for `keep_failed`, which
  `decompose` runs on it)."""
  pieces, new_runs, running_runs, slots, at = [], [], [], 0, 0
  for batch in layout.batches[device]:
    running = packing.unpack_batch(owned, batch, layout.packed)
    parts = ([running.astype(config.second_dtype)] if batch.form == statistics.UNIT
             else decompose_batch(batch, running, at))
    size = layout_lib.storage_size(batch.dim, batch.form, layout.packed)
    running_runs.append((batch.offset, batch.count, size, slots))
    for part in parts:
      new_runs.append((at, batch.count, part[0].size, slots))
      at += part.size
    # A batch's parts, contiguous, in one write (one kernel).
    pieces.append(jnp.concatenate([part.reshape(-1) for part in parts]))
    slots += batch.count
  new = collectives_lib.pad_to(pieces, layout.second_segment, config.second_dtype)
  return new, SlotRuns(tuple(new_runs), tuple(running_runs), slots)


def eigen_segment(config: KfacConfig, layout: layout_lib.Layout, device: int,
                  owned: jax.Array, comm: collectives_lib.Collectives,
                  due: DueFactors | None = None) -> tuple[jax.Array, SlotRuns]:
  """The device's new `[L₂]` segment: eigenbases and eigenvalues of its
  factors (a split factor keeps its columns); as `_new_segment`. With `due`
  (stale statistics), only the due factors' (`DueFactors.parts`)."""
  dtype = config.second_dtype

  def parts(batch: layout_lib.Batch, running: jax.Array, at: int) -> list[jax.Array]:
    kept = lambda x: kept_columns(comm, layout, device, batch, x).astype(dtype)

    def decomposed(x: jax.Array, _: jax.Array | None) -> list[jax.Array]:
      vectors, values = linalg.eigh(x, symmetric=layout.packed)
      return ([] if vectors is None else [kept(vectors)]) + [kept(values)]
    if due is None:
      return decomposed(running, None)
    return due.parts(comm, layout, device, batch, at, "eigen", running, None, decomposed)
  return _new_segment(config, layout, device, owned, parts)


def part_shapes(batch: layout_lib.Batch, method: str) -> list[tuple[int, ...]]:
  """A batch's second-order parts: with `method` "eigen" eigenbases `[count,
  d, w]` (full factors) then eigenvalues `[count, w]`, else damped inverses
  `[count, d, w]` (diagonal: `[count, w]`); `w` the columns kept."""
  count, dim = batch.count, batch.dim
  width = (batch.columns[1] - batch.columns[0]) if batch.columns else dim
  full = batch.form == statistics.FULL
  if method == "eigen":
    return ([(count, dim, width)] if full else []) + [(count, width)]
  return [(count, dim, width) if full else (count, width)]


# A batch's parts from its running factors `[count, ...]` and their per-slot
# input (`[count]`: an inverse's damping; None for eigendecompositions).
PartsOf = Callable[[jax.Array, "jax.Array | None"], list[jax.Array]]


class DueFactors(NamedTuple):
  """Stale statistics (SP-NGD §4.3): which factors are due (`flags`, `[F]`
  in plan order) and the device's current `[L₂]` segment (`previous`),
  whose parts the factors that are not due keep."""
  flags: jax.Array
  previous: jax.Array

  def members(self, comm: collectives_lib.Collectives, layout: layout_lib.Layout,
              device: int, batch: layout_lib.Batch) -> jax.Array:
    """`[count]`: whether each factor of `batch` on the running device is due."""
    return self.flags[batch_factor_numbers(comm, layout, device, batch)]

  def parts(self, comm: collectives_lib.Collectives, layout: layout_lib.Layout,
            device: int, batch: layout_lib.Batch, at: int, method: str,
            running: jax.Array, inputs: jax.Array | None, parts_of: PartsOf
            ) -> list[jax.Array]:
    """`parts_of` the batch's due factors, the others' current parts (those
    from `at` in `previous`) kept: full factors one at a time in a loop over
    the due ones (`_due_parts`), diagonal ones all computed and selected
    (cheap)."""
    previous = []
    for shape in part_shapes(batch, method):
      size = int(np.prod(shape))
      previous.append(self.previous[at:at + size].reshape(shape))
      at += size
    flags = self.members(comm, layout, device, batch)
    if batch.form == statistics.FULL:
      return _due_parts(running, inputs, previous, flags, parts_of)
    return [jnp.where(flags.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(old.dtype), old)
            for x, old in zip(parts_of(running, inputs), previous)]


def batch_factor_numbers(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                         device: int, batch: layout_lib.Batch) -> jax.Array:
  """`[count]`: the numbers (plan order) of `batch`'s factors on the running
  device (`Layout.factor_numbers`; read at its row where devices share the
  branch)."""
  span = slice(batch.first_index, batch.first_index + batch.count)
  if not shares_branch(comm, layout, device):
    return jnp.asarray(np.asarray(layout.factor_numbers[device][span], np.int32))
  rows = jnp.asarray(offsets.int32_table(layout.factor_numbers))
  return rows[comm.device_index()][span]


def _due_parts(running: jax.Array, inputs: jax.Array | None, previous: list[jax.Array],
               flags: jax.Array, parts_of: PartsOf) -> list[jax.Array]:
  """`parts_of` a batch of full factors `[count, d, d]` (eigenbases and
  eigenvalues, or damped inverses of the per-slot `inputs`): the due ones
  (`flags`) one at a time in a loop over them (due first, a stable order),
  the others' `previous` parts kept; all of them in one batched call when
  all are due, as a plain decomposition step (a GPU then runs one batched
  eigh instead of a loop of single ones). The loop's body is one
  decomposition, whatever the batch's size or which factors are due."""
  order = jnp.argsort(~flags, stable=True)
  axes = _compat.varying_axes(running, *previous, flags)
  start = tuple(_compat.as_varying(p, axes) for p in previous)

  def decomposed(x: jax.Array, extra: jax.Array | None) -> tuple[jax.Array, ...]:
    return tuple(v.astype(p.dtype) for v, p in zip(parts_of(x, extra), previous))

  def one(i: jax.Array, parts: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    j = order[i]
    row = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, j, 1)
    return tuple(lax.dynamic_update_slice_in_dim(p, x, j, 0) for p, x in zip(
        parts, decomposed(row(running), row(inputs))))
  return list(lax.cond(
      jnp.all(flags), lambda: _compat.as_varying(decomposed(running, inputs), axes),
      lambda: lax.fori_loop(0, jnp.sum(flags.astype(jnp.int32)), one, start)))


def kept_columns(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                 device: int, batch: layout_lib.Batch, x: jax.Array) -> jax.Array:
  """`x[..., lo:hi]`, the columns of a split factor that `batch` keeps (all
  of them if it is whole). In a branch that devices keeping other columns of
  the same width share (`Layout.decomposition_branches`), `lo` is the
  running device's, from a table."""
  if batch.columns is None:
    return x
  lo, hi = batch.columns
  if not shares_branch(comm, layout, device):
    return x[..., lo:hi]
  j = layout.batches[device].index(batch)
  starts = tuple(layout.batches[d][j].columns[0] if rep == device else 0
                 for d, rep in enumerate(layout.decomposition_branches))
  return lax.dynamic_slice_in_dim(x, comm.device_table(starts), hi - lo, axis=x.ndim - 1)


def inverse_segment(config: KfacConfig, layout: layout_lib.Layout, device: int,
                    owned: jax.Array, damping: jax.Array, comm: collectives_lib.Collectives,
                    due: DueFactors | None = None) -> tuple[jax.Array, SlotRuns]:
  """As `eigen_segment`, with damped inverses; `damping` holds every factor's
  (a non-finite one, from a non-finite trace of either factor of the layer,
  keeps both inverses)."""
  dtype = config.second_dtype

  def parts(batch: layout_lib.Batch, running: jax.Array, at: int) -> list[jax.Array]:
    if shares_branch(comm, layout, device):
      base = comm.device_index() * layout.max_factors + batch.first_index
      damp = lax.dynamic_slice_in_dim(damping, base, batch.count)
    else:
      start = device * layout.max_factors + batch.first_index
      damp = damping[start:start + batch.count]

    def inverted(x: jax.Array, d: jax.Array) -> list[jax.Array]:
      inv = linalg.damped_inverse(x, d)          # not finite where `d` is not
      if batch.matrix_offset is not None:
        inv = kept_columns(comm, layout, device, batch, inv)
      return [inv.astype(dtype)]
    if due is None:
      return inverted(running, damp)
    return due.parts(comm, layout, device, batch, at, "inverse", running, damp, inverted)
  return _new_segment(config, layout, device, owned, parts)


def _traces_segment(config: KfacConfig, layout: layout_lib.Layout, device: int,
                    owned: jax.Array) -> jax.Array:
  pieces = [linalg.mean_traces(packing.unpack_batch(owned, batch, layout.packed))
            for batch in layout.batches[device]]
  return collectives_lib.pad_to([p.astype(config.compute_dtype) for p in pieces],
                                layout.max_factors, config.compute_dtype)


def pi_damping(config: KfacConfig, comm: collectives_lib.Collectives,
               layout: layout_lib.Layout, owned_of: Callable[[int], jax.Array],
               gamma: jax.Array) -> jax.Array:
  """Every factor's π-adjusted damping, `[P·max_factors]` by (owner, index).

  π couples a layer's A and G, which may sit on different devices: the
  (scalar) traces of all factors are shared, then each copy of a factor gets
  its layer's damping (NaN where either trace is not finite): one gather of
  the traces and one scatter of the values for all layers, not ops per layer.
  """
  dtype = config.compute_dtype
  traces = comm.all_gather_owned(
      comm.per_device(lambda d: _traces_segment(config, layout, d, owned_of(d)),
                      layout.decomposition_branches))
  damping = jnp.ones(layout.num_devices * layout.max_factors, dtype)
  plans = _paired_plans(layout)
  if not plans:
    return damping
  trace_a, trace_g = (traces[np.asarray([_slot(layout, getattr(p, w)) for p in plans])]
                      for w in ("a", "g"))
  d_a, d_g = linalg.pi_adjusted_damping(trace_a, trace_g, gamma)
  finite = jnp.isfinite(trace_a) & jnp.isfinite(trace_g)
  values = jnp.where(finite, jnp.concatenate([d_a, d_g]).reshape(2, -1), jnp.nan)
  layers, rows, targets = _factor_copies(layout)   # every copy gets its factor's value
  return damping.at[targets].set(values.reshape(-1)[rows * len(plans) + layers])


def _paired_plans(layout: layout_lib.Layout) -> list[layout_lib.LayerPlan]:
  """The layers with an A and a G (not unit-wise)."""
  return [plan for plan in layout.plans if not plan.layer.unitwise]


def _slot(layout: layout_lib.Layout, place: layout_lib.FactorPlace) -> int:
  """A factor's slot in a `[P·max_factors]` vector by (owner, index)."""
  return place.owner * layout.max_factors + place.index


def _factor_copies(layout: layout_lib.Layout) -> tuple[np.ndarray, ...]:
  """`(layer, row, slot)` of every copy of every factor of `_paired_plans`
  (each piece's, each replica's): its layer's number there, 0 for A and 1
  for G, and its `_slot`."""
  entries = [(k, row, _slot(layout, q)) for k, plan in enumerate(_paired_plans(layout))
             for piece in plan.pieces for row, place in enumerate((piece.a, piece.g))
             for q in (place,) + place.copies]
  if not entries:
    return (np.zeros(0, np.int32),) * 3
  return tuple(np.asarray(column, np.int32) for column in zip(*entries))


def paired_failures(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                    slots: int) -> Callable[[jax.Array], jax.Array]:
  """Method "inverse": `[slots + 1]` failure flags of this device's factors →
  those of every factor whose layer has a failed factor (both inverses carry
  the layer's π: a new `G⁻¹` beside a kept `A⁻¹` would apply neither the old
  nor the new damping). The devices' flags are gathered (A and G may have
  different owners) and each layer's maximum is sent to all its factors'
  copies, as `pi_damping` sends the damping."""
  layers, _, targets = _factor_copies(layout)
  if not layers.size:
    return lambda failed: failed

  def couple(failed: jax.Array) -> jax.Array:
    own = collectives_lib.pad_to([failed[:slots]], layout.max_factors, jnp.int32)
    everyone = comm.all_gather_owned(own)
    layer_failed = jax.ops.segment_max(everyone[targets], layers,
                                       num_segments=len(_paired_plans(layout)))
    coupled = jnp.zeros_like(everyone).at[targets].max(layer_failed[layers])
    mine = lax.dynamic_slice_in_dim(coupled, comm.device_index() * layout.max_factors,
                                    layout.max_factors)
    return failed.at[:slots].max(mine[:slots])
  return couple


def owned_factors(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                  running: jax.Array) -> Callable[[int], jax.Array]:
  """`device -> its owned running factors, tight` (replicas after its home
  factors). Tight chunks are gathered first (decomposition steps only): every
  owner needs its whole factors; a replica reads its home's copy."""
  if layout.factor_storage != layout_lib.CHUNKED:
    return lambda device: running
  full = comm.all_gather_owned(running)
  ranges = [layout.input_ranges(d) for d in range(layout.num_devices)]

  def owned_of(device: int) -> jax.Array:
    mine, size = ranges[device], sum(n for _, n in ranges[device])
    if not shares_branch(comm, layout, device):
      return collectives_lib.concatenated([full[s:s + n] for s, n in _adjoined(mine)],
                                          size, full.dtype)
    # Every device of the branch reads ranges of the same sizes, each at its own starts.
    return collectives_lib.concatenated([
        comm.range_at(full, tuple(r[j][0] if j < len(r) else 0 for r in ranges), n)
        for j, (_, n) in enumerate(mine)], size, full.dtype)
  return owned_of


def _adjoined(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
  """`(start, size)` ranges, each that continues the last joined to it."""
  out: list[tuple[int, int]] = []
  for start, size in ranges:
    if out and sum(out[-1]) == start:
      out[-1] = (out[-1][0], out[-1][1] + size)
    else:
      out.append((start, size))
  return out


def shares_branch(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                  device: int) -> bool:
  """Whether `device`'s decomposition branch also serves other devices
  (`Layout.decomposition_branches`): it then reads its inputs at offsets
  from the running device's index."""
  return comm.num_devices > 1 and layout.decomposition_branches.count(device) > 1


def distribute_second(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                      local: jax.Array) -> jax.Array:
  """Each device's new `[L₂]` → the second-order array of its spec: its
  group's segments (one group: every owner's) in the rows of
  `Layout.second_slots`, gathered without padded traffic (several groups:
  each rank's slot, `Layout.second_capacity`, the same in every group)."""
  if not comm.active:
    return local
  if layout.num_groups == 1:    # every device gets every segment
    return comm.gather_uneven(local, layout.second_sizes).in_rows(
        layout.second_row_members(), layout.second_row)
  if layout.group_size == 1:
    return local
  return comm.gather_group_uneven(local, layout.second_capacity).in_rows(
      layout.second_row_members(), layout.second_row)


def decompose(config: KfacConfig, comm: collectives_lib.Collectives,
              layout: layout_lib.Layout, running: jax.Array, gamma: jax.Array | None,
              second: jax.Array, due: jax.Array | None = None) -> jax.Array:
  """New second-order state from the running factors; `second` is the current
  one (this device's part), kept for any factor that fails, and with stale
  statistics for every factor not `due` (`[F]`, plan order).
  The per-device switch decomposes; `keep_failed` runs once after it, on
  tables of where each device's factors lie, not once in every branch."""
  previous = packing.own_second_segment(comm, layout, second)
  stale = None if due is None else DueFactors(due, previous)
  owned_of = owned_factors(comm, layout, running)
  width = max(_owned_sizes(layout, running))
  damping = None if config.method == "eigen" else pi_damping(config, comm, layout,
                                                               owned_of, gamma)
  runs: dict[int, SlotRuns] = {}

  def branch(device: int) -> tuple[jax.Array, jax.Array]:
    owned = owned_of(device)
    if damping is None:
      new, runs[device] = eigen_segment(config, layout, device, owned, comm, stale)
    else:
      new, runs[device] = inverse_segment(config, layout, device, owned, damping, comm,
                                          stale)
    return new, collectives_lib.pad_to([owned], width, owned.dtype)
  new, owned = comm.per_device(branch, layout.decomposition_branches)
  new_runs, running_runs, slots = _slot_tables(comm, layout, runs)
  couple = None if damping is None else paired_failures(comm, layout, slots)
  local = keep_failed(new, previous, new_runs, owned, running_runs, slots, couple)
  return distribute_second(comm, layout, local)


def _owned_sizes(layout: layout_lib.Layout, running: jax.Array) -> list[int]:
  """Numbers of running factors each device decomposes (`owned_factors`)."""
  if layout.factor_storage != layout_lib.CHUNKED:
    return [running.shape[0]]
  return [sum(n for _, n in layout.input_ranges(d)) for d in range(layout.num_devices)]


def _slot_tables(comm: collectives_lib.Collectives, layout: layout_lib.Layout,
                 runs: dict[int, SlotRuns]) -> tuple[Any, Any, int]:
  """The running device's `SlotRuns` (`runs` of each branch's
  representative) as `run_table`s read at its branch, and the most slots of
  any device (its slots past its own are never used)."""
  if comm.num_devices == 1:
    return runs[0]
  reps = layout.decomposition_branches
  order = sorted(runs)
  tables = []
  for field in ("new", "running"):
    rows = max(len(getattr(runs[r], field)) for r in order)
    tables.append(jnp.asarray(np.stack([run_table(getattr(runs[r], field), rows)
                                        for r in order]))[
        comm.device_table(tuple(order.index(r) for r in reps))])
  return tables[0], tables[1], max(runs[r].slots for r in order)
