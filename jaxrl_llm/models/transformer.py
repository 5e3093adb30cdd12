"""A reference causal transformer LM with an optional value head (Flax NNX).

Architecture (pre-norm, LLaMA-style): token embedding -> ``n_layers`` blocks of
``x + Attn(RMSNorm(x))`` and ``x + SwiGLU(RMSNorm(x))`` -> final RMSNorm. The LM head is
the transposed embedding (tied) or its own ``[D, V]`` matrix; the optional value head is
a ``Linear(D -> 1)`` on the same final hidden states (shared trunk). A separate critic is
simply another ``Transformer`` whose ``hidden`` output is ignored.

Conventions:

* ``attention_mask`` ``[B, T]``: 1 = real token, 0 = padding. A padded key is never
  attended to, so the ids at padded positions never change the outputs at real ones,
  and ``hidden``/``values`` at padded positions are set to 0.
* ``positions`` default to ``max(cumsum(attention_mask) - 1, 0)``: the k-th real token of
  a row has position k-1 wherever it sits. Left padding, right padding and holes all
  give the same outputs at real tokens.
* Causality is by array index: the query at index t sees the real keys at indices <= t.
  Attention is :func:`jaxrl_llm.attention.dot_product_attention` (``config.attention``
  picks the implementation; ``None`` chooses by backend and size, so long sequences get
  the O(T)-memory ``"blockwise"`` kernel and a ``sequence`` mesh axis gets ``"ring"``
  when :mod:`jaxrl_llm.parallel` registers it). A padded query that sees no real key
  gets a zero attention output. Where cuDNN's fused attention can run (GPU, bf16/fp16)
  the full forward packs each row's real tokens to the front instead of passing a
  padding mask, which that kernel cannot take (``TransformerConfig.pack_padding``).
* Every parameter carries logical axis names (``vocab``, ``embed``, ``heads``,
  ``kv_heads``, ``head_dim``, ``mlp``, or ``None``) as ``out_sharding`` metadata with
  eager sharding off; ``nnx.get_partition_spec(nnx.state(model))`` gives the logical
  spec of each parameter, and the caller maps names to mesh axes (e.g. inside
  ``flax.linen.logical_axis_rules``).
* Matmuls run in ``config.dtype``; RMSNorm, RoPE, the attention softmax, logits and
  values are computed in float32.

Pure functional use (train steps never touch the class):

.. code-block:: python

  graphdef, params = split_model(Transformer(config, rngs=nnx.Rngs(0)))
  apply = make_apply_fn(graphdef)
  hidden, values, lm_head = apply(params, tokens, None, mask)   # jit/grad over params

KV-cache decoding: ``init_cache`` -> ``prefill`` (the prompt, any padding layout) ->
``decode`` (one token per row per call). ``make_decode_fns(graphdef)`` wraps these as
pure functions of ``params`` returning next-token logits, the protocol of
:func:`jaxrl_llm.rollout.sampler.sample`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from jaxrl_llm import _validate as v
from jaxrl_llm._names import MODEL_PRESETS as PRESETS
from jaxrl_llm.attention import (
  ATTENTION_IMPLEMENTATIONS,
  dot_product_attention,
  paged_attention,
  select_implementation,
)
from jaxrl_llm.models.protocol import DecodeFns, PagedDecodeFns
from jaxrl_llm.packing import segment_positions

KVPair = tuple[jax.Array, jax.Array]   # one layer's (keys, values)

#: ``TransformerConfig.remat_policy`` names -> ``jax.checkpoint`` policies.
REMAT_POLICIES: dict[str, Any] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


# ----------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  r"""Llama-3 RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``).

  With wavelength :math:`\lambda_i = 2\pi / \omega_i`, :math:`L` =
  ``original_max_position_embeddings``, :math:`s` = ``factor``, :math:`l, h` = the low
  and high frequency factors: :math:`\omega_i` is kept when :math:`\lambda_i < L/h`,
  divided by :math:`s` when :math:`\lambda_i > L/l`, and in between interpolated,
  :math:`(1-\mu)\,\omega_i/s + \mu\,\omega_i` with
  :math:`\mu = (L/\lambda_i - l)/(h - l)` (Meta's Llama 3.1 reference code).
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self) -> None:
    if not self.factor > 0 or not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(f"RopeScaling needs factor > 0 and high_freq_factor > "
                       f"low_freq_factor > 0, got {self!r}.")
    if self.original_max_position_embeddings < 1:
      raise ValueError(f"`original_max_position_embeddings` must be positive, got "
                       f"{self.original_max_position_embeddings}.")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Static sizes and options of :class:`Transformer`.

  Attributes:
    vocab_size: V, number of token ids.
    d_model: D, width of the residual stream.
    n_layers: number of transformer blocks.
    n_heads: H, number of query heads.
    n_kv_heads: K, number of key/value heads; ``K < H`` is grouped-query attention
      (each K/V head serves ``H // K`` query heads), ``K == H`` is multi-head.
    d_ff: hidden width F of the SwiGLU MLP.
    max_seq_len: the longest sequence (prompt + completion) the model is meant for;
      informational for RoPE (which has no table) and used as the default cache size.
    head_dim: per-head width; ``None`` means ``d_model // n_heads``. Must be even.
    rope_theta: RoPE base :math:`\\theta`.
    tie_embeddings: use the transposed embedding as the LM head.
    value_head: add a scalar value head ``Linear(D -> 1)`` on the final hidden states.
    remat: wrap each block in ``nnx.remat`` (``jax.checkpoint``) in the full forward,
      trading recomputation for activation memory; results are equal to float
      rounding.
    scan_layers: run the blocks of the full forward with ``jax.lax.scan`` over their
      parameters, stacked inside the forward (the parameter tree keeps one entry per
      block, so checkpoints, Hugging Face loading and sharding rules are unchanged).
      With ``remat=True`` this is what makes remat pay off: the scan's backward
      recomputes one block at a time, where an unrolled stack lets XLA schedule every
      block's recomputation early (all blocks' ``[T, d_ff]`` intermediates live at
      once). Outputs equal the unrolled loop; it also compiles one block instead of
      ``n_layers``. The stacked copy costs one parameter-sized buffer (and its
      gradient one more).
    mlp_chunk_size: run the SwiGLU MLP over chunks of at most this many sequence
      positions per chunk (per ``sequence`` shard under a sequence mesh) when ``T`` is
      longer, with ``jax.checkpoint`` on each chunk: the ``[B, T, d_ff]`` intermediates
      (and their gradients) then exist one ``[B, chunk, d_ff]`` block at a time. The MLP
      is per-token, so every output is the unchunked one (each token's sums run over
      ``d_model`` / ``d_ff`` as before; equal to float rounding). Chunks are strided
      (chunk ``k`` holds positions ``k, k + n, k + 2n, ...``) so a sequence-sharded
      ``T`` stays sharded inside each chunk. ``None``: never chunk.
    remat_policy: what a remat'd block keeps for the backward pass (only with
      ``remat=True``): ``None`` or ``"nothing_saveable"`` (the least memory: only block
      inputs), ``"dots_saveable"`` / ``"dots_with_no_batch_dims_saveable"`` (keep matmul
      outputs, less recomputation), ``"everything_saveable"``; see ``REMAT_POLICIES``.
    attention: the :func:`jaxrl_llm.dot_product_attention` implementation
      (``"xla"``, ``"blockwise"``, ``"cudnn"``, a registered name such as ``"ring"``),
      or ``None`` to choose by backend and size (``select_implementation``).
    attention_block_size: query/key block size of ``"blockwise"``; ``None`` = default.
    pack_padding: in the full forward, move each row's real tokens to the front (in
      order, with their positions) before the blocks and back after them, so that
      causality alone hides the padding and attention needs no ``key_mask``. Exact
      (a real query sees the same real keys in the same order). ``None`` (default):
      only where that lets ``"cudnn"`` run (a GPU, bf16/fp16, no sequence mesh), whose
      fused kernel takes no arbitrary padding mask; ``True``/``False``: always/never.
    dtype: parameter and matmul dtype (e.g. ``jnp.float32`` or ``jnp.bfloat16``).
    norm_eps: RMSNorm epsilon.
    qkv_bias: add biases to the query/key/value projections (Qwen2).
    qk_norm: RMSNorm over ``head_dim`` of each query and key head before RoPE (Qwen3).
    rope_scaling: a :class:`RopeScaling` (Llama-3 frequency scaling) or ``None``.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  max_seq_len: int
  head_dim: int | None = None
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  value_head: bool = True
  remat: bool = False
  scan_layers: bool = True
  dtype: Any = jnp.float32
  norm_eps: float = 1e-6
  remat_policy: str | None = None
  mlp_chunk_size: int | None = 4096
  attention: str | None = None
  attention_block_size: int | None = None
  pack_padding: bool | None = None
  qkv_bias: bool = False
  qk_norm: bool = False
  rope_scaling: RopeScaling | None = None

  def __post_init__(self) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                 "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"`n_heads` ({self.n_heads}) must be a multiple of `n_kv_heads` "
          f"({self.n_kv_heads}).")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"`d_model` ({self.d_model}) must be divisible by `n_heads` ({self.n_heads}) "
          "when `head_dim` is None.")
    if self.dim_per_head % 2:
      raise ValueError(f"`head_dim` must be even for RoPE, got {self.dim_per_head}.")
    if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
      raise ValueError(f"`dtype` must be a floating dtype, got {self.dtype!r}.")
    if self.remat_policy is not None:
      v.check_choice("remat_policy", self.remat_policy, tuple(REMAT_POLICIES))
    # Implementations may be registered later (e.g. "ring" by jaxrl_llm.parallel), so
    # an unknown name is only rejected at trace time; here only the type is checked.
    if self.attention is not None and not isinstance(self.attention, str):
      raise ValueError(f"`attention` must be None or an implementation name (one of "
                       f"{list(ATTENTION_IMPLEMENTATIONS)}), got {self.attention!r}.")
    if self.attention_block_size is not None and (
        not isinstance(self.attention_block_size, int) or self.attention_block_size < 1):
      raise ValueError(f"`attention_block_size` must be None or a positive int, got "
                       f"{self.attention_block_size!r}.")
    if self.mlp_chunk_size is not None and (
        not isinstance(self.mlp_chunk_size, int) or self.mlp_chunk_size < 1):
      raise ValueError(f"`mlp_chunk_size` must be None or a positive int, got "
                       f"{self.mlp_chunk_size!r}.")
    if self.pack_padding is not None and not isinstance(self.pack_padding, bool):
      raise ValueError(f"`pack_padding` must be None, True or False, got "
                       f"{self.pack_padding!r}.")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"`rope_scaling` must be None or a RopeScaling, got "
                       f"{self.rope_scaling!r}.")

  @property
  def dim_per_head(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  @classmethod
  def tiny(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
    """64 wide, 2 layers, 4 query / 2 KV heads: a CPU fwd+bwd in milliseconds."""
    base = {"vocab_size": vocab_size, "d_model": 64, "n_layers": 2, "n_heads": 4,
            "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 128}
    return cls(**{**base, **overrides})

  @classmethod
  def small(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
    """256 wide, 4 layers, 8 query / 4 KV heads, d_ff 1024, 512 tokens (~3M + 256 V)."""
    base = {"vocab_size": vocab_size, "d_model": 256, "n_layers": 4, "n_heads": 8,
            "n_kv_heads": 4, "d_ff": 1024, "max_seq_len": 512}
    return cls(**{**base, **overrides})


def get_config(name: str, vocab_size: int, **overrides: Any) -> TransformerConfig:
  """A preset config by name (``"tiny"`` or ``"small"``), with field overrides.

  Examples:
    >>> get_config("tiny", 32, value_head=False).d_model
    64
  """
  v.check_choice("name", name, PRESETS)
  return getattr(TransformerConfig, name)(vocab_size, **overrides)


# ----------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  """A Param with logical axis names as (non-eager) ``out_sharding`` metadata."""
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(names),
                   eager_sharding=False)


def _weight(param: Any, dtype: DTypeLike) -> Any:
  """A matmul weight in ``dtype``; a weight qwix has quantised (QLoRA,
  :mod:`jaxrl_llm.models.lora`) is passed as it is (qwix's product dequantises it)."""
  if not isinstance(param, nnx.Variable):   # qwix's quantised weight: as stored
    return param
  return param[...].astype(dtype)


def _normal(stddev):
  return nnx.initializers.normal(stddev=stddev)


def rope_frequencies(d: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  r"""The ``d/2`` RoPE frequencies :math:`\omega_i = \theta^{-2i/d}` (float32),
  scaled by ``scaling`` (:class:`RopeScaling`) when given."""
  freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  if scaling is None:
    return freqs
  s, lo, hi = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
  old = float(scaling.original_max_position_embeddings)
  wavelen = 2 * jnp.pi / freqs
  scaled = jnp.where(wavelen > old / lo, freqs / s, freqs)
  mu = (old / wavelen - lo) / (hi - lo)
  smoothed = (1 - mu) * scaled / s + mu * scaled
  medium = (wavelen >= old / hi) & (wavelen <= old / lo)
  return jnp.where(medium, smoothed, scaled)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
  r"""Rotary position embedding (rotate-half form), computed in float32.

  For each head vector split into halves :math:`(a, b)` of width ``d/2`` and frequency
  :math:`\omega_i = \theta^{-2i/d}`, position :math:`p` maps

  .. math::

    (a_i, b_i) \mapsto (a_i \cos p\omega_i - b_i \sin p\omega_i,\;
                        b_i \cos p\omega_i + a_i \sin p\omega_i),

  so :math:`\langle \mathrm{rope}(q, p), \mathrm{rope}(k, s)\rangle` depends on
  :math:`p - s` only.

  Args:
    x: ``[B, T, N, d]`` queries or keys (``d`` even).
    positions: ``[B, T]`` integer positions.
    theta: RoPE base.
    scaling: optional :class:`RopeScaling` of the frequencies (Llama 3).

  Returns:
    ``[B, T, N, d]`` in the dtype of ``x``.
  """
  d = x.shape[-1]
  freqs = rope_frequencies(d, theta, scaling)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, d/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  a, b = x32[..., : d // 2], x32[..., d // 2:]
  out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):
  r""":math:`y = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \cdot g` (float32 inside)."""

  def __init__(self, dim: int, eps: float, dtype: DTypeLike, *, rngs: nnx.Rngs,
               names: tuple[str, ...] = ("embed",)) -> None:
    self.eps = eps
    self.scale = _param(rngs, nnx.initializers.ones, (dim,), names, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
  """Multi-head / grouped-query self-attention with RoPE and an optional KV cache."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
    c = config
    d, h, kvh, hd = c.d_model, c.n_heads, c.n_kv_heads, c.dim_per_head
    self.theta = c.rope_theta
    self.rope_scaling = c.rope_scaling
    self.implementation = c.attention
    self.block_size = c.attention_block_size
    std_in = d ** -0.5
    std_out = (h * hd) ** -0.5 / (2 * c.n_layers) ** 0.5
    self.wq = _param(rngs, _normal(std_in), (d, h, hd), ("embed", "heads", "head_dim"),
                     c.dtype)
    self.wk = _param(rngs, _normal(std_in), (d, kvh, hd),
                     ("embed", "kv_heads", "head_dim"), c.dtype)
    self.wv = _param(rngs, _normal(std_in), (d, kvh, hd),
                     ("embed", "kv_heads", "head_dim"), c.dtype)
    self.wo = _param(rngs, _normal(std_out), (h, hd, d), ("heads", "head_dim", "embed"),
                     c.dtype)
    if c.qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq = _param(rngs, zeros, (h, hd), ("heads", "head_dim"), c.dtype)
      self.bk = _param(rngs, zeros, (kvh, hd), ("kv_heads", "head_dim"), c.dtype)
      self.bv = _param(rngs, zeros, (kvh, hd), ("kv_heads", "head_dim"), c.dtype)
    if c.qk_norm:
      self.q_norm = RMSNorm(hd, c.norm_eps, c.dtype, rngs=rngs, names=("head_dim",))
      self.k_norm = RMSNorm(hd, c.norm_eps, c.dtype, rngs=rngs, names=("head_dim",))

  def _project(self, x, positions):
    """Rotated queries ``[B, T, H, d]``, rotated keys and values ``[B, T, K, d]``."""
    dtype = x.dtype
    q = jnp.einsum("btd,dhk->bthk", x, _weight(self.wq, dtype))
    k = jnp.einsum("btd,dhk->bthk", x, _weight(self.wk, dtype))
    val = jnp.einsum("btd,dhk->bthk", x, _weight(self.wv, dtype))
    if hasattr(self, "bq"):   # config.qkv_bias
      q = q + self.bq[...].astype(dtype)
      k = k + self.bk[...].astype(dtype)
      val = val + self.bv[...].astype(dtype)
    if hasattr(self, "q_norm"):   # config.qk_norm
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q, positions, self.theta, self.rope_scaling)
    k = rope(k, positions, self.theta, self.rope_scaling)
    return q, k, val

  def paged(self, x: jax.Array, positions: jax.Array, page_table: jax.Array, pages_kv: KVPair,
            chunk_pages: int | None = None) -> tuple[jax.Array, KVPair]:
    """Attention of ``x`` ``[B, T, D]`` at ``positions`` ``[B, T]`` (``< 0``: padding)
    over a paged KV pool ``pages_kv = (k, v)`` ``[num_pages, P, K, d]``.

    The new keys/values are written first at ``(page_table[b, p // P], p % P)`` (padding
    writes are dropped), then :func:`~jaxrl_llm.attention.paged_attention` reads the
    row's positions ``<= p``. Returns ``(out [B, T, D], (k_pages, v_pages))``.
    """
    dtype = x.dtype
    q, k, val = self._project(x, jnp.maximum(positions, 0))
    k_pages, v_pages = pages_kv
    num_pages, page = k_pages.shape[:2]
    real = positions >= 0
    pos = jnp.maximum(positions, 0)
    ids = jnp.take_along_axis(page_table.astype(jnp.int32), pos // page, axis=1)
    ids = jnp.where(real, ids, num_pages)          # out of range: the write is dropped
    k_pages = k_pages.at[ids, pos % page].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[ids, pos % page].set(val.astype(v_pages.dtype), mode="drop")
    out = paged_attention(q, k_pages, v_pages, page_table, positions,
                          chunk_pages=chunk_pages)
    out = jnp.einsum("bthk,hkd->btd", out.astype(dtype), _weight(self.wo, dtype))
    return out, (k_pages, v_pages)

  def __call__(self, x: jax.Array, positions: jax.Array, kv_valid: jax.Array | None,
               cache_kv: KVPair | None = None, index: ArrayLike | None = None,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, KVPair]:
    """Attention over ``x`` ``[B, T, D]``; with a cache, over cache + ``x``.

    Without ``cache_kv`` the keys are ``x``'s own (``kv_valid`` ``[B, T]``), and query
    ``t`` sees keys ``<= t``. With ``cache_kv = (k, v)`` ``[B, S, K, d]`` the new keys
    are written at slots ``index .. index+T-1``, ``kv_valid`` ``[B, S]`` covers the
    whole cache (unwritten slots False), and query ``t`` sees slots ``<= index + t``
    (``query_offset=index``: the cache is not end-aligned, its tail is unwritten).
    ``segment_ids`` ``[B, T]`` (packed rows, no cache): a query sees its own segment.
    Returns ``(out [B, T, D], (k, v))``.
    """
    dtype = x.dtype
    q, k, val = self._project(x, positions)
    query_offset = None
    if cache_kv is not None:
      assert index is not None   # a cache comes with its write index
      ck, cv = cache_kv
      k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, index, 0, 0))
      val = jax.lax.dynamic_update_slice(cv, val.astype(cv.dtype), (0, index, 0, 0))
      query_offset = jnp.asarray(index, jnp.int32)
    out = dot_product_attention(q, k.astype(dtype), val.astype(dtype), key_mask=kv_valid,
                                is_causal=True, implementation=self.implementation,
                                block_size=self.block_size, query_offset=query_offset,
                                segment_ids=segment_ids)
    out = jnp.einsum("bthk,hkd->btd", out, _weight(self.wo, dtype))
    return out, (k, val)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  r""":math:`(\mathrm{silu}(x W_{gate}) \odot x W_{up}) W_{down}` over the last axis of
  ``x`` (``[..., D]``; weights ``[D, F]``, ``[D, F]``, ``[F, D]``)."""
  # einsum, not `@`: LoRA/QLoRA (jaxrl_llm.models.lora, through qwix) intercepts
  # jnp.einsum and sees each weight as the module's parameter (`@` is jitted inside).
  gate = jnp.einsum("...d,df->...f", x, w_gate)
  up = jnp.einsum("...d,df->...f", x, w_up)
  return jnp.einsum("...f,fd->...d", jax.nn.silu(gate) * up, w_down)


def _sequence_shards() -> int:
  """Size of the ambient mesh's ``sequence`` axis (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or "sequence" not in mesh.axis_names:
    return 1
  return int(dict(zip(mesh.axis_names, mesh.axis_sizes))["sequence"])


def chunked_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   chunk_size: int | None, shards: int = 1) -> jax.Array:
  r""":func:`swiglu` of ``x`` ``[B, T, D]`` over strided chunks of the sequence.

  With :math:`n = \lceil T / (\mathrm{shards} \cdot \mathrm{chunk\_size}) \rceil > 1`
  chunks, ``T`` is zero-padded to a multiple :math:`T'` of :math:`n`, viewed as
  ``[B, T'/n, n, D]`` and chunk :math:`k` (positions :math:`k, k+n, \ldots`) is
  computed by a ``lax.scan`` step under ``jax.checkpoint``: the forward keeps no
  ``[B, T, F]`` intermediate, the backward recomputes one chunk at a time. A
  ``sequence``-sharded ``T`` (contiguous blocks of ``T/shards``) stays sharded on the
  ``T'/n`` axis. Each token's result is the unchunked one (the MLP is per-token).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> ks = jax.random.split(jax.random.key(0), 4)
    >>> x = jax.random.normal(ks[0], (1, 10, 4))
    >>> wg, wu = jax.random.normal(ks[1], (4, 8)), jax.random.normal(ks[2], (4, 8))
    >>> wd = jax.random.normal(ks[3], (8, 4))
    >>> bool(jnp.allclose(chunked_swiglu(x, wg, wu, wd, 3), swiglu(x, wg, wu, wd),
    ...                   atol=1e-5))
    True
  """
  if x.ndim != 3 or chunk_size is None:
    return swiglu(x, w_gate, w_up, w_down)
  b, t, d = x.shape
  n = -(-t // (chunk_size * shards))
  if n <= 1:
    return swiglu(x, w_gate, w_up, w_down)
  per = -(-t // n)
  if per * n != t:
    x = jnp.pad(x, ((0, 0), (0, per * n - t), (0, 0)))
  xs = jnp.moveaxis(x.reshape(b, per, n, d), 2, 0)          # [n, B, T'/n, D]

  @jax.checkpoint
  def chunk(w, xc):
    return swiglu(xc, *w)

  def body(w, xc):
    return w, chunk(w, xc)

  ys = jax.lax.scan(body, (w_gate, w_up, w_down), xs)[1]  # [n, B, T'/n, D]
  return jnp.moveaxis(ys, 0, 2).reshape(b, per * n, d)[:, :t]


class MLP(nnx.Module):
  r"""SwiGLU: :math:`W_{down}(\mathrm{silu}(x W_{gate}) \odot x W_{up})`, over chunks
  of ``config.mlp_chunk_size`` positions on long sequences (:func:`chunked_swiglu`)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
    c = config
    self.chunk_size = c.mlp_chunk_size
    std_in = c.d_model ** -0.5
    std_out = c.d_ff ** -0.5 / (2 * c.n_layers) ** 0.5
    self.w_gate = _param(rngs, _normal(std_in), (c.d_model, c.d_ff), ("embed", "mlp"),
                         c.dtype)
    self.w_up = _param(rngs, _normal(std_in), (c.d_model, c.d_ff), ("embed", "mlp"),
                       c.dtype)
    self.w_down = _param(rngs, _normal(std_out), (c.d_ff, c.d_model), ("mlp", "embed"),
                         c.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    return chunked_swiglu(x, _weight(self.w_gate, dtype), _weight(self.w_up, dtype),
                          _weight(self.w_down, dtype), self.chunk_size, _sequence_shards())


class Block(nnx.Module):
  """Pre-norm transformer block: attention then SwiGLU, each with a residual."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
    c = config
    self.attn_norm = RMSNorm(c.d_model, c.norm_eps, c.dtype, rngs=rngs)
    self.attn = Attention(c, rngs=rngs)
    self.mlp_norm = RMSNorm(c.d_model, c.norm_eps, c.dtype, rngs=rngs)
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, kv_valid: jax.Array | None,
               cache_kv: KVPair | None = None, index: ArrayLike | None = None,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, KVPair]:
    attn_out, new_kv = self.attn(self.attn_norm(x), positions, kv_valid, cache_kv, index,
                                 segment_ids)
    x = x + attn_out
    x = x + self.mlp(self.mlp_norm(x))
    return x, new_kv

  def paged(self, x: jax.Array, positions: jax.Array, page_table: jax.Array, pages_kv: KVPair,
            chunk_pages: int | None = None) -> tuple[jax.Array, KVPair]:
    attn_out, new_kv = self.attn.paged(self.attn_norm(x), positions, page_table, pages_kv,
                                       chunk_pages)
    x = x + attn_out
    x = x + self.mlp(self.mlp_norm(x))
    return x, new_kv


def _block_forward(block, x, positions, kv_valid, segment_ids=None):
  return block(x, positions, kv_valid, segment_ids=segment_ids)[0]


def _remat_block_forward(policy: str | None) -> Callable:
  if policy is None:
    return nnx.remat(_block_forward)
  return nnx.remat(_block_forward, policy=REMAT_POLICIES[policy])


def _scan_blocks(blocks, x, positions, kv_valid, remat: bool, policy: str | None,
                 segment_ids=None):
  """``x`` through ``blocks`` with ``jax.lax.scan`` over their stacked parameters.

  The blocks share one graph (same config), so their states stack leaf by leaf into
  ``[n_layers, ...]`` arrays; the scan body rebuilds one block from its slice. With
  ``remat`` the body is ``jax.checkpoint``ed: the scan saves each block's input and the
  backward pass recomputes one block at a time.
  """
  graphdef, first = nnx.split(blocks[0])
  states = [first] + [nnx.split(block)[1] for block in blocks[1:]]
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

  def layer(state, h):
    return nnx.merge(graphdef, state)(h, positions, kv_valid, segment_ids=segment_ids)[0]

  if remat:
    layer = jax.checkpoint(
        layer, policy=None if policy is None else REMAT_POLICIES[policy])

  def body(h, state):
    return layer(state, h), None

  return jax.lax.scan(body, x, stacked)[0]


# ----------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------


class KVCache(NamedTuple):
  """Decoding state of :class:`Transformer` (a pytree of arrays).

  Attributes:
    k, v: tuples of ``n_layers`` arrays ``[B, S, K, head_dim]`` (rotated keys, values).
    valid: ``[B, S]`` bool, slots holding a real token (padding and unwritten slots are
      False and never attended to).
    index: ``[]`` int32, the next slot to write (shared by all rows).
    positions: ``[B]`` int32, the RoPE position of each row's next real token (= the
      number of real tokens seen so far).
  """

  k: tuple
  v: tuple
  valid: jax.Array
  index: jax.Array  # type: ignore[assignment]  # shadows tuple.index
  positions: jax.Array


# ----------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------


def _pack_order(kv_valid):
  """Per row, the stable permutation putting the real tokens first, and its inverse."""
  order = jnp.argsort(jnp.logical_not(kv_valid).astype(jnp.int32), axis=1, stable=True)
  return order, jnp.argsort(order, axis=1)


def _take_rows(x, index):
  """``x[b, index[b, t]]`` for ``x`` ``[B, T, ...]`` and ``index`` ``[B, T]``."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _positions_from_mask(mask):
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)



def _check_tokens(tokens, attention_mask, positions=None):
  v.check_rank("tokens", tokens, 2)
  if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(
        f"`tokens` must be an integer array, got dtype {jnp.result_type(tokens)} "
        f"with shape {v.shape_of(tokens)}.")
  v.check_same_shape(("tokens", "attention_mask", "positions"),
                     (tokens, attention_mask, positions))


class Transformer(nnx.Module):
  """Causal transformer LM with an optional scalar value head.

  Args:
    config: a :class:`TransformerConfig`.
    rngs: initialisation randomness.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0))
    >>> tokens = jnp.array([[0, 0, 5, 6], [1, 2, 3, 4]])   # row 0 left-padded
    >>> mask = jnp.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    >>> hidden, values = model(tokens, attention_mask=mask)
    >>> hidden.shape, values.shape, model.logits(hidden).shape
    ((2, 4, 64), (2, 4), (2, 4, 32))
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs | None = None) -> None:
    if rngs is None:
      rngs = nnx.Rngs(0)
    c = config
    self.config = c
    embed_std = c.d_model ** -0.5 if c.tie_embeddings else 1.0
    self.embed = _param(rngs, _normal(embed_std), (c.vocab_size, c.d_model),
                        ("vocab", "embed"), c.dtype)
    self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.n_layers)])
    self.final_norm = RMSNorm(c.d_model, c.norm_eps, c.dtype, rngs=rngs)
    if not c.tie_embeddings:
      self.lm_head = _param(rngs, _normal(c.d_model ** -0.5), (c.d_model, c.vocab_size),
                            ("embed", "vocab"), c.dtype)
    if c.value_head:
      self.value_w = _param(rngs, _normal(c.d_model ** -0.5), (c.d_model, 1),
                            ("embed", None), c.dtype)
      self.value_b = _param(rngs, nnx.initializers.zeros, (1,), (None,), c.dtype)

  # -- pieces ----------------------------------------------------------------------

  def _embed(self, tokens):
    return jnp.take(self.embed[...], tokens, axis=0, mode="clip").astype(self.config.dtype)

  def _values(self, hidden, mask):
    if not self.config.value_head:
      return None
    h32 = hidden.astype(jnp.float32)
    values = (h32 @ self.value_w[...].astype(jnp.float32))[..., 0]
    values = values + self.value_b[...].astype(jnp.float32)[0]
    return values * mask

  def lm_head_weight(self) -> jax.Array:
    """The LM head ``[D, V]``: ``embed.T`` when tied, else the ``lm_head`` parameter."""
    if self.config.tie_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Float32 logits ``hidden @ lm_head_weight()`` (``[..., D] -> [..., V]``)."""
    return jnp.einsum("...d,dv->...v", hidden.astype(jnp.float32),
                      self.lm_head_weight().astype(jnp.float32))

  # -- full forward ----------------------------------------------------------------

  def packs_padding(self, batch: int, length: int) -> bool:
    """Whether the full forward packs padding (``config.pack_padding``; ``None``: when
    the attention it would run without a ``key_mask`` is ``"cudnn"``)."""
    c = self.config
    if c.pack_padding is not None:
      return c.pack_padding
    if c.attention not in (None, "cudnn"):
      return False
    q = jax.ShapeDtypeStruct((batch, length, c.n_heads, c.dim_per_head), c.dtype)
    k = jax.ShapeDtypeStruct((batch, length, c.n_kv_heads, c.dim_per_head), c.dtype)
    return select_implementation(q, k) == "cudnn"

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               attention_mask: ArrayLike | None = None,
               segment_ids: ArrayLike | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Full causal forward.

    Args:
      tokens: ``[B, T]`` int token ids (out-of-range ids are clipped into range).
      positions: ``[B, T]`` int RoPE positions; default
        ``max(cumsum(attention_mask) - 1, 0)`` (or ``arange(T)`` without a mask), and
        :func:`segment_positions` with ``segment_ids``.
      attention_mask: ``[B, T]``, 1 = real token; default all ones (with
        ``segment_ids``: ``segment_ids > 0``).
      segment_ids: ``[B, T]`` int, packed rows (several sequences a row, 0 = padding;
        :mod:`jaxrl_llm.packing`): a token attends only to the earlier tokens of its
        own segment, so each sequence's outputs equal its forward alone.

    Returns:
      ``(hidden, values)``: ``hidden`` ``[B, T, D]`` (``config.dtype``) after the final
      norm and ``values`` ``[B, T]`` float32 (``None`` without a value head); both are 0
      at padded positions.
    """
    _check_tokens(tokens, attention_mask, positions)
    v.check_same_shape(("tokens", "segment_ids"), (tokens, segment_ids))
    b, t = tokens.shape
    if attention_mask is None:
      mask = (jnp.ones((b, t), jnp.float32) if segment_ids is None
              else v.as_f32(jnp.asarray(segment_ids) > 0))
    else:
      mask = v.as_f32(attention_mask)
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    if positions is None:
      positions = _positions_from_mask(mask) if seg is None else segment_positions(seg)
    kv_valid: jax.Array | None = mask > 0
    c = self.config
    x = self._embed(tokens)
    packed = seg is None and attention_mask is not None and self.packs_padding(b, t)
    if packed:   # real tokens first: the padding trails, hidden by causality alone
      order, inverse = _pack_order(kv_valid)
      x, positions, kv_valid = _take_rows(x, order), _take_rows(positions, order), None
    if c.scan_layers and len(self.blocks) > 1:
      x = _scan_blocks(list(self.blocks), x, positions, kv_valid, c.remat, c.remat_policy,
                       seg)
    else:
      block_fn = _remat_block_forward(c.remat_policy) if c.remat else _block_forward
      for block in self.blocks:
        x = block_fn(block, x, positions, kv_valid, seg)
    if packed:
      x = _take_rows(x, inverse)
    hidden = self.final_norm(x) * mask[..., None].astype(x.dtype)
    return hidden, self._values(hidden, mask)

  # -- cached decoding -------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int | None = None,
                 dtype: DTypeLike | None = None) -> KVCache:
    """An empty :class:`KVCache` for ``batch`` rows and ``max_len`` slots.

    ``max_len`` defaults to ``config.max_seq_len``; it must cover prompt + generated
    tokens (a write past the end is clamped by XLA and corrupts the last slots).
    """
    c = self.config
    max_len = c.max_seq_len if max_len is None else max_len
    dtype = c.dtype if dtype is None else dtype
    shape = (batch, max_len, c.n_kv_heads, c.dim_per_head)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(c.n_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(c.n_layers)),
                   valid=jnp.zeros((batch, max_len), bool),
                   index=jnp.zeros((), jnp.int32),
                   positions=jnp.zeros((batch,), jnp.int32))

  def extend(self, tokens: jax.Array, cache: KVCache, attention_mask: ArrayLike | None = None
             ) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Appends ``tokens`` ``[B, T]`` at slot ``cache.index`` and runs them.

    New real tokens get positions ``cache.positions + (cumsum(mask) - 1)``; they attend
    to every valid cache slot and to the earlier real tokens among themselves. Both
    prefill (T = prompt length, empty cache) and decode (T = 1) are this call, so the
    result at each real token equals the full forward of the concatenated sequence.

    Returns:
      ``(hidden [B, T, D], values [B, T] or None, new_cache)``.
    """
    _check_tokens(tokens, attention_mask)
    b, t = tokens.shape
    if v.shape_of(cache.valid)[0] != b:
      raise ValueError(
          f"`cache` has batch {v.shape_of(cache.valid)[0]}, `tokens` has shape "
          f"{v.shape_of(tokens)}.")
    if attention_mask is None:
      mask = jnp.ones((b, t), jnp.float32)
    else:
      mask = v.as_f32(attention_mask)
    positions = cache.positions[:, None] + _positions_from_mask(mask)
    valid = jax.lax.dynamic_update_slice(cache.valid, mask > 0, (0, cache.index))
    x = self._embed(tokens)
    new_k, new_v = [], []
    for layer, block in enumerate(self.blocks):
      x, (k, val) = block(x, positions, valid, (cache.k[layer], cache.v[layer]),
                          cache.index)
      new_k.append(k)
      new_v.append(val)
    hidden = self.final_norm(x) * mask[..., None].astype(x.dtype)
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid,
                        index=cache.index + t,
                        positions=cache.positions + jnp.sum(mask, axis=1).astype(jnp.int32))
    return hidden, self._values(hidden, mask), new_cache

  def prefill(self, tokens: jax.Array, attention_mask: ArrayLike | None,
              cache: KVCache) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Runs a prompt ``[B, P]`` (any padding layout) into an empty ``cache``.

    Returns ``(hidden [B, P, D], values [B, P] or None, cache)``.
    """
    return self.extend(tokens, cache, attention_mask)

  def decode(self, tokens: jax.Array,
             cache: KVCache) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """One new real token per row, ``tokens`` ``[B]``.

    Returns ``(hidden [B, D], values [B] or None, cache)``.
    """
    v.check_rank("tokens", tokens, 1)
    hidden, values, cache = self.extend(tokens[:, None], cache)
    return hidden[:, 0], (None if values is None else values[:, 0]), cache

  # -- paged decoding (the rollout engine) -----------------------------------------

  def init_pages(self, num_pages: int, page_size: int, dtype: DTypeLike | None = None) -> tuple:
    """An all-zero paged KV pool: ``n_layers`` pairs ``(k, v)`` of
    ``[num_pages, page_size, K, head_dim]`` arrays (``config.dtype`` by default)."""
    c = self.config
    for name, value in (("num_pages", num_pages), ("page_size", page_size)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    dtype = c.dtype if dtype is None else dtype
    shape = (num_pages, page_size, c.n_kv_heads, c.dim_per_head)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(c.n_layers))

  def paged_forward(self, tokens: jax.Array, positions: jax.Array, page_table: jax.Array,
                    pages: tuple,
                    chunk_pages: int | None = None) -> tuple[jax.Array, jax.Array | None, tuple]:
    """Runs ``tokens`` ``[B, T]`` at ``positions`` ``[B, T]`` against a paged KV pool.

    Each real token (``positions >= 0``) writes its keys/values into its row's pages
    (``page_table`` ``[B, M]``, position ``p`` at page ``page_table[b, p // P]``, slot
    ``p % P``) and attends to the row's positions ``<= p`` (earlier calls' tokens and
    this call's). A prompt chunk (T > 1) and a decode step (T = 1) are the same call,
    and a row's result equals the full forward of its sequence. Padding
    (``positions < 0``) writes nothing; its hidden state is 0.

    Returns:
      ``(hidden [B, T, D], values [B, T] or None, new_pages)``.
    """
    _check_tokens(tokens, None, positions)
    v.check_rank("page_table", page_table, 2)
    if len(pages) != len(self.blocks):
      raise ValueError(f"`pages` must hold one (k, v) pair per layer ({len(self.blocks)}), "
                       f"got {len(pages)}.")
    positions = positions.astype(jnp.int32)
    mask = (positions >= 0).astype(jnp.float32)
    x = self._embed(tokens)
    new_pages = []
    for block, kv in zip(self.blocks, pages):
      x, kv = block.paged(x, positions, page_table, kv, chunk_pages)
      new_pages.append(kv)
    hidden = self.final_norm(x) * mask[..., None].astype(x.dtype)
    return hidden, self._values(hidden, mask), tuple(new_pages)


# ----------------------------------------------------------------------------------
# Pure functional adapters
# ----------------------------------------------------------------------------------


def abstract_model(config: TransformerConfig) -> Transformer:
  """The model of ``config`` as shapes only (``nnx.eval_shape``: nothing allocated), for
  its graphdef or its parameters' shapes and shardings.

  Examples:
    >>> graphdef, shapes = split_model(abstract_model(TransformerConfig.tiny(32)))
    >>> shapes["embed"].shape
    (32, 64)
  """
  return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def split_model(model: Transformer) -> tuple[nnx.GraphDef, nnx.State]:
  """``(graphdef, params)``: the static structure and the ``nnx.Param`` state pytree.

  ``params`` is an ``nnx.State`` (a pytree of arrays) to hand to optax, ``jax.grad``,
  ``jax.jit`` shardings or orbax; ``nnx.merge(graphdef, params)`` rebuilds the model.
  """
  return nnx.split(model, nnx.Param)


def make_apply_fn(graphdef: nnx.GraphDef) -> Callable:
  """A pure forward ``apply(params, tokens, positions=None, attention_mask=None,
  segment_ids=None)`` (``segment_ids``: packed rows, see :class:`Transformer`).

  The returned function rebuilds the model from ``params`` (``nnx.merge``) and returns
  ``(hidden [B, T, D], values [B, T] or None, lm_head [D, V])``; it is a pure function
  of ``params`` and so works under ``jax.jit``, ``jax.grad`` and shardings. Log-probs
  of targets are ``log_softmax(hidden @ lm_head)`` gathered at the targets (the
  hidden state at index t predicts the token at t + 1).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> graphdef, params = split_model(
    ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> apply = jax.jit(make_apply_fn(graphdef))
    >>> hidden, values, lm_head = apply(params, jnp.ones((2, 8), jnp.int32))
    >>> hidden.shape, values.shape, lm_head.shape
    ((2, 8, 64), (2, 8), (64, 32))
  """

  def apply(params, tokens, positions=None, attention_mask=None, segment_ids=None):
    model = nnx.merge(graphdef, params)
    hidden, values = model(tokens, positions, attention_mask, segment_ids)
    return hidden, values, model.lm_head_weight()

  return apply


def _last_real_index(mask):
  """Index of the last 1 in each row of ``mask`` ``[B, T]`` (0 for an empty row)."""
  t = mask.shape[1]
  return jnp.max(jnp.where(mask > 0, jnp.arange(t)[None, :], 0), axis=1)


def make_decode_fns(graphdef: nnx.GraphDef) -> DecodeFns:
  """:class:`DecodeFns` of the reference :class:`Transformer` (pure in ``params``).

  ``prefill`` takes the logits at each row's last real prompt token, so left-padded,
  right-padded or holed prompts all work; a row with an empty prompt gets zero hidden
  state there, i.e. all-zero logits (a uniform first token). Create the functions once
  and reuse them: they are hashed by identity when passed as a static jit argument.
  """

  def init_cache(params, batch, max_len):
    return nnx.merge(graphdef, params).init_cache(batch, max_len)

  def prefill(params, tokens, mask, cache):
    model = nnx.merge(graphdef, params)
    hidden, _, cache = model.prefill(tokens, mask, cache)
    last = jnp.take_along_axis(hidden, _last_real_index(mask)[:, None, None], axis=1)
    return model.logits(last[:, 0]), cache

  def decode(params, tokens, cache):
    model = nnx.merge(graphdef, params)
    hidden, _, cache = model.decode(tokens, cache)
    return model.logits(hidden), cache

  return DecodeFns(init_cache=init_cache, prefill=prefill, decode=decode)


def make_paged_decode_fns(graphdef: nnx.GraphDef, *,
                          chunk_pages: int | None = None) -> PagedDecodeFns:
  """:class:`~jaxrl_llm.models.protocol.PagedDecodeFns` of the reference
  :class:`Transformer` (and so of every Hugging Face model loaded into it).

  ``forward`` returns the float32 logits after each row's last real token (the largest
  position; all-zero hidden state, i.e. zero logits, for a row of padding only).
  ``chunk_pages``: pages per online-softmax chunk of
  :func:`~jaxrl_llm.attention.paged_attention` (default 128 keys). Create the
  functions once and reuse them (they are hashed by identity as static arguments).

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> graphdef, params = split_model(
    ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> fns = make_paged_decode_fns(graphdef)
    >>> pages = fns.init_pages(params, 4, 8)        # 4 pages of 8 tokens per layer
    >>> table = jnp.array([[2, 0]])                 # positions 0-7 on page 2, 8-15 on 0
    >>> logits, pages = fns.forward(params, jnp.array([[5, 6, 7]]),
    ...                             jnp.array([[0, 1, 2]]), table, pages)
    >>> logits.shape, float(jnp.abs(pages[0][0][2, :3]).sum()) > 0
    ((1, 32), True)
  """

  def init_pages(params, num_pages, page_size):
    return nnx.merge(graphdef, params).init_pages(num_pages, page_size)

  def forward(params, tokens, positions, page_table, pages):
    model = nnx.merge(graphdef, params)
    hidden, _, pages = model.paged_forward(tokens, positions, page_table, pages,
                                           chunk_pages)
    last = jnp.argmax(positions, axis=1)
    hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return model.logits(hidden), pages

  return PagedDecodeFns(init_pages=init_pages, forward=forward)
