"""Shared pieces of the benchmarks (the communication / memory / layout ones,
and the peers' and convergence runs' data and environment).

* `CnnMlp`: the fixed model of `comm_volume.py` and `memory.py` (kd.linen layers
  of several sizes plus one untagged parameter);
* `STRATEGIES` / `distribution`: the distributed K-FAC configurations;
* `sharded_step`: the shard_map'd training step (capture, gradient reduction,
  `tx.update`, `optax.apply_updates`), as in tests/test_distributed.py;
* `collectives`: every collective of a compiled HLO module, attributed to the
  steps it runs on (plain / factor / inverse) by walking the called
  computations from ENTRY, with ring-model and raw byte counts;
* `header`: jax version, date, git revision, machine.

The scripts import it from their own directory (`python benchmarks/x.py`).
Set XLA_FLAGS / OPENBLAS_NUM_THREADS before importing this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd

FACTOR_SCOPE, DECOMP_SCOPE = "kfac_factor_update", "kfac_decomposition"
# The fault checks (04bba86): a 4-byte psum of the statistics' verdict inside a
# `lax.cond` on `update_factors` (factor steps), and, where the gradients may
# differ between devices (gradient_reduction != "none"), one every step.
FAULT_SCOPE = "kfac_fault_check"
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


# ----------------------------------------------------------------------- model

class CnnMlp(nn.Module):
  """Conv 3x3 3→32, then 32→32 four times (strides 1, 2, 1, 2), global mean,
  Dense 32→256, eight Dense layers alternating 256→320 and 320→256, Dense
  256→10, one untagged per-feature scale (a passthrough parameter); ReLU, biases.

  Factor dimensions (A, G): (28, 32), 4×(289, 32), (33, 256), 4×(257, 320),
  4×(321, 256), (257, 10). Chosen so that no single layer holds more than 1/8 of
  the gradient and no factor more than 1/8 of the factor numbers: a layout
  with one owner per layer/factor can then in principle reach the P = 8
  targets (the scripts print these lower bounds)."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(32, (3, 3))(x))
    for stride in (1, 2, 1, 2):
      x = nn.relu(kd.linen.Conv(32, (3, 3), strides=stride)(x))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.relu(kd.linen.Dense(256)(x))
    for i in range(8):
      x = nn.relu(kd.linen.Dense(320 if i % 2 == 0 else 256)(x))
      if i == 3:
        x = x * self.param("scale", nn.initializers.ones, (256,))
    return kd.linen.Dense(10)(x)


MODEL_DESCRIPTION = (
    "CnnMlp: conv3x3 3→32, 4× conv3x3 32→32 (strides 1,2,1,2), global mean, dense "
    "32→256, 8 dense alternating 256→320 / 320→256, dense 256→10 (all with bias), "
    "one untagged scale[256]; 16x16x3 inputs, global batch 32")


def problem(batch: int = 32):
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (batch, 16, 16, 3), jnp.float32)
  y = jax.random.randint(ky, (batch,), 0, 10)
  model = CnnMlp()
  params = model.init(kp, x)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)

  return loss_fn, params, x, y


# ------------------------------------------------------------------ strategies

@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  fraction: str            # "1", "1/P", "1/2"
  factor_reduction: str = "reduce_scatter"
  gradient_reduction: str = "none"
  symmetric: bool = True
  what: str = ""

  def group_size(self, p: int) -> int | None:
    if self.fraction == "1":
      return p
    if self.fraction == "1/P":
      return 1
    if self.fraction == "1/2":
      return p // 2 if p >= 4 else None     # at P=2 1/2 is MEM-OPT
    raise ValueError(self.fraction)


STRATEGIES = (
    Strategy("COMM-OPT", "1", what="fraction 1, RS, sym"),
    Strategy("COMM-OPT AR full (KAISA)", "1", "all_reduce", symmetric=False,
             what="fraction 1, all_reduce of full factors"),
    Strategy("COMM-OPT AR sym", "1", "all_reduce", what="fraction 1, all_reduce, sym"),
    Strategy("COMM-OPT RS full", "1", symmetric=False, what="fraction 1, RS, full"),
    Strategy("MEM-OPT", "1/P", what="fraction 1/P, RS, sym"),
    Strategy("MEM-OPT AR full (KAISA)", "1/P", "all_reduce", symmetric=False,
             what="fraction 1/P, all_reduce of full factors"),
    Strategy("MEM-OPT AR sym", "1/P", "all_reduce", what="fraction 1/P, all_reduce, sym"),
    Strategy("MEM-OPT RS full", "1/P", symmetric=False, what="fraction 1/P, RS, full"),
    Strategy("HYBRID", "1/2", what="fraction 1/2, RS, sym"),
    Strategy("DP-KFAC", "1/P", "local", what="fraction 1/P, factor_reduction local"),
    Strategy("SP-NGD fused", "1/P", gradient_reduction="reduce_scatter",
             what="fraction 1/P, RS, sym, gradient_reduction reduce_scatter"),
)
QUICK = ("COMM-OPT", "COMM-OPT AR full (KAISA)", "MEM-OPT", "HYBRID", "DP-KFAC",
         "SP-NGD fused")


def factor_places(plan) -> list:
  """The `FactorPlace`s of a layer plan (A and G; newer layouts list them as
  `plan.places`, e.g. one unit-wise factor)."""
  if hasattr(plan, "places"):
    return [place for _, place in plan.places]
  return [plan.a, plan.g]


def distribution(strategy: Strategy, p: int) -> kd.Distribution | None:
  m = strategy.group_size(p)
  if m is None:
    return None
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  return kd.Distribution(mesh, axis="data", grad_worker_fraction=m / p,
                         factor_reduction=strategy.factor_reduction,
                         gradient_reduction=strategy.gradient_reduction,
                         symmetric_comm=strategy.symmetric)


def kfac_tx(grad_fn, layers, dist, **extra):
  return kd.kfac(0.1, layers=layers, distribution=dist, damping=1e-2,
                 factor_update_every=10, inverse_update_every=100, **extra)


def sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, gradient_reduction, *,
                 kfac: bool = True):
  """(jitted shard_map'd step, global opt_state placed on the mesh)."""
  opt_state = tx.init(params)
  if kfac:
    opt_state = kd.shard_state(opt_state, mesh)
    specs = kd.partition_specs(opt_state)
  else:
    specs = jax.tree.map(lambda _: P(), opt_state)

  def step(params, opt_state, x, y):
    if kfac:
      _, grads, stats = grad_fn(params, x, y, opt_state=opt_state)
      if gradient_reduction == "none":
        grads = jax.lax.pmean(grads, "data")
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    else:
      # Local gradients (params cast to varying, as kd.value_and_grad does:
      # otherwise autodiff inserts its own psum), then the data-parallel mean.
      grads = jax.grad(loss_fn)(_varying(params), x, y)
      grads = jax.lax.pmean(grads, "data")
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                             out_specs=(P(), specs)))
  return fn, opt_state


def _varying(tree):
  if hasattr(jax.lax, "pcast"):
    return jax.tree.map(lambda v: jax.lax.pcast(v, ("data",), to="varying"), tree)
  return jax.tree.map(lambda v: jax.lax.pvary(v, ("data",)), tree)


# -------------------------------------------------------------- HLO collectives

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape ("f32[2,3]{1,0}", tuples summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    n = 1
    for d in (dims.split(",") if dims else []):
      n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return total


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[2]{0}, f32[]) all-reduce(...)...' → (shape, 'all-reduce(...)...')."""
  rest = rest.strip()
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].strip()
  shape, _, tail = rest.partition(" ")
  return shape, tail.strip()


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape ('((f32[2]), f32[3])' → ['(f32[2])',
  'f32[3]']); a non-tuple shape is its own one element."""
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    depth += ch in "({["
    depth -= ch in ")}]"
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(shape[start:i].strip())
      start = i + 1
  return [p for p in parts if p]


def opcode(tail: str) -> str:
  """The opcode of an instruction's text after its shape ('all-reduce(...)')."""
  return tail.split("(", 1)[0].strip()


def op_name(tail: str) -> str:
  """The instruction's metadata op_name (the jax named scopes), or ''."""
  m = _OP_NAME.search(tail)
  return m.group(1) if m else ""


def branch_names(tail: str) -> list[str]:
  """A conditional's branch computations, in index order: `branch_computations`,
  or [false, true] for a predicated `true_computation` / `false_computation`."""
  branches = _BRANCHES.search(tail)
  if branches:
    return [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
  f = re.search(r"false_computation=%?([\w.\-]+)", tail)
  t = re.search(r"true_computation=%?([\w.\-]+)", tail)
  return [f.group(1), t.group(1)]


def called_names(tail: str) -> list[str]:
  """The computations a non-conditional instruction calls (fusions, loops'
  body and condition, async wrappers, reductions' `to_apply`)."""
  names = _CALLED.findall(tail)
  m = re.search(r"called_computations=\{([^}]*)\}", tail)
  if m:
    names += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
  return names


def _group_size(attrs: str, default: int) -> int:
  m = re.search(r"replica_groups=\{\{([0-9, ]*)\}", attrs)
  if m:
    return len([t for t in m.group(1).split(",") if t.strip()])
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
  if m:
    return int(m.group(1).split(",")[-1])
  return default


@dataclasses.dataclass
class Collective:
  kind: str
  step: str            # "every" | "factor" | "inverse"
  group: int
  payload: int         # bytes of the logical buffer: AR N, RS input, AG output, ...
  ring: float          # bytes sent per device, ring model
  op_name: str
  name: str
  in_loop: bool = False
  senders: tuple[int, ...] | None = None   # collective-permute: devices that send

  @property
  def fault_check(self) -> bool:
    """A psum of the K-FAC fault check (4 bytes), not factor or gradient traffic."""
    return FAULT_SCOPE in self.op_name


def parse_computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
  """({computation: [(instruction name, text after '=')]}, ENTRY's name)."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    head = _COMP_HEAD.match(line)
    if head and not line.startswith(" "):
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    m = _INSTR.match(line)
    if m:
      comps[current].append((m.group(1), m.group(2)))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


def _output_bytes(shape: str, code: str, base: str) -> int:
  """Bytes of a collective's result. A synchronous op's shape is its result, and
  so is all-reduce-start's; the other async starts' shapes are (operand(s),
  result(s), context...): all-gather-start, collective-permute-start, and the
  async wrappers printed as reduce-scatter-start / all-to-all-start."""
  if not code.endswith("-start") or base == "all-reduce":
    return shape_bytes(shape)
  parts = tuple_elements(shape)
  return shape_bytes(parts[1] if len(parts) > 1 else parts[0])


def _collective(name: str, rest: str, step: str, in_loop: bool, p: int):
  shape, tail = _split_shape(rest)
  code = opcode(tail)
  base = code[:-len("-start")] if code.endswith("-start") else code
  if base not in KINDS:
    return None
  g = _group_size(tail, p)
  out = _output_bytes(shape, code, base)
  if base == "all-reduce":
    payload, ring = out, 2 * (g - 1) / g * out
  elif base == "reduce-scatter":
    payload = out * g
    ring = (g - 1) / g * payload
  elif base in ("all-gather", "all-to-all"):
    payload, ring = out, (g - 1) / g * out
  else:                                    # collective-permute
    payload, ring = out, float(out)
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", tail)
  senders = (tuple(int(a) for a, _ in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))
             if base == "collective-permute" and pairs else None)
  return Collective(base, step, g, payload, ring, op_name(tail), name, in_loop, senders)


def _scope_step(name: str) -> str | None:
  """The step kind a conditional's non-identity branches run on, from the
  conditional's op_name, or None when it is no cadence conditional."""
  if DECOMP_SCOPE in name:
    return "inverse"
  if FACTOR_SCOPE in name or FAULT_SCOPE in name:
    return "factor"
  return None


def collectives(hlo: str, num_devices: int) -> tuple[list[Collective], list[str]]:
  """Every collective reachable from ENTRY, with the steps it runs on.

  A `conditional` whose op_name holds `kfac_factor_update` (`kfac_decomposition`)
  runs its non-identity branch on factor (inverse) steps only: collectives in
  its branches ≥ 1 (the `true` branch of a `lax.cond`) are attributed to that
  step kind. So is the fault check's conditional (`kfac_fault_check`), whose
  predicate is the state's `update_factors`: its psum runs on factor steps.
  Any other conditional (e.g. a `lax.switch` on the device index) runs one
  branch every step: the branch with the most bytes is counted. Collectives
  in a while loop's body or condition are marked `in_loop` (counted once).
  An async op's wrapped computation is walked from its start only.
  Returns (collectives, notes)."""
  comps, entry = parse_computations(hlo)
  notes: list[str] = []
  memo: dict[tuple[str, str, bool], list[Collective]] = {}

  def conditional(name: str, tail: str, step: str, in_loop: bool) -> list[Collective]:
    names, scope = branch_names(tail), op_name(tail)
    label = _scope_step(scope)
    if label is not None:
      if walk(names[0], label, in_loop):
        scoped = DECOMP_SCOPE if label == "inverse" else FACTOR_SCOPE
        notes.append(f"{name}: collectives in the identity (false) branch of the "
                     f"{scoped} conditional")
      return [c for b in names[1:] for c in walk(b, label, in_loop)]
    per_branch = [walk(b, step, in_loop) for b in names]
    if sum(1 for cs in per_branch if cs) > 1:
      notes.append(f"{name}: collectives in several branches of {scope or name}; "
                   "counted the largest")
    return max(per_branch, key=lambda cs: sum(c.ring for c in cs))

  def walk(comp: str, step: str, in_loop: bool) -> list[Collective]:
    key = (comp, step, in_loop)
    if key in memo:
      return memo[key]
    found: list[Collective] = []
    for name, rest in comps.get(comp, []):
      c = _collective(name, rest, step, in_loop, num_devices)
      if c is not None:
        found.append(c)
      tail = _split_shape(rest)[1]
      code = opcode(tail)
      if code == "conditional":
        found += conditional(name, tail, step, in_loop)
        continue
      if code in ("async-update", "async-done"):
        continue                           # the async-start's computation, once
      for called in called_names(tail):
        if called in comps:
          found += walk(called, step, in_loop or code == "while")
    memo[key] = found
    return found

  found = walk(entry, "every", False)
  if any(c.in_loop for c in found):
    notes.append("collectives inside while loops (counted once per step)")
  return found, notes


def fault_bytes(found: list[Collective], step: str) -> float:
  """Ring bytes per device of the fault-check psums that run on `step` only."""
  return sum(c.ring for c in found if c.step == step and c.fault_check)


def totals(found: list[Collective]) -> dict[str, dict[str, dict[str, float]]]:
  """{step kind: {collective kind: {"ring", "payload", "count"}}} for the
  collectives that run on that kind of step only (fault-check psums included:
  see `fault_bytes`). Point-to-point sends (collective-permute) differ by
  device: their "ring" is the most any one device sends in them."""
  out = {s: {k: {"ring": 0.0, "payload": 0, "count": 0} for k in KINDS}
         for s in ("every", "factor", "inverse")}
  sent: dict[str, dict[int, float]] = {s: {} for s in out}
  for c in found:
    t = out[c.step][c.kind]
    if c.senders is not None:
      for d in c.senders:
        sent[c.step][d] = sent[c.step].get(d, 0.0) + c.ring
    else:
      t["ring"] += c.ring
    t["payload"] += c.payload
    t["count"] += 1
  for step, by_device in sent.items():
    out[step]["collective-permute"]["ring"] += max(by_device.values(), default=0.0)
  return out


def step_bytes(tot, which: str, field: str = "ring") -> float:
  """Bytes per device of a whole step: plain = every-step collectives; factor =
  plain + factor-update; inverse = factor + decomposition (an inverse step is
  also a factor step with the usual cadences)."""
  parts = {"plain": ("every",), "factor": ("every", "factor"),
           "inverse": ("every", "factor", "inverse")}[which]
  return float(sum(tot[s][k][field] for s in parts for k in KINDS))


# ------------------------------------------------------------------------ misc

def digits():
  """scikit-learn's digits, `[N, 8, 8, 1]` in [0, 1]: one fixed shuffle, 1437
  training and 360 test images (the peer benchmarks' split)."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  d = load_digits()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  y = d.target.astype(np.int32)
  perm = np.random.default_rng(0).permutation(len(y))
  x, y = x[perm], y[perm]
  return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def library_commit() -> str:
  """The short commit of the imported kfac_jax_dist, "+local changes" if its
  tracked files differ from it."""
  def git(*a):
    try:
      return subprocess.run(["git", *a], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(kd.__file__))).stdout.strip()
    except OSError:
      return ""
  commit = git("rev-parse", "--short", "HEAD")
  if commit and git("status", "--porcelain", "--untracked-files=no", "."):
    commit += "+local changes"
  return commit


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def header() -> dict[str, Any]:
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "kfac_jax_dist"],
                           capture_output=True, text=True,
                           cwd=os.path.join(os.path.dirname(__file__), "..")).stdout.strip()
  except OSError:
    rev, dirty = "?", ""
  return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "git": rev + (" (kfac_jax_dist modified)" if dirty else ""),
          "machine": f"{platform.machine()}, {os.cpu_count()} cores",
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def header_md(h: dict[str, Any]) -> str:
  return (f"- date {h['date']}; jax {h['jax']} ({h['backend']}); kfac_jax_dist at git "
          f"{h['git']}; {h['machine']}; XLA_FLAGS=`{h['xla_flags']}`")


def md_table(rows: list[list[Any]], head: list[str]) -> str:
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    lines.append("| " + " | ".join(str(c) for c in r) + " |")
  return "\n".join(lines)


def fmt_bytes(b: float) -> str:
  if b == 0:
    return "0"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(b) >= scale:
      return f"{b / scale:.3g} {unit}"
  return f"{b:.0f} B"


def write_results(out_dir: str, stem: str, text: str, payload: dict[str, Any]) -> None:
  """Writes `<stem>.md` (the printed table) and `<stem>.json` (raw numbers)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, stem + ".md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out_dir, stem + ".json"), "w") as f:
    json.dump(payload, f, indent=1, default=str)


def checks_markdown(title: str, checks: list[dict[str, Any]]) -> list[str]:
  """The targets table shared by the benchmarks: check, measured, target, holds, why."""
  if not checks:
    return []
  rows = [[c["check"], c["value"], c["target"], "yes" if c["holds"] else "**no**",
           c["why"]] for c in checks]
  return [f"## {title}", "", md_table(rows, ["check", "measured", "target", "holds", "why"]),
          ""]


def argument_parser(doc: str):
  """argparse with the script's docstring: first paragraph as description."""
  return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 1)[1])
