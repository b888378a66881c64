"""Micro-batches: the one place that checks `micro_batches=k` and slices a batch.

Gradient accumulation (`ValueAndGrad.accumulate`) and the exact curvature
products (`gauss_newton_gram`, `loss`) split every positional batch argument
along its leading axis into `k` equal slices and run one slice at a time
(`lax.scan`), so only one slice's activations are live. Keyword arguments go
to every slice whole, but for typed PRNG keys (`jax.random.key`): slice `i`
gets `fold_in(key, i)`, so that each slice draws its own dropout masks, as
the whole batch's rows do, not the first slice's again.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

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
  leading axis `k` does not divide, or leaves of different leading axes other
  than `k` itself (one entry per slice; else one is no batch: class weights,
  say), raise, naming `caller`."""
  leaves = jax.tree_util.tree_leaves(args)
  for x in leaves:
    if jnp.ndim(x) == 0 or jnp.shape(x)[0] % k:
      raise ValueError(f"{caller}(micro_batches={k}): every positional batch "
                       f"argument needs a leading axis divisible by {k}; got shape "
                       f"{jnp.shape(x)}. Pass arguments that are no batch (a PRNG "
                       "key, a flag, a scalar) as keywords: they are passed whole.")
  shapes = list(dict.fromkeys(jnp.shape(x) for x in leaves))      # in argument order
  if len({shape[0] for shape in shapes} - {k}) > 1:     # (k: one entry per slice)
    raise ValueError(f"{caller}(micro_batches={k}): the positional batch arguments "
                     f"have different leading axes, shapes {shapes}: each would be cut "
                     "into its own slices. Pass arguments that are no batch (class "
                     "weights, a table) as keywords: they are passed whole.")
  return jax.tree_util.tree_map(
      lambda x: jnp.reshape(x, (k, x.shape[0] // k) + x.shape[1:]), args)


def _is_typed_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _looks_like_raw_key(x: Any) -> bool:
  """A uint32 array of shape (2,) or (4,): `jax.random.PRNGKey`'s (threefry,
  rbg) raw key, which JAX cannot tell from data."""
  return hasattr(x, "dtype") and x.dtype == np.uint32 and jnp.shape(x) in ((2,), (4,))


def _keyword_leaf(x: Any) -> bool:
  """Keyword arguments are walked through dicts, lists and tuples only (a
  Flax NNX `Rngs` or other object stays whole)."""
  return not isinstance(x, (dict, list, tuple))


def check_keywords(kwargs: dict, k: int, caller: str) -> None:
  """Warns, for `k` > 1 slices, of keyword arguments that look like raw PRNG
  keys: passed whole, they give every slice the first slice's random draws."""
  leaves = jax.tree_util.tree_leaves(kwargs, is_leaf=_keyword_leaf)
  if k > 1 and any(map(_looks_like_raw_key, leaves)):
    warnings.warn(
        f"{caller}(micro_batches={k}): a keyword argument looks like a raw PRNG key "
        "(uint32 of shape (2,) or (4,), jax.random.PRNGKey): keyword arguments go to "
        "every slice whole, so each slice would draw the same dropout masks. Pass a "
        "typed key (jax.random.key), which slice i gets as jax.random.fold_in(key, i).",
        stacklevel=2)


def keywords_of_slice(kwargs: dict, i: jax.Array) -> dict:
  """The keyword arguments of slice `i`: every typed PRNG key folded with
  `i` (`jax.random.fold_in`, per key of a key array), the rest whole."""
  def of_slice(x: Any) -> Any:
    if not _is_typed_key(x):
      return x
    folded = jax.vmap(lambda key: jax.random.fold_in(key, i))(jnp.reshape(x, (-1,)))
    return jnp.reshape(folded, jnp.shape(x))
  return jax.tree_util.tree_map(of_slice, kwargs, is_leaf=_keyword_leaf)


def summed(fn: Callable[[Any, tuple, dict], Any], operands: Any, args: tuple,
           kwargs: dict, k: int, caller: str, axes: tuple[str, ...] = ()) -> Any:
  """`Σ_i fn(operands, slice_i of args, kwargs of slice i)` over `k`
  micro-batches (`fn(operands, args, kwargs)` for k = 1), one slice at a
  time; `fn` returns a pytree of arrays. `operands` (e.g. the parameters)
  enter the loop as its arguments, not closed over (Flax NNX refuses values
  of an outer trace). Inside `shard_map`, `axes` are the mesh axes the
  results vary over (the sums start as zeros typed varying over them)."""
  if k == 1:
    return fn(operands, args, kwargs)
  sliced = split(args, k, caller)

  def one(ops: Any, i: jax.Array) -> Any:
    return fn(ops, jax.tree_util.tree_map(lambda x: x[i], sliced),
              keywords_of_slice(kwargs, i))

  def body(carry: tuple, i: jax.Array) -> tuple[tuple, None]:
    total, ops = carry
    return (jax.tree_util.tree_map(jnp.add, total, one(ops, i)), ops), None

  zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 jax.eval_shape(one, operands, 0))
  (total, _), _ = jax.lax.scan(body, (_compat.as_varying(zeros, axes), operands),
                               jnp.arange(k))
  return total
