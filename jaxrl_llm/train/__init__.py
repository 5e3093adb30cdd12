"""Train state and pure train steps (PPO / GRPO family).

``jaxrl_llm.train`` is the train-*step* package (one pure update of a
:class:`TrainState` on a batch); the RL *loop* (sampling, scoring, evaluation,
checkpoints) is :func:`jaxrl_llm.trainer.run_training`.
"""

from jaxrl_llm.train.registry import (ADVANTAGE_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY,
                                      AdvantageInputs, compute_advantages,
                                      get_advantage_estimator, get_policy_loss,
                                      register_advantage_estimator,
                                      register_policy_loss)
from jaxrl_llm.train.state import (POLICY_LOSSES, TRACED_HPARAMS, TrainConfig, TrainState,
                                   init_train_state)
from jaxrl_llm.train.step import (GRPO_DEFAULTS, ModelOutput, TrainStep, as_model_output,
                                  check_hparams,
                                  default_positions, make_grpo_train_step,
                                  make_ppo_train_step, make_train_step, policy_forward,
                                  prepare_batch, validate_batch)

__all__ = ["TrainConfig", "TrainState", "init_train_state", "make_train_step",
           "make_ppo_train_step", "make_grpo_train_step", "policy_forward",
           "prepare_batch", "validate_batch", "default_positions", "check_hparams", "TrainStep",
           "ModelOutput", "as_model_output",
           "POLICY_LOSSES", "TRACED_HPARAMS", "GRPO_DEFAULTS", "POLICY_LOSS_REGISTRY",
           "ADVANTAGE_ESTIMATOR_REGISTRY", "AdvantageInputs", "register_policy_loss",
           "register_advantage_estimator", "get_policy_loss", "get_advantage_estimator",
           "compute_advantages"]
