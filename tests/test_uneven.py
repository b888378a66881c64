"""Uneven gathers and reduce-scatters (`uneven`): the schemes against stacking
and averaging the segments on 8 devices, the rechunk plans' invariants, the
planner's choice and its latency setting."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.core import collectives
from kfac_jax_dist.core import uneven

SIZES = [
    (5, 0, 17, 3, 9, 9, 1, 20),       # a few overflow
    (6, 6, 6, 6, 6, 6, 6, 6),         # equal: nothing to forward
    (20, 0, 0, 0, 0, 0, 0, 0),        # one owner, spread over every chunk
    (1, 40, 2, 33, 0, 0, 3, 1),       # two large owners share hosts
    (0, 0, 0, 0, 0, 0, 0, 0),
]


def _schemes(sizes):
  chunks = uneven.chunk_candidates(sizes)
  return {"prefix": uneven.Prefix(sizes, uneven.prefix_length(sizes)),
          "rechunk": uneven.rechunk(sizes),
          "matched": uneven.matched(sizes, chunks[min(1, len(chunks) - 1)]),
          "matched-tight": uneven.matched(sizes, chunks[0])}


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("name", ["prefix", "rechunk", "matched", "matched-tight"])
def test_uneven_collectives(sizes, name):
  mesh = helpers.data_mesh(8)
  scheme = _schemes(sizes)[name]
  length = max(sizes) + 2
  rng = np.random.default_rng(0)
  # Device i's segment (zeros past sizes[i]) and its [P·L] contribution to the reduce.
  segments = np.zeros((8, length), np.float32)
  for i, u in enumerate(sizes):
    segments[i, :u] = rng.normal(size=u)
  local = np.zeros((8, 8, length), np.float32)
  for j, u in enumerate(sizes):
    local[:, j, :u] = rng.normal(size=(8, u))

  # Every device's numbers read whole, in ranges of 3 (crossing the edges of
  # forwarded pieces), and one at a time at once.
  ranges = [(i, k, min(3, u - k)) for i, u in enumerate(sizes) for k in range(0, u, 3)]
  points = [(i, k) for i, u in enumerate(sizes) for k in range(u)][::-1]

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")),
                     out_specs=(P(), P(), P(), P(), P("data")))
  def run(seg, loc):
    me = jax.lax.axis_index("data")
    rows = uneven.gather(seg[0], sizes, "data", me, scheme)
    assert [r.shape[0] for r in rows] == list(sizes)
    gathered = jnp.stack([jnp.pad(r, (0, length - r.shape[0])) for r in rows])
    read = jnp.concatenate([rows.read(*r) for r in ranges] + [jnp.zeros(0)])
    numbers = rows.numbers(points) if points else jnp.zeros(0)
    mine = [loc[0, j, :u] for j, u in enumerate(sizes)]
    return (gathered, rows.padded(length), read, numbers,
            uneven.reduce_scatter(mine, length, "data", me, scheme)[None])

  gathered, padded, read, numbers, reduced = jax.jit(run)(segments, local)
  np.testing.assert_array_equal(np.asarray(gathered), segments)
  np.testing.assert_array_equal(np.asarray(padded), segments.reshape(-1))
  used = np.concatenate([segments[i, :u] for i, u in enumerate(sizes)])
  np.testing.assert_array_equal(np.asarray(read), used)
  np.testing.assert_array_equal(np.asarray(numbers), used[::-1])
  np.testing.assert_allclose(np.asarray(reduced), local.sum(0), rtol=1e-5, atol=1e-6)


GROUP_SIZES = [((5, 0, 17, 3), (1, 12, 0, 3)),    # rank 2 overflows in one group only
               ((20, 0, 0, 0), (20, 0, 0, 0)),    # one owner per group, every chunk
               ((1, 9, 2, 8), (0, 0, 0, 0))]      # a group with nothing


@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("name", ["prefix", "rechunk", "matched"])
def test_gather_within_groups(sizes, name):
  """Two groups of four (HYBRID's second-order gather): each group's
  segments reach its own devices only, each rank's numbers up to the
  longest of the groups' (`capacity`), the same scheme in every group."""
  capacity = tuple(max(g[r] for g in sizes) for r in range(4))
  scheme = {"prefix": uneven.plan(capacity, psum=False),
            **{k: v for k, v in _schemes(capacity).items() if k != "prefix"}}[name]
  assert name != "prefix" or not sum(scheme.overflow)
  mesh, length = helpers.data_mesh(8), max(capacity) + 2
  rng = np.random.default_rng(1)
  segments = np.zeros((8, length), np.float32)
  for d in range(8):
    segments[d, :sizes[d // 4][d % 4]] = rng.normal(size=sizes[d // 4][d % 4])
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  def run(seg):
    me = jax.lax.axis_index("data") % 4
    rows = uneven.gather(seg[0], capacity, "data", me, scheme, groups=groups)
    return rows.padded(length)[None]

  got = np.asarray(jax.jit(run)(segments)).reshape(8, 4, length)
  for d in range(8):
    want = segments[d // 4 * 4:d // 4 * 4 + 4].copy()
    for r in range(4):
      want[r, capacity[r]:] = 0
    np.testing.assert_array_equal(got[d], want, err_msg=f"device {d}")
  with pytest.raises(ValueError, match="psum"):   # no grouped psum for an overflow
    uneven.gather(jnp.zeros(length), capacity, "data", 0, uneven.Prefix(capacity, 0),
                  groups=groups)


def test_collectives_average_with_the_planned_scheme():
  """`Collectives.reduce_uneven` averages; `gather_uneven` is exact."""
  sizes = (1, 40, 2, 33, 0, 0, 3, 1)
  mesh = helpers.data_mesh(8)
  comm = collectives.Collectives(kd.Distribution(mesh, grad_worker_fraction=1 / 8))
  local = np.random.default_rng(1).normal(size=(8, 8, 42)).astype(np.float32)
  for j, u in enumerate(sizes):
    local[:, j, u:] = 0

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  def run(loc):
    return comm.reduce_uneven([loc[0, j, :u] for j, u in enumerate(sizes)], 42)[None]

  np.testing.assert_allclose(np.asarray(run(local)), local.mean(0), rtol=1e-5, atol=1e-6)


def _assert_places_every_number_once(plan, sizes):
  """Each device's chunk holds its own first numbers, then pieces that tile
  the rest of its room; each owner's pieces tile its overflow; a send's
  pieces have distinct owners and hosts."""
  p, c = len(sizes), plan.chunk
  held = [[(0, k)] for k in plan.keep]       # chunk intervals in use, per device
  got = [[(0, k)] for k in plan.keep]        # segment intervals covered, per owner
  for send in plan.sends:
    assert len({q.owner for q in send.pieces}) == len(send.pieces)
    assert len({q.host for q in send.pieces}) == len(send.pieces)
    for q in send.pieces:
      assert 0 < q.size <= send.size and q.owner != q.host
      held[q.host].append((q.chunk_start, q.chunk_start + q.size))
      got[q.owner].append((q.segment_start, q.segment_start + q.size))

  def tiles(intervals, end):
    pos = 0
    for lo, hi in sorted(intervals):
      if hi > lo:
        assert lo == pos, intervals
        pos = hi
    return pos == end

  for i in range(p):
    assert tiles(got[i], sizes[i])
    assert tiles(held[i], sum(hi - lo for lo, hi in held[i])) and max(
        hi for _, hi in held[i]) <= c


RANDOM_SIZES = SIZES + [tuple(int(u) for u in np.random.default_rng(s).integers(
    0, 1000, 64)) for s in range(3)] + [(5000,) + (10,) * 63]


@pytest.mark.parametrize("sizes", RANDOM_SIZES)
def test_rechunk_plan_places_every_number_once(sizes):
  p, plan = len(sizes), uneven.rechunk(sizes)
  c = plan.chunk
  assert p * c >= sum(sizes) > p * (c - 1) or sum(sizes) == 0
  _assert_places_every_number_once(plan, sizes)


@pytest.mark.parametrize("sizes", RANDOM_SIZES)
def test_matched_plans_place_every_number_once(sizes):
  """At every candidate chunk; at the smallest one where one round fits
  every overflow (the last of `chunk_candidates`' single-round ones), one
  ppermute forwards it all."""
  chunks = uneven.chunk_candidates(sizes)
  assert chunks == sorted(chunks) and chunks[0] * len(sizes) >= sum(sizes)
  for chunk in chunks:
    plan = uneven.matched(sizes, chunk)
    _assert_places_every_number_once(plan, sizes)
    if chunk >= max(sizes):
      assert not plan.sends
  with pytest.raises(ValueError, match="below"):
    uneven.matched((10, 0), 4)


def _large_owners(seed: int) -> tuple[int, ...]:
  """24 owners of 5-45 M numbers and 40 of under 2 M (as GPT-2-XL's MEM-OPT
  segments at pod scale): the cheapest plan is 29 collectives (seed 6; tight
  chunks and their ppermutes), one within 0.1% of its bytes 12."""
  rng = np.random.default_rng(seed)
  return tuple(int(x) for x in np.concatenate([rng.integers(5_000_000, 45_000_000, 24),
                                               rng.integers(0, 2_000_000, 40)]))


@pytest.mark.parametrize("sizes", RANDOM_SIZES + [_large_owners(6), _large_owners(9)])
@pytest.mark.parametrize("psum", [True, False])
def test_plan_is_cheapest_or_fewer_collectives_within_tolerance(sizes, psum):
  """Against every candidate scheme: the plan costs at most FEWER_COLLECTIVES
  more than the cheapest, and no candidate within that has fewer
  collectives (each is an operation in every device's program); without a
  psum (within groups) no prefix overflows."""
  prefix = uneven.Prefix(sizes, uneven.prefix_length(sizes) if psum else max(sizes))
  candidates = [prefix] + ([uneven.rechunk(sizes)] + [
      uneven.matched(sizes, c) for c in uneven.chunk_candidates(sizes)]
                           if len(sizes) > 1 else [])
  cheapest = min(uneven.cost(c) for c in candidates)
  near = [c for c in candidates if uneven.cost(c) <= cheapest * (1 + uneven.FEWER_COLLECTIVES)]
  chosen = uneven.plan(sizes, psum)
  assert uneven.cost(chosen) <= cheapest * (1 + uneven.FEWER_COLLECTIVES)
  assert chosen.num_collectives == min(c.num_collectives for c in near)
  assert psum or not isinstance(chosen, uneven.Prefix) or not sum(chosen.overflow)
  if sizes == _large_owners(6):       # the cheapest has more collectives
    fewest_bytes = min(candidates, key=uneven.cost)
    assert chosen.num_collectives < fewest_bytes.num_collectives


def test_one_ppermute_for_a_dozen_comparable_layers():
  """SP-NGD's gradient sizes of `benchmarks/_models.CnnMlp12` (12 layers of
  0.5M parameters, none over 1/8 of them) at P = 8: the prefix scheme sends
  1.071x the ideal, tight chunks need four ppermutes; chunks 1206
  numbers longer let one ppermute forward every overflow: 1.040x, in two
  collectives."""
  sizes = (78417, 59025, 57681, 68363, 65793, 65793, 65793, 73873)
  ideal = 7 / 8 * sum(sizes)
  prefix = uneven.Prefix(sizes, uneven.prefix_length(sizes))
  assert max(prefix.device_bytes()) / ideal > 1.07
  chosen = uneven.plan(sizes)
  assert isinstance(chosen, uneven.Rechunk) and chosen.num_collectives == 2
  assert chosen.chunk == -(-sum(sizes) // 8) + 1206
  assert max(chosen.device_bytes()) / ideal < 1.041


def test_latency_setting_steers_the_plan(monkeypatch):
  """`set_latency` changes what `plan` picks (its cache keys on the figure):
  without latency the fewest bytes whatever the collectives, with a huge one
  the fewest collectives; a bad figure is refused, naming what is allowed."""
  monkeypatch.setattr(uneven, "LATENCY_NUMBERS", uneven.LATENCY_NUMBERS)
  sizes = (1, 40, 2, 33, 0, 0, 3, 1)
  candidates = ([uneven.Prefix(sizes, s) for s in sorted(set(sizes))]
                + [uneven.rechunk(sizes, 0)]
                + [uneven.matched(sizes, c) for c in uneven.chunk_candidates(sizes)])
  uneven.set_latency(0)
  assert uneven.LATENCY_NUMBERS == 0
  fewest_bytes = uneven.plan(sizes)
  assert max(fewest_bytes.device_bytes()) == min(max(s.device_bytes()) for s in candidates)
  uneven.set_latency(2.0 ** 30)
  fewest_collectives = uneven.plan(sizes)
  assert fewest_collectives.num_collectives == min(s.num_collectives for s in candidates)
  assert fewest_collectives.num_collectives < fewest_bytes.num_collectives
  for bad in (-1, float("nan"), float("inf"), True, "2**15", None):
    with pytest.raises(ValueError, match="latency must be a finite number"):
      uneven.set_latency(bad)
  assert uneven.LATENCY_NUMBERS == 2 ** 30


def test_measure_latency_gives_a_figure():
  """On the 8 host devices the figure means nothing about a network, but the
  measurement runs and gives a number `set_latency` takes."""
  mesh = helpers.data_mesh(8)
  figure = uneven.measure_latency(mesh, "data", numbers=(1, 2 ** 14), repeats=3)
  assert isinstance(figure, int) and figure >= 0
  assert uneven.measure_latency(helpers.data_mesh(1), "data") == 0


def test_rechunk_is_chosen_for_one_oversized_owner():
  """Three owners holding 6× a device's share (ResNet-50's 3×3 convs at
  P = 64): the prefix scheme pays over 1.3× the ideal, the rechunk about
  1 + 1/(P−1) sent and the share of the largest segment received."""
  rng = np.random.default_rng(0)
  sizes = tuple([6 * 400_000] * 3 + [int(u) for u in rng.integers(200_000, 400_000, 61)])
  p, ideal = len(sizes), (len(sizes) - 1) / len(sizes) * sum(sizes)
  prefix = uneven.Prefix(sizes, uneven.prefix_length(sizes))
  chosen = uneven.plan(sizes)
  assert isinstance(chosen, uneven.Rechunk)
  assert max(prefix.device_bytes()) / ideal > 1.3
  sent, received = chosen.device_bytes()
  assert sent / ideal < 1 + 1.1 / (p - 1) + uneven.PACK_TOLERANCE
  assert received / ideal < 1 + (sizes[0] - chosen.chunk) / ideal * 1.06 + 1 / (p - 1)
  # Equal sizes: the prefix scheme's single all_gather.
  assert isinstance(uneven.plan((1000,) * 8), uneven.Prefix)


def test_prefix_length_minimises_ring_bytes():
  prefix = uneven.prefix_length
  assert prefix([4] * 8) == 4                       # equal: one all_gather
  assert prefix([100] + [0] * 7) == 0               # one big owner: psum only
  assert prefix([10, 9, 8, 7, 1, 1, 1, 1]) == 7     # 4 of 8 exceed 7: no gain above


def test_describe_names_the_schemes():
  """`kd.describe` says how the uneven collectives travel: three large layers
  among small ones (MEM-OPT, layers kept whole for SP-NGD) are rechunked, a
  COMM-OPT layout of equal factors is not."""
  mesh = helpers.data_mesh(8)
  dims = [1024] * 3 + [32] * 13
  layers = kd.LayerRegistry(tuple(
      kd.TaggedLayer(name=f"l{i}", kind="dense", kernel_path=f"l{i}/kernel",
                     bias_path=None, kernel_shape=(d, d), a_dim=d, g_dim=d)
      for i, d in enumerate(dims)))
  params = {f"l{i}": {"kernel": np.zeros((d, d), np.float32)} for i, d in enumerate(dims)}
  sp_ngd = kd.Distribution(mesh, grad_worker_fraction=1 / 8,
                           gradient_reduction="reduce_scatter")
  text = kd.describe(kd.scale_by_kfac(layers=layers, distribution=sp_ngd).init(params),
                     print_table=False)
  assert "uneven collectives: gradient gather rechunk (" in text, text
  assert f"latency of {uneven.LATENCY_NUMBERS:,} numbers per collective" in text, text
  equal = kd.LayerRegistry(layers.layers[3:11])
  comm = kd.Distribution(mesh, grad_worker_fraction=1.0)
  text = kd.describe(kd.scale_by_kfac(layers=equal, distribution=comm).init(
      {k: v for k, v in params.items() if k in {f"l{i}" for i in range(3, 11)}}),
      print_table=False)
  assert "uneven collectives: eigenbasis broadcast prefix" in text, text
  # HYBRID, two groups of four: each group's slots by an uneven gather within it
  hybrid = kd.Distribution(mesh, grad_worker_fraction=1 / 2)
  text = kd.describe(kd.scale_by_kfac(layers=layers, distribution=hybrid).init(params),
                     print_table=False)
  assert "uneven collectives: eigenbasis gather within each group " in text, text


def test_index_tables_past_int32_raise_instead_of_wrapping():
  """numpy's int64 → int32 cast wraps silently (3e9 → -1294967296, an offset
  XLA would clamp to another place); the per-device tables raise instead."""
  from kfac_jax_dist.core import offsets  # pylint: disable=import-outside-toplevel
  bases = np.cumsum([0, 2_000_000_000, 1_000_000_000])        # int64, past int32
  assert np.asarray(bases, np.int32)[2] < 0                   # what numpy does
  for table in (offsets.int32_table, lambda v: uneven._table(v, 0),  # pylint: disable=protected-access
                lambda v: collectives.Collectives(None).device_table(v)):
    with pytest.raises(ValueError, match="past the int32"):
      table(bases)
  np.testing.assert_array_equal(offsets.int32_table(bases[:2]), [0, 2_000_000_000])
  assert offsets.int32_table([-5, 7]).dtype == np.int32
