"""What the linen and NNX wrappers share: which Flax conv configurations K-FAC
supports, and the warning for those it passes through."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding


def _pair(x, n: int) -> tuple[int, ...]:
  x = 1 if x is None else x
  return (x,) * n if isinstance(x, int) else tuple(x)


def conv_config(kernel_size, strides, padding, input_dilation, kernel_dilation,
                feature_group_count, mask, extra_reason: str | None = None):
  """`(strides, padding, dilation)` for `kd.tags.conv2d`, or a reason string."""
  kernel_size = _pair(kernel_size, 1)
  if len(kernel_size) != 2:
    return f"{len(kernel_size)}-D convolution (only 2-D is tagged)"
  if feature_group_count != 1:
    return f"grouped/depthwise convolution (feature_group_count={feature_group_count})"
  if mask is not None:
    return "masked kernel"
  if _pair(input_dilation, 2) != (1, 1):
    return "input dilation"
  if extra_reason:
    return extra_reason
  padding = canonicalize_padding(padding, 2)
  if isinstance(padding, str) and padding not in ("SAME", "VALID"):
    return f"{padding} padding"
  return _pair(strides, 2), padding, _pair(kernel_dilation, 2)


def warn_untagged(layer: str, reason: str) -> None:
  warnings.warn(f"kfac_jax_dist: {layer} with {reason} is not tagged; its parameters "
                "pass through K-FAC unpreconditioned.", stacklevel=3)


def flatten_batch(inputs, spatial: int = 2):
  """Flattens all batch axes into one (as Flax's Conv does); returns the undo."""
  batch_dims = inputs.ndim - (spatial + 1)
  if batch_dims == 1:
    return inputs, lambda y: y
  batch_shape = inputs.shape[:batch_dims]
  flat = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
  return flat, lambda y: jnp.reshape(y, batch_shape + y.shape[1:])
