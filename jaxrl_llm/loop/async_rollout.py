r"""The asynchronous RL loop (``--async --max-staleness K``): a rollout thread generates
the next batches while the trainer steps (AReaL, verl ``fully_async_policy``, prime-rl).

:class:`AsyncRollouts` runs a rollout worker in a thread. The worker generates the
batch of step ``s`` exactly as a synchronous step does (:func:`jaxrl_llm.loop.batch._rollout`:
the prompts from ``(seed, s)``, the samples from ``fold_in(key(seed), s)``) but under
the newest weights the trainer has published, version ``v`` (= train steps applied),
as soon as ``v >= s - 1 - K``: step ``s`` trains with the weights of version
``s - 1``, so its batch lags ``s - 1 - v <= K`` versions. The worker never runs
further ahead than that bound, so no batch is ever too old and none is dropped (it
waits instead; ``sampler_wait_s`` counts it). The trainer takes the batch of its step
(waiting ``trainer_wait_s`` if it is not there yet), steps, and publishes a copy of the
new weights (the train step donates its state's buffers; the copy stays on the same
device: no disk, no host round trip).

* ``K = 0``: the worker waits for the weights of version ``s - 1`` before generating
  step ``s``: the synchronous loop, bit for bit (same prompts, keys, weights; the test
  compares every metric).
* ``K = 1``: the batch of step ``s + 1`` is generated while step ``s`` trains (one
  version old): generation and training overlap.

Devices: by default the worker and the trainer share the process's devices (on one
device they time-share it; on a CPU host they share its cores). With
``--rollout-devices N`` the last ``N`` devices are the rollout set: the worker
generates on them, one engine replica per device
(:class:`~jaxrl_llm.rollout.ReplicatedEngine`: the batch's requests cut in contiguous
parts, the weights copied device to device at each generation, draws keyed as on one
engine, so the tokens are the same bit for bit), and the trainer's mesh is built over
the other devices.

Metrics per step: ``staleness_mean`` / ``staleness_max`` (the batch's version lag: one
version per batch), ``trainer_wait_s`` (the trainer waiting for its batch),
``sampler_wait_s`` (the worker waiting for fresh enough weights, before this batch),
``generate_s`` (the worker's generation of this batch), ``behaviour_kl``. The rollout
correction (``rollout_correction="token"``) is on by default, as with
``--partial-rollouts``.

Resume: batches generated ahead and not yet trained are not checkpointed; a resumed
run generates the batch of each step again from ``(seed, step)`` under the restored
weights. A step's batch is trained once (a step is trained once), so no sample is
trained twice; the regenerated batches are those of the restored version (lag 0 at
first), so a resumed ``K >= 1`` run does not reproduce the uninterrupted one bit for
bit (``K = 0`` does).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.loop.batch import _rollout
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.resolve import Resolved
from jaxrl_llm.rollout import ReplicatedEngine, RolloutBackend, RolloutEngine
from jaxrl_llm.tasks.base import Task


class AsyncRollouts:
  """A rollout thread a bounded number of versions ahead of the trainer.

  Args:
    resolved: the resolved run (sampling settings, train config).
    task: the task.
    policy: the trainer's policy; the worker generates through a copy with a backend
      of its own (:meth:`~jaxrl_llm.rollout.RolloutBackend.replica`: backends are not
      shared between threads).
    max_staleness: K >= 0, the most versions a trained batch may lag.
    first_step: the first step the worker generates for (``start + 1``).
    last_step: the last step.
    seed: the run's seed (prompts and keys of step ``s`` from ``(seed, s)``).
    devices: the rollout device set: the worker generates on them through a
      :class:`~jaxrl_llm.rollout.ReplicatedEngine` (one replica each: the policy's
      backend must be a :class:`~jaxrl_llm.rollout.RolloutEngine`); None: on the
      trainer's devices.
  """

  def __init__(self, resolved: Resolved, task: Task, policy: Policy, *,
               max_staleness: int, first_step: int, last_step: int, seed: int,
               devices: Sequence[jax.Device] | None = None) -> None:
    if not isinstance(max_staleness, int) or max_staleness < 0:
      raise ValueError(f"`max_staleness` must be an int >= 0, got {max_staleness!r}.")
    self.resolved, self.task, self.k = resolved, task, max_staleness
    self.policy = policy.with_backend(_worker_backend(policy.backend, devices))
    self.first_step, self.last_step, self.seed = first_step, last_step, seed
    self._cond = threading.Condition()
    self._params: Any = None
    self._version = -1
    self._ready: dict[int, tuple] = {}
    self._stop = False
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._work, name="rollout-worker", daemon=True)
    self._started = False

  def publish(self, params: Any, version: int) -> None:
    """Hands the worker a copy of ``params`` (the weights after ``version`` train
    steps); starts the worker on the first call."""
    params = jax.tree.map(jnp.copy, params)
    with self._cond:
      self._params, self._version = params, version
      self._cond.notify_all()
    if not self._started:
      self._started = True
      self._thread.start()

  def take(self, step: int) -> tuple[dict, list, dict]:
    """``(rows, problems, stats)`` of ``step``'s batch (waits for it)."""
    start = time.perf_counter()
    with self._cond:
      self._cond.wait_for(lambda: step in self._ready or self._error is not None)
      if self._error is not None:
        raise RuntimeError(f"the rollout worker failed: {self._error!r}") from self._error
      version, rows, problems, generate_s, sampler_wait_s = self._ready.pop(step)
      self._cond.notify_all()
    lag = float(step - 1 - version)
    stats = {"staleness_mean": lag, "staleness_max": lag,
             "trainer_wait_s": time.perf_counter() - start,
             "sampler_wait_s": sampler_wait_s, "generate_s": generate_s}
    return rows, problems, stats

  def close(self) -> None:
    """Stops the worker (after its current generation) and waits for it."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    if self._started:
      self._thread.join()

  def _fresh_enough(self, oldest: int) -> bool:
    return self._stop or self._version >= oldest

  def _work(self) -> None:
    resolved = self.resolved
    base_key = jax.random.PRNGKey(self.seed)
    try:
      for step in range(self.first_step, self.last_step + 1):
        start = time.perf_counter()
        oldest = step - 1 - self.k             # the oldest version step may train on
        with self._cond:
          self._cond.wait_for(functools.partial(self._fresh_enough, oldest))
          if self._stop:
            return
          params, version = self._params, self._version
        waited = time.perf_counter() - start
        rng_np = np.random.default_rng([self.seed, step])
        start = time.perf_counter()
        rows, problems = _rollout(resolved.sampling, self.task, self.policy, params,
                                  rng_np, jax.random.fold_in(base_key, step),
                                  resolved.train, resolved.sampling.prompts_per_step)
        generate_s = time.perf_counter() - start
        with self._cond:
          self._ready[step] = (version, rows, problems, generate_s, waited)
          self._cond.notify_all()
    except BaseException as e:  # noqa: BLE001 - handed to the trainer's take()
      with self._cond:
        self._error = e
        self._cond.notify_all()


def _worker_backend(backend: RolloutBackend,
                    devices: Sequence[jax.Device] | None) -> RolloutBackend:
  """The rollout worker's own backend: ``backend``'s replica, or engine replicas on
  ``devices`` (:class:`~jaxrl_llm.rollout.ReplicatedEngine`)."""
  if devices is None:
    return backend.replica()
  if not isinstance(backend, RolloutEngine):
    raise ValueError("rollout `devices` need the rollout engine (--rollout engine), got "
                     f"the backend {type(backend).__name__}.")
  return ReplicatedEngine(backend, devices)


__all__ = ["AsyncRollouts"]
