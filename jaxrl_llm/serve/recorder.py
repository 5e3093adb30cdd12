"""Every call of the endpoint recorded as token trajectories, chained token in / token out.

Each choice the endpoint returns is recorded as a :class:`Call`: its prompt ids (what
the backend was given), its sampled ids and their behaviour log-probs (what the backend
returned), and what the client was told (the message or text). :meth:`Recorder.take`
returns the recorded trajectories as :class:`~jaxrl_llm.rollout.multiturn.Episode` s
(so :func:`~jaxrl_llm.rollout.multiturn.episodes_to_batch` trains on them) and clears
the recorder.

**Chaining (TITO across calls).** An agent sends the conversation back with the
model's earlier turn as text. Re-encoding that text would not give the ids the model
sampled (and a chat template may render an earlier turn differently: Qwen3 drops its
``<think>`` block), so a request that continues an earlier call is matched at the
message level and its prompt is built from that call's exact ids:

* chat: the request's messages are ``M[:i] + [M[i]] + M[i+1:]`` where ``M[:i]`` (with
  the same ``tools``) equals, message for message, the messages of an earlier call,
  ``M[i]`` is an assistant message equal to what that call returned (its content, and
  its tool calls' names and arguments), and ``M[i+1:]`` is not empty. Then

  .. code-block:: text

    prompt = earlier prompt ids + earlier sampled ids + continuation_ids(M[i+1:])

  (:meth:`~jaxrl_llm.envs.chat.ChatFormat.continuation_ids`: the close of the earlier
  turn where the model did not write it, the new messages, the next assistant header);
  the assistant text is never encoded. The latest assistant message that matches wins
  (the longest chain); among equal earlier calls (``n`` > 1, a retried request), the
  one whose tool-call ids the message carries, else one not yet continued, else the
  latest.
* completions: a prompt given as ids that starts with an earlier call's prompt ids +
  sampled ids (the longest) is that call continued, the rest of the prompt appended
  as given; a prompt string that starts with an earlier string prompt + the text
  returned for it continues that call, the rest of the string encoded alone.

A chained call's prompt extends its parent's prompt + sampled ids exactly, so the
calls of one conversation form one trajectory: the tokens of its last call (its prompt
and its sampled ids), loss mask 1 on every call's sampled ids and 0 on the prompt and
everything rendered in between, each call's behaviour log-probs on its sampled ids.
:meth:`Recorder.take` returns one episode per call that no later call continued (a
conversation that branched gives one episode per branch, sharing their prefix).

**When matching fails** (the agent edited an earlier message, changed the tools, sent
a history this server never produced, or the chain was taken already), the request is
rendered fresh (:meth:`~jaxrl_llm.envs.chat.ChatFormat.prompt_ids` of all its
messages) and its trajectory starts anew; :meth:`Recorder.stats`' ``restarted`` counts
such chat requests (ones with an assistant message in their history that matched no
recorded call). A call continued after :meth:`Recorder.take` took its parent keeps the
parent's ids as its prompt (mask 0: that part was handed out already).

Examples:
  >>> from jaxrl_llm.envs import CHAT_CHARS, PlainChat
  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> chat = PlainChat(CharTokenizer(CHAT_CHARS))
  >>> rec = Recorder(chat)
  >>> user = [{"role": "user", "content": "hi"}]
  >>> first = rec.chat_prefix(user, None)
  >>> ids = chat.tokenizer.encode("yo") + [chat.eos_id]
  >>> call = rec.record(first, ids, [-0.5] * 3, messages=user, key=chat_key(None, user),
  ...                   reply={"role": "assistant", "content": "yo"}, finish_reason="stop")
  >>> again = user + [{"role": "assistant", "content": "yo"},
  ...                 {"role": "user", "content": "more"}]
  >>> second = rec.chat_prefix(again, None)
  >>> second.parent is call, second.reused
  (True, 10)
  >>> text = lambda ids: "".join(chat.tokenizer.id_to_token(i) for i in ids)
  >>> text(second.prompt_ids)
  'u:hi<eos>a:yo<eos>u:more<eos>a:'
  >>> _ = rec.record(second, [chat.eos_id], [-0.25], messages=again,
  ...                key=chat_key(None, again),
  ...                reply={"role": "assistant", "content": ""}, finish_reason="stop")
  >>> [ep] = rec.take()
  >>> ep.turn_spans, int(ep.loss_mask.sum()), rec.stats()["continued"]
  ([(7, 10), (19, 20)], 4, 1)
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.envs.base import Message
from jaxrl_llm.envs.chat import chat_format
from jaxrl_llm.rollout.multiturn import Episode


def chat_key(tools: Sequence[Mapping[str, Any]] | None, messages: Sequence[Message]) -> str:
  """The key two chat requests share when their tools and messages are equal (JSON with
  sorted keys of the normalized messages)."""
  return json.dumps([list(tools or []), list(messages)], sort_keys=True)


def _reply_key(message: Mapping[str, Any]) -> str:
  """An assistant message's content and calls (names, arguments), for matching."""
  calls = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls") or ()]
  return json.dumps([message.get("content") or "", calls], sort_keys=True)


def _call_ids(message: Mapping[str, Any]) -> list[str]:
  return [c.get("id", "") for c in message.get("tool_calls") or ()]


@dataclasses.dataclass(eq=False)
class Call:
  """One recorded choice.

  Attributes:
    order: its number among the recorder's calls (0, 1, ...).
    prompt_ids: the ids the backend was given (a chained call's start with its parent's
      prompt and sampled ids).
    sampled_ids: the ids kept of what the backend sampled (all of them, or up to a
      stop string).
    logprobs: the backend's log-prob of each sampled id.
    parent: the call it continues, or None.
    messages: the request's messages (chat; normalized), or the prompt as one
      ``{"role": "prompt"}`` message (completions).
    reply: what the client got: the assistant message (chat; normalized) or
      ``{"role": "completion", "content": text}``.
    finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"``.
    info: more about the call (its id, sampling, reused ids), kept in the episode's
      ``infos``.
    key: the chat key of its request (:func:`chat_key`), None for completions.
    text: a string-prompt completion's prompt + returned text (None otherwise).
    epoch: how many :meth:`Recorder.take` calls came before it.
    extended: whether a later call continued it.
  """

  order: int
  prompt_ids: list[int]
  sampled_ids: list[int]
  logprobs: list[float]
  parent: Call | None
  messages: list[Message]
  reply: Message
  finish_reason: str
  info: dict[str, Any]
  key: str | None = None
  text: str | None = None
  epoch: int = 0
  extended: bool = False

  @property
  def ids(self) -> list[int]:
    """Its prompt ids then its sampled ids."""
    return self.prompt_ids + self.sampled_ids


@dataclasses.dataclass(frozen=True)
class Prefix:
  """The prompt ids of a request about to be generated.

  Attributes:
    prompt_ids: what the backend is given.
    parent: the call it continues (None: rendered fresh).
    reused: how many leading ids are the parent's (its prompt and sampled ids).
  """

  prompt_ids: list[int]
  parent: Call | None = None
  reused: int = 0


class Recorder:
  """Thread-safe record of the endpoint's calls (the module docstring).

  Args:
    chat: the :class:`~jaxrl_llm.envs.chat.ChatFormat` (or a tokenizer) that renders
      prompts and continuations; its ``tokenizer.encode`` encodes string prompts.
    name: the episodes' ``env``.
  """

  def __init__(self, chat: Any, *, name: str = "serve") -> None:
    self.chat = chat_format(chat)
    self.name = name
    self._lock = threading.Lock()
    self._epoch = 0
    self._order = 0
    self._counts = {"calls": 0, "continued": 0, "restarted": 0, "taken": 0}
    self._reset()

  def _reset(self) -> None:
    self._calls: list[Call] = []
    self._by_key: dict[str, list[Call]] = {}
    self._by_ids: dict[int, dict[tuple[int, ...], Call]] = {}
    self._by_text: dict[str, Call] = {}

  def stats(self) -> dict[str, int]:
    """Counts since the recorder was made: ``calls`` (recorded choices),
    ``continued`` (requests chained to an earlier call), ``restarted`` (chat requests
    with an assistant message in their history that matched no recorded call: rendered
    fresh, a new trajectory), ``taken`` (episodes :meth:`take` returned)."""
    with self._lock:
      return dict(self._counts)

  # ---- prompts ---------------------------------------------------------------------

  def _chat_parent(self, messages: Sequence[Message],
                   tools: Sequence[Mapping[str, Any]] | None) -> tuple[Call, int] | None:
    for i in range(len(messages) - 2, -1, -1):
      if messages[i]["role"] != "assistant":
        continue
      want, ids = _reply_key(messages[i]), _call_ids(messages[i])
      found = [c for c in self._by_key.get(chat_key(tools, messages[:i]), ())
               if _reply_key(c.reply) == want]
      if found:
        best = max(found, key=lambda c: (ids == _call_ids(c.reply) and any(ids),
                                         not c.extended, c.order))
        return best, i
    return None

  def chat_prefix(self, messages: Sequence[Message],
                  tools: Sequence[Mapping[str, Any]] | None) -> Prefix:
    """The prompt of a chat request (``messages`` normalized, as
    :func:`~jaxrl_llm.serve.protocol.normalize_message` makes them): an earlier call
    continued, else the messages rendered fresh (the module docstring).

    Raises:
      ValueError: what the chat format raises (a text its tokenizer cannot encode).
    """
    with self._lock:
      match = self._chat_parent(messages, tools)
      if match is None and any(m["role"] == "assistant" for m in messages):
        self._counts["restarted"] += 1
      elif match is not None:
        self._counts["continued"] += 1
    if match is None:
      return Prefix(list(self.chat.prompt_ids(list(messages), tools or None)))
    parent, i = match
    reply = self.chat.continuation_ids(list(messages[i + 1:]), parent.sampled_ids,
                                       tools or None)
    return Prefix(parent.ids + list(reply), parent, len(parent.ids))

  def ids_prefix(self, ids: Sequence[int]) -> Prefix:
    """The prompt of a completion given as ids: the longest earlier call whose prompt
    and sampled ids start ``ids`` continued, else ``ids`` as is."""
    ids = [int(i) for i in ids]
    with self._lock:
      for n in sorted(self._by_ids, reverse=True):
        parent = self._by_ids[n].get(tuple(ids[:n])) if n <= len(ids) else None
        if parent is not None:
          self._counts["continued"] += 1
          return Prefix(ids, parent, n)
    return Prefix(ids)

  def text_prefix(self, text: str) -> Prefix:
    """The prompt of a completion given as a string: the longest earlier string prompt
    + returned text that starts ``text`` continued (the rest encoded alone), else
    ``text`` encoded.

    Raises:
      ValueError: the chat format has no ``tokenizer``, or it cannot encode ``text``.
    """
    encode = getattr(getattr(self.chat, "tokenizer", None), "encode", None)
    if encode is None:
      raise ValueError("this chat format has no tokenizer to encode a string prompt; send "
                       "token ids.")
    with self._lock:
      starts = [t for t in self._by_text if text.startswith(t)]
      parent = self._by_text[max(starts, key=len)] if starts else None
      if parent is not None:
        self._counts["continued"] += 1
    if parent is None:
      return Prefix(list(encode(text)))
    rest = text[len(parent.text or ""):]
    return Prefix(parent.ids + (list(encode(rest)) if rest else []), parent,
                  len(parent.ids))

  # ---- recording -------------------------------------------------------------------

  def record(self, prefix: Prefix, sampled_ids: Sequence[int], logprobs: Sequence[float], *,
             messages: Sequence[Message], reply: Message, finish_reason: str,
             key: str | None = None, text: str | None = None,
             info: Mapping[str, Any] | None = None) -> Call:
    """Records one choice generated from ``prefix`` (the :class:`Call` fields); returns
    its :class:`Call`."""
    if len(sampled_ids) != len(logprobs):
      raise ValueError(f"`sampled_ids` ({len(sampled_ids)}) and `logprobs` "
                       f"({len(logprobs)}) must have one entry per sampled id.")
    with self._lock:
      call = Call(self._order, list(prefix.prompt_ids), [int(i) for i in sampled_ids],
                  [float(x) for x in logprobs], prefix.parent, list(messages), dict(reply),
                  finish_reason, {**dict(info or {}), "reused_ids": prefix.reused},
                  key=key, text=text, epoch=self._epoch)
      self._order += 1
      self._counts["calls"] += 1
      if prefix.parent is not None and prefix.parent.epoch == self._epoch:
        prefix.parent.extended = True
      self._calls.append(call)
      if key is not None:
        self._by_key.setdefault(key, []).append(call)
      self._by_ids.setdefault(len(call.ids), {})[tuple(call.ids)] = call
      if text is not None:
        self._by_text[text] = call
    return call

  def take(self) -> list[Episode]:
    """The recorded trajectories, one :class:`~jaxrl_llm.rollout.multiturn.Episode` per
    call no later call continued (in the order their last calls were made), and clears
    the recorder: a later request continuing one of them starts a new trajectory whose
    prompt keeps the taken ids (mask 0).

    Each episode: ``tokens`` its last call's prompt and sampled ids, ``loss_mask`` 1 on
    the sampled ids of each of its calls, ``behaviour_logprobs`` theirs,
    ``turn_spans`` each call's sampled ids, ``turn_rewards`` 0 per call (the caller's
    to set), ``finish_reason`` ``"length"`` when its last call was cut by its token
    limit (else ``"done"``), ``messages`` the last request's messages and its reply,
    ``infos`` each call's ``info``, ``seed`` the order of its first call.
    """
    with self._lock:
      calls = self._calls
      self._reset()
      self._epoch += 1
      leaves = [c for c in calls if not c.extended]
      self._counts["taken"] += len(leaves)
    return [self._episode(c) for c in leaves]

  def _episode(self, leaf: Call) -> Episode:
    chain: list[Call] = []
    at: Call | None = leaf
    while at is not None and at.epoch == leaf.epoch:
      chain.append(at)
      at = at.parent
    chain.reverse()
    tokens = np.asarray(leaf.ids, np.int32)
    mask = np.zeros(len(tokens), np.int32)
    logp = np.zeros(len(tokens), np.float32)
    spans = []
    for c in chain:
      start = len(c.prompt_ids)
      end = start + len(c.sampled_ids)
      mask[start:end] = 1
      logp[start:end] = c.logprobs
      spans.append((start, end))
    return Episode(tokens, mask, logp, len(chain[0].prompt_ids), spans, [0.0] * len(chain),
                   "length" if leaf.finish_reason == "length" else "done",
                   [*leaf.messages, leaf.reply], [c.info for c in chain], self.name,
                   chain[0].order)


__all__ = ["Call", "Prefix", "Recorder", "chat_key"]
