"""Tensor-parallel meshes ("data", "model") on 2 x 4 CPU devices: K-FAC and
Shampoo preconditioning each model shard's local shard equal one device
running the same block structure (the sharded layers written as M layers on
their column / row blocks)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac import adaptive
from kfac_jax_dist.kfac import correction
from kfac_jax_dist.kfac.state import find_states
from helpers import compile_step

DATA, M = 2, 4
STEPS = 7            # counts 0..6: inverse at 0, 3, 6; factor-only at 2, 4; plain 1, 5
D_IN, HIDDEN, D_OUT, CLASSES = 6, 8, 6, 5

PARAM_SPECS = {"col": {"kernel": P(None, "model"), "bias": P("model")},
               "row": {"kernel": P("model", None)},
               "rbias": P(),
               "norm": {"scale": P(), "offset": P()},
               "head": {"kernel": P(), "bias": P()}}


def _mesh():
  return helpers.mesh((DATA, M), ("data", "model"))


def _problem(classes=CLASSES):
  k = jax.random.split(jax.random.PRNGKey(0), 8)
  params = {"col": {"kernel": jax.random.normal(k[0], (D_IN, HIDDEN)) * 0.5,
                    "bias": jax.random.normal(k[1], (HIDDEN,)) * 0.1},
            "row": {"kernel": jax.random.normal(k[2], (HIDDEN, D_OUT)) * 0.5},
            "rbias": jax.random.normal(k[3], (D_OUT,)) * 0.1,
            "norm": {"scale": 1.0 + 0.1 * jax.random.normal(k[4], (D_OUT,)),
                     "offset": jnp.zeros(D_OUT)},
            "head": {"kernel": jax.random.normal(k[5], (D_OUT, classes)) * 0.5,
                     "bias": jnp.zeros(classes)}}
  x = jax.random.normal(k[6], (32, D_IN))
  y = jax.random.randint(k[7], (32,), 0, classes)
  return params, x, y


def _top(p, z, y):
  """Everything after the row-parallel layer's sum (replicated layers)."""
  z = z + p["rbias"]
  z = (z - z.mean(-1, keepdims=True)) / jnp.sqrt(z.var(-1, keepdims=True) + 1e-5)
  z = kd.tags.scale_and_shift(z, p["norm"]["scale"], p["norm"]["offset"])
  logits = kd.tags.dense(jnp.tanh(z), p["head"]["kernel"], p["head"]["bias"])
  return kd.losses.softmax_cross_entropy(logits, y)


def tp_loss(p, x, y):
  """Megatron MLP: column-parallel then row-parallel Dense, psum over "model"."""
  h = jnp.tanh(kd.tags.dense(x, p["col"]["kernel"], p["col"]["bias"]))
  z = jax.lax.psum(kd.tags.dense(h, p["row"]["kernel"]), "model")
  return _top(p, z, y)


def block_loss(p, x, y):
  """The same model on one device, the sharded layers as M tagged layers on
  their column (row) blocks."""
  hs = [jnp.tanh(kd.tags.dense(x, p[f"col{i}"]["kernel"], p[f"col{i}"]["bias"]))
        for i in range(M)]
  z = sum(kd.tags.dense(hs[i], p[f"row{i}"]["kernel"]) for i in range(M))
  return _top(p, z, y)


def to_blocks(p):
  """TP params (global arrays) → the block model's params."""
  c, r, n = p["col"], p["row"], HIDDEN // M
  out = {k: v for k, v in p.items() if k not in ("col", "row")}
  for i in range(M):
    out[f"col{i}"] = {"kernel": c["kernel"][:, i * n:(i + 1) * n],
                      "bias": c["bias"][i * n:(i + 1) * n]}
    out[f"row{i}"] = {"kernel": r["kernel"][i * n:(i + 1) * n]}
  return out


def _assert_same(trajectory, reference, rtol=2e-4, atol=2e-5):
  for step, (got, want) in enumerate(zip(trajectory, reference)):
    check = functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol,
                              err_msg=f"step {step}")
    jax.tree.map(check, to_blocks(got), want)


def _train(tx_of, loss_fn, params, x, y, dist=None, steps=STEPS, adaptive=False):
  """`steps` updates; with `dist`, inside shard_map over both mesh axes, the
  state sharded by kd.partition_specs (checked stable across updates).
  `adaptive`: `tx_of(layers, grad_fn)`, updated with `kfac_batch=`."""
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y, distribution=dist)
  tx = tx_of(layers, grad_fn) if adaptive else tx_of(layers)
  state = tx.init(params)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    if dist is not None and dist.gradient_reduction == "none":
      grads = jax.lax.pmean(grads, "data")
    batch = {"kfac_batch": (x, y)} if adaptive else {}
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **batch)
    return optax.apply_updates(params, updates), state

  step, state = compile_step(step, state, dist, 2, param_specs=PARAM_SPECS)
  trajectory, shardings = [], None
  for _ in range(steps):
    params, state = step(params, state, x, y)
    trajectory.append(params)
    if dist is not None:
      now = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.spec), state)
      assert shardings is None or now == shardings, "state sharding changed"
      shardings = now
  return trajectory, state


def _dist(fraction=1.0, **kw):
  return kd.Distribution(_mesh(), axis="data", grad_worker_fraction=fraction,
                         model_axis="model", param_specs=PARAM_SPECS, **kw)


def _kfac(layers, dist=None, method="eigen"):
  return kd.kfac(0.1, layers=layers, damping=1e-2, factor_update_every=2,
                 inverse_update_every=3, kl_clip=1e-2, method=method,
                 distribution=dist)


@functools.cache
def _kfac_reference(method="eigen"):
  params, x, y = _problem()
  return _train(functools.partial(_kfac, method=method), block_loss, to_blocks(params),
                x, y)


@pytest.mark.parametrize("fraction,factor_reduction,gradient_reduction", [
    pytest.param(1.0, "reduce_scatter", "none", marks=pytest.mark.slow),
    (1 / 2, "all_reduce", "none"),
    pytest.param(1 / 2, "reduce_scatter", "reduce_scatter", marks=pytest.mark.slow)],
    ids=["COMM-OPT", "MEM-OPT", "MEM-OPT-SP-NGD"])
def test_kfac_tensor_parallel_equals_block_model(fraction, factor_reduction,
                                                 gradient_reduction):
  params, x, y = _problem()
  dist = _dist(fraction, factor_reduction=factor_reduction,
               gradient_reduction=gradient_reduction)
  trajectory, opt_state = _train(lambda layers: _kfac(layers, dist), tp_loss, params, x,
                                 y, dist)
  reference, ref_state = _kfac_reference()
  _assert_same(trajectory, reference)
  # Model shard i's factors are the block model's i-th column (row) layer's.
  want = kd.running_factors(find_states(ref_state)[0])
  for i in range(M):
    got = kd.running_factors(find_states(kd.model_shard(opt_state, i))[0])
    for name, ref in (("col", f"col{i}"), ("row", f"row{i}"), ("head", "head"),
                      ("norm", "norm")):
      for key in got[name]:
        np.testing.assert_allclose(got[name][key], want[ref][key], rtol=1e-4, atol=1e-6,
                                   err_msg=f"shard {i} {name} {key}")
  # Specs over both axes; the momentum is sharded like the parameters.
  specs = kd.partition_specs(opt_state)
  kfac_specs, = _of_type(specs, kd.ModelShardedState)
  assert kfac_specs.inner.factors == P(("model", "data"))
  assert kfac_specs.inner.second_order == (P("model") if fraction == 1
                                           else P(("model", "data")))
  assert kfac_specs.inner.count == P()
  momentum, = _of_type(specs, optax.TraceState)
  assert momentum.trace == PARAM_SPECS


def _ekfac(layers, dist=None):
  return kd.kfac(0.1, layers=layers, damping=1e-2, factor_update_every=2,
                 inverse_update_every=3, kl_clip=1e-2, eigenvalue_correction="ekfac",
                 distribution=dist)


@pytest.mark.parametrize("fraction", [1.0, pytest.param(1 / 2, marks=pytest.mark.slow)],
                         ids=["COMM-OPT", "MEM-OPT"])
def test_ekfac_tensor_parallel_equals_block_model(fraction):
  """EK-FAC on the TP mesh equals the block model's EK-FAC on one device: each
  model shard measures `S` of its local shards (the column and row blocks) in
  its own eigenbases, averaged over "data"; its scaling is the block layer's.
  With more classes than D_OUT the row layer's output gradients span R^D_OUT:
  a repeated zero eigenvalue of its G would leave its eigenvectors any basis
  of their space, and EK-FAC measures its scaling in the eigenbasis."""
  params, x, y = _problem(classes=D_OUT + 2)
  dist = _dist(fraction)
  trajectory, opt_state = _train(functools.partial(_ekfac, dist=dist), tp_loss, params, x,
                                 y, dist)
  reference, ref_state = _train(_ekfac, block_loss, to_blocks(params), x, y)
  _assert_same(trajectory, reference)
  ref = find_states(ref_state)[0]
  want = correction.layer_scaling(ref.layout, ref.correction)
  opt_state = jax.device_get(opt_state)
  for i in range(M):
    shard = find_states(kd.model_shard(opt_state, i))[0]
    got = correction.layer_scaling(shard.layout, shard.correction)
    assert set(got) == {"col", "row", "head"}
    for name, block in (("col", f"col{i}"), ("row", f"row{i}"), ("head", "head")):
      np.testing.assert_allclose(got[name], want[block], rtol=1e-4, atol=1e-7,
                                 err_msg=f"shard {i} {name}")


def test_describe_counts_every_model_shard():
  """`kd.describe` of a tensor-parallel K-FAC state: one model shard's layers,
  said to be kept for each of the `M` shards, and the state's bytes on all
  `DATA · M` devices, `M` times one data group's."""
  params, x, y = _problem()
  grad_fn = kd.value_and_grad(tp_loss)
  dist = _dist(1 / 2)
  text = kd.describe(_kfac(grad_fn.discover(params, x, y, distribution=dist), dist).init(
      params), print_table=False)
  assert f"kept for each of the {M} model shards ({DATA * M} devices)" in text
  per_device, on_all = (int(v.replace(",", "")) for v in re.search(
      r"K-FAC state: ([\d,]+) bytes per device \(([\d,]+) on all (\d+) devices\)",
      text).groups()[:2])
  assert on_all == DATA * M * per_device


@pytest.mark.slow     # (.ci/run runs it on the oldest jax)
def test_convert_state_between_strategies_continues():
  """Two steps under COMM-OPT, `kd.convert_state` to MEM-OPT (each model
  shard's state moved on its own: factors, eigenbases, counters), five more:
  the block model's uninterrupted trajectory (step 2 preconditions with the
  moved eigenbases of step 0)."""
  params, x, y = _problem()
  grad_fn = kd.value_and_grad(tp_loss)
  comm, mem = _dist(1.0), _dist(1 / 2)
  layers = grad_fn.discover(params, x, y, distribution=comm)

  def run(tx, dist, params, state, steps):
    def step(params, state, x, y):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      grads = jax.lax.pmean(grads, "data")
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), state
    compiled, state = compile_step(step, state, dist, 2, param_specs=PARAM_SPECS)
    out = []
    for _ in range(steps):
      params, state = compiled(params, state, x, y)
      out.append(params)
    return out, state

  first, state = run(_kfac(layers, comm), comm, params, _kfac(layers, comm).init(params), 2)
  template = _kfac(layers, mem).init(params)
  moved = kd.convert_state(state, template)
  assert jax.tree.map(jnp.shape, moved) == jax.tree.map(jnp.shape, template)
  on_host = jax.device_get((moved, state))
  for i in (0, 3):
    got, want = (kd.running_factors(find_states(kd.model_shard(x, i))[0])["row"]["G"]
                 for x in on_host)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  rest, _ = run(_kfac(layers, mem), mem, first[-1], moved, STEPS - 2)
  reference, _ = _kfac_reference()
  _assert_same(first + rest, reference)
  is_sharded = lambda n: isinstance(n, kd.ModelShardedState)
  other_specs = jax.tree.map(                  # a template of other param_specs
      lambda n: dataclasses.replace(n, sharding=dataclasses.replace(
          n.sharding, specs=n.sharding.specs[::-1])) if is_sharded(n) else n,
      template, is_leaf=is_sharded)
  with pytest.raises(ValueError, match="same model axes, sizes and param_specs"):
    kd.convert_state(state, other_specs)


def test_stale_statistics_keep_one_schedule_on_every_model_shard():
  """A column-parallel layer fed hand-made statistics, shard m's own: its `A`
  stays put, then jumps at step 12 + 4m; its `G` drifts by 2 + 2m % per step.
  Every shard refreshes each factor on the schedule of SP-NGD's rule with
  "similar" meaning similar on every shard (so no shard's program takes other
  branches than another's), and keeps its own statistics."""
  steps, alpha = 36, 0.1
  a_seq = [[np.diag([1.0, 2.0, 3.0]) * (3.0 if t >= 12 + 4 * m else 1.0)
            for t in range(steps)] for m in range(M)]
  g_seq = [[np.diag([1.0, 1.5]) * (1.02 + 0.02 * m) ** t for t in range(steps)]
           for m in range(M)]
  specs = {"l": {"kernel": P(None, "model")}}
  dist = kd.Distribution(_mesh(), axis="data", model_axis="model", param_specs=specs)
  layer = kd.TaggedLayer(name="l", kind="dense", kernel_path="l/kernel", bias_path=None,
                         kernel_shape=(3, 2), a_dim=3, g_dim=2)       # the local shard
  tx = kd.scale_by_kfac(layers=kd.LayerRegistry((layer,)), damping=0.1, factor_decay=0.0,
                        stale_threshold=alpha, distribution=dist)
  params = {"l": {"kernel": jnp.ones((3, 2 * M))}}
  state = kd.shard_state(tx.init(params), dist.mesh)

  def update(grads, state, a, g):
    stats = {"l": {"A": a[0], "G": g[0]}}
    return tx.update(grads, state, kfac_stats=stats)[1]
  update = jax.jit(jax.shard_map(
      update, mesh=dist.mesh,
      in_specs=(specs, kd.partition_specs(state), P("model"), P("model")),
      out_specs=kd.partition_specs(state)))
  refreshed = {m: {"A": [], "G": []} for m in range(M)}
  # (the states are read on the host: eager ops on the 8-device arrays between
  # the steps' dispatches can deadlock XLA's CPU collectives on a loaded machine)
  counts = lambda state: [np.asarray(find_states(kd.model_shard(state, m))[0]
                                     .refresh.refreshes) for m in range(M)]
  before = counts(jax.device_get(state))
  for t in range(steps):
    state = update(params, state,
                   jnp.asarray(np.stack([a[t] for a in a_seq]), jnp.float32),
                   jnp.asarray(np.stack([g[t] for g in g_seq]), jnp.float32))
    after = counts(jax.device_get(state))
    for m in range(M):
      for f, key in enumerate(("A", "G")):
        if after[m][f] > before[m][f]:
          refreshed[m][key].append(t)
    before = after
  want = {key: helpers.stale_schedule(seq, alpha) for key, seq in (("A", a_seq),
                                                                     ("G", g_seq))}
  state = jax.device_get(state)
  for m in range(M):
    assert refreshed[m] == want, f"shard {m}"
    factors = kd.running_factors(find_states(kd.model_shard(state, m))[0])["l"]
    for key, seq in (("A", a_seq), ("G", g_seq)):
      np.testing.assert_allclose(factors[key], seq[m][want[key][-1]], rtol=1e-6)
  # The rule of one shard alone would have refreshed on other steps.
  assert any(helpers.stale_schedule([a_seq[m]], alpha) != want["A"] for m in range(M))
  assert any(helpers.stale_schedule([g_seq[m]], alpha) != want["G"] for m in range(M))


def _stale(layers, dist=None, method="eigen"):
  """Stale statistics, threshold 0; `method` "eigen", "inverse" or "ekfac"."""
  options = (dict(method="eigen", eigenvalue_correction="ekfac") if method == "ekfac"
             else dict(method=method))
  return kd.kfac(0.1, layers=layers, damping=1e-2, kl_clip=1e-2, stale_threshold=0.0,
                 distribution=dist, **options)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eigen", "inverse", "ekfac"])
def test_stale_statistics_tensor_parallel_equals_block_model(method):
  """With threshold 0 every factor is refreshed every step (SP-NGD's rule never
  finds a factor similar): the TP run, its refreshes in conditionals around
  the data axis' collectives, equals the block model's on one device (with
  EK-FAC, on a problem whose eigenbases are unique: see the test above)."""
  params, x, y = _problem(**({"classes": D_OUT + 2} if method == "ekfac" else {}))
  dist = _dist(1 / 2)
  trajectory, state = _train(functools.partial(_stale, dist=dist, method=method), tp_loss,
                             params, x, y, dist, steps=4)
  reference, _ = _train(functools.partial(_stale, method=method), block_loss,
                        to_blocks(params), x, y, steps=4)
  _assert_same(trajectory, reference)
  state = jax.device_get(state)
  for i in range(M):
    refresh = find_states(kd.model_shard(state, i))[0].refresh
    np.testing.assert_array_equal(np.asarray(refresh.refreshes), 4)


def _adaptive(layers, grad_fn, dist=None):
  return kd.kfac(None, None, layers=layers, grad_fn=grad_fn, damping=1e-2,
                 weight_decay=1e-3, adapt_damping=True, damping_adaptation_interval=2,
                 factor_update_every=2, inverse_update_every=3, distribution=dist)


@pytest.mark.parametrize("fraction", [1.0, 1 / 2], ids=["COMM-OPT", "MEM-OPT"])
@pytest.mark.slow
def test_adaptive_kfac_tensor_parallel_equals_block_model(fraction):
  """Adaptive K-FAC on the TP mesh equals the block model on one device: the
  same preconditioned direction per shard, and α, μ, λ, ρ from inner products
  summed over the shards (replicated parameters once) and the exact GGN of
  the whole model."""
  params, x, y = _problem()
  dist = _dist(fraction)
  trajectory, opt_state = _train(functools.partial(_adaptive, dist=dist), tp_loss,
                                 params, x, y, dist, steps=5, adaptive=True)
  reference, ref_state = _train(_adaptive, block_loss, to_blocks(params), x, y, steps=5,
                                adaptive=True)
  _assert_same(trajectory, reference)
  state = _of_type(kd.model_shard(opt_state, 1), adaptive.AdaptiveKfacState)[0]
  want = _of_type(ref_state, adaptive.AdaptiveKfacState)[0]
  for field in ("damping", "learning_rate", "momentum", "rho"):
    np.testing.assert_allclose(float(getattr(state, field)), float(getattr(want, field)),
                               rtol=2e-4, err_msg=field)
  assert int(state.count) == 5 and np.isfinite(float(state.rho))


def _of_type(tree, cls):
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, cls))
  return [x for x in leaves if isinstance(x, cls)]


def _shampoo(dist=None, **options):
  return kd.shampoo(0.05, block_size=None, graft_type="adagrad",
                    start_preconditioning_step=1, preconditioning_compute_steps=2,
                    distribution=dist, **options)


@pytest.mark.parametrize("grafting,fraction", [
    pytest.param("layer", 1.0, marks=pytest.mark.slow), ("layer", 1 / 2),
    pytest.param("block", 1.0, marks=pytest.mark.slow)],
    ids=["layer-COMM", "layer-MEM", "block-COMM"])
def test_shampoo_tensor_parallel_equals_split_params(grafting, fraction):
  """Each model shard's Shampoo is Shampoo of its local shard: one device
  with the sharded parameters split into M leaves takes the same steps (root
  work over "data" COMM-style, or MEM-OPT: statistics and roots sharded).
  In float64: the inverse fourth roots of the small statistics amplify
  float32 rounding (which XLA's optimisation level changes) past any tight
  tolerance."""
  with jax.enable_x64(True):
    params, x, y = _problem()                       # float64 under x64
    assert x.dtype == jnp.float64
    dist = _dist(fraction)
    trajectory, _ = _train(lambda _: _shampoo(dist, grafting=grafting), tp_loss, params,
                           x, y, dist)
    reference, _ = _train(lambda _: _shampoo(grafting=grafting), block_loss,
                          to_blocks(params), x, y)
  _assert_same(trajectory, reference, rtol=1e-9, atol=1e-11)


SOAP_WIDTH = 16        # a hidden layer of 16: each model shard's blocks are 4 x 4


def _soap_problem():
  """A Megatron MLP 4 → 16 → 4, 4 classes: every sharded block (4 x 4) and
  every replicated kernel is square, so every statistic is full rank after
  one step (SOAP's direction is basis-independent only then)."""
  k = jax.random.split(jax.random.PRNGKey(1), 4)
  params = {"col": {"kernel": jax.random.normal(k[0], (4, SOAP_WIDTH)) * 0.5,
                    "bias": jnp.zeros(SOAP_WIDTH)},
            "row": {"kernel": jax.random.normal(k[1], (SOAP_WIDTH, 4)) * 0.5},
            "rbias": jnp.zeros(4),
            "norm": {"scale": jnp.ones(4), "offset": jnp.zeros(4)},
            "head": {"kernel": jax.random.normal(k[2], (4, 4)) * 0.5, "bias": jnp.zeros(4)}}
  batches = [(jax.random.normal(kx, (32, 4)), jax.random.randint(ky, (32,), 0, 4))
             for kx, ky in zip(*(jax.random.split(k[3], 2 * 5).reshape(2, 5, -1)))]
  return params, batches


@pytest.mark.parametrize("fraction", [1.0, pytest.param(1 / 2, marks=pytest.mark.slow)],
                         ids=["COMM", "MEM"])
def test_soap_tensor_parallel_equals_split_params(fraction):
  """SOAP likewise: each model shard runs SOAP on its local shards, as one
  device does on the parameters split into M leaves (a new batch each step).
  ε = 1e-3: the head's gradient has no component along the classes' sum and
  the row layer's none along its outputs' mean (the LayerNorm after it), so
  those eigen-coordinates hold float32 rounding noise, which Adam's division
  by √V + ε with the default ε = 1e-8 turns into O(1) entries that differ
  between any two ways of computing them."""
  params, batches = _soap_problem()
  dist = _dist(fraction)
  width = SOAP_WIDTH // M

  def split(p):
    out = {k: v for k, v in p.items() if k not in ("col", "row")}
    for i in range(M):
      out[f"col{i}"] = {"kernel": p["col"]["kernel"][:, i * width:(i + 1) * width],
                        "bias": p["col"]["bias"][i * width:(i + 1) * width]}
      out[f"row{i}"] = {"kernel": p["row"]["kernel"][i * width:(i + 1) * width]}
    return out

  def run(loss_fn, params, distribution=None):
    tx = kd.soap(0.01, eps=1e-3, block_size=None, precondition_every=2,
                 distribution=distribution)
    state = tx.init(params)

    def step(params, state, x, y):
      _, grads, _ = kd.value_and_grad(loss_fn)(params, x, y)    # local gradients
      if distribution is not None:
        grads = jax.lax.pmean(grads, "data")
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    step, state = compile_step(step, state, distribution, 2, param_specs=PARAM_SPECS)
    out = []
    for x, y in batches:
      params, state = step(params, state, x, y)
      out.append(params)
    return out
  got = run(tp_loss, params, dist)
  want = run(block_loss, split(params))
  for i, (a, b) in enumerate(zip(got, want)):
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=2e-4, atol=2e-5,
                                   err_msg=f"step {i}"), split(a), b)


def test_init_sharded_builds_the_model_sharded_states():
  """`kd.init_sharded` on the ("data", "model") mesh: the arrays and shardings
  of `kd.shard_state(tx.init(params), mesh)` for K-FAC and Shampoo states per
  model shard (COMM-OPT and MEM-OPT over "data"), built in the program: no
  array of the state's numbers is a constant of it (the run tables only; the
  host-built state there was a 1-2 thousand-character constant)."""
  params, x, y = _problem()
  for fraction in (1.0, 1 / 2):
    dist = _dist(fraction)
    layers = kd.value_and_grad(tp_loss).discover(params, x, y, distribution=dist)
    for tx in (_kfac(layers, dist), kd.shampoo(0.1, block_size=4, distribution=dist)):
      placed = kd.shard_state(tx.init(params), _mesh())
      built = kd.init_sharded(tx.init, params, _mesh())
      text = jax.jit(tx.init).lower(params).as_text()
      assert max(map(len, re.findall(r"stablehlo.constant dense<([^>]*)>", text))) < 120
      assert jax.tree.structure(built) == jax.tree.structure(placed)
      for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(built)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_model_shard_checks_its_index():
  """`kd.model_shard`'s index: a shard number in `[0, M)` or one position per
  model axis; another is refused naming it (they were IndexError / numpy's
  errors, and -1 read the last shard)."""
  params, x, y = _problem()
  dist = _dist()
  layers = kd.value_and_grad(tp_loss).discover(params, x, y, distribution=dist)
  state = _kfac(layers, dist).init(params)
  helpers.assert_trees_equal(kd.model_shard(state, (3,)), kd.model_shard(state, 3))
  for index in (M, -1, (M,), (0, 0), ()):
    with pytest.raises(ValueError, match=rf"kd.model_shard: index={re.escape(repr(index))} "
                                         rf"for {M} model shards \('model': {M}\)"):
      kd.model_shard(state, index)
  with pytest.raises(TypeError, match="kd.model_shard: index=1.0 .*an int or a tuple"):
    kd.model_shard(state, 1.0)


def test_init_sharded_refuses_a_mesh_the_state_is_not_laid_out_for():
  """As `kd.shard_state` does (it built the state for the Distribution's
  devices and sharded it over the given mesh's)."""
  params, x, y = _problem()
  dist = _dist()
  layers = kd.value_and_grad(tp_loss).discover(params, x, y, distribution=dist)
  tx = _kfac(layers, dist)
  other = helpers.mesh((1, M), ("data", "model"))
  for place in (lambda: kd.shard_state(tx.init(params), other),
                lambda: kd.init_sharded(tx.init, params, other)):
    with pytest.raises(ValueError, match=f"laid out for {DATA} devices of axis 'data', "
                                         "the mesh has"):
      place()


def test_misconfigured_tensor_parallel_is_rejected():
  mesh = _mesh()
  with pytest.raises(ValueError, match="'tensor' is not an axis"):
    kd.Distribution(mesh, model_axis="tensor", param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="pass model_axis"):
    kd.Distribution(mesh, param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="needs param_specs"):
    kd.Distribution(mesh, model_axis="model")
  with pytest.raises(ValueError, match="must be other mesh axes"):
    kd.Distribution(mesh, axis="model", model_axis="model", param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="over the tensor-parallel axis 'model' only"):
    kd.Distribution(mesh, model_axis="model", param_specs={"w": P("data")})
  with pytest.raises(ValueError, match="several dimensions"):
    kd.Distribution(mesh, model_axis="model", param_specs={"w": P("model", "model")})
  params, x, y = _problem()
  dist = _dist()
  bad = dict(params, row={"kernel": jnp.zeros((HIDDEN, D_OUT))},
             col={"kernel": jnp.zeros((D_IN, 6)), "bias": jnp.zeros(6)})
  with pytest.raises(ValueError, match="not divisible by the 4 devices"):
    _shampoo(dist).init(bad)
  tx = _shampoo(dist)
  state = tx.init(params)
  with pytest.raises(ValueError, match="inside jax.shard_map"):
    tx.update(params, state, params)
  # Layers discovered outside shard_map have the global shapes.
  global_layers = kd.value_and_grad(tp_loss).discover(params, x, y)
  with pytest.raises(ValueError, match="discover the layers with"):
    _kfac(global_layers, dist).init(params)


def test_bad_param_specs_entry_is_named_by_its_path():
  """A misfit `param_specs` entry is reported at its parameter's path (it was
  `param_specs['?']`)."""
  mesh = _mesh()
  specs = dict(PARAM_SPECS, row={"kernel": P("data", None)})
  with pytest.raises(ValueError, match=r"param_specs\['row/kernel'\] = .*over 'data'"):
    kd.Distribution(mesh, model_axis="model", param_specs=specs)
  specs = dict(PARAM_SPECS, col={"kernel": P("model", "model"), "bias": P()})
  with pytest.raises(ValueError, match=r"param_specs\['col/kernel'\] .*several dim"):
    kd.Distribution(mesh, model_axis="model", param_specs=specs)
  specs = dict(PARAM_SPECS, norm={"scale": P(), "offset": "model"})
  with pytest.raises(ValueError, match=r"param_specs\['norm/offset'\] is 'model', not a "
                                       "PartitionSpec"):
    kd.Distribution(mesh, model_axis="model", param_specs=specs)


def test_discover_checks_the_parameters_against_param_specs():
  """`grad_fn.discover(..., distribution=)`, the first call that sees the
  parameters, names the misfit as `init` does (it raised shard_map's errors
  about a function the user never wrote)."""
  params, x, y = _problem()
  grad_fn = kd.value_and_grad(tp_loss)
  odd = dict(params, col={"kernel": jnp.zeros((D_IN, 6)), "bias": jnp.zeros(6)},
             row={"kernel": jnp.zeros((6, D_OUT))})
  for p, specs, match in (
      (odd, PARAM_SPECS, r"Parameter 'col/bias' of shape \(6,\): dimension 0 \(6\) is "
                         f"not divisible by the {M} devices of model axis 'model'"),
      (params, {"col": PARAM_SPECS["col"], "row": PARAM_SPECS["row"]},
       "Distribution.param_specs must be a pytree like the parameters"),
      (params, dict(PARAM_SPECS, rbias=P(None, "model")),
       r"param_specs\['rbias'\] = .* has more entries than the parameter has dimensions")):
    dist = kd.Distribution(_mesh(), model_axis="model", param_specs=specs)
    with pytest.raises(ValueError, match=match):
      grad_fn.discover(p, x, y, distribution=dist)


def test_kfac_rejects_shardings_it_cannot_precondition():
  """A row-parallel layer whose tag adds the bias (every shard would add it
  before the psum), a conv kernel sharded on a spatial axis, and a grouped
  convolution's or a transposed kernel's sharded kernel."""
  mesh = _mesh()

  def row_with_bias(p, x, y):
    z = jax.lax.psum(kd.tags.dense(x, p["row"]["kernel"], p["row"]["bias"]), "model")
    return kd.losses.softmax_cross_entropy(z, y)
  params = {"row": {"kernel": jnp.zeros((8, CLASSES)), "bias": jnp.zeros(CLASSES)}}
  specs = {"row": {"kernel": P("model", None), "bias": P()}}
  x, y = jnp.zeros((4, 8 // M)), jnp.zeros(4, jnp.int32)   # the local input rows

  def conv(p, x, y):
    z = jax.lax.psum(kd.tags.conv2d(x, p["conv"]["kernel"]), "model")
    return kd.losses.softmax_cross_entropy(z.mean((1, 2)), y)
  conv_params = {"conv": {"kernel": jnp.zeros((4, 3, 2, CLASSES))}}
  conv_specs = {"conv": {"kernel": P("model")}}
  xc = jnp.zeros((4, 6, 6, 2))

  def grouped(p, x, y):       # column-parallel: each shard has its own 2 groups
    z = kd.tags.conv2d(x, p["grouped"]["kernel"], feature_group_count=2)
    return kd.losses.softmax_cross_entropy(z.mean((1, 2)), y)
  grouped_params = {"grouped": {"kernel": jnp.zeros((3, 3, 1, 2 * M))}}
  grouped_specs = {"grouped": {"kernel": P(None, None, None, "model")}}

  def transposed(p, x, y):    # a transposed kernel (*window, out, in), column-parallel
    z = kd.tags.conv2d(x, p["transposed"]["kernel"], transpose_kernel=True)
    return kd.losses.softmax_cross_entropy(z.mean((1, 2)), y)
  transposed_params = {"transposed": {"kernel": jnp.zeros((3, 3, 2 * M, 2))}}
  transposed_specs = {"transposed": {"kernel": P(None, None, "model", None)}}
  for loss, p, s, xx, match in ((row_with_bias, params, specs, x, "add the bias after"),
                                (conv, conv_params, conv_specs, xc, "spatial axis"),
                                (grouped, grouped_params, grouped_specs, xc,
                                 "'grouped' is a grouped convolution"),
                                (transposed, transposed_params, transposed_specs, xc,
                                 "'transposed' is a layer with a transposed kernel")):
    dist = kd.Distribution(mesh, model_axis="model", param_specs=s)
    layers = kd.value_and_grad(loss).discover(p, xx, y, distribution=dist)
    with pytest.raises(ValueError, match=match):
      kd.kfac(0.1, layers=layers, distribution=dist).init(p)
  # Replicated on the model axis, both are preconditioned (their leaves are
  # not one block's shape: the check reads `TaggedLayer.leaf_shape`).
  for loss, p in ((grouped, {"grouped": {"kernel": jnp.zeros((3, 3, 1, 4))}}),
                  (transposed, {"transposed": {"kernel": jnp.zeros((3, 3, 3, 2))}})):
    s = jax.tree.map(lambda _: P(), p)
    dist = kd.Distribution(mesh, model_axis="model", param_specs=s)
    layers = kd.value_and_grad(loss).discover(p, xc, y, distribution=dist)
    kd.kfac(0.1, layers=layers, distribution=dist).init(p)


def test_vocab_parallel_embedding_equals_the_whole_table():
  """A table split by rows over "model" (Megatron's vocabulary-parallel
  embedding: each shard looks up `ids − its first row` with
  `out_of_range="zero"`, the lookups summed over "model") gets the whole
  table's K-FAC step: `A` is diagonal, so each shard's factors (its rows'
  counts over every position, the full output's `G`) are the whole table's
  restricted to its rows. Five steps equal the single-device run's; looked up
  with NaN fill and masked after the tag (the recipe without the option), the
  other shards' positions leave `G` and the step is off."""
  vocab, width, tokens = 16, 4, 3
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"table": jax.random.normal(k[0], (vocab, width)),
            "head": jax.random.normal(k[1], (width, CLASSES)) * 0.5}
  ids = jax.random.randint(k[2], (32, tokens), 0, vocab)
  y = jax.random.randint(k[3], (32,), 0, CLASSES)
  specs = {"table": P("model", None), "head": P()}

  def head(p, h, y):
    logits = kd.tags.dense(jnp.tanh(h.mean(1)), p["head"])
    return kd.losses.softmax_cross_entropy(logits, y)

  def whole(p, ids, y):
    return head(p, kd.tags.embed(ids, p["table"]), y)

  def sharded(mode):
    def loss(p, ids, y):
      local = ids - jax.lax.axis_index("model") * p["table"].shape[0]
      if mode == "zero":
        h = kd.tags.embed(local, p["table"], out_of_range="zero")
      else:       # masked after the lookup: the other shards' cotangents are zeroed
        mine = (local >= 0) & (local < p["table"].shape[0])
        h = jnp.where(mine[..., None], kd.tags.embed(jnp.where(mine, local, 0),
                                                     p["table"]), 0.0)
      return head(p, jax.lax.psum(h, "model"), y)
    return loss

  def run(loss_fn, dist=None):
    grad_fn = kd.value_and_grad(loss_fn)
    tx = kd.kfac(0.1, layers=grad_fn.discover(params, ids, y, distribution=dist),
                 damping=1e-2, factor_update_every=1, inverse_update_every=1,
                 distribution=dist)

    def step(p, state, ids, y):
      _, grads, stats = grad_fn(p, ids, y, opt_state=state)
      if dist is not None:
        grads = jax.lax.pmean(grads, "data")
      updates, state = tx.update(grads, state, p, kfac_stats=stats)
      return optax.apply_updates(p, updates), state
    step, state = compile_step(step, tx.init(params), dist, 2, param_specs=specs)
    p = params
    for _ in range(5):
      p, state = step(p, state, ids, y)
    return p

  want = run(whole)
  dist = kd.Distribution(_mesh(), axis="data", model_axis="model", param_specs=specs)
  got = run(sharded("zero"), dist)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               got, want)
  masked = run(sharded("masked"), dist)
  assert not np.allclose(masked["table"], want["table"], rtol=2e-2, atol=2e-3)
