"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``metrics.jsonl`` stays the run's record (:class:`~jaxrl_llm.run_folder.MetricsWriter`:
appended and fsynced every step, trimmed on resume); a :class:`MetricSink` is any other
place the same rows go. Two come with the library, each through its own package:

* :class:`TensorBoardSink` (``--tensorboard``): event files in ``RUN/tensorboard/``
  written with ``tensorboardX`` (``pip install 'jaxrl_llm[tensorboard]'``; the lighter
  writer: ``tensorboardX`` needs only ``numpy`` and ``protobuf``, ``tensorboard`` itself
  brings a web server and ``grpcio``). ``tensorboard --logdir runs/`` reads them.
* :class:`WandbSink` (``--wandb-project P``): a W&B run (``pip install wandb``);
  ``WANDB_MODE=offline`` writes it under ``RUN/wandb/`` without a network (``wandb
  sync`` uploads it later). Its id is kept in ``RUN/wandb_run_id``, so ``--resume``
  continues the same W&B run.

TensorBoard is off unless asked for: a run's outputs should not depend on which packages
happen to be installed (the same command gives the same run folder everywhere), and
``metrics.jsonl`` with ``jaxrl-llm plot`` already covers the default job.

Never blocking the train step: :class:`BackgroundSinks` hands every row to a daemon
thread through an unbounded queue (``put`` never waits), and that thread calls the
sinks; ``close`` drains the queue (at most ``timeout`` seconds). A sink that raises
(disk full, a bad project name, no network) gives one warning line and is dropped; the
run goes on and nothing is lost in ``metrics.jsonl``. Only finite numbers are logged
(strings and NaN are skipped).
"""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol


class MetricSink(Protocol):
  """A place metrics rows go: ``write(step, scalars)`` per row, ``close()`` at the end."""

  name: str

  def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

  def close(self) -> None: ...


def scalars_of(row: Mapping[str, Any]) -> dict[str, float]:
  """The finite numbers of a metrics row (``step`` and non-numbers left out).

  Examples:
    >>> scalars_of({"step": 3, "reward": 0.5, "note": "x", "kl": float("nan"), "ok": True})
    {'reward': 0.5, 'ok': 1.0}
  """
  out = {}
  for key, value in row.items():
    if key == "step" or not isinstance(value, (int, float)):
      continue
    value = float(value)
    if math.isfinite(value):
      out[key] = value
  return out


def _require(module: str, extra: str) -> Any:
  try:
    return __import__(module)
  except ImportError:
    raise ImportError(f"{extra} needs the package {module!r}, which is not installed: "
                      f"pip install {module}") from None


class TensorBoardSink:
  """Scalars into TensorBoard event files in ``logdir`` (``tensorboardX``).

  Examples:
    >>> import tempfile
    >>> sink = TensorBoardSink(tempfile.mkdtemp())    # doctest: +SKIP
    >>> sink.write(1, {"reward": 0.5}); sink.close()  # doctest: +SKIP
  """

  name = "tensorboard"

  def __init__(self, logdir: str) -> None:
    _own_folder(logdir)
    tensorboardx = _require("tensorboardX", "--tensorboard")
    self.logdir = logdir
    self._writer = tensorboardx.SummaryWriter(logdir=logdir)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    for key, value in scalars.items():
      self._writer.add_scalar(key, value, global_step=step)

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()


WANDB_ID_FILE = "wandb_run_id"


class WandbSink:
  """Rows into a W&B run of ``project`` (files under ``run_dir/wandb``).

  ``WANDB_MODE=offline`` needs no network. The run id is kept in
  ``run_dir/wandb_run_id``, so a resumed training run continues its W&B run.
  """

  name = "wandb"

  def __init__(self, project: str, run_dir: str, config: Mapping[str, Any] | None = None
               ) -> None:
    _own_folder(os.path.join(run_dir, "wandb"))
    wandb = _require("wandb", "--wandb-project")
    from jaxrl_llm import run_folder as rf
    id_file = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.isfile(id_file) and not os.path.islink(id_file):
      with open(id_file, encoding="utf-8") as f:
        run_id = f.read().strip()
    else:              # a new run (a link there, not the run's own file, is replaced)
      run_id = uuid.uuid4().hex[:12]
      rf.atomic_write_text(id_file, run_id + "\n")
    self._run = wandb.init(project=project, dir=run_dir, id=run_id, resume="allow",
                           name=os.path.basename(os.path.normpath(run_dir)),
                           config=dict(config or {}))

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self._run.log(dict(scalars), step=step)

  def close(self) -> None:
    self._run.finish()


def _own_folder(path: str) -> None:
  """Refuses a sink's folder in the run folder that is a symbolic link (its writer
  would write through it, outside the run folder): ``ValueError``, the sink does not
  start."""
  if os.path.islink(path):
    raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}); a run "
                     "folder's files are written by the run alone: remove the link")


class BackgroundSinks:
  """Calls ``sinks`` on a daemon thread: :meth:`write` only queues the row.

  A sink that raises gives one line on ``warn`` and gets no more rows.

  Examples:
    >>> class Mem:
    ...   name, rows = "mem", []
    ...   def write(self, step, scalars): self.rows.append((step, dict(scalars)))
    ...   def close(self): pass
    >>> sinks = BackgroundSinks([Mem()])
    >>> sinks.write({"step": 1, "reward": 0.5, "note": "skipped"})
    >>> sinks.close(); Mem.rows
    [(1, {'reward': 0.5})]
  """

  def __init__(self, sinks: Sequence[MetricSink],
               warn: Callable[[str], None] | None = None) -> None:
    self.sinks = list(sinks)
    self._warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._drain, name="metric-sinks", daemon=True)
    self._thread.start()

  def _fail(self, sink: MetricSink, what: str, error: BaseException) -> None:
    self._warn(f"warning: the {sink.name} metrics sink failed ({what}: "
               f"{type(error).__name__}: {error}); the run goes on without it "
               "(metrics.jsonl has every row)")

  def _drain(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        break
      step, scalars = item
      for sink in list(self.sinks):
        try:
          sink.write(step, scalars)
        except Exception as e:  # noqa: BLE001 - any failure of a sink is reported once
          self.sinks.remove(sink)
          self._fail(sink, f"writing step {step}", e)
    for sink in self.sinks:
      try:
        sink.close()
      except Exception as e:  # noqa: BLE001
        self._fail(sink, "closing", e)

  def write(self, row: Mapping[str, Any]) -> None:
    """Queues a metrics row (its ``step`` and :func:`scalars_of`); never waits."""
    if self.sinks:
      self._queue.put((int(row["step"]), scalars_of(row)))

  def close(self, timeout: float = 60.0) -> None:
    """Writes what is queued, closes the sinks (waits at most ``timeout`` seconds)."""
    self._queue.put(None)
    self._thread.join(timeout)


def make_sinks(run: Any, warn: Callable[[str], None] | None = None) -> BackgroundSinks:
  """The run's sinks (``run.tensorboard``, ``run.wandb_project``) behind a
  :class:`BackgroundSinks`. A sink that cannot start (its package missing, a bad
  project) gives one warning line and is left out."""
  import dataclasses
  say = warn or (lambda message: print(message, file=sys.stderr, flush=True))
  starters: list[tuple[str, Callable[[], MetricSink]]] = []
  if run.tensorboard:
    starters.append(("tensorboard", lambda: TensorBoardSink(
        os.path.join(run.out, "tensorboard"))))
  if run.wandb_project:
    starters.append(("wandb", lambda: WandbSink(run.wandb_project, run.out,
                                                dataclasses.asdict(run))))
  sinks: list[MetricSink] = []
  for name, start in starters:
    try:
      sinks.append(start())
    except Exception as e:  # noqa: BLE001 - a sink is never worth the run
      say(f"warning: the {name} metrics sink did not start ({type(e).__name__}: {e}); "
          "the run goes on without it (metrics.jsonl has every row)")
  return BackgroundSinks(sinks, warn=say)


__all__ = ["BackgroundSinks", "MetricSink", "TensorBoardSink", "WANDB_ID_FILE", "WandbSink",
           "make_sinks", "scalars_of"]
