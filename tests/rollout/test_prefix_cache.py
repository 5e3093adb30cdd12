"""The rollout engine's prefix cache (``RolloutEngine(prefix_cache=True)``) with the
built-in tiny model: a request that continues a finished sequence prefills only its
new tokens and generates what the same request prefilled from scratch generates
(greedy tokens equal, log-probs within float rounding, teacher-forced log-probs within
1e-4); a continued request is bitwise the same alone and among others; pages are never
read under other parameters; a tight pool evicts cached pages rather than waiting."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import (
    Transformer,
    TransformerConfig,
    make_apply_fn,
    make_paged_decode_fns,
    split_model,
)
from jaxrl_llm.rollout import Request, RolloutEngine

V = 32
GRAPHDEF, PARAMS = split_model(Transformer(TransformerConfig.tiny(V), rngs=nnx.Rngs(0)))
PAGED = make_paged_decode_fns(GRAPHDEF)
KW = {"max_slots": 8, "max_len": 64, "page_size": 4, "prefill_chunk": 8,
      "steps_per_call": 4}
_APPLY = jax.jit(make_apply_fn(GRAPHDEF))


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, V, n).tolist() for n in lengths]


def _continue(first, completions, seed, reply_lengths, **kwargs):
  """Each request's next turn: its prompt, its completion, then a reply."""
  replies = _prompts(seed, reply_lengths)
  return [Request(list(r.prompt) + c.tokens.tolist() + reply, **kwargs)
          for r, c, reply in zip(first, completions, replies)]


def _teacher_forced(prompt, tokens, temperature):
  seq = np.asarray(list(prompt) + list(tokens), np.int32)[None]
  hidden, _, lm_head = _APPLY(PARAMS, seq)
  z = np.asarray(hidden[0] @ lm_head)[len(prompt) - 1:-1] / temperature
  return np.asarray(jax.nn.log_softmax(z))[np.arange(len(tokens)), tokens]


def _same(a, b):
  return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)
          and np.array_equal(a.filtered_logprobs, b.filtered_logprobs)
          and a.finish_reason == b.finish_reason and a.cached_tokens == b.cached_tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_continued_request_equals_it_prefilled_from_scratch(temperature):
  cached, fresh = RolloutEngine(PAGED, prefix_cache=True, **KW), RolloutEngine(PAGED, **KW)
  first = [Request(p, max_new_tokens=m, temperature=temperature)
           for p, m in zip(_prompts(0, [5, 13, 8]), [6, 9, 4])]
  out = cached.generate(PARAMS, first, seed=1)
  # 5 + 6 - 1, 13 + 9 - 1, 8 + 4 - 1 tokens in the cache: 2, 5 and 2 full pages.
  assert cached.stats["prefix_cached_pages"] == 9 and cached.stats["pages_in_use_after"] == 9
  assert cached.stats["prefill_tokens"] == 26 and cached.stats["prefix_reused_tokens"] == 0
  second = _continue(first, out, 2, [3, 1, 6], max_new_tokens=8, temperature=temperature)
  a = cached.generate(PARAMS, second, seed=3)
  b = fresh.generate(PARAMS, second, seed=3)
  assert [c.cached_tokens for c in a] == [8, 20, 8] and [c.cached_tokens for c in b] == [0] * 3
  assert cached.stats["prefix_reused_tokens"] == 36 and cached.stats["prefix_hits"] == 3
  assert cached.stats["prefill_tokens"] + 36 == fresh.stats["prefill_tokens"] == 55
  for r, x, y in zip(second, a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    # Other prefill chunks (from the cached prefix on, not from 0) and keys written
    # by decode steps: a few float32 ulps (measured <= 1e-6 here).
    np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=2e-6)
    tf = _teacher_forced(r.prompt, x.tokens, temperature or 1.0)
    np.testing.assert_allclose(x.logprobs, tf, rtol=1e-4, atol=1e-4)


def test_a_continued_request_is_bitwise_the_same_alone_and_among_others():
  alone, crowd = (RolloutEngine(PAGED, prefix_cache=True, num_pages=160, **KW)
                  for _ in range(2))
  rng = np.random.default_rng(5)

  def others(n):
    return [Request(rng.integers(1, V, rng.integers(2, 20)).tolist(),
                    max_new_tokens=int(rng.integers(1, 12)),
                    temperature=float(rng.choice([0.0, 1.0])), top_p=0.9)
            for _ in range(n)]

  x = [Request(_prompts(6, [11])[0], n=2, max_new_tokens=7, temperature=1.0, top_p=0.9)]
  crowd_first = others(12)
  x_alone = alone.generate(PARAMS, x, seed=4)
  out = crowd.generate(PARAMS, x + crowd_first, seed=4)
  assert all(_same(a, b) for a, b in zip(x_alone, out[:2]))
  # Each sample continues its own sequence (the samples share the prompt's pages).
  nxt = _continue(x * 2, x_alone, 7, [5, 2], max_new_tokens=9, temperature=1.0,
                  top_p=0.9)
  more = _continue(crowd_first, out[2:], 8, [3] * 12, max_new_tokens=5, temperature=0.0)
  a = alone.generate(PARAMS, nxt, seed=9)
  b = crowd.generate(PARAMS, nxt + more + others(6), seed=9)    # the same request indices
  assert [c.cached_tokens for c in a] == [16, 16] and alone.stats["prefix_hits"] == 2
  assert crowd.stats["prefix_hits"] == 14 and crowd.stats["prefix_evictions"] == 0
  assert all(_same(p, q) for p, q in zip(a, b[:2]))


def test_pages_are_never_read_under_other_parameters_or_another_version():
  engine = RolloutEngine(PAGED, prefix_cache=True, **KW)
  first = [Request(_prompts(10, [9])[0], max_new_tokens=8, temperature=0.0)]
  out = engine.generate(PARAMS, first, seed=0)
  second = _continue(first, out, 11, [2], max_new_tokens=3, temperature=0.0)
  # The same leaves in another container: the same parameters, the cache is read.
  engine.generate(jax.tree.map(lambda x: x, PARAMS), second, seed=0)
  assert engine.stats["prefix_reused_tokens"] == 16
  assert engine.stats["prefix_dropped_pages"] == 0
  # Equal values in new arrays are other parameters as far as the engine knows.
  copied = jax.tree.map(lambda x: x + 0, PARAMS)
  engine.generate(copied, second, seed=0)
  assert engine.stats["prefix_dropped_pages"] == 5     # of 19 + 3 - 1 = 21 tokens cached
  assert engine.stats["prefix_reused_tokens"] == 0 and engine.stats["prefix_hits"] == 0
  engine.generate(copied, second, seed=0)
  assert engine.stats["prefix_reused_tokens"] == 16
  # A new version empties it too.
  engine.generate(copied, second, seed=0, version=1)
  assert engine.stats["prefix_dropped_pages"] == 5 and engine.stats["prefix_reused_tokens"] == 0
  assert engine.reset() == 0 and engine.pages_in_use == 0


def test_a_tight_pool_evicts_cached_pages_and_nothing_waits_for_them():
  # 24 pages of 4 tokens for 8 slots: unrelated prompts (no hits) whose finished
  # sequences fill the pool. Admission evicts cached pages instead of waiting: the
  # same device calls and bit-for-bit the completions of the engine without a cache.
  rng = np.random.default_rng(12)
  requests = [Request(rng.integers(1, V, rng.integers(3, 12)).tolist(),
                      max_new_tokens=int(rng.integers(4, 16)), temperature=1.0)
              for _ in range(24)]
  cached = RolloutEngine(PAGED, prefix_cache=True, num_pages=24, **KW)
  plain = RolloutEngine(PAGED, num_pages=24, **KW)
  a, b = cached.generate(PARAMS, requests, seed=2), plain.generate(PARAMS, requests, seed=2)
  assert all(_same(x, y) for x, y in zip(a, b))
  assert cached.stats["prefix_evictions"] > 0 and cached.stats["prefix_hits"] == 0
  for name in ("decode_calls", "decode_steps", "prefill_calls", "peak_pages"):
    assert cached.stats[name] == plain.stats[name], name
  assert cached.stats["prefix_cached_pages"] == cached.stats["pages_in_use_after"] <= 24


def test_off_by_default_no_counters_and_an_empty_engine_frees_its_pool():
  engine = RolloutEngine(PAGED, **KW)
  assert engine.prefix_cache is False and engine.replica(prefix_cache=True).prefix_cache
  engine.generate(PARAMS, [Request([1, 2, 3, 4, 5], max_new_tokens=6)], seed=0)
  assert not [k for k in engine.stats if k.startswith("prefix")]
  assert engine.stats["pages_in_use_after"] == 0 and engine._state is None
  with pytest.raises(ValueError, match="prefix_cache"):
    RolloutEngine(PAGED, prefix_cache=1, **KW)


@pytest.mark.parametrize("kv, cached_pages", [("keep", 0), ("recompute", 5)])
def test_a_sample_in_flight_across_versions_is_cached_only_if_recomputed(kv, cached_pages):
  engine = RolloutEngine(PAGED, prefix_cache=True, on_new_version=kv, **KW)
  request = Request(_prompts(13, [10])[0], max_new_tokens=12, temperature=0.0)
  assert engine.generate(PARAMS, [request], seed=0, token_budget=4, version=0) == []
  (done,) = engine.generate(PARAMS, [], seed=0, version=1)
  assert len(done.tokens) == 12 and engine.stats["prefix_cached_pages"] == cached_pages
