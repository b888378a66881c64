"""Layers whose parameters the loss does not differentiate: a target network,
a discriminator in the generator's loss, a frozen backbone.

A layer at the loss's top level whose kernel does not depend on the
parameters given to `kd.value_and_grad` (another argument of the loss, a
closed-over value, a `stop_gradient`) has no gradient to precondition and runs
untagged: it must neither be taken for the trained model's layer of the same
module path (K-FAC-expand would then average its inputs into that layer's
factors) nor stop discovery. Oracle: the trained layers' factors built in
float64 from their own inputs and output gradients, `A = [x, 1]ᵀ[x, 1] / B`,
`G = B · Σ_b g_b g_bᵀ` (`g` the mean loss's gradient in the layer's output).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfac_jax_dist as kd

B, D_IN, HIDDEN, ACTIONS = 16, 5, 7, 3


@pytest.fixture(autouse=True, scope="module")
def _float64():
  with jax.enable_x64(True):
    yield


class QNet(nn.Module):
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, s):
    h = jnp.tanh(self.dense(HIDDEN)(s))
    return self.dense(ACTIONS)(h)


def _batch():
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  return (jax.random.normal(k[0], (B, D_IN), jnp.float64),
          jax.random.randint(k[1], (B,), 0, ACTIONS),
          jax.random.normal(k[2], (B,), jnp.float64),
          jax.random.normal(k[3], (B, D_IN), jnp.float64))


def _init(model, seed):
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, D_IN)))
  return jax.tree.map(lambda a: a.astype(jnp.float64), params)


def _brute_factors(online: dict, target_values: jax.Array, s, a) -> dict:
  """The online layers' `A` and `G` of the TD loss with the targets fixed."""
  p = online["params"]

  def loss_of(pre: tuple) -> tuple:
    h = jnp.tanh(s @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"] + pre[0])
    q = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"] + pre[1]
    q_sa = jnp.take_along_axis(q, a[:, None], 1)
    return jnp.mean(0.5 * jnp.sum((q_sa - target_values) ** 2, -1)), h

  zeros = (jnp.zeros((B, HIDDEN)), jnp.zeros((B, ACTIONS)))
  h = loss_of(zeros)[1]
  grads = jax.grad(lambda pre: loss_of(pre)[0])(zeros)
  with_one = lambda x: np.concatenate([np.asarray(x), np.ones((B, 1))], 1)
  return {name: {"A": with_one(x).T @ with_one(x) / B,
                 "G": B * np.asarray(g).T @ np.asarray(g)}
          for name, x, g in (("params/Dense_0", s, grads[0]),
                             ("params/Dense_1", h, grads[1]))}


@pytest.mark.parametrize("given", ["argument", "closed_over", "stop_gradient"])
@pytest.mark.parametrize("capture,dense", [("flax", nn.Dense), ("tags", kd.linen.Dense)],
                         ids=["flax", "kd_linen"])
def test_target_network_of_the_same_model_is_left_untagged(capture, dense, given):
  """DQN's TD loss, the target network the online one's architecture: its
  layers (same module paths and shapes) are not merged into the online ones;
  inside the user's jit, where the target parameters are tracers too."""
  q = QNet(dense)
  online, target = _init(q, 1), _init(q, 2)
  s, a, r, s2 = _batch()

  def td_loss(p, tp, s, a, r, s2):
    tp = {"argument": tp, "closed_over": target_in_jit[0],
          "stop_gradient": jax.lax.stop_gradient(tp)}[given]
    q_sa = jnp.take_along_axis(q.apply(p, s), a[:, None], 1)
    y = r[:, None] + 0.99 * jnp.max(q.apply(tp, s2), -1, keepdims=True)
    return kd.losses.squared_error(q_sa, y)

  grad_fn = kd.value_and_grad(td_loss, capture=capture)
  target_in_jit = [target]

  @jax.jit
  def step(p, tp, *batch):
    target_in_jit[0] = tp
    return grad_fn(p, tp, *batch)

  assert set(grad_fn.discover(online, target, s, a, r, s2).names()) == {
      "params/Dense_0", "params/Dense_1"}
  _, grads, stats = step(online, target, s, a, r, s2)
  target_in_jit[0] = target
  y = r[:, None] + 0.99 * jnp.max(q.apply(target, s2), -1, keepdims=True)
  for name, want in _brute_factors(online, y, s, a).items():
    for key in ("A", "G"):
      np.testing.assert_allclose(stats[name][key], want[key], rtol=1e-12,
                                 atol=1e-14 * np.abs(want[key]).max(), err_msg=name + key)
  expected = jax.grad(td_loss)(online, target, s, a, r, s2)
  jax.tree.map(lambda g, e: np.testing.assert_allclose(
      g, e, rtol=1e-12, atol=1e-14 * np.abs(e).max()), grads, expected)


def test_frozen_backbone_beside_the_trained_head():
  """Fine-tuning: only the head is differentiated, the backbone passed as
  another argument (linen, capture="flax") or kept in the rest of an NNX
  split: the head alone is tagged, with its own factors."""
  s, a, _, _ = _batch()

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(nn.Dense(HIDDEN, name="body")(x))
      return nn.Dense(ACTIONS, name="head")(h)

  net = Net()
  params = _init(net, 3)["params"]

  def loss_fn(head, body, x, y):
    return kd.losses.softmax_cross_entropy(net.apply({"params": {**body, **head}}, x), y)

  grad_fn = kd.value_and_grad(loss_fn, capture="flax")
  head, body = {"head": params["head"]}, {"body": params["body"]}
  assert grad_fn.discover(head, body, s, a).names() == ("head",)
  _, _, stats = jax.jit(grad_fn)(head, body, s, a)
  features = np.asarray(jnp.tanh(s @ params["body"]["kernel"] + params["body"]["bias"]))
  with_one = np.concatenate([features, np.ones((B, 1))], 1)
  np.testing.assert_allclose(stats["head"]["A"], with_one.T @ with_one / B, rtol=1e-12)

  model = nnx.Sequential(nnx.Linear(D_IN, HIDDEN, rngs=nnx.Rngs(0)), jnp.tanh,
                         kd.nnx.Linear(HIDDEN, ACTIONS, rngs=nnx.Rngs(1)))
  graphdef, trained, frozen = nnx.split(model, nnx.PathContains(2), ...)
  nnx_fn = kd.value_and_grad(lambda t, f, x, y: kd.losses.softmax_cross_entropy(
      nnx.merge(graphdef, t, f)(x), y))
  assert len(nnx_fn.discover(trained, frozen, s, a).names()) == 1


def test_plain_tags_on_frozen_kernels_run_untagged_and_cast_ones_still_raise():
  """A plain tag on a kernel passed as another argument is no layer of the
  parameters (runs as the plain layer); one on a kernel computed from a
  parameter is refused as before (its gradient is the parameter's)."""
  s, a, _, _ = _batch()
  w = jax.random.normal(jax.random.PRNGKey(5), (D_IN, ACTIONS), jnp.float64)

  def loss_fn(p, frozen, x, y):
    h = kd.tags.dense(x, frozen, name="frozen")
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["w"], name="w") + h, y)

  assert kd.value_and_grad(loss_fn).discover({"w": w}, w, s, a).names() == ("w",)

  def cast_loss(p, x, y):
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, 2.0 * p["w"], name="w"), y)

  with pytest.raises(ValueError, match="not a leaf of the parameters"):
    kd.value_and_grad(cast_loss).discover({"w": w}, s, a)


def test_nnx_lora_is_two_dense_layers_over_a_frozen_base():
  """`nnx.LoRALinear` under capture="flax", only its `LoRAParam`s trained
  (`nnx.split(model, nnx.LoRAParam, ...)`): `A` (inputs → rank) and `B` (rank →
  outputs) are two dense layers, named by their leaves, with the factors of
  `x A` and `(x A) B`; the frozen base kernel runs untagged."""
  s, a, _, _ = _batch()
  rank = 2

  class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.l1 = nnx.LoRALinear(D_IN, HIDDEN, lora_rank=rank, rngs=rngs,
                               param_dtype=jnp.float64)
      self.head = nnx.Linear(HIDDEN, ACTIONS, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
      return self.head(jnp.tanh(self.l1(x)))

  net = Net(nnx.Rngs(0))
  net.l1.lora.lora_b[...] = jax.random.normal(jax.random.PRNGKey(6), (rank, HIDDEN),
                                              jnp.float64)
  graphdef, lora, rest = nnx.split(net, nnx.LoRAParam, ...)
  grad_fn = kd.value_and_grad(lambda t, f, x, y: kd.losses.softmax_cross_entropy(
      nnx.merge(graphdef, t, f)(x), y), capture="flax")
  assert grad_fn.discover(lora, rest, s, a).names() == ("l1/lora/lora_a", "l1/lora/lora_b")
  _, _, stats = jax.jit(grad_fn)(lora, rest, s, a)

  l1, head = net.l1, net.head
  def loss_of(extra: tuple) -> tuple:
    hidden = s @ l1.lora.lora_a[...] + extra[0]
    low_rank = hidden @ l1.lora.lora_b[...] + extra[1]
    out = head(jnp.tanh(s @ l1.kernel[...] + l1.bias[...] + low_rank))
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(out), a[:, None], 1)), hidden

  zeros = (jnp.zeros((B, rank)), jnp.zeros((B, HIDDEN)))
  hidden = np.asarray(loss_of(zeros)[1])
  grads = [np.asarray(g) for g in jax.grad(lambda e: loss_of(e)[0])(zeros)]
  for name, x, g in (("l1/lora/lora_a", np.asarray(s), grads[0]),
                     ("l1/lora/lora_b", hidden, grads[1])):
    np.testing.assert_allclose(stats[name]["A"], x.T @ x / B, rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(stats[name]["G"], B * g.T @ g, rtol=1e-12,
                               atol=1e-14 * np.abs(B * g.T @ g).max(), err_msg=name)
