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

Usage: python benchmarks/shampoo_memory.py [--devices 2,4,8] [--out DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import sys

import jax
import numpy as np
from jax.sharding import Mesh

import kfac_jax_dist as kd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

OPTIONS = {"block_size": 128, "graft_type": "adagrad"}


def per_device_bytes(tree, mesh) -> list[int]:
  out = {d: 0 for d in mesh.devices.flat}
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] += shard.data.nbytes
  return list(out.values())


def measure(p: int) -> list[dict]:
  _, params, _, _ = C.problem()
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
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
    shampoo = per_device_bytes(sstate, mesh)
    second = per_device_bytes((sstate.statistics, sstate.roots), mesh)
    whole = per_device_bytes(state, mesh)
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
  ap.add_argument("--devices", default="2,4,8", help="comma-separated P")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  ps = [int(v) for v in args.devices.split(",")]
  if max(ps) > jax.device_count():
    raise SystemExit(f"need {max(ps)} devices, have {jax.device_count()} (XLA_FLAGS)")
  head = C.header()
  rows = []
  for p in ps:
    rows += measure(p)
  text = render(rows, head)
  print(text)
  C.write_results(args.out, "shampoo_memory", text, {"header": head, "rows": rows})


if __name__ == "__main__":
  main()
