"""The run configuration: what defines a training run (written to ``config.json``).

A run is a recipe (``algo``), a task, a model size and a budget; its train step is
``TrainConfig(**{**recipe fields, **run.train})``: the train-step fields are declared
once, in :class:`~jaxrl_llm.train.TrainConfig`, and ``run.train`` holds only the
ones the user set. The optimizer is built here, in :func:`make_optimizer`, for the
trainer and the ``eval`` command alike.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Optional

from jaxrl_llm.recipes import OVERLONG_QUARTER, RECIPE_RUN_FIELDS, RECIPES, get_recipe
from jaxrl_llm.train.state import TrainConfig

if TYPE_CHECKING:   # optax (and JAX) are imported where used: the CLI checks flags first
  import optax

MODELS = ("tiny", "small")
# Fields that may differ between a run and its resumption.
RESUMABLE_FIELDS = ("steps", "out", "resume", "overwrite", "eval_every", "save_every",
                    "progress", "mesh_data", "mesh_fsdp", "mesh_tensor",
                    "max_consecutive_skips")


# Train fields an in-step advantage estimator does not read (a given one is refused),
# with what to use instead.
_LAM_VALUE = ("only --advantage-estimator decoupled_gae or vapo_gae give the critic its "
              "own lambda")
_LAM_ALPHA = "only --advantage-estimator vapo_gae has a length-adaptive policy lambda"
_HYBRID_MIX = "only --advantage-estimator hybrid mixes in n-step returns"
ESTIMATOR_IGNORES = {
    "gae": {"lam_value": _LAM_VALUE, "lam_alpha": _LAM_ALPHA, "hybrid_mix": _HYBRID_MIX},
    "hybrid": {"lam_value": _LAM_VALUE, "lam_alpha": _LAM_ALPHA},
    "decoupled_gae": {"lam_alpha": _LAM_ALPHA, "hybrid_mix": _HYBRID_MIX},
    "vapo_gae": {"lam": "its policy lambda is the length-adaptive 1 - 1 / (--lam-alpha x "
                        "length); tune --lam-alpha, or use --advantage-estimator "
                        "decoupled_gae for a constant policy lambda --lam",
                 "hybrid_mix": _HYBRID_MIX},
}


def _flag(name: str) -> str:
  """The command-line flag of a field name (``value_lr`` -> ``--value-lr``)."""
  return "--" + name.replace("_", "-")


def _task_names() -> list:
  from jaxrl_llm.tasks import TASKS
  return sorted(TASKS)


@dataclasses.dataclass
class RunConfig:
  """Everything that defines a run (written to ``config.json``).

  Attributes:
    task: the built-in task to train on.
    algo: the algorithm recipe (see :mod:`jaxrl_llm.recipes`).
    model: reference transformer size (a preset), or a local Hugging Face model folder
      (Llama / Qwen2 / Qwen3: config.json, safetensors, tokenizer.json); a folder needs
      --dataset.
    steps: train steps (each: one rollout and one train step).
    prompts_per_step: prompts sampled per step.
    group_size: completions sampled per prompt.
    lr: Adam learning rate.
    seed: seed of the model initialisation, the prompts and the sampling.
    clip_end: anneal the clip epsilon linearly from ``clip_low`` to this value over
      the run (None: constant).
    eval_every: steps between greedy evaluations on the held-out split.
    eval_size: held-out prompts per evaluation.
    save_every: steps between checkpoints.
    mesh_data: data-parallel mesh axis size (-1: all remaining devices).
    mesh_fsdp: FSDP mesh axis size (parameters and optimizer state sharded).
    mesh_tensor: tensor-parallel mesh axis size (heads / mlp / vocab sharded).
    out: the run folder.
    resume: continue the run in ``out``.
    overwrite: replace the run in ``out``.
    progress: print a progress line.
    max_consecutive_skips: stop the run (non-zero exit) after this many train steps
      in a row were skipped for non-finite values.
    dataset: a JSONL file of {"prompt": ..., "answer": ...} lines to train on instead of
      the built-in --task.
    reward: the reward of --dataset completions (a name in jaxrl_llm.tasks.REWARDS:
      math, boxed, exact).
    max_new_tokens: tokens sampled per completion on --dataset.
    critic: a separate critic (its own parameters and Adam optimizer) for recipes with
      a value model: a Hugging Face model folder it is initialised from, or "policy"
      (a copy of the policy's initial weights); None: the policy's value head.
    critic_init: a run folder of this trainer whose newest checkpoint's value
      parameters (the separate critic, or the value head) initialise this run's:
      a critic warmed up once serves many runs (the model layout must match).
    value_lr: learning rate of the value parameters (the separate critic with
      --critic, else the value head; the trunk trains at --lr). None: --lr times the
      recipe's value_lr_scale (vapo: 2, else 1).
    critic_warmup_steps: first steps that train only the value function on rollouts
      of the frozen policy (generation, scoring and evaluation still run; with a
      shared trunk only the value head trains). None: the recipe's (vapo: 10, else 0).
    dynamic_sampling: DAPO dynamic sampling: drop groups whose rewards are all equal
      and draw more to refill the batch (at most --max-sampling-draws rollouts).
      None: the recipe's (dapo: on).
    max_sampling_draws: bound on the rollouts one step of dynamic sampling draws
      (the first included); too few groups with signal are repeated cyclically.
    overlong_buffer: DAPO's soft overlong penalty: responses in the last this many
      tokens of the budget get a reward penalty growing linearly to
      --overlong-penalty (0: off; None: the recipe's; dapo: a quarter of a --dataset's
      budget, 0 on a built-in task, whose budget is exactly its longest answer + eos).
    overlong_penalty: the overlong penalty at the full budget.
    train: TrainConfig fields set on top of the recipe's (e.g. ``{"kl_coef": 0.01,
      "policy_loss": "gspo"}``).
  """
  task: str = "reverse"
  algo: str = "grpo"
  model: str = "tiny"
  steps: int = 400
  prompts_per_step: int = 32
  group_size: int = 8
  lr: float = 1e-3
  seed: int = 0
  clip_end: Optional[float] = None
  eval_every: int = 25
  eval_size: int = 256
  save_every: int = 50
  mesh_data: int = 1
  mesh_fsdp: int = 1
  mesh_tensor: int = 1
  out: str = "runs/default"
  resume: bool = False
  overwrite: bool = False
  progress: bool = True
  max_consecutive_skips: int = 20
  dataset: Optional[str] = None
  reward: str = "math"
  max_new_tokens: int = 64
  critic: Optional[str] = None
  critic_init: Optional[str] = None
  value_lr: Optional[float] = None
  critic_warmup_steps: Optional[int] = None
  dynamic_sampling: Optional[bool] = None
  max_sampling_draws: int = 4
  overlong_buffer: Optional[int] = None
  overlong_penalty: float = 1.0
  train: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(cls, fields: dict) -> "RunConfig":
    """A RunConfig from ``config.json`` or flat keyword arguments.

    Keys that are TrainConfig fields go into ``train`` (so the flat form of earlier
    versions, e.g. ``{"kl_coef": 0.01}``, still loads); ``clip`` is read as
    ``clip_low``, ``critic_lr`` as ``value_lr`` and ``hybrid_n`` as the hybrid
    estimator (earlier names).

    Examples:
      >>> RunConfig.from_dict({"algo": "ppo", "kl_coef": 0.01}).train
      {'kl_coef': 0.01}
    """
    own = {f.name for f in dataclasses.fields(cls)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    run: dict = {}
    train = dict(fields.get("train") or {})
    for key, val in fields.items():
      if key == "train":
        continue
      if key in own:
        run[key] = val
      elif key == "clip":
        train["clip_low"] = val
      elif key == "critic_lr":
        run["value_lr"] = val
      elif key == "hybrid_n":
        if val is not None:
          train.update(hybrid_n=val, advantage_estimator="hybrid")
      elif key in train_fields:
        train[key] = val
      else:
        raise ValueError(f"unknown run setting {key!r} (not a RunConfig or TrainConfig "
                         "field).")
    return cls(**run, train=train)

  def setting(self, name: str) -> Any:
    """A recipe-defaulted run field: its value, else the recipe's, else the fallback
    of :data:`RECIPE_RUN_FIELDS`.

    Examples:
      >>> RunConfig(algo="dapo").setting("dynamic_sampling")
      True
      >>> RunConfig(algo="dapo", dynamic_sampling=False).setting("dynamic_sampling")
      False
    """
    val = getattr(self, name)
    if val is not None:
      return val
    return get_recipe(self.algo).run.get(name, RECIPE_RUN_FIELDS[name])

  def response_budget(self) -> int:
    """Tokens sampled per completion: ``max_new_tokens`` on ``--dataset``, else the
    built-in task's own (no task is built)."""
    if self.dataset is not None:
      return self.max_new_tokens
    from jaxrl_llm.tasks import get_task
    return get_task(self.task).max_new_tokens

  def overlong_buffer_tokens(self) -> int:
    """The overlong buffer in tokens. The recipe's default (dapo) is a quarter of the
    response budget on a ``--dataset``, whose budget is a chosen generation length,
    and 0 on a built-in task, whose budget is exactly its longest answer plus eos: no
    finished response is overlong there, and a buffer would penalise every correct
    answer of the longest length (all of them on reverse, copy or repeat)."""
    val = self.setting("overlong_buffer")
    if val != OVERLONG_QUARTER:
      return int(val)
    return 0 if self.dataset is None else self.response_budget() // 4

  def value_learning_rate(self) -> float:
    """``value_lr``, else ``lr`` times the recipe's ``value_lr_scale``."""
    if self.value_lr is not None:
      return self.value_lr
    return self.lr * get_recipe(self.algo).value_lr_scale

  def validate(self) -> None:
    """Raises ``ValueError`` with a one-line message for a bad setting."""
    tasks = _task_names()
    if self.task not in tasks:
      raise ValueError(f"unknown task {self.task!r}; valid tasks: {', '.join(tasks)}")
    recipe = get_recipe(self.algo)
    if self.model not in MODELS and not os.path.isfile(
        os.path.join(self.model, "config.json")):
      raise ValueError(f"unknown model {self.model!r}; valid models: {', '.join(MODELS)} "
                       "or a Hugging Face model folder (with config.json)")
    if self.critic is not None and self.critic != "policy" and not os.path.isfile(
        os.path.join(self.critic, "config.json")):
      raise ValueError(f"--critic {self.critic!r} must be 'policy' or a Hugging Face "
                       "model folder (with config.json)")
    if self.dataset is None and self.model not in MODELS:
      raise ValueError("--model PATH (a Hugging Face checkpoint) needs --dataset: the "
                       "built-in tasks use their own character tokenizer")
    if self.dataset is not None:
      from jaxrl_llm.tasks import REWARDS
      if not os.path.isfile(self.dataset):
        raise ValueError(f"--dataset {self.dataset!r} is not a file")
      if self.reward not in REWARDS:
        raise ValueError(f"unknown reward {self.reward!r}; valid rewards: "
                         f"{', '.join(sorted(REWARDS))}")
      if self.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if recipe.group and self.group_size < 2:
      raise ValueError(f"--algo {self.algo} is a group estimator and needs --group-size "
                       f">= 2 (got {self.group_size}): with one sample per prompt the "
                       f"group baseline is the sample itself.")
    for name in ("steps", "prompts_per_step", "group_size", "eval_size", "eval_every",
                 "save_every", "max_consecutive_skips"):
      if getattr(self, name) < 1:
        raise ValueError(f"{_flag(name)} must be >= 1 (got "
                         f"{getattr(self, name)})")
    warmup = self.setting("critic_warmup_steps")
    if not isinstance(warmup, int) or warmup < 0:
      raise ValueError(f"--critic-warmup-steps must be an int >= 0 (got {warmup!r})")
    buffer = self.setting("overlong_buffer")
    if buffer != OVERLONG_QUARTER and (not isinstance(buffer, int) or buffer < 0):
      raise ValueError(f"--overlong-buffer must be an int >= 0 (got {buffer!r})")
    budget = self.response_budget()
    if self.overlong_buffer_tokens() > budget:
      raise ValueError(f"--overlong-buffer {self.overlong_buffer_tokens()} is longer "
                       f"than the task's response budget of {budget} tokens")
    if self.overlong_penalty < 0:
      raise ValueError(f"--overlong-penalty must be >= 0 (got {self.overlong_penalty})")
    if self.max_sampling_draws < 1:
      raise ValueError(f"--max-sampling-draws must be >= 1 (got "
                       f"{self.max_sampling_draws})")
    if self.setting("dynamic_sampling") and self.group_size < 2:
      raise ValueError("--dynamic-sampling drops groups whose rewards are all equal and "
                       f"needs --group-size >= 2 (got {self.group_size})")
    if self.critic_init is not None:
      from jaxrl_llm.run_folder import restorable_problem
      problem = restorable_problem(self.critic_init)
      if problem:
        raise ValueError(f"--critic-init {self.critic_init!r}: {problem}")
    if self.value_lr is not None and self.value_lr <= 0:
      raise ValueError(f"--value-lr must be > 0 (got {self.value_lr})")
    for name in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
      size = getattr(self, name)
      if size == 0 or size < -1:
        raise ValueError(f"--{name[5:]} must be >= 1 or -1 (all remaining devices), "
                         f"got {size}")
    if [self.mesh_data, self.mesh_fsdp, self.mesh_tensor].count(-1) > 1:
      raise ValueError("only one of --data, --fsdp, --tensor may be -1")
    if self.resume and self.overwrite:
      raise ValueError("--resume and --overwrite are exclusive")
    config = self.train_config(1)   # TrainConfig's own checks (ranges, choices, names)
    self._check_step_settings(recipe, config, warmup)
    batch = self.prompts_per_step * self.group_size
    chunks = config.num_minibatches * config.num_microbatches
    if batch % chunks:
      raise ValueError(
          f"the batch of --prompts-per-step {self.prompts_per_step} x --group-size "
          f"{self.group_size} = {batch} sequences does not split into "
          f"--num-minibatches {config.num_minibatches} x --num-microbatches "
          f"{config.num_microbatches} = {chunks} equal parts; choose sizes whose "
          "product divides it")

  def _check_step_settings(self, recipe: Any, config: TrainConfig, warmup: int) -> None:
    """Refuses settings the recipe's train step would silently ignore or fail on."""
    if recipe.in_step and not config.use_value:
      raise ValueError(f"--no-use-value: --algo {self.algo} computes its advantages in "
                       f"the train step from a value model (--advantage-estimator "
                       f"{config.advantage_estimator}); keep the value model, or choose "
                       "a critic-free recipe (e.g. --algo grpo)")
    if not config.use_value:
      given = {"critic": self.critic, "critic_init": self.critic_init,
               "value_lr": self.value_lr, "critic_warmup_steps": warmup or None}
      for name, val in given.items():
        if val is not None:
          raise ValueError(f"{_flag(name)} {val} needs a recipe with a value "
                           f"model (--algo {self.algo} has none; e.g. --algo ppo or vapo)")
    if recipe.in_step:
      for name, why in ESTIMATOR_IGNORES.get(config.advantage_estimator, {}).items():
        if self.train.get(name) is not None:
          raise ValueError(f"{_flag(name)} {self.train[name]} is not used by "
                           f"--advantage-estimator {config.advantage_estimator}: {why}")
      return
    # Critic-free recipes hand the step ``advantages`` (computed on the rollout).
    computed = (f"--algo {self.algo} computes its advantages ({recipe.estimator}) on the "
                "rollout, before the train step, which would ignore it")
    for name in ("hybrid_n", "advantage_estimator"):
      if name in self.train:
        raise ValueError(f"{_flag(name)} {self.train[name]} sets the in-step "
                         f"advantage estimator, but {computed}; choose a recipe with a "
                         "value model (e.g. --algo ppo)")
    if config.kl_mode == "reward":
      raise ValueError(f"--kl-mode reward puts the KL into the token rewards, but "
                       f"{computed}; use --kl-mode loss")

  def check_devices(self, device_count: int) -> None:
    """Raises ``ValueError`` unless the mesh flags fit ``device_count`` devices and the
    batch splits evenly over the data-parallel devices.

    Examples:
      >>> RunConfig(mesh_fsdp=4).check_devices(4)
      >>> try:
      ...   RunConfig(mesh_fsdp=3).check_devices(8)
      ... except ValueError as e:
      ...   print(str(e)[:58])
      --data 1 x --fsdp 3 x --tensor 1 needs 3 devices; this hos
    """
    sizes = {"data": self.mesh_data, "fsdp": self.mesh_fsdp, "tensor": self.mesh_tensor}
    if list(sizes.values()) == [1, 1, 1]:
      return
    shown = " x ".join(f"--{k} {v}" for k, v in sizes.items())
    known = 1
    for v in sizes.values():
      known *= v if v != -1 else 1
    bad = (device_count % known) if -1 in sizes.values() else (known != device_count)
    if bad:
      need = (f"a device count divisible by {known}" if -1 in sizes.values()
              else f"{known} devices")
      raise ValueError(f"{shown} needs {need}; this host has {device_count} devices "
                       f"(use sizes whose product is {device_count}, or -1 on one axis "
                       "for the rest)")
    rows = (self.mesh_data if self.mesh_data != -1 else device_count // known) * (
        self.mesh_fsdp if self.mesh_fsdp != -1 else device_count // known)
    batch = self.prompts_per_step * self.group_size
    if batch % rows:
      raise ValueError(f"the batch of {batch} sequences (--prompts-per-step x "
                       f"--group-size) does not split over the {rows} data-parallel "
                       "devices (--data x --fsdp); make it a multiple")

  def train_config(self, max_new_tokens: int) -> TrainConfig:
    """The :class:`TrainConfig` of the run: the recipe's fields, then ``train``."""
    fields = {**get_recipe(self.algo).train_fields(max_new_tokens), **self.train}
    if self.clip_end is not None:
      import optax
      start = TrainConfig(**fields).clip_range()[0]
      # The step counts train steps from 0: the last, steps - 1, uses clip_end.
      fields["clip_schedule"] = optax.linear_schedule(start, self.clip_end,
                                                      max(self.steps - 1, 1))
    return TrainConfig(**fields)

  def identity(self) -> dict:
    """The fields that must match for a run folder to be resumed.

    TrainConfig settings appear as ``train.<field>`` so a mismatch names the field.

    Examples:
      >>> sorted(k for k in RunConfig(train={"kl_coef": 0.1}).identity()
      ...        if k.startswith("train"))
      ['train.kl_coef']
    """
    out = {k: val for k, val in dataclasses.asdict(self).items()
           if k not in RESUMABLE_FIELDS and k != "train"}
    out.update({f"train.{k}": val for k, val in self.train.items()})
    return out


def train_config_for(run: RunConfig, max_new_tokens: int) -> TrainConfig:
  """The :class:`TrainConfig` of a run (``run.train_config``)."""
  return run.train_config(max_new_tokens)


def make_optimizer(run: RunConfig) -> optax.GradientTransformation:
  """The run's optimizer (Adam at ``run.lr``): the one place it is built.

  With a separate critic (``run.critic``), a value learning rate other than ``lr``
  (:meth:`RunConfig.value_learning_rate`) or a critic warm-up: Adam at ``run.lr`` for
  the policy and at the value learning rate for the value parameters, the policy's
  frozen for the warm-up's ``critic_warmup_steps * num_epochs * num_minibatches``
  optimizer updates (:func:`jaxrl_llm.train.optim.policy_value_optimizer`).
  """
  import optax
  value_lr = run.value_learning_rate()
  config = run.train_config(1)
  warmup = run.setting("critic_warmup_steps") * config.num_epochs * config.num_minibatches
  if run.critic is None and (not config.use_value or (value_lr == run.lr and not warmup)):
    return optax.adam(run.lr)
  from jaxrl_llm.train.optim import policy_value_optimizer
  return policy_value_optimizer(optax.adam(run.lr), optax.adam(value_lr),
                                warmup_updates=warmup)


def algos() -> tuple:
  """Names of the registered recipes (``--algo`` choices)."""
  return tuple(RECIPES)


__all__ = ["RunConfig", "MODELS", "RESUMABLE_FIELDS", "train_config_for",
           "make_optimizer", "algos"]
