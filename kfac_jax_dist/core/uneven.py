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

# Cost model: a collective's fixed latency, in the numbers (float32) a link
# sends meanwhile (~10 µs at ~10 GB/s); a ppermute pads a piece by at most
# PACK_TOLERANCE of it, or by up to the latency.
LATENCY_NUMBERS = 2 ** 15
PACK_TOLERANCE = 0.05


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


def rechunk(sizes: Sequence[int]) -> Rechunk:
  """Tight chunks, and the overflow of each device over `C` placed in the room
  other devices leave, in device order (at most `#overflowing + #roomy − 1`
  pieces), packed into sends of similar sizes."""
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
  return Rechunk(tuple(sizes), chunk, _pack(pieces))


def _pack(pieces: list[Piece]) -> tuple[Send, ...]:
  """First fit, largest piece first: a piece joins a send whose owners and
  hosts it does not share and whose size pads it little (PACK_TOLERANCE, or
  less than a latency)."""
  sends: list[list] = []          # [size, pieces, owners, hosts]
  for piece in sorted(pieces, key=lambda q: (-q.size, q.owner, q.host)):
    for send in sends:
      if (piece.owner not in send[2] and piece.host not in send[3]
          and send[0] - piece.size <= max(PACK_TOLERANCE * send[0], LATENCY_NUMBERS)):
        break
    else:
      send = [piece.size, [], set(), set()]
      sends.append(send)
    send[1].append(piece)
    send[2].add(piece.owner)
    send[3].add(piece.host)
  return tuple(Send(size, tuple(members)) for size, members, _, _ in sends)


def cost(scheme: Prefix | Rechunk) -> float:
  """Numbers sent or received by the busiest device, plus each collective's
  latency (`LATENCY_NUMBERS`)."""
  return max(scheme.device_bytes()) + LATENCY_NUMBERS * scheme.num_collectives


def plan(sizes: tuple[int, ...]) -> Prefix | Rechunk:
  """The cheaper scheme by `cost` (the prefix scheme on a tie)."""
  return _plan(tuple(sizes), LATENCY_NUMBERS, PACK_TOLERANCE)


@functools.lru_cache(maxsize=256)
def _plan(sizes, latency, tolerance) -> Prefix | Rechunk:
  del latency, tolerance        # cache keys: the module settings `plan` was called with
  prefix = Prefix(sizes, prefix_length(sizes))
  if len(sizes) == 1:
    return prefix
  chunked = rechunk(sizes)
  return chunked if cost(chunked) < cost(prefix) else prefix


# ----------------------------------------------------------------- collectives


def _table(values, me) -> jax.Array:
  """`values[me]` for the traced device index `me`."""
  return jnp.asarray(np.asarray(values, np.int32))[me]


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
             to_owner: bool):
  """One ppermute of `send`: hosts' chunk numbers to owners (`to_owner`) or
  owners' segment numbers to hosts. Returns what this device receives, and
  where it goes and how much of it is used there (traced)."""
  read, write, used = ([0] * num_devices for _ in range(3))
  pairs = []
  for q in send.pieces:
    src, dst = (q.host, q.owner) if to_owner else (q.owner, q.host)
    read[src] = q.chunk_start if to_owner else q.segment_start
    write[dst], used[dst] = (q.segment_start if to_owner else q.chunk_start), q.size
    pairs.append((src, dst))
  received = jax.lax.ppermute(_take(x, _table(read, me), send.size), axis, pairs)
  return received, _table(write, me), _table(used, me)


def gather(segment: jax.Array, sizes: Sequence[int], axis: str, me,
           scheme: Prefix | Rechunk | None = None) -> list[jax.Array]:
  """Every device's `[L]` segment, of which device `i` uses the first
  `sizes[i]` numbers (the rest are zeros), → the list of every device's used
  numbers, `[sizes[i]]`, on every device (typed invariant over `axis`); `me`
  is the device index, `scheme` by default `plan(sizes)`."""
  p = len(sizes)
  scheme = scheme or plan(tuple(int(u) for u in sizes))
  if isinstance(scheme, Prefix):
    return _gather_prefix(segment, scheme, axis, me)
  c, keep, pad = scheme.chunk, scheme.keep, scheme.largest_send
  mine = jnp.where(jnp.arange(c + pad) < _table(keep, me), _take(segment, 0, c + pad), 0)
  for send in scheme.sends:
    mine = _add_at(mine, *_forward(send, segment, p, me, axis, to_owner=False))
  flat = _compat.all_gather_invariant(mine[:c], axis, tiled=True)
  parts = [[(0, i * c, keep[i])] for i in range(p)]
  for q in scheme.pieces():
    parts[q.owner].append((q.segment_start, q.host * c + q.chunk_start, q.size))
  return [jnp.concatenate([flat[at:at + n] for _, at, n in sorted(parts[i])])
          for i in range(p)]


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


def _gather_prefix(segment, scheme: Prefix, axis, me):
  p, prefix, sizes = len(scheme.sizes), scheme.length, scheme.sizes
  head = (_compat.all_gather_invariant(segment[:prefix], axis, tiled=False)
          if prefix else jnp.zeros((p, 0), segment.dtype))
  over = list(scheme.overflow)
  if not sum(over):
    return [head[i, :sizes[i]] for i in range(p)]
  # The tight overflow buffer holds device i's overflow at bases[i]; each
  # device writes its own there (zeros elsewhere) and the psum adds them up.
  bases, most = np.cumsum([0] + over[:-1]), max(over)
  mine = jnp.where(jnp.arange(most) < _table(over, me), _take(segment, prefix, most), 0)
  summed = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
      jnp.zeros(sum(over) + most, segment.dtype), mine, _table(bases, me), 0)[:sum(over)],
                        axis)
  return [jnp.concatenate([head[i, :min(sizes[i], prefix)],
                           summed[bases[i]:bases[i] + over[i]]]) for i in range(p)]


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
