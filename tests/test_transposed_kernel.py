"""Transposed kernels in K-FAC (`ConvTranspose(transpose_kernel=True)`,
PyTorch's convention for a transposed convolution's weights; `kd.tags.dense`
with `transpose_kernel=True`, PyTorch's and Equinox's `(out, in)` `Linear`
weights).

Such a kernel is stored `(*window, out, in)` and applied flipped over its
window with its channel axes swapped (a dense one: transposed); K-FAC's
factors are those of the applied kernel (the statistics against brute force
are in test_capture.py).
The oracles here: the same network with the applied kernel as its parameter
(float64: every method, every update equal after the flip and swap), NumPy's
Kronecker solve, and the single-device run on 8 devices.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64
BLOCKS = 2                 # a stacked transposed kernel's blocks


def _flip_swap(kernel: jax.Array) -> jax.Array:
  """`[..., kh, kw, c, c']` → flipped over `kh, kw`, `c` and `c'` swapped (its
  own inverse): a transposed kernel's leaf ↔ the kernel it applies."""
  return jnp.swapaxes(jnp.flip(kernel, (-4, -3)), -1, -2)


def _params(seed: int = 0) -> dict:
  """"up": a transposed kernel `(3, 3, out 4, in 3)` with a bias; "mix":
  `BLOCKS` stacked transposed kernels `(2, 2, 4, 4)`, no bias; "head": a
  dense `(out 5, in 4)` weight with a bias."""
  rng = np.random.default_rng(seed)
  params = {"stem": {"kernel": rng.normal(size=(3, 3, 2, 3)) * 0.4},
            "up": {"kernel": rng.normal(size=(3, 3, 4, 3)) * 0.4,
                   "bias": rng.normal(size=4) * 0.1},
            "mix": {"kernel": rng.normal(size=(BLOCKS, 2, 2, 4, 4)) * 0.4},
            "head": {"kernel": rng.normal(size=(5, 4)) * 0.4,
                     "bias": rng.normal(size=5) * 0.1}}
  return jax.tree.map(lambda x: jnp.asarray(x, F64), params)


def _applied_params(params: dict) -> dict:
  """The same network's parameters with the applied kernels as leaves."""
  return {**params, "up": {**params["up"], "kernel": _flip_swap(params["up"]["kernel"])},
          "mix": {"kernel": _flip_swap(params["mix"]["kernel"])},
          "head": {**params["head"], "kernel": params["head"]["kernel"].T}}


def _network(p: dict, x: jax.Array, transposed: bool) -> jax.Array:
  """stem conv → a transposed convolution upsampling by 2 (the input dilated
  by the strides, SAME's pads) → two blocks of a stacked one → mean → dense;
  `transposed`: the kernels are the stored ones (`transpose_kernel=True`),
  else the applied ones (`_applied_params`)."""
  h = jnp.tanh(kd.tags.conv2d(x, p["stem"]["kernel"], name="stem"))
  h = jnp.tanh(kd.tags.conv2d(h, p["up"]["kernel"], p["up"]["bias"], name="up",
                              padding=((2, 2), (2, 2)), input_dilation=(2, 2),
                              transpose_kernel=transposed))
  for i in range(BLOCKS):
    h = jnp.tanh(kd.tags.conv2d(h, p["mix"]["kernel"], name="mix", stack_index=i,
                                transpose_kernel=transposed))
  return kd.tags.dense(h.mean((1, 2)), p["head"]["kernel"], p["head"]["bias"], name="head",
                       transpose_kernel=transposed)


def _batch(n: int = 16):
  return helpers.image_batch((n, 4, 4, 2))


def _loss(transposed: bool):
  return lambda p, x, y: kd.losses.softmax_cross_entropy(_network(p, x, transposed), y)


def _trajectory(transposed: bool, config: dict) -> dict:
  params, batch = _params(), _batch()
  params = params if transposed else _applied_params(params)
  layers = kd.value_and_grad(_loss(transposed)).discover(params, *batch)
  assert [layer.transposed_kernel for layer in layers] == [False] + [transposed] * 3
  params = helpers.method_trajectory(_loss(transposed), params, batch, config)
  return params if transposed else _applied_params(params)   # (its own inverse)


@pytest.mark.parametrize("config", helpers.method_params(("eigen", "ekfac", "diagonal_A")))
def test_transposed_updates_equal_the_applied_kernels(config):
  """A transposed kernel is preconditioned exactly as the kernel it applies:
  four steps of every method give the parameters of the network whose
  leaves are the applied kernels, flipped and swapped back, to float64
  precision (a stacked one's blocks each as its own layer)."""
  with jax.enable_x64(True):
    got = _trajectory(True, helpers.METHOD_CONFIGS[config])
    want = _trajectory(False, helpers.METHOD_CONFIGS[config])
    start = _params()
    for name in ("up", "mix", "head"):
      assert float(jnp.max(jnp.abs(got[name]["kernel"] - start[name]["kernel"]))) > 1e-3
    helpers.assert_trees_equal(got, want, rtol=1e-10)


def test_transposed_update_equals_kronecker_solve():
  """One step: the transposed kernel's update, flipped and swapped, with its
  bias row, is NumPy's solve of `(A ⊗ G + γI) vec(V) = vec(∇)`, ∇ the
  applied kernel's gradient `[kh·kw·in, out]` and the bias row."""
  with jax.enable_x64(True):
    gamma = 1e-2
    grads, updates, factors, _ = helpers.first_kfac_step(_loss(True), _params(), _batch(),
                                                         gamma)
    grad = np.concatenate([np.asarray(_flip_swap(grads["up"]["kernel"])).reshape(-1, 4),
                           np.asarray(grads["up"]["bias"])[None]])
    a, g = np.asarray(factors["up"]["A"]), np.asarray(factors["up"]["G"])
    assert a.shape == (3 * 3 * 3 + 1,) * 2 and g.shape == (4, 4)
    want = np.linalg.solve(np.kron(a, g) + gamma * np.eye(a.shape[0] * 4),
                           grad.reshape(-1)).reshape(grad.shape)
    got = np.concatenate([np.asarray(_flip_swap(updates["up"]["kernel"])).reshape(-1, 4),
                          np.asarray(updates["up"]["bias"])[None]])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # The dense head: its (out, in) weight transposed, with its bias row.
    grad = np.concatenate([np.asarray(grads["head"]["kernel"]).T,
                           np.asarray(grads["head"]["bias"])[None]])
    a, g = np.asarray(factors["head"]["A"]), np.asarray(factors["head"]["G"])
    assert a.shape == (4 + 1,) * 2 and g.shape == (5, 5)
    want = np.linalg.solve(np.kron(a, g) + gamma * np.eye(a.shape[0] * 5),
                           grad.reshape(-1)).reshape(grad.shape)
    got = np.concatenate([np.asarray(updates["head"]["kernel"]).T,
                          np.asarray(updates["head"]["bias"])[None]])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


class _TorchLinear(nn.Module):
  """A dense layer with PyTorch's `(out, in)` weight, tagged with `kd.tags`."""
  features: int

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.lecun_normal(),
                        (self.features, x.shape[-1]))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    return kd.tags.dense(x, weight, bias, transpose_kernel=True)


class _Decoder(nn.Module):
  """A small decoder in `kd.linen`: conv, a PyTorch-style transposed
  convolution (stride 2, explicit padding), conv, a PyTorch-style head."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(4, (3, 3))(x))
    x = nn.relu(kd.linen.ConvTranspose(6, (3, 3), strides=(2, 2), padding=((2, 1), (2, 1)),
                                       transpose_kernel=True)(x))
    x = nn.relu(kd.linen.Conv(4, (3, 3), use_bias=False)(x))
    return _TorchLinear(5)(x.mean((1, 2)))


def _decoder_train(dist=None):
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 4, 4, 3))
  y = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, 5)

  def check(layers):
    assert [layer.transposed_kernel for layer in layers] == [False, True, False, True]
    assert not layers.uncaptured
  return helpers.train_classifier(_Decoder(), x, y, dist, check_layers=check)


@pytest.mark.parametrize("fraction", [1 / 8, pytest.param(1.0, marks=pytest.mark.slow)],
                         ids=["MEM-OPT", "COMM-OPT"])
def test_transposed_distributed_equals_single_device(fraction):
  """A `kd.linen.ConvTranspose(transpose_kernel=True)` decoder with a
  PyTorch-layout head on 8 devices equals the single-device run."""
  want, losses = _decoder_train()
  assert losses[-1] < losses[0]
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  got, _ = _decoder_train(dist)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               got, want)


def test_registry_round_trip_of_a_stacked_transposed_kernel():
  """`leaf_blocks` gives each block as applied and `blocks_leaf` inverts it;
  the leaf's shape is the stored one."""
  with jax.enable_x64(True):
    params = _params()
    layers = kd.value_and_grad(_loss(True)).discover(params, *_batch())
  mix = next(layer for layer in layers if layer.name == "mix")
  leaf = params["mix"]["kernel"]
  assert mix.kernel_shape == (2, 2, 4, 4) and mix.leaf_shape(mix.kernel_shape) == leaf.shape
  up = next(layer for layer in layers if layer.name == "up")
  assert up.kernel_shape == (3, 3, 3, 4)
  assert up.leaf_shape(up.kernel_shape) == params["up"]["kernel"].shape
  blocks = mix.leaf_blocks(leaf, mix.kernel_shape)
  np.testing.assert_array_equal(blocks, _flip_swap(leaf))
  np.testing.assert_array_equal(mix.blocks_leaf(blocks, mix.kernel_shape), leaf)
  np.testing.assert_array_equal(up.leaf_blocks(params["up"]["bias"], (4,))[0],
                                params["up"]["bias"])
