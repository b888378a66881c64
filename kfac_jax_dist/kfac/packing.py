"""Flat segments ↔ matrices: the storage format of `layout`.

A full factor is stored as its upper triangle (`packed`) or all `d²` numbers, a
diagonal one as its `d` diagonal entries; a device's segment is its factors
one after the other (see `layout` for how segments form the global array).

The builders take `xp`, `jax.numpy` (traced, the default) or `numpy` (host
arrays: an eager `tx.init` builds its state there and transfers it once).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import statistics as factors
from kfac_jax_dist.capture import triangles
from kfac_jax_dist.core import collectives
from kfac_jax_dist.core import initial
from kfac_jax_dist.core import linalg
from kfac_jax_dist.core import offsets
from kfac_jax_dist.kfac import layout as layout_lib


def stored_identity(place: layout_lib.FactorPlace, dtype, packed: bool, xp=jnp
                    ) -> jax.Array:
  """The identity factor in its storage form (`pack_factor(identity(place))`
  without building the `d × d` matrix when packed)."""
  if place.form != factors.FULL or not packed:
    return pack_factor(identity(place, dtype, xp), place.form, packed)
  d = place.dim
  diagonal = triangles.row_starts(np.arange(d), d)
  if xp is np:
    out = np.zeros(triangles.packed_size(d), dtype)
    out[diagonal] = 1
    return out
  return jnp.zeros(triangles.packed_size(d), dtype).at[diagonal].set(1)


def pack_factor(value: jax.Array, form: str, packed: bool) -> jax.Array:
  """A factor in its storage form, flat; a full one that came packed (the
  capture's `PACKED` statistics) as it is."""
  if form in (factors.DIAG, factors.UNIT) or value.ndim == 1:
    return value.reshape(-1)
  return triangles.pack_upper(value) if packed else value.reshape(-1)


def pack_factors(values: jax.Array, place: layout_lib.FactorPlace, packed: bool
                 ) -> jax.Array:
  """`pack_factor` of `k` factors of one place's form and dimension, `[k, ...]`
  (a full one maybe packed already), flat: one gather for all of them."""
  full = place.form == factors.FULL and values.shape[-2:] == (place.dim, place.dim)
  return (triangles.pack_upper(values) if full and packed else values).reshape(-1)


def unpack_batch(segment: jax.Array, batch: layout_lib.Batch, packed: bool) -> jax.Array:
  """The batch's running factors, `[k, d, d]` (`[k, d]` diagonal, `[k, 3d]`
  unit-wise)."""
  size = layout_lib.storage_size(batch.dim, batch.form, packed)
  block = segment[batch.offset:batch.offset + batch.count * size].reshape(batch.count, size)
  if batch.form in (factors.DIAG, factors.UNIT):
    return block
  if packed and 1 < batch.count <= linalg.UNROLLED_MAX_SLOTS:
    # Slot by slot where a CPU decomposes them one call each, written out
    # (`core.linalg.batched`): each slot's gather then fuses into its call's
    # input copy, where one gather of the batch was one more kernel.
    return jnp.stack([triangles.unpack_upper(row, batch.dim) for row in block])
  if packed:
    return triangles.unpack_upper(block, batch.dim)
  return block.reshape(batch.count, batch.dim, batch.dim)


def stored_together(now: tuple, before: tuple) -> bool:
  """Whether two factors a device stores follow one another whole: the same
  factor ("a", "g") of consecutive blocks, the second right after the first."""
  (place, _, which), (last, _, last_which) = now, before
  return (which == last_which and place.offset == last.offset + last.size
          and place.columns is None and last.columns is None)


class PackedStacks:
  """Each factor of a stack's blocks (`block_runs` of `lay.plans`, pieces
  included) packed once, by one gather, whichever devices own them, from
  `value_of(plans, which)` (`[k, ...]`); a device's run of blocks is a slice
  of it. Packing each device's blocks apart made the program grow with P: at
  P = 1024 each device owns one or two of GPT-2-XL's factors, so 576 packs
  of their own. Called as `value_of`: `(plans, which) -> [k · size]`."""

  def __init__(self, lay: layout_lib.Layout, value_of, dtype):
    self._lay, self._value_of, self._dtype = lay, value_of, dtype
    self._where = {plan.layer.name: (run, i)
                   for run in layout_lib.block_runs(lay.plans, pieces=True)
                   for i, plan in enumerate(run)}
    self._done: dict[tuple[str, str], jax.Array] = {}
    self._cycles: dict[tuple[str, tuple[str, ...]], jax.Array] = {}

  def locate(self, plans: Sequence[layout_lib.LayerPlan], which: str
             ) -> tuple[tuple[str, str], int, int]:
    """`(stack key, first block, end block)` of `plans`' factors `which`."""
    run, i = self._where[plans[0].layer.name]
    return (run[0].layer.name, which), i, i + len(plans)

  def places(self, stack: str) -> tuple[tuple[str, layout_lib.FactorPlace], ...]:
    """The stack's factors `(which, place)`, in a block's storage order."""
    return self._where[stack][0][0].places

  def _packed(self, key: tuple[str, str]) -> jax.Array:
    if key not in self._done:
      run, _ = self._where[key[0]]
      self._done[key] = pack_factors(self._value_of(run, key[1]).astype(self._dtype),
                                     dict(run[0].places)[key[1]],
                                     self._lay.packed).reshape(len(run), -1)
    return self._done[key]

  def blocks(self, key: tuple[str, str], lo: int, hi: int) -> jax.Array:
    """Blocks `[lo, hi)` of the stack `key`'s packed factors, flat."""
    return self._packed(key)[lo:hi].reshape(-1)

  def interleaved(self, stack: str, cycle: tuple[str, ...]) -> jax.Array:
    """The stack's packed factors `cycle`, block by block (each block's
    factors in `cycle`'s order), flat: `[k · Σ sizes]`."""
    if (stack, cycle) not in self._cycles:
      self._cycles[(stack, cycle)] = joined(
          [self._packed((stack, w)) for w in cycle], axis=1).reshape(-1)
    return self._cycles[(stack, cycle)]

  def __call__(self, plans: Sequence[layout_lib.LayerPlan], which: str) -> jax.Array:
    return self.blocks(*self.locate(plans, which))


def joined(parts: Sequence[jax.Array], axis: int = 0) -> jax.Array:
  """`parts` concatenated along `axis` (one part as it is: no copy)."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def _stored_runs(lay: layout_lib.Layout, device: int) -> list[list[tuple]]:
  """The factors `device` stores (`Layout.stored`) in runs that follow one
  another whole (`stored_together`)."""
  return layout_lib.block_runs(lay.stored(device), lambda t: t[1], stored_together)


def owned_factors(lay: layout_lib.Layout, device: int, value_of, dtype,
                  stored_values: bool = False, batched: bool = False) -> list[jax.Array]:
  """The factors device `device` stores (`Layout.stored`), packed, with
  `value_of(plan, which)` per factor (already in storage form with
  `stored_values`). `batched`: `value_of(plans, which)` gives the storage
  form of consecutive blocks of a stacked layer, flat (`PackedStacks`),
  one piece for them."""
  if stored_values:
    return [value_of(plan, which).astype(dtype) for _, plan, which in lay.stored(device)]
  if not batched:
    return [pack_factor(value_of(plan, which).astype(dtype), place.form, lay.packed)
            for place, plan, which in lay.stored(device)]
  return [value_of([plan for _, plan, _ in run], run[0][2])
          for run in _stored_runs(lay, device)]


_INT32_MAX = offsets.INT32_MAX         # past it, the buffer is written by rows


def _write_span(out: jax.Array, at: int, span: jax.Array) -> jax.Array:
  """`out` (`[rows, width]`, read flat) with `span` written from flat
  position `at`: the end of a row, whole rows, the start of a row (at most
  three writes, however many rows it crosses), every index a (row, column)
  pair within int32, whatever `at` (GPT-2-XL's statistics: 2.9e9 numbers)."""
  width, i, n = out.shape[1], 0, span.shape[0]
  row, column = divmod(at, width)
  if column:
    i = min(width - column, n)
    out = lax.dynamic_update_slice(out, span[:i][None], (row, column))
    row += 1
  rows = (n - i) // width
  if rows:
    out = lax.dynamic_update_slice(out, span[i:i + rows * width].reshape(rows, width),
                                   (row, 0))
    i, row = i + rows * width, row + rows
  if i < n:
    out = lax.dynamic_update_slice(out, span[i:][None], (row, 0))
  return out


class _Range(NamedTuple):
  """Numbers `[start, stop)` of a stack's packed factors `cycle`
  (`PackedStacks.interleaved`), at `at` in the global array."""
  at: int
  stack: str
  cycle: tuple[str, ...]
  start: int
  stop: int


def _ranges(lay: layout_lib.Layout, packs: PackedStacks,
            cycles: dict[str, tuple[str, ...]]) -> list[_Range]:
  """Every stored run of blocks as ranges of its stack's packed factors:
  alone (`cycle` its factor), or for the stacks in `cycles` one range per
  block in the stack's factors interleaved block by block in that order
  (where a device stores a layer's factors together, as MEM-OPT's owners
  do, consecutive blocks then follow one another)."""
  out, at = [], 0
  for device in range(lay.num_devices):
    if lay.factor_storage == layout_lib.OWNER:
      at = device * lay.segment
    for run in _stored_runs(lay, device):
      (stack, which), lo, hi = packs.locate([plan for _, plan, _ in run], run[0][2])
      sizes = {w: place.size for w, place in packs.places(stack)}
      if stack not in cycles:
        out.append(_Range(at, stack, (which,), lo * sizes[which], hi * sizes[which]))
        at += (hi - lo) * sizes[which]
        continue
      cycle = cycles[stack]
      width, offset = sum(sizes.values()), sum(sizes[w] for w in cycle[:cycle.index(which)])
      for block in range(lo, hi):
        start = block * width + offset
        out.append(_Range(at, stack, cycle, start, start + sizes[which]))
        at += sizes[which]
  return out


def _merged(ranges: Sequence[_Range]) -> list[_Range]:
  """`ranges`, each that continues the last in both the global array and the
  same packed factors joined to it."""
  out: list[_Range] = []
  for r in ranges:
    last = out[-1] if out else None
    if (last and last.stack == r.stack and last.cycle == r.cycle and last.stop == r.start
        and last.at + last.stop - last.start == r.at):
      out[-1] = last._replace(stop=r.stop)
    else:
      out.append(r)
  return out


def _span_plan(lay: layout_lib.Layout, packs: PackedStacks) -> list[_Range]:
  """The fewest ranges of packed factors that write every stored factor: a
  stack's blocks over consecutive devices in one range, per factor (tight
  chunks of COMM-OPT's single factors) or interleaved in either order
  (MEM-OPT's layers, both factors on one device), whichever is fewest for
  the stack (one form per stack: each is a copy of its statistics)."""
  def count(cycles: dict[str, tuple[str, ...]]) -> collections.Counter:
    return collections.Counter(r.stack for r in _merged(_ranges(lay, packs, cycles)))
  best, chosen = count({}), {}
  kinds = {stack: tuple(w for w, _ in packs.places(stack)) for stack in best
           if len(packs.places(stack)) > 1}
  for cycle in {c for kind in kinds.values() for c in itertools.permutations(kind)}:
    cycles = {stack: cycle for stack, kind in kinds.items() if set(kind) == set(cycle)}
    fewer = count(cycles)
    for stack in cycles:
      if fewer[stack] < best[stack]:
        best[stack], chosen[stack] = fewer[stack], cycle
  return _merged(_ranges(lay, packs, chosen))


def _spans(lay: layout_lib.Layout, value_of, dtype, batched: bool
           ) -> list[tuple[int, jax.Array]]:
  """`(at, numbers)` of every device's stored factors in the global array.
  `batched` (`value_of` a `PackedStacks`): one span per range of
  `_span_plan`, so per stack where the layout allows, not per device."""
  if batched:
    return [(r.at, value_of.interleaved(r.stack, r.cycle)[r.start:r.stop])
            for r in _span_plan(lay, value_of)]
  located, at = [], 0
  for device in range(lay.num_devices):
    if lay.factor_storage == layout_lib.OWNER:
      at = device * lay.segment
    for piece in owned_factors(lay, device, value_of, dtype):
      located.append((at, piece))
      at += piece.shape[0]
  return located


def _written_segments(lay: layout_lib.Layout, value_of, dtype, batched: bool
                      ) -> jax.Array:
  """`all_segments` of more than 2³¹ numbers (the reduce-scatter's buffer
  holds every factor: GPT-2-XL's are 2.9e9), traced: written as one row per
  device, each span (`_spans`) split where it crosses rows (`_write_span`),
  so that no offset passes int32 (a flat one would wrap, and XLA would clamp
  the write to another place)."""
  width = lay.factor_shard        # within int32: `layout.check_addressable` at init
  spans = _spans(lay, value_of, dtype, batched)
  axes = _compat.varying_axes(*(x for _, x in spans))
  out = _compat.as_varying(jnp.zeros((lay.num_devices, width), dtype), axes)
  for at, span in spans:
    out = _write_span(out, at, span)
  return out.reshape(-1)


def all_segments(lay: layout_lib.Layout, value_of, dtype, xp=jnp,
                 stored_values: bool = False, batched: bool = False) -> jax.Array:
  """The global running-factor array, `[P · factor_shard]`: the owners' factors
  one owner after the other, tight ("chunked") or each padded to `L` ("owner").
  Traced past 2³¹ numbers, it is written by rows (`_written_segments`).
  `value_of`, `stored_values`, `batched`: as `owned_factors`."""
  if batched:
    value_of = PackedStacks(lay, value_of, dtype)
  if (xp is jnp and not stored_values
      and lay.num_devices * lay.factor_shard > _INT32_MAX):
    return _written_segments(lay, value_of, dtype, batched)
  per_device = [owned_factors(lay, d, value_of, dtype, stored_values, batched)
                for d in range(lay.num_devices)]
  join = (collectives.concatenated if xp is jnp
          else functools.partial(collectives.pad_to, xp=xp))
  if lay.factor_storage == layout_lib.OWNER:
    per_device = [[join(pieces, lay.segment, dtype)] for pieces in per_device]
  return join([p for pieces in per_device for p in pieces],
              lay.num_devices * lay.factor_shard, dtype)


def _unit_identity(dim: int, dtype, xp=jnp) -> jax.Array:
  """`[dim, 3]` rows `(1, 0, 1)`: every channel's 2×2 block is the identity."""
  return xp.tile(xp.asarray([1.0, 0.0, 1.0], dtype), (dim, 1))


def identity(place: layout_lib.FactorPlace, dtype, xp=jnp) -> jax.Array:
  if place.form == factors.DIAG:
    return xp.ones((place.dim,), dtype)
  if place.form == factors.UNIT:
    return _unit_identity(place.dim, dtype, xp)
  return xp.eye(place.dim, dtype=dtype)


def second_order_segment(lay: layout_lib.Layout, device: int, dtype, xp=jnp
                         ) -> jax.Array:
  """Initial `[L₂]` segment: identity eigenbases/inverses, unit eigenvalues."""
  pieces = []
  for batch in lay.batches[device]:
    lo, hi = batch.columns or (0, batch.dim)
    if batch.matrix_offset is not None:
      eye = xp.eye(batch.dim, dtype=dtype)[:, lo:hi]
      pieces.append(xp.tile(eye.reshape(-1), batch.count))
    if batch.form == factors.UNIT:
      pieces.append(xp.tile(_unit_identity(batch.dim, dtype, xp).reshape(-1),
                            batch.count))
    elif batch.vector_offset is not None:
      pieces.append(xp.ones(batch.count * (hi - lo), dtype))
  return collectives.pad_to(pieces, lay.second_segment, dtype, xp)


def _identity_piece(place: layout_lib.FactorPlace, packed: bool) -> tuple:
  """The stored identity of `place` as an `initial` piece."""
  if place.form == factors.DIAG:
    return initial.ones(place.dim)
  if place.form == factors.UNIT:
    return initial.packed_eye(2, place.dim)         # rows (1, 0, 1)
  return initial.packed_eye(place.dim, 1) if packed else initial.eye(place.dim, 1)


def initial_factors(lay: layout_lib.Layout, dtype) -> jax.Array:
  """Traced `all_segments` of the identity factors, `[P · factor_shard]`,
  built elementwise (`core.initial`: each device's shard alone under
  `jax.jit(..., out_shardings=...)`)."""
  width, runs, at = lay.factor_shard, [], 0
  for device in range(lay.num_devices):
    if lay.factor_storage == layout_lib.OWNER:
      at = device * lay.segment
    pieces = [_identity_piece(place, lay.packed) for place, _, _ in lay.stored(device)]
    runs += initial.lay_out(pieces, at, width)
    at += sum(length for _, length in pieces)
  return initial.build(runs, lay.num_devices, width, dtype, rows_per_device=1).reshape(-1)


def _second_order_pieces(lay: layout_lib.Layout, owner: int) -> list[tuple]:
  """`second_order_segment(lay, owner)` as `initial` pieces."""
  pieces = []
  for batch in lay.batches[owner]:
    lo, hi = batch.columns or (0, batch.dim)
    if batch.matrix_offset is not None:
      pieces.append(initial.eye(batch.dim, batch.count, batch.columns))
    if batch.form == factors.UNIT:
      pieces.append(initial.packed_eye(2, batch.count * batch.dim))
    elif batch.vector_offset is not None:
      pieces.append(initial.ones(batch.count * (hi - lo)))
  return pieces


def initial_second_order(lay: layout_lib.Layout, rows: list[list[tuple[int, int]]],
                         length: int, dtype, per_device: int | None) -> jax.Array:
  """Traced: rows of `length` numbers, each holding the
  `second_order_segment`s of its (owner, column)s (`state.second_order_rows`),
  `[len(rows) · length]`, built elementwise (`core.initial`; `per_device`:
  rows per device once sharded, None when replicated)."""
  mine = {}
  for row in rows:
    for owner, column in row:
      if (owner, column) not in mine:
        mine[owner, column] = initial.lay_out(_second_order_pieces(lay, owner), column,
                                              length)
  runs = [dataclasses.replace(run, row=r) for r, row in enumerate(rows)
          for slot in row for run in mine[slot]]
  return initial.build(runs, len(rows), length, dtype, per_device).reshape(-1)


def own_second_segment(comm: collectives.Collectives, lay: layout_lib.Layout,
                       second: jax.Array) -> jax.Array:
  """The running device's own `[L₂]` segment within its second-order array
  (its slot's row, `Layout.second_slots`, from its column on; past its own
  numbers, which are all any reader uses, whatever follows)."""
  size = lay.second_segment
  if comm.num_devices == 1:
    return second[:size]
  rows, columns = zip(*lay.second_slots)
  row = (second if lay.second_rows == 1 else
         offsets.segment_at(second, lay.second_row, comm.device_table(rows)))
  if not any(columns):
    return row[:size]
  return lax.dynamic_slice_in_dim(jnp.pad(row, (0, size)), comm.device_table(columns), size)


def width(place) -> int:
  """Columns of the factor's second-order state `place` holds (all, or its slice)."""
  return place.dim if place.columns is None else place.columns[1] - place.columns[0]


def read_matrix(second: jax.Array, base: int, place: layout_lib.FactorPlace) -> jax.Array:
  """Eigenbasis or inverse, `[d, d]`; of a column slice, `[d, w]`."""
  start, w = base + place.matrix_offset, width(place)
  return second[start:start + place.dim * w].reshape(place.dim, w)


def read_vector(second: jax.Array, base: int, place: layout_lib.FactorPlace) -> jax.Array:
  """Eigenvalues or a diagonal inverse, `[d]` (`[w]` of a column slice); a
  unit-wise Fisher, `[d, 3]`."""
  start = base + place.vector_offset
  if place.form == factors.UNIT:
    return second[start:start + 3 * place.dim].reshape(place.dim, 3)
  return second[start:start + width(place)]


class RunPart(NamedTuple):
  """One part of each of a run's `k` factors (`run_parts`): its matrix or
  vector (`offset`) of one column slice, `shape` each, at `starts`."""

  offset: str                    # "matrix_offset" | "vector_offset"
  shape: tuple[int, ...]
  starts: tuple[int, ...]


def run_parts(base_of, places: tuple[layout_lib.FactorPlace, ...]) -> list[RunPart]:
  """Where the second-order parts of `k` factors of one form, dimension and
  column split lie (`layout.precondition_runs`): per part, per column slice."""
  first, d = places[0], places[0].dim
  slices = [tuple(((q,) + q.copies)[j] for q in places) for j in range(1 + len(first.copies))]
  shapes = {"matrix_offset": lambda q: (d, width(q)),
            "vector_offset": lambda q: (d, 3) if q.form == factors.UNIT else (width(q),)}
  return [RunPart(offset, shape(qs[0]), tuple(base_of(q) + getattr(q, offset) for q in qs))
          for offset, shape in shapes.items() if getattr(first, offset) is not None
          for qs in slices]


def _assembled(parts: list[RunPart], values: list[jax.Array]):
  """`(matrices, vectors)`, the parts' `values` (read in their order) with
  column slices put together (None where the factors have none: a vector is
  all a unit-wise Fisher or method "inverse"'s matrix has)."""
  out = {}
  for part, value in zip(parts, values):
    out.setdefault(part.offset, []).append(value)
  together = {k: joined(v, axis=-1) for k, v in out.items()}
  return together.get("matrix_offset"), together.get("vector_offset")


def start_table(starts: tuple[int, ...], row: int) -> np.ndarray:
  """`[k, 2]` int32 (row, column) of each start in an array viewed as `[-1, row]`."""
  return np.array([divmod(s, row) for s in starts], np.int32).reshape(-1, 2)


def gather_windows(x: jax.Array, at: jax.Array, shape: tuple[int, ...], row: int
                   ) -> jax.Array:
  """`[c, *shape]`: windows of `x` (viewed as `[-1, row]`, each inside one
  row) from the (row, column) starts `at` (`[c, 2]`, in bounds): one gather."""
  n = math.prod(shape)
  dims = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                    start_index_map=(0, 1))
  windows = lax.gather(x.reshape(-1, row), at, dims, slice_sizes=(1, n),
                       mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
  return windows.reshape((at.shape[0],) + tuple(shape))


def stride_of(starts: tuple[int, ...], n: int) -> int | None:
  """The constant stride (at least `n`) parts of `n` numbers at `starts` lie
  apart (`n` for one part), or None: `read_at` then gathers, not slices."""
  stride = starts[1] - starts[0] if len(starts) > 1 else n
  if stride >= n and all(b - a == stride for a, b in zip(starts, starts[1:])):
    return stride
  return None


def read_at(x: jax.Array, starts: tuple[int, ...], shape: tuple[int, ...], row: int
            ) -> jax.Array:
  """`[k, *shape]`: `k` parts of `x` at static `starts`, each inside one row
  of `x` viewed as `[-1, row]`. A constant stride apart (at least a part's
  size), one slice of `[k, stride]` rows (the last padded where `x` ends
  first); else one gather of the `k` windows at (row, column) starts, within
  int32 whatever `x`'s length (GPT-2-XL's at P = 1024: 4·10¹⁰ numbers)."""
  k, n = len(starts), math.prod(shape)
  stride = stride_of(starts, n)
  if stride is not None:
    window = x[starts[0]:min(starts[0] + k * stride, x.shape[0])]
    window = jnp.pad(window, (0, k * stride - window.shape[0]))
    return window.reshape(k, stride)[:, :n].reshape((k,) + tuple(shape))
  return gather_windows(x, jnp.asarray(start_table(starts, row)), shape, row)


def read_run(second: jax.Array, parts: list[RunPart], row: int,
             at: list[jax.Array] | None = None):
  """`(matrices [k, d, d], vectors [k, d])` of a run's `k` full factors
  (`run_parts`; each part inside one `row`-long owner segment), column
  slices put together, each part read at once (`read_at`); the matrices None
  where there are none (a unit-wise Fisher, `[k, d, 3]`), the vectors None
  under method "inverse". `at`: per part, the (row, column) starts of some
  of the factors only (`[c, 2]`, traced: a loop over a large run's chunks),
  read by one gather each."""
  if at is None:
    return _assembled(parts, [read_at(second, p.starts, p.shape, row) for p in parts])
  return _assembled(parts, [gather_windows(second, starts, p.shape, row)
                            for p, starts in zip(parts, at)])


def read_parts(second: jax.Array, base_of, place: layout_lib.FactorPlace):
  """`(matrix, vector)` of a factor, its column slices (`place` and its
  `copies`, each at `base_of(slice)`) put together; None where it has none."""
  slices = (place,) + place.copies
  xp = np if isinstance(second, np.ndarray) else jnp
  matrix = (None if place.matrix_offset is None else xp.concatenate(
      [read_matrix(second, base_of(q), q) for q in slices], axis=1))
  vector = (None if place.vector_offset is None else xp.concatenate(
      [read_vector(second, base_of(q), q) for q in slices], axis=0))
  return matrix, vector
