"""Load balance, padding and program size of the K-FAC layout at pod scale.

Layer shapes come from kd.linen models discovered shapes-only (`jax.eval_shape`
of `init`, then `grad_fn.discover` inside an outer `jax.eval_shape`, so the
batch is abstract too; nothing is allocated):

* ResNet-50: bottleneck v1.5 (stride on the 3x3 conv), convolutions without
  bias followed by (untagged) BatchNorm, FC 2048→1000 with bias: 54 tagged
  layers, 108 factors;
* BERT-Large: 24 encoder layers of Q, K, V, O (1024→1024, bias), FFN 1024→4096
  and 4096→1024 (bias), plus the pooler 1024→1024: 145 tagged layers. The
  word/position/type embeddings, the LayerNorms and the classifier are plain
  Flax (untagged, passed through); there is no vocabulary decoder. No
  `max_factor_dim`: every factor (up to 4097) is a full matrix;
* GPT-2-XL: 48 pre-LN decoder blocks (width 1600, 25 heads, MLP 6400) under one
  `nn.scan`, so each projection is one stacked layer `[48, ...]` and the
  layout a plan per block; q, k, v, o, fc1, fc2 with bias, the LayerNorms
  tagged (diagonal); token and position embeddings and the tied head untagged
  (the vocabulary of 50257 skipped). Largest factor 6401.

For P = 8, 64, 256, 1024 and MEM-OPT (group size m = 1) and COMM-OPT (m = P),
`kfac_jax_dist.kfac.layout.build(layers, paths, num_devices=P, group_size=m)` is
called (factor_reduction="reduce_scatter": tight chunked running factors) and
its placement measured:

* balance: max over devices of Σ d³ of the factors it decomposes, over the
  ideal `max(Σ d³ / P, largest single d³)`; "layer bound" is the same ideal
  when a layer's two factors must share an owner group (MEM-OPT);
* communication padding overhead, per collective: bytes per device that the
  library sends (ring model, f32) / bytes of the same communication without
  padding, (P-1)/P·Σ useful numbers (the padding-free ring all_gather or
  reduce-scatter):
  - factor RS, factor steps: psum_scatter of the tight chunks, (P-1)·C,
    C = ⌈T/P⌉, T = Σ stored triangles;
  - chunk AG, inverse steps: all_gather of the chunks, (P-1)·C;
  - eigen broadcast (COMM-OPT, inverse steps), MEM grad gather (MEM-OPT, every
    step), SP-NGD grad RS (its mirror): uneven, in the scheme `uneven.plan`
    picks: prefix, (P-1)·S + 2(P-1)/P·Σ overflow, or rechunk, (P-1)·C plus
    the ppermutes that forward the overflow over C ≥ ⌈Σu/P⌉ (the busiest device's
    larger of sent and received);
  with, beside them, the floor of either scheme over any assignment of whole
  factors / layers (`uneven_floor`), the padded collectives of the library
  before f563242 and KAISA's all-reduce of full factors;
* second-order memory padding: the second-order array (counted once where it
  is replicated: COMM-OPT's segments one after another, `Layout.second_array`;
  else P·L₂) / Σ second-order numbers (d² + d per factor); beside it, the
  same in rows of `L₂` (the packing before 44d087a).

With `--alt-layout FILE` the balance is also given for the `build` of
another layout module with the library's signature (e.g. a prototype
assignment in a copy of layout.py), side by side with the library's.

Finally the compile time of the shard_map'd K-FAC update (`tx.update` of
`kd.kfac`, eigen, factor_update_every=10, inverse_update_every=100, on
abstract ResNet-50 gradients, statistics and state; `jit(...).lower().compile()`)
at P = 8 in this process, and at P = 64 and 256 in subprocesses with that many
host devices (with a time limit; reported as not feasible if it runs out); its
HLO bytes are checked against the layout model. The program's size: the
update of ResNet-50 and GPT-2-XL lowered (not compiled: 1024-device programs
are beyond this machine's compile budget) at P = 64, 256 and 1024 in
subprocesses, its StableHLO operations counted; the per-device code must not
grow with P (P = 1024 at most 2× P = 64). Both are also lowered under HYBRID
(owner groups of 8, a node's devices: P/8 groups). GPT-2-XL's update is also lowered with
SP-NGD's stale statistics (`stale_threshold=0.1`, "stale" rows) and, as a whole
step with its capture, with EK-FAC ("ekfac" rows).

Usage: python benchmarks/layout_balance.py [--quick] [--devices 8,64,256,1024]
       [--compile 8,64,256] [--program-size 64,256,1024] [--compile-timeout S]
       [--reuse-compiles JSON] [--out DIR]
(--quick: the balance at P = 8 and 64, the MEM-OPT update compiled at P = 8 only;
writes layout_balance_quick.*).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402  (standard library only: before jax starts)

_report.host_devices(8)

# pylint: disable=wrong-import-position
import argparse
import dataclasses
import json
import re
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd
from kfac_jax_dist.kfac import cost

import _common as C  # noqa: E402
import _models  # noqa: E402

layout_lib, uneven_lib = C.layout_lib, C.uneven_lib


# ---------------------------------------------------------------------- models

def discover(name: str, with_loss: bool = False):
  """(layers, param paths, abstract params), and with `with_loss` also the
  grad_fn and the abstract batch (x, y)."""
  if name == "resnet50":
    model = _models.ResNet50()
    x = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)
  else:
    model = _models.BertLarge() if name == "bert_large" else _models.Gpt2Xl()
    x = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  y = jax.ShapeDtypeStruct((2, 16) if name == "gpt2_xl" else (2,), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  params = variables["params"]
  stats = variables.get("batch_stats")

  def loss_fn(p, x, y):
    v = {"params": p}
    if stats is not None:
      v["batch_stats"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats)
    return kd.losses.softmax_cross_entropy(model.apply(v, x), y)

  grad_fn = kd.value_and_grad(loss_fn)
  found = []
  # discover() closes over its batch arguments: give it traced ones.
  jax.eval_shape(lambda p, x, y: found.append(grad_fn.discover(p, x, y)) or 0.0,
                 params, x, y)
  paths = tuple(C.registry.leaves_by_path(params))
  if with_loss:
    return found[0], paths, params, grad_fn, x, y
  return found[0], paths, params


# --------------------------------------------------------------------- metrics

F32 = 4
FACTOR_EVERY, INVERSE_EVERY = 10, 100


def uneven(sizes, p: int, gather: bool) -> dict:
  """The library's uneven all_gather (`uneven.gather`) or reduce-scatter
  (`uneven.reduce_scatter`) of per-device sizes u_i, in the scheme
  `uneven.plan` picks:

  * prefix: the first S = `prefix_length(u)` numbers of every segment by
    all_gather / psum_scatter, (P-1)·S, the overflow Σmax(0, u_i - S), packed
    tight, by one psum, 2(P-1)/P of it: library - ideal = (P-1)/P·(zeros +
    overflow), zeros = P·S - Σmin(u_i, S);
  * rechunk: one tight all_gather / psum_scatter of P chunks of C = ⌈Σu/P⌉
    (or longer, `uneven.matched`), (P-1)·C, and the ppermutes forwarding the
    overflow over C: a device sends
    (receives) the sends it takes part in, at their padded sizes.

  "library" is the busiest device's larger of sent and received bytes (the
  ring collectives send what they receive; a ppermute's owner receives what
  its hosts send); "sent" is the most any device sends (what the HLO count
  reads)."""
  scheme = uneven_lib.plan(tuple(int(u) for u in sizes))
  sent, received = scheme.device_bytes()
  if gather:                       # the gather's ppermutes run the other way
    sent, received = received, sent
  out = {"scheme": type(scheme).__name__.lower(), "library": max(sent, received) * F32,
         "sent": sent * F32, "received": received * F32,
         "ideal": (p - 1) / p * sum(sizes) * F32,
         "collectives": scheme.num_collectives}
  if isinstance(scheme, uneven_lib.Prefix):
    s = scheme.length
    out.update(S=s, overflow=sum(scheme.overflow),
               zeros=p * s - sum(min(u, s) for u in sizes))
  else:
    out.update(C=scheme.chunk, sends=len(scheme.sends), pieces=len(scheme.pieces()),
               zeros=p * scheme.chunk - sum(sizes),
               overflow=sum(max(0, u - scheme.chunk) for u in sizes))
  return out


def uneven_floor(items, p: int) -> float:
  """Fewest bytes per device of either uneven scheme over *any* assignment of
  whole items (factors, layers) to devices (and any S): the smaller of
  `prefix_floor` and the rechunk's (P-1)·⌈Σ/P⌉ + max(0, largest - ⌈Σ/P⌉)
  (the largest item's owner receives, or sends, all of it beyond its chunk)."""
  c = -(-int(sum(items)) // p)
  return min(prefix_floor(items, p), ((p - 1) * c + max(0, max(items) - c)) * F32)


def prefix_floor(items, p: int) -> float:
  """Fewest bytes per device of the prefix + overflow-psum scheme over *any*
  assignment of whole items (factors, layers) to devices and any S.

  For every S: cost = (P-1)·S + 2(P-1)/P·Σ_i max(0, u_i - S) and, as P·S >=
  Σ min(u_i, S), cost >= (P-1)/P·(Σu + Σ_i max(0, u_i - S)); and the overflow
  Σ_i max(0, u_i - S) >= Σ_items max(0, x - S) whichever device holds which
  item (x ↦ max(0, x - S) is superadditive). Minimises the larger of the two
  bounds over S exactly (piecewise linear)."""
  r, total = (p - 1) / p, float(sum(items))
  xs = sorted(set(items))

  def bound(sv):
    over = sum(max(0, x - sv) for x in items)
    return max(r * (total + over), (p - 1) * sv + 2 * r * over)

  cands = [0.0] + [float(x) for x in xs]
  edges = [0.0] + [float(x) for x in xs]
  for lo, hi in zip(edges[:-1], edges[1:]):
    big = [x for x in items if x >= hi]
    n, big_sum = len(big), float(sum(big))
    denom = (p - 1) - r * n
    if denom:
      cross = r * (total - big_sum) / denom
      if lo < cross < hi:
        cands.append(cross)
  return min(bound(c) for c in cands) * F32


def second_array(lay) -> int:
  """Second-order numbers of the array, counted once where it is replicated:
  with one owner group every device holds every owner's segment
  (`Layout.second_array`); else the devices hold `P·L₂` between them."""
  return lay.second_array if lay.num_groups == 1 else lay.num_devices * lay.second_segment


def in_segment_rows(lay):
  """`lay` with its second-order segments in rows of `L₂` (before 44d087a)."""
  return dataclasses.replace(lay, second_packing=layout_lib.SEGMENT_ROWS)


def hybrid_layouts(model: str, ps: list[int]):
  """HYBRID layouts of `model` at each P: groups of 8, P/8 and P/2 (1 < m < P)."""
  layers, paths, _ = discover(model)
  for p in ps:
    for m in sorted({8, p // 8, p // 2}):
      if 1 < m < p:
        yield layout_lib.build(layers, paths, num_devices=p, group_size=m)


def hybrid_verdict(hybrid: list[dict]) -> list[str]:
  """How many HYBRID layouts' in-group gathers are within `TARGET_COMM` of
  the ideal, now and with the groups unaligned, and why the others miss."""
  near = lambda h, key: h[key] <= TARGET_COMM * max(h["gather_ideal"], 1)
  misses = [h for h in hybrid if not near(h, "gather")]
  lines = [f"The in-group gather is within {TARGET_COMM:.2f}× the busiest group's "
           f"padding-free bytes on {len(hybrid) - len(misses)} of {len(hybrid)} HYBRID "
           f"layouts ({sum(near(h, 'gather_unaligned') for h in hybrid)} with the groups "
           "unaligned), and every array within "
           f"{max(h['array'] / h['busiest'] for h in hybrid):.3f}× the busiest group's "
           "numbers. A factor's pieces within a group are not capped by the copies' "
           "budget (`layout.REPLICA_BUDGET` counts the layer pieces over groups only; "
           "counted, ResNet-50's in-group gathers at P = 256 and 1024 were up to 1.23×)."
           + (" Where the gather is not within, the group's largest factor is in fewer "
              "pieces than the group has devices (more would slow the slowest device: "
              "each piece's owner decomposes the whole factor), so some devices hold "
              "more than the mean segment, and the uneven scheme sends a prefix as long "
              "as the longest or forwards the overflow by `ppermute`s (`uneven.plan`, "
              "whichever costs less):" if misses else ""), ""]
  for h in misses:
    mean = h["busiest"] / h["m"]
    lines.append(f"- {h['model']} P = {h['P']} in groups of {h['m']}: "
                 f"{h['gather'] / max(h['gather_ideal'], 1):.2f}×; the largest segment "
                 f"{h['largest_segment'] / 1e6:.1f} M numbers, "
                 f"{h['largest_segment'] / mean:.1f}× the busiest group's mean, a factor "
                 f"in at most {h['most_owners']} piece{'s' * (h['most_owners'] > 1)}.")
  return lines


def hybrid_memory(model: str, lay: layout_lib.Layout) -> dict:
  """A HYBRID layout's second-order array per device and in-group gather,
  now, in rows of `L₂` (before 44d087a), and with the groups' factors
  assigned group by group (before the groups were aligned: no factor split
  within a group, each group balanced on its own)."""
  m = lay.group_size
  busiest = max(sum(lay.second_sizes[g * m:(g + 1) * m]) for g in range(lay.num_groups))
  gather = lambda l: max(uneven_lib.plan(l.second_capacity, psum=False).device_bytes())
  unaligned = layout_lib.rebuild(lay, align_groups=False)
  largest = max(lay.second_sizes)
  return {"model": model, "P": lay.num_devices, "m": m, "rows": lay.second_rows,
          "array": lay.second_array, "segment_rows": in_segment_rows(lay).second_array,
          "unaligned": unaligned.second_array, "busiest": max(busiest, 1),
          "gather": gather(lay), "gather_unaligned": gather(unaligned),
          "gather_ideal": (m - 1) / m * busiest, "largest_segment": largest,
          "most_owners": max(1 + len(place.copies) for plan in lay.plans
                             for _, place in plan.places)}


def metrics(lay: layout_lib.Layout, layers, spngd_lay=None) -> dict:
  """`spngd_lay`: the MEM-OPT layout SP-NGD's gradient reduce-scatter uses
  (layers not replicated); default `lay`."""
  p, m = lay.num_devices, lay.group_size
  r = (p - 1) / p
  places = [f for pl in lay.plans for f in C.factor_places(pl)]
  cost = lambda f: layout_lib.eigh_cost(f.dim, f.form)
  load = [0.0] * p
  copies = 0
  for pl in lay.plans:            # every owner of a replicated item pays its d³
    for piece in getattr(pl, "pieces", (pl,)):
      for f in C.factor_places(piece):
        for q in (f,) + tuple(getattr(f, "copies", ())):
          load[q.owner] += cost(q)
          copies += q is not f or piece is not pl
  total = sum(load)
  largest = max(cost(f) for f in places)
  ideal = max(total / p, largest)
  items = sorted((sum(cost(f) for f in C.factor_places(pl)) for pl in lay.plans)
                 if m == 1 else (cost(f) for f in places), reverse=True)
  # the best any assignment of whole items (MEM-OPT: layers, else factors) can
  # do: the mean, the largest item, and (pigeonhole) the P-th and (P+1)-th largest
  # items sharing a device
  best = max(total / p, items[0], items[p - 1] + items[p] if len(items) > p else 0.0)
  stored = sum(f.size for f in places)
  second_items = [C.second_numbers(f, lay.method) for f in places]
  second = sum(second_items)
  grad_items = [pl.layer.a_dim * pl.layer.g_dim for pl in lay.plans]
  grads = sum(grad_items)
  _, group_sizes, s_pad = C.gradient_offsets(lay)
  g = lay.num_groups
  chunk = max(-(-stored // p), 1)          # C = ⌈T/P⌉, the tight chunk
  chunked = lay.factor_storage == layout_lib.CHUNKED
  shard = lay.factor_shard                 # C (chunked) or L (owner segments)
  assert shard == (chunk if chunked else lay.segment), (shard, chunk, lay.segment)
  kaisa = 2 * r * sum(f.dim * f.dim for f in places) * F32
  if chunked:
    coll = {
        # factor steps: psum_scatter of the tight chunks [P·C]
        "factor_rs": {"library": (p - 1) * chunk * F32, "ideal": r * stored * F32,
                      "floor": (p - 1) * chunk * F32,
                      "before": (p - 1) * lay.segment * F32, "kaisa": kaisa,
                      "zeros": p * chunk - stored, "overflow": 0, "items": "factor"},
        # inverse steps: all_gather of the chunks, each owner reads its factors
        "chunk_ag": {"library": (p - 1) * chunk * F32, "ideal": r * stored * F32,
                     "floor": (p - 1) * chunk * F32, "before": 0.0, "kaisa": 0.0,
                     "zeros": p * chunk - stored, "overflow": 0, "items": "factor"},
    }
  else:
    # owner segments (the cadence makes them cheaper, `kfac.layout.cheaper_storage`):
    # psum_scatter of [P·L] on factor steps, no gather on inverse steps. Floor
    # over any one-owner assignment: L >= max(⌈T/P⌉, largest stored factor).
    coll = {
        "factor_rs": {"library": (p - 1) * shard * F32, "ideal": r * stored * F32,
                      "floor": (p - 1) * max(chunk, max(f.size for f in places)) * F32,
                      "before": (p - 1) * lay.segment * F32, "kaisa": kaisa,
                      "zeros": p * shard - stored, "overflow": 0, "items": "factor",
                      "largest": max(f.size for f in places), "share": stored / p},
    }
  if g == 1:          # COMM-OPT: eigenbases of every owner to every device
    u = uneven(lay.second_sizes, p, gather=True)
    coll["eigen_bcast"] = dict(u, floor=uneven_floor(second_items, p),
                               before=(p - 1) * lay.second_segment * F32, kaisa=None,
                               items="factor", largest=max(second_items),
                               share=second / p)
  if m == 1 and g > 1:  # MEM-OPT: preconditioned gradients every step (SP-NGD: + RS)
    _, sp_sizes, sp_pad = C.gradient_offsets(spngd_lay or lay)
    for name, sizes, pad in (("grad_ag", group_sizes, s_pad),
                             ("spngd_rs", sp_sizes, sp_pad)):
      coll[name] = dict(uneven(sizes, p, gather=name == "grad_ag"),
                        floor=uneven_floor(grad_items, p),
                        before=(p - 1) * pad * F32, kaisa=None, items="layer",
                        largest=max(grad_items), share=grads / p)
  for c in coll.values():
    c["ratio"] = c["library"] / c["ideal"]
    c["floor_ratio"] = c["floor"] / c["ideal"]
  every = [n for n in ("grad_ag",) if n in coll]
  inverse = [n for n in ("chunk_ag", "eigen_bcast") if n in coll]
  amort = lambda key: (sum(coll[n][key] for n in every)
                       + coll["factor_rs"][key] / FACTOR_EVERY
                       + sum(coll[n][key] for n in inverse) / INVERSE_EVERY)
  # (before f563242 there was no chunk all_gather: its "before" is 0)
  return {
      "P": p, "m": m, "G": g, "layers": len(lay.plans), "factors": len(places),
      "sum_d3": total, "max_device_d3": max(load), "largest_d3": largest,
      "balance": max(load) / ideal,
      "bound": best / ideal,
      "idle_devices": sum(1 for v in load if v == 0), "replicas": copies,
      "T": stored, "C": chunk, "L": lay.segment, "L2": lay.second_segment,
      "storage": lay.factor_storage, "L_over_C": lay.segment / chunk,
      "sum_second": second, "second_padding": second_array(lay) / second,
      "second_padding_segment_rows": second_array(in_segment_rows(lay)) / second,
      "sum_grad": grads, "group_sizes": list(group_sizes),
      "second_sizes": list(lay.second_sizes), "collectives": coll,
      "amortised_ratio": amort("library") / amort("ideal"),
      "amortised_vs_before": amort("library") / amort("before"),
  }


def model_bytes(lay: layout_lib.Layout) -> dict:
  """The compiled update's collectives by step kind (extra bytes of a factor
  and of an inverse step), from the library's cost model (`kfac.cost`; the
  caller's gradient all-reduce is outside tx.update)."""
  b = cost.step_bytes(lay, "reduce_scatter", "none", F32)
  return {"plain": sum(v for name, v in b.plain if "tagged gradients" not in name),
          "factor": sum(v for _, v in b.factor), "inverse": sum(v for _, v in b.inverse)}


def with_storage(lay: layout_lib.Layout) -> layout_lib.Layout:
  """The running-factor storage the transform picks at init for this cadence
  (`kfac.layout.cheaper_storage`, 69e5d57): tight chunks when L/C > 1 + 1/k, k =
  INVERSE_EVERY / FACTOR_EVERY = 10, else owner segments."""
  if lay.num_devices == 1 or lay.factor_storage != layout_lib.CHUNKED:
    return lay
  return dataclasses.replace(lay, factor_storage=C.cheaper_storage(
      lay, FACTOR_EVERY, INVERSE_EVERY))


# ------------------------------------------------- alternative layout modules

def load_build(path: str | None):
  """`build` of the library's layout module, or of a drop-in replacement file
  (same signature, e.g. a prototype assignment) given with --alt-layout."""
  if path is None:
    return layout_lib.build
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("alt_layout", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["alt_layout"] = module
  spec.loader.exec_module(module)
  return module.build


# --------------------------------------------------------------- compile time

def _statistics_shapes(model: str, p: int, params) -> dict:
  """The global `kfac_stats` of the model's grad_fn (abstract), each leaf's first
  axis P times one device's: `shard_map` gives each device its own."""
  layers, _, _, grad_fn, x, y = discover(model, with_loss=True)
  local = jax.eval_shape(lambda q, a, b: grad_fn(q, a, b)[2], params, x, y)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct((p * s.shape[0],) + s.shape[1:],
                                                     s.dtype), local)


HLO_OP = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*\S")
STABLEHLO_OP = re.compile(r"^\s*(%[\w#:]+(, %[\w#:]+)*\s*=\s*)?\"?(stablehlo|sdy|mhlo|func)\.")


HYBRID_GROUP = 8        # the "HYBRID" program's owner groups: one node's 8 devices
STALE = " stale"       # a strategy with SP-NGD's stale statistics (α = 0.1)
EKFAC = " ekfac"       # a strategy with EK-FAC's correction: the whole step, capture included


def _update_program(model: str, p: int, strategy: str):
  """(the jitted shard_map'd program, its abstract arguments): `tx.update`
  of `kd.kfac` (eigen, cadence 10/100; stale statistics for `STALE`) on
  abstract gradients, statistics and state; for `EKFAC` the whole step, the
  capture included (EK-FAC's statistic `S` is measured in the state's
  eigenbases, so the capture needs the state)."""
  layers, _, params = discover(model)
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  m = {"COMM-OPT": p, "HYBRID": HYBRID_GROUP}.get(strategy.split()[0], 1)
  dist = kd.Distribution(mesh, grad_worker_fraction=m / p)
  cadence = (dict(stale_threshold=0.1) if strategy.endswith(STALE) else
             dict(factor_update_every=10, inverse_update_every=100))
  correction = dict(eigenvalue_correction="ekfac") if strategy.endswith(EKFAC) else {}
  tx = kd.kfac(0.1, layers=layers, distribution=dist, **cadence, **correction)
  state = jax.eval_shape(tx.init, params)
  specs = kd.partition_specs(state)
  if correction:
    _, _, _, grad_fn, x, y = discover(model, with_loss=True)
    batch = [jax.ShapeDtypeStruct((p * a.shape[0],) + a.shape[1:], a.dtype) for a in (x, y)]

    def step(params, state, x, y):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      return tx.update(jax.lax.pmean(grads, "data"), state, params, kfac_stats=stats)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"),
                                                            P("data")),
                                 out_specs=(P(), specs))), (params, state, *batch)
  stats = _statistics_shapes(model, p, params)

  def update(grads, state, params, stats):
    return tx.update(grads, state, params, kfac_stats=stats)
  in_specs = (P(), specs, P(), jax.tree.map(lambda _: P("data"), stats))
  return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=in_specs,
                               out_specs=(P(), specs))), (params, state, params, stats)


def compile_update(model: str, p: int, strategy: str, compile_program: bool = True) -> dict:
  """`_update_program` of `model` at P devices lowered (its StableHLO
  operations: the program's size) and, unless `compile_program` is false,
  compiled (its HLO instructions and collectives)."""
  fn, args = _update_program(model, p, strategy)
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  text = lowered.as_text()
  out = {"model": model, "P": p, "strategy": strategy, "lower_s": t1 - t0,
         "stablehlo_ops": sum(1 for line in text.splitlines() if STABLEHLO_OP.match(line)),
         "stablehlo_chars": len(text)}
  if not compile_program:
    return out
  compiled = lowered.compile()
  t2 = time.perf_counter()
  hlo = compiled.as_text()
  found, _ = C.collectives(hlo, p)
  tot = C.totals(found)
  return dict(out, compile_s=t2 - t1, load_avg_1min=os.getloadavg()[0],
              hlo_chars=len(hlo),
              hlo_instructions=sum(1 for line in hlo.splitlines() if HLO_OP.match(line)),
              plain_bytes=C.step_bytes(tot, "plain"),
              factor_bytes=C.step_bytes(tot, "factor") - C.step_bytes(tot, "plain"),
              inverse_bytes=C.step_bytes(tot, "inverse") - C.step_bytes(tot, "factor"))


def compile_in_subprocess(model, p, strategy, timeout, compile_program=True) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={p}",
             OPENBLAS_NUM_THREADS="1")
  cmd = [sys.executable, os.path.abspath(__file__), "--_compile",
         f"{model},{p},{strategy},{'compile' if compile_program else 'lower'}"]
  t0 = time.perf_counter()
  try:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"model": model, "P": p, "strategy": strategy,
            "error": f"not finished within {timeout} s (killed)"}
  for line in out.stdout.splitlines()[::-1]:
    if line.startswith("{"):
      return json.loads(line)
  return {"model": model, "P": p, "strategy": strategy,
          "error": f"exit {out.returncode} after {time.perf_counter() - t0:.0f} s: "
                   + out.stderr.strip().splitlines()[-1][:300] if out.stderr.strip() else ""}


# ------------------------------------------------------------- program size

SIZE_MODELS = ("resnet50", "gpt2_xl")
SIZE_STRATEGIES = {"resnet50": ("MEM-OPT", "COMM-OPT", "HYBRID", "MEM-OPT" + EKFAC,
                                "COMM-OPT" + EKFAC),
                   "gpt2_xl": ("MEM-OPT", "COMM-OPT", "HYBRID", "MEM-OPT" + STALE,
                               "COMM-OPT" + STALE,
                               "MEM-OPT" + EKFAC, "COMM-OPT" + EKFAC)}
TARGET_SIZE = 2.0        # ops at P = 1024 over ops at P = 64


def program_sizes(args, compiles: list[dict], reused: list[dict], git: str) -> list[dict]:
  """The update program lowered at each P of --program-size in a subprocess
  with that many host devices (StableHLO operations; compiling 1024-device
  programs is beyond this machine); a compile row's lowering, or a `reused`
  row (--reuse-compiles), serves where there is one. New rows are labelled
  with `git`, the commit they are measured at."""
  ps = [int(v) for v in (args.program_size if args.program_size is not None
                         else ("" if args.quick else "64,256,1024")).split(",") if v]
  out = []
  for model in SIZE_MODELS:
    for p in ps:
      for strategy in SIZE_STRATEGIES[model]:
        done = [c for c in compiles + reused if (c["model"], c["P"], c["strategy"]) ==
                (model, p, strategy) and "stablehlo_ops" in c]
        if done:
          res = done[0]
        else:
          res = compile_in_subprocess(model, p, strategy, args.compile_timeout,
                                      compile_program=False)
          res["measured_at"] = git
        out.append(res)
        print("  program size", {k: v for k, v in res.items() if k != "model_bytes"},
              flush=True)
  return out


def size_rows(sizes: list[dict], layouts: dict) -> tuple[list[list], list[str]]:
  """The program-size table and its verdicts (P = 1024 against P = 64); beside
  each, the decomposition batches of all devices together and the branches
  of the decompositions' per-device switch (`Layout.decomposition_branches`:
  devices with the same work share one, so the code grows with the kinds of
  work, not with the devices)."""
  table, verdicts = [], []
  for r in sizes:
    base = [b for b in sizes if (b["model"], b["strategy"], b["P"]) ==
            (r["model"], r["strategy"], 64) and "stablehlo_ops" in b]
    if "error" in r:
      table.append([r["model"], r["P"], r["strategy"], r["error"], "", "", "", "", "", "",
                    r.get("measured_at", "")])
      continue
    growth = r["stablehlo_ops"] / base[0]["stablehlo_ops"] if base else float("nan")
    hlo = r.get("hlo_instructions")
    hlo_growth = (hlo / base[0]["hlo_instructions"]
                  if hlo and base and base[0].get("hlo_instructions") else None)
    lay = layouts.get((r["model"], r["P"], r["strategy"]))
    batches = (f"{sum(len(b) for b in lay.batches)} / {len(set(lay.decomposition_branches))}"
               if lay is not None else "")
    table.append([r["model"], r["P"], r["strategy"], batches, f"{r['stablehlo_ops']:,}",
                  f"{r['stablehlo_chars'] / 1e6:.1f} M", f"{growth:.2f}",
                  f"{hlo:,}" if hlo else "not compiled",
                  f"{hlo_growth:.2f}" if hlo_growth else "", f"{r['lower_s']:.1f}",
                  r.get("measured_at", "")])
    if r["P"] == 1024 and base:
      verdicts.append(f"{r['model']} {r['strategy']}: {growth:.2f}× the operations of "
                      f"P = 64 (target <= {TARGET_SIZE}: "
                      f"{'holds' if growth <= TARGET_SIZE else '**misses**'})")
  return table, verdicts


# ---------------------------------------------------------------------- report

COLLECTIVES = (("factor_rs", "factor RS (factor steps)"),
               ("chunk_ag", "chunk AG (inverse steps)"),
               ("eigen_bcast", "eigen broadcast (COMM-OPT, inverse steps)"),
               ("grad_ag", "MEM grad gather (every step)"),
               ("spngd_rs", "SP-NGD grad RS (every step)"))
SHORT = {"factor_rs": "factor RS", "chunk_ag": "chunk AG", "eigen_bcast": "eigen bcast",
         "grad_ag": "MEM grad AG", "spngd_rs": "SP-NGD grad RS"}
MODELS = ("resnet50", "bert_large", "gpt2_xl")
TARGET_BALANCE, TARGET_COMM = 1.10, 1.10  # issue 16 (1.25 before it)


def miss_reason(name: str, c: dict) -> str:
  what = ("stored factor" if name == "factor_rs" else
          {"factor": "factor's d²+d", "layer": "layer's gradient"}[c["items"]])
  if c["floor_ratio"] > TARGET_COMM:
    return (f"{SHORT[name]} {c['ratio']:.2f}: inherent — the largest {what} is "
            f"{c['largest'] / c['share']:.2f}× a device's share Σ/P (one owner per "
            f"{c['items']}); floor of any assignment {c['floor_ratio']:.2f}")
  return (f"{SHORT[name]} {c['ratio']:.2f}: assignment — floor of any one-owner "
          f"assignment {c['floor_ratio']:.2f}; the layout balances d³, not these sizes"
          + ("" if name == "factor_rs" else
             f" ({c['scheme']} scheme, the cheaper of the two by `uneven.cost`)"))


def main(argv=None):
  ap = C.argument_parser(__doc__)
  ap.add_argument("--quick", action="store_true",
                  help="compiles the MEM-OPT update at P = 8 only (unless --compile); "
                  "writes layout_balance_quick.*")
  ap.add_argument("--devices", default=None,
                  help="P values of the balance tables (default 8,64,256,1024; quick 8,64)")
  ap.add_argument("--compile", default=None,
                  help="P values to compile the ResNet-50 update at (default 8,64,256; quick 8)")
  ap.add_argument("--program-size", default=None,
                  help="P values to lower the ResNet-50 and GPT-2-XL updates at, for the "
                  "program's size (default 64,256,1024; quick none)")
  ap.add_argument("--compile-timeout", type=float, default=300.0)
  ap.add_argument("--alt-layout", default=None,
                  help="a layout.py-like file whose build() is measured beside the library's")
  ap.add_argument("--reuse-compiles", default=None, metavar="JSON",
                  help="take the compile results from a previous layout_balance.json "
                       "instead of compiling (re-renders the report in seconds); rows "
                       "keep the commit they were measured at; with --compile, those P "
                       "are compiled anew")
  ap.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args._compile:
    model, p, strategy, what = args._compile.split(",")
    print(json.dumps(compile_update(model, int(p), strategy, what == "compile")), flush=True)
    return

  head = C.environment()
  alt_build = load_build(args.alt_layout) if args.alt_layout else None
  if args.alt_layout:
    head["alt_layout"] = os.path.abspath(args.alt_layout)
  ps = [int(v) for v in (args.devices or ("8,64" if args.quick else "8,64,256,1024")
                         ).split(",")]
  rows = []
  models = {}
  layouts = {}          # (model, P, strategy) -> the library's layout
  for model in MODELS:
    t0 = time.perf_counter()
    layers, paths, _ = discover(model)
    models[model] = {"layers": len(layers), "discover_s": time.perf_counter() - t0,
                     "dims": sorted({d for l in layers for d in (l.a_dim, l.g_dim)})}
    for p in ps:
      for name, m in (("MEM-OPT", 1), ("COMM-OPT", p)):
        t0 = time.perf_counter()
        lay = with_storage(layout_lib.build(layers, paths, num_devices=p, group_size=m))
        sp = (with_storage(layout_lib.build(layers, paths, num_devices=p, group_size=m,
                                            replicate_layers=False)) if m == 1 else None)
        r = metrics(lay, layers, sp)
        r.update(model=model, layout="library LPT", strategy=name,
                 build_s=time.perf_counter() - t0)
        layouts[(model, p, name)] = lay
        # stale statistics store the running factors per owner (`KfacConfig.factor_storage`)
        layouts[(model, p, name + STALE)] = dataclasses.replace(
            lay, factor_storage=layout_lib.OWNER)
        layouts[(model, p, name + EKFAC)] = lay
        rows.append(r)
        if alt_build is not None:
          t0 = time.perf_counter()
          lay = with_storage(alt_build(layers, paths, num_devices=p, group_size=m))
          r = metrics(lay, layers)
          r.update(model=model, layout="alternative", strategy=name,
                   build_s=time.perf_counter() - t0)
          rows.append(r)
        lib = [x for x in rows if x["layout"] == "library LPT"][-1]
        print(f"  {model} P={p} {name}: balance {lib['balance']:.3f}; comm / ideal "
              + ", ".join(f"{SHORT[k]} {c['ratio']:.3f}" for k, c in lib["collectives"].items())
              + f" (build {lib['build_s']:.2f} s)"
              + (f"; alternative balance {r['balance']:.3f}" if alt_build is not None else ""),
              flush=True)

  hybrid = []
  for model in MODELS:
    for lay in hybrid_layouts(model, ps):
      hybrid.append(hybrid_memory(model, lay))
      if lay.group_size == HYBRID_GROUP:
        layouts[(model, lay.num_devices, "HYBRID")] = with_storage(lay)
  compiles = []
  cps = [int(v) for v in (args.compile if args.compile is not None
                          else ("8" if args.quick else "8,64,256")).split(",") if v]
  old = {}
  if args.reuse_compiles:
    with open(args.reuse_compiles) as f:
      old = json.load(f)
    compiles = old["compiles"]
    for c in compiles:          # label each carried-over row with its commit
      c.setdefault("measured_at", "—" if "error" in c else old["header"]["git"])
      c.pop("model_bytes", None)
    cps = [int(v) for v in args.compile.split(",") if v] if args.compile else []
    compiles = [c for c in compiles if c["P"] not in cps]
  for model in ("resnet50",) if args.quick else SIZE_MODELS:
    for p in cps:
      for strategy in ("MEM-OPT",) if args.quick else ("MEM-OPT", "COMM-OPT"):
        if p <= jax.device_count():
          try:
            res = compile_update(model, p, strategy)
          except Exception as e:  # pylint: disable=broad-except
            res = {"model": model, "P": p, "strategy": strategy,
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
        else:
          res = compile_in_subprocess(model, p, strategy, args.compile_timeout)
        res["measured_at"] = head["git"]
        compiles.append(res)
        print("  compile", {k: v for k, v in res.items() if "bytes" not in k}, flush=True)
  compiles.sort(key=lambda c: (c["model"], c["P"], c["strategy"] != "MEM-OPT"))
  sizes = program_sizes(args, compiles, old.get("program_sizes", []) if args.reuse_compiles
                        else [], head["git"])

  for c in compiles:
    key = (c["model"], c["P"], c["strategy"])
    if key in layouts and "error" not in c:
      c["model_bytes"] = model_bytes(layouts[key])

  targets = []
  for r in rows:
    if r["layout"] != "library LPT":
      continue
    coll = r["collectives"]
    worst = max(c["ratio"] for c in coll.values())
    misses = [miss_reason(k, c) for k, c in coll.items() if c["ratio"] > TARGET_COMM]
    if r["balance"] > TARGET_BALANCE:
      whole = "layers" if r["m"] == 1 else "factors"
      misses.insert(0, f"balance: inherent, the best any assignment of whole {whole} "
                    f"can do is {r['bound']:.3f}" if r["bound"] > TARGET_BALANCE else
                    f"balance: assignment, the best possible is {r['bound']:.3f}")
    targets.append([
        r["model"], r["P"], r["strategy"],
        f"{r['storage']} (L/C {r['L_over_C']:.3f})",
        f"{r['balance']:.3f}", "yes" if r["balance"] <= TARGET_BALANCE else "**no**",
        " / ".join(f"{c['ratio']:.3f}" for c in coll.values()),
        "yes" if worst <= TARGET_COMM else "**no**",
        f"{r['amortised_ratio']:.3f}", f"{r['amortised_vs_before']:.3f}",
        "; ".join(misses)])

  out = ["# K-FAC layout: load balance and communication padding (ResNet-50, BERT-Large, "
         "GPT-2-XL)",
         "", C.header_md(head),
         "- layer shapes from kd.linen models, discovered shapes-only (jax.eval_shape); "
         "`kfac_jax_dist.kfac.layout.build(layers, paths, num_devices=P, group_size=m)`, "
         "method eigen, packed (symmetric) factors, no max_factor_dim, factor_reduction "
         "reduce_scatter, running-factor storage as the transform picks it at init for "
         "the cadence 10/100 (`kfac.layout.cheaper_storage`, 69e5d57): tight chunks when "
         "L/C > 1 + 1/10, else owner segments (column \"storage\").",
         "- ResNet-50: bottleneck v1.5, no conv bias, BatchNorm untagged, FC 2048→1000 "
         f"with bias ({models['resnet50']['layers']} layers). BERT-Large: 24 × (Q, K, V, O "
         "1024→1024, FFN 1024→4096→1024, all with bias) + pooler 1024→1024 "
         f"({models['bert_large']['layers']} layers); embeddings, LayerNorms and the "
         "2-way classifier untagged (passed through), no vocabulary decoder; every factor "
         "full (largest 4097). GPT-2-XL: 48 pre-LN blocks under one `nn.scan` (each "
         "projection one stacked layer [48, ...], a plan per block): q, k, v, o "
         "1600→1600, MLP 1600→6400→1600, all with bias, LayerNorms tagged (diagonal "
         f"scale-and-shift), the final LayerNorm ({models['gpt2_xl']['layers']} tagged "
         "layers); token (vocabulary 50257) and position embeddings and the tied head "
         "untagged (the vocabulary skipped); largest factor 6401.",
         "- **balance** = max over devices of Σd³ of the factors it decomposes / "
         "max(Σd³/P, largest d³); its bound = the best any assignment of whole items "
         "(MEM-OPT: layers, a layer's two factors on one device; else factors) can do, "
         "over the same ideal: max(Σd³/P, the largest item, the P-th and (P+1)-th "
         "largest items together, since two of the P+1 largest share a device). Target "
         f"<= {TARGET_BALANCE} (issue 16; 1.25 before).",
         "- **communication padding overhead** of a collective = bytes per device the "
         "library sends (ring model, f32, from the layout; the compiled HLO agrees, see the "
         "compile table) / bytes of the same communication without padding, the "
         "padding-free ring all_gather / reduce-scatter of the useful numbers: "
         "(P-1)/P·Σ useful. Target <= 1.10. The library's collectives:",
         "  - factor RS (factor steps): chunked: psum_scatter of the tight chunks [P·C], "
         "C = ⌈T/P⌉, T = Σ stored triangles: (P-1)·C; owner: psum_scatter of the owner "
         "segments [P·L], L the longest owner's: (P-1)·L (floor over any one-owner "
         "assignment: (P-1)·max(C, largest stored factor));",
         "  - chunk AG (inverse steps, chunked storage only): all_gather of the chunks, "
         "(P-1)·C, so that each owner reads its whole factors (not in KAISA, whose "
         "all-reduce leaves every factor everywhere, nor with owner segments);",
         "  - eigen broadcast (COMM-OPT inverse steps), MEM grad gather (MEM-OPT, every "
         "step) and SP-NGD grad RS (MEM-OPT + gradient_reduction=reduce_scatter, every "
         "step; the mirror of the gather): uneven, per-device sizes u_i "
         "(`Layout.second_sizes`; `kfac.layout.gradient_offsets`, slot 0 the KL sum), in the "
         "scheme `uneven.plan` picks by its cost model (bytes of the busiest device plus "
         f"a latency of {uneven_lib.LATENCY_NUMBERS} numbers per collective, "
         "`uneven.LATENCY_NUMBERS`). **prefix**: the first "
         "S = `prefix_length(u)` numbers of every device by all_gather / psum_scatter, "
         "(P-1)·S, and the overflow Σmax(0, u_i - S), packed tight, by one psum, "
         "2(P-1)/P of it (library - ideal = (P-1)/P·(zeros + overflow)). **rechunk**: "
         "one tight all_gather / psum_scatter of P chunks of C = ⌈Σu/P⌉ ((P-1)·C, the "
         "ideal), or of longer chunks where that lets one ppermute forward every "
         "overflow (`uneven.matched`), each device's chunk starting with its own first "
         "min(u_i, C) numbers "
         "and the overflow of devices over C filling the others' room; ppermutes "
         "forward each overflow piece between its owner and the device holding it "
         "(pieces of similar size share a ppermute, padded by <= 5%). Point-to-point "
         "sends are not symmetric, so the library column is the busiest device's larger "
         "of bytes sent and received (a big owner receives its overflow in the "
         "reduce-scatter, sends it in the gather).",
         "- not in the tables above: the fault check's psum of one int32 on factor steps "
         "(04bba86), 2(P-1)/P·4 B (7 B at P = 8); it is in the compile table's HLO bytes "
         "and layout model.",
         "- oversized items: `layout.build` gives a factor (COMM-OPT) or a layer "
         "(MEM-OPT) larger than a device's share several owners, each decomposing it "
         "whole and sending a slice (eigenvector columns, preconditioned rows), while the "
         "copies stay within `layout.REPLICA_BUDGET` (2.5×, or +32) of the unsplit "
         "decompositions: where unlimited splitting is over the budget (ResNet-50 at "
         "P = 256), each item's owners are capped at the largest count within it "
         "(Balance table, last column: the extra copies). SP-NGD's gradient RS uses the layout "
         "without split layers (`replicate_layers=False`): every owner of a split layer "
         "would need its whole reduced gradient.",
         "- floor = the fewest bytes of either scheme over any assignment of whole items "
         "(a factor, or a layer's gradient, has one owner) and any S (a lower bound, see "
         "`uneven_floor`; the rechunk's is (P-1)·C plus the largest item's excess over "
         "C). before = the padded collectives of the library before f563242 (owner "
         "segments [P·L], [P·L₂], [G·S]).",
         "- amortised = all the strategy's K-FAC collectives at factor_update_every=10, "
         "inverse_update_every=100 (MEM-OPT: grad gather every step; SP-NGD's RS not "
         "included), library / ideal, and library / the library before f563242 (bytes; "
         "below 1 = fewer bytes now). Where the owner segments are nearly tight (L/C <= 1.1: "
         "BERT-Large P = 8, COMM-OPT P = 64) the transform keeps them, so the bytes equal "
         "the \"before\" ones (ratio 1.000) instead of paying the chunk all_gather.",
         (f"- alternative = `build` of {args.alt_layout} (not the library)."
          if args.alt_layout else "- library layout only (see --alt-layout)."),
         "- Generated by `python benchmarks/layout_balance.py`.", ""]
  out.append(f"## Targets: balance <= {TARGET_BALANCE}, communication padding overhead "
             f"<= {TARGET_COMM:.2f} (every P)")
  out.append("")
  out.append("Overheads per collective, in the order factor RS / chunk AG (chunked storage "
             "only) / eigen broadcast (COMM-OPT) or MEM grad gather / SP-NGD grad RS "
             "(MEM-OPT).")
  out.append("")
  out.append(C.md_table(targets, ["model", "P", "strategy", "storage", "balance", "holds",
                                  "comm overhead per collective", "holds",
                                  "amortised 10/100 / ideal", "amortised bytes vs before",
                                  "misses and why"]))
  out.append("")
  out.append("## Balance")
  out.append("")
  out.append(C.md_table(
      [[r["model"], r["P"], f"{r['strategy']} {r['layout']}", r["m"], r["G"],
        r["idle_devices"], f"{r['balance']:.3f}", f"{r['bound']:.3f}",
        f"{r['storage']}: " + (f"C {r['C']}" if r["storage"] == "chunked" else f"L {r['L']}")
        + f" / {r['T'] / r['P']:.0f}", f"{r['L']}",
        f"{r['second_padding']:.3f} ({r['second_padding_segment_rows']:.3f})",
        r["replicas"]] for r in rows],
      ["model", "P", "layout", "m", "groups", "idle devices", "balance (d³)", "bound",
       "factors per device (C or L) / T/P", "before: longest owner L",
       "second-order memory (COMM-OPT: the array; else P·L₂) / Σ(d²+d) (in rows of L₂, "
       "before 44d087a)",
       "extra copies (split items)"]))
  out.append("")
  out.append("## HYBRID's second-order memory per device")
  out.append("")
  out.append("Each device holds its group's `m` segments one after another "
             "(`Layout.second_slots`: one table of slots by rank for every group, rank "
             "`r`'s as long as the longest of the groups' rank-`r` segments), against "
             "rows of `L₂` (before 44d087a) and the groups assigned one by one (before "
             "the groups were aligned, `layout.rebuild(lay, align_groups=False)`: no "
             "factor split within a group, each group balanced against its own mean, "
             "its ranks wherever its own assignment put them); busiest group = the most "
             "second-order numbers one group's owners compute. The in-group gather on "
             "decomposition steps: the busiest device's bytes in the scheme "
             "`uneven.plan(capacities, psum=False)` picks (ring model, f32), against the "
             "ideal (m-1)/m·(busiest group's numbers). From the layouts alone (nothing "
             "compiled).")
  out.append("")
  ratio = lambda h, key: h[key] / max(h["gather_ideal"], 1)
  out.append(C.md_table(
      [[h["model"], h["P"], h["m"], h["P"] // h["m"], f"{h['rows']} / {h['m']}",
        f"{h['array'] * F32 / 1e9:.2f}", f"{h['segment_rows'] * F32 / 1e9:.2f}",
        f"{h['unaligned'] * F32 / 1e9:.2f}",
        f"{h['busiest'] * F32 / 1e9:.2f}", f"{h['array'] / h['busiest']:.3f}",
        f"{h['unaligned'] / h['busiest']:.3f}",
        f"{C.fmt_bytes(h['gather'] * F32)} ({ratio(h, 'gather'):.2f})",
        f"{C.fmt_bytes(h['gather_unaligned'] * F32)} ({ratio(h, 'gather_unaligned'):.2f})"]
       for h in hybrid],
      ["model", "P", "m", "groups", "rows / m", "GB per device", "rows of L₂: GB",
       "unaligned groups: GB", "busiest group GB", "array / busiest group",
       "unaligned / busiest group", "in-group gather per device (/ ideal)",
       "unaligned groups' gather (/ ideal)"]))
  out.append("")
  out += hybrid_verdict(hybrid)
  out.append("")
  out.append("## Communication per collective (bytes per device, ring model, f32)")
  out.append("")
  ctab = []
  fb = C.fmt_bytes
  for r in rows:
    if r["layout"] != "library LPT":
      continue
    for key, label in COLLECTIVES:
      c = r["collectives"].get(key)
      if c is None:
        continue
      ctab.append([
          r["model"], r["P"], r["strategy"], label, fb(c["library"]), fb(c["ideal"]),
          f"{c['ratio']:.3f}", "yes" if c["ratio"] <= TARGET_COMM else "**no**",
          f"prefix S={c['S']}, zeros {c['zeros']}, psum'd overflow {c['overflow']}"
          if c.get("scheme") == "prefix" else
          (f"rechunk C={c['C']}, zeros {c['zeros']}, forwarded {c['overflow']} in "
           f"{c['pieces']} pieces, {c['sends']} ppermutes; busiest sends "
           f"{fb(c['sent'])}, receives {fb(c['received'])}")
          if c.get("scheme") == "rechunk" else
          (f"C={r['C']}, zeros {c['zeros']}" if r['storage'] == 'chunked'
           else f"owner L={r['L']}, zeros {c['zeros']}"),
          f"{c['floor_ratio']:.3f}",
          f"{fb(c['before'])} ({c['before'] / c['ideal']:.2f})" if c["before"] else "—",
          (f"{fb(c['kaisa'])} (library {c['library'] / c['kaisa']:.3f}×)"
           if c.get("kaisa") else "—")])
  out.append(C.md_table(ctab, [
      "model", "P", "strategy", "collective", "library", "ideal (P-1)/P·Σ", "overhead",
      "<= 1.10", "scheme (numbers)", "floor",
      "before f563242 (overhead)", "KAISA all-reduce of full factors"]))
  out.append("")
  out.append("## Compile time of the K-FAC update (shard_map'd tx.update)")
  out.append("")
  ctab = []
  for c in compiles:
    if "error" in c:
      ctab.append([c["model"], c["P"], c["strategy"], c.get("measured_at", ""), "", "",
                   c["error"], "", "", "", "", ""])
      continue
    mb = c.get("model_bytes", {})
    agree = all(abs(mb.get(k, float("nan")) - c[k + "_bytes"]) < 64
                for k in ("plain", "factor", "inverse"))
    ctab.append([c["model"], c["P"], c["strategy"], c.get("measured_at", ""),
                 f"{c['lower_s']:.1f}", f"{c['compile_s']:.1f}",
                 f"load avg {c['load_avg_1min']:.1f}" if "load_avg_1min" in c else "",
                 f"{c['hlo_instructions']:,}" if "hlo_instructions" in c else "",
                 fb(c["plain_bytes"]), fb(c["factor_bytes"]), fb(c["inverse_bytes"]),
                 ("yes" if agree else
                  "no: " + " / ".join(fb(mb.get(k, 0)) for k in ("plain", "factor", "inverse")))
                 + ("" if c.get("measured_at", head["git"]) == head["git"] else
                    f" (HLO of {c['measured_at']})")])
  out.append(C.md_table(ctab, ["model", "P", "strategy", "measured at", "trace+lower s",
                               "XLA compile s", "note", "HLO instructions",
                               "update's plain-step bytes", "factor-step extra",
                               "inverse-step extra", "HLO == cost model"]))
  out.append("")
  out.append("(bytes: ring model per device, of the collectives inside tx.update only — the "
             "gradient all-reduce of the training step is outside it; default Distribution: "
             "factor_reduction reduce_scatter, symmetric_comm. Compile times are wall-clock "
             "on a shared machine (note: the 1-minute load average after the compile, "
             "where recorded): compare them within one run only.)")
  out.append("")
  out.append("## Program size of the update (does the per-device code grow with P?)")
  out.append("")
  out.append("The shard_map'd `tx.update` (eigen, cadence 10/100; \"HYBRID\" rows: "
             f"owner groups of {HYBRID_GROUP}, P/{HYBRID_GROUP} groups; \"stale\" rows: "
             "stale statistics, `stale_threshold=0.1`; \"ekfac\" rows: EK-FAC, the whole "
             "step with the capture that measures its statistic) lowered at each P in a "
             "subprocess with P host devices: its StableHLO operations (the program XLA "
             "receives; every device runs the same program, its own work in a branch of "
             f"a `lax.switch` on its index). Target: P = 1024 <= {TARGET_SIZE}× P = 64.")
  out.append("")
  table, verdicts = size_rows(sizes, layouts)
  out.append(C.md_table(table, ["model", "P", "strategy", "decomposition batches (all "
                                "devices) / branches", "StableHLO ops", "text",
                                "× P = 64", "compiled HLO instructions", "× P = 64",
                                "trace+lower s", "measured at"]))
  out.append("")
  out.extend(f"- {v}" for v in verdicts)
  out += ["", "Each device's decompositions are a branch of the per-device switch "
          "(one batched eigendecomposition per factor shape it owns). Devices whose "
          "work has the same shapes (the same batches, and the sizes of the running "
          "factors they read, factor by factor, stored or a replica's home copy: "
          "`Layout.input_ranges`) share one branch (`Layout.decomposition_branches`), "
          "each reading its factors, previous segment and damping at offsets from its "
          "index; a split factor's column pieces count by width, each device slicing "
          "its own columns at a start from a table; the kept-on-failure selection runs "
          "once after the switch, on each branch's slot table. So the branches grow "
          "with the kinds of work, not with P (GPT-2-XL at P = 1024: 576 factors, most "
          "devices owning one of a few shapes). Owner groups whose preconditioning is "
          "the same up to which blocks of their stacked layers they hold share one "
          "branch too (`Layout.group_branches`: GPT-2-XL MEM-OPT at P = 1024, 20 "
          "branches for 1024 groups), and equal-shape layers are preconditioned as one "
          "run wherever their state lies (`layout.precondition_runs`, one gather per "
          "part). The uneven gathers are read where the numbers arrived "
          "(`uneven.Gathered`), and the statistics buffer past 2³¹ numbers is written "
          "in spans of a stack's blocks over consecutive devices (`packing._span_plan`: "
          "GPT-2-XL MEM-OPT at P = 1024, 9 spans for 1024 devices). What still grows "
          "with P is a slice per device or forwarded piece where COMM-OPT's "
          "second-order segments are laid out padded, MEM-OPT's read of each row-split "
          "layer piece, and COMM-OPT's 12 decomposition branches at P = 1024 (5 at "
          "P = 64) from its more varied pairings of column pieces; see PERF_NOTES "
          "§20–21. The compiled HLO "
          "instruction counts come from the compile rows, which may be from an earlier "
          "commit (see the compile table's 'measured at')."]
  text = "\n".join(out)
  print(text)
  C.write_results(args.out, C.stem("layout_balance", args.quick)
                  + ("_alt" if args.alt_layout else ""), text,
                  {"header": head, "models": models, "rows": rows, "compiles": compiles,
                   "program_sizes": sizes, "hybrid_memory": hybrid})


if __name__ == "__main__":
  main()
