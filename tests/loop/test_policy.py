"""The loop's Policy generating through the rollout engine or the rectangular sampler."""

import jax
import numpy as np
import pytest

from jaxrl_llm.loop.policy import Policy

V, PAD, EOS = 24, 0, 2


def _policies():
  simple = Policy.reference("tiny", V, 16, PAD, value_head=True, seed=3, temperature=0.7)
  engine = simple.with_backend(simple.engine_backend(max_slots=4, max_len=16, page_size=4))
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


# ------------------------------------------- log-probs from the prompt width (issue 42)


def test_resolve_sets_the_prompt_width_as_logprob_start_where_the_layout_is_static():
  import dataclasses

  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_task
  task = make_task(RunConfig(task="reverse"))
  run = RunConfig(task="rg:chain_sum", model="smollm2-135m-instruct")   # a checkpoint
  assert resolve(run, task).train.logprob_start == task.max_prompt_len == 4
  assert resolve(run).train.logprob_start is None                  # no task: unknown
  packed = dataclasses.replace(run, pack=True)                     # rows start anywhere
  assert resolve(packed, task).train.logprob_start is None
  builtin = RunConfig(task="reverse")              # the built-in model: bit-identical
  assert resolve(builtin, task).train.logprob_start is None
  given = RunConfig(task="reverse", train={"logprob_start": 2})
  assert resolve(given, task).train.logprob_start == 2


def test_build_batch_log_probs_from_the_prompt_width_equal_the_full_ones():
  """The loop's forwards (old and reference log-probs) skip the prompt: the same
  values where the loss reads them, 0 on the prompt columns."""
  import dataclasses

  from jaxrl_llm.loop.batch import build_batch
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  run = RunConfig(task="reverse", model="tiny", algo="grpo", prompts_per_step=2,
                  group_size=2)
  task = make_task(run)
  start = task.max_prompt_len          # what resolve sets for a checkpoint, set by hand
  resolved = resolve(RunConfig(**{**dataclasses.asdict(run), "train": {
      "logprob_start": start}}), task)
  policy = make_policy(resolved, task)
  full = make_policy(dataclasses.replace(
      resolved, train=dataclasses.replace(resolved.train, logprob_start=None)), task)
  assert (policy.logprob_start, full.logprob_start) == (start, None)
  params = policy.init_params
  batch, _ = build_batch(resolved, task, policy, params, policy.ref_params(params),
                         np.random.default_rng(0), jax.random.PRNGKey(0))
  mask = batch["loss_mask"] > 0
  assert mask.sum() > 0 and not mask[:, :start].any()
  for key, fn in (("old_logp", full.forward), ("ref_logp", full.ref_forward)):
    expected = np.asarray(fn(params, batch)[0])
    np.testing.assert_allclose(batch[key][mask], expected[mask], atol=1e-6, rtol=1e-6)
    assert np.all(batch[key][:, :start] == 0) and np.any(expected[:, 1:start] != 0)
