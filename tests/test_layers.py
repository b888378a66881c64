"""Oracle tests for the embedding, DenseGeneral and scale-and-shift layers.

As in `test_capture`, every statistic is checked against a brute-force
construction in float64 that does not use the library: a plain-jnp reference
forward records each layer's inputs (ids, flattened inputs, normalised `x̂`)
and adds a zero perturbation to each layer output; the output gradients
`g_p = Σ_e w_e ∂ℓ_e/∂y_p` come from the Jacobian of the per-example losses
w.r.t. those perturbations. Where examples are independent, per-example
parameter gradients from `jax.vmap(jax.grad(...))` check the same numbers
another way. Conventions under test (see `kfac_jax_dist.capture.statistics`):

    embed:            A_v = (1/N)·#{p : id_p = v}   ([V]),  G = (1/n) Σ_p g_p g_pᵀ
    dense_general:    Dense's A and G on the flattened inputs / outputs
    scale_and_shift:  F_c = (1/n) Σ_u [uγ², uγ uβ, uβ²],  uγ = Σ_{p∈u} x̂_p g_p,
                      uβ = Σ_{p∈u} g_p   (examples u: positions, or images)
"""

from __future__ import annotations

import functools
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import kfac_jax_dist as kd
from kfac_jax_dist.flax import common as flax_common
from kfac_jax_dist.kfac import linalg
from helpers import (assert_factor_close, assert_trees_equal, capture, ce_per_example,
                     check_mc_estimate, f64, mc_draws, randn)
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

def output_gradients(forward, eps0, per_example_loss, weights=None):
  """`{name: g}` with `g_p = Σ_e w_e ∂ℓ_e/∂y_p`, shaped like each output."""
  jac = jax.jit(jax.jacrev(lambda e: per_example_loss(forward(e))))(eps0)
  out = {}
  for name, j in jac.items():
    j = f64(j)
    w = np.ones(j.shape[0]) if weights is None else f64(weights).reshape(-1)
    out[name] = np.tensordot(w, j, axes=1)
  return out


def dense_stats(rows, g, n, bias, units=None):
  """Dense's A, G; `units=U`: positions reduced per example (K-FAC-reduce)."""
  rows = f64(rows).reshape(-1, np.shape(rows)[-1])
  if bias:
    rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
  g = g.reshape(-1, g.shape[-1])
  if units is not None:
    rows = rows.reshape(units, -1, rows.shape[-1]).mean(1)
    g = g.reshape(units, -1, g.shape[-1]).sum(1)
  return {"A": rows.T @ rows / rows.shape[0], "G": g.T @ g / n}


def embed_stats(ids, vocab, g, n):
  ids = np.asarray(ids).reshape(-1)
  g = g.reshape(-1, g.shape[-1])
  return {"A": np.bincount(ids, minlength=vocab) / ids.size, "G": g.T @ g / n}


def unitwise_stats(x_hat, g, n, example_dims=None, has_offset=True):
  x_hat = f64(x_hat)
  lead = x_hat.shape[:-1]
  k = len(lead) if example_dims is None else example_dims
  units = int(np.prod(lead[:k]))
  c = x_hat.shape[-1]
  ug = (x_hat * g).reshape(units, -1, c).sum(1)
  ub = g.reshape(units, -1, c).sum(1)
  f = np.stack([(ug * ug).sum(0), (ug * ub).sum(0), (ub * ub).sum(0)], -1) / n
  if not has_offset:
    f[:, 1:] = 0.0
  return {"F": f}


def check_stats(stats, expected, names=None):
  names = names or {k: k for k in expected}
  assert set(stats) == set(names.values()), (set(stats), names)
  for ref_name, name in names.items():
    assert set(stats[name]) == set(expected[ref_name]), name
    for key, value in expected[ref_name].items():
      assert_factor_close(stats[name][key], value, f"{key} of {name}")


def layer_norm(x, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
  return (x - mean) * lax.rsqrt(var + eps)


# ---------------------------------------------------------------------------
# 1. Embedding.
# ---------------------------------------------------------------------------

def embed_params(key, vocab=7, d=4, classes=3):
  k1, k2 = jax.random.split(key)
  return {"emb": {"embedding": randn(k1, (vocab, d))},
          "out": {"kernel": randn(k2, (d, classes), 0.7)}}


@pytest.mark.parametrize("masked", [False, True])
def test_embed_per_token(masked):
  kp, ki, ky = jax.random.split(jax.random.PRNGKey(0), 3)
  params = embed_params(kp)
  ids = jax.random.randint(ki, (3, 5), 0, 6)        # row 6 never used: A_6 = 0
  y = jax.random.randint(ky, (3, 5), 0, 3)
  mask = (jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0]], jnp.float64)
          if masked else None)

  def loss_fn(p, ids, y):
    h = jnp.tanh(kd.tags.embed(ids, p["emb"]["embedding"]))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["out"]["kernel"]), y,
                                           mask=mask)

  loss, grads, stats = capture(loss_fn)(params, ids, y)
  ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, ids, y)
  assert_trees_equal(grads, ref_grads)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-12)

  table, w = params["emb"]["embedding"], params["out"]["kernel"]

  def forward(e):
    s = table[ids] + e["emb"]
    h = jnp.tanh(s)
    return h @ w + e["out"], h

  eps0 = {"emb": jnp.zeros(ids.shape + (4,)), "out": jnp.zeros(ids.shape + (3,))}
  weights = np.ones(ids.shape) if mask is None else f64(mask)
  n = weights.sum()
  g = output_gradients(lambda e: forward(e)[0], eps0, lambda o: ce_per_example(o, y),
                       weights)
  expected = {"emb": embed_stats(ids, 7, g["emb"], n),
              "out": dense_stats(forward(eps0)[1], g["out"], n, bias=False)}
  check_stats(stats, expected)
  assert f64(stats["emb"]["A"])[6] == 0.0
  np.testing.assert_allclose(f64(stats["emb"]["A"]).sum(), 1.0, rtol=1e-6)

  # Per-token gradients another way: tokens are independent here, so
  # vmap(grad) of one token's loss w.r.t. its embedding output gives g_p.
  def token_loss(e, label):
    logits = jnp.tanh(e) @ w
    return -jax.nn.log_softmax(logits)[label]

  g_vmap = jax.vmap(jax.grad(token_loss))(table[ids].reshape(-1, 4), y.reshape(-1))
  g_vmap = f64(g_vmap) * weights.reshape(-1, 1)
  assert_factor_close(stats["emb"]["G"], g_vmap.T @ g_vmap / n, "G of emb (vmap)")


def _tied_models(vocab, d):
  """`(name, loss_fn(params, ids, y), params_of(table), stats name, capture)`
  of one tied model, `tanh(table[ids]) @ tableᵀ`, written four ways."""
  class Linen(nn.Module):
    embed: type

    @nn.compact
    def __call__(self, ids):
      table = self.embed(vocab, d, param_dtype=jnp.float64, name="emb")
      return table.attend(jnp.tanh(table(ids)))

  class Nnx(nnx.Module):
    def __init__(self, embed):
      self.emb = embed(vocab, d, param_dtype=jnp.float64, rngs=nnx.Rngs(0))

    def __call__(self, ids):
      return self.emb.attend(jnp.tanh(self.emb(ids)))

  def plain(p, ids, y):
    table = p["emb"]["embedding"]
    return kd.losses.softmax_cross_entropy(jnp.tanh(kd.tags.embed(ids, table)) @ table.T, y)

  def linen(embed):
    model = Linen(embed)
    return (lambda p, ids, y: kd.losses.softmax_cross_entropy(model.apply(p, ids), y),
            lambda table: {"params": {"emb": {"embedding": table}}}, "params/emb")

  def nnx_model(embed):
    graphdef, state = nnx.split(Nnx(embed), nnx.Param)

    def params_of(table):
      return jax.tree.map(lambda _: table, state)
    return (lambda p, ids, y: kd.losses.softmax_cross_entropy(
        nnx.merge(graphdef, p)(ids), y), params_of, "emb")

  return {"plain": (plain, lambda table: {"emb": {"embedding": table}}, "emb", "tags"),
          "linen-intercepted": (*linen(nn.Embed), "flax"),
          "kd.linen": (*linen(kd.linen.Embed), "tags"),
          "nnx-intercepted": (*nnx_model(nnx.Embed), "flax"),
          "kd.nnx": (*nnx_model(kd.nnx.Embed), "tags")}


@pytest.mark.parametrize("model", ["plain", "linen-intercepted", "kd.linen",
                                   "nnx-intercepted", "kd.nnx"])
def test_tied_embedding_gets_its_lookups_statistics_and_whole_gradient(model):
  """A table that is also the output projection (`attend`, `x @ tableᵀ`): the
  lookup is captured (its statistics are the lookup's, brute force), the head
  is not, and the table's gradient is the whole gradient (both uses)."""
  vocab, d = 7, 4
  kp, ki, ky = jax.random.split(jax.random.PRNGKey(3), 3)
  table = randn(kp, (vocab, d))
  ids = jax.random.randint(ki, (3, 5), 0, 6)
  y = jax.random.randint(ky, (3, 5), 0, vocab)
  loss_fn, params_of, name, how = _tied_models(vocab, d)[model]
  params = params_of(table)
  grad_fn = kd.value_and_grad(loss_fn, capture=how)
  assert grad_fn.discover(params, ids, y).names() == (name,)
  loss, grads, stats = grad_fn(params, ids, y)
  ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, ids, y)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-12)
  assert_trees_equal(grads, ref_grads)

  def forward(e):
    return jnp.tanh(table[ids] + e["emb"]) @ table.T

  g = output_gradients(forward, {"emb": jnp.zeros(ids.shape + (d,))},
                       lambda o: ce_per_example(o, y))
  check_stats(stats, {"emb": embed_stats(ids, vocab, g["emb"], ids.size)}, {"emb": name})


def test_embed_out_of_range_zero():
  """`out_of_range="zero"`: ids outside `[0, V)`, negative ones too (not
  wrapped), look up zero rows and count in no row of `A`, while every position
  counts in `A`'s denominator and in `G` (their output cotangents); "nan"
  (default) is `jnp.take`'s."""
  table = randn(jax.random.PRNGKey(0), (4, 3))
  w = randn(jax.random.PRNGKey(1), (3, 2))
  ids = jnp.array([[0, -1, 2], [4, 2, 7]])
  y = jnp.array([[0, 1, 1], [0, 1, 0]])

  def loss_fn(p, ids, y, mode="zero"):
    h = kd.tags.embed(ids, p["table"], out_of_range=mode)
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["w"]), y)
  params = {"table": table, "w": w}
  _, grads, stats = capture(loss_fn)(params, ids, y)
  np.testing.assert_allclose(f64(stats["table"]["A"]), np.array([1, 0, 2, 0]) / 6)
  kept = (ids >= 0) & (ids < 4)
  rows = jnp.where(kept[..., None], table[jnp.clip(ids, 0, 3)], 0.0)
  np.testing.assert_array_equal(kd.tags.embed(ids, table, out_of_range="zero"), rows)
  g = jax.vmap(jax.vmap(jax.grad(
      lambda h, t: kd.losses.softmax_cross_entropy(h[None] @ w, t[None]))))(rows, y)
  np.testing.assert_allclose(f64(stats["table"]["G"]),
                             f64(g).reshape(-1, 3).T @ f64(g).reshape(-1, 3) / 6,
                             rtol=1e-5, atol=1e-7)
  want = jax.grad(lambda p: kd.losses.softmax_cross_entropy(rows @ p["w"], y))(params)
  np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-6)
  assert np.isnan(np.asarray(kd.tags.embed(ids, table))[1, 0]).all()
  np.testing.assert_array_equal(kd.tags.embed(ids, table)[0, 1], table[-1])
  with pytest.raises(ValueError, match="out_of_range='clip'"):
    kd.tags.embed(ids, table, out_of_range="clip")


def test_conv_tag_padding_errors_name_the_recipe():
  """A padding name that only Flax's layers know (CAUSAL, CIRCULAR, REFLECT)
  is refused by the tags with how to pad first; another unknown one plainly."""
  x, kernel = jnp.ones((2, 8, 3)), jnp.ones((3, 3, 4))
  with pytest.raises(ValueError, match=r"'CAUSAL': pad the input first.*jnp.pad"):
    kd.tags.conv1d(x, kernel, padding="CAUSAL")
  with pytest.raises(ValueError, match=r"'CIRCULAR': pad the input first"):
    kd.tags.conv2d(jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4)), padding="CIRCULAR")
  with pytest.raises(ValueError, match=r"explicit padding, got 'FULL'$"):
    kd.tags.conv1d(x, kernel, padding="FULL")


def test_embed_errors_and_broadcast():
  with pytest.raises(ValueError, match="integers"):
    kd.tags.embed(jnp.ones((2,)), jnp.ones((3, 2)))
  with pytest.raises(ValueError, match="2-D"):
    kd.tags.embed(jnp.ones((2,), jnp.int32), jnp.ones((3, 2, 1)))
  # num_embeddings == 1 broadcasts the single row whatever the ids (as Flax).
  ids = jnp.array([[0, 3], [5, 0]])
  variables = nn.Embed(1, 3).init(jax.random.PRNGKey(0), ids)
  np.testing.assert_array_equal(kd.linen.Embed(1, 3).apply(variables, ids),
                                nn.Embed(1, 3).apply(variables, ids))


# ---------------------------------------------------------------------------
# 2. DenseGeneral.
# ---------------------------------------------------------------------------

def _projections_problem(use_bias: bool, example_dims: int | None = None):
  """`(p, x, y, forward, eps0, expected)` of x [B, T, d] → [d, h, k] kernel →
  tanh → [h, k, classes] kernel: parameters, batch, the brute-force forward
  with zero output perturbations `eps0`, and its statistics
  (`example_dims=1`: both layers reduced over the sequence)."""
  ks = jax.random.split(jax.random.PRNGKey(1), 7)
  b, t, d, h, k, classes = 2, 3, 4, 2, 3, 5
  p = {"q": {"kernel": randn(ks[0], (d, h, k), 0.5)},
       "o": {"kernel": randn(ks[1], (h, k, classes), 0.5)}}
  if use_bias:
    p["q"]["bias"] = randn(ks[2], (h, k), 0.5)
    p["o"]["bias"] = randn(ks[3], (classes,), 0.5)
  x = randn(ks[4], (b, t, d))
  y = jax.random.randint(ks[5], (b, t), 0, classes)

  def forward(e):
    q = jnp.einsum("btd,dhk->bthk", x, p["q"]["kernel"], precision=HIGHEST)
    q = q + p["q"].get("bias", 0.0) + e["q"]
    o = jnp.einsum("bthk,hkc->btc", jnp.tanh(q), p["o"]["kernel"], precision=HIGHEST)
    return o + p["o"].get("bias", 0.0) + e["o"], jnp.tanh(q)

  eps0 = {"q": jnp.zeros((b, t, h, k)), "o": jnp.zeros((b, t, classes))}
  g = output_gradients(lambda e: forward(e)[0], eps0, lambda out: ce_per_example(out, y))
  n = b * t
  units = b if example_dims else None
  expected = {"q": dense_stats(x, g["q"].reshape(b, t, h * k), n, use_bias, units),
              "o": dense_stats(forward(eps0)[1].reshape(b, t, h * k), g["o"], n, use_bias,
                               units)}
  return p, x, y, forward, eps0, expected


@pytest.mark.parametrize("use_bias,example_dims", [(True, None), (False, None), (True, 1)])
def test_dense_general_statistics(use_bias, example_dims):
  """x [B, T, d] → [d, h, k] kernel → tanh → [h, k, d] kernel (in_dims=2);
  `example_dims=1`: both reduced over the sequence (K-FAC-reduce)."""
  p, x, y, forward, eps0, expected = _projections_problem(use_bias, example_dims)
  d, h, k, classes = 4, 2, 3, 5

  def model(p, x):
    q = kd.tags.dense_general(x, p["q"]["kernel"], p["q"].get("bias"), precision=HIGHEST,
                              example_dims=example_dims)
    return kd.tags.dense_general(jnp.tanh(q), p["o"]["kernel"], p["o"].get("bias"),
                                 in_dims=2, precision=HIGHEST, example_dims=example_dims)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model(p, x), y)

  np.testing.assert_allclose(f64(model(p, x)), f64(forward(eps0)[0]), rtol=1e-12)

  layers = kd.value_and_grad(loss_fn).discover(p, x, y)
  q, o = layers.layers
  assert (q.kind, q.kernel_shape, q.a_dim, q.g_dim) == ("dense", (d, h, k),
                                                       d + use_bias, h * k)
  assert (o.kind, o.kernel_shape, o.a_dim, o.g_dim) == ("dense", (h, k, classes),
                                                       h * k + use_bias, classes)
  assert q.bias_shape == ((h, k) if use_bias else None)
  assert not q.a_diagonal

  _, grads, stats = capture(loss_fn)(p, x, y)
  assert_trees_equal(grads, jax.grad(loss_fn)(p, x, y))
  check_stats(stats, expected)


class _LinenEinsums(nn.Module):
  lib: str = "kd"

  @nn.compact
  def __call__(self, x):
    einsum = kd.linen.Einsum if self.lib == "kd" else nn.Einsum
    kw = dict(param_dtype=jnp.float64, precision=HIGHEST)
    q = einsum((4, 2, 3), "btd,dhk->bthk", name="q", **kw)(x)
    return einsum((2, 3, 5), name="o", **kw)(jnp.tanh(q), "...hk,hkc->...c")


class _NnxEinsums(nnx.Module):
  def __init__(self, lib, rngs):
    kw = dict(param_dtype=jnp.float64, precision=HIGHEST, rngs=rngs)
    self.q = lib.Einsum("btd,dhk->bthk", (4, 2, 3), (2, 3), **kw)
    self.o = lib.Einsum("...hk,hkc->...c", (2, 3, 5), (5,), **kw)

  def __call__(self, x):
    return self.o(jnp.tanh(self.q(x)))


def test_einsum_statistics_linen_nnx_intercepted():
  """A Flax `Einsum` whose equation is a Dense layer's is `dense_general`'s
  layer: the brute-force statistics of the test above, for `kd.linen.Einsum`,
  `kd.nnx.Einsum` and Flax's own under `capture="flax"` (an equation given at
  the call too)."""
  p, x, y, _, _, expected = _projections_problem(use_bias=True)
  d, h, k, classes = 4, 2, 3, 5

  def linen_case(lib):
    model = _LinenEinsums(lib)
    return p, lambda p, x, y: kd.losses.softmax_cross_entropy(
        model.apply({"params": p}, x), y)

  def nnx_case(lib):
    model = _NnxEinsums(lib, nnx.Rngs(0))
    nnx.update(model, p)
    graphdef, state = nnx.split(model, nnx.Param)
    return state, lambda p, x, y: kd.losses.softmax_cross_entropy(
        nnx.merge(graphdef, p)(x), y)

  for case, (params, fn), how in (("linen", linen_case("kd"), "tags"),
                                  ("linen intercepted", linen_case("flax"), "flax"),
                                  ("nnx", nnx_case(kd.nnx), "tags"),
                                  ("nnx intercepted", nnx_case(nnx), "flax")):
    grad_fn = kd.value_and_grad(fn, capture=how)
    layers = grad_fn.discover(params, x, y)
    assert [(l.name, l.kind, l.a_dim, l.g_dim) for l in layers.layers] == [
        ("q", "dense", d + 1, h * k), ("o", "dense", h * k + 1, classes)], case
    assert not layers.uncaptured, case
    _, grads, stats = jax.jit(grad_fn)(params, x, y)
    assert_trees_equal(grads, jax.jit(jax.grad(fn))(params, x, y))
    check_stats(stats, expected)


def test_dense_general_errors():
  with pytest.raises(ValueError, match="in_dims"):
    kd.tags.dense_general(jnp.ones((2, 3)), jnp.ones((3, 4)), in_dims=2)
  with pytest.raises(ValueError, match="do not match"):
    kd.tags.dense_general(jnp.ones((2, 3)), jnp.ones((4, 2, 2)))
  with pytest.raises(ValueError, match="bias shape"):
    kd.tags.dense_general(jnp.ones((2, 3)), jnp.ones((3, 2, 2)), jnp.ones((4,)))
  with pytest.raises(ValueError, match="example_dims"):
    kd.tags.dense_general(jnp.ones((2, 3, 4, 5)), jnp.ones((4, 5, 2)), in_dims=2,
                          example_dims=3)


@pytest.mark.parametrize("bias", [(1,), (4, 3), (5,)])
def test_dense_and_conv_tags_refuse_a_bias_of_another_shape(bias):
  # A bias that broadcasts ((1,), (4, 3)) passed and failed at the update.
  with pytest.raises(ValueError, match=r"kd.tags.dense: bias shape .*expected \(3,\)"):
    kd.tags.dense(jnp.ones((4, 6)), jnp.ones((6, 3)), jnp.zeros(bias))
  conv_bias = bias[:-1] + (4,) if len(bias) > 1 else bias
  for spatial, tag in kd.tags.CONVOLUTIONS.items():
    x, kernel = jnp.ones((2,) + (5,) * spatial + (3,)), jnp.ones((3,) * spatial + (3, 4))
    with pytest.raises(ValueError, match=rf"kd.tags.{tag.__name__}: bias shape"):
      tag(x, kernel, jnp.zeros(conv_bias))


@pytest.mark.parametrize("argument", ["strides", "dilation", "input_dilation"])
@pytest.mark.parametrize("value", [(0, 1), (1, -1), 0, (1, 1, 1)])
def test_conv_tags_refuse_non_positive_strides_and_dilations(argument, value):
  # strides=(0, 1) gave "Cannot lower jaxpr with verifier errors".
  with pytest.raises(ValueError, match=rf"kd.tags.conv2d: {argument}=.*positive"):
    kd.tags.conv2d(jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4)), **{argument: value})


# ---------------------------------------------------------------------------
# 3. Scale-and-shift: SP-NGD's unit-wise Fisher.
# ---------------------------------------------------------------------------

def ss_params(key, c=3, classes=4, offset=True):
  k1, k2, k3 = jax.random.split(key, 3)
  p = {"ln": {"scale": 1.0 + randn(k1, (c,), 0.3)},
       "out": {"kernel": randn(k3, (c, classes))}}
  if offset:
    p["ln"]["bias"] = randn(k2, (c,), 0.3)
  return p


@pytest.mark.parametrize("case", ["tokens", "sequences", "tokens_of_sequences",
                                  "scale_only", "masked_tokens"])
def test_scale_and_shift_unitwise_fisher(case):
  """x̂ [B, T, C] → scale-and-shift → tanh → (mean over T) → dense → CE."""
  per_sequence = case in ("sequences", "tokens_of_sequences")
  example_dims = 1 if case == "sequences" else None
  offset = case != "scale_only"
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(2), 3)
  b, t, c = 3, 4, 3
  p = ss_params(kp, c, offset=offset)
  x_hat = randn(kx, (b, t, c))
  y = jax.random.randint(ky, (b,) if per_sequence else (b, t), 0, 4)
  mask = (jnp.array([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]], jnp.float64)
          if case == "masked_tokens" else None)

  def head(h):
    h = jnp.tanh(h)
    return (h.mean(-2) if per_sequence else h) @ p["out"]["kernel"]

  def loss_fn(q, x_hat, y):
    h = kd.tags.scale_and_shift(x_hat, q["ln"]["scale"], q["ln"].get("bias"),
                                example_dims=example_dims)
    h = jnp.tanh(h)
    h = h.mean(-2) if per_sequence else h
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, q["out"]["kernel"]), y,
                                           mask=mask)

  layers = kd.value_and_grad(loss_fn).discover(p, x_hat, y)
  ln = layers.layers[0]
  assert (ln.name, ln.kind, ln.kernel_path, ln.bias_path) == (
      "ln", "scale_and_shift", "ln/scale", "ln/bias" if offset else None)
  assert (ln.kernel_shape, ln.a_dim, ln.g_dim, ln.unitwise) == ((c,), 1 + offset, c, True)

  _, grads, stats = capture(loss_fn)(p, x_hat, y)
  assert_trees_equal(grads, jax.grad(loss_fn)(p, x_hat, y))
  assert stats["ln"]["F"].shape == (c, 3)
  assert set(stats["ln"]) == {"F"}

  scale, bias = p["ln"]["scale"], p["ln"].get("bias", 0.0)
  weights = np.ones(y.shape) if mask is None else f64(mask)
  n = weights.sum()
  g = output_gradients(lambda e: head(x_hat * scale + bias + e["ln"]),
                       {"ln": jnp.zeros((b, t, c))}, lambda o: ce_per_example(o, y),
                       weights)
  expected = unitwise_stats(x_hat, g["ln"], n, example_dims, offset)
  assert_factor_close(stats["ln"]["F"], expected["F"], "F")

  # Per-example parameter gradients another way (examples are independent).
  def example_loss(gamma, beta, xs, label):          # xs [C] or [T, C]
    logits = head(xs * gamma + beta)
    return -jax.nn.log_softmax(logits)[label]

  if case == "sequences":          # an example is a sequence: exact Fisher
    gg, gb = jax.vmap(jax.grad(example_loss, (0, 1)), (None, None, 0, 0))(
        scale, bias if offset else jnp.zeros(c), x_hat, y)
  elif case in ("tokens", "scale_only", "masked_tokens"):
    gg, gb = jax.vmap(jax.grad(example_loss, (0, 1)), (None, None, 0, 0))(
        scale, bias if offset else jnp.zeros(c), x_hat.reshape(-1, c), y.reshape(-1))
    w = weights.reshape(-1, 1)
    gg, gb = f64(gg) * w, f64(gb) * w
  else:
    return
  gg, gb = f64(gg), f64(gb)
  by_vmap = np.stack([(gg * gg).sum(0), (gg * gb).sum(0), (gb * gb).sum(0)], -1) / n
  if not offset:
    by_vmap[:, 1:] = 0.0
  assert_factor_close(stats["ln"]["F"], by_vmap, "F (vmap)")


def test_scale_and_shift_example_dims_on_images():
  """[B, H, W, C] with example_dims=1: per-image sums (SP-NGD Eq. 16)."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(3), 3)
  p = ss_params(kp, 2)
  x_hat = randn(kx, (3, 2, 3, 2))
  y = jax.random.randint(ky, (3,), 0, 4)
  head = lambda h: jnp.tanh(h).mean((1, 2)) @ p["out"]["kernel"]

  def loss_fn(q, x_hat, y, example_dims):
    h = kd.tags.scale_and_shift(x_hat, q["ln"]["scale"], q["ln"]["bias"],
                                example_dims=example_dims)
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(jnp.tanh(h).mean((1, 2)), q["out"]["kernel"]), y)

  g = output_gradients(lambda e: head(x_hat * p["ln"]["scale"] + p["ln"]["bias"] + e["ln"]),
                       {"ln": jnp.zeros(x_hat.shape)}, lambda o: ce_per_example(o, y))
  for example_dims in (None, 0, 1, 2, 3):
    _, _, stats = kd.value_and_grad(loss_fn)(p, x_hat, y, example_dims)
    expected = unitwise_stats(x_hat, g["ln"], 3, example_dims)
    assert_factor_close(stats["ln"]["F"], expected["F"], f"F, example_dims={example_dims}")
  with pytest.raises(ValueError, match="example_dims"):
    kd.tags.scale_and_shift(x_hat, p["ln"]["scale"], example_dims=4)


def test_scale_and_shift_mc_fisher():
  """With fisher="mc", E[F] is the Fisher: Σ over classes weighted by p(t|x)."""
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(4), 3)
  p = ss_params(kp, 2, classes=3)
  x_hat = randn(kx, (5, 2))
  y = jax.random.randint(ky, (5,), 0, 3)

  def loss_fn(q, x_hat, y):
    h = jnp.tanh(kd.tags.scale_and_shift(x_hat, q["ln"]["scale"], q["ln"]["bias"]))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, q["out"]["kernel"]), y)

  _, _, stats = mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), p, x_hat, y)

  def example_loss(gamma, beta, xs, label):
    return -jax.nn.log_softmax(jnp.tanh(xs * gamma + beta) @ p["out"]["kernel"])[label]

  logits = jnp.tanh(x_hat * p["ln"]["scale"] + p["ln"]["bias"]) @ p["out"]["kernel"]
  probs = f64(jax.nn.softmax(logits))
  exact = np.zeros((2, 3))
  for label in range(3):
    gg, gb = jax.vmap(jax.grad(example_loss, (0, 1)), (None, None, 0, None))(
        p["ln"]["scale"], p["ln"]["bias"], x_hat, label)
    gg, gb = f64(gg), f64(gb)
    w = probs[:, label:label + 1]
    exact += np.stack([(w * gg * gg).sum(0), (w * gg * gb).sum(0),
                       (w * gb * gb).sum(0)], -1) / 5
  check_mc_estimate(stats["ln"]["F"], exact, "F")


def test_scale_and_shift_errors():
  with pytest.raises(ValueError, match="scale"):
    kd.tags.scale_and_shift(jnp.ones((2, 3)), jnp.ones((2,)))
  with pytest.raises(ValueError, match="offset"):
    kd.tags.scale_and_shift(jnp.ones((2, 3)), jnp.ones((3,)), jnp.ones((2,)))


# ---------------------------------------------------------------------------
# 4. Unit-wise preconditioning.
# ---------------------------------------------------------------------------

def test_unitwise_precondition_matches_solve():
  rng = np.random.default_rng(0)
  c, damping = 5, 1e-2
  per_example = rng.normal(size=(7, c, 2))
  blocks = np.einsum("eci,ecj->cij", per_example, per_example) / 7   # PSD 2×2 blocks
  blocks[0] = [[1.0, 1.0], [1.0, 1.0]]                                # singular block
  fisher = np.stack([blocks[:, 0, 0], blocks[:, 0, 1], blocks[:, 1, 1]], -1)
  g = rng.normal(size=(c, 2))
  v_gamma, v_beta = linalg.unitwise_precondition(
      jnp.asarray(g[:, 0]), jnp.asarray(g[:, 1]), jnp.asarray(fisher), damping)
  expected = np.linalg.solve(blocks + damping * np.eye(2), g[..., None])[..., 0]
  np.testing.assert_allclose(f64(v_gamma), expected[:, 0], rtol=1e-10)
  np.testing.assert_allclose(f64(v_beta), expected[:, 1], rtol=1e-10)
  # The whole layer: (F_unitBN + λI)⁻¹ on w = (γ_1, β_1, ..., γ_C, β_C), Eq. 14-15.
  full = np.zeros((2 * c, 2 * c))
  for i in range(c):
    full[2 * i:2 * i + 2, 2 * i:2 * i + 2] = blocks[i]
  w = np.linalg.solve(full + damping * np.eye(2 * c), g.reshape(-1))
  np.testing.assert_allclose(np.stack([f64(v_gamma), f64(v_beta)], -1).reshape(-1), w,
                             rtol=1e-10)
  # float32 inputs: float32 results, computed in float32 at least.
  v32, _ = linalg.unitwise_precondition(jnp.asarray(g[:, 0], jnp.float32),
                                           jnp.asarray(g[:, 1], jnp.float32),
                                           jnp.asarray(fisher, jnp.float32), damping)
  assert v32.dtype == jnp.float32
  np.testing.assert_allclose(f64(v32), expected[:, 0], rtol=1e-3)
  # Scale only: F's γβ, ββ are zero (factors.unitwise_fisher without offset).
  only, none = linalg.unitwise_precondition(
      jnp.asarray(g[:, 0]), None, jnp.asarray(fisher * [1, 0, 0]), damping)
  assert none is None
  np.testing.assert_allclose(f64(only), g[:, 0] / (fisher[:, 0] + damping), rtol=1e-10)


# ---------------------------------------------------------------------------
# 5. Drop-in Flax layers.
# ---------------------------------------------------------------------------

# Fresh Variables on merging: NNX refuses to mutate BatchStats created outside
# the trace of jax.grad / kd.value_and_grad, with its own BatchNorm as with ours.
MERGE_COPY = ({"copy": True} if "copy" in inspect.signature(nnx.merge).parameters
              else {})


def _captured(apply, params):
  """`apply(params)` as a capture computes it: the tagged layers' own
  computation (outside one, the drop-ins are Flax's code)."""
  def loss(p):
    out = apply(p)
    y = jax.tree.leaves(out)[0]
    y = jnp.reshape(y, (-1, y.shape[-1])).astype(jnp.float32)
    return kd.losses.squared_error(y, jnp.zeros_like(y)), out
  (_, out), _, _ = kd.value_and_grad(loss, has_aux=True)(params)
  return out


def _check_outputs(apply, theirs, params, tagged: bool, exact: bool) -> None:
  """Flax's outputs, bit for bit outside a capture where the drop-in runs
  Flax's code there (`exact`: the normalisations); inside one (`tagged`: a
  tagged layer's computation) equal to rounding."""
  outside = np.testing.assert_array_equal if exact else functools.partial(
      np.testing.assert_allclose, rtol=2e-6, atol=2e-6)
  jax.tree.map(outside, apply(params), theirs)
  if tagged:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6),
                 _captured(apply, params), theirs)


def _linen_pair(kd_cls, flax_cls, kwargs, x, call=None, mutable=False, tagged=True):
  """Same variables at init, same outputs (and batch_stats) on random ones."""
  call = call or {}
  flax_vars = flax_cls(**kwargs).init(jax.random.PRNGKey(1), x, **call)
  kd_vars = kd_cls(**kwargs).init(jax.random.PRNGKey(1), x, **call)
  assert _shapes(kd_vars) == _shapes(flax_vars)
  assert_trees_equal(kd_vars, flax_vars)
  flax_vars = dict(flax_vars)
  if "params" in flax_vars:
    flax_vars["params"] = _randomized(flax_vars["params"])
  mut = ["batch_stats"] if mutable else False
  theirs = flax_cls(**kwargs).apply(flax_vars, x, mutable=mut, **call)
  ours = lambda params: kd_cls(**kwargs).apply(dict(flax_vars, params=params), x,
                                               mutable=mut, **call)
  _check_outputs(ours, theirs, flax_vars.get("params", {}),
                 tagged and "params" in flax_vars, kd_cls.__name__.endswith("Norm"))


@pytest.mark.parametrize("kwargs,shape", [
    (dict(features=(2, 3)), (2, 5, 4)),
    (dict(features=3, axis=(-2, -1)), (2, 5, 2, 3)),
    (dict(features=(2, 2), axis=(-1, -2), use_bias=False), (2, 3, 4)),
    (dict(features=4), (3, 5)),
])
def test_linen_dense_general_drop_in(kwargs, shape):
  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  _linen_pair(kd.linen.DenseGeneral, nn.DenseGeneral, kwargs, x)


@pytest.mark.parametrize("kwargs", [dict(features=3, axis=(1, -1)),
                                    dict(features=3, batch_dims=(0,)),
                                    dict(features=3, batch_dims=0)])   # Flax takes an int
def test_linen_dense_general_unusual_passes_through(kwargs):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 2))
  with pytest.warns(UserWarning, match="not tagged"):
    variables = kd.linen.DenseGeneral(**kwargs).init(jax.random.PRNGKey(1), x)
  ref = nn.DenseGeneral(**kwargs).init(jax.random.PRNGKey(1), x)
  assert_trees_equal(variables, ref)
  with pytest.warns(UserWarning, match="not tagged"):
    out = kd.linen.DenseGeneral(**kwargs).apply(ref, x)
  np.testing.assert_allclose(out, nn.DenseGeneral(**kwargs).apply(ref, x), rtol=1e-6)


def test_linen_embed_drop_in():
  ids = jnp.array([[0, 3, 2], [4, 1, 1]])
  _linen_pair(kd.linen.Embed, nn.Embed, dict(num_embeddings=5, features=3), ids)
  with pytest.raises(ValueError, match="integer"):
    kd.linen.Embed(5, 3).init(jax.random.PRNGKey(0), jnp.ones((2,)))


@pytest.mark.parametrize("kernel,equation,call,shape", [
    ((4, 5), "...d,df->...f", {}, (2, 3, 4)),
    ((2, 4, 5), "btnh,nhd->btd", {}, (2, 3, 2, 4)),
    ((4, 2, 3), None, dict(einsum_str="btd,dnh->btnh"), (2, 3, 4)),
])
def test_linen_einsum_drop_in(kernel, equation, call, shape):
  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  for use_bias in (True, False):
    _linen_pair(kd.linen.Einsum, nn.Einsum,
                dict(shape=kernel, einsum_str=equation, use_bias=use_bias), x, call)


@pytest.mark.parametrize("equation,x_ndim,kernel_ndim,want", [
    ("...d,df->...f", 3, 2, (1, None, None, None)),
    ("btnh,nhd->btd", 4, 3, (2, None, None, None)),
    ("x...d,df->x...f", 4, 2, (1, None, None, None)),
    ("btd,ndh->btnh", 3, 3, (1, None, (1, 0, 2), None)),            # Gemma's q
    ("btd,sndh->sbtnh", 3, 4, (1, None, (2, 0, 1, 3), (2, 0, 1, 3, 4))),  # Gemma's kv
    ("bd,df->fb", 2, 2, (1, None, None, (1, 0))),
    ("dbt,fd->tfb", 3, 2, (1, (1, 2, 0), (1, 0), (1, 2, 0))),
    ("bd,bdf->bf", 2, 3, "stack_index"), ("ecd,edf->ecf", 3, 3, "kernel axis 'e'"),
    ("...d,df->f", 3, 2, "not a Dense"),
    ("bd,dfg->bf", 2, 3, "not a Dense"),
    ("bdd,df->bf", 3, 2, "repeated"), ("...d,...df->...f", 3, 3, "ellipsis"),
    ("ab,bc", 2, 2, ""), ("bd,df->bf", 2, 3, ""),
])
def test_einsum_equations_read_as_dense_layers(equation, x_ndim, kernel_ndim, want):
  """A Dense layer's equation gives its `EinsumLayout` (`in_dims`, then the
  input's, kernel's and output's transpositions to and from the tag's order,
  None where none is needed); another a reason; one that jnp.einsum refuses
  "" (Flax's code raises)."""
  got = flax_common.einsum_dense_config(equation, x_ndim, kernel_ndim, custom=False)
  assert got == want if isinstance(want, tuple) or not want else want in got
  assert "custom" in flax_common.einsum_dense_config(equation, x_ndim, kernel_ndim, True)


@pytest.mark.parametrize("equation,x_shape,kernel", [
    ("btd,ndh->btnh", (2, 3, 4), (2, 4, 3)), ("btd,sndh->sbtnh", (2, 3, 4), (2, 2, 4, 3)),
    ("dbt,fd->tfb", (4, 2, 3), (5, 4))])
def test_linen_einsum_permuted_drop_in(equation, x_shape, kernel):
  """Equations whose axes the tag reorders: the same variables and outputs
  as Flax's (the bias: the output's features in its order)."""
  x = jax.random.normal(jax.random.PRNGKey(0), x_shape)
  for use_bias in (True, False):
    _linen_pair(kd.linen.Einsum, nn.Einsum,
                dict(shape=kernel, einsum_str=equation, use_bias=use_bias), x)


@pytest.mark.parametrize("equation,kernel", [("bd,bdf->bf", (2, 3, 5)),
                                             ("btd,df->bf", (4, 3))])
def test_linen_einsum_other_equations_pass_through(equation, kernel):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4)[:len(equation.split(",")[0])])
  ref = nn.Einsum(kernel, equation).init(jax.random.PRNGKey(1), x)
  with pytest.warns(UserWarning, match="Einsum with the equation.*not tagged"):
    variables = kd.linen.Einsum(kernel, equation).init(jax.random.PRNGKey(1), x)
  assert_trees_equal(variables, ref)
  with pytest.warns(UserWarning, match="not tagged"):
    out = kd.linen.Einsum(kernel, equation).apply(ref, x)
  np.testing.assert_allclose(out, nn.Einsum(kernel, equation).apply(ref, x), rtol=1e-6)


@pytest.mark.parametrize("kwargs,shape", [
    (dict(), (2, 5, 4)),
    (dict(use_bias=False, epsilon=1e-3), (3, 4)),
    (dict(reduction_axes=(1, 2)), (2, 3, 4)),
    (dict(use_scale=False, use_bias=False), (2, 4)),
])
def test_linen_layer_norm_drop_in(kwargs, shape):
  x = 2.0 + jax.random.normal(jax.random.PRNGKey(0), shape)
  _linen_pair(kd.linen.LayerNorm, nn.LayerNorm, kwargs, x)
  if kwargs.get("use_scale", True):
    mask = jnp.arange(x.shape[-1]) % 3 != 1
    _linen_pair(kd.linen.LayerNorm, nn.LayerNorm, kwargs, x, dict(mask=mask))


@pytest.mark.parametrize("kwargs,call", [
    (dict(), dict(use_running_average=False)),
    (dict(momentum=0.8, use_fast_variance=False), dict(use_running_average=False)),
    (dict(use_running_average=True), {}),
    (dict(use_bias=False), dict(use_running_average=False)),
    (dict(), dict(use_running_average=False,
                  mask=jnp.array([True, False, True, True])[:, None, None, None])),
])
def test_linen_batch_norm_drop_in(kwargs, call):
  x = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (4, 3, 3, 2))
  _linen_pair(kd.linen.BatchNorm, nn.BatchNorm, kwargs, x, call, mutable=True)


@pytest.mark.parametrize("name,kwargs,shape", [
    ("GroupNorm", dict(num_groups=2), (2, 3, 3, 4)),
    ("GroupNorm", dict(num_groups=None, group_size=1, use_bias=False), (2, 3, 3, 4)),
    ("GroupNorm", dict(num_groups=2, reduction_axes=(-1,)), (2, 5, 4)),
    ("GroupNorm", dict(num_groups=1, use_fast_variance=False, epsilon=1e-3), (3, 4)),
    ("InstanceNorm", dict(), (2, 3, 3, 4)),
    ("InstanceNorm", dict(use_bias=False, use_fast_variance=False), (2, 5, 4)),
])
def test_linen_group_and_instance_norm_drop_in(name, kwargs, shape):
  x = 2.0 + jax.random.normal(jax.random.PRNGKey(0), shape)
  ours, theirs = getattr(kd.linen, name), getattr(nn, name)
  _linen_pair(ours, theirs, kwargs, x)
  mask = jnp.arange(x.size).reshape(x.shape) % 5 != 1
  _linen_pair(ours, theirs, kwargs, x, dict(mask=mask))


def test_linen_group_norm_refuses_what_flax_refuses():
  x = jnp.ones((2, 3, 4))
  for kwargs in (dict(num_groups=3), dict(num_groups=2, group_size=2),
                 dict(num_groups=2, reduction_axes=(1,))):
    with pytest.raises(ValueError) as theirs:
      nn.GroupNorm(**kwargs).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError) as ours:
      kd.linen.GroupNorm(**kwargs).init(jax.random.PRNGKey(0), x)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("cls,kwargs", [
    (nn.LayerNorm, dict(use_scale=False)),
    (nn.LayerNorm, dict(feature_axes=-2, reduction_axes=-2)),
    (nn.BatchNorm, dict(use_running_average=False, axis=1)),
    (nn.BatchNorm, dict(use_running_average=False, force_float32_reductions=False)),
    (nn.GroupNorm, dict(num_groups=2, use_scale=False)),
    (nn.InstanceNorm, dict(feature_axes=1)),
])
def test_linen_norm_unusual_passes_through(cls, kwargs):
  ours_cls = getattr(kd.linen, cls.__name__)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 2))
  ref = cls(**kwargs).init(jax.random.PRNGKey(1), x)
  with pytest.warns(UserWarning, match="not tagged"):
    variables = ours_cls(**kwargs).init(jax.random.PRNGKey(1), x)
  assert_trees_equal(variables, ref)
  with pytest.warns(UserWarning, match="not tagged"):
    out = ours_cls(**kwargs).apply(ref, x, mutable=["batch_stats"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               out, cls(**kwargs).apply(ref, x, mutable=["batch_stats"]))


def _nnx_check(kd_cls, flax_cls, args, kwargs, x, call=None, tagged=True):
  call = call or {}
  ours = kd_cls(*args, **kwargs, rngs=nnx.Rngs(1))
  theirs = flax_cls(*args, **kwargs, rngs=nnx.Rngs(1))
  assert _shapes(nnx.state(ours)) == _shapes(nnx.state(theirs))
  assert_trees_equal(nnx.state(ours), nnx.state(theirs))
  nnx.update(theirs, _randomized(nnx.state(theirs, nnx.Param)))
  nnx.update(ours, nnx.state(theirs))
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
  with warnings.catch_warnings():     # NNX's f64 -> f32 BatchStat update under x64
    warnings.simplefilter("ignore", FutureWarning)
    _check_outputs(lambda p: nnx.merge(graphdef, p, rest, **MERGE_COPY)(x, **call),
                   theirs(x, **call), params, tagged, kd_cls.__name__.endswith("Norm"))
    ours(x, **call)
  assert_trees_equal(nnx.state(ours), nnx.state(theirs), rtol=1e-6)   # batch stats
  # Parameter dtypes (flax 0.12.0's own BatchStat update promotes to float64
  # under x64; later versions keep float32, as we do).
  dtypes = [jax.tree_util.tree_flatten_with_path(jax.tree.map(
      lambda v: v.dtype, nnx.state(m, nnx.Param)))[0] for m in (ours, theirs)]
  assert dtypes[0] == dtypes[1]


@pytest.mark.parametrize("args,kwargs,shape", [
    ((4, (2, 3)), {}, (2, 5, 4)),
    (((2, 3), 4), dict(axis=(-2, -1)), (2, 5, 2, 3)),
    ((3, 2), dict(use_bias=False), (4, 3)),
])
def test_nnx_linear_general_drop_in(args, kwargs, shape):
  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  _nnx_check(kd.nnx.LinearGeneral, nnx.LinearGeneral, args, kwargs, x)


def test_nnx_embed_layer_norm_batch_norm_drop_in():
  ids = jnp.array([[0, 3, 2], [4, 1, 1]])
  _nnx_check(kd.nnx.Embed, nnx.Embed, (5, 3), {}, ids)
  x = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (4, 3, 2))
  _nnx_check(kd.nnx.LayerNorm, nnx.LayerNorm, (2,), {}, x)
  _nnx_check(kd.nnx.LayerNorm, nnx.LayerNorm, (2,), dict(use_bias=False), x)
  for call in (dict(use_running_average=False), dict(use_running_average=True)):
    _nnx_check(kd.nnx.BatchNorm, nnx.BatchNorm, (2,), dict(momentum=0.7), x, call)
  with pytest.warns(UserWarning, match="not tagged"):
    _nnx_check(kd.nnx.BatchNorm, nnx.BatchNorm, (2,), dict(use_scale=False), x,
               dict(use_running_average=False), tagged=False)


def test_nnx_einsum_drop_in():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4))
  _nnx_check(kd.nnx.Einsum, nnx.Einsum, ("btd,dnh->btnh", (4, 2, 3), (2, 3)), {}, x)
  _nnx_check(kd.nnx.Einsum, nnx.Einsum, ("...d,df->...f", (4, 5)), {}, x)
  # NNX takes any bias shape that broadcasts; only the kernel's output axes are a
  # Dense layer's bias.
  with pytest.warns(UserWarning, match="Einsum with a bias of shape.*not tagged"):
    _nnx_check(kd.nnx.Einsum, nnx.Einsum, ("...d,df->...f", (4, 5), (1, 5)), {}, x,
               tagged=False)
  # Gemma's equations (the tag reorders the axes): bias of the output's features.
  _nnx_check(kd.nnx.Einsum, nnx.Einsum, ("btd,ndh->btnh", (2, 4, 3), (2, 3)), {}, x)
  _nnx_check(kd.nnx.Einsum, nnx.Einsum, ("btd,sndh->sbtnh", (2, 2, 4, 3), (2, 2, 3)),
             {}, x)
  with pytest.warns(UserWarning, match="Einsum with the equation.*not tagged"):
    _nnx_check(kd.nnx.Einsum, nnx.Einsum, ("bd,bdf->bf", (2, 4, 5)), {}, x[:, 0],
               tagged=False)


def test_nnx_einsum_with_an_output_sharding_says_so():
  """An `nnx.Einsum` called with `out_sharding` (Gemma's sharding configs) is
  left to NNX with that reason, not a custom einsum's."""
  from kfac_jax_dist.flax import nnx as nnx_layers     # pylint: disable=import-outside-toplevel
  module = nnx.Einsum("btd,dnh->btnh", (4, 2, 3), rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match="Einsum with an output sharding .out_sharding. "
                                       "is not tagged"):
    assert nnx_layers.einsum(module, jnp.ones((2, 3, 4)), None, object(),
                             lambda: "NNX's own") == "NNX's own"


def test_nnx_group_and_instance_norm_drop_in():
  x = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (4, 3, 2, 4))
  _nnx_check(kd.nnx.GroupNorm, nnx.GroupNorm, (4,), dict(num_groups=2), x)
  _nnx_check(kd.nnx.GroupNorm, nnx.GroupNorm, (4,),
             dict(num_groups=None, group_size=1, use_bias=False), x,
             dict(mask=jnp.arange(x.size).reshape(x.shape) % 5 != 1))
  _nnx_check(kd.nnx.InstanceNorm, nnx.InstanceNorm, (4,), dict(epsilon=1e-3), x)
  # NNX repeats the groups' statistics along axis 1: where that is not the
  # channels' last axis left, its own code runs, untagged.
  with pytest.warns(UserWarning, match="GroupNorm with reduction axes.*not tagged"):
    _nnx_check(kd.nnx.GroupNorm, nnx.GroupNorm, (4,),
               dict(num_groups=2, reduction_axes=(-1,)), x[:, 0], tagged=False)
  with pytest.warns(UserWarning, match="InstanceNorm with feature axes.*not tagged"):
    _nnx_check(kd.nnx.InstanceNorm, nnx.InstanceNorm, (2,), dict(feature_axes=2), x,
               tagged=False)


# ---------------------------------------------------------------------------
# 6. linen, NNX and plain tags agree with each other and with brute force.
# ---------------------------------------------------------------------------

V, D, H, K, CLASSES = 6, 4, 2, 3, 5


class LinenTiny(nn.Module):
  """ids → Embed → LayerNorm → DenseGeneral(d→h,k) → tanh → DenseGeneral(h,k→d)
  → tanh → Dense: per-token logits (tokens are independent)."""

  @nn.compact
  def __call__(self, ids):
    kw = dict(param_dtype=jnp.float64)
    h = kd.linen.Embed(V, D, **kw)(ids)
    h = kd.linen.LayerNorm(**kw)(h)
    h = jnp.tanh(kd.linen.DenseGeneral((H, K), precision=HIGHEST, **kw)(h))
    h = jnp.tanh(kd.linen.DenseGeneral(D, axis=(-2, -1), precision=HIGHEST, **kw)(h))
    return kd.linen.Dense(CLASSES, use_bias=False, precision=HIGHEST, **kw)(h)


class NnxTiny(nnx.Module):
  def __init__(self, rngs):
    kw = dict(param_dtype=jnp.float64, rngs=rngs)
    self.emb = kd.nnx.Embed(V, D, **kw)
    self.ln = kd.nnx.LayerNorm(D, **kw)
    self.q = kd.nnx.LinearGeneral(D, (H, K), precision=HIGHEST, **kw)
    self.o = kd.nnx.LinearGeneral((H, K), D, axis=(-2, -1), precision=HIGHEST, **kw)
    self.out = kd.nnx.Linear(D, CLASSES, use_bias=False, precision=HIGHEST, **kw)

  def __call__(self, ids):
    h = self.ln(self.emb(ids))
    h = jnp.tanh(self.q(h))
    return self.out(jnp.tanh(self.o(h)))


def plain_tiny(p, ids):
  h = kd.tags.embed(ids, p["emb"]["embedding"])
  h = kd.tags.scale_and_shift(layer_norm(h), p["ln"]["scale"], p["ln"]["bias"])
  h = jnp.tanh(kd.tags.dense_general(h, p["q"]["kernel"], p["q"]["bias"],
                                     precision=HIGHEST))
  h = jnp.tanh(kd.tags.dense_general(h, p["o"]["kernel"], p["o"]["bias"], in_dims=2,
                                     precision=HIGHEST))
  return kd.tags.dense(h, p["out"]["kernel"], precision=HIGHEST)


def test_tiny_transformer_linen_nnx_plain_agree():
  ki, ky = jax.random.split(jax.random.PRNGKey(5))
  ids = jax.random.randint(ki, (2, 4), 0, V)
  y = jax.random.randint(ky, (2, 4), 0, CLASSES)
  linen_params = _randomized(LinenTiny().init(jax.random.PRNGKey(6), ids)["params"])
  names = {"emb": "Embed_0", "ln": "LayerNorm_0", "q": "DenseGeneral_0",
           "o": "DenseGeneral_1", "out": "Dense_0"}
  plain = {k: linen_params[v] for k, v in names.items()}
  model = NnxTiny(nnx.Rngs(0))
  nnx.update(model, plain)
  graphdef, nnx_params = nnx.split(model)

  losses = {
      "linen": (lambda p, ids, y: kd.losses.softmax_cross_entropy(
          LinenTiny().apply({"params": p}, ids), y), linen_params, names),
      "nnx": (lambda p, ids, y: kd.losses.softmax_cross_entropy(
          nnx.merge(graphdef, p)(ids), y), nnx_params, {k: k for k in names}),
      "plain": (lambda p, ids, y: kd.losses.softmax_cross_entropy(plain_tiny(p, ids), y),
                plain, {k: k for k in names}),
  }
  # Discovery records.
  layers = kd.value_and_grad(losses["linen"][0]).discover(linen_params, ids, y)
  records = {l.name: l for l in layers}
  assert list(records) == list(names.values())
  emb, ln, q, o = (records[names[k]] for k in ("emb", "ln", "q", "o"))
  assert (emb.kind, emb.kernel_path, emb.bias_path, emb.kernel_shape, emb.a_dim,
          emb.g_dim, emb.a_diagonal) == ("embed", "Embed_0/embedding", None, (V, D), V,
                                         D, True)
  assert (ln.kind, ln.kernel_path, ln.bias_path, ln.a_dim, ln.g_dim) == (
      "scale_and_shift", "LayerNorm_0/scale", "LayerNorm_0/bias", 2, D)
  assert (q.kind, q.kernel_shape, q.a_dim, q.g_dim, q.bias_shape) == (
      "dense", (D, H, K), D + 1, H * K, (H, K))
  assert (o.kind, o.kernel_shape, o.a_dim, o.g_dim, o.bias_shape) == (
      "dense", (H, K, D), H * K + 1, D, (D,))
  nnx_layers = kd.value_and_grad(losses["nnx"][0]).discover(nnx_params, ids, y)
  assert nnx_layers.names() == tuple(names)
  assert nnx_layers.layers[0].kernel_path == "emb/embedding"

  # Brute force on the plain parameters.
  def forward(e):
    rec = {}
    h = plain["emb"]["embedding"][ids] + e["emb"]
    rec["ln"] = layer_norm(h)
    h = rec["ln"] * plain["ln"]["scale"] + plain["ln"]["bias"] + e["ln"]
    rec["q"] = h
    h = jnp.einsum("btd,dhk->bthk", h, plain["q"]["kernel"], precision=HIGHEST)
    h = jnp.tanh(h + plain["q"]["bias"] + e["q"])
    rec["o"] = h
    h = jnp.einsum("bthk,hkd->btd", h, plain["o"]["kernel"], precision=HIGHEST)
    h = jnp.tanh(h + plain["o"]["bias"] + e["o"])
    rec["out"] = h
    return h @ plain["out"]["kernel"] + e["out"], rec

  eps0 = {"emb": jnp.zeros((2, 4, D)), "ln": jnp.zeros((2, 4, D)),
          "q": jnp.zeros((2, 4, H, K)), "o": jnp.zeros((2, 4, D)),
          "out": jnp.zeros((2, 4, CLASSES))}
  _, rec = forward(eps0)
  g = output_gradients(lambda e: forward(e)[0], eps0, lambda out: ce_per_example(out, y))
  n = 8
  expected = {"emb": embed_stats(ids, V, g["emb"], n),
              "ln": unitwise_stats(rec["ln"], g["ln"], n),
              "q": dense_stats(rec["q"], g["q"].reshape(2, 4, H * K), n, True),
              "o": dense_stats(rec["o"].reshape(2, 4, H * K), g["o"], n, True),
              "out": dense_stats(rec["out"], g["out"], n, False)}

  results = {}
  for key, (fn, p, key_names) in losses.items():
    loss, grads, stats = capture(fn)(p, ids, y)
    assert_trees_equal(grads, jax.jit(jax.grad(fn))(p, ids, y))
    check_stats(stats, expected, key_names)
    results[key] = (loss, stats)
  for key, (loss, stats) in results.items():
    np.testing.assert_allclose(float(loss), float(results["plain"][0]), rtol=1e-12)
    for layer, name in losses[key][2].items():
      for stat, value in stats[name].items():
        np.testing.assert_allclose(f64(value), f64(results["plain"][1][layer][stat]),
                                   rtol=1e-6, atol=1e-7)


class LinenBN(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    h = kd.linen.BatchNorm(use_running_average=not train, param_dtype=jnp.float64)(x)
    return kd.linen.Dense(3, use_bias=False, param_dtype=jnp.float64,
                          precision=HIGHEST)(jnp.tanh(h).mean((1, 2)))


class NnxBN(nnx.Module):
  def __init__(self, rngs):
    self.bn = kd.nnx.BatchNorm(2, use_running_average=False, param_dtype=jnp.float64,
                               rngs=rngs)
    self.out = kd.nnx.Linear(2, 3, use_bias=False, param_dtype=jnp.float64,
                             precision=HIGHEST, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.bn(x)).mean((1, 2)))


def test_batch_norm_linen_nnx_plain_agree():
  """BatchNorm in training mode couples the examples through the batch
  statistics; the per-example gradients are still g_p = Σ_e ∂ℓ_e/∂y_p at the
  output, summed per image (SP-NGD's per-sample γ/β gradients)."""
  kx, ky = jax.random.split(jax.random.PRNGKey(7))
  x = 0.5 + randn(kx, (4, 3, 2, 2))
  y = jax.random.randint(ky, (4,), 0, 3)
  variables = LinenBN().init(jax.random.PRNGKey(8), x)
  params = _randomized(variables["params"])
  plain = {"bn": params["BatchNorm_0"], "out": params["Dense_0"]}
  model = NnxBN(nnx.Rngs(0))
  nnx.update(model, plain)
  graphdef, nnx_params, nnx_stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def x_hat_of(x):
    mean = x.mean((0, 1, 2))
    var = jnp.maximum((x * x).mean((0, 1, 2)) - mean * mean, 0.0)
    return (x - mean) * lax.rsqrt(var + 1e-5)

  def linen_loss(p, x, y, batch_stats):
    logits, updates = LinenBN().apply({"params": p, "batch_stats": batch_stats},
                                      x, mutable=["batch_stats"])
    return kd.losses.softmax_cross_entropy(logits, y), updates

  def nnx_loss(p, x, y, batch_stats):
    # Fresh Variables (copy=True): NNX refuses to mutate BatchStats created
    # outside the trace of jax.grad / kd.value_and_grad, with its own
    # BatchNorm as with ours.
    model = nnx.merge(graphdef, p, batch_stats, **MERGE_COPY)
    loss = kd.losses.softmax_cross_entropy(model(x), y)
    return loss, nnx.state(model, nnx.BatchStat)

  def plain_loss(p, x, y, batch_stats):
    del batch_stats
    h = kd.tags.scale_and_shift(x_hat_of(x), p["bn"]["scale"], p["bn"]["bias"],
                                example_dims=1)
    logits = kd.tags.dense(jnp.tanh(h).mean((1, 2)), p["out"]["kernel"], precision=HIGHEST)
    return kd.losses.softmax_cross_entropy(logits, y), None

  def forward(e):
    h = x_hat_of(x) * plain["bn"]["scale"] + plain["bn"]["bias"] + e["bn"]
    return jnp.tanh(h).mean((1, 2)) @ plain["out"]["kernel"] + e["out"]

  eps0 = {"bn": jnp.zeros(x.shape), "out": jnp.zeros((4, 3))}
  g = output_gradients(forward, eps0, lambda out: ce_per_example(out, y))
  rows = jnp.tanh(x_hat_of(x) * plain["bn"]["scale"] + plain["bn"]["bias"]).mean((1, 2))
  expected = {"bn": unitwise_stats(x_hat_of(x), g["bn"], 4, example_dims=1),
              "out": dense_stats(rows, g["out"], 4, False)}
  layer_names = {"linen": {"bn": "BatchNorm_0", "out": "Dense_0"},
                 "nnx": {"bn": "bn", "out": "out"}, "plain": {"bn": "bn", "out": "out"}}
  _, ref = nn.BatchNorm(use_running_average=False).apply(
      {"params": params["BatchNorm_0"],
       "batch_stats": variables["batch_stats"]["BatchNorm_0"]}, x, mutable=["batch_stats"])
  for key, fn, p, bs in (("linen", linen_loss, params, variables["batch_stats"]),
                         ("nnx", nnx_loss, nnx_params, nnx_stats),
                         ("plain", plain_loss, plain, None)):
    grad_fn = kd.value_and_grad(fn, has_aux=True)
    layers = grad_fn.discover(p, x, y, bs)
    bn = layers.layers[0]
    assert (bn.name, bn.kind, bn.a_dim, bn.g_dim) == (layer_names[key]["bn"],
                                                      "scale_and_shift", 2, 2)
    (_, aux), grads, stats = jax.jit(grad_fn)(p, x, y, bs)
    assert_trees_equal(grads, jax.jit(jax.grad(fn, has_aux=True))(p, x, y, bs)[0])
    check_stats(stats, expected, layer_names[key])
    # The running statistics are updated as Flax does.
    if key == "linen":
      assert_trees_equal(aux["batch_stats"]["BatchNorm_0"], ref["batch_stats"], rtol=1e-6)
    elif key == "nnx":
      assert_trees_equal(nnx.to_pure_dict(aux)["bn"], ref["batch_stats"], rtol=1e-6)


def _group_norm_hat(x, groups, eps=1e-6):
  """GroupNorm's `x̂` over an image's positions and each group's channels."""
  grouped = x.reshape(x.shape[:-1] + (groups, -1))
  mean = grouped.mean((1, 2, 4), keepdims=True)
  var = jnp.maximum((grouped * grouped).mean((1, 2, 4), keepdims=True) - mean * mean, 0.0)
  return ((grouped - mean) * lax.rsqrt(var + eps)).reshape(x.shape)


def _linen_group_model(lib):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(lib.GroupNorm(num_groups=2, param_dtype=jnp.float64)(x))
      h = jnp.tanh(lib.InstanceNorm(param_dtype=jnp.float64)(h))
      return kd.linen.Dense(3, param_dtype=jnp.float64, precision=HIGHEST)(h.mean((1, 2)))
  return Model()


class NnxGroupModel(nnx.Module):
  def __init__(self, lib, rngs):
    self.gn = lib.GroupNorm(4, num_groups=2, param_dtype=jnp.float64, rngs=rngs)
    self.inorm = lib.InstanceNorm(4, param_dtype=jnp.float64, rngs=rngs)
    self.out = kd.nnx.Linear(4, 3, param_dtype=jnp.float64, precision=HIGHEST, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.inorm(jnp.tanh(self.gn(x))))
    return self.out(h.mean((1, 2)))


def test_group_and_instance_norm_linen_nnx_plain_intercepted_agree():
  """GroupNorm (Wu & He 2018) and InstanceNorm normalise each image on its own;
  their scale and bias get SP-NGD's unit-wise Fisher with an image as the
  example (`example_dims=1`), from `x̂` and the output gradients, as
  BatchNorm's do; the tagged layers and the intercepted Flax ones agree."""
  kx, ky = jax.random.split(jax.random.PRNGKey(9))
  x = 0.5 + randn(kx, (4, 3, 2, 4))
  y = jax.random.randint(ky, (4,), 0, 3)
  params = _randomized(_linen_group_model(kd.linen).init(jax.random.PRNGKey(8), x)["params"])
  plain = {"gn": params["GroupNorm_0"], "in": params["InstanceNorm_0"],
           "out": params["Dense_0"]}
  in_hat = lambda h: _group_norm_hat(h, 4)             # a group per channel

  def plain_loss(p, x, y):
    h = jnp.tanh(kd.tags.scale_and_shift(_group_norm_hat(x, 2), p["gn"]["scale"],
                                         p["gn"]["bias"], example_dims=1))
    h = jnp.tanh(kd.tags.scale_and_shift(in_hat(h), p["in"]["scale"], p["in"]["bias"],
                                         example_dims=1))
    logits = kd.tags.dense(h.mean((1, 2)), p["out"]["kernel"], p["out"]["bias"],
                           precision=HIGHEST)
    return kd.losses.softmax_cross_entropy(logits, y)

  def hidden(e):
    h = jnp.tanh(_group_norm_hat(x, 2) * plain["gn"]["scale"] + plain["gn"]["bias"]
                 + e["gn"])
    return h, jnp.tanh(in_hat(h) * plain["in"]["scale"] + plain["in"]["bias"] + e["in"])

  def forward(e):
    return (hidden(e)[1].mean((1, 2)) @ plain["out"]["kernel"] + plain["out"]["bias"]
            + e["out"])

  eps0 = {"gn": jnp.zeros(x.shape), "in": jnp.zeros(x.shape), "out": jnp.zeros((4, 3))}
  g = output_gradients(forward, eps0, lambda out: ce_per_example(out, y))
  h1, h2 = hidden(jax.tree.map(jnp.zeros_like, eps0))
  expected = {"gn": unitwise_stats(_group_norm_hat(x, 2), g["gn"], 4, example_dims=1),
              "in": unitwise_stats(in_hat(h1), g["in"], 4, example_dims=1),
              "out": dense_stats(h2.mean((1, 2)), g["out"], 4, True)}

  def linen_loss(lib):
    model = _linen_group_model(lib)
    return lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)

  def nnx_case(lib):
    model = NnxGroupModel(lib, nnx.Rngs(0))
    nnx.update(model, {"gn": plain["gn"], "inorm": plain["in"], "out": plain["out"]})
    graphdef, state = nnx.split(model, nnx.Param)
    return state, lambda p, x, y: kd.losses.softmax_cross_entropy(
        nnx.merge(graphdef, p)(x), y)

  linen_names = {"gn": "GroupNorm_0", "in": "InstanceNorm_0", "out": "Dense_0"}
  nnx_names = {"gn": "gn", "in": "inorm", "out": "out"}
  cases = [("plain", plain, plain_loss, "tags", {k: k for k in expected}),
           ("linen", params, linen_loss(kd.linen), "tags", linen_names),
           ("linen intercepted", params, linen_loss(nn), "flax", linen_names),
           ("nnx", *nnx_case(kd.nnx), "tags", nnx_names),
           ("nnx intercepted", *nnx_case(nnx), "flax", nnx_names)]
  for case, p, fn, how, names in cases:
    grad_fn = kd.value_and_grad(fn, capture=how)
    layers = grad_fn.discover(p, x, y)
    assert [(l.name, l.kind) for l in layers.layers] == [
        (names["gn"], "scale_and_shift"), (names["in"], "scale_and_shift"),
        (names["out"], "dense")], case
    assert not layers.uncaptured, case
    _, grads, stats = jax.jit(grad_fn)(p, x, y)
    assert_trees_equal(grads, jax.jit(jax.grad(fn))(p, x, y))
    check_stats(stats, expected, names)


# ---------------------------------------------------------------------------
# 7. With the optimizer: new layers skipped, DenseGeneral preconditioned.
# ---------------------------------------------------------------------------

def test_kfac_step_dense_general_equals_flattened_dense_and_skips_new_layers():
  """`kd.kfac` preconditions a DenseGeneral (kind "dense") exactly like the
  Dense layer on the flattened view; embeddings and scale-and-shift layers,
  which it cannot precondition yet, are left out with `skip=`."""
  ks = jax.random.split(jax.random.PRNGKey(9), 6)
  p = {"emb": {"embedding": randn(ks[0], (V, D))},
       "ln": {"scale": 1.0 + randn(ks[1], (D,), 0.2)},
       "q": {"kernel": randn(ks[2], (D, H, K), 0.5)},
       "o": {"kernel": randn(ks[3], (H, K, CLASSES), 0.5),
             "bias": randn(ks[4], (CLASSES,), 0.5)}}
  ids = jax.random.randint(ks[5], (3, 4), 0, V)
  y = jnp.arange(12).reshape(3, 4) % CLASSES

  def general(p, ids, y):
    h = kd.tags.scale_and_shift(layer_norm(kd.tags.embed(ids, p["emb"]["embedding"])),
                                p["ln"]["scale"])
    h = jnp.tanh(kd.tags.dense_general(h, p["q"]["kernel"], precision=HIGHEST))
    logits = kd.tags.dense_general(h, p["o"]["kernel"], p["o"]["bias"], in_dims=2,
                                   precision=HIGHEST)
    return kd.losses.softmax_cross_entropy(logits, y)

  def flat(p, ids, y):
    h = layer_norm(p["emb"]["embedding"][ids]) * p["ln"]["scale"]
    h = jnp.tanh(kd.tags.dense(h, p["q"]["kernel"], precision=HIGHEST))
    logits = kd.tags.dense(h, p["o"]["kernel"], p["o"]["bias"], precision=HIGHEST)
    return kd.losses.softmax_cross_entropy(logits, y)

  flat_p = {"emb": p["emb"], "ln": p["ln"],
            "q": {"kernel": p["q"]["kernel"].reshape(D, H * K)},
            "o": {"kernel": p["o"]["kernel"].reshape(H * K, CLASSES), "bias": p["o"]["bias"]}}
  updates = {}
  for key, fn, params, skip in (("general", general, p, ("emb", "ln")),
                                ("flat", flat, flat_p, ())):
    grad_fn = kd.value_and_grad(fn)
    tx = kd.kfac(0.1, momentum=0.0, damping=1e-2, kl_clip=None, skip=skip,
                 layers=grad_fn.discover(params, ids, y))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      _, grads, stats = grad_fn(params, ids, y, opt_state=state)
      return tx.update(grads, state, params, kfac_stats=stats)[0], stats

    updates[key], stats = step(params, state)
    assert set(stats) == {"q", "o"}
  general_u, flat_u = updates["general"], updates["flat"]
  for name in ("emb", "ln"):       # passed through: plain -lr·gradient in both
    assert_trees_equal(general_u[name], flat_u[name], rtol=1e-9)
  np.testing.assert_allclose(f64(general_u["q"]["kernel"]).reshape(D, H * K),
                             f64(flat_u["q"]["kernel"]), rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(f64(general_u["o"]["kernel"]).reshape(H * K, CLASSES),
                             f64(flat_u["o"]["kernel"]), rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(f64(general_u["o"]["bias"]), f64(flat_u["o"]["bias"]),
                             rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"])
def test_nnx_norm_narrower_dtype_than_its_parameters(norm):
  """An NNX normalisation with `dtype=bfloat16` and float32 parameters
  (non-trivial scale and bias), captured: its outputs and gradients are NNX's
  own (a flax whose norms have `promote_dtype`, 0.12.8 and 0.12.12: the
  parameters rounded to bfloat16 before the float32 arithmetic, as NNX's
  promotion does; they differed by one bfloat16 ulp in ~30% of the entries;
  flax 0.12.0: nothing rounded before the result)."""
  init = nnx.initializers.normal(1.0)
  options = dict(dtype=jnp.bfloat16, scale_init=init, rngs=nnx.Rngs(0))
  if norm != "RMSNorm":
    options["bias_init"] = init
  make = {"LayerNorm": lambda: nnx.LayerNorm(6, **options),
          "RMSNorm": lambda: nnx.RMSNorm(6, **options),
          "GroupNorm": lambda: nnx.GroupNorm(6, num_groups=2, **options),
          "BatchNorm": lambda: nnx.BatchNorm(6, use_running_average=False, **options)}[norm]

  class Net(nnx.Module):
    def __init__(self):
      self.norm = make()
      self.head = nnx.Linear(6, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
      y = self.norm(x)
      return y, self.head(y.astype(jnp.float32))
  graph, params, rest = nnx.split(Net(), nnx.Param, ...)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 6)) * 2 + 1
  t = jax.random.normal(jax.random.PRNGKey(2), (4, 5, 3))

  def loss(p, x, t):
    y, h = nnx.merge(graph, p, jax.tree.map(lambda v: v, rest))(x)   # (BatchNorm's stats)
    return kd.losses.squared_error(h.reshape(-1, 3), t.reshape(-1, 3)), y
  (_, want), want_grads = jax.value_and_grad(loss, has_aux=True)(params, x, t)
  (_, got), got_grads, _ = kd.value_and_grad(loss, has_aux=True, capture="flax")(params, x, t)
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # (float32 gradients: NNX forms rsqrt(var)·scale first, the tag x̂·scale)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               got_grads, want_grads)
