"""Uneven gathers and reduce-scatters (`uneven`): both schemes against stacking
and averaging the segments on 8 devices, and the rechunk plan's invariants."""

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
  return {"prefix": uneven.Prefix(sizes, uneven.prefix_length(sizes)),
          "rechunk": uneven.rechunk(sizes)}


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("name", ["prefix", "rechunk"])
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

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")),
                     out_specs=(P(), P("data")))
  def run(seg, loc):
    me = jax.lax.axis_index("data")
    rows = uneven.gather(seg[0], sizes, "data", me, scheme)
    assert [r.shape[0] for r in rows] == list(sizes)
    gathered = jnp.stack([jnp.pad(r, (0, length - r.shape[0])) for r in rows])
    mine = [loc[0, j, :u] for j, u in enumerate(sizes)]
    return gathered, uneven.reduce_scatter(mine, length, "data", me, scheme)[None]

  gathered, reduced = jax.jit(run)(segments, local)
  np.testing.assert_array_equal(np.asarray(gathered), segments)
  np.testing.assert_allclose(np.asarray(reduced), local.sum(0), rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("sizes", SIZES + [tuple(np.random.default_rng(s).integers(
    0, 1000, 64)) for s in range(3)] + [(5000,) + (10,) * 63])
def test_rechunk_plan_places_every_number_once(sizes):
  p, plan = len(sizes), uneven.rechunk(sizes)
  c = plan.chunk
  assert p * c >= sum(sizes) > p * (c - 1) or sum(sizes) == 0
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
  equal = kd.LayerRegistry(layers.layers[3:11])
  comm = kd.Distribution(mesh, grad_worker_fraction=1.0)
  text = kd.describe(kd.scale_by_kfac(layers=equal, distribution=comm).init(
      {k: v for k, v in params.items() if k in {f"l{i}" for i in range(3, 11)}}),
      print_table=False)
  assert "uneven collectives: eigenbasis broadcast prefix" in text, text
