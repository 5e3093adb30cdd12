"""Crash-consistent run folders, with real files, real kills and a real full device."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_llm import run_folder as RF

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _strict_rows(path):
  """Parses every line with a JSON parser that refuses NaN / Infinity tokens."""

  def refuse(token):
    raise AssertionError(f"non-strict JSON token {token}")

  with open(path) as f:
    text = f.read()
  assert text == "" or text.endswith("\n")
  return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def test_rows_are_durable_and_strict_before_close(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  log = RF.MetricsWriter(path)
  rows = [{"step": 0, "eval_accuracy": 0.25},
          {"step": 1, "loss": float("nan"), "kl": float("inf"), "x": -float("inf"),
           "n": np.float32(1.5), "i": np.int64(3), "arr": np.arange(2)}]
  for i, row in enumerate(rows):
    log.append(row)
    assert len(_strict_rows(path)) == i + 1       # visible to a reader at once
  log.close()
  got = _strict_rows(path)
  assert got[1] == {"step": 1, "loss": None, "kl": None, "x": None, "n": 1.5, "i": 3,
                    "arr": [0, 1]}
  assert RF.read_metrics(path) == (got, None)


def test_a_really_torn_file_is_reported_repaired_and_appended_to(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with RF.MetricsWriter(path) as log:
    for step in range(4):
      log.append({"step": step, "reward": step / 4})
  size = os.path.getsize(path)
  os.truncate(path, size - 7)                     # a power cut mid-way through row 3
  rows, note = RF.read_metrics(path)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert note == f"{path}: line 4 is incomplete (torn write); ignored it"
  # Appending after a torn tail never glues a new row onto the torn one.
  with RF.MetricsWriter(path) as log:
    assert log.note == note
    log.append({"step": 3, "reward": 0.75})
  assert [r["step"] for r in _strict_rows(path)] == [0, 1, 2, 3]


def test_complete_last_row_without_newline_is_kept(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w") as f:
    f.write('{"step": 0}\n{"step": 1}')            # cut exactly before the newline
  assert RF.read_metrics(path) == ([{"step": 0}, {"step": 1}], None)
  with RF.MetricsWriter(path) as log:
    log.append({"step": 2})
  assert [r["step"] for r in _strict_rows(path)] == [0, 1, 2]


def test_corruption_before_the_last_line_raises_naming_the_line(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w") as f:
    f.write('{"step": 0}\n{"ste\n{"step": 2}\n')
  with pytest.raises(RF.RunFolderIOError, match=r"metrics.jsonl: line 2 is not a JSON"):
    RF.read_metrics(path)
  with pytest.raises(FileNotFoundError, match=r"nope.jsonl does not exist"):
    RF.read_metrics(str(tmp_path / "nope.jsonl"))
  assert RF.read_metrics(str(tmp_path / "nope.jsonl"), missing_ok=True) == ([], None)


def test_prepare_metrics_keeps_rows_up_to_resume_step_and_rewrites_only_if_needed(
    tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  RF.rewrite_jsonl(path, [{"step": s, "v": s * 0.5} for s in range(6)])
  inode = os.stat(path).st_ino
  rows, note = RF.prepare_metrics(path, keep_upto=None)
  assert len(rows) == 6 and note is None and os.stat(path).st_ino == inode  # untouched
  rows, note = RF.prepare_metrics(path, keep_upto=3)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert note == f"{path}: dropped 2 rows after step 3"
  assert os.stat(path).st_ino != inode                   # replaced by rename, not in place
  assert _strict_rows(path) == rows
  assert not os.path.exists(path + ".tmp")
  none = str(tmp_path / "none.jsonl")
  assert RF.prepare_metrics(none, keep_upto=None) == ([], None)      # a fresh run
  assert RF.prepare_metrics(none, keep_upto=-1) == ([], None)
  assert RF.prepare_metrics(none, keep_upto=3) == (
      [], f"{none}: it is missing: the rows of steps 0-3 are lost")   # resumed at 3
  assert not os.path.exists(tmp_path / "none.jsonl")


def test_resume_keeps_only_int_increasing_steps_and_says_what_it_dropped(tmp_path):
  # A mid-file row whose step is not an int was dropped as "after step 12"; duplicated
  # and out-of-order rows were kept.
  path = str(tmp_path / "metrics.jsonl")
  steps = [0, 1, 2, "3", 3, 3, 2, None, 4, 5, True, 6, 13, 14]
  RF.rewrite_jsonl(path, [{"step": s, "i": i} for i, s in enumerate(steps)] + [{"i": 99}])
  rows, note = RF.prepare_metrics(path, keep_upto=12)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
  assert note == (f"{path}: dropped 2 rows after step 12, 4 rows whose step is not an int "
                  "(row 4: '3'), 2 duplicate or out-of-order rows (row 6: step 3 after "
                  "step 3); no row kept after step 6: the rows of steps 7-12 are lost")
  assert _strict_rows(path) == rows                       # rewritten: what is kept
  assert RF.prepare_metrics(path, keep_upto=6) == (rows, None)


def test_resume_says_when_the_metrics_file_was_emptied_or_deleted(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w"):
    pass
  assert RF.prepare_metrics(path, keep_upto=12) == (
      [], f"{path}: it is empty: the rows of steps 0-12 are lost")
  os.remove(path)
  assert RF.prepare_metrics(path, keep_upto=12) == (
      [], f"{path}: it is missing: the rows of steps 0-12 are lost")
  with open(path, "w") as f:
    f.write('{"step": 0}\n{"step": 1}\n{"ste')
  assert RF.prepare_metrics(path, keep_upto=1) == (
      [{"step": 0}, {"step": 1}], f"{path}: line 3 is incomplete (torn write); ignored it")


def test_binary_garbage_is_not_a_metrics_file_but_a_power_cut_tail_is_torn(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  for garbage, what in ((bytes(range(256)) * 4, "binary data"), (b"\x00\x01\xffgarbage",
                        "binary data"), (b"hello world\n", "text")):
    with open(path, "wb") as f:
      f.write(garbage)
    with pytest.raises(RF.RunFolderIOError,
                       match=rf"^{path}: is not a metrics file: line 1 is {what}, not a JSON "
                       "object$".replace(": is", " is")):
      RF.read_metrics(path)
  for tail in (b"\0" * 64, b'{"st'):            # zeros where a power cut lost the data
    with open(path, "wb") as f:
      f.write(tail)
    assert RF.read_metrics(path)[0] == []


_CHILD = r"""
import importlib.util, os, signal, sys
path, mode, module = sys.argv[1], sys.argv[2], sys.argv[4]
spec = importlib.util.spec_from_file_location("run_folder", module)  # no jax import
RF = importlib.util.module_from_spec(spec)
spec.loader.exec_module(RF)
rows = [{"step": s, "new": True, "pad": "x" * 200} for s in range(int(sys.argv[3]))]
if mode == "die-before-rename":
  real_fsync = os.fsync
  def fsync_then_die(fd):
    real_fsync(fd)
    os.kill(os.getpid(), signal.SIGKILL)   # temp written and synced, rename not done
  os.fsync = fsync_then_die
real_write = RF.atomic_write_text
def announce_then_write(p, text):
  print("start", flush=True)               # the rows are serialized: the write begins
  real_write(p, text)
RF.atomic_write_text = announce_then_write
RF.rewrite_jsonl(path, rows)
print("done", flush=True)
"""


MODULE = os.path.join(ROOT, "jaxrl_llm", "run_folder.py")


def _old_file(path, n):
  RF.rewrite_jsonl(path, [{"step": s, "old": True} for s in range(n)])
  return _strict_rows(path)


def test_sigkill_inside_a_rewrite_leaves_the_old_file_whole(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  old = _old_file(path, 50)
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _CHILD, path, "die-before-rename", "10",
                         MODULE], env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGKILL, proc.stderr
  assert _strict_rows(path) == old                 # steps 0-49 all still there
  # The next start repairs nothing it does not need to and appends cleanly.
  rows, note = RF.prepare_metrics(path, keep_upto=49)
  assert rows == old and note is None


def test_sigkill_at_random_moments_of_big_rewrites_never_loses_rows(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  env = dict(os.environ, PYTHONPATH=ROOT)
  rng = np.random.default_rng(0)
  outcomes = set()
  for trial in range(6):
    old = _old_file(path, 100 + trial)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, path, "plain", "30000", MODULE],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "start"
    time.sleep(float(rng.uniform(0.0, 0.1)))
    proc.kill()
    proc.wait(timeout=60)
    rows = _strict_rows(path)                      # never torn, never short
    if rows == old:
      outcomes.add("old")
    else:
      assert len(rows) == 30000 and all(r["new"] for r in rows)
      outcomes.add("new")
  print("outcomes of the kills:", sorted(outcomes))   # which ones depends on timing


def test_full_device_gives_one_line_error_naming_the_path():
  if not os.path.exists("/dev/full"):
    pytest.skip("no /dev/full on this system")
  log = RF.MetricsWriter("/dev/full")
  with pytest.raises(RF.RunFolderIOError) as info:
    log.append({"step": 1, "loss": 0.5})
  msg = str(info.value)
  assert msg == ("cannot write /dev/full: no space left on device (ENOSPC); free some "
                 "space or choose another --out")
  assert "\n" not in msg and info.value.errno == 28 and info.value.filename == "/dev/full"
  assert isinstance(info.value, OSError)


def test_write_json_is_atomic_strict_and_readable(tmp_path):
  path = str(tmp_path / "config.json")
  RF.write_json(path, {"lr": 1e-3, "clip_end": None, "bad": float("nan")})
  assert RF.read_json(path) == {"lr": 1e-3, "clip_end": None, "bad": None}
  assert not os.path.exists(path + ".tmp")
  with open(path, "w") as f:
    f.write('{"lr": ')
  with pytest.raises(RF.RunFolderIOError, match=r"config.json is not valid JSON"):
    RF.read_json(path)
  with pytest.raises(FileNotFoundError, match=r"missing.json does not exist"):
    RF.read_json(str(tmp_path / "missing.json"))
  with pytest.raises(RF.RunFolderIOError, match=r"cannot write .*sub/config.json"):
    RF.write_json(str(tmp_path / "sub" / "config.json"), {})   # folder missing


def test_probe_run_folder_creates_nothing_and_names_the_path(tmp_path):
  out = tmp_path / "runs" / "a"
  RF.probe_run_folder(str(out), min_free_bytes=1)
  assert os.listdir(tmp_path) == []                # nothing created, no probe left
  afile = tmp_path / "file"
  afile.write_text("x")
  with pytest.raises(RF.RunFolderIOError, match=r"run folder .*file/run: .*file is not a"):
    RF.probe_run_folder(str(afile / "run"))
  with pytest.raises(RF.RunFolderIOError, match=r"run folder .*a: only .* MiB free.*need"):
    RF.probe_run_folder(str(out), min_free_bytes=1 << 62)
  if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
    return
  try:
    RF.probe_run_folder("/sys/jaxrl_probe/run")
  except RF.RunFolderIOError as e:
    assert str(e).startswith("run folder /sys/jaxrl_probe/run is not writable: ")
    assert "\n" not in str(e)
  else:
    pytest.skip("/sys is writable here")


def test_graceful_stop_turns_sigterm_into_a_request_and_restores_handlers():
  before = signal.getsignal(signal.SIGTERM)
  with RF.GracefulStop(announce=False) as stop:
    assert not stop.requested
    os.kill(os.getpid(), signal.SIGTERM)           # a real signal, delivered to us
    assert stop.requested and stop.signum == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)           # a second SIGTERM changes nothing
    assert stop.signame == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before
  err = RF.RunInterrupted(signal.SIGTERM, "stopped")
  assert isinstance(err, KeyboardInterrupt) and err.exit_code == 143


def test_graceful_stop_second_ctrl_c_stops_at_once():
  with RF.GracefulStop(announce=False) as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signame == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)                                # the handler runs here


def test_probe_run_folder_checks_that_checkpoints_can_be_written(tmp_path):
  """Issue 28, fault 4: an unwritable ``checkpoints/`` was found only at the first save."""
  from tests.utils import make_unwritable_folder
  out = tmp_path / "run"
  out.mkdir()
  make_unwritable_folder(out / "checkpoints")
  with pytest.raises(RF.RunFolderIOError) as info:
    RF.probe_run_folder(str(out), min_free_bytes=1)
  msg = str(info.value)
  assert msg.startswith(f"checkpoint folder {out}/checkpoints is not writable: cannot "
                        f"write {out}/checkpoints: "), msg
  assert msg.endswith("; choose a writable --out") and "\n" not in msg
  if os.path.islink(out / "checkpoints"):
    os.unlink(out / "checkpoints")
  else:
    os.chmod(out / "checkpoints", 0o755)
    os.rmdir(out / "checkpoints")
  (out / "checkpoints").write_text("x")            # a file where the folder should be
  with pytest.raises(RF.RunFolderIOError, match=r"^checkpoint folder .*run/checkpoints is "
                     r"not a folder; remove it or choose another --out$"):
    RF.probe_run_folder(str(out), min_free_bytes=1)
  os.unlink(out / "checkpoints")
  (out / "checkpoints").mkdir()
  RF.probe_run_folder(str(out), min_free_bytes=1)
  assert os.listdir(out / "checkpoints") == []     # the probe leaves nothing behind


def _outside(tmp_path):
  """A file outside the run folder that a planted link points at, and its bytes."""
  target = tmp_path / "outside.txt"
  target.write_text("not the run's\n")
  return target, target.read_bytes()


def test_a_rewrite_never_writes_through_a_planted_link(tmp_path):
  """Reliability issue, item 3: a planted ``metrics.jsonl.tmp -> F`` was followed by the
  atomic rewrite (F overwritten with the rows) and ``metrics.jsonl`` became a link to
  F; a link at the file itself is replaced, not written through."""
  run = tmp_path / "run"
  run.mkdir()
  target, before = _outside(tmp_path)
  path = str(run / "metrics.jsonl")
  RF.rewrite_jsonl(path, [{"step": s} for s in range(5)])
  os.symlink(target, path + ".tmp")
  rows, note = RF.prepare_metrics(path, keep_upto=2)       # drops rows 3-4: a rewrite
  assert [r["step"] for r in rows] == [0, 1, 2] and note is not None
  assert not os.path.islink(path) and _strict_rows(path) == rows
  assert sorted(os.listdir(run)) == ["metrics.jsonl"]       # the link's name is gone too
  for name in ("config.json", "curves.png"):               # a link at the file itself
    os.symlink(target, run / name)
  RF.write_json(str(run / "config.json"), {"steps": 3})
  RF.atomic_write_bytes(str(run / "curves.png"), b"\x89PNG")
  assert not os.path.islink(run / "config.json") and not os.path.islink(run / "curves.png")
  assert RF.read_json(str(run / "config.json")) == {"steps": 3}
  assert target.read_bytes() == before                     # nothing outside changed


def test_metrics_are_never_appended_through_a_link(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  target, before = _outside(tmp_path)
  path = str(run / "metrics.jsonl")
  os.symlink(target, path)
  for act in (lambda: RF.MetricsWriter(path), lambda: RF.prepare_metrics(path, 2)):
    with pytest.raises(RF.RunFolderIOError) as info:
      act()
    assert str(info.value) == (f"{path} is a symbolic link (to {target}): a run folder's "
                               "files are written by the run alone; remove the link")
  os.unlink(path)
  os.link(target, path)                                    # a hard link: another name
  with pytest.raises(RF.RunFolderIOError, match=r"has other names \(hard links\)"):
    RF.MetricsWriter(path)
  assert target.read_bytes() == before


def test_a_linked_checkpoint_folder_is_refused_before_anything_is_written(tmp_path):
  """Reliability issue, item 3: ``RUN/checkpoints -> D`` was followed (a resumed run
  saved its new steps into D and rotation deleted D's old ones); a step folder
  ``checkpoints/N -> D`` of a fresh run was found only at the first save."""
  out = tmp_path / "run"
  out.mkdir()
  elsewhere = tmp_path / "elsewhere"
  (elsewhere / "2").mkdir(parents=True)
  (elsewhere / "2" / "f").write_text("not the run's\n")
  os.symlink(elsewhere, out / "checkpoints")
  with pytest.raises(RF.RunFolderIOError) as info:
    RF.probe_run_folder(str(out), min_free_bytes=1)
  assert str(info.value) == (f"{out}/checkpoints is a symbolic link (to {elsewhere}): a "
                             "run folder's files are written by the run alone; remove "
                             "the link")
  os.unlink(out / "checkpoints")
  (out / "checkpoints").mkdir()
  os.symlink(elsewhere / "2", out / "checkpoints" / "4")
  with pytest.raises(RF.RunFolderIOError,
                     match=r"^checkpoint step folder \S+/checkpoints/4 is a symbolic link"):
    RF.probe_run_folder(str(out), min_free_bytes=1)
  assert sorted(os.listdir(elsewhere / "2")) == ["f"]
  assert (elsewhere / "2" / "f").read_text() == "not the run's\n"


def test_a_rewrite_never_changes_a_hard_linked_outside_file(tmp_path):
  """Item 3, hard links: ``config.json`` or ``curves.png`` planted as a second name of a
  file elsewhere; a write makes a fresh file and renames it over the name, so the
  other file keeps its bytes (held before the issue too: kept as a regression test)."""
  run = tmp_path / "run"
  run.mkdir()
  target, before = _outside(tmp_path)
  for name in ("config.json", "curves.png", "metrics.jsonl"):
    os.link(target, run / name)
  RF.write_json(str(run / "config.json"), {"steps": 3})
  RF.atomic_write_bytes(str(run / "curves.png"), b"\x89PNG")
  RF.rewrite_jsonl(str(run / "metrics.jsonl"), [{"step": 0}])
  assert RF.read_json(str(run / "config.json")) == {"steps": 3}
  assert (run / "curves.png").read_bytes() == b"\x89PNG"
  assert os.stat(target).st_nlink == 1 and target.read_bytes() == before
