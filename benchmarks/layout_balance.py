"""Load balance and padding of the K-FAC layout on ResNet-50 and BERT-Large.

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
  `max_factor_dim`: every factor (up to 4097) is a full matrix.

For P = 8, 64, 256 and MEM-OPT (group size m = 1) and COMM-OPT (m = P),
`kfac_jax_dist.layout.build(layers, paths, num_devices=P, group_size=m)` is
called and its placement measured:

* balance: max over devices of Σ d³ of the factors it decomposes, over the
  ideal `max(Σ d³ / P, largest single d³)`; "layer bound" is the same ideal
  when a layer's two factors must share an owner group (MEM-OPT);
* factor padding: P·L / Σ stored factor numbers (upper triangles) — the bytes
  of the factor reduce-scatter (and of the running-factor memory) over the
  useful ones;
* gradient padding: G·S / Σ layer gradient sizes (`_gradient_offsets`: G
  groups of S) — the per-step preconditioned-gradient all-gather of MEM-OPT
  (COMM-OPT has G = 1 and gathers nothing);
* second-order padding: P·L₂ / Σ second-order numbers (d² + d per factor);
* the padding-free lower bounds of any one-owner-per-factor (per-layer)
  layout: P·(largest triangle) / Σ and P·(largest layer) / Σ.

With `--alt-layout FILE` the same metrics are also given for the `build` of
another layout module with the library's signature (e.g. a prototype
assignment in a copy of layout.py), side by side with the library's.

Finally the compile time of the shard_map'd K-FAC update (`tx.update` of
`kd.kfac`, eigen, factor_update_every=10, inverse_update_every=100, on
abstract ResNet-50 gradients, statistics and state; `jit(...).lower().compile()`)
at P = 8 in this process, and at P = 64 in a subprocess with 64 host devices
(with a time limit; reported as not feasible if it runs out).

Usage: python benchmarks/layout_balance.py [--quick] [--devices 8,64,256]
       [--compile 8,64] [--compile-timeout S] [--out DIR]
(--quick: no P = 64 compile; writes layout_balance_quick.*).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd
from kfac_jax_dist import layout as layout_lib
from kfac_jax_dist import registry
from kfac_jax_dist.kfac import _gradient_offsets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


# ---------------------------------------------------------------------- models

class Bottleneck(nn.Module):
  width: int
  stride: int
  project: bool

  @nn.compact
  def __call__(self, x):
    bn = lambda: nn.BatchNorm(use_running_average=True)
    y = nn.relu(bn()(kd.linen.Conv(self.width, (1, 1), use_bias=False)(x)))
    y = nn.relu(bn()(kd.linen.Conv(self.width, (3, 3), strides=self.stride,
                                   use_bias=False)(y)))
    y = bn()(kd.linen.Conv(4 * self.width, (1, 1), use_bias=False)(y))
    if self.project:
      x = bn()(kd.linen.Conv(4 * self.width, (1, 1), strides=self.stride,
                             use_bias=False)(x))
    return nn.relu(y + x)


class ResNet50(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = kd.linen.Conv(64, (7, 7), strides=2, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
    x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
      for block in range(blocks):
        x = Bottleneck(width, 2 if block == 0 and stage > 0 else 1, block == 0)(x)
    return kd.linen.Dense(1000)(jnp.mean(x, axis=(1, 2)))


class EncoderLayer(nn.Module):
  hidden: int = 1024
  heads: int = 16
  ffn: int = 4096

  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    split = lambda z: z.reshape(b, t, self.heads, self.hidden // self.heads)
    q = split(kd.linen.Dense(self.hidden, name="query")(x))
    k = split(kd.linen.Dense(self.hidden, name="key")(x))
    v = split(kd.linen.Dense(self.hidden, name="value")(x))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]))
    a = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, self.hidden)
    x = nn.LayerNorm()(x + kd.linen.Dense(self.hidden, name="output")(a))
    h = nn.gelu(kd.linen.Dense(self.ffn, name="intermediate")(x))
    return nn.LayerNorm()(x + kd.linen.Dense(self.hidden, name="ffn_output")(h))


class BertLarge(nn.Module):
  layers: int = 24
  hidden: int = 1024
  vocab: int = 30522

  @nn.compact
  def __call__(self, tokens):
    t = tokens.shape[1]
    x = nn.Embed(self.vocab, self.hidden)(tokens)
    x = x + nn.Embed(512, self.hidden)(jnp.arange(t))[None]
    x = x + nn.Embed(2, self.hidden)(jnp.zeros_like(tokens))
    x = nn.LayerNorm()(x)
    for _ in range(self.layers):
      x = EncoderLayer(self.hidden)(x)
    pooled = jnp.tanh(kd.linen.Dense(self.hidden, name="pooler")(x[:, 0]))
    return nn.Dense(2, name="classifier")(pooled)      # untagged


def discover(name: str):
  """(layers, param paths, abstract params, batch stats or None, loss_fn, x, y)."""
  if name == "resnet50":
    model = ResNet50()
    x = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)
  else:
    model = BertLarge()
    x = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  y = jax.ShapeDtypeStruct((2,), jnp.int32)
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
  paths = tuple(registry.leaves_by_path(params))
  return found[0], paths, params


# --------------------------------------------------------------------- metrics

def metrics(lay: layout_lib.Layout, layers) -> dict:
  p, m = lay.num_devices, lay.group_size
  cost = lambda f: layout_lib.eigh_cost(f.dim, f.form)
  load = [0.0] * p
  for pl in lay.plans:
    for f in (pl.a, pl.g):
      load[f.owner] += cost(f)
  total = sum(load)
  largest = max(cost(f) for pl in lay.plans for f in (pl.a, pl.g))
  largest_layer = max(cost(pl.a) + cost(pl.g) for pl in lay.plans)
  ideal = max(total / p, largest)
  stored = sum(f.size for pl in lay.plans for f in (pl.a, pl.g))
  # the largest item that must sit whole on one device: a layer's two factors
  # with m = 1 (MEM-OPT), one factor otherwise.
  largest_tri = max((pl.a.size + pl.g.size) if m == 1 else max(pl.a.size, pl.g.size)
                    for pl in lay.plans)
  second = 0
  for pl in lay.plans:
    for f in (pl.a, pl.g):
      mat, vec = layout_lib._second_parts(f.dim, f.form, lay.method)
      second += mat + vec
  grads = sum(pl.layer.a_dim * pl.layer.g_dim for pl in lay.plans)
  largest_grad = max(pl.layer.a_dim * pl.layer.g_dim for pl in lay.plans)
  _, s = _gradient_offsets(lay)
  g = lay.num_groups
  return {
      "P": p, "m": m, "G": g, "layers": len(lay.plans), "factors": 2 * len(lay.plans),
      "sum_d3": total, "max_device_d3": max(load), "largest_d3": largest,
      "balance": max(load) / ideal,
      "layer_bound": max(total / p, largest_layer if m == 1 else largest) / ideal,
      "idle_devices": sum(1 for v in load if v == 0),
      "L": lay.segment, "sum_stored": stored, "factor_padding": p * lay.segment / stored,
      "factor_bound": max(1.0, p * largest_tri / stored),
      "L2": lay.second_segment, "sum_second": second,
      "second_padding": p * lay.second_segment / second,
      "S": s, "sum_grad": grads, "grad_padding": g * s / grads,
      "grad_bound": max(1.0, g * largest_grad / grads) if g > 1 else 1.0,
      "segment_vs_share": lay.segment / (stored / p),
      "sum_d2": sum(f.dim * f.dim for pl in lay.plans for f in (pl.a, pl.g)),
      "bytes": _bytes(lay, p, g, s, stored, second, grads,
                      sum(f.dim * f.dim for pl in lay.plans for f in (pl.a, pl.g))),
  }


def _bytes(lay, p, g, s, stored, second, grads, sum_d2) -> dict:
  """Per-device bytes (f32, ring model) of the library's collectives for this
  layout, and of tight-buffer alternatives that ignore the segment padding."""
  r = (p - 1) / p
  return {
      # factor steps
      "factor_rs_library": (p - 1) * lay.segment * 4,          # psum_scatter of [P·L]
      "factor_ar_library": 2 * r * p * lay.segment * 4,        # psum of [P·L]
      "factor_ar_kaisa_full": 2 * r * sum_d2 * 4,              # KAISA: psum of Σd²
      "factor_ar_tight_tri": 2 * r * stored * 4,               # psum of Σ triangles
      "factor_rs_ideal_tri": r * stored * 4,
      # every step, G > 1: preconditioned gradients
      "grad_ag_library": r * g * s * 4 if g > 1 else 0.0,      # all_gather of [G·S]
      "grad_psum_tight": 2 * r * grads * 4 if g > 1 else 0.0,  # masked psum of [N]
      "grad_ag_ideal": r * grads * 4 if g > 1 else 0.0,
      # inverse steps, COMM-OPT (m = P): eigenbases to everyone
      "eig_ag_library": (p - 1) * lay.second_segment * 4 if g == 1 else 0.0,
      "eig_psum_tight": 2 * r * second * 4 if g == 1 else 0.0,
      "eig_ag_ideal": r * second * 4 if g == 1 else 0.0,
  }


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

def compile_update(model: str, p: int, strategy: str) -> dict:
  layers, paths, params = discover(model)
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  m = p if strategy == "COMM-OPT" else 1
  dist = kd.Distribution(mesh, grad_worker_fraction=m / p)
  tx = kd.kfac(0.1, layers=layers, distribution=dist, factor_update_every=10,
               inverse_update_every=100)
  state = jax.eval_shape(tx.init, params)
  specs = kd.partition_specs(state)
  stats = {l.name: {"A": jax.ShapeDtypeStruct((p * l.a_dim, l.a_dim), jnp.float32),
                    "G": jax.ShapeDtypeStruct((p * l.g_dim, l.g_dim), jnp.float32)}
           for l in layers}
  stat_specs = jax.tree.map(lambda _: P("data"), stats)

  def update(grads, state, params, stats):
    return tx.update(grads, state, params, kfac_stats=stats)

  fn = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), specs, P(), stat_specs),
                             out_specs=(P(), specs)))
  t0 = time.perf_counter()
  lowered = fn.lower(params, state, params, stats)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  found, _ = C.collectives(compiled.as_text(), p)
  tot = C.totals(found)
  return {"model": model, "P": p, "strategy": strategy, "lower_s": t1 - t0,
          "compile_s": t2 - t1, "hlo_chars": len(compiled.as_text()),
          "plain_bytes": C.step_bytes(tot, "plain"),
          "factor_bytes": C.step_bytes(tot, "factor") - C.step_bytes(tot, "plain"),
          "inverse_bytes": C.step_bytes(tot, "inverse") - C.step_bytes(tot, "factor")}


def compile_in_subprocess(model, p, strategy, timeout) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={p}",
             OPENBLAS_NUM_THREADS="1")
  cmd = [sys.executable, os.path.abspath(__file__), "--_compile", f"{model},{p},{strategy}"]
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


# ---------------------------------------------------------------------- report

def fmt_row(model, name, r):
  return [model, r["P"], name, r["m"], r["G"], r["idle_devices"],
          f"{r['balance']:.3f}", f"{r['layer_bound']:.3f}",
          f"{r['factor_padding']:.3f}", f"{r['factor_bound']:.3f}",
          f"{r['grad_padding']:.3f}" if r["G"] > 1 else "— (no gather)",
          f"{r['grad_bound']:.3f}" if r["G"] > 1 else "",
          f"{r['second_padding']:.3f}",
          f"{r['L']} / {r['sum_stored'] / r['P']:.0f}"]


HEAD = ["model", "P", "layout", "m", "groups", "idle devices", "balance (d³)",
        "bound", "factor padding P·L/Σ", "bound", "grad padding G·S/Σ", "bound",
        "second-order P·L₂/Σ", "L vs Σ/P"]


def main(argv=None):
  ap = C.argument_parser(__doc__)
  ap.add_argument("--quick", action="store_true",
                  help="no subprocess compile at P=64; writes layout_balance_quick.*")
  ap.add_argument("--devices", default="8,64,256")
  ap.add_argument("--compile", default=None,
                  help="P values to compile the ResNet-50 update at (default 8,64,256; quick 8)")
  ap.add_argument("--compile-timeout", type=float, default=150.0)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--alt-layout", default=None,
                  help="a layout.py-like file whose build() is measured beside the library's")
  ap.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args._compile:
    model, p, strategy = args._compile.split(",")
    print(json.dumps(compile_update(model, int(p), strategy)), flush=True)
    return

  head = C.header()
  alt_build = load_build(args.alt_layout) if args.alt_layout else None
  if args.alt_layout:
    head["alt_layout"] = os.path.abspath(args.alt_layout)
  ps = [int(v) for v in args.devices.split(",")]
  rows = []
  models = {}
  for model in ("resnet50", "bert_large"):
    t0 = time.perf_counter()
    layers, paths, _ = discover(model)
    models[model] = {"layers": len(layers), "discover_s": time.perf_counter() - t0,
                     "dims": sorted({d for l in layers for d in (l.a_dim, l.g_dim)})}
    for p in ps:
      for name, m in (("MEM-OPT", 1), ("COMM-OPT", p)):
        t0 = time.perf_counter()
        lay = layout_lib.build(layers, paths, num_devices=p, group_size=m)
        r = metrics(lay, layers)
        r.update(model=model, layout="library LPT", strategy=name,
                 build_s=time.perf_counter() - t0)
        rows.append(r)
        if alt_build is not None:
          t0 = time.perf_counter()
          lay = alt_build(layers, paths, num_devices=p, group_size=m)
          r = metrics(lay, layers)
          r.update(model=model, layout="alternative", strategy=name,
                   build_s=time.perf_counter() - t0)
          rows.append(r)
        lib = [x for x in rows if x["layout"] == "library LPT"][-1]
        print(f"  {model} P={p} {name}: balance {lib['balance']:.3f} factor pad "
              f"{lib['factor_padding']:.3f} grad pad {lib['grad_padding']:.3f} "
              f"(build {lib['build_s']:.2f} s)"
              + (f"; alternative {r['balance']:.3f} / {r['factor_padding']:.3f} / "
                 f"{r['grad_padding']:.3f}" if alt_build is not None else ""), flush=True)

  compiles = []
  cps = [int(v) for v in (args.compile if args.compile is not None
                          else ("8" if args.quick else "8,64,256")).split(",") if v]
  for p in cps:
    for strategy in ("MEM-OPT", "COMM-OPT"):
      if p <= jax.device_count():
        try:
          res = compile_update("resnet50", p, strategy)
        except Exception as e:  # pylint: disable=broad-except
          res = {"model": "resnet50", "P": p, "strategy": strategy,
                 "error": f"{type(e).__name__}: {str(e)[:300]}"}
      else:
        res = compile_in_subprocess("resnet50", p, strategy, args.compile_timeout)
      compiles.append(res)
      print("  compile", res, flush=True)

  targets = []
  for r in rows:
    if r["P"] in (8, 64) and r["layout"] == "library LPT":
      holds_b = r["balance"] <= 1.25
      pads = [r["factor_padding"]] + ([r["grad_padding"]] if r["G"] > 1 else [])
      holds_p = max(pads) <= 1.10
      floors = [r["factor_bound"]] + ([r["grad_bound"]] if r["G"] > 1 else [])
      targets.append([r["model"], r["P"], r["strategy"], f"{r['balance']:.3f}",
                      "yes" if holds_b else "**no**",
                      " / ".join(f"{v:.3f}" for v in pads), "yes" if holds_p else "**no**",
                      " / ".join(f"{v:.3f}" for v in floors),
                      "; ".join(f"{what}: {'inherent' if floor > 1.10 else 'assignment'}"
                                for what, v, floor in zip(("factor", "grad"), pads, floors)
                                if v > 1.10)])

  out = ["# K-FAC layout: load balance and padding (ResNet-50, BERT-Large)", "",
         C.header_md(head),
         "- layer shapes from kd.linen models, discovered shapes-only (jax.eval_shape); "
         "`kfac_jax_dist.layout.build(layers, paths, num_devices=P, group_size=m)`, "
         "method eigen, packed (symmetric) factors, no max_factor_dim.",
         "- ResNet-50: bottleneck v1.5, no conv bias, BatchNorm untagged, FC 2048→1000 "
         f"with bias ({models['resnet50']['layers']} layers). BERT-Large: 24 × (Q, K, V, O "
         "1024→1024, FFN 1024→4096→1024, all with bias) + pooler 1024→1024 "
         f"({models['bert_large']['layers']} layers); embeddings, LayerNorms and the "
         "2-way classifier untagged (passed through), no vocabulary decoder; every factor "
         "full (largest 4097).",
         "- balance = max device Σd³ / max(Σd³/P, largest d³); its bound = the same with "
         "a layer's two factors in one group (MEM-OPT), the best any assignment can do. "
         "factor padding = P·L / Σ stored numbers (reduce-scatter bytes and factor "
         "memory over the useful ones); grad padding = G·S / Σ layer gradients (MEM-OPT's "
         "every-step all-gather); bound = P·(largest triangle, or largest layer's two "
         "triangles for MEM-OPT)/Σ and G·(largest layer)/Σ, the floor of any "
         "one-owner-per-factor/layer layout. second-order = "
         "P·L₂ / Σ(d²+d).",
         (f"- alternative = `build` of {args.alt_layout} (not the library)."
          if args.alt_layout else "- library layout only (see --alt-layout)."),
         "- Generated by `python benchmarks/layout_balance.py`.", ""]
  out.append("## Balance and padding")
  out.append("")
  table = [fmt_row(r["model"], f"{r['strategy']} {r['layout']}", r) for r in rows]
  out.append(C.md_table(table, HEAD))
  out.append("")
  out.append("## Targets (library LPT, P = 8 and 64): balance <= 1.25, padding <= 1.10")
  out.append("")
  out.append(C.md_table(targets, ["model", "P", "strategy", "balance", "holds",
                                  "padding (factor / grad)", "holds",
                                  "floor of any one-owner layout", "miss due to"]))
  out.append("")
  out.append("## Bytes per device of the padded collectives vs tight-buffer alternatives "
             "(library LPT layouts)")
  out.append("")
  out.append("Ring model, f32, from the layout (the compiled HLO gives the same numbers, "
             "see the compile table). factor step: the library's reduce-scatter of [P·L] "
             "((P-1)·L) and all-reduce of [P·L]; KAISA's all-reduce of the full factors "
             "2(P-1)/P·Σd²; an all-reduce of a tight buffer of triangles 2(P-1)/P·Σtri "
             "(each owner then slices its own); the padding-free reduce-scatter (P-1)/P·Σtri. "
             "MEM-OPT every step: all-gather of [G·S] vs a masked psum of a tight [N] "
             "(each device writes its own layers, zeros elsewhere) vs (P-1)/P·N. COMM-OPT "
             "inverse step: all-gather of [P·L₂] vs a masked psum of tight Σ(d²+d).")
  out.append("")
  btab = []
  for r in rows:
    if r["layout"] != "library LPT":
      continue
    b = r["bytes"]
    fb = C.fmt_bytes
    best_factor = min(b["factor_rs_library"], b["factor_ar_tight_tri"])
    btab.append([
        r["model"], r["P"], r["strategy"],
        fb(b["factor_rs_library"]), fb(b["factor_ar_library"]), fb(b["factor_ar_kaisa_full"]),
        fb(b["factor_ar_tight_tri"]), fb(b["factor_rs_ideal_tri"]),
        f"{b['factor_rs_library'] / b['factor_ar_kaisa_full']:.2f}",
        f"{best_factor / b['factor_ar_kaisa_full']:.2f}",
        (f"{fb(b['grad_ag_library'])} / {fb(b['grad_psum_tight'])} / {fb(b['grad_ag_ideal'])}"
         if r["G"] > 1 else "—"),
        (f"{fb(b['eig_ag_library'])} / {fb(b['eig_psum_tight'])} / {fb(b['eig_ag_ideal'])}"
         if r["G"] == 1 else "—")])
  out.append(C.md_table(btab, [
      "model", "P", "strategy", "factor RS [P·L]", "factor AR [P·L]", "KAISA AR Σd²",
      "tight AR Σtri", "ideal RS Σtri", "RS / KAISA", "min(RS, tight AR) / KAISA",
      "grad: AG [G·S] / psum [N] / ideal", "eigen: AG [P·L₂] / psum / ideal"]))
  out.append("")
  out.append("## Compile time of the ResNet-50 K-FAC update (shard_map'd tx.update)")
  out.append("")
  ctab = []
  for c in compiles:
    if "error" in c:
      ctab.append([c["P"], c["strategy"], "", "", c["error"], "", "", ""])
    else:
      ctab.append([c["P"], c["strategy"], f"{c['lower_s']:.1f}", f"{c['compile_s']:.1f}",
                   "", C.fmt_bytes(c["plain_bytes"]), C.fmt_bytes(c["factor_bytes"]),
                   C.fmt_bytes(c["inverse_bytes"])])
  out.append(C.md_table(ctab, ["P", "strategy", "trace+lower s", "XLA compile s", "note",
                               "update's plain-step bytes", "factor-step extra",
                               "inverse-step extra"]))
  out.append("")
  out.append("(bytes: ring model per device, of the collectives inside tx.update only — the "
             "gradient all-reduce of the training step is outside it.)")
  text = "\n".join(out)
  print(text)
  os.makedirs(args.out, exist_ok=True)
  stem = "layout_balance_quick" if args.quick else "layout_balance"
  if args.alt_layout:
    stem += "_alt"
  with open(os.path.join(args.out, stem + ".md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(args.out, stem + ".json"), "w") as f:
    json.dump({"header": head, "models": models, "rows": rows, "compiles": compiles},
              f, indent=1, default=str)


if __name__ == "__main__":
  main()
