"""Every distribution strategy equals the single-device transform (8 CPU devices)."""

import functools
import itertools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.core import offsets
from kfac_jax_dist.core import uneven
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac.adaptive import AdaptiveKfacState
from kfac_jax_dist.kfac.state import find_states

STEPS = 7            # counts 0..6: inverse at 0, 3, 6; factor-only at 2, 4; plain 1, 5
FACTOR_EVERY, INVERSE_EVERY = 2, 3


def _options(cadence=(FACTOR_EVERY, INVERSE_EVERY), **extra):
  return dict(damping=1e-2, factor_update_every=cadence[0],
              inverse_update_every=cadence[1], kl_clip=1e-2, **extra)


@functools.lru_cache(maxsize=None)
def _single_device(method, cadence=(FACTOR_EVERY, INVERSE_EVERY),
                   problem=helpers.conv_dense_problem, factor_dtype=None):
  loss_fn, params, x, y = problem()
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y),
               **_options(cadence, method=method, factor_dtype=factor_dtype))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  trajectory = []
  for _ in range(STEPS):
    params, state = step(params, state)
    trajectory.append(params)
  return trajectory, state


def _distributed(num_devices, fraction, factor_reduction, gradient_reduction,
                 method="eigen", symmetric=True, steps=STEPS, comm_dtype=None,
                 cadence=(FACTOR_EVERY, INVERSE_EVERY), skip_statistics="auto",
                 problem=helpers.conv_dense_problem, factor_dtype=None):
  loss_fn, params, x, y = problem()
  mesh = helpers.data_mesh(num_devices)
  dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction,
                         gradient_reduction=gradient_reduction, symmetric_comm=symmetric,
                         comm_dtype=comm_dtype)
  grad_fn = kd.value_and_grad(loss_fn, skip_statistics=skip_statistics)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), distribution=dist,
               **_options(cadence, method=method, factor_dtype=factor_dtype))
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    if gradient_reduction == "none":
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs)))
  trajectory, shardings = [], None
  for _ in range(steps):
    params, state = step(params, state, x, y)
    trajectory.append(params)
    now = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.spec), state)
    assert shardings is None or now == shardings, "state sharding changed across update"
    shardings = now
  return trajectory, state, tx


def _assert_same(trajectory, reference, rtol=2e-4, atol=2e-5):
  for step, (got, want) in enumerate(zip(trajectory, reference)):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=rtol, atol=atol, err_msg=f"step {step}"), got, want)


def _residual_stack_float64():
  """`helpers.residual_stack_problem` with float64 parameters and inputs."""
  loss_fn, params, x, y = helpers.residual_stack_problem()
  return (loss_fn, jax.tree.map(lambda a: a.astype(jnp.float64), params),
          x.astype(jnp.float64), y)


STRATEGIES = [(1.0, "COMM-OPT"), (1 / 8, "MEM-OPT"), (1 / 2, "HYBRID"), (1 / 4, "HYBRID")]


def _matrix():
  """Every strategy × factor reduction × gradient reduction; the default
  selection (not slow) keeps one combination per strategy (HYBRID: m = 4)."""
  for fraction, name in STRATEGIES:
    for factor_reduction in ("all_reduce", "reduce_scatter"):
      for gradient_reduction in ("none", "all_reduce", "reduce_scatter"):
        fast = (fraction != 1 / 4 and (factor_reduction, gradient_reduction)
                == ("reduce_scatter", "reduce_scatter"))
        yield pytest.param(fraction, factor_reduction, gradient_reduction,
                           marks=() if fast else pytest.mark.slow,
                           id=f"{name}-{fraction:g}-{factor_reduction}-{gradient_reduction}")


@pytest.mark.parametrize("fraction,factor_reduction,gradient_reduction", list(_matrix()))
def test_strategy_equals_single_device(fraction, factor_reduction, gradient_reduction):
  reference, _ = _single_device("eigen")
  trajectory, _, _ = _distributed(8, fraction, factor_reduction, gradient_reduction)
  _assert_same(trajectory, reference)


@pytest.mark.slow     # the "pass" skip is also checked on one device (test_capture)
@pytest.mark.parametrize("fraction", [1 / 4, 1 / 8, 1.0])
def test_whole_pass_statistics_skip_equals_single_device(fraction):
  """skip_statistics="pass" (one conditional around the capture, the GPU
  default) inside shard_map: the same trajectory as one device."""
  reference, _ = _single_device("eigen")
  trajectory, _, _ = _distributed(8, fraction, "reduce_scatter", "reduce_scatter",
                                  skip_statistics="pass")
  _assert_same(trajectory, reference)


@pytest.mark.parametrize("num_devices,problem,method,fraction,narrow", [
    (4, helpers.conv_dense_problem, "eigen", 1.0, False),   # three owners
    pytest.param(8, helpers.funnel_problem, "eigen", 1.0, False,   # and two idle devices
                 marks=pytest.mark.slow),
    (8, helpers.funnel_problem, "eigen", 1.0, True),
    pytest.param(8, helpers.funnel_problem, "inverse", 1.0, False, marks=pytest.mark.slow),
    (8, helpers.funnel_problem, "eigen", 1 / 2, False),     # HYBRID, two groups of four
    pytest.param(8, helpers.funnel_problem, "eigen", 1 / 2, True, marks=pytest.mark.slow)],
    ids=["comm_opt-4", "comm_opt-8", "comm_opt-8-narrow", "comm_opt-8-inverse", "hybrid-8",
         "hybrid-8-narrow"])
def test_rows_shared_by_owners_equal_single_device(monkeypatch, num_devices, problem,
                                                   method, fraction, narrow):
  """Each device's second-order array keeps its owners' segments one after
  another in one row (`Layout.second_slots`): COMM-OPT's replicated array,
  and in HYBRID each group's, one slot per rank for every group (the longest
  of the groups' segments of that rank, `Layout.second_capacity`; there the
  funnel's oversized factors are split, their eigenvector columns over
  several devices of their group). `narrow`:
  rows of `1.5·L₂`, as an array past int32 numbers is cut (`layout.row_width`),
  so that segments lie in several rows, first fit by decreasing size. The
  gather writes them there, the preconditioning reads them there, each owner
  takes its previous segment back from its slot (kept on a failed
  decomposition), and the steps equal one device's. The array is smaller
  than `m·L₂`."""
  if narrow:
    helpers.narrow_second_rows(monkeypatch)
  reference, _ = _single_device(method, problem=problem)
  trajectory, state, _ = _distributed(num_devices, fraction, "reduce_scatter",
                                      "reduce_scatter", method=method, problem=problem)
  _assert_same(trajectory, reference)
  kfac = find_states(state)[0]
  lay = kfac.layout
  assert lay.rows_shared and any(column for _, column in lay.second_slots)
  assert (lay.second_rows > 1) == narrow
  copies = 1 if lay.num_groups == 1 else num_devices
  assert kfac.second_order.shape == (copies * lay.second_array,)
  assert lay.second_array < lay.group_size * lay.second_segment
  if lay.num_groups > 1:      # HYBRID: an oversized factor's columns split in its group
    split = [place for plan in lay.plans for _, place in plan.places if place.copies]
    assert split and all(len({q.owner // lay.group_size for q in (place,) + place.copies})
                         == 1 for place in split)
  # each factor's eigenvalues (or damped inverse: both unique) where the
  # layout says, as `kd.second_order_parts` reads a global state
  want = kd.second_order_parts(find_states(_single_device(method, problem=problem)[1])[0])
  got = kd.second_order_parts(kfac)
  part = 1 if method == "eigen" else 0          # (matrix, vector)
  for name, factors in want.items():
    for which, parts in factors.items():
      np.testing.assert_allclose(got[name][which][part], parts[part], rtol=2e-3,
                                 atol=2e-4, err_msg=f"{name} {which}")


def _fewest_rows(sizes, row):
  """The fewest rows of `row` numbers that hold every segment (brute force)."""
  best = len(sizes)
  for assignment in itertools.product(range(len(sizes)), repeat=len(sizes)):
    loads = np.bincount(assignment, weights=sizes, minlength=len(sizes))
    if loads.max() <= row:
      best = min(best, len(set(assignment)))
  return best


@pytest.mark.parametrize("seed", range(30))
def test_pack_rows_places_every_segment_in_a_row(seed):
  """`layout.pack_rows`: each segment lies inside its row, the segments of a
  row one after the other from column 0 (what `Gathered.in_rows` writes),
  empty ones at their row's end; first fit by decreasing size is within its
  guarantee, 11/9 of the fewest rows (brute force) + 6/9; and where it saves
  no row, one segment per row in device order (the layout before packing)."""
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 6))
  sizes = [int(s) for s in rng.integers(0, 40, n) * (rng.random(n) < 0.8)]
  row = max(max(sizes), 1)
  slots = layout_lib.pack_rows(sizes, row)
  rows = 1 + max(r for r, _ in slots)
  by_row = {}
  for d in sorted(range(n), key=lambda d: slots[d][1]):
    by_row.setdefault(slots[d][0], []).append(d)
  for r, devices in by_row.items():
    at = 0
    for d in devices:
      assert slots[d][1] == at and at + sizes[d] <= row, (sizes, slots)
      at += sizes[d]
  assert sorted(by_row) == list(range(rows))
  if rows == n:
    assert slots == tuple((d, 0) for d in range(n))
  else:
    assert rows <= 11 / 9 * _fewest_rows(sizes, row) + 6 / 9, (sizes, slots)



def test_row_width_is_one_row_within_int32():
  """`layout.row_width`: every segment in one row while their numbers fit
  int32 indices; past that, rows within int32 that hold the segments with
  little room left over (GPT-2-XL's replicated COMM-OPT array at P = 1024:
  5·10⁹ numbers)."""
  assert layout_lib.row_width([3, 5, 0], 5) == 8
  assert layout_lib.row_width([0, 0], 0) == 1
  big = 2 ** 30
  assert layout_lib.row_width([big - 1, big - 1], big - 1) == 2 * big - 2   # fits int32
  assert layout_lib.row_width([big, big], big) == big                       # 2³¹ does not
  # past int32: the width within it that packs with the least room left over,
  # where rows of the longest segment would leave nearly half of each row empty
  # (segments of 0.5-1 of the longest, as GPT-2-XL's COMM-OPT segments at P = 1024)
  longest = 6_553_600
  sizes = [int(longest * f) for f in np.random.default_rng(0).uniform(0.5, 1.0, 1024)]
  sizes[0] = longest
  for case in ([longest] * 1024, sizes):
    width = layout_lib.row_width(case, longest)
    rows = 1 + max(r for r, _ in layout_lib.pack_rows(case, width))
    assert longest <= width <= offsets.INT32_MAX and rows * width <= 1.01 * sum(case)
  in_segment_rows = 1 + max(r for r, _ in layout_lib.pack_rows(sizes, longest))
  assert in_segment_rows * longest > 1.25 * sum(sizes)

def _longer_chunks(sizes):
  """`uneven.matched` at the second chunk candidate (longer than ⌈Σu/P⌉)."""
  chunks = uneven.chunk_candidates(sizes)
  return uneven.matched(sizes, chunks[min(1, len(chunks) - 1)])


@pytest.mark.parametrize("fraction,scheme", [
    pytest.param(1.0, "rechunk", marks=pytest.mark.slow), (1 / 8, "rechunk"), (1 / 2, "rechunk"),
    pytest.param(1 / 8, "longer chunks", marks=pytest.mark.slow),
    pytest.param(1 / 2, "longer chunks", marks=pytest.mark.slow)])
def test_rechunked_uneven_collectives_equal_single_device(fraction, scheme, monkeypatch):
  """The rechunk scheme of `uneven` (tight chunks + ppermute forwarding), which
  the cost model picks for large uneven owners only, in every uneven collective:
  COMM-OPT's eigenbasis gather, MEM-OPT's gradient gather and SP-NGD's
  reduce-scatter, HYBRID's eigenbasis gather within each group (the same
  ranks' pieces forwarded in every group); and its chunks longer than
  ⌈Σu/P⌉ (`uneven.matched`)."""
  make = {"rechunk": uneven.rechunk, "longer chunks": _longer_chunks}[scheme]
  monkeypatch.setattr(uneven, "plan", lambda sizes, psum=True: make(sizes))
  reference, _ = _single_device("eigen")
  trajectory, _, _ = _distributed(8, fraction, "reduce_scatter", "reduce_scatter")
  _assert_same(trajectory, reference)


@pytest.mark.parametrize("num_devices,fraction,cadence,storage", [
    (8, 1.0, (FACTOR_EVERY, INVERSE_EVERY), "chunked"),
    pytest.param(8, 1 / 8, (FACTOR_EVERY, INVERSE_EVERY), "chunked", marks=pytest.mark.slow),
    (2, 1.0, (1, 1), "owner")])
def test_statistics_buffer_past_int32_is_written_by_rows(num_devices, fraction, cadence,
                                                         storage, monkeypatch):
  """The reduce-scatter's statistics buffer holds every factor; past 2³¹
  numbers (GPT-2-XL's: 2.9e9) a flat offset would wrap, so it is written as
  one row per device, factors split where they cross rows. As if int32 ended
  just short of the buffer: bit for bit the flat buffer, in tight chunks and
  in owner segments, and the step with it inside shard_map equals one
  device."""
  from kfac_jax_dist.kfac import packing  # pylint: disable=import-outside-toplevel
  loss_fn, params, x, y = helpers.conv_dense_problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(num_devices), grad_worker_fraction=fraction)
  layout = find_states(kd.kfac(0.1, layers=layers, distribution=dist,
                               **_options(cadence)).init(params))[0].layout
  assert layout.factor_storage == storage
  rng = np.random.default_rng(0)
  stats = {(plan.layer.name, w): jnp.asarray(rng.normal(size=(q.dim, q.dim)), jnp.float32)
           for plan in layout.plans for w, q in plan.places}

  def segments():      # traced anew: _INT32_MAX is read at trace time
    return jax.jit(lambda s: packing.all_segments(
        layout, lambda plan, w: s[(plan.layer.name, w)], jnp.float32))(stats)
  flat = segments()
  monkeypatch.setattr(packing, "_INT32_MAX", layout.num_devices * layout.factor_shard - 1)
  np.testing.assert_array_equal(segments(), flat)
  reference, _ = _single_device("eigen", cadence)
  trajectory, _, _ = _distributed(num_devices, fraction, "reduce_scatter", "reduce_scatter",
                                  cadence=cadence)
  _assert_same(trajectory, reference)


@pytest.mark.parametrize("fraction,factor_reduction,gradient_reduction", [
    (1 / 2, "reduce_scatter", "reduce_scatter"),
    pytest.param(1 / 8, "all_reduce", "all_reduce", marks=pytest.mark.slow),
    pytest.param(1.0, "reduce_scatter", "all_reduce", marks=pytest.mark.slow)])
def test_batched_preconditioning_equals_single_device(monkeypatch, x64, fraction,
                                                      factor_reduction,
                                                      gradient_reduction):
  """Off CPU, equal-shape layers whose second-order state follows one another
  in an owner group's array are preconditioned as one batch
  (`precondition.precondition`). Forced here on the 8 CPU devices, against
  the single device's layer-at-a-time run, with runs of 2-3 in every group.
  In float64: seven float32 steps of this stack drift apart by up to 4e-5
  (the eigenbases amplify rounding; one of 144 numbers was over float32's
  tolerance at step 6 on jax 0.12), where float64 agrees to 1e-11."""
  del x64
  from kfac_jax_dist.kfac import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import precondition  # pylint: disable=import-outside-toplevel
  reference, _ = _single_device("eigen", problem=_residual_stack_float64,
                                factor_dtype=jnp.float64)
  monkeypatch.setattr(precondition, "BATCH_RUNS", True)
  trajectory, state, _ = _distributed(8, fraction, factor_reduction, gradient_reduction,
                                      problem=_residual_stack_float64,
                                      factor_dtype=jnp.float64)
  assert {leaf.dtype for leaf in jax.tree.leaves(trajectory[-1])} == {np.dtype("float64")}
  lay = find_states(state)[0].layout
  assert all(any(len(run) > 1 for run in layout_lib.precondition_runs(lay, g))
             for g in range(lay.num_groups))
  _assert_same(trajectory, reference, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fraction", [pytest.param(1.0, marks=pytest.mark.slow), 1 / 8])
def test_inverse_method_and_full_factor_traffic(fraction):
  reference, _ = _single_device("inverse")
  trajectory, _, _ = _distributed(8, fraction, "reduce_scatter", "none", method="inverse",
                                  symmetric=False)
  _assert_same(trajectory, reference)


@pytest.mark.parametrize("fraction", [1.0])
def test_one_device_distribution_equals_single_device(fraction):
  reference, _ = _single_device("eigen")
  trajectory, _, _ = _distributed(1, fraction, "reduce_scatter", "reduce_scatter")
  _assert_same(trajectory, reference)


@pytest.mark.parametrize("fraction, method", helpers.slow_unless(
    [(1.0, "eigen"), (1 / 2, "eigen"), (1 / 8, "inverse")], [(1 / 2, "eigen")]))
def test_bfloat16_second_order_state_equals_single_device(x64, fraction, method):
  """`second_order_dtype=jnp.bfloat16`: the second-order rows, their
  all-gathers (COMM-OPT's, HYBRID's within a group) and MEM-OPT's owners'
  reads in bfloat16 give one device's steps (float64 factors: the same
  numbers are rounded, 1e-12). A dense model: rounding eigenbases is not
  invariant within a repeated eigenvalue's eigenspace (a padded convolution
  has them), where float64's reduction orders pick other bases (6e-7 apart)."""
  del x64
  loss_fn, params, batch = _masked_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  options = dict(layers=grad_fn.discover(params, *batch), damping=1e-2, method=method,
                 factor_dtype=jnp.float64, second_order_dtype=jnp.bfloat16)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction,
                         gradient_reduction="all_reduce")
  single, tx = kd.kfac(0.1, **options), kd.kfac(0.1, distribution=dist, **options)

  def step_of(tx):
    def step(params, state, *batch):
      _, grads, stats = grad_fn(params, *batch, opt_state=state)
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), state
    return step
  run, state = helpers.compile_step(step_of(tx), tx.init(params), dist, 3)
  one, one_state = jax.jit(step_of(single)), single.init(params)
  one_params = params
  for i in range(3):
    params, state = run(params, state, *batch)
    one_params, one_state = one(one_params, one_state, *batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15,
                                                         err_msg=f"step {i}"),
                 params, one_params)
  assert kd.find_states(state)[0].second_order.dtype == jnp.bfloat16


def _fsdp_sharding(mesh, leaf):
  """ZeRO-3 / FSDP's layout of one parameter: its longest axis divisible by
  the device count split over "data" (replicated if none is)."""
  n = mesh.shape["data"]
  for axis in sorted(range(leaf.ndim), key=lambda i: -leaf.shape[i]):
    if leaf.shape[axis] % n == 0:
      return jax.sharding.NamedSharding(
          mesh, P(*(["data" if i == axis else None for i in range(leaf.ndim)])))
  return jax.sharding.NamedSharding(mesh, P())


@pytest.mark.parametrize("params_layout", ["replicated", "fsdp"])
def test_jit_on_a_sharded_batch_equals_single_device(params_layout):
  """No `shard_map` and no `Distribution`: the same jitted step given a batch
  sharded over 8 devices (XLA's SPMD partitioner splits the batch's work) takes
  the single-device steps, with the parameters and state replicated, or the
  parameters sharded over the same axis as FSDP / ZeRO-3 lays them out (the
  state as `jax.jit(tx.init)` makes it; the step keeps the layout)."""
  reference, _ = _single_device("eigen")
  loss_fn, params, x, y = helpers.conv_dense_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), **_options(method="eigen"))
  mesh = helpers.data_mesh()
  replicated, rows = (jax.sharding.NamedSharding(mesh, spec) for spec in (P(), P("data")))
  if params_layout == "fsdp":
    layout = jax.tree.map(functools.partial(_fsdp_sharding, mesh), params)
    params = jax.device_put(params, layout)
    state = jax.jit(tx.init)(params)
    assert any(s.spec != P() for s in jax.tree.leaves(layout))
  else:
    layout = replicated
    params, state = jax.device_put((params, tx.init(params)), replicated)
  x, y = jax.device_put((x, y), rows)

  @functools.partial(jax.jit, out_shardings=(layout, None))
  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  trajectory = []
  for _ in range(STEPS):
    params, state = step(params, state, x, y)
    trajectory.append(params)
  assert len(x.sharding.device_set) == 8
  if params_layout == "fsdp":
    assert jax.tree.map(lambda p: p.sharding.spec, params) == jax.tree.map(
        lambda s: s.spec, layout)
  _assert_same(trajectory, reference)


def _explicit_mesh(shape=(8,), names=("data",)) -> jax.sharding.Mesh:
  """A mesh whose axes are `Explicit` on every jax (`jax.make_mesh`'s default
  on jax 0.10.2 and 0.12, `Auto` on 0.8): an array's type then carries its
  sharding."""
  helpers.mesh(shape, names)                  # skips where there are too few devices
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def _float64_conv_dense():
  loss_fn, params, x, y = helpers.conv_dense_problem()
  return loss_fn, jax.tree.map(lambda a: a.astype(jnp.float64), params), x.astype(
      jnp.float64), y


def _optimizer(name, grad_fn, layers):
  """`name`'s optimizer, its second-order arithmetic in float64."""
  if name in ("kfac", "accumulate"):
    return kd.kfac(0.1, layers=layers,
                   **_options(method="eigen", factor_dtype=jnp.float64))
  if name == "adaptive":
    return kd.kfac(None, None, layers=layers, grad_fn=grad_fn, adapt_damping=True,
                   damping=1e-2, damping_adaptation_interval=2, factor_update_every=2,
                   inverse_update_every=3, factor_dtype=jnp.float64)
  if name == "shampoo":
    return kd.shampoo(1e-2, block_size=16, graft_type="rmsprop", graft_beta2=0.999,
                      statistics_dtype=jnp.float64)
  return kd.soap(3e-3, block_size=16, precondition_every=2, statistics_dtype=jnp.float64)


def _training_step(name, tx, grad_fn, loss_fn):
  """The step a user writes for optimizer `name` (Shampoo and SOAP take plain
  `jax.grad` gradients; `accumulate` over 4 micro-batches)."""
  def step(params, state, x, y):
    if name in ("shampoo", "soap"):
      updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
      return optax.apply_updates(params, updates), state
    if name == "accumulate":
      _, grads, stats = grad_fn.accumulate(params, x, y, micro_batches=4, opt_state=state)
    else:
      _, grads, stats = grad_fn(params, x, y, opt_state=state)
    extra = {"kfac_batch": (x, y)} if name == "adaptive" else {}
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **extra)
    return optax.apply_updates(params, updates), state
  return step


def _train(name, steps, mesh=None, params_layout="replicated"):
  """`steps` jitted steps of `name` on the float64 conv-dense problem; with a
  `mesh`, the batch sharded over its "data" axis and the parameters laid out
  as `params_layout` ("fsdp": `_fsdp_sharding`, gathered in the loss for
  `jax.grad`, as JAX's explicit-sharding guide writes FSDP)."""
  loss_fn, params, x, y = _float64_conv_dense()
  grad_fn = kd.value_and_grad(loss_fn)
  tx = _optimizer(name, grad_fn, grad_fn.discover(params, x, y))
  if mesh is None:
    state, layout = tx.init(params), None
    step = _training_step(name, tx, grad_fn, loss_fn)
  else:
    replicated = jax.sharding.NamedSharding(mesh, P())
    if params_layout == "fsdp":
      layout = jax.tree.map(functools.partial(_fsdp_sharding, mesh), params)
      params = jax.device_put(params, layout)
      state = tx.init(params)        # eagerly: jitted, it needs jax.set_mesh (and jax >= 0.10)
      gathered = lambda p, x, y: loss_fn(jax.tree.map(
          lambda a: jax.sharding.reshard(a, replicated), p), x, y)
    else:
      layout, gathered = replicated, loss_fn
      params, state = jax.device_put((params, tx.init(params)), replicated)
    x, y = jax.device_put((x, y), jax.sharding.NamedSharding(mesh, P("data")))
    step = _training_step(name, tx, grad_fn, gathered)
  step = jax.jit(step, out_shardings=None if mesh is None else (layout, None))
  trajectory = []
  for _ in range(steps):
    params, state = step(params, state, x, y)
    trajectory.append(params)
  return trajectory, layout


# SOAP's trajectory on this problem leaves one device's at its first basis
# refresh (count 2) on any mesh, `Auto` axes too (3e-3 against 3e-9 the step
# before): two steps.
EXPLICIT_STEPS = {"kfac": STEPS, "accumulate": STEPS, "adaptive": 4, "shampoo": 4,
                  "soap": 2}
EXPLICIT_TOLERANCE = {"soap": dict(rtol=1e-6, atol=1e-9)}


@functools.lru_cache(maxsize=None)
def _single_device_run(name):
  return _train(name, EXPLICIT_STEPS[name])[0]


@pytest.mark.parametrize("name, params_layout", helpers.slow_unless([
    ("kfac", "replicated"), ("kfac", "fsdp"), ("accumulate", "fsdp"),
    ("adaptive", "fsdp"), ("shampoo", "fsdp"), ("soap", "replicated")],
    [("kfac", "fsdp"), ("accumulate", "fsdp"), ("adaptive", "fsdp"), ("soap", "replicated")]))
def test_jit_on_explicit_mesh_axes_equals_single_device(x64, name, params_layout):
  """`test_jit_on_a_sharded_batch_equals_single_device` on a mesh with
  `Explicit` axes (`jax.make_mesh`'s default on jax 0.10.2 and 0.12), no ambient
  mesh: the library's entry points run their sharded arrays with the axes
  `Auto` (JAX refused the statistics' contraction over the sharded batch,
  `accumulate`'s micro-batch reshape and the preconditioners' reshapes of
  FSDP-sharded gradients), and the updated parameters keep their layout."""
  del x64
  reference = _single_device_run(name)
  mesh = _explicit_mesh()
  trajectory, layout = _train(name, EXPLICIT_STEPS[name], mesh, params_layout)
  assert jax.tree.map(lambda p: p.sharding.spec, trajectory[-1]) == jax.tree.map(
      lambda s: s.spec, layout if params_layout == "fsdp" else jax.tree.map(
          lambda _: layout, trajectory[-1]))
  _assert_same(trajectory, reference,
               **EXPLICIT_TOLERANCE.get(name, dict(rtol=1e-9, atol=1e-12)))


def test_adaptive_velocity_is_laid_out_as_the_parameters():
  """Adaptive K-FAC's velocity (zeros like the parameters, in float32 at
  least) lies as the FSDP-sharded parameters do, as optax's momentum does,
  not replicated."""
  mesh = _explicit_mesh()
  loss_fn, params, x, y = helpers.conv_dense_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  layout = jax.tree.map(functools.partial(_fsdp_sharding, mesh), params)
  state = _optimizer("adaptive", grad_fn, grad_fn.discover(params, x, y)).init(
      jax.device_put(params, layout))
  velocity = find_states(state, AdaptiveKfacState)[0].velocity
  assert all(v.sharding.is_equivalent_to(s, v.ndim) and v.dtype == jnp.float32
             for v, s in zip(jax.tree.leaves(velocity), jax.tree.leaves(layout)))


def test_tensor_parallel_discovery_on_explicit_mesh_axes():
  """`discover(distribution=...)` on a 2-D mesh with `Explicit` axes: the
  layers have the local shard shapes (a column-parallel kernel `[16, 64]`
  over 4 model shards: `a = 16 + 1` with its bias, `g = 16`; a row-parallel
  `[64, 10]`: `a = 16`, `g = 10`), whatever the arrays' own placement."""
  mesh = _explicit_mesh((2, 4), ("data", "model"))
  specs = {"up": {"kernel": P(None, "model"), "bias": P("model")},
           "down": {"kernel": P("model", None)}}

  def loss_fn(p, x, y):
    h = jax.nn.relu(kd.tags.dense(x, p["up"]["kernel"], p["up"]["bias"]))
    return kd.losses.softmax_cross_entropy(
        jax.lax.psum(kd.tags.dense(h, p["down"]["kernel"]), "model"), y)
  params = {"up": {"kernel": jnp.ones((16, 64)), "bias": jnp.zeros(64)},
            "down": {"kernel": jnp.ones((64, 10))}}
  x, y = jnp.ones((32, 16)), jnp.zeros(32, jnp.int32)
  tp = kd.Distribution(mesh, axis="data", model_axis="model", param_specs=specs)
  grad_fn = kd.value_and_grad(loss_fn)
  placed = jax.device_put(params, jax.tree.map(
      lambda s: jax.sharding.NamedSharding(mesh, s), specs,
      is_leaf=lambda s: isinstance(s, P)))
  for args in ((params, x, y), (placed, x, y),
               (placed, *jax.device_put((x, y), jax.sharding.NamedSharding(mesh, P())))):
    layers = grad_fn.discover(*args, distribution=tp).layers
    assert [(layer.a_dim, layer.g_dim) for layer in layers] == [(17, 16), (16, 10)]


def test_dp_kfac_factors_are_the_owners_local_factors():
  loss_fn, params, x, y = helpers.conv_dense_problem()
  _, opt_state, _ = _distributed(8, 1 / 8, "local", "none", steps=1)
  state, = find_states(opt_state)
  stored = kd.running_factors(state)
  grad_fn = jax.jit(kd.value_and_grad(loss_fn))
  lay = state.layout
  for device in range(8):
    xs, ys = x[device * 4:(device + 1) * 4], y[device * 4:(device + 1) * 4]
    _, _, local = grad_fn(params, xs, ys)
    for plan in lay.plans:
      for place, key in ((plan.a, "A"), (plan.g, "G")):
        if place.owner == device:
          np.testing.assert_allclose(stored[plan.layer.name][key],
                                     local[plan.layer.name][key], rtol=1e-5, atol=1e-6)
  owners = {s.owner for p in lay.plans for s in (p.a, p.g)}
  assert len(owners) > 1   # the work is spread


def test_misconfigured_distribution_is_rejected():
  mesh = helpers.data_mesh(8)
  with pytest.raises(ValueError, match="gradient workers"):
    kd.Distribution(mesh, grad_worker_fraction=3 / 8)
  with pytest.raises(ValueError, match="axis"):
    kd.Distribution(mesh, axis="model")
  with pytest.raises(ValueError, match="factor_reduction"):
    kd.Distribution(mesh, factor_reduction="allreduce")


def test_low_precision_factor_traffic_warns_and_stays_close():
  reference, _ = _single_device("eigen")
  with pytest.warns(UserWarning, match="16-bit"):
    trajectory, opt_state, _ = _distributed(8, 1 / 8, "reduce_scatter", "none",
                                            comm_dtype=jnp.bfloat16, steps=3)
  state, = find_states(opt_state)
  assert state.factors.dtype == jnp.float32          # only the traffic is bf16
  for got, want in zip(trajectory, reference):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0.05, atol=2e-2),
                 got, want)
  with pytest.raises(AssertionError):                 # but not bit-equal: bf16 did travel
    _assert_same(trajectory, reference)


def _bright_inputs():
  """`helpers.conv_dense_problem` with inputs 100× larger (a raw-pixel scale):
  factor entries above 65504 / 8, so that 8 devices' float16 sum overflows."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  return loss_fn, params, 100 * x, y


@pytest.mark.parametrize("factor_reduction", ["reduce_scatter", "all_reduce"])
def test_float16_factor_traffic_sends_shares_within_its_range(factor_reduction):
  """Each device sends `x / P` in float16, not `x`: every entry of a mean
  within float16's range reduces without overflow (the step is taken, the
  factors equal the float32 traffic's to float16's rounding)."""
  run = functools.partial(_distributed, 8, 1 / 8, factor_reduction, "none", steps=1,
                          problem=_bright_inputs)
  exact = kd.running_factors(find_states(run()[1])[0])
  with pytest.warns(UserWarning, match="16-bit"):
    _, opt_state, _ = run(comm_dtype=jnp.float16)
  state, = find_states(opt_state)
  assert (int(state.skipped), int(state.count)) == (0, 1)
  largest = max(float(jnp.max(jnp.abs(f))) for layer in exact.values() for f in layer.values())
  assert 65504 / 8 < largest < 65504
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3,
                                                       atol=1e-3 * float(jnp.max(jnp.abs(b)))),
               kd.running_factors(state), exact)


@pytest.mark.parametrize("num_devices,cadence", [
    pytest.param(2, (1, 1), marks=pytest.mark.slow), (8, (2, 3))])
def test_reduce_scatter_factor_storage_is_the_cheaper(num_devices, cadence):
  """Tight chunks (every factor step sends (P−1)·C, decomposition steps gather
  them back) or owner segments ((P−1)·L per factor step), whichever the
  cadence makes cheaper; both follow the single-device trajectory."""
  reference, _ = _single_device("eigen", cadence)
  trajectory, state, _ = _distributed(num_devices, 1.0, "reduce_scatter", "none",
                                      cadence=cadence)
  _assert_same(trajectory, reference)
  lay = find_states(state)[0].layout
  k = cadence[1] / cadence[0]
  chunks = -(-sum(lay.owner_sizes) // num_devices)
  expected = "chunked" if lay.segment * k > chunks * (k + 1) else "owner"
  assert lay.factor_storage == expected
  assert expected == {2: "owner", 8: "chunked"}[num_devices]   # both paths covered


def _same_width_mlp(widths=(12, 16, 16, 16, 16, 16, 16, 16, 16, 10), n=32):
  """Many layers of one shape: on 8 devices several own the same work."""
  keys = jax.random.split(jax.random.PRNGKey(0), len(widths))
  params = {f"l{i}": {"kernel": jax.random.normal(keys[i], (a, b)) / np.sqrt(a),
                      "bias": jnp.full((b,), 0.1)}
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))}

  def loss_fn(p, x, y):
    h = x
    for i in range(len(widths) - 1):
      h = kd.tags.dense(h, p[f"l{i}"]["kernel"], p[f"l{i}"]["bias"], name=f"l{i}")
      h = jnp.tanh(h) if i < len(widths) - 2 else h
    return kd.losses.softmax_cross_entropy(h, y)
  x = jax.random.normal(jax.random.PRNGKey(1), (n, widths[0]))
  y = jax.random.randint(jax.random.PRNGKey(2), (n,), 0, widths[-1])
  return loss_fn, params, x, y


@pytest.mark.parametrize("fraction,method,cadence,reduction", [
    (1 / 8, "eigen", (2, 3), "reduce_scatter"),
    pytest.param(1 / 2, "inverse", (2, 3), "reduce_scatter", marks=pytest.mark.slow),
    pytest.param(1 / 8, "inverse", (10, 100), "reduce_scatter", marks=pytest.mark.slow),
    pytest.param(1 / 2, "eigen", (10, 100), "reduce_scatter", marks=pytest.mark.slow),
    pytest.param(1 / 8, "eigen", (2, 3), "all_reduce", marks=pytest.mark.slow)])
def test_devices_with_the_same_work_share_a_branch(fraction, method, cadence, reduction,
                                                   monkeypatch):
  """`Layout.decomposition_branches` (and `copy_branches` of the all-reduce):
  devices whose decompositions (copies) have the same shapes share one branch
  of the per-device switch, each reading its own factors and segment at
  offsets from its index; the run equals one device's."""
  from kfac_jax_dist.kfac import layout as layout_lib
  monkeypatch.setattr(layout_lib, "SHARED_COPY_MIN", 2)   # 8 devices: share from 2
  loss_fn, params, x, y = _same_width_mlp()
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  opts = _options(cadence, method=method)

  def run(tx, wrap):
    state = tx.init(params)
    step, state = wrap(tx, state)
    p, out = params, []
    for _ in range(5):
      p, state = step(p, state, x, y)
      out.append(p)
    return out, state

  def single(tx, state):
    def step(p, s, x, y):
      _, g, st = grad_fn(p, x, y, opt_state=s)
      u, s = tx.update(g, s, p, kfac_stats=st)
      return optax.apply_updates(p, u), s
    return jax.jit(step), state

  def sharded(tx, state):
    def step(p, s, x, y):
      _, g, st = grad_fn(p, x, y, opt_state=s)
      u, s = tx.update(g, s, p, kfac_stats=st)
      return optax.apply_updates(p, u), s
    state = kd.shard_state(state, mesh)
    specs = kd.partition_specs(state)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs))), state

  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=fraction,
                         factor_reduction=reduction, gradient_reduction="all_reduce")
  reference, _ = run(kd.kfac(0.1, layers=layers, **opts), single)
  trajectory, state = run(kd.kfac(0.1, layers=layers, distribution=dist, **opts), sharded)
  layout = find_states(state)[0].layout
  members = {r: layout.decomposition_branches.count(r) for r in layout.decomposition_branches}
  assert any(n > 1 and layout.batches[r] for r, n in members.items()), members
  copies = {r: layout.copy_branches.count(r) for r in layout.copy_branches}
  assert any(n > 1 and layout.owned(r) for r, n in copies.items()), copies
  _assert_same(trajectory, reference)


def test_a_shared_branch_reads_each_devices_range():
  """`Collectives.range_at`: each device's `[start, start + size)` of the
  gathered chunks, read as (chunk row, column), the window clamped at the end."""
  from kfac_jax_dist.core import collectives as collectives_lib
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, axis="data")
  comm = collectives_lib.Collectives(dist)
  full = jnp.arange(8 * 5, dtype=jnp.float32)          # P = 8 chunks of C = 5
  for size, starts in ((3, (0, 4, 7, 12, 20, 33, 36, 37)), (11, (0, 1, 9, 14, 20, 24, 28, 29))):
    read = jax.jit(jax.shard_map(
        lambda f: comm.range_at(f, starts, size)[None],
        mesh=mesh, in_specs=P(), out_specs=P("data")))(full)
    want = np.stack([np.asarray(full)[s:s + size] for s in starts])
    np.testing.assert_array_equal(np.asarray(read), want)


def _masked_problem():
  """A float64 MLP whose loss mask keeps 2, 1, 0, 2, 2, 1, 2, 2 of each
  device's 2 examples on 8 devices (padding: the devices' counts differ)."""
  k = jax.random.split(jax.random.PRNGKey(0), 6)
  params = {"l0": {"kernel": 0.5 * jax.random.normal(k[0], (5, 7), jnp.float64),
                   "bias": 0.1 * jax.random.normal(k[1], (7,), jnp.float64)},
            "l1": {"kernel": 0.5 * jax.random.normal(k[2], (7, 3), jnp.float64)}}

  def loss_fn(p, x, y, mask):
    h = jnp.tanh(kd.tags.dense(x, p["l0"]["kernel"], p["l0"]["bias"], name="l0"))
    logits = kd.tags.dense(h, p["l1"]["kernel"], name="l1")
    return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
  x = jax.random.normal(k[3], (16, 5), jnp.float64)
  y = jax.random.randint(k[4], (16,), 0, 3)
  mask = jnp.ones(16, jnp.float64).at[jnp.array([3, 4, 5, 11])].set(0.0)
  return loss_fn, params, (x, y, mask)


@pytest.mark.parametrize("fraction,reduction,adaptive", [
    (1.0, "none", False), (1 / 8, "all_reduce", False),
    pytest.param(1 / 2, "reduce_scatter", False, marks=pytest.mark.slow),
    (1 / 8, "none", True)])
def test_masked_loss_with_uneven_counts_equals_single_device(x64, fraction, reduction,
                                                             adaptive):
  """Devices whose masks keep different numbers of examples (one keeps none):
  `grad_fn` returns each device's share of the global batch's loss,
  gradients and `G`, so their mean over the devices is the global batch's,
  and 3 steps on 8 devices equal one device's (float64)."""
  del x64
  loss_fn, params, batch = _masked_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, *batch)
  options = (dict(learning_rate=None, momentum=None, grad_fn=grad_fn, adapt_damping=True,
                  damping_adaptation_interval=1) if adaptive else dict(learning_rate=0.1))
  options.update(layers=layers, damping=0.1, factor_dtype=jnp.float64)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction,
                         gradient_reduction=reduction)
  single, tx = kd.kfac(**options), kd.kfac(distribution=dist, **options)
  extra = dict(kfac_batch=batch) if adaptive else {}

  def step(params, state, *batch):
    loss, grads, stats = grad_fn(params, *batch, opt_state=state)
    if reduction == "none":
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats,
                               **(dict(kfac_batch=batch) if adaptive else {}))
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")
  run, state = helpers.compile_step(step, tx.init(params), dist, 3, extra_out=(P(),))
  one_params, one_state = params, single.init(params)
  for i in range(3):
    params, state, loss = run(params, state, *batch)
    one_loss, grads, stats = grad_fn(one_params, *batch, opt_state=one_state)
    updates, one_state = single.update(grads, one_state, one_params, kfac_stats=stats,
                                       **extra)
    one_params = optax.apply_updates(one_params, updates)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-12, err_msg=f"step {i}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13,
                                                         err_msg=f"step {i}"),
                 params, one_params)


def _loss_with_other_terms(term: str):
  """`_masked_problem`'s model and loss plus a term besides the registered loss."""
  _, params, batch = _masked_problem()

  def with_term(p, x, y, mask):
    logits = kd.tags.dense(jnp.tanh(kd.tags.dense(x, p["l0"]["kernel"], p["l0"]["bias"],
                                                  name="l0")), p["l1"]["kernel"], name="l1")
    squares = jax.nn.logsumexp(logits, axis=-1) ** 2          # a z-loss's
    other = {"l2": lambda: 1e-2 * sum(jnp.sum(w ** 2) for w in jax.tree.leaves(p)),
             "every_position": lambda: 0.1 * jnp.mean(squares),
             "masked_mean": lambda: 0.1 * kd.losses.masked_mean(squares, 1.0 - mask)}
    return kd.losses.softmax_cross_entropy(logits, y, mask=mask) + other[term]()
  return with_term, params, batch


@pytest.mark.parametrize("term", ["l2", "every_position", "masked_mean"])
@pytest.mark.parametrize("devices,slices", [(8, 1), (4, 2), (1, 4)])
def test_terms_besides_the_registered_loss_are_the_global_batchs(x64, term, devices,
                                                                 slices):
  """With masks keeping different numbers of examples on the devices (or
  `accumulate`'s slices), only the registered loss (and `kd.losses.masked_mean`'s
  terms, masked their own way) is weighted as its share of the global batch:
  the mean over devices of the loss and gradients equals `jax.value_and_grad`
  of the whole batch (float64) for a penalty, a mean over every position and
  a masked mean, as do `grad_fn.loss` and `gauss_newton_gram`'s loss. (The
  whole loss was weighted: a mean over every position came out 1% off.)"""
  del x64
  loss_fn, params, batch = _loss_with_other_terms(term)
  grad_fn = kd.value_and_grad(loss_fn)
  want_loss, want_grads = jax.value_and_grad(loss_fn)(params, *batch)
  vector = (jax.tree.map(jnp.ones_like, params),)

  def local(p, *b):
    if slices == 1:
      loss, grads, _ = grad_fn(p, *b)
    else:
      loss, grads, _ = grad_fn.accumulate(p, *b, micro_batches=slices)
    _, gram_loss = grad_fn.gauss_newton_gram(p, vector, *b, micro_batches=slices,
                                             with_loss=True)
    plain = grad_fn.loss(p, *b, micro_batches=slices)
    mean = lambda x: jax.lax.pmean(x, "data") if devices > 1 else x
    return mean(loss), mean(grads), gram_loss, plain
  if devices > 1:
    local = jax.shard_map(local, mesh=helpers.data_mesh(devices),
                          in_specs=(P(),) + (P("data"),) * 3, out_specs=P())
  loss, grads, gram_loss, plain = jax.jit(local)(params, *batch)
  for got in (loss, gram_loss, plain):
    np.testing.assert_allclose(got, want_loss, rtol=1e-12)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-14),
               grads, want_grads)


def test_a_hand_written_masked_mean_is_the_mean_of_the_devices_means(x64):
  """A term averaged over masked positions by hand is not weighted: its mean
  over the devices is the plain mean of their local means, as in data-parallel
  training without K-FAC (docs/concepts.md); `kd.losses.masked_mean` makes it
  the global batch's."""
  del x64
  loss_fn, params, batch = _masked_problem()

  def extra(p, x, mask):
    return jnp.sum(mask * jnp.sum((x @ p["l0"]["kernel"]) ** 2, -1)
                   ) / jnp.maximum(jnp.sum(mask), 1.0)

  def with_extra(p, x, y, mask):
    return loss_fn(p, x, y, mask) + extra(p, x, 1.0 - mask)
  grad_fn = kd.value_and_grad(with_extra)
  local = jax.jit(jax.shard_map(lambda p, *b: jax.lax.pmean(grad_fn(p, *b)[0], "data"),
                                mesh=helpers.data_mesh(8),
                                in_specs=(P(),) + (P("data"),) * 3, out_specs=P()))
  x, y, mask = batch
  means = [extra(params, x[2 * d:2 * d + 2], 1.0 - mask[2 * d:2 * d + 2]) for d in range(8)]
  np.testing.assert_allclose(local(params, *batch),
                             loss_fn(params, *batch) + np.mean(means), rtol=1e-12)


def test_local_factors_keep_each_devices_own_statistics(x64):
  """DP-KFAC: an owner's factors are its own batch's statistics, so under a
  `factor_reduction="local"` state the capture leaves `G` unweighted by the
  devices' numbers of examples: each device's equals one device's on its
  slice alone. EK-FAC's `S`, averaged over the devices as the whole batch's,
  is weighted: its mean is one device's on the whole batch (the first step's
  eigenbases, identities, are the same)."""
  del x64
  loss_fn, params, batch = _masked_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, *batch)
  mesh = helpers.data_mesh(8)
  options = dict(layers=layers, eigenvalue_correction="ekfac", factor_dtype=jnp.float64)
  tx = kd.kfac(0.1, distribution=kd.Distribution(mesh, factor_reduction="local"),
               **options)
  state = kd.shard_state(tx.init(params), mesh)
  local = jax.jit(jax.shard_map(
      lambda s, *b: grad_fn(params, *b, opt_state=s)[2], mesh=mesh,
      in_specs=(kd.partition_specs(state),) + (P("data"),) * 3, out_specs=P("data")))
  stats = local(state, *batch)
  one_state = kd.kfac(0.1, **options).init(params)
  whole = grad_fn(params, *batch, opt_state=one_state)[2]
  for name in ("l0", "l1"):
    for d in range(8):
      alone = grad_fn(params, *(b[2 * d:2 * d + 2] for b in batch), opt_state=one_state)[2]
      got = stats[name]["G"].reshape(8, -1)[d]
      np.testing.assert_allclose(got, alone[name]["G"], rtol=1e-12, atol=1e-15,
                                 err_msg=f"device {d} {name}")
    scaling = stats[name]["S"].reshape((8,) + whole[name]["S"].shape).mean(0)
    np.testing.assert_allclose(scaling, whole[name]["S"], rtol=1e-12, atol=1e-15,
                               err_msg=f"S {name}")


def test_monte_carlo_targets_are_drawn_per_data_shard():
  """`fisher="mc"` inside `shard_map` with one key for every device: each data
  shard draws its own targets (the key folded with its index over the axes the
  batch varies over), as one device draws each example of the global batch
  its own; devices given the same (replicated) batch draw the same ones.
  (Every device drew the same: identical local batches gave identical `G`,
  whose noise then did not fall with the device count.)"""
  def loss_fn(params, x, y):
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, params["w"], name="out"), y)
  grad_fn = kd.value_and_grad(loss_fn, fisher="mc")
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
  y = jnp.arange(4) % 5
  params = {"w": jax.random.normal(jax.random.PRNGKey(1), (3, 5))}
  mesh = helpers.data_mesh(8)

  def local_g(xs, ys):
    _, _, stats = grad_fn(params, xs, ys, rng=jax.random.PRNGKey(5))
    return stats["out"]["G"][None]
  for batch_spec, distinct in ((P("data"), True), (P(), False)):
    tiled = (jnp.tile(x, (8, 1)), jnp.tile(y, 8)) if distinct else (x, y)
    g = np.asarray(jax.jit(jax.shard_map(local_g, mesh=mesh, in_specs=(batch_spec,) * 2,
                                         out_specs=P("data")))(*tiled))
    differ = [not np.array_equal(g[0], g[d]) for d in range(1, 8)]
    assert all(differ) if distinct else not any(differ), differ


def test_monte_carlo_g_takes_the_local_losss_coefficient():
  """Inside `shard_map`, the Monte Carlo `G` of `3 · loss` is 3 times the
  loss's on each device, each the single-device `G` of its slice with its
  folded key: the coefficient is the local loss's, not summed over the
  devices (the zero added to the registered loss varies with the batch)."""
  loss = lambda p, x, y: kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["w"], name="out"), y)
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 3))
  y = jnp.arange(32) % 5
  params = {"w": jax.random.normal(jax.random.PRNGKey(1), (3, 5))}

  def local_g(weight):
    grad_fn = kd.value_and_grad(lambda p, x, y: weight * loss(p, x, y), fisher="mc")
    return lambda xs, ys: grad_fn(params, xs, ys, rng=jax.random.PRNGKey(5))[2]["out"]["G"][None]
  mesh = helpers.data_mesh(8)
  g1, g3 = (np.asarray(jax.jit(jax.shard_map(local_g(w), mesh=mesh, in_specs=(P("data"),) * 2,
                                              out_specs=P("data")))(x, y)) for w in (1.0, 3.0))
  for d in range(8):
    alone = kd.value_and_grad(loss, fisher="mc")(
        params, x[4 * d:4 * d + 4], y[4 * d:4 * d + 4],
        rng=jax.random.fold_in(jax.random.PRNGKey(5), d))[2]["out"]["G"]
    np.testing.assert_allclose(g1[d], alone, rtol=1e-5, err_msg=f"device {d}")
    np.testing.assert_allclose(g3[d], 3.0 * alone, rtol=1e-5, err_msg=f"device {d}")


def test_monte_carlo_keys_follow_the_mesh_order_not_the_axis_names():
  """On a `(2, 4)` mesh whose axes are not in alphabetical order
  (`("outer", "inner")`), the batch split over both, the device at `(i, j)`
  holds rows block `4i + j` and draws with `fold_in(key, 4i + j)`: the
  one-device Monte Carlo `G` of its rows with that key (by name, device
  `(i, j)` drew `fold_in(key, 2j + i)`)."""
  loss = lambda p, x, y: kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["w"], name="out"), y)
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 3))
  y = jnp.arange(32) % 5
  params = {"w": jax.random.normal(jax.random.PRNGKey(1), (3, 5))}
  grad_fn = kd.value_and_grad(loss, fisher="mc")
  mesh = helpers.mesh((2, 4), ("outer", "inner"))
  both = P(("outer", "inner"))
  g = np.asarray(jax.jit(jax.shard_map(
      lambda xs, ys: grad_fn(params, xs, ys, rng=jax.random.PRNGKey(5))[2]["out"]["G"][None],
      mesh=mesh, in_specs=(both, both), out_specs=both))(x, y))
  for d in range(8):
    alone = grad_fn(params, x[4 * d:4 * d + 4], y[4 * d:4 * d + 4],
                    rng=jax.random.fold_in(jax.random.PRNGKey(5), d))[2]["out"]["G"]
    np.testing.assert_allclose(g[d], alone, rtol=1e-5, err_msg=f"device {d}")


@pytest.mark.parametrize("factor_every", [10, optax.constant_schedule(10)],
                         ids=["number", "schedule"])
def test_distributed_init_makes_no_host_transfers(factor_every):
  """Under `jax.transfer_guard("disallow")` (set by users who hunt per-step
  transfers), the abstract and the sharded init of a chunked K-FAC state run:
  the cadence that chooses its storage made a device array from the host."""
  mesh = helpers.data_mesh(8)
  loss_fn, params, x, y = helpers.funnel_problem()
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), factor_update_every=factor_every,
               inverse_update_every=100,
               distribution=kd.Distribution(mesh, grad_worker_fraction=1 / 8))
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
  with jax.transfer_guard("disallow"):
    jax.eval_shape(tx.init, params)
    kd.init_sharded(tx.init, params, mesh)
