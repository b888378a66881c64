"""The K-FAC cost model: bytes per step and state per device of a strategy.

For a `Distribution` and the layout `build_layout` gives it, every collective
the K-FAC step runs over the data axis, per device, ring model (an
all-reduce of N numbers sends 2(P−1)/P·N, a reduce-scatter of N numbers
in and an all-gather of N out (P−1)/P·N, a ppermute N), in `bytes_per_number`
(4: float32), by the steps it runs on:

* every step: the tagged gradients' reduction: the caller's (or
  `gradient_reduction="all_reduce"`'s) all-reduce, 2(P−1)/P·Σ a·g, or
  SP-NGD's uneven reduce-scatter to the owners; MEM-OPT's uneven all-gather
  of the preconditioned gradients, HYBRID's all-gather among the devices of
  equal rank in their groups, (G−1)·S (no fault check: every device reads
  the gradients, reduced, through the updates it produces alike);
* factor steps: the statistics to their owners: reduce-scatter of the tight
  chunks (P−1)·C or of the owner segments (P−1)·L, or KAISA's all-reduce of
  every factor 2(P−1)/P·T (DP-KFAC: nothing); the fault check's int32; with
  layers that may sit out a pass, the psum of their positions, 2(P−1)/P·Σ
  their blocks (not under DP-KFAC, whose owners count their own batches);
* inverse (decomposition) steps: chunked storage gathers the chunks, (P−1)·C;
  COMM-OPT sends every owner's second-order segment to every device (the
  uneven all-gather of `Layout.second_sizes`), HYBRID's within each group
  (of `Layout.second_capacity`, the same ranks' slots in every group).

The uneven collectives cost what `uneven.plan` picks. The untagged
parameters' all-reduce (the same under every strategy) is left out. This is
the model `benchmarks/comm_volume.py` checks against the compiled HLO.

State per device: the running factors (`C` or `L` numbers) and the
second-order state (`Layout.second_array`: a group's devices each hold the
whole group's segments one after another; with one group, every owner's);
`kfac_state_bytes` adds the running weights of the layers that may sit out a
pass.

`kfac_step_bytes` and `kfac_state_bytes` price a whole `KfacConfig`: its
dtypes, and stale statistics' and EK-FAC's own state and collectives (see
there). They count the bytes the program asks for: XLA:CPU promotes 16-bit
collectives to float32 (its compiled HLO shows f32 reduce-scatters for a
bfloat16 `comm_dtype`), so there the saving shows only on accelerators.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist.capture import registry
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.core import faults
from kfac_jax_dist.core import uneven
from kfac_jax_dist.kfac import config as config_lib
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import stale as stale_lib
from kfac_jax_dist.kfac import transform

Terms = tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class StepBytes:
  """Bytes per device of one strategy's collectives, one `(name, bytes)` term
  per collective, by step kind (`inverse` steps are also factor steps)."""

  plain: Terms
  factor: Terms
  inverse: Terms

  def total(self, kind: str) -> float:
    """Bytes of a whole step of `kind`: "plain", "factor" or "inverse"."""
    kinds = {"plain": (self.plain,), "factor": (self.plain, self.factor),
             "inverse": (self.plain, self.factor, self.inverse)}[kind]
    return sum(b for terms in kinds for _, b in terms)

  def amortised(self, factor_every: int, inverse_every: int) -> float:
    """Mean bytes per step at this cadence."""
    return (sum(b for _, b in self.plain) + sum(b for _, b in self.factor) / factor_every
            + sum(b for _, b in self.inverse) / inverse_every)


def uneven_terms(sizes: Sequence[int], what: str, gather: bool,
                 bytes_per_number: int = 4, psum: bool = True) -> list[tuple[str, float]]:
  """The uneven all-gather (`gather`) or reduce-scatter of per-device `sizes`
  (`psum`: over the whole axis; else within groups, by rank) in the scheme
  `uneven.plan` picks: one term per collective (ppermutes: the busiest
  device's sends or receives)."""
  p = len(sizes)
  scheme = uneven.plan(tuple(int(u) for u in sizes), psum)
  if isinstance(scheme, uneven.Prefix):
    over = sum(scheme.overflow)
    terms = [(f"{what} prefix (P-1)·S, S={scheme.length}", (p - 1) * scheme.length)]
    if over:
      terms.append((f"{what} overflow psum ({over})", 2 * (p - 1) / p * over))
  else:
    sent = scheme.device_bytes()[1 if gather else 0]
    terms = [(f"{what} tight chunks (P-1)·C, C={scheme.chunk}", (p - 1) * scheme.chunk),
             (f"{what} ppermutes ({len(scheme.sends)})", sent - (p - 1) * scheme.chunk)]
  return [(name, n * bytes_per_number) for name, n in terms]


def _joint_ppermutes(terms: list, sizes: Sequence[int], bytes_per_number: int) -> list:
  """SP-NGD's reduce-scatter and gather in the rechunk scheme: their ppermutes
  as one term, the most one device sends over both (a host sends in the
  reduce-scatter, an owner in the gather)."""
  scheme = uneven.plan(tuple(int(u) for u in sizes))
  if not isinstance(scheme, uneven.Rechunk) or not scheme.sends:
    return terms
  hosted, owned = scheme.forwarded()
  return [t for t in terms if "ppermutes" not in t[0]] + [
      (f"grad RS + AG ppermutes ({2 * len(scheme.sends)})",
       float((hosted + owned).max()) * bytes_per_number)]


def _gradient_terms(lay: layout_lib.Layout, gradient_reduction: str,
                    bytes_per_number: int) -> list[tuple[str, float]]:
  """Every step: the tagged gradients' reduction and gather."""
  p, m, g = lay.num_devices, lay.group_size, lay.num_groups
  r, n = (p - 1) / p, bytes_per_number
  _, group_sizes, s = layout_lib.gradient_offsets(lay)
  tagged = sum(plan.layer.a_dim * plan.layer.g_dim for plan in lay.plans)
  terms = []
  if gradient_reduction == "reduce_scatter":
    if m == 1 < g:
      terms += uneven_terms(group_sizes, "grad RS", False, n)
    else:
      terms.append(("grad RS [G·S] + AG in group", (r * g * s + (m - 1) * s / m) * n))
  else:
    terms.append(("all-reduce of the tagged gradients", 2 * r * tagged * n))
  if g > 1 and m == 1:
    terms += uneven_terms(group_sizes, "grad AG", True, n)
    if gradient_reduction == "reduce_scatter":
      terms = _joint_ppermutes(terms, group_sizes, n)
  elif g > 1:
    terms.append(("grad AG among equal ranks (G-1)·S", (g - 1) * s * n))
  return terms


def _stored_numbers(lay: layout_lib.Layout) -> int:
  """`T`: the numbers of every running factor as stored (packed or not)."""
  return sum(place.size for plan in lay.plans for _, place in plan.places)


def _fault_check(p: int) -> tuple[str, float]:
  """The psum of the devices' int32 verdicts on the statistics."""
  return ("fault-check psum (statistics)", 2 * (p - 1) / p * 4)


def _stored_checks(config: config_lib.KfacConfig, p: int) -> list[tuple[str, float]]:
  """`stored_verdict`'s int32 psum where the running factors are stored
  narrower than the compute dtype (a 16-bit `factor_dtype`): whether they
  stayed finite as stored (EK-FAC's scaling is kept in the compute dtype)."""
  if not faults.narrower(config.factor_dtype, config.compute_dtype):
    return []
  return [("fault-check psum (factors as stored)", 2 * (p - 1) / p * 4)]


def _positions_numbers(lay: layout_lib.Layout) -> int:
  """The positions counted for the layers that may sit out a pass: one per
  block (`[*stack]` per layer's statistics, `factors.positions`)."""
  stacks = {plan.layer.stats_name: plan.layer.stack
            for plan in layout_lib.sit_out_plans(lay)}
  return sum(math.prod(stack) for stack in stacks.values())


def _positions_psum(lay: layout_lib.Layout, bytes_per_number: int = 4
                    ) -> list[tuple[str, float]]:
  """`factors.positions`' psum of the counts of the layers that may sit out a
  pass, 2(P−1)/P·Σ their blocks, in the statistics' dtype (float32 for a
  float32 or 16-bit model; XLA may send the layers' counts as one all-reduce
  or several, the same bytes); none without such layers."""
  n, p = _positions_numbers(lay), lay.num_devices
  if not n or p == 1:
    return []
  return [(f"positions psum 2(P-1)/P·{n}", 2 * (p - 1) / p * n * bytes_per_number)]


def step_bytes(lay: layout_lib.Layout, factor_reduction: str, gradient_reduction: str,
               bytes_per_number: int = 4, *, factor_traffic_bytes: int | None = None,
               factor_bytes: int | None = None, second_bytes: int | None = None
               ) -> StepBytes:
  """The collectives of the K-FAC step with layout `lay` (see the module
  docstring), per device; one device: none. Numbers are `bytes_per_number`
  bytes, except the statistics on their way to the owners
  (`factor_traffic_bytes`: `comm_dtype`'s), the running factors' chunks
  (`factor_bytes`) and the second-order state (`second_bytes`). Layers
  that may sit out a pass add the psum of their positions on factor steps
  (the running factors' own: none under DP-KFAC)."""
  p, m, g = lay.num_devices, lay.group_size, lay.num_groups
  if p == 1:
    return StepBytes((), (), ())
  n = bytes_per_number
  traffic, stored, second = (n if b is None else b
                             for b in (factor_traffic_bytes, factor_bytes, second_bytes))
  r = (p - 1) / p
  total = _stored_numbers(lay)
  factor = [_fault_check(p)] + ([] if lay.local_factors else _positions_psum(lay, n))
  inverse = []
  chunked = lay.factor_storage == layout_lib.CHUNKED
  if factor_reduction == "reduce_scatter":
    factor.append((f"factor RS (P-1)·{'C' if chunked else 'L'}",
                   (p - 1) * lay.factor_shard * traffic))
    if chunked:
      inverse.append(("chunk AG (P-1)·C", (p - 1) * lay.factor_shard * stored))
  elif factor_reduction == "all_reduce":
    factor.append(("factor all-reduce 2(P-1)/P·T", 2 * r * total * traffic))
  inverse += second_order_terms(lay, second)
  return StepBytes(tuple(_gradient_terms(lay, gradient_reduction, n)), tuple(factor),
                   tuple(inverse))


def second_order_terms(lay: layout_lib.Layout, second_bytes: int
                       ) -> list[tuple[str, float]]:
  """Decomposition steps: COMM-OPT's uneven all-gather of every owner's
  second-order segment, HYBRID's within each group (each rank's slot)."""
  if lay.num_groups == 1:
    return uneven_terms(lay.second_sizes, "second-order AG", True, second_bytes)
  if lay.group_size > 1:
    return uneven_terms(lay.second_capacity, "second-order AG in group", True,
                        second_bytes, psum=False)
  return []


def state_bytes(lay: layout_lib.Layout, factor_bytes: int = 4, second_bytes: int = 4
                ) -> int:
  """K-FAC's state per device: running factors (`C` or `L` numbers of
  `factor_bytes`) and second-order state (`Layout.second_array`: the group's
  segments, with one group every owner's, one after another, of `second_bytes`)."""
  return lay.factor_shard * factor_bytes + lay.second_array * second_bytes


def _itemsize(dtype: Any) -> int:
  return int(jnp.dtype(dtype).itemsize)


def _corrected_numbers(lay: layout_lib.Layout) -> int:
  """EK-FAC's scaling: `d_A·d_G` numbers per corrected layer."""
  return sum(plan.layer.a_dim * plan.layer.g_dim
             for plan, _ in correction_lib.corrected_plans(lay))


def _correction_terms(config: config_lib.KfacConfig, lay: layout_lib.Layout
                      ) -> tuple[list, list]:
  """EK-FAC's collectives: (on factor steps, on decomposition steps); with
  layers that may sit out a pass, its own psum of their positions (whether
  each ran on any device, under DP-KFAC too) on factor steps."""
  if config.eigenvalue_correction is None:
    return [], []
  p, compute = lay.num_devices, _itemsize(config.compute_dtype)
  scaling = [("EK-FAC S all-reduce 2(P-1)/P·Σ d_A·d_G",
              2 * (p - 1) / p * _corrected_numbers(lay) * compute)] + _positions_psum(lay)
  if lay.num_groups == 1:
    return scaling, []
  return scaling, uneven_terms(lay.read_sizes, "EK-FAC eigenbases AG", True,
                               _itemsize(config.second_dtype))


def _inverse_terms(config: config_lib.KfacConfig, lay: layout_lib.Layout
                   ) -> list[tuple[str, float]]:
  """method="inverse", decomposition steps: every device's factor traces (for
  π) and failure flags (a layer's two inverses are kept together), each
  `[max_factors]`, all-gathered (`decompositions.pi_damping`,
  `paired_failures`)."""
  if config.method != "inverse":
    return []
  each = _itemsize(config.compute_dtype) + 4
  return [("π traces + failure flags AG (P-1)·F", (lay.num_devices - 1)
           * lay.max_factors * each)]


def _stale_step_bytes(config: config_lib.KfacConfig, lay: layout_lib.Layout,
                      plain: Terms, traffic: int) -> StepBytes:
  """Stale statistics' steps (see `kfac_step_bytes`); the positions' psum of
  the layers that may sit out a pass runs on every step (with EK-FAC's own,
  the same counts, XLA sends one)."""
  p, r = lay.num_devices, (lay.num_devices - 1) / lay.num_devices
  decisions = ("refresh decisions psum 2(P-1)/P·8F",
               2 * r * 8 * len(stale_lib.factor_order(lay)))
  total = _stored_numbers(lay)
  refreshed = ([] if config.factor_reduction == "local" else
               [("refreshed factors' all-reduces 2(P-1)/P·T", 2 * r * total * traffic)])
  scaling, bases = _correction_terms(config, lay)
  any_refresh = ([_fault_check(p)] + _stored_checks(config, p) + scaling
                 + second_order_terms(lay, _itemsize(config.second_dtype)) + bases
                 + _inverse_terms(config, lay))
  return StepBytes(plain + (decisions, *_positions_psum(lay)), tuple(refreshed),
                   tuple(any_refresh))


def kfac_step_bytes(config: config_lib.KfacConfig, lay: layout_lib.Layout) -> StepBytes:
  """`step_bytes` of the step `config` describes: the statistics travel in
  `comm_dtype` (else the compute dtype, float32 at least: they are averaged
  in it before being stored in `factor_dtype`), the second-order state in
  `second_order_dtype` (else the compute dtype), and the options add their
  own collectives:

  * EK-FAC: the batch's `S` averaged over the devices, 2(P−1)/P·Σ d_A·d_G (and
    the positions' psum of the layers that may sit out a pass), on factor
    steps; with several owner groups, every device's second-order
    segment all-gathered on decomposition steps, (P−1)·L₂
    (`correction.gather_owners`).
  * stale statistics (SP-NGD §4.3): every step, the refresh decisions' psum
    (an int32 pair per factor) and, with layers that may sit out a pass, of
    their positions; a refreshed factor is all-reduced on its own,
    2(P−1)/P·its size (the "factor" terms: every factor once, amortised over
    the mean steps between a factor's refreshes); a step that refreshes any
    factor (the "inverse" terms) runs the fault check's psum, EK-FAC's, and
    sends the second-order state as a decomposition step does.
  * method="inverse": the factors' traces and failure flags gathered on
    decomposition steps (`_inverse_terms`).
  """
  dist = config.distribution
  if dist is None or lay.num_devices == 1:
    return StepBytes((), (), ())
  stored = _itemsize(config.factor_dtype)
  traffic = _itemsize(config.compute_dtype if dist.comm_dtype is None else dist.comm_dtype)
  base = step_bytes(lay, dist.factor_reduction, dist.gradient_reduction,
                    factor_traffic_bytes=traffic, factor_bytes=stored,
                    second_bytes=_itemsize(config.second_dtype))
  if config.stale_threshold is not None:
    return _stale_step_bytes(config, lay, base.plain, traffic)
  scaling, bases = _correction_terms(config, lay)
  scaling += _stored_checks(config, lay.num_devices)
  return StepBytes(base.plain, base.factor + tuple(scaling),
                   base.inverse + tuple(bases) + tuple(_inverse_terms(config, lay)))


def stale_state_bytes(lay: layout_lib.Layout, factor_bytes: int, second_bytes: int
                      ) -> int:
  """Stale statistics' state per device: `X₋₂` laid out as the running
  factors (`X₋₁` is the running factor) and the refresh schedule (4 int32 and
  one compute-dtype number per factor and an int32 count, replicated)."""
  return (lay.factor_shard * factor_bytes
          + len(stale_lib.factor_order(lay)) * (4 * 4 + second_bytes) + 4)


def correction_state_bytes(lay: layout_lib.Layout, second_bytes: int,
                           scaling_bytes: int | None = None) -> int:
  """EK-FAC's state per device: the scaling (`Σ d_A·d_G`, replicated, of
  `scaling_bytes`, float32 at least; None: `second_bytes`), one flag per
  corrected layer and, with several owner groups, every owner's second-order
  segment in rows (`Layout.owner_array`)."""
  gathered = lay.owner_array if lay.num_groups > 1 else 0
  scaling_bytes = second_bytes if scaling_bytes is None else scaling_bytes
  return (_corrected_numbers(lay) * scaling_bytes + gathered * second_bytes
          + len(correction_lib.corrected_plans(lay)))


def marked_state_bytes(lay: layout_lib.Layout, second_bytes: int) -> int:
  """The running weights `w_l` of the layers (blocks) that may sit out a
  pass (`ScaleByKfacState.marked_weight`: `[M]` replicated, or DP-KFAC's
  `[P·M]` sharded, M per device either way)."""
  return len(layout_lib.sit_out_plans(lay)) * second_bytes


def kfac_state_bytes(config: config_lib.KfacConfig, lay: layout_lib.Layout) -> int:
  """The K-FAC state per device of the step `config` describes: `state_bytes`
  in its dtypes, with `stale_state_bytes` and `correction_state_bytes` where
  those options are on, and `marked_state_bytes` where layers may sit out a
  pass (stale statistics keep a weight per factor anyway: none there)."""
  stored, compute = _itemsize(config.factor_dtype), _itemsize(config.compute_dtype)
  second = _itemsize(config.second_dtype)
  total = state_bytes(lay, stored, second)
  if config.stale_threshold is not None:
    total += stale_state_bytes(lay, stored, compute)
  else:
    total += marked_state_bytes(lay, compute)
  if config.eigenvalue_correction is not None:
    total += correction_state_bytes(lay, second, _itemsize(
        jnp.promote_types(config.second_dtype, jnp.float32)))
  return total


def layer_paths(layers: registry.LayerRegistry) -> tuple[str, ...]:
  """The parameter paths of the tagged layers (what `layout.build` needs when
  the parameters themselves are not at hand)."""
  return tuple(path for layer in layers for path in (layer.kernel_path, layer.bias_path)
               if path is not None)


# ------------------------------------------------------- choosing a strategy

@dataclasses.dataclass(frozen=True)
class Candidate:
  """One strategy, its layout's storage, bytes per step and state per device."""

  group_size: int
  factor_reduction: str
  gradient_reduction: str
  storage: str
  bytes: StepBytes
  amortised: float
  state: int

  def label(self, num_devices: int) -> str:
    m = self.group_size
    name = ("COMM-OPT" if m == num_devices else "MEM-OPT" if m == 1 else "HYBRID-OPT")
    sp = ", SP-NGD gradients" if self.gradient_reduction == "reduce_scatter" else ""
    return (f"{name} (grad_worker_fraction {m}/{num_devices}, factor_reduction "
            f"{self.factor_reduction!r}{sp}; {self.storage} factor storage)")

  def words(self, num_devices: int) -> str:
    return (f"{self.label(num_devices)}: {_mb(self.amortised)} per step amortised "
            f"(plain {_mb(self.bytes.total('plain'))}, factor steps +"
            f"{_mb(self.bytes.total('factor') - self.bytes.total('plain'))}, inverse "
            f"steps +{_mb(self.bytes.total('inverse') - self.bytes.total('factor'))}), "
            f"K-FAC state {_mb(self.state)} per device")


def _mb(n: float) -> str:
  """Bytes in words: "9.43 MB", "11.2 GB", "7 bytes"."""
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.3g} bytes"


def candidates(setup_of: Callable[[int, str, str], tuple[config_lib.KfacConfig,
                                                         layout_lib.Layout]],
               num_devices: int, factor_every: int, inverse_every: int,
               factor_reductions: Sequence[str] = ("reduce_scatter", "all_reduce")
               ) -> list[Candidate]:
  """Every strategy `Distribution.auto` considers, cheapest first (ties: less
  state): each group size `m` dividing P, each of `factor_reductions`,
  gradients averaged by the caller or reduce-scattered to their owners
  (SP-NGD). DP-KFAC's local factors are left out: they change the factors,
  not only their cost; so are layouts whose per-device state passes int32
  offsets (`layout.addressable`). `setup_of(m, factor_reduction,
  gradient_reduction)` is the config and layout the transform would build."""
  found = []
  for m in (d for d in range(1, num_devices + 1) if num_devices % d == 0):
    for factor_reduction in factor_reductions:
      for gradient_reduction in (("none", "reduce_scatter") if num_devices > 1
                                 else ("none",)):
        config, lay = setup_of(m, factor_reduction, gradient_reduction)
        if not layout_lib.addressable(lay):
          continue
        b = kfac_step_bytes(config, lay)
        found.append(Candidate(m, factor_reduction, gradient_reduction,
                               lay.factor_storage, b, b.amortised(factor_every,
                                                                  inverse_every),
                               kfac_state_bytes(config, lay)))
  return sorted(found, key=lambda c: (round(c.amortised, 3), c.state, -c.group_size))


def choose(found: list[Candidate], num_devices: int, memory_budget: float | None
           ) -> tuple[Candidate, Candidate | None, tuple[str, ...]]:
  """The cheapest candidate whose state fits `memory_budget` (bytes per
  device; None: any), the runner-up, and the explanation in words."""
  fits = [c for c in found if memory_budget is None or c.state <= memory_budget]
  if not fits:
    least = min(found, key=lambda c: c.state)
    raise ValueError(
        f"Distribution.auto: memory_budget={memory_budget:,.0f} bytes per device is below "
        f"the smallest K-FAC state of any strategy, {least.state:,} bytes "
        f"({least.label(num_devices)}); raise it, or pass max_factor_dim= to keep the "
        "largest factors diagonal.")
  best, runner = fits[0], (fits[1] if len(fits) > 1 else None)
  budget = ("" if memory_budget is None else
            f" under memory_budget {_mb(memory_budget)} ({len(fits)} of {len(found)} "
            "strategies fit)")
  lines = [f"Distribution.auto chose, of {len(found)} strategies{budget}, the fewest "
           "bytes per step:", "  " + best.words(num_devices) + "."]
  if runner is not None:
    lines.append("  runner-up: " + runner.words(num_devices) + ".")
  return best, runner, tuple(lines)


KFAC_OPTIONS = ("method", "max_factor_dim", "skip", "factor_dtype", "second_order_dtype",
                "stale_threshold", "eigenvalue_correction")
DISTRIBUTION_OPTIONS = ("symmetric_comm", "comm_dtype")


def _check_auto_arguments(layers: Any, factor_update_every: Any,
                          inverse_update_every: Any, memory_budget: Any,
                          options: dict) -> None:
  if not isinstance(layers, registry.LayerRegistry):
    raise TypeError("Distribution.auto: layers must be grad_fn.discover(params, ...)'s "
                    f"LayerRegistry, got {type(layers).__name__}")
  for name, every in (("factor_update_every", factor_update_every),
                      ("inverse_update_every", inverse_update_every)):
    if not (isinstance(every, numbers.Integral) and not isinstance(every, bool)
            and every >= 1):
      raise ValueError(f"Distribution.auto: {name} must be a positive int (the "
                       f"cadence the choice amortises over), got {every!r}")
  if memory_budget is not None and not (
      isinstance(memory_budget, numbers.Real) and not isinstance(memory_budget, bool)
      and math.isfinite(memory_budget) and memory_budget > 0):
    raise ValueError("Distribution.auto: memory_budget must be None or a positive "
                     f"number of bytes per device, got {memory_budget!r}")
  unknown = set(options) - set(KFAC_OPTIONS) - set(DISTRIBUTION_OPTIONS)
  if unknown:
    raise TypeError(f"Distribution.auto: unknown argument(s) {sorted(unknown)}; the "
                    f"options are kd.kfac's {', '.join(KFAC_OPTIONS)} and "
                    f"kd.Distribution's {', '.join(DISTRIBUTION_OPTIONS)}.")
  if (options.get("stale_threshold") is not None
      and inverse_update_every > factor_update_every):
    raise ValueError(
        "Distribution.auto: with stale_threshold, factor_update_every is the mean number "
        "of steps between a factor's refreshes and inverse_update_every the mean number "
        "between steps that refresh any factor, so inverse_update_every <= "
        f"factor_update_every; got {inverse_update_every} > {factor_update_every}.")


def auto_distribution(mesh: jax.sharding.Mesh, axis: str,
                      layers: registry.LayerRegistry, *, memory_budget: float | None,
                      factor_update_every: int, inverse_update_every: int,
                      **options: Any) -> distribution_lib.Distribution:
  """`kd.Distribution.auto` (see there): each candidate's config and layout
  are the ones `scale_by_kfac` builds for it at init."""
  _check_auto_arguments(layers, factor_update_every, inverse_update_every, memory_budget,
                        options)
  factor_update_every, inverse_update_every = int(factor_update_every), int(
      inverse_update_every)
  base = distribution_lib.Distribution(
      mesh, axis, **{k: v for k, v in options.items() if k in DISTRIBUTION_OPTIONS})
  kfac_options = {k: v for k, v in options.items() if k in KFAC_OPTIONS}
  stale = kfac_options.get("stale_threshold") is not None
  # stale statistics refresh every factor on its own schedule (the config's
  # cadence is 1/1); the choice amortises over the given intervals
  cadence = ((1, 1) if stale else (factor_update_every, inverse_update_every))
  p = base.num_devices

  def setup_of(m: int, factor_reduction: str, gradient_reduction: str
               ) -> tuple[config_lib.KfacConfig, layout_lib.Layout]:
    dist = dataclasses.replace(base, grad_worker_fraction=m / p,
                               factor_reduction=factor_reduction,
                               gradient_reduction=gradient_reduction)
    config = config_lib.KfacConfig(
        distribution=dist, factor_update_every=cadence[0],
        inverse_update_every=cadence[1], **kfac_options)
    return config, transform.build_layout(config, collectives_lib.Collectives(dist),
                                          layers, layer_paths(layers))

  layout_lib.check_packable(setup_of(p, "reduce_scatter", "none")[1])
  # with stale statistics both reductions all-reduce each refreshed factor
  found = candidates(setup_of, p, factor_update_every, inverse_update_every,
                     ("reduce_scatter",) if stale else ("reduce_scatter", "all_reduce"))
  if not found:       # MEM-OPT holds the least per device: its error says why
    layout_lib.check_addressable(setup_of(1, "reduce_scatter", "none")[1])
  best, _, lines = choose(found, p, memory_budget)
  if stale:
    lines += ("  With stale statistics, a factor step is every factor refreshed once "
              f"(amortised over factor_update_every={factor_update_every} steps, the mean "
              "interval between a factor's refreshes) and an inverse step any step that "
              f"refreshes a factor (over inverse_update_every={inverse_update_every}).",)
  return dataclasses.replace(base, grad_worker_fraction=best.group_size / p,
                             factor_reduction=best.factor_reduction,
                             gradient_reduction=best.gradient_reduction,
                             explanation=lines)


distribution_lib.register_auto(auto_distribution)
