"""Tag functions: layers whose curvature K-FAC captures.

`dense` and `conv2d` compute the layer exactly like their Flax counterparts.
Outside `kd.value_and_grad` they are plain functions. Inside it they

* while discovering, record the layer (`registry.TaggedLayer`): its name, kind
  and the parameter leaves it uses (matched by identity against the leaves of
  the parameter tree given to the loss, so pass the parameters themselves and
  let the tag cast them with `dtype=`);
* while capturing, run through a `custom_vjp` whose backward pass also returns
  the layer's statistics `A` and `G` (see `factors`) as the cotangents of zero
  "probe" inputs. Nothing per-example is materialised, and a traced flag skips
  the statistics (`lax.cond`) on steps that update no factor.

A layer's name defaults to its kernel's path in the parameter tree without the
last key (`"Dense_0"` for `{"Dense_0": {"kernel": ...}}`).
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


def _discover(trace, kind, name, kernel, bias, a_dim, g_dim) -> None:
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
      kernel_shape=tuple(kernel.shape), a_dim=a_dim, g_dim=g_dim))


def _captured(apply: Callable, stats: Callable, x, params: tuple, probes, flag):
  """`apply(x, *params)` whose backward pass also returns `stats(x, ḡ)`."""

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
    zeros = _compat.as_varying(jax.tree_util.tree_map(jnp.zeros_like, probes),
                               _compat.varying_axes(x, cotangent))
    probe_bar = lax.cond(flag, lambda: stats(x, cotangent), lambda: zeros)
    return x_bar, tuple(params_bar), probe_bar, None

  layer.defvjp(fwd, bwd)
  return layer(x, params, probes, flag)


def _tagged(kind: str, name, apply, stats, x, kernel, bias, a_dim, g_dim):
  trace = _context.current()
  params = (kernel,) if bias is None else (kernel, bias)
  if trace is None:
    return apply(x, *params)
  name = _layer_name(trace, name, kernel)
  if trace.mode == "discover":
    _discover(trace, kind, name, kernel, bias, a_dim, g_dim)
    return apply(x, *params)
  probes = trace.probes.get(name)
  if probes is None:        # not preconditioned (skipped by the optimizer)
    return apply(x, *params)
  forms = tuple("diag" if p.ndim == 1 else "full" for p in probes)
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
    return (factors.input_factor(x, bias is not None, forms[0]),
            factors.output_factor(g, forms[1]))

  return _tagged("dense", name, apply, stats, x, kernel, bias,
                 kernel.shape[0] + (bias is not None), kernel.shape[1])


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
    return (factors.input_factor(patches, bias is not None, forms[0]),
            factors.output_factor(g, forms[1]))

  kh, kw, cin, cout = kernel.shape
  return _tagged("conv2d", name, apply, stats, x, kernel, bias,
                 kh * kw * cin + (bias is not None), cout)
