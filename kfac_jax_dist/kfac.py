"""K-FAC as an optax transform: running factors, cadence, preconditioning, KL clip.

`scale_by_kfac` replaces each tagged layer's gradient `∇` (kernel rows, bias as
the last row, shape `(d_A, d_G)`) by `(A ⊗ G + γ I)⁻¹ vec(∇)` (method "eigen",
KAISA §4.1) or by its π-damped factored form (method "inverse"); see `linalg`.
Parameters of no tagged layer pass through unchanged.

Running factors (KAISA Eq. 2.10 with `factor_decay` = the weight of the *old*
value): with `w` the total weight so far,

    w' = decay·w + (1 − decay),   F' = (decay·w·F + (1 − decay)·F_batch) / w',

so the first update gives exactly the first batch's statistics.

Cadence: with `count` the number of updates so far (from 0), factors are
updated when `count % factor_update_every == 0`, the eigenbases/inverses when
`count % inverse_update_every == 0`, both via `lax.cond`. Step 0 therefore
already preconditions. Intervals and damping may be optax schedules of `count`.

KL clip (KAISA Eq. 5.1): `ν = min(1, sqrt(κ / (η² Σ_l |⟨V_l, ∇_l⟩|)))` scales
every preconditioned gradient; `η` is `learning_rate` (float or schedule).

Faults. A non-finite number (NaN/Inf) in any gradient leaf, or in a statistic
on a factor step (the only steps that read statistics), skips the update: the
returned updates are zeros (as `optax.apply_if_finite` returns) and every
state leaf is unchanged except `skipped`, which counts the skipped steps.
`count` does not advance, so a skipped step is as if it never happened: the
cadence, the schedules of `count` and the next factor step are those of the
accepted steps, and a run with a faulty batch inserted equals, bit for bit,
the run without it. Inside `shard_map` the devices agree by a `psum` of their
local verdicts (one device's NaN skips the step on all): of the statistics'
on factor steps, of the gradients' when they are local (`gradient_reduction`
other than "none", or gradients typed varying over the axis). `kd.kfac` wraps its
chain in `skip_faulty_steps`, which also leaves the momentum untouched.
A decomposition whose input or result is not finite (e.g. a running factor
that overflowed) keeps that factor's previous second-order information, per
factor (for "inverse", both factors of a layer whose π is not finite).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import optax

from kfac_jax_dist import _compat
from kfac_jax_dist import distributed
from kfac_jax_dist import factors as factors_lib
from kfac_jax_dist import layout as layout_lib
from kfac_jax_dist import linalg
from kfac_jax_dist import packing
from kfac_jax_dist import registry
from kfac_jax_dist import stale as stale_lib
from kfac_jax_dist import tensor_parallel

ScalarOrSchedule = Union[float, int, Callable[[jax.Array], Any]]
METHODS = ("eigen", "inverse")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "factor_weight", "update_factors", "factors", "second_order",
                 "skipped", "refresh"],
    meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ScaleByKfacState:
  """State of `scale_by_kfac`, in the flat per-device segments of `layout`.

  Attributes:
    count: number of updates so far (skipped ones, see `skipped`, excluded).
    factor_weight: total weight `w` of the running factor averages.
    update_factors: whether the *next* update refreshes the factors; the capture
      reads it to skip the statistics work on other steps.
    factors: running factors, `[P·C]` (tight chunks) or `[P·L]` (owner
      segments), see `layout`; device i holds the i-th part.
    second_order: eigenbases and eigenvalues ("eigen") or damped inverses
      ("inverse"), `[P·L₂]` per owner group member (see `layout`).
    skipped: number of updates skipped for a non-finite gradient or statistic
      (not counted in `count`).
    layout: static placement of every layer's factors.
    refresh: per-factor refresh schedule with stale statistics (`stale`),
      else None.
  """

  count: jax.Array
  factor_weight: jax.Array
  update_factors: jax.Array
  factors: jax.Array
  second_order: jax.Array
  skipped: jax.Array
  layout: layout_lib.Layout
  refresh: stale_lib.RefreshState | None = None


def global_second_order(lay: layout_lib.Layout, segments: Sequence[jax.Array],
                        xp=jnp) -> jax.Array:
  """The global second-order array from each owner's `[L₂]` segment: `[P·L₂]`
  (replicated, one owner group), or device after device its group's `m`
  segments, `[P·m·L₂]` (sharded)."""
  if lay.num_groups == 1:
    return xp.concatenate(segments)
  m = lay.group_size
  return xp.concatenate([segments[j] for i in range(lay.num_devices)
                         for j in range(i // m * m, i // m * m + m)])


def second_order_base(lay: layout_lib.Layout, owner: int) -> int:
  """Start of `owner`'s `[L₂]` segment in the global second-order array (its
  first copy, in its group's first device's part)."""
  m = lay.group_size
  return ((owner // m) * m * m + owner % m) * lay.second_segment


def _at(value: ScalarOrSchedule, count: jax.Array):
  return value(count) if callable(value) else value


def is_factor_step(every: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  return jnp.asarray(count % jnp.asarray(_at(every, count), count.dtype) == 0)


def find_states(tree: Any) -> list[ScaleByKfacState]:
  """Every `ScaleByKfacState` inside an optax state tree."""
  leaves = jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, ScaleByKfacState))
  return [x for x in leaves if isinstance(x, ScaleByKfacState)]


def running_factors(state: ScaleByKfacState) -> dict[str, dict[str, jax.Array]]:
  """`{layer: {"A": A, "G": G}}` (`{"F": F}`, `[C, 3]`, for a unit-wise layer)
  of a global (not per-device) state; diagonal factors come back as their
  diagonal."""
  lay = state.layout
  out = {}
  for plan in lay.plans:
    out[plan.layer.name] = {}
    for which, place in plan.places:
      start = lay.factor_start(place)
      flat = state.factors[start:start + place.size]
      flat = flat.astype(jnp.promote_types(flat.dtype, jnp.float32))
      if place.form == factors_lib.DIAG:
        value = flat
      elif place.form == factors_lib.UNIT:
        value = flat.reshape(place.dim, 3)
      elif lay.packed:
        value = packing.unpack_upper(flat, place.dim)
      else:
        value = flat.reshape(place.dim, place.dim)
      out[plan.layer.name][which.upper()] = value
  return out


def second_order_parts(state: ScaleByKfacState
                       ) -> dict[str, dict[str, tuple[Any, Any]]]:
  """`{layer: {"A": (matrix, vector), "G": ...}}` of a global (not per-device)
  state: eigenbasis and eigenvalues ("eigen") or damped inverse ("inverse"),
  `None` where a factor has no such part (diagonal and unit-wise factors keep
  only a vector, `[d]` or `[d, 3]`)."""
  lay, second = state.layout, state.second_order
  out = {}
  for plan in lay.plans:
    out[plan.layer.name] = {}
    for which, place in plan.places:
      out[plan.layer.name][which.upper()] = packing.read_parts(
          second, lambda q: second_order_base(lay, q.owner), place)
  return out


def _block(leaf: jax.Array, layer: registry.TaggedLayer) -> jax.Array:
  """The layer's part of a parameter leaf: block `stack_index` of a stacked one."""
  return leaf if layer.stack_index is None else leaf[layer.stack_index]


def _gradient_matrix(plan: layout_lib.LayerPlan, leaves: dict[str, Any]) -> jax.Array:
  layer = plan.layer
  kernel = _block(leaves[layer.kernel_path], layer)
  dtype = jnp.promote_types(kernel.dtype, jnp.float32)
  m = kernel.astype(dtype).reshape(layer.a_dim - layer.has_bias, layer.g_dim)
  if layer.has_bias:
    bias = _block(leaves[layer.bias_path], layer)
    m = jnp.concatenate([m, bias.astype(dtype).reshape(1, -1)], axis=0)
  return m


def _write_back(plan: layout_lib.LayerPlan, m: jax.Array, leaves: dict[str, Any]):
  layer = plan.layer
  rows = layer.a_dim - layer.has_bias
  parts = [(layer.kernel_path, m[:rows])] + (
      [(layer.bias_path, m[rows])] if layer.has_bias else [])
  for path, value in parts:
    leaf = leaves[path]
    if layer.stack_index is None:
      leaves[path] = value.reshape(leaf.shape).astype(leaf.dtype)
    else:
      # One block of a stacked leaf. Every block is written (a stack is skipped
      # whole), block 0 first (layout order), so block 0 starts from zeros: the
      # result then does not inherit the raw gradient's type (local, varying
      # over the mesh axis under SP-NGD's reduce-scatter).
      if not any(layer.stack_index):
        leaf = jnp.zeros(leaf.shape, leaf.dtype)
      block_shape = leaf.shape[len(layer.stack_index):]
      leaves[path] = leaf.at[layer.stack_index].set(
          value.reshape(block_shape).astype(leaf.dtype))


def _is_concrete_false(flag) -> bool:
  """Whether `flag` is a known (not traced) False."""
  return not isinstance(flag, jax.core.Tracer) and not bool(flag)


def _check_stats(layout: layout_lib.Layout, stats: Any, update_flag) -> bool:
  """Validates `kfac_stats` against the layout; returns whether they are used.

  Statistics may be omitted (None) only on a step known, outside `jit`, to
  update no factor; a traced step may be a factor step and needs them.
  """
  if stats is None:
    if _is_concrete_false(update_flag):
      return False
    raise ValueError(
        "scale_by_kfac.update needs the curvature statistics on a factor step (or "
        "under jit, where the step is not known): call tx.update(grads, opt_state, "
        "params, kfac_stats=stats) with the stats returned by kd.value_and_grad.")
  for plan in layout.plans:
    name = plan.layer.stats_name
    if name not in stats:
      raise ValueError(f"kfac_stats has no statistics for tagged layer '{name}' "
                       f"(it has {sorted(stats)}).")
    for which, _ in plan.places:
      if which.upper() not in stats[name]:
        raise ValueError(f"kfac_stats['{name}'] has no statistic {which.upper()!r} "
                         f"(it has {sorted(stats[name])}).")
  return True


def _check_updates(layout: layout_lib.Layout, leaves: dict[str, Any]) -> None:
  """Every tagged layer's parameters are in the updates, with their shapes."""
  for plan in layout.plans:
    layer = plan.layer
    for path, shape in ((layer.kernel_path, layer.kernel_shape),
                        (layer.bias_path, layer.bias_shape or (layer.g_dim,))):
      if path is None:
        continue
      if path not in leaves:
        raise ValueError(f"Tagged layer '{layer.name}': '{path}' is missing "
                         "from the updates given to scale_by_kfac.")
      shape = tuple(layer.stack) + tuple(shape)     # stacked: [L, *block shape]
      if tuple(jnp.shape(leaves[path])) != shape:
        raise ValueError(f"Tagged layer '{layer.name}': the update of '{path}' has "
                         f"shape {jnp.shape(leaves[path])}, expected {tuple(shape)}.")


def _check_placement(layout: layout_lib.Layout, state: "ScaleByKfacState",
                     dist: distributed.Distribution | None, factor_storage: str) -> None:
  """The state was laid out for this transform's distribution, and `update`
  runs where that distribution says (inside `shard_map` over its axis, with
  the per-device parts of `kd.partition_specs`)."""
  want = ((1, 1, None, factor_storage) if dist is None else
          (dist.num_devices, dist.group_size, dist.axis, factor_storage))
  have = (layout.num_devices, layout.group_size, layout.axis, layout.factor_storage)
  if factor_storage == layout_lib.CHUNKED and dist is not None:
    have = have[:3] + (factor_storage,)   # either storage, by bytes (_cheaper_storage)
  if have != want:
    names = ("devices", "gradient workers per layer", "axis", "factor storage")
    diff = ", ".join(f"{n} {h!r} (transform: {w!r})" for n, h, w in zip(names, have, want)
                     if h != w)
    raise ValueError(
        f"This K-FAC state was laid out for another distribution: {diff}. Use the "
        "state of this transform's init, or move it with kd.convert_state(state, "
        "tx.init(params)).")
  if dist is None:
    return
  try:
    size = lax.axis_size(dist.axis)
  except NameError as e:
    raise ValueError(
        f"This K-FAC transform is distributed over mesh axis {dist.axis!r} "
        f"({dist.num_devices} devices): call update inside jax.shard_map over that "
        "axis, with in_specs/out_specs from kd.partition_specs(opt_state).") from e
  if size != dist.num_devices:
    raise ValueError(
        f"update runs in a shard_map whose axis {dist.axis!r} has {size} devices, but "
        f"the Distribution's mesh has {dist.num_devices}: use that mesh.")
  second = layout.second_segment * (layout.num_devices if layout.num_groups == 1
                                    else layout.group_size)
  got = (state.factors.shape, state.second_order.shape)
  if got != ((layout.factor_shard,), (second,)):
    raise ValueError(
        f"Inside shard_map the K-FAC state has per-device factors {got[0]} and "
        f"second-order {got[1]}, expected {(layout.factor_shard,)} and {(second,)}: "
        "give shard_map in_specs/out_specs=kd.partition_specs(opt_state).")


def _traced(tree) -> bool:
  """Whether any leaf of `tree` is a tracer (under jit, eval_shape, grad, ...)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _all_finite(arrays) -> jax.Array:
  """Whether every inexact array of `arrays` is finite (a scalar bool)."""
  checks = [jnp.all(jnp.isfinite(x)) for x in arrays
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _materialise(flag: jax.Array) -> jax.Array:
  """`flag`, computed once. XLA fuses (duplicates) a chain of cheap scalar ops
  into each consumer; the verdict `ok` (an `and` of one check per gradient and
  statistic) has ~35 (the update selects, the cadence conds, the counters), so
  the chain was copied ~35 times (on the autoencoder of benchmarks/vs_kfac_jax.py,
  3/10 of the step's HLO). A `lax.cond` is not fused: its result is one value."""
  axes = _compat.varying_axes(flag)
  return lax.cond(flag, lambda: _compat.as_varying(jnp.asarray(True), axes),
                  lambda: _compat.as_varying(jnp.asarray(False), axes))


def _agree(comm: distributed.Collectives, ok: jax.Array) -> jax.Array:
  """True on every device iff `ok` on every device (a psum of the failures)."""
  if not comm.active:
    return ok
  failures = _compat.as_varying((~ok).astype(jnp.int32), comm.varying)
  return lax.psum(failures, comm.varying) == 0


def _finite_slots(*parts: jax.Array | None) -> jax.Array:
  """`[k]`: whether slot i of every `[k, ...]` part is finite."""
  ok = None
  for part in parts:
    if part is None:
      continue
    finite = jnp.all(jnp.isfinite(part.reshape(part.shape[0], -1)), axis=1)
    ok = finite if ok is None else ok & finite
  return ok


def _keep_failed(new: jax.Array, old: jax.Array, ok: jax.Array) -> jax.Array:
  """Slots `[k, ...]` of `new` where `ok`, else the previous ones, flattened."""
  new = new.reshape(ok.shape[0], -1)
  return jnp.where(ok[:, None], new, old.reshape(new.shape)).reshape(-1)


def _layer_stat(stat: jax.Array, place: layout_lib.FactorPlace, name: str,
                which: str) -> jax.Array:
  expected = {factors_lib.FULL: (place.dim, place.dim), factors_lib.DIAG: (place.dim,),
              factors_lib.UNIT: (place.dim, 3)}[place.form]
  if place.form == factors_lib.DIAG and stat.shape == (place.dim, place.dim):
    return jnp.diagonal(stat)
  if stat.shape != expected:
    raise ValueError(f"Statistic {which} of layer '{name}' has shape {stat.shape}; "
                     f"the optimizer state expects {place.form} factors of dimension "
                     f"{place.dim}.")
  return stat


def _stat_of(stats: dict):
  def value_of(plan, which):
    key, layer = which.upper(), plan.layer
    stat = stats[layer.stats_name][key]
    if layer.stack_index is not None:     # block of a stacked layer's statistics
      if tuple(stat.shape[:len(layer.stack)]) != layer.stack:
        raise ValueError(f"Statistic {key} of stacked layer '{layer.stats_name}' has "
                         f"shape {stat.shape}; expected leading stack axes "
                         f"{layer.stack}.")
      stat = stat[layer.stack_index]
    return _layer_stat(stat, getattr(plan, which), layer.name, key)
  return value_of


def stats_segments(lay: layout_lib.Layout, stats: dict, dtype) -> jax.Array:
  """Per-layer statistics `{name: {"A", "G"}}` laid out as the running factors."""
  return packing.all_segments(lay, _stat_of(stats), dtype)


def _tight_offsets(lay: layout_lib.Layout) -> dict[tuple[str, str], int]:
  """Offsets of every factor in an unpadded buffer of all factors (plan order)."""
  offsets, offset = {}, 0
  for plan in lay.plans:
    for which, place in plan.places:
      offsets[(plan.layer.name, which)] = offset
      offset += place.size
  return offsets


def _piece_rows(plan: layout_lib.LayerPlan) -> tuple[int, int]:
  """The rows of the layer's `(d_A, d_G)` gradient that `plan` (a piece) sends."""
  return plan.rows or (0, plan.layer.a_dim)


def _gradient_offsets(lay: layout_lib.Layout
                      ) -> tuple[dict[tuple[str, int], int], list[int], int]:
  """Offsets of each layer's gradient (its rows, for a piece of a replicated
  layer), by (layer, group), in the group's flat buffer (slot 0 holds the
  group's KL-clip sum over its whole layers; a piece is preceded by one slot
  for its partial ⟨V, ∇⟩), each group's used size, and the buffer size S: the
  largest group's, rounded up to a multiple of m."""
  offsets, sizes = {}, []
  for g in range(lay.num_groups):
    offset = 1
    for plan in lay.group_plans(g):
      lo, hi = _piece_rows(plan)
      offset += plan.rows is not None
      offsets[(plan.layer.name, g)] = offset
      offset += (hi - lo) * plan.layer.g_dim
    sizes.append(offset)
  m = lay.group_size
  return offsets, sizes, -(-max(sizes) // m) * m


def _cheaper_storage(lay: layout_lib.Layout, factor_every, inverse_every) -> str:
  """Chunked or owner storage for a reduce-scatter, whichever sends less.

  Per device, tight chunks cost `(P−1)·C` per factor step plus `(P−1)·C` on
  decomposition steps (the chunks are gathered); owner segments `(P−1)·L` per
  factor step. With `k` factor steps per decomposition step, chunks win when
  `L/C > 1 + 1/k` (schedules: judged at count 0).
  """
  zero = jnp.zeros([], jnp.int32)
  k = max(int(_at(inverse_every, zero)) / max(int(_at(factor_every, zero)), 1), 1.0)
  if lay.segment * k > lay.factor_shard * (k + 1):
    return layout_lib.CHUNKED
  return layout_lib.OWNER


def scale_by_kfac(
    layers: registry.LayerRegistry | None = None,
    *,
    damping: ScalarOrSchedule = 1e-3,
    factor_decay: float = 0.95,
    factor_update_every: ScalarOrSchedule = 1,
    inverse_update_every: ScalarOrSchedule = 1,
    method: str = "eigen",
    kl_clip: ScalarOrSchedule | None = None,
    learning_rate: ScalarOrSchedule | None = None,
    factor_dtype: Any = None,
    skip: Sequence[str] = (),
    max_factor_dim: int | None = None,
    distribution: distributed.Distribution | None = None,
    stale_threshold: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions the gradients of tagged layers with damped K-FAC.

  Args:
    layers: the tagged layers, from `kd.value_and_grad(loss_fn).discover(params,
      batch)`; they fix the state's layout at `init`.
    damping: `γ`, a float or a schedule of the update count.
    factor_decay: weight of the old value in the running factor averages.
    factor_update_every: refresh the factors when `count % this == 0`.
    inverse_update_every: refresh eigenbases/inverses when `count % this == 0`.
    method: "eigen" (exact `(A⊗G + γI)⁻¹`) or "inverse" (π-damped Cholesky).
    kl_clip: `κ` of KAISA's KL clip (None: no clipping); needs `learning_rate`.
    learning_rate: `η` for the KL clip, a float or a schedule.
    factor_dtype: storage dtype of the running factors (default float32);
      decompositions run in float32 at least.
    skip: regular expressions; tagged layers whose name matches one (e.g. a
      vocabulary-sized output layer) pass through unpreconditioned.
    max_factor_dim: factors of larger dimension are kept diagonal (see
      `factors`), so that `A` of a huge layer is never formed.
    distribution: a `kd.Distribution` (strategy over a mesh axis); `update`
      then runs inside `shard_map` over that axis, with per-device statistics
      and gradients. None: one device.
    stale_threshold: α of SP-NGD's stale statistics (§4.3; the paper uses
      0.1): each factor is refreshed (communicated, averaged, decomposed) at
      its own adaptive interval instead of every step (see `stale`). Needs
      `factor_update_every = inverse_update_every = 1` and method "eigen";
      each refreshed factor then travels in its own all-reduce (a fused
      reduce-scatter cannot leave stale factors out). None: off.

  Returns:
    A `GradientTransformationExtraArgs` whose `update` takes `kfac_stats=`.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if isinstance(factor_decay, (int, float)) and not 0.0 <= factor_decay < 1.0:
    raise ValueError(f"factor_decay must be in [0, 1), got {factor_decay}")
  if kl_clip is not None and learning_rate is None:
    raise ValueError("kl_clip needs the learning_rate (KAISA Eq. 5.1 uses η²).")
  if stale_threshold is not None:
    if not (isinstance(factor_update_every, int) and factor_update_every == 1
            and isinstance(inverse_update_every, int) and inverse_update_every == 1):
      raise ValueError("stale_threshold chooses every factor's refresh steps itself: "
                       "leave factor_update_every and inverse_update_every at 1.")
    if method != "eigen":
      raise ValueError('stale_threshold supports method="eigen" only.')
  skip = tuple(skip)
  factor_dtype = jnp.float32 if factor_dtype is None else factor_dtype
  compute_dtype = jnp.promote_types(factor_dtype, jnp.float32)
  comm = distributed.Collectives(distribution)
  reduce_grads = "none" if distribution is None else distribution.gradient_reduction
  # Owners keep their own factors when each builds them itself (DP-KFAC) or
  # receives them all anyway (KAISA's all-reduce); a reduce-scatter leaves
  # tight chunks (see `layout`).
  factor_storage = (layout_lib.OWNER if stale_threshold is not None or (
      distribution is not None and distribution.factor_reduction in ("local", "all_reduce"))
                    else layout_lib.CHUNKED)
  local_factors = distribution is not None and distribution.factor_reduction == "local"
  model_axis = None if distribution is None else distribution.model_axis
  if model_axis is not None and stale_threshold is not None:
    raise ValueError("stale_threshold is not supported with a tensor-parallel "
                     "Distribution (model_axis): each model shard would refresh on "
                     "its own schedule.")
  replicated_paths = set()      # of the updates, set by update_fn

  def vg_weight(plan):
    """A layer replicated over the model axis counts once in the psum'd KL sum."""
    if model_axis is None or plan.layer.kernel_path not in replicated_paths:
      return 1.0
    return 1.0 / distribution.model_size

  def init_fn(params):
    if layers is None:
      raise ValueError(
          "scale_by_kfac needs the tagged layers to lay out its state: pass "
          "layers=kd.value_and_grad(loss_fn).discover(params, batch).")
    leaves = registry.leaves_by_path(params)
    for layer in layers:
      for path, shape in ((layer.kernel_path, layer.kernel_shape),
                          (layer.bias_path, layer.bias_shape or (layer.g_dim,))):
        if path is None:
          continue
        shape = tuple(layer.stack) + tuple(shape)     # stacked: [L, *block shape]
        if path not in leaves:
          raise ValueError(f"Tagged layer '{layer.name}': parameter '{path}' is not in "
                           "the tree given to init.")
        if tuple(jnp.shape(leaves[path])) != tuple(shape):
          raise ValueError(f"Tagged layer '{layer.name}': parameter '{path}' has shape "
                           f"{jnp.shape(leaves[path])}, expected {shape}.")
    lay = layout_lib.build(
        layers, tuple(leaves), skip=skip, max_factor_dim=max_factor_dim,
        num_devices=comm.num_devices, group_size=comm.group_size,
        axis=None if distribution is None else distribution.axis, method=method,
        packed=True if distribution is None else distribution.symmetric_comm,
        factor_storage=factor_storage, replicate_factors=not local_factors,
        replicate_layers=not local_factors and reduce_grads != "reduce_scatter")
    if lay.factor_storage == layout_lib.CHUNKED and lay.num_devices > 1:
      lay = dataclasses.replace(lay, factor_storage=_cheaper_storage(
          lay, factor_update_every, inverse_update_every))
    for pattern in skip:
      if not any(re.search(pattern, n) for n in lay.skipped):
        raise ValueError(f"skip pattern {pattern!r} matches no tagged layer "
                         f"(layers: {list(layers.names())}).")
    # Concrete params: the state is built in numpy and transferred once per
    # array (eager jnp runs, and first compiles, one small program per op:
    # seconds for a few layers). Traced (jit, eval_shape, shard_map): jnp.
    xp = jnp if _traced(params) else np
    factors = packing.all_segments(
        lay, lambda plan, which: packing.identity(getattr(plan, which), factor_dtype, xp),
        factor_dtype, xp)
    second = global_second_order(
        lay, [packing.second_order_segment(lay, d, compute_dtype, xp)
              for d in range(lay.num_devices)], xp)
    state = ScaleByKfacState(
        count=xp.zeros([], jnp.int32),
        factor_weight=xp.zeros([], compute_dtype),
        update_factors=xp.asarray(True),
        factors=factors, second_order=second, skipped=xp.zeros([], jnp.int32),
        layout=lay,
        refresh=None if stale_threshold is None else stale_lib.init(
            lay, factors, compute_dtype, xp))
    return state if xp is jnp else jax.tree_util.tree_map(jnp.asarray, state)

  def all_reduced_factors(lay, stats):
    """KAISA: all-reduce the unpadded buffer of every factor, then each owner
    copies its own factors into its segment."""
    value_of = _stat_of(stats)
    flat = jnp.concatenate([
        packing.pack_factor(value_of(plan, w).astype(compute_dtype), place.form,
                            lay.packed)
        for plan in lay.plans for w, place in plan.places])
    summed, offsets = comm.all_reduce_factors(flat), _tight_offsets(lay)

    def own(device):
      owned = lay.owned(device)
      pieces = [summed[offsets[(p.layer.name, w)]:offsets[(p.layer.name, w)] + place.size]
                for place, p, w in owned]
      return packing.pad_to(pieces, lay.segment, compute_dtype)
    return comm.per_device(own)

  def update_factors(state, stats):
    lay = state.layout
    if distribution is not None and distribution.factor_reduction == "all_reduce":
      batch = all_reduced_factors(lay, stats)
    else:
      batch = comm.reduce_factors(stats_segments(lay, stats, compute_dtype),
                                  lay.factor_shard)
    w = state.factor_weight
    new_w = factor_decay * w + (1.0 - factor_decay)
    mixed = (factor_decay * w * state.factors.astype(compute_dtype)
             + (1.0 - factor_decay) * batch.astype(compute_dtype)) / new_w
    return mixed.astype(factor_dtype), new_w

  def previous_part(previous, batch, offset, size):
    """The batch's `[count, size]` slots at `offset` of the previous segment."""
    return previous[offset:offset + batch.count * size].reshape(batch.count, size)

  def eigen_segment(device, owned, lay, gamma, previous):
    """The device's new `[L₂]` segment; a slot whose factor or decomposition is
    not finite keeps its `previous` eigenbasis and eigenvalues."""
    del gamma
    pieces = []
    for batch in lay.batches[device]:
      running = packing.unpack_batch(owned, batch, lay.packed)
      if batch.form == factors_lib.UNIT:       # closed-form solves later: keep F
        old = previous_part(previous, batch, batch.vector_offset, 3 * batch.dim)
        pieces.append(_keep_failed(running.astype(compute_dtype), old,
                                   _finite_slots(running)))
        continue
      vectors, values = linalg.eigh(running)
      ok = _finite_slots(running, vectors, values)
      lo, hi = batch.columns or (0, batch.dim)       # a split factor keeps its columns
      if vectors is not None:
        old = previous_part(previous, batch, batch.matrix_offset, batch.dim * (hi - lo))
        pieces.append(_keep_failed(vectors[..., lo:hi].astype(compute_dtype), old, ok))
      old = previous_part(previous, batch, batch.vector_offset, hi - lo)
      pieces.append(_keep_failed(values[..., lo:hi].astype(compute_dtype), old, ok))
    return _pad(pieces, lay.second_segment)

  def traces_segment(device, owned, lay):
    pieces = [linalg.mean_traces(packing.unpack_batch(owned, batch, lay.packed))
              for batch in lay.batches[device]]
    return _pad([p.astype(compute_dtype) for p in pieces], lay.max_factors)

  def inverse_segment(device, owned, damping_all, lay, previous):
    """As `eigen_segment`, with damped inverses (a non-finite damping, from a
    non-finite trace of either factor of the layer, keeps both inverses)."""
    pieces = []
    for batch in lay.batches[device]:
      start = device * lay.max_factors + batch.first_index
      damp = damping_all[start:start + batch.count]
      running = packing.unpack_batch(owned, batch, lay.packed)
      if batch.form == factors_lib.UNIT:       # closed-form solves later: keep F
        old = previous_part(previous, batch, batch.vector_offset, 3 * batch.dim)
        pieces.append(_keep_failed(running.astype(compute_dtype), old,
                                   _finite_slots(running)))
        continue
      inv = linalg.damped_inverse(running, damp)
      ok = _finite_slots(running, inv, damp[:, None])
      if batch.matrix_offset is not None:
        lo, hi = batch.columns or (0, batch.dim)     # a split factor keeps its columns
        inv = inv[..., lo:hi]
        old = previous_part(previous, batch, batch.matrix_offset, batch.dim * (hi - lo))
      else:
        old = previous_part(previous, batch, batch.vector_offset, batch.dim)
      pieces.append(_keep_failed(inv.astype(compute_dtype), old, ok))
    return _pad(pieces, lay.second_segment)

  def _pad(pieces, length):
    return packing.pad_to(pieces, length, compute_dtype)

  def decompose(running, lay, gamma, second):
    """New second-order state from the running factors; `second` is the
    current one (this device's part), kept for any factor that fails."""
    def previous_of(d):
      # Device d's own [L₂] segment within its local m·L₂ (P·L₂ with one group).
      start = (d % lay.group_size) * lay.second_segment
      return second[start:start + lay.second_segment]

    if lay.factor_storage == layout_lib.CHUNKED:
      # Every owner needs its whole factors: gather the chunks (decomposition
      # steps only), then each device reads its own, tight, from the buffer.
      # A replica (after the device's home factors) reads its home's copy.
      full, bases = comm.all_gather_owned(running), lay.owner_bases

      def owned_of(d):
        replicas = [full[lay.factor_start(q):lay.factor_start(q) + q.size]
                    for q, _, _ in lay.owned(d) if q.home is not None]
        return jnp.concatenate([full[bases[d]:bases[d] + lay.owner_sizes[d]]] + replicas)
    else:
      def owned_of(d):
        del d
        return running
    if method == "eigen":
      local = comm.per_device(
          lambda d: eigen_segment(d, owned_of(d), lay, gamma, previous_of(d)))
    else:
      # π couples a layer's A and G, which may sit on different devices: share
      # the (scalar) traces of all factors, then damp the owned ones.
      traces = comm.all_gather_owned(
          comm.per_device(lambda d: traces_segment(d, owned_of(d), lay)))
      damping_all = jnp.ones(lay.num_devices * lay.max_factors, compute_dtype)
      for plan in lay.plans:
        if plan.layer.unitwise:
          continue
        ia = plan.a.owner * lay.max_factors + plan.a.index
        ig = plan.g.owner * lay.max_factors + plan.g.index
        d_a, d_g = linalg.pi_adjusted_damping(traces[ia], traces[ig], gamma)
        finite = jnp.isfinite(traces[ia]) & jnp.isfinite(traces[ig])
        d_a, d_g = (jnp.where(finite, x, jnp.nan) for x in (d_a, d_g))
        for piece in plan.pieces:          # every copy of a replicated factor
          for place, value in ((piece.a, d_a), (piece.g, d_g)):
            for q in (place,) + place.copies:
              damping_all = damping_all.at[q.owner * lay.max_factors + q.index].set(value)
      local = comm.per_device(
          lambda d: inverse_segment(d, owned_of(d), damping_all, lay, previous_of(d)))
    return distribute_second(local, lay)

  def distribute_second(local, lay):
    """Each device's new `[L₂]` → the second-order array of its spec."""
    if lay.num_groups == 1 and comm.active:    # every device gets every segment
      rows = comm.gather_uneven(local, lay.second_sizes)
      return jnp.concatenate([jnp.pad(r, (0, lay.second_segment - r.shape[0]))
                              for r in rows])
    return comm.gather_group(local)

  def stale_refresh(state, stats):
    """SP-NGD Algorithm 1: refresh the due factors only (see `stale`)."""
    lay, r, count = state.layout, state.refresh, state.count
    order = stale_lib.factor_order(lay)
    index = {(plan.layer.name, which): f for f, (plan, which, _) in enumerate(order)}
    due = r.next_step <= count                  # the same on every device
    value_of = _stat_of(stats)
    batch = []
    for f, (plan, which, place) in enumerate(order):
      x = packing.pack_factor(value_of(plan, which).astype(compute_dtype), place.form,
                              lay.packed)
      if local_factors:                        # DP-KFAC: the owner's own statistics
        batch.append(x)
      else:                                    # one all-reduce per refreshed factor
        batch.append(lax.cond(due[f], lambda x=x: comm.all_reduce_factors(x),
                              lambda x=x: jnp.zeros(x.shape, x.dtype)))
    weight = jnp.where(due, factor_decay * r.weight + (1.0 - factor_decay), r.weight)

    def owner_update(device):
      pieces, lasts, befores = [], [], []
      bits = jnp.zeros([len(order), 2], jnp.int32)
      for place, plan, which in lay.owned(device):
        f = index[(plan.layer.name, which)]
        span = slice(place.offset, place.offset + place.size)
        old = state.factors[span].astype(compute_dtype)
        new = (factor_decay * r.weight[f] * old + (1.0 - factor_decay) * batch[f]) / (
            weight[f])
        new = jnp.where(due[f], new, old).astype(factor_dtype)
        last, before = r.last[span], r.before_last[span]
        similar = [(r.refreshes[f] >= k) & (stale_lib.relative_change(
            new.astype(compute_dtype), y.astype(compute_dtype), place, lay.packed)
            < stale_threshold) for k, y in ((1, last), (2, before))]
        bits = bits.at[f].set(jnp.stack(similar).astype(jnp.int32))
        pieces.append(new)
        lasts.append(jnp.where(due[f], new, last))
        befores.append(jnp.where(due[f], last, before))
      pad = functools.partial(packing.pad_to, length=lay.segment, dtype=factor_dtype)
      return pad(pieces), pad(lasts), pad(befores), bits

    running, last, before, bits = comm.per_device(owner_update)
    if comm.active:                            # owners tell everyone
      bits = lax.psum(bits, lay.axis)
    interval = stale_lib.next_interval(bits[:, 0] > 0, bits[:, 1] > 0, r.interval,
                                       r.previous_interval)
    refresh = dataclasses.replace(
        r, weight=weight, last=last, before_last=before,
        next_step=jnp.where(due, count + interval, r.next_step),
        interval=jnp.where(due, interval, r.interval),
        previous_interval=jnp.where(due, r.interval, r.previous_interval),
        refreshes=r.refreshes + due.astype(jnp.int32))
    return running, refresh, due

  def stale_decompose(state, running, due):
    """Eigendecompositions of the due factors only; the others keep theirs."""
    lay, old = state.layout, state.second_order
    index = {(plan.layer.name, which): f
             for f, (plan, which, _) in enumerate(stale_lib.factor_order(lay))}

    def fresh(one):
      """New second-order parts of one factor: (vectors, values), (values,) or
      (F,) for a unit-wise block."""
      value = packing.unpack_batch(running, one, lay.packed)
      if one.form == factors_lib.UNIT:
        return (value.reshape(-1).astype(compute_dtype),)
      vectors, values = linalg.eigh(value)
      lo, hi = one.columns or (0, one.dim)          # a split factor keeps its columns
      values = values[..., lo:hi].astype(compute_dtype).reshape(-1)
      return (values,) if vectors is None else (
          vectors[..., lo:hi].astype(compute_dtype).reshape(-1), values)

    def owner_segment(device):
      group = device // lay.group_size
      by_offset = {place.offset: (place, index[(plan.layer.name, which)])
                   for place, plan, which in lay.owned(device)}
      pieces = []
      for batch in lay.batches[device]:
        size = layout_lib.storage_size(batch.dim, batch.form, lay.packed)
        mats, vecs = [], []
        for j in range(batch.count):
          place, f = by_offset[batch.offset + j * size]
          base = lay.second_base(place, group)
          kept = ((packing.read_matrix(old, base, place).reshape(-1),)
                  if place.matrix_offset is not None else ()) + (
                      packing.read_vector(old, base, place).reshape(-1),)
          if comm.active:          # replicated (COMM-OPT) state vs local results
            kept = _compat.as_varying(kept, (lay.axis,))
          one = dataclasses.replace(batch, count=1, offset=place.offset)
          out = lax.cond(due[f], functools.partial(fresh, one), lambda kept=kept: kept)
          mats += list(out[:-1])
          vecs.append(out[-1])
        pieces += mats + vecs
      return _pad(pieces, lay.second_segment)

    local = comm.per_device(owner_segment)
    return lax.cond(jnp.any(due), lambda: distribute_second(local, lay),
                    lambda: state.second_order)

  def precondition_group(state, gamma, group, grad_of):
    """Preconditioned gradients of one owner group's layers and Σ|⟨V, ∇⟩|."""
    lay, second = state.layout, state.second_order

    def parts(place):
      """(matrix or None, vector), column slices put together."""
      return packing.read_parts(second, lambda q: lay.second_base(q, group), place)

    def either(place):
      matrix, vector = parts(place)
      return vector if matrix is None else matrix

    out, vg = {}, jnp.zeros([], compute_dtype)
    for plan in lay.group_plans(group):
      grad = grad_of(plan)
      if plan.layer.unitwise:             # SP-NGD: (F_c + γI)⁻¹ per channel
        v_gamma, v_beta = linalg.unitwise_precondition(
            grad[0], grad[1] if plan.layer.has_bias else None, parts(plan.f)[1], gamma)
        v = jnp.stack([v_gamma] + ([v_beta] if v_beta is not None else []))
      elif method == "eigen":
        v = linalg.precondition_eigen(grad, *parts(plan.a), *parts(plan.g), gamma,
                                      rows=plan.rows)
      else:
        v = linalg.precondition_inverse(grad, either(plan.a), either(plan.g),
                                        rows=plan.rows)
      out[plan.layer.name] = v
      lo, hi = _piece_rows(plan)
      dot = jnp.vdot(v, grad[lo:hi]).astype(compute_dtype)
      if plan.rows is None:
        vg = vg + jnp.abs(dot) * vg_weight(plan)
      else:                               # a piece: |Σ of the pieces' dots| later
        out[(plan.layer.name, "dot")] = dot
    return out, vg

  def update_fn(updates, state: ScaleByKfacState, params=None, *, kfac_stats=None,
                **extra_args):
    del params, extra_args
    lay = state.layout
    _check_placement(lay, state, distribution, factor_storage)
    if model_axis is not None:
      replicated_paths.clear()
      replicated_paths.update(tensor_parallel.replicated_paths(updates, distribution))
    with_stats = _check_stats(lay, kfac_stats, state.update_factors)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    leaves = {registry.path_str(p): leaf for p, leaf in flat}
    _check_updates(lay, leaves)
    count = state.count
    gamma = jnp.asarray(_at(damping, count), compute_dtype)

    # Faults: skip the step (on every device) if anything it consumes is not
    # finite: any gradient, and the statistics on a factor step. The devices
    # must agree: a psum of the statistics' verdict on factor steps only, and
    # of the gradients' only if they may differ between devices (local ones;
    # averaged gradients, typed invariant over the axis, are checked as is),
    # so a plain COMM-OPT step has no extra collective.
    with jax.named_scope("kfac_fault_check"):
      ok = _all_finite(leaves.values())
      if comm.active and (reduce_grads != "none" or model_axis is not None
                          or distribution.axis in _compat.varying_axes(updates)):
        ok = _agree(comm, ok)
      if with_stats:
        value_of = _stat_of(kfac_stats)
        stats_finite = _all_finite([value_of(plan, w)
                                    for plan in lay.plans for w, _ in plan.places])
        if comm.active:
          ok = ok & lax.cond(state.update_factors, lambda: _agree(comm, stats_finite),
                             lambda: jnp.asarray(True))
        else:
          ok = ok & (stats_finite | ~state.update_factors)
      ok = _materialise(ok)

    # Named scopes mark the work of each cadence in the HLO (benchmarks read them).
    if stale_threshold is not None:
      if not with_stats:
        raise ValueError("With stale_threshold every update needs kfac_stats (any "
                         "factor may be due).")

      def refreshed():
        with jax.named_scope("kfac_factor_update"):
          running, refresh, due = stale_refresh(state, kfac_stats)
        with jax.named_scope("kfac_decomposition"):
          second = stale_decompose(state, running, due)
        return running, second, refresh
      running, second, refresh = lax.cond(
          ok, refreshed, lambda: (state.factors, state.second_order, state.refresh))
      new_state = dataclasses.replace(
          state, count=jnp.where(ok, count + 1, count),
          update_factors=jnp.where(ok, jnp.any(refresh.next_step <= count + 1),
                                   state.update_factors),
          factors=running, second_order=second, refresh=refresh,
          skipped=state.skipped + (~ok).astype(state.skipped.dtype))
    else:
      with jax.named_scope("kfac_factor_update"):
        if with_stats:
          running, weight = lax.cond(
              state.update_factors & ok, lambda: update_factors(state, kfac_stats),
              lambda: (state.factors, state.factor_weight))
        else:
          running, weight = state.factors, state.factor_weight
      with jax.named_scope("kfac_decomposition"):
        second = lax.cond(is_factor_step(inverse_update_every, count) & ok,
                          lambda: decompose(running, lay, gamma, state.second_order),
                          lambda: state.second_order)
      new_state = dataclasses.replace(
          state, count=jnp.where(ok, count + 1, count), factor_weight=weight,
          update_factors=jnp.where(ok, is_factor_step(factor_update_every, count + 1),
                                   state.update_factors),
          factors=running, second_order=second,
          skipped=state.skipped + (~ok).astype(state.skipped.dtype))

    tagged = {p for plan in lay.plans
              for p in (plan.layer.kernel_path, plan.layer.bias_path) if p is not None}
    offsets, group_sizes, size = _gradient_offsets(lay)

    if reduce_grads == "reduce_scatter" and lay.plans:
      # SP-NGD: raw local gradients go to their owner group only (slot 0:
      # the group's KL sum, computed after the reduction).
      groups = [jnp.concatenate([jnp.zeros(1, compute_dtype)] + [
          _gradient_matrix(p, leaves).ravel().astype(compute_dtype)
          for p in lay.group_plans(g)]) for g in range(lay.num_groups)]
      if lay.group_size == 1 < lay.num_groups:
        segment = comm.reduce_uneven(groups, size)
      else:
        segment = comm.reduce_scatter_groups(jnp.concatenate(
            [jnp.pad(x, (0, size - x.shape[0])) for x in groups]))

      def grad_of(plan):
        layer, start = plan.layer, offsets[(plan.layer.name, plan.group)]
        return segment[start:start + layer.a_dim * layer.g_dim].reshape(
            layer.a_dim, layer.g_dim)
      leaves = {k: (v if k in tagged else comm.mean(v)) for k, v in leaves.items()}
    else:
      if reduce_grads == "all_reduce":
        leaves = comm.mean(leaves)

      def grad_of(plan):
        return _gradient_matrix(plan, leaves).astype(compute_dtype)

    if lay.num_groups == 1:
      preconditioned, vg = precondition_group(new_state, gamma, 0, grad_of)
    else:
      def branch(g):
        out, vg = precondition_group(new_state, gamma, g, grad_of)
        flat_v = [x for p in lay.group_plans(g) for x in (
            [out[(p.layer.name, "dot")][None]] if p.rows is not None else []) + [
                out[p.layer.name].ravel()]]
        used = sum(x.size for x in flat_v)
        buffer = jnp.concatenate([vg[None]] + flat_v
                                 + [jnp.zeros(size - 1 - used, compute_dtype)])
        return _compat.as_varying(buffer, comm.varying)   # a group may own no layer
      mine = lax.switch(comm.group_index(),
                        [functools.partial(branch, g) for g in range(lay.num_groups)])
      buffers = (comm.gather_uneven(mine, group_sizes) if lay.group_size == 1
                 else list(comm.gather_groups(mine)))
      vg = sum(b[0] for b in buffers)
      preconditioned = {}
      for plan in lay.plans:             # a replicated layer: its pieces' rows
        layer, rows, dots = plan.layer, [], []
        for piece in plan.pieces:
          lo, hi = _piece_rows(piece)
          start = offsets[(layer.name, piece.group)]
          rows.append(buffers[piece.group][start:start + (hi - lo) * layer.g_dim].reshape(
              hi - lo, layer.g_dim))
          dots.append(buffers[piece.group][start - 1])
        preconditioned[layer.name] = jnp.concatenate(rows) if plan.copies else rows[0]
        if plan.copies:
          vg = vg + jnp.abs(sum(dots)) * vg_weight(plan)

    if kl_clip is not None:
      if model_axis is not None:       # every layer's shards, replicated ones once
        vg = lax.psum(vg, model_axis)
      eta = jnp.asarray(_at(learning_rate, count), compute_dtype)
      kappa = jnp.asarray(_at(kl_clip, count), compute_dtype)
      nu = jnp.where(vg > 0, jnp.minimum(1.0, jnp.sqrt(kappa / (eta ** 2 * vg))), 1.0)
      preconditioned = {n: nu * v for n, v in preconditioned.items()}
    for plan in lay.plans:
      _write_back(plan, preconditioned[plan.layer.name], leaves)
    outputs = [leaves[registry.path_str(p)] for p, _ in flat]
    new_updates = jax.tree_util.tree_unflatten(
        treedef, [jnp.where(ok, u, jnp.zeros(u.shape, u.dtype)) for u in outputs])
    return new_updates, new_state

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  if model_axis is None:
    return tx
  return tensor_parallel.wrap(
      tx, distribution, "scale_by_kfac",
      lambda sharding: tensor_parallel.check_kfac_layers(layers or (), sharding))


def skip_faulty_steps(inner: optax.GradientTransformation
                      ) -> optax.GradientTransformationExtraArgs:
  """Makes a step that `scale_by_kfac` skips a no-op for the whole of `inner`.

  `inner` is any optax transform holding `scale_by_kfac` states (e.g. a chain
  with momentum). On a step where one of them skipped (a non-finite gradient or
  statistic, see `scale_by_kfac`), the returned updates are zeros and the state
  of every transform in `inner` is the previous one, so momentum, schedules'
  counts and the like neither decay nor advance (zeros alone would still
  decay a momentum trace and move the parameters). The K-FAC states count the
  skip in their `skipped` field. Stateless: the state is `inner`'s own.
  """
  inner = optax.with_extra_args_support(inner)

  def is_kfac(x):
    return isinstance(x, ScaleByKfacState)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    old, new = find_states(state), find_states(new_state)
    if not new:
      raise ValueError("skip_faulty_steps wraps a transform with no scale_by_kfac.")
    skipped = jnp.any(jnp.stack([n.skipped != o.skipped for o, n in zip(old, new)]))

    def keep(before, after):
      if is_kfac(after):        # already unchanged but for its `skipped` count
        return after
      return jnp.where(skipped, before, after)
    kept = jax.tree_util.tree_map(keep, state, new_state, is_leaf=is_kfac)
    zeros = jax.tree_util.tree_map(
        lambda u: jnp.where(skipped, jnp.zeros(u.shape, u.dtype), u), new_updates)
    return zeros, kept

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def kfac(learning_rate: ScalarOrSchedule, momentum: float | None = 0.9,
         weight_decay: float = 0.0, nesterov: bool = False,
         layers: registry.LayerRegistry | None = None, *,
         damping: ScalarOrSchedule = 1e-3, factor_decay: float = 0.95,
         factor_update_every: ScalarOrSchedule = 1,
         inverse_update_every: ScalarOrSchedule = 1, method: str = "eigen",
         kl_clip: ScalarOrSchedule | None = 1e-3, factor_dtype: Any = None,
         skip: Sequence[str] = (), max_factor_dim: int | None = None,
         distribution: distributed.Distribution | None = None,
         stale_threshold: float | None = None,
         ) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning followed by SGD with momentum, as in KAISA.

  `skip_faulty_steps(optax.chain(scale_by_kfac(...),
  add_decayed_weights(weight_decay), sgd(learning_rate, momentum, nesterov)))`:
  weight decay is added to the preconditioned gradient and goes through
  momentum, like PyTorch SGD after KAISA's `preconditioner.step()`, and a step
  that K-FAC skips (non-finite gradient or statistic) changes nothing in the
  chain's state. Works with `optax.inject_hyperparams`.

  Args:
    learning_rate: `η`, a float or an optax schedule of the update count; the
      KL clip uses it too.
    momentum: heavy-ball momentum of the SGD step (None or 0: none). KAISA's
      0.9; where the KL clip binds on a small problem, 0 often works better.
    weight_decay: coefficient added to the preconditioned gradient times the
      parameters (`optax.add_decayed_weights`); 0: none.
    nesterov: Nesterov momentum instead of heavy ball.
    layers: the tagged layers, `kd.value_and_grad(loss_fn).discover(params,
      *batch)`; `init` needs them: they fix the state's layout.
    damping: `γ` of `(A ⊗ G + γI)⁻¹`, positive; a float or a schedule of the
      update count. With method "inverse" a new value takes effect at the next
      inverse update.
    factor_decay: weight of the *old* value in the running factor averages,
      in [0, 1) (the papers' ξ is `1 − factor_decay`).
    factor_update_every: compute the statistics and update the running factors
      (and send them, when distributed) when `count % factor_update_every ==
      0`; a positive int or a schedule. The default 1 does this every step;
      KAISA uses 10.
    inverse_update_every: recompute the eigendecompositions ("eigen") or
      inverses ("inverse") when `count % inverse_update_every == 0`; a
      positive int or a schedule. The default 1 means an eigendecomposition of
      every factor every step, `O(d³)` per factor and the most costly part of
      K-FAC; KAISA uses 100.
    method: "eigen" (exact `(A⊗G + γI)⁻¹` from eigendecompositions; four
      matrix products per layer and step) or "inverse" (π-damped Cholesky
      inverses, an approximation; two products).
    kl_clip: `κ` of KAISA's KL clip (Eq. 5.1), a float or a schedule; None
      turns it off. The default 1e-3 is KAISA's; when the clip binds, the
      step no longer depends on `learning_rate`.
    factor_dtype: storage dtype of the running factors (None: float32;
      `jnp.bfloat16` halves them); decompositions run in float32 at least.
    skip: regular expressions searched in the layer names; matching layers
      (e.g. a vocabulary-sized output layer) pass through unpreconditioned. A
      pattern that matches no layer raises.
    max_factor_dim: factors of larger dimension are kept as their diagonal,
      never formed as matrices; None: no limit.
    distribution: a `kd.Distribution`: `update` then runs inside `shard_map`
      over its axis, with the state's specs from `kd.partition_specs`. None:
      one device.
    stale_threshold: `α` of SP-NGD's stale statistics (the paper uses 0.1):
      each factor is refreshed at its own adaptive interval. Needs both
      intervals at 1 and method "eigen"; not with a tensor-parallel
      distribution. None: off.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update(grads, state,
    params, kfac_stats=stats)` takes the statistics of `kd.value_and_grad`.
  """
  return skip_faulty_steps(optax.chain(
      scale_by_kfac(
          layers, damping=damping, factor_decay=factor_decay,
          factor_update_every=factor_update_every,
          inverse_update_every=inverse_update_every, method=method, kl_clip=kl_clip,
          learning_rate=learning_rate, factor_dtype=factor_dtype, skip=skip,
          max_factor_dim=max_factor_dim, distribution=distribution,
          stale_threshold=stale_threshold),
      optax.add_decayed_weights(weight_decay),
      optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)))
