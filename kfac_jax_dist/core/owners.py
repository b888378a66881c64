"""Owners: which device (or owner group) does which piece of work.

Both preconditioners spread their decompositions over the devices the same
way: KAISA's owner groups (§4.3; `m = grad_worker_fraction · P` devices per
group), and within them a greedy longest-processing-time assignment on two
criteria, the decomposition cost (`d³`) and the numbers each owner sends or
stores (`d²`). `assign` is that assignment; K-FAC's `layout` and Shampoo's
`blocks` call it for layers, factors, blocks and statistics.
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
           level: float = LEVEL, max_parts: int | None = None) -> list[list]:
  """Greedy two-criteria LPT with replication of oversized items.

  Items (largest relative cost or size first) go to the bin whose larger
  relative load — cost over its ideal `max(Σ cost / bins, largest cost)`,
  size over the share `Σ size / bins` — grows least. An item that splits into
  `units(x)` rows or columns (0: it does not) and is larger than the share
  goes as `r = ⌈size/share⌉` pieces of near-equal units to `r` distinct bins,
  each charged the item's whole cost and its piece's size. Then, while the
  fullest bin is over `level` times the share, it hands the last units of its
  cheapest splittable piece to the emptiest bin that holds no piece of that
  item and whose cost stays within the worst bin's. An item never has more
  than `max_parts` pieces (default: no limit).

  Splitting is tried only when the whole-item assignment leaves a bin over
  `level`, and kept only if it lowers the fullest bin's size without raising
  the worst bin's cost by more than 2% of the ideal.

  Returns, per bin, `(item, units)`: a `(lo, hi)` range of the item's units,
  or None for the whole item; without `units`, per bin its items.
  """
  whole, loads = _assign(items, bins, cost, size, lambda x: 0, level)
  if units is None:
    return [[x for x, _ in mine] for mine in whole]
  if max(load[1] for load in loads) <= level:
    return whole
  split, split_loads = _assign(items, bins, cost, size, units, level, max_parts)
  if (max(load[1] for load in split_loads) < max(load[1] for load in loads)
      and max(load[0] for load in split_loads) <= max(load[0] for load in loads) + 0.02):
    return split
  return whole


def _place_run(run: Sequence[int], c: float, z: float, loads: list[list[float]],
               put: Callable[[int, int, None], None]) -> None:
  """Each of `run` (equal items, relative cost `c` and size `z`, none held
  yet) whole to the bin whose key `(max(cost + c, size + z), cost + c, bin)`
  is least, as `min` over the bins would choose, from a heap of those keys:
  `O(log bins)` per item instead of `O(bins)`."""
  heap = [(max(cost + c, size + z), cost + c, j) for j, (cost, size) in enumerate(loads)]
  heapq.heapify(heap)
  for i in run:
    b = heapq.heappop(heap)[2]
    put(b, i, None)
    heapq.heappush(heap, (max(loads[b][0] + c, loads[b][1] + z), loads[b][0] + c, b))


def _assign(items, bins, cost, size, units, level, max_parts=None):
  costs, sizes = [cost(x) for x in items], [size(x) for x in items]
  counts = [units(x) for x in items]
  max_parts = max_parts or bins
  ideal_cost = max([sum(costs) / bins] + costs) or 1.0
  ideal_size = sum(sizes) / bins or 1.0
  loads = [[0.0, 0.0] for _ in range(bins)]
  held: list[dict] = [{} for _ in range(bins)]      # item index -> range or None

  def put(b: int, i: int, rng: tuple[int, int] | None, sign: float = 1.0) -> None:
    n = counts[i]
    share = 1.0 if rng is None else (rng[1] - rng[0]) / n
    loads[b][0] += sign * costs[i] / ideal_cost
    loads[b][1] += sign * share * sizes[i] / ideal_size
    if sign > 0:
      held[b][i] = None if rng is None or rng == (0, n) else rng
    else:
      del held[b][i]

  def parts_of(i: int) -> int:
    z, n = sizes[i] / ideal_size, counts[i]
    return min(bins, max_parts, n, math.ceil(z - 1e-9)) if n and z > 1 else 1

  def kind(i: int) -> tuple:
    return costs[i], sizes[i], counts[i], parts_of(i)

  order = sorted(range(len(items)),
                 key=lambda i: -max(costs[i] / ideal_cost, sizes[i] / ideal_size))
  for (cost_i, size_i, n, parts), run in itertools.groupby(order, key=kind):
    c, z = cost_i / ideal_cost, size_i / ideal_size
    if parts == 1:          # equal whole items (Shampoo: 1e6 blocks): one heap
      _place_run(list(run), c, z, loads, put)
      continue
    for i in run:
      for rng in _split(n, parts):
        zk = z * (rng[1] - rng[0]) / n
        b = min((j for j in range(bins) if i not in held[j]),
                key=lambda j: (max(loads[j][0] + c, loads[j][1] + zk), loads[j][0] + c, j))
        put(b, i, rng)

  worst = max(load[0] for load in loads)
  for _ in range(4 * bins + len(items)):
    b = max(range(bins), key=lambda j: (loads[j][1], -j))
    if loads[b][1] <= level:
      break
    for i in sorted((i for i in held[b] if counts[i]), key=lambda i: (costs[i], i)):
      n = counts[i]
      lo, hi = held[b][i] or (0, n)
      per, c = sizes[i] / ideal_size / n, costs[i] / ideal_cost
      if sum(i in mine for mine in held) >= max_parts:
        continue
      targets = [j for j in range(bins) if i not in held[j]
                 and loads[j][1] + per <= 1.0 and loads[j][0] + c <= worst + 1e-9]
      if not targets:
        continue
      t = min(targets, key=lambda j: (loads[j][1], j))
      move = min(hi - lo, math.ceil((loads[b][1] - 1.0) / per - 1e-9),
                 math.floor((1.0 - loads[t][1]) / per + 1e-9))
      if move <= 0:
        continue
      put(b, i, (lo, hi), -1.0)
      if move < hi - lo:
        put(b, i, (lo, hi - move))
      put(t, i, (hi - move, hi))
      break
    else:
      break             # nothing movable: the fullest bin stays as it is
  return [[(items[i], rng) for i, rng in mine.items()] for mine in held], loads


