"""Oracle tests for the statistics capture (`kd.value_and_grad`, tags, losses).

Every statistic is checked against a brute-force, per-example construction in
float64 that does not use the library's code: layer inputs are recorded by a
plain-jnp reference forward, conv patches are built with explicit Python loops,
and the per-example output gradients `g_p = Σ_e ∂ℓ_e/∂s_p` come from the full
Jacobian of the vector of per-example losses w.r.t. a zero perturbation added
to each layer output. The conventions under test (see `factors`):

    A = (1/N) Σ_p a_p a_pᵀ     (a = [x, 1] with a bias, bias coordinate last)
    G = (1/n) Σ_p g_p g_pᵀ     (n: examples of the mean loss, unmasked ones)

with N the number of positions the layer is applied at (examples, tokens or
output pixels). The statistics of a float64 model are computed in float64, so
comparisons allow float64 rounding only (1e-10 relative); every broken
convention (scaling, order, bias position) is off by far more than that.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import typing
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import kfac_jax_dist as kd
from kfac_jax_dist.flax import common as flax_common
from helpers import (assert_factor_close, assert_trees_equal, capture, ce_per_example,
                     check_mc_estimate, f64, mc_draws, randn, upper)
from helpers import param_shapes as _shapes, randomized as _randomized

HIGHEST = lax.Precision.HIGHEST


@pytest.fixture(autouse=True, scope="module")
def _enable_x64():
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


# ---------------------------------------------------------------------------
# Brute force.
# ---------------------------------------------------------------------------

def explicit_conv_padding(in_size, k, stride, dilation, padding):
  """(lo, hi) padding of one spatial axis, XLA's SAME/VALID convention."""
  k_eff = (k - 1) * dilation + 1
  if padding == "VALID":
    return (0, 0)
  if padding == "SAME":
    out = -(-in_size // stride)
    total = max((out - 1) * stride + k_eff - in_size, 0)
    return (total // 2, total - total // 2)
  return tuple(padding)


def brute_patches(x, kernel_hw, strides, padding, dilation):
  """im2col with explicit loops: `[B, Ho, Wo, kh*kw*C]`, features (kh, kw, C)."""
  x = f64(x)
  b, h, w, c = x.shape
  kh, kw = kernel_hw
  if isinstance(padding, str):
    pads = [explicit_conv_padding(h, kh, strides[0], dilation[0], padding),
            explicit_conv_padding(w, kw, strides[1], dilation[1], padding)]
  else:
    pads = [tuple(p) for p in padding]
  (ph_lo, ph_hi), (pw_lo, pw_hi) = pads
  xp = np.zeros((b, h + ph_lo + ph_hi, w + pw_lo + pw_hi, c))
  xp[:, ph_lo:ph_lo + h, pw_lo:pw_lo + w, :] = x
  ho = (xp.shape[1] - ((kh - 1) * dilation[0] + 1)) // strides[0] + 1
  wo = (xp.shape[2] - ((kw - 1) * dilation[1] + 1)) // strides[1] + 1
  out = np.zeros((b, ho, wo, kh * kw * c))
  for n in range(b):
    for i in range(ho):
      for j in range(wo):
        feature = []
        for di in range(kh):
          for dj in range(kw):
            for ch in range(c):
              feature.append(xp[n, i * strides[0] + di * dilation[0],
                                j * strides[1] + dj * dilation[1], ch])
        out[n, i, j] = feature
  return out


def brute_patches_1d(x, k, stride, padding, dilation):
  """1-D im2col with explicit loops: `[B, Lo, k*C]`, features (k, C)."""
  x = f64(x)
  b, length, c = x.shape
  lo, hi = (explicit_conv_padding(length, k, stride, dilation, padding)
            if isinstance(padding, str) else tuple(padding[0]))
  xp = np.zeros((b, length + lo + hi, c))
  xp[:, lo:lo + length] = x
  out_len = (xp.shape[1] - ((k - 1) * dilation + 1)) // stride + 1
  out = np.zeros((b, out_len, k * c))
  for n in range(b):
    for t in range(out_len):
      out[n, t] = [xp[n, t * stride + j * dilation, ch] for j in range(k) for ch in range(c)]
  return out


def brute_patches_3d(x, size, strides, padding, dilation):
  """3-D im2col with explicit loops: `[B, Do, Ho, Wo, kd*kh*kw*C]`, features
  (kd, kh, kw, C)."""
  x = f64(x)
  b, *spatial, c = x.shape
  pads = [explicit_conv_padding(n, k, s, d, padding) if isinstance(padding, str)
          else tuple(p) for n, k, s, d, p in zip(spatial, size, strides, dilation,
                                                 padding if not isinstance(padding, str)
                                                 else [padding] * 3)]
  xp = np.pad(x, [(0, 0)] + pads + [(0, 0)])
  out = [(xp.shape[1 + i] - ((size[i] - 1) * dilation[i] + 1)) // strides[i] + 1
         for i in range(3)]
  patches = np.zeros((b, *out, int(np.prod(size)) * c))
  for n in range(b):
    for o in np.ndindex(*out):
      patches[(n, *o)] = [
          xp[(n,) + tuple(o[i] * strides[i] + w[i] * dilation[i] for i in range(3)) + (ch,)]
          for w in np.ndindex(*size) for ch in range(c)]
  return patches


class Ref:
  """Plain-jnp layers: record each layer's input rows `a_p` and output, and add a
  perturbation `eps[name]` to the output (to differentiate w.r.t. it)."""

  def __init__(self, eps=None, record=False):
    self.eps = eps or {}
    self.record = record
    self.rows = {}
    self.outputs = {}

  def _finish(self, name, rows, y, has_bias):
    if self.record:
      rows = rows.reshape(-1, rows.shape[-1])
      if has_bias:
        rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
      self.rows[name] = rows
      self.outputs[name] = y
    return y + self.eps[name] if name in self.eps else y

  def dense(self, x, kernel, bias=None, *, name):
    y = jnp.einsum("...i,io->...o", x, kernel, precision=HIGHEST)
    if bias is not None:
      y = y + bias
    return self._finish(name, f64(x) if self.record else None, y, bias is not None)

  def conv2d(self, x, kernel, bias=None, *, name, strides=(1, 1), padding="SAME",
             dilation=(1, 1)):
    y = lax.conv_general_dilated(x, kernel, strides, padding, rhs_dilation=dilation,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                 precision=HIGHEST)
    if bias is not None:
      y = y + bias
    rows = (brute_patches(x, kernel.shape[:2], strides, padding, dilation)
            if self.record else None)
    return self._finish(name, rows, y, bias is not None)

  def conv1d(self, x, kernel, bias=None, *, name, strides=(1,), padding="SAME",
             dilation=(1,)):
    y = lax.conv_general_dilated(x, kernel, strides, padding, rhs_dilation=dilation,
                                 dimension_numbers=("NWC", "WIO", "NWC"),
                                 precision=HIGHEST)
    if bias is not None:
      y = y + bias
    rows = (brute_patches_1d(x, kernel.shape[0], strides[0], padding, dilation[0])
            if self.record else None)
    return self._finish(name, rows, y, bias is not None)


class Tagged:
  """The same layers through `kd.tags` (names left to the default: the path);
  `example_dims={name: k}` reduces that layer's positions per example."""

  def __init__(self, example_dims=None):
    self.example_dims = example_dims or {}

  def dense(self, x, kernel, bias=None, *, name):
    return kd.tags.dense(x, kernel, bias, example_dims=self.example_dims.get(name))

  def conv2d(self, x, kernel, bias=None, *, name, strides=(1, 1), padding="SAME",
             dilation=(1, 1)):
    return kd.tags.conv2d(x, kernel, bias, strides=strides, padding=padding,
                          dilation=dilation, example_dims=self.example_dims.get(name))

  def conv1d(self, x, kernel, bias=None, *, name, strides=(1,), padding="SAME",
             dilation=(1,)):
    return kd.tags.conv1d(x, kernel, bias, strides=strides, padding=padding,
                          dilation=dilation, example_dims=self.example_dims.get(name))


def brute_force(model, params, x, per_example_loss, weights=None, reduce_to=None):
  """Per-layer `(A, G)` and the mean loss, from per-example gradients.

  `model(layers, params, x)` is the network; `per_example_loss(output)` the
  vector of per-example losses; `weights` the 0/1 mask over those examples.
  `reduce_to={name: U}`: that layer's positions are U consecutive groups (the
  examples of K-FAC-reduce), whose rows are averaged and gradients summed.
  """
  ref = Ref(record=True)
  out = model(ref, params, x)
  losses = f64(per_example_loss(out))
  weights = np.ones_like(losses) if weights is None else f64(weights).reshape(-1)
  n = weights.sum()
  eps0 = {name: jnp.zeros(y.shape, jnp.float64) for name, y in ref.outputs.items()}
  jac = jax.jit(jax.jacrev(
      lambda eps: per_example_loss(model(Ref(eps), params, x))))(eps0)
  stats = {}
  for name, rows in ref.rows.items():
    j = f64(jac[name]).reshape(losses.shape[0], -1, eps0[name].shape[-1])
    g = np.einsum("e,epo->po", weights, j)          # g_p = Σ_e w_e ∂ℓ_e/∂s_p
    if reduce_to and name in reduce_to:
      units = reduce_to[name]
      rows = rows.reshape(units, -1, rows.shape[-1]).mean(1)
      g = g.reshape(units, -1, g.shape[-1]).sum(1)
    stats[name] = {"A": rows.T @ rows / rows.shape[0], "G": g.T @ g / n}
  return float((weights * losses).sum() / n), stats


def check_against_brute_force(stats, bf_stats, names=None):
  names = names or {k: k for k in bf_stats}
  assert set(stats) == set(names.values())
  for bf_name, name in names.items():
    for factor in ("A", "G"):
      assert_factor_close(stats[name][factor], bf_stats[bf_name][factor],
                          f"{factor} of {name}")


# ---------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------

def mlp_params(key, dims, biases):
  keys = jax.random.split(key, 2 * len(biases))
  params = {}
  for i, use_bias in enumerate(biases):
    layer = {"kernel": randn(keys[2 * i], (dims[i], dims[i + 1]), 1 / math.sqrt(dims[i]))}
    if use_bias:
      layer["bias"] = randn(keys[2 * i + 1], (dims[i + 1],), 0.5)
    params[f"l{i + 1}"] = layer
  return params


def mlp(layers, p, x, pool=False):
  """dense → tanh → [mean over tokens] → dense: l1's g depends on l2."""
  h = jnp.tanh(layers.dense(x, p["l1"]["kernel"], p["l1"].get("bias"), name="l1"))
  if pool:
    h = h.mean(axis=1)
  return layers.dense(h, p["l2"]["kernel"], p["l2"].get("bias"), name="l2")


def conv_net(layers, p, x, conv_kwargs):
  """conv → tanh → mean over pixels → dense."""
  h = jnp.tanh(layers.conv2d(x, p["conv"]["kernel"], p["conv"].get("bias"),
                             name="conv", **conv_kwargs))
  return layers.dense(h.mean(axis=(1, 2)), p["dense"]["kernel"], None, name="dense")


def conv_params(key, kernel_shape, use_bias, classes):
  k1, k2, k3 = jax.random.split(key, 3)
  p = {"conv": {"kernel": randn(k1, kernel_shape, 0.5)},
       "dense": {"kernel": randn(k3, (kernel_shape[-1], classes))}}
  if use_bias:
    p["conv"]["bias"] = randn(k2, (kernel_shape[-1],), 0.5)
  return p


# ---------------------------------------------------------------------------
# 1. Dense.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("biases", [(True, True), (False, False), (True, False)])
def test_dense_2d(biases):
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(0), 3)
  params = mlp_params(kp, (3, 4, 5), biases)
  x = randn(kx, (6, 3))
  y = jax.random.randint(ky, (6,), 0, 5)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y)

  loss, _, stats = capture(loss_fn)(params, x, y)
  bf_loss, bf = brute_force(lambda l, p, x: mlp(l, p, x), params, x,
                            lambda out: ce_per_example(out, y))
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  check_against_brute_force(stats, bf)
  # Bias folded in as the *last* coordinate: its A row is the mean input.
  if biases[0]:
    a = f64(stats["l1"]["A"])
    np.testing.assert_allclose(a[-1, -1], 1.0, rtol=1e-6)
    np.testing.assert_allclose(a[-1, :-1], f64(x).mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_3d_per_token_loss(use_bias):
  """Tokens are positions and examples: N = n = B·T."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(1), 3)
  params = mlp_params(kp, (3, 4, 5), (use_bias, use_bias))
  x = randn(kx, (2, 4, 3))
  y = jax.random.randint(ky, (2, 4), 0, 5)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y)

  loss, _, stats = capture(loss_fn)(params, x, y)
  bf_loss, bf = brute_force(lambda l, p, x: mlp(l, p, x), params, x,
                            lambda out: ce_per_example(out, y))
  assert bf["l1"]["A"].shape == (3 + use_bias,) * 2
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  check_against_brute_force(stats, bf)


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_3d_per_sequence_loss(use_bias):
  """Mean-pool after l1: l1 has N = B·T positions but n = B examples."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(2), 3)
  params = mlp_params(kp, (3, 4, 5), (use_bias, use_bias))
  x = randn(kx, (3, 4, 3))
  y = jax.random.randint(ky, (3,), 0, 5)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x, pool=True), y)

  loss, _, stats = capture(loss_fn)(params, x, y)
  bf_loss, bf = brute_force(lambda l, p, x: mlp(l, p, x, pool=True), params, x,
                            lambda out: ce_per_example(out, y))
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  check_against_brute_force(stats, bf)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("per_sequence", [True, False])
def test_dense_reduce_over_sequence(per_sequence, use_bias):
  """`example_dims=1` on l1's `[B, T, d]` input (K-FAC-reduce, Eschenhagen et al.
  2023): A of the per-sequence mean inputs, G of the per-sequence summed output
  gradients; l2 (no example_dims) keeps tokens as examples."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(4), 3)
  params = mlp_params(kp, (3, 4, 5), (use_bias, use_bias))
  x = randn(kx, (3, 4, 3))
  y = jax.random.randint(ky, (3,) if per_sequence else (3, 4), 0, 5)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(
        mlp(Tagged({"l1": 1}), p, x, pool=per_sequence), y)

  _, _, stats = capture(loss_fn)(params, x, y)
  _, bf = brute_force(lambda l, p, x: mlp(l, p, x, pool=per_sequence), params, x,
                      lambda out: ce_per_example(out, y), reduce_to={"l1": 3})
  check_against_brute_force(stats, bf)
  _, _, expand = capture(lambda p, x, y: kd.losses.softmax_cross_entropy(
      mlp(Tagged(), p, x, pool=per_sequence), y))(params, x, y)
  assert not np.allclose(f64(expand["l1"]["A"]), bf["l1"]["A"])   # a real difference
  with pytest.raises(ValueError, match="example_dims"):
    kd.tags.dense(x, params["l1"]["kernel"], example_dims=3)
  for bad in (1.5, "1", True):        # named, where slicing or `<=` failed
    with pytest.raises(TypeError, match="kd.tags.dense: example_dims must be None or an int"):
      kd.tags.dense(x, params["l1"]["kernel"], example_dims=bad)
  with pytest.raises(TypeError, match="kd.tags.scale_and_shift: example_dims must be"):
    kd.tags.scale_and_shift(x, jnp.ones(x.shape[-1]), example_dims=1.0)


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_reduce_is_exact_for_one_sequence(use_bias):
  """One sequence, dense → mean over tokens → loss: the gradient is `ā ⊗ e`, so
  K-FAC-reduce's `A ⊗ G` is its outer product exactly (the empirical Fisher of
  one example); K-FAC-expand's is not."""
  kp, kx = jax.random.split(jax.random.PRNGKey(5))
  p = mlp_params(kp, (3, 4), (use_bias,))
  x = randn(kx, (1, 5, 3))
  y = jnp.array([2])

  def loss_fn(example_dims):
    def fn(p, x, y):
      h = kd.tags.dense(x, p["l1"]["kernel"], p["l1"].get("bias"),
                        example_dims=example_dims)
      return kd.losses.softmax_cross_entropy(h.mean(1), y)
    return fn

  _, grads, stats = capture(loss_fn(1))(p, x, y)
  g = f64(grads["l1"]["kernel"])
  if use_bias:
    g = np.concatenate([g, f64(grads["l1"]["bias"])[None]])
  exact = np.outer(g.reshape(-1), g.reshape(-1))
  assert_factor_close(np.kron(f64(stats["l1"]["A"]), f64(stats["l1"]["G"])), exact,
                      "A ⊗ G (reduce)")
  _, _, expand = capture(loss_fn(None))(p, x, y)
  assert not np.allclose(np.kron(f64(expand["l1"]["A"]), f64(expand["l1"]["G"])), exact)


# ---------------------------------------------------------------------------
# 2. Conv2d.
# ---------------------------------------------------------------------------

CONV_CASES = {
    "s1_same_bias": dict(strides=(1, 1), padding="SAME", dilation=(1, 1), bias=True),
    "s2_same": dict(strides=(2, 2), padding="SAME", dilation=(1, 1), bias=False),
    "s1_valid": dict(strides=(1, 1), padding="VALID", dilation=(1, 1), bias=False),
    "s2_valid_bias": dict(strides=(2, 1), padding="VALID", dilation=(1, 1), bias=True),
    "explicit_bias": dict(strides=(1, 1), padding=((1, 2), (0, 1)), dilation=(1, 1),
                          bias=True),
    "s2_explicit": dict(strides=(2, 2), padding=((2, 0), (1, 1)), dilation=(1, 1),
                        bias=False),
    "dilated_same_bias": dict(strides=(1, 1), padding="SAME", dilation=(2, 2),
                              bias=True),
    "dilated_s2_explicit": dict(strides=(2, 1), padding=((1, 1), (2, 1)),
                                dilation=(2, 2), bias=False),
}


@pytest.mark.parametrize("kernel_hw,strides,padding,dilation", [
    ((1, 1), (1, 1), "SAME", (1, 1)),            # the input itself
    ((1, 1), (2, 3), "VALID", (1, 1)),           # a strided 1x1 (ResNet's shortcut)
    ((1, 1), (2, 2), ((1, 0), (0, 2)), (1, 1)),  # padded 1x1
    ((3, 3), (2, 2), "SAME", (1, 1)),            # one gather of 3x3 windows
    ((2, 3), (1, 2), ((2, 1), (0, 1)), (2, 3)),  # dilated: every d-th window pixel
])
def test_conv_patches_equal_loops(kernel_hw, strides, padding, dilation):
  """`statistics.conv_patches` (one gather, or the strided input for 1x1)
  equals im2col built with explicit loops."""
  from kfac_jax_dist.capture import statistics
  x = randn(jax.random.PRNGKey(4), (2, 9, 8, 3))
  got = statistics.conv_patches(x, (*kernel_hw, 3, 5), strides, padding, dilation)
  np.testing.assert_array_equal(f64(got), brute_patches(x, kernel_hw, strides, padding,
                                                        dilation))


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d(case):
  cfg = dict(CONV_CASES[case])
  use_bias = cfg.pop("bias")
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(3), 3)
  kernel_shape = (3, 2, 2, 3)          # kh != kw and cin > 1: order matters
  params = conv_params(kp, kernel_shape, use_bias, classes=4)
  x = randn(kx, (2, 7, 6, 2))          # odd/even sizes: asymmetric SAME padding
  y = jax.random.randint(ky, (2,), 0, 4)
  kernel, bias = params["conv"]["kernel"], params["conv"].get("bias")

  # Forward: the tag equals lax, flax.linen.Conv and the brute-force patches.
  out = kd.tags.conv2d(x, kernel, bias, **cfg)
  ref = lax.conv_general_dilated(x, kernel, cfg["strides"], cfg["padding"],
                                 rhs_dilation=cfg["dilation"],
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                 precision=HIGHEST)
  if use_bias:
    ref = ref + bias
  np.testing.assert_allclose(f64(out), f64(ref), rtol=1e-10, atol=1e-10)
  flax_conv = nn.Conv(3, kernel_size=(3, 2), strides=cfg["strides"],
                      padding=cfg["padding"], kernel_dilation=cfg["dilation"],
                      use_bias=use_bias, param_dtype=jnp.float64,
                      precision=HIGHEST)
  flax_vars = {"params": {"kernel": kernel, **({"bias": bias} if use_bias else {})}}
  np.testing.assert_allclose(f64(flax_conv.apply(flax_vars, x)), f64(out),
                             rtol=1e-10, atol=1e-10)
  patches = brute_patches(x, (3, 2), cfg["strides"], cfg["padding"], cfg["dilation"])
  by_patches = patches @ f64(kernel).reshape(-1, 3) + (f64(bias) if use_bias else 0)
  np.testing.assert_allclose(by_patches, f64(out), rtol=1e-10, atol=1e-10)

  # Statistics: N = B·Ho·Wo positions for A, n = B examples for G.
  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(conv_net(Tagged(), p, x, cfg), y)

  loss, _, stats = capture(loss_fn)(params, x, y)
  bf_loss, bf = brute_force(lambda l, p, x: conv_net(l, p, x, cfg), params, x,
                            lambda o: ce_per_example(o, y))
  assert bf["conv"]["A"].shape == (3 * 2 * 2 + use_bias,) * 2
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  check_against_brute_force(stats, bf)


def test_conv2d_reduce_over_pixels():
  """`example_dims=1`: each image's patches averaged, its gradients summed."""
  cfg = dict(strides=(2, 1), padding="SAME", dilation=(1, 1))
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(6), 3)
  params = conv_params(kp, (3, 2, 2, 3), True, classes=4)
  x = randn(kx, (3, 5, 4, 2))
  y = jax.random.randint(ky, (3,), 0, 4)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(conv_net(Tagged({"conv": 1}), p, x, cfg), y)

  _, _, stats = capture(loss_fn)(params, x, y)
  _, bf = brute_force(lambda l, p, x: conv_net(l, p, x, cfg), params, x,
                      lambda o: ce_per_example(o, y), reduce_to={"conv": 3})
  check_against_brute_force(stats, bf)


CONV1D_CASES = {
    "s1_same_bias": dict(strides=(1,), padding="SAME", dilation=(1,), bias=True),
    "s2_same": dict(strides=(2,), padding="SAME", dilation=(1,), bias=False),
    "s1_valid_bias": dict(strides=(1,), padding="VALID", dilation=(1,), bias=True),
    "causal_dilated_bias": dict(strides=(1,), padding=((4, 0),), dilation=(2,), bias=True),
    "s3_explicit": dict(strides=(3,), padding=((1, 2),), dilation=(1,), bias=False),
}


def conv1d_net(layers, p, x, cfg):
  """conv1d → tanh → mean over positions → dense."""
  h = jnp.tanh(layers.conv1d(x, p["conv"]["kernel"], p["conv"].get("bias"),
                             name="conv", **cfg))
  return layers.dense(h.mean(axis=1), p["dense"]["kernel"], None, name="dense")


@pytest.mark.parametrize("example_dims", [None, 1])
@pytest.mark.parametrize("case", list(CONV1D_CASES))
def test_conv1d(case, example_dims):
  """A 1-D convolution (`[N, L, C]`, kernel `(k, in, out)`): the forward pass
  equals lax's and Flax's, the statistics brute-force 1-D im2col (every
  position an example, or with `example_dims=1` each sequence)."""
  cfg = dict(CONV1D_CASES[case])
  use_bias = cfg.pop("bias")
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(8), 3)
  params = conv_params(kp, (3, 2, 3), use_bias, classes=4)
  x = randn(kx, (3, 10, 2))
  y = jax.random.randint(ky, (3,), 0, 4)
  kernel, bias = params["conv"]["kernel"], params["conv"].get("bias")
  out = kd.tags.conv1d(x, kernel, bias, **cfg)
  flax_conv = nn.Conv(3, kernel_size=(3,), strides=cfg["strides"], padding=cfg["padding"],
                      kernel_dilation=cfg["dilation"], use_bias=use_bias,
                      param_dtype=jnp.float64, precision=HIGHEST)
  flax_vars = {"params": {"kernel": kernel, **({"bias": bias} if use_bias else {})}}
  np.testing.assert_allclose(f64(flax_conv.apply(flax_vars, x)), f64(out),
                             rtol=1e-10, atol=1e-10)

  def loss_fn(p, x, y):
    layers = Tagged({"conv": example_dims} if example_dims else None)
    return kd.losses.softmax_cross_entropy(conv1d_net(layers, p, x, cfg), y)

  loss, _, stats = capture(loss_fn)(params, x, y)
  bf_loss, bf = brute_force(lambda l, p, x: conv1d_net(l, p, x, cfg), params, x,
                            lambda o: ce_per_example(o, y),
                            reduce_to={"conv": 3} if example_dims else None)
  assert bf["conv"]["A"].shape == (3 * 2 + use_bias,) * 2
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  check_against_brute_force(stats, bf)


@pytest.mark.parametrize("strides,padding,dilation,use_bias", [
    ((1, 1, 1), "SAME", (1, 1, 1), True),
    ((2, 1, 2), "VALID", (1, 1, 1), False),
    ((1, 2, 1), ((1, 0), (0, 1), (2, 1)), (2, 1, 1), True),
])
def test_conv3d(strides, padding, dilation, use_bias):
  """A 3-D convolution (NDHWC, kernel `(kd, kh, kw, in, out)`): forward as
  Flax's, `A` the brute-force 3-D im2col patches' second moment, `G` the
  output cotangents' (every output voxel a position)."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(9), 3)
  params = conv_params(kp, (2, 3, 2, 2, 3), use_bias, classes=4)
  x = randn(kx, (2, 4, 5, 4, 2))
  y = jax.random.randint(ky, (2,), 0, 4)
  cfg = dict(strides=strides, padding=padding, dilation=dilation)
  kernel, bias = params["conv"]["kernel"], params["conv"].get("bias")
  flax_conv = nn.Conv(3, kernel_size=(2, 3, 2), strides=strides, padding=padding,
                      kernel_dilation=dilation, use_bias=use_bias,
                      param_dtype=jnp.float64, precision=HIGHEST)
  flax_vars = {"params": {"kernel": kernel, **({"bias": bias} if use_bias else {})}}
  out = kd.tags.conv3d(x, kernel, bias, **cfg)
  np.testing.assert_allclose(f64(flax_conv.apply(flax_vars, x)), f64(out),
                             rtol=1e-10, atol=1e-10)

  def net(p, x):
    h = jnp.tanh(kd.tags.conv3d(x, p["conv"]["kernel"], p["conv"].get("bias"), **cfg))
    return kd.tags.dense(h.mean(axis=(1, 2, 3)), p["dense"]["kernel"])

  _, grads, stats = capture(lambda p, x, y: kd.losses.softmax_cross_entropy(net(p, x), y))(
      params, x, y)
  rows = brute_patches_3d(x, (2, 3, 2), strides, padding, dilation)
  rows = rows.reshape(-1, rows.shape[-1])
  if use_bias:
    rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)

  conv_out = lax.conv_general_dilated(x, kernel, strides, padding, rhs_dilation=dilation,
                                      precision=HIGHEST,
                                      dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
  conv_out = conv_out + (bias if use_bias else 0)

  def with_eps(eps):                  # the output perturbed: ∂ℓ_e/∂s_p by jacrev
    h = jnp.tanh(conv_out + eps)
    return h.mean(axis=(1, 2, 3)) @ params["dense"]["kernel"]

  jac = f64(jax.jacrev(lambda e: ce_per_example(with_eps(e), y))(jnp.zeros_like(conv_out)))
  g = jac.sum(0).reshape(-1, 3)
  assert_factor_close(stats["conv"]["A"], rows.T @ rows / rows.shape[0], "A of conv3d")
  assert_factor_close(stats["conv"]["G"], g.T @ g / x.shape[0], "G of conv3d")
  assert set(grads["conv"]) == set(params["conv"])


@pytest.mark.parametrize("cls,kwargs", [
    (nn.ConvTranspose, dict(kernel_size=(3, 3), strides=(2, 2))),
    (nn.ConvTranspose, dict(kernel_size=(3, 2), strides=(2, 1), padding="VALID",
                            use_bias=False)),
    (nn.ConvTranspose, dict(kernel_size=(4, 3), strides=(3, 2), kernel_dilation=(2, 1))),
    (nn.ConvTranspose, dict(kernel_size=(3, 3), strides=(2, 2), padding=((1, 3), (0, 2)))),
    (nn.ConvTranspose, dict(kernel_size=(3, 2), strides=(2, 2), transpose_kernel=True)),
    (nn.ConvTranspose, dict(kernel_size=(4, 3), strides=(2, 3), padding="CIRCULAR",
                            kernel_dilation=(1, 2))),
    (nn.ConvTranspose, dict(kernel_size=(6, 2), strides=(3, 1), padding="CIRCULAR",
                            transpose_kernel=True)),
    (nn.Conv, dict(kernel_size=(3, 2), strides=(2, 1), padding="CIRCULAR")),
    (nn.Conv, dict(kernel_size=(3, 3), padding="REFLECT", kernel_dilation=(1, 2))),
], ids=["transpose-same", "transpose-valid", "transpose-dilated", "transpose-explicit",
        "transpose-kernel", "transpose-circular", "transpose-circular-kernel", "circular",
        "reflect"])
def test_flax_conv_geometries_statistics(cls, kwargs):
  """A transposed convolution is the convolution of the input dilated by the
  strides; CIRCULAR / REFLECT padding pads the input with its own entries
  first (a transposed one before dilating it: the wrap that Flax's periodic
  sum of the output amounts to). Brute-force patches of the input so
  prepared in numpy reproduce Flax's output (`patches @ kernel`), and the
  captured `A`, `G` are theirs and the output cotangents' second moments. A transposed kernel (`(*window,
  out, in)`) applies its window flipped, channel axes swapped."""
  from kfac_jax_dist.flax import common  # pylint: disable=import-outside-toplevel
  if kwargs.get("padding") == "REFLECT" and "'REFLECT'" not in inspect.getsource(
      inspect.getmodule(nn.Conv)):
    pytest.skip("this Flax has no REFLECT padding")
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(10), 3)
  x = randn(kx, (2, 4, 5, 2))
  module = cls(3, **kwargs, param_dtype=jnp.float64, precision=HIGHEST)
  params = _randomized(module.init(kp, x))
  y_out = module.apply(params, x)
  targets = randn(ky, y_out.shape)

  def loss_fn(p, x):
    return kd.losses.squared_error(jnp.tanh(module.apply(p, x)), targets)

  grad_fn = kd.value_and_grad(loss_fn, capture="flax")
  layer, = grad_fn.discover(params, x)
  _, _, stats = grad_fn(params, x)
  if cls is nn.ConvTranspose:
    config = common.conv_transpose_config(module, nn.dtypes.promote_dtype, x.shape)
    s, wrapped = config.input_dilation, f64(x)
    if config.edge is not None:
      wrapped = np.pad(wrapped, ((0, 0),) + config.edge[1] + ((0, 0),), mode="wrap")
    prepared = np.zeros((2, (wrapped.shape[1] - 1) * s[0] + 1,
                         (wrapped.shape[2] - 1) * s[1] + 1, 2))
    prepared[:, ::s[0], ::s[1]] = wrapped
  else:
    config = common.conv_config(kwargs["kernel_size"], kwargs.get("strides", 1),
                                kwargs["padding"], 1, kwargs.get("kernel_dilation", 1),
                                1, None)
    mode, pads = config.edge
    prepared = np.pad(f64(x), ((0, 0),) + pads + ((0, 0),), mode=mode)
  rows = brute_patches(prepared, kwargs["kernel_size"], config.strides, config.padding,
                       config.dilation)
  kernel = f64(params["params"]["kernel"])
  if kwargs.get("transpose_kernel"):
    kernel = np.flip(kernel, (0, 1)).swapaxes(-1, -2)
    assert layer.transposed_kernel and layer.kernel_shape == kernel.shape
  bias = f64(params["params"]["bias"]) if "bias" in params["params"] else 0
  np.testing.assert_allclose(rows @ kernel.reshape(-1, 3) + bias, f64(y_out), rtol=1e-10,
                             atol=1e-10)
  rows = rows.reshape(-1, rows.shape[-1])
  if layer.has_bias:
    rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
  jac = f64(jax.jacrev(lambda e: jnp.sum(
      0.5 * (jnp.tanh(y_out + e) - targets) ** 2, axis=-1).reshape(2, -1).sum(1))(
          jnp.zeros_like(y_out)))
  g = jac.sum(0).reshape(-1, 3)
  n = int(np.prod(y_out.shape[:-1]))          # squared error: every position an example
  assert_factor_close(stats[layer.name]["A"], rows.T @ rows / rows.shape[0], "A")
  assert_factor_close(stats[layer.name]["G"], g.T @ g / n, "G")


# ---------------------------------------------------------------------------
# 3. Gradients equal jax.value_and_grad's.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("has_aux,jit", [(False, True), (True, True), (True, False)])
def test_gradients_match_jax(has_aux, jit):
  kp, kc, kx, ky, kz = jax.random.split(jax.random.PRNGKey(4), 5)
  params = {"mlp": mlp_params(kp, (3, 4, 5), (True, False)),
            "cnn": conv_params(kc, (2, 2, 2, 3), True, classes=5)}
  x = randn(kx, (3, 2, 3))
  img = randn(kz, (3, 5, 5, 2))
  y = jax.random.randint(ky, (3,), 0, 5)
  cfg = dict(strides=(2, 2), padding="SAME")

  def loss_fn(p, x, img, y):
    logits = (mlp(Tagged(), p["mlp"], x, pool=True)
              + conv_net(Tagged(), p["cnn"], img, cfg))
    loss = kd.losses.softmax_cross_entropy(logits, y)
    return (loss, {"logits": logits}) if has_aux else loss

  grad_fn = kd.value_and_grad(loss_fn, has_aux=has_aux)
  call = (lambda p, *a: grad_fn(p, *a))
  ref_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
  if jit:
    call, ref_fn = jax.jit(call), jax.jit(ref_fn)
  value, grads, stats = call(params, x, img, y)
  ref_value, ref_grads = ref_fn(params, x, img, y)
  assert_trees_equal(value, ref_value)
  assert_trees_equal(grads, ref_grads)
  if has_aux:
    assert isinstance(value, tuple) and set(value[1]) == {"logits"}
  assert set(stats) == {"mlp/l1", "mlp/l2", "cnn/conv", "cnn/dense"}


# ---------------------------------------------------------------------------
# 4. Monte Carlo Fisher.
# ---------------------------------------------------------------------------

def enumerated_fisher(model, params, x, per_example_loss, targets, probs):
  """`(1/n) Σ_i Σ_t p(t|x_i) g_i(t) g_i(t)ᵀ` for every layer (2-D inputs: n = B)."""
  ref = Ref(record=True)
  model(ref, params, x)
  eps0 = {k: jnp.zeros(v.shape, jnp.float64) for k, v in ref.outputs.items()}
  jac_fn = jax.jit(jax.jacrev(
      lambda e, t: per_example_loss(model(Ref(e), params, x), t)))
  exact = {}
  for t, p_t in zip(targets, probs):       # p_t: [B] probability of target t
    for name, j in jac_fn(eps0, t).items():
      g = np.einsum("ii...->i...", f64(j))   # example i's loss w.r.t. its own output
      term = np.einsum("i,io,ip->op", f64(p_t), g, g) / g.shape[0]
      exact[name] = exact.get(name, 0.0) + term
  return exact


def test_mc_fisher_softmax():
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(5), 3)
  params = mlp_params(kp, (3, 4, 3), (True, True))
  x = randn(kx, (5, 3))
  y = jax.random.randint(ky, (5,), 0, 3)
  model = lambda l, p, x: mlp(l, p, x)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model(Tagged(), p, x), y)

  loss, grads, stats = mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x, y)
  emp_loss, emp_grads, emp_stats = capture(loss_fn)(params, x, y)
  # The loss, gradients and A do not depend on the draw.
  # (jit vs eager: float32 rounding of the loss.)
  np.testing.assert_allclose(f64(loss), float(emp_loss), rtol=1e-6)
  assert_trees_equal(jax.tree.map(lambda g: g[0], grads), emp_grads, rtol=1e-6)
  for name in stats:
    np.testing.assert_allclose(f64(stats[name]["A"]),
                               np.broadcast_to(f64(emp_stats[name]["A"]),
                                               stats[name]["A"].shape), rtol=1e-6)

  probs = jax.nn.softmax(model(Ref(), params, x))
  classes = [jnp.full((5,), c) for c in range(3)]
  exact = enumerated_fisher(model, params, x, ce_per_example, classes,
                            [probs[:, c] for c in range(3)])
  # Closed form on the logits side: (1/n) Σ_i diag(p_i) − p_i p_iᵀ.
  p = f64(probs)
  np.testing.assert_allclose(
      exact["l2"], (np.einsum("io,op->op", p, np.eye(3)) - p.T @ p) / 5, atol=1e-12)
  for name in ("l1", "l2"):
    check_mc_estimate(stats[name]["G"], exact[name], f"G of {name}")


@pytest.mark.parametrize("returned, coefficient", [
    (lambda l: 3.0 * l, lambda l: 3.0),             # kfac-jax's loss weight 3
    (lambda l: l / 4.0 + 0.5, lambda l: 0.25),      # a micro-batch's share plus a constant
    (jnp.log, lambda l: 1.0 / l)],                  # the log of the loss
    ids=["weight", "share", "log"])
def test_mc_fisher_is_the_returned_losss(returned, coefficient):
  """The loss function returns `f(L)` of its registered loss `L`: the
  Gauss-Newton matrix of what the optimiser minimises is `f'(L)` times L's,
  and so is what the Monte Carlo `G` estimates (enumerated over the classes),
  as kfac-jax's sampled estimators take its loss weight. The samples'
  cotangents do not carry `f'(L)` (G was L's whatever the coefficient: a
  fixed step scaled with it, against 1/f'(L) under the empirical Fisher).
  The empirical `G`, from the true targets' cotangents, is `f'(L)²` times L's
  (kfac-jax's `fisher_empirical` too)."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(5), 3)
  params = mlp_params(kp, (3, 4, 3), (True, True))
  x, y = randn(kx, (5, 3)), jax.random.randint(ky, (5,), 0, 3)
  model = lambda l, p, x: mlp(l, p, x)
  loss_fn = lambda p, x, y: returned(kd.losses.softmax_cross_entropy(model(Tagged(), p, x), y))
  plain = lambda p, x, y: kd.losses.softmax_cross_entropy(model(Tagged(), p, x), y)

  loss_value, _, stats = mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x, y)
  c = coefficient(float(f64(kd.value_and_grad(plain)(params, x, y)[0])))
  probs = jax.nn.softmax(model(Ref(), params, x))
  exact = enumerated_fisher(model, params, x, ce_per_example,
                            [jnp.full((5,), k) for k in range(3)],
                            [probs[:, k] for k in range(3)])
  for name in ("l1", "l2"):
    check_mc_estimate(stats[name]["G"], c * exact[name], f"G of {name}")
  # The same draws with a loss scale (the seed of the backward pass).
  key = jax.random.PRNGKey(7)
  _, _, one = kd.value_and_grad(plain, fisher="mc")(params, x, y, rng=key)
  _, _, scaled = kd.value_and_grad(loss_fn, fisher="mc")(params, x, y, rng=key,
                                                         loss_scale=128.0)
  _, _, emp_one = capture(plain)(params, x, y)
  _, _, emp = capture(loss_fn)(params, x, y)
  for name in ("l1", "l2"):      # (float64 throughout: the coefficient too)
    np.testing.assert_allclose(f64(scaled[name]["G"]), c * f64(one[name]["G"]), rtol=1e-12)
    np.testing.assert_allclose(f64(emp[name]["G"]), c * c * f64(emp_one[name]["G"]),
                               rtol=1e-12)


def test_mc_fisher_soft_targets_weigh_by_their_sums():
  """Softmax targets summing to `s_i` (0 for a padding row, 1.2, 0.5, ...):
  the loss's Hessian is `s_i (diag(p_i) − p_i p_iᵀ)`, so the Monte Carlo `G`
  estimates the Fisher with example `i` weighted by `s_i` (enumerated over the
  classes), and the loss is the plain mean of `−Σ t log p`."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(8), 3)
  params = mlp_params(kp, (3, 4, 3), (True, True))
  x = randn(kx, (5, 3))
  sums = jnp.array([1.0, 0.0, 1.2, 0.5, 2.0])
  y = jax.random.dirichlet(ky, jnp.ones(3), (5,)) * sums[:, None]
  model = lambda l, p, x: mlp(l, p, x)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model(Tagged(), p, x), y)

  loss, _, stats = mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x, y)
  logits = model(Ref(), params, x)
  np.testing.assert_allclose(
      f64(loss)[0], -np.mean(np.sum(f64(y) * f64(jax.nn.log_softmax(logits)), -1)),
      rtol=1e-6)
  probs = jax.nn.softmax(logits)
  classes = [jnp.full((5,), c) for c in range(3)]
  exact = enumerated_fisher(model, params, x, ce_per_example, classes,
                            [probs[:, c] * sums for c in range(3)])
  p = f64(probs)
  np.testing.assert_allclose(
      exact["l2"], sum(float(s) * (np.diag(q) - np.outer(q, q)) for s, q in zip(sums, p)) / 5,
      atol=1e-12)
  for name in ("l1", "l2"):
    check_mc_estimate(stats[name]["G"], exact[name], f"G of {name}")


def test_mc_fisher_sigmoid():
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(6), 3)
  params = mlp_params(kp, (3, 4, 3), (True, True))
  x = randn(kx, (5, 3))
  y = jax.random.bernoulli(ky, 0.5, (5, 3)).astype(jnp.float64)
  model = lambda l, p, x: mlp(l, p, x)

  def loss_fn(p, x, y):
    return kd.losses.sigmoid_cross_entropy(model(Tagged(), p, x), y)

  def per_example(logits, t):
    return jnp.sum(jax.nn.softplus(logits) - logits * t, axis=-1)

  _, _, stats = mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x, y)
  probs = jax.nn.sigmoid(model(Ref(), params, x))
  targets, weights = [], []
  for bits in itertools.product((0.0, 1.0), repeat=3):
    t = jnp.broadcast_to(jnp.asarray(bits), (5, 3))
    targets.append(t)
    weights.append(jnp.prod(jnp.where(t == 1.0, probs, 1.0 - probs), axis=-1))
  exact = enumerated_fisher(model, params, x, per_example, targets, weights)
  p = f64(probs)
  np.testing.assert_allclose(exact["l2"], np.diag((p * (1 - p)).mean(0)), atol=1e-12)
  for name in ("l1", "l2"):
    check_mc_estimate(stats[name]["G"], exact[name], f"G of {name}")


def test_mc_fisher_squared_error():
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(7), 3)
  params = mlp_params(kp, (3, 4, 3), (True, True))
  x = randn(kx, (5, 3))
  y = randn(ky, (5, 3))
  model = lambda l, p, x: mlp(l, p, x)

  def loss_fn(p, x, y):
    return kd.losses.squared_error(model(Tagged(), p, x), y)

  _, _, stats = mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x, y)
  # Unit-variance Gaussian: E[(μ − t)(μ − t)ᵀ] = I on the output side, and
  # J_iᵀ J_i for l1 with J_i = ∂μ_i/∂s1_i.
  ref = Ref(record=True)
  model(ref, params, x)
  eps0 = {"l1": jnp.zeros(ref.outputs["l1"].shape, jnp.float64)}
  jac = f64(jax.jacrev(lambda e: model(Ref(e), params, x))(eps0)["l1"])  # [B,3,B,4]
  j = np.einsum("iaib->iab", jac)
  exact = {"l2": np.eye(3), "l1": np.einsum("iab,iac->bc", j, j) / 5}
  for name in ("l1", "l2"):
    check_mc_estimate(stats[name]["G"], exact[name], f"G of {name}")


# ---------------------------------------------------------------------------
# 5. Masked loss.
# ---------------------------------------------------------------------------

def test_masked_loss_2d():
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(8), 3)
  params = mlp_params(kp, (3, 4, 5), (True, True))
  x = randn(kx, (6, 3))
  y = jax.random.randint(ky, (6,), 0, 5)
  mask = jnp.array([1, 0, 1, 1, 0, 1], jnp.float64)

  def loss_fn(p, x, y, mask):
    return kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y, mask=mask)

  loss, _, stats = capture(loss_fn)(params, x, y, mask)
  bf_loss, bf = brute_force(lambda l, p, x: mlp(l, p, x), params, x,
                            lambda out: ce_per_example(out, y), weights=mask)
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  # G averages over the n = 4 unmasked examples. A, which the tag computes
  # without knowing the mask, averages over all N = 6 positions.
  check_against_brute_force(stats, bf)


def test_masked_loss_per_token():
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(9), 3)
  params = mlp_params(kp, (3, 4, 5), (False, True))
  x = randn(kx, (2, 4, 3))
  y = jax.random.randint(ky, (2, 4), 0, 5)
  mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float64)

  def loss_fn(p, x, y, mask):
    return kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y, mask=mask)

  loss, _, stats = capture(loss_fn)(params, x, y, mask)
  bf_loss, bf = brute_force(lambda l, p, x: mlp(l, p, x), params, x,
                            lambda out: ce_per_example(out, y), weights=mask)
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  check_against_brute_force(stats, bf)


# ---------------------------------------------------------------------------
# 6. Errors.
# ---------------------------------------------------------------------------

def _small_problem():
  params = mlp_params(jax.random.PRNGKey(10), (3, 4, 5), (True, True))
  return params, jnp.ones((2, 3)), jnp.array([0, 1])


def test_mc_without_rng_raises():
  params, x, y = _small_problem()
  grad_fn = kd.value_and_grad(
      lambda p, x, y: kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y),
      fisher="mc")
  with pytest.raises(ValueError, match="rng"):
    grad_fn(params, x, y)


def test_no_registered_loss_raises():
  params, x, y = _small_problem()

  def loss_fn(p, x, y):
    logits = mlp(Tagged(), p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  with pytest.raises(ValueError, match="registered no loss"):
    kd.value_and_grad(loss_fn)(params, x, y)


@pytest.mark.parametrize("transform", ["jit", "checkpoint", "scan"])
def test_loss_inside_a_transform_of_the_loss_function_raises(transform):
  """The capture and the curvature products read the registered loss's
  inputs after the pass; registered inside a transform they would be its
  tracers (fisher="mc" and adaptive K-FAC failed with jax's leaked-tracer
  error, a nested jit's cached trace registered nothing)."""
  params, x, y = _small_problem()
  head = lambda logits: kd.losses.softmax_cross_entropy(logits, y)
  wrapped = {"jit": jax.jit(head), "checkpoint": jax.checkpoint(head),
             "scan": lambda logits: jax.lax.scan(
                 lambda c, _: (c, head(logits)), 0.0, None, length=1)[1][0]}[transform]

  def loss_fn(p, x, y):
    return wrapped(mlp(Tagged(), p, x))

  with pytest.raises(ValueError, match="softmax_cross_entropy ran inside a JAX transform "
                                       "within the loss function.*top level"):
    kd.value_and_grad(loss_fn).discover(params, x, y)


def test_unknown_fisher_raises():
  with pytest.raises(ValueError, match="fisher"):
    kd.value_and_grad(lambda p: p, fisher="exact")


# ---------------------------------------------------------------------------
# 7. Skipping the statistics on steps that update no factor.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("jit,skip", [(False, "layer"), (True, "layer"), (False, "pass"),
                                      (True, "pass")])
def test_statistics_skipped_between_factor_updates(jit, skip):
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(11), 3)
  params = mlp_params(kp, (3, 4, 5), (True, False))
  x = randn(kx, (6, 3))
  y = jax.random.randint(ky, (6,), 0, 5)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y)

  grad_fn = kd.value_and_grad(loss_fn, skip_statistics=skip)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y), factor_update_every=2)
  state = tx.init(params)
  call = lambda p, s: grad_fn(p, x, y, opt_state=s)
  if jit:
    call = jax.jit(call)
  update = jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st))
  ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x, y)
  _, bf = brute_force(lambda l, p, x: mlp(l, p, x), params, x,
                      lambda out: ce_per_example(out, y))

  for count in range(4):
    loss, grads, stats = call(params, state)
    assert int(state.count) == count
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-12)
    assert_trees_equal(grads, ref_grads)
    assert set(stats) == {"l1", "l2"}
    if count % 2 == 0:      # factor step: the full statistics
      check_against_brute_force(stats, bf)
    else:                   # skipped: NaN placeholders of the right shapes
      for name in stats:
        for factor in ("A", "G"):
          assert stats[name][factor].shape == upper(bf[name][factor]).shape   # packed
          assert np.all(np.isnan(f64(stats[name][factor]))), (count, name, factor)
    _, state = update(grads, state, stats)


def _entry_conditionals(compiled_text: str) -> int:
  """The conditionals of the ENTRY computation: those every step runs (on a
  GPU, one host round trip each); nested ones run only inside a branch."""
  entry = compiled_text[compiled_text.index("\nENTRY "):]
  return entry[:entry.index("\n}")].count(" conditional(")


@pytest.mark.parametrize("skip", ["layer", "pass"])
def test_plain_step_conditionals_do_not_grow_with_layers(skip):
  """skip_statistics="pass": one conditional around the capture whatever the
  number of layers; "layer": one per tagged layer."""
  def deep_mlp(p, x):
    for name in sorted(p):
      x = jnp.tanh(kd.tags.dense(x, p[name]["kernel"], p[name]["bias"], name=name))
    return x

  counts = []
  for widths in ((3, 4, 5), (3, 4, 4, 4, 4, 5)):
    params = mlp_params(jax.random.PRNGKey(0), widths, (True,) * (len(widths) - 1))
    x, y = jnp.ones((4, 3)), jnp.zeros((4,), jnp.int32)
    loss_fn = lambda p, x, y: kd.losses.softmax_cross_entropy(deep_mlp(p, x), y)
    grad_fn = kd.value_and_grad(loss_fn, skip_statistics=skip)
    tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y), factor_update_every=3)

    def step(p, s):
      _, grads, stats = grad_fn(p, x, y, opt_state=s)
      return tx.update(grads, s, kfac_stats=stats)
    text = jax.jit(step).lower(params, tx.init(params)).compile().as_text()
    counts.append(_entry_conditionals(text))
  if skip == "pass":
    assert counts[0] == counts[1], counts
  else:
    assert counts[1] - counts[0] == 3, counts


@pytest.mark.parametrize("skip", ["layer", "pass"])
def test_statistics_of_every_step_without_conditional(skip):
  """A factor update every step (no stale statistics): the update consumes the
  statistics unconditionally, so the capture computes them with no conditional
  (on CPU, two kernels per layer fewer), and they are those of a factor step
  under the conditional (factor_update_every=2 at count 0), bit for bit."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(12), 3)
  params = mlp_params(kp, (3, 4, 5), (True, False))
  x, y = randn(kx, (6, 3)), jax.random.randint(ky, (6,), 0, 5)
  loss_fn = lambda p, x, y: kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y)
  grad_fn = kd.value_and_grad(loss_fn, skip_statistics=skip)
  layers = grad_fn.discover(params, x, y)
  captured = {}
  for every in (1, 2):
    state = kd.scale_by_kfac(layers=layers, factor_update_every=every).init(params)
    call = jax.jit(lambda p, s: grad_fn(p, x, y, opt_state=s))
    assert (" conditional(" in call.lower(params, state).compile().as_text()) == (every > 1)
    captured[every] = call(params, state)
  assert_trees_equal(captured[1], captured[2])
  _, bf = brute_force(lambda l, p, x: mlp(l, p, x), params, x,
                      lambda out: ce_per_example(out, y))
  check_against_brute_force(captured[1][2], bf)


def test_bordered_input_factor_fuses_into_its_packing():
  """A Dense layer's `A = [[S, m], [mᵀ, 1]]` (its bias folded in) is selected
  number by number, so that on XLA:CPU the `[S, m]` block and its scaling fuse
  into the packing gather: no `[d, d + 1]` array in the compiled capture (at
  128 wide, joined by concatenates, it was a kernel of its own, its scaling two
  more)."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's fusion")
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(13), 3)
  params = mlp_params(kp, (128, 128, 5), (True, True))
  x, y = randn(kx, (16, 128)), jax.random.randint(ky, (16,), 0, 5)
  loss_fn = lambda p, x, y: kd.losses.softmax_cross_entropy(mlp(Tagged(), p, x), y)
  grad_fn = kd.value_and_grad(loss_fn)
  state = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y)).init(params)
  text = jax.jit(lambda p, s: grad_fn(p, x, y, opt_state=s)).lower(
      params, state).compile().as_text()
  assert "[128,129]" not in text[text.index("\nENTRY "):]


def test_unknown_skip_statistics_raises():
  with pytest.raises(ValueError, match="skip_statistics must be one of"):
    kd.value_and_grad(lambda p: p, skip_statistics="never")


# ---------------------------------------------------------------------------
# 8. Drop-in Flax layers.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,shape", [
    (dict(features=4), (2, 3)),
    (dict(features=4, use_bias=False), (2, 5, 3)),
])
def test_linen_dense_drop_in(kwargs, shape):
  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  flax_vars = nn.Dense(**kwargs).init(jax.random.PRNGKey(1), x)
  kd_vars = kd.linen.Dense(**kwargs).init(jax.random.PRNGKey(1), x)
  assert _shapes(kd_vars) == _shapes(flax_vars)
  assert_trees_equal(kd_vars, flax_vars)          # same initialisers too
  flax_vars = _randomized(flax_vars)
  np.testing.assert_allclose(kd.linen.Dense(**kwargs).apply(flax_vars, x),
                             nn.Dense(**kwargs).apply(flax_vars, x), rtol=1e-6, atol=1e-6)


CONV_KWARGS = [
    dict(features=3, kernel_size=(3, 2)),
    dict(features=3, kernel_size=(3, 3), strides=2, padding="VALID", use_bias=False),
    dict(features=2, kernel_size=(2, 3), strides=(2, 1), padding=((1, 2), (0, 1))),
    dict(features=2, kernel_size=(3, 3), kernel_dilation=2, padding=1),
]


@pytest.mark.parametrize("kwargs", CONV_KWARGS)
def test_linen_conv_drop_in(kwargs):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 6, 2))
  flax_vars = nn.Conv(**kwargs).init(jax.random.PRNGKey(1), x)
  kd_vars = kd.linen.Conv(**kwargs).init(jax.random.PRNGKey(1), x)
  assert _shapes(kd_vars) == _shapes(flax_vars)
  assert_trees_equal(kd_vars, flax_vars)
  flax_vars = _randomized(flax_vars)
  np.testing.assert_allclose(kd.linen.Conv(**kwargs).apply(flax_vars, x),
                             nn.Conv(**kwargs).apply(flax_vars, x), rtol=1e-5, atol=1e-5)
  # Extra batch axes are flattened like Flax does.
  x5 = x.reshape((1,) + x.shape)
  np.testing.assert_allclose(kd.linen.Conv(**kwargs).apply(flax_vars, x5),
                             nn.Conv(**kwargs).apply(flax_vars, x5), rtol=1e-5, atol=1e-5)


# Seven of the nine by default (CI time): the first 1-D and the first 3-D case
# only with --slow (the next of each has their geometry and more).
CONV_ND_KWARGS = [
    pytest.param(dict(features=3, kernel_size=(3,)), marks=pytest.mark.slow),
    dict(features=3, kernel_size=3, strides=2, padding="VALID"),       # an int: 1-D
    dict(features=2, kernel_size=(4,), padding="CAUSAL", kernel_dilation=2),
    dict(features=2, kernel_size=(2,), padding=((2, 1),), use_bias=False),
    pytest.param(dict(features=2, kernel_size=(2, 3, 2), strides=(1, 2, 1)),
                 marks=pytest.mark.slow),
    dict(features=3, kernel_size=(3, 1, 2), padding="VALID", kernel_dilation=(1, 1, 2)),
    dict(features=2, kernel_size=(3, 2), input_dilation=(2, 1), strides=(1, 2),
         padding=((1, 1), (0, 1))),
    dict(features=2, kernel_size=(3, 3), strides=2, padding="CIRCULAR"),
    dict(features=2, kernel_size=(4,), padding="REFLECT"),
]


@pytest.mark.parametrize("kwargs", CONV_ND_KWARGS)
def test_conv1d_conv3d_drop_in_and_interception(kwargs):
  """`kd.linen.Conv` / `kd.nnx.Conv` with one or three spatial axes (or an
  input dilation) run Flax's convolution (1-D CAUSAL padding included) and
  tag it `conv1d` / `conv3d` (`conv2d`); an unmodified Flax model under
  capture="flax" gets the same layer and statistics."""
  spatial = 1 if isinstance(kwargs["kernel_size"], int) else len(kwargs["kernel_size"])
  x = jax.random.normal(jax.random.PRNGKey(0), {1: (2, 9, 2), 2: (2, 6, 5, 2),
                                               3: (2, 4, 6, 5, 2)}[spatial], jnp.float64)
  y = jnp.array([0, 1])
  flax_vars = _randomized(nn.Conv(**kwargs, param_dtype=jnp.float64).init(
      jax.random.PRNGKey(1), x))
  np.testing.assert_allclose(
      kd.linen.Conv(**kwargs, param_dtype=jnp.float64).apply(flax_vars, x),
      nn.Conv(**kwargs, param_dtype=jnp.float64).apply(flax_vars, x), rtol=1e-12, atol=1e-12)
  nnx_kwargs = dict(kwargs)
  ours, theirs = _nnx_pair(kd.nnx.Conv, nnx.Conv, 2, nnx_kwargs.pop("features"),
                           param_dtype=jnp.float64, **nnx_kwargs)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-12, atol=1e-12)

  def loss_of(module):
    return lambda p, x, y: kd.losses.softmax_cross_entropy(
        module.apply(p, x).mean(axis=tuple(range(1, 1 + spatial))), y)
  plain = kd.value_and_grad(loss_of(nn.Conv(**kwargs, param_dtype=jnp.float64)),
                            capture="flax")
  tagged = kd.value_and_grad(loss_of(kd.linen.Conv(**kwargs, param_dtype=jnp.float64)))
  layer, = plain.discover(flax_vars, x, y)
  assert layer.kind == f"conv{spatial}d"
  assert layer.kernel_shape == flax_vars["params"]["kernel"].shape
  for got, want in zip(plain(flax_vars, x, y), tagged(flax_vars, x, y)):
    assert_trees_equal(got, want)


@pytest.mark.parametrize("padding", ["same", "valid", "Same"])
def test_conv_lowercase_same_valid_padding_is_captured_as_uppercase(padding):
  """lax reads "same" / "valid" in any case (Flax passes them on), so a Conv
  so padded is captured, with the statistics of "SAME" / "VALID"; Flax's
  own CAUSAL / CIRCULAR / REFLECT are read as written (lax refuses another
  case), and stay Flax's."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 4, 2), jnp.float64)
  y = jnp.array([0, 1])
  flax_vars = _randomized(nn.Conv(3, (3, 2), param_dtype=jnp.float64).init(
      jax.random.PRNGKey(1), x))

  def captured(cls, pad):
    module = cls(3, (3, 2), strides=(2, 1), padding=pad, param_dtype=jnp.float64)
    grad_fn = kd.value_and_grad(lambda p, x, y: kd.losses.softmax_cross_entropy(
        module.apply(p, x).mean(axis=(1, 2)), y),
                                 capture="flax" if cls is nn.Conv else "tags")
    layer, = grad_fn.discover(flax_vars, x, y)
    return layer, grad_fn(flax_vars, x, y)[2][layer.name]
  for cls in (nn.Conv, kd.linen.Conv):
    (layer, stats), (want_layer, want) = captured(cls, padding), captured(
        cls, padding.upper())
    assert layer == want_layer
    assert_trees_equal(stats, want)
  config = flax_common.conv_config((3, 3), 1, padding, 1, 1, 1, None)
  assert config.padding == padding.upper()
  for other in ("causal", "circular", "reflect", "same_lower"):
    assert flax_common.conv_config((3,), 1, other, 1, 1, 1, None) == f"{other} padding"


@pytest.mark.parametrize("kwargs", [   # five of the nine by default (CI time)
    pytest.param(dict(kernel_size=(3, 3), strides=(2, 2)), marks=pytest.mark.slow),
    dict(kernel_size=(2, 3), strides=(1, 3), padding="VALID", kernel_dilation=(2, 1)),
    pytest.param(dict(kernel_size=(3,), strides=(2,)), marks=pytest.mark.slow),
    pytest.param(dict(kernel_size=(2, 2, 3), strides=(2, 1, 2), use_bias=False),
                 marks=pytest.mark.slow),
    dict(kernel_size=(3, 3), strides=(2, 2), padding=((2, 0), (1, 3))),
    dict(kernel_size=(4,), strides=(3,), padding=1),
    dict(kernel_size=(3, 2), strides=(2, 1), transpose_kernel=True),
    pytest.param(dict(kernel_size=(3,), strides=(2,), padding="VALID", transpose_kernel=True),
                 marks=pytest.mark.slow),
    dict(kernel_size=(2, 2, 3), strides=(2, 1, 2), transpose_kernel=True, use_bias=False),
    dict(kernel_size=(5,), strides=(2,), padding="CIRCULAR"),
    dict(kernel_size=(3, 4), strides=(3, 2), padding="CIRCULAR", transpose_kernel=True),
])
def test_conv_transpose_drop_in_and_interception(kwargs):
  """`kd.linen.ConvTranspose` / `kd.nnx.ConvTranspose` equal Flax's; Flax's
  own under capture="flax" gets the same layer (a `conv{n}d` of the input
  dilated by the strides) and statistics as the kd layer."""
  spatial = len(kwargs["kernel_size"])
  x = jax.random.normal(jax.random.PRNGKey(0), (2,) + (5, 4, 3)[:spatial] + (2,),
                        jnp.float64)
  plain = nn.ConvTranspose(3, **kwargs, param_dtype=jnp.float64)
  tagged = kd.linen.ConvTranspose(3, **kwargs, param_dtype=jnp.float64)
  flax_vars = _randomized(plain.init(jax.random.PRNGKey(1), x))
  np.testing.assert_allclose(tagged.apply(flax_vars, x), plain.apply(flax_vars, x),
                             rtol=1e-12, atol=1e-12)
  ours, theirs = _nnx_pair(kd.nnx.ConvTranspose, nnx.ConvTranspose, 2, 3,
                           param_dtype=jnp.float64, **kwargs)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-12, atol=1e-12)

  target = jnp.zeros_like(plain.apply(flax_vars, x))
  loss_of = lambda module: (lambda p, x: kd.losses.squared_error(module.apply(p, x), target))
  intercepted = kd.value_and_grad(loss_of(plain), capture="flax")
  layer, = intercepted.discover(flax_vars, x)
  assert layer.kind == f"conv{spatial}d"
  for got, want in zip(intercepted(flax_vars, x), kd.value_and_grad(loss_of(tagged))(
      flax_vars, x)):
    assert_trees_equal(got, want)


def test_conv_transpose_explicit_padding_of_a_consistent_jax_is_reported(monkeypatch):
  """A jax whose `lax.conv_transpose` reads explicit pads as the forward
  convolution's (`use_consistent_padding` True by default) would compute
  another convolution: the layer is left to Flax, with the reason."""
  real = jax.lax.conv_transpose

  def consistent(*args, use_consistent_padding=True, **kwargs):
    return real(*args, **kwargs)
  monkeypatch.setattr(jax.lax, "conv_transpose", consistent)
  x = jnp.ones((2, 4, 4, 2))
  module = kd.linen.ConvTranspose(3, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
  with pytest.warns(UserWarning, match="explicit padding .this jax's use_consistent"):
    module.init(jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("padding", ["same", "circular"])
def test_conv_transpose_padding_flax_refuses_stays_flax_s(padding):
  """Flax's ConvTranspose reads its padding names as written ("SAME",
  "VALID", "CIRCULAR"; lax refuses another case for a transposed
  convolution): another case is left to Flax's code, which raises."""
  module = kd.linen.ConvTranspose(3, (3, 3), strides=(2, 2), padding=padding)
  with pytest.warns(UserWarning, match=f"ConvTranspose with {padding} padding"):
    with pytest.raises(ValueError, match="String padding is not implemented"):
      module.init(jax.random.PRNGKey(0), jnp.ones((2, 4, 4, 2)))


def _nnx_pair(kd_cls, flax_cls, *args, **kwargs):
  ours = kd_cls(*args, **kwargs, rngs=nnx.Rngs(1))
  theirs = flax_cls(*args, **kwargs, rngs=nnx.Rngs(1))
  ours_state, theirs_state = nnx.state(ours), nnx.state(theirs)
  assert _shapes(ours_state) == _shapes(theirs_state)
  assert_trees_equal(ours_state, theirs_state)
  nnx.update(theirs, _randomized(nnx.state(theirs)))
  nnx.update(ours, nnx.state(theirs))
  return ours, theirs


@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_linear_drop_in(use_bias):
  ours, theirs = _nnx_pair(kd.nnx.Linear, nnx.Linear, 3, 4, use_bias=use_bias)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3))
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", CONV_KWARGS)
def test_nnx_conv_drop_in(kwargs):
  kwargs = dict(kwargs)
  ours, theirs = _nnx_pair(kd.nnx.Conv, nnx.Conv, 2, kwargs.pop("features"), **kwargs)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 6, 2))
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


CNN_CONV = dict(kernel_size=(3, 2), strides=(2, 1), padding="SAME")


class LinenCNN(nn.Module):
  conv_example_dims: int | None = None

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(kd.linen.Conv(3, param_dtype=jnp.float64, precision=HIGHEST,
                               kfac_example_dims=self.conv_example_dims, **CNN_CONV)(x))
    h = h.mean(axis=(1, 2))
    h = jnp.tanh(kd.linen.Dense(4, param_dtype=jnp.float64, precision=HIGHEST)(h))
    return kd.linen.Dense(5, use_bias=False, param_dtype=jnp.float64,
                          precision=HIGHEST)(h)


class NnxCNN(nnx.Module):
  def __init__(self, rngs, conv_example_dims=None):
    kw = dict(param_dtype=jnp.float64, precision=HIGHEST, rngs=rngs)
    self.conv = kd.nnx.Conv(2, 3, **CNN_CONV, kfac_example_dims=conv_example_dims, **kw)
    self.hidden = kd.nnx.Linear(3, 4, **kw)
    self.out = kd.nnx.Linear(4, 5, use_bias=False, **kw)

  def __call__(self, x):
    h = jnp.tanh(self.conv(x)).mean(axis=(1, 2))
    return self.out(jnp.tanh(self.hidden(h)))


def plain_cnn(layers, p, x):
  h = jnp.tanh(layers.conv2d(x, p["conv"]["kernel"], p["conv"]["bias"], name="conv",
                             strides=(2, 1), padding="SAME"))
  h = jnp.tanh(layers.dense(h.mean(axis=(1, 2)), p["hidden"]["kernel"],
                            p["hidden"]["bias"], name="hidden"))
  return layers.dense(h, p["out"]["kernel"], None, name="out")


@pytest.mark.parametrize("conv_example_dims", [None, 1])
def test_linen_nnx_and_tags_agree(conv_example_dims):
  """Also `kfac_example_dims` (K-FAC-reduce over each image's pixels)."""
  kx, ky = jax.random.split(jax.random.PRNGKey(12))
  x = randn(kx, (3, 5, 4, 2))
  y = jax.random.randint(ky, (3,), 0, 5)
  linen_params = _randomized(LinenCNN().init(jax.random.PRNGKey(13), x)["params"])
  plain_params = {"conv": linen_params["Conv_0"], "hidden": linen_params["Dense_0"],
                  "out": linen_params["Dense_1"]}
  model = NnxCNN(nnx.Rngs(0), conv_example_dims)
  nnx.update(model, {
      name: {k: v for k, v in layer.items()} for name, layer in plain_params.items()})
  graphdef, nnx_state = nnx.split(model)

  def linen_loss(p, x, y):
    return kd.losses.softmax_cross_entropy(
        LinenCNN(conv_example_dims).apply({"params": p}, x), y)

  def nnx_loss(state, x, y):
    return kd.losses.softmax_cross_entropy(nnx.merge(graphdef, state)(x), y)

  def plain_loss(p, x, y):
    return kd.losses.softmax_cross_entropy(
        plain_cnn(Tagged({"conv": conv_example_dims}), p, x), y)

  results = {}
  for key, fn, p in (("linen", linen_loss, linen_params), ("nnx", nnx_loss, nnx_state),
                     ("plain", plain_loss, plain_params)):
    loss, grads, stats = capture(fn)(p, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(fn))(p, x, y)
    assert_trees_equal(grads, ref_grads)
    results[key] = (loss, grads, stats)

  names = {"linen": {"conv": "Conv_0", "hidden": "Dense_0", "out": "Dense_1"},
           "nnx": {"conv": "conv", "hidden": "hidden", "out": "out"},
           "plain": {"conv": "conv", "hidden": "hidden", "out": "out"}}
  _, bf = brute_force(plain_cnn, plain_params, x, lambda o: ce_per_example(o, y),
                      reduce_to={"conv": 3} if conv_example_dims else None)
  plain_grads = results["plain"][1]
  nnx_grads = nnx.to_pure_dict(results["nnx"][1])
  for key, (loss, grads, stats) in results.items():
    np.testing.assert_allclose(float(loss), float(results["plain"][0]), rtol=1e-12)
    check_against_brute_force(stats, bf, names[key])
    for layer, name in names[key].items():
      np.testing.assert_allclose(f64(stats[name]["A"]),
                                 f64(results["plain"][2][layer]["A"]), rtol=1e-12)
      np.testing.assert_allclose(f64(stats[name]["G"]),
                                 f64(results["plain"][2][layer]["G"]), rtol=1e-12)
  for layer in names["plain"]:
    for leaf in plain_grads[layer]:
      np.testing.assert_allclose(f64(results["linen"][1][names["linen"][layer]][leaf]),
                                 f64(plain_grads[layer][leaf]), rtol=1e-12)
      np.testing.assert_allclose(f64(nnx_grads[layer][leaf]),
                                 f64(plain_grads[layer][leaf]), rtol=1e-12)


# ---------------------------------------------------------------------------
# 9. Grouped convolutions.
# ---------------------------------------------------------------------------

class _Groups:
  """A grouped convolution: through `layers.conv2d` once with
  `feature_group_count` (`Tagged`), or as one convolution per group over its
  slice of the channels (`Ref`: the brute force records each group as a
  layer "conv/<g>")."""

  def __init__(self, layers, groups):
    self.layers, self.groups = layers, groups

  def _conv(self, kind, x, kernel, bias=None, *, name, **kwargs):
    if isinstance(self.layers, Tagged):
      return getattr(kd.tags, kind)(x, kernel, bias, feature_group_count=self.groups,
                                    example_dims=self.layers.example_dims.get(name),
                                    **kwargs)
    c_in, c_out = x.shape[-1] // self.groups, kernel.shape[-1] // self.groups
    return jnp.concatenate([getattr(self.layers, kind)(
        x[..., g * c_in:(g + 1) * c_in], kernel[..., g * c_out:(g + 1) * c_out],
        None if bias is None else bias[g * c_out:(g + 1) * c_out], name=f"{name}/{g}",
        **kwargs) for g in range(self.groups)], axis=-1)

  conv1d = functools.partialmethod(_conv, "conv1d")
  conv2d = functools.partialmethod(_conv, "conv2d")

  def dense(self, *args, **kwargs):
    return self.layers.dense(*args, **kwargs)


GROUPED_CASES = {
    "two_groups_bias": dict(groups=2, c_in=4, c_out=6, bias=True,
                            conv=dict(strides=(1, 1), padding="SAME", dilation=(1, 1))),
    "depthwise_x2_strided": dict(groups=3, c_in=3, c_out=6, bias=False,
                                 conv=dict(strides=(2, 1), padding="VALID",
                                           dilation=(1, 1))),
    "depthwise_dilated_bias": dict(groups=4, c_in=4, c_out=4, bias=True,
                                   conv=dict(strides=(1, 1), padding=((1, 2), (0, 1)),
                                             dilation=(2, 1))),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_conv_statistics_equal_brute_force(case):
  """A grouped (depthwise: one input channel per group) convolution is one
  block per group: its statistics `[groups, ...]` equal the brute force of
  each group's convolution over its own channels (explicit im2col and
  per-example Jacobians), and its forward equals `lax`'s grouped one."""
  cfg = GROUPED_CASES[case]
  groups, c_in, c_out = cfg["groups"], cfg["c_in"], cfg["c_out"]
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(5), 3)
  params = conv_params(kp, (3, 2, c_in // groups, c_out), cfg["bias"], classes=3)
  x = randn(kx, (3, 7, 6, c_in))
  y = jax.random.randint(ky, (3,), 0, 3)
  kernel, bias = params["conv"]["kernel"], params["conv"].get("bias")
  out = kd.tags.conv2d(x, kernel, bias, feature_group_count=groups, **cfg["conv"])
  ref = lax.conv_general_dilated(x, kernel, cfg["conv"]["strides"], cfg["conv"]["padding"],
                                 rhs_dilation=cfg["conv"]["dilation"],
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                 feature_group_count=groups, precision=HIGHEST)
  np.testing.assert_allclose(f64(out), f64(ref + (0 if bias is None else bias)),
                             rtol=1e-10, atol=1e-10)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(
        conv_net(_Groups(Tagged(), groups), p, x, cfg["conv"]), y)

  grad_fn = kd.value_and_grad(loss_fn)
  (layer, _) = grad_fn.discover(params, x, y)
  assert (layer.stack, layer.groups, layer.kernel_shape) == (
      (groups,), groups, (3, 2, c_in // groups, c_out // groups))
  assert (layer.a_dim, layer.g_dim) == (6 * (c_in // groups) + cfg["bias"], c_out // groups)
  loss, grads, stats = jax.jit(grad_fn)(params, x, y)
  bf_loss, bf = brute_force(lambda l, p, x: conv_net(_Groups(l, groups), p, x, cfg["conv"]),
                            params, x, lambda o: ce_per_example(o, y))
  np.testing.assert_allclose(float(loss), bf_loss, rtol=1e-6)
  assert_trees_equal(grads, jax.grad(loss_fn)(params, x, y))
  for g in range(groups):
    for factor in ("A", "G"):
      assert_factor_close(stats["conv"][factor][g], bf[f"conv/{g}"][factor],
                          f"{factor} of group {g}")
  assert_factor_close(stats["dense"]["A"], bf["dense"]["A"], "A of dense")


@pytest.mark.parametrize("example_dims", [None, 1])
def test_depthwise_causal_conv1d_statistics_equal_brute_force(example_dims):
  """A depthwise causal 1-D convolution (a sequence model's short
  convolution: one channel per group, left padding): per-channel factors
  equal the brute force, every position an example or each sequence one
  (`example_dims=1`, K-FAC-reduce)."""
  cfg = dict(strides=(1,), padding=((3, 0),), dilation=(1,))
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(9), 3)
  params = conv_params(kp, (4, 1, 3), True, classes=4)
  x = randn(kx, (3, 9, 3))
  y = jax.random.randint(ky, (3,), 0, 4)

  def loss_fn(p, x, y):
    layers = _Groups(Tagged({"conv": example_dims} if example_dims else None), 3)
    return kd.losses.softmax_cross_entropy(conv1d_net(layers, p, x, cfg), y)

  _, _, stats = capture(loss_fn)(params, x, y)
  _, bf = brute_force(lambda l, p, x: conv1d_net(_Groups(l, 3), p, x, cfg), params, x,
                      lambda o: ce_per_example(o, y),
                      reduce_to={f"conv/{g}": 3 for g in range(3)} if example_dims else None)
  assert stats["conv"]["A"].shape == (3, 5, 5) and stats["conv"]["G"].shape == (3, 1, 1)
  for g in range(3):
    for factor in ("A", "G"):
      assert_factor_close(stats["conv"][factor][g], bf[f"conv/{g}"][factor],
                          f"{factor} of channel {g}")


def test_grouped_conv_bad_group_count_raises():
  x = jnp.ones((1, 4, 4, 4))
  with pytest.raises(ValueError, match="feature_group_count=3 must be a positive divisor"):
    kd.tags.conv2d(x, jnp.ones((3, 3, 2, 4)), feature_group_count=3)
  with pytest.raises(ValueError, match="input channels 4 do not match"):
    kd.tags.conv2d(x, jnp.ones((3, 3, 1, 4)), feature_group_count=2)
  with pytest.raises(ValueError, match="transpose_kernel=True with feature_group_count=2"):
    kd.tags.conv2d(x, jnp.ones((3, 3, 4, 2)), feature_group_count=2, transpose_kernel=True)
  with pytest.raises(ValueError, match="do not match .* and transpose_kernel=True"):
    kd.tags.conv2d(x, jnp.ones((3, 3, 4, 3)), transpose_kernel=True)   # (out 4, in 3)


def test_grouped_conv_in_a_stack_has_each_blocks_groups():
  """A grouped convolution in stacked layers (`stack_index=`, a scan's
  blocks): its statistics are `[L, groups, ...]`, block `l`'s groups those
  of the same convolution applied as a layer of its own (whose groups'
  factors test_grouped_conv_statistics checks against brute force)."""
  kernel = randn(jax.random.PRNGKey(3), (2, 3, 3, 2, 4), 0.4)
  bias = randn(jax.random.PRNGKey(4), (2, 4), 0.1)
  x, y = randn(jax.random.PRNGKey(5), (3, 4, 4, 4)), jnp.array([0, 1, 3])

  def loss_fn(p, x, y, stacked=True):
    h = x
    for i in range(2):
      h = jnp.tanh(kd.tags.conv2d(h, p["k"], p["b"], stack_index=i, feature_group_count=2)
                   if stacked else kd.tags.conv2d(h, p[f"k{i}"], p[f"b{i}"], name=f"k{i}",
                                                  feature_group_count=2))
    return kd.losses.softmax_cross_entropy(h.mean((1, 2)), y)
  layer, = kd.value_and_grad(loss_fn).discover({"k": kernel, "b": bias}, x, y)
  assert layer.stack == (2, 2) and layer.kernel_shape == (3, 3, 2, 2)
  assert layer.leaf_shape(layer.kernel_shape) == kernel.shape
  _, _, stats = kd.value_and_grad(loss_fn)({"k": kernel, "b": bias}, x, y)
  split = {f"{w}{i}": p[i] for w, p in (("k", kernel), ("b", bias)) for i in range(2)}
  _, _, want = kd.value_and_grad(functools.partial(loss_fn, stacked=False))(split, x, y)
  for i in range(2):
    for factor in ("A", "G"):
      np.testing.assert_allclose(stats["k"][factor][i], want[f"k{i}"][factor], rtol=1e-12,
                                 err_msg=f"{factor} of block {i}")


@pytest.mark.parametrize("capture_mode", ["linen", "intercept", "nnx"])
def test_grouped_flax_conv_is_tagged(capture_mode):
  """`kd.linen.Conv` / `kd.nnx.Conv` with `feature_group_count`, and Flax's
  own under `capture="flax"`: Flax's parameters and outputs, and the
  statistics of `kd.tags.conv2d` with the same groups."""
  x = randn(jax.random.PRNGKey(0), (2, 5, 5, 4))
  y = jnp.array([0, 2])
  flax_conv = nn.Conv(6, (3, 3), feature_group_count=2, param_dtype=jnp.float64)
  conv_vars = flax_conv.init(jax.random.PRNGKey(1), x)
  kernel, bias = conv_vars["params"]["kernel"], conv_vars["params"]["bias"]
  assert kernel.shape == (3, 3, 2, 6)
  head = randn(jax.random.PRNGKey(2), (6, 3))
  params = {"conv": {"kernel": kernel, "bias": bias}, "head": {"kernel": head}}

  def tagged_loss(p, x, y):
    h = kd.tags.conv2d(x, p["conv"]["kernel"], p["conv"]["bias"], feature_group_count=2)
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(h.mean((1, 2)), p["head"]["kernel"]), y)

  if capture_mode == "nnx":
    conv = kd.nnx.Conv(4, 6, (3, 3), feature_group_count=2, param_dtype=jnp.float64,
                       rngs=nnx.Rngs(0))
    nnx.update(conv, {"kernel": kernel, "bias": bias})
    np.testing.assert_allclose(f64(conv(x)), f64(flax_conv.apply(conv_vars, x)),
                               rtol=1e-12)
    graphdef, model_params = nnx.split(conv)

    def loss_fn(p, x, y):
      h = nnx.merge(graphdef, p)(x)
      return kd.losses.softmax_cross_entropy(h.mean((1, 2)) @ head, y)
    grad_fn = kd.value_and_grad(loss_fn)
  else:
    module = (kd.linen.Conv if capture_mode == "linen" else nn.Conv)(
        6, (3, 3), feature_group_count=2, param_dtype=jnp.float64)
    assert jax.tree.map(jnp.shape, module.init(jax.random.PRNGKey(1), x)) == jax.tree.map(
        jnp.shape, conv_vars)
    np.testing.assert_allclose(f64(module.apply(conv_vars, x)),
                               f64(flax_conv.apply(conv_vars, x)), rtol=1e-12)
    model_params = conv_vars["params"]

    def loss_fn(p, x, y):
      h = module.apply({"params": p}, x)
      return kd.losses.softmax_cross_entropy(h.mean((1, 2)) @ head, y)
    grad_fn = kd.value_and_grad(loss_fn, capture="tags" if capture_mode == "linen"
                                else "flax")
  layers = grad_fn.discover(model_params, x, y)
  assert len(layers) == 1 and not layers.uncaptured
  assert (layers.layers[0].stack, layers.layers[0].kernel_shape) == ((2,), (3, 3, 2, 3))
  _, _, stats = grad_fn(model_params, x, y)
  _, _, want = kd.value_and_grad(tagged_loss)(params, x, y)
  (got,) = stats.values()
  assert_trees_equal(got, want["conv"])


def test_a_plain_tag_is_named_by_its_kernels_parent_path():
  """A plain-JAX tag without `name=` is named by its kernel's path less the
  leaf's own key, whatever that key is called (a dict key `value` is a key like
  any other: only boxes' attributes are dropped, by `registry.path_str`)."""
  params = {"a": {"b": {"value": jnp.ones((3, 4))}}, "c": {"kernel": jnp.ones((4, 2))}}

  def loss(p, x, y):
    h = kd.tags.dense(x, p["a"]["b"]["value"])
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["c"]["kernel"]), y)
  layers = kd.value_and_grad(loss).discover(params, jnp.ones((5, 3)), jnp.zeros(5, int))
  assert [layer.name for layer in layers.layers] == ["a/b", "c"]


class _ValuePair(typing.NamedTuple):     # fields named like boxes' attributes
  value: jax.Array
  raw_value: jax.Array


class _PlainPair(typing.NamedTuple):
  first: jax.Array
  second: jax.Array


@pytest.mark.parametrize("method", ["kfac", "shampoo"])
def test_a_container_whose_fields_are_called_like_box_attributes_keeps_them_apart(method):
  """A NamedTuple with fields `value` and `raw_value` is not a box: its two
  leaves keep their own names and get their own updates, the updates of the
  same tree with other field names (before, K-FAC gave both the update of
  one)."""
  rng = np.random.default_rng(0)
  x, y = jnp.asarray(rng.normal(size=(16, 3))), jnp.asarray(rng.integers(0, 4, 16))
  kernel = jnp.asarray(rng.normal(size=(3, 4)))

  def run(pair):
    params = {"dense": {"kernel": kernel}, "extra": pair(jnp.ones(4), 2 * jnp.ones(4))}

    def loss_fn(p, x, y):
      first, second = p["extra"]
      return kd.losses.softmax_cross_entropy(
          kd.tags.dense(x, p["dense"]["kernel"]) * first + second, y)
    grad_fn = kd.value_and_grad(loss_fn)
    tx = (kd.kfac(0.1, damping=1e-2, momentum=0.0, layers=grad_fn.discover(params, x, y))
          if method == "kfac" else kd.shampoo(0.1))
    state = tx.init(params)
    for _ in range(2):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      params = optax.apply_updates(params, updates)
    return updates, params
  got, want = run(_ValuePair), run(_PlainPair)
  assert_trees_equal(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
  assert not np.allclose(got[0]["extra"].value, got[0]["extra"].raw_value)
  assert kd.capture.registry.path_strs(
      [p for p, _ in jax.tree_util.tree_flatten_with_path(got[1])[0]]) == [
          "dense/kernel", "extra/value", "extra/raw_value"]


_EMPTY_OUTPUTS = {      # a layer's contribution with no positions, added to `h` [B, 3]
    "dense": lambda p, x: kd.tags.dense(jnp.zeros((x.shape[0], 0, 4)), p["k"], p["b"],
                                        name="empty").sum((1, 2))[:, None],
    "dense_reduce": lambda p, x: kd.tags.dense(jnp.zeros((x.shape[0], 0, 4)), p["k"], p["b"],
                                               name="empty", example_dims=1).sum((1, 2))[:, None],
    "conv_valid": lambda p, x: kd.tags.conv2d(   # a 3x3 VALID window on a 2x2 image
        jnp.ones((x.shape[0], 2, 2, 4)) * x[:, :1, None, None], p["c"], name="empty",
        padding="VALID").sum((1, 2)),
    "scale_and_shift": lambda p, x: kd.tags.scale_and_shift(
        jnp.zeros((x.shape[0], 0, 4)), p["s"], name="empty").sum((1, 2))[:, None],
    "embed": lambda p, x: kd.tags.embed(jnp.zeros((x.shape[0], 0), jnp.int32), p["k"],
                                        name="empty").sum((1, 2))[:, None],
}


@pytest.mark.parametrize("kind", sorted(_EMPTY_OUTPUTS))
def test_a_layer_with_no_positions_keeps_its_factors(kind):
  """A tagged layer whose output is empty (`[B, 0, d]` rows: zero register
  tokens; a VALID window larger than its input) has no statistics: it counts
  as not reached, its factors are kept, and the step is the same model's
  without it (its `A` was 0/0 = NaN, which skipped every step, or the
  capture crashed reshaping the empty patches)."""
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  with jax.enable_x64(True):   # float64: two programs' float32 eigh differ in the 6th digit
    x, t = jax.random.normal(k[0], (16, 4)), jax.random.normal(k[1], (16, 3))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), {
        "w": 0.3 * jax.random.normal(k[2], (4, 3)), "b0": jnp.zeros(3), "k": jnp.ones((4, 4)),
        "b": jnp.ones(4), "c": jnp.ones((3, 3, 4, 1)), "s": jnp.ones(4)})
    _empty_layer_steps(kind, x, t, params)


def _empty_layer_steps(kind: str, x, t, params) -> None:
  """Two steps with and without the empty layer: the same updates."""
  def with_empty(p, x, t):
    h = kd.tags.dense(x, p["w"], p["b0"], name="d")
    return kd.losses.squared_error(h + _EMPTY_OUTPUTS[kind](p, x), t)

  def without(p, x, t):
    return kd.losses.squared_error(kd.tags.dense(x, p["w"], p["b0"], name="d"), t)

  steps = []
  for loss in (with_empty, without):
    grad_fn = kd.value_and_grad(loss)
    tx = kd.kfac(0.1, damping=1e-2, layers=grad_fn.discover(params, x, t),
                 factor_dtype=jnp.float64)
    state = tx.init(params)
    for _ in range(2):
      _, grads, stats = jax.jit(grad_fn)(params, x, t, opt_state=state)
      updates, new_state = jax.jit(tx.update)(grads, state, params, kfac_stats=stats)
      if loss is with_empty:
        assert kd.capture.statistics.UNREACHED in stats["empty"]
        assert_trees_equal(kd.running_factors(new_state)["empty"],
                           kd.running_factors(state)["empty"], rtol=0)
      state = new_state
    assert int(kd.find_states(state)[0].skipped) == 0
    steps.append(updates)
  assert_trees_equal(steps[0]["w"], steps[1]["w"], rtol=1e-10)
  assert_trees_equal(steps[0]["b0"], steps[1]["b0"], rtol=1e-10)


def test_token_frequencies_count_past_float32s_integers():
  """An embedding's `A` counts each id exactly past 2²⁴ copies on one device
  (long padded contexts): float32 ones stopped counting there (2²⁴ + 2²⁰
  padding ids gave A = 0.94, not 1 − 1/N)."""
  n = 2 ** 24 + 2 ** 20
  ids = jnp.zeros((n,), jnp.int32).at[-1].set(3)
  a = kd.capture.statistics.token_frequencies(ids, 5)
  np.testing.assert_allclose(np.asarray(a), [(n - 1) / n, 0, 0, 1 / n, 0], rtol=1e-7)


def test_a_layer_with_an_empty_kernel_runs_untagged():
  """A feature group configured to width 0 (a `(0, d)` kernel): no curvature
  to capture, so the layer runs untagged (its bias then updated as any
  untagged parameter); the reshapes of its rows divided by zero before, in
  the gradient itself. A K-FAC step equals the one of the same model with
  the bias added by hand."""
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  x, t = jax.random.normal(k[0], (32, 4)), jax.random.normal(k[1], (32, 3))
  params = {"w": 0.3 * jax.random.normal(k[2], (4, 3)), "b": jnp.zeros(3),
            "e": jnp.zeros((0, 3)), "eb": 0.1 * jax.random.normal(k[3], (3,))}

  def with_empty(p, x, t):
    y = kd.tags.dense(x, p["w"], p["b"], name="d")
    return kd.losses.squared_error(
        y + kd.tags.dense(x[:, :0], p["e"], p["eb"], name="empty"), t)

  def by_hand(p, x, t):
    return kd.losses.squared_error(kd.tags.dense(x, p["w"], p["b"], name="d") + p["eb"], t)

  steps = []
  for loss in (with_empty, by_hand):
    grad_fn = kd.value_and_grad(loss)
    layers = grad_fn.discover(params, x, t)
    assert [layer.name for layer in layers] == ["d"]
    tx = kd.kfac(0.1, damping=1e-2, layers=layers)
    state = tx.init(params)
    _, grads, stats = grad_fn(params, x, t, opt_state=state)
    steps.append(tx.update(grads, state, params, kfac_stats=stats)[0])
  assert steps[0]["e"].shape == (0, 3)
  assert_trees_equal(steps[0], steps[1], rtol=0)
