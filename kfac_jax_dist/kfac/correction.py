"""EK-FAC: K-FAC's eigenvalues replaced by the measured scaling in its eigenbasis.

Eigenvalue-corrected K-FAC (George et al. 2018, "Fast Approximate Natural
Gradient Descent in a Kronecker-factored Eigenbasis", Alg. 1) keeps K-FAC's
eigenbases `Q_A`, `Q_G` but divides by the second moment of the per-example
gradients projected into them instead of the Kronecker eigenvalues:

    s = E_u[(Q_Aᵀ ∇_u Q_G)²]          (elementwise square, [d_A, d_G]),
    Δ = Q_A [(Q_Aᵀ ∇ Q_G) / (s + γ)] Q_Gᵀ,

`∇_u` example u's gradient (its positions summed: `capture.statistics.
corrected_scaling`, the statistic `S`). `s` is the diagonal of the empirical
Fisher in that basis, the best diagonal there (Eq. 8); K-FAC's `v_A v_Gᵀ` is
its Kronecker approximation.

This library's cadence. The capture measures `S` on factor steps in the
eigenbases of the state it is given (those of the previous decomposition).
So that `S` and the basis always agree, an EK-FAC step preconditions with the
eigenbases the state held at its start: on a decomposition step the new
eigenbases are stored for the steps after (K-FAC uses them at once). On a
factor step the running `s` becomes the batch's `S` if the basis is new
(`fresh`), else `β s + (1 − β) S` (β = `factor_decay`); a decomposition resets
it to the new basis's `v_A v_Gᵀ` (fresh), which steps without statistics use
until the next factor step. With both intervals 1, each step uses the basis
of the step before and its own batch's `S`. Freshness is kept per layer: with
stale statistics (SP-NGD §4.3) a decomposition changes the eigenbases of some
layers only (those with a refreshed factor), and only theirs are reset.

Layers corrected: Dense, DenseGeneral and Conv layers whose `A` and `G` are
full matrices; the others (diagonal factors, embeddings, unit-wise layers)
keep K-FAC's preconditioning, from the second-order state the step started
with like the corrected ones (one array: a decomposition reaches them one
step later than under K-FAC). With a distribution, `S` is averaged over the
data axis (one all-reduce of gradient size on factor steps) and `s` is
replicated. Every device projects its own examples, so it needs every
eigenbasis: with one owner group (COMM-OPT) it has them; with several
(MEM-OPT, HYBRID-OPT, DP-KFAC) each device's own second-order segment is
all-gathered on decomposition steps into `CorrectionState.bases` (COMM-OPT's
broadcast, and its memory for the eigenbases). Under DP-KFAC those are the
eigenbases of the owners' local factors, and `S` is still the whole batch's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import statistics
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac.config import KfacConfig


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["scaling", "fresh", "bases"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CorrectionState:
  """EK-FAC's running scaling (replicated on every device).

  Attributes:
    scaling: every corrected layer's `s` (`[d_A, d_G]`, row-major), in
      layout order (`corrected_plans`).
    fresh: `[C]` bool, per corrected layer: whether its `scaling` is K-FAC's
      `v_A v_Gᵀ` of eigenbases that no factor step has measured yet (the next
      `S` replaces it).
    bases: with several owner groups (MEM-OPT, HYBRID-OPT), every owner's
      second-order segment in rows (`Layout.owner_slots`), gathered on
      decomposition steps so that every device can project its examples;
      None with one group, whose second-order array is already that.
  """

  scaling: jax.Array
  fresh: jax.Array
  bases: jax.Array | None = None


def is_corrected(plan: layout_lib.LayerPlan) -> bool:
  """A layer with full `A` and `G` factors (not unit-wise, not diagonal)."""
  return (not plan.layer.unitwise and not plan.layer.a_diagonal
          and plan.a_form == statistics.FULL and plan.g_form == statistics.FULL)


def corrected_plans(lay: layout_lib.Layout) -> list[tuple[layout_lib.LayerPlan, int]]:
  """`(plan, offset in CorrectionState.scaling)` of every corrected layer."""
  out, offset = [], 0
  for plan in lay.plans:
    if is_corrected(plan):
      out.append((plan, offset))
      offset += plan.layer.a_dim * plan.layer.g_dim
  return out


def owners_second(second: jax.Array, state: CorrectionState) -> jax.Array:
  """Every owner's second-order segment on this device, in the rows of
  `Layout.owner_slots`: the state's own array with one owner group, else the
  gathered one."""
  return second if state.bases is None else state.bases


def gather_owners(comm: collectives_lib.Collectives, lay: layout_lib.Layout,
                  second: jax.Array) -> jax.Array | None:
  """Several owner groups: each device's own `[L₂]` segment (of its group's
  array, in rows) gathered without padded traffic into every owner's
  segment in rows (`Layout.owner_slots`: the second-order bytes and array
  of COMM-OPT), but for devices that hold only copies of split layers
  (`Layout.read_sizes`); None with one group."""
  if lay.num_groups == 1:
    return None
  return comm.gather_uneven(packing.own_second_segment(comm, lay, second),
                            lay.read_sizes).in_rows(layout_lib.slot_rows(lay.owner_slots),
                                                    lay.owner_row)


def _runs(plans: list[layout_lib.LayerPlan]) -> list[list[layout_lib.LayerPlan]]:
  """`plans` cut into runs of consecutive blocks of a stacked layer whose
  factors are split alike (`layout.block_runs`): one read of the second-order
  state each, not one per block."""
  def split(plan: layout_lib.LayerPlan) -> tuple:
    return tuple(q.columns for p in (plan.a, plan.g) for q in (p,) + p.copies)
  return layout_lib.block_runs(plans, joins=lambda now, before: split(now) == split(before),
                               pieces=True)


def _run_parts(lay: layout_lib.Layout, second: jax.Array,
               run: list[layout_lib.LayerPlan], which: str, part: str) -> jax.Array:
  """`[k, d, d]` eigenbases (`part` "matrix_offset") or `[k, d]` eigenvalues
  ("vector_offset") of factor `which` of a run's layers, column slices put
  together, from every owner's segment (`owners_second`: the state's own
  array with one group, else the gathered one, in the rows of
  `Layout.owner_slots` either way)."""
  parts = packing.run_parts(lambda q: lay.owner_base(q.owner),
                            tuple(getattr(plan, which) for plan in run))
  matrices, vectors = packing.read_run(second, [p for p in parts if p.offset == part],
                                       lay.owner_row)
  return vectors if matrices is None else matrices


def bases(lay: layout_lib.Layout, second: jax.Array, names: tuple[str, ...]
          ) -> tuple[jax.Array, jax.Array] | None:
  """`(Q_A [k, d_A, d_A], Q_G [k, d_G, d_G])` of corrected layers (a stack's
  blocks), a run of consecutive blocks read at once; None unless all are
  corrected."""
  plans = [lay.plan(name) for name in names]
  if any(plan is None or not is_corrected(plan) for plan in plans):
    return None
  runs = _runs(plans)
  return tuple(packing.joined([_run_parts(lay, second, run, w, "matrix_offset")
                               for run in runs]) for w in ("a", "g"))


def _corrected_runs(lay: layout_lib.Layout) -> list[list[layout_lib.LayerPlan]]:
  """The corrected layers in `corrected_plans`' order, in `_runs`: what the
  scaling's stages read, write and check as one slice each."""
  return _runs([plan for plan, _ in corrected_plans(lay)])


def kfac_scaling(lay: layout_lib.Layout, second: jax.Array) -> jax.Array:
  """K-FAC's `v_A v_Gᵀ` of every corrected layer, as `CorrectionState.scaling`:
  in float32 at least (a 16-bit second-order state's eigenvalues are read
  up; the scaling is a running average, which 16 bits would stall)."""
  dtype = jnp.promote_types(second.dtype, jnp.float32)
  part = lambda run, which: _run_parts(lay, second, run, which, "vector_offset").astype(dtype)
  pieces = [jnp.einsum("ki,kj->kij", part(run, "a"), part(run, "g")).ravel()
            for run in _corrected_runs(lay)]
  return jnp.concatenate(pieces) if pieces else jnp.zeros(0, dtype)


def per_number(lay: layout_lib.Layout, flags: jax.Array) -> jax.Array:
  """Per-layer flags (`[C]`, `corrected_plans`' order) repeated over each
  layer's `d_A·d_G` numbers of `CorrectionState.scaling`: one broadcast per
  run of `_corrected_runs`."""
  pieces, first = [], 0
  for run in _corrected_runs(lay):
    layer, k = run[0].layer, len(run)
    pieces.append(jnp.broadcast_to(flags[first:first + k, None],
                                   (k, layer.a_dim * layer.g_dim)).ravel())
    first += k
  return jnp.concatenate(pieces) if pieces else jnp.zeros(0, flags.dtype)


def reset(lay: layout_lib.Layout, second: jax.Array, gathered: jax.Array | None,
          previous: CorrectionState | None = None, changed: jax.Array | None = None
          ) -> CorrectionState:
  """The scaling of new eigenbases: their `v_A v_Gᵀ`, fresh (`second`: this
  device's second-order array; `gathered`: every owner's segment, kept, with
  several owner groups). With `changed` (`[C]`, stale statistics), only those
  layers' eigenbases are new: the others keep `previous`' scaling."""
  owners = second if gathered is None else gathered
  scaling = kfac_scaling(lay, owners)
  if changed is None:
    fresh = jnp.ones(len(corrected_plans(lay)), bool)
    if previous is not None:         # typed as the state's (a model axis may vary it)
      fresh = _compat.as_varying(fresh, _compat.varying_axes(previous.fresh))
    return CorrectionState(scaling, fresh, gathered)
  return CorrectionState(jnp.where(per_number(lay, changed), scaling, previous.scaling),
                         changed | previous.fresh, gathered)


def layer_statistics(lay: layout_lib.Layout, stats: Any) -> list[jax.Array]:
  """The batch's `S` of every corrected layer, in layout order, `[k, d_A,
  d_G]` per run of `_corrected_runs` (consecutive blocks of a stacked layer:
  one slice of its stacked statistic)."""
  out = []
  for run in _corrected_runs(lay):
    layer = run[0].layer
    if statistics.CORRECTED not in stats[layer.stats_name]:
      raise ValueError(
          f"kfac_stats['{layer.stats_name}'] has no EK-FAC statistic 'S': compute the "
          "statistics with grad_fn(params, ..., opt_state=opt_state) so that the "
          "capture sees the eigenbases.")
    stat = stats[layer.stats_name][statistics.CORRECTED]
    blocks = stat.reshape((-1,) + stat.shape[len(layer.stack):])
    start = layer.block_number or 0
    out.append(blocks[start:start + len(run)])
  return out


def batch_scaling(config: KfacConfig, comm: collectives_lib.Collectives,
                  lay: layout_lib.Layout, stats: Any) -> jax.Array:
  """The batch's `S` of every corrected layer, flat, averaged over the data
  axis."""
  pieces = [x.astype(config.compute_dtype).ravel() for x in layer_statistics(lay, stats)]
  flat = jnp.concatenate(pieces) if pieces else jnp.zeros(0, config.compute_dtype)
  return comm.mean(flat)


def updated(config: KfacConfig, comm: collectives_lib.Collectives,
            lay: layout_lib.Layout, state: CorrectionState, stats: Any,
            ran: jax.Array | None = None) -> CorrectionState:
  """The running scaling after a factor step: the batch's `S` in layers with
  fresh eigenbases, its `factor_decay` running average in the others; where
  `ran` (`[C]`, None: every layer) says a layer did not run in the pass, its
  scaling as it was."""
  batch = batch_scaling(config, comm, lay, stats)
  decay = jnp.asarray(config.factor_decay, batch.dtype)
  scaling = jnp.where(per_number(lay, state.fresh), batch,
                      decay * state.scaling + (1 - decay) * batch)
  fresh = jnp.zeros_like(state.fresh)
  if ran is not None:
    scaling = jnp.where(per_number(lay, ran), scaling, state.scaling)
    fresh = state.fresh & ~ran
  return CorrectionState(scaling.astype(state.scaling.dtype), fresh, state.bases)


def scaling_reader(lay: layout_lib.Layout, state: CorrectionState
                   ) -> Callable[[Sequence[layout_lib.LayerPlan], Mapping[str, jax.Array]],
                                 jax.Array | None]:
  """`(plans, shift) -> s [k, d_A, d_G]` of layers of one shape (None for
  layers EK-FAC leaves alone), per run of consecutive blocks of a stack (they
  lie one after the other in `CorrectionState.scaling`): one slice, or one
  gather (`packing.read_at`) of layers that do not follow one another. In an
  owner groups' branch that several share, `shift[stack]`: how many blocks
  past the plans' own the running group's are (`precondition._shift`)."""
  offsets = {plan.layer.name: offset for plan, offset in corrected_plans(lay)}

  def read(plans: Sequence[layout_lib.LayerPlan], shift: Mapping[str, jax.Array]
           ) -> jax.Array | None:
    if plans[0].layer.name not in offsets:
      return None
    layer = plans[0].layer
    shape, size = (layer.a_dim, layer.g_dim), layer.a_dim * layer.g_dim
    pieces = []
    for run in layout_lib.block_runs(plans, pieces=True):
      starts = tuple(offsets[p.layer.name] for p in run)
      moved = shift.get(run[0].layer.stack_name)
      pieces.append(packing.read_at(state.scaling, starts, shape, state.scaling.shape[0])
                    if moved is None else lax.dynamic_slice_in_dim(
                        state.scaling, starts[0] + moved * size, len(run) * size
                    ).reshape((len(run),) + shape))
    return packing.joined(pieces)
  return read


def layer_scaling(lay: layout_lib.Layout, state: CorrectionState
                  ) -> dict[str, jax.Array]:
  """`{layer: s [d_A, d_G]}` of the corrected layers."""
  return {plan.layer.name: state.scaling[offset:offset + plan.layer.a_dim * plan.layer.g_dim
                                         ].reshape(plan.layer.a_dim, plan.layer.g_dim)
          for plan, offset in corrected_plans(lay)}
