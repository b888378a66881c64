"""Shampoo against a float64 brute-force numpy Shampoo, and its inverse roots
against scipy's fractional matrix powers."""

import dataclasses
import inspect
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.shampoo import roots
from kfac_jax_dist.core import uneven

# `kd.shampoo` is the alias function; the module it lives in:
from kfac_jax_dist.shampoo import blocks as shampoo_blocks
from kfac_jax_dist.shampoo import state as shampoo_state


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


# ------------------------------------------------------------------ the oracle

def _merge(shape, threshold):
  dims = [d for d in shape if d > 1]
  if not threshold:
    return dims
  merged = []
  for d in dims:
    if merged and merged[-1] * d <= threshold:
      merged[-1] *= d
    else:
      merged.append(d)
  return merged


def _oracle_root(h, p, ridge):
  w, v = np.linalg.eigh(h)
  w = np.maximum(w, 0.0)
  w = w + ridge * max(w.max(), 1e-16)
  return (v * w ** (-1.0 / p)) @ v.T


class NumpyShampoo:
  """Shampoo (Gupta et al. Alg. 2 with Anil et al.'s blocking, grafting and
  cadence), one block at a time, in float64."""

  def __init__(self, shapes, *, block_size=None, merge=False, beta2=1.0, epsilon=1e-6,
               graft_type="sgd", grafting="block", graft_beta2=None, graft_epsilon=1e-10,
               start=0, stat_every=1, precond_every=1, ridge=1e-6, exponent=None,
               max_dim=None):
    self.o = dict(beta2=beta2, graft_type=graft_type, grafting=grafting,
                  graft_beta2=beta2 if graft_beta2 is None else graft_beta2,
                  graft_epsilon=graft_epsilon, start=start, stat_every=stat_every,
                  precond_every=precond_every, ridge=ridge)
    self.count = 0
    self.params = {}
    for name, shape in shapes.items():
      merged = _merge(shape, block_size if merge is True else merge)
      entry = {"shape": shape, "graft": np.zeros(shape)}
      if len(shape) >= 2 and merged and not (max_dim and max(merged) > max_dim):
        bs = block_size or max(merged)
        ranges = [[(s, min(s + bs, n)) for s in range(0, n, bs)] for n in merged]
        entry["merged"] = merged
        entry["p"] = exponent or 2 * len(merged)
        entry["blocks"] = [
            {"idx": tuple(slice(a, b) for a, b in box),
             "H": [epsilon * np.eye(b - a) for a, b in box],
             "R": [np.eye(b - a) for a, b in box]}
            for box in itertools.product(*ranges)]
      self.params[name] = entry

  def _graft(self, entry, g):
    o, t = self.o, self.count + 1
    if o["graft_type"] in ("sgd", "none"):
      return g
    if o["graft_type"] == "adagrad":
      entry["graft"] = entry["graft"] + g * g
      v = entry["graft"]
    else:
      entry["graft"] = o["graft_beta2"] * entry["graft"] + (1 - o["graft_beta2"]) * g * g
      v = entry["graft"]
      if o["graft_type"] == "adam":
        v = v / (1 - o["graft_beta2"] ** t)
    return g / (np.sqrt(v) + o["graft_epsilon"])

  def step(self, grads):
    o, c = self.o, self.count
    out = {}
    for name, entry in self.params.items():
      g = np.asarray(grads[name], np.float64)
      d = self._graft(entry, g)
      if "merged" not in entry:
        out[name] = d
        continue
      gm, dm = g.reshape(entry["merged"]), d.reshape(entry["merged"])
      k = gm.ndim
      for blk in entry["blocks"]:
        gb = gm[blk["idx"]]
        if c % o["stat_every"] == 0:
          for i in range(k):
            others = [a for a in range(k) if a != i]
            ggt = np.tensordot(gb, gb, axes=(others, others))
            w = 1.0 if o["beta2"] == 1.0 else 1.0 - o["beta2"]
            blk["H"][i] = o["beta2"] * blk["H"][i] + w * ggt
        if c >= o["start"] and (c % o["precond_every"] == 0 or c == o["start"]):
          blk["R"] = [_oracle_root(h, entry["p"], o["ridge"]) for h in blk["H"]]
      if c < o["start"]:
        out[name] = d
        continue
      pm = np.zeros_like(gm)
      for blk in entry["blocks"]:
        x = gm[blk["idx"]]
        for i in range(k):         # mode-i product with the (symmetric) root
          x = np.moveaxis(np.tensordot(blk["R"][i], x, axes=([1], [i])), 0, i)
        if o["graft_type"] != "none" and o["grafting"] == "block":
          x = x * np.linalg.norm(dm[blk["idx"]]) / np.linalg.norm(x)
        pm[blk["idx"]] = x
      if o["graft_type"] != "none" and o["grafting"] == "layer":
        pm = pm * np.linalg.norm(dm) / np.linalg.norm(pm)
      out[name] = pm.reshape(entry["shape"])
    self.count += 1
    return out


SHAPES = {"w2": (6, 10), "w3": (3, 4, 5), "wm": (2, 2, 3), "b": (10,)}


def _grads(rng, shapes, dtype=np.float64):
  return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}


def _params(shapes, dtype=np.float64):
  return {k: jnp.zeros(s, dtype) for k, s in shapes.items()}


def _run(tx, oracle, shapes, steps, seed=0, rtol=1e-8, atol=1e-10, jit=True):
  rng = np.random.default_rng(seed)
  state = tx.init(_params(shapes))
  update = jax.jit(tx.update) if jit else tx.update
  for step in range(steps):
    grads = _grads(rng, shapes)
    got, state = update(grads, state)
    want = oracle.step(grads)
    for name in shapes:
      np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=rtol, atol=atol,
                                 err_msg=f"step {step}, parameter {name}")
  return state


# ----------------------------------------------------------------------- tests

def test_merge_small_dims_and_blocks():
  merge = shampoo_blocks.merge_small_dims
  assert merge((3, 3, 32, 64), 128) == (9, 32, 64)
  assert merge((1, 2, 768, 1, 2048), 1024) == (2, 768, 2048)
  assert merge((2, 2, 3), 4) == (4, 3)
  assert merge((4, 1, 5), None) == (4, 5)
  lay = shampoo_blocks.build_layout(
      [("w", (6, 10)), ("b", (10,)), ("c", (1, 7)), ("big", (2, 50))],
      block_size=4, merge_threshold=None, max_preconditioner_dim=20,
      exponent_override=None)
  w, b, c, big = lay.params
  assert not b.preconditioned and not big.preconditioned
  # 6 = 4 + 2, 10 = 2·4 + 2: regions (1×2 of 4×4), (1×1 of 4×2), (1×2 of 2×4), (2×2).
  assert [(r.grid, r.block) for r in w.regions] == [
      ((1, 2), (4, 4)), ((1, 1), (4, 2)), ((1, 2), (2, 4)), ((1, 1), (2, 2))]
  assert c.merged == (7,) and c.exponent == 2                    # order 1: p = 2
  assert dict(zip(lay.buckets, lay.sizes)) == {(4, 4): 7, (2, 4): 5, (4, 2): 1,
                                               (3, 2): 1}


def test_zero_graft_epsilon_is_refused():
  """`ε_graft = 0` would divide a zero gradient coordinate 0 by 0 in the
  diagonal grafted methods, skipping every step: refused by name."""
  with pytest.raises(ValueError, match="graft_epsilon"):
    kd.scale_by_shampoo(graft_type="adagrad", graft_epsilon=0.0)


@pytest.mark.parametrize("make", [kd.scale_by_shampoo, kd.scale_by_soap])
def test_empty_parameters_take_the_diagonal_update(make):
  """A parameter with a zero-size axis (an empty embedding table, say) has
  nothing to precondition: it is laid out diagonal, and its update is empty."""
  params = {"e": jnp.zeros((0, 5)), "f": jnp.zeros((3, 0, 4)), "w": jnp.ones((3, 4))}
  tx = make()
  state = tx.init(params)
  assert [plan.preconditioned for plan in state.layout.params] == [False, False, True]
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state)
  assert updates["e"].shape == (0, 5) and updates["f"].shape == (3, 0, 4)
  assert np.isfinite(np.asarray(updates["w"])).all()


@pytest.mark.parametrize("p", [1, 4, 6])
@pytest.mark.parametrize("method", ["eigh", "newton"])
def test_inverse_roots_match_scipy(method, p, x64):
  rng = np.random.default_rng(p)
  mats = []
  for scale in (1.0, 1e-3, 50.0):
    g = rng.normal(size=(7, 4)) * scale
    mats.append(g @ g.T + 1e-2 * scale ** 2 * np.eye(7))
  mats = np.stack(mats)
  ridge = 1e-3
  got, err = jax.jit(lambda h: roots.inverse_pth_root(
      h, p, method=method, ridge_epsilon=ridge, tolerance=1e-13))(jnp.asarray(mats))
  for h, r in zip(mats, np.asarray(got)):
    lam = np.linalg.eigvalsh(h).max()
    want = np.real(scipy.linalg.fractional_matrix_power(h + ridge * lam * np.eye(7),
                                                        -1.0 / p))
    # Newton's ridge uses a power-iteration λ_max (relative tolerance 1e-6).
    np.testing.assert_allclose(r, want, rtol=1e-6 if method == "newton" else 1e-9,
                               atol=1e-6 * np.abs(want).max())
  assert np.all(np.asarray(err) < 1e-10)
  # float32: both methods agree with the float64 answer to float32 accuracy.
  got32, _ = jax.jit(lambda h: roots.inverse_pth_root(
      h, p, method=method, ridge_epsilon=ridge))(jnp.asarray(mats, jnp.float32))
  assert got32.dtype == jnp.float32
  for h, r in zip(mats, np.asarray(got32)):
    lam = np.linalg.eigvalsh(h).max()
    want = _oracle_root(h, p, ridge)
    np.testing.assert_allclose(r, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_newton_float32_ill_conditioned_is_finite_and_flagged():
  # float32, no ridge. Condition 1e6: still accurate. Condition 1e9: rounding
  # takes over; the divergence guard stops on a finite iterate whose reported
  # error is above the default failure threshold, so Shampoo would reject it.
  rng = np.random.default_rng(0)
  q, _ = np.linalg.qr(rng.normal(size=(16, 16)))
  for low, ok in ((-6, True), (-9, False)):
    values = np.logspace(low, 0, 16)
    x, err = roots.newton_inverse_pth_root(jnp.asarray((q * values) @ q.T, jnp.float32),
                                           4, ridge_epsilon=0.0, tolerance=0.0)
    assert np.all(np.isfinite(np.asarray(x))) and np.isfinite(float(err))
    want = (q * values ** -0.25) @ q.T
    if ok:
      assert float(err) < 1e-5
      # (2e-3: an H100's float32 reductions round differently from a CPU's;
      # it measured 1.07e-3 on one entry.)
      np.testing.assert_allclose(x, want, atol=2e-3 * np.abs(want).max())
    else:
      assert float(err) > 0.1


CONFIGS = {
    # name: (scale_by_shampoo options, oracle options, shapes)
    "unblocked_sgd_layer": (
        dict(block_size=None, merge_small_dims=False, graft_type="sgd", grafting="layer"),
        dict(graft_type="sgd", grafting="layer"), SHAPES),
    "blocked_sgd": (
        dict(block_size=4, graft_type="sgd"),
        dict(block_size=4, merge=True, graft_type="sgd"), SHAPES),
    "blocked_adagrad_beta2": (
        dict(block_size=4, beta2=0.9, graft_type="adagrad"),
        dict(block_size=4, merge=True, beta2=0.9, graft_type="adagrad"), SHAPES),
    "blocked_rmsprop_layer": (
        dict(block_size=4, beta2=0.9, graft_type="rmsprop", grafting="layer",
             graft_epsilon=1e-8),
        dict(block_size=4, merge=True, beta2=0.9, graft_type="rmsprop", grafting="layer",
             graft_epsilon=1e-8), SHAPES),
    "blocked_adam": (
        dict(block_size=3, beta2=0.95, graft_type="adam", graft_beta2=0.99),
        dict(block_size=3, merge=True, beta2=0.95, graft_type="adam", graft_beta2=0.99),
        SHAPES),
    "pure_alg2_no_graft": (
        dict(block_size=None, merge_small_dims=False, graft_type="none", epsilon=1e-3),
        dict(graft_type="none", epsilon=1e-3), SHAPES),
    "skips_and_override": (
        dict(block_size=4, merge_small_dims=False, exponent_override=2,
             max_preconditioner_dim=10, skip=("w3",)),
        dict(block_size=4, exponent=2, max_dim=10),
        {"w2": (6, 10), "w3": (3, 4, 5), "wide": (3, 12), "b": (10,)}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_numpy_shampoo(name, x64):
  options, oracle_options, shapes = CONFIGS[name]
  tx = kd.scale_by_shampoo(start_preconditioning_step=0, **options)
  if name == "skips_and_override":      # the oracle has no name filter
    shapes_oracle = dict(shapes)
    oracle = NumpyShampoo(shapes_oracle, **oracle_options)
    del oracle.params["w3"]["merged"]
    oracle.params["w3"].pop("blocks")
  else:
    oracle = NumpyShampoo(shapes, **oracle_options)
  state = _run(tx, oracle, shapes, steps=3)
  assert sum(p.preconditioned for p in state.layout.params) == (
      1 if name == "skips_and_override" else 3)


def test_newton_roots_match_oracle(x64):
  tx = kd.scale_by_shampoo(block_size=4, root_method="newton", newton_tolerance=1e-12,
                           start_preconditioning_step=0)
  oracle = NumpyShampoo(SHAPES, block_size=4, merge=True)
  _run(tx, oracle, SHAPES, steps=2, rtol=1e-5, atol=1e-7)


def test_cadence_step_by_step(x64):
  options = dict(start=3, stat_every=2, precond_every=3)
  tx = kd.scale_by_shampoo(block_size=4, graft_type="adagrad",
                           start_preconditioning_step=3, statistics_compute_steps=2,
                           preconditioning_compute_steps=3)
  oracle = NumpyShampoo(SHAPES, block_size=4, merge=True, graft_type="adagrad", **options)
  rng = np.random.default_rng(1)
  state = tx.init(_params(SHAPES))
  update = jax.jit(tx.update)
  for step in range(8):
    grads = _grads(rng, SHAPES)
    got, new_state = update(grads, state)
    want = oracle.step(grads)
    for name in SHAPES:
      np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-8, atol=1e-10,
                                 err_msg=f"step {step}, {name}")
    stats_changed = any(not np.array_equal(a, b) for a, b in
                        zip(state.statistics, new_state.statistics))
    roots_changed = any(not np.array_equal(a, b) for a, b in
                        zip(state.roots, new_state.roots))
    assert stats_changed == (step % 2 == 0), step
    assert roots_changed == (step == 3 or step == 6), step
    assert int(new_state.count) == step + 1
    state = new_state


SMALL = {"w": (6, 5), "b": (5,)}


def test_before_start_is_the_grafted_update():
  tx = kd.scale_by_shampoo(block_size=4, graft_type="adagrad",
                           start_preconditioning_step=2)
  rng = np.random.default_rng(2)
  state = tx.init(_params(SMALL, np.float32))
  grads = _grads(rng, SMALL, np.float32)
  got, _ = jax.jit(tx.update)(grads, state)
  for name, g in grads.items():
    g = np.asarray(g, np.float64)
    np.testing.assert_allclose(got[name], g / (np.abs(g) + 1e-10), rtol=1e-5)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _faulty(grads, name="w2", value=np.inf):
  bad = dict(grads)
  bad[name] = bad[name].at[0, 0].set(value)
  return bad


def test_non_finite_gradient_skips_the_step():
  """As K-FAC (core.faults): a non-finite gradient skips the whole step: zero
  updates, every state leaf unchanged but `skipped`, and `count` not advanced,
  so the run after it equals, bit for bit, the run without the faulty batch."""
  tx = kd.scale_by_shampoo(block_size=4, graft_type="adagrad", start_preconditioning_step=0,
                           preconditioning_compute_steps=2)
  rng = np.random.default_rng(3)
  grads = [_grads(rng, SHAPES, np.float32) for _ in range(3)]
  update = jax.jit(tx.update)

  def run(sequence):
    state, updates = tx.init(_params(SHAPES, np.float32)), []
    for g in sequence:
      u, state = update(g, state)
      updates.append(u)
    return updates, state

  clean, clean_state = run([grads[0], grads[2]])
  for value in (np.inf, np.nan):
    faulty, faulty_state = run([grads[0], _faulty(grads[1], value=value), grads[2]])
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(faulty[1]))
    assert _bits(faulty[2]) == _bits(clean[1])
    assert int(faulty_state.skipped) == 1 and int(clean_state.skipped) == 0
    assert _bits(dataclasses.replace(faulty_state, skipped=clean_state.skipped)) == _bits(
        clean_state)


def test_shampoo_chain_skips_momentum_too():
  """`kd.shampoo` wraps its chain in `skip_faulty_steps`: the momentum neither
  decays nor moves the parameters on a skipped step."""
  tx = kd.shampoo(0.1, block_size=4, start_preconditioning_step=0)
  rng = np.random.default_rng(4)
  params = _params(SHAPES, np.float32)
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(_grads(rng, SHAPES, np.float32), state, params)
  updates, new_state = update(_faulty(_grads(rng, SHAPES, np.float32)), state, params)
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(updates))
  skipped = [s.skipped for s in jax.tree.leaves(
      new_state, is_leaf=lambda x: isinstance(x, kd.ScaleByShampooState))
             if isinstance(s, kd.ScaleByShampooState)]
  assert [int(x) for x in skipped] == [1]
  old, new = jax.tree.leaves(state), jax.tree.leaves(new_state)
  assert sum(not np.array_equal(a, b) for a, b in zip(old, new)) == 1   # `skipped` only


def test_intervals_take_schedules(x64):
  """The three cadence settings may be schedules of the count: the roots of a
  schedule that is 2 before count 4 and 3 from then on refresh at 0, 2, 6."""
  every = lambda count: jnp.where(count < 4, 2, 3)
  tx = kd.scale_by_shampoo(block_size=4, start_preconditioning_step=lambda c: 0,
                           statistics_compute_steps=lambda c: 1,
                           preconditioning_compute_steps=every)
  rng = np.random.default_rng(5)
  state = tx.init(_params(SHAPES))
  update = jax.jit(tx.update)
  refreshed = []
  for step in range(8):
    _, new_state = update(_grads(rng, SHAPES), state)
    if any(not np.array_equal(a, b) for a, b in zip(state.roots, new_state.roots)):
      refreshed.append(step)
    state = new_state
  assert refreshed == [0, 2, 6]


def test_failing_root_keeps_previous_root():
  rng = np.random.default_rng(4)
  good = kd.scale_by_shampoo(block_size=4, start_preconditioning_step=0)
  # One Newton step cannot reach an error of 0.1: every new root is rejected.
  failing = kd.scale_by_shampoo(block_size=4, root_method="newton",
                                newton_max_iterations=1, start_preconditioning_step=0)
  state = good.init(_params(SMALL, np.float32))
  fail_update = jax.jit(failing.update)
  _, first = fail_update(_grads(rng, SMALL, np.float32), state)
  for r in shampoo_state.bucket_arrays(first)[1]:    # still the initial identity
    np.testing.assert_array_equal(r, np.broadcast_to(np.eye(r.shape[-1]), r.shape))
  _, state = jax.jit(good.update)(_grads(rng, SMALL, np.float32), state)
  grads = _grads(rng, SMALL, np.float32)
  _, failed = fail_update(grads, state)
  for old, new in zip(state.roots, failed.roots):
    np.testing.assert_array_equal(new, old)
  for old, new in zip(state.statistics, failed.statistics):
    assert not np.array_equal(new, old)


def test_jit_equals_eager():
  tx = kd.scale_by_shampoo(block_size=4, beta2=0.9, graft_type="rmsprop",
                           statistics_compute_steps=2, start_preconditioning_step=1)
  rng = np.random.default_rng(5)
  grads = [_grads(rng, SMALL, np.float32) for _ in range(2)]
  s_eager = s_jit = tx.init(_params(SMALL, np.float32))
  update = jax.jit(tx.update)
  for g in grads:
    u_eager, s_eager = tx.update(g, s_eager)
    u_jit, s_jit = update(g, s_jit)
    for a, b in zip(jax.tree_util.tree_leaves((u_eager, s_eager)),
                    jax.tree_util.tree_leaves((u_jit, s_jit))):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [kd.shampoo, kd.soap], ids=["shampoo", "soap"])
def test_a_state_of_another_configuration_is_refused(make):
  """`update` given the state of a transform with other blocks (block size,
  skip, max_preconditioner_dim, Shampoo's exponent_override) or another graft
  type refuses it: it ran the state's blocks silently (as K-FAC refuses
  another configuration's state)."""
  params = {"fc1": {"w": jnp.ones((8, 16)), "b": jnp.zeros(16)}, "fc2": {"w": jnp.ones((16, 3))}}
  grads = jax.tree.map(jnp.ones_like, params)
  tx = make(0.1, block_size=8)
  tx.update(grads, tx.init(params), params)
  others = [dict(block_size=4), dict(skip=("fc2",)), dict(max_preconditioner_dim=8)]
  for other in others + ([dict(exponent_override=2)] if make is kd.shampoo else []):
    with pytest.raises(ValueError, match=r"the state was built by a transform of another "
                                         r"configuration: its blocks differ"):
      tx.update(grads, make(0.1, **{"block_size": 8, **other}).init(params), params)
  if make is kd.shampoo:
    with pytest.raises(ValueError, match=r"another configuration: its grafting accumulators "
                                         r"do not fit graft_type='sgd'"):
      tx.update(grads, make(0.1, block_size=8, graft_type="adagrad").init(params), params)


def test_shampoo_alias_is_the_chain_and_trains():
  rng = np.random.default_rng(6)
  x = rng.normal(size=(64, 6)).astype(np.float32)
  w_true = rng.normal(size=(6, 3)).astype(np.float32)
  y = x @ w_true

  def loss(p):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  params = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}
  opts = dict(block_size=4, graft_type="adagrad", start_preconditioning_step=1)
  alias = kd.shampoo(0.5, momentum=0.5, weight_decay=1e-4, **opts)
  chain = optax.chain(kd.scale_by_shampoo(**opts), optax.add_decayed_weights(1e-4),
                      optax.sgd(0.5, momentum=0.5))

  def train(tx, p, steps=30):
    state = tx.init(p)

    @jax.jit
    def step(p, state):
      g = jax.grad(loss)(p)
      u, state = tx.update(g, state, p)
      return optax.apply_updates(p, u), state
    for _ in range(steps):
      p, state = step(p, state)
    return p, state

  p_alias, state = train(alias, params)
  p_chain, _ = train(chain, params)
  for a, b in zip(jax.tree_util.tree_leaves(p_alias), jax.tree_util.tree_leaves(p_chain)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert isinstance(state[0], kd.ScaleByShampooState)
  assert float(loss(p_alias)) < 1e-2 * float(loss(params))
  # optax.inject_hyperparams injects every numeric option (block_size too):
  # the shape options are read at init, the rest may be arrays.
  injected = optax.inject_hyperparams(kd.shampoo)(0.5, momentum=0.5, weight_decay=1e-4,
                                                   **opts)
  p_inj, _ = train(injected, params)
  for a, b in zip(jax.tree_util.tree_leaves(p_inj), jax.tree_util.tree_leaves(p_alias)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_injected_shampoo_traces_with_its_default_shapes():
  """`optax.inject_hyperparams(kd.shampoo)` leaves the shape options' defaults
  static (numeric defaults would be injected as arrays, traced under
  `jax.eval_shape` and `jit`): the checkpoint template `jax.eval_shape(tx.init,
  params)`, a jitted init and jitted updates need no `static_args`, and equal
  the concrete ones."""
  params = {"w": jnp.ones((8, 16)), "c": jnp.ones((2, 3, 5)), "b": jnp.ones(16)}
  grads = jax.tree.map(lambda x: 0.1 * x, params)
  for make, args in ((kd.shampoo, (1e-2,)), (kd.scale_by_shampoo, ())):
    helpers.assert_injected_traces(optax.inject_hyperparams(make)(*args), params, grads,
                                   kd.ScaleByShampooState, "block_size")
  assert repr(inspect.signature(kd.shampoo).parameters["block_size"].default) == "128"


@pytest.mark.parametrize("root_method", ["eigh", pytest.param("newton", marks=pytest.mark.slow)])
def test_distributed_shampoo_equals_single_device(root_method):
  """Roots computed by their owners on 8 devices and all-gathered: the same
  steps as on one device. (Every device gets the whole batch: averaging local
  gradients would change their rounding, which the near-singular early
  statistics' roots amplify.)"""
  from jax.sharding import PartitionSpec as P
  mesh = helpers.data_mesh(8)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(10, 6)), jnp.float32),
            "c": jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(16, 10)), jnp.float32)

  def loss(p, x):
    h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.mean(h ** 2) + jnp.sum(p["c"] ** 2) * 1e-2 * jnp.mean(x)

  options = dict(block_size=4, graft_type="adagrad", root_method=root_method,
                 preconditioning_compute_steps=2, start_preconditioning_step=1)

  def run(dist):
    tx = kd.shampoo(0.05, distribution=dist, **options)
    state, p = tx.init(params), params

    def step(p, state, x):
      grads = jax.grad(loss)(p, x)
      updates, state = tx.update(grads, state, p)
      return optax.apply_updates(p, updates), state
    if dist is None:
      step = jax.jit(step)
    else:
      specs = kd.partition_specs(state)
      step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P()),
                                   out_specs=(P(), specs)))
    for _ in range(4):
      p, state = step(p, state, x)
    return p

  got = run(kd.Distribution(mesh))
  want = run(None)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


# ------------------------------------------------- MEM-OPT / HYBRID-OPT Shampoo

# Blocked (w: 10 = 4+4+2, 6 = 4+2), unblocked (u: one 3×4 block), order 3
# (c: (3, 4, 5), 5 = 4+1), diagonal (b).
SHARDED_SHAPES = {"w": (10, 6), "c": (3, 4, 5), "u": (3, 4), "b": (6,)}
# start 2, statistics every 2, roots every 3: over 7 steps the grafted steps,
# the first roots at 2, refreshes at 3 and 6, steps without statistics.
CADENCE = dict(block_size=4, start_preconditioning_step=2, statistics_compute_steps=2,
               preconditioning_compute_steps=3)


def _mesh(n=8):
  return helpers.data_mesh(n)


def _sharded_steps(tx, state, mesh, local_grads, reduction):
  """Runs `tx` inside shard_map over `mesh`; each step's local gradients are
  `[P, ...]` per leaf, averaged before `update` unless `reduction` reduces them."""
  from jax.sharding import PartitionSpec as P
  specs = kd.partition_specs(state)
  state = kd.shard_state(state, mesh)
  local = reduction == "reduce_scatter"

  def step(g, s):
    if local:
      g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, s)
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data") if local else P(), specs),
                               out_specs=(P(), specs)))
  out = []
  for g in local_grads:
    u, state = step(g if local else jax.tree.map(lambda x: x.mean(0), g), state)
    # a global state goes in and comes out with the specs of partition_specs
    assert kd.partition_specs(state) == specs
    for x, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs)):
      assert x.sharding.spec == spec
    out.append((u, state))
  return out


# a parameter of 60 blocks: each group's blocks of it are many, dealt round-robin
MANY_BLOCKS = dict(SHARDED_SHAPES, m=(40, 24))


@pytest.mark.parametrize("fraction,reduction,graft_type,grafting,rechunk,shapes", [
    # (three of the eight by default, CI time: every strategy kind among them,
    # SP-NGD's reduce-scatter in the rechunked case)
    pytest.param(1 / 8, "none", "adagrad", "block", False, SHARDED_SHAPES,   # MEM-OPT
                 marks=pytest.mark.slow),
    (1 / 4, "all_reduce", "adagrad", "layer", False, SHARDED_SHAPES),   # HYBRID, m = 2
    pytest.param(1 / 2, "none", "adam", "block", False, SHARDED_SHAPES,      # HYBRID, m = 4
                 marks=pytest.mark.slow),
    pytest.param(1 / 8, "reduce_scatter", "sgd", "layer", False, SHARDED_SHAPES,  # SP-NGD
                 marks=pytest.mark.slow),
    pytest.param(1 / 4, "reduce_scatter", "sgd", "block", False, SHARDED_SHAPES,
                 marks=pytest.mark.slow),
    (1 / 8, "reduce_scatter", "sgd", "block", True, SHARDED_SHAPES),    # rechunked
    (1 / 8, "none", "adagrad", "layer", False, MANY_BLOCKS),
    pytest.param(1 / 4, "reduce_scatter", "sgd", "block", False, MANY_BLOCKS,
                 marks=pytest.mark.slow),
], ids=["mem", "hybrid2", "hybrid4", "spngd-mem", "spngd-hybrid", "rechunk",
        "mem-many-blocks", "spngd-many-blocks"])
def test_sharded_shampoo_equals_single_device(fraction, reduction, graft_type, grafting,
                                              rechunk, shapes, x64, monkeypatch):
  """Owner groups hold, update and apply only their blocks' statistics and
  roots: the same updates and (gathered) state as one device, step by step.
  `rechunk`: every uneven gather / reduce-scatter takes `uneven`'s rechunk
  scheme (tight chunks and ppermute forwarding). `MANY_BLOCKS`: 60 equal
  blocks over the groups, each group's one run of consecutive blocks
  (`owners.assign` deals equal items in order), read by one slice."""
  if rechunk:
    monkeypatch.setattr(uneven, "plan", uneven.rechunk)
  mesh = _mesh()
  options = dict(CADENCE, graft_type=graft_type, grafting=grafting, graft_beta2=0.9)
  single = kd.scale_by_shampoo(**options)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction, gradient_reduction=reduction)
  tx = kd.scale_by_shampoo(distribution=dist, **options)
  params = _params(shapes)
  state = tx.init(params)
  lay = state.layout
  if shapes is MANY_BLOCKS:
    most = max(len(shampoo_blocks.runs([b for b, g in enumerate(gs) if g == group], 1))
               for gs in (r for q in lay.block_groups for r in q) for group in set(gs))
    assert most == 1
  assert not lay.roots_replicated and lay.num_groups == round(1 / fraction)
  # every group owns blocks, and each block's statistics stay within its group
  owners = {g for q in lay.block_groups for r in q for g in r}
  assert owners == set(range(lay.num_groups))
  for plan, groups in zip(lay.params, lay.block_groups):
    for region, gs in zip(plan.regions, groups):
      for a in range(len(region.block)):
        for b, g in enumerate(gs):
          device = lay.places[region.buckets[a]][region.slots[a] + b][0]
          assert device // lay.group_size == g
  rng = np.random.default_rng(7)
  local = [{k: jnp.asarray(rng.normal(size=(8,) + s)) for k, s in shapes.items()}
           for _ in range(7)]
  runs = _sharded_steps(tx, state, mesh, local, reduction)
  one, update = single.init(params), jax.jit(single.update)
  for step, (g, (got, got_state)) in enumerate(zip(local, runs)):
    want, one = update(jax.tree.map(lambda x: x.mean(0), g), one)
    for name in shapes:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12,
                                 err_msg=f"step {step}, {name}")
    for a, b in zip(jax.tree.leaves(shampoo_state.bucket_arrays(got_state)),
                    jax.tree.leaves(shampoo_state.bucket_arrays(one))):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=f"step {step}")
    for a, b in zip(got_state.graft, one.graft):
      np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("fraction,reduction", [
    pytest.param(1, "none", marks=pytest.mark.slow),             # COMM-OPT
    (1 / 8, "none"),                                             # MEM-OPT
    pytest.param(1 / 4, "all_reduce", marks=pytest.mark.slow),   # HYBRID
    (1 / 8, "reduce_scatter"),        # SP-NGD routing: the NaN stays on one device
])
def test_sharded_faulty_step_is_skipped_bit_for_bit(fraction, reduction):
  """On 8 devices a NaN in one device's gradients skips the step everywhere:
  the run with the faulty batch inserted equals the run without it."""
  mesh = _mesh()
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction, gradient_reduction=reduction)
  tx = kd.scale_by_shampoo(distribution=dist, **CADENCE, graft_type="sgd")
  params = _params(SHARDED_SHAPES, np.float32)
  rng = np.random.default_rng(9)
  local = [{k: jnp.asarray(rng.normal(size=(8,) + s), jnp.float32)
            for k, s in SHARDED_SHAPES.items()} for _ in range(3)]
  name = next(iter(SHARDED_SHAPES))
  bad = dict(local[1])
  bad[name] = bad[name].at[3].set(np.nan)             # device 3's gradient only
  clean = _sharded_steps(tx, tx.init(params), mesh, [local[0], local[2]], reduction)
  faulty = _sharded_steps(tx, tx.init(params), mesh, [local[0], bad, local[2]], reduction)
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(faulty[1][0]))
  assert _bits(faulty[2][0]) == _bits(clean[1][0])
  got, want = faulty[2][1], clean[1][1]
  assert int(got.skipped) == 1
  assert _bits(dataclasses.replace(got, skipped=want.skipped)) == _bits(want)


def _state_bytes(state, mesh):
  """Bytes one device holds of a global state placed with `kd.shard_state`."""
  placed = kd.shard_state(state, mesh)
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(placed))


def test_sharded_state_bytes_per_device():
  """Per device, every strategy stores its own statistics and its group's
  roots, `[L] + [m·L]`: MEM-OPT `[L] + [L]`, HYBRID between, COMM-OPT (one
  group) a `1/P` share of the statistics and every root, below the `2 Σ n d²`
  of every statistic and root; the grafting accumulators and the counters
  are replicated."""
  mesh = _mesh()
  params = _params({"a": (64, 48), "b": (40, 24), "c": (3, 3, 8, 16), "d": (48,)},
                   np.float32)
  options = dict(block_size=16, graft_type="adagrad")
  comm = kd.scale_by_shampoo(distribution=kd.Distribution(mesh), **options).init(params)
  total = sum(n * d * d for (d, _), n in zip(comm.layout.buckets, comm.layout.sizes))
  graft = sum(x.size for x in comm.graft)
  replicated = 4 * graft + 2 * 4          # float32 accumulators, int32 count and skipped
  assert _state_bytes(comm, mesh) < replicated + 4 * 2 * total
  for fraction in (1, 1 / 8, 1 / 4, 1 / 2):
    dist = kd.Distribution(mesh, grad_worker_fraction=fraction)
    state = kd.scale_by_shampoo(distribution=dist, **options).init(params)
    lay = state.layout
    used = [0] * 8
    for (d, _), bucket in zip(lay.buckets, lay.places):
      for device, _ in bucket:
        used[device] += d * d
    assert sum(used) == total and lay.segment == max(used)
    predicted = replicated + 4 * (1 + lay.group_size) * lay.segment
    measured = _state_bytes(state, mesh)
    assert measured == predicted
    assert fraction == 1 or measured < _state_bytes(comm, mesh)
    # the statistics and roots alone: within the balance of the ideal 1/P and m/P
    ideal = (1 + lay.group_size) * total / 8
    assert ideal <= (1 + lay.group_size) * lay.segment < 2 * total


def test_sharded_shampoo_errors():
  mesh = _mesh()
  with pytest.raises(ValueError, match="reduce_scatter.*grafting accumulators"):
    kd.scale_by_shampoo(graft_type="adagrad", distribution=kd.Distribution(
        mesh, grad_worker_fraction=1 / 8, gradient_reduction="reduce_scatter"))
  params = _params(SMALL, np.float32)
  mem = kd.scale_by_shampoo(block_size=4, distribution=kd.Distribution(
      mesh, grad_worker_fraction=1 / 8))
  state = kd.scale_by_shampoo(block_size=4).init(params)
  with pytest.raises(ValueError, match="laid out for.*convert_state"):
    mem.update(_grads(np.random.default_rng(0), SMALL, np.float32), state)


@pytest.mark.parametrize("fraction", [None, 1.0, 1 / 4, 1 / 8])
def test_traced_init_equals_the_host_init(fraction):
  """`init` traced (`jax.jit`, `jax.eval_shape`) builds the identities from
  runs of blocks, never as host arrays: bit for bit the host-built state, on
  one device, COMM-OPT, HYBRID (2 groups of 4) and MEM-OPT (blocks of mixed
  sizes, the devices' segments padded to the longest)."""
  dist = None if fraction is None else kd.Distribution(_mesh(), grad_worker_fraction=fraction)
  tx = kd.scale_by_shampoo(block_size=4, graft_type="adagrad", distribution=dist)
  params = _params(SHARDED_SHAPES, np.float32)
  host = tx.init(params)
  traced = jax.jit(tx.init)(params)
  padded = host.layout.segment * host.layout.num_devices > sum(
      n * d * d for (d, _), n in zip(host.layout.buckets, host.layout.sizes))
  assert padded == (fraction is not None)
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(traced)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.structure(jax.eval_shape(tx.init, params)) == jax.tree.structure(host)
  # no array of the state's numbers in the program, only the tables of the
  # runs of blocks (`core.initial`, 14 runs here: at most 51 characters); a
  # host-built state there is a 1.8-2.6 thousand-character constant
  text = jax.jit(tx.init).lower(params).as_text()
  assert max(map(len, re.findall(r"stablehlo.constant dense<([^>]*)>", text))) < 120


def test_statistics_past_int32_offsets_are_refused(monkeypatch):
  """One device's statistics segment `[L]` is written at int32 offsets: as if
  int32 ended just short of it, init raises naming what to change (on one
  device and on eight, where each device holds 1/8 and passes)."""
  from kfac_jax_dist.core import offsets  # pylint: disable=import-outside-toplevel
  params = _params(SMALL, np.float32)
  one = kd.scale_by_shampoo(block_size=4)
  eight = kd.scale_by_shampoo(block_size=4, distribution=kd.Distribution(
      _mesh(), grad_worker_fraction=1 / 8))
  segment = one.init(params).layout.segment
  assert eight.init(params).layout.segment < segment
  monkeypatch.setattr(offsets, "INT32_MAX", segment - 1)
  with pytest.raises(ValueError, match=r"Shampoo statistics hold .* more than int32 "
                     r"offsets reach .* on 1 device.*max_preconditioner_dim"):
    one.init(params)
  eight.init(params)


def test_convert_state_between_shampoo_strategies(x64):
  """COMM-OPT → MEM-OPT → HYBRID → one device moves statistics, roots and
  grafting state exactly; the converted state continues the trajectory."""
  mesh = _mesh()
  options = dict(CADENCE, graft_type="adagrad")
  params = _params(SHARDED_SHAPES)

  def tx(fraction):
    return kd.scale_by_shampoo(distribution=kd.Distribution(
        mesh, grad_worker_fraction=fraction), **options)
  rng = np.random.default_rng(3)
  local = [{k: jnp.asarray(rng.normal(size=(8,) + s)) for k, s in SHARDED_SHAPES.items()}
           for _ in range(6)]
  comm = _sharded_steps(tx(1), tx(1).init(params), mesh, local[:3], "none")[-1][1]
  mem = kd.convert_state(comm, tx(1 / 8).init(params))
  hybrid = kd.convert_state(mem, tx(1 / 2).init(params))
  single = kd.scale_by_shampoo(**options)
  back = kd.convert_state(hybrid, single.init(params))
  for state in (mem, hybrid, back):
    assert int(state.count) == 3
    for a, b in zip(jax.tree.leaves(shampoo_state.bucket_arrays(state)),
                    jax.tree.leaves(shampoo_state.bucket_arrays(comm))):
      np.testing.assert_array_equal(a, b)
    for a, b in zip(state.graft, comm.graft):
      np.testing.assert_array_equal(a, b)
  # MEM-OPT from the converted state continues the one-device trajectory
  got = _sharded_steps(tx(1 / 8), mem, mesh, local[3:], "none")
  one, update = single.init(params), jax.jit(single.update)
  for step, g in enumerate(local):
    want, one = update(jax.tree.map(lambda x: x.mean(0), g), one)
    if step >= 3:
      for name in SHARDED_SHAPES:
        np.testing.assert_allclose(got[step - 3][0][name], want[name], rtol=1e-9,
                                   atol=1e-12)
  with pytest.raises(ValueError, match="same parameters and block options"):
    kd.convert_state(comm, kd.scale_by_shampoo(**dict(options, block_size=3)).init(params))


def test_sharded_shampoo_checkpoint_restores_and_refuses_another_layout(tmp_path):
  mesh = _mesh()
  params = _params(SHARDED_SHAPES, np.float32)

  def tx(fraction):
    return optax.chain(kd.scale_by_shampoo(block_size=4, graft_type="adagrad",
                                           distribution=kd.Distribution(
                                               mesh, grad_worker_fraction=fraction)),
                       optax.sgd(0.1, momentum=0.9))
  rng = np.random.default_rng(4)
  local = [{k: jnp.asarray(rng.normal(size=(8,) + s), jnp.float32)
            for k, s in SHARDED_SHAPES.items()} for _ in range(2)]
  state = _sharded_steps(tx(1 / 4), tx(1 / 4).init(params), mesh, local, "none")[-1][1]
  kd.save_checkpoint(tmp_path / "ckpt", state)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(tx(1 / 4).init, params),
                                   mesh=mesh)
  assert restored[0].statistics[0].sharding.spec == jax.sharding.PartitionSpec("data")
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="Shampoo states were saved with another layout"):
    kd.restore_checkpoint(tmp_path / "ckpt", tx(1 / 8).init(params))


@pytest.mark.parametrize("make,fraction", [
    (lambda dist: kd.shampoo(0.1, block_size=32, graft_type="adam", graft_beta2=0.9,
                             distribution=dist), None),
    (lambda dist: kd.shampoo(0.1, block_size=32, distribution=dist), 1 / 4),
    (lambda dist: kd.soap(0.1, block_size=32, distribution=dist), 1.0),
    (lambda dist: kd.soap(0.1, block_size=32, distribution=dist), 1 / 8)],
    ids=["shampoo-1dev-adam-graft", "shampoo-4-groups", "soap-comm", "soap-mem"])
def test_describe_tabulates_blocks_and_bytes(make, fraction):
  """kd.describe of Shampoo and SOAP states: each parameter's blocks (counted
  from its shape here), its bytes (blocks' d² per axis for statistics and
  roots or bases, SOAP's block moments, the diagonal methods' accumulators),
  and the bytes per device, equal to what device 0 holds once placed."""
  params = {"a": jnp.ones((70, 40)), "b": jnp.ones((3, 3, 4, 8)), "c": jnp.ones((40,))}
  dist = None if fraction is None else kd.Distribution(helpers.data_mesh(8),
                                                        grad_worker_fraction=fraction)
  state = make(dist).init(params)
  sh = [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "layout"))
        if hasattr(s, "layout")][0]
  soap = "soap" in type(sh).__name__.lower()
  text = kd.describe(state, print_table=False)
  rows = {line.split()[0]: line for line in text.splitlines()
          if line.split() and line.split()[0] in ("a", "b", "c")}
  # "a": (70, 40), blocks of 32: 2x(32, 32), 1x(6, 32), 2x(32, 8), 1x(6, 8)
  assert "2 x (32, 32), 2 x (32, 8), 1 x (6, 32), 1 x (6, 8)" in rows["a"]
  blocks_a = [(32, 32)] * 2 + [(32, 8)] * 2 + [(6, 32), (6, 8)]
  numbers = 2 * sum(r * r + c * c for r, c in blocks_a) + (2 * 70 * 40 if soap else 0)
  graft = 70 * 40 * 4 if not soap and fraction is None else 0   # adam grafting: its v
  assert rows["a"].split()[-1] == f"{4 * numbers + graft:,}"
  # "b" merges to (9, 32) -> one (9, 32) block; "c" is diagonal
  assert "1 x (9, 32)" in rows["b"] and "diagonal" in rows["c"]
  diagonal_c = 2 * 40 * 4 if soap else 40 * 4 if fraction is None else 0   # M, V / v
  assert rows["c"].split()[-1] == f"{diagonal_c:,}"
  per_device = int(re.search(r"state: ([\d,]+) bytes per device", text).group(1).replace(",", ""))
  placed = state if dist is None else kd.shard_state(state, dist.mesh)
  device0 = jax.devices()[0]
  held = sum(shard.data.nbytes for leaf in jax.tree.leaves(
      [s for s in jax.tree.leaves(placed, is_leaf=lambda x: hasattr(x, "layout"))
       if hasattr(s, "layout")][0]) for shard in leaf.addressable_shards
      if shard.device == device0)
  assert per_device == held


def test_describe_counts_one_model_shard():
  """On a ("data", "model") mesh each model shard keeps its own state: the
  bytes per device that kd.describe gives are what device 0 holds once
  placed (not M times them)."""
  mesh = helpers.mesh((4, 2), ("data", "model"))
  params = {"w": jnp.ones((16, 24)), "b": jnp.ones((24,))}
  specs = {"w": jax.sharding.PartitionSpec(None, "model"),
           "b": jax.sharding.PartitionSpec("model")}
  dist = kd.Distribution(mesh, axis="data", model_axis="model", param_specs=specs,
                         grad_worker_fraction=1 / 2)
  for tx in (kd.shampoo(0.1, block_size=8, graft_type="adagrad", distribution=dist),
             kd.soap(0.1, block_size=8, distribution=dist)):
    state = tx.init(params)
    text = kd.describe(state, print_table=False)
    assert "of each of the 2 model shards" in text
    assert "(16, 12)" in text                       # the local shard of "w"
    per_device = int(re.search(r"shards: ([\d,]+) bytes per device",
                               text).group(1).replace(",", ""))
    placed = kd.shard_state(state, mesh)
    sharded = [s for s in jax.tree.leaves(placed, is_leaf=lambda x: hasattr(x, "inner"))
               if hasattr(s, "inner")]
    device0 = jax.devices()[0]
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(sharded)
               for shard in leaf.addressable_shards if shard.device == device0)
    assert per_device == held


# ------------------------------------------------------------- stacked layers

# "s": 3 layers of (6, 10); "n": nested scans, 2 x 2 layers of (3, 4, 5); "sb": a
# stacked bias (each layer's diagonal); "w2": not stacked
STACKED = {"s": (3, 6, 10), "n": (2, 2, 3, 4, 5), "sb": (3, 10), "w2": (6, 10)}
STACK_AXES = {"s": 1, "n": 2, "sb": 1}
STACKED_PATTERNS = {"^s$": 1, "^n$": 2, "^sb$": 1}


def _unstacked_shapes(shapes, stack_axes):
  return {k: np.shape(v) for k, v in helpers.unstacked(
      {k: np.zeros(s) for k, s in shapes.items()}, stack_axes).items()}


def _assert_unrolled(got, want, stack_axes, step):
  got = helpers.unstacked({k: np.asarray(v) for k, v in got.items()}, stack_axes)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12,
                               err_msg=f"step {step}, {name}")


@pytest.mark.parametrize("options", [
    dict(block_size=4, graft_type="adagrad"),
    dict(block_size=4, merge_small_dims=True, graft_type="rmsprop", graft_beta2=0.9,
         grafting="layer", beta2=0.9),
    dict(block_size=None, graft_type="adam", graft_beta2=0.9, grafting="layer")],
    ids=["block-adagrad", "merged-layer-rmsprop", "unblocked-layer-adam"])
def test_stacked_layers_are_preconditioned_as_unrolled(options, x64):
  """`stacked=`: each layer of a stacked parameter (one or two leading stack
  axes) gets its own blocks, statistics, roots and block or layer grafting:
  the numpy oracle run on the unrolled layers, step by step; a stacked bias
  gets each layer's diagonal update."""
  tx = kd.scale_by_shampoo(start_preconditioning_step=0, stacked=STACKED_PATTERNS,
                           **options)
  oracle_options = {k: v for k, v in options.items() if k != "merge_small_dims"}
  oracle = NumpyShampoo(_unstacked_shapes(STACKED, STACK_AXES), start=0,
                        merge=options.get("merge_small_dims", False), **oracle_options)
  state, rng = tx.init(_params(STACKED)), np.random.default_rng(3)
  update = jax.jit(tx.update)
  for step in range(3):
    grads = _grads(rng, STACKED)
    got, state = update(grads, state)
    _assert_unrolled(got, oracle.step(helpers.unstacked(grads, STACK_AXES)), STACK_AXES,
                     step)
  stacks = {plan.path: (plan.stack, plan.preconditioned) for plan in state.layout.params}
  assert stacks == {"s": (3, True), "n": (4, True), "sb": (0, False), "w2": (0, True)}
  text = kd.describe(state, print_table=False)
  assert "3 layers x (6, 10)" in text and "4 layers x (3, 4, 5)" in text


@pytest.mark.parametrize("fraction,reduction,graft_type,grafting", [
    (1 / 8, "reduce_scatter", "sgd", "layer"),     # SP-NGD: layer norms sent by layer
    (1 / 4, "all_reduce", "adagrad", "layer"),     # HYBRID
    (1 / 2, "none", "adagrad", "block")])          # HYBRID, m = 4
def test_sharded_stacked_layers_equal_the_unrolled_oracle(fraction, reduction, graft_type,
                                                         grafting, x64):
  """On 8 devices, the owner groups' blocks of stacked parameters (dealt
  layer by layer) give the numpy oracle's unrolled updates, step by step,
  with the cadence of `CADENCE`."""
  mesh = _mesh()
  options = dict(CADENCE, graft_type=graft_type, grafting=grafting, graft_beta2=0.9)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction, gradient_reduction=reduction)
  tx = kd.scale_by_shampoo(distribution=dist, stacked=STACKED_PATTERNS, **options)
  oracle = NumpyShampoo(
      _unstacked_shapes(STACKED, STACK_AXES), block_size=4, graft_type=graft_type,
      grafting=grafting, graft_beta2=0.9, start=2, stat_every=2, precond_every=3)
  rng = np.random.default_rng(5)
  local = [{k: jnp.asarray(rng.normal(size=(8,) + s)) for k, s in STACKED.items()}
           for _ in range(6)]
  runs = _sharded_steps(tx, tx.init(_params(STACKED)), mesh, local, reduction)
  for step, (g, (got, _)) in enumerate(zip(local, runs)):
    want = oracle.step(helpers.unstacked(jax.tree.map(lambda x: x.mean(0), g), STACK_AXES))
    _assert_unrolled(got, want, STACK_AXES, step)


def test_flax_scan_trains_as_the_unrolled_model(x64):
  """A linen `nn.scan` over 3 Dense blocks with `stacked=["blocks/"]` takes the
  unrolled model's Shampoo steps (the same weights, layer by layer)."""
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(6)(h)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)
      return blocks(name="blocks")(x, None)[0]

  def unrolled_apply(p, x):
    for i in range(3):
      x = jnp.tanh(x @ p[f"{i}/kernel"] + p[f"{i}/bias"])
    return x
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 6))
  stacked = Scanned().init(jax.random.PRNGKey(1), x)["params"]
  layers = lambda tree: {f"{i}/{k}": v[i] for k, v in
                         tree["blocks"]["Dense_0"].items() for i in range(3)}
  unrolled = layers(stacked)
  loss = lambda y: jnp.sum(jnp.sin(y))
  tx = kd.shampoo(0.1, block_size=4, graft_type="adagrad", stacked=["blocks/"])
  tx_unrolled = kd.shampoo(0.1, block_size=4, graft_type="adagrad")
  s, su = tx.init(stacked), tx_unrolled.init(unrolled)
  for _ in range(3):
    g = jax.grad(lambda p: loss(Scanned().apply({"params": p}, x)))(stacked)
    gu = jax.grad(lambda p: loss(unrolled_apply(p, x)))(unrolled)
    u, s = tx.update(g, s, stacked)
    uu, su = tx_unrolled.update(gu, su, unrolled)
    helpers.assert_trees_equal(layers(u), uu, rtol=1e-10)
    stacked, unrolled = optax.apply_updates(stacked, u), optax.apply_updates(unrolled, uu)


def test_stacked_checkpoint_restores_and_refuses_the_unstacked_layout(tmp_path):
  """A checkpoint records which parameters are stacked: it restores into the
  same `stacked=` and refuses a template without it."""
  params = _params({"s": (2, 4, 4)}, np.float32)
  stacked = kd.shampoo(0.1, merge_small_dims=False, stacked=["s"])
  state = stacked.init(params)
  _, state = stacked.update(_grads(np.random.default_rng(0), {"s": (2, 4, 4)}, np.float32),
                            state, params)
  kd.save_checkpoint(tmp_path / "ckpt", state)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", stacked.init(params))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="Shampoo states were saved with another layout"):
    kd.restore_checkpoint(tmp_path / "ckpt",
                          kd.shampoo(0.1, merge_small_dims=False).init(params))


@pytest.mark.parametrize("stacked,error,message", [
    ("s", TypeError, "stacked must be a sequence of regular expressions"),
    ({"^s$": 0}, ValueError, "positive number of leading stack axes, got 0"),
    ({"^s$": True}, ValueError, "positive number of leading stack axes, got True"),
    (["^s$", "layers/"], ValueError, "stacked pattern 'layers/' matches no parameter"),
    ({"^sb$": 3}, ValueError, "'sb' has shape \\(3, 10\\), fewer axes than its 3 stack"),
    ({"s": 1, "^s$": 2}, ValueError, "give it \\[1, 2\\] stack axes")])
def test_stacked_mistakes_are_named(stacked, error, message):
  with pytest.raises(error, match=message):
    kd.shampoo(0.1, stacked=stacked).init(_params(STACKED, np.float32))
  with pytest.raises(error, match=message):
    kd.soap(0.1, stacked=stacked).init(_params(STACKED, np.float32))


@pytest.mark.parametrize("index", [[2, 3, 4], [0, 5, 6, 9], [1, 3, 5, 7, 9, 11, 12, 13],
                                   list(range(0, 30, 3))])
def test_take_is_indexing(index):
  """`blocks.take`: slices of the runs of a static index, or past
  `TAKE_SLICES` runs one gather; either way `x[index]`."""
  x = np.arange(30 * 2, dtype=np.float32).reshape(30, 2)
  spans = shampoo_blocks.runs(index, 1)
  assert (len(spans) > shampoo_blocks.TAKE_SLICES) == (len(index) >= 8)
  np.testing.assert_array_equal(np.asarray(jax.jit(
      lambda v: shampoo_blocks.take(v, index))(jnp.asarray(x))), x[index])
