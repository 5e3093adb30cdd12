"""Hugging Face bridge: tokenizers and chat templates, checkpoints in and out.

Everything is built locally (tiny random models and tokenizers saved to tmp dirs); the
module is skipped when the ``[hf]``/test extras (tokenizers, jinja2, safetensors, torch,
transformers) are missing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer  # noqa: E402
from jaxrl_llm.tasks.jsonl import JsonlTask  # noqa: E402

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


def make_tokenizer_dir(path, *, template=CHATML, legacy_config=False, pad=False,
                       adds_bos=False):
  """A small byte-level BPE tokenizer saved by transformers (as a hub folder would be);
  ``adds_bos``: its post-processor puts bos before raw text (a Llama-style base model)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
  tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
      vocab_size=400, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if adds_bos:
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
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
  with pytest.raises(ValueError, match=r"`prompts`\[1\] .* is \d+ tokens, longer than"):
    ours.encode_batch(["hi", "hello world, what is 3 + 4?"], 3)


def test_generation_config_eos_and_default_pad(tmp_path):
  path = make_tokenizer_dir(tmp_path / "tok")
  im_end = HFTokenizer.from_pretrained(path).tokenizer.token_to_id("<|im_end|>")
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [im_end, 1]}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"eos_token_id": 5}, f)
  tok = HFTokenizer.from_pretrained(path)
  assert tok.eos_ids[0] == tok.eos_id and im_end in tok.eos_ids
  assert sorted(tok.eos_ids) == sorted({tok.eos_id, im_end, 1, 5})   # every source, once
  from jaxrl_llm.loop.evaluation import stop_ids
  assert stop_ids(tok) == tok.eos_ids                        # the sampler gets them all
  assert tok.pad_id == tok.eos_id          # no pad_token: pad with eos
  hello = tok.encode("hello")
  assert tok.decode([*hello, im_end, *hello]) == "hello"


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ValueError, match=r"has no tokenizer.json"):
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



@pytest.mark.parametrize("adds_bos", [False, True])
def test_raw_text_prompts_get_the_bos_the_tokenizer_adds(tmp_path, adds_bos):
  # A non-chat prompt is tokenized as transformers' tokenizer(text) (and vLLM) do: with
  # the bos a base model's post-processor adds, and without one where it adds none.
  path = make_tokenizer_dir(tmp_path / "tok", adds_bos=adds_bos)
  tok = HFTokenizer.from_pretrained(path)
  data = tmp_path / "d.jsonl"
  data.write_text(json.dumps({"prompt": "what is 3 + 4?", "answer": "7"}))
  task = JsonlTask(path=str(data), tokenizer=tok, max_new_tokens=8)
  ref = transformers.AutoTokenizer.from_pretrained(path)
  ids = tok.encode(task.eval_problems()[0].prompt)
  assert ids == ref("what is 3 + 4?")["input_ids"]
  assert (ids[0] == tok.bos_id) == adds_bos and task.max_prompt_len == len(ids)


# ----------------------------------------------------------------------- checkpoints

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import functools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_llm.models import (  # noqa: E402
  from_pretrained,
  make_decode_fns,
  save_pretrained,
  split_model,
)
from jaxrl_llm.rollout import sample  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Full float32 matmuls (GPUs default to TF32), so 1e-4 comparisons hold anywhere."""
  with jax.default_matmul_precision("highest"):
    yield


V = 96
COMMON = {"vocab_size": V, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "hidden_act": "silu"}


def _hf_configs():
  """Tiny configs of the three families, each exercising its special features."""
  return {
      # Untied, llama3 rope scaling with every frequency branch active at head_dim 16
      # (wavelength 6 < 32/4 kept, 20 in between smoothed, >= 63 > 32/1 divided).
      "llama": transformers.LlamaConfig(
          **COMMON, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-5,
          tie_word_embeddings=False,
          rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32}),
      # Tied embeddings, q/k/v bias.
      "qwen2": transformers.Qwen2Config(
          **COMMON, hidden_size=32, intermediate_size=48, rms_norm_eps=1e-6,
          tie_word_embeddings=True,
          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
      # q/k norm, explicit head_dim (16 != 32 / 4), untied.
      "qwen3": transformers.Qwen3Config(
          **COMMON, hidden_size=32, intermediate_size=48, head_dim=16, rms_norm_eps=1e-6,
          tie_word_embeddings=False,
          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
  }


_MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def make_hf_model(family, seed=0):
  """A tiny HF model with every parameter randomised (biases and norms included)."""
  torch.manual_seed(seed)
  model = getattr(transformers, _MODEL_CLASSES[family])(_hf_configs()[family])
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model.eval()


@functools.cache
def _saved(family, root):
  path = os.path.join(root, family)
  make_hf_model(family).save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
  return str(tmp_path_factory.mktemp("hf_ckpts"))


def _hf_logits(model, tokens, mask):
  """HF logits with our position convention (k-th real token of a row at k-1)."""
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long))
  return out.logits.float().numpy()


def _our_logits(model, tokens, mask):
  hidden, _ = model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
  return np.asarray(model.logits(hidden))


def _padded_batch(seed=0, b=3, t=12):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (b, t)).astype(np.int32)
  mask = np.ones((b, t), np.int32)
  mask[0, :4] = 0          # left padding
  mask[1, -3:] = 0         # right padding
  return tokens, mask


def _assert_logits_close(ours, ref, mask):
  real = mask.astype(bool)
  scale = np.abs(ref[real]).max()
  np.testing.assert_allclose(ours[real], ref[real], rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(family, ckpt_root):
  path = _saved(family, ckpt_root)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  model = from_pretrained(path, dtype=jnp.float32)
  c = model.config
  assert (c.qkv_bias, c.qk_norm, c.rope_scaling is not None, c.tie_embeddings) == {
      "llama": (False, False, True, False), "qwen2": (True, False, False, True),
      "qwen3": (False, True, False, False)}[family]
  tokens, mask = _padded_batch()
  ours, ref = _our_logits(model, tokens, mask), _hf_logits(hf_model, tokens, mask)
  _assert_logits_close(ours, ref, mask)
  assert np.all(ours[mask == 0] == 0)        # padded positions: zero hidden -> 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_continuation_matches_generate(family, ckpt_root):
  path = _saved(family, ckpt_root)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  model = from_pretrained(path)
  rng = np.random.default_rng(1)
  prompts = rng.integers(0, V, (2, 6)).astype(np.int32)
  mask = np.ones_like(prompts)
  mask[0, :2] = 0
  prompts[0, :2] = 0
  n = 8
  graphdef, params = split_model(model)
  out = sample(make_decode_fns(graphdef), params, jnp.asarray(prompts),
               jnp.asarray(mask), None, max_new_tokens=n, greedy=True)
  with torch.no_grad():
    ref = hf_model.generate(input_ids=torch.tensor(prompts, dtype=torch.long),
                            attention_mask=torch.tensor(mask, dtype=torch.long),
                            do_sample=False, max_new_tokens=n, min_new_tokens=n,
                            eos_token_id=None, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(out.completion),
                                ref[:, prompts.shape[1]:].numpy())
  # Two eos ids (a list, as Llama-3's generation_config.json gives): row 0 stops at
  # the first, row 1 at the second, as generate(eos_token_id=[a, b]) stops them.
  greedy = np.asarray(out.completion)
  eos = [int(greedy[0, 3]), int(greedy[1, 2])]
  pad = V - 1
  stopped = sample(make_decode_fns(graphdef), params, jnp.asarray(prompts),
                   jnp.asarray(mask), None, max_new_tokens=n, greedy=True, eos_id=eos,
                   pad_id=pad)
  with torch.no_grad():
    ref = hf_model.generate(input_ids=torch.tensor(prompts, dtype=torch.long),
                            attention_mask=torch.tensor(mask, dtype=torch.long),
                            do_sample=False, max_new_tokens=n, eos_token_id=eos,
                            pad_token_id=pad)[:, prompts.shape[1]:].numpy()
  ours = np.asarray(stopped.completion)
  np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)
  np.testing.assert_array_equal(ours[:, ref.shape[1]:], pad)
  assert np.asarray(stopped.finished).all()
  for b in range(2):
    assert int(stopped.lengths[b]) == np.nonzero(np.isin(greedy[b], eos))[0][0] + 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_pretrained_roundtrip_through_transformers(family, ckpt_root, tmp_path):
  path = _saved(family, ckpt_root)
  model = from_pretrained(path, value_head=True)
  assert np.all(np.asarray(model.value_w[...]) == 0)      # fresh value head: zeros
  model.value_w[...] = jnp.linspace(-1, 1, model.config.d_model)[:, None]
  out = str(tmp_path / "saved")
  save_pretrained(model, out, extra_config={"bos_token_id": 1})
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                     "model.safetensors", "value_head.safetensors"]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  original = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  tokens, mask = _padded_batch(seed=2)
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens, mask),
                                _hf_logits(original, tokens, mask))
  assert reloaded.config.bos_token_id == 1
  # Ours again, value head included.
  again = from_pretrained(out, value_head=True)
  np.testing.assert_array_equal(np.asarray(again.value_w[...]),
                                np.asarray(model.value_w[...]))
  np.testing.assert_array_equal(_our_logits(again, tokens, mask),
                                _our_logits(model, tokens, mask))


def test_value_head_file_beside_a_plain_policy_folder(tmp_path):
  """save_value_head + from_pretrained(value_head=file): the export layout."""
  from flax import nnx

  from jaxrl_llm.models import Transformer, TransformerConfig
  from jaxrl_llm.models.critic import drop_value_head
  from jaxrl_llm.models.hf import save_value_head
  model = Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0))
  model.value_b[...] = jnp.array([0.25])
  folder, file = str(tmp_path / "hf"), str(tmp_path / "value_head.safetensors")
  save_pretrained(nnx.merge(*drop_value_head(*split_model(model))), folder)
  save_value_head(model, file)
  assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
  again = from_pretrained(folder, value_head=file)
  tokens = jnp.array([[3, 4, 5, 6]])
  np.testing.assert_allclose(np.asarray(again(tokens)[1]), np.asarray(model(tokens)[1]),
                             rtol=1e-6, atol=1e-6)
  assert from_pretrained(folder).config.value_head is False
  with pytest.raises(ValueError, match=r"`value_head` file .* does not exist"):
    from_pretrained(folder, value_head=str(tmp_path / "nope.safetensors"))
  with pytest.raises(ValueError, match="has no value head"):
    save_value_head(from_pretrained(folder), file)


def test_sharded_checkpoint_and_bfloat16(ckpt_root, tmp_path):
  path = _saved("qwen3", ckpt_root)
  model = from_pretrained(path)
  out = str(tmp_path / "sharded")
  save_pretrained(model, out, max_shard_size="20KB")
  shards = sorted(f for f in os.listdir(out) if f.startswith("model-"))
  assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(out)
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    index = json.load(f)
  assert set(index["weight_map"].values()) == set(shards)
  tokens, mask = _padded_batch(seed=3)
  np.testing.assert_array_equal(_our_logits(from_pretrained(out), tokens, mask),
                                _our_logits(model, tokens, mask))
  hf_sharded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  _assert_logits_close(_hf_logits(hf_sharded, tokens, mask),
                       _our_logits(model, tokens, mask), mask)
  # bfloat16: cast on load, saved as bf16, read back by transformers as bf16.
  bf = from_pretrained(out, dtype=jnp.bfloat16)
  assert bf.embed[...].dtype == jnp.bfloat16
  bf_out = str(tmp_path / "bf16")
  save_pretrained(bf, bf_out)
  with open(os.path.join(bf_out, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  assert from_pretrained(bf_out).config.dtype == jnp.bfloat16


_MESH_SCRIPT = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jaxrl_llm.models import from_pretrained
from jaxrl_llm.parallel import make_mesh
path = sys.argv[1]
tokens, mask = np.array(json.loads(sys.argv[2])), np.array(json.loads(sys.argv[3]))
assert jax.device_count() >= 8, jax.device_count()
mesh = make_mesh(data=1, fsdp=4, tensor=2, devices=jax.devices()[:8])
one = from_pretrained(path)
sharded = from_pretrained(path, mesh=mesh)
specs = {
    "embed": sharded.embed[...].sharding.spec,
    "wq": sharded.blocks[0].attn.wq[...].sharding.spec,
    "wo": sharded.blocks[0].attn.wo[...].sharding.spec,
    "w_down": sharded.blocks[0].mlp.w_down[...].sharding.spec,
}
assert len(sharded.blocks[0].attn.wq[...].sharding.device_set) == 8
for a, b in zip(jax.tree.leaves(nnx_state := __import__("flax").nnx.state(one)),
                jax.tree.leaves(__import__("flax").nnx.state(sharded))):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
def logits(m):
  h, _ = m(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
  return np.asarray(m.logits(h))
np.testing.assert_allclose(logits(sharded), logits(one), rtol=1e-5, atol=1e-5)
print("SPECS", {k: str(v) for k, v in specs.items()})
"""


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_mesh_load_equals_single_device(family, ckpt_root):
  """Loads on a (fsdp=4, tensor=2) mesh of 8 devices, in a subprocess forcing 8 CPU
  devices (so it runs on any host, whatever its own device count)."""
  path = _saved(family, ckpt_root)
  tokens, mask = _padded_batch(seed=4, b=4)
  args = [path, json.dumps(tokens.tolist()), json.dumps(mask.tolist())]
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, *args], env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  specs = eval(proc.stdout.split("SPECS", 1)[1])  # noqa: S307 - our own printout
  norm = {k: val.replace("PartitionSpec", "P") for k, val in specs.items()}
  assert norm == {"embed": "P('tensor', 'fsdp')", "wq": "P('fsdp', 'tensor', None)",
                  "wo": "P('tensor', None, 'fsdp')", "w_down": "P('tensor', 'fsdp')"}, norm


# ---------------------------------------------------------------------------- errors


def _copy_ckpt(src, dst):
  import shutil
  shutil.copytree(src, dst)
  return str(dst)


def _edit_config(path, **changes):
  file = os.path.join(path, "config.json")
  with open(file) as f:
    cfg = json.load(f)
  for k, val in changes.items():
    if val is None:
      cfg.pop(k, None)
    else:
      cfg[k] = val
  with open(file, "w") as f:
    json.dump(cfg, f)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "architecture 'MistralForCausalLM' is not supported"),
    ({"architectures": None, "model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling type 'linear' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"intermediate_size": 50},
     (r"tensor 'model.layers.0.mlp.down_proj.weight' has shape \[32, 48\], expected "
      r"\[32, 50\]")),
    ({"tie_word_embeddings": False},
     "tensor 'lm_head.weight' is missing .* tie_word_embeddings=false"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
])
def test_config_errors(ckpt_root, tmp_path, changes, message):
  family = "qwen3" if "attention_bias" in changes else "qwen2"
  path = _copy_ckpt(_saved(family, ckpt_root), tmp_path / "c")
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=message) as info:
    from_pretrained(path)
  assert "\n" not in str(info.value)


def test_tensor_errors(ckpt_root, tmp_path):
  from safetensors.numpy import load_file, save_file
  src = _saved("qwen2", ckpt_root)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  # Missing tensor.
  path = _copy_ckpt(src, tmp_path / "missing")
  partial = {k: val for k, val in tensors.items()
             if k != "model.layers.1.self_attn.k_proj.bias"}
  save_file(partial, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"tensor 'model.layers.1.self_attn.k_proj.bias' is "
                                       "missing"):
    from_pretrained(path)
  # Unexpected tensor (would change the math: an o_proj bias).
  path = _copy_ckpt(src, tmp_path / "extra")
  extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)})
  save_file(extra, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.o_proj.bias' .* "
                                       "not used"):
    from_pretrained(path)
  # Shape mismatch in a tensor.
  path = _copy_ckpt(src, tmp_path / "shape")
  bad = dict(tensors, **{"model.norm.weight": np.ones(31, np.float32)})
  save_file(bad, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' has shape \[31\], "
                                       r"expected \[32\]"):
    from_pretrained(path)
  # Folder problems.
  with pytest.raises(ValueError, match=r"has no config.json"):
    from_pretrained(tmp_path)
  path = _copy_ckpt(src, tmp_path / "noweights")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match=r"has neither model.safetensors nor"):
    from_pretrained(path)


def test_missing_shard(ckpt_root, tmp_path):
  model = from_pretrained(_saved("qwen2", ckpt_root))
  out = str(tmp_path / "s")
  save_pretrained(model, out, max_shard_size=10_000)
  os.remove(os.path.join(out, "model-00002-of-" + sorted(os.listdir(out))[1][-17:]))
  with pytest.raises(ValueError, match=r"names the shard 'model-00002-of-.*missing"):
    from_pretrained(out)


def test_readme_example_runs(tmp_path):
  """The README's "Hugging Face checkpoints and JSONL data" block, on a tiny Qwen3."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(root, "README.md")) as f:
    readme = f.read()
  section = readme.split("## Hugging Face checkpoints and JSONL data", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  model_dir = make_tokenizer_dir(tmp_path / "model")
  tok = HFTokenizer.from_pretrained(model_dir)
  cfg = _hf_configs()["qwen3"]
  cfg.vocab_size = tok.vocab_size
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"what is {i} + {i}?", "answer": 2 * i})
                          + "\n" for i in range(20)))
  out = str(tmp_path / "out")
  line = 'MODEL, DATA, OUT = "models/Qwen3-0.6B", "data/train.jsonl", "runs/qwen3-ppo"'
  assert line in code and "max_new_tokens=64" in code
  code = code.replace(line, f"MODEL, DATA, OUT = {model_dir!r}, {str(data)!r}, {out!r}")
  code = code.replace("max_new_tokens=64", "max_new_tokens=6")
  scope: dict = {}
  exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
  assert int(scope["state"].step) == 3
  assert np.isfinite(float(scope["metrics"]["loss"]))
  assert {"config.json", "model.safetensors", "value_head.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= set(os.listdir(out))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  ours = from_pretrained(out, value_head=True)
  tokens, mask = _padded_batch(seed=5)
  _assert_logits_close(_our_logits(ours, tokens, mask), _hf_logits(reloaded, tokens, mask),
                       mask)
  saved_tok = HFTokenizer.from_pretrained(out)
  conv = CONVERSATIONS[1]
  assert saved_tok.apply_chat_template(conv) == tok.apply_chat_template(conv)
  assert (transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
      conv, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(conv))


def _tiny_hf_folder(tmp_path):
  """A tiny random Qwen3 with a byte-level BPE tokenizer and a chat template."""
  model_dir = make_tokenizer_dir(tmp_path / "model")
  cfg = _hf_configs()["qwen3"]
  cfg.vocab_size = HFTokenizer.from_pretrained(model_dir).vocab_size
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"what is {i} + {i}?", "answer": 2 * i})
                          + "\n" for i in range(20)))
  return model_dir, str(data)


@pytest.mark.slow     # 18-26 s each on 2 cores (a CLI run on a checkpoint)
@pytest.mark.parametrize("algo, extra", [
    ("ppo", []), ("grpo", []),
    ("ppo", ["--critic", "policy", "--value-lr", "1e-4"]),   # a separate critic
])
def test_cli_train_on_local_checkpoint_and_jsonl(tmp_path, capsys, algo, extra):
  from jaxrl_llm import cli
  model_dir, data = _tiny_hf_folder(tmp_path)
  out = str(tmp_path / "run")
  rc = cli.main(["train", "--model", model_dir, "--dataset", data, "--reward", "math",
                 "--algo", algo, "--steps", "2", "--prompts-per-step", "2",
                 "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "3",
                 "--eval-every", "2", "--save-every", "2", "--out", out, "--no-progress",
                 *extra])
  assert rc == 0
  printed = capsys.readouterr().out        # the summary names the exported folders
  assert re.search(rf"hf_model +{re.escape(os.path.join(out, 'hf'))} \(step 2\)", printed)
  assert ("value_model" in printed) == (algo == "ppo")
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in rows[1:])
  assert "eval_reward" in rows[-1]
  if extra:
    assert all(np.isfinite(r["vf_loss"]) for r in rows[1:])
  if algo == "ppo" and not extra:   # the eval command restores the run (model and task
    assert cli.main(["eval", "--out", out, "--eval-size", "2"]) == 0  # from config.json)
  from jaxrl_llm.loop.export import restore_run
  _, model, critic_model, step = restore_run(out)
  assert step == 2
  _check_export(model, critic_model, out, model_dir, algo, critic=bool(extra))
  if extra:   # `jaxrl-llm export RUN --out DEST` writes the same folders elsewhere
    dest = str(tmp_path / "exported")
    assert cli.main(["export", out, "--out", dest]) == 0
    _check_export(model, critic_model, dest, model_dir, algo, critic=True)


def _check_export(model, critic_model, dest, model_dir, algo, *, critic):
  """``dest/hf`` is a plain HF folder of the trained policy ``model`` (transformers
  loads it and its tokenizer; its logits are ours), the value model is kept beside it."""
  hf_dir = os.path.join(dest, "hf")
  files = set(os.listdir(hf_dir))
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= files and "value_head.safetensors" not in files
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
  tokens, mask = _padded_batch(seed=7, t=10)
  tokens %= model.config.vocab_size
  ours = _our_logits(model, tokens, mask)
  _assert_logits_close(ours, _hf_logits(hf_model, tokens, mask), mask)
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert hf_tok("what is 2 + 2?")["input_ids"] == HFTokenizer.from_pretrained(
      model_dir).encode("what is 2 + 2?")
  value_file = os.path.join(dest, "value_head.safetensors")
  if critic:
    again = from_pretrained(os.path.join(dest, "critic"), value_head=True)
    np.testing.assert_array_equal(np.asarray(again.value_w[...]),
                                  np.asarray(critic_model.value_w[...]))
    assert not os.path.exists(value_file)
  elif algo == "ppo":
    again = from_pretrained(hf_dir, value_head=value_file)
    _, ref_values = model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    _, values = again(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(values), np.asarray(ref_values), atol=1e-6)
  else:
    assert not os.path.exists(value_file)


def test_cli_rejects_checkpoint_without_dataset(tmp_path, capsys):
  from jaxrl_llm import cli
  model_dir, data = _tiny_hf_folder(tmp_path)
  rc = cli.main(["train", "--model", str(tmp_path / "nope"), "--dataset", data,
                 "--out", str(tmp_path / "r")])
  assert rc == 2 and "unknown model" in capsys.readouterr().err
  rc = cli.main(["train", "--model", model_dir, "--dataset", data, "--reward", "nope",
                 "--out", str(tmp_path / "r")])
  assert rc == 2 and "unknown reward 'nope'" in capsys.readouterr().err
  rc = cli.main(["train", "--model", model_dir, "--out", str(tmp_path / "r")])
  assert rc == 2 and "needs --dataset" in capsys.readouterr().err
