"""Smoke test of the benchmark runner: quick sizes, JSON written, RESULTS.md untouched."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_all_quick(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks", "--quick", "--only",
       "gae,train_step,algorithms,no_such_benchmark", "--out", str(tmp_path),
       "--args", "algorithms=--algos grpo,ppo --steps 2 --long-tokens 16",
       "--args", "train_step=--models tiny"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / "summary.json") as f:
    status = json.load(f)["status"]
  assert status["no_such_benchmark"] == "missing"
  assert status["train_step"] == "ok" and status["algorithms"] == "ok"
  assert status["gae"] in ("ok", "skipped")  # rlax is optional
  with open(tmp_path / "algorithms.json") as f:
    alg = json.load(f)
  assert {r["algo"] for r in alg["runs"]} == {"grpo", "ppo"}
  assert all(r["iter_samples_s"] > 0 and r["adv_var_norm"] >= 0 for r in alg["runs"])
  assert [r["algo"] for r in alg["long_generation"]] == ["ppo", "grpo"]
  with open(tmp_path / "train_step.json") as f:
    rows = json.load(f)["rows"]
  assert rows and all(r["tokens_s"] > 0 and r["mfu"] > 0 for r in rows)
  text = (tmp_path / "RESULTS.md").read_text()
  assert "## PPO vs GRPO vs RLOO" in text and "missing" in text
  # A quick run writes its RESULTS.md into --out only, never benchmarks/RESULTS.md.
  wrote = [ln for ln in proc.stdout.splitlines() if ln.startswith("wrote ")]
  assert wrote == [f"wrote {tmp_path / 'RESULTS.md'}"]
