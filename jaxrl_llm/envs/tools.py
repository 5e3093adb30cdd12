"""Tools: Python functions with JSON schemas, tool-call parsers, tool-result turns.

A :class:`Tool` wraps a function and its JSON schema (derived from the signature and
the Google-style docstring, or given). Its :attr:`Tool.schema` is the OpenAI / Hugging
Face form ``{"type": "function", "function": {"name", "description", "parameters"}}``
that chat templates read from their ``tools=`` argument, so the prompt lists the tools
in the model's own format (Qwen's ``<tools>`` block, Llama 3.1's JSON in the first
user turn).

A model's turn is parsed by a parser of :data:`TOOL_PARSERS` into a
:class:`ParsedTurn` (the calls, the text around them, and the errors of malformed
calls: a parse never raises). :func:`tool_messages` runs the calls and returns the
``tool`` role turns the chat template renders as its tool turn (Qwen: a user turn of
``<tool_response>`` blocks; Llama 3.1: an ``ipython`` turn). A tool that raises, an
unknown tool name or bad arguments give an error string as the tool's result, so the
episode goes on and the model sees what went wrong.

Formats:

==================  =================================================================
parser              what the model writes
==================  =================================================================
``hermes``          ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``, any
                    number of them (Hermes, Qwen2.5, Qwen3; aliases ``qwen2.5``,
                    ``qwen3``)
``llama3_json``     ``{"name": N, "parameters": {...}}`` as the whole turn, optionally
                    after ``<|python_tag|>``; several objects separated by ``;`` or
                    white space (Llama 3.1 / 3.2; alias ``llama3.1``)
==================  =================================================================

Examples:
  >>> def add(a: int, b: int = 0) -> int:
  ...   '''Adds two integers.
  ...
  ...   Args:
  ...     a: the first term.
  ...     b: the second term.
  ...   '''
  ...   return a + b
  >>> t = Tool.from_function(add)
  >>> t.schema["function"]["parameters"]["required"], t.schema["function"]["description"]
  (['a'], 'Adds two integers.')
  >>> turn = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
  ...                     '</tool_call>')
  >>> turn.calls
  (ToolCall(name='add', arguments={'a': 2, 'b': 3}),)
  >>> tool_messages(turn, [t])
  [{'role': 'tool', 'name': 'add', 'content': '5'}]
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_llm.envs.base import Message

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string",
                               bool: "boolean", list: "array", tuple: "array",
                               dict: "object"}
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
    "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    "string": lambda x: isinstance(x, str),
    "boolean": lambda x: isinstance(x, bool),
    "array": lambda x: isinstance(x, list),
    "object": lambda x: isinstance(x, dict),
    "null": lambda x: x is None,
}


def _json_schema(annotation: Any) -> dict:
  """The JSON schema of a Python type annotation (``{}``, any value, when unknown)."""
  if annotation is inspect.Parameter.empty or annotation is Any:
    return {}
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    inner = [a for a in args if a is not type(None)]
    return _json_schema(inner[0]) if len(inner) == 1 else {}
  if origin is typing.Literal:
    return {"enum": list(args)}
  if origin in (list, tuple, Sequence):
    out: dict = {"type": "array"}
    if args and args[0] is not Ellipsis:
      out["items"] = _json_schema(args[0])
    return out
  if origin in (dict, Mapping):
    return {"type": "object"}
  if annotation in _JSON_TYPES:
    return {"type": _JSON_TYPES[annotation]}
  return {}


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
  """``(description, {argument: its description})`` from a Google-style docstring:
  the first paragraph is the description; the ``Args:`` section's lines
  ``name: text`` (or ``name (type): text``) name the arguments, lines indented deeper
  continue them."""
  lines = (inspect.getdoc(fn) or "").splitlines()
  head: list[str] = []
  for line in lines:
    if not line.strip() or re.fullmatch(r"\w[\w ]*:\s*", line):
      break
    head.append(line.strip())
  args: dict[str, str] = {}
  in_args, indent, current = False, -1, ""
  for line in lines:
    if re.fullmatch(r"(Args|Arguments|Parameters):\s*", line):
      in_args = True
      continue
    if not in_args or not line.strip():
      continue
    if not line[0].isspace():      # the next section
      break
    depth = len(line) - len(line.lstrip())
    m = re.fullmatch(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
    if m and (indent < 0 or depth <= indent):
      indent, current = depth, m.group(1)
      args[current] = m.group(2).strip()
    elif current:
      args[current] = (args[current] + " " + line.strip()).strip()
  return " ".join(head), args


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function the model may call, with its JSON schema.

  Attributes:
    name: the name the model calls it by.
    fn: the function, called with the call's arguments as keywords.
    description: what it does (the model reads it).
    parameters: the JSON schema of its arguments (``{"type": "object",
      "properties": {...}, "required": [...]}``).

  Calling a tool (``tool(arguments)``) never raises: arguments that do not fit the
  schema (an unknown name, a missing required one, a value of another JSON type) and
  an exception of ``fn`` give an error string starting with ``"Error:"``; any other
  result is the function's ``str`` result, or its JSON (``json.dumps``).
  """

  name: str
  fn: Callable[..., Any]
  description: str
  parameters: Mapping[str, Any]

  def __post_init__(self) -> None:
    if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][\w.-]*", self.name):
      raise ValueError(f"`name` must be an identifier-like str, got {self.name!r}.")
    if not callable(self.fn):
      raise ValueError(f"`fn` of tool {self.name!r} must be callable.")
    if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
      raise ValueError(f"`parameters` of tool {self.name!r} must be a JSON schema with "
                       f"type 'object', got {self.parameters!r}.")

  @classmethod
  def from_function(cls, fn: Callable[..., Any], *, name: str | None = None,
                    description: str | None = None,
                    parameters: Mapping[str, Any] | None = None) -> Tool:
    """A tool of ``fn``; the name, description and parameter schema default to what
    its ``__name__``, signature (annotations: ``int`` -> ``integer``, ``float`` ->
    ``number``, ``str``, ``bool``, ``list[T]`` -> ``array``, ``dict`` -> ``object``,
    ``Literal`` -> ``enum``, ``T | None`` -> ``T``; a parameter without a default is
    required) and Google-style docstring say.

    Raises:
      ValueError: ``fn`` takes ``*args`` (a JSON call names every argument).
    """
    name = name or fn.__name__
    doc, arg_docs = _docstring(fn)
    if parameters is None:
      sig = inspect.signature(fn)
      try:
        hints = typing.get_type_hints(fn)
      except Exception:   # noqa: BLE001 - unresolved annotations: fall back to none
        hints = {}
      properties, required = {}, []
      for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
          raise ValueError(f"tool {name!r}: `fn` takes *{p.name}; a tool's arguments are "
                           "named (give `parameters` and a keyword signature).")
        if p.kind is p.VAR_KEYWORD:
          continue
        prop = _json_schema(hints.get(p.name, p.annotation))
        if p.name in arg_docs:
          prop["description"] = arg_docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
          required.append(p.name)
      parameters = {"type": "object", "properties": properties, "required": required}
    return cls(name=name, fn=fn, description=description if description is not None
               else doc, parameters=dict(parameters))

  @property
  def schema(self) -> dict[str, Any]:
    """The schema chat templates read: ``{"type": "function", "function": {...}}``."""
    return {"type": "function", "function": {"name": self.name,
                                             "description": self.description,
                                             "parameters": dict(self.parameters)}}

  def check_arguments(self, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the schema (one line), or None when they do."""
    if not isinstance(arguments, Mapping):
      return f"the arguments must be a JSON object, got {type(arguments).__name__}"
    props = self.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown and not self.parameters.get("additionalProperties", False):
      return f"unknown argument(s) {unknown}; {self.name} takes {sorted(props)}"
    missing = [k for k in self.parameters.get("required", ()) if k not in arguments]
    if missing:
      return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
      prop = props.get(key, {})
      kind = prop.get("type")
      if isinstance(kind, str) and kind in _CHECKS and not _CHECKS[kind](value):
        return f"argument {key!r} must be of JSON type {kind}, got {json.dumps(value)}"
      if "enum" in prop and value not in prop["enum"]:
        return f"argument {key!r} must be one of {prop['enum']}, got {json.dumps(value)}"
    return None

  def __call__(self, arguments: Any) -> str:
    """The tool's result for ``arguments`` (a dict), as text; an error string, never an
    exception (the class docstring)."""
    problem = self.check_arguments(arguments)
    if problem is not None:
      return f"Error: {self.name}: {problem}."
    try:
      result = self.fn(**arguments)
    except Exception as e:   # noqa: BLE001 - a tool's failure is the model's observation
      return f"Error: {self.name} raised {type(e).__name__}: {e}"
    if isinstance(result, str):
      return result
    try:
      return json.dumps(result)
    except (TypeError, ValueError):
      return str(result)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: the tool's name and its arguments (a dict)."""

  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """A model's turn, parsed.

  Attributes:
    content: the text outside the calls, stripped.
    calls: the well-formed calls, in order.
    errors: one line per malformed call (invalid JSON, no ``name``, arguments not an
      object, an unterminated ``<tool_call>``), in order.
  """

  content: str
  calls: tuple[ToolCall, ...] = ()
  errors: tuple[str, ...] = ()

  @property
  def has_calls(self) -> bool:
    """Whether the turn tried to call a tool (well-formed or not)."""
    return bool(self.calls or self.errors)


def _call_from(obj: Any, arg_keys: Sequence[str]) -> ToolCall | str:
  """A :class:`ToolCall` from a decoded JSON value, or why it is none."""
  if not isinstance(obj, dict):
    return f"a tool call must be a JSON object, got {json.dumps(obj)[:80]}"
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return f"a tool call needs a string 'name', got {json.dumps(obj)[:80]}"
  key = next((k for k in arg_keys if k in obj), None)
  arguments = {} if key is None else obj[key]
  if isinstance(arguments, str):   # some models write the arguments as a JSON string
    with contextlib.suppress(json.JSONDecodeError):
      arguments = json.loads(arguments)
  if not isinstance(arguments, dict):
    return f"the arguments of {name!r} must be a JSON object, got {json.dumps(arguments)[:80]}"
  return ToolCall(name, arguments)


def _collect(call: ToolCall | str, calls: list[ToolCall], errors: list[str]) -> None:
  if isinstance(call, str):
    errors.append(call)
  else:
    calls.append(call)


def _decode_json(text: str) -> tuple[Any, str | None]:
  try:
    return json.loads(text), None
  except json.JSONDecodeError as e:
    return None, f"invalid JSON in a tool call ({e.msg} at char {e.pos}): {text[:80]!r}"


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> ParsedTurn:
  """Hermes / Qwen2.5 / Qwen3 calls: ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks, any number (the module docstring).

  Examples:
    >>> t = parse_hermes('ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    ...                  '<tool_call>{"name": "g", "arguments": {"x": 1</tool_call>')
    >>> t.content, [c.name for c in t.calls]
    ('ok', ['f'])
    >>> print(t.errors[0])
    invalid JSON in a tool call (Expecting ',' delimiter at char 34):
    '{"name": "g", "arguments": {"x": 1'
  """
  calls: list[ToolCall] = []
  errors: list[str] = []
  for body in _HERMES.findall(text):
    obj, error = _decode_json(body.strip())
    _collect(error if error is not None else _call_from(obj, ("arguments", "parameters")),
             calls, errors)
  rest = _HERMES.sub("", text)
  if "<tool_call>" in rest:
    errors.append("an unterminated <tool_call> (no </tool_call>)")
    rest = rest.split("<tool_call>", 1)[0]
  return ParsedTurn(rest.strip(), tuple(calls), tuple(errors))


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedTurn:
  """Llama 3.1 JSON calls: the turn is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``; several objects separated
  by ``;`` or white space. A turn that does not start with ``{`` (after the tag)
  has no call.

  Examples:
    >>> t = parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
    ...                       '{"name": "g", "parameters": {}}')
    >>> [(c.name, c.arguments) for c in t.calls], t.errors
    ([('f', {'x': 1}), ('g', {})], ())
    >>> parse_llama3_json("The answer is 4.").calls
    ()
    >>> parse_llama3_json('{"name": "f", "parameters": {').errors[0][:28]
    'invalid JSON in a tool call '
  """
  body = text.strip()
  tagged = body.startswith(_PYTHON_TAG)
  if tagged:
    body = body[len(_PYTHON_TAG):].strip()
  if not body.startswith("{"):
    return ParsedTurn(body if tagged else text.strip())
  decoder = json.JSONDecoder()
  calls: list[ToolCall] = []
  errors: list[str] = []
  pos = 0
  while pos < len(body):
    try:
      obj, end = decoder.raw_decode(body, pos)
    except json.JSONDecodeError as e:
      errors.append(f"invalid JSON in a tool call ({e.msg} at char {e.pos}): "
                    f"{body[pos:pos + 80]!r}")
      break
    _collect(_call_from(obj, ("parameters", "arguments")), calls, errors)
    pos = end
    while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
      pos += 1
  return ParsedTurn("", tuple(calls), tuple(errors))


TOOL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "qwen2.5": parse_hermes,
    "qwen3": parse_hermes,
    "llama3_json": parse_llama3_json,
    "llama3.1": parse_llama3_json,
}
"""Tool-call parsers by name (the module docstring's table); add one with
``TOOL_PARSERS[name] = fn`` (``fn(text) -> ParsedTurn``, never raising)."""


def get_tool_parser(name: str) -> Callable[[str], ParsedTurn]:
  """The parser registered as ``name`` in :data:`TOOL_PARSERS`.

  >>> get_tool_parser("qwen3") is parse_hermes
  True
  >>> get_tool_parser("xml")
  Traceback (most recent call last):
  ...
  ValueError: `parser` must be one of ['hermes', 'llama3.1', 'llama3_json', 'qwen2.5',
  'qwen3'], got 'xml'.
  """
  if name not in TOOL_PARSERS:
    raise ValueError(f"`parser` must be one of {sorted(TOOL_PARSERS)}, got {name!r}.")
  return TOOL_PARSERS[name]


def tool_messages(turn: ParsedTurn, tools: Sequence[Tool]) -> list[Message]:
  """The ``tool`` role turns answering ``turn``: one per call, in order (the tool's
  result, or ``"Error: unknown tool ..."``), then one per malformed call
  (``"Error: ..."``, with ``name`` ``"error"``). Never raises.

  Examples:
    >>> tool_messages(ParsedTurn("", (ToolCall("nope", {}),)), [])
    [{'role': 'tool', 'name': 'nope', 'content': 'Error: unknown tool nope; the tools are [].'}]
  """
  by_name = {t.name: t for t in tools}
  out: list[Message] = []
  for call in turn.calls:
    tool = by_name.get(call.name)
    content = (tool(call.arguments) if tool is not None else
               f"Error: unknown tool {call.name}; the tools are {sorted(by_name)}.")
    out.append({"role": "tool", "name": call.name, "content": content})
  for error in turn.errors:
    out.append({"role": "tool", "name": "error", "content": f"Error: {error}."})
  return out


__all__ = ["ParsedTurn", "TOOL_PARSERS", "Tool", "ToolCall", "get_tool_parser",
           "parse_hermes", "parse_llama3_json", "tool_messages"]
