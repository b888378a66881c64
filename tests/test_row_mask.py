"""Row masks (`kd.tags.row_mask`): padded rows left out of the curvature.

Sequences padded to one length, examples padded to a fixed batch: without a
mask every row a layer multiplies is an example of its `A`. Under the mask a
layer's `A` is the mean over the kept rows of the whole global batch and the
left-out rows add nothing to `G`, `F` (or EK-FAC's `S`). Oracles: float64
numpy constructions of every layer kind's statistics from the kept rows (a
layer's output cotangents from zero perturbations added to its output, in a
tag-free copy of the model), and the single-device run of the whole batch
for the distributed and micro-batched ones.
"""

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import kfac_jax_dist as kd

import helpers

pytestmark = pytest.mark.usefixtures("x64_module")

B, T, V, D, H, C = 4, 6, 9, 3, 4, 3
DAMPING = 1e-2


def _params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  w = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]))
  return {"emb": {"table": w(V, D)},
          "d1": {"kernel": w(D, H), "bias": w(H)},
          "conv": {"kernel": w(3, H, H) / np.sqrt(3), "bias": w(H)},
          "ln": {"scale": 1 + w(H), "offset": w(H)},
          "dg": {"kernel": w(H, 2, 2), "bias": w(2, 2)},
          "out": {"kernel": w(4, C), "bias": w(C)},
          "head": {"kernel": w(H, C), "bias": w(C)}}


def _model(p: dict, ids: jax.Array, mask: jax.Array, eps: dict | None = None) -> jax.Array:
  """Token logits `[B, T, C]`: embedding, dense, a 1-D convolution over the
  tokens (so a padded token's input reaches real tokens), scale-and-shift, a
  two-axis dense_general, the output layer, plus a head on the masked mean
  of the tokens (`[B, H]` rows, which a `[B, T]` mask does not mask).
  `eps`: zero perturbations added to each layer's output (the oracle's
  cotangents), tag-free; None: the tagged model."""
  tagged = eps is None
  e = (lambda name: 0.0) if tagged else eps.__getitem__
  h = (kd.tags.embed(ids, p["emb"]["table"]) if tagged
       else jnp.take(p["emb"]["table"], ids, axis=0)) + e("emb")
  dense = kd.tags.dense if tagged else (lambda x, k, b: x @ k + b)
  h = jnp.tanh(dense(h, p["d1"]["kernel"], p["d1"]["bias"]) + e("d1"))
  if tagged:
    s = kd.tags.conv1d(h, p["conv"]["kernel"], p["conv"]["bias"], padding="SAME")
  else:
    s = jax.lax.conv_general_dilated(h, p["conv"]["kernel"], (1,), "SAME",
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    s = s + p["conv"]["bias"]
  h = jnp.tanh(s + e("conv"))
  h = ((kd.tags.scale_and_shift(h, p["ln"]["scale"], p["ln"]["offset"]) if tagged
        else h * p["ln"]["scale"] + p["ln"]["offset"]) + e("ln"))
  if tagged:
    z = kd.tags.dense_general(h, p["dg"]["kernel"], p["dg"]["bias"])
  else:
    z = jnp.einsum("bth,hij->btij", h, p["dg"]["kernel"]) + p["dg"]["bias"]
  z = jnp.tanh(z + e("dg")).reshape(z.shape[:2] + (4,))
  logits = dense(z, p["out"]["kernel"], p["out"]["bias"]) + e("out")
  weights = mask.astype(h.dtype)[..., None]
  pooled = jnp.sum(h * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1)
  head = dense(pooled, p["head"]["kernel"], p["head"]["bias"]) + e("head")
  return logits + head[:, None, :]


def _loss(p: dict, ids: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
  with kd.tags.row_mask(mask):
    logits = _model(p, ids, mask)
  return kd.losses.softmax_cross_entropy(logits, y, mask=mask)


def _batch(seed: int, batch: int = B) -> tuple:
  rng = np.random.default_rng(50 + seed)
  ids = jnp.asarray(rng.integers(0, V, size=(batch, T)))
  y = jnp.asarray(rng.integers(0, C, size=(batch, T)))
  lengths = rng.integers(1, T + 1, size=batch)
  mask = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])   # right-padded
  return ids, y, mask


def _with_one(rows: np.ndarray) -> np.ndarray:
  return np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)


def _oracle(p: dict, ids, y, mask) -> dict:
  """Every layer's statistics from the kept rows, in float64: `A` the mean
  of `a aᵀ` over them (a `[B, H]` head over every sequence), `G = (1/n) Σ g
  gᵀ` over them, `g` the per-example gradient `n ∂L/∂s` of the layer's
  output `s`, and the unit-wise `F` of the scale-and-shift layer."""
  ids, y, m = np.asarray(ids), np.asarray(y), np.asarray(mask)
  n = m.sum()

  def loss(eps):
    logits = _model(p, ids, jnp.asarray(m), eps)
    logp = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(logp, jnp.asarray(y)[..., None], axis=-1)[..., 0]
    return -jnp.sum(picked * m) / n

  names = ("emb", "d1", "conv", "ln", "dg", "out", "head")
  shapes = {"emb": (B, T, D), "d1": (B, T, H), "conv": (B, T, H), "ln": (B, T, H),
            "dg": (B, T, 2, 2), "out": (B, T, C), "head": (B, C)}
  zeros = {k: jnp.zeros(shapes[k]) for k in names}
  g = {k: np.asarray(v) * n for k, v in jax.grad(loss)(zeros).items()}

  # The layers' inputs, recomputed tag-free.
  x_emb = np.take(np.asarray(p["emb"]["table"]), ids, axis=0)
  h1 = np.tanh(x_emb @ np.asarray(p["d1"]["kernel"]) + np.asarray(p["d1"]["bias"]))
  padded = np.pad(h1, ((0, 0), (1, 1), (0, 0)))
  patches = np.stack([padded[:, t:t + 3].reshape(B, -1) for t in range(T)], axis=1)
  s = patches @ np.asarray(p["conv"]["kernel"]).reshape(-1, H) + np.asarray(p["conv"]["bias"])
  h2 = np.tanh(s)
  h3 = h2 * np.asarray(p["ln"]["scale"]) + np.asarray(p["ln"]["offset"])
  z = np.tanh(np.einsum("bth,hij->btij", h3, np.asarray(p["dg"]["kernel"]))
              + np.asarray(p["dg"]["bias"])).reshape(B, T, 4)
  w = m[..., None]
  pooled = (h3 * w).sum(1) / np.maximum(w.sum(1), 1)

  def kept(a):
    return a[m].reshape(n, -1)

  def dense(a_rows, g_rows):
    a = _with_one(a_rows)
    return {"A": a.T @ a / a.shape[0], "G": g_rows.T @ g_rows / n}

  freq = np.bincount(ids[m], minlength=V) / n
  ge = kept(g["emb"])
  gl = kept(g["ln"])
  ug, ub = kept(h2) * gl, gl
  return {"emb": {"A": freq, "G": ge.T @ ge / n},
          "d1": dense(kept(x_emb), kept(g["d1"])),
          "conv": dense(kept(patches), kept(g["conv"])),
          "ln": {"F": np.stack([(ug * ug).sum(0), (ug * ub).sum(0), (ub * ub).sum(0)],
                               axis=1) / n},
          "dg": dense(kept(h3), kept(g["dg"])),
          "out": dense(kept(z), kept(g["out"])),
          "head": dense(pooled, g["head"])}


def test_every_layer_kind_leaves_the_masked_rows_out():
  """Embedding, dense, 1-D convolution, scale-and-shift, dense_general and a
  pooled head: the statistics under a `[B, T]` mask of right-padded
  sequences equal the kept rows' (the head's rows, sequences, all kept),
  and the loss and gradients are those of the masked loss alone."""
  params, (ids, y, mask) = _params(), _batch(0)
  grad_fn = kd.value_and_grad(_loss)
  layers = {layer.name: layer for layer in grad_fn.discover(params, ids, y, mask).layers}
  assert {name for name, l in layers.items() if l.row_masked} == {
      "emb", "d1", "conv", "ln", "dg", "out"}      # not the head
  loss, grads, stats = jax.jit(grad_fn)(params, ids, y, mask)
  want = _oracle(params, ids, y, mask)
  for name, layer in want.items():
    for key, value in layer.items():
      np.testing.assert_allclose(stats[name][key], value, rtol=1e-12, atol=1e-14,
                                 err_msg=f"{name} {key}")
  plain = lambda p: kd.losses.softmax_cross_entropy(_model(p, ids, mask), y, mask=mask)
  want_loss, want_grads = jax.value_and_grad(plain)(params)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
  helpers.assert_trees_equal(grads, want_grads, rtol=1e-12)
  assert int(stats["d1"]["positions"]) == int(np.asarray(mask).sum())


def _kfac(grad_fn, params, batch, **kwargs):
  return kd.kfac(0.1, damping=DAMPING, layers=grad_fn.discover(params, *batch),
                 factor_dtype=jnp.float64, **kwargs)


def _single_device_run(batches, micro_batches: int = 1, learn: bool = True, **kwargs):
  params, grad_fn = _params(), kd.value_and_grad(_loss)
  tx = _kfac(grad_fn, params, batches[0], **kwargs)
  state = tx.init(params)

  @jax.jit
  def step(params, state, *batch):
    if micro_batches == 1:
      _, grads, stats = grad_fn(params, *batch, opt_state=state)
    else:
      _, grads, stats = grad_fn.accumulate(params, *batch, micro_batches=micro_batches,
                                           opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates) if learn else params, state
  for batch in batches:
    params, state = step(params, state, *batch)
  return params, state


def _uneven_batches(steps: int = 2) -> list:
  """Global batches of 16 sequences whose device shards (2 each on 8
  devices) keep different numbers of tokens, one shard nothing at all."""
  out = []
  for t in range(steps):
    ids, y, mask = _batch(t, 16)
    mask = np.asarray(mask).copy()
    mask[2 * (t + 1):2 * (t + 2)] = False          # one device's whole shard
    out.append((ids, y, jnp.asarray(mask)))
  return out


@pytest.mark.parametrize("fraction, factor_reduction, options", helpers.slow_unless([
    (1.0, "reduce_scatter", {}),                                    # COMM-OPT
    (1 / 8, "all_reduce", {}),                                      # MEM-OPT
    (1 / 4, "reduce_scatter", {}),                                  # HYBRID
    (1.0, "reduce_scatter", {"eigenvalue_correction": "ekfac"}),
    (1 / 8, "reduce_scatter", {"stale_threshold": 0.1})],
    [(1.0, "reduce_scatter", {}), (1 / 8, "all_reduce", {})]))      # (CI time)
def test_eight_devices_with_uneven_masks_equal_one_device(fraction, factor_reduction,
                                                          options):
  """Devices keeping different numbers of rows (one none): each layer's `A`
  is the mean over every kept row of the global batch, as one device's run
  of the whole batch, over two steps (parameters and running factors); with
  EK-FAC's scaling and stale statistics too."""
  batches = _uneven_batches()
  want_params, want_state = _single_device_run(batches, **options)
  params, grad_fn = _params(), kd.value_and_grad(_loss)
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction, gradient_reduction="all_reduce")
  tx = _kfac(grad_fn, params, batches[0], distribution=dist, **options)
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(params, state, *batch):
    _, grads, stats = grad_fn(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs) + (P("data"),) * 3,
                               out_specs=(P(), specs)))
  for batch in batches:
    params, state = step(params, state, *batch)
  helpers.assert_trees_equal(params, want_params, rtol=1e-10)
  got = kd.running_factors(state)
  for name, factors in kd.running_factors(want_state).items():
    for key, value in factors.items():
      np.testing.assert_allclose(got[name][key], value, rtol=1e-10, atol=1e-13,
                                 err_msg=f"{name} {key}")


def test_micro_batches_with_uneven_masks_equal_the_whole_batch():
  """`accumulate` over 8 slices keeping different numbers of rows (one
  none) gives the whole batch's statistics and steps."""
  batches = _uneven_batches()
  want_params, _ = _single_device_run(batches)
  params, _ = _single_device_run(batches, micro_batches=8)
  helpers.assert_trees_equal(params, want_params, rtol=1e-10)
  grad_fn = kd.value_and_grad(_loss)
  _, _, whole = jax.jit(grad_fn)(_params(), *batches[0])
  _, _, sliced = jax.jit(lambda p, *b: grad_fn.accumulate(p, *b, micro_batches=8))(
      _params(), *batches[0])
  helpers.assert_trees_equal(sliced, whole, rtol=1e-11)


def test_a_pass_that_keeps_no_row_leaves_the_factors():
  """An all-padding batch: the masked layers keep their running factors
  (the scale-and-shift layer's `F` too) and running weights (a later batch
  is averaged in as the second pass's), the pooled head takes the batch.
  Parameters held fixed."""
  first = _batch(0)
  ids, y, mask = _batch(1)
  empty = (ids, y, jnp.zeros_like(mask))
  factors = lambda batches: kd.running_factors(_single_device_run(batches, learn=False)[1])
  got, had = factors([first, empty]), factors([first])
  for name in ("emb", "d1", "conv", "ln", "dg", "out"):
    helpers.assert_trees_equal(got[name], had[name], rtol=0)
  assert not np.allclose(got["head"]["A"], had["head"]["A"])
  third, second = factors([first, empty, first]), factors([first, first])
  for name in ("emb", "d1", "conv", "ln", "dg", "out"):
    helpers.assert_trees_equal(third[name], second[name], rtol=1e-12)
  described = kd.describe(_single_device_run([first], learn=False)[1], print_table=False)
  assert ("6 layers run under a row mask (kd.tags.row_mask: emb, d1, conv, ln, dg, out)"
          in described)


def test_a_mask_no_layer_takes_is_refused():
  """A transposed mask, `layers=` that name no layer, a bare string for
  `layers`: clear errors at discovery (at entry for the string)."""
  params, (ids, y, mask) = _params(), _batch(0)

  def transposed(p, ids, y, mask):
    with kd.tags.row_mask(mask.T):
      logits = _model(p, ids, mask)
    return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
  with pytest.raises(ValueError, match=r"row_mask of shape \(6, 4\) masked no tagged layer"):
    kd.value_and_grad(transposed).discover(params, ids, y, mask)

  def unnamed(p, ids, y, mask):
    with kd.tags.row_mask(mask, layers=["encoder"]):
      logits = _model(p, ids, mask)
    return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
  with pytest.raises(ValueError, match=r"for layers \['encoder'\] masked no tagged layer"):
    kd.value_and_grad(unnamed).discover(params, ids, y, mask)
  with pytest.raises(TypeError, match="sequence of regular expressions"):
    with kd.tags.row_mask(mask, layers="encoder"):
      pass


def test_a_mask_inside_k_fac_reduce_examples_is_refused():
  """A `[B, T]` mask on a layer reducing each sequence first
  (`example_dims=1`) would average padding into its inputs: refused, naming
  the layer; a `[B]` mask over its examples is taken."""
  rng = np.random.default_rng(3)
  kernel, x = jnp.asarray(rng.normal(size=(D, C))), jnp.asarray(rng.normal(size=(B, T, D)))
  y = jnp.asarray(rng.integers(0, C, size=(B,)))

  def loss(kernel, x, y, mask):
    with kd.tags.row_mask(mask):
      h = kd.tags.dense(x, kernel, name="pool", example_dims=1)
    return kd.losses.softmax_cross_entropy(h.mean(1), y)
  grad_fn = kd.value_and_grad(loss)
  with pytest.raises(ValueError, match=r"tagged layer 'pool' \(dense, example_dims=1\)"):
    grad_fn.discover(kernel, x, y, jnp.ones((B, T), bool))
  keep = jnp.asarray([True, False, True, True])
  _, _, stats = jax.jit(grad_fn)(kernel, x, y, keep)
  means = np.asarray(x).mean(1)[np.asarray(keep)]
  np.testing.assert_allclose(stats["pool"]["A"], means.T @ means / 3, rtol=1e-12)


def test_flax_layers_under_a_mask_of_padded_examples():
  """`kd.linen` layers (a CNN) under a `[B]` mask of padded images: the
  statistics equal those of the batch without the padded images."""
  model = helpers.ConvDenseNet()
  x, labels = helpers.image_batch((6, 8, 8, 3))
  params = model.init(jax.random.PRNGKey(0), x)
  keep = jnp.asarray([True, True, False, True, False, True])

  def masked(p, x, labels, keep):
    with kd.tags.row_mask(keep):
      logits = model.apply(p, x)
    return kd.losses.softmax_cross_entropy(logits, labels, mask=keep)

  def plain(p, x, labels):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), labels)
  _check_unpadded(masked, plain, params, (x, labels), keep, rtol=1e-11)


def _check_unpadded(masked, unpadded, params, batch: tuple, keep, rtol: float) -> None:
  """`masked(params, *batch, keep)`'s gradients and statistics equal
  `unpadded(params, *batch)`'s on the kept examples alone."""
  _, grads, stats = jax.jit(kd.value_and_grad(masked))(params, *batch, keep)
  index = np.flatnonzero(np.asarray(keep))
  _, want_grads, want = jax.jit(kd.value_and_grad(unpadded))(
      params, *(b[index] for b in batch))
  helpers.assert_trees_equal(grads, want_grads, rtol=rtol)
  for name, layer in want.items():
    for key, value in layer.items():
      np.testing.assert_allclose(stats[name][key], value, rtol=rtol, atol=rtol * 1e-3,
                                 err_msg=f"{name} {key}")


def test_a_state_from_before_the_mask_converts(tmp_path):
  """A run that adds `row_mask` later: its checkpoint restores into the old
  template and `convert_state` moves it into the masked one, each masked
  layer's running weight the old state's (every pass ran it): the state a
  masked run keeping every row would have; and back."""
  params, batch = _params(), _batch(0)

  def unmasked(p, ids, y, mask):
    return kd.losses.softmax_cross_entropy(_model(p, ids, mask), y, mask=mask)

  def trained(loss, mask):
    grad_fn = kd.value_and_grad(loss)
    tx = kd.scale_by_kfac(layers=grad_fn.discover(params, *batch), factor_dtype=jnp.float64)

    @jax.jit
    def step(state, ids, y, mask):
      _, grads, stats = grad_fn(params, ids, y, mask, opt_state=state)
      return tx.update(grads, state, params, kfac_stats=stats)[1]
    state = tx.init(params)
    for t in range(2):
      ids, y, _ = _batch(t)
      state = step(state, ids, y, mask)
    return tx, state
  every = jnp.ones((B, T), bool)
  old_tx, old = trained(unmasked, every)
  new_tx, want = trained(_loss, every)
  kd.save_checkpoint(tmp_path / "ckpt", {"opt_state": old})
  restored = kd.restore_checkpoint(tmp_path / "ckpt",
                                   {"opt_state": jax.eval_shape(old_tx.init, params)})
  moved = kd.convert_state(restored["opt_state"], new_tx.init(params))
  np.testing.assert_array_equal(moved.marked_weight, np.full(6, float(old.factor_weight)))
  back = kd.convert_state(want, old_tx.init(params))
  assert back.marked_weight is None
  # the eigenbases from factors equal to rounding (the masked path sums A
  # over its kept rows, then divides): equal to 1e-10
  for got, desired in ((moved, want), (back, old)):
    helpers.assert_trees_equal(kd.running_factors(got), kd.running_factors(desired),
                               rtol=1e-12)
    helpers.assert_trees_equal((got.factor_weight, got.marked_weight, got.count),
                               (desired.factor_weight, desired.marked_weight,
                                desired.count), rtol=1e-12)
    np.testing.assert_allclose(got.second_order, desired.second_order, atol=1e-10)


def test_statistics_counted_otherwise_than_the_state_are_refused():
  """A mask passed on some calls only: the state built from a discovery
  without it, the statistics of a call with it (which count the kept rows,
  to be weighted over the devices) are refused, not averaged as if unmasked;
  and the reverse."""
  params, (ids, y, mask) = _params(), _batch(0)

  def optional(p, ids, y, mask=None):
    if mask is None:
      return kd.losses.softmax_cross_entropy(_model(p, ids, jnp.ones_like(y, bool)), y)
    return _loss(p, ids, y, mask)
  grad_fn = kd.value_and_grad(optional)
  for built_with, stepped_with in (((ids, y), (ids, y, mask)), ((ids, y, mask), (ids, y))):
    tx = kd.scale_by_kfac(layers=grad_fn.discover(params, *built_with))
    state = tx.init(params)
    _, grads, stats = grad_fn(params, *stepped_with, opt_state=state)
    refused = r"kfac_stats\['emb'\] (does not )?counts? the layer's"
    with pytest.raises(ValueError, match=refused):
      tx.update(grads, state, params, kfac_stats=stats)


def _per_example(p: dict, ids: jax.Array) -> jax.Array:
  """One sequence's token logits `[T, C]` (written per example, vmapped)."""
  h = jnp.tanh(kd.tags.dense(kd.tags.embed(ids, p["emb"]["table"]), p["d1"]["kernel"],
                             p["d1"]["bias"]))
  return kd.tags.dense(h, p["head"]["kernel"], p["head"]["bias"])


def test_a_mask_outside_a_vmap_is_refused_inside_taken():
  """A model written per example under `jax.vmap`: a `[B]` mask of padded
  examples entered outside the vmap has the shape of the tags' `[T]`
  positions there (B = T), so it is refused; entered inside, one scalar per
  example, it leaves the padded examples out (the unpadded batch's
  statistics)."""
  params = _params()
  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(0, V, size=(T, T)))         # B = T
  y = jnp.asarray(rng.integers(0, C, size=(T, T)))
  keep = jnp.asarray([True, False, True, True, False, True])

  def outside(p, ids, y, keep):
    with kd.tags.row_mask(keep):
      logits = jax.vmap(_per_example, in_axes=(None, 0))(p, ids)
    return kd.losses.softmax_cross_entropy(logits, y, mask=keep[:, None])

  def inside(p, ids, y, keep):
    def one(ids, kept):
      with kd.tags.row_mask(kept):
        return _per_example(p, ids)
    logits = jax.vmap(one)(ids, keep)
    return kd.losses.softmax_cross_entropy(logits, y, mask=keep[:, None])

  def unpadded(p, ids, y):
    return kd.losses.softmax_cross_entropy(jax.vmap(_per_example, in_axes=(None, 0))(p, ids),
                                           y)
  with pytest.raises(ValueError, match=r"entered outside a jax.vmap .* tagged layer 'emb'"):
    kd.value_and_grad(outside).discover(params, ids, y, keep)
  _check_unpadded(inside, unpadded, params, (ids, y), keep, rtol=1e-12)


def test_layers_give_an_encoder_its_own_mask():
  """An encoder and a decoder over sequences of equal length (S = T): each
  mask names its layers (`layers=`), so the decoder's padding does not mask
  the encoder's rows; each layer's `A` is its own kept rows'."""
  rng = np.random.default_rng(5)
  w = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]))
  params = {"encoder": {"kernel": w(D, H), "bias": w(H)},
            "decoder_in": {"kernel": w(D, H), "bias": w(H)},
            "decoder_out": {"kernel": w(H, C), "bias": w(C)}}
  src, tgt = (jnp.asarray(rng.normal(size=(B, T, D))) for _ in range(2))
  y = jnp.asarray(rng.integers(0, C, size=(B, T)))
  src_keep = np.arange(T)[None] < np.asarray([6, 2, 4, 5])[:, None]
  tgt_keep = np.arange(T)[None] < np.asarray([3, 6, 1, 4])[:, None]

  def loss(p, src, tgt, y, src_keep, tgt_keep):
    layer = lambda x, name: kd.tags.dense(x, p[name]["kernel"], p[name]["bias"])
    with kd.tags.row_mask(src_keep, layers=["^encoder"]), \
         kd.tags.row_mask(tgt_keep, layers=["^decoder"]):
      memory = jnp.tanh(layer(src, "encoder"))
      context = jnp.sum(memory * src_keep[..., None], axis=1, keepdims=True)
      logits = layer(jnp.tanh(layer(tgt, "decoder_in") + context), "decoder_out")
    return kd.losses.softmax_cross_entropy(logits, y, mask=tgt_keep)
  _, _, stats = jax.jit(kd.value_and_grad(loss))(params, src, tgt, y, jnp.asarray(src_keep),
                                                 jnp.asarray(tgt_keep))
  p = jax.tree.map(np.asarray, params)
  memory = np.tanh(np.asarray(src) @ p["encoder"]["kernel"] + p["encoder"]["bias"])
  context = (memory * src_keep[..., None]).sum(1, keepdims=True)
  h = np.tanh(np.asarray(tgt) @ p["decoder_in"]["kernel"] + p["decoder_in"]["bias"] + context)
  for name, rows in (("encoder", np.asarray(src)[src_keep]),
                     ("decoder_in", np.asarray(tgt)[tgt_keep]), ("decoder_out", h[tgt_keep])):
    a = _with_one(rows)
    np.testing.assert_allclose(stats[name]["A"], a.T @ a / len(a), rtol=1e-12, err_msg=name)


def _encoder_decoder():
  """A shared embedding, an encoder layer, a decoder's query and its
  cross-attention's key and value on the encoder's memory (rows: source
  positions), and the output layer; sources of `S` tokens, targets of `T`."""
  rng = np.random.default_rng(6)
  w = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]))
  params = {"emb": {"table": w(V, D)}, "encoder": {"kernel": w(D, H), "bias": w(H)},
            "decoder": {"query": {"kernel": w(D, H), "bias": w(H)},
                        "cross": {"key": {"kernel": w(H, H), "bias": w(H)},
                                  "value": {"kernel": w(H, H), "bias": w(H)}},
                        "out": {"kernel": w(H, C), "bias": w(C)}}}

  def encode(p, src):
    return jnp.tanh(kd.tags.dense(kd.tags.embed(src, p["emb"]["table"]),
                                  p["encoder"]["kernel"], p["encoder"]["bias"]))

  def decode(p, tgt, memory, src_keep):
    d = p["decoder"]
    layer = lambda x, q: kd.tags.dense(x, q["kernel"], q["bias"])
    q = layer(kd.tags.embed(tgt, p["emb"]["table"]), d["query"])
    k, v = layer(memory, d["cross"]["key"]), layer(memory, d["cross"]["value"])
    scores = jnp.where(src_keep[:, None, :], jnp.einsum("bth,bsh->bts", q, k), -1e9)
    return layer(jnp.einsum("bts,bsh->bth", jax.nn.softmax(scores), v), d["out"])
  return params, encode, decode


@pytest.mark.parametrize("source_length", [T, T + 2])
def test_cross_attention_and_a_shared_embedding_take_their_own_sequences_masks(
    source_length):
  """An encoder-decoder (docs/concepts.md, 'Which mask'): each pass under its
  own sequence's mask, the cross-attention's keys and values (in the decoder,
  on the encoder's positions) named in the source's. Every `A` is the mean
  over its own sequence's kept rows, the shared embedding's over both
  sequences' kept tokens. The same masks entered by where layers sit leave
  the keys and values unmasked where the lengths differ: warned about."""
  params, encode, decode = _encoder_decoder()
  rng = np.random.default_rng(7)
  src = jnp.asarray(rng.integers(0, V, size=(B, source_length)))
  tgt, y = (jnp.asarray(rng.integers(0, k, size=(B, T))) for k in (V, C))
  src_keep = np.arange(source_length)[None] < np.asarray([6, 2, 4, 5])[:, None]
  tgt_keep = np.arange(T)[None] < np.asarray([3, 6, 1, 4])[:, None]
  cross = r"cross/(key|value)$"

  def loss(p, src, tgt, y, src_keep, tgt_keep):
    with kd.tags.row_mask(src_keep):
      memory = encode(p, src)
    with kd.tags.row_mask(src_keep, layers=[cross]), \
         kd.tags.row_mask(tgt_keep, layers=[f"^(?!.*{cross})"]):
      logits = decode(p, tgt, memory, src_keep)
    return kd.losses.softmax_cross_entropy(logits, y, mask=tgt_keep)
  batch = (src, tgt, y, jnp.asarray(src_keep), jnp.asarray(tgt_keep))
  _, _, stats = jax.jit(kd.value_and_grad(loss))(params, *batch)
  p = jax.tree.map(np.asarray, params)
  dense = lambda x, q: x @ q["kernel"] + q["bias"]
  x_src, x_tgt = p["emb"]["table"][np.asarray(src)], p["emb"]["table"][np.asarray(tgt)]
  memory = np.tanh(dense(x_src, p["encoder"]))
  for name, rows in (("encoder", x_src[src_keep]), ("decoder/query", x_tgt[tgt_keep]),
                     ("decoder/cross/key", memory[src_keep]),
                     ("decoder/cross/value", memory[src_keep])):
    a = _with_one(rows)
    np.testing.assert_allclose(stats[name]["A"], a.T @ a / len(a), rtol=1e-12, err_msg=name)
  ids = np.concatenate([np.asarray(src)[src_keep], np.asarray(tgt)[tgt_keep]])
  np.testing.assert_allclose(stats["emb"]["A"], np.bincount(ids, minlength=V) / len(ids),
                             rtol=1e-12)

  def by_place(p, src, tgt, y, src_keep, tgt_keep):
    with kd.tags.row_mask(src_keep, layers=["^encoder"]), \
         kd.tags.row_mask(tgt_keep, layers=["^decoder"]):
      logits = decode(p, tgt, encode(p, src), src_keep)
    return kd.losses.softmax_cross_entropy(logits, y, mask=tgt_keep)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kd.value_and_grad(by_place).discover(params, *batch)
  warned = [str(w.message) for w in caught if "names it but does not fit" in str(w.message)]
  assert len(warned) == (2 if source_length != T else 0), warned
  assert all("'decoder/cross/" in message for message in warned)


def test_mask_outside_a_recurrent_loop():
  """A `[B, T]` mask around a Flax `nn.RNN` (its cells run in a `lax.scan`
  over T, one `[B]` slice each; JAX does not say what a loop runs over) or
  around a cell stepped by a Python loop over T is warned about at
  discovery, naming the loop: the cells' steps are taken unmasked; `layers=`
  may leave the cells out. The recipe: `nn.scan` over a cell that takes
  `(x_t, mask_t)` and enters `mask_t`: the input gate's `A` is the mean over
  the kept steps' inputs, the padding's out (float64 brute force)."""
  import flax.linen as nn
  batch, steps, width, hidden, classes = 6, 5, 4, 3, 3
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(3), (batch, steps, width), jnp.float64)
    y = jax.random.randint(jax.random.PRNGKey(4), (batch, steps), 0, classes)
    lengths = jnp.array([5, 2, 3, 1, 4, 5])
    mask = jnp.arange(steps)[None] < lengths[:, None]

    class RNN(nn.Module):
      @nn.compact
      def __call__(self, x, lengths):
        out = nn.RNN(nn.LSTMCell(hidden, param_dtype=jnp.float64, name="cell"))(
            x, seq_lengths=lengths)
        return nn.Dense(classes, param_dtype=jnp.float64, name="head")(out)

    def loss(p, x, y, layers=()):
      with kd.tags.row_mask(mask, layers=layers):
        logits = RNN().apply({"params": p}, x, lengths)
      return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
    params = RNN().init(jax.random.PRNGKey(0), x, lengths)["params"]
    warned = r"row_mask of shape \(6, 5\), entered outside a loop .* tagged layer 'cell/i.'"
    with pytest.warns(UserWarning, match=warned + r" .* positions \(6,\) but for one axis"):
      kd.value_and_grad(loss, capture="flax").discover(params, x, y)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      layers = kd.value_and_grad(loss, capture="flax").discover(params, x, y, layers=["head"])
    assert {l.name: l.row_masked for l in layers}["head"]

    def unrolled(p, x, y):               # the cell stepped in Python, T times
      cell = nn.LSTMCell(hidden, param_dtype=jnp.float64)
      carry, outs = cell.initialize_carry(jax.random.PRNGKey(0), x[:, 0].shape), []
      with kd.tags.row_mask(mask):
        for t in range(steps):
          carry, out = cell.apply({"params": p["cell"]}, carry, x[:, t])
          outs.append(out)
        logits = kd.tags.dense(jnp.stack(outs, 1), p["head"]["kernel"], name="head")
      return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
    with pytest.warns(UserWarning, match=r"row_mask of shape \(6, 5\), entered outside a "
                                         r"loop .* a Python loop"):
      kd.value_and_grad(unrolled, capture="flax").discover(params, x, y)

    class MaskedCell(nn.Module):
      @nn.compact
      def __call__(self, carry, inputs):
        x_t, mask_t = inputs
        with kd.tags.row_mask(mask_t):
          return nn.LSTMCell(hidden, param_dtype=jnp.float64, name="cell")(carry, x_t)

    class ScannedRNN(nn.Module):
      @nn.compact
      def __call__(self, x, mask):
        carry = nn.LSTMCell(hidden, param_dtype=jnp.float64, parent=None).initialize_carry(
            jax.random.PRNGKey(0), x[:, 0].shape)
        scan = nn.scan(MaskedCell, variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)
        _, out = scan(name="rnn")(carry, (x, mask))
        with kd.tags.row_mask(mask):
          return nn.Dense(classes, param_dtype=jnp.float64, name="head")(out)

    def scanned_loss(p, x, y):
      logits = ScannedRNN().apply({"params": p}, x, mask)
      return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
    params = ScannedRNN().init(jax.random.PRNGKey(0), x, mask)["params"]
    grad_fn = kd.value_and_grad(scanned_loss, capture="flax")
    assert all(l.row_masked for l in grad_fn.discover(params, x, y))
    _, _, stats = jax.jit(grad_fn)(params, x, y)
    kept = np.asarray(x)[np.asarray(mask)]                 # the input gate's rows, no bias
    np.testing.assert_allclose(helpers.f64(stats["rnn/cell/ii"]["A"]),
                               kept.T @ kept / len(kept), rtol=1e-12)


def test_mask_outside_a_loop_over_stacked_blocks():
  """A `[B, T]` mask around blocks scanned over depth (`nn.scan`, stacked
  parameters): the blocks' token layers take it, a per-example layer inside
  (DiT's conditioning on `[B, d]`) is not masked and not refused: the loop
  runs over the blocks, not over an axis of the batch."""
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, cond):
      scale = nn.Dense(h.shape[-1], name="condition")(cond)        # [B, d]: per example
      return h + nn.Dense(h.shape[-1], name="mlp")(h) * scale[:, None], None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, cond):
      blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=nn.broadcast, length=3)
      h, _ = blocks(name="blocks")(x, cond)
      return nn.Dense(2, name="head")(h)

  x, cond = jnp.ones((4, 5, 6)), jnp.ones((4, 6))
  mask = jnp.arange(5)[None] < jnp.array([5, 2, 3, 1])[:, None]
  params = Model().init(jax.random.PRNGKey(0), x, cond)["params"]

  def loss(p, x, y):
    with kd.tags.row_mask(mask):
      logits = Model().apply({"params": p}, x, cond)
    return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    layers = kd.value_and_grad(loss, capture="flax").discover(params, x,
                                                              jnp.zeros((4, 5), int))
  assert {l.name: l.row_masked for l in layers} == {
      "blocks/condition": False, "blocks/mlp": True, "head": True}


def test_example_mask_around_a_loop_is_not_warned():
  """A `[B]` mask of padded examples around a `lax.scan` (a sampler's steps)
  whose body runs a layer on `[B, d]` rows (masked) and one on a `[1, d]`
  time embedding (not masked): no warning, one axis of a 1-D mask is no
  loop's."""
  params = {"step": jnp.ones((4, 4)), "time": jnp.ones((3, 4))}
  keep = jnp.array([True, True, False, True, False])

  def loss(p, x, y):
    def body(h, t):
      emb = kd.tags.dense(jnp.ones((1, 3)) * t, p["time"], name="time")
      return jnp.tanh(kd.tags.dense(h, p["step"], name="step") + emb), None
    with kd.tags.row_mask(keep):
      h, _ = jax.lax.scan(body, x, jnp.arange(3.0))
    return kd.losses.softmax_cross_entropy(h, y, mask=keep)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    layers = kd.value_and_grad(loss).discover(params, jnp.ones((5, 4)), jnp.zeros(5, int))
  assert {l.name: l.row_masked for l in layers} == {"time": False, "step": True}
