"""Drop-in Flax linen layers whose curvature K-FAC captures.

Same constructor arguments, parameter names and shapes (and, for BatchNorm,
`batch_stats` collection) as `flax.linen.Dense`, `DenseGeneral`, `Einsum`,
`Conv`, `ConvTranspose`, `Embed`, `LayerNorm`, `RMSNorm`, `BatchNorm`,
`GroupNorm` and `InstanceNorm`, so a plain Flax checkpoint loads into the
tagged model. Configurations with no supported form here (masks, custom
dot/conv functions, DenseGeneral batch axes or contractions over other than
the last axes, Einsum equations that are not a Dense layer's,
normalisation over other than the last feature axis, an offset without a
scale, ...) run Flax's own code, untagged, with a warning (and `discover`
lists them as uncaptured).

Each layer's computation is a function of the module (`dense`, `conv`,
`dense_general`, `einsum`, `embed`, `layer_norm`, `batch_norm`, `rms_norm`,
`group_norm`, `instance_norm`), shared by the classes below and by the
interception of unmodified `flax.linen` layers (`kfac_jax_dist.flax.intercept`);
on a plain Flax module they read `kfac_example_dims` as the class's default.

Every tagged layer takes one extra, optional field, `kfac_example_dims`
(see `kd.tags.dense` and `kd.tags.scale_and_shift`): how many leading axes of
the input index examples, the positions inside an example being reduced
before the statistics' outer products. The default `None` treats every
position (token, output pixel) as an example ("K-FAC-expand"); e.g. 1 on
`[B, T, d]` reduces over the sequence ("K-FAC-reduce", Eschenhagen et al.
2023). BatchNorm's, GroupNorm's and InstanceNorm's default is 1 (each image
one example, as SP-NGD does for BatchNorm). Embed has no such field (its A
counts tokens).

Scanned layers: inside `nn.scan` / `nn.vmap` with `variable_axes={"params":
0}` each block gets its own factors (see `kfac_jax_dist.capture.stacking`); the layer
finds its stacked parameter leaf by its scope path, and during
`kd.value_and_grad` reads its block's probes from the parameter entry
`__kfac_probes__` that the capture adds next to its kernel.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes

from kfac_jax_dist.flax import common as _flax_common
from kfac_jax_dist.capture import context as _context
from kfac_jax_dist.capture import stacking
from kfac_jax_dist.capture import tags


Fallback = Callable[[], Any]


def where(module: nn.Module) -> str:
  """The module's path, for the uncaptured-layer report."""
  return "/".join(str(p) for p in module.scope.path) or type(module).__name__


def _example_dims(module: nn.Module, default: int | None = None) -> int | None:
  return getattr(module, "kfac_example_dims", default)


def dense(module: nn.Dense, inputs, fallback: Fallback):
  """`nn.Dense.__call__`, tagged with `kd.tags.dense`."""
  if (module.dot_general is not None or module.dot_general_cls is not None
      or _flax_common.custom_promote(module, linen_dtypes.promote_dtype)):
    return _flax_common.untagged("Dense", "a custom dot_general or promote_dtype",
                                 where(module), fallback)
  kernel = module.param("kernel", module.kernel_init,
                        (jnp.shape(inputs)[-1], module.features), module.param_dtype)
  bias = (module.param("bias", module.bias_init, (module.features,), module.param_dtype)
          if module.use_bias else None)
  return tags.dense(inputs, kernel, bias, dtype=module.dtype, precision=module.precision,
                    example_dims=_example_dims(module),
                    _site=stacking.linen_site(module, kernel, bias, "kernel", "bias"))


def _conv_tagged(module: nn.Module, inputs, config: _flax_common.ConvConfig) -> jax.Array:
  """A linen convolution's parameters created as Flax does, and the tag of its
  dimension (`config`: `common.conv_config` / `conv_transpose_config`'s)."""
  inputs, restore = _flax_common.flatten_batch(inputs, config.spatial)
  inputs = _flax_common.padded_edges(inputs, config.edge)
  kernel_size = _flax_common.kernel_window(module.kernel_size)
  channels = ((module.features, inputs.shape[-1]) if config.transpose_kernel
              else (inputs.shape[-1] // config.groups, module.features))
  kernel = module.param("kernel", module.kernel_init, kernel_size + channels,
                        module.param_dtype)
  bias = (module.param("bias", module.bias_init, (module.features,), module.param_dtype)
          if module.use_bias else None)
  y = tags.CONVOLUTIONS[config.spatial](
      inputs, kernel, bias, strides=config.strides, padding=config.padding,
      dilation=config.dilation, input_dilation=config.input_dilation,
      feature_group_count=config.groups, dtype=module.dtype, precision=module.precision,
      example_dims=_example_dims(module), transpose_kernel=config.transpose_kernel,
      _site=stacking.linen_site(module, kernel, bias, "kernel", "bias"))
  return restore(y)


def conv(module: nn.Conv, inputs, fallback: Fallback):
  """`nn.Conv.__call__` (1-D, 2-D or 3-D), tagged with `kd.tags.conv1d` /
  `conv2d` / `conv3d`."""
  custom = (module.conv_general_dilated is not None
            or module.conv_general_dilated_cls is not None or not module.shared_weights
            or _flax_common.custom_promote(module, linen_dtypes.promote_dtype))
  config = _flax_common.conv_config(
      module.kernel_size, module.strides, module.padding, module.input_dilation,
      module.kernel_dilation, module.feature_group_count, module.mask,
      "a custom convolution or promote_dtype, or unshared weights" if custom else None)
  if isinstance(config, str):
    return _flax_common.untagged("Conv", config, where(module), fallback)
  return _conv_tagged(module, inputs, config)


def conv_transpose(module: nn.ConvTranspose, inputs, fallback: Fallback):
  """`nn.ConvTranspose.__call__`, tagged as the convolution of the input
  dilated by the strides that it computes (`common.conv_transpose_config`)."""
  config = _flax_common.conv_transpose_config(module, linen_dtypes.promote_dtype,
                                                 jnp.shape(inputs))
  if isinstance(config, str):
    return _flax_common.untagged("ConvTranspose", config, where(module), fallback)
  return _conv_tagged(module, inputs, config)


def dense_general(module: nn.DenseGeneral, inputs, fallback: Fallback):
  """`nn.DenseGeneral.__call__`, tagged with `kd.tags.dense_general` when it
  contracts the last input axes and has no `batch_dims`."""
  custom = (module.dot_general is not None or module.dot_general_cls is not None
            or _flax_common.custom_promote(module, linen_dtypes.promote_dtype))
  in_dims = _flax_common.dense_general_config(module.axis, inputs.ndim,
                                              module.batch_dims, custom)
  if isinstance(in_dims, str):
    return _flax_common.untagged("DenseGeneral", in_dims, where(module), fallback)
  features = ((module.features,) if isinstance(module.features, int)
              else tuple(module.features))
  kernel = module.param("kernel", _flax_common.flat_init(module.kernel_init, in_dims),
                        tuple(inputs.shape[inputs.ndim - in_dims:]) + features,
                        module.param_dtype)
  bias = (module.param("bias", _flax_common.flat_init(module.bias_init, 0), features,
                       module.param_dtype) if module.use_bias else None)
  return tags.dense_general(inputs, kernel, bias, in_dims=in_dims, dtype=module.dtype,
                            precision=module.precision,
                            example_dims=_example_dims(module),
                            _site=stacking.linen_site(module, kernel, bias, "kernel",
                                                      "bias"))


def einsum(module: nn.Einsum, inputs, einsum_str, fallback: Fallback):
  """`nn.Einsum.__call__`, tagged with `kd.tags.dense_general` where its
  equation is a Dense layer's (every input axis contracted with the kernel or
  kept, every kernel axis contracted or an output feature, in any order;
  `_flax_common.einsum_dense_config`). Its bias is Flax's: the features in
  the output's order."""
  if einsum_str is not None and module.einsum_str is not None:
    return fallback()                          # Flax's own error
  custom = (getattr(module, "preferred_element_type", None) is not None
            or _flax_common.custom_promote(module, linen_dtypes.promote_dtype))
  layout = _flax_common.einsum_dense_config(
      module.einsum_str if einsum_str is None else einsum_str, jnp.ndim(inputs),
      len(module.shape), custom)
  if layout == "":
    return fallback()                          # Flax's own error
  if isinstance(layout, str):
    return _flax_common.untagged("Einsum", layout, where(module), fallback)
  shape = tuple(module.shape)
  kernel = module.param("kernel", module.kernel_init, shape, module.param_dtype)
  bias = (module.param("bias", module.bias_init, layout.features(shape),
                       module.param_dtype) if module.use_bias else None)
  return layout.run(inputs, functools.partial(
      tags.dense_general, kernel=kernel, bias=bias, in_dims=layout.in_dims,
      dtype=module.dtype, precision=module.precision, example_dims=_example_dims(module),
      _site=stacking.linen_site(module, kernel, bias, "kernel", "bias")))


def embed(module: nn.Embed, inputs, fallback: Fallback):
  """`nn.Embed.__call__`, tagged with `kd.tags.embed`."""
  if _flax_common.custom_promote(module, linen_dtypes.promote_dtype):
    return _flax_common.untagged("Embed", "a custom promote_dtype", where(module),
                                 fallback)
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError("Input type must be an integer or unsigned integer.")
  if module.num_embeddings == 1:          # Flax broadcasts the single row
    inputs = jnp.zeros_like(inputs)
  return tags.embed(inputs, module.embedding, dtype=module.dtype,
                    _site=stacking.linen_site(module, module.embedding, None, "embedding",
                                              None))


def _scale_and_shift(module: nn.Module, x, x_hat, example_dims: int | None):
  """The learnable part of a linen normalisation, tagged: creates `scale`
  (and `bias`, if the module has one) like Flax and casts the result to
  Flax's dtype."""
  features = (x.shape[-1],)
  scale = module.param("scale", module.scale_init, features, module.param_dtype)
  bias = (module.param("bias", module.bias_init, features, module.param_dtype)
          if getattr(module, "use_bias", False) else None)
  y = tags.scale_and_shift(x_hat, scale, bias, example_dims=example_dims,
                           _site=stacking.linen_site(module, scale, bias, "scale",
                                                     "bias" if bias is not None else None))
  return jnp.asarray(y, linen_dtypes.canonicalize_dtype(x, scale, bias, dtype=module.dtype))


def _norm_reason(module: nn.Module, ndim: int, feature_axes) -> str | None:
  if not module.use_scale:
    return "use_scale=False" if getattr(module, "use_bias", False) else None
  return _flax_common.norm_config(ndim, feature_axes,
                                  custom=not getattr(module, "force_float32_reductions", True))


def _normalisation(kind: str, module: nn.Module, x, feature_axes, fallback: Fallback
                   ) -> Any:
  """None when the normalisation is tagged, else Flax's own result (outside
  a capture, bit for bit what `nn.LayerNorm` gives: the tagged path applies
  the scale after normalising, Flax with the inverse deviation, a rounding
  apart; an unsupported configuration, reported; or nothing to precondition)."""
  reason = _norm_reason(module, jnp.ndim(x), feature_axes)
  if reason is not None:
    return _flax_common.untagged(kind, reason, where(module), fallback)
  if not module.use_scale or _context.tagging() is None:
    return fallback()
  return None


def layer_norm(module: nn.LayerNorm, x, mask, fallback: Fallback):
  """`nn.LayerNorm.__call__`, its scale and bias tagged with
  `kd.tags.scale_and_shift` (SP-NGD's unit-wise Fisher)."""
  out = _normalisation("LayerNorm", module, x, module.feature_axes, fallback)
  if out is not None:
    return out
  mean, var = _flax_common.moments(x, module.reduction_axes, module.dtype, module.axis_name,
                                   module.axis_index_groups, module.use_fast_variance, mask)
  x_hat = _flax_common.normalized(x, mean, var, module.reduction_axes, module.epsilon)
  return _scale_and_shift(module, x, x_hat, _example_dims(module))


def rms_norm(module: nn.RMSNorm, x, mask, fallback: Fallback):
  """`nn.RMSNorm.__call__`, its scale tagged with `kd.tags.scale_and_shift`
  (no bias): `x̂ = x / sqrt(E[x²] + ε)`."""
  out = _normalisation("RMSNorm", module, x, module.feature_axes, fallback)
  if out is not None:
    return out
  mean, var = _flax_common.moments(x, module.reduction_axes, module.dtype, module.axis_name,
                                   module.axis_index_groups, module.use_fast_variance, mask,
                                   use_mean=False)
  x_hat = _flax_common.normalized(x, mean, var, module.reduction_axes, module.epsilon)
  return _scale_and_shift(module, x, x_hat, _example_dims(module))


def batch_norm(module: nn.BatchNorm, x, use_running_average, mask, fallback: Fallback):
  """`nn.BatchNorm.__call__` (same `batch_stats`), its scale and bias tagged
  with `kd.tags.scale_and_shift`, one example per entry of the leading batch
  axis by default."""
  out = _normalisation("BatchNorm", module, x, module.axis, fallback)
  if out is not None:
    return out
  use_running_average = nn.merge_param("use_running_average",
                                       module.use_running_average, use_running_average)
  features = (x.shape[-1],)
  reduction_axes = tuple(range(x.ndim - 1))
  ra_mean = module.variable("batch_stats", "mean",
                            lambda s: jnp.zeros(s, jnp.float32), features)
  ra_var = module.variable("batch_stats", "var",
                           lambda s: jnp.ones(s, jnp.float32), features)
  if use_running_average:
    mean, var = ra_mean.value, ra_var.value
  else:
    initializing = module.is_initializing()
    mean, var = _flax_common.moments(
        x, reduction_axes, module.dtype, None if initializing else module.axis_name,
        module.axis_index_groups, module.use_fast_variance, mask)
    if not initializing:
      ra_mean.value = module.momentum * ra_mean.value + (1 - module.momentum) * mean
      ra_var.value = module.momentum * ra_var.value + (1 - module.momentum) * var
  x_hat = _flax_common.normalized(x, mean, var, reduction_axes, module.epsilon)
  return _scale_and_shift(module, x, x_hat, _example_dims(module, 1))


def group_norm(module: nn.GroupNorm, x, mask, fallback: Fallback):
  """`nn.GroupNorm.__call__`, its scale and bias tagged with
  `kd.tags.scale_and_shift`: `x̂` normalised over each group of channels and
  the other reduction axes, one example per entry of the leading batch axis
  by default."""
  out = _normalisation("GroupNorm", module, x, -1, fallback)
  if out is not None:
    return out
  groups = _flax_common.group_count(x.shape[-1], module.num_groups, module.group_size)
  axes = _flax_common.group_reduction_axes(jnp.ndim(x), module.reduction_axes)
  if groups is None or axes is None:
    return fallback()                          # Flax's own error
  x_hat = _flax_common.group_normalized(module, x, groups, axes, mask)
  return _scale_and_shift(module, x, x_hat, _example_dims(module, 1))


def instance_norm(module: nn.InstanceNorm, x, mask, fallback: Fallback):
  """`nn.InstanceNorm.__call__`, its scale and bias tagged with
  `kd.tags.scale_and_shift`: `x̂` normalised per example and channel over the
  axes between, one example per entry of the leading batch axis by default."""
  out = _normalisation("InstanceNorm", module, x, module.feature_axes, fallback)
  if out is not None:
    return out
  x_hat = _flax_common.instance_normalized(module, x, mask)
  if x_hat is None:
    return fallback()                          # Flax's own error
  return _scale_and_shift(module, x, x_hat, _example_dims(module, 1))


# ------------------------------------------------------------ the drop-in classes

class Dense(nn.Dense):
  """`flax.linen.Dense`, tagged with `kd.tags.dense`."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    return dense(self, inputs, functools.partial(super().__call__, inputs))


class Conv(nn.Conv):
  """`flax.linen.Conv` (1-D, 2-D or 3-D), tagged with `kd.tags.conv1d` /
  `conv2d` / `conv3d`."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    return conv(self, inputs, functools.partial(super().__call__, inputs))


class ConvTranspose(nn.ConvTranspose):
  """`flax.linen.ConvTranspose` (SAME, VALID, CIRCULAR or explicit padding;
  a `transpose_kernel=True` kernel too), tagged as the convolution it
  computes: `kd.tags.conv1d` / `conv2d` / `conv3d` of the input (CIRCULAR:
  wrapped around first) dilated by the strides (with the tag's
  `transpose_kernel`). A masked kernel runs Flax's own code, untagged, with
  a warning."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    return conv_transpose(self, inputs, functools.partial(super().__call__, inputs))


class DenseGeneral(nn.DenseGeneral):
  """`flax.linen.DenseGeneral`, tagged with `kd.tags.dense_general` when it
  contracts the last input axes and has no `batch_dims`."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    return dense_general(self, inputs, functools.partial(super().__call__, inputs))


class Einsum(nn.Einsum):
  """`flax.linen.Einsum`, tagged with `kd.tags.dense_general` where its
  equation is a Dense layer's (`BC,CF->BF` up to the letters and the order
  of the axes; other equations run Flax's code, untagged, with a warning)."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs, einsum_str=None):
    return einsum(self, inputs, einsum_str,
                  functools.partial(super().__call__, inputs, einsum_str))


class Embed(nn.Embed):
  """`flax.linen.Embed`, tagged with `kd.tags.embed` (`attend`, which reuses
  the table as an output projection, is Flax's own and untagged)."""

  def __call__(self, inputs):
    return embed(self, inputs, functools.partial(super().__call__, inputs))


class LayerNorm(nn.LayerNorm):
  """`flax.linen.LayerNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift` (SP-NGD's unit-wise Fisher; tokens are examples
  unless `kfac_example_dims` says otherwise)."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    return layer_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


class RMSNorm(nn.RMSNorm):
  """`flax.linen.RMSNorm` whose scale is tagged with `kd.tags.scale_and_shift`
  (no bias; tokens are examples unless `kfac_example_dims` says otherwise)."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    return rms_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


class BatchNorm(nn.BatchNorm):
  """`flax.linen.BatchNorm` (same `batch_stats`) whose scale and bias are tagged
  with `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one example per
  entry of the leading batch axis (`kfac_example_dims=1`)."""

  kfac_example_dims: int | None = 1

  @nn.compact
  def __call__(self, x, use_running_average=None, *, mask=None):
    return batch_norm(self, x, use_running_average, mask, functools.partial(
        super().__call__, x, use_running_average, mask=mask))


class GroupNorm(nn.GroupNorm):
  """`flax.linen.GroupNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one example per entry
  of the leading batch axis (`kfac_example_dims=1`)."""

  kfac_example_dims: int | None = 1

  @nn.compact
  def __call__(self, x, *, mask=None):
    return group_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


class InstanceNorm(nn.InstanceNorm):
  """`flax.linen.InstanceNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one example per entry
  of the leading batch axis (`kfac_example_dims=1`)."""

  kfac_example_dims: int | None = 1

  @nn.compact
  def __call__(self, x, *, mask=None):
    return instance_norm(self, x, mask, functools.partial(super().__call__, x, mask=mask))


TAGGED = (Dense, Conv, ConvTranspose, DenseGeneral, Einsum, Embed, LayerNorm, RMSNorm,
          BatchNorm, GroupNorm, InstanceNorm)
