"""Test-session setup, applied before any test compiles anything.

* ``--xla_backend_optimization_level=0``: the suite is dominated by XLA compile time
  of small programs; the lowest CPU backend optimisation level roughly halves it and
  changes no result beyond float rounding (tests compare with tolerances).
* A persistent compilation cache shared by all tests and the CLI/notebook
  subprocesses they start (they compile the same tiny-model programs).

Both are environment variables, so subprocesses inherit them. Set JAXRL_LLM_TEST_FAST=0
to test with the default XLA pipeline.
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

if "JAX_COMPILATION_CACHE_DIR" in os.environ:
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
