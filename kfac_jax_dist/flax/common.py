"""What the linen and NNX wrappers share: which Flax configurations K-FAC
supports, the warning for those it passes through, and the normalisation
arithmetic of LayerNorm / RMSNorm / BatchNorm / GroupNorm / InstanceNorm up to
their scale and shift."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from flax.linen.linear import canonicalize_padding
from jax import lax

from kfac_jax_dist.capture import context as _context
from kfac_jax_dist.capture import einsum as _einsum


def _pair(x, n: int) -> tuple[int, ...]:
  x = 1 if x is None else x
  return (x,) * n if isinstance(x, int) else tuple(x)


class ConvConfig(NamedTuple):
  """How a Flax convolution runs as `kd.tags.conv1d` / `conv2d` / `conv3d`:
  the tag's geometry, and `edge`: None, or `(mode, pads)` for `jnp.pad` of the
  input first (Flax's CIRCULAR and REFLECT padding, then VALID)."""

  spatial: int
  strides: tuple[int, ...]
  padding: Any
  dilation: tuple[int, ...]
  input_dilation: tuple[int, ...]
  edge: tuple[str, tuple] | None = None
  groups: int = 1                 # feature_group_count
  transpose_kernel: bool = False  # ConvTranspose's: the kernel `(*window, out, in)`


def padded_edges(inputs, edge: tuple[str, tuple] | None):
  """`inputs` (`[B, *spatial, C]`) padded as `ConvConfig.edge` says."""
  if edge is None:
    return inputs
  mode, pads = edge
  return jnp.pad(inputs, ((0, 0),) + pads + ((0, 0),), mode=mode)


def conv_config(kernel_size, strides, padding, input_dilation, kernel_dilation,
                feature_group_count, mask, extra_reason: str | None = None):
  """The `ConvConfig` of a Flax `Conv`, or a reason string. `CAUSAL` padding
  (1-D) becomes Flax's explicit `(dilation·(k − 1), 0)`; `CIRCULAR` and
  `REFLECT` pad the input as Flax does (`edge`), then VALID. Flax reads those
  three names as written (in another case they reach lax, which refuses
  them), and lax reads "same" / "valid" in any case, as SAME / VALID."""
  kernel_size = _pair(kernel_size, 1)
  spatial = len(kernel_size)
  if spatial not in (1, 2, 3):
    return f"{spatial}-D convolution (1-D, 2-D and 3-D are tagged)"
  if mask is not None:
    return "masked kernel"
  if extra_reason:
    return extra_reason
  dilation = _pair(kernel_dilation, spatial)
  if spatial == 1 and isinstance(padding, str) and padding == "CAUSAL":
    padding = (((kernel_size[0] - 1) * dilation[0], 0),)
  padding, edge = canonicalize_padding(padding, spatial), None
  if padding in ("CIRCULAR", "REFLECT"):
    window = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation)]
    edge = ({"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding],
            tuple(((w - 1) // 2, w // 2) for w in window))
    padding = "VALID"
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      return f"{padding} padding"
    padding = padding.upper()
  return ConvConfig(spatial, _pair(strides, spatial), padding, dilation,
                    _pair(input_dilation, spatial), edge, int(feature_group_count))


def _transpose_pads(window: int, stride: int, padding: str) -> tuple[int, int]:
  """`lax.conv_transpose`'s padding of one axis for SAME / VALID (`window`:
  the dilated kernel's extent), the same on every supported jax."""
  if padding == "SAME":
    total = window + stride - 2
    before = window - 1 if stride > window - 1 else -(-total // 2)
  else:
    total = window + stride - 2 + max(window - stride, 0)
    before = window - 1
  return before, total - before


def _circular_transpose_pads(window: int, stride: int, size: int, flipped: bool
                             ) -> tuple[tuple[int, int], tuple[int, int]]:
  """Flax's CIRCULAR `ConvTranspose` of one axis (`size` input entries) as a
  VALID convolution: `(wrap, zeros)`, the input's entries wrapped around
  before it is dilated by the stride, and the zeros padded after.

  Flax pads lax's VALID output `y` (`L` entries) by `(lo, hi)` to whole
  periods of `P = size·stride` and sums the periods. Entry `i` is then
  `Σ_t k_t z_{i + t − c}`, `z` the dilated input repeated with period `P`
  (zeros between the entries, `s − 1` after the last) and
  `c = (lo + window − 1) mod P`: the window `[−c, P − c + window − 2]` of `z`.
  Wrapping `⌊c/s⌋` entries before and enough after, the zeros left over on
  either side (fewer than `s`) are dilation zeros of `z`: exact."""
  low, high = _transpose_pads(window, stride, "VALID")
  period = size * stride
  extra = -((size - 1) * stride + 1 + low + high - window + 1 - period) % (2 * period)
  lo = extra // 2 if flipped else (extra + 1) // 2
  c = (lo + low) % period
  last = period - c + window - 2           # the window's last index of z
  wrap = (c // stride, last // stride - size + 1)   # both >= 0 (c <= window + s - 2)
  return wrap, (c % stride, last - (size + wrap[1] - 1) * stride)


def conv_transpose_config(module, default_promote, input_shape: tuple[int, ...]):
  """A linen or NNX `ConvTranspose` (`lax.conv_transpose`) as the convolution
  it computes: a `ConvConfig` with unit strides, the input dilated by the
  strides and lax's padding (with `transpose_kernel=True`, the kernel flipped
  and swapped: `kd.tags.conv2d`'s `transpose_kernel`); CIRCULAR padding wraps
  the input first (`_circular_transpose_pads`); or a reason string
  (`default_promote`: the API's own `promote_dtype`; `input_shape`: the
  input's, `[..., *spatial, C]`)."""
  kernel_size = _pair(module.kernel_size, 1)
  spatial = len(kernel_size)
  if spatial not in (1, 2, 3):
    return f"{spatial}-D transposed convolution (1-D, 2-D and 3-D are tagged)"
  if module.mask is not None:
    return "masked kernel"
  if (getattr(module, "preferred_element_type", None) is not None
      or custom_promote(module, default_promote)):
    return "a custom promote_dtype or preferred_element_type"
  padding = canonicalize_padding(module.padding, spatial)
  if isinstance(padding, str) and padding not in ("SAME", "VALID", "CIRCULAR"):
    return f"{padding} padding"
  if not isinstance(padding, str) and not _explicit_transpose_pads_as_given():
    return "explicit padding (this jax's use_consistent_padding default)"
  strides, dilation = _pair(module.strides, spatial), _pair(module.kernel_dilation, spatial)
  windows = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation)]
  edge = None
  if padding == "CIRCULAR":
    wraps, pads = zip(*(_circular_transpose_pads(w, s, n, bool(module.transpose_kernel))
                        for w, s, n in zip(windows, strides, input_shape[-spatial - 1:-1])))
    edge = ("wrap", wraps)
  elif isinstance(padding, str):
    pads = tuple(_transpose_pads(w, s, padding) for w, s in zip(windows, strides))
  else:
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
  return ConvConfig(spatial, (1,) * spatial, tuple(pads), dilation, strides, edge,
                    transpose_kernel=bool(module.transpose_kernel))


def _explicit_transpose_pads_as_given() -> bool:
  """Whether `lax.conv_transpose`, as Flax calls it, pads the dilated input
  by explicit `(low, high)` pairs as given: every jax up to now (before
  `use_consistent_padding`, and with its default False since). With that
  default True, they would be the pads of the forward convolution it
  transposes (jax-ml/jax#32267); such a jax leaves the layer untagged."""
  flag = inspect.signature(lax.conv_transpose).parameters.get("use_consistent_padding")
  return flag is None or flag.default is False


def untagged(layer: str, reason: str, where: str, fallback: Callable[[], Any]) -> Any:
  """A layer K-FAC cannot capture: warns, records it for `discover` as
  uncaptured (`where`: its module path) and runs Flax's own code (`fallback`)."""
  warnings.warn(f"kfac_jax_dist: {layer} with {reason} is not tagged (at '{where}'); its "
                "parameters pass through K-FAC unpreconditioned.", stacklevel=3)
  _context.record_uncaptured(where, layer, reason)
  return fallback()


def kernel_window(kernel_size) -> tuple[int, ...]:
  """Flax's `kernel_size` as a tuple (an int is one spatial axis, as in Flax)."""
  return (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)


def flatten_batch(inputs, spatial: int):
  """Flattens all batch axes into one (as Flax's Conv does); returns the undo."""
  batch_dims = inputs.ndim - (spatial + 1)
  if batch_dims == 1:
    return inputs, lambda y: y
  batch_shape = inputs.shape[:batch_dims]
  flat = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
  return flat, lambda y: jnp.reshape(y, batch_shape + y.shape[1:])


def _canonical_axes(ndim: int, axes) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted({a + ndim if a < 0 else a for a in axes}))


def dense_general_config(axis, ndim: int, batch_dims, custom: bool) -> int | str:
  """`in_dims` for `kd.tags.dense_general`, or the reason to leave it to Flax.

  Tagged: no batch (per-slice kernel) axes (`batch_dims`: an int or a
  sequence, as Flax takes them), and the contracted axes are the last ones of
  the input (Flax sorts them, so their order does not matter).
  """
  if custom:
    return "a custom dot_general, promote_dtype or output sharding"
  if _canonical_axes(ndim, batch_dims):
    return "batch_dims"
  axes = _canonical_axes(ndim, axis)
  if axes != tuple(range(ndim - len(axes), ndim)):
    return f"contraction over axes {axes} that are not the last ones"
  return len(axes)


def einsum_dense_config(equation, x_ndim: int, kernel_ndim: int, custom: bool
                        ) -> _einsum.EinsumLayout | str:
  """`capture.einsum.dense_layout` of a Flax `Einsum`'s equation, or the reason
  to leave it to Flax ("" for an equation jnp.einsum refuses: Flax's code
  raises); `custom`: its einsum, promote_dtype or preferred_element_type is
  not jnp's own."""
  if custom:
    return "a custom einsum, promote_dtype or preferred_element_type"
  return _einsum.dense_layout(equation, x_ndim, kernel_ndim)


def norm_config(ndim: int, feature_axes, custom: bool) -> str | None:
  """The reason a LayerNorm / BatchNorm is left to Flax, or `None`."""
  if custom:
    return "a custom promote_dtype or float32 reductions turned off"
  if _canonical_axes(ndim, feature_axes) != (ndim - 1,):
    return "feature axes other than the last"
  return None


def moments(x, axes, dtype=None, axis_name=None, axis_index_groups=None,
            fast_variance: bool = True, mask=None, use_mean: bool = True):
  """Mean and variance of `x` over `axes`, as Flax's normalisation layers define
  them: in at least float32, `E[x²] − E[x]²` clipped at 0 with
  `fast_variance` (else `E[(x − E x)²]`), masked means with `mask`, and with
  `axis_name` the means averaged over that mesh axis (one `pmean`). Without
  `use_mean` (RMSNorm) the mean is 0 and the "variance" `E[x²]`."""
  dtype = jnp.promote_types(jnp.result_type(x) if dtype is None else dtype, jnp.float32)
  x = jnp.asarray(x, dtype)
  axes = _canonical_axes(x.ndim, axes)
  where = None if mask is None else jnp.asarray(mask, bool)

  def mean(*values: jax.Array) -> list[jax.Array]:
    means = [jnp.mean(v, axis=axes, where=where) for v in values]
    if axis_name is not None:
      means = list(lax.pmean(jnp.stack(means), axis_name,
                             axis_index_groups=axis_index_groups))
    return means

  if not use_mean:
    (mu2,) = mean(x * x)
    return jnp.zeros_like(mu2), mu2
  if fast_variance:
    mu, mu2 = mean(x, x * x)
    return mu, jnp.maximum(mu2 - mu * mu, 0.0)
  (mu,) = mean(x)
  (var,) = mean(jnp.square(x - jnp.expand_dims(mu, axes)))
  return mu, var


def group_count(channels: int, num_groups, group_size) -> int | None:
  """GroupNorm's number of channel groups from Flax's `num_groups` xor
  `group_size`, or None where Flax refuses the configuration (its own code
  then raises its error)."""
  if (num_groups is None) == (group_size is None):
    return None
  if group_size is not None:
    ok = isinstance(group_size, int) and group_size > 0 and channels % group_size == 0
    return channels // group_size if ok else None
  ok = isinstance(num_groups, int) and num_groups > 0 and channels % num_groups == 0
  return num_groups if ok else None


def group_reduction_axes(ndim: int, reduction_axes) -> tuple[int, ...] | None:
  """GroupNorm's reduction axes, sorted and non-negative (Flax's default: every
  axis but the leading batch one), or None where they leave out the last,
  channel, axis (Flax raises)."""
  axes = (tuple(range(1, ndim)) if reduction_axes is None
          else _canonical_axes(ndim, reduction_axes))
  return axes if ndim - 1 in axes else None


def group_moments(x, num_groups: int, axes: tuple[int, ...], dtype=None, axis_name=None,
                  axis_index_groups=None, fast_variance: bool = True, mask=None):
  """GroupNorm's mean and variance (Wu & He 2018): `moments` of each group of
  `C / num_groups` consecutive channels over `axes` (`group_reduction_axes`),
  repeated over the group's channels: shaped like `x` without the reduced
  axes but the last."""
  size = x.shape[-1] // num_groups
  grouped = jnp.reshape(x, x.shape[:-1] + (num_groups, size))
  if mask is not None:
    mask = jnp.reshape(mask, jnp.shape(mask)[:-1] + (num_groups, size))
  mean, var = moments(grouped, axes[:-1] + (grouped.ndim - 1,), dtype, axis_name,
                      axis_index_groups, fast_variance, mask)
  return jnp.repeat(mean, size, axis=-1), jnp.repeat(var, size, axis=-1)


def group_normalized(module, x, num_groups: int, axes: tuple[int, ...], mask):
  """A linen or NNX GroupNorm's `x̂` (`group_moments` over `axes`)."""
  mean, var = group_moments(x, num_groups, axes, module.dtype, module.axis_name,
                            module.axis_index_groups, module.use_fast_variance, mask)
  return normalized(x, mean, var, axes[:-1], module.epsilon)


def instance_normalized(module, x, mask):
  """A linen or NNX InstanceNorm's `x̂` (channels last): normalised per example
  and channel over the axes between; None for a 1-D input (Flax's code raises
  its error)."""
  if jnp.ndim(x) < 2:
    return None
  axes = tuple(range(1, jnp.ndim(x) - 1))
  mean, var = moments(x, axes, module.dtype, module.axis_name, module.axis_index_groups,
                      module.use_fast_variance, mask)
  return normalized(x, mean, var, axes, module.epsilon)


def normalized(x, mean, var, reduction_axes, epsilon: float):
  """`x̂ = (x − mean) / sqrt(var + ε)`, the statistics broadcast back over the
  reduced axes; in the statistics' dtype (at least float32)."""
  axes = _canonical_axes(x.ndim, reduction_axes)
  mean, var = jnp.expand_dims(mean, axes), jnp.expand_dims(var, axes)
  return (x - mean) * lax.rsqrt(var + epsilon)


def flat_init(init, split: int):
  """Flax's DenseGeneral initialisation: `init` sees the 2-D (or, for a bias,
  1-D) flattened shape, so fan-in/fan-out are those of the flattened Dense
  layer; the result is reshaped to the parameter's shape."""

  def wrapped(rng: jax.Array, shape: tuple, dtype: Any = jnp.float32) -> jax.Array:
    size = lambda dims: int(np.prod(dims, dtype=np.int64))
    flat = ((size(shape[:split]), size(shape[split:])) if split else (size(shape),))
    value = init(rng, flat, dtype)
    if isinstance(value, meta.AxisMetadata):
      return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)

  return wrapped


def call_flag(name: str, call_value, attribute):
  """The call argument if given, else the attribute (Flax's precedence)."""
  value = attribute if call_value is None else call_value
  if value is None:
    raise ValueError(f"BatchNorm: no `{name}` given, neither to the constructor nor "
                     "to the call.")
  return value


def custom_promote(module, default) -> bool:
  """Whether `module` sets its own `promote_dtype` (flax < 0.12.x has none)."""
  return getattr(module, "promote_dtype", default) is not default
