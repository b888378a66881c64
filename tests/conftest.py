"""Eight host CPU devices for the distributed tests (set before jax starts).

Single-threaded OpenBLAS: jax's CPU eigh calls it, and its worker threads on a
2-core machine running 8 virtual devices stall for seconds at a time.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
