"""Where a run's time and memory go: per-phase seconds, compile seconds, peak RSS.

Every ``metrics.jsonl`` row of :func:`jaxrl_llm.loop.run.run_training` carries

* ``step_s``: the wall time since the previous row was written (the first step: since
  row 0), so the ``step_s`` of a run's rows add up to its loop's wall time;
* the phases of that time, :data:`PHASES` (0 for a phase the step did not run):
  ``generate_s`` (sampling the completions, greedy ones of self-critical included),
  ``score_s`` (decoding, the task's rewards, dynamic sampling's bookkeeping, the
  advantages, packing: the host's work between generation and the forwards),
  ``old_logp_s`` (the behaviour policy's forward), ``ref_s`` (the reference's forward),
  ``update_s`` (the train step), ``eval_s`` (greedy evaluation), ``save_s`` (the
  checkpoint written since the previous row: a step's checkpoint is saved after its
  row is fsynced, so that a resumed run never lacks a row, and its seconds land in
  the next row), ``log_s`` (writing the previous row: ``metrics.jsonl`` with its
  fsync, the sinks' queue, the progress line). What is left, ``step_s -
  sum(PHASES)``, is the loop's own bookkeeping (drawing keys, reading the metrics off
  the device, the learning-signal watch);
* ``compile_s``: seconds JAX spent tracing, lowering and compiling (or fetching from
  the persistent compilation cache) in that interval, every function included;
  ``compile_cache_hits``: the compiles the persistent cache served; ``compiles``
  (only on a row where something compiled): ``{function: seconds}`` of the functions
  that took at least :data:`MIN_LISTED_COMPILE_S`, and ``others (N)``, the sum of the
  N quicker ones (mostly eager operations);
* ``peak_rss_mb``: the process's peak resident memory so far (``getrusage``).

Row 0 (the evaluation before training) carries ``setup_s`` (building the task, the
model, the train state; restoring) and ``eval_s``, whose sum is its ``step_s``.

A phase that ends in device work waits for it (``jax.block_until_ready``) before its
clock stops, so the seconds are the phase's own and not the next one's; waiting
changes no value. With ``--async``, ``generate_s`` is the rollout thread's generation
(overlapped with training; the trainer's wait is ``trainer_wait_s``); with
``--partial-rollouts`` it is the trainer's time in the engine.

Compile seconds come from :mod:`jax.monitoring` (the events JAX records around its
tracing, lowering and backend compilation of every jitted program) rather than from
timing ``jax.jit(f).lower(...).compile()`` of chosen functions: the listener sees
every program a run compiles (the engine's prefill and decode shapes, the sampler,
the forwards, the train step and each packed shape of it, evaluation, eager ops, the
async rollout thread's) without changing how any of them is called, so it cannot
change a result or a cache key, and a persistent-cache hit shows as its (short)
retrieval time.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

# The phases of a step's wall time (``step_s``), in the order a step runs them.
PHASES = ("generate_s", "score_s", "old_logp_s", "ref_s", "update_s", "eval_s", "save_s",
          "log_s")
# Columns that measure time, memory or the compile cache: they differ between two runs
# of the same config (every other column is a function of the config and the seed).
MEASURED_COLUMNS = PHASES + (
    "step_s", "time_s", "setup_s", "compile_s", "compile_cache_hits", "compiles",
    "peak_rss_mb", "trainer_wait_s", "sampler_wait_s", "vllm_push_s")

# ``compiles`` names the functions that took at least this long (the rest are summed).
MIN_LISTED_COMPILE_S = 0.05

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def comparable(row: Mapping[str, Any]) -> dict:
  """``row`` without its :data:`MEASURED_COLUMNS` (what must be bit-identical between
  two runs of one config).

  Examples:
    >>> comparable({"step": 1, "loss": 0.5, "step_s": 1.2, "generate_s": 0.3})
    {'step': 1, 'loss': 0.5}
  """
  return {k: v for k, v in row.items() if k not in MEASURED_COLUMNS}


def peak_rss_mb() -> float:
  """This process's peak resident set size so far, in MiB (``ru_maxrss``: KiB on
  Linux, bytes on macOS)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak / (2 ** 20 if sys.platform == "darwin" else 1024)


def _function_name(name: str) -> str:
  """A jitted program's name as JAX's events give it, without the ``jit(...)`` of its
  module: the tracer's ``train_step`` and the compiler's ``jit(train_step)`` are one.

  Examples:
    >>> _function_name("jit(train_step)"), _function_name("jit_step"), _function_name("add")
    ('train_step', 'step', 'add')
  """
  if name.startswith("jit(") and name.endswith(")"):
    return name[4:-1]
  return name.removeprefix("jit_")


class CompileLog:
  """Seconds JAX spends compiling, by function, between :meth:`take` calls.

  A :mod:`jax.monitoring` listener (installed by :meth:`start`, removed by
  :meth:`stop`) adds the duration of every tracing, lowering and backend-compile
  event to its function's total, and counts persistent-cache hits. Thread-safe: the
  async rollout thread compiles too. ``min_listed_s``: the functions quicker than this
  are summed in ``compiles`` as ``others (N)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> log = CompileLog(min_listed_s=0.0).start()
    >>> def cube(x):
    ...   return x ** 3
    >>> _ = jax.jit(cube)(jnp.float32(2.0))
    >>> seen = log.take()
    >>> log.stop()
    >>> seen["compile_s"] > 0, "cube" in seen["compiles"]
    (True, True)
  """

  def __init__(self, *, min_listed_s: float = MIN_LISTED_COMPILE_S) -> None:
    self.min_listed_s = min_listed_s
    self._lock = threading.Lock()
    self._seconds: dict[str, float] = {}
    self._hits = 0
    self._started = False

  def _on_duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event in (_TRACE_EVENT, _LOWER_EVENT, _BACKEND_EVENT):
      name = _function_name(str(kwargs.get("fun_name", "?")))
      with self._lock:
        self._seconds[name] = self._seconds.get(name, 0.0) + float(duration_secs)

  def _on_event(self, event: str, **kwargs: str | int) -> None:
    if event == _CACHE_HIT_EVENT:
      with self._lock:
        self._hits += 1

  def start(self) -> CompileLog:
    """Installs the listeners; returns ``self``."""
    import jax.monitoring
    if not self._started:
      jax.monitoring.register_event_duration_secs_listener(self._on_duration)
      jax.monitoring.register_event_listener(self._on_event)
      self._started = True
    return self

  def stop(self) -> None:
    """Removes the listeners (a JAX without the unregister calls keeps them, idle)."""
    if not self._started:
      return
    import jax.monitoring
    self._started = False
    for unregister, callback in (
        ("unregister_event_duration_listener", self._on_duration),
        ("unregister_event_listener", self._on_event)):
      with contextlib.suppress(AttributeError, AssertionError, ValueError):
        getattr(jax.monitoring, unregister)(callback)
    self._seconds.clear()

  def take(self) -> dict[str, Any]:
    """``{"compile_s", "compile_cache_hits"}`` since the last call, and ``compiles``
    (``{function: seconds}``) when something compiled; resets the counts."""
    with self._lock:
      seconds, hits = self._seconds, self._hits
      self._seconds, self._hits = {}, 0
    out: dict[str, Any] = {"compile_s": sum(seconds.values()),
                           "compile_cache_hits": float(hits)}
    named = {k: round(v, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
             if v >= self.min_listed_s}
    rest = [v for k, v in seconds.items() if k not in named]
    if rest:          # many eager ops of a few ms each
      named[f"others ({len(rest)})"] = round(sum(rest), 3)
    if seconds:
      out["compiles"] = named
    return out


class PhaseClock:
  """Accumulates wall seconds by phase: ``with clock("update_s"): ...``.

  Examples:
    >>> clock = PhaseClock()
    >>> with clock("score_s"):
    ...   pass
    >>> sorted(clock.take()), clock.take()
    (['score_s'], {})
  """

  def __init__(self) -> None:
    self._seconds: dict[str, float] = {}

  def __call__(self, phase: str) -> _Timed:
    return _Timed(self, phase)

  def add(self, phase: str, seconds: float) -> None:
    self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

  def take(self) -> dict[str, float]:
    """The seconds by phase since the last call (then reset)."""
    out, self._seconds = self._seconds, {}
    return out


class _Timed:
  def __init__(self, clock: PhaseClock, phase: str) -> None:
    self._clock, self._phase = clock, phase

  def __enter__(self) -> None:
    self._start = time.perf_counter()

  def __exit__(self, *exc: object) -> None:
    self._clock.add(self._phase, time.perf_counter() - self._start)


def phase_summary(rows: Iterable[Mapping[str, Any]], *, final_save_s: float = 0.0
                  ) -> dict[str, Any]:
  """The run summary's time and memory lines from its step rows (``step >= 1``).

  ``phase_split_s``: mean seconds per step by phase over the steps after the first
  (all steps when there is only one; the first compiles), ``other`` the rest of
  ``step_s``; ``first_step_s`` and ``first_step_compile_s``: the first step's;
  ``peak_rss_mb``: the last row's. ``final_save_s``: the checkpoint after the last
  row (in no row), added to the last step's ``save_s``.

  Examples:
    >>> rows = [{"step": 1, "step_s": 3.0, "generate_s": 1.0, "update_s": 1.5,
    ...          "compile_s": 2.0, "peak_rss_mb": 500.0},
    ...         {"step": 2, "step_s": 1.0, "generate_s": 0.5, "update_s": 0.25,
    ...          "compile_s": 0.0, "peak_rss_mb": 510.0}]
    >>> s = phase_summary(rows)
    >>> s["phase_split_s"]
    'generate 0.500, update 0.250, other 0.250 (step 1.000)'
    >>> s["first_step_s"], s["first_step_compile_s"], s["peak_rss_mb"]
    (3.0, 2.0, 510.0)
  """
  steps = [dict(r) for r in rows if r.get("step", 0) >= 1 and "step_s" in r]
  if not steps:
    return {}
  steps[-1]["save_s"] = steps[-1].get("save_s", 0.0) + final_save_s
  steps[-1]["step_s"] = steps[-1]["step_s"] + final_save_s
  warm = steps[1:] or steps

  def mean(key: str) -> float:
    return float(sum(r.get(key, 0.0) for r in warm) / len(warm))

  parts = [(p.removesuffix("_s"), mean(p)) for p in PHASES]
  step = mean("step_s")
  parts.append(("other", step - sum(v for _, v in parts)))
  split = ", ".join(f"{name} {v:.3f}" for name, v in parts if v != 0.0)
  out: dict[str, Any] = {"phase_split_s": f"{split} (step {step:.3f})",
                         "first_step_s": round(steps[0]["step_s"], 3),
                         "first_step_compile_s": round(steps[0].get("compile_s", math.nan), 3)}
  if "peak_rss_mb" in steps[-1]:
    out["peak_rss_mb"] = round(steps[-1]["peak_rss_mb"], 1)
  return out


__all__ = ["CompileLog", "MEASURED_COLUMNS", "PHASES", "PhaseClock", "comparable",
           "peak_rss_mb", "phase_summary"]
