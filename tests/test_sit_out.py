"""Layers that may sit out a pass: a `lax.cond` / `lax.switch` branch (a task's
head chosen per batch, a mixture of experts choosing one per step).

A layer whose branch does not run gets no statistics; before, it got zeros
(`A = 0`, `G = 0`) that the running average took in, and inside `shard_map`
its `A` was the mean of the devices' means. Here each such layer keeps its own
running weight and averages only the passes it ran in, over every position
it saw on any device. Oracles: numpy running averages of `x xᵀ` and `g gᵀ`
from explicit per-example inputs and output gradients, and the damped
Kronecker preconditioner solved densely, all in float64.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd
from kfac_jax_dist.kfac import correction as correction_lib

import helpers

pytestmark = pytest.mark.usefixtures("x64_module")

D_IN, D_H, D_OUT = 3, 4, 2
DECAY, GAMMA = 0.9, 1e-2


def _params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  layer = lambda i, o: {"kernel": jnp.asarray(rng.normal(size=(i, o)) / np.sqrt(i)),
                        "bias": jnp.asarray(rng.normal(size=(o,)) / 4)}
  return {"s": layer(D_IN, D_H), "a": layer(D_H, D_OUT), "b": layer(D_H, D_OUT)}


def _loss(p: dict, x: jax.Array, y: jax.Array, route: jax.Array) -> jax.Array:
  """A shared layer `s`, then head `a` where `route[0]`, else head `b`."""
  h = jnp.tanh(kd.tags.dense(x, p["s"]["kernel"], p["s"]["bias"]))
  out = lax.cond(route[0], lambda h: kd.tags.dense(h, p["a"]["kernel"], p["a"]["bias"]),
                 lambda h: kd.tags.dense(h, p["b"]["kernel"], p["b"]["bias"]), h)
  return kd.losses.squared_error(out, y)


def _batch(step: int, n: int) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(100 + step)
  return jnp.asarray(rng.normal(size=(n, D_IN))), jnp.asarray(rng.normal(size=(n, D_OUT)))


def _with_one(x: np.ndarray) -> np.ndarray:
  return np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)


def _oracle_batch(p: dict, x, y, to_a: np.ndarray) -> dict:
  """Per layer: `(A, G, ∇)` of the whole batch (the loss a mean over its n
  examples; example i through head a where `to_a[i]`), or None for a head no
  example went through. `A = mean over the layer's positions of a aᵀ`, `G =
  (1/n) Σ g gᵀ`, g the per-example loss's output gradient."""
  p = jax.tree.map(helpers.f64, p)
  x, y, n = helpers.f64(x), helpers.f64(y), x.shape[0]
  h = np.tanh(x @ p["s"]["kernel"] + p["s"]["bias"])
  out = np.where(to_a[:, None], h @ p["a"]["kernel"] + p["a"]["bias"],
                 h @ p["b"]["kernel"] + p["b"]["bias"])
  g_out = out - y                                    # ½‖out − y‖²'s gradient
  back = np.where(to_a[:, None], g_out @ p["a"]["kernel"].T, g_out @ p["b"]["kernel"].T)
  g_s = back * (1 - h ** 2)
  result = {"s": (_with_one(x).T @ _with_one(x) / n, g_s.T @ g_s / n,
                  _with_one(x).T @ g_s / n)}
  for name, rows in (("a", to_a), ("b", ~to_a)):
    if not rows.any():
      result[name] = None
      continue
    a_in, g = _with_one(h[rows]), g_out[rows]
    result[name] = (a_in.T @ a_in / rows.sum(), g.T @ g / n, a_in.T @ g / n)
  return result


class _Oracle:
  """Running factors per layer: identity and weight 0 at the start, a layer
  that sat out a step left as it was."""

  def __init__(self):
    eye = lambda d: np.eye(d)
    self.factors = {"s": [eye(D_IN + 1), eye(D_H)], "a": [eye(D_H + 1), eye(D_OUT)],
                    "b": [eye(D_H + 1), eye(D_OUT)]}
    self.weight = {name: 0.0 for name in self.factors}

  def step(self, batch: dict) -> dict:
    """Mixes in `batch` (`_oracle_batch`); returns each layer's preconditioned
    gradient `(A ⊗ G + γI)⁻¹ ∇` (0 for a layer that sat out)."""
    updates = {}
    for name, stats in batch.items():
      a, g = self.factors[name]
      if stats is None:
        updates[name] = np.zeros((a.shape[0], g.shape[0]))
        continue
      w = self.weight[name]
      new_w = DECAY * w + 1 - DECAY
      a = (DECAY * w * a + (1 - DECAY) * stats[0]) / new_w
      g = (DECAY * w * g + (1 - DECAY) * stats[1]) / new_w
      self.factors[name], self.weight[name] = [a, g], new_w
      grad = stats[2]
      solved = np.linalg.solve(np.kron(a, g) + GAMMA * np.eye(a.shape[0] * g.shape[0]),
                               grad.reshape(-1))
      updates[name] = solved.reshape(grad.shape)
    return updates


def _as_matrix(update: dict) -> np.ndarray:
  return np.concatenate([helpers.f64(update["kernel"]), helpers.f64(update["bias"])[None]])


def _check(state, updates, oracle: _Oracle, updates_oracle: dict, what: str) -> None:
  got = kd.running_factors(state)
  for name in "sab":
    for k, key in enumerate("AG"):
      np.testing.assert_allclose(helpers.f64(got[name][key]), oracle.factors[name][k],
                                 rtol=1e-10, atol=1e-12, err_msg=f"{what}: {name} {key}")
    np.testing.assert_allclose(_as_matrix(updates[name]), updates_oracle[name], rtol=1e-8,
                               atol=1e-12, err_msg=f"{what}: update of {name}")


ROUTES = (True, False, False, True)      # b sits out the first and last steps


def test_discovery_marks_the_layers_that_may_sit_out():
  """cond, switch and while-loop bodies mark their layers; a scan, a vmap,
  jax.checkpoint and a layer also run outside any branch do not."""
  w = jnp.ones((3, 3))

  def loss(p, x, y, flag):
    h = kd.tags.dense(x, p["plain"])
    h = lax.cond(flag, lambda h: kd.tags.dense(h, p["cond"]), lambda h: h, h)
    h = lax.switch(flag.astype(int), [lambda h: kd.tags.dense(h, p["switch"]),
                                      lambda h: kd.tags.dense(h, p["both"])], h)
    h = kd.tags.dense(h, p["both"])            # also outside: always runs
    h = lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, kd.tags.dense(
        c[1], p["while"])), (0, h))[1]
    h, _ = lax.scan(lambda c, _: (kd.tags.dense(c, p["scan"]), None), h, None, length=2)
    h = jax.vmap(lambda r: kd.tags.dense(r, p["vmap"]))(h)
    h = jax.checkpoint(lambda h: kd.tags.dense(h, p["remat"]))(h)
    return kd.losses.squared_error(h, y)
  names = ("plain", "cond", "switch", "both", "while", "scan", "vmap", "remat")
  params = {name: w for name in names}
  layers = kd.value_and_grad(loss).discover(params, jnp.ones((2, 3)), jnp.ones((2, 3)),
                                            jnp.asarray(True))
  marked = {layer.name for layer in layers if layer.may_sit_out}
  assert marked == {"cond", "switch", "while"}, marked


def test_layers_that_always_run_change_nothing():
  """A model without such layers (a scan repeats its layer, but runs it)
  returns no positions and its state has no running weights of its own: its
  state, checkpoints and compiled step are those of before."""
  def loss(p, x, y):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(kd.tags.dense(h, p["w"])), None), x, None,
                    length=2)
    return kd.losses.squared_error(h, y)
  params, x = {"w": jnp.eye(3)}, jnp.ones((2, 3))
  grad_fn = kd.value_and_grad(loss)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, x))
  state = tx.init(params)
  assert state.marked_weight is None
  assert set(grad_fn(params, x, x, opt_state=state)[2]["w"]) == {"A", "G"}


@pytest.mark.parametrize("options", [{}, {"stale_threshold": 0.0}], ids=["plain", "stale"])
def test_one_device_head_that_sits_out_keeps_its_factors(options):
  """Head b sits out steps 0 and 3: its factors are the running average of
  steps 1-2 only (identity until it first runs), head a's of steps 0 and 3,
  and each step's update is the damped Kronecker preconditioner of those
  factors (0 for the head that did not run). With stale statistics
  (threshold 0: every factor due at every step) a due factor of a head that
  did not run stays due and unchanged: the same factors and updates."""
  params = _params()
  grad_fn = kd.value_and_grad(_loss)
  x, y = _batch(0, 8)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y, jnp.asarray([True])),
                        damping=GAMMA, factor_decay=DECAY, factor_dtype=jnp.float64,
                        **options)

  @jax.jit
  def step(state, x, y, route):
    _, grads, stats = grad_fn(params, x, y, route, opt_state=state)
    return tx.update(grads, state, params, kfac_stats=stats)

  state, oracle = tx.init(params), _Oracle()
  for t, to_a in enumerate(ROUTES):
    x, y = _batch(t, 8)
    updates, state = step(state, x, y, jnp.asarray([to_a]))
    want = oracle.step(_oracle_batch(params, x, y, np.full(8, to_a)))
    _check(state, updates, oracle, want, f"step {t}")


def test_accumulated_micro_batches_weigh_a_by_positions():
  """`accumulate` over two micro-batches, one through each head: each head's
  `A` is the mean over its own positions (not half of it), `G` the whole
  batch's, as one pass routing the examples so."""
  params = _params()
  x, y = _batch(0, 8)
  _, _, stats = kd.value_and_grad(_loss).accumulate(params, x, y, jnp.asarray([True, False]),
                                                    micro_batches=2)
  want = _oracle_batch(params, x, y, np.arange(8) < 4)
  for name in "sab":
    for k, key in enumerate("AG"):
      np.testing.assert_allclose(helpers.f64(stats[name][key]), want[name][k], rtol=1e-10,
                                 atol=1e-14, err_msg=f"{name} {key}")


@pytest.mark.parametrize("where", ["accumulate", "shard_map"])
def test_a_shared_layer_run_again_in_a_branch_weighs_a_by_positions(where):
  """A shared layer applied once always and once more inside `lax.cond` (a
  layer-dropped or halting shared block): its number of positions differs
  between micro-batches or devices (2 or 4 here), and its `A` is the mean
  over every position it saw, `Σ_s N_s A_s / Σ_s N_s` (float64 brute force
  over the positions that ran), as where both runs are in branches. (It was
  the plain mean of the slices' `A_s`, 0.1 off.)"""
  with jax.enable_x64(True):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w": jax.random.normal(k[0], (4, 4)) / 2, "b": jnp.full((4,), 0.1),
         "h": jax.random.normal(k[1], (4, 3))}
    signs = jnp.repeat(jnp.array([1.0, -1.0] * 4), 2)[:, None]   # slices alternate
    x = jax.random.normal(k[2], (16, 4)) + 3.0 * signs
    y = jax.random.randint(k[3], (16,), 0, 3)

    def loss(p, x, y):
      h = jnp.tanh(kd.tags.dense(x, p["w"], p["b"], name="fc"))
      h = lax.cond(x.sum() > 0, lambda h: jnp.tanh(kd.tags.dense(h, p["w"], p["b"],
                                                                 name="fc")),
                   lambda h: h, h)
      return kd.losses.softmax_cross_entropy(h @ p["h"], y)
    grad_fn = kd.value_and_grad(loss)
    assert [layer.partly_sits_out for layer in grad_fn.discover(p, x, y)] == [True]
    if where == "accumulate":
      stats = jax.jit(lambda p, x, y: grad_fn.accumulate(p, x, y, micro_batches=8))(p, x, y)[2]
      got = stats["fc"]["A"]
    else:                # one step's running A (the first batch's) under COMM-OPT
      mesh = helpers.data_mesh(8)
      tx = kd.scale_by_kfac(layers=grad_fn.discover(p, x, y), damping=GAMMA,
                            factor_dtype=jnp.float64, distribution=kd.Distribution(
                                mesh, gradient_reduction="all_reduce"))
      state = kd.shard_state(tx.init(p), mesh)
      specs = kd.partition_specs(state)

      def step(state, x, y):
        _, grads, stats = grad_fn(p, x, y, opt_state=state)
        return tx.update(grads, state, p, kfac_stats=stats)[1]
      state = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                                    out_specs=specs))(state, x, y)
      got = kd.running_factors(state)["fc"]["A"]
    rows = []
    for s in range(8):
      xs = helpers.f64(x[2 * s:2 * s + 2])
      runs = [xs] + ([np.tanh(xs @ helpers.f64(p["w"]) + helpers.f64(p["b"]))]
                     if xs.sum() > 0 else [])
      rows += [np.concatenate([r, np.ones((len(r), 1))], 1) for r in runs]
    rows = np.concatenate(rows)
    np.testing.assert_allclose(helpers.f64(got), rows.T @ rows / len(rows), rtol=1e-10)


def _scaling(state, name: str) -> np.ndarray:
  """EK-FAC's running scaling `s` of a layer, `[d_A, d_G]`."""
  for plan, offset in correction_lib.corrected_plans(state.layout):
    if plan.layer.name == name:
      a, g = plan.layer.a_dim, plan.layer.g_dim
      return helpers.f64(state.correction.scaling[offset:offset + a * g]).reshape(a, g)
  raise KeyError(name)


def test_ekfac_scaling_of_a_layer_that_sat_out_is_kept():
  """EK-FAC (eigenbases from step 0 only): head b's scaling is the running
  average of `S = (1/n) Σ_u (Q_Aᵀ a_u)² ((Q_Gᵀ g_u)²)ᵀ` over the steps it ran
  (1-2), and step 3, where it sat out, leaves it as it was."""
  params = _params()
  grad_fn = kd.value_and_grad(_loss)
  x, y = _batch(0, 8)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y, jnp.asarray([True])),
                        damping=GAMMA, factor_decay=DECAY, factor_dtype=jnp.float64,
                        eigenvalue_correction="ekfac", inverse_update_every=10)

  @jax.jit
  def step(state, x, y, route):
    _, grads, stats = grad_fn(params, x, y, route, opt_state=state)
    return tx.update(grads, state, params, kfac_stats=stats)[1]

  state, want = tx.init(params), None
  for t, to_a in enumerate(ROUTES):
    x, y = _batch(t, 8)
    before = state
    state = step(state, x, y, jnp.asarray([to_a]))
    if to_a:
      np.testing.assert_array_equal(_scaling(state, "b"), _scaling(before, "b"))
      continue
    parts = kd.second_order_parts(state)["b"]
    q_a, q_g = helpers.f64(parts["A"][0]), helpers.f64(parts["G"][0])
    p = jax.tree.map(helpers.f64, params)
    h = np.tanh(helpers.f64(x) @ p["s"]["kernel"] + p["s"]["bias"])
    g = h @ p["b"]["kernel"] + p["b"]["bias"] - helpers.f64(y)
    batch = ((_with_one(h) @ q_a) ** 2).T @ ((g @ q_g) ** 2) / 8
    want = batch if want is None else DECAY * want + (1 - DECAY) * batch
    np.testing.assert_allclose(_scaling(state, "b"), want, rtol=1e-10, atol=1e-14,
                               err_msg=f"step {t}")


def _distributed_run(fraction, factor_reduction, routes):
  """8 devices under shard_map, `routes[t][d]`: device d's batch goes through
  head a at step t."""
  params, n = _params(), 4 * 8
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction, gradient_reduction="all_reduce")
  grad_fn = kd.value_and_grad(_loss)
  x, y = _batch(0, n)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y, jnp.ones(8, bool)),
                        damping=GAMMA, factor_decay=DECAY, factor_dtype=jnp.float64,
                        distribution=dist)
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(state, x, y, route):
    _, grads, stats = grad_fn(params, x, y, route, opt_state=state)
    return tx.update(grads, state, params, kfac_stats=stats)
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs,) + (P("data"),) * 3,
                               out_specs=(P(), specs)))
  oracle = _Oracle()
  for t, route in enumerate(routes):
    x, y = _batch(t, n)
    updates, state = step(state, x, y, jnp.asarray(route))
    want = oracle.step(_oracle_batch(params, x, y, np.repeat(np.asarray(route), 4)))
    _check(state, updates, oracle, want, f"step {t}")


@pytest.mark.parametrize("fraction, factor_reduction", [
    (1.0, "reduce_scatter"),           # the default strategy (COMM-OPT), tight chunks
    (1 / 8, "all_reduce"),             # MEM-OPT, owner segments
    (1 / 4, "reduce_scatter")])        # HYBRID
def test_eight_devices_taking_different_branches(fraction, factor_reduction):
  """Devices take different heads: a head's `A` is the mean over every
  position it saw on any device (not the mean of the devices' means), its `G`
  the global batch's, and a step where no device ran it leaves it as it was;
  against the single-process oracle of the whole batch."""
  devices = np.arange(8)
  routes = [devices % 3 == 0, np.ones(8, bool), devices < 2]
  _distributed_run(fraction, factor_reduction, routes)


def _dp_kfac(grad_fn, params: dict, *batch) -> tuple:
  """DP-KFAC on 8 devices (an owner per layer, its own batch's factors): the
  sharded state and the jitted step `(state, *batch) -> state`."""
  mesh = helpers.data_mesh(8)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, *batch), damping=GAMMA,
                        factor_decay=DECAY, factor_dtype=jnp.float64,
                        distribution=kd.Distribution(mesh, factor_reduction="local",
                                                     grad_worker_fraction=1 / 8,
                                                     gradient_reduction="all_reduce"))
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(state, *batch):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    return tx.update(grads, state, params, kfac_stats=stats)[1]
  return state, jax.jit(jax.shard_map(step, mesh=mesh,
                                      in_specs=(specs,) + (P("data"),) * len(batch),
                                      out_specs=specs))


def test_dp_kfac_owners_average_the_steps_their_batch_ran():
  """DP-KFAC: each owner's factors are the running average of its own
  batch's statistics over the steps its own batch ran the layer."""
  params, devices = _params(), np.arange(8)
  x, y = _batch(0, 32)
  state, step = _dp_kfac(kd.value_and_grad(_loss), params, x, y, jnp.ones(8, bool))
  oracles = [_Oracle() for _ in devices]
  for t, route in enumerate([devices % 3 == 0, np.ones(8, bool), devices < 2]):
    x, y = _batch(t, 32)
    state = step(state, x, y, jnp.asarray(route))
    for d in devices:
      rows = slice(4 * d, 4 * d + 4)
      oracles[d].step(_oracle_batch(params, x[rows], y[rows], np.full(4, route[d])))
  got = kd.running_factors(state)
  for plan in state.layout.plans:
    for which, place in plan.places:
      k = "ag".index(which)
      np.testing.assert_allclose(helpers.f64(got[plan.layer.name][which.upper()]),
                                 oracles[place.owner].factors[plan.layer.name][k],
                                 rtol=1e-10, atol=1e-12, err_msg=f"{plan.layer.name} {which}")


def test_stale_dp_kfac_with_a_layer_that_may_sit_out_is_refused():
  params = _params()
  grad_fn = kd.value_and_grad(_loss)
  x, y = _batch(0, 8)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, x, y, jnp.asarray([True])),
                        stale_threshold=0.1,
                        distribution=kd.Distribution(helpers.data_mesh(8),
                                                     factor_reduction="local"))
  with pytest.raises(ValueError, match=r"stale_threshold.*factor_reduction='local'.*'a', 'b'"):
    tx.init(params)


def test_checkpoint_and_convert_keep_the_running_weights(tmp_path):
  """The per-layer running weights survive a save and restore bit for bit and
  follow their layers through convert_state (8 devices → 1 → 8)."""
  params = _params()
  grad_fn = kd.value_and_grad(_loss)
  x, y = _batch(0, 8)
  layers = grad_fn.discover(params, x, y, jnp.asarray([True]))
  one = kd.scale_by_kfac(layers=layers, factor_dtype=jnp.float64)

  @jax.jit
  def step(state, x, y, route):
    _, grads, stats = grad_fn(params, x, y, route, opt_state=state)
    return one.update(grads, state, params, kfac_stats=stats)[1]
  state = one.init(params)
  for t, to_a in enumerate((True, True, False)):
    state = step(state, *_batch(t, 8), jnp.asarray([to_a]))
  # a ran at steps 0-1, b at step 2 (factor_decay 0.95)
  assert np.asarray(state.marked_weight).tolist() == pytest.approx([0.0975, 0.05])
  kd.save_checkpoint(tmp_path / "ckpt", {"opt_state": state})
  restored = kd.restore_checkpoint(tmp_path / "ckpt",
                                   {"opt_state": jax.eval_shape(one.init, params)})
  helpers.assert_trees_equal(restored["opt_state"], state, rtol=0)
  eight = kd.scale_by_kfac(layers=layers, factor_dtype=jnp.float64,
                           distribution=kd.Distribution(helpers.data_mesh(8),
                                                        grad_worker_fraction=1 / 8))
  moved = kd.convert_state(state, eight.init(params))
  np.testing.assert_array_equal(np.asarray(moved.marked_weight),
                                np.asarray(state.marked_weight))
  back = kd.convert_state(moved, one.init(params))
  helpers.assert_trees_equal(back, state, rtol=0)
  assert "2 layers may sit out a pass" in kd.describe(state, print_table=False)


def test_a_scale_and_shift_layer_that_sits_out_keeps_its_fisher():
  """A LayerNorm's scale-and-shift inside a `lax.cond` branch (a block run
  on some steps only) counts its positions like the Dense layers (it was
  refused: its statistics had no "positions"): a pass without it leaves its
  `F` and running weight as they were, and the next pass it runs in is
  averaged in as its second."""
  rng = np.random.default_rng(0)
  params = {"s": _params()["s"], "ln": {"scale": jnp.asarray(1 + rng.normal(size=D_H) / 4),
                                         "offset": jnp.asarray(rng.normal(size=D_H) / 4)},
            "a": _params()["a"]}

  def loss(p, x, y, run):
    h = jnp.tanh(kd.tags.dense(x, p["s"]["kernel"], p["s"]["bias"]))
    h = lax.cond(run[0], lambda h: kd.tags.scale_and_shift(h, p["ln"]["scale"],
                                                           p["ln"]["offset"]),
                 lambda h: h, h)
    return kd.losses.squared_error(kd.tags.dense(h, p["a"]["kernel"], p["a"]["bias"]), y)
  grad_fn = kd.value_and_grad(loss)
  x, y = _batch(0, 8)
  layers = grad_fn.discover(params, x, y, jnp.asarray([True]))
  assert [l.name for l in layers if l.may_sit_out] == ["ln"]
  tx = kd.scale_by_kfac(layers=layers, factor_dtype=jnp.float64, factor_decay=DECAY)

  @jax.jit
  def step(state, run):
    _, grads, stats = grad_fn(params, x, y, run, opt_state=state)
    return tx.update(grads, state, params, kfac_stats=stats)[1], stats

  def fisher(runs):
    state = tx.init(params)
    for run in runs:
      state, stats = step(state, jnp.asarray([run]))
    return np.asarray(kd.running_factors(state)["ln"]["F"]), state, stats
  first, _, stats = fisher([True])
  np.testing.assert_allclose(first, stats["ln"]["F"], rtol=1e-13)
  assert float(stats["ln"]["positions"]) == 8
  kept, state, stats = fisher([True, False])
  np.testing.assert_array_equal(kept, first)
  assert float(stats["ln"]["positions"]) == 0
  assert np.asarray(state.marked_weight).tolist() == pytest.approx([1 - DECAY])
  np.testing.assert_allclose(fisher([True, False, True])[0], fisher([True, True])[0],
                             rtol=1e-13)


def _task_loss(task: str):
  """Both heads run on the shared layer's output; the loss uses head `task`'s
  (a multi-task model trained by alternating losses that share one state):
  JAX never runs the other head's backward pass, whose statistics are zero
  and marked `"unreached"`."""
  def loss(p, x, y, mask=None):
    h = jnp.tanh(kd.tags.dense(x, p["s"]["kernel"], p["s"]["bias"]))
    out = {head: kd.tags.dense(h, p[head]["kernel"], p[head]["bias"]) for head in "ab"}
    return kd.losses.squared_error(out[task], y, mask=mask)
  return loss


def _task_steps(tx, grad_fns: dict, params: dict) -> dict:
  """Task -> the jitted K-FAC step `(state, x, y) -> (updates, state)` of
  that task's loss (parameters held fixed)."""
  def step(grad_fn, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    return tx.update(grads, state, params, kfac_stats=stats)
  return {task: jax.jit(functools.partial(step, grad_fn))
          for task, grad_fn in grad_fns.items()}


class _SharedWeightOracle(_Oracle):
  """`_Oracle` with one running weight for every layer (the state's `w`):
  a layer without statistics keeps its factors, and its next batch is mixed
  in with `β = (1 − decay) / w'` (layers that cannot sit out a pass)."""

  def step(self, batch: dict) -> dict:
    shared = self.weight["s"]                  # `s` runs at every step
    self.weight = {name: shared for name in self.weight}
    updates = super().step(batch)
    self.weight = {name: DECAY * shared + 1 - DECAY for name in self.weight}
    return updates


TASKS = "abbaab"


@pytest.mark.parametrize("options", [{}, {"stale_threshold": 0.0}], ids=["plain", "stale"])
def test_a_head_another_loss_trains_keeps_its_factors(options):
  """Alternating losses through heads a and b: the head a step's loss does
  not use is unreached and keeps its factors (before: zeros mixed in, A's
  bias entry 0.47 after 6 steps at decay 0.9, where each batch's is 1), its
  update 0. Its next batch comes in with the state's weight; with stale
  statistics (every factor due each step) with the factor's own."""
  params = _params()
  grad_fns = {task: kd.value_and_grad(_task_loss(task)) for task in "ab"}
  x, y = _batch(0, 8)
  tx = kd.scale_by_kfac(layers=grad_fns["a"].discover(params, x, y),
                        damping=GAMMA, factor_decay=DECAY, factor_dtype=jnp.float64,
                        **options)
  steps = _task_steps(tx, grad_fns, params)
  state = tx.init(params)
  oracle = _Oracle() if options else _SharedWeightOracle()
  for t, task in enumerate(TASKS):
    x, y = _batch(t, 8)
    updates, state = steps[task](state, x, y)
    want = oracle.step(_oracle_batch(params, x, y, np.full(8, task == "a")))
    _check(state, updates, oracle, want, f"step {t}")


def test_eight_devices_alternating_losses_equal_one():
  """The same on 8 devices (COMM-OPT, HYBRID): the mark is known when
  tracing, the same on every device."""
  params, n, mesh = _params(), 32, helpers.data_mesh(8)
  for fraction in (1.0, 1 / 4):
    dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=fraction,
                           gradient_reduction="all_reduce")
    grad_fns = {task: kd.value_and_grad(_task_loss(task)) for task in "ab"}
    x, y = _batch(0, n)
    tx = kd.scale_by_kfac(layers=grad_fns["a"].discover(params, x, y), damping=GAMMA,
                          factor_decay=DECAY, factor_dtype=jnp.float64, distribution=dist)
    state = kd.shard_state(tx.init(params), mesh)
    specs = kd.partition_specs(state)

    def step(state, x, y, grad_fn):
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
      return tx.update(grads, state, params, kfac_stats=stats)
    steps = {task: jax.jit(jax.shard_map(
        lambda s, x, y, g=grad_fn: step(s, x, y, g), mesh=mesh,
        in_specs=(specs, P("data"), P("data")), out_specs=(P(), specs)))
             for task, grad_fn in grad_fns.items()}
    oracle = _SharedWeightOracle()
    for t, task in enumerate(TASKS[:4]):
      x, y = _batch(t, n)
      updates, state = steps[task](state, x, y)
      want = oracle.step(_oracle_batch(params, x, y, np.full(n, task == "a")))
      _check(state, updates, oracle, want, f"fraction {fraction} step {t}")


def test_dp_kfac_owner_without_examples_keeps_its_factors():
  """DP-KFAC: at step 2 device 0's rows are all masked out of the loss, so
  its statistics have `G = 0` (no example of the loss there): the factors it
  owns stay as step 1 left them (before: `G = 0` mixed in, its layers' steps
  grew tenfold), while the others' take their batch."""
  params, n = _params(), 32
  x, y = _batch(0, n)
  mask = jnp.ones(n)
  state, step = _dp_kfac(kd.value_and_grad(_task_loss("a")), params, x, y, mask)
  first = step(state, x, y, mask)
  x, y = _batch(1, n)
  second = step(first, x, y, mask.at[:4].set(0.0))
  before, after = kd.running_factors(first), kd.running_factors(second)
  owners = {(plan.layer.name, which): place.owner
            for plan in first.layout.plans for which, place in plan.places}
  assert 0 in owners.values() and len(set(owners.values())) > 1
  for (name, which), owner in owners.items():
    same = np.array_equal(before[name][which.upper()], after[name][which.upper()])
    assert same == (owner == 0 or name == "b"), (name, which, owner)


def test_ekfac_scaling_of_an_unreached_head_is_kept():
  """EK-FAC with alternating losses: the scaling of the head a step's loss
  does not use stays as it was (before: its zero `S` averaged in), the
  other head's changes."""
  params = _params()
  grad_fns = {task: kd.value_and_grad(_task_loss(task)) for task in "ab"}
  x, y = _batch(0, 8)
  tx = kd.scale_by_kfac(layers=grad_fns["a"].discover(params, x, y), damping=GAMMA,
                        factor_decay=DECAY, factor_dtype=jnp.float64,
                        eigenvalue_correction="ekfac", inverse_update_every=10)
  steps = _task_steps(tx, grad_fns, params)
  state = tx.init(params)
  for t, task in enumerate(TASKS):
    before = state
    _, state = steps[task](state, *_batch(t, 8))
    other = "b" if task == "a" else "a"
    np.testing.assert_array_equal(_scaling(state, other), _scaling(before, other))
    if t:
      assert not np.array_equal(_scaling(state, task), _scaling(before, task)), t
