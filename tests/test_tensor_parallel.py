"""Tensor-parallel meshes ("data", "model") on 2 x 4 CPU devices: K-FAC and
Shampoo preconditioning each model shard's local shard equal one device
running the same block structure (the sharded layers written as M layers on
their column / row blocks)."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

DATA, M = 2, 4
STEPS = 7            # counts 0..6: inverse at 0, 3, 6; factor-only at 2, 4; plain 1, 5
D_IN, HIDDEN, D_OUT, CLASSES = 6, 8, 6, 5

PARAM_SPECS = {"col": {"kernel": P(None, "model"), "bias": P("model")},
               "row": {"kernel": P("model", None)},
               "rbias": P(),
               "norm": {"scale": P(), "offset": P()},
               "head": {"kernel": P(), "bias": P()}}


def _mesh():
  return Mesh(np.array(jax.devices()[:DATA * M]).reshape(DATA, M), ("data", "model"))


def _problem():
  k = jax.random.split(jax.random.PRNGKey(0), 8)
  params = {"col": {"kernel": jax.random.normal(k[0], (D_IN, HIDDEN)) * 0.5,
                    "bias": jax.random.normal(k[1], (HIDDEN,)) * 0.1},
            "row": {"kernel": jax.random.normal(k[2], (HIDDEN, D_OUT)) * 0.5},
            "rbias": jax.random.normal(k[3], (D_OUT,)) * 0.1,
            "norm": {"scale": 1.0 + 0.1 * jax.random.normal(k[4], (D_OUT,)),
                     "offset": jnp.zeros(D_OUT)},
            "head": {"kernel": jax.random.normal(k[5], (D_OUT, CLASSES)) * 0.5,
                     "bias": jnp.zeros(CLASSES)}}
  x = jax.random.normal(k[6], (32, D_IN))
  y = jax.random.randint(k[7], (32,), 0, CLASSES)
  return params, x, y


def _top(p, z, y):
  """Everything after the row-parallel layer's sum (replicated layers)."""
  z = z + p["rbias"]
  z = (z - z.mean(-1, keepdims=True)) / jnp.sqrt(z.var(-1, keepdims=True) + 1e-5)
  z = kd.tags.scale_and_shift(z, p["norm"]["scale"], p["norm"]["offset"])
  logits = kd.tags.dense(jnp.tanh(z), p["head"]["kernel"], p["head"]["bias"])
  return kd.losses.softmax_cross_entropy(logits, y)


def tp_loss(p, x, y):
  """Megatron MLP: column-parallel then row-parallel Dense, psum over "model"."""
  h = jnp.tanh(kd.tags.dense(x, p["col"]["kernel"], p["col"]["bias"]))
  z = jax.lax.psum(kd.tags.dense(h, p["row"]["kernel"]), "model")
  return _top(p, z, y)


def block_loss(p, x, y):
  """The same model on one device, the sharded layers as M tagged layers on
  their column (row) blocks."""
  hs = [jnp.tanh(kd.tags.dense(x, p[f"col{i}"]["kernel"], p[f"col{i}"]["bias"]))
        for i in range(M)]
  z = sum(kd.tags.dense(hs[i], p[f"row{i}"]["kernel"]) for i in range(M))
  return _top(p, z, y)


def to_blocks(p):
  """TP params (global arrays) → the block model's params."""
  c, r, n = p["col"], p["row"], HIDDEN // M
  out = {k: v for k, v in p.items() if k not in ("col", "row")}
  for i in range(M):
    out[f"col{i}"] = {"kernel": c["kernel"][:, i * n:(i + 1) * n],
                      "bias": c["bias"][i * n:(i + 1) * n]}
    out[f"row{i}"] = {"kernel": r["kernel"][i * n:(i + 1) * n]}
  return out


def _assert_same(trajectory, reference, rtol=2e-4, atol=2e-5):
  for step, (got, want) in enumerate(zip(trajectory, reference)):
    check = functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol,
                              err_msg=f"step {step}")
    jax.tree.map(check, to_blocks(got), want)


def _train(tx_of, loss_fn, params, x, y, dist=None, steps=STEPS):
  """`steps` updates; with `dist`, inside shard_map over both mesh axes, the
  state sharded by kd.partition_specs (checked stable across updates)."""
  grad_fn = kd.value_and_grad(loss_fn)
  tx = tx_of(grad_fn.discover(params, x, y, distribution=dist))
  state = tx.init(params)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    if dist is not None and dist.gradient_reduction == "none":
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  if dist is None:
    step = jax.jit(step)
  else:
    state = kd.shard_state(state, dist.mesh)
    specs = kd.partition_specs(state)
    step = jax.jit(jax.shard_map(
        step, mesh=dist.mesh, in_specs=(PARAM_SPECS, specs, P("data"), P("data")),
        out_specs=(PARAM_SPECS, specs)))
  trajectory, shardings = [], None
  for _ in range(steps):
    params, state = step(params, state, x, y)
    trajectory.append(params)
    if dist is not None:
      now = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.spec), state)
      assert shardings is None or now == shardings, "state sharding changed"
      shardings = now
  return trajectory, state


def _dist(fraction=1.0, **kw):
  return kd.Distribution(_mesh(), axis="data", grad_worker_fraction=fraction,
                         model_axis="model", param_specs=PARAM_SPECS, **kw)


def _kfac(layers, dist=None, method="eigen"):
  return kd.kfac(0.1, layers=layers, damping=1e-2, factor_update_every=2,
                 inverse_update_every=3, kl_clip=1e-2, method=method,
                 distribution=dist)


@functools.cache
def _kfac_reference(method="eigen"):
  params, x, y = _problem()
  return _train(functools.partial(_kfac, method=method), block_loss, to_blocks(params),
                x, y)


@pytest.mark.parametrize("fraction,factor_reduction,gradient_reduction", [
    (1.0, "reduce_scatter", "none"), (1 / 2, "all_reduce", "none"),
    (1 / 2, "reduce_scatter", "reduce_scatter")],
    ids=["COMM-OPT", "MEM-OPT", "MEM-OPT-SP-NGD"])
def test_kfac_tensor_parallel_equals_block_model(fraction, factor_reduction,
                                                 gradient_reduction):
  params, x, y = _problem()
  dist = _dist(fraction, factor_reduction=factor_reduction,
               gradient_reduction=gradient_reduction)
  trajectory, _ = _train(lambda layers: _kfac(layers, dist), tp_loss, params, x, y, dist)
  reference, _ = _kfac_reference()
  _assert_same(trajectory, reference)
