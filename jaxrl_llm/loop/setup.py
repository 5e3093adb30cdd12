"""The task and the policy of a run: built-in or from local files.

* the task: :func:`~jaxrl_llm.loop.task_setup.make_task` (a JSONL ``run.dataset``, a task
  source's ``run.task`` such as ``rg:chain_sum``, or a built-in task).
* ``run.model`` a checkpoint (a local Hugging Face Llama / Qwen2 / Qwen3 folder, a GGUF
  file of those families, or a packaged model's name:
  :func:`jaxrl_llm.models.sources.checkpoint_path`): the model from
  :func:`jaxrl_llm.models.sources.load_checkpoint` (value head, when the recipe uses
  one, initialised to zeros) and its tokenizer
  (:class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer`, prompts rendered with its chat
  template when it has one); else the reference transformer preset, with the task's
  character tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxrl_llm.loop.config import (
  RunConfig,
  check_checkpoints_match,
  identity_difference,
  read_run_config,
)
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.resolve import LoraSettings, Resolved, resolve
from jaxrl_llm.loop.task_setup import make_task
from jaxrl_llm.tasks.base import Task

if TYPE_CHECKING:
  from jaxrl_llm.rollout.vllm import VllmEngine


def is_checkpoint(model: str) -> bool:
  """Whether ``model`` names a checkpoint (a Hugging Face folder, a GGUF file, a
  packaged model), not a preset."""
  from jaxrl_llm.model_files import checkpoint_path
  return checkpoint_path(model) is not None


def model_file(model: str) -> str:
  """The local folder or file of the checkpoint ``model`` names (a packaged model's
  name resolved to its installed file)."""
  from jaxrl_llm.model_files import checkpoint_path
  path = checkpoint_path(model)
  if path is None:
    raise ValueError(f"{model!r} is a preset, not a checkpoint.")
  return path


def _load(resolved: Resolved, task: Task, *, value_head: bool, path: str | None = None):
  """``(graphdef, params)`` of ``path`` (default the run's model): a checkpoint or a
  preset."""
  from flax import nnx

  from jaxrl_llm.models import Transformer, get_config, split_model
  from jaxrl_llm.models.sources import load_checkpoint
  from jaxrl_llm.models.transformer import abstract_model
  tok = task.tokenizer
  path = resolved.model if path is None else path
  if not is_checkpoint(path):
    cfg = get_config(path, tok.vocab_size, value_head=value_head,
                     max_seq_len=max(task.max_prompt_len + task.max_new_tokens, 8))
    if resolved.remat:
      cfg = dataclasses.replace(cfg, remat=True)
    return split_model(Transformer(cfg, rngs=nnx.Rngs(resolved.seed)))
  model = load_checkpoint(model_file(path), value_head=value_head)
  if tok.vocab_size > model.config.vocab_size:
    raise ValueError(f"the tokenizer of {resolved.model!r} has {tok.vocab_size} tokens, "
                     f"more than the vocab_size {model.config.vocab_size} of {path!r}.")
  graphdef, params = split_model(model)
  if resolved.remat or (resolved.remat is None and resolved.lora is None):  # RunConfig.remat
    # The same parameters under a graph whose blocks are rematerialised.
    graphdef = split_model(abstract_model(dataclasses.replace(model.config, remat=True)))[0]
  return graphdef, params


def load_models(resolved: Resolved, task: Task) -> tuple[Any, Any, Any]:
  """``(graphdef, params, critic_graphdef)`` of the run's models, freshly loaded.

  With a separate critic (``run.critic`` and a recipe with a value model) ``params``
  is ``{"policy": ..., "critic": ...}`` (:mod:`jaxrl_llm.models.critic`), the critic
  loaded from ``run.critic`` (or the policy's initial weights for ``"policy"``) with
  a value head; otherwise ``critic_graphdef`` is None and the policy carries the value
  head when the recipe has a value model.
  """
  separate = resolved.separate_critic
  graphdef, params = _load(resolved, task,
                           value_head=resolved.train.use_value and not separate)
  if not separate:
    return graphdef, params, None
  from jaxrl_llm.models.critic import actor_critic_params
  critic_path = resolved.model if resolved.critic == "policy" else resolved.critic
  critic_graphdef, critic_params = _load(resolved, task, value_head=True, path=critic_path)
  return graphdef, actor_critic_params(params, critic_params), critic_graphdef


def make_policy(resolved: Resolved, task: Task) -> Policy:
  """The run's policy: ``run.model`` loaded from its folder, or the preset, with the
  rollout backend ``run.rollout`` names (:data:`ROLLOUT_BUILDERS`).

  With ``run.critic`` (and a recipe with a value model) the parameters are
  ``{"policy": ..., "critic": ...}`` (:mod:`jaxrl_llm.models.critic`): the critic is
  loaded from ``run.critic`` (or the policy's initial weights for ``"policy"``) with a
  zero-initialised value head; sampling and the KL reference use the policy part
  only (the reference keeps no value head either: :meth:`Policy.ref_params`). With
  ``run.rollout == "engine"`` it generates through a
  :class:`~jaxrl_llm.rollout.RolloutEngine` of ``run.rollout_slots`` slots; with
  ``"vllm"`` through a :class:`~jaxrl_llm.rollout.vllm.VllmEngine` on the folder
  ``run.model`` (its dtype; more ``vllm.LLM`` arguments from the JSON object in the
  environment variable ``JAXRL_LLM_VLLM_ARGS``, e.g. ``{"gpu_memory_utilization": 0.3}``);
  with ``"simple"`` through the rectangular sampler, its prompts padded to the task's
  ``max_prompt_len``.
  """
  return ROLLOUT_BUILDERS[resolved.run.rollout](_policy(resolved, task), resolved, task)


def _with_engine(policy: Policy, resolved: Resolved, task: Task) -> Policy:
  """``policy`` generating through a :class:`~jaxrl_llm.rollout.RolloutEngine` of
  ``rollout.slots`` slots (default: a process's rows of a step, at most
  :data:`_MAX_DEFAULT_SLOTS`)."""
  import jax
  rollout = resolved.rollout
  # Each process of a multi-process run generates its share of the rows.
  rows = (resolved.sampling.prompts_per_step * resolved.sampling.group_size
          // jax.process_count())
  return policy.with_backend(policy.engine_backend(
      max_slots=rollout.slots or min(rows, _MAX_DEFAULT_SLOTS),
      max_len=task.max_prompt_len + task.max_new_tokens,
      max_prompt_len=task.max_prompt_len, prefill_rows=rollout.prefill_rows))


def _with_vllm(policy: Policy, resolved: Resolved, task: Task) -> Policy:
  """``policy`` generating through a :class:`~jaxrl_llm.rollout.vllm.VllmEngine` on
  the run's model (:func:`make_vllm_engine`)."""
  return policy.with_backend(make_vllm_engine(resolved.model,
                                              task.max_prompt_len + task.max_new_tokens))


def _with_sampler(policy: Policy, resolved: Resolved, task: Task) -> Policy:
  """``policy`` generating through the rectangular sampler, every call's prompts padded
  to the task's ``max_prompt_len`` (one compilation; the tokenizer's width)."""
  return policy.with_backend(policy.sampler_backend(prompt_len=task.max_prompt_len))


# ``run.rollout`` (one of ``_names.ROLLOUT_BACKENDS``) -> the policy with that backend.
ROLLOUT_BUILDERS: dict[str, Callable[[Policy, Resolved, Task], Policy]] = {
    "engine": _with_engine, "vllm": _with_vllm, "simple": _with_sampler}


def make_vllm_engine(model_dir: str, max_model_len: int) -> VllmEngine:
  """A :class:`~jaxrl_llm.rollout.vllm.VllmEngine` on ``model_dir`` in the checkpoint's
  dtype, with the ``vllm.LLM`` arguments of ``$JAXRL_LLM_VLLM_ARGS`` (a JSON object)."""
  import json

  import jax.numpy as jnp

  from jaxrl_llm.models.hf import config_from_hf, read_hf_config
  from jaxrl_llm.rollout.vllm import VllmEngine
  config = config_from_hf(read_hf_config(model_dir))
  extra = os.environ.get("JAXRL_LLM_VLLM_ARGS", "").strip()
  try:
    kwargs = json.loads(extra) if extra else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"$JAXRL_LLM_VLLM_ARGS is not a JSON object ({e}).") from None
  if not isinstance(kwargs, dict):
    raise ValueError(f"$JAXRL_LLM_VLLM_ARGS must be a JSON object, got {extra!r}.")
  kwargs.setdefault("dtype", jnp.dtype(config.dtype).name)
  return VllmEngine(model_dir, max_model_len=max_model_len, config=config, **kwargs)


# The engine's default slot count: all completions of a step, up to this many.
_MAX_DEFAULT_SLOTS = 256


def _policy(resolved: Resolved, task: Task) -> Policy:
  from jaxrl_llm.models import make_apply_fn, make_decode_fns, make_paged_decode_fns
  from jaxrl_llm.rollout import DecodeFns, PagedDecodeFns
  tok = task.tokenizer
  config, separate = resolved.train, resolved.separate_critic
  if resolved.lora is not None:
    return _lora_policy(resolved, resolved.lora, task)
  if not separate and not is_checkpoint(resolved.model):
    return Policy.reference(resolved.model, tok.vocab_size,
                            task.max_prompt_len + task.max_new_tokens, tok.pad_id,
                            value_head=config.use_value, seed=resolved.seed,
                            temperature=config.temperature,
                            logprob_start=config.logprob_start)
  graphdef, params, critic_graphdef = load_models(resolved, task)
  if critic_graphdef is None:
    return Policy.of_transformer(graphdef, params, pad_id=tok.pad_id,
                                 temperature=config.temperature,
                                 logprob_start=config.logprob_start)
  from jaxrl_llm.models.critic import POLICY, actor_critic_apply
  fns, paged = make_decode_fns(graphdef), make_paged_decode_fns(graphdef)
  decode = DecodeFns(
      init_cache=lambda p, batch, max_len: fns.init_cache(p[POLICY], batch, max_len),
      prefill=lambda p, tokens, mask, cache: fns.prefill(p[POLICY], tokens, mask, cache),
      decode=lambda p, tokens, cache: fns.decode(p[POLICY], tokens, cache))
  paged_decode = PagedDecodeFns(
      init_pages=lambda p, num_pages, page_size: paged.init_pages(p[POLICY], num_pages,
                                                                  page_size),
      forward=lambda p, *args: paged.forward(p[POLICY], *args))
  # Sampling and the KL reference use the policy part alone (no critic).
  return Policy(actor_critic_apply(graphdef, critic_graphdef), decode,
                params, pad_id=tok.pad_id,
                temperature=config.temperature, ref_apply_fn=make_apply_fn(graphdef),
                ref_part=lambda p: p[POLICY], paged_decode_fns=paged_decode,
                logprob_start=config.logprob_start)


def lora_model(run: RunConfig, graphdef: Any, params: Any) -> tuple[Any, Any]:
  """``(graphdef, params)`` of the model ``(graphdef, params)`` with the LoRA adapters
  of the run config ``run`` (:func:`jaxrl_llm.models.lora.apply_lora`; seeded by
  ``run.seed``)."""
  return _with_lora(run.section("lora"), run.seed, graphdef, params)


def _with_lora(lora: LoraSettings, seed: int, graphdef: Any, params: Any
               ) -> tuple[Any, Any]:
  """:func:`lora_model` of the resolved ``lora`` settings."""
  from flax import nnx

  from jaxrl_llm.models import split_model
  from jaxrl_llm.models.lora import apply_lora
  assert lora.rank is not None
  model = apply_lora(nnx.merge(graphdef, params), rank=lora.rank, alpha=lora.alpha,
                     targets=lora.targets, base_dtype=lora.base_dtype, seed=seed)
  return split_model(model)


def _lora_policy(resolved: Resolved, lora: LoraSettings, task: Task) -> Policy:
  """The run's policy with LoRA adapters: the train forward adds them, the KL
  reference is the same parameters with the adapters off (the base is shared), and
  generation runs on merged weights. A separate critic is trained in full. With
  ``lora.init`` the adapters start from that PEFT folder
  (:func:`jaxrl_llm.models.lora.load_lora_adapters`)."""
  from flax import nnx

  from jaxrl_llm.models import make_apply_fn, make_decode_fns, make_paged_decode_fns
  from jaxrl_llm.models.critic import POLICY, actor_critic_apply
  from jaxrl_llm.models.lora import (
    base_graphdef,
    lora_reference_apply,
    lora_trainable,
    merge_lora,
  )
  config = resolved.train
  graphdef, params, critic_graphdef = load_models(resolved, task)
  separate = critic_graphdef is not None
  graphdef, policy_params = _with_lora(lora, resolved.seed, graphdef,
                                       params[POLICY] if separate else params)
  if lora.init is not None:      # the adapters' start (step 0; --resume restores)
    from jaxrl_llm.models import split_model
    from jaxrl_llm.models.lora import load_lora_adapters
    graphdef, policy_params = split_model(load_lora_adapters(
        nnx.merge(graphdef, policy_params), lora.init, flag="--lora-init"))
  base = base_graphdef(nnx.merge(graphdef, policy_params))
  part = (lambda p: p[POLICY]) if separate else (lambda p: p)
  apply = make_apply_fn(graphdef)
  if separate:
    params = {**params, POLICY: policy_params}
    apply = actor_critic_apply(graphdef, critic_graphdef)
  else:
    params = policy_params
  return Policy(apply, make_decode_fns(base), params, pad_id=task.tokenizer.pad_id,
                temperature=config.temperature,
                ref_apply_fn=lora_reference_apply(make_apply_fn(graphdef)), ref_part=part,
                paged_decode_fns=make_paged_decode_fns(base),
                rollout_params=lambda p: merge_lora(graphdef, part(p)),
                trainable=lora_trainable, ref_shares_params=True,
                logprob_start=config.logprob_start)


def restore_latest(run_dir: str, *, params_only: bool = False
                   ) -> tuple[Resolved, Task, Policy, Any, int]:
  """``(resolved, task, policy, state, step)``: the run folder ``run_dir`` rebuilt from its
  ``config.json`` and its newest checkpoint restored into that policy's
  :class:`~jaxrl_llm.train.TrainState`; with ``params_only``, ``state`` is the policy's
  parameters alone (:func:`restore_params`: the optimizer state is never read).

  Raises:
    ValueError: ``run_dir`` holds no config or no checkpoint
      (:func:`jaxrl_llm.run_folder.restorable_problem`), or a bad config.
    CheckpointError: the checkpoint does not match the rebuilt run or is corrupt.
  """
  run = read_run(run_dir)
  task = make_task(run)
  resolved = resolve(run, task)
  policy = make_policy(resolved, task)
  if params_only:
    params, step = restore_params(run_dir, policy.init_params)
    return resolved, task, policy, params, step
  state, step = restore_state(run_dir, resolved, policy.init_params,
                              trainable=policy.trainable)
  return resolved, task, policy, state, step


def read_run(run_dir: str) -> RunConfig:
  """The :class:`RunConfig` saved in ``run_dir``, a folder with a checkpoint to
  restore (``ValueError`` saying what is missing otherwise)."""
  from jaxrl_llm import run_folder as rf
  problem = rf.restorable_problem(run_dir)
  if problem:
    raise ValueError(problem)
  run = read_run_config(os.path.join(run_dir, rf.CONFIG_FILE))
  check_checkpoints_match(run, run_dir)
  return run


def restore_state(run_dir: str, resolved: Resolved, params: Any, *,
                  trainable: Any = None) -> tuple[Any, int]:
  """``(state, step)``: the newest checkpoint of ``run_dir`` restored into a
  :class:`~jaxrl_llm.train.TrainState` template built on ``params`` (``trainable``: the
  policy's, e.g. a LoRA policy's adapters)."""
  import jax

  from jaxrl_llm import run_folder as rf
  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.train import init_train_state
  template = init_train_state(params, resolved.optimizer.build(), resolved.train,
                              rng=jax.random.PRNGKey(resolved.seed), trainable=trainable)
  with Checkpointer(os.path.join(run_dir, rf.CHECKPOINTS_DIR)) as ckpt:
    state, extra = ckpt.restore(template, check=functools.partial(
        step_problem, identity=dict(resolved.identity)))
  return state, int(extra["step"])


def step_problem(step: int, state: Any, extra: dict, *,
                 identity: dict | None = None) -> str | None:
  """Why the checkpoint folder ``step`` of a run does not hold that step (the ``check``
  of :meth:`~jaxrl_llm.checkpoint.Checkpointer.restore`), or ``None``: its ``extra``
  record's ``"step"`` and the state's own step counter (a
  :class:`~jaxrl_llm.train.TrainState`'s ``step``, one per train step; a state without
  one, e.g. the parameters alone, is not asked) must both be the folder's ``step``.
  A resume acts on that number: it keeps the metrics rows up to it and trains the steps
  after it. With ``identity`` (:meth:`RunConfig.identity` of the run resumed), the run
  the step records (``extra["run"]``, when it has one) must be that run.

  Examples:
    >>> import jax.numpy as jnp
    >>> step_problem(12, {"w": jnp.ones(2)}, {"step": 12}) is None
    True
    >>> step_problem(12, {"w": jnp.ones(2)}, {"step": 2})
    'its extra record says step 2, its folder 12'
  """
  from jaxrl_llm.loop.processes import host_value
  said = extra.get("step")
  if type(said) is not int or said != step:
    return f"its extra record says step {said!r}, its folder {step}"
  counter = getattr(state, "step", None)
  if counter is not None and int(host_value(counter)) != step:
    return f"its state's step counter is {int(host_value(counter))}, its folder {step}"
  if identity is not None and "run" in extra:
    differs = identity_difference(identity, extra["run"])
    if differs is not None:
      return f"it was saved by another run: {differs}"
  return None


def restore_params(run_dir: str, template: Any) -> tuple[Any, int]:
  """``(params, step)``: the parameters of the newest checkpoint of ``run_dir`` that
  verifies, alone, onto the structure, dtypes and shardings of ``template`` (arrays or
  ``jax.ShapeDtypeStruct`` leaves). The optimizer's moments, twice the parameters'
  size under Adam, are never read (:meth:`~jaxrl_llm.checkpoint.Checkpointer.restore`
  with ``part="params"``)."""
  from jaxrl_llm import run_folder as rf
  from jaxrl_llm.checkpoint import Checkpointer
  with Checkpointer(os.path.join(run_dir, rf.CHECKPOINTS_DIR)) as ckpt:
    params, extra = ckpt.restore(template, part="params", check=step_problem)
  return params, int(extra["step"])


def warm_start_value_params(run: RunConfig | str, params: Any) -> Any:
  """``params`` with its value parameters taken from the newest checkpoint of the run
  folder ``run`` (a folder, or a run config's ``critic_init``; NeMo-RL's
  ``warm_start_value_checkpoint``: a critic warmed up once, offline, serves many
  runs).

  The value parameters are those of :func:`jaxrl_llm.models.critic.value_param_labels`:
  the separate critic, or the shared-trunk value head. The source run is rebuilt from
  its ``config.json`` (to read its checkpoint); each value leaf must exist there at
  the same path with the same shape (:class:`~jaxrl_llm.run_folder.RunFolderError`
  naming the first that does not).
  Everything else (the policy, the optimizer state) is ``params``' own.
  """
  import jax

  from jaxrl_llm.models.critic import CRITIC, value_param_labels
  from jaxrl_llm.run_folder import RunFolderError

  folder = run if isinstance(run, str) else str(run.critic_init)
  _, _, _, restored, _ = restore_latest(folder, params_only=True)
  name = lambda path: jax.tree_util.keystr(path)
  source = {name(path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(restored)[0]}
  labels = value_param_labels(params)
  flat_labels = dict((name(p), lab) for p, lab in
                     jax.tree_util.tree_flatten_with_path(labels)[0])
  if CRITIC not in flat_labels.values():
    raise RunFolderError(f"--critic-init {folder!r}: this run has no value parameters.")

  def take(path, leaf):
    key = name(path)
    if flat_labels[key] != CRITIC:
      return leaf
    if key not in source or tuple(source[key].shape) != tuple(leaf.shape):
      got = "missing" if key not in source else f"shape {tuple(source[key].shape)}"
      raise RunFolderError(f"--critic-init {folder!r}: value parameter {key} of shape "
                           f"{tuple(leaf.shape)} is {got} in that run's checkpoint (the "
                           "model and the critic layout must match).")
    return source[key].astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(take, params)


__all__ = ["ROLLOUT_BUILDERS", "is_checkpoint", "load_models", "make_policy", "make_task",
           "make_vllm_engine",
           "model_file", "read_run",
           "restore_latest", "restore_params", "restore_state", "step_problem",
           "warm_start_value_params"]
