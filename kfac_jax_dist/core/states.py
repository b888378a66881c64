"""What every preconditioner state of the library shares.

`PreconditionerState` is the base of `ScaleByKfacState` and
`ScaleByShampooState`: frozen dataclasses registered as pytrees, with an update
`count` and a `skipped` counter (see `faults`), that answer for their own
placement on a mesh (`partition_specs`). Code that must find them inside an
optax state tree (the capture, the fault wrapper, `kd.partition_specs`,
checkpoints) asks this base, so it never imports the optimizers themselves.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax

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
