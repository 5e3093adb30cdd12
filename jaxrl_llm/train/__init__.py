"""Train state and pure train steps (PPO / GRPO family)."""

from jaxrl_llm.train.state import (POLICY_LOSSES, TRACED_HPARAMS, TrainConfig, TrainState,
                                   init_train_state)
from jaxrl_llm.train.step import (default_positions, make_grpo_train_step,
                                  make_ppo_train_step, make_train_step, policy_forward,
                                  prepare_batch, validate_batch)

__all__ = ["TrainConfig", "TrainState", "init_train_state", "make_train_step",
           "make_ppo_train_step", "make_grpo_train_step", "policy_forward",
           "prepare_batch", "validate_batch", "default_positions", "POLICY_LOSSES",
           "TRACED_HPARAMS"]
