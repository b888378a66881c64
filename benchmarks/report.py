"""Generates docs/benchmarks.md from the committed benchmarks/results/*.json.

One section per results file that exists (step time, convergence, the two
peer comparisons, communication volume, layout balance, memory, Shampoo's
memory, stale statistics, the compiled code): where its script is, what it
measures, and a summary table of the numbers as the script recorded them, with
a link to the full report the script wrote beside its JSON. No number in
docs/benchmarks.md is typed by hand: rerun a benchmark, then this script.

    python benchmarks/report.py            # rewrites docs/benchmarks.md
    python benchmarks/report.py --check    # exit 1 if docs/benchmarks.md is stale

Standard library only (tests/test_benchmarks_report.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import RESULTS, fmt_bytes, md_table  # noqa: E402  pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
Json = dict[str, Any]

INTRO = """\
# Benchmarks

Every number below is read from `benchmarks/results/*.json`, the raw output of
the scripts in `benchmarks/`, by `benchmarks/report.py`, which wrote this page
(do not edit it by hand: rerun the benchmark, then
`python benchmarks/report.py`). Each section names its script, what it
measures and how; the full report with every table, check and caveat is the
`.md` beside the JSON, linked in each section. Unless a section says
otherwise the measurements ran on a shared 2-core CPU machine (8 virtual host
devices for the distributed ones): compare ratios measured side by side in one
run, not absolute times across runs. Each benchmark also has `--quick`, a
smoke run that `.ci/run` executes so that no script rots (its numbers are not
results)."""


# ------------------------------------------------------------------- helpers

def measured(env: Json) -> str:
  """When, with what and where a results file was measured (either header
  layout: `_report.environment`, or the older `header`)."""
  where = env.get("cpu") or env.get("machine", "?")
  cores = f", {env['cpu_count']} cores" if env.get("cpu_count") and env.get("cpu") else ""
  commit = env.get("commit") or env.get("git", "?")
  return (f"Measured {env.get('date', '?')[:10]} with jax {env.get('jax', '?')} "
          f"({env.get('backend', 'cpu')}) on {where}{cores}; kfac_jax_dist at {commit}.")


def link(stem: str) -> str:
  return f"[`benchmarks/results/{stem}.md`](../benchmarks/results/{stem}.md)"


def yes_no(holds: bool) -> str:
  return "yes" if holds else "**no**"


def checks_table(checks: list[Json]) -> list[str]:
  """The scripts' checks (check, measured, target, holds), without the reasons."""
  if not checks:
    return []
  rows = [[c["check"], c["value"], c["target"], yes_no(c["holds"])] for c in checks]
  return ["", md_table(rows, ["check", "measured", "target", "holds"])]


def others(rows: list[Json], p: int) -> str:
  """Where the rows of the other device counts are."""
  rest = sorted({r["P"] for r in rows} - {p})
  return ("P = " + ", ".join(map(str, rest)) + " in the full report") if rest else "only P"


def fmt(x: float | None, spec: str = ".2f") -> str:
  return "—" if x is None else format(x, spec)


# ------------------------------------------------------------------ sections

def step_time(d: Json) -> list[str]:
  lines = ["One jitted training step (`value_and_grad → tx.update → apply_updates`) "
           "of K-FAC against optax SGD and Adam on the same model, methods interleaved "
           "round by round; K-FAC every step (factors and eigendecompositions each "
           f"step) and amortised ({d['factor_update_every']}/{d['inverse_update_every']}), "
           "and the amortised optimizer's plain, factor and inverse steps alone. "
           "Ratios are medians of per-round ratios to SGD."]
  head = ["method", "what", "wall ms/step", "× SGD", "CPU ms/step", "× SGD (CPU)",
          "compile s"]
  for res in d["results"]:
    rows = [[r["name"], r["note"], f"{r['ms']:.2f}", f"{r['vs_sgd']:.2f}",
             f"{r['cpu_ms']:.2f}", f"{r['cpu_vs_sgd']:.2f}",
             fmt(r["compile"]["total_s"]) if r["compile"] else ""]
            for r in res["rows"]
            if r["group"] in ("main", "kind", "ekfac", "shampoo")
            or r["name"] == "kfac_adaptive"]
    when = f" (measured {res['measured_at']})" if res.get("measured_at") else ""
    lines += ["", f"**{res['model']}**{when}: {res['description']}", "", md_table(rows, head)]
    cost = res.get("adaptive_cost")
    if cost:
      lines += ["", f"Adaptive K-FAC (α, μ, λ adapted, T = 5): a plain step costs "
                f"{cost['jvp_cpu']:.2f}× a forward+backward more than K-FAC's (target "
                f"≤ 1){_adaptive_split(cost)}; "
                f"{cost.get('alpha_jvp_cpu', float('nan')):.2f}× with the momentum "
                f"fixed at 0; a damping step {cost['damping_cpu']:.2f}× a forward more (CPU "
                "time)."]
      if "lambda_mean_cpu" in cost:
        lines += ["", f"The damping alone adapted (η, μ fixed): a plain step "
                  f"{cost['lambda_plain_cpu']:.2f}× a forward+backward more than K-FAC's, "
                  f"an adaptation step {cost['lambda_damping_cpu']:.2f}× more than its "
                  f"plain step, {cost['lambda_mean_cpu']:.2f}× per step with one every "
                  "T = 5 (target ≤ 1; CPU time)."]
    for key, what, base in (("ekfac_cost", "EK-FAC", "K-FAC's amortised step"),
                            ("soap_cost", "SOAP", "Shampoo's step")):
      if res.get(key):
        lines += ["", f"{what}: {res[key]['cpu']:.2f}× {base} (CPU time; target ≤ 1.3)."]
  return lines


def _adaptive_split(cost: dict) -> str:
  """`, of which ... a× and the rest b×` where step_time measured the split."""
  if "tangent_cpu" not in cost:
    return ""
  return (f", of which its two tangent passes measured alone {cost['tangent_cpu']:.2f}× "
          f"and the rest {cost['rest_cpu']:.2f}×")


def convergence(d: Json) -> list[str]:
  lines = ["Steps and seconds to a target of K-FAC (tuned per task), adaptive K-FAC "
           "(the library's defaults on every task), EK-FAC (K-FAC's tuned settings), "
           "Shampoo and SOAP (learning rates tuned) against Adam(W) and SGD with "
           "momentum, each tuned on seed 0 (learning-rate grids; K-FAC's grid around the "
           "examples' defaults), then evaluated on seeds 1.."
           f"{d['args']['seeds']} in lockstep (medians over seeds, a miss counting as ∞). "
           "Target: ≤ 0.5× the steps and ≤ 0.8× the seconds of the best "
           "first-order method."]
  rows = []
  for task, res in d["results"].items():
    s = res["summary"]
    first = [s[f] for f in ("Adam", "SGD")]
    best_steps = min((f["steps"] for f in first if f["steps"] is not None), default=None)
    best_wall = min((f["wall"] for f in first if f["wall"] is not None), default=None)
    comparisons = s.get("comparisons") or {"K-FAC": dict(
        ratios=s["ratios"], step_cost=s["step_cost"], holds=s["holds"])}
    for name, c in comparisons.items():
      rows.append([task, d["metric"][task], d["targets"][task], name,
                   fmt(s[name]["steps"], ".0f"), fmt(best_steps, ".0f"),
                   fmt(c["ratios"]["steps"]), fmt(s[name]["wall"]), fmt(best_wall),
                   fmt(c["ratios"]["wall"]), f"{c['step_cost']:.1f}", yes_no(c["holds"])])
  return lines + ["", md_table(rows, [
      "task", "metric", "target", "method", "steps", "best first-order steps", "steps ×",
      "s", "best first-order s", "seconds ×", "step cost × fastest", "target holds"])]


def vs_kfac_jax(d: Json) -> list[str]:
  lines = [f"`kd.kfac` against DeepMind's kfac-jax {d['kfac_jax']} at equal settings "
           "(same Fisher up to the batch-size convention, same damping, momentum, "
           "cadences, exact eigendecompositions, nothing adaptive) on three small models "
           "of sklearn's digits, batch "
           f"{d['batch']}: step time (interleaved rounds), compile time (fresh "
           "processes; 'restart ×': a restarted run's, JAX's persistent compilation "
           "cache warm), and the relative parameter difference Δθ after 1 and 10 steps "
           "from the same start (the two compute the same steps). Targets: kd's step "
           "time ≤ 0.7× and time to first step (compile) ≤ 0.7× kfac-jax's "
           "(issue 16; issue 6 had asked ≤ 0.5×)."]
  rows = []
  for model, res in d["results"].items():
    for r in res:
      agree = r["agreement"]
      rows.append([model, r["cadence"], f"{r['ms']['kd']:.2f}",
                   f"{r['ms']['kfac-jax']:.2f}", f"{r['ratio_wall']:.2f}",
                   f"{r['ratio_cpu']:.2f}", f"{r['compile_ratio_wall']:.2f}",
                   f"{r['restart_ratio_wall']:.2f}" if "restart" in r else "—",
                   f"{agree['1']:.0e} / {agree['10']:.0e}"])
  return lines + ["", md_table(rows, ["model", "curv/inv every", "kd ms/step",
                                      "kfac-jax ms/step", "step × (wall)", "step × (CPU)",
                                      "compile ×", "restart ×", "Δθ @1 / @10"])]


def vs_distributed_shampoo(d: Json) -> list[str]:
  lines = ["`kd.shampoo` (Newton and eigh roots) against Google's "
           "`precondition.distributed_shampoo` at equal settings on sklearn's digits: "
           "compile time, step time, loss and accuracy after the same steps from the "
           "same initialisation, and the relative parameter difference to "
           "distributed_shampoo (beside the difference distributed_shampoo itself shows "
           "from an initialisation perturbed by 1e-6)."]
  head = ["model", "optimizer", "compile s", "median ms/step", "CPU ms/step",
          "train loss", "test acc", "rel. Δθ early", "rel. Δθ end"]
  rows = []
  for model, m in d["models"].items():
    for opt, r in m["rows"].items():
      rows.append([model, opt, f"{r['compile_s']:.2f}", f"{r['median_ms']:.2f}",
                   f"{r['cpu_mean_ms']:.2f}", f"{r['train_loss']:.2e}",
                   f"{r['test_acc']:.3f}", f"{r['max_param_diff_early']:.1e}",
                   f"{r['max_param_diff']:.1e}"])
    early, end = m["perturbed_init_diff"]
    rows.append([model, "distributed_shampoo, init + 1e-6 noise", "", "", "", "", "",
                 f"{early:.1e}", f"{end:.1e}"])
  return lines + ["", md_table(rows, head)]


def comm_volume(d: Json) -> list[str]:
  lines = ["Bytes each device sends per step (ring model), read from the compiled HLO "
           "of the shard_map'd training step (`_common.collectives`, unit-tested in "
           "tests/test_hlo_collectives.py), for SGD and every distribution strategy of "
           "K-FAC on a fixed CNN/MLP (`_models.CnnMlp`): plain steps, and the extra "
           "bytes of factor and inverse steps; amortised at factor updates every 10 "
           "and decompositions every 100 steps. The library's own byte model, one term "
           "per collective, must equal the HLO (a check below)."]
  p = max(r["P"] for r in d["rows"])
  lines += ["", f"At P = {p} ({others(d['rows'], p)}):", ""] + _volume_table(d["rows"], p)
  second = d.get("second_model", {}).get("rows")
  if second:
    lines += ["", f"A second model, {d['second_model']['description']} (`_models.CnnMlp12`: "
              "twelve comparable layers, none over 1/8 of the parameters), at P = 8:",
              ""] + _volume_table(second, 8)
  return lines + checks_table(d.get("checks", []))


def _volume_table(rows: list[Json], p: int) -> list[str]:
  rs = [r for r in rows if r["P"] == p]
  sgd = next(r for r in rs if r["strategy"] == "SGD")["plain"]
  table = [[r["strategy"], r["m"] or "", fmt_bytes(r["plain"]), f"{r['plain'] / sgd:.3f}",
            fmt_bytes(r["factor_only"]), fmt_bytes(r["inverse_only"]),
            f"{fmt_bytes(r['amortised'])} ({r['amortised'] / sgd:.2f}×)"] for r in rs]
  return [md_table(table, [
      "strategy", "m", "plain step", "× SGD", "factor step extra", "inverse step extra",
      "amortised 10/100 (× SGD)"])]


COLLECTIVES = {"factor_rs": "factor RS", "chunk_ag": "chunk AG",
               "eigen_bcast": "eigen broadcast", "grad_ag": "MEM-OPT gradient AG",
               "spngd_rs": "SP-NGD gradient RS"}


def layout_balance(d: Json) -> list[str]:
  lines = ["The K-FAC layout (`layout.build`) of ResNet-50, BERT-Large and GPT-2-XL "
           "layer shapes at P = 8, 64, 256 and 1024: the load balance of the "
           "eigendecompositions (max Σd³ on a device over the ideal, and the best any "
           "assignment can do; target ≤ 1.10) and the padding overhead of each "
           "collective (bytes sent over the padding-free (P-1)/P·Σ; target ≤ 1.10), "
           "from the layout; the compiled updates' HLO bytes agree with the library's "
           "cost model, and the update program's size is measured against P (full "
           "report)."]
  rows = [[r["model"], r["P"], r["strategy"], r["storage"], f"{r['balance']:.3f}",
           f"{r['bound']:.3f}" if "bound" in r else "",
           " / ".join(f"{COLLECTIVES.get(k, k)} {c['ratio']:.3f}"
                      for k, c in r["collectives"].items()),
           f"{r['amortised_ratio']:.3f}"]
          for r in d["rows"] if r.get("layout", "library LPT") == "library LPT"]
  lines += ["", md_table(rows, ["model", "P", "strategy", "factor storage", "balance",
                                "best possible", "overhead per collective",
                                "amortised 10/100 overhead"])]
  comp = [[c.get("model", "resnet50"), c["P"], c["strategy"], fmt_bytes(c["plain_bytes"]),
           fmt_bytes(c["factor_bytes"]), fmt_bytes(c["inverse_bytes"])]
          for c in d.get("compiles", []) if "error" not in c]
  if comp:
    lines += ["", "The compiled updates (HLO bytes per device):", "",
              md_table(comp, ["model", "P", "strategy", "plain step", "factor step extra",
                              "inverse step extra"])]
  sizes = [[r["model"], r["P"], r["strategy"], f"{r['stablehlo_ops']:,}"]
           for r in d.get("program_sizes", []) if "error" not in r]
  if sizes:
    lines += ["", "The update program's size (StableHLO operations; target: P = 1024 ≤ 2× "
              "P = 64):", "", md_table(sizes, ["model", "P", "strategy", "operations"])]
  return lines


def memory(d: Json) -> list[str]:
  lines = ["Optimizer-state bytes per device of `kd.kfac` for every strategy on the "
           "model of comm_volume, from the placed arrays' shards (`kd.shard_state`), "
           "against the padding-free ideal (Σ stored factor numbers / P + Σ "
           "second-order numbers / G)."]
  p = max(r["P"] for r in d["rows"])
  rows = [[r["strategy"], r["m"] or "", fmt_bytes(r["kfac_max"]), fmt_bytes(r["ideal"]),
           f"{r['kfac_max'] / r['ideal']:.3f}" if r["ideal"] else "",
           fmt_bytes(r["total_max"])] for r in d["rows"] if r["P"] == p]
  lines += ["", f"At P = {p} ({others(d['rows'], p)}):", "",
            md_table(rows, ["strategy", "m", "K-FAC state, max device", "ideal",
                            "max / ideal", "whole optax state, max device"])]
  peaks = d.get("step_peaks") or []
  if peaks:
    lines += ["", "Peak memory of the amortised K-FAC step against SGD's + the K-FAC state "
              "+ one layer's eigendecomposition workspace (XLA's memory analysis; the "
              "step_time models on one device, ResNet-50 per device of 8):", "", md_table(
                  [[r["model"], fmt_bytes(r["sgd_peak"]), fmt_bytes(r["kfac_peak"]),
                    fmt_bytes(r["bound"]), f"{r['kfac_peak'] / r['bound']:.3f}",
                    yes_no(r["holds"])] for r in peaks],
                  ["model", "SGD peak", "K-FAC peak", "bound", "peak / bound", "holds"])]
  mesh3d = d.get("mesh3d") or []
  if mesh3d:
    lines += ["", "Per device on a 2×2×2 (data, model, stage) mesh, a pipelined and "
              "tensor-parallel stack of 8 MLP blocks, against the same model on 8 data "
              "devices:", "", md_table(
                  [[r["mesh"], r["strategy"], fmt_bytes(r["params"]),
                    fmt_bytes(r["kfac_state"]), fmt_bytes(r["kfac_peak"]),
                    f"{r['kfac_peak'] / r['bound']:.3f}"] for r in mesh3d],
                  ["mesh", "strategy", "parameters", "K-FAC state", "K-FAC peak",
                   "peak / bound"])]
  init = d.get("init") or []
  if init:
    lines += ["", "Building the state on the mesh (`kd.init_sharded`, ResNet-50's shapes on "
              "8 devices): XLA's temporaries per device against the device's shard of the "
              "state (target ≤ 0.5):", "", md_table(
                  [[r["method"], r["strategy"], fmt_bytes(r["shard"]), fmt_bytes(r["temp"]),
                    f"{r['temp'] / r['shard']:.3f}", yes_no(r["holds"])] for r in init],
                  ["method", "strategy", "shard per device", "temporaries",
                   "temporaries / shard", "holds"])]
  return lines + checks_table(d.get("checks", []))


def shampoo_memory(d: Json) -> list[str]:
  lines = ["Optimizer-state bytes per device of `kd.shampoo` (block size 128, AdaGrad "
           "grafting) on the same model for each `grad_worker_fraction`: COMM-OPT "
           "replicates statistics and roots, MEM-OPT and HYBRID shard them."]
  comm = {r["P"]: r for r in d["rows"] if r["strategy"] == "COMM-OPT"}
  rows = [[r["P"], r["strategy"], r["m"], fmt_bytes(r["shampoo_max"]), fmt_bytes(r["ideal"]),
           f"{r['shampoo_max'] / r['ideal']:.3f}",
           f"{r['shampoo_max'] / comm[r['P']]['shampoo_max']:.3f}",
           fmt_bytes(r["second_max"])] for r in d["rows"]]
  return lines + ["", md_table(rows, ["P", "strategy", "m", "Shampoo state, max device",
                                      "ideal", "max / ideal", "× COMM-OPT",
                                      "statistics + roots"])]


def stale_statistics(d: Json) -> list[str]:
  a = d["args"]
  second = {"eigen": "eigenbases", "inverse": "π-damped inverses (a layer's two factors "
            "both inverted when either refreshes)"}[a.get("method", "eigen")]
  lines = ["SP-NGD's stale statistics (`stale_threshold`) on a character-level "
           f"Transformer: {a['steps']} steps with factors and {second} due every step, "
           f"with and without α = {a['alpha']}, for each `factor_decay`: the share of "
           "refreshes, of factor bytes and of decomposition work left, the step-time "
           "ratio, and the final losses of both runs."]
  rows = []
  for res in d["results"]:
    s, t = res["savings"], res["time"]
    plain, stale = (next(r for r in res["runs"] if r["kind"] == k) for k in ("plain", "stale"))
    rows.append([f"{res['decay']:g}", f"{100 * s['refresh_fraction']:.1f} %",
                 f"{100 * s['bytes_fraction']:.1f} %",
                 f"{100 * s['eigh_cube_fraction']:.1f} %", f"{t['ratio_wall']:.3f}",
                 f"{plain['eval'][-1][1]:.4f} / {stale['eval'][-1][1]:.4f}"])
  lines += ["", md_table(rows, ["factor_decay", "refreshes", "factor bytes",
                                "decomposition Σd³", "step time stale / plain",
                                "held-out loss plain / stale"])]
  dv = d.get("device_check")
  if dv and "error" not in dv:
    lines += ["", f"On {dv['p']} devices (shard_map, {dv['strategy']}) the refresh "
              "decisions equal the single-device run's: "
              f"{yes_no(dv['refreshes_equal_single_device'])}; each factor's all-reduce "
              "sits in its own conditional, payloads matching the factor sizes: "
              f"{yes_no(dv['payloads_match_factor_sizes'])}."]
  return lines


def ir_census(d: Json) -> list[str]:
  sgd = {r["model"]: r["lines"] for r in d["rows"] if r["method"] == "sgd"}
  rows = [[r["model"], r["method"], r["kernels"], r["lines"],
           f"{r['lines'] / sgd[r['model']]:.2f}" if r["model"] in sgd else "",
           r["unswitched_kernels"]] for r in d["rows"]]
  return ["XLA:CPU's optimised LLVM IR of each step_time step (one child process per "
          "step, XLA's dump): kernels and lines, which the compile time tracks, and the "
          "kernels whose loops LLVM unswitched; the full report attributes the lines to "
          "the library's source lines.", "",
          md_table(rows, ["model", "method", "kernels", "IR lines", "× SGD's lines",
                          "unswitched kernels"])]


def tied_embedding(d: Json) -> list[str]:
  a, results = d["args"], d["results"].values()
  rows = [[r["label"], f"{r['lr']:g}", f"{r['median']:.3f}"] for r in results]
  return [f"A character LM whose head is its token embedding (`Embed.attend`), {a['steps']} "
          f"steps, validation loss (median over {a['seeds']} seeds): K-FAC with the tied "
          "table preconditioned by its lookup's factors (the library's behaviour: `attend` "
          "is untagged), K-FAC with the table left out (`skip=`), K-FAC on the untied "
          "model, and AdamW.", "",
          md_table(rows, ["arm", "lr", "validation loss"])] + checks_table(d.get("checks", []))


def scan_depth(d: Json) -> list[str]:
  sgd = {r["depth"]: r["instructions"] for r in d["rows"] if r["method"] == "sgd"}
  rows = [[r["depth"], r["method"], f"{r['compile_s']:.2f}", r["instructions"],
           f"{r['instructions'] / sgd[r['depth']]:.2f}" if r["depth"] in sgd else ""]
          for r in d["rows"]]
  return ["A decoder of L pre-LN blocks under one `nn.scan` (width 64: six Kronecker and "
          "two unit-wise layers per block): each step compiled once in a process of its "
          "own; the optimised HLO's instructions, which the compile tracks, should not "
          "grow with L.", "",
          md_table(rows, ["blocks", "method", "compile s", "HLO instructions",
                          "× SGD's"])] + checks_table(d.get("checks", []))


# (results stem, section title, script, renderer), in the page's order.
SECTIONS: tuple[tuple[str, str, str, Callable[[Json], list[str]]], ...] = (
    ("step_time", "Step time", "step_time.py", step_time),
    ("convergence", "Convergence", "convergence.py", convergence),
    ("vs_kfac_jax", "Against kfac-jax", "vs_kfac_jax.py", vs_kfac_jax),
    ("vs_distributed_shampoo", "Against distributed_shampoo",
     "vs_distributed_shampoo.py", vs_distributed_shampoo),
    ("comm_volume", "Communication volume", "comm_volume.py", comm_volume),
    ("layout_balance", "Layout balance", "layout_balance.py", layout_balance),
    ("memory", "Memory", "memory.py", memory),
    ("shampoo_memory", "Shampoo memory", "shampoo_memory.py", shampoo_memory),
    ("stale_statistics", "Stale statistics", "stale_statistics.py", stale_statistics),
    ("stale_statistics_inverse", "Stale statistics with SP-NGD's inverses",
     "stale_statistics.py", stale_statistics),
    ("ir_census", "Compiled code (LLVM IR census)", "ir_census.py", ir_census),
    ("tied_embedding", "Tied embeddings", "tied_embedding.py", tied_embedding),
    ("scan_depth", "Compile against depth", "scan_depth.py", scan_depth),
)


def environment_of(d: Json) -> Json:
  return d.get("environment") or d.get("header") or {}


def render(results: str = RESULTS) -> str:
  """docs/benchmarks.md from the JSON files in `results`."""
  out = [INTRO]
  for stem, title, script, section in SECTIONS:
    path = os.path.join(results, stem + ".json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      d = json.load(f)
    out += ["", f"## {title}", "",
            f"Script: [`benchmarks/{script}`](../benchmarks/{script}); full report: "
            f"{link(stem)}. {measured(environment_of(d))}", ""]
    out += section(d)
  return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--results", default=RESULTS, help="folder of the *.json results")
  ap.add_argument("--out", default=DOC, help="the page to write")
  ap.add_argument("--check", action="store_true",
                  help="only compare: exit 1 if --out differs from what would be written")
  args = ap.parse_args(argv)
  text = render(args.results)
  if args.check:
    with open(args.out) as f:
      stale = f.read() != text
    if stale:
      print(f"{args.out} is not what benchmarks/report.py generates: rerun it")
    return int(stale)
  with open(args.out, "w") as f:
    f.write(text)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
