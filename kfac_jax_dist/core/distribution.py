"""`kd.Distribution`: which devices own which factors, and how data travels.

A data axis of size P is viewed as `P/m` owner groups of `m` gradient workers
each, `m = grad_worker_fraction · P` (KAISA §4.3): every layer belongs to one
group; the group's `m` devices share its eigendecompositions and then all hold
its second-order state, and precondition its gradients.

| grad_worker_fraction | name (KAISA) | second-order state | extra per-step traffic |
|---|---|---|---|
| 1      | COMM-OPT   | replicated              | none                         |
| 1/P    | MEM-OPT    | sharded over P          | all_gather of preconditioned |
| between| HYBRID-OPT | sharded over P/m groups | all_gather across groups     |

`factor_reduction` chooses how the per-device statistics reach the factors'
owners: "all_reduce" (`psum`, as KAISA), "reduce_scatter" (`psum_scatter`: each
device receives only the factors it owns; exact, about half the bytes) or
"local" (DP-KFAC, Zhang et al.: an owner builds its factors from its own local
batch; no factor traffic). `gradient_reduction` says whether the caller already
averaged the gradients ("none"), or `update` should: "all_reduce", or
"reduce_scatter" (SP-NGD, Osawa et al.: raw gradients are reduce-scattered to
their owners, preconditioned there and all-gathered). `symmetric_comm` sends
only the upper triangle of each factor (Ueno et al.; KAISA §5.4.1);
`comm_dtype` casts factor traffic (the papers found 16-bit floats lose small
eigenvalues: decompositions stay in float32).

`model_axis` and `param_specs` add a tensor-parallel axis (a 2-D mesh
`("data", "model")`, parameters sharded over "model" as `param_specs` says),
or several (a 3-D mesh `("data", "model", "stage")`): every model shard
preconditions its local shard with its own state, and the strategy above
runs over `axis` within each model shard (see `tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp

from kfac_jax_dist.core import cadence, settings
from kfac_jax_dist.core import tensor_parallel

# `Distribution.auto`'s chooser: the K-FAC stage registers its cost model
# (`kfac.cost.auto_distribution`), so that the core imports no later stage.
_AUTO: list[Callable[..., "Distribution"]] = []


def register_auto(choose: Callable[..., "Distribution"]) -> None:
  """Makes `Distribution.auto(...)` return `choose(...)`."""
  _AUTO[:] = [choose]


FactorReduction = Literal["all_reduce", "reduce_scatter", "local"]
GradientReduction = Literal["none", "all_reduce", "reduce_scatter"]
FACTOR_REDUCTIONS: tuple[FactorReduction, ...] = ("all_reduce", "reduce_scatter", "local")
GRADIENT_REDUCTIONS: tuple[GradientReduction, ...] = ("none", "all_reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Distribution:
  """How K-FAC's (or Shampoo's) state and work are spread over one mesh axis.

  The `P` devices of `axis` form `P/m` owner groups of `m` consecutive
  devices (`m = grad_worker_fraction · P`, KAISA §4.3). Every layer belongs to
  one group: the group's devices decompose its factors, hold its second-order
  state and precondition its gradient. Validated on construction (a
  `ValueError` names the field). Properties: `num_devices` (`P`),
  `group_size` (`m`), `num_groups` (`P/m`), `model_size` (devices of
  `model_axis`, 1 without one). Shampoo uses `mesh`, `axis`,
  `grad_worker_fraction`, `gradient_reduction`, `model_axis` and
  `param_specs`.

  Attributes:
    mesh: the `jax.sharding.Mesh` the training step runs on (in `shard_map`).
    axis: the name of the mesh axis of the `P` data-parallel devices.
    grad_worker_fraction: `m/P`, with `m` an integer dividing `P`. 1.0
      (default): COMM-OPT, the second-order state replicated, no extra
      per-step traffic, eigenbases all-gathered on inverse steps; `1/P`:
      MEM-OPT, the state sharded `P` ways, the preconditioned gradients
      all-gathered every step; between: HYBRID-OPT.
    factor_reduction: how the per-device statistics reach the factors' owners:
      "reduce_scatter" (default: each owner receives only its factors; exact),
      "all_reduce" (KAISA: every factor to every device, about twice the
      bytes) or "local" (DP-KFAC: each owner's factors from its own local
      batch; no factor traffic, an approximation).
    gradient_reduction: "none" (default: the caller averages the gradients,
      e.g. with `lax.pmean`, before `update`), "all_reduce" (`update` averages
      them) or "reduce_scatter" (SP-NGD: the raw local gradients are
      reduce-scattered to their owners and come back preconditioned; about
      the bytes of SGD's all-reduce).
    symmetric_comm: store and send the factors as upper triangles (default
      True: about half the factor bytes and memory).
    comm_dtype: dtype of the factor traffic; None: the factors' own. Each
      device sends its share `x / P` of the mean, so the sum stays in the
      narrow type's range. Below 32 bits it warns: 16-bit factor traffic can
      lose small eigenvalues (decompositions stay in float32).
    model_axis: a second mesh axis over which the parameters are sharded
      (tensor parallelism; None: none), or a tuple of axes (a 3-D mesh, e.g.
      `("model", "stage")`: operator and pipeline parallelism). Each model
      shard then preconditions its local shard with its own state, the
      strategy above running over `axis`. Needs `param_specs`; must not
      include `axis`.
    param_specs: with `model_axis`, the `PartitionSpec` of every parameter (a
      pytree like the parameters, or a prefix of it), over the model axes
      only; each axis shards at most one dimension. None without
      `model_axis`.
    explanation: why `Distribution.auto` chose this strategy (lines of text;
      not compared or hashed).
  """

  mesh: jax.sharding.Mesh
  axis: str = "data"
  grad_worker_fraction: float = 1.0
  factor_reduction: FactorReduction = "reduce_scatter"
  gradient_reduction: GradientReduction = "none"
  symmetric_comm: bool = True
  comm_dtype: Any = None
  model_axis: str | tuple[str, ...] | None = None
  param_specs: Any = dataclasses.field(default=None, hash=False)
  explanation: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)

  @classmethod
  def auto(cls, mesh: jax.sharding.Mesh, axis: str, layers: Any, *,
           memory_budget: float | None = None, factor_update_every: int = 10,
           inverse_update_every: int = 100, **options: Any) -> Distribution:
    """The strategy (grad_worker_fraction, factor_reduction, gradient_reduction;
    the transform then picks the factor storage) with the fewest bytes per
    step at this cadence among those whose K-FAC state fits `memory_budget`
    bytes per device, by the library's cost model (`kfac.cost`). The choice
    and the runner-up are in `explanation`, and `kd.describe` prints them.
    `layers`: `grad_fn.discover(...)`; `options`: the ones you will pass
    kd.kfac that change its state or traffic (`method`, `max_factor_dim`,
    `skip`, `factor_dtype`, `second_order_dtype`, `stale_threshold`,
    `eigenvalue_correction`) and
    this class's `symmetric_comm`, `comm_dtype` (kept in the result). With
    `stale_threshold`, `factor_update_every` is the mean number of steps
    between a factor's refreshes and `inverse_update_every` between steps that
    refresh any factor. With `gradient_reduction="reduce_scatter"` the step
    passes its local gradients to `update` (no `pmean`)."""
    return _AUTO[0](mesh, axis, layers, memory_budget=memory_budget,
                    factor_update_every=factor_update_every,
                    inverse_update_every=inverse_update_every, **options)

  def __post_init__(self):
    if not isinstance(self.mesh, jax.sharding.Mesh):
      raise TypeError(f"Distribution: mesh must be a jax.sharding.Mesh (e.g. "
                      f"jax.make_mesh((8,), ('data',))), got {type(self.mesh).__name__}")
    if isinstance(self.axis, (tuple, list)) and len(self.axis) == 1:
      raise ValueError(f"Distribution: axis takes a mesh axis name, a str: "
                       f"axis={self.axis[0]!r}, not {tuple(self.axis)!r}.")
    if isinstance(self.axis, (tuple, list)) and all(a in self.mesh.axis_names
                                                    for a in self.axis):
      raise ValueError(
          f"Distribution: axis={tuple(self.axis)!r} names several mesh axes; it takes "
          "one, the axis the optimizer state is spread over. For a batch split over "
          "several (sequence / context parallelism) give the data axis and average "
          "the gradients and kfac_stats over the others in the step (docs/"
          "distributed.md, 'Several batch axes').")
    if self.axis not in self.mesh.axis_names:
      raise ValueError(f"Distribution: axis {self.axis!r} is not an axis of the mesh "
                       f"{dict(self.mesh.shape)}.")
    if isinstance(self.model_axis, list):
      object.__setattr__(self, "model_axis", tuple(self.model_axis))
    if self.model_axis is not None or self.param_specs is not None:
      tensor_parallel.check_distribution(self)
    if self.factor_reduction not in FACTOR_REDUCTIONS:
      raise ValueError(f"factor_reduction must be one of {FACTOR_REDUCTIONS}, got "
                       f"{self.factor_reduction!r}")
    if self.gradient_reduction not in GRADIENT_REDUCTIONS:
      raise ValueError(f"gradient_reduction must be one of {GRADIENT_REDUCTIONS}, got "
                       f"{self.gradient_reduction!r}")
    if not (cadence.is_number(self.grad_worker_fraction)
            and math.isfinite(self.grad_worker_fraction)):
      raise TypeError(f"grad_worker_fraction must be a finite number (m/P, e.g. 1/"
                      f"{self.num_devices} or 1.0), got {self.grad_worker_fraction!r}")
    workers = self.grad_worker_fraction * self.num_devices
    if (not 0 < self.grad_worker_fraction <= 1 or abs(workers - round(workers)) > 1e-6
        or self.num_devices % round(workers)):
      raise ValueError(
          f"grad_worker_fraction={self.grad_worker_fraction} on an axis of "
          f"{self.num_devices} devices gives {workers:g} gradient workers per layer; it "
          f"must be an integer dividing {self.num_devices} (e.g. 1/{self.num_devices} "
          "for MEM-OPT, 1 for COMM-OPT).")
    settings.check_floating_dtype("comm_dtype", self.comm_dtype)
    if self.comm_dtype is not None and jnp.finfo(self.comm_dtype).bits < 32:
      warnings.warn("comm_dtype below 32 bits: the K-FAC papers found that 16-bit "
                    "factor communication can lose small eigenvalues.", stacklevel=3)

  @property
  def num_devices(self) -> int:
    return int(self.mesh.shape[self.axis])

  @property
  def group_size(self) -> int:
    """`m`, the gradient workers of each layer."""
    return int(round(self.grad_worker_fraction * self.num_devices))

  @property
  def num_groups(self) -> int:
    return self.num_devices // self.group_size

  @property
  def model_axes(self) -> tuple[str, ...]:
    """The tensor-parallel axes, as a tuple (`()` without any)."""
    if self.model_axis is None:
      return ()
    return self.model_axis if isinstance(self.model_axis, tuple) else (self.model_axis,)

  @property
  def model_size(self) -> int:
    """Model shards: devices of the tensor-parallel axes (1 without any)."""
    return math.prod(int(self.mesh.shape[a]) for a in self.model_axes)

  def check_params(self, params: Any) -> None:
    """Raises a ValueError naming the parameter where `param_specs` does not
    fit `params` (structure, rank, axes, divisibility), as `init` does."""
    if self.model_axes:
      tensor_parallel.ModelSharding.of(params, self)
