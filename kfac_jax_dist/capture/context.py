"""The tracing context shared by tags, registered losses and the capture.

`kd.value_and_grad` traces the user's loss function twice: once abstractly to
*discover* the tagged layers (their names, kinds and the parameter leaves they
use), then for real to *capture* gradients and curvature statistics. Tags and
registered losses find the active trace through this module. Outside a trace
they are plain functions.

A third mode, *curvature* (`capture.curvature`: exact Gauss-Newton products
and the plain loss), records only the registered loss: the tags do not take
part (`tagging()` is None) and run as plain layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import jax.numpy as jnp

from kfac_jax_dist import _compat

_STACK = threading.local()
DISCOVER, CAPTURE, CURVATURE = "discover", "capture", "curvature"


@dataclasses.dataclass
class Trace:
  """What the tags and losses record or read during one trace of the loss."""

  mode: str                                   # DISCOVER | CAPTURE | CURVATURE
  leaf_paths: dict[int, str]                  # id(param leaf tracer) -> path
  layers: list = dataclasses.field(default_factory=list)      # discover
  probes: dict = dataclasses.field(default_factory=dict)      # capture: name -> probes
  compute_stats: Any = None                   # capture: traced or Python bool
  # capture: the statistics' scale when a Python number (set after the
  # forward pass, read by the backward pass: `value_and_grad._capture`), and
  # the layers whose backward pass applied it inside their conditional.
  statistics_scale: float | None = None
  scaled: set = dataclasses.field(default_factory=set)
  losses: list = dataclasses.field(default_factory=list)      # registered losses
  seen: set = dataclasses.field(default_factory=set)
  # discover, curvature: the loss's own JAX trace; discover: the layers that
  # may run more than once in a pass (called twice, or inside a loop, branch
  # or transform: the capture counts their positions, `statistics.POSITIONS`).
  top: Any = None
  repeats: set = dataclasses.field(default_factory=set)
  leaf_shapes: dict = dataclasses.field(default_factory=dict)  # path -> shape
  leaf_dtypes: dict = dataclasses.field(default_factory=dict)  # path -> dtype
  # Stacked layers (see `stacking`): discover: name -> how the capture hands
  # them their probes; capture: the names whose probes come that way.
  carriers: dict = dataclasses.field(default_factory=dict)
  # discover: name -> the dtype of the layer's statistics (`statistics_dtype`).
  stats_dtypes: dict = dataclasses.field(default_factory=dict)
  # discover: module path -> (layer kind, reason) of the layers a Flax wrapper
  # or interception left to Flax (their parameters pass through unpreconditioned).
  uncaptured: dict = dataclasses.field(default_factory=dict)
  # capture, curvature: (n, i) -> the weight of the i-th mean over masked
  # examples (the registered loss's, `kd.losses.masked_mean`'s), its share of
  # the global batch's (`shares`), None: none; the examples of each such mean
  # in the order they ran.
  loss_weight: Callable[[Any, int], Any] | None = None
  counts: list = dataclasses.field(default_factory=list)
  # discover, capture: the row masks entered (`tags.row_mask`), innermost last.
  row_masks: list = dataclasses.field(default_factory=list)
  # discover, capture: whether the loss runs under a derivative in the
  # parameters, whose tracers are then the values that depend on them
  # (`independent_of_parameters`).
  differentiated: bool = False
  # curvature, capture under fisher="mc" or with several registered losses:
  # zeros the registered losses add to their values (a scalar: the one loss;
  # a vector: one per loss, in the order they run), so that the derivative
  # of the loss function's value in each is that loss's coefficient there;
  # None: none.
  loss_offset: Any = None
  # discover: the layers with an application known to run in a branch or loop
  # body (`_compat.runs_in_branch`), and those with one known to run outside
  # any (`tags._discover`: both make its positions vary).
  branched: set = dataclasses.field(default_factory=set)
  unbranched: set = dataclasses.field(default_factory=set)
  # capture: the layers whose backward pass JAX traced (the others' statistics
  # are zeros: the loss does not use their outputs, `statistics.UNREACHED`).
  reached: set = dataclasses.field(default_factory=set)

  def forget_values(self) -> None:
    """Drops what holds tracers (the registered losses, the probes, the
    flag, the counts, the loss's JAX trace, the row masks, the loss's
    offset) once the forward pass no longer needs them: the tags' backward
    passes keep this trace, and JAX may keep them (cached jaxprs) past the
    trace they were made in (`jax.checking_leaks`)."""
    self.losses, self.probes, self.compute_stats, self.top = [], {}, None, None
    self.counts, self.row_masks = [], []
    self.loss_offset = None

  def path_of(self, leaf) -> str | None:
    return None if leaf is None else self.leaf_paths.get(id(leaf))

  @contextlib.contextmanager
  def aliases(self, outer: list, inner: list) -> Iterator[None]:
    """While a transform traces its body (`tags.remat`): each `inner` leaf,
    the body's tracer of an argument, has the path of the `outer` parameter
    leaf it stands for (removed afterwards, so that no id outlives its
    tracer)."""
    added = {id(i): self.leaf_paths[id(o)] for o, i in zip(outer, inner, strict=True)
             if id(o) in self.leaf_paths and id(i) not in self.leaf_paths}
    self.leaf_paths.update(added)
    try:
      yield
    finally:
      for key in added:
        self.leaf_paths.pop(key, None)


class DependenceUnknown(Exception):
  """A discovery run under no derivative met a kernel at the loss's top level
  that is no parameter leaf: only a run under one tells whether it depends
  on the parameters (`kd.value_and_grad` discovers once more that way)."""


def independent_of_parameters(trace: Trace, kernel: Any) -> bool:
  """Whether a layer at the loss's top level (in no transform of its own)
  uses a kernel that does not depend on the parameters: a value made outside
  the loss (a constant, or a tracer of a transformation around it), or, under
  a derivative in the parameters (`Trace.differentiated`), any value that is
  no tracer of it (another argument of the loss, a `stop_gradient`). Such a
  layer (a frozen backbone, a target network) has no gradient of its own and
  runs untagged."""
  if trace.path_of(kernel) is not None or _compat.current_trace() is not trace.top:
    return False
  if not _compat.traced_by(kernel, trace.top):
    return True
  if not trace.differentiated:
    raise DependenceUnknown
  return False


def current() -> Trace | None:
  stack = getattr(_STACK, "stack", None)
  return stack[-1] if stack else None


def tagging() -> Trace | None:
  """The active trace if the tags take part in it (discover, capture), else
  None: in a curvature trace the tags are the plain layers they are outside."""
  trace = current()
  return None if trace is None or trace.mode == CURVATURE else trace


def record_uncaptured(where: str, kind: str, reason: str) -> None:
  """Notes, in a discovering trace, a layer left uncaptured (see `Trace`)."""
  trace = current()
  if trace is not None and trace.mode == DISCOVER:
    trace.uncaptured.setdefault(where, (kind, reason))


@contextlib.contextmanager
def active(trace: Trace):
  stack = getattr(_STACK, "stack", None)
  if stack is None:
    stack = _STACK.stack = []
  stack.append(trace)
  try:
    yield trace
  finally:
    stack.pop()


@dataclasses.dataclass
class RegisteredLoss:
  """A loss declared through `kd.losses`: its value, how to resample it, and
  its input and output Hessian (the exact curvature products)."""

  name: str
  value: Any                          # mean loss on the true targets (`weighted`)
  num_examples: Any                   # n, the denominator of the mean
  sampled_loss: Callable[[Any], Any]  # rng -> mean loss on sampled targets
  inputs: Any = None                  # the loss's input (logits / predictions)
  # w_x per example: the mask times the output Hessian's scale (a target
  # distribution's sum Σt); None: 1 for every example
  weights: Any = None
  # (inputs, u, w) -> uᵀ H w per example (the last axis contracted), H the
  # Hessian of the per-example loss in its input, in closed form.
  output_hessian: Callable[[Any, Any, Any], Any] | None = None
  # n as a Python number where tracing knows it (no mask: every example).
  static_num_examples: int | None = None
  # the mean before the share weight and the offset (`weighted`), and that
  # weight (None: none): the statistics are unweighted by it, or with several
  # losses each seeded with it.
  unweighted: Any = None
  share: Any = None


def offset_of(trace: Trace) -> Any:
  """The zero the next registered loss adds to its value (`Trace.loss_offset`;
  None: none); a constant zero past the offsets given (the caller, which
  sized them before it knew how many losses run, then counts them)."""
  offset = trace.loss_offset
  if offset is None or jnp.ndim(offset) == 0:
    return offset
  if len(trace.losses) >= offset.shape[0]:
    return jnp.zeros([], offset.dtype)
  return offset[len(trace.losses)]


class LossCountChanged(Exception):
  """The loss function registered `count` losses, not the number of offsets
  it was given: the caller traces it again with `count`."""

  def __init__(self, count: int):
    super().__init__(count)
    self.count = count


def denominator(n: Any) -> Any:
  """What a registered loss's mean over `n` examples divides by: `n` itself,
  also for mask weights summing below 1, and 1 for an empty batch (sum 0)."""
  return jnp.where(n > 0, n, jnp.ones_like(n))


def weighted(value: Any, n: Any) -> tuple[Any, Any]:
  """`(value, weight)`: a mean `value` over `n` masked examples as the active
  trace weighs it (`Trace.loss_weight`), and that weight (None: none, the
  value as it is); its `n` recorded in `Trace.counts`."""
  trace = current()
  if trace is None:
    return value, None
  trace.counts.append(n)
  if trace.loss_weight is None:
    return value, None
  weight = trace.loss_weight(n, len(trace.counts) - 1)
  return value * weight.astype(value.dtype), weight


def run_plain(fun: Callable, params, args: tuple, kwargs: dict,
              loss_weight: Callable[[Any, int], Any] | None = None,
              loss_offset: Any = None) -> tuple[Any, Trace]:
  """`fun(params, *args, **kwargs)` in a curvature trace (the tags plain
  layers) whose masked means are weighted by `loss_weight`, the registered
  losses' values plus `loss_offset` (zeros: see `Trace`; None: none), and the
  trace."""
  trace = Trace(mode=CURVATURE, leaf_paths={}, loss_weight=loss_weight,
                top=_compat.current_trace(), loss_offset=loss_offset)
  with active(trace):
    out = fun(params, *args, **kwargs)
  registered(trace)
  return out, trace


def registered(trace: Trace) -> list[RegisteredLoss]:
  """The losses registered during `trace`, in the order they ran (an error
  for none). Several (a multi-task model's heads, a policy and a value head)
  add their curvatures, each times the returned value's derivative in it."""
  if not trace.losses:
    raise ValueError(
        "The loss function registered no loss: compute it with kd.losses."
        "softmax_cross_entropy, sigmoid_cross_entropy, squared_error, gaussian_nll or "
        "poisson_nll so that K-FAC knows the number of examples and the predictive "
        "distribution (a KL to soft targets is softmax_cross_entropy on them; a loss "
        "none fits, a flow's or an energy model's: docs/concepts.md, 'Terms besides "
        "the registered loss').")
  return list(trace.losses)
