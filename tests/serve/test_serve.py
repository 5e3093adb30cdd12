"""The OpenAI-compatible endpoint (jaxrl_llm.serve): the real ``openai`` client gets text,
tool calls, streamed chunks and token ids; a multi-call agent's recorded trajectory is
what the backend sampled, bit for bit, chained token in / token out (and, with the
built-in model, its behaviour log-probs equal teacher-forced ones); malformed requests
get 4xx JSON errors and the server goes on; a backend failure is a 500; concurrent
agents share one backend call per round; the server binds 127.0.0.1 by default.

Protocol tests drive a fake deterministic backend over the built-in character format
(PlainChat); the Qwen3 tool-call test uses the real Qwen3 template (tests/test_multiturn
's tiny BPE, skipped without trl)."""

from __future__ import annotations

import inspect
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from jaxrl_llm.envs import CHAT_CHARS, PlainChat
from jaxrl_llm.rollout.multiturn import episodes_to_batch
from jaxrl_llm.serve import BackendError, Recorder, serve
from jaxrl_llm.serve.protocol import ApiError
from jaxrl_llm.tasks.tokenizer import CharTokenizer

CHAR = PlainChat(CharTokenizer(CHAT_CHARS))
TOK = CHAR.tokenizer
MODEL = "tiny"
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class Fake:
  """A deterministic backend: prompt p's turn is ``script(p)`` (ids; cut at the limit),
  log-prob of its j-th id ``-0.125 (j + 1) - 0.5 c`` in call c. Records every call's
  prompts, limits and sampling, and what it returned."""

  def __init__(self, script, *, fail=None):
    self.script, self.fail = script, fail
    self.calls = []

  def __call__(self, prompts, limits, sampling=None):
    if self.fail is not None and self.fail(prompts):
      raise RuntimeError("the backend broke")
    c = len(self.calls)
    out = []
    for p, m in zip(prompts, limits):
      ids = list(self.script(p))[:m]
      out.append((ids, [-0.125 * (j + 1) - 0.5 * c for j in range(len(ids))]))
    self.calls.append({"prompts": [list(p) for p in prompts], "limits": list(limits),
                       "sampling": sampling, "out": out})
    return out


def says(text):
  """A script that answers ``text`` then the stop id, whatever the prompt."""
  return lambda prompt: TOK.encode(text) + [TOK.eos_id]


def client(server):
  openai = pytest.importorskip("openai", reason="the endpoint's client tests need the "
                               "openai package (pip install openai; in the test extra)")
  return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def post(server, path, body, *, raw=False):
  """``(status, JSON body)`` of a POST (``raw``: body bytes sent as they are)."""
  data = body if raw else json.dumps(body).encode()
  request = urllib.request.Request(server.url + path, data,
                                   {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request) as r:
      return r.status, json.load(r)
  except urllib.error.HTTPError as e:
    return e.code, json.load(e)


def text_of(ids):
  return "".join(TOK.id_to_token(i) for i in ids)


# ------------------------------------------------------------------------ protocol


def test_the_openai_client_gets_text_logprobs_usage_and_token_ids():
  fake = Fake(says("ok"))
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
  with serve(fake, CHAR, max_len=64, model_name=MODEL) as server:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                  logprobs=True, n=2, temperature=0.5)
    assert [m.id for m in c.models.list().data] == [MODEL]
  prompt = CHAR.prompt_ids(messages)
  assert text_of(prompt) == "s:be brief<eos>u:hi<eos>a:"
  assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 2
  for k, choice in enumerate(r.choices):
    assert choice.index == k and choice.finish_reason == "stop"
    assert (choice.message.role, choice.message.content) == ("assistant", "ok")
    assert choice.token_ids == TOK.encode("ok") + [TOK.eos_id]
    assert [(t.token, t.logprob) for t in choice.logprobs.content] == [
        ("o", -0.125), ("k", -0.25), ("<eos>", -0.375)]
    assert choice.logprobs.content[0].bytes == [111]
  assert r.prompt_token_ids == prompt
  assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
      len(prompt), 6, len(prompt) + 6)
  # one backend call, n prompts, the request's max_tokens and temperature
  [call] = fake.calls
  assert call["prompts"] == [prompt, prompt] and call["limits"] == [5, 5]
  assert call["sampling"] == [{"temperature": 0.5}] * 2


def test_max_tokens_cuts_a_turn_and_defaults_to_the_rest_of_the_context():
  fake = Fake(says("abcdefgh"))
  with serve(fake, CHAR, max_len=20, model_name=MODEL) as server:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                  max_completion_tokens=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("abc", "length")
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
  assert fake.calls[1]["limits"] == [20 - len(CHAR.prompt_ids([{"role": "user",
                                                               "content": "x"}]))]
  assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "abcdefgh"


def test_tool_calls_are_parsed_into_openai_tool_calls():
  fake = Fake(lambda p: TOK.encode("sure " + CALL_TEXT) + [TOK.eos_id])
  with serve(fake, CHAR, max_len=256, model_name=MODEL) as server:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, tools=[ADD_TOOL],
                                  messages=[{"role": "user", "content": "2+3?"}])
    plain = c.chat.completions.create(model=MODEL, tools=[ADD_TOOL], tool_choice="none",
                                      messages=[{"role": "user", "content": "2+3?"}])
  choice = r.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content == "sure"
  [call] = choice.message.tool_calls
  assert (call.type, call.function.name) == ("function", "add")
  assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
  assert call.id.startswith("call_")
  # the tools were rendered into the prompt (PlainChat's tool line)
  assert text_of(r.prompt_token_ids).startswith("s:tools: add(a, b)<eos>u:2+3?")
  assert plain.choices[0].message.tool_calls is None
  assert plain.choices[0].message.content == "sure " + CALL_TEXT


def test_streamed_chunks_add_up_to_the_response():
  fake = Fake(says("hey you"))
  messages = [{"role": "user", "content": "hi"}]
  with serve(fake, CHAR, max_len=64, model_name=MODEL) as server:
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=messages, logprobs=True)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    request = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(
        {"messages": messages, "stream": True}).encode())
    with urllib.request.urlopen(request) as r:
      assert r.headers["Content-Type"] == "text/event-stream"
      raw = r.read().decode()
  assert all(k.object == "chat.completion.chunk" for k in chunks)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[0].prompt_token_ids == whole.prompt_token_ids
  body = [k for k in chunks if k.choices and k.choices[0].finish_reason is None][1:]
  assert "".join(k.choices[0].delta.content for k in body) == "hey you"
  assert [i for k in body for i in k.choices[0].token_ids] == whole.choices[0].token_ids
  assert [t.logprob for k in body for t in k.choices[0].logprobs.content] == (
      fake.calls[1]["out"][0][1])
  assert [k.choices[0].finish_reason for k in chunks if k.choices][-1] == "stop"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
  events = [line for line in raw.split("\n\n") if line]
  assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_streamed_tool_calls():
  fake = Fake(lambda p: TOK.encode(CALL_TEXT) + [TOK.eos_id])
  with serve(fake, CHAR, max_len=256, model_name=MODEL) as server:
    chunks = list(client(server).chat.completions.create(
        model=MODEL, tools=[ADD_TOOL], messages=[{"role": "user", "content": "2+3?"}],
        stream=True))
  [calls] = [k.choices[0].delta.tool_calls for k in chunks if k.choices[0].delta.tool_calls]
  assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
      (0, "add", {"a": 2, "b": 3})]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  assert [i for k in chunks for i in (getattr(k.choices[0], "token_ids", None) or [])] == (
      TOK.encode(CALL_TEXT) + [TOK.eos_id])


def test_completions_from_text_and_token_ids_with_streaming():
  fake = Fake(says("42"))
  with serve(fake, CHAR, max_len=64, model_name=MODEL) as server:
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="6*7=", max_tokens=4, logprobs=0)
    ids = c.completions.create(model=MODEL, prompt=TOK.encode("6*7="), max_tokens=4)
    chunks = list(c.completions.create(model=MODEL, prompt="6*7=", max_tokens=4,
                                       stream=True))
    batch = c.completions.create(model=MODEL, prompt=["1", "2"], n=2, max_tokens=4)
  for out in (r, ids):
    assert out.object == "text_completion" and out.choices[0].text == "42"
    assert out.choices[0].prompt_token_ids == TOK.encode("6*7=")
    assert out.choices[0].token_ids == TOK.encode("42") + [TOK.eos_id]
  lp = r.choices[0].logprobs
  assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (
      ["4", "2", "<eos>"], [-0.125, -0.25, -0.375], [0, 1, 2])
  assert "".join(k.choices[0].text for k in chunks) == "42"
  assert chunks[0].choices[0].prompt_token_ids == TOK.encode("6*7=")
  assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
  assert [ch.prompt_token_ids for ch in batch.choices] == [TOK.encode("1")] * 2 + [
      TOK.encode("2")] * 2
  assert batch.usage.prompt_tokens == 2


def test_a_stop_string_cuts_the_text_and_the_recorded_ids():
  fake = Fake(says("hello world"))
  with serve(fake, CHAR, max_len=64, model_name=MODEL) as server:
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=["wor", "xyz"])
    [ep] = server.recorder.take()
  assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("hello ", "stop")
  assert r.choices[0].token_ids == TOK.encode("hello wor")
  assert ep.tokens[ep.turn_spans[0][0]:].tolist() == TOK.encode("hello wor")


# ----------------------------------------------------------- recording, TITO chaining


def agent(c, first, replies, **kw):
  """A 3-call agent: sends the conversation back with each reply as text (the assistant
  message as the client returned it) and a user turn after it."""
  messages = [{"role": "user", "content": first}]
  responses = []
  for reply in [*replies, None]:
    r = c.chat.completions.create(model=MODEL, messages=messages, **kw)
    responses.append(r)
    if reply is not None:
      messages += [r.choices[0].message, {"role": "user", "content": reply}]
  return responses


def test_a_three_call_agent_is_one_trajectory_of_the_sampled_ids_bit_for_bit():
  # turn 1 holds a bos id (1) that decoding drops: its text re-encoded would lose it
  turns = [TOK.encode("ab") + [TOK.bos_id] + TOK.encode("c") + [TOK.eos_id],
           TOK.encode("defgh"),                           # cut by max_tokens=5: no stop
           TOK.encode("z") + [TOK.eos_id]]
  fake = Fake(lambda p: turns[len(fake.calls)])
  with serve(fake, CHAR, max_len=128, model_name=MODEL) as server:
    responses = agent(client(server), "go", ["n1", "n2"], max_tokens=5)
    [ep] = server.recorder.take()
    stats = server.recorder.stats()
  assert responses[0].choices[0].message.content == "abc"
  assert TOK.encode("abc") != turns[0][:-1]
  sampled = [call["out"][0][0] for call in fake.calls]
  assert sampled == turns
  opening = CHAR.prompt_ids([{"role": "user", "content": "go"}])
  want = (opening + turns[0] + CHAR.continuation_ids([{"role": "user", "content": "n1"}],
                                                     turns[0])
          + turns[1] + CHAR.continuation_ids([{"role": "user", "content": "n2"}], turns[1])
          + turns[2])
  assert ep.tokens.tolist() == want
  assert text_of(want) == ("u:go<eos>a:ab<bos>c<eos>u:n1<eos>a:defgh<eos>u:n2<eos>a:z"
                           "<eos>")
  # each call's prompt was the trajectory so far, exactly (what the backend was given)
  for call, r in zip(fake.calls, responses):
    assert call["prompts"][0] == r.prompt_token_ids == want[:len(r.prompt_token_ids)]
  spans = ep.turn_spans
  assert [ep.tokens[s:e].tolist() for s, e in spans] == turns
  mask = np.zeros(len(want), np.int32)
  logp = np.zeros(len(want), np.float32)
  for c, (s, e) in enumerate(spans):
    mask[s:e] = 1
    logp[s:e] = fake.calls[c]["out"][0][1]
  np.testing.assert_array_equal(ep.loss_mask, mask)
  np.testing.assert_array_equal(ep.behaviour_logprobs, logp)
  assert (ep.turns, ep.prompt_len, ep.finish_reason) == (3, len(opening), "done")
  assert [m["content"] for m in ep.messages] == ["go", "abc", "n1", "defgh", "n2", "z"]
  assert [i["reused_ids"] for i in ep.infos] == [0, spans[0][1], spans[1][1]]
  assert stats == {"calls": 3, "continued": 2, "restarted": 0, "taken": 1}
  batch = episodes_to_batch([ep], pad_id=TOK.pad_id, group_size=1)
  assert batch["tokens"][0].tolist() == want and batch["loss_mask"][0].tolist() == list(mask)


def test_an_edited_history_starts_a_new_trajectory_and_is_counted():
  fake = Fake(says("ok"))
  with serve(fake, CHAR, max_len=128, model_name=MODEL) as server:
    c = client(server)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "OK!"},
              {"role": "user", "content": "and?"}]
    r = c.chat.completions.create(model=MODEL, messages=edited)
    eps = server.recorder.take()
    assert server.recorder.stats()["restarted"] == 1
  assert r.prompt_token_ids == CHAR.prompt_ids(edited)      # rendered fresh
  assert [e.turns for e in eps] == [1, 1]


def test_branches_give_one_episode_each_and_take_clears():
  fake = Fake(says("ok"))
  with serve(fake, CHAR, max_len=128, model_name=MODEL) as server:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}])
    history = [{"role": "user", "content": "a"}, r.choices[0].message]
    for follow in ("b", "c"):
      c.chat.completions.create(model=MODEL,
                                messages=history + [{"role": "user", "content": follow}])
    eps = server.recorder.take()
    assert server.recorder.take() == []
    # continued after its chain was taken: the taken ids stay as the prompt (mask 0)
    r2 = c.chat.completions.create(model=MODEL,
                                   messages=history + [{"role": "user", "content": "b"}])
    [late] = server.recorder.take()
  assert [(e.turns, text_of(e.tokens)) for e in eps] == [
      (2, "u:a<eos>a:ok<eos>u:b<eos>a:ok<eos>"), (2, "u:a<eos>a:ok<eos>u:c<eos>a:ok<eos>")]
  assert late.tokens[:late.prompt_len].tolist() == r2.prompt_token_ids
  assert late.turn_spans == [(len(r2.prompt_token_ids), len(late.tokens))]


def test_completions_chain_on_ids_and_on_text():
  fake = Fake(says("12"))
  with serve(fake, CHAR, max_len=128, model_name=MODEL) as server:
    c = client(server)
    first = c.completions.create(model=MODEL, prompt="1+2", max_tokens=2)   # cut: "12"
    ids = first.choices[0].prompt_token_ids + first.choices[0].token_ids
    c.completions.create(model=MODEL, prompt=ids + TOK.encode("+"), max_tokens=3)
    c.completions.create(model=MODEL, prompt="9", max_tokens=2)
    c.completions.create(model=MODEL, prompt="9" + "12" + "=", max_tokens=2)
    eps = server.recorder.take()
  assert [(e.turns, text_of(e.tokens)) for e in eps] == [
      (2, "1+212+12<eos>"), (2, "912=12")]
  assert server.recorder.stats()["continued"] == 2


def test_qwen3_template_tool_calls_through_the_endpoint_chain_token_exactly():
  from jaxrl_llm.envs import TemplateChat
  from tests.rollout.test_multiturn import _tokenizer
  tok = _tokenizer("qwen3")
  chat = TemplateChat(tok)
  call = ('<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "calculator", '
          '"arguments": {"expression": "811*87+181"}}\n</tool_call>')
  cut = call.index("calc") + 3          # not the canonical tokenization of its text
  turns = [tok.encode(call[:cut]) + tok.encode(call[cut:]) + [tok.eos_id],
           tok.encode("<answer>70738</answer>") + [tok.eos_id]]
  fake = Fake(lambda p: turns[len(fake.calls)])
  tools = [{"type": "function", "function": {
      "name": "calculator", "description": "Evaluates an arithmetic expression.",
      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                     "required": ["expression"]}}}]
  messages = [{"role": "user", "content": "What is 811*87+181?"}]
  with serve(fake, chat, max_len=1024, model_name=MODEL) as server:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    [tc] = r.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == (
        "calculator", {"expression": "811*87+181"})
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "<think>\nuse the tool\n</think>"
    tool_turn = {"role": "tool", "tool_call_id": tc.id, "content": "70738"}
    r2 = c.chat.completions.create(model=MODEL, tools=tools,
                                   messages=messages + [r.choices[0].message, tool_turn])
    [ep] = server.recorder.take()
  assert tok.encode(tok.decode(turns[0][:-1])) != turns[0][:-1]
  reply = chat.continuation_ids([{"role": "tool", "content": "70738"}], turns[0], tools)
  assert r2.prompt_token_ids == r.prompt_token_ids + turns[0] + reply
  assert tok.tokenizer.decode(reply, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\n70738\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n")
  assert ep.tokens.tolist() == r2.prompt_token_ids + turns[1]
  assert [ep.tokens[s:e].tolist() for s, e in ep.turn_spans] == turns
  assert r.prompt_token_ids == chat.prompt_ids(messages, tools)


# ----------------------------------------------------------------------- robustness


def _raw(server, data: bytes) -> tuple[int, dict]:
  """Sends ``data`` on a fresh socket; the status and JSON body of the answer."""
  with socket.create_connection((server.host, server.port), timeout=10) as s:
    s.sendall(data)
    chunks = []
    while chunk := s.recv(65536):
      chunks.append(chunk)
  head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
  return int(head.split()[1]), json.loads(body)


MALFORMED = [
    ("bad JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("no messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("no role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400,
     "messages[0].role"),
    ("content an int", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("an image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("unknown model", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("model a number", "/v1/chat/completions",
     {"model": 7, "messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("max_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400,
     "max_tokens"),
    ("max_tokens beyond the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}, 400, "max_tokens"),
    ("a prompt as long as the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * 64}]}, 400, "messages"),
    ("n 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ("temperature < 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature"),
    ("top_logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
      "top_logprobs": 3}, 400, "top_logprobs"),
    ("stream not a bool", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ("tools a dict", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": {}}, 400, "tools"),
    ("a character the tokenizer lacks", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "h\u00e9"}]}, 400, "messages"),
    ("no prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("prompt of floats", "/v1/completions", {"prompt": [1.5]}, 400, "prompt"),
    ("echo", "/v1/completions", {"prompt": "1", "echo": True}, 400, "echo"),
    ("completion logprobs > 0", "/v1/completions", {"prompt": "1", "logprobs": 2}, 400,
     "logprobs"),
    ("unknown endpoint", "/v1/embeddings", {"input": "x"}, 404, None),
    ("POST on models", "/v1/models", {}, 405, None),
]


def test_malformed_requests_get_4xx_json_errors_and_the_server_goes_on():
  fake = Fake(says("ok"))
  good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
  with serve(fake, CHAR, max_len=64, model_name=MODEL) as server:
    for name, path, body, status, param in MALFORMED:
      got, out = post(server, path, body, raw=isinstance(body, bytes))
      assert got == status, (name, got, out)
      assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param",
                                                              "code"}, name
      assert out["error"]["param"] == param and out["error"]["type"] == (
          "invalid_request_error"), name
      status_ok, ok = post(server, "/v1/chat/completions", good)
      assert status_ok == 200 and ok["choices"][0]["message"]["content"] == "ok", name
    # GET on a POST endpoint, an unknown method, no Content-Length, a huge body, garbage
    with urllib.request.urlopen(server.url + "/v1/models") as r:
      assert json.load(r)["data"][0]["id"] == MODEL
    try:
      urllib.request.urlopen(server.url + "/v1/chat/completions")
      raise AssertionError("GET on chat completions must fail")
    except urllib.error.HTTPError as e:
      assert e.code == 405 and json.load(e)["error"]["code"] == "method_not_allowed"
    assert _raw(server, b"BREW /v1/models HTTP/1.0\r\n\r\n")[0] == 405
    assert _raw(server, b"POST /v1/chat/completions HTTP/1.0\r\n\r\n")[0] == 411
    status, out = _raw(server, b"POST /v1/completions HTTP/1.0\r\nContent-Length: "
                       b"999999999999\r\n\r\n{}")
    assert status == 413 and out["error"]["code"] == "body_too_large"
    assert _raw(server, b"\x00garbage\r\n\r\n")[0] == 400
    assert post(server, "/v1/chat/completions", good)[0] == 200
    assert len(fake.calls) == len(MALFORMED) + 1
  with pytest.raises(urllib.error.URLError):     # closed: the port no longer answers
    urllib.request.urlopen(server.url + "/v1/models", timeout=5)


def test_a_backend_failure_is_a_500_json_error_and_the_server_goes_on():
  openai = pytest.importorskip("openai", reason="needs the openai package")
  fake = Fake(says("ok"), fail=lambda prompts: TOK.encode("boom") in [p[2:6]
                                                                      for p in prompts])
  bad_count = lambda prompts, limits: []
  with serve(fake, CHAR, max_len=64, model_name=MODEL) as server:
    c = client(server)
    with pytest.raises(openai.InternalServerError) as e:
      c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "boom"}])
    assert e.value.status_code == 500
    assert e.value.body["code"] == "backend_error"
    assert "RuntimeError: the backend broke" in e.value.body["message"]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}])
    assert r.choices[0].message.content == "ok"
    assert server.batcher.stats()["backend_errors"] == 1
    assert server.recorder.stats()["calls"] == 1
  with serve(bad_count, CHAR, max_len=64) as server:
    status, out = post(server, "/v1/completions", {"prompt": "1"})
    assert status == 500 and "returned 0 completions for 1 prompts" in out["error"]["message"]


def test_the_server_binds_127_0_0_1_unless_told_and_closes_cleanly():
  assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
  server = serve(Fake(says("ok")), CHAR, max_len=32)
  try:
    assert server._http.server_address[0] == "127.0.0.1"
    assert server.url == f"http://127.0.0.1:{server.port}" and server.port > 0
  finally:
    server.close()
  server.close()                                   # idempotent
  with pytest.raises(BackendError, match="shutting down"):
    server.batcher.submit([[3]], [1])
  with pytest.raises(ValueError, match="`max_len` must be an int >= 2"):
    serve(Fake(says("ok")), CHAR, max_len=0)
  with pytest.raises(ValueError, match="`parser` must be one of"):
    serve(Fake(says("ok")), CHAR, max_len=32, tool_parser="xml")
  with pytest.raises(ValueError, match="`port` must be an int"):
    serve(Fake(says("ok")), CHAR, max_len=32, port=-1)


def test_api_error_bodies():
  e = ApiError(400, "bad", param="n")
  assert e.body() == {"error": {"message": "bad", "type": "invalid_request_error",
                                "param": "n", "code": None}}
  assert ApiError(500, "x").body()["error"]["type"] == "server_error"
  rec = Recorder(CHAR)
  with pytest.raises(ValueError, match="one entry per sampled id"):
    rec.record(rec.ids_prefix([3]), [4, 5], [0.0], messages=[], reply={},
               finish_reason="stop")


# ------------------------------------------------------------------------- batching


def test_concurrent_agents_cost_one_backend_call_per_round():
  fake = Fake(lambda p: [p[2], TOK.eos_id])       # the agent's first letter: its own
  firsts = ["a", "b", "c", "d"]
  results, errors = {}, []
  with serve(fake, CHAR, max_len=128, model_name=MODEL, max_batch=4,
             max_wait=5.0) as server:
    c = client(server)

    def run(first):
      try:
        results[first] = agent(c, first, ["x", "y"], max_tokens=4)
      except Exception as e:   # noqa: BLE001 - reported below
        errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in firsts]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
    eps = server.recorder.take()
    stats = server.batcher.stats()
  assert not errors
  assert [len(call["prompts"]) for call in fake.calls] == [4, 4, 4]
  assert stats["backend_calls"] == 3 and stats["largest_batch"] == 4
  assert sorted(text_of(e.tokens) for e in eps) == [
      f"u:{f}<eos>a:{f}<eos>u:x<eos>a:{f}<eos>u:y<eos>a:{f}<eos>" for f in firsts]
  assert all(e.turns == 3 for e in eps)
  for f in firsts:
    assert [r.choices[0].message.content for r in results[f]] == [f] * 3


def test_the_default_wait_batches_requests_that_arrive_together():
  """Without a batch size to wait for, requests queued while the backend is busy go in
  the next call together (the first call's 4 prompts were all waiting for it)."""
  gate, started = threading.Event(), threading.Event()

  def slow(prompts, limits):
    if not started.is_set():
      started.set()
      gate.wait(10)
    return [([TOK.eos_id], [0.0]) for _ in prompts]

  with serve(slow, CHAR, max_len=32) as server:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    threads = [threading.Thread(target=post, args=(server, "/v1/chat/completions", body))
               for _ in range(5)]
    threads[0].start()
    assert started.wait(10)                       # the first call is in the backend
    for t in threads[1:]:
      t.start()
    deadline = time.monotonic() + 30
    while server.batcher._queue.qsize() < 4:     # the others queue behind it
      assert time.monotonic() < deadline, "the 4 requests never queued"
      time.sleep(0.01)
    gate.set()
    for t in threads:
      t.join(30)
    assert server.batcher.stats()["backend_calls"] == 2
    assert server.batcher.stats()["largest_batch"] == 4


# ------------------------------------------------------- the built-in model, for real


def test_a_three_call_agent_on_the_built_in_model_records_exact_behaviour_logprobs():
  from flax import nnx

  from jaxrl_llm.models import (
      Transformer,
      TransformerConfig,
      make_apply_fn,
      make_paged_decode_fns,
      split_model,
  )
  from jaxrl_llm.rollout import RolloutEngine
  from jaxrl_llm.rollout.multiturn import engine_generate
  from jaxrl_llm.train import policy_forward
  graphdef, params = split_model(Transformer(TransformerConfig.tiny(TOK.vocab_size),
                                             rngs=nnx.Rngs(0)))
  engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=4, max_len=128,
                         page_size=8)
  backend = engine_generate(engine, params, eos_ids=CHAR.stop_ids, seed=3)
  sampled = []

  def spy(prompts, limits, sampling=None):
    out = backend(prompts, limits, sampling=sampling)
    sampled.append((prompts, sampling, [(list(i), list(lp)) for i, lp in out]))
    return out

  with serve(spy, CHAR, max_len=128, model_name=MODEL) as server:
    responses = agent(client(server), "hi", ["more", "again"], max_tokens=8,
                      temperature=1.0, logprobs=True)
    [ep] = server.recorder.take()
  assert [s for _, s, _ in sampled] == [[{"temperature": 1.0}]] * 3
  turns = [out[0][0] for _, _, out in sampled]
  assert [ep.tokens[s:e].tolist() for s, e in ep.turn_spans] == turns
  for (prompts, _, out), r, (s, e) in zip(sampled, responses, ep.turn_spans):
    assert prompts[0] == r.prompt_token_ids == ep.tokens[:s].tolist()
    assert r.choices[0].token_ids == out[0][0]
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(out[0][1],
                                                                               abs=1e-6)
    np.testing.assert_array_equal(ep.behaviour_logprobs[s:e],
                                  np.asarray(out[0][1], np.float32))
  batch = episodes_to_batch([ep], pad_id=TOK.pad_id, group_size=1)
  logp, _, _ = policy_forward(make_apply_fn(graphdef), params, batch, temperature=1.0)
  mask = batch["loss_mask"] == 1
  assert ep.turns == 3 and mask.sum() == sum(len(t) for t in turns) >= 3
  np.testing.assert_allclose(np.asarray(logp)[mask], batch["rollout_logp"][mask], atol=1e-4)
  assert np.all(batch["rollout_logp"][~mask] == 0)


# ------------------------------------------------------------ the `jaxrl-llm serve` command


def test_serve_command_mistakes_are_one_line_before_jax(tmp_path, capsys):
  from jaxrl_llm.cli import main
  assert main(["serve", "--out", str(tmp_path / "nowhere")]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"error: serve: {tmp_path / 'nowhere'} does not exist; pass the run folder of a "
      "training run with --out"]


@pytest.mark.slow
def test_serve_command_serves_a_run_records_and_stops_on_sigint(tmp_path):
  """``jaxrl-llm serve --out RUN`` (a 1-step built-in run): the openai client's
  completion carries the prompt and sampled ids, SIGINT stops the server in one line,
  and ``--record`` holds that call as one trajectory (loss mask 1 on the sampled ids,
  their behaviour log-probs)."""
  import os
  import signal
  import subprocess
  import sys

  import openai
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  run, record = tmp_path / "run", tmp_path / "calls.jsonl"
  subprocess.run([sys.executable, "-m", "jaxrl_llm", "train", "--steps", "1",
                  "--eval-size", "4", "--no-progress", "--out", str(run)],
                 env=env, check=True, capture_output=True, timeout=300)
  server = subprocess.Popen(
      [sys.executable, "-m", "jaxrl_llm", "serve", "--out", str(run), "--port", "0",
       "--max-len", "32", "--slots", "2", "--record", str(record)],
      env=env, stderr=subprocess.PIPE, text=True)
  try:
    line = server.stderr.readline()
    assert " at http://127.0.0.1:" in line and line.startswith("jaxrl-llm serve: "), line
    url = line.split(" at ")[1].split()[0]
    client = openai.OpenAI(base_url=url, api_key="unused")
    out = client.completions.create(model="jaxrl-llm", prompt="1+2=", max_tokens=4,
                                    temperature=0)
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == [4, 13, 5, 16]          # "1+2=" in the run's vocab
    assert len(choice["token_ids"]) == 4
    server.send_signal(signal.SIGINT)
    assert server.wait(timeout=60) == 0
    rest = server.stderr.read().strip().splitlines()
  finally:
    server.kill()
  assert rest == [f"jaxrl-llm serve: stopped; 1 trajectories recorded in {record}"]
  (traj,) = [json.loads(line) for line in record.open()]
  assert traj["tokens"] == choice["prompt_token_ids"] + choice["token_ids"]
  assert traj["loss_mask"] == [0] * 4 + [1] * 4 and traj["prompt_len"] == 4
  assert all(lp < 0 for lp in traj["behaviour_logprobs"][4:])
