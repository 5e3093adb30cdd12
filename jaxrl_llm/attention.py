r"""Memory-efficient dot-product attention as a pure function.

One entry point, :func:`dot_product_attention`, with the shapes of
``jax.nn.dot_product_attention``: ``query`` ``[B, T, N, H]``, ``key``/``value``
``[B, S, K, H]`` with ``N % K == 0`` (grouped-query attention: query head ``n`` uses
key/value head ``n // (N // K)``). For query ``i`` and head ``n``,

.. math::

  o_i = \sum_{j \in A(i)} \frac{e^{s_{ij}}}{\sum_{j' \in A(i)} e^{s_{ij'}}}\, v_j,
  \qquad s_{ij} = \frac{q_i \cdot k_j}{\sqrt{H}},

where the allowed set :math:`A(i)` holds the keys with ``key_mask[b, j]`` true and, with
``is_causal``, ``j <= i + query_offset``. ``query_offset`` defaults to ``S - T``: the
queries are aligned to the *end* of the keys (the flash-attention convention), so a
full forward (``T == S``), a prefill continuation (``T < S``) and a decode step
(``T == 1``) are the same call. A query with an empty :math:`A(i)` returns 0, never NaN.

Implementations (``implementation=``):

* ``"xla"``: the plain softmax over ``[B, N, T, S]`` scores; the reference, and the
  fastest for small ``T * S``.
* ``"blockwise"``: pure JAX online softmax (Milakov & Gimelshein 2018; FlashAttention,
  Dao et al. 2022, 2023) over query blocks and key blocks, in a ``jax.custom_vjp`` whose
  backward pass recomputes the scores block by block (FlashAttention-2's backward), so
  neither pass holds more than ``[B, N, block_q, block_k]`` scores: memory is linear in
  ``T`` and ``S``. Causal key blocks that no query of a block can see are skipped, and
  so, in self-attention over packed rows (``segment_ids`` alone), are the key blocks
  outside the segments of a query block (a packed row pays for its segments' own
  blocks, not for ``T^2/2``).
  Works for any ``T`` and ``S`` (inputs are padded up to the block sizes inside).
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on GPU, only
  where its masks mean the same thing: no ``key_mask``, no explicit ``query_offset``,
  and ``T == S`` when causal (cuDNN's causal mask is aligned to the *start*), bf16/fp16
  inputs, ``H`` a multiple of 8 up to 128. Anything else raises ``ValueError``.
* Registered names (:func:`register_attention`), e.g. ``"ring"`` from
  :mod:`jaxrl_llm.parallel` (context parallelism over a ``sequence`` mesh axis).

``implementation=None`` picks one with :func:`select_implementation`.

All math is float32 inside whatever the input dtype; :func:`dot_product_attention`
returns the query's dtype, :func:`attention_with_lse` returns float32 outputs and the
log-sum-exp of the scores (the partial result that context parallelism merges).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v

# Finite "minus infinity" for masked scores.
_NEG = -1e30
#: The log-sum-exp reported for a query with no visible key. Finite, so merging partial
#: results with the online-softmax rule (``m = max(l1, l2)``, weights ``exp(l - m)``)
#: never produces ``inf - inf``: two empty parts merge to output 0 and an empty part
#: merged with a real one gets weight ``exp(-1e30 - l) = 0``.
NO_KEY_LSE = -1e30

#: ``implementation=None`` uses ``"xla"`` while ``T * S`` is at most this (e.g. decode
#: steps and short sequences), ``"blockwise"`` above it. On CPU the causal blockwise
#: forward + backward was already ~4x faster than ``"xla"`` at T = S = 512 (it skips the
#: masked half of the scores and stays in cache; ``benchmarks/attention.py``).
XLA_MAX_SCORES = 256 * 256

#: Default query/key block size of ``"blockwise"`` per backend: 128 was fastest on CPU
#: at T = 1024 and 2048 (``benchmarks/attention.py``); accelerators get larger blocks,
#: which keep their matrix units busy (tune with ``block_size=``).
DEFAULT_BLOCK_SIZE = {"cpu": 128, "gpu": 512, "tpu": 512}

# ----------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------


def _check_segments(segment_ids, key_segment_ids, b, t, s):
  """Checks the segment ids; returns ``(query ids [B, T], key ids [B, S])`` or Nones."""
  if segment_ids is None and key_segment_ids is None:
    return None, None
  if segment_ids is None:
    raise ValueError("`key_segment_ids` needs `segment_ids` (the queries' segments).")
  self_attention = key_segment_ids is None
  if self_attention:
    if t != s:
      raise ValueError(
          f"`segment_ids` alone describes self-attention (T == S); with T={t} != S={s} "
          f"pass `key_segment_ids` [B, S] too.")
    key_segment_ids = segment_ids
  for name, x, shape in (("segment_ids", segment_ids, (b, t)),
                         ("key_segment_ids", key_segment_ids, (b, s))):
    if v.shape_of(x) != shape:
      raise ValueError(f"`{name}` must have shape [B, {'T' if shape[1] == t else 'S'}] = "
                       f"{shape}, got {v.shape_of(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"`{name}` must be an integer array, got dtype "
                       f"{jnp.result_type(x)}.")
  seg = jnp.asarray(segment_ids, jnp.int32)
  # Self-attention returns one array twice: "blockwise" then skips other segments' blocks.
  return seg, seg if self_attention else jnp.asarray(key_segment_ids, jnp.int32)


def _check_inputs(query, key, value, key_mask, query_offset):
  """Trace-time shape checks; returns ``(B, T, N, H, S, K)``."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    v.check_rank(name, x, 4)
    v.check_float(name, x)
  b, t, n, h = v.shape_of(query)
  bk, s, k, hk = v.shape_of(key)
  if (bk, hk) != (b, h):
    raise ValueError(
        f"`key` must have shape [B, S, K, H] with the batch B and head dim H of `query` "
        f"{v.shape_of(query)}, got {v.shape_of(key)}.")
  if v.shape_of(value) != v.shape_of(key):
    raise ValueError(
        f"`value` must have the shape of `key` {v.shape_of(key)}, got "
        f"{v.shape_of(value)}.")
  if n % k:
    raise ValueError(
        f"The number of query heads N must be a multiple of the key/value heads K: "
        f"`query` has shape {v.shape_of(query)} (N={n}), `key` has shape "
        f"{v.shape_of(key)} (K={k}).")
  if key_mask is not None and v.shape_of(key_mask) != (b, s):
    raise ValueError(
        f"`key_mask` must have shape [B, S] = {(b, s)} (from `key` {v.shape_of(key)}), "
        f"got {v.shape_of(key_mask)}.")
  if query_offset is not None:
    if jnp.ndim(query_offset) != 0:
      raise ValueError(
          f"`query_offset` must be a scalar, got shape {v.shape_of(query_offset)}.")
    if not jnp.issubdtype(jnp.result_type(query_offset), jnp.integer):
      raise ValueError(
          f"`query_offset` must be an integer, got dtype {jnp.result_type(query_offset)}.")
  return b, t, n, h, s, k


def _block_sizes(block_size, t, s):
  """``(block_q, block_k)``: at most the requested size, balanced, multiples of 8."""
  if block_size is None:
    block_size = DEFAULT_BLOCK_SIZE.get(jax.default_backend(), 512)
  if isinstance(block_size, int):
    block_size = (block_size, block_size)
  bq, bk = block_size
  if not (isinstance(bq, int) and isinstance(bk, int) and bq > 0 and bk > 0):
    raise ValueError(f"`block_size` must be a positive int or a pair of them, got "
                     f"{block_size!r}.")

  def balanced(size, length):
    if length <= size:
      return length
    blocks = -(-length // size)
    per = -(-length // blocks)
    return min(size, -(-per // 8) * 8)

  return balanced(bq, t), balanced(bk, s)


# ----------------------------------------------------------------------------------
# "xla": the plain softmax
# ----------------------------------------------------------------------------------


def _allowed(t, s, key_mask, is_causal, offset, segments=None):
  """``[B or 1, T, S]`` bool: key ``j`` visible to query ``i``."""
  allowed = jnp.ones((1, t, s), bool)
  if key_mask is not None:
    allowed = allowed & (key_mask != 0)[:, None, :]
  if segments is not None:
    qs, ks = segments
    allowed = allowed & (qs[:, :, None] == ks[:, None, :]) & (ks != 0)[:, None, :]
  if is_causal:
    causal = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + offset
    allowed = allowed & causal[None]
  return allowed


def _xla_with_lse(query, key, value, key_mask, is_causal, offset, segments=None):
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  qg = query.astype(jnp.float32).reshape(b, t, k, n // k, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, key.astype(jnp.float32))
  scores = scores * (1.0 / math.sqrt(h))
  allowed = _allowed(t, s, key_mask, is_causal, offset, segments)[:, None, None]
  scores = jnp.where(allowed, scores, _NEG)
  m = jnp.max(scores, axis=-1, keepdims=True)
  p = jnp.where(allowed, jnp.exp(scores - lax.stop_gradient(m)), 0.0)
  l = jnp.sum(p, axis=-1)  # [B,K,G,T]
  visible = l > 0
  safe_l = jnp.where(visible, l, 1.0)
  out = jnp.einsum("bkgts,bskh->btkgh", p / safe_l[..., None], value.astype(jnp.float32))
  lse = jnp.where(visible, jnp.log(safe_l) + lax.stop_gradient(m[..., 0]), NO_KEY_LSE)
  out = out.reshape(b, t, n, h)
  lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, n)
  return out, lse


# ----------------------------------------------------------------------------------
# "blockwise": online softmax with a recomputing custom_vjp
# ----------------------------------------------------------------------------------
#
# Internal layout: q [B, K, G, Tp, H] (pre-scaled by 1/sqrt(H)), k/v [B, K, Sp, H],
# valid [B, Sp] bool, all float32, Tp/Sp padded to multiples of the block sizes.


def _online_softmax_block(carry, scores, allowed, values, pv_spec: str):
  r"""Folds one block of keys into the running softmax ``(m, l, acc)``.

  With :math:`m' = \max(m, \max_j s_j)` over the allowed scores :math:`s`:
  :math:`l' = l e^{m - m'} + \sum_j e^{s_j - m'}` and
  :math:`acc' = acc\, e^{m - m'} + \sum_j e^{s_j - m'} v_j` (``pv_spec`` is the
  einsum of probabilities and ``values``); disallowed keys add exactly 0.
  """
  m, l, acc = carry
  scores = jnp.where(allowed, scores, _NEG)
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
  p = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0.0)
  alpha = jnp.exp(m - m_new)
  return (m_new, l * alpha + jnp.sum(p, axis=-1),
          acc * alpha[..., None] + jnp.einsum(pv_spec, p, values))


def _block_allowed(valid_j, q_start, k_start, bq, bk, is_causal, offset, seg_i=None,
                   seg_j=None):
  """``[B, 1, 1, bq, bk]`` visibility of one (query block, key block) pair; ``seg_i``
  ``[B, bq]`` / ``seg_j`` ``[B, bk]``: segment ids (a query sees its own segment)."""
  allowed = valid_j[:, None, None, None, :]
  if seg_i is not None:
    allowed = allowed & (seg_i[:, :, None] == seg_j[:, None, :])[:, None, None]
  if is_causal:
    qi = q_start + jnp.arange(bq)
    kj = k_start + jnp.arange(bk)
    allowed = allowed & (kj[None, :] <= qi[:, None] + offset)[None, None, None]
  return allowed


def _causal_key_blocks_end(i, bq, bk, nk, offset):
  """Number of key blocks query block ``i`` can see (key blocks ``[0, end)``)."""
  last_visible = i * bq + bq - 1 + offset
  return jnp.clip(jnp.floor_divide(last_visible, bk) + 1, 0, nk)


def _causal_query_blocks_start(j, bq, bk, nq, offset):
  """First query block that can see key block ``j``."""
  return jnp.clip(jnp.floor_divide(j * bk - offset, bq), 0, nq)


def _segment_runs(seg):
  """``(first, last)`` ``[B, T]``: the first and last index of the contiguous run of
  equal ids that holds each position (segments are contiguous runs)."""
  t = seg.shape[1]
  idx = jnp.arange(t, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
  ends = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones_like(seg[:, :1], bool)], 1)
  first = lax.cummax(jnp.where(starts, idx, 0), axis=1)
  last = lax.cummin(jnp.where(ends, idx, t - 1), axis=1, reverse=True)
  return first, last


def _segment_block_bounds(seg, bq, bk, tp, sp):
  """Self-attention over packed rows (``seg`` ``[B, T]`` for queries and keys alike):
  the blocks each block can meet, since a position sees only its own run.

  Returns ``(q_lo, q_hi, k_lo, k_hi)``: query block ``i`` needs key blocks
  ``[q_lo[i], q_hi[i])``, key block ``j`` is seen by query blocks ``[k_lo[j], k_hi[j])``
  (empty where a block holds no position; minimum / maximum over the batch).

  >>> seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3]])      # query blocks of 4, key blocks of 2
  >>> [b.tolist() for b in _segment_block_bounds(seg, 4, 2, 8, 8)]
  [[0, 1], [4, 4], [0, 0, 0, 0], [1, 2, 2, 2]]
  """
  b, t = seg.shape
  first, last = _segment_runs(seg)

  def reduce(x, size, padded, fill, op):
    x = jnp.pad(x, ((0, 0), (0, padded - t)), constant_values=fill)
    return op(x.reshape(b, padded // size, size), axis=(0, 2))

  q_lo = reduce(first, bq, tp, t, jnp.min) // bk
  q_hi = reduce(last, bq, tp, -1, jnp.max) // bk + 1
  k_lo = reduce(first, bk, sp, t, jnp.min) // bq
  k_hi = reduce(last, bk, sp, -1, jnp.max) // bq + 1
  return q_lo, q_hi, k_lo, k_hi


def _seg_slice(seg, start, size):
  return None if seg is None else lax.dynamic_slice_in_dim(seg, start, size, axis=1)


def _flash_forward(q, k, v_, valid, offset, qseg, kseg, bounds, is_causal, bq, bk):
  b, kh, g, tp, h = q.shape
  sp = k.shape[2]
  nq, nk = tp // bq, sp // bk

  def query_block(i):
    qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
    seg_i = _seg_slice(qseg, i * bq, bq)

    def body(j, carry):
      kj = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
      vj = lax.dynamic_slice_in_dim(v_, j * bk, bk, axis=2)
      valid_j = lax.dynamic_slice_in_dim(valid, j * bk, bk, axis=1)
      allowed = _block_allowed(valid_j, i * bq, j * bk, bq, bk, is_causal, offset, seg_i,
                               _seg_slice(kseg, j * bk, bk))
      s = jnp.einsum("bkgqh,bksh->bkgqs", qi, kj)
      return _online_softmax_block(carry, s, allowed, vj, "bkgqs,bksh->bkgqh")

    init = (jnp.full((b, kh, g, bq), _NEG, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, h), jnp.float32))
    start, end = 0, _causal_key_blocks_end(i, bq, bk, nk, offset) if is_causal else nk
    if bounds is not None:         # packed rows: only the key blocks of its segments
      start, end = bounds[0][i], jnp.minimum(end, bounds[1][i])
    m, l, acc = lax.fori_loop(start, jnp.maximum(start, end), body, init)
    visible = l > 0
    safe_l = jnp.where(visible, l, 1.0)
    out = acc / safe_l[..., None]
    lse = jnp.where(visible, m + jnp.log(safe_l), NO_KEY_LSE)
    return out, lse

  out, lse = lax.map(query_block, jnp.arange(nq))  # [nq, B,K,G,bq,(H)]
  out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, tp, h)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tp)
  return out, lse


def _flash_backward(q, k, v_, valid, offset, qseg, kseg, bounds, out, lse, dout, dlse,
                    is_causal, bq, bk):
  b, kh, _, tp, h = q.shape
  sp = k.shape[2]
  nq, nk = tp // bq, sp // bk
  # D_i = rowsum(dO_i * O_i) - dlse_i  (the lse cotangent adds dlse_i * p_ij to ds_ij).
  delta = jnp.sum(dout * out, axis=-1) - dlse

  def key_block(dq, j):
    kj = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    vj = lax.dynamic_slice_in_dim(v_, j * bk, bk, axis=2)
    valid_j = lax.dynamic_slice_in_dim(valid, j * bk, bk, axis=1)
    seg_j = _seg_slice(kseg, j * bk, bk)

    def body(i, carry):
      dk, dv, dq = carry
      qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
      doi = lax.dynamic_slice_in_dim(dout, i * bq, bq, axis=3)
      lsei = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
      di = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
      allowed = _block_allowed(valid_j, i * bq, j * bk, bq, bk, is_causal, offset,
                               _seg_slice(qseg, i * bq, bq), seg_j)
      s = jnp.einsum("bkgqh,bksh->bkgqs", qi, kj)
      p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, 0.0) - lsei[..., None]), 0.0)
      dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p, doi)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", doi, vj)
      ds = p * (dp - di[..., None])
      dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, qi)
      dqi = jnp.einsum("bkgqs,bksh->bkgqh", ds, kj)
      dq = lax.dynamic_update_slice_in_dim(
          dq, lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=3) + dqi, i * bq, axis=3)
      return dk, dv, dq

    init = (jnp.zeros((b, kh, bk, h), jnp.float32), jnp.zeros((b, kh, bk, h), jnp.float32),
            dq)
    start, end = _causal_query_blocks_start(j, bq, bk, nq, offset) if is_causal else 0, nq
    if bounds is not None:         # packed rows: only the query blocks of its segments
      start, end = jnp.maximum(start, bounds[2][j]), bounds[3][j]
    dk, dv, dq = lax.fori_loop(start, jnp.maximum(start, end), body, init)
    return dq, (dk, dv)

  dq, (dk, dv) = lax.scan(key_block, jnp.zeros_like(q), jnp.arange(nk))
  dk = jnp.moveaxis(dk, 0, 2).reshape(b, kh, sp, h)
  dv = jnp.moveaxis(dv, 0, 2).reshape(b, kh, sp, h)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash(q, k, v_, valid, offset, qseg, kseg, bounds, is_causal, bq, bk):
  return _flash_forward(q, k, v_, valid, offset, qseg, kseg, bounds, is_causal, bq, bk)


def _flash_fwd(q, k, v_, valid, offset, qseg, kseg, bounds, is_causal, bq, bk):
  out, lse = _flash_forward(q, k, v_, valid, offset, qseg, kseg, bounds, is_causal, bq, bk)
  return (out, lse), (q, k, v_, valid, offset, qseg, kseg, bounds, out, lse)


def _flash_bwd(is_causal, bq, bk, residuals, cotangents):
  q, k, v_, valid, offset, qseg, kseg, bounds, out, lse = residuals
  dout, dlse = cotangents
  dq, dk, dv = _flash_backward(q, k, v_, valid, offset, qseg, kseg, bounds, out, lse, dout,
                               dlse, is_causal, bq, bk)
  return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _blockwise_with_lse(query, key, value, key_mask, is_causal, offset, block_size,
                        segments=None):
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  g = n // k
  bq, bk = _block_sizes(block_size, t, s)
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  scale = 1.0 / math.sqrt(h)
  # [B, T, N, H] -> [B, K, G, Tp, H], pre-scaled; [B, S, K, H] -> [B, K, Sp, H].
  q = (query.astype(jnp.float32) * scale).reshape(b, t, k, g, h)
  q = jnp.pad(jnp.transpose(q, (0, 2, 3, 1, 4)), ((0, 0),) * 3 + ((0, tp - t), (0, 0)))
  kt = jnp.pad(jnp.transpose(key.astype(jnp.float32), (0, 2, 1, 3)),
               ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  vt = jnp.pad(jnp.transpose(value.astype(jnp.float32), (0, 2, 1, 3)),
               ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  valid = jnp.ones((b, s), bool) if key_mask is None else key_mask != 0
  valid = jnp.pad(valid, ((0, 0), (0, sp - s)))
  qseg = kseg = bounds = None
  if segments is not None:   # padded queries/keys get segment 0 (keys invalid anyway)
    qseg = jnp.pad(segments[0], ((0, 0), (0, tp - t)))
    kseg = jnp.pad(segments[1], ((0, 0), (0, sp - s)))
    valid = valid & (kseg != 0)
    if segments[0] is segments[1] and isinstance(offset, int) and offset == 0:
      bounds = _segment_block_bounds(segments[0], bq, bk, tp, sp)   # self-attention
  offset = jnp.asarray(offset, jnp.int32)
  out, lse = _flash(q, kt, vt, valid, offset, qseg, kseg, bounds, is_causal, bq, bk)
  out = jnp.transpose(out[:, :, :, :t], (0, 3, 1, 2, 4)).reshape(b, t, n, h)
  lse = jnp.transpose(lse[:, :, :, :t], (0, 3, 1, 2)).reshape(b, t, n)
  return out, lse


# ----------------------------------------------------------------------------------
# Implementations and their registry
# ----------------------------------------------------------------------------------


def _xla(query, key, value, *, key_mask=None, is_causal=True, query_offset=None,
         block_size=None, segment_ids=None, key_segment_ids=None):
  del block_size
  offset = _offset(query, key, query_offset)
  segments = _pair(segment_ids, key_segment_ids)
  return _xla_with_lse(query, key, value, key_mask, is_causal, offset, segments)[0]


def _blockwise(query, key, value, *, key_mask=None, is_causal=True, query_offset=None,
               block_size=None, segment_ids=None, key_segment_ids=None):
  offset = _offset(query, key, query_offset)
  segments = _pair(segment_ids, key_segment_ids)
  return _blockwise_with_lse(query, key, value, key_mask, is_causal, offset,
                             block_size, segments)[0]


def _pair(segment_ids, key_segment_ids):
  if segment_ids is None:
    return None
  return (segment_ids, segment_ids if key_segment_ids is None else key_segment_ids)


def _cudnn_unfit_reason(query, key, key_mask, is_causal, query_offset,
                        segment_ids=None) -> str | None:
  """Why ``"cudnn"`` cannot compute this call exactly, or ``None`` if it can."""
  t, h = query.shape[1], query.shape[3]
  s = key.shape[1]
  if jax.default_backend() != "gpu":
    return f"it needs a GPU backend (this is {jax.default_backend()!r})"
  if segment_ids is not None:
    return ("`jax.nn.dot_product_attention` takes no segment ids (only per-row lengths), "
            "so packed rows cannot be described to cuDNN")
  if key_mask is not None:
    return ("cuDNN takes padding as lengths (right padding only) while `key_mask` "
            "allows padding anywhere")
  if query_offset is not None:
    return "cuDNN has no explicit causal offset (`query_offset`)"
  if is_causal and t != s:
    return (f"cuDNN's causal mask is aligned to the start of the keys, which differs "
            f"from the end-aligned rule when T != S (T={t}, S={s})")
  if query.dtype not in (jnp.bfloat16, jnp.float16) or key.dtype != query.dtype:
    return f"cuDNN needs bf16/fp16 inputs of one dtype (got {query.dtype}, {key.dtype})"
  if h % 8 or h > 128:
    return f"cuDNN needs a head dim that is a multiple of 8 up to 128 (got H={h})"
  return None


def _cudnn(query, key, value, *, key_mask=None, is_causal=True, query_offset=None,
           block_size=None, segment_ids=None, key_segment_ids=None):
  del block_size, key_segment_ids
  reason = _cudnn_unfit_reason(query, key, key_mask, is_causal, query_offset, segment_ids)
  if reason is not None:
    raise ValueError(
        f"implementation='cudnn' cannot compute this call: {reason}; `query` "
        f"{v.shape_of(query)}, `key` {v.shape_of(key)}. Use 'blockwise' or 'xla'.")
  return jax.nn.dot_product_attention(query, key, value, is_causal=is_causal,
                                      implementation="cudnn")


#: Name -> function with the signature
#: ``fn(query, key, value, *, key_mask, is_causal, query_offset, block_size)``
#: returning ``[B, T, N, H]`` in the query's dtype. Inputs arrive validated.
ATTENTION_IMPLEMENTATIONS: dict[str, Callable] = {
    "xla": _xla,
    "blockwise": _blockwise,
    "cudnn": _cudnn,
}


def register_attention(name: str, fn: Callable) -> None:
  """Registers ``fn`` as ``implementation=name`` of :func:`dot_product_attention`.

  ``fn`` is called as ``fn(query, key, value, *, key_mask, is_causal, query_offset,
  block_size)`` (plus ``segment_ids=, key_segment_ids=`` for packed rows only) with
  validated inputs (``query_offset`` is ``None`` for the default
  end-aligned rule) and must return ``[B, T, N, H]`` in the query's dtype. Registering
  ``"ring"`` makes ``implementation=None`` use it under a mesh with a ``sequence`` axis
  of size > 1 (see :func:`select_implementation`).
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
  if not callable(fn):
    raise TypeError(f"`fn` must be callable, got {fn!r}.")
  ATTENTION_IMPLEMENTATIONS[name] = fn


def _sequence_axis_size() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or "sequence" not in mesh.axis_names:
    return 1
  return int(mesh.shape["sequence"])


def select_implementation(query: jax.Array | jax.ShapeDtypeStruct,
                          key: jax.Array | jax.ShapeDtypeStruct, *,
                          key_mask: ArrayLike | None = None, is_causal: bool = True,
                          query_offset: ArrayLike | None = None,
                          segment_ids: ArrayLike | None = None) -> str:
  """The implementation ``implementation=None`` uses for these inputs.

  In order: ``"ring"`` if registered, ``query_offset`` is ``None`` and the ambient mesh
  (``jax.set_mesh``) has a ``sequence`` axis of size > 1; ``"cudnn"`` on GPU when its
  masks fit (see the module docstring); ``"xla"`` while ``T * S <= XLA_MAX_SCORES``;
  else ``"blockwise"``. Only shapes, dtypes and the ambient mesh matter, so the choice
  is made at trace time.
  """
  if ("ring" in ATTENTION_IMPLEMENTATIONS and query_offset is None
      and _sequence_axis_size() > 1):
    return "ring"
  if _cudnn_unfit_reason(query, key, key_mask, is_causal, query_offset,
                         segment_ids) is None:
    return "cudnn"
  if query.shape[1] * key.shape[1] <= XLA_MAX_SCORES:
    return "xla"
  return "blockwise"


def _offset(query, key, query_offset):
  if query_offset is None:
    return key.shape[1] - query.shape[1]
  return query_offset


# ----------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                          key_mask: ArrayLike | None = None, is_causal: bool = True,
                          implementation: str | None = None,
                          block_size: int | tuple[int, int] | None = None,
                          query_offset: ArrayLike | None = None,
                          segment_ids: ArrayLike | None = None,
                          key_segment_ids: ArrayLike | None = None) -> jax.Array:
  r"""Masked, causal, grouped-query softmax attention with O(T) memory available.

  .. math::

    o_i = \sum_j \mathrm{softmax}_{j \in A(i)}\big(q_i \cdot k_j / \sqrt{H}\big)\, v_j,
    \quad A(i) = \{j : \text{key\_mask}_j \wedge (\neg\text{causal} \vee
    j \le i + \text{query\_offset})\}.

  A query with no visible key (e.g. a left-padded position whose real keys all come
  later) returns 0. Positions whose ``key_mask`` is 0 never change any output.

  Args:
    query: ``[B, T, N, H]``.
    key: ``[B, S, K, H]`` with ``N % K == 0`` (query head ``n`` reads KV head
      ``n // (N // K)``, the layout of ``jax.nn.dot_product_attention``).
    value: ``[B, S, K, H]``.
    key_mask: ``[B, S]`` bool or 0/1, real keys (padding may sit anywhere); ``None``
      means all keys are real.
    is_causal: restrict query ``i`` to keys ``j <= i + query_offset``.
    implementation: ``"xla"``, ``"blockwise"``, ``"cudnn"``, a registered name, or
      ``None`` for :func:`select_implementation`'s choice.
    block_size: ``"blockwise"`` query/key block size (an int or ``(block_q,
      block_k)``); default :data:`DEFAULT_BLOCK_SIZE` of the backend (128 on CPU). Any
      ``T``/``S`` works: blocks shrink to balance the padding, and never exceed T/S.
    query_offset: the key index of query 0 for the causal rule, a scalar int (may be
      traced). ``None`` (default) means ``S - T``: queries aligned to the end of the
      keys. A fixed-size KV cache whose queries sit at slots ``index ..
      index + T - 1`` passes ``index`` (the unwritten slots beyond are masked by
      ``key_mask``).
    segment_ids: ``[B, T]`` int, packed rows: several sequences per row, segment id
      ``> 0`` per sequence and ``0`` on padding. Query ``i`` then also needs
      ``key_segment_ids[j] == segment_ids[i] != 0``: no attention across sequences
      (the packed layout of :mod:`jaxrl_llm.packing`). ``None``: one sequence a row.
    key_segment_ids: ``[B, S]`` int, the keys' segment ids; default ``segment_ids``
      (self-attention, ``T == S``).

  Returns:
    ``[B, T, N, H]`` in ``query``'s dtype (float32 math inside).

  Raises:
    ValueError: on mismatched ranks, batch or head dims, ``N % K != 0``, a ``key_mask``
      or segment ids of the wrong shape, an unknown implementation, or ``"cudnn"``
      where its semantics differ (it cannot take segment ids).

  Examples:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 3, 2, 4)); k = jnp.ones((1, 3, 1, 4))
    >>> vals = jnp.arange(3.0)[None, :, None, None] * jnp.ones((1, 3, 1, 4))
    >>> out = dot_product_attention(q, k, vals, key_mask=jnp.array([[0, 1, 1]]))
    >>> out[0, :, 0, 0].tolist()   # query 0 sees no real key; query 2 averages 1 and 2
    [0.0, 1.0, 1.5]
    >>> seg = jnp.array([[1, 2, 2]])        # two sequences packed in one row
    >>> out = dot_product_attention(q, k, vals, segment_ids=seg)
    >>> out[0, :, 0, 0].tolist()   # query 1 starts sequence 2: it sees only itself
    [0.0, 1.0, 1.5]
  """
  b, t, _, _, s, _ = _check_inputs(query, key, value, key_mask, query_offset)
  segment_ids, key_segment_ids = _check_segments(segment_ids, key_segment_ids, b, t, s)
  if implementation is None:
    implementation = select_implementation(query, key, key_mask=key_mask,
                                           is_causal=is_causal, query_offset=query_offset,
                                           segment_ids=segment_ids)
  v.check_choice("implementation", implementation, tuple(ATTENTION_IMPLEMENTATIONS))
  fn = ATTENTION_IMPLEMENTATIONS[implementation]
  # Segment ids go only to calls that have them, so implementations registered before
  # packing existed keep working on unpacked rows.
  extra = {} if segment_ids is None else {"segment_ids": segment_ids,
                                          "key_segment_ids": key_segment_ids}
  out = fn(query, key, value, key_mask=key_mask, is_causal=is_causal,
           query_offset=query_offset, block_size=block_size, **extra)
  return out.astype(query.dtype)


def attention_with_lse(query: jax.Array, key: jax.Array, value: jax.Array, *,
                       key_mask: ArrayLike | None = None, is_causal: bool = True,
                       implementation: str = "blockwise",
                       block_size: int | tuple[int, int] | None = None,
                       query_offset: ArrayLike | None = None,
                       segment_ids: ArrayLike | None = None,
                       key_segment_ids: ArrayLike | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  r"""Attention output and the log-sum-exp of the scores, both float32.

  ``lse_i = log sum_{j in A(i)} exp(q_i . k_j / sqrt(H))`` per query and head. Two
  partial results over disjoint key sets merge exactly with the online-softmax rule

  .. math::

    \ell = \log(e^{\ell_1} + e^{\ell_2}), \qquad
    o = e^{\ell_1 - \ell}\, o_1 + e^{\ell_2 - \ell}\, o_2,

  which is how ring attention assembles its blocks. A query with no visible key gets
  ``out = 0`` and ``lse =`` :data:`NO_KEY_LSE` (``-1e30``, finite), so such merges never
  give NaN. Both outputs are differentiable (the ``lse`` cotangent ``g_i`` adds
  ``g_i p_ij`` to the score gradient, i.e. ``D_i = rowsum(dO_i * O_i) - g_i`` in the
  FlashAttention-2 backward).

  Args:
    query, key, value, key_mask, is_causal, block_size, query_offset, segment_ids,
      key_segment_ids: as in :func:`dot_product_attention`.
    implementation: ``"blockwise"`` (default) or ``"xla"``.

  Returns:
    ``(out [B, T, N, H] float32, lse [B, T, N] float32)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 2, 1, 4)); k = jnp.zeros((1, 2, 1, 4))
    >>> out, lse = attention_with_lse(q, k, jnp.ones((1, 2, 1, 4)),
    ...                               key_mask=jnp.array([[0, 1]]))
    >>> out[0, :, 0, 0].tolist(), bool(lse[0, 0, 0] == NO_KEY_LSE), float(lse[0, 1, 0])
    ([0.0, 1.0], True, 0.0)
  """
  b, t, _, _, s, _ = _check_inputs(query, key, value, key_mask, query_offset)
  segments = _pair(*_check_segments(segment_ids, key_segment_ids, b, t, s))
  v.check_choice("implementation", implementation, ("blockwise", "xla"))
  offset = _offset(query, key, query_offset)
  if implementation == "xla":
    return _xla_with_lse(query, key, value, key_mask, is_causal, offset, segments)
  return _blockwise_with_lse(query, key, value, key_mask, is_causal, offset, block_size,
                             segments)


# ----------------------------------------------------------------------------------
# Paged attention (the rollout engine's KV cache)
# ----------------------------------------------------------------------------------

#: Keys per online-softmax chunk of :func:`paged_attention` when ``chunk_pages`` is None
#: (rounded down to whole pages, at least one page).
PAGED_CHUNK_TOKENS = 128


def paged_attention(query: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: ArrayLike,
                    positions: ArrayLike, *, chunk_pages: int | None = None) -> jax.Array:
  r"""Causal grouped-query attention of queries over their row's pages of a KV pool.

  The keys of row ``b`` live in a shared pool of pages: key position ``j`` of the row is
  ``k_pages[page_table[b, j // P], j % P]`` (``P`` = page size). Query ``t`` of row
  ``b`` sits at position :math:`p_{bt}` = ``positions[b, t]`` and sees the keys
  :math:`j \le p_{bt}` (all of them written before the call: the prompt, earlier
  tokens and this call's own tokens),

  .. math::

    o_{bt} = \sum_{j \le p_{bt}}
      \frac{e^{s_j}}{\sum_{j' \le p_{bt}} e^{s_{j'}}}\, v_j, \qquad
      s_j = \frac{q_{bt} \cdot k_j}{\sqrt{H}}.

  A padded query (``positions < 0``) sees no key and returns 0.

  The keys are read in chunks of ``chunk_pages`` pages (gather of the row's pages, then
  a masked softmax) merged with the online-softmax rule (running max ``m``, sum ``l``,
  output ``acc``; Milakov & Gimelshein 2018). The work is ragged: chunk ``c`` is read
  only by the rows whose last query reaches it, in blocks of ``w = max(ceil(B / 4),
  min(B, 8))`` rows (rows sorted longest first, so they are a prefix; traced trip
  counts), so a call reads about :math:`\sum_b n_b` keys for row lengths :math:`n_b`
  (rounded up to blocks), not ``B`` times the longest (nor the page table's capacity);
  padding rows read none, and nothing recompiles as sequences grow. (With ``B <= 8``
  there is one block: every row reads the chunks up to the longest, in row order.) A
  row's ``(m, l, acc)`` goes through its own chunks in order, always in a block of
  ``w`` rows, with the same arithmetic whatever the other rows are (a chunk holding no
  visible key would leave it bit for bit unchanged: rescale factor
  :math:`e^{m - m} = 1`, exact-zero terms), so rows never mix.

  Args:
    query: ``[B, T, N, H]``.
    k_pages: ``[num_pages, P, K, H]`` with ``N % K == 0`` (query head ``n`` reads KV
      head ``n // (N // K)``).
    v_pages: ``[num_pages, P, K, H]``.
    page_table: ``[B, M]`` int, the pages of each row in order; entries past a row's
      last position are never read into the result (any in-range id will do).
    positions: ``[B, T]`` int, the position of each query (``< 0``: padding).
    chunk_pages: pages per chunk (static); default :data:`PAGED_CHUNK_TOKENS` keys.

  Returns:
    ``[B, T, N, H]`` in ``query``'s dtype (float32 math inside).

  Examples:
    >>> import jax.numpy as jnp
    >>> pool = jnp.arange(4.0)[:, None, None, None] * jnp.ones((4, 2, 1, 2))
    >>> q = jnp.zeros((1, 1, 1, 2))              # equal scores: a plain average
    >>> table = jnp.array([[3, 1]])              # positions 0,1 on page 3; 2,3 on page 1
    >>> out = paged_attention(q, pool, pool, table, jnp.array([[2]]))
    >>> round(float(out[0, 0, 0, 0]), 4)         # mean of 3, 3, 1
    2.3333
  """
  for name, x in (("query", query), ("k_pages", k_pages), ("v_pages", v_pages)):
    v.check_rank(name, x, 4)
    v.check_float(name, x)
  b, t, n, h = v.shape_of(query)
  _, page, k, hk = v.shape_of(k_pages)
  if hk != h or n % k:
    raise ValueError(f"`k_pages` must have shape [num_pages, P, K, H] with H = {h} and "
                     f"K dividing N = {n} (from `query` {v.shape_of(query)}), got "
                     f"{v.shape_of(k_pages)}.")
  if v.shape_of(v_pages) != v.shape_of(k_pages):
    raise ValueError(f"`v_pages` must have the shape of `k_pages` {v.shape_of(k_pages)}, "
                     f"got {v.shape_of(v_pages)}.")
  v.check_rank("page_table", page_table, 2)
  if v.shape_of(page_table)[0] != b:
    raise ValueError(f"`page_table` must have shape [B, M] with B = {b}, got "
                     f"{v.shape_of(page_table)}.")
  if v.shape_of(positions) != (b, t):
    raise ValueError(f"`positions` must have shape {(b, t)}, got {v.shape_of(positions)}.")
  if chunk_pages is None:
    chunk_pages = max(1, PAGED_CHUNK_TOKENS // page)
  if not isinstance(chunk_pages, int) or chunk_pages < 1:
    raise ValueError(f"`chunk_pages` must be a static int >= 1, got {chunk_pages!r}.")
  k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
  m_pages = v.shape_of(page_table)[1]
  width = -(-m_pages // chunk_pages) * chunk_pages
  table = jnp.pad(jnp.asarray(page_table, jnp.int32), ((0, 0), (0, width - m_pages)))
  positions = jnp.asarray(positions, jnp.int32)
  chunk = chunk_pages * page
  g = n // k
  q = jnp.asarray(query, jnp.float32).reshape(b, t, k, g, h) * (1.0 / math.sqrt(h))
  # Rows longest first: the n_c rows whose last query reaches chunk c are a prefix of
  # ``order``; they read it in blocks of w rows (gathered, then scattered back). Every
  # row always goes through blocks of w, whatever the others: its arithmetic does not
  # depend on them (XLA:CPU rounds some ops differently at other batch sizes).
  row_last = jnp.max(positions, axis=1)
  w = max(-(-b // 4), min(b, 8))
  order = jnp.argsort(-row_last, stable=True)
  order = jnp.pad(order, (0, -(-b // w) * w - b))
  n_chunks = jnp.minimum((jnp.max(positions) + chunk) // chunk, width // chunk_pages)

  def read_chunk(c, carry, q, table, positions):     # these rows read chunk c
    rows = q.shape[0]
    ids = lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages, axis=1)
    keys = k_pages[ids].reshape(rows, chunk, k, h).astype(jnp.float32)
    vals = v_pages[ids].reshape(rows, chunk, k, h).astype(jnp.float32)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, keys)
    key_pos = c * chunk + jnp.arange(chunk)
    allowed = (key_pos[None, None, :] <= positions[:, :, None])[:, None, None]
    return _online_softmax_block(carry, scores, allowed, vals, "bkgts,bskh->bkgth")

  def rows_block(c, s, carry):                       # block s of the rows reaching c
    take = s * w + jnp.arange(w) < jnp.sum(row_last >= c * chunk)
    rows = jnp.where(take, lax.dynamic_slice_in_dim(order, s * w, w), 0)
    new = read_chunk(c, tuple(x[rows] for x in carry), q[rows], table[rows],
                     positions[rows])
    put = jnp.where(take, rows, b)                     # rows past n_c write nothing
    return tuple(x.at[put].set(y, mode="drop") for x, y in zip(carry, new))

  def body(c, carry):                                  # carry: m, l [B,K,G,T], acc (,H)
    if w == b:                       # B <= 8: one block in row order, nothing gathered
      return read_chunk(c, carry, q, table, positions)
    blocks = -(-jnp.sum(row_last >= c * chunk) // w)
    return lax.fori_loop(0, blocks, lambda s, cr: rows_block(c, s, cr), carry)

  init = (jnp.full((b, k, g, t), _NEG, jnp.float32), jnp.zeros((b, k, g, t), jnp.float32),
          jnp.zeros((b, k, g, t, h), jnp.float32))
  _, l, acc = lax.fori_loop(0, n_chunks, body, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)
  return out.astype(query.dtype)


__all__ = [
    "ATTENTION_IMPLEMENTATIONS", "DEFAULT_BLOCK_SIZE", "NO_KEY_LSE", "PAGED_CHUNK_TOKENS",
    "XLA_MAX_SCORES", "attention_with_lse", "dot_product_attention", "paged_attention",
    "register_attention", "select_implementation",
]
