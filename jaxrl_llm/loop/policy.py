"""A policy model as pure, jitted functions of a params pytree (the trainer's model).

Any model that follows the two protocols can be trained by
:func:`jaxrl_llm.loop.run.run_training`: the train step's forward
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

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.rollout import DecodeFns, SampleOutput, sample
from jaxrl_llm.train import TrainConfig, policy_forward

# The defaults of the run's settings (declared once, in the configs).
_TEMPERATURE: float = TrainConfig.temperature
_SEED: int = RunConfig.seed


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
  """

  def __init__(self, apply_fn: Callable[..., Any], decode_fns: DecodeFns,
               init_params: Any, *, pad_id: int, temperature: float = _TEMPERATURE,
               ref_apply_fn: Optional[Callable[..., Any]] = None,
               ref_part: Optional[Callable[[Any], Any]] = None):
    self.apply = apply_fn
    self.decode_fns = decode_fns
    self.init_params = init_params
    self.pad_id = pad_id
    self.temperature = temperature
    self._ref_part = ref_part
    self.forward = jax.jit(lambda params, batch: policy_forward(
        apply_fn, params, batch, temperature=temperature))
    self.ref_forward = self.forward if ref_apply_fn is None else jax.jit(
        lambda params, batch: policy_forward(ref_apply_fn, params, batch,
                                             temperature=temperature))
    self._sample = jax.jit(sample, static_argnums=0,
                           static_argnames=("max_new_tokens", "greedy", "top_k"))

  @classmethod
  def reference(cls, model: str, vocab_size: int, max_len: int, pad_id: int, *,
                value_head: bool, seed: int = _SEED, temperature: float = _TEMPERATURE) -> "Policy":
    """The reference transformer preset ``model`` (``tiny`` / ``small``)."""
    from jaxrl_llm.models.transformer import Transformer, get_config, split_model
    cfg = get_config(model, vocab_size, value_head=value_head,
                     max_seq_len=max(max_len, 8))
    graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(seed)))
    return cls.of_transformer(graphdef, params, pad_id=pad_id, temperature=temperature)

  @classmethod
  def of_transformer(cls, graphdef: Any, params: Any, *, pad_id: int,
                     temperature: float = _TEMPERATURE) -> "Policy":
    """A :class:`~jaxrl_llm.models.Transformer` (``split_model`` output) as a policy;
    its KL reference is the same model without the value head."""
    from jaxrl_llm.models.critic import drop_value_head
    from jaxrl_llm.models.transformer import make_apply_fn, make_decode_fns
    ref_graphdef, _ = drop_value_head(graphdef, params)
    if ref_graphdef is graphdef:        # no value head: the reference is the model
      return cls(make_apply_fn(graphdef), make_decode_fns(graphdef), params,
                 pad_id=pad_id, temperature=temperature)
    return cls(make_apply_fn(graphdef), make_decode_fns(graphdef), params,
               pad_id=pad_id, temperature=temperature,
               ref_apply_fn=make_apply_fn(ref_graphdef),
               ref_part=lambda p: drop_value_head(graphdef, p)[1])

  def ref_params(self, params: Any) -> Any:
    """The part of ``params`` the frozen KL reference keeps (the policy's weights:
    no value head, no critic); :attr:`ref_forward` takes it. The leaves are shared
    with ``params`` (copy them before a train step donates ``params``)."""
    return params if self._ref_part is None else self._ref_part(params)

  def generate(self, params: Any, tokens: Any, mask: Any, rng: Optional[jax.Array], *,
               max_new_tokens: int, eos_id: Optional[int | Sequence[int]],
               temperature: float = _TEMPERATURE,
               greedy: bool = False) -> SampleOutput:
    """Samples completions of the prompts ``tokens`` (see :func:`jaxrl_llm.rollout.sample`)."""
    return self._sample(self.decode_fns, params, jnp.asarray(tokens), jnp.asarray(mask),
                        rng, max_new_tokens=max_new_tokens, temperature=temperature,
                        greedy=greedy, eos_id=eos_id, pad_id=self.pad_id)


__all__ = ["Policy"]
