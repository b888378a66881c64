"""Inverse p-th roots of symmetric positive semi-definite matrices, for Shampoo.

For a statistic `H ⪰ 0` of dimension `d` and an integer `p ≥ 1`, both methods
return

    X ≈ (H + r I)^{-1/p},   r = ε_ridge · max(λ_max(H), 1e-16),

with a *relative* ridge (Anil et al. 2020, "Scalable Second Order Optimization
for Deep Learning", §3 and App. A; Baumann 2023, Alg. 4). The ridge never
modifies `H` itself.

* `method="newton"` — the coupled Newton (Schur–Newton) iteration of Guo &
  Higham 2006 ("A Schur–Newton method for the matrix p-th root and its
  inverse"), as used by Anil et al. With `A = H + r I`, `α = −1/p` and
  `z = (1 + p) / (2‖A‖_F)` (so that the spectrum of `zA` lies in `(0, (p+1)/2]`):

      X₀ = z^{1/p} I,   M₀ = z A,
      M̂ = (1 − α) I + α M_k,   X_{k+1} = X_k M̂,   M_{k+1} = M̂^p M_k.

  `M_k = X_k^p A` is invariant, so `M_k → I` means `X_k → A^{-1/p}`. The error
  is `max |M_k − I|`; the loop stops when it is below `tolerance`, after
  `max_iterations`, or when a step would multiply `‖M_k − I‖_F` by more than
  `divergence_factor` (1.2 in Anil et al.); that step is then discarded. In
  exact arithmetic every eigenvalue `μ` of `M_k` moves monotonically toward 1
  (`|f(μ) − 1| ≤ |μ − 1|` for `f(μ) = (1 + (1 − μ)/p)^p μ` on `(0, (p+1)/2]`),
  so `‖M_k − I‖_F` never grows and a growth is rounding taking over. (The
  elementwise max can grow in the first steps of a healthy iteration, so it is
  not used for the guard.) `λ_max` comes from a power iteration. All matmuls
  run at `Precision.HIGHEST`.
* `method="eigh"` — `A = Q diag(v) Qᵀ` (eigenvalues clipped at 0), then
  `X = Q diag((v + r)^{-1/p}) Qᵀ`; `λ_max = max v`. Exact up to rounding;
  `p` may be any positive number.

Both work on a bucket `[n, d, d]` of equal-size matrices in one batched op; on
CPU the eigendecompositions run one matrix at a time (`core.linalg.batched`),
because jaxlib's batched CPU eigh can deadlock XLA's thread pool (the Newton
iteration is matmuls only and is vmapped everywhere). Both return an error per
matrix (Newton: `max |M − I|` of the last accepted iterate, `= max |X^p A − I|`
in exact arithmetic; eigh: 0) so that callers can reject a failed root.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.core import faults
from kfac_jax_dist.core import linalg

_HI = lax.Precision.HIGHEST
Method = Literal["eigh", "newton"]
METHODS: tuple[Method, ...] = ("eigh", "newton")
_TINY_EIGENVALUE = 1e-16


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HI)


def matrix_power(m: jax.Array, p: int) -> jax.Array:
  """`m^p` for a static integer `p ≥ 1` by binary exponentiation
  (⌈log₂ p⌉ squarings plus one product per set bit)."""
  if p < 1 or int(p) != p:
    raise ValueError(f"matrix_power needs an integer p >= 1, got {p}")
  result, base, p = None, m, int(p)
  while p:
    if p & 1:
      result = base if result is None else _mm(result, base)
    p >>= 1
    if p:
      base = _mm(base, base)
  return result


def _start_vector(d: int, dtype) -> jax.Array:
  # A fixed, generic start vector (a constant of the trace, no RNG state).
  v = np.random.default_rng(0).uniform(0.5, 1.5, size=d)
  return jnp.asarray(v / np.linalg.norm(v), dtype)


def power_iteration(matrix: jax.Array, max_iterations: int = 100,
                    tolerance: float = 1e-6) -> jax.Array:
  """Largest eigenvalue of one symmetric PSD `[d, d]` matrix: `v ← Hv/‖Hv‖`
  until the Rayleigh quotient `vᵀHv` changes by less than `tolerance` (relative)
  or after `max_iterations` (Baumann 2023, Alg. 6)."""
  d = matrix.shape[-1]

  def cond(carry: tuple) -> jax.Array:
    i, _, s, s_prev = carry
    return (i < max_iterations) & (jnp.abs(s - s_prev) > tolerance * jnp.abs(s))

  def body(carry: tuple) -> tuple:
    i, v, s, _ = carry
    w = _mm(matrix, v)
    s_new = jnp.vdot(v, w)
    norm = jnp.linalg.norm(w)
    v_new = jnp.where(norm > 0, w / jnp.where(norm > 0, norm, 1.0), v)
    return i + 1, v_new, s_new, s

  v0 = _start_vector(d, matrix.dtype)
  inf = jnp.asarray(jnp.inf, matrix.dtype)
  # the carry varies over the mesh axes the matrix varies over (inside shard_map)
  start = _compat.as_varying((v0, jnp.zeros([], matrix.dtype), inf),
                             _compat.varying_axes(matrix))
  _, _, s, _ = lax.while_loop(cond, body, (jnp.zeros([], jnp.int32),) + start)
  return s


def newton_inverse_pth_root(matrix: jax.Array, p: int, *, ridge_epsilon: float = 1e-6,
                            max_iterations: int = 100, tolerance: float = 1e-6,
                            divergence_factor: float = 1.2,
                            power_iterations: int = 100) -> tuple[jax.Array, jax.Array]:
  """`(X, error)` with `X ≈ (H + ε_ridge λ_max I)^{-1/p}` for one `[d, d]` matrix
  by the coupled Newton iteration (see the module docstring)."""
  if p < 1 or int(p) != p:
    raise ValueError(f"the Newton iteration needs an integer p >= 1, got {p}")
  p = int(p)
  d, dtype = matrix.shape[-1], matrix.dtype
  eye = jnp.eye(d, dtype=dtype)
  matrix = 0.5 * (matrix + matrix.T)
  lam = power_iteration(matrix, power_iterations)
  a = matrix + ridge_epsilon * jnp.maximum(lam, _TINY_EIGENVALUE) * eye
  alpha = -1.0 / p
  z = (1.0 + p) / (2.0 * jnp.linalg.norm(a))
  m0 = z * a
  x0 = z ** (1.0 / p) * eye
  err0 = jnp.max(jnp.abs(m0 - eye))
  fro0 = jnp.linalg.norm(m0 - eye)

  def cond(carry: tuple) -> jax.Array:
    i, _, _, err, _, stop = carry
    return (i < max_iterations) & (err > tolerance) & ~stop

  def body(carry: tuple) -> tuple:
    i, m, x, err, fro, _ = carry
    m_hat = (1.0 - alpha) * eye + alpha * m
    x_new = _mm(x, m_hat)
    m_new = _mm(matrix_power(m_hat, p), m)
    fro_new = jnp.linalg.norm(m_new - eye)
    diverged = ~(fro_new <= divergence_factor * fro)     # NaN counts as diverged
    keep = lambda old, new: jnp.where(diverged, old, new)
    return (i + 1, keep(m, m_new), keep(x, x_new),
            keep(err, jnp.max(jnp.abs(m_new - eye))), keep(fro, fro_new), diverged)

  carry = (jnp.zeros([], jnp.int32), m0, x0, err0, fro0,
           _compat.as_varying(jnp.asarray(False), _compat.varying_axes(matrix)))
  _, _, x, err, _, _ = lax.while_loop(cond, body, carry)
  return x, err


def eigh_inverse_pth_root(matrix: jax.Array, p: float, *, ridge_epsilon: float = 1e-6
                          ) -> tuple[jax.Array, jax.Array]:
  """`(X, 0)` with `X = (H + ε_ridge λ_max I)^{-1/p}` for one `[d, d]` matrix by
  eigendecomposition."""
  vectors, values = linalg.eigh(matrix[None])
  vectors, values = vectors[0], values[0]
  return _eigh_root(vectors, values, p, ridge_epsilon), jnp.zeros([], values.dtype)


def _eigh_root(vectors, values, p, ridge_epsilon):
  ridge = ridge_epsilon * jnp.maximum(jnp.max(values, axis=-1, keepdims=True),
                                      _TINY_EIGENVALUE)
  scale = (values + ridge) ** (-1.0 / p)
  return _mm(vectors * scale[..., None, :], jnp.swapaxes(vectors, -1, -2))


def inverse_pth_root(matrices: jax.Array, p: float, *, method: str = "eigh",
                     ridge_epsilon: float = 1e-6, max_iterations: int = 100,
                     tolerance: float = 1e-6, divergence_factor: float = 1.2
                     ) -> tuple[jax.Array, jax.Array]:
  """`(H_j + ε_ridge λ_max(H_j) I)^{-1/p}` for every slot of a bucket `[n, d, d]`.

  Args:
    matrices: symmetric PSD matrices `[n, d, d]` (float32 at least is used).
    p: the root; an integer for "newton".
    method: "eigh" or "newton" (see the module docstring).
    ridge_epsilon: relative ridge `ε_ridge`.
    max_iterations, tolerance, divergence_factor: Newton's stopping rules.

  Returns:
    `(roots [n, d, d], errors [n])`: Newton's final `max |M − I|`, or zeros.
  """
  if method not in METHODS:
    raise ValueError(f"root method must be one of {METHODS}, got {method!r}")
  matrices = matrices.astype(jnp.promote_types(matrices.dtype, jnp.float32))
  if method == "eigh":
    # Each slot's root from its own eigendecomposition, the roots stacked: a
    # stack of the eigenvectors themselves fused jax's per-slot `info == 0`
    # selects into one loop, which LLVM unswitched once per slot (PERF_NOTES §17).
    roots = linalg.batched(
        lambda h, eps: eigh_inverse_pth_root(h, p, ridge_epsilon=eps)[0], matrices,
        jnp.asarray(ridge_epsilon, matrices.dtype),
        one_at_a_time_on_cuda=matrices.shape[-1] > linalg.GPU_BATCHED_EIGH_MAX_DIM)
    return roots, jnp.zeros(matrices.shape[:1], matrices.dtype)
  fn = lambda h: newton_inverse_pth_root(
      h, p, ridge_epsilon=ridge_epsilon, max_iterations=max_iterations,
      tolerance=tolerance, divergence_factor=divergence_factor)
  return jax.vmap(fn)(matrices)


def checked_roots(statistics: jax.Array, p: float, previous: jax.Array, *,
                  method: str, ridge_epsilon: float, max_iterations: int,
                  tolerance: float, failure_threshold: float) -> jax.Array:
  """`inverse_pth_root` of a bucket `[n, d, d]`, keeping the `previous` root
  of any block whose new one is not finite or whose Newton error exceeds
  `failure_threshold` (a failed decomposition, not a step fault)."""
  new, error = inverse_pth_root(statistics, p, method=method, ridge_epsilon=ridge_epsilon,
                                max_iterations=max_iterations, tolerance=tolerance)
  ok = faults.finite_rows(new) & (error <= failure_threshold)
  return jnp.where(ok[:, None, None], new.astype(previous.dtype), previous)
