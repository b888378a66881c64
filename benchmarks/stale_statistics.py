"""Stale statistics (SP-NGD §4.3): factor traffic and decompositions saved on a Transformer.

Trains a small character-level Transformer language model with K-FAC
(`kd.kfac`, method eigen, factors and eigenbases every step) for N steps, once
with `stale_threshold=α` (SP-NGD's α = 0.1: each factor is refreshed at its own
adaptive interval, Algorithms 1-2, see `kfac_jax_dist/stale.py`) and once
without, from the same initial parameters on the same batches. This is done
for each `factor_decay` in `--decays`: 0.95 (the library's default running
average) and 0 (SP-NGD, whose refreshed statistic is the mini-batch estimate
itself, with no running average).

Model (`CharLM`): `kd.linen.Embed` for characters and for positions, 2
pre-LN blocks (`kd.linen.LayerNorm`; causal attention with `kd.linen.
DenseGeneral` q/k/v projections [d] → [heads, d/heads] and output projection
[heads, d/heads] → [d]; MLP `kd.linen.Dense` d → 4d → d with GELU), a final
LayerNorm and a `kd.linen.Dense` d → vocabulary head. d = 64, 4 heads,
context 64, batch 32 sequences (2048 tokens) per step. Every parameter is
covered by a factor (`kd.describe`): 20 tagged layers, 35 factors (Embed: A
diagonal (token counts) + G; LayerNorm: SP-NGD's unit-wise 2x2 Fisher F;
dense layers: A and G, tokens as examples).

Data: the source code of a few Python standard-library modules, read from the
files `inspect.getsourcefile` names (training text: argparse, textwrap,
difflib, string; held-out text: pprint), non-ASCII characters replaced by
'?'; the vocabulary is the sorted set of characters of both texts. Batches are
windows of 65 characters at positions drawn with numpy's default_rng(seed),
identical for every run. The held-out loss is the mean over 8 fixed windows
batches (256 sequences).

Reported, from the state's `refresh.refreshes` (the refreshes of every factor,
in the order of `kfac_jax_dist.kfac.stale.factor_order(layout)`):

* refreshes per factor (layer, factor, form, dimension, stored numbers);
* total refreshes against N·#factors;
* factor bytes communicated, relative to refreshing every factor every step:
  with stale statistics each refreshed factor travels in its own all-reduce
  of its stored numbers (packed upper triangle of a full factor, the
  diagonal of a diagonal one, 3 numbers per channel of a unit-wise one),
  2(P−1)/P·size·4 bytes per device per refresh, so the fraction
  Σ_f refreshes_f·size_f / (N·Σ_f size_f) does not depend on P; absolute
  bytes per device are given at P = 8, against the same per-factor
  all-reduce every step and against the non-stale default (one fused
  reduce-scatter of all factors, (P−1)/P·Σ size·4 per step);
* eigendecompositions skipped (full factors; diagonal factors need none, and
  unit-wise blocks are solved in closed form), in count and in Σd³; with
  `--method inverse` (SP-NGD's π-damped inverses; results in
  stale_statistics_inverse.*) Cholesky inverses, a layer's two factors both
  inverted whenever either refreshes (π couples them);
* training loss (mean over the batch of each step) and held-out loss of both
  runs, final values and a PNG plot (stale_statistics.png);
* step time on this CPU (one device): the runs advance in lockstep (step i of
  every run, then step i+1), each step timed with `jax.block_until_ready`;
  the ratio is Σ stale step times / Σ plain step times after compilation.
  Also a few interleaved rounds from fixed states: a plain step, a stale step
  with every factor due, one with none due (the refresh schedule of the final
  stale state set to "all due" / "none due").

`--devices 8` (default; 0 turns it off) then reruns the first `--device-steps`
steps of the stale run (factor_decay = the first of `--decays`) in a child
process with XLA_FLAGS=--xla_force_host_platform_device_count=8 under
`shard_map` (MEM-OPT, grad_worker_fraction 1/8, global batch as above split
over the 8 devices), checks that its refresh decisions equal the single-device
ones, and reads the collectives of the compiled HLO with `_common.collectives`:
every factor's all-reduce must sit in the body of a loop over the due blocks
of its layer (in the `kfac_factor_update` scope; an unstacked layer's loop runs
once or not at all), so a stale factor sends nothing; the
per-step bytes per device follow from the factors refreshed at each step.

SP-NGD (Osawa et al. 2020, Table II; /work/shared/reference/seeds-ueno-spngd.md
§II.2) reports the communication of statistics reduced to 23.6 / 15.1 / 5.4 /
7.8 % of the original at batch sizes 4K / 8K / 16K / 32K (ResNet-50, ImageNet).

Usage: OPENBLAS_NUM_THREADS=1 python benchmarks/stale_statistics.py [--quick]
       [--steps 300] [--alpha 0.1] [--decays 0.95,0] [--lr 0.05] [--damping 1e-2]
       [--seed 0] [--rounds 3] [--reps 4] [--devices 8] [--device-steps 8]
       [--out benchmarks/results]
Writes stale_statistics.md, .json and .png (stale_statistics_quick.* with --quick:
16 steps, decay 0.95 only, no device check, one round of fixed-state steps).
"""

from __future__ import annotations

import os
import sys

if "--child" in sys.argv:          # the 8-device run: before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={sys.argv[sys.argv.index('--child') + 1]}")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import dataclasses
import hashlib
import json
import platform
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _models  # noqa: E402

import kfac_jax_dist as kd  # noqa: E402

TRAIN_MODULES = ("argparse", "textwrap", "difflib", "string")
HELDOUT_MODULES = ("pprint",)
D_MODEL, HEADS, MLP, BLOCKS, CONTEXT, BATCH = 64, 4, 256, 2, 64, 32
EVAL_BATCHES = 8
SPNGD = {"4K": 23.6, "8K": 15.1, "16K": 5.4, "32K": 7.8}   # % of the statistics' traffic


# ------------------------------------------------------------------------ data

def corpus():
  """(train ids, held-out ids, vocabulary, description) from stdlib sources."""
  train, held = C.source_corpus(TRAIN_MODULES), C.source_corpus(HELDOUT_MODULES)
  vocab = sorted(set(train) | set(held))
  digest = hashlib.sha256((train + "\0" + held).encode()).hexdigest()[:12]
  desc = dict(python=platform.python_version(), train_modules=TRAIN_MODULES,
              heldout_modules=HELDOUT_MODULES, train_chars=len(train),
              heldout_chars=len(held), vocab_size=len(vocab), sha256_12=digest)
  return C.encode(train, vocab), C.encode(held, vocab), vocab, desc


def batches(ids, n, batch, seed):
  """[n, batch, CONTEXT + 1] windows at positions from default_rng(seed)."""
  return C.windows(ids, n, batch, CONTEXT + 1, np.random.default_rng(seed))


# ----------------------------------------------------------------------- model

MODEL_DESCRIPTION = (
    f"CharLM: Embed(vocab, {D_MODEL}) + Embed({CONTEXT}, {D_MODEL}) positions; {BLOCKS} "
    f"pre-LN blocks [LayerNorm; causal attention, {HEADS} heads, DenseGeneral q/k/v "
    f"{D_MODEL}→({HEADS},{D_MODEL // HEADS}) and o ({HEADS},{D_MODEL // HEADS})→{D_MODEL}; "
    f"LayerNorm; Dense {D_MODEL}→{MLP}, GELU, Dense {MLP}→{D_MODEL}]; LayerNorm; Dense "
    f"{D_MODEL}→vocab. Context {CONTEXT}, batch {BATCH} sequences = {BATCH * CONTEXT} "
    "tokens per step")


def problem(vocab_size):
  model = _models.CharLM(vocab_size, width=D_MODEL, blocks=BLOCKS, heads=HEADS,
                         context=CONTEXT)
  params = model.init(jax.random.key(0), jnp.zeros((BATCH, CONTEXT), jnp.int32))

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)
  return model, params, loss_fn


def make_tx(layers, args, decay, alpha, distribution=None):
  return kd.kfac(args.lr, layers=layers, damping=args.damping, factor_decay=decay,
                 factor_update_every=1, inverse_update_every=1, stale_threshold=alpha,
                 method=args.method, distribution=distribution)


def make_step(grad_fn, tx):
  """step(params, state, tokens [batch, CONTEXT + 1]): next-character loss."""
  step = C.kfac_step(grad_fn, tx)
  return lambda params, state, tokens: step(params, state, tokens[:, :-1], tokens[:, 1:])


def with_schedule(opt_state, due: bool):
  """The optax state with every factor's next refresh now (due) or never."""
  def fix(s):
    if not isinstance(s, kd.ScaleByKfacState) or s.refresh is None:
      return s
    nxt = jnp.full_like(s.refresh.next_step, 0 if due else 2 ** 30)
    return dataclasses.replace(s, update_factors=jnp.asarray(due),
                               refresh=dataclasses.replace(s.refresh, next_step=nxt))
  return jax.tree_util.tree_map(fix, opt_state,
                                is_leaf=lambda x: isinstance(x, kd.ScaleByKfacState))


# ---------------------------------------------------------------- the factors

def factor_table(lay):
  """One row per factor in `factor_order`: layer, which, form, dim, size, d³."""
  rows = []
  for plan, which, place in C.stale_lib.factor_order(lay):
    rows.append(dict(layer=plan.layer.name.removeprefix("params/"), factor=which,
                     form=place.form, dim=place.dim, size=place.size,
                     eigh=place.form == C.factors_lib.FULL))
  return rows


def decompositions(table, history, method):
  """Each factor's decompositions over the run, from `history` (the cumulative
  refreshes after each step): its refreshes with eigendecompositions; with
  π-damped inverses the steps at which either factor of its layer refreshed
  (both are inverted again, `stale_update.with_layer_partners`)."""
  due = np.diff(np.asarray([[0] * len(table)] + list(history)), axis=0) > 0   # [N, F]
  if method == "eigen":
    return due.sum(0)
  layer = np.array([r["layer"] for r in table])
  return np.array([due[:, layer == name].any(axis=1).sum() for name in layer])


def savings(table, refreshes, n, decomposed, p=8):
  """Bytes and decompositions (`decomposed`: per factor) of a stale run
  against refreshing everything."""
  size = np.array([r["size"] for r in table], float)
  ref = np.asarray(refreshes, float)
  done = np.asarray(decomposed, float)
  full = np.array([r["eigh"] for r in table])
  cube = np.array([r["dim"] ** 3 for r in table], float) * full
  ar = 2 * (p - 1) / p * 4                 # bytes per device per stored number, all-reduce
  rs = (p - 1) / p * 4                     # ... reduce-scatter
  return dict(
      steps=n, factors=len(table), refreshes=int(ref.sum()), possible=n * len(table),
      refresh_fraction=float(ref.sum() / (n * len(table))),
      bytes_fraction=float((ref * size).sum() / (n * size.sum())),
      stored_numbers=int(size.sum()),
      p=p, bytes_stale=float(ar * (ref * size).sum()),
      bytes_every_step_ar=float(ar * n * size.sum()),
      bytes_every_step_rs=float(rs * n * size.sum()),
      eigh_factors=int(full.sum()), eigh_done=int((done * full).sum()),
      eigh_possible=int(n * full.sum()), eigh_skipped=int(((n - done) * full).sum()),
      eigh_cube_fraction=float((done * cube).sum() / (n * cube.sum())))


# ------------------------------------------------------------------- training

def relative_change_fn(lay):
  """jit((old flat factors, new) → ‖X − X₋₁‖_F / ‖X₋₁‖_F of every factor, in
  `factor_order`), the measure of SP-NGD's similarity test."""
  order = C.stale_lib.factor_order(lay)

  def fn(old, new):
    out = []
    for _, _, place in order:
      span = slice(lay.factor_start(place), lay.factor_start(place) + place.size)
      out.append(C.stale_lib.relative_change(new[span].astype(jnp.float32),
                                           old[span].astype(jnp.float32), place, lay.packed))
    return jnp.stack(out)
  return jax.jit(fn)


def train_lockstep(runs, params, data, held_batches, eval_fn, eval_every):
  """Steps every run once per step index; per-step wall and CPU seconds. For
  the plain runs also the step-to-step relative change of every factor."""
  for r in runs:
    r.update(params=params, state=r["tx"].init(params), loss=[], wall=[], cpu=[],
             refreshes=[], eval=[], change=[])
    r["change_fn"] = (relative_change_fn(C.kfac_state(r["state"]).layout) if r["kind"] == "plain"
                      else None)
  for i in range(len(data)):
    for r in runs:
      old = r["state"]
      t, c = time.perf_counter(), time.process_time()
      r["params"], r["state"], loss = r["step"](r["params"], r["state"], data[i])
      jax.block_until_ready((r["params"], r["state"], loss))
      r["wall"].append(time.perf_counter() - t)
      r["cpu"].append(time.process_time() - c)
      r["loss"].append(float(loss))
      ks = C.kfac_state(r["state"])
      if ks.refresh is not None:
        r["refreshes"].append(np.asarray(ks.refresh.refreshes).tolist())
      if r["change_fn"] is not None and i > 0:     # step 1 starts from identities
        r["change"].append(np.asarray(r["change_fn"](C.kfac_state(old).factors,
                                                     ks.factors)).tolist())
      if (i + 1) % eval_every == 0 or i + 1 == len(data) or i == 0:
        r["eval"].append((i + 1, float(np.mean([eval_fn(r["params"], b)
                                                for b in held_batches]))))
    if i == 0 or (i + 1) % 50 == 0:
      print(f"  step {i + 1}: " + ", ".join(
          f"{r['name']} loss {r['loss'][-1]:.3f} ({1e3 * r['wall'][-1]:.0f} ms)"
          for r in runs), flush=True)


def fixed_rounds(cases, rounds, reps):
  """{name: [per-round seconds per step]} of fixed-state steps, interleaved."""
  out = {name: [] for name in cases}
  for fn, args in cases.values():            # warm-up (compiled already)
    jax.block_until_ready(fn(*args))
  for _ in range(rounds):
    for name, (fn, args) in cases.items():
      t = time.perf_counter()
      for _ in range(reps):
        jax.block_until_ready(fn(*args))
      out[name].append((time.perf_counter() - t) / reps)
  return out


# ---------------------------------------------------------- the 8-device run

def child(args):
  """Runs the stale step under shard_map on P host devices; writes a JSON."""
  p, out_path = args.child, args.child_out
  decay = float(args.decays.split(",")[0])
  train_ids, _, vocab, _ = corpus()
  data = batches(train_ids, args.steps, BATCH, args.seed)[:args.device_steps]
  _, params, loss_fn = problem(len(vocab))
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, data[0, :, :-1], data[0, :, 1:])
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=1 / p)
  tx = make_tx(layers, args, decay, args.alpha, dist)
  fn, state = C.sharded_step(loss_fn, params, data[0, :, :-1], data[0, :, 1:], tx,
                             grad_fn, mesh, "none")
  t0 = time.perf_counter()
  compiled = fn.lower(params, state, data[0, :, :-1], data[0, :, 1:]).compile()
  compile_s = time.perf_counter() - t0
  hlo = compiled.as_text()
  lay = C.kfac_state(state).layout
  table = factor_table(lay)
  found, notes = C.collectives(hlo, p)
  cond = factor_collectives(hlo)
  refreshes, prm = [], params
  for i in range(args.device_steps):
    prm, state = compiled(prm, state, data[i, :, :-1], data[i, :, 1:])
    refreshes.append(np.asarray(C.kfac_state(state).refresh.refreshes).tolist())
  payload = dict(
      p=p, decay=decay, steps=args.device_steps, compile_s=compile_s, table=table,
      refreshes=refreshes, notes=notes, conditionals=cond,
      collectives=[dataclasses.asdict(c) for c in found],
      strategy="MEM-OPT (grad_worker_fraction 1/P), gradients pmean'd in the step")
  with open(out_path, "w") as f:
    json.dump(payload, f, default=str)


def factor_collectives(hlo: str):
  """Every loop (`while`) and every conditional in the factor-update scope with
  the all-reduces (payload bytes) reachable from its body or each of its
  branches, and the all-reduces of that scope outside any such loop or
  conditional."""
  comps, entry = C.parse_computations(hlo)

  def instructions(comp):
    for name, rest in comps.get(comp, []):
      shape, tail = C.split_shape(rest)
      yield name, shape, tail, C.opcode(tail), C.op_name(tail)

  def callees(tail, opcode):
    return C.branch_names(tail) if opcode == "conditional" else C.called_names(tail)

  def reduces(comp):
    """Payload bytes of every all-reduce reachable from comp."""
    out = []
    for _, shape, tail, opcode, _ in instructions(comp):
      if opcode in ("all-reduce", "all-reduce-start"):
        out.append(C.shape_bytes(shape))
      for c in callees(tail, opcode):
        out += reduces(c)
    return out

  loops, conds, outside = [], [], []

  def walk(comp):
    for name, shape, tail, opcode, op in instructions(comp):
      if opcode == "while" and C.FACTOR_SCOPE in op:
        loops.append(dict(name=name, body=[b for c in C.called_names(tail)
                                           for b in reduces(c)]))
        continue
      if opcode == "conditional" and C.FACTOR_SCOPE in op:
        conds.append(dict(name=name, branches=[reduces(b) for b in C.branch_names(tail)]))
        continue
      if opcode in ("all-reduce", "all-reduce-start") and C.FACTOR_SCOPE in op:
        outside.append(dict(name=name, bytes=C.shape_bytes(shape), op_name=op))
      for c in callees(tail, opcode):
        walk(c)
  walk(entry)
  return dict(factor_scope_loops=loops, factor_scope_conditionals=conds,
              factor_scope_all_reduces_outside=outside)


def run_child(args, p):
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "child.json")
    argv = [sys.executable, os.path.abspath(__file__), "--child", str(p), "--child-out",
            out, "--decays", args.decays.split(",")[0], "--steps", str(args.steps)] + [
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in ("alpha", "lr", "damping", "seed", "device_steps", "method")]
    env = dict(os.environ)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
      print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
      return dict(error=f"child exited with {proc.returncode}", stderr=proc.stderr[-4000:])
    with open(out) as f:
      res = json.load(f)
    res["child_wall_s"] = time.perf_counter() - t0
    return res


def device_analysis(res, single_refreshes, table):
  """Refresh decisions vs one device; per-factor all-reduces in loops over
  the due blocks (one block each here: the model has no stacked layers)."""
  p = res["p"]
  sizes = [4 * r["size"] for r in table]
  loops = res["conditionals"]["factor_scope_loops"]
  conds = res["conditionals"]["factor_scope_conditionals"]
  per_factor = [c for c in loops if len(c["body"]) == 1]
  payloads = sorted(c["body"][0] for c in per_factor)
  matched = payloads == sorted(sizes)
  other_conds = conds + [dict(name=c["name"], branches=[c["body"]])
                         for c in loops if c not in per_factor]
  every = [c for c in res["collectives"] if c["step"] == "every"]
  inverse = [c for c in res["collectives"] if c["step"] == "inverse"]
  every_ring = sum(c["ring"] for c in every)
  inverse_ring = sum(c["ring"] for c in inverse)
  ar = 2 * (p - 1) / p
  steps, prev = [], [0] * len(table)
  for i, ref in enumerate(res["refreshes"]):
    due = [a - b for a, b in zip(ref, prev)]
    prev = ref
    fac = sum(ar * s for s, d in zip(sizes, due) if d)
    steps.append(dict(step=i + 1, refreshed=int(sum(due)),
                      factor_bytes=fac, total_bytes=every_ring + fac
                      + (inverse_ring if any(due) else 0.0)))
  all_fac = sum(ar * s for s in sizes)
  return dict(
      p=p, steps=res["steps"], compile_s=res["compile_s"], strategy=res["strategy"],
      refreshes_equal_single_device=res["refreshes"] == single_refreshes[:res["steps"]],
      refreshes_last=res["refreshes"][-1],
      single_device_refreshes_last=single_refreshes[res["steps"] - 1],
      factor_loops=len(loops), per_factor_all_reduce_loops=len(per_factor),
      payloads_match_factor_sizes=matched, other_factor_conditionals=other_conds,
      factor_all_reduces_outside_loops=res["conditionals"][
          "factor_scope_all_reduces_outside"],
      every_step_ring_bytes=every_ring,
      every_step=[dict(kind=c["kind"], payload=c["payload"], ring=c["ring"],
                       op=c["op_name"].split("/")[-1]) for c in every],
      inverse_ring_bytes=inverse_ring, all_factors_ring_bytes=all_fac,
      per_step=steps, notes=res["notes"])


# --------------------------------------------------------------------- report

def plot(path, results, args):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  colors = {"plain": "tab:blue", "stale": "tab:orange"}
  styles = ["-", "--", ":", "-."]
  for k, res in enumerate(results):
    for r in res["runs"]:
      loss = np.asarray(r["loss"])
      w = min(10, len(loss))
      smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
      label = f"{r['kind']}, decay {res['decay']:g}"
      axes[0].plot(np.arange(w, len(loss) + 1), smooth, styles[k % 4],
                   color=colors[r["kind"]], label=label + " (train, 10-step mean)")
      ev = np.asarray(r["eval"])
      axes[0].plot(ev[:, 0], ev[:, 1], styles[k % 4], marker="o", ms=3,
                   color=colors[r["kind"]], alpha=0.5, label=label + " (held-out)")
    st = next(r for r in res["runs"] if r["kind"] == "stale")
    ref = np.diff(np.asarray([[0] * len(res["table"])] + st["refreshes"]), axis=0)
    size = np.array([t["size"] for t in res["table"]], float)
    per_step = (ref * size).sum(1) / size.sum()
    axes[1].plot(np.arange(1, len(per_step) + 1), per_step, styles[k % 4], lw=0.8,
                 color=f"C{k + 2}", label=f"decay {res['decay']:g}")
    axes[2].plot(np.arange(1, len(per_step) + 1),
                 np.cumsum(per_step) / np.arange(1, len(per_step) + 1), styles[k % 4],
                 color=f"C{k + 2}", label=f"decay {res['decay']:g}")
  for v in SPNGD.values():
    axes[2].axhline(v / 100, color="grey", lw=0.6, ls=":")
  axes[2].text(len(per_step) * 0.55, SPNGD["4K"] / 100 + 0.01, "SP-NGD 5.4-23.6 %",
               color="grey", fontsize=8)
  axes[0].set(title="loss (nats/char)", xlabel="step", ylim=(1.0, 3.5))
  axes[1].set(title=f"factor bytes sent at each step, stale α={args.alpha:g}\n"
              "(fraction of all factors' bytes)", xlabel="step", ylim=(0, 1.05))
  axes[2].set(title="cumulative fraction of factor bytes\nvs refreshing every step",
              xlabel="step", ylim=(0, 1.05))
  axes[0].legend(fontsize=7)
  axes[1].legend(fontsize=8)
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def median_ratio(a, b):
  return statistics.median(x / y for x, y in zip(a, b))


def render(head, data_desc, results, device, args, describe_text):
  fb = C.fmt_bytes
  lines = ["# Stale statistics (SP-NGD §4.3) on a character-level Transformer", "",
           C.header_md(head) + f"; OPENBLAS_NUM_THREADS="
           f"{os.environ.get('OPENBLAS_NUM_THREADS', '')}",
           "- generated by `python benchmarks/stale_statistics.py"
           + (" --quick" if args.quick else "")
           + ("" if args.method == "eigen" else f" --method {args.method}")
           + f"` ({head['wall_s']:.0f} s); load average "
           f"(1 min) at start / end {head['load'][0]:.1f} / {head['load'][1]:.1f} on "
           f"{os.cpu_count()} cores: the machine is shared, so wall times are noisy (the runs "
           "are interleaved step by step so that both see the same load)",
           f"- model: {MODEL_DESCRIPTION}",
           f"- data: source of the Python {data_desc['python']} standard-library modules "
           f"{', '.join(data_desc['train_modules'])} ({data_desc['train_chars']:,} chars, "
           f"training) and {', '.join(data_desc['heldout_modules'])} "
           f"({data_desc['heldout_chars']:,} chars, held out), read from "
           f"`inspect.getsourcefile`, non-ASCII → '?'; vocabulary {data_desc['vocab_size']} "
           f"characters; sha256 {data_desc['sha256_12']}…; random windows, seed {args.seed}",
           f"- optimizer: `kd.kfac({args.lr:g}, damping={args.damping:g}, "
           f"factor_decay=…, factor_update_every=1, inverse_update_every=1, "
           f"method=\"{args.method}\")` ("
           f"KL clip 1e-3, momentum 0.9) with and without `stale_threshold={args.alpha:g}`; "
           f"{args.steps} steps; same initial parameters and batches", ""]
  for res in results:
    s = res["savings"]
    plain, stale = (next(r for r in res["runs"] if r["kind"] == k) for k in ("plain", "stale"))
    lines += [f"## factor_decay = {res['decay']:g}"
              + (" (library default: running average)" if res["decay"] else
                 " (SP-NGD: the refreshed factor is the mini-batch statistic)"), ""]
    lines += [
        f"- refreshes: **{s['refreshes']:,} of {s['possible']:,}** "
        f"({s['steps']} steps × {s['factors']} factors) = "
        f"**{100 * s['refresh_fraction']:.1f} %**",
        f"- factor bytes communicated: **{100 * s['bytes_fraction']:.1f} %** of refreshing "
        f"every factor every step (Σ refreshes·stored numbers / (N·Σ stored numbers); "
        f"P-independent). Per device at P = {s['p']}: {fb(s['bytes_stale'])} over the run "
        f"({fb(s['bytes_stale'] / s['steps'])}/step) in per-factor all-reduces, vs "
        f"{fb(s['bytes_every_step_ar'])} ({fb(s['bytes_every_step_ar'] / s['steps'])}/step) "
        f"for the same all-reduces every step, and {fb(s['bytes_every_step_rs'])} "
        f"({fb(s['bytes_every_step_rs'] / s['steps'])}/step) for the non-stale default, one "
        f"fused reduce-scatter of all {s['stored_numbers']:,} stored numbers per step "
        f"(ratio {s['bytes_stale'] / s['bytes_every_step_rs']:.3f})",
        f"- {KIND[args.method]}: {s['eigh_done']:,} of {s['eigh_possible']:,} done, "
        f"**{s['eigh_skipped']:,} skipped** ({100 * (1 - s['eigh_done'] / s['eigh_possible']):.1f} %"
        f" of the count); Σd³ done = **{100 * s['eigh_cube_fraction']:.1f} %** of "
        f"decomposing every full factor every step",
        f"- final loss (mean of the last 20 training steps): plain "
        f"{np.mean(plain['loss'][-20:]):.4f}, stale {np.mean(stale['loss'][-20:]):.4f}; "
        f"held-out loss at step {plain['eval'][-1][0]}: plain {plain['eval'][-1][1]:.4f}, "
        f"stale {stale['eval'][-1][1]:.4f} (step 1: {plain['eval'][0][1]:.4f})",
        f"- step time on this CPU (one device, runs in lockstep, steps 2-{args.steps}): "
        f"plain {1e3 * res['time']['plain_ms']:.1f} ms/step, stale "
        f"{1e3 * res['time']['stale_ms']:.1f} ms/step, **stale/plain = "
        f"{res['time']['ratio_wall']:.3f}** (Σ wall; CPU time {res['time']['ratio_cpu']:.3f}; "
        f"median of per-50-step-window ratios {res['time']['ratio_windows']:.3f}); compile: "
        f"plain {res['compile_s']['plain']:.0f} s, stale {res['compile_s']['stale']:.0f} s "
        f"(the due factors' {KIND[args.method]} one at a time, in a loop per batch of "
        "equal factors)", ""]
    rows = []
    for f, (t, r) in enumerate(zip(res["table"], stale["refreshes"][-1])):
      rows.append([t["layer"], t["factor"], t["form"], t["dim"], f"{t['size']:,}", r,
                   f"{100 * r / args.steps:.0f} %",
                   SOLVER[args.method] if t["eigh"] else (
                       "closed form" if t["form"] == "unit" else
                       "none (diagonal)" if args.method == "eigen" else "1/(x + δ)"),
                   res["intervals"][f],
                   f"{res['plain_change_median'][f]:.3f}",
                   f"{100 * res['plain_change_below_alpha'][f]:.0f} %"])
    lines += [f"Refreshes per factor (of {args.steps} steps) in the stale run; size = "
              "numbers stored and communicated per refresh (packed triangle d(d+1)/2, "
              "diagonal d, unit-wise 3·channels); last interval = the one in force at the "
              "end; Δ = ‖X_t − X_{t−1}‖_F / ‖X_{t−1}‖_F of the plain run's factor between "
              f"consecutive steps (steps 2-{args.steps}; with decay 0 the mini-batch "
              "statistics themselves), its median and how often it is below α:",
              "", C.md_table(rows, ["layer", "factor", "form", "dim", "size", "refreshes",
                                    "of steps", "decomposition", "last interval",
                                    "plain: median Δ", f"plain: Δ < {args.alpha:g}"]), ""]
  if results:
    tf = results[0]["fixed"]
    rows = [[k, f"{1e3 * statistics.median(v):.1f}", f"{1e3 * min(v):.1f}-{1e3 * max(v):.1f}",
             f"{median_ratio(v, tf['plain step']):.2f}"] for k, v in tf.items()]
    lines += [f"## Fixed-state steps (factor_decay {results[0]['decay']:g}; {args.rounds} "
              f"interleaved rounds × {args.reps} steps from the final states)", "",
              C.md_table(rows, ["step", "ms (median)", "min-max", "× plain step"]), "",
              "A stale step with every factor due is the same work as a plain step, done "
              f"factor by factor (a loop over each batch's due factors, one "
              f"{SOLVER[args.method]} each, instead of batched ones); with none due the "
              "statistics are not even computed "
              "(`update_factors` is False): what remains is forward/backward and "
              "preconditioning. These few fixed-state timings are the noisiest numbers "
              "here: on the shared machine the 'every factor due' ratio has come out "
              "anywhere between ~0.8 and ~1.25 from one run of the script to the next; the "
              "lockstep ratio over the whole run above is the one to quote.", ""]
  if device:
    lines += device_md(device, results)
  lines += comparison_md(results)
  lines += ["## Coverage (`kd.describe` of the stale state)", "", "```", describe_text, "```",
            ""]
  return "\n".join(lines)


def device_md(dv, results):
  if "error" in dv:
    return [f"## {dv.get('p', 8)}-device check", "", f"Failed: {dv['error']}", "",
            "```", dv.get("stderr", ""), "```", ""]
  fb = C.fmt_bytes
  lines = [f"## {dv['p']}-device check (shard_map on host CPU devices)", "",
           f"- {dv['strategy']}; factor_decay {results[0]['decay']:g}, α as above; first "
           f"{dv['steps']} steps on the same batches (split over the devices); compile "
           f"{dv['compile_s']:.0f} s",
           f"- refresh decisions equal the single-device run's at every step: "
           f"**{'yes' if dv['refreshes_equal_single_device'] else 'NO'}** "
           f"(refreshes after {dv['steps']} steps: {dv['refreshes_last']}"
           + ("" if dv["refreshes_equal_single_device"] else
              f"; one device: {dv['single_device_refreshes_last']}") + ")",
           f"- compiled HLO: {dv['factor_loops']} loops in the `kfac_factor_update` "
           f"scope, {dv['per_factor_all_reduce_loops']} of them with exactly one all-reduce "
           "in their body (a loop over a layer's due blocks: here one block each, run once "
           "when the factor is due, not at all otherwise); their payloads equal the 4·size "
           "of the factors one to one: "
           f"**{'yes' if dv['payloads_match_factor_sizes'] else 'NO'}**; all-reduces of that "
           "scope outside any loop or conditional: "
           + (", ".join(f"{o['bytes']} B ({o['op_name'].split('/')[-1]})"
                        for o in dv["factor_all_reduces_outside_loops"]) or "none")
           + " (the refresh decisions, one int32 pair per factor, psum'd every step); "
           f"other conditionals of that scope: {len(dv['other_factor_conditionals'])}, with "
           f"{sum(len(b) for c in dv['other_factor_conditionals'] for b in c['branches'])} "
           "all-reduces (the per-device `lax.switch`es of the owners' copies and updates, "
           "the statistics' verdict)",
           f"- every-step collectives: {fb(dv['every_step_ring_bytes'])} per device ("
           + ", ".join(f"{c['kind']} {fb(c['payload'])} ({c['op']})" for c in dv["every_step"])
           + f"); decomposition-scope collectives (steps with a refresh): "
           f"{fb(dv['inverse_ring_bytes'])}; all factors' all-reduces together: "
           f"{fb(dv['all_factors_ring_bytes'])}",
           ""]
  rows = [[s["step"], s["refreshed"], fb(s["factor_bytes"]),
           f"{100 * s['factor_bytes'] / dv['all_factors_ring_bytes']:.0f} %",
           fb(s["total_bytes"])] for s in dv["per_step"]]
  lines += ["Per-step bytes per device (ring model) from the HLO and the factors refreshed:",
            "", C.md_table(rows, ["step", "factors refreshed", "factor bytes",
                                  "of all factors", "all collectives"]), ""]
  if dv["notes"]:
    lines += ["Parser notes: " + "; ".join(dv["notes"]), ""]
  return lines


def comparison_md(results):
  lines = ["## Against SP-NGD's reported reduction", "",
           "SP-NGD (Osawa et al. 2020, Table II, ResNet-50/ImageNet, α = 0.1) reports the "
           "communication of statistics with stale statistics at "
           + ", ".join(f"{v} % (BS {k})" for k, v in SPNGD.items())
           + " of the original, smaller at larger batches (the statistics fluctuate less).",
           ""]
  for res in results:
    s = res["savings"]
    lines.append(f"- factor_decay {res['decay']:g}: {100 * s['bytes_fraction']:.1f} % of the "
                 f"factor bytes, {100 * s['refresh_fraction']:.1f} % of the refreshes, "
                 f"{100 * s['eigh_cube_fraction']:.1f} % of the Σd³ of the decompositions.")
  lines += [
      "",
      "Reading: SP-NGD's test compares successive *mini-batch statistics* (it keeps no "
      "running average), at 4K-32K images per batch. With factor_decay 0 (the same test "
      "here) the Δ column shows how far this 2,048-token batch's statistics move from one "
      "step to the next: most factors move by more than α = 0.1 at most steps, so they are "
      "refreshed (nearly) every step, and only a few factors with small Δ (a constant "
      "diagonal such as the position embedding's A, the first block's q/k/v input "
      "covariance) get longer intervals. With the library's default running average "
      "(decay 0.95) a refresh moves the running factor by the fraction "
      "0.05/(1 − 0.95^k) of the statistic's deviation from it (k = refreshes so far: "
      "1/k at first, 5 % after ~20), so after the first ~20 refreshes nearly every "
      "refresh counts as similar and the intervals grow Fibonacci-like (1, 1, 2, 3, 5, "
      "…, 144). The saving is then of the order SP-NGD reports, but it reflects the "
      "smoothing of the average as much as the stability of the statistics, and because "
      "stale steps contribute nothing, a factor's average then spans ~20 refreshes, i.e. "
      "hundreds of steps. The cost shows in the loss lines above (training loss, "
      "held-out loss) and in the plot.",
      "",
      "Collective choice: with stale statistics each refreshed factor travels in its own "
      "all-reduce (2(P−1)/P per number) because a fused reduce-scatter cannot leave stale "
      "factors out, while the non-stale default reduce-scatters all factors at (P−1)/P "
      "per number. Stale statistics therefore send fewer bytes than the default only "
      "when under half of the factor bytes are refreshed: "
      + "; ".join(f"decay {res['decay']:g}: {res['savings']['bytes_stale'] / res['savings']['bytes_every_step_rs']:.2f}× "
                  "the reduce-scatter default's factor bytes" for res in results) + ".",
      ""]
  return lines


# ------------------------------------------------------------------------ main

FULL = dict(steps=300, decays="0.95,0", devices=8, rounds=3, reps=4)
QUICK = dict(steps=16, decays="0.95", devices=0, rounds=1, reps=2)
# The decompositions of each method, what solves a full factor, the results' stem.
KIND = {"eigen": "eigendecompositions", "inverse": "π-damped inverses (Cholesky)"}
SOLVER = {"eigen": "eigh", "inverse": "Cholesky"}
STEMS = {"eigen": "stale_statistics", "inverse": "stale_statistics_inverse"}


def parser():
  ap = C.argument_parser(__doc__)
  C.add_quick(ap, "stale_statistics", QUICK)
  ap.add_argument("--steps", type=int, default=None, help="default 300")
  ap.add_argument("--alpha", type=float, default=0.1)
  ap.add_argument("--method", choices=tuple(KIND), default="eigen",
                  help="inverse: SP-NGD's π-damped inverses (results in "
                       "stale_statistics_inverse.*)")
  ap.add_argument("--decays", default=None, help="factor_decay values (default 0.95,0)")
  ap.add_argument("--lr", type=float, default=0.05)
  ap.add_argument("--damping", type=float, default=1e-2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--eval-every", type=int, default=25)
  ap.add_argument("--rounds", type=int, default=None, help="default 3")
  ap.add_argument("--reps", type=int, default=None, help="default 4")
  ap.add_argument("--devices", type=int, default=None, help="8 (default), 0: no check")
  ap.add_argument("--device-steps", type=int, default=8)
  ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
  return ap


def main():
  t_start = time.perf_counter()
  args = parser().parse_args()
  C.fill_defaults(args, QUICK, FULL)
  head = C.environment()
  load0 = os.getloadavg()[0]
  print(f"jax {head['jax']}, {head['machine']}, load {load0:.1f}", flush=True)
  train_ids, held_ids, vocab, data_desc = corpus()
  data = jnp.asarray(batches(train_ids, args.steps, BATCH, args.seed))
  held = [jnp.asarray(b) for b in batches(held_ids, EVAL_BATCHES, BATCH, args.seed + 1)]
  model, params, loss_fn = problem(len(vocab))
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, data[0, :, :-1], data[0, :, 1:])
  eval_fn = jax.jit(lambda p, b: loss_fn(p, b[:, :-1], b[:, 1:]))

  runs = []
  for decay in (float(d) for d in args.decays.split(",")):
    for kind, alpha in (("plain", None), ("stale", args.alpha)):
      tx = make_tx(layers, args, decay, alpha)
      runs.append(dict(name=f"{kind}/{decay:g}", kind=kind, decay=decay, tx=tx,
                       step=jax.jit(make_step(grad_fn, tx))))
  compile_s = {}
  for r in runs:                     # compile outside the timed loop
    t = time.perf_counter()
    r["step"] = r["step"].lower(params, r["tx"].init(params), data[0]).compile()
    compile_s[r["name"]] = time.perf_counter() - t
    print(f"  compiled {r['name']} in {compile_s[r['name']]:.1f} s", flush=True)
  train_lockstep(runs, params, data, held, eval_fn, args.eval_every)

  results, describe_text = [], ""
  for decay in (float(d) for d in args.decays.split(",")):
    pair = [r for r in runs if r["decay"] == decay]
    plain, stale = pair
    ks = C.kfac_state(stale["state"])
    describe_text = describe_text or kd.describe(ks)
    table = factor_table(ks.layout)
    assert [(t["layer"], t["factor"]) for t in table] == [
        (t["layer"], t["factor"]) for t in factor_table(C.kfac_state(plain["state"]).layout)]
    sv = savings(table, stale["refreshes"][-1], args.steps,
                 decompositions(table, stale["refreshes"], args.method))
    w_p, w_s = np.asarray(plain["wall"][1:]), np.asarray(stale["wall"][1:])
    c_p, c_s = np.asarray(plain["cpu"][1:]), np.asarray(stale["cpu"][1:])
    win = 50
    windows = [w_s[i:i + win].sum() / w_p[i:i + win].sum()
               for i in range(0, len(w_p) - win + 1, win)] or [w_s.sum() / w_p.sum()]
    timing = dict(plain_ms=float(w_p.mean()), stale_ms=float(w_s.mean()),
                  ratio_wall=float(w_s.sum() / w_p.sum()),
                  ratio_cpu=float(c_s.sum() / c_p.sum()),
                  ratio_windows=float(statistics.median(windows)), windows=windows)
    fixed = None
    if decay == float(args.decays.split(",")[0]):
      st = stale["state"]
      cases = {"plain step": (plain["step"], (plain["params"], plain["state"], data[-1])),
               "stale, every factor due": (stale["step"], (stale["params"],
                                                          with_schedule(st, True), data[-1])),
               "stale, none due": (stale["step"], (stale["params"], with_schedule(st, False),
                                                   data[-1])),
               "stale, final state's schedule": (stale["step"], (stale["params"], st,
                                                                 data[-1]))}
      fixed = fixed_rounds(cases, args.rounds, args.reps)
    change = np.asarray(plain["change"])            # [steps − 1, factors]
    results.append(dict(
        decay=decay, table=table, savings=sv, time=timing, fixed=fixed,
        intervals=np.asarray(ks.refresh.interval).tolist(),
        compile_s={r["kind"]: compile_s[r["name"]] for r in pair},
        plain_change_median=np.median(change, 0).tolist(),
        plain_change_below_alpha=(change < args.alpha).mean(0).tolist(),
        runs=[dict(kind=r["kind"], loss=[round(v, 5) for v in r["loss"]], eval=r["eval"],
                   wall_ms=[round(1e3 * v, 2) for v in r["wall"]],
                   cpu_ms=[round(1e3 * v, 2) for v in r["cpu"]],
                   refreshes=r["refreshes"]) for r in pair]))
    print(f"decay {decay:g}: bytes {100 * sv['bytes_fraction']:.1f} %, refreshes "
          f"{100 * sv['refresh_fraction']:.1f} %, Σd³ {100 * sv['eigh_cube_fraction']:.1f} %, "
          f"time ratio {timing['ratio_wall']:.3f}", flush=True)

  device = None
  if args.devices:
    print(f"  {args.devices}-device check (child process) ...", flush=True)
    device = run_child(args, args.devices)
    if "error" not in device:
      stale0 = next(r for r in results[0]["runs"] if r["kind"] == "stale")
      device = device_analysis(device, stale0["refreshes"], results[0]["table"])
  head["wall_s"] = time.perf_counter() - t_start
  head["load"] = (load0, os.getloadavg()[0])
  stem = C.stem(STEMS[args.method], args.quick)
  text = render(head, data_desc, results, device, args, describe_text)
  text += f"\nPlot: `{stem}.png` (losses; factor bytes per step; cumulative fraction).\n"
  print(text)
  os.makedirs(args.out, exist_ok=True)
  plot(os.path.join(args.out, stem + ".png"), results, args)
  for res in results:        # compact: per step, '1' for each factor refreshed
    for r in res["runs"]:
      counts = np.asarray([[0] * len(res["table"])] + r.pop("refreshes"))
      if r["kind"] == "stale":
        r["refreshed_per_step"] = ["".join(map(str, row)) for row in np.diff(counts, axis=0)]
  C.write_results(args.out, stem, text, dict(
      header=head, args=vars(args), data=data_desc, model=MODEL_DESCRIPTION,
      spngd_table2_percent=SPNGD, factor_order="results[i].table", results=results,
      device_check=device))
  print(f"wrote {os.path.join(args.out, stem)}.md, .json, .png", flush=True)


if __name__ == "__main__":
  if "--child" in sys.argv:
    child(parser().parse_args())
  else:
    main()
