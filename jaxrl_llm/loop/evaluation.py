"""Greedy evaluation of a policy on a task's held-out problems."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.tasks.base import Problem, Task


def decode(tokenizer: Any, completion: Any, completion_mask: Any) -> list:
  """Texts of sampled completions (``[B, N]`` tokens and mask)."""
  return tokenizer.decode_batch(np.asarray(completion), np.asarray(completion_mask))


def stop_ids(tokenizer: Any) -> Any:
  """The ids that end a completion: ``tokenizer.eos_ids`` when it has several (a
  Hugging Face tokenizer: its ``eos_token`` and the ``eos_token_id`` s of the model's
  ``generation_config.json`` and ``config.json``), else ``tokenizer.eos_id``.

  Examples:
    >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
    >>> stop_ids(CharTokenizer())
    2
  """
  ids = tuple(getattr(tokenizer, "eos_ids", ()) or ())
  return ids if len(ids) > 1 else tokenizer.eos_id


def evaluate(policy: Policy, params: Any, task: Task, problems: Sequence[Problem], *,
             procs: Any = None) -> dict:
  """Greedy accuracy (exact match) and mean reward on ``problems``.

  ``procs``: a multi-process run's :class:`~jaxrl_llm.loop.processes.Processes`: each
  process evaluates a contiguous share of ``problems`` and the per-problem results are
  all-gathered (every process returns the same means, those of one process).

  Returns:
    ``{"eval_accuracy": float, "eval_reward": float}``.
  """
  if procs is None or not procs.multi:
    exact, score = _greedy_results(policy, params, task, problems)
  else:
    n = len(problems)
    bounds = [n * p // procs.count for p in range(procs.count + 1)]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    exact, score = _greedy_results(policy, params, task,
                                   problems[bounds[procs.index]:bounds[procs.index + 1]])
    exact = procs.gather_uneven(exact, sizes)
    score = procs.gather_uneven(score, sizes)
  return {"eval_accuracy": float(np.mean(exact)), "eval_reward": float(np.mean(score))}


def _greedy_results(policy: Policy, params: Any, task: Task,
                    problems: Sequence[Problem]) -> tuple[np.ndarray, np.ndarray]:
  """Per-problem exact match and reward of the greedy completions (float64)."""
  if not len(problems):
    return np.zeros((0,)), np.zeros((0,))
  tok = task.tokenizer
  tokens, mask = tok.encode_batch([p.prompt for p in problems], task.max_prompt_len)
  out = policy.generate(params, tokens, mask, None, max_new_tokens=task.max_new_tokens,
                        eos_id=stop_ids(tok), greedy=True)
  texts = decode(tok, out.completion, out.completion_mask)
  return (np.asarray(task.exact(problems, texts), np.float64),
          np.asarray(task.score(problems, texts), np.float64))


__all__ = ["evaluate", "decode", "stop_ids"]
