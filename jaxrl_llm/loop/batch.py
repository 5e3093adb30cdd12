"""One rollout turned into a train batch: prompts -> G completions -> scores -> batch.

The advantage estimator is the recipe's (:mod:`jaxrl_llm.recipes`): a critic-based
one (PPO's GAE) runs inside the train step, so the batch carries ``rewards`` and
``old_values``; the others run here, through the registry
(:func:`jaxrl_llm.train.compute_advantages`), and the batch carries ``advantages``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.evaluation import decode, stop_ids
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.recipes import get_recipe
from jaxrl_llm.train import AdvantageInputs, TrainConfig, compute_advantages
from jaxrl_llm.train.registry import get_advantage_estimator


def sequence_advantages(run: RunConfig, scores: Any, greedy_scores: Any = None) -> Any:
  """Per-sequence advantages ``[B]`` of the run's critic-free group / greedy estimator."""
  adv, _ = compute_advantages(get_recipe(run.algo).estimator, AdvantageInputs(
      scores=scores, greedy_scores=greedy_scores, group_size=run.group_size), {})
  return adv


def build_batch(run: RunConfig, task: Any, policy: Policy, params: Any, ref_params: Any,
                rng_np: np.random.Generator, key: jax.Array,
                config: Optional[TrainConfig] = None) -> tuple[dict, dict]:
  """One rollout: ``(batch, stats)`` with ``stats`` reward, accuracy, response length.

  ``rng_np`` draws the prompts and ``key`` the samples, so a step is reproducible
  from ``(seed, step)``. ``ref_params`` is ``policy.ref_params(...)`` of the frozen
  reference weights (scored by ``policy.ref_forward``). ``config`` is the run's
  TrainConfig (built when None).
  """
  config = config or run.train_config(task.max_new_tokens)
  recipe = get_recipe(run.algo)
  tok = task.tokenizer
  problems = task.sample_prompts(rng_np, run.prompts_per_step)
  prompts, prompt_mask = tok.encode_batch([p.prompt for p in problems],
                                          task.max_prompt_len)
  rep = lambda x: np.repeat(x, run.group_size, axis=0)
  out = policy.generate(params, rep(prompts), rep(prompt_mask), key,
                        max_new_tokens=task.max_new_tokens, eos_id=stop_ids(tok),
                        temperature=config.temperature)
  texts = decode(tok, out.completion, out.completion_mask)
  group_problems = [p for p in problems for _ in range(run.group_size)]
  scores = task.score(group_problems, texts)
  exact = task.exact(group_problems, texts)

  prompt_len = prompts.shape[1]
  completion_mask = np.asarray(out.completion_mask, np.float32)
  loss_mask = np.concatenate([np.zeros((len(texts), prompt_len), np.float32),
                              completion_mask], axis=1)
  batch = {"tokens": np.asarray(out.tokens, np.int32),
           "attention_mask": np.asarray(out.mask, np.float32), "loss_mask": loss_mask}
  old_logp, _, old_values = policy.forward(params, batch)
  ref_logp, _, _ = policy.ref_forward(ref_params, batch)
  batch.update(old_logp=np.asarray(old_logp), ref_logp=np.asarray(ref_logp))
  # The score is the reward of the last generated token (EOS, or the last one).
  last = prompt_len + np.maximum(np.asarray(out.lengths), 1) - 1
  rewards = np.zeros(loss_mask.shape, np.float32)
  rewards[np.arange(len(texts)), last] = scores
  if config.use_value:
    batch["old_values"] = np.asarray(old_values)
  if recipe.in_step:
    batch["rewards"] = rewards
  else:
    greedy_scores = None
    if get_advantage_estimator(recipe.estimator).needs_greedy:
      g = policy.generate(params, prompts, prompt_mask, None,
                          max_new_tokens=task.max_new_tokens, eos_id=stop_ids(tok),
                          greedy=True)
      greedy_scores = rep(task.score(problems, decode(tok, g.completion,
                                                      g.completion_mask)))
    adv, _ = compute_advantages(recipe.estimator, AdvantageInputs(
        rewards=rewards, mask=loss_mask, scores=np.asarray(scores, np.float32),
        greedy_scores=greedy_scores, group_size=run.group_size),
        config.hparam_values())
    batch["advantages"] = np.asarray(adv)
  stats = {"reward": float(np.mean(scores)), "accuracy": float(np.mean(exact)),
           "response_length": float(np.mean(np.asarray(out.lengths)))}
  return batch, stats


__all__ = ["build_batch", "sequence_advantages"]
