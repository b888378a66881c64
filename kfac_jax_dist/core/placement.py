"""Checks that a state and an update are where the transform expects them.

A state is laid out for one distribution (devices, owner group size, mesh
axis, storage); `update` of a distributed transform must run inside
`shard_map` over that axis, with the per-device parts that
`kd.partition_specs` gives. These checks turn the errors a misplaced state
would cause deep inside (wrong sizes, unbound axis names) into messages that
say what to do. `check_skip_patterns` rejects a `skip=` pattern that matches
nothing (a typo would otherwise silently precondition the layer).
"""

from __future__ import annotations

import re
import warnings
from typing import Sequence

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import registry
from kfac_jax_dist.core.distribution import Distribution


def check_layout(name: str, have: tuple, want: tuple, fields: Sequence[str]) -> None:
  """The state's placement `have` equals the transform's `want`, field by field."""
  if have == want:
    return
  diff = ", ".join(f"{n} {h!r} (transform: {w!r})" for n, h, w in zip(fields, have, want)
                   if h != w)
  raise ValueError(
      f"This {name} state was laid out for another distribution: {diff}. Use the "
      "state of this transform's init, or move it with kd.convert_state(state, "
      "tx.init(params)).")


def check_axis(name: str, dist: Distribution) -> None:
  """`update` runs inside `shard_map` over the distribution's axis, of its size."""
  try:
    size = lax.axis_size(dist.axis)
  except NameError as e:
    raise ValueError(
        f"This {name} transform is distributed over mesh axis {dist.axis!r} "
        f"({dist.num_devices} devices): call update inside jax.shard_map over that "
        "axis, with in_specs/out_specs from kd.partition_specs(opt_state).") from e
  if size != dist.num_devices:
    raise ValueError(
        f"update runs in a shard_map whose axis {dist.axis!r} has {size} devices, but "
        f"the Distribution's mesh has {dist.num_devices}: use that mesh.")


def check_gradients_averaged(name: str, dist: Distribution, grads: Any) -> None:
  """With `gradient_reduction="none"` the caller averages the gradients: inside
  `shard_map` they must be typed invariant over the data axis (a `pmean`'s
  result), not the local ones `kd.value_and_grad` returns."""
  if dist.gradient_reduction == "none" and dist.axis in _compat.varying_axes(grads):
    raise ValueError(
        f"{name}: the gradients vary over mesh axis {dist.axis!r} (each device's local "
        "ones), but the Distribution's gradient_reduction is \"none\", which means the "
        "caller averaged them. Average them first (grads = jax.lax.pmean(grads, "
        f"{dist.axis!r})), or let update do it: kd.Distribution(..., "
        "gradient_reduction=\"all_reduce\") (or \"reduce_scatter\", SP-NGD).")


def check_statistics_reduced(name: str, dist: Distribution, stats: Any) -> None:
  """With a `Distribution` the statistics may vary over its axis (each device's
  local batch: the layout averages them) and its model axes (a sharded layer's
  local factors). Over another mesh axis that the batch is also split over
  (sequence / context parallelism) each device's factors would be those of its
  own part of the batch: refused inside a typed `shard_map`, warned of where
  JAX does not say (`shard_map(check_vma=False)`)."""
  known = (dist.axis, *dist.model_axes)
  other = tuple(a for a in _compat.varying_axes(stats) if a not in known)
  fix = (f"average them over those axes first, as the gradients: stats = "
         f"jax.lax.pmean(stats, {other or '<the other batch axes>'}) (docs/"
         "distributed.md, 'Several batch axes')")
  if other:
    raise ValueError(
        f"{name}: kfac_stats vary over mesh axes {other}, which are neither the "
        f"Distribution's axis {dist.axis!r} nor a model axis: each device there holds "
        f"factors of its own part of the batch. {fix[0].upper()}{fix[1:]}.")
  untyped = tuple(a for a in _compat.untyped_device_axes() if a not in known)
  if untyped:
    warnings.warn(
        f"kfac_jax_dist: {name} updates inside shard_map(check_vma=False) over axes "
        f"{untyped} besides the Distribution's {known}, where JAX does not say whether "
        "the statistics vary: where the batch is split over them too (sequence "
        f"parallelism), " + fix.replace("<the other batch axes>", str(untyped)) + ".",
        stacklevel=5)


def check_statistics_undistributed(name: str, stats: Any) -> None:
  """Without a `Distribution` the statistics are used as given, so each
  device's factors are those of the statistics it holds. Inside `shard_map`
  they must not vary over a mesh axis (each device's own: its factors would
  differ from the others'); inside `jax.pmap` or `shard_map(check_vma=False)`
  JAX does not say, so a data-parallel loop that averages only the gradients
  is warned of."""
  axes = _compat.varying_axes(stats)
  if axes:
    raise ValueError(
        f"{name}: kfac_stats vary over mesh axes {axes} (each device's own, from its "
        "local batch), but the transform has no distribution: each device would "
        "precondition with factors of its own batch, and the devices' parameters would "
        "drift apart. Pass distribution=kd.Distribution(mesh, ...) (K-FAC's "
        f"distributed layouts), or average them first: jax.lax.pmean(stats, {axes}).")
  untyped = _compat.untyped_device_axes()
  if untyped:
    warnings.warn(
        f"kfac_jax_dist: {name} updates inside jax.pmap or shard_map(check_vma=False) "
        f"(axes {untyped}) without a distribution: each device preconditions with "
        "factors of the statistics it is given. In a data-parallel loop that averages "
        "the gradients, average the statistics too (stats = jax.lax.pmean(stats, "
        "axis): exact where every device has as many examples and no mask), or use "
        "shard_map with distribution=kd.Distribution(mesh); for independent runs per "
        "device (seeds), nothing is needed.", stacklevel=5)


def check_floating_params(name: str, params: Any) -> None:
  """Every parameter leaf is an array (`registry.check_array_leaves`) and real
  floating: an integer one has `float0` gradients, which no update can be
  added to; a complex one would need Hermitian statistics (conjugated
  products), which nothing here forms."""
  registry.check_array_leaves(name, params)
  for leaf_name, leaf in registry.named_leaves(params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or jnp.issubdtype(dtype, jnp.floating):
      continue
    where = f"{name}: parameter '{leaf_name}' has dtype {dtype}; "
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise TypeError(
          where + "complex parameters are not supported (their curvature is "
          "Hermitian: every statistic here is a real one's). Train the real and "
          "imaginary parts as two real parameters (w = w_re + 1j * w_im).")
    raise TypeError(
        where + "only floating parameters can be trained (an integer one has float0 "
        "gradients). Keep integer state (step counters, token ids) out of the "
        "parameter tree.")


def check_skip_patterns(patterns: Sequence[str], names: Sequence[str],
                        all_names: Sequence[str], what: str, option: str = "skip") -> None:
  """Every pattern of the option (`skip`, `stacked`) matches one of `names`
  (for `skip`, those it excluded); `all_names` are listed in the error."""
  for pattern in patterns:
    if not any(re.search(pattern, n) for n in names):
      raise ValueError(f"{option} pattern {pattern!r} matches no {what} "
                       f"({what}s: {list(all_names)}).")
