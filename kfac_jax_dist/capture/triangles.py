"""Symmetric matrices ↔ their upper triangles (row by row, `d(d+1)/2` numbers).

The packed form of a full Kronecker factor: K-FAC stores its running factors
so (`kfac.packing`), and the capture delivers a full statistic so when the
state stores packed factors (`capture.statistics.PACKED`), packing each
layer's statistic inside its capture conditional. Indices of large triangles
are computed in the program, not held as constants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Index arrays up to this many numbers (int32, 2 MB) are program constants: a
# gather by constant indices is several times quicker on CPU than one whose
# indices are computed in its own loop (PERF_NOTES §7). Larger ones are
# computed in the program.
CONSTANT_INDICES = 2 ** 19
# The widest packed factor: `row_starts(i, d)` of every row in int32 (`i·d`
# below 2^31 with room for `packed_rows`' corrections). `kfac.layout` refuses
# wider full factors at `init`.
MAX_PACKED_DIM = 30000


def packed_size(d):
  """Numbers in the upper triangle of a `d × d` matrix, `d(d+1)/2` (Python,
  numpy or jax integers; the halving is a shift)."""
  return (d * (d + 1)) >> 1


def row_starts(rows, d: int):
  """Where row `i` of a `d × d` upper triangle starts in its packed form:
  `i·d − i(i−1)/2` (numpy or jax integers; the halving is a shift, exact as
  `i(i−1) ≥ 0` for every integer `i`)."""
  return rows * d - ((rows * (rows - 1)) >> 1)


def packed_rows(k: jax.Array, dim: jax.Array) -> jax.Array:
  """The row `i` of entry `k` of a row-major `dim × dim` upper triangle
  (`i·dim − i(i−1)/2 ≤ k`), elementwise. Counted from the triangle's end
  (row `dim − 1 − j` starts `j(j+1)/2` entries before it), the quadratic
  formula has no cancellation in float32; one integer correction either way
  then makes it exact (`dim` up to 30000: int32 starts)."""
  k, dim = jnp.asarray(k, jnp.int32), jnp.asarray(dim, jnp.int32)
  from_end = (packed_size(dim) - 1 - k).astype(jnp.float32)
  j = jnp.floor((jnp.sqrt(8.0 * from_end + 1.0) - 1.0) / 2).astype(jnp.int32)
  i = jnp.clip(dim - 1 - j, 0, dim - 1)
  i = jnp.where((i + 1 < dim) & (row_starts(i + 1, dim) <= k), i + 1, i)
  return jnp.where(row_starts(i, dim) > k, i - 1, i)


def _traced_upper_positions(d: int) -> jax.Array:
  """Where entry `k` of the upper triangle sits in the flattened `d × d`
  matrix: `k` plus the `i(i+1)/2` numbers below the diagonal in rows `0..i`
  (row `i` by `packed_rows`), computed in the program from an iota: as
  constants, the positions of a 6401-wide factor would be 82 MB of the
  program itself."""
  if d > MAX_PACKED_DIM:
    raise ValueError(f"packed factors support dimensions up to {MAX_PACKED_DIM} (int32 "
                     f"indices), got {d}: set max_factor_dim")
  k = lax.iota(jnp.int32, packed_size(d))
  i = packed_rows(k, d)
  return k + packed_size(i)


def _constant_indices(x, count: int) -> bool:
  """Whether an index array of `count` numbers into `x` is a numpy constant
  (always for host arrays; up to `CONSTANT_INDICES` numbers for traced ones)."""
  return isinstance(x, np.ndarray) or count <= CONSTANT_INDICES


def pack_upper(x: jax.Array) -> jax.Array:
  """`[..., d, d]` symmetric → its upper triangle, `[..., d(d+1)/2]`: a gather
  from the flattened matrix by one position per entry (constant, or past
  `CONSTANT_INDICES` computed in the program)."""
  d = x.shape[-1]
  if _constant_indices(x, packed_size(d)):
    rows, cols = np.triu_indices(d)
    positions = (rows * d + cols).astype(np.int32)
  else:
    positions = _traced_upper_positions(d)
  return x.reshape(x.shape[:-2] + (d * d,))[..., positions]


def unpack_upper(v: jax.Array, d: int) -> jax.Array:
  """Inverse of `pack_upper` (a gather: entry (i, j) reads (min, max)); past
  `CONSTANT_INDICES` its `d × d` positions are computed in the program."""
  xp = np if _constant_indices(v, d * d) else jnp
  i = xp.arange(d, dtype=np.int32)
  lo, hi = xp.minimum(i[:, None], i[None, :]), xp.maximum(i[:, None], i[None, :])
  return v[..., row_starts(lo, d) + hi - lo]
