"""Where a run's time goes (loop.accounting): the compile log, the phase columns of
every metrics row and the summary's split, and the compile-cache hits of a second
identical ``jaxrl-llm train`` (loop.compile_cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxrl_llm.loop.accounting import MEASURED_COLUMNS, PHASES, CompileLog, phase_summary
from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.run import run_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(steps=3, prompts_per_step=4, group_size=2, eval_every=3, eval_size=8,
             save_every=2, progress=False)


def _rows(out) -> list[dict]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


# ------------------------------------------------------------ per-phase accounting


def test_compile_log_counts_by_function_and_stops():
  log = CompileLog(min_listed_s=0.0).start()

  def seventh_power(x):
    return x ** 7

  jax.jit(seventh_power)(jax.numpy.float32(1.5)).block_until_ready()
  seen = log.take()
  assert seen["compile_s"] > 0 and "seventh_power" in seen["compiles"]
  assert log.take()["compile_s"] == 0.0      # take() resets
  log.stop()
  jax.jit(lambda x: x - 1.0)(jax.numpy.float32(1.0)).block_until_ready()
  assert log.take()["compile_s"] == 0.0      # no listener any more


@pytest.mark.slow
def test_every_row_splits_its_time_into_phases_that_add_up(tmp_path):
  summary = run_training(RunConfig(out=str(tmp_path), **SMALL))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  for row in rows:
    for key in ("step_s", "compile_s", "compile_cache_hits", "peak_rss_mb"):
      assert row[key] >= 0, (row["step"], key)
  assert rows[0]["peak_rss_mb"] > 0
  assert [r["peak_rss_mb"] for r in rows] == sorted(r["peak_rss_mb"] for r in rows)
  assert rows[0]["compile_s"] > 0 and "compiles" in rows[0]   # the initial eval compiled
  parts = [("setup_s", "eval_s")] + [PHASES] * 3
  for row, names in zip(rows, parts):
    assert all(row[name] >= 0 for name in names), row
    total = sum(row[name] for name in names)
    assert abs(total - row["step_s"]) <= 0.1 * row["step_s"], (row["step"], total, row)
  assert rows[3]["eval_s"] > 0 and rows[1]["eval_s"] == 0.0
  assert rows[3]["save_s"] > 0            # step 2's checkpoint, saved after its row
  for key in ("phase_split_s", "first_step_s", "first_step_compile_s", "peak_rss_mb"):
    assert key in summary, key
  assert "update" in summary["phase_split_s"] and "other" in summary["phase_split_s"]
  assert set(MEASURED_COLUMNS) >= set(PHASES) | {"step_s", "compile_s", "peak_rss_mb"}


def test_phase_summary_adds_the_last_save_to_the_last_step():
  rows = [{"step": 1, "step_s": 2.0, "update_s": 2.0},
          {"step": 2, "step_s": 1.0, "update_s": 1.0}]
  assert phase_summary(rows, final_save_s=0.5)["phase_split_s"] == \
      "update 1.000, save 0.500 (step 1.500)"
  assert phase_summary([{"step": 0, "eval_s": 1.0}]) == {}


# ------------------------------------------------------------ the cache, end to end


@pytest.mark.slow
def test_a_second_identical_run_reads_the_compile_cache(tmp_path):
  cache = tmp_path / "xla"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  hits = []
  for name in ("first", "second"):
    cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--steps", "1",
           "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "4",
           "--eval-every", "1", "--no-progress", "--compile-cache", str(cache),
           "--out", str(tmp_path / name)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "phase_split_s" in done.stdout and "first_step_compile_s" in done.stdout
    rows = _rows(tmp_path / name)
    hits.append(sum(r["compile_cache_hits"] for r in rows))
    if name == "first":
      assert os.listdir(cache)       # the first run wrote its programs
  # a fresh cache serves nothing to the first run, the second run's programs from it
  assert hits[0] == 0 and hits[1] > 0, hits
