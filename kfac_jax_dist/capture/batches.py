"""Micro-batches: the one place that checks `micro_batches=k` and slices a batch.

Gradient accumulation (`ValueAndGrad.accumulate`) and the exact curvature
products (`gauss_newton_gram`, `loss`) split every positional batch argument
along its leading axis into `k` equal slices and run one slice at a time
(`lax.scan`), so only one slice's activations are live.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kfac_jax_dist import _compat


def check(micro_batches: Any, caller: str) -> int:
  """`micro_batches` as a positive int, or a ValueError naming `caller`."""
  try:
    k = -1 if isinstance(micro_batches, bool) else operator.index(micro_batches)
  except TypeError:
    k = -1
  if k < 1:
    raise ValueError(f"{caller}: micro_batches must be a positive integer (the "
                     f"number of slices of the batch), got {micro_batches!r}")
  return k


def split(args: tuple, k: int, caller: str) -> tuple:
  """Every leaf of `args` reshaped `[B, ...] → [k, B/k, ...]`; a leaf whose
  leading axis `k` does not divide raises, naming `caller`."""
  for x in jax.tree_util.tree_leaves(args):
    if jnp.ndim(x) == 0 or jnp.shape(x)[0] % k:
      raise ValueError(f"{caller}(micro_batches={k}): every positional batch "
                       f"argument needs a leading axis divisible by {k}; got shape "
                       f"{jnp.shape(x)}. Pass arguments that are no batch (a PRNG "
                       "key, a flag, a scalar) as keywords: they are passed whole.")
  return jax.tree_util.tree_map(
      lambda x: jnp.reshape(x, (k, x.shape[0] // k) + x.shape[1:]), args)


def summed(fn: Callable[[Any, tuple], Any], operands: Any, args: tuple, k: int,
           caller: str, axes: tuple[str, ...] = ()) -> Any:
  """`Σ_i fn(operands, slice_i of args)` over `k` micro-batches
  (`fn(operands, args)` for k = 1), one slice at a time; `fn` returns a
  pytree of arrays. `operands` (e.g. the parameters) enter the loop as its
  arguments, not closed over (Flax NNX refuses values of an outer trace).
  Inside `shard_map`, `axes` are the mesh axes the results vary over (the
  sums start as zeros typed varying over them)."""
  if k == 1:
    return fn(operands, args)
  sliced = split(args, k, caller)

  def one(ops: Any, i: jax.Array) -> Any:
    return fn(ops, jax.tree_util.tree_map(lambda x: x[i], sliced))

  def body(carry: tuple, i: jax.Array) -> tuple[tuple, None]:
    total, ops = carry
    return (jax.tree_util.tree_map(jnp.add, total, one(ops, i)), ops), None

  zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 jax.eval_shape(one, operands, 0))
  (total, _), _ = jax.lax.scan(body, (_compat.as_varying(zeros, axes), operands),
                               jnp.arange(k))
  return total
