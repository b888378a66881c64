"""Buckets, padding and owners: where every Kronecker factor lives in the state.

Factors of the same form and dimension `d` are stacked into one bucket, an
array `[n, d, d]` (or `[n, d]` for diagonal factors), so that decompositions run
as one batched `eigh`/`cholesky` per bucket. Each bucket is padded with identity
matrices to a multiple of the number of owners `P`; owner `p` holds slots
`[p·n/P, (p+1)·n/P)`. Padding is exact: the padded slots never touch a
gradient. Which factor sits in which slot is static metadata, fixed at `init`.

With one device `P = 1`: one owner, no padding.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

from kfac_jax_dist import factors
from kfac_jax_dist import registry


@dataclasses.dataclass(frozen=True)
class Slot:
  bucket: str
  index: int


@dataclasses.dataclass(frozen=True)
class Bucket:
  key: str
  form: str          # factors.FULL | factors.DIAG
  dim: int
  size: int          # slots, padding included
  used: int          # slots holding a real factor

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.size, self.dim, self.dim) if self.form == factors.FULL else (
        self.size, self.dim)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  layer: registry.TaggedLayer
  a: Slot
  g: Slot
  a_form: str
  g_form: str


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of a K-FAC state: layers, buckets and what is left out."""

  plans: tuple[LayerPlan, ...]
  buckets: tuple[Bucket, ...]
  skipped: tuple[str, ...]            # tagged layers excluded by name pattern
  passthrough: tuple[str, ...]        # parameter paths with no factor
  num_owners: int = 1

  def bucket(self, key: str) -> Bucket:
    return next(b for b in self.buckets if b.key == key)

  def plan(self, name: str) -> LayerPlan | None:
    return next((p for p in self.plans if p.layer.name == name), None)

  def owner(self, slot: Slot) -> int:
    return slot.index // (self.bucket(slot.bucket).size // self.num_owners)


def bucket_key(form: str, dim: int) -> str:
  return f"{form}{dim}"


def factor_form(dim: int, max_factor_dim: int | None) -> str:
  return factors.DIAG if max_factor_dim is not None and dim > max_factor_dim else factors.FULL


def build(layers: registry.LayerRegistry, param_paths: Sequence[str], *,
          skip: Sequence[str] = (), max_factor_dim: int | None = None,
          num_owners: int = 1) -> Layout:
  """Places every factor of the non-skipped layers into a bucket slot.

  Slots are filled in registration order; each bucket is padded to a multiple
  of `num_owners`.
  """
  patterns = [re.compile(p) for p in skip]
  kept, skipped = [], []
  for layer in layers:
    (skipped if any(p.search(layer.name) for p in patterns) else kept).append(layer)

  counts: dict[str, int] = {}
  dims: dict[str, tuple[str, int]] = {}
  plans = []

  def take(dim):
    form = factor_form(dim, max_factor_dim)
    key = bucket_key(form, dim)
    dims[key] = (form, dim)
    counts[key] = counts.get(key, 0) + 1
    return Slot(key, counts[key] - 1), form

  for layer in kept:
    a_slot, a_form = take(layer.a_dim)
    g_slot, g_form = take(layer.g_dim)
    plans.append(LayerPlan(layer, a_slot, g_slot, a_form, g_form))

  buckets = tuple(
      Bucket(key, dims[key][0], dims[key][1],
             size=math.ceil(counts[key] / num_owners) * num_owners, used=counts[key])
      for key in sorted(counts, key=lambda k: (dims[k][1], dims[k][0])))
  covered = {p for plan in plans for p in (plan.layer.kernel_path, plan.layer.bias_path)}
  passthrough = tuple(p for p in param_paths if p not in covered)
  return Layout(tuple(plans), buckets, tuple(l.name for l in skipped), passthrough,
                num_owners)
