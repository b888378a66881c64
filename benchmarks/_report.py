"""The benchmarks' report writer: the environment header, markdown tables,
byte counts, the checks table, and the .md + .json pair every script writes.

Light on purpose: nothing heavier than the standard library at import time
(`environment` imports jax, optax and kfac_jax_dist when called), so that
`benchmarks/report.py` and the tests can use it without starting jax.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import subprocess
from typing import Any, Sequence

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ------------------------------------------------------------------ environment

def host_devices(n: int) -> None:
  """Asks XLA for `n` host CPU devices (appended to XLA_FLAGS, unless they
  already set a count, and OPENBLAS_NUM_THREADS 1 unless set). Call before
  jax starts."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# glibc's mallopt parameters (malloc.h), and the thresholds tried: 1 GiB, else
# 32 MiB (older glibc refuses an mmap threshold over 32 MiB, its documented maximum).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEADY_THRESHOLDS = (1 << 30, 32 << 20)
DEFAULT_ALLOCATOR_ENV = "BENCH_DEFAULT_MALLOC"   # set to 1: leave glibc's defaults
_allocator = "not set (call steady_host_allocator)"


def steady_host_allocator() -> str:
  """Fixes glibc malloc's mmap and trim thresholds (at 1 GiB where glibc allows),
  so that memory freed by one jitted step stays in the heap for the next
  (PERF_NOTES §43).

  By default glibc maps every block above a *dynamic* threshold (128 KiB,
  raised to the size of each mapped block freed, up to 32 MiB) with a fresh
  `mmap`, unmaps it on free, and the next step faults its pages in again.
  XLA:CPU allocates a step's temporaries per execution, so whether a step
  pays those faults depends on the heap's history: the MLP's donated EK-FAC
  step faulted ~7,000 pages per step (+13 ms system time), its undonated
  one ~800, and in another process the other way round. Fixed thresholds end
  the faults after warm-up for every method, so a timing measures the
  program. No-op (and says why) off glibc or with BENCH_DEFAULT_MALLOC=1.
  Returns the setting, which `environment()` records."""
  global _allocator
  if os.environ.get(DEFAULT_ALLOCATOR_ENV) == "1":
    _allocator = f"glibc defaults ({DEFAULT_ALLOCATOR_ENV}=1)"
    return _allocator
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    _allocator = "the platform's (no glibc mallopt)"
    return _allocator
  for threshold in STEADY_THRESHOLDS:
    if mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, threshold) == 1:
      _allocator = f"glibc, mmap and trim thresholds fixed at {threshold >> 20} MiB"
      return _allocator
  _allocator = "glibc defaults (mallopt refused the fixed thresholds)"
  return _allocator


def env_with_xla_flags(*flags: str) -> dict[str, str]:
  """This process's environment with `flags` appended to XLA_FLAGS, for a
  child process (XLA reads its flags once, when its backend starts)."""
  return {**os.environ,
          "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()}


def _git(cwd: str, *args: str) -> str:
  try:
    return subprocess.run(["git", *args], capture_output=True, text=True,
                          cwd=cwd).stdout.strip()
  except OSError:
    return ""


def library_commit() -> str:
  """The short commit of the imported kfac_jax_dist, "+local changes" if its
  tracked files differ from it."""
  import kfac_jax_dist as kd  # pylint: disable=import-outside-toplevel
  where = os.path.dirname(os.path.abspath(kd.__file__))
  commit = _git(where, "rev-parse", "--short", "HEAD")
  if commit and _git(where, "status", "--porcelain", "--untracked-files=no", "."):
    commit += "+local changes"
  return commit


def cpu_name() -> str:
  """The CPU's model name (/proc/cpuinfo), else `platform.processor()`."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def _checkout_revision() -> str:
  """The benchmarks' checkout at HEAD, flagged when kfac_jax_dist/ is modified."""
  here = os.path.dirname(os.path.abspath(__file__))
  rev = _git(here, "rev-parse", "--short", "HEAD") or "?"
  dirty = _git(os.path.join(here, ".."), "status", "--porcelain", "kfac_jax_dist")
  return rev + (" (kfac_jax_dist modified)" if dirty else "")


THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                    "XLA_FLAGS")


def environment() -> dict[str, Any]:
  """What a result was measured with: date, versions, revision, machine."""
  # pylint: disable=import-outside-toplevel
  import jax
  import optax

  import kfac_jax_dist as kd
  return {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", ""),
      "optax": optax.__version__, "python": platform.python_version(),
      "backend": jax.default_backend(), "devices": str(jax.devices()),
      "git": _checkout_revision(), "commit": library_commit(),
      "library": os.path.dirname(os.path.abspath(kd.__file__)),
      "cpu": cpu_name(), "cpu_count": os.cpu_count(),
      "machine": f"{platform.machine()}, {os.cpu_count()} cores",
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "threads_env": {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
      "host_allocator": _allocator,
  }


def header_md(h: dict[str, Any]) -> str:
  """The one-line environment header of a results file."""
  machine = f"{h['cpu']}, {h['machine']}" if h.get("cpu") else h["machine"]
  return (f"- date {h['date']}; jax {h['jax']} ({h['backend']}); kfac_jax_dist at git "
          f"{h['git']}; {machine}; XLA_FLAGS=`{h['xla_flags']}`")


# ---------------------------------------------------------------------- tables

def md_table(rows: Sequence[Sequence[Any]], head: Sequence[str]) -> str:
  """A markdown table: one header row, then one line per row."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


def fmt_bytes(b: float) -> str:
  """Bytes in decimal units with three significant digits ("4.95 MB")."""
  if b == 0:
    return "0"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(b) >= scale:
      return f"{b / scale:.3g} {unit}"
  return f"{b:.0f} B"


def checks_markdown(title: str, checks: list[dict[str, Any]]) -> list[str]:
  """The targets table shared by the benchmarks: check, measured, target, holds, why."""
  if not checks:
    return []
  rows = [[c["check"], c["value"], c["target"], "yes" if c["holds"] else "**no**",
           c["why"]] for c in checks]
  return [f"## {title}", "", md_table(rows, ["check", "measured", "target", "holds", "why"]),
          ""]


# --------------------------------------------------------------------- writing

def stem(name: str, quick: bool) -> str:
  """The results' file stem: quick runs never overwrite the committed results."""
  return name + "_quick" if quick else name


def write_json(path: str, payload: dict[str, Any]) -> None:
  """`payload` as indented JSON (anything else, e.g. numpy scalars, as str)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=str)


def write_results(out_dir: str, name: str, text: str, payload: dict[str, Any]) -> None:
  """Writes `<name>.md` (the printed report) and `<name>.json` (raw numbers)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, name + ".md"), "w") as f:
    f.write(text + "\n")
  write_json(os.path.join(out_dir, name + ".json"), payload)


# -------------------------------------------------------------------- arguments

def argument_parser(doc: str) -> argparse.ArgumentParser:
  """argparse with the script's docstring (first paragraph as description) and
  --out, the results folder (default benchmarks/results)."""
  ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog=doc.split("\n\n", 1)[1])
  ap.add_argument("--out", default=RESULTS, help="folder for the .md / .json results")
  return ap


def add_quick(ap: argparse.ArgumentParser, name: str, quick: dict[str, Any]) -> None:
  """--quick: a smoke run with `quick`'s settings (for the options not given)
  that writes `<name>_quick.*`."""
  settings = ", ".join(f"{k}={v}" for k, v in quick.items())
  ap.add_argument("--quick", action="store_true",
                  help=f"a smoke run ({settings} unless given); writes {name}_quick.*")


def fill_defaults(args: argparse.Namespace, quick: dict[str, Any],
                  full: dict[str, Any]) -> None:
  """Sets the options left None from `quick` with --quick, else from `full`."""
  for k, v in (quick if args.quick else full).items():
    if getattr(args, k) is None:
      setattr(args, k, v)
