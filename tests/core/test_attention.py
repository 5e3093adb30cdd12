"""Tests of jaxrl_llm.attention against an independent plain-NumPy softmax reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import attention as attn
from jaxrl_llm.attention import attention_with_lse, dot_product_attention

# Values, not speed: skipping XLA's backend optimisation shortens CPU compiles.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


@functools.partial(_jit, static_argnames=("causal", "impl", "block"))
def _all_outputs(q, k, v, key_mask, dout, dlse, *, causal, impl, block):
  """Output, its VJP with ``dout``; (out, lse) of attention_with_lse and their VJP."""

  def fwd(q, k, v):
    return dot_product_attention(q, k, v, key_mask=key_mask, is_causal=causal,
                                 implementation=impl, block_size=block)

  def fwd_lse(q, k, v):
    return attention_with_lse(q, k, v, key_mask=key_mask, is_causal=causal,
                              implementation=impl, block_size=block)

  out, vjp = jax.vjp(fwd, q, k, v)
  (out2, lse), vjp2 = jax.vjp(fwd_lse, q, k, v)
  return out, vjp(dout), out2, lse, vjp2((dout, dlse))


# ----------------------------------------------------------------------------------
# NumPy reference: loops over batch rows and query heads, float64.
# ----------------------------------------------------------------------------------


def np_allowed(t, s, key_mask_row, causal, offset):
  allowed = np.ones((t, s), bool)
  if key_mask_row is not None:
    allowed &= key_mask_row[None, :].astype(bool)
  if causal:
    allowed &= np.arange(s)[None, :] <= np.arange(t)[:, None] + offset
  return allowed


def np_attention(q, k, v, key_mask, causal, offset=None, dout=None, dlse=None):
  """Forward (out, lse) and, given cotangents, (dq, dk, dv), all in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  offset = s - t if offset is None else offset
  scale = 1.0 / np.sqrt(h)
  out = np.zeros((b, t, n, h))
  lse = np.full((b, t, n), attn.NO_KEY_LSE)
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  for bi in range(b):
    allowed = np_allowed(t, s, None if key_mask is None else np.asarray(key_mask[bi]),
                         causal, offset)
    for ni in range(n):
      ki = ni // g
      scores = q[bi, :, ni] @ k[bi, :, ki].T * scale
      p = np.zeros((t, s))
      for ti in range(t):
        if allowed[ti].any():
          row = scores[ti, allowed[ti]]
          mx = row.max()
          e = np.exp(row - mx)
          p[ti, allowed[ti]] = e / e.sum()
          lse[bi, ti, ni] = mx + np.log(e.sum())
      out[bi, :, ni] = p @ v[bi, :, ki]
      if dout is not None:
        do = np.asarray(dout[bi, :, ni], np.float64)
        gl = np.zeros(t) if dlse is None else np.asarray(dlse[bi, :, ni], np.float64)
        dv[bi, :, ki] += p.T @ do
        dp = do @ v[bi, :, ki].T
        ds = p * (dp - (dp * p).sum(-1, keepdims=True) + gl[:, None])
        dq[bi, :, ni] = ds @ k[bi, :, ki] * scale
        dk[bi, :, ki] += ds.T @ q[bi, :, ni] * scale
  return out, lse, (dq, dk, dv)


def make_inputs(seed, b, t, s, n, kh, h, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, n, h)).astype(np.float32)
  k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
  v = rng.normal(size=(b, s, kh, h)).astype(np.float32)
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype))


def padding_mask(b, s, kind, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.ones((b, s), bool)
  for bi in range(b):
    pad = int(rng.integers(1, s // 2))
    if kind == "left":
      mask[bi, :pad] = False
    elif kind == "right":
      mask[bi, s - pad:] = False
    elif kind == "holes":
      mask[bi] = rng.random(s) > 0.3
  if b > 1 and kind == "holes":
    mask[-1] = False  # a row with no real key at all
  return mask


# (name, B, T, S, N, K, H, mask kind, causal, block)
CASES = [
    ("self_left_gqa", 2, 37, 37, 4, 2, 8, "left", True, 16),
    ("self_right_mha", 2, 29, 29, 2, 2, 8, "right", True, 8),
    ("prefix_right", 2, 13, 40, 4, 1, 8, "right", True, 16),
    ("prefix_left_blocks", 2, 21, 45, 6, 3, 4, "left", True, (8, 16)),
    ("holes_noncausal", 3, 19, 33, 4, 2, 8, "holes", False, 8),
    ("holes_causal", 3, 33, 33, 4, 4, 8, "holes", True, (16, 8)),
    ("nomask", 1, 40, 40, 4, 2, 8, None, True, 16),
    ("decode", 2, 1, 24, 4, 2, 8, "right", True, 8),
]


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_values_and_grads(case, impl):
  _, b, t, s, n, kh, h, kind, causal, block = case
  q, k, v = make_inputs(sum(map(ord, case[0])), b, t, s, n, kh, h)
  mask = None if kind is None else padding_mask(b, s, kind)
  rng = np.random.default_rng(7)
  dout = rng.normal(size=(b, t, n, h)).astype(np.float32)
  dlse = rng.normal(size=(b, t, n)).astype(np.float32)
  key_mask = None if mask is None else jnp.asarray(mask)
  ref_out, ref_lse, ref_grads = np_attention(q, k, v, mask, causal, dout=dout)
  out, grads, out2, lse, grads2 = _all_outputs(
      q, k, v, key_mask, jnp.asarray(dout), jnp.asarray(dlse), causal=causal, impl=impl,
      block=block)
  np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)

  # attention_with_lse: values of both outputs and gradients with both cotangents.
  np.testing.assert_allclose(out2, ref_out, atol=2e-5, rtol=2e-5)
  no_key = ref_lse == attn.NO_KEY_LSE
  np.testing.assert_allclose(np.where(no_key, 0, lse), np.where(no_key, 0, ref_lse),
                             atol=2e-5, rtol=2e-5)
  assert np.all(np.asarray(lse)[no_key] == np.float32(attn.NO_KEY_LSE))
  _, _, ref_grads2 = np_attention(q, k, v, mask, causal, dout=dout, dlse=dlse)
  for got, want in zip(grads2, ref_grads2):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_hand_checked_fixture():
  # One head, H=1, scale 1: q = 1, k = (0, log 3, 0 [pad]), v = (10, 20, 99).
  q = jnp.ones((1, 2, 1, 1))
  k = jnp.array([0.0, np.log(3.0), 0.0]).reshape(1, 3, 1, 1)
  val = jnp.array([10.0, 20.0, 99.0]).reshape(1, 3, 1, 1)
  mask = jnp.array([[1, 1, 0]])
  for impl in ("xla", "blockwise"):
    out = _jit(lambda q, impl=impl: dot_product_attention(
        q, k, val, key_mask=mask, implementation=impl, block_size=1))(q)
    # query 0 (aligned to key 1) sees keys 0,1: weights 1/4, 3/4 -> 17.5; query 1 too.
    np.testing.assert_allclose(out[0, :, 0, 0], [17.5, 17.5], rtol=1e-6)
    _, lse = _jit(lambda q, impl=impl: attention_with_lse(
        q, k, val, key_mask=mask, implementation=impl))(q)
    np.testing.assert_allclose(lse[0, :, 0], [np.log(4.0)] * 2, rtol=1e-6)


def test_fully_masked_rows_are_zero_and_finite():
  q, k, v = make_inputs(1, 2, 16, 16, 4, 2, 8)
  mask = jnp.zeros((2, 16), bool)
  for impl in ("xla", "blockwise"):
    out, grads = _jit(jax.value_and_grad(
        lambda q, k, v, impl=impl: jnp.sum(dot_product_attention(
            q, k, v, key_mask=mask, implementation=impl, block_size=8) ** 2),
        argnums=(0, 1, 2)))(q, k, v)
    assert float(out) == 0.0
    for g in grads:
      assert np.all(np.asarray(g) == 0.0)


def test_explicit_query_offset_kv_cache_layout():
  # A fixed-size cache of 32 slots, slots [0, 10) written earlier, 5 new queries written
  # at [10, 15), slots >= 15 unwritten (invalid): query i sees slots <= 10 + i.
  b, t, s = 2, 5, 32
  q, k, v = make_inputs(3, b, t, s, 4, 2, 8)
  mask = np.zeros((b, s), bool)
  mask[:, :15] = True
  mask[0, :3] = False  # left padding of row 0's prompt
  ref, _, _ = np_attention(q, k, v, mask, True, offset=10)
  for impl in ("xla", "blockwise"):
    out = jax.jit(lambda q, k, v, off, impl=impl: dot_product_attention(
        q, k, v, key_mask=jnp.asarray(mask), implementation=impl, query_offset=off,
        block_size=8))(q, k, v, jnp.int32(10))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_permuting_padded_keys_changes_nothing():
  # Values at masked key positions never change outputs.
  q, k, v = make_inputs(4, 2, 24, 24, 4, 2, 8)
  mask = jnp.asarray(padding_mask(2, 24, "holes"))
  k2 = jnp.where(mask[:, :, None, None], k, 1e3)
  v2 = jnp.where(mask[:, :, None, None], v, -1e3)
  a = dot_product_attention(q, k, v, key_mask=mask, implementation="blockwise",
                            block_size=8)
  c = dot_product_attention(q, k2, v2, key_mask=mask, implementation="blockwise",
                            block_size=8)
  np.testing.assert_array_equal(a, c)


def test_jit_vmap_and_no_recompilation():
  q, k, v = make_inputs(5, 2, 20, 20, 4, 2, 8)
  mask = jnp.asarray(padding_mask(2, 20, "left"))
  ref = dot_product_attention(q, k, v, key_mask=mask, implementation="xla")

  @jax.jit
  def f(q, k, v, mask):
    return dot_product_attention(q, k, v, key_mask=mask, implementation="blockwise",
                                 block_size=8)

  np.testing.assert_allclose(f(q, k, v, mask), ref, atol=2e-5)
  q2, k2, v2 = make_inputs(6, 2, 20, 20, 4, 2, 8)
  f(q2, k2, v2, ~mask)
  assert f._cache_size() == 1

  grad_f = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(f(q, k, v, m) ** 2),
                            argnums=(0, 1, 2)))
  grad_f(q, k, v, mask)
  grad_f(q2, k2, v2, ~mask)
  assert grad_f._cache_size() == 1

  # vmap over a leading axis equals the per-slice calls.
  qs, ks, vs = (jnp.stack([a, b]) for a, b in ((q, q2), (k, k2), (v, v2)))
  masks = jnp.stack([mask, ~mask])
  batched = jax.vmap(f)(qs, ks, vs, masks)
  np.testing.assert_allclose(batched[0], ref, atol=2e-5)
  np.testing.assert_allclose(
      batched[1], dot_product_attention(q2, k2, v2, key_mask=~mask, implementation="xla"),
      atol=2e-5)


def test_bf16_inputs():
  q, k, v = make_inputs(8, 2, 24, 24, 4, 2, 16, dtype=jnp.bfloat16)
  mask = padding_mask(2, 24, "left")
  ref, _, _ = np_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                           v.astype(jnp.float32), mask, True)
  for impl in ("xla", "blockwise"):
    out = _jit(lambda q, k, v, impl=impl: dot_product_attention(
        q, k, v, key_mask=jnp.asarray(mask), implementation=impl, block_size=8))(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2)
    grads = _jit(jax.grad(lambda q, impl=impl: jnp.sum(dot_product_attention(
        q, k, v, key_mask=jnp.asarray(mask), implementation=impl,
        block_size=8).astype(jnp.float32))))(q)
    assert grads.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(grads, np.float32)))
    out32, lse = jax.eval_shape(lambda q, impl=impl: attention_with_lse(
        q, k, v, key_mask=jnp.asarray(mask), implementation=impl), q)
    assert out32.dtype == jnp.float32 and lse.dtype == jnp.float32


def test_merging_partial_results_with_lse():
  # Split the keys into two halves; the online-softmax merge equals the whole.
  q, k, v = make_inputs(9, 2, 16, 32, 4, 2, 8)
  mask = jnp.asarray(padding_mask(2, 32, "left"))
  full = dot_product_attention(q, k, v, key_mask=mask, is_causal=False,
                               implementation="xla")
  o1, l1 = attention_with_lse(q, k[:, :16], v[:, :16], key_mask=mask[:, :16],
                              is_causal=False, block_size=8)
  o2, l2 = attention_with_lse(q, k[:, 16:], v[:, 16:], key_mask=mask[:, 16:],
                              is_causal=False, block_size=8)
  m = jnp.maximum(l1, l2)
  w1, w2 = jnp.exp(l1 - m), jnp.exp(l2 - m)
  merged = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
  assert np.all(np.isfinite(merged))
  np.testing.assert_allclose(merged, full, atol=2e-5)


def test_selection_and_registry(monkeypatch):
  small = jax.ShapeDtypeStruct((1, 64, 4, 8), jnp.float32)
  big = jax.ShapeDtypeStruct((1, 4096, 4, 8), jnp.float32)
  assert attn.select_implementation(small, small) == "xla"
  assert attn.select_implementation(big, big) == "blockwise"

  calls = []

  def fake_ring(query, key, value, **kwargs):
    calls.append(kwargs)
    return jnp.zeros_like(query)

  monkeypatch.setitem(attn.ATTENTION_IMPLEMENTATIONS, "ring", fake_ring)
  assert attn.select_implementation(small, small) == "xla"  # no mesh: no ring
  mesh = jax.sharding.AbstractMesh((2,), ("sequence",))
  with jax.sharding.use_abstract_mesh(mesh):
    assert attn.select_implementation(small, small) == "ring"
    assert attn.select_implementation(small, small, query_offset=3) == "xla"
  q = jnp.ones((1, 4, 2, 8))
  out = dot_product_attention(q, q, q, implementation="ring")
  assert calls and float(jnp.sum(jnp.abs(out))) == 0.0


def test_cudnn_raises_clearly_off_gpu_or_unfit():
  q = jnp.ones((1, 8, 2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="cudnn"):
    dot_product_attention(q, q, q, key_mask=jnp.ones((1, 8)), implementation="cudnn")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="GPU"):
      dot_product_attention(q, q, q, implementation="cudnn")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_matches_numpy_values_and_grads_on_gpu(causal):
  # bf16 inputs (what cuDNN takes), GQA, T not a multiple of 64; float64 reference on
  # the bf16-rounded inputs, so the tolerance covers bf16 outputs and cuDNN's sums.
  b, t, n, kh, h = 2, 200, 8, 2, 64
  q, k, v = make_inputs(11, b, t, t, n, kh, h, dtype=jnp.bfloat16)
  assert attn.select_implementation(q, k, is_causal=causal) == "cudnn"
  dout = np.random.default_rng(3).normal(size=(b, t, n, h)).astype(np.float32)
  ref_out, _, ref_grads = np_attention(q, k, v, None, causal, dout=dout)
  fwd = lambda q, k, v: dot_product_attention(q, k, v, is_causal=causal,
                                              implementation="cudnn")
  out, vjp = jax.vjp(fwd, q, k, v)
  grads = vjp(jnp.asarray(dout, jnp.bfloat16))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2, rtol=2e-2)
  for got, want in zip(grads, ref_grads):
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, want / scale,
                               atol=2e-2)


@pytest.mark.parametrize("args, match", [
    (((1, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8), None), "`key`"),
    (((1, 4, 4, 8), (1, 4, 2, 4), (1, 4, 2, 4), None), "`key`"),
    (((1, 4, 4, 8), (1, 4, 2, 8), (1, 5, 2, 8), None), "`value`"),
    (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8), None), "multiple"),
    (((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8), (1, 5)), "`key_mask`"),
    (((4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8), None), "`query`"),
])
def test_bad_inputs(args, match):
  qs, ks, vs, ms = args
  mask = None if ms is None else jnp.ones(ms)
  with pytest.raises(ValueError, match=match) as info:
    dot_product_attention(jnp.ones(qs), jnp.ones(ks), jnp.ones(vs), key_mask=mask)
  assert "(" in str(info.value)  # names the shapes
  with pytest.raises(ValueError, match=match):
    attention_with_lse(jnp.ones(qs), jnp.ones(ks), jnp.ones(vs), key_mask=mask)


def test_bad_options():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="implementation"):
    dot_product_attention(q, q, q, implementation="nope")
  with pytest.raises(ValueError, match="block_size"):
    dot_product_attention(q, q, q, implementation="blockwise", block_size=0)
  with pytest.raises(ValueError, match="query_offset"):
    dot_product_attention(q, q, q, query_offset=jnp.zeros(2, jnp.int32))
