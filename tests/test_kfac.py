"""The K-FAC transform against float64 oracles: preconditioning, averages, cadence."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64


@pytest.fixture(autouse=True, scope="module")
def _x64():
  """float64 for this module's tests only (a global setting would leak into the
  next test module run by the same worker)."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


def _layer(name, d_in, d_out, bias=True):
  return kd.TaggedLayer(
      name=name, kind="dense", kernel_path=f"{name}/kernel",
      bias_path=f"{name}/bias" if bias else None, kernel_shape=(d_in, d_out),
      a_dim=d_in + bias, g_dim=d_out)


def _spd(rng, d, scale=1.0):
  m = rng.normal(size=(d, 2 * d))
  return scale * m @ m.T / (2 * d)


def _setup(seed=0, dims=((4, 3, True), (3, 5, False), (4, 2, True))):
  rng = np.random.default_rng(seed)
  layers = kd.LayerRegistry(tuple(
      _layer(f"l{i}", di, do, b) for i, (di, do, b) in enumerate(dims)))
  params = {}
  for layer in layers:
    d_in = layer.a_dim - layer.has_bias
    params[layer.name] = {"kernel": jnp.asarray(rng.normal(size=(d_in, layer.g_dim)), F64)}
    if layer.has_bias:
      params[layer.name]["bias"] = jnp.asarray(rng.normal(size=(layer.g_dim,)), F64)
  return rng, layers, params


def _stats(rng, layers, scale=1.0):
  return {l.name: {"A": jnp.asarray(_spd(rng, l.a_dim, scale), F64),
                   "G": jnp.asarray(_spd(rng, l.g_dim, scale), F64)} for l in layers}


def _grad_matrix(layer, grads):
  m = np.asarray(grads[layer.name]["kernel"])
  if layer.has_bias:
    m = np.concatenate([m, np.asarray(grads[layer.name]["bias"])[None]], axis=0)
  return m


def _random_grads(rng, params):
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), F64), params)


# Three layers of one shape: preconditioned as one run off CPU.
RUN_DIMS = ((4, 3, True), (4, 3, True), (2, 6, False), (4, 3, True), (6, 2, True))


def test_conv_kernels_step_matches_dense_oracle():
  """A 1-D and a 2-D convolution's kernels (`(k, in, out)`, `(kh, kw, in,
  out)`) are preconditioned as their `(window·in (+ bias), out)` matrices:
  `(A ⊗ G + γI)⁻¹ vec(∇)` built densely, the update reshaped back."""
  rng = np.random.default_rng(5)
  layers = kd.LayerRegistry((
      kd.TaggedLayer(name="c1", kind="conv1d", kernel_path="c1/kernel",
                     bias_path="c1/bias", kernel_shape=(3, 2, 4), a_dim=7, g_dim=4),
      kd.TaggedLayer(name="c2", kind="conv2d", kernel_path="c2/kernel", bias_path=None,
                     kernel_shape=(2, 3, 2, 3), a_dim=12, g_dim=3)))
  grads = {"c1": {"kernel": rng.normal(size=(3, 2, 4)), "bias": rng.normal(size=(4,))},
           "c2": {"kernel": rng.normal(size=(2, 3, 2, 3))}}
  grads = jax.tree.map(lambda g: jnp.asarray(g, F64), grads)
  gamma = 0.05
  tx = kd.scale_by_kfac(layers=layers, damping=gamma, factor_dtype=F64)
  stats = _stats(rng, layers)
  updates, _ = jax.jit(tx.update)(grads, tx.init(grads), kfac_stats=stats)
  for layer in layers:
    a, g = (np.asarray(stats[layer.name][k]) for k in ("A", "G"))
    kernel = np.asarray(grads[layer.name]["kernel"])
    grad = kernel.reshape(-1, layer.g_dim)
    if layer.has_bias:
      grad = np.concatenate([grad, np.asarray(grads[layer.name]["bias"])[None]])
    big = np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0])
    expected = np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
    np.testing.assert_allclose(updates[layer.name]["kernel"],
                               expected[:kernel.size // layer.g_dim].reshape(kernel.shape),
                               rtol=1e-10, atol=1e-12)
    if layer.has_bias:
      np.testing.assert_allclose(updates[layer.name]["bias"], expected[-1], rtol=1e-10,
                                 atol=1e-12)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("arrangement", ["one_at_a_time", "batched"])
def test_single_step_matches_dense_oracle(monkeypatch, method, arrangement):
  """One step against `(A ⊗ G + γI)⁻¹ vec(∇)` built densely: one layer at a
  time (on CPU by default) and with the equal-shape layers batched (off CPU,
  `precondition.precondition`); both forced here."""
  from kfac_jax_dist.kfac import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import precondition  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(precondition, "BATCH_RUNS", arrangement == "batched")
  rng, layers, params = _setup(dims=RUN_DIMS)
  gamma = 0.03
  tx = kd.scale_by_kfac(layers=layers, damping=gamma, method=method,
                        factor_dtype=F64)
  state = tx.init(params)
  runs = layout_lib.precondition_runs(state.layout, 0)
  assert sorted(len(run) for run in runs) == [1, 1, 3]
  # On CPU (by default) only a stack's blocks run together: none here.
  assert len(layout_lib.precondition_runs(state.layout, 0, False)) == len(layers)
  stats = _stats(rng, layers)
  grads = _random_grads(rng, params)
  updates, _ = jax.jit(tx.update)(grads, state, kfac_stats=stats)
  for layer in layers:
    a = np.asarray(stats[layer.name]["A"])
    g = np.asarray(stats[layer.name]["G"])
    grad = _grad_matrix(layer, grads)
    if method == "eigen":
      # (A ⊗ G + γI)⁻¹ vec(∇), vec row-major: (A ⊗ G) vec(∇) = vec(A ∇ G).
      big = np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0])
      expected = np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
    else:
      pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
      expected = (np.linalg.inv(a + pi * np.sqrt(gamma) * np.eye(a.shape[0])) @ grad
                  @ np.linalg.inv(g + np.sqrt(gamma) / pi * np.eye(g.shape[0])))
    got = _grad_matrix(layer, updates)
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-10)


def test_diagonal_fallback_matches_dense_oracle():
  rng, layers, params = _setup(dims=((6, 3, True),))
  gamma = 0.01
  tx = kd.scale_by_kfac(layers=layers, damping=gamma, max_factor_dim=4,
                        factor_dtype=F64)
  state = tx.init(params)
  assert state.layout.plans[0].a_form == "diag"
  assert state.layout.plans[0].g_form == "full"
  stats = _stats(rng, layers)
  grads = _random_grads(rng, params)
  updates, _ = tx.update(grads, state, kfac_stats=stats)
  a = np.diag(np.diag(np.asarray(stats["l0"]["A"])))
  g = np.asarray(stats["l0"]["G"])
  grad = _grad_matrix(layers.layers[0], grads)
  big = np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0])
  expected = np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
  np.testing.assert_allclose(_grad_matrix(layers.layers[0], updates), expected,
                             rtol=1e-8)


def test_running_average_and_cadence_step_by_step():
  rng, layers, params = _setup()
  decay, gamma, f_every, i_every = 0.7, 0.05, 2, 3
  tx = kd.scale_by_kfac(layers=layers, damping=gamma, factor_decay=decay,
                        factor_update_every=f_every, inverse_update_every=i_every,
                        factor_dtype=F64)
  state, update = tx.init(params), jax.jit(tx.update)
  running = {l.name: None for l in layers}
  weight = 0.0
  decomposed = {}
  for count in range(8):
    assert bool(state.update_factors) == (count % f_every == 0)
    stats = _stats(rng, layers, scale=1.0 + count)
    grads = _random_grads(rng, params)
    updates, state = update(grads, state, kfac_stats=stats)
    if count % f_every == 0:
      new_weight = decay * weight + (1 - decay)
      for l in layers:
        old = running[l.name] or {"A": 0.0, "G": 0.0}
        running[l.name] = {
            k: (decay * weight * old[k] + (1 - decay) * np.asarray(stats[l.name][k]))
            / new_weight for k in ("A", "G")}
      weight = new_weight
    if count % i_every == 0:
      decomposed = {n: dict(v) for n, v in running.items()}
    assert int(state.count) == count + 1
    stored = kd.running_factors(state)
    for l in layers:
      np.testing.assert_allclose(stored[l.name]["A"], running[l.name]["A"], rtol=1e-12)
      np.testing.assert_allclose(stored[l.name]["G"], running[l.name]["G"], rtol=1e-12)
      a, g = decomposed[l.name]["A"], decomposed[l.name]["G"]
      grad = _grad_matrix(l, grads)
      big = np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0])
      expected = np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
      np.testing.assert_allclose(_grad_matrix(l, updates), expected, rtol=1e-7,
                                 err_msg=f"step {count} layer {l.name}")
  # The first update gives exactly the first batch (no bias toward identity).
  assert weight > 0


def test_refreshes_due_every_step_run_unbranched():
  """An `every` of 1 (`cadence.always`) runs the factor update and the
  decomposition with no conditional: 1/2 and 2/1 each add one over 1/1 (the
  program lowered for CPU; 2/2 adds both and the platform's choice of the
  conditional around them)."""
  rng, layers, params = _setup()
  stats, grads = _stats(rng, layers), _random_grads(rng, params)

  def conditionals(factor_every: int, inverse_every: int) -> int:
    tx = kd.scale_by_kfac(layers=layers, factor_update_every=factor_every,
                          inverse_update_every=inverse_every, factor_dtype=F64)
    text = jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st)).trace(
        grads, tx.init(params), stats).lower(lowering_platforms=("cpu",)).as_text()
    return text.count("stablehlo.case") + text.count("stablehlo.if")

  every_step = conditionals(1, 1)
  assert conditionals(1, 2) == every_step + 1
  assert conditionals(2, 1) == every_step + 1
  assert conditionals(2, 2) > every_step + 1


@pytest.mark.parametrize("on_cpu", [True, False])
def test_refresh_arrangements_agree(monkeypatch, on_cpu):
  """The refreshes' two arrangements, chosen when tracing (`Collectives.on_cpu`):
  side by side on CPU, inside one conditional elsewhere (a plain step then runs
  one conditional, one host round trip on a GPU). Forced here on this machine:
  the same states and updates over steps that refresh both, one, or neither,
  and the outer conditional only off CPU."""
  from kfac_jax_dist.core import collectives  # pylint: disable=import-outside-toplevel
  rng, layers, params = _setup()
  stats = [_stats(rng, layers) for _ in range(5)]
  grads = [_random_grads(rng, params) for _ in range(5)]

  def run(arrangement_on_cpu: bool):
    monkeypatch.setattr(collectives.Collectives, "on_cpu", property(
        lambda self: arrangement_on_cpu))
    tx = kd.scale_by_kfac(layers=layers, factor_update_every=2, inverse_update_every=3,
                          factor_dtype=F64)
    update = jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st))
    state, outs = tx.init(params), []
    for g, st in zip(grads, stats):            # counts 0..4: both, -, f, i, f
      out, state = update(g, state, st)
      outs.append(out)
    text = update.trace(grads[0], tx.init(params), stats[0]).lower(
        lowering_platforms=("cpu",)).as_text()
    return outs, state, text.count("stablehlo.case") + text.count("stablehlo.if")

  outs, state, conds = run(on_cpu)
  want_outs, want_state, cpu_conds = run(True)
  chex.assert_trees_all_close(outs, want_outs, rtol=0, atol=0)
  chex.assert_trees_all_close(state, want_state, rtol=0, atol=0)
  assert conds == cpu_conds + (0 if on_cpu else 1)


def test_schedules_for_damping_and_intervals():
  rng, layers, params = _setup(dims=((3, 2, True),))
  damping = lambda c: 0.1 / (1.0 + c)
  tx = kd.scale_by_kfac(layers=layers, damping=damping,
                        factor_update_every=lambda c: jnp.where(c < 2, 1, 4),
                        inverse_update_every=lambda c: jnp.where(c < 2, 1, 4),
                        factor_dtype=F64)
  state, update = tx.init(params), jax.jit(tx.update)
  flags = []
  for count in range(9):
    flags.append(bool(state.update_factors))
    stats = _stats(rng, layers)
    grads = _random_grads(rng, params)
    updates, state = update(grads, state, kfac_stats=stats)
    if count == 1:   # factors and inverses from this batch only after step 0's
      pass
  assert flags == [True, True, False, False, True, False, False, False, True]
  # Damping is applied at preconditioning time with the current value.
  stats = _stats(rng, layers)
  grads = _random_grads(rng, params)
  tx1 = kd.scale_by_kfac(layers=layers, damping=damping, factor_dtype=F64)
  s, update = tx1.init(params), jax.jit(tx1.update)
  _, s = update(grads, s, kfac_stats=stats)
  updates, _ = update(grads, s, kfac_stats=stats)   # count 1: γ = 0.05
  a, g = np.asarray(stats["l0"]["A"]), np.asarray(stats["l0"]["G"])
  grad = _grad_matrix(layers.layers[0], grads)
  big = np.kron(a, g) + 0.05 * np.eye(a.shape[0] * g.shape[0])
  expected = np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
  np.testing.assert_allclose(_grad_matrix(layers.layers[0], updates), expected,
                             rtol=1e-7)


def test_kl_clip_formula():
  rng, layers, params = _setup()
  gamma, kappa, eta = 0.01, 1e-4, 0.5
  plain = kd.scale_by_kfac(layers=layers, damping=gamma, factor_dtype=F64)
  clipped = kd.scale_by_kfac(layers=layers, damping=gamma, kl_clip=kappa,
                             learning_rate=eta, factor_dtype=F64)
  stats = _stats(rng, layers)
  grads = _random_grads(rng, params)
  v, _ = plain.update(grads, plain.init(params), kfac_stats=stats)
  c, _ = clipped.update(grads, clipped.init(params), kfac_stats=stats)
  vg = sum(abs(float(np.sum(_grad_matrix(l, v) * _grad_matrix(l, grads))))
           for l in layers)
  nu = min(1.0, np.sqrt(kappa / (eta ** 2 * vg)))
  assert nu < 1.0
  for l in layers:
    np.testing.assert_allclose(_grad_matrix(l, c), nu * _grad_matrix(l, v), rtol=1e-10)
  with pytest.raises(ValueError, match="learning_rate"):
    kd.scale_by_kfac(layers=layers, kl_clip=1e-3)


def test_float32_damping_and_clip_factors_where_their_operands_overflow():
  """π and ν in float32 where an intermediate passes its range but the value
  does not: π² = (tr A/d)/(tr G/d) = 1.6e40 gives π = 1.3e20 (it came out inf,
  the layer's inverses 0 and its update 0, accepted), and η²·Σ|⟨V,∇⟩| = 1e39
  gives ν = 1e-21 (it came out 0). Against the float64 formulas."""
  from kfac_jax_dist.kfac import config as config_lib
  from kfac_jax_dist.kfac import linalg, precondition
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  d_a, d_g = linalg.pi_adjusted_damping(f32(7.9e5), f32(4.85e-35), f32(1e-2))
  pi = np.sqrt(7.9e5 / 4.85e-35)
  np.testing.assert_allclose([float(d_a), float(d_g)], [pi * 0.1, 0.1 / pi], rtol=1e-5)
  zero_g = linalg.pi_adjusted_damping(f32(5.0), f32(0.0), f32(1e-2))  # G = 0: floored
  assert all(np.isfinite(float(v)) and float(v) > 0 for v in zero_g)
  config = config_lib.KfacConfig(kl_clip=1e-5, learning_rate=10.0)
  nu = precondition.kl_clip(config, f32(1e37), jnp.zeros([], jnp.int32))
  np.testing.assert_allclose(float(nu), np.sqrt(1e-5 / (100.0 * 1e37)), rtol=1e-5)


def test_kl_clip_reads_schedules_at_the_update_count():
  """`η` and `κ` schedules are read at the update's own count (as the SGD
  tail reads `η`), not at the next one: two updates, ν from η(k), κ(k)."""
  rng, layers, params = _setup()
  eta, kappa = (lambda c: 0.5 * 0.5 ** c), (lambda c: 1e-4 * 2.0 ** c)
  plain = kd.scale_by_kfac(layers=layers, damping=0.01, factor_dtype=F64)
  clipped = kd.scale_by_kfac(layers=layers, damping=0.01, kl_clip=kappa,
                             learning_rate=eta, factor_dtype=F64)
  stats, grads = _stats(rng, layers), _random_grads(rng, params)
  p_state, c_state = plain.init(params), clipped.init(params)
  for count in range(2):
    v, p_state = plain.update(grads, p_state, kfac_stats=stats)
    c, c_state = clipped.update(grads, c_state, kfac_stats=stats)
    vg = sum(abs(float(np.sum(_grad_matrix(l, v) * _grad_matrix(l, grads))))
             for l in layers)
    nu = min(1.0, np.sqrt(kappa(count) / (eta(count) ** 2 * vg)))
    assert nu < 1.0
    for l in layers:
      np.testing.assert_allclose(_grad_matrix(l, c), nu * _grad_matrix(l, v), rtol=1e-10,
                                 err_msg=f"count {count}")


def test_untagged_and_skipped_parameters_pass_through():
  rng, layers, params = _setup()
  params["extra"] = {"scale": jnp.ones((3,), F64)}
  tx = kd.scale_by_kfac(layers=layers, skip=("^l1$",), factor_dtype=F64)
  state = tx.init(params)
  assert state.layout.skipped == ("l1",)
  assert "extra/scale" in state.layout.passthrough
  assert "l1/kernel" in state.layout.passthrough
  grads = _random_grads(rng, params)
  updates, _ = tx.update(grads, state, kfac_stats=_stats(rng, layers))
  np.testing.assert_array_equal(updates["extra"]["scale"], grads["extra"]["scale"])
  np.testing.assert_array_equal(updates["l1"]["kernel"], grads["l1"]["kernel"])
  assert not np.allclose(updates["l0"]["kernel"], grads["l0"]["kernel"])
  text = kd.describe(state, print_table=False)
  for needle in ("l0", "skipped", "untagged", "extra/scale", "5x5", "3x3"):
    assert needle in text
  with pytest.raises(ValueError, match="matches no tagged layer"):
    kd.scale_by_kfac(layers=layers, skip=("nothing",)).init(params)


@pytest.mark.parametrize("options", [{}, dict(stale_threshold=0.1),
                                     dict(stale_threshold=0.1, method="inverse")])
def test_every_layer_skipped_passes_the_gradients_through(options):
  """With every tagged layer skipped there is nothing to precondition (with
  stale statistics, nothing to refresh): the updates are the gradients."""
  rng, layers, params = _setup()
  tx = kd.scale_by_kfac(layers=layers, skip=("^l",), factor_dtype=F64, **options)
  state = tx.init(params)
  grads = _random_grads(rng, params)
  for _ in range(2):
    updates, state = tx.update(grads, state, kfac_stats=_stats(rng, layers))
    jax.tree.map(np.testing.assert_array_equal, updates, grads)
  assert int(state.count) == 2 and int(state.skipped) == 0


def test_a_partition_without_the_skipped_layers_parameters():
  """K-FAC on part of the model (an `optax.multi_transform` / `masked`
  partition): a skipped layer's parameters may be absent from the tree, and
  the other layers' updates are those of the whole tree; a layer not skipped
  must be there, and the error says how to leave it out."""
  rng, layers, params = _setup()
  tx = kd.scale_by_kfac(layers=layers, skip=("^l1$",), factor_dtype=F64)
  without = lambda tree: {k: v for k, v in tree.items() if k != "l1"}
  grads, stats = _random_grads(rng, params), _stats(rng, layers)
  whole, _ = tx.update(grads, tx.init(params), kfac_stats=stats)
  part, _ = tx.update(without(grads), tx.init(without(params)), kfac_stats=stats)
  for name in ("l0", "l2"):
    for key in whole[name]:
      np.testing.assert_array_equal(part[name][key], whole[name][key])
  with pytest.raises(ValueError, match=r"parameter 'l1/kernel' is not in the tree given "
                                       r"to init .*skip="):
    kd.scale_by_kfac(layers=layers, factor_dtype=F64).init(without(params))
  kernels_only = {k: {"kernel": v["kernel"]} for k, v in params.items()}
  assert any(layer.has_bias for layer in layers)
  with pytest.raises(ValueError, match=r"its kernel '.*/kernel' is in the tree given to "
                                       r"init, its bias '.*/bias' is not.* label them with "
                                       r"their kernels"):
    kd.scale_by_kfac(layers=layers).init(kernels_only)


def test_tree_map_params_refused():
  """optax.tree_map_params runs init on a placeholder: every transform of
  the library refuses it, naming what to use instead."""
  _, layers, params = _setup()
  for name, tx in (("scale_by_kfac", kd.kfac(0.1, layers=layers)),
                   ("scale_by_shampoo", kd.shampoo(0.1)), ("scale_by_soap", kd.soap(0.1))):
    with pytest.raises(TypeError, match=f"{name}: optax.tree_map_params is not supported"
                                        r".*kd.partition_specs"):
      optax.tree_map_params(tx, lambda p: p, tx.init(params))


def test_clear_errors():
  rng, layers, params = _setup()
  with pytest.raises(ValueError, match="layers="):
    kd.scale_by_kfac().init(params)
  tx = kd.scale_by_kfac(layers=layers)
  state = tx.init(params)
  grads = _random_grads(rng, params)
  with pytest.raises(ValueError, match="kfac_stats"):
    tx.update(grads, state)
  stats = _stats(rng, layers)
  del stats["l1"]
  with pytest.raises(ValueError, match="'l1'"):
    tx.update(grads, state, kfac_stats=stats)
  bad = dict(params)
  bad["l0"] = {"kernel": jnp.zeros((5, 3))}
  with pytest.raises(ValueError, match="l0"):
    tx.init(bad)
  with pytest.raises(ValueError, match="method"):
    kd.scale_by_kfac(layers=layers, method="cholesky")


def test_jit_and_state_stability():
  rng, layers, params = _setup()
  tx = kd.scale_by_kfac(layers=layers, factor_update_every=2, inverse_update_every=3)
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state_eager = state_jit = tx.init(params32)
  structure = jax.tree.structure(state_eager)
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state_eager)
  update = jax.jit(tx.update)
  for _ in range(7):
    stats = jax.tree.map(lambda x: x.astype(jnp.float32), _stats(rng, layers))
    grads = jax.tree.map(lambda p: p.astype(jnp.float32), _random_grads(rng, params))
    u_eager, state_eager = tx.update(grads, state_eager, kfac_stats=stats)
    u_jit, state_jit = update(grads, state_jit, kfac_stats=stats)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5),
                 u_eager, u_jit)
    assert jax.tree.structure(state_jit) == structure
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state_jit) == shapes


def _same_arrays(a, b):
  """Same tree, dtypes, shapes, weak types, placement and values."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert isinstance(x, jax.Array)
    assert (x.dtype, x.shape, x.weak_type) == (y.dtype, y.shape, y.weak_type)
    assert x.sharding == y.sharding
    np.testing.assert_array_equal(np.asarray(x, np.float64), np.asarray(y, np.float64))


@pytest.mark.parametrize("config", [
    {"method": "eigen"}, {"method": "inverse", "factor_dtype": jnp.bfloat16},
    {"stale_threshold": 0.1}, {"distribution": 4}, {"shampoo": True}])
def test_eager_init_equals_traced_init(config):
  # Concrete params: the state is built in numpy and transferred; traced ones
  # (jit, eval_shape) take the jnp construction. Both must give the same state.
  _, layers, params = _setup()
  config = dict(config)
  if config.pop("shampoo", False):
    tx = kd.shampoo(0.1, block_size=3, graft_type="adagrad")
  else:
    if "distribution" in config:
      mesh = helpers.data_mesh(config["distribution"])
      config["distribution"] = kd.Distribution(mesh, grad_worker_fraction=0.5)
    tx = kd.kfac(0.1, layers=layers, **config)
  eager = tx.init(params)
  _same_arrays(eager, jax.jit(tx.init)(params))
  shapes = jax.eval_shape(tx.init, params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), eager) == jax.tree.map(
      lambda x: (x.shape, x.dtype), shapes)


def test_chains_with_optax_transforms():
  rng, layers, params = _setup()
  params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  stats = jax.tree.map(lambda x: x.astype(jnp.float32), _stats(rng, layers))
  grads = jax.tree.map(lambda p: p.astype(jnp.float32), _random_grads(rng, params))
  txs = [
      optax.chain(optax.clip_by_global_norm(1.0), kd.scale_by_kfac(layers=layers),
                  optax.sgd(0.1, 0.9)),
      optax.inject_hyperparams(kd.kfac)(learning_rate=0.1, layers=layers),
      optax.apply_if_finite(kd.kfac(0.1, layers=layers), max_consecutive_errors=3),
  ]
  for tx in txs:
    state = tx.init(params)
    for _ in range(2):
      updates, state = jax.jit(tx.update)(grads, state, params, kfac_stats=stats)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
    assert len(kd.describe(state, print_table=False)) > 0
  # apply_if_finite skips a non-finite step and leaves the K-FAC state alone.
  tx = txs[2]
  state = tx.init(params)
  bad = jax.tree.map(lambda g: g * jnp.nan, grads)
  updates, new_state = tx.update(bad, state, params, kfac_stats=stats)
  np.testing.assert_array_equal(jax.tree.leaves(new_state.inner_state)[0],
                                jax.tree.leaves(state.inner_state)[0])


def test_zero_momentum_keeps_no_trace():
  """`momentum=0` (a number) keeps no parameter-sized momentum trace in
  `kd.kfac`'s or `kd.shampoo`'s state; the updates are those of the trace with
  decay 0 that an array momentum keeps (optax's `sgd`)."""
  rng, layers, params = _setup()
  stats = _stats(rng, layers)
  grads = [_random_grads(rng, params) for _ in range(3)]
  for make, extra in ((functools.partial(kd.kfac, layers=layers), dict(kfac_stats=stats)),
                      (functools.partial(kd.shampoo, start_preconditioning_step=1), {})):
    txs = (make(0.1, momentum=0), make(0.1, momentum=jnp.asarray(0.0, F64)))
    states = [tx.init(params) for tx in txs]
    traces = [[s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, optax.TraceState)) if isinstance(s, optax.TraceState)] for state in states]
    assert (len(traces[0]), len(traces[1])) == (0, 1)
    for g in grads:
      (u_plain, states[0]), (u_traced, states[1]) = (
          tx.update(g, state, params, **extra) for tx, state in zip(txs, states))
      helpers.assert_trees_equal(u_plain, u_traced)


def test_readers_find_the_kfac_state_in_an_optax_state():
  """`kd.running_factors` / `kd.second_order_parts` take an optax state holding
  one K-FAC state (`kd.kfac`'s chain, `inject_hyperparams`') as that state;
  none or two are refused, pointing to `kd.find_states`."""
  rng, layers, params = _setup()
  stats = _stats(rng, layers)
  for tx in (kd.kfac(0.1, layers=layers),
             optax.inject_hyperparams(kd.kfac)(learning_rate=0.1, layers=layers)):
    _, state = tx.update(_random_grads(rng, params), tx.init(params), params,
                         kfac_stats=stats)
    inner, = kd.find_states(state)
    for read in (kd.running_factors, kd.second_order_parts):
      helpers.assert_trees_equal(read(state), read(inner))
  two = (inner, inner)
  for read in (kd.running_factors, kd.second_order_parts):
    for bad, count in ((two, 2), (optax.sgd(0.1).init(params), 0)):
      with pytest.raises(TypeError, match=rf"kd.{read.__name__}: .*holding {count}. "
                                          r"Pick one with kd.find_states"):
        read(bad)


def test_factor_dtype_storage():
  rng, layers, params = _setup()
  tx = kd.scale_by_kfac(layers=layers, factor_dtype=jnp.bfloat16)
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state = tx.init(params32)
  stats = jax.tree.map(lambda x: x.astype(jnp.float32), _stats(rng, layers))
  grads = jax.tree.map(lambda p: p.astype(jnp.float32), _random_grads(rng, params))
  _, state = tx.update(grads, state, kfac_stats=stats)
  assert state.factors.dtype == jnp.bfloat16
  assert state.second_order.dtype == jnp.float32


def test_cpu_decompositions_are_unbatched():
  """jaxlib's batched CPU eigh/cholesky can deadlock a 2-thread XLA pool: on CPU
  every LAPACK call must see one matrix (num_batch_dims = 0)."""
  if jax.default_backend() != "cpu":
    pytest.skip("LAPACK custom calls exist on the CPU backend only")
  from kfac_jax_dist.kfac import linalg
  stacked = jnp.ones((3, 6, 6), jnp.float32)
  texts = [jax.jit(linalg.eigh).lower(stacked).as_text(),
           jax.jit(linalg.damped_inverse).lower(stacked, jnp.ones(3)).as_text()]
  calls = [line for text in texts for line in text.splitlines()
           if "lapack_" in line and "custom_call" in line]
  assert len(calls) >= 2
  assert all('num_batch_dims = "0"' in line for line in calls), calls


def test_cpu_decomposition_inputs_unpacked_slot_by_slot():
  """Packed factors decomposed one LAPACK call per slot (CPU, batches of up to
  `UNROLLED_MAX_SLOTS`) are unpacked slot by slot: each call's input copy is
  a fusion holding the slot's own gather, with no gather of the whole batch
  before it (one kernel more per batch)."""
  if jax.default_backend() != "cpu":
    pytest.skip("LAPACK custom calls exist on the CPU backend only")
  rng, layers, params = _setup(dims=((4, 3, True), (4, 3, True)))     # batches of 2 slots
  tx = kd.scale_by_kfac(layers=layers)
  text = jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st)).lower(
      _random_grads(rng, params), tx.init(params), _stats(rng, layers)).compile().as_text()
  lines = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = ([^\n]*)", text, re.M))
  bodies = dict(re.findall(r"^%?([\w.-]+) [^\n]*\{\n(.*?)^\}", text, re.M | re.S))
  inputs = [re.search(r"custom-call\(%?([\w.-]+)", line).group(1)
            for line in lines.values() if "syevd" in line and "custom-call(" in line]
  assert len(inputs) == 4, inputs
  for name in inputs:
    called = re.search(r"calls=%?([\w.-]+)", lines[name])
    assert called and " gather(" in bodies[called.group(1)], (name, lines[name])


@pytest.mark.parametrize("d, one_at_a_time", [(129, False), (257, True)])
def test_cuda_eigh_of_large_factors_one_matrix_per_call(d, one_at_a_time):
  """The CUDA lowering: jaxlib's batched cuSOLVER eigh is slow above
  `GPU_BATCHED_EIGH_MAX_DIM` (measured on an H100), so such a batch is one
  single-matrix syevd per loop iteration; smaller factors stay one batched call."""
  from kfac_jax_dist.core import linalg  # pylint: disable=import-outside-toplevel
  stacked = jnp.ones((3, d, d), jnp.float32)
  text = jax.jit(linalg.eigh).trace(stacked).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "cusolver_syevd" in line]
  assert len(calls) == 1
  assert ("stablehlo.while" in text) == one_at_a_time
  assert ('num_batch_dims = "0"' in calls[0]) == one_at_a_time


@pytest.mark.parametrize("d", [1, 2, 3, 7, 400, 724, 725, 1023, 1024, 1601])
def test_packed_triangles_match_numpy(d):
  """Packed factors: the positions computed in the program and the constant
  ones (packing up to 1023 wide, unpacking up to 724: both sides of each
  `CONSTANT_INDICES` boundary are among the cases) are numpy's triangle, and
  unpacking inverts packing, traced and on the host."""
  from kfac_jax_dist.capture import triangles  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import packing  # pylint: disable=import-outside-toplevel
  assert triangles.packed_size(1023) <= triangles.CONSTANT_INDICES < triangles.packed_size(1024)
  assert 724 ** 2 <= triangles.CONSTANT_INDICES < 725 ** 2
  rows, cols = np.triu_indices(d)
  got = jax.jit(triangles._traced_upper_positions, static_argnums=0)(d)
  np.testing.assert_array_equal(got, rows * d + cols)
  x = np.random.default_rng(d).normal(size=(2, d, d)).astype(np.float32)
  x = x + np.swapaxes(x, 1, 2)
  packed = jax.jit(triangles.pack_upper)(x)
  np.testing.assert_array_equal(packed, x[:, rows, cols])
  np.testing.assert_array_equal(triangles.pack_upper(x), packed)
  np.testing.assert_array_equal(jax.jit(lambda v: triangles.unpack_upper(v, d))(packed), x)
  np.testing.assert_array_equal(triangles.unpack_upper(np.asarray(packed), d), x)
  place = packing.layout_lib.FactorPlace("full", d, 0, 0, d * (d + 1) // 2, None, None, 0)
  eye = np.eye(d, dtype=np.float32)[rows, cols]
  np.testing.assert_array_equal(packing.stored_identity(place, np.float32, True, np), eye)
  np.testing.assert_array_equal(packing.stored_identity(place, jnp.float32, True), eye)
