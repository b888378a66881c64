"""Several registered losses (a multi-task model's heads, ACKTR's policy and
value heads) against float64 brute force: their Gauss-Newton matrices add up,
each times the returned value's derivative in it, in the exact curvature
products, the Monte Carlo `G` (in expectation) and the empirical `G`; the
statistics of masked heads on 8 devices and over micro-batches equal one
device's whole batch; adaptive K-FAC's first step solves the summed model."""

from __future__ import annotations

import helpers
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

BATCH = 16
LAYERS = ("trunk", "policy", "value", "flags")


pytestmark = pytest.mark.usefixtures("x64_module")


def _params():
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  w = lambda key, shape: 0.6 * jax.random.normal(key, shape, jnp.float64)
  return {"trunk": {"kernel": w(k[0], (5, 7)), "bias": 0.1 * w(k[1], (7,))},
          "policy": {"kernel": w(k[2], (7, 3))}, "value": {"kernel": w(k[3], (7, 2))},
          "flags": {"kernel": w(k[4], (7, 4))}}


def _batch():
  """Inputs, class labels, regression targets, binary flags and two masks
  that keep different examples (and numbers of them on each device of 8)."""
  k = jax.random.split(jax.random.PRNGKey(1), 4)
  x = jax.random.normal(k[0], (BATCH, 5), jnp.float64)
  labels = jax.random.randint(k[1], (BATCH,), 0, 3)
  targets = jax.random.normal(k[2], (BATCH, 2), jnp.float64)
  flags = jax.random.bernoulli(k[3], 0.4, (BATCH, 4)).astype(jnp.float64)
  policy_mask = jnp.ones(BATCH).at[jnp.array([2, 3, 9])].set(0.0)
  value_mask = jnp.ones(BATCH).at[jnp.array([0, 5, 6, 7, 12])].set(0.0)
  return x, labels, targets, flags, policy_mask, value_mask


def _heads(params, x, dense=kd.tags.dense, outputs=None):
  """The trunk and three heads; `outputs` adds a perturbation to each
  layer's output (the brute force's handle on the cotangents)."""
  add = (lambda name, z: z) if outputs is None else (lambda name, z: z + outputs[name])
  h = jnp.tanh(add("trunk", dense(x, params["trunk"]["kernel"], params["trunk"]["bias"])))
  return {name: add(name, dense(h, params[name]["kernel"])) for name in LAYERS[1:]}


def _combine(policy, value, flags):
  """The returned value: the derivatives in the three losses are 1, 0.5 and
  1/(1 + flags) (a log of one of them)."""
  return policy + 0.5 * value + jnp.log1p(flags)


def _signed(policy, value, flags):
  """A likelihood maximised (a GAN's minimax generator's): c = −3 for one."""
  return policy - 3.0 * value + jnp.log1p(flags)


def _linear(policy, value, flags):
  """A returned value whose mean over devices is the whole batch's."""
  return policy + 0.5 * value + 2.0 * flags


def _loss_fn(masked: bool, combine=_combine):
  def loss_fn(params, x, labels, targets, flags, policy_mask, value_mask):
    z = _heads(params, x)
    return combine(
        kd.losses.softmax_cross_entropy(z["policy"], labels,
                                        mask=policy_mask if masked else None),
        kd.losses.squared_error(z["value"], targets, mask=value_mask if masked else None),
        kd.losses.sigmoid_cross_entropy(z["flags"], flags))
  return loss_fn


def _plain(outputs_or_none, params, batch, masked: bool):
  """`[L_policy, L_value, L_flags]` and the heads' outputs, in plain jnp."""
  x, labels, targets, flags, policy_mask, value_mask = batch
  plain_dense = lambda x, w, b=None: x @ w + (0 if b is None else b)
  z = _heads(params, x, plain_dense, outputs_or_none)
  masks = (policy_mask, value_mask, None) if masked else (None, None, None)
  per_example = (-jnp.take_along_axis(jax.nn.log_softmax(z["policy"]), labels[:, None],
                                      -1)[:, 0],
                 0.5 * jnp.sum((z["value"] - targets) ** 2, -1),
                 jnp.sum(optax.sigmoid_binary_cross_entropy(z["flags"], flags), -1))
  mean = lambda l, m: jnp.mean(l) if m is None else jnp.sum(l * m) / jnp.sum(m)
  return jnp.stack([mean(l, m) for l, m in zip(per_example, masks)]), z, masks


def _coefficients(params, batch, masked, combine=_combine):
  values = _plain(None, params, batch, masked)[0]
  return np.asarray(jax.grad(lambda v: combine(*v))(values))


def _hessians(z):
  """Each head's per-example output Hessian."""
  p = np.asarray(jax.nn.softmax(z["policy"]))
  s = np.asarray(jax.nn.sigmoid(z["flags"]))
  return {"policy": np.stack([np.diag(q) - np.outer(q, q) for q in p]),
          "value": np.broadcast_to(np.eye(2), (BATCH, 2, 2)),
          "flags": np.stack([np.diag(q * (1 - q)) for q in s])}


def _dense_ggn(params, batch, masked, combine=_combine):
  """C = Σ_l |c_l| (1/n_l) Σ_x w_x J_lxᵀ H_lx J_lx from the full Jacobians."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  _, z, masks = _plain(None, params, batch, masked)
  c, hessians = np.abs(_coefficients(params, batch, masked, combine)), _hessians(z)
  total = np.zeros((flat.size, flat.size))
  for l, name in enumerate(LAYERS[1:]):
    jac = np.asarray(jax.jacfwd(lambda f: _plain(None, unravel(f), batch, masked)[1][name]
                                )(flat))                # [B, out, P]
    w = np.ones(BATCH) if masks[l] is None else np.asarray(masks[l])
    block = np.einsum("x,xop,xoq,xqr->pr", w, jac, hessians[name], jac)
    total += c[l] * block / w.sum()
  return total


def _zero_outputs(params, batch):
  _, z, _ = _plain(None, params, batch, False)
  h = {"trunk": jnp.zeros((BATCH, 7))}
  return h | {name: jnp.zeros_like(v) for name, v in z.items()}


def _empirical_g(params, batch, masked):
  """Each layer's `G = Σ_rows ĝ ĝᵀ`, `ĝ = Σ_l c_l √n_l ∂L_l/∂o` (one device:
  every share 1)."""
  c = _coefficients(params, batch, masked)
  counts = [BATCH if m is None else float(jnp.sum(m))
            for m in _plain(None, params, batch, masked)[2]]
  cotangents = jax.jacrev(lambda o: _plain(o, params, batch, masked)[0])(
      _zero_outputs(params, batch))                      # name -> [3, B, out]
  out = {}
  for name, per_loss in cotangents.items():
    g = np.einsum("l,lxo->xo", c * np.sqrt(counts), np.asarray(per_loss))
    out[name] = g.T @ g
  return out


def _mc_expected_g(params, batch, masked):
  """The expectation of the Monte Carlo `G`: `Σ_l |c_l| (1/n_l) Σ_x w_x
  J_xᵀ H_x J_x` with `J_x` the head's output's Jacobian in the layer's row x."""
  _, z, masks = _plain(None, params, batch, masked)
  c, hessians = _coefficients(params, batch, masked), _hessians(z)
  jac = jax.jacrev(lambda o: _plain(o, params, batch, masked)[1])(
      _zero_outputs(params, batch))                      # head -> layer -> [B, out, B, d]
  out = {}
  for l, head in enumerate(LAYERS[1:]):
    w = np.ones(BATCH) if masks[l] is None else np.asarray(masks[l])
    for name, j in jac[head].items():
      j = np.einsum("xoxd->xod", np.asarray(j))
      term = abs(c[l]) * np.einsum("x,xod,xoq,xqe->de", w, j, hessians[head], j) / w.sum()
      out[name] = out.get(name, 0.0) + term
  return out


@pytest.mark.parametrize("masked,combine", [(False, _combine), (True, _combine),
                                            (True, _signed)],
                         ids=["unmasked", "masked", "negative"])
def test_curvature_products_sum_the_losses(masked, combine):
  """`gauss_newton_gram` is `v_iᵀ C v_j` of the summed Gauss-Newton matrix
  (≤ 1e-12), each loss's times the returned value's derivative in it, or its
  magnitude where negative (a likelihood maximised: its Fisher with that
  weight, as the Monte Carlo factors take it)."""
  params, batch = _params(), _batch()
  grad_fn = kd.value_and_grad(_loss_fn(masked, combine))
  vectors = (helpers.randomized(params, 3), helpers.randomized(params, 4))
  gram, loss = jax.jit(lambda p: grad_fn.gauss_newton_gram(p, vectors, *batch,
                                                           with_loss=True))(params)
  c = _dense_ggn(params, batch, masked, combine)
  flat = np.stack([jax.flatten_util.ravel_pytree(v)[0] for v in vectors])
  want = flat @ c @ flat.T
  np.testing.assert_allclose(gram, want, rtol=1e-12, atol=1e-14 * np.abs(want).max())
  np.testing.assert_allclose(loss, combine(*_plain(None, params, batch, masked)[0]),
                             rtol=1e-13)


@pytest.mark.parametrize("masked", [False, True], ids=["one_pass", "seeded_pass"])
def test_empirical_statistics(masked):
  """The empirical `G`: each loss's cotangent times `c_l √n_l`, summed per
  row, against jax.jacrev of the plain losses (≤ 1e-12). Unmasked heads of
  one batch take the returned loss's own backward pass; masks of different
  counts a second pass seeded per loss. Gradients are the returned loss's."""
  params, batch = _params(), _batch()
  loss_fn = _loss_fn(masked)
  loss, grads, stats = helpers.capture(loss_fn)(params, *batch)
  want = _empirical_g(params, batch, masked)
  for name in LAYERS:
    np.testing.assert_allclose(stats[name]["G"], want[name], rtol=1e-12,
                               atol=1e-14 * np.abs(want[name]).max(), err_msg=name)
  want_loss, want_grads = jax.value_and_grad(loss_fn)(params, *batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
  helpers.assert_trees_equal(grads, want_grads)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_monte_carlo_statistics_estimate_the_summed_gauss_newton(masked):
  """The Monte Carlo `G` over 4000 draws: its mean is the summed Gauss-
  Newton matrix's factor within 5 standard errors (and not twice or half
  it); each loss draws its own targets."""
  params, batch = _params(), _batch()
  _, _, stats = helpers.mc_draws(kd.value_and_grad(_loss_fn(masked), fisher="mc"),
                                 params, *batch)
  want = _mc_expected_g(params, batch, masked)
  for name in LAYERS:
    helpers.check_mc_estimate(stats[name]["G"], want[name], f"G of {name}")


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_loss_scale_leaves_the_statistics(fisher):
  """A loss scale seeds both backward passes and is divided out (the same
  draws)."""
  params, batch = _params(), _batch()
  grad_fn = kd.value_and_grad(_loss_fn(True), fisher=fisher)
  key = jax.random.PRNGKey(5)
  _, grads, stats = jax.jit(lambda p: grad_fn(p, *batch, rng=key))(params)
  _, scaled_grads, scaled = jax.jit(lambda p: grad_fn(p, *batch, rng=key,
                                                      loss_scale=256.0))(params)
  helpers.assert_trees_equal(scaled, stats)
  helpers.assert_trees_equal(scaled_grads, grads)


@pytest.mark.parametrize("devices,slices", [(8, 1), (4, 2), (1, 4)])
def test_masked_heads_on_devices_and_slices_equal_the_whole_batch(devices, slices):
  """Masks keeping different numbers of each head's examples on each device
  (and slice): the devices' mean of the loss, gradients and `G` and the
  Gram matrix equal the whole batch's on one device (float64). (A returned
  value linear in the losses: the mean of a log is not the log of a mean.)"""
  params, batch = _params(), _batch()
  loss_fn = _loss_fn(True, _linear)
  grad_fn = kd.value_and_grad(loss_fn)
  vector = (helpers.randomized(params, 3),)
  want_loss, want_grads, want_stats = helpers.capture(loss_fn)(params, *batch)
  want_gram = grad_fn.gauss_newton_gram(params, vector, *batch)

  def local(p, *b):
    if slices == 1:
      loss, grads, stats = grad_fn(p, *b)
    else:
      loss, grads, stats = grad_fn.accumulate(p, *b, micro_batches=slices)
    gram = grad_fn.gauss_newton_gram(p, vector, *b, micro_batches=slices)
    mean = lambda x: jax.lax.pmean(x, "data") if devices > 1 else x
    return mean(loss), mean(grads), mean(stats), gram
  if devices > 1:
    local = jax.shard_map(local, mesh=helpers.data_mesh(devices),
                          in_specs=(P(),) + (P("data"),) * 6, out_specs=P())
  loss, grads, stats, gram = jax.jit(local)(params, *batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
  np.testing.assert_allclose(gram, want_gram, rtol=1e-12)
  helpers.assert_trees_equal(grads, want_grads, rtol=1e-11)
  helpers.assert_trees_equal(stats, want_stats, rtol=1e-11)


@pytest.mark.parametrize("correction", helpers.slow_unless(["none", "ekfac"], ("none",)))
def test_kfac_on_eight_devices_equals_one_device(correction):
  """Three adaptive K-FAC steps (COMM-OPT; EK-FAC's `S` too) on 8 devices
  with masked heads equal one device's (float64)."""
  params, batch = _params(), _batch()
  grad_fn = kd.value_and_grad(_loss_fn(True, _linear))
  options = dict(layers=grad_fn.discover(params, *batch), damping=0.1, grad_fn=grad_fn,
                 adapt_damping=True, damping_adaptation_interval=1,
                 factor_dtype=jnp.float64,
                 eigenvalue_correction=None if correction == "none" else correction)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                         gradient_reduction="all_reduce")
  single, tx = kd.kfac(None, None, **options), kd.kfac(None, None, distribution=dist,
                                                         **options)

  def step(params, state, *batch):
    loss, grads, stats = grad_fn(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=batch)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")
  run, state = helpers.compile_step(step, tx.init(params), dist, 6, extra_out=(P(),))
  one_params, one_state = params, single.init(params)
  for i in range(3):
    params, state, loss = run(params, state, *batch)
    one_loss, grads, stats = grad_fn(one_params, *batch, opt_state=one_state)
    updates, one_state = single.update(grads, one_state, one_params, kfac_stats=stats,
                                       kfac_batch=batch)
    one_params = optax.apply_updates(one_params, updates)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-12, err_msg=f"step {i}")
    helpers.assert_trees_equal(params, one_params, rtol=1e-10)


@pytest.mark.parametrize("combine", [_combine, _signed], ids=["positive", "negative"])
def test_adaptive_first_step_solves_the_summed_model(combine):
  """Adaptive K-FAC's first update `αΔ` with `α = −∇ᵀΔ / Δᵀ(C + λI)Δ`, C
  the dense summed Gauss-Newton matrix (≤ 1e-10): a descent step also where a
  loss's coefficient is negative (with the signed C its α went uphill)."""
  params, batch, damping = _params(), _batch(), 0.05
  grad_fn = kd.value_and_grad(_loss_fn(True, combine))
  layers = grad_fn.discover(params, *batch)
  tx = kd.kfac(None, None, layers=layers, damping=damping, grad_fn=grad_fn,
               factor_dtype=jnp.float64)
  state = tx.init(params)
  _, grads, stats = grad_fn(params, *batch, opt_state=state)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=batch)
  inner = kd.scale_by_kfac(layers, damping=damping, factor_dtype=jnp.float64)
  direction, _ = inner.update(grads, inner.init(params), params, kfac_stats=stats)
  flat = lambda t: jax.flatten_util.ravel_pytree(t)[0]
  g, delta = np.asarray(flat(grads)), np.asarray(flat(direction))
  c = _dense_ggn(params, batch, True, combine) + damping * np.eye(g.size)
  want = -(g @ delta) / (delta @ c @ delta) * delta
  np.testing.assert_allclose(flat(updates), want, rtol=1e-10,
                             atol=1e-12 * np.abs(want).max())
  assert g @ np.asarray(flat(updates)) < 0


@pytest.mark.parametrize("skip", ["layer", "pass"])
def test_steps_without_statistics(skip):
  """Factors every other step (`fisher="mc"`: the statistics' own backward
  pass): a step that computes none skips it per layer or whole, and both
  give the same run."""
  params, batch = _params(), _batch()
  runs = []
  for mode in ("layer", skip):
    grad_fn = kd.value_and_grad(_loss_fn(True), fisher="mc", skip_statistics=mode)
    tx = kd.kfac(0.1, layers=grad_fn.discover(params, *batch), damping=0.1,
                 factor_update_every=2, factor_dtype=jnp.float64)

    @jax.jit
    def step(p, state, key):
      _, grads, stats = grad_fn(p, *batch, opt_state=state, rng=key)
      updates, state = tx.update(grads, state, p, kfac_stats=stats)
      return optax.apply_updates(p, updates), state
    p, state = params, tx.init(params)
    for i in range(3):
      p, state = step(p, state, jax.random.PRNGKey(i))
    runs.append(p)
  helpers.assert_trees_equal(runs[1], runs[0])
  assert np.all(np.isfinite(jax.flatten_util.ravel_pytree(runs[0])[0]))


def test_dp_kfac_with_masked_heads_is_refused():
  """DP-KFAC's local statistics cannot weigh each head by its share."""
  params, batch = _params(), _batch()
  grad_fn = kd.value_and_grad(_loss_fn(True))
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                         factor_reduction="local")
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, *batch), damping=0.1,
               distribution=dist)

  def step(params, state, *batch):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state
  run, state = helpers.compile_step(step, tx.init(params), dist, 6)
  with pytest.raises(ValueError, match="Several registered losses.*DP-KFAC"):
    run(params, state, *batch)
