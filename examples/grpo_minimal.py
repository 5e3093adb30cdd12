"""GRPO on the built-in ``reverse`` task: the whole RL loop on one screen.

A tiny transformer, trained from scratch, learns to reverse a 3-digit string ("865=" ->
"568"). Each step: sample ``group_size`` completions of each prompt, score them (partial
credit per correct digit), turn the scores into group-normalised advantages, and take
one jitted PPO-clipped update. Public API only; the library's own loop
(``jaxrl-llm train``) adds checkpoints, a KL reference, metrics files and plots.

Run: ``python examples/grpo_minimal.py``: 400 steps, about 7 minutes on 2 shared CPU
cores, greedy eval accuracy 0 at the start, 0.19 at step 200 and 0.99 at step 400
(``benchmarks/RESULTS.md``); ``--steps 20`` for a quick look.
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

import jaxrl_llm as rl
from jaxrl_llm.models import Transformer, get_config, make_apply_fn, make_decode_fns, split_model
from jaxrl_llm.rollout import sample
from jaxrl_llm.tasks import get_task


def main(steps: int = 400, prompts_per_step: int = 32, group_size: int = 8,
         lr: float = 1e-3, eval_every: int = 50, eval_size: int = 256, seed: int = 0,
         log=print) -> dict:
  """Trains for ``steps`` steps; returns ``{"reward": [per step], "eval_accuracy":
  [before training, then every eval_every steps], "metrics": last step's metrics}``."""
  task = get_task("reverse")
  tok = task.tokenizer
  cfg = get_config("tiny", tok.vocab_size, value_head=False,
                   max_seq_len=task.max_prompt_len + task.max_new_tokens)
  graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(seed)))
  apply_fn = make_apply_fn(graphdef)

  # The train step: clipped surrogate on per-sequence advantages, no critic, no KL.
  config = rl.TrainConfig(use_value=False, whiten_advantages=False, kl_mode="none")
  step = rl.make_train_step(apply_fn, optax.adam(lr), config)
  state, train_step = step.init(params), jax.jit(step, donate_argnums=0)
  generate = jax.jit(functools.partial(sample, make_decode_fns(graphdef)),
                     static_argnames=("max_new_tokens", "greedy"))
  logprobs = jax.jit(lambda p, batch: rl.policy_forward(apply_fn, p, batch)[0])

  def rollout(params, problems, key, greedy=False):
    prompts, prompt_mask = tok.encode_batch([p.prompt for p in problems],
                                            task.max_prompt_len)
    out = generate(params, prompts, prompt_mask, key, max_new_tokens=task.max_new_tokens,
                   eos_id=tok.eos_id, greedy=greedy)
    return out, tok.decode_batch(np.asarray(out.completion), np.asarray(out.completion_mask))

  def evaluate(params):   # greedy exact-match accuracy on held-out problems
    problems = task.eval_problems(eval_size)
    _, texts = rollout(params, problems, None, greedy=True)
    return float(np.mean(task.exact(problems, texts)))

  rng, key = np.random.default_rng(seed), jax.random.key(seed)
  history: dict = {"reward": [], "eval_accuracy": [evaluate(state.params)]}
  log(f"step    0  eval accuracy {history['eval_accuracy'][0]:.3f}")
  metrics: dict = {}
  for i in range(steps):
    # 1. Rollout: group_size completions per prompt, a group in consecutive rows.
    prompts = task.sample_prompts(rng, prompts_per_step)
    problems = [p for p in prompts for _ in range(group_size)]
    out, texts = rollout(state.params, problems, jax.random.fold_in(key, i))
    # 2. Reward in [0, 1], 1 exactly for the right answer.
    scores = task.score(problems, texts)
    # 3. Advantages: each score against its group (mean baseline, group std).
    advantages = rl.grpo_advantages(scores, group_size=group_size)
    # 4. One update: the loss covers the completion tokens of [prompt | completion].
    prompt_len = out.tokens.shape[1] - out.completion.shape[1]
    batch = {"tokens": np.asarray(out.tokens),
             "attention_mask": np.asarray(out.mask, np.float32),
             "loss_mask": np.concatenate([np.zeros((len(problems), prompt_len), np.float32),
                                          np.asarray(out.completion_mask, np.float32)], 1),
             "advantages": np.asarray(advantages)}
    batch["old_logp"] = np.asarray(logprobs(state.params, batch))
    state, metrics = train_step(state, batch)
    history["reward"].append(float(np.mean(scores)))
    # 5. Eval now and then.
    if (i + 1) % eval_every == 0 or i + 1 == steps:
      history["eval_accuracy"].append(evaluate(state.params))
      log(f"step {i + 1:4d}  reward {history['reward'][-1]:.3f}  "
          f"eval accuracy {history['eval_accuracy'][-1]:.3f}  "
          f"entropy {float(metrics['entropy']):.3f}")
  history["metrics"] = {k: float(x) for k, x in metrics.items()}
  return history


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--prompts-per-step", type=int, default=32)
  parser.add_argument("--group-size", type=int, default=8)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  main(steps=args.steps, prompts_per_step=args.prompts_per_step,
       group_size=args.group_size, lr=args.lr, seed=args.seed)
