"""Optimizer-state bytes per device for every distribution strategy.

Same model as comm_volume.py (`_common.CnnMlp`). For P = 1, 2, 4, 8 host
devices and each strategy, the state of `kd.kfac(...)` (scale_by_kfac,
add_decayed_weights, sgd with momentum) is built with `tx.init` and placed
with `kd.shard_state`; the bytes of every leaf's shard on each device are
summed from the placed arrays (`addressable_shards`): the K-FAC state alone
(`ScaleByKfacState`: counters, running factors, second-order state) and the
whole optax state. Reported: device 0 and the max over devices, the global
(logical, unreplicated) size of the K-FAC state, and the ideal per-device
share (Σ stored factor numbers + Σ second-order numbers)·4 B / P.

"ideal" is the padding-free per-device size for the strategy: Σ stored /
P + Σ second-order / G (G = P/m owner groups).

Factor storage follows `symmetric_comm` (upper triangles when on), so the
"full" rows store d² per factor. Running factors (`Layout.factor_storage`):
with factor_reduction="reduce_scatter" (COMM-OPT, MEM-OPT, HYBRID, SP-NGD
fused, and one device) the transform picks at init (`kfac.layout.cheaper_storage`,
69e5d57) the storage that sends fewer bytes for the cadence (here 10/100,
k = 10): tight chunks when L/C > 1 + 1/k — the owners' factors form one tight
buffer of T numbers cut into P chunks of C = ⌈T/P⌉, one per device
("chunked": T/P per device whatever the factor sizes) — else owner segments
like "local" (DP-KFAC) and "all_reduce": each device holds its own factors,
zero-padded to the longest owner's L ("owner"). So the memory follows the
bytes: owner segments cost at most (1 + 1/k)·C per device. The K-FAC state
also holds the scalar counters (count, factor_weight, update_factors and,
since 04bba86, `skipped`).
The second-order state is always per owner, [L₂] per device, L₂ the longest
owner's (replicated over the m devices of a group). Target: at P = 8, MEM-OPT's K-FAC state per
device <= 1.15 × (COMM-OPT's total K-FAC state / 8).

Usage: python benchmarks/memory.py [--quick] [--devices 1,2,4,8] [--out DIR]
(--quick: P = 8 only; writes memory_quick.*).

Peak memory of a step (issue 16): on one device, each step_time model's SGD
step and amortised K-FAC step compiled with params and state donated; XLA's
memory analysis against SGD's peak + the K-FAC state + the largest layer's
eigendecomposition workspace (`step_peaks`; --quick: the MLP only). With P = 8
(not --quick), the same for the ResNet-50-shaped model's shard_map'd step on 8
host devices, per device, MEM-OPT and COMM-OPT (`resnet_peaks`, compiled only:
about a minute on 2 cores).

Building the state on the mesh (`init_rows`, also --quick: MEM-OPT only):
`kd.init_sharded` (jit of `tx.init` with the specs as out_shardings) of K-FAC
and Shampoo on ResNet-50's shapes at P = 8, compiled only: XLA's temporaries
per device against the device's shard (target <= 0.5x).

"+ EK-FAC" rows: the same strategy with `eigenvalue_correction="ekfac"`: its
state adds the replicated scaling `s` (Σ d_A·d_G numbers, gradient-sized) and,
with several owner groups, every owner's second-order segment gathered for the
capture ([P·L₂], as COMM-OPT holds it); "ideal" adds them padding-free.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402  (standard library only: before jax starts)

_report.host_devices(8)

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd

import _common as C  # noqa: E402
import _models  # noqa: E402

# Also measured with eigenvalue_correction="ekfac" (issue 15).
EKFAC_STRATEGIES = ("COMM-OPT", "MEM-OPT", "HYBRID")
MEMORY_STRATEGIES = ("COMM-OPT", "COMM-OPT AR full (KAISA)", "COMM-OPT RS full", "MEM-OPT",
                     "MEM-OPT RS full",
                     "HYBRID", "DP-KFAC", "SP-NGD fused")


def global_bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def useful_numbers(lay) -> tuple[int, int]:
  stored = second = 0
  for pl in lay.plans:
    for f in C.factor_places(pl):
      stored += f.size
      second += C.second_numbers(f, lay.method)
  return stored, second


def correction_numbers(kstate, second: int) -> int:
  """EK-FAC's replicated numbers per device, padding-free: the scaling `s` of
  every corrected layer, and with several owner groups every owner's
  eigenbases once (gathered for the capture)."""
  if kstate.correction is None:
    return 0
  return kstate.correction.scaling.size + (second if kstate.layout.num_groups > 1 else 0)


def measure(p: int, names) -> list[dict]:
  loss_fn, params, x, y = C.problem()
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  devices = jax.devices()[:p]
  mesh = Mesh(np.array(devices), ("data",))
  rows = []
  for name, tx in (("SGD (momentum 0.9)", optax.sgd(0.1, momentum=0.9)),
                   ("Adam", optax.adam(1e-3))):
    state = jax.device_put(tx.init(params), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    dev = C.per_device_bytes(state, devices)
    rows.append({"P": p, "strategy": name, "m": None, "kfac_dev0": 0, "kfac_max": 0,
                 "kfac_global": 0, "ideal": 0, "share": 0, "total_dev0": dev[0],
                 "total_max": max(dev), "layout": {}})
  variants = [(strat, "") for strat in C.STRATEGIES] + [
      (strat, " + EK-FAC") for strat in C.STRATEGIES if strat.name in EKFAC_STRATEGIES]
  for strat, suffix in variants:
    if strat.name not in names or strat.group_size(p) is None:
      continue
    if p == 1 and strat.name not in ("COMM-OPT", "COMM-OPT RS full"):
      continue                                  # every strategy is the same at P=1
    dist = C.distribution(strat, p)
    tx = C.kfac_tx(grad_fn, layers, dist,
                   **({"eigenvalue_correction": "ekfac"} if suffix else {}))
    state = kd.shard_state(tx.init(params), mesh)
    kstate = C.kfac_state(state)
    kdev = C.per_device_bytes(kstate, devices)
    tdev = C.per_device_bytes(state, devices)
    lay = kstate.layout
    stored, second = useful_numbers(lay)
    name = strat.name if p > 1 else strat.name.replace("COMM-OPT", "one device")
    rows.append({
        "P": p, "strategy": name + suffix,
        "m": lay.group_size, "kfac_dev0": kdev[0], "kfac_max": max(kdev),
        "kfac_per_device": kdev, "kfac_global": global_bytes(kstate),
        "ideal": (stored / p + second / lay.num_groups
                  + correction_numbers(kstate, second)) * 4,
        "share": (stored + second) * 4 / p, "total_dev0": tdev[0], "total_max": max(tdev),
        "layout": {"L": lay.segment, "L2": lay.second_segment, "G": lay.num_groups,
                   "storage": lay.factor_storage, "C": lay.factor_shard,
                   "stored": stored, "second": second,
                   "factors_dev": int(kstate.factors.addressable_shards[0].data.nbytes),
                   "second_dev": int(kstate.second_order.addressable_shards[0].data.nbytes),
                   "scalars_dev": kdev[0]
                   - int(kstate.factors.addressable_shards[0].data.nbytes)
                   - int(kstate.second_order.addressable_shards[0].data.nbytes)}})
    print(f"  P={p} {name + suffix:32s} K-FAC/device {C.fmt_bytes(max(kdev)):>9s} "
          f"whole state {C.fmt_bytes(max(tdev)):>9s}", flush=True)
  return rows


# ------------------------------------------------------- peak memory of a step

def step_peak(step, params, state, x, y) -> dict:
  """XLA's memory analysis of `step` compiled with the parameters and the
  optimizer state donated (as a training loop runs it): peak = arguments +
  outputs − aliased + temporaries."""
  stats = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x, y).compile(
      ).memory_analysis()
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  return {"peak": int(peak), "temp": int(stats.temp_size_in_bytes)}


def decomposition_workspace(lay) -> int:
  """The largest layer's eigendecomposition workspace, bytes: per full factor
  of dimension d its copy and its eigenvectors (2d²) and LAPACK syevd's work
  array (1 + 6d + 2d²), float32."""
  def layer(plan) -> int:
    return sum(4 * d * d + 6 * d + 1 for d in (f.dim for f in C.factor_places(plan)
                                                if f.form == "full"))
  return 4 * max((layer(plan) for plan in lay.plans), default=0)


def step_peaks(models) -> list[dict]:
  """Issue 16's memory check on the step_time models (one device): the
  amortised K-FAC step's peak ≤ SGD's peak + the K-FAC state + one layer's
  decomposition workspace."""
  rows = []
  for name in models:
    model, params, x, y, _ = _models.step_problem(name)

    def loss_fn(p, x, y, model=model):
      return kd.losses.softmax_cross_entropy(model.apply(p, x), y)
    grad_fn = kd.value_and_grad(loss_fn)
    sgd = optax.sgd(1e-2, momentum=0.9)
    kfac = kd.kfac(1e-2, layers=grad_fn.discover(params, x, y), factor_update_every=10,
                   inverse_update_every=100)
    copy = lambda t: jax.tree.map(jnp.copy, t)
    first = step_peak(C.optax_step(loss_fn, sgd), copy(params), sgd.init(params), x, y)
    kstate = kfac.init(params)
    second = step_peak(C.kfac_step(grad_fn, kfac), copy(params), kstate, x, y)
    state_bytes = global_bytes(C.kfac_state(kstate))
    work = decomposition_workspace(C.kfac_state(kstate).layout)
    bound = first["peak"] + state_bytes + work
    rows.append({"model": name, "sgd_peak": first["peak"], "kfac_peak": second["peak"],
                 "sgd_temp": first["temp"], "kfac_temp": second["temp"],
                 "kfac_state": state_bytes, "workspace": work, "bound": bound,
                 "holds": second["peak"] <= bound})
    print(f"  {name}: SGD peak {C.fmt_bytes(first['peak'])}, K-FAC peak "
          f"{C.fmt_bytes(second['peak'])}, bound {C.fmt_bytes(bound)}", flush=True)
  return rows


RESNET_IMAGE, RESNET_PER_DEVICE = 224, 4       # images per device (compiled, never run)
RESNET_STRATEGIES = ("MEM-OPT", "COMM-OPT")


def memory_peak(stats) -> int:
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def resnet_peaks(p: int = 8, names=RESNET_STRATEGIES) -> list[dict]:
  """Issue 16's memory check on the ResNet-50-shaped model (`_models.ResNet50`,
  BatchNorm untagged with running averages) at P devices: the per-device peak
  of the data-parallel SGD step (momentum, gradients averaged by `pmean`) and
  of the K-FAC step under each strategy, both shard_map'd
  (`_common.sharded_step`) with the parameters and state donated, compiled
  (never run) on P host devices; XLA's memory analysis of an SPMD program is
  per device."""
  model = _models.ResNet50()
  variables = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  params, batch_stats = variables["params"], variables["batch_stats"]

  def loss_fn(q, x, y):
    return kd.losses.softmax_cross_entropy(
        model.apply({"params": q, "batch_stats": batch_stats}, x), y)
  grad_fn = kd.value_and_grad(loss_fn)
  n = p * RESNET_PER_DEVICE
  x = jax.ShapeDtypeStruct((n, RESNET_IMAGE, RESNET_IMAGE, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)
  layers = []
  jax.eval_shape(lambda q, a, b: layers.append(grad_fn.discover(q, a, b)) or 0.0,
                 params, x, y)
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  devices = list(mesh.devices.flat)

  def compiled(tx, **kw):
    t0 = time.perf_counter()
    fn, state = C.sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, "none",
                               donate=True, **kw)
    stats = fn.lower(params, state, x, y).compile().memory_analysis()
    return memory_peak(stats), state, time.perf_counter() - t0
  sgd_peak, _, sgd_s = compiled(optax.sgd(1e-2, momentum=0.9), kfac=False)
  rows = []
  for strat in C.STRATEGIES:
    if strat.name not in names:
      continue
    tx = C.kfac_tx(grad_fn, layers[0], C.distribution(strat, p))
    peak, state, secs = compiled(tx, kfac=True)
    kstate = C.kfac_state(state)
    state_dev = max(C.per_device_bytes(kstate, devices))
    work = decomposition_workspace(kstate.layout)
    bound = sgd_peak + state_dev + work
    rows.append({"model": f"resnet50 P={p} {strat.name}", "sgd_peak": sgd_peak,
                 "kfac_peak": peak, "kfac_state": state_dev, "workspace": work,
                 "bound": bound, "holds": peak <= bound, "compile_s": secs + sgd_s})
    print(f"  resnet50 P={p} {strat.name}: SGD peak {C.fmt_bytes(sgd_peak)}, K-FAC peak "
          f"{C.fmt_bytes(peak)}, bound {C.fmt_bytes(bound)} ({secs:.0f} s)", flush=True)
  return rows


INIT_STRATEGIES = (("MEM-OPT", 1 / 8), ("HYBRID", 1 / 2), ("COMM-OPT", 1.0))


def init_rows(p: int = 8, names=INIT_STRATEGIES) -> list[dict]:
  """`kd.init_sharded` (`jax.jit(tx.init, out_shardings=...)`) of K-FAC and
  Shampoo (blocks of 128) on the ResNet-50-shaped model at P devices, compiled
  (never run): XLA's temporaries per device against the device's shard of the
  whole optax state (the chain's momentum included)."""
  model = _models.ResNet50()
  x = jax.ShapeDtypeStruct((p, RESNET_IMAGE, RESNET_IMAGE, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((p,), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  params, layers = variables["params"], []

  def discover(q, batch_stats, a, b):
    grad_fn = kd.value_and_grad(lambda q, a, b: kd.losses.softmax_cross_entropy(
        model.apply({"params": q, "batch_stats": batch_stats}, a), b))
    layers.append(grad_fn.discover(q, a, b))
    return 0.0
  jax.eval_shape(discover, params, variables["batch_stats"], x, y)
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  rows = []
  for name, fraction in names:
    dist = kd.Distribution(mesh, grad_worker_fraction=fraction)
    for method, tx in (("K-FAC", kd.kfac(0.1, momentum=0.9, layers=layers[0],
                                         distribution=dist)),
                       ("Shampoo", kd.shampoo(0.1, block_size=128, distribution=dist))):
      shapes = jax.eval_shape(tx.init, params)
      shardings = jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s),
                                         kd.partition_specs(shapes),
                                         is_leaf=lambda s: isinstance(s, P))
      t0 = time.perf_counter()
      stats = jax.jit(tx.init, out_shardings=shardings).lower(params).compile(
          ).memory_analysis()
      shard = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                  for a, s in zip(jax.tree_util.tree_leaves(shapes),
                                  jax.tree_util.tree_leaves(shardings)))
      rows.append({"method": method, "strategy": name, "shard": shard,
                   "temp": stats.temp_size_in_bytes, "compile_s": time.perf_counter() - t0,
                   "holds": stats.temp_size_in_bytes <= 0.5 * shard})
      print(f"  init {method} {name}: shard {C.fmt_bytes(shard)}, temporaries "
            f"{C.fmt_bytes(stats.temp_size_in_bytes)}", flush=True)
  return rows


def render_init(rows) -> list[str]:
  if not rows:
    return []
  table = [[r["method"], r["strategy"], C.fmt_bytes(r["shard"]), C.fmt_bytes(r["temp"]),
            f"{r['temp'] / r['shard']:.3f}", f"{r['compile_s']:.1f}",
            "yes" if r["holds"] else "**no**"] for r in rows]
  return ["", "## Building the state on the mesh (`kd.init_sharded`)", "",
          "ResNet-50's shapes (`_models.ResNet50`), P = 8: `jax.jit(tx.init, "
          "out_shardings=...)` with the specs of `kd.partition_specs`, compiled (never "
          "run); shard = the bytes of the whole optax state one device holds (K-FAC: "
          "`kd.kfac` with momentum, whose buffer is replicated; Shampoo: blocks of 128, "
          "SGD grafting), temporaries = XLA's memory analysis of the program per device. "
          "Target: temporaries ≤ 0.5 × the shard (each device builds its own shard; "
          "`core.initial` writes the identities elementwise). Built by concatenating "
          "per-device pieces (before 2026-11-28) the same programs held about the global "
          "state on every device: temporaries of K-FAC 965 MB (MEM-OPT), 3.31 GB (HYBRID), "
          "425 MB (COMM-OPT); of Shampoo 267 MB, 325 MB, 186 MB.", "",
          C.md_table(table, ["method", "strategy", "shard per device", "temporaries",
                             "temporaries / shard", "compile s", "holds"])]


def mesh3d_rows(p: int = 8) -> list[dict]:
  """Issue 16 item 6: memory per device of the pipelined, tensor-parallel
  stack (`_models.pipeline_problem`) on a 2×2×2 ("data", "model", "stage")
  mesh against the same model on a P-device data mesh: parameters, K-FAC
  state (the largest device's) and the compiled step's peak, SGD's (momentum)
  and K-FAC's, parameters and state donated; COMM-OPT and MEM-OPT over
  "data". Compiled only."""
  params, specs, pipeline_loss, flat_loss, x, y = _models.pipeline_problem()
  devices = jax.devices()[:p]
  meshes = (("2×2×2 (data, model, stage)",
             Mesh(np.array(devices).reshape(2, 2, 2), _models.PIPELINE_AXES),
             pipeline_loss, specs),
            (f"{p} (data)", Mesh(np.array(devices), ("data",)), flat_loss, P()))
  rows = []
  for mesh_name, mesh, loss_fn, pspecs in meshes:
    model_axes = tuple(a for a in mesh.axis_names if a != "data")
    grad_fn = kd.value_and_grad(loss_fn)
    sgd, state = C.sharded_step(loss_fn, params, x, y, optax.sgd(1e-2, momentum=0.9),
                                grad_fn, mesh, "none", kfac=False, donate=True,
                                param_specs=pspecs)
    placed = jax.device_put(params, jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, s), C.leaf_specs(pspecs, params),
        is_leaf=lambda s: isinstance(s, P)))
    param_dev = max(C.per_device_bytes(placed, devices))
    sgd_peak = memory_peak(sgd.lower(params, state, x, y).compile().memory_analysis())
    for strat, fraction in (("COMM-OPT", 1.0), ("MEM-OPT", 1 / mesh.shape["data"])):
      dist = kd.Distribution(mesh, "data", grad_worker_fraction=fraction,
                             model_axis=model_axes or None,
                             param_specs=pspecs if model_axes else None)
      layers = grad_fn.discover(params, x, y, distribution=dist)
      tx = C.kfac_tx(grad_fn, layers, dist)
      fn, state = C.sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, "none",
                                 donate=True, param_specs=pspecs)
      peak = memory_peak(fn.lower(params, state, x, y).compile().memory_analysis())
      kstate = C.kfac_state(state)     # on the 3-D mesh: every model shard's, stacked
      state_dev = max(C.per_device_bytes(kstate, devices))
      work = decomposition_workspace(kstate.layout)
      bound = sgd_peak + state_dev + work
      rows.append({"mesh": mesh_name, "strategy": strat, "params": param_dev,
                   "kfac_state": state_dev, "sgd_peak": sgd_peak, "kfac_peak": peak,
                   "workspace": work, "bound": bound, "holds": peak <= bound})
      print(f"  {mesh_name} {strat}: params {C.fmt_bytes(param_dev)}, K-FAC state "
            f"{C.fmt_bytes(state_dev)}, SGD peak {C.fmt_bytes(sgd_peak)}, K-FAC peak "
            f"{C.fmt_bytes(peak)}, bound {C.fmt_bytes(bound)}", flush=True)
  return rows


def render_mesh3d(rows) -> list[str]:
  if not rows:
    return []
  table = [[r["mesh"], r["strategy"], C.fmt_bytes(r["params"]),
            C.fmt_bytes(r["kfac_state"]), C.fmt_bytes(r["sgd_peak"]),
            C.fmt_bytes(r["kfac_peak"]), C.fmt_bytes(r["bound"]),
            f"{r['kfac_peak'] / r['bound']:.3f}", "yes" if r["holds"] else "**no**"]
           for r in rows]
  return ["", "## Three-dimensional mesh, per device (issue 16 item 6)", "",
          "`_models.pipeline_problem`: 8 residual Megatron MLP blocks stacked `[8, ...]` "
          "(width 256, hidden 1024, GELU; the model's shape of tests/test_mesh3d.py), a "
          "256-class Dense head, batch 64; on the 3-D mesh a pipeline (stage s runs its "
          "blocks in round s, activations passed on by `ppermute`). On the 2×2×2 mesh each device holds one stage's 4 "
          "blocks and half of their hidden units (`model_axis=(\"model\", \"stage\")`); "
          "on the 8-device data mesh every device holds the whole model. K-FAC at "
          "factors every 10 and eigendecompositions every 100 steps, the strategy over "
          "\"data\" (COMM-OPT: fraction 1; MEM-OPT: one device per owner group). Peaks "
          "from XLA's memory analysis of the compiled shard_map'd step (never run), "
          "bound = SGD's peak + K-FAC state + the largest layer's eigendecomposition "
          "workspace, as above. On the 3-D mesh each device holds a quarter of the "
          "parameters (the head is replicated) and only its model shard's K-FAC state "
          "(COMM-OPT's: its 4 blocks' halves instead of every layer); MEM-OPT on the data "
          "mesh already spreads the state over 8 owners, so its gain is smaller. The "
          "peaks exceed the bound for the causes given above (the reduce-scatter's send "
          "buffer of every layer's statistics, the conditionals' copies).", "",
          C.md_table(table, ["mesh", "strategy", "parameters", "K-FAC state",
                             "SGD peak", "K-FAC peak", "bound", "peak / bound",
                             "holds"])]


def render_peaks(rows) -> list[str]:
  if not rows:
    return []
  table = [[r["model"], C.fmt_bytes(r["sgd_peak"]), C.fmt_bytes(r["kfac_peak"]),
            C.fmt_bytes(r["kfac_state"]), C.fmt_bytes(r["workspace"]),
            C.fmt_bytes(r["bound"]), f"{r['kfac_peak'] / r['bound']:.3f}",
            "yes" if r["holds"] else "**no**"] for r in rows]
  return ["", "## Peak memory of a step (issue 16)", "",
          "One device, the step_time models (`_models.step_problem`), each step compiled "
          "with the parameters and the optimizer state donated; peak = XLA's memory "
          "analysis (arguments + outputs − aliased + temporaries), the largest over the "
          "step's branches. K-FAC is `kd.kfac` at factors every 10 and "
          "eigendecompositions every 100 steps; workspace = the largest layer's "
          "eigendecomposition (its factors' copies and eigenvectors, 2d² each, and "
          "LAPACK syevd's 1 + 6d + 2d² work array, float32). Target: K-FAC's peak ≤ "
          "SGD's peak + K-FAC state + workspace.", "",
          f"ResNet-50 rows: `_models.ResNet50` (BatchNorm untagged, running averages), "
          f"{RESNET_PER_DEVICE} images of {RESNET_IMAGE}×{RESNET_IMAGE} per device, the "
          "data-parallel SGD step (momentum, `pmean` of the gradients) and the K-FAC step "
          "under each strategy shard_map'd on 8 host devices (`_common.sharded_step`, "
          "parameters and state donated), compiled and never run; peaks per device "
          "(XLA's memory analysis of the SPMD program); K-FAC state = the largest "
          "device's.", "",
          "Where the excess comes from (XLA's live-range dump of each compiled step, "
          "`--xla_dump_hlo_as_text`: the values live at the peak, K-FAC's against "
          "SGD's; measured at the commit that added the ResNet rows): "
          "**mlp** (re-measured at 3f85508): the peak is on a decomposition step, inside "
          "the decomposition conditional: beside the donated state, the new second-order "
          "segment being written (6.7 MB), the factor update's new running factors "
          "(3.3 MB: the old state must survive until the step's fault verdict), the "
          "three eigh batches' outputs (6.7 MB: XLA runs the decompositions before "
          "writing any), the gradients' kernel-and-bias concatenations (2.7 MB) and "
          "copies of the two large momentum buffers (2.7 MB, kept for the chain's "
          "skip-select and scheduled early). The values live at that point add up to "
          "35.6 MB, while XLA's heap held 42.0 MB (its packing of buffers of mixed sizes "
          "and lifetimes); SGD's step: 7.8 MB live, 9.9 MB heap. With SGD's live bytes "
          "in the bound too, the MLP is at 1.12× (35.6 MB against 7.8 + 10.0 + 14.1). Writing each eigh output into the segment slot by slot (a loop over "
          "the slots carrying the segment, with the kept-on-failure selection as a "
          "0-or-1-trip loop) took the live peak to 33.4 MB (1.05× so counted), "
          "but the heap only to 41.5 MB: not kept (benchmarks/results/PERF_NOTES.md §5). "
          "What the excess is (2026-11-30, the contract's price measured by leaving "
          "it out, PERF_NOTES §16): without the state's undo select the peak is 35.2 MB, "
          "and without the kept-on-failure fallback too, 31.5 MB (0.93×, inside the "
          "bound). A faulty step leaves the state unchanged and a failed "
          "decomposition keeps its previous slot, so on a decomposition step the "
          "previous second-order array (6.7 MB) lives beside the new one until the "
          "step's verdict, which needs the update the new one preconditions; the bound "
          "leaves that array out. Since 2026-12-05 the kept-on-failure selection is "
          "loops run zero times when nothing failed, not a conditional whose output "
          "was one more segment-sized buffer: 41.5 MB (PERF_NOTES §46). "
          "**lm** (holds since 2026-11-28): the peak is in the backward pass. Until then "
          "it was 92.2 MB (1.055× the bound): XLA built each LayerNorm output (the input "
          "of q/k/v and of fc1) twice, once as the [B·T, d] rows its products read and "
          "once in its own [B, T, d] shape as the operand of the statistics' conditional, "
          "and held both from the forward pass to the backward one (4 × 1 MB), beside the "
          "two attention outputs (the o layers' inputs, 2 × 1 MB) in the same way. The "
          "Dense tags now hand the conditional the rows (`tags._dense_statistics`' "
          "`stats_input`, a bitcast), and the copies are gone. "
          "**resnet50 (MEM-OPT)**: the peak is in the factor update. Until 2026-11-29 "
          "(f63d546) it was 1527 MB (1.322× the bound): beside the reduce-scatter's send "
          "buffer (308 MB, all 54 layers' packed statistics, P times the state's factor "
          "chunk) lay the 44 captured layers' dense [d, d] batch statistics (498 MB, the "
          "outputs of the capture's conditionals, 85 MB each for the 4608-wide 3×3×512 "
          "convolutions) and the index arrays of the gathers that packed them (42 MB for "
          "a 4608-wide factor). The capture now packs each full statistic inside its own "
          "conditional (`statistics.PACKED`, what a state that stores packed factors asks "
          "for), so the d × d matrix dies in its layer's backward step: 1271 MB (1.100×), "
          "and the 3-D mesh rows below fell from 1.33–1.36× to 1.13–1.14×. What remains "
          "above the bound is the send buffer beside the packed statistics it is "
          "assembled from (about 250 MB): the bound leaves out the batch statistics and "
          "the reduction's global-sized buffer. Within it, the reduction would have to "
          "run in pieces (a round per column band of the [P, C] send buffer: P slices "
          "per round, so the program grows with P) or the statistics be written into the "
          "send buffer as the backward pass produces them. Earlier: writing the "
          "triangles into the send buffer chunk by chunk took the peak from 1557 to "
          "1527 MB and was not kept (benchmarks/results/PERF_NOTES.md §5). "
          "**resnet50 (COMM-OPT)** (2026-11-29): the peak is in the decomposition step, "
          "at the gather of the new second-order array (680 MB on every device, every "
          "owner's segment): the gathered tight chunks (616 MB) are sliced per owner "
          "(656 MB) and concatenated (680 MB), beside the previous array (680 MB), which "
          "the step's fault select reads at the end. Writing the new array over the "
          "previous one in place would take the step to 1.92 GB (1.11×), but only without "
          "the undo that a faulty step needs; with an exact undo (the previous array "
          "rebuilt from each owner's kept segment) XLA copies the array at the "
          "conditionals' boundaries, 2.57–3.63 GB (benchmarks/results/PERF_NOTES.md §8).", "",
          C.md_table(table, ["model", "SGD peak", "K-FAC peak", "K-FAC state",
                             "workspace", "bound", "peak / bound", "holds"])]


def checks(rows, p=8):
  by = {r["strategy"]: r for r in rows if r["P"] == p}
  if "MEM-OPT" not in by or "COMM-OPT" not in by:
    return []
  mem, comm = by["MEM-OPT"], by["COMM-OPT"]
  ratio = lambda l: l["L"] / -(-l["stored"] // p)
  target = 1.15 * comm["kfac_global"] / p
  lay = mem["layout"]
  shard = lambda l: (f"tight factor chunk C·4 = {l['C']}·4" if l["storage"] == "chunked"
                     else f"factor segment L·4 = {l['L']}·4")
  why = (f"MEM-OPT per device ({lay['storage']} storage, picked for the 10/100 cadence: "
         f"L/C = {ratio(lay):.3f}) = {shard(lay)} + second-order L₂·4 = "
         f"{lay['L2']}·4 + {lay['scalars_dev']} B of replicated scalars; "
         f"COMM-OPT total/{p} = {comm['kfac_global'] / p:.0f} B ({comm['layout']['storage']}: "
         f"P·{'C' if comm['layout']['storage'] == 'chunked' else 'L'} = "
         f"{p * comm['layout']['C']} factor numbers for {comm['layout']['stored']} stored, "
         f"{comm['layout']['second_dev'] // 4} second-order numbers for "
         f"{comm['layout']['second']} useful: every owner's segment, one after another); "
         f"the padding-free share is "
         f"{mem['share']:.0f} B, so MEM-OPT is {mem['kfac_max'] / mem['share']:.3f}x of it")
  return [{"check": f"MEM-OPT K-FAC state per device <= 1.15 × COMM-OPT total / {p} (P={p})",
           "value": f"{mem['kfac_max']} B = {mem['kfac_max'] / (comm['kfac_global'] / p):.3f}x",
           "target": f"<= {target:.0f} B", "holds": mem["kfac_max"] <= target, "why": why}]


def render(rows, chk, head, peaks=(), mesh3d=(), init=()) -> str:
  out = ["# Optimizer-state memory per device", "", C.header_md(head),
         f"- model: {C.MODEL_DESCRIPTION}",
         "- `kd.kfac` (scale_by_kfac + add_decayed_weights + sgd momentum), method eigen, "
         "state from `tx.init` placed with `kd.shard_state`; bytes of each leaf's shard "
         "per device. K-FAC = ScaleByKfacState alone; whole = the whole optax state "
         "(adds the replicated momentum). global = logical size of the K-FAC state "
         "(replicated leaves once; HYBRID's second-order array holds each group's m segments "
         "on each of its m devices, so its global array counts them m times); ideal = "
         "padding-free bytes per device for the strategy: (Σ stored factor numbers / P + "
         "Σ second-order numbers / G)·4, G = P/m owner groups (COMM-OPT replicates the "
         "second-order state, G = 1). Running factors: \"chunked\" = tight chunks of "
         "C = ⌈T/P⌉ numbers per device; \"owner\" = each owner's factors padded to the "
         "longest owner's L (DP-KFAC's local factors, all_reduce, and reduce_scatter where "
         "the transform picks them: L/C <= 1 + 1/k for the cadence, k = 100/10, "
         "`kfac.layout.cheaper_storage`); the second-order state is per owner, [L₂] per device.",
         "- Generated by `python benchmarks/memory.py`.", ""]
  table = []
  for r in rows:
    lay = r["layout"]
    table.append([
        r["P"], r["strategy"], r["m"] or "", C.fmt_bytes(r["kfac_dev0"]),
        C.fmt_bytes(r["kfac_max"]), C.fmt_bytes(r["kfac_global"]),
        C.fmt_bytes(r["ideal"]), f"{r['kfac_max'] / r['ideal']:.3f}" if r["ideal"] else "",
        C.fmt_bytes(r["total_dev0"]), C.fmt_bytes(r["total_max"]),
        (f"{lay['storage']} {'C' if lay['storage'] == 'chunked' else 'L'}="
         f"{lay['C']}, L₂={lay['L2']}, G={lay['G']}") if lay else ""])
  out.append(C.md_table(table, [
      "P", "strategy", "m", "K-FAC dev 0", "K-FAC max", "K-FAC global", "ideal / device",
      "max / ideal", "whole dev 0", "whole max", "factors per device, L₂, groups"]))
  out.append("")
  out += C.checks_markdown("Check", chk)
  out += render_peaks(peaks)
  out += render_mesh3d(mesh3d)
  out += render_init(init)
  return "\n".join(out)


def main(argv=None):
  ap = C.argument_parser(__doc__)
  ap.add_argument("--quick", action="store_true", help="P = 8 only; writes memory_quick.*")
  ap.add_argument("--devices", default=None, help="comma-separated P (default 1,2,4,8)")
  args = ap.parse_args(argv)
  ps = C.device_counts(args, "1,2,4,8")
  head = C.environment()
  rows = []
  for p in ps:
    rows += measure(p, MEMORY_STRATEGIES)
  chk = checks(rows, 8) if 8 in ps else []
  peaks = step_peaks(("mlp",) if args.quick else ("mlp", "cnn", "lm"))
  mesh3d = []
  if not args.quick and 8 in ps:
    peaks += resnet_peaks(8)
    mesh3d = mesh3d_rows(8)
  init = init_rows(8, INIT_STRATEGIES[:1] if args.quick else INIT_STRATEGIES)
  text = render(rows, chk, head, peaks, mesh3d, init)
  print(text)
  C.write_results(args.out, C.stem("memory", args.quick), text,
                  {"header": head, "rows": rows, "checks": chk, "step_peaks": peaks,
                   "mesh3d": mesh3d, "init": init})


if __name__ == "__main__":
  main()
