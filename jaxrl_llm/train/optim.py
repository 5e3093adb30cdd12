r"""Optimizers for policy and value parameters: one per part, and critic warm-up.

The parameter layouts are :mod:`jaxrl_llm.models.critic`'s: actor-critic parameters
``{"policy": ..., "critic": ...}`` (a separate critic) or one model whose value head
(``value_w`` / ``value_b``) is the value function's part. Each part gets its own optax
transformation (``optax.multi_transform``), so its own learning rate, schedule,
clipping and state.

Examples:
  >>> import jax.numpy as jnp, optax
  >>> params = {"policy": {"w": jnp.ones(2)}, "critic": {"v": jnp.ones(2)}}
  >>> opt = actor_critic_optimizer(optax.sgd(0.1), optax.sgd(1.0))
  >>> updates, _ = opt.update(params, opt.init(params))
  >>> updates["policy"]["w"].tolist(), updates["critic"]["v"].tolist()
  ([-0.1, -0.1], [-1.0, -1.0])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.models.critic import CRITIC, POLICY, actor_critic_labels, value_param_labels


def actor_critic_optimizer(policy_optimizer: optax.GradientTransformation,
                           critic_optimizer: optax.GradientTransformation
                           ) -> optax.GradientTransformation:
  """One optimizer per part of :func:`actor_critic_params` (``optax.multi_transform``).

  Each part gets its own learning rate, schedule, gradient clipping and state; e.g.
  ``actor_critic_optimizer(optax.chain(optax.clip_by_global_norm(1.0),
  optax.adamw(1e-6)), optax.adamw(1e-5))`` (verl's defaults: critic lr 10x actor lr).
  """
  return optax.multi_transform({POLICY: policy_optimizer, CRITIC: critic_optimizer},
                               actor_critic_labels)


class FrozenState(NamedTuple):
  """State of :func:`freeze_for`: updates seen (saturating at n) and the inner state."""
  updates: jax.Array
  inner: Any


def freeze_for(inner: optax.GradientTransformation,
               num_updates: int) -> optax.GradientTransformation:
  """``inner``, but its first ``num_updates`` updates are exact no-ops.

  During them the parameters it updates stay bit-identical (the update is ``-0.0``,
  the exact additive identity) and ``inner``'s state does not move, so ``inner``
  starts afterwards as if fresh (Adam's moments and bias correction from zero).
  Used for critic warm-up (:func:`policy_value_optimizer`).

  Examples:
    >>> import jax.numpy as jnp
    >>> opt = freeze_for(optax.sgd(1.0), 1)
    >>> state = opt.init(jnp.ones(2))
    >>> u, state = opt.update(jnp.ones(2), state)
    >>> u2, _ = opt.update(jnp.ones(2), state)
    >>> u.tolist(), u2.tolist()
    ([-0.0, -0.0], [-1.0, -1.0])
  """
  if not isinstance(num_updates, int) or num_updates < 0:
    raise ValueError(f"`num_updates` must be an int >= 0, got {num_updates!r}.")

  def init(params):
    return FrozenState(jnp.zeros((), jnp.int32), inner.init(params))

  def update(updates, state, params=None):
    new_updates, new_inner = inner.update(updates, state.inner, params)
    active = state.updates >= num_updates
    out = jax.tree_util.tree_map(lambda u: jnp.where(active, u, jnp.full_like(u, -0.0)),
                                 new_updates)
    kept = jax.tree_util.tree_map(lambda a, b: jnp.where(active, a, b), new_inner,
                                  state.inner)
    return out, FrozenState(jnp.minimum(state.updates + 1, num_updates), kept)

  return optax.GradientTransformation(init, update)


def policy_value_optimizer(policy_optimizer: optax.GradientTransformation,
                           value_optimizer: optax.GradientTransformation, *,
                           warmup_updates: int = 0) -> optax.GradientTransformation:
  """One optimizer for the policy and one for the value parameters
  (:func:`~jaxrl_llm.models.critic.value_param_labels`), the policy's frozen for
  ``warmup_updates`` updates.

  Critic warm-up: during the first ``warmup_updates`` optimizer updates only the
  value parameters move (the separate critic; or, with a shared trunk, the value head
  alone: the trunk is the policy's and stays frozen too); the policy parameters stay
  bit-identical and the policy optimizer starts fresh afterwards
  (:func:`freeze_for`). With ``warmup_updates=0`` and actor-critic parameters this
  is :func:`actor_critic_optimizer`.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"value_w": jnp.ones(1), "embed": jnp.ones(1)}
    >>> opt = policy_value_optimizer(optax.sgd(1.0), optax.sgd(0.5), warmup_updates=1)
    >>> state = opt.init(params)
    >>> grads = {"value_w": jnp.ones(1), "embed": jnp.ones(1)}
    >>> u, state = opt.update(grads, state, params)
    >>> float(u["embed"][0]), float(u["value_w"][0])
    (-0.0, -0.5)
  """
  if warmup_updates:
    policy_optimizer = freeze_for(policy_optimizer, warmup_updates)
  return optax.multi_transform({POLICY: policy_optimizer, CRITIC: value_optimizer},
                               value_param_labels)


__all__ = ["actor_critic_optimizer", "policy_value_optimizer", "freeze_for", "FrozenState"]
