"""Shampoo's optimizer state: statistics, roots and grafting accumulators.

Every device stores the statistics it owns in a flat `[L]` segment and its
owner group's roots, `[m·L]` (`blocks.ShampooLayout`): on one device that is
every statistic and root; under COMM-OPT (one group of `P`) a `1/P` share of
the statistics and every root, the roots stored once, replicated; with several
groups (MEM-OPT, HYBRID-OPT) the roots are sharded too. `placed_arrays` writes
per-bucket matrices `[n, d, d]` in this form, `bucket_arrays` reads them back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kfac_jax_dist.core import initial
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
    statistics: one flat `[P·L]` array: device `i`'s `[L]` segment holds the
      `H_i` it owns (`layout.places`; `bucket_arrays` reads them per bucket of
      dimension `d` and root `p`).
    roots: the matching `(H_i + ε_ridge λ_max I)^{-1/p}`, one flat array:
      `[m·L]` replicated with one owner group, `[P·m·L]` with several, device
      `i` holding its group's `m` segments.
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
    """Statistics sharded over the axis, roots too with several owner groups,
    everything else replicated."""
    stats, roots = statistics_and_root_specs(self.layout)
    replicated = PartitionSpec()
    return dataclasses.replace(
        self, count=replicated, skipped=replicated,
        statistics=tuple(stats for _ in self.statistics),
        roots=tuple(roots for _ in self.roots),
        graft=tuple(replicated for _ in self.graft))


def statistics_and_root_specs(lay: ShampooLayout) -> tuple[PartitionSpec, PartitionSpec]:
  """The specs of the statistics (sharded over the axis) and of the roots
  (sharded with several owner groups, replicated with one)."""
  stats = PartitionSpec() if lay.axis is None else PartitionSpec(lay.axis)
  return stats, PartitionSpec() if lay.roots_replicated else stats


def _device_segments(lay: ShampooLayout, buckets: Sequence[Any]) -> np.ndarray:
  """Per-bucket matrices `[n, d, d]` → each device's statistics segment `[P, L]`."""
  dtype = np.result_type(*[np.asarray(b).dtype for b in buckets] or [np.float32])
  out = np.zeros((lay.num_devices, lay.segment), dtype)
  for j, ((d, _), bucket) in enumerate(zip(lay.buckets, buckets)):
    bucket = np.asarray(bucket)
    for i, (device, offset) in enumerate(lay.places[j]):
      out[device, offset:offset + d * d] = bucket[i].reshape(-1)
  return out


def _group_rows(lay: ShampooLayout) -> list[int]:
  """The device whose segment each `[L]` row of the global roots holds:
  the group's `m` members once (one group), or device after device its
  group's members (`placed_arrays`)."""
  m = lay.group_size
  if lay.roots_replicated:
    return list(range(m))
  return [i // m * m + k for i in range(lay.num_devices) for k in range(m)]


def _group_placed(lay: ShampooLayout, stats: np.ndarray, root_segments: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
  """`placed_arrays` from each device's segments `[P, L]` of statistics and
  of roots."""
  return stats.reshape(-1), root_segments[_group_rows(lay)].reshape(-1)


def placed_arrays(lay: ShampooLayout, statistics: Sequence[Any], roots: Sequence[Any]
                  ) -> tuple[np.ndarray, np.ndarray]:
  """The global `(statistics [P·L], roots)` of a layout from per-bucket
  matrices (`[n, d, d]` each, host arrays): device `i` holds its own
  statistics and its group's roots (each member's segment, in member order);
  the roots are `[m·L]` with one group (stored once), `[P·m·L]` with several."""
  return _group_placed(lay, _device_segments(lay, statistics), _device_segments(lay, roots))


def _identity_runs(lay: ShampooLayout) -> list[list[initial.Run]]:
  """Each device's segment as `initial` runs: the identity of its bucket's
  `d` in every block's place, adjacent blocks of one size one run."""
  places = np.array([(device, offset, d) for j, (d, _) in enumerate(lay.buckets)
                     for device, offset in lay.places[j]], np.int64).reshape(-1, 3)
  places = places[np.lexsort((places[:, 1], places[:, 0]))]
  bounds = np.searchsorted(places[:, 0], np.arange(lay.num_devices + 1))
  out = []
  for device in range(lay.num_devices):
    offsets, dims = places[bounds[device]:bounds[device + 1], 1:].T
    first = np.ones(len(dims), bool)
    first[1:] = (dims[1:] != dims[:-1]) | (offsets[1:] != offsets[:-1] + dims[:-1] ** 2)
    starts = np.flatnonzero(first)
    pieces, at = [], 0
    for start, count in zip(starts, np.diff(np.append(starts, len(dims)))):
      d = int(dims[start])
      pieces += [int(offsets[start]) - at, initial.eye(d, int(count))]
      at = int(offsets[start]) + int(count) * d * d
    out.append(initial.lay_out(pieces, 0, lay.segment))
  return out


def _identity_rows(lay: ShampooLayout, runs_of: Sequence[Sequence[initial.Run]],
                   devices: Sequence[int], per_device: int | None) -> jax.Array:
  """Traced `[len(devices)·L]`: in row `r`, device `devices[r]`'s segment
  (`runs_of`, `_identity_runs`), built elementwise (`core.initial`: never a
  host array, and under `jax.jit(..., out_shardings=...)` each device's shard
  alone; `per_device`: rows per device once sharded, None when replicated)."""
  runs = [dataclasses.replace(run, row=row) for row, device in enumerate(devices)
          for run in runs_of[device]]
  return initial.build(runs, len(devices), lay.segment, jnp.float32, per_device).reshape(-1)


def bucket_arrays(state: Any) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
  """`(statistics, roots)` of a (global) Shampoo state, `(statistics,
  eigenbases)` of a SOAP one (laid out alike), as per-bucket `[n, d, d]` host
  arrays, whatever its distribution: the inverse of `placed_arrays`."""
  lay = state.layout
  m, length = lay.group_size, lay.segment
  second = state.roots if isinstance(state, ScaleByShampooState) else state.bases
  stats = np.asarray(state.statistics[0]).reshape(lay.num_devices, length)
  roots = np.asarray(second[0]).reshape(-1, m * length)   # one row per copy
  out_stats, out_roots = [], []
  for j, (d, _) in enumerate(lay.buckets):
    s, r = [], []
    for device, offset in lay.places[j]:
      s.append(stats[device, offset:offset + d * d].reshape(d, d))
      # the root, in the copy of the group's first device
      start, row = (device % m) * length + offset, 0 if lay.roots_replicated else device // m * m
      r.append(roots[row, start:start + d * d].reshape(d, d))
    out_stats.append(np.stack(s))
    out_roots.append(np.stack(r))
  return tuple(out_stats), tuple(out_roots)


def initial_state(lay: ShampooLayout, epsilon: float, dtype: Any, graft_shapes: Sequence[
    tuple[tuple[int, ...], Any]], xp=np) -> ScaleByShampooState:
  """The state at count 0: statistics `ε I`, roots `I`, zero accumulators
  (`graft_shapes`: (shape, dtype) of each; empty without accumulators).
  `xp`: numpy for host arrays (one transfer per array), or jax.numpy when
  traced."""
  if xp is np:
    eyes = _device_segments(lay, [np.broadcast_to(np.eye(d, dtype=np.float32), (n, d, d))
                                  for (d, _), n in zip(lay.buckets, lay.sizes)])
    stats, roots = _group_placed(lay, eyes, eyes)
  else:
    runs_of = _identity_runs(lay)
    stats = _identity_rows(lay, runs_of, range(lay.num_devices), 1)
    roots = _identity_rows(lay, runs_of, _group_rows(lay),
                           None if lay.roots_replicated else lay.group_size)
  stats = ((epsilon * xp.asarray(stats, dtype)).astype(dtype),)
  roots = (xp.asarray(roots, dtype),)
  graft = tuple(xp.zeros(shape, g_dtype) for shape, g_dtype in graft_shapes)
  return ScaleByShampooState(count=xp.zeros([], jnp.int32), statistics=stats,
                             roots=roots, graft=graft, layout=lay,
                             skipped=xp.zeros([], jnp.int32))
