"""`kd.losses.gaussian_nll` (a Gaussian whose mean and variance the model
predicts) and `kd.losses.poisson_nll` (counts with predicted log-rates).

Oracles: the negative log-likelihoods written out; the Fisher of the
predictive distribution in closed form (`diag(1/σ², 1/(2σ⁴))` in `(μ, σ²)`,
`diag(exp η)` in the log-rates) carried to each layer's output by its
Jacobian, which the Monte Carlo `G` must estimate; the empirical `G` from
per-example gradients by `jax.grad`. The Gauss-Newton products against a
dense matrix are in test_curvature.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64
B, D_IN, HIDDEN, OUT = 6, 3, 4, 2


def _params(out: int) -> dict:
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"l1": helpers.randn(k1, (D_IN, HIDDEN), 0.7),
          "l2": helpers.randn(k2, (HIDDEN, out), 0.7)}


def _hidden(p: dict, x: jax.Array, eps: dict | None = None) -> tuple:
  """The two layers' outputs `(a₁, z)`, each plus `eps` (for their Jacobians)."""
  eps = eps or {"l1": 0.0, "l2": 0.0}
  a1 = kd.tags.dense(x, p["l1"], name="l1") + eps["l1"]
  return a1, kd.tags.dense(jnp.tanh(a1), p["l2"], name="l2") + eps["l2"]


def _gaussian(z: jax.Array) -> tuple:
  return z[..., :OUT], jax.nn.softplus(z[..., OUT:])


def _gaussian_fisher(z: np.ndarray) -> np.ndarray:
  """Per example, the Fisher of `N(μ, σ²)` in `z = (μ, s)`, `σ² = softplus(s)`."""
  var = np.log1p(np.exp(z[:, OUT:]))
  slope = 1 / (1 + np.exp(-z[:, OUT:]))
  return np.stack([np.diag(d) for d in np.concatenate(
      [1 / var, slope ** 2 / (2 * var ** 2)], -1)])


CASES = {   # name: (outputs, loss of (z, t), per-example loss, Fisher in z, targets)
    "gaussian": (2 * OUT,
                 lambda z, t: kd.losses.gaussian_nll(*_gaussian(z), t),
                 lambda z, t: 0.5 * jnp.sum(jnp.log(_gaussian(z)[1])
                                            + (t - _gaussian(z)[0]) ** 2 / _gaussian(z)[1]),
                 _gaussian_fisher,
                 lambda key: helpers.randn(key, (B, OUT))),
    "poisson": (OUT, kd.losses.poisson_nll,
                lambda z, t: jnp.sum(jnp.exp(z) - t * z),
                lambda z: np.stack([np.diag(np.exp(r)) for r in z]),
                lambda key: jax.random.poisson(key, 3.0, (B, OUT)).astype(F64)),
}


def _problem(case: str):
  outputs, loss, per_example, fisher, targets = CASES[case]
  params = _params(outputs)
  x = helpers.randn(jax.random.PRNGKey(1), (B, D_IN))
  t = targets(jax.random.PRNGKey(2))
  return params, x, t, lambda p, x, t: loss(_hidden(p, x)[1], t), per_example, fisher


def _output_jacobians(params: dict, x: jax.Array) -> dict:
  """Per example, `∂z/∂(layer output)` for each layer: `[B, out, width]`."""
  widths = {"l1": HIDDEN, "l2": params["l2"].shape[1]}
  zeros = {name: jnp.zeros((B, w), F64) for name, w in widths.items()}
  jac = jax.jacobian(lambda e: _hidden(params, x, e)[1])(zeros)
  return {name: np.stack([np.asarray(j)[i, :, i, :] for i in range(B)])
          for name, j in jac.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_value_and_both_fishers_against_closed_forms(case):
  """The loss is the negative log-likelihood's mean; the empirical `G` is
  `(1/n) Σ gᵢgᵢᵀ` of the per-example gradients; the Monte Carlo `G` estimates
  `(1/n) Σ Jᵢᵀ Fᵢ Jᵢ`, `F` the predictive distribution's Fisher in the
  model's output and `J` the output's Jacobian in each layer's output."""
  with jax.enable_x64(True):
    params, x, t, loss_fn, per_example, fisher = _problem(case)
    z = _hidden(params, x)[1]
    loss, _, stats = helpers.capture(loss_fn)(params, x, t)
    want = np.mean([float(per_example(z[i], t[i])) for i in range(B)])
    np.testing.assert_allclose(float(loss), want, rtol=1e-12)

    jac = _output_jacobians(params, x)
    grads = np.stack([np.asarray(jax.grad(per_example)(z[i], t[i])) for i in range(B)])
    fishers = fisher(np.asarray(z))
    for name, j in jac.items():
      per_layer = np.einsum("iow,io->iw", j, grads)
      np.testing.assert_allclose(np.asarray(stats[name]["G"]),
                                 per_layer.T @ per_layer / B, rtol=1e-10, atol=1e-14)
    _, _, draws = helpers.mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x, t)
    for name, j in jac.items():
      exact = np.einsum("iow,iop,ipv->wv", j, fishers, j) / B
      helpers.check_mc_estimate(draws[name]["G"], exact, f"{case}: G of {name}")


def test_masked_rows_take_no_part():
  """A masked example's variance (0 there: padding) and NaN targets change
  nothing: the loss, the gradients and `G` equal those of the kept rows alone
  (`A` still counts every row the layers ran: `kd.tags.row_mask` leaves them
  out of it)."""
  with jax.enable_x64(True):
    params, x, t, _, _, _ = _problem("gaussian")
    keep = jnp.array([1, 0, 1, 1, 0, 1], F64)

    def masked(p, x, t):
      mu, var = _gaussian(_hidden(p, x)[1])
      var = jnp.where(keep[:, None] > 0, var, 0.0)
      return kd.losses.gaussian_nll(mu, var, jnp.where(keep[:, None] > 0, t, jnp.nan),
                                    mask=keep)

    def kept(p, x, t):
      mu, var = _gaussian(_hidden(p, x)[1])
      return kd.losses.gaussian_nll(mu, var, t)
    rows = np.flatnonzero(np.asarray(keep))
    got = helpers.capture(masked)(params, x, t)
    want = helpers.capture(kept)(params, x[rows], t[rows])
    for g, w in zip(jax.tree.leaves((got[:2], {k: v["G"] for k, v in got[2].items()})),
                    jax.tree.leaves((want[:2], {k: v["G"] for k, v in want[2].items()}))):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("case,bad", [("gaussian", "variance"), ("gaussian", "nan"),
                                      ("poisson", "count")])
def test_invalid_values_make_the_loss_nan(case, bad):
  """A variance ≤ 0 (or NaN) or a negative count at a kept example makes the
  loss NaN, so the step is skipped; at a masked one it is ignored."""
  with jax.enable_x64(True):
    z = helpers.randn(jax.random.PRNGKey(0), (B, 2 * OUT))
    mask = jnp.ones(B).at[0].set(0.0)
    if case == "gaussian":
      mu, var = _gaussian(z)
      var = var.at[0, 0].set(-1.0 if bad == "variance" else jnp.nan)
      loss = lambda m: kd.losses.gaussian_nll(mu, var, jnp.zeros_like(mu), mask=m)
    else:
      counts = jnp.ones((B, OUT)).at[0, 1].set(-1.0)
      loss = lambda m: kd.losses.poisson_nll(z[:, :OUT], counts, mask=m)
    assert np.isnan(float(loss(None)))
    assert np.isfinite(float(loss(mask)))


def test_shape_errors_name_the_fix():
  """`[B]` outputs (a squeezed `[B, 1]`: one example of `B` outputs, the mean
  a sum) are refused with the reshape to use; variances, targets and counts
  must have the outputs' shape; a per-output mask names the reshape that makes
  each output an example."""
  x = jnp.ones((4,))
  calls = (lambda x: kd.losses.squared_error(x, x),
           lambda x: kd.losses.sigmoid_cross_entropy(x, 0 * x),
           lambda x: kd.losses.gaussian_nll(x, x, x),
           lambda x: kd.losses.poisson_nll(x, x))
  for call in calls:
    grad_fn = kd.value_and_grad(lambda p, x: call(kd.tags.dense(x, p)[:, 0]))
    with pytest.raises(ValueError, match=r"give B examples of one output as \[B, 1\]"):
      grad_fn(jnp.ones((3, 1)), jnp.ones((4, 3)))
    # Outside kd.value_and_grad, a loss is a loss: one example's, or per
    # example under jax.vmap (an evaluation, DP-SGD's per-example gradients).
    np.testing.assert_allclose(jax.vmap(call)(jnp.ones((4, 2))),
                               jnp.full(4, float(call(jnp.ones(2)))))
  y = jnp.ones((4, 2))
  with pytest.raises(ValueError, match=r"gaussian_nll: variances of shape \(4, 1\).*"
                                       r"expected variances of shape \(4, 2\)"):
    kd.losses.gaussian_nll(y, jnp.ones((4, 1)), y)
  with pytest.raises(ValueError, match=r"poisson_nll: counts of shape \(4,\)"):
    kd.losses.poisson_nll(y, jnp.ones((4,)))
  with pytest.raises(ValueError, match=r"a weight per output.*inputs\[\.\.\., None\]"):
    kd.losses.squared_error(y, y, mask=jnp.ones((4, 2)))
  # The recipe it names: each output an example, the missing ones masked.
  assert float(kd.losses.squared_error(y[..., None], 0 * y[..., None],
                                       mask=jnp.array([[1.0, 0.0]] * 4))) == 0.5


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_poisson_monte_carlo_fisher_at_large_rates(x64):
  """Rates up to e²³ (past int32's 2³¹ counts): the Monte Carlo `G` of a
  layer whose output is the log-rates still estimates the Fisher `diag(e^η)`
  (jax's Poisson sampler saturates there and loses its variance to rounding
  from λ ≈ 1e6: `G` came out up to 1e10 times too large)."""
  with jax.enable_x64(x64):
    eta = jnp.array([2.0, 8.0, 14.0, 23.0])
    params = {"w": jnp.zeros((2, 4)), "b": eta}
    x = jnp.zeros((B, 2))

    def loss_fn(p, x, t):
      z = kd.tags.dense(x, p["w"], p["b"], name="head")
      return kd.losses.poisson_nll(z, t)
    counts = jnp.round(jnp.broadcast_to(jnp.exp(eta), (B, 4)))
    _, _, draws = helpers.mc_draws(kd.value_and_grad(loss_fn, fisher="mc"), params, x,
                                   counts)
    g = np.asarray(draws["head"]["G"], np.float64) / np.sqrt(
        np.outer(np.exp(eta), np.exp(eta)))         # each rate's scale out
    helpers.check_mc_estimate(g, np.eye(4), "G / e^η")


def test_kfac_trains_a_heteroscedastic_regression():
  """Adaptive K-FAC on `gaussian_nll` (noise growing with |x|): the loss
  falls below 0, which no constant variance reaches (≈ 0.09 with the mean
  exact), and the predicted log-variance follows the noise's."""
  xs = jnp.linspace(-2, 2, 64)[:, None]
  noise = 0.1 + 0.5 * jnp.abs(xs)
  ys = jnp.sin(2 * xs) + noise * jax.random.normal(jax.random.PRNGKey(3), xs.shape)
  k1, k2 = jax.random.split(jax.random.PRNGKey(4))
  params = {"l1": jax.random.normal(k1, (1, 16)), "b1": jax.random.normal(k2, (16,)),
            "l2": 0.1 * jax.random.normal(k2, (16, 2)), "b2": jnp.zeros(2)}

  def predict(p, x):
    h = jnp.tanh(kd.tags.dense(x, p["l1"], p["b1"], name="l1"))
    return kd.tags.dense(h, p["l2"], p["b2"], name="l2")

  def loss_fn(p, x, y):
    z = predict(p, x)
    return kd.losses.gaussian_nll(z[:, :1], jnp.exp(z[:, 1:]), y)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(None, None, damping=1e-2, adapt_damping=True, grad_fn=grad_fn,
               layers=grad_fn.discover(params, xs, ys))

  @jax.jit
  def step(p, state):
    loss, grads, stats = grad_fn(p, xs, ys, opt_state=state)
    updates, state = tx.update(grads, state, p, kfac_stats=stats, kfac_batch=(xs, ys))
    return jax.tree.map(jnp.add, p, updates), state, loss
  state, losses = tx.init(params), []
  for _ in range(60):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.0, losses[::10]
  log_var = predict(params, xs)[:, 1]
  assert float(jnp.corrcoef(log_var, jnp.log(noise[:, 0] ** 2))[0, 1]) > 0.7
