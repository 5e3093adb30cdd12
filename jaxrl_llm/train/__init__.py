"""Train state and pure train steps (PPO / GRPO family), their optimizers, and the
sharded (``jax.jit`` on a mesh) and ``jax.pmap`` wrappers of the step.

``jaxrl_llm.train`` is the train-*step* package (one pure update of a
:class:`TrainState` on a batch); the RL *loop* (sampling, scoring, evaluation,
checkpoints) is :func:`jaxrl_llm.loop.run.run_training`.
"""

from typing import TYPE_CHECKING

from jaxrl_llm._lazy import lazy_namespace, public_names

if TYPE_CHECKING:  # the names as static imports, for type checkers and IDEs
  from jaxrl_llm.train.config import GRPO_DEFAULTS, TRACED_HPARAMS, TrainConfig
  from jaxrl_llm.train.optim import (
    FrozenState,
    actor_critic_optimizer,
    freeze_for,
    policy_value_optimizer,
  )
  from jaxrl_llm.train.pmap import make_pmap_train_step
  from jaxrl_llm.train.registry import (
    ADVANTAGE_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdvantageInputs,
    compute_advantages,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
  )
  from jaxrl_llm.train.sharded import shard_apply_fn, shard_train_step
  from jaxrl_llm.train.step import (
    ModelOutput,
    TrainStep,
    as_model_output,
    check_hparams,
    default_positions,
    make_grpo_train_step,
    make_ppo_train_step,
    make_train_step,
    policy_forward,
    prepare_batch,
    validate_batch,
  )
  from jaxrl_llm.train.train_state import TrainState, init_train_state

# Module -> its public names, imported on first access (see jaxrl_llm._lazy).
_EXPORTS = {
    "jaxrl_llm.train.config": ("TrainConfig", "TRACED_HPARAMS", "GRPO_DEFAULTS"),
    "jaxrl_llm.train.train_state": ("TrainState", "init_train_state"),
    "jaxrl_llm.train.step": (
        "make_train_step", "make_ppo_train_step", "make_grpo_train_step",
        "policy_forward", "prepare_batch", "validate_batch", "default_positions",
        "check_hparams", "TrainStep", "ModelOutput", "as_model_output"),
    "jaxrl_llm.train.registry": (
        "POLICY_LOSS_REGISTRY", "ADVANTAGE_ESTIMATOR_REGISTRY", "AdvantageInputs",
        "register_policy_loss", "register_advantage_estimator", "get_policy_loss",
        "get_advantage_estimator", "compute_advantages"),
    "jaxrl_llm.train.optim": ("actor_critic_optimizer", "policy_value_optimizer",
                              "freeze_for", "FrozenState"),
    "jaxrl_llm.train.sharded": ("shard_train_step", "shard_apply_fn"),
    "jaxrl_llm.train.pmap": ("make_pmap_train_step",),
}
__all__ = public_names(_EXPORTS)

__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, globals())
