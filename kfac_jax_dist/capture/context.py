"""The tracing context shared by tags, registered losses and the capture.

`kd.value_and_grad` traces the user's loss function twice: once abstractly to
*discover* the tagged layers (their names, kinds and the parameter leaves they
use), then for real to *capture* gradients and curvature statistics. Tags and
registered losses find the active trace through this module. Outside a trace
they are plain functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable

_STACK = threading.local()


@dataclasses.dataclass
class Trace:
  """What the tags and losses record or read during one trace of the loss."""

  mode: str                                   # "discover" | "capture"
  leaf_paths: dict[int, str]                  # id(param leaf tracer) -> path
  layers: list = dataclasses.field(default_factory=list)      # discover
  probes: dict = dataclasses.field(default_factory=dict)      # capture: name -> probes
  compute_stats: Any = None                   # capture: traced bool
  losses: list = dataclasses.field(default_factory=list)      # registered losses
  seen: set = dataclasses.field(default_factory=set)
  leaf_shapes: dict = dataclasses.field(default_factory=dict)  # path -> shape
  # Stacked layers (see `stacking`): discover: name -> how the capture hands
  # them their probes; capture: the names whose probes come that way.
  carriers: dict = dataclasses.field(default_factory=dict)
  seen_blocks: set = dataclasses.field(default_factory=set)    # (name, index)
  # discover: name -> the dtype of the layer's statistics (`statistics_dtype`).
  stats_dtypes: dict = dataclasses.field(default_factory=dict)

  def path_of(self, leaf) -> str | None:
    return None if leaf is None else self.leaf_paths.get(id(leaf))


def current() -> Trace | None:
  stack = getattr(_STACK, "stack", None)
  return stack[-1] if stack else None


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
  """A loss declared through `kd.losses`: its value and how to resample it."""

  name: str
  value: Any                          # mean loss on the true targets
  num_examples: Any                   # n, the denominator of the mean
  sampled_loss: Callable[[Any], Any]  # rng -> mean loss on sampled targets
