"""Tests for paged attention, the paged decode protocol and the rollout engine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.attention import dot_product_attention, paged_attention
from jaxrl_llm.models import (
  Transformer,
  TransformerConfig,
  make_apply_fn,
  make_paged_decode_fns,
  split_model,
)

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


def test_ragged_paged_attention_matches_numpy_and_is_row_order_equivariant():
  # 20 rows (blocks of 8) with ragged lengths, padding rows and chunks of 8 keys:
  # chunk 0 is read in 3 blocks (17 rows), chunk 1 in one (6), chunks 2-3 by 3 and 2
  # rows. Each row against a plain NumPy softmax over its visible keys; permuting the
  # rows permutes the outputs bit for bit (jitted).
  rng = np.random.default_rng(4)
  b, n, k, h, t, page, pages = 20, 4, 2, 8, 2, 4, 90
  q = rng.normal(size=(b, t, n, h)).astype(np.float32)
  kp = rng.normal(size=(pages, page, k, h)).astype(np.float32)
  vp = rng.normal(size=(pages, page, k, h)).astype(np.float32)
  table = np.stack([rng.permutation(pages)[:8] for _ in range(b)]).astype(np.int32)
  last = np.array([31, 2, 17, -1, 9, 25, 0, -1, 12, 3, 5, 1, 7, 4, 6, 2, -1, 3, 11, 0])
  positions = np.where(last[:, None] >= 0, last[:, None] - 1 + np.arange(t), -1)
  positions[6] = [-1, 0]
  fn = jax.jit(lambda *a: paged_attention(*a, chunk_pages=2))
  out = np.asarray(fn(q, kp, vp, table, positions))
  g = n // k
  for row in range(b):
    for i in range(t):
      pos = positions[row, i]
      if pos < 0:
        assert np.all(out[row, i] == 0)
        continue
      keys = kp[table[row]].reshape(-1, k, h)[:pos + 1]
      vals = vp[table[row]].reshape(-1, k, h)[:pos + 1]
      for head in range(n):
        s = keys[:, head // g] @ q[row, i, head] / np.sqrt(h)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[row, i, head], (p / p.sum()) @ vals[:, head // g],
                                   rtol=2e-5, atol=2e-6)
  perm = rng.permutation(b)
  moved = np.asarray(fn(q[perm], kp, vp, table[perm], positions[perm]))
  assert np.array_equal(moved, out[perm])


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


# ----------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------

from jaxrl_llm.models import make_decode_fns  # noqa: E402
from jaxrl_llm.rollout import Request, RolloutEngine, filter_logits, sample  # noqa: E402

_ENGINE_KW = {"max_len": 48, "page_size": 4, "prefill_chunk": 8, "steps_per_call": 4}
ENGINE = RolloutEngine(PAGED, max_slots=8, **_ENGINE_KW)
_SAMPLE = jax.jit(functools.partial(sample, make_decode_fns(GRAPHDEF)),
                  static_argnames=("max_new_tokens", "greedy"))
_APPLY = jax.jit(make_apply_fn(GRAPHDEF))


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, V, n).tolist() for n in lengths]


def _sample_greedy(prompts, max_new):
  """``sample``'s greedy completions of left-padded prompts, one row each."""
  width = max(map(len, prompts))
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, width - len(prompt):] = prompt
  out = _SAMPLE(PARAMS, tokens, tokens > 0, None, max_new_tokens=max_new, greedy=True)
  return np.asarray(out.completion), np.asarray(out.logprobs)


def test_greedy_tokens_equal_sample_for_every_request():
  # Prompts longer than a prefill chunk (8) and than a page (4), one a multiple of
  # the page size; per-request lengths; n > 1 (greedy samples are all the same).
  prompts = _prompts(0, [3, 13, 8, 17, 1, 6])
  max_new = [12, 5, 9, 2, 7, 1]
  requests = [Request(p, n=2 if i == 1 else 1, max_new_tokens=m, temperature=0.0)
              for i, (p, m) in enumerate(zip(prompts, max_new))]
  out = ENGINE.generate(PARAMS, requests, seed=0)
  ref_tokens, ref_logps = _sample_greedy(prompts, max(max_new))
  assert [(c.request, c.sample) for c in out] == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0),
                                                 (4, 0), (5, 0)]
  for c in out:
    m = max_new[c.request]
    np.testing.assert_array_equal(c.tokens, ref_tokens[c.request, :m])
    np.testing.assert_allclose(c.logprobs, ref_logps[c.request, :m], rtol=1e-4,
                               atol=1e-4)
    assert c.finish_reason == "length" and np.all(c.filtered_logprobs == 0)
  assert ENGINE.stats["pages_in_use_after"] == 0
  assert ENGINE.stats["pages_reserved_after"] == 0


def test_eos_stops_a_sample_and_frees_its_pages():
  prompts = _prompts(1, [5, 9])
  ref, _ = _sample_greedy(prompts, 10)
  eos = int(ref[0, 3])
  first = int(np.nonzero(ref[0] == eos)[0][0])
  out = ENGINE.generate(PARAMS, [Request(prompts[0], max_new_tokens=10, temperature=0,
                                         eos_ids=(V + 5, eos)),
                                 Request(prompts[1], max_new_tokens=10, temperature=0)])
  np.testing.assert_array_equal(out[0].tokens, ref[0, :first + 1])
  assert out[0].finish_reason == "eos" and out[1].finish_reason == "length"
  np.testing.assert_array_equal(out[1].tokens, ref[1])
  assert ENGINE.stats["pages_in_use_after"] == 0


def _teacher_forced(prompt, tokens, temperature, top_k=None, top_p=None):
  """Full-forward log-probs of ``tokens`` after ``prompt``: full and filtered."""
  seq = np.asarray(list(prompt) + list(tokens), np.int32)[None]
  hidden, _, lm_head = _APPLY(PARAMS, seq)
  z = np.asarray(hidden[0] @ lm_head)[len(prompt) - 1:-1]
  scaled = (z - z.max(-1, keepdims=True)) / temperature
  full = np.asarray(jax.nn.log_softmax(scaled))
  filt = np.asarray(jax.nn.log_softmax(filter_logits(scaled, top_k=top_k, top_p=top_p)))
  idx = np.arange(len(tokens))
  return full[idx, tokens], filt[idx, tokens]


MIXED = [Request(p, n=n, max_new_tokens=m, temperature=t, top_k=k, top_p=tp)
         for p, n, m, t, k, tp in zip(
             _prompts(2, [6, 11, 4]), [3, 1, 2], [9, 14, 6], [0.7, 1.3, 1.0],
             [None, 5, None], [0.9, None, None])]


def test_sampled_logprobs_equal_teacher_forced_logprobs():
  out = ENGINE.generate(PARAMS, MIXED, seed=3)
  assert len(out) == 6
  for c in out:
    r = MIXED[c.request]
    assert len(c.tokens) == r.max_new_tokens
    full, filt = _teacher_forced(r.prompt, c.tokens, r.temperature, r.top_k, r.top_p)
    np.testing.assert_allclose(c.logprobs, full, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c.filtered_logprobs, filt, rtol=1e-4, atol=1e-4)
    if r.top_k is None and r.top_p is None:     # nothing filtered: the two agree
      np.testing.assert_allclose(c.filtered_logprobs, c.logprobs, rtol=1e-5, atol=1e-5)
  # The samples of a request differ (own keys), and a new seed changes them.
  assert not np.array_equal(out[0].tokens, out[1].tokens)
  again = ENGINE.generate(PARAMS, MIXED, seed=4)
  assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(out, again))


def _same(a, b):
  return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)
          and np.array_equal(a.filtered_logprobs, b.filtered_logprobs)
          and a.finish_reason == b.finish_reason)


def test_a_request_is_bitwise_the_same_alone_and_among_32_others():
  # Request 0 here is MIXED[0] (n=3, top_p). With 32 other requests (longer ones go
  # first under longest_first) its samples land in other slots at other times, next
  # to other rows, with other page ids; its tokens and log-probs are bit for bit equal.
  rng = np.random.default_rng(5)
  others = [Request(rng.integers(1, V, rng.integers(1, 12)).tolist(),
                    max_new_tokens=int(rng.integers(1, 20)),
                    temperature=float(rng.choice([0.0, 0.8, 1.0])),
                    top_p=float(rng.choice([0.5, 1.0]))) for _ in range(32)]
  alone = ENGINE.generate(PARAMS, MIXED[:1], seed=11)
  crowd = ENGINE.generate(PARAMS, MIXED[:1] + others, seed=11)
  assert ENGINE.stats["decode_calls"] > 10 and ENGINE.stats["pages_in_use_after"] == 0
  assert all(_same(a, b) for a, b in zip(alone, crowd[:3]))
  # Other slot counts are other shapes, so XLA may pick other matmul kernels: on CPU
  # (XLA:CPU, jax 0.10) 16 slots gave bitwise the same results as 8, while 1, 2, 4 and
  # 64 slots gave the same tokens with log-probs 1-2 ulp apart (<= 1.2e-6). With 2
  # slots the 3 samples of the request cannot all run at once (the prompt's pages are
  # held for the waiting sample).
  for slots in (2, 64):
    other = RolloutEngine(PAGED, max_slots=slots, **_ENGINE_KW)
    for a, b in zip(alone, other.generate(PARAMS, MIXED[:1], seed=11)):
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
      np.testing.assert_allclose(a.filtered_logprobs, b.filtered_logprobs, rtol=0,
                                 atol=1e-5)
    assert other.stats["pages_in_use_after"] == 0


def test_batched_prefill_is_bitwise_the_same_alone_and_among_others_in_any_row():
  # Prefill rows of 4 tokens, 3 per call: MIXED[0]'s 6-token prompt takes 2 rows, its
  # neighbours' prompts (1-19 tokens) up to 5, so across the orders below the prompt
  # lands in other rows of other calls, split over two calls or not, beside other
  # prompts or padding. Its tokens and log-probs stay bit for bit the same.
  engine = RolloutEngine(PAGED, max_slots=8, prefill_rows=3,
                         **{**_ENGINE_KW, "prefill_chunk": 4})
  rng = np.random.default_rng(8)
  others = [Request(rng.integers(1, V, rng.integers(1, 20)).tolist(),
                    max_new_tokens=int(rng.integers(1, 12)), temperature=1.0)
            for _ in range(12)]
  alone = engine.generate(PARAMS, MIXED[:1], seed=11)
  assert engine.stats["prefill_calls"] == 1 and engine.stats["prefill_rows_padded"] == 1
  for order in range(3):
    crowd = [others[k] for k in np.random.default_rng(order).permutation(12)]
    fifo = engine.replica(policy="fifo")       # MIXED[0] is admitted with the first
    for eng, requests in ((engine, MIXED[:1] + crowd[:4 * order + 3]),
                          (fifo, MIXED[:1] + crowd)):
      out = eng.generate(PARAMS, requests, seed=11)
      assert all(_same(a, b) for a, b in zip(alone, out[:3]))
      assert eng.stats["pages_in_use_after"] == 0
  # Another row count is another matmul shape: same tokens, log-probs within rounding.
  one = RolloutEngine(PAGED, max_slots=8, prefill_rows=1,
                      **{**_ENGINE_KW, "prefill_chunk": 4})
  for a, b in zip(alone, one.generate(PARAMS, MIXED[:1], seed=11)):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
  assert one.stats["prefill_calls"] == 2            # one row per call, 2 chunks


def test_prefill_calls_are_ceil_rows_over_prefill_rows():
  # N prompts of at most one chunk, all admitted at once: ceil(N / R) calls of R rows.
  for n, rows in ((8, 3), (8, 4), (5, 8), (1, 8)):
    engine = RolloutEngine(PAGED, max_slots=8, prefill_rows=rows, **_ENGINE_KW)
    prompts = _prompts(n, [int(k) for k in np.random.default_rng(n).integers(1, 9, n)])
    engine.generate(PARAMS, [Request(p, max_new_tokens=3) for p in prompts], seed=0)
    assert engine.stats["prefill_calls"] == -(-n // rows), (n, rows)
    assert engine.stats["prefill_rows_padded"] == -n % rows
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts))
    assert engine.stats["admit_calls"] == n and engine.stats["prefill_rows"] == rows
  # Longer prompts take ceil(p / c) rows each (c = 8): 13 + 17 + 8 + 3 -> 2 + 3 + 1 + 1
  # rows = 7 rows, 2 calls of 4; a shared prompt is prefilled once for its n samples.
  engine = RolloutEngine(PAGED, max_slots=8, prefill_rows=4, **_ENGINE_KW)
  prompts = _prompts(4, [13, 17, 8, 3])
  engine.generate(PARAMS, [Request(p, n=2, max_new_tokens=3) for p in prompts], seed=0)
  assert engine.stats["prefill_calls"] == 2 and engine.stats["prefill_rows_padded"] == 1
  assert engine.stats["prefill_tokens"] == 13 + 17 + 8 + 3
  # The default: each prompt alone (the earlier prefill); a replica keeps the setting.
  assert ENGINE.prefill_rows == 1 and ENGINE.replica(prefill_rows=2).prefill_rows == 2
  with pytest.raises(ValueError, match="`prefill_rows`"):
    RolloutEngine(PAGED, max_slots=8, prefill_rows=0, **_ENGINE_KW)


def test_free_prefill_rows_prefill_waiting_prompts_ahead_of_admission():
  # 2 slots, 4 rows per call, 6 one-sample requests of short prompts (longest_first
  # admits them in the order 1, 3, 5, 0, 4, 2): the first round admits 1 and 3 and
  # prefills 5 and 0 ahead in the same call; 4's round prefills 2 ahead: 2 calls for 6
  # prompts, and the same completions as each request alone.
  prompts = _prompts(6, [5, 3, 7, 2, 6, 4])
  requests = [Request(p, max_new_tokens=m, temperature=1.0)
              for p, m in zip(prompts, [4, 9, 2, 6, 3, 5])]
  engine = RolloutEngine(PAGED, max_slots=2, prefill_rows=4, **_ENGINE_KW)
  out = engine.generate(PARAMS, requests, seed=4)
  assert engine.stats["prefill_calls"] == 2 and engine.stats["prefill_ahead"] == 3
  assert engine.stats["prefill_rows_padded"] == 2
  assert engine.stats["prefill_tokens"] == sum(map(len, prompts))
  assert engine.stats["pages_in_use_after"] == 0
  assert engine.stats["pages_reserved_after"] == 0
  one_by_one = [engine.generate(PARAMS, [r], seed=4, first_request=i)[0]
                for i, r in enumerate(requests)]
  assert all(_same(a, b) for a, b in zip(out, one_by_one))
  # A pool without room for a prompt beside a full slot prefills nothing ahead.
  tight = RolloutEngine(PAGED, max_slots=2, prefill_rows=4, num_pages=14, **_ENGINE_KW)
  assert all(_same(a, b) for a, b in zip(out, tight.generate(PARAMS, requests, seed=4)))
  assert tight.stats["prefill_ahead"] == 0 and tight.stats["prefill_calls"] > 2


def test_decode_widths_run_the_live_slots_compacted_with_the_same_results():
  # 16 slots; a call with at most 8 live slots runs them as 8 rows (decode_widths).
  # XLA:CPU rounds a row the same at 8 and 16 rows (measured; not at 1, 2, 4 or 64:
  # the module docstring), so the results are bit for bit those of 16 rows always.
  rng = np.random.default_rng(6)
  requests = [Request(rng.integers(1, V, rng.integers(1, 12)).tolist(),
                      max_new_tokens=int(m), temperature=1.0)
              for m in [40] * 2 + [3] * 18]      # a tail of 2 long samples
  kw = {**_ENGINE_KW, "max_len": 60}
  full = RolloutEngine(PAGED, max_slots=16, **kw)
  reference = full.generate(PARAMS, requests, seed=2)
  bucketed = full.replica(decode_widths=(8,))
  assert bucketed.decode_widths == (8, 16)
  out = bucketed.generate(PARAMS, requests, seed=2)
  assert all(_same(a, b) for a, b in zip(reference, out))
  stats = bucketed.stats
  assert stats["decode_row_steps"] < 16 * stats["decode_steps"]
  assert stats["row_utilisation"] > full.stats["row_utilisation"]
  assert full.stats["decode_row_steps"] == 16 * full.stats["decode_steps"]
  assert stats["pages_in_use_after"] == 0
  with pytest.raises(ValueError, match="`decode_widths`"):
    RolloutEngine(PAGED, max_slots=4, decode_widths=(8,), **_ENGINE_KW)


def test_a_share_of_the_requests_draws_what_the_whole_call_draws():
  # Multi-host rollouts: a process completes requests [a, b) of a step with
  # first_request=a; its draws are keyed as in one call over all of them.
  whole = ENGINE.generate(PARAMS, MIXED, seed=3)
  first = sum(r.n for r in MIXED[:1])
  share = ENGINE.generate(PARAMS, MIXED[1:], seed=3, first_request=1)
  assert [c.request for c in share] == [c.request - 1 for c in whole[first:]]
  assert all(_same(a, b) for a, b in zip(whole[first:], share))
  unkeyed = ENGINE.generate(PARAMS, MIXED[1:], seed=3)    # request 0 of its own call
  assert any(not _same(a, b) for a, b in zip(whole[first:], unkeyed))
  with pytest.raises(ValueError, match="`first_request` must be an int >= 0"):
    ENGINE.generate(PARAMS, MIXED, first_request=-1)


def test_shared_prompt_equals_separate_prefills_and_a_tight_pool_waits():
  # share_prompts=False prefills the prompt once per sample: same keys, same results.
  # Prompt lengths 6 and 4: a partial last page (copied per sample) and a full one.
  shared = ENGINE.generate(PARAMS, MIXED, seed=7)
  stats = dict(ENGINE.stats)
  unshared_engine = RolloutEngine(PAGED, max_slots=8, share_prompts=False, **_ENGINE_KW)
  unshared = unshared_engine.generate(PARAMS, MIXED, seed=7)
  assert all(_same(a, b) for a, b in zip(shared, unshared))
  assert stats["prefill_tokens"] == 6 + 11 + 4
  assert unshared_engine.stats["prefill_tokens"] == 3 * 6 + 11 + 2 * 4
  # A pool of 10 pages holds one or two samples at a time: the rest wait for pages.
  tight = RolloutEngine(PAGED, max_slots=8, num_pages=10, **_ENGINE_KW)
  assert all(_same(a, b) for a, b in zip(shared, tight.generate(PARAMS, MIXED, seed=7)))
  assert tight.stats["peak_pages"] <= 10 and tight.stats["pages_in_use_after"] == 0


def test_bad_input_raises_naming_the_argument():
  with pytest.raises(ValueError, match="`prompt`"):
    Request([], max_new_tokens=3)
  with pytest.raises(ValueError, match="`n`"):
    Request([1], n=0, max_new_tokens=3)
  with pytest.raises(ValueError, match="`max_new_tokens`"):
    Request([1], max_new_tokens=0)
  with pytest.raises(ValueError, match="`temperature`"):
    Request([1], max_new_tokens=1, temperature=-1.0)
  with pytest.raises(ValueError, match="`top_p`"):
    Request([1], max_new_tokens=1, top_p=0.0)
  with pytest.raises(ValueError, match="`top_k`"):
    Request([1], max_new_tokens=1, top_k=0)
  with pytest.raises(ValueError, match="max_len"):
    ENGINE.generate(PARAMS, [Request([1] * 40, max_new_tokens=9)])
  small = RolloutEngine(PAGED, max_slots=2, max_len=48, page_size=4, num_pages=3)
  with pytest.raises(ValueError, match="num_pages"):
    small.generate(PARAMS, [Request([1] * 10, max_new_tokens=4)])
  with pytest.raises(ValueError, match="requests"):
    ENGINE.generate(PARAMS, [[1, 2, 3]])
  with pytest.raises(ValueError, match="max_slots"):
    RolloutEngine(PAGED, max_slots=0, max_len=8)
  with pytest.raises(ValueError, match="policy"):
    RolloutEngine(PAGED, max_slots=1, max_len=8, policy="random")


def test_prompt_ids_outside_the_vocabulary_raise_naming_request_and_position():
  # The embedding lookup clamps an id >= V to V - 1 (and a negative one wraps): the
  # engine refuses them before anything runs, naming the request and the position.
  ok = Request([1, 2], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"^`requests\[1\]\.prompt\[2\]` = 32 is outside "
                     r"the vocabulary \[0, 32\)\.$"):
    ENGINE.generate(PARAMS, [ok, Request([0, 31, V, 5], max_new_tokens=2)])
  with pytest.raises(ValueError, match=r"`requests\[0\]\.prompt\[1\]` = -1 is outside"):
    ENGINE.generate(PARAMS, [Request(np.array([3, -1]), max_new_tokens=2)])
  assert ENGINE.vocab_size(PARAMS) == V and ENGINE.replica().vocab_size(PARAMS) == V
  assert ENGINE.in_flight == 0
  assert len(ENGINE.generate(PARAMS, [Request([0, V - 1], max_new_tokens=2)])) == 1


@pytest.mark.slow   # importing torch + transformers dominates (~20 s on 2 cores)
@pytest.mark.parametrize("family", ["qwen3"])
def test_greedy_engine_equals_sample_on_a_tiny_hugging_face_checkpoint(family, tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  pytest.importorskip("safetensors")
  from jaxrl_llm.models import from_pretrained
  vocab = 64
  common = {"vocab_size": vocab, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "hidden_size": 32,
            "intermediate_size": 48, "tie_word_embeddings": False}
  config = (transformers.Qwen3Config(**common, head_dim=16) if family == "qwen3" else
            transformers.LlamaConfig(**common))
  torch.manual_seed(0)
  model_cls = (transformers.Qwen3ForCausalLM if family == "qwen3"
               else transformers.LlamaForCausalLM)
  hf = model_cls(config)
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
  hf.save_pretrained(tmp_path)
  graphdef, params = split_model(from_pretrained(tmp_path, dtype=jnp.float32))
  prompts = [np.random.default_rng(i).integers(1, vocab, n).tolist()
             for i, n in enumerate([7, 3, 10])]
  engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=2, **_ENGINE_KW)
  out = engine.generate(params, [Request(p, max_new_tokens=8, temperature=0)
                                 for p in prompts])
  for c, prompt in zip(out, prompts):
    ref = sample(make_decode_fns(graphdef), params, jnp.asarray([prompt]),
                 jnp.ones((1, len(prompt))), None, max_new_tokens=8, greedy=True)
    np.testing.assert_array_equal(c.tokens, np.asarray(ref.completion[0]))
    np.testing.assert_allclose(c.logprobs, np.asarray(ref.logprobs[0]), rtol=1e-4,
                               atol=1e-4)


def test_new_requests_do_not_recompile():
  # Other prompts, lengths, n, temperatures and seeds: the same compiled programs.
  from jaxrl_llm.rollout import engine as engine_module
  ENGINE.generate(PARAMS, MIXED[1:], seed=0)
  sizes = [f._cache_size() for f in (engine_module._prefill_jit, engine_module._admit_jit,
                                     engine_module._decode_jit)]
  ENGINE.generate(PARAMS, [Request(_prompts(9, [21])[0], n=5, max_new_tokens=20,
                                   temperature=0.5, top_k=3),
                           Request([3], max_new_tokens=1, temperature=0.0)], seed=5)
  assert [f._cache_size() for f in (engine_module._prefill_jit, engine_module._admit_jit,
                                    engine_module._decode_jit)] == sizes


def test_default_pool_runs_every_slot_at_max_len_with_prompts_of_their_own():
  """8 requests with distinct prompts of a partial last page, each to ``max_len``: each
  sample needs ``ceil(max_len / page) + 1`` pages (its prompt's last page is kept for
  copies), and the default pool holds all 8 at once: one wave of decode steps."""
  engine = RolloutEngine(PAGED, max_slots=8, **_ENGINE_KW)
  prompts = _prompts(3, [6] * 8)
  requests = [Request(p, max_new_tokens=48 - 6, temperature=0.0) for p in prompts]
  assert engine.pages_needed(requests[0]) == 48 // 4 + 1
  out = engine.generate(PARAMS, requests, seed=0)
  assert engine.stats["decode_steps"] == 48 - 6          # one wave, not two
  assert engine.num_pages == 8 * (48 // 4 + 1)
  ref, _ = _sample_greedy(prompts, 48 - 6)
  for c in out:
    np.testing.assert_array_equal(c.tokens, ref[c.request])
