"""Running model-written Python code in a subprocess with limits.

:func:`run_python` runs ``code`` in a fresh ``python -I -u`` subprocess, in a scratch
directory of its own (its cwd, ``HOME`` and ``TMPDIR``; removed afterwards), and
returns a :class:`SandboxResult` whose :meth:`~SandboxResult.observation` is the text a
model reads. Whatever the code does, the caller gets a result, never an exception:

=======================  ==============================================================
limit                    how
=======================  ==============================================================
wall clock               the parent kills the child's process group after
                         ``timeout_s`` (``error="timeout"``)
CPU time                 ``RLIMIT_CPU`` (``cpu_s``): the kernel stops the child
                         (``error="cpu"``)
memory                   ``RLIMIT_AS`` (``memory_mb``): allocations beyond it raise
                         ``MemoryError`` in the child (``error="memory"``)
output                   the parent reads at most ``max_output_bytes`` of stdout and
                         stderr (merged), then kills the child: a flood never fills
                         the parent's memory (``error="output"``, text truncated)
files                    ``RLIMIT_FSIZE`` (``max_file_mb``) bounds each file written
                         in the scratch directory
processes                refused: ``os.fork``, ``subprocess``, ``os.system``,
                         ``os.exec*``, ``os.posix_spawn``, ``pty`` (``error="refused"``)
network                  refused: socket creation, ``connect``, ``bind``,
                         ``getaddrinfo``
writes outside scratch   refused: ``open`` for writing, ``os.remove``, ``rename``,
                         ``mkdir``, ``chmod`` ... of a path outside the scratch
                         directory (symlinks resolved)
=======================  ==============================================================

The refusals are an audit hook (:func:`sys.addaudithook`) installed in the child
before the code runs; a refused operation raises ``PermissionError("sandbox: ...")``
in the code. **An audit hook is not a security boundary**: code that loads native code
(``ctypes``, a C extension, ``/proc/self/mem``) can bypass it, and reads are not
restricted. It keeps a well-meaning or confused model's code from damaging the host
and from hanging or flooding the training run; running untrusted adversarial code
needs an OS-level sandbox (a container, gVisor, nsjail, a VM) around the whole worker.
``ctypes`` stays allowed (``import numpy`` loads libraries through it).

Examples:
  >>> r = run_python("print(6 * 7)")
  >>> r.ok, r.output
  (True, '42\\n')
  >>> r = run_python("import os; os.fork()")
  >>> r.error, r.observation().splitlines()[-1]
  ('refused', 'Error: sandbox: os.fork is not allowed')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from jaxrl_llm.envs.tools import Tool

# The child's first code: limits, then the audit hook, then the model's code (main.py
# in the scratch directory, run as __main__). Its own frames (and the hook's) are cut
# from a traceback. argv: scratch dir, memory bytes, cpu seconds, file bytes.
_BOOTSTRAP = r"""
import os, resource, signal, sys, traceback
scratch = os.path.realpath(sys.argv[1])
mem, cpu, fsize = (int(a) for a in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sys.dont_write_bytecode = True
sys.argv = ["main.py"]
REFUSED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn",
           "os.spawn", "subprocess.Popen", "os.startfile",
           "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
           "socket.sendto", "socket.gethostbyname", "socket.gethostbyaddr"}
PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
         "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,),
         "os.truncate": (0,), "os.utime": (0,), "os.removexattr": (0,),
         "os.setxattr": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
         "shutil.copytree": (1,), "shutil.move": (1,)}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

def inside(path):
  if isinstance(path, int):
    return True
  try:
    real = realpath(fsdecode(path))
  except Exception:
    return False
  return real == scratch or real.startswith(scratch + sep)

def hook(event, args):
  if event in REFUSED:
    raise PermissionError(f"sandbox: {event} is not allowed")
  if event == "open":
    path, mode, flags = args
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & WRITE)
    if writing and not inside(path):
      raise PermissionError(f"sandbox: writing {path!r} (outside the scratch directory) "
                            "is not allowed")
  elif event in PATHS:
    for i in PATHS[event]:
      if i < len(args) and not inside(args[i]):
        raise PermissionError(f"sandbox: {event} of {args[i]!r} (outside the scratch "
                              "directory) is not allowed")

sys.addaudithook(hook)
with open("main.py", encoding="utf-8") as f:
  source = f.read()
try:
  exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
except SystemExit:
  raise
except BaseException as e:   # the report without this file's frames (the hook's)
  report = traceback.TracebackException(type(e), e, e.__traceback__)
  report.stack = traceback.StackSummary.from_list(
      [f for f in report.stack if f.filename != "<string>"])
  sys.stderr.write("".join(report.format()))
  sys.exit(1)
"""

_READ_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What running code gave.

  Attributes:
    output: its stdout and stderr (merged, decoded as UTF-8 with replacement), at most
      ``max_output_bytes`` of them.
    error: None when it ran to completion with exit status 0; else ``"timeout"``,
      ``"cpu"``, ``"memory"``, ``"output"``, ``"refused"`` (the audit hook),
      ``"exception"`` (any other uncaught exception, traceback in ``output``),
      ``"exit"`` (a non-zero ``sys.exit``), ``"signal"`` (killed by a signal) or
      ``"start"`` (the subprocess could not start).
    returncode: the child's exit status (negative: the signal), None if it never ran.
    elapsed_s: wall-clock seconds.
    truncated: whether ``output`` was cut at ``max_output_bytes``.
    message: one line describing ``error`` (empty when None).
  """

  output: str
  error: str | None
  returncode: int | None
  elapsed_s: float
  truncated: bool = False
  message: str = ""

  @property
  def ok(self) -> bool:
    return self.error is None

  def observation(self) -> str:
    """The text a model reads: the output, then ``"Error: <message>"`` on a failure
    (the output alone, or ``"(no output)"``, on success)."""
    if self.ok:
      return self.output or "(no output)"
    text = self.output.rstrip("\n")
    return f"{text}\nError: {self.message}" if text else f"Error: {self.message}"


def _kill(proc: subprocess.Popen) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)


def _read_capped(proc: subprocess.Popen, deadline: float,
                 limit: int) -> tuple[bytes, bool, bool]:
  """``(output, timed_out, flooded)``: reads the child's pipe until EOF, the deadline
  (then kills it) or more than ``limit`` bytes (keeps ``limit``, kills it)."""
  assert proc.stdout is not None
  fd = proc.stdout.fileno()
  chunks: list[bytes] = []
  size = 0
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      _kill(proc)
      return b"".join(chunks), True, False
    ready, _, _ = select.select([fd], [], [], left)
    if not ready:
      continue
    chunk = os.read(fd, _READ_CHUNK)
    if not chunk:
      return b"".join(chunks), False, False
    chunks.append(chunk)
    size += len(chunk)
    if size > limit:
      _kill(proc)
      return b"".join(chunks)[:limit], False, True


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
               cpu_s: float | None = None, max_output_bytes: int = 16384,
               max_file_mb: int = 16, python: str | None = None) -> SandboxResult:
  """Runs ``code`` in a sandboxed subprocess (the module docstring); never raises for
  what the code does.

  Args:
    code: Python source, run as ``__main__`` from ``main.py`` in the scratch directory.
    timeout_s: wall-clock limit, seconds (> 0).
    memory_mb: address-space limit of the child, MiB (Python itself needs ~30).
    cpu_s: CPU-time limit, seconds; None: ``ceil(timeout_s) + 1``.
    max_output_bytes: the most bytes of output kept (and read).
    max_file_mb: the largest file the code may write, MiB.
    python: the interpreter (default: this one, ``sys.executable``).

  Raises:
    ValueError: ``code`` not a str, or a limit that is not positive.

  Examples:
    >>> r = run_python("while True: pass", timeout_s=1.0)
    >>> r.error, r.elapsed_s < 5
    ('timeout', True)
  """
  if not isinstance(code, str):
    raise ValueError(f"`code` must be a str, got {type(code).__name__}.")
  for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb),
                      ("max_output_bytes", max_output_bytes), ("max_file_mb", max_file_mb),
                      ("cpu_s", 1 if cpu_s is None else cpu_s)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
  cpu = int(math.ceil(timeout_s)) + 1 if cpu_s is None else int(math.ceil(cpu_s))
  started = time.monotonic()
  scratch = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
  try:
    with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
      f.write(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    argv = [python or sys.executable, "-I", "-u", "-c", _BOOTSTRAP, scratch,
            str(int(memory_mb) << 20), str(cpu), str(int(max_file_mb) << 20)]
    try:
      proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True, close_fds=True)
    except OSError as e:
      return SandboxResult("", "start", None, time.monotonic() - started,
                           message=f"the sandbox could not start Python ({e})")
    deadline = started + timeout_s
    try:
      raw, timed_out, flooded = _read_capped(proc, deadline, max_output_bytes)
      if not (timed_out or flooded):    # EOF: the child closed its output
        try:
          proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          _kill(proc)
          timed_out = True
    except BaseException:
      _kill(proc)
      raise
    finally:
      proc.wait()
      assert proc.stdout is not None
      proc.stdout.close()
    elapsed = time.monotonic() - started
    output = raw.decode("utf-8", errors="replace")
    return _classify(output, proc.returncode, elapsed, timed_out=timed_out,
                     flooded=flooded, timeout_s=timeout_s, cpu=cpu, memory_mb=memory_mb,
                     max_output_bytes=max_output_bytes)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _classify(output: str, rc: int, elapsed: float, *, timed_out: bool, flooded: bool,
              timeout_s: float, cpu: int, memory_mb: int,
              max_output_bytes: int) -> SandboxResult:
  """The :class:`SandboxResult` of a finished child (its ``error`` and message)."""
  def result(error: str | None, message: str = "") -> SandboxResult:
    return SandboxResult(output, error, rc, elapsed, truncated=flooded, message=message)

  if timed_out:
    return result("timeout", f"timed out after {timeout_s:g} s (the code was stopped)")
  if flooded:
    return result("output", f"output truncated at {max_output_bytes} bytes (the code "
                  "was stopped)")
  if rc == 0:
    return result(None)
  if rc in (-signal.SIGXCPU, -signal.SIGKILL) and elapsed < timeout_s:
    return result("cpu", f"CPU time limit of {cpu} s exceeded (the code was stopped)")
  if rc < 0:
    return result("signal", f"the code was killed by signal {-rc} "
                  f"({signal.Signals(-rc).name})")
  last = output.rstrip().splitlines()[-1] if output.strip() else ""
  if last.startswith("MemoryError"):
    return result("memory", f"out of memory (the limit is {memory_mb} MiB)")
  if last.startswith("PermissionError: sandbox:"):
    return result("refused", last.split(": ", 1)[1])
  if "Traceback (most recent call last):" in output or re.match(
      r"[A-Za-z_][\w.]*(Error|Exception|Warning)\b", last):
    name = re.match(r"[\w.]+", last)
    return result("exception", f"the code raised {name.group(0) if name else 'an exception'}")
  return result("exit", f"the code exited with status {rc}")


def python_tool(**limits: float) -> Tool:
  """A ``python(code)`` tool that runs ``code`` with :func:`run_python` (``limits``:
  its keyword limits) and returns the observation: what it printed, or the error.

  >>> t = python_tool(timeout_s=2.0)
  >>> t({"code": "print(sum(range(10)))"})
  '45\\n'
  """
  def python(code: str) -> str:
    """Runs Python code in a sandbox and returns what it prints (use print()).

    Args:
      code: the Python source to run.
    """
    return run_python(code, **limits).observation()   # type: ignore[arg-type]

  return Tool.from_function(python)

__all__ = ["SandboxResult", "python_tool", "run_python"]
