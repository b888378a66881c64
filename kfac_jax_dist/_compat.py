"""Small shims over jax versions (0.8 → newest) for shard_map's varying axes."""

from __future__ import annotations

import jax
from jax.extend import core as _jex_core
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir


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


# `equal_over`: a typed no-op. Inside `shard_map` a value computed on every
# device of an axis from the same inputs by the same program is the same on
# each, but when it was assembled by a collective over part of the axis (an
# all_gather with `axis_index_groups`) its type says "varying", and jax has no
# invariant-typed form of such collectives. The primitive drops the axes from
# the value's varying axes and lowers to nothing. Linear: its transpose is the
# pmean's (the value is the mean of equal copies).
_equal_over_p = _jex_core.Primitive("kfac_equal_over")


def _without_varying(aval, axes: tuple[str, ...]):
  """`aval` typed as invariant over `axes` (jax >= 0.10: `manual_axis_type`;
  0.8 - 0.9: `vma`)."""
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return aval.update(manual_axis_type=manual.update(
        varying=frozenset(a for a in manual.varying if a not in axes)))
  vma = getattr(aval, "vma", None)
  if vma is None:
    return aval
  return aval.update(vma=frozenset(a for a in vma if a not in axes))


def _equal_over_transpose(ct, x, *, axes):
  del x
  if type(ct) is _ad.Zero:  # pylint: disable=unidiomatic-typecheck
    return [ct]
  return [as_varying(ct, axes) / jax.lax.psum(1, axes)]


_equal_over_p.def_abstract_eval(_without_varying)
_mlir.register_lowering(_equal_over_p, lambda ctx, x, *, axes: [x])
_ad.deflinear2(_equal_over_p, _equal_over_transpose)
_batching.primitive_batchers[_equal_over_p] = (
    lambda args, dims, *, axes: (_equal_over_p.bind(args[0], axes=axes), dims[0]))


def equal_over(tree, axes: tuple[str, ...]):
  """Types `tree`, whose every leaf the caller knows to be the same on every
  device of `axes` (the same program on the same inputs), as invariant over
  them, so that it may leave `shard_map` with spec P(): no communication, no
  check. Only for such values: a value that differs between the devices
  would silently pass as replicated."""
  if not axes:
    return tree

  def one(x: jax.Array) -> jax.Array:
    present = tuple(a for a in axes if a in varying_axes(x))
    return _equal_over_p.bind(x, axes=present) if present else x
  return jax.tree_util.tree_map(one, tree)


def current_trace() -> object:
  """The JAX trace being built (a loop body, a branch or a transform gets its
  own); where this JAX does not say, a new object, unequal to every other."""
  try:
    from jax._src import core  # pylint: disable=import-outside-toplevel
    return core.trace_ctx.trace
  except (ImportError, AttributeError):
    return object()


def inside_another_trace(top: object) -> bool:
  """Whether the JAX trace being built is not `top` (a `current_trace()`
  taken earlier); False where this JAX does not say."""
  now = current_trace()
  return now is not top and now is current_trace()


# The transforms whose body may not run in a pass: a branch of `lax.cond` /
# `lax.switch`, a `lax.while_loop`'s body. What JAX records as `traced_for` of
# the trace. A `lax.fori_loop`'s body is recorded alike whether its bounds are
# static (a scan: it runs) or traced (a while loop), and is not counted: JAX
# refuses to differentiate a while loop in reverse mode, so a trained layer
# in one can only sit under a user's custom VJP.
MAY_NOT_RUN = frozenset({"cond", "switch", "while_body"})


def may_not_run(top: object) -> bool:
  """Whether the trace being built lies inside a transform whose body may not
  run (`MAY_NOT_RUN`) between it and `top` (a `current_trace()` taken
  earlier), read from the chain of traces JAX builds; where this JAX does not
  say (no chain to `top`, a trace without a record of what it traces for):
  whether it is inside any other trace at all, which includes them."""
  now = current_trace()
  if now is top:
    return False
  seen = 0
  while now is not None and now is not top and seen < 10_000:
    kind = type(now).__name__
    info = getattr(getattr(now, "frame", None), "debug_info", None)
    purpose = getattr(info, "traced_for", None)
    if purpose is None and kind != "BatchTrace":      # unknown: assume it may not run
      return True
    if purpose in MAY_NOT_RUN:
      return True
    now, seen = getattr(now, "parent_trace", None), seen + 1
  return now is not top
