"""Named algorithm settings (recipes): one :class:`Recipe` object each, read only by
:func:`jaxrl_llm.loop.resolve.resolve`.

A recipe is an advantage estimator (a name in
:data:`jaxrl_llm.train.registry.ADVANTAGE_ESTIMATOR_REGISTRY`), the
:class:`~jaxrl_llm.train.TrainConfig` fields that make the algorithm, its rollout-side
settings (:class:`Sampling`: dynamic sampling, the overlong buffer) and its critic
settings (warm-up steps, value learning-rate scale). A value known only once the task
is (its response budget) is a :class:`Derived` callable of the :class:`Budget`.
Adding an algorithm, rollout-side behaviour included, is one :func:`register_recipe`
call in this file; ``jaxrl-llm train --algo NAME`` lists them.

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
``kl_coef``). A flag the user gives overrides any recipe setting
(``jaxrl-llm train --algo vapo --critic-warmup-steps 0``).

Examples:
  >>> sorted(RECIPES)
  ['dapo', 'dr_grpo', 'grpo', 'ppo', 'reinforce_pp', 'rloo', 'self_critical', 'vapo']
  >>> get_recipe("vapo").train["clip_high"], get_recipe("dapo").sampling.dynamic_sampling
  (0.28, True)
  >>> get_recipe("dr_grpo").train_fields(Budget(16, dataset=False))["norm_length"]
  16
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxrl_llm.train.config import GRPO_DEFAULTS
from jaxrl_llm.train.registry import (
  DEFAULT_CLIP_LOW,
  AdvantageEstimatorSpec,
  get_advantage_estimator,
)


class Budget(NamedTuple):
  """What a :class:`Derived` recipe value may depend on.

  Attributes:
    max_new_tokens: tokens sampled per completion (the task's response budget).
    dataset: whether the budget is a chosen generation length (``--max-new-tokens``
      of a JSONL ``--dataset`` or a task source's ``--task rg:...``) rather than a
      built-in task's (exactly its longest answer plus eos).
  """
  max_new_tokens: int
  dataset: bool


@dataclasses.dataclass(frozen=True)
class Derived:
  """A recipe value computed from the run's :class:`Budget`.

  Attributes:
    fn: ``fn(budget) -> value``.
    text: how ``--help`` shows it (e.g. ``<max_new_tokens // 4>``).
  """
  fn: Callable[[Budget], Any]
  text: str

  def __call__(self, budget: Budget) -> Any:
    return self.fn(budget)

  def __str__(self) -> str:
    return self.text


def value_of(val: Any, budget: Budget) -> Any:
  """``val``, or its value for ``budget`` when it is :class:`Derived`."""
  return val(budget) if isinstance(val, Derived) else val


@dataclasses.dataclass(frozen=True)
class Sampling:
  """A recipe's rollout-side settings (``--dynamic-sampling``, ``--overlong-buffer``
  override them).

  Attributes:
    dynamic_sampling: DAPO's dynamic sampling (drop groups whose rewards are all
      equal and draw more).
    overlong_buffer: DAPO's soft overlong penalty zone in tokens (0: off), or a
      :class:`Derived` value of the budget.
  """
  dynamic_sampling: bool = False
  overlong_buffer: int | Derived = 0


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A named algorithm.

  Attributes:
    name: registry key (``--algo``).
    estimator: the registered advantage estimator; one that needs values runs inside
      the train step (``TrainConfig.advantage_estimator``), the others run on the
      rollout and hand the step ``advantages``.
    doc: one line for ``--help``.
    train: TrainConfig fields of the algorithm (a :class:`Derived` value is computed
      from the run's budget).
    sampling: the rollout-side settings.
    critic_warmup_steps: first steps that train only the value function
      (``--critic-warmup-steps`` overrides it).
    value_lr_scale: the value parameters' learning rate as a multiple of ``--lr``
      (used when ``--value-lr`` is not given).
  """
  name: str
  estimator: str
  doc: str
  train: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  sampling: Sampling = Sampling()
  critic_warmup_steps: int = 0
  value_lr_scale: float = 1.0

  @property
  def spec(self) -> AdvantageEstimatorSpec:
    """The registered advantage estimator."""
    return get_advantage_estimator(self.estimator)

  @property
  def in_step(self) -> bool:
    """True when the advantages are computed by the train step (critic-based)."""
    return self.spec.needs_values

  @property
  def group(self) -> bool:
    """True when the estimator is a group baseline (needs ``group_size >= 2``)."""
    return self.spec.group

  def train_fields(self, budget: Budget) -> dict:
    """The recipe's TrainConfig fields for ``budget`` (and, for an in-step estimator,
    ``advantage_estimator`` set to it)."""
    fields = {k: value_of(val, budget) for k, val in self.train.items()}
    if self.in_step:
      fields.setdefault("advantage_estimator", self.estimator)
    return fields

  def run_settings(self) -> dict:
    """The recipe's settings of RunConfig fields (for ``--help``):
    ``{field: value}``."""
    return {"critic_warmup_steps": self.critic_warmup_steps,
            "dynamic_sampling": self.sampling.dynamic_sampling,
            "overlong_buffer": self.sampling.overlong_buffer}


RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
  """Registers ``recipe`` under its name (its estimator must be registered)."""
  get_advantage_estimator(recipe.estimator)     # raises for an unknown estimator
  RECIPES[recipe.name] = recipe
  return recipe


def get_recipe(name: str) -> Recipe:
  """The recipe ``name`` (ValueError listing the valid ones)."""
  if name not in RECIPES:
    raise ValueError(f"unknown algo {name!r}; valid algos: {', '.join(RECIPES)}")
  return RECIPES[name]


_KL: dict[str, Any] = dict(kl_coef=0.001)
register_recipe(Recipe("ppo", "gae", "PPO: value head, GAE, KL in the reward",
                       dict(kl_mode="reward", **_KL)))
register_recipe(Recipe("grpo", "grpo", "GRPO: group-normalised scores, KL in the loss",
                       dict(**GRPO_DEFAULTS, **_KL)))
register_recipe(Recipe("dr_grpo", "dr_grpo", "Dr. GRPO: no std, constant-length norm",
                       dict(loss_agg_mode="seq-mean-token-sum-norm",
                            norm_length=Derived(lambda b: b.max_new_tokens,
                                                "<max_new_tokens>"),
                            **GRPO_DEFAULTS, **_KL)))
register_recipe(Recipe("rloo", "rloo", "RLOO: leave-one-out group baseline",
                       dict(**GRPO_DEFAULTS, **_KL)))
register_recipe(Recipe("self_critical", "self_critical", "self-critical: greedy baseline",
                       dict(**GRPO_DEFAULTS, **_KL)))
register_recipe(Recipe("reinforce_pp", "reinforce_pp",
                       "REINFORCE++: whitened discounted returns",
                       dict(**GRPO_DEFAULTS, **_KL)))

# Clip-higher (DAPO): a wider upper clip lets low-probability tokens rise.
_CLIP_HIGHER: dict[str, Any] = dict(clip_low=DEFAULT_CLIP_LOW, clip_high=0.28,
                                    loss_agg_mode="token-mean")
# VAPO traces its estimator's defaults (lam_value 1, lam_alpha 0.05): a sweep of
# ``state.hparams`` can change them without recompiling.
register_recipe(Recipe(
    "vapo", "vapo_gae", "VAPO: PPO with decoupled, length-adaptive GAE, critic warm-up, "
    "clip-higher, positive NLL",
    dict(kl_mode="none", pos_nll_coef=0.1, **get_advantage_estimator("vapo_gae").defaults,
         **_CLIP_HIGHER),
    critic_warmup_steps=10, value_lr_scale=2.0))
# DAPO's overlong buffer: a quarter of a --dataset's budget, 0 on a built-in task,
# whose budget is exactly its longest answer plus eos (no finished response is
# overlong there, and a buffer would penalise every correct answer of the longest
# length: all of them on reverse, copy or repeat).
register_recipe(Recipe(
    "dapo", "grpo", "DAPO: group baseline, clip-higher, dynamic sampling, overlong "
    "penalty, no KL",
    dict(**{**GRPO_DEFAULTS, "kl_mode": "none"}, **_CLIP_HIGHER),
    sampling=Sampling(dynamic_sampling=True, overlong_buffer=Derived(
        lambda b: b.max_new_tokens // 4 if b.dataset else 0, "<max_new_tokens // 4>"))))

__all__ = ["Recipe", "Sampling", "Budget", "Derived", "RECIPES", "register_recipe",
           "get_recipe", "value_of"]
