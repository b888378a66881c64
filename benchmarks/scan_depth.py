"""Compile against depth: a scanned decoder's K-FAC step at 6, 24 and 96 blocks.

Large models scan their blocks (`nn.scan`: each projection one stacked layer
`[L, ...]`), and K-FAC gives each block its own factors. This measures whether
the compiled step grows with `L`: a decoder of `L` pre-LN blocks (4-head causal
attention with q/k/v/o `DenseGeneral`, MLP d → 4d → d, `kd.linen.LayerNorm`s:
six Kronecker and two unit-wise layers per block), width 64, context 32, batch 8,
vocabulary 256 (untagged embeddings and head), under one `nn.scan`
(`_models.Gpt2Xl`'s architecture at a small width).

Methods, each compiled in a child process of its own (a fresh compile, and its
own device count):
* `sgd`: optax SGD on `jax.value_and_grad` (the baseline);
* `kfac`: `kd.kfac`, factors every 10 steps, eigendecompositions every 100;
* `kfac_mem8`: the same on 8 host CPU devices, MEM-OPT (`grad_worker_fraction`
  1/8, the batch sharded over them: each device decomposes its blocks);
* `ekfac`: `kfac` with EK-FAC's correction (`eigenvalue_correction="ekfac"`);
* `kfac_stale`: `kd.kfac` with SP-NGD's stale statistics (`stale_threshold=0.1`,
  every factor on its own schedule);
* `kfac_adaptive`: `kfac` with the learning rate and momentum adapted by the
  quadratic model (`kd.kfac(None, None, grad_fn=...)`).

Reported per depth: trace + lower and compile seconds (one compile each, on a
shared machine: a sanity check of the instruction counts, which do not move
with the machine's load) and the optimised HLO's instructions (every
computation, fusions included); K-FAC's instructions against SGD's, and each
method's instructions added per block from the smallest depth to the largest.

Usage: python benchmarks/scan_depth.py [--quick] [--depths 6,24,96]
       [--methods sgd,kfac,kfac_mem8,ekfac,kfac_stale,kfac_adaptive]
       [--out benchmarks/results]
Writes scan_depth.md and scan_depth.json (scan_depth_quick.* with --quick:
depths 4 and 16, single device).
"""

from __future__ import annotations

import json
import subprocess
import sys

import _report  # benchmarks/, on sys.path when run as a script

METHODS = ("sgd", "kfac", "kfac_mem8", "ekfac", "kfac_stale", "kfac_adaptive")
FULL = dict(depths="6,24,96", methods=",".join(METHODS))
QUICK = dict(depths="4,16", methods="sgd,kfac")
WIDTH, CONTEXT, BATCH, VOCAB, HEADS = 64, 32, 8, 256, 4
# Issue-level check: K-FAC's program may grow by at most this many instructions
# per block (SGD's grows by about none: the scan's body is compiled once).
MAX_PER_BLOCK = 20


def child(depth: int, method: str) -> None:
  """Compiles one step and prints its measurements as JSON (in a child
  process: XLA reads its device count once)."""
  if method == "kfac_mem8":
    _report.host_devices(8)
  import time  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import _models  # pylint: disable=import-outside-toplevel
  import kfac_jax_dist as kd  # pylint: disable=import-outside-toplevel

  model = _models.Gpt2Xl(layers=depth, width=WIDTH, heads=HEADS, vocab=VOCAB,
                         context=CONTEXT)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (BATCH, CONTEXT + 1), 0, VOCAB)
  x, y = tokens[:, :-1], tokens[:, 1:]
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  loss_fn = lambda p, x, y: kd.losses.softmax_cross_entropy(
      model.apply({"params": p}, x), y)
  if method == "sgd":
    tx = optax.sgd(0.1)
    state = tx.init(params)

    def step(p, s, x, y):
      _, grads = jax.value_and_grad(loss_fn)(p, x, y)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s
    compiled_fn = jax.jit(step)
  else:
    grad_fn = kd.value_and_grad(loss_fn)
    mesh = Mesh(np.array(jax.devices()), ("data",)) if method == "kfac_mem8" else None
    dist = None if mesh is None else kd.Distribution(
        mesh, "data", grad_worker_fraction=1 / 8, gradient_reduction="all_reduce")
    schedule = (dict(stale_threshold=0.1) if method == "kfac_stale" else
                dict(factor_update_every=10, inverse_update_every=100))
    correction = dict(eigenvalue_correction="ekfac") if method == "ekfac" else {}
    adaptive = method == "kfac_adaptive"
    tx = kd.kfac(learning_rate=None if adaptive else 1e-3,
                 momentum=None if adaptive else 0.9, damping=1e-3, distribution=dist,
                 grad_fn=grad_fn if adaptive else None,
                 layers=grad_fn.discover(params, x, y), **schedule, **correction)
    batch = {"kfac_batch": (x, y)} if adaptive else {}
    state = tx.init(params)

    def step(p, s, x, y):
      _, grads, stats = grad_fn(p, x, y, opt_state=s)
      updates, s = tx.update(grads, s, p, kfac_stats=stats, **batch)
      return optax.apply_updates(p, updates), s
    if mesh is None:
      compiled_fn = jax.jit(step)
    else:
      state = kd.shard_state(state, mesh)
      specs = kd.partition_specs(state)
      compiled_fn = jax.jit(jax.shard_map(
          step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
          out_specs=(P(), specs)))
  start = time.perf_counter()
  lowered = compiled_fn.lower(params, state, x, y)
  traced = time.perf_counter()
  text = lowered.compile().as_text()
  done = time.perf_counter()
  print(json.dumps(dict(depth=depth, method=method, trace_lower_s=traced - start,
                        compile_s=done - traced,
                        instructions=sum(" = " in line for line in text.splitlines()))))


def measure(depth: int, method: str) -> dict:
  out = subprocess.run([sys.executable, __file__, "--child", str(depth), method],
                       capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"{method} at depth {depth} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def per_block(rows: list[dict], method: str) -> float | None:
  """Instructions added per block, smallest depth to largest."""
  mine = sorted((r["depth"], r["instructions"]) for r in rows if r["method"] == method)
  if len(mine) < 2:
    return None
  (d0, n0), (d1, n1) = mine[0], mine[-1]
  return (n1 - n0) / (d1 - d0)


def checks(rows: list[dict]) -> list[dict]:
  found = []
  for method in sorted({r["method"] for r in rows} - {"sgd"}):
    growth = per_block(rows, method)
    if growth is not None:
      found.append(dict(check=f"{method}: optimised HLO instructions added per block",
                        value=f"{growth:.1f}", target=f"≤ {MAX_PER_BLOCK}",
                        holds=growth <= MAX_PER_BLOCK,
                        why="a block's factors are slices of its stacked layer's"))
  return found


def markdown(rows: list[dict], argv: list[str], environment: dict) -> str:
  sgd = {r["depth"]: r["instructions"] for r in rows if r["method"] == "sgd"}
  table = [[r["depth"], r["method"], f"{r['trace_lower_s']:.2f}", f"{r['compile_s']:.2f}",
            r["instructions"],
            f"{r['instructions'] / sgd[r['depth']]:.2f}" if r["depth"] in sgd else ""]
           for r in rows]
  growth = [[m, f"{per_block(rows, m):.1f}"] for m in dict.fromkeys(r["method"] for r in rows)
            if per_block(rows, m) is not None]
  return "\n".join(
      ["# Compile against depth: a scanned decoder", "", _report.header_md(environment),
       "- " + " ".join(__doc__.split("\n\n")[1].split()),
       f"- generated by `{' '.join(['python benchmarks/scan_depth.py', *argv])}`", "",
       _report.md_table(table, ["blocks", "method", "trace + lower s", "compile s",
                                "HLO instructions", "× SGD's"]), "",
       _report.md_table(growth, ["method", "instructions added per block"]), ""]
      + _report.checks_markdown("Checks", checks(rows)))


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    return child(int(argv[1]), argv[2])
  ap = _report.argument_parser(__doc__)
  _report.add_quick(ap, "scan_depth", QUICK)
  ap.add_argument("--depths")
  ap.add_argument("--methods")
  args = ap.parse_args(argv)
  _report.fill_defaults(args, QUICK, FULL)
  unknown = set(args.methods.split(",")) - set(METHODS)
  if unknown:
    ap.error(f"--methods: unknown {sorted(unknown)}; choose from {METHODS}")
  rows = []
  for depth in map(int, args.depths.split(",")):
    for method in args.methods.split(","):
      rows.append(measure(depth, method))
      r = rows[-1]
      print(f"{depth} blocks, {method}: trace + lower {r['trace_lower_s']:.2f} s, "
            f"compile {r['compile_s']:.2f} s, {r['instructions']} instructions", flush=True)
  environment = _report.environment()
  _report.write_results(args.out, _report.stem("scan_depth", args.quick),
                        markdown(rows, argv, environment),
                        dict(environment=environment, argv=argv, rows=rows,
                             checks=checks(rows)))


if __name__ == "__main__":
  main()
