"""A run's settings by section, and each section's checks (JAX-free, the core floor).

:class:`~jaxrl_llm.loop.config.RunConfig` stays one flat dataclass: its keyword
construction, its flags (``--lora-rank``), ``dataclasses.asdict`` and the flat
``config.json`` are the public surface, and each field's default, range and help are
declared there once. This module groups those fields into sections
(:data:`SECTIONS`): each field belongs to exactly one, under a name of its own there
(``lora_rank`` is ``lora.rank``: :func:`section_view`, ``RunConfig.section("lora")``),
and each section checks itself, in order (:func:`validate_sections`).

A section's checks are a list of rules: the checks of what its names refer to (a
task, a model, a file), then :data:`BOUNDS` (the declared ranges of its fields), then
how its settings combine: a setting that belongs to a switch (:class:`Needs`:
``--partial-kv keep`` without ``--partial-rollouts``), settings that exclude each
other (:class:`Excludes`), a run folder to read. :func:`validate_sections` runs them
phase by phase over the sections (every name, every range, every combination), so
the first fault it names is the one the flat checks of the previous version named.
What only a higher floor knows (the tasks, the recipes, a LoRA adapter's config)
comes through a :class:`Catalog`.

Sections, in the order they are checked (within each phase):

* ``task``: what the run trains on (a task or a dataset, its reward and budget).
* ``recipe``: the algorithm, its learning rate and clip schedule, the TrainConfig
  fields set on top of it.
* ``model``: the policy's model and whether its blocks are rematerialised.
* ``critic``: the separate critic, its warm start, learning rate and warm-up.
* ``budget``: steps, prompts and completions per step, the seed.
* ``dapo``: DAPO's dynamic sampling and overlong penalty.
* ``mesh``: the trainer's mesh axes and the packing of its batch.
* ``io``: the run folder, resuming, cadences, progress and metric sinks.
* ``rollout``: how completions are generated (backend, partial, async).
* ``lora``: LoRA adapters.

Examples:
  >>> import dataclasses
  >>> @dataclasses.dataclass
  ... class Run:
  ...   pack: bool = False
  ...   pack_tokens: int | None = None
  >>> rule = Needs("pack_tokens", "pack", "{flag} is the row budget of --pack; add --pack",
  ...              given="set")
  >>> rule(Run(pack=True, pack_tokens=64), None)
  >>> try:
  ...   rule(Run(pack_tokens=64), None)
  ... except ValueError as e:
  ...   print(e)
  --pack-tokens is the row budget of --pack; add --pack
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from jaxrl_llm._names import LORA_TARGET_NAMES, MODEL_PRESETS


def flag(name: str) -> str:
  """The command-line flag of a config field (``value_lr`` -> ``--value-lr``).

  Examples:
    >>> flag("value_lr")
    '--value-lr'
  """
  return "--" + name.replace("_", "-")


# ------------------------------------------------------------------ the section views


def _of(field: str) -> Any:
  """A section setting that is the RunConfig field ``field``."""
  return dataclasses.field(metadata={"run_field": field})


@dataclasses.dataclass(frozen=True)
class TaskSettings:
  """What the run trains on (``RunConfig``: ``task``, ``task_config``, ``dataset``,
  ``reward``, ``max_new_tokens``, ``eval_dataset``, ``holdout``)."""
  name: str | None = _of("task")
  config: list[str] = _of("task_config")  # noqa: RUF009 - _of is a dataclasses.field
  dataset: str | None = _of("dataset")
  reward: str = _of("reward")
  max_new_tokens: int = _of("max_new_tokens")
  eval_dataset: str | None = _of("eval_dataset")
  holdout: float | None = _of("holdout")


@dataclasses.dataclass(frozen=True)
class RecipeSettings:
  """The algorithm and what is set on top of it (``algo``, ``lr``, ``clip_end``,
  ``train``)."""
  algo: str = _of("algo")
  lr: float | None = _of("lr")
  clip_end: float | None = _of("clip_end")
  train: dict = _of("train")  # noqa: RUF009 - _of is a dataclasses.field


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """The policy's model (``model``, ``remat``)."""
  name: str = _of("model")
  remat: bool | None = _of("remat")


@dataclasses.dataclass(frozen=True)
class CriticSettings:
  """The value model (``critic``, ``critic_init``, ``value_lr``,
  ``critic_warmup_steps``)."""
  model: str | None = _of("critic")
  init: str | None = _of("critic_init")
  lr: float | None = _of("value_lr")
  warmup_steps: int | None = _of("critic_warmup_steps")


@dataclasses.dataclass(frozen=True)
class BudgetSettings:
  """How much the run trains (``steps``, ``prompts_per_step``, ``group_size``,
  ``seed``)."""
  steps: int = _of("steps")
  prompts_per_step: int = _of("prompts_per_step")
  group_size: int = _of("group_size")
  seed: int = _of("seed")


@dataclasses.dataclass(frozen=True)
class DapoSettings:
  """DAPO's sampling settings (``dynamic_sampling``, ``max_sampling_draws``,
  ``overlong_buffer``, ``overlong_penalty``)."""
  dynamic_sampling: bool | None = _of("dynamic_sampling")
  max_draws: int = _of("max_sampling_draws")
  overlong_buffer: int | None = _of("overlong_buffer")
  overlong_penalty: float = _of("overlong_penalty")


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """The trainer's mesh axes (-1: all remaining devices) and the packing of its batch
  (``mesh_data``, ``mesh_fsdp``, ``mesh_tensor``, ``pack``, ``pack_tokens``)."""
  data: int = _of("mesh_data")
  fsdp: int = _of("mesh_fsdp")
  tensor: int = _of("mesh_tensor")
  pack: bool = _of("pack")
  pack_tokens: int | None = _of("pack_tokens")

  @property
  def sizes(self) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)``."""
    return self.data, self.fsdp, self.tensor


@dataclasses.dataclass(frozen=True)
class IOSettings:
  """What the run writes and when (``out``, ``resume``, ``resume_or_start``,
  ``overwrite``, ``progress``, ``eval_every``, ``eval_size``, ``save_every``,
  ``max_consecutive_skips``, ``tensorboard``, ``wandb_project``, ``compile_cache``)."""
  out: str = _of("out")
  resume: bool = _of("resume")
  resume_or_start: bool = _of("resume_or_start")
  overwrite: bool = _of("overwrite")
  progress: bool = _of("progress")
  eval_every: int = _of("eval_every")
  eval_size: int = _of("eval_size")
  save_every: int = _of("save_every")
  max_consecutive_skips: int = _of("max_consecutive_skips")
  tensorboard: bool = _of("tensorboard")
  wandb_project: str | None = _of("wandb_project")
  compile_cache: str | None = _of("compile_cache")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """How completions are generated (``rollout``, ``rollout_slots``,
  ``rollout_prefill_rows``, ``partial_rollouts``, ``token_budget``, ``partial_kv``,
  ``async_rollouts``, ``max_staleness``, ``rollout_devices``).

  Attributes:
    backend: ``"engine"``, ``"simple"`` or ``"vllm"``.
    slots: the engine's slots (None: all completions of a step, at most 256).
    prefill_rows: prompts the engine prefills together per device call.
    partial: partial rollouts: groups stay in flight across steps.
    token_budget: with ``partial``, tokens per engine call.
    partial_kv: with ``partial``, ``"recompute"`` or ``"keep"`` the in-flight KV cache.
    asynchronous: a rollout thread generates ahead of the trainer (``--async``).
    max_staleness: with ``asynchronous``, the most versions a batch may lag.
    devices: with ``asynchronous``, the last this many devices generate.
  """
  backend: str = _of("rollout")
  slots: int | None = _of("rollout_slots")
  prefill_rows: int = _of("rollout_prefill_rows")
  partial: bool = _of("partial_rollouts")
  token_budget: int | None = _of("token_budget")
  partial_kv: str = _of("partial_kv")
  asynchronous: bool = _of("async_rollouts")
  max_staleness: int = _of("max_staleness")
  devices: int = _of("rollout_devices")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """LoRA adapters (``lora_rank``: None is full fine-tuning; ``lora_alpha``,
  ``lora_targets``, ``lora_base_dtype``, ``lora_init``)."""
  rank: int | None = _of("lora_rank")
  alpha: float | None = _of("lora_alpha")
  targets: str = _of("lora_targets")
  base_dtype: str = _of("lora_base_dtype")
  init: str | None = _of("lora_init")


S = TypeVar("S")


def run_fields(settings: type) -> dict[str, str]:
  """``{section name: RunConfig field}`` of a section's settings class.

  Examples:
    >>> run_fields(ModelSettings)
    {'name': 'model', 'remat': 'remat'}
  """
  return {f.name: f.metadata["run_field"] for f in dataclasses.fields(settings)}


def view(settings: type[S], run: Any) -> S:
  """The section ``settings`` (a class of :data:`SECTIONS`) of ``run``: a frozen copy
  of its fields under their section names.

  Examples:
    >>> import types
    >>> view(ModelSettings, types.SimpleNamespace(model="tiny", remat=None))
    ModelSettings(name='tiny', remat=None)
  """
  return settings(**{name: getattr(run, field)                # type: ignore[call-arg]
                     for name, field in run_fields(settings).items()})


# --------------------------------------------------------------------------- the rules


class Catalog(Protocol):
  """What the checks need from the floors above this one: the tasks and rewards
  (``tasks``), the recipes (``loop``), a LoRA adapter folder (``models``).
  :class:`~jaxrl_llm.loop.config.RunConfig` passes its own."""

  def task_names(self) -> Sequence[str]: ...

  def task_source(self, name: str | None) -> Any: ...

  def task_sources_doc(self) -> str: ...

  def check_task_config(self, source: Any, task_config: list[str]) -> None: ...

  def reward_names(self) -> Sequence[str]: ...

  def check_algo(self, name: str) -> None: ...

  def lora_adapter_mismatch(self, run: Any) -> tuple[str, Any, Any] | None: ...


def _given(value: Any, how: str, default: Any = None) -> bool:
  """Whether a setting counts as given: ``"set"`` (not None), ``"on"`` (truthy) or
  ``"changed"`` (not its ``default``)."""
  if how == "set":
    return value is not None
  if how == "on":
    return bool(value)
  return value != default


def _default(run: Any, name: str) -> Any:
  return next(f.default for f in dataclasses.fields(run) if f.name == name)


@dataclasses.dataclass(frozen=True)
class Needs:
  """The setting ``name`` belongs to the switch ``switch``: given (``given``: see
  :func:`_given`) while the switch is off (``switch_on``), it is a ``ValueError`` of
  ``text`` (formatted with the setting's ``flag`` and ``value``)."""
  name: str
  switch: str
  text: str
  given: str = "changed"
  switch_on: str = "on"

  def __call__(self, run: Any, catalog: Catalog | None) -> None:
    value = getattr(run, self.name)
    if (_given(value, self.given, _default(run, self.name))
        and not _given(getattr(run, self.switch), self.switch_on)):
      raise ValueError(self.text.format(flag=flag(self.name), value=value))


@dataclasses.dataclass(frozen=True)
class Excludes:
  """The settings ``first`` and ``second`` exclude each other: both given (``given``)
  is a ``ValueError`` of ``text`` (formatted with both values by field name)."""
  first: str
  second: str
  text: str
  given: tuple[str, str] = ("on", "on")

  def __call__(self, run: Any, catalog: Catalog | None) -> None:
    a, b = getattr(run, self.first), getattr(run, self.second)
    if _given(a, self.given[0]) and _given(b, self.given[1]):
      raise ValueError(self.text.format(**{self.first: a, self.second: b}))


class Bounds:
  """The rule of the declared ranges (``min_int``, ``low``) of the section's own
  fields (:func:`check_bounds`), in the order RunConfig declares them."""

  def __call__(self, run: Any, fields: Sequence[str]) -> None:
    for f in dataclasses.fields(run):
      if f.name in fields:
        check_bounds(f, getattr(run, f.name))

  def __repr__(self) -> str:
    return "BOUNDS"


BOUNDS = Bounds()


def check_bounds(f: dataclasses.Field, x: Any) -> None:
  """Checks value ``x`` of the config field ``f`` against its declared bounds (a
  one-line ``ValueError`` naming the flag)."""
  meta = f.metadata
  if x is None:
    return
  if meta.get("min_int") is not None:
    if f.default is None and (not isinstance(x, int) or isinstance(x, bool)):
      raise ValueError(f"{flag(f.name)} must be an int >= {meta['min_int']} (got {x!r})")
    if x < meta["min_int"]:
      kind = "an int " if f.default is None else ""
      raise ValueError(f"{flag(f.name)} must be {kind}>= {meta['min_int']} (got {x})")
  low = meta.get("low")
  if low is not None and (x < low or (x == low and not meta.get("low_inclusive"))):
    op = ">=" if meta.get("low_inclusive") else ">"
    raise ValueError(f"{flag(f.name)} must be {op} {low:g} (got {x})")


def _installed(name: str, wanted: Any, module: str, install: str) -> Rule:
  """A rule: the setting ``name`` (``wanted(run)``) needs ``module`` installed."""
  def check(run: Any, catalog: Catalog | None) -> None:
    if wanted(run) and importlib.util.find_spec(module) is None:
      raise ValueError(f"{name} needs {module}, which is not installed: pip install "
                       f"{install}")
  return check


Rule = Callable[[Any, Any], None]


# ------------------------------------------------------------------- the task section


def _known_task(run: Any, catalog: Catalog) -> None:
  """The task is a built-in one or a task source's, with its own settings."""
  source = catalog.task_source(run.task)
  names = catalog.task_names()
  if run.dataset is None and run.task not in names and source is None:
    raise ValueError(f"unknown task {run.task!r}; valid tasks: {', '.join(names)}, or "
                     f"{catalog.task_sources_doc()}")
  if source is not None:
    catalog.check_task_config(source, run.task_config)
  elif run.task_config:
    what = "--dataset" if run.dataset is not None else f"--task {run.task}"
    raise ValueError(f"--task-config {run.task_config[0]} is a setting of a task "
                     f"source's --task (rg:NAME); {what} takes none")


def _whole_holdout(run: Any, catalog: Catalog) -> None:
  if run.holdout is not None and run.holdout >= 1 and run.holdout != int(run.holdout):
    raise ValueError(f"--holdout must be a fraction in (0, 1) or a whole count of rows, "
                     f"got {run.holdout:g}")


def _dataset_files(run: Any, catalog: Catalog) -> None:
  """A dataset's files exist and its reward is known."""
  if run.dataset is None:
    return
  for name, path in (("--dataset", run.dataset), ("--eval-dataset", run.eval_dataset)):
    if path is not None and not os.path.isfile(path):
      raise ValueError(f"{name} {path!r} is not a file")
  rewards = catalog.reward_names()
  if run.reward not in rewards:
    raise ValueError(f"unknown reward {run.reward!r}; valid rewards: {', '.join(rewards)}")


_OF_DATASET = "{flag} is a setting of --dataset (a --task has its own held-out split); " \
              "add --dataset"
TASK_RULES: tuple[Rule, ...] = (
    Excludes("dataset", "task", "--task {task} and --dataset are exclusive: a --dataset "
             "run trains on the dataset", given=("set", "set")),
    _known_task,
    Needs("eval_dataset", "dataset", _OF_DATASET, given="set", switch_on="set"),
    Needs("holdout", "dataset", _OF_DATASET, given="set", switch_on="set"),
    Excludes("eval_dataset", "holdout", "--eval-dataset and --holdout are exclusive: "
             "evaluate on a file, or on rows held out of --dataset", given=("set", "set")),
    _whole_holdout,
    _dataset_files,
    BOUNDS,
    _installed("--reward math_verify",
               lambda run: run.dataset is not None and run.reward == "math_verify",
               "math_verify", "'jaxrl_llm[math_verify]'"),
)


# ------------------------------------------------------- recipe, model, critic, budget


def _known_model(run: Any, catalog: Catalog) -> None:
  """The model is a preset or a checkpoint, and a checkpoint trains on a tokenized
  dataset or task source."""
  from jaxrl_llm.model_files import PACKAGED_MODELS, checkpoint_path
  if run.model not in MODEL_PRESETS and checkpoint_path(run.model) is None:
    raise ValueError(f"unknown model {run.model!r}; valid models: "
                     f"{', '.join((*MODEL_PRESETS, *PACKAGED_MODELS))}, a Hugging Face "
                     "model folder (with config.json) or a .gguf file")
  if (run.dataset is None and catalog.task_source(run.task) is None
      and run.model not in MODEL_PRESETS):
    raise ValueError("--model PATH (a Hugging Face checkpoint) needs --dataset or a task "
                     "source's --task (rg:...): the built-in tasks use their own "
                     "character tokenizer")


def _known_critic(run: Any, catalog: Catalog) -> None:
  from jaxrl_llm.model_files import checkpoint_path
  if run.critic is not None and run.critic != "policy" and checkpoint_path(
      run.critic) is None:
    raise ValueError(f"--critic {run.critic!r} must be 'policy', a Hugging Face model "
                     "folder (with config.json), a .gguf file or a packaged model")


def _restorable_critic_init(run: Any, catalog: Catalog) -> None:
  if run.critic_init is not None:
    from jaxrl_llm.run_folder import restorable_problem
    problem = restorable_problem(run.critic_init)
    if problem:
      raise ValueError(f"--critic-init {run.critic_init!r}: {problem}")


def _known_algo(run: Any, catalog: Catalog) -> None:
  catalog.check_algo(run.algo)          # an unknown algo: the recipes listed


RECIPE_RULES: tuple[Rule, ...] = (_known_algo, BOUNDS)
MODEL_RULES: tuple[Rule, ...] = (_known_model, BOUNDS)
CRITIC_RULES: tuple[Rule, ...] = (
    _known_critic,
    BOUNDS,
    _restorable_critic_init,
)
BUDGET_RULES: tuple[Rule, ...] = (BOUNDS,)
DAPO_RULES: tuple[Rule, ...] = (BOUNDS,)


# --------------------------------------------------------------------- mesh, io, rollout


def _mesh_sizes(run: Any, catalog: Catalog) -> None:
  for name in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
    size = getattr(run, name)
    if size == 0 or size < -1:
      raise ValueError(f"--{name[5:]} must be >= 1 or -1 (all remaining devices), "
                       f"got {size}")
  if [run.mesh_data, run.mesh_fsdp, run.mesh_tensor].count(-1) > 1:
    raise ValueError("only one of --data, --fsdp, --tensor may be -1")


MESH_RULES: tuple[Rule, ...] = (
    BOUNDS,
    _mesh_sizes,
    Needs("pack_tokens", "pack", "{flag} is the row budget of --pack; add --pack",
          given="set"),
)
IO_RULES: tuple[Rule, ...] = (
    BOUNDS,
    _installed("--tensorboard", lambda run: run.tensorboard, "tensorboardX",
               "'jaxrl_llm[tensorboard]'"),
    _installed("--wandb-project", lambda run: run.wandb_project, "wandb", "wandb"),
    Excludes("resume", "overwrite", "--resume and --overwrite are exclusive"),
)


def _engine_for(name: str, why: str = "") -> Rule:
  """A rule: the setting ``name`` (on) needs ``--rollout engine``."""
  def check(run: Any, catalog: Catalog | None) -> None:
    if getattr(run, name) and run.rollout != "engine":
      raise ValueError(f"{flag(name)} needs --rollout engine (got --rollout "
                       f"{run.rollout}){why}")
  return check


def _async_engine(run: Any, catalog: Catalog) -> None:
  if run.async_rollouts and run.rollout == "vllm":
    raise ValueError("--async generates on a JAX engine of its own; with --rollout vllm "
                     "the vLLM engine lives in the trainer's process (use --rollout engine)")


_OF_ASYNC = "{flag} {value} is a setting of --async; add --async"
ROLLOUT_RULES: tuple[Rule, ...] = (
    BOUNDS,
    _engine_for("partial_rollouts", ": in-flight samples live in the engine's slots"),
    Needs("partial_kv", "partial_rollouts",
          "{flag} {value} is a setting of --partial-rollouts; add --partial-rollouts"),
    _async_engine,
    Needs("rollout_devices", "async_rollouts", _OF_ASYNC, given="on"),
    _engine_for("rollout_devices"),
    Excludes("async_rollouts", "partial_rollouts",
             "--async and --partial-rollouts are exclusive (choose one)"),
    Needs("max_staleness", "async_rollouts", _OF_ASYNC),
    Needs("token_budget", "partial_rollouts", "{flag} is the budget of "
          "--partial-rollouts; add --partial-rollouts", given="set"),
)


# ------------------------------------------------------------------------ the lora one


def _lora_targets(run: Any, catalog: Catalog) -> None:
  if run.lora_rank is None:
    return
  names = [t.strip() for t in run.lora_targets.split(",") if t.strip()]
  names = list(LORA_TARGET_NAMES) if names == ["all"] else names
  bad = [t for t in names if t.removesuffix("_proj") not in LORA_TARGET_NAMES]
  if bad or not names:
    raise ValueError(f"--lora-targets {run.lora_targets!r}: {bad or 'nothing'} matches "
                     f"no module; valid targets: {','.join(LORA_TARGET_NAMES)} or all")


def _lora_init(run: Any, catalog: Catalog) -> None:
  """``--lora-init``'s adapter has the run's rank, alpha and targets."""
  if run.lora_rank is None or run.lora_init is None:
    return
  differ = catalog.lora_adapter_mismatch(run)
  if differ is not None:
    name, mine, theirs = differ

    def show(x: Any) -> str:
      return ",".join(x) if isinstance(x, tuple) else f"{x:g}"
    raise ValueError(f"--lora-init {run.lora_init!r}: the adapter has {name} "
                     f"{show(theirs)}, the run {flag('lora_' + name)} {show(mine)}; "
                     f"pass {flag('lora_' + name)} {show(theirs)}")


_OF_LORA = "{flag} is a setting of --lora-rank; add --lora-rank"
LORA_RULES: tuple[Rule, ...] = (
    BOUNDS,
    Excludes("remat", "lora_rank", "--remat is not supported with --lora-rank yet (the "
             "adapters are applied by qwix inside the blocks)", given=("on", "set")),
    *(Needs(name, "lora_rank", _OF_LORA, switch_on="set")
      for name in ("lora_alpha", "lora_targets", "lora_base_dtype", "lora_init")),
    _lora_targets,
    Excludes("partial_rollouts", "lora_rank", "--partial-rollouts is not supported with "
             "--lora-rank yet (its engine would run the base weights)",
             given=("on", "set")),
    _lora_init,
)


# ----------------------------------------------------------------------- the sections


@dataclasses.dataclass(frozen=True)
class Section:
  """A section of the run's settings: its name, its frozen view (``settings``, whose
  fields name the RunConfig fields it holds) and its checks, run in order: the rules
  before :data:`BOUNDS` check what its names refer to (a task, a model, a file), then
  the declared ranges of its fields, then the rules after it how its settings
  combine."""
  name: str
  settings: type
  rules: tuple[Rule, ...]

  def phase(self, run: Any, catalog: Catalog | None, which: int) -> None:
    """Raises the ``ValueError`` of the first rule ``run`` breaks in the phase
    ``which``: 0 the rules before :data:`BOUNDS`, 1 the bounds, 2 the rules after."""
    at = self.rules.index(BOUNDS)
    if which == 1:
      BOUNDS(run, tuple(run_fields(self.settings).values()))
      return
    for rule in self.rules[:at] if which == 0 else self.rules[at + 1:]:
      rule(run, catalog)

  def check(self, run: Any, catalog: Catalog | None) -> None:
    """This section's checks alone, in order."""
    for which in range(3):
      self.phase(run, catalog, which)


# The sections, in the order they are checked.
SECTIONS: dict[str, Section] = {s.name: s for s in (
    Section("task", TaskSettings, TASK_RULES),
    Section("recipe", RecipeSettings, RECIPE_RULES),
    Section("model", ModelSettings, MODEL_RULES),
    Section("critic", CriticSettings, CRITIC_RULES),
    Section("budget", BudgetSettings, BUDGET_RULES),
    Section("dapo", DapoSettings, DAPO_RULES),
    Section("mesh", MeshSettings, MESH_RULES),
    Section("io", IOSettings, IO_RULES),
    Section("rollout", RolloutSettings, ROLLOUT_RULES),
    Section("lora", LoraSettings, LORA_RULES),
)}


def section_view(run: Any, name: str) -> Any:
  """The frozen view of the section ``name`` of ``run`` (``ValueError`` naming the
  sections for another name)."""
  if name not in SECTIONS:
    raise ValueError(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
  return view(SECTIONS[name].settings, run)


def validate_sections(run: Any, catalog: Catalog | None) -> None:
  """Each section's checks (:meth:`Section.check`), phase by phase: what every
  section's names refer to, then every declared range (in the order RunConfig declares
  the fields), then how each section's settings combine; the first setting at fault
  is a one-line ``ValueError`` naming its flag."""
  sections = SECTIONS.values()
  for section in sections:
    section.phase(run, catalog, 0)
  BOUNDS(run, [f.name for f in dataclasses.fields(run)])
  for section in sections:
    section.phase(run, catalog, 2)


__all__ = ["BOUNDS", "BudgetSettings", "Bounds", "Catalog", "CriticSettings", "DapoSettings",
           "Excludes", "IOSettings", "LoraSettings", "MeshSettings", "ModelSettings",
           "Needs", "RecipeSettings", "RolloutSettings", "SECTIONS", "Section",
           "TaskSettings", "check_bounds", "flag", "run_fields", "section_view",
           "validate_sections", "view"]
