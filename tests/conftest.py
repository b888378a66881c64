"""Eight host CPU devices for the distributed tests (set before jax starts).

Single-threaded OpenBLAS: jax's CPU eigh calls it, and its worker threads on a
2-core machine running 8 virtual devices stall for seconds at a time.

The tests are compile-bound, and two XLA:CPU settings cut the compile time
without changing what is computed (the results differ by float rounding only):
no LLVM optimisation (`--xla_backend_optimization_level=0`, about a third
faster), and XLA's older elemental fusion emitters instead of its MLIR ones
(`--xla_cpu_use_fusion_emitters=false`: the distributed steps' XLA compile
takes about 0.55x the time, on jax 0.8 to 0.10; jaxlib 0.11 has no such
flag). Each is the default here unless XLA_FLAGS names it; .ci/run reruns
the single-device oracles at XLA's own defaults. On jaxlib < 0.10 the
concurrency-optimised scheduler is off too (a collective's rendezvous
aborted, below).

Tests marked `slow` run only with `--slow`: more strategies, layer kinds and
meshes of cases that the default selection has, the longer end-to-end checks
(examples, notebooks, docs/api.md's code) and the two-process tests
(test_multihost.py, which .ci/run runs on the newest and the oldest jax).
`pytest -q` is the README's and CI's command, `pytest -q --slow` the whole
suite (over twice as long); .ci/run also runs one slow case of each kind on
the oldest jax.

Tests jit the steps they check (single-device references and oracle steps
too): run eagerly, every operation of a K-FAC step is compiled on its own, and
a grouped convolution's first eager step took 20 s against 3 s jitted. Only
the tests about eager mode (`jit_equals_eager`, statistics omitted outside
jit) run steps eagerly.

pytest-xdist's `-n auto` (pyproject.toml) runs one worker per core, at most 4:
each worker is a jax process with 8 virtual devices, and the tests are
compile-bound, so more workers than cores only add memory.
"""

import importlib.metadata
import os


def _jaxlib_version() -> tuple[int, ...]:
  release = importlib.metadata.version("jaxlib").split(".")[:3]
  return tuple(int(part) for part in release if part.isdigit())


_FLAGS = [("--xla_force_host_platform_device_count=8",
           "xla_force_host_platform_device_count"),
          ("--xla_backend_optimization_level=0",
           "xla_backend_optimization_level")]
# XLA aborts the process on a flag it does not know, and jaxlib 0.11 no longer
# knows this one (seen on the GPU machine's jaxlib 0.11.2: every test worker
# died at start-up).
if _jaxlib_version() < (0, 11):
  _FLAGS.append(("--xla_cpu_use_fusion_emitters=false",
                 "xla_cpu_use_fusion_emitters"))
# jaxlib 0.8's XLA:CPU aborted the 3-D mesh's pipeline steps (test_mesh3d's
# GPipe cases) in about a quarter of the runs: an AllReduce's rendezvous of
# the 8 host devices never completed (`AwaitAndLogIfStuck`, SIGABRT). With its
# concurrency-optimised scheduler off, 0 of 42 runs did; jaxlib 0.10.2, 0 of 8
# without the flag.
if _jaxlib_version() < (0, 10):
  _FLAGS.append(("--xla_cpu_enable_concurrency_optimized_scheduler=false",
                 "xla_cpu_enable_concurrency_optimized_scheduler"))
for _flag, _name in _FLAGS:
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config):
  del config
  return max(1, min(os.cpu_count() or 1, 4))


import pytest  # noqa: E402  (after the XLA flags)


def pytest_addoption(parser):
  parser.addoption("--slow", action="store_true",
                   help="also run the tests marked slow (the whole suite)")


def pytest_collection_modifyitems(config, items):
  """Deselects the slow tests unless `--slow` is given or `-m` names them."""
  if config.getoption("--slow") or "slow" in (config.option.markexpr or ""):
    return
  slow = [item for item in items if item.get_closest_marker("slow")]
  if slow:
    config.hook.pytest_deselected(items=slow)
    items[:] = [item for item in items if not item.get_closest_marker("slow")]


def _float64():
  """Turns jax_enable_x64 on until the generator resumes, then restores it."""
  import jax  # pylint: disable=import-outside-toplevel
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


@pytest.fixture(scope="module")
def x64_module():
  """float64 for a whole test module (`pytestmark = pytest.mark.usefixtures(
  "x64_module")`), restored afterwards."""
  yield from _float64()


@pytest.fixture
def x64():
  """float64 for one test, restored afterwards."""
  yield from _float64()
