"""The task and the policy of a run: built-in or from local files.

* ``run.dataset`` set: a :class:`~jaxrl_llm.tasks.JsonlTask` over that JSONL file, scored
  by the reward ``run.reward`` (:data:`jaxrl_llm.tasks.REWARDS`), ``run.max_new_tokens``
  per completion; else the built-in task ``run.task``.
* ``run.model`` a folder (a local Hugging Face Llama / Qwen2 / Qwen3 checkpoint): the
  model from :func:`jaxrl_llm.models.from_pretrained` (value head, when the recipe uses
  one, initialised to zeros) and its tokenizer
  (:class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer`, prompts rendered with its chat
  template when it has one); else the reference transformer preset, with the task's
  character tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.train import TrainConfig


def is_checkpoint(model: str) -> bool:
  """Whether ``model`` names a local model folder (a ``config.json`` inside)."""
  return os.path.isfile(os.path.join(model, "config.json"))


def make_task(run: RunConfig) -> Any:
  """The run's task: a JSONL dataset (``run.dataset``) or the built-in ``run.task``."""
  if run.dataset is None:
    if is_checkpoint(run.model):
      raise ValueError("--model PATH (a Hugging Face checkpoint) needs --dataset: the "
                       "built-in tasks use their own character tokenizer.")
    from jaxrl_llm.tasks import get_task
    return get_task(run.task)
  from jaxrl_llm.tasks import JsonlTask
  tokenizer = None
  chat = False
  if is_checkpoint(run.model):
    from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
    tokenizer = HFTokenizer.from_pretrained(run.model)
    chat = tokenizer.chat_template is not None
  return JsonlTask(path=run.dataset, reward_fn=run.reward, tokenizer=tokenizer,
                   chat=chat, max_new_tokens=run.max_new_tokens)


def make_policy(run: RunConfig, task: Any, config: TrainConfig) -> Policy:
  """The run's policy: ``run.model`` loaded from its folder, or the preset."""
  tok = task.tokenizer
  if not is_checkpoint(run.model):
    return Policy.reference(run.model, tok.vocab_size,
                            task.max_prompt_len + task.max_new_tokens, tok.pad_id,
                            value_head=config.use_value, seed=run.seed,
                            temperature=config.temperature)
  from jaxrl_llm.models import (from_pretrained, make_apply_fn, make_decode_fns,
                                split_model)
  model = from_pretrained(run.model, value_head=config.use_value)
  if tok.vocab_size > model.config.vocab_size:
    raise ValueError(f"the tokenizer of {run.model!r} has {tok.vocab_size} tokens, more "
                     f"than the model's vocab_size {model.config.vocab_size}.")
  graphdef, params = split_model(model)
  return Policy(make_apply_fn(graphdef), make_decode_fns(graphdef), params,
                pad_id=tok.pad_id, temperature=config.temperature)


__all__ = ["is_checkpoint", "make_policy", "make_task"]
