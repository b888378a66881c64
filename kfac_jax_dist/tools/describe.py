"""`kd.describe`: the registration table of every K-FAC state in an optax state."""

from __future__ import annotations

from typing import Any

import numpy as np

from kfac_jax_dist.capture import statistics as factors
from kfac_jax_dist.core import uneven
from kfac_jax_dist.kfac.state import ScaleByKfacState
from kfac_jax_dist.kfac.state import find_states
from kfac_jax_dist.kfac import layout as layout_lib


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


def table(state: ScaleByKfacState) -> str:
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
    rows.append(("-", "untagged", path, "-", "-", "-", "0"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  total = sum(int(np.prod(a.shape)) * a.dtype.itemsize
              for a in (state.factors, state.second_order))
  lines.append(f"{lay.num_devices} device(s), {lay.num_groups} owner group(s); {lay.factor_storage} "
               f"factors, {lay.factor_shard:,} per device, L2={lay.second_segment:,}; "
               f"K-FAC state: "
               f"{total:,} bytes")
  schemes = _uneven_schemes(lay)
  if schemes:
    lines.append("uneven collectives: " + "; ".join(schemes))
  return "\n".join(lines)


def _scheme(sizes) -> str:
  scheme = uneven.plan(tuple(int(u) for u in sizes))
  if isinstance(scheme, uneven.Rechunk):
    return f"rechunk ({len(scheme.sends)} ppermutes)"
  return "prefix"


def _uneven_schemes(lay: layout_lib.Layout) -> list[str]:
  """How the uneven collectives travel (`uneven.plan`): COMM-OPT's eigenbasis
  broadcast and MEM-OPT's gradient gather (and its mirror, SP-NGD's
  reduce-scatter, when the layout keeps layers whole)."""
  if lay.num_devices == 1 or not lay.plans:
    return []
  if lay.num_groups == 1:
    return ["eigenbasis broadcast " + _scheme(lay.second_sizes)]
  if lay.group_size == 1:
    return ["gradient gather " + _scheme(layout_lib.gradient_offsets(lay)[1])]
  return []


def describe(opt_state: Any, print_table: bool = True) -> str:
  """Prints (and returns) layer, parameter paths, factor shapes, owner and bytes
  of every tagged layer, and the parameters passed through unpreconditioned."""
  states = find_states(opt_state)
  if not states:
    raise ValueError("opt_state holds no K-FAC state.")
  text = "\n\n".join(table(s) for s in states)
  if print_table:
    print(text)
  return text
