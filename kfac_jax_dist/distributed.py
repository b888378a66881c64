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
`("data", "model")`, parameters sharded over "model" as `param_specs` says):
every model shard preconditions its local shard with its own state, and the
strategy above runs over `axis` within each model shard (see
`tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist import _compat
from kfac_jax_dist import uneven

FACTOR_REDUCTIONS = ("all_reduce", "reduce_scatter", "local")
GRADIENT_REDUCTIONS = ("none", "all_reduce", "reduce_scatter")


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
    comm_dtype: dtype of the factor traffic; None: the factors' own. Below 32
      bits it warns: 16-bit factor traffic can lose small eigenvalues
      (decompositions stay in float32).
    model_axis: a second mesh axis over which the parameters are sharded
      (tensor parallelism; None: none). Each model shard then preconditions
      its local shard with its own state, the strategy above running over
      `axis`. Needs `param_specs`; must differ from `axis`.
    param_specs: with `model_axis`, the `PartitionSpec` of every parameter (a
      pytree like the parameters, or a prefix of it); each shards at most one
      dimension, over `model_axis` only. None without `model_axis`.
  """

  mesh: jax.sharding.Mesh
  axis: str = "data"
  grad_worker_fraction: float = 1.0
  factor_reduction: str = "reduce_scatter"
  gradient_reduction: str = "none"
  symmetric_comm: bool = True
  comm_dtype: Any = None
  model_axis: str | None = None
  param_specs: Any = dataclasses.field(default=None, hash=False)

  def __post_init__(self):
    if self.axis not in self.mesh.axis_names:
      raise ValueError(f"Distribution: axis {self.axis!r} is not an axis of the mesh "
                       f"{dict(self.mesh.shape)}.")
    if self.model_axis is not None or self.param_specs is not None:
      from kfac_jax_dist import tensor_parallel  # pylint: disable=import-outside-toplevel
      tensor_parallel.check_distribution(self)
    if self.factor_reduction not in FACTOR_REDUCTIONS:
      raise ValueError(f"factor_reduction must be one of {FACTOR_REDUCTIONS}, got "
                       f"{self.factor_reduction!r}")
    if self.gradient_reduction not in GRADIENT_REDUCTIONS:
      raise ValueError(f"gradient_reduction must be one of {GRADIENT_REDUCTIONS}, got "
                       f"{self.gradient_reduction!r}")
    workers = self.grad_worker_fraction * self.num_devices
    if (not 0 < self.grad_worker_fraction <= 1 or abs(workers - round(workers)) > 1e-6
        or self.num_devices % round(workers)):
      raise ValueError(
          f"grad_worker_fraction={self.grad_worker_fraction} on an axis of "
          f"{self.num_devices} devices gives {workers:g} gradient workers per layer; it "
          f"must be an integer dividing {self.num_devices} (e.g. 1/{self.num_devices} "
          "for MEM-OPT, 1 for COMM-OPT).")
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
  def model_size(self) -> int:
    """Devices of the tensor-parallel axis (1 without one)."""
    return 1 if self.model_axis is None else int(self.mesh.shape[self.model_axis])


class Collectives:
  """The collectives of one layout over one mesh axis; identities without a
  `Distribution` (one device, no `shard_map`).

  With a `Distribution` (even of one device) they must run inside `shard_map`
  over its axis; their results are typed varying or invariant over the axis as
  `partition_specs` declares the state.
  """

  def __init__(self, distribution: Distribution | None):
    self.dist = distribution
    self.num_devices = 1 if distribution is None else distribution.num_devices
    self.group_size = 1 if distribution is None else distribution.group_size
    self.num_groups = self.num_devices // self.group_size
    # Axes over which per-device results vary: the data axis, and the
    # tensor-parallel axis (every model shard has its own state) if any.
    self.varying = () if distribution is None else tuple(
        a for a in (distribution.axis, distribution.model_axis) if a is not None)

  @property
  def active(self) -> bool:
    return self.dist is not None

  def device_index(self) -> jax.Array:
    if not self.active:
      return jnp.zeros([], jnp.int32)
    try:
      return jax.lax.axis_index(self.dist.axis)
    except NameError as e:
      raise ValueError(
          f"This K-FAC state is distributed over mesh axis {self.dist.axis!r} "
          f"({self.num_devices} devices): call update inside jax.shard_map over that "
          "axis, with in_specs/out_specs from kd.partition_specs(opt_state).") from e

  def per_device(self, make):
    """`make(device)` on each device: devices own different work, so with P > 1
    this is a `lax.switch` on the device index (each device's code appears in
    one branch only); results are typed varying over the axis."""
    if self.num_devices == 1:
      return make(0)
    varying = self.varying
    branches = [functools.partial(lambda d: _compat.as_varying(make(d), varying), d)
                for d in range(self.num_devices)]
    return jax.lax.switch(self.device_index(), branches)

  def group_index(self) -> jax.Array:
    return self.device_index() // self.group_size

  def _within_groups(self):
    """Axis index groups of the m consecutive devices of each owner group."""
    m = self.group_size
    return [list(range(g * m, (g + 1) * m)) for g in range(self.num_groups)]

  def _gather_within_group(self, x: jax.Array) -> jax.Array:
    """`[k, ...]` per device → its group's `[m·k, ...]`; with one group the
    result is typed invariant over the axis."""
    if self.num_groups == 1:
      return _compat.all_gather_invariant(x, self.dist.axis, tiled=True)
    if self.group_size == 1:
      return x
    return jax.lax.all_gather(x, self.dist.axis, axis_index_groups=self._within_groups(),
                              tiled=True)

  def _traffic(self, x: jax.Array) -> jax.Array:
    return x if self.dist.comm_dtype is None else x.astype(self.dist.comm_dtype)

  def reduce_factors(self, segments: jax.Array, length: int) -> jax.Array:
    """Per-device statistics laid out as the running factors, `[P·length]` →
    this device's `[length]`: averaged over the devices ("reduce_scatter"; tight
    chunks), or its own local ones ("local", DP-KFAC; its owner segment)."""
    if not self.active:
      return segments
    if self.dist.factor_reduction == "local":
      return jax.lax.dynamic_slice_in_dim(segments, self.device_index() * length, length)
    summed = jax.lax.psum_scatter(self._traffic(segments), self.dist.axis,
                                  scatter_dimension=0, tiled=True)
    return summed.astype(segments.dtype) / self.num_devices

  def all_reduce_factors(self, flat: jax.Array) -> jax.Array:
    """KAISA's factor all-reduce: every factor, once, averaged over the devices."""
    if not self.active:
      return flat
    return jax.lax.psum(self._traffic(flat), self.dist.axis).astype(flat.dtype) / (
        self.num_devices)

  def gather_group(self, tree):
    """Owned slots `[c, ...]` → the owner group's slots `[m·c, ...]`."""
    if not self.active:
      return tree
    return jax.tree_util.tree_map(self._gather_within_group, tree)

  def all_gather_owned(self, x):
    """Per-device `[c, ...]` → every device's, `[P·c, ...]`."""
    if not self.active:
      return x
    return jax.tree_util.tree_map(
        lambda v: _compat.all_gather_invariant(v, self.dist.axis, tiled=True), x)

  def mean(self, tree):
    if not self.active:
      return tree
    return jax.tree_util.tree_map(lambda x: jax.lax.pmean(x, self.dist.axis), tree)

  def gather_uneven(self, segment: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """Every device's `[L]` segment, of which device `i` uses the first
    `sizes[i]` numbers (the rest are zeros), → every device's used numbers,
    `[sizes[i]]` each, on every device, without padded traffic (see
    `uneven`)."""
    if not self.active:
      return [segment[:sizes[0]]]
    return uneven.gather(segment, sizes, self.dist.axis, self.device_index())

  def reduce_uneven(self, segments: Sequence[jax.Array], length: int) -> jax.Array:
    """This device's contribution to every device's segment (`segments[i]`,
    unpadded) → this device's `[length]` (zeros past its own size), averaged
    over the devices: the mirror of `gather_uneven`."""
    if not self.active:
      return jnp.pad(segments[0], (0, length - segments[0].shape[0]))
    return uneven.reduce_scatter(segments, length, self.dist.axis,
                                 self.device_index()) / self.num_devices

  def reduce_scatter_groups(self, buffer: jax.Array) -> jax.Array:
    """Per-device `[G·S]` (group-major) → the device's group segment `[S]`,
    averaged over the devices: `psum_scatter`, then `all_gather` in the group."""
    if not self.active:
      return buffer
    piece = jax.lax.psum_scatter(buffer, self.dist.axis, scatter_dimension=0,
                                 tiled=True) / self.num_devices
    return self._gather_within_group(piece)

  def gather_groups(self, buffer: jax.Array) -> jax.Array:
    """Each group's `[S]` → `[G, S]` on every device. Device `r` of a group
    sends the r-th of m pieces, so one all_gather over the whole axis moves each
    group's buffer once (as KAISA's receivers get it from m workers)."""
    if self.num_groups == 1:
      return buffer[None]
    m, size = self.group_size, buffer.shape[0]
    piece = jax.lax.dynamic_slice_in_dim(
        buffer, (self.device_index() % m) * (size // m), size // m)
    gathered = _compat.all_gather_invariant(piece, self.dist.axis, tiled=True)
    return gathered.reshape(self.num_groups, size)


def partition_specs(opt_state: Any) -> Any:
  """A `PartitionSpec` for every leaf of an optax state holding K-FAC or
  Shampoo states.

  Running factors are sharded over the distribution's axis (each device holds
  its slots; see `layout`); the second-order state too, unless there is a
  single owner group (COMM-OPT), where it is replicated. Shampoo's statistics
  and roots likewise (`shampoo.state_specs`). Every other leaf — counters, and
  the states of other transforms, e.g. momentum — is replicated (`P()`). Use the result as
  `shard_map` in_specs/out_specs and with `shard_state`.

  With a tensor-parallel `Distribution` (`model_axis`), each array leaf of a
  K-FAC / Shampoo state gets the model axis prepended on its first axis (see
  `tensor_parallel`), and the states of other transforms that are shaped like
  the parameters (e.g. momentum) get the `param_specs`.
  """
  from kfac_jax_dist.kfac import ScaleByKfacState  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.shampoo import ScaleByShampooState, state_specs  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist import tensor_parallel  # pylint: disable=import-outside-toplevel
  replicated = jax.sharding.PartitionSpec()
  states = (ScaleByKfacState, ScaleByShampooState, tensor_parallel.ModelShardedState)
  sharding = tensor_parallel.find_sharding(opt_state)

  def spec(node):
    if isinstance(node, ScaleByShampooState):
      return state_specs(node)
    if not isinstance(node, ScaleByKfacState):
      return replicated
    axis = node.layout.axis
    sharded = replicated if axis is None else jax.sharding.PartitionSpec(axis)
    refresh = node.refresh
    if refresh is not None:      # per-factor schedule replicated, X₋₁, X₋₂ as factors
      refresh = jax.tree_util.tree_map(lambda _: replicated, refresh)
      refresh = dataclasses.replace(refresh, last=sharded, before_last=sharded)
    return dataclasses.replace(
        node, count=replicated, factor_weight=replicated, update_factors=replicated,
        skipped=replicated,
        factors=sharded,
        second_order=replicated if node.layout.num_groups == 1 else sharded,
        refresh=refresh)

  def node_spec(node):
    if isinstance(node, tensor_parallel.ModelShardedState):
      return tensor_parallel.inner_specs(node, partition_specs(node.inner))
    if sharding is not None and sharding.matches(node):
      return sharding.param_specs()
    return spec(node)

  return jax.tree_util.tree_map(
      node_spec, opt_state, is_leaf=lambda x: isinstance(x, states) or (
          sharding is not None and sharding.matches(x)))


def shard_state(opt_state: Any, mesh: jax.sharding.Mesh) -> Any:
  """Places a global optax state (e.g. fresh from `tx.init`) on `mesh` with the
  specs of `partition_specs`."""
  specs = partition_specs(opt_state)
  return jax.tree_util.tree_map(
      lambda s, x: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)), specs,
      opt_state)
