"""Resolve once: a run's plain-data configuration and its recipe turned into the parts
the loop uses.

:func:`resolve` is the one reader of recipes (:mod:`jaxrl_llm.loop.recipes`) and of
the "None: the recipe's" run fields. It returns a :class:`Resolved`: the
:class:`~jaxrl_llm.train.TrainConfig` of the train step, the optimizer settings, the
rollout's sampling settings (dynamic sampling, the overlong buffer) and the critic
warm-up. Everything downstream (the loop, evaluation, export, setup and the command)
takes these resolved parts and never asks the recipe again.

Examples:
  >>> from jaxrl_llm.loop.config import RunConfig
  >>> r = resolve(RunConfig(algo="dapo", dataset=None))
  >>> r.sampling.dynamic_sampling, r.sampling.overlong_buffer, r.train.clip_high
  (True, 0, 0.28)
  >>> r = resolve(RunConfig(algo="vapo"))
  >>> r.critic_warmup_steps, r.optimizer.value_lr, r.train.advantage_estimator
  (10, 0.002, 'vapo_gae')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from jaxrl_llm._names import MODEL_PRESETS
from jaxrl_llm.loop.config import RunConfig, flag
from jaxrl_llm.loop.recipes import Budget, Recipe, get_recipe, value_of
from jaxrl_llm.settings import IOSettings, LoraSettings, MeshSettings, RolloutSettings, view
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.registry import (
  ADVANTAGE_ESTIMATOR_REGISTRY,
  AdvantageEstimatorSpec,
  get_advantage_estimator,
)

if TYPE_CHECKING:   # optax (and JAX) are imported where used: the CLI checks flags first
  import optax

  from jaxrl_llm.tasks.base import Task


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """How a step's rollout is drawn and scored.

  Attributes:
    prompts_per_step: prompts sampled per step.
    group_size: completions sampled per prompt.
    dynamic_sampling: drop groups whose scores are all equal and draw more.
    max_sampling_draws: bound on the draws of one step of dynamic sampling.
    overlong_buffer: the soft overlong penalty zone in tokens (0: off).
    overlong_penalty: the penalty at the full budget.
  """
  prompts_per_step: int
  group_size: int
  dynamic_sampling: bool
  max_sampling_draws: int
  overlong_buffer: int
  overlong_penalty: float


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """The run's optimizer: Adam at ``lr``, or split policy / value parameters.

  Attributes:
    lr: the policy's (and, unsplit, every parameter's) learning rate.
    value_lr: the value parameters' learning rate.
    warmup_updates: optimizer updates (of the critic warm-up) during which the
      policy's parameters stay frozen.
    split: separate Adam states for the policy and the value parameters
      (:func:`jaxrl_llm.models.critic.policy_value_optimizer`); False: one Adam.
  """
  lr: float
  value_lr: float
  warmup_updates: int
  split: bool

  def build(self) -> optax.GradientTransformation:
    """The optax optimizer: the one place it is built."""
    import optax
    if not self.split:
      return optax.adam(self.lr)
    from jaxrl_llm.train.optim import policy_value_optimizer
    return policy_value_optimizer(optax.adam(self.lr), optax.adam(self.value_lr),
                                  warmup_updates=self.warmup_updates)


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A run with its recipe applied: what the loop reads.

  Attributes:
    run: the run configuration (plain data, kept as the record of the run; its fields
      are read through the resolved parts below, never directly).
    recipe: the run's recipe.
    budget: the response budget (tokens per completion) and whether the task is a
      dataset.
    train: the train step's configuration.
    optimizer: the optimizer settings.
    sampling: the rollout's settings.
    critic_warmup_steps: first steps that train only the value function.
    steps: train steps.
    seed: the seed of the initialisation, the prompts and the sampling.
    trains_on: what the run trains on (the ``--dataset`` file, else the ``--task``).
    model: the model (a preset, or a checkpoint's path or name).
    remat: rematerialise the transformer blocks (None: by model kind).
    critic: the separate critic's source (``--critic``; None: the value head).
    critic_init: a run folder whose value parameters initialise this run's.
    rollout: how completions are generated.
    lora: the LoRA adapters (None: full fine-tuning).
    mesh: the trainer's mesh and batch packing.
    io: the run folder, cadences and sinks.
    record: the run as ``config.json`` holds it.
    identity: the fields a resume must match (:meth:`RunConfig.identity`).

  ``rollout``, ``lora``, ``mesh`` and ``io`` are the run's sections
  (:mod:`jaxrl_llm.settings`: ``run.section("rollout")``).
  """
  run: RunConfig
  recipe: Recipe
  budget: Budget
  train: TrainConfig
  optimizer: OptimizerSettings
  sampling: SamplingSettings
  critic_warmup_steps: int
  steps: int
  seed: int
  trains_on: str
  model: str
  remat: bool | None
  critic: str | None
  critic_init: str | None
  rollout: RolloutSettings
  lora: LoraSettings | None
  mesh: MeshSettings
  io: IOSettings
  record: Mapping[str, Any]
  identity: Mapping[str, Any]

  @property
  def estimator(self) -> AdvantageEstimatorSpec:
    """The advantage estimator (in the step when ``estimator.needs_values``)."""
    return get_advantage_estimator(self.recipe.estimator)

  @property
  def separate_critic(self) -> bool:
    """Whether the value model is a separate critic (``--critic`` with a value model)."""
    return self.critic is not None and self.train.use_value

  def check_devices(self, device_count: int, process_count: int = 1) -> None:
    """One-line ``ValueError`` unless the run fits ``device_count`` devices
    (:meth:`RunConfig.check_devices`) and, with several processes, a
    ``process_count``-process job
    (:func:`~jaxrl_llm.loop.processes.check_multiprocess`)."""
    if process_count > 1:
      from jaxrl_llm.loop.processes import check_multiprocess
      check_multiprocess(self.run, self, process_count, device_count)
    self.run.check_devices(device_count)


def response_budget(run: RunConfig, task: Task | None = None) -> Budget:
  """The run's :class:`~jaxrl_llm.loop.recipes.Budget`: ``task.max_new_tokens``, or
  without a task ``max_new_tokens`` on ``--dataset`` and a task source's ``--task``
  (:attr:`~jaxrl_llm.loop.config.RunConfig.takes_max_new_tokens`) and the built-in
  task's own."""
  if task is not None:
    tokens = task.max_new_tokens
  elif run.takes_max_new_tokens:
    tokens = run.max_new_tokens
  else:
    from jaxrl_llm.tasks import get_task
    tokens = get_task(run.task or "").max_new_tokens
  return Budget(tokens, dataset=run.takes_max_new_tokens)


# Learning rates by model kind (``effective``): a built-in model trains from scratch; a
# pretrained checkpoint takes 1e-5, chosen by measurement on SmolLM2-135M-Instruct
# (GRPO, rg:chain_sum, 4 prompts x 8 samples, benchmarks/RESULTS.md): at verl's and
# TRL's 1e-6 nothing moved in 10 steps (every group all-equal, gradient ~1e-9); at 3e-5
# every completion ran to the token budget by step 14 and greedy accuracy fell from
# 0.165 to 0.105; at 1e-5 it rose to 0.30 by step 20. The critic learns 10x faster
# (verl's critic 1e-5 beside its actor 1e-6).
SCRATCH_LR = 1e-3
PRETRAINED_LR = 1e-5
PRETRAINED_VALUE_LR_RATIO = 10.0


def is_pretrained(run: RunConfig) -> bool:
  """Whether ``run.model`` is a Hugging Face checkpoint (not a built-in preset)."""
  return run.model not in MODEL_PRESETS


def effective(run: RunConfig, name: str, budget: Budget | None = None) -> Any:
  """The RunConfig field ``name`` as the run uses it: ``lr`` (by model kind when None:
  :data:`SCRATCH_LR` for a built-in model, :data:`PRETRAINED_LR` for a checkpoint),
  ``value_lr`` (the ``lr`` times the recipe's scale, and times
  :data:`PRETRAINED_VALUE_LR_RATIO` for a checkpoint, when None),
  ``critic_warmup_steps``, ``dynamic_sampling`` and ``overlong_buffer`` (in tokens;
  the recipe's when None); any other field as set.

  Examples:
    >>> effective(RunConfig(algo="dapo"), "dynamic_sampling")
    True
    >>> effective(RunConfig(algo="dapo", dynamic_sampling=False), "dynamic_sampling")
    False
    >>> effective(RunConfig(), "lr"), effective(RunConfig(algo="vapo"), "value_lr")
    (0.001, 0.002)
  """
  val = getattr(run, name)
  if val is not None or name not in _RECIPE_DEFAULTED:
    return val
  if name == "lr":
    return PRETRAINED_LR if is_pretrained(run) else SCRATCH_LR
  recipe = get_recipe(run.algo)
  if name == "value_lr":
    ratio = PRETRAINED_VALUE_LR_RATIO if is_pretrained(run) else 1.0
    return effective(run, "lr") * recipe.value_lr_scale * ratio
  if name == "overlong_buffer":
    return int(value_of(recipe.sampling.overlong_buffer, budget or response_budget(run)))
  return recipe.run_settings()[name]


# RunConfig fields whose None is resolved by ``effective`` (the model kind's, the
# recipe's).
_RECIPE_DEFAULTED = ("lr", "value_lr", "critic_warmup_steps", "dynamic_sampling",
                     "overlong_buffer")


def resolve(run: RunConfig, task: Task | None = None) -> Resolved:
  """The run with its recipe applied, checked: the one reader of recipes.

  Args:
    run: the run configuration.
    task: the run's task (its ``max_new_tokens`` is the response budget); None: the
      budget from the run alone (the command checks its flags this way before it
      builds the task or imports JAX).

  Returns:
    The :class:`Resolved` parts.

  Raises:
    ValueError: a one-line message for a bad setting (a run field, or one the
      recipe's train step would ignore or fail on).
  """
  run.validate()
  return _resolve(run, response_budget(run, task), task)


def resolve_run(run: RunConfig, *,
                before_task: Callable[[Resolved], None] | None = None
                ) -> tuple[Resolved, Task]:
  """``(resolved, task)``: the run validated and resolved once, and its task built
  (:func:`~jaxrl_llm.loop.task_setup.make_task`, without JAX), what
  :func:`~jaxrl_llm.loop.run.run_training` takes.

  ``before_task(resolved)`` runs after the run's checks and before the task is built
  (the command's own checks: a dataset's rows, before its task reads them).

  Examples:
    >>> resolved, task = resolve_run(RunConfig(task="sort", algo="dapo"))
    >>> task.name, resolved.sampling.dynamic_sampling, resolved.io.out
    ('sort', True, 'runs/default')
  """
  resolved = resolve(run)
  if before_task is not None:
    before_task(resolved)
  from jaxrl_llm.loop.task_setup import make_task
  task = make_task(run)
  if task.max_new_tokens != resolved.budget.max_new_tokens:  # a task with its own budget
    return _resolve(run, response_budget(run, task), task), task
  start = _logprob_start(run, task)
  if start is not None:
    resolved = dataclasses.replace(resolved, train=dataclasses.replace(
        resolved.train, logprob_start=start))
  return resolved, task


def _logprob_start(run: RunConfig, task: Task | None) -> int | None:
  """The column the train step's log-probs start at: the task's prompt width for a
  checkpoint's unpacked batch (unless ``--logprob-start`` is given); None: every
  column.

  Every rollout path lays a batch out as prompts left-padded to the task's
  max_prompt_len, then the responses: the loss reads no column before it. A
  checkpoint's step then skips the LM head on the prompt (0.8x the update on
  SmolLM2); the built-in models keep the full program, so their runs stay
  bit-identical (the smaller gradient program sums in another order: 1 ulp)."""
  if (task is not None and is_pretrained(run) and not run.pack
      and "logprob_start" not in run.train):
    return task.max_prompt_len
  return None


def _resolve(run: RunConfig, budget: Budget, task: Task | None) -> Resolved:
  """:func:`resolve` of a validated run: the recipe's checks and the parts."""
  if run.rollout == "vllm" and not os.path.isfile(os.path.join(run.model, "config.json")):
    raise ValueError(f"--rollout vllm needs --model PATH, a Hugging Face model folder "
                     f"(got {run.model!r}): vLLM loads the architecture from it (for a GGUF "
                     "model, write one with save_pretrained(from_gguf(FILE), DIR))")
  recipe = get_recipe(run.algo)
  if recipe.group and run.group_size < 2:
    raise ValueError(f"--algo {run.algo} is a group estimator and needs --group-size "
                     f">= 2 (got {run.group_size}): with one sample per prompt the "
                     f"group baseline is the sample itself.")
  warmup = effective(run, "critic_warmup_steps", budget)
  buffer = effective(run, "overlong_buffer", budget)
  if buffer > budget.max_new_tokens:
    raise ValueError(f"--overlong-buffer {buffer} is longer than the task's response "
                     f"budget of {budget.max_new_tokens} tokens")
  dynamic = effective(run, "dynamic_sampling", budget)
  _check_sampling(run, dynamic)
  config = _train_config(run, recipe, budget)
  start = _logprob_start(run, task)
  if start is not None:
    config = dataclasses.replace(config, logprob_start=start)
  _check_step_settings(run, recipe, config, warmup)
  _check_batch_split(run, config)
  lr, value_lr = effective(run, "lr"), effective(run, "value_lr", budget)
  warmup_updates = warmup * config.num_epochs * config.num_minibatches
  split = run.critic is not None or (
      config.use_value and (value_lr != lr or bool(warmup_updates)))
  return Resolved(
      run=run, recipe=recipe, budget=budget, train=config,
      optimizer=OptimizerSettings(lr=lr, value_lr=value_lr,
                                  warmup_updates=warmup_updates, split=split),
      sampling=SamplingSettings(
          prompts_per_step=run.prompts_per_step, group_size=run.group_size,
          dynamic_sampling=bool(dynamic), max_sampling_draws=run.max_sampling_draws,
          overlong_buffer=buffer, overlong_penalty=run.overlong_penalty),
      critic_warmup_steps=warmup, **_sections(run))


def _sections(run: RunConfig) -> dict:
  """The :class:`Resolved` fields read from the run as set (no recipe)."""
  return dict(
      steps=run.steps, seed=run.seed, trains_on=str(run.dataset or run.task),
      model=run.model, remat=run.remat, critic=run.critic, critic_init=run.critic_init,
      rollout=view(RolloutSettings, run),
      lora=None if run.lora_rank is None else view(LoraSettings, run),
      mesh=view(MeshSettings, run), io=view(IOSettings, run),
      record=dataclasses.asdict(run), identity=run.identity())


def _check_sampling(run: RunConfig, dynamic: bool) -> None:
  """Refuses dynamic sampling where the rollouts are drawn outside the step, or with
  groups of one."""
  if dynamic and (run.partial_rollouts or run.async_rollouts):
    mode = "--partial-rollouts" if run.partial_rollouts else "--async"
    raise ValueError(f"{mode} generates the batches outside the step; dynamic sampling "
                     "(--algo dapo) draws extra rollouts in the step: pass "
                     f"--no-dynamic-sampling or drop {mode}")
  if dynamic and run.group_size < 2:
    raise ValueError("--dynamic-sampling drops groups whose rewards are all equal and "
                     f"needs --group-size >= 2 (got {run.group_size})")


def _check_batch_split(run: RunConfig, config: TrainConfig) -> None:
  """Refuses a batch that does not split into the minibatches and microbatches."""
  batch = run.prompts_per_step * run.group_size
  chunks = config.num_minibatches * config.num_microbatches
  if batch % chunks:
    raise ValueError(
        f"the batch of --prompts-per-step {run.prompts_per_step} x --group-size "
        f"{run.group_size} = {batch} sequences does not split into "
        f"--num-minibatches {config.num_minibatches} x --num-microbatches "
        f"{config.num_microbatches} = {chunks} equal parts; choose sizes whose "
        "product divides it")


def _train_config(run: RunConfig, recipe: Recipe, budget: Budget) -> TrainConfig:
  """The :class:`TrainConfig` of the run: the recipe's fields, then ``run.train``, then
  the clip schedule of ``clip_end``."""
  fields = {**recipe.train_fields(budget), **run.train}
  if ((run.partial_rollouts or run.async_rollouts or run.rollout == "vllm")
      and "rollout_correction" not in run.train):
    # Off-policy tokens (decoupled PPO, as AReaL), or another engine's log-probs, which
    # differ from the trainer's (kernels, precision): token TIS, as verl.
    fields["rollout_correction"] = "token"
  if run.clip_end is not None:
    import optax
    start = TrainConfig(**fields).clip_range()[0]
    # The step counts train steps from 0: the last, steps - 1, uses clip_end.
    fields["clip_schedule"] = optax.linear_schedule(start, run.clip_end,
                                                    max(run.steps - 1, 1))
  return TrainConfig(**fields)


def _in_step_specs() -> list:
  return [s for s in ADVANTAGE_ESTIMATOR_REGISTRY.values() if s.needs_values]


def _check_step_settings(run: RunConfig, recipe: Recipe, config: TrainConfig,
                         warmup: int) -> None:
  """Refuses settings the recipe's train step would silently ignore or fail on: the
  fields an in-step estimator reads are those its registration declares."""
  if recipe.in_step and not config.use_value:
    raise ValueError(f"--no-use-value: --algo {run.algo} computes its advantages in "
                     f"the train step from a value model (--advantage-estimator "
                     f"{config.advantage_estimator}); keep the value model, or choose "
                     "a critic-free recipe (e.g. --algo grpo)")
  if not config.use_value:
    given = {"critic": run.critic, "critic_init": run.critic_init,
             "value_lr": run.value_lr, "critic_warmup_steps": warmup or None}
    for name, val in given.items():
      if val is not None:
        raise ValueError(f"{flag(name)} {val} needs a recipe with a value "
                         f"model (--algo {run.algo} has none; e.g. --algo ppo or vapo)")
  specs = _in_step_specs()
  if recipe.in_step:
    spec = get_advantage_estimator(config.advantage_estimator)
    read_somewhere = dict.fromkeys(k for s in specs for k in s.reads)
    for name in read_somewhere:
      if name not in spec.reads and run.train.get(name) is not None:
        readers = " or ".join(f"--advantage-estimator {s.name}" for s in specs
                              if name in s.reads)
        reads = ", ".join(flag(k) for k in spec.hparams)
        raise ValueError(f"{flag(name)} {run.train[name]} is not used by "
                         f"--advantage-estimator {config.advantage_estimator} (it reads "
                         f"{reads}); {readers} reads it")
    return
  # Critic-free recipes hand the step ``advantages`` (computed on the rollout): the
  # in-step estimator and the static fields only some in-step estimators read (e.g.
  # hybrid_n) would be ignored.
  computed = (f"--algo {run.algo} computes its advantages ({recipe.estimator}) on the "
              "rollout, before the train step, which would ignore it")
  shared = set.intersection(*(set(s.static) for s in specs))
  selecting = list(dict.fromkeys(
      k for s in specs for k in s.static if k not in shared)) + ["advantage_estimator"]
  for name in selecting:
    if name in run.train:
      raise ValueError(f"{flag(name)} {run.train[name]} sets the in-step "
                       f"advantage estimator, but {computed}; choose a recipe with a "
                       "value model (e.g. --algo ppo)")
  if config.kl_mode == "reward":
    raise ValueError(f"--kl-mode reward puts the KL into the token rewards, but "
                     f"{computed}; use --kl-mode loss")


__all__ = ["IOSettings", "LoraSettings", "MeshSettings", "OptimizerSettings", "Resolved",
           "RolloutSettings", "SamplingSettings", "effective", "resolve", "resolve_run",
           "response_budget"]   # the four sections re-exported from jaxrl_llm.settings
