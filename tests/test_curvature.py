"""Exact curvature products: `ValueAndGrad.gauss_newton_gram` and `.loss`.

The expected Gram matrix is built densely in float64 NumPy, never by the
library's code path:

    C = (1/n) Σ_x w_x J_xᵀ H_x J_x,    G = V C Vᵀ,

with `J` the full Jacobian of the flattened parameters → the registered loss's
input (`jax.jacfwd`), `H_x` written out as a matrix per example (softmax
`diag(p) − p pᵀ`, sigmoid `diag(p(1 − p))`, squared error `I`), `w_x` the
mask and `n = Σ w_x`. A float64 model must meet it to 1e-12 relative, on one
device and, inside `shard_map` over 8 devices with the batch sharded, as the
global batch's.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

F64 = jnp.float64
TOL = 1e-12
BATCH = 16
CLASSES = 3


@pytest.fixture(autouse=True, scope="module")
def _float64():
  with jax.enable_x64(True):
    yield


def assert_close(got, expected, tol: float = TOL) -> None:
  """`max |got − expected| ≤ tol · max |expected|`, in float64."""
  got, expected = helpers.f64(got), helpers.f64(expected)
  assert got.shape == expected.shape, (got.shape, expected.shape)
  error = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
  assert error <= tol, f"relative error {error:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------
# Models: (apply(params, x) -> outputs, params, x).
# ---------------------------------------------------------------------------

def _mlp_tags():
  """Plain `kd.tags` layers on `[B, T, d]` inputs (every position an example)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"h": {"kernel": helpers.randn(keys[0], (4, 6), 0.7),
                  "bias": helpers.randn(keys[1], (6,), 0.3)},
            "out": {"kernel": helpers.randn(keys[2], (6, CLASSES), 0.7),
                    "bias": helpers.randn(keys[3], (CLASSES,), 0.3)}}

  def apply(p: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(kd.tags.dense(x, p["h"]["kernel"], p["h"]["bias"]))
    return kd.tags.dense(h, p["out"]["kernel"], p["out"]["bias"])
  return apply, params, helpers.randn(keys[4], (BATCH, 2, 4))


class _CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(kd.linen.Conv(3, (3, 3), param_dtype=F64)(x))
    x = jnp.tanh(kd.linen.Conv(4, (3, 3), strides=2, param_dtype=F64)(x))
    x = x.reshape(x.shape[0], -1)
    return kd.linen.Dense(CLASSES, param_dtype=F64)(x)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(kd.linen.Dense(5, param_dtype=F64)(h)), None


class _Scanned(nn.Module):
  """Three Dense blocks stacked by `nn.scan` (one stacked parameter leaf)."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(kd.linen.Dense(5, param_dtype=F64)(x))
    h, _ = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=3)()(h, None)
    return kd.linen.Dense(CLASSES, param_dtype=F64)(h)


class _NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.lin = kd.nnx.Linear(4, 4, param_dtype=F64, rngs=rngs)
    self.ln = kd.nnx.LayerNorm(4, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.ln(jnp.tanh(self.lin(x)))


class _NnxScanned(nnx.Module):
  """Two `kd.nnx` blocks (Linear + LayerNorm) made by `nnx.vmap`, run by `nnx.scan`."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> _NnxBlock:
      return _NnxBlock(rngs)

    self.blocks = create(rngs)
    self.out = kd.nnx.Linear(4, CLASSES, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x: jax.Array, block: _NnxBlock) -> jax.Array:
      return block(x)

    return self.out(body(x, self.blocks))


def _nnx_scan():
  graph, params = nnx.split(_NnxScanned(nnx.Rngs(0)), nnx.Param)
  nnx.replace_by_pure_dict(params, helpers.randomized(nnx.to_pure_dict(params), seed=2))

  def apply(p: nnx.State, x: jax.Array) -> jax.Array:
    return nnx.merge(graph, p)(x)
  return apply, params, helpers.randn(jax.random.PRNGKey(1), (BATCH, 4))


def _linen(module: nn.Module, x_shape: tuple[int, ...]):
  kx, kp = jax.random.split(jax.random.PRNGKey(1))
  x = helpers.randn(kx, x_shape)
  params = helpers.randomized(module.init(kp, x), seed=2)
  return module.apply, params, x


MODELS = {
    "mlp_tags": _mlp_tags,
    "cnn_linen": lambda: _linen(_CNN(), (BATCH, 6, 6, 2)),
    "scan_linen": lambda: _linen(_Scanned(), (BATCH, 4)),
    "scan_nnx": _nnx_scan,
}


# ---------------------------------------------------------------------------
# Losses: the library's call, its targets and mask, and H per example.
# ---------------------------------------------------------------------------

def _softmax_h(z: np.ndarray) -> np.ndarray:
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.stack([np.diag(q) - np.outer(q, q) for q in p])


def _sigmoid_h(z: np.ndarray) -> np.ndarray:
  p = 1.0 / (1.0 + np.exp(-z))
  return np.stack([np.diag(q * (1 - q)) for q in p])


def _identity_h(z: np.ndarray) -> np.ndarray:
  return np.broadcast_to(np.eye(z.shape[-1]), (z.shape[0],) + (z.shape[-1],) * 2)


def _gaussian_h(z: np.ndarray) -> np.ndarray:
  """`gaussian_nll(μ = z₀, σ² = softplus(z₁))`'s Fisher in `z`: `diag(1/σ²,
  σ'(z₁)²/(2σ⁴), 0)` (the third output unused)."""
  var = np.log1p(np.exp(z[:, 1]))
  slope = 1.0 / (1.0 + np.exp(-z[:, 1]))
  diagonal = np.stack([1 / var, slope ** 2 / (2 * var ** 2), 0 * var], -1)
  return np.stack([np.diag(d) for d in diagonal])


def _poisson_h(z: np.ndarray) -> np.ndarray:
  return np.stack([np.diag(np.exp(r)) for r in z])


def _gaussian_nll(z, y, mask=None):
  return kd.losses.gaussian_nll(z[..., :1], jax.nn.softplus(z[..., 1:2]), y, mask=mask)


LOSSES = {   # name: (kd loss, hessian, masked)
    "softmax": (kd.losses.softmax_cross_entropy, _softmax_h, False),
    "softmax_masked": (kd.losses.softmax_cross_entropy, _softmax_h, True),
    # target distributions summing to 0 (padding), 1, 1.2, 0.5, ...: H = (Σt)(diag p − ppᵀ)
    "softmax_soft": (kd.losses.softmax_cross_entropy, _softmax_h, True),
    "sigmoid": (kd.losses.sigmoid_cross_entropy, _sigmoid_h, False),
    "squared_error": (kd.losses.squared_error, _identity_h, False),
    "gaussian_masked": (_gaussian_nll, _gaussian_h, True),
    "poisson": (kd.losses.poisson_nll, _poisson_h, False),
}


def _targets(loss: str, example_shape: tuple[int, ...]):
  key = jax.random.PRNGKey(3)
  if loss == "softmax_soft":
    t = jax.random.dirichlet(key, jnp.ones(CLASSES, F64), example_shape)
    sums = jnp.array([0.0, 1.0, 1.2, 0.5, 2.0, 1.0], F64)
    return t * jnp.resize(sums, example_shape)[..., None]
  if loss.startswith("softmax"):
    return jax.random.randint(key, example_shape, 0, CLASSES)
  if loss == "sigmoid":
    return jax.random.uniform(key, example_shape + (CLASSES,), F64)
  if loss == "poisson":
    return jax.random.poisson(key, 2.0, example_shape + (CLASSES,)).astype(F64)
  if loss.startswith("gaussian"):
    return helpers.randn(key, example_shape + (1,))
  return helpers.randn(key, example_shape + (CLASSES,))


def _mask(example_shape: tuple[int, ...]) -> jax.Array:
  """0/1 with the first two examples of the batch dropped: on 8 devices the
  first device's local batch is then empty (n_d = 0)."""
  mask = (jax.random.uniform(jax.random.PRNGKey(4), example_shape) > 0.3).astype(F64)
  return mask.at[:2].set(0.0)


def problem(model: str, loss: str):
  """`(loss_fn, params, batch, vectors, expected gram)`: `loss_fn(params, x, y,
  mask)` and the brute-force `V C Vᵀ` for two random vectors."""
  apply, params, x = MODELS[model]()
  kd_loss, hessian, masked = LOSSES[loss]
  example_shape = jax.eval_shape(apply, params, x).shape[:-1]
  y = _targets(loss, example_shape)
  mask = _mask(example_shape) if masked else jnp.ones(example_shape, F64)

  def loss_fn(p: dict, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    return kd_loss(apply(p, x), y, mask=mask if masked else None)

  flat, unravel = ravel_pytree(params)
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  vectors = tuple(unravel(jax.random.normal(k, flat.shape, F64)) for k in keys)
  scale = np.sum(np.asarray(y), -1) if loss == "softmax_soft" else 1.0
  return loss_fn, params, (x, y, mask), vectors, _brute_gram(
      apply, params, x, mask, hessian, vectors, scale)


def _brute_gram(apply, params, x, mask, hessian, vectors, scale=1.0) -> np.ndarray:
  """`V C Vᵀ`, `C = Σ_x w_x s_x J_xᵀ H_x J_x / Σ_x w_x` (`s_x`: the Hessian's
  scale, a soft target's sum)."""
  flat, unravel = ravel_pytree(params)
  z = np.asarray(apply(params, x), np.float64)
  rows = lambda f: apply(unravel(f), x).reshape(-1, z.shape[-1])
  jac = np.asarray(jax.jit(jax.jacfwd(rows))(flat), np.float64)     # [N, C, P]
  z = z.reshape(-1, z.shape[-1])
  w = np.asarray(mask, np.float64).reshape(-1)
  s = np.broadcast_to(np.asarray(scale, np.float64), np.shape(mask)).reshape(-1)
  curvature = np.einsum("n,ncp,ncd,ndq->pq", w * s, jac, hessian(z), jac) / w.sum()
  v = np.stack([np.asarray(ravel_pytree(u)[0], np.float64) for u in vectors])
  return v @ curvature @ v.T


CASES = [(m, l) for m in MODELS for l in LOSSES]
# By default every loss on the MLP and each other model with one loss (the
# products are the model's jvp and the loss's output Hessian, independent
# parts); the whole product with --slow.
CASES_BY_DEFAULT = [("mlp_tags", l) for l in LOSSES] + [("scan_linen", "softmax_soft"),
    ("cnn_linen", "softmax"), ("cnn_linen", "squared_error"),
    ("scan_linen", "softmax_masked"), ("scan_nnx", "sigmoid")]


# ---------------------------------------------------------------------------
# One device.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model,loss", [
    pytest.param(m, l, id=f"{m}-{l}",
                 marks=() if (m, l) in CASES_BY_DEFAULT else pytest.mark.slow)
    for m, l in CASES])
def test_gram_equals_dense_gauss_newton(model, loss):
  loss_fn, params, batch, vectors, expected = problem(model, loss)
  grad_fn = kd.value_and_grad(loss_fn)
  gram = jax.jit(grad_fn.gauss_newton_gram)(params, vectors, *batch)
  assert gram.shape == (2, 2) and gram.dtype == F64
  assert_close(gram, expected)
  np.testing.assert_array_equal(gram, gram.T)
  assert np.all(np.linalg.eigvalsh(np.asarray(gram)) >= -TOL * np.abs(gram).max())
  one = jax.jit(grad_fn.gauss_newton_gram)(params, vectors[1:], *batch)
  assert_close(one, expected[1:, 1:])
  loss_value = jax.jit(grad_fn.loss)(params, *batch)
  assert_close(loss_value, loss_fn(params, *batch), 1e-14)
  both = jax.jit(functools.partial(grad_fn.gauss_newton_gram, with_loss=True))(
      params, vectors, *batch)
  assert_close(both[0], gram, 1e-15)
  assert_close(both[1], loss_value, 1e-15)


def test_fisher_type_rng_and_aux_do_not_change_the_results():
  loss_fn, params, batch, vectors, expected = problem("mlp_tags", "softmax_masked")

  def with_aux(p: dict, *batch: jax.Array) -> tuple:
    value = loss_fn(p, *batch)
    return value, {"twice": 2 * value}

  mc = kd.value_and_grad(with_aux, has_aux=True, fisher="mc")
  gram = mc.gauss_newton_gram(params, vectors, *batch, rng=jax.random.PRNGKey(9))
  assert_close(gram, expected)
  loss_value = mc.loss(params, *batch, rng=jax.random.PRNGKey(9))
  assert loss_value.shape == ()
  assert_close(loss_value, loss_fn(params, *batch), 1e-14)


def test_vectors_must_match_the_parameters():
  loss_fn, params, batch, vectors, _ = problem("mlp_tags", "softmax")
  grad_fn = kd.value_and_grad(loss_fn)
  with pytest.raises(ValueError, match="structure of the parameters"):
    grad_fn.gauss_newton_gram(params, ({"h": vectors[0]["h"]},), *batch)
  with pytest.raises(ValueError, match="at least one vector"):
    grad_fn.gauss_newton_gram(params, (), *batch)


def test_low_precision_model_gets_float32_products():
  loss_fn, params, batch, vectors, expected = problem("mlp_tags", "sigmoid")
  cast = lambda t, d: jax.tree_util.tree_map(lambda a: a.astype(d), t)
  grad_fn = kd.value_and_grad(loss_fn)
  gram = grad_fn.gauss_newton_gram(cast(params, jnp.bfloat16), vectors,
                                   cast(batch[0], jnp.bfloat16), *batch[1:])
  assert gram.dtype == jnp.float32
  assert_close(gram, expected, 0.1)


MICRO = [("mlp_tags", "softmax_masked"), ("scan_linen", "sigmoid"),
         ("cnn_linen", "squared_error")]


@pytest.mark.parametrize("model,loss", MICRO, ids=[f"{m}-{l}" for m, l in MICRO])
def test_micro_batches_give_the_whole_batch_values(model, loss):
  """Slices with different numbers of unmasked examples: the Gram matrix and the
  loss over 4 micro-batches are the whole batch's (weighted by each slice's n)."""
  loss_fn, params, batch, vectors, expected = problem(model, loss)
  grad_fn = kd.value_and_grad(loss_fn)
  gram = jax.jit(functools.partial(grad_fn.gauss_newton_gram, micro_batches=4))(
      params, vectors, *batch)
  assert_close(gram, expected)
  loss_value = jax.jit(functools.partial(grad_fn.loss, micro_batches=4))(params, *batch)
  assert_close(loss_value, loss_fn(params, *batch), 1e-13)
  gram, loss_value = grad_fn.gauss_newton_gram(params, vectors, *batch, micro_batches=4,
                                               with_loss=True)
  assert_close(gram, expected)
  assert_close(loss_value, loss_fn(params, *batch), 1e-13)
  with pytest.raises(ValueError, match="divisible by 3"):
    grad_fn.gauss_newton_gram(params, vectors, *batch, micro_batches=3)
  with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
    grad_fn.loss(params, *batch, micro_batches=0)


# ---------------------------------------------------------------------------
# 8 devices: the global batch's values.
# ---------------------------------------------------------------------------

DISTRIBUTED = [("mlp_tags", l) for l in LOSSES] + [
    ("cnn_linen", "softmax_masked"), ("scan_linen", "sigmoid"),
    ("scan_nnx", "squared_error")]


@pytest.mark.parametrize("model,loss", DISTRIBUTED, ids=[f"{m}-{l}" for m, l in DISTRIBUTED])
def test_sharded_batch_gives_the_global_values(model, loss):
  mesh = helpers.data_mesh(8)
  loss_fn, params, batch, vectors, expected = problem(model, loss)
  grad_fn = kd.value_and_grad(loss_fn)

  def local(p: dict, vs: tuple, *batch: jax.Array) -> tuple:
    return (grad_fn.gauss_newton_gram(p, vs, *batch), grad_fn.loss(p, *batch),
            grad_fn.gauss_newton_gram(p, vs, *batch, micro_batches=2),
            grad_fn.loss(p, *batch, micro_batches=2),
            grad_fn.gauss_newton_gram(p, vs, *batch, with_loss=True)[1])

  sharded = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P()) + (P("data"),) * len(batch),
      out_specs=(P(),) * 5))
  gram, loss_value, micro_gram, micro_loss, with_loss = sharded(params, vectors, *batch)
  assert_close(with_loss, loss_value)
  assert_close(micro_gram, gram)
  assert_close(micro_loss, loss_value)
  single_gram = jax.jit(grad_fn.gauss_newton_gram)(params, vectors, *batch)
  single_loss = jax.jit(grad_fn.loss)(params, *batch)
  assert_close(gram, single_gram)
  assert_close(gram, expected)
  assert_close(loss_value, single_loss)


def test_sharded_step_with_aux_and_an_extra_term():
  """In one step with the capture (as adaptive K-FAC calls them): the loss of a
  function adding a weight penalty to its masked loss is the global batch's
  (`Σ n_d loss_d / Σ n_d` keeps the penalty once), its aux is ignored."""
  mesh = helpers.data_mesh(8)
  loss_fn, params, batch, vectors, expected = problem("cnn_linen", "softmax_masked")

  def penalised(p: dict, *batch: jax.Array) -> tuple:
    value = loss_fn(p, *batch) + 1e-2 * sum(
        jnp.sum(a * a) for a in jax.tree_util.tree_leaves(p))
    return value, {"value": value}

  grad_fn = kd.value_and_grad(penalised, has_aux=True)

  def step(p: dict, vs: tuple, *batch: jax.Array) -> tuple:
    (_, _), grads, _ = grad_fn(p, *batch)
    grads = jax.lax.pmean(grads, "data")
    return grad_fn.gauss_newton_gram(p, (grads,) + vs, *batch), grad_fn.loss(p, *batch)

  sharded = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P()) + (P("data"),) * len(batch),
      out_specs=(P(), P())))
  gram, loss_value = sharded(params, vectors, *batch)
  assert gram.shape == (3, 3)
  assert_close(gram[1:, 1:], expected)
  assert_close(loss_value, penalised(params, *batch)[0])


@pytest.mark.parametrize("where", ["one_device", "micro_batches", "sharded"])
def test_gram_is_that_of_the_loss_the_function_returns(where):
  """`a · L + R(θ)` (a loss weight `a`, a penalty): `a` times the registered
  loss's matrix, on one device, over micro-batches and as the global batch's on
  8 devices (masked: shares weigh each device's loss)."""
  loss_fn, params, batch, vectors, expected = problem("mlp_tags", "softmax_masked")
  weight = 2.5

  def weighted(p: dict, *batch: jax.Array) -> jax.Array:
    return weight * loss_fn(p, *batch) + 1e-2 * jnp.sum(p["h"]["kernel"] ** 2)

  grad_fn = kd.value_and_grad(weighted)
  if where == "sharded":
    gram = jax.jit(jax.shard_map(
        grad_fn.gauss_newton_gram, mesh=helpers.data_mesh(8),
        in_specs=(P(), P()) + (P("data"),) * len(batch), out_specs=P()))(
            params, vectors, *batch)
  else:
    gram = jax.jit(functools.partial(grad_fn.gauss_newton_gram, micro_batches=(
        4 if where == "micro_batches" else 1)))(params, vectors, *batch)
  assert_close(gram, weight * expected)


def test_gram_of_a_function_of_the_registered_loss():
  """`log L`: its Gauss-Newton matrix `(1/L) C` (the outer function's
  derivative at the loss times the registered loss's matrix)."""
  loss_fn, params, batch, vectors, expected = problem("mlp_tags", "squared_error")
  grad_fn = kd.value_and_grad(lambda p, *batch: jnp.log(loss_fn(p, *batch)))
  gram = jax.jit(grad_fn.gauss_newton_gram)(params, vectors, *batch)
  assert_close(gram, expected / helpers.f64(loss_fn(params, *batch)))


def test_distillation_recipe_is_the_written_losss():
  """Hard labels and a teacher's soft targets at temperature T, `α·CE(s, y) +
  (1−α)·T²·CE(s/T, q)`, as one registered loss over both terms' rows weighted
  by `mask` (docs/concepts.md, "Soft targets"): its value is the written
  loss's and its Gauss-Newton matrix the written loss's, `α H(s) + (1−α)
  H(s/T)` per example (`T²` times the `1/T²` of the scaled logits)."""
  apply, params, x = MODELS["mlp_tags"]()
  alpha, temp = 0.3, 4.0
  shape = jax.eval_shape(apply, params, x).shape[:-1]
  y = jax.random.randint(jax.random.PRNGKey(3), shape, 0, CLASSES)
  q = jax.nn.softmax(helpers.randn(jax.random.PRNGKey(6), shape + (CLASSES,)) / temp)

  def loss_fn(p, x, y, q):
    s = apply(p, x)
    weights = jnp.concatenate([jnp.full(shape, alpha), jnp.full(shape, (1 - alpha) * temp ** 2)])
    return (alpha + (1 - alpha) * temp ** 2) * kd.losses.softmax_cross_entropy(
        jnp.concatenate([s, s / temp]),
        jnp.concatenate([jax.nn.one_hot(y, CLASSES, dtype=F64), q]), mask=weights)

  def written(p):
    s = apply(p, x)
    hard = -jnp.take_along_axis(jax.nn.log_softmax(s), y[..., None], -1)
    soft = -jnp.sum(q * jax.nn.log_softmax(s / temp), -1)
    return alpha * jnp.mean(hard) + (1 - alpha) * temp ** 2 * jnp.mean(soft)
  flat, unravel = ravel_pytree(params)
  vectors = tuple(unravel(jax.random.normal(k, flat.shape, F64))
                  for k in jax.random.split(jax.random.PRNGKey(5), 2))
  expected = _brute_gram(
      apply, params, x, jnp.ones(shape, F64),
      lambda z: alpha * _softmax_h(z) + (1 - alpha) * _softmax_h(z / temp), vectors)
  grad_fn = kd.value_and_grad(loss_fn)
  gram, loss = jax.jit(functools.partial(grad_fn.gauss_newton_gram, with_loss=True))(
      params, vectors, x, y, q)
  assert_close(gram, expected)
  assert_close(loss, written(params), 1e-14)
  assert_close(jax.jit(grad_fn)(params, x, y, q)[1]["out"]["kernel"],
               jax.grad(written)(params)["out"]["kernel"], 1e-13)
