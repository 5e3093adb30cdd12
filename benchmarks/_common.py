"""Shared helpers for the benchmark scripts: timing, machine description, output."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time

import jax


def timeit(fn, *args, repeats=5, warmup=1, min_time=0.0):
  """Median wall time (s) of ``fn(*args)``, blocking on JAX results."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  start = time.perf_counter()
  while len(times) < repeats or time.perf_counter() - start < min_time:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def machine() -> str:
  dev = jax.devices()[0]
  return (f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}, "
          f"jax {jax.__version__} on {dev.platform} ({dev.device_kind})")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    cells = []
    for c in columns:
      val = row.get(c, "")
      cells.append(f"{val:.4g}" if isinstance(val, float) else str(val))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
  if path:
    with open(path, "w") as f:
      json.dump(payload, f, indent=2)
