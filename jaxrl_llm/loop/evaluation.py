"""Greedy evaluation of a policy on a task's held-out problems."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxrl_llm.loop.policy import Policy


def decode(tokenizer: Any, completion: Any, completion_mask: Any) -> list:
  """Texts of sampled completions (``[B, N]`` tokens and mask)."""
  return tokenizer.decode_batch(np.asarray(completion), np.asarray(completion_mask))


def evaluate(policy: Policy, params: Any, task: Any, problems: Sequence[Any]) -> dict:
  """Greedy accuracy (exact match) and mean reward on ``problems``.

  Returns:
    ``{"eval_accuracy": float, "eval_reward": float}``.
  """
  tok = task.tokenizer
  tokens, mask = tok.encode_batch([p.prompt for p in problems], task.max_prompt_len)
  out = policy.generate(params, tokens, mask, None, max_new_tokens=task.max_new_tokens,
                        eos_id=tok.eos_id, greedy=True)
  texts = decode(tok, out.completion, out.completion_mask)
  return {"eval_accuracy": float(np.mean(task.exact(problems, texts))),
          "eval_reward": float(np.mean(task.score(problems, texts)))}


__all__ = ["evaluate", "decode"]
