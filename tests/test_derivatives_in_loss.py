"""Tagged layers under derivatives that the loss function takes itself (a
force field's −∇E, a PINN's residual, a gradient penalty, a custom VJP):
the capture sees a layer's statistics only through the loss's own backward
pass, so a layer that runs nowhere else is refused by name, not left with
identity factors; one that also runs outside it is warned of; under forward
mode the capture runs the layers untagged."""

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
  also run outside it, are not refused (a warning names them), and their
  statistics are the cross-entropy's alone (the penalty's pass is not
  captured)."""
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
  layers = grad_fn.discover(params, x, y)
  assert {l.name: (l.under_derivative, l.also_under_derivative) for l in layers} == {
      "l0": (None, _compat.REVERSE), "out": (None, _compat.REVERSE)}
  with pytest.warns(UserWarning, match=r"\['l0', 'out'\] also run under a derivative"):
    kd.kfac(0.1, 0.9, layers=layers).init(params)
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


def _forward_loss(derivative: str, outside: bool):
  """A penalty on a forward-mode derivative of the tagged energy in `x` (a
  Jacobian-vector product, or Taylor mode's second-order coefficient, a
  forward Laplacian's), plus the head; with `outside`, the energy is also a
  term of the regression (its layers also run outside the derivative)."""
  from jax.experimental import jet       # pylint: disable=import-outside-toplevel

  def loss(p, x, target, tagged=True):
    energy = lambda xx: _energy(p, xx, tagged)
    if derivative == "jvp":
      _, term = jax.jvp(energy, (x,), (jnp.ones_like(x),))
    else:
      term = jet.jet(energy, (x,), ((jnp.ones_like(x), jnp.zeros_like(x)),))[1][1]
    pred = (kd.tags.dense(x, p["head"]["w"], p["head"]["b"], name="head") if tagged
            else x @ p["head"]["w"] + p["head"]["b"])
    if outside:
      pred = pred + energy(x)[:, None]
    if not tagged:
      return 0.5 * jnp.mean(jnp.sum((pred - target) ** 2, -1)) + 0.1 * jnp.sum(term ** 2)
    return kd.losses.squared_error(pred, target) + 0.1 * jnp.sum(term ** 2)
  return loss


@pytest.mark.parametrize("derivative", ["jvp", "jet"])
def test_forward_mode_in_the_loss_runs_its_layers_untagged(derivative):
  """`jax.jvp` or `jax.experimental.jet` of the tagged model inside the loss
  (a Jacobian penalty, a forward Laplacian): there the capture runs the
  layers untagged (before: refused at discovery, since JAX cannot
  differentiate the tags' custom VJPs in forward mode, nor in reverse after
  it). Layers only under it are refused by name at `tx.init` as under a
  reverse-mode derivative; skipped, the step's gradients are `jax.grad`'s.
  Also run outside, they are warned of, and their statistics are the outside
  pass's: `A` the float64 brute force over `[x, 1]`, the gradients exact."""
  params, (x, target) = _params(), _batch()
  grad_fn = kd.value_and_grad(_forward_loss(derivative, outside=False))
  layers = grad_fn.discover(params, x, target)
  assert {l.name: l.under_derivative for l in layers} == {
      "l0": _compat.FORWARD, "l1": _compat.FORWARD, "head": None}
  with pytest.raises(ValueError, match=r"\['l0', 'l1'\] run only under a derivative.*"
                                       r"forward-mode"):
    kd.kfac(0.1, 0.9, layers=layers).init(params)
  state = kd.kfac(0.1, 0.9, layers=layers, skip=("^l0$", "^l1$")).init(params)
  _, grads, stats = grad_fn(params, x, target, opt_state=state)
  want = jax.grad(_forward_loss(derivative, outside=False))(params, x, target, False)
  for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
  assert set(stats) == {"head"}

  grad_fn = kd.value_and_grad(_forward_loss(derivative, outside=True))
  layers = grad_fn.discover(params, x, target)
  assert {l.name: l.also_under_derivative for l in layers} == {
      "l0": _compat.FORWARD, "l1": _compat.FORWARD, "head": None}
  with pytest.warns(UserWarning, match=r"\['l0', 'l1'\] also run under a derivative"):
    kd.kfac(0.1, 0.9, layers=layers).init(params)
  _, grads, stats = grad_fn(params, x, target)
  want = jax.grad(_forward_loss(derivative, outside=True))(params, x, target, False)
  for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
  rows = np.concatenate([np.asarray(x), np.ones((B, 1))], axis=1)
  a = np.asarray(stats["l0"]["A"])
  np.testing.assert_allclose(a if a.ndim == 2 else _unpacked(a, D + 1), rows.T @ rows / B,
                             rtol=1e-12)


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


def test_a_plain_tag_on_maml_adapted_weights_names_the_cause():
  """MAML's query pass at `p − α∇L_support` (the inner step untagged): the
  kernel is computed from the parameters, which the error now says (before,
  it listed dtype=, stack_index=, remat, jit and FSDP only)."""
  def loss(p, x, target):
    inner = jax.grad(lambda q: jnp.mean((x @ q["head"]["w"] - target) ** 2))(p)
    adapted = jax.tree.map(lambda w, g: w - 0.1 * g, p, inner)
    pred = kd.tags.dense(x, adapted["head"]["w"], adapted["head"]["b"], name="head")
    return kd.losses.squared_error(pred, target)
  with pytest.raises(ValueError, match=r"not a leaf.*computed from the parameters "
                                       r"\(MAML's adapted weights.*capture='flax'"):
    kd.value_and_grad(loss).discover(_params(), *_batch())


def test_a_forward_pass_shared_with_a_penalty_is_warned_of_and_rerun_counts():
  """An R1 penalty sharing the critic's pass on the real rows through
  `jax.vjp`, the value going to the registered loss: those rows give no
  statistics (the derivative's trace takes the tags' backward pass), so
  `tx.init` warns (before: silently, `A` the fake rows' alone, 0.46 off); the
  remedy the warning gives, a pass outside the derivative for the loss, gives
  the float64 brute force of `A` over every row."""
  x_real, x_fake = _batch()[0], _batch()[0][::-1] + 1.0

  def critic(p, x):
    return _energy(p, x)[:, None]

  def labelled(real, fake):
    logits = jnp.concatenate([real, fake])
    return logits, jnp.concatenate([jnp.ones_like(real), jnp.zeros_like(fake)])

  def shared(p, xr, xf):
    real, vjp = jax.vjp(lambda xx: critic(p, xx), xr)
    penalty = jnp.mean(jnp.sum(vjp(jnp.ones_like(real))[0] ** 2, axis=-1))
    return kd.losses.sigmoid_cross_entropy(*labelled(real, critic(p, xf))) + penalty

  def rerun(p, xr, xf):
    penalty = jnp.mean(jnp.sum(jax.grad(lambda xx: critic(p, xx).sum())(xr) ** 2, axis=-1))
    return (kd.losses.sigmoid_cross_entropy(*labelled(critic(p, xr), critic(p, xf)))
            + penalty)

  params = _params()
  del params["head"]
  layers = kd.value_and_grad(shared).discover(params, x_real, x_fake)
  assert {l.name: l.also_under_derivative for l in layers} == {
      "l0": _compat.REVERSE, "l1": _compat.REVERSE}
  with pytest.warns(UserWarning, match=r"rows are missing from A and G"):
    kd.kfac(0.1, 0.9, layers=layers).init(params)
  _, grads, stats = kd.value_and_grad(rerun)(params, x_real, x_fake)
  rows = np.concatenate([np.concatenate([x_real, x_fake]), np.ones((2 * B, 1))], axis=1)
  a = np.asarray(stats["l0"]["A"])
  np.testing.assert_allclose(a if a.ndim == 2 else _unpacked(a, D + 1),
                             rows.T @ rows / (2 * B), rtol=1e-12)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.grad(shared)(
      params, x_real, x_fake))):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
