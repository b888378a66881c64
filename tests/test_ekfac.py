"""EK-FAC (`eigenvalue_correction="ekfac"`, kfac.correction) against float64
brute force: the corrected scaling from per-example gradients (`jax.vmap` of
each example's own loss gradient), the update from a dense solve in the
eigenbasis, and the 8-device COMM-OPT run against the single-device one."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import kfac_jax_dist as kd
from kfac_jax_dist.capture import registry
from kfac_jax_dist.capture import statistics as statistics_lib
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac.state import find_states

LAMBDA, DECAY = 1e-2, 0.8


pytestmark = pytest.mark.usefixtures("x64_module")


class ConvNet(nn.Module):
  """A Conv layer (an image is an example: its pixels summed) and two Dense."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(3, (3, 3))(x))
    x = nn.tanh(kd.linen.Dense(5)(x.mean((1, 2))))
    return kd.linen.Dense(4)(x)


class SequenceNet(nn.Module):
  """A Dense layer over a sequence, reduced per sequence (`example_dims=1`):
  the per-example gradient sums its positions."""

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(kd.linen.Dense(5, kfac_example_dims=1)(x))
    return kd.linen.Dense(4)(x.mean(1))


PROBLEMS = {"conv": (ConvNet(), (6, 5, 5, 2)), "sequence": (SequenceNet(), (6, 4, 3))}


def _problem(name: str):
  return _problem_of(*PROBLEMS[name])


def _problem_of(model: nn.Module, shape: tuple[int, ...]):
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, shape, jnp.float64)
  y = jax.random.randint(ky, shape[:1], 0, 4)
  params = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(kp, x))

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)
  return loss_fn, params, x, y


def _batch(x, y, step: int):
  """A different batch per step (fresh inputs, the same shapes)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(100 + step))
  return jax.random.normal(k1, x.shape, x.dtype), jax.random.randint(k2, y.shape, 0, 4)


def _matrix(leaves: dict, layer) -> np.ndarray:
  """A layer's gradient as `[d_A, d_G]` (kernel rows, then the bias row);
  leading axes of per-example gradients kept."""
  kernel = np.asarray(leaves[layer.kernel_path])
  lead = kernel.shape[:kernel.ndim - len(layer.kernel_shape)]
  m = kernel.reshape(lead + (layer.a_dim - layer.has_bias, layer.g_dim))
  if layer.has_bias:
    bias = np.asarray(leaves[layer.bias_path]).reshape(lead + (1, layer.g_dim))
    m = np.concatenate([m, bias], axis=-2)
  return m


def _per_example_gradients(loss_fn, params, x, y) -> dict:
  """Each example's gradient of its own loss, by parameter path."""
  grads = jax.vmap(jax.grad(lambda p, xi, yi: loss_fn(p, xi[None], yi[None])),
                   in_axes=(None, 0, 0))(params, x, y)
  return _by_path(grads)


def _by_path(tree) -> dict:
  return {registry.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _brute_scaling(per_example: dict, layer, qa, qg) -> np.ndarray:
  """`(1/n) Σ_u (Q_Aᵀ ∇_u Q_G)²` in float64."""
  m = _matrix(per_example, layer)
  rotated = np.einsum("ai,uab,bj->uij", np.asarray(qa), m, np.asarray(qg))
  return np.mean(rotated ** 2, axis=0)


def _dense_solve(grad: np.ndarray, qa, qg, scaling: np.ndarray) -> np.ndarray:
  """`F̃⁻¹ vec(∇)` with `F̃ = (Q_A ⊗ Q_G) diag(vec(s) + γ) (Q_A ⊗ Q_G)ᵀ`, formed
  densely (row-major vec of `[d_A, d_G]`)."""
  q = np.kron(np.asarray(qa), np.asarray(qg))
  f = q @ np.diag(scaling.reshape(-1) + LAMBDA) @ q.T
  return np.linalg.solve(f, grad.reshape(-1)).reshape(grad.shape)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_corrected_scaling_equals_per_example_brute_force(name, chunked, monkeypatch):
  """The captured `S` of every Dense/Conv layer equals the per-example second
  moment in the state's eigenbases (taken after two steps: not the identity);
  `chunked`: the per-example matrices summed one example at a time (the scan
  of `statistics.corrected_scaling` for large layers)."""
  if chunked:
    monkeypatch.setattr(statistics_lib, "CHUNK_NUMBERS", 1)
  loss_fn, params, x, y = _problem(name)
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = kd.scale_by_kfac(layers, damping=LAMBDA, factor_dtype=jnp.float64,
                        eigenvalue_correction="ekfac")
  state, statistics, update = helpers.jitted_start(tx, grad_fn, params)
  for step in range(2):
    _, grads, stats = statistics(params, *_batch(x, y, step), opt_state=state)
    _, state = update(grads, state, kfac_stats=stats)
  _, _, stats = statistics(params, x, y, opt_state=state)
  per_example = _per_example_gradients(loss_fn, params, x, y)
  for layer in layers:
    qa, qg = state.correction_bases(layer.name)
    assert not np.allclose(np.asarray(qa), np.eye(qa.shape[0]))
    want = _brute_scaling(per_example, layer, qa, qg)
    helpers.assert_factor_close(stats[layer.name]["S"], want, layer.name)


def _check_five_steps(loss_fn, params, x, y, layers, update, state):
  """Five steps of `update(params, state, x, y) -> (updates, state)` (factors
  every step, eigenbases every second): each update equals the dense solve
  with the eigenbases the step started with and the scaling of the rule in
  `kfac.correction` (the batch's brute-force `S` on fresh eigenbases, else its
  running average; `v_A v_Gᵀ` after a decomposition), and the state keeps that
  scaling, as `kd.second_order_parts` reads it."""
  scaling = {layer.name: np.ones((layer.a_dim, layer.g_dim)) for layer in layers}
  fresh = True
  for step in range(5):
    xb, yb = _batch(x, y, step)
    grads = jax.grad(loss_fn)(params, xb, yb)
    per_example = _per_example_gradients(loss_fn, params, xb, yb)
    bases = {layer.name: state.correction_bases(layer.name) for layer in layers}
    got, new_state = update(params, state, xb, yb)
    for layer in layers:
      qa, qg = bases[layer.name]
      measured = _brute_scaling(per_example, layer, qa, qg)
      s = measured if fresh else DECAY * scaling[layer.name] + (1 - DECAY) * measured
      want = _dense_solve(_matrix(_by_path(grads), layer), qa, qg, s)
      np.testing.assert_allclose(_matrix(_by_path(got), layer), want, rtol=1e-10,
                                 atol=1e-12 * np.abs(want).max(),
                                 err_msg=f"step {step}, {layer.name}")
      scaling[layer.name] = s
    if step % 2 == 0:            # a decomposition: the new v_A v_Gᵀ, fresh
      parts = kd.second_order_parts(new_state)
      scaling = {n: np.outer(p["A"][1], p["G"][1]) for n, p in parts.items()}
    fresh = step % 2 == 0
    # The public reader (`second_order_parts`' "S") of the kept scaling.
    kept = {n: p["S"] for n, p in kd.second_order_parts(new_state).items()}
    for n, s in scaling.items():
      np.testing.assert_allclose(np.asarray(kept[n]), s, rtol=1e-10, atol=1e-14)
    state = new_state
    params = optax.apply_updates(params, jax.tree.map(lambda u: -0.1 * u, got))


def _ekfac(layers, **options):
  return kd.scale_by_kfac(layers, damping=LAMBDA, factor_decay=DECAY,
                          inverse_update_every=2, factor_dtype=jnp.float64,
                          eigenvalue_correction="ekfac", **options)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_updates_equal_the_dense_solve_in_the_basis(name):
  """One device: five steps follow `_check_five_steps`' rule."""
  loss_fn, params, x, y = _problem(name)
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = _ekfac(layers)

  @jax.jit
  def update(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    return tx.update(grads, state, kfac_stats=stats)
  _check_five_steps(loss_fn, params, x, y, layers, update, tx.init(params))


class RepeatedNet(nn.Module):
  """Three equal Dense layers and a head."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.tanh(kd.linen.Dense(5)(x))
    return kd.linen.Dense(4)(x)


def test_batched_preconditioning_follows_the_dense_solve(monkeypatch):
  """Off CPU the three equal layers are preconditioned as one run, their
  scalings stacked (`precondition.precondition`; forced here): five steps
  follow `_check_five_steps`' rule as one layer at a time does."""
  from kfac_jax_dist.kfac import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import precondition  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(precondition, "BATCH_RUNS", True)
  loss_fn, params, x, y = _problem_of(RepeatedNet(), (6, 5))
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = _ekfac(layers)
  state = tx.init(params)
  runs = layout_lib.precondition_runs(find_states(state)[0].layout, 0)
  assert sorted(len(run) for run in runs) == [1, 3]

  @jax.jit
  def update(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    return tx.update(grads, state, kfac_stats=stats)
  _check_five_steps(loss_fn, params, x, y, layers, update, state)


class _NormedBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    h = jnp.tanh(kd.linen.Dense(5, param_dtype=jnp.float64)(x))
    return kd.linen.LayerNorm(param_dtype=jnp.float64)(h), None


class NormedNet(nn.Module):
  """Three equal Dense + LayerNorm blocks, unrolled or scanned, and a head."""
  scanned: bool = False

  @nn.compact
  def __call__(self, x):
    if self.scanned:
      x, _ = nn.scan(_NormedBlock, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)(name="blocks")(x, None)
    else:
      for _ in range(3):
        x, _ = _NormedBlock()(x)
    return kd.linen.Dense(4, param_dtype=jnp.float64)(x)


@pytest.mark.parametrize("scanned,batch_runs", [(False, True), (True, None)],
                         ids=["equal-layers-batched", "scanned-blocks"])
def test_unit_wise_runs_beside_corrected_layers(monkeypatch, scanned, batch_runs):
  """EK-FAC corrects the Kronecker layers only: a run of unit-wise layers
  (a transformer's LayerNorms, preconditioned as one batch off CPU, or a
  scanned stack's on CPU too) takes no scaling. Five steps equal
  preconditioning one layer at a time (`BATCH_RUNS = False`), which
  `test_updates_equal_the_dense_solve_in_the_basis` checks against the dense
  solve."""
  from kfac_jax_dist.kfac import precondition  # pylint: disable=import-outside-toplevel
  loss_fn, params, x, y = _problem_of(NormedNet(scanned), (6, 5))
  params = jax.tree.map(lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
                        params)                  # LayerNorm scales and biases not 1 and 0
  grad_fn = kd.value_and_grad(loss_fn)
  tx = _ekfac(grad_fn.discover(params, x, y))

  def five_steps(runs):
    monkeypatch.setattr(precondition, "BATCH_RUNS", runs)

    @jax.jit                        # traced anew: BATCH_RUNS is read when tracing
    def update(params, state, x, y):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      return tx.update(grads, state, kfac_stats=stats)
    p, state, out = params, tx.init(params), []
    for step in range(5):
      updates, state = update(p, state, *_batch(x, y, step))
      p = optax.apply_updates(p, jax.tree.map(lambda u: -0.1 * u, updates))
      out.append(updates)
    return out
  for got, want in zip(five_steps(batch_runs), five_steps(False)):
    helpers.assert_trees_equal(got, want, rtol=1e-10)


class _DeepScanned(nn.Module):
  """16 scanned Dense blocks and a head: at P = 8 under MEM-OPT most owner
  groups precondition blocks of one kind, and share a branch."""

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=16)(name="blocks")(x, None)
    return kd.linen.Dense(4, param_dtype=jnp.float64)(x)


def _scanned_problem(model: nn.Module, batch: int):
  """(grad_fn, params, x, y) of a scanned model of 4-wide blocks, float64."""
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, 4), jnp.float64)
  y = jax.random.randint(jax.random.PRNGKey(2), (batch,), 0, 4)
  params = model.init(jax.random.PRNGKey(3), x)["params"]

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)
  return kd.value_and_grad(loss_fn), params, x, y


def test_shared_group_branches_read_their_own_scaling():
  """MEM-OPT at P = 8 on 16 scanned blocks: owner groups holding the same
  kinds of blocks share one preconditioning branch (`Layout.group_branches`),
  each reading its gradients and its blocks' EK-FAC scaling at its own shift
  (`correction.scaling_reader`); four steps equal one device's."""
  grad_fn, params, x, y = _scanned_problem(_DeepScanned(), 16)
  layers = grad_fn.discover(params, x, y)

  def train(dist):
    tx = _ekfac(layers, distribution=dist)

    def step(params, state, x, y):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      if dist is not None:
        grads = jax.lax.pmean(grads, "data")
      updates, state = tx.update(grads, state, kfac_stats=stats)
      return optax.apply_updates(params, jax.tree.map(lambda u: -0.1 * u, updates)), state
    run, state = helpers.compile_step(step, tx.init(params), dist, 2)
    p = params
    for i in range(4):
      p, state = run(p, state, *_batch(x, y, i))
    return p, state
  got, state = train(kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8))
  reps = find_states(state)[0].layout.group_branches
  assert any(reps.count(g) > 1 for g in set(reps))
  want, _ = train(None)
  # float64 rounding of 16 blocks, 8 devices' sums: ≤ 2e-7 relative; a branch
  # reading the representative group's scaling is off by O(1)
  helpers.assert_trees_equal(got, want, rtol=1e-6)


@pytest.mark.slow     # (CI time; K-FAC's DP-KFAC local factors are checked by default elsewhere)
def test_dp_kfac_local_eigenbases_and_the_global_scaling():
  """DP-KFAC (factor_reduction="local", one owner per device): each layer's
  eigenbases are those of its owner's local factors (its 3 examples), `S` is
  the whole batch's in them (averaged over the data axis), and the five steps
  follow the rule above."""
  loss_fn, params, x, y = _problem("conv")
  x, y = jnp.concatenate([x] * 4), jnp.concatenate([y] * 4)   # 24: 3 per device
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                         factor_reduction="local")
  tx = _ekfac(layers, distribution=dist)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    updates, state = tx.update(jax.lax.pmean(grads, "data"), state, kfac_stats=stats)
    return updates, state
  run, state = helpers.compile_step(step, tx.init(params), dist, 2)
  _check_five_steps(loss_fn, params, x, y, layers, run, state)
  # The first decomposition (count 0) is of each owner's statistics of its batch.
  _, state = run(params, state, *_batch(x, y, 0))
  _, _, whole = grad_fn(params, *_batch(x, y, 0))
  parts = kd.second_order_parts(state)
  for plan in state.layout.plans:
    for place, key in ((plan.a, "A"), (plan.g, "G")):
      rows = slice(3 * place.owner, 3 * place.owner + 3)
      _, _, local = grad_fn(params, *(b[rows] for b in _batch(x, y, 0)))
      basis, values = (np.asarray(a) for a in parts[plan.layer.name][key])
      rebuilt = basis @ np.diag(values) @ basis.T
      want = np.asarray(local[plan.layer.name][key])
      np.testing.assert_allclose(rebuilt, want, atol=1e-12 * np.abs(want).max(),
                                 err_msg=f"{plan.layer.name} {key}")
      assert not np.allclose(rebuilt, whole[plan.layer.name][key], atol=1e-6)
  assert len({s.owner for p in state.layout.plans for s in (p.a, p.g)}) > 1


STALE_THRESHOLD = 0.5     # the random batches' factors differ by ~0.2-0.6


def _steps_equal_one_device(grad_fn, params, x, y, dist, options: dict, average: bool):
  """Four steps of `kd.kfac(0.1, 0.9, **options)` on `dist` (jit +
  shard_map; `average`: the step pmeans the gradients) and on one device,
  on the same batches: the parameters agree to 1e-9 after each. Returns the
  two final states."""
  single, tx = kd.kfac(0.1, 0.9, **options), kd.kfac(0.1, 0.9, distribution=dist, **options)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    if average:
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state
  run, state = helpers.compile_step(step, tx.init(params), dist, 2)
  one_state, one_grad_fn, one_update = helpers.jitted_start(single, grad_fn, params)
  one_params = params
  for i in range(4):
    xb, yb = _batch(x, y, i)
    params, state = run(params, state, xb, yb)
    _, grads, stats = one_grad_fn(one_params, xb, yb, opt_state=one_state)
    updates, one_state = one_update(grads, one_state, one_params, kfac_stats=stats)
    one_params = optax.apply_updates(one_params, updates)
    helpers.assert_trees_equal(params, one_params, rtol=1e-9)
  return state, one_state


@pytest.mark.parametrize("fraction,reduction,stale,devices", [
    pytest.param(1, "all_reduce", False, 8, marks=pytest.mark.slow),
    # MEM-OPT's gathered eigenbases: test_gathered_eigenbases_skip_devices_holding_only_copies
    pytest.param(1 / 8, "all_reduce", False, 8, marks=pytest.mark.slow),
    pytest.param(1 / 4, "all_reduce", False, 8, marks=pytest.mark.slow),
    pytest.param(1 / 8, "reduce_scatter", False, 8, marks=pytest.mark.slow),
    pytest.param(1, "all_reduce", True, 8, marks=pytest.mark.slow),
    (1 / 2, "all_reduce", True, 8),
    pytest.param(1, "all_reduce", True, 4, marks=pytest.mark.slow)],
    ids=["comm_opt", "mem_opt", "hybrid", "sp_ngd", "comm_opt-stale", "hybrid-stale",
         "comm_opt-stale-4-devices"])
def test_eight_devices_equal_one_device(fraction, reduction, stale, devices):
  """On 8 CPU devices (per-device statistics, `S` averaged over the axis; the
  eigenbases gathered with several owner groups) K-FAC with EK-FAC equals the
  single-device run under COMM-OPT, MEM-OPT, HYBRID-OPT and SP-NGD's fused
  gradient reduce-scatter, and with stale statistics (each layer's scaling
  reset when one of its factors refreshes). COMM-OPT's owners share the
  replicated array's row (`Layout.second_slots`), where the scaling reads
  its eigenbases; in HYBRID's groups (`hybrid-stale`) each owner's segment,
  gathered for the scaling, comes from its column of its group's row. With
  several groups the gathered eigenbases lie one after another too
  (`Layout.owner_slots`), exactly the numbers read."""
  loss_fn, params, x, y = _problem("conv")
  x, y = jnp.concatenate([x] * 4), jnp.concatenate([y] * 4)   # 24: 3 per device
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(devices), grad_worker_fraction=fraction,
                         gradient_reduction=reduction)
  options = dict(layers=layers, damping=LAMBDA, factor_dtype=jnp.float64,
                 eigenvalue_correction="ekfac")
  options |= (dict(stale_threshold=STALE_THRESHOLD) if stale
              else dict(inverse_update_every=2))
  state, one_state = _steps_equal_one_device(grad_fn, params, x, y, dist, options,
                                              reduction == "all_reduce")
  kfac = find_states(state)[0]
  lay = kfac.layout
  assert lay.rows_shared == (lay.group_size > 1)
  if lay.num_groups > 1:     # every owner's eigenbases, one after another
    assert kfac.correction.bases.shape == (lay.owner_array,)
    assert lay.owner_array == sum(lay.read_sizes) < devices * lay.second_segment
  if stale:                                  # some factors were left stale
    refreshes = np.asarray(find_states(state)[0].refresh.refreshes)
    np.testing.assert_array_equal(refreshes, find_states(one_state)[0].refresh.refreshes)
    assert 1 <= refreshes.min() < 4, refreshes


def test_chunked_scaling_inside_shard_map(monkeypatch):
  """A layer whose per-example matrices are summed in chunks (ResNet-50's
  4608 x 512 convolutions: `statistics.CHUNK_NUMBERS`, here one example per
  chunk) traces inside shard_map, where the chunks' sums vary over the data
  axis, and the EK-FAC steps equal one device's."""
  monkeypatch.setattr(statistics_lib, "CHUNK_NUMBERS", 1)
  loss_fn, params, x, y = _problem("conv")
  x, y = jnp.concatenate([x] * 4), jnp.concatenate([y] * 4)   # 24: 3 per device
  grad_fn = kd.value_and_grad(loss_fn)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                         gradient_reduction="all_reduce")
  options = dict(layers=grad_fn.discover(params, x, y), damping=LAMBDA,
                 factor_dtype=jnp.float64, eigenvalue_correction="ekfac",
                 inverse_update_every=2)
  _steps_equal_one_device(grad_fn, params, x, y, dist, options, True)


def test_gathered_eigenbases_skip_devices_holding_only_copies():
  """MEM-OPT with a layer split over devices (conv_dense's dense layer on 8:
  five devices hold only copies of it): the capture reads each layer's home
  copy, so devices holding only copies send nothing to the gathered
  eigenbases (`Layout.read_sizes`), and the EK-FAC steps equal one device's
  (float64; 256 examples, so that every factor has full rank: in a repeated
  eigenvalue's eigenspace `s` depends on the basis eigh happens to return)."""
  loss_fn, params, x, y = helpers.classifier_problem(helpers.ConvDenseNet(), (256, 8, 8, 2))
  params, x = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x))
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                         gradient_reduction="all_reduce")
  options = dict(layers=layers, damping=LAMBDA, eigenvalue_correction="ekfac",
                 factor_dtype=jnp.float64, inverse_update_every=2)
  state, _ = _steps_equal_one_device(grad_fn, params, x, y, dist, options, True)
  kfac = find_states(state)[0]
  lay = kfac.layout
  assert sum(r == 0 < n for r, n in zip(lay.read_sizes, lay.second_sizes)) == 5
  assert kfac.correction.bases.shape == (lay.owner_array,)
  assert lay.owner_array < sum(lay.second_sizes)


def test_stale_threshold_zero_is_ekfac():
  """α = 0: every factor refreshes at every step, so every layer's scaling is
  reset at every step, as EK-FAC's with both intervals 1."""
  loss_fn, params, x, y = _problem("conv")
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)

  def run(**options):
    tx = kd.kfac(0.1, 0.9, layers=layers, damping=LAMBDA, factor_dtype=jnp.float64,
                 eigenvalue_correction="ekfac", **options)
    (state, statistics, update), p = helpers.jitted_start(tx, grad_fn, params), params
    for i in range(4):
      _, grads, stats = statistics(p, *_batch(x, y, i), opt_state=state)
      updates, state = update(grads, state, p, kfac_stats=stats)
      p = optax.apply_updates(p, updates)
    return p, find_states(state)[0]
  (plain, _), (stale, state) = run(), run(stale_threshold=0.0)
  assert np.all(np.asarray(state.refresh.refreshes) == 4)
  helpers.assert_trees_equal(stale, plain, rtol=1e-9)


@pytest.mark.parametrize("options,message", [
    (dict(method="inverse"), 'method="eigen"'),
    (dict(eigenvalue_correction="shampoo"), "eigenvalue_correction must be"),
])
def test_refused_settings(options, message):
  with pytest.raises(ValueError, match=message):
    kd.scale_by_kfac(None, **({"eigenvalue_correction": "ekfac"} | options))


def test_non_finite_statistic_skips_and_convert_state_keeps_the_scaling():
  """A NaN input skips the step (scaling unchanged); `convert_state` moves the
  scaling to a state of another distribution."""
  loss_fn, params, x, y = _problem("conv")
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = kd.scale_by_kfac(layers, damping=LAMBDA, factor_dtype=jnp.float64,
                        inverse_update_every=3, eigenvalue_correction="ekfac")
  state, statistics, update = helpers.jitted_start(tx, grad_fn, params)
  for i in range(2):
    _, grads, stats = statistics(params, *_batch(x, y, i), opt_state=state)
    _, state = update(grads, state, kfac_stats=stats)
  bad = x.at[0, 0, 0, 0].set(jnp.nan)
  _, grads, stats = statistics(params, bad, y, opt_state=state)
  _, skipped = update(grads, state, kfac_stats=stats)
  assert int(skipped.skipped) == 1
  np.testing.assert_array_equal(np.asarray(skipped.correction.scaling),
                                np.asarray(state.correction.scaling))
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1)
  moved = kd.convert_state(state, kd.scale_by_kfac(
      layers, distribution=dist, factor_dtype=jnp.float64,
      eigenvalue_correction="ekfac").init(params))
  np.testing.assert_array_equal(np.asarray(moved.correction.scaling),
                                np.asarray(state.correction.scaling))
  with pytest.raises(ValueError, match="eigenvalue_correction"):
    kd.convert_state(state, kd.scale_by_kfac(layers, factor_dtype=jnp.float64).init(params))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return jnp.tanh(kd.linen.Dense(4, param_dtype=jnp.float64)(x)), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)
    x, _ = blocks(name="blocks")(x, None)
    return kd.linen.Dense(4, param_dtype=jnp.float64)(x)


class _Unrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x, _ = _Block(name=f"block_{i}")(x)
    return kd.linen.Dense(4, param_dtype=jnp.float64)(x)


# (slow, for CI time: test_scan covers scanned layers and this module EK-FAC;
# .ci/run runs the adaptive case on the oldest jax)
@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_scanned_layers_equal_unrolled(adaptive):
  """A `nn.scan`ned stack of Dense blocks (stacked eigenbases in the capture's
  probes) trains exactly as its unrolled copy, fixed and adaptive."""
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 4), jnp.float64)
  y = jax.random.randint(jax.random.PRNGKey(2), (8,), 0, 4)
  stacked = _Scanned().init(jax.random.PRNGKey(3), x)["params"]
  unrolled = {f"block_{i}": jax.tree.map(lambda a, i=i: a[i], stacked["blocks"])
              for i in range(3)} | {"Dense_0": stacked["Dense_0"]}

  def train(model, params):
    def loss_fn(p, x, y):
      return kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)
    grad_fn = kd.value_and_grad(loss_fn)
    tx = kd.kfac(None if adaptive else 0.1, None if adaptive else 0.9,
                 layers=grad_fn.discover(params, x, y), grad_fn=grad_fn,
                 damping=LAMBDA, factor_dtype=jnp.float64, inverse_update_every=2,
                 eigenvalue_correction="ekfac")
    state = tx.init(params)
    for i in range(4):
      xb, yb = _batch(x, y, i)
      _, grads, stats = grad_fn(params, xb, yb, opt_state=state)
      updates, state = tx.update(grads, state, params, kfac_stats=stats,
                                 kfac_batch=(xb, yb))
      params = optax.apply_updates(params, updates)
    return params
  got, want = train(_Scanned(), stacked), train(_Unrolled(), unrolled)
  for i in range(3):
    helpers.assert_trees_equal(jax.tree.map(lambda a, i=i: a[i], got["blocks"]),
                               want[f"block_{i}"], rtol=1e-10)
  helpers.assert_trees_equal(got["Dense_0"], want["Dense_0"], rtol=1e-10)


def test_reset_scaling_of_scanned_blocks_is_each_blocks_own():
  """After a decomposition the scaling is each corrected layer's `v_A v_Gᵀ`
  (fresh), a stack's blocks read as one run (`correction._corrected_runs`):
  block by block, its own eigenvalues' outer product; and the batch's `S` of
  each block is its own slice of the stacked statistic."""
  grad_fn, params, x, y = _scanned_problem(_Scanned(), 8)
  tx = _ekfac(grad_fn.discover(params, x, y))
  state, statistics, update = helpers.jitted_start(tx, grad_fn, params)
  _, _, stats = statistics(params, x, y, opt_state=state)
  _, state = update(params, state, kfac_stats=stats)       # count 0: decomposition
  kept = correction_lib.layer_scaling(state.layout, state.correction)
  parts = kd.second_order_parts(state)
  assert {"blocks/Dense_0/0", "blocks/Dense_0/2"} <= set(parts)
  for name, p in parts.items():
    np.testing.assert_allclose(kept[name], np.outer(p["A"][1], p["G"][1]), rtol=1e-12)
  runs = correction_lib.layer_statistics(state.layout, stats)
  assert [r.shape[0] for r in runs] == [3, 1]           # the stack's blocks, the head
  np.testing.assert_array_equal(runs[0], stats["blocks/Dense_0"]["S"])


def test_accumulated_micro_batches_equal_the_whole_batch():
  """`grad_fn.accumulate` weights `S` like `G`: two micro-batches give the
  whole batch's `S`."""
  loss_fn, params, x, y = _problem("sequence")
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = kd.scale_by_kfac(layers, damping=LAMBDA, factor_dtype=jnp.float64,
                        eigenvalue_correction="ekfac")
  state = tx.init(params)
  _, grads, stats = grad_fn(params, x, y, opt_state=state)
  _, state = tx.update(grads, state, kfac_stats=stats)
  _, _, whole = grad_fn(params, x, y, opt_state=state)
  _, _, parts = grad_fn.accumulate(params, x, y, micro_batches=2, opt_state=state)
  for layer in layers:
    helpers.assert_factor_close(parts[layer.name]["S"], whole[layer.name]["S"], layer.name)


def test_describe_explains_the_correction():
  loss_fn, params, x, y = _problem("conv")
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8)
  state = kd.scale_by_kfac(layers, distribution=dist,
                           eigenvalue_correction="ekfac").init(params)
  text = kd.describe(state, print_table=False)
  numbers = sum(layer.a_dim * layer.g_dim for layer in layers)
  assert f"EK-FAC: the scaling s of 3 Dense/Conv layers, {numbers:,} numbers" in text
  assert "eigenbases gathered for the capture" in text


def test_checkpoint_round_trip(tmp_path):
  """The scaling (and, with owner groups, the gathered eigenbases) are saved
  and restored with the rest of the state."""
  loss_fn, params, x, y = _problem("conv")
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), factor_dtype=jnp.float64,
               eigenvalue_correction="ekfac")
  state, statistics, update = helpers.jitted_start(tx, grad_fn, params)
  for i in range(2):
    _, grads, stats = statistics(params, *_batch(x, y, i), opt_state=state)
    _, state = update(grads, state, params, kfac_stats=stats)
  kd.save_checkpoint(tmp_path / "ekfac", state)
  restored = kd.restore_checkpoint(tmp_path / "ekfac", tx.init(params))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_layout_before_shared_rows_converts():
  """MEM-OPT: the gathered eigenbases of a checkpoint saved before they
  shared rows are `[P·L₂]`, and before rows were wide, rows of `L₂`
  (`checkpoint._saved_layouts`, the layouts `restore_checkpoint` restores
  such checkpoints in); `convert_state` moves them into today's wide rows and
  back bit for bit."""
  from kfac_jax_dist.tools import checkpoint  # pylint: disable=import-outside-toplevel
  loss_fn, params, x, y = _problem("conv")
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8)
  state = kd.kfac(0.1, layers=layers, distribution=dist, eigenvalue_correction="ekfac",
                  factor_dtype=jnp.float64).init(params)
  lay = find_states(state)[0].layout
  assert lay.owner_array == sum(lay.read_sizes)
  padded = checkpoint._saved_layouts(state, {})
  rows = checkpoint._saved_layouts(state, {checkpoint.SHARED_ROWS: True})
  assert find_states(padded)[0].correction.bases.shape == (8 * lay.second_segment,)
  assert lay.owner_array < find_states(rows)[0].layout.owner_array < 8 * lay.second_segment
  for template in (padded, rows):
    back = kd.convert_state(kd.convert_state(state, template), state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _SequenceConv(nn.Module):
  """A strided 1-D convolution over sequences, or the same one written as a
  2-D convolution over images of height 1 (`as_image`)."""

  as_image: bool = False

  @nn.compact
  def __call__(self, x):
    if self.as_image:
      conv = kd.linen.Conv(5, (1, 3), strides=(1, 2), param_dtype=jnp.float64, name="c")
      h = conv(x[:, None])[:, 0]
    else:
      h = kd.linen.Conv(5, (3,), strides=2, param_dtype=jnp.float64, name="c")(x)
    return kd.linen.Dense(4, param_dtype=jnp.float64, name="d")(jnp.tanh(h).mean(1))


@pytest.mark.parametrize("correction", [None, "ekfac"])
def test_conv1d_steps_equal_the_height_one_conv2d(correction):
  """K-FAC and EK-FAC (`S` from each sequence's patches) steps of a 1-D
  convolution equal those of the same convolution as a height-1 2-D one."""
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 12, 3), jnp.float64)
  y = jnp.arange(8) % 4
  params = _SequenceConv().init(jax.random.PRNGKey(1), x)
  image_params = jax.tree.map(lambda a: a, params)
  image_params["params"]["c"]["kernel"] = params["params"]["c"]["kernel"][None]
  runs = []
  for model, p in ((_SequenceConv(), params), (_SequenceConv(True), image_params)):
    grad_fn = kd.value_and_grad(
        lambda p, x, y, model=model: kd.losses.softmax_cross_entropy(model.apply(p, x), y))
    tx = kd.kfac(0.1, layers=grad_fn.discover(p, x, y), eigenvalue_correction=correction,
                 factor_dtype=jnp.float64, damping=LAMBDA)
    state = tx.init(p)

    @jax.jit
    def step(p, state, grad_fn=grad_fn, tx=tx):
      _, grads, stats = grad_fn(p, x, y, opt_state=state)
      updates, state = tx.update(grads, state, p, kfac_stats=stats)
      return optax.apply_updates(p, updates), state
    for _ in range(3):
      p, state = step(p, state)
    runs.append(p)
  runs[1]["params"]["c"]["kernel"] = runs[1]["params"]["c"]["kernel"][0]
  helpers.assert_trees_equal(runs[0], runs[1])
