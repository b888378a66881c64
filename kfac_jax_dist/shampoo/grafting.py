"""Grafting (Agarwal et al. 2020; Anil et al. 2020, §4.3).

The step has Shampoo's direction and the norm of a diagonal method's step,
per block (`grafting="block"`) or per parameter (`grafting="layer"`):
`G̃ · ‖D‖ / ‖G̃‖`, where `D` is the grafted update:

* "sgd": `D = G`;
* "adagrad": `S ← S + G⊙G`, `D = G / (√S + ε_graft)`;
* "rmsprop": `v ← β v + (1−β) G⊙G`, `D = G / (√v + ε_graft)`;
* "adam": as "rmsprop" with Adam's bias correction `v / (1 − β^t)`;
* "none": no grafting, `G̃` as is (diagonal parameters then get `G`).

The grafting statistics are updated every step.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist.shampoo.config import ShampooConfig


def norms(blocks: jax.Array) -> jax.Array:
  """`‖B_i‖_F` of every block of a batch `[n, ...]`."""
  return jnp.sqrt(jnp.sum(jnp.square(blocks), axis=tuple(range(1, blocks.ndim))))


def graft_scale(target_norm: jax.Array, norm: jax.Array) -> jax.Array:
  """`‖D‖ / ‖G̃‖` (1/1 for a zero direction)."""
  return target_norm / jnp.where(norm > 0, norm, 1.0)


def graft_blocks(out: jax.Array, target: jax.Array) -> jax.Array:
  """Block grafting of a batch of directions `[n, ...]` to the norms of the
  grafted update's blocks `target`."""
  return out * graft_scale(norms(target), norms(out))[
      (slice(None),) + (None,) * (out.ndim - 1)]


def diagonal_updates(config: ShampooConfig, grads: Sequence[jax.Array],
                     accumulators: Sequence[jax.Array], count: jax.Array
                     ) -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
  """The grafted diagonal updates `D` and the new accumulators."""
  if not config.accumulates:
    return list(grads), ()
  beta = config.graft_moment
  out, new_acc = [], []
  for g, acc in zip(grads, accumulators):
    g = g.astype(acc.dtype)
    sq = jnp.square(g)
    new = acc + sq if config.graft_type == "adagrad" else beta * acc + (1.0 - beta) * sq
    denom = new
    if config.graft_type == "adam":
      denom = new / (1.0 - beta ** (count + 1).astype(acc.dtype))
    out.append(g / (jnp.sqrt(denom) + config.graft_epsilon))
    new_acc.append(new)
  return out, tuple(new_acc)
