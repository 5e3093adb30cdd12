"""Tests for paged attention, the paged decode protocol and the rollout engine."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.attention import dot_product_attention, paged_attention
from jaxrl_llm.models import (Transformer, TransformerConfig, make_apply_fn,
                              make_paged_decode_fns, split_model)

V = 32
GRAPHDEF, PARAMS = split_model(Transformer(TransformerConfig.tiny(V), rngs=nnx.Rngs(0)))
PAGED = make_paged_decode_fns(GRAPHDEF)


def _scatter_to_pages(rng, dense, ids, num_pages):
  """Dense ``[B, S, K, H]`` into a random pool at page table ``ids`` ``[B, M]``."""
  page = -(-dense.shape[1] // ids.shape[1])
  pool = rng.normal(size=(num_pages, page) + dense.shape[2:]).astype(np.float32)
  for row in range(dense.shape[0]):
    for j in range(dense.shape[1]):
      pool[ids[row, j // page], j % page] = dense[row, j]
  return pool


@pytest.mark.parametrize("chunk_pages", [1, 3, None])
def test_paged_attention_matches_dense(chunk_pages):
  rng = np.random.default_rng(0)
  b, s, n, k, h, t = 3, 23, 4, 2, 8, 3
  q = rng.normal(size=(b, t, n, h)).astype(np.float32)
  keys = rng.normal(size=(b, s, k, h)).astype(np.float32)
  vals = rng.normal(size=(b, s, k, h)).astype(np.float32)
  ids = rng.permutation(20)[:b * 6].reshape(b, 6)       # 6 pages of 4 hold 23 keys
  kp = _scatter_to_pages(rng, keys, ids, 20)
  vp = _scatter_to_pages(rng, vals, ids, 20)
  lengths = np.array([23, 9, 3])
  positions = lengths[:, None] - t + np.arange(t)[None]     # the last t tokens
  positions[2, 0] = -1                                      # a padded query
  out = paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp),
                        jnp.asarray(ids), jnp.asarray(positions), chunk_pages=chunk_pages)
  for row in range(b):
    length = lengths[row]
    ref = dot_product_attention(q[row:row + 1], keys[row:row + 1, :length],
                                vals[row:row + 1, :length], is_causal=True,
                                implementation="xla")
    real = positions[row] >= 0
    np.testing.assert_allclose(np.asarray(out)[row][real], np.asarray(ref)[0][real],
                               rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[2, 0] == 0)                 # padding: 0, not NaN


def test_paged_attention_row_is_independent_of_other_rows_lengths():
  # The chunk loop runs to the longest row; the extra chunks must leave a short row's
  # result bit for bit unchanged.
  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, 1, 2, 8)).astype(np.float32)
  kp = rng.normal(size=(16, 4, 1, 8)).astype(np.float32)
  vp = rng.normal(size=(16, 4, 1, 8)).astype(np.float32)
  table = rng.permutation(16).reshape(2, 8)
  short = paged_attention(q, kp, vp, table, np.array([[5], [6]]), chunk_pages=2)
  long = paged_attention(q, kp, vp, table, np.array([[5], [30]]), chunk_pages=2)
  assert np.array_equal(np.asarray(short)[0], np.asarray(long)[0])


def test_paged_attention_errors():
  q, pool, table = jnp.zeros((1, 1, 4, 8)), jnp.zeros((4, 2, 2, 8)), jnp.zeros((1, 2), int)
  with pytest.raises(ValueError, match="k_pages"):
    paged_attention(q, jnp.zeros((4, 2, 3, 8)), pool, table, jnp.zeros((1, 1), int))
  with pytest.raises(ValueError, match="positions"):
    paged_attention(q, pool, pool, table, jnp.zeros((2, 1), int))
  with pytest.raises(ValueError, match="chunk_pages"):
    paged_attention(q, pool, pool, table, jnp.zeros((1, 1), int), chunk_pages=0)


def test_paged_forward_chunks_and_steps_match_the_full_forward():
  # A 13-token sequence as a 7-token chunk (padded to 8), a 4-token chunk and two
  # decode steps, on scattered pages of 4 tokens, equals the full forward's logits.
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, V, 13).astype(np.int32)
  hidden, _, lm_head = make_apply_fn(GRAPHDEF)(PARAMS, tokens[None])
  ref = np.asarray(hidden[0] @ lm_head)
  pages = PAGED.init_pages(PARAMS, 9, 4)
  table = jnp.array([[7, 2, 5, 0]])
  forward = jax.jit(PAGED.forward)
  got = []
  for start, stop, width in ((0, 7, 8), (7, 11, 4), (11, 12, 1), (12, 13, 1)):
    chunk = np.zeros((1, width), np.int32)
    pos = np.full((1, width), -1, np.int32)
    chunk[0, :stop - start] = tokens[start:stop]
    pos[0, :stop - start] = np.arange(start, stop)
    logits, pages = forward(PARAMS, chunk, pos, table, pages)
    got.append(np.asarray(logits[0]))
  np.testing.assert_allclose(np.stack(got), ref[[6, 10, 11, 12]], rtol=1e-4, atol=1e-5)
  # Untouched pages stay zero (padding writes were dropped).
  assert all(float(jnp.abs(k[np.array([1, 3, 4, 6, 8])]).max()) == 0 for k, _ in pages)
