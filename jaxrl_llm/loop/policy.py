"""A policy model as pure, jitted functions of a params pytree (the trainer's model).

Any model that follows the two protocols can be trained by
:func:`jaxrl_llm.loop.run.run_training`: the train step's forward
``apply_fn(params, tokens, positions, attention_mask)`` (see
:func:`jaxrl_llm.train.policy_forward`) and the sampler's
:class:`~jaxrl_llm.rollout.DecodeFns`; a model that also provides the paged protocol
(:class:`~jaxrl_llm.rollout.PagedDecodeFns`) can generate through the
continuous-batching :class:`~jaxrl_llm.rollout.RolloutEngine`
(:meth:`Policy.use_engine`). :meth:`Policy.reference` builds the reference transformer.
"""

from __future__ import annotations

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
  RolloutEngine,
  SampleOutput,
  sample,
)
from jaxrl_llm.train import TrainConfig, policy_forward

# The defaults of the run's settings (declared once, in the configs).
_TEMPERATURE: float = TrainConfig.temperature
_LOGPROB_START: int | None = TrainConfig.logprob_start
_SEED: int = RunConfig.seed
# The engine's longest prefill chunk (tokens per prefill call).
_MAX_PREFILL_CHUNK = 128


class Policy:
  """A model as jitted ``forward`` (log-probs, entropies, values) and ``generate``;
  ``ref_forward`` over :meth:`ref_params` gives the frozen KL reference's log-probs.

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
      :meth:`use_engine` (None: the model generates through ``sample`` only).
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
  """

  def __init__(self, apply_fn: Callable[..., Any], decode_fns: DecodeFns,
               init_params: Any, *, pad_id: int, temperature: float = _TEMPERATURE,
               ref_apply_fn: Callable[..., Any] | None = None,
               ref_part: Callable[[Any], Any] | None = None,
               paged_decode_fns: PagedDecodeFns | None = None,
               rollout_params: Callable[[Any], Any] | None = None,
               trainable: Callable[[Any], Any] | None = None,
               ref_shares_params: bool = False,
               logprob_start: int | None = _LOGPROB_START) -> None:
    self.apply = apply_fn
    self.trainable = trainable
    self.ref_shares_params = ref_shares_params
    self._rollout_params = None if rollout_params is None else jax.jit(rollout_params)
    self.decode_fns = decode_fns
    self.paged_decode_fns = paged_decode_fns
    self.engine: Any = None      # a RolloutEngine, ReplicatedEngine or VllmEngine
    self._engine_takes_policy_part = False
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
    self._sample = jax.jit(sample, static_argnums=0,
                           static_argnames=("max_new_tokens", "greedy", "top_k"))

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

  def use_engine(self, *, max_slots: int, max_len: int, page_size: int = 16,
                 max_prompt_len: int | None = None, prefill_rows: int = 1) -> None:
    """Generates through a :class:`~jaxrl_llm.rollout.RolloutEngine` of ``max_slots``
    slots from now on (continuous batching, paged KV cache, a group's prompt prefilled
    once); ``max_len`` bounds prompt + completion. ``max_prompt_len`` (when known)
    sizes the prefill chunk: the smallest power of two that holds it, at most 128, so
    short prompts are not prefilled in 128-token chunks. ``prefill_rows``: the engine's
    prompts per prefill call (1: each alone, the earlier numbers).

    Raises:
      ValueError: the model provides no paged protocol (``paged_decode_fns``).
    """
    if self.paged_decode_fns is None:
      raise ValueError("this policy's model has no paged decode protocol "
                       "(`paged_decode_fns`): generate with sample (--rollout simple).")
    chunk = _MAX_PREFILL_CHUNK
    if max_prompt_len is not None:
      chunk = min(chunk, 1 << max(max_prompt_len - 1, 0).bit_length())
    self.engine = RolloutEngine(self.paged_decode_fns, max_slots=max_slots,
                                max_len=max_len, page_size=page_size, prefill_chunk=chunk,
                                prefill_rows=prefill_rows)

  def use_vllm(self, engine: Any) -> None:
    """Generates through ``engine`` (a :class:`~jaxrl_llm.rollout.vllm.VllmEngine`)
    from now on. It gets the policy's weights alone (:meth:`ref_params`: no value head,
    no critic), pushed whenever :meth:`generate` is called with params other than the
    ones pushed last (so after every train step); a failed push raises
    :class:`~jaxrl_llm.rollout.vllm.VllmPushError`, which stops the run before a step
    trains on rollouts of stale weights."""
    self.engine = engine
    self._engine_takes_policy_part = True

  def rollout_stats(self) -> dict[str, float]:
    """The rollout backend's metrics since the last call (vLLM: ``vllm_push_s``, the
    seconds spent pushing weights, and ``vllm_pushes``); empty for the JAX engines."""
    take = getattr(self.engine, "take_stats", None)
    return {} if take is None else take()

  def generate(self, params: Any, tokens: Any, mask: Any, rng: jax.Array | None, *,
               max_new_tokens: int, eos_id: int | Sequence[int] | None,
               temperature: float = _TEMPERATURE, greedy: bool = False,
               n: int = 1, first_request: int = 0) -> SampleOutput:
    """``n`` completions of each prompt row of ``tokens`` ``[B, P]`` (left-padded,
    ``mask`` 1 = real token), as one rectangular :class:`~jaxrl_llm.rollout.SampleOutput`
    of ``B * n`` rows: row ``i``'s samples are rows ``i * n .. i * n + n - 1``.

    Through the engine (:meth:`use_engine`) when one is set: each prompt is one
    :class:`~jaxrl_llm.rollout.Request` with ``n`` samples, keyed by an int seed drawn
    from ``rng`` (0 when greedy); else through :func:`jaxrl_llm.rollout.sample` over
    the ``n``-times repeated rows with ``rng``. The two draw different samples from the
    same distribution; greedy tokens are the same.

    ``first_request`` (engine only): the index of row 0 in the engine's draw keys, so
    that a process generating rows ``[a, b)`` of a batch with ``first_request=a`` draws
    what one call over the whole batch draws for them (multi-host rollouts).
    """
    if self._rollout_params is not None:
      params = self._rollout_params(params)
    if self.engine is not None:
      return self._generate_with_engine(params, tokens, mask, rng, n=n,
                                        max_new_tokens=max_new_tokens, eos_id=eos_id,
                                        temperature=temperature, greedy=greedy,
                                        first_request=first_request)
    if first_request:
      raise ValueError("`first_request` needs the rollout engine (use_engine): the "
                       "rectangular sampler draws with one key over all rows.")
    tokens, mask = np.repeat(tokens, n, axis=0), np.repeat(mask, n, axis=0)
    return self._sample(self.decode_fns, params, jnp.asarray(tokens), jnp.asarray(mask),
                        rng, max_new_tokens=max_new_tokens, temperature=temperature,
                        greedy=greedy, eos_id=eos_id, pad_id=self.pad_id)

  def _generate_with_engine(self, params: Any, tokens: Any, mask: Any,
                            rng: jax.Array | None, *, n: int, max_new_tokens: int,
                            eos_id: int | Sequence[int] | None, temperature: float,
                            greedy: bool, first_request: int = 0) -> SampleOutput:
    assert self.engine is not None
    tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, np.float32)
    eos_ids = None if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    requests = [Request(row[keep > 0].tolist(), n=n, max_new_tokens=max_new_tokens,
                        temperature=0.0 if greedy else float(temperature),
                        eos_ids=eos_ids) for row, keep in zip(tokens, mask)]
    seed = 0 if greedy or rng is None else int(
        jax.random.randint(rng, (), 0, np.iinfo(np.int32).max))
    if self._engine_takes_policy_part:
      params = self.ref_params(params)
    completions = self.engine.generate(params, requests, seed=seed,
                                       first_request=first_request)
    return completions_to_sample_output(completions, np.repeat(tokens, n, axis=0),
                                        np.repeat(mask, n, axis=0),
                                        max_new_tokens=max_new_tokens, pad_id=self.pad_id)


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
