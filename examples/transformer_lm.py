"""K-FAC vs AdamW on a small character-level Transformer language model.

The corpus ships with every CPython: `pydoc_data.topics`, the text of the
Python Language Reference / library topics that `help("assert")` prints (79
topics, about 465k characters of English prose, grammar and code on Python
3.11; other Python versions ship slightly different editions, and so slightly
different numbers). The topics are joined in sorted order; the first 90% of
the characters are the training text, the last 10% the validation text; the
vocabulary is the set of characters of the corpus (about 100).

The model is a pre-LayerNorm decoder-only Transformer (default: 2 blocks,
width 64, 4 heads, context 64) built only from tagged layers, so K-FAC
preconditions every parameter:

* token and position embeddings: `kd.linen.Embed` (diagonal `A`, the token
  frequencies);
* attention: `kd.linen.DenseGeneral` projections `d -> (heads, head_dim)` for
  q, k, v and `(heads, head_dim) -> d` for the output, causal softmax;
* `kd.linen.LayerNorm` (SP-NGD's unit-wise 2x2 Fisher per channel) before the
  attention, before the MLP and before the output layer;
* MLP `kd.linen.Dense` d -> 4d -> d (GELU), output `kd.linen.Dense` d -> vocab;
* loss `kd.losses.softmax_cross_entropy` over every position.

Compared from the same initial weights on the same batch sequence:

* K-FAC: `kd.kfac` (eigendecomposition-based damped inverse of `A ⊗ G`,
  KAISA's KL clip, SGD with momentum 0.9), factors every 5 steps,
  eigendecompositions every 50;
* AdamW (weight decay 0.01, 50 warm-up steps, then constant) at learning rates
  3e-3, 1e-2 and 2e-2 (1e-2 was the best of 1e-3 .. 3e-2 on this problem).

K-FAC's defaults (damping 1e-3, KL clip 2.5e-4, momentum 0.9) were tuned on
seed 0: here the KL clip binds, so it sets the step length (a smaller clip
gave steadier progress than KAISA's 1e-3).

Reported: steps and training seconds (compilation and evaluation excluded)
until the validation loss first falls to `--target` nats per character, and
the final validation loss.

`--adaptive` also trains adaptive K-FAC, which needs no tuning, with the
library's defaults (`_adaptive_log` describes it and its options); η, μ, λ
and ρ are written to `transformer_lm.csv`.
With `--devices N` it runs under the same `kd.Distribution` as K-FAC.
`--skip-fixed-kfac` leaves the fixed-hyperparameter K-FAC out.

Data parallel over N devices: `--devices N` runs every step under
`jax.shard_map` over a mesh of N devices (N host CPU devices, set with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` before jax starts; on a
machine with N accelerators, those), each device taking `batch/N` sequences.
K-FAC gets a `kd.Distribution` with `--grad-worker-fraction`: 1 is KAISA's
COMM-OPT, 1/N MEM-OPT, in between HYBRID-OPT; the updates are the same as on
one device (to float32 rounding), so only the time per step changes (on a
2-core machine N virtual devices are slower than one). AdamW averages the
gradients with `lax.pmean`.

    python examples/transformer_lm.py                    # a few minutes on 2 CPU cores
    python examples/transformer_lm.py --devices 8 --grad-worker-fraction 0.25
    python examples/transformer_lm.py --steps 3000 --layers 4 --width 128
    python examples/transformer_lm.py --adaptive         # adaptive K-FAC beside the others

Writes `transformer_lm.csv` (one row per evaluation) and `transformer_lm.png`
(validation loss against step and against seconds) into `--out`, and prints a
short sample from the (first) K-FAC model.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time


# N host CPU devices and OPENBLAS_NUM_THREADS, before jax initialises.
import _host_devices  # noqa: E402

_N = _host_devices.request_from_argv()

# pylint: disable=wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kfac_jax_dist as kd  # noqa: E402
import _adaptive_log  # noqa: E402
from _adaptive_log import ADAPTED, summary  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# ---------------------------------------------------------------------- data

def load_corpus() -> str:
  """The pydoc help topics of this Python, joined in sorted order."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


@dataclasses.dataclass
class Corpus:
  train: np.ndarray            # int32 token ids
  valid: np.ndarray
  chars: list[str]

  @classmethod
  def make(cls, text: str, valid_fraction: float = 0.1) -> "Corpus":
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    tokens = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    split = int(len(tokens) * (1 - valid_fraction))
    return cls(tokens[:split], tokens[split:], chars)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)


def windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """[len(starts), length] windows of `tokens`."""
  return tokens[starts[:, None] + np.arange(length)[None, :]]


# --------------------------------------------------------------------- model

class Block(nn.Module):
  """Pre-LN Transformer block: causal multi-head attention, then a GELU MLP."""

  heads: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    head_dim = d // self.heads
    h = kd.linen.LayerNorm()(x)
    q, k, v = (kd.linen.DenseGeneral((self.heads, head_dim), name=n)(h) for n in "qkv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    t = x.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    x = x + kd.linen.DenseGeneral(d, axis=(-2, -1), name="o")(o)
    h = kd.linen.LayerNorm()(x)
    h = nn.gelu(kd.linen.Dense(4 * d)(h))
    return x + kd.linen.Dense(d)(h)


class CharTransformer(nn.Module):
  vocab: int
  width: int = 64
  layers: int = 2
  heads: int = 4
  context: int = 64

  @nn.compact
  def __call__(self, tokens):
    # Position ids built from `tokens` (not a broadcast constant), so that under
    # shard_map they are per-device values like the tokens: the embedding's
    # statistics are then per-device too.
    positions = jnp.zeros_like(tokens) + jnp.arange(tokens.shape[1])
    x = (kd.linen.Embed(self.vocab, self.width, name="tokens")(tokens)
         + kd.linen.Embed(self.context, self.width, name="positions")(positions))
    for _ in range(self.layers):
      x = Block(self.heads)(x)
    x = kd.linen.LayerNorm()(x)
    return kd.linen.Dense(self.vocab)(x)


# ------------------------------------------------------------------ training

@dataclasses.dataclass
class Result:
  """Validation-loss curve of one method, one entry per evaluation."""

  name: str
  steps: list[int]
  seconds: list[float]
  valid: list[float]
  train: list[float]
  params: object = None
  # Adaptive K-FAC only: η = −α, μ, λ and ρ at each evaluation (else empty).
  adapted: dict[str, list[float]] = dataclasses.field(default_factory=dict)

  def first_reaching(self, target: float):
    for step, sec, loss in zip(self.steps, self.seconds, self.valid):
      if loss <= target:
        return step, sec
    return None


def _varying(tree):
  """Marks replicated values as varying over "data" inside shard_map, so that
  `jax.grad` returns each device's local gradient (no automatic psum)."""
  if hasattr(jax.lax, "pcast"):
    return jax.tree.map(lambda v: jax.lax.pcast(v, ("data",), to="varying"), tree)
  return jax.tree.map(lambda v: jax.lax.pvary(v, ("data",)), tree)


def make_step(tx, loss_fn, use_kfac: bool, mesh=None, opt_state=None, adaptive=False):
  """The jitted training step `(params, opt_state, batch) -> (params, opt_state,
  loss)`: plain `jit` on one device; with a `mesh`, `jit(shard_map)` over its
  axis "data" (`opt_state`, placed on the mesh, gives the partition specs).
  `adaptive`: `tx` is adaptive K-FAC, whose update also takes the batch."""
  grad_fn = kd.value_and_grad(loss_fn)

  def step(params, opt_state, batch):
    if use_kfac:
      # Inside shard_map: this device's loss, gradients and statistics.
      loss, grads, stats = grad_fn(params, batch, opt_state=opt_state)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(
          params if mesh is None else _varying(params), batch)
    if mesh is not None:
      grads, loss = jax.lax.pmean((grads, loss), "data")
    if use_kfac:
      # kfac_batch: the arguments grad_fn received after the parameters (under
      # shard_map this device's; the curvature products are averaged over "data").
      extra = {"kfac_batch": (batch,)} if adaptive else {}
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats, **extra)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # Params and state donated: XLA updates them in place (on a GPU a loop
  # without donation was up to 2x slower: benchmarks/results/gpu/summary.md).
  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  specs = (kd.partition_specs(opt_state) if use_kfac
           else jax.tree.map(lambda _: P(), opt_state))
  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs, P())), donate_argnums=(0, 1))


def train(name, tx, params, batches, valid_batch, eval_every, use_kfac, loss_fn, mesh=None,
          adaptive=False):
  """Trains from `params` on `batches` (host token windows); returns the curve.
  `adaptive`: `tx` is adaptive K-FAC (η, μ, λ, ρ are logged)."""
  params = jax.tree.map(jnp.copy, params)      # the step donates it; the caller's stays
  opt_state = tx.init(params)
  if mesh is not None:
    replicated = jax.sharding.NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = (kd.shard_state(opt_state, mesh) if use_kfac
                 else jax.device_put(opt_state, replicated))
  step = make_step(tx, loss_fn, use_kfac, mesh, opt_state, adaptive)
  valid_batch = jnp.asarray(valid_batch)
  evaluate = jax.jit(lambda p: loss_fn(p, valid_batch))

  # Compile (and run once, discarding the result) before timing anything.
  jax.block_until_ready(step(*jax.tree.map(jnp.copy, (params, opt_state)), batches[0]))
  jax.block_until_ready(evaluate(params))

  result = Result(name, [0], [0.0], [float(evaluate(params))], [float("nan")])
  if adaptive:
    result.adapted = {k: [float("nan")] for k in ADAPTED}
  elapsed, recent = 0.0, []
  bar = tqdm(range(len(batches)), desc=f"{name:>15}", leave=True, ncols=100)
  for t in bar:
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batches[t])
    jax.block_until_ready(params)
    elapsed += time.perf_counter() - start
    recent.append(loss)
    if (t + 1) % eval_every == 0 or t + 1 == len(batches):
      valid = float(evaluate(params))
      train_loss = float(np.mean(jax.device_get(recent)))
      recent = []
      result.steps.append(t + 1)
      result.seconds.append(elapsed)
      result.valid.append(valid)
      result.train.append(train_loss)
      shown = dict(train=f"{train_loss:.3f}", valid=f"{valid:.3f}")
      if adaptive:
        _adaptive_log.record(opt_state, result.adapted, shown)
      bar.set_postfix(shown, refresh=False)
  result.params = params
  return result


def sample(model, params, corpus: Corpus, prompt: str, length: int, seed: int = 0) -> str:
  """`length` characters sampled (temperature 0.8) after `prompt`."""
  context = model.context
  lookup = {c: i for i, c in enumerate(corpus.chars)}
  ids = [lookup.get(c, 0) for c in prompt][-context:]

  @jax.jit
  def next_logits(window, n):
    return model.apply({"params": params}, window[None])[0, n - 1]

  key = jax.random.PRNGKey(seed)
  out = []
  for _ in range(length):
    n = len(ids)
    window = jnp.asarray(ids + [0] * (context - n), jnp.int32)
    key, sub = jax.random.split(key)
    token = int(jax.random.categorical(sub, next_logits(window, n) / 0.8))
    out.append(token)
    ids = (ids + [token])[-context:]
  return corpus.decode(out)


# ------------------------------------------------------------------- output

def report(results: list[Result], target: float) -> str:
  header = ["method", f"steps to {target:g}", f"seconds to {target:g}", "final valid",
            "final train"]
  rows = []
  for r in results:
    hit = r.first_reaching(target)
    rows.append([r.name, str(hit[0]) if hit else "-", f"{hit[1]:.1f}" if hit else "-",
                 f"{r.valid[-1]:.4f}", f"{r.train[-1]:.4f}"])
  widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
  line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  table = [line(header), sep] + [line(row) for row in rows]
  table += [summary(r.name, r.adapted) for r in results if r.adapted]
  return "\n".join(table)


def save(results: list[Result], out: str, target: float, title: str) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "transformer_lm.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["method", "step", "seconds", "valid_loss", "train_loss", *ADAPTED])
    for r in results:
      for i, row in enumerate(zip(r.steps, r.seconds, r.valid, r.train)):
        adapted = [f"{r.adapted[k][i]:.6g}" if r.adapted else "" for k in ADAPTED]
        writer.writerow([r.name, row[0], f"{row[1]:.4f}", f"{row[2]:.5f}", f"{row[3]:.5f}",
                         *adapted])

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  others = iter(["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown",
                 "tab:pink", "tab:olive", "tab:cyan"] * len(results))
  for r in results:
    style = (dict(lw=2.5, color="tab:red") if r.adapted else
             dict(lw=2.5, color="black") if r.name.startswith("K-FAC") else
             dict(lw=1.3, color=next(others)))
    axes[0].plot(r.steps, r.valid, label=r.name, **style)
    axes[1].plot(r.seconds, r.valid, label=r.name, **style)
  top = min(max(r.valid[0] for r in results), 4.6)
  for ax, xlabel in zip(axes, ["step", "training seconds (compile excluded)"]):
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylim(min(min(r.valid) for r in results) - 0.1, top)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("validation loss (nats / character)")
  axes[0].legend(loc="upper right")
  fig.suptitle(f"{title} (dashed: {target:g})")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "transformer_lm.png"), dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=600, help="training steps per method")
  parser.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
  parser.add_argument("--context", type=int, default=64, help="sequence length")
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial weights and the batches")
  parser.add_argument("--eval-every", type=int, default=20,
                      help="evaluate the validation loss every this many steps")
  parser.add_argument("--valid-sequences", type=int, default=256,
                      help="validation windows (fixed, spread over the validation text)")
  parser.add_argument("--target", type=float, default=1.6,
                      help="validation loss target (nats per character)")
  parser.add_argument("--sample", type=int, default=200,
                      help="characters to sample from the K-FAC model at the end (0: none)")
  parser.add_argument("--out", default="examples/out", help="output directory")
  dist = parser.add_argument_group("data parallel")
  dist.add_argument("--devices", type=int, default=1,
                    help="devices of the data axis; > 1 runs under shard_map (host CPU "
                         "devices are created when jax starts)")
  dist.add_argument("--grad-worker-fraction", type=float, default=1.0,
                    help="K-FAC gradient workers per layer / devices: 1 COMM-OPT, "
                         "1/N MEM-OPT, between HYBRID-OPT")
  dist.add_argument("--factor-reduction", default="reduce_scatter",
                    choices=["reduce_scatter", "all_reduce", "local"],
                    help="how the factors reach their owners ('local': DP-KFAC)")
  kfac = parser.add_argument_group("K-FAC")
  kfac.add_argument("--kfac-lr", type=float, default=0.1,
                    help="learning rate (the KL clip usually binds and sets the step)")
  kfac.add_argument("--kfac-momentum", type=float, default=0.9)
  kfac.add_argument("--damping", type=float, default=1e-3)
  kfac.add_argument("--kl-clip", type=float, default=2.5e-4,
                    help="KAISA's KL clip: bound on lr^2 * |<update, grad>| (0: off)")
  kfac.add_argument("--factor-decay", type=float, default=0.95)
  kfac.add_argument("--factor-every", type=int, default=5,
                    help="update the Kronecker factors every this many steps")
  kfac.add_argument("--inverse-every", type=int, default=50,
                    help="recompute the eigendecompositions every this many steps")
  _adaptive_log.add_arguments(kfac)
  base = parser.add_argument_group("baseline")
  base.add_argument("--adamw-lrs", type=float, nargs="+", default=[3e-3, 1e-2, 2e-2])
  base.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's")
  base.add_argument("--warmup", type=int, default=50, help="AdamW linear warm-up steps")
  base.add_argument("--skip-baselines", action="store_true",
                    help="train K-FAC only (for tuning)")
  args = parser.parse_args()
  if args.steps < 1:
    parser.error(f"--steps {args.steps}: at least 1")
  if args.devices < 1 or args.batch_size % args.devices:
    parser.error(f"--batch-size {args.batch_size} is not a multiple of --devices "
                 f"{args.devices}")
  if args.width % args.heads:
    parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
  if args.skip_fixed_kfac and args.skip_baselines and not args.adaptive:
    parser.error("nothing to train: --skip-fixed-kfac and --skip-baselines without "
                 "--adaptive")

  corpus = Corpus.make(load_corpus())
  rng = np.random.default_rng(args.seed)
  starts = rng.integers(0, len(corpus.train) - args.context - 1,
                        size=(args.steps, args.batch_size))
  batches = np.stack([windows(corpus.train, s, args.context + 1) for s in starts])
  valid_starts = np.linspace(0, len(corpus.valid) - args.context - 2,
                             args.valid_sequences).astype(np.int64)
  valid_batch = windows(corpus.valid, valid_starts, args.context + 1)
  print(f"corpus: pydoc_data.topics of Python {sys.version.split()[0]}, "
        f"{len(corpus.train) + len(corpus.valid)} characters "
        f"({len(corpus.train)} train / {len(corpus.valid)} valid), vocabulary "
        f"{len(corpus.chars)}; uniform loss {np.log(len(corpus.chars)):.3f}")

  mesh = None
  if args.devices > 1:
    if jax.device_count() < args.devices:
      sys.exit(f"--devices {args.devices}: jax sees only {jax.device_count()} devices "
               "(XLA_FLAGS was already set before starting?)")
    mesh = Mesh(np.array(jax.devices()[:args.devices]), ("data",))
    print(f"data parallel over {args.devices} {jax.devices()[0].platform} devices, "
          f"{args.batch_size // args.devices} sequences each")

  model = CharTransformer(len(corpus.chars), args.width, args.layers, args.heads,
                          args.context)
  params = model.init(jax.random.PRNGKey(args.seed), jnp.asarray(batches[0][:1, :-1]))
  params = params["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch[:, :-1])
    return kd.losses.softmax_cross_entropy(logits, batch[:, 1:])

  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, jnp.asarray(batches[0]))
  distribution = None
  where = ""
  if mesh is not None:
    distribution = kd.Distribution(mesh, axis="data",
                                   grad_worker_fraction=args.grad_worker_fraction,
                                   factor_reduction=args.factor_reduction)
    where = (f" x{args.devices} (m={distribution.group_size}"
             f"{', DP-KFAC' if args.factor_reduction == 'local' else ''})")
  methods = []      # (name, transform, K-FAC?, adaptive?)
  if not args.skip_fixed_kfac:
    kfac_tx = kd.kfac(args.kfac_lr, momentum=args.kfac_momentum,
                      kl_clip=args.kl_clip or None, layers=layers, damping=args.damping,
                      factor_decay=args.factor_decay, factor_update_every=args.factor_every,
                      inverse_update_every=args.inverse_every, distribution=distribution)
    kd.describe(kfac_tx.init(params))
    methods.append(("K-FAC" + where, kfac_tx, True, False))
  if args.adaptive:
    # learning_rate=None, momentum=None: both adapted; the rest the library's defaults.
    adaptive_tx = kd.kfac(None, None, layers=layers, grad_fn=grad_fn,
                          damping=args.adaptive_damping,
                          min_damping=args.adaptive_min_damping, adapt_damping=True,
                          distribution=distribution)
    if args.skip_fixed_kfac:
      kd.describe(adaptive_tx.init(params))
    methods.append(("K-FAC adaptive" + where, adaptive_tx, True, True))
  if not args.skip_baselines:
    for lr in args.adamw_lrs:
      schedule = optax.join_schedules(
          [optax.linear_schedule(0.0, lr, args.warmup), optax.constant_schedule(lr)],
          [args.warmup])
      methods.append((f"AdamW lr={lr:g}" + (f" x{args.devices}" if mesh else ""),
                      optax.adamw(schedule, weight_decay=args.weight_decay), False,
                      False))

  results = [train(name, tx, params, batches, valid_batch, args.eval_every, use_kfac,
                   loss_fn, mesh, adaptive)
             for name, tx, use_kfac, adaptive in methods]
  print()
  print(report(results, args.target))
  title = (f"char Transformer ({args.layers} blocks, width {args.width}, context "
           f"{args.context}) on pydoc topics: validation loss")
  save(results, args.out, args.target, title)
  print(f"\nwrote {os.path.join(args.out, 'transformer_lm.csv')} and "
        f"{os.path.join(args.out, 'transformer_lm.png')}")
  kfac_results = [r for r, (_, _, use_kfac, _) in zip(results, methods) if use_kfac]
  if args.sample and kfac_results:
    prompt = "The \"while\" statement\n*********************\n\n"
    params = jax.device_get(kfac_results[0].params)
    print(f"\n{kfac_results[0].name} model, {args.sample} sampled characters after "
          f"{prompt!r}:\n")
    print(prompt + sample(model, params, corpus, prompt, args.sample, args.seed))


if __name__ == "__main__":
  main()
