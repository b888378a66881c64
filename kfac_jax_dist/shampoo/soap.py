"""SOAP: Adam run in Shampoo's eigenbasis, as an optax transform.

SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam",
Alg. 3; Meta's distributed Shampoo ships the same idea as eigenvalue-corrected
Shampoo) keeps Shampoo's statistics of each block `G` of order k and runs Adam
in the coordinates of their eigenvectors:

    M ← β₁ M + (1 − β₁) G                                  (original coordinates)
    G' = G ×₁ Q₁ᵀ ⋯ ×_k Q_kᵀ,   V ← β₂ V + (1 − β₂) G'²    (rotated coordinates)
    N = [(M̂ ×₁ Q₁ᵀ ⋯ ×_k Q_kᵀ) / (√V̂ + ε)] ×₁ Q₁ ⋯ ×_k Q_k,
    then H_i ← β_s H_i + (1 − β_s) G_(i) G_(i)ᵀ,
    and every `precondition_every` steps Q_i ← eigenvectors of H_i,

`M̂ = M / (1 − β₁^t)`, `V̂ = V / (1 − β₂^t)`, `β_s = shampoo_beta` (default
`β₂`). As in the paper (and the authors' code) the statistics and eigenbases
are updated after the step, so a step never rotates with eigenvectors of its
own gradient (which they would diagonalise, leaving its other coordinates as
rounding noise that Adam's division would blow up to ±1). The first update
(count 0) only measures the statistics and computes the first eigenbases: it
returns zeros and leaves the moments, as the authors' implementation skips
its first step; so at count t the moments hold t gradients. Later refreshes
happen when `count % precondition_every == 0`.

The state keeps `M` rotated too (`M' = M ×₁ Q₁ᵀ ⋯`, updated with `G'`, and
carried into new eigenbases on a refresh, `M' ← M' ×₁ (Q₁,newᵀ Q₁) ⋯`): the
same `M`, one rotation per step fewer than rotating it every step. `V` keeps
its slots across a refresh, each new eigenvector put in the slot of the old
direction it follows (`_following`: the authors' code sorts the old
eigenvectors by their Rayleigh quotients under the new statistic and permutes
`V` with them; the same pairing). The statistics start at `STATISTICS_EPSILON · I` (the
paper's start at zero; the tiny ridge keeps the first ones definite). A
decomposition that fails (a non-finite eigenbasis) keeps the previous basis.

Blocking, merging, `skip` and `max_preconditioner_dim` are Shampoo's
(`blocks`): a parameter Shampoo would not precondition (rank < 2 after
merging, a merged axis above `max_preconditioner_dim`, a `skip` match) gets
plain Adam. The statistics and eigenbases live where Shampoo's statistics
and roots live (`step.ShampooStep`): each device keeps its own statistics
and its owner group's eigenbases (each decomposed by one owner and gathered
in the group), the group keeps the moments of its blocks
(`ScaleBySoapState.block_mu`), runs their Adam and sends the directions to
every device (`core.routing`). One device and COMM-OPT are one group (the
eigenbases and block moments replicated, nothing sent after the Adam step);
MEM-OPT, HYBRID-OPT and SP-NGD's gradient routing have several. Parameters
without bases keep replicated, parameter-shaped moments. On a tensor-parallel
mesh (`model_axis`) every model shard runs SOAP on its local shards, as
Shampoo does.

A non-finite gradient, statistic or produced update skips the step on every
device (`core.faults`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from kfac_jax_dist import _compat
from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.core import faults
from kfac_jax_dist.core import linalg
from kfac_jax_dist.core import settings
from kfac_jax_dist.core import states
from kfac_jax_dist.core import tensor_parallel
from kfac_jax_dist.core import routing
from kfac_jax_dist.shampoo import blocks
from kfac_jax_dist.shampoo import step as step_lib
from kfac_jax_dist.shampoo import state as state_lib
from kfac_jax_dist.shampoo import transform as shampoo_transform
from kfac_jax_dist.shampoo.config import BLOCK_SIZE, MAX_PRECONDITIONER_DIM
from kfac_jax_dist.shampoo.config import ShampooConfig

STATISTICS_EPSILON = 1e-30
Buckets = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class SoapConfig:
  """The settings of `scale_by_soap` (see its docstring for each)."""

  b1: float = 0.95
  b2: float = 0.95
  eps: float = 1e-8
  shampoo_beta: float | None = None
  precondition_every: cadence.ScalarOrSchedule = 10
  block_size: int | None = BLOCK_SIZE
  merge_small_dims: bool | int = True
  max_preconditioner_dim: int | None = MAX_PRECONDITIONER_DIM
  skip: Sequence[str] = ()
  statistics_dtype: Any = None
  distribution: distribution_lib.Distribution | None = None
  stacked: Sequence[str] | Mapping[str, int] = ()

  def __post_init__(self):
    settings.check_range("b1", self.b1, 0.0, 1.0, schedule=False)
    settings.check_range("b2", self.b2, 0.0, 1.0, schedule=False)
    # eps 0: 0/0 where a coordinate never moved
    settings.check_positive("eps", self.eps, schedule=False)
    if self.shampoo_beta is not None:
      settings.check_range("shampoo_beta", self.shampoo_beta, 0.0, 1.0,
                           closed_low=False, closed_high=True, schedule=False)
    elif cadence.is_number(self.b2) and self.b2 == 0:
      raise ValueError("b2=0 with shampoo_beta=None would make the statistics' β_s "
                       "(shampoo_beta, b2 by default) 0, outside (0, 1]: pass "
                       "shampoo_beta explicitly.")
    settings.check_interval("precondition_every", self.precondition_every)
    _ = self.shampoo                  # Shampoo's checks of the shared options

  @functools.cached_property
  def shampoo(self) -> ShampooConfig:
    """Shampoo's settings of the statistics, blocks and their placement."""
    return ShampooConfig(
        block_size=self.block_size,
        beta2=self.b2 if self.shampoo_beta is None else self.shampoo_beta,
        epsilon=STATISTICS_EPSILON, graft_type="none", start_preconditioning_step=0,
        preconditioning_compute_steps=self.precondition_every,
        merge_small_dims=self.merge_small_dims,
        max_preconditioner_dim=self.max_preconditioner_dim, skip=self.skip,
        statistics_dtype=self.statistics_dtype, distribution=self.distribution,
        stacked=self.stacked)

  def settings_ok(self, count: jax.Array) -> jax.Array:
    """The run-time check of the values only the step knows."""
    return settings.all_ok([
        lambda: settings.range_ok("b1", self.b1, count, 0.0, 1.0),
        lambda: settings.range_ok("b2", self.b2, count, 0.0, 1.0),
        lambda: settings.positive_ok("eps", self.eps, count),
        lambda: settings.interval_ok("precondition_every", self.precondition_every, count)])


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "statistics", "bases", "mu", "nu", "skipped", "block_mu",
                 "block_nu"],
    meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ScaleBySoapState(states.PreconditionerState):
  """State of `scale_by_soap`.

  Attributes:
    count: number of updates so far (skipped ones excluded).
    statistics: Shampoo's statistics, in its placed form
      (`ScaleByShampooState.statistics`).
    bases: their eigenvectors `Q`, in the form of Shampoo's roots.
    mu: Adam's first moment `M` of every parameter leaf without bases, in
      tree order (the preconditioned ones' are in `block_mu`).
    nu: its second moment `V`, the same coordinates.
    skipped: number of updates skipped for a non-finite gradient, statistic
      or produced update.
    layout: Shampoo's static layout of the blocks and statistics.
    block_mu, block_nu: `M` and `V` of every preconditioned block, in each
      block's rotated coordinates (float32 at least), in one flat array each: device `i` holds
      its group's blocks (in the group's gradient buffer order,
      `step.GroupTables`; `T` the largest group's numbers), `[T]` replicated
      with one owner group, `[P·T]` sharded with several.
  """

  count: jax.Array
  statistics: tuple[jax.Array, ...]
  bases: tuple[jax.Array, ...]
  mu: tuple[jax.Array, ...]
  nu: tuple[jax.Array, ...]
  skipped: jax.Array
  layout: blocks.ShampooLayout
  block_mu: tuple[jax.Array, ...]
  block_nu: tuple[jax.Array, ...]

  def partition_specs(self) -> ScaleBySoapState:
    """Statistics sharded over the axis; eigenbases and block moments as
    Shampoo's roots (sharded with several owner groups); the rest replicated."""
    specs = jax.tree_util.tree_map(lambda _: PartitionSpec(), self)
    stats, groups = state_lib.statistics_and_root_specs(self.layout)
    return dataclasses.replace(
        specs, statistics=tuple(stats for _ in self.statistics),
        **{name: tuple(groups for _ in getattr(self, name))
           for name in ("bases", "block_mu", "block_nu")})


def checked_bases(p: float, statistics: jax.Array, previous: jax.Array) -> jax.Array:
  """The eigenvectors of a bucket `[n, d, d]`, each in the column of the
  previous basis's direction it follows (`_following`), keeping the previous
  basis of a block whose decomposition is not finite."""
  del p
  vectors, _ = linalg.eigh(statistics)
  vectors = _following(vectors, statistics, previous)
  ok = faults.finite_rows(vectors)
  return jnp.where(ok[:, None, None], vectors.astype(previous.dtype), previous)


def _following(vectors: jax.Array, statistics: jax.Array, previous: jax.Array) -> jax.Array:
  """`vectors` (ascending eigenvalues) reordered so that column i is the one
  whose eigenvalue ranks as the previous column i's Rayleigh quotient
  `q_iᵀ H q_i` under the new statistic `H`: `V`'s entry i then follows its
  direction across a refresh, the pairing of the authors' code (which sorts
  the old columns by those quotients and permutes `V` with them)."""
  dtype = vectors.dtype
  old = previous.astype(dtype)
  product = jnp.matmul(statistics.astype(dtype), old, precision=lax.Precision.HIGHEST)
  rayleigh = jnp.sum(old * product, axis=-2)                                   # [n, d]
  rank = jnp.argsort(jnp.argsort(rayleigh, axis=-1, stable=True), axis=-1, stable=True)
  return jnp.take_along_axis(vectors, rank[:, None, :], axis=-1)


def adam_step(config: SoapConfig, g_rot: jax.Array, mu: jax.Array, nu: jax.Array,
              count: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Adam in the rotated coordinates: (`N'`, new `M'`, new `V`); at count 0
  zeros and the moments unchanged (see the module docstring)."""
  t = jnp.maximum(count, 1).astype(mu.dtype)
  new_mu = config.b1 * mu + (1.0 - config.b1) * g_rot
  new_nu = config.b2 * nu + (1.0 - config.b2) * jnp.square(g_rot)
  direction = (new_mu / (1.0 - config.b1 ** t)) / (
      jnp.sqrt(new_nu / (1.0 - config.b2 ** t)) + config.eps)
  first = count == 0
  return (jnp.where(first, 0.0, direction).astype(mu.dtype), jnp.where(first, mu, new_mu),
          jnp.where(first, nu, new_nu))


# --------------------------- the moments: per parameter leaf, or placed in groups

def _block_rows(lay: blocks.ShampooLayout, flat: Any) -> list[np.ndarray]:
  """A global block-moment array (`[T]` or `[P·T]`) → each group's `[T]`
  buffer (its first device's)."""
  if lay.roots_replicated:
    return [np.asarray(flat)]
  rows = np.asarray(flat).reshape(lay.num_devices, -1)
  return [rows[g * lay.group_size] for g in range(lay.num_groups)]


def param_moments(state: ScaleBySoapState) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """`(M, V)` of every parameter leaf as host arrays of its shape (rotated
  coordinates), whatever the distribution of a global state."""
  lay = state.layout
  plain = iter(range(len(state.mu)))
  index = [None if plan.preconditioned else next(plain) for plan in lay.params]
  mu = [None if k is None else np.asarray(state.mu[k]) for k in index]
  nu = [None if k is None else np.asarray(state.nu[k]) for k in index]
  tables = step_lib.GroupTables.of(lay)
  for out, flat in ((mu, state.block_mu[0]), (nu, state.block_nu[0])):
    rows = _block_rows(lay, flat)
    for q, plan in enumerate(lay.params):
      if not plan.preconditioned:
        continue
      pieces = {}
      for r, region in enumerate(plan.regions):
        x = np.zeros((region.num_blocks,) + region.block, rows[0].dtype)
        for g, bs in ((g, t[(q, r)]) for g, t in enumerate(tables.blocks)
                      if (q, r) in t):
          start, n = tables.starts[g][(q, r)], math.prod(region.block)
          x[list(bs)] = rows[g][start:start + len(bs) * n].reshape((len(bs),) + region.block)
        pieces[region.index] = blocks.from_blocks(jnp.asarray(x), region)
      out[q] = np.asarray(blocks.assemble(pieces, plan)).reshape(plan.shape)
  return mu, nu


def with_moments(template: ScaleBySoapState, mu: Sequence[Any], nu: Sequence[Any]
                 ) -> ScaleBySoapState:
  """`template` with the moments of every parameter leaf (`param_moments`'
  form) written in its own form."""
  lay = template.layout
  tables = step_lib.GroupTables.of(lay)
  copies = 1 if lay.roots_replicated else lay.group_size     # of each group's row
  total = template.block_mu[0].shape[0] // (lay.num_groups * copies)
  flats = []
  for moments in (mu, nu):
    rows = np.zeros((lay.num_groups, total))
    for g, mine in enumerate(tables.blocks):
      for (q, r), bs in mine.items():
        plan = lay.params[q]
        region = plan.regions[r]
        x = blocks.to_blocks(blocks.region_slice(
            jnp.asarray(moments[q]).reshape(plan.merged), region), region)
        start = tables.starts[g][(q, r)]
        values = np.asarray(x)[list(bs)].reshape(-1)
        rows[g, start:start + values.size] = values
    flats.append(jnp.asarray(np.repeat(rows, copies, axis=0).reshape(-1),
                             template.block_mu[0].dtype))
  plain = lambda ms, like: tuple(
      jnp.asarray(m, y.dtype)
      for m, y in zip([m for plan, m in zip(lay.params, ms) if not plan.preconditioned],
                      like))
  return dataclasses.replace(template, mu=plain(mu, template.mu), nu=plain(nu, template.nu),
                             block_mu=(flats[0],), block_nu=(flats[1],))


def init_state(config: SoapConfig, comm: collectives_lib.Collectives, params: Any
               ) -> ScaleBySoapState:
  """The state at count 0: Shampoo's statistics (`ε I`), identity bases and
  zero moments (float32 at least)."""
  shampoo = shampoo_transform.init_state(config.shampoo, comm, params)
  lay = shampoo.layout

  def zeros() -> tuple[jax.Array, ...]:      # two sets: a donated step gets distinct buffers
    return tuple(jnp.zeros(jnp.shape(x), jnp.promote_types(jnp.result_type(x), jnp.float32))
                 for plan, x in zip(lay.params, jax.tree_util.tree_leaves(params))
                 if not plan.preconditioned)

  def block_zeros() -> tuple[jax.Array, ...]:
    total = max(max(step_lib.GroupTables.of(lay).totals), 1)
    copies = 1 if lay.roots_replicated else lay.num_devices
    return (jnp.zeros(copies * total,
                      jnp.promote_types(shampoo.statistics[0].dtype, jnp.float32)),)
  return ScaleBySoapState(count=shampoo.count, statistics=shampoo.statistics,
                          bases=shampoo.roots, mu=zeros(), nu=zeros(),
                          skipped=shampoo.skipped, layout=lay, block_mu=block_zeros(),
                          block_nu=block_zeros())


Moments = tuple[jax.Array, ...]
Step = tuple[Buckets, Buckets, list, Moments, Moments, Moments, Moments]


def _group_adam(config: SoapConfig, step: step_lib.ShampooStep, g: int, bases: jax.Array,
                mu: jax.Array, nu: jax.Array, due: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Group `g`'s (directions, `M'`, `V`), flat in its gradient buffer's order,
  from its blocks' moments `mu`, `nu` (this device's `[T]`), rotated with the
  eigenbases the step started with; `M'` carried into the new ones `bases`
  on a refresh (one conditional for the group's regions: on a GPU each
  conditional is a host round trip)."""
  tables, dtype = step.tables, mu.dtype
  directions, moments, seconds, rebases = [], [], [], []
  for (q, r), bs in tables.blocks[g].items():
    region = step.lay.params[q].regions[r]
    axis_bases = lambda roots, region=region, bs=bs: [
        step.group_roots(roots, region, a, bs) for a in range(len(region.block))]
    old = axis_bases(step.state.roots[0])
    back = lambda qs: [jnp.swapaxes(x, -1, -2) for x in qs]
    x = step.blocks_of(g, q, r).astype(dtype)
    start, n = tables.starts[g][(q, r)], len(bs) * step.numel(q, r)
    m, v = (y[start:start + n].reshape(x.shape) for y in (mu, nu))
    d, m, v = adam_step(config, blocks.precondition_blocks(x, old), m, v,
                        step.state.count)

    def rebase(m: jax.Array = m, old: list[jax.Array] = old,
               axis_bases: Any = axis_bases) -> jax.Array:
      """`M'` into the new eigenbases (read only on a refresh)."""
      return blocks.precondition_blocks(blocks.precondition_blocks(m, back(old)),
                                        axis_bases(bases))
    directions.append(blocks.precondition_blocks(d, back(old)))
    moments.append(m)
    seconds.append(v)
    rebases.append(rebase)
  rotated = (lax.cond(due, lambda: [rebase() for rebase in rebases], lambda: moments)
             if rebases else [])
  flat = lambda ys: collectives_lib.concat_flat([y.reshape(-1) for y in ys], dtype)
  return flat(directions), flat(rotated), flat(seconds)


def soap_step(config: SoapConfig, comm: collectives_lib.Collectives,
              state: ScaleBySoapState, grads: list[jax.Array],
              merged: list[jax.Array | None]) -> Step:
  """(statistics, eigenbases, directions, `mu`, `nu`, block moments): this
  device's statistics and its group's eigenbases (Shampoo's
  `step.ShampooStep`), each group's Adam on its blocks with their moments,
  the directions gathered from the groups; plain Adam for the other
  parameters."""
  lay, count = state.layout, state.count
  dtype = state.statistics[0].dtype
  as_shampoo = state_lib.ScaleByShampooState(
      count=count, statistics=state.statistics, roots=state.bases, graft=(),
      skipped=state.skipped, layout=lay)
  step = step_lib.ShampooStep(config.shampoo, comm, as_shampoo, merged, grads, dtype,
                             compute=checked_bases).routed()
  stats, bases = step.refreshed()
  due = cadence.due(config.precondition_every, count)
  width = routing.group_width(step.tables.totals, lay.group_size)
  total = state.block_mu[0].shape[0]

  def make(g: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    d, m, v = _group_adam(config, step, g, bases, state.block_mu[0], state.block_nu[0],
                          due)
    moments = state.block_mu[0].dtype           # float32 at least
    return tuple(collectives_lib.pad_to([x], n, t)
                 for x, n, t in ((d, width, dtype), (m, total, moments), (v, total, moments)))
  directions, block_mu, block_nu = routing.per_group(comm, make)
  buffers = routing.gather_made(comm, directions, step.tables.totals)
  out, mu, nu, k = [], list(state.mu), list(state.nu), 0
  for q, (plan, g) in enumerate(zip(lay.params, grads)):
    if plan.preconditioned:
      out.append(step.assembled(buffers, q).reshape(plan.shape))
    else:
      d, mu[k], nu[k] = adam_step(config, g.astype(mu[k].dtype), mu[k], nu[k], count)
      k += 1
      out.append(d)
  return ((stats,), (bases,), out, tuple(mu), tuple(nu), (block_mu,), (block_nu,))


def update_state(config: SoapConfig, comm: collectives_lib.Collectives, updates: Any,
                 state: ScaleBySoapState) -> tuple[Any, ScaleBySoapState]:
  """One SOAP update: statistics, eigenbases on refresh steps, Adam in them
  (`soap_step`), then the fault verdict and one
  select (as Shampoo's `update_state`)."""
  shampoo, lay, count = config.shampoo, state.layout, state.count
  shampoo_transform.check_placement(shampoo, comm, state, updates, "SOAP")
  with jax.named_scope(faults.SCOPE):    # first: a non-scalar schedule is named
    settings_ok = config.settings_ok(count)
  leaves, treedef = jax.tree_util.tree_flatten(updates)
  dtype = state.statistics[0].dtype if state.statistics else jnp.float32
  grads = shampoo_transform.averaged_gradients(shampoo, comm, lay, leaves)
  merged = [g.astype(dtype).reshape(plan.merged) if plan.preconditioned else None
            for g, plan in zip(grads, lay.params)]
  stats, bases, directions, mu, nu, block_mu, block_nu = (
      soap_step(config, comm, state, grads, merged))
  new_updates = treedef.unflatten([d.astype(x.dtype) for d, x in zip(directions, leaves)])
  with jax.named_scope(faults.SCOPE):
    ok = faults.all_finite(list(grads) + list(stats) + jax.tree_util.tree_leaves(
        new_updates)) & settings_ok
    ok = faults.computed_once(faults.agree(ok, _compat.varying_axes(ok)))
  new_state = dataclasses.replace(
      state, count=count + 1, statistics=stats, bases=bases, mu=mu, nu=nu,
      block_mu=block_mu, block_nu=block_nu)
  return faults.accept_or_skip(ok, new_updates, new_state, state)


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    eps: float = 1e-8,
    *,
    shampoo_beta: float | None = None,
    precondition_every: cadence.ScalarOrSchedule = 10,
    block_size: int | None = BLOCK_SIZE,
    merge_small_dims: bool | int = True,
    max_preconditioner_dim: int | None = MAX_PRECONDITIONER_DIM,
    skip: Sequence[str] = (),
    statistics_dtype: Any = None,
    distribution: distribution_lib.Distribution | None = None,
    stacked: Sequence[str] | Mapping[str, int] = (),
) -> optax.GradientTransformationExtraArgs:
  """Replaces each gradient by SOAP's direction: Adam in Shampoo's eigenbasis.

  See the module docstring for the math, the cadence and the failure
  handling.

  Args:
    b1: Adam's `β₁` (first moment, original coordinates), in [0, 1).
    b2: Adam's `β₂` (second moment, rotated coordinates), in [0, 1).
    eps: Adam's `ε` > 0, added to `√V̂` (with 0 a coordinate whose gradient
      is still 0 divides 0 by 0, and every step is skipped).
    shampoo_beta: `β_s` of the statistics `H ← β_s H + (1 − β_s) G_(i)G_(i)ᵀ`,
      in (0, 1] (1: the sum `H ← H + G_(i)G_(i)ᵀ`, as Shampoo's `beta2=1`);
      None: `b2` (then `b2 > 0`).
    precondition_every: recompute the eigenbases when `count % this == 0`
      (a positive int or a schedule; an eigendecomposition of every block
      statistic). The paper's 10.
    block_size: largest block per merged axis (Shampoo's); None: no blocking.
    merge_small_dims: Shampoo's axis merging (True: up to `block_size`).
    max_preconditioner_dim: parameters with a longer merged axis get plain
      Adam (None: no limit).
    skip: regular expressions; matching parameter paths get plain Adam. A
      pattern that matches no parameter raises at `init`.
    statistics_dtype: dtype of the statistics and eigenbases (default
      float32, or float64 if a parameter is float64).
    distribution: a `kd.Distribution`: `update` runs
      inside `shard_map` with the state's specs from `kd.partition_specs`.
      `grad_worker_fraction=1` replicates the state (each eigenbasis
      decomposed by one owner and all-gathered); below 1 each owner group
      keeps its blocks' statistics, eigenbases and moments (MEM-OPT,
      HYBRID-OPT), as Shampoo's; with `model_axis` each model shard runs
      SOAP on its local shards. None: one device.
    stacked: parameter path patterns whose leading axis stacks layers (or a
      mapping of them to their number of stack axes): each layer gets its
      own statistics and eigenbases, as unrolled (Shampoo's `stacked`).

  Returns:
    An optax `GradientTransformationExtraArgs` (extra arguments of `update`
    are ignored).
  """
  config = SoapConfig(b1=b1, b2=b2, eps=eps, shampoo_beta=shampoo_beta,
                      precondition_every=precondition_every, block_size=block_size,
                      merge_small_dims=merge_small_dims,
                      max_preconditioner_dim=max_preconditioner_dim, skip=skip,
                      statistics_dtype=statistics_dtype, distribution=distribution,
                      stacked=stacked)
  comm = collectives_lib.Collectives(distribution)

  def init_fn(params: Any) -> ScaleBySoapState:
    states.check_params(params, "scale_by_soap")
    state = init_state(config, comm, params)
    states.check_device_memory(state, "scale_by_soap", shampoo_transform.SHAMPOO_REMEDIES)
    return state

  def update_fn(updates: Any, state: ScaleBySoapState, params: Any = None,
                **extra_args: Any) -> tuple[Any, ScaleBySoapState]:
    del params, extra_args
    states.check_kind(state, ScaleBySoapState, "scale_by_soap")
    return update_state(config, comm, updates, state)
  update_fn = _compat.transform_update(update_fn, config)

  # Tensor-parallel: every model shard runs SOAP on its local shard (as Shampoo).
  return tensor_parallel.for_model_shards(
      optax.GradientTransformationExtraArgs(init_fn, update_fn), distribution,
      "scale_by_soap")


def soap(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.95,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    shampoo_beta: float | None = None,
    precondition_every: cadence.ScalarOrSchedule = 10,
    block_size: int | None = BLOCK_SIZE,
    merge_small_dims: bool | int = True,
    max_preconditioner_dim: int | None = MAX_PRECONDITIONER_DIM,
    skip: Sequence[str] = (),
    statistics_dtype: Any = None,
    distribution: distribution_lib.Distribution | None = None,
    stacked: Sequence[str] | Mapping[str, int] = (),
) -> optax.GradientTransformationExtraArgs:
  """SOAP (Vyas et al. 2024) with decoupled weight decay, like `optax.adamw`.

  `skip_faulty_steps(optax.chain(scale_by_soap(...),
  add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate)))`:
  the update is `−η (N + w θ)`, and a step SOAP skips changes nothing in the
  chain. Works with `optax.inject_hyperparams`; the shape options
  (`block_size`, `merge_small_dims`, `max_preconditioner_dim`) and
  `statistics_dtype`, when given, go in its `static_args` (their defaults stay
  static): otherwise `init` refuses the dtype, and a shape option where it is
  traced (`jax.eval_shape(tx.init, params)`, a jitted `init`), naming it.

  Args:
    learning_rate: `η` ≥ 0, a float or an optax schedule of the update count.
    b1: Adam's `β₁`, in [0, 1).
    b2: Adam's `β₂` (second moment, in the eigenbasis), in [0, 1).
    eps: Adam's `ε`.
    weight_decay: `w` of the decoupled weight decay, ≥ 0; 0: none.
    shampoo_beta: `β_s` of the statistics (None: `b2`).
    precondition_every: recompute the eigenbases when `count % this == 0`.
    block_size: Shampoo's block size (None: no blocking).
    merge_small_dims: Shampoo's axis merging.
    max_preconditioner_dim: longer merged axes: plain Adam for the parameter.
    skip: parameter path patterns that get plain Adam.
    statistics_dtype: dtype of the statistics and eigenbases.
    distribution: a `kd.Distribution` (see `scale_by_soap`); None: one
      device.
    stacked: parameter path patterns whose layers stack on the leading axis
      (see `scale_by_soap`).

  Returns:
    An `optax.GradientTransformationExtraArgs`.
  """
  settings.check_first_order_tail(learning_rate, weight_decay=weight_decay)
  return faults.skip_faulty_steps(optax.chain(
      *faults.poison_unless(settings.first_order_tail_checks(
          learning_rate, weight_decay=weight_decay)),
      scale_by_soap(b1, b2, eps, shampoo_beta=shampoo_beta,
                    precondition_every=precondition_every, block_size=block_size,
                    merge_small_dims=merge_small_dims,
                    max_preconditioner_dim=max_preconditioner_dim, skip=skip,
                    statistics_dtype=statistics_dtype, distribution=distribution,
                    stacked=stacked),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate)))
