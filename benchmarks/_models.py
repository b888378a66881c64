"""The models of the benchmarks, each defined once.

Flax models, built from `kd.linen` layers (outside `kd.value_and_grad` the
tagged layers are plain Flax computations, so first-order baselines run the
very same models):

* `CnnMlp`: the fixed model of comm_volume, memory and shampoo_memory;
* `CnnMlp12`: comm_volume's second model, a dozen comparable layers;
* `MLP`, `CNN`: step_time's 784-512-512-10 MLP and CIFAR-shaped CNN;
* `DigitsCNN`, `Autoencoder`: examples/digits.py's CNN and
  examples/autoencoder.py's model (convergence);
* `TransformerBlock` / `CharLM`: a pre-LayerNorm decoder-only Transformer
  (step_time, stale_statistics, convergence);
* `ResNet50`, `BertLarge`, `Gpt2Xl`: layer shapes for layout_balance.

Flax derives every parameter's initialisation from its module path, so each
model keeps the module names of the script that first had it: where two
scripts' versions differ only in names, the class takes the naming as a field
(`CharLM.naming`) and each keeps its own numbers.

Plain-JAX models (parameter dicts, He-normal init) for the peer comparisons,
whose peers (kfac-jax's layer registration, distributed_shampoo) see plain
`x @ w + b` and `lax.conv_general_dilated`: `dense_stack_*`, `conv_init`,
`dense`, `conv`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kfac_jax_dist as kd

Params = dict[str, Any]


# ------------------------------------------------------------------ Flax models

class CnnMlp(nn.Module):
  """Conv 3x3 3→32, then 32→32 four times (strides 1, 2, 1, 2), global mean,
  Dense 32→256, eight Dense layers alternating 256→320 and 320→256, Dense
  256→10, one untagged per-feature scale (a passthrough parameter); ReLU, biases.

  Factor dimensions (A, G): (28, 32), 4×(289, 32), (33, 256), 4×(257, 320),
  4×(321, 256), (257, 10). Chosen so that no single layer holds more than 1/8 of
  the gradient and no factor more than 1/8 of the factor numbers: a layout
  with one owner per layer/factor can then in principle reach the P = 8
  targets (the scripts print these lower bounds)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(kd.linen.Conv(32, (3, 3))(x))
    for stride in (1, 2, 1, 2):
      x = nn.relu(kd.linen.Conv(32, (3, 3), strides=stride)(x))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.relu(kd.linen.Dense(256)(x))
    for i in range(8):
      x = nn.relu(kd.linen.Dense(320 if i % 2 == 0 else 256)(x))
      if i == 3:
        x = x * self.param("scale", nn.initializers.ones, (256,))
    return kd.linen.Dense(10)(x)


class CnnMlp12(nn.Module):
  """Twelve comparable layers: conv 3x3 3→48, 48→64, 64→80 (stride 2), 80→80
  three times (strides 1, 2, 1), global mean, Dense 80→256, four Dense
  256→256, Dense 256→10; ReLU, biases. 534,730 parameters, the largest layer
  (257×256) 12.3% of them: no layer over 1/8, yet twelve layers on eight
  devices leave the owners' gradients uneven (57,681 to 78,417 numbers at P =
  8, SP-NGD's layout)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate((48, 64, 80, 80, 80, 80)):
      x = nn.relu(kd.linen.Conv(width, (3, 3), strides=2 if i in (2, 4) else 1)(x))
    x = jnp.mean(x, axis=(1, 2))
    for _ in range(5):
      x = nn.relu(kd.linen.Dense(256)(x))
    return kd.linen.Dense(10)(x)


class MLP(nn.Module):
  """ReLU multilayer perceptron on flattened inputs."""

  widths: tuple[int, ...] = (512, 512)
  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for w in self.widths:
      x = nn.relu(kd.linen.Dense(w)(x))
    return kd.linen.Dense(self.classes)(x)


class CNN(nn.Module):
  """Conv(32)-pool-Conv(64)-pool-Conv(64)-global mean-Dense, 3x3 kernels, ReLU."""

  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(kd.linen.Conv(32, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(kd.linen.Conv(64, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(kd.linen.Conv(64, (3, 3))(x))
    x = jnp.mean(x, axis=(1, 2))
    return kd.linen.Dense(self.classes)(x)


class DigitsCNN(nn.Module):
  """examples/digits.py's CNN: Conv3x3(16)-Conv3x3/2(32)-Dense(64)-Dense(10), ReLU."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(kd.linen.Conv(16, (3, 3))(x))
    x = nn.relu(kd.linen.Conv(32, (3, 3), strides=(2, 2))(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(kd.linen.Dense(64)(x))
    return kd.linen.Dense(10)(x)


class Autoencoder(nn.Module):
  """examples/autoencoder.py's model: tanh encoder, linear code, mirrored
  decoder, logits of the `outputs` pixels."""

  sizes: tuple[int, ...] = (256, 128, 64, 16)   # encoder; the last is the code
  outputs: int = 64

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    *hidden, code = self.sizes
    for width in hidden:
      x = jnp.tanh(kd.linen.Dense(width)(x))
    x = kd.linen.Dense(code)(x)                     # linear code layer
    for width in reversed(hidden):
      x = jnp.tanh(kd.linen.Dense(width)(x))
    return kd.linen.Dense(self.outputs)(x)


# Module names of the Transformer, per naming: "named" (step_time and
# stale_statistics) or "auto" (convergence: Flax's automatic names, which its
# results were measured with; in its block `Dense(d)(gelu(Dense(4d)(h)))`
# constructs the outer Dense first, so Dense_0 is fc2).
NAMINGS = {
    "named": dict(embed="embed", block="block{}", ln1="ln1", ln2="ln2", fc1="fc1",
                  fc2="fc2", ln_f="ln_f", head="head"),
    "auto": dict(embed="tok", block="Block_{}", ln1="LayerNorm_0", ln2="LayerNorm_1",
                 fc1="Dense_1", fc2="Dense_0", ln_f="LayerNorm_0", head="Dense_0"),
}


class TransformerBlock(nn.Module):
  """Pre-LN block: x + o(attention(LN(x))), then x + fc2(GELU(fc1(LN(x)))).

  Causal softmax attention with `DenseGeneral` q/k/v [d] → [heads, d/heads]
  and o [heads, d/heads] → [d]; masked scores are set to `mask_value`."""

  heads: int = 4
  mlp_ratio: int = 4
  naming: str = "named"
  mask_value: float | None = None      # None: the dtype's most negative number

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    names = NAMINGS[self.naming]
    d = x.shape[-1]
    hd = d // self.heads
    h = kd.linen.LayerNorm(name=names["ln1"])(x)
    q, k, v = (kd.linen.DenseGeneral((self.heads, hd), name=n)(h) for n in "qkv")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    masked = jnp.finfo(s.dtype).min if self.mask_value is None else self.mask_value
    s = jnp.where(causal, s, masked)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    x = x + kd.linen.DenseGeneral(d, axis=(-2, -1), name="o")(o)
    h = kd.linen.LayerNorm(name=names["ln2"])(x)
    h = nn.gelu(kd.linen.Dense(self.mlp_ratio * d, name=names["fc1"])(h))
    return x + kd.linen.Dense(d, name=names["fc2"])(h)


class CharLM(nn.Module):
  """Token + position embeddings, `blocks` TransformerBlocks, LN, vocab head."""

  vocab: int
  width: int = 64
  blocks: int = 2
  heads: int = 4
  context: int = 64
  naming: str = "named"
  mask_value: float | None = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    names = NAMINGS[self.naming]
    # Position ids built from the tokens, so that under shard_map they vary
    # over the devices like the tokens (the embedding's captured statistics
    # and its skipped-statistics placeholders must agree in that type).
    positions = jnp.arange(tokens.shape[1]) + 0 * tokens
    x = (kd.linen.Embed(self.vocab, self.width, name=names["embed"])(tokens)
         + kd.linen.Embed(self.context, self.width, name="pos")(positions))
    for i in range(self.blocks):
      x = TransformerBlock(self.heads, naming=self.naming, mask_value=self.mask_value,
                           name=names["block"].format(i))(x)
    x = kd.linen.LayerNorm(name=names["ln_f"])(x)
    return kd.linen.Dense(self.vocab, name=names["head"])(x)

  def describe(self) -> str:
    return (f"CharLM: embeddings (vocab {self.vocab}, context {self.context}) of width "
            f"{self.width}, {self.blocks} pre-LN blocks ({self.heads}-head causal "
            f"attention, DenseGeneral q/k/v/o; MLP {self.width}→{4 * self.width}→"
            f"{self.width}, GELU), LayerNorm, Dense head")


class Bottleneck(nn.Module):
  """ResNet v1.5 bottleneck (stride on the 3x3 conv), BatchNorm untagged."""

  width: int
  stride: int
  project: bool

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    bn = lambda: nn.BatchNorm(use_running_average=True)
    y = nn.relu(bn()(kd.linen.Conv(self.width, (1, 1), use_bias=False)(x)))
    y = nn.relu(bn()(kd.linen.Conv(self.width, (3, 3), strides=self.stride,
                                   use_bias=False)(y)))
    y = bn()(kd.linen.Conv(4 * self.width, (1, 1), use_bias=False)(y))
    if self.project:
      x = bn()(kd.linen.Conv(4 * self.width, (1, 1), strides=self.stride,
                             use_bias=False)(x))
    return nn.relu(y + x)


class ResNet50(nn.Module):
  """ResNet-50 v1.5: convolutions without bias, FC 2048→1000 with bias."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = kd.linen.Conv(64, (7, 7), strides=2, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
    x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
      for block in range(blocks):
        x = Bottleneck(width, 2 if block == 0 and stage > 0 else 1, block == 0)(x)
    return kd.linen.Dense(1000)(jnp.mean(x, axis=(1, 2)))


class EncoderLayer(nn.Module):
  """BERT encoder layer: tagged Q, K, V, O and FFN, untagged LayerNorms."""

  hidden: int = 1024
  heads: int = 16
  ffn: int = 4096

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    split = lambda z: z.reshape(b, t, self.heads, self.hidden // self.heads)
    q = split(kd.linen.Dense(self.hidden, name="query")(x))
    k = split(kd.linen.Dense(self.hidden, name="key")(x))
    v = split(kd.linen.Dense(self.hidden, name="value")(x))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]))
    a = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, self.hidden)
    x = nn.LayerNorm()(x + kd.linen.Dense(self.hidden, name="output")(a))
    h = nn.gelu(kd.linen.Dense(self.ffn, name="intermediate")(x))
    return nn.LayerNorm()(x + kd.linen.Dense(self.hidden, name="ffn_output")(h))


class BertLarge(nn.Module):
  """BERT-Large: untagged embeddings, 24 encoder layers, tagged pooler,
  untagged 2-way classifier; no vocabulary decoder."""

  layers: int = 24
  hidden: int = 1024
  vocab: int = 30522

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    x = nn.Embed(self.vocab, self.hidden)(tokens)
    x = x + nn.Embed(512, self.hidden)(jnp.arange(t))[None]
    x = x + nn.Embed(2, self.hidden)(jnp.zeros_like(tokens))
    x = nn.LayerNorm()(x)
    for _ in range(self.layers):
      x = EncoderLayer(self.hidden)(x)
    pooled = jnp.tanh(kd.linen.Dense(self.hidden, name="pooler")(x[:, 0]))
    return nn.Dense(2, name="classifier")(pooled)      # untagged


class _ScannedBlock(nn.Module):
  """A `TransformerBlock` with `nn.scan`'s signature `(carry, x) -> (carry, y)`."""

  heads: int

  @nn.compact
  def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
    return TransformerBlock(self.heads, name="block")(x), None


class Gpt2Xl(nn.Module):
  """GPT-2-XL's shapes: 48 pre-LN blocks of width 1600 (25 heads, MLP 6400)
  under one `nn.scan` (a stacked layer per projection, `[48, ...]`); token
  (vocabulary 50257) and position embeddings untagged, the head tied to the
  token embedding and untagged (the vocabulary is skipped)."""

  layers: int = 48
  width: int = 1600
  heads: int = 25
  vocab: int = 50257
  context: int = 1024

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(self.vocab, self.width, name="wte")
    x = embed(tokens) + nn.Embed(self.context, self.width, name="wpe")(
        jnp.arange(tokens.shape[1]))[None]
    blocks = nn.scan(_ScannedBlock, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.layers)
    x, _ = blocks(self.heads, name="blocks")(x, None)
    return embed.attend(kd.linen.LayerNorm(name="ln_f")(x))


# ------------------------------------------------------------ plain-JAX models

def dense_init(key: jax.Array, n_in: int, n_out: int) -> Params:
  """He-normal kernel [n_in, n_out], zero bias."""
  return {"kernel": jax.random.normal(key, (n_in, n_out)) * np.sqrt(2.0 / n_in),
          "bias": jnp.zeros(n_out)}


def conv_init(key: jax.Array, c_in: int, c_out: int) -> Params:
  """He-normal 3x3 kernel [3, 3, c_in, c_out] (HWIO), zero bias."""
  return {"kernel": jax.random.normal(key, (3, 3, c_in, c_out)) * np.sqrt(2.0 / (9 * c_in)),
          "bias": jnp.zeros(c_out)}


def dense(x: jax.Array, p: Params, tagged: bool = False, name: str = "") -> jax.Array:
  """x @ kernel + bias; `tagged`: through `kd.tags.dense` (the same numbers)."""
  if tagged:
    return kd.tags.dense(x, p["kernel"], p["bias"], name=name)
  return x @ p["kernel"] + p["bias"]


def conv(x: jax.Array, p: Params, stride: int, tagged: bool = False,
         name: str = "") -> jax.Array:
  """SAME-padded NHWC convolution + bias; `tagged`: through `kd.tags.conv2d`."""
  if tagged:
    return kd.tags.conv2d(x, p["kernel"], p["bias"], strides=(stride, stride),
                          padding="SAME", name=name)
  y = jax.lax.conv_general_dilated(x, p["kernel"], (stride, stride), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return y + p["bias"]


def dense_stack_init(key: jax.Array, sizes: tuple[int, ...]) -> Params:
  """Dense layers d0, d1, ... of sizes[i] → sizes[i + 1]."""
  keys = jax.random.split(key, len(sizes) - 1)
  return {f"d{i}": dense_init(keys[i], a, b)
          for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def dense_stack_apply(p: Params, x: jax.Array, tagged: bool = False,
                      linear: tuple[int, ...] = ()) -> jax.Array:
  """The dense layers of `dense_stack_init` on flattened inputs, ReLU after
  every layer but the last and those in `linear`."""
  h = x.reshape(x.shape[0], -1)
  n = len(p)
  for i in range(n):
    h = dense(h, p[f"d{i}"], tagged, f"d{i}")
    if i < n - 1 and i not in linear:
      h = jax.nn.relu(h)
  return h


# Step-time models (step_time.py, memory.py's step peaks).
LM_VOCAB, LM_CONTEXT = 96, 64


def step_problem(name: str):
  """(model, params, x, y, description) of benchmarks/step_time.py's model
  `name` ("mlp", "cnn", "lm") with a fixed synthetic batch."""
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  if name == "mlp":
    model = MLP()
    x = jax.random.normal(kx, (256, 784), jnp.float32)
    y = jax.random.randint(ky, (256,), 0, 10)
    desc = "MLP 784-512-512-10, ReLU, batch 256, synthetic data"
  elif name == "cnn":
    model = CNN()
    x = jax.random.normal(kx, (128, 32, 32, 3), jnp.float32)
    y = jax.random.randint(ky, (128,), 0, 10)
    desc = ("CNN conv3x3(32)-pool-conv3x3(64)-pool-conv3x3(64)-mean-dense(10), "
            "32x32x3, batch 128, synthetic data")
  elif name == "lm":
    model = CharLM(LM_VOCAB, width=128, blocks=2, heads=4, context=LM_CONTEXT)
    x = jax.random.randint(kx, (32, LM_CONTEXT), 0, LM_VOCAB)
    y = jax.random.randint(ky, (32, LM_CONTEXT), 0, LM_VOCAB)
    desc = (model.describe() + f"; batch 32 x {LM_CONTEXT} tokens, synthetic tokens, "
            "cross-entropy at every position")
  else:
    raise ValueError(f"unknown model {name!r} (mlp, cnn, lm)")
  params = model.init(kp, x)
  return model, params, x, y, desc


# --------------------------------- a pipelined, tensor-parallel stack (3-D mesh)

PIPELINE_AXES = ("data", "model", "stage")


def pipeline_problem(blocks: int = 8, width: int = 256, hidden: int = 1024,
                     classes: int = 256, batch: int = 64):
  """Residual Megatron MLP blocks stacked `[L, ...]` and a Dense head, for a
  `("data", "model", "stage")` mesh (as tests/test_mesh3d.py, larger):
  `(params, param_specs, pipeline_loss, flat_loss, x, y)`. The stack is
  sharded over "stage" on its stack axis and its hidden units over "model";
  `pipeline_loss` runs inside shard_map over the three axes (stage s runs its
  L/S blocks in round s, activations passed on by `ppermute`); `flat_loss`
  is the same model on a mesh without model axes (one scan over the L blocks)."""
  k = jax.random.split(jax.random.key(1), 5)
  params = {"up": {"kernel": jax.random.normal(k[0], (blocks, width, hidden))
                   * np.sqrt(1.0 / width), "bias": jnp.zeros((blocks, hidden))},
            "down": {"kernel": jax.random.normal(k[1], (blocks, hidden, width))
                     * np.sqrt(0.5 / hidden / blocks)},
            "head": dense_init(k[2], width, classes)}
  specs = {"up": {"kernel": jax.sharding.PartitionSpec("stage", None, "model"),
                  "bias": jax.sharding.PartitionSpec("stage", "model")},
           "down": {"kernel": jax.sharding.PartitionSpec("stage", "model", None)},
           "head": jax.sharding.PartitionSpec()}
  x = jax.random.normal(k[3], (batch, width), jnp.float32)
  y = jax.random.randint(k[4], (batch,), 0, classes)

  def run_blocks(p, h, reduce):
    def block(h, i):
      u = jax.nn.gelu(kd.tags.dense(h, p["up"]["kernel"], p["up"]["bias"],
                                    stack_index=i))
      return h + reduce(kd.tags.dense(u, p["down"]["kernel"], stack_index=i)), None
    return jax.lax.scan(block, h, jnp.arange(p["up"]["kernel"].shape[0]))[0]

  def head(p, h, y):
    return kd.losses.softmax_cross_entropy(
        kd.tags.dense(h, p["head"]["kernel"], p["head"]["bias"]), y)

  def pipeline_loss(p, x, y):
    stages = jax.lax.axis_size("stage")
    stage = jax.lax.axis_index("stage")
    reduce = lambda z: jax.lax.psum(z, "model")

    def one_round(h, r):
      h = jax.lax.cond(stage == r, lambda h: run_blocks(p, h, reduce), lambda h: h, h)
      return jax.lax.ppermute(h, "stage", [(s, (s + 1) % stages)
                                           for s in range(stages)]), None
    h = jax.lax.scan(one_round, _stage_varying(x), jnp.arange(stages))[0]
    return head(p, jax.lax.psum(jnp.where(stage == 0, h, 0.0), "stage"), y)

  def flat_loss(p, x, y):
    return head(p, run_blocks(p, x, lambda z: z), y)
  return params, specs, pipeline_loss, flat_loss, x, y


def _stage_varying(x: jax.Array) -> jax.Array:
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, ("stage",), to="varying")
  return jax.lax.pvary(x, ("stage",))
