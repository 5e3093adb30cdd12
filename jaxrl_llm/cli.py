"""The ``jaxrl-llm`` command: ``train``, ``eval``, ``plot`` and ``export``.

``jaxrl-llm train`` with no flags trains the tiny built-in policy with GRPO on the
default task (reverse a 3-digit string) and prints a summary; ``jaxrl-llm eval --out
RUN`` re-evaluates a run's latest checkpoint; ``jaxrl-llm plot RUN [RUN ...]`` draws
the learning curves of one or several runs into a PNG; ``jaxrl-llm export RUN``
writes the latest checkpoint of a run on a Hugging Face ``--model`` as Hugging Face
folders (:mod:`jaxrl_llm.loop.export`; ``train --model PATH`` does it at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from jaxrl_llm._names import GGUF_WRITE_TYPES
from jaxrl_llm.loop.config import flag

if TYPE_CHECKING:
  from jaxrl_llm.loop.resolve import Resolved

PLOT_KEYS = (("reward", "train reward"), ("eval_accuracy", "eval accuracy (greedy)"),
             ("kl_ref", "KL to reference"), ("pg_clipfrac", "clip fraction"),
             ("entropy", "entropy"), ("adv_raw_var", "advantage variance"))


# Other flag names of a field (the mesh axes' short names).
ALIASES = {"mesh_data": ("--data",), "mesh_fsdp": ("--fsdp",), "mesh_tensor": ("--tensor",),
           "async_rollouts": ("--async",)}
# Metavariables of the options whose values are not one word.
METAVARS = {"compile_cache": "DIR|off", "task_config": "KEY=VALUE",
            "holdout": "N|FRACTION", "eval_dataset": "FILE", "dataset": "FILE"}
# The subcommands (build_parser adds each; train is the default).
COMMANDS = ("train", "eval", "plot", "export", "serve")
TRAIN_PREFIX = "train__"
# What the start line and the summary say of a --dataset run evaluated on its own rows.
EVAL_ON_TRAIN_ROWS = ("eval on training rows: pass --eval-dataset FILE or --holdout "
                      "N|FRACTION for a held-out score")
LAUNCH_PREFIX = "launch__"
LOSS_PREFIX = "loss__"


def plain_help(text: str) -> str:
  """A field's help text without reStructuredText markup.

  Examples:
    >>> plain_help("see :func:`jaxrl_llm.aggregate` and ``kl_mode``")
    'see jaxrl_llm.aggregate and kl_mode'
  """
  return re.sub(r"``|:\w+:`~?([^`]*)`", lambda m: m.group(1) or "", text)


def _optional(tp) -> tuple:
  """``(base type, is_optional)`` of a field annotation."""
  args = [a for a in typing.get_args(tp) if a is not type(None)]
  if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
    return args[0], True
  return tp, False


def _parse(base, optional: bool):
  def parse(text: str):
    if optional and text.lower() == "none":
      return None
    return base(text)
  parse.__name__ = base.__name__
  return parse


def _add_field(group, f, hints, *, dest, default, shown):
  """One option for the declared dataclass field ``f`` (its metadata: help, choices)."""
  from jaxrl_llm.train.config import field_choices
  base, optional = _optional(hints[f.name])
  names = (flag(f.name),) + ALIASES.get(f.name, ())
  choices = field_choices(f)
  help_text = plain_help(f.metadata["help"])
  selects = selected_estimator(f.name)
  if selects is not None:
    help_text += f" Giving it alone selects --advantage-estimator {selects}."
  if choices:
    help_text += f" One of: {', '.join(map(str, choices))}."
  help_text += f" (default: {shown})"
  if base is bool:
    group.add_argument(*names, dest=dest, default=default,
                       action=argparse.BooleanOptionalAction, help=help_text)
  elif typing.get_origin(base) is list:     # repeatable; left out unless given
    (item,) = typing.get_args(base)
    help_text = help_text.replace(f" (default: {shown})", " (default: none)")
    group.add_argument(*names, dest=dest, default=argparse.SUPPRESS, action="append",
                       type=item, help=help_text, metavar=METAVARS.get(f.name, "VALUE"))
  elif base in (int, float, str):
    group.add_argument(*names, dest=dest, default=default, type=_parse(base, optional),
                       choices=choices, help=help_text,
                       metavar=(METAVARS.get(f.name, f.name.upper()) if choices is None
                                else None))


def selected_estimator(name: str) -> str | None:
  """The in-step advantage estimator that a flag for TrainConfig field ``name``
  selects when given alone: the one registered estimator whose static fields include
  it (``hybrid_n``: ``hybrid``); None for any other field.

  Examples:
    >>> selected_estimator("hybrid_n"), selected_estimator("lam")
    ('hybrid', None)
  """
  from jaxrl_llm.train.registry import ADVANTAGE_ESTIMATOR_REGISTRY
  readers = [s.name for s in ADVANTAGE_ESTIMATOR_REGISTRY.values()
             if s.needs_values and name in s.static]
  return readers[0] if len(readers) == 1 else None


def _recipe_note(settings: dict, default: Any = dataclasses.MISSING) -> str:
  """``; --algo sets X for ppo, ...`` for the recipes whose setting differs from
  ``default`` (``settings``: recipe name -> its setting, absent when it sets none)."""
  groups: dict = {}
  for name, val in settings.items():
    if val is not dataclasses.MISSING and val != default:
      groups.setdefault(str(val), []).append(name)
  if not groups:
    return ""
  if len(groups) == 1 and len(next(iter(groups.values()))) == len(settings):
    return f"; every --algo sets {next(iter(groups))}"
  return "; --algo sets " + "; ".join(f"{val} for {', '.join(names)}"
                                      for val, names in groups.items())


def add_train_args(p: argparse.ArgumentParser) -> None:
  """The ``train`` options, generated from the RunConfig and TrainConfig declarations."""
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.recipes import RECIPES, Recipe
  from jaxrl_llm.train import TrainConfig
  from jaxrl_llm.train.registry import POLICY_LOSS_REGISTRY

  run_group = p.add_argument_group("run")
  hints = typing.get_type_hints(RunConfig)
  # A None that stands for the recipe's setting shows what a recipe that sets nothing
  # uses, then the recipes that set another value.
  plain = Recipe("", "grpo", "").run_settings()
  for f in dataclasses.fields(RunConfig):
    if not f.metadata["flag"]:
      continue
    shown = f.default
    if f.name in plain:
      shown = f"{plain[f.name]}" + _recipe_note(
          {r.name: r.run_settings()[f.name] for r in RECIPES.values()}, plain[f.name])
    _add_field(run_group, f, hints, dest=f.name, default=f.default, shown=shown)
  step_group = p.add_argument_group(
      "train step (TrainConfig; unset options take the --algo recipe's value)")
  hints = typing.get_type_hints(TrainConfig)
  for f in dataclasses.fields(TrainConfig):
    if not f.metadata["flag"]:
      continue
    note = _recipe_note({r.name: r.train.get(f.name, dataclasses.MISSING)
                         for r in RECIPES.values()})
    # Left out of the namespace unless given, so that an explicit ``none`` is kept.
    _add_field(step_group, f, hints, dest=TRAIN_PREFIX + f.name,
               default=argparse.SUPPRESS, shown=f"{f.default}{note}")
  from jaxrl_llm.loop.config import LaunchConfig
  launch_group = p.add_argument_group(
      "multi-host (the same command on every host; see docs/multihost.md)")
  hints = typing.get_type_hints(LaunchConfig)
  for f in dataclasses.fields(LaunchConfig):
    _add_field(launch_group, f, hints, dest=LAUNCH_PREFIX + f.name, default=f.default,
               shown=f.default)
  loss_group = p.add_argument_group("policy-loss hyperparameters")
  extras: dict = {}
  for spec in POLICY_LOSS_REGISTRY.values():
    for name, default in spec.extra_hparams.items():
      extras.setdefault(name, []).append(f"{spec.name}: {default}")
  for name, notes in extras.items():
    loss_group.add_argument(flag(name), dest=LOSS_PREFIX + name,
                            type=float, default=argparse.SUPPRESS, metavar=name.upper(),
                            help=f"(default: {'; '.join(notes)})")


def _train_epilog() -> str:
  from jaxrl_llm.loop.recipes import RECIPES
  from jaxrl_llm.tasks import TASKS
  from jaxrl_llm.train.registry import POLICY_LOSS_REGISTRY
  lines = ["algorithms (--algo):"]
  lines += [f"  {r.name:<14} {r.doc}" for r in RECIPES.values()]
  lines += ["policy losses (--policy-loss):"]
  lines += [f"  {spec.name:<14} {spec.doc}" for spec in POLICY_LOSS_REGISTRY.values()]
  from jaxrl_llm.tasks import TASK_SOURCES
  lines += ["tasks (--task): " + ", ".join(sorted(TASKS))]
  lines += [f"  {source.doc}" for source in TASK_SOURCES.values()]
  return "\n".join(lines)


def run_config_from_args(args: argparse.Namespace) -> Any:
  """The :class:`~jaxrl_llm.loop.config.RunConfig` of parsed ``train`` arguments.

  Train-step and policy-loss options are in ``args`` only when given (their default is
  ``argparse.SUPPRESS``), so ``--clip-high none`` sets None over the recipe's value.
  """
  from jaxrl_llm.loop.config import RunConfig
  values = vars(args)
  run = {f.name: values[f.name] for f in dataclasses.fields(RunConfig)
         if f.name in values}
  train = {k[len(TRAIN_PREFIX):]: val for k, val in values.items()
           if k.startswith(TRAIN_PREFIX)}
  loss = {k[len(LOSS_PREFIX):]: val for k, val in values.items()
          if k.startswith(LOSS_PREFIX)}
  if loss:
    train["loss_hparams"] = loss
  for name in list(train):
    selects = selected_estimator(name)
    if selects is not None:
      train.setdefault("advantage_estimator", selects)
  return RunConfig(**run, train=train)


def launch_config_from_args(args: argparse.Namespace) -> Any:
  """The :class:`~jaxrl_llm.loop.config.LaunchConfig` (multi-host flags) of parsed
  ``train`` arguments."""
  from jaxrl_llm.loop.config import LaunchConfig
  values = vars(args)
  return LaunchConfig(**{f.name: values[LAUNCH_PREFIX + f.name]
                         for f in dataclasses.fields(LaunchConfig)
                         if LAUNCH_PREFIX + f.name in values})


def join_job(launch: Any) -> bool:
  """Joins the multi-host job ``launch`` describes (or the environment's); returns
  whether this is a multi-process run. Must run before any JAX computation.

  A job that does not form (a process not started or dead before it registers, an
  unreachable coordinator) ends the process with one line and status 75 after the
  initialisation timeout (``JAXRL_INIT_TIMEOUT``, default 300 s).
  """
  from jaxrl_llm.parallel.multihost import initialize_multihost
  try:
    initialize_multihost(launch.coordinator, launch.num_processes, launch.process_id,
                         cpu_collectives=launch.cpu_collectives,
                         auto_detect=launch.multihost_auto)
  except ValueError as e:
    if not launch.multihost_auto:
      raise
    raise ValueError(f"--multihost-auto: JAX found no job to join here (no Cloud TPU "
                     f"pod slice, SLURM step or Open MPI launch detected: {e}); pass "
                     "--coordinator HOST:PORT --num-processes N --process-id I") from None
  import jax
  return jax.process_count() > 1


def _flags_in_message(message: str) -> str:
  """``ValueError`` text with backticked config field names as the flags that set them."""
  return re.sub(r"`(\w+)`", lambda m: flag(m.group(1)), message)


def _explicit_train_dests(argv: list) -> set:
  """The ``train`` options given on the command line (not left at their default)."""
  p = argparse.ArgumentParser(add_help=False)
  add_train_args(p)
  for action in p._actions:
    action.default = argparse.SUPPRESS
  return set(vars(p.parse_known_args(argv)[0]))


def _resume_config(args: argparse.Namespace, argv: list):
  """The run to continue on ``--resume``: the saved config, changed only by the
  resumable options given on the command line. A given option whose value differs
  from the one the saved run uses (recipe defaults filled in) raises ``ValueError``
  naming it."""
  from jaxrl_llm import run_folder as rf
  from jaxrl_llm.loop.config import (
    RESUMABLE_FIELDS,
    check_checkpoints_match,
    read_run_config,
  )
  from jaxrl_llm.loop.resolve import effective, resolve
  saved = read_run_config(os.path.join(args.out, rf.CONFIG_FILE))
  check_checkpoints_match(saved, args.out)     # a hand-edited config.json
  given = run_config_from_args(args)
  # The given options, and the estimator that one of them alone implies (--hybrid-n).
  explicit = _explicit_train_dests(argv) | {TRAIN_PREFIX + k for k in given.train
                                            if k != "loss_hparams"}
  changes: dict = {"resume": True, "overwrite": False, "out": args.out}
  conflicts = []
  saved_train = resolve(saved).train
  for dest in sorted(explicit):
    if dest.startswith(LAUNCH_PREFIX):      # how to launch, not what the run is
      continue
    if dest.startswith(TRAIN_PREFIX):
      name = dest[len(TRAIN_PREFIX):]
      value, before = given.train.get(name), getattr(saved_train, name)
    elif dest.startswith(LOSS_PREFIX):
      name = dest[len(LOSS_PREFIX):]
      value = (given.train.get("loss_hparams") or {}).get(name)
      before = saved_train.hparam_values().get(name)
    else:
      name, value = dest, getattr(given, dest)
      if name in RESUMABLE_FIELDS:
        changes[name] = value
        continue
      # A None that stands for the recipe's value is filled in, so that restating
      # it on --resume is no contradiction.
      value = effective(dataclasses.replace(saved, **{name: value}), name)
      before = effective(saved, name)
    if value != before:
      conflicts.append(f"{flag(name)} {value} (the saved run has {before})")
  if conflicts:
    allowed = ", ".join(flag(f) for f in RESUMABLE_FIELDS
                        if f not in ("out", "resume", "overwrite"))
    raise ValueError(f"--resume continues the run saved in {args.out}; "
                     f"{'; '.join(conflicts)} contradicts it. Only {allowed} may change "
                     "on --resume (or pass --overwrite, or choose another --out).")
  return dataclasses.replace(saved, **changes)


def cmd_train(args: argparse.Namespace) -> int:
  from jaxrl_llm import run_folder as rf
  argv = getattr(args, "argv", [])
  multi = False
  try:   # every flag is checked before JAX is imported (only the device count needs it)
    launch = launch_config_from_args(args)
    launch.validate()
    args.resume = args.resume or args.resume_or_start
    saved = os.path.exists(os.path.join(args.out, rf.CONFIG_FILE))
    if args.resume and not args.overwrite and saved:
      run = _resume_config(args, argv)
    else:
      if args.resume and not args.resume_or_start:
        raise ValueError(f"--resume: {args.out} holds no run (no {rf.CONFIG_FILE}); "
                         "check --out, or pass --resume-or-start to start a new run there")
      run = run_config_from_args(args)
      if ("max_new_tokens" in _explicit_train_dests(argv) and run.dataset is None
          and not run.takes_max_new_tokens):
        raise ValueError(f"--max-new-tokens applies to --dataset runs and task sources' "
                         f"tasks (rg:...): the built-in task {args.task!r} has its own "
                         "response budget (its longest answer and eos)")
      if args.resume:
        print(f"note: no run in {args.out} yet: starting a new one", file=sys.stderr)
    from jaxrl_llm.loop.resolve import resolve_run
    # The run's own checks and the recipe's, the command's, then the task: once.
    resolved, task = resolve_run(run, before_task=_command_checks)
    if not launch.joins_a_job():
      _early_note(run)             # before the slow imports
    _use_compile_cache(run.compile_cache)   # before anything compiles
    multi = join_job(launch)       # before any JAX computation
    import jax
    if multi:
      from jaxrl_llm.loop.processes import check_multiprocess
      check_multiprocess(run, resolved, jax.process_count(), jax.device_count())
    if launch.joins_a_job() and jax.process_index() == 0:
      _early_note(run)
    run.check_devices(jax.device_count())
  except (ValueError, OSError, ImportError) as e:
    print(f"error: {_flags_in_message(str(e))}", file=sys.stderr)
    return _leave(multi, 2)
  from jaxrl_llm.checkpoint import CheckpointError
  from jaxrl_llm.loop.run import SkippedUpdatesError, format_summary, run_training
  from jaxrl_llm.models.lora import AdapterError
  from jaxrl_llm.rollout.vllm import VllmLoadError, VllmMissingError, VllmPushError
  try:
    summary = run_training(resolved, task=task)
  except (rf.RunFolderError, AdapterError) as e:     # --lora-init's tensors: the model's
    print(f"error: {e}", file=sys.stderr)
    return _leave(multi, 2)
  except (VllmMissingError, VllmLoadError, VllmPushError) as e:    # --rollout vllm
    print(f"error: {e}", file=sys.stderr)
    return _leave(multi, 1)
  except (rf.RunFolderIOError, CheckpointError, SkippedUpdatesError) as e:
    if multi and not isinstance(e, SkippedUpdatesError):
      # A save cut off by a lost process fails here: let the watchdog name it.
      from jaxrl_llm.parallel.multihost import await_lost_peer
      await_lost_peer()
    print(f"error: {e}", file=sys.stderr)
    return _leave(multi, 1)
  except KeyboardInterrupt as e:     # RunInterrupted (a first Ctrl-C, SIGTERM) included
    import jax
    if jax.process_index() == 0 and os.path.exists(os.path.join(run.out, rf.METRICS_FILE)):
      print(f"curves: {_draw_curves(run.out)}", file=sys.stderr)
    if isinstance(e, rf.RunInterrupted):
      return _leave(multi, e.exit_code, ok=True)
    return _leave(multi, 130)
  except Exception:
    if multi:    # a collective failed? then the watchdog names the lost process
      from jaxrl_llm.parallel.multihost import await_lost_peer, mark_failed
      if not await_lost_peer():
        mark_failed(1)
    raise
  import jax
  if jax.process_index() != 0:      # process 0 reports; the others leave together
    return _leave(multi, 0, ok=True)
  from jaxrl_llm.loop.setup import is_checkpoint
  if is_checkpoint(run.model) and multi:
    summary["export"] = f"run 'jaxrl-llm export {run.out}' (one process)"
  elif is_checkpoint(run.model):
    from jaxrl_llm.loop.export import export_run
    try:
      summary.update(export_run(run.out))
    except (ValueError, OSError, CheckpointError) as e:
      print(f"error: exporting the trained model: {e}", file=sys.stderr)
      return 1
  summary["plot"] = _draw_curves(run.out)
  if run.eval_on_train_rows:
    summary["eval_split"] = EVAL_ON_TRAIN_ROWS
  print(format_summary(summary))
  return _leave(multi, 0, ok=True)


def _leave(multi: bool, code: int, *, ok: bool = False) -> int:
  """``code``, after leaving the multi-host job: cleanly (``ok``: every process leaves
  at this point) or telling the other processes this one failed."""
  if multi:
    from jaxrl_llm.parallel.multihost import mark_failed, shutdown_multihost
    if ok:
      shutdown_multihost()
    else:
      mark_failed(code)
  return code


def _draw_curves(run_dir: str) -> str:
  """Draws ``RUN/curves.png`` (a finished or an interrupted run); its path, or why not."""
  png = os.path.join(run_dir, "curves.png")
  try:
    plot_runs([run_dir], None, png)
  except ImportError:
    return "not drawn (matplotlib is not installed: pip install matplotlib)"
  except (OSError, ValueError) as e:
    return f"not drawn ({e})"
  return png


def _use_compile_cache(setting: str | None) -> None:
  """Sets the persistent compilation cache (:mod:`jaxrl_llm.loop.compile_cache`)."""
  from jaxrl_llm.loop.compile_cache import use_compile_cache
  use_compile_cache(setting, warn=lambda line: print(line, file=sys.stderr, flush=True))


def _fail(command: str, message: str) -> int:
  print(f"error: {command}: {message}", file=sys.stderr)
  return 2


def _run_folder_problem(out: str) -> str | None:
  """Why ``out`` is not a run folder with a checkpoint to restore (None: it is), before
  JAX is imported: what ``eval`` and ``serve`` check first."""
  from jaxrl_llm import run_folder as rf
  if not os.path.isdir(out):
    return f"{out} does not exist; pass the run folder of a training run with --out"
  return rf.restorable_problem(out)


def cmd_eval(args: argparse.Namespace) -> int:
  problem = _run_folder_problem(args.out)
  if problem:
    return _fail("eval", problem)
  if args.eval_size < 1:
    return _fail("eval", f"--eval-size must be >= 1 (got {args.eval_size})")
  _use_compile_cache(args.compile_cache)
  from jaxrl_llm.checkpoint import CheckpointError
  from jaxrl_llm.loop import evaluate
  from jaxrl_llm.loop.setup import restore_latest
  try:
    _, task, policy, params, step = restore_latest(args.out, params_only=True)
  except (ValueError, OSError, CheckpointError) as e:
    return _fail("eval", str(e))
  result = {"step": step,
            **evaluate(policy, params, task, task.eval_problems(args.eval_size))}
  print(json.dumps(result))
  return 0


def cmd_serve(args: argparse.Namespace) -> int:
  """Serves a run's latest checkpoint on an OpenAI-compatible endpoint
  (:func:`jaxrl_llm.serve.serve`) until Ctrl-C or SIGTERM; every call's tokens are
  recorded, and with ``--record FILE`` written as JSON lines (one multi-turn
  trajectory a line: ``tokens``, ``loss_mask``, ``behaviour_logprobs``) at exit."""
  problem = _run_folder_problem(args.out)
  if problem:
    return _fail("serve", problem)
  for option, value in (("--slots", args.slots), ("--max-len", args.max_len)):
    if value < 1:
      return _fail("serve", f"{option} must be >= 1 (got {value})")
  _use_compile_cache(args.compile_cache)
  from jaxrl_llm.checkpoint import CheckpointError
  from jaxrl_llm.envs.chat import chat_format
  from jaxrl_llm.loop.setup import restore_latest
  from jaxrl_llm.rollout.multiturn import engine_generate
  from jaxrl_llm.serve import serve
  try:
    _, task, policy, params, step = restore_latest(args.out, params_only=True)
    chat = chat_format(task.tokenizer)
    engine = policy.engine_backend(max_slots=args.slots, max_len=args.max_len)
    generate = engine_generate(engine, policy.rollout_view(params), eos_ids=chat.stop_ids,
                               seed=args.seed)
    server = serve(generate, chat, max_len=args.max_len, host=args.host, port=args.port,
                   model_name=args.model_name, tool_parser=args.tool_parser)
  except (ValueError, OSError, CheckpointError) as e:
    return _fail("serve", str(e))
  from jaxrl_llm.run_folder import GracefulStop
  with server, GracefulStop(announce=False) as stop:
    print(f"jaxrl-llm serve: {args.out} (step {step}) at {server.base_url} as model "
          f"{args.model_name!r}; Ctrl-C stops", file=sys.stderr, flush=True)
    while not stop.requested:
      time.sleep(0.2)
  episodes = server.recorder.take()
  if args.record:
    _write_episodes(args.record, episodes)
  print(f"jaxrl-llm serve: stopped; {len(episodes)} trajectories recorded"
        + (f" in {args.record}" if args.record else ""), file=sys.stderr)
  return 0


def _write_episodes(path: str, episodes: Sequence[Any]) -> None:
  """The recorded trajectories as JSON lines (atomically)."""
  from jaxrl_llm import run_folder as rf
  lines = [json.dumps({"tokens": e.tokens.tolist(), "loss_mask": e.loss_mask.tolist(),
                       "behaviour_logprobs": e.behaviour_logprobs.tolist(),
                       "prompt_len": e.prompt_len, "turn_spans": e.turn_spans,
                       "messages": e.messages}) for e in episodes]
  rf.atomic_write_text(path, "".join(line + "\n" for line in lines))


def cmd_export(args: argparse.Namespace) -> int:
  _use_compile_cache(args.compile_cache)
  from jaxrl_llm.checkpoint import CheckpointError
  from jaxrl_llm.loop.export import export_run
  try:
    result = export_run(args.run, args.out, merge_lora=args.merge_lora,
                        gguf_type=args.gguf_type if args.gguf else None)
  except (ValueError, OSError, CheckpointError) as e:
    return _fail("export", str(e))
  if "policy_weights" in result:
    print(f"warning: export: the policy's weights are {result['policy_weights']}",
          file=sys.stderr)
  print(json.dumps(result))
  return 0


def load_history(run_dir: str) -> list[dict]:
  """The rows of a run's ``metrics.jsonl`` (a torn last line is dropped, with a note)."""
  from jaxrl_llm import run_folder as rf
  rows, note = rf.read_metrics(os.path.join(run_dir, rf.METRICS_FILE))
  if note is not None:
    print(f"note: {note}", file=sys.stderr)
  return rows


# Panels always drawn (a flat line there is news: nothing was learned).
_HEADLINE_KEYS = ("reward", "eval_accuracy")


def informative_keys(histories: Sequence[list]) -> list:
  """The :data:`PLOT_KEYS` worth a panel for these runs' metrics rows: the headline ones,
  and every other one that some run records and that is not one constant value in all
  runs (the clip fraction of single-epoch GRPO is exactly 0: no panel).

  Examples:
    >>> rows = [{"step": 1, "reward": 0.5, "pg_clipfrac": 0.0, "kl_ref": 0.1},
    ...         {"step": 2, "reward": 0.7, "pg_clipfrac": 0.0, "kl_ref": 0.2}]
    >>> [k for k, _ in informative_keys([rows])]
    ['reward', 'eval_accuracy', 'kl_ref']
  """
  keep = []
  for key, title in PLOT_KEYS:
    values = {r[key] for rows in histories for r in rows if r.get(key) is not None}
    if key in _HEADLINE_KEYS or len(values) > 1:
      keep.append((key, title))
  return keep


def plot_runs(runs: Sequence[str], labels: Sequence[str] | None, output: str) -> None:
  """Draws the learning curves of ``runs`` into ``output`` (needs matplotlib): a panel
  per :func:`informative_keys` metric. The image is written fresh and renamed into
  place (:func:`jaxrl_llm.run_folder.atomic_write_bytes`): a link at ``output`` is
  replaced, never written through."""
  import io

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  histories = [load_history(run_dir) for run_dir in runs]
  keys = informative_keys(histories)
  cols = min(3, len(keys))
  rows_n = -(-len(keys) // cols)
  fig, axes = plt.subplots(rows_n, cols, figsize=(4.4 * cols, 3.5 * rows_n), squeeze=False)
  for ax in axes.flat[len(keys):]:
    ax.set_visible(False)
  for i, (run_dir, rows) in enumerate(zip(runs, histories)):
    label = labels[i] if labels else os.path.basename(os.path.normpath(run_dir))
    for ax, (key, title) in zip(axes.flat, keys):
      pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, label=label, marker="o" if key.startswith("eval") else None,
                markersize=3)
      ax.set_title(title)
      ax.set_xlabel("step")
  labelled = [ax for ax in axes.flat if ax.get_legend_handles_labels()[0]]
  if labelled:                # a run with no rows to draw yet has no legend
    labelled[0].legend()
  fig.tight_layout()
  image = io.BytesIO()
  # The format of output's extension (as savefig(output) picks it), else PNG.
  fig.savefig(image, dpi=110, format=os.path.splitext(output)[1][1:].lower() or None)
  plt.close(fig)
  from jaxrl_llm import run_folder as rf
  rf.atomic_write_bytes(output, image.getvalue())


def cmd_plot(args: argparse.Namespace) -> int:
  from jaxrl_llm import run_folder as rf
  if args.labels and len(args.labels) != len(args.runs):
    return _fail("plot", f"--labels gives {len(args.labels)} labels for "
                 f"{len(args.runs)} run folders; give one per run")
  for run_dir in args.runs:
    path = os.path.join(run_dir, rf.METRICS_FILE)
    if not os.path.isdir(run_dir):
      return _fail("plot", f"run folder {run_dir} does not exist")
    if not os.path.exists(path):
      return _fail("plot", f"{run_dir} has no {rf.METRICS_FILE} (not a run folder, or "
                   "its run has not started)")
    try:
      rows, _ = rf.read_metrics(path)
    except OSError as e:
      return _fail("plot", str(e))
    if not rows:
      return _fail("plot", f"{path} holds no rows yet")
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return _fail("plot", "drawing needs matplotlib, which is not installed: pip install "
                 "matplotlib (or pip install -e '.[plot]')")
  try:
    plot_runs(args.runs, args.labels, args.output)
  except rf.RunFolderIOError as e:         # names the file and the cause
    return _fail("plot", str(e))
  except OSError as e:
    return _fail("plot", f"cannot write {args.output}: {e.strerror or e}")
  print(args.output)
  return 0


def _run_default(name: str) -> Any:
  """The declared default of the RunConfig field ``name``."""
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.train.config import config_field
  return config_field(RunConfig, name).default


def _add_run_option(p: argparse.ArgumentParser, name: str) -> None:
  """The ``train`` option of RunConfig field ``name`` on another subcommand."""
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.train.config import config_field
  f = config_field(RunConfig, name)
  _add_field(p, f, typing.get_type_hints(RunConfig), dest=name, default=f.default,
             shown=f.default)


class _Parser(argparse.ArgumentParser):
  """argparse with one-line errors: the message and where the help is (argparse prints
  the whole usage, 50 lines for ``train``, above it)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog="jaxrl-llm", description="Train, evaluate and plot RL runs on language "
      "models (train is the default command; see 'jaxrl-llm train --help').")
  sub = parser.add_subparsers(dest="command")
  p_train = sub.add_parser("train", help="train the built-in policy on a task",
                           description="Train a policy with an algorithm recipe and a "
                           "policy loss on a built-in task.", epilog=_train_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
  add_train_args(p_train)
  p_train.set_defaults(func=cmd_train)
  p_eval = sub.add_parser("eval", help="evaluate a run's latest checkpoint")
  p_eval.add_argument("--out", default=_run_default("out"))
  p_eval.add_argument("--eval-size", type=int, default=_run_default("eval_size"))
  _add_run_option(p_eval, "compile_cache")
  p_eval.set_defaults(func=cmd_eval)
  p_plot = sub.add_parser("plot", help="plot learning curves of runs into a PNG")
  p_plot.add_argument("runs", nargs="+", help="run folders")
  p_plot.add_argument("--labels", nargs="*", default=None)
  p_plot.add_argument("--output", "-o", default="curves.png")
  p_plot.set_defaults(func=cmd_plot)
  p_export = sub.add_parser(
      "export", help="write a run's latest checkpoint as Hugging Face folders",
      description="Write the trained policy of a run on a Hugging Face --model as a "
      "Hugging Face folder DEST/hf (with the tokenizer files), and its value model as "
      "DEST/value_head.safetensors or DEST/critic.")
  p_export.add_argument("run", help="the run folder")
  p_export.add_argument("--out", default=None, metavar="DEST",
                        help="where to write (default: the run folder)")
  p_export.add_argument("--merge-lora", action="store_true",
                        help="a --lora-rank run: also write DEST/hf, the policy with its "
                        "adapters merged into the base weights (the adapters alone are "
                        "always written to DEST/adapter in PEFT's format)")
  p_export.add_argument("--gguf", action="store_true",
                        help="also write DEST/policy.gguf (adapters merged, with the run's "
                        "tokenizer and chat template), which llama.cpp, Ollama and LM "
                        "Studio run")
  p_export.add_argument("--gguf-type", default="f32", choices=GGUF_WRITE_TYPES,
                        help="the type of the GGUF file's weight matrices (f32: exact; "
                        "norms stay f32)")
  _add_run_option(p_export, "compile_cache")
  p_export.set_defaults(func=cmd_export)
  p_serve = sub.add_parser(
      "serve", help="serve a run's latest checkpoint on an OpenAI-compatible endpoint",
      description="Serve the trained policy of a run on /v1/chat/completions, "
      "/v1/completions and /v1/models (the responses carry the prompt and sampled token "
      "ids); every call's tokens and log-probs are recorded as trajectories.")
  p_serve.add_argument("--out", default=_run_default("out"), help="the run folder")
  p_serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default: this machine only)")
  p_serve.add_argument("--port", type=int, default=8000, help="0: any free port")
  p_serve.add_argument("--model-name", default="jaxrl-llm",
                       help="the model's name in requests and /v1/models")
  p_serve.add_argument("--max-len", type=int, default=1024,
                       help="the context: prompt + new tokens of a request")
  p_serve.add_argument("--slots", type=int, default=8,
                       help="the engine's concurrent sequences")
  p_serve.add_argument("--tool-parser", default="hermes",
                       help="how tool calls are read from the text (hermes: Qwen2.5/Qwen3; "
                       "llama3_json: Llama 3.1)")
  p_serve.add_argument("--seed", type=int, default=_run_default("seed"))
  p_serve.add_argument("--record", default=None, metavar="FILE",
                       help="write the recorded trajectories as JSON lines here at exit")
  _add_run_option(p_serve, "compile_cache")
  p_serve.set_defaults(func=cmd_serve)
  return parser


def _command_checks(resolved: Resolved) -> None:
  """The command's checks of a resolved run, before its task is built and JAX is
  imported: a critic warm-up as long as the run (:func:`_check_warmup`), and a
  dataset's rows (``FILE:LINE`` errors, prompt lengths, answers: warnings printed)."""
  run = resolved.run
  _check_warmup(run, resolved.critic_warmup_steps)
  if run.dataset is not None:
    from jaxrl_llm.loop.datacheck import check_dataset
    for warning in check_dataset(run):
      print(warning, file=sys.stderr)


def _check_warmup(run: Any, warmup: int) -> None:
  """A critic warm-up as long as the run trains no policy: an error when
  ``--critic-warmup-steps`` says so, a warning when it is the recipe's (vapo: 10)."""
  if not warmup or warmup < run.steps:
    return
  if run.critic_warmup_steps is not None:
    raise ValueError(f"--critic-warmup-steps {warmup} >= --steps {run.steps}: every step "
                     "would train only the value function and the policy would never "
                     "change; choose --critic-warmup-steps below --steps")
  print(f"warning: --algo {run.algo} warms its critic up for {warmup} steps "
        f"(--critic-warmup-steps), all of --steps {run.steps}: the policy will not "
        "change; pass a larger --steps or a smaller --critic-warmup-steps",
        file=sys.stderr)


def _early_note(run: Any) -> None:
  """One line before the slow imports (the flags are checked): what is starting and
  where its outputs go."""
  if not run.progress:
    return
  what = "resuming" if run.resume else f"{run.algo} on {run.dataset or run.task}"
  if run.eval_on_train_rows:
    what += f" ({EVAL_ON_TRAIN_ROWS})"
  print(f"jaxrl-llm train: {what}, writing to {run.out}; importing JAX and building "
        "the model (the first step then compiles) ...", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
  words = list(sys.argv[1:] if argv is None else argv)
  # train is the default command: ``jaxrl-llm --steps 5`` is ``jaxrl-llm train --steps 5``
  # (``jaxrl-llm --help`` alone is the top-level help).
  if not words or words[0] not in COMMANDS + ("-h", "--help"):
    words = ["train"] + words
  args = build_parser().parse_args(words)
  args.argv = words[1:]
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
