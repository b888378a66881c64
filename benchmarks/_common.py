"""Shared pieces of the benchmarks.

* the library internals they read (one place to fix when the library moves
  them);
* `STRATEGIES` / `distribution` / `kfac_tx`: the distributed K-FAC
  configurations, and `problem`, the fixed `_models.CnnMlp` problem of
  comm_volume, memory and shampoo_memory;
* `sharded_step`: the shard_map'd training step (capture, gradient reduction,
  `tx.update`, `optax.apply_updates`), as in tests/test_distributed.py;
  `kfac_step` / `optax_step`: the plain jitted training steps; `kfac_state`;
  `per_device_bytes`;
* data: sklearn's digits (`digits`), character corpora (`pydoc_corpus`,
  `source_corpus`, `encode`, `windows`);
* `collectives`: every collective of a compiled HLO module, attributed to the
  steps it runs on (plain / factor / inverse) by walking the called
  computations from ENTRY, with ring-model and raw byte counts (`totals`,
  `step_bytes`);
* the report writer, re-exported from `_report` (`environment`, `header_md`,
  `md_table`, `fmt_bytes`, `checks_markdown`, `write_results`, ...).

The scripts import it from their own directory (`python benchmarks/x.py`).
Set XLA_FLAGS / OPENBLAS_NUM_THREADS before importing this module. It imports
nothing heavier than jax, flax, optax and kfac_jax_dist (scikit-learn when
`digits` is called).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import importlib
import inspect
import json
import re
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd
# The library internals the benchmarks read: layouts, the uneven collectives'
# plans, the stale-statistics order, Shampoo's roots. Every such import is
# here, so that a move inside the library is a fix in this one place.
from kfac_jax_dist.capture import registry  # noqa: F401
from kfac_jax_dist.capture import statistics as factors_lib  # noqa: F401
from kfac_jax_dist.core import uneven as uneven_lib  # noqa: F401
from kfac_jax_dist.kfac import layout as layout_lib  # noqa: F401
from kfac_jax_dist.kfac import stale as stale_lib  # noqa: F401
from kfac_jax_dist.kfac.layout import _second_parts as second_parts
from kfac_jax_dist.kfac.layout import cheaper_storage  # noqa: F401
from kfac_jax_dist.kfac.layout import gradient_offsets  # noqa: F401
from kfac_jax_dist.shampoo import roots as roots_lib  # noqa: F401

import _models
# The report writer, re-exported: the scripts' one import.
from _report import (add_quick, argument_parser, checks_markdown,  # noqa: F401
                     env_with_xla_flags, environment, fill_defaults, fmt_bytes,
                     header_md, md_table, steady_host_allocator, stem, write_json,
                     write_results)

# Every script here times jitted steps: the memory one step frees stays in the
# heap for the next, or glibc's page faults decide the ratios (PERF_NOTES §43).
steady_host_allocator()

FACTOR_SCOPE, DECOMP_SCOPE = "kfac_factor_update", "kfac_decomposition"
# The fault checks (04bba86): a 4-byte psum of the statistics' verdict inside a
# `lax.cond` on `update_factors` (factor steps), and, where the gradients may
# differ between devices (gradient_reduction != "none"), one every step.
FAULT_SCOPE = "kfac_fault_check"
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


# ---------------------------------------------------------------------- problem

MODEL_DESCRIPTION = (
    "CnnMlp: conv3x3 3→32, 4× conv3x3 32→32 (strides 1,2,1,2), global mean, dense "
    "32→256, 8 dense alternating 256→320 / 320→256, dense 256→10 (all with bias), "
    "one untagged scale[256]; 16x16x3 inputs, global batch 32")


MODEL12_DESCRIPTION = (
    "CnnMlp12: conv3x3 3→48, 48→64, 64→80 (stride 2), 3× conv3x3 80→80 (strides "
    "1,2,1), global mean, dense 80→256, 4× dense 256→256, dense 256→10 (all with "
    "bias); 16x16x3 inputs, global batch 32")


def trace_events(trace_dir: str) -> list[dict]:
  """The events of the `jax.profiler.trace` written under `trace_dir` (its
  Chrome trace: `ph` "X" events with `ts`, `dur` in µs and XLA's `args`)."""
  path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
  with gzip.open(path) as f:
    return json.load(f)["traceEvents"]


def problem(batch: int = 32, model: Any = None) -> tuple[Callable, Any, jax.Array, jax.Array]:
  """(loss_fn, params, x, y): `model` (default `_models.CnnMlp`) on a fixed
  random batch of 16x16x3 images."""
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (batch, 16, 16, 3), jnp.float32)
  y = jax.random.randint(ky, (batch,), 0, 10)
  model = _models.CnnMlp() if model is None else model
  params = model.init(kp, x)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)

  return loss_fn, params, x, y


# ------------------------------------------------------------------ strategies

@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  fraction: str            # "1", "1/P", "1/2", "1/4"
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
    if self.fraction == "1/4":
      return p // 4 if p >= 8 else None     # at P=4 1/4 is MEM-OPT
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
    Strategy("HYBRID m=2", "1/4", what="fraction 1/4, RS, sym"),
    Strategy("DP-KFAC", "1/P", "local", what="fraction 1/P, factor_reduction local"),
    Strategy("SP-NGD fused", "1/P", gradient_reduction="reduce_scatter",
             what="fraction 1/P, RS, sym, gradient_reduction reduce_scatter"),
)


def factor_places(plan) -> list:
  """The `FactorPlace`s of a layer plan (A and G; newer layouts list them as
  `plan.places`, e.g. one unit-wise factor)."""
  if hasattr(plan, "places"):
    return [place for _, place in plan.places]
  return [plan.a, plan.g]


def second_numbers(place, method: str) -> int:
  """Numbers of a factor's second-order state (eigenbasis and eigenvalues, or
  inverse) for `method`."""
  return sum(second_parts(place.dim, place.form, method))


def distribution(strategy: Strategy, p: int) -> kd.Distribution | None:
  m = strategy.group_size(p)
  if m is None:
    return None
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  return kd.Distribution(mesh, axis="data", grad_worker_fraction=m / p,
                         factor_reduction=strategy.factor_reduction,
                         gradient_reduction=strategy.gradient_reduction,
                         symmetric_comm=strategy.symmetric)


def device_counts(args: argparse.Namespace, default: str, quick: str = "8") -> list[int]:
  """The P values of `args.devices` (else `quick` with --quick, else
  `default`): comma-separated, at most the number of host devices."""
  ps = [int(v) for v in (args.devices or (quick if args.quick else default)).split(",")]
  if max(ps) > jax.device_count():
    raise SystemExit(f"need {max(ps)} devices, have {jax.device_count()} (XLA_FLAGS)")
  return ps


def kfac_tx(grad_fn, layers, dist, **extra):
  return kd.kfac(0.1, layers=layers, distribution=dist, damping=1e-2,
                 factor_update_every=10, inverse_update_every=100, **extra)


# ------------------------------------------------------------------------ steps

def kfac_step(grad_fn: kd.ValueAndGrad, tx: optax.GradientTransformation,
              adaptive: bool = False) -> Callable:
  """step(params, opt_state, *batch) → (params, opt_state, loss): capture,
  `tx.update` with the statistics (and the batch, for adaptive K-FAC),
  `optax.apply_updates`."""
  def step(params, opt_state, *batch):
    loss, grads, stats = grad_fn(params, *batch, opt_state=opt_state)
    extra = {"kfac_batch": batch} if adaptive else {}
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats, **extra)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def optax_step(loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
  """step(params, opt_state, *batch) → (params, opt_state, loss) of a
  first-order optimizer: `jax.value_and_grad`, `tx.update`, apply."""
  def step(params, opt_state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def kfac_state(opt_state: Any) -> kd.ScaleByKfacState:
  """The K-FAC state inside an optax state tree (the first, if several)."""
  is_state = lambda s: isinstance(s, kd.ScaleByKfacState)
  return next(s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state)
              if is_state(s))


def sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, gradient_reduction, *,
                 kfac: bool = True, donate: bool = False, param_specs: Any = P()):
  """(jitted shard_map'd step, global opt_state placed on the mesh); `donate`:
  the parameters and the state donated (as a training loop runs it);
  `param_specs`: the parameters' specs on a tensor-parallel mesh (a tree like
  them or a prefix; the batch is sharded over "data")."""
  opt_state = tx.init(params)
  if kfac:
    opt_state = kd.shard_state(opt_state, mesh)
    specs = kd.partition_specs(opt_state)
  else:
    specs = first_order_specs(opt_state, params, param_specs)

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

  fn = jax.jit(jax.shard_map(step, mesh=mesh,
                             in_specs=(param_specs, specs, P("data"), P("data")),
                             out_specs=(param_specs, specs)),
               donate_argnums=(0, 1) if donate else ())
  return fn, opt_state


def leaf_specs(param_specs: Any, params: Any) -> Any:
  """`param_specs` (a tree like the parameters or a prefix) as a full tree."""
  return jax.tree.map(lambda s, x: jax.tree.map(lambda _: s, x), param_specs, params,
                      is_leaf=lambda s: isinstance(s, P))


def first_order_specs(opt_state: Any, params: Any, param_specs: Any) -> Any:
  """Specs of a first-order optax state: every subtree shaped like the
  parameters (momentum, Adam's moments) gets `param_specs`, the rest `P()`."""
  full = leaf_specs(param_specs, params)
  treedef = jax.tree.structure(params)
  return jax.tree.map(
      lambda node: full if jax.tree.structure(node) == treedef else P(), opt_state,
      is_leaf=lambda node: jax.tree.structure(node) == treedef)


def _varying(tree):
  if hasattr(jax.lax, "pcast"):
    return jax.tree.map(lambda v: jax.lax.pcast(v, ("data",), to="varying"), tree)
  return jax.tree.map(lambda v: jax.lax.pvary(v, ("data",)), tree)


def per_device_bytes(tree: Any, devices: Sequence[Any]) -> list[int]:
  """Bytes of the tree's shards on each of `devices` (placed arrays), in order."""
  index = {d: i for i, d in enumerate(devices)}
  out = [0] * len(devices)
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      if shard.device in index:
        out[index[shard.device]] += shard.data.nbytes
  return out


# ------------------------------------------------------------------------- data

Split = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def digits(stratified: bool = False) -> Split:
  """scikit-learn's digits, `[N, 8, 8, 1]` in [0, 1] with int32 labels, as
  ((x_train, y_train), (x_test, y_test)): 1437 training and 360 test images.

  The split is one fixed shuffle (numpy's default_rng(0); the peer
  benchmarks), or with `stratified` `train_test_split(test_size=360,
  stratify=y, random_state=0)` (convergence, as examples/digits.py)."""
  # pylint: disable=import-outside-toplevel
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  d = load_digits()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  y = d.target.astype(np.int32)
  if stratified:
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, stratify=y,
                                              random_state=0)
    return (x_tr, y_tr), (x_te, y_te)
  perm = np.random.default_rng(0).permutation(len(y))
  x, y = x[perm], y[perm]
  return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def pydoc_corpus() -> str:
  """examples/transformer_lm.py's corpus: the pydoc help topics of this Python,
  joined in sorted order."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def source_corpus(modules: Iterable[str]) -> str:
  """The source files of these Python modules (`inspect.getsourcefile`),
  concatenated, characters outside printable ASCII and newline as '?'."""
  texts = []
  for name in modules:
    with open(inspect.getsourcefile(importlib.import_module(name)), encoding="utf-8") as f:
      texts.append(f.read())
  return "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in "".join(texts))


def encode(text: str, vocab: Sequence[str]) -> np.ndarray:
  """int32 ids of the characters of `text` in `vocab`."""
  lookup = {c: i for i, c in enumerate(vocab)}
  return np.fromiter((lookup[c] for c in text), np.int32, len(text))


def windows(ids: np.ndarray, n: int, batch: int, length: int,
            rng: np.random.Generator) -> np.ndarray:
  """[n, batch, length] windows of `ids` at starts drawn by
  `rng.integers(0, len(ids) - length, (n, batch))`."""
  starts = rng.integers(0, len(ids) - length, (n, batch))
  return ids[starts[..., None] + np.arange(length)]


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


def split_shape(rest: str) -> tuple[str, str]:
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
  shape, tail = split_shape(rest)
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
      tail = split_shape(rest)[1]
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
