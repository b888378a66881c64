"""The registry of tagged layers: what `kd.value_and_grad` discovered.

A `TaggedLayer` names a layer, its kind, the paths of its parameters in the
parameter tree given to the loss function, and the dimensions of its Kronecker
factors `A` (inputs, bias folded in) and `G` (outputs). The registry is static
(hashable) metadata: it fixes the optimizer state's layout at `init`.

Kinds and the statistics `kd.value_and_grad` returns for them (see `factors`):

* "dense" (also `kd.tags.dense_general`), "conv1d", "conv2d", "conv3d":
  `{"A": [a, a], "G": [g, g]}`
  (either may be a diagonal `[d]` when the optimizer asks for one);
* "embed": `{"A": [V], "G": [d, d]}`; `A` is diagonal by construction
  (`a_diagonal=True`): the token frequencies of the vocabulary rows;
* "scale_and_shift": `{"F": [C, 3]}`, SP-NGD's unit-wise Fisher, one 2×2 block
  over `(γ_c, β_c)` per channel, stored as `(γγ, γβ, ββ)`; `a_dim = 2` (or 1
  without offset) and `g_dim = C` describe the `(a_dim, C)` matrix `[γ; β]`.

A *stacked* layer (`stack != ()`: a layer inside `nn.scan` / `nnx.scan` /
`nnx.vmap`, or a plain tag with `stack_index=`) is one record whose parameter
leaves carry the leading stack axes `stack` (`[L, *kernel_shape]`); its
statistics carry them too (`{"A": [L, a, a], "G": [L, g, g]}`). The optimizer
treats each block as a layer of its own (`TaggedLayer.blocks`): block `l` is
named `"<name>/<l>"` and preconditions slice `l` of the stacked gradient with
its own factors, exactly as if the blocks were unrolled.

A *grouped* convolution (`feature_group_count = n > 1`, depthwise when every
group has one input channel) is `n` independent convolutions, group `i`
mapping input channels `[i·c_in, (i+1)·c_in)` to output channels `[i·c_out,
(i+1)·c_out)`. It is recorded as a stacked layer of `n` blocks (`groups = n`,
`stack = (*outer, n)`, `outer` the stack axes of scanned blocks, if any;
`kernel_shape` `(*window, c_in, c_out)` and `a_dim`, `g_dim` one group's), so
that each group gets its own Kronecker factors (block-diagonal over the
groups: exact K-FAC for the groups, which share no weight); only the way its
blocks lie in the leaves differs, inside the kernel's last axis
(`leaf_blocks`, `blocks_leaf`).

A *transposed kernel* (`transposed_kernel=True`: Flax's `ConvTranspose` with
`transpose_kernel=True`, PyTorch's convention; a dense layer's `(out, in)`
weight, PyTorch's and Equinox's `Linear`, whose window is empty) is stored
`(*window, out, in)` and applied flipped over its window with the two channel
axes swapped (`lax.conv_transpose`): `kernel_shape` is that applied kernel's
`(*window, in, out)`, whose rows the factors describe, and `leaf_blocks` /
`blocks_leaf` flip and swap between it and the leaf.

A *permuted kernel* (`kernel_axes`: an einsum Dense layer whose kernel holds
its contracted axes elsewhere than first, Gemma's `BTD,NDH->BTNH`; PyTorch's
and Equinox's convolution weights `(out, in, *window)`) is applied as
`jnp.transpose(leaf, kernel_axes)`, `(*in, *out)` / `(*window, in, out)`
(then flipped and swapped if it is also transposed; a grouped convolution's
groups then split its last axis): `kernel_shape` is that applied kernel's,
and `leaf_blocks` / `blocks_leaf` transpose between it and the leaf.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

Path = tuple  # a tuple of jax.tree_util keys


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


# The attribute that holds a boxed parameter's array: an NNX Variable's, a
# linen `Partitioned`'s (flax.core.meta).
BOX_ATTRIBUTES = ("value", "raw_value")


def path_str(path: Path) -> str:
  """`('Dense_0', 'kernel')`-style key path as `"Dense_0/kernel"`; a boxed
  parameter's (an NNX Variable's array, a linen `Partitioned`'s) without its
  box's attribute key, as the bare array's: the Variables' `nnx.State` that
  `tx.init` sees and the pure arrays that `nnx.Optimizer.update` hands
  `tx.update` name the same leaves. For one leaf known to be a box's; a
  tree's leaves are named by `path_strs`."""
  if _ends_in_box_key(path):
    path = path[:-1]
  return "/".join(_key_name(k) for k in path)


def _ends_in_box_key(path: Path) -> bool:
  return (len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey)
          and path[-1].name in BOX_ATTRIBUTES)


def path_strs(paths: list[Path]) -> list[str]:
  """The names of a tree's leaves: `path_str`, except that a box's attribute
  key is dropped only where the node holds that one leaf. A container of
  several leaves whose fields happen to be called `value` and `raw_value` (a
  NamedTuple, a dataclass) keeps the field names, so its leaves stay apart."""
  below: dict[Path, int] = {}
  for path in paths:
    for k in range(len(path)):
      below[path[:k]] = below.get(path[:k], 0) + 1
  return ["/".join(_key_name(k) for k in (
      p[:-1] if _ends_in_box_key(p) and below[p[:-1]] == 1 else p)) for p in paths]


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """`[(name, leaf)]` of a parameter (or gradient) tree, named by `path_strs`."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return list(zip(path_strs([p for p, _ in flat]), [x for _, x in flat]))


def check_array_leaves(name: str, params: Any) -> None:
  """Every parameter leaf is an array (or a number): a model object's other
  leaves (an Equinox module's activation functions, a config) are refused by
  path, with how to split them off."""
  for leaf_name, leaf in named_leaves(params):
    if not (hasattr(leaf, "dtype") or isinstance(leaf, (int, float, complex))):
      raise TypeError(
          f"{name}: parameter leaf '{leaf_name}' is a {type(leaf).__name__}, not an "
          "array; pass the parameters as a pytree of arrays and the rest of the model "
          "apart (Equinox: params, static = eqx.partition(model, eqx.is_inexact_array), "
          "rebuilt in the loss with eqx.combine(params, static); Flax NNX: nnx.split).")


def check_patterns(name: str, patterns: Any, empty: str = "none") -> tuple[str, ...]:
  """A sequence of regular expressions naming layers (a bare string would be
  read as its characters; None is not "none": that is `()`, which means
  `empty`): `skip=`, Shampoo's `stacked=`, `kd.tags.row_mask`'s `layers=`."""
  if (isinstance(patterns, str) or not isinstance(patterns, Iterable)
      or not all(isinstance(p, str) for p in patterns)):
    raise TypeError(f"{name} must be a sequence of regular expressions (e.g. "
                    f"[\"head\"], or () for {empty}), got {patterns!r}")
  for pattern in patterns:
    try:
      re.compile(pattern)
    except re.error as error:
      raise ValueError(f"{name}: {pattern!r} is not a regular expression ({error}).") from None
  return tuple(patterns)


@dataclasses.dataclass(frozen=True)
class TaggedLayer:
  """One tagged layer: `kernel` (and `bias`) preconditioned with `A ⊗ G`.

  `kernel_shape` is the parameter's shape; the preconditioned matrix is the
  kernel reshaped to `(a_dim - has_bias, g_dim)` with the bias, flattened, as a
  last row. For an embedding the kernel is the table `[V, d]` (`a_dim = V`);
  for a scale-and-shift layer it is the scale `[C]` and the bias the offset.

  `a_diagonal`: `A` is diagonal by construction (embeddings: one-hot inputs),
  so its statistic is always the vector of its diagonal, whatever the
  optimizer's `max_factor_dim`. `bias_shape`: the bias parameter's shape,
  `(g_dim,)` unless a `dense_general` layer has several output axes (`None`:
  no bias, or a layer recorded before this field existed).

  `stack`: the leading stack axes of a stacked layer's kernel (and bias)
  leaves, e.g. `(L,)` for `L` scanned blocks; `kernel_shape` and `bias_shape`
  are then one block's. `stack_index` and `stack_name` are set on the per-block
  records of `blocks()` only: which block, and the stacked layer (the key of
  the statistics) it belongs to. `groups`: a grouped convolution's
  `feature_group_count` (its blocks are the groups, the last stack axis).
  `transposed_kernel`: the kernel leaf is the applied kernel flipped over
  its window, channel axes swapped (see the module docstring).
  `kernel_axes`: the applied kernel is `jnp.transpose(leaf block,
  kernel_axes)` (a permuted kernel; `None`: the leaf's own order).
  `may_sit_out`: every application runs inside a `lax.cond` / `lax.switch`
  branch or a `lax.while_loop` body (`_compat.MAY_NOT_RUN`), so a pass may give it no position
  (the optimizer then leaves its factors as they are; see `kfac.factors`).
  `row_masked`: an application runs under a row mask (`tags.row_mask`) that
  leaves rows out of its `A`, so its devices (and passes) may see different
  numbers of positions, none included. `partly_sits_out`: some applications
  run inside such a branch or body, others outside (a shared block that a
  layer drop or a halting loop runs again), so the number of its positions
  varies, never to none. Any of the three makes it `counted`.
  `under_derivative`: every application lies under a derivative the loss
  function takes itself (`_compat.derivative_since`: a force field's `-∇E`, a
  PINN's residual, a user's `jax.custom_vjp`), where the capture never sees the
  loss's backward pass through the layer: no statistics (K-FAC refuses such a
  layer unless skipped). `also_under_derivative`: some applications lie under
  one, the others outside (a PINN's residual and boundary term, a gradient
  penalty, MAML's inner step, a forward pass shared with a penalty through
  `jax.vjp`): its statistics are those of the applications outside (K-FAC
  warns).
  """

  name: str
  kind: str                 # "dense" | "conv1d|2d|3d" | "embed" | "scale_and_shift"
  kernel_path: str          # path_str of the kernel leaf
  bias_path: str | None
  kernel_shape: tuple[int, ...]
  a_dim: int
  g_dim: int
  a_diagonal: bool = False
  bias_shape: tuple[int, ...] | None = None
  stack: tuple[int, ...] = ()
  stack_index: tuple[int, ...] | None = None
  stack_name: str | None = None
  groups: int = 1
  transposed_kernel: bool = False
  kernel_axes: tuple[int, ...] | None = None
  may_sit_out: bool = False
  row_masked: bool = False
  partly_sits_out: bool = False
  under_derivative: str | None = None
  also_under_derivative: str | None = None

  @property
  def has_bias(self) -> bool:
    return self.bias_path is not None

  @property
  def counted(self) -> bool:
    """Whether its statistics carry the positions its `A` averages over
    (`statistics.POSITIONS`), by which the optimizer weighs `A` over the
    devices and tells whether it ran: `may_sit_out`, `row_masked` or
    `partly_sits_out`."""
    return self.may_sit_out or self.row_masked or self.partly_sits_out

  @property
  def bias_block_shape(self) -> tuple[int, ...]:
    """One block's bias shape (`bias_shape`, `(g_dim,)` when not recorded)."""
    return tuple(self.bias_shape or (self.g_dim,))

  @property
  def stats_name(self) -> str:
    """The key of this layer's statistics (a block's: its stacked layer's)."""
    return self.stack_name or self.name

  def blocks(self) -> tuple["TaggedLayer", ...]:
    """One record per block of a stacked layer, in row-major order, named
    `"<name>/<i>"` (`"<name>/<i>/<j>"` for two stack axes); `(self,)` for a
    layer that is not stacked."""
    if not self.stack or self.stack_index is not None:
      return (self,)
    return tuple(
        dataclasses.replace(self, name="/".join([self.name, *map(str, index)]),
                            stack_index=index, stack_name=self.name)
        for index in itertools.product(*(range(n) for n in self.stack)))

  @property
  def block_number(self) -> int | None:
    """A block's position in its stacked layer, counted row-major over the
    stack axes (`blocks()` order); None for a layer that is not a block."""
    if self.stack_index is None:
      return None
    number = 0
    for index, size in zip(self.stack_index, self.stack):
      number = number * size + index
    return number

  def _is_kernel(self, block_shape: tuple[int, ...]) -> bool:
    """Whether leaves of `block_shape` are the kernel's (not the bias's)."""
    return tuple(block_shape) == tuple(self.kernel_shape)

  def _leaf_stack(self) -> int:
    """The stack axes a kernel leaf holds first (a grouped convolution's
    groups, the last stack axis, lie in its last axis instead)."""
    return len(self.stack) - (self.groups > 1)

  def _stacked_axes(self, inverse: bool) -> tuple[int, ...]:
    """`kernel_axes` (or its inverse) on a leaf with the stack axes first."""
    axes = tuple(np.argsort(self.kernel_axes)) if inverse else self.kernel_axes
    k = self._leaf_stack()
    return tuple(range(k)) + tuple(k + int(a) for a in axes)

  def applied_axis(self, leaf_axis: int) -> int:
    """The axis of the applied kernel (`kernel_shape`) that is `leaf_axis` of
    one block's kernel leaf: itself unless the kernel is permuted."""
    return leaf_axis if self.kernel_axes is None else self.kernel_axes.index(leaf_axis)

  def leaf_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a parameter leaf whose blocks are `block_shape` (the
    kernel's `kernel_shape` or the bias's): `[*stack, *block_shape]`; a
    grouped convolution's groups (the last stack axis) side by side in the
    last axis; a transposed kernel's channel axes swapped; a permuted
    kernel's axes in the leaf's order."""
    shape, kernel = tuple(block_shape), self._is_kernel(block_shape)
    if self.groups > 1:
      shape = shape[:-1] + (self.groups * shape[-1],)
    if kernel and self.transposed_kernel:
      shape = channels_swapped(shape)
    if kernel and self.kernel_axes is not None:
      shape = tuple(shape[i] for i in np.argsort(self.kernel_axes))
    return tuple(self.stack[:self._leaf_stack()]) + shape

  def leaf_blocks(self, leaf: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    """`[blocks, *block_shape]`: every block of a parameter leaf (the
    stacked layer's blocks, a grouped convolution's groups; a single layer's
    leaf with a leading axis of one; a transposed or permuted kernel as
    applied)."""
    kernel = self._is_kernel(block_shape)
    if kernel and self.kernel_axes is not None:
      leaf = jnp.transpose(leaf, self._stacked_axes(inverse=False))
    if kernel and self.transposed_kernel:
      leaf = flip_swap(leaf, len(self.kernel_shape) - 2)
    if self.groups > 1:            # [*outer, ..., n, c] → [*outer, n, ..., c]
      grouped = leaf.reshape(leaf.shape[:-1] + (self.groups, block_shape[-1]))
      leaf = jnp.moveaxis(grouped, -2, len(self.stack) - 1)
    return leaf.reshape((-1,) + tuple(block_shape))

  def blocks_leaf(self, blocks: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    """The parameter leaf of `blocks` (`[blocks, *block_shape]`, or its
    numbers in that order): the inverse of `leaf_blocks`."""
    leaf = blocks.reshape(tuple(self.stack) + tuple(block_shape))
    if self.groups > 1:
      leaf = jnp.moveaxis(leaf, len(self.stack) - 1, -2)
      leaf = leaf.reshape(leaf.shape[:-2] + (self.groups * block_shape[-1],))
    kernel = self._is_kernel(block_shape)
    if kernel and self.transposed_kernel:
      leaf = flip_swap(leaf, len(self.kernel_shape) - 2)
    if kernel and self.kernel_axes is not None:
      leaf = jnp.transpose(leaf, self._stacked_axes(inverse=True))
    return leaf.reshape(self.leaf_shape(block_shape))

  @property
  def unitwise(self) -> bool:
    """Preconditioned with a 2×2 block per channel (`"F"`), not `A ⊗ G`."""
    return self.kind in UNITWISE_KINDS


def channels_swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
  """A kernel shape `(..., c, c')` as `(..., c', c)`: a transposed kernel's
  leaf ↔ the kernel it applies."""
  return tuple(shape[:-2]) + (shape[-1], shape[-2])


def flip_swap(kernels: jax.Array, window: int) -> jax.Array:
  """`[..., *window, c, c']` flipped over its `window` spatial axes, `c` and
  `c'` swapped: its own inverse (a transposed kernel's leaf ↔ the kernel it
  applies, as `lax.conv_transpose(transpose_kernel=True)`)."""
  axes = tuple(range(kernels.ndim - 2 - window, kernels.ndim - 2))
  return jnp.swapaxes(jnp.flip(kernels, axes), -1, -2)


UNITWISE_KINDS = ("scale_and_shift",)
CONV_KINDS = ("conv1d", "conv2d", "conv3d")     # kernels `(*window, in, out)`


@dataclasses.dataclass(frozen=True)
class UncapturedLayer:
  """A layer the Flax wrappers or the interception left to Flax (its
  parameters pass through K-FAC unpreconditioned): its module path, its kind
  ("Conv", "ConvTranspose", ...) and why."""

  where: str
  kind: str
  reason: str


@dataclasses.dataclass(frozen=True)
class LayerRegistry:
  """The tagged layers of a loss function, in the order they ran, and the
  layers it ran that could not be captured."""

  layers: tuple[TaggedLayer, ...]
  uncaptured: tuple[UncapturedLayer, ...] = ()

  def __iter__(self):
    return iter(self.layers)

  def __len__(self):
    return len(self.layers)

  def names(self) -> tuple[str, ...]:
    return tuple(layer.name for layer in self.layers)


def check_layers(layers: Any) -> None:
  """`layers` must be None or what `grad_fn.discover(...)` returned (a
  `LayerRegistry`), not layer names nor a list picked from it."""
  if layers is None or isinstance(layers, LayerRegistry):
    return
  raise TypeError(
      "layers must be the LayerRegistry that kd.value_and_grad(loss_fn).discover(params, "
      f"*batch) returns, got {type(layers).__name__} {layers!r:.80}; to leave layers "
      "out, pass skip=[regular expressions] instead.")


def leaves_by_path(tree: Any) -> dict[str, Any]:
  """`{name: leaf}` of a parameter (or gradient) tree (`named_leaves`)."""
  return dict(named_leaves(tree))
