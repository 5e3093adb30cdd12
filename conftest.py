"""Session setup for the tests and the docstring examples (loaded before anything else).

* ``FAST_COMPILE_FLAGS``: the suite is dominated by XLA compile time of small
  programs; the lowest CPU backend optimisation level, no expensive LLVM passes and
  the classic emitters cut it to about a third and change no result beyond float
  rounding (tests compare with tolerances).
* A persistent compilation cache shared by all tests and the CLI/notebook
  subprocesses they start (they compile the same tiny-model programs), every program
  in it however quick its compile (an eager op's 0.1 s, paid again in each subprocess,
  adds up).

  Both are environment variables, so subprocesses inherit them. Set
  ``JAXRL_LLM_TEST_FAST=0`` to test with the default XLA pipeline and no cache.
* The default test command (``--doctest-modules``, see ``pyproject.toml``) runs every
  ``Examples:`` block of ``jaxrl_llm/``. A module that needs an optional dependency at
  import time (matplotlib, transformers, torch, ...) is reported as skipped, not as a
  collection error, when that dependency is missing, so the suite runs on the core
  install too; so is a module whose examples need a package listed in its
  ``__doctest_requires__`` (one imported lazily, e.g. reasoning-gym). Any other
  import error stays a failure.

The hypothesis profile is in ``tests/conftest.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import tempfile

# XLA CPU compile time of the GRPO-PPO train step of the tiny model (2 cores): 10.8 s by
# default, 6.7 s at backend optimisation level 0, 3.9 s with the two flags after it as
# well. The whole suite from a cold cache: 16 min 34 s with the first flag only and a
# 0.5 s cache threshold, 9 min 28 s with all three and no threshold.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true",
                      "--xla_cpu_use_fusion_emitters=false")

if os.environ.get("JAXRL_LLM_TEST_FAST", "1") == "1":
  _flags = os.environ.get("XLA_FLAGS", "")
  for _flag in FAST_COMPILE_FLAGS:
    if _flag.split("=")[0] not in _flags:
      _flags += " " + _flag
  os.environ["XLA_FLAGS"] = _flags.strip()
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(tempfile.gettempdir(), "jaxrl_llm_xla_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Test worker processes (pytest-xdist) and subprocesses share one GPU: allocate on demand.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the environment is set)
import pytest  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" in os.environ:
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))



def _has_tpu() -> bool:
  """A local TPU (``/dev/accel*`` on v2-v4, ``/dev/vfio/<n>`` on v5e and later)."""
  import glob
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Runs in one process on a TPU host: only one process at a time may open a TPU."""
  if getattr(config.option, "numprocesses", None) and _has_tpu() and \
      os.environ.get("JAX_PLATFORMS", "") in ("", "tpu"):
    config.option.numprocesses = 0
    config.option.dist = "no"


OPTIONAL_DEPENDENCIES = frozenset({
    "matplotlib", "transformers", "torch", "safetensors", "tokenizers", "jinja2",
    "huggingface_hub", "rlax", "nbformat", "nbclient"})
PACKAGE = pathlib.Path(__file__).resolve().parent / "jaxrl_llm"


def _module_name(path: pathlib.Path) -> str:
  parts = path.resolve().relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _missing_optional_dependency(path: pathlib.Path) -> str | None:
  """The optional top-level package whose absence stops ``path`` importing, if any."""
  try:
    importlib.import_module(_module_name(path))
  except ModuleNotFoundError as e:
    root = (e.name or "").split(".")[0]
    if root in OPTIONAL_DEPENDENCIES:
      return root
  except Exception:  # noqa: BLE001  (the doctest collector reports it)
    return None
  # A module whose examples alone need a package (one it imports lazily) lists it in
  # ``__doctest_requires__``, a tuple of top-level package names.
  module = importlib.import_module(_module_name(path))
  for name in getattr(module, "__doctest_requires__", ()):
    if importlib.util.find_spec(name) is None:
      return name
  return None


class _SkippedModule(pytest.File):
  """Stands in for the doctests of a module whose optional dependency is missing."""

  dependency = ""

  def collect(self):
    pytest.skip(f"{self.path.name}: docstring examples need `{self.dependency}` "
                "(not installed)")


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
  collected = yield
  if file_path.suffix != ".py" or PACKAGE not in file_path.resolve().parents:
    return collected
  out = []
  for node in collected or []:
    if type(node).__name__ == "DoctestModule":
      missing = _missing_optional_dependency(file_path)
      if missing is not None:
        node = _SkippedModule.from_parent(parent, path=file_path)
        node.dependency = missing
    out.append(node)
  return out


# ------------------------------------------------------- CPU time per test (opt-in)
# `JAXRL_LLM_TEST_CPU=N python -m pytest ...` prints the N tests that used the most CPU
# seconds (this process + the subprocesses they waited for). On a shared machine wall
# time (--durations) measures the neighbours; CPU time measures the test.

_CPU_REPORT = int(os.environ.get("JAXRL_LLM_TEST_CPU", "0") or 0)
_cpu_seconds: dict = {}


def _cpu_now() -> float:
  import resource
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_REPORT:

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    start = _cpu_now()
    try:
      return (yield)
    finally:
      _cpu_seconds[item.nodeid] = _cpu_now() - start

  def pytest_terminal_summary(terminalreporter):
    total = sum(_cpu_seconds.values())
    terminalreporter.write_sep("=", f"CPU seconds per test (tests {total:.0f} s, whole "
                                    f"session {_cpu_now():.0f} s)")
    for nodeid, sec in sorted(_cpu_seconds.items(), key=lambda kv: -kv[1])[:_CPU_REPORT]:
      terminalreporter.write_line(f"{sec:8.1f}  {nodeid}")
