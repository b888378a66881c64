"""Stale statistics (SP-NGD §4.3, Algorithms 1-2): interval decisions on a
hand-made sequence, unchanged state for stale factors, and every strategy."""

import dataclasses
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac import stale
from kfac_jax_dist.kfac.state import find_states

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "benchmarks"))
import stale_statistics  # noqa: E402  pylint: disable=wrong-import-position

ALPHA = 0.1


def _oracle_schedule(sequence, alpha=ALPHA):
  """Algorithms 1-2 written out for one factor fed `sequence[t]` at step t
  (factor_decay 0: the refreshed value is the statistic itself)."""
  return helpers.stale_schedule([sequence], alpha)


def _layer():
  return kd.TaggedLayer(name="l", kind="dense", kernel_path="l/kernel", bias_path=None,
                        kernel_shape=(3, 2), a_dim=3, g_dim=2)


def test_interval_decisions_on_a_hand_made_sequence():
  """A stays put (intervals grow 1, 1, 2, 3, 5, ...), then jumps (halves);
  G drifts by 5% per step (similar to the last, not to the one before)."""
  a0, g0 = np.diag([1.0, 2.0, 3.0]), np.diag([1.0, 1.0])
  steps = 40
  a_seq = [a0 if t < 20 else 3 * a0 for t in range(steps)]
  g_seq = [g0 * 1.06 ** t for t in range(steps)]
  layers = kd.LayerRegistry((_layer(),))
  params = {"l": {"kernel": jnp.ones((3, 2))}}
  tx = kd.scale_by_kfac(layers=layers, damping=0.1, factor_decay=0.0,
                        stale_threshold=ALPHA)
  state = tx.init(params)
  update = jax.jit(tx.update)
  refreshed = {"A": [], "G": []}
  for t in range(steps):
    before = state
    stats = {"l": {"A": jnp.asarray(a_seq[t], jnp.float32),
                   "G": jnp.asarray(g_seq[t], jnp.float32)}}
    _, state = update({"l": {"kernel": jnp.ones((3, 2))}}, state, kfac_stats=stats)
    for f, key in enumerate(("A", "G")):
      if int(state.refresh.refreshes[f]) > int(before.refresh.refreshes[f]):
        refreshed[key].append(t)
    assert bool(state.update_factors) == bool(jnp.any(state.refresh.next_step <= t + 1))
  assert refreshed["A"] == _oracle_schedule(a_seq)
  assert refreshed["G"] == _oracle_schedule(g_seq)
  assert refreshed["A"][:6] == [0, 1, 2, 4, 7, 12]    # intervals 1, 1, 2, 3, 5
  assert len(refreshed["A"]) < steps // 3
  np.testing.assert_allclose(kd.running_factors(state)["l"]["A"],
                             a_seq[refreshed["A"][-1]], rtol=1e-6)


def test_stale_factor_leaves_its_state_bit_identical():
  layers = kd.LayerRegistry((_layer(),))
  params = {"l": {"kernel": jnp.ones((3, 2))}}
  tx = kd.scale_by_kfac(layers=layers, damping=0.1, stale_threshold=ALPHA)
  state = tx.init(params)
  stats = {"l": {"A": jnp.eye(3) * 2.0, "G": jnp.eye(2)}}
  update = jax.jit(tx.update)
  for _ in range(5):                       # identical statistics: intervals grow
    _, state = update(params, state, kfac_stats=stats)
  assert int(state.refresh.next_step[0]) > 5    # A is not due at count 5
  due = np.asarray(state.refresh.next_step) <= 5
  new_stats = {"l": {"A": jnp.eye(3) * 5.0, "G": jnp.eye(2) * 7.0}}
  _, after = update(params, state, kfac_stats=new_stats)
  lay = state.layout
  for f, (plan, which, place) in enumerate(stale.factor_order(lay)):
    span = slice(place.offset, place.offset + place.size)
    same = np.array_equal(np.asarray(after.factors[span]), np.asarray(state.factors[span]))
    assert same != due[f], (which, due[f])
  a = lay.plans[0].a
  span = slice(a.matrix_offset, a.matrix_offset + a.dim * a.dim)
  assert np.array_equal(after.second_order[span], state.second_order[span])


def test_stale_inverses_equal_float64_brute_force(x64):
  """method="inverse" with stale statistics, against NumPy in float64: A and
  G refresh on their own schedules (Algorithms 1-2), and whenever either
  does, both are inverted again, at the π of the running factors then and at
  that step's γ (a decaying schedule); between refreshes every step is
  preconditioned with those inverses."""
  rng = np.random.default_rng(0)
  m = rng.normal(size=(3, 3))
  a0, g0 = m @ m.T + np.eye(3), np.diag([1.0, 2.0])
  steps = 30
  a_seq = [a0 if t < 12 else 3 * a0 for t in range(steps)]
  g_seq = [g0 * 1.03 ** t for t in range(steps)]
  grads = rng.normal(size=(steps, 3, 2))
  gamma = lambda count: 0.1 * 0.8 ** count
  tx = kd.scale_by_kfac(layers=kd.LayerRegistry((_layer(),)), damping=gamma,
                        factor_decay=0.0, stale_threshold=ALPHA, method="inverse",
                        factor_dtype=jnp.float64)
  state = tx.init({"l": {"kernel": jnp.ones((3, 2), jnp.float64)}})
  update = jax.jit(tx.update)
  refreshed = [helpers.stale_schedule([seq], ALPHA) for seq in (a_seq, g_seq)]
  # steps where A refreshes alone and steps where G does (12 and 10 first)
  assert set(refreshed[0]) - set(refreshed[1]) and set(refreshed[1]) - set(refreshed[0])
  inverses_made = []
  for t in range(steps):
    stats = {"l": {"A": jnp.asarray(a_seq[t]), "G": jnp.asarray(g_seq[t])}}
    updates, state = update({"l": {"kernel": jnp.asarray(grads[t])}}, state,
                            kfac_stats=stats)
    # the running factors: each one's statistic at its last refresh
    a, g = (seq[max(r for r in steps_of if r <= t)]
            for seq, steps_of in zip((a_seq, g_seq), refreshed))
    if t in refreshed[0] or t in refreshed[1]:
      inverses_made.append(t)
      made_at, made_with = t, (a, g)
    expected = helpers.inverse_update(*made_with, grads[t], gamma(made_at))
    got = np.asarray(updates["l"]["kernel"])
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0, err_msg=f"step {t}")
  assert len(inverses_made) < 0.6 * steps         # many steps reused the inverses


def _eigen_update(grad, qa, qg, scaling, gamma):
  """EK-FAC's `Q_A [(Q_Aᵀ ∇ Q_G) / (s + γ)] Q_Gᵀ` in NumPy."""
  return qa @ ((qa.T @ grad @ qg) / (scaling + gamma)) @ qg.T


def _fresh_by_layer(state) -> dict:
  """EK-FAC's freshness flag of each corrected layer, by name."""
  names = [plan.layer.name for plan, _ in correction_lib.corrected_plans(state.layout)]
  return dict(zip(names, np.asarray(state.correction.fresh).tolist()))


def _check_converted_correction(state, template) -> None:
  """`kd.convert_state` keeps each layer's EK-FAC scaling and freshness, the
  eigenbases the capture projects in (gathered from every owner when the
  template has several owner groups) and the refresh schedule."""
  moved = kd.convert_state(state, template)
  assert _fresh_by_layer(moved) == _fresh_by_layer(state)
  got = correction_lib.layer_scaling(moved.layout, moved.correction)
  for name, want in correction_lib.layer_scaling(state.layout, state.correction).items():
    np.testing.assert_array_equal(got[name], want)
    for q_moved, q in zip(moved.correction_bases(name), state.correction_bases(name)):
      np.testing.assert_array_equal(q_moved, q)
  schedule = lambda s: {(plan.layer.name, which): (int(s.refresh.next_step[k]),
                                                   int(s.refresh.interval[k]))
                        for k, (plan, which, _) in enumerate(stale.factor_order(s.layout))}
  assert schedule(moved) == schedule(state)
  for key in ("factors", "refresh.before_last"):
    read = lambda s: kd.running_factors(dataclasses.replace(
        s, factors=s.refresh.before_last if key == "refresh.before_last" else s.factors))
    jax.tree.map(np.testing.assert_array_equal, read(moved), read(state))


@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_stale_ekfac_equals_float64_brute_force(x64, decay):
  """EK-FAC with stale statistics against NumPy in float64, two layers whose
  four factors refresh on their own schedules. Each step preconditions in the
  eigenbases the state started with; a step with a refreshed factor (a factor
  step) measures its batch's `S`: a layer's scaling becomes `S` if a factor
  of it refreshed since its last measurement (its eigenbases are new), else
  `β s + (1 − β) S`; a step without uses what the step before left: a layer
  with a factor refreshed then restarts from `v_A v_Gᵀ` of its new
  eigenbases, the other keeps what it last measured. The state's freshness
  flags are the oracle's, and `convert_state` (to MEM-OPT on 8 devices) keeps
  them by layer while one layer is fresh and the other measured."""
  rng = np.random.default_rng(1)
  dims = {"l": (3, 2), "m": (2, 3)}
  layers = kd.LayerRegistry(tuple(
      kd.TaggedLayer(name=n, kind="dense", kernel_path=f"{n}/kernel", bias_path=None,
                     kernel_shape=d, a_dim=d[0], g_dim=d[1]) for n, d in dims.items()))
  steps, gamma = 40, 0.05

  def spd(d):
    m = rng.normal(size=(d, d))
    return m @ m.T + d * np.eye(d)
  base = {n: (spd(a), spd(g)) for n, (a, g) in dims.items()}
  seqs = {("l", "A"): [base["l"][0] * (1 if t < 15 else 2.5) for t in range(steps)],
          ("l", "G"): [base["l"][1] * 1.01 ** t for t in range(steps)],
          ("m", "A"): [base["m"][0] * 1.02 ** t for t in range(steps)],
          ("m", "G"): [base["m"][1] for t in range(steps)]}
  s_seq = {n: rng.uniform(0.5, 2.0, size=(steps,) + d) for n, d in dims.items()}
  grads = {n: rng.normal(size=(steps,) + d) for n, d in dims.items()}
  running = {k: helpers.stale_refreshes([seq], ALPHA, decay) for k, seq in seqs.items()}
  options = dict(damping=gamma, factor_decay=decay, stale_threshold=ALPHA,
                 eigenvalue_correction="ekfac", factor_dtype=jnp.float64)
  params = {n: {"kernel": jnp.ones(d, jnp.float64)} for n, d in dims.items()}
  state = kd.scale_by_kfac(layers=layers, **options).init(params)
  update = jax.jit(kd.scale_by_kfac(layers=layers, **options).update)
  eig = lambda x: np.linalg.eigh(x)
  bases = {n: (np.eye(a), np.eye(g)) for n, (a, g) in dims.items()}
  scaling = {n: np.ones(d) for n, d in dims.items()}   # v_A v_Gᵀ of the identities
  fresh = dict.fromkeys(dims, True)
  kinds, converted = set(), False
  for t in range(steps):
    stats = {n: {"A": jnp.asarray(seqs[n, "A"][t]), "G": jnp.asarray(seqs[n, "G"][t]),
                 "S": jnp.asarray(s_seq[n][t])} for n in dims}
    updates, state = update({n: {"kernel": jnp.asarray(grads[n][t])} for n in dims},
                            state, kfac_stats=stats)
    due = {n: [t in running[n, w] for w in "AG"] for n in dims}
    factor_step = any(any(d) for d in due.values())
    if factor_step:
      scaling = {n: s_seq[n][t] if fresh[n] else decay * scaling[n] + (1 - decay) * s_seq[n][t]
                 for n in dims}
      fresh = dict.fromkeys(dims, False)
    for n in dims:
      expected = _eigen_update(grads[n][t], *bases[n], scaling[n], gamma)
      np.testing.assert_allclose(np.asarray(updates[n]["kernel"]), expected, rtol=1e-10,
                                 atol=1e-12, err_msg=f"step {t}, layer {n}")
    kinds.add((factor_step, due["l"] != [False, False], due["m"] != [False, False]))
    for n in dims:                  # the state after the step, for the next one
      if any(due[n]):
        factors = [running[n, w][max(r for r in running[n, w] if r <= t)][0] for w in "AG"]
        (va, qa), (vg, qg) = eig(factors[0]), eig(factors[1])
        bases[n], scaling[n], fresh[n] = (qa, qg), np.outer(va, vg), True
    assert _fresh_by_layer(state) == fresh, t
    if len(set(fresh.values())) == 2 and not converted:    # one fresh layer, one measured
      converted = True
      _check_converted_correction(state, kd.scale_by_kfac(
          layers=layers,
          distribution=kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8),
          **options).init(params))
  # steps that refreshed l alone, m alone, both, and steps with no factor step
  assert {(True, True, False), (True, False, True), (False, False, False)} <= kinds, kinds
  assert converted


@pytest.mark.parametrize("method", ["eigen", pytest.param("inverse", marks=pytest.mark.slow)])
def test_threshold_zero_is_plain_kfac(method):
  """α = 0: nothing is ever similar, every factor refreshes every step."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)

  def run(**options):
    tx = kd.kfac(0.1, layers=layers, damping=1e-2, kl_clip=1e-2, method=method,
                 **options)
    state, p = tx.init(params), params
    step = jax.jit(lambda p, s: _one_step(grad_fn, tx, p, s, x, y))
    for _ in range(4):
      p, state = step(p, state)
    return p, state
  plain, _ = run()
  stale, state = run(stale_threshold=0.0)
  assert np.all(np.asarray(find_states(state)[0].refresh.refreshes) == 4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               stale, plain)


@functools.lru_cache(maxsize=None)
def _stale_single_device(method, steps=6):
  loss_fn, params, x, y = helpers.conv_dense_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), damping=1e-2, kl_clip=1e-2,
               stale_threshold=0.3, method=method)
  state, p = tx.init(params), params
  step = jax.jit(lambda p, s: _one_step(grad_fn, tx, p, s, x, y))
  for _ in range(steps):
    p, state = step(p, state)
  return p, np.asarray(find_states(state)[0].refresh.refreshes)


def _stale_strategies():
  """Every owner-group shape and both factor reductions, not their product
  (test_distributed.py has the product without stale statistics), for each
  method (the inverses' π couples a layer's factors across owners), and
  SP-NGD's own configuration (π-damped inverses, raw gradients reduce-scattered
  to their owners)."""
  for method in ("eigen", "inverse"):
    for fraction, name, reduction in ((1.0, "COMM", "all_reduce"),
                                      (0.5, "HYBRID", "reduce_scatter"),
                                      (0.125, "MEM", "reduce_scatter")):
      # by default the hard case alone: the inverses' π across MEM-OPT's owners
      # (the eigen method's stale statistics under MEM-OPT: test_scan.py)
      marks = () if (name, method) == ("MEM", "inverse") else pytest.mark.slow
      yield pytest.param(fraction, reduction, method, "none",
                         id=f"{name}-{reduction}-{method}", marks=marks)
  yield pytest.param(0.125, "reduce_scatter", "inverse", "reduce_scatter",
                     id="SP-NGD-fused-inverse", marks=pytest.mark.slow)


@pytest.mark.parametrize("fraction,factor_reduction,method,gradient_reduction",
                         list(_stale_strategies()))
def test_stale_statistics_under_every_strategy(fraction, factor_reduction, method,
                                               gradient_reduction):
  loss_fn, params, x, y = helpers.conv_dense_problem()
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction,
                         gradient_reduction=gradient_reduction)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), damping=1e-2, kl_clip=1e-2,
               stale_threshold=0.3, method=method, distribution=dist)
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(p, state, x, y):
    _, grads, stats = grad_fn(p, x, y, opt_state=state)
    if gradient_reduction == "none":       # the caller averages; else raw local ones
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, p, kfac_stats=stats)
    return optax.apply_updates(p, updates), state
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs)))
  p = params
  for _ in range(6):
    p, state = step(p, state, x, y)
  ref, ref_refreshes = _stale_single_device(method)
  refreshes = np.asarray(find_states(state)[0].refresh.refreshes)
  np.testing.assert_array_equal(refreshes, ref_refreshes)
  assert refreshes.min() < 6                 # something was actually skipped
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), p, ref)


def test_convert_state_moves_the_refresh_schedule():
  """Three steps on 8 devices under MEM-OPT, `kd.convert_state` to one
  device, three more: the uninterrupted single-device run's parameters and
  refresh counts (the schedule and `X₋₂` moved factor by factor)."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  mesh = helpers.data_mesh(8)
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  make = lambda dist=None: kd.kfac(0.1, layers=layers, damping=1e-2, kl_clip=1e-2,
                                   stale_threshold=0.3, distribution=dist)
  tx8, tx1 = make(kd.Distribution(mesh, grad_worker_fraction=1 / 8)), make()

  def step(tx, p, state, x, y, axis=None):
    _, grads, stats = grad_fn(p, x, y, opt_state=state)
    grads = grads if axis is None else jax.lax.pmean(grads, axis)
    updates, state = tx.update(grads, state, p, kfac_stats=stats)
    return optax.apply_updates(p, updates), state
  state = kd.shard_state(tx8.init(params), mesh)
  specs = kd.partition_specs(state)
  step8 = jax.jit(jax.shard_map(functools.partial(step, tx8, axis="data"), mesh=mesh,
                                in_specs=(P(), specs, P("data"), P("data")),
                                out_specs=(P(), specs)))
  step1 = jax.jit(functools.partial(step, tx1))
  p = params
  for _ in range(3):
    p, state = step8(p, state, x, y)
  p, state = jax.device_get(p), kd.convert_state(state, tx1.init(params))
  for _ in range(3):
    p, state = step1(p, state, x, y)
  ref, ref_refreshes = _stale_single_device("eigen")
  np.testing.assert_array_equal(find_states(state)[0].refresh.refreshes, ref_refreshes)
  assert ref_refreshes.min() < 6
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), p, ref)


def test_describe_counts_the_stale_state():
  """`kd.describe` names stale statistics' `X₋₂` and counts its
  bytes (sharded as the running factors) and the schedule's in the state's."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8)
  plain, stale_state = (kd.scale_by_kfac(layers, distribution=dist, **options).init(params)
                        for options in ({}, {"stale_threshold": 0.1}))
  per_device = lambda s: int(re.search(r"K-FAC state: ([\d,]+) bytes per device",
                                       kd.describe(s, print_table=False)
                                       ).group(1).replace(",", ""))
  shard, factors = stale_state.layout.factor_shard, len(stale.factor_order(stale_state.layout))
  text = kd.describe(stale_state, print_table=False)
  assert f"(X₋₂; X₋₁ is the running factor), {shard:,} numbers per device" in text
  assert f"refresh schedule ({factors} factors, replicated)" in text
  # the stale layout stores each owner's factors padded (not tight chunks)
  assert per_device(stale_state) - (per_device(plain) + 4 * (
      stale_state.layout.factor_shard - plain.layout.factor_shard)) == 4 * (
          shard + 5 * factors + 1)


def test_describe_reports_the_mean_refresh_interval():
  """After some stale steps `kd.describe` gives each factor's mean interval
  between refreshes, count · F / Σ refreshes, and the steps that refreshed any
  factor (counted here from the schedule before each step: some `next_step` ≤
  count): what `Distribution.auto` takes as its two cadences with stale
  statistics. An abstract state (no values) and a fresh one (no refresh yet)
  leave them out."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), damping=1e-2,
               stale_threshold=0.3)
  state, p = tx.init(params), params
  line = lambda s: kd.describe(s, print_table=False)
  assert "refreshes: a factor every" not in line(state)
  assert "refreshes: a factor every" not in line(jax.eval_shape(tx.init, params))
  step = jax.jit(lambda p, s: _one_step(grad_fn, tx, p, s, x, y))
  some = 0
  for _ in range(6):
    k = find_states(state)[0]
    some += bool(np.any(np.asarray(k.refresh.next_step) <= int(k.count)))
    p, state = step(p, state)
  refreshes = np.asarray(find_states(state)[0].refresh.refreshes)
  assert 0 < refreshes.sum() < 6 * refreshes.size        # some factors went stale
  assert 1 < some < 6                                     # and some steps refreshed none
  want = 6 * refreshes.size / refreshes.sum()
  assert (f"After 6 steps, {refreshes.sum():,} refreshes: a factor every {want:.3g} steps "
          f"on average, some factor on {some} steps (every {6 / some:.3g})") in line(state)


def _one_step(grad_fn, tx, p, state, x, y):
  """One K-FAC step on one device: capture, update, apply."""
  _, grads, stats = grad_fn(p, x, y, opt_state=state)
  updates, state = tx.update(grads, state, p, kfac_stats=stats)
  return optax.apply_updates(p, updates), state


def test_due_factors_are_all_reduced_inside_their_loops():
  """In the compiled 8-device program each factor's all-reduce stays in the
  body of its layer's loop over due blocks, so a stale factor sends nothing:
  written straight into the loop's carry, XLA moved it out of the loop
  (`WhileLoopAllReduceCodeMotion`) and all-reduced every factor at every factor
  step. The only all-reduce of the factor update outside a loop is the
  refresh decisions' (an int32 pair per factor)."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  mesh = helpers.data_mesh(8)
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = kd.kfac(0.1, layers=layers, stale_threshold=0.3,
               distribution=kd.Distribution(mesh, grad_worker_fraction=0.125))
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(p, state, x, y):
    _, grads, stats = grad_fn(p, x, y, opt_state=state)
    return tx.update(jax.lax.pmean(grads, "data"), state, p, kfac_stats=stats)
  hlo = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                              out_specs=(P(), specs))).lower(params, state, x, y).compile()
  found = stale_statistics.factor_collectives(hlo.as_text())
  lay = find_states(state)[0].layout
  sizes = sorted(4 * place.size for _, _, place in stale.factor_order(lay))
  assert sorted(b for loop in found["factor_scope_loops"] for b in loop["body"]) == sizes
  assert all(len(loop["body"]) == 1 for loop in found["factor_scope_loops"])
  assert [o["bytes"] for o in found["factor_scope_all_reduces_outside"]] == [
      4 * 2 * len(sizes)]


def test_benchmark_counts_a_layers_inverses_at_either_factors_refresh():
  """stale_statistics.py's decomposition counts: with eigendecompositions a
  factor's refreshes; with π-damped inverses every step at which either factor
  of its layer refreshed (the cumulative refreshes after each step in)."""
  table = [dict(layer="l", factor="a"), dict(layer="l", factor="g"),
           dict(layer="m", factor="f")]
  history = [[1, 1, 1], [2, 1, 1], [2, 2, 1], [2, 2, 2]]   # a at 0, 1; g at 0, 2; f at 0, 3
  assert stale_statistics.decompositions(table, history, "eigen").tolist() == [2, 2, 2]
  assert stale_statistics.decompositions(table, history, "inverse").tolist() == [3, 3, 2]


def test_stale_misconfiguration_errors():
  layers = kd.LayerRegistry((_layer(),))
  with pytest.raises(ValueError, match="factor_update_every"):
    kd.scale_by_kfac(layers=layers, stale_threshold=0.1, factor_update_every=2)


@pytest.mark.parametrize("packed", [False, True], ids=["square", "packed"])
def test_relative_change_of_one_factor_is_a_number(packed):
  """`stale.relative_changes` of one factor's stored numbers (`[size]`, as
  benchmarks/stale_statistics reads them) is a number, `‖X − Y‖_F / ‖Y‖_F` of
  the symmetric matrices; of `[n, size]` rows, one per row."""
  from kfac_jax_dist.capture import statistics, triangles
  rng = np.random.default_rng(0)
  mats = [m + m.T for m in rng.normal(size=(3, 4, 4))]
  stored = lambda m: (triangles.pack_upper(jnp.asarray(m, jnp.float32)) if packed
                      else jnp.asarray(m, jnp.float32).reshape(-1))
  one = stale.relative_changes(stored(mats[0]), stored(mats[1]), statistics.FULL, 4, packed)
  assert one.shape == ()
  np.testing.assert_allclose(one, np.linalg.norm(mats[0] - mats[1]) / np.linalg.norm(mats[1]),
                             rtol=1e-5)
  rows = stale.relative_changes(jnp.stack([stored(mats[0]), stored(mats[2])]),
                                jnp.stack([stored(mats[1]), stored(mats[1])]),
                                statistics.FULL, 4, packed)
  np.testing.assert_allclose(rows, [np.linalg.norm(m - mats[1]) / np.linalg.norm(mats[1])
                                    for m in (mats[0], mats[2])], rtol=1e-5)
