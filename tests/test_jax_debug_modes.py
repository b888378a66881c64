"""JAX's debugging modes on healthy runs: `jax.checking_leaks` (no tracer of
the library's outlives its trace) and `jax.debug_nans` (no NaN made on
purpose where JAX checks: inside jit, the outputs; outside jit, every
operation). A user turns these on to find their own model's fault; the
optimizer must not trip them on a step that has none.

Known and documented (troubleshooting.md): outside jit, the NaN placeholders
returned as the statistics of a step that computes none trip `debug_nans`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_dist as kd

import helpers


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return kd.linen.Dense(3)(jnp.tanh(kd.linen.Dense(5)(x)))


def _problem() -> tuple:
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  y = jnp.asarray([0, 1, 2, 0, 1, 2, 0, 1])
  model = _Mlp()
  params = model.init(jax.random.PRNGKey(0), x)
  grad_fn = kd.value_and_grad(
      lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply(p, x), y))
  return grad_fn, params, x, y


OPTIONS = {
    "kfac": dict(learning_rate=0.1),
    "kfac_every_2": dict(learning_rate=0.1, factor_update_every=2, inverse_update_every=2),
    "ekfac": dict(learning_rate=0.1, eigenvalue_correction="ekfac"),
    "adaptive": dict(learning_rate=None, momentum=None),
    "adaptive_damping": dict(learning_rate=None, momentum=None, adapt_damping=True,
                             damping_adaptation_interval=2),
    "momentum_adapted": dict(learning_rate=0.1, momentum=None),
}


def _steps(name: str, jitted: bool, steps: int = 3) -> None:
  grad_fn, params, x, y = _problem()
  tx = kd.kfac(layers=grad_fn.discover(params, x, y), grad_fn=grad_fn, **OPTIONS[name])
  state = tx.init(params)

  def step(params, state):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    return jax.tree.map(jnp.add, params, updates), state
  step = jax.jit(step) if jitted else step
  for _ in range(steps):
    params, state = step(params, state)
  assert int(kd.find_states(state)[0].skipped) == 0


class _Broad(nn.Module):
  """Every kind of tagged layer's backward pass, a scan and a remat."""

  @nn.compact
  def __call__(self, ids: jax.Array, img: jax.Array) -> jax.Array:
    h = kd.linen.Conv(3, (3, 3))(img).reshape(img.shape[0], -1)
    h = jnp.concatenate([kd.linen.LayerNorm()(h),
                         kd.linen.Embed(10, 4)(ids).reshape(ids.shape[0], -1)], -1)
    h = kd.linen.DenseGeneral((2, 3))(h).reshape(h.shape[0], -1)
    block = lambda: nn.remat(kd.linen.Dense)(6)
    h, _ = nn.scan(lambda module, h, _: (jnp.tanh(module(h)), None),
                   variable_axes={"params": 0}, split_rngs={"params": True},
                   length=2)(block(), h, None)
    return kd.linen.Dense(3)(h)


# One mode by default (CI time: each case runs several steps with leak checks).
@pytest.mark.parametrize("name, fisher", helpers.slow_unless(
    [("kfac", "mc"), ("ekfac", "empirical"), ("adaptive_damping", "empirical")],
    [("kfac", "mc")]))
def test_no_tracer_outlives_its_trace(name, fisher):
  """Discovery kept its whole trace (the registered loss's tracers) in a
  list the traced function closed over, and the tags' backward passes kept
  the capture's (its losses, probes and flag, a bias): every discovery and
  every jitted step reported a leaked trace."""
  rng = np.random.default_rng(0)
  ids, y = jnp.asarray(rng.integers(0, 10, (8, 2))), jnp.arange(8) % 3
  img = jnp.asarray(rng.normal(size=(8, 5, 5, 2)), jnp.float32)
  model = _Broad()
  with jax.checking_leaks():
    params = model.init(jax.random.PRNGKey(0), ids, img)
    grad_fn = kd.value_and_grad(lambda p, ids, img, y: kd.losses.softmax_cross_entropy(
        model.apply(p, ids, img), y), fisher=fisher)
    tx = kd.kfac(layers=grad_fn.discover(params, ids, img, y), grad_fn=grad_fn,
                 **OPTIONS[name])
    state = tx.init(params)

    @jax.jit
    def step(params, state, key):
      _, grads, stats = grad_fn(params, ids, img, y, opt_state=state, rng=key)
      return tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(ids, img, y))
    step(params, state, jax.random.PRNGKey(1))
    grad_fn.accumulate(params, ids, img, y, opt_state=state, micro_batches=2,
                       rng=jax.random.PRNGKey(1))


EAGER = ("kfac_every_2", "adaptive", "momentum_adapted")


@pytest.mark.parametrize("name, jitted", [(n, True) for n in OPTIONS]
                         + [(n, False) for n in EAGER],
                         ids=[f"{n}-jit" for n in OPTIONS] + [f"{n}-eager" for n in EAGER])
def test_healthy_steps_make_no_nan(name, jitted):
  """Before: the capture built its NaN placeholders on every step, also
  where the statistics are computed (eager, factors every 2 steps); adaptive K-FAC's state held
  ρ = NaN until its first damping adaptation (jit: every step without
  one), and its first step solved a singular 2 × 2 system whose NaNs a
  select dropped (eager)."""
  with jax.debug_nans(True):     # eagerly, one step: its statistics are computed
    _steps(name, jitted, steps=3 if jitted else 1)


def test_first_rho_is_zero():
  """ρ before any damping adaptation: 0 (`kd.adapted_values`)."""
  grad_fn, params, x, y = _problem()
  tx = kd.kfac(None, None, layers=grad_fn.discover(params, x, y), grad_fn=grad_fn)
  assert float(kd.adapted_values(tx.init(params))["rho"]) == 0.0
