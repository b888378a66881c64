"""Where K-FAC's step time goes on an accelerator: a short probe for the GPU check.

Three measurements, printed as text (benchmarks/gpu_check.sh appends them to
its log):

* eigh: ms per call of `lax.linalg.eigh` for each implementation the backend
  offers (QR = cuSOLVER syevd, JACOBI = syevj, QDWH = jax's polar-based one)
  on batches of random PSD matrices of the step_time models' factor sizes,
  beside a Cholesky inverse of the same batch (the cheapest decomposition a
  damped-inverse preconditioner could use);
* kernels: the kernels each compiled piece of a K-FAC plain step launches
  (fusions, library calls, control flow) on the CNN and the LM, against
  `jax.value_and_grad` and optax SGD's whole step;
* plain step: ms per call of those pieces (median of `--reps`).

Usage: python benchmarks/gpu_probe.py [--models cnn,lm] [--reps 50] [--no-eigh] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

import kfac_jax_dist as kd

import _common
import _models

EIGH_SIZES = ((1, 785), (2, 513), (4, 257), (8, 129), (16, 65), (24, 35))
# One matrix at a time: is a size 2^k + 1 (a factor with its bias row) slow?
# (Measured on an H100, jax 0.11.2: cuSOLVER syevd took 26 ms per 513 matrix
# in a batch of 2 and 9 ms for one 785.)
SINGLE_SIZES = (35, 65, 129, 256, 257, 272, 512, 513, 520, 544, 784, 785, 1024, 1025)
SKIPPED_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
               "after-all", "partition-id", "replica-id"}


def timed(fn, *args, reps: int) -> float:
  """Median wall ms of `fn(*args)` over `reps` calls, after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - start))
  return statistics.median(times)


def eigh_table(reps: int) -> list[str]:
  lines = ["eigh, ms per batched call (float32, random PSD):",
           "  batch x dim | " + " | ".join(["qr", "jacobi", "qdwh", "cholesky inverse",
                                             "one at a time (lax.map)", "one at a time (unrolled)"])]
  for batch, dim in EIGH_SIZES:
    mats = random_psd(batch, dim)
    cells = []
    for impl in lax.linalg.EighImplementation:
      fn = jax.jit(lambda m, impl=impl: lax.linalg.eigh(m, implementation=impl))
      try:
        cells.append(f"{timed(fn, mats, reps=reps):.2f}")
      except Exception as e:  # an implementation this backend lacks
        cells.append(type(e).__name__)
    inv = jax.jit(lambda m: jax.scipy.linalg.cho_solve(
        (jnp.linalg.cholesky(m), True), jnp.broadcast_to(jnp.eye(m.shape[-1]), m.shape)))
    cells.append(f"{timed(inv, mats, reps=reps):.2f}")
    mapped = jax.jit(lambda m: lax.map(jnp.linalg.eigh, m))
    unrolled = jax.jit(lambda m: [jnp.linalg.eigh(m[i]) for i in range(m.shape[0])])
    cells += [f"{timed(mapped, mats, reps=reps):.2f}", f"{timed(unrolled, mats, reps=reps):.2f}"]
    lines.append(f"  {batch} x {dim} | " + " | ".join(cells))
  lines.append("one matrix, default eigh, ms: " + ", ".join(
      f"{dim}: {timed(jax.jit(jnp.linalg.eigh), random_psd(1, dim)[0], reps=reps):.2f}"
      for dim in SINGLE_SIZES))
  return lines


def random_psd(batch: int, dim: int) -> jax.Array:
  a = jax.random.normal(jax.random.key(dim), (batch, dim, 2 * dim), jnp.float32)
  return a @ jnp.swapaxes(a, -1, -2) / dim + 1e-3 * jnp.eye(dim)


def kernel_census(compiled) -> collections.Counter:
  """Opcode counts of the instructions that launch work: every instruction of
  the computations that are neither fused nor a reduction's reducer
  (`to_apply`), bookkeeping (tuples, parameters) left out. Untaken branches
  of conditionals count too."""
  text = compiled.as_text()
  fused = set(re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", text))
  counts: collections.Counter = collections.Counter()
  inside = False
  for line in text.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      inside = head.group(2) not in fused or bool(head.group(1))
      continue
    m = re.match(r"^\s+(ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(", line)
    if inside and m and m.group(2) not in SKIPPED_OPS:
      counts[m.group(2)] += 1
  return counts


def plain_step_pieces(name: str, reps: int) -> list[str]:
  model, params, x, y, _ = _models.step_problem(name)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)

  grad_fn = kd.value_and_grad(loss_fn)
  layers = grad_fn.discover(params, x, y)
  tx = kd.kfac(1e-2, layers=layers, factor_update_every=10, inverse_update_every=100)
  sgd = optax.sgd(1e-2, momentum=0.9)
  kstep = jax.jit(_common.kfac_step(grad_fn, tx))
  sstep = jax.jit(_common.optax_step(loss_fn, sgd))
  state = tx.init(params)
  p1, s1 = kstep(params, state, x, y)[:2]          # count 1: a plain step next
  _, _, stats = grad_fn(p1, x, y, opt_state=s1)
  _, grads = jax.value_and_grad(loss_fn)(p1, x, y)
  pieces = {
      "sgd step": (sstep, (params, sgd.init(params), x, y)),
      "jax.value_and_grad": (jax.jit(jax.value_and_grad(loss_fn)), (p1, x, y)),
      "kd.value_and_grad plain": (jax.jit(lambda p, s, x, y: grad_fn(p, x, y, opt_state=s)),
                                  (p1, s1, x, y)),
      "kfac tx.update plain": (jax.jit(lambda g, s, p, st: tx.update(g, s, p, kfac_stats=st)),
                               (grads, s1, p1, stats)),
      "kfac step plain": (kstep, (p1, s1, x, y)),
  }
  lines = [f"{name}: piece | ms | kernels (launching instructions) | top opcodes"]
  for label, (fn, args) in pieces.items():
    census = kernel_census(fn.lower(*args).compile())
    top = ", ".join(f"{k} {v}" for k, v in census.most_common(6))
    lines.append(f"  {label} | {timed(fn, *args, reps=reps):.3f} | "
                 f"{sum(census.values())} | {top}")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="cnn,lm")
  parser.add_argument("--reps", type=int, default=50)
  parser.add_argument("--no-eigh", action="store_true", help="skip the eigh table")
  parser.add_argument("--quick", action="store_true", help="3 reps, no eigh table")
  args = parser.parse_args()
  reps = 3 if args.quick else args.reps
  print(f"# gpu_probe: backend {jax.default_backend()}, {jax.devices()[0].device_kind}",
        flush=True)
  for name in [m for m in args.models.split(",") if m]:
    print("\n".join(plain_step_pieces(name, reps)), flush=True)
  if not (args.quick or args.no_eigh):
    print("\n".join(eigh_table(max(3, reps // 5))), flush=True)


if __name__ == "__main__":
  main()
