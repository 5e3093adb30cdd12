"""The RL loop: sample G completions per prompt, score, estimate advantages, update.

``run_training(RunConfig(...))`` runs a recipe (:mod:`jaxrl_llm.recipes`: PPO with a
value head and GAE, or a critic-free estimator: GRPO, Dr.GRPO, RLOO, self-critical,
REINFORCE++) with any registered policy loss on a built-in task, evaluating greedy
accuracy on the task's held-out split and checkpointing with orbax. Everything random
in step ``s`` is derived from ``(seed, s)``, so a run resumed from a checkpoint
continues exactly as an uninterrupted one. The pieces live in :mod:`jaxrl_llm.loop`;
this module is the loop itself (``train`` is the earlier name of ``run_training``;
:mod:`jaxrl_llm.train` is the train-*step* package).

Run folder layout: ``config.json`` (the run config), ``metrics.jsonl`` (one JSON object
per step, eval results included on eval steps), ``checkpoints/<step>/`` (orbax).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.loop.batch import build_batch, sequence_advantages
from jaxrl_llm.loop.config import (MODELS, RESUMABLE_FIELDS, RunConfig, algos,
                                   make_optimizer, train_config_for)
from jaxrl_llm.loop.evaluation import evaluate
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.progress import report_progress
from jaxrl_llm.recipes import RECIPES
from jaxrl_llm.tasks import get_task
from jaxrl_llm.train import TrainConfig, make_train_step

ALGOS = tuple(RECIPES)
GROUP_ALGOS = tuple(name for name, r in RECIPES.items() if r.group)


class RunFolderError(ValueError):
  """The run folder holds another run (or one not meant to be resumed)."""


# ------------------------------------------------------------ run folder, placement


def _compile_step(run: RunConfig, step_fn, state):
  """``(jitted step, placed state, batch placer)``: one device, or a mesh via
  :func:`jaxrl_llm.parallel.shard_train_step` when ``mesh_*`` asks for one."""
  if (run.mesh_data, run.mesh_fsdp, run.mesh_tensor) == (1, 1, 1):
    return jax.jit(step_fn, donate_argnums=0), state, lambda batch: batch
  from jaxrl_llm.parallel import make_mesh, shard_batch, shard_train_step
  mesh = make_mesh(data=run.mesh_data, fsdp=run.mesh_fsdp, tensor=run.mesh_tensor)
  jitted, state = shard_train_step(step_fn, state, mesh)
  return jitted, state, lambda batch: shard_batch(batch, mesh)


def _prepare_run_folder(run: RunConfig) -> None:
  """Creates / validates the run folder and writes ``config.json``."""
  cfg_path = os.path.join(run.out, "config.json")
  if os.path.exists(cfg_path) and not run.overwrite:
    with open(cfg_path) as f:
      saved_identity = RunConfig.from_dict(json.load(f)).identity()
    if saved_identity != run.identity():
      diff = sorted(k for k in set(saved_identity) | set(run.identity())
                    if saved_identity.get(k) != run.identity().get(k))
      raise RunFolderError(f"{run.out} holds a run with a different config (fields "
                       f"{diff}); pass --overwrite to replace it or choose another --out.")
    if not run.resume:
      raise RunFolderError(f"{run.out} already holds a run; pass --resume to continue it or "
                       f"--overwrite to replace it.")
  elif run.overwrite and os.path.exists(run.out):
    shutil.rmtree(run.out)
  os.makedirs(run.out, exist_ok=True)
  with open(cfg_path, "w") as f:
    json.dump(dataclasses.asdict(run), f, indent=2)


def _load_metrics(path, upto):
  rows = []
  if os.path.exists(path):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r["step"] <= upto]


# ----------------------------------------------------------------------------- loop


def run_training(run: RunConfig, *, policy: Optional[Policy] = None,
                 on_step: Optional[Callable[[dict], None]] = None) -> dict:
  """Runs (or resumes) a training run; returns a summary dict.

  ``policy``: any :class:`~jaxrl_llm.loop.Policy` (default: the reference transformer
  ``run.model``). ``on_step(row)`` is called after every step (tests use it to
  interrupt a run). A ``KeyboardInterrupt`` saves a checkpoint of the last completed
  step and re-raises.
  """
  run.validate()
  _prepare_run_folder(run)
  task = get_task(run.task)
  tok = task.tokenizer
  config = run.train_config(task.max_new_tokens)
  if policy is None:
    policy = Policy.reference(run.model, tok.vocab_size,
                              task.max_prompt_len + task.max_new_tokens, tok.pad_id,
                              value_head=config.use_value, seed=run.seed,
                              temperature=config.temperature)
  step_fn = make_train_step(policy.apply, make_optimizer(run), config)
  # A frozen copy: the train step donates (and so invalidates) the state's buffers.
  ref_params = jax.tree_util.tree_map(jnp.copy, policy.init_params)
  state = step_fn.init(policy.init_params, rng=jax.random.PRNGKey(run.seed))
  step_fn, state, place = _compile_step(run, step_fn, state)
  eval_problems = task.eval_problems(run.eval_size)
  metrics_path = os.path.join(run.out, "metrics.jsonl")
  ckpt = Checkpointer(os.path.join(run.out, "checkpoints"), max_to_keep=2)

  start, history, state = _resume(run, ckpt, metrics_path, state)
  if start == 0:
    history = [{"step": 0, **evaluate(policy, state.params, task, eval_problems)}]
    _append(metrics_path, history[-1])

  base_key = jax.random.PRNGKey(run.seed)
  t0, step = time.time(), start
  try:
    for step in range(start + 1, run.steps + 1):
      rng_np = np.random.default_rng([run.seed, step])
      key = jax.random.fold_in(base_key, step)
      t_step = time.time()
      batch, stats = build_batch(run, task, policy, state.params, ref_params, rng_np, key,
                                 config)
      state, m = step_fn(state, place(batch))
      row = {"step": step, **stats, **{k: float(val) for k, val in m.items()},
             "time_s": time.time() - t_step}
      if step % run.eval_every == 0 or step == run.steps:
        row.update(evaluate(policy, state.params, task, eval_problems))
      history.append(row)
      _append(metrics_path, row)
      if step % run.save_every == 0 or step == run.steps:
        ckpt.save(step, state, extra={"step": step})
      report_progress(run, step, row, t0, start)
      if on_step is not None:
        on_step(row)
  except KeyboardInterrupt:
    _save_on_interrupt(run, ckpt, state)
    raise
  ckpt.close()
  if run.progress and sys.stderr.isatty():
    sys.stderr.write("\n")
  return summarize(history, time.time() - t0, run)


train = run_training   # the earlier name (kept: ``from jaxrl_llm.trainer import train``)


def _resume(run: RunConfig, ckpt: Checkpointer, metrics_path: str, state):
  """``(start step, kept metrics rows, state)``: the latest checkpoint when resuming."""
  start, history = 0, []
  if run.resume and ckpt.latest_step() is not None:
    state, extra = ckpt.restore(state)
    start = int(extra["step"])
    history = _load_metrics(metrics_path, start)
  with open(metrics_path, "w") as f:
    for row in history:
      f.write(json.dumps(row) + "\n")
  return start, history, state


def _append(path: str, row: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")


def _save_on_interrupt(run: RunConfig, ckpt: Checkpointer, state) -> None:
  """Saves the last completed step. If the interrupt hit inside the donated step
  call, ``state`` is gone and the latest periodic checkpoint stands."""
  try:
    done = int(state.step)
    if done > 0 and done not in ckpt.all_steps():
      ckpt.save(done, state, extra={"step": done}, force=True)
    note = f"checkpoint saved at step {done}"
  except Exception:  # noqa: BLE001 - deleted buffers raise a runtime error
    note = f"kept the checkpoint of step {ckpt.latest_step()}"
  ckpt.close()
  if run.progress:
    sys.stderr.write(f"\ninterrupted: {note} in {run.out}\n")


def summarize(history: list[dict], wall_s: float, run: RunConfig) -> dict:
  evals = [r for r in history if "eval_accuracy" in r]
  steps = [r for r in history if "reward" in r]
  summary = {
      "algo": run.algo, "task": run.task, "steps": steps[-1]["step"] if steps else 0,
      "wall_s": round(wall_s, 1),
      "eval_accuracy_start": evals[0]["eval_accuracy"] if evals else math.nan,
      "eval_accuracy_end": evals[-1]["eval_accuracy"] if evals else math.nan,
      "eval_reward_start": evals[0]["eval_reward"] if evals else math.nan,
      "eval_reward_end": evals[-1]["eval_reward"] if evals else math.nan,
      "train_reward_last10": float(np.mean([r["reward"] for r in steps[-10:]]))
      if steps else math.nan,
  }
  return summary


def format_summary(summary: dict) -> str:
  width = max(len(k) for k in summary)
  lines = ["-" * (width + 16)]
  for k, val in summary.items():
    val = f"{val:.4f}" if isinstance(val, float) else str(val)
    lines.append(f"{k:<{width}}  {val}")
  lines.append("-" * (width + 16))
  return "\n".join(lines)


__all__ = ["run_training", "train", "RunConfig", "RunFolderError", "Policy", "evaluate",
           "build_batch", "sequence_advantages", "train_config_for", "make_optimizer",
           "summarize", "format_summary", "ALGOS", "GROUP_ALGOS", "MODELS", "algos",
           "RESUMABLE_FIELDS", "TrainConfig"]
