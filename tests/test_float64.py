"""Float64 fidelity: statistics and one K-FAC update against NumPy brute force.

Every expected value here is built in float64 NumPy from the formulas of
`capture.statistics` and `kfac.linalg` (explicit positions, im2col by loops,
the Kronecker product formed and solved densely), never by the library:

    A = (1/N) Σ_p a_p a_pᵀ   (a = [x, 1] with a bias; token frequencies for an
                              embedding),
    G = n Σ_p ĝ_p ĝ_pᵀ       (ĝ the cotangent of the layer's output, n the
                              loss's number of examples),
    F_c = n Σ_u [uγ², uγ uβ, uβ²]   (scale-and-shift, per channel),
    eigen:   vec(V) = (A ⊗ G + γI)⁻¹ vec(∇),
    inverse: V = (A + π√γ I)⁻¹ ∇ (G + √γ/π I)⁻¹,  π² = (tr A/d_A) / (tr G/d_G),

with the output cotangents of the registered loss written out by hand:
softmax cross-entropy `(softmax(y) − onehot)/n`, squared error `(y − t)/n`.
A float64 model with `factor_dtype=float64` must meet them to 1e-12 relative
(statistics computed in float32 missed them by 5e-8 to 2e-6), on one device,
through `nn.scan`, `accumulate` and on 8 devices. A bfloat16 model still gets
float32 statistics.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

import helpers

F64 = jnp.float64
GAMMA = 1e-2
TOL = 1e-12


@pytest.fixture(autouse=True, scope="module")
def _float64():
  with jax.enable_x64(True):
    yield


def rel_err(got, expected) -> float:
  got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
  assert got.shape == expected.shape, (got.shape, expected.shape)
  return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


# ---------------------------------------------------------------------------
# Brute-force pieces (NumPy, float64).
# ---------------------------------------------------------------------------

def softmax_ce_cotangent(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """d(mean_p CE_p)/d logits: `(softmax − onehot) / n`, rows = positions."""
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  p[np.arange(len(labels)), labels] -= 1.0
  return p / len(labels)


def im2col(x: np.ndarray, kh: int, kw: int, strides, padding, dilation) -> np.ndarray:
  """`[B, h, w, kh·kw·C]` patches by loops, ordered like `kernel.reshape(-1, O)`."""
  b, hh, ww, c = x.shape
  (sh, sw), (dh, dw) = strides, dilation
  win_h, win_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
  if padding == "SAME":
    pads = []
    for size, s, win in ((hh, sh, win_h), (ww, sw, win_w)):
      out = -(-size // s)
      total = max((out - 1) * s + win - size, 0)
      pads.append((total // 2, total - total // 2))
  elif padding == "VALID":
    pads = [(0, 0), (0, 0)]
  else:
    pads = padding
  xp = np.zeros((b, hh + sum(pads[0]), ww + sum(pads[1]), c))
  xp[:, pads[0][0]:pads[0][0] + hh, pads[1][0]:pads[1][0] + ww] = x
  out_h = (xp.shape[1] - win_h) // sh + 1
  out_w = (xp.shape[2] - win_w) // sw + 1
  patches = np.zeros((b, out_h, out_w, kh * kw * c))
  for oh in range(out_h):
    for ow in range(out_w):
      taps = [xp[:, oh * sh + i * dh, ow * sw + j * dw, :]
              for i in range(kh) for j in range(kw)]
      patches[:, oh, ow] = np.concatenate(taps, axis=-1)
  return patches


def kron_factors(a_rows: np.ndarray, g_rows: np.ndarray, n: int,
                 bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(A, G, ∇)` of a dense layer from its inputs and output cotangents, one
  row per position: `∇ = Σ_p a_p ĝ_pᵀ` (kernel rows, then the bias row)."""
  if bias:
    a_rows = np.concatenate([a_rows, np.ones((a_rows.shape[0], 1))], axis=1)
  a = sum(np.outer(r, r) for r in a_rows) / a_rows.shape[0]
  g = n * sum(np.outer(r, r) for r in g_rows)
  grad = sum(np.outer(ar, gr) for ar, gr in zip(a_rows, g_rows))
  return a, g, grad


def eigen_update(a: np.ndarray, g: np.ndarray, grad: np.ndarray, gamma: float
                 ) -> np.ndarray:
  """`(A ⊗ G + γI)⁻¹ vec(∇)` by a dense solve (vec row-major: `A ∇ G`)."""
  big = np.kron(a, g) + gamma * np.eye(a.shape[0] * g.shape[0])
  return np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)


def unitwise_update(f: np.ndarray, grad: np.ndarray, gamma: float) -> np.ndarray:
  """`(F + γI)⁻¹ [∇γ; ∇β]` with F the block-diagonal `2C × 2C` unit-wise Fisher
  (channel c: rows/columns `c` and `C + c`), solved densely."""
  c = f.shape[0]
  big = np.zeros((2 * c, 2 * c))
  for i, (gg, gb, bb) in enumerate(f):
    big[np.ix_([i, c + i], [i, c + i])] = [[gg, gb], [gb, bb]]
  big += gamma * np.eye(2 * c)
  return np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)


# ---------------------------------------------------------------------------
# The cases: a one-layer model, its batch, and the brute-force expectations.
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
  loss_fn: Callable
  params: dict
  batch: tuple
  layer: str                      # the layer's name in the statistics
  stats: dict                     # brute-force statistics
  grad: np.ndarray                # brute-force gradient matrix (kernel rows, bias row)
  expected_out: np.ndarray        # brute-force forward output (a sanity check)
  forward: Callable               # params, input -> the layer's output


def _rng(seed: int) -> np.random.Generator:
  return np.random.default_rng(seed)


def dense_case(seed: int = 0) -> Case:
  rng = _rng(seed)
  b, d, c = 12, 5, 4
  x, labels = rng.normal(size=(b, d)), rng.integers(0, c, size=b)
  params = {"fc": {"kernel": rng.normal(size=(d, c)) * 0.7, "bias": rng.normal(size=c)}}
  logits = x @ params["fc"]["kernel"] + params["fc"]["bias"]
  a, g, grad = kron_factors(x, softmax_ce_cotangent(logits, labels), b, True)

  def forward(p, x):
    return kd.tags.dense(x, p["fc"]["kernel"], p["fc"]["bias"])

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(forward(p, x), y)
  return Case(loss_fn, params, (x, labels), "fc", {"A": a, "G": g}, grad, logits,
              forward)


CONV_SETTINGS = {
    "stride2_same": dict(strides=(2, 2), padding="SAME", dilation=(1, 1)),
    "stride12_explicit": dict(strides=(1, 2), padding=((2, 1), (0, 1)), dilation=(1, 1)),
    "dilated_valid": dict(strides=(1, 1), padding="VALID", dilation=(2, 1)),
}


def conv_case(setting: str, seed: int = 1) -> Case:
  rng = _rng(seed)
  cfg = CONV_SETTINGS[setting]
  kh, kw, cin, cout = 3, 2, 2, 3
  x = rng.normal(size=(3, 7, 6, cin))
  params = {"conv": {"kernel": rng.normal(size=(kh, kw, cin, cout)) * 0.5,
                     "bias": rng.normal(size=cout)}}
  patches = im2col(x, kh, kw, cfg["strides"], cfg["padding"], cfg["dilation"])
  y = patches @ params["conv"]["kernel"].reshape(-1, cout) + params["conv"]["bias"]
  targets = rng.normal(size=y.shape)
  n = y.size // cout                          # squared error per output pixel
  cot = (y - targets).reshape(-1, cout) / n
  a, g, grad = kron_factors(patches.reshape(-1, patches.shape[-1]), cot, n, True)

  def forward(p, x):
    return kd.tags.conv2d(x, p["conv"]["kernel"], p["conv"]["bias"], **cfg)

  def loss_fn(p, x, t):
    return kd.losses.squared_error(forward(p, x), t)
  return Case(loss_fn, params, (x, targets), "conv", {"A": a, "G": g}, grad, y, forward)


def dense_general_case(seed: int = 2) -> Case:
  rng = _rng(seed)
  b, t, h1, h2, o1, o2 = 3, 4, 2, 3, 3, 2
  x = rng.normal(size=(b, t, h1, h2))
  params = {"proj": {"kernel": rng.normal(size=(h1, h2, o1, o2)) * 0.5,
                     "bias": rng.normal(size=(o1, o2))}}
  y = np.einsum("btij,ijkl->btkl", x, params["proj"]["kernel"]) + params["proj"]["bias"]
  targets = rng.normal(size=(b, t, o1 * o2))
  n = b * t
  cot = (y.reshape(b, t, -1) - targets).reshape(n, -1) / n
  a, g, grad = kron_factors(x.reshape(n, -1), cot, n, True)

  def forward(p, x):
    return kd.tags.dense_general(x, p["proj"]["kernel"], p["proj"]["bias"], in_dims=2)

  def loss_fn(p, x, t):
    out = forward(p, x)
    return kd.losses.squared_error(out.reshape(out.shape[:2] + (-1,)), t)
  return Case(loss_fn, params, (x, targets), "proj", {"A": a, "G": g}, grad, y, forward)


def embed_case(seed: int = 3) -> Case:
  rng = _rng(seed)
  b, t, vocab, d = 4, 5, 9, 4
  ids = rng.integers(0, vocab - 2, size=(b, t))         # the last two rows unused
  params = {"emb": {"embedding": rng.normal(size=(vocab, d))}}
  y = params["emb"]["embedding"][ids]
  targets = rng.normal(size=y.shape)
  n = b * t
  cot = (y - targets).reshape(n, d) / n
  freq = np.zeros(vocab)
  grad = np.zeros((vocab, d))
  for v, row in zip(ids.reshape(-1), cot):
    freq[v] += 1.0 / n
    grad[v] += row
  g = n * sum(np.outer(r, r) for r in cot)

  def forward(p, ids):
    return kd.tags.embed(ids, p["emb"]["embedding"])

  def loss_fn(p, ids, t):
    return kd.losses.squared_error(forward(p, ids), t)
  return Case(loss_fn, params, (ids, targets), "emb", {"A": freq, "G": g}, grad, y,
              forward)


def normalised(x: np.ndarray) -> np.ndarray:
  """LayerNorm's `x̂` over the last axis (an input here, not a parameter)."""
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def scale_and_shift_case(example_dims: int | None, seed: int = 4) -> Case:
  """`example_dims=None`: LayerNorm on `[B, T, C]`, tokens as examples;
  `1`: BatchNorm-like on `[B, H, W, C]`, images as examples."""
  rng = _rng(seed)
  shape = (3, 4, 5) if example_dims is None else (3, 2, 3, 5)
  xhat = normalised(rng.normal(size=shape))
  c = shape[-1]
  params = {"ln": {"scale": 1.0 + 0.3 * rng.normal(size=c), "bias": rng.normal(size=c)}}
  y = xhat * params["ln"]["scale"] + params["ln"]["bias"]
  targets = rng.normal(size=y.shape)
  n = y.size // c
  cot = (y - targets) / n
  units = n if example_dims is None else shape[0]
  u_gamma = (xhat * cot).reshape(units, -1, c).sum(1)
  u_beta = cot.reshape(units, -1, c).sum(1)
  f = n * np.stack([(u_gamma ** 2).sum(0), (u_gamma * u_beta).sum(0),
                    (u_beta ** 2).sum(0)], axis=-1)
  grad = np.stack([(xhat * cot).reshape(-1, c).sum(0), cot.reshape(-1, c).sum(0)])

  def forward(p, x):
    return kd.tags.scale_and_shift(x, p["ln"]["scale"], p["ln"]["bias"],
                                   example_dims=example_dims)

  def loss_fn(p, x, t):
    return kd.losses.squared_error(forward(p, x), t)
  return Case(loss_fn, params, (xhat, targets), "ln", {"F": f}, grad, y, forward)


CASES = {
    "dense": dense_case,
    **{f"conv2d_{k}": (lambda k=k: conv_case(k)) for k in CONV_SETTINGS},
    "dense_general": dense_general_case,
    "embed": embed_case,
    "layernorm": lambda: scale_and_shift_case(None),
    "batchnorm_images": lambda: scale_and_shift_case(1),
}


def as_f64(tree):
  return jax.tree.map(lambda v: jnp.asarray(v, F64) if np.issubdtype(
      np.asarray(v).dtype, np.floating) else jnp.asarray(v), tree)


def gradient_matrix(layer: str, tree: dict) -> np.ndarray:
  """The layer's leaves of `tree` as the `(d_A, d_G)` matrix of the brute force."""
  leaves = [np.asarray(v, np.float64) for v in jax.tree.leaves(tree[layer])]
  if layer == "ln":                         # {"bias", "scale"}: rows (γ, β)
    return np.stack([leaves[1], leaves[0]])
  if layer == "emb":
    return leaves[0]
  kernel, bias = leaves[1], leaves[0]       # {"bias", "kernel"}
  return np.concatenate([kernel.reshape(-1, bias.size), bias.reshape(1, -1)])


def brute_update(case: Case, method: str) -> np.ndarray:
  if "F" in case.stats:
    return unitwise_update(case.stats["F"], case.grad, GAMMA)
  a = case.stats["A"]
  a = np.diag(a) if a.ndim == 1 else a
  solve = eigen_update if method == "eigen" else helpers.inverse_update
  return solve(a, case.stats["G"], case.grad, GAMMA)


def captured(case: Case):
  params, batch = as_f64(case.params), as_f64(case.batch)
  grad_fn = kd.value_and_grad(case.loss_fn)
  layers = grad_fn.discover(params, *batch)
  _, grads, stats = jax.jit(grad_fn)(params, *batch)
  return params, layers, grads, stats


def one_update(case: Case, method: str, factor_dtype=F64):
  params, layers, grads, stats = captured(case)
  tx = kd.scale_by_kfac(layers=layers, damping=GAMMA, method=method,
                        factor_dtype=factor_dtype)
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(grads, state, kfac_stats=stats)
  return updates, new_state


# ---------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(CASES))
def test_statistics_and_gradients_equal_brute_force(kind):
  case = CASES[kind]()
  params, batch = as_f64(case.params), as_f64(case.batch)
  assert rel_err(case.forward(params, batch[0]), case.expected_out) <= TOL
  _, _, grads, stats = captured(case)
  for key, expected in case.stats.items():
    got = stats[case.layer][key]
    assert got.dtype == F64, (kind, key, got.dtype)
    assert rel_err(got, expected) <= TOL, (kind, key, rel_err(got, expected))
  assert rel_err(gradient_matrix(case.layer, grads), case.grad) <= TOL


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kind", list(CASES))
def test_one_update_equals_brute_force(kind, method):
  case = CASES[kind]()
  updates, state = one_update(case, method)
  got = gradient_matrix(case.layer, updates)
  err = rel_err(got, brute_update(case, method))
  assert err <= TOL, (kind, method, err)
  # float64 end to end: running factors, decompositions, the update itself.
  assert state.factors.dtype == F64 and state.second_order.dtype == F64
  assert all(v.dtype == F64 for v in jax.tree.leaves(updates))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(kd.linen.Dense(h.shape[-1], param_dtype=F64)(h)), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)
    return blocks(name="blocks")(x, None)[0]


def test_scanned_linen_blocks_equal_brute_force():
  """A stacked layer (probes carried through `nn.scan`'s parameters) gets
  float64 statistics per block, and each block's update is its own solve."""
  rng = _rng(7)
  b, d, depth = 6, 3, 3
  x, targets = rng.normal(size=(b, d)), rng.normal(size=(b, d))
  params = _Scanned().init(jax.random.PRNGKey(0), jnp.asarray(x))["params"]
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.6, F64),
                        params)
  kernel = np.asarray(params["blocks"]["Dense_0"]["kernel"])
  bias = np.asarray(params["blocks"]["Dense_0"]["bias"])
  hs = [x]                                   # brute force: forward, then backward
  for i in range(depth):
    hs.append(np.tanh(hs[-1] @ kernel[i] + bias[i]))
  cot, expected = (hs[-1] - targets) / b, []
  for i in reversed(range(depth)):
    cot_s = cot * (1.0 - hs[i + 1] ** 2)
    expected.insert(0, kron_factors(hs[i], cot_s, b, True))
    cot = cot_s @ kernel[i].T

  def loss_fn(p, x, t):
    return kd.losses.squared_error(_Scanned().apply({"params": p}, x), t)
  grad_fn = kd.value_and_grad(loss_fn)
  batch = (jnp.asarray(x), jnp.asarray(targets))
  _, grads, stats = jax.jit(grad_fn)(params, *batch)
  layer_stats = stats["blocks/Dense_0"]
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, *batch), damping=GAMMA,
                        factor_dtype=F64)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), kfac_stats=stats)
  for i, (a, g, grad) in enumerate(expected):
    assert layer_stats["A"].dtype == layer_stats["G"].dtype == F64
    assert rel_err(layer_stats["A"][i], a) <= TOL
    assert rel_err(layer_stats["G"][i], g) <= TOL
    got = {"fc": jax.tree.map(lambda v, i=i: v[i], updates["blocks"]["Dense_0"])}
    err = rel_err(gradient_matrix("fc", got),
                  eigen_update(a, g, grad, GAMMA))
    assert err <= TOL, (i, err)


@pytest.mark.parametrize("mask_range", [(0.1, 1.0), (0.01, 0.1)], ids=["above1", "below1"])
def test_accumulated_masked_statistics_equal_brute_force(mask_range):
  """`grad_fn` and its `accumulate` over micro-batches with a fractional mask:
  the loss is `Σ w l / Σ w` also where the weights sum below 1 (the whole
  batch's and each slice's, `below1`), and the slices' weights `n_i` (mask
  sums) are float64 too; the Gauss-Newton products divide by `Σ w` alike."""
  rng = _rng(8)
  b, d, c = 8, 4, 3
  x, labels = rng.normal(size=(b, d)), rng.integers(0, c, size=b)
  mask = rng.uniform(*mask_range, size=b)
  params = {"fc": {"kernel": rng.normal(size=(d, c)), "bias": rng.normal(size=c)}}
  n = mask.sum()
  logits = x @ params["fc"]["kernel"] + params["fc"]["bias"]
  cot = softmax_ce_cotangent(logits, labels) * len(labels) * mask[:, None] / n
  a, g, grad = kron_factors(x, cot, n, True)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  loss = -(mask * log_p[np.arange(b), labels]).sum() / n
  p = np.exp(log_p)
  v = {"fc": {"kernel": rng.normal(size=(d, c)), "bias": rng.normal(size=c)}}
  u = x @ v["fc"]["kernel"] + v["fc"]["bias"]           # J v per example
  gram = (mask * ((p * u * u).sum(-1) - (p * u).sum(-1) ** 2)).sum() / n

  def loss_fn(p, x, y, m):
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(x, p["fc"]["kernel"], p["fc"]["bias"]), y, mask=m)
  grad_fn = kd.value_and_grad(loss_fn)
  batch = as_f64((x, labels, mask))
  for run in (grad_fn, functools.partial(grad_fn.accumulate, micro_batches=2)):
    value, grads, stats = jax.jit(run)(as_f64(params), *batch)
    assert rel_err(value, loss) <= TOL
    assert rel_err(stats["fc"]["A"], a) <= TOL
    assert rel_err(stats["fc"]["G"], g) <= TOL
    assert rel_err(np.concatenate([grads["fc"]["kernel"], grads["fc"]["bias"][None]]),
                   grad) <= TOL
  for k in (1, 2):
    assert rel_err(grad_fn.gauss_newton_gram(as_f64(params), (as_f64(v),), *batch,
                                             micro_batches=k)[0, 0], gram) <= TOL
    assert rel_err(grad_fn.loss(as_f64(params), *batch, micro_batches=k), loss) <= TOL


def test_monte_carlo_fisher_weighs_a_masked_position_by_its_weight():
  """`fisher="mc"` with mask weights `w`: `G = (1/n) Σ_i w_i e_i e_iᵀ` for the
  sampled targets' gradients `e_i` (so that its expectation is the Gauss-Newton
  matrix `(1/n) Σ w JᵀHJ`), i.e. the `w/n`-weighted sum of the `G`s of the
  one-example masks `c·onehot(i)`, each `e_i e_iᵀ` whatever `c` (the same key
  draws the same targets)."""
  rng = _rng(10)
  b, d, c = 6, 3, 4
  x, labels = rng.normal(size=(b, d)), rng.integers(0, c, size=b)
  params = as_f64({"fc": {"kernel": rng.normal(size=(d, c)), "bias": rng.normal(size=c)}})

  def loss_fn(p, x, y, m):
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(x, p["fc"]["kernel"], p["fc"]["bias"]), y, mask=m)
  grad_fn = jax.jit(kd.value_and_grad(loss_fn, fisher="mc"))
  key = jax.random.PRNGKey(3)
  g_of = lambda m: np.asarray(grad_fn(params, *as_f64((x, labels, m)), rng=key)[2]["fc"]["G"])
  w = rng.uniform(0.05, 3.0, size=b)
  singles = [g_of(np.eye(b)[i] * w[i]) for i in range(b)]
  assert rel_err(g_of(np.eye(b)[0] * 7.0), singles[0]) <= TOL
  assert rel_err(g_of(w), sum(wi * gi for wi, gi in zip(w, singles)) / w.sum()) <= TOL


def _conv_dense_brute_force(seed: int = 9):
  """Conv (stride 2, SAME) → flatten → Dense → softmax cross-entropy on 16
  images: per layer `(A, G, ∇)`, the conv's cotangents back through the Dense."""
  rng = _rng(seed)
  b, cout, classes = 16, 3, 4
  x, labels = rng.normal(size=(b, 5, 4, 2)), rng.integers(0, classes, size=b)
  params = {"conv": {"kernel": rng.normal(size=(3, 3, 2, cout)) * 0.4,
                     "bias": rng.normal(size=cout)},
            "fc": {"kernel": rng.normal(size=(3 * 2 * cout, classes)) * 0.4,
                   "bias": rng.normal(size=classes)}}
  patches = im2col(x, 3, 3, (2, 2), "SAME", (1, 1))
  y1 = patches @ params["conv"]["kernel"].reshape(-1, cout) + params["conv"]["bias"]
  h = y1.reshape(b, -1)
  cot2 = softmax_ce_cotangent(h @ params["fc"]["kernel"] + params["fc"]["bias"], labels)
  cot1 = (cot2 @ params["fc"]["kernel"].T).reshape(-1, cout)
  expected = {"conv": kron_factors(patches.reshape(-1, patches.shape[-1]), cot1, b, True),
              "fc": kron_factors(h, cot2, b, True)}

  def loss_fn(p, x, y):
    y1 = kd.tags.conv2d(x, p["conv"]["kernel"], p["conv"]["bias"], strides=(2, 2))
    logits = kd.tags.dense(y1.reshape(y1.shape[0], -1), p["fc"]["kernel"],
                           p["fc"]["bias"])
    return kd.losses.softmax_cross_entropy(logits, y)
  return loss_fn, as_f64(params), as_f64((x, labels)), expected


@pytest.mark.parametrize("fraction,factor_reduction,gradient_reduction", [
    (1 / 8, "reduce_scatter", "reduce_scatter"),      # MEM-OPT, SP-NGD's routing
    (1 / 2, "all_reduce", "all_reduce")])             # HYBRID, KAISA's all-reduce
def test_distributed_update_equals_brute_force(fraction, factor_reduction,
                                               gradient_reduction):
  """On 8 devices, 2 images each: the averaged local statistics and gradients
  are the global batch's, and the update its brute force, in float64."""
  loss_fn, params, batch, expected = _conv_dense_brute_force()
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=fraction,
                         factor_reduction=factor_reduction,
                         gradient_reduction=gradient_reduction)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.scale_by_kfac(layers=grad_fn.discover(params, *batch), damping=GAMMA,
                        factor_dtype=F64, distribution=dist)
  state = kd.shard_state(tx.init(params), mesh)
  specs = kd.partition_specs(state)

  def step(params, state, x, y):
    _, grads, stats = grad_fn(params, x, y, opt_state=state)
    return tx.update(grads, state, kfac_stats=stats)
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs)))
  updates, state = step(params, state, *batch)
  assert state.factors.dtype == F64 and state.second_order.dtype == F64
  for name, (a, g, grad) in expected.items():
    got = gradient_matrix(name, updates)
    err = rel_err(got, eigen_update(a, g, grad, GAMMA))
    assert err <= TOL, (name, err)


def test_float32_factors_miss_the_tolerance():
  """The tolerance can tell: the same update with float32 factors misses it."""
  case = dense_case()
  updates, state = one_update(case, "eigen", factor_dtype=jnp.float32)
  assert state.factors.dtype == jnp.float32
  err = rel_err(gradient_matrix(case.layer, updates), brute_update(case, "eigen"))
  assert 1e-9 < err < 1e-4, err


def _bf16(x) -> np.ndarray:
  """`x` rounded to bfloat16 (nearest even), back in float64."""
  return np.asarray(jnp.asarray(x, F64).astype(jnp.bfloat16).astype(F64))


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_bfloat16_second_order_state_is_the_brute_force_rounded(method):
  """`second_order_dtype=jnp.bfloat16` (KAISA's 16-bit `inv_dtype`): the
  eigenbases and eigenvalues (or the damped inverses) are decomposed in
  float64, stored rounded to bfloat16 and read up: the update equals the
  brute force's with exactly those numbers rounded (≤ 1e-12), products and
  all in float64, and the rounding shows against the unrounded update."""
  case = dense_case()
  params, layers, grads, stats = captured(case)
  tx = kd.scale_by_kfac(layers=layers, damping=GAMMA, method=method, factor_dtype=F64,
                        second_order_dtype=jnp.bfloat16)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), kfac_stats=stats)
  assert state.second_order.dtype == jnp.bfloat16 and state.factors.dtype == F64
  a, g, grad = case.stats["A"], case.stats["G"], case.grad
  if method == "eigen":
    (va, qa), (vg, qg) = np.linalg.eigh(a), np.linalg.eigh(g)
    va, qa, vg, qg = (_bf16(x) for x in (np.maximum(va, 0), qa, np.maximum(vg, 0), qg))
    want = qa @ ((qa.T @ grad @ qg) / (np.outer(va, vg) + GAMMA)) @ qg.T
  else:
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    inv_a = _bf16(np.linalg.inv(a + pi * np.sqrt(GAMMA) * np.eye(a.shape[0])))
    inv_g = _bf16(np.linalg.inv(g + np.sqrt(GAMMA) / pi * np.eye(g.shape[0])))
    want = inv_a @ grad @ inv_g
  got = gradient_matrix(case.layer, updates)
  assert rel_err(got, want) <= TOL, rel_err(got, want)
  assert 1e-5 < rel_err(got, brute_update(case, method)) < 1e-1


def _bf16_dense():
  rng = _rng(5)
  x = jnp.asarray(rng.normal(size=(16, 6)), jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, 3, size=16))
  params = {"fc": {"kernel": jnp.asarray(rng.normal(size=(6, 3)), jnp.bfloat16),
                   "bias": jnp.asarray(rng.normal(size=3), jnp.bfloat16)}}

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(x, p["fc"]["kernel"], p["fc"]["bias"]), y)
  return loss_fn, params, x, labels


def test_bfloat16_model_gets_float32_statistics():
  loss_fn, params, x, labels = _bf16_dense()
  _, grads, stats = jax.jit(kd.value_and_grad(loss_fn))(params, x, labels)
  assert grads["fc"]["kernel"].dtype == jnp.bfloat16
  assert stats["fc"]["A"].dtype == jnp.float32
  assert stats["fc"]["G"].dtype == jnp.float32
  # A of the bfloat16 inputs, accumulated in float32: float32 rounding only
  # (bfloat16 products would miss by ~1e-3).
  a_rows = np.concatenate([np.asarray(x, np.float64), np.ones((16, 1))], axis=1)
  assert rel_err(stats["fc"]["A"], a_rows.T @ a_rows / 16) < 1e-6


def test_bfloat16_embedding_and_layernorm_get_float32_statistics():
  rng = _rng(6)
  ids = jnp.asarray(rng.integers(0, 5, size=(2, 3)))
  params = {"emb": {"embedding": jnp.asarray(rng.normal(size=(5, 4)), jnp.bfloat16)},
            "ln": {"scale": jnp.ones(4, jnp.bfloat16), "bias": jnp.zeros(4, jnp.bfloat16)}}

  def loss_fn(p, ids, t):
    h = kd.tags.embed(ids, p["emb"]["embedding"])
    h = kd.tags.scale_and_shift(h, p["ln"]["scale"], p["ln"]["bias"])
    return kd.losses.squared_error(h, t)
  t = jnp.zeros((2, 3, 4), jnp.bfloat16)
  _, _, stats = jax.jit(kd.value_and_grad(loss_fn))(params, ids, t)
  assert {k: v.dtype for k, v in stats["emb"].items()} == {"A": jnp.float32,
                                                           "G": jnp.float32}
  assert stats["ln"]["F"].dtype == jnp.float32
