"""Training-loop features: micro-batch accumulation, loss scaling, mixed precision."""


import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.core import states as states_lib
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


def _dropout_mlp(key_shape=()):
  """A float64 two-layer tagged MLP whose hidden units drop out, and its loss
  two ways: the masks drawn from a keyword `key` (`jax.random.bernoulli` over
  the rows it gets), or given as a positional batch argument."""
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(5, 7))),
            "w2": jnp.asarray(rng.normal(size=(7, 3)))}
  x = jnp.asarray(rng.normal(size=(16, 5)))
  y = jnp.asarray(rng.integers(0, 3, size=16))

  def with_masks(p, x, y, masks):
    h = jnp.tanh(kd.tags.dense(x, p["w1"], name="l1")) * masks
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["w2"], name="l2"), y)

  def with_key(p, x, y, *, key):
    first = key if not key_shape else key[(0,) * len(key_shape)]
    return with_masks(p, x, y, jax.random.bernoulli(first, 0.5, (x.shape[0], 7)) * 2.0)
  return params, x, y, with_masks, with_key


@pytest.mark.parametrize("key_shape", [(), (2,)])
def test_micro_batches_fold_a_typed_keyword_key_with_the_slice(x64, key_shape):
  """`accumulate`, `loss` and `gauss_newton_gram` over k slices give a typed
  key among the keyword arguments to slice i as `fold_in(key, i)`: the
  results equal the whole batch's with each slice's dropout masks drawn so
  (passed whole, every slice drew the first's masks). A raw key warns."""
  del x64
  params, x, y, with_masks, with_key = _dropout_mlp(key_shape)
  key = jax.random.split(jax.random.key(4), key_shape) if key_shape else jax.random.key(4)
  k = 4
  first = lambda kk: kk if not key_shape else kk[(0,) * len(key_shape)]
  masks = jnp.concatenate([
      jax.random.bernoulli(first(jax.vmap(lambda j: jax.random.fold_in(j, i))(
          jnp.reshape(key, (-1,))).reshape(jnp.shape(key))), 0.5, (16 // k, 7)) * 2.0
      for i in range(k)])
  whole_fn, key_fn = kd.value_and_grad(with_masks), kd.value_and_grad(with_key)
  helpers.assert_trees_equal(key_fn.accumulate(params, x, y, micro_batches=k, key=key),
                             whole_fn(params, x, y, masks))
  np.testing.assert_allclose(key_fn.loss(params, x, y, micro_batches=k, key=key),
                             whole_fn.loss(params, x, y, masks), rtol=1e-13)
  vectors = (jax.tree.map(jnp.ones_like, params),)
  np.testing.assert_allclose(
      key_fn.gauss_newton_gram(params, vectors, x, y, micro_batches=k, key=key),
      whole_fn.gauss_newton_gram(params, vectors, x, y, masks), rtol=1e-12)
  if not key_shape:
    with pytest.warns(UserWarning, match=r"accumulate\(micro_batches=4\): a keyword "
                                         r"argument looks like a raw PRNG key"):
      key_fn.accumulate(params, x, y, micro_batches=k,
                        key=jax.random.PRNGKey(4))


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


def _training_step(kind, loss_fn, params, tokens, mask, state_dtype=None):
  """`(tx, step(params, state, tokens, mask) -> (params, state))` of `kind`:
  K-FAC (amortised cadence; "kfac inverse": damped inverses by Cholesky),
  adaptive K-FAC, Shampoo, or K-FAC under MEM-OPT on 8 devices (the step's
  `Distribution`, else None, third); `state_dtype`:
  the factors' (statistics') dtype, None for the default."""
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, tokens, mask)
  dist = None
  if kind == "shampoo":
    tx = kd.shampoo(0.1, preconditioning_compute_steps=10, statistics_dtype=state_dtype)
  elif kind == "adaptive":
    tx = kd.kfac(None, None, layers=layers, grad_fn=grad_fn, adapt_damping=True,
                 factor_dtype=state_dtype)
  else:
    if kind == "kfac MEM-OPT":
      dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                             gradient_reduction="all_reduce")
    tx = kd.kfac(0.1, layers=layers, factor_update_every=10, inverse_update_every=100,
                 distribution=dist, factor_dtype=state_dtype,
                 method="inverse" if kind == "kfac inverse" else "eigen")

  def step(params, state, tokens, mask):
    if kind == "shampoo":
      grads, extra = jax.grad(loss_fn)(params, tokens, mask), {}
    else:
      _, grads, stats = grad_fn(params, tokens, mask, opt_state=state)
      extra = {"kfac_stats": stats}
      if kind == "adaptive":
        extra["kfac_batch"] = (tokens, mask)
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state
  return tx, step, dist


@pytest.mark.parametrize("kind", ["kfac", "adaptive", "shampoo"])
def test_a_donating_step_equals_the_plain_one(kind, x64):
  """Params and state donated to the step (`donate_argnums=(0, 1)`, as the
  README's loop runs it), straight from `tx.init`: no two leaves of the state
  share a buffer with each other or with the parameters (the call would fail),
  and 3 steps (K-FAC's first one updates factors and eigenbases) equal the
  steps without donation, in float64 (the donating program is fused
  differently: in float32 the eigenbases differ in their rounding). A step
  returns the state with the types it took (a float64 model, float32
  factors: adaptive K-FAC's scalars once came back float64), as a
  `lax.scan` carry needs."""
  del x64
  loss_fn, params, tokens, mask = _problem(jnp.float64, jnp.float64)
  tx, step, _ = _training_step(kind, loss_fn, params, tokens, mask)
  plain, donating = jax.jit(step), jax.jit(step, donate_argnums=(0, 1))
  p, s = params, tx.init(params)
  pd = jax.tree.map(jnp.copy, params)
  sd = tx.init(pd)
  types = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)
  assert types(jax.eval_shape(step, p, s, tokens, mask)[1]) == types(s)
  for _ in range(3):
    p, s = plain(p, s, tokens, mask)
    pd, sd = donating(pd, sd, tokens, mask)
  helpers.assert_trees_equal((p, s), (pd, sd), rtol=1e-10)


_COMPILES = [0]


def _count_compiles(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


@pytest.mark.parametrize("kind", ["kfac", "kfac inverse", "shampoo", "soap"])
def test_an_eager_loop_compiles_nothing_after_its_first_steps(kind, x64):
  """A training loop without `jax.jit` (a notebook, a debugging session):
  after the first steps (K-FAC's cadence 2/3: factor, decomposition and plain
  steps all seen), steps compile no program (before, every K-FAC step
  compiled 8: each tagged layer's statistics conditional in `grad_fn` and
  five in `update`, fresh closures each call, 0.7 s a step and JAX's caches
  growing by 16 MB), and the eager steps equal the jitted ones in float64
  (the factors too: float32 factors round the two programs' statistics,
  equal to 1e-17, apart by 1e-7), SOAP's aside."""
  del x64
  loss_fn, params, tokens, mask = _problem(jnp.float64, jnp.float64)
  grad_fn = kd.value_and_grad(loss_fn)
  if kind in ("shampoo", "soap"):
    tx = (kd.shampoo(0.1, preconditioning_compute_steps=3, statistics_dtype=jnp.float64)
          if kind == "shampoo" else
          kd.soap(0.01, precondition_every=3, statistics_dtype=jnp.float64))
  else:
    method = "inverse" if kind == "kfac inverse" else "eigen"
    tx = kd.kfac(0.1, layers=grad_fn.discover(params, tokens, mask), factor_update_every=2,
                 inverse_update_every=3, method=method, factor_dtype=jnp.float64)

  def step(params, state, tokens, mask):
    _, grads, stats = grad_fn(params, tokens, mask, opt_state=state)
    extra = {} if kind in ("shampoo", "soap") else {"kfac_stats": stats}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state
  p, s, jp, js, jitted = params, tx.init(params), params, tx.init(params), jax.jit(step)
  for i in range(10):
    batch = jnp.roll(tokens, i, axis=0)
    before = _COMPILES[0]
    p, s = step(p, s, batch, mask)
    if i >= 6:
      assert _COMPILES[0] == before, f"step {i} compiled {_COMPILES[0] - before} programs"
    jp, js = jitted(jp, js, batch, mask)
  if kind != "soap":    # rank-deficient eigenbases: see the next test's docstring
    helpers.assert_trees_equal(p, jp, rtol=1e-9)
    # Shampoo's roots amplify rounding, as in the next test.
    helpers.assert_trees_equal(s, js, rtol=1e-6 if kind == "shampoo" else 1e-9)


@pytest.mark.parametrize("kind", ["kfac", "adaptive", "shampoo"])
def test_steps_in_a_scan_equal_the_jitted_loop(kind, x64):
  """Several training steps per call, `lax.scan` over a stack of batches
  (one program for the whole loop, as TPU input pipelines run it): 12 steps,
  through K-FAC's factor steps, an eigendecomposition and plain steps, equal
  the same steps jitted one at a time, in float64 (the state's factors too).
  (SOAP is left out: where
  its factors are rank-deficient, eigh's basis of the zero eigenspace is
  arbitrary and rounding-level differences between two programs choose
  different ones, which Adam's per-coordinate scaling in that basis then
  tells apart: docs/shampoo.md.)"""
  del x64
  loss_fn, params, tokens, mask = _problem(jnp.float64, jnp.float64)
  tx, step, _ = _training_step(kind, loss_fn, params, tokens, mask, jnp.float64)
  batches = (jnp.stack([jnp.roll(tokens, i, axis=0) for i in range(12)]),
             jnp.stack([jnp.roll(mask, i, axis=1) for i in range(12)]))

  def scanned(carry, batch):
    return step(*carry, *batch), None
  (p_scan, s_scan), _ = jax.jit(lambda c, b: jax.lax.scan(scanned, c, b))(
      (params, tx.init(params)), batches)
  jitted, p, s = jax.jit(step), params, tx.init(params)
  for i in range(12):
    p, s = jitted(p, s, batches[0][i], batches[1][i])
  assert int(states_lib.find_states(s)[0].count) == 12
  # Shampoo's inverse fourth roots of rank-deficient statistics (ridge 1e-6)
  # amplify the two programs' rounding (2e-16 in the statistics) to 1e-11 of
  # the roots' scale, which an element-wise tolerance sees on their small entries
  # (and the parameters' small entries: 2e-12 on one of 3e-3, parameters ~0.5).
  helpers.assert_trees_equal(p_scan, p, rtol=1e-9 if kind == "shampoo" else 1e-10)
  helpers.assert_trees_equal(s_scan, s, rtol=1e-6 if kind == "shampoo" else 1e-10)


@pytest.mark.parametrize("kind", [
    "kfac", pytest.param("kfac inverse", marks=pytest.mark.slow),
    pytest.param("adaptive", marks=pytest.mark.slow), "shampoo"])
def test_a_step_vmapped_over_seeds_equals_each_seed(kind, x64):
  """`jax.vmap` of the whole step over three seeds' parameters and states (an
  ensemble or a sweep in one program) takes each seed's steps, in float64.
  jaxlib's batched CPU LAPACK calls deadlock XLA's intra-op pool (this 2-core
  machine hung), so every eigh, Cholesky and LU call of the vmapped program
  must still take one matrix (`core.linalg.one_matrix_per_call`): checked on
  the lowered program first, so that a regression fails instead of hanging."""
  del x64
  loss_fn, params, tokens, mask = _problem(jnp.float64, jnp.float64)
  tx, step, _ = _training_step(kind, loss_fn, params, tokens, mask, jnp.float64)
  seeds = [jax.tree.map(lambda a, i=i: a * (1 + 0.25 * i), params) for i in range(3)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *seeds)
  vmapped = jax.jit(jax.vmap(step, in_axes=(0, 0, None, None)))
  states = jax.vmap(tx.init)(stacked)
  text = vmapped.lower(stacked, states, tokens, mask).as_text()
  calls = re.findall(r'custom_call @(lapack_\w+)\(.*?num_batch_dims = "(\d+)"', text)
  assert calls and all(batch_dims == "0" for _, batch_dims in calls), sorted(set(calls))
  p, s = stacked, states
  for _ in range(3):
    p, s = vmapped(p, s, tokens, mask)
  jitted = jax.jit(step)
  for i, seed in enumerate(seeds):
    q, t = seed, tx.init(seed)
    for _ in range(3):
      q, t = jitted(q, t, tokens, mask)
    # The parameters; the statistics (K-FAC's running factors, Shampoo's),
    # not the eigenbases, which are any basis of a repeated eigenvalue's
    # eigenspace (the rank-deficient factors' zero one) in either program.
    helpers.assert_trees_equal(jax.tree.map(lambda a, i=i: a[i], p), q, rtol=1e-8)
    if kind == "shampoo":
      statistics = lambda state: states_lib.find_states(state)[0].statistics
    else:
      statistics = lambda state: find_states(state)[0].factors
    helpers.assert_trees_equal(jax.tree.map(lambda a, i=i: a[i], statistics(s)),
                               statistics(t), rtol=1e-10)


@pytest.mark.parametrize("kind", ["kfac", "adaptive", "shampoo", "kfac MEM-OPT"])
def test_steps_have_no_host_callbacks(kind):
  """A training step's program holds no host callback, so JAX's persistent
  compilation cache (`jax_compilation_cache_dir`) stores it and a restarted
  run skips its compile (JAX writes no entry for a program with one:
  kfac-jax's step has one, benchmarks/results/vs_kfac_jax.md). The check has
  teeth: a `jax.debug.callback` beside the step is found."""
  loss_fn, params, tokens, mask = _problem()
  tx, step, dist = _training_step(kind, loss_fn, params, tokens, mask)
  compiled, state = compile_step(step, tx.init(params), dist, 2)

  def callbacks(fn):
    text = jax.jit(fn).lower(params, state, tokens, mask).as_text()
    return [t for t in set(re.findall(r"custom_call @(\w+)", text)) if "callback" in t]
  assert callbacks(compiled) == []

  def noisy(params, state, tokens, mask):
    jax.debug.callback(lambda _: None, tokens)
    return compiled(params, state, tokens, mask)
  assert callbacks(noisy) != []
