"""K-FAC vs Adam and SGD on a small CNN for scikit-learn's handwritten digits.

The example trains one small convolutional network (same initial weights, same
mini-batch sequence) with

* K-FAC: `kd.kfac`, i.e. K-FAC preconditioning with KL clipping followed by SGD
  with momentum. Curvature comes from the tagged layers `kd.linen.Conv` /
  `kd.linen.Dense` and the registered loss `kd.losses.softmax_cross_entropy`;
  the jitted step passes `opt_state=` to `kd.value_and_grad` so that the
  statistics are only computed on factor-update steps;
* Adam at learning rates 1e-3, 3e-3 and 1e-2;
* SGD with momentum 0.9 at learning rates 0.03 and 0.1,

and reports, for each, the number of steps and the training wall-clock seconds
(compilation and evaluation excluded) needed to reach 97% test accuracy, plus
the final test accuracy. The data is `sklearn.datasets.load_digits` (1797 8x8
grey images, bundled, no download), split 1437/360 (stratified, seeded).

    python examples/digits.py                 # defaults: ~1-2 minutes on 2 CPU cores
    python examples/digits.py --seed 1 --steps 400 --out /tmp/digits

Outputs in --out: `metrics.csv` (one row per evaluation) and `digits.png`
(test accuracy against step and against seconds, one curve per method).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import kfac_jax_dist as kd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


class CNN(nn.Module):
  """conv 3x3 -> relu -> conv 3x3 / 2 -> relu -> dense -> relu -> dense 10."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(kd.linen.Conv(16, (3, 3))(x))
    x = nn.relu(kd.linen.Conv(32, (3, 3), strides=(2, 2))(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(kd.linen.Dense(64)(x))
    return kd.linen.Dense(10)(x)


def load_data(seed: int):
  """Stratified 1437/360 split, pixels scaled to [0, 1], NHWC images."""
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=360, stratify=y, random_state=seed)
  return x_train, y_train, x_test, y_test


@dataclasses.dataclass
class Result:
  name: str
  steps: list[int]
  seconds: list[float]
  accuracy: list[float]
  losses: list[float]

  def first_reaching(self, target: float):
    """(step, seconds) of the first evaluation at or above `target`, else None."""
    for step, sec, acc in zip(self.steps, self.seconds, self.accuracy):
      if acc >= target:
        return step, sec
    return None


def train(name, tx, params, data, batches, eval_every, use_kfac, loss_fn):
  """Trains from `params` on `batches`; returns the test-accuracy curve."""
  x_train, y_train, x_test, y_test = (jnp.asarray(a) for a in data)

  if use_kfac:
    grad_fn = kd.value_and_grad(loss_fn)

    @jax.jit
    def step(params, opt_state, idx):
      x, y = x_train[idx], y_train[idx]
      loss, grads, stats = grad_fn(params, x, y, opt_state=opt_state)
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), opt_state, loss
  else:
    @jax.jit
    def step(params, opt_state, idx):
      x, y = x_train[idx], y_train[idx]
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params):
    logits = CNN().apply({"params": params}, x_test)
    return jnp.mean(jnp.argmax(logits, -1) == y_test)

  opt_state = tx.init(params)
  # Compile (and run once, discarding the result) before timing anything.
  jax.block_until_ready(step(params, opt_state, batches[0]))
  jax.block_until_ready(accuracy(params))

  result = Result(name, [0], [0.0], [float(accuracy(params))], [float("nan")])
  elapsed = 0.0
  bar = tqdm(range(len(batches)), desc=f"{name:>16}", leave=True, ncols=100)
  for t in bar:
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batches[t])
    jax.block_until_ready(params)
    elapsed += time.perf_counter() - start
    if (t + 1) % eval_every == 0 or t + 1 == len(batches):
      acc = float(accuracy(params))
      result.steps.append(t + 1)
      result.seconds.append(elapsed)
      result.accuracy.append(acc)
      result.losses.append(float(loss))
      bar.set_postfix(loss=f"{float(loss):.3f}", test_acc=f"{acc:.3f}", refresh=False)
  return result


def report(results: list[Result], target: float) -> str:
  header = ["method", f"steps to {target:.0%}", f"seconds to {target:.0%}",
            "final test acc"]
  rows = []
  for r in results:
    hit = r.first_reaching(target)
    rows.append([r.name, str(hit[0]) if hit else "-", f"{hit[1]:.2f}" if hit else "-",
                 f"{r.accuracy[-1]:.4f}"])
  widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
  line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(header), sep] + [line(row) for row in rows])


def save(results: list[Result], out: str, target: float) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["method", "step", "seconds", "test_accuracy", "train_loss"])
    for r in results:
      for row in zip(r.steps, r.seconds, r.accuracy, r.losses):
        writer.writerow([r.name, row[0], f"{row[1]:.4f}", f"{row[2]:.4f}",
                         f"{row[3]:.4f}"])

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for r in results:
    style = dict(lw=2.5, color="black") if r.name == "K-FAC" else dict(lw=1.3)
    axes[0].plot(r.steps, r.accuracy, label=r.name, **style)
    axes[1].plot(r.seconds, r.accuracy, label=r.name, **style)
  for ax, xlabel in zip(axes, ["step", "training seconds (compile excluded)"]):
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylim(0.8, 1.0)
    ax.grid(alpha=0.3)
  axes[1].set_xscale("log")
  axes[0].set_ylabel("test accuracy")
  axes[0].legend(loc="lower right")
  fig.suptitle("sklearn digits, small CNN: test accuracy "
               f"(dashed: {target:.0%})")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "digits.png"), dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="training steps per method")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the split, the initial weights and the batches")
  parser.add_argument("--eval-every", type=int, default=5,
                      help="evaluate test accuracy every this many steps")
  parser.add_argument("--target", type=float, default=0.97, help="test accuracy target")
  parser.add_argument("--out", default="examples/out", help="output directory")
  parser.add_argument("--kfac-lr", type=float, default=0.1)
  parser.add_argument("--damping", type=float, default=1e-2)
  parser.add_argument("--kl-clip", type=float, default=1e-2)
  parser.add_argument("--factor-decay", type=float, default=0.95)
  parser.add_argument("--factor-every", type=int, default=1,
                      help="update the Kronecker factors every this many steps")
  parser.add_argument("--inverse-every", type=int, default=10,
                      help="recompute the eigendecompositions every this many steps")
  parser.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
  parser.add_argument("--sgd-lrs", type=float, nargs="+", default=[0.03, 0.1])
  parser.add_argument("--skip-baselines", action="store_true",
                      help="train K-FAC only (for tuning)")
  args = parser.parse_args()

  data = load_data(args.seed)
  n_train = len(data[0])
  rng = np.random.default_rng(args.seed)
  batches = np.stack([rng.choice(n_train, args.batch_size, replace=False)
                      for _ in range(args.steps)]).astype(np.int32)

  model = CNN()
  params = model.init(jax.random.PRNGKey(args.seed), jnp.asarray(data[0][:1]))["params"]

  def loss_fn(params, x, y):
    return kd.losses.softmax_cross_entropy(model.apply({"params": params}, x), y)

  layers = kd.value_and_grad(loss_fn).discover(
      params, jnp.asarray(data[0][batches[0]]), jnp.asarray(data[1][batches[0]]))
  methods = [("K-FAC", kd.kfac(
      args.kfac_lr, momentum=0.9, kl_clip=args.kl_clip, layers=layers,
      damping=args.damping, factor_decay=args.factor_decay,
      factor_update_every=args.factor_every,
      inverse_update_every=args.inverse_every), True)]
  if not args.skip_baselines:
    methods += [(f"Adam lr={lr:g}", optax.adam(lr), False) for lr in args.adam_lrs]
    methods += [(f"SGD+mom lr={lr:g}", optax.sgd(lr, momentum=0.9), False)
                for lr in args.sgd_lrs]

  results = [train(name, tx, params, data, batches, args.eval_every, use_kfac, loss_fn)
             for name, tx, use_kfac in methods]
  table = report(results, args.target)
  print()
  print(table)
  save(results, args.out, args.target)
  print(f"\nwrote {os.path.join(args.out, 'metrics.csv')} and "
        f"{os.path.join(args.out, 'digits.png')}")


if __name__ == "__main__":
  main()
