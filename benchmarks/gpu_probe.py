"""Where K-FAC's step time goes on an accelerator: a short probe for the GPU check.

Measurements, printed as text (benchmarks/gpu_check.sh appends them to its log):

* kernels: the kernels each compiled piece of a K-FAC plain step launches
  (fusions, library calls, control flow) on the CNN and the LM, against
  `jax.value_and_grad` and optax SGD's whole step;
* plain step: ms per call of those pieces (median of `--reps`), and of the
  step in the preconditioning's other arrangement (`precondition.BATCH_RUNS`)
  where the model has equal-shape layers (the LM): off CPU, where they are
  batched by default (its eight attention projections one run), one layer at
  a time; on CPU the reverse;
* consecutive steps: 2 cycles of the amortised step (factors every 10, eigh
  every 100) carried step to step, each step timed alone, summarised by kind
  (eigh, factor, the plain step right after a factor step, other plain steps),
  in a plain loop and in a loop whose step donates the parameters and the
  state, against the same kinds timed from one fixed state (the first of its
  kind after the warm-up cycle: on this CPU the LM's eigh of its count-0
  factors, one batch's statistics, took 73 ms against 83-88 ms for the
  running averages of later cycles; run 4 timed the count-0 eigh). On the
  H100 (run 4) the LM's 100 consecutive steps took 4.63 ms each against 2.88
  ms for the cadence-weighted mean of its kinds; on the CPU the two agree. On
  the H200 (run 5) the LM's plain step took 4.17 ms in a plain loop, 2.37 ms
  from a fixed state and 2.11 ms in a donating loop;
* `--command-buffer-ab`: the consecutive-step summary again in a child
  process whose XLA_FLAGS add conditionals and loops to XLA's GPU command
  buffers (CUDA graph conditional nodes), so that a plain step's
  conditionals need no wait on the host;
* `--compile-ab` (alone): trace + lower and XLA compile seconds of SGD's and the
  amortised K-FAC's steps, at XLA's defaults and in a child process with
  GPU autotuning off (run 5, H200: K-FAC's step compiled in 13.6 s on the
  CNN against SGD's 1.3 s, 17.8 against 6.3 on the LM);
* `--trace` (alone): where the plain step's gap to SGD's goes on the device.
  Consecutive donated steps of SGD and of the amortised K-FAC (from count
  101: plain and factor steps, no eigh), each blocked, under `jax.profiler`;
  per plain step, from the trace's kernel events of the step's program: the
  wall ms, the kernels run, the device's busy ms (the union of their
  intervals), its idle ms (wall − busy: launches, host work, waits) and the
  kernels' summed ms by the library file of each one's innermost
  `kfac_jax_dist` frame ("outside": the loss, optax, XLA's copies; the
  model's tagged layers are `capture/tags.py`'s in both steps; kernels that
  overlap count in full). A gap that is mostly idle time is launch- or
  host-bound, one that is busy time is the kernels' own work;
* `--eigh`: ms per call of `lax.linalg.eigh` for each implementation the
  backend offers (QR = cuSOLVER syevd, JACOBI = syevj, QDWH = jax's
  polar-based one) on batches of random PSD matrices of the step_time
  models' factor sizes, beside a Cholesky inverse of the same batch and one
  matrix at a time.

Usage: python benchmarks/gpu_probe.py [--models cnn,lm] [--reps 50]
       [--command-buffer-ab] [--compile-ab] [--trace] [--eigh] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import precondition
from kfac_jax_dist.kfac.state import find_states

import _common
import ir_census
import step_time

EIGH_SIZES = ((1, 785), (2, 513), (4, 257), (8, 129), (16, 65), (24, 35))
# One matrix at a time: is a size 2^k + 1 (a factor with its bias row) slow?
# (Measured on an H100, jax 0.11.2: cuSOLVER syevd took 26 ms per 513 matrix
# in a batch of 2 and 9 ms for one 785.)
SINGLE_SIZES = (35, 65, 129, 256, 257, 272, 512, 513, 520, 544, 784, 785, 1024, 1025)
FACTOR_EVERY, INVERSE_EVERY = step_time.FACTOR_EVERY, step_time.INVERSE_EVERY
# Conditionals and while loops recorded into CUDA graphs (XLA's `+TYPE`
# syntax adds to the default command types).
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
# XLA:GPU times candidate kernels (GEMM algorithms, fusions) while compiling;
# level 0 keeps its defaults. Is that where the K-FAC step's compile goes?
AUTOTUNE_OFF_FLAG = "--xla_gpu_autotune_level=0"
SKIPPED_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
               "after-all", "partition-id", "replica-id"}


def timed(fn, *args, reps: int) -> float:
  """Median wall ms of `fn(*args)` over `reps` calls, after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - start))
  return statistics.median(times)


def eigh_table(reps: int) -> list[str]:
  lines = ["eigh, ms per batched call (float32, random PSD):",
           "  batch x dim | " + " | ".join(["qr", "jacobi", "qdwh", "cholesky inverse",
                                             "one at a time (lax.map)", "one at a time (unrolled)"])]
  for batch, dim in EIGH_SIZES:
    mats = random_psd(batch, dim)
    cells = []
    for impl in lax.linalg.EighImplementation:
      fn = jax.jit(lambda m, impl=impl: lax.linalg.eigh(m, implementation=impl))
      try:
        cells.append(f"{timed(fn, mats, reps=reps):.2f}")
      except Exception as e:  # an implementation this backend lacks
        cells.append(type(e).__name__)
    inv = jax.jit(lambda m: jax.scipy.linalg.cho_solve(
        (jnp.linalg.cholesky(m), True), jnp.broadcast_to(jnp.eye(m.shape[-1]), m.shape)))
    cells.append(f"{timed(inv, mats, reps=reps):.2f}")
    mapped = jax.jit(lambda m: lax.map(jnp.linalg.eigh, m))
    unrolled = jax.jit(lambda m: [jnp.linalg.eigh(m[i]) for i in range(m.shape[0])])
    cells += [f"{timed(mapped, mats, reps=reps):.2f}", f"{timed(unrolled, mats, reps=reps):.2f}"]
    lines.append(f"  {batch} x {dim} | " + " | ".join(cells))
  lines.append("one matrix, default eigh, ms: " + ", ".join(
      f"{dim}: {timed(jax.jit(jnp.linalg.eigh), random_psd(1, dim)[0], reps=reps):.2f}"
      for dim in SINGLE_SIZES))
  return lines


def random_psd(batch: int, dim: int) -> jax.Array:
  a = jax.random.normal(jax.random.key(dim), (batch, dim, 2 * dim), jnp.float32)
  return a @ jnp.swapaxes(a, -1, -2) / dim + 1e-3 * jnp.eye(dim)


def kernel_census(compiled) -> collections.Counter:
  """Opcode counts of the instructions that launch work: every instruction of
  the computations that are neither fused nor a reduction's reducer
  (`to_apply`), bookkeeping (tuples, parameters) left out. Untaken branches
  of conditionals count too."""
  text = compiled.as_text()
  fused = set(re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", text))
  counts: collections.Counter = collections.Counter()
  inside = False
  for line in text.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      inside = head.group(2) not in fused or bool(head.group(1))
      continue
    m = re.match(r"^\s+(ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(", line)
    if inside and m and m.group(2) not in SKIPPED_OPS:
      counts[m.group(2)] += 1
  return counts


class Problem(NamedTuple):
  """A step_time model: its loss, capture and amortised K-FAC step (jitted)."""
  name: str
  loss_fn: Callable
  grad_fn: Callable
  tx: Any
  step: Callable              # the K-FAC step, not jitted
  kstep: Callable
  kstep_donated: Callable     # the same step with donate_argnums=(0, 1)
  params: Any
  x: jax.Array
  y: jax.Array


def amortised_problem(name: str) -> Problem:
  """step_time's model `name` and its amortised K-FAC (`step_time.methods`)."""
  m = step_time.methods(name)
  step = m.steps["kfac_amortised"]
  return Problem(name, m.loss_fn, m.grad_fn, m.txs["kfac_amortised"], step, jax.jit(step),
                 jax.jit(step, donate_argnums=(0, 1)), m.params, m.x, m.y)


def other_arrangement(pb: Problem, state, *args) -> dict[str, tuple]:
  """`{label: (compiled step, args)}` of `pb`'s K-FAC step in the
  preconditioning arrangement the platform does not use
  (`precondition.BATCH_RUNS`): off CPU one layer at a time, on CPU every run
  of equal-shape layers batched; empty where the model has no such run (the
  same program)."""
  lay = find_states(state)[0].layout
  if not any(len(run) > 1 for run in layout_lib.precondition_runs(lay, 0)):
    return {}
  on_cpu = jax.default_backend() == "cpu"
  label = ("kfac step plain, equal layers batched" if on_cpu
           else "kfac step plain, one layer at a time")
  precondition.BATCH_RUNS = on_cpu
  try:       # a new function: jax reuses the trace of `pb.step` (the default arrangement)
    compiled = jax.jit(lambda *a: pb.step(*a)).lower(*args).compile()
  finally:
    precondition.BATCH_RUNS = None
  return {label: (compiled, args)}


def plain_step_pieces(pb: Problem, reps: int) -> list[str]:
  sgd = optax.sgd(1e-2, momentum=0.9)
  sstep = jax.jit(_common.optax_step(pb.loss_fn, sgd))
  p1, s1 = pb.kstep(pb.params, pb.tx.init(pb.params), pb.x, pb.y)[:2]  # count 1: plain
  x, y = pb.x, pb.y
  _, _, stats = pb.grad_fn(p1, x, y, opt_state=s1)
  _, grads = jax.value_and_grad(pb.loss_fn)(p1, x, y)
  pieces = {
      "sgd step": (sstep, (pb.params, sgd.init(pb.params), x, y)),
      "jax.value_and_grad": (jax.jit(jax.value_and_grad(pb.loss_fn)), (p1, x, y)),
      "kd.value_and_grad plain": (
          jax.jit(lambda p, s, x, y: pb.grad_fn(p, x, y, opt_state=s)), (p1, s1, x, y)),
      "kfac tx.update plain": (
          jax.jit(lambda g, s, p, st: pb.tx.update(g, s, p, kfac_stats=st)),
          (grads, s1, p1, stats)),
      "kfac step plain": (pb.kstep, (p1, s1, x, y)),
      **other_arrangement(pb, s1, p1, s1, x, y),
  }
  lines = [f"{pb.name}: piece | ms | kernels (launching instructions) | top opcodes"]
  for label, (fn, args) in pieces.items():
    compiled = fn if isinstance(fn, jax.stages.Compiled) else fn.lower(*args).compile()
    census = kernel_census(compiled)
    top = ", ".join(f"{k} {v}" for k, v in census.most_common(6))
    lines.append(f"  {label} | {timed(fn, *args, reps=reps):.3f} | "
                 f"{sum(census.values())} | {top}")
  return lines


def step_kind(count: int) -> str:
  if count % INVERSE_EVERY == 0:
    return "eigh"
  if count % FACTOR_EVERY == 0:
    return "factor"
  return "plain after factor" if count % FACTOR_EVERY == 1 else "plain"


def sequence_times(step: Callable, params, state, pb: Problem, keep_states: bool):
  """Three cycles of consecutive amortised steps of `step`, each timed alone
  (blocked): ms by kind over the last two cycles, the inputs of the first step
  of each kind there (if `keep_states`: not for a step that donates them) and
  the last loss."""
  times: dict[str, list[float]] = collections.defaultdict(list)
  first_inputs = {}
  for count in range(3 * INVERSE_EVERY):          # the first cycle warms up
    kind = step_kind(count)
    if keep_states and count >= INVERSE_EVERY:   # (count 0's eigh sees one batch)
      first_inputs.setdefault(kind, (params, state))
    start = time.perf_counter()
    params, state, loss = jax.block_until_ready(step(params, state, pb.x, pb.y))
    if count >= INVERSE_EVERY:
      times[kind].append(1e3 * (time.perf_counter() - start))
  return times, first_inputs, float(loss)


def consecutive_profile(pb: Problem, reps: int) -> list[str]:
  """Two cycles of consecutive amortised steps, each timed alone (blocked), by
  kind: a plain loop, a loop whose step donates the parameters and the state
  (`donate_argnums=(0, 1)`, as training loops run it), and each kind repeated
  from one fixed state. Is a step slower in sequence than alone, and which?"""
  state0 = pb.tx.init(pb.params)
  in_sequence, fixed_states, loss = sequence_times(pb.kstep, pb.params, state0, pb, True)
  donated, _, loss_donated = sequence_times(pb.kstep_donated,
                                            *step_time.copies(pb.params, state0), pb, False)
  lines = [f"{pb.name}: consecutive steps, ms per step by kind (median; min-max) | "
           f"in sequence | in sequence, donated | alone, from one fixed state"]
  alone = {}
  for kind, times in in_sequence.items():
    p, s = fixed_states[kind]
    alone[kind] = timed(pb.kstep, p, s, pb.x, pb.y,
                        reps=max(3, reps // 10) if kind == "eigh" else reps)
    lines.append(f"  {kind} ({len(times)}) | {statistics.median(times):.3f} "
                 f"({min(times):.3f}-{max(times):.3f}) | "
                 f"{statistics.median(donated[kind]):.3f} | {alone[kind]:.3f}")
  mean = lambda by_kind: sum(sum(t) for t in by_kind.values()) / (2 * INVERSE_EVERY)
  weights = {"eigh": 1, "factor": INVERSE_EVERY // FACTOR_EVERY - 1,
             "plain after factor": INVERSE_EVERY // FACTOR_EVERY}
  weights["plain"] = INVERSE_EVERY - sum(weights.values())
  mix = sum(w * alone[k] for k, w in weights.items()) / INVERSE_EVERY
  lines.append(f"  mean per step in sequence {mean(in_sequence):.3f} ms, donated "
               f"{mean(donated):.3f} ms; cadence-weighted mean of the kinds alone "
               f"{mix:.3f} ms (final loss {loss:.4f}, donated {loss_donated:.4f})")
  return lines


# ------------------------------------------------------------------- trace

TRACED_STEPS = 40       # per method: K-FAC's counts 101..140 hold 4 factor steps
QUICK_TRACED_STEPS = 12  # --quick: counts 1..12 (after count 0's eigh), 1 factor step
# Idle seconds between traced steps (outside their timing): far wider than any
# wait inside a step (a GPU conditional's is about 70 us), so that `_runs` can
# split the trace at them where the kernels carry no run id.
STEP_GAP_S = 0.002


def op_sources(hlo_text: str) -> dict[str, str]:
  """Instruction name → the library file of its innermost `kfac_jax_dist`
  frame (`ir_census.instruction_sources`), "outside" for the loss, optax."""
  return {name: source.split(":")[0]
          for name, source in ir_census.instruction_sources(hlo_text).items()}


def _kernel_events(trace_dir: str) -> list[dict]:
  """The trace's kernel events of the step's program (`ir_census.MODULE`):
  the device's where the trace has a device process (a GPU), else the host
  threads' that ran the thunks (the CPU)."""
  events = _common.trace_events(trace_dir)
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  ours = [e for e in events if e.get("ph") == "X" and
          e.get("args", {}).get("hlo_module") == ir_census.MODULE and "hlo_op" in e["args"]]
  on_device = [e for e in ours if names.get(e["pid"], "").startswith("/device:")]
  return on_device or ours


def _busy_ms(events: list[dict]) -> float:
  """Milliseconds covered by the union of the events' intervals."""
  total, end = 0.0, float("-inf")
  for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
    total += max(0.0, stop - max(start, end))
    end = max(end, stop)
  return total / 1e3


def _runs(events: list[dict], steps: int) -> list[list[dict]]:
  """The events of each run of the program, in order: by their `run_id` (the
  CPU's thunks carry it) or, where that does not give `steps` runs, split at
  the `steps - 1` widest gaps between consecutive kernels (each step is
  blocked, so its kernels end before the next step is dispatched)."""
  by_id: dict[str, list[dict]] = collections.defaultdict(list)
  for e in events:
    by_id[e["args"].get("run_id", "")].append(e)
  if len(by_id) == steps:
    return sorted(by_id.values(), key=lambda run: min(e["ts"] for e in run))
  ordered = sorted(events, key=lambda e: e["ts"])
  if len(ordered) < steps:
    raise RuntimeError(f"the trace holds {len(ordered)} kernels of {ir_census.MODULE} "
                       f"for {steps} steps")
  ends = [ordered[0]["ts"] + ordered[0]["dur"]]
  for e in ordered[1:]:
    ends.append(max(ends[-1], e["ts"] + e["dur"]))
  gaps = sorted(range(1, len(ordered)), key=lambda i: ordered[i]["ts"] - ends[i - 1])
  cuts = [0] + sorted(gaps[len(gaps) - (steps - 1):] if steps > 1 else []) + [len(ordered)]
  return [ordered[a:b] for a, b in zip(cuts, cuts[1:])]


def traced_steps(step: Callable, params, state, pb: Problem, counts: range,
                 sources: dict[str, str]) -> list[dict]:
  """`step` (donating) chained over `counts`, each step blocked, under
  `jax.profiler`: per step its kind, wall ms, kernels, busy ms and kernel ms
  by source (`_runs`: the trace's runs of the program in order)."""
  walls = []
  trace_dir = tempfile.mkdtemp()
  try:
    with jax.profiler.trace(trace_dir):
      for _ in counts:
        start = time.perf_counter()
        params, state, _ = jax.block_until_ready(step(params, state, pb.x, pb.y))
        walls.append(1e3 * (time.perf_counter() - start))
        time.sleep(STEP_GAP_S)             # the steps' kernels apart in the trace
    events = _kernel_events(trace_dir)
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)
  steps = []
  for count, wall, run in zip(counts, walls, _runs(events, len(counts))):
    by_source: collections.Counter = collections.Counter()
    for e in run:
      by_source[sources.get(e["args"]["hlo_op"], "outside")] += e["dur"] / 1e3
    steps.append(dict(kind=step_kind(count), wall=wall, kernels=len(run),
                      busy=_busy_ms(run), by_source=by_source))
  return steps


def trace_table(pb: Problem, quick: bool = False) -> list[str]:
  """SGD's and K-FAC's plain steps from the trace (`traced_steps`), medians
  per step, side by side, and their difference (`quick`: fewer steps, and
  K-FAC's from count 1, its first cycle not run)."""
  n = QUICK_TRACED_STEPS if quick else TRACED_STEPS
  first = 1 if quick else INVERSE_EVERY + 1
  sgd = optax.sgd(1e-2, momentum=0.9)
  p, s = step_time.copies(pb.params, sgd.init(pb.params))
  plain = jax.jit(_common.optax_step(pb.loss_fn, sgd), donate_argnums=(0, 1)).lower(
      p, s, pb.x, pb.y).compile()
  for _ in range(3):
    p, s, _ = plain(p, s, pb.x, pb.y)
  jax.block_until_ready((p, s))          # no warm-up step runs into the trace
  sgd_steps = traced_steps(plain, p, s, pb, range(n), op_sources(plain.as_text()))
  p, s = step_time.copies(pb.params, pb.tx.init(pb.params))
  kfac = pb.kstep_donated.lower(p, s, pb.x, pb.y).compile()
  for _ in range(first):             # a whole cycle (or count 0's eigh), then plain steps
    p, s, _ = kfac(p, s, pb.x, pb.y)
  jax.block_until_ready((p, s))
  kfac_steps = [t for t in traced_steps(kfac, p, s, pb, range(first, first + n),
                                        op_sources(kfac.as_text()))
                if t["kind"].startswith("plain")]
  median = lambda steps, f: statistics.median(f(t) for t in steps)
  rows = [("wall ms", lambda t: t["wall"]), ("kernels", lambda t: t["kernels"]),
          ("device busy ms", lambda t: t["busy"]),
          ("device idle ms (wall - busy)", lambda t: t["wall"] - t["busy"])]
  totals: collections.Counter = collections.Counter()
  for t in kfac_steps:
    totals.update(t["by_source"])
  rows += [(f"kernel ms, {source}", lambda t, source=source: t["by_source"][source])
           for source, _ in totals.most_common(8)]
  lines = [f"{pb.name}: traced plain steps (jax.profiler; donated, consecutive, each "
           f"blocked; medians of {len(sgd_steps)} SGD and {len(kfac_steps)} K-FAC steps) "
           f"| SGD | K-FAC | K-FAC - SGD"]
  for label, f in rows:
    a, b = median(sgd_steps, f), median(kfac_steps, f)
    lines.append(f"  {label} | {a:.3f} | {b:.3f} | {b - a:+.3f}")
  return lines


def in_child(flag: str, *args: str) -> list[str]:
  """This script's output with `args`, run in a child process whose XLA_FLAGS
  add `flag` (XLA reads its flags once per process), less its first line."""
  cmd = [sys.executable, __file__, *args]
  run = subprocess.run(cmd, env=_common.env_with_xla_flags(flag), capture_output=True,
                       text=True, check=False)
  head = f"with XLA_FLAGS {flag}:"
  if run.returncode:
    return [head, f"  failed (exit {run.returncode}): " + run.stderr.strip()[-800:]]
  return [head] + ["  " + line for line in run.stdout.splitlines()[1:]]


def command_buffer_ab(models: str, reps: int) -> list[str]:
  """The consecutive-step profile in a child process with conditionals and
  loops in XLA's command buffers."""
  return in_child(COMMAND_BUFFER_FLAG, "--models", models, "--reps", str(reps),
                  "--profile-only")


def compile_table(models: list[str]) -> list[str]:
  """Trace + lower and XLA compile seconds of a fresh jit of SGD's and the
  amortised K-FAC's steps (`step_time.compile_time`), after one warm-up
  compile of a matmul and an eigh (a process's first compile pays for
  library set-up: on the H200 SGD's MLP step took 2.3 s, Adam's after it 0.7)."""
  warm = jax.jit(lambda a: jnp.linalg.eigh(a @ a.T)[0])
  jax.block_until_ready(warm(jnp.eye(8)))
  lines = ["compile s (trace + lower | XLA compile) of a fresh jit:"]
  for name in models:
    m = step_time.methods(name)
    for method in ("sgd", "kfac_amortised"):
      t = step_time.compile_time(m.steps[method], m.params, m.txs[method].init(m.params),
                                 m.x, m.y)
      lines.append(f"  {name} {method}: {t['lower_s']:.2f} | {t['compile_s']:.2f}")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="cnn,lm")
  parser.add_argument("--reps", type=int, default=50)
  parser.add_argument("--eigh", action="store_true", help="time the eigh table too")
  parser.add_argument("--command-buffer-ab", action="store_true",
                      help=f"the consecutive steps again with {COMMAND_BUFFER_FLAG}")
  parser.add_argument("--profile-only", action="store_true",
                      help="only the consecutive-step profile")
  parser.add_argument("--compile-ab", action="store_true",
                      help=f"only compile times: XLA's defaults, then {AUTOTUNE_OFF_FLAG}")
  parser.add_argument("--compile-only", action="store_true", help="only the compile times")
  parser.add_argument("--trace", action="store_true",
                      help="only the profiler's view of the plain steps, K-FAC against SGD")
  parser.add_argument("--quick", action="store_true", help="3 reps")
  args = parser.parse_args()
  reps = 3 if args.quick else args.reps
  print(f"# gpu_probe: backend {jax.default_backend()}, {jax.devices()[0].device_kind}",
        flush=True)
  models = [m for m in args.models.split(",") if m]
  if args.compile_only or args.compile_ab:
    print("\n".join(compile_table(models)), flush=True)
    if args.compile_ab:
      print("\n".join(in_child(AUTOTUNE_OFF_FLAG, "--models", args.models,
                                 "--compile-only")), flush=True)
    return
  if args.trace:
    for name in models:
      print("\n".join(trace_table(amortised_problem(name), args.quick)), flush=True)
    return
  for name in models:
    pb = amortised_problem(name)
    if not args.profile_only:
      print("\n".join(plain_step_pieces(pb, reps)), flush=True)
    print("\n".join(consecutive_profile(pb, reps)), flush=True)
  if args.command_buffer_ab:
    print("\n".join(command_buffer_ab(args.models, reps)), flush=True)
  if args.eigh:
    print("\n".join(eigh_table(max(3, reps // 5))), flush=True)


if __name__ == "__main__":
  main()
