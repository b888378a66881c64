"""Checkpoints (orbax, sharded or not) restore bit for bit and resume the same
trajectory; `kd.convert_state` moves a state between device counts and
strategies (8-device MEM-OPT → 4-device COMM-OPT → one device → back)."""

import dataclasses
import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac.state import find_states
from kfac_jax_dist.tools import checkpoint as checkpoint_lib

BATCH = 16
FACTOR_EVERY, INVERSE_EVERY = 1, 2


def loss_fn(params, x, y):
  h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
  h = kd.tags.scale_and_shift(h, params["ln"]["scale"], params["ln"]["offset"], name="ln")
  h = jnp.tanh(kd.tags.dense(h, params["l1"]["kernel"], params["l1"]["bias"], name="l1"))
  return kd.losses.softmax_cross_entropy(
      kd.tags.dense(h, params["out"]["kernel"], name="out"), y)


def _params():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"l0": {"kernel": 0.5 * jax.random.normal(k[0], (6, 8)), "bias": jnp.zeros(8)},
          "ln": {"scale": jnp.ones(8), "offset": jnp.zeros(8)},
          "l1": {"kernel": 0.5 * jax.random.normal(k[1], (8, 5)), "bias": jnp.zeros(5)},
          "out": {"kernel": 0.5 * jax.random.normal(k[2], (5, 4))}}


def _batch(i):
  kx, ky = jax.random.split(jax.random.PRNGKey(100 + i))
  return jax.random.normal(kx, (BATCH, 6)), jax.random.randint(ky, (BATCH,), 0, 4)


GRAD_FN = kd.value_and_grad(loss_fn)


def _tx(distribution=None):
  layers = GRAD_FN.discover(_params(), *_batch(0))
  return kd.kfac(0.1, momentum=0.9, layers=layers, damping=1e-2,
                 factor_update_every=FACTOR_EVERY, inverse_update_every=INVERSE_EVERY,
                 distribution=distribution)


@functools.lru_cache(maxsize=None)
def _config(num_devices, fraction=1.0):
  """`(tx, mesh, step)` for one device (mesh None) or a strategy on
  `num_devices` (jit + shard_map); the transform is built anew each time."""
  if num_devices == 1:
    tx = _tx()

    @jax.jit
    def step(params, state, x, y):
      _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), state

    return tx, None, step
  mesh = helpers.data_mesh(num_devices)
  tx = _tx(kd.Distribution(mesh, grad_worker_fraction=fraction))
  specs = kd.partition_specs(tx.init(_params()))

  def step(params, state, x, y):
    _, grads, stats = GRAD_FN(params, x, y, opt_state=state)
    grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  return tx, mesh, jax.jit(jax.shard_map(step, mesh=mesh,
                                         in_specs=(P(), specs, P("data"), P("data")),
                                         out_specs=(P(), specs)))


def _init(num_devices, fraction=1.0):
  tx, mesh, _ = _config(num_devices, fraction)
  state = tx.init(_params())
  return state if mesh is None else kd.shard_state(state, mesh)


def _run(config, params, state, start, stop):
  step = _config(*config)[2]
  params = jax.tree.map(np.asarray, params)     # replicated, from any mesh
  for i in range(start, stop):
    params, state = step(params, state, *_batch(i))
  return params, state


def _bits(x):
  x = np.asarray(x)
  return x.dtype, x.shape, x.tobytes()


def assert_bitwise(a, b, what=""):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, what                    # includes the K-FAC layouts
  for i, (x, y) in enumerate(zip(la, lb)):
    assert _bits(x) == _bits(y), f"{what}: leaf {i} differs"


def assert_close(a, b, what=""):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-5, err_msg=what), a, b)


def _specs_of(tree):
  return jax.tree.map(lambda x: x.sharding.spec, tree)


# ------------------------------------------------------------- save / restore

def test_save_restore_one_device_bitwise_and_resume(tmp_path):
  """The whole state (K-FAC, momentum) and the parameters, restored into an
  abstract template, are bit-equal; the resumed run is the uninterrupted one."""
  single = (1,)
  params, state = _run(single, _params(), _init(1), 0, 3)      # counts 0-2
  kd.save_checkpoint(tmp_path / "ckpt", {"params": params, "opt_state": state})
  tx = _tx()                                                   # a fresh, equal transform
  template = {"params": _params(), "opt_state": jax.eval_shape(tx.init, _params())}
  restored = kd.restore_checkpoint(tmp_path / "ckpt", template)
  assert_bitwise(restored, {"params": params, "opt_state": state}, "restored")
  resumed = _run(single, restored["params"], restored["opt_state"], 3, 6)
  assert_bitwise(resumed, _run(single, _params(), _init(1), 0, 6), "resumed")


def test_sharded_mem_opt_save_restore_and_resume(tmp_path):
  """8-device MEM-OPT under jit + shard_map: saved sharded, restored with the
  shardings of kd.partition_specs, bit-equal, and the resumed run continues on
  exactly the uninterrupted trajectory."""
  config = (8, 1 / 8)
  params, state = _run(config, _params(), _init(*config), 0, 3)
  kd.save_checkpoint(tmp_path / "ckpt", state)
  tx, mesh, _ = _config(*config)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(tx.init, _params()),
                                   mesh=mesh)
  assert_bitwise(restored, state, "restored")
  assert _specs_of(restored) == _specs_of(state) == kd.partition_specs(state)
  assert find_states(restored)[0].factors.sharding.spec == P("data")
  resumed = _run(config, params, restored, 3, 5)
  assert_bitwise(resumed, _run(config, _params(), _init(*config), 0, 5), "resumed")
  # Into the template's own shardings (no mesh given), too.
  again = kd.restore_checkpoint(tmp_path / "ckpt", _init(*config))
  assert_bitwise(again, state)
  assert _specs_of(again) == _specs_of(state)


def test_comm_opt_rows_save_restore_and_resume(tmp_path):
  """8-device COMM-OPT, whose replicated array holds several owners' segments
  per row: their slots are in the checkpoint's metadata, and the restored
  state resumes on the uninterrupted trajectory."""
  config = (8,)
  params, state = _run(config, _params(), _init(*config), 0, 3)
  lay = find_states(state)[0].layout
  meta = kd.checkpoint_metadata(state)["kfac_states"][0]
  assert lay.rows_shared and meta["second_slots"] == [list(s) for s in lay.second_slots]
  kd.save_checkpoint(tmp_path / "ckpt", state)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", _init(*config))
  assert_bitwise(restored, state, "restored")
  resumed = _run(config, params, restored, 3, 5)
  assert_bitwise(resumed, _run(config, _params(), _init(*config), 0, 5), "resumed")


@pytest.mark.parametrize("fraction,saved", [
    (1.0, "padded"), (1 / 2, "padded"), (1.0, "segment"), (1 / 2, "segment")],
    ids=["comm_opt_padded", "hybrid_padded", "comm_opt_segment_rows", "hybrid_segment_rows"])
def test_checkpoint_of_an_older_packing_restores(tmp_path, monkeypatch, fraction, saved):
  """A checkpoint of an older packing of the second-order segments restores
  into today's template (wide rows): before segments shared rows (one per
  row, `[m·L₂]`; metadata without `SHARED_ROWS`) and before rows were wide
  (rows of `L₂`; metadata without `WIDE_ROWS`). Restored in the old layout,
  moved by `convert_state`: bit for bit the state it was saved from, and the
  run resumes on the uninterrupted trajectory."""
  from kfac_jax_dist.tools import checkpoint  # pylint: disable=import-outside-toplevel
  config = (8, fraction)
  params, state = _run(config, _params(), _init(*config), 0, 3)
  lay = find_states(state)[0].layout
  assert lay.second_rows == 1 and lay.second_array < lay.group_size * lay.second_segment
  keys = {checkpoint.WIDE_ROWS, checkpoint.SHARED_ROWS, checkpoint.ALIGNED_GROUPS,
          checkpoint.FREE_GROUP_PIECES, checkpoint.FEWER_LAYER_PIECES}
  dropped = {checkpoint.WIDE_ROWS, checkpoint.ALIGNED_GROUPS, checkpoint.FREE_GROUP_PIECES,
             checkpoint.FEWER_LAYER_PIECES} | (
      {checkpoint.SHARED_ROWS} if saved == "padded" else set())
  old = kd.convert_state(state, checkpoint._saved_layouts(
      state, {k: True for k in keys - dropped}))
  old_layout = find_states(old)[0].layout
  assert old_layout.second_packing == saved
  assert old_layout.second_row == old_layout.second_segment
  assert (old_layout.second_rows == old_layout.group_size) == (saved == "padded")
  metadata = checkpoint.checkpoint_metadata
  monkeypatch.setattr(checkpoint, "checkpoint_metadata", lambda tree: {
      k: v for k, v in metadata(tree).items() if k not in dropped})
  kd.save_checkpoint(tmp_path / "ckpt", old)
  monkeypatch.undo()
  tx, mesh, _ = _config(*config)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(tx.init, _params()),
                                   mesh=mesh)
  assert_bitwise(restored, state, "restored")
  assert _specs_of(restored) == _specs_of(state)
  resumed = _run(config, params, restored, 3, 5)
  assert_bitwise(resumed, _run(config, _params(), _init(*config), 0, 5), "resumed")


def _split_in_a_group(lay) -> bool:
  """Whether some factor's eigenvector columns are split over several owners."""
  return any(place.copies for plan in lay.plans for _, place in plan.places)


@pytest.mark.parametrize("before", ["groups_aligned", "group_pieces_uncapped"])
def test_hybrid_checkpoint_before_groups_split_factors_restores(tmp_path, monkeypatch,
                                                                 before):
  """A HYBRID checkpoint saved before its groups split oversized factors over
  several of their devices restores into today's template, which splits
  them: saved before the groups were assigned together (metadata without
  `ALIGNED_GROUPS`: each factor whole on one device of its group), or before
  a factor's pieces within a group escaped the copies' cap (without
  `FREE_GROUP_PIECES`; here with a budget of no copies, so the cap leaves
  every factor whole). Restored in the saved assignment
  (`layout.rebuild(align_groups=False)`, `cap_group_pieces=True`), moved by
  `convert_state`, bit for bit the state it was saved from, and the run
  resumes on the uninterrupted trajectory."""
  from kfac_jax_dist.kfac import layout  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.tools import checkpoint  # pylint: disable=import-outside-toplevel
  if before == "group_pieces_uncapped":
    monkeypatch.setattr(layout, "REPLICA_BUDGET", 1.0)
    monkeypatch.setattr(layout, "MIN_EXTRA_COPIES", 0)
  _config.cache_clear()          # the transforms are built under this budget
  kept = {checkpoint.SHARED_ROWS: True, checkpoint.WIDE_ROWS: True}
  if before == "group_pieces_uncapped":
    kept[checkpoint.ALIGNED_GROUPS] = True
  try:
    _restore_older_checkpoint(tmp_path, monkeypatch, checkpoint, (8, 1 / 2), kept,
                              _split_in_a_group)
  finally:
    monkeypatch.undo()
    _config.cache_clear()


def test_mem_opt_checkpoint_before_layers_took_fewer_owners_restores(tmp_path,
                                                                      monkeypatch):
  """8-device MEM-OPT, whose layers today take fewer owners than their size
  needs (`layout.build(fewer_layer_pieces=True)`: split over as many, a device
  would decompose two layers, so every layer stayed whole): a checkpoint
  saved before (metadata without `FEWER_LAYER_PIECES`) restores into today's
  template, moved by `convert_state`, bit for bit the state it was saved
  from, and the run resumes on the uninterrupted trajectory."""
  from kfac_jax_dist.tools import checkpoint  # pylint: disable=import-outside-toplevel
  kept = {key: True for key in (checkpoint.SHARED_ROWS, checkpoint.WIDE_ROWS,
                                checkpoint.ALIGNED_GROUPS, checkpoint.FREE_GROUP_PIECES)}
  _restore_older_checkpoint(tmp_path, monkeypatch, checkpoint, (8, 1 / 8), kept,
                            lambda lay: any(plan.copies for plan in lay.plans))


def _restore_older_checkpoint(tmp_path, monkeypatch, checkpoint, config, kept, split):
  """A state of `config` whose layout is `split` today, saved in the layout of
  a checkpoint whose metadata has only `kept`, restores and resumes."""
  params, state = _run(config, _params(), _init(*config), 0, 3)
  assert split(find_states(state)[0].layout)
  old = kd.convert_state(state, checkpoint._saved_layouts(state, kept))
  assert not split(find_states(old)[0].layout)
  metadata = checkpoint.checkpoint_metadata
  with monkeypatch.context() as m:
    m.setattr(checkpoint, "checkpoint_metadata", lambda tree: {
        k: v for k, v in metadata(tree).items()
        if k in kept or k in ("kfac_states", "shampoo_states")})
    kd.save_checkpoint(tmp_path / "ckpt", old)
  tx, mesh, _ = _config(*config)
  template = jax.eval_shape(tx.init, _params())
  restored = kd.restore_checkpoint(tmp_path / "ckpt", template, mesh=mesh)
  assert_bitwise(restored, state, "restored")
  assert _specs_of(restored) == _specs_of(state)
  resumed = _run(config, params, restored, 3, 5)
  assert_bitwise(resumed, _run(config, _params(), _init(*config), 0, 5), "resumed")
  # Today's checkpoints say that groups split factors: the same old state
  # saved with today's metadata is refused, naming the placement.
  kd.save_checkpoint(tmp_path / "today", old)
  with pytest.raises(ValueError, match="factors are placed on other owners"):
    kd.restore_checkpoint(tmp_path / "today", template)


def test_restore_names_the_layers_that_changed(tmp_path):
  """A template of another set of layers (a layer skipped, a layer wider) is
  refused naming them, and says that convert_state does not change layers
  (it had said "factor placement differs" and pointed to convert_state)."""
  kd.save_checkpoint(tmp_path / "ckpt", _init(1))
  layers = GRAD_FN.discover(_params(), *_batch(0))
  skipped = jax.eval_shape(kd.kfac(0.1, layers=layers, skip=["^l1$"]).init, _params())
  with pytest.raises(ValueError, match=r"layers only in the checkpoint: \['l1'\].*"
                                       r"not between sets of layers"):
    kd.restore_checkpoint(tmp_path / "ckpt", skipped)
  diagonal = jax.eval_shape(kd.kfac(0.1, layers=layers, max_factor_dim=6).init, _params())
  with pytest.raises(ValueError, match=r"layers whose factors' form or size differ: "
                                       r"\['l0', 'l1'\]"):
    kd.restore_checkpoint(tmp_path / "ckpt", diagonal)


def test_restore_refuses_another_layout(tmp_path):
  kd.save_checkpoint(tmp_path / "ckpt", _init(8, 1 / 8))
  other = jax.eval_shape(_config(4)[0].init, _params())
  with pytest.raises(ValueError, match="another layout.*num_devices: saved 8.*convert_state"):
    kd.restore_checkpoint(tmp_path / "ckpt", other)
  meta = kd.checkpoint_metadata(_init(8, 1 / 8))["kfac_states"][0]
  assert meta["num_devices"] == 8 and meta["group_size"] == 1
  assert {tuple(f[:2]) for f in meta["factors"]} >= {("l0", "a"), ("ln", "f"), ("out", "g")}


def test_shampoo_checkpoint_of_boxed_parameter_paths_restores(tmp_path, monkeypatch):
  """A Shampoo state of NNX parameters, saved before parameter paths dropped
  their Variable's `value` key (its metadata naming `kernel/value`), restores
  into today's template; another parameter is still refused."""
  graphdef, params = nnx.split(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Param)
  tx = kd.shampoo(0.1)
  state = tx.init(params)
  metadata = checkpoint_lib.checkpoint_metadata

  def boxed(tree):
    meta = metadata(tree)
    meta["shampoo_states"] = [{**s, "params": [[path + "/value", *rest]
                                               for path, *rest in s["params"]]}
                              for s in meta["shampoo_states"]]
    return meta
  monkeypatch.setattr(checkpoint_lib, "checkpoint_metadata", boxed)
  kd.save_checkpoint(tmp_path / "ckpt", state)
  monkeypatch.undo()
  assert_bitwise(kd.restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(tx.init, params)),
                 state, "restored")
  _, other = nnx.split(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), nnx.Param)
  with pytest.raises(ValueError, match="Shampoo states were saved with another layout"):
    kd.restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(tx.init, other))


# ----------------------------------------------------------------- conversion

def _same_factors_state(state, template):
  """`template` (a global state of another configuration) holding `state`'s
  counters, running factors and momentum, built independently of
  convert_state from kd.running_factors and packing.all_segments; its
  second-order information is the template's (identity)."""
  def build(old, new):
    if not isinstance(new, kd.ScaleByKfacState):
      return jnp.asarray(np.asarray(old))
    running = kd.running_factors(old)
    factors = packing.all_segments(
        new.layout, lambda plan, which: running[plan.layer.name][which.upper()],
        new.factors.dtype)
    return dataclasses.replace(new, count=jnp.asarray(old.count),
                               factor_weight=jnp.asarray(old.factor_weight),
                               update_factors=jnp.asarray(old.update_factors),
                               factors=factors)
  is_kfac = lambda x: isinstance(x, kd.ScaleByKfacState)
  return jax.tree_util.tree_map(build, state, template, is_leaf=is_kfac)


def _factors_and_second(state):
  kstate, = find_states(state)
  return kd.running_factors(kstate), kd.second_order_parts(kstate)


def test_convert_round_trip_is_exact():
  """8-device MEM-OPT → 4-device COMM-OPT → one device → 8-device MEM-OPT:
  every factor and every eigenbasis/eigenvalue moves bit for bit, and the round
  trip gives back the original state."""
  params, s8 = _run((8, 1 / 8), _params(), _init(8, 1 / 8), 0, 3)
  s4 = kd.convert_state(s8, _init(4))
  s1 = kd.convert_state(s4, _config(1)[0].init(_params()))
  back = kd.convert_state(s1, _init(8, 1 / 8))
  assert_bitwise(back, s8, "round trip")
  assert _specs_of(back) == _specs_of(s8)
  assert _specs_of(s4) == _specs_of(_init(4))
  for other in (s4, s1):
    assert_bitwise(_factors_and_second(other), _factors_and_second(s8))
    assert find_states(other)[0].layout != find_states(s8)[0].layout
  assert int(find_states(s1)[0].count) == 3
  # Owner storage (KAISA's all-reduce), unpacked factors, HYBRID groups of 2.
  mesh8 = helpers.data_mesh(8)
  hybrid = _tx(kd.Distribution(mesh8, grad_worker_fraction=1 / 4,
                               factor_reduction="all_reduce", symmetric_comm=False))
  s_h = kd.convert_state(s8, hybrid.init(_params()))
  assert find_states(s_h)[0].layout.factor_storage == "owner"
  assert_bitwise(_factors_and_second(s_h), _factors_and_second(s8))
  assert_bitwise(kd.convert_state(s_h, _init(8, 1 / 8)), s8, "round trip via HYBRID")
  # HYBRID groups of 4: each group's segments share three rows, a slot per rank.
  s_r = kd.convert_state(s8, _init(8, 1 / 2))
  assert find_states(s_r)[0].layout.rows_shared
  assert_bitwise(_factors_and_second(s_r), _factors_and_second(s8))
  assert_bitwise(kd.convert_state(s_r, _init(8, 1 / 8)), s8, "round trip via HYBRID rows")
  # COMM-OPT on 8 devices: the owners' segments share four rows of the
  # replicated array (`Layout.second_slots`).
  s_c = kd.convert_state(s8, _init(8))
  assert find_states(s_c)[0].layout.rows_shared
  assert_bitwise(_factors_and_second(s_c), _factors_and_second(s8))
  assert_bitwise(kd.convert_state(s_c, _init(8, 1 / 8)), s8, "round trip via COMM-OPT")
  # Another method or other layers cannot be converted.
  layers = GRAD_FN.discover(_params(), *_batch(0))
  with pytest.raises(ValueError, match="distributions, not methods"):
    kd.convert_state(s1, kd.kfac(0.1, layers=layers, method="inverse").init(_params()))
  with pytest.raises(ValueError, match=r"only in the state: \[\('out', 'a'\)"):
    kd.convert_state(s1, kd.kfac(0.1, layers=layers, skip=("out",)).init(_params()))


@pytest.mark.parametrize("stop", [2, 3], ids=["at-inverse-step", "between-inverse-steps"])
def test_converted_run_continues(stop):
  """Run 8-device MEM-OPT up to count `stop`, convert to 4-device COMM-OPT and
  continue. At an inverse step, the converted run is bit-equal to a 4-device
  COMM-OPT run given the same factors (built with running_factors and
  all_segments). Either way it follows the uninterrupted 8-device run and a
  run that never left 4-device COMM-OPT, to the strategies' float32 agreement
  (the moved second-order information is used in between inverse steps)."""
  end = 5
  params, s8 = _run((8, 1 / 8), _params(), _init(8, 1 / 8), 0, stop)
  converted = _run((4,), params, kd.convert_state(s8, _init(4)), stop, end)
  if stop % INVERSE_EVERY == 0:
    mesh4 = _config(4)[1]
    given = kd.shard_state(_same_factors_state(s8, _config(4)[0].init(_params())), mesh4)
    reference = _run((4,), params, given, stop, end)
    assert_bitwise(converted[0], reference[0], "params")
  uninterrupted = _run((8, 1 / 8), params, s8, stop, end)
  never_left = _run((4,), _params(), _init(4), 0, end)
  for other in (uninterrupted, never_left):
    assert_close(converted[0], other[0], "params")
    assert_close(_factors_and_second(converted[1])[0], _factors_and_second(other[1])[0])
  one = _run((1,), params, kd.convert_state(s8, _config(1)[0].init(_params())), stop, end)
  assert_close(one[0], uninterrupted[0], "params on one device")


# ------------------------------------------------------------------------ SOAP

SOAP_PARAMS = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 16)),
               "w2": jax.random.normal(jax.random.PRNGKey(1), (16, 3))}


def _soap(num_devices=None):
  """`kd.soap` on one device, or COMM-OPT on the first `num_devices`."""
  distribution = None if num_devices is None else kd.Distribution(
      helpers.data_mesh(num_devices), axis="data")
  return kd.soap(1e-2, block_size=8, distribution=distribution)


def _trained_soap_state():
  """A SOAP state after three steps on one device (statistics, bases and
  moments away from their initial values)."""
  tx = _soap()
  grads = jax.tree.map(lambda p: jnp.sin(3 * p) + 0.1, SOAP_PARAMS)
  state, update = tx.init(SOAP_PARAMS), jax.jit(tx.update)
  for _ in range(3):
    _, state = update(grads, state, SOAP_PARAMS)
  return state


def test_soap_checkpoint_restores_and_refuses_another_layout(tmp_path):
  """A SOAP state saved from 8-device COMM-OPT restores bit for bit into its
  own layout and is refused, naming the device counts, by a 4-device COMM-OPT
  template whose arrays have exactly the saved shapes and dtypes (restored,
  its statistics would sit in other blocks' places)."""
  mesh8, mesh4 = helpers.data_mesh(8), helpers.data_mesh(4)
  state = kd.shard_state(kd.convert_state(_trained_soap_state(),
                                          _soap(8).init(SOAP_PARAMS)), mesh8)
  kd.save_checkpoint(tmp_path / "ckpt", state)
  template8 = jax.eval_shape(_soap(8).init, SOAP_PARAMS)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", template8, mesh=mesh8)
  assert_bitwise(restored, state, "restored")
  template4 = jax.eval_shape(_soap(4).init, SOAP_PARAMS)
  shapes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
  assert shapes(template4) == shapes(template8)      # only the layout tells them apart
  with pytest.raises(ValueError, match="SOAP states were saved with another layout "
                     r"\(state 0: num_devices: saved 8, template 4.*convert_state"):
    kd.restore_checkpoint(tmp_path / "ckpt", template4, mesh=mesh4)
  assert kd.checkpoint_metadata(state)["soap_states"] == [
      checkpoint_lib.shampoo_layout_metadata(kd.find_states(state, kd.ScaleBySoapState)[0]
                                             .layout)]


def test_soap_update_errors_name_soap():
  """A SOAP state given another tree, or laid out for another distribution
  (restored into the wrong template, say), is refused naming SOAP, not the
  Shampoo code it shares (the errors said scale_by_shampoo / This Shampoo)."""
  state = _trained_soap_state()
  grads = jax.tree.map(jnp.ones_like, SOAP_PARAMS)
  with pytest.raises(ValueError, match="^scale_by_soap: the updates do not have the "
                                       "structure of the params given to init"):
    _soap().update({"w": grads["w"]}, state, {"w": SOAP_PARAMS["w"]})
  other = kd.convert_state(state, _soap(8).init(SOAP_PARAMS))
  with pytest.raises(ValueError, match="^This SOAP state was laid out for another "
                                       "distribution: devices 8"):
    _soap().update(grads, other, SOAP_PARAMS)


def test_soap_checkpoint_without_soap_metadata_restores(tmp_path, monkeypatch):
  """A SOAP checkpoint saved before SOAP states were described (metadata
  without `soap_states`) still restores into its own layout, bit for bit."""
  mesh8 = helpers.data_mesh(8)
  state = kd.shard_state(kd.convert_state(_trained_soap_state(),
                                          _soap(8).init(SOAP_PARAMS)), mesh8)
  metadata = checkpoint_lib.checkpoint_metadata
  with monkeypatch.context() as m:
    m.setattr(checkpoint_lib, "checkpoint_metadata", lambda tree: {
        k: v for k, v in metadata(tree).items() if k != "soap_states"})
    kd.save_checkpoint(tmp_path / "ckpt", state)
  template = jax.eval_shape(_soap(8).init, SOAP_PARAMS)
  restored = kd.restore_checkpoint(tmp_path / "ckpt", template, mesh=mesh8)
  assert_bitwise(restored, state, "restored")


# --------------------------------------------------------- leaves and dtypes

@pytest.mark.parametrize("saved_ekfac", [False, True], ids=["kfac_into_ekfac",
                                                             "ekfac_into_kfac"])
def test_restore_into_another_tree_names_the_leaves(tmp_path, saved_ekfac):
  """A K-FAC checkpoint restored into an EK-FAC template (or back) is refused
  naming EK-FAC's correction leaves, not a leaf that sits at the same position
  with another dtype."""
  layers = GRAD_FN.discover(_params(), *_batch(0))
  plain = kd.kfac(0.1, layers=layers)
  ekfac = kd.kfac(0.1, layers=layers, eigenvalue_correction="ekfac")
  saved, template = (ekfac, plain) if saved_ekfac else (plain, ekfac)
  kd.save_checkpoint(tmp_path / "ckpt", saved.init(_params()))
  correction = r"\[0\]\.correction\.scaling, \[0\]\.correction\.fresh"
  where = (f"only in the checkpoint: {correction}; only in the template: none"
           if saved_ekfac else
           f"only in the checkpoint: none; only in the template: {correction}")
  with pytest.raises(ValueError, match=f"another tree.*{where}") as info:
    kd.restore_checkpoint(tmp_path / "ckpt", jax.eval_shape(template.init, _params()))
  assert "saved as" not in str(info.value)


def test_shampoo_restore_into_another_graft_names_the_leaves(tmp_path):
  """A Shampoo checkpoint without grafting accumulators (`graft_type="sgd"`)
  restored into an RMSprop-grafted template is refused naming the template's
  grafting accumulators (not `skipped`, whose position they take)."""
  kd.save_checkpoint(tmp_path / "ckpt", kd.shampoo(1e-2, block_size=4).init(_params()))
  template = jax.eval_shape(kd.shampoo(1e-2, block_size=4, graft_type="rmsprop",
                                       graft_beta2=0.99).init, _params())
  with pytest.raises(ValueError, match=r"only in the checkpoint: none; only in the "
                     r"template: \[0\]\.graft\[0\], \[0\]\.graft\[1\], \[0\]\.graft\[2\], "
                     r"\[0\]\.graft\[3\] and 3 more\)") as info:
    kd.restore_checkpoint(tmp_path / "ckpt", template)
  assert "skipped" not in str(info.value)


def test_restore_into_other_dtypes_names_the_leaf(tmp_path):
  """With the same leaves, a leaf of another dtype is named with both dtypes."""
  kd.save_checkpoint(tmp_path / "ckpt", {"a": jnp.zeros(3), "b": jnp.zeros(2, jnp.int32)})
  template = {"a": jax.ShapeDtypeStruct((3,), jnp.float32),
              "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
  with pytest.raises(ValueError, match=r"leaf \['b'\] was saved as int32, the template "
                     "has float32"):
    kd.restore_checkpoint(tmp_path / "ckpt", template)


def test_restore_into_other_shapes_names_the_leaf(tmp_path):
  """A leaf of another shape (a parameter, outside any optimizer state) is
  named with both shapes (orbax's own error named no leaf)."""
  kd.save_checkpoint(tmp_path / "ckpt", {"a": jnp.zeros(3), "w": jnp.zeros((4, 2))})
  template = {"a": jax.ShapeDtypeStruct((3,), jnp.float32),
              "w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
  with pytest.raises(ValueError, match=r"leaf \['w'\] was saved with shape \(4, 2\), "
                     r"the template has \(4, 3\)"):
    kd.restore_checkpoint(tmp_path / "ckpt", template)
