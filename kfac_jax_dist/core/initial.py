"""The initial state's flat arrays, built in the program one element at a time.

At count 0 a preconditioner's state is identities and ones laid in flat
per-device segments: K-FAC's running factors (full `d × d`, upper triangles,
diagonals, SP-NGD's unit-wise 2×2 blocks) and eigenbases or inverses (whole or
column slices), Shampoo's statistics and roots (blocks). Each array is
described here as `Run`s, stretches of one row of a `[rows, width]` view that
repeat one pattern, and `build` evaluates every element from its row and
column: which run holds it (a scatter of the runs' starts and a running
maximum along the row), then the run's pattern at its position.

Built so, every op is elementwise along the rows or a read of a small table,
and XLA's partitioner gives each device the rows of its own shard:
`jax.jit(tx.init, out_shardings=...)` holds about one shard per device in
temporaries. Concatenating per-device pieces, or writing them with
`dynamic_update_slice`, makes it build about the whole global array on every
device (ResNet-50's K-FAC state at P = 8, MEM-OPT: 3.8× the shard in
temporaries; GPT-2-XL's at P = 64: 55.6 GB).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist.capture import triangles
from kfac_jax_dist.core import offsets

EYE = 0        # blocks `eye(dim)[:, low:low + width]`, row-major; ones: dim = width = 1
PACKED = 1     # upper triangles of `eye(dim)`, row-major; a unit-wise 2×2 block: dim = 2


def _period(kind: int, dim: int, width: int, low: int) -> int:
  """Numbers in one repetition of a pattern."""
  del low
  return triangles.packed_size(dim) if kind == PACKED else dim * width


@dataclasses.dataclass(frozen=True)
class Run:
  """Columns `[start, start + length)` of `row` hold a pattern's numbers from
  its position `phase` on, repeating every `period` numbers."""

  row: int
  start: int
  length: int
  kind: int = EYE
  dim: int = 1
  width: int = 1
  low: int = 0
  phase: int = 0

  @property
  def period(self) -> int:
    return _period(self.kind, self.dim, self.width, self.low)


def eye(dim: int, count: int, columns: tuple[int, int] | None = None) -> tuple:
  """`count` blocks `eye(dim)` (of its `columns` only): (pattern, length)."""
  low, high = columns or (0, dim)
  return (EYE, dim, high - low, low), count * dim * (high - low)


def ones(count: int) -> tuple:
  return (EYE, 1, 1, 0), count


def packed_eye(dim: int, count: int) -> tuple:
  """`count` upper triangles of `eye(dim)` (a unit-wise 2×2 block: dim 2)."""
  return (PACKED, dim, 1, 0), count * triangles.packed_size(dim)


def lay_out(pieces: Sequence[tuple[tuple, int] | int], start: int, width: int) -> list[Run]:
  """Runs of `pieces` written one after the other from flat position `start`
  of a `[rows, width]` view (an int: that many zeros), split where they cross
  rows; adjacent pieces of one pattern are one run (a piece is whole
  periods, so the pattern goes on)."""
  merged: list[list] = []
  for piece in pieces:
    if isinstance(piece, int):
      if piece:
        merged.append([None, piece])
    elif merged and merged[-1][0] == piece[0]:
      merged[-1][1] += piece[1]
    else:
      merged.append(list(piece))
  runs: list[Run] = []
  at = start
  for pattern, length in merged:
    done = 0
    while pattern is not None and done < length:
      row, column = divmod(at + done, width)
      n = min(width - column, length - done)
      runs.append(Run(row, column, n, *pattern, phase=done % _period(*pattern)))
      done += n
    at += length
  return runs


# Elements evaluated at once per device: the temporaries of `build`, besides
# its marks, are a few int32 arrays of this many numbers.
CHUNK = 2 ** 16


def _tables(runs: Sequence[Run]) -> dict[str, jax.Array]:
  """Each field of the runs as an int32 table, read at each element's run."""
  fields = ("start", "length", "kind", "dim", "width", "low", "phase", "period")
  return {f: jnp.asarray(offsets.int32_table([getattr(r, f) for r in runs]))
          for f in fields}


def _numbering(runs: Sequence[Run], rows: int) -> tuple[np.ndarray, np.ndarray, Any]:
  """Runs are numbered within their row, from 1: `(first, count, dtype)`:
  each row's first run (in `runs`, sorted by row), its number of runs, and
  the narrowest integer type that holds the numbers (int8 up to 127: a
  quarter of a float32 array's bytes)."""
  first = np.searchsorted(np.array([r.row for r in runs]), np.arange(rows))
  count = np.diff(np.append(first, len(runs)))
  return first, count, next(d for d in (jnp.int8, jnp.int16, jnp.int32)
                            if count.max() <= jnp.iinfo(d).max)


def _opaque(x: Any) -> Any:
  """`x`, which XLA may not see as constant: it would fold a scatter of
  constants into a constant array of the state's size (21 s for a 100 MB row
  of Shampoo's roots)."""
  return lax.optimization_barrier(jax.tree_util.tree_map(jnp.asarray, x))


def _marks(runs: Sequence[Run], rows: int, width: int) -> jax.Array:
  """`[rows, width]`: each run's number in its row at its start, zeros
  elsewhere; their running maximum along a row is each element's run."""
  first, _, dtype = _numbering(runs, rows)
  rows_of = np.array([r.row for r in runs])
  where, numbers = _opaque((
      (offsets.int32_table(rows_of), offsets.int32_table([r.start for r in runs])),
      offsets.int32_table(np.arange(len(runs)) - first[rows_of] + 1).astype(dtype)))
  return jnp.zeros((rows, width), dtype).at[where].set(numbers, unique_indices=True)


def _values(found: jax.Array, first: jax.Array, t: dict[str, jax.Array], start: Any, dtype
            ) -> jax.Array:
  """The numbers at columns `start + [0, n)` whose runs are `found` (`[rows, n]`,
  the run's number in its row, 0 for none; `first`: each row's first run)."""
  t = {name: table[first[:, None] + jnp.maximum(found - 1, 0)] for name, table in t.items()}
  column = start + lax.broadcasted_iota(jnp.int32, found.shape, 1)
  inside = (found > 0) & (column < t["start"] + t["length"])
  q = ((column - t["start"]) % t["period"] + t["phase"]) % t["period"]
  in_block = q % t["width"] + t["low"] == q // t["width"]
  diagonal = triangles.packed_rows(q, t["dim"])
  on_triangle = triangles.row_starts(diagonal, t["dim"]) == q
  return (inside & jnp.where(t["kind"] == PACKED, on_triangle, in_block)).astype(dtype)


def _fill_by_chunks(out: jax.Array, runs: Sequence[Run], t: dict[str, jax.Array],
                    chunk: int) -> jax.Array:
  """`out` (`[rows, width]`, replicated) written `chunk` columns of a row at
  a time, each chunk's runs found from its row's run starts alone: a scatter
  of those that start inside it and a count of those before it. Nothing the
  size of a row lives beside `out` (COMM-OPT's one row of every owner's
  eigenbases: ResNet-50's at P = 8 is 154 M numbers, whose marks would be
  int16)."""
  rows, width = out.shape
  first, count, _ = _numbering(runs, rows)
  k = jnp.arange(int(count.max()), dtype=jnp.int32)
  first, count, starts = (jnp.asarray(offsets.int32_table(x)) for x in (
      first, count, [r.start for r in runs]))
  per_row = -(-width // chunk)

  def write(i: jax.Array, out: jax.Array) -> jax.Array:
    row, start = i // per_row, jnp.minimum(i % per_row * chunk, width - chunk)
    mine = starts[jnp.minimum(first[row] + k, len(runs) - 1)]
    real = k < count[row]
    before = jnp.sum(real & (mine < start)).astype(jnp.int32)
    inside = jnp.where(real & (mine >= start), mine - start, chunk)     # past: dropped
    marks = jnp.zeros((1, chunk), jnp.int32).at[0, inside].set(k + 1, mode="drop")
    found = jnp.maximum(lax.cummax(marks, axis=1), before)
    values = _values(found, lax.dynamic_slice(first, (row,), (1,)), t, start, out.dtype)
    return lax.dynamic_update_slice(out, values, (row, start))
  return lax.fori_loop(0, rows * per_row, write, out)


def _fill(out: jax.Array, row: Any, marks: jax.Array, first: jax.Array,
          t: dict[str, jax.Array], chunk: int) -> jax.Array:
  """`out` with rows `row + [0, r)` written from their `marks` (`[r, width]`;
  `first`: their first runs), `chunk` columns at a time, the running maximum
  carried across chunks."""
  rows, width = marks.shape

  def piece(start: Any, carry: jax.Array) -> tuple[jax.Array, jax.Array]:
    found = lax.cummax(lax.dynamic_slice(marks, (0, start), (rows, chunk)), axis=1)
    found = jnp.maximum(found.astype(jnp.int32), carry[:, None])
    return _values(found, first, t, start, out.dtype), found[:, -1]

  count = -(-width // chunk)
  none = jnp.zeros([rows], jnp.int32)
  if count == 1:
    return lax.dynamic_update_slice(out, piece(0, none)[0], (row, 0))
  # the last chunk ends at `width`, over the one before: its carry is that of
  # its own first column, not the previous chunk's
  last = marks[:, :width - chunk].max(axis=1).astype(jnp.int32)

  def write(i: jax.Array, carried: tuple[jax.Array, jax.Array]) -> tuple:
    out, carry = carried
    start = jnp.minimum(i * chunk, width - chunk)
    values, carry = piece(start, jnp.where(i == count - 1, last, carry))
    return lax.dynamic_update_slice(out, values, (row, start)), carry
  return lax.fori_loop(0, count, write, (out, none))[0]


def build(runs: Sequence[Run], rows: int, width: int, dtype,
          rows_per_device: int | None = None) -> jax.Array:
  """The `[rows, width]` array of `runs` (zeros outside them), traced, in
  chunks of `CHUNK` numbers per device. `rows_per_device`: the rows one
  device holds once the array is sharded, built side by side; None: a
  replicated array, built a chunk of a row at a time (`_fill_by_chunks`)."""
  runs = sorted(runs, key=lambda r: (r.row, r.start))
  out = jnp.zeros((rows, width), dtype)
  if not runs:
    return out
  if max(r.start + r.length for r in runs) > width or runs[-1].row >= rows:
    raise ValueError(f"a run ends past the [{rows}, {width}] array")
  t, first = _tables(runs), jnp.asarray(offsets.int32_table(_numbering(runs, rows)[0]))
  if rows_per_device is not None:
    chunk = min(width, max(1, CHUNK // rows_per_device))
    return _fill(out, 0, _marks(runs, rows, width), first, t, chunk)
  return _fill_by_chunks(out, runs, t, min(width, CHUNK))
