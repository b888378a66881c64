"""Adaptive K-FAC against a float64 brute force: the quadratic model's
coefficients from a dense Gauss-Newton matrix, the Levenberg-Marquardt rule
on constructed cases, and the distributed strategies against one device."""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd
from kfac_jax_dist.core.states import find_states
from kfac_jax_dist.kfac import adaptive
from kfac_jax_dist.kfac.state import ScaleByKfacState

BATCH, CLASSES = 16, 3
LAMBDA, WD = 1e-2, 1e-3


@pytest.fixture(autouse=True, scope="module")
def _x64():
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


def _logits(params, x):
  h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
  return kd.tags.dense(h, params["out"]["kernel"], name="out") * params["scale"]


def loss_fn(params, x, y):
  return kd.losses.softmax_cross_entropy(_logits(params, x), y)


def _params():
  k = jax.random.split(jax.random.PRNGKey(0), 2)
  return {"l0": {"kernel": 0.5 * jax.random.normal(k[0], (5, 6), jnp.float64),
                 "bias": jnp.zeros(6, jnp.float64)},
          "out": {"kernel": 0.5 * jax.random.normal(k[1], (6, CLASSES), jnp.float64)},
          "scale": jnp.ones(CLASSES, jnp.float64)}


def _batch(i):
  kx, ky = jax.random.split(jax.random.PRNGKey(10 + i))
  return (jax.random.normal(kx, (BATCH, 5), jnp.float64),
          jax.random.randint(ky, (BATCH,), 0, CLASSES))


GRAD_FN = kd.value_and_grad(loss_fn)


def _tx(grad_fn=GRAD_FN, **options):
  layers = grad_fn.discover(_params(), *_batch(0))
  # Decompositions every step: the brute force decomposes the current factors.
  options = dict(dict(damping=LAMBDA, weight_decay=WD, factor_dtype=jnp.float64,
                      inverse_update_every=1), **options)
  return kd.kfac(options.pop("learning_rate", None), options.pop("momentum", None),
                 layers=layers, grad_fn=grad_fn, **options)


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel()
                         for x in jax.tree.leaves(tree)])


def _dense_ggn(params, x, y):
  """C = Jᵀ H J / n from the full Jacobian of the logits (softmax: H = diag p − ppᵀ)."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  logits = _logits(params, x)
  jac = jax.jacfwd(lambda f: _logits(unravel(f), x).reshape(-1))(flat)
  jac = np.asarray(jac).reshape(BATCH, CLASSES, -1)
  p = np.asarray(jax.nn.softmax(logits, -1))
  c = np.zeros((flat.size, flat.size))
  for i in range(BATCH):
    h = np.diag(p[i]) - np.outer(p[i], p[i])
    c += jac[i].T @ h @ jac[i]
  return c / BATCH


def _kfac_direction(params, state, grads, stats, **options):
  """Δ: K-FAC's preconditioned gradient of ∇ + wθ, damped with the state's
  λ plus the weight decay w (the curvature of (w/2)|θ|²)."""
  inner = kd.scale_by_kfac(GRAD_FN.discover(_params(), *_batch(0)),
                           damping=float(state.damping) + WD, factor_dtype=jnp.float64,
                           **options)
  total = jax.tree.map(lambda g, p: g + WD * p, grads, params)
  direction, _ = inner.update(total, state.kfac, params, kfac_stats=stats)
  return _flat(total), _flat(direction)


def _adaptive_state(state):
  return next(s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, adaptive.AdaptiveKfacState))
              if isinstance(s, adaptive.AdaptiveKfacState))


@pytest.mark.parametrize("momentum,options", [
    (None, {}), (0.0, {}),
    pytest.param(None, {"method": "inverse"}, marks=pytest.mark.slow),   # (CI time)
    (None, {"eigenvalue_correction": "ekfac"})],
    ids=["adapted", "zero", "inverse", "ekfac"])
def test_first_two_updates_solve_the_quadratic_model(momentum, options):
  """Step 1: α alone; step 2: (α, μ) of the 2×2 model with the previous
  update, both against the dense solve (≤ 1e-10). With the momentum fixed at
  0 (one tangent pass), α alone on every step. The model takes any K-FAC
  direction Δ: π-damped inverses and EK-FAC's as well."""
  _check_first_two_updates(GRAD_FN, 1.0, momentum, options)


def test_a_multiple_of_the_registered_loss_scales_the_model():
  """A loss function returning `a · L` (kfac-jax's loss weight `a`, ported):
  the model's curvature is `a·C`, the Gauss-Newton matrix of what the
  optimiser minimises, not the registered loss's `C`."""
  weight = 2.5
  grad_fn = kd.value_and_grad(lambda p, x, y: weight * loss_fn(p, x, y))
  _check_first_two_updates(grad_fn, weight, None, {})


def _check_first_two_updates(grad_fn, weight: float, momentum, options: dict) -> None:
  """The first two updates of `grad_fn`'s loss, `weight` times `loss_fn`'s,
  against the dense solve of the model with `weight · C`."""
  tx, params = _tx(grad_fn, momentum=momentum, **options), _params()
  state, statistics, update = helpers.jitted_start(tx, grad_fn, params)
  velocity = None
  for step in range(2):
    x, y = _batch(step)
    _, grads, stats = statistics(params, x, y, opt_state=state)
    inner = _adaptive_state(state)
    g, delta = _kfac_direction(params, inner, grads, stats, **options)
    c = weight * _dense_ggn(params, x, y) + (WD + LAMBDA) * np.eye(g.size)
    if velocity is None or momentum == 0.0:
      alpha = -(g @ delta) / (delta @ c @ delta)
      want = alpha * delta
    else:
      v = np.stack([delta, velocity])
      w = -np.linalg.solve(v @ c @ v.T, v @ g)
      want = w @ v
    updates, state = update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    got = _flat(updates)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * np.abs(want).max(),
                               err_msg=f"step {step}")
    velocity = want
    params = optax.apply_updates(params, updates)
  new = _adaptive_state(state)
  assert int(new.count) == 2 and float(new.learning_rate) > 0
  assert (float(new.momentum) == 0.0) == (momentum == 0.0)


@pytest.mark.parametrize("rho,factor", [(0.1, 1 / 0.9 ** 5), (0.5, 1.0), (0.9, 0.9 ** 5),
                                        (float("nan"), 1 / 0.9 ** 5)])
def test_levenberg_marquardt_rule(rho, factor):
  config = adaptive.AdaptiveConfig()
  got = adaptive.new_damping(config, jnp.asarray(1e-2), jnp.asarray(rho))
  np.testing.assert_allclose(float(got), 1e-2 * factor, rtol=1e-12)
  clipped = adaptive.new_damping(adaptive.AdaptiveConfig(min_damping=5e-3, max_damping=1e-2),
                                 jnp.asarray(1e-2), jnp.asarray(rho))
  assert 5e-3 <= float(clipped) <= 1e-2


def _model_minimum(a, b, w):
  """`½ wᵀAw + bᵀw`, numpy float64."""
  a, b, w = (np.asarray(v, np.float64) for v in (a, b, w))
  return 0.5 * w @ a @ w + b @ w


def test_degenerate_models_give_finite_coefficients():
  """The 2 × 2 model's degenerate cases give finite minimisers, where the
  solve gave NaN and the step was skipped: `Δ = 0` (a zero gradient) gives
  `(0, 0)`; `v ∥ Δ` (a singular system) `α` alone, which reaches the model's
  minimum over the span (checked against a fine grid of the line); a regular
  system equals numpy's solve."""
  solve = lambda a, b, lr=None, mu=None: np.asarray(adaptive.solve_coefficients(
      jnp.asarray(a), jnp.asarray(b), lr, mu, jnp.asarray(False)))
  zero = np.zeros((2, 2))
  zero[1, 1] = 2.0
  for lr, mu in ((None, None), (None, 0.5), (0.1, None)):
    got = solve(zero, np.zeros(2), lr, mu)
    assert np.all(np.isfinite(got)), (lr, mu, got)
    assert got[0] == (-0.1 if lr else 0.0), (lr, mu, got)
  u = np.asarray([1.0, -2.5])            # v = -2.5 Δ: every matrix of the span is rank 1
  a, b = 3.0 * np.outer(u, u) + 0.2 * np.outer(u, u), 0.7 * u
  got = solve(a, b)
  assert np.all(np.isfinite(got)) and got[1] == 0.0
  line = np.linspace(-2, 2, 400001)
  best = min(_model_minimum(a, b, [t, 0.0]) for t in line)
  assert _model_minimum(a, b, got) <= best + 1e-12
  regular = np.asarray([[2.0, 0.3], [0.3, 1.0]])
  np.testing.assert_allclose(solve(regular, b), -np.linalg.solve(regular, b), rtol=1e-12)


def test_one_dimensional_problem_converges_without_skips():
  """A one-parameter least-squares fit (`t = 3x`): from the second step the
  new direction and the previous update are parallel, which made every step
  skipped with `w` stuck at 2.954; now it converges, no step skipped."""
  def loss(p, x, t):
    return kd.losses.squared_error(kd.tags.dense(x, p["w"]["kernel"], name="w"), t)
  x = jax.random.normal(jax.random.PRNGKey(2), (8, 1), jnp.float64)
  t, params = 3.0 * x, {"w": {"kernel": jnp.zeros((1, 1), jnp.float64)}}
  grad_fn = kd.value_and_grad(loss)
  tx = kd.kfac(None, None, layers=grad_fn.discover(params, x, t), grad_fn=grad_fn,
               adapt_damping=True, inverse_update_every=1)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    _, grads, stats = grad_fn(params, x, t, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(x, t))
    return optax.apply_updates(params, updates), state
  for _ in range(8):
    params, state = step(params, state)
  assert abs(float(params["w"]["kernel"][0, 0]) - 3.0) < 1e-4
  inner = _adaptive_state(state)
  assert int(inner.skipped) == 0 and int(inner.count) == 8


@pytest.mark.parametrize("learning_rate,momentum", [(None, None), (0.1, 0.9)])
def test_all_masked_batches_leave_the_damping_alone(learning_rate, momentum):
  """A batch whose every example is masked (padding) has a zero gradient and
  a zero step, `M₀(d) = 0`: ρ = 0/0 said nothing, but counted as a bad fit
  and raised λ at every adaptation (0.1 → 19.4 over 50 such batches, 2e17
  over 400, stored ρ NaN), and the zero gradient made the solve NaN and the
  step skipped. Now λ and ρ stay, no step is skipped, and a real batch after
  them moves the parameters."""
  def loss(p, x, y, mask):
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(jnp.tanh(kd.tags.dense(x, p["l0"]["kernel"], p["l0"]["bias"],
                                             name="l0")), p["out"]["kernel"], name="out"),
        y, mask=mask)
  params = {"l0": _params()["l0"], "out": _params()["out"]}
  x, y = _batch(0)
  grad_fn = kd.value_and_grad(loss)
  none, every = jnp.zeros(BATCH), jnp.ones(BATCH)
  tx = kd.kfac(learning_rate, momentum, layers=grad_fn.discover(params, x, y, every),
               grad_fn=grad_fn, adapt_damping=True, damping_adaptation_interval=1,
               damping=0.1)

  @jax.jit
  def step(params, state, mask):
    _, grads, stats = grad_fn(params, x, y, mask, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats,
                               kfac_batch=(x, y, mask))
    return optax.apply_updates(params, updates), state
  state = tx.init(params)
  for _ in range(10):
    params, state = step(params, state, none)
  inner = _adaptive_state(state)
  assert float(inner.damping) == pytest.approx(0.1) and np.isfinite(float(inner.rho))
  assert int(inner.skipped) == 0 and int(inner.count) == 10
  after, state = step(params, state, every)
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), after, params)
  assert all(0 < m < np.inf for m in jax.tree.leaves(moved)), moved
  assert int(_adaptive_state(state).skipped) == 0


def test_damping_adapts_from_the_reduction_ratio():
  """With adaptation every step, λ moves by ω or 1/ω as ρ says, and ρ equals
  (L(θ+d) − L(θ)) / M₀(d) computed here from the dense model."""
  tx, params = _tx(adapt_damping=True, damping_adaptation_interval=1), _params()
  state = tx.init(params)
  x, y = _batch(0)
  _, grads, stats = jax.jit(GRAD_FN)(params, x, y, opt_state=state)
  inner = _adaptive_state(state)
  g, delta = _kfac_direction(params, inner, grads, stats)
  c = _dense_ggn(params, x, y) + WD * np.eye(g.size)
  alpha = -(g @ delta) / (delta @ (c + LAMBDA * np.eye(g.size)) @ delta)
  d = alpha * delta
  updates, state = jax.jit(tx.update)(grads, state, params, kfac_stats=stats,
                                      kfac_batch=(x, y))
  rho = (_objective(optax.apply_updates(params, updates), x, y)
         - _objective(params, x, y)) / (0.5 * d @ c @ d + g @ d)
  new = _adaptive_state(state)
  np.testing.assert_allclose(float(new.rho), rho, rtol=1e-9)
  factor = 0.9 if rho > 0.75 else (1 / 0.9 if rho < 0.25 else 1.0)
  np.testing.assert_allclose(float(new.damping), LAMBDA * factor, rtol=1e-12)


def test_fixed_learning_rate_adapts_momentum_only():
  tx, params = _tx(learning_rate=0.05), _params()
  state, statistics, update = helpers.jitted_start(tx, GRAD_FN, params)
  for step in range(2):
    x, y = _batch(step)
    _, grads, stats = statistics(params, x, y, opt_state=state)
    updates, state = update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    params = optax.apply_updates(params, updates)
    new = _adaptive_state(state)
    np.testing.assert_allclose(float(new.learning_rate), 0.05, rtol=1e-12)
  assert float(new.momentum) != 0.0


def test_a_learning_rate_schedule_from_zero_takes_zero_steps_not_skips():
  """A warm-up's first value 0 (optax's warm-up schedules start there): α = 0
  and, on the first step, μ = 0, so the update is zero and the step counts (a
  skipped step kept the count, read 0 again, and skipped forever); the next
  steps take the schedule's rate. The damping stays over the zero step."""
  schedule = lambda count: 0.05 * jnp.minimum(count, 2) / 2
  tx, params = _tx(learning_rate=schedule, adapt_damping=True,
                   damping_adaptation_interval=1), _params()
  state, statistics, update = helpers.jitted_start(tx, GRAD_FN, params)
  for step in range(3):
    x, y = _batch(step)
    _, grads, stats = statistics(params, x, y, opt_state=state)
    updates, state = update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    moved = max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(updates))
    assert (moved == 0.0) == (step == 0)
    params = optax.apply_updates(params, updates)
    new = _adaptive_state(state)
    assert int(find_states(state, ScaleByKfacState)[0].skipped) == 0
    np.testing.assert_allclose(float(new.learning_rate), float(schedule(step)), rtol=1e-12)
    if step == 0:
      assert float(new.damping) == LAMBDA
  assert int(new.count) == 3


def test_a_state_saved_under_other_damping_bounds_takes_the_new_ones_at_once():
  """Resumed with a higher `min_damping`, the saved λ below it is clipped on
  the next step, not only at the next adaptation: the step equals that of a
  fresh state at the new bound."""
  params, (x, y) = _params(), _batch(0)
  saved = _tx(adapt_damping=True, damping=LAMBDA, min_damping=1e-3).init(params)
  resumed = _tx(adapt_damping=True, damping=5 * LAMBDA, min_damping=5 * LAMBDA)
  _, grads, stats = GRAD_FN(params, x, y, opt_state=saved)
  step = jax.jit(resumed.update)
  updates, state = step(grads, saved, params, kfac_stats=stats, kfac_batch=(x, y))
  fresh, _ = step(grads, resumed.init(params), params, kfac_stats=stats, kfac_batch=(x, y))
  assert float(_adaptive_state(state).damping) == 5 * LAMBDA
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(fresh)):
    np.testing.assert_array_equal(a, b)


def _second_order_per_step(tx, steps):
  """The K-FAC state's eigenbases and eigenvalues after each of `steps` updates."""
  params, seen = _params(), []
  state, update = tx.init(params), jax.jit(tx.update)
  for step in range(steps):
    x, y = _batch(step)
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    updates, state = update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    params = optax.apply_updates(params, updates)
    seen.append(np.asarray(find_states(state, ScaleByKfacState)[0].second_order))
  return state, seen


def test_adaptive_defaults():
  """`kd.kfac(None, None)`'s defaults: λ₀ = 0.1 and the eigendecompositions
  every 10 updates (factors every update); the non-adaptive mode, and adaptive
  mode with stale statistics, decompose every update."""
  layers = GRAD_FN.discover(_params(), *_batch(0))
  adaptive_tx = kd.kfac(None, None, layers=layers, grad_fn=GRAD_FN,
                        factor_dtype=jnp.float64)
  state, seen = _second_order_per_step(adaptive_tx, 12)
  assert float(_adaptive_state(adaptive_tx.init(_params())).damping) == 0.1
  assert all(np.array_equal(seen[0], s) for s in seen[1:10])
  assert not np.array_equal(seen[9], seen[10]) and np.array_equal(seen[10], seen[11])
  assert int(_adaptive_state(state).count) == 12
  fixed = kd.kfac(0.1, layers=layers, factor_dtype=jnp.float64)
  assert not np.array_equal(*_second_order_per_step(fixed, 2)[1])
  stale = kd.kfac(None, None, layers=layers, grad_fn=GRAD_FN, stale_threshold=0.1)
  stale.init(_params())      # needs both intervals at 1: the default gives them


def test_adaptive_mode_needs_the_batch_and_grad_fn():
  with pytest.raises(TypeError, match="grad_fn=kd.value_and_grad"):
    kd.kfac(None, None, layers=GRAD_FN.discover(_params(), *_batch(0)))
  tx, params = _tx(), _params()
  state = tx.init(params)
  _, grads, stats = GRAD_FN(params, *_batch(0), opt_state=state)
  with pytest.raises(ValueError, match="kfac_batch="):
    tx.update(grads, state, params, kfac_stats=stats)
  with pytest.raises(TypeError, match="grad_fn=kd.value_and_grad"):
    kd.kfac(0.1, 0.9, layers=GRAD_FN.discover(_params(), *_batch(0)), adapt_damping=True)
  with pytest.raises(ValueError, match="kl_clip is defined through a fixed learning"):
    _tx(momentum=0.9, kl_clip=1e-3)


def test_batch_arguments_by_keyword():
  """A loss mask `grad_fn` received by keyword reaches the quadratic model
  through `kfac_batch_kwargs`: the same steps (adapted λ every step) as with
  the mask positional; a misspelt `kfac_*` keyword is refused by name."""
  def masked_loss(params, x, y, mask=None):
    return kd.losses.softmax_cross_entropy(_logits(params, x), y, mask=mask)
  grad_fn = kd.value_and_grad(masked_loss)
  mask = jnp.asarray(np.arange(BATCH) % 3 != 0, jnp.float64)
  params = _params()
  runs = []
  for by_keyword in (False, True):
    tx = kd.kfac(None, None, layers=grad_fn.discover(params, *_batch(0), mask),
                 grad_fn=grad_fn, damping=LAMBDA, factor_dtype=jnp.float64,
                 adapt_damping=True, damping_adaptation_interval=1)
    p, state = params, tx.init(params)
    for i in range(2):
      x, y = _batch(i)
      args, kwargs = ((x, y), {"mask": mask}) if by_keyword else ((x, y, mask), {})
      _, grads, stats = grad_fn(p, *args, opt_state=state, **kwargs)
      updates, state = tx.update(grads, state, p, kfac_stats=stats, kfac_batch=args,
                                 kfac_batch_kwargs=kwargs or None)
      p = optax.apply_updates(p, updates)
    runs.append((p, kd.adapted_values(state)))
  np.testing.assert_allclose(_flat(runs[1][0]), _flat(runs[0][0]), rtol=1e-12)
  for name, value in runs[0][1].items():
    np.testing.assert_allclose(float(runs[1][1][name]), float(value), rtol=1e-12,
                               err_msg=name)
  with pytest.raises(TypeError, match="kfac_kwargs: the K-FAC keywords of update are"):
    tx.update(grads, state, p, kfac_stats=stats, kfac_batch=args, kfac_kwargs=kwargs)
  with pytest.raises(TypeError, match="kfac_batch_kwargs must be the dict"):
    tx.update(grads, state, p, kfac_stats=stats, kfac_batch=args, kfac_batch_kwargs=[mask])


def _objective(params, x, y):
  """`L(θ) + (w/2)|θ|²` on the batch, in float64."""
  return float(loss_fn(params, x, y)) + 0.5 * WD * float(_flat(params) @ _flat(params))


def test_damping_alone_adapts_with_fixed_coefficients():
  """`kd.kfac(η, μ, adapt_damping=True)` (kfac-jax's adaptive damping alone):
  d = −ηΔ + μv with K-FAC's Δ at the adapted λ, and λ moved by the reduction
  ratio of that d, computed here from the dense model, over 3 steps with
  adaptation every step (≤ 1e-10)."""
  eta, mu = 0.05, 0.5
  tx = _tx(learning_rate=eta, momentum=mu, adapt_damping=True,
           damping_adaptation_interval=1)
  params, velocity, lam = _params(), 0.0, LAMBDA
  state, statistics, update = helpers.jitted_start(tx, GRAD_FN, params)
  for step in range(3):
    x, y = _batch(step)
    _, grads, stats = statistics(params, x, y, opt_state=state)
    g, delta = _kfac_direction(params, _adaptive_state(state), grads, stats)
    d = -eta * delta + mu * velocity
    updates, state = update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    np.testing.assert_allclose(_flat(updates), d, rtol=1e-10,
                               atol=1e-12 * np.abs(d).max(), err_msg=f"step {step}")
    c = _dense_ggn(params, x, y) + WD * np.eye(g.size)
    new_params = optax.apply_updates(params, updates)
    rho = (_objective(new_params, x, y) - _objective(params, x, y)) / (
        0.5 * d @ c @ d + g @ d)
    lam *= 0.9 if rho > 0.75 else (1 / 0.9 if rho < 0.25 else 1.0)
    new = _adaptive_state(state)
    np.testing.assert_allclose(float(new.rho), rho, rtol=1e-9, err_msg=f"step {step}")
    np.testing.assert_allclose(float(new.damping), lam, rtol=1e-12)
    assert float(new.learning_rate) == eta and float(new.momentum) == mu
    params, velocity = new_params, d


def test_damping_alone_takes_the_fixed_steps_until_lambda_moves():
  """Before its first adaptation (T = 5) the damping-only mode takes the
  non-adaptive mode's steps, momentum and a binding KL clip included (no
  weight decay, whose two modes differ): `d = −ηΔ + μv` is SGD's heavy ball."""
  options = dict(learning_rate=0.05, momentum=0.5, weight_decay=0.0, kl_clip=1e-6)
  got = _run_steps(_tx(adapt_damping=True, **options), _params(), 4)
  want = _run_steps(_tx(**options), _params(), 4)
  np.testing.assert_allclose(_flat(got[0]), _flat(want[0]), rtol=1e-12, atol=1e-14)
  unclipped = _run_steps(_tx(**dict(options, kl_clip=None)), _params(), 4)
  assert np.abs(_flat(unclipped[0]) - _flat(want[0])).max() > 1e-3   # the clip binds
  assert float(_adaptive_state(got[1]).damping) == LAMBDA


@pytest.mark.parametrize("coefficients", [(None, None), (1.0, 0.5)],
                         ids=["adapted", "fixed"])
def test_step_rejection_against_the_dense_model(coefficients):
  """`reject_steps` (kfac-jax's `use_step_rejection`), from a λ₀ low enough
  that some updates raise the objective: each step against the dense model
  from the state before it. A rejected update changes nothing (v kept, λ
  moved by the rule, then × 2); the others are taken as computed; both kinds
  occur, and the state counts the rejections."""
  eta, mu = coefficients
  tx = _tx(learning_rate=eta, momentum=mu, damping=1e-3, adapt_damping=True,
           damping_adaptation_interval=1, reject_steps=True,
           reject_damping_increase_factor=2.0)
  params = _params()
  state, statistics, update = helpers.jitted_start(tx, GRAD_FN, params)
  _, unravel = jax.flatten_util.ravel_pytree(params)
  velocity, outcomes = np.zeros(_flat(params).size), []
  for step in range(5):
    x, y = _batch(step)
    _, grads, stats = statistics(params, x, y, opt_state=state)
    lam = float(_adaptive_state(state).damping)
    g, delta = _kfac_direction(params, _adaptive_state(state), grads, stats)
    c = _dense_ggn(params, x, y) + WD * np.eye(g.size)
    if eta is not None:
      d = -eta * delta + mu * velocity
    elif not velocity.any():
      d = -(g @ delta) / (delta @ (c + lam * np.eye(g.size)) @ delta) * delta
    else:
      v = np.stack([delta, velocity])
      d = -np.linalg.solve(v @ (c + lam * np.eye(g.size)) @ v.T, v @ g) @ v
    before = _objective(params, x, y)
    after = _objective(jax.tree.map(jnp.add, params, unravel(d)), x, y)
    rho = (after - before) / (0.5 * d @ c @ d + g @ d)
    lam *= 0.9 if rho > 0.75 else (1 / 0.9 if rho < 0.25 else 1.0)
    rejected = after > before
    updates, state = update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    want = np.zeros_like(d) if rejected else d
    np.testing.assert_allclose(_flat(updates), want, rtol=1e-10,
                               atol=1e-12 * np.abs(d).max(), err_msg=f"step {step}")
    new = _adaptive_state(state)
    np.testing.assert_allclose(float(new.damping), lam * (2.0 if rejected else 1.0),
                               rtol=1e-12, err_msg=f"step {step}")
    np.testing.assert_allclose(_flat(new.velocity), velocity if rejected else d,
                               rtol=1e-10, atol=1e-12 * np.abs(d).max())
    params, velocity = optax.apply_updates(params, updates), _flat(new.velocity)
    outcomes.append(rejected)
  assert any(outcomes) and not all(outcomes), outcomes
  assert int(_adaptive_state(state).rejected) == sum(outcomes)
  assert int(_adaptive_state(state).count) == 5


def _products_outside_conditionals(tx) -> int:
  """The `dot_general`s of one traced `update`, not counting those inside a
  `cond`'s branches (the adaptation step's)."""
  params = _params()
  state, (x, y) = tx.init(params), _batch(0)
  _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
  jaxpr = jax.make_jaxpr(lambda g, s, p, t: tx.update(
      g, s, p, kfac_stats=t, kfac_batch=(x, y)))(grads, state, params, stats).jaxpr

  def inner_jaxprs(params: dict) -> list:
    found = []
    for value in params.values():
      for v in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
          found.append(v.jaxpr if hasattr(v, "jaxpr") else v)
    return found

  def count(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
      total += eqn.primitive.name == "dot_general"
      if eqn.primitive.name != "cond":
        total += sum(count(sub) for sub in inner_jaxprs(eqn.params))
    return total
  return count(jaxpr)


def test_damping_alone_needs_no_tangent_pass_between_adaptations():
  """With both coefficients fixed the model of `d` is computed in the
  adaptation step's branch only: outside it the update does exactly the
  non-adaptive K-FAC step's products; an adapted α adds a tangent pass there."""
  fixed = _products_outside_conditionals(_tx(learning_rate=0.05, momentum=0.5,
                                             adapt_damping=True))
  plain = _products_outside_conditionals(_tx(learning_rate=0.05, momentum=0.5,
                                             weight_decay=0.0, kl_clip=None))
  adapted = _products_outside_conditionals(_tx(momentum=0.0, adapt_damping=True))
  assert fixed == plain < adapted, (fixed, plain, adapted)


def test_faulty_batch_is_skipped():
  tx, params = _tx(adapt_damping=True, damping_adaptation_interval=1), _params()
  state = tx.init(params)
  x, y = _batch(0)
  bad = x.at[0, 0].set(jnp.nan)
  _, grads, stats = GRAD_FN(params, bad, y, opt_state=state)
  updates, new = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(bad, y))
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert int(_adaptive_state(new).skipped) == 1 and int(_adaptive_state(new).count) == 0


def test_a_step_skipped_by_the_adaptive_model_counts_in_the_kfac_state():
  """A step that K-FAC's direction passes but the quadratic model fails (here
  a NaN in the batch the model is evaluated on) is skipped and counted in the
  K-FAC state's `skipped` too, the counter the docs point to (before, only the
  adaptive state's counted it, and a stalled run looked healthy)."""
  tx, params = _tx(), _params()
  state = tx.init(params)
  x, y = _batch(0)
  _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
  updates, new = tx.update(grads, state, params, kfac_stats=stats,
                           kfac_batch=(x.at[0, 0].set(jnp.nan), y))
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert int(_adaptive_state(new).skipped) == 1
  assert int(kd.find_states(new)[0].skipped) == 1     # the ScaleByKfacState


@pytest.mark.parametrize("fraction,reduction,fixed", [
    (1, "none", False),
    pytest.param(1 / 8, "none", False, marks=pytest.mark.slow),
    pytest.param(1 / 2, "all_reduce", False, marks=pytest.mark.slow),
    pytest.param(1 / 8, "reduce_scatter", False, marks=pytest.mark.slow),
    (1 / 2, "all_reduce", True)])
def test_distributed_equals_one_device(fraction, reduction, fixed):
  """COMM-OPT, MEM-OPT, HYBRID and SP-NGD fused on 8 devices equal one device
  on the global batch, over 3 steps with damping adaptation every step (and
  HYBRID with the damping alone adapted and step rejection: `fixed`)."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction, gradient_reduction=reduction)
  options = dict(adapt_damping=True, damping_adaptation_interval=1)
  if fixed:    # η such that the first step is rejected (the global loss goes up)
    options.update(learning_rate=0.5, momentum=0.5, reject_steps=True,
                   reject_damping_increase_factor=2.0, damping=1e-3)
  single, tx = _tx(**options), _tx(distribution=dist, **options)
  params = _params()

  def step(params, state, x, y):
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    if reduction == "none":
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    return optax.apply_updates(params, updates), state
  run, state = helpers.compile_step(step, tx.init(params), dist, 2)
  one_params, one_state = params, single.init(params)
  for i in range(3):
    x, y = _batch(i)
    params, state = run(params, state, x, y)
    _, grads, stats = GRAD_FN(one_params, x, y, opt_state=one_state)
    updates, one_state = single.update(grads, one_state, one_params, kfac_stats=stats,
                                       kfac_batch=(x, y))
    one_params = optax.apply_updates(one_params, updates)
    np.testing.assert_allclose(_flat(params), _flat(one_params), rtol=1e-9, atol=1e-12,
                               err_msg=f"step {i}")
  got, want = _adaptive_state(state), _adaptive_state(one_state)
  for field in ("damping", "learning_rate", "momentum", "rho"):
    np.testing.assert_allclose(float(getattr(got, field)), float(getattr(want, field)),
                               rtol=1e-8, err_msg=field)
  assert int(got.rejected) == int(want.rejected) == (1 if fixed else 0)


# ---------------------------------------------------------------------------
# Everywhere K-FAC runs: micro-batches, inject_hyperparams, scanned layers,
# checkpoints and convert_state.
# ---------------------------------------------------------------------------

def _run_steps(tx, params, steps: int, grads_of=None, update_kwargs=None):
  """`steps` adaptive updates on batches 0.. from `params`; returns (params, state)."""
  state = tx.init(params)
  grads_of = grads_of or (lambda p, s, x, y: GRAD_FN(p, x, y, opt_state=s))
  for i in range(steps):
    x, y = _batch(i)
    _, grads, stats = grads_of(params, state, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats,
                               kfac_batch=(x, y), **(update_kwargs or {}))
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_updates_come_in_the_parameters_dtypes(dtype):
  """Low-precision parameters get updates of their own dtypes, as from every
  other transform (they came in float32, the velocity's), and an update that
  overflows float16 (α fixed at 1e6; bfloat16 has float32's range) skips the
  step, where it went out finite in float32 and `apply_updates` made the
  parameters inf."""
  params = jax.tree.map(lambda v: v.astype(dtype), _params())
  for lr, skipped in ((None, 0), (1e6, int(dtype == jnp.float16))):
    tx = _tx(learning_rate=lr, adapt_damping=lr is not None)
    state = tx.init(params)
    x, y = _batch(0)
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    assert int(_adaptive_state(state).skipped) == skipped
    assert all(np.isfinite(np.asarray(u, np.float32)).all() for u in jax.tree.leaves(updates))


def test_rejection_keeps_the_damping_within_its_bounds():
  """A rejected step multiplies λ by `reject_damping_increase_factor`, clipped
  to `[min_damping, max_damping]` as the rule's moves are (between the rule's
  steps λ grew to 13× `max_damping`); a factor below 1, which would shrink λ
  after a step the model got wrong, and a damping schedule, of which
  `adapt_damping` would read count 0 only, are refused."""
  options = dict(adapt_damping=True, reject_steps=True, reject_damping_increase_factor=3.0,
                 damping=1e-3, max_damping=2e-3, damping_adaptation_interval=5)
  _, state = _run_steps(_tx(learning_rate=20.0, momentum=0.5, **options), _params(), 4)
  state = _adaptive_state(state)
  assert int(state.rejected) >= 2
  np.testing.assert_allclose(float(state.damping), 2e-3, rtol=1e-12)
  with pytest.raises(ValueError, match="reject_damping_increase_factor must be >= 1"):
    _tx(**dict(options, reject_damping_increase_factor=0.5))
  with pytest.raises(TypeError, match="damping is the initial λ .* not a schedule"):
    _tx(**dict(options, damping=optax.constant_schedule(1e-3)))


def test_micro_batches_equal_the_whole_batch():
  """`grad_fn.accumulate` with `kd.kfac(micro_batches=4)`: the model's products
  and losses over 4 slices give the whole batch's steps."""
  options = dict(adapt_damping=True, damping_adaptation_interval=1)
  whole = _run_steps(_tx(**options), _params(), 3)
  micro = _run_steps(
      _tx(micro_batches=4, **options), _params(), 3,
      lambda p, s, x, y: GRAD_FN.accumulate(p, x, y, micro_batches=4, opt_state=s))
  np.testing.assert_allclose(_flat(micro[0]), _flat(whole[0]), rtol=1e-11, atol=1e-13)
  for field in ("damping", "learning_rate", "momentum", "rho"):
    np.testing.assert_allclose(float(getattr(_adaptive_state(micro[1]), field)),
                               float(getattr(_adaptive_state(whole[1]), field)),
                               rtol=1e-10, err_msg=field)
  with pytest.raises(ValueError, match="micro_batches=2 needs adaptive mode"):
    kd.kfac(0.1, 0.9, grad_fn=GRAD_FN, micro_batches=2)
  with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
    _tx(micro_batches=0)


def test_inject_hyperparams_fixes_or_adapts():
  """`optax.inject_hyperparams(kd.kfac)`: the injected damping starts the adapted
  one, an injected learning rate fixes α, and the result equals plain `kd.kfac`."""
  layers = GRAD_FN.discover(_params(), *_batch(0))
  common = dict(layers=layers, grad_fn=GRAD_FN, factor_dtype=jnp.float64,
                weight_decay=WD)
  injected = optax.inject_hyperparams(kd.kfac, static_args=(
      "layers", "grad_fn", "factor_dtype", "adapt_damping", "momentum"))(
      learning_rate=0.05, momentum=None, damping=LAMBDA, adapt_damping=True, **common)
  plain = kd.kfac(0.05, None, damping=LAMBDA, adapt_damping=True, **common)
  got, want = _run_steps(injected, _params(), 3), _run_steps(plain, _params(), 3)
  # (atol: an injected array and a Python float round differently, by ~1e-16,
  # in an eager step; entries near 1e-5 then differ by 1e-11 relatively)
  np.testing.assert_allclose(_flat(got[0]), _flat(want[0]), rtol=1e-12, atol=1e-14)
  assert float(_adaptive_state(got[1]).learning_rate) == pytest.approx(0.05)
  # Jitted, with only the non-number arguments static: optax injects every numeric
  # default too (min_damping, the rejection's factor, ...), as traced arrays that
  # kd.kfac's checks must leave to run time.
  minimal = optax.inject_hyperparams(kd.kfac, static_args=("layers", "grad_fn",
                                                        "factor_dtype"))(
      learning_rate=None, momentum=None, adapt_damping=True, reject_steps=True, **common)
  params, (x, y) = _params(), _batch(0)
  state = minimal.init(params)
  _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
  updates, state = jax.jit(lambda g, s, p, t: minimal.update(
      g, s, p, kfac_stats=t, kfac_batch=(x, y)))(grads, state, params, stats)
  assert int(_adaptive_state(state).count) == 1 and np.isfinite(_flat(updates)).all()


def test_inject_hyperparams_with_grad_fn_not_static_names_static_args():
  """optax takes a callable hyperparameter for a schedule and calls it with
  the step count: `grad_fn` left out of `static_args` says so by name."""
  layers = GRAD_FN.discover(_params(), *_batch(0))
  tx = optax.inject_hyperparams(kd.kfac, static_args=("layers",))(
      learning_rate=None, momentum=None, layers=layers, grad_fn=GRAD_FN)
  with pytest.raises(TypeError, match=r"as optax calls a schedule .*static_args=\('grad_fn'"):
    tx.init(_params())


def _scanned_loss(params, x, y):
  """Three tanh Dense blocks, stacked leaves run by `lax.scan` (`stack_index`)."""
  blocks = params["blocks"]

  def block(h, i):
    return jnp.tanh(kd.tags.dense(h, blocks["kernel"], blocks["bias"], name="block",
                                  stack_index=i)), None
  h, _ = jax.lax.scan(block, x, jnp.arange(3))
  return kd.losses.softmax_cross_entropy(
      kd.tags.dense(h, params["out"]["kernel"], name="out"), y)


def _unrolled_loss(params, x, y):
  h = x
  for i in range(3):
    h = jnp.tanh(kd.tags.dense(h, params[f"b{i}"]["kernel"], params[f"b{i}"]["bias"],
                               name=f"b{i}"))
  return kd.losses.softmax_cross_entropy(
      kd.tags.dense(h, params["out"]["kernel"], name="out"), y)


@pytest.mark.slow          # (CI time: test_ekfac's adaptive scanned case covers it)
def test_scanned_layers_equal_the_unrolled_model():
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  stacked = {"blocks": {"kernel": 0.4 * jax.random.normal(keys[0], (3, 5, 5), jnp.float64),
                        "bias": jnp.full((3, 5), 0.1, jnp.float64)},
             "out": {"kernel": 0.5 * jax.random.normal(keys[1], (5, CLASSES),
                                                        jnp.float64)}}
  unrolled = {f"b{i}": {"kernel": stacked["blocks"]["kernel"][i],
                        "bias": stacked["blocks"]["bias"][i]} for i in range(3)}
  unrolled["out"] = stacked["out"]
  results = []
  for loss_fn, params in ((_scanned_loss, stacked), (_unrolled_loss, unrolled)):
    grad_fn = kd.value_and_grad(loss_fn)
    tx = kd.kfac(None, None, layers=grad_fn.discover(params, *_batch(0)),
                 grad_fn=grad_fn, damping=LAMBDA, adapt_damping=True,
                 damping_adaptation_interval=1, factor_dtype=jnp.float64)
    results.append(_run_steps(
        tx, params, 3, lambda p, s, x, y, g=grad_fn: g(p, x, y, opt_state=s)))
  (got, got_state), (want, want_state) = results
  for i in range(3):
    np.testing.assert_allclose(got["blocks"]["kernel"][i], want[f"b{i}"]["kernel"],
                               rtol=1e-10, atol=1e-13)
  assert float(_adaptive_state(got_state).damping) == pytest.approx(
      float(_adaptive_state(want_state).damping), rel=1e-10)


@pytest.mark.slow
def test_checkpoint_and_convert_state_continue_the_trajectory(tmp_path):
  """An adaptive state saved on 8 devices (COMM-OPT), restored bit for bit, and
  moved to one device by `kd.convert_state`, continues the run: λ, v, α, μ, ρ
  and the K-FAC state all move."""
  mesh = helpers.data_mesh(8)
  options = dict(adapt_damping=True, damping_adaptation_interval=1)
  dist = kd.Distribution(mesh, gradient_reduction="all_reduce")
  tx8, tx1 = _tx(distribution=dist, **options), _tx(**options)
  params = _params()

  def step(params, state, x, y):
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    updates, state = tx8.update(grads, state, params, kfac_stats=stats,
                                kfac_batch=(x, y))
    return optax.apply_updates(params, updates), state
  run, state = helpers.compile_step(step, tx8.init(params), dist, 2)
  for i in range(2):
    params, state = run(params, state, *_batch(i))
  kd.save_checkpoint(tmp_path / "ckpt", state)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", tx8.init(_params()), mesh=mesh)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = kd.convert_state(restored, tx1.init(_params()))
  np.testing.assert_array_equal(np.asarray(_adaptive_state(moved).velocity["l0"]["kernel"]),
                                np.asarray(_adaptive_state(state).velocity["l0"]["kernel"]))
  # One more step each way: 8 devices from the saved state, 1 device from the moved one.
  x, y = _batch(2)
  params8, _ = run(params, restored, x, y)
  params = jax.device_put(params, jax.devices()[0])
  _, grads, stats = GRAD_FN(params, x, y, opt_state=moved)
  updates, moved = tx1.update(grads, moved, params, kfac_stats=stats, kfac_batch=(x, y))
  np.testing.assert_allclose(_flat(optax.apply_updates(params, updates)), _flat(params8),
                             rtol=1e-9, atol=1e-12)


def test_dp_kfac_adaptive_trains():
  """DP-KFAC (factor_reduction="local": each owner's factors from its own local
  batch) is not the single-device run; adaptive, it trains with α, μ, λ from
  the global batch's model (replicated by construction: P() specs)."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=1 / 8, factor_reduction="local",
                         gradient_reduction="all_reduce")
  tx = _tx(distribution=dist, adapt_damping=True, damping_adaptation_interval=1)
  params = _params()

  def step(params, state, x, y):
    loss, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")
  run, state = helpers.compile_step(step, tx.init(params), dist, 2, extra_out=(P(),))
  x, y = _batch(0)
  losses = []
  for _ in range(4):
    params, state, loss = run(params, state, x, y)
    losses.append(float(loss))
  inner = _adaptive_state(state)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert int(inner.skipped) == 0 and np.isfinite(float(inner.rho))
  assert float(inner.learning_rate) > 0


def test_adapted_values_reads_the_state():
  tx, params = _tx(adapt_damping=True), _params()
  state = tx.init(params)
  x, y = _batch(0)
  _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
  _, state = tx.update(grads, state, params, kfac_stats=stats, kfac_batch=(x, y))
  values = kd.adapted_values(state)
  inner = _adaptive_state(state)
  assert list(values) == ["learning_rate", "momentum", "damping", "rho"]
  assert float(values["learning_rate"]) == float(inner.learning_rate) > 0
  assert float(values["damping"]) == LAMBDA
  with pytest.raises(ValueError, match="no adaptive K-FAC state"):
    kd.adapted_values(kd.kfac(0.1, layers=GRAD_FN.discover(params, x, y)).init(params))
