"""The registry of tagged layers: what `kd.value_and_grad` discovered.

A `TaggedLayer` names a layer, its kind, the paths of its parameters in the
parameter tree given to the loss function, and the dimensions of its Kronecker
factors `A` (inputs, bias folded in) and `G` (outputs). The registry is static
(hashable) metadata: it fixes the optimizer state's layout at `init`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

Path = tuple  # a tuple of jax.tree_util keys


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: Path) -> str:
  """`('Dense_0', 'kernel')`-style key path as `"Dense_0/kernel"`."""
  return "/".join(_key_name(k) for k in path)


@dataclasses.dataclass(frozen=True)
class TaggedLayer:
  """One tagged layer: `kernel` (and `bias`) preconditioned with `A ⊗ G`.

  `kernel_shape` is the parameter's shape; the preconditioned matrix is the
  kernel reshaped to `(a_dim - has_bias, g_dim)` with the bias as a last row.
  """

  name: str
  kind: str                 # "dense" | "conv2d"
  kernel_path: str          # path_str of the kernel leaf
  bias_path: str | None
  kernel_shape: tuple[int, ...]
  a_dim: int
  g_dim: int

  @property
  def has_bias(self) -> bool:
    return self.bias_path is not None


@dataclasses.dataclass(frozen=True)
class LayerRegistry:
  """The tagged layers of a loss function, in the order they ran."""

  layers: tuple[TaggedLayer, ...]

  def __iter__(self):
    return iter(self.layers)

  def __len__(self):
    return len(self.layers)

  def names(self) -> tuple[str, ...]:
    return tuple(layer.name for layer in self.layers)


def leaves_by_path(tree: Any) -> dict[str, Any]:
  """`{path_str: leaf}` of a parameter (or gradient) tree."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_str(path): leaf for path, leaf in flat}
