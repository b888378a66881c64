"""Drop-in Flax NNX layers whose curvature K-FAC captures.

Same constructor arguments, attribute names and shapes as `flax.nnx.Linear` and
`flax.nnx.Conv`. Unsupported configurations (grouped convolutions, masks, ...)
run NNX's own code, untagged, with a warning.
"""

from __future__ import annotations

from flax import nnx
from jax import lax

from kfac_jax_dist import _flax_common
from kfac_jax_dist import tags


def _raw(variable):
  """The array a Variable holds, not a copy (tags match it by identity)."""
  if variable is None:
    return None
  get = getattr(variable, "get_value", None)
  return get() if get is not None else variable.value


class Linear(nnx.Linear):
  """`flax.nnx.Linear`, tagged with `kd.tags.dense`."""

  def __call__(self, inputs, out_sharding=None):
    if (self.dot_general is not lax.dot_general or out_sharding is not None
        or self.preferred_element_type is not None):
      _flax_common.warn_untagged("Linear", "a custom dot_general or output sharding")
      return super().__call__(inputs, out_sharding)
    return tags.dense(inputs, _raw(self.kernel), _raw(self.bias), dtype=self.dtype,
                      precision=self.precision)


class Conv(nnx.Conv):
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
    y = tags.conv2d(inputs, _raw(self.kernel), _raw(self.bias), strides=strides,
                    padding=padding, dilation=dilation, dtype=self.dtype,
                    precision=self.precision)
    return restore(y)
