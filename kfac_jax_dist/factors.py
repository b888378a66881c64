"""Curvature statistics of one layer, from its inputs and output cotangents.

For a layer `s = a W` applied at N positions (examples, tokens or output pixels)
with a loss that is a mean over n examples, the captured cotangent of `s` at
position p is `ĝ_p = g_p / n`, where `g_p` is the per-example loss gradient.
This module returns

    A = (1/N) Σ_p a_p a_pᵀ            (a = [x, 1] when there is a bias)
    G = n Σ_p ĝ_p ĝ_pᵀ               (= (1/n) Σ_p g_p g_pᵀ)

The capture multiplies G by n (here we return `Σ_p ĝ_p ĝ_pᵀ`). Their Kronecker
product is what the K-FAC papers use:

* Dense on `[B, d]` inputs (N = n = B): `A = E[a aᵀ]`, `G = E[g gᵀ]`, Martens &
  Grosse (2015); KAISA Eq. 2.9.
* Dense on `[B, T, d]` inputs with a per-token loss (N = n = B·T): tokens are
  treated as examples.
* Conv2d (N = B·h·w, n = B): `A ⊗ G = (1/B) Σ a aᵀ ⊗ (1/(B h w)) Σ g gᵀ`, the KFC
  approximation (Grosse & Martens, 2016) in the form of DP-KFAC Eq. 13 / SP-NGD.
  We move the 1/(h w) from G to A so that A is a per-position average; the
  product, which is all that the preconditioner sees, is unchanged.

A factor whose dimension exceeds `max_factor_dim` is kept as its diagonal
("diag" form): `diag(A)` and `diag(G)`, i.e. the block-diagonal approximation
with blocks of size one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FULL = "full"
DIAG = "diag"


def _flatten_positions(x: jax.Array) -> jax.Array:
  return jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.float32)


def input_factor(a: jax.Array, has_bias: bool, form: str = FULL) -> jax.Array:
  """`A = (1/N) Σ_p a_p a_pᵀ` over all leading positions, bias folded in."""
  a = _flatten_positions(a)
  num_positions = a.shape[0]
  if has_bias:
    a = jnp.concatenate([a, jnp.ones((num_positions, 1), a.dtype)], axis=1)
  if form == DIAG:
    return jnp.sum(a * a, axis=0) / num_positions
  return jnp.matmul(a.T, a, precision=lax.Precision.HIGHEST) / num_positions


def output_factor(g: jax.Array, form: str = FULL) -> jax.Array:
  """`Σ_p ĝ_p ĝ_pᵀ` of the captured cotangents (the capture multiplies by n)."""
  g = _flatten_positions(g)
  if form == DIAG:
    return jnp.sum(g * g, axis=0)
  return jnp.matmul(g.T, g, precision=lax.Precision.HIGHEST)


def conv_patches(x: jax.Array, kernel_shape, strides, padding, dilation) -> jax.Array:
  """im2col patches of an NHWC input, features ordered like `kernel.reshape(-1, O)`.

  `lax.conv_general_dilated_patches` orders a patch's features channel-first,
  `(C, kh, kw)`; Flax's HWIO kernel flattens as `(kh, kw, C)`. We reorder the
  patches so that `patches @ kernel.reshape(-1, O)` is the convolution.
  """
  kh, kw, cin = kernel_shape[0], kernel_shape[1], kernel_shape[2]
  patches = lax.conv_general_dilated_patches(
      x, filter_shape=(kh, kw), window_strides=strides, padding=padding,
      rhs_dilation=dilation, dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=lax.Precision.HIGHEST)
  lead = patches.shape[:-1]
  patches = patches.reshape(lead + (cin, kh * kw))
  patches = jnp.swapaxes(patches, -1, -2)
  return patches.reshape(lead + (kh * kw * cin,))
