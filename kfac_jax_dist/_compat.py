"""Small shims over jax versions (0.8 → newest) for shard_map's varying axes."""

from __future__ import annotations

import jax


def varying_axes(*values) -> tuple[str, ...]:
  """Mesh axes over which any of `values` varies inside `shard_map` (else ())."""
  axes = set()
  for value in values:
    for leaf in jax.tree_util.tree_leaves(value):
      if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        continue                      # Python flags, strings, modules, ...
      aval = jax.typeof(leaf)
      manual = getattr(aval, "manual_axis_type", None)        # jax >= 0.10
      axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()))
  return tuple(sorted(axes))


def as_varying(tree, axes: tuple[str, ...]):
  """Marks `tree` as varying over `axes` (a no-op on values), so that both
  branches of a `lax.cond` inside `shard_map` have the same type."""
  if not axes:
    return tree
  if hasattr(jax.lax, "pcast"):
    cast = lambda x, missing: jax.lax.pcast(x, missing, to="varying")
  else:
    cast = lambda x, missing: jax.lax.pvary(x, missing)

  def one(x: jax.Array) -> jax.Array:   # only the axes x does not already vary over
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return cast(x, missing) if missing else x
  return jax.tree_util.tree_map(one, tree)


def all_gather_invariant(x, axis_name: str, *, tiled: bool = True):
  """`all_gather` over a whole mesh axis, typed as invariant over it (every
  device holds the same result), so it may leave `shard_map` with spec P()."""
  if hasattr(jax.lax, "all_gather_invariant"):                 # jax 0.8 - 0.9
    return jax.lax.all_gather_invariant(x, axis_name, tiled=tiled)
  return jax.lax.all_gather(x, axis_name, tiled=tiled, to="invarying")


def traced(tree) -> bool:
  """Whether any leaf of `tree` is a tracer (under jit, eval_shape, grad, ...)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))
