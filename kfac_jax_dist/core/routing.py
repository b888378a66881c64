"""Owner-group routing of gradients, shared by K-FAC and Shampoo.

With `P/m` owner groups (KAISA §4.3) each group preconditions the gradients
of its own layers (K-FAC) or blocks (Shampoo). Two routes connect the groups:

* to the owners (`reduce_to_groups`, SP-NGD's `gradient_reduction=
  "reduce_scatter"`, Osawa et al. 2020): every device's raw local gradients of
  each group's parameters, one flat buffer per group, are summed over the
  devices and each device receives its own group's average only. With one
  device per group (MEM-OPT) the buffers are uneven (`uneven.reduce_scatter`,
  no padded traffic); otherwise a reduce-scatter of the buffers padded to a
  common width, then an all-gather within the group.
* from the owners (`gather_from_groups`): each group's flat buffer of results
  (preconditioned gradients and the sums that go with them) reaches every
  device. With one device per group the buffers are uneven
  (`uneven.gather`); otherwise the buffers, padded to the largest group's,
  travel by one all-gather among the devices of equal rank in their groups
  (KAISA's receivers: each device receives every other group's buffer once,
  `(G−1)·S`), typed invariant over the axis (`Collectives.gather_groups`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import uneven


def group_width(sizes: Sequence[int], group_size: int) -> int:
  """The common buffer width: the largest group's, rounded up to a multiple
  of `m` (so that `reduce_to_groups`' pieces are equal)."""
  return -(-max(max(sizes), 1) // group_size) * group_size


def reduce_to_groups(comm: collectives_lib.Collectives, buffers: Sequence[jax.Array],
                     width: int) -> jax.Array:
  """This device's raw buffer of every group's parameters (`buffers[g]`,
  unpadded) → its own group's buffer averaged over the devices, `[width]`
  (zeros past the group's size)."""
  if comm.group_size == 1 < comm.num_groups:
    return comm.reduce_uneven(buffers, width)
  return comm.reduce_scatter_groups(jnp.concatenate(
      [jnp.pad(x, (0, width - x.shape[0])) for x in buffers]))


def per_group(comm: collectives_lib.Collectives, make: Callable[[int], Any],
              representatives: Sequence[int] | None = None) -> Any:
  """`make(group)` (an array or a tuple of them, shaped alike for every group)
  on the devices of each owner group (a `lax.switch` on the group index;
  typed varying over the axis, since a group may own nothing).
  `representatives[g]`: a group whose branch also serves `g` (it then reads
  at the running group's offsets), one branch for both. With one group,
  `make(0)` on every device, typed as its inputs."""
  if comm.num_groups == 1:
    return make(0)
  return comm.switch(comm.group_index(), make, representatives or range(comm.num_groups))


def gather_from_groups(comm: collectives_lib.Collectives,
                       make: Callable[[int], jax.Array], sizes: Sequence[int],
                       dtype, representatives: Sequence[int] | None = None
                       ) -> uneven.Gathered:
  """Every group's flat buffer (`make(group)`, of `sizes[group]` numbers, made
  on that group's devices; `representatives` as `per_group`) → on every
  device, every group's buffer, read where it arrived (`uneven.Gathered`):
  its numbers, or (several devices per group) the buffer padded to the
  common width. With one group its buffer, unpadded: nothing travels."""
  if comm.num_groups == 1:
    return _rows(make(0), 1, sizes[0])
  width = group_width(sizes, comm.group_size)
  mine = per_group(comm, lambda g: collectives_lib.pad_to([make(g)], width, dtype),
                   representatives)
  return gather_made(comm, mine, sizes)


def gather_made(comm: collectives_lib.Collectives, mine: jax.Array, sizes: Sequence[int]
                ) -> uneven.Gathered:
  """`gather_from_groups` of a buffer already made on each group's devices,
  `[group_width(sizes, m)]`."""
  if comm.num_groups == 1:
    return _rows(mine, 1, sizes[0])
  if comm.group_size == 1:
    return comm.gather_uneven(mine, sizes)
  return _rows(comm.gather_groups(mine).reshape(-1), comm.num_groups, mine.shape[0])


def _rows(flat: jax.Array, count: int, size: int) -> uneven.Gathered:
  """`count` buffers of `size` numbers one after the other in `flat`."""
  return uneven.Gathered((flat,), tuple(((0, i * size, size),) for i in range(count)))
