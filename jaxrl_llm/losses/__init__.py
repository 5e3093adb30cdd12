r"""Per-token policy losses, value loss, KL estimators, entropy, rollout correction and
aggregation, re-exported flat (``from jaxrl_llm.losses import ppo_policy_loss``).

One module per topic, as optax splits its losses:

=======================================  ==================================================
module                                   names
=======================================  ==================================================
:mod:`jaxrl_llm.losses.policy`           ``ppo_policy_loss``, ``gspo_policy_loss``,
                                         ``cispo_policy_loss`` (``cispo_trl_policy_loss``,
                                         ``cispo_verl_policy_loss``), ``sapo_policy_loss``,
                                         ``gmpo_policy_loss``, ``reinforce_policy_loss``
:mod:`jaxrl_llm.losses.value`            ``value_loss``
:mod:`jaxrl_llm.losses.divergence`       ``kl_penalty``, ``KL_KINDS``,
                                         ``entropy_from_logits``
:mod:`jaxrl_llm.losses.aggregation`      ``aggregate``, ``aggregate_parts``,
                                         ``AGGREGATION_MODES``
:mod:`jaxrl_llm.losses.correction`       ``rollout_correction_weights``
=======================================  ==================================================

Policy losses return ``(per_token_loss, metrics)`` with the same metric keys (see
:mod:`jaxrl_llm.losses.policy`); reduce a per-token loss with :func:`aggregate` (or
:func:`aggregate_parts` for microbatches and devices). Coefficients (``clip_low``,
``clip_high``, ``dual_clip``, temperatures, ``clamp``) are ordinary traced arguments,
so a schedule or a sweep does not recompile ("dynamic clipping": epsilon annealed from
0.2 early to 0.05 late):

>>> import jax, jax.numpy as jnp, optax
>>> schedule = optax.linear_schedule(0.2, 0.05, transition_steps=1000)
>>> def step_loss(step, logp, old_logp, adv, mask):
...   per_tok, _ = ppo_policy_loss(logp, old_logp, adv, mask, clip_low=schedule(step))
...   return aggregate(per_tok, mask, "token-mean")
>>> step_loss = jax.jit(step_loss)
>>> logp, mask = jnp.full((2, 3), -1.0), jnp.ones((2, 3))
>>> adv = jnp.array([1.0, -1.0])  # ratio e^0.5: loss (e^0.5 - 1 - eps) / 2
>>> [round(float(step_loss(s, logp, logp - 0.5, adv, mask)), 4) for s in (0, 500, 1000)]
[0.2244, 0.2619, 0.2994]
>>> step_loss._cache_size()  # one compilation for every step
1
"""

from jaxrl_llm.losses.aggregation import AGGREGATION_MODES, aggregate, aggregate_parts
from jaxrl_llm.losses.correction import rollout_correction_weights
from jaxrl_llm.losses.divergence import KL_KINDS, entropy_from_logits, kl_penalty
from jaxrl_llm.losses.policy import (
    cispo_policy_loss,
    cispo_trl_policy_loss,
    cispo_verl_policy_loss,
    gmpo_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    reinforce_policy_loss,
    sapo_policy_loss,
)
from jaxrl_llm.losses.value import value_loss

__all__ = [
    "ppo_policy_loss", "gspo_policy_loss", "cispo_policy_loss", "cispo_trl_policy_loss",
    "cispo_verl_policy_loss", "sapo_policy_loss",
    "gmpo_policy_loss", "reinforce_policy_loss", "value_loss", "kl_penalty", "KL_KINDS",
    "entropy_from_logits", "aggregate", "aggregate_parts", "AGGREGATION_MODES",
    "rollout_correction_weights",
]
