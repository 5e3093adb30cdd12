"""PPO with a separate critic, with ``make_train_step`` called from your own loop.

The library gives the pure pieces: a train step ``(state, batch) -> (state, metrics)``
built from any ``apply_fn``, and the separate-critic layout of
:mod:`jaxrl_llm.models.critic` (policy hidden states and LM head, values from a second
transformer) with one optimizer per part (:func:`jaxrl_llm.train.actor_critic_optimizer`:
its own learning rate for the critic). Everything else is yours: here the loop shapes
its own token rewards (the task score on the last completion token, minus a small cost
per token), runs two PPO epochs per rollout by calling the step twice, and stops early
when the greedy eval is solved. The step computes GAE from ``rewards`` and the critic's
``old_values`` inside.

Run: ``python examples/ppo_custom_loop.py`` (``--steps 20`` for a quick look).
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

import jaxrl_llm as rl
from jaxrl_llm.models import Transformer, get_config, make_decode_fns, split_model
from jaxrl_llm.models.critic import actor_critic_apply, actor_critic_params
from jaxrl_llm.rollout import sample
from jaxrl_llm.tasks import get_task
from jaxrl_llm.train import actor_critic_optimizer


def main(steps: int = 200, batch_size: int = 64, epochs: int = 2, lr: float = 1e-3,
         critic_lr: float = 3e-3, token_cost: float = 0.01, eval_size: int = 256,
         seed: int = 0, log=print) -> dict:
  """Trains for up to ``steps`` rollouts; returns the per-step histories."""
  task = get_task("reverse")
  tok = task.tokenizer
  cfg = functools.partial(get_config, "tiny", tok.vocab_size,
                          max_seq_len=task.max_prompt_len + task.max_new_tokens)
  policy_graphdef, policy = split_model(Transformer(cfg(value_head=False),
                                                    rngs=nnx.Rngs(seed)))
  critic_graphdef, critic = split_model(Transformer(cfg(value_head=True),
                                                    rngs=nnx.Rngs(seed + 1)))
  apply_fn = actor_critic_apply(policy_graphdef, critic_graphdef)
  optimizer = actor_critic_optimizer(optax.adam(lr), optax.adam(critic_lr))
  config = rl.TrainConfig(use_value=True, advantage_estimator="gae", gamma=1.0, lam=0.95,
                          kl_mode="none")
  step = rl.make_train_step(apply_fn, optimizer, config)
  state = step.init(actor_critic_params(policy, critic))
  train_step = jax.jit(step, donate_argnums=0)
  forward = jax.jit(lambda params, batch: rl.policy_forward(apply_fn, params, batch))
  generate = jax.jit(functools.partial(sample, make_decode_fns(policy_graphdef)),
                     static_argnames=("max_new_tokens", "greedy"))

  def rollout(params, problems, key, greedy=False):
    prompts, prompt_mask = tok.encode_batch([p.prompt for p in problems],
                                            task.max_prompt_len)
    out = generate(params["policy"], prompts, prompt_mask, key, greedy=greedy,
                   max_new_tokens=task.max_new_tokens, eos_id=tok.eos_id)
    return out, tok.decode_batch(np.asarray(out.completion), np.asarray(out.completion_mask))

  rng, key = np.random.default_rng(seed), jax.random.key(seed)
  history: dict = {"reward": [], "vf_loss": [], "explained_variance": [], "eval_accuracy": []}
  for i in range(steps):
    problems = task.sample_prompts(rng, batch_size)
    out, texts = rollout(state.params, problems, jax.random.fold_in(key, i))
    scores = task.score(problems, texts)
    # Token rewards: a cost on every completion token, the score on the last one.
    prompt_len = out.tokens.shape[1] - out.completion.shape[1]
    loss_mask = np.concatenate([np.zeros((batch_size, prompt_len), np.float32),
                                np.asarray(out.completion_mask, np.float32)], axis=1)
    rewards = -token_cost * loss_mask
    last = prompt_len + np.maximum(np.asarray(out.lengths), 1) - 1
    rewards[np.arange(batch_size), last] += scores
    batch = {"tokens": np.asarray(out.tokens),
             "attention_mask": np.asarray(out.mask, np.float32),
             "loss_mask": loss_mask, "rewards": rewards}
    old_logp, _, old_values = forward(state.params, batch)   # behaviour policy, critic
    batch.update(old_logp=np.asarray(old_logp), old_values=np.asarray(old_values))
    for _ in range(epochs):                                  # PPO epochs, our way
      state, metrics = train_step(state, batch)
    history["reward"].append(float(np.mean(scores)))
    history["vf_loss"].append(float(metrics["vf_loss"]))
    history["explained_variance"].append(float(metrics["explained_variance"]))
    if (i + 1) % 25 == 0 or i + 1 == steps:
      problems = task.eval_problems(eval_size)
      _, texts = rollout(state.params, problems, None, greedy=True)
      history["eval_accuracy"].append(float(np.mean(task.exact(problems, texts))))
      log(f"step {i + 1:4d}  reward {history['reward'][-1]:.3f}  "
          f"vf_loss {history['vf_loss'][-1]:.4f}  "
          f"explained variance {history['explained_variance'][-1]:.3f}  "
          f"eval accuracy {history['eval_accuracy'][-1]:.3f}")
      if history["eval_accuracy"][-1] == 1.0:
        break
  return history


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  main(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
