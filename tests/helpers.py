"""Helpers shared by the test modules (imported as `helpers`; no test module
imports another).

* `mesh` / `data_mesh`: a device mesh of the first devices, or a skip where
  the backend has fewer (tests/conftest.py gives 8 host CPU devices; on one
  GPU only the single-device tests run: benchmarks/gpu_check.sh);
* `compile_step`: the compiled training step, plain `jit` on one device or
  `jit(shard_map(...))` over a distribution's mesh.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd


def mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
  """A mesh of the first prod(shape) devices; skips the test where the
  default backend has fewer."""
  n = math.prod(shape)
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, the {jax.default_backend()} backend has "
                f"{jax.device_count()}")
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), axes)


def data_mesh(n: int = 8) -> Mesh:
  """A one-axis mesh ("data",) of the first n devices."""
  return mesh((n,), ("data",))


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
