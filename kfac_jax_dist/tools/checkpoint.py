"""Checkpoints of optax states holding K-FAC states, and moving them between
distributions.

A `ScaleByKfacState` is a pytree whose array leaves (counters, running factors,
second-order state) are what orbax saves; its `layout` (which layer's factor
sits where, for which device count and strategy) is static metadata, not an
array. A checkpoint is therefore restored *into a template*: a state of the
same configuration, e.g. `tx.init(params)` or, without computing anything,
`jax.eval_shape(tx.init, params)`. The template gives the tree, the layout and
(with `mesh=`) the shardings; the checkpoint gives the numbers, bit for bit.

    kd.save_checkpoint("/ckpt/step_100", opt_state)
    template = jax.eval_shape(tx.init, params)
    opt_state = kd.restore_checkpoint("/ckpt/step_100", template, mesh=mesh)

`save_checkpoint` stores, next to the arrays, a JSON description of every
K-FAC, Shampoo and SOAP state's layout (`checkpoint_metadata`) and every
leaf's path, dtype and shape; `restore_checkpoint` refuses a template whose
layout differs (the arrays would have the right shapes but another meaning),
or whose leaves, dtypes or shapes do. Saved with one distribution (device
count, strategy, factor reduction, `symmetric_comm`) and needed with another:
restore into a template of the *saved* configuration, then
`convert_state(state, new_template)`.

Any pytree works (an optax state, or `{"params": ..., "opt_state": ...}`).
Arrays must be addressable from this process for `convert_state` (one host);
save and restore are orbax's and work across hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_dist.core import specs
from kfac_jax_dist.core import states as states_lib
from kfac_jax_dist.core import tensor_parallel
from kfac_jax_dist.capture import registry
from kfac_jax_dist.capture import statistics as factors_lib
from kfac_jax_dist.kfac import correction as correction_lib
from kfac_jax_dist.kfac import state as kfac_lib
from kfac_jax_dist.kfac import layout as layout_lib
from kfac_jax_dist.kfac import packing
from kfac_jax_dist.kfac import stale as stale_lib
from kfac_jax_dist.shampoo import soap as soap_lib
from kfac_jax_dist.shampoo import state as shampoo_state

_STATE, _META = "state", "kfac_layout"
# in the metadata of checkpoints whose second-order segments may share rows
# (of `L₂`), of those whose rows are wide (`layout.WIDE_ROWS`), and of those
# whose HYBRID groups are assigned together (oversized factors split within a
# group, every group's devices in one slot table: `layout._assign_in_groups`),
# and of those whose HYBRID pieces within a group escape the copies' cap
# (`layout._group_pieces_free`), and of those whose oversized layers may take
# fewer owners than their size needs (`layout.build(fewer_layer_pieces=)`)
SHARED_ROWS = "second_order_rows_shared"
WIDE_ROWS = "second_order_rows_wide"
ALIGNED_GROUPS = "owner_groups_aligned"
FREE_GROUP_PIECES = "group_pieces_uncapped"
FEWER_LAYER_PIECES = "layer_pieces_fewer"


def _is_kfac(x) -> bool:
  return isinstance(x, kfac_lib.ScaleByKfacState)


def _is_shampoo(x) -> bool:
  return isinstance(x, shampoo_state.ScaleByShampooState)


def _is_soap(x) -> bool:
  return isinstance(x, soap_lib.ScaleBySoapState)


def _is_state(x) -> bool:
  return _is_kfac(x) or _is_shampoo(x) or _is_soap(x)


# The states with a `ShampooLayout`, by their key in the metadata: their name
# in messages, their class, and what a checkpoint without the key
# holds: checkpoints from before Shampoo states were described hold none ([]),
# those from before SOAP states were described may hold some, undescribed
# (None: not checked, restored as before).
_BLOCK_STATES = {"shampoo_states": ("Shampoo", shampoo_state.ScaleByShampooState, []),
                 "soap_states": ("SOAP", soap_lib.ScaleBySoapState, None)}


def shampoo_layout_metadata(lay) -> dict[str, Any]:
  """What the arrays of a Shampoo state with layout `lay` mean: the
  distribution, every parameter's blocks and where each statistic lives."""
  return {"num_devices": lay.num_devices, "group_size": lay.group_size, "axis": lay.axis,
          "segment": lay.segment, "buckets": [[d, p] for d, p in lay.buckets],
          "sizes": list(lay.sizes),
          # a stacked parameter's stack length after its merged shape (only
          # there: checkpoints from before `stacked=` match as they were)
          "params": [[plan.path, list(plan.shape), plan.merged and list(plan.merged)]
                     + ([plan.stack] if plan.stack else []) for plan in lay.params],
          "places": [[list(x) for x in bucket] for bucket in lay.places]}


def layout_metadata(lay: layout_lib.Layout) -> dict[str, Any]:
  """What the arrays of a state with layout `lay` mean, as JSON-able data:
  the distribution, the storage, and every factor's form, dimension, owner and
  offsets."""
  factors = [[plan.layer.name, which, q.form, q.dim, q.owner, q.offset, q.size,
              q.matrix_offset, q.vector_offset]
             + ([] if q.columns is None and piece.rows is None
                else [list(q.columns or ()), list(piece.rows or ())])
             for plan in lay.plans for piece in plan.pieces
             for which, place in piece.places for q in (place,) + place.copies]
  return {"num_devices": lay.num_devices, "group_size": lay.group_size,
          "axis": lay.axis, "factor_storage": lay.factor_storage, "packed": lay.packed,
          "method": lay.method, "segment": lay.segment,
          "second_segment": lay.second_segment, "factors": factors,
          # several segments to a row (a layout without these is one
          # segment per row, as every checkpoint before them), and how wide
          **({"second_slots": [list(s) for s in lay.second_slots]}
             if lay.rows_shared else {}),
          **({"second_row": lay.second_row}
             if lay.rows_shared and lay.second_packing == layout_lib.WIDE_ROWS else {})}


def checkpoint_metadata(tree: Any) -> dict[str, Any]:
  """`layout_metadata` of every K-FAC state in `tree`, and
  `shampoo_layout_metadata` of every Shampoo and every SOAP state, in tree
  order; and `SHARED_ROWS`, `WIDE_ROWS`, `ALIGNED_GROUPS`,
  `FREE_GROUP_PIECES` and `FEWER_LAYER_PIECES`, which tell
  `restore_checkpoint` how K-FAC layouts pack second-order segments
  (`Layout.second_packing`), whether HYBRID's groups were assigned together,
  whether their factors' pieces were capped and whether an oversized layer
  could take fewer owners."""
  return {"kfac_states": [layout_metadata(s.layout) for s in kfac_lib.find_states(tree)],
          **{key: [shampoo_layout_metadata(s.layout)
                   for s in states_lib.find_states(tree, kind)]
             for key, (_, kind, _) in _BLOCK_STATES.items()},
          SHARED_ROWS: True, WIDE_ROWS: True, ALIGNED_GROUPS: True,
          FREE_GROUP_PIECES: True, FEWER_LAYER_PIECES: True}


def _checkpointer():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError("kd.save_checkpoint / kd.restore_checkpoint need orbax-checkpoint: "
                      "pip install 'kfac_jax_dist[checkpoint]'.") from error
  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_checkpoint(directory: str | os.PathLike, tree: Any, *, force: bool = False
                    ) -> None:
  """Saves `tree` (any pytree of arrays, e.g. an optax state) with orbax, with
  the layout of its K-FAC states (`checkpoint_metadata`). Sharded arrays are
  saved sharded. Blocks until written; `force` overwrites `directory`."""
  ocp, checkpointer = _checkpointer()
  checkpointer.save(
      os.path.abspath(directory),
      ocp.args.Composite(**{_STATE: ocp.args.StandardSave(tree),
                            _META: ocp.args.JsonSave(dict(checkpoint_metadata(tree),
                                                          dtypes=_dtypes(tree),
                                                          shapes=_shapes(tree)))}),
      force=force)


def _abstract(template: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """`ShapeDtypeStruct`s with shardings: `kd.partition_specs` on `mesh`, else
  the template's own (where it has none: one device; with several processes,
  replicated on all devices, so that every process holds it)."""
  if jax.process_count() > 1:
    everywhere = jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
    default = jax.sharding.NamedSharding(everywhere, jax.sharding.PartitionSpec())
  else:
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def leaf(spec: Any, x: Any) -> Any:
    if mesh is not None:
      sharding = jax.sharding.NamedSharding(mesh, spec)
    else:
      sharding = getattr(x, "sharding", None) or default
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)

  return jax.tree_util.tree_map(leaf, specs.partition_specs(template), template)


def restore_checkpoint(directory: str | os.PathLike, template: Any, *,
                       mesh: jax.sharding.Mesh | None = None) -> Any:
  """Restores a `save_checkpoint` checkpoint into the structure of `template`.

  Args:
    directory: the checkpoint.
    template: a tree of the saved configuration: the same pytree structure
      and K-FAC layouts (e.g. `tx.init(params)` or `jax.eval_shape(tx.init,
      params)` of the same transform); its values are not used.
    mesh: place the result with `kd.partition_specs(template)` on this mesh
      (K-FAC factors sharded as `update` inside `shard_map` expects, the rest
      replicated). None: with the template's own shardings (where a leaf
      has none: one device; with several processes, replicated on all).

  Returns:
    The saved tree, bit for bit, with `template`'s structure and layouts.

  Raises:
    ValueError: the template's K-FAC, Shampoo or SOAP layouts are not the
      saved ones (another device count, strategy or set of layers; see
      `convert_state`), or its leaves (paths), dtypes or shapes are not the
      saved ones.
  """
  ocp, checkpointer = _checkpointer()
  path = os.path.abspath(directory)
  _check_readable(path)
  saved = checkpointer.restore(path, ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
  # saved before rows were wide or shared, or before HYBRID's groups were
  # assigned together: restored in that layout, then moved
  target = _saved_layouts(template, saved[_META])
  _check_compatible(saved[_META], checkpoint_metadata(target))
  _check_dtypes(saved[_META], target)
  _check_mesh(template, mesh)
  restored = checkpointer.restore(path, ocp.args.Composite(
      **{_STATE: ocp.args.StandardRestore(_abstract(target, mesh))}))[_STATE]
  if target is template:
    return restored
  return jax.tree_util.tree_map(lambda x, want: jax.device_put(x, want.sharding),
                                convert_state(restored, template), _abstract(template, mesh))


def _saved_layouts(template: Any, meta: dict) -> Any:
  """`template` with every K-FAC state in the layout of the checkpoint whose
  metadata is `meta`, its arrays abstract: the packing of second-order
  segments before rows were wide (`layout.SEGMENT_ROWS`: rows of `L₂`) or
  before segments shared rows (`layout.PADDED_ROWS`: `[m·L₂]` per device,
  EK-FAC's gathered eigenbases `[P·L₂]`), and HYBRID's assignment before its
  groups were assigned together (`layout.rebuild(align_groups=False)`, in
  the saved factor storage) or before a factor's pieces within a group were
  uncapped (`cap_group_pieces=True`), and the assignment of layers to owner
  groups before an oversized layer could take fewer owners
  (`fewer_layer_pieces=False`); `template` itself where no layout differs."""
  if meta.get(FEWER_LAYER_PIECES):
    return template
  groups_then = ({} if meta.get(FREE_GROUP_PIECES) else
                 dict(cap_group_pieces=True) if meta.get(ALIGNED_GROUPS) else
                 dict(align_groups=False))
  packing_then = (layout_lib.WIDE_ROWS if meta.get(WIDE_ROWS) else
                  layout_lib.SEGMENT_ROWS if meta.get(SHARED_ROWS) else layout_lib.PADDED_ROWS)
  saved_layouts = iter(meta.get("kfac_states", []))

  def layout_then(lay: layout_lib.Layout, saved: dict) -> layout_lib.Layout:
    if lay.num_groups > 1 and lay.built_with:
      lay = layout_lib.rebuild(lay, fewer_layer_pieces=False,
                               **(groups_then if lay.group_size > 1 else {}))
      lay = dataclasses.replace(lay, factor_storage=saved.get("factor_storage",
                                                              lay.factor_storage))
    return dataclasses.replace(lay, second_packing=packing_then)

  def legacy(state: kfac_lib.ScaleByKfacState) -> kfac_lib.ScaleByKfacState:
    current = state.layout
    lay = layout_then(current, next(saved_layouts, {}))
    geometry = lambda l: (l.plans, l.factor_storage, l.second_slots, l.owner_slots,
                          l.second_array, l.owner_array)
    if geometry(lay) == geometry(current):
      return state

    def resized(x: Any, now: int, then: int) -> jax.ShapeDtypeStruct:
      shape = jnp.shape(x)
      return jax.ShapeDtypeStruct(shape[:-1] + (shape[-1] // now * then,),
                                  jnp.result_type(x))
    shards = current.factor_shard, lay.factor_shard
    correction, refresh = state.correction, state.refresh
    if correction is not None and correction.bases is not None:
      correction = dataclasses.replace(correction, bases=resized(
          correction.bases, current.owner_array, lay.owner_array))
    if refresh is not None:
      refresh = dataclasses.replace(refresh, before_last=resized(refresh.before_last,
                                                                 *shards))
    return dataclasses.replace(
        state, layout=lay, correction=correction, refresh=refresh,
        factors=resized(state.factors, *shards), second_order=resized(
            state.second_order, current.second_array, lay.second_array))
  out = jax.tree_util.tree_map(lambda x: legacy(x) if _is_kfac(x) else x, template,
                               is_leaf=_is_kfac)
  same = all(a is b for a, b in zip(*(jax.tree_util.tree_leaves(t, is_leaf=_is_kfac)
                                      for t in (out, template))))
  return template if same else out


# The checkpoint's JSON files (orbax's and the layouts'): a damaged one is
# named instead of surfacing as a bare JSONDecodeError from inside orbax.
_JSON_FILES = ("_CHECKPOINT_METADATA", f"{_META}/metadata", f"{_STATE}/_METADATA",
               f"{_STATE}/_sharding")


def _check_readable(path: str) -> None:
  """Every JSON metadata file of the checkpoint at `path` parses."""
  if not os.path.isdir(path):
    raise ValueError(f"restore_checkpoint: no checkpoint at {path}")
  arrays = os.path.join(path, _STATE, "array_metadatas")
  files = [os.path.join(path, f) for f in _JSON_FILES] + (
      [os.path.join(arrays, f) for f in sorted(os.listdir(arrays))]
      if os.path.isdir(arrays) else [])
  for file in files:
    if not os.path.exists(file):
      continue
    try:
      with open(file, encoding="utf-8") as f:
        json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
      raise ValueError(f"restore_checkpoint: the checkpoint's metadata file {file} is "
                       f"damaged ({e}); restore an earlier checkpoint.") from e


def _by_path(tree: Any, fact: Callable[[Any], Any]) -> list[list]:
  """`[path, fact(leaf)]` of every array leaf (saved, and compared at restore)."""
  return [[jax.tree_util.keystr(path), fact(x)]
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _dtypes(tree: Any) -> list[list]:
  return _by_path(tree, lambda x: str(jnp.result_type(x)))


def _shapes(tree: Any) -> list[list]:
  return _by_path(tree, lambda x: list(jnp.shape(x)))


def _few(paths: list[str], most: int = 4) -> str:
  """`paths`, the first `most` of them named."""
  if not paths:
    return "none"
  more = f" and {len(paths) - most} more" if len(paths) > most else ""
  return ", ".join(paths[:most]) + more


def _check_paths(saved: list[str], template: list[str]) -> None:
  """The template's leaves are the saved ones (`keystr` paths), in order."""
  if saved == template:
    return
  in_template = set(template)
  only_saved = [p for p in saved if p not in in_template]
  in_saved = set(saved)
  only_template = [p for p in template if p not in in_saved]
  what = (f"leaves only in the checkpoint: {_few(only_saved)}; only in the template: "
          f"{_few(only_template)}" if only_saved or only_template else
          "the same leaves in another order")
  raise ValueError(
      f"restore_checkpoint: the template is another tree than the checkpoint's ({what}). "
      "Restore into a template of the saved configuration (the same optax chain and "
      "options, e.g. eigenvalue_correction or graft_type).")


def _check_dtypes(saved: dict, template: Any) -> None:
  """The template's leaves are the saved ones (`_check_paths`) and have the
  saved dtypes (orbax would cast silently) and shapes (orbax's error names
  no leaf)."""
  if "dtypes" not in saved:        # saved before dtypes were recorded
    return
  wanted = _dtypes(template)
  _check_paths([path for path, _ in saved["dtypes"]], [path for path, _ in wanted])
  for (path, have), (_, want) in zip(saved["dtypes"], wanted):
    if have != want:
      raise ValueError(
          f"restore_checkpoint: leaf {path} was saved as {have}, the template has "
          f"{want}. Restore into a template of the saved dtypes (e.g. the same "
          "factor_dtype / statistics_dtype), then cast if you mean to.")
  for (path, have), (_, want) in zip(saved.get("shapes", ()), _shapes(template)):
    if have != want:           # (checkpoints saved before shapes were recorded: orbax's)
      raise ValueError(
          f"restore_checkpoint: leaf {path} was saved with shape {tuple(have)}, the "
          f"template has {tuple(want)}. Restore into a template of the saved "
          "configuration (the same model and optimizer).")


def _check_mesh(template: Any, mesh: jax.sharding.Mesh | None) -> None:
  """A distributed state is restored onto a mesh of its device count (or into
  a template already placed on one)."""
  if mesh is not None:
    specs.check_mesh(template, mesh, "restore_checkpoint")
    return
  for state in specs.distributed_states(template):
    lay = state.layout
    if not any(isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
               for x in jax.tree_util.tree_leaves(state)):
      raise ValueError(
          f"restore_checkpoint: the template holds a state distributed over "
          f"{lay.num_devices} devices of axis {lay.axis!r} but is not placed on a "
          "mesh: pass mesh= (the mesh of its Distribution).")


def _unboxed(shampoo_states: list[dict]) -> list[dict]:
  """Shampoo metadata with a boxed parameter's path as the bare array's: those
  of checkpoints written before `registry.path_str` dropped an NNX Variable's
  (or linen `Partitioned`'s) `value` key end in `/value` (or `/raw_value`)."""
  box = re.compile("/(" + "|".join(registry.BOX_ATTRIBUTES) + ")$")
  strip = lambda path: box.sub("", path)
  return [{**state, "params": [[strip(path), *rest] for path, *rest in state["params"]]}
          for state in shampoo_states]


# summarised in messages rather than printed: every block's parameter and place
_BLOCK_DETAILS = {"params": "parameters or their blocks differ",
                  "places": "block placement differs"}


def _block_layout_difference(have: dict, want: dict) -> str:
  """What differs between two `shampoo_layout_metadata`s; '' where nothing."""
  diff = [k for k in {**have, **want} if have.get(k) != want.get(k)]
  return ", ".join([f"{k}: saved {have.get(k)!r}, template {want.get(k)!r}" for k in diff
                    if k not in _BLOCK_DETAILS] +
                   [_BLOCK_DETAILS[k] for k in diff if k in _BLOCK_DETAILS])


def _check_block_layouts(kind: str, have: list[dict], want: list[dict]) -> None:
  """The checkpoint's `kind` (Shampoo or SOAP) states, described by `have`,
  have the layouts `want` of the template's, one by one."""
  have, want = _unboxed(have), _unboxed(want)
  if len(have) != len(want):
    details = f"{len(have)} in the checkpoint, {len(want)} in the template"
  else:
    details = next((f"state {i}: {d}" for i, (h, w) in enumerate(zip(have, want))
                    if (d := _block_layout_difference(h, w))), "")
    if not details:
      return
  raise ValueError(
      f"The checkpoint's {kind} states were saved with another layout ({details}; device "
      "count, grad_worker_fraction, parameters or block options). Restore into a template "
      "of the saved configuration, then kd.convert_state(state, new_template).")


def _check_compatible(saved: dict, wanted: dict) -> None:
  """The template's layouts (`wanted`, its `checkpoint_metadata`) are the
  checkpoint's (`saved`)."""
  for key, (name, _, missing) in _BLOCK_STATES.items():
    have = saved.get(key, missing)
    if have is not None:
      _check_block_layouts(name, have, wanted[key])
  saved_states, wanted_states = saved["kfac_states"], wanted["kfac_states"]
  if len(saved_states) != len(wanted_states):
    raise ValueError(f"The checkpoint holds {len(saved_states)} K-FAC state(s), the "
                     f"template {len(wanted_states)}.")
  for i, (have, want) in enumerate(zip(saved_states, wanted_states)):
    diff = [k for k in want if have.get(k) != want[k]]
    if diff:
      details = ", ".join(f"{k}: saved {have.get(k)!r}, template {want[k]!r}"
                          for k in diff if k != "factors")
      if "factors" in diff:
        details += (", " if details else "") + _factor_difference(have["factors"],
                                                                  want["factors"])
      raise ValueError(
          f"K-FAC state {i} of the checkpoint was saved with another layout ({details}). "
          "Restore into a template of the saved configuration (the same layers, "
          "Distribution, skip=, max_factor_dim and cadences: the storage follows "
          "them), then kd.convert_state(state, new_template), which moves a state "
          "between distributions and storages, not between sets of layers or their "
          "factors' shapes: a changed model starts K-FAC's state anew (tx.init).")


def _factor_difference(saved: list, wanted: list) -> str:
  """Which layers' factors differ between two layouts' metadata (`factors`:
  one entry per factor place, `[layer, which, form, dim, owner, ...]`)."""
  shapes = lambda entries: {(e[0], e[1]): tuple(e[2:4]) for e in entries}
  have, want = shapes(saved), shapes(wanted)
  names = lambda keys: sorted({name for name, _ in keys})
  only_saved, only_template = (names(have.keys() - want.keys()),
                               names(want.keys() - have.keys()))
  reshaped = names(k for k in have.keys() & want.keys() if have[k] != want[k])
  parts = [f"{what}: {found}" for what, found in (
      ("layers only in the checkpoint", only_saved),
      ("layers only in the template", only_template),
      ("layers whose factors' form or size differ", reshaped)) if found]
  return "; ".join(parts) or "the factors are placed on other owners"


# ------------------------------------------------------------------ conversion

def _check_convertible(old: layout_lib.Layout, new: layout_lib.Layout) -> None:
  if old.method != new.method:
    raise ValueError(f"convert_state moves a state between distributions, not methods "
                     f"(saved {old.method!r}, template {new.method!r}).")
  forms = lambda lay: {(p.layer.name, w): (pl.form, pl.dim)
                       for p in lay.plans for w, pl in p.places}
  have, want = forms(old), forms(new)
  if have != want:
    missing = sorted(set(want) - set(have))
    other = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    raise ValueError(
        "convert_state needs the same layers and factor forms on both sides "
        f"(factors only in the template: {missing}; of another form or dimension: "
        f"{other}; only in the state: {sorted(set(have) - set(want))}).")


def _convert_kfac(old: kfac_lib.ScaleByKfacState, new: kfac_lib.ScaleByKfacState
                  ) -> kfac_lib.ScaleByKfacState:
  lay = new.layout
  _check_convertible(old.layout, lay)
  old = jax.tree_util.tree_map(np.asarray, old)      # global arrays, on the host
  factors = _running_like(old, old.factors, lay, new.factors.dtype)
  parts = kfac_lib.second_order_parts(old)
  dtype = new.second_order.dtype
  segments = []
  for device in range(lay.num_devices):
    segment = packing.second_order_segment(lay, device, dtype, np)
    for place, plan, which in lay.owned(device):
      matrix, vector = parts[plan.layer.name][which.upper()]
      lo, hi = place.columns or (0, place.dim)     # a split factor's columns
      if place.matrix_offset is not None:
        matrix = np.asarray(matrix)[:, lo:hi].reshape(-1)
        segment[place.matrix_offset:place.matrix_offset + matrix.size] = matrix
      if place.vector_offset is not None:
        vector = np.asarray(vector)
        vector = (vector if place.form == factors_lib.UNIT else vector[lo:hi]).reshape(-1)
        segment[place.vector_offset:place.vector_offset + vector.size] = vector
    segments.append(segment)
  return kfac_lib.ScaleByKfacState(
      count=jnp.asarray(old.count, new.count.dtype),
      factor_weight=jnp.asarray(old.factor_weight, new.factor_weight.dtype),
      update_factors=jnp.asarray(old.update_factors, new.update_factors.dtype),
      factors=jnp.asarray(factors),
      second_order=jnp.asarray(kfac_lib.global_second_order(lay, segments, np)),
      skipped=jnp.asarray(old.skipped, new.skipped.dtype), layout=lay,
      refresh=_convert_refresh(old, new), correction=_convert_correction(old, new, segments),
      marked_weight=_convert_marked_weight(old, new))


def _check_both_or_neither(old: Any, new: Any, what: str, same: str) -> None:
  """`convert_state` moves an optional part of the state (`what`) only
  between two states that both have it, or neither."""
  if (old is None) != (new is None):
    raise ValueError(f"convert_state: only one of the two K-FAC states has {what}; "
                     f"build the template with the same {same}.")


def _convert_marked_weight(old: kfac_lib.ScaleByKfacState, new: kfac_lib.ScaleByKfacState
                           ) -> jax.Array | None:
  """The running weights of the layers that may sit out a pass or run under
  a row mask (`TaggedLayer.counted`), layer by layer (None without such
  layers); DP-KFAC's per device, each layer's read from its owner's and
  written to every device's (only its owner's is used). A layer the old
  state did not count (a row mask added since) took every pass: its weight
  is the old state's `factor_weight`."""
  if new.marked_weight is None:
    return None
  have = {} if old.marked_weight is None else _marked_weights(old)
  every_pass = np.asarray(old.factor_weight)
  names = [plan.layer.name for plan in layout_lib.sit_out_plans(new.layout)]
  rows = new.marked_weight.shape[0] // max(len(names), 1)
  weights = [have.get(name, every_pass) for name in names]
  return jnp.asarray(np.tile(np.asarray(weights), rows), new.marked_weight.dtype)


def _marked_weights(state: kfac_lib.ScaleByKfacState) -> dict[str, Any]:
  """Layer name -> its running weight (DP-KFAC's: its owner's)."""
  lay = state.layout
  plans = layout_lib.sit_out_plans(lay)
  weights = np.asarray(state.marked_weight).reshape(-1, len(plans))
  return {plan.layer.name: weights[plan.places[0][1].owner if lay.local_factors else 0, k]
          for k, plan in enumerate(plans)}


def _running_like(old: kfac_lib.ScaleByKfacState, flat: np.ndarray,
                  lay: layout_lib.Layout, dtype: Any) -> np.ndarray:
  """`flat` (numbers laid out as `old`'s running factors: the factors, or
  stale statistics' `X₋₂`) laid out as `lay`'s, factor by factor."""
  running = kfac_lib.running_factors(dataclasses.replace(old, factors=flat))
  return packing.all_segments(
      lay, lambda plan, which: running[plan.layer.name][which.upper()], dtype, np)


def _convert_refresh(old: kfac_lib.ScaleByKfacState, new: kfac_lib.ScaleByKfacState
                     ) -> stale_lib.RefreshState | None:
  """Stale statistics' schedule, factor by factor (None without them): the
  per-factor vectors by `(layer, factor)`, `X₋₂` as the running factors. A
  factor split into column pieces takes its first piece's."""
  _check_both_or_neither(old.refresh, new.refresh, "stale_threshold", "stale_threshold")
  if new.refresh is None:
    return None
  r = old.refresh
  index = {}
  for k, (plan, which, _) in enumerate(stale_lib.factor_order(old.layout)):
    index.setdefault((plan.layer.name, which), k)
  picks = np.asarray([index[(plan.layer.name, which)]
                      for plan, which, _ in stale_lib.factor_order(new.layout)], np.int32)
  vectors = {name: jnp.asarray(np.asarray(getattr(r, name))[picks],
                               getattr(new.refresh, name).dtype)
             for name in ("next_step", "interval", "previous_interval", "refreshes",
                          "weight")}
  dtype = new.refresh.before_last.dtype
  return stale_lib.RefreshState(
      **vectors,
      before_last=jnp.asarray(_running_like(old, r.before_last, new.layout, dtype)),
      refresh_steps=jnp.asarray(r.refresh_steps, new.refresh.refresh_steps.dtype))


def _convert_correction(old: kfac_lib.ScaleByKfacState, new: kfac_lib.ScaleByKfacState,
                        segments: list[np.ndarray]) -> correction_lib.CorrectionState | None:
  """EK-FAC's scaling and freshness, layer by layer (None without the
  correction); with several owner groups in `new`, the gathered eigenbases:
  every device's own second-order segment (`segments`), in the rows of
  `Layout.owner_slots`."""
  _check_both_or_neither(old.correction, new.correction, 'eigenvalue_correction="ekfac"',
                         "eigenvalue_correction")
  if new.correction is None:
    return None
  scaling = correction_lib.layer_scaling(old.layout, old.correction)
  old_names = [plan.layer.name for plan, _ in correction_lib.corrected_plans(old.layout)]
  fresh = dict(zip(old_names, np.asarray(old.correction.fresh)))
  names = [plan.layer.name for plan, _ in correction_lib.corrected_plans(new.layout)]
  flat = [np.asarray(scaling[name]).reshape(-1) for name in names]
  return correction_lib.CorrectionState(
      jnp.asarray(np.concatenate(flat) if flat else np.zeros(0),
                  new.correction.scaling.dtype),
      jnp.asarray([fresh[name] for name in names], bool).reshape(len(names)),
      None if new.correction.bases is None else jnp.asarray(
          kfac_lib.global_second_order(new.layout, segments, np, owners=True),
          new.correction.bases.dtype))


def _check_same_blocks(old_layout, lay) -> None:
  logical = lambda x: (x.params, x.buckets, x.sizes)
  if logical(old_layout) != logical(lay):
    raise ValueError(
        "convert_state moves a Shampoo state between distributions: it needs the same "
        "parameters and block options on both sides (the statistics' buckets differ: "
        f"{list(zip(old_layout.buckets, old_layout.sizes))} in the state, "
        f"{list(zip(lay.buckets, lay.sizes))} in the template).")


def _convert_soap(old, new):
  """A SOAP state with the template's layout: statistics and eigenbases as
  Shampoo's statistics and roots, the moments parameter by parameter."""
  _check_same_blocks(old.layout, new.layout)
  stats, bases = shampoo_state.bucket_arrays(old)
  stats, bases = (tuple([x]) for x in shampoo_state.placed_arrays(new.layout, stats, bases))
  cast = lambda xs, like: tuple(jnp.asarray(x, y.dtype) for x, y in zip(xs, like))
  out = soap_lib.with_moments(new, *soap_lib.param_moments(old))
  return dataclasses.replace(
      out, count=jnp.asarray(np.asarray(old.count), new.count.dtype),
      skipped=jnp.asarray(np.asarray(old.skipped), new.skipped.dtype),
      statistics=cast(stats, new.statistics), bases=cast(bases, new.bases))


def _convert_shampoo(old, new):
  lay = new.layout
  _check_same_blocks(old.layout, lay)
  stats, roots = (tuple([x]) for x in shampoo_state.placed_arrays(
      lay, *shampoo_state.bucket_arrays(old)))
  cast = lambda xs, like: tuple(jnp.asarray(x, jnp.result_type(y)) for x, y in zip(xs, like))
  if len(old.graft) != len(new.graft):
    raise ValueError("convert_state: the Shampoo states have different grafting "
                     f"({len(old.graft)} vs {len(new.graft)} accumulators).")
  return shampoo_state.ScaleByShampooState(
      count=jnp.asarray(np.asarray(old.count), new.count.dtype),
      statistics=cast(stats, new.statistics), roots=cast(roots, new.roots),
      graft=cast([np.asarray(x) for x in old.graft], new.graft),
      skipped=jnp.asarray(np.asarray(old.skipped), new.skipped.dtype), layout=lay)


def convert_state(state: Any, template: Any) -> Any:
  """Moves an optax state to another distribution: `template`'s.

  `state` is a global state (as `tx.init` makes it, restored from a
  checkpoint, or the output of a `shard_map`'d step) of one configuration,
  `template` one of the target configuration, e.g. `tx_new.init(params)`
  (optionally placed with `kd.shard_state`): the same optax chain and tagged
  layers, another device count, `grad_worker_fraction`, `factor_reduction`
  or `symmetric_comm` (the method, the factor forms and the layers must
  match). A Shampoo state's statistics, roots, grafting accumulators and
  count move over exactly (the same parameters and block options on both
  sides). Every K-FAC state's running factors (read with `running_factors`,
  written with the template's layout) *and* second-order information (each
  factor's eigenbasis and eigenvalues, or damped inverse) move over exactly,
  as do its counters, stale statistics' schedules (`_convert_refresh`) and
  EK-FAC's scaling (`_convert_correction`); every other leaf (momentum, ...)
  is copied. The result
  continues the trajectory: the next update is the one the old configuration
  would have made (up to the float32 differences between strategies), and
  the cadence is unchanged. Moving the decompositions rather than recomputing
  them keeps the exact trajectory between inverse steps and costs no
  decomposition; they are per-factor data, independent of the layout.

  A tensor-parallel state (`model_axis`) moves between strategies over the
  data axis, each model shard's state on its own (the same model axes, sizes
  and `param_specs` on both sides).

  Storing a factor as an upper triangle (`symmetric_comm=True`) keeps only
  that triangle of a full one. Leaves are placed with the template's
  shardings where it has them. Reads the arrays on this host (one process).

  Returns:
    A state with `template`'s structure, layouts and shardings.
  """
  if any(tensor_parallel.find_sharding(x) is not None for x in (state, template)):
    return _convert_model_sharded(state, template)
  leaves, treedef = jax.tree_util.tree_flatten(state, is_leaf=_is_state)
  targets, target_def = jax.tree_util.tree_flatten(template, is_leaf=_is_state)
  _check_same_structure(treedef, target_def)
  out = []
  for leaf, target in zip(leaves, targets):
    if (_is_state(leaf) or _is_state(target)) and type(leaf) is not type(target):
      raise ValueError(f"convert_state: the state holds a {type(leaf).__name__} where the "
                       f"template holds a {type(target).__name__}; it moves a state "
                       "between distributions of the same optimizer.")
    if _is_kfac(target):
      value = _convert_kfac(leaf, target)
    elif _is_shampoo(target):
      value = _convert_shampoo(leaf, target)
    elif _is_soap(target):
      value = _convert_soap(leaf, target)
    else:
      if jnp.shape(leaf) != jnp.shape(target):
        raise ValueError(f"convert_state: a leaf of shape {jnp.shape(leaf)} where the "
                         f"template has {jnp.shape(target)}.")
      value = jnp.asarray(np.asarray(leaf), jnp.result_type(target))
    value = jax.tree_util.tree_map(_place_like, value, target)
    out.append(value)
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_same_structure(treedef: Any, target_def: Any) -> None:
  if treedef != target_def:
    raise ValueError(f"convert_state: the state and the template are different optax "
                     f"states:\n{treedef}\nvs\n{target_def}")


def _convert_model_sharded(state: Any, template: Any) -> Any:
  """Tensor-parallel states (`model_axis`): each model shard's single-axis
  state converted on its own (`model_shard`, then `stack_shards`), between
  strategies over the data axis; the other leaves copied."""
  is_sharded = lambda x: isinstance(x, tensor_parallel.ModelShardedState)
  olds, treedef = jax.tree_util.tree_flatten(state, is_leaf=is_sharded)
  news, target_def = jax.tree_util.tree_flatten(template, is_leaf=is_sharded)
  _check_same_structure(treedef, target_def)
  out = []
  for old, new in zip(olds, news):
    if not is_sharded(new):
      out.append(convert_state(old, new))
      continue
    if not is_sharded(old) or old.sharding != new.sharding:
      raise ValueError("convert_state moves a tensor-parallel state between strategies "
                       "over the data axis only: the state and the template need the "
                       "same model axes, sizes and param_specs.")
    # shards read on the host once (no per-shard device splits and placements:
    # the stacked result is placed like the template below)
    old_host, new_host = jax.device_get((old, new))
    shards = [convert_state(tensor_parallel.model_shard(old_host, i),
                            tensor_parallel.model_shard(new_host, i))
              for i in range(new.sharding.size)]
    value = dataclasses.replace(new, inner=tensor_parallel.stack_shards(shards))
    out.append(jax.tree_util.tree_map(_place_like, value, new))
  return jax.tree_util.tree_unflatten(treedef, out)


def _place_like(value, target):
  if isinstance(target, jax.Array):
    return jax.device_put(value, target.sharding)
  return value
