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
  treated as examples ("K-FAC-expand", Eschenhagen et al., 2023).
* Reducing over the sequence instead ("K-FAC-reduce", Eschenhagen et al., 2023,
  Eq. 13; `example_dims=1` on the tags): the positions of one example u are
  reduced first, `ā_u = mean_{p∈u} a_p` and `ḡ_u = Σ_{p∈u} ĝ_p`, and then

      A = (1/U) Σ_u ā_u ā_uᵀ,   G = n Σ_u ḡ_u ḡ_uᵀ.

  With a per-sequence loss (n = U = B, e.g. a classifier on pooled tokens)
  these are the paper's K-FAC-reduce factors, exact for a linear layer
  followed by a linear pooling on one example. A conv layer with
  `example_dims=1` reduces over its output pixels the same way.
* Conv2d (N = B·h·w, n = B): `A ⊗ G = (1/B) Σ a aᵀ ⊗ (1/(B h w)) Σ g gᵀ`, the KFC
  approximation (Grosse & Martens, 2016) in the form of DP-KFAC Eq. 13 / SP-NGD.
  We move the 1/(h w) from G to A so that A is a per-position average; the
  product, which is all that the preconditioner sees, is unchanged.

A factor whose dimension exceeds `max_factor_dim` is kept as its diagonal
("diag" form): `diag(A)` and `diag(G)`, i.e. the block-diagonal approximation
with blocks of size one.

Other layer kinds:

* Embedding (`table[ids]`, i.e. a Dense layer on one-hot inputs, no bias):
  `A = (1/N) Σ_p onehot(id_p) onehot(id_p)ᵀ` is diagonal, so it is returned
  as the vector of token frequencies `A_v = (1/N)·#{p : id_p = v}`, `[V]`;
  `G` as for Dense.
* Scale-and-shift (`y = x̂ ⊙ γ + β` over the last axis, the learnable part of
  LayerNorm / BatchNorm): SP-NGD's unit-wise Fisher (Osawa et al., §4.2.1,
  Eq. 15–16; Amari, Karakida & Oizumi 2019), one 2×2 block per channel c over
  `(γ_c, β_c)` built from per-*example* gradients. With examples u, each a set
  of positions (one position, or e.g. the h·w pixels of one image),

      uγ_c = Σ_{p∈u} x̂_pc ĝ_pc,   uβ_c = Σ_{p∈u} ĝ_pc      (ĝ = g / n)
      F_c  = n Σ_u [[uγ², uγ uβ], [uγ uβ, uβ²]]  (= (1/n) Σ_u with g instead of ĝ)

  returned compactly as `[C, 3]` = `(γγ, γβ, ββ)`. As for `G`, this module
  returns `Σ_u (…)` of the captured cotangents and the capture multiplies by
  n (`SCALED_BY_NUM_EXAMPLES`). With a per-token loss and tokens as examples
  (n = B·T) this is the token-level empirical Fisher, the Dense convention;
  with a per-image loss and images as examples (n = B, positions h·w summed
  first) it is SP-NGD's per-sample Fisher exactly.

EK-FAC (George et al. 2018) adds, for a Dense or Conv layer whose K-FAC state
has eigenbases `Q_A`, `Q_G`, the second moment of the per-example gradients
in that basis, `S = n Σ_u (Q_Aᵀ ∇̂_u Q_G)²` with `∇̂_u = Σ_{p∈u} a_p ĝ_pᵀ` (=
`(1/n) Σ_u (Q_Aᵀ ∇_u Q_G)²`, ∇_u example u's loss gradient): in the units of
`v_A v_Gᵀ`, the K-FAC eigenvalues it replaces (`corrected_scaling`). The
examples u are those of `A` and `G` (a Dense position, or an entry of the
first `example_dims` axes; a Conv layer's image, its pixels summed).

A layer that runs several times in one loss evaluation inside a compiled
loop (a pipeline stage's blocks once per micro-batch under `lax.cond`, a
scan's iterations sharing one kernel, the lanes of a `jax.vmap`) has its
probes' cotangents summed over the runs: `G`, `F` and `S`, sums over
examples, are then those of all the runs' positions, and `A` is the mean over
all of them, `Σ_r N_r A_r / Σ_r N_r` with `N_r` run r's positions (rows of
`A`): each run's backward pass adds its sum `N_r A_r` and its count `N_r` to
the probe `POSITIONS`, a scalar per layer or block, only for the layers the
discovery saw called twice or inside a loop, branch or transform. Every
run's positions count as examples of one layer, K-FAC-expand's treatment of
weight sharing (Eschenhagen et al. 2023), runs of different sizes included.
A layer that may sit out a pass (`TaggedLayer.may_sit_out`: every run inside
a `lax.cond` / `lax.switch` branch or a `lax.while_loop` body) keeps its count
among its statistics (`POSITIONS`, 0 where it did not run), by which the
optimizer tells whether it ran and weighs its `A` over the devices; so does
one only some of whose runs are there (`TaggedLayer.partly_sits_out`).

Precision: every statistic is computed in `statistics_dtype` of the layer's
inputs and output cotangents, `promote_types(dtype, float32)`: a bfloat16 or
float16 model gets float32 statistics, a float64 model float64 ones (the
tags cast both to it before any product), and the contractions run at
`Precision.HIGHEST`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist.capture import triangles

FULL = "full"
DIAG = "diag"
UNIT = "unit"      # a scale-and-shift layer's [C, 3] unit-wise Fisher
# A full statistic delivered as its upper triangle (`capture.triangles`), for a
# state that stores its factors so: packed inside the capture's conditional,
# each layer's `d × d` statistic lives only there, not until the factor update.
PACKED = "packed"


def statistic_shape(dim: int, form: str) -> tuple[int, ...]:
  """One block's statistic of dimension `dim` in `form` (FULL, PACKED or DIAG)."""
  if form == FULL:
    return (dim, dim)
  return (triangles.packed_size(dim),) if form == PACKED else (dim,)

# Statistics built from output cotangents: the capture multiplies them by n.
SCALED_BY_NUM_EXAMPLES = frozenset({"G", "F", "S"})
# EK-FAC: the corrected scaling `S` (`corrected_scaling`), computed in the
# eigenbases the capture receives as the inputs `QA` and `QG`.
CORRECTED, BASES = "S", ("QA", "QG")
# How many positions a repeated layer (block) saw over its runs in the pass:
# `A`, summed over them, is divided by it (see the module docstring).
POSITIONS = "positions"
# The statistics of a layer that the loss's backward pass did not reach (its
# output unused by the loss: JAX never ran its backward pass, every statistic
# is zero) hold this key too, an int32 0; the optimizer keeps its factors.
UNREACHED = "unreached"


def with_leading_units(v: jax.Array, ndim: int) -> jax.Array:
  """`v` with leading unit axes up to rank `ndim`: an explicit broadcast over
  the trailing axes of a rank-`ndim` array (the library runs under
  `jax_numpy_rank_promotion="raise"`)."""
  return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def per_block(values: jax.Array, statistic: jax.Array) -> jax.Array:
  """`values` of each block (`[*stack]`, a layer's positions, say) shaped to
  broadcast against the blocks' `statistic` (`[*stack, ...]`)."""
  return values.reshape(values.shape + (1,) * (statistic.ndim - values.ndim))


def mean_over_positions(a: jax.Array, positions: jax.Array) -> jax.Array:
  """`A` summed over `positions` positions (`[*stack]`) → their mean (none: as is)."""
  return a / per_block(jnp.maximum(positions, 1).astype(a.dtype), a)


def num_rows(x: jax.Array, example_dims: int | None) -> int:
  """The rows of a statistic of `x` (`_flatten_positions`): its positions, or
  with `example_dims=k` the entries of its first k axes."""
  if example_dims is None:
    return x.size // max(x.shape[-1], 1)
  return math.prod(x.shape[:example_dims])


def statistics_dtype(*arrays) -> jnp.dtype:
  """`promote_types(dtype, float32)` of the floating arrays among `arrays`
  (integer ones, embedding ids, are left out): the dtype of a layer's
  statistics."""
  floating = [a for a in arrays
              if a is not None and jnp.issubdtype(jnp.result_type(a), jnp.inexact)]
  dtype = jnp.result_type(*floating) if floating else jnp.float32
  return jnp.promote_types(dtype, jnp.float32)


def _flatten_positions(x: jax.Array, example_dims: int | None = None,
                       reduce=jnp.sum) -> jax.Array:
  """`[N, d]` rows: every leading position, or (`example_dims=k`) one row per
  example, the `reduce` over the positions of the first k axes' entries."""
  x = x.astype(statistics_dtype(x))
  if example_dims is None:
    return jnp.reshape(x, (-1, x.shape[-1]))
  if not 0 <= example_dims < x.ndim:
    raise ValueError(f"example_dims={example_dims} for an input of shape {x.shape}: "
                     f"must be between 0 and {x.ndim - 1}")
  num_examples = 1
  for size in x.shape[:example_dims]:
    num_examples *= size
  return reduce(jnp.reshape(x, (num_examples, -1, x.shape[-1])), axis=1)


def row_weights(mask: jax.Array, positions: tuple[int, ...],
                example_dims: int | None) -> jax.Array:
  """The rows of a statistic over `positions` (`_flatten_positions`) kept by
  `mask` (a boolean prefix of `positions`, broadcast over the rest), `[N]`
  (`[U]`: the entries of the first `example_dims` axes, which `mask` may
  not outnumber), 1 kept, 0 left out."""
  rows = tuple(positions if example_dims is None else positions[:example_dims])
  wide = mask.reshape(mask.shape + (1,) * (len(rows) - mask.ndim))
  return jnp.broadcast_to(wide, rows).reshape(-1)


def input_factor(a: jax.Array, has_bias: bool, form: str = FULL,
                 example_dims: int | None = None,
                 weights: jax.Array | None = None) -> jax.Array:
  """`A = (1/N) Σ_p a_p a_pᵀ` over all leading positions, bias folded in.

  `example_dims=k`: the rows are the per-example means `ā_u` over the
  positions inside each entry of the first k axes (K-FAC-reduce).
  `weights` (`row_weights`, 0 or 1 per row): `(1/N) Σ_p w_p a_p a_pᵀ`, the
  kept rows' sum (the capture divides it by their count)."""
  a = _flatten_positions(a, example_dims, jnp.mean)
  num_positions = a.shape[0]
  corner = jnp.ones((1,), a.dtype)     # the homogeneous coordinate's mean
  if weights is not None:
    w = weights.astype(a.dtype)
    a = a * w[:, None]
    corner = jnp.mean(w, keepdims=True)
  # The homogeneous coordinate is added to the product, not to `a`: with
  # `a = [x, 1]`, `A = [[E x xᵀ, E x], [E xᵀ, 1]]`. Concatenating a column of
  # ones to `x` would copy the whole `[N, d]` input just to feed the matmul
  # (a conv's gathered patches come with their ones instead: `conv_patches`).
  if form == DIAG:
    diag = jnp.sum(a * a, axis=0) / num_positions
    return jnp.concatenate([diag, corner]) if has_bias else diag
  second = jnp.matmul(a.T, a, precision=lax.Precision.HIGHEST) / num_positions
  if not has_bias:
    return second
  return _bordered(second, jnp.mean(a, axis=0), corner)


def _bordered(second: jax.Array, mean: jax.Array, corner: jax.Array) -> jax.Array:
  """`[[S, m], [mᵀ, c]]` (`c` the `[1]` `corner`, 1 without a row mask),
  each number selected from `S` or `[m, c]` by its
  position. Joined by concatenates, the `[S, m]` block was a kernel of its own
  on XLA:CPU (128 and 256 wide), and `S`'s and `m`'s scaling two more, where
  the selects fuse into the packing gather after them (PERF_NOTES §50). `[m, 1]`
  is built once as a vector and read as both the column and the row: XLA:CPU
  built the mean once for each shape it was read in (PERF_NOTES §24)."""
  d, shape = second.shape[0], (second.shape[0] + 1,) * 2
  row, col = (lax.broadcasted_iota(jnp.int32, shape, k) for k in (0, 1))
  border = jnp.concatenate([mean, corner.astype(mean.dtype)])
  inner = lax.pad(second, jnp.zeros((), second.dtype), ((0, 1, 0), (0, 1, 0)))
  edge = lax.select(col == d, lax.broadcast_in_dim(border, shape, (0,)),
                    lax.broadcast_in_dim(border, shape, (1,)))
  return lax.select(lax.max(row, col) < d, inner, edge)


def output_factor(g: jax.Array, form: str = FULL,
                  example_dims: int | None = None) -> jax.Array:
  """`Σ_p ĝ_p ĝ_pᵀ` of the captured cotangents (the capture multiplies by n).

  `example_dims=k`: the rows are the per-example sums `ḡ_u` over the
  positions inside each entry of the first k axes (K-FAC-reduce)."""
  g = _flatten_positions(g, example_dims, jnp.sum)
  if form == DIAG:
    return jnp.sum(g * g, axis=0)
  return jnp.matmul(g.T, g, precision=lax.Precision.HIGHEST)


def conv_patches(x: jax.Array, kernel_shape, strides, padding, dilation,
                 homogeneous: bool = False) -> jax.Array:
  """im2col patches of a channels-last input `[B, *spatial, C]` (NWC, NHWC,
  NDHWC), features ordered like `kernel.reshape(-1, O)`; `homogeneous`: with
  a last feature of ones, the bias's input (`[x, 1]`).

  Flax's kernel `(*window, C, O)` flattens as `(*window, C)`, so the patch of
  an output position is its receptive field in the padded input, `[*window,
  C]` flattened (with a dilation, every `d`-th position of the dilated
  window): `patches @ kernel.reshape(-1, O)` is the convolution (a 1x1
  kernel's are the input, no copy when unstrided). Otherwise one gather
  copies the windows, starting at `(o₁·s₁, o₂·s₂, ...)`, straight into `[B,
  *out, *window, C]`: pure data movement in one kernel.
  (`kh·kw` strided slices and a concatenation run 3% faster on XLA:CPU but
  take ten times longer to compile, as long as the rest of the capture;
  `lax.conv_general_dilated_patches` builds the patches with a grouped
  convolution against a one-hot kernel, which XLA's CPU backend runs as
  slowly as the factor's matmul itself.)
  """
  n = x.ndim - 2
  size, strides, dilation = tuple(kernel_shape[:n]), tuple(strides), tuple(dilation)
  window = tuple((k - 1) * d + 1 for k, d in zip(size, dilation))
  if isinstance(padding, str):
    padding = lax.padtype_to_pads(x.shape[1:1 + n], window, strides, padding)
  x = lax.pad(x, jnp.zeros((), x.dtype),
              ((0, 0, 0),) + tuple((lo, hi, 0) for lo, hi in padding) + ((0, 0, 0),))
  batch, *padded, channels = x.shape
  out = tuple((p - w) // s + 1 for p, w, s in zip(padded, window, strides))
  if all(k == 1 for k in size):     # a 1x1 kernel's patches are the (strided) input
    patches = lax.slice(x, (0,) * (n + 2),
                        (batch,) + tuple((o - 1) * s + 1 for o, s in zip(out, strides))
                        + (channels,), (1,) + strides + (1,))
    return _with_ones(patches) if homogeneous else patches
  starts = jnp.stack(jnp.meshgrid(*(jnp.arange(o) * s for o, s in zip(out, strides)),
                                  indexing="ij"), axis=-1)          # [*out, n]
  windows = lax.gather(
      x, starts, lax.GatherDimensionNumbers(offset_dims=(0,) + tuple(range(n + 1, 2 * n + 2)),
                                            collapsed_slice_dims=(),
                                            start_index_map=tuple(range(1, n + 1))),
      slice_sizes=(batch, *window, channels),
      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)   # [B, *out, *window, C]
  if any(d != 1 for d in dilation):
    windows = windows[(slice(None),) * (n + 1) + tuple(slice(None, None, d) for d in dilation)]
  patches = windows.reshape((batch,) + out + (math.prod(size) * channels,))
  return _with_ones(patches) if homogeneous else patches


def _with_ones(x: jax.Array) -> jax.Array:
  """`x` with a last feature of ones: `[..., d]` → `[..., d + 1]`."""
  return jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)


def token_frequencies(ids: jax.Array, vocab_size: int, dtype=jnp.float32,
                      weights: jax.Array | None = None) -> jax.Array:
  """`A_v = (1/N)·#{p : ids_p = v}`: the diagonal of `E[onehot onehotᵀ]`, `[V]`.

  A scatter-add of ones, never an `[N, V]` one-hot. Ids are indexed like
  `jnp.take` (negative ids wrap); out-of-range ids count nowhere. `dtype`:
  the statistics' (the output cotangents'), float32 at least. `weights`
  (`row_weights`, 0 or 1): only the kept positions count (still divided by
  `N`). Counted in int32 (float32 stops counting at 2²⁴ copies of one id).
  """
  ids = jnp.reshape(ids, (-1,))
  dtype = jnp.promote_types(dtype, jnp.float32)
  ones = 1 if weights is None else weights.astype(jnp.int32)
  counts = jnp.zeros((vocab_size,), jnp.int32).at[ids].add(ones, mode="drop")
  return counts.astype(dtype) / max(ids.shape[0], 1)


def unitwise_fisher(x: jax.Array, g: jax.Array, has_offset: bool = True,
                    example_dims: int | None = None) -> jax.Array:
  """`Σ_u [uγ², uγ·uβ, uβ²]` per channel, `[C, 3]` (the capture multiplies by n).

  `x` is the normalised input `x̂` and `g` the captured output cotangent, both
  `[..., C]`. The first `example_dims` axes index examples; the remaining
  leading axes are positions within an example, summed into the per-example
  gradients `uγ = Σ x̂ ĝ`, `uβ = Σ ĝ` before their products are taken.
  `example_dims=None`: every leading axis indexes examples (each position is
  an example). Without an offset, the `γβ` and `ββ` entries are zero, so that
  the 2×2 solve of `linalg.unitwise_precondition` reduces to `γ`'s own
  `gγ / (F_γγ + λ)`.
  """
  dtype = statistics_dtype(x, g)
  x, g = x.astype(dtype), g.astype(dtype)
  lead = x.shape[:-1]
  k = len(lead) if example_dims is None else example_dims
  if not 0 <= k <= len(lead):
    raise ValueError(f"example_dims={example_dims} for an input of shape {x.shape}: "
                     f"must be between 0 and {len(lead)}")
  num_units = 1
  for size in lead[:k]:
    num_units *= size
  channels = x.shape[-1]
  u_gamma = jnp.sum(jnp.reshape(x * g, (num_units, -1, channels)), axis=1)
  if not has_offset:
    zeros = jnp.zeros((channels,), dtype)
    return jnp.stack([jnp.sum(u_gamma * u_gamma, axis=0), zeros, zeros], axis=-1)
  u_beta = jnp.sum(jnp.reshape(g, (num_units, -1, channels)), axis=1)
  return jnp.stack([jnp.sum(u_gamma * u_gamma, axis=0),
                    jnp.sum(u_gamma * u_beta, axis=0),
                    jnp.sum(u_beta * u_beta, axis=0)], axis=-1)


# Per-example gradient matrices `[c, d_A, d_G]` formed at once by
# `corrected_scaling` (more examples are summed in chunks of this many numbers).
CHUNK_NUMBERS = 1 << 22


def corrected_scaling(x: jax.Array, g: jax.Array, has_bias: bool, basis_a: jax.Array,
                      basis_g: jax.Array, example_dims: int | None = None) -> jax.Array:
  """EK-FAC's `Σ_u (Q_Aᵀ ∇̂_u Q_G)²` (George et al. 2018, Eq. 10; the capture
  multiplies by n), `[d_A, d_G]`.

  `∇̂_u = Σ_{p∈u} a_p ĝ_pᵀ` is example u's gradient from the captured
  cotangents (`a = [x, 1]` with a bias), the positions of the first
  `example_dims` axes summed (None: every position is an example, as for
  `A` and `G`). With one position per example it is one matmul of squares,
  `((X Q_A)²)ᵀ (Ĝ Q_G)²`; else the per-example matrices are formed in chunks
  of `CHUNK_NUMBERS` numbers.
  """
  dtype = statistics_dtype(x, g)
  x, g = x.astype(dtype), g.astype(dtype)
  lead = x.shape[:-1]
  k = len(lead) if example_dims is None else example_dims
  units = math.prod(lead[:k])
  x = jnp.reshape(x, (units, -1, x.shape[-1]))
  g = jnp.reshape(g, (units, -1, g.shape[-1]))
  hi = lax.Precision.HIGHEST
  xq = jnp.matmul(x, basis_a[:x.shape[-1]].astype(dtype), precision=hi)
  if has_bias:
    xq = xq + basis_a[-1].astype(dtype)[None, None]
  gq = jnp.matmul(g, basis_g.astype(dtype), precision=hi)
  if x.shape[1] == 1:
    return jnp.matmul(jnp.square(xq[:, 0]).T, jnp.square(gq[:, 0]), precision=hi)
  da, dg = xq.shape[-1], gq.shape[-1]
  chunk = max(1, min(units, CHUNK_NUMBERS // (da * dg)))

  def squares(xs: jax.Array, gs: jax.Array) -> jax.Array:
    per_example = jnp.einsum("upa,upg->uag", xs, gs, precision=hi)
    return jnp.sum(jnp.square(per_example), axis=0)
  if chunk == units:
    return squares(xq, gq)
  pad = (-units) % chunk          # zero examples add nothing
  xq = jnp.pad(xq, ((0, pad), (0, 0), (0, 0))).reshape(-1, chunk, *xq.shape[1:])
  gq = jnp.pad(gq, ((0, pad), (0, 0), (0, 0))).reshape(-1, chunk, *gq.shape[1:])

  def body(total: jax.Array, pair: tuple) -> tuple:
    return total + squares(*pair), None
  # carried from the first chunk: inside shard_map a zero start would be typed
  # invariant over the data axis where the chunks' sums vary (a scan error)
  total, _ = lax.scan(body, squares(xq[0], gq[0]), (xq[1:], gq[1:]))
  return total
