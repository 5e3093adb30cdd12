r"""GGUF files (llama.cpp, Ollama, LM Studio) in and out of the reference :class:`Transformer`.

:func:`from_gguf` reads a ``.gguf`` file of the ``llama``, ``qwen2`` or ``qwen3``
architecture into the same model :func:`~jaxrl_llm.models.from_pretrained` returns;
:func:`save_gguf` writes a model (and its tokenizer) as a file llama.cpp loads. Both go
through the ``gguf`` package, the llama.cpp project's own NumPy reader and writer
(``pip install 'jaxrl_llm[gguf]'``); no torch.

Tensors. Each tensor is dequantized with ``gguf.quants.dequantize`` (bit for bit what
the ``gguf`` package computes) into float32, in the Hugging Face layout (``[out, in]``;
GGUF lists dimensions innermost first, ``ne0`` = ``in``), then read through the same
layout table as a Hugging Face checkpoint (:func:`~jaxrl_llm.models.hf.hf_layout`). The
names are llama.cpp's (:data:`GGUF_NAMES`):

==========================================  ==========================================
GGUF tensor                                 Hugging Face tensor
==========================================  ==========================================
``token_embd.weight``                       ``model.embed_tokens.weight``
``output_norm.weight``                      ``model.norm.weight``
``output.weight`` (absent when tied)        ``lm_head.weight``
``blk.{i}.attn_norm.weight``                ``model.layers.{i}.input_layernorm.weight``
``blk.{i}.attn_{q,k,v}.{weight,bias}``      ``...self_attn.{q,k,v}_proj.{weight,bias}``
``blk.{i}.attn_output.weight``              ``...self_attn.o_proj.weight``
``blk.{i}.attn_{q,k}_norm.weight``          ``...self_attn.{q,k}_norm.weight``
``blk.{i}.ffn_norm.weight``                 ``...post_attention_layernorm.weight``
``blk.{i}.ffn_{gate,up,down}.weight``       ``...mlp.{gate,up,down}_proj.weight``
==========================================  ==========================================

RoPE permutation (``llama`` only). llama.cpp's converter reorders the rows of each
head of ``attn_q`` and ``attn_k`` from Hugging Face's rotate-half pairing
``(j, j + d/2)`` to interleaved pairs ``(2j, 2j + 1)``: with rows of one head indexed
``r = h d + s i + j`` (``s`` in {0, 1} selects the half, ``j < d/2``),

.. math::
  W^{\mathrm{gguf}}_{h d + 2 j + s} = W^{\mathrm{hf}}_{h d + s \cdot d/2 + j},

per head ``h`` of ``n_head`` (queries) or ``n_head_kv`` (keys). :func:`unpermute_rope`
is its exact inverse (a reshape and a swap of axes: no arithmetic), applied on read;
:func:`permute_rope` on write. ``qwen2``/``qwen3`` files are not permuted.

Hyper-parameters come from the ``{arch}.*`` metadata (``block_count``,
``embedding_length``, ``feed_forward_length``, ``attention.head_count[_kv]``,
``attention.key_length``, ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``,
``context_length``) and are checked by the same rules as a ``config.json``
(:func:`~jaxrl_llm.models.hf.config_from_hf`). What is not supported is one
``ValueError`` naming the file and the field, before any tensor is read: another
architecture, a quantization type outside :data:`READ_TYPES`, RoPE scaling (a
``rope.scaling.type`` or a ``rope_freqs`` tensor), partial rotary dimensions, a
truncated file or one that is not GGUF.

Examples:
  >>> import os, tempfile
  >>> from flax import nnx
  >>> from jaxrl_llm.models import Transformer, get_config
  >>> model = Transformer(get_config("tiny", 32, value_head=False), rngs=nnx.Rngs(0))
  >>> path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
  >>> save_gguf(model, path)                        # f32: exact
  >>> loaded = from_gguf(path)
  >>> tokens = jnp.array([[1, 2, 3]])
  >>> bool((model.logits(model(tokens)[0]) == loaded.logits(loaded(tokens)[0])).all())
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from jaxrl_llm._names import GGUF_WRITE_TYPES
from jaxrl_llm.model_files import open_gguf, require_gguf
from jaxrl_llm.models.hf import (
  ArrayTensor,
  config_from_hf,
  config_model_type,
  hf_shapes,
  hf_tensors,
  load_model,
)
from jaxrl_llm.models.transformer import Transformer, TransformerConfig, split_model

if TYPE_CHECKING:
  from jaxrl_llm.parallel.sharding import Rules

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Quantization types read (every one the gguf package dequantizes in NumPy that a
# llama/qwen checkpoint uses in practice).
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
              "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# --gguf-type: what save_gguf writes for the 2-D weight matrices (1-D norms and biases
# stay F32, as llama.cpp's converter keeps them).
WRITE_TYPES = GGUF_WRITE_TYPES
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16",
               "q8_0": "MOSTLY_Q8_0"}

# Hugging Face name (after ``model.layers.{i}.`` for per-layer ones) -> llama.cpp's.
GGUF_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_GGUF_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_HF_NAMES = {v: k for k, v in LAYER_GGUF_NAMES.items()}
_HF_NAMES = {v: k for k, v in GGUF_NAMES.items()}


def gguf_name(hf_name: str) -> str:
  """llama.cpp's tensor name of the Hugging Face tensor ``hf_name``.

  Examples:
    >>> gguf_name("model.layers.3.self_attn.o_proj.weight")
    'blk.3.attn_output.weight'
    >>> gguf_name("lm_head.weight")
    'output.weight'
  """
  if hf_name in GGUF_NAMES:
    return GGUF_NAMES[hf_name]
  parts = hf_name.split(".", 3)
  if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_GGUF_NAMES:
    return f"blk.{parts[2]}.{LAYER_GGUF_NAMES[parts[3]]}"
  raise ValueError(f"tensor {hf_name!r} has no GGUF name.")


def hf_name(name: str) -> str | None:
  """The Hugging Face name of llama.cpp's tensor ``name`` (``None`` if it has none).

  Examples:
    >>> hf_name("blk.0.ffn_down.weight"), hf_name("rope_freqs.weight")
    ('model.layers.0.mlp.down_proj.weight', None)
  """
  if name in _HF_NAMES:
    return _HF_NAMES[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_HF_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_HF_NAMES[parts[2]]}"
  return None


def _rope_permuted(arch: str, n_heads: int, n_kv_heads: int) -> dict[str, int]:
  """``{tensor suffix: heads}`` of the tensors whose rows llama.cpp permutes for
  ``arch`` (llama's ``attn_q``/``attn_k``; none for qwen2/qwen3)."""
  if arch != "llama":
    return {}
  return {"attn_q.weight": n_heads, "attn_k.weight": n_kv_heads}


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Hugging Face's rotate-half rows of ``w`` ``[n_heads * d, ...]`` in llama.cpp's
  interleaved order (the module docstring's formula).

  Examples:
    >>> permute_rope(np.arange(8), 2).tolist()      # 2 heads of d = 4
    [0, 2, 1, 3, 4, 6, 5, 7]
    >>> x = np.random.default_rng(0).normal(size=(12, 3))
    >>> bool((unpermute_rope(permute_rope(x, 3), 3) == x).all())
    True
  """
  rows = w.shape[0]
  return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """The inverse of :func:`permute_rope`: llama.cpp's interleaved rows of ``w`` back in
  Hugging Face's rotate-half order.

  Examples:
    >>> unpermute_rope(np.array([0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
  """
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


# ---------------------------------------------------------------------------- read


def gguf_metadata(reader: Any) -> dict[str, Any]:
  """``{key: value}`` of the scalar and string metadata of a ``gguf.GGUFReader``
  (arrays such as the tokenizer's tokens are left out)."""
  gguf = require_gguf()
  out = {}
  for key, field in reader.fields.items():
    if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
      continue
    out[key] = field.contents()
  return out


def _f32(x: Any) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
  9.999999747378752e-06)."""
  return float(str(np.float32(x)))


def config_from_gguf(metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
                     *, file: str = "GGUF",
                     dtype: DTypeLike | None = None,
                     value_head: bool = False) -> TransformerConfig:
  """The :class:`TransformerConfig` of a GGUF file's metadata and tensor names.

  Args:
    metadata: :func:`gguf_metadata` of the file.
    tensor_shapes: ``{GGUF tensor name: shape}`` of the file, rows first (the
      vocabulary is ``token_embd.weight``'s rows; tied embeddings: no
      ``output.weight``; ``qwen2`` biases and ``qwen3`` norms follow the architecture).
    file: the file's name, for error messages.
    dtype: parameter dtype (default float32: every GGUF type dequantizes into it).
    value_head: add a value head.

  Raises:
    ValueError: ``"FILE: FIELD ..."`` for an unsupported architecture or setting.

  Examples:
    >>> meta = {"general.architecture": "qwen3", "qwen3.block_count": 2,
    ...         "qwen3.embedding_length": 32, "qwen3.feed_forward_length": 48,
    ...         "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
    ...         "qwen3.attention.key_length": 16, "qwen3.attention.value_length": 16,
    ...         "qwen3.rope.freq_base": 1e6, "qwen3.context_length": 128,
    ...         "qwen3.attention.layer_norm_rms_epsilon": 1e-6}
    >>> cfg = config_from_gguf(meta, {"token_embd.weight": (64, 32)})
    >>> cfg.vocab_size, cfg.dim_per_head, cfg.qk_norm, cfg.tie_embeddings, cfg.norm_eps
    (64, 16, True, True, 1e-06)
  """
  arch = metadata.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"{file}: general.architecture {arch!r} is not supported "
                     f"(supported: {list(ARCHITECTURES)}).")
  names = set(tensor_shapes)

  def get(key: str, default: Any = None, *, required: bool = False) -> Any:
    full = f"{arch}.{key}"
    if full not in metadata:
      if required:
        raise ValueError(f"{file}: metadata field {full!r} is missing.")
      return default
    return metadata[full]

  scaling = get("rope.scaling.type")
  if scaling not in (None, "none"):
    raise ValueError(f"{file}: {arch}.rope.scaling.type {scaling!r} is not supported "
                     "(only none).")
  if "rope_freqs.weight" in names:
    raise ValueError(f"{file}: tensor 'rope_freqs.weight' (Llama-3.1-style RoPE scaling "
                     "factors) is not supported.")
  if "token_embd.weight" not in names:
    raise ValueError(f"{file}: tensor 'token_embd.weight' is missing.")
  vocab = int(tensor_shapes["token_embd.weight"][0])
  if int(get("vocab_size", vocab)) != vocab:
    raise ValueError(f"{file}: {arch}.vocab_size {get('vocab_size')} differs from "
                     f"token_embd.weight's {vocab} rows.")
  d = int(get("embedding_length", required=True))
  n_heads = int(get("attention.head_count", required=True))
  head_dim = int(get("attention.key_length", d // n_heads))
  if int(get("attention.value_length", head_dim)) != head_dim:
    raise ValueError(f"{file}: {arch}.attention.value_length "
                     f"{get('attention.value_length')} differs from key_length {head_dim}.")
  rotary = int(get("rope.dimension_count", head_dim))
  if rotary != head_dim:
    raise ValueError(f"{file}: {arch}.rope.dimension_count {rotary} < head dim {head_dim} "
                     "(partial rotary) is not supported.")
  hf = {
      "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM"}[arch]],
      "model_type": arch, "hidden_size": d, "num_attention_heads": n_heads,
      "num_hidden_layers": int(get("block_count", required=True)),
      "intermediate_size": int(get("feed_forward_length", required=True)),
      "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
      "head_dim": head_dim, "rope_theta": _f32(get("rope.freq_base", 10000.0)),
      "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
      "max_position_embeddings": int(get("context_length", 2048)),
      "vocab_size": vocab,
      "tie_word_embeddings": "output.weight" not in names,
  }
  try:
    return config_from_hf(hf, dtype=jnp.float32 if dtype is None else dtype,
                          value_head=value_head)
  except ValueError as e:
    raise ValueError(f"{file}: {e}") from None


def _check_tensor(tensor, file: str) -> None:
  """A tensor the reader found: a supported type, and all its bytes in the file."""
  kind = tensor.tensor_type.name
  if kind not in READ_TYPES:
    raise ValueError(f"{file}: tensor {tensor.name!r} has quantization type {kind}, "
                     f"which is not supported (supported: {', '.join(READ_TYPES)}).")
  if tensor.data.nbytes != tensor.n_bytes:
    raise ValueError(f"{file}: tensor {tensor.name!r} is truncated ({tensor.data.nbytes} "
                     f"of {tensor.n_bytes} bytes).")


class GGUFTensors:
  """The tensors of a GGUF file as a :class:`~jaxrl_llm.models.hf.TensorSource`:
  Hugging Face names, each dequantized to float32 in Hugging Face layout (``llama``
  q/k rows un-permuted) when :meth:`tensor` is called, one at a time.

  Attributes:
    files: ``{Hugging Face name: GGUF tensor}`` of every tensor with a Hugging Face name.
    unnamed: the GGUF names with none (refused by :func:`from_gguf`).
  """

  def __init__(self, reader: Any, file: str, *, arch: str, n_heads: int,
               n_kv_heads: int) -> None:
    self.file = file
    self._permute = _rope_permuted(arch, n_heads, n_kv_heads)
    self.files: dict[str, Any] = {}
    self.unnamed: list[str] = []
    for t in reader.tensors:
      name = hf_name(t.name)
      if name is None:
        self.unnamed.append(t.name)
      else:
        self.files[name] = t

  def array(self, name: str) -> np.ndarray:
    """Tensor ``name`` (a Hugging Face name) dequantized, in Hugging Face layout."""
    gguf = require_gguf()
    t = self.files[name]
    _check_tensor(t, self.file)
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    x = np.asarray(x, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
    heads = self._permute.get(t.name.split(".", 2)[-1])
    return unpermute_rope(x, heads) if heads else x

  def tensor(self, name: str, hint: str = "") -> ArrayTensor:
    if name not in self.files:
      raise ValueError(f"{self.file}: tensor {gguf_name(name)!r} is missing{hint}.")
    return ArrayTensor(self.array(name))


def read_gguf(path: str | os.PathLike, *, dtype: DTypeLike | None = None,
              value_head: bool = False) -> tuple[TransformerConfig, GGUFTensors, dict]:
  """``(config, tensors, metadata)`` of a GGUF file, every field and tensor type
  checked (nothing dequantized yet).

  Raises:
    ValueError: one line naming the file and the field or tensor.
  """
  file = os.fspath(path)
  reader = open_gguf(file)
  metadata = gguf_metadata(reader)
  shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
  config = config_from_gguf(metadata, shapes, file=file, dtype=dtype,
                            value_head=value_head)
  for t in reader.tensors:
    _check_tensor(t, file)
  tensors = GGUFTensors(reader, file, arch=metadata["general.architecture"],
                        n_heads=config.n_heads, n_kv_heads=config.n_kv_heads)
  if tensors.unnamed:
    raise ValueError(f"{file}: tensor {tensors.unnamed[0]!r} is not used by the "
                     f"{metadata['general.architecture']!r} layout "
                     f"({len(tensors.unnamed)} unused).")
  return config, tensors, metadata


def from_gguf(path: str | os.PathLike, *, dtype: DTypeLike | None = None,
              mesh: Mesh | None = None, rules: Rules | None = None,
              value_head: bool | str | os.PathLike | None = False) -> Transformer:
  """Loads a llama.cpp GGUF file (``llama`` / ``qwen2`` / ``qwen3``) into a
  :class:`Transformer`, the model :func:`~jaxrl_llm.models.from_pretrained` returns.

  Args:
    path: the ``.gguf`` file.
    dtype: parameter dtype (default float32; quantized tensors are dequantized into it).
    mesh: a ``jax.sharding.Mesh``: each parameter is placed straight into its sharded
      layout (each tensor is dequantized once, on the host, then sliced).
    rules: logical-axis rule overrides for ``mesh``.
    value_head: ``True``: a value head initialised to zeros (a GGUF file has none);
      a file path: read from that ``value_head.safetensors``
      (:func:`~jaxrl_llm.models.hf.save_value_head`); ``False``/``None``: none.

  Returns:
    The model.

  Raises:
    ValueError: one line naming the file and the field or tensor (the module
      docstring lists what is refused).
  """
  if value_head is None:
    value_head = False
  value_file = None
  if not isinstance(value_head, bool):
    value_file = os.fspath(value_head)
    if not os.path.isfile(value_file):
      raise ValueError(f"`value_head` file {value_file!r} does not exist.")
  config, tensors, _ = read_gguf(path, dtype=dtype, value_head=value_head is not False)
  return load_model(config, tensors, value_file=value_file, mesh=mesh, rules=rules,
                    origin=os.fspath(path))


# --------------------------------------------------------------------------- write


@dataclasses.dataclass(frozen=True)
class _Planned:
  """One tensor to write: its GGUF name, type, and HF shape."""

  name: str
  qtype: Any          # gguf.GGMLQuantizationType
  shape: tuple[int, ...]


def _write_type(gguf, shape: tuple[int, ...], gguf_type: str):
  """The type a tensor of HF ``shape`` is written in: 1-D tensors F32 (as llama.cpp's
  converter keeps norms and biases), matrices ``gguf_type``; Q8_0 needs rows of whole
  blocks of 32 and falls back to F16 otherwise (llama.cpp's converter does the same)."""
  q = gguf.GGMLQuantizationType
  if len(shape) == 1 or gguf_type == "f32":
    return q.F32
  kind = {"f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[gguf_type]
  block = gguf.GGML_QUANT_SIZES[kind][0]
  return kind if shape[-1] % block == 0 else q.F16


def _encode(gguf, x: np.ndarray, qtype) -> np.ndarray:
  """``x`` (float32, HF layout) in the bytes/values the writer stores for ``qtype``."""
  if qtype == gguf.GGMLQuantizationType.F32:
    return np.ascontiguousarray(x, np.float32)
  return np.ascontiguousarray(gguf.quants.quantize(np.asarray(x, np.float32), qtype))


def _add_hparams(writer, config: TransformerConfig, gguf_type: str, gguf) -> None:
  c = config
  writer.add_context_length(c.max_seq_len)
  writer.add_embedding_length(c.d_model)
  writer.add_block_count(c.n_layers)
  writer.add_feed_forward_length(c.d_ff)
  writer.add_head_count(c.n_heads)
  writer.add_head_count_kv(c.n_kv_heads)
  writer.add_key_length(c.dim_per_head)
  writer.add_value_length(c.dim_per_head)
  writer.add_rope_dimension_count(c.dim_per_head)
  writer.add_rope_freq_base(float(c.rope_theta))
  writer.add_layer_norm_rms_eps(float(c.norm_eps))
  writer.add_vocab_size(c.vocab_size)
  writer.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[gguf_type])))
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gguf_tensors(config: TransformerConfig, params: Any) -> Iterator[tuple[str, np.ndarray]]:
  """``(GGUF name, float32 tensor in HF layout, q/k permuted for llama)`` of each policy
  parameter, one at a time (:func:`~jaxrl_llm.models.hf.hf_tensors` renamed)."""
  perm = _rope_permuted(config_model_type(config), config.n_heads, config.n_kv_heads)
  for name, x in hf_tensors(config, params, dtype=jnp.float32):
    g = gguf_name(name)
    heads = perm.get(g.split(".", 2)[-1])
    yield g, permute_rope(x, heads) if heads else x


def save_gguf(model: Transformer, path: str | os.PathLike, *, gguf_type: str = "f32",
              tokenizer: Any = None, name: str | None = None) -> None:
  """Writes ``model`` as a GGUF file llama.cpp loads (``llama``/``qwen2``/``qwen3``).

  Tensors are converted and written one at a time (the model is never held twice on
  the host). 2-D weights are stored as ``gguf_type``, norms and biases as F32:

  * ``f32``: exact (:func:`from_gguf` gives the same parameters bit for bit);
  * ``f16`` / ``bf16``: each weight rounded to nearest, relative error at most
    ``2^-11`` / ``2^-8`` (normal range);
  * ``q8_0``: blocks of 32 along a row, ``q = round(x / d)``, ``d = max|x| / 127``
    stored in float16, so ``|x - q d_{16}| <= (1/2 + 127 \\cdot 2^{-11}) d``; a matrix
    whose rows are not whole blocks is stored F16.

  With several processes every process must call this (sharded arrays are gathered)
  and process 0 writes.

  Args:
    model: the model.
    path: the ``.gguf`` file to write (its folder is created; an existing file is
      replaced once the new one is complete).
    gguf_type: one of :data:`WRITE_TYPES`.
    tokenizer: an :class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer` whose vocabulary,
      special ids and chat template go into the file (llama.cpp needs them to run it).
    name: ``general.name`` (default the file's stem).

  Raises:
    ValueError: an unknown ``gguf_type``, or a model GGUF cannot express (RoPE
      scaling, a value head is left out silently: it is no part of the model).
  """
  gguf = require_gguf()
  if gguf_type not in WRITE_TYPES:
    raise ValueError(f"`gguf_type` must be one of {list(WRITE_TYPES)}, got {gguf_type!r}.")
  config = model.config
  if config.rope_scaling is not None:
    raise ValueError("`model` uses llama3 RoPE scaling, which save_gguf does not write.")
  arch = config_model_type(config)
  _, params = split_model(model)
  shapes = hf_shapes(config, params)
  plan = [_Planned(gguf_name(n), _write_type(gguf, s, gguf_type), s)
          for n, s in shapes.items()]
  if jax.process_index() != 0:
    for _ in gguf_tensors(config, params):      # every process joins the gathers
      pass
    return
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".partial"
  writer = gguf.GGUFWriter(tmp, arch)
  try:
    writer.add_name(name or os.path.splitext(os.path.basename(path))[0])
    _add_hparams(writer, config, gguf_type, gguf)
    if tokenizer is not None:
      from jaxrl_llm.tasks.gguf_vocab import add_gguf_tokenizer
      add_gguf_tokenizer(writer, tokenizer)
    for p in plan:
      if p.qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32),
                               4 * int(np.prod(p.shape)))
      else:                                   # stored as raw bytes of its type
        byte_shape = gguf.quants.quant_shape_to_byte_shape(p.shape, p.qtype)
        writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8),
                               int(np.prod(byte_shape)), raw_dtype=p.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    types = {p.name: p.qtype for p in plan}
    for g, x in gguf_tensors(config, params):
      data = _encode(gguf, x, types[g])
      writer.write_tensor_data(data.view(np.uint8) if data.dtype != np.float32 else data)
    writer.close()
  except BaseException:
    with contextlib.suppress(Exception):
      writer.close()
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  os.replace(tmp, path)


__all__ = ["ARCHITECTURES", "GGUFTensors", "GGUF_NAMES", "LAYER_GGUF_NAMES", "READ_TYPES",
           "WRITE_TYPES", "config_from_gguf", "from_gguf", "gguf_metadata", "gguf_name",
           "gguf_tensors", "hf_name", "permute_rope", "read_gguf", "save_gguf",
           "unpermute_rope"]
