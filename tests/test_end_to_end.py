"""Whole training steps: linen, NNX and plain-JAX tags agree; jit equals eager."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_dist as kd


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(4, (3, 3), strides=2, name="conv")(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.tanh(kd.linen.Dense(8, name="hidden")(x))
    return kd.linen.Dense(5, use_bias=False, name="out")(x)


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.conv = kd.nnx.Conv(2, 4, (3, 3), strides=2, rngs=rngs)
    self.hidden = kd.nnx.Linear(64, 8, rngs=rngs)
    self.out = kd.nnx.Linear(8, 5, use_bias=False, rngs=rngs)

  def __call__(self, x):
    x = nn.relu(self.conv(x))
    x = nn.tanh(self.hidden(x.reshape(x.shape[0], -1)))
    return self.out(x)


def plain_net(p, x):
  x = nn.relu(kd.tags.conv2d(x, p["conv"]["kernel"], p["conv"]["bias"], strides=(2, 2),
                             name="conv"))
  x = x.reshape(x.shape[0], -1)
  x = nn.tanh(kd.tags.dense(x, p["hidden"]["kernel"], p["hidden"]["bias"], name="hidden"))
  return kd.tags.dense(x, p["out"]["kernel"], name="out")


def _data():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(k1, (16, 8, 8, 2))
  y = jax.random.randint(k2, (16,), 0, 5)
  return x, y


def _kfac(layers):
  return kd.kfac(0.2, layers=layers, damping=1e-2, factor_update_every=2,
                 inverse_update_every=3)


def _train(loss_fn, params, x, y, steps=5, jit=True):
  grad_fn = kd.value_and_grad(loss_fn)
  tx = _kfac(grad_fn.discover(params, x, y))
  state = tx.init(params)

  def step(params, state):
    loss, grads, stats = grad_fn(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  step = jax.jit(step) if jit else step
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return params, state, losses


def test_linen_nnx_and_plain_tags_take_the_same_steps():
  x, y = _data()
  linen = LinenNet()
  variables = linen.init(jax.random.PRNGKey(1), x)
  p = variables["params"]
  plain = {"conv": dict(p["conv"]), "hidden": dict(p["hidden"]), "out": dict(p["out"])}

  model = NnxNet(nnx.Rngs(0))
  graphdef, state = nnx.split(model, nnx.Param)
  nnx_params = nnx.to_pure_dict(state)
  for layer in ("conv", "hidden", "out"):
    for name, value in p[layer].items():
      nnx_params[layer][name] = value
  nnx.replace_by_pure_dict(state, nnx_params)

  def linen_loss(v, x, y):
    return kd.losses.softmax_cross_entropy(linen.apply(v, x), y)

  def nnx_loss(s, x, y):
    return kd.losses.softmax_cross_entropy(nnx.merge(graphdef, s)(x), y)

  def plain_loss(q, x, y):
    return kd.losses.softmax_cross_entropy(plain_net(q, x), y)

  lp, _, l_losses = _train(linen_loss, variables, x, y)
  pp, _, p_losses = _train(plain_loss, plain, x, y)
  np_, _, n_losses = _train(nnx_loss, state, x, y)
  np.testing.assert_allclose(l_losses, p_losses, rtol=1e-5)
  np.testing.assert_allclose(l_losses, n_losses, rtol=1e-5)
  assert l_losses[-1] < l_losses[0]
  n_pure = nnx.to_pure_dict(np_)
  for layer in ("conv", "hidden", "out"):
    for name in p[layer]:
      np.testing.assert_allclose(lp["params"][layer][name], pp[layer][name], atol=1e-5)
      np.testing.assert_allclose(lp["params"][layer][name], n_pure[layer][name], atol=1e-5)


def test_jit_equals_eager_and_state_is_stable():
  x, y = _data()
  linen = LinenNet()
  variables = linen.init(jax.random.PRNGKey(1), x)

  def loss_fn(v, x, y):
    return kd.losses.softmax_cross_entropy(linen.apply(v, x), y)

  pj, sj, lj = _train(loss_fn, variables, x, y, steps=4, jit=True)
  pe, se, le = _train(loss_fn, variables, x, y, steps=4, jit=False)
  np.testing.assert_allclose(lj, le, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), pj, pe)
  grad_fn = kd.value_and_grad(loss_fn)
  s0 = _kfac(grad_fn.discover(variables, x, y)).init(variables)   # the same transform's
  assert jax.tree.structure(s0) == jax.tree.structure(sj)
  assert (jax.tree.map(lambda a: (a.shape, a.dtype), s0)
          == jax.tree.map(lambda a: (a.shape, a.dtype), sj))


def test_discover_from_shapes_only():
  x, y = _data()
  linen = LinenNet()
  shapes = jax.eval_shape(linen.init, jax.random.PRNGKey(1), x)
  x_s, y_s = jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype)

  def loss_fn(v, x, y, train=True):
    assert train is True            # non-array arguments stay Python values
    return kd.losses.softmax_cross_entropy(linen.apply(v, x), y)

  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(shapes, x_s, y_s, train=True)
  assert [l.name for l in layers] == ["params/conv", "params/hidden", "params/out"]
  assert [(l.a_dim, l.g_dim) for l in layers] == [(19, 4), (65, 8), (8, 5)]

  params = linen.init(jax.random.PRNGKey(1), x)
  loss, grads, stats = jax.jit(lambda p: grad_fn(p, x, y, train=True))(params)
  assert set(stats) == {l.name for l in layers} and bool(jnp.isfinite(loss))


def test_nnx_optimizer_runs_kfac_and_shampoo_as_a_hand_written_loop():
  """`nnx.Optimizer(model, tx, wrt=nnx.Param)` inits the transform on the
  Variables' State and updates it with pure arrays (`nnx.Optimizer.update`
  passes `kfac_stats=` on): both name the same leaves, and the steps equal
  the hand-written loop's."""
  x, y = _data()
  graphdef, state = nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param)

  def nnx_loss(s, x, y):
    return kd.losses.softmax_cross_entropy(nnx.merge(graphdef, s)(x), y)

  want_kfac, _, kfac_losses = _train(nnx_loss, state, x, y)
  grad_fn = kd.value_and_grad(nnx_loss)
  model = nnx.merge(graphdef, state)
  optimizer = nnx.Optimizer(model, kd.kfac(0.2, layers=grad_fn.discover(state, x, y),
                                           damping=1e-2, factor_update_every=2,
                                           inverse_update_every=3), wrt=nnx.Param)

  @nnx.jit
  def kfac_step(model, optimizer):
    loss, grads, stats = grad_fn(nnx.state(model, nnx.Param), x, y,
                                 opt_state=optimizer.opt_state)
    optimizer.update(model, grads, kfac_stats=stats)
    return loss

  losses = [float(kfac_step(model, optimizer)) for _ in range(5)]
  np.testing.assert_allclose(losses, kfac_losses, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(want_kfac))

  tx = kd.shampoo(0.05, preconditioning_compute_steps=2)

  @jax.jit
  def hand_written(params, opt_state):
    updates, opt_state = tx.update(jax.grad(nnx_loss)(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  want, opt_state = state, tx.init(state)
  for _ in range(3):
    want, opt_state = hand_written(want, opt_state)
  model = nnx.merge(graphdef, state)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def shampoo_step(model, optimizer):
    optimizer.update(model, nnx.grad(lambda m: kd.losses.softmax_cross_entropy(
        m(x), y))(model))
  for _ in range(3):
    shampoo_step(model, optimizer)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(want))
