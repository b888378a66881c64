"""Step time of K-FAC against optax SGD and Adam, measured side by side.

Three models from benchmarks/_models.py, built from `kd.linen` layers
(outside `kd.value_and_grad` the tags are plain Flax computations, so SGD and
Adam run the very same model):

* mlp: 784-512-512-10 ReLU MLP, batch 256, synthetic MNIST-shaped data;
* cnn: Conv(32)-pool-Conv(64)-pool-Conv(64)-global mean-Dense(10), 3x3 kernels,
  ReLU, on 32x32x3 inputs, batch 128, synthetic CIFAR-shaped data;
* lm: a character-level Transformer LM (width 128, 2 pre-LN blocks, 4 heads,
  context 64, vocabulary 96), batch 32 sequences, synthetic tokens.

For each model every method is one jitted training step
`value_and_grad -> tx.update -> optax.apply_updates`, run with
`jax.block_until_ready` after every step. Every step donates the parameters
and the optimizer state (`donate_argnums=(0, 1)`), as a training loop should:
on an H200 (2026-11-29, fdb28b5) the LM's plain K-FAC step took 4.17 ms in a
loop without donation, 2.11 ms with it, and SGD's 2.33 against 1.51 ms
(benchmarks/results/gpu). The rows from one fixed state run the same program
on fresh copies of that state, made outside the timing.

* sgd: `optax.sgd(lr, momentum=0.9)`; adam: `optax.adam(lr)`;
* kfac_every: `kd.kfac(..., factor_update_every=1, inverse_update_every=1)`;
* kfac_amortised: `factor_update_every=10, inverse_update_every=100`, timed over
  a run of consecutive steps that is a whole number of inverse periods, so the
  mix of plain, factor and inverse steps is the real one;
* ekfac_amortised: kfac_amortised with `eigenvalue_correction="ekfac"`;
* shampoo / soap: `kd.shampoo` (roots) and `kd.soap` (eigenbases) refreshed
  every `ROOTS_EVERY` = 10 steps, their defaults otherwise;
* kfac_plain / kfac_factor / kfac_inverse: one step of the amortised optimizer
  from a fixed state whose next step updates nothing / the factors only / the
  factors and the eigenbases (count 100: running averages, not count 0's one
  batch); `kfac_mix` is their cadence-weighted mean (a check on kfac_amortised);
* pieces: `jax.value_and_grad` alone, `kd.value_and_grad` alone on a plain and a
  factor step (with `opt_state`), and the K-FAC `tx.update` alone on a plain step.

The machine is shared and noisy, so the methods are interleaved (round r runs
every method once) and each ratio is the median over rounds of the per-round
ratio to SGD (and to Adam). Each block is timed in wall-clock and in process
CPU time (all threads): on a machine shared with other jobs the CPU-time ratios
are the steadier ones. Compile time is `jit(step).lower(...).compile()` after
`jax.clear_caches()`, so that every repetition traces and compiles anew, the
methods alternating; the compile ratio to SGD is the median of the
per-repetition ratios (issue 16's check on the CNN: ≤ 2). Under
each table, an analytic FLOP count (see `flop_model`) gives the floor that
K-FAC's extra arithmetic puts under each kind of step. A watchdog exits with
status 3 (and every thread's Python stack) when no step finishes for
`--hang-timeout` seconds.

On CPU, `jnp.linalg.eigh` calls LAPACK from scipy's OpenBLAS, whose own threads
compete with XLA's thread pool (and spin while they wait), so this script sets
`OPENBLAS_NUM_THREADS=1` unless it is set, as the other benchmarks do: eigh
times an order of magnitude lower and far less erratic, and no cost carried into
the next runner. With OpenBLAS's default threads the MLP's SGD step, the first
runner of each round (after the previous round's Shampoo and SOAP), took 10.0
ms against Adam's 6.4 (2026-11-29, 2149aaa); alone, 5.3-6.3 ms against 6.6-7.0,
and 8.7-14.0 ms right after one 512 x 512 eigh. The header records the setting.

Usage: [OPENBLAS_NUM_THREADS=n] python benchmarks/step_time.py [--quick]
       [--models mlp,cnn,lm] [--rounds R] [--reps N] [--cycles C] [--chain-steps S]
       [--compile-reps K] [--hang-timeout S] [--core] [--merge]
       [--out benchmarks/results]
Writes step_time.md and step_time.json (step_time_quick.* with --quick: the
MLP unless --models, 2 rounds of 3 steps, chained blocks of 11).
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, NamedTuple

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # before numpy loads OpenBLAS

import flax.linen as nn  # pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_dist as kd

import _common  # benchmarks/, on sys.path when run as a script
import _models

FACTOR_EVERY, INVERSE_EVERY = 10, 100
LAMBDA_INTERVAL = 5       # kd.kfac's damping_adaptation_interval default
ROOTS_EVERY = 10          # Shampoo's roots and SOAP's eigenbases
LR = 1e-2


class Watchdog:
  """Exits (status 3, with every thread's Python stack) when no step finished
  for `seconds`: a hung XLA CPU thread pool must not hang the benchmark."""

  def __init__(self, seconds: float):
    self.seconds, self.last = seconds, time.monotonic()
    if seconds > 0:
      threading.Thread(target=self._watch, daemon=True).start()

  def kick(self):
    self.last = time.monotonic()

  def _watch(self):
    while True:
      time.sleep(min(5.0, self.seconds))
      if time.monotonic() - self.last > self.seconds:
        print(f"\nstep_time: no step finished for {self.seconds:.0f} s; the XLA CPU "
              "runtime looks deadlocked (e.g. batched LAPACK eigh/cholesky fanning out "
              "over a busy intra-op pool). Python stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)


WATCHDOG = Watchdog(0)


# --------------------------------------------------------------------- models



# ---------------------------------------------------------------------- steps

def copies(params, opt_state):
  """Fresh buffers of (params, opt_state), for a step that donates them."""
  return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, (params, opt_state)))


def random_like(tree, seed: int):
  """A tree of standard normals shaped and typed as `tree`."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree_util.tree_unflatten(
      treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def advance(step, params, opt_state, x, y, n):
  """(params, opt_state) after `n` steps from copies of the given ones (which
  stay valid: `step` may donate its inputs)."""
  params, opt_state = copies(params, opt_state)
  for _ in range(n):
    params, opt_state, _ = step(params, opt_state, x, y)
    jax.block_until_ready(opt_state)
    WATCHDOG.kick()
  return params, opt_state


def compile_time(fn, *args) -> dict[str, float]:
  """Seconds to trace+lower and to compile a fresh `jax.jit(fn)`. jax's
  in-memory caches are cleared first: they key on `fn` and the computation,
  and would answer a repetition in milliseconds."""
  jax.clear_caches()
  jitted = jax.jit(fn)
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  WATCHDOG.kick()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def flop_model(model, params, x, layers, loss_fn, y) -> dict:
  """FLOPs per step of the pieces of K-FAC, against those of forward+backward.

  Per tagged dense or conv layer with N positions (examples, or examples ×
  output pixels / tokens), factor dimensions dA (bias included) and dG:
  forward+backward ≈ 3·2·N·(dA−1)·dG (2· for the model's first layer, whose
  input needs no gradient); preconditioning (method eigen: Q_Aᵀ∇Q_G, then
  Q_A(·)Q_Gᵀ) = 4·(dA²·dG + dA·dG²); factors A and G = 2·N·(dA² + dG²); eigh
  ≈ 9·d³ per factor (Golub & Van Loan's count for a symmetric
  eigendecomposition with vectors; an upper estimate). An embedding (diagonal
  A) counts the G side only: 4·V·dG², 2·N·dG², 9·dG³. LayerNorm's unit-wise
  2x2 blocks are negligible and not counted. Adaptive K-FAC's tangent pass
  `J v` (one per vector; two: Δ and the previous update) ≈ 2·2·N·(dA−1)·dG
  per layer, `ẋW + xẆ` (2·N·(dA−1)·dG for the first layer, whose input
  carries no tangent).
  """
  positions = {}

  def record(f, args, kwargs, context):
    out = f(*args, **kwargs)
    if context.method_name == "__call__":
      path = "params/" + "/".join(context.module.scope.path)
      positions[path] = int(np.size(out))
    return out

  with nn.intercept_methods(record):
    jax.eval_shape(model.apply, params, x)
  cost = jax.jit(jax.value_and_grad(loss_fn)).lower(params, x, y).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  total = dict(fwd_bwd=0.0, precondition=0.0, factors=0.0, eigh=0.0, tangent=0.0)
  for i, layer in enumerate(layers):
    a, g = layer.a_dim, layer.g_dim
    n = positions[layer.name] // g      # the output has N positions × g features
    if layer.kind in ("dense", "conv2d"):
      total["fwd_bwd"] += 2 * n * (a - 1) * g * (2 if i == 0 else 3)
      total["tangent"] += 2 * n * (a - 1) * g * (1 if i == 0 else 2)
      total["precondition"] += 4 * (a * a * g + a * g * g)
      total["factors"] += 2 * n * (a * a + g * g)
      total["eigh"] += 9 * (a ** 3 + g ** 3)
    elif layer.kind == "embed":
      total["precondition"] += 4 * a * g * g
      total["factors"] += 2 * n * g * g
      total["eigh"] += 9 * g ** 3
  total["fwd_bwd_xla"] = float(cost.get("flops", float("nan"))) if cost else float("nan")
  fb = total["fwd_bwd"]
  total["floor_plain"] = (fb + total["precondition"]) / fb
  total["floor_factor"] = (fb + total["precondition"] + total["factors"]) / fb
  total["floor_amortised"] = (fb + total["precondition"] + total["factors"] / FACTOR_EVERY
                              + total["eigh"] / INVERSE_EVERY) / fb
  return total


class Runner:
  """A measurement: `run()` returns seconds per step of one timed block."""

  def __init__(self, name: str, run: Callable[..., tuple[float, float]] | None,
               group: str, note: str):
    self.name, self.run, self.group, self.note = name, run, group, note


def fixed_runner(fn, args, reps: int, donated: bool = False):
  """Calls `fn(*args)` `reps` times from the same inputs (`donated`: `fn`
  donates its first two arguments, so each call gets fresh copies of them,
  made outside the timing).

  Returns (wall, cpu) seconds per call; cpu is the process's CPU time (all
  threads), which other processes on a shared machine disturb much less.
  """
  def run(n=None):
    n = reps if n is None else n
    wall = cpu = 0.0
    for _ in range(n):
      call_args = copies(*args[:2]) + tuple(args[2:]) if donated else args
      t, c = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*call_args))
      wall, cpu = wall + time.perf_counter() - t, cpu + time.process_time() - c
      WATCHDOG.kick()
    return wall / n, cpu / n
  return run


def chained_runner(step, init, reps: int):
  """Runs `reps` consecutive steps carrying (params, opt_state); (wall, cpu) s
  per step. `step` may donate its first two arguments: it starts from copies
  of `init`'s."""
  params, opt_state, x, y = init
  carry = [copies(params, opt_state) + (x, y)]
  def run(n=None):
    n = reps if n is None else n
    params, opt_state, x, y = carry[0]
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
      params, opt_state, loss = step(params, opt_state, x, y)
      jax.block_until_ready((params, opt_state, loss))
      WATCHDOG.kick()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    carry[0] = (params, opt_state, x, y)
    carry.append(float(loss))
    return wall / n, cpu / n
  run.carry = carry
  return run


class Methods(NamedTuple):
  """A step_time model, its batch and every method's transform and step."""
  model: nn.Module
  params: Any
  x: jax.Array
  y: jax.Array
  desc: str
  loss_fn: Callable
  grad_fn: kd.ValueAndGrad
  layers: tuple
  txs: dict[str, optax.GradientTransformation]
  steps: dict[str, Callable]     # unjitted (params, opt_state, x, y) -> ...


def methods(model_name: str) -> Methods:
  """The model `model_name`, every method's optax transform and its step
  (`_common.kfac_step` / `optax_step`), by method name."""
  model, params, x, y, desc = _models.step_problem(model_name)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)

  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  txs = {
      "sgd": optax.sgd(LR, momentum=0.9),
      "adam": optax.adam(1e-3),
      "kfac_every": kd.kfac(LR, layers=layers, factor_update_every=1,
                            inverse_update_every=1),
      "kfac_amortised": kd.kfac(LR, layers=layers, factor_update_every=FACTOR_EVERY,
                                inverse_update_every=INVERSE_EVERY),
      "kfac_adaptive": kd.kfac(None, None, layers=layers, grad_fn=grad_fn,
                               adapt_damping=True, factor_update_every=FACTOR_EVERY,
                               inverse_update_every=INVERSE_EVERY),
      "ekfac_amortised": kd.kfac(LR, layers=layers, factor_update_every=FACTOR_EVERY,
                                 inverse_update_every=INVERSE_EVERY,
                                 eigenvalue_correction="ekfac"),
      "shampoo": kd.shampoo(LR, preconditioning_compute_steps=ROOTS_EVERY),
      "soap": kd.soap(1e-3, precondition_every=ROOTS_EVERY),
  }
  steps = {
      "sgd": _common.optax_step(loss_fn, txs["sgd"]),
      "adam": _common.optax_step(loss_fn, txs["adam"]),
      "kfac_every": _common.kfac_step(grad_fn, txs["kfac_every"]),
      "kfac_amortised": _common.kfac_step(grad_fn, txs["kfac_amortised"]),
      "kfac_adaptive": _common.kfac_step(grad_fn, txs["kfac_adaptive"], adaptive=True),
      "ekfac_amortised": _common.kfac_step(grad_fn, txs["ekfac_amortised"]),
      "shampoo": _common.optax_step(loss_fn, txs["shampoo"]),
      "soap": _common.optax_step(loss_fn, txs["soap"]),
  }
  return Methods(model, params, x, y, desc, loss_fn, grad_fn, layers, txs, steps)


def build(model_name: str, args):
  model, params, x, y, desc, loss_fn, grad_fn, layers, txs, steps = methods(model_name)
  if args.core:                  # the GPU check's set: SGD, Adam, amortised K-FAC
    txs = {k: txs[k] for k in CORE}
    steps = {k: steps[k] for k in CORE}
  states = {k: tx.init(params) for k, tx in txs.items()}

  # Compile time of each step (fresh jit each time, the methods alternating;
  # medians over the repetitions, each ratio to SGD's of the same repetition).
  compile_times = {}
  for _ in range(args.compile_reps):
    for k, step in steps.items():
      compile_times.setdefault(k, []).append(compile_time(step, params, states[k], x, y))
  compile_med = {k: dict({f: statistics.median(r[f] for r in v) for f in v[0]},
                         vs_sgd=statistics.median(r["total_s"] / s["total_s"] for r, s
                                                  in zip(v, compile_times["sgd"])),
                         reps=len(v))
                 for k, v in compile_times.items()}

  # Every step donates params and state, as a training loop runs it; the
  # rows from one fixed state give it fresh copies (`fixed_runner`).
  donating = {k: jax.jit(s, donate_argnums=(0, 1)) for k, s in steps.items()}

  # Fixed K-FAC states of the amortised optimizer at each kind of step.
  amort = donating["kfac_amortised"]
  st0 = states["kfac_amortised"]                                    # count 0
  p1, st1 = advance(amort, params, st0, x, y, 1)                    # count 1
  p10, st10 = advance(amort, p1, st1, x, y, FACTOR_EVERY - 1)       # count 10
  # The eigh step from count INVERSE_EVERY, not 0: the count-0 factors are one
  # batch's statistics, whose eigh ran 15% faster than later running averages
  # (the LM on this CPU: 73 against 83-88 ms).
  p100, st100 = advance(amort, p10, st10, x, y, INVERSE_EVERY - FACTOR_EVERY)
  kinds = {"kfac_plain": copies(p1, st1), "kfac_factor": (p10, st10),
           "kfac_inverse": (p100, st100)}
  for name, (_, s) in kinds.items():
    ks = _common.kfac_state(s)
    inv = int(ks.count) % INVERSE_EVERY == 0
    assert bool(ks.update_factors) == (name != "kfac_plain"), name
    assert inv == (name == "kfac_inverse"), name

  # Pieces: the capture alone and the update alone.
  jax_vg = jax.jit(jax.value_and_grad(loss_fn))
  kd_vg = jax.jit(lambda p, s, x, y: grad_fn(p, x, y, opt_state=s))
  _, _, plain_stats = jax.block_until_ready(kd_vg(p1, st1, x, y))
  _, grads1 = jax.block_until_ready(jax_vg(p1, x, y))
  tx_a = txs["kfac_amortised"]
  kfac_update = jax.jit(lambda g, s, p, st: tx_a.update(g, s, p, kfac_stats=st))
  sgd_update = jax.jit(lambda g, s, p: txs["sgd"].update(g, s, p))

  reps, cycle = args.reps, args.chain_steps or args.cycles * INVERSE_EVERY
  runners = [
      Runner("sgd", chained_runner(donating["sgd"], (params, states["sgd"], x, y), reps),
             "main", "optax.sgd(momentum=0.9)"),
      Runner("adam", chained_runner(donating["adam"], (params, states["adam"], x, y), reps),
             "main", "optax.adam"),
      Runner("kfac_amortised", chained_runner(amort, (params, st0, x, y), cycle),
             "main", f"factors every {FACTOR_EVERY}, eigh every {INVERSE_EVERY}; "
             f"{cycle} consecutive steps"),
  ]
  if not args.core:
    runners.insert(2, Runner("kfac_every", chained_runner(
        donating["kfac_every"], (params, states["kfac_every"], x, y),
        max(1, reps // 2)), "main", "factors + eigh every step"))
  for name, (p, s) in kinds.items():
    note = {"kfac_plain": "no factor, no eigh", "kfac_factor": "factors, no eigh",
            "kfac_inverse": "factors + eigh"}[name]
    n = max(2, reps // 4) if name == "kfac_inverse" else reps
    runners.append(Runner(name, fixed_runner(amort, (p, s, x, y), n, donated=True), "kind",
                          note))
  runners += [
      Runner("jax.value_and_grad", fixed_runner(jax_vg, (p1, x, y), reps), "piece",
             "capture-free gradient"),
      Runner("kd.value_and_grad plain", fixed_runner(kd_vg, (p1, st1, x, y), reps),
             "piece", "opt_state on a non-factor step"),
      Runner("kd.value_and_grad factor", fixed_runner(kd_vg, (p10, st10, x, y), reps),
             "piece", "opt_state on a factor step"),
      Runner("sgd tx.update", fixed_runner(sgd_update, (grads1, states["sgd"], p1), reps),
             "piece", "optax.sgd update alone"),
      Runner("kfac tx.update plain", fixed_runner(
          kfac_update, (grads1, st1, p1, plain_stats), reps), "piece",
          "K-FAC update alone, plain step"),
  ]

  if not args.core:
    runners += adaptive_runners(grad_fn, layers, donating["kfac_adaptive"], params,
                                states["kfac_adaptive"], x, y, grads1, reps, cycle)
    runners += chained_runners(donating, states, params, x, y, cycle)
  return dict(desc=desc, layers=layers, runners=runners, compile=compile_med,
              steps_per_cycle=cycle, flops=flop_model(model, params, x, layers, loss_fn, y))


def chained_runners(donating: dict, states: dict, params, x, y, cycle: int) -> list[Runner]:
  """EK-FAC, `kd.shampoo` and `kd.soap`, each over `cycle` consecutive steps
  (`donating`: the jitted steps that donate params and state)."""
  return [Runner("ekfac_amortised", chained_runner(
      donating["ekfac_amortised"], (params, states["ekfac_amortised"], x, y), cycle),
      "ekfac", f"EK-FAC, the amortised cadence; {cycle} consecutive steps")] + [
      Runner(name, chained_runner(donating[name], (params, states[name], x, y), cycle),
             "shampoo", f"{what}, every {ROOTS_EVERY} steps; {cycle} consecutive steps")
      for name, what in (("shampoo", "kd.shampoo: roots"), ("soap", "kd.soap: eigenbases"))]


def adaptive_runners(grad_fn, layers, step, params, state, x, y, grads, reps: int,
                     cycle: int) -> list[Runner]:
  """Adaptive K-FAC (`kd.kfac(None, None, adapt_damping=True)`, the amortised
  cadence, damping adapted every T = 5 steps): the chained run, one step of
  each kind from fixed states (count 1: plain, no damping step; count 4:
  plain with the damping step), the plain step with the momentum fixed at 0
  (α alone: one tangent pass), the damping alone adapted (`kd.kfac(LR, 0.9,
  adapt_damping=True)`) at counts 1 and 4, and the two extra pieces. `step`
  donates params and state, as the other K-FAC rows' steps."""
  p1, s1 = advance(step, params, state, x, y, 1)
  p4, s4 = advance(step, p1, s1, x, y, 3)
  alpha_tx = kd.kfac(None, 0.0, layers=layers, grad_fn=grad_fn, adapt_damping=True,
                     factor_update_every=FACTOR_EVERY, inverse_update_every=INVERSE_EVERY)
  alpha_step = jax.jit(_common.kfac_step(grad_fn, alpha_tx, adaptive=True),
                       donate_argnums=(0, 1))
  pa, sa = advance(alpha_step, params, alpha_tx.init(params), x, y, 1)
  # The damping alone adapted: kfac_amortised's η, μ and KL clip fixed.
  lambda_tx = kd.kfac(LR, 0.9, layers=layers, grad_fn=grad_fn, adapt_damping=True,
                      kl_clip=1e-3, factor_update_every=FACTOR_EVERY,
                      inverse_update_every=INVERSE_EVERY)
  lambda_step = jax.jit(_common.kfac_step(grad_fn, lambda_tx, adaptive=True),
                        donate_argnums=(0, 1))
  pl1, sl1 = advance(lambda_step, params, lambda_tx.init(params), x, y, 1)
  pl4, sl4 = advance(lambda_step, pl1, sl1, x, y, 3)
  # Two vectors as unlike as the step's Δ and v: XLA would share the tangent
  # passes of equal ones, and the parameters' own (`dW x` = the forward's `W x`).
  gram = jax.jit(lambda p, v, w, x, y: grad_fn.gauss_newton_gram(p, (v, w), x, y,
                                                                 with_loss=True))
  other = random_like(params, 1)
  loss = jax.jit(grad_fn.loss)
  return [
      Runner("kfac_adaptive", chained_runner(step, (params, state, x, y), cycle),
             "adaptive", f"α, μ, λ adapted (T = 5); {cycle} consecutive steps"),
      Runner("adaptive_plain", fixed_runner(step, (p1, s1, x, y), reps, donated=True),
             "adaptive", "no factor, no eigh, no damping step"),
      Runner("adaptive_damping", fixed_runner(step, (p4, s4, x, y), reps, donated=True),
             "adaptive", "no factor, no eigh, damping step"),
      Runner("adaptive_alpha_plain", fixed_runner(alpha_step, (pa, sa, x, y), reps,
                                                  donated=True),
             "adaptive", "momentum fixed at 0 (α alone), no factor, no eigh"),
      Runner("adaptive_lambda_plain", fixed_runner(lambda_step, (pl1, sl1, x, y), reps,
                                                   donated=True),
             "adaptive", "λ alone adapted (η, μ fixed), no factor, no eigh, no damping "
             "step"),
      Runner("adaptive_lambda_damping", fixed_runner(lambda_step, (pl4, sl4, x, y), reps,
                                                     donated=True),
             "adaptive", "λ alone adapted, no factor, no eigh, damping step (d's "
             "tangent pass and L(θ+d))"),
      Runner("gauss_newton_gram k=2", fixed_runner(gram, (p1, grads, other, x, y), reps),
             "adaptive", "the model's Gram matrix and L(θ): one linearisation, two "
             "tangent passes"),
      Runner("grad_fn.loss", fixed_runner(loss, (p1, x, y), reps), "adaptive",
             "one forward pass (the damping step's L(θ+d))"),
  ]


def adaptive_cost(wall: dict, cpu: dict) -> dict:
  """The issue-14 cost check, medians over rounds of per-round ratios: the
  extra time of an adaptive plain step over K-FAC's plain step in units of a
  forward+backward (`jax.value_and_grad`; target ≤ 1), and the extra time of a
  damping step in units of a forward (`grad_fn.loss`; target ≈ 1). The plain
  step's extra is split into the two tangent passes measured alone (the Gram
  matrix less its forward) and the rest (the parameter-sized work of the
  quadratic model, less what the passes share with the step's gradient)."""
  out = {}
  for clock, times in (("wall", wall), ("cpu", cpu)):
    fb = times["jax.value_and_grad"]
    extra = [a - k for a, k in zip(times["adaptive_plain"], times["kfac_plain"])]
    tangent = [g - f for g, f in zip(times["gauss_newton_gram k=2"], times["grad_fn.loss"])]
    out[f"jvp_{clock}"] = statistics.median(e / f for e, f in zip(extra, fb))
    out[f"tangent_{clock}"] = statistics.median(t / f for t, f in zip(tangent, fb))
    out[f"rest_{clock}"] = statistics.median((e - t) / f
                                            for e, t, f in zip(extra, tangent, fb))
    out[f"alpha_jvp_{clock}"] = statistics.median(
        (a - k) / f for a, k, f in zip(times["adaptive_alpha_plain"], times["kfac_plain"],
                                       times["jax.value_and_grad"]))
    out[f"damping_{clock}"] = statistics.median(
        (d - a) / f for d, a, f in zip(times["adaptive_damping"], times["adaptive_plain"],
                                       times["grad_fn.loss"]))
    out[f"amortised_{clock}"] = statistics.median(
        a / k for a, k in zip(times["kfac_adaptive"], times["kfac_amortised"]))
    # The damping alone: its plain step over K-FAC's, its adaptation step over
    # its plain step, and per step on average (one adaptation every T = 5).
    plain = [(l - k) / f for l, k, f in zip(times["adaptive_lambda_plain"],
                                            times["kfac_plain"], fb)]
    adapting = [(d - l) / f for d, l, f in zip(times["adaptive_lambda_damping"],
                                               times["adaptive_lambda_plain"], fb)]
    out[f"lambda_plain_{clock}"] = statistics.median(plain)
    out[f"lambda_damping_{clock}"] = statistics.median(adapting)
    out[f"lambda_mean_{clock}"] = statistics.median(
        p + a / LAMBDA_INTERVAL for p, a in zip(plain, adapting))
  return out


def measure(model_name: str, args) -> dict:
  b = build(model_name, args)
  runners = b["runners"]
  for r in runners:            # warm-up: one untimed call each
    r.run(1)
  wall = {r.name: [] for r in runners}
  cpu = {r.name: [] for r in runners}
  for i in range(args.rounds):
    for r in runners:
      w, c = r.run()
      wall[r.name].append(w)
      cpu[r.name].append(c)
    print(f"  [{model_name}] round {i + 1}/{args.rounds} (wall ms): "
          + ", ".join(f"{k} {1e3 * v[-1]:.1f}" for k, v in wall.items()), flush=True)

  n_inv = 1
  n_fac = INVERSE_EVERY // FACTOR_EVERY - 1
  n_plain = INVERSE_EVERY - n_fac - n_inv
  for times in (wall, cpu):
    times["kfac_mix"] = [(i + n_fac * f + n_plain * p) / INVERSE_EVERY for p, f, i in zip(
        times["kfac_plain"], times["kfac_factor"], times["kfac_inverse"])]

  def ratio(times, name, base):
    return statistics.median(a / b for a, b in zip(times[name], times[base]))

  rows = []
  mix = Runner("kfac_mix", None, "kind", f"({n_inv}·inverse + {n_fac}·factor + "
               f"{n_plain}·plain)/{INVERSE_EVERY} of the rows below")
  n_main = sum(r.group == "main" for r in runners)
  for r in runners[:n_main] + [mix] + runners[n_main:]:
    rows.append(dict(name=r.name, group=r.group, note=r.note,
                     ms=1e3 * statistics.median(wall[r.name]),
                     ms_min=1e3 * min(wall[r.name]), ms_max=1e3 * max(wall[r.name]),
                     vs_sgd=ratio(wall, r.name, "sgd"), vs_adam=ratio(wall, r.name, "adam"),
                     cpu_ms=1e3 * statistics.median(cpu[r.name]),
                     cpu_vs_sgd=ratio(cpu, r.name, "sgd"),
                     cpu_vs_adam=ratio(cpu, r.name, "adam"),
                     compile=b["compile"].get(r.name)))
  final_losses = {r.name: r.run.carry[-1] for r in runners
                  if hasattr(r.run, "carry") and len(r.run.carry) > 1}
  return dict(model=model_name, description=b["desc"],
              layers=[dict(name=l.name, kind=l.kind, a_dim=l.a_dim, g_dim=l.g_dim)
                      for l in b["layers"]],
              flops=b["flops"], rows=rows, raw_wall_seconds=wall, raw_cpu_seconds=cpu,
              final_losses=final_losses, steps_in_amortised_run=b["steps_per_cycle"],
              **({} if args.core else dict(
                  adaptive_cost=adaptive_cost(wall, cpu),
                  ekfac_cost=cost_ratio(wall, cpu, "ekfac_amortised", "kfac_amortised"),
                  soap_cost=cost_ratio(wall, cpu, "soap", "shampoo"))))


def cost_ratio(wall: dict, cpu: dict, name: str, base: str) -> dict:
  """`{"wall", "cpu"}`: the median over rounds of `name`'s time per step over
  `base`'s."""
  return {clock: statistics.median(a / b for a, b in zip(times[name], times[base]))
          for clock, times in (("wall", wall), ("cpu", cpu))}


# -------------------------------------------------------------------- report

def markdown(results: list[dict], env: dict, args) -> str:
  lines = ["# Step time: K-FAC vs optax SGD and Adam", "",
           f"- date: {env['date']}; jax {env['jax']} ({env['backend']}); "
           f"CPU: {env['cpu']} ({env['cpu_count']} cores, shared with other jobs)",
           f"- library: {env['library']} at commit {env['commit']}; thread settings: "
           f"{env['threads_env'] or 'defaults'} (LAPACK eigh runs on scipy's OpenBLAS: "
           "with its default threads it contends with XLA's own pool and slows the "
           "next runner, see OPENBLAS_NUM_THREADS in the docstring)",
           f"- {args.rounds} interleaved rounds (every method once per round); wall ms = "
           "median per step (min-max over rounds); CPU ms = process CPU time (all "
           "threads) per step, less disturbed by other jobs on the machine; each ratio "
           "is the median over rounds of the per-round ratio.",
           "- Every step is jitted with `donate_argnums=(0, 1)` (params and optimizer "
           "state, as a training loop should); the rows from one fixed state run it on "
           "fresh copies of that state, made outside the timing.",
           f"- Host allocator: {env.get('host_allocator', 'glibc defaults')} (with "
           "glibc's dynamic mmap threshold a donated step can fault its temporaries' "
           "pages in anew every step, by chance of the heap's history: PERF_NOTES §43).",
           f"- K-FAC: `kd.kfac(lr, ...)`, method eigen, KL clip 1e-3; amortised = "
           f"factor_update_every={FACTOR_EVERY}, inverse_update_every={INVERSE_EVERY}.",
           "- compile s = `jax.jit(step).lower(...).compile()`, trace + XLA compile.",
           "- Generated by `python benchmarks/step_time.py"
           + (" --quick" if args.quick else "") + (" --core" if args.core else "") + "`"
           + (f" (the {args.models} rows re-measured with `--models {args.models} --merge`; "
              "the others come from the earlier run, each section says when)"
              if args.merge else "") + ".", ""]
  for res in results:
    f = res["flops"]
    lines += [f"## {res['model']}: {res['description']}", "",
              f"Measured {res['measured_at']}." if "measured_at" in res else "", "",
              "Tagged layers: " + ", ".join(
                  f"{l['name'].split('/')[-1]} (A {l['a_dim']}, G {l['g_dim']})"
                  for l in res["layers"]), "",
              _common.md_table([[
                  row["name"], row["note"],
                  f"{row['ms']:.2f} ({row['ms_min']:.1f}-{row['ms_max']:.1f})",
                  f"{row['vs_sgd']:.2f}", f"{row['vs_adam']:.2f}", f"{row['cpu_ms']:.2f}",
                  f"{row['cpu_vs_sgd']:.2f}", f"{row['cpu_vs_adam']:.2f}",
                  f"{row['compile']['total_s']:.2f}" if row["compile"] else ""]
                  for row in res["rows"]],
                  ["method", "what", "wall ms/step", "× SGD", "× Adam", "CPU ms/step",
                   "× SGD (CPU)", "× Adam (CPU)", "compile s"])]
    lines += ["", f"FLOPs per step (analytic; XLA's count for forward+backward: "
              f"{f['fwd_bwd_xla'] / 1e9:.2f} GFLOP): forward+backward "
              f"{f['fwd_bwd'] / 1e9:.2f} G, preconditioning {f['precondition'] / 1e9:.2f} G, "
              f"factors {f['factors'] / 1e9:.2f} G (factor steps), eigh ≈ {f['eigh'] / 1e9:.2f} G "
              f"(inverse steps). FLOP floor of K-FAC vs SGD: plain step "
              f"{f['floor_plain']:.2f}×, factor step {f['floor_factor']:.2f}×, amortised "
              f"{f['floor_amortised']:.2f}× (9d³ for eigh is an upper estimate, and LAPACK's "
              "FLOP rate is not XLA's: the kfac_inverse row is the measured cost).", ""]
    lines += _compile_line(res), ""
    a = res.get("adaptive_cost")
    if a:
      holds = "holds" if a["jvp_cpu"] <= 1.0 else "**does not hold**"
      lines += [f"Adaptive K-FAC's extra cost (issue 14; CPU time, wall in brackets): "
                f"a plain step costs {a['jvp_cpu']:.2f}× ({a['jvp_wall']:.2f}×) of a "
                "forward+backward (`jax.value_and_grad`) more than K-FAC's plain step "
                f"(target ≤ 1: {holds}; two tangent passes, for Δ and the previous "
                f"update; with the momentum fixed at 0, one: {a['alpha_jvp_cpu']:.2f}× "
                f"({a['alpha_jvp_wall']:.2f}×){_tangent_floor(f)}){_split(a)}, "
                f"and a damping step {a['damping_cpu']:.2f}× "
                f"({a['damping_wall']:.2f}×) of a forward (`grad_fn.loss`) more than a "
                "plain adaptive step (one forward expected, every T = 5 steps); the "
                f"amortised adaptive run costs {a['amortised_cpu']:.2f}× "
                f"({a['amortised_wall']:.2f}×) kfac_amortised per step.", ""]
      if "lambda_mean_cpu" in a:
        holds = "holds" if a["lambda_mean_cpu"] <= 1.0 else "**does not hold**"
        lines += [f"With the damping alone adapted (`kd.kfac(η, 0.9, adapt_damping=True, "
                  f"kl_clip=1e-3)`, kfac_amortised's η and clip): a plain step costs "
                  f"{a['lambda_plain_cpu']:.2f}× ({a['lambda_plain_wall']:.2f}×) of a "
                  "forward+backward more than K-FAC's plain step (no model: none "
                  f"expected), an adaptation step {a['lambda_damping_cpu']:.2f}× "
                  f"({a['lambda_damping_wall']:.2f}×) more than its plain step (d's "
                  "tangent pass and one forward), so "
                  f"{a['lambda_mean_cpu']:.2f}× ({a['lambda_mean_wall']:.2f}×) per step "
                  f"with an adaptation every {LAMBDA_INTERVAL} (target ≤ 1: {holds}).",
                  ""]
    for key, what, base in (
        ("ekfac_cost", "EK-FAC (`eigenvalue_correction=\"ekfac\"`, the same amortised "
         "cadence)", "kfac_amortised's"),
        ("soap_cost", f"SOAP (`kd.soap`, eigenbases every {ROOTS_EVERY} steps)",
         f"`kd.shampoo`'s (roots every {ROOTS_EVERY} steps)")):
      e = res.get(key)
      if e:
        holds = "holds" if e["cpu"] <= 1.3 else "**does not hold**"
        lines += [f"{what}: {e['cpu']:.2f}× ({e['wall']:.2f}× wall) {base} CPU time per "
                  f"step (issue 15's target ≤ 1.3: {holds}).", ""]
  return "\n".join(lines)


COMPILE_TARGET = 2.0     # issue 16: the amortised K-FAC step's compile ≤ 2× SGD's (CNN)


def _compile_line(res: dict) -> str:
  """The amortised K-FAC step's compile against SGD's: the median of the
  per-repetition ratios (absent from results measured before they were kept)."""
  k = next((row["compile"] or {} for row in res["rows"] if row["name"] == "kfac_amortised"),
           {})
  if "vs_sgd" not in k:
    return ""
  target = ""
  if res["model"] == "cnn":
    holds = "holds" if k["vs_sgd"] <= COMPILE_TARGET else "**does not hold**"
    target = f" (issue 16's target on the CNN ≤ {COMPILE_TARGET:g}: {holds})"
  reps = f"{k['reps']} repetition" + "s" * (k["reps"] != 1)
  return (f"Compile (trace + XLA compile of a fresh `jax.jit`, {reps} alternating the "
          "methods; ratio = median of the per-repetition ratios): the "
          f"amortised K-FAC step {k['total_s']:.2f} s, {k['vs_sgd']:.2f}× SGD's{target}.")


def _split(cost: dict) -> str:
  """The plain step's extra as the two tangent passes measured alone and the
  rest (absent from results measured before the split was kept)."""
  if "tangent_cpu" not in cost:
    return ""
  return (f"; of it, the two tangent passes measured alone (`gauss_newton_gram` of two "
          f"vectors less a forward) {cost['tangent_cpu']:.2f}× "
          f"({cost['tangent_wall']:.2f}×) and the rest {cost['rest_cpu']:.2f}× "
          f"({cost['rest_wall']:.2f}×), the extra less the passes alone: the model's "
          "parameter-sized work (five inner products, the update, its finite check, the "
          "velocity's write; on the MLP a fixed time per step that the batch does not "
          "scale, PERF_NOTES §38) less whatever the passes share with the step's own "
          "gradient")


def _tangent_floor(flops: dict) -> str:
  """The two tangent passes' FLOPs against a forward+backward's (the tagged
  layers' matmuls; absent from results measured before they were counted)."""
  if "tangent" not in flops:
    return ""
  return (f"; in the tagged layers' FLOPs the two tangent passes alone are "
          f"{2 * flops['tangent'] / flops['fwd_bwd']:.2f}× a forward+backward, a floor "
          "for the time ratio where the step's time is those matmuls at one FLOP rate "
          "(the MLP; a conv's or an attention model's backward runs slower per FLOP "
          "than its tangent passes); the forward they linearise is the gradient's, "
          "shared by XLA's CSE")


CORE = ("sgd", "adam", "kfac_amortised")
FULL = dict(rounds=5, reps=10, cycles=1, compile_reps=5, models="mlp,cnn,lm")
# --quick's chained blocks: 11 steps from count 0 take the count-0 decomposition,
# nine plain steps and a factor step (every kind; a whole cycle is 100 steps).
QUICK = dict(rounds=2, reps=3, cycles=1, chain_steps=FACTOR_EVERY + 1, compile_reps=1,
             models="mlp")


def merged(results: list[dict], path: str) -> list[dict]:
  """`results` with the other models' results of an earlier run (`path`), in
  the order mlp, cnn, lm; each earlier result keeps where it was measured."""
  with open(path) as f:
    old = json.load(f)
  env = old["environment"]
  mine = {r["model"] for r in results}
  kept = [dict(r, measured_at=r.get("measured_at", f"{env['date']}, commit {env['commit']}"))
          for r in old["results"] if r["model"] not in mine]
  order = ["mlp", "cnn", "lm"]
  return sorted(results + kept, key=lambda r: order.index(r["model"])
                if r["model"] in order else len(order))


def main():
  parser = _common.argument_parser(__doc__)
  _common.add_quick(parser, "step_time", QUICK)
  parser.add_argument("--models", default=None,
                      help="comma-separated (default mlp,cnn,lm; quick mlp)")
  parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
  parser.add_argument("--reps", type=int, default=None,
                      help="steps per timed block (fixed-state and short runs)")
  parser.add_argument("--cycles", type=int, default=None,
                      help=f"inverse periods ({INVERSE_EVERY} steps) per amortised block")
  parser.add_argument("--chain-steps", type=int, default=None,
                      help="consecutive steps per chained block instead of --cycles "
                      f"periods (quick: {FACTOR_EVERY + 1})")
  parser.add_argument("--compile-reps", type=int, default=None)
  parser.add_argument("--hang-timeout", type=float, default=600,
                      help="abort (exit 3) when no step finishes for this many seconds")
  parser.add_argument("--core", action="store_true",
                      help="SGD, Adam and amortised K-FAC (its kinds of step and pieces) "
                      "alone: no adaptive K-FAC, EK-FAC, Shampoo or SOAP (the GPU check)")
  parser.add_argument("--merge", action="store_true",
                      help="keep the other models' results of the step_time.json in --out "
                      "(each labelled with the date and commit it was measured at)")
  args = parser.parse_args()
  _common.fill_defaults(args, QUICK, FULL)

  global WATCHDOG
  WATCHDOG = Watchdog(args.hang_timeout)
  env = _common.environment()
  print(f"jax {env['jax']} on {env['cpu']} ({env['cpu_count']} cores)", flush=True)
  results = []
  for name in args.models.split(","):
    results.append(dict(measure(name.strip(), args),
                        measured_at=f"{env['date']}, commit {env['commit']}"))
  if args.merge:
    results = merged(results, os.path.join(args.out, _common.stem("step_time", args.quick)
                                           + ".json"))
  text = markdown(results, env, args)
  print(text)
  stem = _common.stem("step_time", args.quick)
  _common.write_results(args.out, stem, text, dict(
      environment=env, args=vars(args), factor_update_every=FACTOR_EVERY,
      inverse_update_every=INVERSE_EVERY, results=results))
  print(f"wrote {os.path.join(args.out, stem + '.md')} and .json")


if __name__ == "__main__":
  main()
