"""Test-session setup, applied before any test compiles anything.

* ``--xla_backend_optimization_level=0``: the suite is dominated by XLA compile time
  of small programs; the lowest CPU backend optimisation level roughly halves it and
  changes no result beyond float rounding (tests compare with tolerances).
* A persistent compilation cache shared by all tests and the CLI/notebook
  subprocesses they start (they compile the same tiny-model programs).

Both are environment variables, so subprocesses inherit them. Set JAXRL_LLM_TEST_FAST=0
to test with the default XLA pipeline.

* A deterministic hypothesis profile (``jaxrl_llm``, loaded by default): examples are
  derived from each test's name (``derandomize=True``), nothing is stored or replayed
  from a ``.hypothesis/`` example database (``database=None``), no per-example
  deadline (the first example of a jitted test includes its compilation). Every run
  of the suite tries the same inputs, so a failure reproduces and a pass is not luck.
  ``HYPOTHESIS_PROFILE=explore`` tries fresh random inputs (more of them) to hunt for
  new failures; a test's own ``@settings(max_examples=...)`` still caps its count.
"""

import os
import tempfile

if os.environ.get("JAXRL_LLM_TEST_FAST", "1") == "1":
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(tempfile.gettempdir(), "jaxrl_llm_xla_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402  (after the environment is set)
from hypothesis import settings  # noqa: E402

settings.register_profile("jaxrl_llm", derandomize=True, database=None, deadline=None,
                          max_examples=25, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, deadline=None,
                          max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxrl_llm"))

if "JAX_COMPILATION_CACHE_DIR" in os.environ:
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
