"""K-FAC vs Adam on the classic deep-autoencoder benchmark, with the digits images.

The deep autoencoder (Hinton & Salakhutdinov, 2006) is the benchmark on which
K-FAC was first shown to beat first-order methods (Martens & Grosse, 2015): a
deep encoder squeezes the image through a narrow code and a mirrored decoder
reconstructs it, which makes the curvature badly conditioned. Here the images are
scikit-learn's bundled handwritten digits (1797 8x8 grey images, no download),
pixels scaled to [0, 1], split 1437/360 (seeded):

    64 -> 256 -> 128 -> 64 -> 16 (linear code) -> 64 -> 128 -> 256 -> 64 logits

tanh hidden units, every layer a tagged `kd.linen.Dense`, and the reconstruction
loss `kd.losses.sigmoid_cross_entropy(logits, pixels)` (Bernoulli outputs, the
cross-entropies summed over the 64 pixels and averaged over the images).
The pixels are grey levels, not bits, so the loss cannot reach 0: its minimum
is the pixels' own binary entropy (about 13.7 nats per image on the training
set), and what is reported is the loss *above* that floor, which K-FAC and
Adam drive toward 0.

Compared, from the same initial weights on the same mini-batch sequence:

* K-FAC: `kd.kfac` (exact damped inverse of `A ⊗ G` from eigendecompositions,
  KAISA's KL clip, SGD with momentum 0.9), factors refreshed every 5 steps and
  eigendecompositions every 25; the jitted step passes `opt_state=` to
  `kd.value_and_grad`, so statistics are computed only on factor steps;
* Adam at learning rates 1e-3, 3e-3 and 1e-2 (3e-3 was the best of a sweep
  over 1e-3 .. 1e-2 on this problem).

It reports, for each, the steps and the training wall-clock seconds
(compilation and evaluation excluded) until the loss on the whole training set
first falls to `--target` nats above the floor, and the final train/test
values. As in Martens & Grosse, the benchmark measures optimisation, i.e. the
training loss; the test loss is written too, and on these 1437 images K-FAC,
fitting them faster and further without any regularisation, also overfits
them sooner. K-FAC's defaults (damping 0.03, KL clip 1e-2) were tuned on seed 0;
with the KL clip binding, the step length is set by `--kl-clip` more than by
`--kfac-lr`.

`--adaptive` also trains adaptive K-FAC, which needs no tuning, with the
library's defaults (`_adaptive_log` describes it and its options); η, μ, λ
and ρ are written to `autoencoder.csv`. On seed 0 it reached the target in 60
steps and 0.61 s (Adam 3e-3: 350 steps, 1.06 s) with a test loss of 1.85
there, below Adam's 1.97 at its target; it too overfits later (2.10 after 500
steps, Adam 1.77).
`--skip-fixed-kfac` leaves the fixed-hyperparameter K-FAC out.

    python examples/autoencoder.py              # well under a minute on 2 CPU cores
    python examples/autoencoder.py --seed 1 --out /tmp/autoencoder
    python examples/autoencoder.py --adaptive   # adaptive K-FAC beside the others

Writes `autoencoder.csv` (one row per evaluation) and `autoencoder.png` (loss
above the floor against step and against seconds, training solid, test
dashed) into `--out`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import os
import time

# jax's CPU eigh calls OpenBLAS's LAPACK, whose worker threads fight XLA's on a
# few busy cores. Set before numpy/jax load OpenBLAS; an explicit setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# pylint: disable=wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kfac_jax_dist as kd  # noqa: E402
import _adaptive_log  # noqa: E402
from _adaptive_log import ADAPTED, summary  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class Autoencoder(nn.Module):
  """Encoder `sizes` (the last one the linear code), mirrored decoder, 64 logits."""

  sizes: tuple[int, ...] = (256, 128, 64, 16)
  outputs: int = 64

  @nn.compact
  def __call__(self, x):
    *hidden, code = self.sizes
    for width in hidden:
      x = nn.tanh(kd.linen.Dense(width)(x))
    x = kd.linen.Dense(code)(x)                     # the code layer is linear
    for width in reversed(hidden):
      x = nn.tanh(kd.linen.Dense(width)(x))
    return kd.linen.Dense(self.outputs)(x)          # logits of the 64 pixels


def load_data(seed: int):
  """Flattened 8x8 images in [0, 1], split 1437/360 (seeded)."""
  x = (load_digits().data / 16.0).astype(np.float32)
  x_train, x_test = train_test_split(x, test_size=360, random_state=seed)
  return x_train, x_test


def entropy_floor(x: np.ndarray) -> float:
  """The smallest possible sigmoid cross-entropy: mean over images of the
  pixels' summed binary entropies (reached when sigmoid(logits) = pixels)."""
  p = np.clip(x.astype(np.float64), 1e-12, 1 - 1e-12)
  return float(np.mean(np.sum(-(p * np.log(p) + (1 - p) * np.log1p(-p)), axis=-1)))


@dataclasses.dataclass
class Result:
  """Loss curve of one method (above the entropy floor), one entry per evaluation."""

  name: str
  steps: list[int]
  seconds: list[float]
  train: list[float]
  test: list[float]
  # Adaptive K-FAC only: η = −α, μ, λ and ρ at each evaluation (else empty).
  adapted: dict[str, list[float]] = dataclasses.field(default_factory=dict)

  def first_reaching(self, target: float):
    """(step, seconds) of the first evaluation at or below `target`, else None."""
    for step, sec, loss in zip(self.steps, self.seconds, self.train):
      if loss <= target:
        return step, sec
    return None


def train(name, tx, params, data, batches, eval_every, use_kfac, loss_fn, floors,
          adaptive=False):
  """Trains from `params` on `batches`; returns the loss curve. `adaptive`:
  `tx` is adaptive K-FAC (its update takes the batch; η, μ, λ, ρ are logged)."""
  x_train, x_test = (jnp.asarray(a) for a in data)

  # Params and state donated: XLA updates them in place (on a GPU a loop
  # without donation was up to 2x slower: benchmarks/results/gpu/summary.md).
  donating_jit = functools.partial(jax.jit, donate_argnums=(0, 1))
  if use_kfac:
    grad_fn = kd.value_and_grad(loss_fn)

    @donating_jit
    def step(params, opt_state, idx):
      x = x_train[idx]
      loss, grads, stats = grad_fn(params, x, opt_state=opt_state)
      # kfac_batch: the arguments grad_fn received after the parameters.
      batch = {"kfac_batch": (x,)} if adaptive else {}
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats, **batch)
      return optax.apply_updates(params, updates), opt_state, loss
  else:
    @donating_jit
    def step(params, opt_state, idx):
      x = x_train[idx]
      loss, grads = jax.value_and_grad(loss_fn)(params, x)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

  # The registered loss works outside kd.value_and_grad too (plain mean loss).
  evaluate = jax.jit(lambda p: (loss_fn(p, x_train), loss_fn(p, x_test)))

  def losses(params):
    train_loss, test_loss = evaluate(params)
    return float(train_loss) - floors[0], float(test_loss) - floors[1]

  params = jax.tree.map(jnp.copy, params)      # the step donates it; the caller's stays
  opt_state = tx.init(params)
  # Compile (and run once, discarding the result) before timing anything.
  jax.block_until_ready(step(*jax.tree.map(jnp.copy, (params, opt_state)), batches[0]))
  jax.block_until_ready(evaluate(params))

  first = losses(params)
  result = Result(name, [0], [0.0], [first[0]], [first[1]])
  if adaptive:
    result.adapted = {k: [float("nan")] for k in ADAPTED}
  elapsed = 0.0
  bar = tqdm(range(len(batches)), desc=f"{name:>14}", leave=True, ncols=100)
  for t in bar:
    start = time.perf_counter()
    params, opt_state, _ = step(params, opt_state, batches[t])
    jax.block_until_ready(params)
    elapsed += time.perf_counter() - start
    if (t + 1) % eval_every == 0 or t + 1 == len(batches):
      train_loss, test_loss = losses(params)
      result.steps.append(t + 1)
      result.seconds.append(elapsed)
      result.train.append(train_loss)
      result.test.append(test_loss)
      shown = dict(train=f"{train_loss:.3f}", test=f"{test_loss:.3f}")
      if adaptive:
        _adaptive_log.record(opt_state, result.adapted, shown)
      bar.set_postfix(shown, refresh=False)
  return result


def report(results: list[Result], target: float) -> str:
  header = ["method", f"steps to {target:g}", f"seconds to {target:g}",
            "final train", "final test"]
  rows = []
  for r in results:
    hit = r.first_reaching(target)
    rows.append([r.name, str(hit[0]) if hit else "-", f"{hit[1]:.2f}" if hit else "-",
                 f"{r.train[-1]:.3f}", f"{r.test[-1]:.3f}"])
  widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
  line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  table = [line(header), sep] + [line(row) for row in rows]
  table += [summary(r.name, r.adapted) for r in results if r.adapted]
  return "\n".join(table)


def save(results: list[Result], out: str, target: float, floors) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "autoencoder.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["method", "step", "seconds", "train_loss_above_floor",
                     "test_loss_above_floor", "train_loss", "test_loss", *ADAPTED])
    for r in results:
      for i, (step, sec, tr, te) in enumerate(zip(r.steps, r.seconds, r.train, r.test)):
        adapted = [f"{r.adapted[k][i]:.6g}" if r.adapted else "" for k in ADAPTED]
        writer.writerow([r.name, step, f"{sec:.4f}", f"{tr:.5f}", f"{te:.5f}",
                         f"{tr + floors[0]:.5f}", f"{te + floors[1]:.5f}", *adapted])

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  others = iter(["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown",
                 "tab:pink", "tab:olive", "tab:cyan"] * len(results))
  for r in results:
    style = (dict(lw=2.5, color="tab:red") if r.adapted else
             dict(lw=2.5, color="black") if r.name.startswith("K-FAC") else
             dict(lw=1.3, color=next(others)))
    axes[0].plot(r.steps[1:], r.train[1:], label=r.name, **style)
    axes[1].plot(r.seconds[1:], r.train[1:], label=r.name, **style)
    # The test loss, dashed: fitting the 1437 training images faster is not
    # generalising better.
    test_style = dict(style, lw=1.0, ls="--")
    axes[0].plot(r.steps[1:], r.test[1:], **test_style)
    axes[1].plot(r.seconds[1:], r.test[1:], **test_style)
  for ax, xlabel in zip(axes, ["step", "training seconds (compile excluded)"]):
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
  axes[0].set_ylabel("loss above the entropy floor (nats / image)\n"
                     "training solid, test dashed")
  axes[0].legend(loc="upper right")
  fig.suptitle("digits deep autoencoder 64-256-128-64-16-64-128-256-64: reconstruction "
               f"loss (dashed: {target:g})")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "autoencoder.png"), dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=500, help="training steps per method")
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the split, the initial weights and the batches")
  parser.add_argument("--eval-every", type=int, default=10,
                      help="evaluate the train/test losses every this many steps")
  parser.add_argument("--target", type=float, default=1.5,
                      help="training loss above the entropy floor (nats per image)")
  parser.add_argument("--sizes", type=int, nargs="+", default=[256, 128, 64, 16],
                      help="encoder widths, the last one the code (decoder mirrored)")
  parser.add_argument("--out", default="examples/out", help="output directory")
  kfac = parser.add_argument_group("K-FAC")
  kfac.add_argument("--kfac-lr", type=float, default=0.1,
                    help="learning rate (the KL clip usually binds and sets the step)")
  kfac.add_argument("--kfac-momentum", type=float, default=0.9)
  kfac.add_argument("--damping", type=float, default=0.03)
  kfac.add_argument("--kl-clip", type=float, default=1e-2,
                    help="KAISA's KL clip: bound on lr^2 * |<update, grad>| (0: off)")
  kfac.add_argument("--factor-decay", type=float, default=0.95)
  kfac.add_argument("--factor-every", type=int, default=5,
                    help="update the Kronecker factors every this many steps")
  kfac.add_argument("--inverse-every", type=int, default=25,
                    help="recompute the eigendecompositions every this many steps")
  _adaptive_log.add_arguments(kfac)
  base = parser.add_argument_group("baseline")
  base.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
  base.add_argument("--skip-baselines", action="store_true",
                    help="train K-FAC only (for tuning)")
  args = parser.parse_args()
  if args.steps < 1:
    parser.error(f"--steps {args.steps}: at least 1")
  if args.skip_fixed_kfac and args.skip_baselines and not args.adaptive:
    parser.error("nothing to train: --skip-fixed-kfac and --skip-baselines without "
                 "--adaptive")

  data = load_data(args.seed)
  floors = (entropy_floor(data[0]), entropy_floor(data[1]))
  n_train = len(data[0])
  if args.batch_size > n_train:
    parser.error(f"--batch-size {args.batch_size} exceeds the {n_train} training images")
  rng = np.random.default_rng(args.seed)
  batches = np.stack([rng.choice(n_train, args.batch_size, replace=False)
                      for _ in range(args.steps)]).astype(np.int32)

  model = Autoencoder(tuple(args.sizes))
  params = model.init(jax.random.PRNGKey(args.seed), jnp.asarray(data[0][:1]))["params"]

  def loss_fn(params, x):
    return kd.losses.sigmoid_cross_entropy(model.apply({"params": params}, x), x)

  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, jnp.asarray(data[0][batches[0]]))
  methods = []      # (name, transform, K-FAC?, adaptive?)
  if not args.skip_fixed_kfac:
    methods.append(("K-FAC", kd.kfac(
        args.kfac_lr, momentum=args.kfac_momentum, kl_clip=args.kl_clip or None,
        layers=layers, damping=args.damping, factor_decay=args.factor_decay,
        factor_update_every=args.factor_every,
        inverse_update_every=args.inverse_every), True, False))
  if args.adaptive:
    # learning_rate=None, momentum=None: both adapted; the rest the library's defaults.
    methods.append(("K-FAC adaptive", kd.kfac(
        None, None, layers=layers, grad_fn=grad_fn, damping=args.adaptive_damping,
        min_damping=args.adaptive_min_damping,
        adapt_damping=True), True, True))
  if not args.skip_baselines:
    methods += [(f"Adam lr={lr:g}", optax.adam(lr), False, False) for lr in args.adam_lrs]

  print(f"entropy floor: {floors[0]:.3f} nats/image (train), {floors[1]:.3f} (test); "
        "losses below are above it")
  results = [train(name, tx, params, data, batches, args.eval_every, use_kfac, loss_fn,
                   floors, adaptive)
             for name, tx, use_kfac, adaptive in methods]
  print()
  print(report(results, args.target))
  save(results, args.out, args.target, floors)
  print(f"\nwrote {os.path.join(args.out, 'autoencoder.csv')} and "
        f"{os.path.join(args.out, 'autoencoder.png')}")


if __name__ == "__main__":
  main()
