"""Tagged layers under derivatives that the loss function takes itself (a
force field's −∇E, a PINN's residual, a gradient penalty, a custom VJP):
the capture sees a layer's statistics only through the loss's own backward
pass, so a layer that runs nowhere else is refused by name, not left with
identity factors; forward mode is refused at discovery."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd
from kfac_jax_dist import _compat

pytestmark = pytest.mark.usefixtures("x64_module")

B, D = 12, 4


def _params():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"l0": {"w": 0.5 * jax.random.normal(k[0], (D, 6), jnp.float64),
                 "b": jnp.zeros(6, jnp.float64)},
          "l1": {"w": 0.5 * jax.random.normal(k[1], (6, 1), jnp.float64)},
          "head": {"w": 0.5 * jax.random.normal(k[2], (D, D), jnp.float64),
                   "b": jnp.zeros(D, jnp.float64)}}


def _batch():
  x = jax.random.normal(jax.random.PRNGKey(1), (B, D), jnp.float64)
  return x, jnp.sin(3 * x)


def _energy(p, x, tagged=True):
  dense = kd.tags.dense if tagged else (lambda h, w, b=None, name=None:
                                        h @ w + (0 if b is None else b))
  h = jnp.tanh(dense(x, p["l0"]["w"], p["l0"]["b"], name="l0"))
  return dense(h, p["l1"]["w"], name="l1")[:, 0]


def _force_loss(tagged_energy):
  """A force field: the prediction is −∇ₓE(x), then one tagged head."""
  def loss(p, x, target):
    forces = -jax.grad(lambda xx: _energy(p, xx, tagged_energy).sum())(x)
    pred = kd.tags.dense(forces, p["head"]["w"], p["head"]["b"], name="head")
    return kd.losses.squared_error(pred, target)
  return loss


def test_layers_only_under_the_losss_own_gradient_are_refused_by_name():
  grad_fn = kd.value_and_grad(_force_loss(True))
  layers = grad_fn.discover(_params(), *_batch())
  hidden = {layer.name: layer.under_derivative for layer in layers}
  assert hidden == {"l0": _compat.REVERSE, "l1": _compat.REVERSE, "head": None}
  with pytest.raises(ValueError, match=r"Tagged layers \['l0', 'l1'\] run only under a "
                                       r"derivative.*skip=\['\^l0\$', '\^l1\$'\]"):
    kd.kfac(0.1, 0.9, layers=layers).init(_params())


def test_skipped_they_train_and_the_head_gets_its_statistics():
  """With the energy's layers skipped, the head's `A` is the brute-force mean
  of `[f, 1][f, 1]ᵀ` over the forces, the gradients `jax.grad`'s, and a step
  changes the head's factors (before: every factor stayed the identity)."""
  params, (x, target) = _params(), _batch()
  grad_fn = kd.value_and_grad(_force_loss(True))
  tx = kd.kfac(0.1, 0.0, layers=grad_fn.discover(params, x, target),
               skip=("^l0$", "^l1$"), factor_dtype=jnp.float64, inverse_update_every=1)
  state = tx.init(params)
  loss, grads, stats = grad_fn(params, x, target, opt_state=state)
  expected = jax.grad(_force_loss(False))(params, x, target)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
  forces = np.asarray(-jax.grad(lambda xx: _energy(params, xx, False).sum())(x))
  rows = np.concatenate([forces, np.ones((B, 1))], axis=1)
  a_head = np.asarray(stats["head"]["A"])
  np.testing.assert_allclose(a_head if a_head.ndim == 2 else _unpacked(a_head, D + 1),
                             rows.T @ rows / B, rtol=1e-12)
  assert set(stats) == {"head"}
  before = np.asarray(kd.running_factors(state)["head"]["A"])
  _, state = tx.update(grads, state, params, kfac_stats=stats)
  assert not np.allclose(np.asarray(kd.running_factors(state)["head"]["A"]), before)


def _unpacked(packed, d):
  out = np.zeros((d, d))
  out[np.triu_indices(d)] = np.asarray(packed)
  return out + np.triu(out, 1).T


def test_a_layer_also_applied_outside_keeps_the_losss_statistics():
  """An input-gradient penalty reruns the model inside `jax.grad`: the layers
  also run outside it, are not refused, and their statistics are the
  cross-entropy's alone (the penalty's pass is not captured)."""
  def logits(p, x):
    h = jnp.tanh(kd.tags.dense(x, p["l0"]["w"], p["l0"]["b"], name="l0"))
    return kd.tags.dense(h, p["out"], name="out")

  def penalised(p, x, y):
    gx = jax.grad(lambda xx: optax.softmax_cross_entropy_with_integer_labels(
        logits(p, xx), y).mean())(x)
    return kd.losses.softmax_cross_entropy(logits(p, x), y) + 0.3 * jnp.sum(gx ** 2)

  def plain(p, x, y):
    return kd.losses.softmax_cross_entropy(logits(p, x), y)

  params = dict(_params(), out=jax.random.normal(jax.random.PRNGKey(5), (6, 3), jnp.float64))
  x, y = _batch()[0], jnp.arange(B) % 3
  grad_fn = kd.value_and_grad(penalised)
  assert all(layer.under_derivative is None for layer in grad_fn.discover(params, x, y))
  _, _, stats = grad_fn(params, x, y)
  _, _, reference = kd.value_and_grad(plain)(params, x, y)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(reference)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    return jnp.tanh(kd.linen.Dense(5, param_dtype=jnp.float64, name="inner")(h))


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = kd.linen.Dense(5, param_dtype=jnp.float64, name="inp")(x)

    def f(module, h):
      return module(h)

    def fwd(module, h):
      return nn.vjp(f, module, h)

    h = nn.custom_vjp(f, forward_fn=fwd, backward_fn=lambda vjp, ct: vjp(ct))(
        _Block(name="blk"), h)
    return kd.linen.Dense(3, param_dtype=jnp.float64, name="out")(h)


def test_a_block_under_a_custom_vjp_is_refused():
  x, y = _batch()[0], jnp.arange(B) % 3
  model = _Net()
  params = model.init(jax.random.PRNGKey(0), x)
  grad_fn = kd.value_and_grad(
      lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply(p, x), y))
  layers = grad_fn.discover(params, x, y)
  assert {l.name: l.under_derivative for l in layers} == {
      "params/inp": None, "params/blk/inner": _compat.CUSTOM, "params/out": None}
  with pytest.raises(ValueError, match=r"\['params/blk/inner'\] run only under a "
                                       r"derivative.*custom derivative rule"):
    kd.kfac(0.1, 0.9, layers=layers).init(params)
  kd.kfac(0.1, 0.9, layers=layers, skip=("inner",)).init(params)


def test_forward_mode_in_the_loss_is_refused_at_discovery():
  """`jax.jvp` of the tagged model (a Jacobian penalty): the capture failed
  with JAX's "Differentiation rule for 'custom_lin' not implemented"."""
  def loss(p, x, target):
    _, tangent = jax.jvp(lambda xx: _energy(p, xx), (x,), (jnp.ones_like(x),))
    pred = kd.tags.dense(x, p["head"]["w"], p["head"]["b"], name="head")
    return kd.losses.squared_error(pred, target) + 0.1 * jnp.sum(tangent ** 2)
  with pytest.raises(ValueError, match="Tagged layer 'l0' runs under a forward-mode "
                                       "derivative.*jax.vjp, jax.grad"):
    kd.value_and_grad(loss).discover(_params(), *_batch())


def test_a_gradient_with_respect_to_the_parameters_names_the_cause():
  """A plain JAX tag inside `jax.grad` of the parameters (a gradient-norm
  penalty) sees no leaf: the error says why instead of listing other causes."""
  def loss(p, x, target):
    pred = kd.tags.dense(x, p["head"]["w"], p["head"]["b"])
    inner = jax.grad(lambda q: jnp.sum(kd.tags.dense(x, q["head"]["w"]) ** 2))(p)
    return kd.losses.squared_error(pred, target) + jnp.sum(inner["head"]["w"] ** 2)
  with pytest.raises(ValueError, match="runs under a derivative that the loss function "
                                       "takes itself.*untagged copy"):
    kd.value_and_grad(loss).discover(_params(), *_batch())
