"""Permuted kernels in K-FAC: einsum Dense layers whose kernel holds its
contracted axes elsewhere than first, or whose output puts a kernel axis
before the input's (Gemma's `BTD,NDH->BTNH` queries and `BTD,SNDH->SBTNH`
keys and values), and `kd.tags.dense_general(..., kernel_axes=...)`.

Such a layer applies `jnp.transpose(kernel, kernel_axes)`, `(*in, *out)`;
K-FAC's factors are those of that applied kernel. The oracles: the same
network written with the applied kernels as its parameters and the
canonical equations (float64: every update equal after the transposition),
NumPy's Kronecker solve, and the single-device run on 8 devices.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64
D, N, H, S, CLASSES = 4, 2, 3, 2, 5       # model width, heads, head width, (k, v)
Q_AXES, KV_AXES = (1, 0, 2), (2, 0, 1, 3)  # stored [N, D, H] / [S, N, D, H] as applied


class _Attention(nn.Module):
  """Gemma's attention projections: `permuted`, its own equations and kernel
  layouts; else the same layer in the canonical ones (`[D, N, H]`, `[D, S, N,
  H]`: `BTD,D...->BT...`). `lib`: `nn` (intercepted) or `kd.linen`."""
  permuted: bool
  lib: object = nn

  @nn.compact
  def __call__(self, x):
    kw = dict(param_dtype=x.dtype, precision=jax.lax.Precision.HIGHEST)
    if self.permuted:
      q = self.lib.Einsum((N, D, H), "BTD,NDH->BTNH", use_bias=False, name="q", **kw)(x)
      k, v = self.lib.Einsum((S, N, D, H), "BTD,SNDH->SBTNH", name="kv", **kw)(x)
    else:
      q = self.lib.Einsum((D, N, H), "BTD,DNH->BTNH", use_bias=False, name="q", **kw)(x)
      k, v = jnp.moveaxis(
          self.lib.Einsum((D, S, N, H), "BTD,DSNH->BTSNH", name="kv", **kw)(x), 2, 0)
    probs = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k), axis=-1)
    attended = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    out = self.lib.Einsum((N, H, D), "BTNH,NHD->BTD", name="o", **kw)(attended)
    return self.lib.Dense(CLASSES, name="head", **kw)(jnp.tanh(out).mean(1))


def _batch(n: int = 12, dtype=F64) -> tuple:
  kx, ky = jax.random.split(jax.random.PRNGKey(3))
  return (jax.random.normal(kx, (n, 5, D), dtype),
          jax.random.randint(ky, (n,), 0, CLASSES))


def _params(dtype=F64) -> dict:
  return _Attention(True).init(jax.random.PRNGKey(0), _batch(2, dtype)[0])["params"]


def _applied(params: dict) -> dict:
  """The canonical network's parameters: the applied kernels as leaves."""
  return {**params, "q": {"kernel": jnp.transpose(params["q"]["kernel"], Q_AXES)},
          "kv": {**params["kv"], "kernel": jnp.transpose(params["kv"]["kernel"], KV_AXES)}}


def _stored(params: dict) -> dict:
  """`_applied`'s inverse."""
  return {**params, "q": {"kernel": jnp.transpose(params["q"]["kernel"],
                                                  np.argsort(Q_AXES))},
          "kv": {**params["kv"], "kernel": jnp.transpose(params["kv"]["kernel"],
                                                         np.argsort(KV_AXES))}}


def _loss(permuted: bool, lib=nn):
  model = _Attention(permuted, lib)
  return lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)


@pytest.mark.parametrize("config", helpers.method_params(("eigen", "ekfac")))
def test_permuted_updates_equal_the_applied_kernels(config):
  """Flax's own `Einsum` with Gemma's equations, captured: every layer found
  (none left to Flax), the permuted ones recorded with their `kernel_axes`,
  and four steps of every method equal to the canonical network's, to
  float64 precision."""
  with jax.enable_x64(True):
    batch, trajectories = _batch(), []
    for permuted in (True, False):
      params = _params() if permuted else _applied(_params())
      fn = _loss(permuted)
      layers = kd.value_and_grad(fn, capture="flax").discover(params, *batch)
      assert not layers.uncaptured
      assert [(l.name, l.kernel_shape, l.kernel_axes) for l in layers] == [
          ("q", (D, N, H), Q_AXES if permuted else None),
          ("kv", (D, S, N, H), KV_AXES if permuted else None),
          ("o", (N, H, D), None), ("head", (D, CLASSES), None)]
      grad_fn = kd.value_and_grad(fn, capture="flax")
      options = dict(damping=1e-2, factor_update_every=1, inverse_update_every=2,
                     factor_dtype=F64) | helpers.METHOD_CONFIGS[config]
      if options["learning_rate"] is None:
        options["grad_fn"] = grad_fn
      tx = kd.kfac(layers=layers, **options)

      @jax.jit
      def step(params, state, grad_fn=grad_fn, tx=tx):
        _, grads, stats = grad_fn(params, *batch, opt_state=state)
        updates, state = tx.update(grads, state, params, kfac_stats=stats,
                                   kfac_batch=batch)
        return optax.apply_updates(params, updates), state
      state = tx.init(params)
      for _ in range(4):
        params, state = step(params, state)
      trajectories.append(params if permuted else _stored(params))
    start = _params()
    for name in ("q", "kv"):
      assert float(jnp.max(jnp.abs(trajectories[0][name]["kernel"]
                                   - start[name]["kernel"]))) > 1e-3
    helpers.assert_trees_equal(*trajectories, rtol=1e-10)


def test_permuted_update_equals_kronecker_solve():
  """One step of `kd.linen.Einsum` with `BTD,SNDH->SBTNH`: its update,
  transposed as applied (`[D, S·N·H]`) with its bias row, is NumPy's solve of
  `(A ⊗ G + γI) vec(V) = vec(∇)`; its bias keeps Flax's shape, the output's
  features `[S, N, H]`."""
  with jax.enable_x64(True):
    gamma, params = 1e-2, _params()
    assert params["kv"]["bias"].shape == (S, N, H)
    grads, updates, factors, _ = helpers.first_kfac_step(
        _loss(True, kd.linen), params, _batch(), gamma)

    def as_applied(tree):
      kernel = np.asarray(jnp.transpose(tree["kv"]["kernel"], KV_AXES)).reshape(D, -1)
      return np.concatenate([kernel, np.asarray(tree["kv"]["bias"]).reshape(1, -1)])
    grad = as_applied(grads)
    a, g = np.asarray(factors["kv"]["A"]), np.asarray(factors["kv"]["G"])
    assert a.shape == (D + 1,) * 2 and g.shape == (S * N * H,) * 2
    want = np.linalg.solve(np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0]),
                           grad.reshape(-1)).reshape(grad.shape)
    np.testing.assert_allclose(as_applied(updates), want, rtol=1e-9, atol=1e-12)


def test_stacked_permuted_kernel_tag():
  """`kd.tags.dense_general(kernel_axes=...)` on a stacked leaf `[L, N, D,
  H]`: `leaf_blocks` gives each block as applied, `blocks_leaf` inverts it,
  and four steps equal those of the network holding the applied blocks."""
  blocks = 2

  def network(p, x, y, axes):
    h = x
    for i in range(blocks):
      h = jnp.tanh(kd.tags.dense_general(h, p["mix"], stack_index=i, kernel_axes=axes)
                   ).reshape(h.shape)
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h.mean(1), p["head"]), y)

  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    stored = {"mix": jnp.asarray(rng.normal(size=(blocks, N, D, 2)) * 0.5),
              "head": jnp.asarray(rng.normal(size=(D, CLASSES)) * 0.5)}
    applied = {**stored, "mix": jnp.transpose(stored["mix"], (0, 2, 1, 3))}
    batch = _batch()
    layers = kd.value_and_grad(network).discover(stored, *batch, axes=(1, 0, 2))
    mix = layers.layers[0]
    assert (mix.stack, mix.kernel_shape, mix.kernel_axes) == ((blocks,), (D, N, 2),
                                                              (1, 0, 2))
    assert mix.leaf_shape(mix.kernel_shape) == stored["mix"].shape
    as_blocks = mix.leaf_blocks(stored["mix"], mix.kernel_shape)
    np.testing.assert_array_equal(as_blocks, applied["mix"])
    np.testing.assert_array_equal(mix.blocks_leaf(as_blocks, mix.kernel_shape),
                                  stored["mix"])
    got = helpers.method_trajectory(
        lambda p, x, y: network(p, x, y, (1, 0, 2)), stored, batch,
        helpers.METHOD_CONFIGS["eigen"])
    want = helpers.method_trajectory(
        lambda p, x, y: network(p, x, y, None), applied, batch,
        helpers.METHOD_CONFIGS["eigen"])
    helpers.assert_trees_equal(got["mix"], jnp.transpose(want["mix"], (0, 2, 1, 3)),
                               rtol=1e-10)


def test_kernel_axes_errors():
  x = jnp.ones((2, 4))
  with pytest.raises(ValueError, match=r"kernel_axes=\(0, 0, 1\) must be a permutation"):
    kd.tags.dense_general(x, jnp.ones((2, 4, 3)), kernel_axes=(0, 0, 1))
  with pytest.raises(ValueError, match=r"kernel_axes=\(1.5, 0, 2\) must be .* integers"):
    kd.tags.dense_general(x, jnp.ones((2, 4, 3)), kernel_axes=(1.5, 0, 2))
  with pytest.raises(ValueError, match=r"do not match the kernel \(2, 4, 3\) "
                                       r"\(the stored \(4, 2, 3\) as kernel_axes"):
    kd.tags.dense_general(x, jnp.ones((4, 2, 3)), kernel_axes=(1, 0, 2))
  assert kd.tags.dense_general(x, jnp.ones((2, 4, 3)), kernel_axes=(1, 0, 2)).shape == (
      2, 2, 3)


class _NnxAttention(nnx.Module):
  """`_Attention(permuted=True)` in NNX (Flax's own modules, intercepted)."""

  def __init__(self, rngs: nnx.Rngs):
    kw = dict(param_dtype=F64, precision=jax.lax.Precision.HIGHEST, rngs=rngs)
    self.q = nnx.Einsum("BTD,NDH->BTNH", (N, D, H), **kw)
    self.kv = nnx.Einsum("BTD,SNDH->SBTNH", (S, N, D, H), (S, N, H), **kw)
    self.o = nnx.Einsum("BTNH,NHD->BTD", (N, H, D), (D,), **kw)
    self.head = nnx.Linear(D, CLASSES, **kw)

  def __call__(self, x):
    q, (k, v) = self.q(x), self.kv(x)
    probs = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k), axis=-1)
    out = self.o(jnp.einsum("BNTS,BSNH->BTNH", probs, v))
    return self.head(jnp.tanh(out).mean(1))


def test_nnx_permuted_einsum_statistics_equal_linens():
  """NNX's `Einsum` with Gemma's equations is captured (a bias of the output's
  features), and its statistics equal the linen network's (tested above
  against the canonical network) with the same weights."""
  with jax.enable_x64(True):
    params, batch = _params(), _batch()
    model = _NnxAttention(nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    state = nnx.State({"q": {"kernel": params["q"]["kernel"]},
                       "kv": {"kernel": params["kv"]["kernel"], "bias": params["kv"]["bias"]},
                       "o": {"kernel": params["o"]["kernel"], "bias": params["o"]["bias"]},
                       "head": {"kernel": params["head"]["kernel"],
                                "bias": params["head"]["bias"]}})

    def nnx_loss(p, x, y):
      return kd.losses.softmax_cross_entropy(nnx.merge(graphdef, p)(x), y)
    grad_fn = kd.value_and_grad(nnx_loss, capture="flax")
    layers = grad_fn.discover(state, *batch)
    assert not layers.uncaptured
    assert [l.kernel_axes for l in layers] == [Q_AXES, KV_AXES, None, None]
    _, _, got = jax.jit(grad_fn)(state, *batch)
    _, _, want = jax.jit(kd.value_and_grad(_loss(True), capture="flax"))(params, *batch)
    helpers.assert_trees_equal(got, want, rtol=1e-10)


@pytest.mark.parametrize("fraction", [1 / 8], ids=["MEM-OPT"])
def test_permuted_distributed_equals_single_device(fraction):
  """Gemma's projections in `kd.linen` on 8 devices equal the single-device run."""
  x, y = _batch(16, jnp.float32)
  want, losses = helpers.train_classifier(_Attention(True, kd.linen), x, y)
  assert losses[-1] < losses[0]
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  got, _ = helpers.train_classifier(_Attention(True, kd.linen), x, y, dist)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               got, want)


def test_tensor_parallel_reads_a_permuted_kernels_axes():
  """Sharded over "model" on a permuted kernel's stored axis, the layer is
  column- or row-parallel by the axis it applies: an `(out, in)` leaf
  (`kernel_axes=(1, 0)`) sharded on its input axis (row-parallel) with a
  tagged bias is refused, on its output axis (column-parallel)
  preconditioned."""
  model = 4
  mesh = helpers.mesh((2, model), ("data", "model"))

  def row(p, x, y):
    z = kd.tags.dense_general(x, p["w"]["kernel"], p["w"]["bias"], kernel_axes=(1, 0))
    return kd.losses.softmax_cross_entropy(jax.lax.psum(z, "model"), y)

  def column(p, x, y):
    z = kd.tags.dense_general(x, p["w"]["kernel"], p["w"]["bias"], kernel_axes=(1, 0))
    return kd.losses.softmax_cross_entropy(jax.lax.all_gather(z, "model", axis=1,
                                                              tiled=True), y)
  y = jnp.zeros(4, jnp.int32)
  rows = {"w": {"kernel": jnp.zeros((CLASSES, 8)), "bias": jnp.zeros(CLASSES)}}
  row_specs = {"w": {"kernel": P(None, "model"), "bias": P()}}
  columns = {"w": {"kernel": jnp.zeros((2 * model, 8)), "bias": jnp.zeros(2 * model)}}
  column_specs = {"w": {"kernel": P("model", None), "bias": P("model")}}
  for loss, params, specs, x in ((row, rows, row_specs, jnp.zeros((4, 8 // model))),
                                 (column, columns, column_specs, jnp.zeros((4, 8)))):
    dist = kd.Distribution(mesh, model_axis="model", param_specs=specs)
    layers = kd.value_and_grad(loss).discover(params, x, y, distribution=dist)
    assert layers.layers[0].kernel_axes == (1, 0)
    tx = kd.kfac(0.1, layers=layers, distribution=dist)
    if loss is row:
      with pytest.raises(ValueError, match="add the bias after"):
        tx.init(params)
    else:
      tx.init(params)


def test_tags_einsum_is_the_flax_einsums_layer():
  """`kd.tags.einsum` with Gemma's equations on a model's own parameters (as
  google-deepmind/gemma's `layers.Einsum`, `jnp.einsum` on its `w`) is the
  intercepted Flax network's layer: the same statistics and gradients; an
  equation that is no Dense layer's is refused."""
  with jax.enable_x64(True):
    params, batch = _params(), _batch()

    def loss(p, x, y):
      q = kd.tags.einsum("BTD,NDH->BTNH", x, p["q"]["kernel"], name="q")
      k, v = kd.tags.einsum("BTD,SNDH->SBTNH", x, p["kv"]["kernel"], p["kv"]["bias"],
                            name="kv")
      probs = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k), axis=-1)
      out = kd.tags.einsum("BTNH,NHD->BTD", jnp.einsum("BNTS,BSNH->BTNH", probs, v),
                           p["o"]["kernel"], p["o"]["bias"], name="o")
      logits = kd.tags.dense(jnp.tanh(out).mean(1), p["head"]["kernel"],
                             p["head"]["bias"], name="head")
      return kd.losses.softmax_cross_entropy(logits, y)
    layers = kd.value_and_grad(loss).discover(params, *batch)
    assert [l.kernel_axes for l in layers] == [Q_AXES, KV_AXES, None, None]
    got = jax.jit(kd.value_and_grad(loss))(params, *batch)
    want = jax.jit(kd.value_and_grad(_loss(True), capture="flax"))(params, *batch)
    helpers.assert_trees_equal(got, want, rtol=1e-10)

    def unnamed(p, x, y):       # named by their kernels' paths, run eagerly
      q = kd.tags.einsum("BTD,NDH->BTNH", x, p["q"]["kernel"])
      logits = jnp.tanh(q).mean((1, 3)) @ jnp.ones((N, CLASSES))
      return kd.losses.softmax_cross_entropy(logits, y)
    _, grads, stats = kd.value_and_grad(unnamed)(params, *batch)
    assert set(stats) == {"q"} and grads["q"]["kernel"].shape == (N, D, H)
  with pytest.raises(ValueError, match="kd.tags.einsum: the equation 'bd,dfg->bf', not a "
                                       "Dense layer's"):
    kd.tags.einsum("bd,dfg->bf", jnp.ones((2, 3)), jnp.ones((3, 4, 5)))
  with pytest.raises(ValueError, match=r"the equation 'ecd,edf->ecf', whose kernel axis 'e' is "
                                       r"also an input axis .* kd.tags.dense\(..., stack_index=i\)"):
    kd.tags.einsum("ecd,edf->ecf", jnp.ones((4, 3, 6)), jnp.ones((4, 6, 8)))
  with pytest.raises(ValueError, match="no explicit two-operand equation .* that fits"):
    kd.tags.einsum("bd,df->bf", jnp.ones((2, 3)), jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match=r"one block of it: stack_index=0"):
    kd.tags.einsum("bd,df->bf", jnp.ones((2, 3)), jnp.ones((3, 4)), stack_index=0)
