"""Helpers shared by the test modules (imported as `helpers`; no test module
imports another).

* `mesh` / `data_mesh`: a device mesh of the first devices, or a skip where
  the backend has fewer (tests/conftest.py gives 8 host CPU devices; on one
  GPU only the single-device tests run: benchmarks/gpu_check.sh);
* `compile_step`: the compiled training step, plain `jit` on one device or
  `jit(shard_map(...))` over a distribution's mesh;
* `classifier_problem`: a model's loss, parameters and a random batch;
  `conv_dense_problem`, the Conv + Dense one that the distributed and
  stale-statistics tests train;
* float64 oracle tools of the capture tests (test_capture, test_layers):
  `f64`, `randn`, `assert_factor_close`, `assert_trees_equal`,
  `ce_per_example`, `capture`, `mc_draws` / `check_mc_estimate`,
  `param_shapes`, `randomized`. `randn` needs `jax_enable_x64`;
* `inverse_update`: the π-damped K-FAC update, in float64 NumPy
  (test_float64, test_stale);
* `stale_refreshes` / `stale_schedule`: SP-NGD's refresh steps of a factor
  and its refreshed values, written out (test_stale, test_tensor_parallel);
* `METHOD_CONFIGS` / `method_params`, `method_trajectory`, `train_classifier`,
  `image_batch`, `first_kfac_step`: K-FAC's methods run on a network and on
  its rewritten twin (test_grouped_conv, test_transposed_kernel);
* `jitted_start`: a transformation's state and its jitted statistics and
  update, for tests that step outside a training-step function.
* `slow_unless`: parametrize cases, those outside the default selection
  marked slow.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import kfac_jax_dist as kd
from kfac_jax_dist.capture import triangles
from kfac_jax_dist.kfac import layout as layout_lib


def mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
  """A mesh of the first prod(shape) devices; skips the test where the
  default backend has fewer."""
  n = math.prod(shape)
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, the {jax.default_backend()} backend has "
                f"{jax.device_count()}")
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), axes)


def data_mesh(n: int = 8) -> Mesh:
  """A one-axis mesh ("data",) of the first n devices."""
  return mesh((n,), ("data",))


def compile_step(step, state, dist, num_batch_args, param_specs=P(), extra_out=()):
  """`step(params, state, *batch) -> (params, state, *extra)` compiled; returns
  `(compiled step, state)`, the state placed on the mesh when distributed.
  Batch arguments are sharded over "data"; `extra_out` are the specs of the
  extra outputs."""
  if dist is None:
    return jax.jit(step), state
  state = kd.shard_state(state, dist.mesh)
  specs = kd.partition_specs(state)
  return jax.jit(jax.shard_map(
      step, mesh=dist.mesh, in_specs=(param_specs, specs) + (P("data"),) * num_batch_args,
      out_specs=(param_specs, specs) + tuple(extra_out))), state


class ConvDenseNet(nn.Module):
  """Dense and Conv layers of several sizes, plus an untagged parameter."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(4, (3, 3))(x))
    x = nn.relu(kd.linen.Conv(8, (3, 3), strides=2)(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.tanh(kd.linen.Dense(16)(x))
    x = nn.tanh(kd.linen.Dense(16)(x))
    x = x * self.param("scale", nn.initializers.ones, (16,))
    return kd.linen.Dense(10, use_bias=False)(x)


def classifier_problem(model: nn.Module, x_shape: tuple[int, ...], seed: int = 0):
  """`(loss_fn, params, x, y)`: `model` (10 classes, softmax cross-entropy) on
  a random batch of shape `x_shape` with random labels."""
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, x_shape, jnp.float32)   # float32 also under x64
  y = jax.random.randint(ky, x_shape[:1], 0, 10)
  params = model.init(kp, x)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)

  return loss_fn, params, x, y


class ResidualStack(nn.Module):
  """24 equal Dense layers (12 → 12, residual) and a head: on one device one
  run of preconditioning (`layout.precondition_runs`), on 8 devices runs of
  2-3 per owner group in every strategy."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Dense(12)(x))
    for _ in range(23):
      x = x + nn.tanh(kd.linen.Dense(12)(x))
    return kd.linen.Dense(10)(x)


def residual_stack_problem():
  """`ResidualStack` on a random batch of 32 12-vectors (`classifier_problem`)."""
  return classifier_problem(ResidualStack(), (32, 12))


class Funnel(nn.Module):
  """Dense 16 → 16 → 3 → 10 on flattened 4x4 images: on 8 devices COMM-OPT's
  owners hold uneven second-order segments, two of them none, and several
  share a row of the replicated array (`Layout.second_slots`)."""

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(kd.linen.Dense(16)(x))
    x = nn.relu(kd.linen.Dense(3)(x))
    return kd.linen.Dense(10)(x)


def funnel_problem():
  """`Funnel` on a random batch of 32 4x4x1 images (`classifier_problem`)."""
  return classifier_problem(Funnel(), (32, 4, 4, 1))


def conv_dense_problem():
  """`ConvDenseNet` on a random batch of 32 8x8x2 images (`classifier_problem`)."""
  return classifier_problem(ConvDenseNet(), (32, 8, 8, 2))


class BranchHeads(nn.Module):
  """`ConvDenseNet`'s layers up to its scale, then one of two Dense heads
  chosen by the sign of the batch's mean feature (`nn.cond`, per device
  inside `shard_map`): the heads may sit out a pass (`may_sit_out`)."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(4, (3, 3))(x))
    x = nn.relu(kd.linen.Conv(8, (3, 3), strides=2)(x))
    x = nn.tanh(kd.linen.Dense(16)(x.reshape(x.shape[0], -1)))
    x = x * self.param("scale", nn.initializers.ones, (16,))
    heads = (kd.linen.Dense(10), kd.linen.Dense(10))
    return nn.cond(jnp.mean(x) > 0, lambda _, h: heads[0](h), lambda _, h: heads[1](h),
                   self, x)


def branch_heads_problem():
  """`BranchHeads` on a random batch of 32 8x8x2 images (`classifier_problem`)."""
  return classifier_problem(BranchHeads(), (32, 8, 8, 2))


# ---------------------------------------------------------------------------
# float64 oracles of the capture tests.
# ---------------------------------------------------------------------------

def f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def upper(x) -> np.ndarray:
  """The upper triangle of `[..., d, d]` row by row: the packed form in which the
  capture delivers a full statistic to a K-FAC state that stores its factors
  packed (the default)."""
  rows, cols = np.triu_indices(x.shape[-1])
  return np.asarray(x)[..., rows, cols]


def packed_dim(n: int) -> int:
  """`d` of a packed triangle of `n = d(d+1)/2` numbers."""
  d = (math.isqrt(8 * n + 1) - 1) // 2
  assert d * (d + 1) // 2 == n, n
  return d


def entry(stat, i: int, j: int):
  """Where entry (i, j), i ≤ j, of a statistic is: `(i, j)` of a `[d, d]` one,
  its position in a packed `[d(d+1)/2]` one."""
  if stat.ndim == 2:
    return i, j
  return triangles.row_starts(i, packed_dim(stat.shape[0])) + j - i


def assert_factor_close(actual, desired, what=""):
  """Equality up to float64 rounding (the statistics of a float64 model are
  computed in float64); a packed `actual` against the upper triangle of a
  `[d, d]` `desired`."""
  actual, desired = f64(actual), f64(desired)
  if actual.ndim == desired.ndim - 1 and desired.shape[-1] > 1 and (
      actual.shape[-1:] == upper(desired).shape[-1:]):
    desired = upper(desired)
  assert actual.shape == desired.shape, (what, actual.shape, desired.shape)
  scale = max(np.abs(desired).max(), 1e-30)
  np.testing.assert_allclose(actual, desired, rtol=1e-10, atol=1e-12 * scale,
                             err_msg=what)


def assert_trees_equal(actual, desired, rtol=1e-12):
  """Tight equality of two pytrees with the same structure."""
  assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(desired)
  for a, d in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(desired)):
    assert jnp.shape(a) == jnp.shape(d)
    np.testing.assert_allclose(f64(a), f64(d), rtol=rtol, atol=rtol * 1e-2)


def randn(key, shape, scale=1.0):
  return scale * jax.random.normal(key, shape, jnp.float64)


def ce_per_example(logits, labels):
  """Softmax cross-entropy of every example (float64, flattened)."""
  logits = logits.reshape(-1, logits.shape[-1])
  labels = labels.reshape(-1)
  logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def capture(loss_fn, **kwargs):
  """`kd.value_and_grad` under `jax.jit` (one compilation instead of one per op)."""
  return jax.jit(kd.value_and_grad(loss_fn, **kwargs))


NUM_DRAWS = 4000


def check_mc_estimate(samples, exact, what):
  """The mean of the draws is within 5 standard errors of the exact value,
  and the same test rejects the exact value scaled by 2 or 1/2."""
  samples, exact = f64(samples), f64(exact)
  mean = samples.mean(0)
  tol = 5.0 * samples.std(0) / math.sqrt(samples.shape[0]) + 1e-6 * np.abs(exact).max()

  def within(target):
    return bool(np.all(np.abs(mean - target) <= tol))

  assert within(exact), (what, np.abs(mean - exact).max(), tol.max())
  assert not within(2.0 * exact), f"{what}: tolerance too loose to see a factor 2"
  assert not within(0.5 * exact), f"{what}: tolerance too loose to see a factor 1/2"


def mc_draws(grad_fn, params, *args):
  """`grad_fn(params, *args, rng=r)` for `NUM_DRAWS` keys, vmapped."""
  keys = jax.random.split(jax.random.PRNGKey(123), NUM_DRAWS)
  return jax.jit(jax.vmap(lambda r: grad_fn(params, *args, rng=r)))(keys)


def unstacked(tree: dict, stack_axes: dict) -> dict:
  """A flat dict of leaves with each stacked leaf (`stack_axes[name]` leading
  stack axes) replaced by its layers, `"name/0"`, `"name/1"`, …: the unrolled
  model's parameters (or gradients, or updates)."""
  out = {}
  for name, x in tree.items():
    n = stack_axes.get(name, 0)
    if not n:
      out[name] = x
      continue
    shape = tuple(np.shape(x))
    layers = np.asarray(x).reshape((-1,) + shape[n:])
    out.update({f"{name}/{i}": layer for i, layer in enumerate(layers)})
  return out


def param_shapes(tree):
  """`{path: shape}` (plain data, comparable across flax versions)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): jnp.shape(leaf) for path, leaf in flat}


def randomized(tree, seed=7):
  """Random values for every leaf (Flax initialises biases to zero, which would
  hide a dropped bias)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      jax.random.normal(k, jnp.shape(leaf), jnp.result_type(leaf))
      for k, leaf in zip(keys, leaves)])


def inverse_update(a: np.ndarray, g: np.ndarray, grad: np.ndarray, gamma: float
                   ) -> np.ndarray:
  """π-damped K-FAC in float64 NumPy (test_float64, test_stale):
  `(A + π√γ I)⁻¹ ∇ (G + √γ/π I)⁻¹`, `π² = (tr A/d_A)/(tr G/d_G)`."""
  pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
  left = np.linalg.solve(a + pi * np.sqrt(gamma) * np.eye(a.shape[0]), grad)
  return np.linalg.solve(g + np.sqrt(gamma) / pi * np.eye(g.shape[0]), left.T).T


def stale_refreshes(sequences, alpha: float, decay: float = 0.0
                    ) -> dict[int, list[np.ndarray]]:
  """SP-NGD's Algorithms 1-2 written out for one factor held by one or several
  model shards, shard m fed `sequences[m][t]` at step t; a refreshed value is
  the running average `(β w X + (1 − β) S) / (β w + 1 − β)` (β = `decay`,
  w its total weight, 0 at first: with β = 0 the statistic itself) and counts
  as similar to an earlier one only where it is on every shard. `{refresh
  step: the refreshed values, one per shard}`."""
  t_next, d1, d2, history, weight, refreshed = 0, 1, 1, [], 0.0, []
  for t in range(len(sequences[0])):
    if t != t_next:
      continue
    refreshed.append(t)
    new_weight = decay * weight + (1 - decay)
    now = [(decay * weight * (history[-1][m] if history else 0) + (1 - decay) * seq[t])
           / new_weight for m, seq in enumerate(sequences)]
    weight = new_weight

    def similar(before):
      return all(np.linalg.norm(x - y) / np.linalg.norm(y) < alpha
                 for x, y in zip(now, before))
    if not history or not similar(history[-1]):
      d = max(1, d1 // 2)
    elif len(history) < 2 or not similar(history[-2]):
      d = d1
    else:
      d = d1 + d2
    d1, d2 = d, d1
    t_next = t + d
    history.append(now)
  return dict(zip(refreshed, history))


def stale_schedule(sequences, alpha: float) -> list[int]:
  """The steps at which `stale_refreshes` (factor_decay 0) refreshes."""
  return sorted(stale_refreshes(sequences, alpha))


# K-FAC's methods, each as `kd.kfac` options (`method_trajectory`).
METHOD_CONFIGS = {
    "eigen": dict(learning_rate=0.1),
    "inverse": dict(learning_rate=0.1, method="inverse"),
    "ekfac": dict(learning_rate=0.1, eigenvalue_correction="ekfac"),
    "diagonal_A": dict(learning_rate=0.1, max_factor_dim=10),
    "stale": dict(learning_rate=0.1, stale_threshold=0.1, inverse_update_every=1),
    "adaptive": dict(learning_rate=None, momentum=None, adapt_damping=True,
                     damping_adaptation_interval=1),
}


def slow_unless(cases, by_default) -> list:
  """`cases` for `pytest.mark.parametrize`, those not in `by_default` marked
  slow (CI time); a tuple case is one value per argument name."""
  return [case if case in by_default else
          pytest.param(*(case if isinstance(case, tuple) else (case,)),
                       marks=pytest.mark.slow)
          for case in cases]


def method_params(by_default: tuple[str, ...]) -> list:
  """`METHOD_CONFIGS`' names for `pytest.mark.parametrize`, those outside
  `by_default` marked slow (each case runs two trajectories)."""
  return slow_unless(METHOD_CONFIGS, by_default)


def image_batch(shape: tuple[int, ...], classes: int = 5, seed: int = 3) -> tuple:
  """Random float64 images `shape` (`[n, *spatial, c]`) and integer labels
  (needs `jax_enable_x64`)."""
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(kx, shape, jnp.float64),
          jax.random.randint(ky, shape[:1], 0, classes))


def jitted_start(tx, grad_fn, params) -> tuple:
  """`tx`'s initial state and jitted `grad_fn` and `tx.update`: one program
  each instead of every op compiled alone (tests/conftest.py)."""
  return tx.init(params), jax.jit(grad_fn), jax.jit(tx.update)


def first_kfac_step(loss_fn, params, batch: tuple, damping: float):
  """`kd.scale_by_kfac`'s first update (float64 factors, every refresh due):
  (gradients, updates, running factors by layer name, state), jitted."""
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, *batch), damping=damping,
                        factor_dtype=jnp.float64)
  state, statistics, update = jitted_start(tx, grad_fn, params)
  _, grads, stats = statistics(params, *batch, opt_state=state)
  updates, state = update(grads, state, kfac_stats=stats)
  return grads, updates, kd.running_factors(state), state


def method_trajectory(loss_fn, params, batch: tuple, config: dict, steps: int = 4):
  """The parameters after `steps` jitted `kd.kfac` steps of `config` (one of
  `METHOD_CONFIGS`: damping 1e-2, factors every step, decompositions every
  other, float64 factors) on one batch."""
  grad_fn = kd.value_and_grad(loss_fn)
  options = dict(damping=1e-2, factor_update_every=1, inverse_update_every=2,
                 factor_dtype=jnp.float64) | config
  if config.get("learning_rate", 0.1) is None:
    options["grad_fn"] = grad_fn
  tx = kd.kfac(layers=grad_fn.discover(params, *batch), **options)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=batch)
    return optax.apply_updates(params, updates), state
  for _ in range(steps):
    params, state = step(params, state)
  return params


def train_classifier(model: nn.Module, x, y, dist=None, steps: int = 4,
                     check_layers=None, **options):
  """`steps` `kd.kfac` steps (lr 0.05, damping 1e-2, decompositions every
  other step) of a linen classifier on one batch, on one device or over
  `dist` (the gradients averaged over "data"): (parameters, losses).
  `check_layers(layers)` sees the discovered registry first."""
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  if check_layers is not None:
    check_layers(layers)
  tx = kd.kfac(0.05, layers=layers, damping=1e-2, factor_update_every=1,
               inverse_update_every=2, distribution=dist, **options)

  def step(params, state, x, y):
    loss, grads, stats = grad_fn(params, x, y, opt_state=state)
    if dist is not None:
      grads, loss = jax.lax.pmean((grads, loss), "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, loss
  step, state = compile_step(step, tx.init(params), dist, 2, extra_out=(P(),))
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, x, y)
    losses.append(float(loss))
  return params, losses


def narrow_second_rows(monkeypatch) -> None:
  """Second-order arrays in rows of `1.5·L₂`, as `layout.row_width` cuts an
  array past int32 numbers, so that segments lie in several rows."""
  monkeypatch.setattr(layout_lib, "row_width", lambda sizes, longest: longest * 3 // 2)


def assert_injected_traces(tx, params, grads, state_class, static_default: str) -> None:
  """An `optax.inject_hyperparams` transform whose shape defaults stay static
  (`static_default` not among its hyperparameters): its checkpoint template
  `jax.eval_shape(tx.init, params)` and jitted init have the concrete init's
  structure, and two jitted updates count 2 with finite updates."""
  state = tx.init(params)
  assert jax.tree_util.tree_structure(jax.eval_shape(tx.init, params)) == \
      jax.tree_util.tree_structure(state)
  assert jax.tree_util.tree_structure(jax.jit(tx.init)(params)) == \
      jax.tree_util.tree_structure(state)
  assert static_default not in state.hyperparams
  for _ in range(2):
    updates, state = jax.jit(tx.update)(grads, state, params)
  assert [int(s.count) for s in kd.find_states(state, state_class)] == [2]
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree_util.tree_leaves(updates))
