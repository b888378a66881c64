"""Training-loop features: micro-batch accumulation, loss scaling, mixed precision."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac.state import find_states
from helpers import compile_step


class Net(nn.Module):
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    x = kd.linen.Embed(13, 8, **kw)(tokens)
    x = nn.tanh(kd.linen.Dense(16, **kw)(x))
    x = kd.linen.LayerNorm(**kw)(x)
    return kd.linen.Dense(13, **kw)(x)


def _problem(dtype=jnp.float32, param_dtype=jnp.float32):
  tokens = jax.random.randint(jax.random.PRNGKey(1), (16, 5), 0, 13)
  mask = (jax.random.uniform(jax.random.PRNGKey(2), (16, 4)) > 0.3).astype(jnp.float32)
  model = Net(dtype, param_dtype)
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])

  def loss_fn(p, tokens, mask):
    logits = model.apply(p, tokens[:, :-1])
    return kd.losses.softmax_cross_entropy(logits, tokens[:, 1:], mask=mask)
  return loss_fn, params, tokens, mask


def _close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_accumulated_micro_batches_equal_one_batch(fisher):
  """Masks give the micro-batches different example counts n_i: G, F and the
  gradients must be n_i-weighted, A plainly averaged."""
  loss_fn, params, tokens, mask = _problem()
  grad_fn = kd.value_and_grad(loss_fn, fisher=fisher)
  rng = jax.random.PRNGKey(3) if fisher == "mc" else None
  whole = jax.jit(lambda p, t, m: grad_fn(p, t, m, rng=rng))(params, tokens, mask)
  acc = jax.jit(lambda p, t, m: grad_fn.accumulate(p, t, m, micro_batches=4, rng=rng))(
      params, tokens, mask)
  _close(acc[0], whole[0])
  _close(acc[1], whole[1])
  if fisher == "empirical":
    _close(acc[2], whole[2])
  else:             # MC targets differ per slice: same A, G of the same scale
    for name in whole[2]:
      if "A" in whole[2][name]:
        _close(acc[2][name]["A"], whole[2][name]["A"])
  with pytest.raises(ValueError, match="divisible by 3"):
    grad_fn.accumulate(params, tokens, mask, micro_batches=3)


def test_accumulation_inside_shard_map_equals_global_batch():
  loss_fn, params, tokens, _ = _problem()
  mask = jnp.ones((16, 4))
  grad_fn = kd.value_and_grad(loss_fn)
  mesh = helpers.data_mesh(4)
  dist = kd.Distribution(mesh, factor_reduction="reduce_scatter")

  def run(dist, accumulate):
    tx = kd.kfac(0.05, layers=grad_fn.discover(params, tokens, mask), damping=1e-2,
                 distribution=dist)
    state = tx.init(params)

    def step(params, state, tokens, mask):
      if accumulate:
        _, grads, stats = grad_fn.accumulate(params, tokens, mask, micro_batches=2,
                                             opt_state=state)
      else:
        _, grads, stats = grad_fn(params, tokens, mask, opt_state=state)
      if dist is not None:
        grads = jax.lax.pmean(grads, "data")
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), state

    step, state = compile_step(step, state, dist, 2)
    p = params
    for _ in range(3):
      p, state = step(p, state, tokens, mask)
    return p

  _close(run(dist, True), run(None, False), rtol=2e-4, atol=2e-5)


def test_loss_scaling_unscales_gradients_and_statistics():
  loss_fn, params, tokens, mask = _problem()
  grad_fn = kd.value_and_grad(loss_fn)
  ref = grad_fn(params, tokens, mask)
  scaled = grad_fn(params, tokens, mask, loss_scale=1024.0)
  _close(scaled[0], ref[0])
  _close(scaled[1], ref[1], rtol=1e-5, atol=1e-7)
  _close(scaled[2], ref[2], rtol=1e-5, atol=1e-7)


def test_float16_with_loss_scaling_recovers_small_cotangents():
  """float16 activations with tiny cotangents (here a loss scaled by 1e-6, as a
  mean over very many examples would give): without loss scaling they
  underflow and G is wrong; with a loss scale they match float32."""
  def tiny(loss_fn):
    return lambda *a: 1e-6 * loss_fn(*a)
  loss_fn32, params32, tokens, mask = _problem()
  loss_fn16, params16, _, _ = _problem(dtype=jnp.float16)
  ref = kd.value_and_grad(tiny(loss_fn32))(params32, tokens, mask)[2]
  plain = kd.value_and_grad(tiny(loss_fn16))(params16, tokens, mask)[2]
  scaled = kd.value_and_grad(tiny(loss_fn16))(params16, tokens, mask,
                                               loss_scale=2.0 ** 20)[2]

  def error(stats, name, key):
    value = np.asarray(ref[name][key])
    return np.abs(np.asarray(stats[name][key], np.float32) - value).max() / np.abs(
        value).max()
  for name, stat in ref.items():
    for key in stat:
      assert error(scaled, name, key) < 0.02, (name, key)
  assert max(error(plain, name, "G") for name in ref if "G" in ref[name]) > 0.1


def test_bfloat16_params_and_activations_keep_float32_factors():
  loss_fn, params, tokens, mask = _problem(jnp.bfloat16, jnp.bfloat16)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, tokens, mask), damping=1e-2,
               inverse_update_every=2)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads, stats = grad_fn(params, tokens, mask, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, loss, updates

  losses = []
  for _ in range(8):
    params, state, loss, updates = step(params, state)
    losses.append(float(loss))
  kstate = find_states(state)[0]
  assert kstate.factors.dtype == jnp.float32 and kstate.second_order.dtype == jnp.float32
  assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
