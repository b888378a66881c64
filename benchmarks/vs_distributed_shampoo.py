"""kd.shampoo against Google's `precondition.distributed_shampoo` at equal settings.

Two small models on sklearn's digits (8x8 grey images, 10 classes; 1437 train /
360 test images, fixed split), plain JAX, float32, minibatch 128:

* mlp: 64-128-128-10, ReLU;
* cnn: Conv3x3(16)-Conv3x3 stride 2(32)-Dense(10), ReLU, SAME padding.

Settings shared by both optimizers (each a whole optimizer: `kd.shampoo`
chains SGD with Nesterov momentum; Google's applies its own):
block size 64, small axes merged up to 64, β₂ = 0.999 for the statistics and
the RMSProp graft (layer-wise grafting, diagonal ε 1e-10), statistics ε 1e-6
(start `εI`, relative ridge `ε λ_max`), momentum 0.9 Nesterov, statistics every
step, roots every 10 steps, Shampoo from step 0, rank-1 parameters (biases)
diagonal only (`skip_preconditioning_rank_lt=2` on Google's side), coupled
Newton roots with 100 iterations / tolerance 1e-6 / failure threshold 0.1.
kd.shampoo runs twice: `root_method="newton"` (Google's method) and "eigh".
Shampoo starts at step 0 because Google keeps two momentum buffers (grafted
and Shampoo, the latter fed from step 0 with Shampoo steps) and switches at
the start step, while `kd.shampoo` has one (optax.sgd); with a later start the
trajectories part at the start step by design. With start 0 the two
implementations compute the same steps, so the table also gives the largest
relative parameter difference `‖θ − θ_ds‖ / ‖θ_ds‖` to distributed_shampoo
after K and N steps. Float32
rounding is amplified by the training dynamics (ill-conditioned roots), so
the yardstick is distributed_shampoo against itself started from the same
initialisation perturbed by 1e-6 (Gaussian): differences well below that are
rounding, not a different algorithm.

Measured, per model and optimizer, for one jitted training step
(`value_and_grad → tx.update → apply_updates`):

* compile s: `jax.jit(step).lower(...).compile()`;
* ms/step: wall-clock per step with `block_until_ready`, over interleaved
  rounds (each round runs every optimizer for a whole number of root periods,
  so the mix of plain and root-refresh steps is the real one): the median and
  the mean over all timed steps (the mean includes the refresh steps), and the
  process CPU time per step (steadier on a shared machine);
* root check: after one step, every statistic `H` of kd.shampoo's state goes
  through kd's roots (newton, eigh) and through Google's
  `matrix_inverse_pth_root` (same p, ridge and tolerance); each is compared with
  a float64 numpy `(H + ε λ_max I)^{-1/p}` (max |Δ| / max |oracle| per bucket),
  with the number of ridge retries Google's function reports;
* loss / accuracy after N steps from the same initialisation and batch order,
  and `‖θ − θ_ds‖ / ‖θ_ds‖` to distributed_shampoo's parameters after K
  (default 30) and N steps.

Google's code calls `jax.tree_map` & co., removed from jax: this script (only)
aliases them to `jax.tree_util`'s.

Usage: OPENBLAS_NUM_THREADS=1 python benchmarks/vs_distributed_shampoo.py
       [--quick] [--steps N] [--rounds R] [--round-steps K] [--agree-steps K]
       [--models mlp,cnn] [--out benchmarks/results]
Writes vs_distributed_shampoo.md and .json (vs_distributed_shampoo_quick.* with
--quick: the MLP, 10 steps). Without precondition-opt installed, --quick prints
why and exits 0; a full run exits with the same message.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top

import kfac_jax_dist as kd  # pylint: disable=g-import-not-at-top
from kfac_jax_dist.shampoo import state as shampoo_state  # pylint: disable=g-import-not-at-top

import _models  # pylint: disable=g-import-not-at-top

for _name in ("tree_map", "tree_flatten", "tree_unflatten", "tree_leaves",
              "tree_structure"):
  if not hasattr(jax, _name):
    setattr(jax, _name, getattr(jax.tree_util, _name))
warnings.filterwarnings("ignore", message="Explicitly requested dtype")
try:
  from precondition import distributed_shampoo as gds  # pylint: disable=g-import-not-at-top
except ImportError as e:
  gds = None
  MISSING_PEER = (f"vs_distributed_shampoo.py needs Google's distributed_shampoo, from the "
                  f"package precondition-opt (pip install precondition-opt): {e}")

BLOCK, BETA2, EPS, LR, MOMENTUM = 64, 0.999, 1e-6, 1e-3, 0.9
START, ROOT_EVERY, BATCH = 0, 10, 128


# -------------------------------------------------------------------- models

digits = _common.digits
MLP_SIZES = (64, 128, 128, 10)


def cnn_init(key):
  k = jax.random.split(key, 3)
  return {"c0": _models.conv_init(k[0], 1, 16), "c1": _models.conv_init(k[1], 16, 32),
          "d": _models.dense_init(k[2], 4 * 4 * 32, 10)}


def cnn_apply(p, x):
  h = jax.nn.relu(_models.conv(x, p["c0"], 1))
  h = jax.nn.relu(_models.conv(h, p["c1"], 2))
  return _models.dense(h.reshape(h.shape[0], -1), p["d"])


MODELS = {
    "mlp": ("MLP 64-128-128-10, ReLU",
            lambda key: _models.dense_stack_init(key, MLP_SIZES), _models.dense_stack_apply),
    "cnn": ("Conv3x3(16)-Conv3x3/2(32)-Dense(10), ReLU", cnn_init, cnn_apply),
}


# ---------------------------------------------------------------- optimizers

def kd_shampoo(root_method):
  return kd.shampoo(
      LR, momentum=MOMENTUM, nesterov=True, block_size=BLOCK, beta2=BETA2,
      epsilon=EPS, ridge_epsilon=EPS, graft_type="rmsprop", grafting="layer",
      graft_epsilon=1e-10, start_preconditioning_step=START,
      statistics_compute_steps=1, preconditioning_compute_steps=ROOT_EVERY,
      merge_small_dims=BLOCK, max_preconditioner_dim=4096, root_method=root_method,
      newton_max_iterations=100, newton_tolerance=1e-6, root_failure_threshold=0.1)


def google_shampoo():
  return gds.distributed_shampoo(
      LR, block_size=BLOCK, beta1=MOMENTUM, beta2=BETA2, diagonal_epsilon=1e-10,
      matrix_epsilon=EPS, start_preconditioning_step=START,
      preconditioning_compute_steps=ROOT_EVERY, statistics_compute_steps=1,
      graft_type=gds.GraftingType.RMSPROP, nesterov=True,
      skip_preconditioning_rank_lt=2, skip_preconditioning_dim_size_gt=4096,
      merge_small_dims_block_size=BLOCK, inverse_failure_threshold=0.1,
      relative_matrix_epsilon=True, generate_training_metrics=False)


OPTIMIZERS = {
    "kd.shampoo newton": lambda: kd_shampoo("newton"),
    "kd.shampoo eigh": lambda: kd_shampoo("eigh"),
    "distributed_shampoo": google_shampoo,
}


# -------------------------------------------------------------------- runner

def make_step(apply, tx):
  def loss_fn(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

  return _common.optax_step(loss_fn, tx), loss_fn


def batches(n_train, steps, seed=1):
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < steps:
    perm = rng.permutation(n_train)
    out += [perm[i:i + BATCH] for i in range(0, n_train - BATCH + 1, BATCH)]
  return out[:steps]


def _max_diff(a, b):
  """‖a − b‖ / ‖b‖ over all parameters (a few near-zero gradient entries flip
  sign under rounding and get a full RMSProp-sized step: a max-abs measure
  would only see those)."""
  fa, fb = (jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)])
            for t in (a, b))
  return float(jnp.linalg.norm(fa - fb) / jnp.linalg.norm(fb))


def _train(compiled, params, state, xtr, ytr, order, steps, agree_steps):
  p, s, early = params, state, None
  for i in range(steps):
    p, s, _ = compiled(p, s, jnp.asarray(xtr[order[i]]), jnp.asarray(ytr[order[i]]))
    if i + 1 == agree_steps:
      early = p
  return jax.block_until_ready(p), early


def _oracle_root(h, p):
  w, v = np.linalg.eigh(np.asarray(h, np.float64))
  w = np.maximum(w, 0.0)
  w = w + EPS * max(w.max(), 1e-16)
  return (v * w ** (-1.0 / p)) @ v.T


def root_check(state):
  """Per bucket of a ScaleByShampooState: relative errors of the roots."""
  rows = []
  for (d, p), stats in zip(state.layout.buckets, shampoo_state.bucket_arrays(state)[0]):
    want = [_oracle_root(h, p) for h in np.asarray(stats)]
    scale = [np.abs(x).max() for x in want]
    row = {"d": d, "p": p, "n": stats.shape[0]}
    for method in ("newton", "eigh"):
      got, _ = _common.roots_lib.inverse_pth_root(stats, p, method=method, ridge_epsilon=EPS)
      row[method] = max(np.abs(np.asarray(g) - w).max() / s_
                        for g, w, s_ in zip(got, want, scale))
    errs, retries = [], []
    for h, w, s_ in zip(stats, want, scale):
      r, metrics = gds.matrix_inverse_pth_root(h, p, ridge_epsilon=EPS,
                                               error_tolerance=1e-6)
      errs.append(np.abs(np.asarray(r) - w).max() / s_)
      retries.append(int(metrics.total_retries))
    row["google"], row["google_retries"] = max(errs), max(retries)
    rows.append(row)
  return rows


def run_model(name, steps, rounds, round_steps, agree_steps):
  what, init, apply = MODELS[name]
  (xtr, ytr), (xte, yte) = digits()
  params = init(jax.random.key(0))
  order = batches(len(ytr), max(steps, round_steps))
  rows, fns = {}, {}
  for opt, factory in OPTIMIZERS.items():
    tx = factory()
    step, loss_fn = make_step(apply, tx)
    state = tx.init(params)
    x0, y0 = jnp.asarray(xtr[order[0]]), jnp.asarray(ytr[order[0]])
    t = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=()).lower(params, state, x0, y0).compile()
    compile_s = time.perf_counter() - t
    if opt == "kd.shampoo newton":
      _, first, _ = compiled(params, state, x0, y0)
      checks = root_check(first[0])
    # Training run: loss / accuracy after `steps` steps.
    p, early = _train(compiled, params, state, xtr, ytr, order, steps, agree_steps)
    train_loss = float(loss_fn(p, jnp.asarray(xtr), jnp.asarray(ytr)))
    test_acc = float(jnp.mean(jnp.argmax(apply(p, jnp.asarray(xte)), -1) == yte))
    fns[opt] = (compiled, state)
    rows[opt] = {"compile_s": compile_s, "train_loss": train_loss, "test_acc": test_acc,
                 "wall_ms": [], "cpu_ms": [], "params": p, "early": early}
  ref = rows["distributed_shampoo"]
  for r in rows.values():
    r["max_param_diff"] = _max_diff(r["params"], ref["params"])
    r["max_param_diff_early"] = _max_diff(r["early"], ref["early"])
  compiled, state = fns["distributed_shampoo"]
  noise = jax.tree_util.tree_map(
      lambda x: 1e-6 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
  p, early = _train(compiled, jax.tree_util.tree_map(jnp.add, params, noise), state,
                    xtr, ytr, order, steps, agree_steps)
  sensitivity = (_max_diff(early, ref["early"]), _max_diff(p, ref["params"]))
  for r in rows.values():
    del r["params"], r["early"]
  # Timing: interleaved rounds of `round_steps` consecutive steps each, from the
  # state after START steps (refresh steps are in the mix).
  xs = [jnp.asarray(xtr[order[i]]) for i in range(round_steps)]
  ys = [jnp.asarray(ytr[order[i]]) for i in range(round_steps)]
  warm = {}
  for opt, (compiled, state) in fns.items():
    p, s = params, state
    for i in range(START):
      p, s, _ = compiled(p, s, xs[i], ys[i])
    warm[opt] = jax.block_until_ready((p, s))
  for _ in range(rounds):
    for opt, (compiled, _) in fns.items():
      p, s = warm[opt]
      for i in range(round_steps):
        c0, w0 = time.process_time(), time.perf_counter()
        p, s, loss = compiled(p, s, xs[i], ys[i])
        jax.block_until_ready(loss)
        rows[opt]["wall_ms"].append(1e3 * (time.perf_counter() - w0))
        rows[opt]["cpu_ms"].append(1e3 * (time.process_time() - c0))
  for r in rows.values():
    r["median_ms"] = statistics.median(r["wall_ms"])
    r["mean_ms"] = statistics.fmean(r["wall_ms"])
    r["cpu_mean_ms"] = statistics.fmean(r["cpu_ms"])
    r["timed_steps"] = len(r["wall_ms"])
  shapes = {"/".join(str(getattr(k, "key", k)) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  return what, shapes, rows, sensitivity, checks


FULL = dict(steps=300, rounds=5, round_steps=40, agree_steps=30, models="mlp,cnn")
QUICK = dict(steps=10, rounds=1, round_steps=10, agree_steps=5, models="mlp")


def main():
  parser = _common.argument_parser(__doc__)
  _common.add_quick(parser, "vs_distributed_shampoo", QUICK)
  parser.add_argument("--steps", type=int, default=None, help="default 300")
  parser.add_argument("--rounds", type=int, default=None, help="default 5")
  parser.add_argument("--round-steps", type=int, default=None, help="default 40")
  parser.add_argument("--agree-steps", type=int, default=None, help="default 30")
  parser.add_argument("--models", default=None, help="default mlp,cnn")
  args = parser.parse_args()
  _common.fill_defaults(args, QUICK, FULL)
  if gds is None:
    if args.quick:     # the smoke run of .ci/run where the peer is not installed
      print(f"vs_distributed_shampoo.py --quick: skipped. {MISSING_PEER}")
      return
    sys.exit(MISSING_PEER)
  head = _common.environment()
  lines = ["# kd.shampoo vs Google's distributed_shampoo", "",
           _common.header_md(head) + f"; OPENBLAS_NUM_THREADS="
           f"{os.environ.get('OPENBLAS_NUM_THREADS')}; precondition-opt "
           f"{_version('precondition-opt')}",
           f"- sklearn digits, minibatch {BATCH}, {args.steps} training steps from the same "
           f"init and batch order; loss = mean train cross-entropy after them, acc = "
           f"test accuracy (360 images).",
           f"- equal settings: block {BLOCK}, merge up to {BLOCK}, β₂ {BETA2} (statistics "
           f"and RMSProp graft, layer-wise), ε {EPS} (init and relative ridge), lr {LR}, "
           f"Nesterov momentum {MOMENTUM}, statistics every step, roots every "
           f"{ROOT_EVERY} steps from step {START}, biases diagonal only, Newton 100 "
           f"iterations / tol 1e-6 / failure threshold 0.1.",
           f"- ms/step: {args.rounds} interleaved rounds × {args.round_steps} consecutive "
           f"steps (every {ROOT_EVERY}th refreshes the roots); median and mean of the "
           f"wall-clock steps, mean process CPU time. compile s = "
           f"`jit(step).lower().compile()`. Machine shared with other jobs: wall "
           f"times are noisy.",
           "- generated by `python benchmarks/vs_distributed_shampoo.py`.", ""]
  payload = {"header": head, "models": {}}
  for name in args.models.split(","):
    what, shapes, rows, sensitivity, checks = run_model(
        name, args.steps, args.rounds, args.round_steps, args.agree_steps)
    payload["models"][name] = {"what": what, "shapes": shapes, "rows": rows,
                               "perturbed_init_diff": sensitivity, "root_check": checks}
    base = rows["distributed_shampoo"]
    table = [[opt, f"{r['compile_s']:.2f}", f"{r['median_ms']:.2f}", f"{r['mean_ms']:.2f}",
              f"{r['cpu_mean_ms']:.2f}", f"{r['mean_ms'] / base['mean_ms']:.2f}",
              f"{r['train_loss']:.2e}", f"{r['test_acc']:.3f}",
              f"{r['max_param_diff_early']:.1e}", f"{r['max_param_diff']:.1e}"]
             for opt, r in rows.items()]
    lines += [f"## {name}: {what}", "",
              "Parameters: " + ", ".join(f"{k} {v}" for k, v in shapes.items()), "",
              _common.md_table(table, ["optimizer", "compile s", "median ms/step",
                                       "mean ms/step", "CPU ms/step",
                                       "mean × distributed_shampoo",
                                       f"train loss @{args.steps}",
                                       f"test acc @{args.steps}",
                                       f"rel. Δθ @{args.agree_steps}",
                                       f"rel. Δθ @{args.steps}"]), "",
              f"rel. Δθ = ‖θ − θ_ds‖ / ‖θ_ds‖ to distributed_shampoo's parameters. "
              f"Yardstick: "
              f"distributed_shampoo from the initialisation perturbed by 1e-6 is "
              f"{sensitivity[0]:.1e} away @{args.agree_steps} and {sensitivity[1]:.1e} "
              f"@{args.steps}.", "",
              "Root check after one step (max |X − X_oracle| / max |X_oracle| over the "
              "bucket's matrices; oracle = float64 eigh):", "",
              _common.md_table(
                  [[f"{c['n']}× {c['d']}×{c['d']}, p={c['p']}", f"{c['newton']:.1e}",
                    f"{c['eigh']:.1e}", f"{c['google']:.1e}", c["google_retries"]]
                   for c in checks],
                  ["statistics", "kd newton", "kd eigh", "Google matrix_inverse_pth_root",
                   "Google tries (max; 1 = no retry)"]), ""]
    retried = [c for c in checks if c["google_retries"] > 1]
    if retried:
      lines += [
          "Google's `matrix_inverse_pth_root` restarts the Newton iteration with a "
          "10× larger ridge while its error stays above 0.05, and its divergence "
          "guard watches the elementwise max |M − I|, which can grow by more than "
          "1.2× in the first steps of a converging iteration (kd watches "
          "‖M − I‖_F, which cannot grow in exact arithmetic; see `roots`). Here it "
          "retried on " + ", ".join(
              f"{c['d']}×{c['d']} p={c['p']} ({c['google_retries']} tries: ridge "
              f"×1e{c['google_retries'] - 1})" for c in retried) +
          ", so its root is that of a more damped statistic, and the "
          "trajectories part from the first step on for that layer.", ""]
    print("\n".join(lines[-14:]), flush=True)
  text = "\n".join(lines)
  print(text)
  _common.write_results(args.out, _common.stem("vs_distributed_shampoo", args.quick), text,
                        payload)


def _version(dist):
  try:
    from importlib import metadata  # pylint: disable=import-outside-toplevel
    return metadata.version(dist)
  except Exception:  # pylint: disable=broad-except
    return "?"


if __name__ == "__main__":
  main()
