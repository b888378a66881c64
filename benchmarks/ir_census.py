"""Where a compiled step's code goes: XLA:CPU's LLVM IR, kernel by kernel.

On XLA:CPU a step's compile time tracks the kernels it generates and their
lines of optimised LLVM IR (benchmarks/results/PERF_NOTES.md §9-11: about 4 ms
per kernel and 0.045 ms per line on the 2-core CI machine). Those counts are
the same on every run, where whole-compile timings move by ±0.5 s with the
machine's load, so a cut can be judged by them before it is timed.

For each step_time model and method (`step_time.methods`: the same transforms
and steps), a child process compiles the jitted step with XLA's dump on
(`--xla_dump_to`, the step's module only) and this process reads the dump:
- each kernel's optimised IR (`*.ir-with-opt.ll`): its lines, and whether LLVM
  unswitched a loop in it (copied the loop once per value of a
  loop-invariant condition: `.us` blocks), the pattern `faults.pick` avoids;
- the optimised HLO's stack frames: each kernel is attributed to the
  innermost `kfac_jax_dist` source line of its instruction ("outside" when
  no frame is the library's: the model, optax, XLA's own copies).

Reported: kernels, IR lines and unswitched kernels per method, each method's
lines against SGD's, and the library's source lines that generate the most
IR per method. The child's trace + compile seconds are printed beside them as
a sanity check, not a measurement (one compile, a loaded machine).

XLA:CPU of jaxlib 0.11 and later dumps a kernel's LLVM IR only where its
emitters' dump is asked for too (`--xla_dump_emitter_re`), and that dump
aborts the process when XLA emits kernels on several threads (a race seen
on jaxlib 0.10.2 and 0.12.0.1: "pure virtual method called"), so there the
child compiles on one CPU (`sched_setaffinity`; same kernels, same IR, its
seconds single-threaded). jaxlib 0.10 dumps the IR without it (and with it,
even on one CPU, its CNN step's compile crashed).

Usage: python benchmarks/ir_census.py [--quick] [--models cnn] [--methods
       sgd,kfac_amortised,shampoo] [--top 12] [--out benchmarks/results]
Writes ir_census.md and ir_census.json (ir_census_quick.* with --quick: the
MLP's SGD and amortised K-FAC steps).
"""

from __future__ import annotations

import collections
import glob
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import _report  # benchmarks/, on sys.path when run as a script

METHODS = ("sgd", "adam", "kfac_every", "kfac_amortised", "kfac_adaptive", "shampoo")
FULL = dict(models="mlp,cnn,lm", methods=",".join(METHODS))
QUICK = dict(models="mlp", methods="sgd,kfac_amortised")
MODULE = "jit_step"                # `_common.kfac_step` / `optax_step` name it step
UNSWITCHED = re.compile(r"\.us[.:]")
# The library's folder (found without importing it, nor jax, in this process).
PACKAGE = os.path.dirname(importlib.util.find_spec("kfac_jax_dist").origin) + os.sep


class Kernel(NamedTuple):
  name: str
  lines: int
  unswitched: bool
  source: str                      # innermost library frame, or "outside"


def compile_dumped(model: str, method: str, dump: str) -> float:
  """Compile `method`'s step on `model` in a child process that dumps its
  HLO and LLVM IR to `dump`; the child's trace + compile seconds."""
  flags = [f"--xla_dump_to={dump}", f"--xla_dump_hlo_module_re={MODULE}"]
  one_cpu = None
  if _jaxlib_version() >= (0, 11):    # (older ones dump the IR without it)
    flags.append("--xla_dump_emitter_re=.*")
    if hasattr(os, "sched_setaffinity"):    # Linux (elsewhere: hope for no race)
      cpu = min(os.sched_getaffinity(0))
      one_cpu = lambda: os.sched_setaffinity(0, {cpu})  # noqa: E731
  out = subprocess.run([sys.executable, __file__, "--child", model, method],
                       env=_report.env_with_xla_flags(*flags), preexec_fn=one_cpu,
                       capture_output=True, text=True, check=True)
  return float(out.stdout.split()[-1])


def _jaxlib_version() -> tuple[int, ...]:
  release = importlib.metadata.version("jaxlib").split(".")[:2]
  return tuple(int(part) for part in release if part.isdigit())


def child(model: str, method: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import step_time  # pylint: disable=import-outside-toplevel
  m = step_time.methods(model)
  state = m.txs[method].init(m.params)
  t = time.perf_counter()
  jax.jit(m.steps[method]).lower(m.params, state, m.x, m.y).compile()
  print(time.perf_counter() - t)


def stack_frames(hlo_text: str) -> dict[int, str]:
  """Stack frame id → its innermost `kfac_jax_dist` frame ("path:function:line")
  or "outside", from the HLO text's FileNames ... StackFrames tables."""
  tables: dict[str, dict[int, str]] = {}
  table = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      table = tables.setdefault(line, {})
    elif table is not None and re.match(r"^\d+ ", line):
      key, value = line.split(" ", 1)
      table[int(key)] = value.strip('"')
    elif not line.strip():
      table = None
  locations = {}
  for key, value in tables.get("FileLocations", {}).items():
    f, fn, ln = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)",
                          value).groups()
    locations[key] = (tables["FileNames"][int(f)], tables["FunctionNames"][int(fn)], ln)
  parents = {key: tuple(map(int, re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)",
                                           value).groups()))
             for key, value in tables.get("StackFrames", {}).items()}

  def innermost(frame: int) -> str:
    seen = set()
    while frame in parents and frame not in seen:
      seen.add(frame)
      location, frame = parents[frame]
      named = _in_package(*locations[location])
      if named != "outside":
        return named
    return "outside"
  return {frame: innermost(frame) for frame in parents}


def _in_package(path: str, *where: str) -> str:
  """`path`'s frame as the census names it: its path inside the package and
  `where` (function, line), joined by ":"; "outside" for a path elsewhere."""
  return ":".join((path[len(PACKAGE):],) + where) if path.startswith(PACKAGE) else "outside"


# An HLO instruction's name, then (lazily) the rest of its line up to a metadata field.
_INSTRUCTION = r"^\s*(?:ROOT )?%?([\w.-]+) = .*?"


def instruction_sources(hlo_text: str) -> dict[str, str]:
  """Instruction name → its innermost `kfac_jax_dist` frame (`stack_frames`),
  for the instructions of the HLO text that carry a stack frame. Older jaxlibs
  (0.8) write no frame tables, only each instruction's innermost frame outside
  jax as `source_file`/`source_line`: then "path:line" where that frame is the
  package's, else "outside"."""
  frames = stack_frames(hlo_text)
  if frames:
    return {name: frames.get(int(frame), "outside") for name, frame in re.findall(
        _INSTRUCTION + r"stack_frame_id=(\d+)", hlo_text, re.MULTILINE)}
  return {name: _in_package(path, line) for name, path, line in re.findall(
      _INSTRUCTION + r'source_file="([^"]*)" source_line=(\d+)', hlo_text, re.MULTILINE)}


def kernels(dump: str) -> list[Kernel]:
  """Every kernel of the dumped step: IR lines, unswitched, source line."""
  if not glob.glob(f"{dump}/*{MODULE}.*.ir-with-opt.ll"):
    raise RuntimeError(f"XLA dumped no LLVM IR for {MODULE} (files: "
                       f"{sorted({os.path.splitext(f)[1] for f in os.listdir(dump)})})")
  hlo = open(glob.glob(f"{dump}/*{MODULE}.cpu_after_optimizations.txt")[0]).read()
  sources = instruction_sources(hlo)
  found = []
  for path in glob.glob(f"{dump}/*{MODULE}.*.ir-with-opt.ll"):
    name = os.path.basename(path).split(f"{MODULE}.", 1)[1].removesuffix(".ir-with-opt.ll")
    name = name.replace("__compute_module_", "").replace("_kernel_module", "")
    body = open(path).read()
    source = sources.get(name, "outside")
    found.append(Kernel(name, body.count("\n"), bool(UNSWITCHED.search(body)), source))
  return found


def census(model: str, method: str, top: int) -> dict:
  with tempfile.TemporaryDirectory() as dump:
    seconds = compile_dumped(model, method, dump)
    ks = kernels(dump)
  by_source = collections.defaultdict(lambda: [0, 0])
  for k in ks:
    by_source[k.source][0] += k.lines
    by_source[k.source][1] += 1
  ranked = sorted(by_source.items(), key=lambda kv: -kv[1][0])[:top]
  return dict(model=model, method=method, kernels=len(ks), lines=sum(k.lines for k in ks),
              unswitched_kernels=sum(k.unswitched for k in ks),
              unswitched_lines=sum(k.lines for k in ks if k.unswitched),
              compile_s=seconds,
              sources=[dict(source=s, lines=n, kernels=c) for s, (n, c) in ranked])


def markdown(rows: list[dict], argv: list[str], environment: dict) -> str:
  sgd = {r["model"]: r["lines"] for r in rows if r["method"] == "sgd"}
  table = [[r["model"], r["method"], r["kernels"], r["lines"],
            f"{r['lines'] / sgd[r['model']]:.2f}" if r["model"] in sgd else "",
            f"{r['unswitched_kernels']} ({r['unswitched_lines']})", f"{r['compile_s']:.2f}"]
           for r in rows]
  out = ["# XLA:CPU code per compiled step (LLVM IR census)", "",
         _report.header_md(environment),
         "- " + " ".join(__doc__.split("\n\n")[1].split()),
         f"- generated by `{' '.join(['python benchmarks/ir_census.py', *argv])}`", "",
         _report.md_table(table, ["model", "method", "kernels", "IR lines", "× SGD's lines",
                                  "unswitched kernels (lines)",
                                  "trace + compile s (one run)"])]
  for r in rows:
    if r["method"] not in ("sgd", "adam"):
      out += ["", f"## {r['model']}, {r['method']}: the source lines with the most IR", "",
              _report.md_table([[s["lines"], s["kernels"], f"`{s['source']}`"]
                                for s in r["sources"]],
                               ["IR lines", "kernels", "innermost kfac_jax_dist frame"])]
  return "\n".join(out)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    return child(*argv[1:3])
  ap = _report.argument_parser(__doc__)
  _report.add_quick(ap, "ir_census", QUICK)
  ap.add_argument("--models")
  ap.add_argument("--methods")
  ap.add_argument("--top", type=int, default=12, help="source lines listed per method")
  args = ap.parse_args(argv)
  _report.fill_defaults(args, QUICK, FULL)
  unknown = set(args.methods.split(",")) - set(METHODS) - {"ekfac_amortised", "soap"}
  if unknown:
    ap.error(f"--methods: unknown {sorted(unknown)}; choose from step_time's methods")
  rows = []
  for model in args.models.split(","):
    for method in args.methods.split(","):
      rows.append(census(model, method, args.top))
      r = rows[-1]
      print(f"{model} {method}: {r['kernels']} kernels, {r['lines']} lines, "
            f"{r['unswitched_kernels']} unswitched, {r['compile_s']:.2f} s", flush=True)
  environment = _report.environment()
  _report.write_results(args.out, _report.stem("ir_census", args.quick),
                        markdown(rows, argv, environment),
                        dict(environment=environment, argv=argv, rows=rows))


if __name__ == "__main__":
  main()
