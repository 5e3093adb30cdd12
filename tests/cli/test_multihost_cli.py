"""``jaxrl-llm train`` as 2 real ``jax.distributed`` processes on 127.0.0.1.

Each process has 2 forced CPU devices and gloo collectives (4 devices in all). The
runs are shared between the assertions (this is a 2-core CI box):

1. a 1-process reference on 4 devices (``--data 4``) runs beside a 2-process run
   whose process 1 is SIGKILLed once step 2 is checkpointed: process 0 exits with the
   watchdog's one-line message (status 75);
2. ``--resume`` on 2 processes (from that checkpoint) with ``--fsdp 4`` (parameters
   split across the processes), SIGTERM to process 1 once
   step 3 is done: both save the same step (3, or a later one if the signal came
   late) and exit with 143;
3. ``--resume`` on 1 process from that 2-process checkpoint, to the end.

The stitched ``metrics.jsonl`` (written by process 0 only, each step once) equals the
reference: every rollout-derived value (rewards, accuracy, lengths, greedy eval) bit
for bit, the train-step metrics within 1e-6 (absolute + relative): a process computes
the old and reference log-probs of its 4 rows where one process computes 8, and
XLA:CPU picks kernels by shape, so those differ in the last bits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_llm.loop.accounting import MEASURED_COLUMNS
from jaxrl_llm.parallel.multihost import PEER_LOST_EXIT_CODE
from tests._devices import xla_flags_with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
FLAGS = ["--steps", str(STEPS), "--prompts-per-step", "4", "--group-size", "2",
         "--eval-size", "8", "--eval-every", "2", "--save-every", "2",
         "--rollout-slots", "4", "--no-progress"]   # slots: a process's default (its rows)
# The watchdog's peer timeout: a lost process is named this long after its last sign of
# life, and the survivor of the SIGKILL below waits that long (idle). A busy peer whose
# beating thread is held up this long is judged lost too: a CLI run at load 3 delayed a
# 0.2 s ticker by 0.13 s at most, docs/multihost.md reports a 12 s gap with a dozen
# busy processes on 2 cores; the 2-process test runs 3 busy JAX processes. (Was 20.)
PEER_TIMEOUT = 10
# The failing pair of the formation test: its process 1 waits up to 2 timeouts + 2 beats
# for a verdict before it reports (cli.py: await_lost_peer), while only its process 0 is
# busy; 5 s makes that wait 12 s (42 s at 20).
PAIR_PEER_TIMEOUT = 5
# Values that come from the rollouts (tokens, scores): equal bit for bit.
EXACT = ("reward", "accuracy", "response_length", "eval_accuracy", "eval_reward", "step")
TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _env(devices: int, **extra: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAXRL_HEARTBEAT_TIMEOUT="60", JAXRL_PEER_TIMEOUT=str(PEER_TIMEOUT),
             JAXRL_INIT_TIMEOUT="300")
  env.update(extra)
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
               "JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID"):
    env.pop(name, None)
  env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), devices)
  return env


def _train(out, *extra) -> list:
  return [sys.executable, "-m", "jaxrl_llm", "train", *FLAGS, "--out", str(out), *extra]


def _start(cmd, env) -> subprocess.Popen:
  return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def _pair(out, *extra, port=None) -> list:
  """Starts the 2 processes of a job (the same command but for --process-id)."""
  port = port or _free_port()
  return [_start(_train(out, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                        "2", "--process-id", str(i), "--cpu-collectives", "gloo", *extra),
                 _env(2)) for i in range(2)]


def _finish(procs) -> list:
  try:
    return [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
  finally:
    for proc in procs:            # never leave a process waiting for its peer
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _rows(out) -> list:
  path = os.path.join(out, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f.read().splitlines():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break                                    # a torn last line while running
  return rows


def _when(condition, procs, what) -> None:
  deadline = time.time() + TIMEOUT_S
  while not condition():
    if any(p.poll() is not None for p in procs) or time.time() > deadline:
      outs = _finish(procs)
      raise AssertionError(f"a process ended before {what}:\n" + "\n---\n".join(
          o[-3000:] for o in outs))
    time.sleep(0.02)


def _assert_like_reference(rows, ref):
  assert [r["step"] for r in rows] == list(range(STEPS + 1))    # each step once
  assert [r["step"] for r in ref] == list(range(STEPS + 1))
  for got, want in zip(rows, ref):
    keys = set(want) - set(MEASURED_COLUMNS)
    assert set(got) - set(MEASURED_COLUMNS) == keys, (got["step"], set(got) ^ set(want))
    for key in keys:
      if key in EXACT:
        assert got[key] == want[key], (got["step"], key, got[key], want[key])
      else:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6,
                                   err_msg=f"step {got['step']} {key}")


@pytest.mark.slow
def test_two_processes_train_like_one_survive_kill_stop_and_resume_anywhere(tmp_path):
  ref_dir, run = tmp_path / "reference", tmp_path / "run"
  reference = _start(_train(ref_dir, "--data", "4"), _env(4))

  # 1. SIGKILL process 1 once step 2 is checkpointed: process 0 stops in one line.
  procs = _pair(run)
  _when(lambda: os.path.isdir(run / "checkpoints" / "2"), procs, "checkpoint 2")
  procs[1].send_signal(signal.SIGKILL)
  outs = _finish(procs)
  assert procs[1].returncode == -signal.SIGKILL
  assert procs[0].returncode == PEER_LOST_EXIT_CODE, outs[0][-3000:]
  errors = [line for line in outs[0].splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "Traceback" not in outs[0], outs[0][-3000:]
  lost = re.search(r"^error: jaxrl_llm multihost: process 0: lost process 1 of this "
                   r"2-process job: no sign of life for (\d+) s .* add --resume\) to "
                   r"continue from the last checkpoint\.$", errors[0])
  assert lost and int(lost.group(1)) <= PEER_TIMEOUT + 2, errors[0]   # the watchdog's bound

  ref_out = _finish([reference])[0]
  assert reference.returncode == 0, ref_out[-3000:]
  ref = _rows(ref_dir)

  # 2. --resume on 2 processes; SIGTERM to process 1 after step 3: both save one step.
  # With --fsdp 4 the parameters are split across the processes (restored onto that
  # mesh from the data-parallel checkpoint; each process gathers them to generate).
  procs = _pair(run, "--resume", "--fsdp", "4")
  _when(lambda: any(r["step"] == 3 for r in _rows(run)), procs, "step 3")
  procs[1].send_signal(signal.SIGTERM)
  outs = _finish(procs)
  assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outs[0][-3000:]
  assert "resuming from step 2" in outs[0], outs[0][-3000:]
  saved = [re.findall(r"SIGTERM.*: checkpoint saved at step (\d+)", out) for out in outs]
  assert len(saved[0]) == len(saved[1]) == 1 and saved[0] == saved[1], outs
  assert "(on another process of this job)" in outs[0]
  stop = int(saved[0][0])
  assert 3 <= stop < STEPS and os.path.isdir(run / "checkpoints" / str(stop))
  assert "resuming" not in outs[1] and "reward" not in outs[1]   # process 0 reports
  # The stitched metrics so far equal the reference's (process 0 wrote them once).
  _assert_like_reference(_rows(run) + ref[stop + 1:], ref)

  # 3. --resume on 1 process from the 2-process checkpoint (restored onto 1 device).
  one = _start(_train(run, "--resume", "--fsdp", "1"), _env(1))
  out = _finish([one])[0]
  assert one.returncode == 0, out[-3000:]
  assert f"resuming from step {stop}" in out
  _assert_like_reference(_rows(run), ref)


@pytest.mark.slow
def test_a_job_that_never_forms_or_loses_a_failing_process_ends_in_one_line(tmp_path):
  """Fault 5, before registration: process 1 with no coordinator to reach, and a
  process 0 whose peer never comes; each ends with one line (status 75) when the
  initialisation timeout passes, not JAX's C++ abort. And a formed job whose process
  1 fails with a one-line error of its own (its --out is under a file): process 0 is
  told, and stops with one line too. The 4 processes run at once."""
  env = _env(1, JAXRL_INIT_TIMEOUT="3")
  lonely = [_start([sys.executable, "-m", "jaxrl_llm", "train", "--out", str(tmp_path / str(i)),
                    "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2",
                    "--process-id", str(i), "--cpu-collectives", "gloo"], env)
            for i in range(2)]
  (tmp_path / "file").write_text("")
  port = _free_port()
  pair = [_start([sys.executable, "-m", "jaxrl_llm", "train", "--out",
                  str(tmp_path / ("ok" if i == 0 else "file") / "run"),
                  "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                  "--process-id", str(i), "--cpu-collectives", "gloo"],
                 _env(1, JAXRL_PEER_TIMEOUT=str(PAIR_PEER_TIMEOUT)))
          for i in range(2)]
  outs = _finish(lonely + pair)
  for i, (proc, out) in enumerate(zip(lonely, outs)):
    assert proc.returncode == PEER_LOST_EXIT_CODE, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()
             and not line.startswith("jaxrl-llm train:")]
    assert len(lines) == 1 and "Check failure" not in out, out[-3000:]
    want = ("the 2-process job did not form within 3 s" if i == 0 else
            "could not join the 2-process job within 3 s: the coordinator at 127.0.0.1:")
    assert lines[0].startswith(f"error: jaxrl_llm multihost: process {i}: "), lines[0]
    assert want in lines[0], lines[0]
  failed, told = pair[1], pair[0]
  errors = [[line for line in out.splitlines() if line.startswith("error: ")]
            for out in outs[2:]]
  assert failed.returncode == 1 and len(errors[1]) == 1, outs[3][-3000:]
  assert "is not a folder" in errors[1][0] and "Traceback" not in outs[3]
  assert told.returncode == PEER_LOST_EXIT_CODE and len(errors[0]) == 1, outs[2][-3000:]
  assert errors[0][0].startswith("error: jaxrl_llm multihost: process 0: process 1 of "
                                 "this 2-process job failed (see its log)"), errors[0]
  assert not (tmp_path / "ok").exists()      # nothing written: the run never started


@pytest.mark.parametrize("flags,message", [
    (["--coordinator", "10.0.0.1:8476", "--num-processes", "2"],
     "--coordinator 10.0.0.1:8476 needs --num-processes and --process-id"),
    (["--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"],
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, --num-processes 2), got 2"),
    (["--num-processes", "2", "--process-id", "1"], "need --coordinator HOST:PORT"),
    (["--multihost-auto", "--process-id", "1"], "--multihost-auto lets JAX find the job"),
    (["--num-processes", "0"], "--num-processes must be an int >= 1 (got 0)"),
])
def test_launch_mistakes_are_one_line_errors_before_joining(capsys, monkeypatch, tmp_path,
                                                           flags, message):
  from jaxrl_llm.cli import main
  for name in ("JAX_COORDINATOR_ADDRESS", "JAXRL_COORDINATOR"):
    monkeypatch.delenv(name, raising=False)
  assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
  assert not (tmp_path / "run").exists()


def test_what_a_multi_process_run_does_not_support_is_one_line():
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.processes import check_multiprocess
  from jaxrl_llm.loop.resolve import resolve
  for fields, message in [({"rollout": "simple"}, "--rollout simple (its draws are keyed"),
                          ({"algo": "dapo"}, "dynamic sampling (--algo dapo"),
                          ({"async_rollouts": True}, "--async is not supported"),
                          ({"mesh_fsdp": 3}, "needs 3 devices; this host has 4")]:
    run = RunConfig(prompts_per_step=4, group_size=2, **fields)
    with pytest.raises(ValueError, match=re.escape(message)):
      check_multiprocess(run, resolve(run), 2, 4)
  run = RunConfig(prompts_per_step=4, group_size=2)
  check_multiprocess(run, resolve(run), 2, 4)          # data parallel over all 4
