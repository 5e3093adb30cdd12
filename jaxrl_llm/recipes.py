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
``vapo``           ``vapo_gae``       VAPO / VC-PPO: value head, decoupled GAE
                   (decoupled GAE,    (critic ``lam_value=1``, policy lambda
                   length-adaptive)   ``1 - 1/(0.05 l)``), critic warm-up 10
                                      steps, value lr 2x ``--lr``, clip-higher
                                      0.2 / 0.28, token-mean, positive-example
                                      NLL 0.1, no KL
``dapo``           group mean / std   DAPO: clip-higher 0.2 / 0.28, token-mean,
                                      dynamic sampling, soft overlong penalty
                                      (buffer: a quarter of a dataset's
                                      budget; none on built-in tasks), no KL
=================  =================  ============================================

Every recipe but vapo and dapo starts the KL coefficient at 0.001 (verl's
``kl_coef``). A recipe may also set run fields (``Recipe.run``: the critic warm-up,
dynamic sampling, the overlong buffer; :data:`RECIPE_RUN_FIELDS`) and scale the value
learning rate (``Recipe.value_lr_scale``); a flag the user gives overrides either
(``jaxrl-llm train --recipe vapo --critic-warmup-steps 0``).

Examples:
  >>> sorted(RECIPES)
  ['dapo', 'dr_grpo', 'grpo', 'ppo', 'reinforce_pp', 'rloo', 'self_critical', 'vapo']
  >>> get_recipe("vapo").train["clip_high"], get_recipe("dapo").run["dynamic_sampling"]
  (0.28, True)
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
# Placeholder for ``overlong_buffer``: a quarter of a dataset's response length (0 on
# the built-in tasks; ``RunConfig.overlong_buffer_tokens``).
OVERLONG_QUARTER = "<max_new_tokens // 4>"
# RunConfig fields a recipe may set (``Recipe.run``), with their value when none does.
RECIPE_RUN_FIELDS = {"critic_warmup_steps": 0, "dynamic_sampling": False,
                     "overlong_buffer": 0}


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
    run: RunConfig fields of the algorithm (keys of :data:`RECIPE_RUN_FIELDS`),
      used where the run leaves them None.
    value_lr_scale: the value parameters' learning rate as a multiple of ``--lr``
      (used when ``--value-lr`` is not given).
  """
  name: str
  estimator: str
  train: Mapping[str, Any]
  doc: str
  run: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  value_lr_scale: float = 1.0

  def train_fields(self, max_new_tokens: int) -> dict:
    """The recipe's TrainConfig fields with ``MAX_NEW_TOKENS`` filled in (and, for an
    in-step estimator, ``advantage_estimator`` set to it)."""
    fields = {k: (max_new_tokens if val == MAX_NEW_TOKENS else val)
              for k, val in self.train.items()}
    if self.in_step:
      fields.setdefault("advantage_estimator", self.estimator)
    return fields

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
                    run: Mapping[str, Any] | None = None, value_lr_scale: float = 1.0,
                    **train: Any) -> Recipe:
  """Registers a recipe: an advantage estimator plus TrainConfig fields (and optional
  run fields, ``run``, and a value learning-rate scale)."""
  get_advantage_estimator(estimator)     # raises for an unknown estimator
  unknown = sorted(set(run or {}) - set(RECIPE_RUN_FIELDS))
  if unknown:
    raise ValueError(f"`run` has {unknown}; a recipe may set {sorted(RECIPE_RUN_FIELDS)}.")
  recipe = Recipe(name=name, estimator=estimator, train=dict(train), doc=doc,
                  run=dict(run or {}), value_lr_scale=value_lr_scale)
  RECIPES[name] = recipe
  return recipe


def get_recipe(name: str) -> Recipe:
  """The recipe ``name`` (ValueError listing the valid ones)."""
  if name not in RECIPES:
    raise ValueError(f"unknown algo {name!r}; valid algos: {', '.join(RECIPES)}")
  return RECIPES[name]


_KL: dict[str, Any] = dict(kl_coef=0.001)
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

# Clip-higher (DAPO): a wider upper clip lets low-probability tokens rise.
_CLIP_HIGHER: dict[str, Any] = dict(clip_low=0.2, clip_high=0.28, loss_agg_mode="token-mean")
register_recipe("vapo", "vapo_gae", use_value=True, whiten_advantages=True,
                kl_mode="none", lam_value=1.0, lam_alpha=0.05, pos_nll_coef=0.1,
                run={"critic_warmup_steps": 10}, value_lr_scale=2.0,
                doc="VAPO: PPO with decoupled, length-adaptive GAE, critic warm-up, "
                    "clip-higher, positive NLL", **_CLIP_HIGHER)
register_recipe("dapo", "grpo", **{**GRPO_DEFAULTS, "kl_mode": "none"},
                run={"dynamic_sampling": True, "overlong_buffer": OVERLONG_QUARTER},
                doc="DAPO: group baseline, clip-higher, dynamic sampling, overlong "
                    "penalty, no KL", **_CLIP_HIGHER)

__all__ = ["Recipe", "RECIPES", "MAX_NEW_TOKENS", "OVERLONG_QUARTER", "RECIPE_RUN_FIELDS",
           "register_recipe", "get_recipe"]
