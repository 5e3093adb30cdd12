"""The loop's Policy generating through the rollout engine or the rectangular sampler."""

import jax
import numpy as np
import pytest

from jaxrl_llm.loop.policy import Policy

V, PAD, EOS = 24, 0, 2


def _policies():
  simple = Policy.reference("tiny", V, 16, PAD, value_head=True, seed=3, temperature=0.7)
  engine = Policy.reference("tiny", V, 16, PAD, value_head=True, seed=3, temperature=0.7)
  engine.use_engine(max_slots=4, max_len=16, page_size=4)
  return simple, engine


PROMPTS = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [0, 0, 0, 9, 8]], np.int32)
MASK = (np.arange(5)[None] >= np.array([[2], [0], [3]])).astype(np.float32)


def test_engine_greedy_equals_sample_greedy_in_groups():
  simple, engine = _policies()
  kw = dict(max_new_tokens=6, eos_id=EOS, greedy=True, n=2)
  a = simple.generate(simple.init_params, PROMPTS, MASK, None, **kw)
  b = engine.generate(engine.init_params, PROMPTS, MASK, None, **kw)
  assert np.asarray(a.tokens).shape == np.asarray(b.tokens).shape == (6, 11)
  for name in ("tokens", "mask", "completion", "completion_mask", "lengths", "finished"):
    np.testing.assert_array_equal(np.asarray(getattr(a, name)), getattr(b, name), name)
  np.testing.assert_allclose(np.asarray(a.logprobs), b.logprobs, atol=1e-5)
  # row i's samples are rows 2i, 2i+1, each with prompt i
  np.testing.assert_array_equal(b.tokens[:, :5], np.repeat(PROMPTS, 2, axis=0))


def test_engine_samples_carry_the_behaviour_logprobs_of_their_tokens():
  _, engine = _policies()
  out = engine.generate(engine.init_params, PROMPTS, MASK, jax.random.key(5),
                        max_new_tokens=6, eos_id=EOS, temperature=0.7, n=3)
  again = engine.generate(engine.init_params, PROMPTS, MASK, jax.random.key(5),
                          max_new_tokens=6, eos_id=EOS, temperature=0.7, n=3)
  np.testing.assert_array_equal(out.tokens, again.tokens)          # keyed by rng
  cmask = np.asarray(out.completion_mask)
  assert cmask.sum() > 6 and len(set(map(tuple, np.asarray(out.completion)[:3].tolist()))) > 1
  batch = {"tokens": out.tokens, "attention_mask": out.mask,
           "loss_mask": np.concatenate([np.zeros_like(MASK.repeat(3, 0)), cmask], 1)}
  logp, _, _ = engine.forward(engine.init_params, batch)
  np.testing.assert_allclose(np.asarray(logp)[:, 5:] * cmask, out.logprobs * cmask,
                             atol=1e-4)
  # no top-k / top-p: the filtered distribution is the full one
  np.testing.assert_allclose(out.sampling_logprobs, out.logprobs, atol=1e-6)
  assert np.all(out.logprobs[cmask == 0] == 0)


def test_use_engine_needs_the_paged_protocol():
  simple, _ = _policies()
  bare = Policy(simple.apply, simple.decode_fns, simple.init_params, pad_id=PAD)
  with pytest.raises(ValueError, match="paged_decode_fns"):
    bare.use_engine(max_slots=2, max_len=8)
