"""Drop-in Flax linen layers whose curvature K-FAC captures.

Same constructor arguments, parameter names and shapes (and, for BatchNorm,
`batch_stats` collection) as `flax.linen.Dense`, `DenseGeneral`, `Conv`,
`Embed`, `LayerNorm` and `BatchNorm`, so a plain Flax checkpoint loads into the
tagged model. Configurations with no supported form here (grouped
convolutions, masks, custom dot/conv functions, DenseGeneral batch axes or
contractions over other than the last axes, normalisation over other than the
last feature axis, an offset without a scale, ...) run Flax's own code,
untagged, with a warning.

Every tagged layer takes one extra, optional field, `kfac_example_dims`
(see `kd.tags.dense` and `kd.tags.scale_and_shift`): how many leading axes of
the input index examples, the positions inside an example being reduced
before the statistics' outer products. The default `None` treats every
position (token, output pixel) as an example ("K-FAC-expand"); e.g. 1 on
`[B, T, d]` reduces over the sequence ("K-FAC-reduce", Eschenhagen et al.
2023). BatchNorm's default is 1 (each image one example, as SP-NGD does).
Embed has no such field (its A counts tokens).

Scanned layers: inside `nn.scan` / `nn.vmap` with `variable_axes={"params":
0}` each block gets its own factors (see `kfac_jax_dist.capture.stacking`); the layer
finds its stacked parameter leaf by its scope path, and during
`kd.value_and_grad` reads its block's probes from the parameter entry
`__kfac_probes__` that the capture adds next to its kernel.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes

from kfac_jax_dist.flax import common as _flax_common
from kfac_jax_dist.capture import stacking
from kfac_jax_dist.capture import tags


class Dense(nn.Dense):
  """`flax.linen.Dense`, tagged with `kd.tags.dense`."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    if self.dot_general is not None or self.dot_general_cls is not None:
      _flax_common.warn_untagged("Dense", "a custom dot_general")
      return super().__call__(inputs)
    kernel = self.param("kernel", self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    return tags.dense(inputs, kernel, bias, dtype=self.dtype, precision=self.precision,
                      example_dims=self.kfac_example_dims, _site=stacking.linen_site(self, kernel, bias, "kernel", "bias"))


class Conv(nn.Conv):
  """`flax.linen.Conv` (2-D), tagged with `kd.tags.conv2d`."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    custom = (self.conv_general_dilated is not None
              or self.conv_general_dilated_cls is not None or not self.shared_weights)
    config = _flax_common.conv_config(
        self.kernel_size, self.strides, self.padding, self.input_dilation,
        self.kernel_dilation, self.feature_group_count, self.mask,
        "a custom or unshared convolution" if custom else None)
    if isinstance(config, str):
      _flax_common.warn_untagged("Conv", config)
      return super().__call__(inputs)
    strides, padding, dilation = config
    inputs, restore = _flax_common.flatten_batch(inputs)
    kernel_size = tuple(self.kernel_size) if not isinstance(self.kernel_size, int) else (
        self.kernel_size,) * 2
    kernel = self.param("kernel", self.kernel_init,
                        kernel_size + (inputs.shape[-1], self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    y = tags.conv2d(inputs, kernel, bias, strides=strides, padding=padding,
                    dilation=dilation, dtype=self.dtype, precision=self.precision,
                    example_dims=self.kfac_example_dims,
                    _site=stacking.linen_site(self, kernel, bias, "kernel", "bias"))
    return restore(y)


class DenseGeneral(nn.DenseGeneral):
  """`flax.linen.DenseGeneral`, tagged with `kd.tags.dense_general` when it
  contracts the last input axes and has no `batch_dims`."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, inputs):
    custom = (self.dot_general is not None or self.dot_general_cls is not None
              or _flax_common.custom_promote(self, linen_dtypes.promote_dtype))
    in_dims = _flax_common.dense_general_config(self.axis, inputs.ndim,
                                                tuple(self.batch_dims), custom)
    if isinstance(in_dims, str):
      _flax_common.warn_untagged("DenseGeneral", in_dims)
      return super().__call__(inputs)
    features = ((self.features,) if isinstance(self.features, int)
                else tuple(self.features))
    kernel = self.param("kernel", _flax_common.flat_init(self.kernel_init, in_dims),
                        tuple(inputs.shape[inputs.ndim - in_dims:]) + features,
                        self.param_dtype)
    bias = (self.param("bias", _flax_common.flat_init(self.bias_init, 0), features,
                       self.param_dtype) if self.use_bias else None)
    return tags.dense_general(inputs, kernel, bias, in_dims=in_dims, dtype=self.dtype,
                              precision=self.precision,
                              example_dims=self.kfac_example_dims,
                              _site=stacking.linen_site(self, kernel, bias, "kernel",
                                                        "bias"))


class Embed(nn.Embed):
  """`flax.linen.Embed`, tagged with `kd.tags.embed` (`attend`, which reuses
  the table as an output projection, is Flax's own and untagged)."""

  def __call__(self, inputs):
    if _flax_common.custom_promote(self, linen_dtypes.promote_dtype):
      _flax_common.warn_untagged("Embed", "a custom promote_dtype")
      return super().__call__(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    if self.num_embeddings == 1:          # Flax broadcasts the single row
      inputs = jnp.zeros_like(inputs)
    return tags.embed(inputs, self.embedding, dtype=self.dtype,
                      _site=stacking.linen_site(self, self.embedding, None, "embedding",
                                                None))


def _scale_and_shift(module, x, x_hat, example_dims):
  """The learnable part of a linen LayerNorm / BatchNorm, tagged: creates
  `scale` (and `bias`) like Flax and casts the result to Flax's dtype."""
  features = (x.shape[-1],)
  scale = module.param("scale", module.scale_init, features, module.param_dtype)
  bias = (module.param("bias", module.bias_init, features, module.param_dtype)
          if module.use_bias else None)
  y = tags.scale_and_shift(x_hat, scale, bias, example_dims=example_dims,
                           _site=stacking.linen_site(module, scale, bias, "scale", "bias"))
  return jnp.asarray(y, linen_dtypes.canonicalize_dtype(x, scale, bias, dtype=module.dtype))


def _norm_reason(module, ndim, feature_axes) -> str | None:
  if not module.use_scale:
    return "use_scale=False" if module.use_bias else None
  return _flax_common.norm_config(ndim, feature_axes,
                                  custom=not getattr(module, "force_float32_reductions", True))


class LayerNorm(nn.LayerNorm):
  """`flax.linen.LayerNorm` whose scale and bias are tagged with
  `kd.tags.scale_and_shift` (SP-NGD's unit-wise Fisher; tokens are examples
  unless `kfac_example_dims` says otherwise)."""

  kfac_example_dims: int | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    reason = _norm_reason(self, jnp.ndim(x), self.feature_axes)
    if reason is not None or not self.use_scale:
      if reason is not None:
        _flax_common.warn_untagged("LayerNorm", reason)
      return super().__call__(x, mask=mask)
    mean, var = _flax_common.moments(x, self.reduction_axes, self.dtype, self.axis_name,
                                     self.axis_index_groups, self.use_fast_variance, mask)
    x_hat = _flax_common.normalized(x, mean, var, self.reduction_axes, self.epsilon)
    return _scale_and_shift(self, x, x_hat, self.kfac_example_dims)


class BatchNorm(nn.BatchNorm):
  """`flax.linen.BatchNorm` (same `batch_stats`) whose scale and bias are tagged
  with `kd.tags.scale_and_shift`: SP-NGD's unit-wise Fisher, one example per
  entry of the leading batch axis (`kfac_example_dims=1`)."""

  kfac_example_dims: int | None = 1

  @nn.compact
  def __call__(self, x, use_running_average=None, *, mask=None):
    reason = _norm_reason(self, jnp.ndim(x), self.axis)
    if reason is not None or not self.use_scale:
      if reason is not None:
        _flax_common.warn_untagged("BatchNorm", reason)
      return super().__call__(x, use_running_average, mask=mask)
    use_running_average = nn.merge_param("use_running_average",
                                         self.use_running_average, use_running_average)
    features = (x.shape[-1],)
    reduction_axes = tuple(range(x.ndim - 1))
    ra_mean = self.variable("batch_stats", "mean",
                            lambda s: jnp.zeros(s, jnp.float32), features)
    ra_var = self.variable("batch_stats", "var",
                           lambda s: jnp.ones(s, jnp.float32), features)
    if use_running_average:
      mean, var = ra_mean.value, ra_var.value
    else:
      initializing = self.is_initializing()
      mean, var = _flax_common.moments(
          x, reduction_axes, self.dtype, None if initializing else self.axis_name,
          self.axis_index_groups, self.use_fast_variance, mask)
      if not initializing:
        ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
        ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
    x_hat = _flax_common.normalized(x, mean, var, reduction_axes, self.epsilon)
    return _scale_and_shift(self, x, x_hat, self.kfac_example_dims)
