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

# Triangles up to this many numbers index with constants (as small as the
# computation that replaces them, and quicker to compile); larger ones compute
# their indices in the program.
CONSTANT_INDICES = 2 ** 16


def packed_size(d: int) -> int:
  """Numbers in the upper triangle of a `d × d` matrix."""
  return d * (d + 1) // 2


def row_starts(rows, d: int):
  """Where row `i` of a `d × d` upper triangle starts in its packed form:
  `i·d − i(i−1)/2` (numpy or jax integers)."""
  return rows * d - (rows * (rows - 1)) // 2


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


def _traced_upper_indices(d: int) -> tuple[jax.Array, jax.Array]:
  """`np.triu_indices(d)` computed in the program from an iota: as constants,
  the indices of a 6401-wide factor would be 330 MB of the program itself.
  Row `i` of entry `k` by `packed_rows`, column `k − start(i) + i`."""
  if d > 30000:
    raise ValueError(f"packed factors support dimensions up to 30000 (int32 "
                     f"indices), got {d}: set max_factor_dim")
  k = lax.iota(jnp.int32, packed_size(d))
  i = packed_rows(k, d)
  return i, k - row_starts(i, d) + i


def _constant_indices(x, d: int) -> bool:
  """Whether `x`'s triangle of width `d` is indexed with numpy constants (host
  arrays, and triangles of at most `CONSTANT_INDICES` numbers)."""
  return isinstance(x, np.ndarray) or packed_size(d) <= CONSTANT_INDICES


def pack_upper(x: jax.Array) -> jax.Array:
  """`[..., d, d]` symmetric → its upper triangle, `[..., d(d+1)/2]`; past
  `CONSTANT_INDICES`, a gather from the flattened matrix by one index per
  entry, computed in the program (a (row, column) pair per entry held twice
  the bytes: 85 MB for a 4608-wide factor)."""
  d = x.shape[-1]
  if _constant_indices(x, d):
    rows, cols = (r.astype(np.int32) for r in np.triu_indices(d))
    return x[..., rows, cols]
  rows, cols = _traced_upper_indices(d)
  return x.reshape(x.shape[:-2] + (d * d,))[..., rows * d + cols]


def unpack_upper(v: jax.Array, d: int) -> jax.Array:
  """Inverse of `pack_upper` (a gather: entry (i, j) reads (min, max)); for a
  large `d` its positions are computed in the program (no `d × d` constant)."""
  xp = np if _constant_indices(v, d) else jnp
  i = xp.arange(d, dtype=np.int32)
  lo, hi = xp.minimum(i[:, None], i[None, :]), xp.maximum(i[:, None], i[None, :])
  return v[..., row_starts(lo, d) + hi - lo]
