"""Where a step's completions come from: one :class:`Rollouts` over the three modes.

* :class:`InStep` (the default): nothing is drawn ahead; :func:`~jaxrl_llm.loop.batch.
  build_batch` generates the step's samples itself with the current parameters.
* :class:`Partial` (``--partial-rollouts``): groups stay in flight across steps
  (:class:`~jaxrl_llm.loop.partial.PartialRollouts`).
* :class:`Async` (``--async``): a rollout thread at most ``max_staleness`` versions
  ahead of the trainer (:class:`~jaxrl_llm.loop.async_rollout.AsyncRollouts`).

Each answers ``take(step, params, rng_np, key) -> (drawn, stats)``: ``drawn`` is the
step's ``(rows, problems)`` (None: draw them in the step) and ``stats`` the mode's own
columns; ``publish(params, step)`` hands the weights after ``step`` updates to a mode
that generates apart from the step, and ``close()`` stops it.

Examples:
  >>> rollouts = InStep()
  >>> rollouts.take(1, None, None, None)
  (None, {})
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

Drawn = tuple[dict, list]


class Rollouts(Protocol):
  """The source of a step's completions (module doc)."""

  def take(self, step: int, params: Any, rng_np: np.random.Generator,
           key: jax.Array) -> tuple[Drawn | None, dict]: ...

  def publish(self, params: Any, step: int) -> None: ...

  def close(self) -> None: ...


class InStep:
  """Synchronous rollouts: the step draws its own samples (nothing ahead)."""

  def take(self, step: int, params: Any, rng_np: np.random.Generator | None,
           key: jax.Array | None) -> tuple[Drawn | None, dict]:
    return None, {}

  def publish(self, params: Any, step: int) -> None:
    pass

  def close(self) -> None:
    pass


class Partial(InStep):
  """Partial rollouts: ``take`` continues the groups in flight under ``params`` (the
  weights after ``step - 1`` updates: the sampling version of the new tokens)."""

  def __init__(self, buffer: Any) -> None:
    self.buffer = buffer          # a jaxrl_llm.loop.partial.PartialRollouts

  def take(self, step: int, params: Any, rng_np: np.random.Generator | None,
           key: jax.Array | None) -> tuple[Drawn | None, dict]:
    rows, problems, stats = self.buffer.rollout(params, step - 1, rng_np, key)
    return (rows, problems), stats


class Async(InStep):
  """Asynchronous rollouts: ``take`` waits for the worker's batch of ``step``;
  ``publish`` hands it new weights."""

  def __init__(self, worker: Any) -> None:
    self.worker = worker          # a jaxrl_llm.loop.async_rollout.AsyncRollouts

  def take(self, step: int, params: Any, rng_np: np.random.Generator | None,
           key: jax.Array | None) -> tuple[Drawn | None, dict]:
    rows, problems, stats = self.worker.take(step)
    return (rows, problems), stats

  def publish(self, params: Any, step: int) -> None:
    self.worker.publish(params, step)

  def close(self) -> None:
    self.worker.close()


__all__ = ["Async", "Drawn", "InStep", "Partial", "Rollouts"]
