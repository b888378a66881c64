"""`kd.describe`: the registration table of every K-FAC state in an optax state."""

from __future__ import annotations

from typing import Any

import numpy as np

from kfac_jax_dist import factors
from kfac_jax_dist.kfac import ScaleByKfacState
from kfac_jax_dist.kfac import find_states
from kfac_jax_dist import layout as layout_lib


def _slot_bytes(state: ScaleByKfacState, slot: layout_lib.Slot) -> int:
  total = 0
  for tree in (state.factors, state.eigvecs, state.eigvals, state.inverses):
    if slot.bucket in tree:
      arr = tree[slot.bucket]
      total += int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
  return total


def _factor(form: str, dim: int) -> str:
  return f"{dim}x{dim}" if form == factors.FULL else f"diag({dim})"


def table(state: ScaleByKfacState) -> str:
  lay = state.layout
  rows = [("layer", "kind", "parameters", "A", "G", "owner", "bytes")]
  for plan in lay.plans:
    layer = plan.layer
    params = layer.kernel_path + (f", {layer.bias_path}" if layer.bias_path else "")
    owners = sorted({lay.owner(plan.a), lay.owner(plan.g)})
    rows.append((layer.name, layer.kind, params, _factor(plan.a_form, layer.a_dim),
                 _factor(plan.g_form, layer.g_dim), ",".join(map(str, owners)),
                 f"{_slot_bytes(state, plan.a) + _slot_bytes(state, plan.g):,}"))
  for name in lay.skipped:
    rows.append((name, "skipped", "-", "-", "-", "-", "0"))
  for path in lay.passthrough:
    rows.append(("-", "untagged", path, "-", "-", "-", "0"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  total = sum(int(np.prod(a.shape)) * a.dtype.itemsize
              for tree in (state.factors, state.eigvecs, state.eigvals, state.inverses)
              for a in tree.values())
  buckets = ", ".join(f"{b.key}[{b.size}]" for b in lay.buckets)
  lines.append(f"buckets: {buckets}; K-FAC state: {total:,} bytes")
  return "\n".join(lines)


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
