"""The initial state built in the program (`core.initial`): the patterns
against dense numpy constructions, the traced K-FAC and Shampoo init against
the host-built one on every storage form and strategy, and XLA building only
each device's shard under `jax.jit(tx.init, out_shardings=...)`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import kfac_jax_dist as kd
from kfac_jax_dist.core import initial
from kfac_jax_dist.capture import triangles

import helpers


def _dense(piece) -> np.ndarray:
  """A piece's numbers, built directly: `eye(d)[:, lo:hi]` row-major, upper
  triangles of `eye(d)` (`np.triu_indices`), ones, or zeros (an int)."""
  if isinstance(piece, int):
    return np.zeros(piece)
  (kind, dim, width, low), length = piece
  if kind == initial.PACKED:
    one = np.eye(dim)[np.triu_indices(dim)]
  else:
    one = np.eye(dim)[:, low:low + width].reshape(-1)
  return np.tile(one, length // one.size)


@pytest.mark.parametrize("chunk", [5, 7, 64, 2 ** 16])
def test_runs_build_the_dense_patterns(monkeypatch, chunk):
  """Random pieces of every pattern, written from a random start of a
  `[rows, width]` array so that they cross rows, built in chunks (the last
  one overlapping the one before) equal the dense construction."""
  monkeypatch.setattr(initial, "CHUNK", chunk)
  rng = np.random.default_rng(chunk)
  makers = [lambda: initial.eye(int(rng.integers(1, 6)), int(rng.integers(1, 4))),
            lambda: initial.eye(5, int(rng.integers(1, 3)), (1, 4)),
            lambda: initial.ones(int(rng.integers(1, 9))),
            lambda: initial.packed_eye(int(rng.integers(1, 9)), int(rng.integers(1, 3))),
            lambda: initial.packed_eye(2, int(rng.integers(1, 5))),     # unit-wise
            lambda: int(rng.integers(1, 6))]                           # zeros
  pieces = [makers[k]() for k in rng.integers(0, len(makers), 60)]
  start, width = 5, 23
  flat = np.concatenate([np.zeros(start)] + [_dense(p) for p in pieces])
  rows = -(-flat.size // width) + 1
  expected = np.zeros(rows * width)
  expected[:flat.size] = flat
  runs = initial.lay_out(pieces, start, width)
  assert len(runs) < len(pieces) + flat.size // width + 1     # pieces merge
  for per_device in (None, 1):
    built = jax.jit(lambda: initial.build(runs, rows, width, jnp.float32, per_device))()
    np.testing.assert_array_equal(np.asarray(built).reshape(-1), expected)


def test_packed_rows_are_exact_up_to_30000():
  for d in (1, 2, 3, 1449, 4608, 23170, 30000):
    size = d * (d + 1) // 2
    k = np.unique(np.concatenate([np.arange(min(size, 5000)), size - 1 - np.arange(
        min(size, 5000)), np.random.default_rng(d).integers(0, size, 20000)]))
    i = np.asarray(jax.jit(triangles.packed_rows)(k, d)).astype(np.int64)
    start = lambda r: r * d - r * (r - 1) // 2
    assert np.all((start(i) <= k) & ((i == d - 1) | (start(i + 1) > k))), d


def test_packed_triangle_indices_reach_30000():
  """Packing a factor in the program (`triangles._traced_upper_positions`)
  once took the row of an entry from `(2d + 1)² − 8k`, which passes int32
  beyond d = 23169: a 24000-wide factor raised an OverflowError while tracing
  (x64 off, as users run). Now `packed_rows` gives it (exact to 30000, above)
  and the flat positions stay below d² < 2³¹; the programs lower (not run:
  2.9e8 indices)."""
  with jax.enable_x64(False):
    for d in (23170, 24000, 30000):
      jax.jit(triangles._traced_upper_positions, static_argnums=0).lower(d)


def _layers() -> kd.LayerRegistry:
  """Every factor form: full (packed or not; `big`'s 65-wide input factor is
  split by columns under COMM-OPT), diagonal (`emb`'s A, and `wide`'s G past
  max_factor_dim), unit-wise 2×2 blocks (`ln`)."""
  return kd.LayerRegistry((
      kd.TaggedLayer(name="emb", kind="embed", kernel_path="emb/embedding", bias_path=None,
                     kernel_shape=(7, 3), a_dim=7, g_dim=3, a_diagonal=True),
      kd.TaggedLayer(name="ln", kind="scale_and_shift", kernel_path="ln/scale",
                     bias_path="ln/bias", kernel_shape=(3,), a_dim=2, g_dim=3,
                     bias_shape=(3,)),
      kd.TaggedLayer(name="big", kind="dense", kernel_path="big/kernel",
                     bias_path="big/bias", kernel_shape=(64, 6), a_dim=65, g_dim=6,
                     bias_shape=(6,)),
      kd.TaggedLayer(name="wide", kind="dense", kernel_path="wide/kernel", bias_path=None,
                     kernel_shape=(6, 80), a_dim=6, g_dim=80),
      kd.TaggedLayer(name="small", kind="dense", kernel_path="small/kernel",
                     bias_path=None, kernel_shape=(4, 5), a_dim=4, g_dim=5),
  ))


def _params():
  shapes = {"emb": {"embedding": (7, 3)}, "ln": {"scale": (3,), "bias": (3,)},
            "big": {"kernel": (64, 6), "bias": (6,)}, "wide": {"kernel": (6, 80)},
            "small": {"kernel": (4, 5)}}
  return jax.tree.map(lambda s: jnp.ones(s, jnp.float32), shapes,
                      is_leaf=lambda s: isinstance(s, tuple))


CASES = {
    "one device": {},
    "one device, inverse": {"method": "inverse"},
    "one device, stale": {"stale_threshold": 0.1},
    "one device, EK-FAC": {"eigenvalue_correction": "ekfac"},
    "COMM-OPT": {"fraction": 1.0},
    "COMM-OPT, rows shared": {"fraction": 1.0, "max_factor_dim": None},
    "COMM-OPT, unpacked, all-reduce": {"fraction": 1.0, "symmetric_comm": False,
                                       "factor_reduction": "all_reduce"},
    "MEM-OPT": {"fraction": 1 / 8},
    "MEM-OPT, EK-FAC": {"fraction": 1 / 8, "eigenvalue_correction": "ekfac"},
    "HYBRID, inverse": {"fraction": 1 / 4, "method": "inverse"},
    "HYBRID, rows shared": {"fraction": 1 / 2},
    "DP-KFAC": {"fraction": 1 / 8, "factor_reduction": "local"},
}


# Eight of the twelve by default (CI time): every storage, form, group kind and
# optional part of the state (stale statistics', EK-FAC's).
CASES_BY_DEFAULT = ("one device", "one device, stale", "one device, EK-FAC",
                    "COMM-OPT, rows shared", "COMM-OPT, unpacked, all-reduce",
                    "MEM-OPT, EK-FAC", "HYBRID, inverse", "DP-KFAC")


@pytest.mark.parametrize("case", helpers.slow_unless(list(CASES), CASES_BY_DEFAULT))
def test_traced_kfac_init_equals_the_host_init(monkeypatch, case):
  """`jax.jit(tx.init)`, with and without the state's shardings, builds
  bit for bit the state `tx.init` builds on the host, whatever the storage
  (tight chunks or owner segments, packed or not), the factor forms and the
  owner groups; in chunks of 7 columns so that every array takes the loop."""
  monkeypatch.setattr(initial, "CHUNK", 7)
  options = dict(CASES[case])
  dist_options = {k: options.pop(k) for k in ("fraction", "symmetric_comm",
                                              "factor_reduction") if k in options}
  mesh = helpers.data_mesh(8)
  dist = None
  if dist_options:
    dist = kd.Distribution(mesh, grad_worker_fraction=dist_options.pop("fraction"),
                           **dist_options)
  tx = kd.scale_by_kfac(layers=_layers(), distribution=dist,
                        max_factor_dim=options.pop("max_factor_dim", 70), **options)
  params = _params()
  host = tx.init(params)
  forms = {place.form for plan in host.layout.plans for _, place in plan.places}
  assert forms == {"full", "diag", "unit"}
  if case == "COMM-OPT":
    assert any(place.copies for plan in host.layout.plans for _, place in plan.places)
  if case.endswith("rows shared"):          # several segments in a row, at columns
    assert host.layout.rows_shared
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), kd.partition_specs(host))
  for traced in (jax.jit(tx.init)(params),
                 jax.jit(tx.init, out_shardings=shardings)(params)):
    assert jax.tree.structure(traced) == jax.tree.structure(host)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(traced)):
      assert (a.shape, a.dtype) == (b.shape, b.dtype)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _mlp_layers_and_params():
  widths = [512, 1024, 768, 512, 10]
  layers, params = [], {}
  for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
    layers.append(kd.TaggedLayer(
        name=f"l{i}", kind="dense", kernel_path=f"l{i}/kernel", bias_path=f"l{i}/bias",
        kernel_shape=(n_in, n_out), a_dim=n_in + 1, g_dim=n_out, bias_shape=(n_out,)))
    params[f"l{i}"] = {"kernel": jax.ShapeDtypeStruct((n_in, n_out), jnp.float32),
                       "bias": jax.ShapeDtypeStruct((n_out,), jnp.float32)}
  return kd.LayerRegistry(tuple(layers)), params


@pytest.mark.parametrize("fraction", [1 / 8, 1 / 4])
def test_sharded_init_builds_each_devices_shard_alone(fraction):
  """`jax.jit(tx.init, out_shardings=...)` under MEM-OPT and HYBRID: XLA's
  temporaries per device are at most half of the device's shard of the state
  (the runs' marks in int8, and chunks of columns). Built by concatenating
  per-device pieces, as before `core.initial`, they were 2.5× (Shampoo,
  MEM-OPT) to 6.8× (K-FAC, HYBRID) the shard: about the whole global state
  on every device."""
  layers, params = _mlp_layers_and_params()
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction)
  for tx in (kd.kfac(0.1, layers=layers, distribution=dist),
             kd.shampoo(0.1, block_size=128, distribution=dist)):
    shapes = jax.eval_shape(tx.init, params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), kd.partition_specs(shapes))
    memory = jax.jit(tx.init, out_shardings=shardings).lower(params).compile(
        ).memory_analysis()
    shard = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))
    assert memory.output_size_in_bytes >= shard
    assert memory.temp_size_in_bytes <= 0.5 * shard, (tx, memory.temp_size_in_bytes, shard)


def test_init_sharded_places_the_arrays_of_shard_state():
  """`kd.init_sharded(tx.init, params, mesh)`: the arrays and shardings of
  `kd.shard_state(tx.init(params), mesh)`, for a chain holding K-FAC
  (MEM-OPT) and one holding Shampoo (COMM-OPT)."""
  mesh = helpers.data_mesh(8)
  params = _params()
  for tx in (kd.kfac(0.1, momentum=0.9, layers=_layers(), max_factor_dim=70,
                     distribution=kd.Distribution(mesh, grad_worker_fraction=1 / 8)),
             kd.shampoo(0.1, block_size=4, distribution=kd.Distribution(mesh))):
    placed = kd.shard_state(tx.init(params), mesh)
    built = kd.init_sharded(tx.init, params, mesh)
    assert jax.tree.structure(built) == jax.tree.structure(placed)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(built)):
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
