"""Scanned / stacked layers: each block gets its own factors, exactly as unrolled.

The oracle is the same model unrolled, with each block's weights a slice of the
stacked ones: its statistics (checked against brute force in test_capture),
gradients and K-FAC trajectory. Routes: linen `nn.scan`, NNX `nnx.vmap` +
`nnx.scan`, plain JAX `lax.scan` with `stack_index=`, and the errors for the
stacking that is not supported.
"""

from __future__ import annotations

import functools
import re
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist.kfac import stale
from kfac_jax_dist.kfac.state import find_states
from helpers import compile_step

L, D, C, B = 3, 4, 3, 8
F64 = jnp.float64


@pytest.fixture(autouse=True, scope="module")
def _enable_x64():
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


def _batch():
  x = jax.random.normal(jax.random.PRNGKey(0), (B, D), F64)
  y = jax.random.randint(jax.random.PRNGKey(1), (B,), 0, C)
  return x, y


def _perturbed(params, seed=3):
  """Non-trivial LayerNorm scales/biases (Flax initialises them to 1 and 0)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      x + 0.3 * jax.random.normal(k, jnp.shape(x), F64) for x, k in zip(leaves, keys)])


def _assert_close(a, b, rtol):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                             rtol=rtol, atol=rtol * 1e-2)


def _train(loss_fn, params, batch, steps=4):
  """A few kd.kfac steps (factor and decomposition updates included)."""
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, *batch), damping=0.1,
               inverse_update_every=2, factor_dtype=F64)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params, state


def _check_stacked_stats(stacked, unrolled, pairs):
  """`pairs`: (stacked layer name, unrolled name of block i as a function of i)."""
  for name, block_name in pairs:
    for key, value in stacked[name].items():
      assert value.shape[0] == L, (name, key, value.shape)
      for i in range(L):
        _assert_close(value[i], unrolled[block_name(i)][key], 1e-10)


# ---------------------------------------------------------------------------
# linen: nn.scan
# ---------------------------------------------------------------------------

class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    h = kd.linen.Dense(D, param_dtype=F64)(x)
    return kd.linen.LayerNorm(param_dtype=F64)(jnp.tanh(h)), None


class LinenScanned(nn.Module):
  variable_axes: int = 0

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(LinenBlock, variable_axes={"params": self.variable_axes},
                     split_rngs={"params": True}, length=L)
    x, _ = blocks(name="blocks")(x, None)
    return kd.linen.Dense(C, param_dtype=F64)(x)


class LinenUnrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(L):
      x, _ = LinenBlock(name=f"block_{i}")(x)
    return kd.linen.Dense(C, param_dtype=F64)(x)


def _linen_problem():
  x, y = _batch()
  stacked = _perturbed(LinenScanned().init(jax.random.PRNGKey(2), x)["params"])
  unrolled = {f"block_{i}": jax.tree.map(lambda a, i=i: a[i], stacked["blocks"])
              for i in range(L)}
  unrolled["Dense_0"] = stacked["Dense_0"]

  def loss_scanned(p, x, y):
    return kd.losses.softmax_cross_entropy(LinenScanned().apply({"params": p}, x), y)

  def loss_unrolled(p, x, y):
    return kd.losses.softmax_cross_entropy(LinenUnrolled().apply({"params": p}, x), y)
  return (loss_scanned, stacked), (loss_unrolled, unrolled), (x, y)


def test_linen_scan_matches_unrolled():
  (loss_s, params_s), (loss_u, params_u), batch = _linen_problem()
  layers = kd.value_and_grad(loss_s).discover(params_s, *batch)
  by_name = {layer.name: layer for layer in layers}
  assert set(by_name) == {"blocks/Dense_0", "blocks/LayerNorm_0", "Dense_0"}
  dense = by_name["blocks/Dense_0"]
  assert (dense.stack, dense.kernel_path, dense.kernel_shape) == (
      (L,), "blocks/Dense_0/kernel", (D, D))
  assert [b.name for b in dense.blocks()] == [f"blocks/Dense_0/{i}" for i in range(L)]
  assert by_name["blocks/LayerNorm_0"].stack == (L,)
  assert by_name["Dense_0"].stack == ()

  (loss, grads, stats) = jax.jit(kd.value_and_grad(loss_s))(params_s, *batch)
  (ref_loss, ref_grads, ref_stats) = jax.jit(kd.value_and_grad(loss_u))(params_u, *batch)
  _assert_close(loss, ref_loss, 1e-12)
  # The user's gradients: the parameters' structure, no probes.
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params_s)
  for i in range(L):
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), grads["blocks"],
                 ref_grads[f"block_{i}"])
  _check_stacked_stats(stats, ref_stats, [
      ("blocks/Dense_0", lambda i: f"block_{i}/Dense_0"),
      ("blocks/LayerNorm_0", lambda i: f"block_{i}/LayerNorm_0")])
  _assert_close(stats["Dense_0"]["A"], ref_stats["Dense_0"]["A"], 1e-10)

  got, state = _train(loss_s, params_s, batch)
  want, _ = _train(loss_u, params_u, batch)
  for i in range(L):      # float64 throughout, compiled differently
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), got["blocks"],
                 want[f"block_{i}"])
  _assert_close(got["Dense_0"]["kernel"], want["Dense_0"]["kernel"], 1e-10)
  kstate = find_states(state)[0]
  assert len(kstate.layout.plans) == 2 * L + 1 and not kstate.layout.passthrough
  table = kd.describe(kstate, print_table=False)
  assert "blocks/Dense_0/2" in table and "blocks/Dense_0/kernel[2]" in table
  running = kd.running_factors(kstate)
  assert running["blocks/Dense_0/1"]["A"].shape == (D + 1, D + 1)


class GroupedBlock(nn.Module):
  """A grouped convolution (2 groups of 2 channels) as a scanned block."""

  @nn.compact
  def __call__(self, x, _=None):
    return jnp.tanh(kd.linen.Conv(4, (3, 3), feature_group_count=2, param_dtype=F64)(x)), None


class GroupedNet(nn.Module):
  scanned: bool

  @nn.compact
  def __call__(self, x):
    if self.scanned:
      x, _ = nn.scan(GroupedBlock, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=L)(name="blocks")(x, None)
    else:
      for i in range(L):
        x, _ = GroupedBlock(name=f"block_{i}")(x)
    return kd.linen.Dense(C, param_dtype=F64)(x.mean((1, 2)))


def test_linen_scan_of_a_grouped_conv_matches_unrolled():
  """`nn.scan` over blocks with a grouped convolution: its stack is `(L,
  groups)`, every block's every group a block of its own, and the K-FAC
  trajectory is the unrolled model's."""
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 5, 5, 4), F64)
  y = jax.random.randint(jax.random.PRNGKey(1), (B,), 0, C)
  stacked = _perturbed(GroupedNet(True).init(jax.random.PRNGKey(2), x)["params"])
  unrolled = {f"block_{i}": jax.tree.map(lambda a, i=i: a[i], stacked["blocks"])
              for i in range(L)} | {"Dense_0": stacked["Dense_0"]}
  loss = lambda scanned: (lambda p, x, y: kd.losses.softmax_cross_entropy(
      GroupedNet(scanned).apply({"params": p}, x), y))
  conv = kd.value_and_grad(loss(True)).discover(stacked, x, y).layers[0]
  assert conv.stack == (L, 2) and conv.kernel_shape == (3, 3, 2, 2)
  assert conv.blocks()[3].name == "blocks/Conv_0/1/1"
  got, _ = _train(loss(True), stacked, (x, y))
  want, _ = _train(loss(False), unrolled, (x, y))
  for i in range(L):
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), got["blocks"],
                 want[f"block_{i}"])


def _train_stale(loss_fn, params, batch, dist=None, steps=8, method="eigen"):
  """kd.kfac with stale statistics (SP-NGD §4.3), float64: the parameters and
  each factor's refreshes by (layer, factor), an unrolled block's layer named
  as the stack's block (`block_1/Dense_0` → `blocks/Dense_0/1`)."""
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, *batch), damping=1e-2, kl_clip=1e-2,
               stale_threshold=0.3, factor_dtype=F64, distribution=dist, method=method)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    if dist is not None:
      grads = lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state
  step, state = compile_step(step, tx.init(params), dist, 2)
  for _ in range(steps):
    params, state = step(params, state, *batch)
  kstate = find_states(state)[0]
  refreshes = np.asarray(kstate.refresh.refreshes)
  renamed = lambda name: re.sub(r"^block_(\d+)/(.*)$", r"blocks/\2/\1", name)
  return params, {(renamed(plan.layer.name), which): int(refreshes[f])
                  for f, (plan, which, _) in enumerate(stale.factor_order(kstate.layout))}


@pytest.mark.parametrize("strategy,method", [
    pytest.param(None, "eigen", marks=pytest.mark.slow), ("MEM-OPT", "eigen"),
    pytest.param("COMM-OPT", "eigen", marks=pytest.mark.slow),
    pytest.param(None, "inverse", marks=pytest.mark.slow),
    pytest.param("MEM-OPT", "inverse", marks=pytest.mark.slow)])
def test_stale_statistics_scanned_equal_unrolled(strategy, method):
  """Stale statistics on a scan: each block's factors keep their own schedule
  (a loop over a stack's due blocks communicates them; owners and
  decompositions read the due flags by factor number; with inverses, a
  block's two factors are inverted together), as the unrolled model's
  layers, one run each, on one device (float64). Misnumbering a stack's or a
  batch's factors refreshes the wrong blocks."""
  (loss_s, params_s), (loss_u, params_u), (x, y) = _linen_problem()
  x, y = jnp.tile(x, (4, 1)) * jnp.repeat(jnp.linspace(0.5, 1.5, 4), B)[:, None], \
      jnp.tile(y, 4)                                  # 32 examples: 4 per device
  dist = None if strategy is None else kd.Distribution(
      helpers.data_mesh(8), grad_worker_fraction=1.0 if strategy == "COMM-OPT" else 0.125,
      factor_reduction="all_reduce" if strategy == "COMM-OPT" else "reduce_scatter")
  got, got_refreshes = _train_stale(loss_s, params_s, (x, y), dist, method=method)
  want, want_refreshes = _train_stale(loss_u, params_u, (x, y), method=method)
  assert got_refreshes == want_refreshes
  assert len(set(want_refreshes.values())) > 2           # schedules differ by factor
  assert len({want_refreshes[(f"blocks/Dense_0/{i}", "g")] for i in range(L)}) > 1
  for i in range(L):
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-9), got["blocks"],
                 want[f"block_{i}"])
  _assert_close(got["Dense_0"]["kernel"], want["Dense_0"]["kernel"], 1e-9)


def test_batched_preconditioning_of_a_stack_equals_layer_at_a_time(monkeypatch):
  """The blocks of a scanned layer are preconditioned as one run (on every
  platform, `precondition.precondition`), the LayerNorm's unit-wise blocks
  too, and train as one block at a time (forced) does."""
  from kfac_jax_dist.kfac import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import precondition  # pylint: disable=import-outside-toplevel
  (loss_s, params_s), _, batch = _linen_problem()
  got, state = _train(loss_s, params_s, batch)
  monkeypatch.setattr(precondition, "BATCH_RUNS", False)
  want, _ = _train(loss_s, params_s, batch)
  lay = find_states(state)[0].layout
  for across_layers in (True, False):
    runs = layout_lib.precondition_runs(lay, 0, across_layers)
    assert [run[0].layer.name for run in runs if len(run) > 1] == [
        "blocks/Dense_0/0", "blocks/LayerNorm_0/0"]
    assert max(len(run) for run in runs) == L
  jax.tree.map(lambda a, b: _assert_close(a, b, 1e-10), got, want)


def test_linen_scan_skip_and_sparse_statistics():
  """`skip` takes a stacked layer's blocks together; diagonal factors stack too."""
  (loss_s, params_s), _, batch = _linen_problem()
  grad_fn = kd.value_and_grad(loss_s)
  layers = grad_fn.discover(params_s, *batch)
  tx = kd.scale_by_kfac(layers, skip=["LayerNorm"], max_factor_dim=4)
  state = tx.init(params_s)
  assert state.layout.skipped == ("blocks/LayerNorm_0",)
  _, grads, stats = jax.jit(grad_fn)(params_s, *batch, opt_state=state)
  assert "blocks/LayerNorm_0" not in stats
  assert stats["blocks/Dense_0"]["A"].shape == (L, D + 1)      # diagonal: 5 > 4
  assert stats["blocks/Dense_0"]["G"].shape == (L, D * (D + 1) // 2)   # full, packed
  updates, _ = jax.jit(tx.update)(grads, state, params_s, kfac_stats=stats)
  _assert_close(updates["blocks"]["LayerNorm_0"]["scale"],
                grads["blocks"]["LayerNorm_0"]["scale"], 1e-12)


# ---------------------------------------------------------------------------
# NNX: nnx.vmap-created blocks applied with nnx.scan
# ---------------------------------------------------------------------------

class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin = kd.nnx.Linear(D, D, param_dtype=F64, rngs=rngs)
    self.ln = kd.nnx.LayerNorm(D, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.ln(jnp.tanh(self.lin(x)))


class NnxScanned(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NnxBlock(rngs)

    self.blocks = create(rngs)
    self.out = kd.nnx.Linear(D, C, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.out(body(x, self.blocks))


class NnxUnrolled(nnx.Module):
  def __init__(self, rngs):
    for i in range(L):
      setattr(self, f"block_{i}", NnxBlock(rngs))
    self.out = kd.nnx.Linear(D, C, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    for i in range(L):
      x = getattr(self, f"block_{i}")(x)
    return self.out(x)


def test_nnx_scan_matches_unrolled():
  x, y = _batch()
  graph_s, params_s = nnx.split(NnxScanned(nnx.Rngs(0)), nnx.Param)
  graph_u, params_u = nnx.split(NnxUnrolled(nnx.Rngs(1)), nnx.Param)
  pure = _perturbed(nnx.to_pure_dict(params_s))
  nnx.replace_by_pure_dict(params_s, pure)
  pure_u = {f"block_{i}": jax.tree.map(lambda a, i=i: a[i], pure["blocks"])
            for i in range(L)}
  pure_u["out"] = pure["out"]
  nnx.replace_by_pure_dict(params_u, pure_u)

  def loss_s(p, x, y):
    return kd.losses.softmax_cross_entropy(nnx.merge(graph_s, p)(x), y)

  def loss_u(p, x, y):
    return kd.losses.softmax_cross_entropy(nnx.merge(graph_u, p)(x), y)

  layers = {l.name: l for l in kd.value_and_grad(loss_s).discover(params_s, x, y)}
  assert set(layers) == {"blocks/lin", "blocks/ln", "out"}
  assert layers["blocks/lin"].stack == (L,) and layers["blocks/ln"].stack == (L,)
  assert layers["blocks/lin"].kernel_shape == (D, D)

  loss, grads, stats = jax.jit(kd.value_and_grad(loss_s))(params_s, x, y)
  ref_loss, ref_grads, ref_stats = jax.jit(kd.value_and_grad(loss_u))(params_u, x, y)
  _assert_close(loss, ref_loss, 1e-12)
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params_s)
  grads, ref_grads = nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads)
  for i in range(L):
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), grads["blocks"],
                 ref_grads[f"block_{i}"])
  _check_stacked_stats(stats, ref_stats, [("blocks/lin", lambda i: f"block_{i}/lin"),
                                          ("blocks/ln", lambda i: f"block_{i}/ln")])

  got, _ = _train(loss_s, params_s, (x, y))
  want, _ = _train(loss_u, params_u, (x, y))
  got, want = nnx.to_pure_dict(got), nnx.to_pure_dict(want)
  for i in range(L):
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), got["blocks"],
                 want[f"block_{i}"])


# ---------------------------------------------------------------------------
# Ensembles: nn.vmap / nnx.vmap over stacked members (same input for each)
# ---------------------------------------------------------------------------

class LinenEnsemble(nn.Module):
  @nn.compact
  def __call__(self, x):
    members = nn.vmap(kd.linen.Dense, variable_axes={"params": 0},
                      split_rngs={"params": True}, in_axes=None, axis_size=L)
    h = jnp.tanh(members(D, param_dtype=F64, name="members")(x))      # [L, B, D]
    return kd.linen.Dense(C, param_dtype=F64, name="out")(h.sum(0))


class NnxEnsemble(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return kd.nnx.Linear(D, D, param_dtype=F64, rngs=rngs)

    self.members = create(rngs)
    self.out = kd.nnx.Linear(D, C, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.vmap(in_axes=(0, None), out_axes=0)
    def run(member, x):
      return jnp.tanh(member(x))

    return self.out(run(self.members, x).sum(0))


def _ensemble_unrolled(p, x, y):
  h = sum(jnp.tanh(kd.tags.dense(x, p[f"m{i}"]["kernel"], p[f"m{i}"]["bias"]))
          for i in range(L))
  logits = kd.tags.dense(h, p["out"]["kernel"], p["out"]["bias"])
  return kd.losses.softmax_cross_entropy(logits, y)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_vmapped_ensemble_matches_unrolled(api):
  x, y = _batch()
  if api == "linen":
    params = LinenEnsemble().init(jax.random.PRNGKey(2), x)["params"]
    pure = params

    def loss_fn(p, x, y):
      return kd.losses.softmax_cross_entropy(LinenEnsemble().apply({"params": p}, x), y)
  else:
    graph, params = nnx.split(NnxEnsemble(nnx.Rngs(0)), nnx.Param)
    pure = nnx.to_pure_dict(params)

    def loss_fn(p, x, y):
      return kd.losses.softmax_cross_entropy(nnx.merge(graph, p)(x), y)
  unrolled = {f"m{i}": jax.tree.map(lambda a, i=i: a[i], pure["members"])
              for i in range(L)}
  unrolled["out"] = pure["out"]
  layers = {l.name: l.stack for l in kd.value_and_grad(loss_fn).discover(params, x, y)}
  assert layers == {"members": (L,), "out": ()}
  _, _, stats = jax.jit(kd.value_and_grad(loss_fn))(params, x, y)
  _, _, ref = jax.jit(kd.value_and_grad(_ensemble_unrolled))(unrolled, x, y)
  _check_stacked_stats(stats, ref, [("members", lambda i: f"m{i}")])


# ---------------------------------------------------------------------------
# Plain JAX: lax.scan over stacked weights with stack_index=
# ---------------------------------------------------------------------------

def _plain_params():
  keys = jax.random.split(jax.random.PRNGKey(4), 4)
  return {"blocks": {"dense": {"kernel": jax.random.normal(keys[0], (L, D, D), F64) / 2,
                               "bias": jax.random.normal(keys[1], (L, D), F64) / 4},
                     "norm": {"scale": 1 + jax.random.normal(keys[2], (L, D), F64) / 4}},
          "out": {"kernel": jax.random.normal(keys[3], (D, C), F64)}}


def _plain_block(p, h, i):
  h = jnp.tanh(kd.tags.dense(h, p["dense"]["kernel"], p["dense"]["bias"], stack_index=i))
  return kd.tags.scale_and_shift(h, p["norm"]["scale"], stack_index=i)


def _plain_loss(loop):
  def loss_fn(p, x, y):
    if loop == "scan":
      h, _ = lax.scan(lambda h, i: (_plain_block(p["blocks"], h, i), None), x,
                      jnp.arange(L))
    elif loop == "fori":
      h = lax.fori_loop(0, L, lambda i, h: _plain_block(p["blocks"], h, i), x)
    else:                                   # Python loop, concrete indices
      h = x
      for i in range(L):
        h = _plain_block(p["blocks"], h, i)
    logits = kd.tags.dense(h, p["out"]["kernel"])
    return kd.losses.softmax_cross_entropy(logits, y)
  return loss_fn


def _plain_unrolled(p, x, y):
  h = x
  for i in range(L):
    b = p[f"block_{i}"]
    h = jnp.tanh(kd.tags.dense(h, b["dense"]["kernel"], b["dense"]["bias"]))
    h = kd.tags.scale_and_shift(h, b["norm"]["scale"])
  return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["out"]["kernel"]), y)


@pytest.mark.parametrize("loop", ["scan", "fori", "python"])
def test_plain_stack_index_matches_unrolled(loop):
  x, y = _batch()
  params = _plain_params()
  unrolled = {f"block_{i}": jax.tree.map(lambda a, i=i: a[i], params["blocks"])
              for i in range(L)}
  unrolled["out"] = params["out"]
  grad_fn = kd.value_and_grad(_plain_loss(loop))
  layers = {l.name: l for l in grad_fn.discover(params, x, y)}
  assert set(layers) == {"blocks/dense", "blocks/norm", "out"}
  assert layers["blocks/dense"].stack == (L,) and layers["blocks/norm"].stack == (L,)
  assert layers["blocks/dense"].bias_path == "blocks/dense/bias"
  assert layers["blocks/dense"].kernel_shape == (D, D)

  loss, grads, stats = jax.jit(grad_fn)(params, x, y)
  ref_loss, ref_grads, ref_stats = jax.jit(kd.value_and_grad(_plain_unrolled))(
      unrolled, x, y)
  _assert_close(loss, ref_loss, 1e-12)
  _check_stacked_stats(stats, ref_stats, [
      ("blocks/dense", lambda i: f"block_{i}/dense"),
      ("blocks/norm", lambda i: f"block_{i}/norm")])
  for i in range(L):
    jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), grads["blocks"],
                 ref_grads[f"block_{i}"])

  if loop == "scan":
    got, _ = _train(_plain_loss(loop), params, (x, y))
    want, _ = _train(_plain_unrolled, unrolled, (x, y))
    for i in range(L):
      jax.tree.map(lambda a, b, i=i: _assert_close(a[i], b, 1e-10), got["blocks"],
                   want[f"block_{i}"])


# ---------------------------------------------------------------------------
# What is not supported raises, naming the layer.
# ---------------------------------------------------------------------------

def test_stack_axis_must_be_leading():
  x, y = _batch()
  model = LinenScanned(variable_axes=1)
  params = model.init(jax.random.PRNGKey(2), x)["params"]
  assert params["blocks"]["Dense_0"]["kernel"].shape == (D, L, D)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)
  with pytest.raises(ValueError, match="leading axes"):
    kd.value_and_grad(loss_fn).discover(params, x, y)


class _LinenSquareScan(nn.Module):
  """nn.scan over D blocks of Dense(D) (no bias), stacked along `axis`: the
  kernel leaf is [D, D, D] whichever the axis."""
  axis: int

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_SquareBlock, variable_axes={"params": self.axis},
                     split_rngs={"params": True}, length=D)
    x, _ = blocks(name="blocks")(x, None)
    return kd.linen.Dense(C, param_dtype=F64)(x)


class _SquareBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(kd.linen.Dense(D, use_bias=False, param_dtype=F64)(x)), None


class _NnxSquareEnsemble(nnx.Module):
  """D Linear(D, D) members made and run with nnx.vmap over `axis`."""

  def __init__(self, axis, rngs):
    self.axis = axis

    @nnx.split_rngs(splits=D)
    @nnx.vmap(in_axes=(0,), out_axes=axis)
    def create(rngs):
      return kd.nnx.Linear(D, D, use_bias=False, param_dtype=F64, rngs=rngs)
    self.members = create(rngs)
    self.out = kd.nnx.Linear(D, C, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    run = nnx.vmap(lambda member, x: jnp.tanh(member(x)), in_axes=(self.axis, None))
    return self.out(run(self.members, x).sum(0))


def _square_stack(api: str, axis: int):
  """(loss_fn, params) of a stack of D blocks whose kernels are [D, D]."""
  if api == "linen":
    model = _LinenSquareScan(axis)
    params = model.init(jax.random.PRNGKey(2), _batch()[0])["params"]
    return lambda p, x, y: kd.losses.softmax_cross_entropy(
        model.apply({"params": p}, x), y), params
  graphdef, params = nnx.split(_NnxSquareEnsemble(axis, nnx.Rngs(0)), nnx.Param)
  return lambda p, x, y: kd.losses.softmax_cross_entropy(
      nnx.merge(graphdef, p)(x), y), params


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_stack_axis_that_shapes_cannot_tell_raises_naming_the_layer(api):
  """A stack along axis 1 of length D over [D, D] kernels: the leaf is
  [D, D, D], which discovery reads as a leading stack. The capture raises,
  naming the layer and asking for a leading stack axis (flax and JAX failed
  to slice the probes with their own messages); along axis 0 it runs."""
  x, y = _batch()
  loss_fn, params = _square_stack(api, 1)
  name = "blocks/Dense_0" if api == "linen" else "members"
  kernel = (params["blocks"]["Dense_0"]["kernel"] if api == "linen"
            else params["members"]["kernel"][...])
  assert kernel.shape == (D, D, D)
  grad_fn = kd.value_and_grad(loss_fn)
  layer = next(l for l in grad_fn.discover(params, x, y) if l.name == name)
  assert layer.stack == (D,)                    # mistaken: the shapes allow it
  with pytest.raises(ValueError, match=f"Stacked layer '{name}': the model slices its "
                     r"parameters .* along an axis other than the leading 1.*Keep the "
                     "stack axis leading"):
    jax.jit(grad_fn)(params, x, y)
  loss_fn, params = _square_stack(api, 0)
  _, _, stats = jax.jit(kd.value_and_grad(loss_fn))(params, x, y)
  assert stats[name]["A"].shape == (D, D, D)


def test_linen_scan_with_broadcast_params_gets_expand_statistics():
  """nn.scan with `variable_broadcast="params"`: one block's weights shared by
  the L iterations. Its Dense layer's statistics are K-FAC-expand's over the
  L runs (flax's LayerNorm written out for the brute force)."""
  class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
      blocks = nn.scan(LinenBlock, variable_broadcast="params",
                       split_rngs={"params": False}, length=L)
      x, _ = blocks(name="blocks")(x, None)
      return kd.linen.Dense(C, param_dtype=F64)(x)

  x, y = _batch()
  params = Shared().init(jax.random.PRNGKey(2), x)["params"]

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(Shared().apply({"params": p}, x), y)
  grad_fn = kd.value_and_grad(loss_fn)
  names = [l.name for l in grad_fn.discover(params, x, y)]
  dense = next(n for n in names if n.startswith("blocks") and n.endswith("Dense_0"))
  _, _, stats = jax.jit(grad_fn)(params, x, y)
  p = params["blocks"]

  def unrolled(eps):
    h, inputs = x, []
    for r in range(L):
      inputs.append(h)
      t = jnp.tanh(h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"] + eps[r])
      mean = t.mean(-1, keepdims=True)
      var = (t * t).mean(-1, keepdims=True) - mean * mean
      h = ((t - mean) * lax.rsqrt(var + 1e-6) * p["LayerNorm_0"]["scale"]
           + p["LayerNorm_0"]["bias"])
    out = h @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    return kd.losses.softmax_cross_entropy(out, y), inputs
  want_a, want_g = _expand_oracle(unrolled, x, L)
  np.testing.assert_allclose(stats[dense]["A"], want_a, rtol=1e-10)
  np.testing.assert_allclose(stats[dense]["G"], want_g, rtol=1e-10)


def test_one_name_for_different_layers_raises():
  """Two different layers under one name (here two kernels) are not one
  shared layer: discovery raises."""
  params = {"w": jnp.zeros((D, D), F64), "v": jnp.zeros((D, C), F64)}
  x, y = _batch()

  def loss_fn(p, x, y):
    h = kd.tags.dense(x, p["w"], name="layer")
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["v"], name="layer"), y)
  with pytest.raises(ValueError, match="ran twice in one loss evaluation as different"):
    kd.value_and_grad(loss_fn).discover(params, x, y)

  def bias_once(p, x, y):    # one kernel, the bias only the first time: what differs
    h = kd.tags.dense(x, p["w"], p["b"], name="layer")
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["w"], name="layer") @ p["v"], y)
  with pytest.raises(ValueError, match="differ in bias_path 'b' then None"):
    kd.value_and_grad(bias_once).discover({**params, "b": jnp.zeros(D, F64)}, x, y)


def test_plain_scan_over_slices_needs_stack_index():
  x, y = _batch()
  params = _plain_params()

  def loss_fn(p, x, y):
    def body(h, w):
      return jnp.tanh(kd.tags.dense(h, w["kernel"], w["bias"])), None
    h, _ = lax.scan(body, x, p["blocks"]["dense"])
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["out"]["kernel"]), y)
  with pytest.raises(ValueError, match="stack_index"):
    kd.value_and_grad(loss_fn).discover(params, x, y)


def _expand_oracle(run, x, runs: int, bias: bool = True):
  """K-FAC-expand's statistics of a Dense layer (`[·, D]` outputs) that runs
  `runs` times, by float64 brute force: `run(eps) -> (loss, inputs)`
  evaluates the model unrolled with `eps[r]` added to run r's output and
  returns every run's input (`x`: one run's, `[B, ·]`). `A` = mean of `a aᵀ`
  over all runs' positions (`a` with the bias's 1), `G = n Σ_r g_rᵀ g_r` (n =
  B, the loss's examples)."""
  eps = jnp.zeros((runs,) + x.shape[:-1] + (D,), F64)
  g = jax.grad(lambda e: run(e)[0])(eps)
  a = jnp.concatenate([jnp.concatenate([h, jnp.ones((h.shape[0], 1), F64)], 1)
                       if bias else h for h in run(eps)[1]])
  return a.T @ a / a.shape[0], x.shape[0] * sum(g[r].T @ g[r] for r in range(runs))


@pytest.mark.parametrize("loop", ["scan", "python"])
def test_shared_kernel_gets_expand_statistics(loop):
  """One kernel applied R times in one pass (a plain `lax.scan` closing over
  it, or a Python loop: weight sharing) has K-FAC-expand's statistics
  (Eschenhagen et al. 2023), every run's positions counted as examples of
  the layer: `A` the mean of `a aᵀ` over all of them, `G = n Σ_r Σ_p g gᵀ`."""
  runs = 3
  k = jax.random.split(jax.random.PRNGKey(7), 4)
  params = {"w": jax.random.normal(k[0], (D, D), F64) / 2,
            "b": jax.random.normal(k[1], (D,), F64) / 4,
            "out": jax.random.normal(k[2], (D, C), F64)}
  x, y = _batch()

  def loss_fn(p, x, y):
    body = lambda h: jnp.tanh(kd.tags.dense(h, p["w"], p["b"]))
    if loop == "scan":
      h = lax.scan(lambda h, _: (body(h), None), x, None, length=runs)[0]
    else:
      h = x
      for _ in range(runs):
        h = body(h)
    return kd.losses.softmax_cross_entropy(h @ p["out"], y)
  grad_fn = kd.value_and_grad(loss_fn)
  assert [l.name for l in grad_fn.discover(params, x, y)] == ["w"]
  _, _, stats = jax.jit(grad_fn)(params, x, y)

  def unrolled(eps):
    h, inputs = x, []
    for r in range(runs):
      inputs.append(h)
      h = jnp.tanh(h @ params["w"] + params["b"] + eps[r])
    return kd.losses.softmax_cross_entropy(h @ params["out"], y), inputs
  want_a, want_g = _expand_oracle(unrolled, x, runs)
  np.testing.assert_allclose(stats["w"]["A"], want_a, rtol=1e-12)
  np.testing.assert_allclose(stats["w"]["G"], want_g, rtol=1e-12)


def _positions_oracle(inputs: list, cotangents: jax.Array, n: int):
  """A Dense layer's statistics over every position of every run, by float64
  brute force: `A` the mean of `[a, 1][a, 1]ᵀ` over the rows of all `inputs`
  (`[·, D]` each), `G = n Σ_p g_p g_pᵀ` over the cotangents `[·, C]` of all
  positions (n: the loss's examples)."""
  a = jnp.concatenate([jnp.concatenate([h, jnp.ones((h.shape[0], 1), F64)], 1)
                       for h in inputs])
  g = cotangents.reshape(-1, cotangents.shape[-1])
  return a.T @ a / a.shape[0], n * g.T @ g


@pytest.mark.parametrize("mapped", ["time", "examples"])
def test_shared_kernel_under_vmap_gets_expand_statistics(mapped):
  """A kernel shared by the lanes of a `jax.vmap` (a Dense applied to each
  time step, or a per-example model mapped over the batch) runs once per
  lane: every lane's positions are examples of the layer, `A` their mean
  (not `T` times it: the lanes' position counts are mapped like `A`)."""
  T = 5
  k = jax.random.split(jax.random.PRNGKey(8), 4)
  params = {"w": jax.random.normal(k[0], (D, C), F64), "b": jax.random.normal(k[1], (C,), F64)}
  x = jax.random.normal(k[2], (B, T, D), F64)
  y = jax.random.randint(k[3], (B, T), 0, C)
  axis = 1 if mapped == "time" else 0
  dense = lambda p, v, eps=0.0: kd.tags.dense(v, p["w"], p["b"], name="fc") + eps

  def loss_fn(p, x, y, eps=None):
    eps = jnp.zeros(x.shape[:-1] + (C,), F64) if eps is None else eps
    out = jax.vmap(functools.partial(dense, p), in_axes=axis, out_axes=axis)(x, eps)
    return kd.losses.softmax_cross_entropy(out, y)
  grad_fn = kd.value_and_grad(loss_fn)
  _, grads, stats = jax.jit(grad_fn)(params, x, y)
  helpers.assert_trees_equal(grads, jax.grad(loss_fn)(params, x, y))
  cotangents = jax.grad(lambda e: loss_fn(params, x, y, e))(jnp.zeros((B, T, C), F64))
  want_a, want_g = _positions_oracle([x.reshape(-1, D)], cotangents, B * T)
  np.testing.assert_allclose(stats["fc"]["A"], want_a, rtol=1e-12)
  np.testing.assert_allclose(stats["fc"]["G"], want_g, rtol=1e-12)


def test_shared_embedding_under_vmap_counts_every_lane():
  """Token frequencies of an embedding mapped over the time steps: every
  lane's ids counted once, the frequencies of the whole `[B, T]` ids."""
  T, V = 5, 7
  table = jax.random.normal(jax.random.PRNGKey(9), (V, C), F64)
  ids = jax.random.randint(jax.random.PRNGKey(10), (B, T), 0, V)
  y = jax.random.randint(jax.random.PRNGKey(11), (B, T), 0, C)

  def loss_fn(p, ids, y):
    out = jax.vmap(lambda i: kd.tags.embed(i, p, name="emb"), in_axes=1, out_axes=1)(ids)
    return kd.losses.softmax_cross_entropy(out, y)
  _, _, stats = jax.jit(kd.value_and_grad(loss_fn))(table, ids, y)
  np.testing.assert_allclose(stats["emb"]["A"],
                             np.bincount(np.asarray(ids).ravel(), minlength=V) / (B * T),
                             rtol=1e-12)


def test_shared_kernel_runs_of_different_sizes_average_their_positions():
  """One Dense applied to `B` positions and then to `B·T` (an encoder shared
  by inputs of different lengths): `A` is the mean over all `B + B·T`
  positions, not the mean of the two runs' means."""
  T = 5
  k = jax.random.split(jax.random.PRNGKey(12), 4)
  params = {"w": jax.random.normal(k[0], (D, C), F64), "b": jax.random.normal(k[1], (C,), F64)}
  x = jax.random.normal(k[2], (B, T, D), F64)
  y = jax.random.randint(k[3], (B,), 0, C)

  def loss_fn(p, x, y, eps=(0.0, 0.0)):
    short = kd.tags.dense(x[:, 0], p["w"], p["b"], name="fc") + eps[0]
    long = kd.tags.dense(x, p["w"], p["b"], name="fc") + eps[1]
    return kd.losses.softmax_cross_entropy(short + jnp.tanh(long).mean(1), y)
  _, _, stats = jax.jit(kd.value_and_grad(loss_fn))(params, x, y)
  eps = (jnp.zeros((B, C), F64), jnp.zeros((B, T, C), F64))
  g_short, g_long = jax.grad(lambda e: loss_fn(params, x, y, e))(eps)
  want_a, want_g = _positions_oracle(
      [x[:, 0], x.reshape(-1, D)], jnp.concatenate([g_short, g_long.reshape(-1, C)]), B)
  np.testing.assert_allclose(stats["fc"]["A"], want_a, rtol=1e-12)
  np.testing.assert_allclose(stats["fc"]["G"], want_g, rtol=1e-12)


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.OptimizedLSTMCell])
def test_flax_lstm_gates_get_expand_statistics(cell):
  """An LSTM (Flax's `nn.RNN` over `nn.LSTMCell`, captured by interception):
  each gate's input and hidden Dense is one layer shared by the T time
  steps, with K-FAC-expand's statistics over them (every step's positions
  are examples; kfac-jax#188 asks for recurrent layers). The cell written
  out in float64 is the brute force. `OptimizedLSTMCell` (the gates'
  kernels joined into one product) is captured as `LSTMCell`, its loss
  Flax's own."""
  steps = 3

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.RNN(cell(D, param_dtype=F64, name="cell"))(x)
      return nn.Dense(C, param_dtype=F64)(h[:, -1])

  x = jax.random.normal(jax.random.PRNGKey(3), (B, steps, D), F64)
  y = jax.random.randint(jax.random.PRNGKey(4), (B,), 0, C)
  params = helpers.randomized(Net().init(jax.random.PRNGKey(5), x))["params"]

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(Net().apply({"params": p}, x), y)
  grad_fn = kd.value_and_grad(loss_fn, capture="flax")
  layers = grad_fn.discover(params, x, y)
  assert not layers.uncaptured and len(layers) == 9          # 8 gates, the head
  loss, _, stats = jax.jit(grad_fn)(params, x, y)
  np.testing.assert_allclose(loss, loss_fn(params, x, y), rtol=1e-12)
  weights = params["cell"]

  def unrolled(gate: str, eps):
    """The LSTM with `eps[t]` added to `gate`'s Dense output at step t."""
    h, c, inputs = jnp.zeros((B, D), F64), jnp.zeros((B, D), F64), []

    def dense(name, v, t):
      out = v @ weights[name]["kernel"] + weights[name].get("bias", 0.0)
      if name == gate:
        inputs.append(v)
        out = out + eps[t]
      return out
    for t in range(steps):
      pre = {k: dense("i" + k, x[:, t], t) + dense("h" + k, h, t) for k in "ifgo"}
      c = jax.nn.sigmoid(pre["f"]) * c + jax.nn.sigmoid(pre["i"]) * jnp.tanh(pre["g"])
      h = jax.nn.sigmoid(pre["o"]) * jnp.tanh(c)
    out = h @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    return kd.losses.softmax_cross_entropy(out, y), inputs
  for gate in ("ii", "hi", "if", "hf", "ig", "hg", "io", "ho"):
    name = next(layer.name for layer in layers if layer.name.endswith("/" + gate))
    want_a, want_g = _expand_oracle(functools.partial(unrolled, gate), x[:, 0], steps,
                                    bias=gate[0] == "h")
    np.testing.assert_allclose(stats[name]["A"], want_a, rtol=1e-10, err_msg=gate)
    np.testing.assert_allclose(stats[name]["G"], want_g, rtol=1e-10, err_msg=gate)


def test_stack_applied_twice_gets_expand_statistics():
  """A scanned stack applied twice (two `fori_loop`s over the blocks): every
  block runs twice, and its statistics are K-FAC-expand's over both runs."""
  x, y = _batch()
  params = _plain_params()

  def loss_fn(p, x, y):
    h = x
    for _ in range(2):                      # the whole stack, twice
      h = lax.fori_loop(0, L, lambda i, h: _plain_block(p["blocks"], h, i), h)
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["out"]["kernel"]), y)
  grad_fn = kd.value_and_grad(loss_fn)
  assert [l.stack for l in grad_fn.discover(params, x, y)] == [(L,), (L,), ()]
  _, _, stats = jax.jit(grad_fn)(params, x, y)
  blocks = params["blocks"]

  def unrolled(eps, block):                 # eps[r]: block `block`'s run r
    h, inputs = x, []
    for r in range(2):
      for i in range(L):
        z = h @ blocks["dense"]["kernel"][i] + blocks["dense"]["bias"][i]
        if i == block:
          inputs.append(h)
          z = z + eps[r]
        h = jnp.tanh(z) * blocks["norm"]["scale"][i]
    return (kd.losses.softmax_cross_entropy(h @ params["out"]["kernel"], y), inputs)
  for i in range(L):
    want_a, want_g = _expand_oracle(functools.partial(unrolled, block=i), x, 2)
    np.testing.assert_allclose(stats["blocks/dense"]["A"][i], want_a, rtol=1e-12)
    np.testing.assert_allclose(stats["blocks/dense"]["G"][i], want_g, rtol=1e-12)


def test_nnx_pure_dict_state_raises():
  """Stacked NNX layers need the nnx.State (its Variables carry their paths)."""
  x, y = _batch()
  graph, state = nnx.split(NnxScanned(nnx.Rngs(0)), nnx.Param)
  pure = nnx.to_pure_dict(state)

  def loss_fn(p, x, y):
    s = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(s, p)
    return kd.losses.softmax_cross_entropy(nnx.merge(graph, s)(x), y)
  with pytest.raises(ValueError, match="not a leaf"):
    kd.value_and_grad(loss_fn).discover(pure, x, y)


def test_loss_that_drops_the_probes_raises():
  (_, params_s), _, (x, y) = _linen_problem()

  def loss_fn(p, x, y):                      # rebuilds the tree from known keys
    p = jax.tree.map(lambda a: a, {"blocks": {k: {n: v for n, v in d.items()
                                                   if n in ("kernel", "bias", "scale")}
                                              for k, d in p["blocks"].items()},
                                   "Dense_0": p["Dense_0"]})
    return kd.losses.softmax_cross_entropy(LinenScanned().apply({"params": p}, x), y)
  with pytest.raises(ValueError, match="ran without its probes"):
    kd.value_and_grad(loss_fn)(params_s, x, y)


def test_stacked_statistics_of_wrong_shape_raise():
  (loss_s, params_s), _, batch = _linen_problem()
  grad_fn = kd.value_and_grad(loss_s)
  tx = kd.scale_by_kfac(grad_fn.discover(params_s, *batch))
  state = tx.init(params_s)
  _, grads, stats = jax.jit(grad_fn)(params_s, *batch)
  stats["blocks/Dense_0"] = {k: v[:2] for k, v in stats["blocks/Dense_0"].items()}
  with pytest.raises(ValueError, match="stack axes"):
    tx.update(grads, state, params_s, kfac_stats=stats)


# ---------------------------------------------------------------------------
# A small Transformer with nn.scan'd blocks (attention projections are
# DenseGeneral kernels [d, heads, head_dim]), and distribution.
# ---------------------------------------------------------------------------

class TransformerBlock(nn.Module):
  """Post-LN block: attention (DenseGeneral projections), then an MLP."""

  @nn.compact
  def __call__(self, x, _=None):
    heads, d = 2, x.shape[-1]
    q, k, v = (kd.linen.DenseGeneral((heads, d // heads), name=n)(x) for n in "qkv")
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads))
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
    x = kd.linen.LayerNorm()(x + kd.linen.DenseGeneral(d, axis=(-2, -1), name="o")(o))
    h = kd.linen.Dense(2 * d)(x)
    return kd.linen.LayerNorm()(x + kd.linen.Dense(d)(nn.gelu(h))), None


class TinyLM(nn.Module):
  scanned: bool = True

  @nn.compact
  def __call__(self, tokens):
    x = kd.linen.Embed(11, 8)(tokens)
    if self.scanned:
      blocks = nn.scan(TransformerBlock, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=2)
      x, _ = blocks(name="blocks")(x, None)
    else:
      for i in range(2):
        x, _ = TransformerBlock(name=f"block_{i}")(x)
    return kd.linen.Dense(11)(x)


def _lm_problem(scanned=True):
  tokens = jax.random.randint(jax.random.PRNGKey(1), (16, 6), 0, 11)
  params = TinyLM().init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  if not scanned:
    blocks = params.pop("blocks")
    params.update({f"block_{i}": jax.tree.map(lambda a, i=i: a[i], blocks)
                   for i in range(2)})

  def loss_fn(p, tokens):
    logits = TinyLM(scanned).apply({"params": p}, tokens[:, :-1])
    return kd.losses.softmax_cross_entropy(logits, tokens[:, 1:])
  return loss_fn, params, (tokens,)


def _mlp_problem():
  (loss_fn, params), _, batch = _linen_problem()
  return loss_fn, params, batch


def _train_float32(problem, dist=None, steps=3):
  loss_fn, params, batch = problem
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.05, layers=grad_fn.discover(params, *batch), damping=0.1,
               inverse_update_every=2, distribution=dist)
  state = tx.init(params)

  def step(params, state, *batch):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    if dist is not None and dist.gradient_reduction == "none":
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  step, state = compile_step(step, state, dist, len(batch))
  for _ in range(steps):
    params, state = step(params, state, *batch)
  return params, state


@functools.cache
def _single_device_run(problem: str):
  """The single-device (parameters, state) every case of `problem` is compared
  with, computed once per worker."""
  with jax.enable_x64(problem == "mlp"):
    return _train_float32(_mlp_problem() if problem == "mlp" else _lm_problem())


@pytest.mark.slow
def test_scanned_transformer_matches_unrolled():
  with jax.enable_x64(False):
    got, state = _single_device_run("transformer")
    want, _ = _train_float32(_lm_problem(scanned=False))
  kstate = find_states(state)[0]
  assert not kstate.layout.passthrough, kd.describe(kstate, print_table=False)
  stacked = {p.layer.stack_name for p in kstate.layout.plans if p.layer.stack_name}
  assert stacked == {f"blocks/{n}" for n in
                     ("q", "k", "v", "o", "Dense_0", "Dense_1", "LayerNorm_0",
                      "LayerNorm_1")}
  for i in range(2):
    jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b, rtol=2e-4,
                                                              atol=2e-6),
                 got["blocks"], want[f"block_{i}"])


def _strategies():
  """(problem, grad_worker_fraction, factor_reduction, gradient_reduction)."""
  yield pytest.param("mlp", 1 / 8, "reduce_scatter", "reduce_scatter",
                     id="mlp-MEM-SPNGD")
  # Every owner-group shape and both factor reductions, not their full product
  # (test_distributed.py has the product on a Dense + Conv model); SP-NGD's
  # reduce-scattered gradients on the MLP's scanned layers only.
  for fraction, name, factors in ((1.0, "COMM", "reduce_scatter"),
                                  (0.25, "HYBRID", "all_reduce"),
                                  (1 / 8, "MEM", "reduce_scatter")):
    yield pytest.param("transformer", fraction, factors, "none",
                       id=f"transformer-{name}-{factors}", marks=pytest.mark.slow)


@pytest.mark.parametrize("problem,fraction,factor_reduction,gradient_reduction",
                         list(_strategies()))
def test_distributed_scanned_equals_single_device(problem, fraction, factor_reduction,
                                                  gradient_reduction):
  make = _mlp_problem if problem == "mlp" else _lm_problem
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction,
                         gradient_reduction=gradient_reduction)
  with jax.enable_x64(problem == "mlp"):
    got, state = _train_float32(make(), dist)
  want, _ = _single_device_run(problem)
  owners = {place.owner for plan in find_states(state)[0].layout.plans
            if plan.layer.stack_name for _, place in plan.places}
  assert len(owners) > 1                  # the blocks live on several devices
  jax.tree.map(lambda a, b: _assert_close(a, b, 1e-5 if problem == "mlp" else 2e-4),
               got, want)


def _instructions(compiled_text: str) -> int:
  """Instructions of the compiled program's entry computation and of every
  computation it calls (fusions included)."""
  return sum(1 for line in compiled_text.splitlines() if " = " in line)


def _step_instructions(loss_fn, params, x, y, **options) -> int:
  """`_instructions` of the jitted K-FAC step (η 0.1, λ 1e-3, `options`)."""
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(learning_rate=0.1, damping=1e-3, layers=grad_fn.discover(params, x, y),
               **options)

  def step(p, s):
    _, grads, stats = grad_fn(p, x, y, opt_state=s)
    updates, s = tx.update(grads, s, p, kfac_stats=stats)
    return optax.apply_updates(p, updates), s
  return _instructions(jax.jit(step).lower(params, tx.init(params)).compile().as_text())


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_stacked_step_program_does_not_grow_with_blocks(method):
  """The compiled K-FAC step of `L` scanned blocks (a Dense with bias, a
  bias-free Dense, a scale-and-shift) has about the same instructions for 8 and 24
  blocks: consecutive blocks are read, packed, preconditioned and written
  back as slices of their stacked leaves and statistics, not one op per block
  (before, 50 scanned blocks compiled about 6 kernels each)."""
  def loss_fn(p, x, y):
    def block(h, i):
      h = jnp.tanh(kd.tags.dense(h, p["up"]["kernel"], p["up"]["bias"], stack_index=i))
      h = kd.tags.dense(h, p["down"]["kernel"], stack_index=i)
      return kd.tags.scale_and_shift(h, p["norm"]["scale"], p["norm"]["bias"],
                                     stack_index=i), None
    h, _ = lax.scan(block, x, jnp.arange(p["up"]["kernel"].shape[0]))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, p["out"]["kernel"]), y)

  x, y = _batch()
  counts = []
  for blocks in (8, 24):
    keys = jax.random.split(jax.random.PRNGKey(blocks), 3)
    params = {"up": {"kernel": jax.random.normal(keys[0], (blocks, D, 2 * D), F64) / 2,
                     "bias": jnp.zeros((blocks, 2 * D), F64)},
              "down": {"kernel": jax.random.normal(keys[1], (blocks, 2 * D, D), F64) / 3},
              "norm": {"scale": jnp.ones((blocks, D), F64),
                       "bias": jnp.zeros((blocks, D), F64)},
              "out": {"kernel": jax.random.normal(keys[2], (D, C), F64)}}
    counts.append(_step_instructions(loss_fn, params, x, y, method=method))
  assert abs(counts[1] - counts[0]) <= 0.02 * counts[0], counts


def test_unscanned_step_program_grows_linearly_with_layers():
  """The compiled K-FAC step of `L` unscanned Dense layers (with the default
  KL clip) grows by the same number of instructions per added layer: the
  clip's `ν`, a sum over every layer that scales each layer's update, is
  computed once (before, XLA copied the L-term sum into each of the ~4L
  update fusions: 4·L² `abs` ops, 145k instructions for 96 Flax layers
  against 32k)."""
  x, y = _batch()
  counts = []
  for layers in (4, 8, 12):
    keys = jax.random.split(jax.random.PRNGKey(layers), layers + 1)
    params = [{"w": jax.random.normal(k, (D, D), F64) / 3, "b": jnp.zeros(D, F64)}
              for k in keys[:-1]] + [{"w": jax.random.normal(keys[-1], (D, C), F64)}]

    def loss_fn(p, x, y):
      for q in p[:-1]:
        x = jnp.tanh(kd.tags.dense(x, q["w"], q["b"]))
      return kd.losses.softmax_cross_entropy(kd.tags.dense(x, p[-1]["w"]), y)
    counts.append(_step_instructions(loss_fn, params, x, y))
  first, second = counts[1] - counts[0], counts[2] - counts[1]
  assert abs(second - first) <= 0.05 * first, counts


def _deep_stack_problem(blocks: int = 16):
  """A Dense input projection (devices own factors of different sizes: each
  copies its own out of the all-reduced buffer), then `blocks` tanh Dense
  blocks under `lax.scan`, the head untagged: the stack's factors are the
  last in plan order, so a device's run of them can end the buffer."""
  keys = jax.random.split(jax.random.PRNGKey(5), 6)
  params = {"inputs": jax.random.normal(keys[5], (2 * D, D), F64) / 3,
            "dense": {"kernel": jax.random.normal(keys[0], (blocks, D, D), F64) / 2,
                      "bias": jax.random.normal(keys[1], (blocks, D), F64) / 4},
            "head": jax.random.normal(keys[2], (D, C), F64)}

  def loss_fn(p, x, y):
    def block(h, i):
      return jnp.tanh(kd.tags.dense(h, p["dense"]["kernel"], p["dense"]["bias"],
                                    stack_index=i)), None
    h, _ = lax.scan(block, kd.tags.dense(x, p["inputs"]), jnp.arange(blocks))
    return kd.losses.softmax_cross_entropy(h @ p["head"], y)
  x = jax.random.normal(keys[3], (16, 2 * D), F64)
  return loss_fn, params, (x, jax.random.randint(keys[4], (16,), 0, C))


@pytest.mark.parametrize("fraction", [pytest.param(1.0, marks=pytest.mark.slow), 1 / 8])
def test_all_reduced_factors_of_consecutive_blocks_equal_single_device(fraction):
  """KAISA's factor all-reduce: each device copies its factors of consecutive
  blocks out of the summed buffer as one strided slice (`factors._copied`),
  a run at the buffer's end too; the steps equal one device's."""
  from kfac_jax_dist.kfac import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import packing  # pylint: disable=import-outside-toplevel
  problem = _deep_stack_problem()
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction,
                         factor_reduction="all_reduce", gradient_reduction="none")
  got, state = _train_float32(problem, dist)
  want, _ = _train_float32(problem)
  lay = find_states(state)[0].layout
  runs = [len(run) for d in range(8) for run in layout_lib.block_runs(
      lay.owned(d), lambda t: t[1], packing.stored_together)]
  assert max(runs) > 1 and len(set(lay.copy_branches)) == 8
  jax.tree.map(lambda a, b: _assert_close(a, b, 1e-6), got, want)


def test_two_stack_axes_train_as_unrolled():
  """A stack with two leading axes (`[2, 3, ...]`, `stack_index=(i, j)`, a
  pipeline's stages × blocks): blocks numbered row-major, read and written as
  slices of the flattened stack, train as the six layers unrolled, on one
  device and on 8 (MEM-OPT)."""
  keys = jax.random.split(jax.random.PRNGKey(6), 3)
  params = {"dense": {"kernel": jax.random.normal(keys[0], (2, 3, D, D), F64) / 2,
                      "bias": jax.random.normal(keys[1], (2, 3, D), F64) / 4},
            "out": {"kernel": jax.random.normal(keys[2], (D, C), F64)}}

  def stacked(p, x, y):
    for i in range(2):
      for j in range(3):
        x = jnp.tanh(kd.tags.dense(x, p["dense"]["kernel"], p["dense"]["bias"],
                                   stack_index=(i, j)))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["out"]["kernel"]), y)

  def unrolled(p, x, y):
    for k in range(6):
      x = jnp.tanh(kd.tags.dense(x, p[f"b{k}"]["kernel"], p[f"b{k}"]["bias"]))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["out"]["kernel"]), y)
  flat = {f"b{k}": {n: v.reshape((6,) + v.shape[2:])[k] for n, v in params["dense"].items()}
          for k in range(6)} | {"out": params["out"]}
  x = jax.random.normal(jax.random.PRNGKey(7), (16, D), F64)
  y = jax.random.randint(jax.random.PRNGKey(8), (16,), 0, C)
  want, _ = _train_float32((unrolled, flat, (x, y)))
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=1 / 8,
                         gradient_reduction="none")
  for distribution in (None, dist):
    got, state = _train_float32((stacked, params, (x, y)), distribution)
    assert [p.layer.name for p in find_states(state)[0].layout.plans][:2] == [
        "dense/0/0", "dense/0/1"]
    for k in range(6):
      jax.tree.map(lambda a, b, k=k: _assert_close(a.reshape((6,) + a.shape[2:])[k], b,
                                                   1e-5), got["dense"], want[f"b{k}"])


def _strided(lay, run) -> bool:
  """Whether a precondition run's A eigenbases lie a constant stride apart."""
  starts = [lay.second_base(p.a.owner) + p.a.matrix_offset for p in run]
  return len({b - a for a, b in zip(starts, starts[1:])}) == 1


def _apart(lay, run) -> bool:
  """Whether a precondition run's A eigenbases do not follow one another."""
  starts = [lay.second_base(p.a.owner) + p.a.matrix_offset for p in run]
  return any(b - a != run[0].a.dim ** 2 for a, b in zip(starts, starts[1:]))


@pytest.mark.parametrize("fraction,gradient_reduction,run_numbers", [
    pytest.param(1 / 8, "all_reduce", None, marks=pytest.mark.slow),
    (1 / 8, "reduce_scatter", None),
    pytest.param(1.0, "all_reduce", None, marks=pytest.mark.slow), (1.0, "all_reduce", 120)])
def test_one_block_per_owner_equals_single_device(monkeypatch, fraction,
                                                  gradient_reduction, run_numbers):
  """Eight blocks on eight devices, as at pod scale, where each device owns
  about one block: under MEM-OPT the owner groups of equal blocks share one
  branch of the preconditioning, each reading its own block of the stacked
  gradient at a shift from a table (`Layout.group_branches`); under COMM-OPT
  a run of blocks whose eigenbases lie one per device is read as one strided
  slice or gather (`packing.read_at`), and past `RUN_NUMBERS` (120: two
  blocks a chunk) chunk by chunk through a loop. The steps equal one
  device's."""
  from kfac_jax_dist.kfac import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from kfac_jax_dist.kfac import precondition  # pylint: disable=import-outside-toplevel
  if run_numbers is not None:
    monkeypatch.setattr(precondition, "RUN_NUMBERS", run_numbers)
  problem = _deep_stack_problem(blocks=8)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction,
                         gradient_reduction=gradient_reduction)
  got, state = _train_float32(problem, dist)
  want, _ = _train_float32(problem)
  lay = find_states(state)[0].layout
  if fraction < 1:
    assert len(set(lay.group_branches)) < lay.num_groups // 2, lay.group_branches
  else:
    runs = [run for run in layout_lib.precondition_runs(lay, 0, across_layers=False)
            if len(run) > 1]
    assert any(_apart(lay, run) for run in runs)
    if run_numbers is not None:     # gathered, in chunks of 2 of the 8 blocks
      assert run_numbers // layout_lib.second_numbers(runs[0][0]) == 2
      assert not _strided(lay, runs[0]) and len(runs[0]) == 8
  jax.tree.map(lambda a, b: _assert_close(a, b, 1e-6), got, want)


@pytest.mark.parametrize("starts", [(3, 7, 11), (2, 12, 22, 32), (1, 14, 20, 36), (25,)])
def test_read_at_is_indexing(starts):
  """`packing.read_at`: parts that follow one another, lie a constant stride
  apart (the last row cut short by the array's end) or anywhere in their
  rows (a gather) are read as numpy's slices."""
  from kfac_jax_dist.kfac import packing  # pylint: disable=import-outside-toplevel
  x = np.arange(40.0)
  got = jax.jit(lambda v: packing.read_at(v, starts, (2, 2), row=10))(jnp.asarray(x))
  want = np.stack([x[s:s + 4].reshape(2, 2) for s in starts])
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("at,size", [(3, 4), (7, 25), (10, 20), (0, 3), (5, 15), (20, 40)])
def test_write_span_is_flat_assignment(at, size):
  """`packing._write_span`: the end of a row, whole rows, the start of a row,
  in any combination, write what a flat assignment writes."""
  from kfac_jax_dist.kfac import packing  # pylint: disable=import-outside-toplevel
  span = np.arange(1.0, size + 1)
  got = jax.jit(lambda s: packing._write_span(jnp.zeros((6, 10)), at, s))(jnp.asarray(span))
  want = np.zeros(60)
  want[at:at + size] = span
  np.testing.assert_array_equal(np.asarray(got).reshape(-1), want)


@pytest.mark.parametrize("blocks,fraction,storage,interleaved", [
    (32, 1 / 8, "chunked", False), (64, 1.0, "owner", False), (8, 1 / 2, "chunked", True)])
def test_statistics_spans_past_int32_equal_the_flat_buffer(monkeypatch, blocks, fraction,
                                                           storage, interleaved):
  """Past 2³¹ numbers the statistics buffer is written by rows, a stack's
  blocks over consecutive devices in one span (`packing._span_plan`: at
  P = 1024 one write per stack instead of one per device), per factor or,
  where each device stores a block's two factors together, the factors
  interleaved block by block (8 blocks on 4 groups: a span of more than two
  whole rows). As if int32 ended just short of the buffer, on 8 devices in
  tight chunks and in owner segments: bit for bit the flat buffer, and the
  layer-at-a-time one."""
  from kfac_jax_dist.kfac import packing  # pylint: disable=import-outside-toplevel
  loss_fn, params, batch = _deep_stack_problem(blocks=blocks)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  tx = kd.kfac(0.1, layers=kd.value_and_grad(loss_fn).discover(params, *batch),
               distribution=dist, factor_update_every=10, inverse_update_every=100)
  lay = find_states(tx.init(params))[0].layout
  assert lay.factor_storage == storage
  rng = np.random.default_rng(0)
  stats = {(plan.layer.name, w): jnp.asarray(rng.normal(size=(q.dim, q.dim)), jnp.float32)
           for plan in lay.plans for w, q in plan.places}

  def stacked(plans, w):
    return jnp.stack([stats[(plan.layer.name, w)] for plan in plans])

  def one(plan, w):
    return stats[(plan.layer.name, w)]

  def segments(batched):     # traced anew: _INT32_MAX is read at trace time
    return np.asarray(jax.jit(lambda: packing.all_segments(
        lay, stacked if batched else one, jnp.float32, batched=batched))())
  flat = segments(True)
  runs = sum(len(packing._stored_runs(lay, d)) for d in range(lay.num_devices))
  plan = packing._span_plan(lay, packing.PackedStacks(lay, stacked, jnp.float32))
  assert storage == "owner" or len(plan) < runs, (len(plan), runs)
  assert interleaved == any(len(r.cycle) > 1 and r.stop - r.start > 2 * lay.factor_shard
                            for r in plan)
  monkeypatch.setattr(packing, "_INT32_MAX", flat.shape[0] - 1)
  np.testing.assert_array_equal(segments(True), flat)
  np.testing.assert_array_equal(segments(False), flat)


class _ShapeReadingBlock(nnx.Module):
  """A block whose code reads its layer's kernel outside the layer (Gemma's
  attention reads its heads from its kernels' shapes); `read="T"` reads
  more than the shape."""

  def __init__(self, read: str, rngs: nnx.Rngs):
    self.read = read
    self.lin = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    scale = 1.0
    if self.read == "shape":
      scale = self.lin.kernel.shape[-1] / 4 * len(self.lin.kernel[...]) / 4
    elif self.read == "T":
      scale = 1.0 + 0.0 * jnp.sum(self.lin.kernel.value.T)
    return jnp.tanh(self.lin(x)) * scale


class _ShapeReadingStack(nnx.Module):
  def __init__(self, read: str, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> _ShapeReadingBlock:
      return _ShapeReadingBlock(read, rngs)
    self.blocks = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)
    return body(x, self.blocks)


def test_scanned_nnx_model_may_read_its_kernels_shape():
  """A scanned NNX model that reads a stacked layer's kernel shape (`.shape`,
  `len`, Flax's `variable[...]`) outside the layer is captured (its statistics those of the model that does not,
  the same numbers); one that reads more of it gets an error saying so, not
  the stack axis's."""
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
  y = jnp.arange(8) % 4

  def captured(read: str):
    graph, state = nnx.split(_ShapeReadingStack(read, nnx.Rngs(0)))
    fn = lambda s, x, y: kd.losses.softmax_cross_entropy(nnx.merge(graph, s)(x), y)
    return kd.value_and_grad(fn, capture="flax"), state
  grad_fn, state = captured("shape")
  assert [(l.name, l.stack) for l in grad_fn.discover(state, x, y)] == [("blocks/lin", (3,))]
  got = jax.jit(grad_fn)(state, x, y)
  plain_fn, plain_state = captured("none")
  want = jax.jit(plain_fn)(plain_state, x, y)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
  grad_fn, state = captured("T")
  with pytest.raises(ValueError, match="kernel outside the layer.*only its shape"):
    grad_fn(state, x, y)
