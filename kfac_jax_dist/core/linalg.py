"""Decompositions shared by both preconditioners, safe on every backend.

`eigh` is the symmetric eigendecomposition of a batch of PSD matrices (K-FAC's
factors, Shampoo's statistics), in float32 at least, eigenvalues clipped at 0.
`batched` runs a per-matrix function over a batch: one batched call on
accelerators, one call per matrix on CPU (see its docstring); `eigh` also runs
one matrix at a time on CUDA above `GPU_BATCHED_EIGH_MAX_DIM`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax import lax


def at_least_f32(x: jax.Array) -> jax.Array:
  """`x` in float32 at least."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# jaxlib's batched cuSOLVER eigh is slow on large matrices. Measured on an H100
# (jax 0.11.2; benchmarks/results/gpu/summary.md): 8.4 ms per matrix in a batch
# of 4 x 257 and 26 ms in 2 x 513, against 2.7 and 5.9 ms one at a time; a
# batch of 8 x 129 took 0.23 ms per matrix (between 129 and 257: not measured).
GPU_BATCHED_EIGH_MAX_DIM = 192


# Up to this many slots, "one at a time" is written out slot by slot: the
# loop's own kernels (its zero-filled outputs, slot reads and writes, counter)
# took 0.17 s of XLA:CPU's compile for a batch of two 64x64 eighs on the
# step_time CNN, against 0.04 s for two written out.
UNROLLED_MAX_SLOTS = 4


def one_matrix_per_call(fn: Callable) -> Callable:
  """`fn`, which decomposes or solves one matrix, run one matrix per call
  under any outer `jax.vmap` too (a user's vmap of the training step over
  seeds or settings), as a loop. jaxlib's batched CPU eigh / cholesky / LU
  fan the batch out over XLA's intra-op thread pool from inside that pool,
  and deadlock when every pool thread waits: a K-FAC step vmapped over 3
  seeds hung on this 2-core machine, every pool thread in `ParallelBatchMap`.
  `fn` must take every traced value it reads as an argument (it is traced on
  its own: a closed-over tracer would escape). Not reverse-differentiable:
  nothing differentiates the preconditioner."""
  return custom_batching.sequential_vmap(fn)


def batched(fn: Callable, stacked: jax.Array, *shared: Any,
            one_at_a_time_on_cuda: bool = False):
  """`fn(slot, *shared)` on every `[d, d]` slot of `stacked`: one batched call
  on accelerators, one call per slot on CPU (written out up to
  `UNROLLED_MAX_SLOTS`, else `lax.map`), and on CUDA too if
  `one_at_a_time_on_cuda` (`lax.map`); one call per matrix under an outer
  `jax.vmap` too (`one_matrix_per_call`: `fn` closes over no traced value,
  `shared` passes them). jaxlib's batched CPU eigh/cholesky fans the batch
  out over XLA's intra-op thread pool from inside that pool, and deadlocks
  when every pool thread waits (seen on 2-core machines)."""
  one = one_matrix_per_call(fn)

  def written_out(s: jax.Array, *shared: Any) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                  *[one(s[i], *shared) for i in range(s.shape[0])])

  if stacked.shape[0] == 1:
    return written_out(stacked, *shared)
  one_at_a_time = lambda s, *shared: lax.map(lambda x: one(x, *shared), s)
  on_cpu = written_out if stacked.shape[0] <= UNROLLED_MAX_SLOTS else one_at_a_time
  cuda = {"cuda": one_at_a_time} if one_at_a_time_on_cuda else {}
  return lax.platform_dependent(stacked, *shared, cpu=on_cpu, **cuda,
                                default=jax.vmap(fn, (0,) + (None,) * len(shared)))


def eigh(factors: jax.Array, symmetric: bool = False
         ) -> tuple[jax.Array | None, jax.Array]:
  """Batched eigendecomposition; eigenvalues clipped at 0 (factors are PSD).
  `factors` are symmetrised first unless `symmetric` says they are exactly
  (unpacked from a triangle: the average would read every number twice)."""
  factors = at_least_f32(factors)
  if factors.ndim == 2:                      # diagonal factors
    return None, jnp.maximum(factors, 0.0)
  if not symmetric:
    factors = 0.5 * (factors + jnp.swapaxes(factors, -1, -2))
  values, vectors = batched(
      lambda f: jnp.linalg.eigh(f, symmetrize_input=False), factors,
      one_at_a_time_on_cuda=factors.shape[-1] > GPU_BATCHED_EIGH_MAX_DIM)
  return vectors, jnp.maximum(values, 0.0)
