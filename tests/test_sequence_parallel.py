"""A batch split over two mesh axes, `("data", "seq")` (sequence / context
parallelism: each device holds `[B/D, T/S, d]` tokens), with the
`Distribution` over "data" and the statistics averaged over "seq" by the
step (docs/distributed.md, "Several batch axes").

Oracle: the single-device run on the whole `[B, T]` batch, in float64,
with a padding mask that differs between sequence shards.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers

B, T, D, CLASSES = 8, 8, 3, 4
BATCH = P("data", "seq")


def _problem():
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"h": helpers.randn(k[0], (D, 6), 0.7), "out": helpers.randn(k[1], (6, CLASSES))}
  x = helpers.randn(k[2], (B, T, D))
  y = jax.random.randint(k[3], (B, T), 0, CLASSES)
  lengths = jnp.array([8, 3, 5, 1, 8, 6, 2, 7])        # padding differs between shards
  mask = (jnp.arange(T)[None] < lengths[:, None]).astype(jnp.float64)
  return params, x, y, mask


def _loss(p, x, y, mask):
  h = jnp.tanh(kd.tags.dense(x, p["h"], name="h"))
  return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["out"], name="out"), y,
                                         mask=mask)


def _run(dist=None, reduce_statistics=True, steps=3):
  params, x, y, mask = _problem()
  grad_fn = kd.value_and_grad(_loss)
  layers = grad_fn.discover(params, x, y, mask)
  tx = kd.kfac(0.1, layers=layers, damping=1e-2, factor_update_every=1,
               inverse_update_every=1, factor_dtype=jnp.float64, distribution=dist)
  state = tx.init(params)

  def step(p, state, x, y, mask):
    _, grads, stats = grad_fn(p, x, y, mask, opt_state=state)
    if dist is not None:
      grads = jax.lax.pmean(grads, ("data", "seq"))
      if reduce_statistics:
        stats = jax.lax.pmean(stats, "seq")
    updates, state = tx.update(grads, state, p, kfac_stats=stats)
    return optax.apply_updates(p, updates), state

  if dist is None:
    step = jax.jit(step)
  else:
    state = kd.shard_state(state, dist.mesh)
    specs = kd.partition_specs(state)
    step = jax.jit(jax.shard_map(step, mesh=dist.mesh,
                                 in_specs=(P(), specs, BATCH, BATCH, BATCH),
                                 out_specs=(P(), specs)))
  for _ in range(steps):
    params, state = step(params, state, x, y, mask)
  return params


@pytest.mark.parametrize("shape,fraction", [((2, 4), 1.0), ((4, 2), 1 / 4)],
                         ids=["COMM-OPT-2x4", "MEM-OPT-4x2"])
def test_sequence_parallel_equals_the_whole_batch(shape, fraction):
  """Statistics averaged over "seq" by the step: three steps equal the single
  device's on the whole batch (every token once in `A` and `G`, the masked
  loss's weights the global batch's)."""
  with jax.enable_x64(True):
    want = _run()
    mesh = helpers.mesh(shape, ("data", "seq"))
    got = _run(kd.Distribution(mesh, axis="data", grad_worker_fraction=fraction))
    helpers.assert_trees_equal(got, want, rtol=1e-10)


def test_statistics_left_varying_over_another_axis_are_refused():
  """Forgetting the statistics' average over "seq" (each "seq" device would
  keep factors of its own tokens) is refused at update, naming the pmean; a
  tuple of batch axes for the Distribution is refused naming the recipe."""
  mesh = helpers.mesh((2, 4), ("data", "seq"))
  with jax.enable_x64(True):
    with pytest.raises(ValueError, match=r"kfac_stats vary over mesh axes \('seq',\).*"
                                         r"jax.lax.pmean\(stats, \('seq',\)\)"):
      _run(kd.Distribution(mesh, axis="data"), reduce_statistics=False, steps=1)
  with pytest.raises(ValueError, match=r"axis=\('data', 'seq'\) names several mesh axes"
                                       r".*Several batch axes"):
    kd.Distribution(mesh, axis=("data", "seq"))
  with pytest.raises(ValueError, match=r"axis takes a mesh axis name, a str: axis='data'"):
    kd.Distribution(mesh, axis=("data",))


def test_untyped_shard_map_is_warned_of():
  """Inside `shard_map(check_vma=False)` JAX does not type the statistics:
  an axis bound besides the Distribution's is warned of."""
  mesh = helpers.mesh((2, 4), ("data", "seq"))
  with jax.enable_x64(True):
    params, x, y, mask = _problem()
    grad_fn = kd.value_and_grad(_loss)
    dist = kd.Distribution(mesh, axis="data")
    tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y, mask), distribution=dist)
    state = kd.shard_state(tx.init(params), mesh)
    specs = kd.partition_specs(state)

    def step(p, state, x, y, mask):
      _, grads, stats = grad_fn(p, x, y, mask, opt_state=state)
      grads, stats = jax.lax.pmean((grads, stats), ("data", "seq"))
      return tx.update(grads, state, p, kfac_stats=stats)[0]

    shard_map = functools.partial(jax.shard_map, check_vma=False)
    with pytest.warns(UserWarning, match=r"shard_map\(check_vma=False\) over axes "
                                         r"\('seq',\).*jax.lax.pmean"):
      jax.jit(shard_map(step, mesh=mesh, in_specs=(P(), specs, BATCH, BATCH, BATCH),
                        out_specs=P())).lower(params, state, x, y, mask)
