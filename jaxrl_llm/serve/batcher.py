"""Concurrent requests gathered into one backend call.

Agents call the endpoint from many threads; each request's prompts go to a queue, and
one worker thread takes the first waiting request, then keeps taking requests until
``max_batch`` requests are gathered or ``max_wait`` seconds have passed since the first
was taken, and calls the backend ONCE with all their prompts (a request of ``n``
choices is ``n`` prompts). While the backend runs, new requests queue for the next
call. So N agents that call at about the same time cost one batched call per round,
not N, and the backend (which is not thread-safe) is only ever called from the worker.

The backend is a :data:`~jaxrl_llm.rollout.multiturn.Generate`,
``generate(prompts, max_new_tokens) -> [(sampled_ids, sampled_logprobs), ...]``; one
that also takes ``sampling=`` (one mapping of ``Request`` fields per prompt, as
:func:`~jaxrl_llm.rollout.multiturn.engine_generate`'s does) gets each request's
``temperature`` / ``top_p``. A backend exception, or an answer that is not one pair per
prompt of 1 to ``max_new_tokens`` ids with as many log-probs, fails the requests of
that call (:class:`BackendError`) and the worker goes on with the next.

Examples:
  >>> def generate(prompts, limits):
  ...   return [(p[-1:] * m, [-1.0] * m) for p, m in zip(prompts, limits)]
  >>> with Batcher(generate) as b:
  ...   b.submit([[4, 5]], [3])
  ...   b.stats()["backend_calls"]
  [([5, 5, 5], [-1.0, -1.0, -1.0])]
  1
"""

from __future__ import annotations

import dataclasses
import inspect
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_llm._validate import check_int
from jaxrl_llm.rollout.multiturn import _check_turn

Turn = tuple[list[int], list[float]]


class BackendError(RuntimeError):
  """The backend raised, or answered out of contract, for a request's call."""


def takes_sampling(generate: Callable[..., Any]) -> bool:
  """Whether ``generate`` takes a ``sampling=`` keyword (or ``**kwargs``).

  >>> takes_sampling(lambda prompts, limits: []), takes_sampling(
  ...     lambda prompts, limits, sampling=None: [])
  (False, True)
  """
  try:
    params = inspect.signature(generate).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == "sampling" or p.kind is p.VAR_KEYWORD for p in params)


@dataclasses.dataclass(eq=False)
class _Job:
  prompts: list[list[int]]
  limits: list[int]
  sampling: list[dict[str, Any]]
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: list[Turn] | None = None
  error: BaseException | None = None


_STOP = object()


class Batcher:
  """A worker thread that batches requests into backend calls (the module docstring).

  Args:
    generate: the backend (:data:`~jaxrl_llm.rollout.multiturn.Generate`).
    max_wait: the most seconds the first request of a call waits for others (>= 0).
    max_batch: the most requests in one call (>= 1).
  """

  def __init__(self, generate: Callable[..., Any], *, max_wait: float = 0.005,
               max_batch: int = 64) -> None:
    if not callable(generate):
      raise ValueError("`generate` must be callable: generate(prompts, max_new_tokens).")
    if not isinstance(max_wait, (int, float)) or not max_wait >= 0:
      raise ValueError(f"`max_wait` must be a number of seconds >= 0, got {max_wait!r}.")
    self.generate = generate
    self.max_wait, self.max_batch = float(max_wait), check_int("max_batch", max_batch)
    self.sampling = takes_sampling(generate)
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._closed = False
    self._stats = {"backend_calls": 0, "requests": 0, "prompts": 0, "largest_batch": 0,
                   "backend_errors": 0}
    self._thread = threading.Thread(target=self._work, name="jaxrl-llm-batcher",
                                    daemon=True)
    self._thread.start()

  def stats(self) -> dict[str, int]:
    """``backend_calls``, ``requests`` and ``prompts`` sent, ``largest_batch`` (most
    requests in one call), ``backend_errors`` (calls that failed)."""
    with self._lock:
      return dict(self._stats)

  def submit(self, prompts: Sequence[Sequence[int]], limits: Sequence[int],
             sampling: Sequence[Mapping[str, Any]] | None = None) -> list[Turn]:
    """Generates ``prompts`` (``limits``: each one's most new tokens; ``sampling``: each
    one's overrides) in the next backend call; blocks until it is done.

    Raises:
      BackendError: the backend failed for this call, or the batcher is closed.
    """
    job = _Job([list(map(int, p)) for p in prompts], [int(m) for m in limits],
               [dict(s) for s in (sampling or [{}] * len(prompts))])
    with self._lock:
      if self._closed:
        raise BackendError("the server is shutting down.")
      self._queue.put(job)
    job.done.wait()
    if job.error is not None:
      raise job.error
    assert job.result is not None
    return job.result

  def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
    jobs, deadline = [first], time.monotonic() + self.max_wait
    while len(jobs) < self.max_batch:
      left = deadline - time.monotonic()
      try:
        job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
      except queue.Empty:
        break
      if job is _STOP:
        return jobs, True
      jobs.append(job)
    return jobs, False

  def _work(self) -> None:
    stop = False
    while not stop:
      first = self._queue.get()
      if first is _STOP:
        break
      jobs, stop = self._gather(first)
      self._run(jobs)
    while True:                      # what came after the stop: refused
      try:
        job = self._queue.get_nowait()
      except queue.Empty:
        break
      if job is not _STOP:
        job.error = BackendError("the server is shutting down.")
        job.done.set()

  def _call(self, jobs: list[_Job]) -> list:
    prompts = [p for j in jobs for p in j.prompts]
    limits = [m for j in jobs for m in j.limits]
    if self.sampling and any(s for j in jobs for s in j.sampling):
      outs = list(self.generate(prompts, limits,
                                sampling=[s for j in jobs for s in j.sampling]))
    else:
      outs = list(self.generate(prompts, limits))
    if len(outs) != len(prompts):
      raise ValueError(f"`generate` returned {len(outs)} completions for {len(prompts)} "
                       "prompts.")
    return outs

  def _run(self, jobs: list[_Job]) -> None:
    with self._lock:
      self._stats["backend_calls"] += 1
      self._stats["requests"] += len(jobs)
      self._stats["prompts"] += sum(len(j.prompts) for j in jobs)
      self._stats["largest_batch"] = max(self._stats["largest_batch"], len(jobs))
    try:
      outs = self._call(jobs)
    except Exception as e:   # noqa: BLE001 - any backend failure fails its requests only
      with self._lock:
        self._stats["backend_errors"] += 1
      for job in jobs:
        job.error = BackendError(f"the backend failed: {type(e).__name__}: {e}")
        job.done.set()
      return
    at = 0
    for job in jobs:
      mine = outs[at:at + len(job.prompts)]
      try:
        job.result = [_check_turn(out, at + k, limit)
                      for k, (out, limit) in enumerate(zip(mine, job.limits))]
      except ValueError as e:
        job.error = BackendError(f"the backend failed: {e}")
      at += len(job.prompts)
      job.done.set()

  def close(self) -> None:
    """Stops the worker after the call in flight; later requests are refused."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._queue.put(_STOP)
    self._thread.join()

  def __enter__(self) -> Batcher:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


__all__ = ["BackendError", "Batcher", "takes_sampling"]
