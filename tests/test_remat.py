"""Rematerialised blocks (`jax.checkpoint` / `nn.remat` / `nnx.remat`): the
capture sees the same layers, gradients and statistics as without remat.

The oracle is the same model without rematerialisation (its statistics are
checked against brute force in test_capture): in float64 the gradients,
statistics and two K-FAC steps (adaptive K-FAC's too, whose curvature products
linearise the rematerialised model) are equal, and the lowered step really
recomputes the blocks (each block's tanh appears twice). Routes: plain JAX
with `kd.remat` (named and unnamed tags, a checkpoint policy, `stack_index=`
inside `lax.scan`), linen `nn.remat` (interception and `kd.linen`), NNX
`nnx.remat` (interception and `kd.nnx`); `kd.remat` on 8 devices (MEM-OPT,
COMM-OPT) against one device without it; and the error that points a plain
`jax.checkpoint` over the parameters to `kd.remat`.

(On XLA:CPU the compiled program is the same with or without remat, for any
JAX model: XLA:CPU drops the recomputation's optimization barriers and merges
it with the forward pass. So the tests look at the lowered program.)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import kfac_jax_dist as kd

import helpers

pytestmark = pytest.mark.usefixtures("x64_module")

D, C, B, BLOCKS = 6, 4, 16, 2
F64 = jnp.float64


def _batch():
  kx, ky = jax.random.split(jax.random.PRNGKey(1))
  return jax.random.normal(kx, (B, 5), F64), jax.random.randint(ky, (B,), 0, C)


# --- the models: two residual tanh blocks between an input and an output layer

def _plain_params():
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * BLOCKS + 2))
  dense = lambda n_in, n_out: {"kernel": helpers.randn(next(keys), (n_in, n_out), 0.4),
                               "bias": jnp.zeros(n_out, F64)}
  return {"inp": dense(5, D), "out": dense(D, C),
          "blocks": [{"fc1": dense(D, D), "fc2": dense(D, D)} for _ in range(BLOCKS)]}


def _plain_block(named: bool):
  def block(p, h, i):
    name = (lambda layer: f"b{i}/{layer}") if named else (lambda layer: None)
    a = jnp.tanh(kd.tags.dense(h, p["fc1"]["kernel"], p["fc1"]["bias"], name=name("fc1")))
    return h + kd.tags.dense(a, p["fc2"]["kernel"], p["fc2"]["bias"], name=name("fc2"))
  return block


def _plain_problem(wrap, named=True):
  block = _plain_block(named)

  def loss_fn(params, x, y):
    h = kd.tags.dense(x, params["inp"]["kernel"], params["inp"]["bias"])
    for i, p in enumerate(params["blocks"]):
      h = wrap(block, static_argnums=(2,))(p, h, i)
    logits = kd.tags.dense(h, params["out"]["kernel"], params["out"]["bias"])
    return kd.losses.softmax_cross_entropy(logits, y)
  return loss_fn, _plain_params(), "tags"


def _linen_problem(wrap, capture):
  dense = nn.Dense if capture == "flax" else kd.linen.Dense

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
      return h + dense(D, name="fc2")(jnp.tanh(dense(D, name="fc1")(h)))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = dense(D, name="inp")(x)
      for i in range(BLOCKS):
        h = wrap(Block)(name=f"b{i}")(h)
      return dense(C, name="out")(h)

  model = Net()
  params = jax.tree_util.tree_map(lambda v: v.astype(F64),
                                  model.init(jax.random.PRNGKey(0), _batch()[0]))
  loss_fn = lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply(p, x), y)
  return loss_fn, params, capture


def _nnx_problem(remat: bool, capture):
  linear = nnx.Linear if capture == "flax" else kd.nnx.Linear

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = linear(D, D, param_dtype=F64, rngs=rngs)
      self.fc2 = linear(D, D, param_dtype=F64, rngs=rngs)

    def __call__(self, h):
      return h + self.fc2(jnp.tanh(self.fc1(h)))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.inp = linear(5, D, param_dtype=F64, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)]) if hasattr(
          nnx, "List") else [Block(rngs) for _ in range(BLOCKS)]
      self.out = linear(D, C, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
      run = lambda block, h: block(h)
      run = nnx.remat(run) if remat else run
      h = self.inp(x)
      for block in self.blocks:
        h = run(block, h)
      return self.out(h)

  graphdef, params = nnx.split(Net(nnx.Rngs(0)), nnx.Param)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(nnx.merge(graphdef, p)(x), y)
  return loss_fn, params, capture


def _no_remat(fun, **kwargs):
  del kwargs
  return fun


_POLICY = jax.checkpoint_policies.checkpoint_dots
PROBLEMS = {
    "plain": lambda remat: _plain_problem(kd.remat if remat else _no_remat),
    "plain-unnamed": lambda remat: _plain_problem(kd.remat if remat else _no_remat,
                                                  named=False),
    "plain-policy": lambda remat: _plain_problem(
        (lambda f, **kw: kd.remat(f, policy=_POLICY, **kw)) if remat else _no_remat),
    "linen-flax": lambda remat: _linen_problem(nn.remat if remat else _no_remat, "flax"),
    "linen-tags": lambda remat: _linen_problem(nn.remat if remat else _no_remat, "tags"),
    "nnx-flax": lambda remat: _nnx_problem(remat, "flax"),
    "nnx-tags": lambda remat: _nnx_problem(remat, "tags"),
}


def _lowered_tanh_count(fun, *args) -> int:
  return jax.jit(fun).lower(*args).as_text().count("stablehlo.tanh")


def _kfac_run(loss_fn, params, capture, steps=2, adaptive=False):
  x, y = _batch()
  grad_fn = kd.value_and_grad(loss_fn, capture=capture)
  layers = grad_fn.discover(params, x, y)
  if adaptive:
    tx = kd.kfac(None, None, damping=1e-1, layers=layers, grad_fn=grad_fn,
                 factor_dtype=F64)
  else:
    tx = kd.kfac(learning_rate=0.1, momentum=0.9, damping=1e-2, layers=layers,
                 factor_dtype=F64)

  def step(p, s):
    loss, grads, stats = grad_fn(p, x, y, opt_state=s)
    extra = {"kfac_batch": (x, y)} if adaptive else {}
    updates, s = tx.update(grads, s, p, kfac_stats=stats, **extra)
    return optax.apply_updates(p, updates), s, loss, grads, stats

  state, out = tx.init(params), []
  for _ in range(steps):
    params, state, loss, grads, stats = jax.jit(step)(params, state)
    out.append((loss, grads, stats))
  return layers, out, params, _lowered_tanh_count(step, params, state)


@pytest.mark.parametrize("name", helpers.slow_unless(   # one of each kind by default
    PROBLEMS, ("plain-policy", "linen-flax", "nnx-tags")))
def test_remat_equals_the_model_without_it(name):
  plain_layers, plain_out, plain_params, plain_tanh = _kfac_run(*PROBLEMS[name](False))
  layers, out, params, tanh = _kfac_run(*PROBLEMS[name](True))
  assert layers.names() == plain_layers.names() and len(layers) == 2 * BLOCKS + 2
  for (loss, grads, stats), (want_loss, want_grads, want_stats) in zip(out, plain_out):
    np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
    helpers.assert_trees_equal(grads, want_grads)
    helpers.assert_trees_equal(stats, want_stats)
  helpers.assert_trees_equal(params, plain_params)
  # The blocks' forward runs again in the backward pass (remat not lost).
  assert tanh == plain_tanh + BLOCKS, (tanh, plain_tanh)


def test_adaptive_kfac_through_kd_remat():
  """Adaptive K-FAC's curvature products (a linearisation of the loss, in the
  curvature trace, where `kd.remat` is `jax.checkpoint`) through remat."""
  _, plain_out, plain_params, _ = _kfac_run(*PROBLEMS["plain"](False), adaptive=True)
  _, out, params, _ = _kfac_run(*PROBLEMS["plain"](True), adaptive=True)
  for (loss, _, _), (want, _, _) in zip(out, plain_out):
    np.testing.assert_allclose(loss, want, rtol=1e-13)
  helpers.assert_trees_equal(params, plain_params, rtol=1e-11)


def test_kd_remat_with_stack_index_inside_scan():
  """`lax.scan` over a `kd.remat` body that takes the stacked leaves as an
  argument and applies block `i` (`stack_index=`), against the unrolled loop."""
  params = _plain_params()
  stacked = jax.tree_util.tree_map(lambda *b: jnp.stack(b), *params["blocks"])
  params = {"inp": params["inp"], "out": params["out"], "blocks": stacked}

  def block(blocks, h, i):
    a = jnp.tanh(kd.tags.dense(h, blocks["fc1"]["kernel"], blocks["fc1"]["bias"],
                               stack_index=i))
    return h + kd.tags.dense(a, blocks["fc2"]["kernel"], blocks["fc2"]["bias"],
                             stack_index=i)

  def make_loss(scanned):
    def loss_fn(params, x, y):
      h = kd.tags.dense(x, params["inp"]["kernel"], params["inp"]["bias"])
      if scanned:
        body = lambda h, i: (kd.remat(block)(params["blocks"], h, i), None)
        h, _ = lax.scan(body, h, jnp.arange(BLOCKS))
      else:
        for i in range(BLOCKS):
          h = block(params["blocks"], h, i)
      logits = kd.tags.dense(h, params["out"]["kernel"], params["out"]["bias"])
      return kd.losses.softmax_cross_entropy(logits, y)
    return loss_fn

  want_layers, want_out, want_params, _ = _kfac_run(make_loss(False), params, "tags")
  layers, out, got_params, _ = _kfac_run(make_loss(True), params, "tags")
  assert layers.names() == want_layers.names()
  for (loss, grads, stats), (want_loss, want_grads, want_stats) in zip(out, want_out):
    np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
    helpers.assert_trees_equal(grads, want_grads)
    helpers.assert_trees_equal(stats, want_stats)
  helpers.assert_trees_equal(got_params, want_params)


def test_kd_remat_outside_the_capture_is_jax_checkpoint():
  loss_fn, params, _ = PROBLEMS["plain"](True)
  x, y = _batch()
  want = jax.grad(PROBLEMS["plain"](False)[0])(params, x, y)
  helpers.assert_trees_equal(jax.grad(loss_fn)(params, x, y), want)
  assert "remat" in str(jax.make_jaxpr(loss_fn)(params, x, y))   # jax.checkpoint's primitive


def test_jax_checkpoint_over_the_parameters_points_to_kd_remat():
  loss_fn, params, _ = _plain_problem(jax.checkpoint)
  with pytest.raises(ValueError, match=r"kd\.remat"):
    kd.value_and_grad(loss_fn).discover(params, *_batch())


@pytest.mark.parametrize("fraction", [1 / 8, pytest.param(1.0, marks=pytest.mark.slow)],
                         ids=["MEM-OPT", "COMM-OPT"])
def test_kd_remat_on_eight_devices_equals_one_device_without_it(fraction):
  """Inside `shard_map` the remat body closes over the capture's probes and
  statistics flag, which vary over the data axis."""
  x, y = _batch()
  runs = []
  for remat, dist in ((False, None), (True, kd.Distribution(
      helpers.data_mesh(), grad_worker_fraction=fraction,
      factor_reduction="reduce_scatter", gradient_reduction="reduce_scatter"))):
    loss_fn, params, _ = PROBLEMS["plain-unnamed"](remat)
    grad_fn = kd.value_and_grad(loss_fn)
    tx = kd.kfac(0.1, momentum=0.9, damping=1e-2, inverse_update_every=2,
                 layers=grad_fn.discover(params, x, y), distribution=dist,
                 factor_dtype=F64)

    def step(p, s, x, y):
      _, grads, stats = grad_fn(p, x, y, opt_state=s)
      updates, s = tx.update(grads, s, p, kfac_stats=stats)
      return optax.apply_updates(p, updates), s

    step, state = helpers.compile_step(step, tx.init(params), dist, 2)
    for _ in range(3):
      params, state = step(params, state, x, y)
    runs.append(params)
  helpers.assert_trees_equal(runs[1], runs[0], rtol=1e-10)


def test_kd_remat_around_the_loss_is_refused():
  """The capture and the curvature products read the registered loss's inputs
  after the pass: a checkpointed function that computes the loss is refused
  at discovery, naming what to checkpoint instead."""
  loss_fn, params, _ = PROBLEMS["plain"](False)
  with pytest.raises(ValueError, match=r"kd\.remat: the checkpointed function computes "
                                       r"the kd\.losses loss.*Checkpoint the model"):
    kd.value_and_grad(kd.remat(loss_fn)).discover(params, *_batch())
