"""Buckets, owners and padding: where every Kronecker factor lives in the state.

Factors of the same form and dimension `d` are stacked into one bucket, an
array `[P·c, d, d]` (or `[P·c, d]` for diagonal factors) for a data axis of P
devices: device `i` owns slots `[i·c, (i+1)·c)` and runs one batched
`eigh`/`cholesky` over them. Slots a device does not fill hold identity
matrices (exact: they never touch a gradient, but they cost compute).

Ownership follows KAISA's grid (§4.3): the P devices form `P/m` owner groups of
`m` consecutive devices. Each layer belongs to one group (longest processing
time first on the eigendecomposition cost `d_A³ + d_G³`, as KAISA assigns
work), and the group's factors are spread over its `m` devices. After a
decomposition the group's devices all-gather their slots, so each holds the
second-order state of the whole group: `m·c` slots per bucket.

With one device: one group, one owner, `c` = the number of factors of size d.
All of this is static metadata, fixed at `init`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from kfac_jax_dist import factors
from kfac_jax_dist import registry


@dataclasses.dataclass(frozen=True)
class Slot:
  bucket: str
  index: int         # global slot index in the bucket's factor array


@dataclasses.dataclass(frozen=True)
class Bucket:
  key: str
  form: str          # factors.FULL | factors.DIAG
  dim: int
  per_device: int    # c: slots each device owns, padding included
  num_devices: int   # P
  used: int          # slots holding a real factor

  @property
  def size(self) -> int:
    return self.per_device * self.num_devices

  @property
  def matrix_shape(self) -> tuple[int, ...]:
    return (self.dim, self.dim) if self.form == factors.FULL else (self.dim,)

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.size,) + self.matrix_shape


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  layer: registry.TaggedLayer
  a: Slot
  g: Slot
  a_form: str
  g_form: str
  group: int = 0


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of a K-FAC state: layers, buckets and what is left out."""

  plans: tuple[LayerPlan, ...]
  buckets: tuple[Bucket, ...]
  skipped: tuple[str, ...]            # tagged layers excluded by name pattern
  passthrough: tuple[str, ...]        # parameter paths with no factor
  num_devices: int = 1                # P
  group_size: int = 1                 # m, gradient workers per layer
  axis: str | None = None             # the mesh axis the buckets are sharded over

  @property
  def num_groups(self) -> int:
    return self.num_devices // self.group_size

  def bucket(self, key: str) -> Bucket:
    return next(b for b in self.buckets if b.key == key)

  def plan(self, name: str) -> LayerPlan | None:
    return next((p for p in self.plans if p.layer.name == name), None)

  def owner(self, slot: Slot) -> int:
    """The device that decomposes the factor in `slot`."""
    return slot.index // self.bucket(slot.bucket).per_device

  def group_index(self, slot: Slot, group: int) -> int:
    """`slot`'s index in its group's second-order arrays (`m·c` slots)."""
    return slot.index - group * self.group_size * self.bucket(slot.bucket).per_device

  def group_plans(self, group: int) -> tuple[LayerPlan, ...]:
    return tuple(p for p in self.plans if p.group == group)


def bucket_key(form: str, dim: int) -> str:
  return f"{form}{dim}"


def factor_form(dim: int, max_factor_dim: int | None) -> str:
  return factors.DIAG if max_factor_dim is not None and dim > max_factor_dim else factors.FULL


def eigh_cost(dim: int, form: str) -> float:
  """Cost model of a decomposition: `d³` (a diagonal factor costs `d`)."""
  return float(dim) ** 3 if form == factors.FULL else float(dim)


def _least_loaded(loads: list[float]) -> int:
  return min(range(len(loads)), key=lambda i: (loads[i], i))


def build(layers: registry.LayerRegistry, param_paths: Sequence[str], *,
          skip: Sequence[str] = (), max_factor_dim: int | None = None,
          num_devices: int = 1, group_size: int = 1, axis: str | None = None) -> Layout:
  """Assigns layers to owner groups and factors to devices and bucket slots."""
  patterns = [re.compile(p) for p in skip]
  kept, skipped = [], []
  for layer in layers:
    (skipped if any(p.search(layer.name) for p in patterns) else kept).append(layer)
  num_groups = num_devices // group_size

  def forms(layer):
    return factor_form(layer.a_dim, max_factor_dim), factor_form(layer.g_dim, max_factor_dim)

  def layer_cost(layer):
    fa, fg = forms(layer)
    return eigh_cost(layer.a_dim, fa) + eigh_cost(layer.g_dim, fg)

  # Layers to groups: longest processing time first.
  group_of, group_load = {}, [0.0] * num_groups
  for layer in sorted(kept, key=lambda l: -layer_cost(l)):
    g = _least_loaded(group_load)
    group_of[layer.name] = g
    group_load[g] += layer_cost(layer)

  # Factors to the devices of their group: per bucket, the least-loaded device
  # that has the fewest factors of that size (keeps the padding small).
  device_load = [0.0] * num_devices
  count: dict[tuple[str, int], int] = {}          # (bucket, device) -> factors
  placed: dict[tuple[str, str], tuple[str, int, int]] = {}
  dims: dict[str, tuple[str, int]] = {}
  items = [(layer, which, dim, form) for layer in kept
           for which, dim, form in (("a", layer.a_dim, forms(layer)[0]),
                                    ("g", layer.g_dim, forms(layer)[1]))]
  for layer, which, dim, form in sorted(items, key=lambda t: -eigh_cost(t[2], t[3])):
    key = bucket_key(form, dim)
    dims[key] = (form, dim)
    g = group_of[layer.name]
    devices = range(g * group_size, (g + 1) * group_size)
    device = min(devices, key=lambda d: (count.get((key, d), 0), device_load[d], d))
    j = count.get((key, device), 0)
    count[(key, device)] = j + 1
    device_load[device] += eigh_cost(dim, form)
    placed[(layer.name, which)] = (key, device, j)

  per_device = {key: max(c for (k, _), c in count.items() if k == key) for key in dims}
  plans = []
  for layer in kept:
    slots = {}
    for which in ("a", "g"):
      key, device, j = placed[(layer.name, which)]
      slots[which] = Slot(key, device * per_device[key] + j)
    fa, fg = forms(layer)
    plans.append(LayerPlan(layer, slots["a"], slots["g"], fa, fg, group_of[layer.name]))

  buckets = tuple(
      Bucket(key, dims[key][0], dims[key][1], per_device=per_device[key],
             num_devices=num_devices,
             used=sum(c for (k, _), c in count.items() if k == key))
      for key in sorted(dims, key=lambda k: (dims[k][1], dims[k][0])))
  covered = {p for plan in plans for p in (plan.layer.kernel_path, plan.layer.bias_path)}
  passthrough = tuple(p for p in param_paths if p not in covered)
  return Layout(tuple(plans), buckets, tuple(l.name for l in skipped), passthrough,
                num_devices, group_size, axis)
