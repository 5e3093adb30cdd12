"""Forced host (CPU) device counts for test worker processes.

Workers import this before ``jax`` (the flag is read once, at backend start-up):
``force_host_devices(8)`` rewrites ``os.environ["XLA_FLAGS"]``; tests that start a
subprocess put ``xla_flags_with_devices(...)`` in its environment.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_devices(flags: str, devices: int) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with the host device count set to ``devices``:
  the caller's other flags are kept, any earlier device count is replaced.

  >>> xla_flags_with_devices("--xla_a=1 --xla_force_host_platform_device_count=8", 2)
  '--xla_a=1 --xla_force_host_platform_device_count=2'
  """
  kept = [f for f in flags.split() if not f.startswith(_FLAG)]
  return " ".join([*kept, f"{_FLAG}={devices}"])


def force_host_devices(devices: int) -> None:
  """Sets this process's ``XLA_FLAGS`` to force ``devices`` CPU devices (call it before
  importing ``jax``)."""
  os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)
