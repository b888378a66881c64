"""K-FAC's optimizer state and the views of it a user reads.

The state holds the running Kronecker factors and the second-order state
(eigenbases and eigenvalues, or damped inverses) of every tagged layer in the
flat per-device segments that `layout` places, plus the counters of the
cadence and of the fault policy (`core.faults`). `running_factors` and
`second_order_parts` read a global (not per-device) state back per layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kfac_jax_dist.capture import statistics
from kfac_jax_dist.capture import triangles
from kfac_jax_dist.core import states
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac import stale as stale_lib


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "factor_weight", "update_factors", "factors", "second_order",
                 "skipped", "refresh", "correction", "marked_weight"],
    meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ScaleByKfacState(states.PreconditionerState):
  """State of `scale_by_kfac`, in the flat per-device segments of `layout`.

  Attributes:
    count: number of updates so far (skipped ones, see `skipped`, excluded).
    factor_weight: total weight `w` of the running factor averages.
    update_factors: whether the *next* update refreshes the factors; the capture
      reads it to skip the statistics work on other steps.
    factors: running factors, `[P·C]` (tight chunks) or `[P·L]` (owner
      segments), see `layout`; device i holds the i-th part.
    second_order: eigenbases and eigenvalues ("eigen") or damped inverses
      ("inverse"): per device its group's `m` segments one after another
      (`[second_rows·second_row]`), sharded; with one group every owner's,
      replicated (see `layout`).
    skipped: number of updates skipped for a non-finite gradient, statistic
      or produced update (not counted in `count`).
    layout: static placement of every layer's factors.
    refresh: per-factor refresh schedule with stale statistics (`stale`),
      else None.
    correction: EK-FAC's running scaling (`correction`), else None.
    marked_weight: `[M]`, the total weight `w_l` of the running averages of
      the layers that may sit out a pass or run under a row mask
      (`TaggedLayer.counted`, in layout order: `layout.sit_out_plans`), which
      a pass that gives them no position leaves as it is (DP-KFAC: each device's own, `[P·M]`, sharded);
      None when there is none (or with stale statistics, whose weights are
      per factor already).
  """

  count: jax.Array
  factor_weight: jax.Array
  update_factors: jax.Array
  factors: jax.Array
  second_order: jax.Array
  skipped: jax.Array
  layout: layout_lib.Layout
  refresh: stale_lib.RefreshState | None = None
  correction: correction_lib.CorrectionState | None = None
  marked_weight: jax.Array | None = None

  def partition_specs(self) -> ScaleByKfacState:
    """Running factors sharded over the distribution's axis (each device holds
    its slots); the second-order state too, unless there is a single owner
    group (COMM-OPT), where it is replicated; counters replicated."""
    replicated = PartitionSpec()
    axis = self.layout.axis
    sharded = replicated if axis is None else PartitionSpec(axis)
    refresh = self.refresh
    if refresh is not None:      # per-factor schedule replicated, X₋₂ as factors
      refresh = jax.tree_util.tree_map(lambda _: replicated, refresh)
      refresh = dataclasses.replace(refresh, before_last=sharded)
    return dataclasses.replace(
        self, count=replicated, factor_weight=replicated, update_factors=replicated,
        skipped=replicated, factors=sharded,
        second_order=replicated if self.layout.num_groups == 1 else sharded,
        refresh=refresh, correction=jax.tree_util.tree_map(lambda _: replicated,
                                                           self.correction),
        marked_weight=None if self.marked_weight is None else (
            sharded if self.layout.local_factors else replicated))

  @property
  def statistics_every_step(self) -> bool:
    """Whether every update consumes the statistics, with no conditional
    (`update_factors` always True): the capture then computes them with none
    either, where it otherwise branches on `update_factors` per layer."""
    return self.layout.statistics_every_step

  @property
  def local_statistics(self) -> bool:
    """DP-KFAC: each owner's factors are its own batch's statistics, so the
    capture leaves them unweighted by the devices' numbers of examples."""
    return self.layout.local_factors

  def statistic_forms(self, layer_name: str) -> tuple[str, str] | None:
    """The forms ("full", "packed" or "diag") of the statistics `A` and `G`
    the state consumes for a tagged layer; None for a layer it skips. The
    capture reads it to compute only what is used, and to pack a full one
    inside its conditional when the factors are stored packed."""
    plan = self.layout.plan(layer_name)
    if plan is None:
      return None
    packed = lambda form: (statistics.PACKED if form == statistics.FULL and self.layout.packed
                           else form)
    return packed(plan.a_form), packed(plan.g_form)

  def check_skipped(self, layer_name: str) -> None:
    """A tagged layer (a stacked one by its own name) that the state does not
    precondition must be one it skips: one it does not know (`layers=` of
    another model, a head added since) raises, where the capture would leave
    it out and it would pass through unpreconditioned without a word."""
    if layer_name in self.layout.skipped:
      return
    known = sorted({plan.layer.stats_name for plan in self.layout.plans}
                   | set(self.layout.skipped))
    raise ValueError(
        f"The loss function ran tagged layer '{layer_name}', which the K-FAC state "
        f"passed as opt_state does not know (it was laid out for {known}): a layer "
        "added since the transform was built, or layers= of another model. Build the "
        "transform with layers=grad_fn.discover(params, *batch) of this model (and a "
        "new state: kd.convert_state does not add layers), or exclude the layer with "
        "skip=.")

  def correction_bases(self, layer_name: str) -> tuple[jax.Array, jax.Array] | None:
    """EK-FAC: the eigenbases `(Q_A, Q_G)` in which the capture measures the
    layer's `S`; None without the correction or for a layer it leaves alone."""
    found = self.correction_block_bases((layer_name,))
    return None if found is None else (found[0][0], found[1][0])

  def correction_block_bases(self, layer_names: tuple[str, ...]
                             ) -> tuple[jax.Array, jax.Array] | None:
    """`correction_bases` of several layers (a stack's blocks), `[k, d, d]`
    each, consecutive blocks read at once."""
    if self.correction is None:
      return None
    return correction_lib.bases(
        self.layout, correction_lib.owners_second(self.second_order, self.correction),
        layer_names)


def find_states(tree: Any, kind: type[states.S] = ScaleByKfacState) -> list[states.S]:
  """Every state of `kind` inside an optax state tree: K-FAC's by default, or
  another preconditioner's (`kd.ScaleByShampooState`, `kd.ScaleBySoapState`)."""
  if not (isinstance(kind, type) and issubclass(kind, states.PreconditionerState)):
    raise TypeError("find_states: kind must be one of the library's state classes "
                    "(kd.ScaleByKfacState, kd.ScaleByShampooState, kd.ScaleBySoapState), "
                    f"got {kind!r}")
  return states.find_states(tree, kind)


def second_order_rows(lay: layout_lib.Layout) -> list[list[tuple[int, int]]]:
  """The global second-order array as rows of `Layout.second_row` numbers:
  per row, the (owner, column) of each segment it holds
  (`Layout.second_slots`). One owner group: the replicated array's rows;
  several: device after device, its group's rows (`[P·second_array]`,
  sharded)."""
  m, members = lay.group_size, lay.second_row_members()
  firsts = [0] if lay.num_groups == 1 else [d // m * m for d in range(lay.num_devices)]
  return [[(first + rank, lay.second_slots[rank][1]) for rank in row]
          for first in firsts for row in members]


def owner_rows(lay: layout_lib.Layout) -> list[list[tuple[int, int]]]:
  """`second_order_rows` of the array of every owner's segment that is read
  (`Layout.owner_slots`, `Layout.read_sizes`: EK-FAC's gathered eigenbases)."""
  return [[(d, lay.owner_slots[d][1]) for d in row if lay.read_sizes[d]]
          for row in layout_lib.slot_rows(lay.owner_slots)]


def global_second_order(lay: layout_lib.Layout, segments: Sequence[Any], xp=jnp,
                        owners: bool = False) -> Any:
  """The global second-order array from each owner's `[L₂]` segment, in the
  rows of `second_order_rows` (`owners`: of `owner_rows`, EK-FAC's gathered
  eigenbases): each row its owners' used numbers at their columns, zeros
  elsewhere."""
  pieces, dtype = [], segments[0].dtype
  rows, width = ((owner_rows(lay), lay.owner_row) if owners else
                 (second_order_rows(lay), lay.second_row))
  for row in rows:
    at = 0
    for owner, column in row:
      used = segments[owner][:lay.second_sizes[owner]]
      pieces += [xp.zeros(column - at, dtype), used]
      at = column + used.shape[0]
    pieces.append(xp.zeros(width - at, dtype))
  return xp.concatenate(pieces)


def second_order_base(lay: layout_lib.Layout, owner: int) -> int:
  """Start of `owner`'s segment in the global second-order array (its first
  copy, in its group's first device's part)."""
  return owner // lay.group_size * lay.group_size * lay.second_array + lay.second_base(owner)


def _on_host(x: Any) -> tuple[Any, Any]:
  """`(x, back)`: a concrete array of this process as numpy, which the
  readers below slice once per factor (each eager slice of a device array is
  a program of its own: a compile per factor shape, and of a multi-device
  array an SPMD program, where XLA's CPU runtime has aborted under load), and
  `back`, which makes a result of a device array one again. Traced arrays
  and arrays of several processes stay as they are."""
  if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array)
                                        and not x.is_fully_addressable):
    return x, lambda tree: tree
  back = ((lambda tree: jax.tree_util.tree_map(jnp.asarray, tree))
          if isinstance(x, jax.Array) else (lambda tree: tree))
  return np.asarray(x), back


def _one_state(state: Any, caller: str) -> ScaleByKfacState:
  """`state` itself, or the one K-FAC state in an optax state tree (`kd.kfac`'s
  chain state, `optax.inject_hyperparams`'...)."""
  if isinstance(state, ScaleByKfacState):
    return state
  found = states.find_states(state, ScaleByKfacState)
  if len(found) != 1:
    raise TypeError(
        f"kd.{caller}: state must be a kd.ScaleByKfacState or an optax state holding "
        f"exactly one; got a {type(state).__name__} holding {len(found)}. Pick one "
        "with kd.find_states(opt_state).")
  return found[0]


def running_factors(state: Any) -> dict[str, dict[str, jax.Array]]:
  """`{layer: {"A": A, "G": G}}` (`{"F": F}`, `[C, 3]`, for a unit-wise layer)
  of a global (not per-device) state; diagonal factors come back as their
  diagonal. `state`: a `ScaleByKfacState`, or an optax state holding one."""
  state = _one_state(state, "running_factors")
  lay, (running, back) = state.layout, _on_host(state.factors)
  out = {}
  for plan in lay.plans:
    out[plan.layer.name] = {}
    for which, place in plan.places:
      start = lay.factor_start(place)
      flat = running[start:start + place.size]
      flat = flat.astype(jnp.promote_types(flat.dtype, jnp.float32))
      if place.form == statistics.DIAG:
        value = flat
      elif place.form == statistics.UNIT:
        value = flat.reshape(place.dim, 3)
      elif lay.packed:
        value = triangles.unpack_upper(flat, place.dim)
      else:
        value = flat.reshape(place.dim, place.dim)
      out[plan.layer.name][which.upper()] = value
  return back(out)


def second_order_parts(state: Any) -> dict[str, dict[str, Any]]:
  """`{layer: {"A": (matrix, vector), "G": ...}}` of a global (not per-device)
  state: eigenbasis and eigenvalues ("eigen") or damped inverse ("inverse"),
  `None` where a factor has no such part (diagonal and unit-wise factors keep
  only a vector, `[d]` or `[d, 3]`); with EK-FAC, also `"S"`, a corrected
  layer's scaling `s` `[d_A, d_G]` in those eigenbases (George et al. 2018).
  `state` as for `running_factors`."""
  state = _one_state(state, "second_order_parts")
  lay, (second, back) = state.layout, _on_host(state.second_order)
  out = {}
  for plan in lay.plans:
    out[plan.layer.name] = {}
    for which, place in plan.places:
      out[plan.layer.name][which.upper()] = packing.read_parts(
          second, lambda q: second_order_base(lay, q.owner), place)
  if state.correction is not None:
    scaling = _on_host(state.correction.scaling)[0]
    for name, s in correction_lib.layer_scaling(
        lay, dataclasses.replace(state.correction, scaling=scaling)).items():
      out[name]["S"] = s
  return back(out)
