"""Shampoo as an optax transform: blocked Kronecker statistics, inverse roots, grafting.

Shampoo (Gupta, Koren & Singer 2018, Alg. 2; Anil et al. 2020, "Scalable
Second Order Optimization for Deep Learning") preconditions the gradient `G` of
an order-k tensor parameter with one statistic per axis:

    H_i ← β₂ H_i + (1 − β₂) G_(i) G_(i)ᵀ     (β₂ = 1: H_i ← H_i + G_(i) G_(i)ᵀ),
    G̃ = G ×₁ H₁^{-1/(2k)} ×₂ … ×_k H_k^{-1/(2k)},

where `G_(i) G_(i)ᵀ` contracts `G` with itself over every axis but `i`,
`×_i` is the mode-i product and every `H_i` starts at `ε I`. The roots are
`(H_i + ε_ridge λ_max(H_i) I)^{-1/p}`, `p = 2k` (or `exponent_override`),
computed by the coupled Newton iteration or by eigendecomposition (`roots`).

Shapes (Anil et al. §5, Google's `distributed_shampoo`):

1. `merge_small_dims`: size-1 axes are dropped and consecutive axes are merged
   while their product stays ≤ the threshold (e.g. a `(3, 3, 32, 64)` conv
   kernel with threshold 128 becomes `(9, 32, 64)`), so `k` is the order of the
   merged tensor.
2. Blocking: every merged axis longer than `block_size` is cut into blocks of
   `block_size` plus one smaller last block when the length is not a multiple
   (exact: no padding). Each block of order `k` has its own `k` statistics.
3. Parameters of rank < 2, those with a merged axis longer than
   `max_preconditioner_dim`, and those matching `skip` use the grafted
   diagonal method only. (A rank-≥2 parameter whose merged shape has one axis
   is preconditioned as an order-1 tensor: full-matrix AdaGrad, `p = 2`.)

Grafting (Agarwal et al. 2020; Anil et al. §4.3): the step has Shampoo's
direction and the norm of a diagonal method's step, per block
(`grafting="block"`) or per parameter (`grafting="layer"`):
`G̃ · ‖D‖ / ‖G̃‖`, where `D` is the grafted update:

* "sgd": `D = G`;
* "adagrad": `S ← S + G⊙G`, `D = G / (√S + ε_graft)`;
* "rmsprop": `v ← β v + (1−β) G⊙G`, `D = G / (√v + ε_graft)`;
* "adam": as "rmsprop" with Adam's bias correction `v / (1 − β^t)`;
* "none": no grafting, `G̃` as is (diagonal parameters then get `G`).

The grafting statistics are updated every step.

Cadence, with `count` the number of updates so far (from 0):

* statistics are updated when `count % statistics_compute_steps == 0`;
* roots are recomputed when `count ≥ start_preconditioning_step` and
  (`count % preconditioning_compute_steps == 0` or
  `count == start_preconditioning_step`), after that step's statistics;
* before `start_preconditioning_step` every parameter gets the grafted update `D`.

All three are `lax.cond`s, so skipped work costs nothing.

Robustness: a block whose new statistic is not finite keeps its old one, and a
block whose new root is not finite (or whose Newton error exceeds
`root_failure_threshold`) keeps its previous root; likewise for the grafting
accumulators (per parameter). The state never holds a NaN; the *returned*
update for a non-finite gradient is not finite — wrap the chain in
`optax.apply_if_finite` to skip such steps.

Batching: statistics of equal dimension `d` and equal root `p` are stacked into
one bucket `[n, d, d]`, so each refresh runs one batched root per bucket.

Distributed (`distribution=kd.Distribution(...)`, inside `shard_map`, Anil et
al. §5): the statistics are updated on every device from the averaged
gradients (no statistics traffic); each root is computed by one owner (the
statistics assigned like K-FAC's factors: LPT on `d³`, balancing the numbers
each owner sends too) and the roots are all-gathered (`gather_uneven`), so
every device holds every root (COMM-OPT style, `grad_worker_fraction = 1`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from kfac_jax_dist import distributed
from kfac_jax_dist import layout as layout_lib
from kfac_jax_dist import packing
from kfac_jax_dist import registry
from kfac_jax_dist import roots as roots_lib

_HI = lax.Precision.HIGHEST
GRAFT_TYPES = ("sgd", "adagrad", "rmsprop", "adam", "none")
GRAFTINGS = ("block", "layer")


# ---------------------------------------------------------------- static layout

@dataclasses.dataclass(frozen=True)
class Region:
  """A grid of equal blocks inside a merged parameter.

  Attributes:
    index: the segment of each axis (0: the whole blocks, 1: the smaller last
      block), used to put the regions back together.
    start: first element of the region on each axis.
    grid: number of blocks along each axis; the blocks are numbered row-major.
    block: the block shape.
    buckets: for each axis, the bucket holding the statistics of its blocks.
    slots: for each axis, the slot of the region's first block in that bucket
      (the region's `num_blocks` blocks follow contiguously).
  """

  index: tuple[int, ...]
  start: tuple[int, ...]
  grid: tuple[int, ...]
  block: tuple[int, ...]
  buckets: tuple[int, ...]
  slots: tuple[int, ...]

  @property
  def num_blocks(self) -> int:
    return math.prod(self.grid)


@dataclasses.dataclass(frozen=True)
class ParamPlan:
  """How one parameter is preconditioned.

  Attributes:
    path: the parameter's path ("layer/kernel").
    shape: its shape.
    merged: the shape after `merge_small_dims`; None for a parameter that gets
      the grafted diagonal update only.
    segments: for each merged axis, the number of segments (1 or 2).
    regions: the regions of equal blocks, in row-major segment order.
    exponent: `p` of the roots `H^{-1/p}`.
  """

  path: str
  shape: tuple[int, ...]
  merged: tuple[int, ...] | None
  segments: tuple[int, ...] = ()
  regions: tuple[Region, ...] = ()
  exponent: float = 0

  @property
  def preconditioned(self) -> bool:
    return self.merged is not None


@dataclasses.dataclass(frozen=True)
class ShampooLayout:
  """Static placement of every statistic: one bucket `[n, d, d]` per `(d, p)`.

  Attributes:
    params: one plan per parameter leaf, in tree-flattening order.
    buckets: `(d, p)` of each bucket.
    sizes: the number of matrices in each bucket.
  """

  params: tuple[ParamPlan, ...]
  buckets: tuple[tuple[int, float], ...]
  sizes: tuple[int, ...]


def merge_small_dims(shape: Sequence[int], threshold: int | None) -> tuple[int, ...]:
  """Drops size-1 axes and merges consecutive axes while their product is at
  most `threshold` (None or 0: no merging). `(3, 3, 32, 64)`, 128 →
  `(9, 32, 64)`; `(1, 2, 768, 1, 2048)`, 1024 → `(2, 768, 2048)`."""
  dims = [int(d) for d in shape if d != 1]
  if not threshold:
    return tuple(dims)
  out, acc = [], None
  for d in dims:
    if acc is not None and acc * d <= threshold:
      acc *= d
    else:
      if acc is not None:
        out.append(acc)
      acc = d
  if acc is not None:
    out.append(acc)
  return tuple(out)


def _axis_segments(n: int, block_size: int | None) -> list[tuple[int, int, int]]:
  """`(start, number of blocks, block length)` of the segments of an axis."""
  if block_size is None or n <= block_size:
    return [(0, 1, n)]
  whole, rest = divmod(n, block_size)
  segments = [(0, whole, block_size)]
  if rest:
    segments.append((whole * block_size, 1, rest))
  return segments


def build_layout(paths_and_shapes: Sequence[tuple[str, tuple[int, ...]]], *,
                 block_size: int | None, merge_threshold: int | None,
                 max_preconditioner_dim: int | None, exponent_override: float | None,
                 skip: Sequence[str] = ()) -> ShampooLayout:
  """The static layout of the statistics of parameters with these paths and shapes."""
  bucket_index: dict[tuple[int, float], int] = {}
  sizes: list[int] = []
  plans = []
  for path, shape in paths_and_shapes:
    merged = merge_small_dims(shape, merge_threshold)
    diagonal = (len(shape) < 2 or not merged or any(re.search(s, path) for s in skip)
                or (max_preconditioner_dim is not None
                    and max(merged) > max_preconditioner_dim))
    if diagonal:
      plans.append(ParamPlan(path, tuple(shape), None))
      continue
    p = 2 * len(merged)
    if exponent_override:
      p = (int(exponent_override) if float(exponent_override).is_integer()
           else float(exponent_override))
    per_axis = [_axis_segments(n, block_size) for n in merged]
    regions = []
    for index in itertools.product(*(range(len(s)) for s in per_axis)):
      segs = [per_axis[a][i] for a, i in enumerate(index)]
      grid = tuple(s[1] for s in segs)
      block = tuple(s[2] for s in segs)
      n = math.prod(grid)
      buckets, slots = [], []
      for d in block:
        j = bucket_index.setdefault((d, p), len(bucket_index))
        if j == len(sizes):
          sizes.append(0)
        buckets.append(j)
        slots.append(sizes[j])
        sizes[j] += n
      regions.append(Region(tuple(index), tuple(s[0] for s in segs), grid, block,
                            tuple(buckets), tuple(slots)))
    plans.append(ParamPlan(path, tuple(shape), merged,
                           tuple(len(s) for s in per_axis), tuple(regions), p))
  buckets = [None] * len(bucket_index)
  for key, j in bucket_index.items():
    buckets[j] = key
  return ShampooLayout(tuple(plans), tuple(buckets), tuple(sizes))


# ------------------------------------------------------------------------ state

@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "statistics", "roots", "graft"],
    meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ScaleByShampooState:
  """State of `scale_by_shampoo`.

  Attributes:
    count: number of updates so far.
    statistics: one `[n, d, d]` array per bucket of `layout`: the `H_i` of every
      block axis of dimension `d` and root `p`.
    roots: the matching `(H_i + ε_ridge λ_max I)^{-1/p}`, same shapes.
    graft: the grafting accumulators (`S` or `v`), one per parameter leaf in
      tree order; empty for "sgd" and "none".
    layout: static placement of every block's statistics.
  """

  count: jax.Array
  statistics: tuple[jax.Array, ...]
  roots: tuple[jax.Array, ...]
  graft: tuple[jax.Array, ...]
  layout: ShampooLayout


# ----------------------------------------------------------------- block math

def _region_slice(x: jax.Array, region: Region) -> jax.Array:
  stop = tuple(s + g * b for s, g, b in zip(region.start, region.grid, region.block))
  return lax.slice(x, region.start, stop)


def _to_blocks(x: jax.Array, region: Region) -> jax.Array:
  """Region `(g₀b₀, …)` → blocks `[n, b₀, …]`, blocks numbered row-major."""
  k = len(region.grid)
  split = x.reshape(tuple(itertools.chain(*zip(region.grid, region.block))))
  order = tuple(range(0, 2 * k, 2)) + tuple(range(1, 2 * k, 2))
  return split.transpose(order).reshape((region.num_blocks,) + region.block)


def _from_blocks(blocks: jax.Array, region: Region) -> jax.Array:
  k = len(region.grid)
  split = blocks.reshape(region.grid + region.block)
  order = tuple(itertools.chain(*((a, a + k) for a in range(k))))
  return split.transpose(order).reshape(
      tuple(g * b for g, b in zip(region.grid, region.block)))


def _assemble(pieces: dict[tuple[int, ...], jax.Array], segments: tuple[int, ...]):
  """Concatenates the regions back into the merged parameter."""
  def build(prefix):
    axis = len(prefix)
    if axis == len(segments):
      return pieces[prefix]
    parts = [build(prefix + (i,)) for i in range(segments[axis])]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)
  return build(())


def axis_statistics(blocks: jax.Array) -> list[jax.Array]:
  """`G_(i) G_(i)ᵀ` for every axis `i` of a batch of blocks `[n, b₀, …, b_{k−1}]`:
  `[n, b_i, b_i]`, contracting over all the other axes."""
  out = []
  for i in range(blocks.ndim - 1):
    y = jnp.moveaxis(blocks, i + 1, 1).reshape(blocks.shape[0], blocks.shape[i + 1], -1)
    out.append(jnp.einsum("nir,njr->nij", y, y, precision=_HI))
  return out


def precondition_blocks(blocks: jax.Array, axis_roots: Sequence[jax.Array]) -> jax.Array:
  """`B ×₁ R₁ ×₂ … ×_k R_k` for a batch of blocks `[n, b₀, …]` and symmetric
  `R_i` of shape `[n, b_i, b_i]`. Each step contracts the first block axis and
  appends the result as the last one, so after `k` steps the order is back."""
  n, shape = blocks.shape[0], blocks.shape[1:]
  y = blocks
  for i, r in enumerate(axis_roots):
    y = jnp.einsum("nir,nij->nrj", y.reshape(n, shape[i], -1), r, precision=_HI)
    y = y.reshape((n,) + shape[i + 1:] + shape[:i + 1])
  return y


def _norms(blocks: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.sum(jnp.square(blocks), axis=tuple(range(1, blocks.ndim))))


def _graft_scale(target_norm: jax.Array, norm: jax.Array) -> jax.Array:
  return target_norm / jnp.where(norm > 0, norm, 1.0)


def _all_finite(x: jax.Array, axes=None) -> jax.Array:
  return jnp.all(jnp.isfinite(x), axis=axes)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def root_owners(lay: ShampooLayout, num_devices: int) -> list[list[list[int]]]:
  """`owned[device][bucket]`: the slots whose roots `device` computes, by the
  layout's two-criteria LPT (cost `d³`, size `d²` sent)."""
  items = [(j, i) for j, n in enumerate(lay.sizes) for i in range(n)]
  bins = layout_lib.assign(
      items, num_devices, lambda t: float(lay.buckets[t[0]][0]) ** 3,
      lambda t: float(lay.buckets[t[0]][0]) ** 2)
  owned = [[[] for _ in lay.sizes] for _ in range(num_devices)]
  for device, mine in enumerate(bins):
    for j, i in sorted(mine):
      owned[device][j].append(i)
  return owned


# ------------------------------------------------------------------- transform

def scale_by_shampoo(
    block_size: int | None = 128,
    beta2: float = 1.0,
    epsilon: float = 1e-6,
    *,
    graft_type: str = "sgd",
    grafting: str = "block",
    graft_beta2: float | None = None,
    graft_epsilon: float = 1e-10,
    start_preconditioning_step: int = 1,
    statistics_compute_steps: int = 1,
    preconditioning_compute_steps: int = 1,
    merge_small_dims: bool | int = True,
    max_preconditioner_dim: int | None = 4096,
    exponent_override: float | None = None,
    root_method: str = "eigh",
    ridge_epsilon: float = 1e-6,
    newton_max_iterations: int = 100,
    newton_tolerance: float = 1e-6,
    root_failure_threshold: float = 0.1,
    skip: Sequence[str] = (),
    statistics_dtype: Any = None,
    distribution: distributed.Distribution | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Replaces each gradient by its blocked, grafted Shampoo direction.

  Works from gradients alone (no tags). See the module docstring for the math,
  the shapes, the grafting, the cadence and the failure handling.

  Args:
    block_size: largest block per merged axis; None: no blocking.
    beta2: weight of the old statistics, `H ← β₂ H + (1 − β₂) G_(i)G_(i)ᵀ`; 1
      sums them (the original, AdaGrad-like Shampoo).
    epsilon: the statistics start at `ε I`.
    graft_type: "sgd", "adagrad", "rmsprop", "adam" or "none".
    grafting: "block" (one norm per block) or "layer" (one per parameter).
    graft_beta2: `β` of "rmsprop"/"adam" grafting (default: `beta2`, which
      must then be < 1).
    graft_epsilon: `ε_graft` of the diagonal grafted methods.
    start_preconditioning_step: the grafted update alone before this count.
    statistics_compute_steps: update the statistics when `count % this == 0`.
    preconditioning_compute_steps: recompute the roots when `count % this == 0`.
    merge_small_dims: True: merge axes up to `block_size`; an int: up to that;
      False: no merging (size-1 axes are dropped either way).
    max_preconditioner_dim: parameters with a longer merged axis get the
      grafted diagonal update only (None: no limit).
    exponent_override: `p` of every root `H^{-1/p}` (default `2k`).
    root_method: "eigh" (eigendecomposition) or "newton" (coupled Newton).
    ridge_epsilon: relative ridge: the roots are of `H + ε_ridge λ_max(H) I`.
    newton_max_iterations, newton_tolerance: Newton's stopping rules.
    root_failure_threshold: a Newton root with `max |X^p A − I|` above this
      (or any non-finite root) is rejected and the previous root kept.
    skip: regular expressions; parameters whose path ("layer/kernel") matches
      one get the grafted diagonal update only.
    statistics_dtype: dtype of the statistics and roots (default float32, or
      float64 if a parameter is float64).
    distribution: a `kd.Distribution` with `grad_worker_fraction = 1`: the
      root computations are spread over its axis (call `update` inside
      `shard_map`). Its `gradient_reduction` says whether the gradients come
      averaged ("none") or `update` averages them ("all_reduce"); the factor
      options are K-FAC's and do not apply. None: one device.

  Returns:
    An optax `GradientTransformationExtraArgs` (extra arguments of `update`
    are ignored, so it chains with `kd.scale_by_kfac`-style transforms).
  """
  if graft_type not in GRAFT_TYPES:
    raise ValueError(f"graft_type must be one of {GRAFT_TYPES}, got {graft_type!r}")
  if grafting not in GRAFTINGS:
    raise ValueError(f"grafting must be one of {GRAFTINGS}, got {grafting!r}")
  if root_method not in roots_lib.METHODS:
    raise ValueError(f"root_method must be one of {roots_lib.METHODS}, got {root_method!r}")
  # Numbers may arrive as arrays (optax.inject_hyperparams): check the Python
  # ones here; the shape options are read (concretely) at init only.
  if _is_number(beta2) and not 0.0 < beta2 <= 1.0:
    raise ValueError(f"beta2 must be in (0, 1], got {beta2}")
  if _is_number(block_size) and block_size < 1:
    raise ValueError(f"block_size must be positive or None, got {block_size}")
  for name, value in (("statistics_compute_steps", statistics_compute_steps),
                      ("preconditioning_compute_steps", preconditioning_compute_steps)):
    if _is_number(value) and (int(value) != value or value < 1):
      raise ValueError(f"{name} must be a positive integer, got {value}")
  if _is_number(start_preconditioning_step) and start_preconditioning_step < 0:
    raise ValueError("start_preconditioning_step must be >= 0")
  if _is_number(exponent_override) and exponent_override <= 0:
    raise ValueError(f"exponent_override must be positive, got {exponent_override}")
  if (root_method == "newton" and _is_number(exponent_override)
      and int(exponent_override) != exponent_override):
    raise ValueError("root_method='newton' needs an integer exponent_override")
  g_beta = beta2 if graft_beta2 is None else graft_beta2
  if (graft_type in ("rmsprop", "adam") and _is_number(g_beta)
      and not 0.0 <= g_beta < 1.0):
    raise ValueError(f"graft_type={graft_type!r} needs a moving average: pass "
                     f"graft_beta2 < 1 (beta2 is {beta2}).")
  skip = tuple(skip)
  start = start_preconditioning_step
  if distribution is not None and distribution.grad_worker_fraction != 1:
    raise ValueError("scale_by_shampoo: only grad_worker_fraction=1 (every device "
                     "holds every root; the root computations are spread) is "
                     "implemented for Shampoo.")
  if distribution is not None and distribution.gradient_reduction == "reduce_scatter":
    raise ValueError('scale_by_shampoo: gradient_reduction="reduce_scatter" is K-FAC\'s '
                     'SP-NGD mode; use "none" (gradients already averaged) or '
                     '"all_reduce" (update averages them).')
  comm = distributed.Collectives(distribution)

  def shape_options():
    block = None if block_size is None else int(block_size)
    if merge_small_dims is True:
      merge = block
    elif merge_small_dims is False:
      merge = None
    else:
      merge = int(merge_small_dims)
    return dict(block_size=block, merge_threshold=merge,
                max_preconditioner_dim=(None if max_preconditioner_dim is None
                                        else int(max_preconditioner_dim)),
                exponent_override=(None if exponent_override is None
                                   else float(exponent_override)))

  def init_fn(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    lay = build_layout([(registry.path_str(p), tuple(jnp.shape(x))) for p, x in flat],
                       skip=skip, **shape_options())
    for pattern in skip:
      if not any(re.search(pattern, plan.path) for plan in lay.params):
        raise ValueError(f"skip pattern {pattern!r} matches no parameter.")
    dtype = statistics_dtype
    if dtype is None:
      dtype = jnp.promote_types(jnp.float32, jnp.result_type(
          *[x for _, x in flat] or [jnp.float32]))
    # Concrete params: built in numpy and transferred once per array (eager
    # jnp compiles and runs one small program per op); traced: jnp.
    xp = jnp if any(isinstance(x, jax.core.Tracer) for _, x in flat) else np
    stats = tuple((epsilon * xp.broadcast_to(xp.eye(d, dtype=dtype), (n, d, d))
                   ).astype(dtype) for (d, _), n in zip(lay.buckets, lay.sizes))
    roots = tuple(xp.broadcast_to(xp.eye(d, dtype=dtype), (n, d, d))
                  for (d, _), n in zip(lay.buckets, lay.sizes))
    graft = ()
    if graft_type in ("adagrad", "rmsprop", "adam"):
      graft = tuple(xp.zeros(jnp.shape(x), jnp.promote_types(jnp.result_type(x),
                                                             jnp.float32))
                    for _, x in flat)
    state = ScaleByShampooState(count=xp.zeros([], jnp.int32), statistics=stats,
                                roots=roots, graft=graft, layout=lay)
    return state if xp is jnp else jax.tree_util.tree_map(jnp.asarray, state)

  def graft_updates(grads, accumulators, count):
    """The grafted diagonal updates `D` and the new accumulators."""
    if graft_type in ("sgd", "none"):
      return list(grads), ()
    out, new_acc = [], []
    for g, acc in zip(grads, accumulators):
      g = g.astype(acc.dtype)
      sq = jnp.square(g)
      new = acc + sq if graft_type == "adagrad" else g_beta * acc + (1.0 - g_beta) * sq
      new = jnp.where(_all_finite(g), new, acc)
      denom = new
      if graft_type == "adam":
        denom = new / (1.0 - g_beta ** (count + 1).astype(acc.dtype))
      out.append(g / (jnp.sqrt(denom) + graft_epsilon))
      new_acc.append(new)
    return out, tuple(new_acc)

  def new_statistics(lay, merged_grads, stats):
    stat_weight = jnp.where(jnp.asarray(beta2) == 1.0, 1.0, 1.0 - jnp.asarray(beta2))
    pieces = [[] for _ in lay.buckets]
    for plan, g in zip(lay.params, merged_grads):
      if not plan.preconditioned:
        continue
      for region in plan.regions:
        blocks = _to_blocks(_region_slice(g, region), region)
        for axis, h in enumerate(axis_statistics(blocks)):
          j = region.buckets[axis]
          assert region.slots[axis] == sum(x.shape[0] for x in pieces[j])
          pieces[j].append(h)
    out = []
    for j, old in enumerate(stats):
      batch = jnp.concatenate(pieces[j]) if len(pieces[j]) > 1 else pieces[j][0]
      new = beta2 * old + stat_weight * batch.astype(old.dtype)
      out.append(jnp.where(_all_finite(new, (1, 2))[:, None, None], new, old))
    return tuple(out)

  def checked_roots(p, h, old):
    cand, err = roots_lib.inverse_pth_root(
        h, p, method=root_method, ridge_epsilon=ridge_epsilon,
        max_iterations=newton_max_iterations, tolerance=newton_tolerance)
    ok = _all_finite(cand, (1, 2)) & (err <= root_failure_threshold)
    return jnp.where(ok[:, None, None], cand.astype(old.dtype), old)

  def new_roots(lay, stats, old_roots):
    if comm.num_devices == 1:
      return tuple(checked_roots(p, h, old)
                   for (_, p), h, old in zip(lay.buckets, stats, old_roots))
    owned = root_owners(lay, comm.num_devices)
    sizes = [sum(len(slots) * lay.buckets[j][0] ** 2 for j, slots in enumerate(mine))
             for mine in owned]
    length = max(max(sizes), 1)

    def mine(device):
      pieces = []
      for j, slots in enumerate(owned[device]):
        if slots:
          idx = jnp.asarray(slots)
          pieces.append(checked_roots(lay.buckets[j][1], stats[j][idx],
                                      old_roots[j][idx]).reshape(-1))
      return packing.pad_to(pieces, length, old_roots[0].dtype)

    gathered = comm.gather_uneven(comm.per_device(mine), sizes)
    out = list(old_roots)
    for device, mine_slots in enumerate(owned):
      offset = 0
      for j, slots in enumerate(mine_slots):
        if slots:
          d = lay.buckets[j][0]
          block = gathered[device, offset:offset + len(slots) * d * d]
          out[j] = out[j].at[jnp.asarray(slots)].set(block.reshape(len(slots), d, d))
          offset += len(slots) * d * d
    return tuple(out)

  def precondition(plan, g, d, roots):
    """Grafted Shampoo direction of one merged parameter `g` (grafted update `d`)."""
    pieces = {}
    for region in plan.regions:
      blocks = _to_blocks(_region_slice(g, region), region)
      axis_roots = [lax.dynamic_slice_in_dim(roots[j], s, region.num_blocks)
                    for j, s in zip(region.buckets, region.slots)]
      out = precondition_blocks(blocks, axis_roots)
      if graft_type != "none" and grafting == "block":
        target = _norms(_to_blocks(_region_slice(d, region), region))
        out = out * _graft_scale(target, _norms(out))[
            (slice(None),) + (None,) * (out.ndim - 1)]
      pieces[region.index] = _from_blocks(out, region)
    out = _assemble(pieces, plan.segments)
    if graft_type != "none" and grafting == "layer":
      out = out * _graft_scale(jnp.linalg.norm(d.ravel()), jnp.linalg.norm(out.ravel()))
    return out

  def update_fn(updates, state: ScaleByShampooState, params=None, **extra_args):
    del params, extra_args
    lay = state.layout
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [registry.path_str(p) for p, _ in flat]
    if paths != [plan.path for plan in lay.params] or any(
        tuple(x.shape) != plan.shape for (_, x), plan in zip(flat, lay.params)):
      raise ValueError(
          "scale_by_shampoo: the updates do not have the structure of the params "
          f"given to init (got {[(p, tuple(x.shape)) for p, (_, x) in zip(paths, flat)]},"
          f" expected {[(q.path, q.shape) for q in lay.params]}).")
    count = state.count
    dtype = state.statistics[0].dtype if state.statistics else jnp.float32
    grads = [x for _, x in flat]
    if distribution is not None and distribution.gradient_reduction == "all_reduce":
      grads = comm.mean(grads)
    diag, graft = graft_updates(grads, state.graft, count)
    pre = [i for i, plan in enumerate(lay.params) if plan.preconditioned]
    merged = [grads[i].astype(dtype).reshape(plan.merged) if plan.preconditioned else None
              for i, plan in enumerate(lay.params)]

    stats, roots = state.statistics, state.roots
    if pre:
      with jax.named_scope("shampoo_statistics"):
        if _is_number(statistics_compute_steps) and statistics_compute_steps == 1:
          stats = new_statistics(lay, merged, stats)
        else:
          stats = lax.cond(count % statistics_compute_steps == 0,
                           lambda: new_statistics(lay, merged, state.statistics),
                           lambda: state.statistics)
      with jax.named_scope("shampoo_roots"):
        if (_is_number(start) and start == 0 and _is_number(preconditioning_compute_steps)
            and preconditioning_compute_steps == 1):
          roots = new_roots(lay, stats, state.roots)
        else:
          refresh = (count >= start) & ((count % preconditioning_compute_steps == 0)
                                        | (count == start))
          roots = lax.cond(refresh, lambda: new_roots(lay, stats, state.roots),
                           lambda: state.roots)

      def shampoo_branch():
        return [precondition(lay.params[i], merged[i],
                             diag[i].astype(dtype).reshape(lay.params[i].merged),
                             roots).reshape(lay.params[i].shape).astype(dtype)
                for i in pre]

      def graft_branch():
        return [diag[i].astype(dtype) for i in pre]

      with jax.named_scope("shampoo_precondition"):
        if _is_number(start) and start == 0:
          preconditioned = shampoo_branch()
        else:
          preconditioned = lax.cond(count >= start, shampoo_branch, graft_branch)
      for i, v in zip(pre, preconditioned):
        diag[i] = v

    new_updates = jax.tree_util.tree_unflatten(
        treedef, [v.astype(x.dtype) for v, x in zip(diag, grads)])
    new_state = dataclasses.replace(state, count=count + 1, statistics=stats,
                                    roots=roots, graft=graft)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def shampoo(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float | None = 0.9,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    block_size: int | None = 128,
    beta2: float = 1.0,
    epsilon: float = 1e-6,
    graft_type: str = "sgd",
    grafting: str = "block",
    graft_beta2: float | None = None,
    graft_epsilon: float = 1e-10,
    start_preconditioning_step: int = 1,
    statistics_compute_steps: int = 1,
    preconditioning_compute_steps: int = 1,
    merge_small_dims: bool | int = True,
    max_preconditioner_dim: int | None = 4096,
    exponent_override: float | None = None,
    root_method: str = "eigh",
    ridge_epsilon: float = 1e-6,
    newton_max_iterations: int = 100,
    newton_tolerance: float = 1e-6,
    root_failure_threshold: float = 0.1,
    skip: Sequence[str] = (),
    statistics_dtype: Any = None,
    distribution: distributed.Distribution | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Shampoo followed by SGD with momentum (Anil et al. 2020, §4).

  `optax.chain(scale_by_shampoo(...), add_decayed_weights(weight_decay),
  sgd(learning_rate, momentum, nesterov))`: weight decay is added to the
  grafted Shampoo step (it is not preconditioned) and goes through momentum,
  as in Anil et al.'s implementation. The other options are
  `scale_by_shampoo`'s. Works with `optax.inject_hyperparams`.
  """
  return optax.chain(
      scale_by_shampoo(
          block_size, beta2, epsilon, graft_type=graft_type, grafting=grafting,
          graft_beta2=graft_beta2, graft_epsilon=graft_epsilon,
          start_preconditioning_step=start_preconditioning_step,
          statistics_compute_steps=statistics_compute_steps,
          preconditioning_compute_steps=preconditioning_compute_steps,
          merge_small_dims=merge_small_dims, max_preconditioner_dim=max_preconditioner_dim,
          exponent_override=exponent_override, root_method=root_method,
          ridge_epsilon=ridge_epsilon, newton_max_iterations=newton_max_iterations,
          newton_tolerance=newton_tolerance,
          root_failure_threshold=root_failure_threshold, skip=skip,
          statistics_dtype=statistics_dtype, distribution=distribution),
      optax.add_decayed_weights(weight_decay),
      optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov))
