"""The rollout-backend protocol (jaxrl_llm/rollout/backend.py): every backend class
implements it, the sampler and engine backends give the numbers the Policy gave before
the protocol (pinned from main), seeds map keys losslessly, stats."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm import _names
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.rollout import (
  ReplicatedEngine,
  Request,
  RolloutBackend,
  RolloutEngine,
  SamplerBackend,
  sample,
)
from jaxrl_llm.rollout.backend import draw_seed, key_seed, seed_key
from jaxrl_llm.rollout.vllm import PushStats, VllmEngine

V, PAD, EOS = 24, 0, 2
PROMPTS = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [0, 0, 0, 9, 8]], np.int32)
MASK = (np.arange(5)[None] >= np.array([[2], [0], [3]])).astype(np.float32)
SIMPLE = Policy.reference("tiny", V, 16, PAD, value_head=True, seed=3, temperature=0.7)
ENGINE = SIMPLE.with_backend(SIMPLE.engine_backend(max_slots=4, max_len=16, page_size=4))
KW = dict(max_new_tokens=6, eos_id=EOS)

# Policy.generate on main before the protocol (commit cabf401): n=2, temperature 0.7,
# rng PRNGKey(5); greedy with rng None.
PINNED_SAMPLER = [[1, 18, 0, 17, 4, 4], [14, 9, 9, 16, 0, 18], [4, 4, 6, 6, 15, 6],
                  [15, 3, 0, 2, 0, 0], [8, 16, 0, 0, 9, 4], [12, 2, 0, 0, 0, 0]]
PINNED_SAMPLER_LOGP = [[-2.3120389, -2.7101021], [-1.854684, -3.9149261],
                       [-2.2763281, -0.798885], [-4.5332298, -4.2993798],
                       [-0.580443, -5.1250081], [-4.2059579, -4.4568882]]
PINNED_ENGINE = [[22, 6, 6, 0, 0, 0], [11, 17, 22, 6, 6, 6], [5, 6, 6, 14, 14, 14],
                 [7, 7, 9, 21, 16, 16], [8, 0, 8, 22, 16, 16], [20, 8, 20, 21, 3, 6]]
PINNED_ENGINE_LOGP = [[-4.1513338, -1.177236], [-3.4311199, -3.5614569],
                      [-3.245856, -2.0290501], [-2.306293, -2.0937679],
                      [-0.580443, -4.4551201], [-3.249144, -2.9145279]]
PINNED_GREEDY = [[21, 21, 21, 16, 16, 16]] * 2 + [[19, 19, 16, 16, 16, 16]] * 2 + [
    [8, 8, 8, 8, 8, 6]] * 2
PINNED_GREEDY_LOGP = [[-1.965356, -1.389092]] * 2 + [[-2.019187, -1.673282]] * 2 + [
    [-1.064958, -1.412241]] * 2


def _vllm_without_vllm() -> VllmEngine:
  """A VllmEngine instance built without vLLM (no ``__init__``: its pure parts)."""
  engine = VllmEngine.__new__(VllmEngine)
  engine.push_stats = PushStats()
  return engine


def _backends() -> dict[str, object]:
  return {"sampler": SIMPLE.backend, "engine": ENGINE.backend,
          "replicated": ReplicatedEngine(ENGINE.backend, jax.devices()[:1]),
          "vllm": _vllm_without_vllm()}


def test_every_backend_class_implements_the_protocol():
  backends = _backends()
  assert isinstance(backends["sampler"], SamplerBackend)
  assert isinstance(backends["engine"], RolloutEngine)
  for name, backend in backends.items():
    assert isinstance(backend, RolloutBackend), name
  assert [b.takes_policy_part for b in backends.values()] == [False, False, False, True]

  class NoStats:      # generate alone is not a backend
    takes_policy_part = False

    def generate(self, params, requests, *, seed, first_request=0):
      return []

  assert not isinstance(NoStats(), RolloutBackend)
  with pytest.raises(ValueError, match="`backend` must implement"):
    SIMPLE.with_backend(NoStats())  # type: ignore[arg-type]


def test_sampler_and_engine_backends_give_mains_numbers():
  sampled = dict(rng=jax.random.PRNGKey(5), temperature=0.7, n=2, **KW)
  for policy, tokens, logp in ((SIMPLE, PINNED_SAMPLER, PINNED_SAMPLER_LOGP),
                               (ENGINE, PINNED_ENGINE, PINNED_ENGINE_LOGP)):
    out = policy.generate(policy.init_params, PROMPTS, MASK, **sampled)
    assert np.asarray(out.completion).tolist() == tokens
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, :2], logp, rtol=1e-5)
  greedy = [p.generate(p.init_params, PROMPTS, MASK, None, greedy=True, n=2, **KW)
            for p in (SIMPLE, ENGINE)]
  for out in greedy:
    assert np.asarray(out.completion).tolist() == PINNED_GREEDY
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, :2], PINNED_GREEDY_LOGP,
                               rtol=1e-5)
  assert np.asarray(greedy[0].finished).tolist() == [False] * 6


def test_sampler_backend_is_sample_over_the_repeated_rows_bit_for_bit():
  """The backend's rectangle is ``sample``'s over ``np.repeat``-ed rows, drawn with the
  key its seed stands for: the same arrays, bit for bit."""
  key = jax.random.fold_in(jax.random.PRNGKey(0), 9)
  n, tokens, mask = 3, np.repeat(PROMPTS, 3, axis=0), np.repeat(MASK, 3, axis=0)
  run = jax.jit(sample, static_argnums=0, static_argnames=("max_new_tokens",))
  want = run(SIMPLE.decode_fns, SIMPLE.init_params, tokens, mask, key, max_new_tokens=6,
             temperature=0.7, eos_id=(EOS,), pad_id=PAD)
  backend = SamplerBackend(SIMPLE.decode_fns, pad_id=PAD, prompt_len=5)
  requests = [Request(row[m > 0].tolist(), n=n, max_new_tokens=6, temperature=0.7,
                      eos_ids=(EOS,), tag=i) for i, (row, m) in enumerate(zip(PROMPTS, MASK))]
  out = backend.generate(SIMPLE.init_params, requests, seed=backend.seed_from_key(key))
  assert [(c.request, c.sample, c.tag) for c in out] == [
      (i, j, i) for i in range(3) for j in range(n)]
  for r, c in enumerate(out):
    k = int(want.lengths[r])
    assert len(c.tokens) == k
    np.testing.assert_array_equal(c.tokens, np.asarray(want.completion)[r, :k])
    np.testing.assert_array_equal(c.logprobs, np.asarray(want.logprobs)[r, :k])
    np.testing.assert_array_equal(c.filtered_logprobs,
                                  np.asarray(want.sampling_logprobs)[r, :k])
    assert c.finish_reason == ("eos" if bool(want.finished[r]) else "length")


def test_seeds_map_keys_losslessly_for_the_sampler_and_by_a_draw_for_the_engines():
  key = jax.random.fold_in(jax.random.PRNGKey(3), 11)
  assert np.array_equal(seed_key(key_seed(key)), key)
  assert key_seed(jax.random.PRNGKey(7)) == key_seed(jax.random.key(7)) == 7
  assert np.array_equal(seed_key(7), jax.random.PRNGKey(7))
  assert seed_key(2 ** 64 - 1).tolist() == [2 ** 32 - 1] * 2
  for bad in (-1, 2 ** 64, 1.5, True):
    with pytest.raises(ValueError, match="`seed`"):
      seed_key(bad)
  with pytest.raises(ValueError, match="`key`"):
    key_seed(np.zeros(3, np.uint32))
  # the engines' seed: what the Policy drew before the protocol
  want = int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
  assert [b.seed_from_key(key) for name, b in _backends().items() if name != "sampler"] == [
      want] * 3 == [draw_seed(key)] * 3


def test_stats_are_empty_for_the_jax_backends_and_vllms_are_its_pushes():
  requests = [Request([3, 4], n=2, max_new_tokens=3, temperature=0.7)]
  for name, backend in _backends().items():
    if name == "vllm":
      continue
    backend.generate(SIMPLE.init_params, requests, seed=1)
    assert backend.take_stats() == {}, name
  assert ENGINE.backend.stats["pages_in_use_after"] == 0     # counters kept apart
  assert SIMPLE.rollout_stats() == ENGINE.rollout_stats() == {}
  vllm = _vllm_without_vllm()
  assert vllm.take_stats() == {"vllm_push_s": 0.0, "vllm_pushes": 0.0}
  vllm.push_stats.add(0.5)
  vllm.push_stats.add(0.25)
  assert SIMPLE.with_backend(vllm).rollout_stats() == {"vllm_push_s": 0.75, "vllm_pushes": 2.0}
  assert vllm.take_stats() == {"vllm_push_s": 0.0, "vllm_pushes": 0.0}
  with pytest.raises(ValueError, match="no replica"):
    vllm.replica()


def test_with_backend_returns_a_new_policy_sharing_the_jitted_functions():
  assert isinstance(SIMPLE.backend, SamplerBackend)         # the constructor's default
  assert ENGINE is not SIMPLE and ENGINE.forward is SIMPLE.forward
  assert ENGINE.ref_forward is SIMPLE.ref_forward and ENGINE.init_params is SIMPLE.init_params
  assert isinstance(ENGINE.backend, RolloutEngine)
  with pytest.warns(DeprecationWarning, match="Policy.backend"):
    assert ENGINE.engine is ENGINE.backend                  # the old name, read-only
  given = Policy(SIMPLE.apply, SIMPLE.decode_fns, SIMPLE.init_params, pad_id=PAD,
                 backend=ENGINE.backend)
  assert given.backend is ENGINE.backend
  wide = SIMPLE.with_backend(SIMPLE.sampler_backend(prompt_len=8))
  assert isinstance(wide.backend, SamplerBackend) and wide.backend.prompt_len == 8
  assert SIMPLE.backend.prompt_len is None
  with pytest.raises(AttributeError):
    SIMPLE.engine = ENGINE.backend  # type: ignore[misc]


def test_use_engine_and_use_vllm_still_set_the_policys_own_backend():
  """The names from before backends: in place, as they always were (returning the
  policy now), so code that ignores the result still generates through the engine."""
  policy = Policy.reference("tiny", V, 16, PAD, value_head=True, seed=3, temperature=0.7)
  assert policy.use_engine(max_slots=4, max_len=16, page_size=4) is policy
  assert isinstance(policy.backend, RolloutEngine)
  vllm = _vllm_without_vllm()
  assert policy.use_vllm(vllm) is policy and policy.backend is vllm


def test_replicas_keep_the_settings_and_none_of_the_state():
  for name, backend in _backends().items():
    if name == "vllm":
      continue
    copy = backend.replica()
    assert type(copy) is type(backend) and copy is not backend, name
  engine = ENGINE.backend.replica()
  assert (engine.max_slots, engine.page_size, engine.prefill_chunk) == (4, 4, 128)


def test_the_sampler_backend_refuses_what_one_rectangle_cannot_do():
  backend = SamplerBackend(SIMPLE.decode_fns, pad_id=PAD, prompt_len=3)
  params = SIMPLE.init_params
  assert backend.generate(params, [], seed=0) == []
  mixed = [Request([1, 2], max_new_tokens=3), Request([1], max_new_tokens=4)]
  with pytest.raises(ValueError, match=r"`requests\[1\]` has other settings"):
    backend.generate(params, mixed, seed=0)
  with pytest.raises(ValueError, match=r"`requests\[0\]`'s prompt has 4 tokens"):
    backend.generate(params, [Request([1, 2, 3, 4], max_new_tokens=2)], seed=0)
  with pytest.raises(ValueError, match="`first_request` must be 0"):
    backend.generate(params, [Request([1], max_new_tokens=2)], seed=0, first_request=2)
  with pytest.raises(ValueError, match="`requests` must be"):
    backend.generate(params, [[1, 2]], seed=0)  # type: ignore[list-item]
  with pytest.raises(ValueError, match="`prompt_len`"):
    SamplerBackend(SIMPLE.decode_fns, pad_id=PAD, prompt_len=0)


def test_make_policy_picks_the_backend_the_run_names():
  from jaxrl_llm.loop.async_rollout import AsyncRollouts
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.partial import PartialRollouts
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import ROLLOUT_BUILDERS, make_policy, make_task
  assert set(ROLLOUT_BUILDERS) == set(_names.ROLLOUT_BACKENDS)
  run = RunConfig(task="reverse", prompts_per_step=2, group_size=2, rollout="simple")
  task = make_task(run)
  resolved = resolve(run, task)
  simple = make_policy(resolved, task)
  assert isinstance(simple.backend, SamplerBackend)
  assert simple.backend.prompt_len == task.max_prompt_len
  engine = make_policy(resolve(RunConfig(task="reverse", prompts_per_step=2,
                                         group_size=2), task), task)
  assert isinstance(engine.backend, RolloutEngine) and engine.backend.max_slots == 4
  # the engine-only capabilities refuse another backend, naming it
  with pytest.raises(ValueError, match=r"needs the rollout engine.*SamplerBackend"):
    PartialRollouts(simple, task, resolved.sampling, resolved.train)
  with pytest.raises(ValueError, match=r"need the rollout engine.*SamplerBackend"):
    AsyncRollouts(resolved, task, simple, max_staleness=1, first_step=1, last_step=2,
                  seed=0, devices=jax.devices()[:1])
  worker = AsyncRollouts(resolved, task, engine, max_staleness=1, first_step=1,
                         last_step=2, seed=0)
  assert isinstance(worker.policy.backend, RolloutEngine)
  assert worker.policy.backend is not engine.backend and worker.policy is not engine
