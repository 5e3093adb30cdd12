r"""One rollout-backend protocol: what the RL loop asks of whatever generates.

:class:`RolloutBackend` is the whole interface the loop's
:class:`~jaxrl_llm.loop.policy.Policy` uses: ``generate(params, requests, *, seed,
first_request=0) -> list[Completion]`` (the :class:`~jaxrl_llm.rollout.Request` s
completed ``n`` times each, ordered by request then sample), ``take_stats()`` (the metrics
since the last call, recorded in each step's row; empty where there are none),
``seed_from_key(key)`` (how a JAX key becomes this backend's int ``seed``),
``replica()`` (a backend with the same settings and none of the state, for a second
thread) and ``takes_policy_part`` (True: ``params`` are the policy's weights alone,
no value head and no critic, :meth:`~jaxrl_llm.loop.policy.Policy.ref_params`; False:
the whole parameter pytree the model's decode functions take). It implements:

========================================  ==========================================
backend                                   what it is
========================================  ==========================================
:class:`SamplerBackend` (here)            the rectangular sampler,
                                          :func:`~jaxrl_llm.rollout.sample`
:class:`~jaxrl_llm.rollout.RolloutEngine` continuous batching over a paged KV cache
:class:`~jaxrl_llm.rollout.ReplicatedEngine`  engine replicas, one per device
:class:`~jaxrl_llm.rollout.vllm.VllmEngine`   in-process vLLM (weights pushed:
                                          ``takes_policy_part``; ``take_stats()`` its pushes)
========================================  ==========================================

The loop never asks which one it holds. Capabilities beyond the protocol stay with
their class: partial rollouts (``token_budget``, ``version``) are the engine's
(:mod:`jaxrl_llm.loop.partial` asks for a :class:`~jaxrl_llm.rollout.RolloutEngine`);
vLLM's :meth:`~jaxrl_llm.rollout.vllm.VllmEngine.push` loads weights, which its
``generate`` does whenever ``params`` are not the ones pushed last.

**Seeds.** ``generate``'s ``seed`` is an int; the loop holds JAX keys, and each backend
says how a key becomes its seed (``seed_from_key``), so that every backend draws what
it drew before the protocol:

* the engines (and vLLM) key their draws by a small int: :func:`draw_seed`, an int in
  :math:`[0, 2^{31} - 1)` drawn with the key;
* the rectangular sampler draws with one key over all rows (``fold_in(key, n)`` at
  generated position ``n``), so its seed *is* the key: :func:`key_seed` writes the key's
  words as one int (high word first) and :func:`seed_key` reads them back, lossless.
  An int below :math:`2^{32}` is then the key ``jax.random.PRNGKey(seed)``.

Greedy requests (``temperature=0``) draw nothing; the loop passes ``seed=0``.

Examples:
  >>> from flax import nnx
  >>> from jaxrl_llm.models import Transformer, TransformerConfig, make_decode_fns, split_model
  >>> graphdef, params = split_model(
  ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
  >>> backend = SamplerBackend(make_decode_fns(graphdef), pad_id=0)
  >>> isinstance(backend, RolloutBackend), backend.take_stats(), backend.takes_policy_part
  (True, {}, False)
  >>> out = backend.generate(params, [Request([3, 4], n=2, max_new_tokens=4)],
  ...                        seed=backend.seed_from_key(jax.random.PRNGKey(7)))
  >>> [(c.request, c.sample, len(c.tokens)) for c in out]
  [(0, 0, 4), (0, 1, 4)]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.rollout.protocol import DecodeFns
from jaxrl_llm.rollout.sampler import SampleOutput, sample
from jaxrl_llm.rollout.scheduler import Completion, Request

# The engines' seeds: ints in [0, _SEED_HIGH), drawn with the loop's key.
_SEED_HIGH = int(np.iinfo(np.int32).max)
_WORD_BITS = 32


@runtime_checkable
class RolloutBackend(Protocol):
  """What generates completions for the RL loop (module docstring).

  Attributes:
    takes_policy_part: True when ``generate`` takes the policy's weights alone (no
      value head, no critic: ``Policy.ref_params``), as vLLM; False when it takes the
      whole parameter pytree the model's decode functions read.
  """

  @property
  def takes_policy_part(self) -> bool:
    """Whether ``generate``'s ``params`` are the policy's weights alone."""
    ...

  def generate(self, params: Any, requests: Sequence[Request], *, seed: int,
               first_request: int = 0) -> list[Completion]:
    """Completes every request ``n`` times; the completions ordered by request, then
    sample (``Completion.request`` the index in ``requests``). ``seed`` keys the draws
    (:meth:`seed_from_key`); ``first_request``: the index of ``requests[0]`` in the
    draws' keys, so a share ``[a, b)`` of a batch draws what the whole batch draws for
    it (a backend that draws with one key over all rows raises ``ValueError`` for a
    nonzero one)."""
    ...

  def take_stats(self) -> dict[str, float]:
    """The backend's metrics since the last call (empty where there are none). Named
    ``take_`` because it resets them; an engine's per-call counters are its ``stats``
    dict, another thing."""
    ...

  def seed_from_key(self, key: jax.Array) -> int:
    """The int ``seed`` of :meth:`generate` that the JAX ``key`` stands for."""
    ...

  def replica(self) -> RolloutBackend:
    """A backend with this one's settings (and compilations) and none of its state:
    for a second thread."""
    ...


def draw_seed(key: jax.Array) -> int:
  """The engines' int seed of a JAX ``key``: uniform in :math:`[0, 2^{31} - 1)`.

  Examples:
    >>> seed = draw_seed(jax.random.PRNGKey(0))
    >>> seed == draw_seed(jax.random.key(0)) and 0 <= seed < 2 ** 31 - 1
    True
  """
  return int(jax.random.randint(key, (), 0, _SEED_HIGH))


@functools.cache
def _key_words() -> int:
  """Words (uint32) of a key of the default PRNG implementation (threefry: 2)."""
  return int(jax.random.PRNGKey(0).shape[-1])


def key_seed(key: jax.Array) -> int:
  """The words of one JAX ``key`` (typed or raw uint32, default implementation) as one
  int, high word first; :func:`seed_key` is its inverse.

  Examples:
    >>> key_seed(jax.random.PRNGKey(5)), key_seed(jax.random.key(5))
    (5, 5)
    >>> key = jax.random.fold_in(jax.random.PRNGKey(0), 3)
    >>> bool((seed_key(key_seed(key)) == key).all())
    True
  """
  data = key
  if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  words = np.asarray(data)
  if words.shape != (_key_words(),) or words.dtype != np.uint32:
    raise ValueError(f"`key` must be one key of the default PRNG implementation "
                     f"({_key_words()} uint32 words), got {words.dtype} {words.shape}.")
  seed = 0
  for w in words.tolist():
    seed = (seed << _WORD_BITS) | int(w)
  return seed


def seed_key(seed: int) -> jax.Array:
  """The raw uint32 key whose words :func:`key_seed` wrote as ``seed``; below
  :math:`2^{32}`, ``jax.random.PRNGKey(seed)``.

  Examples:
    >>> bool((seed_key(5) == jax.random.PRNGKey(5)).all())
    True
    >>> seed_key(-1)
    Traceback (most recent call last):
    ...
    ValueError: `seed` must be an int in [0, 2 ** 64), got -1.
  """
  n = _key_words()
  if (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
      or not 0 <= seed < 1 << (_WORD_BITS * n)):
    raise ValueError(f"`seed` must be an int in [0, 2 ** {_WORD_BITS * n}), got {seed!r}.")
  mask = (1 << _WORD_BITS) - 1
  words = [(int(seed) >> (_WORD_BITS * (n - 1 - i))) & mask for i in range(n)]
  return jnp.asarray(np.array(words, np.uint32))


# One compilation per (decode functions, shapes, static settings), shared by every
# SamplerBackend over the same decode functions.
_sample_jit = jax.jit(sample, static_argnums=0,
                      static_argnames=("max_new_tokens", "greedy", "top_k"))


def _setting(request: Request) -> tuple:
  """What the rectangular call takes once for all rows."""
  eos = None if request.eos_ids is None else tuple(int(t) for t in request.eos_ids)
  return (int(request.max_new_tokens), float(request.temperature), request.top_k,
          request.top_p, eos)


class SamplerBackend:
  """The rectangular sampler (:func:`~jaxrl_llm.rollout.sample`) as a
  :class:`RolloutBackend`: one call over the requests' prompts, each repeated ``n``
  times (rows ``request 0 sample 0 .. n-1``, then request 1, ...), left-padded with
  ``pad_id`` to ``prompt_len`` columns, drawn with the one key :func:`seed_key`
  ``(seed)``. The same numbers as ``sample`` over those rows with that key, bit for bit.

  All requests of a call share ``max_new_tokens``, ``temperature``, ``top_k``,
  ``top_p`` and ``eos_ids`` (one rectangular call); ``temperature=0`` samples greedily,
  log-probs then under :math:`\\tau = 1` (as the engine's). ``first_request`` must be 0:
  the draws depend on the rows' places in the call, not on request keys.

  Args:
    decode_fns: the model's :class:`~jaxrl_llm.rollout.DecodeFns`.
    pad_id: the token id of the left padding and after a completion ends.
    prompt_len: the prompt columns of every call (one compilation; a longer prompt is a
      ``ValueError``); None: each call's longest prompt. The width changes the float
      rounding (ulps), so a run keeps one: its tokenizer's padded width.
  """

  takes_policy_part = False

  def __init__(self, decode_fns: DecodeFns, *, pad_id: int,
               prompt_len: int | None = None) -> None:
    if prompt_len is not None and (not isinstance(prompt_len, int) or prompt_len < 1):
      raise ValueError(f"`prompt_len` must be None or an int >= 1, got {prompt_len!r}.")
    self.fns = decode_fns
    self.pad_id = pad_id
    self.prompt_len = prompt_len

  def replica(self) -> SamplerBackend:
    """A backend of the same settings (the sampler keeps no state between calls)."""
    return SamplerBackend(self.fns, pad_id=self.pad_id, prompt_len=self.prompt_len)

  def take_stats(self) -> dict[str, float]:
    """``{}``: the sampler records no metrics."""
    return {}

  def seed_from_key(self, key: jax.Array) -> int:
    """:func:`key_seed`: the key itself, as an int."""
    return key_seed(key)

  def generate(self, params: Any, requests: Sequence[Request], *, seed: int = 0,
               first_request: int = 0) -> list[Completion]:
    """The completions of ``requests`` (class docstring).

    Raises:
      ValueError: ``requests`` not a sequence of :class:`Request`, requests with
        different settings, a prompt longer than ``prompt_len``, a nonzero
        ``first_request``, ``seed`` outside :func:`seed_key`'s range.
    """
    if first_request:
      raise ValueError("`first_request` must be 0 for the rectangular sampler: it draws "
                       "with one key over all rows (per-request keys: the rollout engine).")
    if not isinstance(requests, Sequence) or not all(isinstance(r, Request)
                                                     for r in requests):
      raise ValueError("`requests` must be a sequence of Request.")
    if not requests:
      return []
    for i, r in enumerate(requests):
      if _setting(r) != _setting(requests[0]):
        raise ValueError(
            f"`requests[{i}]` has other settings than requests[0] (max_new_tokens, "
            f"temperature, top_k, top_p, eos_ids: {_setting(r)} vs {_setting(requests[0])}):"
            " the rectangular sampler takes one setting for all rows.")
    tokens, mask = self._rows(requests)
    max_new, temperature, top_k, top_p, eos = _setting(requests[0])
    greedy = temperature == 0
    out = _sample_jit(self.fns, params, jnp.asarray(tokens), jnp.asarray(mask),
                      None if greedy else seed_key(seed), max_new_tokens=max_new,
                      temperature=1.0 if greedy else temperature, top_k=top_k,
                      top_p=top_p, greedy=greedy, eos_id=eos, pad_id=self.pad_id)
    return _completions(out, requests)

  def _rows(self, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
    """The left-padded ``[rows, width]`` prompts (int32) and their mask (float32)."""
    longest = max(len(r.prompt) for r in requests)
    width = longest if self.prompt_len is None else self.prompt_len
    if longest > width:
      i = next(i for i, r in enumerate(requests) if len(r.prompt) == longest)
      raise ValueError(f"`requests[{i}]`'s prompt has {longest} tokens, more than "
                       f"`prompt_len` ({width}).")
    prompts = [np.asarray(r.prompt, np.int32) for r in requests for _ in range(r.n)]
    tokens = np.full((len(prompts), width), self.pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.float32)
    for row, p in enumerate(prompts):
      tokens[row, width - len(p):] = p
      mask[row, width - len(p):] = 1.0
    return tokens, mask


def _completions(out: SampleOutput, requests: Sequence[Request]) -> list[Completion]:
  """The rows of ``out`` (request by request, ``n`` rows each) as completions cut to
  their lengths; ``"eos"`` where a row ended on a stop id."""
  completion, logprobs = np.asarray(out.completion), np.asarray(out.logprobs)
  filtered, lengths = np.asarray(out.sampling_logprobs), np.asarray(out.lengths)
  finished = np.asarray(out.finished)
  result, row = [], 0
  for i, r in enumerate(requests):
    for j in range(r.n):
      k = int(lengths[row])
      result.append(Completion(
          request=i, sample=j, tokens=completion[row, :k], logprobs=logprobs[row, :k],
          filtered_logprobs=filtered[row, :k],
          finish_reason="eos" if finished[row] else "length", tag=r.tag))
      row += 1
  return result


__all__ = ["RolloutBackend", "SamplerBackend", "draw_seed", "key_seed", "seed_key"]
