"""The compiled training step of the tests: plain `jit` on one device, or
`jit(shard_map(...))` over a distribution's mesh with the state placed by
`kd.shard_state` and specs from `kd.partition_specs`."""

import jax
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd


def compile_step(step, state, dist, num_batch_args, param_specs=P(), extra_out=()):
  """`step(params, state, *batch) -> (params, state, *extra)` compiled; returns
  `(compiled step, state)`, the state placed on the mesh when distributed.
  Batch arguments are sharded over "data"; `extra_out` are the specs of the
  extra outputs."""
  if dist is None:
    return jax.jit(step), state
  state = kd.shard_state(state, dist.mesh)
  specs = kd.partition_specs(state)
  return jax.jit(jax.shard_map(
      step, mesh=dist.mesh, in_specs=(param_specs, specs) + (P("data"),) * num_batch_args,
      out_specs=(param_specs, specs) + tuple(extra_out))), state
