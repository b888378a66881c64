"""One Shampoo step on `P` devices in `P/m` owner groups: statistics, roots,
directions (Anil et al. 2020 §5 with KAISA's groups). One device (`P = 1`)
and COMM-OPT (`m = P`, one group) are cases of the same code, as are MEM-OPT
(`m = 1`) and HYBRID-OPT (between).

Every block belongs to one group (LPT on `Σ_i d_i³` and `Σ_i d_i²`), and each
of its statistics to one device of the group (`blocks.shard_layout`). A
device keeps only its own statistics, updated from the averaged gradient of
their blocks (no statistics traffic), computes their roots, and the group's
devices gather each other's roots on refresh steps (no traffic with
`m = 1`); so a device holds `1/P` of the statistics and `m/P` of the roots
(under COMM-OPT every root, stored replicated). Each step the group
preconditions its blocks (block grafting with its own norms; layer grafting
is applied after the gather, on the whole parameter) and the directions reach
every device (`core.routing.gather_from_groups`; nothing travels with one
group). The grafting accumulators stay replicated, like momentum.

With `gradient_reduction="reduce_scatter"` (SP-NGD style) the raw local
gradients of each group's blocks are reduce-scattered to it
(`core.routing.reduce_to_groups`; the others all-reduced), so no device
receives the averaged gradient of blocks it does not own. Layer grafting then
needs each parameter's `Σ‖D_b‖²`, which the groups send with their directions.

Named scopes mark each cadence's work in the HLO; refreshes run under
`lax.cond` unless their interval is the constant 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import offsets
from kfac_jax_dist.core import routing
from kfac_jax_dist.core import uneven
from kfac_jax_dist.shampoo import blocks
from kfac_jax_dist.shampoo import grafting
from kfac_jax_dist.shampoo import roots as roots_lib
from kfac_jax_dist.shampoo.config import ShampooConfig
from kfac_jax_dist.shampoo.state import ScaleByShampooState

Key = tuple[int, int]          # (parameter q, region r)
RootFn = Callable[[float, jax.Array, jax.Array], jax.Array]


def checked_roots(config: ShampooConfig, p: float, statistics: jax.Array,
                  previous: jax.Array) -> jax.Array:
  """`roots.checked_roots` of a bucket's statistics `[n, d, d]` with the
  config's root options (a failed root keeps `previous`)."""
  return roots_lib.checked_roots(
      statistics, p, previous, method=config.root_method,
      ridge_epsilon=config.ridge_epsilon, max_iterations=config.newton_max_iterations,
      tolerance=config.newton_tolerance, failure_threshold=config.root_failure_threshold)


@dataclasses.dataclass(frozen=True)
class GroupTables:
  """Static index tables of a placed layout (`blocks.shard_plan`).

  Attributes:
    blocks: `[group]` → `{(q, r): (b, …)}`, the group's blocks in parameter,
      region, block order: the order of its gradient and output buffers.
    runs: `[device]` → `(bucket j, offset, ((q, r, axis, (b, …)), …)), …`:
      per bucket, the device's statistics, `offset` their first number in its
      segment, by block and axis in slot order.
    starts: `[group]` → `{(q, r): start}` in the group's gradient buffer.
    totals: `[group]` → numbers of its gradient buffer.
    position: `[group]` → `{(q, r): {b: k}}`, block `b`'s index `k` among the
      group's blocks of region r.
  """

  blocks: tuple[dict[Key, tuple[int, ...]], ...]
  runs: tuple
  starts: tuple[dict[Key, int], ...]
  totals: tuple[int, ...]
  position: tuple[dict[Key, dict[int, int]], ...]

  @classmethod
  @functools.lru_cache(maxsize=64)
  def of(cls, lay: blocks.ShampooLayout) -> GroupTables:
    group_blocks, runs = blocks.shard_plan(lay)
    group_blocks = tuple(dict(g) for g in group_blocks)
    starts, totals = [], []
    for mine in group_blocks:
      start, total = {}, 0
      for (q, r), bs in mine.items():
        start[(q, r)] = total
        total += len(bs) * math.prod(lay.params[q].regions[r].block)
      starts.append(start)
      totals.append(total)
    position = tuple({key: {b: k for k, b in enumerate(bs)} for key, bs in mine.items()}
                     for mine in group_blocks)
    return cls(group_blocks, runs, tuple(starts), tuple(totals), position)


@dataclasses.dataclass(frozen=True)
class ShampooStep:
  """One update: the data every stage reads."""

  config: ShampooConfig
  comm: collectives_lib.Collectives
  state: ScaleByShampooState
  merged: Sequence[jax.Array | None]     # averaged gradients, merged shapes
  diag: Sequence[jax.Array]              # the grafted diagonal updates D
  dtype: Any
  segment: jax.Array | None = None       # SP-NGD: this group's reduced gradients
  compute: RootFn | None = None          # (p, statistics, previous) → roots; None:
                                         # `checked_roots` (SOAP: its eigenbases)

  @property
  def lay(self) -> blocks.ShampooLayout:
    return self.state.layout

  @functools.cached_property
  def tables(self) -> GroupTables:
    # once per step: `GroupTables.of`'s cache hashes the whole layout, and the
    # stages read the tables per block group (4 LLaMA-13B blocks, MEM-OPT at
    # P = 64: lowering the update took 291 s read each time, 20 s once)
    return GroupTables.of(self.lay)

  def numel(self, q: int, r: int) -> int:
    return math.prod(self.lay.params[q].regions[r].block)

  def all_blocks(self, x: jax.Array, q: int, r: int) -> jax.Array:
    region = self.lay.params[q].regions[r]
    return blocks.to_blocks(blocks.region_slice(x, region), region)

  def routed(self) -> ShampooStep:
    """SP-NGD: this step with each group's averaged gradients of its blocks
    only (`segment`)."""
    if not self.config.reduce_scatter:
      return self
    buffers = [collectives_lib.concat_flat([
        blocks.take(self.all_blocks(self.merged[q], q, r), bs)
        for (q, r), bs in self.tables.blocks[g].items()], self.dtype)
        for g in range(self.lay.num_groups)]
    width = routing.group_width(self.tables.totals, self.lay.group_size)
    return dataclasses.replace(
        self, segment=routing.reduce_to_groups(self.comm, buffers, width))

  def blocks_of(self, g: int, q: int, r: int) -> jax.Array:
    """Group `g`'s averaged gradient blocks of region r of parameter q,
    `[n, b₀, …]` (on a device of group `g`)."""
    bs = self.tables.blocks[g][(q, r)]
    if self.segment is not None:
      start, shape = self.tables.starts[g][(q, r)], self.lay.params[q].regions[r].block
      return self.segment[start:start + len(bs) * self.numel(q, r)].reshape(
          (len(bs),) + shape)
    return blocks.take(self.all_blocks(self.merged[q], q, r), bs)

  # -------------------------------------------------------- statistics, roots

  def device_statistics(self, device: int) -> jax.Array:
    """The device's statistics segment `[L]`, accumulated."""
    g, pieces, old_all = device // self.lay.group_size, [], self.state.statistics[0]
    for j, offset, items in self.tables.runs[device]:
      d = self.lay.buckets[j][0]
      batch = [blocks.axis_statistic(blocks.take(self.blocks_of(g, q, r), [
          self.tables.position[g][(q, r)][b] for b in bs]), a) for q, r, a, bs in items]
      n = sum(x.shape[0] for x in batch)
      old = old_all[offset:offset + n * d * d].reshape(n, d, d)
      batch = collectives_lib.concat_flat(batch, self.dtype).reshape(n, d, d)
      pieces.append(blocks.accumulate(old, batch, self.config.beta2))
    return collectives_lib.pad_to(pieces, self.lay.segment, self.dtype)

  def device_roots(self, device: int, stats: jax.Array) -> jax.Array:
    """The roots of the device's statistics, `[L]` (failed ones kept)."""
    k, pieces, length = device % self.lay.group_size, [], self.lay.segment
    for j, offset, items in self.tables.runs[device]:
      d, p = self.lay.buckets[j]
      n = sum(len(bs) for *_, bs in items)
      old = self.state.roots[0][k * length + offset:k * length + offset + n * d * d]
      compute = self.compute or functools.partial(checked_roots, self.config)
      pieces.append(compute(p, stats[offset:offset + n * d * d].reshape(n, d, d),
                            old.reshape(n, d, d)).reshape(-1))
    return collectives_lib.pad_to(pieces, length, self.dtype)

  def refreshed(self) -> tuple[jax.Array, jax.Array]:
    """(statistics `[L]`, group roots `[m·L]`) of this device after the
    cadence's refreshes."""
    config, comm, count = self.config, self.comm, self.state.count
    with jax.named_scope("shampoo_statistics"):
      stats = cadence.when_due(config.statistics_compute_steps, count,
                               lambda: comm.per_device(self.device_statistics),
                               lambda: self.state.statistics[0])
    with jax.named_scope("shampoo_roots"):
      roots = cadence.when_due(
          config.preconditioning_compute_steps, count,
          lambda: comm.gather_group(comm.per_device(lambda d: self.device_roots(d, stats))),
          lambda: self.state.roots[0], start=config.start_preconditioning_step)
    return stats, roots

  # ---------------------------------------------------------------- directions

  @property
  def layer_norms(self) -> bool:
    """Layer grafting under a reduce-scatter: the groups send each
    parameter's Σ‖D_b‖² over their blocks after their directions."""
    return (self.config.reduce_scatter and self.config.graft_type != "none"
            and self.config.grafting == "layer")

  def group_roots(self, roots: jax.Array, region: blocks.Region, axis: int,
                  bs: Sequence[int]) -> jax.Array:
    """The roots of axis `axis` of blocks `bs` of a region, `[n, d, d]`."""
    j, length, m = region.buckets[axis], self.lay.segment, self.lay.group_size
    d = self.lay.buckets[j][0]
    starts = [(device % m) * length + offset for device, offset in
              (self.lay.places[j][region.slots[axis] + b] for b in bs)]
    return collectives_lib.concat_flat(
        [roots[x:x + n * d * d] for x, n in blocks.runs(starts, d * d)], roots.dtype
    ).reshape(len(bs), d, d)

  def group_directions(self, g: int, roots: jax.Array, shampoo: bool) -> jax.Array:
    """Group `g`'s directions, flat, in its gradient buffer's order (then the
    layer norms' sums, see `layer_norms`)."""
    config, pieces = self.config, []
    sums = [jnp.zeros([plan.layers], self.dtype) for plan in self.lay.params]
    for (q, r), bs in self.tables.blocks[g].items():
      region, x = self.lay.params[q].regions[r], self.blocks_of(g, q, r)
      if not shampoo:                  # before start: D = G ("sgd", "none")
        pieces.append(x.reshape(-1))
        continue
      out = blocks.precondition_blocks(x, [self.group_roots(roots, region, a, bs)
                                           for a in range(len(region.block))])
      if config.graft_type != "none":
        target = x if config.reduce_scatter else blocks.take(self.all_blocks(
            self.diag[q].astype(self.dtype).reshape(self.lay.params[q].merged), q, r), bs)
        if config.grafting == "block":
          out = grafting.graft_blocks(out, target)
        elif self.layer_norms:
          sums[q] = sums[q] + self.layer_sums(q, r, bs, target)
      pieces.append(out.reshape(-1))
    if self.layer_norms:
      pieces.append(jnp.concatenate(sums))
    return collectives_lib.concat_flat(pieces, self.dtype)

  def layer_sums(self, q: int, r: int, bs: Sequence[int], x: jax.Array) -> jax.Array:
    """`Σ‖x_b‖²` over blocks `bs` of region r, by layer of parameter q's stack
    (`[1]` unstacked)."""
    plan = self.lay.params[q]
    if not plan.stack:
      return jnp.sum(jnp.square(x))[None]
    per_layer = math.prod(plan.regions[r].grid)
    return jax.ops.segment_sum(jnp.square(grafting.norms(x)),
                               np.array([b // per_layer for b in bs]), plan.layers)

  @functools.cached_property
  def layer_offsets(self) -> tuple[int, ...]:
    """Where each parameter's layer sums start after a group's directions."""
    return tuple(np.cumsum([0] + [plan.layers for plan in self.lay.params]).tolist())

  def assembled(self, buffers: uneven.Gathered, q: int) -> jax.Array:
    """Parameter q's merged direction from the groups' buffers."""
    plan, pieces = self.lay.params[q], {}
    for r, region in enumerate(plan.regions):
      pieces[region.index] = blocks.from_blocks(self.region_blocks(buffers, q, r), region)
    return blocks.assemble(pieces, plan)

  def region_blocks(self, buffers: uneven.Gathered, q: int, r: int) -> jax.Array:
    """Region r of parameter q's direction blocks `[n, b₀, …]`, in block order.
    Each group's blocks of the region lie together in its buffer: one slice
    per group, then, where the groups' blocks interleave, one gather into
    block order, not a slice per block (the owners deal equal blocks in order,
    `owners.assign`, so the groups' ranges usually follow one another)."""
    region, numel, held, order = self.lay.params[q].regions[r], self.numel(q, r), [], []
    for g in sorted(set(self.lay.block_groups[q][r])):
      mine, start = self.tables.blocks[g][(q, r)], self.tables.starts[g][(q, r)]
      held.append(buffers.read(g, start, len(mine) * numel))
      order += mine
    x = collectives_lib.concat_flat(held, buffers.arrays[0].dtype).reshape(
        (len(order), numel))
    if order != sorted(order):
      x = x.at[offsets.int32_table(np.argsort(order))].get(
          mode="promise_in_bounds", unique_indices=True)
    return x.reshape((region.num_blocks,) + region.block)

  def layer_grafted(self, buffers: uneven.Gathered, q: int, x: jax.Array) -> jax.Array:
    """Parameter q's merged direction `x` scaled to the grafted update's norm,
    layer by layer of a stack (`‖D‖/‖G̃‖` per layer)."""
    layers = self.lay.params[q].layers
    if self.layer_norms:
      start = self.layer_offsets[q]
      target = jnp.sqrt(sum(buffers.read(g, self.tables.totals[g] + start, layers)
                            for g in range(self.lay.num_groups)))
    else:
      target = grafting.norms(self.diag[q].astype(self.dtype).reshape(layers, -1))
    rows = x.reshape(layers, -1)
    return (rows * grafting.graft_scale(target, grafting.norms(rows))[:, None]
            ).reshape(x.shape)

  def gathered(self, roots: jax.Array, shampoo: bool, pre: Sequence[int]
               ) -> list[jax.Array]:
    """Every preconditioned parameter's direction (Shampoo's, or before the
    start step the grafted one), on every device."""
    sizes = [t + (self.layer_offsets[-1] if self.layer_norms else 0)
             for t in self.tables.totals]
    buffers = routing.gather_from_groups(
        self.comm, lambda g: self.group_directions(g, roots, shampoo), sizes, self.dtype)
    out = []
    for q in pre:
      x = self.assembled(buffers, q)
      if shampoo and self.config.graft_type != "none" and self.config.grafting == "layer":
        x = self.layer_grafted(buffers, q, x)
      out.append(x.reshape(self.lay.params[q].shape))
    # as varying as the grafted branch (under a reduce-scatter: invariant)
    return _compat.as_varying(out, () if self.config.reduce_scatter else
                              _compat.varying_axes([self.diag[q] for q in pre]))


def update(config: ShampooConfig, comm: collectives_lib.Collectives,
           state: ScaleByShampooState, merged: Sequence[jax.Array | None],
           diag: Sequence[jax.Array], dtype: Any
           ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], list[jax.Array]]:
  """New statistics and roots (this device's parts) and the directions of the
  preconditioned parameters (whole, on every device; before the start step
  the grafted updates `diag`)."""
  pre = [q for q, plan in enumerate(state.layout.params) if plan.preconditioned]
  if not pre:
    return state.statistics, state.roots, []
  step = ShampooStep(config, comm, state, merged, diag, dtype).routed()
  stats, roots = step.refreshed()
  start = config.start_preconditioning_step

  def graft_branch() -> list[jax.Array]:
    if config.reduce_scatter:
      return step.gathered(roots, False, pre)
    return [diag[q].astype(dtype) for q in pre]

  with jax.named_scope("shampoo_precondition"):
    if cadence.is_number(start) and start == 0:
      directions = step.gathered(roots, True, pre)
    else:
      directions = lax.cond(state.count >= cadence.value_at(start, state.count),
                            lambda: step.gathered(roots, True, pre), graft_branch)
  return (stats,), (roots,), directions
