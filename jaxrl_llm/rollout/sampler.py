"""KV-cache sampler: one prefill, then a ``lax.while_loop`` of one-token decodes.

The sampler is model-agnostic. It consumes a :class:`~jaxrl_llm.models.DecodeFns`
(``init_cache``, ``prefill``, ``decode``: pure functions of ``params`` returning float32
next-token logits); :func:`jaxrl_llm.models.make_decode_fns` builds them for the
reference transformer.

Padding convention: prompts are LEFT-padded (``prompt_mask`` ``[B, P]``, 1 = real
token), so every row's prompt ends at column ``P - 1`` and all rows decode into the
same cache slot each step, and ``SampleOutput.tokens`` / ``SampleOutput.mask`` are
ready for the usual shift-by-one re-scoring (the logits at column t predict the token
at column t + 1). The reference model reads each row's last *real* prompt token and
derives RoPE positions from ``cumsum(mask)``, so right-padded prompts give the same
completions and log-probs too; but their ``tokens`` then have a hole between prompt and
completion, and shift-by-one re-scoring of the first completion token would read a
padded column. Left-pad prompts that are to be trained on.

Log-prob convention: ``logprobs[b, n]`` is the log-probability of the sampled token
under the temperature-scaled *full* distribution,

.. math::

  \\log \\pi(y_n \\mid x, y_{<n}) = \\mathrm{log\\_softmax}(z_n / \\tau)[y_n],

so it matches a train-side ``token_logprobs`` of the same tokens (with logits divided
by the same temperature). ``top_k`` / ``top_p`` only filter what may be *sampled*; they
do not renormalise the reported log-probs.

``sampling_logprobs[b, n]`` is the log-probability under the distribution the token
was actually drawn from: temperature, then ``top_k`` / ``top_p`` filtering,
renormalised (0 under greedy decoding, a point mass). It is the behaviour log-prob a
rollout-mismatch correction (:func:`jaxrl_llm.rollout_correction_weights`) needs when
sampling is filtered: the importance ratio of the trained (unfiltered) policy to this
distribution is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v
from jaxrl_llm.rollout.protocol import DecodeFns

if TYPE_CHECKING:
  import numpy as np

_NEG = -1e30
_MIN_TEMPERATURE = 1e-6


class SampleOutput(NamedTuple):
  """Result of :func:`sample` (a pytree of arrays).

  Attributes:
    tokens: ``[B, P + N]`` int32, the prompt followed by the completion.
    mask: ``[B, P + N]`` float32, ``concat(prompt_mask, completion_mask)``: the
      attention mask to re-score ``tokens`` with.
    completion: ``[B, N]`` int32 generated tokens; ``pad_id`` after EOS.
    completion_mask: ``[B, N]`` float32, 1 for generated tokens up to and including
      EOS, 0 after.
    logprobs: ``[B, N]`` float32 sampler log-probs (see the module docstring); 0 where
      ``completion_mask`` is 0.
    lengths: ``[B]`` int32, number of generated tokens (EOS included).
    finished: ``[B]`` bool, the row emitted one of the ``eos_id`` s (False when it was
      cut at ``max_new_tokens`` or no ``eos_id`` was given).
    sampling_logprobs: ``[B, N]`` float32 log-probs under the filtered distribution
      the tokens were drawn from (see the module docstring); 0 where
      ``completion_mask`` is 0 and under greedy decoding.
  """

  tokens: jax.Array
  mask: jax.Array
  completion: jax.Array
  completion_mask: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finished: jax.Array
  sampling_logprobs: jax.Array


def filter_logits(logits: ArrayLike, *, top_k: int | None = None,
                  top_p: ArrayLike | None = None) -> jax.Array:
  r"""Sets logits outside the top-k and the top-p nucleus to a large negative value.

  ``top_k`` keeps the k largest logits of each row (ties at the k-th value are all
  kept). ``top_p`` keeps the smallest prefix of the descending-sorted tokens whose
  probability mass reaches ``top_p``: token :math:`i` (in sorted order) is kept iff
  :math:`\sum_{j<i} p_j < \mathrm{top\_p}`, so the most likely token is always kept and
  ``top_p >= 1`` keeps everything. ``top_p`` is applied after ``top_k``.

  Args:
    logits: ``[B, V]`` float logits (already temperature-scaled).
    top_k: static int >= 1, or None.
    top_p: scalar or ``[B]`` traced float, or None.

  Returns:
    ``[B, V]`` float32 filtered logits.

  Examples:
    >>> import jax.numpy as jnp
    >>> z = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    >>> (filter_logits(z, top_p=0.7) > -1e29).astype(int).tolist()
    [[1, 1, 0]]
    >>> (filter_logits(z, top_k=1) > -1e29).astype(int).tolist()
    [[1, 0, 0]]
  """
  v.check_rank("logits", logits, 2)
  logits = v.as_f32(logits)
  batch, vocab = logits.shape
  if top_k is not None:
    if not isinstance(top_k, int) or top_k < 1:
      raise ValueError(f"`top_k` must be a static int >= 1 or None, got {top_k!r}.")
    if top_k < vocab:
      kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
      logits = jnp.where(logits < kth, _NEG, logits)
  if top_p is not None:
    top_p = jnp.broadcast_to(v.as_f32(top_p), (batch,))[:, None]
    sorted_logits = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1.0) | (jnp.arange(vocab) == 0)[None]
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, _NEG, logits)
  return logits


def _pick(logits, rng, step, temperature, *, top_k, top_p, greedy):
  """One token per row, its log-prob under ``log_softmax(logits / temperature)`` and
  under the filtered distribution it was drawn from (0 when greedy)."""
  logits = v.as_f32(logits)
  # Shift before scaling: exact 0 at the argmax even for a tiny temperature.
  scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  if greedy:
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling_logp = jnp.zeros(token.shape, jnp.float32)
  else:
    key = jax.random.fold_in(rng, step)
    filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
    token = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    sampling_logp = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1),
                                        token[:, None], axis=-1)[:, 0]
  logp = jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]
  return token, logp, sampling_logp


def _eos_array(eos_id) -> jax.Array:
  """``eos_id`` (an int, a sequence of ints or an int array of rank <= 1) as ``[E]``
  int32; raises ``ValueError`` naming it otherwise."""
  if isinstance(eos_id, (list, tuple)):
    if not eos_id:
      raise ValueError("`eos_id` must be an int, a non-empty sequence of ints or None, "
                       "got an empty sequence.")
    eos_id = jnp.stack([jnp.asarray(i) for i in eos_id])
  dtype = jnp.result_type(eos_id)
  shape = v.shape_of(eos_id)
  if not jnp.issubdtype(dtype, jnp.integer) or len(shape) > 1 or 0 in shape:
    raise ValueError(f"`eos_id` must be an int, a non-empty sequence of ints or None, "
                     f"got dtype {dtype} with shape {shape}.")
  return jnp.atleast_1d(jnp.asarray(eos_id, jnp.int32))


def sample(fns: DecodeFns, params: Any, prompt_tokens: jax.Array | np.ndarray,
           prompt_mask: ArrayLike, rng: jax.Array | None, *, max_new_tokens: int,
           temperature: ArrayLike = 1.0, top_k: int | None = None,
           top_p: ArrayLike | None = None, greedy: bool = False,
           eos_id: int | Sequence[int] | ArrayLike | None = None,
           pad_id: int = 0) -> SampleOutput:
  r"""Autoregressive sampling with a KV cache.

  One ``fns.prefill`` over the prompt, then up to ``max_new_tokens - 1``
  ``fns.decode`` calls inside a ``lax.while_loop`` that stops early once every row has
  emitted an end-of-sequence id. Step ``n`` draws

  .. math::

    y_n \sim \mathrm{softmax}\big(\mathrm{filter}_{k,p}(z_n / \tau)\big), \qquad
    \text{or } y_n = \arg\max z_n \text{ if greedy},

  with the key ``fold_in(rng, n)``, and records
  :math:`\log \mathrm{softmax}(z_n / \tau)[y_n]` (the unfiltered, temperature-scaled
  distribution, so it matches train-side log-probs of the same tokens). A row stops at
  its first token in ``eos_id`` (one id, or several: Llama-3 ends a turn with either
  ``<|end_of_text|>`` or ``<|eot_id|>``, its ``generation_config.json`` lists both); the
  stop token is kept, with mask 1; later tokens are ``pad_id`` with mask 0 and
  log-prob 0. Rows that finished keep being fed ``pad_id`` (their results are
  discarded), so the batch stays rectangular.

  Static: ``max_new_tokens``, ``top_k``, ``greedy``, whether ``top_p`` / ``eos_id``
  are None and how many eos ids there are. Traced: ``temperature`` and ``top_p``
  (scalars or ``[B]``), the eos id values, ``pad_id``. Data faults: ``temperature <= 0``
  is treated as ``1e-6`` (effectively greedy, finite log-probs); a row with an empty
  prompt samples from whatever logits the model gives there (all-zero, i.e. uniform,
  for the reference transformer).

  Args:
    fns: :class:`~jaxrl_llm.models.DecodeFns` (``init_cache``, ``prefill``,
      ``decode``); for the reference model ``make_decode_fns(graphdef)``.
    params: the parameter pytree passed to each of ``fns``.
    prompt_tokens: ``[B, P]`` int prompts, left-padded (see the module docstring).
    prompt_mask: ``[B, P]``, 1 = real prompt token.
    rng: a ``jax.random`` key (may be None when ``greedy``).
    max_new_tokens: N >= 1, the number of tokens to generate (static).
    temperature: :math:`\tau`, scalar or ``[B]``.
    top_k: keep only the k most likely tokens when sampling (static int or None).
    top_p: nucleus mass, scalar or ``[B]``, or None.
    greedy: take the argmax instead of sampling (``rng``, ``top_k``, ``top_p`` unused).
    eos_id: the end-of-sequence id: an int, a sequence of ints or an int array
      ``[E]`` (a row stops at any of them), or None for fixed-length completions.
    pad_id: id written after EOS.

  Returns:
    A :class:`SampleOutput`.

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxrl_llm.models import (Transformer, TransformerConfig, make_decode_fns,
    ...                               split_model)
    >>> graphdef, params = split_model(
    ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> run = jax.jit(functools.partial(sample, make_decode_fns(graphdef)),
    ...               static_argnames=("max_new_tokens", "top_k", "greedy"))
    >>> prompts = jnp.array([[0, 0, 3, 4], [5, 6, 7, 8]])   # row 0 left-padded
    >>> out = run(params, prompts, prompts > 0, jax.random.key(0), max_new_tokens=6,
    ...           temperature=0.7, top_p=0.9, eos_id=2)
    >>> out.tokens.shape, out.completion_mask.shape, out.lengths.shape
    ((2, 10), (2, 6), (2,))
    >>> out = run(params, prompts, prompts > 0, None, max_new_tokens=6, greedy=True,
    ...           eos_id=(2, 7))                        # stop at either id
    >>> stops = (out.completion == 2) | (out.completion == 7)
    >>> bool(jnp.all(out.finished == jnp.any(stops, axis=1)))
    True
  """
  v.check_rank("prompt_tokens", prompt_tokens, 2)
  if not jnp.issubdtype(jnp.result_type(prompt_tokens), jnp.integer):
    raise ValueError(
        f"`prompt_tokens` must be an integer array, got dtype "
        f"{jnp.result_type(prompt_tokens)} with shape {v.shape_of(prompt_tokens)}.")
  v.check_same_shape(("prompt_tokens", "prompt_mask"), (prompt_tokens, prompt_mask))
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"`max_new_tokens` must be a static int >= 1, got {max_new_tokens!r}.")
  if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
    raise ValueError(f"`top_k` must be a static int >= 1 or None, got {top_k!r}.")
  batch, prompt_len = v.shape_of(prompt_tokens)
  eos_ids = None if eos_id is None else _eos_array(eos_id)
  for name, value in (("temperature", temperature), ("top_p", top_p)):
    if value is not None and v.shape_of(value) not in ((), (batch,)):
      raise ValueError(
          f"`{name}` must be a scalar or have shape ({batch},), got {v.shape_of(value)}.")

  n = max_new_tokens
  prompt_tokens = prompt_tokens.astype(jnp.int32)
  prompt_mask = v.as_f32(prompt_mask)
  temp = jnp.maximum(jnp.broadcast_to(v.as_f32(temperature), (batch,)),
                     _MIN_TEMPERATURE)[:, None]
  pad = jnp.asarray(pad_id, jnp.int32)
  pick = lambda logits, step: _pick(logits, rng, step, temp, top_k=top_k, top_p=top_p,
                                    greedy=greedy)

  def record(step, token, logp, sampling_logp, done, bufs):
    """Writes column ``step``; returns the updated (done, bufs) and the fed token."""
    toks, logps, masks, sampling_logps = bufs
    live = ~done
    token = jnp.where(live, token, pad)

    def put(buf, col):
      return jax.lax.dynamic_update_slice(buf, col[:, None], (0, step))

    toks = put(toks, token)
    logps = put(logps, jnp.where(live, logp, 0.0))
    masks = put(masks, live.astype(jnp.float32))
    sampling_logps = put(sampling_logps, jnp.where(live, sampling_logp, 0.0))
    if eos_ids is not None:
      done = done | jnp.any(token[:, None] == eos_ids[None, :], axis=1)
    return token, done, (toks, logps, masks, sampling_logps)

  cache = fns.init_cache(params, batch, prompt_len + n - 1)
  logits, cache = fns.prefill(params, prompt_tokens, prompt_mask, cache)
  bufs = (jnp.full((batch, n), pad, jnp.int32), jnp.zeros((batch, n), jnp.float32),
          jnp.zeros((batch, n), jnp.float32), jnp.zeros((batch, n), jnp.float32))
  token, logp, sampling_logp = pick(logits, 0)
  token, done, bufs = record(0, token, logp, sampling_logp, jnp.zeros((batch,), bool),
                             bufs)

  def cond(carry):
    step, _, _, done, _ = carry
    return (step < n) & ~jnp.all(done)

  def body(carry):
    step, token, cache, done, bufs = carry
    logits, cache = fns.decode(params, token, cache)
    token, logp, sampling_logp = pick(logits, step)
    token, done, bufs = record(step, token, logp, sampling_logp, done, bufs)
    return step + 1, token, cache, done, bufs

  carry = (jnp.asarray(1, jnp.int32), token, cache, done, bufs)
  _, _, _, done, (completion, logprobs, completion_mask, sampling_logprobs) = (
      jax.lax.while_loop(
          cond, body, carry))

  finished = done if eos_ids is not None else jnp.zeros((batch,), bool)
  return SampleOutput(
      tokens=jnp.concatenate([prompt_tokens, completion], axis=1),
      mask=jnp.concatenate([prompt_mask, completion_mask], axis=1),
      completion=completion,
      completion_mask=completion_mask,
      logprobs=logprobs,
      lengths=jnp.sum(completion_mask, axis=1).astype(jnp.int32),
      finished=finished,
      sampling_logprobs=sampling_logprobs,
  )
