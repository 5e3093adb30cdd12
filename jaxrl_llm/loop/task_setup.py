"""The task of a run, built without JAX (the command builds it before the slow imports).

* ``run.dataset`` set: a :class:`~jaxrl_llm.tasks.JsonlTask` over that JSONL file, scored
  by the reward ``run.reward`` (:data:`jaxrl_llm.tasks.REWARDS`), ``run.max_new_tokens``
  per completion, evaluated on ``run.eval_dataset`` or the ``run.holdout`` rows (a
  fraction, or a count >= 1), else on its training rows.
* ``run.task`` a task source's ``PREFIX:SPEC`` (``rg:chain_sum``,
  :data:`jaxrl_llm.tasks.TASK_SOURCES`): the source's task with the settings
  ``run.task_config``, ``run.max_new_tokens`` per completion and ``run.eval_size``
  evaluation problems.
* else the built-in task ``run.task``.

With a checkpoint ``run.model`` the dataset's and the source's prompts are encoded by
its tokenizer (:class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer`) and rendered with
its chat template when it has one; else a character tokenizer is built over the
task's texts (for the built-in model, trained from scratch).
"""

from __future__ import annotations

import os
from typing import Any

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.tasks.base import Task


def run_tokenizer(run: RunConfig) -> tuple[Any, bool]:
  """``(tokenizer, chat)``: the checkpoint ``run.model``'s tokenizer and whether it
  has a chat template; ``(None, False)`` for a preset (the task builds its own)."""
  from jaxrl_llm.model_files import checkpoint_path
  path = checkpoint_path(run.model)
  if path is None:
    return None, False
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
    raise ValueError(f"--model {run.model} has no tokenizer.json (only fast tokenizers "
                     "are supported)")
  tokenizer = HFTokenizer.from_pretrained(path)
  return tokenizer, tokenizer.chat_template is not None


def make_task(run: RunConfig) -> Task:
  """The run's task (see the module docstring).

  Examples:
    >>> make_task(RunConfig(task="sort")).name
    'sort'
  """
  from jaxrl_llm.tasks import get_task, parse_task_config, task_source
  source = task_source(run.task) if run.dataset is None else None
  if run.dataset is None and source is None:
    from jaxrl_llm.model_files import checkpoint_path
    if checkpoint_path(run.model) is not None:
      raise ValueError("--model PATH (a Hugging Face checkpoint) needs --dataset or a "
                       "task source's --task (rg:...): the built-in tasks use their own "
                       "character tokenizer.")
    assert run.task is not None          # validate(): a run without --dataset has one
    return get_task(run.task)
  tokenizer, chat = run_tokenizer(run)
  if source is not None:
    return source[0].build(source[1], parse_task_config(run.task_config),
                           tokenizer=tokenizer, chat=chat,
                           max_new_tokens=run.max_new_tokens, eval_size=run.eval_size)
  from jaxrl_llm.tasks import JsonlTask
  assert run.dataset is not None
  holdout = run.holdout or 0.0
  return JsonlTask(path=run.dataset, reward_fn=run.reward, tokenizer=tokenizer,
                   chat=chat, max_new_tokens=run.max_new_tokens,
                   eval_path=run.eval_dataset,
                   holdout=holdout if holdout < 1 else 0.0,
                   holdout_rows=int(holdout) if holdout >= 1 else 0)


__all__ = ["make_task", "run_tokenizer"]
