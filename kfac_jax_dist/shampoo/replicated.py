"""Shampoo when every device holds every statistic: one device, or one owner
group (COMM-OPT, `grad_worker_fraction = 1`).

Every device updates every statistic from the averaged gradients (no
statistics traffic) and computes every direction; each root is computed by
one owner (the statistics assigned like K-FAC's factors: LPT on `d³`,
balancing the numbers each owner sends too, `blocks.root_owners`) and the
roots are all-gathered without padding (`uneven`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.shampoo import blocks
from kfac_jax_dist.shampoo import grafting
from kfac_jax_dist.shampoo import roots
from kfac_jax_dist.shampoo.config import ShampooConfig
from kfac_jax_dist.shampoo.state import ScaleByShampooState

Buckets = tuple[jax.Array, ...]


def new_statistics(config: ShampooConfig, lay: blocks.ShampooLayout,
                   merged: Sequence[jax.Array | None], stats: Buckets) -> Buckets:
  """Every bucket's statistics accumulated with this step's blocks."""
  pieces: list[list[jax.Array]] = [[] for _ in lay.buckets]
  for plan, g in zip(lay.params, merged):
    if not plan.preconditioned:
      continue
    for region in plan.regions:
      x = blocks.to_blocks(blocks.region_slice(g, region), region)
      for axis, h in enumerate(blocks.axis_statistics(x)):
        j = region.buckets[axis]
        assert region.slots[axis] == sum(y.shape[0] for y in pieces[j])
        pieces[j].append(h)
  return tuple(blocks.accumulate(old, jnp.concatenate(pieces[j]) if len(pieces[j]) > 1
                                 else pieces[j][0], config.beta2)
               for j, old in enumerate(stats))


def checked_roots(config: ShampooConfig, p: float, statistics: jax.Array,
                  previous: jax.Array) -> jax.Array:
  """`roots.checked_roots` with the config's root options."""
  return roots.checked_roots(
      statistics, p, previous, method=config.root_method,
      ridge_epsilon=config.ridge_epsilon, max_iterations=config.newton_max_iterations,
      tolerance=config.newton_tolerance, failure_threshold=config.root_failure_threshold)


RootFn = Callable[[float, jax.Array, jax.Array], jax.Array]


def new_roots(config: ShampooConfig, comm: collectives_lib.Collectives,
              lay: blocks.ShampooLayout, stats: Buckets, old_roots: Buckets,
              compute: RootFn | None = None) -> Buckets:
  """Every bucket's roots (or what `compute(p, statistics, previous)` makes of
  the statistics, `[n, d, d]` each: SOAP's eigenbases): computed here on one
  device; by their owners and gathered with several."""
  if compute is None:
    compute = functools.partial(checked_roots, config)
  if comm.num_devices == 1:
    return tuple(compute(p, h, old) for (_, p), h, old in zip(lay.buckets, stats, old_roots))
  owned = blocks.root_owners(lay, comm.num_devices)
  sizes = [sum(len(slots) * lay.buckets[j][0] ** 2 for j, slots in enumerate(mine))
           for mine in owned]
  length = max(max(sizes), 1)

  def mine(device: int) -> jax.Array:
    pieces = []
    for j, slots in enumerate(owned[device]):
      if slots:
        idx = jnp.asarray(slots)
        pieces.append(compute(lay.buckets[j][1], stats[j][idx],
                              old_roots[j][idx]).reshape(-1))
    return collectives_lib.pad_to(pieces, length, old_roots[0].dtype)

  gathered = comm.gather_uneven(comm.per_device(mine), sizes)
  out = list(old_roots)
  for device, mine_slots in enumerate(owned):
    offset = 0
    for j, slots in enumerate(mine_slots):
      if slots:
        d = lay.buckets[j][0]
        block = gathered[device][offset:offset + len(slots) * d * d]
        out[j] = out[j].at[jnp.asarray(slots)].set(block.reshape(len(slots), d, d))
        offset += len(slots) * d * d
  return tuple(out)


def direction(config: ShampooConfig, plan: blocks.ParamPlan, g: jax.Array,
              d: jax.Array, bucket_roots: Buckets) -> jax.Array:
  """Grafted Shampoo direction of one merged parameter `g` (grafted update `d`)."""
  pieces = {}
  for region in plan.regions:
    x = blocks.to_blocks(blocks.region_slice(g, region), region)
    axis_roots = [lax.dynamic_slice_in_dim(bucket_roots[j], s, region.num_blocks)
                  for j, s in zip(region.buckets, region.slots)]
    out = blocks.precondition_blocks(x, axis_roots)
    if config.graft_type != "none" and config.grafting == "block":
      out = grafting.graft_blocks(out, blocks.to_blocks(blocks.region_slice(d, region),
                                                        region))
    pieces[region.index] = blocks.from_blocks(out, region)
  out = blocks.assemble(pieces, plan.segments)
  if config.graft_type != "none" and config.grafting == "layer":
    out = out * grafting.graft_scale(jnp.linalg.norm(d.ravel()),
                                     jnp.linalg.norm(out.ravel()))
  return out


def update(config: ShampooConfig, comm: collectives_lib.Collectives,
           state: ScaleByShampooState, merged: Sequence[jax.Array | None],
           diag: Sequence[jax.Array], dtype: Any
           ) -> tuple[Buckets, Buckets, list[jax.Array]]:
  """New statistics and roots, and the directions of the preconditioned
  parameters (the grafted update before the start step). Named scopes mark
  each cadence's work in the HLO."""
  lay, count = state.layout, state.count
  every, start = config.statistics_compute_steps, config.start_preconditioning_step
  root_every = config.preconditioning_compute_steps
  with jax.named_scope("shampoo_statistics"):
    if cadence.always(every):
      stats = new_statistics(config, lay, merged, state.statistics)
    else:
      stats = lax.cond(cadence.due(every, count),
                       lambda: new_statistics(config, lay, merged, state.statistics),
                       lambda: state.statistics)
  with jax.named_scope("shampoo_roots"):
    if cadence.always(root_every, start):
      new = new_roots(config, comm, lay, stats, state.roots)
    else:
      new = lax.cond(cadence.due_from(start, root_every, count),
                     lambda: new_roots(config, comm, lay, stats, state.roots),
                     lambda: state.roots)
  pre = [i for i, plan in enumerate(lay.params) if plan.preconditioned]

  def shampoo_branch() -> list[jax.Array]:
    return [direction(config, lay.params[i], merged[i],
                      diag[i].astype(dtype).reshape(lay.params[i].merged),
                      new).reshape(lay.params[i].shape).astype(dtype) for i in pre]

  with jax.named_scope("shampoo_precondition"):
    if cadence.is_number(start) and start == 0:
      directions = shampoo_branch()
    else:
      directions = lax.cond(count >= cadence.value_at(start, count), shampoo_branch,
                            lambda: [diag[i].astype(dtype) for i in pre])
  return stats, new, directions
