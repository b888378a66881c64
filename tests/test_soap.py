"""SOAP (`kd.scale_by_soap`, shampoo/soap.py) against a NumPy reference written
from Vyas et al. 2024, Alg. 3 (float64, blocked and unblocked), on 8 CPU
devices (COMM-OPT, MEM-OPT, HYBRID-OPT, SP-NGD routing) against one, and its
fault policy and state conversion."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import kfac_jax_dist as kd

B1, B2, EPS, EVERY = 0.9, 0.95, 1e-8, 2
SHAPES = {"w": (8, 8), "cube": (4, 4, 4), "v": (6, 6), "slab": (4, 4, 6), "b": (5,)}
# SOAP depends on the basis chosen inside a degenerate eigenspace, so the
# reference must meet statistics that are full rank after one step: blocks
# whose every unfolding is at least as wide as it is tall ("slab" cut by 4
# gives 4x4x4 and 4x4x2 blocks: unfoldings 4x8 and 2x16).
CASES = {"blocked": (4, ("w", "cube", "b")), "uneven": (4, ("slab", "b")),
         "unblocked": (None, ("w", "cube", "v", "b"))}


pytestmark = pytest.mark.usefixtures("x64_module")


def _mode(x: np.ndarray, m: np.ndarray, axis: int) -> np.ndarray:
  """The mode-`axis` product `x ×_axis m` (`m` applied to that axis's index)."""
  return np.moveaxis(np.tensordot(m, x, axes=(1, axis)), 0, axis)


def _key(name: str, sl: tuple) -> tuple:
  return name, tuple((x.start, x.stop) for x in sl)


class NumpySoap:
  """Alg. 3 of the paper for each block of each parameter: the Adam step in
  the current eigenbases (`M` in the original coordinates, `V` in the rotated
  ones, bias corrections), then the statistics `L`, `R` (one per axis) and,
  every `every` steps, their eigenvectors with `V` permuted as the authors'
  code does (`_refresh`); the first step only measures the statistics (the
  authors' code skips it); a 1-D parameter is plain Adam."""

  def __init__(self, shapes: dict, block: int | None, every: int = EVERY):
    self.shapes, self.block, self.every, self.t = shapes, block, every, 0
    self.stats, self.bases, self.mu, self.nu = {}, {}, {}, {}
    for name, shape in shapes.items():
      self.mu[name], self.nu[name] = np.zeros(shape), np.zeros(shape)
      for sl in self._blocks(shape):
        key = _key(name, sl)
        self.stats[key] = [1e-30 * np.eye(x.stop - x.start) for x in sl
                           ] if len(shape) > 1 else []
        self.bases[key] = [np.eye(s.shape[0]) for s in self.stats[key]]

  def _blocks(self, shape):
    """Each block's slices: every axis cut into `block` long pieces and a
    shorter last one."""
    if len(shape) == 1 or self.block is None:
      return [tuple(slice(0, n) for n in shape)]
    cuts = [[slice(o, min(o + self.block, n)) for o in range(0, n, self.block)]
            for n in shape]
    return [tuple(c) for c in itertools.product(*cuts)]

  def step(self, grads: dict) -> dict:
    out, t = {}, self.t
    for name, shape in self.shapes.items():
      g = np.asarray(grads[name], np.float64)
      out[name] = np.zeros(shape) if t == 0 else self._adam(name, shape, g, t)
      for sl in self._blocks(shape) if len(shape) > 1 else []:
        gb, key = g[sl], _key(name, sl)
        for i in range(gb.ndim):
          unfolded = np.moveaxis(gb, i, 0).reshape(gb.shape[i], -1)
          self.stats[key][i] = B2 * self.stats[key][i] + (1 - B2) * unfolded @ unfolded.T
          if t % self.every == 0:
            self._refresh(name, sl, key, i)
    self.t += 1
    return out

  def _refresh(self, name, sl, key, i):
    """The authors' refresh (`get_orthogonal_matrix_QR`) with an exact
    eigendecomposition for its power iteration: the old eigenvectors sorted
    by their Rayleigh quotients under the new statistic, descending, `V`
    permuted with them along axis i, then the new eigenvectors, descending."""
    stat, old = self.stats[key][i], self.bases[key][i]
    order = np.argsort(-np.diag(old.T @ stat @ old), kind="stable")
    self.nu[name][sl] = np.take(self.nu[name][sl], order, axis=i)
    self.bases[key][i] = np.linalg.eigh(stat)[1][:, ::-1]

  def _adam(self, name, shape, g, t):
    bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
    self.mu[name] = B1 * self.mu[name] + (1 - B1) * g
    if len(shape) == 1:
      self.nu[name] = B2 * self.nu[name] + (1 - B2) * g ** 2
      return (self.mu[name] / bc1) / (np.sqrt(self.nu[name] / bc2) + EPS)
    direction = np.zeros(shape)
    for sl in self._blocks(shape):
      rot, mrot = g[sl], self.mu[name][sl]
      for i, q in enumerate(self.bases[_key(name, sl)]):
        rot, mrot = _mode(rot, q.T, i), _mode(mrot, q.T, i)
      self.nu[name][sl] = B2 * self.nu[name][sl] + (1 - B2) * rot ** 2
      n = (mrot / bc1) / (np.sqrt(self.nu[name][sl] / bc2) + EPS)
      for i, q in enumerate(self.bases[_key(name, sl)]):
        n = _mode(n, q, i)
      direction[sl] = n
    return direction


def _grads(rng, shapes=SHAPES):
  return {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}


def _params(shapes=SHAPES):
  return {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_five_steps_equal_the_numpy_reference(case):
  block, names = CASES[case]
  shapes = {k: SHAPES[k] for k in names}
  tx = kd.scale_by_soap(B1, B2, EPS, precondition_every=EVERY, block_size=block,
                        merge_small_dims=False)
  oracle = NumpySoap(shapes, block, EVERY)
  state, rng = tx.init(_params(shapes)), np.random.default_rng(0)
  update = jax.jit(tx.update)
  for step in range(6):            # count 0 (statistics only) and five updates
    grads = _grads(rng, shapes)
    got, state = update(grads, state)
    want = oracle.step(grads)
    for name in shapes:
      # normwise: max |got − want| ≤ 1e-10 · max |want| (see EPS)
      np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=0,
                                 atol=1e-10 * np.abs(want[name]).max(),
                                 err_msg=f"step {step}, {name}")
  assert int(state.count) == 6 and int(state.skipped) == 0


def test_bucket_arrays_read_soaps_statistics_and_eigenbases():
  """`shampoo.state.bucket_arrays` reads a SOAP state as a Shampoo one:
  every block's statistic of the NumPy reference, per bucket of its size,
  and orthonormal eigenbases of the statistics they were taken from."""
  from kfac_jax_dist.shampoo import state as shampoo_state
  shapes = {k: SHAPES[k] for k in ("w", "cube")}
  tx = kd.scale_by_soap(B1, B2, EPS, precondition_every=EVERY, block_size=4,
                        merge_small_dims=False)
  oracle, rng = NumpySoap(shapes, 4, EVERY), np.random.default_rng(1)
  state, update = tx.init(_params(shapes)), jax.jit(tx.update)
  for _ in range(3):              # bases refreshed at count 2, statistics since
    grads = _grads(rng, shapes)
    _, state = update(grads, state)
    oracle.step(grads)
  stats, bases = shampoo_state.bucket_arrays(state)
  got = np.concatenate(stats)
  want = np.stack([h for hs in oracle.stats.values() for h in hs])
  assert got.shape == want.shape
  for h in want:
    assert np.abs(got - h).max(axis=(1, 2)).min() <= 1e-12 * np.abs(h).max()
  for q in np.concatenate(bases):
    np.testing.assert_allclose(q.T @ q, np.eye(len(q)), atol=1e-12)


def test_soap_is_adamw_in_the_eigenbasis():
  """`kd.soap` = scale_by_soap, decoupled weight decay, −learning rate: after
  its first update (statistics only: zero direction, the weight decay alone)
  a parameter without a basis (1-D) moves exactly as under `optax.adamw`."""
  import optax
  shapes = {"b": (5,)}
  params = {"b": jnp.linspace(-1.0, 1.0, 5)}
  ours, ref = kd.soap(1e-2, B1, B2, EPS, 1e-2), optax.adamw(1e-2, B1, B2, EPS,
                                                            weight_decay=1e-2)
  s1, s2, rng = ours.init(params), ref.init(params), np.random.default_rng(1)
  u1, s1 = ours.update(_grads(rng, shapes), s1, params)
  np.testing.assert_allclose(np.asarray(u1["b"]), -1e-4 * np.asarray(params["b"]),
                             rtol=1e-12)
  for _ in range(3):
    g = _grads(rng, shapes)
    u1, s1 = ours.update(g, s1, params)
    u2, s2 = ref.update(g, s2, params)
    np.testing.assert_allclose(np.asarray(u1["b"]), np.asarray(u2["b"]), rtol=1e-12)


@pytest.mark.slow
def test_eight_devices_comm_opt_equal_one_device():
  """COMM-OPT (grad_worker_fraction=1): each eigenbasis decomposed by one
  owner and all-gathered; the updates equal the single-device run."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=1)
  options = dict(precondition_every=EVERY, block_size=4, merge_small_dims=False)
  single, tx = kd.scale_by_soap(**options), kd.scale_by_soap(distribution=dist, **options)
  state = kd.shard_state(tx.init(_params()), mesh)
  specs = kd.partition_specs(state)
  step = jax.jit(jax.shard_map(lambda g, s: tx.update(g, s), mesh=mesh,
                               in_specs=(P(), specs), out_specs=(P(), specs)))
  one, rng = single.init(_params()), np.random.default_rng(2)
  for i in range(4):
    grads = _grads(rng)
    got, state = step(grads, state)
    want, one = single.update(grads, one)
    helpers.assert_trees_equal(got, want, rtol=1e-10)
  moved = kd.convert_state(state, single.init(_params()))
  helpers.assert_trees_equal(dataclasses.replace(moved, layout=one.layout), one,
                             rtol=1e-10)


def test_non_finite_gradient_skips_the_step():
  tx = kd.soap(1e-2, precondition_every=EVERY, block_size=4)
  params, rng = _params(), np.random.default_rng(3)
  state = tx.init(params)
  grads = [_grads(rng) for _ in range(3)]
  update = jax.jit(tx.update)   # one program (eager, each op compiles alone: ~20 s)
  _, state = update(grads[0], state, params)
  bad = dict(grads[1], w=grads[1]["w"].at[0, 0].set(jnp.nan))
  updates, skipped = update(bad, state, params)
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(updates))
  soap_state = [s for s in jax.tree.leaves(
      skipped, is_leaf=lambda x: isinstance(x, kd.ScaleBySoapState))
      if isinstance(s, kd.ScaleBySoapState)][0]
  assert int(soap_state.skipped) == 1
  old = jax.tree.leaves(state)
  new = jax.tree.leaves(skipped)
  assert sum(not np.array_equal(a, b) for a, b in zip(old, new)) == 1   # `skipped` only


def test_float16_statistics_keep_adams_moments_in_float32():
  """`statistics_dtype=float16` holds the statistics and eigenbases in float16
  and the blocks' Adam moments in float32 (in float16, `eps=1e-8` is 0: a
  zero rotated gradient, of an unused layer or a dead unit, made 0/0 and
  skipped every step). Five steps with a layer whose gradient is zero step
  every time, within float16's precision of the float32 statistics' run."""
  rng = np.random.default_rng(0)
  params = {"used": jnp.zeros((8, 8)), "unused": jnp.zeros((8, 8))}
  grads = [{"used": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
            "unused": jnp.zeros((8, 8))} for _ in range(5)]
  runs = {}
  for dtype in (jnp.float32, jnp.float16):
    tx = kd.scale_by_soap(statistics_dtype=dtype, merge_small_dims=False)
    state, update = tx.init(params), jax.jit(tx.update)
    for g in grads:
      updates, state = update(g, state)
    assert (state.block_mu[0].dtype, state.statistics[0].dtype) == (jnp.float32, dtype)
    assert (int(state.count), int(state.skipped)) == (5, 0)
    runs[dtype] = updates["used"]
  np.testing.assert_allclose(runs[jnp.float16], runs[jnp.float32], rtol=0.05, atol=0.02)


@pytest.mark.parametrize("kwargs,message", [
    (dict(b1=1.0), "b1"), (dict(precondition_every=0), "precondition_every"),
    (dict(shampoo_beta=0.0), "shampoo_beta"), (dict(block_size=0), "block_size"),
    (dict(b2=0.0), "b2=0 with shampoo_beta=None .* pass shampoo_beta"),
    (dict(eps=0.0), "eps")])
def test_bad_settings_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    kd.scale_by_soap(**kwargs)
  kd.scale_by_soap(b2=0.0, shampoo_beta=0.5)      # Adam's b2 = 0 itself is allowed


def test_precondition_every_takes_a_schedule():
  """A schedule equal to 2 everywhere gives the run of the integer 2."""
  shapes = {k: SHAPES[k] for k in ("w", "b")}
  runs = []
  for every in (2, lambda count: 2):
    tx = kd.scale_by_soap(precondition_every=every, block_size=4)
    state, rng, out = tx.init(_params(shapes)), np.random.default_rng(4), []
    for _ in range(3):
      u, state = jax.jit(tx.update)(_grads(rng, shapes), state)
      out.append(u)
    runs.append(out)
  helpers.assert_trees_equal(runs[0], runs[1], rtol=1e-14)


def test_injected_soap_traces_with_its_default_shapes():
  """`optax.inject_hyperparams(kd.soap)` leaves the shape options' defaults
  static: the checkpoint template `jax.eval_shape(tx.init, params)`, a jitted
  init and jitted updates need no `static_args`."""
  params, grads = _params(), _grads(np.random.default_rng(3))
  for make, args in ((kd.soap, (3e-3,)), (kd.scale_by_soap, ())):
    helpers.assert_injected_traces(optax.inject_hyperparams(make)(*args), params, grads,
                                   kd.ScaleBySoapState, "max_preconditioner_dim")


def test_a_donating_step_runs():
  """The state's buffers are distinct (`M` and `V` start as separate zeros), so
  a step that donates the state compiles and runs."""
  tx = kd.soap(1e-2, block_size=4)
  params = _params({"w": (8, 8), "b": (5,)})
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(1,))
  _, state = step(_grads(np.random.default_rng(5), {"w": (8, 8), "b": (5,)}), state, params)
  assert int(jax.tree.leaves(state)[0]) >= 0


def test_conditionals_do_not_grow_with_the_parameters():
  """The moments' rotation into refreshed eigenbases is one conditional for
  every block of the step, not one per parameter (a conditional is a host
  round trip on a GPU; before, a 12-block GPT compiled 113 of them)."""
  def conditionals(shapes: dict) -> int:
    tx = kd.soap(1e-2, block_size=4, precondition_every=3)
    params = _params(shapes)
    grads = _grads(np.random.default_rng(6), shapes)
    text = jax.jit(tx.update).lower(grads, tx.init(params), params).compile().as_text()
    return text.count(" conditional(")
  few = conditionals({"w": (8, 8), "b": (5,)})
  many = conditionals({f"w{i}": (8, 8) for i in range(6)} | {"cube": (4, 4, 4), "b": (5,)})
  assert many == few, (few, many)


SHARDED = {"w": (8, 8), "x": (12, 12), "cube": (4, 4, 4), "b": (5,)}


@pytest.mark.parametrize("fraction,reduction", [
    (1 / 8, "none"), pytest.param(1 / 4, "all_reduce", marks=pytest.mark.slow),
    pytest.param(1 / 2, "none", marks=pytest.mark.slow), (1 / 8, "reduce_scatter")],
    ids=["mem_opt", "hybrid_2", "hybrid_4", "sp_ngd"])
def test_owner_groups_equal_one_device(fraction, reduction):
  """MEM-OPT / HYBRID-OPT (and SP-NGD's gradient routing): each owner group
  keeps its blocks' statistics, eigenbases and moments; the updates equal the
  single-device run, and the state converts to the single-device one."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction, gradient_reduction=reduction)
  options = dict(precondition_every=EVERY, block_size=4)
  single, tx = kd.scale_by_soap(**options), kd.scale_by_soap(distribution=dist, **options)
  state = tx.init(_params(SHARDED))
  assert not state.layout.roots_replicated and state.block_mu[0].shape[0] % 8 == 0
  specs = kd.partition_specs(state)
  state = kd.shard_state(state, mesh)
  local = reduction != "none"

  def update(g, s):
    if local:
      g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, s)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data") if local else P(), specs),
                               out_specs=(P(), specs)))
  one, rng = single.init(_params(SHARDED)), np.random.default_rng(6)
  single_update = jax.jit(single.update)
  for i in range(5):
    g = {k: jnp.asarray(rng.normal(size=(8,) + s)) for k, s in SHARDED.items()}
    mean = jax.tree.map(lambda x: x.mean(0), g)
    got, state = step(g if local else mean, state)
    want, one = single_update(mean, one)
    helpers.assert_trees_equal(got, want, rtol=1e-9)
  moved = kd.convert_state(state, single.init(_params(SHARDED)))
  helpers.assert_trees_equal(dataclasses.replace(moved, layout=one.layout), one, rtol=1e-9)
  back = kd.convert_state(one, tx.init(_params(SHARDED)))
  helpers.assert_trees_equal(jax.tree.leaves(back), jax.tree.leaves(state), rtol=1e-9)


STACKED = {"sw": (2, 8, 8), "scube": (2, 2, 4, 4, 4), "sb": (3, 5), "w": (8, 8)}
STACK_AXES = {"sw": 1, "scube": 2, "sb": 1}


@pytest.mark.parametrize("fraction", [None, 1 / 8], ids=["one_device", "mem_opt"])
def test_stacked_layers_equal_the_unrolled_reference(fraction):
  """`stacked=`: every layer of a stacked parameter has its own statistics,
  eigenbases and moments: the NumPy reference on the unrolled layers, on one
  device and under MEM-OPT (whose state converts to one device's)."""
  options = dict(precondition_every=EVERY, block_size=4, merge_small_dims=False,
                 stacked={"^sw$": 1, "^scube$": 2, "^sb$": 1})
  dist = None if fraction is None else kd.Distribution(
      helpers.data_mesh(8), grad_worker_fraction=fraction)
  tx = kd.scale_by_soap(B1, B2, EPS, distribution=dist, **options)
  state, step = tx.init(_params(STACKED)), jax.jit(tx.update)
  if dist is not None:
    specs = kd.partition_specs(state)
    state = kd.shard_state(state, dist.mesh)
    step = jax.jit(jax.shard_map(tx.update, mesh=dist.mesh, in_specs=(P(), specs),
                                 out_specs=(P(), specs)))
  unrolled = {k: np.shape(v) for k, v in helpers.unstacked(
      {k: np.zeros(s) for k, s in STACKED.items()}, STACK_AXES).items()}
  oracle, rng = NumpySoap(unrolled, 4, EVERY), np.random.default_rng(4)
  for i in range(5):
    grads = _grads(rng, STACKED)
    got, state = step(grads, state)
    want = oracle.step(helpers.unstacked(grads, STACK_AXES))
    got = helpers.unstacked({k: np.asarray(v) for k, v in got.items()}, STACK_AXES)
    for name in want:
      np.testing.assert_allclose(got[name], want[name], rtol=0,
                                 atol=1e-10 * max(np.abs(want[name]).max(), 1.0),
                                 err_msg=f"step {i}, {name}")
  if dist is not None:
    single = kd.scale_by_soap(B1, B2, EPS, **options)
    moved = kd.convert_state(state, single.init(_params(STACKED)))
    want, _ = single.update(grads, moved)
    got, _ = step(grads, state)
    helpers.assert_trees_equal(got, want, rtol=1e-9)


def test_checkpoint_round_trip(tmp_path):
  tx = kd.soap(1e-2, block_size=4)
  params, rng = _params(SHARDED), np.random.default_rng(8)
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update(_grads(rng, SHARDED), state, params)
  kd.save_checkpoint(tmp_path / "soap", state)
  restored = kd.restore_checkpoint(tmp_path / "soap", tx.init(params))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
