"""`kd.Distribution.auto`: the strategy with the fewest bytes per step that fits.

Oracles: (1) an exhaustive search written here over every strategy, each one's
layout and state taken from the real transform (`jax.eval_shape` of
`kd.kfac(...).init` with that `Distribution`), its bytes from the cost model
and its memory from the abstract state's shapes and partition specs, on the
layer shapes of ResNet-50, BERT-Large and GPT-2-XL (benchmarks/layout_balance);
(2) on the 8-device CPU mesh, the bytes of every strategy's compiled step,
read from its HLO (benchmarks/_common's collective parser), against the model,
to the byte: on a CNN+MLP, and on a model whose heads may sit out a pass
(`helpers.BranchHeads`: a `nn.cond` between them).
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd
from kfac_jax_dist.kfac import config as kfac_config
from kfac_jax_dist.kfac import cost

import helpers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "benchmarks"))
import _common as C  # noqa: E402  pylint: disable=wrong-import-position
import layout_balance  # noqa: E402  pylint: disable=wrong-import-position
import stale_statistics  # noqa: E402  pylint: disable=wrong-import-position


FE, IE = 10, 100
F32 = 4


def mesh8():
  return helpers.data_mesh(8)


def strategies(p: int):
  for m in (d for d in range(1, p + 1) if p % d == 0):
    for fr in ("reduce_scatter", "all_reduce"):
      for gr in ("none", "reduce_scatter"):
        yield m, fr, gr


def state_bytes_per_device(state, p: int) -> int:
  """The K-FAC state per device (all but its four scalar counters: running
  factors, second-order state, stale statistics' and EK-FAC's arrays, the
  running weights of the layers that may sit out a pass), from the abstract
  state's shapes and its partition specs."""
  specs = state.partition_specs()
  is_spec = lambda s: isinstance(s, P)
  total = 0
  for field in ("factors", "second_order", "refresh", "correction", "marked_weight"):
    leaves = jax.tree_util.tree_leaves(getattr(state, field))
    for leaf, spec in zip(leaves, jax.tree_util.tree_leaves(getattr(specs, field),
                                                            is_leaf=is_spec)):
      n = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
      total += n // p if spec != P() else n
  return total


# Options whose state and traffic differ from plain K-FAC's; with stale
# statistics the cadence the choice amortises over is the mean refresh
# interval of a factor (20 steps) and of any factor (2 steps).
OPTIONS = {"plain": {}, "ekfac": {"eigenvalue_correction": "ekfac"},
           "stale": {"stale_threshold": 0.1},
           "stale_ekfac": {"stale_threshold": 0.1, "eigenvalue_correction": "ekfac"},
           "bf16_factors": {"factor_dtype": jnp.bfloat16},
           "bf16_second_ekfac": {"second_order_dtype": jnp.bfloat16,
                                 "eigenvalue_correction": "ekfac"},
           "inverse": {"method": "inverse"}, "stale_inverse": {"stale_threshold": 0.1,
                                                               "method": "inverse"}}


# 16-bit factors with the options that add collectives (the cost model's
# terms only: their state is bf16_factors' and the options').
TRAFFIC_OPTIONS = {**OPTIONS,
                   "bf16_ekfac": {"factor_dtype": jnp.bfloat16, "eigenvalue_correction": "ekfac"},
                   "bf16_stale": {"factor_dtype": jnp.bfloat16, "stale_threshold": 0.1}}


def cadence(options):
  return (20, 2) if "stale_threshold" in options else (FE, IE)


def strategy_config(mesh, m, fr, gr, options):
  dist = kd.Distribution(mesh, "data", grad_worker_fraction=m / mesh.shape["data"],
                         factor_reduction=fr, gradient_reduction=gr)
  every = (1, 1) if "stale_threshold" in options else (FE, IE)
  return kfac_config.KfacConfig(distribution=dist, factor_update_every=every[0],
                                inverse_update_every=every[1], **options)


def exhaustive(layers, params, mesh, budget=None, options=None):
  """(bytes, state, -m, m, fr, gr) of every strategy, from the transform: its
  layout and state from `init` with that `Distribution` (the abstract state's
  bytes per device), its bytes from the cost model. With stale statistics the
  two factor reductions run the same program (each refreshed factor
  all-reduced): one of them, as auto."""
  options = options or {}
  rows = []
  for m, fr, gr in strategies(mesh.shape["data"]):
    if "stale_threshold" in options and fr == "all_reduce":
      continue
    config = strategy_config(mesh, m, fr, gr, options)
    tx = kd.scale_by_kfac(layers=layers, distribution=config.distribution,
                          factor_update_every=config.factor_update_every,
                          inverse_update_every=config.inverse_update_every, **options)
    state = jax.eval_shape(tx.init, params)
    amortised = cost.kfac_step_bytes(config, state.layout).amortised(*cadence(options))
    memory = state_bytes_per_device(state, 8)
    if budget is None or memory <= budget:
      rows.append((round(amortised, 3), memory, -m, m, fr, gr))
  return sorted(rows)


@pytest.mark.parametrize("model, option", [
    ("resnet50", "plain"), ("resnet50", "ekfac"), ("resnet50", "stale"),
    *[pytest.param(m, o, marks=pytest.mark.slow) for m, o in (
        ("resnet50", "stale_ekfac"), ("bert_large", "plain"), ("gpt2_xl", "plain"),
        ("bert_large", "ekfac"), ("gpt2_xl", "stale"))]])
def test_auto_is_the_exhaustive_minimum_on_large_model_shapes(model, option):
  layers, _, params = layout_balance.discover(model)
  mesh = mesh8()
  options = OPTIONS[option]
  rows = exhaustive(layers, params, mesh, options=options)
  assert len(rows) == (8 if "stale_threshold" in options else 16)
  for budget in (None, sorted(r[1] for r in rows)[3]):   # then: only 4 or so fit
    want = [r for r in rows if budget is None or r[1] <= budget]   # exhaustive's filter
    fe, ie = cadence(options)
    dist = kd.Distribution.auto(mesh, "data", layers, memory_budget=budget,
                                factor_update_every=fe, inverse_update_every=ie, **options)
    got = (dist.group_size, dist.factor_reduction, dist.gradient_reduction)
    assert got == want[0][3:], (model, budget, got, want[:3])
    if budget is not None:
      assert want[0][1] <= budget and len(want) < len(rows)
    # the explanation names the choice and the runner-up with their numbers
    text = "\n".join(dist.explanation)
    assert "runner-up" in text and cost._mb(want[0][1]) in text


def described_bytes(opt_state) -> int:
  """The K-FAC state's bytes per device that `kd.describe` reports."""
  return int(re.search(r"K-FAC state: ([\d,]+) bytes per device", kd.describe(
      opt_state, print_table=False)).group(1).replace(",", ""))


def held_on_device0(state) -> int:
  """The bytes of every leaf of a (placed) state that device 0 holds."""
  device0 = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(state)
             for shard in leaf.addressable_shards if shard.device == device0)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_describe_counts_every_leaf_of_the_state_on_one_device(option):
  """On one device `kd.describe`'s bytes are the sum of the state's leaves'
  nbytes: the arrays and the scalar counters (count, factor_weight,
  update_factors, skipped, and stale statistics' and EK-FAC's)."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  state = kd.scale_by_kfac(layers, **OPTIONS[option]).init(params)
  assert described_bytes(state) == sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(
      state))


# DP-KFAC: each owner its own factors (and its own running weights of the
# layers that may sit out a pass).
DP_KFAC = (1, "local", "none")
STATE_PROBLEMS = {"conv_dense": helpers.conv_dense_problem,
                  "branch_heads": helpers.branch_heads_problem}


@pytest.mark.parametrize("problem", list(STATE_PROBLEMS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_state_bytes_of_every_option_equal_the_state_init_builds(option, problem):
  """`cost.kfac_state_bytes` equals the abstract state's bytes per device for
  every strategy and DP-KFAC (`init`'s own arrays and partition specs, the
  scalar counters aside; with heads that may sit out a pass, their running
  weights), and `kd.describe` reports the bytes of every leaf that device 0
  holds once the state is placed; EK-FAC under MEM-OPT holds every owner's
  eigenbases on every device, more than COMM-OPT's state."""
  loss_fn, params, x, y = STATE_PROBLEMS[problem]()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  assert any(layer.may_sit_out for layer in layers) == (problem == "branch_heads")
  mesh = mesh8()
  options = OPTIONS[option]
  found = {}
  # stale statistics with DP-KFAC and layers that may sit out: refused at init
  dp_kfac = [] if "stale_threshold" in options and problem == "branch_heads" else [DP_KFAC]
  for m, fr, gr in [*strategies(8), *dp_kfac]:
    config = strategy_config(mesh, m, fr, gr, options)
    state = kd.scale_by_kfac(layers, distribution=config.distribution,
                             factor_update_every=config.factor_update_every,
                             inverse_update_every=config.inverse_update_every,
                             **options).init(params)
    found[m, fr, gr] = state_bytes_per_device(state, 8)
    assert cost.kfac_state_bytes(config, state.layout) == found[m, fr, gr], (m, fr, gr)
    assert described_bytes(state) == held_on_device0(kd.shard_state(state, mesh))
  mem, comm = found[1, "reduce_scatter", "none"], found[8, "reduce_scatter", "none"]
  assert (mem > comm) == ("eigenvalue_correction" in options)


def test_auto_state_bytes_and_errors():
  loss_fn, params, x, y = C.problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  mesh = mesh8()
  rows = exhaustive(layers, params, mesh)
  smallest = min(r[1] for r in rows)
  with pytest.raises(ValueError, match=r"memory_budget=.*below the smallest K-FAC state"):
    kd.Distribution.auto(mesh, "data", layers, memory_budget=smallest - 1)
  with pytest.raises(ValueError, match="inverse_update_every must be a positive int"):
    kd.Distribution.auto(mesh, "data", layers, inverse_update_every=0)
  for budget in ("1e9", float("nan"), True, -1.0):    # a raw comparison error, or "below"
    with pytest.raises(ValueError, match="memory_budget must be None or a positive number"):
      kd.Distribution.auto(mesh, "data", layers, memory_budget=budget)
  numpy_cadence = kd.Distribution.auto(mesh, "data", layers,      # as kd.kfac takes it
                                       factor_update_every=np.int64(10))
  assert numpy_cadence == kd.Distribution.auto(mesh, "data", layers)
  with pytest.raises(TypeError, match="layers must be grad_fn.discover"):
    kd.Distribution.auto(mesh, "data", params)
  with pytest.raises(TypeError, match="unknown argument.*storage.*stale_threshold"):
    kd.Distribution.auto(mesh, "data", layers, storage="owner")
  with pytest.raises(ValueError, match="with stale_threshold.*inverse_update_every <= "):
    kd.Distribution.auto(mesh, "data", layers, stale_threshold=0.1)   # 100 > 10
  with pytest.raises(ValueError, match="needs method=.eigen"):
    kd.Distribution.auto(mesh, "data", layers, method="inverse",
                         eigenvalue_correction="ekfac")
  kept = kd.Distribution.auto(mesh, "data", layers, symmetric_comm=False,
                              comm_dtype=jnp.float32)
  assert not kept.symmetric_comm and kept.comm_dtype == jnp.float32
  dist = kd.Distribution.auto(mesh, "data", layers, memory_budget=smallest)
  assert dist.group_size == 1                    # only MEM-OPT's state is that small
  # the state of the chosen strategy is what the model said, and describe says why
  tx = kd.kfac(0.1, layers=layers, distribution=dist, factor_update_every=FE,
               inverse_update_every=IE)
  state = C.kfac_state(tx.init(params))
  assert state_bytes_per_device(state, 8) == cost.state_bytes(state.layout) == smallest
  assert "Distribution.auto chose" in kd.describe(tx.init(params), print_table=False)



def test_state_past_int32_offsets_is_refused_and_auto_leaves_it_out(monkeypatch):
  """One device's running factors and second-order segment are flat arrays
  with int32 offsets (GPT-2-XL's eigenbases on 2 devices: 2.6e9 numbers): as
  if int32 ended inside the range of this model's strategies, `init` of a
  strategy past it raises naming what to change, `Distribution.auto` picks
  the cheapest of the others (the exhaustive search's; on ResNet-50's shapes
  not the cheapest of all, MEM-OPT's wider segments), and with every strategy
  past it, auto raises the same error."""
  from kfac_jax_dist.core import offsets  # pylint: disable=import-outside-toplevel
  layers, _, params = layout_balance.discover("resnet50")
  mesh = mesh8()
  widest = {}
  for m, fr, gr in strategies(8):
    dist = kd.Distribution(mesh, "data", grad_worker_fraction=m / 8, factor_reduction=fr,
                           gradient_reduction=gr)
    lay = jax.eval_shape(kd.scale_by_kfac(layers=layers, distribution=dist,
                                          factor_update_every=FE,
                                          inverse_update_every=IE).init, params).layout
    widest[m, fr, gr] = max(lay.segment, lay.factor_shard, lay.second_segment)
  limit = sorted(set(widest.values()))[-2]        # the widest strategies pass it
  everything = exhaustive(layers, params, mesh)
  rows = [r for r in everything if widest[r[3:]] <= limit]
  assert 0 < len(rows) < 16 and rows[0] != everything[0]   # the cheapest is left out
  monkeypatch.setattr(offsets, "INT32_MAX", limit)
  m, fr, gr = max(widest, key=widest.get)
  with pytest.raises(ValueError, match=r"second-order state .* holds .* int32 offsets reach .*grad_worker_fraction"):
    kd.scale_by_kfac(layers=layers, distribution=kd.Distribution(
        mesh, "data", grad_worker_fraction=m / 8, factor_reduction=fr,
        gradient_reduction=gr)).init(params)
  dist = kd.Distribution.auto(mesh, "data", layers, factor_update_every=FE,
                              inverse_update_every=IE)
  assert (dist.group_size, dist.factor_reduction, dist.gradient_reduction) == rows[0][3:]
  monkeypatch.setattr(offsets, "INT32_MAX", min(widest.values()) - 1)
  with pytest.raises(ValueError, match=r"One device's .* numbers, more than int32"):
    kd.Distribution.auto(mesh, "data", layers)


def test_auto_refuses_a_factor_too_wide_for_any_strategy(monkeypatch):
  """A full factor wider than the packed triangles' int32 indices allow is
  refused by `init` under every strategy: `Distribution.auto` raises the
  same error (it priced and chose one, which `init` then refused)."""
  from kfac_jax_dist.capture import triangles  # pylint: disable=import-outside-toplevel
  loss_fn, params, x, y = helpers.funnel_problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  lay = jax.eval_shape(kd.scale_by_kfac(layers=layers).init, params).layout
  widest = max(place.dim for plan in lay.plans for _, place in plan.places)
  monkeypatch.setattr(triangles, "MAX_PACKED_DIM", widest - 1)
  refusal = rf"full {widest}×{widest} factor .* int32 indices, up to {widest - 1} wide"
  with pytest.raises(ValueError, match=refusal):
    kd.Distribution.auto(mesh8(), "data", layers)
  with pytest.raises(ValueError, match=refusal):
    jax.eval_shape(kd.scale_by_kfac(layers=layers).init, params)


def hlo_bytes(loss_fn, params, x, y, layers, mesh, m, fr, gr, options=None) -> dict:
  options = options or {}
  config = strategy_config(mesh, m, fr, gr, options)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = C.kfac_tx(grad_fn, layers, config.distribution, **options) if not (
      "stale_threshold" in options) else kd.kfac(
          0.1, layers=layers, distribution=config.distribution, damping=1e-2, **options)
  fn, state = C.sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, gr)
  text = fn.lower(params, state, x, y).compile().as_text()
  found, _ = C.collectives(text, 8)
  tot = C.totals(found)
  return ({k: C.step_bytes(tot, k) for k in ("plain", "factor", "inverse")}, state, config,
          text)


PROBLEMS = {"cnn_mlp": C.problem, "branch_heads": helpers.branch_heads_problem}
CANDIDATES = [(*strategy, "cnn_mlp") for strategy in strategies(8)] + [
    (*strategy, "branch_heads") for strategy in (*strategies(8), DP_KFAC)]
# Every group size and both reductions of each kind appear by default, here
# or in OPTION_CASES_BY_DEFAULT below (whose totals include these terms);
# the heads that may sit out a pass under the default strategy (COMM-OPT).
QUICK = [(4, "reduce_scatter", "reduce_scatter", "cnn_mlp"),
         (8, "reduce_scatter", "none", "cnn_mlp"), (8, "reduce_scatter", "none", "branch_heads")]
# The capture's psum of the global batch's number of examples (a float32
# scalar, every step; `value_and_grad`'s weights of unequal batches): the
# same under every strategy, left out of the model as the untagged
# parameters' all-reduce is.
EXAMPLES_PSUM = 2 * 7 / 8 * F32


def examples_psum(text: str) -> float:
  """`EXAMPLES_PSUM` where the compiled step sends it: jaxlib 0.12.1's XLA
  folds the psum of a count known when compiling (no mask) into a product."""
  found, _ = C.collectives(text, 8)
  sent = any(c.kind == "all-reduce" and c.step == "every" and c.payload == F32
             and c.op_name == "jit(step)/shard_map/psum_invariant" for c in found)
  return EXAMPLES_PSUM if sent else 0.0


def untagged_bytes(params, layers) -> float:
  """The untagged parameters' all-reduce (left out of the cost model); a
  stacked or grouped layer's blocks each count."""
  n_all = sum(v.size for v in jax.tree_util.tree_leaves(params))
  tagged = sum(l.a_dim * l.g_dim * int(np.prod(l.stack)) for l in layers)
  return 2 * 7 / 8 * (n_all - tagged) * F32


@pytest.mark.parametrize("m, fr, gr, problem", helpers.slow_unless(CANDIDATES, QUICK))
def test_cost_model_equals_the_compiled_hlo(m, fr, gr, problem):
  """`cost.step_bytes` against the compiled 8-device step, to the byte; with
  heads that may sit out a pass, their positions' psum on factor steps
  (none under DP-KFAC, whose owners count their own batches)."""
  loss_fn, params, x, y = PROBLEMS[problem]()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  mesh = mesh8()
  measured, state, _, text = hlo_bytes(loss_fn, params, x, y, layers, mesh, m, fr, gr)
  model = cost.step_bytes(C.kfac_state(state).layout, fr, gr)
  untagged = untagged_bytes(params, layers) + examples_psum(text)
  for kind in ("plain", "factor", "inverse"):
    assert abs(measured[kind] - (model.total(kind) + untagged)) < 1, (
        kind, measured, model)


# Four of the thirty-two cases by default (CI time: each compiles an 8-device
# step): both EK-FAC terms and stale statistics' under MEM-OPT, EK-FAC's under
# HYBRID, the inverses' gathers under COMM-OPT; and with heads that may sit
# out a pass, stale statistics' and EK-FAC's psums of their positions.
OPTION_CASES_BY_DEFAULT = [(1, "reduce_scatter", "reduce_scatter", "stale_ekfac", "cnn_mlp"),
                           (4, "all_reduce", "none", "ekfac", "cnn_mlp"),
                           (8, "reduce_scatter", "none", "inverse", "cnn_mlp"),
                           (1, "reduce_scatter", "reduce_scatter", "stale_ekfac",
                            "branch_heads"),
                           (4, "all_reduce", "none", "bf16_factors", "cnn_mlp")]


@pytest.mark.parametrize("m, fr, gr, option, problem", helpers.slow_unless(
    [(*strategy, option, problem) for problem in PROBLEMS for strategy in (
        (1, "reduce_scatter", "reduce_scatter"), (4, "all_reduce", "none"),
        (8, "reduce_scatter", "none"))
     for option in ("ekfac", "stale", "stale_ekfac", "inverse", "stale_inverse")]
    + [(*DP_KFAC, "ekfac", "branch_heads")]
    # 16-bit factors' own collectives (the chunks' all-gather, 1/P-sharded
    # storage) are asked for in bfloat16 but compiled in float32 by XLA:CPU:
    # where their statistics are averaged in the compute dtype, all-reduced.
    + [(4, "all_reduce", "none", option, "cnn_mlp")
       for option in ("bf16_factors", "bf16_ekfac", "bf16_stale")],
    OPTION_CASES_BY_DEFAULT))
def test_cost_model_of_options_equals_the_compiled_hlo(m, fr, gr, option, problem):
  """EK-FAC's `S` all-reduce and eigenbases gather, stale statistics' refresh
  decisions and per-factor all-reduces, method="inverse"'s gathers of the
  traces and failure flags, bfloat16 factors' statistics (averaged in float32,
  the compute dtype, before they are stored in 16 bits), and with heads that may sit out a pass the psums
  of their positions (stale statistics' every step, EK-FAC's on factor steps,
  under DP-KFAC too): `cost.kfac_step_bytes` against the compiled
  8-device step, to the byte. The parser counts a loop's body once; with stale
  statistics each refreshed factor's all-reduce sits in its layer's loop
  over due blocks (one block each here), so the whole program (the parser's
  "inverse" total, a step where every factor is due) is every term of the
  model; its "plain" total is what runs on a step with nothing due, and the
  loop bodies' all-reduces are the model's per-factor term."""
  loss_fn, params, x, y = PROBLEMS[problem]()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  options = TRAFFIC_OPTIONS[option]
  measured, state, config, text = hlo_bytes(loss_fn, params, x, y, layers, mesh8(), m, fr,
                                            gr, options)
  model = cost.kfac_step_bytes(config, C.kfac_state(state).layout)
  untagged = untagged_bytes(params, layers) + examples_psum(text)
  for kind in ("plain", "inverse") if "stale_threshold" in options else (
      "plain", "factor", "inverse"):
    assert abs(measured[kind] - (model.total(kind) + untagged)) < 1, (
        kind, measured, model)
  if "stale_threshold" in options:
    loops = stale_statistics.factor_collectives(text)["factor_scope_loops"]
    assert all(len(loop["body"]) == 1 for loop in loops)
    refreshed = 2 * 7 / 8 * sum(b for loop in loops for b in loop["body"])
    assert dict(model.factor)["refreshed factors' all-reduces 2(P-1)/P·T"] == refreshed
