"""Smoke tests of the benchmarks: quick sizes, JSON written, RESULTS.md untouched.

Two runs of the runner (``python -m benchmarks``), so that pytest-xdist can give them
to different workers: the runner's bookkeeping with the cheap benchmarks (``gae``,
``train_step``) and a missing one, then the PPO-vs-GRPO benchmark (two short training
runs and the long-generation update) on its own.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmarks(out, *args):
  proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out),
                         *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(out / "summary.json") as f:
    status = json.load(f)["status"]
  # A quick run writes its RESULTS.md into --out only, never benchmarks/RESULTS.md.
  wrote = [ln for ln in proc.stdout.splitlines() if ln.startswith("wrote ")]
  assert wrote == [f"wrote {out / 'RESULTS.md'}"]
  return status, (out / "RESULTS.md").read_text()


@pytest.mark.slow
def test_run_all_quick_statuses_json_and_results(tmp_path):
  status, text = run_benchmarks(tmp_path, "--only", "gae,train_step,no_such_benchmark",
                                "--args", "train_step=--models tiny")
  assert status["no_such_benchmark"] == "missing"
  assert status["train_step"] == "ok"
  assert status["gae"] in ("ok", "skipped")  # rlax is optional
  with open(tmp_path / "train_step.json") as f:
    rows = json.load(f)["rows"]
  assert rows and all(r["tokens_s"] > 0 and r["mfu"] > 0 for r in rows)
  assert {r["model"] for r in rows} == {"tiny"}          # --args reached the benchmark
  assert "missing" in text and "| train_step | ok |" in text


@pytest.mark.slow
def test_algorithms_benchmark_quick(tmp_path):
  status, text = run_benchmarks(
      tmp_path, "--only", "algorithms",
      "--args", "algorithms=--algos grpo,ppo --steps 2 --long-tokens 16")
  assert status["algorithms"] == "ok"
  with open(tmp_path / "algorithms.json") as f:
    alg = json.load(f)
  assert {r["algo"] for r in alg["runs"]} == {"grpo", "ppo"}
  assert all(r["iter_samples_s"] > 0 for r in alg["runs"])
  # A ratio of summed variances: NaN exactly when no rollout had any score variance.
  assert all(r["adv_var_norm"] >= 0 if r["score_var"] > 0 else math.isnan(r["adv_var_norm"])
             for r in alg["runs"])
  assert [r["algo"] for r in alg["long_generation"]] == ["ppo", "grpo"]
  assert "## PPO, VAPO, GRPO, DAPO, RLOO" in text


@pytest.mark.slow
def test_rollout_benchmark_quick(tmp_path):
  status, text = run_benchmarks(tmp_path, "--only", "rollout", "--args", "rollout=--no-hf")
  assert status["rollout"] == "ok"
  with open(tmp_path / "rollout.json") as f:
    result = json.load(f)
  assert [r["workload"] for r in result["rows"]] == ["heavy_tailed", "uniform"]
  assert all(r["engine_tok_s"] > 0 and r["sample_tok_s"] > 0 for r in result["rows"])
  assert result["shared_over_distinct"] > 0 and "## Rollout engine" in text


def test_adv_var_norm_is_a_ratio_of_summed_variances():
  from benchmarks.algorithms import _variance_ratio
  rows = [{"adv_var": 0.5, "score_var": 1.0}, {"adv_var": 0.25, "score_var": 0.0},
          {"adv_var": 0.25, "score_var": 1.0}]
  assert _variance_ratio(rows) == 0.5      # (0.5 + 0.25 + 0.25) / (1 + 0 + 1)
  assert _variance_ratio(rows[1:2]) != _variance_ratio(rows[1:2])   # NaN, not 2.5e11
