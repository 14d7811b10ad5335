"""Shared test setup: GPU tests skip cleanly without a GPU; tests marked ``slow`` run only with
``--run-slow``; hypothesis profile for CI; fast XLA compiles (-O0 and the classic fusion emitters
on CPU-only machines, no autotuning on a GPU); no GPU memory preallocation in xdist workers;
jax's caches cleared before a worker runs out of memory maps; a test whose xdist worker crashes
runs once more."""
import gc
import os
import shutil
import subprocess
import sys


def _no_nvidia_gpu():
  return shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl")


# CPU CI is compile-bound (interpret-mode kernels, eager ops, many small jits): XLA's LLVM backend
# at -O0 compiles ~35% faster, and XLA:CPU's classic fusion emitters
# (--xla_cpu_use_fusion_emitters=false) cut the rest by ~40% (interpret-mode kernels are large
# programs of many small fusions). The HLO passes and every test tolerance are unchanged (no
# fast-math either way; the last bit may round differently where the LLVM backend would contract
# to FMA). Only without an NVIDIA GPU, so GPU timings are untouched, and the emitter flag only
# where this jaxlib accepts it (an unknown XLA flag aborts the process: a subprocess asks first;
# xdist workers inherit the answer through XLA_FLAGS). JATTN_TEST_XLA_OPT=1 keeps XLA's defaults.
# Must run before jax's backend starts (conftest is imported before any test module).
# On a GPU the tests' XLA programs (the fp32 references, the glue around the kernels) skip XLA's
# GEMM/fusion autotuning: it times candidates on the GPU in every xdist worker at once, while the
# tests check numerics only (the Pallas kernels and cuDNN are custom calls it never tunes).
_CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag):
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, timeout=300).returncode == 0


_flags = os.environ.get("XLA_FLAGS", "")
if os.environ.get("JATTN_TEST_XLA_OPT") != "1":
  if _no_nvidia_gpu() and "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
    if _xla_accepts(_CLASSIC_EMITTERS):
      _flags += " " + _CLASSIC_EMITTERS
  elif not _no_nvidia_gpu() and "xla_gpu_autotune_level" not in _flags:
    _flags += " --xla_gpu_autotune_level=0"
  os.environ["XLA_FLAGS"] = _flags.strip()

# xdist workers share the GPU: none may take jax's default 75% of its memory up front.
if not _no_nvidia_gpu() and "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest

try:
  from hypothesis import settings
  settings.register_profile("ci", max_examples=int(os.environ.get("JATTN_HYPOTHESIS_EXAMPLES", 25)),
                            deadline=None)
  settings.load_profile("ci")
except ImportError:  # pragma: no cover
  pass


def _has_gpu():
  try:
    return len(jax.devices("gpu")) > 0
  except RuntimeError:
    return False


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
  skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
  skip_gpu = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on a GPU machine)")
  run_slow, has_gpu = config.getoption("--run-slow"), _has_gpu()
  # The heavy tests first: xdist hands the first items out round-robin, so no worker is left
  # running a long test alone at the end.
  items.sort(key=lambda item: "heavy" not in item.keywords)
  for item in items:
    if "slow" in item.keywords and not run_slow:
      item.add_marker(skip_slow)
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip_gpu)


# An xdist worker that compiles many thousands of executables (interpret-mode kernels are large
# programs, and every shape and option is a new one) holds one memory map or more per executable
# and can reach the kernel's limit (vm.max_map_count, 65530 by default); XLA:CPU's compiler then
# segfaults in ``backend_compile_and_load`` instead of raising, late in the suite.
# ``_bound_memory_maps`` below clears jax's caches when a worker passes a third of the limit. The
# rerun stays as a guard: a test whose worker dies anyway runs once more on a fresh worker; a
# second crash, like any failure of a test, fails the run. Test failures are never rerun.
_CRASH_RERUNS: set = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  if crashitem in _CRASH_RERUNS:
    return
  _CRASH_RERUNS.add(crashitem)
  sys.stderr.write(f"\n[conftest] the worker running {crashitem} crashed ({report.longrepr}); "
                   f"running it once more on a fresh worker\n")
  sched.mark_test_pending(crashitem)
  report.outcome = "rerun"


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
  if report.outcome == "rerun":
    return "rerun", "R", "RERUN"


def _memory_map_limit():
  try:
    with open("/proc/sys/vm/max_map_count") as fh:
      return int(fh.read())
  except (OSError, ValueError):   # not Linux: no such limit to watch
    return None


_MAP_LIMIT = _memory_map_limit()


def _memory_maps():
  with open("/proc/self/maps", "rb") as fh:
    return sum(1 for _ in fh)


@pytest.fixture(autouse=True)
def _bound_memory_maps():
  """After each test: when this process holds more than a third of ``vm.max_map_count`` memory
  maps, drop jax's compiled executables (``jax.clear_caches`` + a GC pass) so that the maps
  they hold are unmapped; later tests recompile what they need."""
  yield
  if _MAP_LIMIT and _memory_maps() > _MAP_LIMIT // 3:
    jax.clear_caches()
    gc.collect()
