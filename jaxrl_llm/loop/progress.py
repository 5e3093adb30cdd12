"""The progress line of a training run (stderr)."""

from __future__ import annotations

import sys
import time

from jaxrl_llm.loop.config import RunConfig

# Whether a progress bar without its newline is on the terminal (a TTY bar rewrites its
# line with ``\r``): a message must end it first (:func:`end_progress_line`).
_line_open = False


def end_progress_line() -> None:
  """Ends an open progress bar with a newline, so the next message has a line of its own
  (an interrupt, a warning, the summary); does nothing otherwise."""
  global _line_open
  if _line_open:
    sys.stderr.write("\n")
    sys.stderr.flush()
    _line_open = False


def report_progress(run: RunConfig, step: int, row: dict, start_time: float,
                    start_step: int, *, last_eval: float | None = None) -> None:
  """Writes a progress bar (a TTY) or one line per eval interval (a log) to stderr.

  The rate and the ETA are measured from ``start_time`` at ``start_step``: the end of
  the run's first step, so the compilation it includes does not distort them (the
  first line says ``eta after warm-up``). The bar shows the greedy eval accuracy once one
  is measured (``last_eval``, or the row's own on an eval step).
  """
  global _line_open
  if not run.progress:
    return
  done = step - start_step
  width = 24
  filled = int(width * step / run.steps)
  bar = "#" * filled + "-" * (width - filled)
  if done > 0:
    rate = done / max(time.time() - start_time, 1e-9)
    speed = f"{rate:.2f} it/s eta {(run.steps - step) / max(rate, 1e-9):4.0f}s"
  else:
    speed = "eta after warm-up"
  measured = row.get("eval_accuracy", last_eval)
  ev = f" eval_acc {measured:.3f}" if measured is not None else ""
  msg = (f"\r[{bar}] {step}/{run.steps} reward {row['reward']:.3f} "
         f"acc {row['accuracy']:.3f}{ev} kl {row.get('kl_ref', 0.0):+.4f} {speed}")
  stream = sys.stderr
  if stream.isatty():
    on_eval = "eval_accuracy" in row       # an eval step keeps its line
    stream.write(msg + ("\n" if on_eval else ""))
    stream.flush()
    _line_open = not on_eval
  elif done == 0 or step == run.steps or step % max(run.eval_every, 1) == 0:
    stream.write(msg.lstrip("\r") + "\n")


__all__ = ["end_progress_line", "report_progress"]
