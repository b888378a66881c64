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
  segments, so each device holds `m·L₂` (all `P·L₂` with one group).

Within a segment, factors of the same form and dimension are contiguous: each
such run is one batched `eigh`/`cholesky` ("bucket"). The only padding is at
the end of a segment, up to the longest device's (and, for chunked factors,
fewer than `P` numbers at the end of the tight buffer).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from kfac_jax_dist import factors
from kfac_jax_dist import registry


CHUNKED = "chunked"
OWNER = "owner"


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


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """A layer's factors: `a` and `g` (Kronecker), or `f` (unit-wise, SP-NGD)."""

  layer: registry.TaggedLayer
  a: FactorPlace | None
  g: FactorPlace | None
  group: int = 0
  f: FactorPlace | None = None

  @property
  def places(self) -> tuple[tuple[str, FactorPlace], ...]:
    """`(which, place)` of each factor, `which` in "a", "g", "f"."""
    return tuple((w, p) for w, p in (("a", self.a), ("g", self.g), ("f", self.f))
                 if p is not None)

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
    """Offset of a running factor in the global `[P · factor_shard]` array."""
    if self.factor_storage == OWNER:
      return place.owner * self.segment + place.offset
    return self.owner_bases[place.owner] + place.offset

  @property
  def num_groups(self) -> int:
    return self.num_devices // self.group_size

  def plan(self, name: str) -> LayerPlan | None:
    return next((p for p in self.plans if p.layer.name == name), None)

  def group_plans(self, group: int) -> tuple[LayerPlan, ...]:
    return tuple(p for p in self.plans if p.group == group)

  def second_base(self, place: FactorPlace, group: int) -> int:
    """Start of `place`'s owner segment in its group's `m·L₂` second-order array."""
    return (place.owner - group * self.group_size) * self.second_segment

  def owned(self, device: int) -> list[tuple[FactorPlace, LayerPlan, str]]:
    """`(place, plan, "a" | "g")` of every factor `device` owns, in segment order."""
    found = [(place, p, w) for p in self.plans for w, place in p.places
             if place.owner == device]
    return sorted(found, key=lambda t: t[0].offset)


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
  return dim * (dim + 1) // 2 if packed else dim * dim


def _second_parts(dim: int, form: str, method: str) -> tuple[int, int]:
  """(matrix numbers, vector numbers) of one factor's second-order state; a
  unit-wise Fisher is kept as is (its 2×2 solves are closed form)."""
  if form in (factors.DIAG, factors.UNIT):
    return 0, storage_size(dim, form, False)
  return dim * dim, (dim if method == "eigen" else 0)


def assign(items: Sequence, bins: int, cost, size) -> list[list]:
  """Greedy two-criteria LPT: items (largest relative cost or size first) go
  to the bin whose larger relative load — cost over its ideal
  `max(Σ cost / bins, largest cost)`, size over `Σ size / bins` — grows least."""
  total_cost = sum(cost(x) for x in items)
  total_size = sum(size(x) for x in items)
  ideal_cost = max([total_cost / bins] + [cost(x) for x in items]) or 1.0
  ideal_size = total_size / bins or 1.0
  loads = [(0.0, 0.0)] * bins
  out: list[list] = [[] for _ in range(bins)]
  for x in sorted(items, key=lambda x: -max(cost(x) / ideal_cost, size(x) / ideal_size)):
    c, z = cost(x) / ideal_cost, size(x) / ideal_size
    b = min(range(bins), key=lambda i: (max(loads[i][0] + c, loads[i][1] + z),
                                        loads[i][0] + c, i))
    loads[b] = (loads[b][0] + c, loads[b][1] + z)
    out[b].append(x)
  return out


def build(layers: registry.LayerRegistry, param_paths: Sequence[str], *,
          skip: Sequence[str] = (), max_factor_dim: int | None = None,
          num_devices: int = 1, group_size: int = 1, axis: str | None = None,
          method: str = "eigen", packed: bool = True,
          factor_storage: str = CHUNKED) -> Layout:
  """Assigns layers to owner groups, factors to devices, and packs segments.

  A stacked layer becomes one plan per block (`TaggedLayer.blocks`), each with
  its own factors; `skip` patterns match the stacked layer's name, so its
  blocks are kept or skipped together. `plans` keep the blocks consecutive,
  block 0 first (`kfac._write_back` relies on it).
  """
  patterns = [re.compile(p) for p in skip]
  kept, skipped = [], []
  for layer in layers:
    if any(p.search(layer.name) for p in patterns):
      skipped.append(layer)
    else:
      kept.extend(layer.blocks())
  num_groups = num_devices // group_size

  def factors_of(layer):
    """`(which, dim, form)` of the layer's factors."""
    if layer.unitwise:
      return (("f", layer.g_dim, factors.UNIT),)
    a_form = factors.DIAG if layer.a_diagonal else factor_form(layer.a_dim, max_factor_dim)
    return (("a", layer.a_dim, a_form),
            ("g", layer.g_dim, factor_form(layer.g_dim, max_factor_dim)))

  def layer_cost(layer):
    return sum(eigh_cost(dim, form) for _, dim, form in factors_of(layer))

  # Layers to groups, then each group's factors to its devices. Both balance
  # the decomposition cost d³ and the numbers each owner sends: a group's
  # preconditioned gradients (gathered every step when there are several
  # groups), a device's eigenbases (gathered on decomposition steps).
  group_of = {}
  group_bins = assign(kept, num_groups, layer_cost,
                       lambda l: l.a_dim * l.g_dim if num_groups > 1 else 0.0)
  for g, members in enumerate(group_bins):
    for layer in members:
      group_of[layer.name] = g
  owned: list[list[tuple]] = [[] for _ in range(num_devices)]
  for g, members in enumerate(group_bins):
    items = [(layer, which, dim, form) for layer in members
             for which, dim, form in factors_of(layer)]
    bins = assign(items, group_size, lambda t: eigh_cost(t[2], t[3]),
                   lambda t: sum(_second_parts(t[2], t[3], method)))
    for r, mine in enumerate(bins):
      owned[g * group_size + r] = [(layer.name, which, dim, form)
                                   for layer, which, dim, form in mine]

  # Pack each device's factors, runs of equal (form, dim) contiguous.
  places, batches, owner_sizes, second_sizes = {}, [], [], []
  segment = second_segment = max_factors = 0
  for device, mine in enumerate(owned):
    runs: dict[tuple[str, int], list] = {}
    for item in mine:
      runs.setdefault((item[3], item[2]), []).append(item)
    offset = second = index = 0
    device_batches = []
    for (form, dim), run in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
      size = storage_size(dim, form, packed)
      matrix, vector = _second_parts(dim, form, method)
      matrix_start = second if matrix else None
      vector_start = second + len(run) * matrix if vector else None
      device_batches.append(Batch(form, dim, len(run), offset, matrix_start, vector_start,
                                  index))
      for j, (name, which, _, _) in enumerate(run):
        places[(name, which)] = FactorPlace(
            form, dim, device, offset + j * size, size,
            None if matrix_start is None else matrix_start + j * matrix,
            None if vector_start is None else vector_start + j * vector, index + j)
      offset += len(run) * size
      second += len(run) * (matrix + vector)
      index += len(run)
    batches.append(tuple(device_batches))
    owner_sizes.append(offset)
    second_sizes.append(second)
    segment, second_segment = max(segment, offset), max(second_segment, second)
    max_factors = max(max_factors, index)

  plans = tuple(LayerPlan(layer, places.get((layer.name, "a")),
                          places.get((layer.name, "g")), group_of[layer.name],
                          places.get((layer.name, "f"))) for layer in kept)
  covered = {p for plan in plans for p in (plan.layer.kernel_path, plan.layer.bias_path)}
  passthrough = tuple(p for p in param_paths if p not in covered)
  return Layout(plans, tuple(batches), max(segment, 1), max(second_segment, 1),
                max(max_factors, 1), packed, method,
                tuple(l.name for l in skipped), passthrough, num_devices, group_size,
                axis, factor_storage, tuple(owner_sizes), tuple(second_sizes))
