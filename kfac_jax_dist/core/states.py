"""What every preconditioner state of the library shares.

`PreconditionerState` is the base of `ScaleByKfacState` and
`ScaleByShampooState`: frozen dataclasses registered as pytrees, with an update
`count` and a `skipped` counter (see `faults`), that answer for their own
placement on a mesh (`partition_specs`). Code that must find them inside an
optax state tree (the capture, the fault wrapper, `kd.partition_specs`,
checkpoints) asks this base, so it never imports the optimizers themselves.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

import jax

from kfac_jax_dist import _compat

S = TypeVar("S")


class PreconditionerState:
  """Base class of the library's optimizer states.

  Subclasses are dataclasses with at least the fields `count` (accepted
  updates) and `skipped` (skipped updates), and implement `partition_specs`.
  """

  count: jax.Array
  skipped: jax.Array

  def partition_specs(self) -> Any:
    """This state with a `PartitionSpec` in place of every array leaf."""
    raise NotImplementedError


def find_states(tree: Any, kind: type[S] = PreconditionerState) -> list[S]:
  """Every node of type `kind` inside a pytree (e.g. an optax state)."""
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kind))
  return [x for x in leaves if isinstance(x, kind)]


def check_kind(state: Any, kind: type[PreconditionerState], transform: str) -> None:
  """A clear error when `transform`'s update gets a state that is not its own
  (e.g. another optimizer's `opt_state`), before any field of it is read."""
  if not isinstance(state, kind):
    raise TypeError(f"{transform}.update got a {type(state).__name__} as its state; "
                    f"it takes the {kind.__name__} that its own init returned (is "
                    "this another optimizer's opt_state?).")


def check_params(params: Any, transform: str) -> None:
  """A clear error where `transform`'s init gets optax's `tree_map_params`
  placeholder instead of the parameters: the state holds arrays laid out by
  layers and blocks (packed factors, eigenbases), no copy of the parameter
  tree that the placeholder could stand for."""
  if type(params).__name__ == "_ParamsPlaceholder":
    raise TypeError(
        f"{transform}: optax.tree_map_params is not supported: the state's arrays are "
        "laid out by layers and blocks (packed factors, eigenbases, roots), not shaped "
        "like the parameters. Map the state with jax.tree.map, or take its shardings "
        "from kd.partition_specs(state).")


def per_device_bytes(state: PreconditionerState, shards: int = 1) -> int:
  """Bytes of the state's arrays on one device: a leaf specced over the axis
  holds 1/P of its numbers there, every other leaf all of them; of a state
  kept for `shards` model shards (`tensor_parallel`), one shard's."""
  lay, specs = state.layout, state.partition_specs()
  leaves = jax.tree_util.tree_leaves(state)
  spec_leaves = jax.tree_util.tree_leaves(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  total = 0
  for leaf, spec in zip(leaves, spec_leaves):
    sharded = lay.axis is not None and len(spec) > 0 and spec[0] is not None
    tiled = shards if leaf.ndim else 1           # scalars are kept once
    total += leaf.size * leaf.dtype.itemsize // (lay.num_devices if sharded else 1) // tiled
  return total


# A state above this share of a device's memory is worth a warning at `init`:
# the model, its gradients, the activations and XLA's buffers need the rest.
DEVICE_MEMORY_SHARE = 0.5


def check_device_memory(state: PreconditionerState, transform: str, remedies: str) -> None:
  """Warns where the state takes more than `DEVICE_MEMORY_SHARE` of a
  device's memory (where JAX reports it: GPU, TPU; not the CPU), which would
  otherwise surface as the first step's out-of-memory error."""
  limit = _compat.device_memory_limit()
  need = per_device_bytes(state)
  if limit and need > DEVICE_MEMORY_SHARE * limit:
    warnings.warn(
        f"{transform}: its state takes {need / 2**30:.2f} GiB per device, {need / limit:.0%} "
        f"of the device's {limit / 2**30:.2f} GiB, before the model, its gradients and "
        f"activations. {remedies}", stacklevel=3)
