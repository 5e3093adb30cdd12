"""Named algorithm settings (recipes) read by the trainer and the CLI.

A recipe is an advantage estimator (a name in
:data:`jaxrl_llm.train.registry.ADVANTAGE_ESTIMATOR_REGISTRY`) plus the
:class:`~jaxrl_llm.train.TrainConfig` fields that make the algorithm. The trainer
(:func:`jaxrl_llm.trainer.run_training`) builds ``TrainConfig(**{**recipe.train,
**user_overrides})``; ``jaxrl-llm train --algo NAME`` lists them. Adding an algorithm
is one :func:`register_recipe` line.

=================  =================  ============================================
recipe             estimator          train-step settings
=================  =================  ============================================
``ppo``            in-step GAE        value head, whitened advantages, KL (k1) in
                                      the reward (verl / OpenRLHF PPO)
``grpo``           group mean / std   no critic, k3 KL in the loss, token-mean
``dr_grpo``        group mean         as grpo, ``seq-mean-token-sum-norm`` by the
                                      max response length (Dr. GRPO)
``rloo``           leave-one-out      as grpo
``self_critical``  score - greedy     as grpo (one greedy rollout per prompt)
``reinforce_pp``   REINFORCE++        as grpo (batch-whitened discounted returns)
=================  =================  ============================================

Every recipe starts the KL coefficient at 0.001 (verl's ``kl_coef``).

Examples:
  >>> sorted(RECIPES)
  ['dr_grpo', 'grpo', 'ppo', 'reinforce_pp', 'rloo', 'self_critical']
  >>> get_recipe("dr_grpo").train_fields(max_new_tokens=16)["norm_length"]
  16
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxrl_llm.train.registry import get_advantage_estimator
from jaxrl_llm.train.state import GRPO_DEFAULTS

# Placeholder for a TrainConfig value known only once the task is (its response length).
MAX_NEW_TOKENS = "<max_new_tokens>"


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A named algorithm.

  Attributes:
    name: registry key (``--algo``).
    estimator: the registered advantage estimator; one that needs values runs inside
      the train step (``TrainConfig.advantage_estimator``), the others run on the
      rollout and hand the step ``advantages``.
    train: TrainConfig fields of the algorithm (``MAX_NEW_TOKENS`` is replaced by the
      task's response length).
    doc: one line for ``--help``.
  """
  name: str
  estimator: str
  train: Mapping[str, Any]
  doc: str

  def train_fields(self, max_new_tokens: int) -> dict:
    """The recipe's TrainConfig fields with ``MAX_NEW_TOKENS`` filled in."""
    return {k: (max_new_tokens if val == MAX_NEW_TOKENS else val)
            for k, val in self.train.items()}

  @property
  def in_step(self) -> bool:
    """True when the advantages are computed by the train step (critic-based)."""
    return get_advantage_estimator(self.estimator).needs_values

  @property
  def group(self) -> bool:
    """True when the estimator is a group baseline (needs ``group_size >= 2``)."""
    return get_advantage_estimator(self.estimator).group


RECIPES: dict[str, Recipe] = {}


def register_recipe(name: str, estimator: str, *, doc: str = "",
                    **train: Any) -> Recipe:
  """Registers a recipe: an advantage estimator plus TrainConfig fields."""
  get_advantage_estimator(estimator)     # raises for an unknown estimator
  recipe = Recipe(name=name, estimator=estimator, train=dict(train), doc=doc)
  RECIPES[name] = recipe
  return recipe


def get_recipe(name: str) -> Recipe:
  """The recipe ``name`` (ValueError listing the valid ones)."""
  if name not in RECIPES:
    raise ValueError(f"unknown algo {name!r}; valid algos: {', '.join(RECIPES)}")
  return RECIPES[name]


_KL = dict(kl_coef=0.001)
register_recipe("ppo", "gae", use_value=True, whiten_advantages=True, kl_mode="reward",
                reward_kl_kind="k1", doc="PPO: value head, GAE, KL in the reward", **_KL)
register_recipe("grpo", "grpo", doc="GRPO: group-normalised scores, KL in the loss",
                **GRPO_DEFAULTS, **_KL)
register_recipe("dr_grpo", "dr_grpo", loss_agg_mode="seq-mean-token-sum-norm",
                norm_length=MAX_NEW_TOKENS, doc="Dr. GRPO: no std, constant-length norm",
                **GRPO_DEFAULTS, **_KL)
register_recipe("rloo", "rloo", doc="RLOO: leave-one-out group baseline",
                **GRPO_DEFAULTS, **_KL)
register_recipe("self_critical", "self_critical", doc="self-critical: greedy baseline",
                **GRPO_DEFAULTS, **_KL)
register_recipe("reinforce_pp", "reinforce_pp",
                doc="REINFORCE++: whitened discounted returns", **GRPO_DEFAULTS, **_KL)

__all__ = ["Recipe", "RECIPES", "MAX_NEW_TOKENS", "register_recipe", "get_recipe"]
