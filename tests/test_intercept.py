"""Unmodified Flax linen models captured by interception (`capture="flax"`).

The oracle of each model is the same model written with `kd.linen` layers
(checked against brute force in test_capture / test_layers), run on the same
float64 parameters and batch: the intercepted model's layers, statistics,
gradients and K-FAC updates equal it (≤ 1e-12), on one device and on 8 CPU
devices (COMM-OPT, MEM-OPT). A scanned plain model equals its unrolled
version; layers with no tagged form are reported, never mis-captured.
"""

from __future__ import annotations

import inspect
import types
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax
import pytest
from flax import nnx

import kfac_jax_dist as kd
from kfac_jax_dist.capture import registry

import helpers
from helpers import compile_step

pytestmark = pytest.mark.usefixtures("x64_module")
# The default selection (not slow): one device for both APIs (linen: the CNN and
# the ResNet; NNX: the CNN), the linen CNN on 8 devices; `--slow` adds the other
# models (.ci/run runs the NNX scanned model on the oldest jax).
SLOW = pytest.mark.slow

F64 = jnp.float64
PLAIN = types.SimpleNamespace(Dense=nn.Dense, Conv=nn.Conv, DenseGeneral=nn.DenseGeneral,
                              Embed=nn.Embed, LayerNorm=nn.LayerNorm, RMSNorm=nn.RMSNorm,
                              BatchNorm=nn.BatchNorm)
TAGGED = types.SimpleNamespace(**{k: getattr(kd.linen, k) for k in vars(PLAIN)})
VOCAB, WIDTH, HEADS, T = 11, 8, 2, 5


def _cnn(lib):
  class Cnn(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(lib.Conv(4, (3, 3), param_dtype=F64)(x))
      x = nn.relu(lib.Conv(6, (3, 3), strides=2, padding="VALID", param_dtype=F64)(x))
      x = nn.tanh(lib.Dense(12, param_dtype=F64)(x.reshape(x.shape[0], -1)))
      return lib.Dense(10, use_bias=False, param_dtype=F64)(x)
  return Cnn()


class TaggedAttention(nn.Module):
  """`nn.MultiHeadDotProductAttention(num_heads)` (self-attention, no mask,
  no dropout) written with `kd.linen.DenseGeneral`: the same parameter tree
  (`query`, `key`, `value`, `out`) and the same arithmetic."""

  num_heads: int

  @nn.compact
  def __call__(self, x):
    head = x.shape[-1] // self.num_heads
    project = lambda name: kd.linen.DenseGeneral((self.num_heads, head), axis=-1,
                                                 param_dtype=F64, name=name)
    y = nn.dot_product_attention(project("query")(x), project("key")(x),
                                 project("value")(x))
    return kd.linen.DenseGeneral(x.shape[-1], axis=(-2, -1), param_dtype=F64,
                                 name="out")(y)


def _transformer(lib, attention):
  class Block(nn.Module):
    attention: nn.Module         # a field, so that Flax binds it as a submodule

    @nn.compact
    def __call__(self, tokens):
      x = lib.Embed(VOCAB, WIDTH, param_dtype=F64)(tokens)
      x = x + self.attention(lib.LayerNorm(param_dtype=F64)(x))
      h = lib.LayerNorm(param_dtype=F64)(x)
      x = x + lib.Dense(WIDTH, param_dtype=F64)(nn.gelu(lib.Dense(2 * WIDTH,
                                                                  param_dtype=F64)(h)))
      return lib.Dense(VOCAB, param_dtype=F64)(lib.RMSNorm(param_dtype=F64)(x))
  return Block(attention)


def _resnet(lib, train: bool):
  class ResBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
      norm = lambda: lib.BatchNorm(use_running_average=not train, param_dtype=F64)
      h = nn.relu(norm()(lib.Conv(4, (3, 3), use_bias=False, param_dtype=F64)(x)))
      h = norm()(lib.Conv(4, (3, 3), use_bias=False, param_dtype=F64)(h))
      x = nn.relu(lib.Conv(4, (1, 1), param_dtype=F64)(x) + h)
      return lib.Dense(10, param_dtype=F64)(jnp.mean(x, axis=(1, 2)))
  return ResBlock()


def _perturbed(tree, seed=5):
  """Non-trivial scales and biases (Flax initialises them to 1 and 0)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      x + 0.2 * jax.random.normal(k, jnp.shape(x), F64) for x, k in zip(leaves, keys)])


def _problem(name: str):
  """(plain loss, kd.linen loss, params, batch): the same model both ways,
  the loss taking `(params, x, y)` (batch_stats closed over, training mode
  updating them as aux where there are any)."""
  key = jax.random.PRNGKey(0)
  if name == "transformer":
    x = jax.random.randint(key, (8, T), 0, VOCAB)
    y = jax.random.randint(jax.random.PRNGKey(1), (8, T), 0, VOCAB)
    plain = _transformer(PLAIN, nn.MultiHeadDotProductAttention(HEADS, param_dtype=F64,
                                                                name="attention"))
    tagged = _transformer(TAGGED, TaggedAttention(HEADS, name="attention"))
  else:
    x = jax.random.normal(key, (8, 7, 7, 2), F64)
    y = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, 10)
    plain, tagged = ((_cnn(PLAIN), _cnn(TAGGED)) if name == "cnn" else
                     (_resnet(PLAIN, name == "resnet_train"),
                      _resnet(TAGGED, name == "resnet_train")))
  variables = plain.init(jax.random.PRNGKey(2), x)
  params = _perturbed(variables["params"])
  extra = {k: v for k, v in variables.items() if k != "params"}

  def loss(model):
    def loss_fn(p, x, y):
      out = model.apply({"params": p, **extra}, x, mutable=list(extra) or False)
      logits = out[0] if extra else out
      return kd.losses.softmax_cross_entropy(logits, y)
    return loss_fn
  return loss(plain), loss(tagged), params, (x, y)


def _train(grad_fn, params, batch, dist=None, steps=3):
  """`steps` K-FAC updates (factors every step, eigenbases every second)."""
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, *batch), damping=0.1,
               inverse_update_every=2, factor_dtype=F64, distribution=dist)

  def step(params, state, *batch):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    if dist is not None:
      grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state

  step, state = compile_step(step, tx.init(params), dist, len(batch))
  for _ in range(steps):
    params, state = step(params, state, *batch)
  return params


def _check_capture_equal(name, plain, tagged, params, batch):
  """The intercepted plain model's layers, loss, gradients, statistics and
  K-FAC trajectory are the tagged model's."""
  got_fn = kd.value_and_grad(plain, capture="flax")
  want_fn = kd.value_and_grad(tagged)
  got_layers, want_layers = got_fn.discover(params, *batch), want_fn.discover(params, *batch)
  assert got_layers.layers == want_layers.layers and not got_layers.uncaptured
  if name == "transformer":           # the attention's four projections are captured
    assert {f"attention/{p}" for p in ("query", "key", "value", "out")} <= set(
        got_layers.names())
  helpers.assert_trees_equal(jax.jit(got_fn)(params, *batch),
                             jax.jit(want_fn)(params, *batch))
  helpers.assert_trees_equal(_train(got_fn, params, batch), _train(want_fn, params, batch))


@pytest.mark.parametrize("name", [pytest.param("cnn", marks=SLOW),
                                  pytest.param("transformer", marks=SLOW), "resnet_train",
                                  pytest.param("resnet_eval", marks=SLOW)])
def test_intercepted_equals_tagged_model(name):
  _check_capture_equal(name, *_problem(name))


def test_without_interception_plain_layers_are_not_captured():
  plain, _, params, batch = _problem("cnn")
  with pytest.raises(ValueError, match="ran no tagged layer"):
    kd.value_and_grad(plain).discover(params, *batch)
  with pytest.raises(ValueError, match="capture must be one of"):
    kd.value_and_grad(plain, capture="jaxpr")


# The interception does not depend on the owner groups: the CNN runs at both
# fractions (COMM-OPT by default), the other models at one each.
@pytest.mark.parametrize("name,fraction", [
    ("cnn", 1.0), pytest.param("cnn", 1 / 8, marks=SLOW),
    pytest.param("transformer", 1 / 8, marks=SLOW),
    pytest.param("resnet_train", 1.0, marks=SLOW)])
def test_distributed_intercepted_equals_tagged_model(name, fraction):
  """COMM-OPT and MEM-OPT on 8 devices: the intercepted model's trajectory is
  the `kd.linen` model's, bit for bit. (That a tagged model's distributed
  trajectory is the single device's is test_distributed's and
  test_layer_kinds' check; the intercepted single-device run is the tagged
  one, test_intercepted_equals_tagged_model.)"""
  plain, tagged, params, batch = _problem(name)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  batch = tuple(jnp.concatenate([b] * 2) for b in batch)     # 16 examples: 2 per device
  got = _train(kd.value_and_grad(plain, capture="flax"), params, batch, dist)
  want = _train(kd.value_and_grad(tagged), params, batch, dist)
  helpers.assert_trees_equal(got, want)


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return nn.LayerNorm(param_dtype=F64)(jnp.tanh(nn.Dense(x.shape[-1],
                                                           param_dtype=F64)(x))), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(3, param_dtype=F64)(x)


class _Unrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x, _ = _ScanBlock(name=f"block_{i}")(x)
    return nn.Dense(3, param_dtype=F64)(x)


def test_scanned_plain_model_equals_unrolled():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4), F64)
  y = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, 3)
  stacked = _perturbed(_Scanned().init(jax.random.PRNGKey(2), x)["params"])
  unrolled = {f"block_{i}": jax.tree.map(lambda a, i=i: a[i], stacked["blocks"])
              for i in range(3)} | {"Dense_0": stacked["Dense_0"]}
  loss = lambda model: (lambda p, x, y: kd.losses.softmax_cross_entropy(
      model.apply({"params": p}, x), y))
  scanned_fn = kd.value_and_grad(loss(_Scanned()), capture="flax")
  unrolled_fn = kd.value_and_grad(loss(_Unrolled()), capture="flax")
  by_name = {layer.name: layer for layer in scanned_fn.discover(stacked, x, y)}
  assert set(by_name) == {"blocks/Dense_0", "blocks/LayerNorm_0", "Dense_0"}
  assert by_name["blocks/Dense_0"].stack == (3,)
  _, grads, stats = jax.jit(scanned_fn)(stacked, x, y)
  _, ref_grads, ref_stats = jax.jit(unrolled_fn)(unrolled, x, y)
  for i in range(3):
    helpers.assert_trees_equal(jax.tree.map(lambda a, i=i: a[i], grads["blocks"]),
                               ref_grads[f"block_{i}"])
    for layer in ("Dense_0", "LayerNorm_0"):
      helpers.assert_trees_equal({k: v[i] for k, v in stats[f"blocks/{layer}"].items()},
                                 ref_stats[f"block_{i}/{layer}"])
  got, want = _train(scanned_fn, stacked, (x, y)), _train(unrolled_fn, unrolled, (x, y))
  for i in range(3):
    helpers.assert_trees_equal(jax.tree.map(lambda a, i=i: a[i], got["blocks"]),
                               want[f"block_{i}"], rtol=1e-10)


_MASK = jnp.ones((3, 3, 4, 4)).at[1, 1].set(0.0)   # a masked kernel: not tagged
_UP_MASK = jnp.ones((3, 3, 2, 4)).at[0, 2].set(0.0)


class _Unsupported(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.ConvTranspose(4, (3, 3), mask=_UP_MASK, param_dtype=F64, name="up")(x)
    x = nn.Conv(4, (3, 3), mask=_MASK, param_dtype=F64, name="masked")(x)
    x = nn.Conv(4, (3, 3), param_dtype=F64, name="plain")(x)
    x = nn.Einsum((4, 4), "...c,dc->...c", param_dtype=F64, name="mix")(x)
    x = nn.ConvLocal(4, (3, 3), padding="SAME", param_dtype=F64, name="local")(x)
    return nn.Dense(10, param_dtype=F64)(x.reshape(x.shape[0], -1))


@pytest.mark.filterwarnings("ignore:kfac_jax_dist. Conv with masked",
                            "ignore:kfac_jax_dist. ConvTranspose with masked",
                            "ignore:kfac_jax_dist. Einsum with the equation",
                            "ignore:kfac_jax_dist. Conv with a custom convolution")
def test_uncaptured_layers_are_reported_and_pass_through():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 5, 2), F64)
  y = jax.random.randint(jax.random.PRNGKey(1), (4,), 0, 10)
  model = _Unsupported()
  params = model.init(jax.random.PRNGKey(2), x)["params"]
  grad_fn = kd.value_and_grad(lambda p, x, y: kd.losses.softmax_cross_entropy(
      model.apply({"params": p}, x), y), capture="flax")
  with pytest.warns(UserWarning) as warned:
    layers = grad_fn.discover(params, x, y)
  messages = {str(w.message) for w in warned}      # each naming its module: none merged
  for where, kind in (("up", "ConvTranspose"), ("masked", "Conv"), ("mix", "Einsum")):
    assert any(m.startswith(f"kfac_jax_dist: {kind} with ") and f"not tagged (at '{where}')"
               in m for m in messages), (where, messages)
  assert layers.names() == ("plain", "Dense_0")
  reported = {u.where: (u.kind, u.reason) for u in layers.uncaptured}
  assert reported["up"] == ("ConvTranspose", "masked kernel")
  assert reported["masked"] == ("Conv", "masked kernel")
  assert reported["mix"][0] == "Einsum" and "not a Dense" in reported["mix"][1]
  assert reported["local"] == ("Conv", "a custom convolution or promote_dtype, or unshared weights")
  # their gradients are jax's; the K-FAC state passes them through and says so
  _, grads, _ = jax.jit(grad_fn)(params, x, y)
  want = jax.jit(jax.grad(lambda p: kd.losses.softmax_cross_entropy(
      model.apply({"params": p}, x), y)))(params)
  helpers.assert_trees_equal(grads, want)
  state = kd.kfac(0.1, layers=layers).init(params)
  table = kd.describe(state, print_table=False)
  assert "uncaptured" in table and "ConvTranspose" in table and "up/kernel" in table


def _doubled_kernel(*args, dtype=None, inexact=True):
  """A user's linen `promote_dtype` (here: the kernel doubled)."""
  del dtype, inexact
  out = [None if a is None else jnp.asarray(a, F64) for a in args]
  return (out[0], 2.0 * out[1], *out[2:])


@pytest.mark.skipif("promote_dtype" not in nn.Dense.__dataclass_fields__,
                    reason="this flax's layers have no promote_dtype")
def test_a_custom_promote_dtype_runs_flaxs_own_layer():
  """linen Dense / Conv and NNX Linear / Conv with a `promote_dtype` of the
  user's run Flax's own code, untagged with a warning, as the other layers
  with one do (the tagged path ignored it: another model's outputs, loss and
  statistics, also under `capture="flax"`)."""
  nnx_promote = lambda args, dtype=None: _doubled_kernel(*args)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 5, 3), F64)
  for kind, plain, tagged in (
      ("Dense", nn.Dense(4, promote_dtype=_doubled_kernel),
       kd.linen.Dense(4, promote_dtype=_doubled_kernel)),
      ("Conv", nn.Conv(4, (3, 3), promote_dtype=_doubled_kernel),
       kd.linen.Conv(4, (3, 3), promote_dtype=_doubled_kernel))):
    variables = plain.init(jax.random.PRNGKey(1), x)
    with pytest.warns(UserWarning, match=f"{kind} with .*promote_dtype.* not tagged"):
      got = tagged.apply(variables, x)
    helpers.assert_trees_equal(got, plain.apply(variables, x))
    model = nn.Sequential([plain, nn.Dense(2, param_dtype=F64)])   # one layer tagged
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    loss = lambda p, x: kd.losses.squared_error(model.apply({"params": p}, x),
                                                jnp.zeros(x.shape[:-1] + (2,)))
    with pytest.warns(UserWarning, match="promote_dtype"):
      value, _, _ = kd.value_and_grad(loss, capture="flax")(params, x)
    np.testing.assert_allclose(value, loss(params, x))
  for kind, cls, args in (("Linear", kd.nnx.Linear, (3, 4)),
                          ("Conv", kd.nnx.Conv, (3, 4, (3, 3)))):
    plain_cls = getattr(nnx, kind)
    plain = plain_cls(*args, promote_dtype=nnx_promote, param_dtype=F64, rngs=nnx.Rngs(0))
    tagged = cls(*args, promote_dtype=nnx_promote, param_dtype=F64, rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match=f"{kind} with .*promote_dtype.* not tagged"):
      got = tagged(x)
    helpers.assert_trees_equal(got, plain(x))


def test_nnx_rms_norm_takes_its_mask_positionally():
  """`kd.nnx.RMSNorm(x, mask)`, as `nnx.RMSNorm` takes it (it was keyword-only)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 6), F64)
  mask = jnp.arange(6)[None, None, :] < 4
  plain = nnx.RMSNorm(6, param_dtype=F64, rngs=nnx.Rngs(0))
  tagged = kd.nnx.RMSNorm(6, param_dtype=F64, rngs=nnx.Rngs(0))
  helpers.assert_trees_equal(tagged(x, mask), plain(x, mask))


# ---------------------------------------------------------------------------
# NNX: the same models with flax.nnx layers against kd.nnx ones.
# ---------------------------------------------------------------------------

NNX_PLAIN = types.SimpleNamespace(Linear=nnx.Linear, Conv=nnx.Conv, Embed=nnx.Embed,
                                  LayerNorm=nnx.LayerNorm, RMSNorm=nnx.RMSNorm,
                                  BatchNorm=nnx.BatchNorm)
NNX_TAGGED = types.SimpleNamespace(**{k: getattr(kd.nnx, k) for k in vars(NNX_PLAIN)})
MERGE_COPY = ({"copy": True} if "copy" in inspect.signature(nnx.merge).parameters else {})


class NnxCnn(nnx.Module):
  def __init__(self, lib, rngs):
    self.c1 = lib.Conv(2, 4, (3, 3), param_dtype=F64, rngs=rngs)
    self.c2 = lib.Conv(4, 6, (3, 3), strides=2, padding="VALID", param_dtype=F64,
                       rngs=rngs)
    self.d1 = lib.Linear(54, 12, param_dtype=F64, rngs=rngs)
    self.d2 = lib.Linear(12, 10, use_bias=False, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
    return self.d2(nnx.tanh(self.d1(x.reshape(x.shape[0], -1))))


class NnxTaggedAttention(nnx.Module):
  """`nnx.MultiHeadAttention(HEADS, WIDTH)` (self-attention, no mask, no
  dropout) with `kd.nnx.LinearGeneral` projections: the same state paths."""

  def __init__(self, rngs):
    project = lambda: kd.nnx.LinearGeneral(WIDTH, (HEADS, WIDTH // HEADS), param_dtype=F64,
                                           rngs=rngs)
    self.query, self.key, self.value = project(), project(), project()
    self.out = kd.nnx.LinearGeneral((HEADS, WIDTH // HEADS), WIDTH, axis=(-2, -1),
                                    param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.dot_product_attention(self.query(x), self.key(x), self.value(x)))


class NnxTransformer(nnx.Module):
  def __init__(self, lib, attention, rngs):
    self.embed = lib.Embed(VOCAB, WIDTH, param_dtype=F64, rngs=rngs)
    self.ln1 = lib.LayerNorm(WIDTH, param_dtype=F64, rngs=rngs)
    self.attention = attention
    self.ln2 = lib.LayerNorm(WIDTH, param_dtype=F64, rngs=rngs)
    self.up = lib.Linear(WIDTH, 2 * WIDTH, param_dtype=F64, rngs=rngs)
    self.down = lib.Linear(2 * WIDTH, WIDTH, param_dtype=F64, rngs=rngs)
    self.norm = lib.RMSNorm(WIDTH, param_dtype=F64, rngs=rngs)
    self.head = lib.Linear(WIDTH, VOCAB, param_dtype=F64, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.attention(self.ln1(x))
    x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
    return self.head(self.norm(x))


class NnxResBlock(nnx.Module):
  def __init__(self, lib, train, rngs):
    norm = lambda: lib.BatchNorm(4, use_running_average=not train, param_dtype=F64,
                                 rngs=rngs)
    self.c1 = lib.Conv(2, 4, (3, 3), use_bias=False, param_dtype=F64, rngs=rngs)
    self.n1 = norm()
    self.c2 = lib.Conv(4, 4, (3, 3), use_bias=False, param_dtype=F64, rngs=rngs)
    self.n2 = norm()
    self.skip = lib.Conv(2, 4, (1, 1), param_dtype=F64, rngs=rngs)
    self.head = lib.Linear(4, 10, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    h = self.n2(self.c2(nnx.relu(self.n1(self.c1(x)))))
    return self.head(jnp.mean(nnx.relu(self.skip(x) + h), axis=(1, 2)))


def _nnx_problem(name: str):
  """(plain loss, kd.nnx loss, params, batch) of an NNX model built both ways
  with the same state (float64, perturbed)."""
  def build(lib, attention):
    rngs = nnx.Rngs(0)
    if name == "transformer":
      return NnxTransformer(lib, attention(rngs), rngs)
    if name == "cnn":
      return NnxCnn(lib, rngs)
    return NnxResBlock(lib, name == "resnet_train", rngs)
  plain = build(NNX_PLAIN, lambda rngs: nnx.MultiHeadAttention(
      HEADS, WIDTH, decode=False, param_dtype=F64, rngs=rngs))
  tagged = build(NNX_TAGGED, NnxTaggedAttention)
  nnx.update(plain, _perturbed(nnx.state(plain, nnx.Param)))
  params = nnx.state(plain, nnx.Param)
  nnx.update(tagged, params)
  if name == "transformer":
    x = jax.random.randint(jax.random.PRNGKey(0), (8, T), 0, VOCAB)
    y = jax.random.randint(jax.random.PRNGKey(1), (8, T), 0, VOCAB)
  else:
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 7, 7, 2), F64)
    y = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, 10)

  def loss(model):
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, x, y):
      return kd.losses.softmax_cross_entropy(nnx.merge(graphdef, p, rest, **MERGE_COPY)(x), y)
    return loss_fn
  return loss(plain), loss(tagged), params, (x, y)


@pytest.mark.parametrize("name", ["cnn", pytest.param("transformer", marks=SLOW),
                                  pytest.param("resnet_train", marks=SLOW),
                                  pytest.param("resnet_eval", marks=SLOW)])
def test_nnx_intercepted_equals_tagged_model(name):
  _check_capture_equal(name, *_nnx_problem(name))
  # the classes are restored after the capture
  assert "kfac_original" not in vars(nnx.Linear.__call__)


# Each NNX model at one fraction (the transformer and the ResNet at the one
# their linen cases do not run).
@pytest.mark.parametrize("name,fraction", [("cnn", 1 / 8), ("transformer", 1.0),
                                           ("resnet_train", 1 / 8)])
@SLOW
def test_nnx_distributed_intercepted_equals_tagged_model(name, fraction):
  plain, tagged, params, batch = _nnx_problem(name)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  got = _train(kd.value_and_grad(plain, capture="flax"), params, batch, dist)
  want = _train(kd.value_and_grad(tagged), params, batch, dist)
  helpers.assert_trees_equal(got, want)


class _NnxUnsupported(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.ConvTranspose(2, 4, (3, 3), preferred_element_type=F64,
                                param_dtype=F64, rngs=rngs)
    self.custom = nnx.Conv(4, 4, (3, 3), param_dtype=F64, rngs=rngs,
                           conv_general_dilated=lambda *a, **k: lax.conv_general_dilated(*a, **k))
    self.plain = nnx.Conv(4, 4, (3, 3), param_dtype=F64, rngs=rngs)
    self.mix = nnx.Einsum("...c,dc->...c", (4, 4), param_dtype=F64, rngs=rngs)
    self.head = nnx.Linear(100, 10, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    x = self.mix(self.plain(self.custom(self.up(x))))
    return self.head(x.reshape(x.shape[0], -1))


@pytest.mark.filterwarnings("ignore:kfac_jax_dist. Conv with a custom",
                            "ignore:kfac_jax_dist. ConvTranspose with a custom",
                            "ignore:kfac_jax_dist. Einsum with the equation")
def test_nnx_uncaptured_layers_are_reported():
  model = _NnxUnsupported(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 5, 2), F64)
  y = jax.random.randint(jax.random.PRNGKey(1), (4,), 0, 10)
  grad_fn = kd.value_and_grad(lambda p, x, y: kd.losses.softmax_cross_entropy(
      nnx.merge(graphdef, p)(x), y), capture="flax")
  with pytest.warns(UserWarning, match="Conv with a custom.*not tagged"):
    layers = grad_fn.discover(params, x, y)
  assert layers.names() == ("plain", "head")
  reported = {u.where: u.kind for u in layers.uncaptured}
  assert reported == {"up": "ConvTranspose", "custom": "Conv", "mix": "Einsum"}
  _, grads, _ = grad_fn(params, x, y)
  want = jax.grad(lambda p: kd.losses.softmax_cross_entropy(nnx.merge(graphdef, p)(x),
                                                            y))(params)
  helpers.assert_trees_equal(grads, want)
  table = kd.describe(kd.kfac(0.1, layers=layers).init(params), print_table=False)
  uncaptured = {r[2] for r in (line.split() for line in table.splitlines())
                if r[:2] == ["-", "uncaptured"]}
  assert uncaptured == {"up/kernel", "up/bias", "custom/kernel", "custom/bias",
                        "mix/kernel"}
  assert "Uncaptured layer up (ConvTranspose" in table


class _NnxScanned(nnx.Module):
  """Blocks created by `nnx.vmap` and applied by `nnx.scan`, of `lib`'s layers."""

  def __init__(self, lib, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> nnx.Module:
      block = nnx.Module()
      block.lin = lib.Linear(4, 4, param_dtype=F64, rngs=rngs)
      block.ln = lib.LayerNorm(4, param_dtype=F64, rngs=rngs)
      return block

    self.blocks = create(rngs)
    self.out = lib.Linear(4, 3, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x: jax.Array, block: nnx.Module) -> jax.Array:
      return block.ln(jnp.tanh(block.lin(x)))

    return self.out(body(x, self.blocks))


@SLOW
def test_nnx_scanned_plain_model_equals_tagged():
  """Per-block statistics of a scanned plain NNX model are those of the same
  model with kd.nnx layers (test_scan checks that against the unrolled one)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4), F64)
  y = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, 3)
  graphs, params = [], None
  for lib in (NNX_PLAIN, NNX_TAGGED):
    graph, state = nnx.split(_NnxScanned(lib, nnx.Rngs(0)), nnx.Param)
    params = _perturbed(state) if params is None else params
    graphs.append(graph)
  loss = lambda graph: (lambda p, x, y: kd.losses.softmax_cross_entropy(
      nnx.merge(graph, p)(x), y))
  got_fn = kd.value_and_grad(loss(graphs[0]), capture="flax")
  want_fn = kd.value_and_grad(loss(graphs[1]))
  layers = {l.name: l for l in got_fn.discover(params, x, y)}
  assert set(layers) == {"blocks/lin", "blocks/ln", "out"}
  assert layers["blocks/lin"].stack == (3,) and layers["blocks/ln"].stack == (3,)
  got, want = jax.jit(got_fn)(params, x, y), jax.jit(want_fn)(params, x, y)
  helpers.assert_trees_equal(got, want)
  helpers.assert_trees_equal(_train(got_fn, params, (x, y)),
                             _train(want_fn, params, (x, y)))


class _StandardizedDense(nn.Dense):
  """A weight-standardised Dense layer (BiT's StdConv, as big_vision writes
  it): its `param` returns the kernel standardised per output unit."""

  def param(self, name, *args, **kwargs):
    p = super().param(name, *args, **kwargs)
    return (p - p.mean(0)) / p.std(0) if name == "kernel" else p


class _TransposedDense(nn.Dense):
  """A Dense layer storing its kernel in PyTorch's `[out, in]` layout."""

  def param(self, name, init, shape, *args):
    if name != "kernel":
      return super().param(name, init, shape, *args)
    return super().param(name, lambda k, s, *a: init(k, s[::-1], *a).T, shape[::-1],
                         *args).T


def test_a_kernel_stored_transposed_is_refused_naming_the_cause():
  x, y = jax.random.normal(jax.random.PRNGKey(0), (8, 5)), jnp.arange(8) % 3
  model = _TransposedDense(3)
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  loss = lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply({"params": p}, x), y)
  with pytest.raises(ValueError, match=r"\(3, 5\), which does not end with the shape "
                                       r"\(5, 3\).*transposed or reshaped"):
    kd.value_and_grad(loss, capture="flax").discover(params, x, y)


@pytest.mark.parametrize("first", ["weight_norm", "standardized", "plain", "cast"])
def test_a_kernel_computed_from_its_parameter_is_warned_about(first):
  """A layer applying a kernel computed from its parameter (nn.WeightNorm, a
  `param` override) is followed to that parameter, whose gradient its
  factors then precondition without the map's Jacobian: warned about at
  discovery, naming the layer; its name leaves it out with `skip=`. A cast of
  the parameters (mixed precision) is followed silently."""
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 5))
  y = jnp.arange(8) % 3
  layer = {"weight_norm": lambda: nn.WeightNorm(nn.Dense(6)),
           "standardized": lambda: _StandardizedDense(6)}.get(first, lambda: nn.Dense(6))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="head")(jnp.tanh(layer()(x)))
  params = Model().init(jax.random.PRNGKey(1), x)["params"]

  def loss(p, x, y):
    if first == "cast":
      p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    return kd.losses.softmax_cross_entropy(Model().apply({"params": p}, x), y)
  grad_fn = kd.value_and_grad(loss, capture="flax")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layers = grad_fn.discover(params, x, y)
  warned = [str(w.message) for w in caught if "kernel computed from" in str(w.message)]
  if first in ("plain", "cast"):
    assert not warned
    return
  name = next(l.name for l in layers if l.name != "head")
  assert len(warned) == 1 and f"layer '{name}'" in warned[0], warned
  tx = kd.kfac(0.1, layers=layers, skip=[f"^{name}$"])
  state = tx.init(params)
  _, grads, stats = grad_fn(params, x, y, opt_state=state)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  skipped = next(l for l in layers if l.name == name).kernel_path
  leaf = lambda tree: registry.leaves_by_path(tree)[skipped]
  np.testing.assert_allclose(leaf(updates), -0.1 * leaf(grads), rtol=1e-6)


class _MergedLoraDense(nn.Dense):
  """A Dense layer applying `kernel + a b` (LoRA merged into the kernel)."""

  def param(self, name, *args, **kwargs):
    p = super().param(name, *args, **kwargs)
    if name != "kernel":
      return p
    a = super().param("lora_a", nn.initializers.normal(0.3), (p.shape[0], 2))
    return p + a @ super().param("lora_b", nn.initializers.normal(0.3), (2, p.shape[1]))


def test_a_kernel_of_parameters_passed_apart_runs_untagged_and_reported():
  """Adapters trained, the base kernel frozen in another argument: the kernel
  depends on the parameters but is none of their leaves. The layer runs
  Flax's code untagged, warned and reported as uncaptured (it was refused),
  and the adapters pass through K-FAC unpreconditioned: the chain's SGD."""
  x, y = jax.random.normal(jax.random.PRNGKey(0), (8, 5)), jnp.arange(8) % 3
  model = _MergedLoraDense(3, use_bias=False)
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  adapters = {k: params[k] for k in ("lora_a", "lora_b")}
  adapters["skip"] = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (5, 3))

  def loss(adapters, base, x, y):
    lora = {k: adapters[k] for k in ("lora_a", "lora_b")}
    logits = model.apply({"params": {**lora, "kernel": base}}, x)
    return kd.losses.softmax_cross_entropy(logits + kd.tags.dense(x, adapters["skip"]), y)
  grad_fn = kd.value_and_grad(loss, capture="flax")
  with pytest.warns(UserWarning, match="Flax layer '_MergedLoraDense' is not tagged: its "
                                       "kernel computed from parameters"):
    layers = grad_fn.discover(adapters, params["kernel"], x, y)
  assert layers.names() == ("skip",)
  assert [u.where for u in layers.uncaptured] == ["_MergedLoraDense"]
  tx = kd.kfac(0.1, momentum=0.0, layers=layers)
  state = tx.init(adapters)
  with pytest.warns(UserWarning, match="is not tagged"):
    _, grads, stats = grad_fn(adapters, params["kernel"], x, y, opt_state=state)
  updates, _ = tx.update(grads, state, adapters, kfac_stats=stats)
  for name in ("lora_a", "lora_b"):
    np.testing.assert_allclose(updates[name], -0.1 * grads[name], rtol=1e-6)


class _TiedByApply(nn.Module):
  """An LM whose head applies a Dense module to the embedding's transpose, as
  Hugging Face's Flax models tie it (`lm_head.apply({"params": {"kernel":
  wte.T}}, h)`), or (`attend`) with `Embed.attend`: the same function."""
  attend: bool = False

  def setup(self):
    self.wte = nn.Embed(20, 6, param_dtype=F64)
    self.mix = nn.Dense(6, param_dtype=F64)
    self.lm_head = nn.Dense(20, use_bias=False, param_dtype=F64)

  def __call__(self, ids):
    h = jnp.tanh(self.mix(self.wte(ids)))
    if self.attend:
      return self.wte.attend(h)
    return self.lm_head.apply({"params": {"kernel": self.wte.variables["params"]
                                          ["embedding"].T}}, h)


def test_a_tied_head_applied_by_another_module_is_the_attend_form():
  """Hugging Face's tied heads (GPT-2, BERT-MLM, T5, ... with
  `tie_word_embeddings`) made discovery raise: the head now runs untagged,
  reported, and three K-FAC steps equal those of the `Embed.attend` form of
  the same model (the table preconditioned by its lookup's factors)."""
  ids = jax.random.randint(jax.random.PRNGKey(0), (4, 6), 0, 20)
  params = _TiedByApply().init(jax.random.PRNGKey(1), ids)["params"]
  runs = []
  for attend in (False, True):
    model = _TiedByApply(attend)
    grad_fn = kd.value_and_grad(lambda p, ids: kd.losses.softmax_cross_entropy(
        model.apply({"params": p}, ids), ids), capture="flax")
    with warnings.catch_warnings(record=True) as warned:
      warnings.simplefilter("always")
      layers = grad_fn.discover(params, ids)
    assert layers.names() == ("wte", "mix")
    assert [u.where for u in layers.uncaptured] == ([] if attend else ["Dense"])
    assert any("is not tagged" in str(w.message) for w in warned) != attend
    tx = kd.kfac(0.1, layers=layers, factor_dtype=F64)
    state, p = tx.init(params), params
    for _ in range(3):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, grads, stats = grad_fn(p, ids, opt_state=state)
      updates, state = tx.update(grads, state, p, kfac_stats=stats)
      p = optax.apply_updates(p, updates)
    runs.append(p)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10), *runs)
