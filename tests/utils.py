"""Small shared helpers for the test-suite (no chex variants needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_close(actual, expected, atol=1e-5, rtol=1e-5, err_msg=""):
  """Pytree-aware np.testing.assert_allclose in float64 (lists count as arrays)."""
  if isinstance(expected, list):
    expected = np.asarray(expected, np.float64)
  a_leaves, a_def = jax.tree_util.tree_flatten(actual)
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert a_def == e_def, f"tree structures differ: {a_def} vs {e_def}"
  for a, e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(e, np.float64), atol=atol, rtol=rtol,
        err_msg=err_msg)


def assert_no_recompile(fn, *calls):
  """Jits `fn`, calls it with each argument tuple in `calls`, asserts one compilation.

  Use it with calls that differ only in coefficient values (gamma, lam, epsilon...).
  """
  jitted = jax.jit(fn)
  for args in calls:
    jax.block_until_ready(jitted(*args))
  assert jitted._cache_size() == 1, f"recompiled: {jitted._cache_size()} compilations"


def random_mask(rng: np.random.Generator, batch: int, time: int, p_hole=0.15,
                all_masked_row=True) -> np.ndarray:
  """A [B, T] 0/1 float32 mask with ragged lengths, holes, and (optionally) one empty row."""
  lengths = rng.integers(1, time + 1, size=batch)
  mask = (np.arange(time)[None, :] < lengths[:, None]).astype(np.float32)
  mask *= (rng.random((batch, time)) > p_hole)
  if all_masked_row and batch > 1:
    mask[-1] = 0.0
  return mask


def run_worker(module: str, *args: str, devices: int = 8, timeout: float = 900) -> dict:
  """Runs ``python -m tests.<module> RESULTS.json *args`` and returns its JSON.

  The worker scripts (``tests/*_worker.py``) force ``devices`` CPU devices before
  importing jax, so they run as subprocesses; each runs every multi-device case of its
  test file once and writes one JSON of results (``{"device_count": n, "errors":
  {case: traceback}, case: {...}}``) that the tests assert on. A failed run shows the
  worker's output tail.
  """
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  with tempfile.TemporaryDirectory(prefix=f"{module}_") as tmp:
    out = os.path.join(tmp, "results.json")
    proc = subprocess.run([sys.executable, "-m", f"tests.{module}", out, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
      results = json.load(f)
  assert results["device_count"] == devices, results["device_count"]
  return results


def train_two_steps(out: str, *flags: str) -> list[dict]:
  """Runs ``jaxrl-llm train FLAGS`` in-process for 2 tiny steps (4 prompts x 2 samples,
  eval on 8 prompts at step 2) into ``out``; returns the ``metrics.jsonl`` rows after
  checking the exit code, the steps and that loss, pg_loss, entropy and grad_norm are
  finite at every update. The sizes are test_trainer's ``SMALL``: the same programs,
  compiled once for the whole suite (persistent compilation cache)."""
  from jaxrl_llm.cli import main
  rc = main(["train", *flags, "--steps", "2", "--prompts-per-step", "4", "--group-size",
             "2", "--eval-size", "8", "--eval-every", "2", "--out", out, "--no-progress"])
  assert rc == 0, flags
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [0, 1, 2], flags
  for row in rows[1:]:
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
      assert row[key] is not None and np.isfinite(row[key]), (flags, key)
  return rows


def make_unwritable_folder(path) -> None:
  """Makes ``path`` a folder this process cannot create files in, also as root.

  A non-root user gets a ``chmod 555`` folder; root (whom permissions do not stop)
  gets a symbolic link to a sysfs folder, where no process may create files. Skips the
  calling test when neither is possible.
  """
  import pytest
  path = str(path)
  if os.geteuid() != 0:
    os.makedirs(path)
    os.chmod(path, 0o555)
    return
  for target in ("/sys/kernel", "/sys"):
    if os.path.isdir(target):
      try:
        fd, probe = tempfile.mkstemp(dir=target)
      except OSError:
        os.symlink(target, path)
        return
      os.close(fd)
      os.unlink(probe)
  pytest.skip("running as root with no folder that refuses writes")
