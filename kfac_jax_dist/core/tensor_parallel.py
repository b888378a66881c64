"""Tensor-parallel meshes: one K-FAC / Shampoo state per model shard.

On a 2-D mesh `("data", "model")` with parameters sharded over "model"
(Megatron-style: a column-parallel Dense kernel `[d_in, d_out]` sharded on
`d_out`, a row-parallel one on `d_in` with its output psum'd over "model" by the
model code), training runs inside `shard_map` over both axes and every device
sees its local shard of each parameter. As in 3D-Shampoo (Baumann 2023, §6:
"each rank's Shampoo statistics are those of its local shard"), each model
shard preconditions its local shard on its own, i.e. block-diagonally over the
tensor-parallel split:

* Shampoo: statistics and roots of the local shard (as if the shards were
  separate parameters);
* K-FAC Dense: factors of the local shard. Column-parallel: `A` of the full
  input (the same on every model shard) and `G` of the local output columns;
  row-parallel: `A` of the local input rows and `G` of the full output (the
  cotangent of the psum is the same on every shard). This is K-FAC of a model
  whose sharded layer is `M` separate layers on the column (row) blocks.

Within a model shard the data-parallel strategy of `Distribution` runs as on
one axis. The state is the single-axis state of one model shard, built from the
local shard shapes, `M` times: each array leaf is the concatenation of the `M`
shards' along its first axis, specced `P((model, ...))` on it (a scalar, the
same on every shard, stays `P()`). Parameters replicated over "model" (biases of
row-parallel layers, LayerNorm) have the same gradients on every model shard:
their state is kept (identically) by every shard, and their updates are read
from model shard 0 (a psum of its update and zeros, exact) so that they leave
`shard_map` replicated. K-FAC's KL clip sums `|⟨V, ∇⟩|` over every layer's
shards (a psum over "model", replicated layers counted once), and a step is
skipped on every device if any device saw a non-finite number.

Three-dimensional meshes (3D-Shampoo's data x operator x pipeline layout,
Baumann 2023, §6): `model_axis` may name several axes, e.g. `("model",
"stage")` on a `("data", "model", "stage")` mesh, where a stacked-blocks
parameter `[L, ...]` is sharded over "stage" on its stack axis (each stage
owns L/S blocks, as a pipeline lays them out) and its matrices over "model".
The model shards are then the `M = Π sizes` positions on those axes (ordered
row-major), the state's leaves are specced `P(("model", "stage", ...))`, and
a leaf replicated over some of the axes is read from position 0 of those.
Sharding a stack axis loses nothing: blocks have their own factors anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import PartitionSpec
import optax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import registry


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def check_distribution(dist) -> None:
  """Validates a `Distribution`'s `model_axis` (one mesh axis or a tuple of
  them) and `param_specs`."""
  if dist.model_axis is None:
    raise ValueError("Distribution: param_specs describe a tensor-parallel sharding; "
                     "pass model_axis= too (the mesh axis or axes they shard over).")
  axes = dist.model_axes
  if not axes or not all(isinstance(a, str) for a in axes):
    raise ValueError(f"Distribution: model_axis must be a mesh axis name or a tuple of "
                     f"them, got {dist.model_axis!r}.")
  for a in axes:
    if a not in dist.mesh.axis_names:
      raise ValueError(f"Distribution: model_axis {a!r} is not an axis of the mesh "
                       f"{dict(dist.mesh.shape)}.")
  if len(set(axes)) != len(axes):
    raise ValueError(f"Distribution: model_axis {dist.model_axis!r} names an axis twice.")
  if dist.axis in axes:
    raise ValueError(f"Distribution: model_axis and axis are both {dist.axis!r}; the "
                     "tensor-parallel axes must be other mesh axes.")
  if dist.param_specs is None:
    raise ValueError("Distribution: model_axis needs param_specs=, the PartitionSpec "
                     "of every parameter (a pytree like the parameters, or a prefix).")
  for path, spec in jax.tree_util.tree_flatten_with_path(dist.param_specs,
                                                         is_leaf=_is_spec)[0]:
    if not _is_spec(spec):
      raise ValueError(f"Distribution: param_specs['{registry.path_str(path)}'] is "
                       f"{spec!r}, not a PartitionSpec.")
    _sharded_dims(spec, axes, registry.path_str(path))


def _describe_axes(axes: tuple[str, ...]) -> str:
  return (f"axis {axes[0]!r}" if len(axes) == 1
          else "axes " + ", ".join(repr(a) for a in axes))


def _sharded_dims(spec: PartitionSpec, axes: tuple[str, ...], path: str
                  ) -> tuple[int | None, ...]:
  """The dimension `spec` shards over each of `axes` (None: replicated over it).
  One dimension may be sharded over several axes; one axis shards at most one
  dimension."""
  found: dict[str, int] = {}
  for dim, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    for name in names:
      if name is None:
        continue
      if name not in axes:
        raise ValueError(
            f"param_specs['{path}'] = {spec} shards over {name!r}: parameters may be "
            f"sharded over the tensor-parallel {_describe_axes(axes)} only (the data "
            "axis holds replicas; another mesh axis is not the Distribution's).")
      if name in found:
        raise ValueError(f"param_specs['{path}'] = {spec} shards several dimensions "
                         f"over {name!r}; at most one may be.")
      found[name] = dim
  return tuple(found.get(a) for a in axes)


def _leaf_specs(tree: Any, dist) -> list[tuple[str, Any, PartitionSpec]]:
  """`(path, leaf, spec)` of every leaf of `tree` (shaped like the parameters),
  `dist.param_specs` being a tree like it or a prefix of it."""
  try:
    specs = jax.tree_util.tree_map(
        lambda s, x: jax.tree_util.tree_map(lambda _: s, x), dist.param_specs, tree,
        is_leaf=_is_spec)
  except (ValueError, TypeError) as e:
    raise ValueError("Distribution.param_specs must be a pytree like the parameters "
                     f"(or a prefix of it): {e}") from e
  leaf_specs = jax.tree_util.tree_structure(tree).flatten_up_to(specs)
  return [(name, x, spec) for (name, x), spec in zip(registry.named_leaves(tree), leaf_specs)]


@dataclasses.dataclass(frozen=True)
class ModelSharding:
  """Static metadata: how the parameters are sharded over the model axes.

  Attributes:
    axes: the tensor-parallel mesh axes (e.g. `("model",)`, or `("model",
      "stage")` on a 3-D mesh).
    sizes: their numbers of devices; `size = Π sizes` is the number `M` of
      model shards, ordered row-major over `axes`.
    treedef: the parameters' tree structure.
    paths: every parameter leaf's path ("layer/kernel"), in tree order.
    shapes: the global shapes of the parameter leaves.
    specs: their `PartitionSpec`s.
    dims: per leaf, the dimension sharded over each of `axes` (None:
      replicated over that axis).
  """

  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  specs: tuple[PartitionSpec, ...]
  dims: tuple[tuple[int | None, ...], ...]

  @classmethod
  def of(cls, params, dist) -> ModelSharding:
    treedef = jax.tree_util.tree_structure(params)
    axes = dist.model_axes
    sizes = tuple(int(dist.mesh.shape[a]) for a in axes)
    paths, shapes, specs, dims = [], [], [], []
    for name, x, spec in _leaf_specs(params, dist):
      shape = tuple(jnp.shape(x))
      if len(spec) > len(shape):
        raise ValueError(f"param_specs['{name}'] = {spec} has more entries than the "
                         f"parameter has dimensions ({shape}).")
      leaf_dims = _sharded_dims(spec, axes, name)
      for dim in set(leaf_dims) - {None}:
        over = [a for a, d in zip(axes, leaf_dims) if d == dim]
        devices = math.prod(int(dist.mesh.shape[a]) for a in over)
        if shape[dim] % devices:
          raise ValueError(
              f"Parameter '{name}' of shape {shape}: dimension {dim} ({shape[dim]}) is "
              f"not divisible by the {devices} devices of model "
              f"{_describe_axes(tuple(over))}.")
      paths.append(name)
      shapes.append(shape)
      specs.append(spec)
      dims.append(leaf_dims)
    return cls(axes, sizes, treedef, tuple(paths), tuple(shapes), tuple(specs),
               tuple(dims))

  @property
  def size(self) -> int:
    """`M`, the number of model shards (devices of the model axes)."""
    return math.prod(self.sizes)

  def describe_axes(self) -> str:
    return _describe_axes(self.axes)

  def local_shape(self, i: int) -> tuple[int, ...]:
    shape = list(self.shapes[i])
    for dim, size in zip(self.dims[i], self.sizes):
      if dim is not None:
        shape[dim] //= size
    return tuple(shape)

  def replicated_axes(self, i: int) -> tuple[str, ...]:
    """The model axes over which leaf `i` is replicated."""
    return tuple(a for a, d in zip(self.axes, self.dims[i]) if d is None)

  def param_specs(self):
    """The `PartitionSpec` of every parameter leaf, as a tree like the parameters."""
    return self.treedef.unflatten(list(self.specs))

  def matches(self, node) -> bool:
    """Whether `node` is shaped like the (global) parameters, e.g. a momentum."""
    if isinstance(node, ModelShardedState) or _is_spec(node):
      return False
    leaves, treedef = jax.tree_util.tree_flatten(node)
    return treedef == self.treedef and all(
        hasattr(x, "shape") and tuple(x.shape) == s
        for x, s in zip(leaves, self.shapes))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner"],
                   meta_fields=["sharding"])
@dataclasses.dataclass(frozen=True)
class ModelShardedState:
  """A transform's state for every model shard.

  Attributes:
    inner: the single-axis state of one model shard, each array leaf
      concatenated over the `M` shards along its first axis (scalars once).
      Inside `shard_map` (specs from `kd.partition_specs`) it is that shard's.
    sharding: how the parameters are sharded (static).
  """

  inner: Any
  sharding: ModelSharding


def _tile(x, size: int):
  """`x` for each of `size` model shards, along its first axis: a broadcast
  and a reshape, which XLA's partitioner splits by device (a concatenation of
  copies it would build whole on each)."""
  x = jnp.asarray(x)
  if x.ndim == 0:
    return x
  return jnp.broadcast_to(x[None], (size,) + x.shape).reshape((size * x.shape[0],)
                                                              + x.shape[1:])


def model_shard(tree: Any, index: int | tuple[int, ...]) -> Any:
  """`tree` (e.g. an optax state of global arrays) with every model-sharded
  transform state replaced by model shard `index`'s single-axis state: what
  one device of that shard holds for `kd.running_factors` and the like.
  `index`: the shard's position on each model axis (a tuple), or its
  row-major number over them."""
  def one(node: Any) -> Any:
    if not isinstance(node, ModelShardedState):
      return node
    sizes = node.sharding.sizes
    flat = _shard_number(index, node.sharding.axes, sizes)
    return jax.tree_util.tree_map(
        lambda x: x if jnp.ndim(x) == 0 else jnp.split(jnp.asarray(x),
                                                        math.prod(sizes))[flat],
        node.inner)
  return jax.tree_util.tree_map(one, tree,
                                is_leaf=lambda x: isinstance(x, ModelShardedState))


def _shard_number(index: Any, axes: tuple[str, ...], sizes: tuple[int, ...]) -> int:
  """`model_shard`'s `index` as the shard's row-major number, checked against
  the model axes `axes` of `sizes` devices."""
  where = (f"kd.model_shard: index={index!r} for {math.prod(sizes)} model shards "
           f"({', '.join(f'{a!r}: {n}' for a, n in zip(axes, sizes))})")
  position = tuple(index) if isinstance(index, (tuple, list)) else None
  try:
    numbers = [operator.index(i) for i in ((index,) if position is None else position)]
  except TypeError:
    raise TypeError(f"{where}: an int or a tuple of ints, one per model axis") from None
  if position is None:
    if not 0 <= numbers[0] < math.prod(sizes):
      raise ValueError(f"{where}: a shard number must be in [0, {math.prod(sizes)})")
    return numbers[0]
  if len(numbers) != len(sizes) or not all(0 <= i < n for i, n in zip(numbers, sizes)):
    raise ValueError(f"{where}: a position has {len(sizes)} entries (one per model "
                     "axis), each in [0, that axis's size)")
  return int(np.ravel_multi_index(tuple(numbers), sizes))


def stack_shards(shards: list[Any]) -> Any:
  """The inverse of `model_shard` for one transform's state: the `M` model
  shards' single-axis states (the same structure) as `ModelShardedState.inner`,
  each array leaf concatenated along its first axis (scalars, the same on
  every shard, once)."""
  def stack(*xs: Any) -> Any:
    return xs[0] if jnp.ndim(xs[0]) == 0 else jnp.concatenate([jnp.asarray(x) for x in xs])
  return jax.tree_util.tree_map(stack, *shards)


def inner_specs(node: ModelShardedState, specs: Any) -> Any:
  """The specs of a `ModelShardedState` from its inner state's single-axis
  `specs`: the model axes prepended on the first axis of every array leaf."""
  axes = node.sharding.axes

  def prepend(spec: PartitionSpec, x: Any) -> PartitionSpec:
    if jnp.ndim(x) == 0:
      return PartitionSpec()
    first = spec[0] if len(spec) else None
    rest = tuple(spec[1:])
    first = () if first is None else first if isinstance(first, tuple) else (first,)
    names = axes + first
    return PartitionSpec(names[0] if len(names) == 1 else names, *rest)
  return dataclasses.replace(node, inner=jax.tree_util.tree_map(
      prepend, specs, node.inner, is_leaf=_is_spec))


def find_sharding(tree: Any) -> ModelSharding | None:
  """The `ModelSharding` of the model-sharded states in `tree` (None: none)."""
  found = {x.sharding for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, ModelShardedState))
           if isinstance(x, ModelShardedState)}
  if len(found) > 1:
    raise ValueError("The state holds model-sharded transforms of different "
                     "parameter shardings.")
  return found.pop() if found else None


def replicated_axes(tree: Any, dist) -> dict[str, tuple[str, ...]]:
  """The model axes over which `dist.param_specs` replicates each leaf of
  `tree` (shaped like the parameters), by path."""
  axes = dist.model_axes
  return {name: tuple(a for a, d in zip(axes, _sharded_dims(spec, axes, name))
                      if d is None)
          for name, _, spec in _leaf_specs(tree, dist)}


def on_shard_zero(axes: tuple[str, ...]) -> jax.Array:
  """Whether this device is at position 0 of every one of `axes`."""
  mine = jnp.asarray(True)
  for a in axes:
    mine = mine & (lax.axis_index(a) == 0)
  return mine


def from_shard_zero(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`x` of the model shards at position 0 of `axes`, typed replicated over
  them: a psum of its value and zeros (exact)."""
  axes = tuple(a for a in axes if a in _compat.varying_axes(x))
  if not axes:
    return x
  return lax.psum(jnp.where(on_shard_zero(axes), x, jnp.zeros_like(x)), axes)


def _check_axis_sizes(sharding: ModelSharding, name: str) -> None:
  """The enclosing shard_map has the state's model axes, of its sizes."""
  for axis, expected in zip(sharding.axes, sharding.sizes):
    try:
      size = lax.axis_size(axis)
    except NameError as e:
      raise ValueError(
          f"{name} is tensor-parallel over mesh {sharding.describe_axes()}: call "
          "update inside jax.shard_map over the data and model axes, with "
          "in_specs/out_specs from kd.partition_specs(opt_state) and the "
          "param_specs.") from e
    if size != expected:
      raise ValueError(f"update runs in a shard_map whose axis {axis!r} has {size} "
                       f"devices, but the state was built for {expected}.")


def for_model_shards(tx: optax.GradientTransformationExtraArgs, dist, name: str,
                     check=None) -> optax.GradientTransformationExtraArgs:
  """`tx` as it is without model axes (no distribution, or a data axis only);
  on a tensor-parallel mesh `wrap(tx, dist, name, check)`: one state per model
  shard. The one place the public transforms decide it."""
  if dist is None or not dist.model_axes:
    return tx
  return wrap(tx, dist, name, check)


def wrap(inner: optax.GradientTransformationExtraArgs, dist, name: str,
         check=None) -> optax.GradientTransformationExtraArgs:
  """`inner` (a single-axis transform over `dist.axis`) for every model shard.

  `init` builds `inner`'s state from the local shard shapes (`check(sharding)`
  may reject a sharding the transform cannot precondition) and stacks it for
  the `M` shards. `update` runs inside `shard_map` over the data and model
  axes on the local shards; gradients and the `kfac_stats` are typed varying
  over the model axes (the per-shard state is), and the updates of
  parameters replicated over a model axis leave replicated over it (shard
  0's, see the module docstring).
  """
  axes = dist.model_axes

  def init_fn(params: Any) -> ModelShardedState:
    sharding = ModelSharding.of(params, dist)
    if check is not None:
      check(sharding)
    flat = sharding.treedef.flatten_up_to(params)
    # local shards of the shapes' parameters: traced when `params` are (the
    # state is then built in the program, by each device for its own shard
    # under jit with out_shardings), else abstract (built on the host)
    local_param = jnp.zeros if _compat.traced(params) else jax.ShapeDtypeStruct
    local = sharding.treedef.unflatten([
        local_param(sharding.local_shape(i), jnp.result_type(x)) for i, x in enumerate(flat)])
    state = inner.init(local)
    return ModelShardedState(
        jax.tree_util.tree_map(lambda x: _tile(x, sharding.size), state), sharding)

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any
                ) -> tuple[Any, ModelShardedState]:
    if not isinstance(state, ModelShardedState):
      raise TypeError(f"{name}: this transform is tensor-parallel over "
                      f"{_describe_axes(axes)}; give it the state of its own init.")
    sharding = state.sharding
    _check_axis_sizes(sharding, name)
    flat = sharding.treedef.flatten_up_to(updates)
    for i, x in enumerate(flat):
      if tuple(jnp.shape(x)) != sharding.local_shape(i):
        raise ValueError(
            f"{name}: the update of '{sharding.paths[i]}' has shape {jnp.shape(x)}, "
            f"expected its local shard {sharding.local_shape(i)} (global "
            f"{sharding.shapes[i]}): call update inside shard_map with the "
            "param_specs.")
    varying = functools.partial(_compat.as_varying, axes=axes)
    extra_args = {k: (varying(v) if k == "kfac_stats" and v is not None else v)
                  for k, v in extra_args.items()}
    new_updates, new_inner = inner.update(varying(updates), state.inner, params,
                                          **extra_args)
    out = sharding.treedef.flatten_up_to(new_updates)
    out = [from_shard_zero(x, sharding.replicated_axes(i)) for i, x in enumerate(out)]
    return (sharding.treedef.unflatten(out),
            dataclasses.replace(state, inner=new_inner))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_kfac_layers(layers, sharding: ModelSharding) -> None:
  """Rejects a tagged layer whose local kernel shape is not its shard's, a
  kernel sharded on a conv's spatial axis, and a row-parallel layer (kernel
  sharded on an input axis) whose tag adds a bias: the bias belongs after
  the psum over the model axis. A stack axis may be sharded (each shard then
  owns whole blocks, e.g. a pipeline stage's: their factors are exact)."""
  for layer in layers:
    if layer.kernel_path not in sharding.paths:
      continue
    i = sharding.paths.index(layer.kernel_path)
    kind = (f"a grouped convolution (feature_group_count={layer.groups})"
            if layer.groups > 1 else
            "a layer with a transposed kernel" if layer.transposed_kernel else None)
    if kind and any(dim is not None for dim in sharding.dims[i]):
      raise ValueError(
          f"Tagged layer '{layer.name}' is {kind} whose kernel is sharded over a model "
          "axis; K-FAC supports such layers with replicated kernels only: replicate "
          "it, or leave it untagged.")
    if layer.leaf_shape(layer.kernel_shape) != tuple(sharding.local_shape(i)):
      raise ValueError(
          f"Tagged layer '{layer.name}' has kernel shape {layer.kernel_shape}, not its "
          f"local shard's {sharding.local_shape(i)}: discover the layers with "
          "grad_fn.discover(params, *batch, distribution=dist).")
    for axis, dim in zip(sharding.axes, sharding.dims[i]):
      if dim is not None and dim >= len(layer.stack):
        _check_kernel_dim(layer, axis, layer.applied_axis(dim - len(layer.stack)))


def _check_kernel_dim(layer, axis: str, dim: int) -> None:
  """Kernel dimension `dim` of `layer` (of the kernel it applies, `kernel_shape`)
  is sharded over `axis`: it must be an input or output channel axis, and an
  input one only without a tagged bias."""
  shape = layer.kernel_shape
  if layer.kind in registry.CONV_KINDS and dim < len(shape) - 2:
    stored = ("" if layer.kernel_axes is None else
              f" (the stored {layer.leaf_shape(shape)[len(layer.stack):]}'s axis "
              f"{layer.kernel_axes[dim]}, kernel_axes={layer.kernel_axes})")
    raise ValueError(
        f"Tagged layer '{layer.name}': its kernel {shape} (local) is sharded over "
        f"{axis!r} on spatial axis {dim}{stored}; K-FAC needs the input or output "
        "channels sharded (row- or column-parallel).")
  if layer.kind == "dense" or layer.kind in registry.CONV_KINDS:
    rows = layer.a_dim - layer.has_bias
    in_dims = next((k for k in range(len(shape) + 1) if math.prod(shape[:k]) == rows),
                   len(shape) - 1)
    if dim < in_dims and layer.has_bias:
      raise ValueError(
          f"Tagged layer '{layer.name}' is row-parallel (its kernel is sharded over "
          f"{axis!r} on input axis {dim}) and its tag adds a bias, which "
          "every model shard would add before the psum: add the bias after the "
          "psum, outside the tag.")
