"""Placing an optax state that holds preconditioner states on a mesh.

Each preconditioner state says how its own leaves are sharded
(`PreconditionerState.partition_specs`); a tensor-parallel state prepends its
model axis (`tensor_parallel`); every other leaf (counters, other transforms'
states such as momentum) is replicated, or, on a tensor-parallel mesh, takes
the parameters' specs when it is shaped like them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from kfac_jax_dist.core import states
from kfac_jax_dist.core import tensor_parallel


def partition_specs(opt_state: Any) -> Any:
  """A `PartitionSpec` for every leaf of an optax state holding K-FAC or
  Shampoo states.

  Each K-FAC or Shampoo state gives its own (`partition_specs()` of the
  state: K-FAC's running factors sharded over the distribution's axis, its
  second-order state too unless there is a single owner group, COMM-OPT;
  Shampoo's statistics and roots when its layout is sharded). Every other leaf
  — counters, and the states of other transforms, e.g. momentum — is
  replicated (`P()`). Use the result as `shard_map` in_specs/out_specs and
  with `shard_state`.

  With a tensor-parallel `Distribution` (`model_axis`), each array leaf of a
  K-FAC / Shampoo state gets the model axis prepended on its first axis (see
  `tensor_parallel`), and the states of other transforms that are shaped like
  the parameters (e.g. momentum) get the `param_specs`.
  """
  replicated = jax.sharding.PartitionSpec()
  sharding = tensor_parallel.find_sharding(opt_state)

  def is_node(x: Any) -> bool:
    return isinstance(x, (states.PreconditionerState, tensor_parallel.ModelShardedState)
                      ) or (sharding is not None and sharding.matches(x))

  def node_spec(node: Any) -> Any:
    if isinstance(node, tensor_parallel.ModelShardedState):
      return tensor_parallel.inner_specs(node, partition_specs(node.inner))
    if sharding is not None and sharding.matches(node):
      return sharding.param_specs()
    if isinstance(node, states.PreconditionerState):
      return node.partition_specs()
    return replicated

  return jax.tree_util.tree_map(node_spec, opt_state, is_leaf=is_node)


def distributed_states(opt_state: Any) -> list[Any]:
  """The preconditioner states inside `opt_state` laid out over a mesh axis of
  several devices (K-FAC's, Shampoo's, SOAP's; adaptive K-FAC's and
  tensor-parallel ones hold them)."""
  has_layout = lambda x: isinstance(x, states.PreconditionerState) and hasattr(x, "layout")
  return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=has_layout)
          if has_layout(x) and x.layout.num_devices > 1 and x.layout.axis is not None]


def check_mesh(opt_state: Any, mesh: jax.sharding.Mesh, who: str) -> None:
  """Every distributed state of `opt_state` is laid out for as many devices as
  `mesh` has on its axis (a ValueError naming `who` otherwise)."""
  for state in distributed_states(opt_state):
    lay = state.layout
    if lay.axis not in mesh.shape or mesh.shape[lay.axis] != lay.num_devices:
      raise ValueError(
          f"{who}: the state is laid out for {lay.num_devices} devices of axis "
          f"{lay.axis!r}, the mesh has {dict(mesh.shape)}. Use the mesh of its "
          "Distribution (kd.convert_state moves a state to another one).")


def shard_state(opt_state: Any, mesh: jax.sharding.Mesh) -> Any:
  """Places a global optax state (e.g. fresh from `tx.init`) on `mesh` with the
  specs of `partition_specs`; the mesh must be the one its distributed states
  were laid out for."""
  check_mesh(opt_state, mesh, "shard_state")
  specs = partition_specs(opt_state)
  return jax.tree_util.tree_map(
      lambda s, x: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)), specs,
      opt_state)


def init_sharded(init_fn: Callable[[Any], Any], params: Any, mesh: jax.sharding.Mesh) -> Any:
  """`init_fn(params)` (e.g. `tx.init`) built on `mesh`, each leaf with the
  spec of `partition_specs`: one program (`jax.jit` with those
  `out_shardings`) in which each device builds its own shard (K-FAC's and
  Shampoo's identities elementwise, `core.initial`). No host holds the
  global state, as `shard_state(tx.init(params), mesh)` does; with several
  processes each builds only its devices' shards. The mesh must be the one
  the state's distributed states are laid out for (as for `shard_state`)."""
  shapes = jax.eval_shape(init_fn, params)
  check_mesh(shapes, mesh, "init_sharded")
  shardings = jax.tree_util.tree_map(
      lambda s: jax.sharding.NamedSharding(mesh, s), partition_specs(shapes),
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return jax.jit(init_fn, out_shardings=shardings)(params)
