"""Chat formats: an episode's opening and its environment turns rendered to token ids.

A multi-turn episode is one token sequence built incrementally ("token in, token
out"): the opening messages rendered once (:meth:`ChatFormat.prompt_ids`, ending with
the assistant header), then each model turn's sampled ids exactly as sampled, then
each environment reply rendered once to ids (:meth:`ChatFormat.continuation_ids`: the
close of the model's turn where the model did not write it, the reply's turns, the
next assistant header), appended. Nothing already in the sequence is rendered,
decoded or encoded again.

:class:`TemplateChat` renders through a Hugging Face chat template
(:class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer`). It computes a continuation as a
difference of renderings around a sentinel: it renders

.. code-block:: text

  [user "U", assistant SENTINEL] + reply                 (add_generation_prompt=True)

and takes the text after ``SENTINEL``: what the template writes between the end of an
assistant's content and the start of the next assistant's content (Qwen:
``<|im_end|>\\n<|im_start|>user\\n<tool_response>...<|im_end|>\\n<|im_start|>assistant\\n``;
Llama 3.1: ``<|eot_id|><|start_header_id|>ipython<|end_header_id|>\\n\\n...``). Its check
that the prefix is unchanged: the text after ``SENTINEL`` must start with the close
that the template writes after a *last* assistant turn (the same rendering without
``reply``): appending the reply does not change how the model's turn ends. A
template for which it does not hold raises ``ValueError``. The part before
``SENTINEL`` may change with what follows, and does not matter: Qwen3 drops the empty
``<think>`` block of an assistant turn that is no longer last, which is why
re-rendering a conversation changes its earlier tokens (the retokenization drift of
verl#6719 and others); here the earlier tokens are the ones the model saw and sampled.

The model's turn usually ends with its stop id (``<|im_end|>``, ``<|eot_id|>``,
``<|eom_id|>``), the first token of the template's close: when the sampled turn ends
with one of :attr:`ChatFormat.stop_ids` and the close starts with the text of one, the
close's first token is dropped (the sampled one stands for it). A turn cut by its token
limit keeps the whole close, so the sequence stays well formed. The continuation text
starts with a special token or right after one, so encoding it alone gives the ids it
has in the whole text.

:class:`PlainChat` is the format of tokenizers without a chat template (the built-in
character tokenizer): each message is ``tag + content`` then ``eos``
(``u:hi<eos>``), the generation prompt is the assistant tag, rendered at the id level.

Examples:
  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> chat = PlainChat(CharTokenizer(CHAT_CHARS))
  >>> text = lambda ids: "".join(chat.tokenizer.id_to_token(i) for i in ids)
  >>> text(chat.prompt_ids([{"role": "user", "content": "2+2?"}]))
  'u:2+2?<eos>a:'
  >>> sampled = chat.tokenizer.encode("4") + [chat.tokenizer.eos_id]   # ends at its stop
  >>> text(chat.continuation_ids([{"role": "user", "content": "sure?"}], sampled))
  'u:sure?<eos>a:'
  >>> text(chat.continuation_ids([{"role": "user", "content": "sure?"}], sampled[:-1]))
  '<eos>u:sure?<eos>a:'
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from jaxrl_llm.envs.base import Message
from jaxrl_llm.tasks.tokenizer import DIGITS, LETTERS, SYMBOLS

CHAT_CHARS = "".join(dict.fromkeys(
    DIGITS + SYMBOLS + LETTERS + LETTERS.upper() + ".:;?!'\"<>/_[]{}\n#%&|@$^~`\\"))
"""The alphabet of a :class:`~jaxrl_llm.tasks.tokenizer.CharTokenizer` that writes the
built-in environments' texts (``CharTokenizer(CHAT_CHARS)``): digits, letters, the
arithmetic symbols, punctuation, brackets and newline."""

SENTINEL = "JAXRLLLMTURNSENTINEL"
"""The assistant content :class:`TemplateChat` renders to find where a turn ends
(letters only: templates ``trim`` contents and split them on ``</think>``)."""

DUMMY_USER = "U"


@runtime_checkable
class ChatFormat(Protocol):
  """How an episode's messages become token ids (the module docstring).

  Attributes:
    stop_ids: the ids that end a model turn (the backend stops a turn at any of them).
  """

  stop_ids: tuple[int, ...]

  def prompt_ids(self, messages: Sequence[Message],
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The ids of the opening ``messages`` (with ``tools``' schemas), ending with the
    assistant header the model's first turn follows."""
    ...

  def continuation_ids(self, messages: Sequence[Message], last_turn: Sequence[int],
                       tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The ids appended after a model turn ``last_turn`` (its sampled ids): the turn's
    close where the model did not write it, ``messages``, the next assistant header."""
    ...

  def decode(self, ids: Sequence[int]) -> str:
    """The text of a model turn (what the environment reads)."""
    ...


class PlainChat:
  """A chat format at the id level, for tokenizers without a chat template.

  A message is ``encode(tags[role] + content) + [eos]``; the generation prompt is
  ``encode(tags["assistant"])``; a model turn ends at ``eos`` (a turn cut by its
  limit gets one appended). Tools, when given, are listed first as one ``system``
  message ``tools: name(arg, ...); ...``.

  Args:
    tokenizer: any tokenizer with ``encode``, ``decode`` and an ``eos_id`` (the
      built-in ``CharTokenizer(CHAT_CHARS)``).
    tags: the prefix of each role (``system``, ``user``, ``assistant``, ``tool``; an
      unknown role is written ``role + ":"``).

  Raises:
    ValueError: a tokenizer without ``eos_id``.
  """

  DEFAULT_TAGS: ClassVar[Mapping[str, str]] = {"system": "s:", "user": "u:",
                                               "assistant": "a:", "tool": "t:"}

  def __init__(self, tokenizer: Any, *, tags: Mapping[str, str] | None = None) -> None:
    if getattr(tokenizer, "eos_id", None) is None:
      raise ValueError("`tokenizer` must have an eos_id (it ends every turn).")
    self.tokenizer = tokenizer
    self.tags = {**self.DEFAULT_TAGS, **dict(tags or {})}
    self.eos_id = int(tokenizer.eos_id)
    self.stop_ids: tuple[int, ...] = (self.eos_id,)

  def _tag(self, role: str) -> str:
    return self.tags.get(role, role + ":")

  def _message_ids(self, m: Message) -> list[int]:
    return self.tokenizer.encode(self._tag(m["role"]) + m["content"]) + [self.eos_id]

  def _tool_message(self, tools: Sequence[Mapping[str, Any]] | None) -> list[Message]:
    if not tools:
      return []
    listed = []
    for t in tools:
      fn = t.get("function", t)
      args = ", ".join(fn.get("parameters", {}).get("properties", {}))
      listed.append(f"{fn['name']}({args})")
    return [{"role": "system", "content": "tools: " + "; ".join(listed)}]

  def prompt_ids(self, messages: Sequence[Message],
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    ids: list[int] = []
    for m in [*self._tool_message(tools), *messages]:
      ids += self._message_ids(m)
    return ids + self.tokenizer.encode(self._tag("assistant"))

  def continuation_ids(self, messages: Sequence[Message], last_turn: Sequence[int],
                       tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    del tools
    ids = [] if len(last_turn) and int(last_turn[-1]) == self.eos_id else [self.eos_id]
    for m in messages:
      ids += self._message_ids(m)
    return ids + self.tokenizer.encode(self._tag("assistant"))

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids))


class TemplateChat:
  """A chat format through a Hugging Face chat template (the module docstring).

  Args:
    tokenizer: an :class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer` with a chat
      template.
    stop_ids: the ids that end a model turn (default: the tokenizer's ``eos_ids``).
    **template_kwargs: more template variables (``enable_thinking=False`` for Qwen3,
      ``date_string`` for Llama 3.1).

  Raises:
    ValueError: a tokenizer without a chat template, or no stop ids.
  """

  def __init__(self, tokenizer: Any, *, stop_ids: Sequence[int] | None = None,
               **template_kwargs: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
      raise ValueError("`tokenizer` has no chat template (use PlainChat).")
    self.tokenizer = tokenizer
    self.template_kwargs = template_kwargs
    self.stop_ids = tuple(int(i) for i in (tokenizer.eos_ids if stop_ids is None
                                           else stop_ids))
    if not self.stop_ids:
      raise ValueError("`stop_ids` is empty and the tokenizer has no eos id: nothing "
                       "would end a model turn.")

  def render(self, messages: Sequence[Message], *, add_generation_prompt: bool,
             tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The template's text of ``messages``."""
    text = self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
        **self.template_kwargs)
    assert isinstance(text, str)
    return text

  def prompt_ids(self, messages: Sequence[Message],
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    return self.tokenizer.encode(self.render(messages, add_generation_prompt=True,
                                             tools=tools))

  @functools.cached_property
  def _stop_texts(self) -> tuple[str, ...]:
    return tuple(self.tokenizer.id_to_token(i) for i in self.stop_ids)

  def continuation_text(self, messages: Sequence[Message], *, closed: bool,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The text appended after a model turn (``closed``: the turn ended with a stop
    id, which stands for the close's first token).

    Raises:
      ValueError: when the template writes the sentinel content other than once, or
        closes an assistant turn differently when messages follow (the module
        docstring: the check that the prefix is unchanged).
    """
    base = [{"role": "user", "content": DUMMY_USER},
            {"role": "assistant", "content": SENTINEL}]
    alone = self.render(base, add_generation_prompt=False, tools=tools)
    full = self.render(base + [dict(m) for m in messages], add_generation_prompt=True,
                       tools=tools)
    if full.count(SENTINEL) != 1 or alone.count(SENTINEL) != 1:
      raise ValueError("the chat template does not write an assistant turn's content "
                       "verbatim once; its environment turns cannot be rendered apart.")
    close = alone.split(SENTINEL, 1)[1]
    after = full.split(SENTINEL, 1)[1]
    if not after.startswith(close):
      raise ValueError(f"the chat template closes an assistant turn with {close!r} when "
                       f"it is last but with {after[:len(close) + 20]!r}... when messages "
                       "follow; its environment turns cannot be rendered apart.")
    if closed:
      stop = next((t for t in self._stop_texts if after.startswith(t)), None)
      if stop is not None:
        after = after[len(stop):]
    return after

  def continuation_ids(self, messages: Sequence[Message], last_turn: Sequence[int],
                       tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    closed = len(last_turn) > 0 and int(last_turn[-1]) in self.stop_ids
    return self.tokenizer.encode(self.continuation_text(messages, closed=closed,
                                                        tools=tools))

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids))


def chat_format(tokenizer: Any, **kwargs: Any) -> ChatFormat:
  """The chat format of ``tokenizer``: a :class:`ChatFormat` as is, a
  :class:`TemplateChat` for a tokenizer with a chat template (``kwargs``: its
  template variables), else a :class:`PlainChat` (``kwargs``: its ``tags``).

  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> type(chat_format(CharTokenizer(CHAT_CHARS))).__name__
  'PlainChat'
  """
  if isinstance(tokenizer, ChatFormat):
    return tokenizer
  if getattr(tokenizer, "chat_template", None) is not None:
    return TemplateChat(tokenizer, **kwargs)
  return PlainChat(tokenizer, **kwargs)


__all__ = ["CHAT_CHARS", "ChatFormat", "PlainChat", "SENTINEL", "TemplateChat",
           "chat_format"]
