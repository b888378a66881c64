"""Scanned and stacked layers: one set of factors per block.

A layer applied inside `nn.scan` / `nn.vmap` (`variable_axes={"params": 0}`),
`nnx.scan` / `nnx.vmap` over a module created with `nnx.vmap`, or a plain
`lax.scan` over stacked weights sees one *block* (slice) of a stacked
parameter leaf `[L, ...]`. Two things then differ from an ordinary tag:

* discovery cannot find the kernel by identity (the tag sees a slice made
  inside the transform), so the layer names its leaf another way;
* a probe closed over by the loop body would receive the *sum* of every
  iteration's statistics. Each block's probe must instead be sliced by the
  same transform that slices the parameters, so that autodiff stacks the
  probes' cotangents: `stats[name] = {"A": [L, a, a], "G": [L, g, g]}`.

Three routes (`Site` records what a route found for one tag call):

* linen (`kd.linen` layers): the module's scope path names the leaf (the one
  leaf of the parameter tree whose path ends with `<scope path>/<param>` and
  whose shape ends with the block's shape; the leading axes are the stack). At
  capture, `kd.value_and_grad` injects the zero probes into the parameter tree
  as a sibling entry `PROBE_KEY` of the kernel, stacked like it, so flax slices
  them with the parameters; the layer reads its block's probes from its scope.
* NNX (`kd.nnx` layers): `prepare` stamps every `nnx.Variable` of the
  parameter state with its leaf path (metadata `"kfac_path"`, which NNX carries
  through `merge`, `scan` and `vmap`). At capture, the kernel Variable of a
  stacked layer holds `Probed(kernel, probes)` instead of the array, so NNX
  slices both; the layer unwraps it.
* plain JAX (`kd.tags.*(..., stack_index=i)`): the tag receives the stacked
  leaves themselves (found by identity) and the block index (a Python int or a
  traced integer, e.g. a loop counter), and slices the kernel, bias and the
  stacked probes itself; the transpose of that slice writes block `i`'s
  statistics into slot `i`.

The user's gradients never contain probes: they are a separate argument of
the capture's `jax.vjp`, inserted into the tree only inside the traced loss.

The registry records a stacked layer once, with `stack = (L,)` (leading axes
only; several for nested scans); the optimizer's layout expands it into one
layer per block (`TaggedLayer.blocks`).

A layer (or block) that runs several times in one pass — a plain `lax.scan`
closing over one unstacked kernel, a stack applied twice, a pipeline stage's
blocks once per micro-batch, a layer called twice, nn.scan's
`variable_broadcast="params"` — gets K-FAC-expand's statistics for weight
sharing: every run's positions count as its examples (`A` the mean over all
the runs' positions, `G` their sum; `statistics.POSITIONS`). Not supported: stack axes other
than the leading ones (raises: at discovery where the shapes show it, else at
the first capture, where the probes fail to slice like the parameters:
`ValueAndGrad._check_stack_axes`); NNX parameters given as a pure dict
(raises: not a leaf).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import context as _context
from kfac_jax_dist.capture import registry

PROBE_KEY = "__kfac_probes__"     # linen: the injected parameter entry
PATH_METADATA = "kfac_path"       # NNX: Variable metadata naming its leaf
LINEN, NNX = "linen", "nnx"


@dataclasses.dataclass(frozen=True)
class Site:
  """Where a tag call's parameters live, when identity matching cannot say.

  `kernel_path`, `bias_path`: the leaves (stacked ones: `[*stack, ...]`);
  `stack`: their leading stack axes (`()`: not stacked, e.g. a layer under
  `nn.remat`); `probes`: at capture, this block's probes as sliced by
  flax/NNX (None: the probes come by name); `index`: the block index of the
  plain route; `carrier`: how the capture hands probes to a stacked linen or
  NNX layer, `(LINEN, module path)` or `(NNX, kernel path)`.
  """

  kernel_path: str | None
  bias_path: str | None
  stack: tuple[int, ...]
  probes: Any = None
  index: tuple | None = None
  carrier: tuple[str, str] | None = None


# A Flax layer whose kernel depends on the parameters through other leaves
# than its own (`linen_site`): it runs untagged, reported as uncaptured.
UNTAGGED = Site(kernel_path=None, bias_path=None, stack=())


@jax.tree_util.register_pytree_node_class
class Probed:
  """An NNX kernel value carrying its layer's probes through `nnx.scan` /
  `nnx.vmap` (only inside `kd.value_and_grad`'s capture). A model may read
  its `shape`, `dtype`, `ndim`, `size`, `len` and `[...]` outside the layer
  (Gemma's attention reads its heads from its kernels' shapes), as the
  array's."""

  def __init__(self, array, probes):
    self.array, self.probes = array, probes

  shape = property(lambda self: self.array.shape)
  dtype = property(lambda self: self.array.dtype)
  ndim = property(lambda self: self.array.ndim)
  size = property(lambda self: self.array.size)

  def __getitem__(self, index):     # `variable[...]`, Flax's read of a value
    return self.array[index]

  def __len__(self) -> int:
    return len(self.array)

  def tree_flatten(self):
    return (self.array, self.probes), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)


def owner_path(leaf_path: str) -> str:
  """The path of the module that holds a parameter leaf (`"fc1/kernel"` →
  `"fc1"`; a boxed leaf's path has no box key, `registry.path_str`): the
  leaf path without its own name."""
  return "/".join(leaf_path.split("/")[:-1])


def stack_of(name: str, path: str, leaf_shape, block_shape) -> tuple[int, ...]:
  """The leading stack axes of a leaf holding blocks of `block_shape`."""
  leaf_shape, block_shape = tuple(leaf_shape), tuple(block_shape)
  k = len(leaf_shape) - len(block_shape)
  if k < 0 or leaf_shape[k:] != block_shape:
    raise ValueError(
        f"Tagged layer '{name}': parameter '{path}' has shape {leaf_shape}, which "
        f"does not end with the shape {block_shape} the layer uses. Stacked layers "
        "must stack their parameters along leading axes (nn.scan / nn.vmap with "
        "variable_axes={'params': 0}, nnx.vmap / nnx.scan with axis 0); a kernel "
        "computed from the parameter (transposed or reshaped from another layout, "
        "reparameterised) cannot be tagged: store it in the layer's layout, or leave "
        "the layer to a plain, untagged one.")
  return leaf_shape[:k]


def _check_followed(trace, what: str, kernel_path: str, kernel) -> None:
  """Warn, at discovery, where a kernel at the loss's own trace level is not
  its leaf `kernel_path` but has its dtype: computed from it (a weight or
  spectral norm, a standardisation, a transpose, MAML's adapted weights),
  not cast or sliced by a transform. The layer's factors, the applied
  kernel's, then precondition the leaf's gradient: right only where the map
  is close to the identity (its Jacobian is not applied)."""
  if (trace.mode != _context.DISCOVER or _compat.current_trace() is not trace.top
      or jnp.result_type(kernel) != trace.leaf_dtypes.get(kernel_path)):
    return
  warnings.warn(
      f"kfac_jax_dist: layer '{what}' applies a kernel computed from parameter "
      f"'{kernel_path}' (not the leaf itself, nor a cast of it: a weight or spectral "
      "norm, a standardisation, a transpose, MAML's adapted weights). K-FAC "
      "preconditions the parameter's gradient with the factors of the kernel "
      "applied, which ignores the map's Jacobian: close to right for a map near the "
      "identity (an inner-loop step), wrong in scale for a normalisation. Pass "
      f"skip=[...] naming '{what}' to leave it unpreconditioned.", stacklevel=2)


def _site(trace, what, kernel_path, bias_path, kernel, bias, **fields) -> Site:
  stack = stack_of(what, kernel_path, trace.leaf_shapes[kernel_path], kernel.shape)
  if bias_path is not None:
    bias_stack = stack_of(what, bias_path, trace.leaf_shapes[bias_path], bias.shape)
    if bias_stack != stack:
      raise ValueError(f"Tagged layer '{what}': kernel '{kernel_path}' is stacked "
                       f"{stack} but bias '{bias_path}' {bias_stack}.")
  return Site(kernel_path, bias_path, stack, **fields)


# --- plain JAX: stack_index -------------------------------------------------

def index_site(kernel, bias, stack_index):
  """`(kernel block, bias block, Site | None)` for `kd.tags.*(..., stack_index=)`."""
  index = tuple(stack_index) if isinstance(stack_index, (tuple, list)) else (stack_index,)
  if kernel.ndim <= len(index):
    raise ValueError(f"stack_index {stack_index!r} needs a kernel with more than "
                     f"{len(index)} axes, got {kernel.shape}")
  stack = tuple(kernel.shape[:len(index)])
  if bias is not None and tuple(bias.shape[:len(index)]) != stack:
    raise ValueError(f"stack_index: bias {bias.shape} is not stacked like the "
                     f"kernel {kernel.shape}")
  block = lambda leaf: None if leaf is None else leaf[index]
  trace = _context.tagging()
  if trace is None:
    return block(kernel), block(bias), None
  site = Site(trace.path_of(kernel), trace.path_of(bias), stack, index=index)
  return block(kernel), block(bias), site


# --- linen ------------------------------------------------------------------

def _by_suffix(trace, suffix: tuple[str, ...], block_shape, what: str) -> str | None:
  matches = [path for path in trace.leaf_shapes
             if tuple(path.split("/")[-len(suffix):]) == suffix]
  if len(matches) > 1:              # e.g. two models with the same module names
    k = len(block_shape)
    matches = [path for path in matches
               if tuple(trace.leaf_shapes[path][-k:] if k else ()) == tuple(block_shape)]
  if len(matches) > 1:
    raise ValueError(
        f"Tagged linen layer '{what}' runs inside a transform (nn.scan, nn.vmap, "
        f"nn.remat, ...) and several parameter leaves end with its path: {matches}. "
        "Give the layer a unique module path, or pass only its model's parameters.")
  return matches[0] if matches else None


def linen_site(module, kernel, bias, kernel_name: str, bias_name: str | None):
  """The Site of a `kd.linen` layer whose kernel is not a leaf of the loss's
  parameters (inside a lifted transform, or cast), or None: also for one at
  the loss's top level whose kernel does not depend on the parameters (a
  frozen or another model's layer: `context.independent_of_parameters`),
  whatever leaf its module path ends like. `UNTAGGED` (warned, reported as
  uncaptured) where no leaf at its module path holds it: a tied weight
  applied by another module, a kernel merged from parameters passed apart."""
  trace = _context.tagging()
  if (trace is None or trace.path_of(kernel) is not None
      or _context.independent_of_parameters(trace, kernel)):
    return None
  scope = tuple(str(p) for p in module.scope.path)
  what = "/".join(scope) or type(module).__name__
  # A module applied on its own (no path: the loss's model, or a tied head
  # `lm_head.apply(...)`) owns only top-level leaves, not every one ending so.
  own = lambda name, leaf: (
      _by_suffix(trace, scope + (name,), leaf.shape, what) if scope else next(
          (p for p in (name, f"params/{name}") if p in trace.leaf_shapes), None))
  kernel_path = own(kernel_name, kernel)
  bias_path = None if bias is None else own(bias_name, bias)
  if kernel_path is None or (bias is not None and bias_path is None):
    missing = kernel_name if kernel_path is None else bias_name
    reason = (f"its {missing} computed from parameters that are not its own leaves (a "
              "tied weight: lm_head.apply({'params': {'kernel': embedding.T}}, h); a "
              "merged LoRA kernel whose base is passed apart)")
    warnings.warn(
        f"kfac_jax_dist: Flax layer '{what}' is not tagged: {reason}. The gradients "
        "of those parameters are preconditioned by their own layers (a tied table by "
        "its lookup's factors) or pass through unpreconditioned; pass the parameters "
        "it is computed from in the first argument to follow it to its own leaf.",
        stacklevel=4)
    _context.record_uncaptured(what, type(module).__name__, reason)
    return UNTAGGED
  _check_followed(trace, what, kernel_path, kernel)
  parts = kernel_path.split("/")
  probes = (module.get_variable("params", PROBE_KEY)
            if module.has_variable("params", PROBE_KEY) else None)
  return _site(trace, what, kernel_path, bias_path, kernel, bias, probes=probes,
               carrier=(LINEN, "/".join(parts[:-1])))


# --- NNX ----------------------------------------------------------------------

def _raw(variable):
  if variable is None:
    return None
  get = getattr(variable, "get_value", None)
  return get() if get is not None else variable.value


def _metadata(variable) -> dict:
  get = getattr(variable, "get_metadata", None)
  return dict(get()) if get is not None else dict(getattr(variable, "metadata", {}))


def variable_path(variable) -> str | None:
  """The leaf path the capture stamped on an NNX Variable (None: unstamped)."""
  return _metadata(variable).get(PATH_METADATA)


def nnx_site(kernel_var, bias_var):
  """`(kernel, bias, Site | None)` of a `kd.nnx` layer: the arrays its
  Variables hold (a `Probed` kernel unwrapped) and, when the kernel is not a
  leaf of the loss's parameters (inside `nnx.scan` / `nnx.vmap` / ...), where
  the Variables' stamped paths say they live."""
  kernel, bias = _raw(kernel_var), _raw(bias_var)
  probes = None
  if isinstance(kernel, Probed):
    kernel, probes = kernel.array, kernel.probes
  trace = _context.tagging()
  if trace is None or trace.path_of(kernel) is not None:
    return kernel, bias, None
  kernel_path = _metadata(kernel_var).get(PATH_METADATA)
  bias_path = None if bias_var is None else _metadata(bias_var).get(PATH_METADATA)
  if kernel_path not in trace.leaf_shapes or (
      bias is not None and bias_path not in trace.leaf_shapes):
    return kernel, bias, None
  what = "/".join(kernel_path.split("/")[:-1]) or kernel_path
  _check_followed(trace, what, kernel_path, kernel)
  return kernel, bias, _site(trace, what, kernel_path, bias_path, kernel, bias,
                             probes=probes, carrier=(NNX, kernel_path))


# --- capture: stamping and carrying -----------------------------------------

def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _raw_value(variable):
  get = getattr(variable, "get_raw_value", None)
  return get() if get is not None else variable.raw_value


def _stamped(variable, path: str, wrap=None):
  value = _raw_value(variable)
  return variable.replace(value if wrap is None else Probed(value, wrap),
                          **{PATH_METADATA: path})


def prepare(params, carried: dict[str, tuple[tuple[str, str], Any]] | None = None):
  """The parameter tree the loss sees inside `kd.value_and_grad`.

  NNX Variables are stamped with their leaf path (a copy with metadata
  `"kfac_path"`; values untouched). `carried` maps a stacked layer's name to
  `(carrier, probes)`: linen probes are added as the entry `PROBE_KEY` of the
  layer's parameter dict, NNX probes wrap the kernel Variable's value.
  """
  carried = carried or {}
  wraps = {path: probes for (kind, path), probes in carried.values() if kind == NNX}
  injects = {path: probes for (kind, path), probes in carried.values() if kind == LINEN}
  if any(_is_variable(x) for x in jax.tree_util.tree_leaves(params, is_leaf=_is_variable)):
    def stamp(var_path: tuple, node: Any) -> Any:
      if not _is_variable(node):
        return node
      inner = jax.tree_util.tree_flatten_with_path(node)[0]
      if len(inner) != 1:
        return node
      path = registry.path_str(tuple(var_path) + tuple(inner[0][0]))
      return _stamped(node, path, wraps.pop(path, None))
    params = jax.tree_util.tree_map_with_path(stamp, params, is_leaf=_is_variable)
  if wraps:
    raise ValueError(f"Stacked NNX layers' kernels {sorted(wraps)} are not held by "
                     "nnx.Variables of the parameters given to kd.value_and_grad.")
  for prefix, probes in injects.items():
    params = _inject(params, prefix.split("/") if prefix else [], probes, prefix)
  return params


def _inject(node, keys: list[str], probes, prefix: str):
  if not isinstance(node, Mapping):
    raise ValueError(
        f"kd.value_and_grad passes the probes of the stacked layer at '{prefix}' "
        f"as an entry of its parameter dict, but a {type(node).__name__} lies on "
        "that path; use dicts (linen's parameter trees) for stacked linen layers.")
  entries = dict(node)
  if keys:
    key = next((k for k in entries if str(k) == keys[0]), None)
    if key is None:
      raise ValueError(f"Stacked layer at '{prefix}': '{keys[0]}' not found.")
    entries[key] = _inject(entries[key], keys[1:], probes, prefix)
  else:
    entries[PROBE_KEY] = probes
  try:
    return type(node)(entries)
  except TypeError:
    return entries
