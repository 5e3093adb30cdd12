"""Tests for the reference transformer (jaxrl_llm.models.transformer)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec

from jaxrl_llm.models.transformer import (
  KVCache,
  Transformer,
  TransformerConfig,
  chunked_swiglu,
  get_config,
  make_apply_fn,
  make_decode_fns,
  rope,
  split_model,
  swiglu,
)
from tests.utils import assert_close, assert_no_recompile, random_mask

# These tests check values, not speed: skipping XLA's backend optimisation roughly
# halves CPU compile time, which dominates this file's wall time.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

V = 32
CFG = TransformerConfig.tiny(V)


def _build(cfg=CFG, seed=0):
  graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(seed)))
  return graphdef, params


GRAPHDEF, PARAMS = _build()
_APPLY = _jit(make_apply_fn(GRAPHDEF))


def APPLY(*args):  # pylint: disable=invalid-name
  """The jitted forward with NumPy outputs (eager jax indexing would compile per call)."""
  return jax.tree.map(np.asarray, _APPLY(*args))


def _tokens(seed, b=3, t=10):
  return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


def _loss(params, graphdef, tokens, mask):
  """A scalar touching every output: log-probs of token 3 plus squared values."""
  hidden, values, lm_head = make_apply_fn(graphdef)(params, tokens, None, mask)
  loss = jnp.sum(jax.nn.log_softmax(hidden @ lm_head)[..., 3] * mask)
  return loss if values is None else loss + jnp.sum(values ** 2)


LOSS_GRAD = _jit(jax.value_and_grad(_loss), static_argnums=1)


def _left_mask(lengths, t):
  lengths = np.asarray(lengths)
  return (np.arange(t)[None, :] >= t - lengths[:, None]).astype(np.float32)


# ----------------------------------------------------------------------------------
# Independent NumPy reference (float64, loops over tokens and heads)
# ----------------------------------------------------------------------------------


def _np_rms(x, g, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _np_rope(vec, pos, theta):
  d = vec.shape[-1]
  out = np.empty_like(vec)
  for i in range(d // 2):
    w = pos * theta ** (-2.0 * i / d)
    a, b = vec[i], vec[i + d // 2]
    out[i] = a * np.cos(w) - b * np.sin(w)
    out[i + d // 2] = b * np.cos(w) + a * np.sin(w)
  return out


def np_forward(p, cfg, ids):
  """Hidden [L, D] and values [L] of one unpadded sequence ``ids`` (positions 0..L-1).

  ``p`` is the pure-dict of the parameters in float64.
  """
  h_n, k_n, dh = cfg.n_heads, cfg.n_kv_heads, cfg.dim_per_head
  group = h_n // k_n
  x = p["embed"][np.asarray(ids)]
  n = len(ids)
  for layer in range(cfg.n_layers):
    bp = p["blocks"][layer]
    h = _np_rms(x, bp["attn_norm"]["scale"], cfg.norm_eps)
    q = np.einsum("td,dhk->thk", h, bp["attn"]["wq"])
    k = np.einsum("td,dhk->thk", h, bp["attn"]["wk"])
    val = np.einsum("td,dhk->thk", h, bp["attn"]["wv"])
    for t in range(n):
      for j in range(h_n):
        q[t, j] = _np_rope(q[t, j], t, cfg.rope_theta)
      for j in range(k_n):
        k[t, j] = _np_rope(k[t, j], t, cfg.rope_theta)
    out = np.zeros((n, h_n, dh))
    for t in range(n):
      for j in range(h_n):
        kv = j // group
        scores = np.array([q[t, j] @ k[s, kv] / np.sqrt(dh) for s in range(t + 1)])
        w = np.exp(scores - scores.max())
        w /= w.sum()
        out[t, j] = sum(w[s] * val[s, kv] for s in range(t + 1))
    x = x + np.einsum("thk,hkd->td", out, bp["attn"]["wo"])
    h = _np_rms(x, bp["mlp_norm"]["scale"], cfg.norm_eps)
    gate = h @ bp["mlp"]["w_gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ bp["mlp"]["w_up"])) @ bp["mlp"]["w_down"]
  hidden = _np_rms(x, p["final_norm"]["scale"], cfg.norm_eps)
  values = hidden @ p["value_w"][:, 0] + p["value_b"][0]
  return hidden, values


# ----------------------------------------------------------------------------------
# Shapes, reference, hand checks
# ----------------------------------------------------------------------------------


def test_shapes_and_dtypes():
  tokens = _tokens(0)
  hidden, values, lm_head = APPLY(PARAMS, tokens)
  assert hidden.shape == (3, 10, CFG.d_model) and hidden.dtype == np.float32
  assert values.shape == (3, 10) and values.dtype == np.float32
  assert lm_head.shape == (CFG.d_model, V)
  logits = _jit(lambda p, h: nnx.merge(GRAPHDEF, p).logits(h))(PARAMS, hidden)
  assert logits.shape == (3, 10, V) and logits.dtype == jnp.float32
  assert_close(logits, hidden @ lm_head, atol=1e-5)


def test_matches_numpy_reference_on_random_masks():
  rng = np.random.default_rng(0)
  tokens = _tokens(1)
  mask = random_mask(rng, 3, 10)
  hidden, values, _ = APPLY(PARAMS, tokens, None, mask)
  p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(PARAMS))
  for b in range(3):
    real = np.nonzero(mask[b])[0]
    if len(real):
      ref_h, ref_v = np_forward(p64, CFG, tokens[b, real])
      assert_close(hidden[b, real], ref_h, atol=1e-4, rtol=1e-4)
      assert_close(values[b, real], ref_v, atol=1e-4, rtol=1e-4)
    pad = mask[b] == 0
    np.testing.assert_array_equal(np.asarray(hidden[b, pad]), 0.0)
    np.testing.assert_array_equal(np.asarray(values[b, pad]), 0.0)


def test_rope_hand_check_and_relative_property():
  rope_jit = _jit(rope)
  # d = 2: a pure rotation of (1, 0) by angle p.
  x = np.array([1.0, 0.0], np.float32).reshape(1, 1, 1, 2)
  out = rope_jit(np.repeat(x, 3, axis=1), np.array([[0, 1, 3]]), 10000.0)
  assert_close(out[0, :, 0], [[1, 0], [np.cos(1), np.sin(1)], [np.cos(3), np.sin(3)]],
               atol=1e-6)
  # <rope(q, p), rope(k, s)> depends on p - s only.
  rng = np.random.default_rng(0)
  q = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
  k = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
  dot_fn = _jit(lambda p, s: jnp.sum(rope(q, p[None, None], 100.0)
                                        * rope(k, s[None, None], 100.0)))
  dot = lambda p, s: float(dot_fn(np.int32(p), np.int32(s)))
  assert dot(5, 2) == pytest.approx(dot(13, 10), abs=1e-4)
  assert dot(0, 0) == pytest.approx(float(np.sum(q * k)), abs=1e-5)
  assert abs(dot(5, 2) - dot(5, 3)) > 1e-3


# ----------------------------------------------------------------------------------
# Causality and padding (properties)
# ----------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(t=st.integers(0, 8), seed=st.integers(0, 10_000))
def test_causality(t, seed):
  tokens = _tokens(seed)
  changed = tokens.copy()
  changed[:, t + 1:] = (tokens[:, t + 1:] + 7) % V
  h1, v1, _ = APPLY(PARAMS, tokens)
  h2, v2, _ = APPLY(PARAMS, changed)
  assert_close(h1[:, :t + 1], h2[:, :t + 1], atol=1e-6)
  assert_close(v1[:, :t + 1], v2[:, :t + 1], atol=1e-6)
  if t < 8:
    assert not np.allclose(np.asarray(h1[:, t + 1:]), np.asarray(h2[:, t + 1:]))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_padding_invariance(seed):
  """Any padding layout and any ids at padded slots give the compacted outputs."""
  rng = np.random.default_rng(seed)
  t = 10
  mask = random_mask(rng, 3, t)
  tokens = rng.integers(0, V, (3, t)).astype(np.int32)
  garbage = np.where(mask > 0, tokens, rng.integers(0, V, (3, t))).astype(np.int32)
  h_mask, v_mask, _ = APPLY(PARAMS, garbage, None, mask)
  # Compact each row's real tokens to the left (right-padded layout).
  compact = np.zeros_like(tokens)
  compact_mask = np.zeros_like(mask)
  for b in range(3):
    real = tokens[b, mask[b] > 0]
    compact[b, :len(real)] = real
    compact_mask[b, :len(real)] = 1
  h_cmp, v_cmp, _ = APPLY(PARAMS, compact, None, compact_mask)
  for b in range(3):
    n = int(compact_mask[b].sum())
    assert_close(h_mask[b, mask[b] > 0], h_cmp[b, :n], atol=1e-5)
    assert_close(v_mask[b, mask[b] > 0], v_cmp[b, :n], atol=1e-5)
  assert np.all(np.asarray(h_mask)[mask == 0] == 0)


def test_explicit_positions_match_default():
  tokens = _tokens(3)
  mask = _left_mask([10, 6, 3], 10)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  a = APPLY(PARAMS, tokens, None, mask)
  b = APPLY(PARAMS, tokens, positions, mask)
  assert_close(a, b, atol=0)
  c = APPLY(PARAMS, tokens, positions + 3, mask)   # shifted positions: RoPE is relative
  assert_close(a[0], c[0], atol=1e-4)


def test_empty_row_is_finite_zero():
  tokens = _tokens(4)
  mask = np.ones((3, 10), np.float32)
  mask[1] = 0
  hidden, values, _ = APPLY(PARAMS, tokens, None, mask)
  assert np.all(np.isfinite(np.asarray(hidden)))
  np.testing.assert_array_equal(np.asarray(hidden[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(values[1]), 0.0)


# ----------------------------------------------------------------------------------
# Architecture options
# ----------------------------------------------------------------------------------


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa_cfg = CFG
  mha_cfg = TransformerConfig.tiny(V, n_kv_heads=4)
  p_gqa = PARAMS
  g_mha, p_mha = _build(mha_cfg)
  src = nnx.to_pure_dict(p_gqa)
  assert gqa_cfg.n_kv_heads == 2
  dst = nnx.to_pure_dict(p_mha)
  group = gqa_cfg.n_heads // gqa_cfg.n_kv_heads
  for layer in range(gqa_cfg.n_layers):
    for name in ("wk", "wv"):
      # query head h uses kv head h // group
      src_w = src["blocks"][layer]["attn"][name]
      dst["blocks"][layer]["attn"][name] = np.repeat(np.asarray(src_w), group, axis=1)
    for name in ("wq", "wo"):
      dst["blocks"][layer]["attn"][name] = src["blocks"][layer]["attn"][name]
    for name in ("attn_norm", "mlp_norm", "mlp"):
      dst["blocks"][layer][name] = src["blocks"][layer][name]
  for name in ("embed", "final_norm", "value_w", "value_b"):
    dst[name] = src[name]
  nnx.replace_by_pure_dict(p_mha, dst)
  tokens = _tokens(5)
  mask = _left_mask([10, 7, 2], 10)
  out_gqa = APPLY(p_gqa, tokens, None, mask)   # same graphdef as the default tiny
  out_mha = _jit(make_apply_fn(g_mha))(p_mha, tokens, None, mask)
  assert_close(out_gqa, out_mha, atol=1e-5)
  assert p_gqa["blocks"][0]["attn"]["wk"][...].shape == (64, 2, 16)


def test_tied_vs_untied_and_value_head_off():
  tied = nnx.merge(GRAPHDEF, PARAMS)
  np.testing.assert_array_equal(np.asarray(tied.lm_head_weight()),
                                np.asarray(tied.embed[...]).T)
  assert "lm_head" not in nnx.to_pure_dict(PARAMS)
  g_u, p_u = _build(TransformerConfig.tiny(V, tie_embeddings=False, value_head=False))
  pure = nnx.to_pure_dict(p_u)
  assert pure["lm_head"].shape == (64, V)
  assert "value_w" not in pure and "value_b" not in pure
  tokens, mask = _tokens(6), np.ones((3, 10), np.float32)
  hidden, values, lm_head = _jit(make_apply_fn(g_u))(p_u, tokens, None, mask)
  assert values is None and hidden.shape == (3, 10, 64)
  np.testing.assert_array_equal(np.asarray(lm_head), np.asarray(pure["lm_head"]))
  # The tied embedding gets gradient from its use as the LM head too.
  _, g_tied = LOSS_GRAD(PARAMS, GRAPHDEF, tokens, mask)
  unused_rows = np.setdiff1d(np.arange(V), tokens.ravel())
  assert len(unused_rows) > 0   # rows never used as inputs still get LM-head gradient
  assert np.abs(np.asarray(nnx.to_pure_dict(g_tied)["embed"])[unused_rows]).sum() > 0


def test_remat_identical_values_and_grads():
  g_r, p_r = _build(TransformerConfig.tiny(V, remat=True))
  assert_close(p_r, PARAMS, atol=0)
  tokens = _tokens(7)
  mask = _left_mask([10, 5, 1], 10)
  l0, g0 = LOSS_GRAD(PARAMS, GRAPHDEF, tokens, mask)
  l1, g1 = LOSS_GRAD(p_r, g_r, tokens, mask)
  assert_close(l0, l1, atol=1e-6)
  assert_close(g0, g1, atol=1e-5)   # a rematted scan body fuses differently: rounding


@pytest.mark.parametrize("remat", [False, True])
def test_scan_layers_equals_unrolled_blocks(remat):
  # The layer scan (default) stacks the per-block params inside the forward: same
  # param tree, same values and gradients as the unrolled Python loop over blocks.
  tokens, mask = _tokens(7), _left_mask([10, 5, 1], 10)
  g_s, p_s = _build(TransformerConfig.tiny(V, remat=remat))
  g_u, p_u = _build(TransformerConfig.tiny(V, remat=remat, scan_layers=False))
  assert jax.tree.structure(p_s) == jax.tree.structure(p_u)
  assert_close(p_s, p_u, atol=0)
  l0, g0 = LOSS_GRAD(p_u, g_u, tokens, mask)
  l1, g1 = LOSS_GRAD(p_s, g_s, tokens, mask)
  assert_close(l0, l1, atol=1e-6)
  assert_close(g0, g1, atol=1e-5)   # ~1 ulp where embed-gradient terms cancel


def test_remat_policies_identical_values_and_grads():
  tokens, mask = _tokens(7), _left_mask([10, 5, 1], 10)
  l0, g0 = LOSS_GRAD(PARAMS, GRAPHDEF, tokens, mask)
  for policy in ("dots_saveable", "nothing_saveable"):
    g_r, p_r = _build(TransformerConfig.tiny(V, remat=True, remat_policy=policy))
    l1, g1 = LOSS_GRAD(p_r, g_r, tokens, mask)
    assert_close(l0, l1, atol=1e-6)
    assert_close(g0, g1, atol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
def test_chunked_mlp_equals_unchunked_values_and_grads(remat):
  # mlp_chunk_size 4 over T=10: 3 strided chunks, T padded to 12. The MLP is per-token,
  # so values are bit-identical; gradients of the MLP weights sum the chunks in another
  # order (float rounding).
  tokens, mask = _tokens(7), _left_mask([10, 5, 1], 10)
  g_c, p_c = _build(TransformerConfig.tiny(V, remat=remat, mlp_chunk_size=4))
  g_u, p_u = _build(TransformerConfig.tiny(V, remat=remat, mlp_chunk_size=None))
  assert_close(p_c, p_u, atol=0)
  h_c, v_c, _ = _jit(make_apply_fn(g_c))(p_c, tokens, None, mask)
  h_u, v_u, _ = _jit(make_apply_fn(g_u))(p_u, tokens, None, mask)
  assert_close(h_c, h_u, atol=0)
  assert_close(v_c, v_u, atol=0)
  l0, g0 = LOSS_GRAD(p_u, g_u, tokens, mask)
  l1, g1 = LOSS_GRAD(p_c, g_c, tokens, mask)
  assert_close(l0, l1, atol=1e-6)
  assert_close(g0, g1, atol=1e-5)
  assert float(l0) == pytest.approx(float(LOSS_GRAD(PARAMS, GRAPHDEF, tokens, mask)[0]),
                                    abs=1e-6)


def test_chunked_swiglu_strided_chunks_pinned():
  # chunked_swiglu against the plain SwiGLU on a hand-sized case, chunk sizes that do
  # and do not divide T, under grad; and the per-shard chunk count (shards=2).
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 7, 3)), jnp.float32)
  w = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((3, 5), (3, 5), (5, 3)))
  ref = np.asarray(swiglu(x, *w))
  x64 = np.asarray(x, np.float64)
  gate = x64 @ np.asarray(w[0], np.float64)
  np_ref = (gate / (1 + np.exp(-gate)) * (x64 @ np.asarray(w[1], np.float64))) @ np.asarray(
      w[2], np.float64)
  assert_close(ref, np_ref, atol=1e-5)
  for chunk, shards in ((1, 1), (2, 1), (3, 1), (7, 1), (100, 1), (2, 2)):
    assert_close(chunked_swiglu(x, *w, chunk, shards), ref, atol=1e-6)
    g_c = jax.grad(lambda x, w, c=chunk, s=shards: jnp.sum(jnp.sin(
        chunked_swiglu(x, *w, c, s))), argnums=(0, 1))(x, w)
    g_u = jax.grad(lambda x, w: jnp.sum(jnp.sin(swiglu(x, *w))), argnums=(0, 1))(x, w)
    assert_close(g_c, g_u, atol=1e-5)
  with pytest.raises(ValueError, match="mlp_chunk_size"):
    TransformerConfig.tiny(V, mlp_chunk_size=0)


# The blockwise (O(T) memory) attention with blocks that do not divide T: the model
# gives the same values, gradients and cached decoding as with the plain softmax.
BLOCK_CFG = TransformerConfig.tiny(V, attention="blockwise", attention_block_size=4)


def test_blockwise_attention_matches_xla_forward_and_grads():
  g_b, p_b = _build(BLOCK_CFG)
  g_x, p_x = _build(TransformerConfig.tiny(V, attention="xla"))
  assert_close(p_b, PARAMS, atol=0)
  tokens = _tokens(12)
  mask = _left_mask([10, 7, 0], 10)
  mask[1, 8:] = 0  # left and right padding, and an empty row
  l0, g0 = LOSS_GRAD(PARAMS, GRAPHDEF, tokens, mask)
  for graphdef, params in ((g_b, p_b), (g_x, p_x)):
    l1, g1 = LOSS_GRAD(params, graphdef, tokens, mask)
    assert_close(l0, l1, atol=1e-5)
    assert_close(g0, g1, atol=1e-5)


def test_packed_padding_equals_key_mask_values_and_grads():
  # Real tokens moved to the front (cuDNN's layout) vs the padding mask: same hidden
  # states, values and gradients, for left and right padding, holes and an empty row.
  g_p, p_p = _build(TransformerConfig.tiny(V, pack_padding=True))
  g_m, p_m = _build(TransformerConfig.tiny(V, pack_padding=False))
  assert_close(p_p, p_m, atol=0)
  tokens = _tokens(21, b=4, t=12)
  mask = _left_mask([10, 7, 0, 12], 12)
  mask[1, 9:] = 0    # left and right padding
  mask[3, [2, 5, 6]] = 0   # holes
  apply_p, apply_m = _jit(make_apply_fn(g_p)), _jit(make_apply_fn(g_m))
  out_p, out_m = apply_p(p_p, tokens, None, mask), apply_m(p_m, tokens, None, mask)
  assert_close(out_p[:2], out_m[:2], atol=2e-6)
  assert_close(out_m[:2], APPLY(PARAMS, tokens, None, mask)[:2], atol=2e-6)
  l_p, g_p_grads = LOSS_GRAD(p_p, g_p, tokens, mask)
  l_m, g_m_grads = LOSS_GRAD(p_m, g_m, tokens, mask)
  assert_close(l_p, l_m, atol=1e-5)
  assert_close(g_p_grads, g_m_grads, atol=1e-5)


def test_pack_padding_by_default_only_where_cudnn_runs(monkeypatch):
  bf16 = TransformerConfig.tiny(V, dtype=jnp.bfloat16)
  assert not Transformer(bf16, rngs=nnx.Rngs(0)).packs_padding(2, 8)   # CPU: no cuDNN
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert Transformer(bf16, rngs=nnx.Rngs(0)).packs_padding(2, 8)
  assert not Transformer(CFG, rngs=nnx.Rngs(0)).packs_padding(2, 8)    # float32
  assert not Transformer(TransformerConfig.tiny(V, dtype=jnp.bfloat16, attention="xla"),
                         rngs=nnx.Rngs(0)).packs_padding(2, 8)
  assert not Transformer(TransformerConfig.tiny(V, dtype=jnp.bfloat16, pack_padding=False),
                         rngs=nnx.Rngs(0)).packs_padding(2, 8)
  with pytest.raises(ValueError, match="pack_padding"):
    TransformerConfig.tiny(V, pack_padding=1)


def test_blockwise_attention_cache_decode_matches_full_forward():
  g_b, p_b = _build(BLOCK_CFG)
  fns = make_decode_fns(g_b)
  b, p, n = 3, 6, 3
  tokens = np.asarray(_tokens(13, b=b, t=p + n))
  prompt_mask = _left_mask([6, 3, 1], p)
  full_mask = np.concatenate([prompt_mask, np.ones((b, n), np.float32)], axis=1)
  hidden, _, lm_head = APPLY(PARAMS, tokens, None, full_mask)
  full_logits = np.asarray(hidden @ lm_head)
  cache = fns.init_cache(p_b, b, p + n + 2)   # 2 slots never written
  logits, cache = _jit(fns.prefill)(p_b, tokens[:, :p], prompt_mask, cache)
  assert_close(logits, full_logits[:, p - 1], atol=1e-5)
  decode = _jit(fns.decode)
  for t in range(p, p + n):
    logits, cache = decode(p_b, tokens[:, t], cache)
    assert_close(logits, full_logits[:, t], atol=1e-5)


def test_bfloat16_runs_finite():
  """bf16 params/matmuls (one layer, to keep the bf16 CPU compile short)."""
  cfg = TransformerConfig.tiny(V, dtype=jnp.bfloat16, n_layers=1)
  g_b, p_b = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)), nnx.Param)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p_b))
  pure = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), nnx.to_pure_dict(PARAMS))
  pure["blocks"] = {0: pure["blocks"][0]}
  nnx.replace_by_pure_dict(p_b, pure)
  tokens, mask = _tokens(8), _left_mask([10, 4, 0], 10)
  hidden, values, _ = _jit(make_apply_fn(g_b))(p_b, tokens, None, mask)
  assert hidden.dtype == jnp.bfloat16 and values.dtype == jnp.float32
  hidden, values = np.asarray(hidden, np.float32), np.asarray(values)
  assert np.all(np.isfinite(hidden)) and np.all(hidden[2] == 0)
  # Against the float64 reference with the same (bf16-rounded) weights.
  p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), pure)
  for b, n in ((0, 10), (1, 4)):
    ref_h, ref_v = np_forward(p64, cfg, tokens[b, 10 - n:])
    assert np.mean(np.abs(hidden[b, 10 - n:] - ref_h)) < 0.03
    assert np.max(np.abs(values[b, 10 - n:] - ref_v)) < 0.1


# ----------------------------------------------------------------------------------
# Sharding metadata
# ----------------------------------------------------------------------------------


def test_every_param_has_logical_partition_spec():
  allowed = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", None}
  for cfg in (CFG, TransformerConfig.tiny(V, tie_embeddings=False)):
    _, params = _build(cfg)
    specs = nnx.get_partition_spec(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    param_leaves = jax.tree.leaves(params)
    assert len(spec_leaves) == len(param_leaves)
    for spec, leaf in zip(spec_leaves, param_leaves):
      assert isinstance(spec, PartitionSpec)
      assert len(spec) == leaf.ndim
      assert set(spec) <= allowed
  pure = nnx.to_pure_dict(nnx.get_partition_spec(PARAMS))
  assert pure["embed"] == PartitionSpec("vocab", "embed")
  assert pure["blocks"][0]["attn"]["wq"] == PartitionSpec("embed", "heads", "head_dim")
  assert pure["blocks"][0]["attn"]["wk"] == PartitionSpec("embed", "kv_heads", "head_dim")
  assert pure["blocks"][0]["mlp"]["w_down"] == PartitionSpec("mlp", "embed")
  assert pure["value_w"] == PartitionSpec("embed", None)


# ----------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------


FNS = make_decode_fns(GRAPHDEF)
PREFILL, DECODE = _jit(FNS.prefill), _jit(FNS.decode)


@pytest.mark.parametrize("layout", ["left", "right"])
def test_cache_decode_matches_full_forward(layout):
  b, p, n = 3, 6, 5
  tokens = np.asarray(_tokens(9, b=b, t=p + n))
  lengths = np.array([6, 3, 1])
  if layout == "left":
    prompt_mask = _left_mask(lengths, p)
  else:
    prompt_mask = (np.arange(p)[None] < lengths[:, None]).astype(np.float32)
  full_mask = np.concatenate([prompt_mask, np.ones((b, n), np.float32)], axis=1)
  hidden, _values, lm_head = APPLY(PARAMS, tokens, None, full_mask)
  full_logits = np.asarray(hidden @ lm_head)

  cache = FNS.init_cache(PARAMS, b, p + n)
  logits, cache = PREFILL(PARAMS, tokens[:, :p], prompt_mask, cache)
  last = np.array([np.nonzero(r)[0][-1] for r in prompt_mask])
  assert_close(logits, full_logits[np.arange(b), last], atol=1e-5)
  for t in range(p, p + n):
    logits, cache = DECODE(PARAMS, tokens[:, t], cache)
    assert_close(logits, full_logits[:, t], atol=1e-5)
  assert int(cache.index) == p + n
  np.testing.assert_array_equal(np.asarray(cache.positions), lengths + n)
  np.testing.assert_array_equal(np.asarray(cache.valid), full_mask > 0)


def test_cache_module_methods_return_hidden_and_values():
  @_jit
  def run(params, tokens):
    model = nnx.merge(GRAPHDEF, params)
    cache = model.init_cache(3, 10)
    h_pre, v_pre, cache = model.prefill(tokens[:, :9], jnp.ones((3, 9)), cache)
    h_dec, v_dec, cache = model.decode(tokens[:, 9], cache)
    return h_pre, v_pre, h_dec, v_dec, cache

  tokens = _tokens(10)
  h_pre, v_pre, h_dec, v_dec, cache = run(PARAMS, tokens)
  assert isinstance(cache, KVCache) and len(cache.k) == CFG.n_layers
  assert cache.k[0].shape == (3, 10, CFG.n_kv_heads, CFG.dim_per_head)
  hidden, values, _ = APPLY(PARAMS, tokens)
  assert_close(h_pre, hidden[:, :9], atol=1e-5)
  assert_close(v_pre, values[:, :9], atol=1e-5)
  assert_close(h_dec, hidden[:, 9], atol=1e-5)
  assert_close(v_dec, values[:, 9], atol=1e-5)


# ----------------------------------------------------------------------------------
# Transforms, recompiles, speed
# ----------------------------------------------------------------------------------


def test_jit_grad_vmap_no_recompile_and_speed():
  tokens = _tokens(11)
  mask = _left_mask([10, 8, 2], 10)
  _, grads = LOSS_GRAD(PARAMS, GRAPHDEF, tokens, mask)
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  assert all(np.abs(np.asarray(g)).sum() > 0 for g in leaves)
  # A tiny fwd+bwd is well under a second once compiled.
  start = time.perf_counter()
  jax.block_until_ready(LOSS_GRAD(PARAMS, GRAPHDEF, tokens + 2, mask))
  assert time.perf_counter() - start < 1.0
  # vmap over rows == batched forward; new params/tokens/mask values do not recompile.
  apply = make_apply_fn(GRAPHDEF)
  rows = jax.vmap(lambda p, t, m: apply(p, t[None], None, m[None])[0][0],
                  in_axes=(None, 0, 0))
  params2 = jax.tree.map(lambda x: x * 1.01, PARAMS)
  assert_no_recompile(rows, (PARAMS, tokens, mask), (params2, tokens + 1, mask[::-1]))
  assert_close(_jit(rows)(PARAMS, tokens, mask), APPLY(PARAMS, tokens, None, mask)[0],
               atol=1e-5)


# ----------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------


def test_bad_inputs_raise():
  model = nnx.merge(GRAPHDEF, PARAMS)
  with pytest.raises(ValueError, match="tokens"):
    model(jnp.ones((4,), jnp.int32))
  with pytest.raises(ValueError, match="tokens"):
    model(jnp.ones((2, 4), jnp.float32))
  with pytest.raises(ValueError, match="attention_mask"):
    model(jnp.ones((2, 4), jnp.int32), attention_mask=jnp.ones((2, 5)))
  with pytest.raises(ValueError, match="positions"):
    model(jnp.ones((2, 4), jnp.int32), positions=jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="cache"):
    jax.eval_shape(lambda: model.decode(jnp.ones((3,), jnp.int32), model.init_cache(2, 4)))
  with pytest.raises(ValueError, match="n_kv_heads"):
    TransformerConfig.tiny(V, n_kv_heads=3)
  with pytest.raises(ValueError, match="head_dim"):
    TransformerConfig.tiny(V, head_dim=15)
  with pytest.raises(ValueError, match="vocab_size"):
    TransformerConfig.tiny(0)
  with pytest.raises(ValueError, match="name"):
    get_config("huge", V)
  with pytest.raises(ValueError, match="remat_policy"):
    TransformerConfig.tiny(V, remat=True, remat_policy="some")
  with pytest.raises(ValueError, match="attention_block_size"):
    TransformerConfig.tiny(V, attention_block_size=0)
  with pytest.raises(ValueError, match="implementation"):
    model_bad = Transformer(TransformerConfig.tiny(V, attention="nope"))
    jax.eval_shape(lambda: model_bad(jnp.ones((1, 4), jnp.int32)))


def test_presets():
  assert get_config("tiny", V) == TransformerConfig.tiny(V)
  small = get_config("small", 100, remat=True)
  assert (small.d_model, small.n_layers, small.n_heads, small.d_ff,
          small.max_seq_len) == (256, 4, 8, 1024, 512)
  assert small.remat and small.vocab_size == 100
