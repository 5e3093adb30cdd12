"""The RL loop: every algorithm runs, kill-and-resume is exact, bad input is refused."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm.trainer import ALGOS, RunConfig, RunFolderError, train

SMALL = dict(steps=3, prompts_per_step=4, group_size=2, eval_every=3, eval_size=8,
             save_every=2, progress=False)


def _rows(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("algo", ALGOS)
def test_three_steps_of_every_algo_give_finite_metrics(algo, tmp_path):
  summary = train(RunConfig(algo=algo, out=str(tmp_path), **SMALL))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  for row in rows[1:]:
    for key in ("reward", "loss", "pg_loss", "entropy", "approx_kl", "pg_clipfrac",
                "adv_raw_var", "grad_norm"):
      assert np.isfinite(row[key]), (algo, key)
    assert row["skipped"] == 0
  assert "eval_accuracy" in rows[-1] and summary["steps"] == 3
  if algo == "ppo":
    assert np.isfinite(rows[-1]["vf_loss"])


def test_kill_and_resume_matches_uninterrupted(tmp_path):
  cfg = dict(SMALL, steps=4, algo="ppo", save_every=10)
  train(RunConfig(out=str(tmp_path / "a"), **cfg))
  full = _rows(tmp_path / "a")

  def stop_after_two(row):
    if row["step"] == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    train(RunConfig(out=str(tmp_path / "b"), **cfg), on_step=stop_after_two)
  assert os.path.isdir(tmp_path / "b" / "checkpoints" / "2")
  train(RunConfig(out=str(tmp_path / "b"), resume=True, **cfg))
  resumed = _rows(tmp_path / "b")
  assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
  for a, b in zip(full[3:], resumed[3:]):
    for key in ("reward", "loss", "pg_loss", "vf_loss", "approx_kl", "grad_norm"):
      assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key


def test_bad_input_is_refused_with_clear_messages(tmp_path):
  with pytest.raises(ValueError, match="valid tasks: .*reverse"):
    RunConfig(task="chess").validate()
  with pytest.raises(ValueError, match="valid algos: ppo, grpo"):
    RunConfig(algo="dpo").validate()
  with pytest.raises(ValueError, match="group-size >= 2"):
    RunConfig(algo="grpo", group_size=1).validate()
  RunConfig(algo="self_critical", group_size=1).validate()   # not a group estimator
  out = str(tmp_path / "run")
  train(RunConfig(out=out, **dict(SMALL, steps=1)))
  with pytest.raises(RunFolderError, match="different config.*lr"):
    train(RunConfig(out=out, lr=0.5, **dict(SMALL, steps=1)))
  with pytest.raises(RunFolderError, match="--resume"):
    train(RunConfig(out=out, **dict(SMALL, steps=1)))


def test_cli_train_eval_plot_as_subprocess(tmp_path):
  out = str(tmp_path / "cli_run")
  # Two forced CPU devices and --data 2: the CLI trains on a data-parallel mesh.
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
  cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--steps", "2", "--prompts-per-step",
         "4", "--group-size", "2", "--eval-size", "8", "--eval-every", "2", "--data", "2",
         "--out", out]
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert done.returncode == 0, done.stderr
  assert "eval_accuracy_end" in done.stdout
  assert os.path.exists(os.path.join(out, "config.json"))
  # a second train into the same folder without --resume is refused, with exit code 2
  again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert again.returncode == 2 and "--resume" in again.stderr
  bad = subprocess.run([sys.executable, "-m", "jaxrl_llm", "train", "--algo", "nope"],
                       capture_output=True, text=True, env=env, timeout=600)
  assert bad.returncode == 2 and "valid algos" in bad.stderr
  png = str(tmp_path / "curves.png")
  plot = subprocess.run([sys.executable, "-m", "jaxrl_llm", "plot", out, out, "--labels",
                         "a", "b", "-o", png], capture_output=True, text=True, env=env,
                        timeout=600)
  assert plot.returncode == 0, plot.stderr
  assert os.path.getsize(png) > 10_000
