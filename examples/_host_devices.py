"""Process setup shared by the examples, run before jax is imported.

`request_from_argv()` reads `--devices N` from the command line and asks XLA
for N host CPU devices (harmless with accelerators: it only adds CPU devices),
and sets `OPENBLAS_NUM_THREADS=1`: jax's CPU eigh calls OpenBLAS's LAPACK,
whose worker threads fight XLA's pool (an explicit setting wins).
"""

import os
import sys


def devices_from_argv(argv) -> int:
  """`--devices N` / `--devices=N` of the command line (1 if absent or bad:
  argparse reports the bad value)."""
  for i, arg in enumerate(argv):
    try:
      if arg == "--devices" and i + 1 < len(argv):
        return int(argv[i + 1])
      if arg.startswith("--devices="):
        return int(arg.split("=", 1)[1])
    except ValueError:
      return 1
  return 1


def request_from_argv() -> int:
  n = devices_from_argv(sys.argv[1:])
  if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={n}").strip()
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
  return n
