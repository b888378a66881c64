"""K-FAC vs Adam and SGD on a small CNN for scikit-learn's handwritten digits.

One small convolutional network (same initial weights, same mini-batch
sequence for every method) is trained with

* K-FAC: `kd.kfac`, i.e. K-FAC preconditioning (exact damped inverse of
  `A ⊗ G` from eigendecompositions) with KAISA's KL clip, followed by SGD.
  Curvature comes from the tagged layers `kd.linen.Conv` / `kd.linen.Dense` and
  the registered loss `kd.losses.softmax_cross_entropy`; the jitted step passes
  `opt_state=` to `kd.value_and_grad`, so the statistics are computed only on
  the steps that update the factors;
* Adam at learning rates 1e-3, 3e-3 and 1e-2;
* SGD with momentum 0.9 at learning rates 0.03 and 0.1.

For each it reports the steps and the training wall-clock seconds (compilation
and evaluation excluded) to reach 97% test accuracy, and the final test
accuracy. K-FAC needs fewer steps; a K-FAC step costs several Adam steps on
this tiny model, so it is not faster in seconds. The data is
`sklearn.datasets.load_digits` (1797 8x8 grey images, bundled, no download),
split 1437/360 (stratified, seeded), pixels scaled to [0, 1].

K-FAC's defaults (damping 0.03, KL clip 1e-2, no momentum, factors every step,
eigendecompositions every 10 steps) were tuned on seeds 0-5; with the KL clip
binding, the step length is set by `--kl-clip` more than by `--kfac-lr`.

`--adaptive` also trains adaptive K-FAC, which needs no tuning, with the
library's defaults (`_adaptive_log` describes it and its options); η, μ, λ
and ρ are written to `metrics.csv`.
`--skip-fixed-kfac` leaves the fixed-hyperparameter K-FAC out.

    python examples/digits.py                   # about a minute on 2 CPU cores
    python examples/digits.py --seed 1 --out /tmp/digits
    python examples/digits.py --adaptive        # adaptive K-FAC beside the others

Distributed K-FAC: `--devices N` trains data parallel over N devices (N host
CPU devices, made with `XLA_FLAGS=--xla_force_host_platform_device_count=N`
before jax starts): every step runs under `jax.shard_map` over a mesh axis
"data", each device taking `batch/N` examples, and K-FAC gets a
`kd.Distribution` for each `--strategy`:

    comm    COMM-OPT (KAISA), grad_worker_fraction 1: second-order state replicated
    mem     MEM-OPT, fraction 1/N: state sharded, preconditioned gradients all-gathered
    hybrid  HYBRID-OPT, fraction 1/2: second-order state sharded 2 ways, replicated N/2
    dp      DP-KFAC: MEM-OPT whose owners use their local batch (no factor traffic)

    python examples/digits.py --devices 8 --strategy comm mem hybrid dp

COMM, MEM and HYBRID give the same updates as one device (to float32
rounding); DP-KFAC's factors come from 1/N of the batch, by design. The
baselines average their gradients with `lax.pmean` over the same mesh. On a
2-core machine N virtual devices share the cores, so compare steps, not
seconds.

Writes `metrics.csv` (one row per evaluation) and `digits.png` (test accuracy
against step and against seconds, one curve per method) into `--out`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import os
import time


# N host CPU devices and OPENBLAS_NUM_THREADS, before jax initialises.
import _host_devices  # noqa: E402

_N = _host_devices.request_from_argv()

# pylint: disable=wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
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
  """Test-accuracy curve of one method: one entry per evaluation."""

  name: str
  steps: list[int]
  seconds: list[float]
  accuracy: list[float]
  losses: list[float]
  # Adaptive K-FAC only: η = −α, μ, λ and ρ at each evaluation (else empty).
  adapted: dict[str, list[float]] = dataclasses.field(default_factory=dict)

  def first_reaching(self, target: float):
    """(step, seconds) of the first evaluation at or above `target`, else None."""
    for step, sec, acc in zip(self.steps, self.seconds, self.accuracy):
      if acc >= target:
        return step, sec
    return None


STRATEGIES = {  # --strategy: (name, gradient workers per layer of N devices, factors)
    "comm": ("COMM-OPT", lambda n: n, "reduce_scatter"),
    "mem": ("MEM-OPT", lambda n: 1, "reduce_scatter"),
    "hybrid": ("HYBRID", lambda n: n // 2, "reduce_scatter"),
    "dp": ("DP-KFAC", lambda n: 1, "local"),
}


def distribution(strategy: str, mesh) -> kd.Distribution:
  """The `kd.Distribution` of a `--strategy` over `mesh`'s axis "data"."""
  n = mesh.shape["data"]
  _, workers, factor_reduction = STRATEGIES[strategy]
  if strategy == "hybrid" and n % 2:
    raise SystemExit(f"--strategy hybrid needs an even number of devices, got {n}")
  return kd.Distribution(mesh, axis="data", grad_worker_fraction=workers(n) / n,
                         factor_reduction=factor_reduction)


# The training steps donate the parameters and the optimizer state: XLA updates
# them in place, and on a GPU a loop without donation was up to 2x slower
# (benchmarks/results/gpu/summary.md, run 5).
donating_jit = functools.partial(jax.jit, donate_argnums=(0, 1))


def _copy(tree):
  """Fresh buffers for a donating step (the caller keeps its own)."""
  return jax.tree.map(jnp.copy, tree)


def _varying(tree):
  """Marks replicated values as varying over "data" inside shard_map, so that
  `jax.grad` returns each device's local gradient (no automatic psum)."""
  if hasattr(jax.lax, "pcast"):
    return jax.tree.map(lambda v: jax.lax.pcast(v, ("data",), to="varying"), tree)
  return jax.tree.map(lambda v: jax.lax.pvary(v, ("data",)), tree)


def sharded_step(tx, loss_fn, use_kfac, mesh, opt_state, data, key, fisher,
                 adaptive=False):
  """The training step under `jax.shard_map` over `mesh` (data parallel):
  `(params, opt_state, idx, t)`, the global batch `idx` split over the devices."""
  x_train, y_train = data
  grad_fn = kd.value_and_grad(loss_fn, fisher=fisher)
  specs = (kd.partition_specs(opt_state) if use_kfac
           else jax.tree.map(lambda _: P(), opt_state))

  def local_step(params, opt_state, x, y, t):
    if use_kfac:
      # This device's rows: its loss, gradients and curvature statistics.
      rng = jax.random.fold_in(jax.random.fold_in(key, t), jax.lax.axis_index("data"))
      loss, grads, stats = grad_fn(params, x, y, rng=rng, opt_state=opt_state)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(_varying(params), x, y)
    grads, loss = jax.lax.pmean((grads, loss), "data")
    if use_kfac:
      # Adaptive K-FAC evaluates its quadratic model on the batch: each device
      # passes its rows, the curvature products are averaged over "data".
      batch = {"kfac_batch": (x, y)} if adaptive else {}
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats, **batch)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  local_step = jax.shard_map(local_step, mesh=mesh,
                             in_specs=(P(), specs, P("data"), P("data"), P()),
                             out_specs=(P(), specs, P()))

  @donating_jit
  def step(params, opt_state, idx, t):
    return local_step(params, opt_state, x_train[idx], y_train[idx], t)
  return step


def train(name, tx, params, data, batches, eval_every, use_kfac, loss_fn,
          fisher="empirical", seed=0, mesh=None, adaptive=False):
  """Trains from `params` on `batches`; returns the test-accuracy curve.
  With a `mesh`, data parallel under `jax.shard_map` over its axis "data".
  `adaptive`: `tx` is adaptive K-FAC (its update takes the batch; η, μ, λ, ρ
  are logged)."""
  x_train, y_train, x_test, y_test = (jnp.asarray(a) for a in data)
  key = jax.random.PRNGKey(seed)

  params = _copy(params)          # the steps donate it; the caller's stays
  opt_state = tx.init(params)
  if mesh is not None:
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = (kd.shard_state(opt_state, mesh) if use_kfac
                 else jax.device_put(opt_state, replicated))
    step = sharded_step(tx, loss_fn, use_kfac, mesh, opt_state, (x_train, y_train), key,
                        fisher, adaptive)
  elif use_kfac:
    grad_fn = kd.value_and_grad(loss_fn, fisher=fisher)

    @donating_jit
    def step(params, opt_state, idx, t):
      x, y = x_train[idx], y_train[idx]
      rng = jax.random.fold_in(key, t)  # only the MC Fisher uses it
      loss, grads, stats = grad_fn(params, x, y, rng=rng, opt_state=opt_state)
      # kfac_batch: the arguments grad_fn received after the parameters.
      batch = {"kfac_batch": (x, y)} if adaptive else {}
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats, **batch)
      return optax.apply_updates(params, updates), opt_state, loss
  else:
    @donating_jit
    def step(params, opt_state, idx, t):
      del t
      x, y = x_train[idx], y_train[idx]
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params):
    logits = CNN().apply({"params": params}, x_test)
    return jnp.mean(jnp.argmax(logits, -1) == y_test)

  # Compile (and run once, discarding the result) before timing anything.
  jax.block_until_ready(step(*_copy((params, opt_state)), batches[0], 0))
  jax.block_until_ready(accuracy(params))

  result = Result(name, [0], [0.0], [float(accuracy(params))], [float("nan")])
  if adaptive:
    result.adapted = {k: [float("nan")] for k in ADAPTED}
  elapsed = 0.0
  bar = tqdm(range(len(batches)), desc=f"{name:>16}", leave=True, ncols=100)
  for t in bar:
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batches[t], t)
    jax.block_until_ready(params)
    elapsed += time.perf_counter() - start
    if (t + 1) % eval_every == 0 or t + 1 == len(batches):
      acc = float(accuracy(params))
      result.steps.append(t + 1)
      result.seconds.append(elapsed)
      result.accuracy.append(acc)
      result.losses.append(float(loss))
      shown = dict(loss=f"{float(loss):.3f}", test_acc=f"{acc:.3f}")
      if adaptive:
        _adaptive_log.record(opt_state, result.adapted, shown)
      bar.set_postfix(shown, refresh=False)
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
  table = [line(header), sep] + [line(row) for row in rows]
  table += [summary(r.name, r.adapted) for r in results if r.adapted]
  return "\n".join(table)


def save(results: list[Result], out: str, target: float) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["method", "step", "seconds", "test_accuracy", "train_loss",
                     *ADAPTED])
    for r in results:
      for i, row in enumerate(zip(r.steps, r.seconds, r.accuracy, r.losses)):
        adapted = [f"{r.adapted[k][i]:.6g}" if r.adapted else "" for k in ADAPTED]
        writer.writerow([r.name, row[0], f"{row[1]:.4f}", f"{row[2]:.4f}",
                         f"{row[3]:.4f}", *adapted])

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  # Fixed K-FAC black, adaptive K-FAC red, the others any colour but those.
  others = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown",
                 "tab:pink", "tab:olive", "tab:cyan"] * len(results))
  for r in results:
    style = (dict(lw=2.5, color="black") if r.name == "K-FAC" else
             dict(lw=2.5, color="tab:red") if r.adapted and r.name == "K-FAC adaptive"
             else dict(lw=2.0, ls="-.", color=next(others)) if r.name.startswith("K-FAC")
             else dict(lw=1.3, color=next(others)))
    axes[0].plot(r.steps, r.accuracy, label=r.name, **style)
    axes[1].plot(r.seconds, r.accuracy, label=r.name, **style)
  for ax, xlabel in zip(axes, ["step", "training seconds (compile excluded)"]):
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylim(0.8, 1.0)
    ax.grid(alpha=0.3)
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
  kfac = parser.add_argument_group("K-FAC")
  kfac.add_argument("--kfac-lr", type=float, default=0.3,
                    help="learning rate (the KL clip usually binds and sets the step)")
  kfac.add_argument("--kfac-momentum", type=float, default=0.0)
  kfac.add_argument("--damping", type=float, default=0.03)
  kfac.add_argument("--kl-clip", type=float, default=1e-2,
                    help="KAISA's KL clip: bound on lr^2 * |<update, grad>| (0: off)")
  kfac.add_argument("--factor-decay", type=float, default=0.95)
  kfac.add_argument("--factor-every", type=int, default=1,
                    help="update the Kronecker factors every this many steps")
  kfac.add_argument("--inverse-every", type=int, default=10,
                    help="recompute the eigendecompositions every this many steps")
  kfac.add_argument("--fisher", choices=["empirical", "mc"], default="empirical")
  _adaptive_log.add_arguments(kfac)
  base = parser.add_argument_group("baselines")
  base.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
  base.add_argument("--sgd-lrs", type=float, nargs="+", default=[0.03, 0.1])
  base.add_argument("--skip-baselines", action="store_true",
                    help="train K-FAC only (for tuning)")
  dist = parser.add_argument_group("distributed K-FAC")
  dist.add_argument("--devices", type=int, default=1,
                    help="devices of the data axis; > 1: every method trains data "
                         "parallel under shard_map (host CPU devices are created when "
                         "jax starts)")
  dist.add_argument("--strategy", nargs="+", choices=list(STRATEGIES), default=["comm"],
                    help="K-FAC strategies to train with --devices > 1 (one run each)")
  args = parser.parse_args()
  if args.steps < 1:
    parser.error(f"--steps {args.steps}: at least 1")
  if args.devices < 1 or args.batch_size % args.devices:
    parser.error(f"--batch-size {args.batch_size} is not a multiple of --devices "
                 f"{args.devices}")
  mesh = None
  if args.devices > 1:
    if jax.device_count() < args.devices:
      parser.error(f"--devices {args.devices}: jax sees only {jax.device_count()} devices "
                   "(was XLA_FLAGS set with a smaller device count?)")
    mesh = Mesh(np.array(jax.devices()[:args.devices]), ("data",))
    print(f"data parallel over {args.devices} {jax.devices()[0].platform} devices, "
          f"{args.batch_size // args.devices} examples each")

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
  def kfac(distribution=None):
    return kd.kfac(
        args.kfac_lr, momentum=args.kfac_momentum, kl_clip=args.kl_clip or None,
        layers=layers,
        damping=args.damping, factor_decay=args.factor_decay,
        factor_update_every=args.factor_every,
        inverse_update_every=args.inverse_every, distribution=distribution)

  grad_fn = kd.value_and_grad(loss_fn, fisher=args.fisher)

  def adaptive_kfac(distribution=None):
    # learning_rate=None, momentum=None: both adapted; the rest the library's defaults.
    return kd.kfac(None, None, layers=layers, grad_fn=grad_fn,
                   damping=args.adaptive_damping,
                   min_damping=args.adaptive_min_damping, adapt_damping=True,
                   distribution=distribution)

  # (name, transform, K-FAC?, adaptive?)
  strategies = [None] if mesh is None else list(dict.fromkeys(args.strategy))
  label = lambda s: "" if s is None else f" {STRATEGIES[s][0]}"
  dist = lambda s: None if s is None else distribution(s, mesh)
  methods = []
  if not args.skip_fixed_kfac:
    methods += [(f"K-FAC{label(s)}", kfac(dist(s)), True, False) for s in strategies]
  if args.adaptive:
    methods += [(f"K-FAC adaptive{label(s)}", adaptive_kfac(dist(s)), True, True)
                for s in strategies]
  suffix = f" x{args.devices}" if mesh is not None else ""
  if not args.skip_baselines:
    methods += [(f"Adam lr={lr:g}{suffix}", optax.adam(lr), False, False)
                for lr in args.adam_lrs]
    methods += [(f"SGD+mom lr={lr:g}{suffix}", optax.sgd(lr, momentum=0.9), False, False)
                for lr in args.sgd_lrs]
  if not methods:
    parser.error("nothing to train: --skip-fixed-kfac and --skip-baselines without "
                 "--adaptive")

  results = [train(name, tx, params, data, batches, args.eval_every, use_kfac, loss_fn,
                   fisher=args.fisher, seed=args.seed, mesh=mesh, adaptive=adaptive)
             for name, tx, use_kfac, adaptive in methods]
  table = report(results, args.target)
  print()
  print(table)
  save(results, args.out, args.target)
  print(f"\nwrote {os.path.join(args.out, 'metrics.csv')} and "
        f"{os.path.join(args.out, 'digits.png')}")


if __name__ == "__main__":
  main()
