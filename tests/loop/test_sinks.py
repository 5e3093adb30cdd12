"""Metric sinks (jaxrl_llm.loop.sinks): TensorBoard event files read back, a W&B run
(a stand-in module always; the real package offline when installed), failing sinks."""

import glob
import json
import os
import struct
import sys
import types

import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.sinks import BackgroundSinks, TensorBoardSink, WandbSink, make_sinks


def read_events(logdir):
  """``{tag: [(step, value), ...]}`` of the scalar events in ``logdir`` (TFRecord frames:
  length u64, its crc u32, the Event proto, its crc u32)."""
  from tensorboardX.proto import event_pb2
  out: dict = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, round(v.simple_value, 6)))
  return out


ROWS = [{"step": 0, "eval_accuracy": 0.25}, {"step": 1, "reward": 0.5, "loss": -1.5},
        {"step": 2, "reward": 0.75, "loss": float("nan"), "note": "text"}]


def test_tensorboard_events_hold_the_values(tmp_path):
  pytest.importorskip("tensorboardX")
  sinks = BackgroundSinks([TensorBoardSink(str(tmp_path / "tb"))])
  for row in ROWS:
    sinks.write(row)
  sinks.close()
  assert read_events(str(tmp_path / "tb")) == {
      "eval_accuracy": [(0, 0.25)], "reward": [(1, 0.5), (2, 0.75)], "loss": [(1, -1.5)]}
  try:     # tensorboard's own reader too, where it is installed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  except ImportError:
    return
  acc = EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.5), (2, 0.75)]


class _FakeWandb(types.ModuleType):
  """A stand-in for ``wandb``: records init's arguments, the logged rows and finish."""

  def __init__(self):
    super().__init__("wandb")
    self.runs = []

  def init(self, **kwargs):
    run = types.SimpleNamespace(kwargs=kwargs, logged=[], finished=False)
    run.log = lambda data, step: run.logged.append((step, data))
    run.finish = lambda: setattr(run, "finished", True)
    self.runs.append(run)
    return run


def test_wandb_sink_with_a_stand_in_module(tmp_path, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  run = RunConfig(out=str(tmp_path), wandb_project="proj", steps=7)
  sinks = make_sinks(run)
  for row in ROWS:
    sinks.write(row)
  sinks.close()
  (wb,) = fake.runs
  assert wb.kwargs["project"] == "proj" and wb.kwargs["dir"] == str(tmp_path)
  assert wb.kwargs["config"]["steps"] == 7 and wb.kwargs["resume"] == "allow"
  assert wb.logged == [(0, {"eval_accuracy": 0.25}), (1, {"reward": 0.5, "loss": -1.5}),
                       (2, {"reward": 0.75})]
  assert wb.finished
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  assert wb.kwargs["id"] == run_id
  make_sinks(run).close()                      # a resumed run continues the same W&B run
  assert fake.runs[1].kwargs["id"] == run_id


@pytest.mark.slow
def test_wandb_offline_run_folder(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  sink = WandbSink("jaxrl-llm-test", str(tmp_path), {"algo": "grpo"})
  sink.write(1, {"reward": 0.5})
  sink.write(2, {"reward": 0.75, "loss": -1.5})
  sink.close()
  (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
  history = [{k: v for k, v in h.items() if not k.startswith("_") or k == "_step"}
             for h in read_wandb_history(run_file)]
  assert history == [{"_step": 1, "reward": 0.5},
                     {"_step": 2, "reward": 0.75, "loss": -1.5}]


def read_wandb_history(path):
  """The history rows of a ``.wandb`` run file: a 7-byte header, then LevelDB-log
  records (crc u32, length u16, type u8; 32 KiB blocks) holding ``Record`` protos."""
  from wandb.proto import wandb_internal_pb2
  with open(path, "rb") as f:
    data = f.read()
  pos, chunks, rows = 7, b"", []
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    if left < 7:
      pos += left
      continue
    n, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
    chunks += data[pos + 7:pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):          # a full record, or the last piece of one
      record = wandb_internal_pb2.Record.FromString(chunks)
      chunks = b""
      if record.WhichOneof("record_type") == "history":
        rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
  return rows


def test_a_failing_sink_warns_once_and_the_others_go_on():
  class Broken:
    name = "broken"
    def write(self, step, scalars):
      raise OSError(28, "No space left on device")
    def close(self):
      pass

  class Mem:
    name = "mem"
    def __init__(self):
      self.rows = []
    def write(self, step, scalars):
      self.rows.append(step)
    def close(self):
      pass

  said, mem = [], Mem()
  sinks = BackgroundSinks([Broken(), mem], warn=said.append)
  for row in ROWS:
    sinks.write(row)
  sinks.close()
  assert mem.rows == [0, 1, 2]
  assert len(said) == 1 and said[0].startswith(
      "warning: the broken metrics sink failed (writing step 0: OSError")


def test_a_sink_that_cannot_start_warns(tmp_path, monkeypatch):
  fake = _FakeWandb()
  fake.init = lambda **kwargs: (_ for _ in ()).throw(ValueError("invalid project name"))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  said: list = []
  sinks = make_sinks(RunConfig(out=str(tmp_path), wandb_project="bad/name"), warn=said.append)
  assert sinks.sinks == [] and "did not start (ValueError: invalid project name)" in said[0]
  sinks.close()


def test_missing_packages_are_one_line_errors(monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in ("tensorboardX", "wandb") else real(
                          name, *a))
  with pytest.raises(ValueError, match=r"--tensorboard needs tensorboardX.*\[tensorboard\]"):
    RunConfig(tensorboard=True).validate()
  with pytest.raises(ValueError, match="--wandb-project needs wandb"):
    RunConfig(wandb_project="p").validate()


def test_progress_shows_the_last_eval_accuracy(capsys):
  from jaxrl_llm.loop.progress import report_progress
  report_progress(RunConfig(steps=10), 1, {"reward": 0.5, "accuracy": 0.25}, 0.0, 1,
                  last_eval=0.375)
  assert "eval_acc 0.375" in capsys.readouterr().err


@pytest.mark.slow
def test_a_training_run_writes_tensorboard(tmp_path):
  pytest.importorskip("tensorboardX")
  from jaxrl_llm.loop.run import run_training
  run = RunConfig(steps=2, prompts_per_step=2, group_size=2, eval_size=4, eval_every=2,
                  out=str(tmp_path / "run"), progress=False, tensorboard=True)
  run_training(run)
  rows = [json.loads(line)
          for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  events = read_events(str(tmp_path / "run" / "tensorboard"))
  assert events["reward"] == [(r["step"], round(r["reward"], 6)) for r in rows[1:]]
  assert [s for s, _ in events["eval_accuracy"]] == [0, 2]


def test_sinks_write_nothing_through_a_planted_link(tmp_path, monkeypatch):
  """Reliability issue, item 3: ``RUN/tensorboard`` or ``RUN/wandb`` planted as links
  would have the sinks write outside the run folder (the sink does not start: one
  warning); a planted ``wandb_run_id -> F`` was overwritten (now replaced)."""
  monkeypatch.setitem(sys.modules, "wandb", _FakeWandb())
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "f.txt").write_text("not the run's\n")
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "wandb_run_id").symlink_to(outside / "f.txt")
  warnings: list = []
  run = RunConfig(out=str(run_dir), wandb_project="proj")
  make_sinks(run, warn=warnings.append).close()
  assert not (run_dir / "wandb_run_id").is_symlink() and warnings == []
  for name, flags in (("tensorboard", {"tensorboard": True}),
                      ("wandb", {"wandb_project": "proj"})):
    (run_dir / name).symlink_to(outside)
    make_sinks(RunConfig(out=str(run_dir), **flags), warn=warnings.append).close()
    assert f"{run_dir}/{name} is a symbolic link (to {outside})" in warnings[-1]
  assert sorted(os.listdir(outside)) == ["f.txt"]
  assert (outside / "f.txt").read_text() == "not the run's\n"
