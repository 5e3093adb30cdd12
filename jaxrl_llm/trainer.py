"""The RL loop: sample G completions per prompt, score, estimate advantages, update.

``train(RunConfig(...))`` runs PPO (value head, GAE or hybrid n-step/GAE, KL in the
reward) or a critic-free estimator (GRPO, Dr.GRPO, RLOO, self-critical, REINFORCE++;
KL in the loss) on a built-in task with the reference transformer, evaluating greedy
accuracy on the task's held-out split and checkpointing with orbax. Everything random
in step ``s`` is derived from ``(seed, s)``, so a run resumed from a checkpoint
continues exactly as an uninterrupted one.

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
import optax
from flax import nnx

from jaxrl_llm import advantages as A
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.models.transformer import (Transformer, get_config, make_apply_fn,
                                          make_decode_fns, split_model)
from jaxrl_llm.rollout.sampler import sample
from jaxrl_llm.tasks import TASKS, get_task
from jaxrl_llm.train import TrainConfig, init_train_state, make_train_step, policy_forward

ALGOS = ("ppo", "grpo", "dr_grpo", "rloo", "self_critical", "reinforce_pp")
GROUP_ALGOS = ("grpo", "dr_grpo", "rloo")
MODELS = ("tiny", "small")
# Fields that may differ between a run and its resumption.
RESUMABLE_FIELDS = ("steps", "out", "resume", "overwrite", "eval_every", "save_every",
                    "progress", "mesh_data", "mesh_fsdp", "mesh_tensor")


class RunFolderError(ValueError):
  """The run folder holds another run (or one not meant to be resumed)."""


@dataclasses.dataclass
class RunConfig:
  """Everything that defines a run (written to ``config.json``)."""
  task: str = "reverse"
  algo: str = "grpo"
  model: str = "tiny"
  steps: int = 400
  prompts_per_step: int = 32
  group_size: int = 8
  lr: float = 1e-3
  seed: int = 0
  temperature: float = 1.0
  kl_coef: float = 0.001
  clip: float = 0.2
  clip_end: Optional[float] = None        # linear clip schedule clip -> clip_end
  adaptive_clip: bool = False
  num_epochs: int = 1
  num_minibatches: int = 1
  gamma: float = 1.0
  lam: float = 0.95
  hybrid_n: Optional[int] = None          # PPO: hybrid n-step/GAE advantages
  hybrid_mix: float = 0.5
  vf_coef: float = 0.5
  entropy_coef: float = 0.0
  eval_every: int = 25
  eval_size: int = 256
  save_every: int = 50
  mesh_data: int = 1                      # device mesh: 1 x 1 x 1 = one device;
  mesh_fsdp: int = 1                      # -1 on one axis takes the remaining devices
  mesh_tensor: int = 1
  out: str = "runs/default"
  resume: bool = False
  overwrite: bool = False
  progress: bool = True

  def validate(self):
    if self.task not in TASKS:
      raise ValueError(f"unknown task {self.task!r}; valid tasks: {', '.join(sorted(TASKS))}")
    if self.algo not in ALGOS:
      raise ValueError(f"unknown algo {self.algo!r}; valid algos: {', '.join(ALGOS)}")
    if self.model not in MODELS:
      raise ValueError(f"unknown model {self.model!r}; valid models: {', '.join(MODELS)}")
    if self.algo in GROUP_ALGOS and self.group_size < 2:
      raise ValueError(f"--algo {self.algo} is a group estimator and needs --group-size "
                       f">= 2 (got {self.group_size}): with one sample per prompt the "
                       f"group baseline is the sample itself.")
    for name in ("steps", "prompts_per_step", "group_size", "eval_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if self.resume and self.overwrite:
      raise ValueError("--resume and --overwrite are exclusive")

  def identity(self) -> dict:
    """The fields that must match for a run folder to be resumed."""
    return {k: val for k, val in dataclasses.asdict(self).items()
            if k not in RESUMABLE_FIELDS}


def train_config_for(run: RunConfig, max_new_tokens: int) -> TrainConfig:
  """The :class:`TrainConfig` of an algorithm."""
  common = dict(num_epochs=run.num_epochs, num_minibatches=run.num_minibatches,
                clip_low=run.clip, kl_coef=run.kl_coef, entropy_coef=run.entropy_coef,
                temperature=run.temperature, adaptive_clip=run.adaptive_clip,
                clip_schedule=(None if run.clip_end is None else optax.linear_schedule(
                    run.clip, run.clip_end, run.steps)))
  if run.algo == "ppo":
    est = "gae" if run.hybrid_n is None else "hybrid"
    return TrainConfig(use_value=True, whiten_advantages=True, kl_mode="reward",
                       reward_kl_kind="k1", gamma=run.gamma, lam=run.lam,
                       advantage_estimator=est, hybrid_n=run.hybrid_n or 4,
                       hybrid_mix=run.hybrid_mix, vf_coef=run.vf_coef, **common)
  agg = "token-mean"
  norm = None
  if run.algo == "dr_grpo":
    agg, norm = "seq-mean-token-sum-norm", max_new_tokens
  return TrainConfig(use_value=False, whiten_advantages=False, kl_mode="loss",
                     kl_kind="k3", loss_agg_mode=agg, norm_length=norm, vf_clip=None,
                     **common)


# ---------------------------------------------------------------------------- pieces


class Policy:
  """The reference transformer as pure, jitted functions of a params pytree."""

  def __init__(self, run: RunConfig, vocab_size: int, max_len: int, pad_id: int):
    cfg = get_config(run.model, vocab_size, value_head=run.algo == "ppo",
                     max_seq_len=max(max_len, 8))
    self.graphdef, self.init_params = split_model(
        Transformer(cfg, rngs=nnx.Rngs(run.seed)))
    self.apply = make_apply_fn(self.graphdef)
    self.decode_fns = make_decode_fns(self.graphdef)
    self.pad_id = pad_id
    self.forward = jax.jit(lambda params, batch: policy_forward(
        self.apply, params, batch, temperature=run.temperature))
    self._sample = jax.jit(sample, static_argnums=0,
                           static_argnames=("max_new_tokens", "greedy", "top_k"))

  def generate(self, params, tokens, mask, rng, *, max_new_tokens, eos_id,
               temperature=1.0, greedy=False):
    return self._sample(self.decode_fns, params, jnp.asarray(tokens), jnp.asarray(mask),
                        rng, max_new_tokens=max_new_tokens, temperature=temperature,
                        greedy=greedy, eos_id=eos_id, pad_id=self.pad_id)


def _decode(tokenizer, completion, completion_mask):
  return tokenizer.decode_batch(np.asarray(completion), np.asarray(completion_mask))


def evaluate(policy: Policy, params, task, problems) -> dict:
  """Greedy accuracy (exact match) and mean reward on ``problems``."""
  tok = task.tokenizer
  tokens, mask = tok.encode_batch([p.prompt for p in problems], task.max_prompt_len)
  out = policy.generate(params, tokens, mask, None, max_new_tokens=task.max_new_tokens,
                        eos_id=tok.eos_id, greedy=True)
  texts = _decode(tok, out.completion, out.completion_mask)
  return {"eval_accuracy": float(np.mean(task.exact(problems, texts))),
          "eval_reward": float(np.mean(task.score(problems, texts)))}


def sequence_advantages(run: RunConfig, scores, greedy_scores=None):
  """Per-sequence advantages of the critic-free estimators (``[B]`` float32)."""
  s = jnp.asarray(scores, jnp.float32)
  if run.algo == "grpo":
    return A.grpo_advantages(s, group_size=run.group_size)
  if run.algo == "dr_grpo":
    return A.dr_grpo_advantages(s, group_size=run.group_size)
  if run.algo == "rloo":
    return A.rloo_advantages(s, group_size=run.group_size)
  if run.algo == "self_critical":
    return A.self_critical_advantages(s, jnp.asarray(greedy_scores, jnp.float32))
  raise ValueError(run.algo)


def build_batch(run, task, policy, params, ref_params, rng_np, key):
  """One rollout: prompts -> G completions each -> scores -> a train batch."""
  tok = task.tokenizer
  problems = task.sample_prompts(rng_np, run.prompts_per_step)
  prompts, prompt_mask = tok.encode_batch([p.prompt for p in problems],
                                          task.max_prompt_len)
  rep = lambda x: np.repeat(x, run.group_size, axis=0)
  out = policy.generate(params, rep(prompts), rep(prompt_mask), key,
                        max_new_tokens=task.max_new_tokens, eos_id=tok.eos_id,
                        temperature=run.temperature)
  texts = _decode(tok, out.completion, out.completion_mask)
  group_problems = [p for p in problems for _ in range(run.group_size)]
  scores = task.score(group_problems, texts)
  exact = task.exact(group_problems, texts)

  prompt_len = prompts.shape[1]
  completion_mask = np.asarray(out.completion_mask, np.float32)
  loss_mask = np.concatenate([np.zeros((len(texts), prompt_len), np.float32),
                              completion_mask], axis=1)
  batch = {"tokens": np.asarray(out.tokens, np.int32),
           "attention_mask": np.asarray(out.mask, np.float32), "loss_mask": loss_mask}
  old_logp, _, old_values = policy.forward(params, batch)
  ref_logp, _, _ = policy.forward(ref_params, batch)
  batch.update(old_logp=np.asarray(old_logp), ref_logp=np.asarray(ref_logp))
  # The score is the reward of the last generated token (EOS, or the last one).
  last = prompt_len + np.maximum(np.asarray(out.lengths), 1) - 1
  rewards = np.zeros(loss_mask.shape, np.float32)
  rewards[np.arange(len(texts)), last] = scores
  if run.algo == "ppo":
    batch.update(rewards=rewards, old_values=np.asarray(old_values))
  elif run.algo == "reinforce_pp":
    batch["advantages"] = np.asarray(A.reinforce_pp_advantages(rewards, loss_mask,
                                                               gamma=run.gamma))
  else:
    greedy_scores = None
    if run.algo == "self_critical":
      g = policy.generate(params, prompts, prompt_mask, None,
                          max_new_tokens=task.max_new_tokens, eos_id=tok.eos_id,
                          greedy=True)
      greedy_scores = rep(task.score(problems, _decode(tok, g.completion,
                                                       g.completion_mask)))
    batch["advantages"] = np.asarray(sequence_advantages(run, scores, greedy_scores))
  stats = {"reward": float(np.mean(scores)), "accuracy": float(np.mean(exact)),
           "response_length": float(np.mean(np.asarray(out.lengths)))}
  return batch, stats


# ----------------------------------------------------------------------------- loop


def _compile_step(run: RunConfig, step_fn, state):
  """``(jitted step, placed state, batch placer)``: one device, or a mesh via
  :func:`jaxrl_llm.parallel.shard_train_step` when ``mesh_*`` asks for one."""
  if (run.mesh_data, run.mesh_fsdp, run.mesh_tensor) == (1, 1, 1):
    return jax.jit(step_fn, donate_argnums=0), state, lambda batch: batch
  from jaxrl_llm.parallel import make_mesh, shard_batch, shard_train_step
  mesh = make_mesh(data=run.mesh_data, fsdp=run.mesh_fsdp, tensor=run.mesh_tensor)
  jitted, state = shard_train_step(step_fn, state, mesh)
  return jitted, state, lambda batch: shard_batch(batch, mesh)


def _prepare_run_folder(run: RunConfig) -> Optional[int]:
  """Creates/validates the run folder; returns the step to resume from (or None)."""
  cfg_path = os.path.join(run.out, "config.json")
  if os.path.exists(cfg_path) and not run.overwrite:
    with open(cfg_path) as f:
      saved = json.load(f)
    saved_identity = {k: val for k, val in saved.items() if k not in RESUMABLE_FIELDS}
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
  return None


def _load_metrics(path, upto):
  rows = []
  if os.path.exists(path):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r["step"] <= upto]


def _progress(run, step, row, start_time, start_step):
  if not run.progress:
    return
  done = step - start_step
  rate = done / max(time.time() - start_time, 1e-9)
  width = 24
  filled = int(width * step / run.steps)
  bar = "#" * filled + "-" * (width - filled)
  eta = (run.steps - step) / max(rate, 1e-9)
  msg = (f"\r[{bar}] {step}/{run.steps} reward {row['reward']:.3f} "
         f"acc {row['accuracy']:.3f} kl {row.get('kl_ref', 0.0):+.4f} "
         f"{rate:.2f} it/s eta {eta:4.0f}s")
  stream = sys.stderr
  if stream.isatty():
    stream.write(msg)
    stream.flush()
  elif step == run.steps or step % max(run.eval_every, 1) == 0:
    stream.write(msg.lstrip("\r") + "\n")


def train(run: RunConfig, *, on_step: Optional[Callable[[dict], None]] = None) -> dict:
  """Runs (or resumes) a training run; returns a summary dict.

  ``on_step(row)`` is called after every step (tests use it to interrupt a run).
  A ``KeyboardInterrupt`` saves a checkpoint of the last completed step and re-raises.
  """
  run.validate()
  _prepare_run_folder(run)
  task = get_task(run.task)
  tok = task.tokenizer
  policy = Policy(run, tok.vocab_size, task.max_prompt_len + task.max_new_tokens,
                  tok.pad_id)
  config = train_config_for(run, task.max_new_tokens)
  optimizer = optax.adam(run.lr)
  # A frozen copy: the train step donates (and so invalidates) the state's buffers.
  ref_params = jax.tree_util.tree_map(jnp.copy, policy.init_params)
  state = init_train_state(policy.init_params, optimizer, config,
                           rng=jax.random.PRNGKey(run.seed))
  step_fn, state, place = _compile_step(
      run, make_train_step(policy.apply, optimizer, config), state)
  eval_problems = task.eval_problems(run.eval_size)
  metrics_path = os.path.join(run.out, "metrics.jsonl")
  ckpt = Checkpointer(os.path.join(run.out, "checkpoints"), max_to_keep=2)

  start = 0
  history: list[dict] = []
  if run.resume and ckpt.latest_step() is not None:
    state, extra = ckpt.restore(state)
    start = int(extra["step"])
    history = _load_metrics(metrics_path, start)
  with open(metrics_path, "w") as f:
    for row in history:
      f.write(json.dumps(row) + "\n")
  if start == 0:
    history.append({"step": 0, **evaluate(policy, state.params, task, eval_problems)})
    with open(metrics_path, "a") as f:
      f.write(json.dumps(history[-1]) + "\n")

  base_key = jax.random.PRNGKey(run.seed)
  t0, step = time.time(), start
  try:
    for step in range(start + 1, run.steps + 1):
      rng_np = np.random.default_rng([run.seed, step])
      key = jax.random.fold_in(base_key, step)
      t_step = time.time()
      batch, stats = build_batch(run, task, policy, state.params, ref_params, rng_np, key)
      state, m = step_fn(state, place(batch))
      row = {"step": step, **stats, **{k: float(val) for k, val in m.items()},
             "time_s": time.time() - t_step}
      if step % run.eval_every == 0 or step == run.steps:
        row.update(evaluate(policy, state.params, task, eval_problems))
      history.append(row)
      with open(metrics_path, "a") as f:
        f.write(json.dumps(row) + "\n")
      if step % run.save_every == 0 or step == run.steps:
        ckpt.save(step, state, extra={"step": step})
      _progress(run, step, row, t0, start)
      if on_step is not None:
        on_step(row)
  except KeyboardInterrupt:
    # Save the last completed step. If the interrupt hit inside the donated step
    # call, ``state`` is gone and the latest periodic checkpoint stands.
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
    raise
  ckpt.close()
  if run.progress and sys.stderr.isatty():
    sys.stderr.write("\n")
  return summarize(history, time.time() - t0, run)


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
