"""Drop-in Flax NNX layers whose curvature K-FAC captures.

Same constructor arguments, attribute names and shapes (BatchNorm's `mean` and
`var` BatchStats included) as `flax.nnx.Linear`, `LinearGeneral`, `Conv`,
`Embed`, `LayerNorm` and `BatchNorm`. Unsupported configurations (grouped
convolutions, masks, LinearGeneral batch axes, normalisation over other than
the last feature axis, an offset without a scale, ...) run NNX's own code,
untagged, with a warning.

Every tagged layer takes one extra, optional keyword, `kfac_example_dims`
(see `kd.tags.dense` and `kd.tags.scale_and_shift`): how many leading axes of
the input index examples, the positions inside an example being reduced
before the statistics' outer products. The default `None` treats every
position (token, output pixel) as an example ("K-FAC-expand"); e.g. 1 on
`[B, T, d]` reduces over the sequence ("K-FAC-reduce", Eschenhagen et al.
2023). BatchNorm's default is 1 (each image one example, as SP-NGD does).
Embed has no such keyword (its A counts tokens).

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

from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from kfac_jax_dist.flax import common as _flax_common
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


class _ExampleDims:
  """The `kfac_example_dims=` keyword (module docstring) of a tagged layer."""

  DEFAULT_EXAMPLE_DIMS: int | None = None

  def __init__(self, *args, kfac_example_dims: Any = _UNSET, **kwargs):
    super().__init__(*args, **kwargs)
    self.kfac_example_dims = (self.DEFAULT_EXAMPLE_DIMS if kfac_example_dims is _UNSET
                              else kfac_example_dims)


class Linear(_ExampleDims, nnx.Linear):
  """`flax.nnx.Linear`, tagged with `kd.tags.dense`."""

  def __call__(self, inputs, out_sharding=None):
    if (self.dot_general is not lax.dot_general or out_sharding is not None
        or self.preferred_element_type is not None):
      _flax_common.warn_untagged("Linear", "a custom dot_general or output sharding")
      return super().__call__(inputs, out_sharding)
    kernel, bias, site = stacking.nnx_site(self.kernel, self.bias)
    return tags.dense(inputs, kernel, bias, dtype=self.dtype, precision=self.precision,
                      example_dims=self.kfac_example_dims, _site=site)


class Conv(_ExampleDims, nnx.Conv):
  """`flax.nnx.Conv` (2-D), tagged with `kd.tags.conv2d`."""

  def __call__(self, inputs, out_sharding=None):
    custom = (self.conv_general_dilated is not lax.conv_general_dilated
              or out_sharding is not None or self.preferred_element_type is not None)
    config = _flax_common.conv_config(
        self.kernel_size, self.strides, self.padding, self.input_dilation,
        self.kernel_dilation, self.feature_group_count, self.mask,
        "a custom convolution or output sharding" if custom else None)
    if isinstance(config, str):
      _flax_common.warn_untagged("Conv", config)
      return super().__call__(inputs, out_sharding)
    strides, padding, dilation = config
    inputs, restore = _flax_common.flatten_batch(inputs)
    kernel, bias, site = stacking.nnx_site(self.kernel, self.bias)
    y = tags.conv2d(inputs, kernel, bias, strides=strides, padding=padding,
                    dilation=dilation, dtype=self.dtype, precision=self.precision,
                    example_dims=self.kfac_example_dims, _site=site)
    return restore(y)


class LinearGeneral(_ExampleDims, nnx.LinearGeneral):
  """`flax.nnx.LinearGeneral`, tagged with `kd.tags.dense_general` when it
  contracts the last input axes and has no `batch_axis`."""

  def __call__(self, inputs, out_sharding=None):
    custom = (self.dot_general is not None or self.dot_general_cls is not None
              or out_sharding is not None
              or getattr(self, "preferred_element_type", None) is not None
              or _flax_common.custom_promote(self, nnx_dtypes.promote_dtype))
    in_dims = _flax_common.dense_general_config(self.axis, inputs.ndim,
                                                tuple(self.batch_axis), custom)
    if isinstance(in_dims, str):
      _flax_common.warn_untagged("LinearGeneral", in_dims)
      return super().__call__(inputs, out_sharding)
    kernel, bias, site = stacking.nnx_site(self.kernel, self.bias)
    return tags.dense_general(inputs, kernel, bias, in_dims=in_dims, dtype=self.dtype,
                              precision=self.precision,
                              example_dims=self.kfac_example_dims, _site=site)


class Embed(nnx.Embed):
  """`flax.nnx.Embed`, tagged with `kd.tags.embed` (`attend`, which reuses the
  table as an output projection, is NNX's own and untagged)."""

  def __call__(self, inputs, out_sharding=None):
    if out_sharding is not None or _flax_common.custom_promote(self, nnx_dtypes.promote_dtype):
      _flax_common.warn_untagged("Embed", "a custom promote_dtype or output sharding")
      return super().__call__(inputs, out_sharding)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    if self.num_embeddings == 1:          # NNX broadcasts the single row
      inputs = jnp.zeros_like(inputs)
    table, _, site = stacking.nnx_site(self.embedding, None)
    return tags.embed(inputs, table, dtype=self.dtype, _site=site)


def _norm_reason(module, ndim, feature_axes) -> str | None:
  if not module.use_scale:
    return "use_scale=False" if module.use_bias else None
  return _flax_common.norm_config(
      ndim, feature_axes, custom=_flax_common.custom_promote(module, nnx_dtypes.promote_dtype))


class LayerNorm(_ExampleDims, nnx.LayerNorm):
  """`flax.nnx.LayerNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift` (SP-NGD's unit-wise Fisher; tokens are examples
  unless `kfac_example_dims` says otherwise)."""

  def __call__(self, x, *, mask=None):
    reason = _norm_reason(self, jnp.ndim(x), self.feature_axes)
    if reason is not None or not self.use_scale:
      if reason is not None:
        _flax_common.warn_untagged("LayerNorm", reason)
      return super().__call__(x, mask=mask)
    scale, bias, site = stacking.nnx_site(self.scale, self.bias)
    dtype = nnx_dtypes.canonicalize_dtype(x, scale, bias, dtype=self.dtype)
    x = jnp.asarray(x, dtype)
    mean, var = _flax_common.moments(x, self.reduction_axes, self.dtype, self.axis_name,
                                     self.axis_index_groups, self.use_fast_variance, mask)
    x_hat = _flax_common.normalized(x, mean, var, self.reduction_axes, self.epsilon)
    y = tags.scale_and_shift(x_hat, scale, bias, example_dims=self.kfac_example_dims,
                             _site=site)
    return jnp.asarray(y, dtype)


class BatchNorm(_ExampleDims, nnx.BatchNorm):
  """`flax.nnx.BatchNorm` (same `mean`/`var` BatchStats) whose scale and bias
  are tagged with `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one
  example per entry of the leading batch axis (`kfac_example_dims=1`)."""

  DEFAULT_EXAMPLE_DIMS = 1

  def __call__(self, x, use_running_average=None, *, mask=None):
    reason = _norm_reason(self, jnp.ndim(x), self.axis)
    if reason is not None or not self.use_scale:
      if reason is not None:
        _flax_common.warn_untagged("BatchNorm", reason)
      return super().__call__(x, use_running_average, mask=mask)
    use_running_average = _flax_common.call_flag(
        "use_running_average", use_running_average, self.use_running_average)
    scale, bias, site = stacking.nnx_site(self.scale, self.bias)
    running_mean, running_var = _raw(self.mean), _raw(self.var)
    dtype = nnx_dtypes.canonicalize_dtype(x, running_mean, running_var, scale, bias,
                                          dtype=self.dtype)
    x = jnp.asarray(x, dtype)
    reduction_axes = tuple(range(x.ndim - 1))
    if use_running_average:
      mean, var = jnp.asarray(running_mean, dtype), jnp.asarray(running_var, dtype)
    else:
      mean, var = _flax_common.moments(x, reduction_axes, self.dtype, self.axis_name,
                                       self.axis_index_groups, self.use_fast_variance,
                                       mask)
      # As in NNX: no gradients through the running statistics, which keep
      # their dtype.
      _assign(self.mean, lax.stop_gradient(
          self.momentum * running_mean + (1 - self.momentum) * mean
      ).astype(running_mean.dtype))
      _assign(self.var, lax.stop_gradient(
          self.momentum * running_var + (1 - self.momentum) * var
      ).astype(running_var.dtype))
    x_hat = _flax_common.normalized(x, mean, var, reduction_axes, self.epsilon)
    y = tags.scale_and_shift(x_hat, scale, bias, example_dims=self.kfac_example_dims,
                             _site=site)
    return jnp.asarray(y, dtype)
