"""One rollout turned into a train batch: prompts -> G completions -> scores -> batch.

The advantage estimator is the recipe's (:mod:`jaxrl_llm.loop.recipes`): a critic-based
one (PPO's GAE) runs inside the train step, so the batch carries ``rewards`` and
``old_values``; the others run here, through the registry
(:func:`jaxrl_llm.train.compute_advantages`), and the batch carries ``advantages``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_llm.loop.accounting import PhaseClock
from jaxrl_llm.loop.evaluation import decode, stop_ids
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.resolve import Resolved, SamplingSettings
from jaxrl_llm.tasks.base import Task
from jaxrl_llm.train import AdvantageInputs, TrainConfig, compute_advantages


def _rollout(sampling: SamplingSettings, task: Task, policy: Policy, params: Any,
             rng_np: np.random.Generator, key: jax.Array, config: TrainConfig,
             num_prompts: int, share: Share | None = None,
             clock: PhaseClock | None = None) -> tuple[dict, list]:
  """Samples ``group_size`` completions of ``num_prompts`` prompts and scores them.

  Returns ``(rows, problems)``: ``rows`` a dict of per-row numpy arrays (groups are
  contiguous rows; ``problem`` indexes ``problems``). With a ``share`` (a multi-process
  run) every process draws the same prompts, generates and scores only the groups of
  its rows (their draws keyed as in one call over all prompts) and the rows are
  all-gathered, so every process returns the whole batch. ``clock`` (optional) gets
  the generation's seconds as ``generate_s``.
  """
  tok = task.tokenizer
  problems = task.sample_prompts(rng_np, num_prompts)
  first, last = (0, num_prompts) if share is None else share.prompts(sampling.group_size)
  mine = problems[first:last]
  prompts, prompt_mask = tok.encode_batch([p.prompt for p in mine], task.max_prompt_len)
  rep = lambda x: np.repeat(x, sampling.group_size, axis=0)
  start = time.perf_counter()
  if share is None:
    out = policy.generate(params, prompts, prompt_mask, key, n=sampling.group_size,
                          max_new_tokens=task.max_new_tokens, eos_id=stop_ids(tok),
                          temperature=config.temperature)
  else:        # draws keyed by the prompts' places in the whole step
    out = policy.generate(params, prompts, prompt_mask, key, n=sampling.group_size,
                          max_new_tokens=task.max_new_tokens, eos_id=stop_ids(tok),
                          temperature=config.temperature, first_request=first)
  if clock is not None:
    jax.block_until_ready(out)
    clock.add("generate_s", time.perf_counter() - start)
  group_problems = [p for p in mine for _ in range(sampling.group_size)]
  rows = completion_rows(task, out, group_problems, rep(np.arange(first, last)),
                         rollout_logp=config.rollout_correction is not None)
  if share is not None:
    rows = share.procs.gather(rows)
  return rows, problems


def completion_rows(task: Task, out: Any, group_problems: list, problem: np.ndarray, *,
                    rollout_logp: bool) -> dict:
  """The per-row arrays of the completions ``out`` (a
  :class:`~jaxrl_llm.rollout.SampleOutput`: one row per completion, its prompt first)
  of ``group_problems`` (one per row): ``tokens``, ``attention_mask``, ``loss_mask`` (0
  on prompt positions), the task's ``scores`` and ``exact``, ``lengths``, ``problem``,
  ``truncated`` (1 where the completion was cut at the budget, no eos), ``parsed``
  where the task says (:meth:`~jaxrl_llm.tasks.base.Task.parsed`) and, with
  ``rollout_logp``, ``rollout_logp`` (the sampler's log-probs of the
  distribution it drew from, aligned with ``tokens``)."""
  texts = decode(task.tokenizer, out.completion, out.completion_mask)
  completion_mask = np.asarray(out.completion_mask, np.float32)
  pad = np.zeros((len(texts), np.shape(out.tokens)[1] - completion_mask.shape[1]),
                 np.float32)
  rows = {"tokens": np.asarray(out.tokens, np.int32),
          "attention_mask": np.asarray(out.mask, np.float32),
          "loss_mask": np.concatenate([pad, completion_mask], axis=1),
          "scores": np.asarray(task.score(group_problems, texts), np.float32),
          "exact": np.asarray(task.exact(group_problems, texts), np.float32),
          "lengths": np.asarray(out.lengths, np.int32),
          "problem": problem,
          "truncated": 1.0 - np.asarray(out.finished, np.float32)}
  parsed = task.parsed(group_problems, texts)
  if parsed is not None:
    rows["parsed"] = np.asarray(parsed, np.float32)
  if rollout_logp:
    rows["rollout_logp"] = np.concatenate(
        [pad, np.asarray(out.sampling_logprobs, np.float32) * completion_mask], axis=1)
  return rows


@dataclasses.dataclass(frozen=True)
class Share:
  """This process's rows ``[lo, hi)`` of a step's global batch (a multi-process run:
  :class:`jaxrl_llm.loop.processes.Processes`); whole groups of ``group_size`` rows."""

  procs: Any
  lo: int
  hi: int

  def prompts(self, group_size: int) -> tuple[int, int]:
    """The prompts (groups) whose rows these are."""
    if self.lo % group_size or self.hi % group_size:
      raise ValueError(f"process rows {self.lo}-{self.hi} split a group of "
                       f"{group_size}: make --prompts-per-step a multiple of the "
                       "process count")
    return self.lo // group_size, self.hi // group_size


def _draw_stats(rows: dict) -> dict[str, float]:
  """The means of a draw's rows: reward, accuracy, response length, the fraction cut at
  the budget and, where the task says, the fraction without a parsable answer."""
  stats = {"reward": float(np.mean(rows["scores"])),
           "accuracy": float(np.mean(rows["exact"])),
           "response_length": float(np.mean(rows["lengths"])),
           "truncated_frac": float(np.mean(rows["truncated"]))}
  if "parsed" in rows:
    stats["unparsed_frac"] = 1.0 - float(np.mean(rows["parsed"]))
  return stats


def build_batch(resolved: Resolved, task: Task, policy: Policy, params: Any,
                ref_params: Any, rng_np: np.random.Generator, key: jax.Array, *,
                info: dict | None = None,
                drawn: tuple[dict, list] | None = None,
                share: Share | None = None,
                packer: Callable[[dict], tuple[dict, dict]] | None = None
                ) -> tuple[dict, dict]:
  """One rollout: ``(batch, stats)`` with ``stats`` reward, accuracy, response length,
  the fraction of completions cut at the budget (``truncated_frac``) and, where the
  task says, of those without a parsable answer (``unparsed_frac``).

  ``rng_np`` draws the prompts and ``key`` the samples, so a step is reproducible
  from ``(seed, step)``. ``ref_params`` is ``policy.ref_params(...)`` of the frozen
  reference weights (scored by ``policy.ref_forward``), or None where nothing reads
  the reference (``kl_mode="none"``): then the batch has no ``ref_logp``, no
  reference forward runs and ``ref_s`` is 0. ``resolved`` is the run
  (:func:`jaxrl_llm.loop.resolve.resolve`): its sampling settings, train config and
  advantage estimator.
  ``info``: a dict that receives the batch rows' ``scores`` (``[B]``, as the
  advantages see them: overlong penalty included) and ``task_scores`` / ``exact``
  (the task's own), for benchmarks.

  Run options read here: dynamic sampling (:func:`jaxrl_llm.rollout.dapo.dynamic_sampling`
  over the task scores, draw ``i > 0`` sampled with ``fold_in(key, i)``; with no group
  of varying score in ``max_sampling_draws`` draws the batch has an all-zero
  ``loss_mask``, so the step is an exact no-op), the soft overlong penalty (added to
  the scores the advantages use), the sampler's log-probs (``rollout_logp``, with
  ``rollout_correction``) and the correct-response marks (``positive``, with
  ``pos_nll_coef``). ``reward`` / ``accuracy`` / ``response_length`` in the stats
  are over the first draw (the policy's unfiltered samples).
  ``drawn``: the first draw's ``(rows, problems)`` when the caller generated them
  (partial rollouts: :class:`jaxrl_llm.loop.partial.PartialRollouts`); None: drawn
  here.
  The stats time the phases (:mod:`jaxrl_llm.loop.accounting`): ``generate_s`` (every
  generation here: the draws, greedy completions; absent when ``drawn`` is given and
  nothing is generated here), ``score_s`` (the rest until the forwards: decoding,
  scores, advantages, packing), ``old_logp_s`` and ``ref_s`` (the policy's and the
  reference's forward, each waited for).
  ``share``: this process's rows of the global batch in a multi-process run
  (:class:`Share`): it generates and scores only its groups, the per-row results are
  all-gathered, the statistics and advantages are those of the whole batch, and the
  returned batch holds its rows only (what it feeds to ``shard_batch``).
  ``packer``: ``batch -> (packed batch, stats)`` (e.g. :func:`pack_train_batch`), applied
  before the policy and reference forwards, so the behaviour and reference log-probs
  are computed on the packed rows too (``--pack``).
  """
  config, sampling, estimator = resolved.train, resolved.sampling, resolved.estimator
  tok = task.tokenizer
  group_size = sampling.group_size
  stats: dict[str, float] = {}
  clock = PhaseClock()
  start = time.perf_counter()
  generated_here = drawn is None
  if drawn is None:
    drawn = _rollout(sampling, task, policy, params, rng_np, key, config,
                     sampling.prompts_per_step, share, clock=clock)
  first, problems = drawn
  stats.update(_draw_stats(first))
  rows = first
  if sampling.dynamic_sampling:
    from jaxrl_llm.rollout.dapo import dynamic_sampling
    all_problems: list = []

    def draw(n: int) -> dict:
      if not all_problems:
        drawn, probs = first, problems
      else:
        drawn, probs = _rollout(sampling, task, policy, params, rng_np,
                                jax.random.fold_in(key, len(all_problems)), config, n,
                                clock=clock)
      drawn = {**drawn, "problem": drawn["problem"] + sum(map(len, all_problems))}
      all_problems.append(probs)
      return drawn

    kept, ds = dynamic_sampling(draw, num_groups=sampling.prompts_per_step,
                                group_size=group_size,
                                max_draws=sampling.max_sampling_draws)
    problems = [p for probs in all_problems for p in probs]
    if kept is None:     # no group with signal: an exact no-op update
      rows = {**first, "loss_mask": np.zeros_like(first["loss_mask"])}
    else:
      rows = kept
    stats.update(sampling_draws=float(ds.draws), groups_drawn=float(ds.groups_drawn),
                 groups_kept=float(ds.groups_kept),
                 groups_repeated=float(ds.groups_repeated))
  problems = [problems[i] for i in rows["problem"][::group_size]]
  scores = rows["scores"]
  buffer = sampling.overlong_buffer
  if buffer > 0:
    from jaxrl_llm.rollout.dapo import overlong_penalty
    penalty = np.asarray(overlong_penalty(rows["lengths"], max_length=task.max_new_tokens,
                                          buffer_length=buffer,
                                          penalty=sampling.overlong_penalty))
    scores = scores + penalty
    stats["overlong_penalty"] = float(np.mean(penalty))

  if info is not None:
    info.update(scores=np.asarray(scores, np.float32), task_scores=rows["scores"],
                exact=rows["exact"])
  loss_mask = rows["loss_mask"]
  mine = slice(0, len(scores)) if share is None else slice(share.lo, share.hi)
  batch = {k: rows[k][mine] for k in ("tokens", "attention_mask", "loss_mask")}
  if "rollout_logp" in rows:
    batch["rollout_logp"] = rows["rollout_logp"][mine]
  if config.pos_nll_coef is not None:
    batch["positive"] = rows["exact"][mine]
  # The score is the reward of the last generated token (EOS, or the last one).
  prompt_len = task.max_prompt_len        # prompts are encoded to this width
  last = prompt_len + np.maximum(rows["lengths"], 1) - 1
  rewards = np.zeros(loss_mask.shape, np.float32)
  rewards[np.arange(len(scores)), last] = scores
  if estimator.needs_values:
    batch["rewards"] = rewards[mine]
  else:
    greedy_scores = None
    if estimator.needs_greedy:
      lo, hi = (0, len(problems)) if share is None else share.prompts(group_size)
      prompts, prompt_mask = tok.encode_batch([p.prompt for p in problems[lo:hi]],
                                              task.max_prompt_len)
      with clock("generate_s"):
        g = policy.generate(params, prompts, prompt_mask, None,
                            max_new_tokens=task.max_new_tokens, eos_id=stop_ids(tok),
                            greedy=True)
        jax.block_until_ready(g)
      greedy = np.asarray(task.score(problems[lo:hi],
                                     decode(tok, g.completion, g.completion_mask)))
      if share is not None:
        greedy = share.procs.gather(greedy)
      greedy_scores = np.repeat(greedy, group_size, axis=0)
    adv, _ = compute_advantages(estimator.name, AdvantageInputs(
        rewards=rewards, mask=loss_mask, scores=np.asarray(scores, np.float32),
        greedy_scores=greedy_scores, group_size=group_size),
        config.hparam_values())
    batch["advantages"] = np.asarray(adv)[mine]
  if packer is not None:
    batch, pack_stats = packer(batch)
    stats.update(pack_stats)
  generate_s = clock.take().get("generate_s", 0.0)
  if generated_here or generate_s:
    stats["generate_s"] = generate_s
  stats["score_s"] = time.perf_counter() - start - generate_s
  old_logp = old_values = None
  if not config.old_logp_from_step:  # else the update's own forward gives them
    with clock("old_logp_s"):
      old_logp, _, old_values = jax.block_until_ready(policy.forward(params, batch))
  if ref_params is not None:       # (on the batch the policy's forward read: one trace)
    with clock("ref_s"):
      ref_logp, _, _ = jax.block_until_ready(policy.ref_forward(ref_params, batch))
    batch["ref_logp"] = np.asarray(ref_logp)
  if old_logp is not None:
    batch["old_logp"] = np.asarray(old_logp)
  stats.update(clock.take())
  for skipped in ("old_logp_s", "ref_s"):
    stats.setdefault(skipped, 0.0)
  if config.use_value:
    batch["old_values"] = np.asarray(old_values)
  return batch, stats


def pack_train_batch(batch: dict, config: TrainConfig, *, max_tokens: int | None = None,
                     devices: int = 1) -> tuple[dict, dict]:
  """Packs a padded train batch (:func:`build_batch`) into rows of ``max_tokens``.

  Returns ``(packed batch, stats)``; ``stats`` holds ``padding_frac`` (padding share of
  the padded batch), ``padding_frac_packed`` (of the packed one) and ``packed_rows``.
  The row count is the rows needed rounded up to ``m * 2^k`` (``m`` = minibatches x
  microbatches x ``devices``, so every split divides it), at most the padded row count
  rounded up to ``m``: a run compiles a few packed shapes, not one per step.

  Examples:
    >>> import numpy as np
    >>> ones = np.ones((4, 3), np.float32)
    >>> batch = dict(tokens=np.ones((4, 3), np.int32), attention_mask=ones,
    ...              loss_mask=ones, advantages=np.zeros(4, np.float32))
    >>> packed, stats = pack_train_batch(batch, TrainConfig(), max_tokens=6)
    >>> packed["tokens"].shape, stats["padding_frac_packed"]
    ((2, 6), 0.0)
  """
  from jaxrl_llm.packing import pack_batch, padding_fraction, plan_packing
  n, width = np.shape(batch["tokens"])
  budget = width if max_tokens is None else max_tokens
  split = config.num_microbatches if config.max_tokens_per_microbatch is None else 1
  multiple = config.num_minibatches * split * devices
  needed = plan_packing(batch["attention_mask"], budget).num_rows
  units = -(-needed // multiple)
  rows = multiple * min(1 << (units - 1).bit_length(), -(-n // multiple))
  packed, plan = pack_batch(batch, budget, row_multiple=multiple,
                            num_rows=max(rows, multiple * units))
  packed = {k: np.asarray(x) for k, x in packed.items()}
  return packed, {"padding_frac": padding_fraction(batch["attention_mask"]),
                  "padding_frac_packed": padding_fraction(plan.segment_ids),
                  "packed_rows": float(plan.num_rows)}


__all__ = ["Share", "build_batch", "pack_train_batch"]
