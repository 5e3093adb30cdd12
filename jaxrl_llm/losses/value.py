r"""The clipped value loss of the PPO critic."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm.losses._common import (
  ArrayLike,
  Coef,
  LossAndMetrics,
  check_nonnegative,
  finish,
  masked_f32,
)
from jaxrl_llm.masked import masked_mean


def value_loss(values: ArrayLike, old_values: ArrayLike | None, returns: ArrayLike,
               mask: ArrayLike, *, clip: Coef | None = 0.5) -> LossAndMetrics:
  r"""Clipped value loss per token (PPO critic).

  .. math::

     \hat v^c = \mathrm{clip}(\hat v, V_{old} - c, V_{old} + c),\qquad
     L = \tfrac12\max\big((\hat v - R)^2, (\hat v^c - R)^2\big)

  verl/OpenRLHF use ``c = 0.5``, TRL 0.2. ``clip=None`` gives the unclipped
  :math:`\tfrac12(\hat v - R)^2` and ``old_values`` may then be None. Fixture
  :math:`\hat v=1, V_{old}=0, R=2, c=0.5 \to 1.125`.

  Args:
    values: predicted values :math:`\hat v`, [B, T].
    old_values: values at rollout time :math:`V_{old}`, [B, T] (None if ``clip`` is None).
    returns: targets :math:`R`, [B, T].
    mask: [B, T].
    clip: :math:`c` (traced) or None.

  Returns:
    ``(per_token_loss, metrics)`` with ``vf_clipfrac`` (mean of
    :math:`[(\hat v^c-R)^2 > (\hat v-R)^2]`, 0 when unclipped) and ``vpred_mean``.
    The loss has the dtype of ``values``.

  Examples:
    >>> import jax.numpy as jnp
    >>> loss, m = value_loss(jnp.ones((1, 1)), jnp.zeros((1, 1)), jnp.full((1, 1), 2.0),
    ...                      jnp.ones((1, 1)))
    >>> float(loss[0, 0]), float(m["vf_clipfrac"])
    (1.125, 1.0)
  """
  v.check_rank("values", values, 2)
  v.check_float("values", values)
  v.check_same_shape(("values", "returns", "mask"), (values, returns, mask))
  v.check_float("returns", returns)
  if clip is not None:
    if old_values is None:
      raise ValueError("`old_values` is required when `clip` is set; got None.")
    v.check_float("old_values", old_values)
    v.check_same_shape(("values", "old_values"), (values, old_values))
  check_nonnegative("clip", clip)
  dtype = v.out_dtype(values)
  valid = v.as_f32(mask) > 0
  pred = masked_f32(values, valid)
  target = masked_f32(returns, valid)
  loss1 = jnp.square(pred - target)
  if clip is None:
    loss, clipfrac = loss1, jnp.zeros((), jnp.float32)
  else:
    assert old_values is not None   # checked above
    old = masked_f32(old_values, valid)
    pred_clipped = jnp.clip(pred, old - clip, old + clip)
    loss2 = jnp.square(pred_clipped - target)
    loss = jnp.maximum(loss1, loss2)
    clipfrac = masked_mean(v.as_f32(loss2 > loss1), mask)
  metrics = jax.lax.stop_gradient(
      {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(pred, mask)})
  return finish(0.5 * loss, valid, dtype), metrics


__all__ = ["value_loss"]
