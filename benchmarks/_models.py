"""The models of the benchmarks, built once from `kd.linen` layers.

Outside `kd.value_and_grad` the tagged layers are plain Flax computations, so
first-order baselines run the very same models.

* `MLP`: ReLU multilayer perceptron (step_time's 784-512-512-10);
* `CNN`: Conv(32)-pool-Conv(64)-pool-Conv(64)-global mean-Dense, 3x3 kernels,
  ReLU (step_time's CIFAR-shaped model);
* `TransformerBlock` / `CharLM`: a pre-LayerNorm decoder-only Transformer
  (causal attention with DenseGeneral q/k/v/o projections, GELU MLP) over
  token and position embeddings, every parameter in a tagged layer.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kfac_jax_dist as kd


class MLP(nn.Module):
  widths: tuple[int, ...] = (512, 512)
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for w in self.widths:
      x = nn.relu(kd.linen.Dense(w)(x))
    return kd.linen.Dense(self.classes)(x)


class CNN(nn.Module):
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(32, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(kd.linen.Conv(64, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(kd.linen.Conv(64, (3, 3))(x))
    x = jnp.mean(x, axis=(1, 2))
    return kd.linen.Dense(self.classes)(x)


class TransformerBlock(nn.Module):
  """Pre-LN block: x + o(attention(LN(x))), then x + fc2(GELU(fc1(LN(x))))."""

  heads: int = 4
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    hd = d // self.heads
    h = kd.linen.LayerNorm(name="ln1")(x)
    q, k, v = (kd.linen.DenseGeneral((self.heads, hd), name=n)(h) for n in "qkv")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    x = x + kd.linen.DenseGeneral(d, axis=(-2, -1), name="o")(o)
    h = kd.linen.LayerNorm(name="ln2")(x)
    h = nn.gelu(kd.linen.Dense(self.mlp_ratio * d, name="fc1")(h))
    return x + kd.linen.Dense(d, name="fc2")(h)


class CharLM(nn.Module):
  """Token + position embeddings, `blocks` TransformerBlocks, LN, vocab head."""

  vocab: int
  width: int = 64
  blocks: int = 2
  heads: int = 4
  context: int = 64

  @nn.compact
  def __call__(self, tokens):
    # Position ids built from the tokens, so that under shard_map they vary
    # over the devices like the tokens (the embedding's captured statistics
    # and its skipped-statistics placeholders must agree in that type).
    positions = jnp.arange(tokens.shape[1]) + 0 * tokens
    x = (kd.linen.Embed(self.vocab, self.width, name="embed")(tokens)
         + kd.linen.Embed(self.context, self.width, name="pos")(positions))
    for i in range(self.blocks):
      x = TransformerBlock(self.heads, name=f"block{i}")(x)
    return kd.linen.Dense(self.vocab, name="head")(kd.linen.LayerNorm(name="ln_f")(x))

  def describe(self) -> str:
    return (f"CharLM: embeddings (vocab {self.vocab}, context {self.context}) of width "
            f"{self.width}, {self.blocks} pre-LN blocks ({self.heads}-head causal "
            f"attention, DenseGeneral q/k/v/o; MLP {self.width}→{4 * self.width}→"
            f"{self.width}, GELU), LayerNorm, Dense head")
