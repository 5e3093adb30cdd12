"""jaxrl_llm: exact, composable, long-sequence RL for language models in JAX.

A flat public API over small modules (import from here, not from submodules)::

  import jaxrl_llm as rl
  adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)
"""

from typing import TYPE_CHECKING

from jaxrl_llm._lazy import lazy_namespace, public_names

if TYPE_CHECKING:  # the names as static imports, for type checkers and IDEs
  from jaxrl_llm.advantages import (
    broadcast_to_tokens,
    decoupled_gae,
    default_gae_method,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    group_advantages,
    grpo_advantages,
    hybrid_advantages,
    lambda_returns,
    length_adaptive_lambda,
    nstep_returns,
    reinforce_pp_advantages,
    remax_advantages,
    reverse_linear_recurrence,
    rloo_advantages,
    self_critical_advantages,
  )
  from jaxrl_llm.attention import attention_with_lse, dot_product_attention
  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.control import (
    AdaptiveClipState,
    AdaptiveKLState,
    adaptive_clip_init,
    adaptive_clip_update,
    adaptive_kl_init,
    adaptive_kl_update,
  )
  from jaxrl_llm.logprobs import token_logprobs, token_logprobs_from_hidden
  from jaxrl_llm.losses import (
    AGGREGATION_MODES,
    KL_KINDS,
    aggregate,
    aggregate_parts,
    cispo_policy_loss,
    entropy_from_logits,
    gmpo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    reinforce_policy_loss,
    rollout_correction_weights,
    sapo_policy_loss,
    value_loss,
  )
  from jaxrl_llm.masked import (
    explained_variance,
    masked_count,
    masked_mean,
    masked_std,
    masked_sum,
    masked_var,
    masked_whiten,
  )
  from jaxrl_llm.packing import (
    PackPlan,
    check_segments,
    pack,
    pack_batch,
    plan_packing,
    segment_positions,
    segment_sum,
    unpack,
  )
  from jaxrl_llm.train import (
    TrainConfig,
    TrainState,
    init_train_state,
    make_grpo_train_step,
    make_ppo_train_step,
    make_train_step,
    policy_forward,
  )

__version__ = "0.1.0"

# Module -> the public names it defines, imported on first access (PEP 562), so
# ``import jaxrl_llm`` (and the ``jaxrl-llm`` command's flag checks and ``--help``)
# import no JAX. The ``TYPE_CHECKING`` block above names the same things for type
# checkers (a test keeps the two equal).
_EXPORTS = {
    "jaxrl_llm.masked": (  # masked statistics
        "masked_sum", "masked_count", "masked_mean", "masked_var", "masked_std",
        "masked_whiten", "explained_variance"),
    "jaxrl_llm.advantages": (
        "gae", "nstep_returns", "lambda_returns", "discounted_returns",
        "hybrid_advantages", "reverse_linear_recurrence", "self_critical_advantages",
        "group_advantages", "grpo_advantages", "rloo_advantages", "dr_grpo_advantages",
        "reinforce_pp_advantages", "remax_advantages", "broadcast_to_tokens",
        "decoupled_gae", "length_adaptive_lambda", "default_gae_method"),
    "jaxrl_llm.losses": (  # losses and aggregation
        "ppo_policy_loss", "gspo_policy_loss", "cispo_policy_loss", "sapo_policy_loss",
        "gmpo_policy_loss", "reinforce_policy_loss", "value_loss", "kl_penalty",
        "entropy_from_logits", "aggregate", "aggregate_parts", "AGGREGATION_MODES",
        "KL_KINDS", "rollout_correction_weights"),
    "jaxrl_llm.control": (  # controllers
        "adaptive_kl_init", "adaptive_kl_update", "adaptive_clip_init",
        "adaptive_clip_update", "AdaptiveKLState", "AdaptiveClipState"),
    "jaxrl_llm.logprobs": ("token_logprobs", "token_logprobs_from_hidden"),
    "jaxrl_llm.attention": ("dot_product_attention", "attention_with_lse"),
    "jaxrl_llm.train": (  # train steps
        "TrainConfig", "TrainState", "init_train_state", "make_train_step",
        "make_ppo_train_step", "make_grpo_train_step", "policy_forward"),
    "jaxrl_llm.checkpoint": ("Checkpointer",),
    "jaxrl_llm.packing": (  # packed batches (several sequences a row)
        "PackPlan", "plan_packing", "pack", "unpack", "pack_batch", "check_segments",
        "segment_positions", "segment_sum"),
}
__all__ = public_names(_EXPORTS)

__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, globals())
