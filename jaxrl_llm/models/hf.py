r"""Hugging Face checkpoints in and out of the reference :class:`Transformer`.

:func:`from_pretrained` reads a local Hugging Face model folder (``config.json`` and
``model.safetensors``, or ``model.safetensors.index.json`` with several shards) of the
Llama (``LlamaForCausalLM``, Llama-3 ``rope_scaling`` of type ``llama3`` included),
Qwen2/Qwen2.5 (``Qwen2ForCausalLM``: q/k/v bias) and Qwen3 (``Qwen3ForCausalLM``: q/k
RMSNorm, explicit ``head_dim``) families; :func:`save_pretrained` writes the same
layout back, so ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load a
trained policy. Only ``safetensors`` is needed (``pip install 'jaxrl_llm[hf]'``).

Weight layout. A Hugging Face ``nn.Linear`` stores ``[out, in]``; here every matrix
is ``[in, out]`` with heads split out:

==============================================  ===========================  ===============
Hugging Face tensor                             here                         transform
==============================================  ===========================  ===============
``model.embed_tokens.weight`` ``[V, D]``        ``embed`` ``[V, D]``          same
``...self_attn.q_proj.weight`` ``[H*d, D]``     ``attn.wq`` ``[D, H, d]``     T, split heads
``...self_attn.{k,v}_proj.weight`` ``[K*d, D]`` ``attn.w{k,v}`` ``[D, K, d]`` T, split heads
``...self_attn.o_proj.weight`` ``[D, H*d]``     ``attn.wo`` ``[H, d, D]``     T, split heads
``...self_attn.{q,k,v}_proj.bias`` (Qwen2)      ``attn.b{q,k,v}`` ``[N, d]``  split heads
``...self_attn.{q,k}_norm.weight`` (Qwen3)      ``attn.{q,k}_norm.scale``     same
``...mlp.{gate,up}_proj.weight`` ``[F, D]``     ``mlp.w_{gate,up}`` ``[D, F]`` T
``...mlp.down_proj.weight`` ``[D, F]``          ``mlp.w_down`` ``[F, D]``     T
``...{input,post_attention}_layernorm.weight``  ``{attn,mlp}_norm.scale``     same
``model.norm.weight``                           ``final_norm.scale``          same
``lm_head.weight`` ``[V, D]`` (untied)          ``lm_head`` ``[D, V]``        T
==============================================  ===========================  ===============

RoPE needs no permutation: Hugging Face's Llama/Qwen checkpoints already use the
rotate-half convention of :func:`~jaxrl_llm.models.transformer.rope`.

Sharded loading. With a ``mesh``, every parameter is created with
``jax.make_array_from_callback`` on its :func:`~jaxrl_llm.parallel.param_shardings`
layout, and the callback reads only the requested slice of the tensor
(``safe_open(...).get_slice``), so a process never holds more than its own shards of
a tensor (the model is never materialised whole on a host). Without a mesh each
tensor goes to the default device.

What is not supported raises ``ValueError`` naming the field (never a silent
approximation): other architectures or ``model_type`` s, ``hidden_act`` other than
``silu``, ``attention_bias``/``mlp_bias`` on Llama/Qwen3, sliding-window attention,
RoPE scaling types other than ``default``/``llama3``, ``partial_rotary_factor`` < 1,
quantised checkpoints. Dropout fields are ignored (this model has no dropout; RL
fine-tuning runs without it, as verl and OpenRLHF do).

The value head (``value_head=True``) is not part of a Hugging Face model: it is read
from ``value_head.safetensors`` in the folder when present (written there by
:func:`save_pretrained`), or from the file passed as ``value_head=path`` (written by
:func:`save_value_head`, e.g. beside a plain policy folder, as ``jaxrl-llm train``
exports a run), and otherwise initialised to zeros (``values`` start at 0; its
gradient is the final hidden state, so it learns from the first step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from jaxrl_llm.models.transformer import (
  RopeScaling,
  Transformer,
  TransformerConfig,
  abstract_model,
  split_model,
)

if TYPE_CHECKING:
  from jaxrl_llm.parallel.sharding import Rules

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
VALUE_HEAD_FILE = "value_head.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Tensors some checkpoints carry that hold no parameters of the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _require_safetensors():
  try:
    import safetensors  # noqa: F401
  except ImportError as e:
    raise ImportError("Hugging Face checkpoints need 'safetensors': "
                      "pip install 'jaxrl_llm[hf]'.") from e


# ---------------------------------------------------------------------------- config


def read_hf_config(path: str | os.PathLike) -> dict:
  """The ``config.json`` of a model folder as a dict.

  Raises:
    ValueError: if it is missing or not valid JSON.
  """
  file = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(file):
    raise ValueError(f"`path` {os.fspath(path)!r} has no config.json.")
  with open(file, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{file}: invalid JSON ({e.msg} at line {e.lineno}).") from None


def _rope_fields(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
  """``(rope_theta, scaling dict or None)`` from the legacy (``rope_theta`` +
  ``rope_scaling``) or the transformers-5 (``rope_parameters``) layout."""
  params = hf.get("rope_parameters") or {}
  if not isinstance(params, Mapping):
    raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}.")
  if "full_attention" in params or "sliding_attention" in params:
    raise ValueError("config.json: per-layer-type rope_parameters are not supported.")
  theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or None
  if scaling is None and params.get("rope_type", "default") != "default":
    scaling = dict(params)
  for source in (params, scaling or {}):
    factor = source.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
      raise ValueError(f"config.json: partial_rotary_factor={factor} is not supported "
                       "(only 1.0).")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"config.json: partial_rotary_factor="
                     f"{hf['partial_rotary_factor']} is not supported (only 1.0).")
  return float(theta), scaling


def _rope_scaling(scaling: Mapping[str, Any] | None, max_pos: int):
  if scaling is None:
    return None
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return None
  if kind != "llama3":
    raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported "
                     "(supported: 'default', 'llama3').")
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor")
             if k not in scaling]
  if missing:
    raise ValueError(f"config.json: llama3 rope_scaling lacks {missing}.")
  return RopeScaling(
      factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(
          scaling.get("original_max_position_embeddings", max_pos)))


def config_from_hf(hf: Mapping[str, Any], *, dtype: DTypeLike | None = None,
                   value_head: bool = False) -> TransformerConfig:
  """The :class:`TransformerConfig` of a Hugging Face ``config.json`` dict.

  Args:
    hf: the decoded ``config.json``.
    dtype: parameter dtype; default the checkpoint's ``torch_dtype``/``dtype``
      (``float32`` if absent).
    value_head: add a value head.

  Raises:
    ValueError: naming the field, for an unsupported architecture or a setting that
      would change the math (see the module docstring).

  Examples:
    >>> cfg = config_from_hf({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    ...     "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    ...     "tie_word_embeddings": True, "max_position_embeddings": 128})
    >>> cfg.qk_norm, cfg.qkv_bias, cfg.dim_per_head, cfg.rope_theta
    (True, False, 16, 1000000.0)
  """
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  for arch in archs:
    if arch not in ARCHITECTURES:
      raise ValueError(f"config.json: architecture {arch!r} is not supported "
                       f"(supported: {sorted(ARCHITECTURES)}).")
  if model_type not in _MODEL_TYPES:
    raise ValueError(f"config.json: model_type {model_type!r} is not supported "
                     f"(supported: {sorted(_MODEL_TYPES)}).")
  if archs and ARCHITECTURES[archs[0]] != model_type:
    raise ValueError(f"config.json: architecture {archs[0]!r} does not match model_type "
                     f"{model_type!r}.")
  if hf.get("quantization_config") is not None:
    raise ValueError("config.json: quantization_config is set; quantised checkpoints are "
                     "not supported.")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu').")
  if hf.get("mlp_bias", False):
    raise ValueError("config.json: mlp_bias=true is not supported.")
  if model_type != "qwen2" and hf.get("attention_bias", False):
    raise ValueError(f"config.json: attention_bias=true is not supported for "
                     f"{model_type!r} (it adds an o_proj bias).")
  if hf.get("use_sliding_window", False):
    raise ValueError("config.json: use_sliding_window=true (sliding-window attention) "
                     "is not supported.")
  layer_types = hf.get("layer_types") or []
  other = sorted({t for t in layer_types if t != "full_attention"})
  if other and (model_type != "qwen2" or hf.get("use_sliding_window", False)):
    raise ValueError(f"config.json: layer_types {other} are not supported (only "
                     "'full_attention').")
  for key in ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale",
              "embedding_multiplier", "residual_multiplier", "attention_multiplier"):
    if hf.get(key) not in (None, 1.0):
      raise ValueError(f"config.json: {key}={hf[key]!r} is not supported.")
  try:
    d, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kw: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]), "d_model": d,
        "n_layers": int(hf["num_hidden_layers"]), "n_heads": n_heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
        "d_ff": int(hf["intermediate_size"])}
  except KeyError as e:
    raise ValueError(f"config.json: missing required field {e.args[0]!r}.") from None
  max_pos = int(hf.get("max_position_embeddings", 2048))
  theta, scaling = _rope_fields(hf)
  head_dim = hf.get("head_dim")
  if head_dim is not None and int(head_dim) == d // n_heads and d % n_heads == 0:
    head_dim = None
  if dtype is None:
    name = hf.get("torch_dtype", hf.get("dtype")) or "float32"
    if name not in _DTYPES:
      raise ValueError(f"config.json: dtype {name!r} is not supported "
                       f"(supported: {sorted(_DTYPES)}); pass `dtype`.")
    dtype = _DTYPES[name]
  return TransformerConfig(
      **kw, max_seq_len=max_pos, head_dim=None if head_dim is None else int(head_dim),
      rope_theta=theta, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      value_head=value_head, dtype=dtype, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
      rope_scaling=_rope_scaling(scaling, max_pos))


def _dtype_name(dtype) -> str:
  name = jnp.dtype(dtype).name
  if name not in _DTYPES:
    raise ValueError(f"dtype {name!r} cannot be saved (supported: {sorted(_DTYPES)}).")
  return name


def hf_config_from(config: TransformerConfig) -> dict:
  """A Hugging Face ``config.json`` dict for ``config`` (Llama, Qwen2 or Qwen3).

  The architecture follows the features: q/k norm -> Qwen3, q/k/v bias -> Qwen2,
  neither -> Llama. RoPE is written in the legacy ``rope_theta``/``rope_scaling``
  fields, which transformers 4 and 5 and vLLM read.

  Raises:
    ValueError: for a config no supported architecture expresses (q/k/v bias together
      with q/k norm).
  """
  c = config
  if c.qk_norm and c.qkv_bias:
    raise ValueError("no supported Hugging Face architecture has both q/k/v bias and "
                     "q/k norm.")
  model_type = "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias else "llama"
  out: dict[str, Any] = {
      "architectures": [_MODEL_TYPES[model_type]], "model_type": model_type,
      "vocab_size": c.vocab_size, "hidden_size": c.d_model,
      "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
      "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
      "head_dim": c.dim_per_head, "hidden_act": "silu",
      "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
      "rope_theta": c.rope_theta, "rope_scaling": None,
      "tie_word_embeddings": c.tie_embeddings, "torch_dtype": _dtype_name(c.dtype),
      "use_cache": True,
  }
  if c.rope_scaling is not None:
    out["rope_scaling"] = {"rope_type": "llama3",
                           **dataclasses.asdict(c.rope_scaling)}
  if model_type == "qwen2":
    out["use_sliding_window"] = False
  else:
    out["attention_bias"] = False
  if model_type == "llama":
    out["mlp_bias"] = False
  return out


# ---------------------------------------------------------------------------- layout


def _norm(s: slice, n: int) -> slice:
  start, stop, step = s.indices(n)
  if step != 1:
    raise ValueError(f"strided shard index {s} is not supported.")
  return slice(start, stop)


def _head_rows(s: slice, hd: int) -> slice:
  return slice(s.start * hd, s.stop * hd)


def _read_heads_in(tensor, idx, hd: int) -> np.ndarray:
  sd, sn, sk = idx
  x = tensor[_head_rows(sn, hd), sd]                  # [n*hd, nd]
  x = x.reshape(sn.stop - sn.start, hd, -1).transpose(2, 0, 1)
  return x[:, :, sk]


def _read_heads_out(tensor, idx, hd: int) -> np.ndarray:
  sn, sk, sd = idx
  x = tensor[sd, _head_rows(sn, hd)]                  # [nd, n*hd]
  x = x.reshape(-1, sn.stop - sn.start, hd).transpose(1, 2, 0)
  return x[:, sk, :]


def _read_heads_bias(tensor, idx, hd: int) -> np.ndarray:
  sn, sk = idx
  return tensor[_head_rows(sn, hd)].reshape(sn.stop - sn.start, hd)[:, sk]


class LayoutKind(NamedTuple):
  """How one kind of parameter relates to its Hugging Face tensor.

  Attributes:
    hf_shape: ``hf_shape(shape) -> hf_shape``, the Hugging Face tensor shape of a
      parameter of ``shape`` (our layout).
    to_hf: ``to_hf(x) -> tensor``, a parameter (NumPy, our layout) as the Hugging
      Face tensor.
    read_slice: ``read_slice(tensor, idx, head_dim) -> block``: the block ``idx`` (a
      tuple of unit-stride slices of *our* layout) read from a safetensors slice
      handle, in our layout.

  :data:`LAYOUT_KINDS` maps each kind named by :func:`hf_layout` to its functions.

  Examples:
    >>> LAYOUT_KINDS["heads_in"].hf_shape((64, 4, 16))   # [D, N, d] <- [N*d, D]
    (64, 64)
    >>> x = np.arange(6.0).reshape(1, 2, 3)                # [D=1, N=2, d=3]
    >>> LAYOUT_KINDS["heads_in"].to_hf(x)[:, 0].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
  """
  hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
  to_hf: Callable[[np.ndarray], np.ndarray]
  read_slice: Callable[[Any, tuple[slice, ...], int], np.ndarray]


# Our layout <- Hugging Face's: D model width, N heads, d head_dim.
LAYOUT_KINDS: dict[str, LayoutKind] = {
    "id": LayoutKind(                    # the same array
        hf_shape=lambda shape: shape,
        to_hf=lambda x: x,
        read_slice=lambda tensor, idx, hd: tensor[idx]),
    "T": LayoutKind(                     # [in, out] <- torch Linear's [out, in]
        hf_shape=lambda shape: shape[::-1],
        to_hf=lambda x: x.T,
        read_slice=lambda tensor, idx, hd: tensor[idx[::-1]].T),
    "heads_in": LayoutKind(              # [D, N, d] <- [N*d, D]
        hf_shape=lambda shape: (shape[1] * shape[2], shape[0]),
        to_hf=lambda x: x.transpose(1, 2, 0).reshape(-1, x.shape[0]),
        read_slice=_read_heads_in),
    "heads_out": LayoutKind(             # [N, d, D] <- [D, N*d]
        hf_shape=lambda shape: (shape[2], shape[0] * shape[1]),
        to_hf=lambda x: x.transpose(2, 0, 1).reshape(x.shape[2], -1),
        read_slice=_read_heads_out),
    "heads_bias": LayoutKind(            # [N, d] <- [N*d]
        hf_shape=lambda shape: (shape[0] * shape[1],),
        to_hf=lambda x: x.reshape(-1),
        read_slice=_read_heads_bias),
}


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One parameter: its Hugging Face tensor name and how the layouts relate."""

  name: str
  kind: str        # a key of LAYOUT_KINDS
  head_dim: int = 0

  @property
  def layout(self) -> LayoutKind:
    return LAYOUT_KINDS[self.kind]


def hf_layout(config: TransformerConfig) -> dict[str, _Entry]:
  """``{our parameter path: (Hugging Face tensor name, transform)}`` for ``config``.

  Paths are dotted (``"blocks.0.attn.wq"``); the value head is not included.
  """
  c = config
  hd = c.dim_per_head
  out = {"embed": _Entry("model.embed_tokens.weight", "id"),
         "final_norm.scale": _Entry("model.norm.weight", "id")}
  if not c.tie_embeddings:
    out["lm_head"] = _Entry("lm_head.weight", "T")
  for i in range(c.n_layers):
    ours, hf = f"blocks.{i}.", f"model.layers.{i}."
    out[ours + "attn_norm.scale"] = _Entry(hf + "input_layernorm.weight", "id")
    out[ours + "mlp_norm.scale"] = _Entry(hf + "post_attention_layernorm.weight", "id")
    for p in "qkv":
      out[ours + f"attn.w{p}"] = _Entry(hf + f"self_attn.{p}_proj.weight", "heads_in", hd)
      if c.qkv_bias:
        out[ours + f"attn.b{p}"] = _Entry(hf + f"self_attn.{p}_proj.bias", "heads_bias",
                                          hd)
    out[ours + "attn.wo"] = _Entry(hf + "self_attn.o_proj.weight", "heads_out", hd)
    if c.qk_norm:
      out[ours + "attn.q_norm.scale"] = _Entry(hf + "self_attn.q_norm.weight", "id")
      out[ours + "attn.k_norm.scale"] = _Entry(hf + "self_attn.k_norm.weight", "id")
    out[ours + "mlp.w_gate"] = _Entry(hf + "mlp.gate_proj.weight", "T")
    out[ours + "mlp.w_up"] = _Entry(hf + "mlp.up_proj.weight", "T")
    out[ours + "mlp.w_down"] = _Entry(hf + "mlp.down_proj.weight", "T")
  return out


def _hf_shape(entry: _Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The Hugging Face tensor shape of a parameter of ``shape``."""
  return entry.layout.hf_shape(shape)


def _to_hf(entry: _Entry, x: np.ndarray) -> np.ndarray:
  """A parameter as the Hugging Face tensor."""
  return entry.layout.to_hf(x)


def _read_slice(entry: _Entry, tensor, shape: tuple[int, ...], index) -> np.ndarray:
  """The block ``index`` (a tuple of slices of *our* layout) read from ``tensor``
  (a safetensors slice handle), in our layout."""
  idx = tuple(_norm(s, n) for s, n in zip(index, shape))
  return entry.layout.read_slice(tensor, idx, entry.head_dim)


# ------------------------------------------------------------------------ checkpoint


class _Checkpoint(contextlib.ExitStack):
  """The tensors of a (possibly sharded) safetensors checkpoint, opened lazily."""

  def __init__(self, path: str):
    super().__init__()
    from safetensors import safe_open
    self._safe_open = safe_open
    self.path = path
    index = os.path.join(path, _INDEX_FILE)
    single = os.path.join(path, _SINGLE_FILE)
    if os.path.isfile(index):
      with open(index, encoding="utf-8") as f:
        try:
          weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
          raise ValueError(f"{index}: not a safetensors index (no 'weight_map').") from None
      self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
      for file in sorted(set(self.files.values())):
        if not os.path.isfile(file):
          raise ValueError(f"{index} names the shard {os.path.basename(file)!r}, which is "
                           "missing.")
    elif os.path.isfile(single):
      with safe_open(single, framework="numpy") as f:
        self.files = dict.fromkeys(f.keys(), single)
    else:
      raise ValueError(f"`path` {path!r} has neither {_SINGLE_FILE} nor {_INDEX_FILE}.")
    self._handles: dict[str, Any] = {}

  def _handle(self, file: str):
    if file not in self._handles:
      self._handles[file] = self.enter_context(self._safe_open(file, framework="numpy"))
    return self._handles[file]

  def tensor(self, name: str, hint: str = ""):
    """A slice handle (``get_shape()``, ``[...]``) of tensor ``name``."""
    if name not in self.files:
      raise ValueError(f"tensor {name!r} is missing from the checkpoint at "
                       f"{self.path!r}{hint}.")
    handle = self._handle(self.files[name])
    try:
      return handle.get_slice(name)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
      raise ValueError(f"tensor {name!r}: cannot be read from "
                       f"{os.path.basename(self.files[name])!r} ({e}).") from None


def _path_str(path) -> str:
  parts = []
  for k in path:
    key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
    if key == "value" and isinstance(k, jax.tree_util.GetAttrKey):
      continue
    parts.append(str(key))
  return ".".join(parts)


def _abstract_params(config: TransformerConfig):
  return split_model(abstract_model(config))


def _place(shape, dtype, sharding, read: Callable[[Any], np.ndarray]):
  """A jax array of ``shape`` from ``read(index) -> block`` (one block per shard)."""
  if sharding is None:
    full = tuple(slice(0, n) for n in shape)
    return jnp.asarray(read(full).astype(dtype))
  return jax.make_array_from_callback(
      shape, sharding, lambda index: np.ascontiguousarray(read(index).astype(dtype)))


def from_pretrained(path: str | os.PathLike, *, dtype: DTypeLike | None = None,
                    mesh: Mesh | None = None, rules: Rules | None = None,
                    value_head: bool | str | os.PathLike | None = False) -> Transformer:
  """Loads a local Hugging Face Llama / Qwen2 / Qwen3 folder into a :class:`Transformer`.

  Args:
    path: a folder with ``config.json`` and ``model.safetensors`` (or
      ``model.safetensors.index.json`` and its shards).
    dtype: parameter and matmul dtype (e.g. ``jnp.float32``, ``jnp.bfloat16``); default
      the checkpoint's ``torch_dtype``. Tensors are cast while reading.
    mesh: a ``jax.sharding.Mesh`` (:func:`jaxrl_llm.parallel.make_mesh`); each
      parameter is then read straight into its sharded layout, only the slices this
      process's devices hold.
    rules: logical-axis rule overrides for ``mesh`` (see
      :func:`jaxrl_llm.parallel.make_rules`).
    value_head: add the scalar value head: ``True`` reads it from
      ``value_head.safetensors`` when the folder has one, else zeros; a file path
      reads it from that file (written by :func:`save_value_head`; it must exist);
      ``False`` or ``None``: no value head.

  Returns:
    The model; ``model(tokens)`` -> ``(hidden, values)``, ``model.logits(hidden)``,
    :func:`~jaxrl_llm.models.split_model` and friends work as for a fresh one.

  Raises:
    ValueError: one line naming the field, file or tensor: unsupported architecture
      or config field, missing or unexpected tensor, shape mismatch.

  Examples:
    >>> import tempfile
    >>> from flax import nnx
    >>> folder = tempfile.mkdtemp()
    >>> model = Transformer(TransformerConfig.tiny(32, value_head=False), rngs=nnx.Rngs(0))
    >>> save_pretrained(model, folder)
    >>> loaded = from_pretrained(folder)
    >>> tokens = jnp.array([[1, 2, 3]])
    >>> bool(jnp.allclose(model.logits(model(tokens)[0]), loaded.logits(loaded(tokens)[0])))
    True
  """
  _require_safetensors()
  path = os.fspath(path)
  value_file = os.path.join(path, VALUE_HEAD_FILE)
  if value_head is None:
    value_head = False
  if not isinstance(value_head, bool):
    if not isinstance(value_head, (str, os.PathLike)):
      raise ValueError(f"`value_head` must be a bool, None or a file path, got "
                       f"{value_head!r}.")
    value_file = os.fspath(value_head)
    if not os.path.isfile(value_file):
      raise ValueError(f"`value_head` file {value_file!r} does not exist.")
  config = config_from_hf(read_hf_config(path), dtype=dtype,
                          value_head=value_head is not False)
  with _Checkpoint(path) as ckpt:
    return load_model(config, ckpt, value_file=value_file, mesh=mesh, rules=rules,
                      origin="config.json")


class TensorSource(Protocol):
  """Where :func:`load_model` reads Hugging Face tensors from.

  Attributes:
    files: the names of every tensor the source holds (a mapping or set of Hugging
      Face names; extras the layout does not use are refused).

  ``tensor(name, hint)`` returns a slice handle of tensor ``name`` in Hugging Face
  layout: ``get_shape()`` and ``[index]`` with a tuple of slices (a safetensors slice,
  or a NumPy array behind :class:`ArrayTensor`); a missing name raises ``ValueError``
  ending in ``hint``.
  """

  files: Any

  def tensor(self, name: str, hint: str = "") -> Any: ...


class ArrayTensor:
  """A NumPy array as a :class:`TensorSource` slice handle (``get_shape()``, ``[...]``).

  Examples:
    >>> t = ArrayTensor(np.arange(6).reshape(2, 3))
    >>> t.get_shape(), t[0:1, 1:3].tolist()
    ([2, 3], [[1, 2]])
  """

  def __init__(self, array: np.ndarray) -> None:
    self.array = array

  def get_shape(self) -> list[int]:
    return list(self.array.shape)

  def __getitem__(self, index: Any) -> np.ndarray:
    return self.array[index]


def load_model(config: TransformerConfig, tensors: TensorSource, *,
               value_file: str | None = None, mesh: Mesh | None = None,
               rules: Rules | None = None, origin: str = "the config") -> Transformer:
  """A :class:`Transformer` of ``config`` whose parameters are read from ``tensors``.

  The loop :func:`from_pretrained` and :func:`~jaxrl_llm.models.gguf.from_gguf` share:
  each parameter is read through its :func:`hf_layout` entry (only the slices this
  process's devices hold, with a ``mesh``), shapes are checked against ``config``, and
  a tensor of ``tensors`` the layout does not use is refused.

  Args:
    config: the architecture.
    tensors: the tensors (:class:`TensorSource`).
    value_file: a ``value_head.safetensors`` to read the value head from (zeros when
      the file does not exist).
    mesh, rules: as in :func:`from_pretrained`.
    origin: what ``config`` came from, for error messages (``"config.json"``).

  Raises:
    ValueError: a missing, misshapen or unused tensor (one line naming it).
  """
  layout = hf_layout(config)
  graphdef, abstract = _abstract_params(config)
  shardings = None
  if mesh is not None:
    # Lazy: jaxrl_llm.parallel sits below models in the layer order.
    from jaxrl_llm.parallel.sharding import param_shardings
    shardings = param_shardings(abstract, mesh, rules)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  shard_leaves = (jax.tree_util.tree_leaves(shardings) if shardings is not None
                  else [None] * len(flat))
  leaves = []
  used = set()
  for (key_path, leaf), sharding in zip(flat, shard_leaves):
    name = _path_str(key_path)
    shape, leaf_dtype = tuple(leaf.shape), leaf.dtype
    if name in ("value_w", "value_b"):
      leaves.append(_value_param(name, shape, leaf_dtype, sharding, value_file))
      continue
    if name not in layout:
      raise ValueError(f"parameter {name!r} has no Hugging Face tensor (internal).")
    entry = layout[name]
    hint = (f" ({origin} has tie_word_embeddings=false)" if entry.name ==
            "lm_head.weight" else "")
    tensor = tensors.tensor(entry.name, hint)
    expected = _hf_shape(entry, shape)
    got = tuple(tensor.get_shape())
    if got != expected:
      raise ValueError(f"tensor {entry.name!r} has shape {list(got)}, expected "
                       f"{list(expected)} from {origin}.")
    used.add(entry.name)
    leaves.append(_place(shape, leaf_dtype, sharding,
                         functools.partial(_read_slice, entry, tensor, shape)))
  extra = sorted(n for n in tensors.files if n not in used and not (
      n.endswith(_IGNORED_SUFFIXES) or (n == "lm_head.weight" and config.tie_embeddings)))
  if extra:
    raise ValueError(f"tensor {extra[0]!r} in the checkpoint is not used by the "
                     f"{config_model_type(config)!r} layout ({len(extra)} unused).")
  params = jax.tree_util.tree_unflatten(treedef, leaves)
  return nnx.merge(graphdef, params)


def config_model_type(config: TransformerConfig) -> str:
  """``"qwen3"``, ``"qwen2"`` or ``"llama"``: the architecture :func:`save_pretrained`
  writes for ``config``."""
  return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


_VALUE_NAMES = {"value_w": "value_head.weight", "value_b": "value_head.bias"}


def _value_param(name, shape, dtype, sharding, file):
  if not file or not os.path.isfile(file):
    return _place(shape, dtype, sharding, lambda index: np.zeros(
        tuple(_norm(s, n).stop - _norm(s, n).start for s, n in zip(index, shape)),
        np.float32))
  from safetensors.numpy import load_file
  tensors = load_file(file)
  hf_name = _VALUE_NAMES[name]
  if hf_name not in tensors:
    raise ValueError(f"tensor {hf_name!r} is missing from {file!r}.")
  x = tensors[hf_name]
  x = x.T if name == "value_w" else x      # stored as nn.Linear: [1, D]
  if tuple(x.shape) != shape:
    stored = shape[::-1] if name == "value_w" else shape
    raise ValueError(f"tensor {hf_name!r} has shape {list(tensors[hf_name].shape)} in "
                     f"{file!r}, expected {list(stored)}.")
  return _place(shape, dtype, sharding,
                lambda index: x[tuple(_norm(s, n) for s, n in zip(index, shape))])


# ------------------------------------------------------------------------------ save


def _parse_size(size: int | str) -> int:
  if isinstance(size, int):
    return size
  units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
           "GIB": 2**30}
  text = size.strip().upper()
  for unit, mult in sorted(units.items(), key=lambda u: -len(u[0])):
    if text.endswith(unit):
      return int(float(text[:-len(unit)]) * mult)
  return int(text)


def _host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def hf_tensors(config: TransformerConfig, params: Any, *,
               dtype: DTypeLike | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """``(Hugging Face name, NumPy tensor)`` of each policy parameter of ``params``, one
  at a time, in Hugging Face layout (the table of the module docstring,
  :func:`hf_layout`): what :func:`save_pretrained` writes and what a running inference
  engine loads (:class:`jaxrl_llm.rollout.vllm.VllmEngine` pushes them).

  Each tensor is converted only when the iterator reaches it, so a consumer that
  hands tensors on one by one never holds the whole model on the host twice (a
  sharded parameter is gathered on its own, with several processes every process must
  iterate). The value head (``value_w``/``value_b``) is skipped: it is no part of the
  Hugging Face model.

  Args:
    config: the model's :class:`TransformerConfig` (its layout).
    params: the parameter pytree of ``split_model(model)[1]``.
    dtype: the tensors' dtype (default ``config.dtype``).

  Raises:
    ValueError: a parameter the layout of ``config`` does not name.

  Examples:
    >>> from jaxrl_llm.models import Transformer, get_config, split_model
    >>> cfg = get_config("tiny", 11)
    >>> _, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
    >>> tensors = dict(hf_tensors(cfg, params))
    >>> tensors["model.layers.0.self_attn.q_proj.weight"].shape   # [H*d, D] <- [D, H, d]
    (64, 64)
    >>> len(tensors) == len(hf_layout(cfg))
    True
  """
  out_dtype = jnp.dtype(config.dtype if dtype is None else dtype)
  for entry, leaf in _hf_entries(config, params):
    yield entry.name, np.ascontiguousarray(_to_hf(entry, _host(leaf).astype(out_dtype)))


def _hf_entries(config: TransformerConfig, params: Any) -> Iterator[tuple[Any, Any]]:
  """``(layout entry, leaf)`` of each policy parameter of ``params`` (the value head
  skipped); ``ValueError`` for a parameter the layout of ``config`` does not name."""
  layout = hf_layout(config)
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = _path_str(key_path)
    if name in _VALUE_NAMES:
      continue
    if name not in layout:
      raise ValueError(f"parameter {name!r} has no Hugging Face name in the "
                       f"{config_model_type(config)!r} layout.")
    yield layout[name], leaf


def hf_shapes(config: TransformerConfig, params: Any) -> dict[str, tuple[int, ...]]:
  """``{Hugging Face name: shape}`` of the tensors :func:`hf_tensors` yields for
  ``params`` (from the shapes alone: nothing is converted or gathered).

  Raises:
    ValueError: a parameter the layout of ``config`` does not name.

  Examples:
    >>> from jaxrl_llm.models import Transformer, get_config, split_model
    >>> cfg = get_config("tiny", 11)
    >>> _, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
    >>> hf_shapes(cfg, params)["model.layers.0.mlp.down_proj.weight"]   # [D, F] <- [F, D]
    (64, 128)
  """
  return {entry.name: tuple(_hf_shape(entry, tuple(np.shape(leaf))))
          for entry, leaf in _hf_entries(config, params)}


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
  """``{tensor name: shape}`` of the safetensors checkpoint folder ``path`` (headers
  only: no tensor is read)."""
  _require_safetensors()
  with _Checkpoint(os.fspath(path)) as ckpt:
    return {name: tuple(ckpt.tensor(name).get_shape()) for name in ckpt.files
            if not name.endswith(_IGNORED_SUFFIXES)}


# config.json / generation_config.json fields that say how generation starts, pads and
# stops (not architecture fields): written by save_pretrained, carried over by export.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG_FILE = "generation_config.json"


def token_id_fields(*, tokenizer: Any = None,
                    config: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The ``bos``/``eos``/``pad`` token ids of :data:`TOKEN_ID_FIELDS` to write into
  ``config.json`` and ``generation_config.json``: those set in ``config`` (an original
  ``config.json``), else the ``tokenizer``'s (an
  :class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer`: every id in ``eos_ids``, a list
  when there are several, as Llama-3's generation config has; the pad id only when the
  tokenizer names a ``pad_token``). Unknown ids are left out.

  Examples:
    >>> from tokenizers import Tokenizer, models
    >>> from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
    >>> vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "hi": 3}
    >>> tok = HFTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="hi")),
    ...                   special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    ...                   extra_eos_ids=[2])
    >>> token_id_fields(tokenizer=tok)
    {'bos_token_id': 0, 'eos_token_id': [1, 2]}
    >>> token_id_fields(tokenizer=tok, config={"eos_token_id": 2, "pad_token_id": None})
    {'bos_token_id': 0, 'eos_token_id': 2}
  """
  out: dict[str, Any] = {}
  if tokenizer is not None:
    eos = [int(i) for i in getattr(tokenizer, "eos_ids", ())]
    out["bos_token_id"] = tokenizer.bos_id
    out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    if "pad_token" in getattr(tokenizer, "special_tokens", {}):
      out["pad_token_id"] = tokenizer.pad_id
  for key in TOKEN_ID_FIELDS:
    if config is not None and config.get(key) is not None:
      out[key] = config[key]
  return {k: v for k, v in out.items() if v is not None}


def save_pretrained(model: Transformer, path: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB", dtype: DTypeLike | None = None,
                    extra_config: Mapping[str, Any] | None = None, tokenizer: Any = None) -> None:
  """Writes ``model`` as a Hugging Face folder (``config.json`` + safetensors).

  Tensors are written in Hugging Face names and layouts (see the module docstring),
  in files of at most ``max_shard_size`` bytes: one ``model.safetensors``, or
  ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
  ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and vLLM load the result.
  The ``bos``/``eos``/``pad`` ids (:func:`token_id_fields`: ``extra_config``'s, else the
  ``tokenizer``'s) go into ``config.json`` and a ``generation_config.json``, so
  ``transformers``' ``generate`` stops at the tokenizer's eos.
  The value head, when the model has one, goes to ``value_head.safetensors`` (not part
  of the Hugging Face model; :func:`from_pretrained` with ``value_head=True`` reads it).
  With several processes every process must call this (sharded arrays are gathered)
  and process 0 writes.

  Args:
    model: the model (``nnx.merge(graphdef, params)`` rebuilds one from trained params).
    path: the output folder (created if needed; existing files are overwritten).
    max_shard_size: bytes per file, an int or a string like ``"2GB"``/``"500MiB"``.
    dtype: dtype of the saved tensors; default the model's ``config.dtype``.
    extra_config: more ``config.json`` fields (e.g. ``bos_token_id``/``eos_token_id``
      of the original checkpoint); they may not override the architecture fields.
    tokenizer: an :class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer` to save beside the
      model (``tokenizer.json``, ``tokenizer_config.json`` with its chat template);
      its token ids fill the :data:`TOKEN_ID_FIELDS` that ``extra_config`` leaves out.

  Raises:
    ValueError: for a model no supported architecture expresses, or ``extra_config``
      overriding an architecture field.
  """
  _require_safetensors()
  from safetensors.numpy import save_file
  config = model.config
  limit = _parse_size(max_shard_size)
  out_dtype = jnp.dtype(config.dtype if dtype is None else dtype)
  hf_config = hf_config_from(dataclasses.replace(config, dtype=out_dtype))
  extra = dict(extra_config or {})
  for key, val in extra.items():
    if key in hf_config and hf_config[key] != val:
      raise ValueError(f"`extra_config` may not override {key!r} "
                       f"({hf_config[key]!r} -> {val!r}).")
  hf_config.update(extra)
  ids = token_id_fields(tokenizer=tokenizer, config=extra)
  hf_config.update(ids)
  _, params = split_model(model)
  # The files' headers from the shapes alone (hf_shapes: nothing converted or gathered),
  # then the bytes, each tensor converted as it is written: the host never holds the
  # model twice.
  specs = [(name, np.dtype(out_dtype), shape)
           for name, shape in hf_shapes(config, params).items()]
  value: dict[str, np.ndarray] = {}
  if config.value_head:
    value = dict(_value_tensor(name, _host(getattr(model, name)[...]).astype(out_dtype))
                 for name in _VALUE_NAMES)
  tensors = hf_tensors(config, params, dtype=out_dtype)
  if jax.process_index() != 0:
    for _ in tensors:                          # the gathers of a sharded model
      pass
    return
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  for stale in (_SINGLE_FILE, _INDEX_FILE, VALUE_HEAD_FILE):
    if os.path.exists(os.path.join(path, stale)):
      os.remove(os.path.join(path, stale))
  shards: list[list[tuple[str, Any, tuple[int, ...]]]] = [[]]
  size = 0
  for spec in specs:
    nbytes = _nbytes(*spec[1:])
    if shards[-1] and size + nbytes > limit:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += nbytes
  meta = {"format": "pt"}
  if len(shards) == 1:
    write_safetensors(os.path.join(path, _SINGLE_FILE), shards[0], tensors, meta)
  else:
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
      write_safetensors(os.path.join(path, file), shard, tensors, meta)
      weight_map.update({name: file for name, _, _ in shard})
    total = sum(_nbytes(*spec[1:]) for spec in specs)
    _write_json(os.path.join(path, _INDEX_FILE),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
  _write_json(os.path.join(path, "config.json"), hf_config)
  if ids:
    _write_json(os.path.join(path, GENERATION_CONFIG_FILE), ids)
  elif os.path.exists(os.path.join(path, GENERATION_CONFIG_FILE)):
    os.remove(os.path.join(path, GENERATION_CONFIG_FILE))
  if value:
    save_file(value, os.path.join(path, VALUE_HEAD_FILE), metadata=meta)
  if tokenizer is not None:
    _save_tokenizer(tokenizer, path)


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16",
                       "bfloat16": "BF16", "int64": "I64", "int32": "I32",
                       "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _nbytes(dtype: Any, shape: tuple[int, ...]) -> int:
  """Bytes of a C-ordered array of ``dtype`` and ``shape``."""
  return np.dtype(dtype).itemsize * math.prod(shape)


def write_safetensors(file: str | os.PathLike,
                      specs: list[tuple[str, Any, tuple[int, ...]]],
                      tensors: Iterator[tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
  """Writes a safetensors file tensor by tensor, holding one tensor at a time.

  ``specs`` lists ``(name, dtype, shape)`` of the file's tensors in order (the header,
  written first); ``tensors`` yields ``(name, array)`` in that order, and the next
  ``len(specs)`` are taken from it. The format: an 8-byte little-endian header length,
  the JSON header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, space
  padded to a multiple of 8 bytes), then each tensor's bytes, C order, back to back.

  Raises:
    ValueError: a tensor that is not the next one of ``specs`` (name, dtype, shape).

  Examples:
    >>> import tempfile, safetensors.numpy
    >>> file = tempfile.mkdtemp() + "/t.safetensors"
    >>> x = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(1, np.int32)}
    >>> write_safetensors(file, [(k, v.dtype, v.shape) for k, v in x.items()],
    ...                   iter(x.items()), {"format": "pt"})
    >>> safetensors.numpy.load_file(file)["a"].tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
  """
  header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for name, dtype, shape in specs:
    nbytes = _nbytes(dtype, shape)
    header[name] = {"dtype": _SAFETENSORS_DTYPES[np.dtype(dtype).name],
                    "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  with open(file, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for name, dtype, shape in specs:
      got, x = next(tensors)
      if (got, x.dtype, tuple(x.shape)) != (name, np.dtype(dtype), tuple(shape)):
        raise ValueError(f"tensors: expected {name} {np.dtype(dtype)}{list(shape)}, got "
                         f"{got} {x.dtype}{list(x.shape)}")
      f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)


def save_value_head(model: Transformer, file: str | os.PathLike, *,
                    dtype: DTypeLike | None = None) -> None:
  """Writes the value head of ``model`` alone to the safetensors ``file``.

  Tensors ``value_head.weight`` ``[1, D]`` (an ``nn.Linear`` layout) and
  ``value_head.bias`` ``[1]``, as :func:`save_pretrained` writes them beside the
  model; ``from_pretrained(folder, value_head=file)`` reads them back onto the same
  trunk. Keeping the head out of the model folder leaves that folder a plain Hugging
  Face model (vLLM reads every ``*.safetensors`` of a folder without an index).
  With several processes every process must call this and process 0 writes.

  Raises:
    ValueError: if ``model`` has no value head.
  """
  _require_safetensors()
  from safetensors.numpy import save_file
  if not model.config.value_head:
    raise ValueError("`model` has no value head (build it with value_head=True).")
  out_dtype = jnp.dtype(model.config.dtype if dtype is None else dtype)
  tensors = dict(_value_tensor(name, _host(getattr(model, name)[...]).astype(out_dtype))
                 for name in _VALUE_NAMES)
  if jax.process_index() != 0:
    return
  file = os.fspath(file)
  os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
  save_file(tensors, file, metadata={"format": "pt"})


def _value_tensor(name: str, x: np.ndarray) -> tuple[str, np.ndarray]:
  """The safetensors name and array of our value parameter ``name`` (``value_w``
  ``[D, 1]`` is written ``[1, D]``, an ``nn.Linear`` weight)."""
  return _VALUE_NAMES[name], np.ascontiguousarray(x.T if name == "value_w" else x)


def _write_json(file: str, obj) -> None:
  with open(file, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=False)
    f.write("\n")


def _save_tokenizer(tokenizer, path: str) -> None:
  inner = getattr(tokenizer, "tokenizer", None)
  if inner is None or not hasattr(inner, "save"):
    raise ValueError(f"`tokenizer` must be an HFTokenizer, got {type(tokenizer).__name__}.")
  inner.save(os.path.join(path, "tokenizer.json"))
  cfg: dict[str, Any] = dict(tokenizer.special_tokens)
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
  if tokenizer.chat_template is not None:
    cfg["chat_template"] = tokenizer.chat_template
  _write_json(os.path.join(path, "tokenizer_config.json"), cfg)


def num_params(config: TransformerConfig) -> int:
  """Parameter count of ``config`` (value head included when present)."""
  _, abstract = _abstract_params(config)
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract))


__all__ = ["ARCHITECTURES", "ArrayTensor", "GENERATION_CONFIG_FILE", "LAYOUT_KINDS", "LayoutKind",
           "TensorSource", "load_model",
           "TOKEN_ID_FIELDS", "VALUE_HEAD_FILE", "token_id_fields",
           "checkpoint_shapes", "config_from_hf", "config_model_type", "from_pretrained",
           "hf_config_from", "hf_layout", "hf_shapes", "hf_tensors", "num_params",
           "read_hf_config", "save_pretrained", "save_value_head"]
