"""Owners, packed segments and batches: where every Kronecker factor lives.

For a data axis of P devices (P = 1 on one device) each factor has one owner,
the device that decomposes it. The devices form `P/m` owner groups of `m`
consecutive devices (KAISA §4.3, `m` gradient workers per layer): every layer
belongs to one group, longest processing time first on the cost model `d³`
(as KAISA assigns its work), and the group's factors are spread over its `m`
devices the same way.

State is stored in flat per-device segments, so that neither compute,
memory nor communication pays for padding matrices:

* running factors, each packed (the upper triangle, `d(d+1)/2` numbers, when
  `packed`; all `d²` otherwise; `d` for a diagonal factor) and laid out owner
  by owner, each owner's factors one after the other. Two storages:

  - "chunked" (factor reduction by reduce-scatter, and one device): the owners'
    factors form one tight buffer of `T` numbers, cut into `P` equal chunks of
    `C = ⌈T/P⌉`; device `i` holds chunk `i`. The reduce-scatter of the
    statistics then sends exactly the papers' `(P−1)/P·T` numbers per device
    whatever the factor sizes, and each device stores `T/P`. On a
    decomposition step the chunks are all-gathered and each owner reads its own
    factors (a factor larger than `T/P` cannot live on one device of a tight
    reduce-scatter otherwise);
  - "owner" (KAISA's all-reduce, DP-KFAC's local factors): device `i` holds
    its own factors, `[L]`, zero-padded to the longest owner's `L`;
* second-order state: segment `[L₂]` per owner with, per factor, a matrix part
  (eigenbasis or inverse, `d²`) and a vector part (eigenvalues, or a diagonal
  inverse, `d`). After a decomposition the owner group all-gathers its
  segments, and each device holds its group's segments one after another
  (`Layout.second_slots`: one row, or rows as wide as int32 indices allow),
  not `m·L₂` (at pod scale most owners hold far less than the longest); with
  one group, every owner's.

Within a segment, factors of the same form and dimension are contiguous: each
such run is one batched `eigh`/`cholesky` ("bucket"). The only padding is at
the end of a segment, up to the longest device's (and, for chunked factors,
fewer than `P` numbers at the end of the tight buffer).

Oversized items are replicated. An item that travels whole from its owner — a
factor's eigenbasis and eigenvalues gathered within its owner group (all
devices under COMM-OPT, the `m` of a group under HYBRID), a layer's
preconditioned gradient gathered from its owner group (MEM-OPT, HYBRID) —
larger than a device's (group's) share `Σ/P` makes its owner send more than the
ring's `(P−1)/P·Σ/P`. Such an item gets `r = ⌈size/share⌉` owners (capped so
that the copies stay within a compile budget, see `build`), each paying the
whole `d³` of the decomposition but sending `1/r` of the item: factor owner `k`
keeps eigenvector columns `[c_k, c_{k+1})` (and their eigenvalues, or those
columns of a damped inverse), a replicated layer's group `k` preconditions and
sends output rows `[r_k, r_{k+1})` of `(d_A, d_G)`. After the first assignment,
devices still over their share by more than 5% hand rows/columns of their
cheapest splittable item to the emptiest devices whose decomposition cost stays
within the worst device's. Replicas are deterministic copies of one
decomposition (the same call on the same input). The home copy (columns or rows
from 0) is the one stored in tight chunks; a replica decomposes the running
factor read from the gathered chunks (decomposition steps gather them anyway),
or, with owner segments, stores its own copy (the statistics reach it with the
reduce: a reduce-scatter sends them once per copy, an all-reduce to everybody
anyway). Not with local factors (DP-KFAC: owners' factors differ) nor, for
layers, with reduce-scattered gradients (SP-NGD: each copy would need the whole
reduced gradient)."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Any, Callable, NamedTuple, Sequence

from kfac_jax_dist.capture import registry
from kfac_jax_dist.capture import statistics as factors
from kfac_jax_dist.capture import triangles
from kfac_jax_dist.core import offsets
from kfac_jax_dist.core import owners


CHUNKED = "chunked"
OWNER = "owner"
# How second-order segments are packed into rows (`Layout.second_packing`):
# rows as wide as int32 indices allow (one row unless the array passes int32
# numbers); rows of `L₂` (checkpoints saved before rows were wide); one
# segment per row of `L₂` (checkpoints saved before rows were shared).
WIDE_ROWS, SEGMENT_ROWS, PADDED_ROWS = "wide", "segment", "padded"
# Fewest devices that share a branch of the all-reduce's copy (`copy_branches`).
SHARED_COPY_MIN = 8


@dataclasses.dataclass(frozen=True)
class FactorPlace:
  """Where one factor lives. Offsets are within its owner's segments."""

  form: str            # factors.FULL | factors.DIAG
  dim: int
  owner: int
  offset: int          # running factor, in the owner's [L] segment
  size: int            # numbers stored for the running factor
  matrix_offset: int | None   # second-order matrix part, in the owner's [L₂]
  vector_offset: int | None   # second-order vector part
  index: int           # position among the owner's factors (for traces)
  columns: tuple[int, int] | None = None   # eigenvector columns kept (split factor)
  copies: tuple[FactorPlace, ...] = ()   # the other column slices' places
  home: tuple[int, int] | None = None      # replica: (owner, offset) of the home copy


@dataclasses.dataclass(frozen=True)
class Batch:
  """A run of factors of one form and dimension on one device: one batched op."""

  form: str
  dim: int
  count: int
  offset: int                  # first factor's running-factor offset
  matrix_offset: int | None    # first factor's matrix part (then count·d²)
  vector_offset: int | None    # first factor's vector part (then count·d)
  first_index: int
  columns: tuple[int, int] | None = None   # eigenvector columns kept


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """A layer's factors: `a` and `g` (Kronecker), or `f` (unit-wise, SP-NGD)."""

  layer: registry.TaggedLayer
  a: FactorPlace | None
  g: FactorPlace | None
  group: int = 0
  f: FactorPlace | None = None
  rows: tuple[int, int] | None = None      # output rows this group sends (split layer)
  copies: tuple[LayerPlan, ...] = ()     # the layer's plans in its other groups

  @property
  def places(self) -> tuple[tuple[str, FactorPlace], ...]:
    """`(which, place)` of each factor, `which` in "a", "g", "f"."""
    return tuple((w, p) for w, p in (("a", self.a), ("g", self.g), ("f", self.f))
                 if p is not None)

  @property
  def pieces(self) -> tuple[LayerPlan, ...]:
    """This plan and its copies (one per owner group), rows in order."""
    return (self,) + self.copies

  @property
  def a_form(self) -> str:
    return factors.FULL if self.a is None else self.a.form

  @property
  def g_form(self) -> str:
    return factors.FULL if self.g is None else self.g.form


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of a K-FAC state: layers, segments, what is left out."""

  plans: tuple[LayerPlan, ...]
  batches: tuple[tuple[Batch, ...], ...]     # per device
  segment: int                       # L: running-factor numbers per device
  second_segment: int                # L₂: second-order numbers per device
  max_factors: int                   # most factors on one device
  packed: bool                       # full factors stored as upper triangles
  method: str
  skipped: tuple[str, ...]           # tagged layers excluded by name pattern
  passthrough: tuple[str, ...]       # parameter paths with no factor
  num_devices: int = 1               # P
  group_size: int = 1                # m, gradient workers per layer
  axis: str | None = None            # the mesh axis segments are sharded over
  factor_storage: str = CHUNKED      # CHUNKED | OWNER (see the module docstring)
  owner_sizes: tuple[int, ...] = ()  # numbers of running factors each device owns
  second_sizes: tuple[int, ...] = () # second-order numbers each device computes
  # DP-KFAC: each owner builds its factors from its own batch's statistics
  local_factors: bool = False
  # the update consumes the statistics at every step, unconditionally (a
  # factor update every 1, no stale statistics): the capture then computes
  # them with no conditional either (`ScaleByKfacState.statistics_every_step`)
  statistics_every_step: bool = False
  # (module path, kind, reason) of the layers the capture could not tag
  # (`LayerRegistry.uncaptured`): their parameters are in `passthrough`.
  uncaptured: tuple[tuple[str, str, str], ...] = ()
  # why `Distribution.auto` chose this strategy (its `explanation`), in words
  strategy_choice: tuple[str, ...] = dataclasses.field(default=(), compare=False)
  # the rows second-order segments are packed into (WIDE_ROWS; the others
  # are the layouts of older checkpoints, restored and then converted)
  second_packing: str = WIDE_ROWS
  # `build`'s arguments (layers, parameter paths, options), for `rebuild`
  built_with: tuple = dataclasses.field(default=(), compare=False, repr=False)

  @property
  def owner_bases(self) -> tuple[int, ...]:
    """Start of each owner's factors in the tight buffer of all factors."""
    bases, total = [], 0
    for size in self.owner_sizes:
      bases.append(total)
      total += size
    return tuple(bases)

  @property
  def factor_shard(self) -> int:
    """Running-factor numbers stored per device: `C` (chunked) or `L` (owner)."""
    if self.factor_storage == OWNER:
      return self.segment
    return max(-(-sum(self.owner_sizes) // self.num_devices), 1)

  def factor_start(self, place: FactorPlace) -> int:
    """Offset of a running factor in the global `[P · factor_shard]` array (a
    replica's own copy with owner segments, its home's in tight chunks)."""
    if self.factor_storage == OWNER:
      return place.owner * self.segment + place.offset
    owner, offset = place.home or (place.owner, place.offset)
    return self.owner_bases[owner] + offset

  @property
  def num_groups(self) -> int:
    return self.num_devices // self.group_size

  @functools.cached_property
  def tagged_paths(self) -> frozenset[str]:
    """Paths of the parameter leaves of the tagged layers (kernels, biases)."""
    return frozenset(p for plan in self.plans
                     for p in (plan.layer.kernel_path, plan.layer.bias_path) if p is not None)

  def plan(self, name: str) -> LayerPlan | None:
    return next((p for p in self.plans if p.layer.name == name), None)

  def group_plans(self, group: int) -> tuple[LayerPlan, ...]:
    """Plans (and copies of replicated layers) whose gradient `group` sends."""
    return self._plans_by_group.get(group, ())

  @functools.cached_property
  def _plans_by_group(self) -> dict[int, tuple[LayerPlan, ...]]:
    """`group_plans` of every group, in plan order, found once (the layout's
    helpers ask for each of P = 1024 groups' plans several times)."""
    found: dict[int, list[LayerPlan]] = {}
    for plan in self.plans:
      for piece in plan.pieces:
        found.setdefault(piece.group, []).append(piece)
    return {g: tuple(plans) for g, plans in found.items()}

  def second_base(self, owner: int) -> int:
    """Start of `owner`'s segment in its group's second-order array (its slot)."""
    row, column = self.second_slots[owner]
    return row * self.second_row + column

  @functools.cached_property
  def second_capacity(self) -> tuple[int, ...]:
    """Numbers each rank's slot of the second-order array holds: the longest
    of the groups' segments of that rank (the program, and so the array's
    shape and slots, is the same on every device); with one group, each
    device's own (`second_sizes`)."""
    m, sizes = self.group_size, self.second_sizes
    return tuple(max(sizes[g * m + r] for g in range(self.num_groups)) for r in range(m))

  @functools.cached_property
  def second_row(self) -> int:
    """Numbers in a row of the second-order array (`row_width` of the slots)."""
    return self._row_width(self.second_capacity)

  def _row_width(self, sizes: Sequence[int]) -> int:
    """`row_width` of `sizes`; `L₂` for one segment (one device's own, as
    its decompositions write it) and in the older packings."""
    if self.second_packing == WIDE_ROWS and len(sizes) > 1:
      return row_width(sizes, self.second_segment)
    return self.second_segment

  @functools.cached_property
  def second_slots(self) -> tuple[tuple[int, int], ...]:
    """Each device's (row, column) in its group's second-order array, a
    `[second_rows, second_row]` view: the slots of its rank
    (`second_capacity`) packed into rows (`pack_rows`), so that the array
    holds the segments' numbers, not `m·L₂` where owners hold little or
    nothing (ResNet-50 COMM-OPT at P = 1024: 786 idle devices, `L₂` 35× the
    mean; GPT-2-XL's there: 1.31× its numbers in rows of `L₂`)."""
    if self.num_groups == 1:          # every owner's segment: the same packing
      return self.owner_slots
    if self.second_packing == PADDED_ROWS:
      return tuple((d % self.group_size, 0) for d in range(self.num_devices))
    by_rank = pack_rows(self.second_capacity, self.second_row)
    return tuple(by_rank[d % self.group_size] for d in range(self.num_devices))

  @property
  def second_rows(self) -> int:
    """Rows of `second_row` numbers in a device's second-order array."""
    return 1 + max(row for row, _ in self.second_slots)

  @property
  def rows_shared(self) -> bool:
    """Whether a row of the second-order array holds several segments."""
    return self.second_rows < self.group_size

  @property
  def second_array(self) -> int:
    """Second-order numbers per device: `second_rows · second_row`."""
    return self.second_rows * self.second_row

  def second_row_members(self) -> list[list[int]]:
    """The ranks in the group (with one group, the devices) whose segments
    each row holds, in column order."""
    return slot_rows(self.second_slots[:self.group_size])

  @functools.cached_property
  def read_sizes(self) -> tuple[int, ...]:
    """Second-order numbers of each device that are read outside its owner
    group: with one group, all; with several (EK-FAC's gathered eigenbases),
    the segment of a device that owns some factor of a layer's home plan
    (`LayerPlan.places`) or a column slice of one split in its group, none of
    one that holds only copies of layers split over groups, which their own
    groups read (GPT-2-XL MEM-OPT at P = 1024: 20.7 of 74.8 GB)."""
    if self.num_groups == 1:
      return self.second_sizes
    homes = {q.owner for plan in self.plans for _, place in plan.places
             for q in (place,) + place.copies}
    return tuple(n if d in homes else 0 for d, n in enumerate(self.second_sizes))

  @functools.cached_property
  def owner_slots(self) -> tuple[tuple[int, int], ...]:
    """Each owner's (row, column) in an array of every owner's segment read
    (`read_sizes`) in rows of `owner_row` (`pack_rows`): COMM-OPT's
    second-order state (there `second_slots`) and, with several groups,
    EK-FAC's gathered eigenbases."""
    if self.num_devices == 1 or self.second_packing == PADDED_ROWS:
      return tuple((d, 0) for d in range(self.num_devices))
    return pack_rows(self.read_sizes, self.owner_row)

  @functools.cached_property
  def owner_row(self) -> int:
    """Numbers in a row of the array of every owner's segment."""
    return self._row_width(self.read_sizes)

  def owner_base(self, owner: int) -> int:
    """Start of `owner`'s segment in the array of every owner's (`owner_slots`)."""
    row, column = self.owner_slots[owner]
    return row * self.owner_row + column

  @property
  def owner_array(self) -> int:
    """Numbers of the array of every owner's segment, in rows of `owner_row`."""
    return (1 + max(row for row, _ in self.owner_slots)) * self.owner_row

  @functools.cached_property
  def decomposition_branches(self) -> tuple[int, ...]:
    """Each device's representative in the decompositions' per-device switch:
    the first device whose decomposition work has the same shapes (the same
    batches, and the sizes of the running factors it reads, `input_ranges`;
    with owner segments, its replicas' sizes). Such devices run the same code on
    different data, read at their own offsets (`Collectives.range_at`), so
    the program grows with the distinct kinds of work, not with P (at
    P = 1024 most of GPT-2-XL's devices own one factor of one of a few
    shapes). A split factor's columns count by their width only: which
    columns a device keeps is read from a table (`decompositions`), else
    each of the 9 column pieces of GPT-2-XL's 6401-wide factors would be a
    branch of its own (52 branches at P = 1024 instead of 5 at P = 64)."""
    first: dict = {}
    reps = []
    for d in range(self.num_devices):
      if self.factor_storage == CHUNKED:
        inputs = tuple(n for _, n in self.input_ranges(d))
      else:
        inputs = tuple(q.size for q, _, _ in self.owned(d) if q.home is not None)
      batches = tuple(b if b.columns is None else
                      dataclasses.replace(b, columns=(0, b.columns[1] - b.columns[0]))
                      for b in self.batches[d])
      reps.append(first.setdefault((batches, inputs), d))
    return tuple(reps)

  def input_ranges(self, device: int) -> tuple[tuple[int, int], ...]:
    """Tight chunks: `(start, size)` in the global array of each running
    factor `device` decomposes, in the order its decompositions read them
    (`decompositions.owned_factors`): those it stores, as in its chunk, then
    its replicas' home copies. Counted factor by factor, a device that
    stores a factor and one that reads the same factor's replica do the same
    work (GPT-2-XL's COMM-OPT at P = 1024: 16 → 12 branches)."""
    own = sorted((q.offset, q.size) for q, _, _ in self.owned(device) if q.home is None)
    base = self.owner_bases[device]
    return tuple((base + offset, size) for offset, size in own if size) + tuple(
        (self.factor_start(q), q.size) for q, _, _ in self.owned(device)
        if q.home is not None)

  def stack_bases(self, group: int) -> dict[str, int]:
    """The first block of each stacked layer among `group`'s plans."""
    bases: dict[str, int] = {}
    for plan in self.group_plans(group):
      if plan.layer.stack_name is not None:
        bases.setdefault(plan.layer.stack_name, plan.layer.block_number)
    return bases

  def _group_work(self, group: int) -> tuple:
    """What `group` preconditions, up to which blocks of its stacked layers:
    per plan, its stack, its block past the stack's first in the group, its
    rows (a piece of a split layer) and its factors' second-order places
    relative to the group. A group with an unstacked layer is unique."""
    m, bases, work = self.group_size, self.stack_bases(group), []
    for plan in self.group_plans(group):
      layer = plan.layer
      if layer.stack_name is None:
        return ("group", group)
      places = tuple((w, q.form, q.dim, tuple(
          (c.owner - group * m, c.matrix_offset, c.vector_offset, c.columns)
          for c in (q,) + q.copies)) for w, q in plan.places)
      work.append((layer.stack_name, layer.block_number - bases[layer.stack_name],
                   plan.rows, places))
    return tuple(work)

  @functools.cached_property
  def group_branches(self) -> tuple[int, ...]:
    """Each owner group's representative in the preconditioning's switch
    (`routing.per_group`): the first group with the same work up to which
    blocks of its stacked layers it holds (`_group_work`). It reads the
    running group's blocks from the stacked leaves at a shift from a table
    (`precondition`), so that at P = 1024 under MEM-OPT, where each device
    preconditions one block, the program holds one branch per kind of block
    instead of 1024."""
    first: dict = {}
    return tuple(first.setdefault(self._group_work(g), g) for g in range(self.num_groups))

  @functools.cached_property
  def copy_branches(self) -> tuple[int, ...]:
    """Each device's representative in the per-device copy of its factors out
    of an all-reduced buffer (`factor_reduction="all_reduce"`): the first
    device that owns factors of the same sizes in the same order, if at least
    `SHARED_COPY_MIN` devices do (idle devices always share): a shared branch
    reads each factor at the running device's offset through about eight
    operations (`Collectives.range_at`) where a device's own branch has one
    static slice."""
    sizes = [tuple(q.size for q, _, _ in self.owned(d)) for d in range(self.num_devices)]
    members: dict = {}
    for d, key in enumerate(sizes):
      members.setdefault(key, []).append(d)
    return tuple(members[key][0] if not key or len(members[key]) >= SHARED_COPY_MIN else d
                 for d, key in enumerate(sizes))

  def owned(self, device: int) -> list[tuple[FactorPlace, LayerPlan, str]]:
    """`(place, plan, "a" | "g" | "f")` of every factor `device` decomposes
    (replicas included, after its home factors), in segment order."""
    return list(self._owned_by_device.get(device, ()))

  @functools.cached_property
  def _owned_by_device(self) -> dict[int, tuple[tuple[FactorPlace, LayerPlan, str], ...]]:
    """`owned` of every device, found in one pass over the plans (the
    layout's helpers ask for each of P = 1024 devices' factors several times
    while the update is traced)."""
    found: dict[int, list] = {}
    for plan in self.plans:
      for p in plan.pieces:
        for w, place in p.places:
          for q in (place,) + place.copies:
            found.setdefault(q.owner, []).append((q, p, w))
    return {d: tuple(sorted(f, key=lambda t: t[0].offset)) for d, f in found.items()}

  @functools.cached_property
  def factor_numbers(self) -> tuple[tuple[int, ...], ...]:
    """`[P][max_factors]`: the number, in plan order (every layer's factors
    as `tight_offsets` lays them out), of each device's factor at each
    `FactorPlace.index` (a copy's is its layer's; unused indices 0): what
    per-factor vectors, such as stale statistics' schedule, are indexed by."""
    number = {key: f for f, key in enumerate(tight_offsets(self))}
    table = [[0] * self.max_factors for _ in range(self.num_devices)]
    for d, owned in self._owned_by_device.items():
      for q, plan, which in owned:
        table[d][q.index] = number[(plan.layer.name, which)]
    return tuple(tuple(row) for row in table)

  def stored(self, device: int) -> list[tuple[FactorPlace, LayerPlan, str]]:
    """`owned`, less the replicas that tight chunks do not store."""
    return [t for t in self.owned(device)
            if self.factor_storage == OWNER or t[0].home is None]

  def replicated(self) -> bool:
    """Whether any factor or layer has several owners."""
    return any(plan.copies or any(place.copies for _, place in plan.places)
               for plan in self.plans)


def slot_rows(slots: Sequence[tuple[int, int]]) -> list[list[int]]:
  """The indices of `slots` ((row, column) each) that each row holds, in
  column order."""
  rows: list[list[int]] = [[] for _ in range(1 + max(row for row, _ in slots))]
  for i in sorted(range(len(slots)), key=lambda i: slots[i][::-1]):
    rows[slots[i][0]].append(i)
  return rows


def row_width(sizes: Sequence[int], longest: int) -> int:
  """Width of the rows the segments of `sizes` (each at most `longest`) are
  packed into (`pack_rows`): one row of all of them where their numbers fit
  int32 indices; past that, the width within int32 whose packing holds the
  fewest numbers, of a few multiples of `longest` and even shares of the
  total (a row's index and a column in it then stay within int32:
  `offsets.segment_at`, `packing.read_at`). GPT-2-XL's replicated COMM-OPT
  array at P = 1024, 5.2·10⁹ numbers: 3 rows, 1.004× its numbers."""
  total = max(sum(sizes), longest, 1)
  if total <= offsets.INT32_MAX:
    return total
  fewest = -(-total // offsets.INT32_MAX)
  widths = {k * longest for k in range(1, 9)} | {
      -(-total * (256 + j) // (256 * n)) for n in range(fewest, fewest + 4) for j in range(33)}

  def held(width: int) -> tuple[int, int]:
    rows = 1 + max(row for row, _ in pack_rows(sizes, width))
    return rows * width, rows
  return min(sorted(w for w in widths if longest <= w <= offsets.INT32_MAX), key=held,
             default=longest)


def pack_rows(sizes: Sequence[int], row: int) -> tuple[tuple[int, int], ...]:
  """(row, column) of each segment of `sizes` (each ≤ `row`) in rows of
  `row` numbers, first fit by decreasing size (ties in device order, so that
  equal owners, the usual runs of equal-shape factors, take consecutive
  places); empty segments after the others. Only when that saves a row; else
  one segment per row in device order, as the padded layout has them."""
  order = sorted(range(len(sizes)), key=lambda d: (-sizes[d], d))
  used: list[int] = []
  slots: dict[int, tuple[int, int]] = {}
  for d in order:
    r = next((r for r, n in enumerate(used) if n + sizes[d] <= row), len(used))
    if r == len(used):
      used.append(0)
    slots[d] = (r, used[r])
    used[r] += sizes[d]
  if len(used) >= len(sizes):
    return tuple((d, 0) for d in range(len(sizes)))
  return tuple(slots[d] for d in range(len(sizes)))


def factor_form(dim: int, max_factor_dim: int | None) -> str:
  return factors.DIAG if max_factor_dim is not None and dim > max_factor_dim else factors.FULL


def eigh_cost(dim: int, form: str) -> float:
  """Cost model of a decomposition: `d³` (diagonal or unit-wise: `d`)."""
  return float(dim) ** 3 if form == factors.FULL else float(dim)


def storage_size(dim: int, form: str, packed: bool) -> int:
  if form == factors.DIAG:
    return dim
  if form == factors.UNIT:
    return 3 * dim
  return triangles.packed_size(dim) if packed else dim * dim


def _second_parts(dim: int, form: str, method: str,
                  columns: tuple[int, int] | None = None) -> tuple[int, int]:
  """(matrix numbers, vector numbers) of one factor's second-order state (of
  its `columns` only, for a split factor); a unit-wise Fisher is kept as is
  (its 2×2 solves are closed form)."""
  if form in (factors.DIAG, factors.UNIT):
    return 0, storage_size(dim, form, False)
  width = dim if columns is None else columns[1] - columns[0]
  return dim * width, (width if method == "eigen" else 0)


# Replication adds decompositions to the compiled program (one per owned
# factor copy, summed over the devices' branches), and XLA's compile time and
# memory grow with them: at most REPLICA_BUDGET times the unreplicated count
# (or MIN_EXTRA_COPIES more, for small models). ResNet-50: 2.4x at P = 64
# (MEM-OPT); unlimited, 8.3x at P = 256, whose compile then needed more than
# 19 GB. HYBRID's pieces of a factor within its group (at most the group's
# devices, column pieces that share branches by width) are neither counted
# nor capped: ResNet-50's HYBRID updates lower to at most 1.18x P = 64's operations
# at P = 256 and 1024 (groups of 8 to 512) with them, and counted, its
# 4608-wide factor stayed in fewer pieces than its group has devices
# (benchmarks/results/PERF_NOTES.md §35).
REPLICA_BUDGET = 2.5
MIN_EXTRA_COPIES = 32


def build(layers: registry.LayerRegistry, param_paths: Sequence[str], *,
          replicate_factors: bool = True, replicate_layers: bool = True,
          **options) -> Layout:
  """Assigns layers to owner groups, factors to devices, and packs segments
  (see `_build`). Replicated items get at most as many owners as keeps the
  decompositions within `REPLICA_BUDGET` times the unreplicated layout's (or
  `MIN_EXTRA_COPIES` more): the largest such cap (binary search), else none;
  HYBRID's pieces of a factor within a group are neither counted nor capped
  (unless `cap_group_pieces`, the assignment before they were free)."""
  built_with = (layers, tuple(param_paths), tuple(sorted(dict(
      options, replicate_factors=replicate_factors,
      replicate_layers=replicate_layers).items())))

  def build_with(max_parts: int | None) -> Layout:
    return dataclasses.replace(_build(
        layers, param_paths, replicate_factors=replicate_factors,
        replicate_layers=replicate_layers, max_parts=max_parts, **options),
        built_with=built_with)

  def within_budget(lay: Layout) -> bool:
    copies = (sum(len(piece.places) for plan in lay.plans for piece in plan.pieces)
              if _group_pieces_free(lay.num_groups, lay.group_size,
                                    options.get("align_groups", True),
                                    options.get("cap_group_pieces", False)) else
              sum(len(lay.owned(d)) for d in range(lay.num_devices)))
    single = sum(len(plan.places) for plan in lay.plans)
    return copies <= max(REPLICA_BUDGET * single, single + MIN_EXTRA_COPIES)

  lay = build_with(None)
  if not (replicate_factors or replicate_layers) or within_budget(lay):
    return lay
  lo, hi, best = 2, options.get("num_devices", 1), None
  while lo <= hi:
    mid = (lo + hi) // 2
    candidate = build_with(mid)
    if within_budget(candidate):
      best, lo = candidate, mid + 1
    else:
      hi = mid - 1
  return best or dataclasses.replace(_build(
      layers, param_paths, replicate_factors=False, replicate_layers=False, **options),
      built_with=built_with)


def rebuild(lay: Layout, **changes) -> Layout:
  """`lay` as `build` makes it with some of its options changed (an older
  checkpoint's assignment, e.g. `align_groups=False`); the fields the
  transform sets after `build` (storage, local factors, the statistics'
  cadence, what the capture left out, the strategy's explanation, the
  packing) are `lay`'s."""
  if not lay.built_with:
    raise ValueError("rebuild needs a layout made by layout.build")
  layers, paths, options = lay.built_with
  new = build(layers, paths, **dict(options, **changes))
  return dataclasses.replace(
      new, factor_storage=lay.factor_storage, local_factors=lay.local_factors,
      statistics_every_step=lay.statistics_every_step, uncaptured=lay.uncaptured,
      strategy_choice=lay.strategy_choice, second_packing=lay.second_packing)


# (factor name, copy, which, dim, form, columns): one factor slice a device owns
Owned = tuple[str, int, str, int, str, "tuple[int, int] | None"]


def _factors_of(layer: registry.TaggedLayer, max_factor_dim: int | None) -> tuple:
  """`(which, dim, form)` of the layer's factors."""
  if layer.unitwise:
    return (("f", layer.g_dim, factors.UNIT),)
  a_form = factors.DIAG if layer.a_diagonal else factor_form(layer.a_dim, max_factor_dim)
  return (("a", layer.a_dim, a_form),
          ("g", layer.g_dim, factor_form(layer.g_dim, max_factor_dim)))


def _group_pieces_free(num_groups: int, group_size: int, align_groups: bool,
                       cap_group_pieces: bool) -> bool:
  """Whether a factor's pieces within an owner group escape the copies' cap:
  under HYBRID (several groups of several devices, assigned together) unless
  `cap_group_pieces` (checkpoints saved before, `tools.checkpoint`)."""
  return num_groups > 1 and group_size > 1 and align_groups and not cap_group_pieces


def _assign_owners(kept: list, max_factor_dim: int | None, num_devices: int,
                   group_size: int, method: str, replicate_factors: bool,
                   replicate_layers: bool, max_parts: int | None,
                   align_groups: bool = True, cap_group_pieces: bool = False,
                   fewer_layer_pieces: bool = True
                   ) -> tuple[dict[str, list], list[list[Owned]]]:
  """Layers to owner groups, then each group's factors to its devices
  (`_assign_in_groups`). Both balance the decomposition cost d³ and the
  numbers each owner sends: a group's preconditioned gradients (gathered
  every step when there are several groups), a device's eigenbases (gathered
  within its group on decomposition steps).

  Returns each layer's pieces `[(rows, group)]` (rows in order) and each
  device's owned factor slices."""
  num_groups = num_devices // group_size

  def layer_cost(layer: registry.TaggedLayer) -> float:
    return sum(eigh_cost(dim, form) for _, dim, form in _factors_of(layer, max_factor_dim))

  split_layers = replicate_layers and num_groups > 1
  group_bins = owners.assign(kept, num_groups, layer_cost,
                             lambda l: l.a_dim * l.g_dim if num_groups > 1 else 0.0,
                             lambda l: l.a_dim if split_layers and not l.unitwise else 0,
                             max_parts=max_parts, fewer_parts=fewer_layer_pieces)
  pieces: dict[str, list] = {}
  for g, members in enumerate(group_bins):
    for layer, rows in members:
      pieces.setdefault(layer.name, []).append((rows, g))
  for found in pieces.values():
    found.sort(key=lambda t: t[0] or (0, 0))
  group_items = [[(layer.name, [t[1] for t in pieces[layer.name]].index(g), which, dim, form)
                  for layer, _ in members
                  for which, dim, form in _factors_of(layer, max_factor_dim)]
                 for g, members in enumerate(group_bins)]
  split_factors = (replicate_factors and group_size > 1
                   and (num_groups == 1 or align_groups))
  free = _group_pieces_free(num_groups, group_size, align_groups, cap_group_pieces)
  bins = _assign_in_groups(group_items, group_size, method, split_factors,
                           None if free else max_parts,
                           aligned=num_groups > 1 and group_size > 1 and align_groups)
  owned = [[item + (columns,) for item, columns in mine] for group in bins for mine in group]
  return pieces, owned


def _assign_in_groups(group_items: list[list], group_size: int, method: str,
                      split_factors: bool, max_parts: int | None, aligned: bool
                      ) -> list[list[list]]:
  """Each group's factors `(name, copy, which, dim, form)` to its devices
  (`owners.assign`: d³ and second-order numbers; a full factor larger than
  the share split into eigenvector columns when `split_factors`). `aligned`
  (HYBRID; False: the assignment of checkpoints saved before it): each group
  balanced against the whole layout's pace, pieces up to 5% over the share
  (`_group_targets`), then its devices' work moved into the groups' common
  slot table (`owners.align_ranks`). Returns per group, per rank
  `[(factor, columns)]`."""
  cost = lambda t: eigh_cost(t[3], t[4])
  size = lambda t: sum(_second_parts(t[3], t[4], method))
  columns = lambda t: t[3] if split_factors and t[4] == factors.FULL else 0
  targets = _group_targets(group_items, cost, size, group_size) if aligned else {}
  bins = [owners.assign(items, group_size, cost, size, columns, max_parts=max_parts,
                        **targets) for items in group_items]
  if not aligned:
    return bins
  piece_size = lambda p: size(p[0]) * (1 if p[1] is None else (p[1][1] - p[1][0]) / p[0][3])
  piece_cost = lambda p: cost(p[0])
  limit = max(targets["min_ideal"], max(sum(map(piece_cost, b)) for g in bins for b in g))
  return owners.align_ranks(bins, piece_size, piece_cost, lambda p: p[0][:3], limit)


def _group_targets(group_items: list[list], cost: Callable, size: Callable,
                   group_size: int) -> dict[str, float]:
  """`owners.assign`'s targets for one owner group among several: the whole
  layout's ideal decomposition cost `max(Σ d³ / P, largest d³)` (the slowest
  device sets every group's pace) and the largest group's share of numbers
  (its segments set the slot table's size); and pieces up to `owners.LEVEL`
  times that share (GPT-2-XL at P = 256 in groups of 8: three 41 M-number
  factors in two pieces each, not three, which would put two whole
  decompositions on one of the eight devices)."""
  every = [t for items in group_items for t in items]
  num_devices = group_size * len(group_items)
  return dict(min_ideal=max([sum(map(cost, every)) / num_devices] + list(map(cost, every))),
              min_share=max(sum(map(size, items)) for items in group_items) / group_size,
              slack=owners.LEVEL)


def _is_replica(item: Owned) -> bool:
  """A copy of a replicated layer, or a factor's columns after the first."""
  return item[1] > 0 or (item[5] is not None and item[5][0] > 0)


class _Packed(NamedTuple):
  """Every device's packed segments (`_pack`)."""
  places: dict[tuple, FactorPlace]     # (name, copy, which, columns) -> place
  batches: tuple[tuple[Batch, ...], ...]
  owner_sizes: tuple[int, ...]         # stored (home) factor numbers per device
  second_sizes: tuple[int, ...]        # second-order numbers per device
  segment: int                         # the longest device's of each
  second_segment: int
  max_factors: int


def _stacks_together(run: list[Owned], blocks: dict[str, registry.TaggedLayer]
                     ) -> list[Owned]:
  """`run` with the same factor of the blocks of one stacked layer together,
  in block order, where the layer's first block was (a scan's `up` and `down`
  projections of one width: every `up` G, then every `down` A, not
  alternating), so that the step reads, packs and preconditions them as
  slices (`block_runs`, `precondition_runs`)."""
  def group(item: Owned) -> tuple:
    layer = blocks[item[0]]
    return (layer.stack_name or layer.name,) + item[1:3]
  first: dict[tuple, int] = {}
  for item in run:
    first.setdefault(group(item), len(first))
  return sorted(run, key=lambda t: (first[group(t)], blocks[t[0]].block_number or 0))


def _pack(owned: list[list[Owned]], packed: bool, method: str,
          blocks: dict[str, registry.TaggedLayer]) -> _Packed:
  """Packs each device's factors: home factors first (tight chunks store only
  them), then replicas; runs of equal (form, dim, columns) contiguous, one
  `Batch` each, the blocks of a stacked layer together (`_stacks_together`).
  `blocks`: the kept layers (blocks) by name."""
  places, batches, owner_sizes, second_sizes = {}, [], [], []
  segment = second_segment = max_factors = 0
  for device, mine in enumerate(owned):
    runs: dict[tuple, list] = {}
    for item in mine:
      runs.setdefault((_is_replica(item), item[4], item[3], item[5]), []).append(item)
    runs = {key: _stacks_together(run, blocks) for key, run in runs.items()}
    offset = second = index = 0
    device_batches = []
    for (_, form, dim, columns), run in sorted(
        runs.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1], kv[0][3] or (0, 0))):
      size = storage_size(dim, form, packed)
      matrix, vector = _second_parts(dim, form, method, columns)
      matrix_start = second if matrix else None
      vector_start = second + len(run) * matrix if vector else None
      device_batches.append(Batch(form, dim, len(run), offset, matrix_start, vector_start,
                                  index, columns))
      for j, (name, copy, which, _, _, _) in enumerate(run):
        places[(name, copy, which, columns)] = FactorPlace(
            form, dim, device, offset + j * size, size,
            None if matrix_start is None else matrix_start + j * matrix,
            None if vector_start is None else vector_start + j * vector, index + j,
            columns)
      offset += len(run) * size
      second += len(run) * (matrix + vector)
      index += len(run)
    batches.append(tuple(device_batches))
    owner_sizes.append(sum(storage_size(t[3], t[4], packed) for t in mine
                           if not _is_replica(t)))
    second_sizes.append(second)
    segment, second_segment = max(segment, offset), max(second_segment, second)
    max_factors = max(max_factors, index)
  return _Packed(places, tuple(batches), tuple(owner_sizes), tuple(second_sizes),
                 segment, second_segment, max_factors)


def _layer_plans(kept: list, pieces: dict[str, list],
                 places: dict[tuple, FactorPlace]) -> tuple[LayerPlan, ...]:
  """Each layer's plan: a split factor's home place lists its other column
  slices; replicas (and their slices) point at the home copy (owner, offset)."""
  slices: dict[tuple, list] = {}
  for (name, copy, which, columns), place in places.items():
    slices.setdefault((name, copy, which), []).append(place)
  for found in slices.values():
    found.sort(key=lambda p: p.columns or (0, 0))

  def place_of(name: str, copy: int, which: str) -> FactorPlace | None:
    found = slices.get((name, copy, which))
    if not found:
      return None
    home = slices[(name, 0, which)][0]
    source = (home.owner, home.offset)
    rest = tuple(dataclasses.replace(p, home=source) for p in found[1:])
    return dataclasses.replace(found[0], copies=rest, home=None if copy == 0 else source)

  plans = []
  for layer in kept:
    copies = [LayerPlan(layer, place_of(layer.name, k, "a"), place_of(layer.name, k, "g"),
                        g, place_of(layer.name, k, "f"), rows)
              for k, (rows, g) in enumerate(pieces[layer.name])]
    plans.append(dataclasses.replace(copies[0], copies=tuple(copies[1:])))
  return tuple(plans)


def _build(layers: registry.LayerRegistry, param_paths: Sequence[str], *,
           skip: Sequence[str] = (), max_factor_dim: int | None = None,
           num_devices: int = 1, group_size: int = 1, axis: str | None = None,
           method: str = "eigen", packed: bool = True,
           factor_storage: str = CHUNKED, replicate_factors: bool = True,
           replicate_layers: bool = True, max_parts: int | None = None,
           align_groups: bool = True, cap_group_pieces: bool = False,
           fewer_layer_pieces: bool = True) -> Layout:
  """Assigns layers to owner groups, factors to devices, and packs segments.

  A stacked layer becomes one plan per block (`TaggedLayer.blocks`), each with
  its own factors; `skip` patterns match the stacked layer's name, so its
  blocks are kept or skipped together. `plans` keep the blocks consecutive,
  block 0 first (`precondition.write_back` relies on it). Oversized full factors
  (within an owner group; with several groups unless `align_groups` is
  False) and layers (several groups) are split over several owners (at most
  `max_parts`; HYBRID's factors within a group up to its size, unless
  `cap_group_pieces`) unless `replicate_factors` / `replicate_layers` is
  False (see the module docstring); a layer in fewer pieces where as many as
  its size needs would put a second decomposition on a device
  (`fewer_layer_pieces`; False: the assignment of older checkpoints).
  """
  patterns = [re.compile(p) for p in skip]
  kept, skipped = [], []
  for layer in layers:
    if any(p.search(layer.name) for p in patterns):
      skipped.append(layer)
    else:
      kept.extend(layer.blocks())
  pieces, owned = _assign_owners(kept, max_factor_dim, num_devices, group_size, method,
                                 replicate_factors, replicate_layers, max_parts,
                                 align_groups, cap_group_pieces, fewer_layer_pieces)
  pack = _pack(owned, packed, method, {layer.name: layer for layer in kept})
  plans = _layer_plans(kept, pieces, pack.places)
  covered = {p for plan in plans for p in (plan.layer.kernel_path, plan.layer.bias_path)}
  passthrough = tuple(p for p in param_paths if p not in covered)
  return Layout(plans, pack.batches, max(pack.segment, 1), max(pack.second_segment, 1),
                max(pack.max_factors, 1), packed, method,
                tuple(l.name for l in skipped), passthrough, num_devices, group_size,
                axis, factor_storage, pack.owner_sizes, pack.second_sizes)


def _runnable(plan: LayerPlan) -> bool:
  """Whether the plan can be preconditioned batched with others: a whole
  (unsplit by rows) Kronecker layer with two full factors (maybe split by
  columns), or a unit-wise one."""
  kronecker = plan.a is not None and plan.g is not None and all(
      p.form == factors.FULL for p in (plan.a, plan.g))
  return plan.rows is None and (kronecker or plan.f is not None)


def second_numbers(plan: LayerPlan) -> int:
  """The second-order numbers of the plan's factors (eigenbases `d·w` and
  eigenvalues `w` of each column slice, `w = d` unsplit, or a unit-wise
  Fisher's `3d`)."""
  return sum(n for _, place in plan.places for q in (place,) + place.copies
             for n in _second_parts(q.dim, q.form, "eigen", q.columns))


def precondition_runs(lay: Layout, group: int, across_layers: bool = True
                      ) -> tuple[tuple[LayerPlan, ...], ...]:
  """The group's plans, those that are preconditioned together in one run:
  layers of equal `(d_A, d_G)` and column splits, in plan order, wherever
  their eigenbases (inverses) and eigenvalues lie (a transformer's q, k, v
  and o projections, the blocks of a stack, at P = 1024 one per owner), and
  unit-wise layers (`[k, C, 3]`); `precondition` reads them as `[k, d, d]`
  and `[k, d]` (`packing.read_run`), a large run chunk by chunk. Every other
  plan is a run of its own. `across_layers=False`: only blocks of one
  stacked layer run together."""
  def key(plan: LayerPlan) -> tuple:
    return tuple((w, p.dim, tuple(q.columns or () for q in (p,) + p.copies))
                 for w, p in plan.places) + (
        () if across_layers else (plan.layer.stack_name,))
  runs: dict[tuple, list[LayerPlan]] = {}
  single = []
  for plan in lay.group_plans(group):
    if _runnable(plan) and (across_layers or plan.layer.stack_name is not None):
      runs.setdefault(key(plan), []).append(plan)
    else:
      single.append((plan,))
  return tuple(single) + tuple(tuple(run) for run in runs.values())


def tight_offsets(lay: Layout) -> dict[tuple[str, str], int]:
  """Offsets of every factor in an unpadded buffer of all factors (plan order)."""
  offsets, offset = {}, 0
  for plan in lay.plans:
    for which, place in plan.places:
      offsets[(plan.layer.name, which)] = offset
      offset += place.size
  return offsets


def follows(plan: LayerPlan, previous: LayerPlan, pieces: bool = False) -> bool:
  """Whether `plan` is the block after `previous` of one stacked layer, both
  whole (not a piece of a layer split over groups) unless `pieces`."""
  now, before = plan.layer, previous.layer
  return (now.stack_name is not None and now.stack_name == before.stack_name
          and (pieces or plan.rows is None and previous.rows is None)
          and now.block_number == before.block_number + 1)


def block_runs(items: Sequence[Any], plan_of: Callable[[Any], LayerPlan] = lambda x: x,
               joins: Callable[[Any, Any], bool] = lambda now, before: True,
               pieces: bool = False) -> list[list[Any]]:
  """`items` cut into maximal runs of consecutive blocks of one stacked layer
  (`follows`, and `joins(item, previous)`), every other item a run of its own:
  what the step can read, pack or write as one slice of the stacked leaf or
  statistic instead of one op per block (a scan of L blocks would otherwise
  compile L copies of each). `pieces`: a layer split over groups joins too
  (its factors are whole)."""
  runs: list[list] = []
  for item in items:
    if (runs and follows(plan_of(item), plan_of(runs[-1][-1]), pieces)
        and joins(item, runs[-1][-1])):
      runs[-1].append(item)
    else:
      runs.append([item])
  return runs


def buffer_runs(plans: Sequence[LayerPlan], offsets: dict[tuple[str, int], int]
                ) -> list[list[LayerPlan]]:
  """`block_runs` of `plans` whose gradients (or preconditioned rows) also
  follow one another in their group's buffer (`gradient_offsets`): one slice
  `[k, d_A, d_G]` of it each."""
  def contiguous(plan: LayerPlan, before: LayerPlan) -> bool:
    start = offsets[(before.layer.name, before.group)]
    return plan.group == before.group and offsets[(plan.layer.name, plan.group)] == (
        start + before.layer.a_dim * before.layer.g_dim)
  return block_runs(plans, joins=contiguous)


def piece_rows(plan: LayerPlan) -> tuple[int, int]:
  """The rows of the layer's `(d_A, d_G)` gradient that `plan` (a piece) sends."""
  return plan.rows or (0, plan.layer.a_dim)


def gradient_offsets(lay: Layout) -> tuple[dict[tuple[str, int], int], list[int], int]:
  """Offsets of each layer's gradient (its rows, for a piece of a replicated
  layer), by (layer, group), in the group's flat buffer (slot 0 holds the
  group's KL-clip sum over its whole layers; a piece is preceded by one slot
  for its partial ⟨V, ∇⟩), each group's used size, and the buffer size S: the
  largest group's, rounded up to a multiple of m."""
  offsets, sizes = {}, []
  for g in range(lay.num_groups):
    offset = 1
    for plan in lay.group_plans(g):
      lo, hi = piece_rows(plan)
      offset += plan.rows is not None
      offsets[(plan.layer.name, g)] = offset
      offset += (hi - lo) * plan.layer.g_dim
    sizes.append(offset)
  m = lay.group_size
  return offsets, sizes, -(-max(sizes) // m) * m


def sit_out_plans(lay: Layout) -> list[LayerPlan]:
  """The plans of the layers (blocks) that may sit out a pass or run under a
  row mask (`TaggedLayer.counted`), in layout order:
  `ScaleByKfacState.marked_weight`'s."""
  return [plan for plan in lay.plans if plan.layer.counted]


def flat_sizes(lay: Layout) -> dict[str, int]:
  """One device's flat state arrays indexed with int32 offsets, words →
  numbers: its running factors (`C` or `L`) and second-order segment (`L₂`;
  GPT-2-XL's eigenbases on 2 devices: 2.6e9). Arrays over several devices
  are read and written as (device, column)."""
  return {"running factors hold": max(lay.segment, lay.factor_shard),
          "second-order state (eigenbases or inverses) holds": lay.second_segment}


def addressable(lay: Layout) -> bool:
  return max(flat_sizes(lay).values()) <= offsets.INT32_MAX


def check_addressable(lay: Layout) -> None:
  """`offsets.check_sizes` of `flat_sizes`, with what to change."""
  offsets.check_sizes(flat_sizes(lay), (
      f"on {lay.num_devices} device(s) in {lay.num_groups} owner group(s), spread them "
      "over more devices (more devices, or a smaller grad_worker_fraction), keep the "
      "largest factors diagonal (max_factor_dim=) or leave their layers out (skip=)."))


# A full factor wider than this is worth a warning at `init`: its copies are
# over a GiB each in float32 and its decomposition `O(d³)` (a vocabulary-sized
# output layer, usually, that `max_factor_dim=` would keep diagonal).
LARGE_FACTOR_DIM = 16384


def _full_factors(lay: Layout) -> list[tuple[str, str, int]]:
  """(layer, "A" or "G", width) of every full factor."""
  return [(plan.layer.name, which.upper(), place.dim) for plan in lay.plans
          for which, place in plan.places if place.form == factors.FULL]


def check_packable(lay: Layout) -> None:
  """Every full factor fits the packed triangles' int32 arithmetic
  (`triangles.MAX_PACKED_DIM`), or an error naming the layer (whatever the
  strategy: `Distribution.auto` asks before it prices any)."""
  for name, which, dim in _full_factors(lay):
    if lay.packed and dim > triangles.MAX_PACKED_DIM:
      raise ValueError(
          f"scale_by_kfac: layer '{name}' has a full {dim}×{dim} factor {which}; full "
          f"factors are stored as upper triangles with int32 indices, up to "
          f"{triangles.MAX_PACKED_DIM} wide. Keep it diagonal (max_factor_dim=, e.g. "
          "4096) or leave the layer out (skip=).")


def check_factor_dims(lay: Layout) -> None:
  """`check_packable`; one warning lists the full factors wider than
  `LARGE_FACTOR_DIM`."""
  check_packable(lay)
  large = [f"'{name}' {which} {dim}×{dim}" for name, which, dim in _full_factors(lay)
           if dim > LARGE_FACTOR_DIM]
  if large:
    warnings.warn(
        f"kfac_jax_dist: full Kronecker factors wider than {LARGE_FACTOR_DIM}: "
        f"{', '.join(large)}; each one's eigenbasis or inverse is over 1 GiB in float32 "
        "and its decomposition O(d³). A vocabulary-sized layer usually wants "
        "max_factor_dim= (e.g. 4096: diagonal beyond) or skip=.", stacklevel=3)


def cheaper_storage(lay: Layout, factor_every: int, inverse_every: int) -> str:
  """Chunked or owner storage for a reduce-scatter, whichever sends less.

  Per device, tight chunks cost `(P−1)·C` per factor step plus `(P−1)·C` on
  decomposition steps (the chunks are gathered); owner segments `(P−1)·L` per
  factor step. With `k` factor steps per decomposition step, chunks win when
  `L/C > 1 + 1/k`.
  """
  k = max(inverse_every / max(factor_every, 1), 1.0)
  if lay.segment * k > lay.factor_shard * (k + 1):
    return CHUNKED
  return OWNER

