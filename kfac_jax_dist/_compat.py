"""Small shims over jax versions (0.8 → newest): shard_map's varying axes,
running on `Explicit` mesh axes (`on_auto_axes`), and eager calls that
compile once (`cond`, `compiled_when_eager`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
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
  device holds the same result), so it may leave `shard_map` with spec P().
  `x` is cast varying first where it is not: jax 0.12.1 refuses an invariant
  input (a one-device mesh's, whose values nothing made varying)."""
  if hasattr(jax.lax, "all_gather_invariant"):                 # jax 0.8 - 0.9
    return jax.lax.all_gather_invariant(x, axis_name, tiled=tiled)
  return jax.lax.all_gather(as_varying(x, (axis_name,)), axis_name, tiled=tiled,
                            to="invarying")


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


def traced_by(value: Any, trace: object) -> bool:
  """Whether `value` is a tracer of `trace` (a `current_trace()` taken
  earlier); True where this JAX does not say (a tracer without its trace)."""
  if not isinstance(value, jax.core.Tracer):
    return False
  return getattr(value, "_trace", trace) is trace


def _traces_since(top: object) -> tuple[list[tuple[str, Any]], bool]:
  """The traces between the one being built (first) and `top` (a
  `current_trace()` taken earlier, excluded), each as (its type's name, what
  JAX records it traced for), and whether the chain reached `top` (not where
  this JAX keeps no chain, or a trace of its own starts one: a custom rule's)."""
  chain = []
  for now in _enclosing_traces():
    if now is top:
      return chain, True
    info = getattr(getattr(now, "frame", None), "debug_info", None)
    chain.append((type(now).__name__, getattr(info, "traced_for", None)))
  return chain, top is None


def _enclosing_traces():
  """The trace being built, then each one it was built inside (at most
  10 000: JAX's chain has no cycles, the bound only guards against one)."""
  now, seen = current_trace(), 0
  while now is not None and seen < 10_000:
    yield now
    now, seen = getattr(now, "parent_trace", None), seen + 1


def in_mesh_order(axes: Sequence[str]) -> tuple[str, ...]:
  """`axes` in the order of the mesh being traced over (`shard_map`'s, by
  `jax.sharding.get_abstract_mesh`), those it does not name (a `pmap`'s)
  after them, by name."""
  try:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  except (AttributeError, RuntimeError):
    names = ()
  rank = {name: i for i, name in enumerate(names)}
  return tuple(sorted(axes, key=lambda axis: (rank.get(axis, len(rank)), axis)))


def untyped_device_axes() -> tuple[str, ...]:
  """The axis names bound around the trace being built by a `jax.pmap` or a
  `shard_map(check_vma=False)` (not a vmap's), where values carry no type
  saying whether they vary over them: () inside a typed `shard_map`, outside
  any, or where this JAX does not say."""
  try:
    from jax._src import config, core  # pylint: disable=import-outside-toplevel
    if config._check_vma.value:  # pylint: disable=protected-access
      return ()
    names = set(core.get_axis_env().axis_sizes)
  except (ImportError, AttributeError):
    return ()
  for now in _enclosing_traces():                    # a vmap's named axis
    names.discard(getattr(getattr(now, "axis_data", None), "name", None))
  return tuple(sorted(n for n in names if isinstance(n, str)))


def vmapped_since(top: object) -> bool:
  """Whether a `jax.vmap` (a batching trace) lies between the trace being
  built and `top` (a `current_trace()` taken earlier): inside it the arrays
  have lost their mapped axis. False where this JAX does not say."""
  return any(kind == "BatchTrace" for kind, _ in _traces_since(top)[0])


# The transforms that run their body once per slice of their inputs: what JAX
# records as `traced_for` of a loop body (flax's `nn.scan` / `nn.RNN` run
# `lax.scan`).
LOOPS = frozenset({"scan", "fori_loop", "while_body"})


def looped_since(top: object) -> bool:
  """Whether a loop body (`LOOPS`: `lax.scan`, `nn.scan`, `nn.RNN`, a
  `fori_loop`) lies between the trace being built and `top` (a
  `current_trace()` taken earlier): inside it the arrays have lost the axis
  it runs over. False where this JAX does not say."""
  return any(purpose in LOOPS for _, purpose in _traces_since(top)[0])


# What `derivative_since` names: a derivative taken inside the loss.
REVERSE = "reverse-mode (jax.grad / jax.vjp / jax.linearize)"
FORWARD = "forward-mode (jax.jvp / jax.jacfwd / jax.experimental.jet)"
CUSTOM = "a custom derivative rule (jax.custom_vjp / jax.custom_jvp / nn.custom_vjp)"
_CUSTOM_RULES = frozenset({"custom_vjp fun", "custom_jvp fun"})


def derivative_since(top: object) -> str | None:
  """The innermost derivative the function being traced is under, taken
  after `top` (a `current_trace()` taken earlier): `REVERSE` (a linearize
  trace), `FORWARD` (a JVP trace, or Taylor mode's jet), `CUSTOM` (the function of a custom
  derivative rule, whose own rule replaces its derivative); None for none, or
  where this JAX does not say. A chain that holds a derivative's trace but
  starts afresh before reaching `top` is a custom rule's function, which JAX
  traces apart from the derivative around it (discovery's `jax.vjp`)."""
  chain, reached = _traces_since(top)
  if not reached and any(kind in ("LinearizeTrace", "JVPTrace", "JetTrace")
                         for kind, _ in chain):
    return CUSTOM
  for kind, purpose in chain:
    if kind == "LinearizeTrace":
      return REVERSE
    if kind in ("JVPTrace", "JetTrace"):         # jax.jvp; jax.experimental.jet
      return FORWARD
    if purpose in _CUSTOM_RULES:
      return CUSTOM
  return None


# The transforms whose body may not run in a pass: a branch of `lax.cond` /
# `lax.switch`, a `lax.while_loop`'s body. What JAX records as `traced_for` of
# the trace. A `lax.fori_loop`'s body is recorded alike whether its bounds are
# static (a scan: it runs) or traced (a while loop), and is not counted: JAX
# refuses to differentiate a while loop in reverse mode, so a trained layer
# can sit in one only under a user's custom VJP, where the capture cannot see
# it (`derivative_since`: refused).
MAY_NOT_RUN = frozenset({"cond", "switch", "while_body"})


def may_not_run(top: object) -> bool:
  """Whether the trace being built lies inside a transform whose body may not
  run (`MAY_NOT_RUN`) between it and `top` (a `current_trace()` taken
  earlier), read from the chain of traces JAX builds; where this JAX does not
  say (no chain to `top`, a trace without a record of what it traces for):
  whether it is inside any other trace at all, which includes them."""
  chain, reached = _traces_since(top)
  for kind, purpose in chain:
    if purpose is None and kind != "BatchTrace":      # unknown: assume it may not run
      return True
    if purpose in MAY_NOT_RUN:
      return True
  return not reached


def runs_in_branch(top: object) -> bool:
  """Whether the trace being built is known to lie inside a transform whose
  body may not run (`MAY_NOT_RUN`) between it and `top`: `may_not_run`
  without its guesses where JAX does not say."""
  chain, reached = _traces_since(top)
  return reached and any(purpose in MAY_NOT_RUN for _, purpose in chain)


# Explicit mesh axes (`jax.make_mesh`'s default on jax 0.10.2 and 0.12): an
# array's type then carries its sharding, and the library's reshapes and
# contractions of a sharded batch or FSDP-sharded parameters are refused by
# JAX's sharding rules ("ambiguous how the output should be sharded", "reshape
# is not supported"), its constants (on no mesh) mixed with arrays on the mesh
# too. Its entry points run such calls with those axes `Auto`, as a jit over
# unannotated arrays: XLA's partitioner lays out the body.

def explicit_mesh(tree) -> Any:
  """The mesh of the first array leaf of `tree` whose type lies on a mesh
  with `Explicit` axes, sharded over them or not (None if there is none: no
  mesh, `Auto` axes, or inside `shard_map`, where the axes are `Manual`).
  Replicated arrays count too: JAX refuses to mix them with the library's
  constants, which lie on no mesh (outside `jax.set_mesh`)."""
  for leaf in jax.tree_util.tree_leaves(tree):
    if not isinstance(leaf, jax.Array):
      continue
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is not None and _explicit_axes(mesh):
      return mesh
  return None


def _explicit_axes(mesh) -> tuple[str, ...]:
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == jax.sharding.AxisType.Explicit)


def sharding_as_given(tree, mesh) -> Any:
  """Each leaf's own partition spec (an array's type's) on `mesh`, else
  replicated: for a result of `on_auto_axes` shaped like an input."""
  def one(x: Any) -> jax.sharding.NamedSharding:
    spec = jax.typeof(x).sharding.spec if isinstance(x, jax.Array) else None
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec() if spec is None else spec)
  return jax.tree_util.tree_map(one, tree)


def replicated(mesh) -> jax.sharding.NamedSharding:
  """`P()` on `mesh`: every device the whole array."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def on_auto_axes(fun: Callable, args: tuple, kwargs: dict,
                 out_shardings: Callable[[Any], Any]) -> Any:
  """`fun(*args, **kwargs)`; where an array of them is sharded over `Explicit`
  mesh axes, run with the mesh's explicit axes `Auto`
  (`jax.sharding.auto_axes`) and the results resharded to
  `out_shardings(mesh)` (a pytree prefix of them: `NamedSharding`s); else
  exactly `fun(*args, **kwargs)`. Leaves that are not `jax.Array`s (flags,
  modules, numpy arrays) pass through as they are. JAX's errors there about
  `Auto` axes carry `AUTO_AXES_NOTE`."""
  mesh = explicit_mesh((args, kwargs))
  if mesh is None:
    return fun(*args, **kwargs)
  flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
  is_array = [isinstance(x, jax.Array) for x in flat]

  def on_arrays(*arrays: jax.Array) -> Any:
    given = iter(arrays)
    a, k = treedef.unflatten([next(given) if d else x for x, d in zip(flat, is_array)])
    return fun(*a, **k)
  try:
    return jax.sharding.auto_axes(on_arrays, axes=_explicit_axes(mesh),
                                  out_sharding=out_shardings(mesh))(
        *[x for x, d in zip(flat, is_array) if d])
  except Exception as error:    # pylint: disable=broad-except
    if "Auto" in str(error):      # JAX's, about the axes' type
      error.add_note(AUTO_AXES_NOTE)
    raise


AUTO_AXES_NOTE = (
    "kfac_jax_dist runs the loss function and the optimizer with the mesh's Explicit "
    "axes Auto (jax.sharding.auto_axes): explicit-sharding annotations inside the "
    "loss (reshard to a sharding naming a mesh axis or to a NamedSharding, "
    "out_sharding=) are refused there; see docs/distributed.md, 'Explicit mesh axes'.")


def cond(pred: Any, true_fun: Callable, false_fun: Callable) -> Any:
  """`lax.cond(pred, true_fun, false_fun)`; with a concrete `pred` (an eager
  call) the taken branch alone, op by op: an eager `lax.cond` of closures made
  anew on each call compiles a new program on every call."""
  if isinstance(pred, jax.core.Tracer):
    return jax.lax.cond(pred, true_fun, false_fun)
  return true_fun() if bool(pred) else false_fun()


def compiled_when_eager(update_fn: Callable, config: Any, needs: tuple[str, ...] = ()
                        ) -> Callable:
  """An optax `update_fn(updates, state, params=None, **extra)` that, called
  eagerly (no argument traced, every leaf an array), runs as one `jax.jit`
  program, compiled once per argument structure and kept with the transform.
  Op by op, its conditionals and loops (closures made anew on each call) were
  compiled on every call: 5 programs and 0.5 s a K-FAC step, JAX's caches
  growing by MBs. Under the user's jit, with a keyword of `needs` omitted or
  None (K-FAC's statistics, on a step known from its concrete state to update
  no factor), or with a hyperparameter of the dataclass `config` an array
  (`optax.inject_hyperparams` builds a new transform, with every number an
  array, each step: compiled, it would compile each step), it is `update_fn`
  itself."""
  jitted = jax.jit(update_fn)
  injected = any(isinstance(getattr(config, field.name), jax.Array)
                 for field in dataclasses.fields(config))

  @functools.wraps(update_fn)
  def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple:
    leaves = jax.tree_util.tree_leaves((updates, state, params, extra))
    if (injected or any(extra.get(name) is None for name in needs) or traced(leaves)
        or not all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)):
      return update_fn(updates, state, params, **extra)
    return jitted(updates, state, params, **extra)
  return update


def transform_update(update_fn: Callable, config: Any, needs: tuple[str, ...] = ()
                     ) -> Callable:
  """A preconditioner's optax `update_fn` as its transform exposes it:
  compiled once when called eagerly (`compiled_when_eager`), run with
  `Explicit` mesh axes `Auto` (`updates_on_auto_axes`)."""
  return updates_on_auto_axes(compiled_when_eager(update_fn, config, needs))


def updates_on_auto_axes(update_fn: Callable) -> Callable:
  """An optax `update_fn(updates, state, params=None, **extra)` run by
  `on_auto_axes`: the updates laid out as the incoming ones, the state's
  leaves as they came in."""
  @functools.wraps(update_fn)
  def update(updates: Any, state: Any, params: Any = None, *more: Any, **extra: Any
             ) -> tuple:                 # (`more`: for update_fn's own error)
    return on_auto_axes(update_fn, (updates, state, params, *more), extra, lambda mesh: (
        sharding_as_given(updates, mesh), sharding_as_given(state, mesh)))
  return update


def device_memory_limit() -> int | None:
  """The first local device's memory in bytes, where JAX reports it (GPU,
  TPU); None elsewhere (the CPU reports none)."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:    # pylint: disable=broad-except  (a backend without the call)
    return None
  return (stats or {}).get("bytes_limit")
