"""Three-dimensional meshes ("data", "model", "stage") on 2 x 2 x 2 CPU devices
(3D-Shampoo's data x operator x pipeline layout): a stack of residual
Megatron MLP blocks `[L, ...]` sharded over "stage" on its stack axis (each
stage owns L/S blocks and runs them in its turn of a pipeline: `lax.cond` on
the stage index, activations passed on by `ppermute`) and its matrices over
"model". K-FAC (every data-axis strategy; HYBRID-OPT on a 4 x 1 x 2 mesh),
adaptive K-FAC and Shampoo, preconditioning each device's local shards, equal
one device training the split model: every parameter cut into its M·S local
shards as separate leaves, run in the same order, in float64. DP-KFAC's
factors are each owner's half-batch statistics of the split model.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd
from kfac_jax_dist import _compat
from kfac_jax_dist.core import tensor_parallel

import helpers
from kfac_jax_dist.kfac import adaptive
from kfac_jax_dist.kfac import correction
from kfac_jax_dist.kfac.state import find_states
from helpers import compile_step

DATA, M, S = 2, 2, 2                # the mesh's sizes (HYBRID's test: 4 x 1 x 2)
# 4 blocks, 2 per stage; hidden 8, 4 per model shard. CLASSES > D: the last
# block's output gradients span R^D (no repeated zero eigenvalue of its G,
# whose eigenvectors would be any basis of their space: EK-FAC measures its
# scaling in the eigenbasis).
L, D, H, CLASSES = 4, 6, 8, 8
STEPS = 5                           # inverse at 0, 3; factor-only at 2, 4; plain at 1

PARAM_SPECS = {"up": {"kernel": P("stage", None, "model"), "bias": P("stage", "model")},
               "down": {"kernel": P("stage", "model", None)},
               "shift": P("stage"),                              # replicated over "model"
               "head": {"kernel": P(), "bias": P()}}             # replicated over both


def _mesh(shape=(DATA, M, S)):
  return helpers.mesh(shape, ("data", "model", "stage"))


def _problem():
  k = jax.random.split(jax.random.PRNGKey(0), 7)
  params = {"up": {"kernel": jax.random.normal(k[0], (L, D, H)) * 0.4,
                   "bias": jax.random.normal(k[1], (L, H)) * 0.1},
            "down": {"kernel": jax.random.normal(k[2], (L, H, D)) * 0.4},
            "shift": jax.random.normal(k[3], (L, D)) * 0.1,
            "head": {"kernel": jax.random.normal(k[4], (D, CLASSES)) * 0.5,
                     "bias": jnp.zeros(CLASSES)}}
  x = jax.random.normal(k[5], (16, D))
  y = jax.random.randint(k[6], (16,), 0, CLASSES)
  return params, x, y


def _block(h, up, down, shift, i, reduce):
  """Residual Megatron MLP block `i` of a stage's stacked leaves; `reduce`
  sums the row-parallel outputs over the model shards."""
  u = jnp.tanh(kd.tags.dense(h, up["kernel"], up["bias"], stack_index=i))
  return h + reduce(kd.tags.dense(u, down["kernel"], stack_index=i)) + shift[i]


def _head(p, h, y):
  logits = kd.tags.dense(h, p["head"]["kernel"], p["head"]["bias"])
  return kd.losses.softmax_cross_entropy(logits, y)


def pipeline_loss(p, x, y):
  """Inside shard_map: S rounds; in round r stage r runs its blocks (a scan
  over its L/S local blocks), then every stage passes its activations on.
  After the last round stage 0 holds the output, which it shares."""
  stage, stages = lax.axis_index("stage"), lax.axis_size("stage")
  reduce = functools.partial(lax.psum, axis_name="model")

  def run_blocks(h):
    return lax.scan(lambda h, i: (_block(h, p["up"], p["down"], p["shift"], i, reduce),
                                  None), h, jnp.arange(p["shift"].shape[0]))[0]

  def one_round(h, r):
    h = lax.cond(stage == r, run_blocks, lambda h: h, h)
    return lax.ppermute(h, "stage", [(s, (s + 1) % stages) for s in range(stages)]), None
  h, _ = lax.scan(one_round, _compat.as_varying(x, ("stage",)), jnp.arange(stages))
  h = lax.psum(jnp.where(stage == 0, h, jnp.zeros_like(h)), "stage")
  return _head(p, h, y)


MICRO = 2                           # GPipe: micro-batches per data shard


def gpipe_loss(p, x, y):
  """Inside shard_map: a GPipe schedule of MICRO micro-batches over the S
  stages, MICRO + S − 1 ticks; at tick t stage s runs its blocks on
  micro-batch t − s when there is one (`lax.cond`: a bubble runs nothing),
  then passes its activations on. Every block runs MICRO times a step: its
  `A` is the mean over the runs, its `G` their sum (`statistics.RUNS`), so
  the statistics are the whole batch's. The last stage's outputs are shared."""
  stage, stages = lax.axis_index("stage"), lax.axis_size("stage")
  reduce = functools.partial(lax.psum, axis_name="model")
  micro = x.reshape(MICRO, -1, x.shape[-1])

  def run_blocks(h):
    return lax.scan(lambda h, i: (_block(h, p["up"], p["down"], p["shift"], i, reduce),
                                  None), h, jnp.arange(p["shift"].shape[0]))[0]

  def tick(carry, t):
    received, outputs = carry
    k = t - stage                                   # this stage's micro-batch
    h = jnp.where(stage == 0, micro[jnp.clip(t, 0, MICRO - 1)], received)
    h = lax.cond((k >= 0) & (k < MICRO), run_blocks, lambda h: h, h)
    done = (stage == stages - 1) & (k >= 0) & (k < MICRO)
    outputs = jnp.where(done, outputs.at[jnp.clip(k, 0, MICRO - 1)].set(h), outputs)
    sent = lax.ppermute(h, "stage", [(s, (s + 1) % stages) for s in range(stages)])
    return (sent, outputs), None
  start = _compat.as_varying((micro[0], jnp.zeros_like(micro)), ("stage",))
  (_, outputs), _ = lax.scan(tick, start, jnp.arange(MICRO + stages - 1))
  h = lax.psum(jnp.where(stage == stages - 1, outputs, 0.0), "stage")
  return _head(p, h.reshape(x.shape), y)


def split_loss(p, x, y):
  """The split model on one device: stage s's blocks, model shard m's
  columns (rows) as the stacked leaves `up{s}{m}`, `down{s}{m}`, `shift{s}`,
  run in the pipeline's order."""
  stages = sum(k.startswith("shift") for k in p)
  models = sum(k.startswith("up0") for k in p)
  h = x
  for s in range(stages):
    for i in range(p[f"shift{s}"].shape[0]):
      z = sum(kd.tags.dense(jnp.tanh(kd.tags.dense(
          h, p[f"up{s}{m}"]["kernel"], p[f"up{s}{m}"]["bias"], stack_index=i)),
          p[f"down{s}{m}"]["kernel"], stack_index=i) for m in range(models))
      h = h + z + p[f"shift{s}"][i]
  return _head(p, h, y)


def to_split(p, models=M, stages=S):
  """Mesh params (global arrays) → the split model's."""
  out = {"head": p["head"]}
  per_stage, per_model = L // stages, H // models
  for s in range(stages):
    blocks = slice(s * per_stage, (s + 1) * per_stage)
    out[f"shift{s}"] = p["shift"][blocks]
    for m in range(models):
      cols = slice(m * per_model, (m + 1) * per_model)
      out[f"up{s}{m}"] = {"kernel": p["up"]["kernel"][blocks, :, cols],
                          "bias": p["up"]["bias"][blocks, cols]}
      out[f"down{s}{m}"] = {"kernel": p["down"]["kernel"][blocks, cols]}
  return out


def _train(tx_of, loss_fn, params, x, y, dist=None, steps=STEPS):
  """`steps` updates; with `dist`, inside shard_map over the three axes (the
  batch over "data"), the state placed by kd.partition_specs. `tx_of(layers,
  dist, grad_fn)`; the update gets `kfac_batch` (for adaptive K-FAC)."""
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y, distribution=dist)
  tx = tx_of(layers, dist, grad_fn)
  state = tx.init(params)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    if dist is not None and dist.gradient_reduction == "none":
      grads = lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats,
                               kfac_batch=(x, y))
    return optax.apply_updates(params, updates), state

  specs = PARAM_SPECS if dist is not None and dist.model_axes else P()
  step, state = compile_step(step, state, dist, 2, param_specs=specs)
  trajectory = []
  for _ in range(steps):
    params, state = step(params, state, x, y)
    trajectory.append(params)
  return trajectory, state


def _dist(fraction=1.0, shape=(DATA, M, S), **kw):
  return kd.Distribution(_mesh(shape), axis="data", grad_worker_fraction=fraction,
                         model_axis=("model", "stage"), param_specs=PARAM_SPECS, **kw)


def _kfac(layers, dist=None, grad_fn=None):
  del grad_fn
  return kd.kfac(0.1, layers=layers, damping=1e-2, factor_update_every=2,
                 inverse_update_every=3, kl_clip=1e-2, factor_dtype=jnp.float64,
                 distribution=dist)


def _ekfac(layers, dist=None, grad_fn=None):
  del grad_fn
  return kd.kfac(0.1, layers=layers, damping=1e-2, factor_update_every=2,
                 inverse_update_every=3, kl_clip=1e-2, factor_dtype=jnp.float64,
                 eigenvalue_correction="ekfac", distribution=dist)


def _adaptive(layers, dist=None, grad_fn=None):
  return kd.kfac(None, None, layers=layers, grad_fn=grad_fn, damping=1e-2,
                 weight_decay=1e-3, adapt_damping=True, damping_adaptation_interval=2,
                 factor_update_every=2, inverse_update_every=3,
                 factor_dtype=jnp.float64, distribution=dist)


def _shampoo(layers=None, dist=None, grad_fn=None, graft_type="adagrad"):
  del layers, grad_fn
  return kd.shampoo(0.05, block_size=None, graft_type=graft_type,
                    start_preconditioning_step=1, preconditioning_compute_steps=2,
                    distribution=dist)


# Adagrad grafting needs every averaged gradient on every device: SGD grafting
# where the gradients are reduce-scattered to their owners.
_shampoo_sgd_graft = functools.partial(_shampoo, graft_type="sgd")


@functools.cache
def _reference(tx_of, shape=(DATA, M, S)):
  """The split model trained on one device by `tx_of`, in float64 (several
  tests compare against the same one)."""
  with jax.enable_x64(True):
    params, x, y = _problem()
    return _train(tx_of, split_loss, to_split(params, *shape[1:]), x, y)


def _assert_same(trajectory, reference, shape=(DATA, M, S), rtol=1e-9, atol=1e-11):
  for step, (got, want) in enumerate(zip(trajectory, reference)):
    check = functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol,
                              err_msg=f"step {step}")
    jax.tree.map(check, to_split(got, *shape[1:]), want)


STRATEGIES = [(1.0, "reduce_scatter", "none", (DATA, M, S)),
              pytest.param(1 / 2, "all_reduce", "none", (DATA, M, S),
                           marks=pytest.mark.slow),
              pytest.param(1 / 2, "reduce_scatter", "reduce_scatter", (DATA, M, S),
                           marks=pytest.mark.slow),
              pytest.param(1 / 2, "reduce_scatter", "none", (4, 1, 2),
                           marks=pytest.mark.slow)]


@pytest.mark.parametrize("fraction,factor_reduction,gradient_reduction,shape", STRATEGIES,
                         ids=["COMM-OPT", "MEM-OPT", "SP-NGD", "HYBRID-4x1x2"])
def test_kfac_3d_mesh_equals_split_model(fraction, factor_reduction,
                                         gradient_reduction, shape):
  """The trajectory, and on every model shard the factors of its blocks."""
  with jax.enable_x64(True):
    params, x, y = _problem()
    dist = _dist(fraction, shape, factor_reduction=factor_reduction,
                 gradient_reduction=gradient_reduction)
    trajectory, state = _train(_kfac, pipeline_loss, params, x, y, dist)
    reference, ref_state = _reference(_kfac, shape)
    _assert_same(trajectory, reference, shape)
    # Shard (m, s) holds stage s's blocks of model shard m's columns.
    want = kd.running_factors(find_states(ref_state)[0])
    for m in range(shape[1]):
      for s in range(shape[2]):
        got = kd.running_factors(find_states(kd.model_shard(state, (m, s)))[0])
        for i in range(L // shape[2]):
          for name in ("up", "down"):
            for key in ("A", "G"):
              np.testing.assert_allclose(got[f"{name}/{i}"][key],
                                         want[f"{name}{s}{m}/{i}"][key], rtol=1e-9,
                                         err_msg=f"shard {(m, s)} {name}/{i} {key}")
  specs = kd.partition_specs(state)
  assert specs[0].inner.factors == P(("model", "stage", "data"))


@pytest.mark.parametrize("fraction", [1.0, 1 / 2], ids=["COMM-OPT", "MEM-OPT"])
@pytest.mark.slow
def test_kfac_gpipe_micro_batches_equal_split_model(fraction):
  """A micro-batched pipeline (GPipe, bubbles skipped by `lax.cond`) runs
  each block MICRO times per step; K-FAC's statistics are still the whole
  batch's (A the mean over the runs, G the sum), so the steps equal the
  split model's on the whole batch."""
  with jax.enable_x64(True):
    params, x, y = _problem()
    trajectory, _ = _train(_kfac, gpipe_loss, params, x, y, _dist(fraction))
    reference, _ = _reference(_kfac)
    _assert_same(trajectory, reference)


def test_dp_kfac_3d_factors_are_the_owners_local_factors():
  """DP-KFAC (factors of each device's own batch, not reduced): on every model
  shard (m, s), a layer's factors are the split model's statistics of its
  owner's half of the batch."""
  with jax.enable_x64(True):
    params, x, y = _problem()
    _, state = _train(_kfac, pipeline_loss, params, x, y,
                      _dist(1 / 2, factor_reduction="local"), steps=1)
    grad_fn = jax.jit(kd.value_and_grad(split_loss))
    half = x.shape[0] // DATA
    local = [grad_fn(to_split(params), x[d * half:(d + 1) * half],
                     y[d * half:(d + 1) * half])[2] for d in range(DATA)]
    owners = set()
    for m in range(M):
      for s in range(S):
        shard, = find_states(kd.model_shard(state, (m, s)))
        stored = kd.running_factors(shard)
        for plan in shard.layout.plans:
          name = plan.layer.name
          for place, key in ((plan.a, "A"), (plan.g, "G")):
            owners.add(place.owner)
            want = local[place.owner]
            if name == "head":
              want = want["head"][key]
            else:                                   # "up/i": block i of up{s}{m}
              layer, i = name.split("/")
              want = want[f"{layer}{s}{m}"][key][int(i)]
            np.testing.assert_allclose(stored[name][key], want, rtol=1e-9,
                                       err_msg=f"{(m, s)} {name} {key}")
  assert owners == set(range(DATA))


@pytest.mark.parametrize("fraction,gradient_reduction,shape", [
    pytest.param(1.0, "none", (DATA, M, S), marks=pytest.mark.slow),
    pytest.param(1 / 2, "none", (DATA, M, S), marks=pytest.mark.slow),
    pytest.param(1 / 2, "reduce_scatter", (DATA, M, S), marks=pytest.mark.slow),
    pytest.param(1 / 2, "none", (4, 1, 2), marks=pytest.mark.slow)],
    ids=["COMM-OPT", "MEM-OPT", "MEM-OPT-reduce-scatter", "HYBRID-4x1x2"])
def test_shampoo_3d_mesh_equals_split_params(fraction, gradient_reduction, shape):
  """Shampoo of each device's local shards (`[L/S, D, H/M]` blocks of the
  stacked kernels) is Shampoo of the split model's leaves."""
  tx = _shampoo if gradient_reduction == "none" else _shampoo_sgd_graft
  with jax.enable_x64(True):
    params, x, y = _problem()
    dist = _dist(fraction, shape, gradient_reduction=gradient_reduction)
    trajectory, _ = _train(tx, pipeline_loss, params, x, y, dist)
    reference, _ = _reference(tx, shape)
  _assert_same(trajectory, reference, shape)


@pytest.mark.slow
def test_adaptive_kfac_3d_mesh_equals_split_model():
  """Adaptive K-FAC: α, μ, λ and ρ from inner products summed over the
  model and stage shards (a leaf replicated over an axis counted once there)
  and the exact GGN through the pipeline equal the split model's."""
  with jax.enable_x64(True):
    params, x, y = _problem()
    trajectory, state = _train(_adaptive, pipeline_loss, params, x, y, _dist(1 / 2))
    reference, ref_state = _reference(_adaptive)
    _assert_same(trajectory, reference)
    got = _of_type(kd.model_shard(state, (1, 1)), adaptive.AdaptiveKfacState)[0]
    want = _of_type(ref_state, adaptive.AdaptiveKfacState)[0]
    for field in ("damping", "learning_rate", "momentum", "rho"):
      np.testing.assert_allclose(float(getattr(got, field)),
                                 float(getattr(want, field)), rtol=1e-9, err_msg=field)


@pytest.mark.slow
def test_ekfac_3d_mesh_equals_split_model():
  """EK-FAC (MEM-OPT over "data"): each (model, stage) shard measures the
  scaling of its blocks' local shards in its own eigenbases, as one device
  does for the split model's layers."""
  with jax.enable_x64(True):
    params, x, y = _problem()
    trajectory, state = _train(_ekfac, pipeline_loss, params, x, y, _dist(1 / 2))
    reference, ref_state = _reference(_ekfac)
    _assert_same(trajectory, reference)
    ref = find_states(ref_state)[0]
    want = correction.layer_scaling(ref.layout, ref.correction)
    state = jax.device_get(state)
    for m in range(M):
      for s in range(S):
        shard = find_states(kd.model_shard(state, (m, s)))[0]
        got = correction.layer_scaling(shard.layout, shard.correction)
        for name, value in got.items():
          base, _, block = name.partition("/")
          np.testing.assert_allclose(
              value, want[name if base == "head" else f"{base}{s}{m}/{block}"],
              rtol=1e-9, atol=1e-15, err_msg=f"shard {(m, s)} {name}")


def _of_type(tree, cls):
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, cls))
  return [x for x in leaves if isinstance(x, cls)]


def test_misconfigured_3d_mesh_is_rejected():
  mesh = _mesh()
  with pytest.raises(ValueError, match="names an axis twice"):
    kd.Distribution(mesh, model_axis=("model", "model"), param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="must be other mesh axes"):
    kd.Distribution(mesh, model_axis=("model", "data"), param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="'pipe' is not an axis"):
    kd.Distribution(mesh, model_axis=("model", "pipe"), param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="axes 'model', 'stage' only"):
    kd.Distribution(mesh, model_axis=("model", "stage"), param_specs={"w": P("data")})
  with pytest.raises(ValueError, match="several dimensions over 'stage'"):
    kd.Distribution(mesh, model_axis=("model", "stage"),
                    param_specs={"w": P("stage", "stage")})
  # A dimension sharded over both axes divides by their 4 devices.
  dist = kd.Distribution(mesh, model_axis=("model", "stage"),
                         param_specs={"w": P(("model", "stage"))})
  with pytest.raises(ValueError, match="not divisible by the 4 devices"):
    _shampoo(dist=dist).init({"w": jnp.zeros((6, 3))})
  state = _shampoo(dist=dist).init({"w": jnp.zeros((8, 3))})
  sharding = tensor_parallel.find_sharding(state)
  assert sharding.local_shape(0) == (2, 3) and sharding.size == 4
  specs, = _of_type(kd.partition_specs(state), kd.ModelShardedState)
  assert all(spec[0][:2] == ("model", "stage") for spec in specs.inner.statistics)
  # update outside shard_map over the model axes is refused, naming them.
  params = _problem()[0]
  tx = _shampoo(dist=_dist())
  with pytest.raises(ValueError, match="axes 'model', 'stage': call update inside"):
    tx.update(params, tx.init(params), params)
