"""Tests for the KV-cache sampler (jaxrl_llm.rollout.sampler)."""

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

from jaxrl_llm.models.transformer import (
  DecodeFns,
  Transformer,
  TransformerConfig,
  make_apply_fn,
  make_decode_fns,
  split_model,
)
from jaxrl_llm.rollout.sampler import SampleOutput, filter_logits, sample
from tests.utils import assert_close

# These tests check values, not speed: skipping XLA's backend optimisation roughly
# halves CPU compile time, which dominates this file's wall time.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

V = 32
B, P, N = 3, 5, 6
GRAPHDEF, PARAMS = split_model(Transformer(TransformerConfig.tiny(V), rngs=nnx.Rngs(0)))
FNS = make_decode_fns(GRAPHDEF)
_SAMPLE = _jit(functools.partial(sample, FNS),
                  static_argnames=("max_new_tokens", "top_k", "greedy"))
_APPLY = _jit(make_apply_fn(GRAPHDEF))

PROMPTS = np.random.default_rng(0).integers(1, V, (B, P)).astype(np.int32)
LEFT_MASK = (np.arange(P)[None] >= P - np.array([5, 3, 1])[:, None]).astype(np.float32)
PROMPTS = PROMPTS * LEFT_MASK.astype(np.int32)   # left-padded with id 0


def run(prompts=PROMPTS, mask=LEFT_MASK, rng=0, *, greedy=False, top_k=None,
        temperature=None, top_p=None, eos_id=-1, pad_id=0):
  """The jitted sampler with stable static structure (eos_id=-1 never matches).

  Greedy calls use a scalar temperature; sampled calls always pass [B] temperature and
  top_p so all of them share one compilation per ``top_k``.
  """
  if greedy:
    temperature = 1.0 if temperature is None else temperature
  else:
    temperature = np.broadcast_to(np.float32(1.0 if temperature is None else temperature),
                                  (B,)).astype(np.float32)
    top_p = np.broadcast_to(np.float32(1.0 if top_p is None else top_p),
                            (B,)).astype(np.float32)
  out = _SAMPLE(PARAMS, prompts, mask, jax.random.key(rng), max_new_tokens=N,
                temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                eos_id=eos_id, pad_id=pad_id)
  return SampleOutput(*(np.asarray(x) for x in out))


def full_logits(tokens, mask):
  """[B, T, V] float32 logits of a full (no-cache) forward."""
  hidden, _, lm_head = _APPLY(PARAMS, tokens, None, mask)
  return np.asarray(hidden @ lm_head, np.float64)


def log_softmax(z):
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def greedy_no_cache(prompts, mask):
  """Reference: argmax decoding that recomputes the full forward at every step."""
  tokens = np.concatenate([prompts, np.zeros((B, N), np.int32)], axis=1)
  full_mask = np.concatenate([mask, np.zeros((B, N), np.float32)], axis=1)
  logps = np.zeros((B, N))
  for n in range(N):
    logits = full_logits(tokens, full_mask)[:, P + n - 1]
    tokens[:, P + n] = logits.argmax(-1)
    full_mask[:, P + n] = 1
    logps[:, n] = log_softmax(logits)[np.arange(B), tokens[:, P + n]]
  return tokens[:, P:], logps


GREEDY_REF = greedy_no_cache(PROMPTS, LEFT_MASK)


def rescored_logprobs(out, temperature):
  """Train-side log-probs of ``out.completion`` from a full forward of ``out.tokens``."""
  logits = full_logits(out.tokens, out.mask)[:, P - 1:-1] / np.reshape(temperature,
                                                                       (-1, 1, 1))
  return np.take_along_axis(log_softmax(logits), out.completion[..., None], -1)[..., 0]


# ----------------------------------------------------------------------------------
# Greedy == no-cache argmax, padding layouts, EOS
# ----------------------------------------------------------------------------------


def test_greedy_matches_no_cache_argmax_decoding():
  out = run(greedy=True)
  ref_tokens, ref_logps = GREEDY_REF
  np.testing.assert_array_equal(out.completion, ref_tokens)
  np.testing.assert_array_equal(out.tokens, np.concatenate([PROMPTS, ref_tokens], 1))
  assert_close(out.logprobs, ref_logps, atol=1e-4)
  np.testing.assert_array_equal(out.completion_mask, 1.0)
  np.testing.assert_array_equal(out.mask, np.concatenate([LEFT_MASK, np.ones((B, N))], 1))
  np.testing.assert_array_equal(out.lengths, N)
  assert not out.finished.any()
  assert out.tokens.dtype == np.int32 and out.logprobs.dtype == np.float32


def test_greedy_unchanged_with_blockwise_attention():
  cfg = TransformerConfig.tiny(V, attention="blockwise", attention_block_size=4)
  graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
  out = _jit(functools.partial(sample, make_decode_fns(graphdef)),
             static_argnames=("max_new_tokens", "greedy"))(
      params, PROMPTS, LEFT_MASK, jax.random.key(0), max_new_tokens=N, greedy=True)
  ref_tokens, ref_logps = GREEDY_REF
  np.testing.assert_array_equal(np.asarray(out.completion), ref_tokens)
  assert_close(np.asarray(out.logprobs), ref_logps, atol=1e-4)


def test_right_padded_prompts_give_the_same_completion():
  right_prompts = np.zeros_like(PROMPTS)
  right_mask = np.zeros_like(LEFT_MASK)
  for b in range(B):
    real = PROMPTS[b, LEFT_MASK[b] > 0]
    right_prompts[b, :len(real)] = real
    right_mask[b, :len(real)] = 1
  out = run(right_prompts, right_mask, greedy=True)
  np.testing.assert_array_equal(out.completion, GREEDY_REF[0])
  assert_close(out.logprobs, GREEDY_REF[1], atol=1e-4)
  # Shift-by-one re-scoring is right except at the first completion token of rows
  # whose prompt does not end at column P - 1 (documented: use left padding to train).
  rescored = rescored_logprobs(out, 1.0)
  assert_close(rescored[:, 1:], out.logprobs[:, 1:], atol=1e-4)
  assert_close(rescored[0, 0], out.logprobs[0, 0], atol=1e-4)
  assert_close(rescored[1:, 0], -np.log(V), atol=1e-5)   # zero hidden at a pad


def test_eos_stops_each_row_and_masks_the_rest():
  ref_tokens, ref_logps = GREEDY_REF
  eos = int(ref_tokens[0, 2])
  pad = V - 1
  out = run(greedy=True, eos_id=eos, pad_id=pad)
  for b in range(B):
    hits = np.nonzero(ref_tokens[b] == eos)[0]
    length = hits[0] + 1 if len(hits) else N
    np.testing.assert_array_equal(out.completion[b, :length], ref_tokens[b, :length])
    np.testing.assert_array_equal(out.completion[b, length:], pad)
    np.testing.assert_array_equal(out.completion_mask[b], np.arange(N) < length)
    assert_close(out.logprobs[b, :length], ref_logps[b, :length], atol=1e-4)
    np.testing.assert_array_equal(out.logprobs[b, length:], 0.0)
    assert out.lengths[b] == length
    assert out.finished[b] == bool(len(hits))
  assert out.lengths[0] <= 3 and out.finished[0]


def test_each_of_several_eos_ids_stops_a_row():
  """Two eos ids (as Llama-3's generation config gives): row 0 stops at the first,
  row 1 at the second; a list, a tuple and an int array give the same result."""
  ref_tokens, ref_logps = GREEDY_REF
  eos_a, eos_b = int(ref_tokens[0, 1]), int(ref_tokens[1, 2])
  assert eos_a != eos_b
  outs = [run(greedy=True, eos_id=ids, pad_id=V - 1)
          for ids in ([eos_a, eos_b], (eos_a, eos_b), np.array([eos_a, eos_b]))]
  for out in outs:
    for b in range(B):
      hits = np.nonzero(np.isin(ref_tokens[b], [eos_a, eos_b]))[0]
      length = hits[0] + 1 if len(hits) else N
      np.testing.assert_array_equal(out.completion[b, :length], ref_tokens[b, :length])
      np.testing.assert_array_equal(out.completion[b, length:], V - 1)
      assert out.lengths[b] == length and out.finished[b] == bool(len(hits))
      assert_close(out.logprobs[b, :length], ref_logps[b, :length], atol=1e-4)
    assert out.lengths[0] <= 2 and out.lengths[1] <= 3 and out.finished[:2].all()
    np.testing.assert_array_equal(out.completion, outs[0].completion)
  last = outs[0].completion[np.arange(B), outs[0].lengths - 1]
  assert (int(last[0]), int(last[1])) == (eos_a, eos_b)    # each id stopped a row


def test_all_rows_finish_at_the_first_token():
  """Every row emits EOS at step 0: the loop exits at once, everything after is pad."""
  first = GREEDY_REF[0][:, 0]
  prompts = np.repeat(PROMPTS[:1], B, axis=0)
  mask = np.repeat(LEFT_MASK[:1], B, axis=0)
  out = run(prompts, mask, greedy=True, eos_id=int(first[0]))
  np.testing.assert_array_equal(out.lengths, 1)
  np.testing.assert_array_equal(out.completion[:, 1:], 0)
  assert out.finished.all()


# ----------------------------------------------------------------------------------
# Sampled log-probs, filters, temperature
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, 1])
def test_sampled_logprobs_match_full_forward_log_softmax(top_k):
  temperature = np.array([0.7, 1.0, 1.3], np.float32)
  out = run(rng=3, temperature=temperature, top_p=0.9, top_k=top_k, eos_id=5)
  ref = rescored_logprobs(out, temperature)
  assert_close(out.logprobs * out.completion_mask, ref * out.completion_mask, atol=1e-4)
  np.testing.assert_array_equal(out.logprobs[out.completion_mask == 0], 0.0)
  assert np.all(out.logprobs <= 0)
  # Mask: ones up to and including the first EOS, zeros after.
  for b in range(B):
    hits = np.nonzero(out.completion[b] == 5)[0]
    length = hits[0] + 1 if len(hits) else N
    np.testing.assert_array_equal(out.completion_mask[b], np.arange(N) < length)


@pytest.mark.parametrize("top_k", [None, 3])
def test_sampling_logprobs_are_those_of_the_filtered_distribution(top_k):
  temperature = np.array([0.7, 1.0, 1.3], np.float32)
  top_p = np.array([0.6, 1.0, 0.8], np.float32)
  out = run(rng=5, temperature=temperature, top_p=top_p, top_k=top_k)
  logits = full_logits(out.tokens, out.mask)[:, P - 1:-1] / temperature[:, None, None]
  kept = np.stack([np.asarray(filter_logits(jnp.asarray(logits[:, n], jnp.float32),
                                            top_k=top_k, top_p=top_p)) > -1e29
                   for n in range(N)], axis=1)
  ref = np.where(kept, logits, -np.inf)
  ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - ref.max(-1, keepdims=True)
  ref = np.take_along_axis(ref, out.completion[..., None], -1)[..., 0]
  assert_close(out.sampling_logprobs, ref, atol=1e-4)
  assert np.all(out.sampling_logprobs >= out.logprobs - 1e-5)  # renormalised over fewer
  if top_k is None:   # row 1 has no filter at all: same as the full distribution
    assert_close(out.sampling_logprobs[1], out.logprobs[1], atol=1e-5)
  greedy = run(greedy=True)
  np.testing.assert_array_equal(greedy.sampling_logprobs, 0.0)


def test_top_k_one_and_tiny_top_p_equal_greedy():
  ref_tokens, ref_logps = GREEDY_REF
  for out in (run(rng=1, top_k=1), run(rng=2, top_p=1e-6)):
    np.testing.assert_array_equal(out.completion, ref_tokens)
    # log-probs are the full (unfiltered) distribution's, not 0 = log(1)
    assert_close(out.logprobs, ref_logps, atol=1e-4)
    assert np.all(out.logprobs < 0)


def test_zero_or_tiny_temperature_is_greedy_and_finite():
  out = run(rng=4, temperature=np.array([0.0, 1e-7, 1.0], np.float32))
  np.testing.assert_array_equal(out.completion[:2], GREEDY_REF[0][:2])
  assert np.all(np.isfinite(out.logprobs))
  assert_close(out.logprobs[:2], 0.0, atol=1e-4)


def test_determinism_and_rng_dependence():
  a, b, c = run(rng=7), run(rng=7), run(rng=8)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.completion, c.completion)


def test_top_p_sampling_frequencies():
  """First-token frequencies follow the renormalised nucleus of the model's distribution."""
  prompts = np.repeat(PROMPTS[:1], B, axis=0)
  mask = np.repeat(LEFT_MASK[:1], B, axis=0)
  logits = full_logits(np.concatenate([prompts, np.zeros((B, N), np.int32)], 1),
                       np.concatenate([mask, np.zeros((B, N), np.float32)], 1))[0, P - 1]
  probs = np.exp(log_softmax(logits))
  order = np.argsort(-probs)
  keep = np.zeros(V, bool)
  keep[order[(np.cumsum(probs[order]) - probs[order]) < 0.8]] = True
  nucleus = np.where(keep, probs, 0) / probs[keep].sum()
  draws = np.concatenate([run(prompts, mask, rng=100 + i, top_p=0.8).completion[:, 0]
                          for i in range(150)])
  assert keep.sum() >= 3 and set(draws) <= set(np.nonzero(keep)[0])
  freq = np.bincount(draws, minlength=V) / len(draws)
  sigma = np.sqrt(nucleus * (1 - nucleus) / len(draws))
  assert np.all(np.abs(freq - nucleus) <= 5 * sigma + 1e-3)


def test_empty_prompt_row_is_finite():
  mask = LEFT_MASK.copy()
  mask[1] = 0
  out = run(mask=mask, rng=5)
  assert np.all(np.isfinite(out.logprobs))
  np.testing.assert_array_equal(out.lengths, N)
  # The reference model gives all-zero logits there: a uniform first token.
  assert_close(out.logprobs[1, 0], -np.log(V), atol=1e-5)


# ----------------------------------------------------------------------------------
# filter_logits: hand fixture, NumPy reference, properties
# ----------------------------------------------------------------------------------


def test_filter_logits_hand_fixture():
  z = np.log(np.array([[0.1, 0.5, 0.15, 0.25]], np.float32))
  kept = lambda **kw: (np.asarray(filter_logits(z, **kw)) > -1e29).astype(int).tolist()
  assert kept(top_k=2) == [[0, 1, 0, 1]]
  assert kept(top_p=0.5) == [[0, 1, 0, 0]]        # mass before 2nd token is 0.5: dropped
  assert kept(top_p=0.51) == [[0, 1, 0, 1]]
  assert kept(top_p=0.8) == [[0, 1, 1, 1]]
  assert kept(top_p=1.0) == [[1, 1, 1, 1]]
  assert kept(top_p=0.0) == [[0, 1, 0, 0]]        # the argmax is always kept
  assert kept(top_k=3, top_p=0.6) == [[0, 1, 0, 1]]
  np.testing.assert_array_equal(np.asarray(filter_logits(z, top_k=4)), z)


def np_filter(logits, top_k, top_p):
  out = logits.astype(np.float64).copy()
  for b in range(out.shape[0]):
    row = out[b]
    if top_k is not None and top_k < row.size:
      kth = np.sort(row)[::-1][top_k - 1]
      row[row < kth] = -1e30
    if top_p is not None:
      order = np.argsort(-row, kind="stable")
      p = np.exp(row[order] - row[order].max())
      p /= p.sum()
      mass = 0.0
      keep = np.zeros(row.size, bool)
      for i, idx in enumerate(order):
        if i == 0 or mass < top_p[b] or top_p[b] >= 1:
          keep[idx] = True
        mass += p[i]
      row[~keep] = -1e30
  return out


_FILTER = _jit(filter_logits, static_argnames="top_k")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.sampled_from([None, 3, 40]),
       use_p=st.booleans())
def test_filter_logits_matches_numpy_and_properties(seed, top_k, use_p):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(4, 16)) * 2).astype(np.float32)
  top_p = rng.uniform(0, 1.2, size=4).astype(np.float32) if use_p else None
  got = np.asarray(_FILTER(logits, top_k=top_k, top_p=top_p))
  ref = np_filter(logits, top_k, top_p)
  np.testing.assert_array_equal(got > -1e29, ref > -1e29)
  kept = got > -1e29
  np.testing.assert_array_equal(got[kept], logits[kept])   # survivors are unchanged
  assert kept[np.arange(4), logits.argmax(-1)].all()
  if top_k is not None:
    assert np.all(kept.sum(-1) <= top_k)
  if top_p is not None:
    probs = np.exp(log_softmax(logits.astype(np.float64)))
    mass = np.where(kept, probs, 0).sum(-1)
    assert np.all((mass >= np.minimum(top_p, 1) - 1e-5) | (top_k is not None))


# ----------------------------------------------------------------------------------
# Other models, recompiles, speed, bad inputs
# ----------------------------------------------------------------------------------


def test_any_model_with_decode_fns():
  """A bigram table as a model: logits depend on the last token only."""
  table = np.random.default_rng(1).normal(size=(V, V)).astype(np.float32) * 3

  def init_cache(params, batch, max_len):
    del params, max_len
    return jnp.zeros((batch,), jnp.int32)

  def prefill(params, tokens, mask, cache):
    del cache
    last = jnp.max(jnp.where(mask > 0, jnp.arange(tokens.shape[1]), 0), axis=1)
    prev = jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0]
    return params[prev], prev

  def decode(params, tokens, cache):
    del cache
    return params[tokens], tokens

  fns = DecodeFns(init_cache, prefill, decode)
  out = _jit(functools.partial(sample, fns, max_new_tokens=N, greedy=True))(
      jnp.asarray(table), PROMPTS, LEFT_MASK, None)
  completion, logprobs = np.asarray(out.completion), np.asarray(out.logprobs)
  prev = PROMPTS[:, -1]
  for n in range(N):
    logits = table[prev]
    token = logits.argmax(-1)
    np.testing.assert_array_equal(completion[:, n], token)
    assert_close(logprobs[:, n], log_softmax(logits)[np.arange(B), token], atol=1e-5)
    prev = token


def test_coefficients_do_not_recompile():
  run(rng=0, temperature=0.5, top_p=0.9, eos_id=3)
  size = _SAMPLE._cache_size()
  run(rng=1, temperature=1.5, top_p=0.3, eos_id=7, pad_id=2)
  run(rng=2, temperature=np.array([0.2, 0.9, 2.0]), top_p=np.array([1.0, 0.5, 0.1]),
      eos_id=11, pad_id=9)
  assert _SAMPLE._cache_size() == size


def test_tiny_sampling_is_fast():
  run(rng=0)
  start = time.perf_counter()
  for i in range(5):
    run(rng=i)
  assert (time.perf_counter() - start) / 5 < 0.5


def test_bad_inputs_raise():
  key = jax.random.key(0)
  call = functools.partial(sample, FNS, PARAMS, max_new_tokens=2)
  with pytest.raises(ValueError, match="prompt_mask"):
    call(PROMPTS, LEFT_MASK[:, :3], key)
  with pytest.raises(ValueError, match="prompt_tokens"):
    call(PROMPTS[0], LEFT_MASK[0], key)
  with pytest.raises(ValueError, match="prompt_tokens"):
    call(PROMPTS.astype(np.float32), LEFT_MASK, key)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sample(FNS, PARAMS, PROMPTS, LEFT_MASK, key, max_new_tokens=0)
  with pytest.raises(ValueError, match="top_k"):
    call(PROMPTS, LEFT_MASK, key, top_k=0)
  with pytest.raises(ValueError, match="temperature"):
    call(PROMPTS, LEFT_MASK, key, temperature=np.ones(B + 1))
  with pytest.raises(ValueError, match="top_p"):
    call(PROMPTS, LEFT_MASK, key, top_p=np.ones((B, 2)))
  with pytest.raises(ValueError, match="logits"):
    filter_logits(np.ones(4), top_k=2)
  for bad in ([], np.ones((2, 2), np.int32), 2.0, [1.5, 2.0]):
    with pytest.raises(ValueError, match="eos_id"):
      call(PROMPTS, LEFT_MASK, key, eos_id=bad)
