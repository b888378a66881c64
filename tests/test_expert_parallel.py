"""Mixture of experts under K-FAC: stacked experts `[E, d, f]` applied per
expert (`kd.tags.dense(..., stack_index=e)` under `jax.vmap`, a capacity
`row_mask` inside), on one device and expert-parallel on 8.

Expert parallelism (docs/distributed.md, "Expert parallelism"): a
`("data", "expert")` mesh, the experts sharded over "expert", the tokens over
both axes and sent to their expert with `lax.all_to_all`. An expert device's
layer receives the cotangents of its `E` peers' local losses, so its gradient
and its `G` are `E` times the global mean loss's; the replicated layers'
statistics are each device's own tokens'. The oracle: the same routing (each
device's tokens routed within their group, `C` slots per expert) written on
one device over the whole batch, in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

import helpers

E, D, F, CLASSES, C = 4, 6, 8, 5, 3      # experts, width, expert width, classes, capacity
DATA, TOKENS = 2, 8                      # data-parallel replicas, tokens per device
GROUPS = DATA * E                        # devices = routing groups
OUT = np.random.default_rng(5).normal(size=(F, D)) / 3     # a fixed projection back


def _params() -> dict:
  rng = np.random.default_rng(0)
  return jax.tree.map(jnp.asarray, {
      "router": {"kernel": rng.normal(size=(D, E)), "bias": np.zeros(E)},
      "experts": {"kernel": rng.normal(size=(E, D, F)) / 2,
                  "bias": rng.normal(size=(E, F)) / 10},
      "head": {"kernel": rng.normal(size=(D, CLASSES)) / 2, "bias": np.zeros(CLASSES)}})


def _route(p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Top-1 routing of one group's tokens `[T, D]` (GShard): one-hot
  `dispatch` and gated `combine` `[T, E, C]`, tokens past an expert's `C`
  slots dropped."""
  probs = jax.nn.softmax(kd.tags.dense(x, p["router"]["kernel"], p["router"]["bias"],
                                       name="router"))
  chosen = jax.nn.one_hot(jnp.argmax(probs, -1), E)
  slot = jnp.cumsum(chosen, 0).astype(jnp.int32) - 1
  dispatch = jax.nn.one_hot(jnp.where(chosen > 0, slot, C), C)     # slot C: dropped
  return dispatch, dispatch * probs[..., None]


def _experts(p: dict, rows: jax.Array, kept: jax.Array) -> jax.Array:
  """Each expert `e` on its rows `[E, R, D]` (`kept`: the filled slots):
  block `e` of the stacked kernel (of the local shard's blocks, under expert
  parallelism: its one expert is block 0), its empty slots out of `A`."""
  def one(e, x, mask):
    with kd.tags.row_mask(mask):
      return kd.tags.dense(x, p["experts"]["kernel"], p["experts"]["bias"],
                           stack_index=e, name="experts")
  return jnp.tanh(jax.vmap(one)(jnp.arange(rows.shape[0]), rows, kept)) @ OUT


def _head(p: dict, x, combine, expert_out, y) -> jax.Array:
  mixed = x + jnp.einsum("...tec,...ecd->...td", combine, expert_out)
  return kd.losses.softmax_cross_entropy(
      kd.tags.dense(mixed, p["head"]["kernel"], p["head"]["bias"], name="head"), y)


def _one_device_loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  """Every group's tokens `[GROUPS, T, D]` routed within the group; expert
  `e` runs on the slots of all groups."""
  dispatch, combine = jax.vmap(lambda t: _route(p, t))(x)
  rows = jnp.einsum("gtec,gtd->egcd", dispatch, x).reshape(E, GROUPS * C, D)
  kept = dispatch.sum(1).transpose(1, 0, 2).reshape(E, GROUPS * C) > 0
  out = _experts(p, rows, kept).reshape(E, GROUPS, C, D).transpose(1, 0, 2, 3)
  return _head(p, x, combine, out, y)


def _expert_parallel_loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  """One device's tokens `[T, D]`; its expert (the local block of the
  kernel) runs on the slots all_to_all brings from its `E` peers."""
  dispatch, combine = _route(p, x)
  rows = jnp.einsum("tec,td->ecd", dispatch, x)
  kept = dispatch.sum(0) > 0
  rows = jax.lax.all_to_all(rows, "expert", 0, 1, tiled=True)          # [1, E·C, D]
  kept = jax.lax.all_to_all(kept, "expert", 0, 1, tiled=True)
  out = jax.lax.all_to_all(_experts(p, rows, kept), "expert", 1, 0, tiled=True)
  return _head(p, x, combine, out, y)


def _batch() -> tuple:
  kx, ky = jax.random.split(jax.random.PRNGKey(1))
  return (jax.random.normal(kx, (GROUPS, TOKENS, D), jnp.float64),
          jax.random.randint(ky, (GROUPS, TOKENS), 0, CLASSES))


OPTIONS = dict(learning_rate=0.1, damping=1e-2, factor_update_every=1,
               inverse_update_every=1, factor_dtype=jnp.float64)
STEPS = 2


def _one_device() -> dict:
  params, batch = _params(), _batch()
  grad_fn = kd.value_and_grad(_one_device_loss)
  layers = grad_fn.discover(params, *batch)
  assert [(l.name, l.stack, l.counted) for l in layers] == [
      ("router", (), False), ("experts", (E,), True), ("head", (), False)]
  tx = kd.kfac(layers=layers, **OPTIONS)

  @jax.jit
  def step(params, state):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state
  state = tx.init(params)
  for _ in range(STEPS):
    params, state = step(params, state)
  return params


@pytest.mark.parametrize("fraction", helpers.slow_unless((1.0, 0.5), (0.5,)))
def test_expert_parallel_equals_one_device(fraction):
  """Two float64 steps on a `(data 2, expert 4)` mesh, reduced as
  distributed.md's recipe says (the experts' gradients and `G` divided by
  `E`, the replicated layers' gradients and statistics averaged over
  "expert"), equal the one-device run; under COMM-OPT and MEM-OPT."""
  with jax.enable_x64(True):
    want = _one_device()
    params, (x, y) = _params(), _batch()
    mesh = helpers.mesh((DATA, E), ("data", "expert"))
    specs = {"router": P(), "experts": P("expert"), "head": P()}
    param_specs = {k: {"kernel": s, "bias": s} for k, s in specs.items()}
    dist = kd.Distribution(mesh, axis="data", model_axis="expert",
                           param_specs=param_specs, grad_worker_fraction=fraction)
    grad_fn = kd.value_and_grad(_expert_parallel_loss)
    tokens = P(("data", "expert"))
    x, y = x.reshape(-1, D), y.reshape(-1)
    layers = grad_fn.discover(params, x, y, distribution=dist)
    tx = kd.kfac(layers=layers, distribution=dist, **OPTIONS)
    state = kd.shard_state(tx.init(params), mesh)

    def step(params, state, x, y):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      grads = jax.lax.pmean(grads, "data")
      grads = {k: jax.tree.map(lambda g: g / E, g) if k == "experts"
               else jax.lax.pmean(g, "expert") for k, g in grads.items()}
      stats = {k: {**s, "G": s["G"] / E} if k == "experts"
               else jax.lax.pmean(s, "expert") for k, s in stats.items()}
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), state
    step = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(param_specs, kd.partition_specs(state), tokens, tokens),
        out_specs=(param_specs, kd.partition_specs(state))))
    for _ in range(STEPS):
      params, state = step(params, state, x, y)
    assert float(jnp.max(jnp.abs(want["experts"]["kernel"]
                                 - _params()["experts"]["kernel"]))) > 1e-3
    helpers.assert_trees_equal(params, want, rtol=1e-9)
