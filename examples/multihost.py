"""Distributed K-FAC over several processes (hosts) with `jax.distributed`.

JAX's own multi-process runtime is the distributed engine: every process runs
this same script, calls `jax.distributed.initialize`, and then sees the devices
of *all* processes in `jax.devices()`. One mesh axis "data" spans them; the
training step is the usual `jax.shard_map` over that axis with
`in_specs=(P(), kd.partition_specs(opt_state), P("data"), P("data"))`, and each
process feeds only its own rows of the global batch
(`jax.make_array_from_process_local_data`). The K-FAC strategy is the
`kd.Distribution`'s `grad_worker_fraction` (KAISA):

    --strategy comm-opt   fraction 1    second-order state replicated
    --strategy mem-opt    fraction 1/P  second-order state sharded over all P devices
    --strategy hybrid     fraction 1/2  sharded over P/m groups of m = P/2 devices
    --grad-worker-fraction F            any m = F·P that divides P
    --strategy auto       chosen by `kd.Distribution.auto`: the fewest bytes per
                          step whose K-FAC state fits `--memory-budget` bytes per
                          device (the choice and the runner-up are printed)

A strategy name with the suffix `+adaptive` (e.g. `--strategy hybrid+adaptive`)
trains adaptive K-FAC instead (learning rate, momentum and damping from the
exact quadratic model of each batch; `--learning-rate` unused).

Local run (no accelerator needed). Without `--process-id` the script is its own
launcher: it picks a free port on 127.0.0.1 and starts `--num-processes` copies
of itself, each with `--cpu-devices` host CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count`) and gloo CPU collectives,
and prints process 0's output:

    python examples/multihost.py --num-processes 2 --cpu-devices 2 --strategy mem-opt
    python examples/multihost.py --help

Cluster run (GPU / TPU hosts). Run the script once on every host, each with its
own process id and the same coordinator (host 0's address and a free port):

    # on host i of N (i = 0 .. N-1):
    python examples/multihost.py --process-id $i --num-processes $N \\
        --coordinator host0.example.com:12345 --strategy hybrid

or, under SLURM / Open MPI / Cloud TPU, where JAX detects the cluster itself:

    python examples/multihost.py --auto-detect --strategy hybrid

The mesh is every device of every process, so P = N × (devices per host).
Process 0 prints the loss and writes the loss of every step to
`DIR/multihost.csv` and `DIR/multihost.png` (`--out DIR`, default
examples/out; the strategies' curves coincide: they compute the same
updates); every process writes its final parameters to `DIR/process{i}.npz`
(the tests compare them with a single-process run of the same `train`
function). `--out ''` writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Sequence

import numpy as np

STRATEGIES = ("comm-opt", "mem-opt", "hybrid", "auto")
IMAGE_SHAPE = (8, 8, 2)
NUM_CLASSES = 10


# --------------------------------------------------------------------------- #
# The model, the data and one training run. Used by the workers and, on one
# process, by tests/test_multihost.py as the reference.
# --------------------------------------------------------------------------- #

def make_model():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import kfac_jax_dist as kd  # pylint: disable=import-outside-toplevel

  class Net(nn.Module):
    """Conv 3x3 / 2 (4) → dense 16 → dense 10 (no bias): Kronecker factors of
    dimensions 19 and 4, 65 and 16, 16 and 10."""

    @nn.compact
    def __call__(self, x):
      x = nn.relu(kd.linen.Conv(4, (3, 3), strides=2)(x))
      x = x.reshape(x.shape[0], -1)
      x = nn.tanh(kd.linen.Dense(16)(x))
      return kd.linen.Dense(NUM_CLASSES, use_bias=False)(x)

  return Net()


def global_batch(step: int, batch_size: int, seed: int = 0):
  """The step's global batch: each image is its class's fixed random pattern
  plus as much noise. Deterministic in (seed, step)."""
  patterns = np.random.default_rng(seed).normal(size=(NUM_CLASSES,) + IMAGE_SHAPE)
  rng = np.random.default_rng([seed, step + 1])
  y = rng.integers(0, NUM_CLASSES, size=batch_size).astype(np.int32)
  x = (patterns[y] + rng.normal(size=(batch_size,) + IMAGE_SHAPE)).astype(np.float32)
  return x, y


@functools.lru_cache(maxsize=None)
def initial_params(seed: int = 0):
  """The model's initial parameters as host arrays: the same on every process
  (same seed), computed once per process."""
  import jax  # pylint: disable=import-outside-toplevel
  x = np.zeros((1,) + IMAGE_SHAPE, np.float32)
  params = jax.jit(make_model().init)(jax.random.PRNGKey(seed), x)
  return jax.tree_util.tree_map(np.asarray, params)


ADAPTIVE = "+adaptive"


def is_adaptive(strategy: str) -> bool:
  """Whether a strategy name asks for adaptive K-FAC (`hybrid+adaptive`)."""
  return strategy.endswith(ADAPTIVE)


def fraction_of(strategy: str, num_devices: int) -> float | None:
  """`grad_worker_fraction` of a KAISA strategy name on `num_devices` devices;
  None for "auto" (`kd.Distribution.auto` chooses the whole strategy)."""
  strategy = strategy.removesuffix(ADAPTIVE)
  if strategy == "auto":
    return None
  if strategy == "comm-opt":
    return 1.0
  if strategy == "mem-opt":
    return 1.0 / num_devices
  if strategy == "hybrid":
    if num_devices % 2:
      raise ValueError(f"hybrid needs an even number of devices, got {num_devices}")
    return 0.5
  raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")


def train(mesh, grad_worker_fraction: float | None, *, steps: int = 4,
          batch_size: int = 32, factor_update_every: int = 2, inverse_update_every: int = 3,
          learning_rate: float = 0.1, damping: float = 1e-2, seed: int = 0,
          log=None, nan_step: int | None = None, checkpoint: str | None = None,
          resume: tuple[str, int] | None = None, adaptive: bool = False,
          memory_budget: float | None = None):
  """Trains the model with K-FAC over `mesh`'s axis "data" for `steps` steps.

  Works the same on one process and on many: the batch of every step is made
  from this process's rows only, and the parameters come back replicated.
  `nan_step`: that step's first example (a row of process 0) is NaN, so the
  step is skipped on every device of every process. `checkpoint`: save the
  final `{"params", "opt_state"}` there (`kd.save_checkpoint`, every process
  writing its pieces). `resume=(directory, first_step)`: start from such a
  checkpoint (saved by any number of processes) at step `first_step`.
  `grad_worker_fraction=None`: the strategy `kd.Distribution.auto` picks for
  this model, mesh and cadence under `memory_budget` (bytes per device; None:
  any), the same on every process.

  Returns:
    (params, losses, skipped): the final parameters (a pytree of global,
    replicated `jax.Array`s), the global mean loss of every step (floats) and
    the K-FAC state's count of skipped steps.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import kfac_jax_dist as kd  # pylint: disable=import-outside-toplevel

  num_devices = int(mesh.shape["data"])
  if batch_size % num_devices:
    raise ValueError(f"batch size {batch_size} is not a multiple of the {num_devices} devices")
  model = make_model()
  x0, y0 = global_batch(0, batch_size, seed)

  def loss_fn(p, x, y):
    return kd.losses.softmax_cross_entropy(model.apply(p, x), y)

  grad_fn = kd.value_and_grad(loss_fn)
  host_params = initial_params(seed)
  layers = grad_fn.discover(host_params, x0, y0)
  if grad_worker_fraction is None:
    dist = kd.Distribution.auto(mesh, "data", layers, memory_budget=memory_budget,
                                factor_update_every=factor_update_every,
                                inverse_update_every=inverse_update_every)
    if log is not None:
      for line in dist.explanation:
        log(line)
  else:
    dist = kd.Distribution(mesh, axis="data", grad_worker_fraction=grad_worker_fraction)
  common = dict(damping=damping, factor_update_every=factor_update_every,
                inverse_update_every=inverse_update_every, layers=layers,
                distribution=dist)
  if adaptive:
    tx = kd.kfac(None, None, grad_fn=grad_fn, adapt_damping=True,
                 damping_adaptation_interval=1, **common)
  else:
    tx = kd.kfac(learning_rate, momentum=0.9, kl_clip=1e-2, **common)
  # Every process passes the same global values; each keeps its own pieces.
  on_mesh = lambda spec: NamedSharding(mesh, spec)
  params = jax.device_put(host_params, on_mesh(P()))
  # The optimizer state is created directly on the mesh, each process
  # computing only its own pieces (`jit` with the state's partition specs as
  # out_shardings). `kd.shard_state(tx.init(params), mesh)` gives the same
  # arrays, but builds the whole global state on every host first.
  state = kd.init_sharded(tx.init, params, mesh)
  specs = kd.partition_specs(state)

  def step(params, state, x, y):
    loss, grads, stats = grad_fn(params, x, y, opt_state=state)   # this device's batch
    if dist.gradient_reduction == "none":     # else update reduces the local gradients
      grads = jax.lax.pmean(grads, "data")
    batch = {"kfac_batch": (x, y)} if adaptive else {}       # the model's curvature
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **batch)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

  # Params and state are donated: each step updates them in place.
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs, P())), donate_argnums=(0, 1))

  # This process's rows of the global batch: the devices of a process hold
  # consecutive pieces of axis "data" (a real input pipeline would read only
  # these rows, e.g. with `jax.process_index()` as its shard number).
  data_sharding = NamedSharding(mesh, P("data"))
  rows = sorted({index[0].indices(batch_size)[:2] for index in
                 data_sharding.addressable_devices_indices_map((batch_size,)).values()})
  start, stop = rows[0][0], rows[-1][1]
  if sum(b - a for a, b in rows) != stop - start:
    raise ValueError(f"this process's devices hold non-contiguous rows {rows}")

  first = 0
  if resume is not None:
    template = {"params": params, "opt_state": state}
    restored = kd.restore_checkpoint(resume[0], template, mesh=mesh)
    params, state, first = restored["params"], restored["opt_state"], resume[1]
  losses = []
  for i in range(first, first + steps):
    x, y = global_batch(i, batch_size, seed)
    if i == nan_step:
      x[0] = np.nan
    x = jax.make_array_from_process_local_data(data_sharding, x[start:stop], x.shape)
    y = jax.make_array_from_process_local_data(data_sharding, y[start:stop], y.shape)
    params, state, loss = step(params, state, x, y)
    losses.append(float(to_host(loss)))
    if log is not None:
      log(f"step {i:3d}  loss {losses[-1]:.5f}")
  if checkpoint is not None:
    kd.save_checkpoint(checkpoint, {"params": params, "opt_state": state}, force=True)
  skipped = int(to_host(kd.find_states(state)[0].skipped))
  return params, losses, skipped


def to_host(tree):
  """Replicated global arrays → numpy, from this process's own copy (no
  communication; `multihost_utils.process_allgather` would do for sharded ones)."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)), tree)


def flatten(params, prefix: str = "") -> dict[str, np.ndarray]:
  """`{prefix + "a/b/kernel": array}` of a parameter pytree (host arrays)."""
  import jax  # pylint: disable=import-outside-toplevel
  flat = jax.tree_util.tree_flatten_with_path(to_host(params))[0]
  return {prefix + "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
          for path, v in flat}


# --------------------------------------------------------------------------- #
# Worker: one process of the job.
# --------------------------------------------------------------------------- #

def worker(args) -> None:
  """One process of the job: joins the others, trains, leaves."""
  import jax  # pylint: disable=import-outside-toplevel

  # CPU-to-CPU collectives across processes go through gloo (also jax's default
  # since 0.4.3x; GPUs use NCCL and TPUs ICI whatever this says).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeouts = dict(initialization_timeout=args.init_timeout,
                  heartbeat_timeout_seconds=args.init_timeout)
  if args.auto_detect:
    jax.distributed.initialize(**timeouts)
  else:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes,
                               process_id=args.process_id, **timeouts)
  try:
    run_worker(args)
  except BaseException:  # pylint: disable=broad-except
    # Report and leave at once: a graceful shutdown would wait for peers that
    # may be blocked in a collective with this process (the launcher, or the
    # cluster's, sees the exit code and stops the others).
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  jax.distributed.shutdown()


def run_worker(args) -> None:
  """Trains each strategy of `args` on the mesh of all processes' devices."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel

  me = jax.process_index()
  say = (lambda msg: print(f"[process {me}] {msg}", flush=True)) if me == 0 else None
  devices = jax.devices()             # every process's devices, same order everywhere
  mesh = Mesh(np.array(devices), ("data",))
  if say:
    say(f"{jax.process_count()} processes, {len(devices)} devices "
        f"({jax.local_device_count()} here, {devices[0].platform}), jax {jax.__version__}")
  results = {}
  if args.grad_worker_fraction is not None:
    runs = [(f"fraction-{args.grad_worker_fraction:g}", args.grad_worker_fraction)]
  else:
    runs = [(s, fraction_of(s, len(devices))) for s in args.strategy.split(",")]
  for strategy, fraction in runs:
    if say and fraction is None:
      say(f"K-FAC {strategy}: the strategy kd.Distribution.auto chooses")
    elif say:
      say(f"K-FAC {strategy}: grad_worker_fraction {fraction:g} "
          f"({round(fraction * len(devices))} gradient workers per layer)")
    t0 = time.perf_counter()
    checkpoint = (os.path.join(os.path.abspath(args.checkpoint_dir), strategy)
                  if args.checkpoint_dir else None)
    params, losses, skipped = train(
        mesh, fraction, steps=args.steps, batch_size=args.batch_size,
        factor_update_every=args.factor_update_every,
        inverse_update_every=args.inverse_update_every, learning_rate=args.learning_rate,
        damping=args.damping, seed=args.seed, log=say, nan_step=args.nan_step,
        checkpoint=checkpoint, adaptive=is_adaptive(strategy),
        memory_budget=args.memory_budget)
    if say:
      say(f"{strategy}: {args.steps} steps in {time.perf_counter() - t0:.1f}s "
          "(compilation included)")
    results.update(flatten(params, prefix=f"{strategy}/"))
    results[f"{strategy}/losses"] = np.asarray(losses)
    results[f"{strategy}/skipped"] = np.asarray(skipped)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"process{me}.npz"), **results)
    if me == 0:
      save_curves(args.out, {name: results[f"{name}/losses"] for name, _ in runs},
                  len(devices), jax.process_count())
      say(f"wrote {os.path.join(args.out, 'multihost.csv')} and "
          f"{os.path.join(args.out, 'multihost.png')}")


def save_curves(out: str, losses: dict[str, np.ndarray], num_devices: int,
                num_processes: int) -> None:
  """`multihost.csv` (strategy, step, loss) and `multihost.png` (loss per step)."""
  import csv  # pylint: disable=import-outside-toplevel
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  with open(os.path.join(out, "multihost.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["strategy", "step", "loss"])
    for name, curve in losses.items():
      writer.writerows([name, i, f"{loss:.6f}"] for i, loss in enumerate(curve))
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for i, (name, curve) in enumerate(losses.items()):
    ax.plot(curve, label=name, lw=2.5 - 1.2 * (i > 0), ls=("-", "--", ":", "-.")[i % 4])
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (global batch)")
  ax.set_title(f"K-FAC over {num_processes} processes x "
               f"{num_devices // num_processes} devices")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "multihost.png"), dpi=120)
  plt.close(fig)


# --------------------------------------------------------------------------- #
# Local launcher: N processes on this machine, CPU devices.
# --------------------------------------------------------------------------- #

def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cpu_env(cpu_devices: int, xla_flags: Sequence[str] = (), base: dict | None = None) -> dict:
  """Environment of a local CPU worker: `cpu_devices` host devices (replacing
  any device count already in XLA_FLAGS), extra `xla_flags`, the CPU platform
  only, one BLAS thread."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(
      flags + list(xla_flags) + [f"--xla_force_host_platform_device_count={cpu_devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  # Several processes of several virtual devices share few cores: one BLAS
  # thread each (jax's CPU eigh calls OpenBLAS, whose threads otherwise stall).
  env.setdefault("OPENBLAS_NUM_THREADS", "1")
  return env


class LocalJob:
  """`num_processes` workers of this script on 127.0.0.1, started at once.

  Every worker gets `worker_args` plus its `--process-id`, `--num-processes`
  and a common `--coordinator` (a free local port), and `cpu_devices` host
  CPU devices (and the extra `xla_flags`). Process 0 prints to this
  process's stdout (unless `capture`); the output of the others (of all, with
  `capture`) goes to temporary files, shown when a worker fails and returned
  by `wait`.
  """

  def __init__(self, worker_args: Sequence[str], num_processes: int, cpu_devices: int,
               capture: bool = False, xla_flags: Sequence[str] = ()):
    coordinator = f"127.0.0.1:{free_port()}"
    env = cpu_env(cpu_devices, xla_flags)
    self.procs, self.logs = [], []
    try:
      for i in range(num_processes):
        cmd = [sys.executable, os.path.abspath(__file__), *worker_args,
               "--process-id", str(i), "--num-processes", str(num_processes),
               "--coordinator", coordinator]
        out = tempfile.TemporaryFile(mode="w+") if (capture or i > 0) else None
        self.logs.append(out)
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                           stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL))
    except BaseException:
      self.kill()
      raise

  def kill(self) -> None:
    """Kills the workers still running (only these children, by handle)."""
    for p in self.procs:
      if p.poll() is None:
        p.kill()
    for p in self.procs:
      p.wait()

  def outputs(self) -> list[str]:
    texts = []
    for log in self.logs:
      if log is None:
        texts.append("(printed above)\n")
      else:
        log.seek(0)
        texts.append(log.read())
    return texts

  def wait(self, timeout: float) -> list[str]:
    """Waits for every worker; if one fails or `timeout` seconds pass, kills
    the others and raises RuntimeError with the workers' output tails.
    Returns the workers' outputs (process 0's is "(printed above)" without
    `capture`)."""
    deadline = time.monotonic() + timeout
    failed = None
    try:
      while failed is None and any(p.poll() is None for p in self.procs):
        bad = [i for i, p in enumerate(self.procs) if p.returncode not in (None, 0)]
        if bad:
          failed = f"process {bad[0]} exited with code {self.procs[bad[0]].returncode}"
        elif time.monotonic() > deadline:
          failed = f"timed out after {timeout:.0f}s"
        else:
          time.sleep(0.05)
      bad = [i for i, p in enumerate(self.procs) if p.returncode not in (None, 0)]
      if failed is None and bad:
        failed = f"process {bad[0]} exited with code {self.procs[bad[0]].returncode}"
    finally:
      self.kill()
    texts = self.outputs()
    for log in self.logs:
      if log is not None:
        log.close()
    if failed:
      detail = "".join(f"\n--- process {i} ---\n{t[-3000:]}" for i, t in enumerate(texts))
      raise RuntimeError(f"multi-process run failed: {failed}{detail}")
    return texts


def launch_local(worker_args: Sequence[str], num_processes: int, cpu_devices: int,
                 timeout: float = 600.0, capture: bool = False) -> list[str]:
  """Runs a `LocalJob` to completion (see there)."""
  return LocalJob(worker_args, num_processes, cpu_devices, capture).wait(timeout)


# --------------------------------------------------------------------------- #

WORKER_OPTIONS = ("strategy", "grad_worker_fraction", "steps", "batch_size", "learning_rate",
                  "damping", "factor_update_every", "inverse_update_every", "seed", "out",
                  "nan_step", "checkpoint_dir", "memory_budget")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description="Distributed K-FAC over several processes with jax.distributed. "
                  "Without --process-id (or --auto-detect) it launches --num-processes "
                  "local CPU workers itself; on a cluster run it once per host with "
                  "--process-id, --num-processes and --coordinator.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  job = parser.add_argument_group("job")
  job.add_argument("--num-processes", type=int, default=2, help="processes (hosts) in the job")
  job.add_argument("--process-id", type=int, default=None,
                   help="this process's id, 0 .. N-1; omitted: launch N local CPU processes")
  job.add_argument("--coordinator", default=None,
                   help="host:port of process 0's coordinator service (the local "
                        "launcher picks 127.0.0.1 and a free port)")
  job.add_argument("--auto-detect", action="store_true",
                   help="let jax.distributed.initialize() detect the cluster "
                        "(SLURM, Open MPI, Cloud TPU)")
  job.add_argument("--cpu-devices", type=int, default=2,
                   help="host CPU devices per local process (launcher only)")
  job.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before the local launcher kills its workers")
  job.add_argument("--init-timeout", type=int, default=120,
                   help="seconds a worker waits for the others to join, and for a "
                        "silent peer before it gives up")
  opt = parser.add_argument_group("training")
  opt.add_argument("--strategy", default="hybrid",
                   help=f"one of {', '.join(STRATEGIES)}, optionally with the suffix "
                        f"{ADAPTIVE} (adaptive K-FAC); comma-separate several to train "
                        "each in turn")
  opt.add_argument("--grad-worker-fraction", type=float, default=None,
                   help="instead of --strategy: gradient workers per layer / devices "
                        "(results are labelled fraction-F)")
  opt.add_argument("--memory-budget", type=float, default=None,
                   help="with --strategy auto: the K-FAC state's bytes per device at most")
  opt.add_argument("--steps", type=int, default=30, help="training steps")
  opt.add_argument("--batch-size", type=int, default=64, help="global batch size")
  opt.add_argument("--learning-rate", type=float, default=0.1,
                   help="η of SGD with momentum 0.9 after K-FAC (and of the KL clip)")
  opt.add_argument("--damping", type=float, default=1e-2, help="K-FAC damping γ")
  opt.add_argument("--factor-update-every", type=int, default=2,
                   help="refresh the Kronecker factors every this many steps")
  opt.add_argument("--inverse-update-every", type=int, default=6,
                   help="refresh the eigendecompositions every this many steps")
  opt.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
  opt.add_argument("--nan-step", type=int, default=None,
                   help="make the first example of this step NaN (on process 0 only): "
                        "the step is skipped on every process")
  opt.add_argument("--checkpoint-dir", default=None,
                   help="save each strategy's final parameters and optimizer state "
                        "under DIR/<strategy> (every process writes its pieces)")
  opt.add_argument("--out", default="examples/out",
                   help="directory for multihost.csv / multihost.png (process 0) and the "
                        "final parameters, process{i}.npz ('': write nothing)")
  args = parser.parse_args(argv)
  for strategy in args.strategy.split(","):
    if strategy.removesuffix(ADAPTIVE) not in STRATEGIES:
      parser.error(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}, "
                   f"each optionally with the suffix {ADAPTIVE}")
  if args.process_id is not None and args.coordinator is None:
    parser.error("--process-id needs --coordinator host:port")
  if args.steps < 1:
    parser.error(f"--steps {args.steps}: at least 1")
  if args.memory_budget is not None and "auto" not in args.strategy:
    parser.error("--memory-budget applies to --strategy auto only")
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.process_id is not None or args.auto_detect:
    worker(args)
    return
  forwarded = ["--init-timeout", str(args.init_timeout)]
  for name in WORKER_OPTIONS:
    value = getattr(args, name)
    if value is not None:
      forwarded += ["--" + name.replace("_", "-"), str(value)]
  print(f"launching {args.num_processes} local processes x {args.cpu_devices} CPU devices",
        flush=True)
  try:
    launch_local(forwarded, args.num_processes, args.cpu_devices, timeout=args.timeout)
  except RuntimeError as e:
    sys.exit(str(e))


if __name__ == "__main__":
  main()
