"""Uneven collectives: per-device segments of different sizes, no padded traffic.

Owners hold uneven amounts — device `i` uses the first `uᵢ` numbers of its
segment of `L ≥ max u` — and every device needs every segment (gather), or
each device needs its own segment summed over the devices (reduce-scatter, the
mirror). A ring collective of whole segments sends `(P−1)·L` per device where
the papers' ideal is `(P−1)/P·Σu`. Two schemes, chosen per call by the ring
model of the bytes each device sends or receives (`plan`):

* **prefix**: the first `S = prefix_length(u)` numbers of every segment by one
  all_gather / psum_scatter, `(P−1)·S`, and the overflow beyond `S`, packed
  tight, by one psum, `2(P−1)/P` of it. Good when few devices overflow.
* **rechunk**: the segments are laid out in `P` tight chunks of
  `C = ⌈Σu/P⌉`: chunk `i` starts with the first `min(uᵢ, C)` numbers of
  device `i`'s own segment, and the overflow of devices with `uᵢ > C` fills
  the room the others leave. A reduce-scatter is one psum_scatter of the
  chunks (the ideal bytes), after which point-to-point sends (`ppermute`)
  forward each overflow piece from the device holding its chunk to its owner;
  a gather is the mirror (owners send their overflow pieces to the chunks'
  devices, then one all_gather of the chunks). Per device `(P−1)·C` plus at
  most its own overflow or its room (about `Σu/P`): within `1 + 1/(P−1)`
  of the ideal for senders, and within the largest segment's share of `Σu`
  for its owner's receives, whatever the sizes. Pieces of similar size share
  one `ppermute`, padded by at most `PACK_TOLERANCE` (or a latency's worth).
  The chunks may also be longer than `⌈Σu/P⌉` (`matched`): each extra number
  costs `P−1` in the all_gather but shrinks every overflow and grows every
  room, until one ppermute forwards all the overflow — two collectives, as
  the prefix scheme, at close to the rechunk's bytes.

Each collective is charged a latency, `LATENCY_NUMBERS` numbers (`set_latency`,
`measure_latency`): the rechunk's ppermutes pay off only where the bytes they
save exceed it.

SP-NGD (Osawa et al. 2019) reduce-scatters raw gradients to their layers'
owners and gathers the preconditioned ones; MEM-OPT (KAISA) gathers them; a
layer's gradient is one owner's, so one large layer makes the sizes uneven.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_dist import _compat
from kfac_jax_dist.core import offsets

# The cost model's latency: what one collective costs beyond its bytes,
# counted in the float32 numbers a link sends meanwhile (latency × bandwidth
# / 4 B). The default, 2¹⁵ numbers (128 kB), is ~10 µs at ~13 GB/s; a GPU
# fabric (NVLink: ~5–10 µs at 100–400 GB/s) is nearer 2¹⁷–2²⁰, a slow
# network's latency larger still. Set it with `set_latency` (a figure from
# `measure_latency` on the real mesh) before the training step is traced;
# `plan` keys its cache on it. A ppermute pads a piece by at most
# PACK_TOLERANCE of it, or by up to the latency.
LATENCY_NUMBERS = 2 ** 15
PACK_TOLERANCE = 0.05
FEWER_COLLECTIVES = 1e-3    # relative cost a plan with fewer collectives may add

Groups = Sequence[Sequence[int]] | None    # axis_index_groups of equal size


@dataclasses.dataclass(frozen=True)
class Piece:
  """Numbers `[segment_start, +size)` of `owner`'s segment, held at
  `[chunk_start, +size)` of `host`'s chunk."""
  owner: int
  host: int
  segment_start: int
  chunk_start: int
  size: int


@dataclasses.dataclass(frozen=True)
class Send:
  """One `ppermute`: each piece travels between its owner and its host in a
  buffer of `size` numbers (owners and hosts distinct within a send)."""
  size: int
  pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class Prefix:
  """The prefix scheme: `length` numbers of each segment by all_gather /
  psum_scatter, the overflow by a psum."""
  sizes: tuple[int, ...]
  length: int

  @property
  def overflow(self) -> tuple[int, ...]:
    return tuple(max(0, u - self.length) for u in self.sizes)

  def device_bytes(self) -> tuple[float, float]:
    """Numbers (sent, received) by the busiest device, ring model."""
    p = len(self.sizes)
    cost = (p - 1) * self.length + 2 * (p - 1) / p * sum(self.overflow)
    return cost, cost

  @property
  def num_collectives(self) -> int:
    return (self.length > 0) + (sum(self.overflow) > 0)


@dataclasses.dataclass(frozen=True)
class Rechunk:
  """The rechunk scheme: tight chunks of `chunk` numbers, `keep[i]` of device
  `i`'s own segment first in its chunk, the overflow in `sends`."""
  sizes: tuple[int, ...]
  chunk: int
  sends: tuple[Send, ...]

  @property
  def keep(self) -> tuple[int, ...]:
    return tuple(min(u, self.chunk) for u in self.sizes)

  @property
  def largest_send(self) -> int:
    return max((send.size for send in self.sends), default=0)

  def pieces(self) -> list[Piece]:
    return [piece for send in self.sends for piece in send.pieces]

  def forwarded(self) -> tuple[np.ndarray, np.ndarray]:
    """Numbers each device sends as a host, and receives as an owner, in the
    reduce-scatter's ppermutes (the gather's are the mirror)."""
    p = len(self.sizes)
    hosted, owned = np.zeros(p), np.zeros(p)
    for send in self.sends:
      for piece in send.pieces:
        hosted[piece.host] += send.size
        owned[piece.owner] += send.size
    return hosted, owned

  def device_bytes(self) -> tuple[float, float]:
    """Numbers (sent, received) by the busiest device, ring model, in the
    reduce-scatter (the gather swaps them)."""
    p = len(self.sizes)
    hosted, owned = self.forwarded()
    tight = (p - 1) * self.chunk
    return tight + float(hosted.max()), tight + float(owned.max())

  @property
  def num_collectives(self) -> int:
    return 1 + len(self.sends)


def prefix_length(sizes: Sequence[int]) -> int:
  """The prefix `S` of the prefix scheme.

  Ring model, per device: an all_gather of `S` numbers from each of `P`
  devices sends `(P−1)·S`; a psum of the overflow `Σ max(0, uᵢ − S)` sends
  `2(P−1)/P` of it. Raising `S` pays off while more than `P/2` devices
  overflow, so the best `S` is the `⌈P/2⌉`-th largest size (at most all of
  them: equal sizes need no psum).
  """
  return min(sorted(set(sizes)) + [0],
             key=lambda s: (Prefix(tuple(sizes), s).device_bytes()[0], -s))


def rechunk(sizes: Sequence[int], latency: int | None = None) -> Rechunk:
  """Tight chunks, and the overflow of each device over `C` placed in the room
  other devices leave, in device order (at most `#overflowing + #roomy − 1`
  pieces), packed into sends of similar sizes (`_pack`, padding a piece by up
  to `latency` numbers; default `LATENCY_NUMBERS`)."""
  p, total = len(sizes), sum(sizes)
  chunk = max(1, -(-total // p))
  keep = [min(u, chunk) for u in sizes]
  rooms = [[i, keep[i], chunk - keep[i]] for i in range(p) if keep[i] < chunk]
  pieces = []
  for owner, u in enumerate(sizes):
    start = keep[owner]
    while start < u:
      room = rooms[0]
      size = min(u - start, room[2])
      pieces.append(Piece(owner, room[0], start, room[1], size))
      start += size
      room[1] += size
      room[2] -= size
      if not room[2]:
        rooms.pop(0)
  return Rechunk(tuple(sizes), chunk, _pack(pieces, LATENCY_NUMBERS if latency is None
                                            else latency))


def matched(sizes: Sequence[int], chunk: int) -> Rechunk:
  """The rechunk scheme with chunks of `chunk ≥ ⌈Σu/P⌉` numbers, the overflow
  forwarded in rounds: each round pairs the largest remaining overflows with
  the largest remaining rooms, one piece per pair, and is one ppermute.

  A larger chunk costs `(P−1)` numbers per extra number of chunk in the
  all_gather but shrinks every overflow and grows every room by as much: one
  round then fits every overflow (the `i`-th largest into the `i`-th largest
  room) once the chunk exceeds `⌈Σu/P⌉` by half the largest shortfall, two
  collectives in all where the tight chunks need a ppermute per piece.
  """
  p = len(sizes)
  keep = [min(u, chunk) for u in sizes]
  over = {i: [keep[i], u] for i, u in enumerate(sizes) if u > chunk}   # [next, end)
  room = {i: [keep[i], chunk] for i in range(p) if keep[i] < chunk}
  if sum(e - s for s, e in over.values()) > sum(e - s for s, e in room.values()):
    raise ValueError(f"chunk {chunk} is below ⌈Σu/P⌉ for sizes {tuple(sizes)}")
  sends = []
  while over:
    owners = sorted(over, key=lambda i: (over[i][0] - over[i][1], i))
    hosts = sorted(room, key=lambda i: (room[i][0] - room[i][1], i))
    pieces = []
    for o, h in zip(owners, hosts):
      size = min(over[o][1] - over[o][0], room[h][1] - room[h][0])
      pieces.append(Piece(o, h, over[o][0], room[h][0], size))
      over[o][0] += size
      room[h][0] += size
      if over[o][0] == over[o][1]:
        del over[o]
      if room[h][0] == room[h][1]:
        del room[h]
    sends.append(Send(max(q.size for q in pieces), tuple(pieces)))
  return Rechunk(tuple(sizes), chunk, tuple(sends))


def chunk_candidates(sizes: Sequence[int]) -> list[int]:
  """Chunk sizes worth trying for `matched`, ascending: `⌈Σu/P⌉`, every
  size above it (where a device stops overflowing), and from each of these
  the smallest chunk at which one round fits every overflow."""
  p, largest = len(sizes), max(sizes, default=0)
  base = max(1, -(-sum(sizes) // p))
  starts = sorted({base} | {u for u in sizes if u > base})
  found = set(starts)
  for c in starts:
    over = sorted((u - c for u in sizes if u > c), reverse=True)
    rooms = sorted((c - u for u in sizes if u < c), reverse=True)
    if over and len(over) <= len(rooms):
      found.add(c + max(0, max(-(-(v - r) // 2) for v, r in zip(over, rooms))))
  return sorted(c for c in found if c <= max(largest, base))


def _pack(pieces: list[Piece], latency: int) -> tuple[Send, ...]:
  """First fit, largest piece first: a piece joins a send whose owners and
  hosts it does not share and whose size pads it little (PACK_TOLERANCE, or
  less than a latency)."""
  sends: list[list] = []          # [size, pieces, owners, hosts]
  for piece in sorted(pieces, key=lambda q: (-q.size, q.owner, q.host)):
    for send in sends:
      if (piece.owner not in send[2] and piece.host not in send[3]
          and send[0] - piece.size <= max(PACK_TOLERANCE * send[0], latency)):
        break
    else:
      send = [piece.size, [], set(), set()]
      sends.append(send)
    send[1].append(piece)
    send[2].add(piece.owner)
    send[3].add(piece.host)
  return tuple(Send(size, tuple(members)) for size, members, _, _ in sends)


def cost(scheme: Prefix | Rechunk, latency: int | None = None) -> float:
  """Numbers sent or received by the busiest device, plus each collective's
  latency (default `LATENCY_NUMBERS`)."""
  latency = LATENCY_NUMBERS if latency is None else latency
  return max(scheme.device_bytes()) + latency * scheme.num_collectives


def plan(sizes: tuple[int, ...], psum: bool = True) -> Prefix | Rechunk:
  """The cheapest scheme by `cost` (within `FEWER_COLLECTIVES` of it, the
  fewest collectives; the prefix scheme on a tie) under the module's
  `LATENCY_NUMBERS` and `PACK_TOLERANCE`; without `psum` (within
  owner groups: `shard_map` has no grouped psum) a prefix has no overflow."""
  return _plan(tuple(int(u) for u in sizes), LATENCY_NUMBERS, PACK_TOLERANCE, psum)


@functools.lru_cache(maxsize=256)
def _plan(sizes, latency, tolerance, psum) -> Prefix | Rechunk:
  """Among the prefix scheme, `rechunk` and `matched` at each of
  `chunk_candidates` (ascending, stopping where the all_gather alone costs
  more than the best so far), the cheapest by `cost`, or within
  `FEWER_COLLECTIVES` of it the one with the fewest collectives: each
  ppermute is an operation of its own in every device's program (GPT-2-XL's
  EK-FAC gather under MEM-OPT at P = 1024: 15 collectives instead of 75, for
  0.02% more bytes)."""
  del tolerance                 # a cache key: the module setting `_pack` reads
  found = [Prefix(sizes, prefix_length(sizes) if psum else max(sizes))]
  if len(sizes) > 1:
    found.append(rechunk(sizes, latency))
  best = min(cost(scheme, latency) for scheme in found)
  for chunk in chunk_candidates(sizes) if len(sizes) > 1 else ():
    if (len(sizes) - 1) * chunk + latency >= best * (1 + FEWER_COLLECTIVES):
      break
    found.append(matched(sizes, chunk))
    best = min(best, cost(found[-1], latency))
  near = [s for s in found if cost(s, latency) <= best * (1 + FEWER_COLLECTIVES)]
  return min(near, key=lambda s: (s.num_collectives, cost(s, latency)))


def set_latency(numbers: float) -> None:
  """Sets the cost model's latency, `LATENCY_NUMBERS`: the float32 numbers a
  link sends during one collective's fixed cost (latency × bandwidth / 4 B;
  `measure_latency` gives it for a mesh). It steers `plan`'s choice of
  scheme for every uneven collective traced afterwards (a step already
  compiled keeps its scheme). Raises `ValueError` unless a finite number ≥ 0.
  """
  global LATENCY_NUMBERS
  if (isinstance(numbers, bool) or not isinstance(numbers, (int, float, np.number))
      or not np.isfinite(numbers) or numbers < 0):
    raise ValueError(f"set_latency: the latency must be a finite number of float32 "
                     f"numbers >= 0 (latency × bandwidth / 4 B), got {numbers!r}")
  LATENCY_NUMBERS = int(round(float(numbers)))


def measure_latency(mesh: jax.sharding.Mesh, axis: str = "data",
                    numbers: tuple[int, int] = (1, 2 ** 22), repeats: int = 10) -> int:
  """The latency figure of `set_latency` for the devices of `mesh`'s `axis`,
  measured: the median time `t` of an all_gather of `n` float32 numbers per
  device, for the two `numbers`, fitted to `t = α + (P−1)·n/β` (the cost
  model's busiest device: `(P−1)·n` numbers, plus one latency); returns
  `α·β` numbers (0 where the fit finds no latency). Run it on the real
  mesh (every process of a multi-host run calls it, as a training step);
  on host CPU devices the figure says nothing about a network.
  """
  # pylint: disable=import-outside-toplevel
  import time
  from jax.sharding import NamedSharding, PartitionSpec
  p = int(mesh.shape[axis])
  if p < 2:
    return 0
  gather = jax.jit(jax.shard_map(
      lambda x: _compat.all_gather_invariant(x, axis, tiled=True), mesh=mesh,
      in_specs=PartitionSpec(axis), out_specs=PartitionSpec()))
  times = []
  for n in numbers:
    x = jax.device_put(np.zeros(p * n, np.float32), NamedSharding(mesh, PartitionSpec(axis)))
    jax.block_until_ready(gather(x))                       # compile and warm up
    runs = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(gather(x))
      runs.append(time.perf_counter() - start)
    times.append(float(np.median(runs)))
  (n0, n1), (t0, t1) = numbers, times
  if t1 <= t0:
    return 0
  per_number = (t1 - t0) / ((p - 1) * (n1 - n0))        # 1/β, seconds per number
  return max(0, int(round((t0 - (p - 1) * n0 * per_number) / per_number)))


# ----------------------------------------------------------------- collectives


def _table(values, me) -> jax.Array:
  """`values[me]` for the traced device index `me`."""
  return jnp.asarray(offsets.int32_table(values))[me]


def _add_at(x: jax.Array, piece: jax.Array, start, used) -> jax.Array:
  """`x[start:start + used] += piece[:used]` with traced `start`, `used`
  (`x` padded by at least `piece`'s size at the end)."""
  size = piece.shape[0]
  piece = jnp.where(jnp.arange(size) < used, piece, 0)
  window = jax.lax.dynamic_slice_in_dim(x, start, size)
  return jax.lax.dynamic_update_slice_in_dim(x, window + piece, start, 0)


def _take(x: jax.Array, start, size: int) -> jax.Array:
  """`x[start:start + size]` with traced `start`, zeros past the end."""
  return jax.lax.dynamic_slice_in_dim(jnp.pad(x, (0, size)), start, size)


def _forward(send: Send, x: jax.Array, num_devices: int, me, axis: str,
             to_owner: bool, groups: Groups = None):
  """One ppermute of `send`: hosts' chunk numbers to owners (`to_owner`) or
  owners' segment numbers to hosts (the same ranks in each of `groups`).
  Returns what this device receives, and where it goes and how much of it
  is used there (traced)."""
  read, write, used = ([0] * num_devices for _ in range(3))
  pairs = []
  for q in send.pieces:
    src, dst = (q.host, q.owner) if to_owner else (q.owner, q.host)
    read[src] = q.chunk_start if to_owner else q.segment_start
    write[dst], used[dst] = (q.segment_start if to_owner else q.chunk_start), q.size
    pairs.append((src, dst))
  if groups is not None:
    pairs = [(group[src], group[dst]) for group in groups for src, dst in pairs]
  received = jax.lax.ppermute(_take(x, _table(read, me), send.size), axis, pairs)
  return received, _table(write, me), _table(used, me)


def _all_gather(x: jax.Array, axis: str, groups: Groups) -> jax.Array:
  """Tiled all_gather over the axis (typed invariant) or within each group."""
  if groups is None:
    return _compat.all_gather_invariant(x, axis, tiled=True)
  return jax.lax.all_gather(x, axis, axis_index_groups=groups, tiled=True)


@dataclasses.dataclass(frozen=True)
class Gathered:
  """Every device's used numbers after a gather, read where they arrived
  instead of copied out into an array per device (a slice and a
  concatenation per device: O(P) operations in the program). Device `i`'s
  numbers are the runs `parts[i]`, each `(array, at, size)`: `size` numbers
  of `arrays[array]` from `at`, in order."""
  arrays: tuple[jax.Array, ...]
  parts: tuple[tuple[tuple[int, int, int], ...], ...]

  def __len__(self) -> int:
    return len(self.parts)

  def __getitem__(self, device: int) -> jax.Array:
    return self.read(device, 0, self.size(device))

  def __iter__(self):
    return (self[i] for i in range(len(self)))

  def size(self, device: int) -> int:
    return sum(n for _, _, n in self.parts[device])

  def _pieces(self, device: int, start: int, size: int) -> list[tuple[int, int, int]]:
    """`(array, at, size)` runs of numbers `[start, start + size)` of `device`'s."""
    out, offset = [], 0
    for array, at, n in self.parts[device]:
      lo, hi = max(start, offset), min(start + size, offset + n)
      if lo < hi:
        out.append((array, at + lo - offset, hi - lo))
      offset += n
    return out

  def read(self, device: int, start: int, size: int) -> jax.Array:
    """Numbers `[start, start + size)` of `device`'s: one slice of each run
    they cross (one, unless they cross a forwarded piece's edge)."""
    pieces = [self.arrays[a][at:at + n] for a, at, n in self._pieces(device, start, size)]
    if len(pieces) == 1:
      return pieces[0]
    return jnp.concatenate(pieces) if pieces else jnp.zeros(0, self.arrays[0].dtype)

  def numbers(self, points: Sequence[tuple[int, int]]) -> jax.Array:
    """`[n]`: number `k` of device `i` for each `(i, k)` of `points`, by one
    gather of constant positions per array (a slice each past int32)."""
    where = [self._pieces(i, k, 1)[0][:2] for i, k in points]
    if any(self.arrays[a].shape[0] > offsets.INT32_MAX for a, _ in where):
      return jnp.stack([self.arrays[a][at] for a, at in where])
    picked, order = [], []
    for a, array in enumerate(self.arrays):
      mine = [j for j, (b, _) in enumerate(where) if b == a]
      if mine:
        picked.append(array[offsets.int32_table([where[j][1] for j in mine])])
        order += mine
    out = jnp.concatenate(picked) if len(picked) > 1 else picked[0]
    if order != sorted(order):
      out = out[offsets.int32_table(np.argsort(order))]
    return out

  def padded(self, length: int) -> jax.Array:
    """`[P·length]`: each device's numbers, zeros past them to `length`."""
    return self.in_rows([[device] for device in range(len(self))], length)

  def in_rows(self, rows: Sequence[Sequence[int]], length: int) -> jax.Array:
    """`[len(rows)·length]`: row after row, the numbers of its devices one
    after the other, zeros past them to `length`: one concatenation of the
    runs' slices and the zeros."""
    pieces, zeros = [], {}        # one array of zeros per length
    for devices in rows:
      for device in devices:
        pieces += [self.arrays[a][at:at + n] for a, at, n in self.parts[device]]
      n = length - sum(self.size(device) for device in devices)
      if n > 0:
        if n not in zeros:
          zeros[n] = jnp.zeros(n, self.arrays[0].dtype)
        pieces.append(zeros[n])
    return jnp.concatenate(pieces)


def gather(segment: jax.Array, sizes: Sequence[int], axis: str, me,
           scheme: Prefix | Rechunk | None = None, groups: Groups = None) -> Gathered:
  """Every device's `[L]` segment, of which device `i` uses the first
  `sizes[i]` numbers (the rest are zeros), → every device's used numbers,
  `[sizes[i]]`, on every device (typed invariant over `axis`), as they
  arrived (`Gathered`); `me` is the device index, `scheme` by default
  `plan(sizes)`. With `groups` (lists of the axis's devices, `sizes` and
  `me` by rank in a group), within each group alike."""
  p = len(sizes)
  sizes = tuple(int(u) for u in sizes)
  scheme = scheme or (plan(sizes) if groups is None else plan(sizes, psum=False))
  if isinstance(scheme, Prefix):
    return _gather_prefix(segment, scheme, axis, me, groups)
  c, keep, pad = scheme.chunk, scheme.keep, scheme.largest_send
  mine = jnp.where(jnp.arange(c + pad) < _table(keep, me), _take(segment, 0, c + pad), 0)
  for send in scheme.sends:
    mine = _add_at(mine, *_forward(send, segment, p, me, axis, False, groups))
  flat = _all_gather(mine[:c], axis, groups)
  parts = [[(0, 0, i * c, keep[i])] for i in range(p)]
  for q in scheme.pieces():
    parts[q.owner].append((q.segment_start, 0, q.host * c + q.chunk_start, q.size))
  return Gathered((flat,), tuple(tuple(run[1:] for run in sorted(parts[i]) if run[3])
                                 for i in range(p)))


def reduce_scatter(segments: Sequence[jax.Array], length: int, axis: str, me,
                   scheme: Prefix | Rechunk | None = None) -> jax.Array:
  """This device's contribution to every device's segment, `segments[i]` of
  `[uᵢ]` numbers → this device's `[L]` (`L = length ≥ max u`; zeros past
  its `u`), summed over the devices (typed varying over `axis`): the mirror
  of `gather`."""
  p, sizes = len(segments), tuple(int(x.shape[0]) for x in segments)
  scheme = scheme or plan(sizes)
  if isinstance(scheme, Prefix):
    return _reduce_prefix(segments, length, scheme, axis, me)
  c, keep = scheme.chunk, scheme.keep
  dtype = segments[0].dtype
  hosted = [[(0, segments[i][:keep[i]])] for i in range(p)]
  for q in scheme.pieces():
    hosted[q.host].append(
        (q.chunk_start, segments[q.owner][q.segment_start:q.segment_start + q.size]))
  tight = []
  for i in range(p):
    tight += [x for _, x in sorted(hosted[i], key=lambda t: t[0])]
    tight.append(jnp.zeros(c - sum(x.shape[0] for _, x in hosted[i]), dtype))
  chunk = jax.lax.psum_scatter(jnp.concatenate(tight), axis, scatter_dimension=0,
                               tiled=True)
  pad = scheme.largest_send
  out = jnp.where(jnp.arange(length + pad) < _table(keep, me),
                  _take(chunk, 0, length + pad), 0)
  for send in scheme.sends:
    out = _add_at(out, *_forward(send, chunk, p, me, axis, to_owner=True))
  return out[:length]


def _gather_prefix(segment, scheme: Prefix, axis, me, groups: Groups = None) -> Gathered:
  p, prefix, sizes = len(scheme.sizes), scheme.length, scheme.sizes
  head = _all_gather(segment[:prefix], axis, groups) if prefix else jnp.zeros(
      0, segment.dtype)
  parts = [[(0, i * prefix, min(u, prefix))] if min(u, prefix) else []
           for i, u in enumerate(sizes)]
  over = list(scheme.overflow)
  if not sum(over):
    return Gathered((head,), tuple(map(tuple, parts)))
  if groups is not None:
    raise ValueError("a prefix with overflow needs a psum, which shard_map has not "
                     "within groups: plan(sizes, psum=False)")
  # The tight overflow buffer holds device i's overflow at bases[i]; each
  # device writes its own there (zeros elsewhere) and the psum adds them up.
  bases, most = np.cumsum([0] + over[:-1]), max(over)
  mine = jnp.where(jnp.arange(most) < _table(over, me), _take(segment, prefix, most), 0)
  summed = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
      jnp.zeros(sum(over) + most, segment.dtype), mine, _table(bases, me), 0)[:sum(over)],
                        axis)
  for i in range(p):
    if over[i]:
      parts[i].append((1, int(bases[i]), over[i]))
  return Gathered((head, summed), tuple(map(tuple, parts)))


def _reduce_prefix(segments, length, scheme: Prefix, axis, me):
  prefix, dtype = scheme.length, segments[0].dtype
  head = (jax.lax.psum_scatter(
      jnp.concatenate([jnp.pad(x[:prefix], (0, prefix - min(x.shape[0], prefix)))
                       for x in segments]), axis, scatter_dimension=0, tiled=True)
          if prefix else jnp.zeros(0, dtype))
  over = list(scheme.overflow)
  tail = jnp.zeros(length - prefix, dtype)
  if sum(over):
    summed = jax.lax.psum(jnp.concatenate([x[prefix:] for x in segments]), axis)
    # This device's overflow, at its base in the tight buffer.
    tail = jnp.where(jnp.arange(length - prefix) < _table(over, me),
                     _take(summed, _table(np.cumsum([0] + over[:-1]), me), length - prefix),
                     0)
  return jnp.concatenate([head, tail])
