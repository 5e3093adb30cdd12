"""One process of the real multi-process test (see test_multihost.py).

``python -m tests.multihost_worker lose-peer PROCESS_ID PORT VICTIM SCENARIO`` is the
peer-loss test: 2 processes, process VICTIM kills itself with SIGKILL after 3
all-gathers; the survivor is idle (``idle``) or inside a collective (``collective``)
when it happens, and must end with a clear one-line error, not a C++ abort.

``python -m tests.multihost_worker OUT.npz PROCESS_ID NUM_PROCESSES PORT`` joins a
``jax.distributed`` job on 127.0.0.1:PORT with 2 forced CPU devices and gloo CPU
collectives, runs ``STEPS`` sharded PPO steps per mesh layout (each process feeding
only its own rows through ``make_array_from_process_local_data``) and saves the
gathered parameters and metrics. ``NUM_PROCESSES = 1`` (no PORT) is the
single-device reference run, without ``jax.distributed``.
"""

from __future__ import annotations

import os
import sys

from tests._devices import force_host_devices

force_host_devices(2)    # before jax is imported; the caller's other XLA flags kept

import jax
import numpy as np

# Compile fast (this is a 2-core CI box); the optimization level changes float
# rounding only, and the comparison tolerance (1e-5) is far above it.
jax.config.update("jax_disable_most_optimizations", True)

from jaxrl_llm.parallel import (
  gather_to_host,
  host_local_batch,
  initialize_multihost,
  make_mesh,
  shard_batch,
)
from jaxrl_llm.parallel.multihost import shutdown_multihost
from jaxrl_llm.train import init_train_state, make_train_step, shard_apply_fn, shard_train_step
from tests import parallel_setup as S

LAYOUTS = {"data4": dict(data=4), "data2_fsdp2": dict(data=2, fsdp=2)}


def sharded_run(sizes):
  apply_fn, params, optimizer, config, batch = S.build()
  mesh = make_mesh(**sizes)
  apply_fn = shard_apply_fn(apply_fn, mesh)
  state = init_train_state(params, optimizer, config)
  step, state = shard_train_step(make_train_step(apply_fn, optimizer, config), state,
                                 mesh, batch=batch)
  local = host_local_batch(batch, mesh)          # this process's rows only
  placed = shard_batch(local, mesh)
  losses = []
  for _ in range(S.STEPS):
    state, metrics = step(state, placed)
    losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
  return S.flat_params(gather_to_host(state.params)), losses, local["tokens"].shape[0]


def main(out, process_id, num_processes, port=None):
  arrays = {}
  if num_processes == 1:
    params, hist = S.reference_run()
    arrays.update({f"ref/{k}": v for k, v in params.items()})
    arrays["ref/loss"] = np.array([h["loss"] for h in hist])
  else:
    initialized = initialize_multihost(f"127.0.0.1:{port}", num_processes, process_id,
                                       cpu_collectives="gloo",
                                       initialization_timeout=120)
    arrays["initialized"] = np.array(initialized)
    arrays["process_index"] = np.array(jax.process_index())
    arrays["process_count"] = np.array(jax.process_count())
    arrays["device_count"] = np.array(jax.device_count())
    arrays["local_device_count"] = np.array(jax.local_device_count())
    for name, sizes in LAYOUTS.items():
      params, losses, local_rows = sharded_run(sizes)
      arrays.update({f"{name}/{k}": v for k, v in params.items()})
      arrays[f"{name}/loss"] = np.array(losses)
      arrays[f"{name}/local_rows"] = np.array(local_rows)
  np.savez(out, **arrays)
  if num_processes > 1:
    shutdown_multihost()


def lose_peer(process_id, port, victim, scenario):
  import signal
  import time

  from jax.experimental import multihost_utils
  initialize_multihost(f"127.0.0.1:{port}", 2, process_id, cpu_collectives="gloo",
                       initialization_timeout=60, heartbeat_timeout_seconds=8,
                       peer_timeout_seconds=2)
  for i in range(3):
    got = multihost_utils.process_allgather(np.array([i, process_id]))
    print(f"process {process_id} step {i} {np.asarray(got).ravel().tolist()}", flush=True)
  if process_id == victim:
    os.kill(os.getpid(), signal.SIGKILL)
  if scenario == "collective":
    time.sleep(0.5)
    multihost_utils.process_allgather(np.array([9, process_id]))   # peer is gone
  time.sleep(60)                 # idle (e.g. data loading) when the peer dies
  print(f"process {process_id}: still running after 60 s", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "lose-peer":
    lose_peer(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    sys.exit(0)
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
       int(sys.argv[4]) if len(sys.argv) > 4 else None)
