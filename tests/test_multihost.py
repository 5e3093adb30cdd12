"""Real multi-process training: 2 ``jax.distributed`` processes on localhost.

Each process has 2 forced CPU devices and gloo collectives; together they form a
4-device global mesh. Each feeds only its own 8 rows of the 16-row batch
(``make_array_from_process_local_data``), runs 3 sharded PPO steps per layout (data=4,
and data=2 x fsdp=2 with parameters split across the processes), and saves the
gathered parameters. A third, independent single-device process computes the
reference. All three run concurrently (see tests/multihost_worker.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np

from tests import parallel_setup as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _layout(arrays, prefix):
  return {k[len(prefix) + 1:]: arrays[k] for k in arrays.files
          if k.startswith(prefix + "/") and k.endswith(".value")}


def test_two_processes_train_like_one(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
               "JAX_PROCESS_ID", "JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES",
               "JAXRL_PROCESS_ID"):
    env.pop(name, None)
  port = _free_port()
  worker = [sys.executable, "-m", "tests.multihost_worker"]
  commands = [worker + [str(tmp_path / f"p{i}.npz"), str(i), "2", str(port)]
              for i in range(2)]
  commands.append(worker + [str(tmp_path / "ref.npz"), "0", "1"])
  procs, outputs = [], []
  try:
    for cmd in commands:
      procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    for proc in procs:
      outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for proc in procs:          # never leave a process waiting for its peer
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for cmd, proc, out in zip(commands, procs, outputs):
    assert proc.returncode == 0, f"{cmd} failed:\n{out[-5000:]}"

  ref = np.load(tmp_path / "ref.npz")
  ref_params = _layout(ref, "ref")
  assert len(ref_params) == 13
  for i in range(2):
    res = np.load(tmp_path / f"p{i}.npz")
    assert bool(res["initialized"]) and int(res["process_index"]) == i
    assert int(res["process_count"]) == 2
    assert int(res["device_count"]) == 4 and int(res["local_device_count"]) == 2
    for layout in ("data4", "data2_fsdp2"):
      assert int(res[f"{layout}/local_rows"]) == S.B // 2     # each fed half the rows
      diff = S.max_abs_diff(_layout(res, layout), ref_params)
      assert diff < 1e-5, (i, layout, diff)
      np.testing.assert_allclose(res[f"{layout}/loss"], ref["ref/loss"], atol=1e-5)
