r"""LoRA and QLoRA on the reference :class:`~jaxrl_llm.models.Transformer` through ``qwix``.

:func:`apply_lora` wraps a loaded model (a preset, or any Hugging Face family that
:func:`~jaxrl_llm.models.from_pretrained` loads: they are all this ``Transformer``) with
qwix's own LoRA (``qwix.LoraProvider`` / ``qwix.apply_lora_to_model``; no LoRA layer is
written here). Each targeted weight :math:`W` gets two ``nnx.LoRAParam`` adapters
:math:`A` (``[fan_in..., r]``, He-uniform) and :math:`B` (``[r, fan_out...]``, zeros), and
its product becomes

.. math::  y = x W + \frac{\alpha}{r}\, (x A) B,

so the wrapped model starts exactly at the base (:math:`B = 0`). With
``base_dtype="nf4"`` / ``"int8"`` (QLoRA) qwix stores the frozen base of the attention
and MLP weights quantised (NormalFloat4 in blocks of 64 inputs where the sizes allow,
else per output channel; int8 per output channel) and dequantises it inside the
product; the adapters stay in the compute dtype. ``"bf16"`` keeps the base
unquantised in the model's own dtype (bf16 for a bf16 checkpoint).

Targets (``q,k,v,o,gate,up,down``, PEFT's ``*_proj`` names) map to ``attn.wq``,
``attn.wk``, ``attn.wv``, ``attn.wo``, ``mlp.w_gate``, ``mlp.w_up``, ``mlp.w_down``.
qwix matches rules by module (``attn``, ``mlp``); weights of a matched module that are
not targets are passed through qwix's base (PTQ) product, so they are quantised with
the rest under QLoRA but get no adapter.

Training only the adapters: :func:`lora_trainable` marks the ``nnx.LoRAParam`` leaves
(and the value head, when the model has one) for ``make_train_step(...,
trainable=lora_trainable)``; gradients and the optimizer state then exist for those
alone and the base is passed through the step untouched (bit-identical). The KL
reference is the same parameters with every :math:`B` set to zero
(:func:`lora_reference_apply`): the base is shared by the policy and the reference,
never copied. Critic setups: a value head on the LoRA policy (trained in full, it is
small); a separate critic trained in full (``{"policy": LoRA, "critic": full}``) or
LoRA'd as well (both parts wrapped): :func:`lora_trainable` trains a part's adapters
when it has any, else the whole part.

Rollouts (the sampler and the paged engine) run on merged weights:
:func:`merge_lora` gives the base model's parameters with :math:`W + \frac{\alpha}{r}AB`
(dequantised under QLoRA), once per generation; :func:`save_lora_adapters` writes the
adapters in PEFT's format (``adapter_model.safetensors`` + ``adapter_config.json``), and
:func:`load_lora_adapters` reads such a folder back onto a model (ours, or one written by
``peft``'s ``save_pretrained``, e.g. an SFT adapter from TRL; ``jaxrl-llm train
--lora-init DIR``). Both name the tensors through
:func:`~jaxrl_llm.models.hf.hf_layout`, the table the checkpoints are read with:
``lora_A.weight`` ``[r, in]`` is :math:`A^T`, ``lora_B.weight`` ``[out, r]`` is
:math:`B^T`, heads flattened in Hugging Face's order.

Adapters carry the logical axis names of the weight they adapt (qwix transposes the
weight's ``out_sharding`` metadata, ``None`` on the rank axis), so the mesh rules of
:mod:`jaxrl_llm.parallel` shard :math:`A` like :math:`W`'s input axes and :math:`B` like
its output axes.

Examples:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxrl_llm.models import Transformer, TransformerConfig
  >>> base = Transformer(TransformerConfig.tiny(32, n_layers=1), rngs=nnx.Rngs(0))
  >>> model = apply_lora(base, rank=2, targets=("q", "v"))
  >>> sorted(k for k in vars(model.blocks[0].attn) if k.endswith(("_lora_a", "_lora_b")))
  ['wq_lora_a', 'wq_lora_b', 'wv_lora_a', 'wv_lora_b']
  >>> tokens = jnp.array([[1, 2, 3]])
  >>> bool(jnp.all(model(tokens)[0] == base(tokens)[0]))     # B = 0: the base exactly
  True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm._names import LORA_BASE_DTYPES
from jaxrl_llm.models.transformer import MLP, Transformer, TransformerConfig, abstract_model

#: LoRA target names (PEFT's ``<name>_proj``) -> (module, weight) of the Transformer.
LORA_TARGETS: dict[str, tuple[str, str]] = {
    "q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
    "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down"),
}
_QTYPES = {"bf16": None, "int8": "int8", "nf4": "nf4"}
_NF4_BLOCK = 64
_MODULES = r".*(attn|mlp)"     # the qwix rule's module paths (Block.attn, Block.mlp)


class AdapterError(ValueError):
  """An adapter folder's tensors cannot be loaded onto the model: the safetensors file
  is unreadable or truncated, a tensor is missing, extra, of the wrong shape or not
  finite. One line naming the file, the tensor and the argument (``--lora-init``);
  a ``ValueError``, so callers that catch those keep working."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """What :func:`apply_lora` did (kept on the model as ``model.lora_spec``).

  Attributes:
    rank: r.
    alpha: :math:`\\alpha`; the update is scaled by ``alpha / rank``.
    targets: the target names (keys of :data:`LORA_TARGETS`), in that table's order.
    base_dtype: one of :data:`LORA_BASE_DTYPES`.
  """

  rank: int
  alpha: float
  targets: tuple[str, ...]
  base_dtype: str

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def weights(self) -> frozenset[str]:
    return frozenset(LORA_TARGETS[t][1] for t in self.targets)


def parse_targets(targets: str | Sequence[str], *, flag: str = "targets") -> tuple[str, ...]:
  """Target names from ``"q,k,v"`` or a sequence; ``"all"`` = every target.

  Examples:
    >>> parse_targets("v, q"), parse_targets("all")[-1]
    (('q', 'v'), 'down')
  """
  if isinstance(targets, str):
    targets = [t.strip() for t in targets.split(",") if t.strip()]
  names = list(targets)
  if names == ["all"]:
    names = list(LORA_TARGETS)
  names = [n[:-len("_proj")] if n.endswith("_proj") else n for n in names]
  bad = [n for n in names if n not in LORA_TARGETS]
  if bad or not names:
    raise ValueError(f"`{flag}` must name LoRA targets among {sorted(LORA_TARGETS)} "
                     f"(or 'all'), got {list(targets)!r}: {bad or 'none'} match no module.")
  return tuple(n for n in LORA_TARGETS if n in names)


def lora_spec(rank: int, alpha: float | None = None,
              targets: str | Sequence[str] = tuple(LORA_TARGETS),
              base_dtype: str = "bf16") -> LoraSpec:
  """A validated :class:`LoraSpec` (``alpha`` defaults to ``rank``: scale 1, PEFT's
  default ratio). Bad values raise ``ValueError`` naming the argument.

  Examples:
    >>> lora_spec(8, targets="q,v")
    LoraSpec(rank=8, alpha=8.0, targets=('q', 'v'), base_dtype='bf16')
  """
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"`rank` must be an int >= 1, got {rank!r}.")
  alpha = float(rank) if alpha is None else alpha
  if not isinstance(alpha, int | float) or not alpha > 0:
    raise ValueError(f"`alpha` must be > 0, got {alpha!r}.")
  if base_dtype not in LORA_BASE_DTYPES:
    raise ValueError(f"`base_dtype` must be one of {LORA_BASE_DTYPES}, got {base_dtype!r}.")
  return LoraSpec(rank, float(alpha), parse_targets(targets), base_dtype)


def _import_qwix():
  try:
    import qwix
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("LoRA needs qwix: pip install 'jaxrl_llm[lora]'") from e
  return qwix


def _provider(spec: LoraSpec, config: TransformerConfig) -> Any:
  """qwix's LoRA provider for ``spec``: one rule over the attention and MLP modules,
  adapters only on the targeted weights."""
  qwix = _import_qwix()
  from qwix._src.providers import ptq
  from qwix._src.utils import flax_util

  qtype = _QTYPES[spec.base_dtype]
  tile = None
  if qtype == "nf4" and all(n % _NF4_BLOCK == 0 for n in
                            (config.d_model, config.dim_per_head, config.d_ff)):
    tile = _NF4_BLOCK
  weights = spec.weights

  class TargetedLoraProvider(qwix.LoraProvider):  # type: ignore[name-defined]
    """qwix's LoRA, skipping the adapter on the weights of a matched module that are
    not targets (qwix rules match modules, not single weights)."""

    def _skip(self, rhs) -> bool:
      name = flax_util.find_param(rhs, ptq.WithAux)
      return name is not None and name not in weights

    def einsum(self, einsum_str, *operands, **kwargs):
      if len(operands) == 2 and self._skip(operands[1]):
        return ptq.PtqProvider.einsum(self, einsum_str, *operands, **kwargs)
      return super().einsum(einsum_str, *operands, **kwargs)

    def dot_general(self, lhs, rhs, *args, **kwargs):
      if self._skip(rhs):
        return ptq.PtqProvider.dot_general(self, lhs, rhs, *args, **kwargs)
      return super().dot_general(lhs, rhs, *args, **kwargs)

  lora = TargetedLoraProvider(module_path=_MODULES, op_names=("einsum",), rank=spec.rank,
                              alpha=spec.alpha, weight_qtype=qtype, tile_size=tile)
  if qtype is None:
    return None, lora
  # QLoRA: quantise the base first (qwix's PTQ), then add the adapters. In one pass
  # qwix finds the weight behind an einsum operand by its shape once the module's
  # attribute has been replaced by the quantised one, which is ambiguous for
  # same-shaped weights (k and v): the adapter of one of them would be dropped.
  ptq_provider = qwix.PtqProvider([qwix.QuantizationRule(
      module_path=_MODULES, op_names=("einsum",), weight_qtype=qtype, tile_size=tile)])
  return ptq_provider, lora


def apply_lora(model: Transformer, *, rank: int, alpha: float | None = None,
               targets: str | Sequence[str] = tuple(LORA_TARGETS),
               base_dtype: str = "bf16", seed: int = 0) -> Transformer:
  """``model`` with qwix LoRA adapters on ``targets`` (a new model; ``model`` is kept).

  Args:
    model: a :class:`~jaxrl_llm.models.Transformer` (a preset or
      :func:`~jaxrl_llm.models.from_pretrained`).
    rank: r >= 1.
    alpha: scale numerator (update ``alpha / rank * x A B``); default ``rank``.
    targets: names among ``q,k,v,o,gate,up,down`` (a comma list or a sequence).
    base_dtype: ``"bf16"`` (base unquantised), ``"int8"`` or ``"nf4"`` (QLoRA).
    seed: seeds the He-uniform init of the :math:`A` adapters.

  Returns:
    The wrapped model: its forward (``__call__``, so :func:`make_apply_fn`) adds the
    adapters; ``model.lora_spec`` is the :class:`LoraSpec`. Its cached-decoding methods
    are the base's: generate from :func:`merge_lora`'s parameters. Its MLP runs
    unchunked (``mlp_chunk_size`` is ignored: qwix cannot adapt a weight inside the
    chunks' scan), so at long ``T`` its ``[B, T, d_ff]`` intermediates are whole.
  """
  if not isinstance(model, Transformer):
    raise ValueError(f"`model` must be a jaxrl_llm.models.Transformer, got "
                     f"{type(model).__name__}.")
  if hasattr(model, "lora_spec"):
    raise ValueError("`model` already has LoRA adapters.")
  spec = lora_spec(rank, alpha, targets, base_dtype)
  qwix = _import_qwix()
  config = model.config
  quantizer, provider = _provider(spec, config)
  # qwix creates the adapters on a first (eager) call: run it with the blocks unrolled
  # (the scanned forward rebuilds blocks from stacked, traced parameters).
  model.config = dataclasses.replace(config, scan_layers=False, remat=False)
  try:
    tokens = jnp.zeros((1, 2), jnp.int32)
    base = model
    if quantizer is not None:
      base = qwix.quantize_model(model, quantizer, tokens)
      for _, module in nnx.iter_modules(base):   # the first pass left it a static None
        setattr(module, "qwix_rngs", nnx.data(None))  # noqa: B010 - a qwix attribute
    wrapped = qwix.apply_lora_to_model(base, provider, tokens, rngs=nnx.Rngs(seed))
  finally:
    model.config = config
  wrapped.config = config
  wrapped.lora_spec = spec
  for _, module in nnx.iter_modules(wrapped):
    if isinstance(module, MLP):
      # qwix adapts a weight in an einsum of the module's own call; the chunked MLP
      # (mlp_chunk_size) multiplies inside a scan, out of its reach: run it whole.
      module.chunk_size = None
  return wrapped


# ----------------------------------------------------------------------------------
# Trainable parts, reference, merged weights
# ----------------------------------------------------------------------------------

def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _has_lora(tree) -> bool:
  return any(isinstance(x, nnx.LoRAParam)
             for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_var))


def lora_trainable(params: Any) -> Any:
  """Which parameters a LoRA run trains: a pytree of bools, a prefix of ``params``.

  A model's ``nnx.LoRAParam`` adapters and its value head (``value_w`` / ``value_b``);
  for actor-critic parameters ``{"policy": ..., "critic": ...}`` each part by the
  same rule, a part without adapters (a fully trained critic) entirely.

  Examples:
    >>> from jaxrl_llm.models import Transformer, TransformerConfig, split_model
    >>> m = apply_lora(Transformer(TransformerConfig.tiny(32, n_layers=1)), rank=2,
    ...                targets="q")
    >>> _, params = split_model(m)
    >>> mask = lora_trainable(params)
    >>> mask["blocks"][0]["attn"]["wq_lora_b"], mask["blocks"][0]["attn"]["wq"]
    (True, False)
    >>> bool(mask["value_w"])
    True
  """
  from jaxrl_llm.models.critic import CRITIC, POLICY, VALUE_HEAD_PARAMS
  if isinstance(params, dict) and set(params) == {POLICY, CRITIC}:
    return {k: lora_trainable(part) if _has_lora(part) else
            jax.tree_util.tree_map(lambda _: True, part, is_leaf=_is_var)
            for k, part in params.items()}

  def mark(path, leaf):
    first = path[0] if path else None
    name = getattr(first, "key", getattr(first, "name", None))
    return isinstance(leaf, nnx.LoRAParam) or name in VALUE_HEAD_PARAMS

  return jax.tree_util.tree_map_with_path(mark, params, is_leaf=_is_var)


def _zero_b(params: Any) -> Any:
  def zero(path, leaf):
    last = path[-1] if path else None
    name = str(getattr(last, "key", getattr(last, "name", "")))
    if isinstance(leaf, nnx.LoRAParam) and name.endswith("_lora_b"):
      return leaf.replace(value=jnp.zeros_like(leaf.get_value()))
    return leaf
  return jax.tree_util.tree_map_with_path(zero, params, is_leaf=_is_var)


def lora_reference_apply(apply_fn: Callable[..., Any]) -> Callable[..., Any]:
  """The KL reference of a LoRA model: ``apply_fn`` with every :math:`B` zeroed.

  The result is the base model's forward computed on the *same* parameters (the base
  is shared, nothing is copied; the zeros are adapter-sized and made inside the jit).
  """
  def apply(params: Any, *args: Any, **kwargs: Any) -> Any:
    return apply_fn(_zero_b(params), *args, **kwargs)
  return apply


def _dequantize(x: Any, dtype: Any) -> jax.Array:
  """A weight's value as an array of ``dtype`` (qwix's QLoRA base dequantised)."""
  if isinstance(x, jax.Array):
    return x.astype(dtype)
  qwix = _import_qwix()
  return qwix.dequantize(getattr(x, "array", x)).astype(dtype)


def lora_delta(a: jax.Array, b: jax.Array, shape: Sequence[int], scale: float) -> jax.Array:
  r"""The weight update :math:`\frac{\alpha}{r} A B` of adapters ``a`` ``[in..., r]``
  and ``b`` ``[r, out...]``, in the weight's ``shape`` (float32).

  Examples:
    >>> import jax.numpy as jnp
    >>> lora_delta(jnp.ones((2, 1)), jnp.ones((1, 3)), (2, 3), 0.5).tolist()
    [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
  """
  d = jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)
  return (scale * d).reshape(tuple(shape))


def merge_lora(graphdef: nnx.GraphDef, params: Any) -> Any:
  r"""The base model's parameters with the adapters merged in:
  :math:`W \leftarrow W + \frac{\alpha}{r} A B` (the base dequantised under QLoRA),
  in the model's ``config.dtype``, without the adapter entries. Pure (jit it); the tree
  is that of the model before :func:`apply_lora`, so ``nnx.merge(base_graphdef(model),
  merged)`` is a plain Transformer (what the rollout engines and ``save_pretrained``
  take).

  Args:
    graphdef: the LoRA model's graphdef (``split_model`` of :func:`apply_lora`'s model).
    params: its parameters.
  """
  model = nnx.merge(graphdef, params)
  spec, config = model.lora_spec, model.config
  pure = nnx.to_pure_dict(params)
  for i, block in enumerate(model.blocks):
    for module_name in ("attn", "mlp"):
      module = getattr(block, module_name)
      entry = pure["blocks"][i][module_name]
      for key in [k for k in entry if "_lora_" in k]:
        del entry[key]
      for weight in {w for m, w in LORA_TARGETS.values() if m == module_name}:
        w = getattr(module, weight)
        w = _dequantize(w.get_value() if _is_var(w) else w, config.dtype)
        a = getattr(module, f"{weight}_lora_a", None)
        if a is not None:
          b = getattr(module, f"{weight}_lora_b")
          w = (w.astype(jnp.float32) + lora_delta(a.get_value(), b.get_value(), w.shape,
                                                  spec.scale)).astype(config.dtype)
        entry[weight] = w
  state = nnx.state(abstract_model(config), nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  return state


def base_graphdef(model: Transformer) -> nnx.GraphDef:
  """The graphdef of ``model``'s base (no adapters): what :func:`merge_lora`'s output
  merges into."""
  from jaxrl_llm.models.transformer import split_model
  return split_model(abstract_model(model.config))[0]


# ----------------------------------------------------------------------------------
# PEFT format
# ----------------------------------------------------------------------------------

_PEFT_PREFIX = "base_model.model."
#: The two files of a PEFT adapter folder.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def _np(x):
  import numpy as np
  return np.asarray(jax.device_get(x), np.float32)


def _peft_stems(spec: LoraSpec, config: TransformerConfig) -> dict[tuple[int, str, str], str]:
  """``{(layer, module, weight): PEFT tensor stem}`` of every adapter of ``spec``: the
  Hugging Face name of the adapted weight (:func:`~jaxrl_llm.models.hf.hf_layout`, the
  table the checkpoints are read and written with) less ``.weight``, prefixed
  ``base_model.model.``; the stem's ``.lora_A.weight`` / ``.lora_B.weight`` are the
  adapters."""
  from jaxrl_llm.models.hf import hf_layout
  layout = hf_layout(config)
  out = {}
  for i in range(config.n_layers):
    for target in spec.targets:
      module, weight = LORA_TARGETS[target]
      hf_name = layout[f"blocks.{i}.{module}.{weight}"].name
      out[(i, module, weight)] = _PEFT_PREFIX + hf_name[:-len(".weight")]
  return out


def lora_state_dict(params: Any, spec: LoraSpec, config: TransformerConfig) -> dict[str, Any]:
  """The adapters as PEFT tensors ``{name: float32 ndarray}``: for a weight whose
  Hugging Face tensor is ``X.weight`` ``[out, in]``, ``X.lora_A.weight`` ``[r, in]``
  (our :math:`A^T`) and ``X.lora_B.weight`` ``[out, r]`` (our :math:`B^T`), heads
  flattened in Hugging Face's order; names prefixed ``base_model.model.``."""
  out = {}
  r = spec.rank
  for (i, module, weight), stem in _peft_stems(spec, config).items():
    block = params["blocks"][i]
    a = _np(block[module][f"{weight}_lora_a"].get_value())
    b = _np(block[module][f"{weight}_lora_b"].get_value())
    out[f"{stem}.lora_A.weight"] = a.reshape(-1, r).T.copy()
    out[f"{stem}.lora_B.weight"] = b.reshape(r, -1).T.copy()
  return out


def save_lora_adapters(params: Any, spec: LoraSpec, config: TransformerConfig,
                       path: str | os.PathLike, *,
                       base_model: str | None = None) -> None:
  """Writes the adapters as a PEFT folder: ``adapter_model.safetensors`` +
  ``adapter_config.json`` (``peft.PeftModel.from_pretrained(base, path)`` loads it
  onto the ``transformers`` base checkpoint).

  Args:
    params: the LoRA model's parameters.
    spec: its :class:`LoraSpec`.
    config: its :class:`~jaxrl_llm.models.TransformerConfig`.
    path: the folder (created).
    base_model: ``base_model_name_or_path`` recorded in the config.
  """
  from safetensors.numpy import save_file
  os.makedirs(path, exist_ok=True)
  tensors = lora_state_dict(params, spec, config)
  save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
  cfg = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
      "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
      "target_modules": sorted(f"{t}_proj" for t in spec.targets),
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
      "base_model_name_or_path": base_model, "revision": None,
  }
  with open(os.path.join(path, ADAPTER_CONFIG_FILE), "w") as f:
    json.dump(cfg, f, indent=2, sort_keys=True)


# adapter_config.json fields that do not change what the loaded adapters compute
# (besides those checked one by one: peft_type, r, lora_alpha, target_modules, bias,
# fan_in_fan_out, init_lora_weights). Any other field set to a true value is a PEFT
# feature this loader would silently drop, so it is refused.
_PEFT_NEUTRAL = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "r", "target_modules", "lora_alpha", "lora_dropout",
    "fan_in_fan_out", "bias", "init_lora_weights", "layers_pattern", "megatron_config",
    "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "runtime_config", "ensure_weight_tying"})
# Features refused with their own message.
_PEFT_UNSUPPORTED = {
    "use_dora": "DoRA (a learned magnitude per output)",
    "use_rslora": "rsLoRA (the scale alpha / sqrt(r))",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained modules saved beside the adapters",
    "layers_to_transform": "adapters on some layers only",
    "exclude_modules": "modules excluded from the targets",
    "lora_bias": "a trained bias on lora_B",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "replicated layers",
    "target_parameters": "adapters on parameters (not modules)",
    "use_qalora": "QALoRA (pooled inputs to lora_A)",
    "alora_invocation_tokens": "activated LoRA (adapters from an invocation token on)",
}
# init_lora_weights that also rewrite the base weights (the adapters then belong to a
# modified base, not to the checkpoint's): PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# LoraSpec attribute -> its adapter_config.json field.
_PEFT_FIELDS = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules"}


def _arg(flag: str) -> str:
  """How a message names the argument ``flag``: a command-line flag as is, a Python
  argument in backquotes."""
  return flag if flag.startswith("-") else f"`{flag}`"


def _adapter_targets(target_modules: Any, path: str, where: str) -> list[str]:
  """PEFT's ``target_modules`` as our target names (``"x_proj"`` -> ``"x"``): a list of
  module names (PEFT matches their dotted suffix), ``"all-linear"``, or a regular
  expression over the full module names (PEFT's ``re.fullmatch``), resolved against
  the modules that have tensors in the folder."""
  if target_modules == "all-linear":
    return list(LORA_TARGETS)
  if isinstance(target_modules, str):
    import re

    from safetensors import safe_open
    suffix = ".lora_A.weight"
    try:
      with safe_open(os.path.join(path, ADAPTER_WEIGHTS_FILE), framework="numpy") as f:
        keys = list(f.keys())  # noqa: SIM118 - a safetensors handle, not a dict
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
      raise ValueError(f"{where}: {ADAPTER_WEIGHTS_FILE} cannot be read ({e}).") from None
    modules = [k[len(_PEFT_PREFIX):-len(suffix)] for k in keys
               if k.startswith(_PEFT_PREFIX) and k.endswith(suffix)]
    try:
      names = sorted({m.split(".")[-1] for m in modules if re.fullmatch(target_modules, m)})
    except re.error as e:
      raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE}'s target_modules "
                       f"{target_modules!r} is not a regular expression ({e}).") from None
  elif isinstance(target_modules, list | tuple) and all(
      isinstance(n, str) for n in target_modules):
    names = [n.split(".")[-1] for n in target_modules]
  else:
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE}'s target_modules must be a list of "
                     f"module names, 'all-linear' or a regular expression, got "
                     f"{target_modules!r}.")
  bad = [n for n in names if n.removesuffix("_proj") not in LORA_TARGETS]
  if bad or not names:
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE}'s target_modules "
                     f"{target_modules!r}: {bad or 'nothing'} matches no LoRA target "
                     f"(the linear layers {', '.join(t + '_proj' for t in LORA_TARGETS)}).")
  return [n.removesuffix("_proj") for n in names]


def read_lora_config(path: str | os.PathLike, *, base_dtype: str = "bf16",
                     flag: str = "path") -> LoraSpec:
  """The :class:`LoraSpec` of a PEFT LoRA adapter folder (``adapter_config.json``'s
  ``r``, ``lora_alpha`` and ``target_modules``; ``base_dtype`` is the caller's).

  The folder must hold ``adapter_config.json`` and ``adapter_model.safetensors``, and
  the config must describe plain LoRA on the linear layers of the blocks: features
  that change the forward (DoRA, rsLoRA, a ``bias`` other than ``"none"``,
  ``rank_pattern`` / ``alpha_pattern``, ``modules_to_save``, an initialisation that
  rewrites the base such as PiSSA, ...) are refused.

  Args:
    path: the adapter folder.
    base_dtype: the spec's ``base_dtype`` (:func:`lora_spec`).
    flag: how errors name ``path`` (a command-line flag such as ``"--lora-init"``).

  Raises:
    ValueError: one line naming ``path`` (or ``flag``) and the file or field.

  Examples:
    >>> import tempfile
    >>> from jaxrl_llm.models import Transformer, TransformerConfig, split_model
    >>> m = apply_lora(Transformer(TransformerConfig.tiny(32, n_layers=1)), rank=2,
    ...                alpha=4.0, targets="q,v")
    >>> folder = tempfile.mkdtemp()
    >>> save_lora_adapters(split_model(m)[1], m.lora_spec, m.config, folder)
    >>> read_lora_config(folder)
    LoraSpec(rank=2, alpha=4.0, targets=('q', 'v'), base_dtype='bf16')
  """
  path = os.fspath(path)
  where = f"{_arg(flag)} {path!r}"
  if not os.path.isdir(path):
    raise ValueError(f"{where} is not a folder (a PEFT adapter folder holds "
                     f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}).")
  for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
    if not os.path.isfile(os.path.join(path, name)):
      hint = (" (it has adapter_model.bin, a torch pickle: save the adapter with "
              "safe_serialization=True)" if name == ADAPTER_WEIGHTS_FILE and os.path.isfile(
                  os.path.join(path, "adapter_model.bin")) else "")
      raise ValueError(f"{where} has no {name}{hint}.")
  file = os.path.join(path, ADAPTER_CONFIG_FILE)
  with open(file, encoding="utf-8") as f:
    try:
      cfg = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} is not valid JSON ({e.msg} at line "
                       f"{e.lineno}).") from None
  if not isinstance(cfg, dict):
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} is not a JSON object.")
  if cfg.get("peft_type") != "LORA":
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} has peft_type="
                     f"{cfg.get('peft_type')!r}; only LoRA adapters ('LORA') load here.")
  for key, what in _PEFT_UNSUPPORTED.items():
    if cfg.get(key):
      raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} sets {key}={cfg[key]!r}: {what} "
                       "is not supported (plain LoRA only).")
  if cfg.get("bias", "none") != "none":
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} has bias={cfg['bias']!r}: trained "
                     "biases are not supported (bias='none' only).")
  if cfg.get("fan_in_fan_out"):
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} has fan_in_fan_out=true (Conv1D "
                     "layers, e.g. GPT-2); the families loaded here use Linear layers.")
  init = cfg.get("init_lora_weights", True)
  if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} has init_lora_weights={init!r}, "
                     "which rewrites the base weights too: convert the adapter to plain "
                     "LoRA first (PEFT's path_initial_model_for_weight_conversion).")
  for key, value in cfg.items():
    if key not in _PEFT_NEUTRAL and key not in _PEFT_UNSUPPORTED and value:
      raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} sets {key}={value!r}, a PEFT "
                       "setting this loader does not reproduce.")
  rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE}'s r must be an int >= 1, got "
                     f"{rank!r}.")
  if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
    raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE}'s lora_alpha must be a number > 0, "
                     f"got {alpha!r}.")
  targets = _adapter_targets(cfg.get("target_modules"), path, where)
  return lora_spec(rank, float(alpha), targets, base_dtype)


def lora_spec_mismatch(spec: LoraSpec, adapter: LoraSpec) -> tuple[str, Any, Any] | None:
  """``(attribute, spec's value, adapter's value)`` of the first of ``rank``, ``alpha``,
  ``targets`` on which ``spec`` and ``adapter`` differ (None when they agree).

  Examples:
    >>> lora_spec_mismatch(lora_spec(4, targets="q,v"), lora_spec(4, 8.0, targets="v,q"))
    ('alpha', 4.0, 8.0)
  """
  for name in _PEFT_FIELDS:
    ours, theirs = getattr(spec, name), getattr(adapter, name)
    if ours != theirs:
      return name, ours, theirs
  return None


def load_lora_state_dict(params: Any, tensors: dict[str, Any], spec: LoraSpec,
                         config: TransformerConfig, *, flag: str = "tensors") -> Any:
  """``params`` with its adapters taken from the PEFT tensors ``tensors`` (the inverse
  of :func:`lora_state_dict`: :math:`A` is ``lora_A.weight`` ``[r, in]`` transposed
  and unflattened to ``[in..., r]``, :math:`B` is ``lora_B.weight`` ``[out, r]`` to
  ``[r, out...]``; Hugging Face's head order, names from
  :func:`~jaxrl_llm.models.hf.hf_layout`). Pure: the base weights are ``params``'
  own, the adapters keep their dtype and sharding.

  Args:
    params: a LoRA model's parameters (``split_model`` of :func:`apply_lora`'s model).
    tensors: ``{PEFT name: array}`` (e.g. ``safetensors.numpy.load_file``), any float
      dtype.
    spec: the model's :class:`LoraSpec`.
    config: its :class:`~jaxrl_llm.models.TransformerConfig`.
    flag: how errors name ``tensors``.

  Raises:
    AdapterError: a tensor missing, of the wrong shape, not finite, or not an adapter
      of ``spec`` on this model (one line naming the first).
  """
  return _load_state_dict(params, tensors, spec, config, _arg(flag))


def _load_state_dict(params: Any, tensors: dict[str, Any], spec: LoraSpec,
                     config: TransformerConfig, where: str) -> Any:
  """:func:`load_lora_state_dict`, its errors starting with ``where``."""
  import numpy as np
  wanted: dict[tuple[str, ...], str] = {}
  for (i, module, weight), stem in _peft_stems(spec, config).items():
    wanted[("blocks", str(i), module, f"{weight}_lora_a")] = f"{stem}.lora_A.weight"
    wanted[("blocks", str(i), module, f"{weight}_lora_b")] = f"{stem}.lora_B.weight"
  extra = sorted(set(tensors) - set(wanted.values()))
  if extra:
    raise AdapterError(f"{where}: tensor {extra[0]!r} is not an adapter of targets "
                       f"{','.join(spec.targets)} on this {config.n_layers}-layer model "
                       f"({len(extra)} such tensors).")
  missing = sorted(set(wanted.values()) - set(tensors))
  if missing:
    raise AdapterError(f"{where}: tensor {missing[0]!r} is missing ({len(missing)} "
                       f"adapter tensors of targets {','.join(spec.targets)} missing).")
  found = set()

  def put(path, leaf):
    key = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                for k in path)
    if key not in wanted or not isinstance(leaf, nnx.LoRAParam):
      return leaf
    name, value = wanted[key], leaf.get_value()
    x = np.asarray(tensors[name])
    r = spec.rank
    if key[-1].endswith("_a"):
      expected = (r, math.prod(value.shape[:-1]))
    else:
      expected = (math.prod(value.shape[1:]), r)
    if tuple(x.shape) != expected:
      raise AdapterError(f"{where}: tensor {name!r} has shape {list(x.shape)}, expected "
                         f"{list(expected)} (rank {r} on this model's weight).")
    new = x.astype(np.float32)
    _refuse_nonfinite(new, name, where)
    new = new.T.reshape(value.shape).astype(value.dtype)
    found.add(key)
    return leaf.replace(value=jax.device_put(new, value.sharding))

  out = jax.tree_util.tree_map_with_path(put, params, is_leaf=_is_var)
  if len(found) != len(wanted):
    lost = sorted(set(wanted) - found)[0]
    raise ValueError(f"`params` has no adapter {'.'.join(lost)}: it is not the LoRA model "
                     f"of `spec` {spec}.")
  return out


def _refuse_nonfinite(x: Any, name: str, where: str) -> None:
  """Raises :class:`AdapterError` when the float32 array ``x`` holds a NaN or an inf: a
  non-finite adapter makes every loss non-finite, so every update would be skipped."""
  import numpy as np
  bad = ~np.isfinite(x)
  if bad.any():
    raise AdapterError(f"{where}: tensor {name!r} has {int(bad.sum())} non-finite values "
                       f"(NaN or inf) of {x.size}: an adapter to start from must be finite.")


def read_lora_tensors(path: str | os.PathLike, *, flag: str = "path") -> dict[str, Any]:
  """The tensors of the adapter folder ``path`` (``{PEFT name: numpy array}``), each
  checked to be finite.

  Raises:
    AdapterError: the weights file cannot be read (missing, truncated, not
      safetensors) or a tensor holds NaN or inf; one line naming ``path`` (or
      ``flag``) and the tensor.

  Examples:
    >>> import os, tempfile
    >>> import numpy as np
    >>> from safetensors.numpy import save_file
    >>> folder = tempfile.mkdtemp()
    >>> save_file({"a": np.array([1.0, np.inf], np.float32)},
    ...           os.path.join(folder, ADAPTER_WEIGHTS_FILE))
    >>> try:
    ...   read_lora_tensors(folder, flag="--lora-init")
    ... except AdapterError as e:
    ...   print(str(e).replace(folder, "ADAPTER"))
    --lora-init 'ADAPTER': adapter_model.safetensors: tensor 'a' has 1 non-finite values
    (NaN or inf) of 2: an adapter to start from must be finite.
  """
  import numpy as np
  from safetensors.numpy import load_file
  where = f"{_arg(flag)} {os.fspath(path)!r}"
  try:
    tensors = load_file(os.path.join(os.fspath(path), ADAPTER_WEIGHTS_FILE))
  except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
    reason = " ".join(str(e).split())
    raise AdapterError(f"{where}: {ADAPTER_WEIGHTS_FILE} cannot be read ({reason}).") from None
  for name in sorted(tensors):
    x = tensors[name]
    if np.issubdtype(x.dtype, np.floating):
      _refuse_nonfinite(np.asarray(x, np.float32), name, f"{where}: {ADAPTER_WEIGHTS_FILE}")
  return tensors


def load_lora_adapters(model: Transformer, path: str | os.PathLike, *,
                       base_dtype: str = "bf16", seed: int = 0,
                       flag: str = "path") -> Transformer:
  """``model`` with the adapters of the PEFT LoRA folder ``path`` (a new model).

  The inverse of :func:`save_lora_adapters`: it loads what ``export`` writes and
  what ``peft``'s ``save_pretrained`` writes for a Llama / Qwen2 / Qwen3 model (e.g. an
  SFT adapter trained with TRL), onto the same base checkpoint
  (:func:`~jaxrl_llm.models.from_pretrained`).

  Args:
    model: a :class:`~jaxrl_llm.models.Transformer`. With adapters
      (:func:`apply_lora`), its rank, alpha and targets must equal the folder's
      ``r``, ``lora_alpha`` and ``target_modules``; without, it is first wrapped by
      :func:`apply_lora` with those (and ``base_dtype``, ``seed``).
    path: the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
    base_dtype: the frozen base's storage when ``model`` is wrapped here.
    seed: :func:`apply_lora`'s seed when ``model`` is wrapped here (every adapter is
      then overwritten by the folder's).
    flag: how errors name ``path``.

  Raises:
    ValueError: one line naming ``path`` (or ``flag``) or ``model``: what
      :func:`read_lora_config` refuses, a rank / alpha / targets that differ from the
      model's adapters; an :class:`AdapterError` for an unreadable (truncated) weights
      file or a missing, extra, wrongly shaped or non-finite tensor.

  Examples:
    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> from jaxrl_llm.models import Transformer, TransformerConfig, split_model
    >>> base = Transformer(TransformerConfig.tiny(32, n_layers=1))
    >>> trained = apply_lora(base, rank=2, targets="q,v", seed=1)
    >>> folder = tempfile.mkdtemp()
    >>> save_lora_adapters(split_model(trained)[1], trained.lora_spec, trained.config,
    ...                    folder)
    >>> loaded = load_lora_adapters(base, folder)          # wrapped per the folder
    >>> bool(jnp.all(loaded.blocks[0].attn.wq_lora_a[...] == trained.blocks[0].attn.wq_lora_a[...]))
    True
  """
  from jaxrl_llm.models.transformer import split_model
  adapter = read_lora_config(path, base_dtype=base_dtype, flag=flag)
  where = f"{_arg(flag)} {os.fspath(path)!r}"
  if not isinstance(model, Transformer):
    raise ValueError(f"`model` must be a jaxrl_llm.models.Transformer, got "
                     f"{type(model).__name__}.")
  spec = adapter                    # the spec of the model with the adapters
  if hasattr(model, "lora_spec"):
    spec = model.lora_spec
    bad = lora_spec_mismatch(spec, adapter)
    if bad is not None:
      name, ours, theirs = bad
      raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} has {_PEFT_FIELDS[name]}="
                       f"{theirs!r}, but `model`'s adapters have {name}={ours!r} (wrap the "
                       "model with the adapter's settings, or pass it unwrapped).")
  else:
    model = apply_lora(model, rank=adapter.rank, alpha=adapter.alpha,
                       targets=adapter.targets, base_dtype=base_dtype, seed=seed)
  tensors = read_lora_tensors(path, flag=flag)
  graphdef, params = split_model(model)
  params = _load_state_dict(params, tensors, spec, model.config,
                            f"{where}: {ADAPTER_WEIGHTS_FILE}")
  return nnx.merge(graphdef, params)


def num_lora_params(config: TransformerConfig, spec: LoraSpec) -> int:
  """Closed form of the adapter count: per layer, per target, :math:`r\\,(in + out)`.

  Examples:
    >>> from jaxrl_llm.models import TransformerConfig
    >>> c = TransformerConfig.tiny(32)
    >>> num_lora_params(c, lora_spec(2, targets="q")) == c.n_layers * 2 * (
    ...     c.d_model + c.n_heads * c.dim_per_head)
    True
  """
  c = config
  d, hq, hk, f = c.d_model, c.n_heads * c.dim_per_head, c.n_kv_heads * c.dim_per_head, c.d_ff
  sizes = {"q": d + hq, "k": d + hk, "v": d + hk, "o": hq + d, "gate": d + f, "up": d + f,
           "down": f + d}
  return c.n_layers * spec.rank * sum(sizes[t] for t in spec.targets)


__all__ = ["AdapterError", "LORA_TARGETS", "LORA_BASE_DTYPES", "LoraSpec", "lora_spec",
           "parse_targets", "apply_lora", "lora_trainable", "lora_reference_apply", "lora_delta",
           "merge_lora", "base_graphdef", "lora_state_dict", "save_lora_adapters",
           "ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "read_lora_config",
           "lora_spec_mismatch", "load_lora_state_dict", "read_lora_tensors",
           "load_lora_adapters", "num_lora_params"]
