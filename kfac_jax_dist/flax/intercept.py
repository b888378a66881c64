"""Capture of unmodified Flax models: `kd.value_and_grad(loss_fn, capture="flax")`.

Linen:
The loss function runs under `flax.linen.intercept_methods`: when Flax is
about to run the `__call__` of one of its own `Dense`, `DenseGeneral`
(including the projections inside `MultiHeadDotProductAttention` /
`SelfAttention`), `Einsum`, `Conv`, `ConvTranspose`, `Embed`, `LayerNorm`,
`RMSNorm`, `BatchNorm`, `GroupNorm` or `InstanceNorm` (or of a subclass that
does not replace it), the interceptor runs the same module through the tagged
computation of `kd.linen` instead (`kfac_jax_dist.flax.linen`): the same
parameters, names, statistics and conventions as the `kd.linen` layer,
`kfac_example_dims` at its class default.
Flax's `OptimizedLSTMCell` (its gates' kernels joined into one product) runs
as `LSTMCell`, whose parameters it keeps: its gates are Dense layers.
Interception is Flax's public, stable hook, so nothing depends on the
jaxpr's shape (kfac-jax's pattern matching does, and breaks across JAX
releases).

A configuration the tagged computation does not support (a masked
kernel, a custom `dot_general`, an unshared convolution (`ConvLocal`, which
runs `Conv`'s `__call__`), an `Einsum` equation that is not a Dense layer's,
...) runs Flax's own code and is reported as uncaptured
(`discover`'s `LayerRegistry.uncaptured`, `kd.describe`): its parameters pass
through K-FAC unpreconditioned, never silently mis-captured. `kd.linen` layers
inside an intercepted model tag themselves as before.

NNX has no method interception: while the loss runs, the `__call__` of
`nnx.Linear`, `LinearGeneral` (with `MultiHeadAttention`'s projections),
`Einsum`, `Conv`, `ConvTranspose`, `Embed`, `LayerNorm`, `RMSNorm`,
`BatchNorm`, `GroupNorm` and `InstanceNorm` is replaced on those classes by
the tagged computation of `kd.nnx` (`kfac_jax_dist.flax.nnx`); the classes are
restored when the loss returns. The
user's classes are untouched (a subclass that does not replace `__call__` is
captured through its base). While a capture runs in one thread, another
thread tracing NNX layers would run the tagged computations too (outside a
capture they are the ordinary layers: the same values, to rounding).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import flax.linen as nn
from flax import nnx

from kfac_jax_dist.capture import value_and_grad as value_and_grad_lib
from kfac_jax_dist.flax import linen
from kfac_jax_dist.flax import nnx as nnx_layers

Handler = Callable[..., Any]          # (module, fallback, *args, **kwargs) -> output


def _raw(cls: type) -> Callable:
  """The function Flax runs for `cls.__call__` (under its method wrapper)."""
  method = cls.__call__
  return getattr(method, "__wrapped__", method)


@functools.lru_cache(maxsize=None)
def _handlers() -> dict[Callable, Handler]:
  """Flax's own `__call__` bodies → the tagged computation of the same module."""
  plain = lambda tagged: (lambda module, fallback, inputs: tagged(module, inputs, fallback))
  norm = lambda tagged: (lambda module, fallback, x, *, mask=None:
                         tagged(module, x, mask, fallback))

  def batch_norm(module: nn.BatchNorm, fallback: Callable[[], Any], x: Any,
                 use_running_average: bool | None = None, *, mask: Any = None) -> Any:
    return linen.batch_norm(module, x, use_running_average, mask, fallback)

  def optimized_lstm(module: nn.OptimizedLSTMCell, fallback: Callable[[], Any],
                     carry: Any, inputs: Any) -> Any:
    """`OptimizedLSTMCell` keeps `LSTMCell`'s parameters (names, shapes and
    fields, for compatibility, says Flax) and multiplies each input by its
    gates' kernels joined: it runs as `LSTMCell`, whose gates' Dense layers
    are captured (the same products, one per gate)."""
    del fallback
    return _raw(nn.LSTMCell)(module, carry, inputs)
  return {_raw(nn.Dense): plain(linen.dense), _raw(nn.Conv): plain(linen.conv),
          _raw(nn.OptimizedLSTMCell): optimized_lstm,
          _raw(nn.ConvTranspose): plain(linen.conv_transpose),
          _raw(nn.DenseGeneral): plain(linen.dense_general),
          _raw(nn.Einsum): lambda module, fallback, inputs, einsum_str=None: (
              linen.einsum(module, inputs, einsum_str, fallback)),
          _raw(nn.Embed): plain(linen.embed), _raw(nn.LayerNorm): norm(linen.layer_norm),
          _raw(nn.RMSNorm): norm(linen.rms_norm), _raw(nn.BatchNorm): batch_norm,
          _raw(nn.GroupNorm): norm(linen.group_norm),
          _raw(nn.InstanceNorm): norm(linen.instance_norm)}


def interceptor(next_fun: Callable, args: tuple, kwargs: dict,
                context: nn.module.InterceptorContext) -> Any:
  """Runs a supported Flax layer's `__call__` as its tagged computation (see
  the module docstring); every other method call is left alone."""
  raw = getattr(context.orig_method, "func", None)
  module = context.module
  if context.method_name != "__call__" or raw is None or isinstance(module, linen.TAGGED):
    return next_fun(*args, **kwargs)
  handler = _handlers().get(raw)
  if handler is not None:
    return handler(module, functools.partial(next_fun, *args, **kwargs), *args, **kwargs)
  return next_fun(*args, **kwargs)


# ----------------------------------------------------------------------- NNX

@functools.lru_cache(maxsize=None)
def _nnx_handlers() -> dict[type, Handler]:
  """NNX classes → the tagged computation of the same module."""
  projection = lambda tagged: (lambda module, fallback, inputs, out_sharding=None:
                               tagged(module, inputs, out_sharding, fallback))
  norm = lambda tagged: (lambda module, fallback, x, mask=None:
                         tagged(module, x, mask, fallback))

  def batch_norm(module: nnx.BatchNorm, fallback: Callable[[], Any], x: Any,
                 use_running_average: bool | None = None, *, mask: Any = None) -> Any:
    return nnx_layers.batch_norm(module, x, use_running_average, mask, fallback)
  return {nnx.Linear: projection(nnx_layers.linear), nnx.Conv: projection(nnx_layers.conv),
          nnx.ConvTranspose: lambda module, fallback, inputs: nnx_layers.conv_transpose(
              module, inputs, fallback),
          nnx.LinearGeneral: projection(nnx_layers.linear_general),
          nnx.LoRA: lambda module, fallback, x, **kwargs: nnx_layers.lora(
              module, x, kwargs, fallback),
          nnx.Einsum: lambda module, fallback, inputs, einsum_str=None, out_sharding=None: (
              nnx_layers.einsum(module, inputs, einsum_str, out_sharding, fallback)),
          nnx.Embed: projection(nnx_layers.embed),
          nnx.LayerNorm: norm(nnx_layers.layer_norm), nnx.RMSNorm: norm(nnx_layers.rms_norm),
          nnx.BatchNorm: batch_norm, nnx.GroupNorm: norm(nnx_layers.group_norm),
          nnx.InstanceNorm: norm(nnx_layers.instance_norm)}


def _nnx_replacement(original: Callable, handler: Handler) -> Callable:
  """What an NNX class's `__call__` runs during a capture."""

  def call(module: Any, *args: Any, **kwargs: Any) -> Any:
    fallback = functools.partial(original, module, *args, **kwargs)
    if isinstance(module, nnx_layers.TAGGED):     # kd.nnx's own fallback
      return fallback()
    return handler(module, fallback, *args, **kwargs)
  return call


_NNX_LOCK = threading.Lock()
_nnx_depth = [0]


@functools.lru_cache(maxsize=None)
def _nnx_targets() -> tuple[tuple[type, Handler], ...]:
  """(class, handler) of every NNX class to patch; a class that inherits its
  `__call__` is covered by the class that defines it."""
  return tuple((cls, handler) for cls, handler in _nnx_handlers().items()
               if "__call__" in vars(cls))


@contextlib.contextmanager
def _nnx_patched() -> Iterator[None]:
  """The NNX classes' `__call__` replaced (nested captures share one patch)."""
  targets = _nnx_targets()
  with _NNX_LOCK:
    _nnx_depth[0] += 1
    if _nnx_depth[0] == 1:
      for cls, handler in targets:
        original = cls.__dict__["__call__"]
        replacement = _nnx_replacement(original, handler)
        replacement.kfac_original = original
        cls.__call__ = replacement
  try:
    yield
  finally:
    with _NNX_LOCK:
      _nnx_depth[0] -= 1
      if _nnx_depth[0] == 0:
        for cls, _ in targets:
          cls.__call__ = cls.__dict__["__call__"].kfac_original


def intercepted(fun: Callable) -> Callable:
  """`fun` with every supported Flax linen and NNX layer it runs captured."""

  @functools.wraps(fun)
  def run(*args: Any, **kwargs: Any) -> Any:
    with nn.intercept_methods(interceptor), _nnx_patched():
      return fun(*args, **kwargs)
  return run


value_and_grad_lib.register_capture("flax", intercepted)
