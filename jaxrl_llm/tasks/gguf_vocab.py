"""The tokenizer stored in a GGUF file, read into and written from :class:`HFTokenizer`.

A GGUF file has no ``tokenizer.json``: llama.cpp keeps the vocabulary as metadata under
``tokenizer.ggml.*`` (the tokenizer ``model``, the ``pre``-tokenizer name, ``tokens``,
``token_type``, ``merges`` or ``scores``, the special token ids, ``add_bos_token``) and the
chat template under ``tokenizer.chat_template``. :func:`read_gguf_tokenizer` rebuilds a
``tokenizers.Tokenizer`` from them (:meth:`HFTokenizer.from_gguf` calls it);
:func:`add_gguf_tokenizer` writes those fields for an :class:`HFTokenizer` into a
``gguf.GGUFWriter``, so llama.cpp and :meth:`HFTokenizer.from_gguf` read the same
tokenizer back.

Two tokenizer models are understood:

* ``gpt2``: byte-level BPE (tokens spelled in GPT-2's byte alphabet, ``merges``). The text
  is first cut by the pre-tokenizer that ``tokenizer.ggml.pre`` names:
  :data:`GGUF_PRE_TOKENIZERS` maps each name to the splitting llama.cpp applies for it
  (``llama-vocab.cpp``). ``transformers``' GGUF conversion knows fewer names and uses
  GPT-2's splitting for all others; where the two disagree we follow llama.cpp (the
  reference reader of the format, and the splitting the original ``tokenizer.json`` had).
  Example: ``smollm`` (SmolLM, StarCoder) isolates every digit first, so ``"x  1"``
  gives ``x``, ``ĠĠ``, ``1`` here and in llama.cpp, ``x``, ``Ġ``, ``Ġ``, ``1`` in
  ``transformers``; ``default`` is llama.cpp's default splitting (punctuation runs, then
  GPT-2's, then digit runs), not GPT-2's.
* ``llama``: SentencePiece-style BPE (``tokens`` with ``scores``, ``▁`` for spaces, byte
  tokens ``<0x..>`` as fallback), built as ``transformers``' ``LlamaTokenizer`` builds it:
  a ``▁`` is put before the text (unless ``add_space_prefix`` is false), merges come
  from the file or, without them, from the vocabulary ranked by the scores.

Token types: ``CONTROL`` tokens become special added tokens (matched whole, skipped by
``decode``), ``USER_DEFINED`` ones plain added tokens (matched whole), as in llama.cpp and
``transformers``. ``add_bos_token`` (``add_eos_token``) becomes the tokenizer's
post-processor, so :attr:`HFTokenizer.raw_text_prefix` is the bos for such a model.
``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` (llama.cpp stops generating at them
too) become more end-of-sequence ids.

Needs ``pip install 'jaxrl_llm[gguf]'`` (``gguf``, with ``tokenizers`` and ``jinja2``).
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.model_files import open_gguf, require_gguf


def _require(module: str) -> Any:
  try:
    return __import__(module)
  except ImportError as e:
    raise ImportError(f"{module!r} is needed for GGUF tokenizers: pip install "
                      "'jaxrl_llm[gguf]'.") from e

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
                 rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _splits(*patterns: str) -> Any:
  """Each regex cuts the pieces of the one before (matches and the text between them
  become pieces, as llama.cpp's ``unicode_regex_split``), then bytes are respelled."""
  tk = _require("tokenizers")
  pre = tk.pre_tokenizers
  return pre.Sequence([pre.Split(tk.Regex(p), behavior="isolated") for p in patterns]
                      + [pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2() -> Any:
  return _require("tokenizers").pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                          use_regex=True)


def _digits_gpt2() -> Any:
  pre = _require("tokenizers").pre_tokenizers
  return pre.Sequence([pre.Digits(individual_digits=True),
                       pre.ByteLevel(add_prefix_space=False, use_regex=True)])


def _llama_cpp_default() -> Any:
  return _splits(r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


# name -> (builder of the `tokenizers` pre-tokenizer, ignore_merges: a piece that is a token
# is taken whole, as llama.cpp does for these names). Within a group, the first name is the
# one `add_gguf_tokenizer` writes for a tokenizer.json with that pre-tokenizer.
_GROUPS: list[tuple[Callable[[], Any], bool, tuple[str, ...]]] = [
    (_gpt2, False, ("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2", "jina-es", "jina-de",
                    "jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0", "mellum", "modern-bert",
                    "exaone4", "trillion", "granite-docling")),
    (_digits_gpt2, False, ("smollm", "starcoder", "refact", "command-r", "codeshell",
                           "exaone", "minerva-7b", "mellum2")),
    (functools.partial(_splits, _LLAMA3_SPLIT), True,
     ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano")),
    (functools.partial(_splits, _LLAMA3_SPLIT), False, ("dbrx", "smaug-bpe")),
    (functools.partial(_splits, _QWEN2_SPLIT), False,
     ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2")),
    (functools.partial(_splits, _QWEN35_SPLIT), False, ("qwen35",)),
    (functools.partial(_splits, _TEKKEN_SPLIT), True, ("tekken",)),
    (functools.partial(_splits, _GPT4O_SPLIT), False,
     ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")),
    (_llama_cpp_default, False, ("default",)),
]

GGUF_PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    name: builder for builder, _, names in _GROUPS for name in names}
"""``tokenizer.ggml.pre`` name -> a function building its ``tokenizers`` pre-tokenizer
(for ``tokenizer.ggml.model = gpt2``). Add an entry to support one more name."""

_IGNORE_MERGES = frozenset(name for _, ignore, names in _GROUPS if ignore for name in names)


@functools.cache
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
  """GPT-2's spelling of bytes as printable characters (byte -> character)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  spelling, extra = {}, 0
  for b in range(256):
    if b in keep:
      spelling[b] = chr(b)
    else:
      spelling[b] = chr(256 + extra)
      extra += 1
  return spelling, frozenset(spelling.values())


# ---- reading -------------------------------------------------------------------------


class _Fields:
  """The metadata of a GGUF file, read with ``gguf.GGUFReader``; errors name the file."""

  def __init__(self, path: str) -> None:
    gguf = require_gguf()
    self.path = path
    if not os.path.isfile(path):
      raise ValueError(f"`path` {path!r} is not a file.")
    reader = open_gguf(path)
    self.fields = reader.fields
    self.types = gguf.GGUFValueType

  def __contains__(self, key: str) -> bool:
    return key in self.fields

  def _field(self, key: str) -> Any:
    field = self.fields.get(key)
    if field is None:
      raise ValueError(f"{self.path}: GGUF field {key!r} is missing (a tokenizer needs it).")
    return field

  def _bad(self, key: str, want: str) -> ValueError:
    got = [t.name for t in self.fields[key].types]
    return ValueError(f"{self.path}: GGUF field {key!r} must be {want}, got {got}.")

  def string(self, key: str) -> str:
    field = self._field(key)
    if field.types != [self.types.STRING]:
      raise self._bad(key, "a string")
    return bytes(field.parts[field.data[0]]).decode("utf-8")

  def scalar(self, key: str) -> Any:
    field = self._field(key)
    if len(field.types) != 1 or field.types[0] in (self.types.STRING, self.types.ARRAY):
      raise self._bad(key, "a number or bool")
    return field.parts[field.data[0]][0].item()

  def strings(self, key: str) -> list[str]:
    field = self._field(key)
    if field.types != [self.types.ARRAY, self.types.STRING]:
      raise self._bad(key, "an array of strings")
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

  def numbers(self, key: str) -> np.ndarray:
    field = self._field(key)
    if (len(field.types) != 2 or field.types[0] != self.types.ARRAY
        or field.types[1] in (self.types.STRING, self.types.ARRAY)):
      raise self._bad(key, "an array of numbers")
    if not field.data:
      return np.zeros((0,))
    return np.concatenate([field.parts[i] for i in field.data])

  def get(self, key: str, kind: str = "scalar") -> Any:
    return getattr(self, kind)(key) if key in self.fields else None


def read_gguf_tokenizer(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
  """The tokenizer of a GGUF file (``tokenizer.ggml.*``): ``(tokenizers.Tokenizer,
  keyword arguments of HFTokenizer)``, what :meth:`HFTokenizer.from_gguf` builds its
  tokenizer from. The ``tokenizer.ggml.pre`` name is kept in ``gguf_pre`` (``None``
  for a ``llama`` model).

  Args:
    path: a ``.gguf`` file.

  Returns:
    ``(tokenizer, {"special_tokens", "chat_template", "extra_eos_ids", "gguf_pre"})``.

  Raises:
    ValueError: (one line naming the file and the field) if the file is not a GGUF file,
      is cut short, lacks a tokenizer field, or names a tokenizer model or pre-tokenizer
      this module does not know.

  Examples:
    >>> import os, tempfile, gguf
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
    >>> w = gguf.GGUFWriter(path, "llama")
    >>> w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("gpt-2")
    >>> w.add_token_list(["<eos>", "a", "b", "ab", "Ġ", "Ġab"])
    >>> w.add_token_types([CONTROL] + [NORMAL] * 5)
    >>> w.add_token_merges(["a b", "Ġ ab"]); w.add_eos_token_id(0)
    >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.close()
    >>> from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
    >>> tok = HFTokenizer.from_gguf(path)
    >>> tok.encode("ab ab<eos>"), tok.eos_id, tok.gguf_pre
    ([3, 5, 0], 0, 'gpt-2')
  """
  tokenizers = _require("tokenizers")
  path = os.fspath(path)
  f = _Fields(path)
  model = f.string("tokenizer.ggml.model")
  tokens = f.strings("tokenizer.ggml.tokens")
  types = f.get("tokenizer.ggml.token_type", "numbers")
  types = [NORMAL] * len(tokens) if types is None else [int(t) for t in types]
  if len(types) != len(tokens):
    raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.token_type' has {len(types)} "
                     f"entries for {len(tokens)} tokens.")
  pre_name: str | None = None
  if model == "gpt2":
    pre_name = f.string("tokenizer.ggml.pre") if "tokenizer.ggml.pre" in f else "default"
    if pre_name not in GGUF_PRE_TOKENIZERS:
      raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.pre' = {pre_name!r} is not a "
                       f"known pre-tokenizer (known: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}).")
    merges = f.strings("tokenizer.ggml.merges")
    tok, added = _byte_level(tokenizers, tokens, types, merges, pre_name, path)
  elif model == "llama":
    merges = f.get("tokenizer.ggml.merges", "strings")
    scores = None if merges is not None else f.numbers("tokenizer.ggml.scores")
    prefix = f.get("tokenizer.ggml.add_space_prefix")
    tok, added = _sentencepiece(tokenizers, tokens, types, merges, scores,
                                prefix is None or bool(prefix), path)
  else:
    raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.model' = {model!r} is not "
                     "supported (only 'gpt2' and 'llama').")
  tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True)
                          for t, special in added if special])
  tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                  for t, special in added if not special])

  specials: dict[str, str] = {}
  for key, field in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                     ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    i = f.get(f"tokenizer.ggml.{field}")
    if i is None:
      continue
    if not 0 <= int(i) < len(tokens):
      raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.{field}' = {i} is outside the "
                       f"{len(tokens)} tokens.")
    specials[key] = tokens[int(i)] if tok.token_to_id(tokens[int(i)]) == int(i) else (
        tok.id_to_token(int(i)))
  add_bos = f.get("tokenizer.ggml.add_bos_token")
  if add_bos is None:   # llama.cpp's default for a SentencePiece vocabulary
    add_bos = model == "llama"
  add_eos = bool(f.get("tokenizer.ggml.add_eos_token"))
  _set_post_processor(tokenizers, tok, specials, bool(add_bos), add_eos, path)
  extra = [int(i) for key in ("eot_token_id", "eom_token_id")
           if (i := f.get(f"tokenizer.ggml.{key}")) is not None and 0 <= int(i) < len(tokens)]
  return tok, {"special_tokens": specials,
               "chat_template": f.get("tokenizer.chat_template", "string"),
               "extra_eos_ids": extra, "gguf_pre": pre_name}


def _check_types(types: Sequence[int], path: str) -> None:
  bad = sorted({t for t in types if not NORMAL <= t <= BYTE})
  if bad:
    raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.token_type' holds unknown types "
                     f"{bad} (llama.cpp's are 1..6).")


def _byte_level(tokenizers, tokens: list[str], types: list[int], merges: list[str],
                pre_name: str, path: str) -> tuple[Any, list[tuple[str, bool]]]:
  """Byte-level BPE; the tokens to add whole as ``(text, special)``."""
  _check_types(types, path)
  spelling, alphabet = _byte_alphabet()
  vocab: dict[str, int] = {}
  for i, t in enumerate(tokens):
    # A token written with characters outside the byte alphabet (llama.cpp keeps control
    # and user tokens as plain text) is respelled byte by byte, as transformers does.
    spelled = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
    vocab[spelled] = i   # a repeated token keeps its last id (llama.cpp, transformers)
  model = tokenizers.models.BPE(vocab, _pairs(merges, path),
                                ignore_merges=pre_name in _IGNORE_MERGES)
  tok = tokenizers.Tokenizer(model)
  tok.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre_name]()
  tok.decoder = tokenizers.decoders.ByteLevel()
  added = [(t, True) for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
  added += [(t, False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
  return tok, added


def _pairs(merges: list[str], path: str) -> list[tuple[str, str]]:
  pairs = []
  for k, m in enumerate(merges):
    parts = m.split(" ")
    if len(parts) != 2:
      raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.merges'[{k}] = {m!r} is not two "
                       "tokens separated by one space.")
    pairs.append((parts[0], parts[1]))
  return pairs


def _sentencepiece(tokenizers, tokens: list[str], types: list[int], merges: list[str] | None,
                   scores: np.ndarray | None, space_prefix: bool,
                   path: str) -> tuple[Any, list[tuple[str, bool]]]:
  """SentencePiece-style BPE with byte fallback, as transformers' ``LlamaTokenizer``."""
  _check_types(types, path)
  vocab: dict[str, int] = {}
  for i, t in enumerate(tokens):
    vocab[t] = i
  if merges is not None:
    pairs = _pairs(merges, path)
  else:
    assert scores is not None
    if len(scores) != len(tokens):
      raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.scores' has {len(scores)} "
                       f"entries for {len(tokens)} tokens.")
    pairs = _merges_from_scores(tokens, vocab, [float(s) for s in scores])
  model = tokenizers.models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True)
  tok = tokenizers.Tokenizer(model)
  pre, dec = tokenizers.pre_tokenizers, tokenizers.decoders
  tok.pre_tokenizer = pre.Metaspace(replacement="▁", split=False,
                                    prepend_scheme="first" if space_prefix else "never")
  tok.decoder = dec.Sequence([dec.Replace("▁", " "), dec.ByteFallback(), dec.Fuse()]
                             + ([dec.Strip(" ", 1, 0)] if space_prefix else []))
  added = [(t, True) for t, ty in zip(tokens, types) if ty == CONTROL]
  added += [(t, False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
  return tok, added


def _merges_from_scores(tokens: list[str], vocab: dict[str, int],
                        scores: list[float]) -> list[tuple[str, str]]:
  """Merges a scored vocabulary implies: every cut of a token into two tokens, the best
  score first; ties by the longer left part, then the longer right part, then the order of
  the tokens and of the parts' ids (the order ``transformers`` gives them)."""
  score_of: dict[str, float] = {}
  for t, s in zip(tokens, scores):
    score_of[t] = s   # a repeated token: its first place, its last score (as a dict)
  found = []
  for t, s in score_of.items():
    cuts = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    cuts.sort(key=lambda c: (vocab[c[0]], vocab[c[1]]))
    found += [(left, right, s) for left, right in cuts]
  # A stable sort on the negated key keeps the order above among ties.
  found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
  return [(left, right) for left, right, _ in found]


def _set_post_processor(tokenizers, tok, specials: dict[str, str], add_bos: bool,
                        add_eos: bool, path: str) -> None:
  single, pair, ids = ["$A:0"], ["$A:0", "$B:1"], []
  for flag, key, field in ((add_bos, "bos_token", "bos_token_id"),
                           (add_eos, "eos_token", "eos_token_id")):
    if not flag:
      continue
    token = specials.get(key)
    if token is None:
      raise ValueError(f"{path}: GGUF field 'tokenizer.ggml.add_{key}' is true but "
                       f"'tokenizer.ggml.{field}' is not set.")
    ids.append((token, tok.token_to_id(token)))
    if key == "bos_token":
      single, pair = [f"{token}:0", *single], [f"{token}:0", "$A:0", f"{token}:1", "$B:1"]
    else:
      single, pair = [*single, f"{token}:0"], [*pair[:-1], pair[-1], f"{token}:1"]
  if ids:
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(ids)))


# ---- writing -------------------------------------------------------------------------


def _pre_json(pre: Any) -> Any:
  return None if pre is None else json.loads(pre.__getstate__())


def pre_tokenizer_name(tokenizer: Any) -> str:
  """The ``tokenizer.ggml.pre`` name for a byte-level BPE ``tokenizer``.

  The name recorded by :meth:`HFTokenizer.from_gguf` (:attr:`HFTokenizer.gguf_pre`), else
  the first name of :data:`GGUF_PRE_TOKENIZERS` whose pre-tokenizer is exactly the
  tokenizer's (and whose ``ignore_merges`` matches, where one does), else ``"default"``
  with a warning: llama.cpp then splits the text by its own default rules, which are not
  the tokenizer's, and so does :meth:`HFTokenizer.from_gguf`.

  Examples:
    >>> from tokenizers import Tokenizer, models
    >>> from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
    >>> tk = Tokenizer(models.BPE({"a": 0}, []))
    >>> tk.pre_tokenizer = GGUF_PRE_TOKENIZERS["qwen2"]()
    >>> pre_tokenizer_name(HFTokenizer(tk))
    'qwen2'
  """
  if tokenizer.gguf_pre is not None:
    return tokenizer.gguf_pre
  state = json.loads(tokenizer.tokenizer.to_str())
  want, ignore = state.get("pre_tokenizer"), bool(state["model"].get("ignore_merges"))
  matches = [name for name, build in GGUF_PRE_TOKENIZERS.items()
             if _pre_json(build()) == want]
  for name in matches:
    if (name in _IGNORE_MERGES) == ignore:
      return name
  if matches:
    return matches[0]
  warnings.warn("the tokenizer's pre-tokenizer matches no llama.cpp pre-tokenizer name: "
                "writing tokenizer.ggml.pre = 'default' (llama.cpp will split text "
                "differently).", stacklevel=3)
  return "default"


def add_gguf_tokenizer(writer: Any, tokenizer: Any) -> None:
  """Writes ``tokenizer`` as the ``tokenizer.ggml.*`` fields of a ``gguf.GGUFWriter``.

  Byte-level BPE only: writes ``model`` (``gpt2``), ``pre`` (:func:`pre_tokenizer_name`),
  ``tokens``, ``token_type`` (special added tokens ``CONTROL``, other added tokens
  ``USER_DEFINED``, the rest ``NORMAL``), ``merges``,
  the ``bos``/``eos``/``unknown``/``padding`` ids that the tokenizer has (its second and
  third end-of-sequence ids as ``eot``/``eom``), ``add_bos_token`` (whether
  :attr:`HFTokenizer.raw_text_prefix` is the bos), ``add_space_prefix`` (False) and the
  chat template. The caller writes the rest of the
  file (architecture, tensors).

  Args:
    writer: a ``gguf.GGUFWriter`` before ``write_kv_data_to_file``.
    tokenizer: from :meth:`HFTokenizer.from_gguf` or a Hugging Face ``tokenizer.json``.

  Raises:
    ValueError: (one line) for a tokenizer these fields cannot express: not byte-level
      BPE (a SentencePiece-style ``llama`` vocabulary needs scores, which a ``tokenizers``
      BPE model does not have), a normalizer or a BPE option (dropout, subword
      prefix/suffix) llama.cpp has no field for, or ids with gaps.

  Examples:
    >>> import os, tempfile, gguf
    >>> from tokenizers import Tokenizer, models
    >>> from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
    >>> tk = Tokenizer(models.BPE({"<eos>": 0, "a": 1, "b": 2, "ab": 3}, [("a", "b")]))
    >>> tk.pre_tokenizer = GGUF_PRE_TOKENIZERS["gpt-2"]()
    >>> tok = HFTokenizer(tk, special_tokens={"eos_token": "<eos>"})
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
    >>> w = gguf.GGUFWriter(path, "llama"); add_gguf_tokenizer(w, tok)
    >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.close()
    >>> back = HFTokenizer.from_gguf(path)
    >>> back.encode("abab"), back.eos_id, back.gguf_pre
    ([3, 3], 0, 'gpt-2')
  """
  state = json.loads(tokenizer.tokenizer.to_str())
  model = state["model"]
  if model.get("type") != "BPE":
    raise ValueError(f"`tokenizer`: a {model.get('type')} model cannot be written to GGUF "
                     "(only BPE: tokenizer.ggml.model gpt2 or llama).")
  for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
    if model.get(key):
      raise ValueError(f"`tokenizer`: the BPE option {key}={model[key]!r} has no GGUF field.")
  if state.get("normalizer") is not None:
    raise ValueError(f"`tokenizer`: its normalizer ({state['normalizer'].get('type')}) has no "
                     "GGUF field.")
  if "ByteLevel" not in json.dumps(state.get("pre_tokenizer")) or model.get("byte_fallback"):
    raise ValueError("`tokenizer`: only byte-level BPE (a ByteLevel pre-tokenizer, no byte "
                     "fallback) can be written (tokenizer.ggml.model gpt2).")
  tk = tokenizer.tokenizer
  n = tokenizer.vocab_size
  tokens = [tk.id_to_token(i) for i in range(n)]
  if None in tokens:
    raise ValueError(f"`tokenizer`: id {tokens.index(None)} has no token (GGUF tokens must "
                     f"be the ids 0..{n - 1}).")
  types = [NORMAL] * n
  for i, added in tk.get_added_tokens_decoder().items():
    types[i] = CONTROL if added.special else USER_DEFINED
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  ids = {key: tk.token_to_id(tokenizer.special_tokens[key])
         for key in ("unk_token", "pad_token") if key in tokenizer.special_tokens}
  if tokenizer.bos_id is not None:
    writer.add_bos_token_id(tokenizer.bos_id)
  eos = list(tokenizer.eos_ids)
  if eos:
    writer.add_eos_token_id(eos[0])
  if len(eos) > 1:
    writer.add_eot_token_id(eos[1])
  if len(eos) > 2:
    writer.add_eom_token_id(eos[2])
  if ids.get("unk_token") is not None:
    writer.add_unk_token_id(ids["unk_token"])
  if ids.get("pad_token") is not None:
    writer.add_pad_token_id(ids["pad_token"])
  writer.add_add_bos_token(tokenizer.raw_text_prefix != "")
  writer.add_add_space_prefix(False)
  if tokenizer.chat_template is not None:
    writer.add_chat_template(tokenizer.chat_template)


__all__ = ["GGUF_PRE_TOKENIZERS", "read_gguf_tokenizer", "add_gguf_tokenizer",
           "pre_tokenizer_name"]
