"""Crash-consistent run folders: metrics that survive kill -9, power loss and full disks.

A run folder holds ``config.json`` (written atomically by :func:`write_json`),
``metrics.jsonl`` (one strict-JSON object per step, appended by
:class:`MetricsWriter`) and ``checkpoints/``. The rules that make it crash-consistent:

* **Append, flush, fsync.** Each metrics row is one ``write`` of one line, then
  ``flush`` and ``os.fsync``: after a crash the file holds every completed step, plus
  at most one torn (incomplete) last line.
* **Never rewrite in place.** A rewrite (dropping the rows after the step a run
  resumes from, or a torn tail) writes ``<name>.tmp``, fsyncs it, renames it over the
  original (``os.replace``, atomic on POSIX) and fsyncs the folder, so a crash at any
  instant leaves either the old file or the new one, never a truncated one. The same
  holds for :func:`write_json`.
* **Tolerate, and report, a torn last line.** :func:`read_metrics` returns the rows
  and a one-line note when the last line does not parse; a bad line *before* the
  last one is real corruption and raises :class:`RunFolderIOError` naming the line.
* **Strict JSON.** NaN and +-inf are written as ``null`` (``allow_nan=False``), so every
  JSON reader accepts the file; numpy scalars become Python numbers.
* **Never through a link.** Every file is written fresh: a rewrite's temporary is
  created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a stale one, or a link planted under
  its name, is unlinked first: the name, never what it points to) and renamed over the
  file, which replaces a link there rather than following it (:func:`replacing`);
  ``metrics.jsonl`` is appended to only when it is a file of its own (a symbolic or
  hard link is refused in one line). So a run folder crafted with links to files
  elsewhere changes nothing outside it on ``--resume``.
* **Fail early, in one line.** :func:`probe_run_folder` checks at start that the
  folder can be created and written and that its disk has room; any ``OSError``
  (``ENOSPC`` included) while writing becomes a :class:`RunFolderIOError` whose
  message names the path and the cause.

Examples:
  >>> import os, tempfile
  >>> out = tempfile.mkdtemp()
  >>> path = os.path.join(out, "metrics.jsonl")
  >>> with MetricsWriter(path) as log:
  ...   log.append({"step": 1, "loss": float("nan")})
  >>> open(path).read()
  '{"step": 1, "loss": null}\\n'
  >>> with open(path, "a") as f:
  ...   _ = f.write('{"step": 2, "lo')          # a torn last line (crash mid-write)
  >>> rows, note = read_metrics(path)
  >>> rows, note is not None
  ([{'step': 1, 'loss': None}], True)
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from typing import IO, Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"
# A step's ``extra`` dict in its checkpoint folder: the file orbax's JSON handler writes
# for the item "extra" (jaxrl_llm.checkpoint).
EXTRA_FILE = os.path.join("extra", "metadata")


class RunFolderError(ValueError):
  """A run folder named on the command line cannot serve as asked: ``--out`` holds
  another run (or one not meant to be resumed), or the run given to ``--critic-init``
  has no value parameters of this run's layout. A user's choice to correct, reported
  in one line (exit code 2)."""


class RunFolderIOError(OSError):
  """A run-folder file could not be read or written; the message names the path.

  Subclass of ``OSError`` (``errno`` and ``filename`` are set when known), raised
  instead of the raw error so a command-line tool prints one line.
  """

  def __init__(self, message: str, *, path: str | None = None,
               err: int | None = None) -> None:
    super().__init__(message)
    self.message = message
    self.filename = path
    self.errno = err

  def __str__(self) -> str:
    return self.message


def io_error(action: str, path: str, exc: OSError) -> RunFolderIOError:
  """A one-line :class:`RunFolderIOError` for ``exc`` raised while ``action`` on ``path``.

  Examples:
    >>> err = io_error("writing", "runs/a/metrics.jsonl",
    ...                OSError(28, "No space left on device"))
    >>> print(str(err).replace("; ", ";\\n"))
    cannot write runs/a/metrics.jsonl: no space left on device (ENOSPC);
    free some space or choose another --out
  """
  verb = "write" if action == "writing" else "read" if action == "reading" else action
  msg = f"cannot {verb} {path}: {os_reason(exc)}"
  return RunFolderIOError(" ".join(msg.split()), path=path, err=exc.errno)


def os_reason(exc: OSError) -> str:
  """The cause of ``exc`` in words, its errno name, and what to do for the usual ones.

  Examples:
    >>> os_reason(OSError(28, "No space left on device"))
    'no space left on device (ENOSPC); free some space or choose another --out'
    >>> os_reason(OSError(27, "File too large"))
    'file too large (EFBIG)'
  """
  code = exc.errno
  name = errno.errorcode.get(code, "") if code is not None else ""
  reason = (exc.strerror or str(exc) or type(exc).__name__).strip()
  reason = reason[:1].lower() + reason[1:]
  if name:
    reason += f" ({name})"
  if code == errno.ENOSPC:
    reason += "; free some space or choose another --out"
  elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
    reason += "; choose a writable --out"
  return " ".join(reason.split())


def to_jsonable(value: Any) -> Any:
  """``value`` with every non-finite float as ``None`` and numpy scalars as Python.

  Examples:
    >>> to_jsonable({"a": float("inf"), "b": [1.5, float("nan")], "c": "x"})
    {'a': None, 'b': [1.5, None], 'c': 'x'}
  """
  if isinstance(value, dict):
    return {str(k): to_jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_jsonable(v) for v in value]
  if isinstance(value, bool) or value is None or isinstance(value, str):
    return value
  if isinstance(value, int):
    return value
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  item = getattr(value, "item", None)          # numpy / jax scalars
  if item is not None and getattr(value, "ndim", 1) == 0:
    return to_jsonable(item())
  if hasattr(value, "tolist"):
    return to_jsonable(value.tolist())
  return value


def dumps(value: Any, **kwargs: Any) -> str:
  """Strict JSON of ``value`` (non-finite floats as ``null``; never ``NaN`` tokens)."""
  return json.dumps(to_jsonable(value), allow_nan=False, **kwargs)


def _fsync_dir(path: str) -> None:
  """fsyncs a folder so a rename inside it is durable (no-op where unsupported)."""
  try:
    fd = os.open(path or ".", os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)      # 0 where the OS has none (Windows)


@contextlib.contextmanager
def replacing(path: str, mode: str = "w") -> Iterator[IO]:
  """Within: a new file (``mode`` ``"w"``, UTF-8 text, or ``"wb"``) whose content
  replaces ``path`` when the block ends without an error.

  The content goes to ``<path>.tmp``, created fresh (``O_CREAT | O_EXCL | O_NOFOLLOW``;
  a stale temporary, or a link planted under its name, is unlinked first: the name
  only), is fsynced, then renamed over ``path`` (``os.replace``: a link at ``path`` is
  replaced, never followed) and the folder is fsynced. A crash at any moment leaves
  the previous file or the complete new one; nothing is ever written through a link.
  On an error the temporary is removed and ``path`` is left as it was.

  Raises:
    RunFolderIOError: any ``OSError`` (one line naming ``path``); other errors of the
      block pass through.

  Examples:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.symlink(os.path.join(d, "elsewhere"), os.path.join(d, "a.txt.tmp"))
    >>> with replacing(os.path.join(d, "a.txt")) as f:
    ...   _ = f.write("fresh")
    >>> sorted(os.listdir(d)), open(os.path.join(d, "a.txt")).read()
    (['a.txt'], 'fresh')
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"`mode` must be 'w' or 'wb', got {mode!r}.")
  tmp = path + ".tmp"
  try:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)                     # a stale temporary, or a planted link: the name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
  except OSError as e:
    raise io_error("writing", path, e) from None
  done = False
  try:
    f: IO = os.fdopen(fd, "w", encoding="utf-8") if mode == "w" else os.fdopen(fd, "wb")
    with f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    done = True
  except OSError as e:
    raise io_error("writing", path, e) from None
  finally:
    if not done:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
  _fsync_dir(os.path.dirname(path))


def atomic_write_text(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` as temp file + fsync + rename (+ fsync of the folder),
  never through a link (:func:`replacing`).

  A crash at any moment leaves either the previous file or the complete new one.
  Raises :class:`RunFolderIOError` (one line, naming ``path``) on any ``OSError``.
  """
  with replacing(path) as f:
    f.write(text)


def atomic_write_bytes(path: str, data: bytes) -> None:
  """:func:`atomic_write_text` of ``data`` (e.g. a PNG)."""
  with replacing(path, "wb") as f:
    f.write(data)


def refuse_link(path: str) -> None:
  """Raises :class:`RunFolderIOError` when ``path`` is a symbolic link: a file the run
  appends to (or reads to act on) must be the run folder's own.

  Examples:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> refuse_link(os.path.join(d, "metrics.jsonl"))            # missing: fine
    >>> os.symlink("/etc/passwd", os.path.join(d, "metrics.jsonl"))
    >>> try:
    ...   refuse_link(os.path.join(d, "metrics.jsonl"))
    ... except RunFolderIOError as e:
    ...   print(str(e).replace(d, "RUN"))
    RUN/metrics.jsonl is a symbolic link (to /etc/passwd): a run folder's files are
    written by the run alone; remove the link
  """
  if os.path.islink(path):
    raise RunFolderIOError(f"{path} is a symbolic link (to {os.readlink(path)}): a run "
                           "folder's files are written by the run alone; remove the link",
                           path=path, err=errno.ELOOP)


def write_json(path: str, obj: Any) -> None:
  """Atomically writes ``obj`` as indented strict JSON (see :func:`atomic_write_text`).

  Examples:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "config.json")
    >>> write_json(p, {"lr": 1e-3, "clip_end": float("nan")})
    >>> read_json(p)
    {'lr': 0.001, 'clip_end': None}
  """
  atomic_write_text(path, dumps(obj, indent=2) + "\n")


def restorable_problem(run_dir: str) -> str | None:
  """Why ``run_dir`` holds no run to restore, or None when it holds one: its
  ``config.json`` is missing, or ``checkpoints/`` has no numbered step yet. Reads only
  directory listings (no JAX, nothing created).

  Examples:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> restorable_problem(d).endswith("config.json is missing)")
    True
    >>> write_json(os.path.join(d, CONFIG_FILE), {})
    >>> os.makedirs(os.path.join(d, CHECKPOINTS_DIR, "2"))
    >>> restorable_problem(d) is None
    True
  """
  cfg = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.isfile(cfg):
    return f"{run_dir} is not a run folder ({cfg} is missing)"
  ckpt_dir = os.path.join(run_dir, CHECKPOINTS_DIR)
  if not os.path.isdir(ckpt_dir) or not any(n.isdigit() for n in os.listdir(ckpt_dir)):
    return (f"{run_dir} has no checkpoint yet ({ckpt_dir} is empty or missing): the run "
            "saved none before it stopped")
  return None


def checkpoint_extras(run_dir: str) -> dict[int, Any]:
  """The ``extra`` data of each step in ``run_dir/checkpoints``, as its file holds it.

  Read without JAX, before anything is restored, and so not verified (a restore
  verifies it: :mod:`jaxrl_llm.checkpoint`): for checks that can refuse a run early.
  Steps whose file is missing or not JSON, and step folders that are links, are left
  out.

  Examples:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(d, CHECKPOINTS_DIR, "2", "extra"))
    >>> write_json(os.path.join(d, CHECKPOINTS_DIR, "2", EXTRA_FILE), {"step": 2})
    >>> checkpoint_extras(d)
    {2: {'step': 2}}
  """
  folder = os.path.join(run_dir, CHECKPOINTS_DIR)
  try:
    names = sorted((n for n in os.listdir(folder) if n.isdigit()), key=int)
  except OSError:
    return {}
  out = {}
  for name in names:
    step_dir = os.path.join(folder, name)
    if os.path.islink(step_dir):
      continue
    try:
      out[int(name)] = read_json(os.path.join(step_dir, EXTRA_FILE))
    except OSError:                   # missing, unreadable or not JSON
      continue
  return out


def read_json(path: str) -> Any:
  """Reads a JSON file; a missing, unreadable or malformed one raises a one-line error.

  Raises:
    FileNotFoundError: ``path`` does not exist (message names it).
    RunFolderIOError: it cannot be read or is not valid JSON.
  """
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} does not exist") from None
  except OSError as e:
    raise io_error("reading", path, e) from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise RunFolderIOError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})",
                           path=path) from None


def read_metrics(path: str, *, missing_ok: bool = False
                 ) -> tuple[list[dict], str | None]:
  """The rows of a ``metrics.jsonl`` and a note about a torn last line (or ``None``).

  A last line that does not parse (or does not end in a newline and does not parse)
  is what a crash or a full disk leaves mid-write: it is dropped and described in the
  note. A malformed line before the last one is not a crash artefact and raises.

  Args:
    path: the JSONL file.
    missing_ok: return ``([], None)`` for a missing file instead of raising.

  Raises:
    FileNotFoundError: the file does not exist (and not ``missing_ok``).
    RunFolderIOError: it cannot be read, or a line other than the last is malformed.

  Examples:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> with open(p, "w") as f:
    ...   _ = f.write('{"step": 0}\\n{"step": 1}\\n{"st')
    >>> rows, note = read_metrics(p)
    >>> [r["step"] for r in rows]
    [0, 1]
    >>> note.endswith("line 3 is incomplete (torn write); ignored it")
    True
  """
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    if missing_ok:
      return [], None
    raise FileNotFoundError(f"{path} does not exist") from None
  except OSError as e:
    raise io_error("reading", path, e) from None
  lines = data.split(b"\n")
  if lines and lines[-1] == b"":
    lines.pop()                                # the file ends with a newline
  rows: list[dict] = []
  note = None
  for i, raw in enumerate(lines):
    if not raw.strip():
      continue
    try:
      row = json.loads(raw.decode("utf-8"))
      problem = None if isinstance(row, dict) else "not a JSON object"
    except (ValueError, UnicodeDecodeError) as e:
      problem = str(e)
    if problem is not None and not rows and not _torn_row(raw):
      what = "binary data" if _binary(raw) else "text"
      raise RunFolderIOError(f"{path} is not a metrics file: line {i + 1} is {what}, not "
                             "a JSON object", path=path)
    if problem is not None:
      if i == len(lines) - 1:
        note = f"{path}: line {i + 1} is incomplete (torn write); ignored it"
        break
      raise RunFolderIOError(f"{path}: line {i + 1} is not a JSON object ({problem}); "
                             "the file is corrupted before its last line", path=path)
    rows.append(row)
  return rows, note


def _torn_row(raw: bytes) -> bool:
  """Whether an unparsable line looks like what a crash leaves of a row: its start
  (``{...``), or the zeros a power cut can leave in place of unwritten data."""
  body = raw.strip()
  return body.startswith(b"{") or not body.strip(b"\0")


def _binary(raw: bytes) -> bool:
  try:
    return b"\0" in raw or not raw.decode("utf-8").isprintable()
  except UnicodeDecodeError:
    return True


def rewrite_jsonl(path: str, rows: Iterable[dict]) -> None:
  """Replaces ``path`` by ``rows`` (one strict-JSON line each), atomically."""
  atomic_write_text(path, "".join(dumps(r) + "\n" for r in rows))


def prepare_metrics(path: str, keep_upto: int | None
                    ) -> tuple[list[dict], str | None]:
  """Readies ``metrics.jsonl`` for appending when a run (re)starts.

  Keeps the rows a resume can trust: an int ``step`` (not a bool), steps strictly
  increasing (a duplicate or out-of-order row is dropped; the first of equal steps
  stays) and ``step <= keep_upto`` (any step when ``None``). Drops a torn last line,
  and rewrites the file atomically (:func:`rewrite_jsonl`) only if something was
  dropped (a missing file stays missing). Returns the kept rows and one line saying
  what was dropped, and, for ``keep_upto >= 0``, which steps up to it have no row (a
  file emptied or deleted: all of them); ``None`` when all is well.

  Examples:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> rewrite_jsonl(p, [{"step": s} for s in (0, 1, 1, 3, 2, "4", 4, 5)])
    >>> rows, note = prepare_metrics(p, keep_upto=4)
    >>> [r["step"] for r in rows]
    [0, 1, 3, 4]
    >>> print(note.replace(p, "RUN/metrics.jsonl"))
    RUN/metrics.jsonl: dropped 1 row after step 4, 1 row whose step is not an int
    (row 6: '4'), 2 duplicate or out-of-order rows (row 3: step 1 after step 1)
  """
  refuse_link(path)
  rows, torn = read_metrics(path, missing_ok=True)
  kept: list[dict] = []
  after, not_int, disorder = [], [], []     # (row number, its step[, the step before])
  for n, row in enumerate(rows, 1):
    step = row.get("step")
    if type(step) is not int:
      not_int.append((n, step))
    elif keep_upto is not None and step > keep_upto:
      after.append((n, step))
    elif kept and step <= kept[-1]["step"]:
      disorder.append((n, step, kept[-1]["step"]))
    else:
      kept.append(row)
  dropped = []
  if after:
    dropped.append(f"{_rows(len(after))} after step {keep_upto}")
  if not_int:
    dropped.append(f"{_rows(len(not_int))} whose step is not an int (row {not_int[0][0]}: "
                   f"{_short_repr(not_int[0][1])})")
  if disorder:
    n, step, before = disorder[0]
    dropped.append(f"{_rows(len(disorder), 'duplicate or out-of-order row')} (row {n}: "
                   f"step {step} after step {before})")
  parts = [] if torn is None else [torn.removeprefix(f"{path}: ")]
  if dropped:
    parts.append("dropped " + ", ".join(dropped))
  if torn is not None or dropped:
    rewrite_jsonl(path, kept)
  if keep_upto is not None and keep_upto >= 0:
    last = kept[-1]["step"] if kept else -1
    if not rows and torn is None:
      state = "is missing" if not os.path.exists(path) else "is empty"
      parts.append(f"it {state}: the rows of steps 0-{keep_upto} are lost")
    elif last < keep_upto:
      parts.append(f"no row kept after step {last}: the rows of steps {last + 1}-"
                   f"{keep_upto} are lost" if kept else
                   f"no row kept: the rows of steps 0-{keep_upto} are lost")
  if not parts:
    return kept, None
  return kept, f"{path}: " + "; ".join(parts)


def _rows(count: int, what: str = "row") -> str:
  return f"{count} {what}" + ("" if count == 1 else "s")


def _short_repr(value: Any, limit: int = 40) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _ends_with_newline(path: str) -> bool:
  """Whether ``path`` is missing, empty, or ends with a newline."""
  try:
    with open(path, "rb") as f:
      end = f.seek(0, os.SEEK_END)
      if end == 0:
        return True
      f.seek(end - 1)
      return f.read(1) == b"\n"
  except FileNotFoundError:
    return True
  except OSError as e:
    raise io_error("reading", path, e) from None


class MetricsWriter:
  """Appends one strict-JSON line per row to a JSONL file; flushes and fsyncs each.

  A file that ends in a torn line is first repaired with :func:`prepare_metrics`
  (the note is kept in ``note``); a complete last row without its newline gets one,
  so every new row starts on its own line.
  Any ``OSError`` (full disk, lost mount) raises :class:`RunFolderIOError` naming the
  file.

  Args:
    path: the JSONL file (created if missing).
    fsync: ``os.fsync`` after every row (default); ``False`` only flushes.

  Examples:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "m.jsonl")
    >>> with MetricsWriter(p) as log:
    ...   log.append({"step": 0, "acc": 0.5})
    >>> read_metrics(p)
    ([{'step': 0, 'acc': 0.5}], None)
  """

  def __init__(self, path: str, *, fsync: bool = True) -> None:
    self.path = path
    self._fsync = fsync
    self.note: str | None = None
    refuse_link(path)
    if not _ends_with_newline(path):           # a torn tail: drop it atomically first
      self.note = prepare_metrics(path, None)[1]
    try:               # O_NOFOLLOW: a link planted since the check is refused too
      fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
      self._file = os.fdopen(fd, "ab")
      if os.fstat(fd).st_nlink > 1:            # a hard link: other names share the file
        self._file.close()
        raise RunFolderIOError(f"{path} has other names (hard links): a run folder's "
                               "files are written by the run alone; copy it to a file of "
                               "its own", path=path)
      if not _ends_with_newline(path):         # a complete last row missing its newline
        self._write(b"\n")
    except RunFolderIOError:
      raise
    except OSError as e:
      raise io_error("writing", path, e) from None

  def _write(self, data: bytes) -> None:
    self._file.write(data)
    self._file.flush()
    if self._fsync:
      os.fsync(self._file.fileno())

  def append(self, row: dict) -> None:
    """Writes ``row`` as one line and makes it durable before returning."""
    line = (dumps(row) + "\n").encode("utf-8")
    try:
      self._write(line)
    except OSError as e:
      raise io_error("writing", self.path, e) from None

  def close(self) -> None:
    try:
      self._file.close()
    except OSError as e:
      raise io_error("writing", self.path, e) from None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def _existing_ancestor(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def _probe_write(folder: str, what: str, path: str) -> None:
  """Creates, writes, fsyncs and removes a file in ``folder``; one-line error if not."""
  try:
    fd, probe = tempfile.mkstemp(prefix=".jaxrl-write-probe-", dir=folder)
    try:
      os.write(fd, b"probe")
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    err = io_error("writing", folder, e)
    raise RunFolderIOError(f"{what} is not writable: {err}", path=path,
                           err=e.errno) from None


def probe_run_folder(path: str, *, min_free_bytes: int = 64 << 20) -> None:
  """Checks, before any compute is spent, that ``path`` can hold a run.

  Without creating anything: the nearest existing ancestor of ``path`` must be a
  folder in which a file can be created, written, fsynced and removed, and its disk
  must have at least ``min_free_bytes`` free. When ``path/checkpoints`` exists already
  (a resumed run, or a folder made ready beforehand) it must be a folder that passes
  the same write test, so an unwritable one stops the run before any compute rather
  than at its first save, and neither it nor a step folder in it may be a symbolic
  link (:func:`refuse_linked_checkpoints`).

  Raises:
    RunFolderIOError: one line naming ``path`` and the cause.

  Examples:
    >>> import tempfile
    >>> probe_run_folder(tempfile.mkdtemp() + "/runs/a", min_free_bytes=1)
  """
  where = _existing_ancestor(path)
  if not os.path.isdir(where):
    raise RunFolderIOError(f"cannot create run folder {path}: {where} is not a folder",
                           path=path, err=errno.ENOTDIR)
  _probe_write(where, f"run folder {path}", path)
  checkpoints = os.path.join(path, CHECKPOINTS_DIR)
  if os.path.lexists(checkpoints):
    if not os.path.isdir(checkpoints):
      raise RunFolderIOError(f"checkpoint folder {checkpoints} is not a folder; remove it "
                             "or choose another --out", path=checkpoints, err=errno.ENOTDIR)
    _probe_write(checkpoints, f"checkpoint folder {checkpoints}", checkpoints)
    refuse_linked_checkpoints(checkpoints)
  free = shutil.disk_usage(where).free
  if free < min_free_bytes:
    raise RunFolderIOError(
        f"run folder {path}: only {free / 2**20:.1f} MiB free on its disk, need at "
        f"least {min_free_bytes / 2**20:.1f} MiB; free some space or choose another "
        "--out", path=path, err=errno.ENOSPC)


def refuse_linked_checkpoints(checkpoints: str) -> None:
  """Raises :class:`RunFolderIOError` when the folder ``checkpoints`` or one of its step
  folders (``checkpoints/N``) is a symbolic link: the checkpointer writes and deletes
  step folders there, which through a link would be files outside the run folder.

  Examples:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(d, "elsewhere", "2"))
    >>> os.symlink(os.path.join(d, "elsewhere"), os.path.join(d, "checkpoints"))
    >>> try:
    ...   refuse_linked_checkpoints(os.path.join(d, "checkpoints"))
    ... except RunFolderIOError as e:
    ...   print(str(e).replace(d, "RUN"))
    RUN/checkpoints is a symbolic link (to RUN/elsewhere): a run folder's files are
    written by the run alone; remove the link
  """
  refuse_link(checkpoints)
  step = linked_step_folder(checkpoints)
  if step is not None:
    raise RunFolderIOError(linked_step_message(step), path=step, err=errno.ELOOP)


def linked_step_folder(checkpoints: str) -> str | None:
  """The first step folder ``checkpoints/N`` (by name) that is a symbolic link; None
  when there is none or ``checkpoints`` cannot be listed (missing: the caller's to
  report). The run folder's probe and :class:`~jaxrl_llm.checkpoint.Checkpointer` both
  refuse it, with :func:`linked_step_message`."""
  try:
    names = sorted(os.listdir(checkpoints))
  except OSError:
    return None
  return next((os.path.join(checkpoints, name) for name in names
               if name.isdigit() and os.path.islink(os.path.join(checkpoints, name))),
              None)


def linked_step_message(step: str) -> str:
  """The one line refusing the linked step folder ``step``."""
  return (f"checkpoint step folder {step} is a symbolic link (to {os.readlink(step)}); "
          "a checkpoint is a folder the checkpointer wrote: remove the link")


class RunInterrupted(KeyboardInterrupt):
  """A run stopped on a signal after checkpointing; ``exit_code`` is ``128 + signum``.

  A ``KeyboardInterrupt`` subclass, so code that handles Ctrl-C handles it too.
  """

  def __init__(self, signum: int, message: str = "") -> None:
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + int(signum)


class GracefulStop:
  """Turns SIGTERM (and SIGINT) into a request to stop after the current step.

  SLURM, Kubernetes and preemptible TPU/GPU VMs send SIGTERM some seconds before they
  kill a job. Inside ``with GracefulStop() as stop:`` the first such signal only sets
  ``stop.signum`` (and prints one line); the loop checks ``stop.requested`` between
  steps, saves a checkpoint and raises :class:`RunInterrupted`. A second SIGINT
  raises ``KeyboardInterrupt`` at once (Ctrl-C twice: stop now), except while a
  checkpoint is being written: :meth:`jaxrl_llm.checkpoint.Checkpointer.save` holds it
  until the step is complete (one line says so), so a save is never torn. Handlers are
  installed only in the main thread and restored on exit.

  Examples:
    >>> import os, signal
    >>> with GracefulStop(announce=False) as stop:
    ...   os.kill(os.getpid(), signal.SIGTERM)
    ...   stop.requested, stop.signame
    (True, 'SIGTERM')
  """

  def __init__(self, signals: tuple = (signal.SIGTERM, signal.SIGINT), *,
               announce: bool = True) -> None:
    self.signals = signals
    self.announce = announce
    self.signum: int | None = None
    self._previous: dict = {}

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def signame(self) -> str:
    return signal.Signals(self.signum).name if self.signum is not None else ""

  def _handle(self, signum: int, frame: Any) -> None:
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if self.signum is None:
      self.signum = signum
      if self.announce:
        sys.stderr.write(f"\nreceived {signal.Signals(signum).name}: finishing the "
                         "current step, saving a checkpoint, then exiting (Ctrl-C again "
                         "to stop at once)\n")
        sys.stderr.flush()

  def __enter__(self) -> GracefulStop:
    if threading.current_thread() is threading.main_thread():
      for sig in self.signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc: object) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}


__all__ = ["METRICS_FILE", "CONFIG_FILE", "EXTRA_FILE", "RunFolderError",
           "RunFolderIOError", "io_error", "os_reason", "to_jsonable", "dumps",
           "atomic_write_bytes", "atomic_write_text", "replacing", "refuse_link",
           "refuse_linked_checkpoints", "linked_step_folder", "linked_step_message",
           "write_json", "checkpoint_extras", "read_json",
           "read_metrics", "rewrite_jsonl", "prepare_metrics", "MetricsWriter",
           "probe_run_folder", "RunInterrupted", "GracefulStop"]
