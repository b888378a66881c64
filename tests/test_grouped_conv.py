"""Grouped and depthwise convolutions in K-FAC: one block per group.

A convolution with `feature_group_count = n` is `n` convolutions side by side,
each over its own slice of the channels, sharing no weight; K-FAC gives each
group its own `A ⊗ G` (the statistics against brute force are in
test_capture.py). The oracles here: the same network written as one plain
convolution per group (float64: every method, every update equal), NumPy's
solve of each group's Kronecker system, and the single-device run for every
distribution strategy on 8 devices.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64
# (name, groups, input channels per group, output channels per group, bias)
GROUPED = (("depthwise", 4, 1, 2, True), ("grouped", 2, 4, 3, False))


def _params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  params = {"stem": {"kernel": rng.normal(size=(3, 3, 2, 4)) * 0.4,
                     "bias": rng.normal(size=4) * 0.1}}
  for name, groups, c_in, c_out, bias in GROUPED:
    params[name] = {"kernel": rng.normal(size=(3, 3, c_in, groups * c_out)) * 0.4}
    if bias:
      params[name]["bias"] = rng.normal(size=groups * c_out) * 0.1
  params["head"] = {"kernel": rng.normal(size=(6, 5)) * 0.4}
  return jax.tree.map(lambda x: jnp.asarray(x, F64), params)


def _network(p: dict, x: jax.Array, split: bool) -> jax.Array:
  """stem conv → depthwise conv (channel multiplier 2, strided) → grouped
  conv → mean → dense; `split`: each group as a plain convolution of its own
  channels and its own slice of the kernel (`_split_params`: "<layer>_<g>")."""
  h = jnp.tanh(kd.tags.conv2d(x, p["stem"]["kernel"], p["stem"]["bias"], name="stem"))
  for (name, groups, c_in, _, _), strides in zip(GROUPED, ((2, 2), (1, 1))):
    if not split:
      h = kd.tags.conv2d(h, p[name]["kernel"], p[name].get("bias"), strides=strides,
                         feature_group_count=groups, name=name)
    else:
      h = jnp.concatenate([kd.tags.conv2d(
          h[..., g * c_in:(g + 1) * c_in], p[f"{name}_{g}"]["kernel"],
          p[f"{name}_{g}"].get("bias"), strides=strides, name=f"{name}_{g}")
          for g in range(groups)], axis=-1)
    h = jnp.tanh(h)
  return kd.tags.dense(h.mean((1, 2)), p["head"]["kernel"], name="head")


def _split_params(params: dict) -> dict:
  out = {"stem": params["stem"], "head": params["head"]}
  for name, groups, _, c_out, _ in GROUPED:
    for g in range(groups):
      out[f"{name}_{g}"] = jax.tree.map(
          lambda x: x[..., g * c_out:(g + 1) * c_out], params[name])
  return out


def _joined(split: dict) -> dict:
  out = {"stem": split["stem"], "head": split["head"]}
  for name, groups, *_ in GROUPED:
    out[name] = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=-1),
                             *(split[f"{name}_{g}"] for g in range(groups)))
  return out


def _batch(n: int = 16):
  return helpers.image_batch((n, 6, 6, 2))


def _loss(split: bool):
  return lambda p, x, y: kd.losses.softmax_cross_entropy(_network(p, x, split), y)


def _trajectory(split: bool, config: dict) -> dict:
  params = _split_params(_params()) if split else _params()
  params = helpers.method_trajectory(_loss(split), params, _batch(), config)
  return _joined(params) if split else params


@pytest.mark.parametrize("config", helpers.method_params(("eigen", "adaptive")))
def test_grouped_updates_equal_split_convolutions(config):
  """Each group is preconditioned exactly as a convolution of its own: four
  steps of every method (eigen, inverses, EK-FAC, a diagonal `A`, stale
  statistics, adaptive learning rate, momentum and damping) give the
  parameters of the split network to float64 precision."""
  with jax.enable_x64(True):
    got = _trajectory(False, helpers.METHOD_CONFIGS[config])
    want = _trajectory(True, helpers.METHOD_CONFIGS[config])
    start = _params()
    assert float(jnp.max(jnp.abs(got["depthwise"]["kernel"] - start["depthwise"]["kernel"]))
                 ) > 1e-3
    helpers.assert_trees_equal(got, want, rtol=1e-10)


STACKED = 2                # blocks of the stacked depthwise convolution
CHANNELS = 4


def _stacked_params() -> dict:
  rng = np.random.default_rng(1)
  params = {"dw": {"kernel": rng.normal(size=(STACKED, 3, 3, 1, CHANNELS)) * 0.5,
                   "bias": rng.normal(size=(STACKED, CHANNELS)) * 0.1},
            "head": {"kernel": rng.normal(size=(CHANNELS, 5)) * 0.4}}
  return jax.tree.map(lambda x: jnp.asarray(x, F64), params)


def _stacked_network(p: dict, x: jax.Array, split: bool) -> jax.Array:
  """Two blocks of a depthwise convolution stacked in one leaf (`stack_index`)
  → mean → dense; `split`: each block's each channel a plain convolution of
  its own ("dw_<block>_<channel>")."""
  h = x
  for i in range(STACKED):
    if not split:
      h = kd.tags.conv2d(h, p["dw"]["kernel"], p["dw"]["bias"], stack_index=i,
                         feature_group_count=CHANNELS, name="dw")
    else:
      h = jnp.concatenate([kd.tags.conv2d(
          h[..., c:c + 1], p[f"dw_{i}_{c}"]["kernel"], p[f"dw_{i}_{c}"]["bias"],
          name=f"dw_{i}_{c}") for c in range(CHANNELS)], axis=-1)
    h = jnp.tanh(h)
  return kd.tags.dense(h.mean((1, 2)), p["head"]["kernel"], name="head")


def _stacked_split(params: dict) -> dict:
  out = {"head": params["head"]}
  for i in range(STACKED):
    for c in range(CHANNELS):
      out[f"dw_{i}_{c}"] = jax.tree.map(lambda x: x[i, ..., c:c + 1], params["dw"])
  return out


def _stacked_joined(split: dict) -> dict:
  dw = {w: jnp.stack([jnp.concatenate([split[f"dw_{i}_{c}"][w] for c in range(CHANNELS)],
                                      axis=-1) for i in range(STACKED)])
        for w in ("kernel", "bias")}
  return {"dw": dw, "head": split["head"]}


@pytest.mark.parametrize("config", helpers.method_params(("eigen", "ekfac")))
def test_stacked_grouped_updates_equal_split_convolutions(config):
  """A depthwise convolution stacked over blocks (`stack` `(blocks, groups)`):
  each block's each group is preconditioned as a convolution of its own."""
  with jax.enable_x64(True):
    batch = helpers.image_batch((16, 5, 5, CHANNELS))
    loss = lambda split: (lambda p, x, y: kd.losses.softmax_cross_entropy(
        _stacked_network(p, x, split), y))
    got = helpers.method_trajectory(loss(False), _stacked_params(), batch,
                                    helpers.METHOD_CONFIGS[config])
    want = _stacked_joined(helpers.method_trajectory(
        loss(True), _stacked_split(_stacked_params()), batch,
        helpers.METHOD_CONFIGS[config]))
    assert float(jnp.max(jnp.abs(got["dw"]["kernel"] - _stacked_params()["dw"]["kernel"]))
                 ) > 1e-3
    helpers.assert_trees_equal(got, want, rtol=1e-10)


def test_grouped_update_equals_kronecker_solve():
  """One step: group `g`'s kernel and bias update is NumPy's solve of `(A_g ⊗
  G_g + γI) vec(V) = vec(∇_g)` with the group's own factors, ∇_g its slice of
  the kernel's last axis (and of the bias)."""
  with jax.enable_x64(True):
    gamma = 1e-2
    grads, updates, factors, state = helpers.first_kfac_step(_loss(False), _params(),
                                                             _batch(), gamma)
    for name, groups, c_in, c_out, bias in GROUPED:
      kernel = np.asarray(grads[name]["kernel"])
      for g in range(groups):
        cols = slice(g * c_out, (g + 1) * c_out)
        grad = kernel[..., cols].reshape(-1, c_out)
        if bias:
          grad = np.concatenate([grad, np.asarray(grads[name]["bias"])[None, cols]])
        a = np.asarray(factors[f"{name}/{g}"]["A"])
        gg = np.asarray(factors[f"{name}/{g}"]["G"])
        assert a.shape == (9 * c_in + bias,) * 2 and gg.shape == (c_out, c_out)
        big = np.kron(a, gg) + gamma * np.eye(a.shape[0] * c_out)
        want = np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
        np.testing.assert_allclose(
            np.asarray(updates[name]["kernel"])[..., cols].reshape(-1, c_out),
            want[:9 * c_in], rtol=1e-9, atol=1e-12)
        if bias:
          np.testing.assert_allclose(np.asarray(updates[name]["bias"])[cols], want[-1],
                                     rtol=1e-9, atol=1e-12)
    table = kd.describe(state, print_table=False)
    assert "depthwise/3" in table and "grouped/1" in table


class _LinenNet(nn.Module):
  """A MobileNet-like block in `kd.linen`: 1x1 expansion, depthwise 3x3
  (strided), grouped 1x1 projection, head."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(8, (1, 1))(x))
    x = nn.relu(kd.linen.Conv(8, (3, 3), strides=2, feature_group_count=8)(x))
    x = nn.relu(kd.linen.Conv(6, (1, 1), feature_group_count=2, use_bias=False)(x))
    return kd.linen.Dense(5)(x.mean((1, 2)))


def _linen_train(dist=None, **options):
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 6, 6, 4))
  y = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, 5)

  def check(layers):
    assert [layer.groups for layer in layers] == [1, 8, 2, 1] and not layers.uncaptured
  return helpers.train_classifier(_LinenNet(), x, y, dist, check_layers=check, **options)


STRATEGIES = {
    "COMM-OPT": dict(grad_worker_fraction=1.0),
    "HYBRID": dict(grad_worker_fraction=0.25),
    "MEM-OPT": dict(grad_worker_fraction=1 / 8),
    "SP-NGD": dict(grad_worker_fraction=1 / 8, gradient_reduction="reduce_scatter"),
}


@pytest.mark.parametrize("strategy", helpers.slow_unless(STRATEGIES, ("HYBRID",)))
def test_grouped_distributed_equals_single_device(strategy):
  """A depthwise and a grouped `kd.linen.Conv` on 8 devices (their groups'
  blocks spread over the owners) equal the single-device run; SP-NGD's
  configuration with inverses."""
  options = {"method": "inverse"} if strategy == "SP-NGD" else {}
  want, losses = _linen_train(**options)
  assert losses[-1] < losses[0]
  dist = kd.Distribution(helpers.data_mesh(8), **STRATEGIES[strategy])
  got, _ = _linen_train(dist, **options)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               got, want)
