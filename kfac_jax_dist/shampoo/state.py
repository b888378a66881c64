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

from kfac_jax_dist.core import collectives as collectives_lib
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


def _group_placed(lay: ShampooLayout, stats: Any, root_segments: Any, xp=np
                  ) -> tuple[Any, Any]:
  """`placed_arrays` from each device's segments `[P, L]` of statistics and
  of roots."""
  m = lay.group_size
  groups = [root_segments[g * m:g * m + m].reshape(-1) for g in range(lay.num_groups)]
  if lay.roots_replicated:
    return stats.reshape(-1), groups[0]
  return stats.reshape(-1), xp.concatenate([groups[i // m] for i in range(lay.num_devices)])


def placed_arrays(lay: ShampooLayout, statistics: Sequence[Any], roots: Sequence[Any]
                  ) -> tuple[np.ndarray, np.ndarray]:
  """The global `(statistics [P·L], roots)` of a layout from per-bucket
  matrices (`[n, d, d]` each, host arrays): device `i` holds its own
  statistics and its group's roots (each member's segment, in member order);
  the roots are `[m·L]` with one group (stored once), `[P·m·L]` with several."""
  return _group_placed(lay, _device_segments(lay, statistics), _device_segments(lay, roots))


def _identity_segments(lay: ShampooLayout) -> jax.Array:
  """Traced `[P, L]`: the identity of its bucket's `d` in every block's
  place, zeros elsewhere, built from runs of adjacent equal blocks (`tile`),
  never as a host array (`jax.eval_shape` or `jax.jit` of a 13e9-parameter
  model's init: tens of GB)."""
  found = [[] for _ in range(lay.num_devices)]
  for j, (d, _) in enumerate(lay.buckets):
    for device, offset in lay.places[j]:
      found[device].append((offset, d))
  rows = []
  for mine in found:
    runs = []                                   # [offset, d, count]
    for offset, d in sorted(mine):
      if runs and runs[-1][1] == d and runs[-1][0] + runs[-1][2] * d * d == offset:
        runs[-1][2] += 1
      else:
        runs.append([offset, d, 1])
    pieces, at = [], 0
    for offset, d, count in runs:
      if offset > at:
        pieces.append(jnp.zeros(offset - at, jnp.float32))
      pieces.append(jnp.tile(jnp.eye(d, dtype=jnp.float32).reshape(-1), count))
      at = offset + count * d * d
    rows.append(collectives_lib.pad_to(pieces, lay.segment, jnp.float32))
  return jnp.stack(rows)


def bucket_arrays(state: ScaleByShampooState) -> tuple[tuple[np.ndarray, ...],
                                                         tuple[np.ndarray, ...]]:
  """`(statistics, roots)` of a (global) state as per-bucket `[n, d, d]` host
  arrays, whatever its distribution: the inverse of `placed_arrays`."""
  lay = state.layout
  m, length = lay.group_size, lay.segment
  stats = np.asarray(state.statistics[0]).reshape(lay.num_devices, length)
  roots = np.asarray(state.roots[0]).reshape(-1, m * length)   # one row per copy
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
  else:
    eyes = _identity_segments(lay)
  stats, roots = _group_placed(lay, eyes, eyes, xp)
  stats = ((epsilon * xp.asarray(stats, dtype)).astype(dtype),)
  roots = (xp.asarray(roots, dtype),)
  graft = tuple(xp.zeros(shape, g_dtype) for shape, g_dtype in graft_shapes)
  return ScaleByShampooState(count=xp.zeros([], jnp.int32), statistics=stats,
                             roots=roots, graft=graft, layout=lay,
                             skipped=xp.zeros([], jnp.int32))
