"""A policy model as pure, jitted functions of a params pytree (the trainer's model).

Any model that follows the two protocols can be trained by
:func:`jaxrl_llm.trainer.run_training`: the train step's forward
``apply_fn(params, tokens, positions, attention_mask)`` (see
:func:`jaxrl_llm.train.policy_forward`) and the sampler's
:class:`~jaxrl_llm.rollout.DecodeFns`. :meth:`Policy.reference` builds the reference
transformer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.rollout import DecodeFns, SampleOutput, sample
from jaxrl_llm.train import policy_forward


class Policy:
  """A model as jitted ``forward`` (log-probs, entropies, values) and ``generate``.

  Args:
    apply_fn: the pure forward of the model protocol.
    decode_fns: the model's :class:`~jaxrl_llm.rollout.DecodeFns`.
    init_params: the initial parameter pytree.
    pad_id: token id written after a completion ends.
    temperature: the temperature log-probs are computed at (the sampling one).
  """

  def __init__(self, apply_fn: Callable[..., Any], decode_fns: DecodeFns,
               init_params: Any, *, pad_id: int, temperature: float = 1.0):
    self.apply = apply_fn
    self.decode_fns = decode_fns
    self.init_params = init_params
    self.pad_id = pad_id
    self.temperature = temperature
    self.forward = jax.jit(lambda params, batch: policy_forward(
        apply_fn, params, batch, temperature=temperature))
    self._sample = jax.jit(sample, static_argnums=0,
                           static_argnames=("max_new_tokens", "greedy", "top_k"))

  @classmethod
  def reference(cls, model: str, vocab_size: int, max_len: int, pad_id: int, *,
                value_head: bool, seed: int = 0, temperature: float = 1.0) -> "Policy":
    """The reference transformer preset ``model`` (``tiny`` / ``small``)."""
    from jaxrl_llm.models.transformer import (Transformer, get_config, make_apply_fn,
                                              make_decode_fns, split_model)
    cfg = get_config(model, vocab_size, value_head=value_head,
                     max_seq_len=max(max_len, 8))
    graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(seed)))
    return cls(make_apply_fn(graphdef), make_decode_fns(graphdef), params,
               pad_id=pad_id, temperature=temperature)

  def generate(self, params: Any, tokens: Any, mask: Any, rng: Optional[jax.Array], *,
               max_new_tokens: int, eos_id: Optional[int | Sequence[int]],
               temperature: float = 1.0,
               greedy: bool = False) -> SampleOutput:
    """Samples completions of the prompts ``tokens`` (see :func:`jaxrl_llm.rollout.sample`)."""
    return self._sample(self.decode_fns, params, jnp.asarray(tokens), jnp.asarray(mask),
                        rng, max_new_tokens=max_new_tokens, temperature=temperature,
                        greedy=greedy, eos_id=eos_id, pad_id=self.pad_id)


__all__ = ["Policy"]
