"""A real multi-process run: 2 processes × 2 CPU devices equal 1 process × 4.

The workers are `examples/multihost.py` (the example doubles as the launcher's
documentation): each calls `jax.distributed.initialize` on 127.0.0.1 with gloo
CPU collectives, builds the mesh "data" over the 4 devices of both processes,
feeds only its half of every global batch, trains MEM-OPT (fraction 1/4),
COMM-OPT (fraction 1), HYBRID (fraction 1/2) and adaptive K-FAC under HYBRID
(learning rate, momentum and damping adapted every step) for 4 steps — counts 0..3 with
factor_update_every=2, inverse_update_every=3: factors and inverses at 0, plain
at 1, factors only at 2, inverses only at 3 — and writes its final parameters
to an .npz. Step 1's batch has a NaN in a row of process 0 only: both
processes must skip it. Each strategy's final state is checkpointed by both
processes. Meanwhile this process computes the same `train` on 4 of its own 8
devices (tests/conftest.py), and the results must agree to float32 tolerance;
then it restores the two-process MEM-OPT checkpoint and continues one step.

Marked slow (outside the README's selection: three processes of compiles,
about 20 s on a fast day): .ci/run runs this file with `--slow` on the newest
and the oldest jax.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kfac_multihost_example",
                                               ROOT / "examples" / "multihost.py")
multihost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multihost)

NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 2
NUM_DEVICES = NUM_PROCESSES * DEVICES_PER_PROCESS
STRATEGIES = ("mem-opt", "comm-opt", "hybrid", "hybrid+adaptive", "auto")
CONFIG = dict(steps=4, batch_size=32, factor_update_every=2, inverse_update_every=3,
              learning_rate=0.1, damping=1e-2, seed=0, nan_step=1)
TIMEOUT_S = 100          # the workers, from launch to exit (killed after that)

pytestmark = pytest.mark.slow


def _gloo_missing() -> str | None:
  """Why gloo CPU collectives are unavailable in this jaxlib, or None."""
  try:
    jax.config.jax_cpu_collectives_implementation  # pylint: disable=pointless-statement
  except AttributeError:
    return "this jax has no jax_cpu_collectives_implementation option"
  try:
    from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None                     # can't tell from here: let the run decide
  if not hasattr(_jax, "make_gloo_tcp_collectives"):
    return "this jaxlib was built without gloo CPU collectives"
  return None


def _worker_args(out: pathlib.Path) -> list[str]:
  args = ["--strategy", ",".join(STRATEGIES), "--out", str(out), "--init-timeout", "60",
          "--checkpoint-dir", str(out / "ckpt")]
  for key, value in CONFIG.items():
    args += ["--" + key.replace("_", "-"), str(value)]
  return args


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(reference, per-process results, process 0's output), each result a dict
  `{"strategy/param/path": array, "strategy/losses": array}`."""
  reason = _gloo_missing()
  if reason:
    pytest.skip(reason)
  mesh = helpers.data_mesh(NUM_DEVICES)   # the single-process reference's
  out = tmp_path_factory.mktemp("multihost")
  start = time.monotonic()
  # The workers inherit this process's XLA_FLAGS (conftest's compile settings,
  # or the caller's), so they compile as the single-process reference does.
  job = multihost.LocalJob(_worker_args(out), NUM_PROCESSES, DEVICES_PER_PROCESS,
                           capture=True)
  try:
    reference = {}
    for strategy in STRATEGIES:
      params, losses, skipped = multihost.train(
          mesh, multihost.fraction_of(strategy, NUM_DEVICES), **CONFIG,
          adaptive=multihost.is_adaptive(strategy))
      reference.update(multihost.flatten(params, prefix=f"{strategy}/"))
      reference[f"{strategy}/losses"] = np.asarray(losses)
      reference[f"{strategy}/skipped"] = np.asarray(skipped)
  except BaseException:
    job.kill()
    raise
  outputs = job.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
  results = []
  for i in range(NUM_PROCESSES):
    with np.load(out / f"process{i}.npz") as f:
      results.append(dict(f))
  return reference, results, outputs[0], out


def test_workers_are_two_processes_of_two_devices(runs):
  _, _, output, _ = runs
  assert (f"{NUM_PROCESSES} processes, {NUM_DEVICES} devices ({DEVICES_PER_PROCESS} here, "
          "cpu)") in output, output


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_multiprocess_equals_single_process(runs, strategy):
  reference, results, _, _ = runs
  want = {k: v for k, v in reference.items() if k.startswith(strategy + "/")}
  assert len(want) > 1
  losses = want[f"{strategy}/losses"]
  assert losses.shape == (CONFIG["steps"],)
  assert np.isnan(losses[CONFIG["nan_step"]])         # the faulty batch's loss
  losses = np.delete(losses, CONFIG["nan_step"])
  assert np.all(np.isfinite(losses)) and int(want[f"{strategy}/skipped"]) == 1
  assert not np.allclose(losses, losses[0])          # it trained
  for process, got in enumerate(results):
    got = {k: v for k, v in got.items() if k.startswith(strategy + "/")}
    assert sorted(got) == sorted(want), f"process {process}"
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=2e-5,
                                 err_msg=f"process {process}: {key}")


def test_checkpoint_of_two_processes_continues_on_one(runs):
  """The MEM-OPT state both processes saved restores onto this process's mesh
  of the same 4 devices and continues: one more step equals the
  single-process run of 5 steps."""
  reference, _, _, out = runs
  mesh = helpers.data_mesh(NUM_DEVICES)
  fraction = multihost.fraction_of("mem-opt", NUM_DEVICES)
  options = {k: v for k, v in CONFIG.items() if k != "steps"}
  params, _, skipped = multihost.train(mesh, fraction, steps=1, **options,
                                       resume=(str(out / "ckpt" / "mem-opt"),
                                               CONFIG["steps"]))
  want, _, want_skipped = multihost.train(mesh, fraction, steps=CONFIG["steps"] + 1,
                                          **options)
  assert skipped == want_skipped == 1
  got, want = multihost.flatten(params), multihost.flatten(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=2e-5, err_msg=key)


_RESTORE_WORKER = """
import sys
import jax
import numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=int(sys.argv[1]),
                           initialization_timeout=60)
import jax.numpy as jnp
import kfac_jax_dist as kd
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
replicated = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), P())
params = {"w": jnp.arange(6.0).reshape(3, 2)}
layers = kd.LayerRegistry((kd.TaggedLayer(name="l", kind="dense", kernel_path="w",
                                          bias_path=None, kernel_shape=(3, 2),
                                          a_dim=3, g_dim=2),))
tx = kd.kfac(0.1, layers=layers)
tree = jax.device_put({"params": params, "opt_state": tx.init(params)}, replicated)
kd.save_checkpoint(sys.argv[3], tree, force=True)
template = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
restored = kd.restore_checkpoint(sys.argv[3], template)          # no mesh=
w = restored["params"]["w"]
print("restored", float(np.asarray(w.addressable_data(0)).sum()),
      len(w.sharding.device_set), flush=True)
"""


def test_restore_without_a_mesh_on_two_processes(tmp_path):
  """`kd.restore_checkpoint(directory, jax.eval_shape(...))` (api.md's form,
  no `mesh=`) with two processes: the leaves without a sharding are restored
  replicated on every device, so each process holds them (process 1 failed
  inside orbax and process 0 then hung: the default was process 0's first
  device)."""
  reason = _gloo_missing()
  if reason:
    pytest.skip(reason)
  coordinator = f"127.0.0.1:{multihost.free_port()}"
  env = multihost.cpu_env(DEVICES_PER_PROCESS)
  env["PYTHONPATH"] = str(ROOT)
  procs = [subprocess.Popen([sys.executable, "-c", _RESTORE_WORKER, str(i), coordinator,
                             str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, output[-3000:]
    assert f"restored 15.0 {NUM_DEVICES}" in output, output[-3000:]
