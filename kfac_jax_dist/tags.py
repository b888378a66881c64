"""Tag functions: layers whose curvature K-FAC captures.

`dense`, `dense_general`, `conv2d`, `embed` and `scale_and_shift` compute the
layer exactly like their Flax counterparts. Outside `kd.value_and_grad` they
are plain functions. Inside it they

* while discovering, record the layer (`registry.TaggedLayer`): its name, kind
  and the parameter leaves it uses (matched by identity against the leaves of
  the parameter tree given to the loss, so pass the parameters themselves and
  let the tag cast them with `dtype=`);
* while capturing, run through a `custom_vjp` whose backward pass also returns
  the layer's statistics (`A` and `G`, or `F`; see `factors`) as the
  cotangents of zero "probe" inputs. Nothing per-example is materialised, and
  a traced flag skips the statistics (`lax.cond`) on steps that update no
  factor.

A layer's name defaults to its kernel's path in the parameter tree without the
last key (`"Dense_0"` for `{"Dense_0": {"kernel": ...}}`); the kernel of an
embedding is its table, of a scale-and-shift its scale.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist import _context
from kfac_jax_dist import factors
from kfac_jax_dist import registry


def _promote(dtype, *arrays):
  if dtype is None:
    dtype = jnp.result_type(*[a for a in arrays if a is not None])
  return tuple(None if a is None else jnp.asarray(a, dtype) for a in arrays)


def _layer_name(trace: _context.Trace, name: str | None, kernel) -> str:
  if name is not None:
    return name
  path = trace.path_of(kernel)
  if path is None:
    raise ValueError(
        "A tagged layer without a name uses a kernel that is not a leaf of the "
        "parameters given to kd.value_and_grad. Pass the parameter itself (cast it "
        "with the tag's dtype= argument) or give the tag a name.")
  parts = path.split("/")
  while len(parts) > 1 and parts[-1] in ("value", "raw_value"):   # NNX Variables
    parts.pop()
  return "/".join(parts[:-1]) if len(parts) > 1 else parts[0]


def _discover(trace, kind, name, kernel, bias, **record) -> None:
  kernel_path = trace.path_of(kernel)
  if kernel_path is None:
    raise ValueError(
        f"Tagged layer '{name}': its kernel is not a leaf of the parameters given "
        "to kd.value_and_grad, so K-FAC cannot tell which gradient to precondition. "
        "Pass the parameter itself (cast it with the tag's dtype= argument).")
  bias_path = trace.path_of(bias)
  if bias is not None and bias_path is None:
    raise ValueError(
        f"Tagged layer '{name}': its bias is not a leaf of the parameters given to "
        "kd.value_and_grad.")
  if name in trace.seen:
    raise ValueError(
        f"Tagged layer '{name}' ran twice in one loss evaluation; shared layers "
        "are not supported: give each application its own parameters and name.")
  trace.seen.add(name)
  trace.layers.append(registry.TaggedLayer(
      name=name, kind=kind, kernel_path=kernel_path, bias_path=bias_path,
      kernel_shape=tuple(kernel.shape),
      bias_shape=None if bias is None else tuple(bias.shape), **record))


def _captured(apply: Callable, stats: Callable, x, params: tuple, probes, flag):
  """`apply(x, *params)` whose backward pass also returns `stats(x, ḡ)`, a
  pytree like `probes` (`x` may be integer: embedding ids)."""

  @jax.custom_vjp
  def layer(x, params, probes, flag):
    del probes, flag
    return apply(x, *params)

  def fwd(x, params, probes, flag):
    del probes
    return apply(x, *params), (x, params, flag)

  def bwd(residuals, cotangent):
    x, params, flag = residuals
    _, vjp = jax.vjp(apply, x, *params)   # the primal is dead code under jit
    x_bar, *params_bar = vjp(cotangent)
    # A statistic may not depend on everything that varies (an embedding's A
    # on replicated ids): both branches are typed varying like (x, cotangent).
    axes = _compat.varying_axes(x, cotangent)
    zeros = _compat.as_varying(jax.tree_util.tree_map(jnp.zeros_like, probes), axes)
    probe_bar = lax.cond(flag, lambda: _compat.as_varying(stats(x, cotangent), axes),
                         lambda: zeros)
    return x_bar, tuple(params_bar), probe_bar, None

  layer.defvjp(fwd, bwd)
  return layer(x, params, probes, flag)


def _tagged(kind: str, name, apply, stats, x, kernel, bias, **record):
  """Runs `apply(x, kernel[, bias])`, recording or capturing the layer.

  `stats(x, ḡ, forms)` returns the statistics as a dict keyed like the probes
  that the capture made for this layer (`{"A", "G"}` or `{"F"}`), where
  `forms[key]` says whether the probe is a full matrix or a diagonal.
  `record` holds the `TaggedLayer` fields that only the tag knows (a_dim,
  g_dim, a_diagonal).
  """
  trace = _context.current()
  params = (kernel,) if bias is None else (kernel, bias)
  if trace is None:
    return apply(x, *params)
  name = _layer_name(trace, name, kernel)
  if trace.mode == "discover":
    _discover(trace, kind, name, kernel, bias, **record)
    return apply(x, *params)
  probes = trace.probes.get(name)
  if probes is None:        # not preconditioned (skipped by the optimizer)
    return apply(x, *params)
  forms = {key: factors.DIAG if p.ndim == 1 else factors.FULL
           for key, p in probes.items()}
  return _captured(apply, lambda xx, gg: stats(xx, gg, forms), x, params,
                   probes, trace.compute_stats)


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
          name: str | None = None, dtype: Any = None, precision=None) -> jax.Array:
  """`x @ kernel + bias` over the last axis of `x`; kernel layout `(in, out)`.

  Any leading axes of `x` (`[B, d]`, `[B, T, d]`, ...) are positions: each is an
  example of `A = E[a aᵀ]` and `G` (tokens are treated as examples).
  """
  if kernel.ndim != 2:
    raise ValueError(f"kd.tags.dense expects a 2-D (in, out) kernel, got {kernel.shape}")
  if x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"kd.tags.dense: input features {x.shape[-1]} do not match "
                     f"kernel {kernel.shape}")

  def apply(x, kernel, bias=None):
    x, kernel, bias = _promote(dtype, x, kernel, bias)
    y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                        precision=precision)
    return y if bias is None else y + bias

  def stats(x, g, forms):
    return {"A": factors.input_factor(x, bias is not None, forms["A"]),
            "G": factors.output_factor(g, forms["G"])}

  return _tagged("dense", name, apply, stats, x, kernel, bias,
                 a_dim=kernel.shape[0] + (bias is not None), g_dim=kernel.shape[1])


def _size(shape) -> int:
  size = 1
  for d in shape:
    size *= int(d)
  return size


def dense_general(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                  in_dims: int = 1, name: str | None = None, dtype: Any = None,
                  precision=None) -> jax.Array:
  """A Dense layer over several input and/or output axes.

  The last `in_dims` axes of `x` are contracted with the first `in_dims` axes
  of the kernel; the remaining kernel axes are the output axes, and the bias
  has their shape. E.g. attention projections: `x [B, T, d]` with a kernel
  `[d, heads, head_dim]` (`in_dims=1`) gives `[B, T, heads, head_dim]`; `x [B,
  T, heads, head_dim]` with a kernel `[heads, head_dim, d]` (`in_dims=2`)
  gives `[B, T, d]`.

  K-FAC sees the flattened Dense layer: `a_dim = Π in_shape (+1 with a bias)`,
  `g_dim = Π out_shape`, and `A`, `G` are Dense's on the flattened inputs and
  output cotangents (the kernel's row-major reshape to `(a_dim - has_bias,
  g_dim)` is the Dense kernel). It is recorded with kind "dense".
  """
  if not 1 <= in_dims < kernel.ndim:
    raise ValueError(f"kd.tags.dense_general: in_dims={in_dims} for a kernel of shape "
                     f"{kernel.shape} (needs at least one output axis)")
  in_shape, out_shape = kernel.shape[:in_dims], kernel.shape[in_dims:]
  if x.ndim < in_dims or x.shape[x.ndim - in_dims:] != in_shape:
    raise ValueError(f"kd.tags.dense_general: the last {in_dims} axes of the input "
                     f"{x.shape} do not match the kernel {kernel.shape}")
  if bias is not None and bias.shape != out_shape:
    raise ValueError(f"kd.tags.dense_general: bias shape {bias.shape}, expected "
                     f"{out_shape}")
  n_out = len(out_shape)

  def apply(x, kernel, bias=None):
    x, kernel, bias = _promote(dtype, x, kernel, bias)
    contract = (tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims)))
    y = lax.dot_general(x, kernel, (contract, ((), ())), precision=precision)
    return y if bias is None else y + bias

  def stats(x, g, forms):
    x = jnp.reshape(x, x.shape[:x.ndim - in_dims] + (_size(in_shape),))
    g = jnp.reshape(g, g.shape[:g.ndim - n_out] + (_size(out_shape),))
    return {"A": factors.input_factor(x, bias is not None, forms["A"]),
            "G": factors.output_factor(g, forms["G"])}

  return _tagged("dense", name, apply, stats, x, kernel, bias,
                 a_dim=_size(in_shape) + (bias is not None), g_dim=_size(out_shape))


def _conv_padding(padding):
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      raise ValueError(f"kd.tags.conv2d supports SAME, VALID or explicit padding, "
                       f"got {padding!r}")
    return padding.upper()
  if isinstance(padding, int):
    return ((padding, padding), (padding, padding))
  return tuple((int(lo), int(hi)) for lo, hi in padding)


def conv2d(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           name: str | None = None, strides: Sequence[int] = (1, 1),
           padding: str | Sequence[tuple[int, int]] = "SAME",
           dilation: Sequence[int] = (1, 1), feature_group_count: int = 1,
           dtype: Any = None, precision=None) -> jax.Array:
  """2-D convolution, NHWC input and Flax's HWIO kernel `(kh, kw, in, out)`.

  `A` is built from im2col patches (see `factors.conv_patches`), `G` from the
  output cotangents at every output pixel. Grouped or depthwise convolutions
  have no Kronecker-factored form here and raise an error.
  """
  if feature_group_count != 1:
    raise ValueError(
        f"kd.tags.conv2d: grouped/depthwise convolutions (feature_group_count="
        f"{feature_group_count}) have no K-FAC factors here; use an untagged "
        "convolution for this layer.")
  if x.ndim != 4 or kernel.ndim != 4:
    raise ValueError(f"kd.tags.conv2d expects NHWC inputs and HWIO kernels, got "
                     f"{x.shape} and {kernel.shape}")
  if x.shape[-1] != kernel.shape[2]:
    raise ValueError(f"kd.tags.conv2d: input channels {x.shape[-1]} do not match "
                     f"kernel {kernel.shape}")
  strides, dilation = tuple(strides), tuple(dilation)
  padding = _conv_padding(padding)

  def apply(x, kernel, bias=None):
    x, kernel, bias = _promote(dtype, x, kernel, bias)
    y = lax.conv_general_dilated(
        x, kernel, window_strides=strides, padding=padding, rhs_dilation=dilation,
        dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=precision)
    return y if bias is None else y + bias

  def stats(x, g, forms):
    patches = factors.conv_patches(x.astype(jnp.float32), kernel.shape, strides,
                                   padding, dilation)
    return {"A": factors.input_factor(patches, bias is not None, forms["A"]),
            "G": factors.output_factor(g, forms["G"])}

  kh, kw, cin, cout = kernel.shape
  return _tagged("conv2d", name, apply, stats, x, kernel, bias,
                 a_dim=kh * kw * cin + (bias is not None), g_dim=cout)


def embed(ids: jax.Array, table: jax.Array, *, name: str | None = None,
          dtype: Any = None) -> jax.Array:
  """Embedding lookup `table[ids]` (`jnp.take` along axis 0, like Flax's Embed).

  K-FAC sees a Dense layer without bias on one-hot inputs: the table `[V, d]`
  is the kernel (`a_dim = V`, `g_dim = d`), `A = diag(token frequencies)` is
  returned as the vector `[V]` (never `V × V`; recorded `a_diagonal=True`),
  and `G` is Dense's from the output cotangents. Every position of `ids` (any
  shape) is an example, as for Dense.
  """
  if table.ndim != 2:
    raise ValueError(f"kd.tags.embed expects a 2-D (vocab, features) table, got "
                     f"{table.shape}")
  if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(f"kd.tags.embed: ids must be integers, got {jnp.result_type(ids)}")
  vocab_size, features = table.shape

  def apply(ids, table):
    (table,) = _promote(dtype, table)
    return jnp.take(table, ids, axis=0)

  def stats(ids, g, forms):
    return {"A": factors.token_frequencies(ids, vocab_size),
            "G": factors.output_factor(g, forms["G"])}

  return _tagged("embed", name, apply, stats, ids, table, None,
                 a_dim=vocab_size, g_dim=features, a_diagonal=True)


def scale_and_shift(x: jax.Array, scale: jax.Array, offset: jax.Array | None = None, *,
                    name: str | None = None, dtype: Any = None,
                    example_dims: int | None = None) -> jax.Array:
  """`x * scale + offset` over the last axis (`x` already normalised: the
  learnable part of LayerNorm / BatchNorm).

  Its curvature is SP-NGD's unit-wise Fisher (`factors.unitwise_fisher`): one
  2×2 block per channel over `(scale_c, offset_c)`, from per-example
  gradients, returned as `stats[name]["F"]` of shape `[C, 3]`.

  `example_dims`: how many leading axes of `x` index examples; the other
  leading axes are positions within an example, whose gradients are summed
  into the example's gradient before the outer product. `None` (default):
  every position is an example, the Dense convention (tokens are examples).
  `kd.linen.BatchNorm` / `kd.nnx.BatchNorm` use 1: on `[B, H, W, C]` feature
  maps an example is an image, SP-NGD Eq. 16.

  `offset=None` (a scale-only layer) is supported: `F`'s `γβ` and `ββ` entries
  are then zero. A layer with an offset but no scale has no tag.
  """
  if scale.ndim != 1 or x.shape[-1:] != scale.shape:
    raise ValueError(f"kd.tags.scale_and_shift: scale of shape {scale.shape} does not "
                     f"match the last axis of the input {x.shape}")
  if offset is not None and offset.shape != scale.shape:
    raise ValueError(f"kd.tags.scale_and_shift: offset shape {offset.shape}, expected "
                     f"{scale.shape}")
  if example_dims is not None and not 0 <= example_dims < x.ndim:
    raise ValueError(f"kd.tags.scale_and_shift: example_dims={example_dims} for an "
                     f"input of shape {x.shape}")
  has_offset = offset is not None

  def apply(x, scale, offset=None):
    x, scale, offset = _promote(dtype, x, scale, offset)
    y = x * scale
    return y if offset is None else y + offset

  def stats(x, g, forms):
    del forms
    return {"F": factors.unitwise_fisher(x, g, has_offset, example_dims)}

  return _tagged("scale_and_shift", name, apply, stats, x, scale, offset,
                 a_dim=1 + has_offset, g_dim=scale.shape[0])
