"""Real faults on the real command: kill -9 and SIGTERM mid-run, then ``--resume``.

One uninterrupted run and one run that is killed with SIGKILL, resumed, stopped with
SIGTERM, and resumed again. The interrupted run must end bit-identical to the
uninterrupted one (the exact checksums of the whole final train state, recorded with
its checkpoint, are equal), with every step of ``metrics.jsonl`` present once and
equal, and strict JSON throughout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
FLAGS = ["--algo", "ppo", "--steps", str(STEPS), "--prompts-per-step", "4",
         "--group-size", "2", "--eval-size", "8", "--eval-every", "3", "--save-every",
         "2", "--no-progress"]


def _env():
  return dict(os.environ, JAX_PLATFORMS="cpu",
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cmd(out, *extra):
  return [sys.executable, "-m", "jaxrl_llm", "train", *FLAGS, "--out", str(out), *extra]


def _rows(out):
  def refuse(token):
    raise AssertionError(f"non-strict JSON token {token} in metrics.jsonl")

  path = os.path.join(out, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().splitlines()
  rows = []
  for line in lines:
    try:
      rows.append(json.loads(line, parse_constant=refuse))
    except json.JSONDecodeError:
      break                                     # a torn last line while running
  return rows


def _run_until(out, step, sig, *extra):
  """Starts a run and sends ``sig`` once this run has written ``step``'s row (a
  resumed run first drops the rows after its checkpoint, so wait for that)."""
  stale = any(r.get("step") == step for r in _rows(out))
  proc = subprocess.Popen(_cmd(out, *extra), env=_env(), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
      present = any(r.get("step") == step for r in _rows(out))
      if stale and not present:
        stale = False
      elif present and not stale:
        proc.send_signal(sig)
        break
      time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=900)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, stdout, stderr


def _final_checksums(out):
  path = os.path.join(out, "checkpoints", str(STEPS), "verify", "metadata")
  with open(path) as f:
    record = json.load(f)
  return record["paths"], record["checksums"]


def _comparable(rows):
  return [{k: v for k, v in r.items() if k != "time_s"} for r in rows]


@pytest.mark.slow
def test_sigkill_and_sigterm_then_resume_is_bit_identical(tmp_path):
  full = tmp_path / "full"
  done = subprocess.run(_cmd(full), env=_env(), cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]

  run = tmp_path / "interrupted"
  code, _, err = _run_until(run, 3, signal.SIGKILL)
  assert code == -signal.SIGKILL, err[-3000:]
  assert [r["step"] for r in _rows(run)][:4] == [0, 1, 2, 3]

  # SIGTERM (what SLURM / Kubernetes / preemptible VMs send) once step 3 is done
  # again: the step in flight finishes, is checkpointed, and the process exits.
  code, _, err = _run_until(run, 3, signal.SIGTERM, "--resume")
  assert code == 128 + signal.SIGTERM, err[-3000:]
  assert "resuming from step 2" in err, err[-3000:]
  saved = re.search(r"checkpoint saved at step (\d+)", err)
  assert saved and int(saved.group(1)) in (3, 4), err[-3000:]
  at = int(saved.group(1))
  assert os.path.isdir(run / "checkpoints" / str(at))

  done = subprocess.run(_cmd(run, "--resume"), env=_env(), cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"resuming from step {at}" in done.stderr

  full_rows, run_rows = _rows(full), _rows(run)
  assert [r["step"] for r in run_rows] == list(range(STEPS + 1))   # none lost or doubled
  assert _comparable(run_rows) == _comparable(full_rows)
  assert _final_checksums(run) == _final_checksums(full)
