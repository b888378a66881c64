"""Shampoo's blocks: how each parameter is cut, and the math on a batch of blocks.

Shapes (Anil et al. 2020, §5; Google's `distributed_shampoo`):

1. `merge_small_dims`: size-1 axes are dropped and consecutive axes are merged
   while their product stays ≤ the threshold (e.g. a `(3, 3, 32, 64)` conv
   kernel with threshold 128 becomes `(9, 32, 64)`), so `k` is the order of the
   merged tensor.
2. Blocking: every merged axis longer than `block_size` is cut into blocks of
   `block_size` plus one smaller last block when the length is not a multiple
   (exact: no padding). Each block of order `k` has its own `k` statistics.
3. Parameters of rank < 2, empty ones (a zero-size axis), those with a
   merged axis longer than `max_preconditioner_dim`, and those matching
   `skip` use the grafted diagonal method only. (A rank-≥2 parameter whose merged shape has one axis
   is preconditioned as an order-1 tensor: full-matrix AdaGrad, `p = 2`.)

Statistics of equal dimension `d` and equal root `p` are stacked into one
bucket `[n, d, d]` (`ShampooLayout`), so each refresh runs one batched root per
bucket. A placed layout (`shard_layout`) also assigns every block to an owner
group and every statistic to one device of it (`core.owners`): one device and
COMM-OPT are the cases of one group. The block math
(`axis_statistics`, `precondition_blocks`) works on batches `[n, b₀, …]`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist.core import offsets
from kfac_jax_dist.core import owners

_HI = lax.Precision.HIGHEST


# ---------------------------------------------------------------- static layout

@dataclasses.dataclass(frozen=True)
class Region:
  """A grid of equal blocks inside a merged parameter.

  Attributes:
    index: the segment of each axis (0: the whole blocks, 1: the smaller last
      block), used to put the regions back together.
    start: first element of the region on each axis.
    grid: number of blocks along each axis; the blocks are numbered row-major.
    block: the block shape.
    buckets: for each axis, the bucket holding the statistics of its blocks.
    slots: for each axis, the slot of the region's first block in that bucket
      (the region's `num_blocks` blocks follow contiguously).
    stack: a stacked parameter's stack length `S` (0: not stacked). The
      fields above then describe one layer of the stack, the merged
      parameter is `[S, …]`, and its blocks are numbered layer-major: block
      `b` belongs to layer `b // prod(grid)`.
  """

  index: tuple[int, ...]
  start: tuple[int, ...]
  grid: tuple[int, ...]
  block: tuple[int, ...]
  buckets: tuple[int, ...]
  slots: tuple[int, ...]
  stack: int = 0

  @property
  def num_blocks(self) -> int:
    return max(self.stack, 1) * math.prod(self.grid)

  @property
  def lead(self) -> tuple[int, ...]:
    """The merged parameter's leading stack axis `(S,)`, or `()`."""
    return (self.stack,) if self.stack else ()


@dataclasses.dataclass(frozen=True)
class ParamPlan:
  """How one parameter is preconditioned.

  Attributes:
    path: the parameter's path ("layer/kernel").
    shape: its shape.
    merged: the shape after `merge_small_dims`; None for a parameter that gets
      the grafted diagonal update only. A stacked parameter's is `(S, …)`:
      its stack axes as one, then one layer's merged shape.
    segments: for each merged axis, the number of segments (1 or 2).
    regions: the regions of equal blocks, in row-major segment order.
    exponent: `p` of the roots `H^{-1/p}`.
    stack: the stack length `S` of a parameter whose leading axes are a
      stack of layers (`stacked=`), each layer preconditioned as its own
      parameter; 0: not stacked.
  """

  path: str
  shape: tuple[int, ...]
  merged: tuple[int, ...] | None
  segments: tuple[int, ...] = ()
  regions: tuple[Region, ...] = ()
  exponent: float = 0
  stack: int = 0

  @property
  def preconditioned(self) -> bool:
    return self.merged is not None

  @property
  def layers(self) -> int:
    """The layers whose blocks are preconditioned apart: the stack's `S`, or 1."""
    return max(self.stack, 1)


@dataclasses.dataclass(frozen=True)
class ShampooLayout:
  """Static placement of every statistic: one bucket `[n, d, d]` per `(d, p)`.

  The buckets are the logical placement, the same for every distribution. A
  placed layout (`shard_layout`: `P/m` owner groups, one on one device and
  under COMM-OPT) also says which group owns each block and where each
  statistic lives: device `i` stores the statistics it owns in a flat `[L]`
  segment (`segment`) and its group's roots, the `m` segments of its members
  one after the other, `[m·L]`.

  Attributes:
    params: one plan per parameter leaf, in tree-flattening order.
    buckets: `(d, p)` of each bucket.
    sizes: the number of matrices in each bucket.
    num_devices, group_size, axis: `P`, `m` and the mesh axis (1, 1, None on
      one device).
    block_groups: placed only: `[param][region]` → the owner group of each
      block (row-major), () for a diagonal parameter.
    places: placed only: `[bucket][slot]` → `(device, offset)`: the device
      that owns the statistic (and computes its root) and its offset in that
      device's segment.
    segment: placed only: `L`, the longest device's statistics (numbers).
  """

  params: tuple[ParamPlan, ...]
  buckets: tuple[tuple[int, float], ...]
  sizes: tuple[int, ...]
  num_devices: int = 1
  group_size: int = 1
  axis: str | None = None
  block_groups: tuple[tuple[tuple[int, ...], ...], ...] = ()
  places: tuple[tuple[tuple[int, int], ...], ...] = ()
  segment: int = 0

  @property
  def num_groups(self) -> int:
    return self.num_devices // self.group_size

  @property
  def roots_replicated(self) -> bool:
    """One owner group: every device holds every root (the group's `[m·L]`),
    so the roots are stored once, replicated, not once per device."""
    return self.num_groups == 1


def merge_small_dims(shape: Sequence[int], threshold: int | None) -> tuple[int, ...]:
  """Drops size-1 axes and merges consecutive axes while their product is at
  most `threshold` (None or 0: no merging). `(3, 3, 32, 64)`, 128 →
  `(9, 32, 64)`; `(1, 2, 768, 1, 2048)`, 1024 → `(2, 768, 2048)`."""
  dims = [int(d) for d in shape if d != 1]
  if not threshold:
    return tuple(dims)
  out, acc = [], None
  for d in dims:
    if acc is not None and acc * d <= threshold:
      acc *= d
    else:
      if acc is not None:
        out.append(acc)
      acc = d
  if acc is not None:
    out.append(acc)
  return tuple(out)


def _axis_segments(n: int, block_size: int | None) -> list[tuple[int, int, int]]:
  """`(start, number of blocks, block length)` of the segments of an axis."""
  if block_size is None or n <= block_size:
    return [(0, 1, n)]
  whole, rest = divmod(n, block_size)
  segments = [(0, whole, block_size)]
  if rest:
    segments.append((whole * block_size, 1, rest))
  return segments


def stack_axes(path: str, shape: Sequence[int], stacked: Sequence[tuple[str, int]]) -> int:
  """How many leading axes of the parameter at `path` are stack axes: those of
  the `stacked` patterns (`(pattern, axes)`, `re.search`) that match it."""
  found = sorted({n for pattern, n in stacked if re.search(pattern, path)})
  if len(found) > 1:
    raise ValueError(f"stacked: the patterns that match {path!r} give it {found} stack "
                     "axes; give each parameter one number.")
  n = found[0] if found else 0
  if n > len(shape):
    raise ValueError(f"stacked: {path!r} has shape {tuple(shape)}, fewer axes than its "
                     f"{n} stack axes.")
  return n


def build_layout(paths_and_shapes: Sequence[tuple[str, tuple[int, ...]]], *,
                 block_size: int | None, merge_threshold: int | None,
                 max_preconditioner_dim: int | None, exponent_override: float | None,
                 skip: Sequence[str] = (), stacked: Sequence[tuple[str, int]] = ()
                 ) -> ShampooLayout:
  """The static layout of the statistics of parameters with these paths and
  shapes. A stacked parameter's layers (its shape past the stack axes) are
  each merged, cut and preconditioned as a parameter of their own."""
  bucket_index: dict[tuple[int, float], int] = {}
  sizes: list[int] = []
  plans = []
  for path, shape in paths_and_shapes:
    n = stack_axes(path, shape, stacked)
    layer, stack = tuple(shape[n:]), (math.prod(shape[:n]) if n else 0)
    merged = merge_small_dims(layer, merge_threshold)
    diagonal = (len(layer) < 2 or not merged or 0 in shape
                or any(re.search(s, path) for s in skip)
                or (max_preconditioner_dim is not None
                    and max(merged) > max_preconditioner_dim))
    if diagonal:
      plans.append(ParamPlan(path, tuple(shape), None))
      continue
    p = 2 * len(merged)
    if exponent_override:
      p = (int(exponent_override) if float(exponent_override).is_integer()
           else float(exponent_override))
    per_axis = [_axis_segments(d, block_size) for d in merged]
    regions = []
    for index in itertools.product(*(range(len(s)) for s in per_axis)):
      segs = [per_axis[a][i] for a, i in enumerate(index)]
      grid = tuple(s[1] for s in segs)
      block = tuple(s[2] for s in segs)
      buckets, slots = [], []
      for d in block:
        j = bucket_index.setdefault((d, p), len(bucket_index))
        if j == len(sizes):
          sizes.append(0)
        buckets.append(j)
        slots.append(sizes[j])
        sizes[j] += max(stack, 1) * math.prod(grid)
      regions.append(Region(tuple(index), tuple(s[0] for s in segs), grid, block,
                            tuple(buckets), tuple(slots), stack))
    plans.append(ParamPlan(path, tuple(shape), ((stack,) if n else ()) + merged,
                           tuple(len(s) for s in per_axis), tuple(regions), p, stack))
  buckets = [None] * len(bucket_index)
  for key, j in bucket_index.items():
    buckets[j] = key
  return ShampooLayout(tuple(plans), tuple(buckets), tuple(sizes))


def shard_layout(lay: ShampooLayout, num_devices: int, group_size: int,
                 axis: str | None) -> ShampooLayout:
  """`lay` with its blocks assigned to `P/m` owner groups and their statistics
  to the groups' devices (KAISA's HYBRID-OPT; MEM-OPT for `m = 1`, COMM-OPT
  for `m = P`, one device for `P = 1`).

  Blocks go to groups by the layout's two-criteria LPT, balancing the root
  cost `Σ_i d_i³` and the numbers stored `Σ_i d_i²`; a group's statistics go
  to its `m` devices the same way (`d³`, `d²`). A device's statistics are
  stored bucket by bucket, each bucket's in slot order.
  """
  lay = dataclasses.replace(lay, num_devices=num_devices, group_size=group_size,
                            axis=axis)
  blocks = [(q, r, b) for q, plan in enumerate(lay.params)
            for r, region in enumerate(plan.regions) for b in range(region.num_blocks)]
  dims = lambda t: lay.params[t[0]].regions[t[1]].block
  group_bins = owners.assign(blocks, lay.num_groups,
                                 lambda t: float(sum(d ** 3 for d in dims(t))),
                                 lambda t: float(sum(d * d for d in dims(t))))
  group_of = {t: g for g, members in enumerate(group_bins) for t in members}
  block_groups = tuple(
      tuple(tuple(group_of[(q, r, b)] for b in range(region.num_blocks))
            for r, region in enumerate(plan.regions))
      for q, plan in enumerate(lay.params))
  owner = {}
  for g, members in enumerate(group_bins):
    stats = [(region.buckets[a], region.slots[a] + b)
             for q, r, b in sorted(members)
             for region in [lay.params[q].regions[r]] for a in range(len(region.block))]
    bins = owners.assign(stats, group_size,
                             lambda t: float(lay.buckets[t[0]][0]) ** 3,
                             lambda t: float(lay.buckets[t[0]][0]) ** 2)
    for k, mine in enumerate(bins):
      for t in mine:
        owner[t] = g * group_size + k
  offsets, places = [0] * num_devices, [[None] * n for n in lay.sizes]
  for j, n in enumerate(lay.sizes):
    d = lay.buckets[j][0]
    for i in range(n):
      device = owner[(j, i)]
      places[j][i] = (device, offsets[device])
      offsets[device] += d * d
  return dataclasses.replace(lay, block_groups=block_groups,
                             places=tuple(tuple(p) for p in places),
                             segment=max(max(offsets), 1))


@functools.lru_cache(maxsize=64)
def shard_plan(lay: ShampooLayout):
  """Static index tables of a placed layout (see `ShampooLayout`).

  Returns:
    group_blocks: `[group]` → `((q, r), (b, …)), …`: the group's blocks, in
      parameter, region, block order: the order of its gradient and output
      buffers.
    device_runs: `[device]` → `(j, offset, ((q, r, axis, (b, …)), …)), …`:
      per bucket, the device's statistics, `offset` their first number in its
      segment, by block and axis in slot order.
  """
  group_blocks = [{} for _ in range(lay.num_groups)]
  for q, plan in enumerate(lay.params):
    for r, groups in enumerate(lay.block_groups[q]):
      for b, g in enumerate(groups):
        group_blocks[g].setdefault((q, r), []).append(b)
  runs = [{} for _ in range(lay.num_devices)]
  for q, plan in enumerate(lay.params):
    for r, region in enumerate(plan.regions):
      for a, (j, s) in enumerate(zip(region.buckets, region.slots)):
        for b in range(region.num_blocks):
          device, offset = lay.places[j][s + b]
          run = runs[device].setdefault(j, [offset, []])
          if run[1] and run[1][-1][:3] == (q, r, a):
            run[1][-1][3].append(b)
          else:
            run[1].append((q, r, a, [b]))
  freeze = lambda items: tuple((q, r, a, tuple(bs)) for q, r, a, bs in items)
  return (tuple(tuple((k, tuple(v)) for k, v in gb.items()) for gb in group_blocks),
          tuple(tuple((j, run[0], freeze(run[1])) for j, run in sorted(device.items()))
                for device in runs))


def runs(positions: Sequence[int], step: int) -> list[tuple[int, int]]:
  """`(first position, count)` of the maximal runs of `positions` that advance
  by `step`."""
  out = []
  for x in positions:
    if out and out[-1][0] + out[-1][1] * step == x:
      out[-1] = (out[-1][0], out[-1][1] + 1)
    else:
      out.append((x, 1))
  return out


TAKE_SLICES = 4     # more runs than this: one gather, not a slice per run


def take(x: jax.Array, index: Sequence[int]) -> jax.Array:
  """`x[index]` for a static increasing `index`: slices of its runs, or past
  `TAKE_SLICES` runs one gather (a slice per block was most of a large
  model's program when owners dealt equal blocks round-robin: 51840 slices
  of one LLaMA-13B layer; they now deal them in order, `owners.assign`, and a
  device's blocks of a region are one run)."""
  spans = runs(index, 1)
  if len(spans) > TAKE_SLICES:
    return x.at[offsets.int32_table(index)].get(
        mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)
  parts = [lax.slice_in_dim(x, start, start + n) for start, n in spans]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


# ----------------------------------------------------------------- block math

def region_slice(x: jax.Array, region: Region) -> jax.Array:
  """The region of a merged parameter (of every layer of a stacked one)."""
  stop = tuple(s + g * b for s, g, b in zip(region.start, region.grid, region.block))
  return lax.slice(x, (0,) * len(region.lead) + region.start, region.lead + stop)


def to_blocks(x: jax.Array, region: Region) -> jax.Array:
  """Region `([S,] g₀b₀, …)` → blocks `[n, b₀, …]`, blocks numbered row-major
  (layer-major for a stack: `n = S·Πgᵢ`)."""
  k, lead = len(region.grid), len(region.lead)
  split = x.reshape(region.lead + tuple(itertools.chain(*zip(region.grid, region.block))))
  order = (tuple(range(lead)) + tuple(range(lead, lead + 2 * k, 2))
           + tuple(range(lead + 1, lead + 2 * k, 2)))
  return split.transpose(order).reshape((region.num_blocks,) + region.block)


def from_blocks(blocks: jax.Array, region: Region) -> jax.Array:
  """Blocks `[n, b₀, …]` → the region `([S,] g₀b₀, …)` (`to_blocks` undone)."""
  k, lead = len(region.grid), len(region.lead)
  split = blocks.reshape(region.lead + region.grid + region.block)
  order = tuple(range(lead)) + tuple(
      itertools.chain(*((lead + a, lead + a + k) for a in range(k))))
  return split.transpose(order).reshape(
      region.lead + tuple(g * b for g, b in zip(region.grid, region.block)))


def assemble(pieces: dict[tuple[int, ...], jax.Array], plan: ParamPlan) -> jax.Array:
  """Concatenates the regions back into the merged parameter."""
  lead, segments = int(plan.stack > 0), plan.segments

  def build(prefix: tuple[int, ...]) -> jax.Array:
    axis = len(prefix)
    if axis == len(segments):
      return pieces[prefix]
    parts = [build(prefix + (i,)) for i in range(segments[axis])]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=lead + axis)
  return build(())


def axis_statistics(blocks: jax.Array) -> list[jax.Array]:
  """`G_(i) G_(i)ᵀ` for every axis `i` of a batch of blocks `[n, b₀, …, b_{k−1}]`:
  `[n, b_i, b_i]`, contracting over all the other axes."""
  return [axis_statistic(blocks, i) for i in range(blocks.ndim - 1)]


def axis_statistic(blocks: jax.Array, i: int) -> jax.Array:
  """`G_(i) G_(i)ᵀ` of axis `i` alone (see `axis_statistics`)."""
  y = jnp.moveaxis(blocks, i + 1, 1).reshape(blocks.shape[0], blocks.shape[i + 1], -1)
  return jnp.einsum("nir,njr->nij", y, y, precision=_HI)


def accumulate(old: jax.Array, batch: jax.Array, beta2: float) -> jax.Array:
  """`H ← β₂ H + w G_(i)G_(i)ᵀ` for a bucket `[n, d, d]`: `w = 1 − β₂`, or 1 for
  `β₂ = 1` (the sum, AdaGrad-like), in `old`'s dtype (a `β₂` injected as a
  float32 array by `optax.inject_hyperparams` does not promote bfloat16)."""
  weight = jnp.where(jnp.asarray(beta2) == 1.0, 1.0, 1.0 - jnp.asarray(beta2))
  return (beta2 * old + weight * batch.astype(old.dtype)).astype(old.dtype)


def precondition_blocks(blocks: jax.Array, axis_roots: Sequence[jax.Array]) -> jax.Array:
  """`B ×₁ R₁ ×₂ … ×_k R_k` for a batch of blocks `[n, b₀, …]` and symmetric
  `R_i` of shape `[n, b_i, b_i]`. Each step contracts the first block axis and
  appends the result as the last one, so after `k` steps the order is back."""
  n, shape = blocks.shape[0], blocks.shape[1:]
  y = blocks
  for i, r in enumerate(axis_roots):
    y = jnp.einsum("nir,nij->nrj", y.reshape(n, shape[i], -1), r, precision=_HI)
    y = y.reshape((n,) + shape[i + 1:] + shape[:i + 1])
  return y


def root_owners(lay: ShampooLayout, num_devices: int) -> list[list[list[int]]]:
  """`owned[device][bucket]`: the slots whose roots `device` computes, by the
  layout's two-criteria LPT (cost `d³`, size `d²` sent)."""
  items = [(j, i) for j, n in enumerate(lay.sizes) for i in range(n)]
  bins = owners.assign(
      items, num_devices, lambda t: float(lay.buckets[t[0]][0]) ** 3,
      lambda t: float(lay.buckets[t[0]][0]) ** 2)
  owned = [[[] for _ in lay.sizes] for _ in range(num_devices)]
  for device, mine in enumerate(bins):
    for j, i in sorted(mine):
      owned[device][j].append(i)
  return owned
