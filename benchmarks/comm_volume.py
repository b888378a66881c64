"""Communication volume per device per step, read from the compiled HLO.

For a fixed model (`_models.CnnMlp`, kd.linen layers of several sizes plus one
untagged parameter) and P = 2, 4, 8 host devices, and a second model
(`_models.CnnMlp12`, twelve comparable layers, none over 1/8 of the
parameters) at P = 8 (SGD, COMM-OPT, MEM-OPT, both HYBRIDs, SP-NGD fused),
this compiles the shard_map'd
training step (`jax.jit(jax.shard_map(step)).lower(...).compile().as_text()`)
of

* SGD: `pmean` of the gradients + `optax.sgd(0.1, 0.9)`;
* K-FAC (`kd.kfac`, method "eigen") with every strategy of `_common.STRATEGIES`:
  COMM-OPT (grad_worker_fraction=1), MEM-OPT (1/P), HYBRID (1/2, P ≥ 4, and
  "HYBRID m=2": 1/4, P = 8), DP-KFAC
  (factor_reduction="local"), SP-NGD fused (MEM-OPT with
  gradient_reduction="reduce_scatter"), and factor_reduction all_reduce vs
  reduce_scatter × symmetric_comm on/off for COMM-OPT and MEM-OPT;

and lists every collective of the HLO (walking called computations from ENTRY).
Collectives in the `true` branch of the conditional named `kfac_factor_update`
run on factor steps only, those under `kfac_decomposition` on inverse steps
only, all others every step (a collective in a `lax.switch` branch would run
every step; the largest branch is counted). Step kinds: plain = every-step
collectives; factor step = plain + factor update; inverse step = factor step
+ decomposition (with the usual cadences an inverse step also updates factors).

Bytes per device, ring model with g the replica-group size: all-reduce
2(g-1)/g·N, reduce-scatter (g-1)/g·N_in, all-gather (g-1)/g·N_out, all-to-all
(g-1)/g·N, collective-permute N. "payload" is the logical buffer: N, N_in, N_out.

Beside them, the papers' formulas from the layer shapes (per device, ring; the
DP-KFAC paper's Table 2 gives totals over the P devices, i.e. P× these):
SGD gradient all-reduce 2(P-1)/P·N_params; KAISA factor all-reduce of full
factors 2(P-1)/P·Σd²; triangular factors Σd(d+1)/2 instead of Σd²; factor
reduce-scatter (P-1)/P·Σ; MEM-OPT preconditioned-gradient all-gather
(P-1)/P·N_tagged (HYBRID: (G-1)/G·N_tagged, G = P/m groups, as KAISA's
receivers get each other group's gradients once); eigenbasis all-gather to the
m gradient workers (m-1)/m·Σ(d²+d)/G; DP-KFAC no factor traffic.

And the library's own model ("model" columns: `kfac_jax_dist.kfac.cost.step_bytes`,
the model `kd.Distribution.auto` chooses by, plus the untagged parameters'
all-reduce), from its layout, one term per collective (ring model, f32), which
the HLO numbers must match:

* factor step, factor_reduction="reduce_scatter": the transform picks at init
  (`kfac.layout.cheaper_storage`, since 69e5d57) whichever running-factor storage
  sends fewer bytes for the cadence, k = inverse_update_every /
  factor_update_every (here 100/10 = 10): tight chunks ("chunked") when
  L/C > 1 + 1/k, else owner segments ("owner"); the layout column says which.
  Chunked: psum_scatter of [P·C], C = ⌈T/P⌉, T = Σ stored factor numbers:
  (P-1)·C, the papers' (P-1)/P·T up to rounding. Owner: psum_scatter of the
  owner segments [P·L], L the longest owner's: (P-1)·L (`Layout.factor_shard`
  is C or L). "all_reduce": psum of the tight buffer of all factors,
  2(P-1)/P·T. "local": nothing.
* inverse step, "reduce_scatter" with chunked storage only: all_gather of the
  chunks, (P-1)·C, so that each owner can read its whole factors (a factor may
  span chunks). This term is not in the papers: KAISA's all-reduce already
  leaves every factor on every device, and owner-segment storage needs no
  gather. It costs one more (P-1)·C per inverse step, which is why the
  transform only takes chunks when (P-1)·L·k > (P-1)·C·(k+1).
* fault checks (since 04bba86, `kfac_fault_check`): on factor steps a psum of
  one int32 (the statistics' verdict), 2(P-1)/P·4 B, inside a `lax.cond` on
  `update_factors` (counted in the factor column). None every step, with
  local gradients too (SP-NGD fused): a gradient is checked through the
  updates, which every device produces alike from the reduced gradients (an
  every-step psum until the gradient check moved there). They carry no factor
  or gradient numbers; the checks list them separately rather than folding
  them into the factor traffic.
* inverse step, COMM-OPT (one owner group): the uneven all-gather of the
  second-order segments, sizes u_i = `Layout.second_sizes`, in the scheme
  `uneven.plan` picks: all_gather of the first S₂ = `prefix_length(u)`
  numbers of every segment, (P-1)·S₂, and a psum of the tight overflow
  Σmax(0, u_i - S₂), 2(P-1)/P of it; or (for large uneven owners) an
  all_gather of tight chunks, (P-1)·⌈Σu/P⌉, plus ppermutes of the owners'
  overflow. HYBRID
  (1 < m < P): the same within each group of m, of each rank's slot (the
  longest of the groups' segments of that rank, `Layout.second_capacity`),
  without the psum (shard_map has none within groups: a prefix is then the
  largest slot).
* every step, MEM-OPT (m = 1, G = P): the uneven all-gather of the
  preconditioned gradients, sizes = each group's used buffer (slot 0 the KL
  sum, then its layers' gradients; `kfac.layout.gradient_offsets`), same formula;
  SP-NGD fused adds the mirror reduce-scatter of the raw gradients (psum_scatter
  of the prefix + psum of the overflow, or the mirror of the chunks and
  ppermutes), and all-reduces only the untagged
  parameters. HYBRID: all_gather of the groups' buffers [S] among the G
  devices of equal rank in their groups (KAISA's receivers; since the
  corners branch, before: pieces S/m over the whole axis, (P-1)·S/m),
  (G-1)·S. With gradient_reduction="none" the step's own pmean of all
  gradients, 2(P-1)/P·N_params.

Usage: python benchmarks/comm_volume.py [--quick] [--devices 2,4,8] [--out DIR]
(--quick: P = 8 only, SGD, COMM-OPT, MEM-OPT and HYBRID, the second model
with SGD, HYBRID and SP-NGD fused; writes comm_volume_quick.*).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402  (standard library only: before jax starts)

_report.host_devices(8)

# pylint: disable=wrong-import-position
import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import kfac_jax_dist as kd
from kfac_jax_dist.kfac import cost

import _common as C  # noqa: E402
import _models  # noqa: E402

F32 = 4
FACTOR_EVERY, INVERSE_EVERY = 10, 100     # the cadence of C.kfac_tx, for "amortised"
QUICK = ("COMM-OPT", "MEM-OPT", "HYBRID")   # with SGD, --quick's strategies
# The second model's strategies (P = 8), and --quick's.
SECOND = ("COMM-OPT", "MEM-OPT", "HYBRID", "HYBRID m=2", "SP-NGD fused")
SECOND_QUICK = ("HYBRID", "SP-NGD fused")


def model_sizes(layers, params) -> dict:
  n_all = sum(int(np.prod(v.shape)) for v in jax.tree_util.tree_leaves(params))
  n_tag = sum(l.a_dim * l.g_dim for l in layers)
  dims = [d for l in layers for d in (l.a_dim, l.g_dim)]
  return {"params": n_all, "tagged": n_tag, "untagged": n_all - n_tag,
          "sum_d2": sum(d * d for d in dims), "sum_tri": sum(d * (d + 1) // 2 for d in dims),
          "sum_eig": sum(d * d + d for d in dims), "largest_layer": max(
              l.a_dim * l.g_dim for l in layers),
          "largest_tri": max(d * (d + 1) // 2 for d in dims)}


def formulas(s: dict, strat: C.Strategy | None, p: int) -> dict:
  """Papers' per-device bytes (ring model) for this configuration."""
  r = (p - 1) / p
  sgd = 2 * r * s["params"] * F32
  if strat is None:
    return {"plain": sgd, "factor": 0.0, "inverse": 0.0}
  m = strat.group_size(p)
  g = p // m
  plain = sgd
  if g > 1:
    plain += (g - 1) / g * s["tagged"] * F32
  if strat.gradient_reduction == "reduce_scatter":
    plain = sgd     # RS + AG of the tagged gradients, AR of the rest: SGD's bytes
  size = s["sum_tri"] if strat.symmetric else s["sum_d2"]
  factor = {"local": 0.0, "all_reduce": 2 * r * size * F32,
            "reduce_scatter": r * size * F32}[strat.factor_reduction]
  inverse = (m - 1) / m * s["sum_eig"] / g * F32
  return {"plain": plain, "factor": factor, "inverse": inverse}


def uneven(sizes, p: int, what: str, gather: bool, psum: bool = True) -> dict:
  """The library's uneven all_gather / reduce-scatter (`uneven.gather`,
  `uneven.reduce_scatter`) of per-device sizes (`psum`: over the axis; else
  within groups of `p`, by rank), in the scheme `uneven.plan` picks;
  "terms": the library's cost model (`kfac.cost.uneven_terms`), one (name,
  bytes sent per device) per collective."""
  scheme = C.uneven_lib.plan(tuple(int(u) for u in sizes), psum)
  if isinstance(scheme, C.uneven_lib.Prefix):
    over = sum(scheme.overflow)
    text = (f"prefix S = {scheme.length}, overflow {over}"
            + ("" if over else " (no overflow: S is the largest size)"))
  else:
    text = f"rechunk C = {scheme.chunk}, {len(scheme.sends)} ppermutes"
  return {"terms": cost.uneven_terms(sizes, what, gather, F32, psum), "text": text,
          "bytes": max(scheme.device_bytes()) * F32,
          "ideal": (p - 1) / p * sum(sizes) * F32}


def layout_info(opt_state, p: int) -> dict:
  lay = C.kfac_state(opt_state).layout
  _, group_sizes, size = C.gradient_offsets(lay)
  stored = sum(f.size for pl in lay.plans for f in C.factor_places(pl))
  second = sum(C.second_numbers(f, lay.method) for pl in lay.plans
               for f in C.factor_places(pl))
  tight = max(-(-sum(lay.owner_sizes) // p), 1)
  return {"L": lay.segment, "L2": lay.second_segment, "S": size, "G": lay.num_groups,
          "m": lay.group_size, "storage": lay.factor_storage, "C": lay.factor_shard,
          "C_tight": tight, "L_over_C": lay.segment / tight,
          "factor_buffer": p * lay.factor_shard, "factor_useful": stored,
          "owner_sizes": list(lay.owner_sizes), "second_sizes": list(lay.second_sizes),
          "group_sizes": list(group_sizes),
          "grad_buffer": lay.num_groups * size,
          "grad_useful": sum(pl.layer.a_dim * pl.layer.g_dim for pl in lay.plans),
          "second_capacity": list(lay.second_capacity),
          "second_array": lay.second_array, "second_useful": second}


def library_model(opt_state, strat: C.Strategy | None, p: int, s: dict) -> dict:
  """The library's cost model (`kfac.cost.step_bytes` of the state's layout),
  one term per collective, plus the untagged parameters' all-reduce (the same
  under every strategy, so the model leaves it out): {step kind: [(name,
  bytes per device)]}."""
  r = (p - 1) / p
  if strat is None:
    return {"plain": [("pmean of all gradients", 2 * r * s["params"] * F32)],
            "factor": [], "inverse": []}
  b = cost.step_bytes(C.kfac_state(opt_state).layout, strat.factor_reduction,
                      strat.gradient_reduction, F32)
  return {"plain": [("all-reduce of the untagged gradients", 2 * r * s["untagged"] * F32)]
          + list(b.plain), "factor": list(b.factor), "inverse": list(b.inverse)}


def measure(p: int, strategies, verbose=True, model=None) -> list[dict]:
  """The rows of SGD and `strategies` at `p` devices on `C.problem(model=model)`."""
  loss_fn, params, x, y = C.problem(model=model)
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  sizes = model_sizes(layers, params)
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  rows = []
  configs = [("SGD", None)] + [(s.name, s) for s in strategies]
  for name, strat in configs:
    if strat is not None and strat.group_size(p) is None:
      continue
    t0 = time.perf_counter()
    if strat is None:
      tx = optax.sgd(0.1, momentum=0.9)
      fn, state = C.sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, "none",
                                 kfac=False)
      info = {}
    else:
      dist = C.distribution(strat, p)
      tx = C.kfac_tx(grad_fn, layers, dist)
      fn, state = C.sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh,
                                 strat.gradient_reduction)
      info = layout_info(state, p)
    hlo = fn.lower(params, state, x, y).compile().as_text()
    found, notes = C.collectives(hlo, p)
    tot = C.totals(found)
    row = {"P": p, "strategy": name, "what": strat.what if strat else "pmean + optax.sgd",
           "m": strat.group_size(p) if strat else None, "layout": info,
           "totals": tot, "notes": notes, "compile_s": time.perf_counter() - t0,
           "collectives": [dict(vars(c), fault_check=c.fault_check) for c in found],
           "fault": {k: C.fault_bytes(found, k) for k in ("every", "factor", "inverse")},
           "formula": formulas(sizes, strat, p), "sizes": sizes,
           "model": library_model(state, strat, p, sizes)}
    for kind in ("plain", "factor", "inverse"):
      row[kind] = C.step_bytes(tot, kind)
      row[kind + "_payload"] = C.step_bytes(tot, kind, "payload")
    row["factor_only"] = row["factor"] - row["plain"]
    row["inverse_only"] = row["inverse"] - row["factor"]
    for kind in ("plain", "factor", "inverse"):
      row["model_" + kind] = sum(b for _, b in row["model"][kind])
    row["amortised"] = (row["plain"] + row["factor_only"] / FACTOR_EVERY
                        + row["inverse_only"] / INVERSE_EVERY)
    rows.append(row)
    if verbose:
      print(f"  {type(model).__name__ if model else ''} P={p} {name:28s} plain {C.fmt_bytes(row['plain']):>9s} factor-only "
            f"{C.fmt_bytes(row['factor_only']):>9s} inverse-only "
            f"{C.fmt_bytes(row['inverse_only']):>9s} ({row['compile_s']:.1f} s)",
            flush=True)
  return rows


def kinds_str(tot, part: str, field="ring") -> str:
  bits = [f"{k.replace('collective-', '').replace('all-', '')}:{C.fmt_bytes(tot[part][k][field])}"
          f"×{tot[part][k]['count']}" for k in C.KINDS if tot[part][k]["count"]]
  return ", ".join(bits) if bits else "—"


def checks(rows: list[dict], p: int = 8, model: str = "") -> list[dict]:
  """The checks at `p` devices (`model`: a label appended to each name)."""
  by = {r["strategy"]: r for r in rows if r["P"] == p}
  out = []
  if not by:
    return out
  sgd = by["SGD"]["plain"]
  sizes = by["SGD"]["sizes"]
  kaisa_formula = 2 * (p - 1) / p * sizes["sum_d2"] * F32

  def add(name, value, target, ok, why):
    out.append({"check": name + (f" [{model}]" if model else ""), "value": value,
                "target": target, "holds": bool(ok), "why": why})

  if "COMM-OPT" in by:
    v = by["COMM-OPT"]["plain"]
    add(f"COMM-OPT plain step bytes == SGD's (P={p})", f"{v:.0f} vs {sgd:.0f} B",
        "equal", v == sgd,
        "" if v == sgd else f"difference {v - sgd:+.0f} B: "
        + kinds_str(by["COMM-OPT"]["totals"], "every"))
  if "SP-NGD fused" in by:
    r = by["SP-NGD fused"]
    v = r["plain"]
    lay = r["layout"]
    u = uneven(lay["group_sizes"], p, "grad", gather=True)
    add(f"SP-NGD fused MEM-OPT plain step <= 1.05x SGD (P={p})", f"{v / sgd:.3f}x",
        "<= 1.05x", v <= 1.05 * sgd,
        f"reduce-scatter + all-gather of the owners' gradients, uneven (sizes "
        f"{min(lay['group_sizes'])}..{max(lay['group_sizes'])} for "
        f"{lay['grad_useful']} gradient numbers; `uneven.plan`): {u['text']}"
        + f"; each {u['bytes'] / u['ideal']:.3f}x the "
        f"padding-free (P-1)/P·N_tagged; the untagged parameters by psum; "
        f"every-step fault-check psums: {r['fault']['every']:.0f} B. "
        f"(Before tight chunks/uneven gathers: a padded G·S = {lay['grad_buffer']} buffer, "
        f"{lay['grad_buffer'] / lay['grad_useful']:.3f}x.)")
  for name in ("COMM-OPT", "MEM-OPT"):
    if name in by:
      r = by[name]
      flag = r["fault"]["factor"]
      v = r["factor_only"] - flag           # factor traffic; the fault flag aside
      lay = r["layout"]
      kaisa_cfg = by.get(name + " AR full (KAISA)")
      measured_kaisa = ("" if kaisa_cfg is None else
                        f"; the library's own all_reduce of full factors sends "
                        f"{(kaisa_cfg['factor_only'] - kaisa_cfg['fault']['factor']) / kaisa_formula:.3f}x the formula")
      if lay["storage"] == "chunked":
        how = (f"psum_scatter of tight chunks (chosen: L/C = {lay['L_over_C']:.3f} > 1.1), "
               f"P·C = {p}×{lay['C']} = {lay['factor_buffer']} numbers for T = "
               f"{lay['factor_useful']} triangle numbers "
               f"({lay['factor_buffer'] / lay['factor_useful']:.5f}x)")
        inv = (p - 1) * lay["C"] * F32
        extra = (f"Inverse steps add an all_gather of the chunks, (P-1)·C = "
                 f"{C.fmt_bytes(inv)} (KAISA's all-reduce needs none)")
      else:
        how = (f"psum_scatter of owner segments (chosen: L/C = {lay['L_over_C']:.3f} <= 1.1), "
               f"P·L = {p}×{lay['C']} = {lay['factor_buffer']} numbers for T = "
               f"{lay['factor_useful']} triangle numbers "
               f"({lay['factor_buffer'] / lay['factor_useful']:.5f}x)")
        inv = 0.0
        extra = "Owner segments need no gather on inverse steps"
      add(f"{name} factor traffic (RS + symmetric) <= 0.3x KAISA full-factor all-reduce "
          f"(P={p})", f"{v / kaisa_formula:.3f}x{measured_kaisa}", "<= 0.3x",
          v <= 0.3 * kaisa_formula,
          f"{how}: the ideal Σtri/(2·Σd²) = {sizes['sum_tri'] / (2 * sizes['sum_d2']):.3f}. "
          f"{extra}: with the 10/100 cadence factor traffic amortises to "
          f"{(v / 10 + inv / 100) / (kaisa_formula / 10):.3f}x KAISA's. Not counted: the "
          f"factor-step fault-check psum of one int32, {flag:.0f} B")
  for name in ("HYBRID", "HYBRID m=2"):
    if name not in by:
      continue
    r = by[name]
    lay = r["layout"]
    m, g = lay["m"], lay["G"]
    gathered = r["totals"]["every"]["all-gather"]["ring"]
    kaisa = (g - 1) * lay["S"] * F32        # each receiver gets every other group once
    add(f"HYBRID (m={m}) every-step gather <= 1.05x KAISA's receivers, (G-1)·S (P={p})",
        f"{gathered / kaisa:.3f}x", "<= 1.05x", gathered <= 1.05 * kaisa,
        f"all_gather of the groups' buffers (S = {lay['S']} numbers) among the G = {g} "
        f"devices of equal rank in their groups {{r, r+m, ...}}: (G-1)·S = {g - 1}·S per "
        f"device, typed invariant over the axis (`_compat.equal_over`: every device of a "
        f"group computes its buffer alike). Before (40b2d74): pieces of S/m all-gathered "
        f"over all P devices, (P-1)/m·S, of which (m-1)/m·S were the device's own "
        f"group's: (P-1)/(P-m) = {(p - 1) / (p - m):.3f}x")
  for name in ("COMM-OPT", "MEM-OPT"):
    r = by.get(name + " AR full (KAISA)")
    if r is not None:
      v = r["factor_only"]
      lay = r["layout"]
      add(f"{name} factor_reduction=all_reduce, full factors, vs KAISA's all-reduce "
          f"2(P-1)/P·Σd² (P={p})", f"{v / kaisa_formula:.3f}x", "1x",
          abs(v / kaisa_formula - 1) < 0.01,
          f"psum of the unpadded buffer of all factors (Σd² = {lay['factor_useful']} "
          "numbers); each owner then copies its own factors into its segment"
          if abs(v / kaisa_formula - 1) < 0.01 else
          f"psum of {v / kaisa_formula:.3f}x the formula's numbers: segment padding "
          f"travels ([P·L] = {lay['factor_buffer']} for Σd² = {lay['factor_useful']})")
  worst = max((max(abs(r[k + ("_only" if k != "plain" else "")] - r["model_" + k])
                     for k in ("plain", "factor", "inverse")), r["strategy"])
              for r in rows)
  add("HLO bytes == the library model, every configuration, step kind and P "
      f"({', '.join(str(q) for q in sorted({r['P'] for r in rows}))})",
      f"max abs(HLO - model) = {worst[0]:.0f} B" + (f" ({worst[1]})" if worst[0] else ""),
      "0 (up to rounding)",
      worst[0] < 64, "each collective of the model is found in the HLO with these bytes"
      if worst[0] < 64 else "see the model columns of the tables")
  if "DP-KFAC" in by:
    r = by["DP-KFAC"]
    flag = r["fault"]["factor"]
    v = r["factor_only"] - flag
    add(f"DP-KFAC zero factor bytes (P={p})",
        f"{v:.0f} B (+ {flag:.0f} B fault-check flag)", "0", v == 0,
        (f"the factor step's only collective is the fault check's psum of one int32 "
         f"(2(P-1)/P·4 = {flag:.0f} B: the devices agree whether every statistic is "
         f"finite); no factor numbers travel" if v == 0 else
         kinds_str(r["totals"], "factor")))
  fr = [r for r in rows if r["P"] == p and r["strategy"] != "SGD"]
  if fr:
    want = 2 * (p - 1) / p * F32
    every = sorted({r["strategy"] for r in fr if r["fault"]["every"]})
    ok = all(abs(r["fault"]["factor"] - want) < 0.5 and r["fault"]["inverse"] == 0
             and r["fault"]["every"] == 0 for r in fr)
    add(f"fault-check psums (since 04bba86), listed not hidden (P={p})",
        f"factor steps: {want:.0f} B in every strategy; every step: "
        + (f"{want:.0f} B in " + ", ".join(every) if every else "none"),
        "one int32 psum per factor step; none on plain steps",
        ok, "psum of the statistics' failure count (int32) so that all devices skip "
        "together; included in the factor column above, left out of the factor-traffic "
        "and DP-KFAC checks (no factor numbers); none on a plain step, with local "
        "gradients too (SP-NGD fused): the gradients are checked through the updates, "
        "which every device produces alike from the reduced gradients")
  return out


def render(rows, chk, head, second=()) -> str:
  """The report: the first model's sections (`rows`), then the second's."""
  out = ["# Communication volume per device per step (from compiled HLO)", "",
         C.header_md(head),
         f"- model: {C.MODEL_DESCRIPTION}; K-FAC method eigen, factor_update_every=10, "
         "inverse_update_every=100, KL clip on",
         "- bytes per device, ring model (AR 2(g-1)/g·N, RS (g-1)/g·N_in, AG (g-1)/g·N_out); "
         "payload = logical buffer bytes (N, N_in, N_out). plain = collectives every step; "
         "factor / inverse = the extra collectives of the factor-update / decomposition "
         "conditionals (an inverse step pays plain + factor + inverse).",
         "- model = the library's collectives computed from its layout, one term per "
         "collective (listed in the second table of each P; see the docstring). With "
         "factor_reduction reduce_scatter the transform picks the running-factor storage "
         "that sends fewer bytes for the cadence (`kfac.layout.cheaper_storage`, 69e5d57; "
         "k = 100/10): tight chunks when L/C > 1 + 1/k = 1.1, reduced by a psum_scatter of "
         "(P-1)·C on factor steps and **all-gathered on inverse steps** ((P-1)·C, "
         "\"chunk AG\": each owner reads its whole factors from the chunks; not in the "
         "papers' formulas, whose owners keep their factors in place), else owner "
         "segments, (P-1)·L on factor steps and no gather (the layout table says which, "
         "with L/C). COMM-OPT's eigenbases and MEM-OPT's gradients go by the uneven "
         "all_gather (prefix S by all_gather, the overflow beyond S by one psum, the "
         "\"reduce\" entries of COMM-OPT's inverse column).",
         "- fault checks (04bba86) are in the columns: a psum of one int32 on factor steps "
         "in every strategy (2(P-1)/P·4 B: 4, 6, 7 B at P = 2, 4, 8; the \"reduce\" ×1 "
         "beside DP-KFAC's zero factor traffic), none on plain steps (local gradients "
         "are checked through the produced updates, alike on every device). Model terms "
         "\"fault-check psum\"; the checks set them apart from factor traffic.",
         "- paper = the papers' formula for that configuration from the layer shapes "
         "(see the docstring); ×SGD = plain-step bytes / SGD's.",
         "- Generated by `python benchmarks/comm_volume.py`.", ""]
  out += sections(rows)
  if second:
    out += [f"# Second model: {C.MODEL12_DESCRIPTION}", ""]
    out += sections(second, "Second model, ")
  out += C.checks_markdown("Checks", chk)
  return "\n".join(out)


def sections(rows, title: str = "") -> list[str]:
  """A model's line and its tables per P (headings `## {title}P = p`)."""
  out = []
  sizes = rows[0]["sizes"]
  out.append(f"Model: {sizes['params']} parameters ({sizes['tagged']} in tagged layers, "
             f"largest layer {sizes['largest_layer']}); factors Σd² = {sizes['sum_d2']}, "
             f"Σd(d+1)/2 = {sizes['sum_tri']}, largest triangle {sizes['largest_tri']}.")
  out.append("")
  for p in sorted({r["P"] for r in rows}):
    rs = [r for r in rows if r["P"] == p]
    sgd = next(r for r in rs if r["strategy"] == "SGD")["plain"]
    out.append(f"## {title}P = {p}")
    out.append("")
    r_ = (p - 1) / p
    half = p // 2 if p >= 4 else 1
    g_h = p // half
    out.append("Papers' formulas (bytes per device, ring model; the DP-KFAC paper's Table 2 "
               "gives P× these totals): " + "; ".join(f"{k} {C.fmt_bytes(v)}" for k, v in (
                   ("SGD gradient all-reduce 2(P-1)/P·N", 2 * r_ * sizes["params"] * F32),
                   ("KAISA factor all-reduce of full factors 2(P-1)/P·Σd²",
                    2 * r_ * sizes["sum_d2"] * F32),
                   ("all-reduce of triangles 2(P-1)/P·Σd(d+1)/2", 2 * r_ * sizes["sum_tri"] * F32),
                   ("reduce-scatter of triangles (P-1)/P·Σd(d+1)/2", r_ * sizes["sum_tri"] * F32),
                   ("MEM-OPT preconditioned-gradient all-gather (P-1)/P·N_tagged",
                    r_ * sizes["tagged"] * F32),
                   (f"HYBRID m={half} receivers' gather (G-1)/G·N_tagged",
                    (g_h - 1) / g_h * sizes["tagged"] * F32),
                   ("COMM-OPT eigenbasis all-gather (P-1)/P·Σ(d²+d)", r_ * sizes["sum_eig"] * F32),
                   ("DP-KFAC factor traffic", 0.0))) + ".")
    out.append("")
    table = []
    for r in rs:
      f = r["formula"]
      table.append([
          r["strategy"], r["m"] or "", C.fmt_bytes(r["plain"]), f"{r['plain'] / sgd:.3f}",
          C.fmt_bytes(f["plain"]), kinds_str(r["totals"], "every"),
          C.fmt_bytes(r["factor_only"]), C.fmt_bytes(f["factor"]),
          kinds_str(r["totals"], "factor"), C.fmt_bytes(r["inverse_only"]),
          C.fmt_bytes(f["inverse"]), kinds_str(r["totals"], "inverse"),
          " / ".join(C.fmt_bytes(r["model_" + k]) for k in ("plain", "factor", "inverse")),
          f"{C.fmt_bytes(r['amortised'])} ({r['amortised'] / sgd:.2f}×)",
          f"{C.fmt_bytes(r['plain_payload'])} / {C.fmt_bytes(r['factor_payload'] - r['plain_payload'])}"
          f" / {C.fmt_bytes(r['inverse_payload'] - r['factor_payload'])}"])
    out.append(C.md_table(table, [
        "strategy", "m", "plain", "×SGD", "paper plain", "plain by kind (ring×count)",
        "factor", "paper factor", "factor by kind", "inverse", "paper inverse",
        "inverse by kind", "model plain / factor / inverse", "amortised 10/100 (×SGD)",
        "payload plain / factor / inverse"]))
    out.append("")
    lay_rows = []
    for r in rs:
      lay = r["layout"]
      if not lay:
        continue
      if lay["storage"] == "chunked":
        factor = (f"chunked: P·C = {lay['factor_buffer']} / {lay['factor_useful']} = "
                  f"{lay['factor_buffer'] / lay['factor_useful']:.4f}")
      else:
        factor = (f"owner: P·L = {p * lay['L']} / {lay['factor_useful']} = "
                  f"{p * lay['L'] / lay['factor_useful']:.3f}")
      if any(
          s.name == r["strategy"] and s.factor_reduction == "reduce_scatter"
          for s in C.STRATEGIES):
        factor += f" (L/C = {lay['L_over_C']:.3f})"
      if lay["G"] > 1 and lay["m"] == 1:
        u = uneven(lay["group_sizes"], p, "grad", gather=True)
        grad = f"uneven: {u['text']}; {u['bytes'] / u['ideal']:.3f}x (P-1)/P·Σ"
      elif lay["G"] > 1:
        grad = f"G·S = {lay['grad_buffer']} / {lay['grad_useful']} = " \
               f"{lay['grad_buffer'] / lay['grad_useful']:.3f}"
      else:
        grad = "— (no gather)"
      if lay["G"] == 1:
        u = uneven(lay["second_sizes"], p, "eigen", gather=True)
        second = f"uneven: {u['text']}; {u['bytes'] / u['ideal']:.3f}x (P-1)/P·Σ"
      elif lay["m"] > 1:
        u = uneven(lay["second_capacity"], lay["m"], "eigen", gather=True, psum=False)
        second = (f"in groups, uneven: {u['text']}; {u['bytes'] / u['ideal']:.3f}x "
                  f"(m-1)/m·Σ slots; held: {lay['second_array']} / "
                  f"{lay['second_useful'] / lay['G']:.0f}")
      else:
        second = "— (no gather)"
      terms = "; ".join(f"{k}: " + ", ".join(f"{n} {C.fmt_bytes(b)}" for n, b in r["model"][k])
                        for k in ("plain", "factor", "inverse") if r["model"][k])
      lay_rows.append([r["strategy"], lay["G"], lay["m"], factor, grad, second, terms,
                       f"{r['compile_s']:.1f}", "; ".join(r["notes"])])
    out.append(C.md_table(lay_rows, [
        "strategy", "groups G", "m", "running factors (buffer / Σ stored)",
        "gradient gather (MEM-OPT: uneven)", "second-order gather",
        "library model, per collective", "compile s", "notes"]))
    out.append("")
  return out


def main(argv=None):
  ap = C.argument_parser(__doc__)
  ap.add_argument("--quick", action="store_true",
                  help=f"P = 8 only, SGD, {', '.join(QUICK)} (second model: SGD, "
                  f"{', '.join(SECOND_QUICK)}); writes comm_volume_quick.*")
  ap.add_argument("--devices", default=None, help="comma-separated P values (default 2,4,8)")
  args = ap.parse_args(argv)
  ps = C.device_counts(args, "2,4,8")
  strategies = [s for s in C.STRATEGIES if not args.quick or s.name in QUICK]
  head = C.environment()
  rows, second = [], []
  for p in ps:
    rows += measure(p, strategies)
  chk = checks(rows, 8) if 8 in ps else []
  if 8 in ps:
    names = SECOND_QUICK if args.quick else SECOND
    second = measure(8, [s for s in C.STRATEGIES if s.name in names],
                     model=_models.CnnMlp12())
    chk += checks(second, 8, "CnnMlp12")
  text = render(rows, chk, head, second)
  print(text)
  C.write_results(args.out, C.stem("comm_volume", args.quick), text,
                  {"header": head, "rows": rows, "checks": chk,
                   "second_model": {"description": C.MODEL12_DESCRIPTION, "rows": second}})


if __name__ == "__main__":
  main()
