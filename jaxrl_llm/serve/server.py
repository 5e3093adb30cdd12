"""The HTTP server: OpenAI's endpoints over a generation backend, every call recorded.

:func:`serve` starts a :class:`Server` (standard library ``http.server``, one thread
per connection) on ``127.0.0.1`` unless ``host`` says otherwise (``host="0.0.0.0"``
listens on every interface: anyone who reaches the port can generate, there is no
authentication). Endpoints:

=============================  =======================================================
``POST /v1/chat/completions``  messages rendered by the chat format (a continued
                               conversation reuses its exact ids:
                               :mod:`jaxrl_llm.serve.recorder`), tool calls parsed
                               by the tool parser, streaming, log-probs, token ids
``POST /v1/completions``       a prompt string or token ids
``GET /v1/models``             the served model
=============================  =======================================================

A request is checked (:mod:`jaxrl_llm.serve.protocol`), its prompt built, its prompts
batched with other requests' into one backend call (:mod:`jaxrl_llm.serve.batcher`),
each choice decoded (cut at a stop string, tool calls parsed) and recorded, and the
response written. A malformed request gets a 4xx with OpenAI's JSON error body; a
backend failure a 500 with one; an unexpected exception in a handler a 500 too: the
server keeps serving. :meth:`Server.close` (or leaving the ``with`` block) stops
accepting, waits for the backend call in flight, and frees the port.

Examples:
  >>> import json, urllib.request
  >>> from jaxrl_llm.envs import CHAT_CHARS, PlainChat
  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> chat = PlainChat(CharTokenizer(CHAT_CHARS))
  >>> def generate(prompts, limits):                 # a fake backend: "ok" then eos
  ...   ids = chat.tokenizer.encode("ok") + [chat.eos_id]
  ...   return [(ids, [-0.5] * 3) for _ in prompts]
  >>> with serve(generate, chat, max_len=64, model_name="tiny") as server:
  ...   body = json.dumps({"model": "tiny", "messages": [{"role": "user",
  ...                      "content": "hi"}]}).encode()
  ...   request = urllib.request.Request(server.base_url + "/chat/completions", body)
  ...   out = json.load(urllib.request.urlopen(request))
  ...   [ep] = server.recorder.take()
  >>> out["choices"][0]["message"], out["choices"][0]["token_ids"], out["usage"]
  ({'role': 'assistant', 'content': 'ok'}, [35, 31, 2],
   {'prompt_tokens': 7, 'completion_tokens': 3, 'total_tokens': 10})
  >>> ep.tokens.tolist() == out["prompt_token_ids"] + out["choices"][0]["token_ids"]
  True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jaxrl_llm.envs.chat import ChatFormat, chat_format
from jaxrl_llm.envs.tools import ParsedTurn, get_tool_parser
from jaxrl_llm.serve.batcher import BackendError, Batcher
from jaxrl_llm.serve.protocol import (
    ApiError,
    ChatRequest,
    Choice,
    CompletionRequest,
    Sampling,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    normalize_message,
    parse_chat_request,
    parse_completion_request,
    sse,
    tool_calls_of,
)
from jaxrl_llm.serve.recorder import Prefix, Recorder, chat_key

DEFAULT_HOST = "127.0.0.1"
"""Where the server listens unless told otherwise (this machine only)."""

MAX_BODY = 32 * 2**20
"""The largest request body accepted (bytes); a larger one gets 413."""


# ---------------------------------------------------------------------- decoding


def _cut_at_stop(decode: Callable[[Sequence[int]], str], ids: list[int],
                 stop: Sequence[str]) -> tuple[int, str] | None:
  """``(k, text)``: the first ``k`` ids decode to a text holding a stop string, ``text``
  the part before it; None when no stop string occurs."""
  if not stop or not any(s in decode(ids) for s in stop):
    return None
  for k in range(1, len(ids) + 1):
    text = decode(ids[:k])
    hits = [text.index(s) for s in stop if s in text]
    if hits:
      return k, text[:min(hits)]
  return None


def token_texts(decode: Callable[[Sequence[int]], str], to_token: Callable[[int], str] | None,
                ids: Sequence[int], text: str) -> tuple[list[str], list[str]]:
  """``(tokens, pieces)``: each id's own text (its decoding, or its token string when
  that is empty), and the part of ``text`` each id adds (pieces join to ``text``: the
  prefix decodings, an incomplete character held back until it completes).

  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> tok = CharTokenizer()
  >>> token_texts(tok.decode, tok.id_to_token, [4, 5, 2], "12")
  (['1', '2', '<eos>'], ['1', '2', ''])
  """
  tokens = []
  for i in ids:
    own = decode([i])
    tokens.append(own if own or to_token is None else to_token(int(i)))
  pieces, done = [], 0
  for k in range(len(ids)):
    prefix = decode(list(ids[:k + 1]))
    end = done if prefix.endswith("\ufffd") else max(done, min(len(prefix), len(text)))
    pieces.append(text[done:end])
    done = end
  if pieces:
    pieces[-1] += text[done:]
  return tokens, pieces


@dataclasses.dataclass(frozen=True)
class _Decoder:
  """Turns one sampled turn into a :class:`~jaxrl_llm.serve.protocol.Choice`."""

  chat: ChatFormat
  parser: Callable[[str], ParsedTurn] | None

  def choice(self, index: int, ids: list[int], logprobs: list[float], *, limit: int,
             stop: Sequence[str], parse_tools: bool,
             call_id: Callable[[int], str]) -> Choice:
    decode = self.chat.decode
    cut = _cut_at_stop(decode, ids, stop)
    if cut is not None:
      k, text = cut
      ids, logprobs, finish = ids[:k], logprobs[:k], "stop"
    else:
      text = decode(ids)
      finish = ("stop" if ids[-1] in self.chat.stop_ids or len(ids) < limit
                else "length")
    content: str | None = text
    calls: list[dict[str, Any]] = []
    if parse_tools and self.parser is not None:
      turn = self.parser(text)
      if turn.calls:
        content, calls = turn.content or None, tool_calls_of(turn, call_id)
        finish = "tool_calls" if finish != "length" else finish
    to_token = getattr(getattr(self.chat, "tokenizer", None), "id_to_token", None)
    tokens, pieces = token_texts(decode, to_token, ids, text)
    return Choice(index, ids, logprobs, tokens, pieces, text, content, calls, finish)


# ---------------------------------------------------------------------- the app


@dataclasses.dataclass
class _Reply:
  """What the HTTP handler writes: a JSON body, or a stream of server-sent events."""

  status: int = 200
  body: Any = None
  events: Iterator[bytes] | None = None


class App:
  """The endpoints, apart from HTTP: ``handle(method, path, body) -> _Reply``.

  Args: as :func:`serve`'s.
  """

  def __init__(self, generate: Callable[..., Any], chat: Any, *, max_len: int,
               model_name: str = "jaxrl-llm", tool_parser: str | None = "hermes",
               default_max_tokens: int | None = None, max_wait: float = 0.005,
               max_batch: int = 64, recorder: Recorder | None = None) -> None:
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 2:
      raise ValueError(f"`max_len` must be an int >= 2 (the backend's context), got "
                       f"{max_len!r}.")
    if default_max_tokens is not None and (not isinstance(default_max_tokens, int)
                                           or default_max_tokens < 1):
      raise ValueError(f"`default_max_tokens` must be None or an int >= 1, got "
                       f"{default_max_tokens!r}.")
    if not isinstance(model_name, str) or not model_name:
      raise ValueError(f"`model_name` must be a non-empty str, got {model_name!r}.")
    self.chat = chat_format(chat)
    self.max_len, self.model_name = max_len, model_name
    self.default_max_tokens = default_max_tokens
    self.decoder = _Decoder(self.chat, None if tool_parser is None
                            else get_tool_parser(tool_parser))
    self.recorder = recorder if recorder is not None else Recorder(self.chat,
                                                                   name=model_name)
    self.batcher = Batcher(generate, max_wait=max_wait, max_batch=max_batch)
    self._ids = itertools.count()
    self.created = int(time.time())
    self.routes: dict[tuple[str, str], Callable[[Any], _Reply]] = {
        ("POST", "/v1/chat/completions"): self.chat_completions,
        ("POST", "/v1/completions"): self.completions,
        ("GET", "/v1/models"): self.models,
    }

  def handle(self, method: str, path: str, read_body: Callable[[], bytes]) -> _Reply:
    """Routes a request; every failure becomes a JSON error reply."""
    path = path.split("?", 1)[0].rstrip("/") or "/"
    route = self.routes.get((method, path))
    try:
      if route is None:
        if any(p == path for _, p in self.routes):
          allowed = sorted(m for m, p in self.routes if p == path)
          raise ApiError(405, f"{method} is not allowed on {path}; use {allowed}.",
                         code="method_not_allowed")
        raise ApiError(404, f"no endpoint {method} {path}; this server has "
                       f"{sorted(p for _, p in self.routes)}.", code="not_found")
      if method != "POST":
        return route(None)
      raw = read_body()
      try:
        body = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}.",
                       code="invalid_json") from None
      return route(body)
    except ApiError as e:
      return _Reply(e.status, e.body())
    except BackendError as e:
      return _Reply(500, ApiError(500, str(e), code="backend_error").body())
    except Exception as e:   # noqa: BLE001 - a bug in a handler: a 500, never a dead server
      return _Reply(500, ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                  code="internal_error").body())

  def models(self, _: Any) -> _Reply:
    return _Reply(body={"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": self.created,
         "owned_by": "jaxrl_llm", "max_model_len": self.max_len}]})

  def _head(self, prefix: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{next(self._ids)}", "created": int(time.time()),
            "model": self.model_name}

  def _limit(self, prompt_ids: Sequence[int], sampling: Sampling) -> int:
    room = self.max_len - len(prompt_ids)
    if room < 1:
      raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens; "
                     f"the prompt is {len(prompt_ids)} tokens, which leaves no room to "
                     "generate.", param="messages", code="context_length_exceeded")
    if sampling.max_tokens is None:
      return room if self.default_max_tokens is None else min(room,
                                                               self.default_max_tokens)
    if sampling.max_tokens > room:
      raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens; "
                     f"the prompt is {len(prompt_ids)} tokens and max_tokens is "
                     f"{sampling.max_tokens} ({len(prompt_ids) + sampling.max_tokens} in "
                     "all).", param="max_tokens", code="context_length_exceeded")
    return sampling.max_tokens

  def _generate(self, prefixes: Sequence[Prefix], sampling: Sampling) -> list[tuple[
      Prefix, int, list[int], list[float]]]:
    """``(prefix, limit, ids, logprobs)`` of each choice: ``n`` per prefix."""
    limits = [self._limit(p.prompt_ids, sampling) for p in prefixes]
    jobs = [(p, m) for p, m in zip(prefixes, limits) for _ in range(sampling.n)]
    outs = self.batcher.submit([p.prompt_ids for p, _ in jobs], [m for _, m in jobs],
                               [sampling.overrides()] * len(jobs))
    return [(p, m, ids, lp) for (p, m), (ids, lp) in zip(jobs, outs)]

  def _info(self, head: dict[str, Any], index: int, sampling: Sampling) -> dict[str, Any]:
    return {"id": head["id"], "choice": index, **sampling.overrides()}

  def chat_completions(self, body: Any) -> _Reply:
    req: ChatRequest = parse_chat_request(body, self.model_name)
    try:
      prefix = self.recorder.chat_prefix(req.messages, req.tools)
    except ValueError as e:
      raise ApiError(400, f"the messages cannot be rendered: {e}",
                     param="messages") from None
    head = self._head("chatcmpl")
    key = chat_key(req.tools, req.messages)
    choices = []
    for index, (_, limit, ids, logprobs) in enumerate(self._generate([prefix], req.sampling)):
      c = self.decoder.choice(index, ids, logprobs, limit=limit, stop=req.sampling.stop,
                              parse_tools=req.parse_tools,
                              call_id=functools.partial(_call_id, head["id"], index))
      self.recorder.record(prefix, c.token_ids, c.logprobs, messages=req.messages,
                           reply=normalize_message(c.message, 0), key=key,
                           finish_reason=c.finish_reason,
                           info={**self._info(head, index, req.sampling),
                                 "finish_reason": c.finish_reason})
      choices.append(c)
    if req.sampling.stream:
      return _Reply(events=_events(chat_chunks(head, choices, prefix.prompt_ids,
                                               req.sampling)))
    return _Reply(body=chat_response(head, choices, prefix.prompt_ids, req.sampling))

  def _completion_prefix(self, prompt: str | list[int]) -> Prefix:
    if not isinstance(prompt, str):
      return self.recorder.ids_prefix(prompt)
    try:
      return self.recorder.text_prefix(prompt)
    except ValueError as e:
      raise ApiError(400, f"the prompt cannot be encoded: {e}", param="prompt") from None

  def completions(self, body: Any) -> _Reply:
    req: CompletionRequest = parse_completion_request(body, self.model_name)
    prefixes = [self._completion_prefix(p) for p in req.prompts]
    head = self._head("cmpl")
    choices = []
    for index, (prefix, limit, ids, logprobs) in enumerate(
        self._generate(prefixes, req.sampling)):
      c = self.decoder.choice(index, ids, logprobs, limit=limit, stop=req.sampling.stop,
                              parse_tools=False, call_id=str)
      prompt = req.prompts[index // req.sampling.n]
      text = prompt + c.text if isinstance(prompt, str) else None
      shown = prompt if isinstance(prompt, str) else self.chat.decode(prompt)
      self.recorder.record(prefix, c.token_ids, c.logprobs, text=text,
                           messages=[{"role": "prompt", "content": shown}],
                           reply={"role": "completion", "content": c.text},
                           finish_reason=c.finish_reason,
                           info={**self._info(head, index, req.sampling),
                                 "finish_reason": c.finish_reason})
      choices.append(c)
    prompts = [p.prompt_ids for p in prefixes]
    if req.sampling.stream:
      return _Reply(events=_events(completion_chunks(head, choices, prompts, req.sampling)))
    return _Reply(body=completion_response(head, choices, prompts, req.sampling))

  def close(self) -> None:
    self.batcher.close()


def _call_id(response: str, choice: int, k: int) -> str:
  """The id of tool call ``k`` of a response's choice (unique in this server's life)."""
  return f"call_{response}_{choice}_{k}"


def _events(chunks: Iterator[dict[str, Any]]) -> Iterator[bytes]:
  for chunk in chunks:
    yield sse(chunk)
  yield sse("[DONE]")


# ---------------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
  """One HTTP request: read, ``App.handle``, write (JSON or server-sent events)."""

  server: _HTTPServer
  protocol_version = "HTTP/1.0"
  server_version = "jaxrl-llm"

  def log_message(self, format: str, *args: Any) -> None:
    pass

  def _read_body(self) -> bytes:
    length = self.headers.get("Content-Length")
    if length is None or not length.strip().isdigit():
      raise ApiError(411, "a request body needs a Content-Length header.",
                     code="length_required")
    if int(length) > MAX_BODY:
      raise ApiError(413, f"the request body is {int(length)} bytes; the most is "
                     f"{MAX_BODY}.", code="body_too_large")
    return self.rfile.read(int(length))

  def _serve(self, method: str) -> None:
    reply = self.server.app.handle(method, self.path, self._read_body)
    if reply.events is not None:
      self.send_response(reply.status)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.end_headers()
      try:
        for event in reply.events:
          self.wfile.write(event)
          self.wfile.flush()
      except (BrokenPipeError, ConnectionResetError):
        pass                       # the client left; the call is recorded already
      return
    self._send_json(reply.status, reply.body)

  def _send_json(self, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    try:
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
      pass

  def send_error(self, code: int, message: str | None = None,
                 explain: str | None = None) -> None:
    """The base class's errors as JSON: a malformed request line (400), a method with
    no handler (the base's 501, answered 405: the method is not allowed here)."""
    self.close_connection = True
    if self.request_version == "HTTP/0.9":    # an unreadable request line: answer as 1.0
      self.request_version = "HTTP/1.0"
    if code == 501:
      code, message = 405, f"the method {self.command!r} is not allowed."
    self._send_json(code, ApiError(code, message or explain or "bad request",
                                   code="bad_request").body())

  def do_GET(self) -> None:
    self._serve("GET")

  def do_POST(self) -> None:
    self._serve("POST")

  def do_PUT(self) -> None:
    self._serve("PUT")

  def do_DELETE(self) -> None:
    self._serve("DELETE")

  def do_PATCH(self) -> None:
    self._serve("PATCH")


class _HTTPServer(ThreadingHTTPServer):
  daemon_threads = True
  app: App


class Server:
  """A running endpoint (start it with :func:`serve`).

  Attributes:
    host, port: where it listens (``port`` the bound one when 0 was asked for).
    url: ``http://host:port``; base_url: ``url + "/v1"`` (the ``openai`` client's
      ``base_url``).
    app: the endpoints; recorder: its :class:`~jaxrl_llm.serve.recorder.Recorder`
      (``recorder.take()`` returns the trajectories); batcher: its
      :class:`~jaxrl_llm.serve.batcher.Batcher`.
  """

  def __init__(self, app: App, *, host: str = DEFAULT_HOST, port: int = 0) -> None:
    self.app = app
    try:
      if not isinstance(host, str) or not host:
        raise ValueError(f"`host` must be a non-empty str, got {host!r}.")
      if not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"`port` must be an int in [0, 65535], got {port!r}.")
      self._http = _HTTPServer((host, port), _Handler)
    except BaseException:
      app.close()                 # no server: its batcher's thread stops too
      raise
    self._http.app = app
    self.host, self.port = host, int(self._http.server_address[1])
    self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,),
                                    name="jaxrl-llm-serve", daemon=True)
    self._thread.start()
    self._closed = False

  @property
  def url(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"http://{host}:{self.port}"

  @property
  def base_url(self) -> str:
    return self.url + "/v1"

  @property
  def recorder(self) -> Recorder:
    return self.app.recorder

  @property
  def batcher(self) -> Batcher:
    return self.app.batcher

  def close(self) -> None:
    """Stops serving: no new connections, the backend call in flight finishes, the port
    is freed. Idempotent."""
    if self._closed:
      return
    self._closed = True
    self._http.shutdown()
    self._thread.join()
    self.app.close()
    self._http.server_close()

  def __enter__(self) -> Server:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def serve(generate: Callable[..., Any], chat: Any, *, max_len: int,
          host: str = DEFAULT_HOST, port: int = 0, model_name: str = "jaxrl-llm",
          tool_parser: str | None = "hermes", default_max_tokens: int | None = None,
          max_wait: float = 0.005, max_batch: int = 64,
          recorder: Recorder | None = None) -> Server:
  """Starts an OpenAI-compatible endpoint over ``generate`` (the module docstring).

  Args:
    generate: the backend, ``generate(prompts, max_new_tokens) -> [(sampled_ids,
      sampled_logprobs), ...]`` (:data:`~jaxrl_llm.rollout.multiturn.Generate`;
      :func:`~jaxrl_llm.rollout.multiturn.engine_generate` over a
      :class:`~jaxrl_llm.rollout.RolloutEngine`), stopping at the chat format's stop
      ids. Called from one worker thread only.
    chat: the :class:`~jaxrl_llm.envs.chat.ChatFormat` (or a tokenizer:
      :func:`~jaxrl_llm.envs.chat.chat_format` of it).
    max_len: the backend's context (prompt + new tokens; the engine's ``max_len``).
    host: the address to listen on; ``127.0.0.1`` (this machine only) unless told
      otherwise (``"0.0.0.0"``: every interface, no authentication).
    port: the port (0: any free one; read it from ``Server.port``).
    model_name: the model's name in ``/v1/models`` and the requests' ``model``.
    tool_parser: a name of :data:`~jaxrl_llm.envs.tools.TOOL_PARSERS` (``"hermes"``
      for Qwen2.5 / Qwen3, ``"llama3_json"`` for Llama 3.1), or None (no tool calls
      parsed).
    default_max_tokens: the most new tokens of a request that does not say (None:
      what is left of the context).
    max_wait: the most seconds a request waits for others to share its backend call.
    max_batch: the most requests in one backend call.
    recorder: where calls are recorded (default: a new
      :class:`~jaxrl_llm.serve.recorder.Recorder`).

  Returns:
    The running :class:`Server` (``close()`` it, or use it as a context manager).

  Raises:
    ValueError: a bad argument (naming it); OSError: the port is taken.
  """
  app = App(generate, chat, max_len=max_len, model_name=model_name, tool_parser=tool_parser,
            default_max_tokens=default_max_tokens, max_wait=max_wait, max_batch=max_batch,
            recorder=recorder)
  return Server(app, host=host, port=port)


__all__ = ["App", "DEFAULT_HOST", "MAX_BODY", "Server", "serve", "token_texts"]
