"""A policy model as pure, jitted functions of a params pytree (the trainer's model).

Any model that follows the two protocols can be trained by
:func:`jaxrl_llm.loop.run.run_training`: the train step's forward
``apply_fn(params, tokens, positions, attention_mask)`` (see
:func:`jaxrl_llm.train.policy_forward`) and the sampler's
:class:`~jaxrl_llm.rollout.DecodeFns`; a model that also provides the paged protocol
(:class:`~jaxrl_llm.rollout.PagedDecodeFns`) can generate through the
continuous-batching :class:`~jaxrl_llm.rollout.RolloutEngine`
(:meth:`Policy.engine_backend`). :meth:`Policy.reference` builds the reference transformer.

A policy generates through one :class:`~jaxrl_llm.rollout.RolloutBackend` (the
rectangular sampler by default), given to the constructor or to
:meth:`Policy.with_backend`, which returns a new policy sharing the jitted functions:
a policy's backend never changes.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.rollout import (
  Completion,
  DecodeFns,
  PagedDecodeFns,
  Request,
  RolloutBackend,
  RolloutEngine,
  SampleOutput,
  SamplerBackend,
)
from jaxrl_llm.train import TrainConfig, policy_forward

# The defaults of the run's settings (declared once, in the configs).
_TEMPERATURE: float = TrainConfig.temperature
_LOGPROB_START: int | None = TrainConfig.logprob_start
_SEED: int = RunConfig.seed
# The engine's longest prefill chunk (tokens per prefill call).
_MAX_PREFILL_CHUNK = 128


class Policy:
  """A model as jitted ``forward`` (log-probs, entropies, values) and ``generate``
  (through its :attr:`backend`); ``ref_forward`` over :meth:`ref_params` gives the
  frozen KL reference's log-probs.

  Args:
    apply_fn: the pure forward of the model protocol.
    decode_fns: the model's :class:`~jaxrl_llm.rollout.DecodeFns`.
    init_params: the initial parameter pytree.
    pad_id: token id written after a completion ends.
    temperature: the temperature log-probs are computed at (the sampling one).
    ref_apply_fn: the forward of the frozen KL reference (default ``apply_fn``).
    ref_part: ``params -> the part of them ref_apply_fn needs`` (default: all): the
      reference keeps no value head or critic parameters (see :meth:`ref_params`).
    paged_decode_fns: the model's :class:`~jaxrl_llm.rollout.PagedDecodeFns`, for
      :meth:`engine_backend` (None: the model generates through ``sample`` only).
    rollout_params: ``params -> the parameters decode_fns take`` (default: all), applied
      once per :meth:`generate` (a LoRA policy generates from merged weights).
    trainable: what the train step trains (``make_train_step(..., trainable=)``; None:
      all parameters).
    ref_shares_params: the reference is a function of the *live* parameters (a LoRA
      policy's frozen base with the adapters off): the loop passes
      ``ref_params(state.params)`` each step instead of a frozen copy.
    logprob_start: the static first response column of the batches ``forward`` and
      ``ref_forward`` score (``TrainConfig.logprob_start``): log-probs and entropies
      are 0 before it and the LM head skips the prompt (see
      :func:`~jaxrl_llm.train.policy_forward`). None: every column.
    backend: the :class:`~jaxrl_llm.rollout.RolloutBackend` :meth:`generate` uses
      (None: the rectangular sampler over ``decode_fns``,
      :class:`~jaxrl_llm.rollout.SamplerBackend`, padding each call to its longest
      prompt).
  """

  def __init__(self, apply_fn: Callable[..., Any], decode_fns: DecodeFns,
               init_params: Any, *, pad_id: int, temperature: float = _TEMPERATURE,
               ref_apply_fn: Callable[..., Any] | None = None,
               ref_part: Callable[[Any], Any] | None = None,
               paged_decode_fns: PagedDecodeFns | None = None,
               rollout_params: Callable[[Any], Any] | None = None,
               trainable: Callable[[Any], Any] | None = None,
               ref_shares_params: bool = False,
               logprob_start: int | None = _LOGPROB_START,
               backend: RolloutBackend | None = None) -> None:
    self.apply = apply_fn
    self.trainable = trainable
    self.ref_shares_params = ref_shares_params
    self._rollout_params = None if rollout_params is None else jax.jit(rollout_params)
    self.decode_fns = decode_fns
    self.paged_decode_fns = paged_decode_fns
    self._backend = SamplerBackend(decode_fns, pad_id=pad_id) if backend is None else (
        _checked(backend))
    self.init_params = init_params
    self.pad_id = pad_id
    self.temperature = temperature
    self._ref_part = ref_part
    self.logprob_start = logprob_start
    self.forward = jax.jit(lambda params, batch: policy_forward(
        apply_fn, params, batch, temperature=temperature, logprob_start=logprob_start))
    self.ref_forward = self.forward if ref_apply_fn is None else jax.jit(
        lambda params, batch: policy_forward(ref_apply_fn, params, batch,
                                             temperature=temperature,
                                             logprob_start=logprob_start))

  @classmethod
  def reference(cls, model: str, vocab_size: int, max_len: int, pad_id: int, *,
                value_head: bool, seed: int = _SEED, temperature: float = _TEMPERATURE,
                logprob_start: int | None = _LOGPROB_START) -> Policy:
    """The reference transformer preset ``model`` (``tiny`` / ``small``)."""
    from jaxrl_llm.models.transformer import Transformer, get_config, split_model
    cfg = get_config(model, vocab_size, value_head=value_head,
                     max_seq_len=max(max_len, 8))
    graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(seed)))
    return cls.of_transformer(graphdef, params, pad_id=pad_id, temperature=temperature,
                              logprob_start=logprob_start)

  @classmethod
  def of_transformer(cls, graphdef: Any, params: Any, *, pad_id: int,
                     temperature: float = _TEMPERATURE,
                     logprob_start: int | None = _LOGPROB_START) -> Policy:
    """A :class:`~jaxrl_llm.models.Transformer` (``split_model`` output) as a policy;
    its KL reference is the same model without the value head."""
    from jaxrl_llm.models.critic import drop_value_head
    from jaxrl_llm.models.transformer import make_apply_fn, make_decode_fns, make_paged_decode_fns
    ref_graphdef, _ = drop_value_head(graphdef, params)
    paged = make_paged_decode_fns(graphdef)
    if ref_graphdef is graphdef:        # no value head: the reference is the model
      return cls(make_apply_fn(graphdef), make_decode_fns(graphdef), params,
                 pad_id=pad_id, temperature=temperature, paged_decode_fns=paged,
                 logprob_start=logprob_start)
    return cls(make_apply_fn(graphdef), make_decode_fns(graphdef), params,
               pad_id=pad_id, temperature=temperature, paged_decode_fns=paged,
               logprob_start=logprob_start, ref_apply_fn=make_apply_fn(ref_graphdef),
               ref_part=lambda p: drop_value_head(graphdef, p)[1])

  def ref_params(self, params: Any) -> Any:
    """The part of ``params`` the frozen KL reference keeps (the policy's weights:
    no value head, no critic); :attr:`ref_forward` takes it. The leaves are shared
    with ``params`` (copy them before a train step donates ``params``)."""
    return params if self._ref_part is None else self._ref_part(params)

  # -- the rollout backend -----------------------------------------------------------

  @property
  def backend(self) -> RolloutBackend:
    """The :class:`~jaxrl_llm.rollout.RolloutBackend` :meth:`generate` uses
    (:meth:`with_backend` makes a new policy with another)."""
    return self._backend

  @property
  def engine(self) -> RolloutBackend:
    """:attr:`backend` (deprecated name, read-only: use :attr:`backend`)."""
    warnings.warn("Policy.engine is deprecated: use Policy.backend (a RolloutBackend).",
                  DeprecationWarning, stacklevel=2)
    return self._backend

  def with_backend(self, backend: RolloutBackend) -> Policy:
    """A policy that generates through ``backend``, sharing this one's model, jitted
    functions and initial parameters (this one keeps its backend).

    Raises:
      ValueError: ``backend`` does not implement
        :class:`~jaxrl_llm.rollout.RolloutBackend`.
    """
    new = copy.copy(self)
    new._backend = _checked(backend)
    return new

  def sampler_backend(self, *, prompt_len: int | None = None) -> SamplerBackend:
    """The rectangular sampler over this policy's ``decode_fns``
    (:class:`~jaxrl_llm.rollout.SamplerBackend`), its prompts padded to ``prompt_len``
    columns (None: each call's longest prompt); for :meth:`with_backend`."""
    return SamplerBackend(self.decode_fns, pad_id=self.pad_id, prompt_len=prompt_len)

  def engine_backend(self, *, max_slots: int, max_len: int, page_size: int = 16,
                     max_prompt_len: int | None = None,
                     prefill_rows: int = 1) -> RolloutEngine:
    """A :class:`~jaxrl_llm.rollout.RolloutEngine` over this policy's paged decode
    functions, for :meth:`with_backend`: ``max_slots`` slots (continuous batching,
    paged KV cache, a group's prompt prefilled once), ``max_len`` bounding prompt +
    completion. ``max_prompt_len`` (when known) sizes the prefill chunk: the smallest
    power of two that holds it, at most 128, so short prompts are not prefilled in
    128-token chunks. ``prefill_rows``: the engine's prompts per prefill call (1: each
    alone, the earlier numbers).

    Raises:
      ValueError: the model provides no paged protocol (``paged_decode_fns``).
    """
    if self.paged_decode_fns is None:
      raise ValueError("this policy's model has no paged decode protocol "
                       "(`paged_decode_fns`): generate with sample (--rollout simple).")
    chunk = _MAX_PREFILL_CHUNK
    if max_prompt_len is not None:
      chunk = min(chunk, 1 << max(max_prompt_len - 1, 0).bit_length())
    return RolloutEngine(self.paged_decode_fns, max_slots=max_slots, max_len=max_len,
                         page_size=page_size, prefill_chunk=chunk,
                         prefill_rows=prefill_rows)

  def use_engine(self, *, max_slots: int, max_len: int, page_size: int = 16,
                 max_prompt_len: int | None = None, prefill_rows: int = 1) -> Policy:
    """Sets this policy's backend to :meth:`engine_backend` (the same arguments) and
    returns the policy. Kept for code written before backends existed; the RL loop
    and new code use ``policy.with_backend(policy.engine_backend(...))``, which leaves
    ``policy`` as it was.

    Raises:
      ValueError: the model provides no paged protocol (``paged_decode_fns``).
    """
    self._backend = self.engine_backend(max_slots=max_slots, max_len=max_len,
                                        page_size=page_size, max_prompt_len=max_prompt_len,
                                        prefill_rows=prefill_rows)
    return self

  def use_vllm(self, engine: RolloutBackend) -> Policy:
    """Sets this policy's backend to ``engine`` (a
    :class:`~jaxrl_llm.rollout.vllm.VllmEngine`) and returns the policy (kept for
    code written before backends existed; new code: :meth:`with_backend`). vLLM takes
    the policy's weights alone (its ``takes_policy_part``: :meth:`ref_params`, no
    value head, no critic), pushed whenever :meth:`generate` is called with params
    other than the ones pushed last (so after every train step); a failed push raises
    :class:`~jaxrl_llm.rollout.vllm.VllmPushError`, which stops the run before a step
    trains on rollouts of stale weights."""
    self._backend = _checked(engine)
    return self

  def rollout_view(self, params: Any) -> Any:
    """The parameters this policy's backend generates from, given the trained ones:
    ``rollout_params(params)`` (a LoRA policy's merged weights), then the policy's
    weights alone where the backend ``takes_policy_part`` (vLLM). What
    :meth:`generate` hands its backend; a caller driving the backend itself (the
    endpoint of ``jaxrl-llm serve``, multi-turn episodes) passes it this."""
    if self._rollout_params is not None:
      params = self._rollout_params(params)
    return self.ref_params(params) if self._backend.takes_policy_part else params

  def rollout_stats(self) -> dict[str, float]:
    """The backend's metrics since the last call (:meth:`RolloutBackend.take_stats`; vLLM:
    ``vllm_push_s``, the seconds spent pushing weights, and ``vllm_pushes``); empty
    for the JAX backends."""
    return self._backend.take_stats()

  def generate(self, params: Any, tokens: Any, mask: Any, rng: jax.Array | None, *,
               max_new_tokens: int, eos_id: int | Sequence[int] | None,
               temperature: float = _TEMPERATURE, greedy: bool = False,
               n: int = 1, first_request: int = 0) -> SampleOutput:
    """``n`` completions of each prompt row of ``tokens`` ``[B, P]`` (left-padded,
    ``mask`` 1 = real token), as one rectangular :class:`~jaxrl_llm.rollout.SampleOutput`
    of ``B * n`` rows: row ``i``'s samples are rows ``i * n .. i * n + n - 1``.

    Each prompt is one :class:`~jaxrl_llm.rollout.Request` with ``n`` samples (greedy:
    temperature 0, log-probs under temperature 1) for the :attr:`backend`, seeded by
    its ``seed_from_key(rng)`` (0 when greedy or ``rng`` is None): the engine keys each
    request's draws by an int seed drawn from ``rng``, the rectangular sampler draws
    over the ``n``-times repeated rows with ``rng`` itself. The two draw different
    samples from the same distribution; greedy tokens are the same.

    ``first_request`` (a backend with per-request keys, as the engine): the index of row
    0 in the draws' keys, so that a process generating rows ``[a, b)`` of a batch with
    ``first_request=a`` draws what one call over the whole batch draws for them
    (multi-host rollouts).
    """
    params = self.rollout_view(params)
    tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, np.float32)
    eos_ids = None if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    requests = [Request(row[keep > 0].tolist(), n=n, max_new_tokens=max_new_tokens,
                        temperature=0.0 if greedy else float(temperature),
                        eos_ids=eos_ids) for row, keep in zip(tokens, mask)]
    seed = 0 if greedy or rng is None else self._backend.seed_from_key(rng)
    completions = self._backend.generate(params, requests, seed=seed,
                                         first_request=first_request)
    return completions_to_sample_output(completions, np.repeat(tokens, n, axis=0),
                                        np.repeat(mask, n, axis=0),
                                        max_new_tokens=max_new_tokens, pad_id=self.pad_id)


def _checked(backend: RolloutBackend) -> RolloutBackend:
  """``backend``, or ``ValueError`` when it does not implement the protocol."""
  if not isinstance(backend, RolloutBackend):
    raise ValueError(f"`backend` must implement jaxrl_llm.rollout.RolloutBackend "
                     f"(generate, stats, seed_from_key, replica, takes_policy_part), "
                     f"got {type(backend).__name__}.")
  return backend


def completions_to_sample_output(completions: Sequence[Completion], prompt_tokens: Any,
                                 prompt_mask: Any, *, max_new_tokens: int,
                                 pad_id: int) -> SampleOutput:
  """The engine's completions (ordered by request, then sample) as the rectangular
  :class:`~jaxrl_llm.rollout.SampleOutput` that :func:`~jaxrl_llm.rollout.sample` returns
  for the prompt rows ``prompt_tokens`` ``[R, P]`` (one row per completion): each
  completion padded with ``pad_id`` to ``max_new_tokens`` (mask, log-probs 0 there).

  Examples:
    >>> import numpy as np
    >>> c = Completion(request=0, sample=0, tokens=np.array([5, 2]),
    ...                logprobs=np.array([-0.5, -0.25]), filtered_logprobs=np.zeros(2),
    ...                finish_reason="eos")
    >>> out = completions_to_sample_output([c], np.array([[0, 7]]), np.array([[0, 1]]),
    ...                                    max_new_tokens=3, pad_id=0)
    >>> out.tokens.tolist(), out.completion_mask.tolist(), out.lengths.tolist()
    ([[0, 7, 5, 2, 0]], [[1.0, 1.0, 0.0]], [2])
    >>> out.logprobs.tolist(), out.finished.tolist()
    ([[-0.5, -0.25, 0.0]], [True])
  """
  rows = len(completions)
  completion = np.full((rows, max_new_tokens), pad_id, np.int32)
  completion_mask = np.zeros((rows, max_new_tokens), np.float32)
  logprobs = np.zeros((rows, max_new_tokens), np.float32)
  sampling_logprobs = np.zeros((rows, max_new_tokens), np.float32)
  for r, c in enumerate(completions):
    k = len(c.tokens)
    completion[r, :k] = c.tokens
    completion_mask[r, :k] = 1.0
    logprobs[r, :k] = c.logprobs
    sampling_logprobs[r, :k] = c.filtered_logprobs
  prompt_tokens = np.asarray(prompt_tokens, np.int32)
  as_jax = jnp.asarray
  return SampleOutput(
      tokens=as_jax(np.concatenate([prompt_tokens, completion], axis=1)),
      mask=as_jax(np.concatenate([np.asarray(prompt_mask, np.float32), completion_mask],
                                 axis=1)),
      completion=as_jax(completion), completion_mask=as_jax(completion_mask),
      logprobs=as_jax(logprobs),
      lengths=as_jax(completion_mask.sum(axis=1).astype(np.int32)),
      finished=as_jax(np.array([c.finish_reason == "eos" for c in completions], bool)),
      sampling_logprobs=as_jax(sampling_logprobs))


__all__ = ["Policy", "completions_to_sample_output"]
