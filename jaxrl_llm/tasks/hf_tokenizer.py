"""Hugging Face tokenizers and chat templates, without ``transformers``.

:class:`HFTokenizer` loads a model folder's ``tokenizer.json`` with the ``tokenizers``
package and its chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``) and renders the template with ``jinja2`` the way
``transformers``' ``apply_chat_template`` does: a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that does not escape HTML, the globals ``raise_exception`` and
``strftime_now``, and the special tokens (``bos_token``, ``eos_token``, ...) as
template variables. It has the interface of
:class:`~jaxrl_llm.tasks.tokenizer.CharTokenizer` (``encode``/``decode``/
``encode_batch``/``decode_batch``, ``pad_id``/``bos_id``/``eos_id``/``vocab_size``), so
tasks and the trainer use either.

Conventions:

* ``encode`` never adds special tokens by itself (``tokenizers``'
  ``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)`` does): chat
  templates write their own ``bos``; raw text gets it from
  :attr:`HFTokenizer.raw_text_prefix` (``JsonlTask`` puts it before non-chat prompts)
  or ``add_bos=True``.
* ``decode`` stops at the first end-of-sequence id (any of ``eos_ids``: the
  tokenizer's ``eos_token``, then the ``eos_token_id`` (an int or a list) of
  ``generation_config.json`` and of ``config.json``; the trainer's sampler stops a
  completion at any of them too),
  skips special tokens, and writes :data:`~jaxrl_llm.tasks.tokenizer.UNKNOWN_CHAR` for
  ids outside the tokenizer's vocabulary (models pad their embedding tables).
* ``pad_id``: the ``pad_token`` when set, else ``eos_id`` (the usual choice for
  decoder-only models without one).

Needs the optional extra ``pip install 'jaxrl_llm[hf]'`` (``tokenizers``, ``jinja2``); the
tokenizer of a GGUF file (:meth:`HFTokenizer.from_gguf`, ``jaxrl_llm.tasks.gguf_vocab``)
also needs ``pip install 'jaxrl_llm[gguf]'``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from jaxrl_llm.model_files import is_gguf
from jaxrl_llm.tasks.tokenizer import UNKNOWN_CHAR, pad_encoded

if TYPE_CHECKING:   # an optional dependency (the hf extra)
  import jinja2

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                 "cls_token", "mask_token")


def _require(module: str):
  try:
    return __import__(module)
  except ImportError as e:
    raise ImportError(f"{module!r} is needed for Hugging Face tokenizers and checkpoints: "
                      "pip install 'jaxrl_llm[hf]'.") from e


def _token_str(value) -> str | None:
  """A special token from a config value: a string or an AddedToken dict."""
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  return None


# The longest string (or list) a chat template may build, as jinja's sandbox bounds
# ``range`` (MAX_RANGE): 16 Mi characters, far beyond any prompt, far below a memory
# exhaustion. ``**`` results are bounded in bits.
MAX_TEMPLATE_SIZE = 1 << 24
_MAX_POW_BITS = 1 << 16


def _too_big(what: str) -> Exception:
  from jinja2.exceptions import SecurityError
  return SecurityError(f"the chat template {what}: more than the sandbox's "
                       f"{MAX_TEMPLATE_SIZE} characters (MAX_TEMPLATE_SIZE)")


def _sized(x: Any) -> bool:
  return isinstance(x, (str, list, tuple))


def _check_ints(args: Sequence[Any]) -> None:
  """Refuses an int argument beyond the size bound (a width: ``center(10**8)``)."""
  for a in args:
    if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_SIZE:
      raise _too_big(f"passes {a} as an argument (a width or count)")


# A ``%`` conversion's width and precision; a ``str.format`` field's spec (after ':').
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")
_FORMAT_SPEC = re.compile(r"\{[^{}:]*:([^{}]*)\}")


def _check_format(fmt: Any) -> None:
  """Refuses a ``%`` or ``str.format`` field width or precision beyond the size bound."""
  if isinstance(fmt, str):
    numbers = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
    numbers += [n for m in _FORMAT_SPEC.finditer(fmt) for n in re.findall(r"\d+", m[1])]
    _check_ints([int(n) for n in numbers])


def _check_replace(text: Any, args: Sequence[Any]) -> None:
  """Refuses ``text.replace(old, new)`` whose result would exceed the bound."""
  if isinstance(text, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
    old, new = args[0], args[1]
    hits = text.count(old) if old else len(text) + 1
    if len(text) + hits * len(new) > MAX_TEMPLATE_SIZE:
      raise _too_big("replaces into a string too long")


def _check_result(result: Any, what: str) -> Any:
  if _sized(result) and len(result) > MAX_TEMPLATE_SIZE:
    raise _too_big(f"builds a {type(result).__name__} of {len(result)} items with {what}")
  return result


def _check_binop(op: str, left: Any, right: Any) -> None:
  """Refuses, before it runs, an operator whose result would exceed the bound."""
  if op == "*":
    sized, count = (left, right) if _sized(left) else (right, left)
    if _sized(sized) and isinstance(count, int) and len(sized) * count > MAX_TEMPLATE_SIZE:
      raise _too_big(f"repeats a {type(sized).__name__} of {len(sized)} items {count} times")
  elif op == "+" and _sized(left) and _sized(right):
    if len(left) + len(right) > MAX_TEMPLATE_SIZE:
      raise _too_big("concatenates a string too long")
  elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
    if abs(left) > 1 and left.bit_length() * right > _MAX_POW_BITS:
      raise _too_big(f"raises {left} to the power {right}")
  elif op == "%":
    _check_format(left)
    _check_ints(right if isinstance(right, tuple) else [right])


def _bounded_filter(f: Any) -> Any:
  """``f`` (a jinja filter) with its int arguments and its result bounded."""
  @functools.wraps(f)
  def bounded(*args: Any, **kwargs: Any) -> Any:
    values = [*args, *kwargs.values()]
    _check_ints(values)
    strs = [a for a in values if isinstance(a, str)]
    if f.__name__ == "do_format" and strs:
      _check_format(strs[0])
    elif f.__name__ == "do_replace" and strs:
      _check_replace(strs[0], strs[1:])
    return _check_result(f(*args, **kwargs), f"the filter {f.__name__}")
  return bounded


@functools.cache
def _bounded_sandbox() -> type:
  """jinja's immutable sandbox with every string (and list) it builds bounded by
  :data:`MAX_TEMPLATE_SIZE`: the operators ``*``, ``+``, ``~``, ``**`` and ``%``, calls
  (``'x'.ljust(n)``, ``.replace``, ``.format``) and filters (``center``, ``indent``,
  ...) refuse, before allocating where the size is known in advance, a result beyond
  it (``jinja2.exceptions.SecurityError``)."""
  from jinja2.compiler import CodeGenerator
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generator(CodeGenerator):
    def visit_Concat(self, node: Any, frame: Any) -> None:     # ``a ~ b``
      self.write("environment.bounded_concat((")
      for arg in node.nodes:
        self.visit(arg, frame)
        self.write(", ")
      self.write("))")

  class Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = Generator
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
      _check_binop(operator, left, right)
      return _check_result(super().call_binop(context, operator, left, right),
                           f"the operator {operator}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
      _check_ints([*args, *kwargs.values()])
      method = getattr(__obj, "__wrapped__", __obj)     # the sandbox wraps str.format
      owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
      if name in ("format", "format_map"):
        _check_format(owner)
      elif name == "replace":
        _check_replace(owner, args)
      return _check_result(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def bounded_concat(self, parts: Sequence[Any]) -> str:
      texts = [str(p) for p in parts]
      if sum(map(len, texts)) > MAX_TEMPLATE_SIZE:
        raise _too_big("concatenates (~) a string too long")
      return "".join(texts)

  return Sandbox


def compile_chat_template(source: str) -> jinja2.Template:
  """A ``jinja2`` template compiled the way ``transformers`` compiles chat templates,
  in a sandbox that also bounds the size of the strings it builds
  (:data:`MAX_TEMPLATE_SIZE`, as jinja bounds ``range``).

  Raises:
    ImportError: without ``jinja2``.

  Examples:
    >>> t = compile_chat_template("{{ ('x' * 10**8)|length }}")
    >>> try:
    ...   t.render()
    ... except Exception as e:
    ...   print(type(e).__name__, str(e))
    SecurityError the chat template repeats a str of 1 items 100000000 times: more than
    the sandbox's 16777216 characters (MAX_TEMPLATE_SIZE)
  """
  jinja2 = _require("jinja2")
  from jinja2 import ext as jinja_ext

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.now().strftime(fmt)

  env = _bounded_sandbox()(trim_blocks=True, lstrip_blocks=True,
                           extensions=[jinja_ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(source)


class HFTokenizer:
  """A ``tokenizers.Tokenizer`` with special tokens and a chat template.

  Build it with :meth:`from_pretrained` (a local folder), :meth:`from_gguf` (a GGUF
  file's tokenizer) or directly.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``.
    special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}`` (strings; they
      are also chat-template variables).
    chat_template: the Jinja source of the chat template, or ``None``.
    extra_eos_ids: more ids that end a completion (``generation_config.json``,
      ``config.json``).
    gguf_pre: the ``tokenizer.ggml.pre`` name of the GGUF file it came from
      (:meth:`from_gguf` sets it; ``add_gguf_tokenizer`` writes it back), else ``None``.

  Examples:
    >>> from tokenizers import Tokenizer, models
    >>> vocab = {"<s>": 0, "</s>": 1, "hi": 2, "there": 3, "[UNK]": 4}
    >>> tok = HFTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
    ...                   special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    >>> tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size
    (0, 1, 1, 5)
    >>> tok.encode("hi", add_bos=True), tok.decode([2, 3, 1, 2])
    ([0, 2], 'hi there')
  """

  def __init__(self, tokenizer: Any, *, special_tokens: Mapping[str, str] | None = None,
               chat_template: str | None = None, extra_eos_ids: Sequence[int] = (),
               gguf_pre: str | None = None) -> None:
    self.tokenizer = tokenizer
    self.gguf_pre = gguf_pre
    self.special_tokens = {k: v for k, v in dict(special_tokens or {}).items()
                           if isinstance(v, str)}
    self.chat_template = chat_template
    self._compiled: jinja2.Template | None = None
    self._vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    ids = {k: self._id_of(k) for k in ("bos_token", "eos_token", "pad_token")}
    self._bos = ids["bos_token"]
    eos = [ids["eos_token"]] if ids["eos_token"] is not None else []
    self.eos_ids = tuple(dict.fromkeys(eos + [int(i) for i in extra_eos_ids]))
    self._pad = ids["pad_token"] if ids["pad_token"] is not None else (
        self.eos_ids[0] if self.eos_ids else 0)

  def _id_of(self, key: str) -> int | None:
    token = self.special_tokens.get(key)
    if token is None:
      return None
    i = self.tokenizer.token_to_id(token)
    if i is None:
      raise ValueError(f"`special_tokens`[{key!r}] = {token!r} is not in the vocabulary.")
    return int(i)

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a GGUF file (its ``tokenizer.ggml.*`` fields and chat template).

    See :func:`jaxrl_llm.tasks.gguf_vocab.read_gguf_tokenizer` (needs the ``gguf`` extra).
    The file's ``tokenizer.ggml.pre`` name is kept in :attr:`gguf_pre`.

    Raises:
      ValueError: (one line naming the file and the field) for a file that is not GGUF,
        is cut short, lacks a tokenizer field or names an unknown pre-tokenizer.
    """
    from jaxrl_llm.tasks.gguf_vocab import read_gguf_tokenizer

    tokenizer, kwargs = read_gguf_tokenizer(path)
    return cls(tokenizer, **kwargs)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
    """Loads ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat
    template) and ``chat_template.jinja`` from a folder, with the ``eos_token_id`` s
    (an int or a list) of its ``generation_config.json`` and ``config.json``. A ``.gguf``
    file is read by :meth:`from_gguf`.

    Raises:
      ValueError: if ``path`` has no ``tokenizer.json``.
    """
    tokenizers = _require("tokenizers")
    path = os.fspath(path)
    if is_gguf(path):
      return cls.from_gguf(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise ValueError(f"`path` {path!r} has no tokenizer.json (only fast tokenizers "
                       "are supported).")
    tokenizer = tokenizers.Tokenizer.from_file(tok_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    specials = {}
    for key in _SPECIAL_KEYS:
      token = _token_str(config.get(key))
      if token is not None:
        specials[key] = token
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
      named = {t.get("name"): t.get("template") for t in template}
      template = named.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        template = f.read()
    extra: list[int] = []
    for file in ("generation_config.json", "config.json"):
      ids = _read_json(os.path.join(path, file)).get("eos_token_id")
      extra += [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return cls(tokenizer, special_tokens=specials, chat_template=template,
               extra_eos_ids=extra)

  # ---- ids ---------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    """Tokens of the tokenizer, added tokens included (a model may have more rows)."""
    return self._vocab_size

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @property
  def eos_id(self) -> int | None:
    """The tokenizer's ``eos_token`` id (else the first generation-config eos id)."""
    return self.eos_ids[0] if self.eos_ids else None

  @property
  def pad_id(self) -> int:
    return self._pad

  @functools.cached_property
  def raw_text_prefix(self) -> str:
    """What a raw-text (non-chat) prompt starts with, as ``transformers``'
    ``tokenizer(text)`` and vLLM encode one: the ``bos_token`` when the tokenizer's own
    post-processor adds it (Llama-style base models), else ``""``. Chat templates write
    their own."""
    bos = self.special_tokens.get("bos_token")
    if bos is None or self.tokenizer.encode("a", add_special_tokens=True).ids[:1] != [
        self._bos]:
      return ""
    # Only where the token's text encodes back to it (an added special token).
    return bos if self.encode(bos) == [self._bos] else ""

  def id_to_token(self, i: int) -> str:
    token = self.tokenizer.id_to_token(int(i)) if 0 <= int(i) < self._vocab_size else None
    return UNKNOWN_CHAR if token is None else token

  # ---- text --------------------------------------------------------------------

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Ids of ``text`` (no special tokens unless asked for)."""
    if not isinstance(text, str):
      raise ValueError(f"`text` must be a str, got {type(text).__name__}.")
    ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
    if add_bos:
      if self._bos is None:
        raise ValueError("`add_bos=True` but the tokenizer has no bos_token.")
      ids = [self._bos] + ids
    if add_eos:
      if self.eos_id is None:
        raise ValueError("`add_eos=True` but the tokenizer has no eos_token.")
      ids = ids + [self.eos_id]
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ``ids`` up to the first eos, special tokens skipped."""
    out, run = [], []
    eos = set(self.eos_ids)
    for i in np.asarray(ids).reshape(-1).tolist():
      if i in eos:
        break
      if 0 <= i < self._vocab_size:
        run.append(i)
        continue
      out.append(self.tokenizer.decode(run, skip_special_tokens=True))
      out.append(UNKNOWN_CHAR)
      run = []
    out.append(self.tokenizer.decode(run, skip_special_tokens=True))
    return "".join(out)

  def decode_batch(self, ids: ArrayLike, mask: ArrayLike | None = None) -> list[str]:
    """`decode` of each row of ``ids`` [B, T]; positions where ``mask`` is 0 are skipped."""
    ids = np.asarray(ids)
    if ids.ndim != 2:
      raise ValueError(f"`ids` must have rank 2 [B, T], got shape {ids.shape}.")
    if mask is None:
      return [self.decode(row) for row in ids]
    mask = np.asarray(mask)
    if mask.shape != ids.shape:
      raise ValueError(f"`mask` must have the shape of `ids` {ids.shape}, got {mask.shape}.")
    return [self.decode(row[m.astype(bool)]) for row, m in zip(ids, mask)]

  def encode_batch(self, prompts: Sequence[str], length: int, left_pad: bool = True, *,
                   add_bos: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and pads ``prompts`` to ``length`` tokens (see ``CharTokenizer``).

    Returns:
      ``(tokens, mask)``, ``np.int32`` ``[B, length]``; padding holds ``pad_id``.

    Raises:
      ValueError: if a prompt is longer than ``length`` tokens.
    """
    return pad_encoded(self.encode, prompts, length, pad_id=self.pad_id,
                       left_pad=left_pad, add_bos=add_bos)

  # ---- chat ----------------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, tokenize: bool = False,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          **kwargs: Any) -> str | list[int]:
    """Renders ``messages`` with the chat template (as ``transformers`` does).

    Args:
      messages: ``[{"role": ..., "content": ...}, ...]``.
      add_generation_prompt: end with the assistant-turn header (note: ``transformers``
        defaults to False; a prompt for sampling wants True).
      tokenize: return ids (``encode`` of the text, no extra special tokens).
      tools: the tools' JSON schemas (``{"type": "function", "function": {...}}``,
        :attr:`jaxrl_llm.envs.Tool.schema`), the template's ``tools`` variable, as in
        ``transformers``; None: no tools.
      **kwargs: more template variables (e.g. ``enable_thinking=False`` for Qwen3);
        they override the special tokens.

    Raises:
      ValueError: if the tokenizer has no chat template.
    """
    if self.chat_template is None:
      raise ValueError("the tokenizer has no chat template (no chat_template.jinja and no "
                       "'chat_template' in tokenizer_config.json).")
    if self._compiled is None:
      self._compiled = compile_chat_template(self.chat_template)
    template: Any = self._compiled
    variables = {**self.special_tokens, **kwargs}
    text = template.render(messages=[dict(m) for m in messages],
                           tools=None if tools is None else [dict(t) for t in tools],
                           documents=None, add_generation_prompt=add_generation_prompt,
                           **variables)
    return self.encode(text) if tokenize else text


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}).") from None


__all__ = ["HFTokenizer", "compile_chat_template", "MAX_TEMPLATE_SIZE"]
