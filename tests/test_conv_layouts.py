"""Convolutions in PyTorch's and Equinox's layout: `(out, in / n, *window)`
kernels on channels-first inputs (`kernel_axes`, `channels_first` of
`kd.tags.conv1d/2d/3d`), grouped and transposed ones too.

Such a layer applies `jnp.transpose(kernel, kernel_axes)`, Flax's `(*window,
in / n, out)`, to the input with its channels moved last; K-FAC's factors
are those of that applied kernel, its updates transposed back into the
stored leaf. The oracles: the same network in Flax's layout (float64: every
update equal after the transposition), NumPy's Kronecker solve, the
registry's leaf ↔ blocks maps against the transposition written out, and
the single-device run on 8 devices.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64
TORCH_2D = (2, 3, 1, 0)        # (out, in, kh, kw) applied as (kh, kw, in, out)
# (name, groups, input channels per group, output channels per group, bias)
LAYERS = (("stem", 1, 2, 4, True), ("depthwise", 4, 1, 2, True), ("grouped", 2, 4, 3, False))


def _flax_params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  params = {}
  for name, groups, c_in, c_out, bias in LAYERS:
    params[name] = {"kernel": rng.normal(size=(3, 3, c_in, groups * c_out)) * 0.4}
    if bias:
      params[name]["bias"] = rng.normal(size=groups * c_out) * 0.1
  params["up"] = {"kernel": rng.normal(size=(2, 2, 5, 6)) * 0.4}   # (kh, kw, out, in)
  params["head"] = {"kernel": rng.normal(size=(5, 5)) * 0.4}
  return jax.tree.map(lambda x: jnp.asarray(x, F64), params)


def _torch_params(flax: dict) -> dict:
  """The same parameters as PyTorch stores them: convolutions `(out, in, kh,
  kw)`, the transposed convolution `(in, out, kh, kw)` (its `(kh, kw, out,
  in)` leaf's axes moved the same way)."""
  return {name: {**p, "kernel": jnp.transpose(p["kernel"], np.argsort(TORCH_2D))}
          if name != "head" else p for name, p in flax.items()}


def _flax_layout(torch: dict) -> dict:
  """`_torch_params`' inverse."""
  return {name: {**p, "kernel": jnp.transpose(p["kernel"], TORCH_2D)}
          if name != "head" else p for name, p in torch.items()}


def _network(p: dict, x: jax.Array, torch: bool) -> jax.Array:
  """stem conv → depthwise conv (strided) → grouped conv → transposed conv
  (stride 2, PyTorch's ConvTranspose2d weight) → mean → dense, on NHWC
  images; `torch`: the kernels in PyTorch's layout on NCHW ones."""
  layout = dict(kernel_axes=TORCH_2D, channels_first=True) if torch else {}
  h = jnp.moveaxis(x, -1, 1) if torch else x
  for (name, groups, *_), strides in zip(LAYERS, (1, 2, 1)):
    h = jnp.tanh(kd.tags.conv2d(h, p[name]["kernel"], p[name].get("bias"),
                                strides=strides, feature_group_count=groups, name=name,
                                **layout))
  h = jnp.tanh(kd.tags.conv2d(h, p["up"]["kernel"], padding=((1, 1), (1, 1)),
                              input_dilation=(2, 2), transpose_kernel=True, name="up",
                              **layout))
  h = h.mean((2, 3)) if torch else h.mean((1, 2))
  return kd.tags.dense(h, p["head"]["kernel"], name="head")


def _loss(torch: bool):
  return lambda p, x, y: kd.losses.softmax_cross_entropy(_network(p, x, torch), y)


def _batch(n: int = 16):
  return helpers.image_batch((n, 6, 6, 2))


@pytest.mark.parametrize("config", helpers.method_params(("eigen", "adaptive")))
def test_torch_layout_updates_equal_flax_layout(config):
  """Four steps of every method on PyTorch-layout kernels (plain, depthwise,
  grouped, transposed) and NCHW images equal those of the network in Flax's
  layout, transposed back; the layers are recorded with their applied
  kernels' shapes."""
  with jax.enable_x64(True):
    flax, batch = _flax_params(), _batch()
    layers = kd.value_and_grad(_loss(True)).discover(_torch_params(flax), *batch)
    assert [(l.name, l.kernel_shape, l.groups, l.kernel_axes) for l in layers] == [
        ("stem", (3, 3, 2, 4), 1, TORCH_2D), ("depthwise", (3, 3, 1, 2), 4, TORCH_2D),
        ("grouped", (3, 3, 4, 3), 2, TORCH_2D), ("up", (2, 2, 6, 5), 1, TORCH_2D),
        ("head", (5, 5), 1, None)]
    got = helpers.method_trajectory(_loss(True), _torch_params(flax), batch,
                                    helpers.METHOD_CONFIGS[config])
    want = helpers.method_trajectory(_loss(False), flax, batch,
                                     helpers.METHOD_CONFIGS[config])
    assert float(jnp.max(jnp.abs(want["grouped"]["kernel"] - flax["grouped"]["kernel"]))
                 ) > 1e-3
    helpers.assert_trees_equal(_flax_layout(got), want, rtol=1e-10)


def test_torch_layout_update_equals_kronecker_solve():
  """One step of a PyTorch-layout convolution with a bias: its update, as
  applied (`(kh·kw·in, out)` with its bias row), is NumPy's solve of `(A ⊗
  G + γI) vec(V) = vec(∇)`."""
  def loss(p, x, y):
    h = kd.tags.conv2d(jnp.moveaxis(x, -1, 1), p["conv"]["kernel"], p["conv"]["bias"],
                       kernel_axes=TORCH_2D, channels_first=True, name="conv")
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(jnp.tanh(h).mean((2, 3)), p["head"], name="head"), y)

  with jax.enable_x64(True):
    rng, gamma = np.random.default_rng(1), 1e-2
    params = {"conv": {"kernel": jnp.asarray(rng.normal(size=(4, 2, 3, 3)) * 0.4),
                       "bias": jnp.asarray(rng.normal(size=4) * 0.1)},
              "head": jnp.asarray(rng.normal(size=(4, 5)) * 0.4)}
    grads, updates, factors, _ = helpers.first_kfac_step(loss, params, _batch(), gamma)

    def as_applied(tree):
      kernel = np.asarray(jnp.transpose(tree["conv"]["kernel"], TORCH_2D)).reshape(18, 4)
      return np.concatenate([kernel, np.asarray(tree["conv"]["bias"])[None]])
    grad = as_applied(grads)
    a, g = np.asarray(factors["conv"]["A"]), np.asarray(factors["conv"]["G"])
    assert a.shape == (19, 19) and g.shape == (4, 4)
    want = np.linalg.solve(np.kron(a, g) + gamma * np.eye(76),
                           grad.reshape(-1)).reshape(grad.shape)
    np.testing.assert_allclose(as_applied(updates), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("spatial", [1, 3])
def test_torch_layout_conv1d_conv3d(spatial):
  """`conv1d` (`(out, in, k)` on `[N, C, L]`) and `conv3d` (`(out, in, kd,
  kh, kw)` on NCDHW), grouped: four steps equal Flax's layout's."""
  axes = tuple(range(2, spatial + 2)) + (1, 0)
  tag = kd.tags.CONVOLUTIONS[spatial]

  def loss(torch: bool):
    def fn(p, x, y):
      layout = dict(kernel_axes=axes, channels_first=True) if torch else {}
      h = jnp.moveaxis(x, -1, 1) if torch else x
      h = tag(h, p["conv"]["kernel"], p["conv"]["bias"], feature_group_count=2,
              name="conv", **layout)
      h = jnp.tanh(h).mean(tuple(range(2, spatial + 2)) if torch
                           else tuple(range(1, spatial + 1)))
      return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["head"], name="head"), y)
    return fn

  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    flax = {"conv": {"kernel": jnp.asarray(rng.normal(size=(2,) * spatial + (2, 6)) * 0.4),
                     "bias": jnp.asarray(rng.normal(size=6) * 0.1)},
            "head": jnp.asarray(rng.normal(size=(6, 5)) * 0.4)}
    torch = {**flax, "conv": {**flax["conv"], "kernel": jnp.transpose(
        flax["conv"]["kernel"], np.argsort(axes))}}
    batch = helpers.image_batch((12,) + (4,) * spatial + (4,))
    got = helpers.method_trajectory(loss(True), torch, batch, helpers.METHOD_CONFIGS["eigen"])
    want = helpers.method_trajectory(loss(False), flax, batch,
                                     helpers.METHOD_CONFIGS["eigen"])
    got["conv"]["kernel"] = jnp.transpose(got["conv"]["kernel"], axes)
    helpers.assert_trees_equal(got, want, rtol=1e-10)


def test_permuted_grouped_stacked_leaf_blocks():
  """The registry's maps for a stacked, grouped, PyTorch-layout kernel leaf
  `[L, out, in / n, kh, kw]`: `leaf_blocks` gives block `(l, g)` as group
  `g` of `kernel[l]` in Flax's layout, `blocks_leaf` inverts it, `leaf_shape`
  is the leaf's; the bias `[L, out]` splits into the groups' slices."""
  blocks, groups, c_in, c_out = 2, 3, 2, 4
  layer = kd.TaggedLayer(name="conv", kind="conv2d", kernel_path="k", bias_path="b",
                         kernel_shape=(3, 3, c_in, c_out), a_dim=9 * c_in + 1, g_dim=c_out,
                         stack=(blocks, groups), groups=groups, kernel_axes=TORCH_2D)
  leaf = jnp.arange(blocks * groups * c_out * c_in * 9.0).reshape(
      blocks, groups * c_out, c_in, 3, 3)
  want = jnp.stack([jnp.transpose(leaf[l], TORCH_2D)[..., g * c_out:(g + 1) * c_out]
                    for l in range(blocks) for g in range(groups)])
  got = layer.leaf_blocks(leaf, layer.kernel_shape)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(layer.blocks_leaf(got, layer.kernel_shape), leaf)
  assert layer.leaf_shape(layer.kernel_shape) == leaf.shape
  bias = jnp.arange(blocks * groups * c_out * 1.0).reshape(blocks, groups * c_out)
  np.testing.assert_array_equal(layer.leaf_blocks(bias, (c_out,)),
                                bias.reshape(blocks * groups, c_out))
  np.testing.assert_array_equal(layer.blocks_leaf(bias.reshape(-1, c_out), (c_out,)), bias)


class _TorchLayoutNet(nn.Module):
  """A Flax module holding PyTorch-layout convolution weights (a ported
  checkpoint), applied to NHWC images moved to NCHW."""

  @nn.compact
  def __call__(self, x):
    h = jnp.moveaxis(x, -1, 1)
    for name, (c_out, c_in, groups) in {"c1": (8, 4, 1), "c2": (8, 1, 8)}.items():
      kernel = self.param(name, nn.initializers.lecun_normal(in_axis=1, out_axis=0),
                          (c_out, c_in, 3, 3))
      h = nn.relu(kd.tags.conv2d(h, kernel, feature_group_count=groups, name=name,
                                 kernel_axes=TORCH_2D, channels_first=True))
    return kd.linen.Dense(5)(h.mean((2, 3)))


@pytest.mark.parametrize("strategy", helpers.slow_unless(("COMM-OPT", "MEM-OPT"),
                                                         ("MEM-OPT",)))
def test_torch_layout_distributed_equals_single_device(strategy):
  """PyTorch-layout plain and depthwise convolutions on 8 devices (the
  depthwise groups' blocks spread over the owners under MEM-OPT) equal the
  single-device run."""
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 6, 6, 4))
  y = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, 5)
  want, losses = helpers.train_classifier(_TorchLayoutNet(), x, y)
  assert losses[-1] < losses[0]
  fraction = 1.0 if strategy == "COMM-OPT" else 1 / 8
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  got, _ = helpers.train_classifier(_TorchLayoutNet(), x, y, dist)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               got, want)


def test_layout_errors():
  x, kernel = jnp.ones((2, 2, 5, 5)), jnp.ones((4, 2, 3, 3))     # NCHW, (out, in, kh, kw)
  with pytest.raises(ValueError, match=r"kernel_axes=\(2, 3, 1, 0\), channels_first=True\)"):
    kd.tags.conv2d(x, kernel)
  with pytest.raises(ValueError, match=r"PyTorch's and Equinox's: kernel_axes=\(2, 3, 1, 0\)\)"):
    kd.tags.conv2d(x, kernel, channels_first=True)
  with pytest.raises(ValueError, match=r"conv2d: kernel_axes=\(2, 3, 1\) must be a "
                                       r"permutation of the kernel's 4 axes"):
    kd.tags.conv2d(x, kernel, kernel_axes=(2, 3, 1), channels_first=True)
  with pytest.raises(ValueError, match=r"channels_first=True expects \[N, C, 2-D spatial\] "
                                       r"inputs, got \(2, 5, 5\)"):
    kd.tags.conv2d(x[0], kernel, kernel_axes=TORCH_2D, channels_first=True)
  y = kd.tags.conv2d(x, kernel, kernel_axes=TORCH_2D, channels_first=True)
  want = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                      dimension_numbers=("NCHW", "OIHW", "NCHW"))
  np.testing.assert_allclose(y, want, rtol=1e-6)


def test_torch_layout_kernel_sharded_on_a_spatial_axis():
  """A PyTorch-layout kernel sharded over a model axis on its window (stored
  axis 2, `kh`) is refused, the error naming the stored axis as well."""
  from jax.sharding import PartitionSpec as P
  mesh = helpers.mesh((2, 4), ("data", "model"))
  params = {"conv": {"kernel": jnp.ones((8, 3, 4, 4)), "bias": jnp.zeros(8)},
            "head": jnp.ones((8, 5))}
  specs = {"conv": {"kernel": P(None, None, "model"), "bias": P()}, "head": P()}

  def loss(p, x, y):
    h = kd.tags.conv2d(x, p["conv"]["kernel"], p["conv"]["bias"], name="conv",
                       kernel_axes=TORCH_2D, channels_first=True, padding="VALID")
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h.mean((2, 3)), p["head"]), y)
  dist = kd.Distribution(mesh, axis="data", model_axis="model", param_specs=specs)
  layers = kd.value_and_grad(loss).discover(params, jnp.ones((4, 3, 6, 6)),
                                            jnp.zeros(4, int), distribution=dist)
  with pytest.raises(ValueError, match=r"sharded over 'model' on spatial axis 0 \(the stored "
                                       r"\(8, 3, 1, 4\)'s axis 2, kernel_axes=\(2, 3, 1, 0\)\)"):
    kd.kfac(0.1, layers=layers, distribution=dist).init(params)
