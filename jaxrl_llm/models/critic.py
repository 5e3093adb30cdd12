r"""A separate critic: its own parameters (and, through :mod:`jaxrl_llm.train.optim`,
its own optimizer and learning rate).

Beside the shared-trunk value head (one :class:`~jaxrl_llm.models.Transformer` with
``value_head=True``), PPO on LLMs usually trains a *separate* critic, a second
transformer with a value head, initialised from the policy checkpoint or from a
reward model (verl's ``critic`` worker, OpenRLHF's ``CriticModel``, NeMo-RL). Here it
is a parameter layout, not a new train step:

* parameters ``{"policy": policy_params, "critic": critic_params}``;
* :func:`actor_critic_apply` is an ``apply_fn`` with the usual protocol
  ``(params, tokens, positions, attention_mask) -> (hidden, values, lm_head)``:
  ``hidden`` and ``lm_head`` from the policy, ``values`` from the critic;
* :func:`jaxrl_llm.train.actor_critic_optimizer` is ``optax.multi_transform`` with one
  optimizer per part (so each has its own learning rate, schedule, clipping and state).

:func:`jaxrl_llm.train.make_train_step` (``use_value=True``) then runs unchanged: its
loss :math:`\mathcal{L} = \mathcal{L}_{pg}(\theta) + c_v\,\mathcal{L}_{v}(\phi)` splits
into a policy part (no critic parameter in it) and a critic part (no policy
parameter), so :math:`\nabla_\theta \mathcal{L} = \nabla_\theta \mathcal{L}_{pg}` and
:math:`\nabla_\phi \mathcal{L} = c_v \nabla_\phi \mathcal{L}_v`: the two updates are
independent, as with two train steps, without a second copy of the loss code. With
Adam-type critic optimizers ``vf_coef`` only rescales the critic's gradient (Adam is
scale invariant up to its epsilon); set the critic's step size with its learning rate.
``grad_norm`` in the metrics is the norm over both parts.

Examples:
  >>> import jax, jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> from jaxrl_llm.models import Transformer, TransformerConfig, split_model
  >>> pg, pp = split_model(Transformer(TransformerConfig.tiny(32, value_head=False)))
  >>> cg, cp = split_model(Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(1)))
  >>> apply = actor_critic_apply(pg, cg)
  >>> params = actor_critic_params(pp, cp)
  >>> hidden, values, lm_head = apply(params, jnp.ones((2, 5), jnp.int32))
  >>> hidden.shape, values.shape, lm_head.shape
  ((2, 5, 64), (2, 5), (64, 32))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxrl_llm.models.transformer import Transformer, make_apply_fn, split_model

POLICY, CRITIC = "policy", "critic"
VALUE_HEAD_PARAMS = ("value_w", "value_b")


def actor_critic_params(policy_params: Any, critic_params: Any) -> dict:
  """``{"policy": policy_params, "critic": critic_params}``, the layout the functions
  of this module (and :func:`jaxrl_llm.train.actor_critic_optimizer`'s labels) expect."""
  return {POLICY: policy_params, CRITIC: critic_params}


def actor_critic_apply(policy_graphdef: nnx.GraphDef, critic_graphdef: nnx.GraphDef) -> Callable:
  """An ``apply_fn`` over :func:`actor_critic_params`: policy hidden states and LM head,
  critic values.

  Args:
    policy_graphdef: graphdef of the policy (:func:`~jaxrl_llm.models.split_model`).
    critic_graphdef: graphdef of the critic, a model with a value head; only its
      trunk and value head are used (its LM head never is).

  Returns:
    ``apply(params, tokens, positions=None, attention_mask=None) ->
    (hidden [B, T, D], values [B, T], lm_head [D, V])``, pure in ``params``.

  Raises:
    ValueError: at trace time, if the critic returns no values (no value head).
  """
  policy_apply = make_apply_fn(policy_graphdef)
  critic_apply = make_apply_fn(critic_graphdef)

  def apply(params, tokens, positions=None, attention_mask=None, segment_ids=None):
    hidden, _, lm_head = policy_apply(params[POLICY], tokens, positions, attention_mask,
                                      segment_ids)
    _, values, _ = critic_apply(params[CRITIC], tokens, positions, attention_mask,
                                segment_ids)
    if values is None:
      raise ValueError("the critic has no value head: build it with value_head=True "
                       "(e.g. from_pretrained(path, value_head=True)).")
    return hidden, values, lm_head

  return apply


def drop_value_head(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[Any, Any]:
  """``(graphdef, params)`` of the same :class:`~jaxrl_llm.models.Transformer` without
  its value head: what the policy's log-probs (e.g. a frozen KL reference) need.

  ``make_apply_fn`` of the returned graphdef over the returned params gives the same
  hidden states and LM head as the full model, and ``values`` None. A model without a
  value head is returned as is. No parameter is copied (the leaves are shared).

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxrl_llm.models import Transformer, TransformerConfig, split_model
    >>> graphdef, params = split_model(Transformer(TransformerConfig.tiny(32)))
    >>> ref_graphdef, ref_params = drop_value_head(graphdef, params)
    >>> sorted(ref_params.keys())
    ['blocks', 'embed', 'final_norm']
    >>> tokens = jnp.ones((1, 4), jnp.int32)
    >>> h, values, _ = make_apply_fn(ref_graphdef)(ref_params, tokens)
    >>> values is None, bool(jnp.all(h == make_apply_fn(graphdef)(params, tokens)[0]))
    (True, True)
  """
  config = nnx.merge(graphdef, params).config
  if not config.value_head:
    return graphdef, params
  policy_config = dataclasses.replace(config, value_head=False)
  ref_graphdef, _ = split_model(nnx.eval_shape(
      lambda: Transformer(policy_config, rngs=nnx.Rngs(0))))
  keep = nnx.Not(nnx.Any(*(nnx.PathContains(name) for name in VALUE_HEAD_PARAMS)))
  return ref_graphdef, nnx.filter_state(params, keep)


def actor_critic_labels(params: Any) -> dict:
  """``"policy"`` / ``"critic"`` per leaf of :func:`actor_critic_params` (ValueError for
  any other pytree): the labels of :func:`jaxrl_llm.train.actor_critic_optimizer`.

  Examples:
    >>> actor_critic_labels(actor_critic_params({"w": 1.0}, {"v": 2.0}))
    {'policy': {'w': 'policy'}, 'critic': {'v': 'critic'}}
  """
  if not isinstance(params, dict) or set(params) != {POLICY, CRITIC}:
    keys = sorted(params) if isinstance(params, dict) else type(params).__name__
    raise ValueError(f"actor-critic params must be a dict with keys "
                     f"['critic', 'policy'], got {keys}.")
  return {name: jax.tree_util.tree_map(lambda _, n=name: n, part)
          for name, part in params.items()}


def value_param_labels(params: Any) -> Any:
  """``"policy"`` / ``"critic"`` per leaf: which parameters are the value function's.

  Actor-critic parameters (:func:`actor_critic_params`): the ``critic`` part. Any
  other pytree (a shared-trunk model): the value head (the top-level entries
  ``value_w`` / ``value_b`` of :class:`~jaxrl_llm.models.Transformer`); the trunk is
  the policy's, trained by both losses.

  Examples:
    >>> value_param_labels({"value_w": 1.0, "embed": 2.0})
    {'embed': 'policy', 'value_w': 'critic'}
  """
  if isinstance(params, dict) and set(params) == {POLICY, CRITIC}:
    return actor_critic_labels(params)

  def label(path, _):
    first = path[0] if path else None
    name = getattr(first, "key", getattr(first, "name", None))
    return CRITIC if name in VALUE_HEAD_PARAMS else POLICY

  return jax.tree_util.tree_map_with_path(label, params)


__all__ = ["actor_critic_apply", "actor_critic_labels", "actor_critic_params",
           "drop_value_head", "value_param_labels", "POLICY", "CRITIC", "VALUE_HEAD_PARAMS"]
