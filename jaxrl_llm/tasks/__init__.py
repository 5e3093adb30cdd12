"""Built-in verifiable-reward tasks, their reward functions and a character tokenizer.

Every task draws seeded `Problem`s (`Task.sample_prompts`), has a fixed held-out eval
split (`Task.eval_problems`), and scores decoded completions with a reward in [0, 1]
that is 1 exactly for a correct answer (`Task.score`, `Task.exact`). The default,
``"reverse"`` (3 digits), is learnable by a tiny model trained from scratch by RL on
a CPU: every answer token is a copy of one prompt token, and the per-position partial
credit gives a signal long before the first exact answer.

Examples:
  >>> import numpy as np
  >>> task = get_task(DEFAULT_TASK)
  >>> problems = task.sample_prompts(np.random.default_rng(0), 2)
  >>> tokens, mask = task.tokenizer.encode_batch(
  ...     [p.prompt for p in problems], task.max_prompt_len)
  >>> tokens.shape, task.max_new_tokens
  ((2, 4), 4)
  >>> task.score(problems, [problems[0].answer, ""]).tolist()
  [1.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl_llm._names import DEFAULT_TASK
from jaxrl_llm.tasks.arithmetic import AddTask
from jaxrl_llm.tasks.base import Problem, Task, position_match, random_baseline
from jaxrl_llm.tasks.countdown import CountdownTask, parse_expression
from jaxrl_llm.tasks.jsonl import JsonlTask, load_jsonl
from jaxrl_llm.tasks.reasoning_gym import REASONING_GYM, ReasoningGymTask
from jaxrl_llm.tasks.sources import TaskSource, parse_task_config, split_task_name
from jaxrl_llm.tasks.strings import (
    CopyTask,
    MixedRepeatTask,
    RepeatTask,
    ReverseTask,
    SortTask,
    StringTask,
)
from jaxrl_llm.tasks.tokenizer import CharTokenizer
from jaxrl_llm.tasks.verifiers import REWARDS, get_reward, register_reward

TASKS: dict[str, Callable[..., Task]] = {
    "copy": CopyTask,
    "reverse": ReverseTask,
    "sort": SortTask,
    "add": AddTask,
    "countdown": CountdownTask,
    "repeat": RepeatTask,
    "repeat_mixed": MixedRepeatTask,
}

LONG_TASKS = ("repeat", "repeat_mixed")
"""Tasks whose answers are long (200+ tokens): credit assignment over length."""

TASK_SOURCES: dict[str, TaskSource] = {
    "rg": REASONING_GYM,
}
"""Families of tasks named ``PREFIX:SPEC`` (:mod:`jaxrl_llm.tasks.sources`)."""


def task_source(name: str | None) -> tuple[TaskSource, str] | None:
  """``(source, spec)`` of a task named ``PREFIX:SPEC`` with a registered prefix; None
  for any other name.

  Examples:
    >>> source, spec = task_source("rg:chain_sum")
    >>> source.prefix, spec
    ('rg', 'chain_sum')
    >>> task_source("reverse") is None, task_source("nope:x") is None
    (True, True)
  """
  split = split_task_name(name)
  if split is None or split[0] not in TASK_SOURCES:
    return None
  return TASK_SOURCES[split[0]], split[1]


def get_task(name: str = DEFAULT_TASK, **kwargs: Any) -> Task:
  """The registered task ``name``, built with ``kwargs`` (its dataclass fields); or,
  for ``PREFIX:SPEC`` (:data:`TASK_SOURCES`), the source's task (``kwargs``: its
  ``build`` options, e.g. ``config``).

  Raises:
    ValueError: for an unknown ``name`` (the message lists the valid names).

  Examples:
    >>> get_task("sort", max_len=5).max_new_tokens
    6
  """
  source = task_source(name)
  if source is not None:
    return source[0].build(source[1], **kwargs)
  if name not in TASKS:
    raise ValueError(f"`name` must be one of {sorted(TASKS)} or "
                     f"{', '.join(p + ':...' for p in TASK_SOURCES)}, got {name!r}.")
  return TASKS[name](**kwargs)


__all__ = [
    "AddTask", "CharTokenizer", "CopyTask", "CountdownTask", "DEFAULT_TASK", "Problem",
    "MixedRepeatTask", "RepeatTask", "ReverseTask", "SortTask", "LONG_TASKS", "StringTask",
    "TASKS", "Task",
    "get_task",
    "parse_expression", "position_match", "random_baseline",
    "JsonlTask", "load_jsonl", "REWARDS", "get_reward", "register_reward",
    "ReasoningGymTask", "TASK_SOURCES", "TaskSource", "parse_task_config", "task_source",
]
