"""Drop-in Flax NNX layers whose curvature K-FAC captures.

Same constructor arguments, attribute names and shapes (BatchNorm's `mean` and
`var` BatchStats included) as `flax.nnx.Linear`, `LinearGeneral`, `Einsum`,
`Conv`, `ConvTranspose`, `Embed`, `LayerNorm`, `RMSNorm`, `BatchNorm`,
`GroupNorm` and `InstanceNorm`. Unsupported configurations (masks,
LinearGeneral batch axes, Einsum equations that are not a Dense layer's,
normalisation over other than the last feature axis, an offset without a
scale, ...) run NNX's own code, untagged, with a warning (and `discover`
lists them as uncaptured).

Each layer's computation is a function of the module (`linear`, `conv`,
`linear_general`, `einsum`, `embed`, `layer_norm`, `rms_norm`, `batch_norm`,
`group_norm`, `instance_norm`), shared by the classes below and by the
interception of unmodified `flax.nnx` layers (`kfac_jax_dist.flax.intercept`);
on a plain NNX module they read `kfac_example_dims` as the class's default.

Every tagged layer takes one extra, optional keyword, `kfac_example_dims`
(see `kd.tags.dense` and `kd.tags.scale_and_shift`): how many leading axes of
the input index examples, the positions inside an example being reduced
before the statistics' outer products. The default `None` treats every
position (token, output pixel) as an example ("K-FAC-expand"); e.g. 1 on
`[B, T, d]` reduces over the sequence ("K-FAC-reduce", Eschenhagen et al.
2023). BatchNorm's, GroupNorm's and InstanceNorm's default is 1 (each image
one example, as SP-NGD does for BatchNorm). Embed has no such keyword (its A
counts tokens).

Stacked layers: a module created with `nnx.vmap` (e.g. under
`nnx.split_rngs(splits=L)`) and applied with `nnx.scan` / `nnx.vmap` over axis
0 gives each block its own factors (see `kfac_jax_dist.capture.stacking`). Pass
`kd.value_and_grad` the `nnx.State` (of `nnx.split`), not a pure dict: the
capture stamps its Variables with their paths (metadata `kfac_path`) and, for
a stacked layer, lets the kernel Variable carry the probes (a
`stacking.Probed` value, unwrapped by the layer; read a stacked tagged
kernel only through its layer inside the loss).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from kfac_jax_dist.flax import common as _flax_common
from kfac_jax_dist.capture import context as _context
from kfac_jax_dist.capture import stacking
from kfac_jax_dist.capture import tags


def _raw(variable):
  """The array a Variable holds, not a copy (tags match it by identity)."""
  if variable is None:
    return None
  get = getattr(variable, "get_value", None)
  return get() if get is not None else variable.value


def _assign(variable, value) -> None:
  set_value = getattr(variable, "set_value", None)
  if set_value is not None:
    set_value(value)
  else:
    variable.value = value


_UNSET = object()
Fallback = Callable[[], Any]


def where(module: nnx.Module, attribute: str) -> str:
  """The module's path (its `attribute` Variable's leaf path without the last
  key), for the uncaptured-layer report; its class name where unknown."""
  variable = getattr(module, attribute, None)
  trace = _context.current()
  path = None if trace is None else trace.path_of(_raw(variable))
  if path is None and variable is not None:
    path = stacking.variable_path(variable)
  return (stacking.owner_path(path) if path else "") or type(module).__name__


def _given(out_sharding: Any) -> tuple:
  """`out_sharding` as a positional argument of NNX's own `__call__`, only when
  given (flax < 0.12.x's layers have no such argument)."""
  return () if out_sharding is None else (out_sharding,)


def _example_dims(module: nnx.Module, default: int | None = None) -> int | None:
  return getattr(module, "kfac_example_dims", default)


def _untagged(kind: str, reason: str, module: nnx.Module, attribute: str,
              fallback: Fallback) -> Any:
  return _flax_common.untagged(kind, reason, where(module, attribute), fallback)


class _ExampleDims:
  """The `kfac_example_dims=` keyword (module docstring) of a tagged layer."""

  DEFAULT_EXAMPLE_DIMS: int | None = None

  def __init__(self, *args, kfac_example_dims: Any = _UNSET, **kwargs):
    super().__init__(*args, **kwargs)
    self.kfac_example_dims = (self.DEFAULT_EXAMPLE_DIMS if kfac_example_dims is _UNSET
                              else kfac_example_dims)


def linear(module: nnx.Linear, inputs, out_sharding, fallback: Fallback):
  """`nnx.Linear.__call__`, tagged with `kd.tags.dense`."""
  if (module.dot_general is not lax.dot_general or out_sharding is not None
      or getattr(module, "preferred_element_type", None) is not None
      or _flax_common.custom_promote(module, nnx_dtypes.promote_dtype)):
    return _untagged("Linear", "a custom dot_general, promote_dtype or output sharding",
                     module, "kernel", fallback)
  kernel, bias, site = stacking.nnx_site(module.kernel, module.bias)
  return tags.dense(inputs, kernel, bias, dtype=module.dtype, precision=module.precision,
                    example_dims=_example_dims(module), _site=site)


def _conv_tagged(module: nnx.Module, inputs, config: _flax_common.ConvConfig
                 ) -> jax.Array:
  """An NNX convolution through the tag of its dimension (`config`:
  `common.conv_config` / `conv_transpose_config`'s)."""
  inputs, restore = _flax_common.flatten_batch(inputs, config.spatial)
  inputs = _flax_common.padded_edges(inputs, config.edge)
  kernel, bias, site = stacking.nnx_site(module.kernel, module.bias)
  y = tags.CONVOLUTIONS[config.spatial](
      inputs, kernel, bias, strides=config.strides, padding=config.padding,
      dilation=config.dilation, input_dilation=config.input_dilation,
      feature_group_count=config.groups, dtype=module.dtype, precision=module.precision,
      example_dims=_example_dims(module), transpose_kernel=config.transpose_kernel,
      _site=site)
  return restore(y)


def conv(module: nnx.Conv, inputs, out_sharding, fallback: Fallback):
  """`nnx.Conv.__call__` (1-D, 2-D or 3-D), tagged with `kd.tags.conv1d` /
  `conv2d` / `conv3d`."""
  custom = (module.conv_general_dilated is not lax.conv_general_dilated
            or out_sharding is not None
            or getattr(module, "preferred_element_type", None) is not None
            or _flax_common.custom_promote(module, nnx_dtypes.promote_dtype))
  config = _flax_common.conv_config(
      module.kernel_size, module.strides, module.padding, module.input_dilation,
      module.kernel_dilation, module.feature_group_count, module.mask,
      "a custom convolution, promote_dtype or output sharding" if custom else None)
  if isinstance(config, str):
    return _untagged("Conv", config, module, "kernel", fallback)
  return _conv_tagged(module, inputs, config)


def conv_transpose(module: nnx.ConvTranspose, inputs, fallback: Fallback):
  """`nnx.ConvTranspose.__call__`, tagged as the convolution of the input
  dilated by the strides that it computes (`common.conv_transpose_config`)."""
  config = _flax_common.conv_transpose_config(module, nnx_dtypes.promote_dtype,
                                                 jnp.shape(inputs))
  if isinstance(config, str):
    return _untagged("ConvTranspose", config, module, "kernel", fallback)
  return _conv_tagged(module, inputs, config)


def linear_general(module: nnx.LinearGeneral, inputs, out_sharding, fallback: Fallback):
  """`nnx.LinearGeneral.__call__`, tagged with `kd.tags.dense_general` when it
  contracts the last input axes and has no `batch_axis`."""
  custom = (module.dot_general is not None or module.dot_general_cls is not None
            or out_sharding is not None
            or getattr(module, "preferred_element_type", None) is not None
            or _flax_common.custom_promote(module, nnx_dtypes.promote_dtype))
  in_dims = _flax_common.dense_general_config(module.axis, inputs.ndim,
                                              tuple(module.batch_axis), custom)
  if isinstance(in_dims, str):
    return _untagged("LinearGeneral", in_dims, module, "kernel", fallback)
  kernel, bias, site = stacking.nnx_site(module.kernel, module.bias)
  return tags.dense_general(inputs, kernel, bias, in_dims=in_dims, dtype=module.dtype,
                            precision=module.precision,
                            example_dims=_example_dims(module), _site=site)


def _leaf_name(kernel, site: stacking.Site | None) -> str | None:
  """The kernel's own leaf path as its layer's name (two kernels of one
  module would share the module's path), None outside a capture."""
  trace = _context.tagging()
  if trace is None:
    return None
  return site.kernel_path if site is not None else trace.path_of(kernel)


def lora(module: nnx.LoRA, inputs, kwargs: dict, fallback: Fallback):
  """`nnx.LoRA.__call__`, `x A B` (plus its base module's output), as two
  tagged dense layers without bias, `A` (inputs → rank) and `B` (rank →
  outputs), each named by its leaf (`…/lora_a`, `…/lora_b`)."""
  if _flax_common.custom_promote(module, nnx_dtypes.promote_dtype):
    return _untagged("LoRA", "a custom promote_dtype", module, "lora_a", fallback)
  a, _, site_a = stacking.nnx_site(module.lora_a, None)
  b, _, site_b = stacking.nnx_site(module.lora_b, None)
  dtype = jnp.result_type(inputs, a, b) if module.dtype is None else module.dtype
  inputs = jnp.asarray(inputs, dtype)
  hidden = tags.dense(inputs, a, dtype=dtype, name=_leaf_name(a, site_a), _site=site_a)
  out = tags.dense(hidden, b, dtype=dtype, name=_leaf_name(b, site_b), _site=site_b)
  if module.base_module is not None:
    out = out + module.base_module(inputs, **kwargs)
  return out


def einsum(module: nnx.Einsum, inputs, einsum_str, out_sharding, fallback: Fallback):
  """`nnx.Einsum.__call__`, tagged with `kd.tags.dense_general` where its
  equation is a Dense layer's (as `kd.linen.Einsum`) and its bias, if any,
  has the kernel's output features, in the output's order."""
  custom = (module.einsum_op is not jnp.einsum
            or getattr(module, "preferred_element_type", None) is not None
            or _flax_common.custom_promote(module, nnx_dtypes.promote_dtype))
  kernel, bias, site = stacking.nnx_site(module.kernel, module.bias)
  layout = _flax_common.einsum_dense_config(
      module.einsum_str if einsum_str is None else einsum_str, jnp.ndim(inputs),
      kernel.ndim, custom)
  if layout == "":
    return fallback()                          # NNX's own error
  if out_sharding is not None and not isinstance(layout, str):
    layout = "an output sharding (out_sharding)"
  if not isinstance(layout, str) and bias is not None and (
      tuple(bias.shape) != layout.features(tuple(kernel.shape))):
    layout = f"a bias of shape {bias.shape}, not the kernel's output features"
  if isinstance(layout, str):
    return _untagged("Einsum", layout, module, "kernel", fallback)
  return layout.run(inputs, functools.partial(
      tags.dense_general, kernel=kernel, bias=bias, in_dims=layout.in_dims,
      dtype=module.dtype, precision=module.precision, example_dims=_example_dims(module),
      _site=site))


def embed(module: nnx.Embed, inputs, out_sharding, fallback: Fallback):
  """`nnx.Embed.__call__`, tagged with `kd.tags.embed`."""
  if out_sharding is not None or _flax_common.custom_promote(module,
                                                             nnx_dtypes.promote_dtype):
    return _untagged("Embed", "a custom promote_dtype or output sharding", module,
                     "embedding", fallback)
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError("Input type must be an integer or unsigned integer.")
  if module.num_embeddings == 1:          # NNX broadcasts the single row
    inputs = jnp.zeros_like(inputs)
  table, _, site = stacking.nnx_site(module.embedding, None)
  return tags.embed(inputs, table, dtype=module.dtype, _site=site)


def _normalisation(kind: str, module: nnx.Module, x, feature_axes, fallback: Fallback,
                   unsupported: str | None = None) -> Any:
  """None when the normalisation is tagged, else NNX's own result (outside
  a capture, bit for bit `nnx.LayerNorm`'s: see `linen._normalisation`; an
  unsupported configuration, reported, `unsupported` the caller's reason;
  or nothing to precondition)."""
  if not module.use_scale:
    if getattr(module, "use_bias", False):
      return _untagged(kind, "use_scale=False", module, "bias", fallback)
    return fallback()
  reason = unsupported or _flax_common.norm_config(
      jnp.ndim(x), feature_axes,
      custom=_flax_common.custom_promote(module, nnx_dtypes.promote_dtype))
  if reason is not None:
    return _untagged(kind, reason, module, "scale", fallback)
  return fallback() if _context.tagging() is None else None


def _promotes(module: nnx.Module) -> bool:
  """Whether the NNX norm casts its input and parameters to its `dtype`
  before computing (its `promote_dtype`: flax 0.12.8 and 0.12.12 checked);
  flax 0.12.0's computes in their own dtypes and casts only the result."""
  return hasattr(module, "promote_dtype")


def _promoted(module: nnx.Module, x) -> tuple[jax.Array, Any]:
  """`(x, dtype)`: `x` as the normalisation computes with it (in the dtype
  of its result where NNX promotes the input, scale and bias) and that
  dtype."""
  scale, bias, _ = stacking.nnx_site(module.scale, getattr(module, "bias", None))
  dtype = nnx_dtypes.canonicalize_dtype(x, scale, bias, dtype=module.dtype)
  return jnp.asarray(x, dtype if _promotes(module) else None), dtype


def _normalised(module: nnx.Module, x, mask, use_mean: bool):
  """`(x̂, dtype)`: `x` normalised over the module's reduction axes (LayerNorm:
  centred; RMSNorm: not), in NNX's dtype."""
  x, dtype = _promoted(module, x)
  mean, var = _flax_common.moments(x, module.reduction_axes, module.dtype, module.axis_name,
                                   module.axis_index_groups, module.use_fast_variance, mask,
                                   use_mean=use_mean)
  return _flax_common.normalized(x, mean, var, module.reduction_axes, module.epsilon), dtype


def _scale_and_shift(module: nnx.Module, x_hat, dtype, default_dims: int | None = None):
  """The module's scale (and bias, if it has one) applied to `x̂`, tagged,
  both rounded to `dtype` first where NNX's promotion does (`_promotes`)."""
  scale, bias, site = stacking.nnx_site(module.scale, getattr(module, "bias", None))
  y = tags.scale_and_shift(x_hat, scale, bias,
                           example_dims=_example_dims(module, default_dims), _site=site,
                           _params_dtype=dtype if _promotes(module) else None)
  return jnp.asarray(y, dtype)


def layer_norm(module: nnx.LayerNorm, x, mask, fallback: Fallback):
  """`nnx.LayerNorm.__call__`, its scale and bias tagged with
  `kd.tags.scale_and_shift` (SP-NGD's unit-wise Fisher)."""
  out = _normalisation("LayerNorm", module, x, module.feature_axes, fallback)
  if out is not None:
    return out
  return _scale_and_shift(module, *_normalised(module, x, mask, use_mean=True))


def rms_norm(module: nnx.RMSNorm, x, mask, fallback: Fallback):
  """`nnx.RMSNorm.__call__`, its scale tagged with `kd.tags.scale_and_shift`
  (no bias): `x̂ = x / sqrt(E[x²] + ε)`."""
  out = _normalisation("RMSNorm", module, x, module.feature_axes, fallback)
  if out is not None:
    return out
  return _scale_and_shift(module, *_normalised(module, x, mask, use_mean=False))


def batch_norm(module: nnx.BatchNorm, x, use_running_average, mask, fallback: Fallback):
  """`nnx.BatchNorm.__call__` (same `mean`/`var` BatchStats), its scale and
  bias tagged with `kd.tags.scale_and_shift`, one example per entry of the
  leading batch axis by default."""
  out = _normalisation("BatchNorm", module, x, module.axis, fallback)
  if out is not None:
    return out
  use_running_average = _flax_common.call_flag(
      "use_running_average", use_running_average, module.use_running_average)
  scale, bias, _ = stacking.nnx_site(module.scale, module.bias)
  running_mean, running_var = _raw(module.mean), _raw(module.var)
  dtype = nnx_dtypes.canonicalize_dtype(x, running_mean, running_var, scale, bias,
                                        dtype=module.dtype)
  computed = dtype if _promotes(module) else None
  x = jnp.asarray(x, computed)
  reduction_axes = tuple(range(x.ndim - 1))
  if use_running_average:
    mean, var = jnp.asarray(running_mean, computed), jnp.asarray(running_var, computed)
  else:
    mean, var = _flax_common.moments(x, reduction_axes, module.dtype, module.axis_name,
                                     module.axis_index_groups, module.use_fast_variance,
                                     mask)
    # As in NNX: no gradients through the running statistics, which keep
    # their dtype.
    _assign(module.mean, lax.stop_gradient(
        module.momentum * running_mean + (1 - module.momentum) * mean
    ).astype(running_mean.dtype))
    _assign(module.var, lax.stop_gradient(
        module.momentum * running_var + (1 - module.momentum) * var
    ).astype(running_var.dtype))
  x_hat = _flax_common.normalized(x, mean, var, reduction_axes, module.epsilon)
  return _scale_and_shift(module, x_hat, dtype, default_dims=1)


def group_norm(module: nnx.GroupNorm, x, mask, fallback: Fallback):
  """`nnx.GroupNorm.__call__`, its scale and bias tagged with
  `kd.tags.scale_and_shift`: `x̂` normalised over each group of channels and
  every axis of an example, one example per entry of the leading batch axis by
  default. Other reduction axes run NNX's own code (it repeats the groups'
  statistics along axis 1, the channels only where that is the last one
  left)."""
  axes = _flax_common.group_reduction_axes(jnp.ndim(x), module.reduction_axes)
  if axes is None:
    return fallback()                          # NNX's own error
  out = _normalisation("GroupNorm", module, x, module.feature_axis, fallback,
                       None if axes[:-1] == tuple(range(1, jnp.ndim(x) - 1))
                       else "reduction axes other than all of an example's")
  if out is not None:
    return out
  x, dtype = _promoted(module, x)
  x_hat = _flax_common.group_normalized(module, x, module.num_groups, axes, mask)
  return _scale_and_shift(module, x_hat, dtype, default_dims=1)


def instance_norm(module: nnx.InstanceNorm, x, mask, fallback: Fallback):
  """`nnx.InstanceNorm.__call__`, its scale and bias tagged with
  `kd.tags.scale_and_shift`: `x̂` normalised per example and channel over the
  axes between, one example per entry of the leading batch axis by default."""
  out = _normalisation("InstanceNorm", module, x, module.feature_axes, fallback)
  if out is not None:
    return out
  x, dtype = _promoted(module, x)
  x_hat = _flax_common.instance_normalized(module, x, mask)
  if x_hat is None:
    return fallback()                          # NNX's own error
  return _scale_and_shift(module, x_hat, dtype, default_dims=1)


# ------------------------------------------------------------ the drop-in classes

class Linear(_ExampleDims, nnx.Linear):
  """`flax.nnx.Linear`, tagged with `kd.tags.dense`."""

  def __call__(self, inputs, out_sharding=None):
    return linear(self, inputs, out_sharding,
                  functools.partial(super().__call__, inputs, *_given(out_sharding)))


class Conv(_ExampleDims, nnx.Conv):
  """`flax.nnx.Conv` (1-D, 2-D or 3-D), tagged with `kd.tags.conv1d` /
  `conv2d` / `conv3d`."""

  def __call__(self, inputs, out_sharding=None):
    return conv(self, inputs, out_sharding,
                functools.partial(super().__call__, inputs, *_given(out_sharding)))


class ConvTranspose(_ExampleDims, nnx.ConvTranspose):
  """`flax.nnx.ConvTranspose` (SAME, VALID, CIRCULAR or explicit padding;
  a `transpose_kernel=True` kernel too), tagged as the convolution it
  computes: `kd.tags.conv1d` / `conv2d` / `conv3d` of the input (CIRCULAR:
  wrapped around first) dilated by the strides (with the tag's
  `transpose_kernel`). A masked kernel runs Flax's own code, untagged, with
  a warning."""

  def __call__(self, inputs):
    return conv_transpose(self, inputs, functools.partial(super().__call__, inputs))


class LinearGeneral(_ExampleDims, nnx.LinearGeneral):
  """`flax.nnx.LinearGeneral`, tagged with `kd.tags.dense_general` when it
  contracts the last input axes and has no `batch_axis`."""

  def __call__(self, inputs, out_sharding=None):
    return linear_general(self, inputs, out_sharding,
                          functools.partial(super().__call__, inputs, *_given(out_sharding)))


class Einsum(_ExampleDims, nnx.Einsum):
  """`flax.nnx.Einsum`, tagged with `kd.tags.dense_general` where its equation
  is a Dense layer's (as `kd.linen.Einsum`)."""

  def __call__(self, inputs, einsum_str=None, out_sharding=None):
    return einsum(self, inputs, einsum_str, out_sharding, functools.partial(
        super().__call__, inputs, einsum_str, *_given(out_sharding)))


class Embed(nnx.Embed):
  """`flax.nnx.Embed`, tagged with `kd.tags.embed` (`attend`, which reuses the
  table as an output projection, is NNX's own and untagged)."""

  def __call__(self, inputs, out_sharding=None):
    return embed(self, inputs, out_sharding,
                 functools.partial(super().__call__, inputs, *_given(out_sharding)))


class LayerNorm(_ExampleDims, nnx.LayerNorm):
  """`flax.nnx.LayerNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift` (SP-NGD's unit-wise Fisher; tokens are examples
  unless `kfac_example_dims` says otherwise)."""

  def __call__(self, x, *, mask=None):
    return layer_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


class RMSNorm(_ExampleDims, nnx.RMSNorm):
  """`flax.nnx.RMSNorm` whose scale is tagged with `kd.tags.scale_and_shift`
  (no bias; tokens are examples unless `kfac_example_dims` says otherwise)."""

  def __call__(self, x, mask=None):       # positional, as NNX's own
    return rms_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


class BatchNorm(_ExampleDims, nnx.BatchNorm):
  """`flax.nnx.BatchNorm` (same `mean`/`var` BatchStats) whose scale and bias
  are tagged with `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one
  example per entry of the leading batch axis (`kfac_example_dims=1`)."""

  DEFAULT_EXAMPLE_DIMS = 1

  def __call__(self, x, use_running_average=None, *, mask=None):
    return batch_norm(self, x, use_running_average, mask, functools.partial(
        super().__call__, x, use_running_average, mask=mask))


class GroupNorm(_ExampleDims, nnx.GroupNorm):
  """`flax.nnx.GroupNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one example per entry
  of the leading batch axis (`kfac_example_dims=1`)."""

  DEFAULT_EXAMPLE_DIMS = 1

  def __call__(self, x, *, mask=None):
    return group_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


class InstanceNorm(_ExampleDims, nnx.InstanceNorm):
  """`flax.nnx.InstanceNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one example per entry
  of the leading batch axis (`kfac_example_dims=1`)."""

  DEFAULT_EXAMPLE_DIMS = 1

  def __call__(self, x, *, mask=None):
    return instance_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


TAGGED = (Linear, Conv, ConvTranspose, LinearGeneral, Einsum, Embed, LayerNorm, RMSNorm,
          BatchNorm, GroupNorm, InstanceNorm)
