r"""Data-parallel generation: one :class:`~jaxrl_llm.rollout.RolloutEngine` replica per
device of a rollout device set.

:class:`ReplicatedEngine` has the engine's ``generate(params, requests, seed)``: it cuts
the request list into contiguous parts, one per device (sizes differ by at most one
request), and each replica generates its part on its device in a thread of its own,
with a copy of ``params`` put there (device to device: never through the host's disk).
Part ``d`` starts at request :math:`a_d` and is generated with
``first_request`` :math:`= a_d`, so every sample's draws are keyed by its index in the
whole list, as on one engine; the completions come back renumbered to that index and
ordered by ``(request, sample)``. Each replica keeps the slot count of the engine it copies, and
at one slot count the engine's rows never mix (bitwise the same alone or among
others), so the tokens and log-probs equal those of the single engine bit for bit
(tested). What this gives the asynchronous loop is its own devices for generation
(``--rollout-devices N``: :mod:`jaxrl_llm.loop.async_rollout`), the trainer's mesh on
the others.

Not supported here: partial rollouts (``token_budget``), whose in-flight samples live
in one engine's slots; a replica sharded over several devices (tensor-parallel
generation: one replica per device only).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax

from jaxrl_llm.rollout.backend import draw_seed
from jaxrl_llm.rollout.engine import Completion, Request, RolloutEngine


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
  """``parts`` contiguous ``(start, stop)`` ranges covering ``range(count)``, sizes
  differing by at most one (the first ones larger).

  >>> split_evenly(7, 3)
  [(0, 3), (3, 5), (5, 7)]
  >>> split_evenly(1, 2)
  [(0, 1), (1, 1)]
  """
  if not isinstance(parts, int) or parts < 1:
    raise ValueError(f"`parts` must be an int >= 1, got {parts!r}.")
  base, extra = divmod(count, parts)
  bounds, start = [], 0
  for d in range(parts):
    stop = start + base + (d < extra)
    bounds.append((start, stop))
    start = stop
  return bounds


class ReplicatedEngine:
  """Replicas of ``engine`` (its settings: :meth:`RolloutEngine.replica`), one per
  device of ``devices``, generating contiguous parts of each request list in parallel;
  a :class:`~jaxrl_llm.rollout.backend.RolloutBackend` as the engine is.

  Args:
    engine: the engine whose settings every replica takes (it is not used itself).
    devices: the rollout devices (distinct; at least one).

  Raises:
    ValueError: ``devices`` empty or with a repeated device.

  Examples:
    >>> import jax
    >>> from flax import nnx
    >>> from jaxrl_llm.models import (Transformer, TransformerConfig,
    ...                               make_paged_decode_fns, split_model)
    >>> graphdef, params = split_model(
    ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> one = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=2, max_len=16)
    >>> both = ReplicatedEngine(one, jax.devices()[:1])
    >>> requests = [Request([1, 2], n=2, max_new_tokens=4), Request([3], max_new_tokens=2)]
    >>> out = both.generate(params, requests, seed=3)
    >>> [(c.request, c.sample) for c in out]
    [(0, 0), (0, 1), (1, 0)]
    >>> all((a.tokens == b.tokens).all()
    ...     for a, b in zip(out, one.generate(params, requests, seed=3)))
    True
  """

  def __init__(self, engine: RolloutEngine, devices: Sequence[jax.Device]) -> None:
    devices = list(devices)
    if not devices or len(set(devices)) != len(devices):
      raise ValueError(f"`devices` must be distinct devices (at least one), got {devices!r}.")
    self.devices = devices
    self.replicas = [engine.replica() for _ in devices]
    self.max_slots, self.max_len = engine.max_slots, engine.max_len
    self.page_size = engine.page_size
    self.stats: dict[str, Any] = {}     # the last generate call's, merged

  # -- the rollout-backend protocol ------------------------------------------------

  takes_policy_part = False

  def take_stats(self) -> dict[str, float]:
    """``{}``: no step metrics (the last call's merged counters: the :attr:`stats`
    dict)."""
    return {}

  def seed_from_key(self, key: jax.Array) -> int:
    """:func:`~jaxrl_llm.rollout.backend.draw_seed`, as one engine's."""
    return draw_seed(key)

  def replica(self) -> ReplicatedEngine:
    """New replicas of the same settings on the same devices (none of this one's
    state)."""
    return ReplicatedEngine(self.replicas[0], self.devices)

  def generate(self, params: Any, requests: Sequence[Request], seed: int = 0, *,
               version: int = 0, first_request: int = 0) -> list[Completion]:
    """The completions of ``requests`` (``n`` each) ordered by ``(request, sample)``,
    as :meth:`RolloutEngine.generate` on one engine returns them (``first_request``
    as there: this call's share of a larger batch). ``self.stats`` holds
    the replicas' counters summed, ``slot_utilisation`` their mean, ``total_s`` the
    slowest replica's and ``replicas`` their number."""
    requests = list(requests)
    parts = split_evenly(len(requests), len(self.devices))
    results: list[list[Completion] | None] = [None] * len(parts)
    errors: list[BaseException] = []

    def work(d: int) -> None:
      start, stop = parts[d]
      try:
        with jax.default_device(self.devices[d]):     # thread-local: this thread only
          local = jax.device_put(params, self.devices[d])
          part = self.replicas[d].generate(local, requests[start:stop], seed,
                                           version=version,
                                           first_request=first_request + start)
          results[d] = [dataclasses.replace(c, request=start + c.request) for c in part]
      except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
        errors.append(e)

    threads = [threading.Thread(target=work, args=(d,), name=f"rollout-replica-{d}")
               for d, (start, stop) in enumerate(parts) if stop > start]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if errors:
      raise errors[0]
    out = [c for part in results if part is not None for c in part]
    self.stats = self._merged_stats([r.stats for r, (a, b)
                                          in zip(self.replicas, parts) if b > a])
    return sorted(out, key=lambda c: (c.request, c.sample))

  def _merged_stats(self, stats: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"replicas": len(self.devices)}
    for name in sorted({k for s in stats for k in s}):
      values = [s[name] for s in stats if name in s]
      if name == "total_s":
        merged[name] = max(values)
      elif name == "slot_utilisation":
        merged[name] = sum(values) / len(values)
      else:
        merged[name] = sum(values)
    return merged


__all__ = ["ReplicatedEngine", "split_evenly"]
