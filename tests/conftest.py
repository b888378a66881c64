"""Eight host CPU devices for the distributed tests (set before jax starts).

Single-threaded OpenBLAS: jax's CPU eigh calls it, and its worker threads on a
2-core machine running 8 virtual devices stall for seconds at a time.

pytest-xdist's `-n auto` (pyproject.toml) runs one worker per core, at most 4:
each worker is a jax process with 8 virtual devices, and the tests are
compile-bound, so more workers than cores only add memory.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config):
  del config
  return max(1, min(os.cpu_count() or 1, 4))
