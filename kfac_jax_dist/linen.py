"""Drop-in Flax linen layers whose curvature K-FAC captures.

Same constructor arguments, parameter names and shapes as `flax.linen.Dense`
and `flax.linen.Conv`, so a plain Flax checkpoint loads into the tagged model.
Configurations with no Kronecker-factored form here (grouped convolutions,
masks, custom dot/conv functions, ...) run Flax's own code, untagged, with a
warning.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from kfac_jax_dist import _flax_common
from kfac_jax_dist import tags


class Dense(nn.Dense):
  """`flax.linen.Dense`, tagged with `kd.tags.dense`."""

  @nn.compact
  def __call__(self, inputs):
    if self.dot_general is not None or self.dot_general_cls is not None:
      _flax_common.warn_untagged("Dense", "a custom dot_general")
      return super().__call__(inputs)
    kernel = self.param("kernel", self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    return tags.dense(inputs, kernel, bias, dtype=self.dtype, precision=self.precision)


class Conv(nn.Conv):
  """`flax.linen.Conv` (2-D), tagged with `kd.tags.conv2d`."""

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
                    dilation=dilation, dtype=self.dtype, precision=self.precision)
    return restore(y)
