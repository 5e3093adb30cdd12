"""Multi-host (multi-process) initialisation and host-side gathering.

One Python process per host (TPU VM of a pod slice, or GPU node); every process runs
the same program. :func:`initialize_multihost` connects them
(``jax.distributed.initialize``), after which ``jax.devices()`` lists the devices of
every process, a mesh from :func:`jaxrl_llm.parallel.make_mesh` spans them all, and
each process feeds its own rows with :func:`jaxrl_llm.parallel.shard_batch`. See
``docs/multihost.md`` for launch recipes.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import jax
import numpy as np

COORDINATOR_ENV = ("JAXRL_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
NUM_PROCESSES_ENV = ("JAXRL_NUM_PROCESSES", "JAX_NUM_PROCESSES")
PROCESS_ID_ENV = ("JAXRL_PROCESS_ID", "JAX_PROCESS_ID")
LOCAL_DEVICE_IDS_ENV = ("JAXRL_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS")
CPU_COLLECTIVES_ENV = "JAXRL_CPU_COLLECTIVES"


def _env(names, environ):
  for name in names:
    value = environ.get(name)
    if value not in (None, ""):
      return name, value
  return None, None


def _env_int(names, environ):
  name, value = _env(names, environ)
  if value is None:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(
        f"environment variable {name}={value!r} is not an integer.") from None


def resolve_multihost_args(coordinator_address=None, num_processes=None, process_id=None,
                           local_device_ids=None, environ=None) -> dict:
  """The arguments :func:`initialize_multihost` passes on: explicit values first, then
  the environment (``JAXRL_*`` before ``JAX_*``).

  Examples:
    >>> resolve_multihost_args(environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    ...     "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"})["num_processes"]
    4
  """
  environ = os.environ if environ is None else environ
  if coordinator_address is None:
    coordinator_address = _env(COORDINATOR_ENV, environ)[1]
  if num_processes is None:
    num_processes = _env_int(NUM_PROCESSES_ENV, environ)
  if process_id is None:
    process_id = _env_int(PROCESS_ID_ENV, environ)
  if local_device_ids is None:
    ids = _env(LOCAL_DEVICE_IDS_ENV, environ)[1]
    if ids is not None:
      local_device_ids = [int(i) for i in ids.split(",") if i.strip()]
  return dict(coordinator_address=coordinator_address, num_processes=num_processes,
              process_id=process_id, local_device_ids=local_device_ids)


def initialize_multihost(coordinator_address: Optional[str] = None,
                         num_processes: Optional[int] = None,
                         process_id: Optional[int] = None,
                         local_device_ids: Optional[Union[int, Sequence[int]]] = None, *,
                         cpu_collectives: Optional[str] = None,
                         auto_detect: bool = False, **kwargs) -> bool:
  """Connects this process to the others (``jax.distributed.initialize``); idempotent.

  Call it first thing, before any JAX computation. Arguments left ``None`` are read
  from the environment: ``JAXRL_COORDINATOR`` / ``JAX_COORDINATOR_ADDRESS``
  (``host:port`` of process 0), ``JAXRL_NUM_PROCESSES`` / ``JAX_NUM_PROCESSES``,
  ``JAXRL_PROCESS_ID`` / ``JAX_PROCESS_ID``, ``JAXRL_LOCAL_DEVICE_IDS`` /
  ``JAX_LOCAL_DEVICE_IDS`` (comma separated), ``JAXRL_CPU_COLLECTIVES``.

  It does nothing (returns ``False``) when JAX is already initialised, or when there
  is a single process: no coordinator and ``num_processes`` unset or 1 (unless
  ``auto_detect``). ``auto_detect=True`` with no coordinator calls
  ``jax.distributed.initialize()`` without arguments, letting JAX detect the cluster
  (Cloud TPU pod slices, SLURM, Open MPI, ...).

  Args:
    coordinator_address: ``"host:port"`` of process 0's coordinator service.
    num_processes: total number of processes.
    process_id: this process's rank in ``[0, num_processes)``.
    local_device_ids: the local devices this process owns (e.g. one GPU per process).
    cpu_collectives: CPU backend cross-process collectives, ``"gloo"`` or ``"mpi"``
      (sets ``jax_cpu_collectives_implementation``); needed for multi-process CPU
      runs (tests, debugging), not on TPU/GPU.
    auto_detect: let JAX detect the cluster when no coordinator is given.
    **kwargs: passed to ``jax.distributed.initialize`` (e.g.
      ``initialization_timeout``).

  Returns:
    Whether this call initialised ``jax.distributed``.

  Raises:
    ValueError: a malformed environment variable, or a coordinator without
      ``num_processes`` / ``process_id``.

  Examples:
    >>> initialize_multihost(num_processes=1)   # a single process: nothing to do
    False
  """
  if jax.distributed.is_initialized():
    return False
  args = resolve_multihost_args(coordinator_address, num_processes, process_id,
                                local_device_ids)
  if cpu_collectives is None:
    cpu_collectives = os.environ.get(CPU_COLLECTIVES_ENV) or None
  single = args["num_processes"] in (None, 1)
  if args["coordinator_address"] is None and single and not auto_detect:
    return False
  if args["coordinator_address"] is not None and args["num_processes"] == 1:
    return False
  if args["coordinator_address"] is not None and (
      args["num_processes"] is None or args["process_id"] is None):
    raise ValueError(f"coordinator {args['coordinator_address']!r} given without "
                     f"num_processes ({args['num_processes']}) and process_id "
                     f"({args['process_id']}); set both (or JAX_NUM_PROCESSES / "
                     "JAX_PROCESS_ID).")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(**{k: val for k, val in args.items() if val is not None},
                             **kwargs)
  return True


def gather_to_host(tree):
  """Every leaf as a full host ``numpy`` array, on every process.

  Arrays spread over several processes are all-gathered
  (``multihost_utils.process_allgather``); fully addressable ones are copied.
  Every process must call it (it is a collective when arrays span processes).
  """
  from jax.experimental import multihost_utils

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  return jax.tree_util.tree_map(one, tree)


__all__ = ["initialize_multihost", "resolve_multihost_args", "gather_to_host"]
