"""Stale statistics: a refresh interval per factor (SP-NGD, Osawa et al. 2020, §4.3).

Each factor X (every `A`, `G` and unit-wise `F`) is refreshed — its statistic
communicated, averaged into the running factor and decomposed — only at its
own steps `t_X` (Algorithm 1). After a refresh the next interval comes from how
much X moved (Algorithm 2), X being similar to Y when `‖X − Y‖_F / ‖Y‖_F < α`
(α = 0.1 in the paper):

    not similar to X₋₁:          Δ = max(1, ⌊Δ₋₁ / 2⌋)
    similar to X₋₁, not to X₋₂:  Δ = Δ₋₁
    similar to both:             Δ = Δ₋₁ + Δ₋₂

with X₋₁, X₋₂ the factor at its last two refreshes and Δ₋₁, Δ₋₂ the last two
intervals. X₋₁ is the running factor itself (it changes only when refreshed),
so only X₋₂ is stored beside it. The paper leaves the start open: here both
intervals start at 1, and a missing X₋₁ or X₋₂ (fewer than two refreshes so
far) counts as not similar. X is the running factor after the refresh (with
`factor_decay = 0`, the refresh's statistic itself, as in the paper).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kfac_jax_dist.capture import statistics as factors_lib
from kfac_jax_dist.kfac import layout as layout_lib


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["next_step", "interval", "previous_interval", "refreshes", "weight",
                 "before_last", "refresh_steps"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RefreshState:
  """Per-factor refresh schedule, in the order of `factor_order(layout)`.

  Attributes:
    next_step: `t_X`, the update count of the factor's next refresh.
    interval: `Δ₋₁`, the last interval.
    previous_interval: `Δ₋₂`, the one before.
    refreshes: refreshes so far (what was saved is `count − refreshes`).
    weight: total weight of each factor's running average.
    before_last: `X₋₂` of every factor, laid out as the running factors
      (`X₋₁` is the running factor itself).
    refresh_steps: the updates that refreshed any factor so far (a scalar).
  """

  next_step: jax.Array
  interval: jax.Array
  previous_interval: jax.Array
  refreshes: jax.Array
  weight: jax.Array
  before_last: jax.Array
  refresh_steps: jax.Array


def factor_order(lay: layout_lib.Layout):
  """`(plan, which, place)` of every factor: the order of `RefreshState`'s vectors."""
  return [(plan, which, place) for plan in lay.plans for which, place in plan.places]


def init(lay: layout_lib.Layout, running: jax.Array, weight_dtype, xp=jnp
         ) -> RefreshState:
  """Every factor due at step 0 (`xp`: jax.numpy, or numpy for host arrays)."""
  num = len(factor_order(lay))
  ones = xp.ones([num], jnp.int32)
  return RefreshState(
      next_step=xp.zeros([num], jnp.int32), interval=ones, previous_interval=ones,
      refreshes=xp.zeros([num], jnp.int32), weight=xp.zeros([num], weight_dtype),
      before_last=running, refresh_steps=xp.zeros([], jnp.int32))


def next_interval(similar_last: jax.Array, similar_before_last: jax.Array,
                  interval: jax.Array, previous_interval: jax.Array) -> jax.Array:
  """Algorithm 2 of SP-NGD: the interval until the next refresh."""
  return jnp.where(~similar_last, jnp.maximum(1, interval // 2),
                   jnp.where(~similar_before_last, interval, interval + previous_interval))


def _squared_weights(form: str, dim: int, packed: bool, dtype) -> jax.Array:
  """`w` with `Σ w x² = ‖X‖_F²` for the numbers stored for X: off-diagonal
  entries of a packed triangle (and the γβ entry of a unit-wise block) count
  twice."""
  if form == factors_lib.UNIT:
    return jnp.tile(jnp.asarray([1.0, 2.0, 1.0], dtype), dim)
  size = layout_lib.storage_size(dim, form, packed)
  if form == factors_lib.DIAG or not packed:
    return jnp.ones([size], dtype)
  rows = jnp.arange(dim)
  diagonal = rows * dim - rows * (rows - 1) // 2        # row-major upper triangle
  return jnp.full([size], 2.0, dtype).at[diagonal].set(1.0)


def relative_changes(x: jax.Array, y: jax.Array, form: str, dim: int, packed: bool
                     ) -> jax.Array:
  """`‖X − Y‖_F / ‖Y‖_F` of each row of `[n, size]` stored numbers of factors
  of one form and dimension, or of one factor's `[size]` (inf where Y = 0)."""
  w = factors_lib.with_leading_units(_squared_weights(form, dim, packed, x.dtype), x.ndim)
  num = jnp.sum(w * jnp.square(x - y), axis=-1)
  den = jnp.sum(w * jnp.square(y), axis=-1)
  return jnp.where(den > 0, jnp.sqrt(num / jnp.where(den > 0, den, 1.0)), jnp.inf)


def relative_change(x: jax.Array, y: jax.Array, place: layout_lib.FactorPlace,
                    packed: bool) -> jax.Array:
  """`relative_changes` of one factor's stored numbers."""
  return relative_changes(x, y, place.form, place.dim, packed)
