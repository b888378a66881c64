"""Shampoo's optimizer-state bytes per device for each `grad_worker_fraction`.

Same model as memory.py (`_common.CnnMlp`). For P = 2, 4, 8 host devices, the
state of `kd.shampoo(..., block_size=128, graft_type="adagrad")`
(scale_by_shampoo, add_decayed_weights, sgd with momentum) is built with
`tx.init` and placed with `kd.shard_state`; the bytes of every leaf's shard on
each device are summed from the placed arrays (`addressable_shards`): the
Shampoo state alone (`ScaleByShampooState`: count, statistics, roots and the
replicated AdaGrad grafting accumulators) and the whole optax state (adds the
replicated momentum).

COMM-OPT (fraction 1) replicates every statistic and root: `2 T` numbers,
`T = Σ n d²` over the buckets. MEM-OPT (1/P) and HYBRID (m devices per owner
group) store on each device its own statistics `[L]` and its group's roots
`[m·L]`, `L` the longest device's statistics; the ideal (padding-free) share is
`T/P + m·T/P`. The grafting accumulators (one number per parameter) and the
count stay replicated.

Traffic columns are the layout's numbers, not measured from HLO: per step
the sharded strategies all-gather the preconditioned directions of every
blocked parameter (N numbers, each sent once by its group; COMM-OPT sends
none); on a root refresh COMM-OPT gathers every root (T numbers), HYBRID each
group's devices gather each other's roots, MEM-OPT nothing.

Usage: python benchmarks/shampoo_memory.py [--quick] [--devices 2,4,8] [--out DIR]
(--quick: P = 8 only; writes shampoo_memory_quick.*).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402  (standard library only: before jax starts)

_report.host_devices(8)

# pylint: disable=wrong-import-position
import jax
import numpy as np
from jax.sharding import Mesh

import kfac_jax_dist as kd

import _common as C  # noqa: E402

OPTIONS = {"block_size": 128, "graft_type": "adagrad"}


def measure(p: int) -> list[dict]:
  _, params, _, _ = C.problem()
  devices = jax.devices()[:p]
  mesh = Mesh(np.array(devices), ("data",))
  rows = []
  for name, fraction in (("COMM-OPT", 1.0), ("HYBRID 1/2", 0.5), ("HYBRID 1/4", 0.25),
                         ("MEM-OPT", 1 / p)):
    if fraction * p < 1 or (name != "MEM-OPT" and fraction == 1 / p):
      continue
    tx = kd.shampoo(0.1, distribution=kd.Distribution(mesh, grad_worker_fraction=fraction),
                    **OPTIONS)
    state = kd.shard_state(tx.init(params), mesh)
    sstate = state[0]
    lay = sstate.layout
    total = sum(n * d * d for (d, _), n in zip(lay.buckets, lay.sizes))
    blocked = sum(int(np.prod(plan.shape)) for plan in lay.params if plan.preconditioned)
    graft = sum(x.size for x in sstate.graft)
    shampoo = C.per_device_bytes(sstate, devices)
    second = C.per_device_bytes((sstate.statistics, sstate.roots), devices)
    whole = C.per_device_bytes(state, devices)
    m = lay.group_size
    ideal = (2 * total if not lay.sharded else total / p + m * total / p) * 4 + 4 * graft + 4
    rows.append({
        "P": p, "strategy": name, "m": m, "G": lay.num_groups,
        "L": lay.segment if lay.sharded else None, "T": total, "N": blocked,
        "graft": graft, "shampoo_dev0": shampoo[0], "shampoo_max": max(shampoo),
        "second_max": max(second),
        "ideal": ideal, "whole_max": max(whole),
        "gather_per_step": 0 if not lay.sharded else blocked,
        "gather_per_refresh": (total if not lay.sharded else
                               (m * lay.segment if m > 1 else 0))})
    print(f"  P={p} {name:11s} Shampoo/device {C.fmt_bytes(max(shampoo)):>9s} "
          f"statistics + roots {C.fmt_bytes(max(second)):>9s} "
          f"whole {C.fmt_bytes(max(whole)):>9s}", flush=True)
  return rows


def render(rows, head) -> str:
  out = ["# Shampoo optimizer-state memory per device", "", C.header_md(head),
         f"- model: {C.MODEL_DESCRIPTION}",
         f"- `kd.shampoo(0.1, {', '.join(f'{k}={v!r}' for k, v in OPTIONS.items())})`, "
         "state from `tx.init` placed with `kd.shard_state`; bytes of each leaf's shard "
         "per device. Shampoo = ScaleByShampooState (count, statistics, roots, replicated "
         "AdaGrad accumulators); whole = the optax state (adds the replicated momentum). "
         "ideal = (statistics and roots padding-free: 2T for COMM-OPT, T/P + m·T/P "
         "sharded)·4 + accumulators·4 + count. T = Σ n d² statistic numbers; N = numbers "
         "of the blocked parameters.",
         "- statistics + roots = those two leaves alone (the replicated AdaGrad "
         "accumulators, one number per parameter, dominate the sharded states).",
         "- traffic (numbers, from the layout, not HLO): gathered / step = size of the "
         "gathered directions of the blocked parameters (sharded only); gathered / "
         "refresh = size of the gathered roots: all of them (COMM-OPT), the group's m·L "
         "(HYBRID), none (MEM-OPT).",
         "- Generated by `python benchmarks/shampoo_memory.py`.", ""]
  table = []
  for r in rows:
    comm = next(x for x in rows if x["P"] == r["P"] and x["strategy"] == "COMM-OPT")
    table.append([r["P"], r["strategy"], r["m"], r["G"], r["L"] or "",
                  C.fmt_bytes(r["shampoo_dev0"]), C.fmt_bytes(r["shampoo_max"]),
                  C.fmt_bytes(r["ideal"]), f"{r['shampoo_max'] / r['ideal']:.3f}",
                  f"{r['shampoo_max'] / comm['shampoo_max']:.3f}",
                  C.fmt_bytes(r["second_max"]), f"{r['second_max'] / comm['second_max']:.3f}",
                  C.fmt_bytes(r["whole_max"]), r["gather_per_step"],
                  r["gather_per_refresh"]])
  out.append(C.md_table(table, [
      "P", "strategy", "m", "groups", "L", "Shampoo dev 0", "Shampoo max", "ideal",
      "max / ideal", "max / COMM-OPT", "statistics + roots max", "of COMM-OPT's",
      "whole max", "gathered / step", "gathered / refresh"]))
  r = rows[0]
  out += ["", f"T = {r['T']} statistic numbers, N = {r['N']} blocked-parameter numbers, "
          f"{r['graft']} grafting accumulator numbers.", ""]
  return "\n".join(out)


def main(argv=None):
  ap = C.argument_parser(__doc__)
  ap.add_argument("--quick", action="store_true",
                  help="P = 8 only; writes shampoo_memory_quick.*")
  ap.add_argument("--devices", default=None, help="comma-separated P (default 2,4,8)")
  args = ap.parse_args(argv)
  ps = C.device_counts(args, "2,4,8")
  head = C.environment()
  rows = []
  for p in ps:
    rows += measure(p)
  text = render(rows, head)
  print(text)
  C.write_results(args.out, C.stem("shampoo_memory", args.quick), text,
                  {"header": head, "rows": rows})


if __name__ == "__main__":
  main()
