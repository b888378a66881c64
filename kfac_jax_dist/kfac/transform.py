"""K-FAC as an optax transform: the stages of one update, in order.

`scale_by_kfac` replaces each tagged layer's gradient by its K-FAC
preconditioned gradient; parameters of no tagged layer pass through unchanged.
One `update` runs these stages (each in its own module, each a pure function
of the settings `KfacConfig`, the `Collectives` of the distribution, the
layout and the state):

1. checks: statistics and updates against the layout (`factors.check_stats`,
   `precondition.check_updates`), placement (`core.placement`);
2. the run-time settings' verdict (`core.faults`; the statistics are checked
   inside the factor update's conditional, on factor steps only, the
   gradients with the produced updates in 6);
3. running factors (`factors`) on factor steps, or the due factors with stale
   statistics (`stale_update`);
4. decompositions (`decompositions`) on decomposition steps;
5. preconditioning in the owner groups and the gather (`precondition`,
   `core.routing`), then the KL clip;
6. fault verdict on the produced updates and, through `Σ|⟨V, ∇⟩|`, on every
   tagged gradient number, then one select: an accepted step
   returns the new updates and state, a faulty one zeros and the old state
   with `skipped` + 1 (`core.faults`).

Cadence (`core.cadence`): with `count` the number of accepted updates (from
0), factors are refreshed when `count % factor_update_every == 0`, the
eigenbases/inverses when `count % inverse_update_every == 0`, both under
`lax.cond`. Step 0 therefore already preconditions. Intervals, damping, the
KL clip and the learning rate may be schedules of `count`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import registry
from kfac_jax_dist.core import cadence, faults, placement, settings, states, tensor_parallel
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.kfac import (
  decompositions,
  factors,
  packing,
  precondition,
  stale,
  stale_update,
)
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac.config import Correction, KfacConfig, Method
from kfac_jax_dist.kfac.state import ScaleByKfacState, global_second_order
from kfac_jax_dist.kfac.state import owner_rows, second_order_rows

# ------------------------------------------------------------------------ init

def _check_params(layers: registry.LayerRegistry, leaves: dict[str, Any],
                  skipped: Sequence[str]) -> None:
  """Every tagged layer's parameters, but the `skipped` layers' (which K-FAC
  never reads), are in the tree given to init, with the shapes the layer was
  discovered with."""
  for layer in layers:
    if layer.name in skipped:
      continue
    for path, shape in ((layer.kernel_path, layer.kernel_shape),
                        (layer.bias_path, layer.bias_block_shape)):
      if path is None:
        continue
      shape = layer.leaf_shape(shape)     # stacked: [L, *block shape]
      if path not in leaves and path == layer.bias_path and layer.kernel_path in leaves:
        raise ValueError(
            f"Tagged layer '{layer.name}': its kernel '{layer.kernel_path}' is in the tree "
            f"given to init, its bias '{path}' is not. K-FAC preconditions a layer's kernel "
            "and bias together (one A ⊗ G, the bias a row of the kernel): give both to "
            "this transform (an optax.multi_transform / masked label that sends biases "
            "elsewhere must label them with their kernels), or leave the layer out with "
            "skip=.")
      if path not in leaves:
        raise ValueError(f"Tagged layer '{layer.name}': parameter '{path}' is not in "
                         "the tree given to init (a tree other than the loss "
                         "function's, or an optax.masked / multi_transform partition "
                         "without it? Leave such a layer out with skip=).")
      if tuple(jnp.shape(leaves[path])) != tuple(shape):
        raise ValueError(f"Tagged layer '{layer.name}': parameter '{path}' has shape "
                         f"{jnp.shape(leaves[path])}, expected {shape}.")


def _check_captured(layers: registry.LayerRegistry, skipped: Sequence[str]) -> None:
  """No preconditioned layer runs only under a derivative the loss function
  takes itself (`TaggedLayer.under_derivative`): the capture would give it
  no statistics, and its factors would stay the identity. One that also runs
  outside one (`also_under_derivative`) gets a warning."""
  hidden = [layer for layer in layers
            if layer.under_derivative and layer.name not in skipped]
  if hidden:
    names = [layer.name for layer in hidden]
    raise ValueError(
        f"Tagged layers {names} run only under a derivative that the loss function "
        f"takes itself ({hidden[0].under_derivative}; e.g. a force field's -∇E, a "
        "PINN's residual, a block under nn.custom_vjp). K-FAC's statistics of a layer "
        "come from the loss's own backward pass through it, which that derivative "
        "hides from the capture: their factors would never change. Leave them out "
        f"with skip={[f'^{re.escape(n)}$' for n in names]} (they then take the plain "
        "gradient), or precondition such a model with kd.shampoo or kd.soap, which "
        "read only the gradients. Where the registered loss's own inputs come out of "
        "that derivative (jax.vjp or jax.value_and_grad of the model, its value "
        "shared with a gradient penalty), compute them outside it instead (run the "
        "model once more).")
  partly = [layer.name for layer in layers
            if layer.also_under_derivative and layer.name not in skipped]
  if partly:
    warnings.warn(
        f"kfac_jax_dist: tagged layers {partly} also run under a derivative that the "
        "loss function takes itself (a PINN's residual, a gradient penalty, MAML's "
        "inner step): K-FAC's statistics of them are those of their applications "
        "outside it (the curvature of the terms inside is left out). If the "
        "registered loss's inputs come out of that derivative (the value of jax.vjp or "
        "jax.value_and_grad of the model, shared with a gradient penalty), their rows "
        "are missing from A and G: compute them with a pass outside it. See "
        "docs/concepts.md, \"Derivatives inside the loss\".", stacklevel=4)


def _initial_cadence(config: KfacConfig, name: str) -> int:
  """The cadence `name` at count 0 (a schedule evaluated then, also while
  tracing), which chooses the storage; an injected (traced) number raises.
  A number makes no array (no transfer, under `jax.transfer_guard` too)."""
  value = getattr(config, name)
  if callable(value):
    with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):
      value = value(jnp.zeros([], jnp.int32))
  return int(settings.static(name, value))


def build_layout(config: KfacConfig, comm: collectives_lib.Collectives,
                 layers: registry.LayerRegistry, param_paths: Sequence[str]
                 ) -> layout_lib.Layout:
  """The state's static layout: owners, segments and storage (chunked or
  owner segments, whichever the cadence makes cheaper, see `layout`)."""
  dist = config.distribution
  lay = layout_lib.build(
      layers, tuple(param_paths), skip=config.skip, max_factor_dim=config.max_factor_dim,
      num_devices=comm.num_devices, group_size=comm.group_size,
      axis=None if dist is None else dist.axis, method=config.method,
      packed=True if dist is None else dist.symmetric_comm,
      factor_storage=config.factor_storage, replicate_factors=not config.local_factors,
      replicate_layers=(not config.local_factors
                        and config.gradient_reduction != "reduce_scatter"))
  if lay.factor_storage == layout_lib.CHUNKED and lay.num_devices > 1:
    lay = dataclasses.replace(lay, factor_storage=layout_lib.cheaper_storage(
        lay, _initial_cadence(config, "factor_update_every"),
        _initial_cadence(config, "inverse_update_every")))
  placement.check_skip_patterns(config.skip, lay.skipped, list(layers.names()),
                                "tagged layer")
  uncaptured = tuple((u.where, u.kind, u.reason) for u in getattr(layers, "uncaptured", ()))
  return dataclasses.replace(lay, uncaptured=uncaptured, local_factors=config.local_factors,
                             statistics_every_step=_statistics_every_step(config),
                             strategy_choice=() if dist is None else dist.explanation)


def _statistics_every_step(config: KfacConfig) -> bool:
  """Whether `refreshed_state` consumes the statistics at every step with no
  conditional (a factor update every 1, without stale statistics, whose
  schedule is per factor): `update_factors` is then True at every step."""
  return config.stale_threshold is None and cadence.always(config.factor_update_every)


def init_state(config: KfacConfig, comm: collectives_lib.Collectives,
               layers: registry.LayerRegistry | None, params: Any) -> ScaleByKfacState:
  """The state at count 0: identity factors and second-order state.

  Concrete params: the state is built in numpy and transferred once per array
  (eager jnp runs, and first compiles, one small program per op: seconds for
  a few layers). Traced (jit, eval_shape, shard_map): jnp.
  """
  if layers is None:
    raise ValueError(
        "scale_by_kfac needs the tagged layers to lay out its state: pass "
        "layers=kd.value_and_grad(loss_fn).discover(params, batch).")
  placement.check_floating_params("scale_by_kfac", params)
  leaves = registry.leaves_by_path(params)
  lay = build_layout(config, comm, layers, list(leaves))
  _check_params(layers, leaves, lay.skipped)
  _check_captured(layers, lay.skipped)
  layout_lib.check_factor_dims(lay)
  layout_lib.check_addressable(lay)
  xp = jnp if _compat.traced(params) else np
  running, second = initial_arrays(config, lay, xp)
  state = ScaleByKfacState(
      count=xp.zeros([], jnp.int32), factor_weight=xp.zeros([], config.compute_dtype),
      update_factors=xp.asarray(True), factors=running, second_order=second,
      skipped=xp.zeros([], jnp.int32), layout=lay,
      refresh=None if config.stale_threshold is None else stale.init(
          lay, running, config.compute_dtype, xp),
      correction=None if config.eigenvalue_correction is None else initial_correction(
          lay, second, xp),
      marked_weight=initial_marked_weight(config, lay, xp))
  return state if xp is jnp else jax.tree_util.tree_map(jnp.asarray, state)


def initial_marked_weight(config: KfacConfig, lay: layout_lib.Layout, xp: Any
                          ) -> Any:
  """`ScaleByKfacState.marked_weight` at count 0 (zeros; DP-KFAC's, one per
  device and layer, `[P·M]`), None where no layer may sit out a pass or stale
  statistics keep a weight per factor anyway. Stale statistics' one refresh
  schedule cannot follow DP-KFAC's owners, each of whom sees whether a layer
  ran on its own batch only: refused."""
  marked = [plan.layer.name for plan in layout_lib.sit_out_plans(lay)]
  if not marked:
    return None
  if config.stale_threshold is not None and config.local_factors:
    raise ValueError(
        "stale_threshold with kd.Distribution(factor_reduction='local') (DP-KFAC) and "
        "layers that may see no position in a pass (inside a lax.cond / lax.switch "
        "branch or a lax.while_loop body, or under kd.tags.row_mask: "
        f"{marked[:4]}{'...' if len(marked) > 4 else ''}) is not supported: one refresh "
        "schedule cannot follow whether each owner's own batch gave them any. Use "
        "factor_reduction='all_reduce' or 'reduce_scatter', or skip= these layers.")
  if config.stale_threshold is not None:
    return None
  devices = lay.num_devices if config.local_factors else 1
  return xp.zeros([devices * len(marked)], config.compute_dtype)


def initial_arrays(config: KfacConfig, lay: layout_lib.Layout, xp: Any
                   ) -> tuple[Any, Any]:
  """Identity running factors and second-order state (unit eigenvalues).
  Traced, built elementwise (`packing.initial_factors`): under
  `jax.jit(tx.init, out_shardings=...)` each device builds its shard alone.
  On the host, in numpy."""
  dtype, second_dtype = config.factor_dtype, config.second_dtype
  if xp is jnp:
    return (packing.initial_factors(lay, dtype),
            packing.initial_second_order(lay, second_order_rows(lay), lay.second_row,
                                         second_dtype,
                                         None if lay.num_groups == 1 else lay.second_rows))
  running = packing.all_segments(
      lay, lambda plan, which: packing.stored_identity(getattr(plan, which), dtype,
                                                       lay.packed, np),
      dtype, np, stored_values=True)
  second = global_second_order(
      lay, [packing.second_order_segment(lay, d, second_dtype, np)
            for d in range(lay.num_devices)], np)
  return running, second


def initial_correction(lay: layout_lib.Layout, second: Any, xp: Any
                       ) -> correction_lib.CorrectionState:
  """EK-FAC's scaling at count 0 (`v_A v_Gᵀ` of the identity eigenbases), with
  every owner's segment in rows (`Layout.owner_slots`) kept when there are
  several owner groups (with one, `second` is that array already)."""
  if lay.num_groups == 1:
    owners = second
  elif xp is jnp:
    owners = packing.initial_second_order(lay, owner_rows(lay), lay.owner_row, second.dtype,
                                          None)
  else:
    owners = global_second_order(lay, [packing.second_order_segment(lay, d, second.dtype, np)
                                       for d in range(lay.num_devices)], np, owners=True)
  return correction_lib.reset(lay, jnp.asarray(owners),
                              None if lay.num_groups == 1 else jnp.asarray(owners))


# ---------------------------------------------------------------------- update

# What to do about a state too large for the devices (`states.check_device_memory`).
KFAC_REMEDIES = ("Spread it over the devices (kd.Distribution(grad_worker_fraction=1/P): MEM-OPT "
                 "keeps 1/P of the eigenbases on each), keep wide factors diagonal "
                 "(max_factor_dim=), leave layers out (skip=) or store the running factors "
                 "and eigenbases in bfloat16 (factor_dtype=, second_order_dtype=jnp.bfloat16).")


def check_settings(config: KfacConfig, lay: layout_lib.Layout) -> None:
  """The state was made by a transform of this configuration: the settings
  that shape the layout (method, skip, max_factor_dim, packed factors) agree."""
  packed = True if config.distribution is None else config.distribution.symmetric_comm
  wrong = []
  if lay.method != config.method:
    wrong.append(f"method {lay.method!r} (transform: {config.method!r})")
  if lay.packed != packed:
    wrong.append(f"symmetric_comm {lay.packed} (transform: {packed})")
  kept = [plan.layer.name for plan in lay.plans]
  if any(re.search(p, n) for p in config.skip for n in kept) or not all(
      any(re.search(p, n) for p in config.skip) for n in lay.skipped):
    wrong.append(f"skipped layers {list(lay.skipped)} (transform: skip={list(config.skip)})")
  if any(place.form != layout_lib.factor_form(place.dim, config.max_factor_dim)
         for plan in lay.plans if not plan.layer.unitwise for which, place in plan.places
         if not (which == "a" and plan.layer.a_diagonal)):
    wrong.append(f"factor forms of another max_factor_dim (transform: "
                 f"{config.max_factor_dim})")
  if wrong:
    raise ValueError(
        "This K-FAC state was made by a transform of another configuration: "
        + "; ".join(wrong) + ". Use the state of this transform's init (kd.convert_state "
        "moves a state between distributions only).")


def check_placement(config: KfacConfig, state: ScaleByKfacState) -> None:
  """The state was laid out for this transform's distribution, and `update`
  runs where that distribution says (inside `shard_map` over its axis, with
  the per-device parts of `kd.partition_specs`)."""
  lay, dist, storage = state.layout, config.distribution, config.factor_storage
  want = ((1, 1, None, storage) if dist is None else
          (dist.num_devices, dist.group_size, dist.axis, storage))
  have = (lay.num_devices, lay.group_size, lay.axis, lay.factor_storage)
  if storage == layout_lib.CHUNKED and dist is not None:
    have = have[:3] + (storage,)   # either storage, by bytes (layout.cheaper_storage)
  placement.check_layout("K-FAC", have, want, ("devices", "gradient workers per layer",
                                               "axis", "factor storage"))
  check_settings(config, lay)
  stored = jnp.dtype(state.second_order.dtype)
  if stored != config.second_dtype:
    raise ValueError(
        f"This K-FAC state stores its second-order state in {stored.name}, the transform "
        f"in {jnp.dtype(config.second_dtype).name} (second_order_dtype=, factor_dtype=): "
        "use the state of this transform's init.")
  if dist is None:
    return
  placement.check_axis("K-FAC", dist)
  second = lay.second_array
  got = (state.factors.shape, state.second_order.shape)
  if got != ((lay.factor_shard,), (second,)):
    raise ValueError(
        f"Inside shard_map the K-FAC state has per-device factors {got[0]} and "
        f"second-order {got[1]}, expected {(lay.factor_shard,)} and {(second,)}: "
        "give shard_map in_specs/out_specs=kd.partition_specs(opt_state).")


def settings_verdict(config: KfacConfig, state: ScaleByKfacState) -> jax.Array:
  """Whether the settings whose values only the step knows are valid
  (`KfacConfig.settings_ok`): the same on every device, no collective.

  The gradients need no check of their own: `produced_finite` reads every
  tagged gradient number through `Σ|⟨V, ∇⟩|` (a non-finite `∇ᵢⱼ` makes
  `Vᵢⱼ∇ᵢⱼ`, hence the sum, non-finite whatever `V` is) and every other
  leaf's update as it leaves. A step with a faulty gradient still refreshes
  its factors and decompositions; its result is then discarded whole. (One
  check per gradient leaf was 9% of the autoencoder's step compile.)"""
  return faults.computed_once(config.settings_ok(state.count))


def _agreed_finite(comm: collectives_lib.Collectives, arrays: list) -> jax.Array:
  """Whether every array is finite, agreed by the devices."""
  with jax.named_scope(faults.SCOPE):
    finite = faults.all_finite(arrays)
    return faults.agree(finite, comm.varying) if comm.active else finite


def _corrected_statistics(state: ScaleByKfacState, stats: factors.Stats) -> list:
  """EK-FAC's statistics `S` (none without a correction)."""
  return ([] if state.correction is None else
          correction_lib.layer_statistics(state.layout, stats))


def statistics_verdict(comm: collectives_lib.Collectives, state: ScaleByKfacState,
                       stats: factors.Stats) -> jax.Array:
  """Whether every statistic a factor step consumes is finite, agreed by the
  devices. Evaluated inside the factor update's conditional, so that a plain
  step (the most frequent) checks no statistics."""
  return _agreed_finite(comm, factors.all_statistics(state.layout, stats)
                        + _corrected_statistics(state, stats))


def consumed_verdict(comm: collectives_lib.Collectives, state: ScaleByKfacState,
                     stats: factors.Stats, batch: jax.Array) -> jax.Array:
  """`statistics_verdict` read from what the factor update consumed: this
  device's reduced batch factors (a non-finite statistic of any device makes
  the sum that holds it non-finite) and EK-FAC's statistics. Checking the
  reduced, packed factors instead of every layer's dense statistics lets
  those die as soon as they are packed."""
  return _agreed_finite(comm, [batch] + _corrected_statistics(state, stats))


def stored_verdict(config: KfacConfig, comm: collectives_lib.Collectives, old: jax.Array,
                   new: jax.Array) -> jax.Array:
  """Whether the `new` running values (factors, EK-FAC's scaling) are finite
  as stored, where the `old` ones were, agreed by the devices (True, no
  check, where the storage dtype is not `faults.narrower` than the compute
  dtype: its cast cannot overflow where the statistics were finite)."""
  if not faults.narrower(new.dtype, config.compute_dtype):
    return jnp.asarray(True)
  with jax.named_scope(faults.SCOPE):
    ok = faults.all_finite([new]) | ~faults.all_finite([old])
    return faults.agree(ok, comm.varying) if comm.active else ok


def _refreshed_stale_state(config: KfacConfig, comm: collectives_lib.Collectives,
                           state: ScaleByKfacState, stats: factors.Stats | None,
                           ok: jax.Array, gamma: jax.Array
                           ) -> tuple[ScaleByKfacState, jax.Array]:
  """`refreshed_state` with stale statistics (`stale_threshold`): each factor
  refreshed and decomposed on its own schedule (`stale_update`). With no
  layer preconditioned (all skipped) there is nothing to refresh."""
  count, true = state.count, jnp.asarray(True)
  if not state.layout.plans:
    return dataclasses.replace(state, count=count + 1,
                               update_factors=jnp.zeros([], bool)), true

  def refreshed() -> tuple:
    with jax.named_scope("kfac_factor_update"):
      running, refresh, due = stale_update.refresh_due_factors(config, comm, state, stats)
      # (the psum of the devices' verdicts on factor steps only; without
      # one, no conditional: on a GPU each is a host round trip)
      verdict = lambda: (statistics_verdict(comm, state, stats)
                         & stored_verdict(config, comm, state.factors, running))
      stats_ok = (lax.cond(state.update_factors, verdict, lambda: true)
                  if comm.active else verdict() | ~state.update_factors)
    with jax.named_scope("kfac_decomposition"):
      second = stale_update.decompose_due_factors(config, comm, state, running, due,
                                                  gamma)
    return running, second, refresh, stats_ok
  running, second, refresh, stats_ok = lax.cond(
      ok, refreshed, lambda: (state.factors, state.second_order, state.refresh, true))
  update_next = jnp.any(refresh.next_step <= count + 1)
  if config.model_axes:     # the same on every model shard (one schedule), so typed
    update_next = lax.pmax(update_next.astype(jnp.int32), config.model_axes) > 0
  return dataclasses.replace(
      state, count=count + 1, factors=running, second_order=second, refresh=refresh,
      update_factors=update_next), stats_ok


def refreshed_state(config: KfacConfig, comm: collectives_lib.Collectives,
                    state: ScaleByKfacState, stats: factors.Stats | None, ok: jax.Array,
                    gamma: jax.Array) -> tuple[ScaleByKfacState, jax.Array]:
  """The state after this step's factor and decomposition refreshes (none on
  a faulty step), and whether the statistics a factor step consumed were
  finite (True on other steps; if not, the step is faulty and the caller
  keeps the old state). Named scopes mark each cadence's work in the HLO."""
  if config.stale_threshold is not None:
    return _refreshed_stale_state(config, comm, state, stats, ok, gamma)
  count, true = state.count, jnp.asarray(True)
  decompose_now = cadence.due(config.inverse_update_every, count) & ok
  update_now = (state.update_factors & ok) if stats is not None else jnp.asarray(False)
  # Work due at every step (an every of 1) runs without a conditional
  # (`cadence.cond_unless_always`): on a faulty step its result is discarded
  # with the rest (`faults.accept_or_skip`).
  unbranched = (cadence.always(config.inverse_update_every) or
                (stats is not None and cadence.always(config.factor_update_every)))

  weights = (state.factor_weight, state.marked_weight)

  def updated_factors() -> tuple:
    running, weight, batch = factors.update_running_factors(config, comm, state, stats)
    return running, weight, (consumed_verdict(comm, state, stats, batch)
                             & stored_verdict(config, comm, state.factors, running))

  def refreshed() -> tuple:
    running, weight, stats_ok = state.factors, weights, true
    if stats is not None:
      with jax.named_scope("kfac_factor_update"):
        running, weight, stats_ok = cadence.cond_unless_always(
            config.factor_update_every, update_now, updated_factors,
            lambda: (state.factors, weights, true))
    with jax.named_scope("kfac_decomposition"):
      second = cadence.cond_unless_always(
          config.inverse_update_every, decompose_now,
          lambda: decompositions.decompose(config, comm, state.layout, running, gamma,
                                           state.second_order),
          lambda: state.second_order)
    return running, weight, second, stats_ok

  def unchanged() -> tuple:
    return state.factors, weights, state.second_order, true

  # Off CPU one conditional around both refreshes: a plain step (the most
  # frequent) runs one, one host round trip on a GPU (see `kd.value_and_grad`).
  # On CPU, where a conditional costs nothing, the two side by side: the outer
  # one holds one more copy at a decomposition step's peak (step_time's MLP:
  # 46.3 MB instead of 42.0). Chosen when tracing (`Collectives.on_cpu`):
  # `lax.platform_dependent` traced both, 0.2-0.3 s of the CNN step's compile.
  running, weight, second, stats_ok = (
      refreshed() if unbranched or comm.on_cpu
      else lax.cond(update_now | decompose_now, refreshed, unchanged))
  return dataclasses.replace(
      state, count=count + 1, factor_weight=weight[0], marked_weight=weight[1],
      factors=running, second_order=second,
      update_factors=cadence.due(config.factor_update_every, count + 1)), stats_ok


def _corrected_layers_refreshed(state: ScaleByKfacState) -> jax.Array:
  """Stale statistics: `[C]`, whether each EK-FAC-corrected layer has a factor
  refreshed (so decomposed) this step (`stale_update.layers_due`)."""
  corrected = np.asarray([k for k, plan in enumerate(state.layout.plans)
                          if correction_lib.is_corrected(plan)], np.int32)
  due = state.refresh.next_step <= state.count
  return stale_update.layers_due(state.layout, due)[corrected]


def _corrected_layers_ran(comm: collectives_lib.Collectives, lay: layout_lib.Layout,
                         stats: factors.Stats) -> jax.Array | None:
  """`[C]`, whether each EK-FAC-corrected layer ran in the pass (the loss's
  backward pass reached it, `factors.reached`, and, if it may sit out one,
  positions on any device); None where every layer ran."""
  corrected = np.asarray([k for k, plan in enumerate(lay.plans)
                          if correction_lib.is_corrected(plan)], np.int32)
  reached = factors.reached(lay, stats)[corrected]
  if not layout_lib.sit_out_plans(lay):
    return None if reached.all() else jnp.asarray(reached)
  return factors.positions(comm, lay, stats, pooled=True).ran(lay)[corrected] & reached


def corrected_states(config: KfacConfig, comm: collectives_lib.Collectives,
                     state: ScaleByKfacState, new_state: ScaleByKfacState,
                     stats: factors.Stats | None, ok: jax.Array
                     ) -> tuple[ScaleByKfacState, ScaleByKfacState, jax.Array]:
  """EK-FAC (`correction`): (the state this step preconditions with: the
  eigenbases it started with and the scaling measured in them on a factor
  step; the state after the step: on a decomposition step, the new eigenbases
  and their `v_A v_Gᵀ`, fresh; with stale statistics, of the layers with a
  refreshed factor only; `stored_verdict` of the measured scaling)."""
  lay, measured, scaling_ok = state.layout, state.correction, jnp.asarray(True)
  if stats is not None:
    measure = lambda: correction_lib.updated(config, comm, lay, state.correction, stats,
                                             _corrected_layers_ran(comm, lay, stats))
    with jax.named_scope("kfac_factor_update"):
      if not faults.narrower(state.correction.scaling.dtype, config.compute_dtype):
        measured = lax.cond(state.update_factors & ok, measure, lambda: state.correction)
      else:                             # and whether its cast stayed finite

        def checked() -> tuple[correction_lib.CorrectionState, jax.Array]:
          new = measure()
          return new, stored_verdict(config, comm, state.correction.scaling, new.scaling)
        measured, scaling_ok = lax.cond(state.update_factors & ok, checked,
                                        lambda: (state.correction, jnp.asarray(True)))
  changed = None
  if config.stale_threshold is None:
    decomposed = cadence.due(config.inverse_update_every, state.count) & ok
  else:
    changed = _corrected_layers_refreshed(state) & ok
    ran = None if stats is None else _corrected_layers_ran(comm, lay, stats)
    if ran is not None:         # a due layer that did not run was not refreshed
      changed = changed & ran
    decomposed = jnp.any(changed)

  def reset() -> correction_lib.CorrectionState:
    return correction_lib.reset(
        lay, new_state.second_order,
        correction_lib.gather_owners(comm, lay, new_state.second_order), measured, changed)
  with jax.named_scope("kfac_decomposition"):
    after = lax.cond(decomposed, reset, lambda: measured)
  return (dataclasses.replace(new_state, second_order=state.second_order,
                              correction=measured),
          dataclasses.replace(new_state, correction=after), scaling_ok)


def preconditioned_updates(config: KfacConfig, comm: collectives_lib.Collectives,
                           state: ScaleByKfacState, updates: Any,
                           leaves: dict[str, jax.Array], gamma: jax.Array,
                           count: jax.Array) -> tuple[Any, jax.Array]:
  """The updates with every tagged layer's gradient preconditioned (from the
  refreshed `state`) and KL-clipped with the schedules' values at the
  update's `count` (the refreshed state's is already the next one),
  untagged leaves passing through; and whether they are finite
  (`produced_finite`)."""
  lay = state.layout
  replicated = ({} if not config.model_axes else
                tensor_parallel.replicated_axes(updates, config.distribution))

  def kl_weight(plan: layout_lib.LayerPlan) -> float:
    """A layer replicated over model axes counts once in the KL sum psum'd
    over them."""
    return 1.0 / math.prod(int(config.distribution.mesh.shape[a])
                           for a in replicated.get(plan.layer.kernel_path, ()))

  grad_of, leaves = precondition.routed_gradients(config, comm, lay, leaves)
  scaling = (None if state.correction is None
             else correction_lib.scaling_reader(lay, state.correction))
  out, vg = precondition.precondition(config, comm, lay, state.second_order, gamma,
                                      grad_of, kl_weight, scaling)
  leaves = dict(leaves)
  precondition.write_back(lay, out, leaves, precondition.kl_clip(config, vg, count))
  return (jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(updates),
      [leaves[name] for name, _ in registry.named_leaves(updates)]),
          produced_finite(config, lay, leaves, vg))


def produced_finite(config: KfacConfig, lay: layout_lib.Layout,
                    leaves: dict[str, jax.Array], vg: jax.Array) -> jax.Array:
  """Whether the produced updates and the gradients are finite, from one
  scalar for the tagged layers: `Σ_l |⟨V_l, ∇_l⟩|` is finite iff every number
  of every preconditioned `V_l` and gradient `∇_l` is (x·±∞ is ±∞ or NaN,
  NaN·x is NaN, and a sum with a non-finite term is not finite), barring an
  overflow of the sum itself, which skips the step too. Leaves of no tagged
  layer (their updates are their gradients), and tagged leaves of a dtype of
  smaller range than `compute_dtype` (the cast of a finite `V` may
  overflow), are checked one by one."""
  rest = [x for path, x in leaves.items()
          if path not in lay.tagged_paths or faults.narrower(x.dtype, config.compute_dtype)]
  return jnp.isfinite(vg) & faults.all_finite(rest)


def update_state(config: KfacConfig, comm: collectives_lib.Collectives, updates: Any,
                 state: ScaleByKfacState, stats: factors.Stats | None
                 ) -> tuple[Any, ScaleByKfacState]:
  """One K-FAC update: the stages of the module docstring."""
  lay = state.layout
  check_placement(config, state)
  if not factors.check_stats(lay, stats, state.update_factors):
    stats = None
  if config.stale_threshold is not None and stats is None:
    raise ValueError("With stale_threshold every update needs kfac_stats (any "
                     "factor may be due).")
  leaves = registry.leaves_by_path(updates)
  precondition.check_updates(lay, leaves)
  if config.distribution is not None:
    placement.check_gradients_averaged("scale_by_kfac", config.distribution, updates)
    if stats is not None:
      placement.check_statistics_reduced("scale_by_kfac", config.distribution, stats)
  elif stats is not None:
    placement.check_statistics_undistributed("scale_by_kfac", stats)
  gamma = jnp.asarray(cadence.value_at(config.damping, state.count), config.compute_dtype)
  with jax.named_scope(faults.SCOPE):
    ok = settings_verdict(config, state)
  new_state, stats_ok = refreshed_state(config, comm, state, stats, ok, gamma)
  applied = new_state
  if state.correction is not None:
    applied, new_state, scaling_ok = corrected_states(config, comm, state, new_state,
                                                      stats, ok)
    stats_ok = stats_ok & scaling_ok
  new_updates, produced = preconditioned_updates(config, comm, applied, updates, leaves,
                                                 gamma, state.count)
  with jax.named_scope(faults.SCOPE):
    ok = faults.computed_once(
        faults.agree(ok & stats_ok & produced, _compat.varying_axes(produced)))
  return faults.accept_or_skip(ok, new_updates, new_state, state)


# ------------------------------------------------------------------- transforms

# What the K-FAC transforms' `update` takes by keyword beside optax's (the
# batch's are adaptive mode's; a fixed-coefficient chain ignores them).
EXTRA_ARGS = ("kfac_stats", "kfac_batch", "kfac_batch_kwargs")


def check_extra_args(extra_args: dict, caller: str) -> None:
  """A `kfac_*` keyword of `update` that no K-FAC transform takes (a typo)
  would otherwise be dropped silently, like any other chain's extra argument."""
  unknown = sorted(k for k in extra_args if k.startswith("kfac_") and k not in EXTRA_ARGS)
  if unknown:
    raise TypeError(f"{caller}.update got {', '.join(unknown)}: the K-FAC keywords of "
                    f"update are {', '.join(EXTRA_ARGS)}.")


def scale_by_kfac(
    layers: registry.LayerRegistry | None = None,
    *,
    damping: cadence.ScalarOrSchedule = 1e-3,
    factor_decay: float = 0.95,
    factor_update_every: cadence.ScalarOrSchedule = 1,
    inverse_update_every: cadence.ScalarOrSchedule = 1,
    method: Method = "eigen",
    kl_clip: cadence.ScalarOrSchedule | None = None,
    learning_rate: cadence.ScalarOrSchedule | None = None,
    factor_dtype: Any = None,
    second_order_dtype: Any = None,
    skip: Sequence[str] = (),
    max_factor_dim: int | None = None,
    distribution: distribution_lib.Distribution | None = None,
    stale_threshold: float | None = None,
    eigenvalue_correction: Correction | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions the gradients of tagged layers with damped K-FAC.

  Args:
    layers: the tagged layers, from `kd.value_and_grad(loss_fn).discover(params,
      batch)`; they fix the state's layout at `init`.
    damping: `γ` of `(A ⊗ G + γI)⁻¹`, positive; a float or a schedule of the
      update count.
    factor_decay: weight of the old value in the running factor averages, in
      [0, 1).
    factor_update_every: refresh the factors when `count % this == 0` (an int
      or a schedule). The default 1 computes statistics every step.
    inverse_update_every: refresh eigenbases/inverses when `count % this == 0`
      (an int or a schedule). The default 1 decomposes every factor every
      step, the costliest setting: 10-100 is usual.
    method: "eigen" (exact `(A⊗G + γI)⁻¹`) or "inverse" (π-damped inverses).
    kl_clip: `κ` of KAISA's KL clip, a float or a schedule (None: no
      clipping); needs `learning_rate`.
    learning_rate: `η` for the KL clip, a float or a schedule.
    factor_dtype: storage dtype of the running factors (default float32);
      decompositions run in float32 at least.
    second_order_dtype: storage dtype of the eigenbases and eigenvalues (or
      inverses), which also travel in it (KAISA's `inv_dtype`; default: the
      compute dtype, float32 at least). `jnp.bfloat16` halves that state and
      its all-gathers; the products that read it run in the compute dtype.
    skip: regular expressions; tagged layers whose name matches one (e.g. a
      vocabulary-sized output layer) pass through unpreconditioned. A pattern
      that matches no layer raises at `init`.
    max_factor_dim: factors of larger dimension are kept diagonal (see
      `capture.statistics`), so that `A` of a huge layer is never formed.
    distribution: a `kd.Distribution` (strategy over a mesh axis); `update`
      then runs inside `shard_map` over that axis, with per-device statistics
      and gradients. None: one device.
    stale_threshold: α of SP-NGD's stale statistics (§4.3; the paper uses
      0.1): each factor is refreshed (communicated, averaged, decomposed) at
      its own adaptive interval instead of every step (see `kfac.stale`).
      Needs `factor_update_every = inverse_update_every = 1`; with method
      "inverse" a refresh of either factor of a layer inverts both at the
      new π (`stale_update.with_layer_partners`). Each refreshed factor
      travels in its own all-reduce (a fused reduce-scatter cannot leave
      stale factors out). None: off.
    eigenvalue_correction: "ekfac": EK-FAC (George et al. 2018): Dense and
      Conv layers divide by the second moment of the per-example gradients in
      the eigenbasis instead of K-FAC's eigenvalues (`kfac.correction`);
      `grad_fn` must get `opt_state=` so that the capture measures it. Needs
      method "eigen". With stale statistics, a layer's scaling restarts
      from its new `v_A v_Gᵀ` when either of its factors refreshes.
      Costs per factor step one all-reduce of gradient size, and with
      several owner groups an all-gather of the eigenbases on decomposition
      steps. None: K-FAC.

  Returns:
    A `GradientTransformationExtraArgs` whose `update` takes `kfac_stats=`.
    A step whose gradients, statistics or produced updates are not finite is
    skipped (zero updates, state unchanged but `skipped`; see `core.faults`).
  """
  registry.check_layers(layers)
  config = KfacConfig(
      damping=damping, factor_decay=factor_decay, factor_update_every=factor_update_every,
      inverse_update_every=inverse_update_every, method=method, kl_clip=kl_clip,
      learning_rate=learning_rate, factor_dtype=factor_dtype,
      second_order_dtype=second_order_dtype, skip=skip,
      max_factor_dim=max_factor_dim, distribution=distribution,
      stale_threshold=stale_threshold, eigenvalue_correction=eigenvalue_correction)
  comm = collectives_lib.Collectives(distribution)

  def init_fn(params: Any) -> ScaleByKfacState:
    states.check_params(params, "scale_by_kfac")
    state = init_state(config, comm, layers, params)
    states.check_device_memory(state, "scale_by_kfac", KFAC_REMEDIES)
    return state

  def update_fn(updates: Any, state: ScaleByKfacState, params: Any = None, *,
                kfac_stats: factors.Stats | None = None, **extra_args: Any
                ) -> tuple[Any, ScaleByKfacState]:
    del params
    check_extra_args(extra_args, "scale_by_kfac")
    states.check_kind(state, ScaleByKfacState, "scale_by_kfac")
    return update_state(config, comm, updates, state, kfac_stats)
  update_fn = _compat.transform_update(update_fn, config, needs=("kfac_stats",))

  return tensor_parallel.for_model_shards(
      optax.GradientTransformationExtraArgs(init_fn, update_fn), distribution,
      "scale_by_kfac",
      lambda sharding: tensor_parallel.check_kfac_layers(layers or (), sharding))
