"""Task sources: families of tasks a run names ``PREFIX:SPEC`` (``--task rg:chain_sum``).

A built-in task is one name in :data:`jaxrl_llm.tasks.TASKS`. A *task source* builds
tasks from a spec and ``KEY=VALUE`` settings (``--task-config``), e.g. reasoning-gym's
generators (:mod:`jaxrl_llm.tasks.reasoning_gym`, prefix ``rg``). Each source is one
:class:`TaskSource` in :data:`jaxrl_llm.tasks.TASK_SOURCES`; the run's config, the
command's checks and :func:`jaxrl_llm.tasks.get_task` read that table (no per-source
branches).

Examples:
  >>> split_task_name("rg:chain_sum,leg_counting")
  ('rg', 'chain_sum,leg_counting')
  >>> split_task_name("reverse") is None
  True
  >>> parse_task_config(["size=8", "allow_negation=true", "ratio=0.5", "style=natural"])
  {'size': 8, 'allow_negation': True, 'ratio': 0.5, 'style': 'natural'}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_llm.tasks.base import Task


@dataclasses.dataclass(frozen=True)
class TaskSource:
  """A family of tasks named ``PREFIX:SPEC``.

  Attributes:
    prefix: the name before the colon (``"rg"``).
    doc: one line for ``--help``.
    check: ``check(spec, config)`` raises a one-line ``ValueError`` for an unknown spec
      or a setting the spec does not take. It must not import JAX (the command runs
      it before the slow imports).
    build: ``build(spec, config, *, tokenizer=None, chat=False, max_new_tokens=...,
      eval_size=...) -> Task``: ``tokenizer`` a model's tokenizer (None: a character
      tokenizer over the task's texts), ``chat`` whether prompts are rendered with its
      chat template.
  """

  prefix: str
  doc: str
  check: Callable[[str, Mapping[str, Any]], None]
  build: Callable[..., Task]


def split_task_name(name: str | None) -> tuple[str, str] | None:
  """``(prefix, spec)`` of a task name ``PREFIX:SPEC``; None for a plain name.

  Examples:
    >>> split_task_name("rg:basic_arithmetic")
    ('rg', 'basic_arithmetic')
  """
  if not name or ":" not in name:
    return None
  prefix, spec = name.split(":", 1)
  return prefix, spec


def parse_config_value(text: str) -> bool | int | float | str:
  """A ``--task-config`` value: ``true``/``false`` (any case) a bool, then an int, a
  float, else the string itself.

  Examples:
    >>> [parse_config_value(t) for t in ["True", "3", "-2", "1e-3", "0.5", "simple"]]
    [True, 3, -2, 0.001, 0.5, 'simple']
  """
  low = text.strip().lower()
  if low in ("true", "false"):
    return low == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_task_config(items: Sequence[str]) -> dict[str, Any]:
  """``{key: value}`` of ``KEY=VALUE`` strings (values by :func:`parse_config_value`;
  a later key replaces an earlier one).

  Raises:
    ValueError: one line naming ``task_config`` for an item without ``=`` or a key.

  Examples:
    >>> parse_task_config(["min_terms=2", "max_terms=3"])
    {'min_terms': 2, 'max_terms': 3}
  """
  out: dict[str, Any] = {}
  for item in items:
    key, sep, value = str(item).partition("=")
    if not sep or not key.strip():
      raise ValueError(f"`task_config` takes KEY=VALUE, got {item!r}")
    out[key.strip()] = parse_config_value(value.strip())
  return out


__all__ = ["TaskSource", "parse_config_value", "parse_task_config", "split_task_name"]
