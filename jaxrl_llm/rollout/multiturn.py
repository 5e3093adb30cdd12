"""Multi-turn episodes, token in and token out.

An episode is ONE token sequence built incrementally:

.. code-block:: text

  prompt ids | turn 1 (sampled) | env reply 1 | turn 2 (sampled) | env reply 2 | ... | turn K

* the prompt: the environment's opening messages rendered once by the chat format
  (:meth:`~jaxrl_llm.envs.chat.ChatFormat.prompt_ids`, ending with the assistant
  header);
* each turn: the ids the backend sampled, exactly as sampled (never decoded and
  re-encoded; the environment reads their text, decoded once);
* each reply: the environment's messages rendered once to ids as a continuation of the
  template (:meth:`~jaxrl_llm.envs.chat.ChatFormat.continuation_ids`: the close of the
  turn where the model did not write it, the reply's turns, the next assistant header;
  the method and its prefix check are in :mod:`jaxrl_llm.envs.chat`).

So the trained ids are, bit for bit, the sampled ids interleaved with the environment
turns' ids, and the behaviour log-prob of every sampled token is the one the backend
computed for it, under the context the trainer re-reads.

Per episode: ``tokens``, ``loss_mask`` (1 on sampled tokens only, 0 on the prompt and
the environment's tokens), ``behaviour_logprobs`` (the sampler's, 0 off the mask),
the turn rewards and their sum (the episode's reward, :func:`jaxrl_llm.envs.
episode_reward`), the turns and the finish reason:

=============  ====================================================================
reason         when
=============  ====================================================================
``done``       the environment ended the episode
``max_turns``  the model took ``max_turns`` turns and the environment did not end it
``length``     the next turn would not fit ``max_len`` tokens: a turn cut at the budget,
               or a reply whose ids (with one token for the next turn) do not fit (it
               is not appended)
=============  ====================================================================

Each round, every unfinished episode's sequence goes to ``generate`` in one call (the
backend batches them), then the environments step (in a thread pool with
``max_workers > 1``: a slow tool delays its round, not the others' environments).
``generate`` is any backend as a plain callable ``generate(prompts, max_new_tokens) ->
[(sampled_ids, sampled_logprobs), ...]`` (one pair per prompt, in order; each
``prompts[i]`` a list of ids, ``max_new_tokens[i]`` its most new tokens, stopping at
the chat format's ``stop_ids``): :func:`engine_generate` wraps
:class:`~jaxrl_llm.rollout.engine.RolloutEngine`; a unit test passes a fake.

**KV continuation.** Every round hands ``generate`` each episode's whole sequence; with
the engine's prefix cache (``RolloutEngine(..., prefix_cache=True)``, or
``engine_generate(..., prefix_cache=True)``) the keys/values of the episode's previous
turn stay in the engine's pages, found again by their exact token ids, so turn k+1
prefills only what follows them: the environment's reply, the last sampled token
(never fed to the model) and the part of the sequence in its last, partly filled page
(less than a page). Each pair ``generate`` returns may say how many leading prompt
tokens the backend read from its cache (a :class:`SampledTurn`'s ``cached_tokens``;
0 for a plain pair); the episode counts them (``Episode.reused_tokens``) against the
prompt tokens prefilled (``Episode.prefill_tokens``).

:func:`episodes_to_batch` turns episodes into train rows: right-padded ``tokens``,
``attention_mask``, ``loss_mask``, ``rollout_logp`` and per-token ``advantages``
:math:`A_i \\cdot m_{i,t}` with :math:`A_i` the group-relative advantage of episode i's
reward among the episodes of its prompt (:func:`jaxrl_llm.advantages.group_advantages`:
GRPO over episodes).

Examples:
  >>> from jaxrl_llm.envs import CHAT_CHARS, PlainChat, StepResult
  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> chat = PlainChat(CharTokenizer(CHAT_CHARS))
  >>> class Count:                      # three turns, rewards 0.5 each
  ...   def reset(self, seed): return [{"role": "user", "content": "go"}]
  ...   def step(self, text):
  ...     self.n = getattr(self, "n", 0) + 1
  ...     return StepResult([{"role": "user", "content": "more"}], 0.5, self.n == 3)
  >>> def generate(prompts, limits):    # a fake backend: "ok" then the stop id
  ...   ids = chat.tokenizer.encode("ok") + [chat.tokenizer.eos_id]
  ...   return [(ids, [-0.5] * len(ids)) for _ in prompts]
  >>> [ep] = run_episodes(generate, chat, [Count()], max_turns=4, max_new_tokens=8,
  ...                     max_len=64)
  >>> ep.turns, ep.reward, ep.finish_reason, int(ep.loss_mask.sum())
  (3, 1.5, 'done', 9)
  >>> "".join(chat.tokenizer.id_to_token(i) for i in ep.tokens)
  'u:go<eos>a:ok<eos>u:more<eos>a:ok<eos>u:more<eos>a:ok<eos>'
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm._validate import check_int
from jaxrl_llm.advantages import group_advantages
from jaxrl_llm.envs.base import (
    Env,
    Message,
    StepResult,
    check_max_turns,
    check_messages,
    check_step,
    env_name,
    episode_reward,
)
from jaxrl_llm.envs.chat import ChatFormat, chat_format
from jaxrl_llm.rollout.scheduler import Request

Generate = Callable[[list[list[int]], list[int]],
                    Sequence[tuple[Sequence[int], Sequence[float]]]]
"""``generate(prompts, max_new_tokens) -> [(sampled_ids, sampled_logprobs), ...]``."""

FINISH_REASONS = ("done", "max_turns", "length")


@dataclasses.dataclass
class Episode:
  """One multi-turn episode (the module docstring).

  Attributes:
    tokens: ``[L]`` int32, the whole sequence (prompt, turns, replies).
    loss_mask: ``[L]`` int32, 1 on the sampled tokens.
    behaviour_logprobs: ``[L]`` float32, the backend's log-prob of each sampled token,
      0 elsewhere.
    prompt_len: the opening's length (``tokens[:prompt_len]``).
    turn_spans: ``[(start, end), ...]``: turn k's sampled ids are
      ``tokens[start:end]``; what lies between two spans is an environment reply.
    turn_rewards: the reward of each turn.
    finish_reason: ``"done"``, ``"max_turns"`` or ``"length"``.
    messages: the conversation as text (the opening, each turn decoded, each reply;
      for reading and logging: training reads ``tokens``).
    infos: each step's ``info``.
    env: the environment's name.
    seed: its reset seed.
    prefill_tokens: the prompt tokens the backend prefilled over the episode's turns
      (the whole sequence each turn, less what it reused).
    reused_tokens: the prompt tokens it read from its prefix cache instead (KV
      continuation: ``prefill_tokens + reused_tokens`` is the sum of the sequence's
      lengths when each turn was asked).
  """

  tokens: np.ndarray
  loss_mask: np.ndarray
  behaviour_logprobs: np.ndarray
  prompt_len: int
  turn_spans: list[tuple[int, int]]
  turn_rewards: list[float]
  finish_reason: str
  messages: list[Message]
  infos: list[Mapping[str, Any]]
  env: str
  seed: int
  prefill_tokens: int = 0
  reused_tokens: int = 0

  @property
  def reward(self) -> float:
    """The episode's reward: the sum of its turn rewards."""
    return episode_reward(self.turn_rewards)

  @property
  def turns(self) -> int:
    """The model turns taken."""
    return len(self.turn_spans)


@dataclasses.dataclass
class _Live:
  """An episode being built."""

  env: Env
  name: str
  seed: int
  tools: list[dict]
  tokens: list[int]
  mask: list[int]
  logp: list[float]
  prompt_len: int
  messages: list[Message]
  spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  infos: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
  finish: str | None = None
  prefilled: int = 0
  reused: int = 0

  def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
    self.tokens += [int(i) for i in ids]
    self.mask += [0 if logprobs is None else 1] * len(ids)
    self.logp += [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]

  def episode(self) -> Episode:
    assert self.finish in FINISH_REASONS
    return Episode(np.asarray(self.tokens, np.int32), np.asarray(self.mask, np.int32),
                   np.asarray(self.logp, np.float32), self.prompt_len, self.spans,
                   self.rewards, self.finish, self.messages, self.infos, self.name,
                   self.seed, self.prefilled, self.reused)


def _check_turn(out: Any, i: int, limit: int) -> tuple[list[int], list[float]]:
  """Episode ``i``'s ``(ids, logprobs)`` from ``generate``, checked."""
  try:
    ids, logprobs = out
  except (TypeError, ValueError):
    raise ValueError(f"`generate` returned {type(out).__name__} for prompt {i}; it must "
                     "return (sampled_ids, sampled_logprobs) pairs.") from None
  ids = np.asarray(ids).reshape(-1)
  logprobs = np.asarray(logprobs, np.float32).reshape(-1)
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"`generate` returned ids of dtype {ids.dtype} for prompt {i}.")
  if not 1 <= ids.size <= limit or logprobs.size != ids.size:
    raise ValueError(f"`generate` returned {ids.size} ids and {logprobs.size} log-probs "
                     f"for prompt {i}; it must return as many of each, 1 to "
                     f"max_new_tokens={limit}.")
  return ids.tolist(), logprobs.tolist()


def _cached_tokens(out: Any, i: int, prompt_len: int) -> int:
  """The leading prompt tokens the backend reused for prompt ``i`` (a
  :class:`SampledTurn`'s ``cached_tokens``; 0 for a plain pair), checked."""
  cached = getattr(out, "cached_tokens", 0)
  if (not isinstance(cached, (int, np.integer)) or isinstance(cached, bool)
      or not 0 <= cached < prompt_len):
    raise ValueError(f"`generate` said it reused {cached!r} cached tokens of prompt {i}; "
                     f"it must be an int in [0, {prompt_len}).")
  return int(cached)


def _start(env: Env, seed: int, chat: ChatFormat, max_len: int) -> _Live:
  name = env_name(env)
  opening = check_messages(env.reset(int(seed)), env=name, field="reset()")
  tools = [t.schema for t in getattr(env, "tools", ()) or ()]
  ids = chat.prompt_ids(opening, tools or None)
  if len(ids) >= max_len:
    raise ValueError(f"environment {name!r}: the opening of seed {seed} is {len(ids)} "
                     f"tokens, which leaves no room below `max_len`={max_len}.")
  live = _Live(env, name, int(seed), tools, [], [], [], len(ids), opening)
  live.append(ids, None)
  return live


def _advance(live: _Live, turn: tuple[list[int], list[float]], chat: ChatFormat, *,
             max_turns: int, max_len: int) -> None:
  """Appends a sampled turn, steps the environment and appends its reply (or ends)."""
  ids, logprobs = turn
  start = len(live.tokens)
  live.append(ids, logprobs)
  live.spans.append((start, len(live.tokens)))
  text = chat.decode(ids)
  result: StepResult = check_step(live.env.step(text), env=live.name)
  live.rewards.append(result.reward)
  live.infos.append(result.info)
  live.messages += [{"role": "assistant", "content": text}, *result.messages]
  if result.done:
    live.finish = "done"
  elif len(live.tokens) >= max_len:
    live.finish = "length"
  elif len(live.spans) >= max_turns:
    live.finish = "max_turns"
  else:
    reply = chat.continuation_ids(result.messages, ids, live.tools or None)
    if len(live.tokens) + len(reply) >= max_len:
      live.finish = "length"
    else:
      live.append(reply, None)


def run_episodes(generate: Generate, chat: Any, envs: Sequence[Env],
                 seeds: Sequence[int] | None = None, *, max_turns: int,
                 max_new_tokens: int, max_len: int,
                 max_workers: int = 1) -> list[Episode]:
  """Runs one episode per environment, token in and token out (the module docstring).

  Args:
    generate: the backend, ``generate(prompts, max_new_tokens) -> [(ids, logprobs)]``.
    chat: a :class:`~jaxrl_llm.envs.chat.ChatFormat`, or a tokenizer
      (:func:`~jaxrl_llm.envs.chat.chat_format` of it).
    envs: the environments, one per episode (distinct objects: they keep state).
    seeds: each environment's reset seed (default ``0, 1, ...``); a group of episodes
      of one prompt (GRPO) is several environments with one seed.
    max_turns: the most model turns per episode (>= 1).
    max_new_tokens: the most tokens of one turn.
    max_len: the most tokens of an episode's sequence (the length budget).
    max_workers: threads stepping the environments of a round (1: in order, here).

  Returns:
    The :class:`Episode` s, in the order of ``envs``.

  Raises:
    ValueError: ``max_turns`` < 1 (or not an int), another bad count, a seed per
      environment missing, one environment object given twice, an opening as long as
      ``max_len``, what an environment returns of the wrong type (naming it and the
      field), or ``generate`` returning other than one pair per prompt, 1 to
      ``max_new_tokens`` ids each with as many log-probs.
  """
  max_turns = check_max_turns(max_turns)
  max_new_tokens = check_int("max_new_tokens", max_new_tokens)
  max_len = check_int("max_len", max_len, 2)
  max_workers = check_int("max_workers", max_workers)
  chat = chat_format(chat)
  seeds = list(range(len(envs))) if seeds is None else list(seeds)
  if len(seeds) != len(envs):
    raise ValueError(f"`seeds` must have one seed per environment: got {len(seeds)} "
                     f"for {len(envs)} `envs`.")
  seen: dict[int, int] = {}
  for i, env in enumerate(envs):
    if id(env) in seen:
      raise ValueError(f"`envs[{i}]` is `envs[{seen[id(env)]}]`: each episode needs its "
                       "own environment object (environments keep state).")
    seen[id(env)] = i
  lives = [_start(env, seed, chat, max_len) for env, seed in zip(envs, seeds)]
  pool = (concurrent.futures.ThreadPoolExecutor(max_workers) if max_workers > 1
          and len(lives) > 1 else None)
  try:
    while True:
      live = [x for x in lives if x.finish is None]
      if not live:
        break
      limits = [min(max_new_tokens, max_len - len(x.tokens)) for x in live]
      outs = list(generate([list(x.tokens) for x in live], limits))
      if len(outs) != len(live):
        raise ValueError(f"`generate` returned {len(outs)} completions for {len(live)} "
                         "prompts.")
      turns = [_check_turn(out, i, limit) for i, (out, limit) in enumerate(zip(outs, limits))]
      for i, (x, out) in enumerate(zip(live, outs)):
        cached = _cached_tokens(out, i, len(x.tokens))
        x.prefilled += len(x.tokens) - cached
        x.reused += cached
      step = lambda x, turn: _advance(x, turn, chat, max_turns=max_turns, max_len=max_len)
      if pool is None:
        for x, turn in zip(live, turns):
          step(x, turn)
      else:
        for future in [pool.submit(step, x, turn) for x, turn in zip(live, turns)]:
          future.result()
  finally:
    if pool is not None:
      pool.shutdown(wait=True)
  return [x.episode() for x in lives]


class SampledTurn(tuple):
  """A ``(sampled_ids, sampled_logprobs)`` pair of a :data:`Generate` that also says
  how many leading prompt tokens the backend read from its prefix cache
  (``cached_tokens``): it unpacks as the pair.

  >>> turn = SampledTurn([4, 2], [-0.5, -1.0], cached_tokens=16)
  >>> ids, logprobs = turn
  >>> ids, turn.cached_tokens
  ([4, 2], 16)
  """

  cached_tokens: int

  def __new__(cls, ids: Any, logprobs: Any, cached_tokens: int = 0) -> SampledTurn:
    turn = super().__new__(cls, (ids, logprobs))
    turn.cached_tokens = int(cached_tokens)
    return turn


def engine_generate(engine: Any, params: Any, *, eos_ids: Sequence[int], seed: int = 0,
                    prefix_cache: bool | None = None, **sampling: Any) -> Generate:
  """A :data:`Generate` over a :class:`~jaxrl_llm.rollout.engine.RolloutEngine`: each
  call completes every prompt once (``Request(prompt, max_new_tokens=...,
  eos_ids=eos_ids, **sampling)``, e.g. ``temperature``, ``top_k``, ``top_p``), with
  the draws' seed of call ``c`` derived from ``(seed, c)``. The engine's ``max_len``
  must hold an episode's (:func:`run_episodes`' ``max_len``).

  ``prefix_cache``: None (default) uses ``engine`` as it is; True or False generates
  with a replica of it with that setting (:meth:`RolloutEngine.replica`: its
  compilations, a cache of its own) when it differs. With the prefix cache, each turn
  continues the episode's sequence from the pages of its previous turn (the module
  docstring, "KV continuation").

  Returns:
    ``generate(prompts, max_new_tokens, sampling=None) -> [SampledTurn(
    completion.tokens, completion.logprobs, completion.cached_tokens)]`` (pairs,
    log-probs of the temperature-scaled full distribution). ``sampling`` (optional):
    one mapping per prompt of ``Request`` fields that replace ``**sampling``'s for
    that prompt (the OpenAI-compatible endpoint of :mod:`jaxrl_llm.serve` passes each
    request's ``temperature`` / ``top_p`` so).
  """
  if prefix_cache is not None and prefix_cache != engine.prefix_cache:
    engine = engine.replica(prefix_cache=prefix_cache)
  calls = [0]
  stops = tuple(int(i) for i in eos_ids)
  defaults = dict(sampling)

  def generate(prompts: list[list[int]], limits: list[int],
               sampling: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[Any, Any]]:
    call = calls[0]
    calls[0] += 1
    draws = int(np.random.SeedSequence([int(seed), call]).generate_state(1)[0] >> 1)
    own = [{}] * len(prompts) if sampling is None else list(sampling)
    if len(own) != len(prompts):
      raise ValueError(f"`sampling` must have one mapping per prompt: got {len(own)} for "
                       f"{len(prompts)} prompts.")
    requests = [Request(list(p), max_new_tokens=int(m), eos_ids=stops,
                        **{**defaults, **dict(s)})
                for p, m, s in zip(prompts, limits, own)]
    out = sorted(engine.generate(params, requests, seed=draws),
                 key=lambda c: (c.request, c.sample))
    return [SampledTurn(c.tokens, c.logprobs, c.cached_tokens) for c in out]

  return generate


def episodes_to_batch(episodes: Sequence[Episode], *, pad_id: int,
                      length: int | None = None, group_size: int | None = None,
                      group_ids: Any = None, num_groups: int | None = None,
                      **advantage_kwargs: Any) -> dict[str, np.ndarray]:
  """Train rows of ``episodes`` (right-padded to ``length``, default the longest).

  Returns:
    ``{"tokens", "attention_mask", "loss_mask", "rollout_logp", "advantages"}``
    ``[B, T]`` (``advantages`` :math:`A_i m_{i,t}`; ``rollout_logp`` the behaviour
    log-probs, aligned with the tokens as the train step's log-probs are: entry t is
    the log-prob of token t), and ``"scores"`` (the episodes' rewards), ``"turns"``
    ``[B]``. :math:`A_i` = :func:`~jaxrl_llm.advantages.group_advantages` of the
    scores with ``group_size`` (consecutive episodes of one prompt) or ``group_ids`` /
    ``num_groups`` and ``advantage_kwargs`` (``baseline``, ``scale``, ``eps``, ...;
    its defaults: GRPO).

  Raises:
    ValueError: no episodes, or an episode longer than ``length``.

  Examples:
    >>> ep = lambda r: Episode(np.array([5, 6, 7, 8]), np.array([0, 1, 0, 1]),
    ...                        np.array([0, -.5, 0, -.25], np.float32), 1, [(1, 2), (3, 4)],
    ...                        [r], "done", [], [], "e", 0)
    >>> b = episodes_to_batch([ep(1.0), ep(0.0)], pad_id=0, length=5, group_size=2)
    >>> b["tokens"][0].tolist(), b["loss_mask"][0].tolist()
    ([5, 6, 7, 8, 0], [0, 1, 0, 1, 0])
    >>> np.round(b["advantages"], 4).tolist()
    [[0.0, 0.7071, 0.0, 0.7071, 0.0], [0.0, -0.7071, 0.0, -0.7071, 0.0]]
  """
  if not episodes:
    raise ValueError("`episodes` is empty.")
  longest = max(len(e.tokens) for e in episodes)
  length = longest if length is None else check_int("length", length)
  if longest > length:
    raise ValueError(f"an episode is {longest} tokens, longer than `length`={length}.")
  b = len(episodes)
  tokens = np.full((b, length), pad_id, np.int32)
  attention = np.zeros((b, length), np.int32)
  loss_mask = np.zeros((b, length), np.int32)
  logp = np.zeros((b, length), np.float32)
  for i, e in enumerate(episodes):
    n = len(e.tokens)
    tokens[i, :n] = e.tokens
    attention[i, :n] = 1
    loss_mask[i, :n] = e.loss_mask
    logp[i, :n] = e.behaviour_logprobs
  scores = np.asarray([e.reward for e in episodes], np.float32)
  adv = np.asarray(group_advantages(scores, group_size=group_size, group_ids=group_ids,
                                    num_groups=num_groups, **advantage_kwargs), np.float32)
  return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask,
          "rollout_logp": logp, "advantages": adv[:, None] * loss_mask,
          "scores": scores, "turns": np.asarray([e.turns for e in episodes], np.int32)}


__all__ = ["Episode", "FINISH_REASONS", "Generate", "SampledTurn", "engine_generate",
           "episodes_to_batch", "run_episodes"]
