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
Decompositions run in float32 at least, in float64 for float64 factors
(`factor_dtype=jnp.float64`); the products run at `Precision.HIGHEST`.

Scale-and-shift layers (LayerNorm / BatchNorm) are preconditioned unit-wise
(SP-NGD §4.2.1): `unitwise_precondition` solves one damped 2×2 system per
channel in closed form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist.core.linalg import at_least_f32
from kfac_jax_dist.core.linalg import batched
from kfac_jax_dist.core.linalg import eigh  # noqa: F401  (the decomposition of "eigen")

_HI = lax.Precision.HIGHEST


def damped_inverse(factors: jax.Array, damping: jax.Array) -> jax.Array:
  """`(F + δ I)⁻¹` per slot by Cholesky, `damping` of shape `[n]`."""
  factors = at_least_f32(factors)
  if factors.ndim == 2:
    return 1.0 / (factors + damping[:, None])
  eye = jnp.eye(factors.shape[-1], dtype=factors.dtype)
  damped = 0.5 * (factors + jnp.swapaxes(factors, -1, -2)) + damping[:, None, None] * eye[None]
  return batched(lambda f, eye: jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(f), True),
                                                          eye), damped, eye)


def mean_traces(factors: jax.Array) -> jax.Array:
  """`tr F / dim F` of each slot of a bucket (full `[n, d, d]` or diagonal `[n, d]`)."""
  factors = at_least_f32(factors)
  if factors.ndim == 2:
    return jnp.mean(factors, axis=-1)
  return jnp.trace(factors, axis1=-2, axis2=-1) / factors.shape[-1]


def pi_adjusted_damping(trace_a: jax.Array, trace_g: jax.Array, damping
                        ) -> tuple[jax.Array, jax.Array]:
  """`(π√γ, √γ/π)` with `π² = (tr A/d_A)/(tr G/d_G)`, from the mean traces
  (floored at the smallest normal number of their dtype). The roots are
  taken before the quotient, which may overflow where π does not (a G of
  zeros: its trace floored at 1e-38 in float32)."""
  tiny = jnp.finfo(jnp.result_type(trace_a, trace_g)).tiny
  pi = jnp.sqrt(jnp.maximum(trace_a, tiny)) / jnp.sqrt(jnp.maximum(trace_g, tiny))
  root = jnp.sqrt(damping)
  return pi * root, root / pi


def _rotate(m, basis_a, basis_g, transpose: bool):
  """`Q_Aᵀ m Q_G` (`transpose`) or `Q_A m Q_Gᵀ`, batched over leading axes."""
  if basis_a is not None:
    m = jnp.matmul(_t(basis_a) if transpose else basis_a, m, precision=_HI)
  if basis_g is not None:
    m = jnp.matmul(m, basis_g if transpose else _t(basis_g), precision=_HI)
  return m


def _t(x: jax.Array) -> jax.Array:
  """The matrices' transposes (the last two axes swapped)."""
  return jnp.swapaxes(x, -1, -2)


def precondition_eigen(grad, basis_a, values_a, basis_g, values_g, damping, rows=None,
                       scaling=None):
  """`Q_A [(Q_Aᵀ ∇ Q_G) / (v_A v_Gᵀ + γ)] Q_Gᵀ`; a `None` basis is the identity.
  `rows=(lo, hi)`: only those rows of the result (`Q_A[lo:hi]` on the left).
  `scaling` `[d_A, d_G]` replaces `v_A v_Gᵀ` (EK-FAC, `kfac.correction`).
  Without `rows`, batched: `[k, d_A, d_G]` gradients with `[k, d, d]` bases
  and `[k, d]` values (`layout.precondition_runs`)."""
  m = _rotate(grad, basis_a, basis_g, transpose=True)
  if scaling is None:      # in the gradients' dtype (a 16-bit state's values read up)
    scaling = values_a[..., :, None].astype(m.dtype) * values_g[..., None, :].astype(m.dtype)
  m = m / (scaling.astype(m.dtype) + damping)
  if rows is not None:
    if basis_a is None:
      m = m[rows[0]:rows[1]]
    else:
      basis_a = basis_a[rows[0]:rows[1]]
  return _rotate(m, basis_a, basis_g, transpose=False)


def precondition_inverse(grad, inverse_a, inverse_g, rows=None):
  """`A_damped⁻¹ ∇ G_damped⁻¹`; 1-D inverses are diagonal. `rows=(lo, hi)`:
  only those rows of the result. Full inverses may be batched (`[k, d, d]`,
  gradients `[k, d_A, d_G]`)."""
  if rows is not None:
    inverse_a = inverse_a[rows[0]:rows[1]]
    if inverse_a.ndim == 1:
      grad = grad[rows[0]:rows[1]]
  m = inverse_a[:, None] * grad if inverse_a.ndim == 1 else jnp.matmul(
      inverse_a, grad, precision=_HI)
  return m * inverse_g[None, :] if inverse_g.ndim == 1 else jnp.matmul(
      m, inverse_g, precision=_HI)


def unitwise_precondition(grad_gamma: jax.Array, grad_beta: jax.Array | None,
                          fisher: jax.Array, damping) -> tuple[jax.Array, jax.Array | None]:
  """SP-NGD's unit-wise natural gradient of a scale-and-shift layer.

  For every channel c, with `F_c = [[f_γγ, f_γβ], [f_γβ, f_ββ]]` stored as the
  row `fisher[c] = (f_γγ, f_γβ, f_ββ)` (`factors.unitwise_fisher`),

      [vγ_c, vβ_c] = (F_c + λ I)⁻¹ [gγ_c, gβ_c]
                   = [(f_ββ + λ) gγ − f_γβ gβ,  (f_γγ + λ) gβ − f_γβ gγ] / det,
      det = (f_γγ + λ)(f_ββ + λ) − f_γβ²,

  the closed-form 2×2 inverse of Osawa et al. (SP-NGD) Eq. 17, with the full
  damping λ added to both diagonal entries (`(F_unitBN + λI)⁻¹`, SP-NGD §4.2.1;
  not the √λ split of the Kronecker factors). `grad_beta=None` (a scale-only
  layer, whose `F` has zero `γβ`, `ββ` entries) gives `gγ / (f_γγ + λ)` and
  returns `None` for β. Shapes: gradients `[C]` (or any `[..., C]`), `fisher`
  `[..., C, 3]`; the result has the gradients' dtypes, computed in float32 at
  least.
  """
  fisher = at_least_f32(jnp.asarray(fisher))
  dtype = jnp.promote_types(fisher.dtype, grad_gamma.dtype)
  damping = jnp.asarray(damping, dtype)
  f_gg, f_gb, f_bb = (fisher[..., i].astype(dtype) for i in range(3))
  g_gamma = grad_gamma.astype(dtype)
  if grad_beta is None:
    return (g_gamma / (f_gg + damping)).astype(grad_gamma.dtype), None
  g_beta = grad_beta.astype(dtype)
  a, d = f_gg + damping, f_bb + damping
  det = a * d - f_gb * f_gb
  v_gamma = (d * g_gamma - f_gb * g_beta) / det
  v_beta = (a * g_beta - f_gb * g_gamma) / det
  return v_gamma.astype(grad_gamma.dtype), v_beta.astype(grad_beta.dtype)
