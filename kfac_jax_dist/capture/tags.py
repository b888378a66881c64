"""Tag functions: layers whose curvature K-FAC captures.

`dense`, `dense_general`, `einsum`, `conv2d`, `embed` and `scale_and_shift` compute the
layer exactly like their Flax counterparts. Outside `kd.value_and_grad` they
are plain functions. Inside it they

* while discovering, record the layer (`registry.TaggedLayer`): its name, kind
  and the parameter leaves it uses (matched by identity against the leaves of
  the parameter tree given to the loss, so pass the parameters themselves and
  let the tag cast them with `dtype=`);
* while capturing, run through a `custom_vjp` whose backward pass also returns
  the layer's statistics (`A` and `G`, or `F`; see `factors`) as the
  cotangents of zero "probe" inputs. Nothing per-example is materialised, and
  a traced flag skips the statistics (`lax.cond`) on steps that update no
  factor.

`row_mask(mask)` around the model leaves padded rows out of the statistics
of the tags run inside it (see its docstring).

The statistics are computed in `factors.statistics_dtype` of the layer's
input and output (`promote_types(dtype, float32)`: float32 for a bfloat16
layer, float64 for a float64 one): discovery records it per layer
(`Trace.stats_dtypes`), the capture makes the probes in it, and the tag casts
the input and the output cotangent to the probes' dtype before any product.

A layer's name defaults to its kernel's path in the parameter tree without the
last key (`"Dense_0"` for `{"Dense_0": {"kernel": ...}}`); the kernel of an
embedding is its table, of a scale-and-shift its scale.

Stacked layers (one layer per block of stacked weights `[L, ...]`, e.g. the
body of a `lax.scan` over layers): pass the stacked leaves themselves and the
block index, `dense(x, params["kernel"], params["bias"], stack_index=i)` with
`i` a Python int or a traced integer (the loop counter). The tag applies block
`i`, and its statistics come back stacked, `{"A": [L, a, a], "G": [L, g, g]}`,
one block per slot; the optimizer gives each block its own factors. A tuple
indexes several leading stack axes. `kd.linen` / `kd.nnx` layers inside
`nn.scan` / `nnx.scan` / `nnx.vmap` do this by themselves (see `stacking`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import re
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.typing import ArrayLike
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import context as _context
from kfac_jax_dist.capture import einsum as _einsum
from kfac_jax_dist.capture import registry, stacking
from kfac_jax_dist.capture import statistics as factors
from kfac_jax_dist.capture import triangles


def _promote(dtype, *arrays):
  if dtype is None:
    dtype = jnp.result_type(*[a for a in arrays if a is not None])
  return tuple(None if a is None else jnp.asarray(a, dtype) for a in arrays)


def _add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
  """`y + bias`, `bias` over the trailing axes of `y`."""
  return y if bias is None else y + factors.with_leading_units(bias, y.ndim)


_NOT_A_LEAF = (
    "Pass the parameter itself (cast it with the tag's dtype= argument). Inside a "
    "loop over stacked weights, pass the stacked leaf and stack_index=; a plain "
    "JAX tag cannot follow a slice made by a transform. Inside jax.checkpoint "
    "(jax.remat) of a function that takes the parameters as arguments, use "
    "kd.remat instead. A nested jax.jit that takes the parameters as arguments: "
    "close it over them, or drop it (the step's own jit compiles it). A kernel "
    "gathered inside shard_map (parameters sharded over the data axis, FSDP) is "
    "not supported there: shard them under jax.jit without shard_map "
    "(docs/distributed.md), or over a tensor-parallel model_axis. A kernel computed "
    "from the parameters (MAML's adapted weights p - a*grad, a weight average) is no "
    "parameter either: apply that pass untagged, or capture a Flax model with "
    "capture='flax', which follows the parameters into it (and warns: the factors "
    "of the kernel applied then precondition the parameter's gradient).")


def _not_a_leaf_hint(trace: _context.Trace) -> str:
  """How to pass the parameters themselves (`_NOT_A_LEAF`), or why they
  cannot be: the tag runs under a derivative the loss function takes itself,
  with respect to them."""
  derivative = _derivative_over(trace)
  if derivative is None:
    return _NOT_A_LEAF
  return (f"The tag runs under a derivative that the loss function takes itself "
          f"({derivative}): with respect to the parameters (a gradient penalty's "
          "jax.grad, a jax.custom_vjp taking them as arguments), a plain JAX tag sees "
          "new values there, not the parameters' leaves. Apply the model there without "
          "tags (an untagged copy), or capture a Flax model with capture='flax', which "
          "follows its parameters into such derivatives.")


def _layer_name(trace: _context.Trace, name: str | None, kernel,
                site: stacking.Site | None) -> str:
  if name is not None:
    return name
  path = site.kernel_path if site is not None else trace.path_of(kernel)
  if path is None:
    raise ValueError(
        "A tagged layer without a name uses a kernel that is not a leaf of the "
        "parameters given to kd.value_and_grad. " + _not_a_leaf_hint(trace))
  return stacking.owner_path(path) or path     # (box keys: not in paths)


def _discover(trace, kind, name, kernel, bias, site, **record) -> None:
  if site is None:
    kernel_path, bias_path, stack = trace.path_of(kernel), trace.path_of(bias), ()
  else:
    kernel_path, bias_path, stack = site.kernel_path, site.bias_path, site.stack
  if kernel_path is None:
    raise ValueError(
        f"Tagged layer '{name}': its kernel is not a leaf of the parameters given "
        "to kd.value_and_grad, so K-FAC cannot tell which gradient to precondition. "
        + _not_a_leaf_hint(trace))
  if bias is not None and bias_path is None:
    raise ValueError(
        f"Tagged layer '{name}': its bias is not a leaf of the parameters given to "
        "kd.value_and_grad.")
  kernel_shape, bias_shape = tuple(kernel.shape), None if bias is None else tuple(bias.shape)
  if record.get("kernel_axes"):             # the applied kernel's (see `registry`)
    kernel_shape = tuple(kernel_shape[i] for i in record["kernel_axes"])
  if record.get("transposed_kernel"):
    kernel_shape = registry.channels_swapped(kernel_shape)
  groups = record.get("groups", 1)
  if groups > 1:              # one group's blocks (see `registry`)
    stack = tuple(stack) + (groups,)
    kernel_shape = kernel_shape[:-1] + (kernel_shape[-1] // groups,)
    bias_shape = None if bias is None else (bias_shape[-1] // groups,)
  layer = registry.TaggedLayer(
      name=name, kind=kind, kernel_path=kernel_path, bias_path=bias_path,
      kernel_shape=kernel_shape, bias_shape=bias_shape, stack=stack,
      may_sit_out=_compat.may_not_run(trace.top),
      under_derivative=_derivative_over(trace), **record)
  if name in trace.seen or _compat.current_trace() is not trace.top:
    trace.repeats.add(name)
  if _compat.runs_in_branch(trace.top):
    trace.branched.add(name)
  elif not layer.may_sit_out:
    trace.unbranched.add(name)
  if name in trace.seen:
    _merge_application(trace, layer)
    return
  trace.seen.add(name)
  if site is not None and site.carrier is not None and stack:
    trace.carriers[name] = site.carrier
  trace.layers.append(layer)


def _merge_application(trace: _context.Trace, layer: registry.TaggedLayer) -> None:
  """Merges another application of the discovered `layer` into its record: another
  block of an unrolled stack, a transform's second trace of its body (flax traces
  nn.scan's twice), or weight sharing (a second application, a scan's iterations
  over one kernel). The capture counts every run's positions
  (`statistics.POSITIONS`): K-FAC-expand. It may sit out a pass (or be hidden by
  derivatives) only if every application may (is); where some are known to run
  in a branch and others outside any, its positions vary (flax's first trace of
  an nn.scan body, of no known purpose, is neither). Two different layers under
  one name raise, naming what differs."""
  name = layer.name
  at, previous = next((i, l) for i, l in enumerate(trace.layers) if l.name == name)
  if previous == dataclasses.replace(
      layer, may_sit_out=previous.may_sit_out, row_masked=previous.row_masked,
      partly_sits_out=previous.partly_sits_out,
      under_derivative=previous.under_derivative,
      also_under_derivative=previous.also_under_derivative):
    hidden = layer.under_derivative and previous.under_derivative
    trace.layers[at] = dataclasses.replace(
        previous, may_sit_out=previous.may_sit_out and layer.may_sit_out,
        partly_sits_out=name in trace.branched and name in trace.unbranched,
        row_masked=previous.row_masked or layer.row_masked, under_derivative=hidden,
        also_under_derivative=previous.also_under_derivative or (
            None if hidden else layer.under_derivative or previous.under_derivative))
    return
  differ = ", ".join(
      f"{field.name} {getattr(previous, field.name)!r} then {getattr(layer, field.name)!r}"
      for field in dataclasses.fields(layer)
      if getattr(previous, field.name) != getattr(layer, field.name))
  raise ValueError(
      f"Tagged layer '{name}' ran twice in one loss evaluation as different "
      f"layers ({previous.kind} with kernel '{previous.kernel_path}' "
      f"{previous.kernel_shape}, then {layer.kind} with kernel '{layer.kernel_path}' "
      f"{layer.kernel_shape}; they differ in {differ}): a shared layer must be applied "
      "the same way each time; give each application its own parameters and name.")


def _real_statistics_dtype(name: str, x, y) -> jnp.dtype:
  """The layer's `statistics_dtype`, refused for complex inputs or outputs:
  their curvature is Hermitian (`E[x xᴴ]`), the statistics here are real
  products (`xᵀx`) and would make indefinite factors."""
  dtype = factors.statistics_dtype(x, y)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(
        f"Tagged layer '{name}': complex input or output ({jnp.result_type(x)} -> "
        f"{jnp.result_type(y)}); complex layers are not supported (their curvature "
        "is Hermitian: every statistic here is a real one's). Feed it real inputs "
        "([re, im] as features) and keep complex numbers after the tagged layers.")
  return dtype


def _derivative_over(trace: _context.Trace) -> str | None:
  """The derivative the loss function takes itself over this application of
  a layer (`_compat.derivative_since`), None for none. Under forward mode the
  capture runs the layer untagged (`_tagged`): JAX cannot differentiate the
  tags' custom VJPs in forward mode, nor in reverse mode after it."""
  return None if trace.top is None else _compat.derivative_since(trace.top)


def _captured(apply: Callable, stats: Callable, x, params: tuple, probes, flag,
              stats_input: Callable | None = None, mask: jax.Array | None = None,
              reached: Callable[[], None] = lambda: None):
  """`apply(x, *params)` whose backward pass also returns `stats(x̃, ḡ,
  probes, mask)`, a pytree like `probes` (`x` may be integer: embedding ids), with
  `x̃ = stats_input(x)` (default `x`) taken outside the conditional; `mask`
  the layer's row mask (`row_mask`), a boolean array or None; `reached()` is
  called when JAX traces the backward pass (where the loss uses the output)
  of a non-empty output.
  `flag` says whether to compute them: a traced bool (a `lax.cond` here) or a
  Python one (`skip_statistics="pass"`: the caller branched around the pass).

  A Dense layer's `stats_input` merges the positions into rows, the shape its
  product reads: the conditional's operand is then that buffer, where with the
  input's own shape XLA builds the input a second time (a LayerNorm's output,
  say), held from the forward pass to the backward one (4 MB of the step_time
  LM's 92 MB peak)."""
  static_flag = flag if isinstance(flag, bool) else None
  if static_flag is not None:
    flag = None

  @jax.custom_vjp
  def layer(x: jax.Array, params: tuple, probes: Any, flag: Any, mask: Any) -> jax.Array:
    del probes, flag, mask
    return apply(x, *params)

  def fwd(x: jax.Array, params: tuple, probes: Any, flag: Any, mask: Any) -> tuple:
    return apply(x, *params), (x, params, probes, flag, mask)

  def bwd(residuals: tuple, cotangent: jax.Array) -> tuple:
    x, params, probes, flag, mask = residuals
    # An empty output (no rows: `[B, 0, d]`, a VALID window larger than the
    # input) has no statistics: the layer counts as not reached (its factors
    # are kept), not as a batch of none (`A = 0/0`).
    empty = math.prod(jnp.shape(cotangent)) == 0
    if not empty:
      reached()
    x_stats = x if stats_input is None else stats_input(x)
    if jnp.issubdtype(x.dtype, jnp.integer):     # ids: no cotangent (float0)
      _, vjp = jax.vjp(lambda *p: apply(x, *p), *params)
      x_bar, params_bar = None, vjp(cotangent)
    else:
      _, vjp = jax.vjp(apply, x, *params)   # the primal is dead code under jit
      x_bar, *params_bar = vjp(cotangent)
    # A statistic may not depend on everything that varies (an embedding's A
    # on replicated ids, a layer replicated over a tensor-parallel axis): both
    # branches are typed varying like (x, cotangent) and the probes.
    # A step that computes no statistics returns NaN placeholders: consumed by
    # mistake on a factor step (statistics taken with another step's
    # opt_state), they make the step faulty instead of averaging in zeros.
    # Built inside the branch that returns them: eagerly (outside jit), with
    # `jax_debug_nans` on, a NaN made on every step would trip it.
    axes = _compat.varying_axes(x, cotangent, probes)

    def placeholders() -> Any:
      return _compat.as_varying(jax.tree_util.tree_map(
          lambda p: jnp.full_like(p, jnp.nan), probes), axes)

    def computed() -> Any:
      # In the probes' dtype (the statistics', see the module docstring).
      values = jax.tree_util.tree_map(lambda s, p: s.astype(p.dtype),
                                      stats(x_stats, cotangent, probes, mask), probes)
      return _compat.as_varying(values, axes)
    if empty:
      probe_bar = _compat.as_varying(jax.tree_util.tree_map(jnp.zeros_like, probes), axes)
    elif static_flag is not None:             # the caller branched around the pass
      probe_bar = computed() if static_flag else placeholders()
    else:
      probe_bar = _compat.cond(flag, computed, placeholders)
    return x_bar, tuple(params_bar), probe_bar, None, None

  layer.defvjp(fwd, bwd)
  return layer(x, params, probes, flag, mask)


def _scaled_inside(trace: _context.Trace, name: str, out: dict) -> dict:
  """`out` with the statistics built from output cotangents times the
  capture's scale when it is a Python number (`Trace.statistics_scale`):
  inside the conditional that computes them, where the product fuses into
  their packing, instead of one more kernel each after it (PERF_NOTES §17).
  The layer is marked so that `value_and_grad` does not scale it again."""
  scale = trace.statistics_scale
  if scale is None:
    return out
  trace.scaled.add(name)
  return {key: (value * scale).astype(value.dtype)
          if key in factors.SCALED_BY_NUM_EXAMPLES else value
          for key, value in out.items()}


def _forms(probes: dict, record: dict) -> dict[str, str]:
  """Each probe's form: a matrix is FULL, a vector DIAG, or PACKED where it
  holds the upper triangle of the statistic's dimension (`a_dim`, `g_dim`)."""
  dims = {"A": record.get("a_dim"), "G": record.get("g_dim")}

  def form(key: str, probe: jax.Array) -> str:
    if probe.ndim != 1:
      return factors.FULL
    d = dims.get(key)
    packed = d is not None and d > 1 and probe.shape == factors.statistic_shape(
        d, factors.PACKED)
    return factors.PACKED if packed else factors.DIAG
  return {key: form(key, probe) for key, probe in probes.items()}


def _layer_probes(trace, name: str, site) -> dict | None:
  """The capture's probes of layer `name` (one block's where `site` says so);
  None: the optimizer skips it."""
  if site is not None and site.probes is not None:
    return site.probes            # this block's, sliced by flax / NNX
  if name in trace.carriers:
    raise ValueError(
        f"Stacked layer '{name}' ran without its probes: the loss function must "
        "pass the parameter tree it receives to the model unchanged (the capture "
        f"adds '{stacking.PROBE_KEY}' entries to linen parameter dicts and wraps "
        "NNX kernels).")
  probes = trace.probes.get(name)
  if probes is not None and site is not None and site.index is not None:
    probes = jax.tree_util.tree_map(lambda p: p[site.index], probes)
  return probes


def _tagged(kind: str, name, apply, stats, x, kernel, bias, site=None, examples=None,
            stats_input=None, positions=None, out_dims: int = 1, example_dims=None,
            **record):
  """Runs `apply(x, kernel[, bias])`, recording or capturing the layer.

  `stats(x, ḡ, forms, mask)` returns the statistics as a dict keyed like the probes
  that the capture made for this layer (`{"A", "G"}` or `{"F"}`), where
  `forms[key]` says whether the probe is a full matrix or a diagonal (a
  PACKED probe's statistic is computed full and packed here, inside the
  capture's conditional).
  `record` holds the `TaggedLayer` fields that only the tag knows (a_dim,
  g_dim, a_diagonal). `stats_input(x)` is the input as `stats` and
  `examples` read it (default `x`; see `_captured`). `examples(x, ḡ)` (Dense
  and Conv layers) returns the positions `[..., d_A − bias]`, `[..., d_G]`
  and their `example_dims`, from which EK-FAC's `S` is computed when the
  probes bring eigenbases. `positions(x, ḡ)` is the number of rows of `A`
  (its mean's denominator; a unit-wise layer's positions), counted for a
  repeated layer or one that may sit out a pass (`statistics.POSITIONS`).
  `kernel` and `bias` are one block's; `site` (see `stacking`) says where
  they live when they are not leaves of the parameters.
  Under a row mask (`row_mask`, matched to the output's leading axes but its
  last `out_dims`), `stats` gets it as `mask` for `A`'s rows, `ḡ` comes with
  the left-out rows zeroed, and the layer counts the kept rows as its
  positions (`TaggedLayer.row_masked`; a unit-wise layer's count says only
  whether it saw any); `example_dims` is a layer with `A`'s.
  """
  trace = _context.tagging()
  params = (kernel,) if bias is None else (kernel, bias)
  if trace is None or kernel.size == 0 or site is stacking.UNTAGGED or (
      site is None and _context.independent_of_parameters(trace, kernel)):
    return apply(x, *params)      # (an empty kernel: no curvature to capture)
  name = _layer_name(trace, name, kernel, site)
  mask = _row_mask_of(trace, name, kind, apply, x, params, out_dims, example_dims,
                      stacked=site is not None and bool(site.stack))
  if trace.mode == _context.DISCOVER:
    _discover(trace, kind, name, kernel, bias, site, row_masked=mask is not None,
              **record)
    y = apply(x, *params)
    trace.stats_dtypes[name] = _real_statistics_dtype(name, x, y)
    return y
  probes = _layer_probes(trace, name, site)
  if probes is None or _derivative_over(trace) == _compat.FORWARD:
    # Not preconditioned (skipped by the optimizer), or under a forward-mode
    # derivative the loss takes itself: that application gives no statistics
    # (discovery told the optimizer: `TaggedLayer.under_derivative`).
    return apply(x, *params)
  if factors.BASES[0] in probes and examples is None:
    raise ValueError(f"Tagged layer '{name}' ({kind}) has no EK-FAC statistic.")
  layer_stats = _LayerStatistics(trace, name, stats, examples, positions, probes,
                                 groups=record.get("groups", 1), record=record,
                                 has_bias=bias is not None)
  return _captured(apply, layer_stats, x, params, probes, trace.compute_stats, stats_input,
                   mask, lambda: trace.reached.add(name))


class _LayerStatistics:
  """One tagged layer's statistics in the capture's backward pass
  (`_captured`'s `stats`): the tag's `stats` of the input and the output
  cotangent in the probes' dtype and forms, EK-FAC's `S` where the probes
  bring eigenbases, the positions counted where the probes ask for them, and
  the capture's scale (`_scaled_inside`)."""

  def __init__(self, trace: _context.Trace, name: str, stats: Callable,
               examples: Callable | None, positions: Callable | None, probes: dict, *,
               groups: int, record: dict, has_bias: bool):
    forms = _forms(probes if groups == 1 else
                   jax.tree_util.tree_map(lambda p: p[0], probes), record)
    self.packed = [key for key, form in forms.items() if form == factors.PACKED]
    self.forms = {key: factors.FULL if key in self.packed else form
                  for key, form in forms.items()}
    self.dtype = jnp.result_type(*probes.values())
    self.trace, self.name, self.groups, self.has_bias = trace, name, groups, has_bias
    self.stats, self.examples, self.positions = stats, examples, positions

  def block(self, xx: jax.Array, gg: jax.Array, bases: dict, mask: jax.Array | None
            ) -> dict:
    """One block's statistics (PACKED ones packed inside the conditional);
    with eigenbases `bases`, also EK-FAC's `S`."""
    out = self.stats(xx, gg, self.forms, mask)
    for key in self.packed:
      out[key] = triangles.pack_upper(out[key])
    if bases:
      ex, eg, example_dims = self.examples(xx, gg)
      out[factors.CORRECTED] = factors.corrected_scaling(
          ex, eg, self.has_bias, *(bases[key] for key in factors.BASES), example_dims)
    return out

  def __call__(self, xx: jax.Array, gg: jax.Array, inputs: dict, mask: jax.Array | None
               ) -> dict:
    """`block` of the input (ids stay integers) and the output cotangent, both
    cast to the statistics' dtype (a grouped convolution's: of each group's
    channels, mapped over the groups), the rows a `mask` leaves out zeroed in
    the cotangent; with eigenbases among the probes `inputs`, zeros for them."""
    if not jnp.issubdtype(xx.dtype, jnp.integer):
      xx = xx.astype(self.dtype)
    gg = gg.astype(self.dtype)
    if mask is not None:
      gg = gg * mask.reshape(mask.shape + (1,) * (gg.ndim - mask.ndim)).astype(self.dtype)
    bases = {key: inputs[key] for key in factors.BASES if key in inputs}
    if self.groups == 1:
      out = self.block(xx, gg, bases, mask)
    else:
      out = jax.vmap(lambda x_, g_, b_: self.block(x_, g_, b_, mask))(
          _groups_first(xx, self.groups), _groups_first(gg, self.groups), bases)
    if factors.POSITIONS in inputs:             # this run's sum and positions
      count = self.positions(xx, gg)
      if "A" in out:
        out["A"] = out["A"] * count
      kept = count if mask is None else (
          jnp.sum(mask, dtype=self.dtype) * (count // max(mask.size, 1)))
      out[factors.POSITIONS] = _counted(kept, inputs[factors.POSITIONS], gg)
    out.update({key: jnp.zeros_like(value) for key, value in bases.items()})
    return _scaled_inside(self.trace, self.name, out)


@dataclasses.dataclass(eq=False)
class _RowMask:
  """An active `row_mask`: its booleans, the layers it is for (patterns; none:
  every layer), the JAX trace it was entered in, whether a tag took it, and
  how often each layer it did not fit ran in its block (`_warn_mask_outside_loop`)."""
  mask: jax.Array
  patterns: tuple
  top: object
  used: bool = False
  unfitted_runs: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def row_mask(mask: ArrayLike, layers: Sequence[str] = ()) -> Iterator[None]:
  """Inside the loss function: the tagged layers run in this block leave the
  rows where `mask` is False (0) out of their curvature statistics.

  Padding (sequences padded to one length, examples padded to a fixed batch,
  a mixture of experts' empty capacity slots) otherwise counts as examples:
  `A` averages every row a layer multiplies. Under the mask a layer's
  `A = Σ_kept a aᵀ / #kept` (its bias coordinate's 1 included), the left-out
  rows add nothing to `G`, `F` or EK-FAC's `S`, and the mean is over the
  kept rows of the whole global batch: inside `shard_map` and over
  `accumulate`'s slices the devices' (slices') `A` are weighted by their
  kept rows, and a pass that keeps none leaves the layer's factors as they
  are. The loss and the gradients stay the loss function's: mask the loss
  as well (`kd.losses.*(..., mask=)`).

  A tagged layer takes the innermost mask whose shape is the leading axes
  of its output positions (`[B]` per example, `[B, T]` per token for a
  Dense layer on `[B, T, d]`; a convolution's output pixels, an
  embedding's ids; a scalar: every position) and whose `layers` (regular
  expressions searched in the layer's name, e.g. `["encoder"]`; empty:
  every layer) name it; a layer whose positions the shape does not begin
  (a head on pooled `[B, d]` under a `[B, T]` mask) is not masked. Names
  say where a layer sits, not whose rows it multiplies: a decoder's
  cross-attention keys and values, on the encoder's positions, need the
  encoder's mask by name (warned where only its shape tells). Inside a
  `jax.vmap` (`nn.vmap`, `nnx.vmap`) entered after the mask the arrays have
  lost their mapped axis: enter the mask inside the mapped function (a
  scalar per example for a model written per example); inside a loop over
  an axis of the mask (a recurrent cell's time steps under `lax.scan` or
  `nn.RNN`) enter each step's slice inside the body (warned where a layer
  in a loop entered after a mask would take it but for one axis). Errors: a
  mask that no tagged layer takes, one whose shape a layer inside such a
  vmap would take, and one over the positions inside K-FAC-reduce's examples
  (`example_dims=k`: at most `k` axes). Outside `kd.value_and_grad` it does
  nothing.
  """
  mask = jnp.asarray(mask)
  if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.number)):
    raise TypeError(f"kd.tags.row_mask: the mask must be boolean or numeric (nonzero: "
                    f"kept), got {mask.dtype}.")
  patterns = tuple(map(re.compile, registry.check_patterns(
      "kd.tags.row_mask: layers", layers, empty="every layer")))
  trace = _context.tagging()
  if trace is None:
    yield
    return
  entry = _RowMask(mask if mask.dtype == jnp.bool_ else mask != 0, patterns,
                   _compat.current_trace())
  trace.row_masks.append(entry)
  try:
    yield
  finally:
    trace.row_masks.pop()
  if trace.mode == _context.DISCOVER and not entry.used:
    raise ValueError(
        f"kd.tags.row_mask of shape {tuple(mask.shape)}"
        + (f" for layers {list(layers)}" if layers else "") + " masked no tagged layer: "
        "its shape must be the leading axes of a tagged layer's output positions inside "
        "the block ([B] or [B, T] for a Dense layer on [B, T, d]; [B] for a "
        "convolution's images), in the same jax.vmap as the with-statement.")


def _row_mask_of(trace: _context.Trace, name: str, kind: str, apply: Callable, x,
                 params: tuple, out_dims: int, example_dims: int | None,
                 stacked: bool) -> jax.Array | None:
  """The innermost active `row_mask` for layer `name` whose shape begins
  the layer's positions (the leading axes of `apply`'s output but its last
  `out_dims`), marked used; None. `example_dims`: a layer with `A` reducing
  the positions of each example first (a mask over them is refused).
  `stacked`: one block of a stacked layer (a loop over it runs over blocks,
  not over an axis of the batch)."""
  if not trace.row_masks:
    return None
  spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
  out = jax.eval_shape(apply, spec(x), *map(spec, params)).shape
  positions = tuple(out[:len(out) - out_dims])
  for entry in reversed(trace.row_masks):
    shape = tuple(entry.mask.shape)
    if (positions[:len(shape)] != shape
        or entry.patterns and not any(p.search(name) for p in entry.patterns)):
      continue
    if _compat.vmapped_since(entry.top):
      raise ValueError(
          f"kd.tags.row_mask of shape {shape}, entered outside a jax.vmap (nn.vmap, "
          f"nnx.vmap), fits the positions {positions} of tagged layer '{name}' ({kind}) "
          "inside it, where the arrays have lost the mapped axis: whether it masks the "
          "right rows cannot be told. Enter the mask inside the mapped function (a "
          "scalar per example for a model written per example), or give it layers= "
          "that leave this layer out.")
    if example_dims is not None and len(shape) > example_dims:
      raise ValueError(
          f"kd.tags.row_mask of shape {shape} on tagged layer '{name}' ({kind}, "
          f"example_dims={example_dims}): it masks positions inside the examples whose "
          f"inputs K-FAC-reduce averages. Give it the shape of the first {example_dims} "
          f"axes {positions[:example_dims]}, or use example_dims=None.")
    entry.used = True
    return entry.mask
  if trace.mode == _context.DISCOVER and not stacked:
    _warn_mask_outside_loop(trace.row_masks, name, kind, positions)
  if trace.mode == _context.DISCOVER:
    _check_named_mask_fits(trace.row_masks, name, positions)
  return None


def _warn_mask_outside_loop(entries: Sequence[_RowMask], name: str, kind: str,
                            positions: tuple) -> None:
  """Warn where a mask of two or more axes does not fit layer `name`'s
  positions but would without one of its axes, and the layer, unstacked (its
  kernel shared by the iterations), runs in a loop entered after the mask (a
  `lax.scan`, `nn.RNN`) or has run in its block as many times as that axis
  is long (a Python loop): if the loop runs over that axis (a recurrent
  cell's time steps) each iteration's rows are one slice of it, taken
  unmasked. (JAX does not say what its loop runs over, refinement steps on
  pooled rows look the same: this warns and does not refuse.)"""
  for entry in reversed(entries):
    shape = tuple(entry.mask.shape)
    if entry.patterns and not any(p.search(name) for p in entry.patterns):
      continue
    runs = entry.unfitted_runs[name] = entry.unfitted_runs.get(name, 0) + 1
    sliced = [i for i in range(len(shape)) if len(shape) > 1
              and positions[:len(shape) - 1] == shape[:i] + shape[i + 1:]]
    if not any(_compat.looped_since(entry.top) or runs == shape[i] for i in sliced):
      continue
    warnings.warn(
        f"kd.tags.row_mask of shape {shape}, entered outside a loop (lax.scan, nn.scan, "
        f"nn.RNN, a Python loop) that tagged layer '{name}' ({kind}) runs in, would fit "
        f"its positions {positions} but for one axis: if the loop runs over that axis (a "
        "recurrent cell's time steps), each step's rows are taken unmasked. Enter the "
        "step's mask inside the loop's body (mask[:, t] for step t; for a Flax RNN, "
        "nn.scan over a cell that takes (x_t, mask_t)); if it runs over something else, "
        "give the mask layers= that leave this layer out (docs/concepts.md, 'Padding: "
        "row masks').", stacklevel=6)
    return


def _check_named_mask_fits(entries: Sequence[_RowMask], name: str,
                           positions: tuple) -> None:
  """Warn where a mask names layer `name` but does not fit its positions
  while another mask, for other layers, does: the layer's rows are another
  sequence's (a decoder's cross-attention keys and values run on the
  encoder's positions), taken unmasked."""
  fits = lambda e: positions[:e.mask.ndim] == tuple(e.mask.shape)
  named = [e for e in entries if any(p.search(name) for p in e.patterns)]
  others = [e for e in entries if fits(e)]
  if named and others and not any(map(fits, named)):
    warnings.warn(
        f"Tagged layer '{name}' (positions {positions}): kd.tags.row_mask of shape "
        f"{tuple(named[-1].mask.shape)} names it but does not fit its positions, and "
        f"the mask of shape {tuple(others[-1].mask.shape)} that fits them is for other "
        "layers, so its rows are taken unmasked. A decoder's cross-attention keys and "
        "values run on the encoder's positions: give them the encoder's mask by name "
        "(docs/concepts.md, 'Padding: row masks').", stacklevel=6)


def _counted(count: int, probe: jax.Array, data: jax.Array) -> jax.Array:
  """`count` like `probe`, computed from `data` (a run's output cotangent):
  under `jax.vmap` it is then mapped like the run's statistics and summed
  over the lanes with them, where a constant would count one lane only."""
  if not data.size:
    return jnp.full_like(probe, count)
  first = jnp.reshape(data, (-1,))[0]
  return jnp.where(jnp.isnan(first), count, count).astype(probe.dtype) + jnp.zeros_like(probe)


def _groups_first(x: jax.Array, groups: int) -> jax.Array:
  """`[..., groups·c]` → `[groups, ..., c]`: each group's channels (a grouped
  convolution's inputs or outputs) as one slice of a leading axis."""
  grouped = x.reshape(x.shape[:-1] + (groups, x.shape[-1] // groups))
  return jnp.moveaxis(grouped, -2, 0)


def _block_of(kernel, bias, stack_index, site):
  """One block's parameters and their `stacking.Site` (`stack_index=` route)."""
  if stack_index is None:
    return kernel, bias, site
  if site is not None:
    raise ValueError("stack_index= is for plain JAX tags; kd.linen / kd.nnx layers "
                     "find their block themselves.")
  return stacking.index_site(kernel, bias, stack_index)


def dense(x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
          name: str | None = None, dtype: Any = None, precision=None,
          example_dims: int | None = None, stack_index=None,
          transpose_kernel: bool = False, _site=None) -> jax.Array:
  """`x @ kernel + bias` over the last axis of `x`; kernel layout `(in, out)`,
  or `(out, in)` with `transpose_kernel=True` (PyTorch's and Equinox's
  `Linear` weight, applied as `x @ kernelᵀ`; the factors are the applied
  kernel's, see `registry`).

  `example_dims=None` (default): any leading axes of `x` (`[B, d]`, `[B, T,
  d]`, ...) are positions, each an example of `A = E[a aᵀ]` and `G` (tokens
  are treated as examples: K-FAC-expand). `example_dims=k`: the first k axes
  index examples and the positions inside each are reduced first, the inputs
  averaged and the output gradients summed (K-FAC-reduce, Eschenhagen et al.
  2023; e.g. `k = 1` on `[B, T, d]` for a per-sequence loss). See `factors`.
  `stack_index`: `kernel` (and `bias`) are stacked leaves `[*stack, ...]` and
  the tag applies block `kernel[stack_index]` (see the module docstring).
  """
  kernel, bias, site = _block_of(kernel, bias, stack_index, _site)
  layout = "(out, in)" if transpose_kernel else "(in, out)"
  if kernel.ndim != 2:
    raise ValueError(f"kd.tags.dense expects a 2-D {layout} kernel, got {kernel.shape}")
  d_in, d_out = kernel.shape[::-1] if transpose_kernel else kernel.shape
  if x.shape[-1] != d_in:
    raise ValueError(
        f"kd.tags.dense: input features {x.shape[-1]} do not match kernel {kernel.shape} "
        f"in the layout {layout}"
        + ("" if transpose_kernel or x.shape[-1] != kernel.shape[1] else
           " (an (out, in) weight, PyTorch's or Equinox's: transpose_kernel=True)"))
  _check_bias("dense", bias, (d_out,))
  _check_example_dims("dense", example_dims, x.ndim - 1, x.shape)
  contracted = 1 if transpose_kernel else 0

  def apply(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None
            ) -> jax.Array:
    x, kernel, bias = _promote(dtype, x, kernel, bias)
    y = lax.dot_general(x, kernel, (((x.ndim - 1,), (contracted,)), ((), ())),
                        precision=precision)
    return _add_bias(y, bias)

  stats, examples, stats_input = _dense_statistics(bias is not None, 1, 1, example_dims)
  transposed = {"transposed_kernel": True} if transpose_kernel else {}
  return _tagged("dense", name, apply, stats, x, kernel, bias, site, examples=examples,
                 stats_input=stats_input, positions=_row_count(example_dims),
                 example_dims=example_dims, a_dim=d_in + (bias is not None),
                 g_dim=d_out, **transposed)


def _size(shape) -> int:
  size = 1
  for d in shape:
    size *= int(d)
  return size


def _rows(x: jax.Array, feature_dims: int, example_dims: int | None) -> jax.Array:
  """`x` with its last `feature_dims` axes merged into one and, where every
  position is an example (`example_dims=None`), its leading axes into rows,
  `[N, d]`: a bitcast of a row-major `x`."""
  width = _size(x.shape[x.ndim - feature_dims:])
  lead = x.shape[:x.ndim - feature_dims]
  return x.reshape((-1, width) if example_dims is None else lead + (width,))


def _row_count(example_dims: int | None) -> Callable[[jax.Array, jax.Array], int]:
  """A Dense layer's `positions(rows, ḡ)`: the rows of `A` (see `_rows`)."""
  return lambda rows, g: factors.num_rows(rows, example_dims)


def _dense_statistics(has_bias: bool, in_dims: int, out_dims: int,
                      example_dims: int | None) -> tuple[Callable, Callable, Callable]:
  """`(stats, examples, stats_input)` of a Dense layer whose last `in_dims`
  input axes and last `out_dims` output axes are features (see `_tagged`):
  `A`, `G` of the inputs and output cotangents as rows (`_rows`; the input's
  rows taken before the statistics' conditional, see `_captured`)."""
  def stats(rows: jax.Array, g: jax.Array, forms: tuple[str, str],
            mask: jax.Array | None = None) -> dict:
    weights = None if mask is None else factors.row_weights(
        mask, g.shape[:g.ndim - out_dims], example_dims)
    return {"A": factors.input_factor(rows, has_bias, forms["A"], example_dims, weights),
            "G": factors.output_factor(_rows(g, out_dims, example_dims), forms["G"],
                                       example_dims)}

  def examples(rows: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, int | None]:
    return rows, _rows(g, out_dims, example_dims), example_dims

  return stats, examples, lambda x: _rows(x, in_dims, example_dims)


def _check_bias(tag: str, bias: jax.Array | None, expected: tuple[int, ...]) -> None:
  """Refuses a bias whose shape is not the layer's output features `expected`."""
  if bias is not None and tuple(bias.shape) != tuple(expected):
    raise ValueError(f"kd.tags.{tag}: bias shape {tuple(bias.shape)}, expected "
                     f"{tuple(expected)}")


def _check_example_dims(tag: str, example_dims, num_leading: int, shape) -> None:
  if example_dims is not None and not (
      isinstance(example_dims, (int, np.integer)) and not isinstance(example_dims, bool)):
    raise TypeError(f"kd.tags.{tag}: example_dims must be None or an int (the leading "
                    f"axes that index examples), got {example_dims!r}")
  if example_dims is not None and not 0 <= example_dims <= num_leading:
    raise ValueError(f"kd.tags.{tag}: example_dims={example_dims} for an input of "
                     f"shape {shape}: at most its {num_leading} leading (non-feature) "
                     "axes can index examples")


def dense_general(x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
                  in_dims: int = 1, name: str | None = None, dtype: Any = None,
                  precision=None, example_dims: int | None = None, stack_index=None,
                  kernel_axes: Sequence[int] | None = None, _site=None) -> jax.Array:
  """A Dense layer over several input and/or output axes.

  The last `in_dims` axes of `x` are contracted with the first `in_dims` axes
  of the kernel; the remaining kernel axes are the output axes, and the bias
  has their shape. E.g. attention projections: `x [B, T, d]` with a kernel
  `[d, heads, head_dim]` (`in_dims=1`) gives `[B, T, heads, head_dim]`; `x [B,
  T, heads, head_dim]` with a kernel `[heads, head_dim, d]` (`in_dims=2`)
  gives `[B, T, d]`. `kernel_axes`: a kernel stored in another order (Gemma's
  `[heads, d, head_dim]`) is applied as `jnp.transpose(kernel, kernel_axes)`
  (here `(1, 0, 2)`), whose layout is the one above.

  K-FAC sees the flattened Dense layer: `a_dim = Π in_shape (+1 with a bias)`,
  `g_dim = Π out_shape`, and `A`, `G` are Dense's on the flattened inputs and
  output cotangents (the applied kernel's row-major reshape to `(a_dim -
  has_bias, g_dim)` is the Dense kernel). It is recorded with kind "dense".
  `stack_index`: `kernel` (and `bias`) are stacked leaves `[*stack, ...]` and
  the tag applies block `kernel[stack_index]` (see the module docstring).
  """
  kernel, bias, site = _block_of(kernel, bias, stack_index, _site)
  axes = _kernel_axes("dense_general", kernel.ndim, kernel_axes)
  shape = tuple(kernel.shape[i] for i in axes) if axes else tuple(kernel.shape)
  if not 1 <= in_dims < kernel.ndim:
    raise ValueError(f"kd.tags.dense_general: in_dims={in_dims} for a kernel of shape "
                     f"{kernel.shape} (needs at least one output axis)")
  in_shape, out_shape = shape[:in_dims], shape[in_dims:]
  if x.ndim < in_dims or x.shape[x.ndim - in_dims:] != in_shape:
    raise ValueError(f"kd.tags.dense_general: the last {in_dims} axes of the input "
                     f"{x.shape} do not match the kernel {shape}"
                     + _stored_as(kernel, axes))
  _check_bias("dense_general", bias, out_shape)
  _check_example_dims("dense_general", example_dims, x.ndim - in_dims, x.shape)
  n_out = len(out_shape)

  def apply(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None
            ) -> jax.Array:
    x, kernel, bias = _promote(dtype, x, kernel, bias)
    kernel = kernel if axes is None else jnp.transpose(kernel, axes)
    contract = (tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims)))
    y = lax.dot_general(x, kernel, (contract, ((), ())), precision=precision)
    return _add_bias(y, bias)

  stats, examples, stats_input = _dense_statistics(bias is not None, in_dims, n_out,
                                                   example_dims)
  permuted = {"kernel_axes": axes} if axes else {}
  return _tagged("dense", name, apply, stats, x, kernel, bias, site, examples=examples,
                 stats_input=stats_input, positions=_row_count(example_dims),
                 out_dims=n_out, example_dims=example_dims,
                 a_dim=_size(in_shape) + (bias is not None),
                 g_dim=_size(out_shape), **permuted)


def einsum(equation: str, x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None,
           *, name: str | None = None, dtype: Any = None, precision=None,
           example_dims: int | None = None, stack_index=None) -> jax.Array:
  """`jnp.einsum(equation, x, kernel)` (plus `bias`) for an equation that is a
  Dense layer's in any axis order: every input axis contracted with the
  kernel or kept in the output, every kernel axis contracted or an output
  feature (Gemma's `BTD,NDH->BTNH`, `BTD,SNDH->SBTNH`, `BTNH,NHD->BTD`). Runs
  `dense_general` on the input and kernel transposed to its order
  (`kernel_axes`), the output transposed back. `bias`: the output's features
  in the output's order (Flax's `Einsum`'s). Another equation is refused
  (compute it with `jnp.einsum`, untagged). `example_dims`, `stack_index` as
  for `dense`."""
  # (the kernel as given: the capture knows its parameter leaves by identity)
  stack_dims = 0 if stack_index is None else (
      len(stack_index) if isinstance(stack_index, tuple) else 1)
  layout = _einsum.dense_layout(equation, jnp.ndim(x), jnp.ndim(kernel) - stack_dims)
  if isinstance(layout, str):
    why = layout or (
        f"{equation!r} is no explicit two-operand equation ('x,kernel->out') that fits "
        f"the input {jnp.shape(x)} and the kernel {jnp.shape(kernel)}"
        + (f" (one block of it: stack_index={stack_index!r})" if stack_dims else ""))
    raise ValueError(f"kd.tags.einsum: {why}; only a Dense layer's equation is tagged "
                     "(compute another with jnp.einsum).")
  return layout.run(x, functools.partial(
      dense_general, kernel=kernel, bias=bias, in_dims=layout.in_dims, name=name,
      dtype=dtype, precision=precision, example_dims=example_dims,
      stack_index=stack_index))


def _kernel_axes(tag: str, ndim: int, kernel_axes: Sequence[int] | None
                 ) -> tuple[int, ...] | None:
  """`kernel_axes` checked as a permutation of a kernel's `ndim` axes; `None`
  for the kernel's own order."""
  if kernel_axes is None:
    return None
  try:
    axes = tuple(operator.index(a) for a in kernel_axes)
  except TypeError:
    axes = ()
  if sorted(axes) != list(range(ndim)):
    raise ValueError(f"kd.tags.{tag}: kernel_axes={kernel_axes!r} must be a "
                     f"permutation of the kernel's {ndim} axes, integers 0..{ndim - 1}")
  return None if axes == tuple(range(ndim)) else axes


def _stored_as(kernel: jax.Array, axes: tuple[int, ...] | None) -> str:
  """An error's note on a permuted kernel: its stored shape and `kernel_axes`."""
  return f" (the stored {kernel.shape} as kernel_axes={axes})" if axes else ""


def _conv_padding(tag: str, padding, spatial: int):
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      raise ValueError(
          f"kd.tags.{tag} supports SAME, VALID or explicit padding, got {padding!r}"
          + (": pad the input first (CAUSAL: explicit ((dilation·(k − 1), 0),); "
             "CIRCULAR / REFLECT: jnp.pad(x, ..., mode='wrap' / 'reflect') then VALID), "
             "as kd.linen.Conv does" if padding.upper() in ("CAUSAL", "CIRCULAR", "REFLECT")
             else ""))
    return padding.upper()
  if isinstance(padding, int):
    return ((padding, padding),) * spatial
  return tuple((int(lo), int(hi)) for lo, hi in padding)


def _spatial(tag: str, argument: str, value, spatial: int) -> tuple[int, ...]:
  """Strides or dilations: one int for every spatial axis, or one per axis,
  each positive."""
  values = (value,) * spatial if np.ndim(value) == 0 else tuple(value)
  if len(values) != spatial or any(int(v) < 1 for v in values):
    raise ValueError(f"kd.tags.{tag}: {argument}={value!r} must be a positive integer "
                     f"or {spatial} positive integers (one per spatial axis)")
  return tuple(int(v) for v in values)


_CONV_LAYOUTS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"),
                 3: ("NDHWC", "DHWIO", "NDHWC")}


def _pytorch_axes(spatial: int) -> tuple[int, ...]:
  """`kernel_axes` of an `(out, in, *window)` kernel (PyTorch's, Equinox's)."""
  return tuple(range(2, spatial + 2)) + (1, 0)


def _applied_shape(tag: str, spatial: int, x: jax.Array, kernel: jax.Array, groups: int,
                   transpose_kernel: bool, axes: tuple[int, ...] | None,
                   channels_first: bool) -> tuple[int, ...]:
  """The shape of the kernel a convolution applies (`(*window, in / groups,
  out)`), after checking that the input (channels last by now) and the
  kernel (stored, its `axes` the `kernel_axes`) fit it."""
  layout = _CONV_LAYOUTS[spatial]
  if x.ndim != spatial + 2 or kernel.ndim != spatial + 2:
    raise ValueError(f"kd.tags.{tag} expects {layout[0]} inputs and {layout[1]} "
                     f"kernels, got {x.shape} and {kernel.shape}")
  if transpose_kernel and groups != 1:
    raise ValueError(f"kd.tags.{tag}: transpose_kernel=True with feature_group_count="
                     f"{groups}; a transposed kernel has one group.")
  shape = kernel.shape if axes is None else tuple(kernel.shape[i] for i in axes)
  shape = registry.channels_swapped(shape) if transpose_kernel else shape
  if groups < 1 or shape[-1] % groups:
    raise ValueError(f"kd.tags.{tag}: feature_group_count={groups} must be "
                     f"a positive divisor of the kernel's output channels {shape[-1]}")
  if x.shape[-1] != shape[-2] * groups:
    channels = x.shape[-1] if channels_first else x.shape[1]
    pytorch = (axes is None and not transpose_kernel
               and channels == kernel.shape[1] * groups)
    hint = (f" (an (out, in, *window) kernel on channels-first inputs, PyTorch's and "
            f"Equinox's: kernel_axes={_pytorch_axes(spatial)}"
            + ("" if channels_first else ", channels_first=True") + ")") if pytorch else ""
    raise ValueError(
        f"kd.tags.{tag}: input channels {x.shape[-1]} do not match kernel "
        f"{tuple(shape)} with feature_group_count={groups}"
        + " and transpose_kernel=True" * transpose_kernel
        + _stored_as(kernel, axes) + hint)
  return tuple(shape)


def _channels_first(tag: str, spatial: int, x: ArrayLike,
                    convolve: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """`convolve` (channels last) on a channels-first `x` (`[N, C, *spatial]`),
  its output moved back to channels first: the same factors."""
  x = jnp.asarray(x)
  if x.ndim != spatial + 2:
    raise ValueError(f"kd.tags.{tag} with channels_first=True expects "
                     f"[N, C, {spatial}-D spatial] inputs, got {x.shape}")
  return jnp.moveaxis(convolve(jnp.moveaxis(x, 1, -1)), -1, 1)


def _convolution(tag: str, spatial: int, x: ArrayLike, *args: Any,
                 channels_first: bool) -> jax.Array:
  """`_channels_last` (`args` its arguments after `x`), on a
  channels-first `x` (`[N, C, *spatial]`) through `_channels_first`."""
  convolve = lambda x: _channels_last(tag, spatial, x, *args, channels_first)
  return _channels_first(tag, spatial, x, convolve) if channels_first else convolve(x)


def _channels_last(tag: str, spatial: int, x: jax.Array, kernel: jax.Array,
                   bias: jax.Array | None, name, strides, padding, dilation,
                   input_dilation, feature_group_count: int, dtype, precision,
                   example_dims, site, transpose_kernel: bool,
                   kernel_axes: Sequence[int] | None, moved: bool) -> jax.Array:
  """`conv1d` / `conv2d` / `conv3d`: channels-last input `[N, *spatial, C]`,
  Flax's kernel `(*window, in, out)`; `A` from the im2col patches
  (`factors.conv_patches`) of the input, with `input_dilation − 1` zeros
  between its entries when dilated (a transposed convolution), `G` from the
  output cotangents. A grouped convolution (`feature_group_count = n`: kernel
  `(*window, in / n, out)`) is `n` blocks, each group's channels a
  convolution of its own (see `registry`). `transpose_kernel`: the kernel is
  stored `(*window, out, in)` and applied flipped (`registry.flip_swap`).
  `kernel_axes`: the kernel is stored in another order, applied as
  `jnp.transpose(kernel, kernel_axes)` (before a transposed kernel's flip).
  `moved`: `x` was given channels first (for the errors' hints)."""
  groups = int(feature_group_count)
  layout = _CONV_LAYOUTS[spatial]
  axes = _kernel_axes(tag, kernel.ndim, kernel_axes)
  shape = _applied_shape(tag, spatial, x, kernel, groups, transpose_kernel, axes, moved)
  _check_bias(tag, bias, shape[-1:])
  _check_example_dims(tag, example_dims, spatial + 1, x.shape)
  strides = _spatial(tag, "strides", strides, spatial)
  dilation = _spatial(tag, "dilation", dilation, spatial)
  input_dilation = _spatial(tag, "input_dilation", input_dilation, spatial)
  padding = _conv_padding(tag, padding, spatial)
  has_bias = bias is not None    # (the backward pass closes over no tracer)

  def apply(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None
            ) -> jax.Array:
    x, kernel, bias = _promote(dtype, x, kernel, bias)
    kernel = kernel if axes is None else jnp.transpose(kernel, axes)
    y = lax.conv_general_dilated(
        x, registry.flip_swap(kernel, spatial) if transpose_kernel else kernel,
        window_strides=strides, padding=padding, lhs_dilation=input_dilation,
        rhs_dilation=dilation, dimension_numbers=layout, feature_group_count=groups,
        precision=precision)
    return _add_bias(y, bias)

  def patches(x: jax.Array, homogeneous: bool = False) -> jax.Array:
    if any(d != 1 for d in input_dilation):
      x = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0),) + tuple(
          (0, 0, d - 1) for d in input_dilation) + ((0, 0, 0),))
    return factors.conv_patches(x, shape, strides, padding, dilation, homogeneous)

  def stats(x: jax.Array, g: jax.Array, forms: tuple[str, str],
            mask: jax.Array | None = None) -> dict:
    # A gathered patch gets its bias's 1 in the gather (`conv_patches`); a
    # 1x1 kernel's patches are the input itself, which a 1 would copy.
    homogeneous = has_bias and math.prod(shape[:-2]) != 1
    weights = None if mask is None else factors.row_weights(mask, g.shape[:-1],
                                                            example_dims)
    return {"A": factors.input_factor(patches(x, homogeneous), has_bias and not homogeneous,
                                      forms["A"], example_dims, weights),
            "G": factors.output_factor(g, forms["G"], example_dims)}

  def examples(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, int]:
    """Patches and cotangents; an example is an image (its pixels summed)."""
    return patches(x), g, 1 if example_dims is None else example_dims

  transposed = {"transposed_kernel": True} if transpose_kernel else {}
  permuted = {"kernel_axes": axes} if axes else {}
  return _tagged(tag, name, apply, stats, x, kernel, bias, site, examples=examples,
                 positions=lambda x, g: factors.num_rows(g, example_dims),
                 example_dims=example_dims, a_dim=math.prod(shape[:-1]) + has_bias,
                 g_dim=shape[-1] // groups, groups=groups, **transposed, **permuted)


def conv2d(x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
           name: str | None = None, strides: Sequence[int] = (1, 1),
           padding: str | Sequence[tuple[int, int]] = "SAME",
           dilation: Sequence[int] = (1, 1), input_dilation: Sequence[int] = (1, 1),
           feature_group_count: int = 1, dtype: Any = None, precision=None,
           example_dims: int | None = None, stack_index=None, transpose_kernel: bool = False,
           kernel_axes: Sequence[int] | None = None, channels_first: bool = False,
           _site=None) -> jax.Array:
  """2-D convolution, NHWC input and Flax's HWIO kernel `(kh, kw, in, out)`.

  `A` is built from im2col patches (see `factors.conv_patches`), `G` from the
  output cotangents at every output pixel. A grouped or depthwise convolution
  (`feature_group_count = n`, kernel `(kh, kw, in / n, out)`) has factors per
  group, one block each (see `registry`). Every output pixel
  is a position (KFC); `example_dims=1` reduces each image's pixels first
  (patches averaged, output gradients summed: K-FAC-reduce).
  `input_dilation` (`lax.conv_general_dilated`'s `lhs_dilation`: what a
  transposed convolution with these strides computes) puts `d − 1` zeros
  between the input's entries before the patches are taken.
  `stack_index`: `kernel` (and `bias`) are stacked leaves `[*stack, ...]` and
  the tag applies block `kernel[stack_index]` (see the module docstring).
  `transpose_kernel`: the kernel is stored `(kh, kw, out, in)` and applied
  flipped over its window, channel axes swapped, as `lax.conv_transpose`'s
  `transpose_kernel=True` (PyTorch's transposed-convolution weights); the
  factors are the applied kernel's.
  `kernel_axes`: a kernel stored in another order is applied as
  `jnp.transpose(kernel, kernel_axes)` (before a transposed kernel's flip);
  `channels_first=True`: `x` and the output are NCHW. PyTorch's and
  Equinox's `Conv2d` weight `(out, in / n, kh, kw)` on NCHW images:
  `kernel_axes=(2, 3, 1, 0), channels_first=True` (the leaf keeps its
  layout; the factors are the applied kernel's).
  """
  kernel, bias, site = _block_of(kernel, bias, stack_index, _site)
  return _convolution("conv2d", 2, x, kernel, bias, name, strides, padding, dilation,
                      input_dilation, feature_group_count, dtype, precision,
                      example_dims, site, transpose_kernel, kernel_axes,
                      channels_first=channels_first)


def conv1d(x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
           name: str | None = None, strides: int | Sequence[int] = (1,),
           padding: str | Sequence[tuple[int, int]] = "SAME",
           dilation: int | Sequence[int] = (1,), input_dilation: int | Sequence[int] = (1,),
           feature_group_count: int = 1, dtype: Any = None, precision=None,
           example_dims: int | None = None, stack_index=None, transpose_kernel: bool = False,
           kernel_axes: Sequence[int] | None = None, channels_first: bool = False,
           _site=None) -> jax.Array:
  """1-D convolution, NWC input `[N, L, C]` and Flax's WIO kernel `(k, in,
  out)` (sequences: audio, text, time series).

  As `conv2d` along one axis: `A` from the `[k·in(+1)]` patches of every
  output position, `G` from the output cotangents there; every position is
  an example unless `example_dims=1` (one example per sequence).
  `stack_index`, `transpose_kernel`, `kernel_axes` and `channels_first` as
  for `conv2d` (PyTorch's `(out, in, k)` on `[N, C, L]`: `kernel_axes=(2, 1,
  0), channels_first=True`).
  """
  kernel, bias, site = _block_of(kernel, bias, stack_index, _site)
  return _convolution("conv1d", 1, x, kernel, bias, name, strides, padding, dilation,
                      input_dilation, feature_group_count, dtype, precision,
                      example_dims, site, transpose_kernel, kernel_axes,
                      channels_first=channels_first)


def conv3d(x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
           name: str | None = None, strides: int | Sequence[int] = (1, 1, 1),
           padding: str | Sequence[tuple[int, int]] = "SAME",
           dilation: int | Sequence[int] = (1, 1, 1),
           input_dilation: int | Sequence[int] = (1, 1, 1), feature_group_count: int = 1,
           dtype: Any = None, precision=None, example_dims: int | None = None,
           stack_index=None, transpose_kernel: bool = False,
           kernel_axes: Sequence[int] | None = None, channels_first: bool = False,
           _site=None) -> jax.Array:
  """3-D convolution, NDHWC input `[N, D, H, W, C]` and Flax's DHWIO kernel
  `(kd, kh, kw, in, out)` (video, volumes).

  As `conv2d` over three axes: `A` from the `[kd·kh·kw·in(+1)]` patches of
  every output voxel, `G` from the output cotangents there; every voxel is
  an example unless `example_dims=1` (one example per volume).
  `stack_index`, `transpose_kernel`, `kernel_axes` and `channels_first` as
  for `conv2d` (PyTorch's `(out, in, kd, kh, kw)` on NCDHW: `kernel_axes=(2,
  3, 4, 1, 0), channels_first=True`).
  """
  kernel, bias, site = _block_of(kernel, bias, stack_index, _site)
  return _convolution("conv3d", 3, x, kernel, bias, name, strides, padding, dilation,
                      input_dilation, feature_group_count, dtype, precision,
                      example_dims, site, transpose_kernel, kernel_axes,
                      channels_first=channels_first)


CONVOLUTIONS = {1: conv1d, 2: conv2d, 3: conv3d}   # the tag of each spatial rank


def embed(ids: ArrayLike, table: ArrayLike, *, name: str | None = None,
          dtype: Any = None, stack_index=None, out_of_range: str = "nan",
          _site=None) -> jax.Array:
  """Embedding lookup `table[ids]` (`jnp.take` along axis 0, like Flax's Embed).

  K-FAC sees a Dense layer without bias on one-hot inputs: the table `[V, d]`
  is the kernel (`a_dim = V`, `g_dim = d`), `A = diag(token frequencies)` is
  returned as the vector `[V]` (never `V × V`; recorded `a_diagonal=True`),
  and `G` is Dense's from the output cotangents. Every position of `ids` (any
  shape) is an example, as for Dense.
  `out_of_range`: "nan" (default, as `jnp.take`: an id outside `[0, V)`, a
  negative one wrapping as in NumPy, looks up NaN, which skips the step); "zero":
  such an id (negative ones too) looks up a zero row and counts in no row of
  `A`, while its position still counts in `G` and in `A`'s denominator: a
  vocabulary-parallel shard of a table split by rows over a model axis, looking
  up `ids − its first row` and summed over that axis (Megatron's), then has the
  whole table's factors restricted to its rows.
  `stack_index`: `table` is a stacked leaf `[*stack, ...]` and
  the tag applies block `table[stack_index]` (see the module docstring).
  """
  table, _, site = _block_of(table, None, stack_index, _site)
  if table.ndim != 2:
    raise ValueError(f"kd.tags.embed expects a 2-D (vocab, features) table, got "
                     f"{table.shape}")
  if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(f"kd.tags.embed: ids must be integers, got {jnp.result_type(ids)}")
  if out_of_range not in ("nan", "zero"):
    raise ValueError(f"kd.tags.embed: out_of_range={out_of_range!r}; expected 'nan' or "
                     "'zero'")
  vocab_size, features = table.shape
  zero = out_of_range == "zero"

  def in_table(ids: jax.Array) -> jax.Array:
    """`ids`, where "zero" mode leaves them out, replaced by `V` (no row)."""
    return jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size) if zero else ids

  def apply(ids: jax.Array, table: jax.Array) -> jax.Array:
    (table,) = _promote(dtype, table)
    return jnp.take(table, in_table(ids), axis=0, mode="fill",
                    fill_value=0 if zero else None)

  def stats(ids: jax.Array, g: jax.Array, forms: tuple[str, str],
            mask: jax.Array | None = None) -> dict:
    weights = None if mask is None else factors.row_weights(mask, ids.shape, None)
    return {"A": factors.token_frequencies(in_table(ids), vocab_size, g.dtype, weights),
            "G": factors.output_factor(g, forms["G"])}

  return _tagged("embed", name, apply, stats, ids, table, None, site,
                 positions=lambda ids, g: factors.num_rows(g, None),
                 a_dim=vocab_size, g_dim=features, a_diagonal=True)


def scale_and_shift(x: ArrayLike, scale: ArrayLike, offset: ArrayLike | None = None, *,
                    name: str | None = None, dtype: Any = None,
                    example_dims: int | None = None, stack_index=None,
                    _site=None, _params_dtype: Any = None) -> jax.Array:
  """`x * scale + offset` over the last axis (`x` already normalised: the
  learnable part of LayerNorm / BatchNorm).

  Its curvature is SP-NGD's unit-wise Fisher (`factors.unitwise_fisher`): one
  2×2 block per channel over `(scale_c, offset_c)`, from per-example
  gradients, returned as `stats[name]["F"]` of shape `[C, 3]`.

  `example_dims`: how many leading axes of `x` index examples; the other
  leading axes are positions within an example, whose gradients are summed
  into the example's gradient before the outer product. `None` (default):
  every position is an example, the Dense convention (tokens are examples).
  `kd.linen.BatchNorm` / `kd.nnx.BatchNorm` use 1: on `[B, H, W, C]` feature
  maps an example is an image, SP-NGD Eq. 16.

  `offset=None` (a scale-only layer) is supported: `F`'s `γβ` and `ββ` entries
  are then zero. A layer with an offset but no scale has no tag.
  `stack_index`: `scale` (and `offset`) are stacked leaves `[*stack, ...]` and
  the tag applies block `scale[stack_index]` (see the module docstring).
  `_params_dtype`: `scale` and `offset` rounded to it first (NNX's norms
  promote their parameters to the layer's `dtype`, then compute in `x`'s).
  """
  scale, offset, site = _block_of(scale, offset, stack_index, _site)
  if scale.ndim != 1 or x.shape[-1:] != scale.shape:
    raise ValueError(f"kd.tags.scale_and_shift: scale of shape {scale.shape} does not "
                     f"match the last axis of the input {x.shape}")
  if offset is not None and offset.shape != scale.shape:
    raise ValueError(f"kd.tags.scale_and_shift: offset shape {offset.shape}, expected "
                     f"{scale.shape}")
  _check_example_dims("scale_and_shift", example_dims, x.ndim - 1, x.shape)
  has_offset = offset is not None

  def apply(x: jax.Array, scale: jax.Array, offset: jax.Array | None = None
            ) -> jax.Array:
    if _params_dtype is not None:
      scale, offset = (None if a is None else a.astype(_params_dtype) for a in (scale, offset))
    x, scale, offset = _promote(dtype, x, scale, offset)
    return _add_bias(x * factors.with_leading_units(scale, x.ndim), offset)

  def stats(x: jax.Array, g: jax.Array, forms: tuple[str, str],
            mask: jax.Array | None = None) -> dict:
    del forms, mask                 # (the cotangent comes masked)
    return {"F": factors.unitwise_fisher(x, g, has_offset, example_dims)}

  return _tagged("scale_and_shift", name, apply, stats, x, scale, offset, site,
                 positions=lambda x, g: factors.num_rows(g, None),
                 a_dim=1 + has_offset, g_dim=scale.shape[0])


def _registering_no_loss(trace: _context.Trace, fun: Callable) -> Callable:
  """`fun`, refused if it registers the loss: the capture and the curvature
  products read the loss's inputs after the pass, which a checkpointed
  function's trace cannot hand out (they would be its tracers)."""
  def run(*args: Any, **kwargs: Any) -> Any:
    registered = len(trace.losses)
    out = fun(*args, **kwargs)
    if len(trace.losses) != registered:
      raise ValueError(
          "kd.remat: the checkpointed function computes the kd.losses loss; K-FAC reads "
          "the loss's inputs outside it. Checkpoint the model (or its blocks) and "
          "compute the loss outside kd.remat.")
    return out
  return run


def remat(fun: Callable, *, prevent_cse: bool = True, policy: Callable | None = None,
          static_argnums: int | tuple[int, ...] = ()) -> Callable:
  """`jax.checkpoint(fun, ...)` (rematerialisation: `fun`'s activations are
  recomputed in the backward pass instead of stored) for a function that runs
  tags on parameters it takes as arguments.

  `jax.checkpoint` traces `fun` with new tracers for its arguments, so a tag
  cannot find its kernel among the loss's parameters by identity (a function
  that closes over the parameters can use `jax.checkpoint` itself). `remat`
  tells the capture which parameter leaf each argument leaf is; the discovery,
  an abstract pass with nothing to save, calls `fun` directly. Outside
  `kd.value_and_grad`, and in the curvature products, it is `jax.checkpoint`.
  `fun` must not compute the `kd.losses` loss (checkpoint the model, not the
  loss). `flax.linen.remat` and `nnx.remat` need nothing of this: their layers
  are found by module path."""
  options = dict(prevent_cse=prevent_cse, policy=policy, static_argnums=static_argnums)

  def checkpointed(*args: Any, **kwargs: Any) -> Any:
    trace = _context.current()
    if trace is None:
      return jax.checkpoint(fun, **options)(*args, **kwargs)
    run = _registering_no_loss(trace, fun)
    if trace.mode == _context.DISCOVER:
      return run(*args, **kwargs)
    if trace.mode == _context.CURVATURE:        # the tags are plain layers here
      return jax.checkpoint(run, **options)(*args, **kwargs)
    outer = jax.tree_util.tree_leaves((args, kwargs))

    def body(*inner_args: Any, **inner_kwargs: Any) -> Any:
      with trace.aliases(outer, jax.tree_util.tree_leaves((inner_args, inner_kwargs))):
        return run(*inner_args, **inner_kwargs)
    return jax.checkpoint(body, **options)(*args, **kwargs)
  return functools.wraps(fun)(checkpointed)
