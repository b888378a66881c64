"""Embedding, scale-and-shift and multi-axis Dense layers in the K-FAC transform:
preconditioned updates against float64 brute force, and training end to end on
one device and under every distribution strategy."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac.state import find_states
from helpers import compile_step

F64 = jnp.float64


def _layers():
  return kd.LayerRegistry((
      kd.TaggedLayer(name="emb", kind="embed", kernel_path="emb/embedding", bias_path=None,
                     kernel_shape=(7, 3), a_dim=7, g_dim=3, a_diagonal=True),
      kd.TaggedLayer(name="ln", kind="scale_and_shift", kernel_path="ln/scale",
                     bias_path="ln/bias", kernel_shape=(3,), a_dim=2, g_dim=3,
                     bias_shape=(3,)),
      kd.TaggedLayer(name="rms", kind="scale_and_shift", kernel_path="rms/scale",
                     bias_path=None, kernel_shape=(3,), a_dim=1, g_dim=3),
      kd.TaggedLayer(name="proj", kind="dense", kernel_path="proj/kernel",
                     bias_path="proj/bias", kernel_shape=(3, 2, 2), a_dim=4, g_dim=4,
                     bias_shape=(2, 2)),
  ))


def _spd(rng, d):
  m = rng.normal(size=(d, 2 * d))
  return m @ m.T / (2 * d)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_new_layer_kinds_match_brute_force(method):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    layers = _layers()
    params = {"emb": {"embedding": rng.normal(size=(7, 3))},
              "ln": {"scale": rng.normal(size=3), "bias": rng.normal(size=3)},
              "rms": {"scale": rng.normal(size=3)},
              "proj": {"kernel": rng.normal(size=(3, 2, 2)), "bias": rng.normal(size=(2, 2))}}
    params = jax.tree.map(lambda x: jnp.asarray(x, F64), params)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), F64), params)
    counts = rng.integers(0, 5, size=7).astype(np.float64)
    fisher = []
    for _ in range(2):
      u = rng.normal(size=(3, 5, 2))            # per-channel (gγ, gβ) of 5 examples
      f = np.einsum("cni,cnj->cij", u, u) / 5
      fisher.append(np.stack([f[:, 0, 0], f[:, 0, 1], f[:, 1, 1]], axis=1))
    fisher[1][:, 1:] = 0.0                      # scale only
    stats = {"emb": {"A": jnp.asarray(counts / counts.sum()), "G": jnp.asarray(_spd(rng, 3))},
             "ln": {"F": jnp.asarray(fisher[0])}, "rms": {"F": jnp.asarray(fisher[1])},
             "proj": {"A": jnp.asarray(_spd(rng, 4)), "G": jnp.asarray(_spd(rng, 4))}}
    gamma = 0.05
    tx = kd.scale_by_kfac(layers=layers, damping=gamma, method=method, factor_dtype=F64)
    updates, state = tx.update(grads, tx.init(params), kfac_stats=stats)

    def solve(a, g, grad):
      if method == "eigen":
        big = np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0])
        return np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
      pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
      return (np.linalg.inv(a + pi * np.sqrt(gamma) * np.eye(a.shape[0])) @ grad
              @ np.linalg.inv(g + np.sqrt(gamma) / pi * np.eye(g.shape[0])))

    # Embedding: A = diag(token frequencies), never formed as a matrix.
    expected = solve(np.diag(np.asarray(stats["emb"]["A"])), np.asarray(stats["emb"]["G"]),
                     np.asarray(grads["emb"]["embedding"]))
    np.testing.assert_allclose(updates["emb"]["embedding"], expected, rtol=1e-8, atol=1e-10)
    # Multi-axis kernel and bias: Dense on the flattened (in, out) view.
    g_mat = np.concatenate([np.asarray(grads["proj"]["kernel"]).reshape(3, 4),
                            np.asarray(grads["proj"]["bias"]).reshape(1, 4)])
    expected = solve(np.asarray(stats["proj"]["A"]), np.asarray(stats["proj"]["G"]), g_mat)
    np.testing.assert_allclose(updates["proj"]["kernel"], expected[:3].reshape(3, 2, 2),
                               rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(updates["proj"]["bias"], expected[3].reshape(2, 2),
                               rtol=1e-8, atol=1e-10)
    # Scale-and-shift: (F_c + γI)⁻¹ per channel, SP-NGD (same for both methods).
    for c in range(3):
      f = fisher[0][c]
      block = np.array([[f[0], f[1]], [f[1], f[2]]]) + gamma * np.eye(2)
      v = np.linalg.solve(block, [grads["ln"]["scale"][c], grads["ln"]["bias"][c]])
      np.testing.assert_allclose([updates["ln"]["scale"][c], updates["ln"]["bias"][c]], v,
                                 rtol=1e-8)
      np.testing.assert_allclose(updates["rms"]["scale"][c],
                                 grads["rms"]["scale"][c] / (fisher[1][c, 0] + gamma),
                                 rtol=1e-8)
    running = kd.running_factors(state)
    np.testing.assert_allclose(running["ln"]["F"], fisher[0])
    assert running["emb"]["A"].shape == (7,)
    assert "2x2 x 3 (unit-wise)" in kd.describe(state)


class Block(nn.Module):
  """Post-LN Transformer block: attention (DenseGeneral projections), MLP."""

  @nn.compact
  def __call__(self, x):
    heads, d = 2, x.shape[-1]
    q, k, v = (kd.linen.DenseGeneral((heads, d // heads), name=n)(x) for n in "qkv")
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads))
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
    x = kd.linen.LayerNorm()(x + kd.linen.DenseGeneral(d, axis=(-2, -1), name="o")(o))
    h = kd.linen.Dense(2 * d)(x)
    return kd.linen.LayerNorm()(x + kd.linen.Dense(d)(nn.gelu(h)))


class TinyLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = kd.linen.Embed(11, 8)(tokens)
    for _ in range(2):
      x = Block()(x)
    return kd.linen.Dense(11)(x)


def _norm(axis_name: str | None, group_norm: bool):
  """The ResNet's normalisation: BatchNorm in training mode, or GroupNorm."""
  if group_norm:
    return functools.partial(kd.linen.GroupNorm, num_groups=2)
  return functools.partial(kd.linen.BatchNorm, use_running_average=False,
                           axis_name=axis_name)


class ResBlock(nn.Module):
  """ResNet basic block: conv-BN-relu-conv-BN plus the shortcut (a strided 1×1
  conv + BN where the shape changes), then relu (GroupNorm for BN with
  `group_norm`)."""
  features: int
  strides: int = 1
  axis_name: str | None = None
  group_norm: bool = False

  @nn.compact
  def __call__(self, x):
    bn = _norm(self.axis_name, self.group_norm)
    conv = functools.partial(kd.linen.Conv, self.features, use_bias=False)
    h = nn.relu(bn()(conv((3, 3), strides=self.strides)(x)))
    h = bn()(conv((3, 3))(h))
    if x.shape != h.shape:
      x = bn()(conv((1, 1), strides=self.strides)(x))
    return nn.relu(x + h)


class ResNet(nn.Module):
  """A ResNet-style CNN with BatchNorm in training mode (batch statistics);
  `axis_name`: synchronised BatchNorm over that mesh axis (inside shard_map the
  statistics are the global batch's, as on one device). `group_norm`:
  GroupNorm instead (each image normalised on its own), an InstanceNorm
  after the stem."""
  axis_name: str | None = None
  group_norm: bool = False

  @nn.compact
  def __call__(self, x):
    x = kd.linen.Conv(4, (3, 3), use_bias=False)(x)
    stem = kd.linen.InstanceNorm() if self.group_norm else _norm(self.axis_name, False)()
    x = nn.relu(stem(x))
    x = ResBlock(4, axis_name=self.axis_name, group_norm=self.group_norm)(x)
    x = ResBlock(6, strides=2, axis_name=self.axis_name, group_norm=self.group_norm)(x)
    return kd.linen.Dense(5)(x.mean((1, 2)))


def _lm_problem(axis_name=None):
  del axis_name
  tokens = jax.random.randint(jax.random.PRNGKey(1), (16, 6), 0, 11)
  model = TinyLM()
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])

  def loss_fn(p, tokens):
    return kd.losses.softmax_cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:])
  return loss_fn, params, (tokens,)


def _bn_problem(axis_name=None):
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 6, 6, 2))
  y = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, 5)
  variables = ResNet().init(jax.random.PRNGKey(0), x)
  batch_stats = variables["batch_stats"]
  model = ResNet(axis_name)

  def loss_fn(p, x, y):
    out, _ = model.apply({"params": p, "batch_stats": batch_stats}, x,
                         mutable=["batch_stats"])
    return kd.losses.softmax_cross_entropy(out, y)
  return loss_fn, variables["params"], (x, y)


def _gn_problem(axis_name=None):
  del axis_name
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 6, 6, 2))
  y = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, 5)
  model = ResNet(group_norm=True)
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)
  return loss_fn, params, (x, y)


def _train(problem, dist=None, steps=4):
  loss_fn, params, batch = problem(None if dist is None else dist.axis)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.05, layers=grad_fn.discover(params, *batch), damping=1e-2,
               factor_update_every=1, inverse_update_every=2, distribution=dist)
  state = tx.init(params)

  def step(params, state, *batch):
    loss, grads, stats = grad_fn(params, *batch, opt_state=state)
    if dist is not None:
      grads, loss = jax.lax.pmean((grads, loss), "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  step, state = compile_step(step, state, dist, len(batch), extra_out=(P(),))
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, *batch)
    losses.append(float(loss))
  return params, state, losses


@pytest.mark.parametrize("problem", [_lm_problem, _bn_problem, _gn_problem],
                         ids=["transformer", "bn_resnet", "gn_resnet"])
def test_models_train_and_every_parameter_is_covered(problem):
  _, state, losses = _train(problem, steps=6)
  assert losses[-1] < losses[0]
  kstate = find_states(state)[0]
  assert not kstate.layout.passthrough, kd.describe(kstate)


@functools.lru_cache(maxsize=None)
def _reference(problem):
  return _train(problem)[0]


def _strategies():
  """Every owner-group shape and both factor reductions, not their product
  (test_distributed.py has the product on a Dense + Conv model)."""
  for fraction, name, reduction in ((1.0, "COMM", "reduce_scatter"),
                                    (0.25, "HYBRID", "all_reduce"),
                                    (0.125, "MEM", "reduce_scatter")):
    yield pytest.param(fraction, reduction, id=f"{name}-{reduction}")


# (slow, for CI time: by default the transformer's layer kinds run on 8
# devices in test_dp_kfac_trains)
@pytest.mark.slow
@pytest.mark.parametrize("fraction,factor_reduction", list(_strategies()))
@pytest.mark.parametrize("problem", [_lm_problem, _bn_problem, _gn_problem],
                         ids=["transformer", "bn_resnet", "gn_resnet"])
def test_distributed_equals_single_device(problem, factor_reduction, fraction):
  """Every strategy on 8 devices equals one device on the global batch; the
  ResNet's BatchNorm is synchronised over the data axis (training mode), its
  GroupNorm needs nothing (each image normalised on its own)."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction)
  got = _train(problem, dist)[0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               got, _reference(problem))


@pytest.mark.parametrize("problem", [_lm_problem, pytest.param(_bn_problem, marks=pytest.mark.slow)],
                         ids=["transformer", "bn_resnet"])
def test_dp_kfac_trains(problem):
  """DP-KFAC (factor_reduction="local": each owner's factors from its own
  local batch) is not the single-device run; it trains, and its factor
  reduction moves nothing (checked in test_distributed)."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=1 / 8, factor_reduction="local")
  _, state, losses = _train(problem, dist, steps=6)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert int(find_states(state)[0].skipped) == 0


@pytest.mark.slow
def test_embedding_of_replicated_ids_inside_shard_map():
  """Position ids the same on every device (jnp.arange): A does not vary over
  the axis while G does; the capture must still type both alike."""
  mesh = helpers.data_mesh(2)

  class Positions(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      ids = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)   # invariant
      return kd.linen.Dense(5)(kd.linen.Embed(6, 4)(ids) + kd.linen.Embed(5, 4)(tokens))

  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 6), 0, 5)
  model = Positions()
  params = model.init(jax.random.PRNGKey(1), tokens)

  def loss_fn(p, t):
    return kd.losses.softmax_cross_entropy(model.apply(p, t), t)
  grad_fn = kd.value_and_grad(loss_fn)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")),
                     out_specs=P())
  def stats_of(p, t):
    _, _, stats = grad_fn(p, t)
    return jax.lax.pmean(stats, "data")

  got = stats_of(params, tokens)
  want = grad_fn(params, tokens)[2]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               got, want)
