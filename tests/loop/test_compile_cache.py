"""The command's persistent compilation cache (loop.compile_cache): the flag on train,
eval and export, its precedence over JAX's own settings, ``off``, and an unwritable
directory (one warning, no cache). That a second identical run reads the cache is
tests/loop/test_accounting.py's (it counts the cache hits in the metrics rows)."""

from __future__ import annotations

import os

import jax
import pytest

from jaxrl_llm.cli import build_parser, run_config_from_args
from jaxrl_llm.loop.compile_cache import (
  MIN_COMPILE_TIME_S,
  choose_cache,
  default_cache_dir,
  use_compile_cache,
)
from jaxrl_llm.loop.config import RESUMABLE_FIELDS
from tests.utils import make_unwritable_folder

# ------------------------------------------------------------------ the flag


@pytest.mark.parametrize("command", [["train"], ["eval"], ["export", "RUN"]])
def test_compile_cache_flag_parses_on_train_eval_and_export(command):
  parser = build_parser()
  assert parser.parse_args(command).compile_cache is None
  assert parser.parse_args([*command, "--compile-cache", "/data/xla"]).compile_cache == \
      "/data/xla"
  assert parser.parse_args([*command, "--compile-cache", "off"]).compile_cache == "off"


def test_compile_cache_is_a_resumable_run_field():
  args = build_parser().parse_args(["train", "--compile-cache", "off"])
  run = run_config_from_args(args)
  assert run.compile_cache == "off"
  assert "compile_cache" in RESUMABLE_FIELDS and "compile_cache" not in run.identity()


# ------------------------------------------------------------ the precedence


def test_the_flag_beats_jax_settings_which_beat_the_default():
  env = {"HOME": "/home/me"}
  assert default_cache_dir(env) == "/home/me/.cache/jaxrl_llm/xla"
  assert default_cache_dir({**env, "XDG_CACHE_HOME": "/x"}) == "/x/jaxrl_llm/xla"
  assert choose_cache(None, jax_dir=None, jax_enabled=True, environ=env) == (
      "/home/me/.cache/jaxrl_llm/xla", "default")
  # JAX_COMPILATION_CACHE_DIR (JAX reads it into jax_compilation_cache_dir) is kept ...
  assert choose_cache(None, jax_dir="/env/dir", jax_enabled=True, environ=env) == (
      None, "jax")
  # ... and so is JAX_ENABLE_COMPILATION_CACHE=false
  assert choose_cache(None, jax_dir=None, jax_enabled=False, environ=env) == (None, "jax")
  # the flag wins over both
  assert choose_cache("/mine", jax_dir="/env/dir", jax_enabled=False) == ("/mine", "flag")
  assert choose_cache("OFF", jax_dir="/env/dir", jax_enabled=True) == (None, "off")


@pytest.fixture
def jax_cache_settings():
  """Restores this process's JAX cache settings (the suite's) after the test."""
  names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
           "jax_persistent_cache_min_compile_time_secs")
  saved = {name: getattr(jax.config, name) for name in names}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)
  from jax.experimental.compilation_cache import compilation_cache
  compilation_cache.reset_cache()


def test_use_compile_cache_sets_turns_off_and_survives_an_unwritable_dir(
    tmp_path, monkeypatch, jax_cache_settings):
  suite_dir = jax.config.jax_compilation_cache_dir
  if suite_dir:   # the root conftest's JAX_COMPILATION_CACHE_DIR (none with ..._FAST=0)
    assert use_compile_cache(None) == suite_dir        # kept without a flag
    assert jax.config.jax_compilation_cache_dir == suite_dir

  monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
  mine = str(tmp_path / "cache" / "xla")
  assert use_compile_cache(mine) == mine and os.path.isdir(mine)
  assert jax.config.jax_compilation_cache_dir == mine
  assert jax.config.jax_enable_compilation_cache
  assert jax.config.jax_persistent_cache_min_compile_time_secs == MIN_COMPILE_TIME_S

  assert use_compile_cache("off") is None
  assert not jax.config.jax_enable_compilation_cache

  blocked = tmp_path / "blocked"
  make_unwritable_folder(blocked)
  warnings: list[str] = []
  assert use_compile_cache(str(blocked / "xla"), warn=warnings.append) is None
  assert len(warnings) == 1 and "not writable" in warnings[0]
  assert not jax.config.jax_enable_compilation_cache
  # the process still computes (compiles without a cache)
  assert float(jax.jit(lambda x: x * 3.0)(2.0)) == 6.0
