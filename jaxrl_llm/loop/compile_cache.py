"""The persistent XLA compilation cache of the ``jaxrl-llm`` command.

A second run of the same programs (a resumed run, the next run of a sweep, ``eval`` or
``export`` after ``train``) reads its compiled executables from disk instead of
compiling them again. ``train``, ``eval`` and ``export`` share one cache, set by
``--compile-cache`` (:class:`~jaxrl_llm.loop.config.RunConfig.compile_cache`).

Which cache a command uses (the first that applies):

1. ``--compile-cache DIR`` or ``--compile-cache off``: given on the command line, it wins.
2. JAX's own setting, left as it is: ``JAX_COMPILATION_CACHE_DIR`` (or the caller's
   ``jax.config.update("jax_compilation_cache_dir", ...)`` before calling
   :func:`jaxrl_llm.cli.main`) and ``JAX_ENABLE_COMPILATION_CACHE=false``.
3. The default, :func:`default_cache_dir`: ``$XDG_CACHE_HOME/jaxrl_llm/xla``, or
   ``~/.cache/jaxrl_llm/xla``.

Where this module sets the directory (1 and 3) it also caches every program that took
at least :data:`MIN_COMPILE_TIME_S` to compile (JAX's default is 1 s; a run compiles
many sub-second programs, and each is paid again at the next start), unless
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set. A directory that cannot be
created or written gives one warning line and the command runs without a cache.

Only the command sets the cache: :func:`~jaxrl_llm.loop.run.run_training` called from
Python leaves the caller's JAX configuration alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

# The compile-time threshold of a cached program (seconds).
MIN_COMPILE_TIME_S = 0.0
# The value of --compile-cache that turns the cache off.
OFF = "off"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
  """``$XDG_CACHE_HOME/jaxrl_llm/xla``, or ``~/.cache/jaxrl_llm/xla``.

  Examples:
    >>> default_cache_dir({"XDG_CACHE_HOME": "/scratch/me/cache"})
    '/scratch/me/cache/jaxrl_llm/xla'
  """
  environ = os.environ if environ is None else environ
  home = environ.get("HOME") or os.path.expanduser("~")
  base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
  return os.path.join(base, "jaxrl_llm", "xla")


def choose_cache(setting: str | None, *, jax_dir: str | None, jax_enabled: bool,
                 environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
  """``(directory to set, or None: set nothing / turn off; where it comes from)``.

  ``setting``: ``--compile-cache`` (None: not given); ``jax_dir`` and ``jax_enabled``:
  JAX's current ``jax_compilation_cache_dir`` and ``jax_enable_compilation_cache``.
  The source is ``"flag"``, ``"off"`` (the flag turns it off), ``"jax"`` (JAX's own
  setting is kept) or ``"default"``.

  Examples:
    >>> choose_cache(None, jax_dir=None, jax_enabled=True, environ={"HOME": "/h"})
    ('/h/.cache/jaxrl_llm/xla', 'default')
    >>> choose_cache(None, jax_dir="/tmp/c", jax_enabled=True)
    (None, 'jax')
    >>> choose_cache("/data/xla", jax_dir="/tmp/c", jax_enabled=True)
    ('/data/xla', 'flag')
    >>> choose_cache("off", jax_dir="/tmp/c", jax_enabled=True)
    (None, 'off')
  """
  if setting is not None:
    if setting.strip().lower() == OFF:
      return None, "off"
    return os.path.expanduser(setting), "flag"
  if jax_dir or not jax_enabled:
    return None, "jax"
  return default_cache_dir(environ), "default"


def _writable_problem(directory: str) -> str | None:
  """Why ``directory`` cannot hold the cache (None: it can): created if missing, and
  a file is written and removed in it."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
      pass
  except OSError as e:
    return e.strerror or str(e)
  return None


def _jax_setting(name: str) -> Any:
  """JAX's current value of its option ``name`` (an attribute of ``jax.config``)."""
  import jax
  return getattr(jax.config, name)


def use_compile_cache(setting: str | None, *,
                      warn: Callable[[str], None] | None = None) -> str | None:
  """Sets JAX's persistent compilation cache for this process (before it compiles
  anything) from ``--compile-cache`` (see the module's precedence); returns the
  directory in use, or None (off, or unusable: ``warn`` gets one line). A process
  that compiled before (``cli.main`` called twice) has its cache state reset when the
  setting changes. Its precedence is :func:`choose_cache`'s (examples there).
  """
  import jax
  jax_dir = _jax_setting("jax_compilation_cache_dir")
  jax_enabled = _jax_setting("jax_enable_compilation_cache")
  directory, source = choose_cache(setting, jax_dir=jax_dir, jax_enabled=jax_enabled)
  if source == "jax":
    return jax_dir if jax_enabled else None
  if directory is not None:
    problem = _writable_problem(directory)
    if problem is not None:
      if warn is not None:
        warn(f"warning: compile cache {directory} is not writable ({problem}); "
             "compiling without it (--compile-cache DIR or off)")
      directory = None
  changed = directory != jax_dir or (directory is None) == jax_enabled
  if directory is None:
    jax.config.update("jax_enable_compilation_cache", False)
  else:
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  if changed:        # a process that compiled before (cli.main called twice) re-reads it
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()
  return directory


__all__ = ["MIN_COMPILE_TIME_S", "OFF", "choose_cache", "default_cache_dir",
           "use_compile_cache"]
