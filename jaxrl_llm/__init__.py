"""jaxrl_llm: exact, composable, long-sequence RL for language models in JAX.

A flat public API over small modules (import from here, not from submodules)::

  import jaxrl_llm as rl
  adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)
"""

from typing import TYPE_CHECKING

from jaxrl_llm._lazy import lazy_namespace

if TYPE_CHECKING:  # the names as static imports, for type checkers and IDEs
  from jaxrl_llm.masked import (
      explained_variance, masked_count, masked_mean, masked_std, masked_sum, masked_var,
      masked_whiten)
  from jaxrl_llm.advantages import (
      broadcast_to_tokens, discounted_returns, dr_grpo_advantages, gae, group_advantages,
      grpo_advantages, hybrid_advantages, lambda_returns, nstep_returns,
      reinforce_pp_advantages, remax_advantages, reverse_linear_recurrence,
      rloo_advantages, self_critical_advantages)
  from jaxrl_llm.advantages import decoupled_gae, length_adaptive_lambda
  from jaxrl_llm.losses import (
      AGGREGATION_MODES, KL_KINDS, aggregate, aggregate_parts, cispo_policy_loss,
      entropy_from_logits, gmpo_policy_loss, gspo_policy_loss, kl_penalty,
      ppo_policy_loss, reinforce_policy_loss, sapo_policy_loss, value_loss)
  from jaxrl_llm.losses import rollout_correction_weights
  from jaxrl_llm.control import (
      AdaptiveClipState, AdaptiveKLState, adaptive_clip_init, adaptive_clip_update,
      adaptive_kl_init, adaptive_kl_update)
  from jaxrl_llm.logprobs import token_logprobs, token_logprobs_from_hidden
  from jaxrl_llm.attention import attention_with_lse, dot_product_attention
  from jaxrl_llm.train import (
      TrainConfig, TrainState, init_train_state, make_grpo_train_step,
      make_ppo_train_step, make_train_step, policy_forward)
  from jaxrl_llm.checkpoint import Checkpointer

__version__ = "0.1.0"

__all__ = [
    # masked statistics
    "masked_sum", "masked_count", "masked_mean", "masked_var", "masked_std",
    "masked_whiten", "explained_variance",
    # advantages
    "gae", "nstep_returns", "lambda_returns", "discounted_returns", "hybrid_advantages",
    "reverse_linear_recurrence", "self_critical_advantages", "group_advantages",
    "grpo_advantages", "rloo_advantages", "dr_grpo_advantages",
    "reinforce_pp_advantages", "remax_advantages", "broadcast_to_tokens",
    "decoupled_gae", "length_adaptive_lambda",
    # losses and aggregation
    "ppo_policy_loss", "gspo_policy_loss", "cispo_policy_loss", "sapo_policy_loss",
    "gmpo_policy_loss", "reinforce_policy_loss", "value_loss", "kl_penalty",
    "entropy_from_logits", "aggregate", "aggregate_parts", "AGGREGATION_MODES",
    "KL_KINDS",
    "rollout_correction_weights",
    # controllers
    "adaptive_kl_init", "adaptive_kl_update", "adaptive_clip_init",
    "adaptive_clip_update", "AdaptiveKLState", "AdaptiveClipState",
    # log-probs
    "token_logprobs", "token_logprobs_from_hidden",
    # attention
    "dot_product_attention", "attention_with_lse",
    # train steps and checkpoints
    "TrainConfig", "TrainState", "init_train_state", "make_train_step",
    "make_ppo_train_step", "make_grpo_train_step", "policy_forward", "Checkpointer",
]

# Public name -> the module that defines it: imported on first access (PEP 562), so
# ``import jaxrl_llm`` (and the ``jaxrl-llm`` command's flag checks and ``--help``)
# import no JAX.
_LAZY = {
    # jaxrl_llm.masked
    "explained_variance": "jaxrl_llm.masked", "masked_count": "jaxrl_llm.masked",
    "masked_mean": "jaxrl_llm.masked", "masked_std": "jaxrl_llm.masked",
    "masked_sum": "jaxrl_llm.masked", "masked_var": "jaxrl_llm.masked",
    "masked_whiten": "jaxrl_llm.masked",
    # jaxrl_llm.advantages
    "broadcast_to_tokens": "jaxrl_llm.advantages",
    "discounted_returns": "jaxrl_llm.advantages",
    "dr_grpo_advantages": "jaxrl_llm.advantages", "gae": "jaxrl_llm.advantages",
    "group_advantages": "jaxrl_llm.advantages", "grpo_advantages": "jaxrl_llm.advantages",
    "hybrid_advantages": "jaxrl_llm.advantages", "lambda_returns": "jaxrl_llm.advantages",
    "nstep_returns": "jaxrl_llm.advantages",
    "reinforce_pp_advantages": "jaxrl_llm.advantages",
    "remax_advantages": "jaxrl_llm.advantages",
    "reverse_linear_recurrence": "jaxrl_llm.advantages",
    "rloo_advantages": "jaxrl_llm.advantages",
    "self_critical_advantages": "jaxrl_llm.advantages",
    "decoupled_gae": "jaxrl_llm.advantages",
    "length_adaptive_lambda": "jaxrl_llm.advantages",
    # jaxrl_llm.losses
    "AGGREGATION_MODES": "jaxrl_llm.losses", "KL_KINDS": "jaxrl_llm.losses",
    "aggregate": "jaxrl_llm.losses", "aggregate_parts": "jaxrl_llm.losses",
    "cispo_policy_loss": "jaxrl_llm.losses", "entropy_from_logits": "jaxrl_llm.losses",
    "gmpo_policy_loss": "jaxrl_llm.losses", "gspo_policy_loss": "jaxrl_llm.losses",
    "kl_penalty": "jaxrl_llm.losses", "ppo_policy_loss": "jaxrl_llm.losses",
    "reinforce_policy_loss": "jaxrl_llm.losses", "sapo_policy_loss": "jaxrl_llm.losses",
    "value_loss": "jaxrl_llm.losses", "rollout_correction_weights": "jaxrl_llm.losses",
    # jaxrl_llm.control
    "AdaptiveClipState": "jaxrl_llm.control", "AdaptiveKLState": "jaxrl_llm.control",
    "adaptive_clip_init": "jaxrl_llm.control", "adaptive_clip_update": "jaxrl_llm.control",
    "adaptive_kl_init": "jaxrl_llm.control", "adaptive_kl_update": "jaxrl_llm.control",
    # jaxrl_llm.logprobs
    "token_logprobs": "jaxrl_llm.logprobs",
    "token_logprobs_from_hidden": "jaxrl_llm.logprobs",
    # jaxrl_llm.attention
    "attention_with_lse": "jaxrl_llm.attention",
    "dot_product_attention": "jaxrl_llm.attention",
    # jaxrl_llm.train
    "TrainConfig": "jaxrl_llm.train", "TrainState": "jaxrl_llm.train",
    "init_train_state": "jaxrl_llm.train", "make_grpo_train_step": "jaxrl_llm.train",
    "make_ppo_train_step": "jaxrl_llm.train", "make_train_step": "jaxrl_llm.train",
    "policy_forward": "jaxrl_llm.train",
    # jaxrl_llm.checkpoint
    "Checkpointer": "jaxrl_llm.checkpoint",
}

__getattr__, __dir__ = lazy_namespace(__name__, _LAZY, __all__, globals())
