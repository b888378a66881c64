"""Faults and misconfigurations: non-finite inputs skip the step (state unchanged,
bit for bit), failed decompositions keep the previous second-order information,
and bad configurations raise errors that name the layer. On 1 and 8 devices."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac.state import find_states
from kfac_jax_dist.kfac.state import second_order_parts

BATCH = 16


def loss_fn(params, x, y):
  """Dense layers of factor dimensions 7, 8, 9, 5, 5, 4 (two of 5: one bucket),
  a scale-and-shift (unit-wise) layer and an untagged parameter."""
  h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
  h = kd.tags.scale_and_shift(h, params["ln"]["scale"], params["ln"]["offset"], name="ln")
  h = jnp.tanh(kd.tags.dense(h, params["l1"]["kernel"], params["l1"]["bias"], name="l1"))
  logits = kd.tags.dense(h, params["out"]["kernel"], name="out") * params["temp"]
  return kd.losses.softmax_cross_entropy(logits, y)


def _params():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"l0": {"kernel": 0.5 * jax.random.normal(k[0], (6, 8)), "bias": jnp.zeros(8)},
          "ln": {"scale": jnp.ones(8), "offset": jnp.zeros(8)},
          "l1": {"kernel": 0.5 * jax.random.normal(k[1], (8, 5)), "bias": jnp.zeros(5)},
          "out": {"kernel": 0.5 * jax.random.normal(k[2], (5, 4))},
          "temp": jnp.ones(4)}


def _batch(i):
  kx, ky = jax.random.split(jax.random.PRNGKey(100 + i))
  return jax.random.normal(kx, (BATCH, 6)), jax.random.randint(ky, (BATCH,), 0, 4)


GRAD_FN = kd.value_and_grad(loss_fn)


def _layers():
  return GRAD_FN.discover(_params(), *_batch(0))


def _poison(grads, stats, grad_bad, stat_bad):
  """Adds `grad_bad` to one tagged and one untagged gradient entry and
  `stat_bad` to one statistic (0.0: unchanged; NaN/Inf: a fault)."""
  grads = dict(grads, l1=dict(grads["l1"], kernel=grads["l1"]["kernel"].at[0, 0].add(grad_bad)),
               temp=grads["temp"].at[1].add(grad_bad))
  g = stats["out"]["G"]
  stats = dict(stats, out=dict(stats["out"], G=g.at[helpers.entry(g, 1, 1)].add(stat_bad)))
  return grads, stats


def _bits(x):
  x = np.asarray(x)
  return x.dtype, x.shape, x.tobytes()


def assert_bitwise(a, b, what=""):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, what
  for i, (x, y) in enumerate(zip(la, lb)):
    assert _bits(x) == _bits(y), f"{what}: leaf {i} differs"


def _without_skipped(tree, kind=kd.ScaleByKfacState):
  """`tree` with every K-FAC (or `kind`) state's `skipped` counter zeroed (for
  comparisons)."""
  return jax.tree_util.tree_map(
      lambda s: dataclasses.replace(s, skipped=jnp.zeros_like(s.skipped))
      if isinstance(s, kind) else s, tree, is_leaf=lambda s: isinstance(s, kind))


def _skipped(opt_state, kind=kd.ScaleByKfacState):
  return [int(s.skipped) for s in kd.find_states(opt_state, kind)]


# ---------------------------------------------------------------- one device

def _single_tx(chained, method="eigen", factor_every=1, inverse_every=2, **extra):
  options = dict(damping=1e-2, factor_update_every=factor_every,
                 inverse_update_every=inverse_every, method=method, **extra)
  if chained:
    return kd.kfac(0.1, layers=_layers(), momentum=0.9, weight_decay=1e-3, **options)
  return kd.scale_by_kfac(_layers(), kl_clip=1e-2, learning_rate=0.1, **options)


@functools.lru_cache(maxsize=None)
def _single_step(chained, **options):
  tx = _single_tx(chained, **options)

  @jax.jit
  def step(params, state, x, y, grad_bad, stat_bad):
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    grads, stats = _poison(grads, stats, grad_bad, stat_bad)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, updates

  return tx, step


@pytest.mark.parametrize("chained", [False, True], ids=["scale_by_kfac", "kfac"])
@pytest.mark.parametrize("fault", ["grad_nan", "grad_inf", "stat_nan", "stat_inf"])
def test_nonfinite_input_skips_the_step_bitwise(chained, fault):
  """A NaN/Inf gradient, or statistic on a factor step, returns zero updates
  and leaves every state leaf unchanged but `skipped`; `count` does not
  advance, so the run continues exactly as if the faulty step never happened."""
  tx, step = _single_step(chained)
  bad = {"nan": np.nan, "inf": np.inf}[fault.split("_")[1]]
  grad_bad, stat_bad = (bad, 0.0) if fault.startswith("grad") else (0.0, bad)
  params0 = _params()
  clean_p, clean_s = params0, tx.init(params0)
  p, s = params0, tx.init(params0)
  for i in range(4):                       # counts 0..3; count 2: factor + inverse step
    clean_p, clean_s, _ = step(clean_p, clean_s, *_batch(i), 0.0, 0.0)
    if i == 2:                             # the same batch, poisoned, first
      new_p, new_s, updates = step(p, s, *_batch(i), grad_bad, stat_bad)
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
      assert_bitwise(new_p, p, "params after a skipped step")
      assert _skipped(new_s) == [1]
      assert_bitwise(_without_skipped(new_s), s, "state after a skipped step")
      s = new_s
    p, s, _ = step(p, s, *_batch(i), 0.0, 0.0)
  assert int(find_states(s)[0].count) == 4
  assert _skipped(s) == [1]
  assert_bitwise(p, clean_p, "params")
  assert_bitwise(_without_skipped(s), clean_s, "state")


@functools.lru_cache(maxsize=None)
def _decomposition_step_inputs(method):
  """(jitted update, params, state, grads, stats) of a decomposition step
  after two steps (eigenbases no longer the identity), made once per method."""
  tx = _single_tx(False, method=method, inverse_every=1, max_factor_dim=8)
  params = _params()
  update = jax.jit(tx.update)
  state = tx.init(params)
  for i in range(2):
    _, grads, stats = GRAD_FN(params, *_batch(i), opt_state=state)
    updates, state = update(grads, state, params, kfac_stats=stats)
    params = optax.apply_updates(params, updates)
  _, grads, stats = GRAD_FN(params, *_batch(2), opt_state=state)
  return update, params, state, grads, stats


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("path", ["l0/kernel", "l1/bias", "ln/scale", "out/kernel", "temp"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_one_nonfinite_gradient_number_anywhere_skips(method, path, bad):
  """One non-finite number in any gradient leaf (a dense kernel or bias, a
  unit-wise scale, an untagged leaf) skips the step: zero updates, the state
  unchanged but `skipped`. On a decomposition step, where the eigenbases
  are no longer the identity."""
  update, params, state, grads, stats = _decomposition_step_inputs(method)
  leaf = functools.reduce(lambda t, k: t[k], path.split("/"), grads)
  bad_leaf = leaf.at[(0,) * leaf.ndim].set(bad)
  grads = jax.tree_util.tree_map_with_path(
      lambda p, x: bad_leaf if "/".join(k.key for k in p) == path else x, grads)
  updates, new_state = update(grads, state, params, kfac_stats=stats)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert _skipped(new_state) == [1]
  assert_bitwise(_without_skipped(new_state), _without_skipped(state), "state")


def test_zero_updates_alone_would_move_momentum():
  """Why `kd.kfac` wraps its chain in `skip_faulty_steps`: without it, a
  skipped K-FAC step still decays the momentum and moves the parameters."""
  layers = _layers()
  bare = optax.chain(kd.scale_by_kfac(layers), optax.sgd(0.1, momentum=0.9))
  wrapped = kd.skip_faulty_steps(bare)
  params = _params()
  x, y = _batch(0)
  for tx, moves in ((bare, True), (wrapped, False)):
    state = tx.init(params)
    update = jax.jit(tx.update)
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    _, state = update(grads, state, params, kfac_stats=stats)
    grads, stats = _poison(grads, stats, np.nan, 0.0)
    updates, new_state = update(grads, state, params, kfac_stats=stats)
    assert _skipped(new_state) == [1]
    assert bool(any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))) == moves
    momentum = lambda st: jax.tree.leaves(st[1])
    assert (_bits(momentum(new_state)[0]) != _bits(momentum(state)[0])) == moves
  with pytest.raises(TypeError, match=r"holds no K-FAC, Shampoo or SOAP state: .*"
                                      r"skip_faulty_steps wraps transforms that hold one"):
    kd.skip_faulty_steps(optax.sgd(0.1)).update(grads, optax.sgd(0.1).init(params))
  # another chain's state (the bare chain's, given to kd.kfac's update): named, not
  # optax's "The number of updates and states has to be the same in chain!"
  with pytest.raises(TypeError, match=r"the state has 2 part\(s\) at its top level, not "
                                      r"this transform's: another optimizer's"):
    kd.kfac(0.1, layers=layers).update(grads, bare.init(params), params, kfac_stats=stats)


def test_nonfinite_statistics_on_other_steps_are_not_consumed():
  """Statistics are read on factor steps only: a NaN in them elsewhere does
  not skip the step."""
  tx, step = _single_step(False, factor_every=2)
  params = _params()
  p, s, _ = step(params, tx.init(params), *_batch(0), 0.0, 0.0)
  assert not bool(find_states(s)[0].update_factors)
  p_bad, s_bad, _ = step(p, s, *_batch(1), 0.0, np.nan)
  p_ok, s_ok, _ = step(p, s, *_batch(1), 0.0, 0.0)
  assert _skipped(s_bad) == [0]
  assert_bitwise((p_bad, s_bad), (p_ok, s_ok))


def _poison_factor(state, layer, which, value=np.inf):
  """The global state with `value` written into one entry of a running factor."""
  kstate, = find_states(state)
  lay = kstate.layout
  place = dict(lay.plan(layer).places)[which]
  bad = kstate.factors.at[lay.factor_start(place)].set(value)
  return jax.tree_util.tree_map(
      lambda s: dataclasses.replace(s, factors=bad) if isinstance(s, kd.ScaleByKfacState)
      else s, state, is_leaf=lambda s: isinstance(s, kd.ScaleByKfacState))


def _check_kept(before, after, clean, kept):
  """Second-order parts: `kept` factors as in `before`, the others as in the
  clean run's `after` (and so changed)."""
  old, new, ref = (second_order_parts(find_states(s)[0]) for s in (before, after, clean))
  changed = 0
  for layer in ref:
    for which in ref[layer]:
      if (layer, which) in kept:
        assert_bitwise(new[layer][which], old[layer][which], f"{layer}/{which} kept")
      else:
        assert_bitwise(new[layer][which], ref[layer][which], f"{layer}/{which} updated")
        changed += any(_bits(a) != _bits(b) for a, b in zip(ref[layer][which],
                                                             old[layer][which])
                       if a is not None)
  assert changed > 0


@pytest.mark.parametrize("method,layer,which,kept", [
    ("eigen", "out", "a", {("out", "A")}),          # shares its bucket with l1/G
    ("eigen", "ln", "f", {("ln", "F")}),            # unit-wise
    ("eigen", "l1", "a", {("l1", "A")}),            # diagonal (max_factor_dim=8)
    ("inverse", "out", "a", {("out", "A"), ("out", "G")}),   # π couples A and G
    ("inverse", "l1", "a", {("l1", "A"), ("l1", "G")}),
])
def test_failed_decomposition_keeps_previous_second_order(method, layer, which, kept):
  """A factor whose running value (hence decomposition) is not finite keeps
  its previous eigenbasis/eigenvalues or inverse; every other factor is
  decomposed as in a clean run, and the step is taken (finite updates)."""
  tx, step = _single_step(False, method=method, inverse_every=1, max_factor_dim=8)
  params = _params()
  p, s, _ = step(params, tx.init(params), *_batch(0), 0.0, 0.0)
  _, clean, _ = step(p, s, *_batch(1), 0.0, 0.0)
  bad = _poison_factor(s, layer, which)
  _, after, updates = step(p, bad, *_batch(1), 0.0, 0.0)
  assert _skipped(after) == [0] and int(find_states(after)[0].count) == 2
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
  _check_kept(s, after, clean, kept)


@pytest.mark.parametrize("method,kept", [
    ("eigen", {("out", "A")}),
    ("inverse", {("out", "A"), ("out", "G")})])              # π couples A and G
def test_failed_decomposition_with_stale_statistics_keeps_previous(method, kept):
  """`stale_threshold`: a due factor whose running value (hence eigenbasis or
  inverse) is not finite keeps its previous second-order parts, and the step
  is taken; the others are refreshed as in a clean run. (Before, its NaN
  eigenbasis was written into the state and every later step was skipped.)"""
  tx, step = _single_step(False, method=method, inverse_every=1, stale_threshold=0.0)
  params = _params()
  p, s, _ = step(params, tx.init(params), *_batch(0), 0.0, 0.0)
  _, clean, _ = step(p, s, *_batch(1), 0.0, 0.0)
  _, after, updates = step(p, _poison_factor(s, "out", "a"), *_batch(1), 0.0, 0.0)
  assert _skipped(after) == [0] and int(find_states(after)[0].count) == 2
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
  _check_kept(s, after, clean, kept)


@pytest.mark.parametrize("layer,which", [("out", "a"), ("l0", "g")])
def test_failed_cholesky_keeps_both_inverses_of_its_layer(layer, which):
  """method="inverse": a running factor that is finite but indefinite (its
  Cholesky fails, its trace does not) keeps its previous inverse, and so does
  the other factor of its layer: both carry the layer's π (before, the other
  got a new inverse, damped unlike the kept one). The step is taken."""
  tx, step = _single_step(False, method="inverse", inverse_every=1, max_factor_dim=8)
  params = _params()
  p, s, _ = step(params, tx.init(params), *_batch(0), 0.0, 0.0)
  _, clean, _ = step(p, s, *_batch(1), 0.0, 0.0)
  _, after, updates = step(p, _poison_factor(s, layer, which, -1e6), *_batch(1), 0.0, 0.0)
  assert _skipped(after) == [0] and int(find_states(after)[0].count) == 2
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
  _check_kept(s, after, clean, {(layer, "A"), (layer, "G")})


@pytest.mark.parametrize("options", [
    {}, {"method": "inverse"}, {"stale_threshold": 0.1},
    {"eigenvalue_correction": "ekfac"}], ids=["eigen", "inverse", "stale", "ekfac"])
def test_running_factor_past_float16_range_skips_the_step(options):
  """`factor_dtype=float16`: statistics finite in float32 whose running
  average passes float16's 65504 skip the step, state unchanged (before, the
  factor was stored as inf, the step taken, and every later decomposition
  failed for good); the next ordinary batch trains."""
  tx = kd.scale_by_kfac(_layers(), damping=1e-2, factor_dtype=jnp.float16, **options)
  update = jax.jit(lambda g, s, p, st: tx.update(g, s, p, kfac_stats=st))
  params = _params()
  state = tx.init(params)
  x, y = _batch(0)
  _, grads, stats = GRAD_FN(params, 300.0 * x, y, opt_state=state)
  biggest = max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(stats))
  assert 65504 < biggest < np.inf
  updates, after = update(grads, state, params, stats)
  assert _skipped(after) == [1]
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert_bitwise(_without_skipped(after), _without_skipped(state), "skipped step")
  _, grads, stats = GRAD_FN(params, x, y, opt_state=after)
  _, after = update(grads, after, params, stats)
  kstate, = find_states(after)
  assert _skipped(after) == [1] and int(kstate.count) == 1
  assert np.isfinite(np.asarray(kstate.factors, np.float32)).all()


@pytest.mark.parametrize("preconditioner", ["kfac", "shampoo"])
def test_a_tail_overflowing_float16_updates_skips_the_step(preconditioner):
  """`skip_faulty_steps`: finite preconditioned updates that a later link of
  the chain pushes past float16's range (a momentum trace or weight decay
  in the parameters' dtype; here a scale) skip the step for the whole chain,
  counted in the preconditioner's state (before, the inf updates went out)."""
  inner, kind = ((kd.scale_by_kfac(_layers(), damping=1e-2), kd.ScaleByKfacState)
                 if preconditioner == "kfac" else
                 (kd.scale_by_shampoo(block_size=8), kd.ScaleByShampooState))
  tx = kd.skip_faulty_steps(optax.chain(inner, optax.trace(0.9), optax.scale(1e6)))
  params = jax.tree.map(lambda v: v.astype(jnp.float16), _params())
  state = tx.init(params)
  _, grads, stats = GRAD_FN(params, *_batch(0), opt_state=state)
  extra = {"kfac_stats": stats} if preconditioner == "kfac" else {}
  updates, after = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra))(grads, state,
                                                                       params)
  assert all(u.dtype == jnp.float16 and not np.any(np.asarray(u))
             for u in jax.tree.leaves(updates))
  assert _skipped(after, kind) == [1]
  assert_bitwise(_without_skipped(after, kind), _without_skipped(state, kind),
                 "skipped step")


@pytest.mark.parametrize("chunk", [1 << 16, 7, 3], ids=["one-chunk", "chunks-of-7", "chunks-of-3"])
@pytest.mark.parametrize("seed", range(6))
def test_keep_failed_selects_exactly_the_failed_factors(seed, chunk, monkeypatch):
  """`decompositions.keep_failed` against a per-factor loop: runs of several
  sizes (a factor with two parts, as eigenvectors and eigenvalues; running
  factors with gaps and padding between them), non-finite numbers (NaN, ±∞)
  written into random factors of either array; every factor with one keeps
  its previous numbers, every other one takes its new numbers. Also with the
  selection's loops in chunks of 7 and 3 numbers (the last one shifted back),
  and the runs handed over in a random order."""
  from kfac_jax_dist.kfac import decompositions
  monkeypatch.setattr(decompositions, "_CHUNK", chunk)
  rng = np.random.default_rng(seed)
  batches = [(int(rng.integers(1, 4)), int(rng.integers(1, 7)), int(rng.integers(1, 3)))
             for _ in range(int(rng.integers(1, 5)))]     # (count, size, parts)
  new_runs, running_runs, at, at_running, slots = [], [], 0, 3, 0
  for count, size, parts in batches:
    running_runs.append((at_running, count, size + 1, slots))
    at_running += count * (size + 1) + int(rng.integers(0, 3))     # a gap
    for part in range(parts):
      new_runs.append((at, count, size * (part + 1), slots))
      at += count * size * (part + 1)
    slots += count
  new = rng.normal(size=at + 5)                  # padding after the last run
  previous = rng.normal(size=new.shape)
  running = rng.normal(size=at_running + 2)
  failed = set()
  for _ in range(int(rng.integers(0, 6))):
    array, runs = ((new, new_runs), (running, running_runs))[int(rng.integers(0, 2))]
    start, count, size, first = runs[int(rng.integers(0, len(runs)))]
    j = int(rng.integers(0, count))
    edge = start + j * size + (0, size - 1)[int(rng.integers(0, 2))]   # a slot's end
    array[edge] = rng.choice([np.nan, np.inf, -np.inf])
    failed.add(first + j)
  expect = new.copy()
  for start, count, size, first in new_runs:
    for j in range(count):
      if first + j in failed:
        expect[start + j * size:start + (j + 1) * size] = previous[start + j * size:
                                                                   start + (j + 1) * size]
  # The runs in any order (`_slot_ids` finds each position's run by start).
  new_runs, running_runs = ([runs[i] for i in rng.permutation(len(runs))]
                            for runs in (new_runs, running_runs))
  got = jax.jit(lambda n, p, r: decompositions.keep_failed(
      n, p, tuple(new_runs), r, tuple(running_runs), slots))(
          jnp.asarray(new, jnp.float32), jnp.asarray(previous, jnp.float32),
          jnp.asarray(running, jnp.float32))
  np.testing.assert_array_equal(np.asarray(got), expect.astype(np.float32))


# ------------------------------------------------------------- eight devices

@functools.lru_cache(maxsize=None)
def _distributed_step(fraction, gradient_reduction, method="eigen"):
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction,
                         gradient_reduction=gradient_reduction)
  tx = kd.kfac(0.1, layers=_layers(), damping=1e-2, factor_update_every=1,
               inverse_update_every=2, distribution=dist, method=method)
  state = kd.shard_state(tx.init(_params()), mesh)
  specs = kd.partition_specs(state)

  def step(params, state, x, y, grad_device, stat_device):
    """Device `grad_device` (`stat_device`) sees a NaN in its local gradients
    (statistics); -1: none."""
    me = lax.axis_index("data")
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    grads, stats = _poison(grads, stats, jnp.where(me == grad_device, jnp.nan, 0.0),
                           jnp.where(me == stat_device, jnp.nan, 0.0))
    if gradient_reduction == "none":         # the caller averages the gradients
      grads = lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, updates

  step = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data"), P(), P()),
      out_specs=(P(), specs, P())))
  return tx, mesh, state, step


# HYBRID (m = 2 of 8: second-order sharded over 4 groups, replicated in pairs)
# is the general case; MEM-OPT and COMM-OPT are its ends. Local gradients
# ("reduce_scatter", "all_reduce") need the devices' verdicts psum'd; averaged
# ones ("none") do not.
FRACTIONS = [pytest.param(1 / 4, "reduce_scatter", id="HYBRID-reduce_scatter"),
             pytest.param(1 / 8, "none", id="MEM-OPT-none", marks=pytest.mark.slow),
             pytest.param(1.0, "all_reduce", id="COMM-OPT-all_reduce",
                          marks=pytest.mark.slow)]


@pytest.mark.parametrize("fraction,gradient_reduction", FRACTIONS)
def test_one_device_fault_skips_on_all_devices(fraction, gradient_reduction):
  """A NaN seen by one device only (its local gradients, or its local
  statistics) skips the step on every device: all state leaves unchanged
  but `skipped`, zero updates, and the run continues as if it never happened."""
  _, _, state0, step = _distributed_step(fraction, gradient_reduction)
  params0 = _params()
  clean_p, clean_s, p, s = params0, state0, params0, state0
  for i in range(4):
    clean_p, clean_s, _ = step(clean_p, clean_s, *_batch(i), -1, -1)
    if i == 2:
      for n, (grad_device, stat_device) in enumerate(((3, -1), (-1, 5))):
        new_p, new_s, updates = step(p, s, *_batch(i), grad_device, stat_device)
        assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
        assert_bitwise(new_p, p, "params after a skipped step")
        assert _skipped(new_s) == [n + 1]
        assert_bitwise(_without_skipped(new_s), _without_skipped(s), "skipped step")
        s = new_s
    p, s, _ = step(p, s, *_batch(i), -1, -1)
  assert _skipped(s) == [2]
  assert_bitwise(p, clean_p, "params")
  assert_bitwise(_without_skipped(s), clean_s, "state")


@pytest.mark.parametrize("fraction,gradient_reduction,narrow", [
    pytest.param(1 / 4, "reduce_scatter", False, id="HYBRID-reduce_scatter"),
    pytest.param(1 / 8, "none", False, id="MEM-OPT-none", marks=pytest.mark.slow),
    pytest.param(1.0, "all_reduce", False, id="COMM-OPT-all_reduce"),
    pytest.param(1 / 2, "reduce_scatter", False, id="HYBRID-rows-shared",
                 marks=pytest.mark.slow),
    pytest.param(1 / 2, "reduce_scatter", True, id="HYBRID-narrow-rows")])
def test_failed_decomposition_on_its_owner_keeps_previous(monkeypatch, fraction,
                                                          gradient_reduction, narrow):
  """A non-finite running factor keeps its previous second-order state on
  its owner, every other factor updates. MEM-OPT's devices own two factors
  each, in branches of different layouts: reading another branch's slot
  table fails it. COMM-OPT's owners share the replicated array's row, and
  HYBRID's groups of four theirs: an owner reads its previous segment back
  from its slot's column; `narrow`: and from its row, in rows of `1.5·L₂`
  (`layout.row_width` past int32)."""
  build = _distributed_step
  if narrow:                                   # a layout of its own, not the cached one
    helpers.narrow_second_rows(monkeypatch)
    build = _distributed_step.__wrapped__
  _, mesh, state0, step = build(fraction, gradient_reduction)
  params = _params()
  p, s, _ = step(params, state0, *_batch(0), -1, -1)
  p, s, _ = step(p, s, *_batch(1), -1, -1)           # count 2 is an inverse step
  _, clean, _ = step(p, s, *_batch(2), -1, -1)
  lay = find_states(s)[0].layout
  assert len({pl.owner for plan in lay.plans for _, pl in plan.places}) > 1
  assert fraction not in (1.0, 1 / 2) or any(column for _, column in lay.second_slots)
  assert (lay.second_rows > 1) == narrow
  # Every factor in turn, so every decomposition branch's slot tables are read
  # (`decompositions._slot_tables`: `keep_failed` runs after the switch).
  assert len(set(lay.decomposition_branches)) > 1
  for plan in lay.plans:
    for which, _ in plan.places:
      bad = kd.shard_state(_poison_factor(s, plan.layer.name, which), mesh)
      _, after, updates = step(p, bad, *_batch(2), -1, -1)
      assert _skipped(after) == [0]
      assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
      _check_kept(s, after, clean, {(plan.layer.name, which.upper())})


@pytest.mark.parametrize("fraction,gradient_reduction", [
    pytest.param(1 / 4, "reduce_scatter", id="HYBRID"),
    pytest.param(1.0, "all_reduce", id="COMM-OPT", marks=pytest.mark.slow)])
def test_failed_cholesky_keeps_its_layers_inverses_on_other_owners(fraction,
                                                                   gradient_reduction):
  """method="inverse", a layer's A and G decomposed on different devices: an
  indefinite running A (its Cholesky fails) keeps the previous inverses of
  both, on their owners (the devices' failures are gathered)."""
  _, mesh, state0, step = _distributed_step(fraction, gradient_reduction, "inverse")
  params = _params()
  p, s, _ = step(params, state0, *_batch(0), -1, -1)
  p, s, _ = step(p, s, *_batch(1), -1, -1)           # count 2 is an inverse step
  _, clean, _ = step(p, s, *_batch(2), -1, -1)
  split = [plan.layer.name for plan in find_states(s)[0].layout.plans
           if plan.a is not None and plan.a.owner != plan.g.owner]
  assert split
  bad = kd.shard_state(_poison_factor(s, split[0], "a", -1e6), mesh)
  _, after, updates = step(p, bad, *_batch(2), -1, -1)
  assert _skipped(after) == [0]
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
  _check_kept(s, after, clean, {(split[0], "A"), (split[0], "G")})


# ------------------------------------------------------------ clear errors

def test_configuration_errors_name_the_layer():
  layers, params = _layers(), _params()
  x, y = _batch(0)
  _, grads, stats = GRAD_FN(params, x, y)
  tx = kd.scale_by_kfac(layers)
  state = tx.init(params)
  # A skip pattern that matches no tagged layer.
  with pytest.raises(ValueError, match=r"'\^nothing' matches no tagged layer"):
    kd.scale_by_kfac(layers, skip=("^nothing",)).init(params)
  # A tagged layer's parameters missing from the tree given to init / update.
  without = {k: v for k, v in params.items() if k != "l1"}
  with pytest.raises(ValueError, match="'l1'.*'l1/kernel' is not in the tree"):
    tx.init(without)
  with pytest.raises(ValueError, match="'l1'.*'l1/kernel' is missing from the updates"):
    tx.update({k: v for k, v in grads.items() if k != "l1"}, state, kfac_stats=stats)
  # Shapes: parameters at init, updates, statistics.
  with pytest.raises(ValueError, match="'out'.*'out/kernel' has shape"):
    tx.init(dict(params, out={"kernel": jnp.zeros((4, 4))}))
  with pytest.raises(ValueError, match="'l0'.*update of 'l0/bias' has shape"):
    tx.update(dict(grads, l0=dict(grads["l0"], bias=jnp.zeros(3))), state,
              kfac_stats=stats)
  with pytest.raises(ValueError, match="G of layer 'l1' has shape"):
    tx.update(grads, state, kfac_stats=dict(stats, l1=dict(stats["l1"], G=jnp.eye(4))))
  # Statistics missing on a factor step: all of them, a layer's, one factor's.
  with pytest.raises(ValueError, match="needs the curvature statistics on a factor step"):
    tx.update(grads, state)
  with pytest.raises(ValueError, match="no statistics for tagged layer 'ln'"):
    tx.update(grads, state, kfac_stats={k: v for k, v in stats.items() if k != "ln"})
  with pytest.raises(ValueError, match=r"kfac_stats\['out'\] has no statistic 'A'"):
    tx.update(grads, state, kfac_stats=dict(stats, out={"G": stats["out"]["G"]}))
  with pytest.raises(ValueError, match="under jit"):
    jax.jit(lambda g, s: tx.update(g, s))(grads, state)


def test_statistics_may_be_omitted_on_a_known_non_factor_step():
  layers, params = _layers(), _params()
  tx = kd.scale_by_kfac(layers, factor_update_every=2)
  _, grads, stats = GRAD_FN(params, *_batch(0))
  _, state = tx.update(grads, tx.init(params), kfac_stats=stats)
  assert not bool(state.update_factors)
  _, grads, stats = GRAD_FN(params, *_batch(1), opt_state=state)   # zeros: not computed
  with_stats = tx.update(grads, state, kfac_stats=stats)
  without = tx.update(grads, state)
  # Eagerly, with statistics the update runs compiled, without them op by op
  # (only the concrete state says they are not needed): equal to float32 rounding.
  helpers.assert_trees_equal(with_stats, without, rtol=2e-5)


def test_distribution_errors():
  """The strategy must fit the mesh, and update must run where it says."""
  layers, params = _layers(), _params()
  mesh = helpers.data_mesh(8)
  with pytest.raises(ValueError, match="gradient workers per layer"):
    kd.Distribution(mesh, grad_worker_fraction=3 / 8)
  with pytest.raises(ValueError, match="'model' is not an axis"):
    kd.Distribution(mesh, axis="model")
  dist = kd.Distribution(mesh, grad_worker_fraction=1 / 8)
  tx = kd.scale_by_kfac(layers, distribution=dist)
  state = tx.init(params)
  x, y = _batch(0)
  _, grads, stats = GRAD_FN(params, x, y)
  # Outside shard_map.
  with pytest.raises(ValueError, match="inside jax.shard_map over that axis"):
    tx.update(grads, state, kfac_stats=stats)

  def run(tx, state, mesh, specs):
    f = jax.shard_map(lambda g, s, st: tx.update(g, s, kfac_stats=st)[1], mesh=mesh,
                      in_specs=(P(), specs, P()), out_specs=specs)
    return jax.eval_shape(f, grads, state, stats)

  specs = kd.partition_specs(state)
  run(tx, state, mesh, specs)                                   # fine
  # The state of another distribution (here: one device).
  single = kd.scale_by_kfac(layers).init(params)
  with pytest.raises(ValueError, match="laid out for another distribution.*convert_state"):
    run(tx, single, mesh, kd.partition_specs(single))
  # shard_map over a mesh of another size than the Distribution's.
  mesh4 = helpers.data_mesh(4)
  with pytest.raises(ValueError, match="has 4 devices, but the Distribution's mesh has 8"):
    run(tx, state, mesh4, specs)
  # in_specs that do not shard the factors.
  replicated = jax.tree.map(lambda _: P(), specs)
  with pytest.raises(ValueError, match="partition_specs"):
    run(tx, state, mesh, replicated)


def test_verdict_is_computed_once_without_a_gpu_conditional():
  """`computed_once` keeps the verdict one value: a `lax.cond` on CPU, an
  optimization barrier elsewhere (a GPU conditional is a host round trip)."""
  from kfac_jax_dist.core import faults
  traced = jax.jit(faults.computed_once).trace(jnp.asarray(True))
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  # The platform's branch alone is lowered (behind a constant selector that
  # XLA folds away); CPU's is a conditional, CUDA's a barrier.
  assert "optimization_barrier" in cuda and "optimization_barrier" not in cpu
  compiled = jax.jit(faults.computed_once).lower(jnp.asarray(True)).compile().as_text()
  assert compiled.count(" conditional(") == (1 if jax.default_backend() == "cpu" else 0)
  assert bool(jax.jit(faults.computed_once)(jnp.asarray(False))) is False


def test_all_finite_against_numpy():
  """`all_finite` (one `Σ|x|·0` reduction per array) is numpy's `isfinite().all()`
  over every inexact array: huge finite values (whose sum would overflow) pass,
  any NaN or ±∞ fails, in float32, bfloat16 and complex; integers are ignored."""
  from kfac_jax_dist.core import faults
  big = np.float32(3e38)
  cases = [
      [np.ones(3, np.float32), np.array([big, big, -big], np.float32)],
      [np.array([1.0, np.inf], np.float32)],
      [np.array([-np.inf], np.float32), np.ones(2, np.float32)],
      [np.ones((2, 2), np.float32), np.array([np.nan], np.float32)],
      [np.array([1 + 1j * np.inf], np.complex64)],
      [np.array([1 + 2j], np.complex64)],
      [np.arange(3)],
      [],
  ]
  for arrays in cases:
    want = all(np.isfinite(a).all() for a in arrays if np.issubdtype(a.dtype, np.inexact))
    assert bool(jax.jit(faults.all_finite)(arrays)) == want, arrays
  overflowing = jnp.asarray([1e38, 1e38, 1e38], jnp.float32).astype(jnp.bfloat16)
  assert bool(jax.jit(faults.all_finite)([overflowing]))
  assert not bool(jax.jit(faults.all_finite)([overflowing * 1e10]))


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (2, 0), (3, 3, 3, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_pick_is_a_select_on_its_flag(shape, dtype):
  """`pick` (a select whose predicate varies along the innermost axis, so
  that LLVM does not unswitch the fused loop) returns either operand bit for
  bit, NaNs and infinities included, with a traced flag; a scalar operand
  broadcasts like `jnp.where`'s."""
  from kfac_jax_dist.core import faults
  rng = np.random.default_rng(len(shape))
  a = rng.normal(size=shape) * 1e3
  b = rng.normal(size=shape)
  if a.size and jnp.issubdtype(dtype, jnp.floating):
    a.flat[0], b.flat[-1] = np.nan, -np.inf
  a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
  pick = jax.jit(faults.pick)
  for flag, want in ((True, a), (False, b)):
    got = pick(jnp.asarray(flag), a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_bitwise(got, want, f"pick({flag})")
    zeros = jnp.zeros((), dtype)
    assert_bitwise(pick(jnp.asarray(flag), zeros, a),
                   jnp.broadcast_to(zeros, a.shape) if flag else a,
                   f"pick({flag}) against a scalar")
