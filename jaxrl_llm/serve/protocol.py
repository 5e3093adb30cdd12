"""The OpenAI wire format: requests checked into plain data, responses built from it.

Pure functions, no HTTP and no model: :func:`parse_chat_request` and
:func:`parse_completion_request` turn a decoded JSON body into a
:class:`ChatRequest` / :class:`CompletionRequest` or raise :class:`ApiError` (an HTTP
status and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``);
:func:`chat_response`, :func:`chat_chunks`, :func:`completion_response` and
:func:`completion_chunks` build the JSON of a finished :class:`Choice`.

What is accepted (fields not listed are ignored, as vLLM ignores them):

========================================  ===========================================
field                                     meaning here
========================================  ===========================================
``model``                                 the served name (another name: 404
                                          ``model_not_found``; omitted: the served one)
``messages`` (chat)                       ``role`` in system / developer / user /
                                          assistant / tool; ``content`` a string, null
                                          or a list of ``{"type": "text"}`` parts;
                                          ``name``, ``tool_call_id``, ``tool_calls``
``prompt`` (completions)                  a string, a list of token ids, or a list of
                                          either (one choice group per prompt)
``tools``, ``tool_choice``                function schemas, rendered by the chat
                                          template; ``tool_choice: "none"`` turns the
                                          parsing of calls off (any other value parses
                                          as ``"auto"``: nothing is forced)
``max_completion_tokens`` / ``max_tokens``  >= 1; prompt + it must fit the context
                                          (default: what is left of the context)
``n``                                     1 to 128 choices (samples of one prompt)
``temperature``, ``top_p``                passed to a backend that takes per-request
                                          sampling (``generate(..., sampling=)``),
                                          otherwise the backend's own settings apply
``stop``                                  a string or a list of strings: the text is
                                          cut before the first one and the sampled ids
                                          after the token that completes it are dropped
``logprobs`` (chat: bool; completions:    the sampled tokens' log-probs (the backend's
int, 0 only)                              behaviour log-probs); ``top_logprobs`` > 0
                                          (chat) and ``logprobs`` > 0 (completions):
                                          400, the backend returns the sampled token's
                                          log-prob only
``stream``, ``stream_options``            server-sent events in OpenAI's chunk format,
                                          ending with ``data: [DONE]``;
                                          ``include_usage`` adds the usage chunk
``return_token_ids``                      default true: ``prompt_token_ids`` (on the
                                          chat response / first chunk; on each
                                          completion choice) and ``token_ids`` (on
                                          each choice), vLLM's field names
``echo``, ``suffix`` (completions)        400 when set (not supported)
========================================  ===========================================

Examples:
  >>> req = parse_chat_request({"model": "m", "messages": [{"role": "user",
  ...                           "content": "hi"}], "max_tokens": 4}, "m")
  >>> req.messages, req.sampling.max_tokens, req.sampling.n
  ([{'role': 'user', 'content': 'hi'}], 4, 1)
  >>> try:
  ...   parse_chat_request({"messages": [], "max_tokens": 0}, "m")
  ... except ApiError as e:
  ...   print(e.status, e.body()["error"]["param"])
  400 messages
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jaxrl_llm.envs.base import Message
from jaxrl_llm.envs.tools import ParsedTurn

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles a chat request may use."""

MAX_CHOICES = 128
"""The most choices (``n``) of one request."""

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 411: "invalid_request_error",
                413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
  """An HTTP error with OpenAI's JSON body.

  Args:
    status: the HTTP status (4xx: the request's fault; 5xx: the server's).
    message: one line saying what is wrong.
    param: the request field at fault (``"messages[1].content"``), or None.
    code: a short machine-readable code (``"model_not_found"``), or None.

  Examples:
    >>> ApiError(404, "no such model", param="model", code="model_not_found").body()
    {'error': {'message': 'no such model', 'type': 'invalid_request_error',
               'param': 'model', 'code': 'model_not_found'}}
  """

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> None:
    super().__init__(message)
    self.status, self.message, self.param, self.code = int(status), message, param, code

  def body(self) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500
                            else "server_error")
    return {"error": {"message": self.message, "type": kind, "param": self.param,
                      "code": self.code}}


def _bad(message: str, param: str | None, code: str | None = "invalid_value") -> ApiError:
  return ApiError(400, message, param=param, code=code)


# ------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class Sampling:
  """What a request asks of the sampler and of the response (the module table).

  ``max_tokens`` None: what is left of the context. ``temperature`` / ``top_p`` None:
  the backend's own.
  """

  max_tokens: int | None = None
  n: int = 1
  temperature: float | None = None
  top_p: float | None = None
  stop: tuple[str, ...] = ()
  logprobs: bool = False
  stream: bool = False
  include_usage: bool = False
  return_token_ids: bool = True

  def overrides(self) -> dict[str, float]:
    """The per-request sampling fields the request set (for ``generate(sampling=)``)."""
    out = {"temperature": self.temperature, "top_p": self.top_p}
    return {k: v for k, v in out.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  """A checked ``/v1/chat/completions`` request: ``messages`` normalized
  (:func:`normalize_message`), ``tools`` (None: none), ``parse_tools`` (whether the
  reply's tool calls are parsed)."""

  messages: list[Message]
  tools: list[dict[str, Any]] | None
  parse_tools: bool
  sampling: Sampling


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A checked ``/v1/completions`` request: each prompt a string or a list of ids."""

  prompts: list[str | list[int]]
  sampling: Sampling


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _optional(body: Mapping[str, Any], key: str, check: Callable[[Any], bool],
              what: str) -> Any:
  value = body.get(key)
  if value is not None and not check(value):
    raise _bad(f"`{key}` must be {what}, got {json.dumps(value)[:80]}.", key)
  return value


def check_model(body: Mapping[str, Any], model_name: str) -> None:
  """404 ``model_not_found`` when ``body["model"]`` names another model (400 when it is
  no string); an omitted model is the served one."""
  model = body.get("model")
  if model is None:
    return
  if not isinstance(model, str):
    raise _bad(f"`model` must be a string, got {json.dumps(model)[:80]}.", "model")
  if model != model_name:
    raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                   f"`{model_name}`.", param="model", code="model_not_found")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise _bad("`stop` must be a non-empty string or a list of them, got "
               f"{json.dumps(stop)[:80]}.", "stop")
  return tuple(stop)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
      else "max_tokens"
  value = body.get(key)
  if value is not None and (not _is_int(value) or value < 1):
    raise _bad(f"`{key}` must be an integer >= 1, got {json.dumps(value)[:80]}.", key)
  return value


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
  options = body.get("stream_options")
  if options is None:
    return False
  if not isinstance(options, dict):
    raise _bad("`stream_options` must be an object.", "stream_options")
  if not stream:
    raise _bad("`stream_options` is only allowed with `stream: true`.", "stream_options")
  usage = options.get("include_usage", False)
  if not isinstance(usage, bool):
    raise _bad("`stream_options.include_usage` must be a boolean.",
               "stream_options.include_usage")
  return usage


def _sampling(body: Mapping[str, Any], *, logprobs: bool) -> Sampling:
  n = _optional(body, "n", lambda x: _is_int(x) and 1 <= x <= MAX_CHOICES,
                f"an integer from 1 to {MAX_CHOICES}")
  temperature = _optional(body, "temperature", lambda x: _is_number(x) and x >= 0,
                          "a number >= 0")
  top_p = _optional(body, "top_p", lambda x: _is_number(x) and 0 < x <= 1,
                    "a number in (0, 1]")
  stream = _optional(body, "stream", lambda x: isinstance(x, bool), "a boolean")
  ids = _optional(body, "return_token_ids", lambda x: isinstance(x, bool), "a boolean")
  return Sampling(max_tokens=_max_tokens(body), n=1 if n is None else n,
                  temperature=None if temperature is None else float(temperature),
                  top_p=None if top_p is None else float(top_p), stop=_stop(body),
                  logprobs=logprobs, stream=bool(stream),
                  include_usage=_stream_options(body, bool(stream)),
                  return_token_ids=True if ids is None else ids)


def _text(content: Any, param: str) -> str:
  """A message's content as one string (null: empty; text parts: joined)."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for k, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
          part.get("text"), str):
        raise _bad("only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                   f"supported, got {json.dumps(part)[:80]}.", f"{param}[{k}]")
      parts.append(part["text"])
    return "".join(parts)
  raise _bad(f"`content` must be a string, null or a list of text parts, got "
             f"{json.dumps(content)[:80]}.", param)


def _tool_call(call: Any, param: str) -> dict[str, Any]:
  """An OpenAI tool call, its JSON-string arguments decoded when they are JSON."""
  fn = call.get("function") if isinstance(call, dict) else None
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
    raise _bad("a tool call must be {\"type\": \"function\", \"function\": {\"name\", "
               f"\"arguments\"}}, got {json.dumps(call)[:80]}.", param)
  arguments = fn.get("arguments", {})
  if isinstance(arguments, str):
    with contextlib.suppress(json.JSONDecodeError):
      arguments = json.loads(arguments) if arguments.strip() else {}
  out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"],
                                                          "arguments": arguments}}
  if isinstance(call.get("id"), str):
    out["id"] = call["id"]
  return out


def normalize_message(message: Any, i: int) -> Message:
  """A chat message checked and reduced to what the chat formats read: ``role``,
  ``content`` (a string), and ``name`` / ``tool_call_id`` / ``tool_calls`` where given
  (a tool call's ``arguments`` decoded from its JSON string, as templates read them).

  Raises:
    ApiError: 400 naming ``messages[i]`` and the field.

  Examples:
    >>> normalize_message({"role": "assistant", "content": None, "tool_calls": [
    ...   {"id": "c1", "type": "function",
    ...    "function": {"name": "f", "arguments": '{"x": 1}'}}]}, 1)
    {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function',
     'function': {'name': 'f', 'arguments': {'x': 1}}, 'id': 'c1'}]}
    >>> normalize_message({"role": "robot", "content": "hi"}, 0)
    Traceback (most recent call last):
    ...
    jaxrl_llm.serve.protocol.ApiError: `messages[0].role` must be one of ['system',
    'developer', 'user', 'assistant', 'tool'], got "robot".
  """
  param = f"messages[{i}]"
  if not isinstance(message, dict):
    raise _bad(f"`{param}` must be an object, got {json.dumps(message)[:80]}.", param)
  role = message.get("role")
  if role not in ROLES:
    raise _bad(f"`{param}.role` must be one of {list(ROLES)}, got "
               f"{json.dumps(role)[:80]}.", f"{param}.role")
  if "content" not in message and not message.get("tool_calls"):
    raise _bad(f"`{param}` has no `content`.", f"{param}.content")
  out: Message = {"role": role, "content": _text(message.get("content"),
                                                 f"{param}.content")}
  for key in ("name", "tool_call_id"):
    if message.get(key) is not None:
      if not isinstance(message[key], str):
        raise _bad(f"`{param}.{key}` must be a string.", f"{param}.{key}")
      out[key] = message[key]
  calls = message.get("tool_calls")
  if calls:
    if role != "assistant" or not isinstance(calls, list):
      raise _bad(f"`{param}.tool_calls` must be a list, on an assistant message.",
                 f"{param}.tool_calls")
    out["tool_calls"] = [_tool_call(c, f"{param}.tool_calls[{k}]")
                         for k, c in enumerate(calls)]
  return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
  tools = body.get("tools")
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise _bad("`tools` must be a list of {\"type\": \"function\", \"function\": ...}.",
               "tools")
  for k, tool in enumerate(tools):
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise _bad(f"`tools[{k}]` must be {{\"type\": \"function\", \"function\": "
                 f"{{\"name\", ...}}}}, got {json.dumps(tool)[:80]}.", f"tools[{k}]")
  return tools or None


def parse_chat_request(body: Any, model_name: str) -> ChatRequest:
  """A ``/v1/chat/completions`` body checked (the module table).

  Raises:
    ApiError: 400 naming the field (404 for another model's name).
  """
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object.", None)
  check_model(body, model_name)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _bad("`messages` must be a non-empty list of messages.", "messages",
               "missing_required_parameter" if messages is None else "invalid_value")
  normalized = [normalize_message(m, i) for i, m in enumerate(messages)]
  top = _optional(body, "top_logprobs", lambda x: _is_int(x) and x >= 0,
                  "an integer >= 0")
  if top:
    raise _bad("`top_logprobs` > 0 is not supported: the backend returns the sampled "
               "token's log-prob only (use `logprobs: true`).", "top_logprobs",
               "unsupported_value")
  logprobs = _optional(body, "logprobs", lambda x: isinstance(x, bool), "a boolean")
  tools = _tools(body)
  choice = body.get("tool_choice")
  return ChatRequest(normalized, tools, tools is not None and choice != "none",
                     _sampling(body, logprobs=bool(logprobs)))


def _prompt(x: Any) -> bool:
  return (isinstance(x, str) and bool(x)) or (
      isinstance(x, list) and bool(x) and all(_is_int(i) and i >= 0 for i in x))


def parse_completion_request(body: Any, model_name: str) -> CompletionRequest:
  """A ``/v1/completions`` body checked (the module table).

  Raises:
    ApiError: 400 naming the field (404 for another model's name).

  Examples:
    >>> parse_completion_request({"prompt": [5, 6, 7]}, "m").prompts
    [[5, 6, 7]]
  """
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object.", None)
  check_model(body, model_name)
  prompt = body.get("prompt")
  prompts = [prompt] if isinstance(prompt, str) or (
      isinstance(prompt, list) and prompt and _is_int(prompt[0])) else prompt
  if not isinstance(prompts, list) or not prompts or not all(map(_prompt, prompts)):
    raise _bad("`prompt` must be a non-empty string, a non-empty list of token ids, or a "
               "list of either.", "prompt",
               "missing_required_parameter" if prompt is None else "invalid_value")
  logprobs = _optional(body, "logprobs", lambda x: _is_int(x) and x >= 0,
                       "an integer >= 0")
  if logprobs:
    raise _bad("`logprobs` > 0 is not supported: the backend returns the sampled "
               "token's log-prob only (use `logprobs: 0`).", "logprobs", "unsupported_value")
  for key in ("echo", "suffix"):
    if body.get(key):
      raise _bad(f"`{key}` is not supported.", key, "unsupported_value")
  return CompletionRequest(list(prompts), _sampling(body, logprobs=logprobs is not None))


# ------------------------------------------------------------------------ responses


@dataclasses.dataclass(frozen=True)
class Choice:
  """One finished sample, ready for the wire.

  Attributes:
    index: the choice's index in the response.
    token_ids: the sampled ids kept (all of them, or up to the token completing a stop
      string), the stop id included.
    logprobs: the backend's log-prob of each kept id.
    tokens: each kept id's text (its own decoding, or its token string when that is
      empty: a stop id).
    pieces: the text each kept id adds to ``text`` (they join to ``text``).
    text: the decoded text, cut before a stop string.
    content: the message content (``text``, or the text around tool calls; None when
      the calls are all there is).
    tool_calls: OpenAI tool calls (``{"id", "type": "function", "function": {"name",
      "arguments": JSON string}}``).
    finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"``.
  """

  index: int
  token_ids: list[int]
  logprobs: list[float]
  tokens: list[str]
  pieces: list[str]
  text: str
  content: str | None
  tool_calls: list[dict[str, Any]]
  finish_reason: str

  @property
  def message(self) -> dict[str, Any]:
    """The assistant message of a chat response."""
    out: dict[str, Any] = {"role": "assistant", "content": self.content}
    if self.tool_calls:
      out["tool_calls"] = self.tool_calls
    return out


def tool_calls_of(turn: ParsedTurn, call_id: Callable[[int], str]) -> list[dict[str, Any]]:
  """OpenAI tool calls of a parsed turn (``arguments`` a JSON string; ``call_id(k)``
  the id of call k).

  >>> from jaxrl_llm.envs.tools import parse_hermes
  >>> tool_calls_of(parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}'
  ...                            '</tool_call>'), lambda k: f"call_{k}")
  [{'id': 'call_0', 'type': 'function', 'function': {'name': 'f', 'arguments': '{"x": 1}'}}]
  """
  return [{"id": call_id(k), "type": "function",
           "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
          for k, c in enumerate(turn.calls)]


def _chat_logprobs(tokens: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
  return {"content": [{"token": t, "logprob": float(lp), "bytes": list(t.encode()),
                       "top_logprobs": []} for t, lp in zip(tokens, logprobs)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def chat_response(head: Mapping[str, Any], choices: Sequence[Choice],
                  prompt_ids: Sequence[int], sampling: Sampling) -> dict[str, Any]:
  """A ``chat.completion`` object (``head``: its ``id``, ``created``, ``model``)."""
  out = {**head, "object": "chat.completion", "choices": []}
  for c in choices:
    choice: dict[str, Any] = {"index": c.index, "message": c.message,
                              "logprobs": _chat_logprobs(c.tokens, c.logprobs)
                              if sampling.logprobs else None,
                              "finish_reason": c.finish_reason}
    if sampling.return_token_ids:
      choice["token_ids"] = list(c.token_ids)
    out["choices"].append(choice)
  out["usage"] = usage(len(prompt_ids), sum(len(c.token_ids) for c in choices))
  if sampling.return_token_ids:
    out["prompt_token_ids"] = list(prompt_ids)
  return out


def _chunk(head: Mapping[str, Any], obj: str, choice: dict[str, Any] | None,
           **extra: Any) -> dict[str, Any]:
  return {**head, "object": obj, "choices": [] if choice is None else [choice], **extra}


def _chat_deltas(c: Choice) -> Iterator[tuple[dict[str, Any], slice]]:
  """``(delta, ids)`` of each content chunk: a chunk per token, or one chunk with the
  content and the tool calls when there are calls."""
  if c.tool_calls:
    delta: dict[str, Any] = {"tool_calls": [{"index": k, **call}
                                            for k, call in enumerate(c.tool_calls)]}
    if c.content:
      delta = {"content": c.content, **delta}
    yield delta, slice(0, len(c.token_ids))
    return
  for k, piece in enumerate(c.pieces):
    yield {"content": piece}, slice(k, k + 1)


def chat_chunks(head: Mapping[str, Any], choices: Sequence[Choice],
                prompt_ids: Sequence[int], sampling: Sampling) -> Iterator[dict[str, Any]]:
  """The ``chat.completion.chunk`` objects of a streamed response, in order (the
  ``data: [DONE]`` line is the server's): per choice a role chunk (the first carries
  ``prompt_token_ids``), content chunks (each with its ``token_ids`` and log-probs), a
  finish chunk; then the usage chunk when asked for."""
  obj, ids = "chat.completion.chunk", sampling.return_token_ids
  for c in choices:
    first = {"prompt_token_ids": list(prompt_ids)} if ids and c.index == 0 else {}
    yield _chunk(head, obj, {"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}, **first)
    for delta, span in _chat_deltas(c):
      choice = {"index": c.index, "delta": delta,
                "logprobs": _chat_logprobs(c.tokens[span], c.logprobs[span])
                if sampling.logprobs else None, "finish_reason": None}
      if ids:
        choice["token_ids"] = c.token_ids[span]
      yield _chunk(head, obj, choice)
    yield _chunk(head, obj, {"index": c.index, "delta": {}, "logprobs": None,
                             "finish_reason": c.finish_reason})
  if sampling.include_usage:
    yield _chunk(head, obj, None, usage=usage(len(prompt_ids),
                                              sum(len(c.token_ids) for c in choices)))


def _completion_logprobs(c: Choice) -> dict[str, Any]:
  offsets, at = [], 0
  for piece in c.pieces:
    offsets.append(at)
    at += len(piece)
  return {"tokens": list(c.tokens), "token_logprobs": [float(x) for x in c.logprobs],
          "top_logprobs": None, "text_offset": offsets}


def completion_response(head: Mapping[str, Any], choices: Sequence[Choice],
                        prompts: Sequence[Sequence[int]], sampling: Sampling) -> dict[str, Any]:
  """A ``text_completion`` object. ``prompts``: each prompt's ids; choice ``i`` samples
  prompt ``i // n``. ``text_offset`` of the log-probs counts from the completion's
  start."""
  out: dict[str, Any] = {**head, "object": "text_completion", "choices": []}
  for c in choices:
    choice: dict[str, Any] = {"index": c.index, "text": c.text,
                              "logprobs": _completion_logprobs(c) if sampling.logprobs
                              else None, "finish_reason": c.finish_reason}
    if sampling.return_token_ids:
      choice.update(prompt_token_ids=list(prompts[c.index // sampling.n]),
                    token_ids=list(c.token_ids))
    out["choices"].append(choice)
  out["usage"] = usage(sum(len(p) for p in prompts), sum(len(c.token_ids) for c in choices))
  return out


def completion_chunks(head: Mapping[str, Any], choices: Sequence[Choice],
                      prompts: Sequence[Sequence[int]],
                      sampling: Sampling) -> Iterator[dict[str, Any]]:
  """The ``text_completion`` chunks of a streamed completion: one per token (the first
  of a choice carries ``prompt_token_ids``), a finish chunk per choice, the usage chunk
  when asked for."""
  ids, obj = sampling.return_token_ids, "text_completion"
  for c in choices:
    logprobs = _completion_logprobs(c)
    for k, piece in enumerate(c.pieces):
      choice: dict[str, Any] = {"index": c.index, "text": piece, "finish_reason": None,
                                "logprobs": {key: (None if v is None else v[k:k + 1])
                                             for key, v in logprobs.items()}
                                if sampling.logprobs else None}
      if ids:
        choice["token_ids"] = c.token_ids[k:k + 1]
        if k == 0:
          choice["prompt_token_ids"] = list(prompts[c.index // sampling.n])
      yield _chunk(head, obj, choice)
    yield _chunk(head, obj, {"index": c.index, "text": "", "logprobs": None,
                             "finish_reason": c.finish_reason})
  if sampling.include_usage:
    yield _chunk(head, obj, None, usage=usage(sum(len(p) for p in prompts),
                                              sum(len(c.token_ids) for c in choices)))


def sse(obj: Any) -> bytes:
  """One server-sent event line of ``obj`` (``"[DONE]"`` as is).

  >>> sse("[DONE]")
  b'data: [DONE]\\n\\n'
  """
  text = obj if isinstance(obj, str) else json.dumps(obj)
  return f"data: {text}\n\n".encode()


__all__ = ["ApiError", "ChatRequest", "Choice", "CompletionRequest", "MAX_CHOICES", "ROLES",
           "Sampling", "chat_chunks", "chat_response", "check_model", "completion_chunks",
           "completion_response", "normalize_message", "parse_chat_request",
           "parse_completion_request", "sse", "tool_calls_of", "usage"]
