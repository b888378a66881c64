"""int32 offsets: the limit of JAX's index type, checked where it matters.

Every dynamic index JAX lowers (a `dynamic_slice` offset, a gather index, a
per-device table read by `lax.axis_index`) is int32. Past 2³¹ an offset
wraps, and XLA clamps the read or write to another place: a silently wrong
step. So one device's flat state arrays are kept within int32
(`check_sizes` at init, naming what to change), arrays over all devices are
indexed as (device, column), and the per-device tables are built by
`int32_table`, which raises instead of wrapping (numpy's int64 → int32 cast
wraps silently).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np

INT32_MAX = 2 ** 31 - 1


def check_sizes(sizes: Mapping[str, int], advice: str) -> None:
  """Raises a `ValueError` naming the first of one device's flat state arrays
  (`sizes`: words → numbers) past int32 offsets, with `advice`."""
  for what, size in sizes.items():
    if size > INT32_MAX:
      raise ValueError(f"One device's {what} {size:,} numbers, more than int32 offsets "
                       f"reach (2^31 - 1): {advice}")


def int32_table(values: Sequence[int] | np.ndarray) -> np.ndarray:
  """`values` as an int32 array of indices or offsets; a `ValueError` where
  one passes int32, instead of numpy's silent wrap."""
  wide = np.asarray(values, np.int64)
  if wide.size and (wide.max() > INT32_MAX or wide.min() < -INT32_MAX - 1):
    raise ValueError(f"An index table holds {int(np.abs(wide).max()):,}, past the int32 "
                     "offsets JAX indexes with: a per-device segment or buffer is too "
                     "long (spread the state over more devices).")
  return wide.astype(np.int32)


def segment_at(flat: jax.Array, length: int, index: jax.Array) -> jax.Array:
  """`flat[index·length : (index + 1)·length]` for a traced `index`, read as
  (row, column) of `flat` viewed `[-1, length]`: the flat offset would pass
  int32 on arrays over many devices (GPT-2-XL's: 2.6e9 numbers)."""
  return jax.lax.dynamic_index_in_dim(flat.reshape(-1, length), index, keepdims=False)
