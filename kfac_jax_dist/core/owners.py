"""Owners: which device (or owner group) does which piece of work.

Both preconditioners spread their decompositions over the devices the same
way: KAISA's owner groups (§4.3; `m = grad_worker_fraction · P` devices per
group), and within them a greedy longest-processing-time assignment on two
criteria, the decomposition cost (`d³`) and the numbers each owner sends or
stores (`d²`). `assign` is that assignment; K-FAC's `layout` and Shampoo's
`blocks` call it for layers, factors, blocks and statistics. `align_ranks`
moves several groups' assignments into one table of slots by rank (K-FAC's
HYBRID: one program runs in every group).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Callable, Sequence


def _split(units: int, parts: int, lo: int = 0) -> list[tuple[int, int]]:
  """`[lo, lo + units)` cut into `parts` near-equal ranges."""
  cuts = [lo + units * k // parts for k in range(parts + 1)]
  return list(itertools.pairwise(cuts))


LEVEL = 1.05   # a bin this far over its share hands units of split items over


def assign(items: Sequence, bins: int, cost: Callable[[Any], float],
           size: Callable[[Any], float], units: Callable[[Any], int] | None = None,
           level: float = LEVEL, max_parts: int | None = None, min_ideal: float = 0.0,
           min_share: float = 0.0, slack: float = 1.0, fewer_parts: bool = False
           ) -> list[list]:
  """Greedy two-criteria LPT with replication of oversized items.

  Items (largest relative cost or size first) go to the bin whose larger
  relative load — cost over its ideal `max(Σ cost / bins, largest cost,
  min_ideal)`, size over the share `max(Σ size / bins, min_share)` — grows
  least. (The floors are for bins that are part of a larger machine: one owner
  group among several, whose slowest device and largest group set the pace, not
  this group's own mean.) An item that splits into `units(x)` rows or columns
  (0: it does not) and is larger than `slack` times the share goes as `r =
  ⌈size/(slack·share)⌉` pieces of near-equal units to `r` distinct bins, each
  charged the item's whole cost and its piece's size. Then, while the fullest
  bin is over `level` times the share, it hands the last units of its cheapest
  splittable piece to the emptiest bin that holds no piece of that item and
  whose cost stays within the worst bin's. An item never has more than
  `max_parts` pieces (default: no limit).

  Splitting is tried only when the whole-item assignment leaves a bin over
  `level`, and kept only if it lowers the fullest bin's size without raising
  the worst bin's cost by more than 2% of the ideal. Where it would, with
  `fewer_parts`, again with fewer pieces an item (`_fewer_parts`, the first
  that passes): a piece in every bin charges each the item's whole cost, and
  the bins left free take the other items (a 784-512-10 MLP's layers on 8
  devices: its first layer, 7.9 shares, in 7 pieces, 1.13 shares each, the
  other layer on the 8th device, instead of the first layer whole on one).

  Returns, per bin, `(item, units)`: a `(lo, hi)` range of the item's units,
  or None for the whole item; without `units`, per bin its items.
  """
  targets = min_ideal, min_share, slack
  whole, loads = _assign(items, bins, cost, size, lambda x: 0, level, targets=targets)
  if units is None:
    return [[x for x, _ in mine] for mine in whole]
  if max(load[1] for load in loads) <= level:
    return whole
  for parts in _fewer_parts(max_parts or bins) if fewer_parts else [max_parts]:
    split, split_loads = _assign(items, bins, cost, size, units, level, parts, targets)
    if (max(load[1] for load in split_loads) < max(load[1] for load in loads)
        and max(load[0] for load in split_loads) <= max(load[0] for load in loads) + 0.02):
      return split
  return whole


def _fewer_parts(most: int) -> list[int]:
  """The caps on an item's pieces that `assign` tries, most first: every
  count from `most` down to 2 for `most ≤ 16`, else `most`, `most − 2ʲ` and
  `most / 2ʲ` (at least 2)."""
  if most <= 16:
    return list(range(most, 1, -1))
  powers = [2 ** j for j in range(most.bit_length())]
  caps = {most} | {most - p for p in powers} | {most // p for p in powers}
  return sorted((c for c in caps if c >= 2), reverse=True)


class _Bins:
  """The bins' loads while `_assign` fills them: per bin `[cost, size]`, each
  relative to its ideal (`assign`), and the pieces it holds (item index →
  `(lo, hi)` units, or None for the whole item)."""

  def __init__(self, costs: list[float], sizes: list[float], counts: list[int],
               bins: int, targets: tuple[float, float, float] = (0.0, 0.0, 1.0)):
    # targets: `assign`'s (min_ideal, min_share, slack)
    self.costs, self.sizes, self.counts, self.bins = costs, sizes, counts, bins
    self.ideal_cost = max([sum(costs) / bins, targets[0]] + costs) or 1.0
    self.ideal_size = max(sum(sizes) / bins, targets[1]) or 1.0
    self.slack = targets[2]
    self.loads = [[0.0, 0.0] for _ in range(bins)]
    self.held: list[dict] = [{} for _ in range(bins)]

  def cost(self, i: int) -> float:
    return self.costs[i] / self.ideal_cost

  def size(self, i: int) -> float:
    return self.sizes[i] / self.ideal_size

  def put(self, b: int, i: int, rng: tuple[int, int] | None, sign: float = 1.0) -> None:
    """Charge (`sign` 1) or refund (-1) bin `b` item `i`'s whole cost and
    the size of its units `rng` (None: all)."""
    n = self.counts[i]
    share = 1.0 if rng is None else (rng[1] - rng[0]) / n
    self.loads[b][0] += sign * self.costs[i] / self.ideal_cost
    self.loads[b][1] += sign * share * self.sizes[i] / self.ideal_size
    if sign > 0:
      self.held[b][i] = None if rng is None or rng == (0, n) else rng
    else:
      del self.held[b][i]

  def parts_of(self, i: int, max_parts: int) -> int:
    """Pieces of item `i`: `⌈size / (slack · share)⌉` when it splits and is
    larger than that, else 1."""
    z, n = self.size(i) / self.slack, self.counts[i]
    return min(self.bins, max_parts, n, math.ceil(z - 1e-9)) if n and z > 1 else 1


def _place_run(run: Sequence[int], c: float, z: float, bins: _Bins) -> None:
  """Each of `run` (equal items, relative cost `c` and size `z`, none held
  yet) whole to the bin whose key `(max(cost + c, size + z), cost + c, bin)`
  is least, as `min` over the bins would choose, from a heap of those keys:
  `O(log bins)` per item instead of `O(bins)`. The items then go to the
  chosen bins in order (the lowest bin takes the first ones): the same loads,
  and consecutive items (the blocks of a stacked layer) share an owner, which
  reads and packs them as slices (`layout.block_runs`)."""
  loads = [list(load) for load in bins.loads]
  heap = [(max(cost + c, size + z), cost + c, j) for j, (cost, size) in enumerate(loads)]
  heapq.heapify(heap)
  chosen = []
  for _ in run:
    b = heapq.heappop(heap)[2]
    chosen.append(b)
    loads[b][0] += c
    loads[b][1] += z
    heapq.heappush(heap, (max(loads[b][0] + c, loads[b][1] + z), loads[b][0] + c, b))
  for i, b in zip(run, sorted(chosen)):
    bins.put(b, i, None)


def _place(bins: _Bins, max_parts: int) -> None:
  """The greedy pass: items by decreasing larger relative load, each whole
  (or each of its pieces, to distinct bins) where the larger load grows least."""
  loads, held = bins.loads, bins.held

  def kind(i: int) -> tuple:
    return bins.costs[i], bins.sizes[i], bins.counts[i], bins.parts_of(i, max_parts)

  order = sorted(range(len(bins.costs)), key=lambda i: -max(bins.cost(i), bins.size(i)))
  for (_, _, n, parts), run in itertools.groupby(order, key=kind):
    if parts == 1:          # equal whole items (Shampoo: 1e6 blocks): one heap
      run = list(run)
      _place_run(run, bins.cost(run[0]), bins.size(run[0]), bins)
      continue
    for i in run:
      c = bins.cost(i)
      for rng in _split(n, parts):
        zk = bins.size(i) * (rng[1] - rng[0]) / n
        b = min((j for j in range(bins.bins) if i not in held[j]),
                key=lambda j: (max(loads[j][0] + c, loads[j][1] + zk), loads[j][0] + c, j))
        bins.put(b, i, rng)


def _hand_over(bins: _Bins, b: int, worst: float, max_parts: int) -> bool:
  """Bin `b` hands the last units of its cheapest splittable piece that can
  move to the emptiest bin that holds none of that item, stays within the
  share and keeps its cost within `worst`; False if no piece can move."""
  loads, held = bins.loads, bins.held
  for i in sorted((i for i in held[b] if bins.counts[i]), key=lambda i: (bins.costs[i], i)):
    n = bins.counts[i]
    lo, hi = held[b][i] or (0, n)
    per, c = bins.size(i) / n, bins.cost(i)
    if sum(i in mine for mine in held) >= max_parts:
      continue
    targets = [j for j in range(bins.bins) if i not in held[j]
               and loads[j][1] + per <= 1.0 and loads[j][0] + c <= worst + 1e-9]
    if not targets:
      continue
    t = min(targets, key=lambda j: (loads[j][1], j))
    move = min(hi - lo, math.ceil((loads[b][1] - 1.0) / per - 1e-9),
               math.floor((1.0 - loads[t][1]) / per + 1e-9))
    if move <= 0:
      continue
    bins.put(b, i, (lo, hi), -1.0)
    if move < hi - lo:
      bins.put(b, i, (lo, hi - move))
    bins.put(t, i, (hi - move, hi))
    return True
  return False


def _assign(items, bins: int, cost, size, units, level: float, max_parts=None,
            targets: tuple[float, float, float] = (0.0, 0.0, 1.0)):
  """`assign`'s one pass at a given `units` (`lambda x: 0`: items whole):
  the greedy placement, then, while the fullest bin is over `level`, units
  handed over (`_hand_over`). Returns per bin `[(item, range)]` and the loads."""
  state = _Bins([cost(x) for x in items], [size(x) for x in items],
                [units(x) for x in items], bins, targets)
  max_parts = max_parts or bins
  _place(state, max_parts)
  worst = max(load[0] for load in state.loads)
  for _ in range(4 * bins + len(items)):
    b = max(range(bins), key=lambda j: (state.loads[j][1], -j))
    if state.loads[b][1] <= level or not _hand_over(state, b, worst, max_parts):
      break               # balanced, or nothing movable: the fullest bin stays
  return [[(items[i], rng) for i, rng in mine.items()] for mine in state.held], state.loads




def align_ranks(groups: Sequence[Sequence[list]], size: Callable[[Any], float],
                cost: Callable[[Any], float], key: Callable[[Any], Any], limit: float
                ) -> list[list[list]]:
  """Each group's bins (`assign`'s pieces per device) moved to ranks so that
  the groups fill one table of slots: rank `r`'s slot is the largest of the
  groups' rank-`r` bins, so a group spread thin over many ranks widens slots
  that another group leaves nearly empty (one program runs in every group, so
  every group's array and gather use the table). Bins are sorted by size,
  then each group's bins are packed whole, by decreasing size, into the
  first slot (the largest first) whose room holds them, several to a slot,
  while the rank's cost stays within `limit` and no two pieces of one item
  (`key`) meet: the large slots fill and the small ones empty. A group that
  does not fit keeps its bins. Twice, the table recomputed between: Σ slots
  never grows.

  `size` and `cost` are a piece's, `(item, units)`; returns per group its
  bins by rank."""
  load = lambda pieces: sum(map(size, pieces))
  groups = [sorted(bins, key=load, reverse=True) for bins in groups]
  ranks = len(groups[0]) if groups else 0
  for _ in range(2):
    slots = [max(load(bins[r]) for bins in groups) for r in range(ranks)]
    groups = [_pack_into(bins, slots, size, cost, key, limit) or bins for bins in groups]
  return [sorted(bins, key=load, reverse=True) for bins in groups]


def _pack_into(bins: Sequence[list], slots: Sequence[float], size, cost, key,
               limit: float) -> list[list] | None:
  """`bins` packed whole into `slots` (first fit by decreasing size, costs
  within `limit`, no item twice on a rank); None if some bin does not fit."""
  out: list[list] = [[] for _ in slots]
  room, spent = list(slots), [0.0] * len(slots)
  held: list[set] = [set() for _ in slots]
  for z, pieces in sorted(((sum(map(size, b)), b) for b in bins if b),
                          key=lambda t: t[0], reverse=True):
    c, keys = sum(map(cost, pieces)), {key(p) for p in pieces}
    fits = [r for r in range(len(slots)) if z <= room[r] * (1 + 1e-9) and
            spent[r] + c <= limit * (1 + 1e-9) and not keys & held[r]]
    if not fits:
      return None
    r = fits[0]
    out[r] += pieces
    room[r] -= z
    spent[r] += c
    held[r] |= keys
  return out
