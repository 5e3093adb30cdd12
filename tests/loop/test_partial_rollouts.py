"""Partial rollouts in the rollout engine: token budgets, in-flight samples continued
under new parameters, per-token versions and behaviour log-probs."""

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
from jaxrl_llm.rollout import Request, RolloutEngine, filter_logits

V = 32
GRAPHDEF, PARAMS_A = split_model(Transformer(TransformerConfig.tiny(V), rngs=nnx.Rngs(0)))
# Another version of the same model: every weight moved by a seeded perturbation.
_leaves, _tree = jax.tree.flatten(PARAMS_A)
_noise = [np.random.default_rng(i).normal(size=x.shape).astype(np.float32)
          for i, x in enumerate(_leaves)]
PARAMS_B = jax.tree.unflatten(_tree, [x + 0.3 * np.std(np.asarray(x)) * n
                                      for x, n in zip(_leaves, _noise)])
PAGED = make_paged_decode_fns(GRAPHDEF)
_APPLY = jax.jit(make_apply_fn(GRAPHDEF))
KW = {"max_len": 48, "page_size": 4, "prefill_chunk": 8, "steps_per_call": 4}


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, V, n).tolist() for n in lengths]


# Prompts with a partial last page (6, 11) and a full one (4), shared by n samples,
# sampled, top-k and top-p filtered, one greedy request.
MIXED = [Request(p, n=n, max_new_tokens=m, temperature=t, top_k=k, top_p=tp, tag=i)
         for i, (p, n, m, t, k, tp) in enumerate(zip(
             _prompts(2, [6, 11, 4, 8]), [3, 1, 2, 1], [9, 14, 6, 12],
             [0.7, 1.3, 1.0, 0.0], [None, 5, None, None], [0.9, None, None, None]))]


def _same(a, b):
  return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)
          and np.array_equal(a.filtered_logprobs, b.filtered_logprobs)
          and a.finish_reason == b.finish_reason and a.request == b.request
          and a.sample == b.sample and a.tag == b.tag)


def _drain(engine, params, budget, version=0):
  out = []
  while engine.in_flight:
    out += engine.generate(params, [], token_budget=budget, version=version)
  return out


def _teacher_forced(params, prompt, tokens, temperature, top_k=None, top_p=None):
  """Full-forward log-probs of ``tokens`` after ``prompt`` under ``params``."""
  seq = np.asarray(list(prompt) + list(tokens), np.int32)[None]
  hidden, _, lm_head = _APPLY(params, seq)
  z = np.asarray(hidden[0] @ lm_head)[len(prompt) - 1:-1]
  tau = temperature if temperature > 0 else 1.0
  scaled = (z - z.max(-1, keepdims=True)) / tau
  full = np.asarray(jax.nn.log_softmax(scaled))
  filt = np.asarray(jax.nn.log_softmax(filter_logits(scaled, top_k=top_k, top_p=top_p)))
  idx = np.arange(len(tokens))
  return full[idx, tokens], filt[idx, tokens]


def test_budgeted_calls_equal_one_unbounded_call_bitwise_and_return_pages():
  whole = RolloutEngine(PAGED, max_slots=8, **KW).generate(PARAMS_A, MIXED, seed=3)
  engine = RolloutEngine(PAGED, max_slots=8, **KW)
  first = engine.generate(PARAMS_A, MIXED, seed=3, token_budget=10)
  # 7 samples in 8 slots, 4 steps per device call cut to ceil(10 / 7) = 2 steps: 14
  # tokens, nothing finished; the pages of the 7 samples stay.
  assert first == [] and engine.in_flight == 7
  assert engine.stats["generated_tokens"] == 14 and engine.stats["in_flight_after"] == 7
  assert engine.pages_in_use == engine.stats["pages_in_use_after"] > 0
  calls, out = 1, list(first)
  while engine.in_flight:
    out += engine.generate(PARAMS_A, [], token_budget=10)
    calls += 1
    assert engine.stats["generated_tokens"] < 10 + 8     # overshoot < live slots
  assert calls == 6 and len(out) == len(whole) == 7
  out.sort(key=lambda c: (c.request, c.sample))
  assert all(_same(a, b) for a, b in zip(whole, out))
  assert all(np.all(c.versions == 0) and len(c.versions) == len(c.tokens) for c in out)
  assert [c.tag for c in out] == [0, 0, 0, 1, 2, 2, 3]
  assert engine.pages_in_use == 0 and engine.stats["pages_reserved_after"] == 0
  assert engine._state is None                           # the device pool is freed


def test_new_requests_join_in_flight_samples_and_keep_their_own_seed():
  # Call 2 submits MIXED[1:3] under seed 9 while call 1's samples (seed 3) are in
  # flight: each completes as it would alone (keyed draws), call 1's finish first in
  # the returned order, and ``request`` indexes the submitting call's list.
  alone_1 = RolloutEngine(PAGED, max_slots=8, **KW).generate(PARAMS_A, MIXED[:1], seed=3)
  alone_2 = RolloutEngine(PAGED, max_slots=8, **KW).generate(PARAMS_A, MIXED[1:3],
                                                              seed=9)
  engine = RolloutEngine(PAGED, max_slots=8, **KW)
  out = engine.generate(PARAMS_A, MIXED[:1], seed=3, token_budget=5)
  out += engine.generate(PARAMS_A, MIXED[1:3], seed=9)
  assert engine.in_flight == 0 and engine.pages_in_use == 0
  assert [(c.request, c.sample, c.tag) for c in out] == [
      (0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 0, 1), (1, 0, 2), (1, 1, 2)]
  assert all(_same(a, b) for a, b in zip(alone_1 + alone_2, out))


@pytest.mark.parametrize("slots", [8, 3])
def test_tokens_carry_the_version_that_sampled_them_and_its_logprobs(slots):
  # Recompute (default): tokens tagged 0 were drawn from params A, tokens tagged 1
  # from params B given the whole prefix (the cache was prefilled again under B; with 8
  # slots its last rounds, a few long samples, run in 2 rows). With 3 slots samples
  # wait: their groups' prompts are prefilled again too.
  engine = RolloutEngine(PAGED, max_slots=slots, **KW)
  out = engine.generate(PARAMS_A, MIXED, seed=3, token_budget=20)
  assert engine.in_flight > 0
  out += engine.generate(PARAMS_B, [], version=1)
  assert engine.stats["recomputed_tokens"] > 0 and engine.in_flight == 0
  spans = 0
  for c in out:
    r = MIXED[c.request]
    v = c.versions
    assert len(v) == len(c.tokens) and set(v.tolist()) <= {0, 1}
    assert np.all(np.diff(v) >= 0)                 # a prefix of 0s, then 1s
    spans += int(v[0] == 0 and v[-1] == 1)
    for version, params in ((0, PARAMS_A), (1, PARAMS_B)):
      full, filt = _teacher_forced(params, r.prompt, c.tokens, r.temperature, r.top_k,
                                   r.top_p)
      at = v == version
      np.testing.assert_allclose(c.logprobs[at], full[at], rtol=1e-4, atol=1e-4)
      if r.temperature > 0:
        np.testing.assert_allclose(c.filtered_logprobs[at], filt[at], rtol=1e-4,
                                   atol=1e-4)
  assert spans >= {8: 4, 3: 2}[slots]              # several completions span A and B
  # The two versions differ: B's log-probs of the A-tagged tokens are not A's.
  c = out[0]
  full_b, _ = _teacher_forced(PARAMS_B, MIXED[0].prompt, c.tokens, MIXED[0].temperature,
                              top_p=MIXED[0].top_p)
  at = c.versions == 0
  assert np.max(np.abs(full_b[at] - c.logprobs[at])) > 1e-2


def test_keep_mode_is_deterministic_and_bitwise_unbounded_when_params_are_unchanged():
  def run(params_b):
    engine = RolloutEngine(PAGED, max_slots=8, on_new_version="keep", **KW)
    out = engine.generate(PARAMS_A, MIXED, seed=3, token_budget=20)
    out += engine.generate(params_b, [], version=1)
    assert "recomputed_tokens" not in engine.stats
    return sorted(out, key=lambda c: (c.request, c.sample))

  whole = RolloutEngine(PAGED, max_slots=8, **KW).generate(PARAMS_A, MIXED, seed=3)
  same = run(PARAMS_A)
  assert all(_same(a, b) for a, b in zip(whole, same))
  assert sum(int(np.any(c.versions == 1)) for c in same) >= 4
  mixed, again = run(PARAMS_B), run(PARAMS_B)
  assert all(_same(a, b) and np.array_equal(a.versions, b.versions)
             for a, b in zip(mixed, again))
  assert [c.versions.tolist() for c in mixed] == [c.versions.tolist() for c in same]


def test_recompute_with_unchanged_params_matches_the_unbounded_call():
  # A new version number with the same weights: the cache is prefilled again (another
  # computation order), so log-probs agree to rounding and the tokens are the same.
  whole = RolloutEngine(PAGED, max_slots=8, **KW).generate(PARAMS_A, MIXED, seed=3)
  engine = RolloutEngine(PAGED, max_slots=8, **KW)
  out = engine.generate(PARAMS_A, MIXED, seed=3, token_budget=20)
  out += engine.generate(PARAMS_A, [], version=1)
  out.sort(key=lambda c: (c.request, c.sample))
  for a, b in zip(whole, out):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_refill_after_changes_the_device_calls_not_the_samples():
  # 7 samples, 3 slots: samples wait. Returning after every finished slot (1) or after
  # 2 of them gives bitwise the same completions, in fewer, longer device calls with 2
  # (24 tokens: 24 decode steps in 5 calls at 1, 27 steps in 3 calls at 2).
  def run(refill_after):
    engine = RolloutEngine(PAGED, max_slots=3, refill_after=refill_after,
                           **{**KW, "steps_per_call": 16})
    out = engine.generate(PARAMS_A, MIXED, seed=5)
    return out, engine.stats["decode_calls"], engine.stats["decode_steps"]

  (eager, eager_calls, eager_steps), (lazy, lazy_calls, lazy_steps) = run(1), run(2)
  assert len(eager) == 7 and all(_same(a, b) for a, b in zip(eager, lazy))
  assert (eager_calls, eager_steps, lazy_calls, lazy_steps) == (5, 24, 3, 27)
  with pytest.raises(ValueError, match="`refill_after`"):
    RolloutEngine(PAGED, max_slots=3, refill_after=0, **KW)


def test_reset_drops_in_flight_samples_and_returns_their_pages():
  engine = RolloutEngine(PAGED, max_slots=4, **KW)   # 7 samples, 4 slots: some wait
  engine.generate(PARAMS_A, MIXED, seed=3, token_budget=6)
  assert engine.in_flight == 7 and engine.pages_in_use > 0
  assert engine.reset() == 7
  assert engine.in_flight == 0 and engine.pages_in_use == 0
  whole = RolloutEngine(PAGED, max_slots=4, **KW).generate(PARAMS_A, MIXED, seed=3)
  assert all(_same(a, b) for a, b in zip(whole, engine.generate(PARAMS_A, MIXED, seed=3)))


def test_waiting_samples_of_a_tight_pool_are_continued_too():
  # A 10-page pool holds one or two samples at a time; the budget cuts the rollout
  # while samples wait (their prompt prefilled or not): all complete bitwise.
  whole = RolloutEngine(PAGED, max_slots=8, **KW).generate(PARAMS_A, MIXED, seed=7)
  engine = RolloutEngine(PAGED, max_slots=8, num_pages=10, **KW)
  out = engine.generate(PARAMS_A, MIXED, seed=7, token_budget=7)
  assert engine.in_flight > 0
  out = sorted(out + _drain(engine, PARAMS_A, 7), key=lambda c: (c.request, c.sample))
  assert all(_same(a, b) for a, b in zip(whole, out))
  assert engine.pages_in_use == 0


def test_prompts_prefilled_ahead_wait_across_calls_and_are_recomputed():
  # 2 slots, 4 prefill rows: groups are prefilled ahead of their admission and wait
  # over budgeted calls with their prompt pages and logits. Same version: bitwise the
  # unbounded call; a new version prefills the waiting groups' prompts again (same
  # weights: same tokens, log-probs to rounding); every page comes back.
  kw = {**KW, "prefill_rows": 4, "num_pages": 40}   # room to prefill ahead
  whole = RolloutEngine(PAGED, max_slots=2, **kw).generate(PARAMS_A, MIXED, seed=3)
  engine = RolloutEngine(PAGED, max_slots=2, **kw)
  out = engine.generate(PARAMS_A, MIXED, seed=3, token_budget=6)
  assert engine.stats["prefill_ahead"] > 0 and engine.waiting > 0
  out = sorted(out + _drain(engine, PARAMS_A, 6), key=lambda c: (c.request, c.sample))
  assert all(_same(a, b) for a, b in zip(whole, out))
  assert engine.pages_in_use == 0 and engine._state is None
  out = engine.generate(PARAMS_A, MIXED, seed=3, token_budget=6)
  waiting = engine.waiting
  out = sorted(out + engine.generate(PARAMS_A, [], version=1),
               key=lambda c: (c.request, c.sample))
  assert waiting > 0 and engine.stats["recomputed_tokens"] > 0
  for a, b in zip(whole, out):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
  assert engine.pages_in_use == 0


def test_bad_budget_and_version_raise_naming_the_argument():
  engine = RolloutEngine(PAGED, max_slots=2, **KW)
  for bad in (0, -3, 1.5, True):
    with pytest.raises(ValueError, match="`token_budget`"):
      engine.generate(PARAMS_A, MIXED[:1], token_budget=bad)
  with pytest.raises(ValueError, match="`version`"):
    engine.generate(PARAMS_A, MIXED[:1], version="1")
  with pytest.raises(ValueError, match="`on_new_version`"):
    RolloutEngine(PAGED, max_slots=2, on_new_version="drop", **KW)
  assert engine.in_flight == 0
