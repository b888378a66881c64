"""The collectives of the preconditioners over one mesh axis.

`Collectives` wraps every communication K-FAC and Shampoo do over the data
axis of a `Distribution` (reduce-scatters and all-reduces of statistics,
gathers of second-order state and of preconditioned gradients, the uneven
schemes of `uneven`) and the per-device dispatch (`per_device`: one branch of
a `lax.switch` per device, since devices own different work). Without a
`Distribution` every method is the identity of one device.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist import _compat
from kfac_jax_dist.core import offsets
from kfac_jax_dist.core import uneven
from kfac_jax_dist.core.distribution import Distribution


def pad_to(pieces: list[jax.Array], length: int, dtype, xp=jnp) -> jax.Array:
  """The pieces, flattened one after the other, zero-padded to `length`: a
  device's segment of a collective or of the state.

  Traced, the pieces are written into zeros by `dynamic_update_slice`: each
  piece's producer (an eigendecomposition's transposed output, a clip) fuses
  into its write, where XLA:CPU ran a concatenate of large reshaped operands
  up to ~100× slower (a 1.4 M-number segment: 35 ms against 0.15 ms). Pieces
  already materialised join faster in one concatenate (`concatenated`)."""
  used = sum(p.size for p in pieces)
  if xp is not jnp:
    return xp.concatenate(pieces + [xp.zeros(length - used, dtype)])
  out_dtype = jnp.result_type(dtype, *pieces)
  if len(pieces) == 1 and used == length:      # nothing to pad: no copy
    return pieces[0].reshape(-1).astype(out_dtype)
  out = jnp.zeros(length, out_dtype)
  offset = 0
  for piece in pieces:
    out = jax.lax.dynamic_update_slice(out, piece.reshape(-1).astype(out.dtype), (offset,))
    offset += piece.size
  return out


def concatenated(pieces: Sequence[jax.Array], length: int, dtype) -> jax.Array:
  """`pad_to` in one concatenate, for pieces that are already materialised
  (the statistics, results of the capture's conditionals): XLA:CPU copies
  them in one kernel where `pad_to` writes each in its own, which pays only
  where a piece's producer fuses into its write (measured on the step_time
  CNN: 7 fewer kernels, and 1.5 M numbers of flat statistics joined in 0.8-1.1
  ms against 2.3-2.6 ms)."""
  used = sum(p.size for p in pieces)
  out_dtype = jnp.result_type(dtype, *pieces)
  parts = [p.reshape(-1).astype(out_dtype) for p in pieces if p.size]
  if length > used or not parts:
    parts.append(jnp.zeros(length - used, out_dtype))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def concat_flat(pieces: Sequence[jax.Array], dtype) -> jax.Array:
  """The pieces flattened one after the other (`pad_to` without padding)."""
  return pad_to(list(pieces), sum(p.size for p in pieces), dtype)


class Collectives:
  """The collectives of one layout over one mesh axis; identities without a
  `Distribution` (one device, no `shard_map`).

  With a `Distribution` (even of one device) they must run inside `shard_map`
  over its axis; their results are typed varying or invariant over the axis as
  `partition_specs` declares the state.
  """

  def __init__(self, distribution: Distribution | None):
    self.dist = distribution
    self.num_devices = 1 if distribution is None else distribution.num_devices
    self.group_size = 1 if distribution is None else distribution.group_size
    self.num_groups = self.num_devices // self.group_size
    # Axes over which per-device results vary: the data axis, and the
    # tensor-parallel axes (every model shard has its own state) if any.
    self.varying = () if distribution is None else (
        (distribution.axis,) + distribution.model_axes)

  @property
  def active(self) -> bool:
    return self.dist is not None

  @property
  def on_cpu(self) -> bool:
    """Whether the step runs on CPU, as known when tracing: the platform of
    the mesh's devices, else jax's default backend. Only choices of speed
    and memory rest on it, never results (a program lowered for another
    platform computes the same, in the other platform's arrangement), as for
    `kd.value_and_grad`'s `skip_statistics="auto"`; unlike
    `lax.platform_dependent`, it traces the chosen arrangement alone."""
    mesh = self.dist.mesh if self.active else None
    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
      return mesh.devices.flat[0].platform == "cpu"
    return jax.default_backend() == "cpu"

  def device_index(self) -> jax.Array:
    if not self.active:
      return jnp.zeros([], jnp.int32)
    try:
      return jax.lax.axis_index(self.dist.axis)
    except NameError as e:
      raise ValueError(
          f"This K-FAC state is distributed over mesh axis {self.dist.axis!r} "
          f"({self.num_devices} devices): call update inside jax.shard_map over that "
          "axis, with in_specs/out_specs from kd.partition_specs(opt_state).") from e

  def device_table(self, values: Sequence[int]) -> jax.Array:
    """`values[d]` of the device running this code (int32, checked)."""
    return jnp.asarray(offsets.int32_table(values))[self.device_index()]

  def group_table(self, values: Sequence[int]) -> jax.Array:
    """`values[g]` of the owner group of the device running this code."""
    return jnp.asarray(offsets.int32_table(values))[self.group_index()]

  def range_at(self, full: jax.Array, starts: Sequence[int], size: int) -> jax.Array:
    """`full[s:s + size]`, `s = starts[d]` of the running device d, in a branch
    of `per_device` that several devices share; `full`'s length a multiple of
    P. `s` may pass int32 (GPT-2-XL's factors: 2.6e9 numbers), so it is read
    as (row, column) of `full` as `[P, C]`, each small: a window of whole rows,
    then the range in it."""
    p = self.num_devices
    chunk = full.shape[0] // p
    rows = min(-(-size // chunk) + 1, p)
    first = self.device_table(tuple(s // chunk for s in starts))
    column = self.device_table(tuple(s % chunk for s in starts))
    start = jnp.minimum(first, p - rows)          # the window stays inside the rows
    window = jax.lax.dynamic_slice_in_dim(full.reshape(p, chunk), start, rows).reshape(-1)
    return jax.lax.dynamic_slice_in_dim(window, (first - start) * chunk + column, size)

  def per_device(self, make, representatives: Sequence[int] | None = None):
    """`make(device)` on each device: devices own different work, so with P > 1
    this is a `lax.switch` on the device index (each device's code appears in
    one branch only); results are typed varying over the axis.
    `representatives[d]`: a device whose `make` computes the same as `d`'s
    (devices with the same kind of work: `Layout.decomposition_branches`),
    so that they share one branch."""
    if self.num_devices == 1:
      return make(0)
    return self.switch(self.device_index(), make, representatives or range(self.num_devices))

  def switch(self, index: jax.Array, make: Callable[[int], Any],
             representatives: Sequence[int]) -> Any:
    """`make(representatives[index])`: a `lax.switch` with one branch per
    distinct representative, results typed varying over the axis."""
    reps = list(representatives)
    unique = sorted(set(reps))
    branches = [functools.partial(lambda r: _compat.as_varying(make(r), self.varying), r)
                for r in unique]
    if len(unique) < len(reps):
      position = {r: i for i, r in enumerate(unique)}
      index = jnp.asarray([position[r] for r in reps], jnp.int32)[index]
    return jax.lax.switch(index, branches)

  def group_index(self) -> jax.Array:
    return self.device_index() // self.group_size

  def _within_groups(self):
    """Axis index groups of the m consecutive devices of each owner group."""
    m = self.group_size
    return [list(range(g * m, (g + 1) * m)) for g in range(self.num_groups)]

  def _gather_within_group(self, x: jax.Array) -> jax.Array:
    """`[k, ...]` per device → its group's `[m·k, ...]`; with one group the
    result is typed invariant over the axis."""
    if self.num_groups == 1:
      return _compat.all_gather_invariant(x, self.dist.axis, tiled=True)
    if self.group_size == 1:
      return x
    return jax.lax.all_gather(x, self.dist.axis, axis_index_groups=self._within_groups(),
                              tiled=True)

  def _device_mean(self, x: jax.Array, summed: Callable[[jax.Array], jax.Array]
                   ) -> jax.Array:
    """`summed(x) / P`, `summed` a sum over the devices. In `comm_dtype` each
    device's share `x / P` travels, not `x`: the sum of `P` contributions
    stays within the narrow type's range (float16's 65504 would otherwise
    bound each entry by 65504 / P) and comes back in `x`'s dtype."""
    if self.dist.comm_dtype is None:
      return summed(x) / self.num_devices
    share = (x / self.num_devices).astype(self.dist.comm_dtype)
    return summed(share).astype(x.dtype)

  def reduce_factors(self, segments: jax.Array, length: int) -> jax.Array:
    """Per-device statistics laid out as the running factors, `[P·length]` →
    this device's `[length]`: averaged over the devices ("reduce_scatter"; tight
    chunks), or its own local ones ("local", DP-KFAC; its owner segment)."""
    if not self.active:
      return segments
    if self.dist.factor_reduction == "local":
      return offsets.segment_at(segments, length, self.device_index())
    return self._device_mean(segments, lambda x: jax.lax.psum_scatter(
        x, self.dist.axis, scatter_dimension=0, tiled=True))

  def all_reduce_factors(self, flat: jax.Array) -> jax.Array:
    """KAISA's factor all-reduce: every factor, once, averaged over the devices."""
    if not self.active:
      return flat
    return self._device_mean(flat, lambda x: jax.lax.psum(x, self.dist.axis))

  def gather_group(self, tree):
    """Owned slots `[c, ...]` → the owner group's slots `[m·c, ...]`."""
    if not self.active:
      return tree
    return jax.tree_util.tree_map(self._gather_within_group, tree)

  def all_gather_owned(self, x):
    """Per-device `[c, ...]` → every device's, `[P·c, ...]`."""
    if not self.active:
      return x
    return jax.tree_util.tree_map(
        lambda v: _compat.all_gather_invariant(v, self.dist.axis, tiled=True), x)

  def mean(self, tree):
    if not self.active:
      return tree
    return jax.tree_util.tree_map(lambda x: jax.lax.pmean(x, self.dist.axis), tree)

  def gather_uneven(self, segment: jax.Array, sizes: Sequence[int]) -> uneven.Gathered:
    """Every device's `[L]` segment, of which device `i` uses the first
    `sizes[i]` numbers (the rest are zeros), → every device's used numbers,
    `[sizes[i]]` each, on every device, without padded traffic, read where
    they arrived (`uneven.Gathered`)."""
    if not self.active:
      return uneven.Gathered((segment,), ((0, 0, sizes[0]),))
    return uneven.gather(segment, sizes, self.dist.axis, self.device_index())

  def gather_group_uneven(self, segment: jax.Array, sizes: Sequence[int]
                          ) -> uneven.Gathered:
    """`gather_uneven` within each owner group (several groups of `m > 1`):
    `sizes[r]` the numbers the device of rank `r` uses, in every group."""
    return uneven.gather(segment, sizes, self.dist.axis, self.device_index() % self.group_size,
                         groups=self._within_groups())

  def reduce_uneven(self, segments: Sequence[jax.Array], length: int) -> jax.Array:
    """This device's contribution to every device's segment (`segments[i]`,
    unpadded) → this device's `[length]` (zeros past its own size), averaged
    over the devices: the mirror of `gather_uneven`."""
    if not self.active:
      return jnp.pad(segments[0], (0, length - segments[0].shape[0]))
    return uneven.reduce_scatter(segments, length, self.dist.axis,
                                 self.device_index()) / self.num_devices

  def reduce_scatter_groups(self, buffer: jax.Array) -> jax.Array:
    """Per-device `[G·S]` (group-major) → the device's group segment `[S]`,
    averaged over the devices: `psum_scatter`, then `all_gather` in the group."""
    if not self.active:
      return buffer
    piece = jax.lax.psum_scatter(buffer, self.dist.axis, scatter_dimension=0,
                                 tiled=True) / self.num_devices
    return self._gather_within_group(piece)

  def _same_rank(self) -> list[list[int]]:
    """Axis index groups of the devices of equal rank in their owner groups,
    `{r, r + m, r + 2m, ...}` (KAISA's receivers of a layer)."""
    m = self.group_size
    return [list(range(r, self.num_devices, m)) for r in range(m)]

  def gather_groups(self, buffer: jax.Array) -> jax.Array:
    """Each group's `[S]` → `[G, S]` on every device, typed invariant over the
    axis: one all_gather among the devices of equal rank (`_same_rank`), as
    KAISA's receivers get each other group's buffer once, `(G−1)·S` per
    device. Every device of a group holds its group's buffer (the same
    program on the same inputs: the group's gathered second-order state and
    the averaged gradients), so the `G` buffers each device receives are the
    same on all and `_compat.equal_over` types them so."""
    if self.num_groups == 1:
      return buffer[None]
    gathered = jax.lax.all_gather(buffer, self.dist.axis,
                                  axis_index_groups=self._same_rank())
    return _compat.equal_over(gathered, (self.dist.axis,))
