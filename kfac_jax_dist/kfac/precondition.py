"""Preconditioning: each owner group applies its layers' second-order state.

Each tagged layer's gradient `∇` (kernel rows, bias as the last row, shape
`(d_A, d_G)`) becomes `(A ⊗ G + γ I)⁻¹ vec(∇)` (method "eigen", KAISA §4.1)
or its π-damped factored form (method "inverse"), see `linalg`; a unit-wise
layer (SP-NGD) gets `(F_c + γI)⁻¹` per channel. The owner group of each layer
does it (`layout.group_plans`) and the results are gathered from the groups
(`core.routing`); with one group every device does all of them.

KL clip (KAISA Eq. 5.1): `ν = min(1, sqrt(κ / (η² Σ_l |⟨V_l, ∇_l⟩|)))` scales
every preconditioned gradient; `η` is `learning_rate` (float or schedule).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_dist.capture import registry
from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import faults
from kfac_jax_dist.core import routing
from kfac_jax_dist.core import uneven
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import linalg
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac.config import KfacConfig

Leaves = dict[str, jax.Array]
# Per stacked layer, how many blocks past the plans' own the running owner
# group's are, in a branch several groups share (`Layout.group_branches`).
Shift = Mapping[str, jax.Array]
# The gradients of plans (moved by a shift), `[k, d_A, d_G]` (`gradient_matrices`).
GradOf = Callable[[Sequence[layout_lib.LayerPlan], Shift], jax.Array]
ReadGrad = Callable[[Sequence[layout_lib.LayerPlan]], jax.Array]   # a shift applied
ReadScaling = Callable[[Sequence[layout_lib.LayerPlan]], jax.Array | None]   # likewise
Runs = Literal["all", "stacks", "none"]     # which equal-shape layers run batched
# EK-FAC's `s` of layers of one shape, `[k, d_A, d_G]`, a shift applied
# (`correction.scaling_reader`)
Scaling = Callable[[Sequence[layout_lib.LayerPlan], Shift], jax.Array | None]

# Which equal-shape layers are preconditioned in runs (`precondition`): None
# chooses by platform; True: all runs, False: none (the tests,
# benchmarks/gpu_probe.py).
BATCH_RUNS: bool | None = None

# Second-order numbers (eigenbases or inverses) a run gathers at once at most
# (`_precondition_run`: past it, chunk by chunk through a loop).
RUN_NUMBERS = 1 << 26


def _blocks(leaf: jax.Array, plans: Sequence[layout_lib.LayerPlan],
            shape: tuple[int, ...], shift: Shift) -> jax.Array:
  """`[k, *shape]`: the plans' parts of a parameter leaf, the whole leaf of a
  layer that is not stacked, one slice for consecutive blocks of a stack
  (`shift[stack]` blocks further on, read at a traced start, if given)."""
  start = plans[0].layer.block_number or 0
  blocks = plans[0].layer.leaf_blocks(leaf, shape)
  moved = shift.get(plans[0].layer.stack_name) if shift else None
  if moved is None:
    return blocks[start:start + len(plans)]
  return lax.dynamic_slice_in_dim(blocks, start + moved, len(plans))


def gradient_matrices(plans: Sequence[layout_lib.LayerPlan], leaves: Leaves,
                      shift: Shift | None = None) -> jax.Array:
  """The gradients of one layer or of consecutive blocks of a stacked one
  (`layout.block_runs`; `shift` as `_blocks`), `[k, d_A, d_G]`: kernel
  rows, then the bias row. One layer's is joined as a `[d_A, d_G]` matrix
  (the leading axis added after): its readers, the product and ⟨V, ∇⟩, then
  see one array, which XLA:CPU otherwise built twice, once per shape, each a
  kernel as large as the parameter's update (PERF_NOTES §24)."""
  layer, k = plans[0].layer, len(plans)
  kernel = _blocks(leaves[layer.kernel_path], plans, layer.kernel_shape, shift)
  dtype = jnp.promote_types(kernel.dtype, jnp.float32)
  m = kernel.astype(dtype).reshape(k, layer.a_dim - layer.has_bias, layer.g_dim)
  if not layer.has_bias:
    return m
  bias = _blocks(leaves[layer.bias_path], plans, layer.bias_block_shape, shift).astype(dtype).reshape(k, 1, layer.g_dim)
  if k == 1:
    return jnp.concatenate([m[0], bias[0]])[None]
  return jnp.concatenate([m, bias], axis=1)


def _buffer_run(read: Callable[[int, int], jax.Array], offsets: dict[tuple[str, int], int],
                run: Sequence[layout_lib.LayerPlan]) -> jax.Array:
  """`[k, d_A, d_G]`: a run of `layout.buffer_runs` read from its group's
  buffer (`read(start, size)`: its numbers `[start, start + size)`)."""
  layer = run[0].layer
  return read(offsets[(layer.name, run[0].group)],
              len(run) * layer.a_dim * layer.g_dim).reshape(len(run), layer.a_dim,
                                                             layer.g_dim)


def write_back(layout: layout_lib.Layout, out: dict[str, jax.Array], leaves: Leaves,
               scale: jax.Array | None = None) -> None:
  """Writes each layer's `(d_A, d_G)` matrix `out[name]`, times `scale` (the
  KL clip's `ν`), into its kernel and bias leaves. The blocks of a stacked
  leaf (every block: a stack is skipped whole; consecutive plans, row-major)
  are stacked in one op, which XLA turns into one slice where a batched run
  produced them (`precondition_runs`), then split into kernel and bias rows
  once, not once per block; the result carries only their type (not the raw
  gradient's, varying over the mesh axis under SP-NGD's reduce-scatter).
  A layer that is not stacked has its kernel rows sliced from the `[d_A,
  d_G]` matrix itself (as `gradient_matrices` joins it): sliced from `[1,
  d_A, d_G]`, XLA:CPU sliced them once per shape its readers saw (adaptive
  K-FAC's tangent pass and inner products; PERF_NOTES §25). Its bias row
  keeps the leading axis, with which its readers' code is smaller."""
  parts: dict[str, list[jax.Array]] = {}
  layers: dict[str, tuple[registry.TaggedLayer, tuple[int, ...]]] = {}
  for run in layout_lib.block_runs(layout.plans):
    layer = run[0].layer
    stacked = layer.block_number is not None
    m = jnp.stack([out[plan.layer.name] for plan in run]) if stacked else out[layer.name]
    m = m if scale is None else scale.astype(m.dtype) * m
    rows = layer.a_dim - layer.has_bias
    parts.setdefault(layer.kernel_path, []).append(m[:, :rows] if stacked else m[:rows])
    layers[layer.kernel_path] = (layer, layer.kernel_shape)
    if layer.has_bias:
      parts.setdefault(layer.bias_path, []).append((m if stacked else m[None])[:, rows])
      layers[layer.bias_path] = (layer, layer.bias_block_shape)
  for path, values in parts.items():
    layer, shape = layers[path]
    leaves[path] = layer.blocks_leaf(packing.joined(values), shape).astype(
        leaves[path].dtype)


def check_updates(layout: layout_lib.Layout, leaves: Leaves) -> None:
  """Every tagged layer's parameters are in the updates, with their shapes."""
  for plan in layout.plans:
    layer = plan.layer
    for path, shape in ((layer.kernel_path, layer.kernel_shape),
                        (layer.bias_path, layer.bias_block_shape)):
      if path is None:
        continue
      if path not in leaves:
        raise ValueError(f"Tagged layer '{layer.name}': '{path}' is missing "
                         "from the updates given to scale_by_kfac.")
      shape = layer.leaf_shape(shape)     # stacked: [L, *block shape]
      if tuple(jnp.shape(leaves[path])) != shape:
        raise ValueError(f"Tagged layer '{layer.name}': the update of '{path}' has "
                         f"shape {jnp.shape(leaves[path])}, expected {tuple(shape)}.")


def precondition_group(config: KfacConfig, layout: layout_lib.Layout,
                       second: jax.Array, gamma: jax.Array, group: int, grad_of: GradOf,
                       kl_weight: Callable[[layout_lib.LayerPlan], float],
                       scaling: Scaling | None = None,
                       runs: Runs = "none", shift: Shift | None = None
                       ) -> tuple[dict[Any, jax.Array], jax.Array]:
  """Preconditioned gradients of one owner group's layers and its Σ|⟨V, ∇⟩|;
  a piece of a replicated layer leaves its partial ⟨V, ∇⟩ under
  `(name, "dot")` instead. `scaling`: EK-FAC's `s` of the layers it corrects.
  `runs`: which equal-shape layers are batched (`layout.precondition_runs`):
  "all", "stacks" (blocks of one stacked layer) or "none" (see `precondition`).
  `shift`: in a branch the group shares, where the running group's blocks are."""
  batches = (tuple((plan,) for plan in layout.group_plans(group)) if runs == "none"
             else layout_lib.precondition_runs(layout, group, runs == "all"))
  out, vg = {}, jnp.zeros([], config.compute_dtype)
  read = lambda plans: grad_of(plans, shift or {})
  scaled = None if scaling is None else lambda plans: scaling(plans, shift or {})
  for run in batches:
    apply = _precondition_run if len(run) > 1 else _precondition_one
    found, run_vg = apply(config, layout, second, gamma, run, read, kl_weight, scaled)
    out.update(found)
    vg = vg + run_vg
  return out, vg


def _precondition_one(config: KfacConfig, layout: layout_lib.Layout, second: jax.Array,
                      gamma: jax.Array, run: tuple[layout_lib.LayerPlan],
                      grad_of: ReadGrad,
                      kl_weight: Callable[[layout_lib.LayerPlan], float],
                      scaling: ReadScaling | None
                      ) -> tuple[dict[Any, jax.Array], jax.Array]:
  """`precondition_group` of one layer (or a piece of a replicated one, whose
  partial ⟨V, ∇⟩ goes under `(name, "dot")`, counted later)."""
  (plan,) = run
  dtype = config.compute_dtype

  def parts(place: layout_lib.FactorPlace) -> tuple[jax.Array | None, jax.Array]:
    """(matrix or None, vector), column slices put together."""
    return packing.read_parts(second, lambda q: layout.second_base(q.owner), place)

  def either(place: layout_lib.FactorPlace) -> jax.Array:
    matrix, vector = parts(place)
    return vector if matrix is None else matrix

  grad, s = grad_of((plan,))[0], _scaled(scaling, run)
  if plan.layer.unitwise:             # SP-NGD: (F_c + γI)⁻¹ per channel
    v_gamma, v_beta = linalg.unitwise_precondition(
        grad[0], grad[1] if plan.layer.has_bias else None, parts(plan.f)[1], gamma)
    v = jnp.stack([v_gamma] + ([v_beta] if v_beta is not None else []))
  elif config.method == "eigen":
    v = linalg.precondition_eigen(grad, *parts(plan.a), *parts(plan.g), gamma,
                                  rows=plan.rows,
                                  scaling=None if s is None else s[0])
  else:
    v = linalg.precondition_inverse(grad, either(plan.a), either(plan.g), rows=plan.rows)
  lo, hi = layout_lib.piece_rows(plan)
  dot = jnp.vdot(v, grad[lo:hi]).astype(dtype)
  if plan.rows is None:
    return {plan.layer.name: v}, jnp.abs(dot) * kl_weight(plan)
  return {plan.layer.name: v, (plan.layer.name, "dot"): dot}, jnp.zeros([], dtype)


def _scaled(scaling: ReadScaling | None, run: Sequence[layout_lib.LayerPlan]
            ) -> jax.Array | None:
  """EK-FAC's `s` of a run's layers, `[k, d_A, d_G]`; None without the
  correction and for layers it leaves alone (unit-wise ones, diagonal
  factors)."""
  return None if scaling is None or run[0].layer.unitwise else scaling(run)


def _precondition_run(config: KfacConfig, layout: layout_lib.Layout, second: jax.Array,
                      gamma: jax.Array, run: tuple[layout_lib.LayerPlan, ...],
                      grad_of: ReadGrad,
                      kl_weight: Callable[[layout_lib.LayerPlan], float],
                      scaling: ReadScaling | None
                      ) -> tuple[dict[str, jax.Array], jax.Array]:
  """`precondition_group` of a run of `k` equal-shape layers
  (`layout.precondition_runs`) at once: gradients stacked `[k, d_A, d_G]`,
  each factor part read by one slice or gather, batched products (the same
  numbers, a few kernels for the run instead of a few per layer). A run of
  more than `RUN_NUMBERS` second-order numbers that would be gathered goes
  chunk by chunk through a loop (`lax.map`): a gather is a copy, and 48 of
  GPT-2-XL's 6400-wide eigenbases at once (COMM-OPT at P = 1024, one per
  owner) would be 7.9 GB; a slice feeds the products without one."""
  grads = grad_of(run)
  parts = {w: packing.run_parts(lambda q: layout.second_base(q.owner),
                                tuple(getattr(plan, w) for plan in run))
           for w, _ in run[0].places}
  stacked = _scaled(scaling, run)
  k, c = len(run), max(1, RUN_NUMBERS // layout_lib.second_numbers(run[0]))
  sliced = all(packing.stride_of(p.starts, math.prod(p.shape)) is not None
               for ps in parts.values() for p in ps)
  if k <= c or sliced:
    read = lambda w: packing.read_run(second, parts[w], layout.second_row)
    v = _solved(config, run[0], grads, read, gamma, stacked)
    return _run_results(config, run, v, grads, kl_weight)
  # Chunks of c layers, the last one padded with the run's last layer.
  order = np.minimum(np.arange(-(-k // c) * c), k - 1).reshape(-1, c)
  row = layout.second_row
  tables = {w: [jnp.asarray(packing.start_table(p.starts, row)[order]) for p in ps]
            for w, ps in parts.items()}

  def solve_chunk(chunk: tuple) -> jax.Array:
    g, s, at = chunk
    read = lambda w: packing.read_run(second, parts[w], row, at[w])
    return _solved(config, run[0], g, read, gamma, s)
  v = lax.map(solve_chunk, (grads[order], None if stacked is None else stacked[order],
                            tables))
  return _run_results(config, run, v.reshape((-1,) + v.shape[2:])[:k], grads, kl_weight)


def _solved(config: KfacConfig, plan: layout_lib.LayerPlan, grads: jax.Array,
            read: Callable[[str], tuple], gamma: jax.Array, scaling: jax.Array | None
            ) -> jax.Array:
  """`(A ⊗ G + γI)⁻¹ ∇` (or its π-damped form, or SP-NGD's per channel) of
  one layer like `plan` or a batch of them (`grads` `[..., d_A, d_G]`), its
  factors' parts from `read("a" | "g" | "f")`."""
  if plan.layer.unitwise:          # SP-NGD: (F_c + γI)⁻¹ per channel, [..., C, 3]
    v_gamma, v_beta = linalg.unitwise_precondition(
        grads[..., 0, :], grads[..., 1, :] if plan.layer.has_bias else None,
        read("f")[1], gamma)
    return jnp.stack([v_gamma] + ([v_beta] if v_beta is not None else []), axis=-2)
  a, g = read("a"), read("g")
  if config.method == "eigen":
    return linalg.precondition_eigen(grads, *a, *g, gamma, scaling=scaling)
  return linalg.precondition_inverse(grads, a[0], g[0])


def _run_results(config: KfacConfig, run: tuple[layout_lib.LayerPlan, ...],
                 v: jax.Array, grads: jax.Array,
                 kl_weight: Callable[[layout_lib.LayerPlan], float]
                 ) -> tuple[dict[str, jax.Array], jax.Array]:
  """Each layer's row of the run's preconditioned `v [k, ...]`, and the run's
  Σ|⟨V, ∇⟩| (each layer's KL weight)."""
  dots = jnp.einsum("kij,kij->k", v, grads).astype(config.compute_dtype)
  weights = jnp.asarray([kl_weight(plan) for plan in run], config.compute_dtype)
  return ({plan.layer.name: v[i] for i, plan in enumerate(run)},
          jnp.sum(jnp.abs(dots) * weights))


def routed_gradients(config: KfacConfig, comm: collectives_lib.Collectives,
                     layout: layout_lib.Layout, leaves: Leaves
                     ) -> tuple[GradOf, Leaves]:
  """Where each owner group reads its layers' gradients, and the leaves with
  the untagged ones averaged as the distribution says.

  SP-NGD (`gradient_reduction="reduce_scatter"`): the raw local gradients go
  to their owner group only (each group's buffer starts with a slot for its
  KL sum, filled after the reduction); "all_reduce": every leaf averaged here.
  """
  dtype = config.compute_dtype
  if config.gradient_reduction == "reduce_scatter" and layout.plans:
    offsets, _, width = layout_lib.gradient_offsets(layout)
    buffers = [jnp.concatenate([jnp.zeros(1, dtype)] + [
        gradient_matrices(run, leaves).ravel().astype(dtype)
        for run in layout_lib.block_runs(layout.group_plans(g))])
        for g in range(layout.num_groups)]
    segment = routing.reduce_to_groups(comm, buffers, width)

    return (lambda plans, shift: packing.joined([  # a shared branch's offsets are the group's
        _buffer_run(lambda start, n: segment[start:start + n], offsets, run)
        for run in layout_lib.buffer_runs(plans, offsets)
    ])), {k: (v if k in layout.tagged_paths else comm.mean(v)) for k, v in leaves.items()}
  if config.gradient_reduction == "all_reduce":
    leaves = comm.mean(leaves)
  return (lambda plans, shift: packing.joined([
      gradient_matrices(run, leaves, shift).astype(dtype)
      for run in layout_lib.block_runs(plans)])), leaves


def _group_buffer(config: KfacConfig, layout: layout_lib.Layout, group: int,
                  out: dict[Any, jax.Array], vg: jax.Array) -> jax.Array:
  """A group's results as one flat buffer: its KL sum, then per layer (a
  piece: its partial dot first) the preconditioned rows."""
  flat = [x for run in layout_lib.block_runs(layout.group_plans(group)) for x in (
      [out[(run[0].layer.name, "dot")][None]] if run[0].rows is not None else []) + [
          jnp.stack([out[p.layer.name] for p in run]).reshape(-1)]]
  return jnp.concatenate([vg[None].astype(config.compute_dtype)] + flat)


def precondition(config: KfacConfig, comm: collectives_lib.Collectives,
                 layout: layout_lib.Layout, second: jax.Array, gamma: jax.Array,
                 grad_of: GradOf, kl_weight: Callable[[layout_lib.LayerPlan], float],
                 scaling: Scaling | None = None
                 ) -> tuple[dict[str, jax.Array], jax.Array]:
  """Every layer's preconditioned gradient (on every device) and Σ|⟨V, ∇⟩|
  (`scaling`: EK-FAC's `s` of the layers it corrects, on every device).

  Off CPU, layers of equal shape whose second-order state lies in one run are
  preconditioned together (`precondition_runs`: the step_time LM's eight
  attention projections in one batch of four products instead of 32
  products, 16 slices and 8 divisions, each a kernel launch on a GPU). On CPU
  only the blocks of a stacked layer are: batched, separate layers of one
  shape compiled slower there (the LM's step: 270 → 274 kernels, +8 % IR; a
  12-block unscanned GPT 11.1 s against 8.7 s, PERF_NOTES §51), where a
  stack's blocks are slices of one leaf either way (a scan of 8 Dense
  blocks: 170 → 143 kernels). Chosen when
  tracing (`Collectives.on_cpu`) unless `BATCH_RUNS` says; the numbers are the
  same up to the order of the KL sum."""
  runs = {None: "stacks" if comm.on_cpu else "all", True: "all", False: "none"}[BATCH_RUNS]
  if layout.num_groups == 1:
    return precondition_group(config, layout, second, gamma, 0, grad_of, kl_weight,
                              scaling, runs)
  offsets, sizes, _ = layout_lib.gradient_offsets(layout)
  reps = layout.group_branches

  def make(g: int) -> jax.Array:
    out, vg = precondition_group(config, layout, second, gamma, g, grad_of, kl_weight,
                                 scaling, runs, _shift(comm, layout, g, reps))
    return _group_buffer(config, layout, g, out, vg)
  buffers = routing.gather_from_groups(comm, make, sizes, config.compute_dtype, reps)
  preconditioned = {}
  for run in layout_lib.buffer_runs(layout.plans, offsets):
    if len(run) > 1:                    # a stack's blocks: one slice
      v = _buffer_run(functools.partial(buffers.read, run[0].group), offsets, run)
      preconditioned.update((plan.layer.name, v[i]) for i, plan in enumerate(run))
  split, dots, weights = [], [], []
  for plan in layout.plans:             # a replicated layer: its pieces' rows
    if plan.layer.name in preconditioned:
      continue
    layer, rows = plan.layer, []
    for piece in plan.pieces:
      lo, hi = layout_lib.piece_rows(piece)
      start = offsets[(layer.name, piece.group)]
      rows.append(buffers.read(piece.group, start, (hi - lo) * layer.g_dim).reshape(
          hi - lo, layer.g_dim))
      if plan.copies:
        dots.append((piece.group, start - 1))
    preconditioned[layer.name] = jnp.concatenate(rows) if plan.copies else rows[0]
    if plan.copies:
      weights.append(kl_weight(plan))
      split += [len(weights) - 1] * len(plan.pieces)
  return preconditioned, _kl_sum(layout.num_groups, buffers, split, dots, weights)


def _kl_sum(num_groups: int, buffers: uneven.Gathered, split: list[int],
            dots: list[tuple[int, int]], weights: list[float]) -> jax.Array:
  """Σ|⟨V, ∇⟩| of every layer: each group's sum (its buffer's first number)
  and, for each split layer `i`, `weights[i]`·|Σ of its pieces' partial
  dots| (`dots[j]`: where piece `j`'s is, `split[j]` its layer); the numbers
  read by one gather, not one slice per group and piece."""
  numbers = buffers.numbers([(g, 0) for g in range(num_groups)] + dots)
  vg = numbers[:num_groups].sum()
  if weights:
    per_layer = jax.ops.segment_sum(numbers[num_groups:], jnp.asarray(split),
                                    num_segments=len(weights))
    vg = vg + (jnp.abs(per_layer) * jnp.asarray(weights, per_layer.dtype)).sum()
  return vg


def _shift(comm: collectives_lib.Collectives, layout: layout_lib.Layout, group: int,
           representatives: Sequence[int] | None) -> Shift:
  """In a branch `group` shares (`representatives`), how many blocks past
  its own each stacked layer's blocks of the running group are (a table
  lookup); empty in a branch of its own."""
  if representatives is None or representatives.count(group) == 1:
    return {}
  served = [g for g, rep in enumerate(representatives) if rep == group]
  bases = {g: layout.stack_bases(g) for g in served}
  return {stack: comm.group_table(tuple(bases[g][stack] - base if g in bases else 0
                                        for g in range(layout.num_groups)))
          for stack, base in bases[group].items()}


def kl_clip(config: KfacConfig, vg: jax.Array, count: jax.Array) -> jax.Array | None:
  """`ν` of KAISA's KL clip, which scales every preconditioned gradient (None
  without `kl_clip`); on a tensor-parallel mesh Σ|⟨V, ∇⟩| sums every
  layer's shards."""
  if config.kl_clip is None:
    return None
  if config.model_axes:
    vg = lax.psum(vg, config.model_axes)
  dtype = config.compute_dtype
  eta = jnp.asarray(cadence.value_at(config.learning_rate, count), dtype)
  kappa = jnp.asarray(cadence.value_at(config.kl_clip, count), dtype)
  # √κ / (η √vg): η²·vg may overflow where ν does not
  nu = jnp.minimum(1.0, jnp.sqrt(kappa) / (eta * jnp.sqrt(vg)))
  return faults.computed_once(vg > 0, nu, jnp.ones_like(nu))   # one ν for every layer
