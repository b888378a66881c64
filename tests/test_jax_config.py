"""The library under JAX's strictest global settings that codebases turn on,
`jax_numpy_rank_promotion="raise"` (every broadcast written out) and
`jax_numpy_dtype_promotion="strict"`: the drop-in layers compute what Flax's
own do, and one step of K-FAC (eigen, inverse, EK-FAC, stale statistics,
adaptive), Shampoo and SOAP what it computes by default."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_dist as kd

B, T, CLASSES = 4, 5, 3


class _Net(nn.Module):
  """The tags of a linen model: embed, conv, conv transpose, dense_general,
  dense, and scale_and_shift (layer norm)."""

  @nn.compact
  def __call__(self, ids):
    h = kd.linen.Embed(7, 4)(ids)                                    # [B, T, 4]
    h = jnp.tanh(kd.linen.Conv(3, (3,))(h))
    h = kd.linen.LayerNorm()(kd.linen.ConvTranspose(4, (2,))(h))
    h = jnp.tanh(kd.linen.DenseGeneral(2, axis=(-2, -1))(h))         # [B, 2]
    return kd.linen.Dense(CLASSES)(h)


def _problem():
  k = jax.random.split(jax.random.PRNGKey(0), 2)
  ids = jax.random.randint(k[0], (B, T), 0, 7)
  y = jax.random.randint(k[1], (B,), 0, CLASSES)
  model = _Net()
  params = model.init(jax.random.PRNGKey(1), ids)
  loss = lambda p, ids, y: kd.losses.softmax_cross_entropy(model.apply(p, ids), y)
  return params, (ids, y), kd.value_and_grad(loss)


_OPTIMIZERS = {
    "eigen": lambda grad_fn, layers: kd.kfac(0.1, layers=layers),
    "inverse": lambda grad_fn, layers: kd.kfac(0.1, layers=layers, method="inverse"),
    "ekfac": lambda grad_fn, layers: kd.kfac(0.1, layers=layers,
                                             eigenvalue_correction="ekfac"),
    "stale": lambda grad_fn, layers: kd.kfac(0.1, layers=layers, stale_threshold=0.1),
    "adaptive": lambda grad_fn, layers: kd.kfac(None, layers=layers, grad_fn=grad_fn),
    "shampoo": lambda grad_fn, layers: kd.shampoo(0.1, graft_type="adam", graft_beta2=0.9),
    "soap": lambda grad_fn, layers: kd.soap(0.1),
}


def _step(name: str):
  """One jitted step's updates and loss (traced anew: the setting is read
  when tracing)."""
  params, batch, grad_fn = _problem()
  tx = _OPTIMIZERS[name](grad_fn, grad_fn.discover(params, *batch))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads, stats = grad_fn(params, *batch, opt_state=state)
    if name in ("shampoo", "soap"):
      return loss, tx.update(grads, state, params)[0]
    extra = dict(kfac_batch=batch) if name == "adaptive" else {}
    return loss, tx.update(grads, state, params, kfac_stats=stats, **extra)[0]

  return step(params, state)


_SETTINGS = {"rank_raise": lambda: jax.numpy_rank_promotion("raise"),
             "dtype_strict": lambda: jax.numpy_dtype_promotion("strict")}


@pytest.mark.parametrize("setting", list(_SETTINGS))
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_a_step_under_a_strict_setting(name, setting):
  with _SETTINGS[setting]():
    strict = _step(name)
  jax.tree.map(np.testing.assert_array_equal, strict, _step(name))


_LINEN = [  # (the drop-in, Flax's, the input)
    (kd.linen.Dense(3), nn.Dense(3), (B, 4)),
    (kd.linen.DenseGeneral((2, 3), axis=(-2, -1)), nn.DenseGeneral((2, 3), axis=(-2, -1)),
     (B, T, 4)),
    (kd.linen.Conv(3, (3,)), nn.Conv(3, (3,)), (B, T, 2)),
    (kd.linen.Conv(3, (2, 2)), nn.Conv(3, (2, 2)), (B, 3, 3, 2)),
    (kd.linen.Conv(2, (2, 2, 2)), nn.Conv(2, (2, 2, 2)), (B, 3, 3, 3, 1)),
    (kd.linen.ConvTranspose(3, (2,)), nn.ConvTranspose(3, (2,)), (B, T, 2)),
    (kd.linen.Einsum((4, 3), "btd,de->bte"), nn.Einsum((4, 3), "btd,de->bte"), (B, T, 4)),
    (kd.linen.LayerNorm(), nn.LayerNorm(), (B, T, 4)),
    (kd.linen.RMSNorm(), nn.RMSNorm(), (B, T, 4)),
    (kd.linen.GroupNorm(num_groups=2), nn.GroupNorm(num_groups=2), (B, T, 4)),
    (kd.linen.InstanceNorm(), nn.InstanceNorm(), (B, T, 4)),
    (kd.linen.BatchNorm(use_running_average=False),
     nn.BatchNorm(use_running_average=False), (B, T, 4)),
]


def test_linen_drop_ins_under_rank_promotion_raise():
  """init and apply of each drop-in (and Embed) equal Flax's."""
  x = jax.random.normal(jax.random.PRNGKey(2), (B, T, 3, 3, 1))
  ids = jnp.arange(B * T).reshape(B, T) % 7
  cases = _LINEN + [(kd.linen.Embed(7, 4), nn.Embed(7, 4), None)]
  with jax.numpy_rank_promotion("raise"):
    for ours, theirs, shape in cases:
      inputs = ids if shape is None else x.reshape(-1)[:np.prod(shape)].reshape(shape)
      variables = theirs.init(jax.random.PRNGKey(3), inputs)
      jax.tree.map(np.testing.assert_array_equal, ours.init(jax.random.PRNGKey(3), inputs),
                   variables)
      apply = lambda m, v: m.apply(v, inputs, mutable=["batch_stats"])
      jax.tree.map(np.testing.assert_array_equal, apply(ours, variables),
                   apply(theirs, variables))


_NNX = [  # (the drop-in, Flax's, arguments, the input shape)
    (kd.nnx.Linear, nnx.Linear, (4, 3), (B, 4)),
    (kd.nnx.LinearGeneral, nnx.LinearGeneral, ((T, 4), (2, 3)), (B, T, 4)),
    (kd.nnx.Conv, nnx.Conv, (2, 3, (3,)), (B, T, 2)),
    (kd.nnx.ConvTranspose, nnx.ConvTranspose, (2, 3, (2,)), (B, T, 2)),
    (kd.nnx.Conv, nnx.Conv, (2, 3, (2, 2)), (B, 2, 2, 2)),
    (kd.nnx.LayerNorm, nnx.LayerNorm, (4,), (B, T, 4)),
    (kd.nnx.RMSNorm, nnx.RMSNorm, (4,), (B, T, 4)),
    (kd.nnx.GroupNorm, nnx.GroupNorm, (4, 2), (B, T, 4)),
    (kd.nnx.InstanceNorm, nnx.InstanceNorm, (4,), (B, T, 4)),
    (kd.nnx.BatchNorm, nnx.BatchNorm, (4,), (B, T, 4)),
    (kd.nnx.Embed, nnx.Embed, (7, 4), None),
]


def test_nnx_drop_ins_under_rank_promotion_raise():
  x = jax.random.normal(jax.random.PRNGKey(2), (B * T * 4,))
  with jax.numpy_rank_promotion("raise"):
    for ours, theirs, args, shape in _NNX:
      inputs = (jnp.arange(B * T).reshape(B, T) % 7 if shape is None
                else x[:np.prod(shape)].reshape(shape))
      kw = dict(axis=(-2, -1)) if theirs is nnx.LinearGeneral else {}
      np.testing.assert_array_equal(ours(*args, **kw, rngs=nnx.Rngs(0))(inputs),
                                    theirs(*args, **kw, rngs=nnx.Rngs(0))(inputs))
