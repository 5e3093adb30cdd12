"""Hugging Face bridge: tokenizers and chat templates, checkpoints in and out.

Everything is built locally (tiny random models and tokenizers saved to tmp dirs); the
module is skipped when the ``[hf]``/test extras (tokenizers, jinja2, safetensors, torch,
transformers) are missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
from jaxrl_llm.tasks.jsonl import JsonlTask

# ------------------------------------------------------------------------- tokenizers

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA3_LIKE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] | trim %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if loop.index0 == 1 and ns.system %}
        {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
{%- if meta is defined %}{{ meta | tojson }}{% endif %}
"""

CORPUS = ["hello world, what is 3 + 4? The answer is 7.", "Ünïcode ☃ and émojis 😀",
          "system user assistant You are helpful. Be brief."]


def make_tokenizer_dir(path, *, template=CHATML, legacy_config=False, pad=False):
  """A small byte-level BPE tokenizer saved by transformers (as a hub folder would be)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
  tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
      vocab_size=400, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  kwargs = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
  if pad:
    kwargs["pad_token"] = "<|pad|>"
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template,
                                              **kwargs)
  fast.save_pretrained(path)
  if legacy_config:   # the pre-v5 layout: the template inside tokenizer_config.json
    os.remove(os.path.join(path, "chat_template.jinja"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
      cfg = json.load(f)
    cfg["chat_template"] = template
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|eos|>", "lstrip": False,
                        "rstrip": False, "normalized": False, "single_word": False}
    with open(cfg_path, "w") as f:
      json.dump(cfg, f)
  return str(path)


CONVERSATIONS = [
    [{"role": "user", "content": "what is 3 + 4?"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " hi ☃"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "3 + 4?"}],
]


@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE])
@pytest.mark.parametrize("legacy", [False, True])
def test_chat_template_matches_transformers(tmp_path, template, legacy):
  path = make_tokenizer_dir(tmp_path / "tok", template=template, legacy_config=legacy)
  ours = HFTokenizer.from_pretrained(path)
  ref = transformers.AutoTokenizer.from_pretrained(path)
  for conv in CONVERSATIONS:
    for gen in (False, True):
      expected = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
      assert ours.apply_chat_template(conv, add_generation_prompt=gen) == expected
      ids = ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
      ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
      assert ours.apply_chat_template(conv, add_generation_prompt=gen,
                                      tokenize=True) == list(ids)
  # Extra template variables (and tojson without HTML escaping).
  if template is LLAMA3_LIKE:
    meta = {"a": "<b>☃"}
    assert (ours.apply_chat_template(CONVERSATIONS[0], meta=meta)
            == ref.apply_chat_template(CONVERSATIONS[0], tokenize=False,
                                       add_generation_prompt=True, meta=meta))
    with pytest.raises(Exception, match="unknown role tool"):
      ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_encode_decode_match_transformers(tmp_path):
  path = make_tokenizer_dir(tmp_path / "tok", pad=True)
  ours = HFTokenizer.from_pretrained(path)
  ref = transformers.AutoTokenizer.from_pretrained(path)
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
      ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
  assert ours.vocab_size == len(ref)
  for text in CORPUS + ["", " leading space", "unseen wörds Ω"]:
    ids = ours.encode(text)
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
  ids = ours.encode("hello world", add_bos=True, add_eos=True)
  assert ids[0] == ours.bos_id and ids[-1] == ours.eos_id
  # decode stops at eos, skips special tokens, marks out-of-vocabulary ids.
  hello = ours.encode("hello")
  assert ours.decode([ours.bos_id, *hello, ours.eos_id, *hello]) == "hello"
  assert ours.decode([*hello, ours.vocab_size + 3, *hello]) == "hello\ufffdhello"
  tokens, mask = ours.encode_batch(["hello", "hello world"], 6)
  assert tokens.dtype == np.int32 and tokens.shape == (2, 6)
  assert (tokens[mask == 0] == ours.pad_id).all() and mask[1, -1] == 1
  assert ours.decode_batch(tokens, mask) == ["hello", "hello world"]
  with pytest.raises(ValueError, match=r"`prompts`\[1\] is \d+ tokens, longer than"):
    ours.encode_batch(["hi", "hello world, what is 3 + 4?"], 3)


def test_generation_config_eos_and_default_pad(tmp_path):
  path = make_tokenizer_dir(tmp_path / "tok")
  im_end = HFTokenizer.from_pretrained(path).tokenizer.token_to_id("<|im_end|>")
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [im_end, 1]}, f)
  tok = HFTokenizer.from_pretrained(path)
  assert tok.eos_ids[0] == tok.eos_id and im_end in tok.eos_ids
  assert tok.pad_id == tok.eos_id          # no pad_token: pad with eos
  hello = tok.encode("hello")
  assert tok.decode([*hello, im_end, *hello]) == "hello"


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    HFTokenizer.from_pretrained(tmp_path)
  path = make_tokenizer_dir(tmp_path / "tok", template=None)
  tok = HFTokenizer.from_pretrained(path)
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(CONVERSATIONS[0])


def test_jsonl_task_with_chat_template(tmp_path):
  path = make_tokenizer_dir(tmp_path / "tok")
  tok = HFTokenizer.from_pretrained(path)
  data = tmp_path / "d.jsonl"
  data.write_text("\n".join(json.dumps(r) for r in [
      {"prompt": "what is 3 + 4?", "answer": "7"},
      {"messages": CONVERSATIONS[1], "answer": "#### 7"},
  ]))
  plain = JsonlTask(path=str(data), tokenizer=tok, max_new_tokens=8)
  chat = JsonlTask(path=str(data), tokenizer=tok, chat=True, system_prompt="Be brief.")
  ref = transformers.AutoTokenizer.from_pretrained(path)
  p_plain, p_chat = plain.eval_problems(), chat.eval_problems()
  assert p_plain[0].prompt == "what is 3 + 4?"
  assert p_plain[1].prompt == ref.apply_chat_template(CONVERSATIONS[1], tokenize=False,
                                                      add_generation_prompt=True)
  assert p_chat[0].prompt == ref.apply_chat_template(
      [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "what is 3 + 4?"}],
      tokenize=False, add_generation_prompt=True)
  assert chat.max_prompt_len == max(len(tok.encode(p.prompt)) for p in p_chat)
  assert chat.score(p_chat, ["The answer is 7.", "8"]).tolist() == [1.0, 0.0]

