"""The progress line of a training run (stderr)."""

from __future__ import annotations

import sys
import time

from jaxrl_llm.loop.config import RunConfig


def report_progress(run: RunConfig, step: int, row: dict, start_time: float,
                    start_step: int) -> None:
  """Writes a progress bar (a TTY) or one line per eval interval (a log) to stderr."""
  if not run.progress:
    return
  done = step - start_step
  rate = done / max(time.time() - start_time, 1e-9)
  width = 24
  filled = int(width * step / run.steps)
  bar = "#" * filled + "-" * (width - filled)
  eta = (run.steps - step) / max(rate, 1e-9)
  msg = (f"\r[{bar}] {step}/{run.steps} reward {row['reward']:.3f} "
         f"acc {row['accuracy']:.3f} kl {row.get('kl_ref', 0.0):+.4f} "
         f"{rate:.2f} it/s eta {eta:4.0f}s")
  stream = sys.stderr
  if stream.isatty():
    stream.write(msg)
    stream.flush()
  elif step == run.steps or step % max(run.eval_every, 1) == 0:
    stream.write(msg.lstrip("\r") + "\n")


__all__ = ["report_progress"]
