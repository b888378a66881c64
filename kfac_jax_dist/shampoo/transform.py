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
Parameters are merged and cut into blocks (`blocks`), and the step takes the
norm of a diagonal method's (`grafting`).

One `update` runs these stages, each a function of the settings
(`ShampooConfig`), the `Collectives` and the state:

1. checks: placement (`core.placement`) and the updates' structure;
2. gradient averaging as the distribution says, then the grafted diagonal
   updates `D` (`grafting`);
3. statistics, roots and directions on the owner groups (`step`: one group
   on one device and under COMM-OPT; MEM-OPT, HYBRID-OPT, SP-NGD routing);
4. fault verdict (`core.faults`) on the gradients, the statistics and the
   produced updates, then one select: a faulty step returns zeros and the old
   state with `skipped` + 1.

Cadence (`core.cadence`), with `count` the number of accepted updates (from
0): statistics are updated when `count % statistics_compute_steps == 0`;
roots are recomputed when `count ≥ start_preconditioning_step` and
(`count % preconditioning_compute_steps == 0` or `count ==
start_preconditioning_step`), after that step's statistics; before the start
every parameter gets the grafted update `D`. The three may be schedules of
`count`; refreshes run under `lax.cond`, so skipped work costs nothing.

Robustness: a non-finite gradient, statistic or update skips the whole step
(`core.faults`, as K-FAC); a block whose new root is not finite (or whose
Newton error exceeds `root_failure_threshold`) keeps its previous root.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import registry
from kfac_jax_dist.core import cadence
from kfac_jax_dist.core import collectives as collectives_lib
from kfac_jax_dist.core import distribution as distribution_lib
from kfac_jax_dist.core import faults
from kfac_jax_dist.core import offsets
from kfac_jax_dist.core import placement
from kfac_jax_dist.core import settings
from kfac_jax_dist.core import states
from kfac_jax_dist.core import tensor_parallel
from kfac_jax_dist.shampoo import blocks
from kfac_jax_dist.shampoo import grafting as graft_lib
from kfac_jax_dist.shampoo import state as state_lib
from kfac_jax_dist.shampoo import roots
from kfac_jax_dist.shampoo import step as step_lib
from kfac_jax_dist.shampoo.config import GraftType
from kfac_jax_dist.shampoo.config import Grafting
from kfac_jax_dist.shampoo.config import BLOCK_SIZE
from kfac_jax_dist.shampoo.config import MAX_PRECONDITIONER_DIM
from kfac_jax_dist.shampoo.config import SHAPE_OPTIONS
from kfac_jax_dist.shampoo.config import ShampooConfig
from kfac_jax_dist.shampoo.state import ScaleByShampooState


def configured_layout(config: ShampooConfig, comm: collectives_lib.Collectives,
                      paths_and_shapes: list[tuple[str, tuple[int, ...]]]
                      ) -> blocks.ShampooLayout:
  """The placed layout `config` builds for parameters of these paths and shapes."""
  lay = blocks.build_layout(paths_and_shapes, skip=config.skip, stacked=config.stacked,
                            **config.shape_options())
  return blocks.shard_layout(lay, comm.num_devices, comm.group_size,
                             None if config.distribution is None else config.distribution.axis)


# What to do about a state too large for the devices (`states.check_device_memory`).
SHAMPOO_REMEDIES = ("Spread it over the devices (kd.Distribution(grad_worker_fraction=1/P): "
                    "MEM-OPT keeps 1/P of the roots on each), take smaller blocks "
                    "(block_size=), leave wide axes out (max_preconditioner_dim=) or "
                    "parameters out (skip=), or keep the statistics in bfloat16 "
                    "(statistics_dtype=jnp.bfloat16).")


def init_state(config: ShampooConfig, comm: collectives_lib.Collectives, params: Any
               ) -> ScaleByShampooState:
  """The state at count 0 (built in numpy for concrete params: one transfer
  per array; jnp when traced)."""
  placement.check_floating_params("scale_by_shampoo", params)
  flat = registry.named_leaves(params)
  paths = [p for p, _ in flat]
  lay = configured_layout(config, comm, [(p, tuple(jnp.shape(x))) for p, x in flat])
  placement.check_skip_patterns(config.skip, paths, paths, "parameter")
  placement.check_skip_patterns([p for p, _ in config.stacked], paths, paths, "parameter",
                                option="stacked")
  offsets.check_sizes({"Shampoo statistics hold": lay.segment}, (
      f"on {lay.num_devices} device(s), spread them over more devices, or precondition "
      "fewer axes (max_preconditioner_dim=, skip=)."))
  dtype = config.statistics_dtype
  if dtype is None:
    dtype = jnp.promote_types(jnp.float32, jnp.result_type(
        *[x for _, x in flat] or [jnp.float32]))
  xp = jnp if _compat.traced(params) else np
  graft = [(jnp.shape(x), jnp.promote_types(jnp.result_type(x), jnp.float32))
           for _, x in flat] if config.accumulates else []
  state = state_lib.initial_state(lay, config.epsilon, dtype, graft, xp)
  return state if xp is jnp else jax.tree_util.tree_map(jnp.asarray, state)


def check_placement(config: ShampooConfig, comm: collectives_lib.Collectives,
                    state: ScaleByShampooState, updates: Any, name: str = "Shampoo"
                    ) -> None:
  """The state is this transform's, `update` runs where its distribution says,
  and the updates have the structure of the params given to init (the errors
  name the method, "Shampoo" or "SOAP", and its transform `scale_by_<name>`)."""
  lay, dist = state.layout, config.distribution
  transform = f"scale_by_{name.lower()}"
  want = (1, 1, None) if dist is None else (comm.num_devices, comm.group_size, dist.axis)
  placement.check_layout(name, (lay.num_devices, lay.group_size, lay.axis), want,
                         ("devices", "gradient workers per block", "axis"))
  if dist is not None:
    placement.check_axis(name, dist)
    placement.check_gradients_averaged(transform, dist, updates)
  got = [(p, tuple(jnp.shape(x))) for p, x in registry.named_leaves(updates)]
  if got != [(q.path, q.shape) for q in lay.params]:
    raise ValueError(
        f"{transform}: the updates do not have the structure of the params "
        f"given to init (got {got}, expected {[(q.path, q.shape) for q in lay.params]}).")
  traced = any(isinstance(settings.concrete(getattr(config, name)), jax.core.Tracer)
               for name in SHAPE_OPTIONS)         # inject_hyperparams: init read them
  if not traced and lay != configured_layout(config, comm, got):
    _refuse_another_configuration(transform, "its blocks differ from those this one builds "
                                  "(block_size, merge_small_dims, max_preconditioner_dim, "
                                  "exponent_override, skip or stacked)")
  graft = getattr(state, "graft", None)              # (SOAP's state has none)
  if graft is not None and bool(graft) != config.accumulates:
    _refuse_another_configuration(transform, "its grafting accumulators do not fit "
                                  f"graft_type={config.graft_type!r}")


def _refuse_another_configuration(transform: str, why: str) -> None:
  raise ValueError(
      f"{transform}: the state was built by a transform of another configuration: {why}. "
      "Pass the state of this transform's init, or restore a checkpoint with the "
      "settings that wrote it.")


def averaged_gradients(config: ShampooConfig, comm: collectives_lib.Collectives,
                       lay: blocks.ShampooLayout, grads: list[jax.Array]
                       ) -> list[jax.Array]:
  """The gradients averaged as the distribution says; under SP-NGD routing the
  preconditioned ones stay local (they are reduced to their owners)."""
  if config.reduce_scatter:
    return [x if plan.preconditioned else comm.mean(x) for x, plan in zip(grads, lay.params)]
  if config.distribution is not None and config.distribution.gradient_reduction != "none":
    return comm.mean(grads)
  return grads


def update_state(config: ShampooConfig, comm: collectives_lib.Collectives, updates: Any,
                 state: ScaleByShampooState) -> tuple[Any, ScaleByShampooState]:
  """One Shampoo update: the stages of the module docstring."""
  check_placement(config, comm, state, updates)
  with jax.named_scope(faults.SCOPE):    # first: a non-scalar schedule is named
    settings_ok = config.settings_ok(state.count)
  lay = state.layout
  leaves, treedef = jax.tree_util.tree_flatten(updates)
  dtype = state.statistics[0].dtype if state.statistics else jnp.float32
  grads = averaged_gradients(config, comm, lay, leaves)
  diag, graft = graft_lib.diagonal_updates(config, grads, state.graft, state.count)
  merged = [g.astype(dtype).reshape(plan.merged) if plan.preconditioned else None
            for g, plan in zip(grads, lay.params)]
  pre = [i for i, plan in enumerate(lay.params) if plan.preconditioned]
  stats, roots = state.statistics, state.roots
  if pre:
    stats, roots, directions = step_lib.update(config, comm, state, merged, diag, dtype)
    for i, v in zip(pre, directions):
      diag[i] = v
  new_updates = treedef.unflatten([v.astype(x.dtype) for v, x in zip(diag, grads)])
  with jax.named_scope(faults.SCOPE):
    ok = faults.all_finite(list(grads) + list(stats) + jax.tree_util.tree_leaves(
        new_updates)) & settings_ok
    ok = faults.computed_once(faults.agree(ok, _compat.varying_axes(ok)))
  new_state = dataclasses.replace(state, count=state.count + 1, statistics=stats, roots=roots,
                                   graft=graft)
  return faults.accept_or_skip(ok, new_updates, new_state, state)


def scale_by_shampoo(
    block_size: int | None = BLOCK_SIZE,
    beta2: float = 1.0,
    epsilon: float = 1e-6,
    *,
    graft_type: GraftType = "sgd",
    grafting: Grafting = "block",
    graft_beta2: float | None = None,
    graft_epsilon: float = 1e-10,
    start_preconditioning_step: cadence.ScalarOrSchedule = 1,
    statistics_compute_steps: cadence.ScalarOrSchedule = 1,
    preconditioning_compute_steps: cadence.ScalarOrSchedule = 1,
    merge_small_dims: bool | int = True,
    max_preconditioner_dim: int | None = MAX_PRECONDITIONER_DIM,
    exponent_override: float | None = None,
    root_method: roots.Method = "eigh",
    ridge_epsilon: float = 1e-6,
    newton_max_iterations: int = 100,
    newton_tolerance: float = 1e-6,
    root_failure_threshold: float = 0.1,
    skip: Sequence[str] = (),
    statistics_dtype: Any = None,
    distribution: distribution_lib.Distribution | None = None,
    stacked: Sequence[str] | Mapping[str, int] = (),
) -> optax.GradientTransformationExtraArgs:
  """Replaces each gradient by its blocked, grafted Shampoo direction.

  Works from gradients alone (no tags). See the module docstring for the math,
  the shapes, the grafting, the cadence and the failure handling.

  Args:
    block_size: largest block per merged axis, positive; None: no blocking.
    beta2: weight of the old statistics, in (0, 1]: `H ← β₂ H + (1 − β₂)
      G_(i)G_(i)ᵀ`; 1 sums them (the original, AdaGrad-like Shampoo).
    epsilon: the statistics start at `ε I`.
    graft_type: "sgd", "adagrad", "rmsprop", "adam" or "none".
    grafting: "block" (one norm per block) or "layer" (one per parameter).
    graft_beta2: `β` of "rmsprop"/"adam" grafting (default: `beta2`, which
      must then be < 1).
    graft_epsilon: `ε_graft` > 0 of the diagonal grafted methods (with 0 a
      zero gradient coordinate divides 0 by 0, and every step is skipped).
    start_preconditioning_step: the grafted update alone before this count
      (an int ≥ 0 or a schedule of the count).
    statistics_compute_steps: update the statistics when `count % this == 0`
      (a positive int or a schedule). The default 1 updates every statistic
      every step.
    preconditioning_compute_steps: recompute the roots when `count % this == 0`
      (a positive int or a schedule). The default 1 computes every root every step,
      the costliest setting: Anil et al. refresh every 10-100 steps.
    merge_small_dims: True: merge axes up to `block_size` (none with
      `block_size=None`); an int: up to that; False: no merging (size-1 axes
      are dropped either way).
    max_preconditioner_dim: parameters with a longer merged axis get the
      grafted diagonal update only (None: no limit).
    exponent_override: `p` of every root `H^{-1/p}` (default `2k`); positive,
      an integer with "newton".
    root_method: "eigh" (eigendecomposition) or "newton" (coupled Newton).
    ridge_epsilon: relative ridge: the roots are of `H + ε_ridge λ_max(H) I`.
    newton_max_iterations: most iterations of the Newton root.
    newton_tolerance: the Newton iteration stops once `max |M_k − I|` is below
      this.
    root_failure_threshold: a Newton root with `max |X^p A − I|` above this
      (or any non-finite root) is rejected and the previous root kept.
    skip: regular expressions; parameters whose path ("layer/kernel") matches
      one get the grafted diagonal update only. A pattern that matches no
      parameter raises at `init`.
    stacked: regular expressions of parameters whose leading axis stacks
      layers (`nn.scan`, `nnx.scan`, a `lax.scan` over blocks), or a mapping
      of them to their number of leading stack axes: each layer is
      preconditioned (and layer-grafted) as a parameter of its own, as
      unrolled. A pattern that matches no parameter raises at `init`.
    statistics_dtype: dtype of the statistics and roots (default float32, or
      float64 if a parameter is float64).
    distribution: a `kd.Distribution`: the work is spread over its axis (call
      `update` inside `shard_map`, with `kd.partition_specs`). With
      `grad_worker_fraction = 1` every device holds every statistic and root
      (the roots are computed by owners and all-gathered); below 1 the blocks
      belong to `P/m` owner groups that alone hold, update and apply their
      statistics and roots (MEM-OPT / HYBRID-OPT, see the module docstring).
      Its `gradient_reduction` says whether the gradients come averaged
      ("none"), `update` averages them ("all_reduce"), or the raw gradients of
      each group's blocks are reduce-scattered to it ("reduce_scatter", SP-NGD
      style; with `graft_type` "sgd" or "none" when there are several groups).
      The factor options are K-FAC's and do not apply. None: one device.

  Returns:
    An optax `GradientTransformationExtraArgs` (extra arguments of `update`
    are ignored, so it chains with `kd.scale_by_kfac`-style transforms).
  """
  config = ShampooConfig(
      block_size=block_size, beta2=beta2, epsilon=epsilon, graft_type=graft_type,
      grafting=grafting, graft_beta2=graft_beta2, graft_epsilon=graft_epsilon,
      start_preconditioning_step=start_preconditioning_step,
      statistics_compute_steps=statistics_compute_steps,
      preconditioning_compute_steps=preconditioning_compute_steps,
      merge_small_dims=merge_small_dims, max_preconditioner_dim=max_preconditioner_dim,
      exponent_override=exponent_override, root_method=root_method,
      ridge_epsilon=ridge_epsilon, newton_max_iterations=newton_max_iterations,
      newton_tolerance=newton_tolerance, root_failure_threshold=root_failure_threshold,
      skip=skip, statistics_dtype=statistics_dtype, distribution=distribution,
      stacked=stacked)
  comm = collectives_lib.Collectives(distribution)

  def init_fn(params: Any) -> ScaleByShampooState:
    states.check_params(params, "scale_by_shampoo")
    state = init_state(config, comm, params)
    states.check_device_memory(state, "scale_by_shampoo", SHAMPOO_REMEDIES)
    return state

  def update_fn(updates: Any, state: ScaleByShampooState, params: Any = None,
                **extra_args: Any) -> tuple[Any, ScaleByShampooState]:
    del params, extra_args
    states.check_kind(state, ScaleByShampooState, "scale_by_shampoo")
    return update_state(config, comm, updates, state)
  update_fn = _compat.transform_update(update_fn, config)

  # Tensor-parallel: every model shard preconditions its local shard (3D-Shampoo).
  return tensor_parallel.for_model_shards(
      optax.GradientTransformationExtraArgs(init_fn, update_fn), distribution,
      "scale_by_shampoo")


def shampoo(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float | None = 0.9,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    block_size: int | None = BLOCK_SIZE,
    beta2: float = 1.0,
    epsilon: float = 1e-6,
    graft_type: GraftType = "sgd",
    grafting: Grafting = "block",
    graft_beta2: float | None = None,
    graft_epsilon: float = 1e-10,
    start_preconditioning_step: cadence.ScalarOrSchedule = 1,
    statistics_compute_steps: cadence.ScalarOrSchedule = 1,
    preconditioning_compute_steps: cadence.ScalarOrSchedule = 1,
    merge_small_dims: bool | int = True,
    max_preconditioner_dim: int | None = MAX_PRECONDITIONER_DIM,
    exponent_override: float | None = None,
    root_method: roots.Method = "eigh",
    ridge_epsilon: float = 1e-6,
    newton_max_iterations: int = 100,
    newton_tolerance: float = 1e-6,
    root_failure_threshold: float = 0.1,
    skip: Sequence[str] = (),
    statistics_dtype: Any = None,
    distribution: distribution_lib.Distribution | None = None,
    stacked: Sequence[str] | Mapping[str, int] = (),
) -> optax.GradientTransformationExtraArgs:
  """Shampoo followed by SGD with momentum (Anil et al. 2020, §4).

  `skip_faulty_steps(optax.chain(scale_by_shampoo(...),
  add_decayed_weights(weight_decay), sgd(learning_rate, momentum, nesterov)))`:
  weight decay is added to the grafted Shampoo step (it is not preconditioned)
  and goes through momentum, as in Anil et al.'s implementation, and a step
  that Shampoo skips (non-finite gradient, statistic or update) changes
  nothing in the chain's state. Works with `optax.inject_hyperparams`; the
  shape options (`block_size`, `merge_small_dims`, `max_preconditioner_dim`,
  `exponent_override`) and `statistics_dtype`, when given, go in its
  `static_args` (their defaults stay static): otherwise `init` refuses the
  dtype, and a shape option where it is traced (`jax.eval_shape(tx.init,
  params)`, a jitted `init`), naming it. The module docstring has the math.

  Args:
    learning_rate: a float ≥ 0 or an optax schedule of the update count.
    momentum: heavy-ball momentum of the SGD step, in [0, 1) (None or the number 0:
      none, and no trace kept).
    weight_decay: coefficient added to the Shampoo step times the parameters
      (`optax.add_decayed_weights`), ≥ 0; 0: none.
    nesterov: Nesterov momentum instead of heavy ball.
    block_size: largest block per merged axis, a positive int; None: no
      blocking (a statistic per whole axis: `d³` root work per axis).
    beta2: weight of the old statistics, in (0, 1]: `H ← β₂ H + (1 − β₂)
      G_(i)G_(i)ᵀ`; the default 1 sums them (the original, AdaGrad-like
      Shampoo).
    epsilon: the statistics start at `ε I`.
    graft_type: the diagonal method whose step norm Shampoo's direction takes:
      "sgd" (default), "adagrad", "rmsprop", "adam" or "none" (no grafting).
    grafting: "block" (one norm per block, default) or "layer" (one per
      parameter).
    graft_beta2: `β` of "rmsprop" / "adam" grafting, in [0, 1); None: `beta2`,
      which must then be below 1.
    graft_epsilon: `ε_graft` > 0 of the diagonal grafted methods (with 0 a
      zero gradient coordinate divides 0 by 0, and every step is skipped).
    start_preconditioning_step: before this update count every parameter gets
      the grafted update alone; an int ≥ 0 or a schedule of the count.
    statistics_compute_steps: update the statistics when `count % this == 0`,
      a positive int or a schedule. The default 1 updates every statistic
      every step.
    preconditioning_compute_steps: recompute the inverse roots when `count %
      this == 0`, a positive int or a schedule. The default 1 computes a root of every
      statistic every step (an eigendecomposition, or a Newton iteration, of
      each `d × d` block statistic), the most costly part of Shampoo (the
      benchmarks use 10).
    merge_small_dims: True: merge consecutive axes while their product stays
      ≤ `block_size`; an int: up to that; False: no merging (size-1 axes are
      dropped either way).
    max_preconditioner_dim: parameters with a merged axis longer than this get
      the grafted diagonal update only (None: no limit), blocked or not (the
      merged axis is compared before blocking).
    exponent_override: `p` of every root `H^{-1/p}` (None: `2k` for an
      order-`k` block); positive, an integer with "newton".
    root_method: "eigh" (eigendecomposition, default) or "newton" (coupled
      Newton iteration: matrix products only).
    ridge_epsilon: relative ridge: the roots are of `H + ε_ridge λ_max(H) I`.
    newton_max_iterations: most iterations of the Newton root.
    newton_tolerance: the Newton iteration stops once `max |M_k − I|` is
      below this.
    root_failure_threshold: a Newton root with `max |X^p A − I|` above this
      (or any non-finite root) is rejected and the previous root kept.
    skip: regular expressions searched in parameter paths ("layer/kernel");
      matching parameters get the grafted diagonal update only. A pattern that
      matches no parameter raises.
    stacked: regular expressions of parameters whose leading axis stacks
      layers (`nn.scan`, `nnx.scan`), or a mapping of them to their number of
      leading stack axes: each layer is preconditioned as if unrolled.
    statistics_dtype: dtype of the statistics and roots (None: float32, or
      float64 if a parameter is float64).
    distribution: a `kd.Distribution`: `update` runs inside `shard_map` over
      its axis, with the state's specs from `kd.partition_specs`.
      `grad_worker_fraction` 1 replicates the statistics and roots (each root
      computed by one owner, then all-gathered); below 1 each of the `P/m`
      owner groups holds, updates and applies only its blocks' (MEM-OPT at
      `1/P`, HYBRID-OPT between). `gradient_reduction` as for K-FAC
      ("reduce_scatter" needs `graft_type` "sgd" or "none" when there are
      several groups); the factor options do not apply. None: one device.

  Returns:
    An `optax.GradientTransformationExtraArgs` (extra arguments of `update`
    are ignored).
  """
  settings.check_first_order_tail(learning_rate, momentum, weight_decay)
  return faults.skip_faulty_steps(optax.chain(
      *faults.poison_unless(settings.first_order_tail_checks(learning_rate, momentum,
                                                             weight_decay)),
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
          statistics_dtype=statistics_dtype, distribution=distribution, stacked=stacked),
      *settings.first_order_tail(learning_rate, momentum, weight_decay, nesterov)))
