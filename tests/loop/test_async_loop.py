"""The asynchronous loop (--async --max-staleness K): a rollout thread at most K
versions ahead; K = 0 is the synchronous loop bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm.loop.accounting import MEASURED_COLUMNS
from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.run import run_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(steps=4, prompts_per_step=4, group_size=2, eval_every=2, eval_size=8,
             save_every=2, progress=False)
WALL = MEASURED_COLUMNS       # time, memory and compile columns
ASYNC_ONLY = ("staleness_mean", "staleness_max", "behaviour_kl")


def _rows(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path):
  # The same run (the rollout correction on in both: --async turns it on by default).
  sync = RunConfig(out=str(tmp_path / "sync"), train={"rollout_correction": "token"},
                   **SMALL)
  run_training(sync)
  run_training(RunConfig(out=str(tmp_path / "async"), async_rollouts=True,
                         max_staleness=0, **SMALL))
  a, b = _rows(tmp_path / "sync"), _rows(tmp_path / "async")
  assert all(r["staleness_max"] == 0 for r in b[1:])
  strip = lambda rows: [{k: v for k, v in r.items() if k not in WALL + ASYNC_ONLY}
                        for r in rows]
  assert strip(a) == strip(b)
  assert len(a) == 5 and "eval_accuracy" in a[-1]


@pytest.mark.slow
def test_max_staleness_1_overlaps_and_never_trains_an_older_batch(tmp_path):
  def stop_after_two(row):
    if row["step"] == 2:
      raise KeyboardInterrupt

  cfg = dict(SMALL, steps=5, save_every=10)
  with pytest.raises(KeyboardInterrupt):      # the worker is stopped, step 2 saved
    run_training(RunConfig(out=str(tmp_path), async_rollouts=True, max_staleness=1,
                           **cfg), on_step=stop_after_two)
  run_training(RunConfig(out=str(tmp_path), async_rollouts=True, max_staleness=1,
                         resume=True, **cfg))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
  lags = [r["staleness_max"] for r in rows[1:]]
  assert all(lag in (0.0, 1.0) for lag in lags)
  assert lags[0] == 0 and lags[2] == 0        # the first step of a run: fresh weights
  for r in rows[1:]:
    assert np.isfinite(r["loss"]) and r["skipped"] == 0
    assert r["trainer_wait_s"] >= 0 and r["sampler_wait_s"] >= 0
    assert np.isfinite(r["behaviour_kl"]) and "rollout_is_mean" in r


def _train(out, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "jaxrl_llm", "train", "--steps", "2",
                         "--out", str(out), *flags], capture_output=True, text=True,
                        env=env, timeout=120)


@pytest.mark.parametrize("flags, message", [
    (["--async", "--max-staleness", "-1"], "error: --max-staleness must be >= 0 (got -1)"),
    (["--max-staleness", "2"], "error: --max-staleness 2 is a setting of --async"),
    (["--async", "--partial-rollouts"], "error: --async and --partial-rollouts are exclusive"),
    (["--async", "--algo", "dapo"], "error: --async generates the batches outside the step"),
    # more rollout devices than any test host has (1, or 8 forced CPU devices)
    (["--async", "--rollout-devices", "4096"], "error: --rollout-devices 4096 leaves no "
     "device to train on: this host has "),
    (["--rollout-devices", "1"], "error: --rollout-devices 1 is a setting of --async"),
    (["--async", "--rollout-devices", "1", "--rollout", "simple"],
     "error: --rollout-devices needs --rollout engine"),
])
def test_bad_async_flags_are_one_line_errors_before_anything_is_written(tmp_path, flags,
                                                                       message):
  out = tmp_path / "run"
  done = _train(out, *flags)
  assert done.returncode == 2
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(message), done.stderr
  assert not out.exists()


@pytest.mark.slow
def test_sigkill_during_an_async_run_then_resume_trains_every_step_once(tmp_path):
  """The real command, killed with SIGKILL after step 3 (checkpoint at 2, batches of
  later steps generated ahead and lost), then ``--resume``: every step is trained
  once (metrics rows 0..6 once each), none lost beyond the checkpoint, and no batch
  older than K = 1 version."""
  import signal

  from tests.cli.test_cli_faults import STEPS, _cmd, _env, _run_until
  from tests.cli.test_cli_faults import _rows as _fault_rows
  run = tmp_path / "async"
  flags = ("--async", "--max-staleness", "1")
  code, _, err = _run_until(run, 3, signal.SIGKILL, *flags)
  assert code == -signal.SIGKILL, err[-3000:]
  done = subprocess.run(_cmd(run, "--resume", *flags), env=_env(), cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resuming from step 2" in done.stderr
  rows = _fault_rows(run)
  assert [r["step"] for r in rows] == list(range(STEPS + 1))
  assert all(r["staleness_max"] <= 1 for r in rows[1:])
  assert rows[3]["staleness_max"] == 0          # the first step after the resume


@pytest.mark.slow
def test_rollout_devices_generate_apart_and_change_nothing(tmp_path):
  """On 4 forced CPU devices (tests/rollout_devices_worker.py): a ReplicatedEngine over
  3 devices returns the one engine's tokens and log-probs bit for bit (sampled, n = 2,
  uneven parts), and ``--async --max-staleness 0 --rollout-devices 2`` (the trainer on
  device 0, its mesh over devices 0-1 when asked; generation on 2-3) gives the
  synchronous loop's metrics bit for bit."""
  out = tmp_path / "out.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run([sys.executable, "-m", "tests.rollout_devices_worker", str(out),
                         str(tmp_path)], capture_output=True, text=True, env=env,
                        timeout=600, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["devices"] == 4
  assert result["replica_devices"] == [[0], [2], [3]]     # one part per rollout device
  assert result["engine_equal"] and result["completions"] == 7 * 2
  assert result["generated_on"] == [2, 3]
  assert result["sync_rows"] == result["async_rows"] and len(result["sync_rows"]) == 5
