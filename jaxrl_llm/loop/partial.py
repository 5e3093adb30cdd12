r"""Partial rollouts in the RL loop (``--partial-rollouts``, Kimi k1.5 / slime style).

A synchronous step waits for the longest response of its batch: while the last few
samples decode, most engine slots idle, and so does the trainer. With partial rollouts
a step stops generating as soon as it has a batch of finished groups; the samples
still decoding stay in flight in the engine (their slots, pages and draws' keys) and
continue in the next step, under the new weights.

One step of :class:`PartialRollouts`:

1. **Top up.** Before every engine call, new groups (``group_size`` samples of a new
   prompt, drawn with the step's ``rng_np``) are submitted until at least ``slots``
   samples wait for a slot: the call can refill every slot that frees, so no slot
   idles for lack of work (slime's over-sampling). Waiting samples have drawn nothing
   yet, so they add no staleness; a step whose batch is already complete (groups
   finished in earlier steps) submits nothing.
2. **Generate** through the run's own :class:`~jaxrl_llm.rollout.RolloutEngine`
   (separate from the one evaluation uses; as many slots, ``--rollout-slots``) in
   calls of ``token_budget`` tokens (:meth:`RolloutEngine.generate`'s ``token_budget``;
   default: one device call at full slots, ``slots * steps_per_call``), with
   ``version`` = the number of train steps applied so far, until ``prompts_per_step``
   groups are **complete**.
   A group trains only when all its ``group_size`` samples finished: the group
   baselines (GRPO, RLOO, ...) need the whole group, and a group's samples are never
   split over steps.
3. **Batch** the oldest ``prompts_per_step`` complete groups (submission order):
   the same rows as a synchronous rollout (:func:`jaxrl_llm.loop.batch.build_batch`
   scores them), with the sampler's per-token log-probs as ``rollout_logp``. The other
   complete groups wait for the next step.

Off-policy correction. A token sampled at version ``v`` and trained at step ``s`` (whose
parameters are version ``s - 1``) lags ``s - 1 - v`` versions. Its behaviour log-prob is
the engine's, recorded per token under the version that sampled it (by default,
``--partial-kv recompute``, the engine recomputes the in-flight cache under new weights,
so that log-prob is the version's own; ``--partial-kv keep`` keeps the stale cache,
cheaper, and the log-prob is that of the mixed-version distribution the token was drawn
from: see :mod:`jaxrl_llm.rollout.engine`, "Partial rollouts");
:func:`jaxrl_llm.loop.resolve.resolve` turns the rollout correction on
(``rollout_correction="token"``, truncated IS) unless the run sets it, so the loss is
the decoupled PPO objective of AReaL: the proximal policy is the current one
(``old_logp``), the behaviour policy the sampler's (``rollout_logp``). Metrics per step:
``staleness_mean`` / ``staleness_max`` (version lag of the trained tokens),
``in_flight`` (samples left in the engine), ``groups_waiting`` (complete groups left for
later steps), ``behaviour_kl`` (the masked mean of ``rollout_logp - old_logp`` over
trained tokens, a k1 estimate of the train/behaviour mismatch), ``generate_s``,
``engine_calls``.

Resume. The in-flight samples and waiting groups are not checkpointed: a resumed run
starts with none and submits new prompts; the partial completions in flight when the
run stopped are lost and regenerated as new samples (a group trained before the
checkpoint is never trained again, since groups leave this buffer when trained).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from jaxrl_llm.loop.batch import completion_rows
from jaxrl_llm.loop.evaluation import stop_ids
from jaxrl_llm.loop.policy import Policy, completions_to_sample_output
from jaxrl_llm.loop.resolve import SamplingSettings
from jaxrl_llm.rollout import Completion, Request, RolloutEngine
from jaxrl_llm.tasks.base import Task
from jaxrl_llm.train import TrainConfig


class PartialRollouts:
  """The loop's buffer of groups in flight across steps (module docstring).

  Args:
    policy: the run's policy; its backend must be a
      :class:`~jaxrl_llm.rollout.RolloutEngine` (partial rollouts keep samples in
      flight in the engine's slots), whose slots and sizes are reused.
    task: the task (prompts, tokenizer, scoring).
    sampling: the run's sampling settings (prompts per step, group size).
    config: the train config (temperature; ``rollout_correction`` adds
      ``rollout_logp`` rows).
    token_budget: tokens per engine call (None: ``slots * steps_per_call``).
    kv: the engine's ``on_new_version`` (``"recompute"`` or ``"keep"``).
  """

  def __init__(self, policy: Policy, task: Task, sampling: SamplingSettings,
               config: TrainConfig, token_budget: int | None = None,
               kv: str = "recompute") -> None:
    base = policy.backend
    if not isinstance(base, RolloutEngine):
      raise ValueError("--partial-rollouts needs the rollout engine (--rollout engine), "
                       f"got the backend {type(base).__name__}.")
    # Samples always wait here, so a device call would return at every finished slot:
    # it returns once an eighth of the slots finished (engine's ``refill_after``).
    self.engine = base.replica(on_new_version=kv, refill_after=max(1, base.max_slots // 8))
    self.task, self.sampling, self.config, self.policy = task, sampling, config, policy
    self.token_budget = token_budget or base.max_slots * base.steps_per_call
    self.problems: dict[int, Any] = {}                  # group id -> problem
    self.finished: dict[int, list[Completion]] = {}     # group id -> its samples
    self.next_group = 0
    self.eos_ids = tuple(np.atleast_1d(stop_ids(task.tokenizer)).tolist())

  @property
  def outstanding(self) -> int:
    """Groups submitted and not yet trained on."""
    return len(self.problems)

  def _top_up(self, rng_np: np.random.Generator) -> list[Request]:
    """New groups (``group_size`` samples of a new prompt each) until at least
    ``max_slots`` samples wait for a slot, so the coming call can refill every slot
    that frees; ``[]`` when enough wait."""
    task, tok, g = self.task, self.task.tokenizer, self.sampling.group_size
    new = -(-(self.engine.max_slots - self.engine.waiting) // g)
    if new <= 0:
      return []
    problems = task.sample_prompts(rng_np, new)
    prompts, mask = tok.encode_batch([q.prompt for q in problems], task.max_prompt_len)
    requests = []
    for q, row, keep in zip(problems, np.asarray(prompts), np.asarray(mask)):
      gid = self.next_group
      self.next_group += 1
      self.problems[gid] = q
      self.finished[gid] = []
      requests.append(Request(row[keep > 0].tolist(), n=g, max_new_tokens=task.max_new_tokens,
                              temperature=float(self.config.temperature), eos_ids=self.eos_ids,
                              tag=gid))
    return requests

  def rollout(self, params: Any, version: int, rng_np: np.random.Generator,
              key: jax.Array) -> tuple[dict, list, dict]:
    """``(rows, problems, stats)`` of one step: ``rows`` as
    :func:`jaxrl_llm.loop.batch._rollout` returns them (groups contiguous), plus
    ``versions`` ``[B, T]`` (the sampling version per token, -1 outside completions).
    """
    task, tok = self.task, self.task.tokenizer
    p, g = self.sampling.prompts_per_step, self.sampling.group_size
    seed = self.engine.seed_from_key(key)
    start, calls, recompute_s, recomputed, sent = time.perf_counter(), 0, 0.0, 0, 0

    def complete() -> list[int]:
      return [gid for gid, done in self.finished.items() if len(done) == g]

    while len(complete()) < p:
      requests = self._top_up(rng_np)
      # The step's requests draw as one list: request i of this call as ``sent + i``.
      for c in self.engine.generate(params, requests, seed, token_budget=self.token_budget,
                                    version=version, first_request=sent):
        self.finished[c.tag].append(c)
      calls, sent = calls + 1, sent + len(requests)
      recompute_s += self.engine.stats.get("recompute_s", 0.0)
      recomputed += self.engine.stats.get("recomputed_tokens", 0)
    generate_s = time.perf_counter() - start
    take = sorted(complete())[:p]
    completions = [c for gid in take
                   for c in sorted(self.finished.pop(gid), key=lambda c: c.sample)]
    problems = [self.problems.pop(gid) for gid in take]
    prompts, prompt_mask = tok.encode_batch([q.prompt for q in problems],
                                            task.max_prompt_len)
    out = completions_to_sample_output(
        completions, np.repeat(prompts, g, axis=0), np.repeat(prompt_mask, g, axis=0),
        max_new_tokens=task.max_new_tokens, pad_id=self.policy.pad_id)
    group_problems = [q for q in problems for _ in range(g)]
    rows = completion_rows(task, out, group_problems, np.repeat(np.arange(p), g),
                           rollout_logp=self.config.rollout_correction is not None)
    completion_mask = np.asarray(out.completion_mask, np.float32)
    versions = np.full(completion_mask.shape, -1, np.int32)
    for r, c in enumerate(completions):
      if c.versions is not None:
        versions[r, :len(c.tokens)] = c.versions
    rows["versions"] = np.concatenate(          # -1 on prompt positions
        [np.full((len(completions), prompts.shape[1]), -1, np.int32), versions], axis=1)
    lag = (version - versions)[completion_mask > 0]
    stats = {"staleness_mean": float(lag.mean()) if lag.size else 0.0,
             "staleness_max": float(lag.max()) if lag.size else 0.0,
             "in_flight": float(self.engine.in_flight),
             "groups_waiting": float(len(complete())), "submitted_groups": float(sent),
             "engine_calls": float(calls), "generate_s": generate_s,
             "recompute_s": recompute_s, "recomputed_tokens": float(recomputed)}
    return rows, problems, stats


def behaviour_kl(batch: dict) -> float:
  """The masked mean of ``rollout_logp - old_logp`` over the trained tokens: a k1
  estimate of KL(behaviour || current), the train/behaviour mismatch (0 without
  ``rollout_logp``).

  Examples:
    >>> import numpy as np
    >>> round(behaviour_kl({"rollout_logp": np.array([[-1.0, -2.0]]),
    ...                     "old_logp": np.array([[-1.5, -2.0]]),
    ...                     "loss_mask": np.array([[1.0, 1.0]])}), 4)
    0.25
  """
  if "rollout_logp" not in batch:
    return 0.0
  mask = np.asarray(batch["loss_mask"], np.float64)
  diff = np.asarray(batch["rollout_logp"], np.float64) - np.asarray(batch["old_logp"])
  return float((diff * mask).sum() / max(mask.sum(), 1.0))


__all__ = ["PartialRollouts", "behaviour_kl"]
