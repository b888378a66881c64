"""K-FAC without a `kd.Distribution` inside `jax.pmap` or `shard_map` (the
data-parallel loops that kfac-jax's users, FermiNet's among them, write):
each device preconditions with factors of the statistics it is given, so
statistics that vary over a typed mesh axis are refused, and where JAX does
not type them (pmap, `check_vma=False`) a warning says to average them. The
recipe it gives, `pmean` of the statistics beside the gradients, equals the
single-device run on the whole batch (float64, 8 CPU devices)."""

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers

pytestmark = pytest.mark.usefixtures("x64_module")

DEVICES, PER_DEVICE, D_IN, D_H, CLASSES = 8, 4, 5, 6, 3


def _problem():
  rng = np.random.default_rng(0)
  params = {"l0": {"w": jnp.asarray(rng.normal(size=(D_IN, D_H)) / 2),
                   "b": jnp.zeros(D_H)},
            "l1": {"w": jnp.asarray(rng.normal(size=(D_H, CLASSES)) / 2)}}
  x = jnp.asarray(rng.normal(size=(DEVICES * PER_DEVICE, D_IN)))
  y = jnp.asarray(rng.integers(0, CLASSES, DEVICES * PER_DEVICE))
  return params, x, y


def _loss(p, x, y):
  h = jnp.tanh(kd.tags.dense(x, p["l0"]["w"], p["l0"]["b"], name="l0"))
  return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["l1"]["w"], name="l1"), y)


GRAD_FN = kd.value_and_grad(_loss)


def _tx(params, x, y):
  return kd.kfac(0.1, 0.9, damping=1e-2, inverse_update_every=2, factor_dtype=jnp.float64,
                 layers=GRAD_FN.discover(params, x, y))


def _step(tx, axis=None, average_stats=False):
  def step(p, state, x, y):
    _, grads, stats = GRAD_FN(p, x, y, opt_state=state)
    if axis is not None:
      grads = jax.lax.pmean(grads, axis)
      stats = jax.lax.pmean(stats, axis) if average_stats else stats
    updates, state = tx.update(grads, state, p, kfac_stats=stats)
    return optax.apply_updates(p, updates), state
  return step


def test_shard_map_without_a_distribution_refuses_local_statistics():
  """Before: JAX's "cond branches must have equal output types"."""
  params, x, y = _problem()
  tx = _tx(params, x, y)
  mesh = helpers.data_mesh(DEVICES)
  step = jax.shard_map(_step(tx, "data"), mesh=mesh,
                       in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()))
  with pytest.raises(ValueError, match=r"kfac_stats vary over mesh axes \('data',\).*"
                                       r"no distribution.*kd.Distribution"):
    jax.jit(step)(params, tx.init(params), x, y)


def test_pmap_warns_and_averaged_statistics_equal_the_whole_batch():
  """Gradients averaged alone: a warning (before: silent, the replicas'
  parameters 0.2 apart after one step); statistics averaged too: every
  device's parameters equal the single-device run on the whole batch."""
  params, x, y = _problem()
  tx = _tx(params, x, y)
  replicate = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * DEVICES), tree)
  xs, ys = x.reshape(DEVICES, PER_DEVICE, D_IN), y.reshape(DEVICES, PER_DEVICE)
  with pytest.warns(UserWarning, match=r"inside jax.pmap or shard_map\(check_vma=False\) "
                                       r"\(axes \('i',\)\).*jax.lax.pmean\(stats"):
    jax.pmap(_step(tx, "i"), axis_name="i")(replicate(params), replicate(tx.init(params)),
                                           xs, ys)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    step = jax.pmap(_step(tx, "i", average_stats=True), axis_name="i")
    replicated, states = replicate(params), replicate(tx.init(params))
    single, state = params, tx.init(params)
    for _ in range(3):
      replicated, states = step(replicated, states, xs, ys)
      single, state = jax.jit(_step(tx))(single, state, x, y)
  for device in range(DEVICES):
    helpers.assert_trees_equal(jax.tree.map(lambda a: a[device], replicated), single,
                               rtol=1e-11)


def test_monte_carlo_targets_are_drawn_per_device_under_pmap():
  """`fisher="mc"` with one key for every device (the same rows on each, to
  see it): each device draws the targets of `fold_in(key, its index)`, as a
  shard does inside `shard_map` (before: every device drew the same ones,
  their `G`s equal)."""
  params, x, y = _problem()
  grad_fn, key = kd.value_and_grad(_loss, fisher="mc"), jax.random.PRNGKey(5)
  rows = (jnp.stack([x[:PER_DEVICE]] * DEVICES), jnp.stack([y[:PER_DEVICE]] * DEVICES))
  stats = jax.pmap(lambda x, y: grad_fn(params, x, y, rng=key)[2], axis_name="i")(*rows)
  for device in range(DEVICES):
    want = grad_fn(params, x[:PER_DEVICE], y[:PER_DEVICE],
                   rng=jax.random.fold_in(key, device))[2]
    helpers.assert_trees_equal(jax.tree.map(lambda s: s[device], stats), want,
                               rtol=1e-10)
  assert not np.allclose(stats["l1"]["G"][0], stats["l1"]["G"][1])
