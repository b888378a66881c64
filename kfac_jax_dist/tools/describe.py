"""`kd.describe`: the registration table of every K-FAC, Shampoo and SOAP state
in an optax state."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import stacking
from kfac_jax_dist.capture import statistics as factors
from kfac_jax_dist.core import states as states_lib
from kfac_jax_dist.core import tensor_parallel
from kfac_jax_dist.core import uneven
from kfac_jax_dist.kfac.state import ScaleByKfacState
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.shampoo import blocks as blocks_lib
from kfac_jax_dist.shampoo.soap import ScaleBySoapState
from kfac_jax_dist.shampoo.state import ScaleByShampooState


def _factor(place: layout_lib.FactorPlace | None) -> str:
  if place is None:
    return "-"
  if place.form == factors.UNIT:
    return f"2x2 x {place.dim} (unit-wise)"
  return f"{place.dim}x{place.dim}" if place.form == factors.FULL else f"diag({place.dim})"


def _bytes(state: ScaleByKfacState, place: layout_lib.FactorPlace) -> int:
  """Running factor (once) and second-order state of every column slice."""
  second = 0
  for q in (place,) + place.copies:
    matrix, vector = layout_lib._second_parts(  # pylint: disable=protected-access
        q.dim, q.form, state.layout.method, q.columns)
    second += ((matrix if q.matrix_offset is not None else 0)
               + (vector if q.vector_offset is not None else 0))
  return (place.size * state.factors.dtype.itemsize
          + second * state.second_order.dtype.itemsize)


def table(state: ScaleByKfacState, shards: int = 1) -> str:
  """One row per tagged layer, skipped layer and parameter passed through,
  then `_summary` (of one model shard's state, kept for `shards` of them)."""
  lay = state.layout
  rows = [("layer", "kind", "parameters", "A", "G", "owner", "bytes")]
  for plan in lay.plans:
    layer = plan.layer
    at = "" if layer.stack_index is None else "[" + ",".join(map(str, layer.stack_index)) + "]"
    params = layer.kernel_path + at + (f", {layer.bias_path}{at}" if layer.bias_path else "")
    owners = sorted({q.owner for piece in plan.pieces for _, place in piece.places
                     for q in (place,) + place.copies})
    first = plan.f if plan.layer.unitwise else plan.a
    rows.append((layer.name, layer.kind, params, _factor(first), _factor(plan.g),
                 ",".join(map(str, owners)),
                 f"{sum(_bytes(state, place) for _, place in plan.places):,}"))
  for name in lay.skipped:
    rows.append((name, "skipped", "-", "-", "-", "-", "0"))
  for path in lay.passthrough:
    rows.append(("-", _untagged_kind(lay, path), path, "-", "-", "-", "0"))
  return "\n".join(_columns(rows) + [""] + _summary(state, shards))


def _untagged_kind(lay: layout_lib.Layout, path: str) -> str:
  """"uncaptured" for a parameter of a layer the capture could not tag (see
  `_uncaptured_lines`), "untagged" for any other parameter with no factor."""
  owner = stacking.owner_path(path)   # the parameter's module (the path may start with
  held = lambda where: owner == where or owner.endswith("/" + where)   # "params/")
  return "uncaptured" if any(held(where) for where, _, _ in lay.uncaptured) else "untagged"


def _uncaptured_lines(lay: layout_lib.Layout) -> list[str]:
  """One line per layer the capture ran but could not tag."""
  return [f"Uncaptured layer {where} ({kind}: {reason}): its parameters pass through "
          "unpreconditioned." for where, kind, reason in lay.uncaptured]


def _summary(state: ScaleByKfacState, shards: int = 1) -> list[str]:
  """The table's legend, then where the state lives, in words (one model
  shard's state, kept for `shards` of them: `tensor_parallel`)."""
  lay = state.layout
  p, m, groups = lay.num_devices, lay.group_size, lay.num_groups
  lines = ["A, G: a layer's Kronecker factors, of its inputs and of its output gradients:",
           "  d x d matrices; diag(d): kept diagonal; 2x2 x C (unit-wise): one 2x2 Fisher",
           "  per channel (scale-and-shift layers). owner: the device(s) that decompose",
           "  them. bytes: their running averages and second-order state."]
  if shards > 1:
    lines.append(f"One model shard's layers and state, kept for each of the {shards} "
                 f"model shards ({p * shards} devices).")
  if p == 1:
    lines.append("1 device.")
  else:
    lines.append(f"{p} devices in {groups} owner group{'s' * (groups > 1)} of {m}: a "
                 "group holds the second-order state of its layers and preconditions "
                 "their gradients.")
  if p == 1:
    storage = ""
  elif lay.factor_storage == layout_lib.CHUNKED:
    storage = f" (all owners' factors packed tight and cut into {p} equal chunks)"
  else:
    storage = " (each device's own factors, padded to the longest owner's)"
  lines.append(f"Running factors: {lay.factor_shard:,} numbers per device{storage}.")
  what = "eigenbases and eigenvalues" if lay.method == "eigen" else "damped inverses"
  lines.append(f"Second-order state ({what}): {lay.second_array:,} numbers per "
               f"device{_segments(lay)}.")
  if state.refresh is not None:
    lines.append(_stale_line(state))
  if state.correction is not None:
    lines.append(_correction_line(state))
  if state.marked_weight is not None:
    lines.append(_marked_line(state))
  per_device = states_lib.per_device_bytes(state, shards)
  on_all = (f" ({p * shards * per_device:,} on all {p * shards} devices)"
            if p * shards > 1 else "")
  lines.append(f"K-FAC state: {per_device:,} bytes per device{on_all}.")
  lines += list(lay.strategy_choice)
  lines += _uncaptured_lines(lay)
  schemes = _uneven_schemes(lay)
  if schemes:
    lines.append("uneven collectives: " + "; ".join(schemes) + f" (chosen for a latency "
                 f"of {uneven.LATENCY_NUMBERS:,} numbers per collective: "
                 "kfac_jax_dist.core.uneven.set_latency)")
  return lines


def _segments(lay: layout_lib.Layout) -> str:
  """What a device's second-order array holds when its group has several
  owners: their segments one after another (with several groups, one slot
  per rank, the longest of the groups' segments of that rank), in one row
  or rows as wide as int32 indices allow; and how much more than the owners
  use that is (the largest group's)."""
  m = lay.group_size
  if m == 1:
    return ""
  used = max(sum(lay.second_sizes[g * m:(g + 1) * m]) for g in range(lay.num_groups))
  rows = "" if lay.second_rows == 1 else f" in {lay.second_rows} rows of {lay.second_row:,}"
  return (f" (the segments of its group's {m} owners{rows}: "
          f"{lay.second_array / max(used, 1):.2f}x the {used:,} they use)")


def _marked_line(state: ScaleByKfacState) -> str:
  """The layers that may sit out a pass or run under a row mask, which keep
  running weights of their own."""
  plans = layout_lib.sit_out_plans(state.layout)
  parts = []
  for what, names in (
      ("may sit out a pass (inside a lax.cond / lax.switch branch or a lax.while_loop "
       "body", [p.layer.name for p in plans if p.layer.may_sit_out]),
      ("run under a row mask (kd.tags.row_mask", [p.layer.name for p in plans
                                                   if not p.layer.may_sit_out])):
    if names:
      shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6
                                      else "")
      parts.append(f"{len(names)} layer{'s' * (len(names) > 1)} {what}: {shown})")
  return ("; ".join(parts) + ": each averages only the positions it saw, with a running "
          "weight of its own.")


def _stale_line(state: ScaleByKfacState) -> str:
  """Stale statistics' part of the state, in words: `X₋₂` sharded as the
  running factors (`X₋₁` is the running factor), the schedule replicated, and
  the refresh intervals so far."""
  r, shard = state.refresh, state.layout.factor_shard
  line = (f"Stale statistics: every factor's value at the refresh before last (X₋₂; "
          f"X₋₁ is the running factor), {shard:,} numbers per device, and its refresh "
          f"schedule ({r.next_step.size} factors, replicated).")
  count, refreshes, steps = (_host_value(x) for x in (state.count, r.refreshes,
                                                       r.refresh_steps))
  if all(v is not None for v in (count, refreshes, steps)) and refreshes.sum() > 0:
    line += (f" After {int(count)} steps, {int(refreshes.sum()):,} refreshes: a factor "
             f"every {count * refreshes.size / refreshes.sum():.3g} steps on average, "
             f"some factor on {int(steps)} steps (every {count / steps:.3g}): "
             "Distribution.auto's factor_update_every and inverse_update_every with "
             "stale_threshold.")
  return line


def _host_value(x: Any) -> np.ndarray | None:
  """A replicated array's value on this host (its first local copy: no
  communication); None for an abstract or traced one."""
  if not isinstance(x, jax.Array) or _compat.traced(x):
    return None
  return np.asarray(x.addressable_data(0))


def _correction_line(state: ScaleByKfacState) -> str:
  """EK-FAC's part of the state, in words."""
  corr, lay = state.correction, state.layout
  corrected = len(correction_lib.corrected_plans(lay))
  line = (f"EK-FAC: the scaling s of {corrected} Dense/Conv layer"
          f"{'s' * (corrected != 1)}, {corr.scaling.size:,} numbers replicated on "
          "every device")
  if corr.bases is not None:
    line += (f", and every owner's eigenbases gathered for the capture, "
             f"{corr.bases.size:,} numbers per device")
  return line + "."


def _scheme(sizes, psum: bool = True) -> str:
  scheme = uneven.plan(tuple(int(u) for u in sizes), psum)
  if isinstance(scheme, uneven.Rechunk) and not scheme.sends:
    return "rechunk (one all_gather of equal chunks: no owner holds more than its chunk)"
  if isinstance(scheme, uneven.Rechunk):
    return (f"rechunk ({len(scheme.sends)} ppermutes: owners hold unequal amounts, so "
            "one all_gather moves equal chunks and the ppermutes forward what the "
            "largest owners hold beyond theirs)")
  if not sum(scheme.overflow):
    return "prefix (one all_gather of every owner's numbers, up to the longest's)"
  return ("prefix (owners hold unequal amounts: one all_gather of a prefix common to "
          "every owner, one psum of the rest)")


def _uneven_schemes(lay: layout_lib.Layout) -> list[str]:
  """How the uneven collectives travel (`uneven.plan`): COMM-OPT's eigenbasis
  broadcast, HYBRID's within each group (of each rank's slot) and MEM-OPT's
  gradient gather (and its mirror, SP-NGD's reduce-scatter, when the layout
  keeps layers whole)."""
  if lay.num_devices == 1 or not lay.plans:
    return []
  what = "eigenbasis" if lay.method == "eigen" else "inverse"
  if lay.num_groups == 1:
    return [f"{what} broadcast " + _scheme(lay.second_sizes)]
  if lay.group_size == 1:
    return ["gradient gather " + _scheme(layout_lib.gradient_offsets(lay)[1])]
  return [f"{what} gather within each group " + _scheme(lay.second_capacity, psum=False)]


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
  """Left-aligned columns, a rule under the header row."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return lines


def _merged(plan: blocks_lib.ParamPlan) -> str:
  """The merged shape; a stack's `S layers x (…)`, one layer's."""
  if plan.stack:
    return f"{plan.stack} layers x {tuple(plan.merged[1:])}"
  return str(tuple(plan.merged))


def _blocks(plan: blocks_lib.ParamPlan) -> str:
  """`n x (b₀, b₁)` per region shape: the blocks a parameter is cut into."""
  counts: dict[tuple[int, ...], int] = {}
  for region in plan.regions:
    counts[region.block] = counts.get(region.block, 0) + region.num_blocks
  return ", ".join(f"{n} x {tuple(block)}" for block, n in counts.items())


def _block_numbers(plan: blocks_lib.ParamPlan, soap: bool) -> int:
  """Numbers a parameter's blocks keep: a statistic and a root (SOAP: an
  eigenbasis) per axis, and SOAP's two moments of every block."""
  per_axis = sum(r.num_blocks * sum(d * d for d in r.block) for r in plan.regions)
  moments = sum(r.num_blocks * math.prod(r.block) for r in plan.regions) if soap else 0
  return 2 * per_axis + 2 * moments


def _diagonal_bytes(state: ScaleByShampooState | ScaleBySoapState, shards: int) -> list[int]:
  """Per parameter, the bytes of its diagonal method's accumulators: Shampoo's
  grafting ones (every parameter; none for "sgd" and "none"), SOAP's Adam
  moments of a parameter without blocks (one model shard's of `shards`)."""
  size = lambda tree: sum(a.size * a.dtype.itemsize
                          for a in jax.tree_util.tree_leaves(tree)) // shards
  plans = state.layout.params
  if isinstance(state, ScaleByShampooState):
    return [size(g) for g in state.graft] if state.graft else [0] * len(plans)
  moments = iter(zip(state.mu, state.nu))
  return [0 if plan.preconditioned else size(next(moments)) for plan in plans]


def shampoo_table(state: ScaleByShampooState | ScaleBySoapState, shards: int = 1) -> str:
  """One row per parameter: its merged shape, blocks, roots and owner
  groups (or the diagonal method it gets), then the placement in words (of
  one model shard's state, kept for `shards` of them: `tensor_parallel`)."""
  lay, soap = state.layout, isinstance(state, ScaleBySoapState)
  itemsize = state.statistics[0].dtype.itemsize if state.statistics else 4
  shard = f" of each of the {shards} model shards" if shards > 1 else ""
  rows = [("parameter", "shape", "merged", "blocks", "root" if not soap else "basis",
           "owner groups", "bytes")]
  for i, (plan, diagonal) in enumerate(zip(lay.params, _diagonal_bytes(state, shards))):
    if not plan.preconditioned:
      rows.append((plan.path, str(tuple(plan.shape)), "-", "diagonal ("
                   + ("Adam" if soap else "grafted") + ")", "-", "-", f"{diagonal:,}"))
      continue
    groups = sorted({g for region in (lay.block_groups[i] if lay.block_groups else ())
                     for g in region})
    rows.append((plan.path, str(tuple(plan.shape)), _merged(plan), _blocks(plan),
                 "eigh" if soap else f"H^(-1/{plan.exponent:g})",
                 ",".join(map(str, groups)) or "-",
                 f"{itemsize * _block_numbers(plan, soap) + diagonal:,}"))
  name = "SOAP" if soap else "Shampoo"
  p, m = lay.num_devices, lay.group_size
  lines = _columns(rows) + [
      "", "bytes: the blocks' statistics and "
      + ("eigenbases and their Adam moments, a diagonal parameter's Adam moments"
         if soap else "roots, and the grafting accumulators") + " (all devices together).",
      "1 device." if p == 1 else
      f"{p} devices in {lay.num_groups} owner group{'s' * (lay.num_groups > 1)} of {m}: "
      "each statistic lives on one device of its block's group.",
      f"Statistics: {lay.segment:,} numbers per device; "
      + ("eigenbases" if soap else "roots") + f": {m * lay.segment:,} per device"
      + (" (replicated: one owner group)." if lay.roots_replicated and p > 1 else "."),
      f"{name} state{shard}: {states_lib.per_device_bytes(state, shards):,} bytes per device."]
  return "\n".join(lines)


def _states_with_shards(opt_state: Any, kinds: tuple[type, ...]) -> list[tuple[Any, int]]:
  """Every state of `kinds` with the number of model shards it is kept for
  (1, or `M` inside a tensor-parallel `ModelShardedState`)."""
  node = lambda x: isinstance(x, kinds + (tensor_parallel.ModelShardedState,))
  found = []
  for x in jax.tree_util.tree_leaves(opt_state, is_leaf=node):
    if isinstance(x, tensor_parallel.ModelShardedState):
      found += [(s, x.sharding.size) for kind in kinds
                for s in states_lib.find_states(x.inner, kind)]
    elif isinstance(x, kinds):
      found.append((x, 1))
  return found


def describe(opt_state: Any, print_table: bool = True) -> str:
  """Prints (and returns) the table of every K-FAC, Shampoo and SOAP state in
  `opt_state`.

  K-FAC: one row per tagged layer (kind, parameter paths, factor shapes, owner
  devices, bytes), per skipped layer and per parameter passed through
  unpreconditioned; then a legend and, in words, the devices and owner groups,
  how the running factors and the second-order state are stored, the state's
  bytes per device and, when distributed, how the uneven collectives travel.
  Shampoo and SOAP: one row per parameter (shape, merged shape, blocks, root,
  owner groups, bytes, or the diagonal method it gets), then the placement
  and the state's bytes per device.

  Args:
    opt_state: an optax state holding `scale_by_kfac`, `scale_by_shampoo` or
      `scale_by_soap` states (global, as `tx.init` makes it).
    print_table: print the text as well as returning it.

  Returns:
    The text (the tables of several states separated by a blank line).

  Raises:
    ValueError: `opt_state` holds no K-FAC, Shampoo or SOAP state.
  """
  tables = [table(s, shards) for s, shards in _states_with_shards(
      opt_state, (ScaleByKfacState,))] + [shampoo_table(s, shards) for s, shards in
                                          _states_with_shards(opt_state, (
                                              ScaleByShampooState, ScaleBySoapState))]
  if not tables:
    raise ValueError("opt_state holds no K-FAC, Shampoo or SOAP state.")
  text = "\n\n".join(tables)
  if print_table:
    print(text)
  return text
