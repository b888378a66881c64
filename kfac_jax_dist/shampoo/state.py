"""Shampoo's optimizer state: statistics, roots and grafting accumulators.

On one device and with one owner group (COMM-OPT) the statistics and roots
are per-bucket arrays `[n, d, d]` (`blocks.ShampooLayout`), the same on every
device; with several owner groups (MEM-OPT, HYBRID-OPT) each device stores its
own statistics in a flat `[L]` segment and its group's roots, `[m·L]`
(`sharded_arrays`, `bucket_arrays` read either form back per bucket).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kfac_jax_dist.core import states
from kfac_jax_dist.shampoo.blocks import ShampooLayout


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "statistics", "roots", "graft", "skipped"],
    meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ScaleByShampooState(states.PreconditionerState):
  """State of `scale_by_shampoo`.

  Attributes:
    count: number of updates so far (skipped ones excluded).
    statistics: one `[n, d, d]` array per bucket of `layout`: the `H_i` of every
      block axis of dimension `d` and root `p`. Sharded layouts: one flat
      `[P·L]` array, device `i`'s `[L]` segment holding its own statistics
      (`layout.places`); `bucket_arrays` reads either form.
    roots: the matching `(H_i + ε_ridge λ_max I)^{-1/p}`, same shapes; sharded:
      `[P·m·L]`, device `i` holding its group's `m` segments.
    graft: the grafting accumulators (`S` or `v`), one per parameter leaf in
      tree order; empty for "sgd" and "none".
    skipped: number of updates skipped for a non-finite gradient, statistic
      or produced update (see `core.faults`).
    layout: static placement of every block's statistics.
  """

  count: jax.Array
  statistics: tuple[jax.Array, ...]
  roots: tuple[jax.Array, ...]
  graft: tuple[jax.Array, ...]
  skipped: jax.Array
  layout: ShampooLayout

  def partition_specs(self) -> ScaleByShampooState:
    """Statistics and roots sharded over the axis when the layout is sharded,
    everything else replicated."""
    replicated = PartitionSpec()
    sharded = PartitionSpec(self.layout.axis) if self.layout.sharded else replicated
    return dataclasses.replace(
        self, count=replicated, skipped=replicated,
        statistics=tuple(sharded for _ in self.statistics),
        roots=tuple(sharded for _ in self.roots),
        graft=tuple(replicated for _ in self.graft))


def _device_segments(lay: ShampooLayout, buckets: Sequence[Any]) -> np.ndarray:
  """Per-bucket matrices `[n, d, d]` → each device's statistics segment `[P, L]`."""
  dtype = np.result_type(*[np.asarray(b).dtype for b in buckets] or [np.float32])
  out = np.zeros((lay.num_devices, lay.segment), dtype)
  for j, ((d, _), bucket) in enumerate(zip(lay.buckets, buckets)):
    bucket = np.asarray(bucket)
    for i, (device, offset) in enumerate(lay.places[j]):
      out[device, offset:offset + d * d] = bucket[i].reshape(-1)
  return out


def sharded_arrays(lay: ShampooLayout, statistics: Sequence[Any], roots: Sequence[Any]
                   ) -> tuple[np.ndarray, np.ndarray]:
  """The global `(statistics [P·L], roots [P·m·L])` of a sharded layout from
  per-bucket matrices (`[n, d, d]` each, host arrays): device `i` holds its own
  statistics and its group's roots (each member's segment, in member order)."""
  m = lay.group_size
  stats, root_segments = _device_segments(lay, statistics), _device_segments(lay, roots)
  groups = [root_segments[i // m * m:i // m * m + m].reshape(-1)
            for i in range(lay.num_devices)]
  return stats.reshape(-1), np.concatenate(groups)


def bucket_arrays(state: ScaleByShampooState) -> tuple[tuple[np.ndarray, ...],
                                                         tuple[np.ndarray, ...]]:
  """`(statistics, roots)` of a (global) state as per-bucket `[n, d, d]` host
  arrays, whatever its distribution: the single-device form."""
  lay = state.layout
  if not lay.sharded:
    return (tuple(np.asarray(x) for x in state.statistics),
            tuple(np.asarray(x) for x in state.roots))
  m, length = lay.group_size, lay.segment
  stats = np.asarray(state.statistics[0]).reshape(lay.num_devices, length)
  roots = np.asarray(state.roots[0]).reshape(lay.num_devices, m * length)
  out_stats, out_roots = [], []
  for j, (d, _) in enumerate(lay.buckets):
    s, r = [], []
    for device, offset in lay.places[j]:
      s.append(stats[device, offset:offset + d * d].reshape(d, d))
      # the root, in the part of the group's first device
      start = (device % m) * length + offset
      r.append(roots[device // m * m, start:start + d * d].reshape(d, d))
    out_stats.append(np.stack(s))
    out_roots.append(np.stack(r))
  return tuple(out_stats), tuple(out_roots)


def initial_state(lay: ShampooLayout, epsilon: float, dtype: Any, graft_shapes: Sequence[
    tuple[tuple[int, ...], Any]], xp=np) -> ScaleByShampooState:
  """The state at count 0: statistics `ε I`, roots `I`, zero accumulators
  (`graft_shapes`: (shape, dtype) of each; empty without accumulators).
  `xp`: numpy for host arrays (one transfer per array), or jax.numpy when
  traced."""
  if lay.sharded:
    eyes = [np.broadcast_to(np.eye(d, dtype=np.float32), (n, d, d))
            for (d, _), n in zip(lay.buckets, lay.sizes)]
    stats, roots = sharded_arrays(lay, eyes, eyes)
    stats = ((epsilon * xp.asarray(stats, dtype)).astype(dtype),)
    roots = (xp.asarray(roots, dtype),)
  else:
    stats = tuple((epsilon * xp.broadcast_to(xp.eye(d, dtype=dtype), (n, d, d))
                   ).astype(dtype) for (d, _), n in zip(lay.buckets, lay.sizes))
    roots = tuple(xp.broadcast_to(xp.eye(d, dtype=dtype), (n, d, d))
                  for (d, _), n in zip(lay.buckets, lay.sizes))
  graft = tuple(xp.zeros(shape, g_dtype) for shape, g_dtype in graft_shapes)
  return ScaleByShampooState(count=xp.zeros([], jnp.int32), statistics=stats,
                             roots=roots, graft=graft, layout=lay,
                             skipped=xp.zeros([], jnp.int32))
