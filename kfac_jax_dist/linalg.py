"""Matrix functions of the Kronecker factors and the preconditioned gradient.

The gradient of a layer is the matrix `∇` of shape `(d_A, d_G)` (kernel rows,
bias as the last row). With `F = A ⊗ G` acting as `∇ ↦ A ∇ G`:

* eigen (KAISA §4.1, Grosse & Martens): with `A = Q_A diag(v_A) Q_Aᵀ` and
  `G = Q_G diag(v_G) Q_Gᵀ`, the exact damped inverse is
  `V = Q_A [(Q_Aᵀ ∇ Q_G) / (v_A v_Gᵀ + γ)] Q_Gᵀ = (A ⊗ G + γ I)⁻¹ vec(∇)`.
* inverse (Martens & Grosse 2015 §6.3; DP-KFAC Eq. 14): factored Tikhonov
  damping with `π² = (tr A / d_A) / (tr G / d_G)`:
  `V = (A + π√γ I)⁻¹ ∇ (G + √γ/π I)⁻¹`.

Diagonal factors (`[d]` instead of `[d, d]`) have the identity as eigenbasis.
Decompositions run in float32 at least.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _at_least_f32(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _batched(fn, stacked: jax.Array):
  """`fn` on every `[d, d]` slot of `stacked`: one batched call on accelerators,
  one call per slot (`lax.map`) on CPU. jaxlib's batched CPU eigh/cholesky fans
  the batch out over XLA's intra-op thread pool from inside that pool, and
  deadlocks when every pool thread waits (seen on 2-core machines)."""
  if stacked.shape[0] == 1:
    return jax.tree_util.tree_map(lambda x: x[None], fn(stacked[0]))
  return lax.platform_dependent(stacked, cpu=lambda s: lax.map(fn, s),
                                default=jax.vmap(fn))


def eigh(factors: jax.Array) -> tuple[jax.Array | None, jax.Array]:
  """Batched eigendecomposition; eigenvalues clipped at 0 (factors are PSD)."""
  factors = _at_least_f32(factors)
  if factors.ndim == 2:                      # diagonal factors
    return None, jnp.maximum(factors, 0.0)
  factors = 0.5 * (factors + jnp.swapaxes(factors, -1, -2))
  values, vectors = _batched(lambda f: jnp.linalg.eigh(f, symmetrize_input=False),
                             factors)
  return vectors, jnp.maximum(values, 0.0)


def damped_inverse(factors: jax.Array, damping: jax.Array) -> jax.Array:
  """`(F + δ I)⁻¹` per slot by Cholesky, `damping` of shape `[n]`."""
  factors = _at_least_f32(factors)
  if factors.ndim == 2:
    return 1.0 / (factors + damping[:, None])
  eye = jnp.eye(factors.shape[-1], dtype=factors.dtype)
  damped = 0.5 * (factors + jnp.swapaxes(factors, -1, -2)) + damping[:, None, None] * eye
  return _batched(
      lambda f: jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(f), True), eye), damped)


def mean_traces(factors: jax.Array) -> jax.Array:
  """`tr F / dim F` of each slot of a bucket (full `[n, d, d]` or diagonal `[n, d]`)."""
  factors = _at_least_f32(factors)
  if factors.ndim == 2:
    return jnp.mean(factors, axis=-1)
  return jnp.trace(factors, axis1=-2, axis2=-1) / factors.shape[-1]


def pi_adjusted_damping(trace_a: jax.Array, trace_g: jax.Array, damping
                        ) -> tuple[jax.Array, jax.Array]:
  """`(π√γ, √γ/π)` with `π² = (tr A/d_A)/(tr G/d_G)`, from the mean traces."""
  tiny = jnp.finfo(jnp.float32).tiny
  pi = jnp.sqrt(jnp.maximum(trace_a, tiny) / jnp.maximum(trace_g, tiny))
  root = jnp.sqrt(damping)
  return pi * root, root / pi


def _rotate(m, basis_a, basis_g, transpose: bool):
  if basis_a is not None:
    m = jnp.matmul(basis_a.T if transpose else basis_a, m, precision=_HI)
  if basis_g is not None:
    m = jnp.matmul(m, basis_g if transpose else basis_g.T, precision=_HI)
  return m


def precondition_eigen(grad, basis_a, values_a, basis_g, values_g, damping):
  """`Q_A [(Q_Aᵀ ∇ Q_G) / (v_A v_Gᵀ + γ)] Q_Gᵀ`; a `None` basis is the identity."""
  m = _rotate(grad, basis_a, basis_g, transpose=True)
  m = m / (values_a[:, None] * values_g[None, :] + damping)
  return _rotate(m, basis_a, basis_g, transpose=False)


def precondition_inverse(grad, inverse_a, inverse_g):
  """`A_damped⁻¹ ∇ G_damped⁻¹`; 1-D inverses are diagonal."""
  m = inverse_a[:, None] * grad if inverse_a.ndim == 1 else jnp.matmul(
      inverse_a, grad, precision=_HI)
  return m * inverse_g[None, :] if inverse_g.ndim == 1 else jnp.matmul(
      m, inverse_g, precision=_HI)
