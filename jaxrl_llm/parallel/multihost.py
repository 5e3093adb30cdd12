"""Multi-host (multi-process) initialisation and host-side gathering.

One Python process per host (TPU VM of a pod slice, or GPU node); every process runs
the same program. :func:`initialize_multihost` connects them
(``jax.distributed.initialize``), after which ``jax.devices()`` lists the devices of
every process, a mesh from :func:`jaxrl_llm.parallel.make_mesh` spans them all, and
each process feeds its own rows with :func:`jaxrl_llm.parallel.shard_batch`. See
``docs/multihost.md`` for launch recipes.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

COORDINATOR_ENV = ("JAXRL_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
NUM_PROCESSES_ENV = ("JAXRL_NUM_PROCESSES", "JAX_NUM_PROCESSES")
PROCESS_ID_ENV = ("JAXRL_PROCESS_ID", "JAX_PROCESS_ID")
LOCAL_DEVICE_IDS_ENV = ("JAXRL_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS")
CPU_COLLECTIVES_ENV = "JAXRL_CPU_COLLECTIVES"
INIT_TIMEOUT_ENV = "JAXRL_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "JAXRL_HEARTBEAT_TIMEOUT"
SHUTDOWN_TIMEOUT_ENV = "JAXRL_SHUTDOWN_TIMEOUT"
PEER_TIMEOUT_ENV = "JAXRL_PEER_TIMEOUT"
# Exit status of a process whose peer was lost (EX_TEMPFAIL: "try again later", i.e.
# restart the job and resume from the last checkpoint).
PEER_LOST_EXIT_CODE = 75
# JAX's own defaults (jax.distributed.initialize, jax 0.4 - 0.10).
DEFAULT_INIT_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_SHUTDOWN_TIMEOUT = 300


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


def resolve_multihost_args(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None,
                           local_device_ids: int | Sequence[int] | None = None,
                           environ: Mapping[str, str] | None = None) -> dict:
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


def _env_number(name: str, environ) -> float | None:
  value = environ.get(name)
  if value in (None, ""):
    return None
  try:
    return float(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} is not a number.") from None


def resolve_timeouts(initialization_timeout: float | None = None,
                     heartbeat_timeout_seconds: float | None = None,
                     shutdown_timeout_seconds: float | None = None,
                     peer_timeout_seconds: float | None = None,
                     environ: Mapping[str, str] | None = None) -> dict:
  """The timeouts :func:`initialize_multihost` uses, in seconds, validated.

  Explicit values first, then ``JAXRL_INIT_TIMEOUT``, ``JAXRL_HEARTBEAT_TIMEOUT``,
  ``JAXRL_SHUTDOWN_TIMEOUT``, ``JAXRL_PEER_TIMEOUT``, then the defaults: JAX's 300 s,
  100 s and 300 s, and a peer timeout of half the heartbeat timeout (``0`` turns the
  peer watchdog off). The peer timeout must be below the heartbeat timeout, so the
  watchdog reports a lost peer before JAX's own check aborts the process.

  Raises:
    ValueError: a non-positive timeout, or ``peer_timeout_seconds >=
      heartbeat_timeout_seconds``; the message names the argument.

  Examples:
    >>> t = resolve_timeouts(heartbeat_timeout_seconds=10)
    >>> t["initialization_timeout"], t["heartbeat_timeout_seconds"], t["peer_timeout_seconds"]
    (300, 10, 5.0)
    >>> resolve_timeouts(environ={"JAXRL_HEARTBEAT_TIMEOUT": "30"})["peer_timeout_seconds"]
    15.0
  """
  environ = os.environ if environ is None else environ
  given = {"initialization_timeout": (initialization_timeout, INIT_TIMEOUT_ENV,
                                      DEFAULT_INIT_TIMEOUT),
           "heartbeat_timeout_seconds": (heartbeat_timeout_seconds, HEARTBEAT_TIMEOUT_ENV,
                                         DEFAULT_HEARTBEAT_TIMEOUT),
           "shutdown_timeout_seconds": (shutdown_timeout_seconds, SHUTDOWN_TIMEOUT_ENV,
                                        DEFAULT_SHUTDOWN_TIMEOUT)}
  out: dict[str, Any] = {}
  for name, (value, env, default) in given.items():
    if value is None:
      value = _env_number(env, environ)
    value = default if value is None else value
    if not value >= 1:
      raise ValueError(f"`{name}` must be >= 1 second, got {value}.")
    out[name] = int(round(value))              # JAX takes whole seconds
  peer = peer_timeout_seconds
  if peer is None:
    peer = _env_number(PEER_TIMEOUT_ENV, environ)
  if peer is None:
    peer = out["heartbeat_timeout_seconds"] / 2
  if peer < 0 or (peer and peer >= out["heartbeat_timeout_seconds"]):
    raise ValueError(f"`peer_timeout_seconds` must be 0 (off) or in (0, "
                     f"heartbeat_timeout_seconds={out['heartbeat_timeout_seconds']}), "
                     f"got {peer}.")
  out["peer_timeout_seconds"] = float(peer)
  return out


def _default_on_peer_lost(message: str) -> None:
  """Prints the one-line error and ends the process with :data:`PEER_LOST_EXIT_CODE`."""
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
  try:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
  except (OSError, ValueError):
    pass
  os._exit(PEER_LOST_EXIT_CODE)


class _PeerWatchdog:
  """Each process publishes a counter in the coordinator's key-value store every
  ``interval`` seconds and watches the others'. A peer whose counter has not moved for
  ``timeout`` seconds (local clock: no clock sync needed), a peer that marked itself
  failed, or a coordinator that stays unreachable for ``timeout`` seconds, calls
  ``on_lost(message)`` once. A peer that marked itself done (normal exit) is left
  alone."""

  PREFIX = "jaxrl_llm/peer"

  def __init__(self, client, process_id: int, num_processes: int, timeout: float,
               on_lost: Callable[[str], None]):
    self.client, self.pid, self.n = client, process_id, num_processes
    self.timeout = timeout
    self.interval = max(min(timeout / 5, 1.0), 0.05)
    self.on_lost = on_lost
    self._stop = threading.Event()
    self.lost = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxrl-peer-watchdog",
                                    daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()

  def mark(self, status: str) -> None:
    """Publishes ``done`` or ``failed`` for this process (best effort)."""
    with contextlib.suppress(Exception):  # noqa: BLE001 - the coordinator may be gone already
      self.client.key_value_set(f"{self.PREFIX}/{self.pid}/status", status, True)

  def _get(self, key: str) -> str | None:
    try:
      return self.client.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - NOT_FOUND until the peer has written it
      return None

  def _run(self) -> None:
    beat = 0
    start = time.monotonic()
    seen: dict[int, tuple[str | None, float]] = {
        p: (None, start) for p in range(self.n) if p != self.pid}
    last_ok = start
    while not self._stop.wait(self.interval):
      now = time.monotonic()
      beat += 1
      try:
        self.client.key_value_set(f"{self.PREFIX}/{self.pid}/beat", str(beat), True)
        last_ok = now
      except Exception as e:  # noqa: BLE001 - the coordinator is unreachable
        if self._stop.is_set():
          return
        if now - last_ok > self.timeout:
          self._lost(f"lost the coordinator (process 0) of this {self.n}-process job: "
                     f"unreachable for {now - last_ok:.0f} s "
                     f"({' '.join(str(e).split())[:120]})")
          return
        continue
      for peer, (value, since) in seen.items():
        status = self._get(f"{self.PREFIX}/{peer}/status")
        if status == "done":
          continue
        if status == "failed":
          self._lost(f"process {peer} of this {self.n}-process job failed (see its log)")
          return
        current = self._get(f"{self.PREFIX}/{peer}/beat")
        if current != value:
          seen[peer] = (current, now)
        elif now - since > self.timeout:
          self._lost(f"lost process {peer} of this {self.n}-process job: no sign of life "
                     f"for {now - since:.0f} s (crashed, killed, preempted, or its host "
                     "is down)")
          return

  def _lost(self, what: str) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    try:
      self.on_lost(f"jaxrl_llm multihost: process {self.pid}: {what}. This process "
                   "stops too; restart every process with the same command (jaxrl-llm "
                   "train: add --resume) to continue from the last checkpoint.")
    finally:     # after the handler: the default one ends the process first
      self.lost.set()


class _InitTimer:
  """Within: if ``jax.distributed.initialize`` has not returned after ``limit`` seconds,
  ``on_fail(message)`` is called from a timer thread (the default prints one line and
  exits with :data:`PEER_LOST_EXIT_CODE`).

  JAX (0.10) reports a job that does not form, a peer that never registers or a
  coordinator that cannot be reached, by aborting the process in C++ once its own
  ``initialization_timeout`` passes (``DEADLINE_EXCEEDED ... RegisterTask``, a stack
  trace). ``initialize`` releases the GIL while it waits, so a Python timer set a
  little earlier than JAX's deadline can say what happened in one line instead.
  """

  def __init__(self, limit: float, args: dict, on_fail: Callable[[str], None]):
    self.limit, self.args, self.on_fail = limit, args, on_fail
    self._timer = threading.Timer(limit, self._fire)
    self._timer.daemon = True

  def _fire(self) -> None:
    a = self.args
    n, pid, where = a["num_processes"], a["process_id"], a["coordinator_address"]
    if pid is None or n is None:
      what = (f"the job did not form within {self.limit:.0f} s (cluster auto-detection; "
              "a process was not started, died before connecting, or cannot reach the "
              "coordinator)")
    elif pid == 0:
      what = (f"the {n}-process job did not form within {self.limit:.0f} s: not every "
              f"process registered with this process's coordinator at {where} (one was "
              f"not started, died before connecting, or cannot reach {where})")
    else:
      what = (f"could not join the {n}-process job within {self.limit:.0f} s: the "
              f"coordinator at {where} (process 0) did not answer (it is not running, "
              "died, or the address or port is wrong or blocked)")
    self.on_fail(f"jaxrl_llm multihost: process {pid if pid is not None else '?'}: "
                 f"{what}. Start every process with the same command (jaxrl-llm train: "
                 "--coordinator HOST:PORT --num-processes N --process-id I).")

  def __enter__(self) -> _InitTimer:
    self._timer.start()
    return self

  def __exit__(self, *exc: object) -> None:
    self._timer.cancel()


_WATCHDOG: _PeerWatchdog | None = None
_UNCAUGHT: dict[str, Any] = {"exception": False, "failed": None}


def _note_uncaught(hook):
  def excepthook(*args):
    _UNCAUGHT["exception"] = True
    hook(*args)
  return excepthook


def _at_exit() -> None:
  """Runs before JAX's own exit hook (atexit is last-in, first-out)."""
  watchdog = _WATCHDOG
  if watchdog is None:
    return
  if _UNCAUGHT["exception"] or _UNCAUGHT["failed"] is not None:
    # JAX's exit hook would wait in the shutdown barrier for peers that may be dead,
    # then abort in C++. Tell the peers, and leave now with the traceback shown.
    watchdog.mark("failed")
    watchdog.stop()
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(OSError, ValueError):
        stream.flush()
    os._exit(1 if _UNCAUGHT["exception"] else _UNCAUGHT["failed"])
  watchdog.mark("done")
  watchdog.stop()


def mark_failed(exit_code: int = 1) -> None:
  """Tells the other processes' watchdogs that this process is failing (they stop with
  "process N ... failed (see its log)" instead of waiting for it); best effort, a
  no-op without a watchdog. Call it before leaving a multi-process job on an error
  the program handled itself (an uncaught exception does it automatically): the
  process then ends with ``exit_code`` at interpreter exit without waiting in JAX's
  shutdown barrier for peers that are leaving too."""
  if _WATCHDOG is not None:
    _WATCHDOG.mark("failed")
    _WATCHDOG.stop()
    _UNCAUGHT["failed"] = int(exit_code)


def await_lost_peer(timeout: float | None = None) -> bool:
  """After a collective failed: waits until the watchdog has judged whether a peer was
  lost. Returns ``True`` if it was (the watchdog's ``on_peer_lost`` ran: by default it
  has already printed its one line and ended the process, so this only returns with a
  custom handler), ``False`` after ``timeout`` seconds (default: twice the watchdog's
  peer timeout plus two check intervals: the watchdog judges within one timeout and
  an interval of the loss, later on a host too busy to run its thread on time) or at
  once when no watchdog runs.

  On CPU (gloo) a collective whose peer died fails at once with a Python error; on
  TPU/GPU it blocks. Either way the watchdog names the lost process in one line; a
  caller that catches the error gives it the time to do so before reporting the
  error as its own.
  """
  watchdog = _WATCHDOG
  if watchdog is None:
    return False
  if timeout is None:
    timeout = 2 * watchdog.timeout + 2 * watchdog.interval
  return watchdog.lost.wait(timeout)


def shutdown_multihost() -> None:
  """Leaves the job cleanly: tells the peers' watchdogs this process is done, then
  ``jax.distributed.shutdown()`` (waits for the other processes at a barrier)."""
  global _WATCHDOG
  if _WATCHDOG is not None:
    _WATCHDOG.mark("done")
    _WATCHDOG.stop()
    _WATCHDOG = None
  jax.distributed.shutdown()


def _distributed_client():
  """JAX's coordination-service client (private API; ``None`` if it moved)."""
  try:
    from jax._src import distributed as _dist
  except ImportError:
    return None
  return getattr(getattr(_dist, "global_state", None), "client", None)


def initialize_multihost(coordinator_address: str | None = None,
                         num_processes: int | None = None,
                         process_id: int | None = None,
                         local_device_ids: int | Sequence[int] | None = None, *,
                         cpu_collectives: str | None = None,
                         auto_detect: bool = False,
                         initialization_timeout: float | None = None,
                         heartbeat_timeout_seconds: float | None = None,
                         shutdown_timeout_seconds: float | None = None,
                         peer_timeout_seconds: float | None = None,
                         on_peer_lost: Callable[[str], None] | None = None,
                         **kwargs: Any) -> bool:
  """Connects this process to the others (``jax.distributed.initialize``); idempotent.

  Call it first thing, before any JAX computation. Arguments left ``None`` are read
  from the environment: ``JAXRL_COORDINATOR`` / ``JAX_COORDINATOR_ADDRESS``
  (``host:port`` of process 0), ``JAXRL_NUM_PROCESSES`` / ``JAX_NUM_PROCESSES``,
  ``JAXRL_PROCESS_ID`` / ``JAX_PROCESS_ID``, ``JAXRL_LOCAL_DEVICE_IDS`` /
  ``JAX_LOCAL_DEVICE_IDS`` (comma separated), ``JAXRL_CPU_COLLECTIVES``, and the
  timeouts below from ``JAXRL_INIT_TIMEOUT``, ``JAXRL_HEARTBEAT_TIMEOUT``,
  ``JAXRL_SHUTDOWN_TIMEOUT``, ``JAXRL_PEER_TIMEOUT`` (see :func:`resolve_timeouts`).

  It does nothing (returns ``False``) when JAX is already initialised, or when there
  is a single process: no coordinator and ``num_processes`` unset or 1 (unless
  ``auto_detect``). ``auto_detect=True`` with no coordinator calls
  ``jax.distributed.initialize()`` without addresses, letting JAX detect the cluster
  (Cloud TPU pod slices, SLURM, Open MPI, ...).

  **When a process dies.** JAX notices a dead process only after
  ``heartbeat_timeout_seconds`` and then aborts the survivors in C++ (no Python
  exception, a stack trace). A peer watchdog started here notices first: every
  process publishes a heartbeat in the coordinator's key-value store; when a peer's
  stops for ``peer_timeout_seconds`` (or it exited with an uncaught exception, or the
  coordinator stops answering), ``on_peer_lost(message)`` is called with a one-line
  message naming the process and what to do. The default prints ``error: <message>``
  and exits with status :data:`PEER_LOST_EXIT_CODE` (75). A process that fails with
  an uncaught exception tells the others and exits at once instead of waiting in
  JAX's shutdown barrier; one that ends normally tells them it is done. No state can
  be saved after a peer is lost (sharded arrays live on the dead host): restart every
  process with the same command and resume from the last checkpoint (the CLI:
  ``--resume``); see ``docs/multihost.md``.

  Args:
    coordinator_address: ``"host:port"`` of process 0's coordinator service.
    num_processes: total number of processes.
    process_id: this process's rank in ``[0, num_processes)``.
    local_device_ids: the local devices this process owns (e.g. one GPU per process).
    cpu_collectives: CPU backend cross-process collectives, ``"gloo"`` or ``"mpi"``
      (sets ``jax_cpu_collectives_implementation``); needed for multi-process CPU
      runs (tests, debugging), not on TPU/GPU.
    auto_detect: let JAX detect the cluster when no coordinator is given.
    initialization_timeout: seconds to wait for every process to connect (JAX's
      default 300); a process that cannot reach the coordinator fails after it.
    heartbeat_timeout_seconds: seconds without heartbeat after which JAX declares a
      process dead and aborts the others (JAX's default 100).
    shutdown_timeout_seconds: seconds a finishing process waits for the others at
      the shutdown barrier (JAX's default 300).
    peer_timeout_seconds: the watchdog's timeout; default half the heartbeat timeout;
      ``0`` turns the watchdog off. Must be below ``heartbeat_timeout_seconds``.
    on_peer_lost: called (from the watchdog thread) with the one-line message; it
      should end the process (collectives with a dead peer never return).
    **kwargs: other ``jax.distributed.initialize`` keywords (e.g.
      ``coordinator_bind_address``, ``cluster_detection_method``).

  Returns:
    Whether this call initialised ``jax.distributed``.

  Raises:
    ValueError: a malformed environment variable, an out-of-range timeout, a keyword
      this JAX version does not accept, or a coordinator without ``num_processes`` /
      ``process_id``.

  Examples:
    >>> initialize_multihost(num_processes=1)   # a single process: nothing to do
    False
  """
  global _WATCHDOG
  if jax.distributed.is_initialized():
    return False
  args = resolve_multihost_args(coordinator_address, num_processes, process_id,
                                local_device_ids)
  timeouts = resolve_timeouts(initialization_timeout, heartbeat_timeout_seconds,
                              shutdown_timeout_seconds, peer_timeout_seconds)
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
  peer_timeout = timeouts.pop("peer_timeout_seconds")
  accepted = inspect.signature(jax.distributed.initialize).parameters
  call = {k: val for k, val in args.items() if val is not None}
  call.update(kwargs)
  for name, value in timeouts.items():
    if name in accepted:
      call[name] = value
  unknown = sorted(k for k in call if k not in accepted)
  if unknown:
    raise ValueError(f"jax.distributed.initialize (jax {jax.__version__}) does not "
                     f"accept {unknown}; it takes {sorted(accepted)}.")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  limit = timeouts["initialization_timeout"]
  if "initialization_timeout" in call:
    # JAX's own deadline comes later: a job that does not form ends with the one-line
    # message of the timer below, not JAX's C++ abort (see _InitTimer).
    call["initialization_timeout"] = limit + max(10, limit // 10)
  with _InitTimer(limit, args, on_peer_lost or _default_on_peer_lost):
    jax.distributed.initialize(**call)
  client = _distributed_client()
  if peer_timeout > 0 and client is not None and jax.process_count() > 1:
    _WATCHDOG = _PeerWatchdog(client, jax.process_index(), jax.process_count(),
                              peer_timeout, on_peer_lost or _default_on_peer_lost)
    _WATCHDOG.start()
    if not getattr(sys.excepthook, "_jaxrl_llm", False):
      sys.excepthook = _note_uncaught(sys.excepthook)
      sys.excepthook._jaxrl_llm = True  # type: ignore[attr-defined]
    atexit.register(_at_exit)
  return True


def gather_to_host(tree: Any) -> Any:
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


__all__ = ["initialize_multihost", "resolve_multihost_args", "resolve_timeouts",
           "shutdown_multihost", "gather_to_host", "PEER_LOST_EXIT_CODE", "mark_failed",
           "await_lost_peer"]
