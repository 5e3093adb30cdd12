r"""Rollout-correction importance weights (truncated and masked IS, verl's semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm._names import ROLLOUT_LEVELS
from jaxrl_llm.losses._common import ArrayLike, Coef, LossAndMetrics, check_positive, masked_f32
from jaxrl_llm.masked import masked_mean
from jaxrl_llm.packing import segment_sum

_IS_LOG_BOUND = 20.0  # verl's SAFETY_BOUND on log importance ratios


def rollout_correction_weights(log_ratio: ArrayLike, mask: ArrayLike, *,
                               level: str = "token", threshold: Coef = 2.0,
                               lower: Coef | None = None,
                               segment_ids: ArrayLike | None = None) -> LossAndMetrics:
  r"""Importance weights that correct for a rollout/trainer mismatch (verl's semantics).

  ``log_ratio`` is :math:`\log\pi_{train} - \log\pi_{rollout}` per token (the trainer's
  recomputed old log-probs minus the sampler's). With :math:`\ell` the log-ratio of
  the chosen level, clamped to :math:`[-20, 20]` before ``exp`` (verl's
  ``SAFETY_BOUND``):

  .. math::

     \ell_{it} = \begin{cases} \log\pi^{train}_{it} - \log\pi^{roll}_{it} &
       \texttt{level="token"}\\
       \sum_{t'} m_{it'}(\log\pi^{train}_{it'} - \log\pi^{roll}_{it'}) &
       \texttt{level="sequence"} \text{ (product of the token ratios)}\end{cases}
     \qquad \rho_{it} = e^{\mathrm{clip}(\ell_{it}, -20, 20)}

     w_{it} = \begin{cases} \min(\rho_{it}, \tau_{hi}) & \texttt{lower} = \text{None}
       \text{ (truncated IS, TIS)}\\
       \rho_{it}\,[\tau_{lo} \le \rho_{it} \le \tau_{hi}] & \text{otherwise (masked IS,
       IcePop)}\end{cases}

  with :math:`\tau_{hi}` = ``threshold`` and :math:`\tau_{lo}` = ``lower``. Truncation is
  verl's ``compute_rollout_correction_weights`` (``rollout_is="token"|"sequence"``,
  ``rollout_is_threshold=2.0``); the masked form is verl's rejection rule
  (``rollout_rs`` with ``rollout_rs_threshold_lower``) applied to the weights, as
  IcePop and OpenRLHF's ``icepop`` do (weights inside the band are kept untruncated,
  those outside are 0). Usual settings: token TIS 2.0 (verl, tunix), sequence TIS 2.0
  (verl) to 5.0 (SkyRL), IcePop ``lower=0.5, threshold=2.0`` (SkyRL) or ``0.5, 5.0``
  (verl's ``decoupled_token_icepop``). Multiply the per-token policy loss by the
  weights; they are exactly 1 on valid tokens where the two log-probs agree (for
  ``threshold >= 1`` and ``lower <= 1``).

  Weights are stop-gradient (they change the measure, not the objective) and exactly
  0 where ``mask`` is 0; values at masked positions (NaN, inf) never matter. A
  NaN log-ratio at a valid position (a data fault) gives weight 0 there (for
  ``level="sequence"``, on its whole row) and counts as clipped.

  Args:
    log_ratio: [B, T] float, :math:`\log\pi_{train} - \log\pi_{rollout}`.
    mask: [B, T], 1 for response tokens.
    level: ``"token"`` or ``"sequence"`` (static).
    threshold: :math:`\tau_{hi}` (traced; a Python number must be > 0).
    lower: :math:`\tau_{lo}` (traced; a Python number must be >= 0 and <= a Python
      ``threshold``), or None for truncation. None versus a value is static.
    segment_ids: ``[B, T]`` int of packed rows: ``level="sequence"`` multiplies the
      ratios of each segment (a sequence), not of the whole row.

  Returns:
    ``(weights, metrics)``: ``weights`` [B, T] with the dtype of ``log_ratio``;
    ``metrics`` float32 scalars (stop-gradient), means over valid tokens (a sequence
    weight counts once per token, as in verl):

    - ``rollout_is_mean``: mean of :math:`w` (the weights the loss gets).
    - ``rollout_is_max``: max of :math:`\rho` before truncation/masking (verl's
      ``rollout_is_max``; 0 without valid tokens).
    - ``rollout_is_clipfrac``: fraction of tokens with :math:`w \ne \rho` (truncated
      or zeroed).
    - ``rollout_mismatch_kl``: the train/inference mismatch
      :math:`\mathrm{KL}(\pi_{roll} \| \pi_{train})`, estimated per token from the
      sampled tokens with the non-negative :math:`k_3 = e^{r} - 1 - r`,
      :math:`r = \mathrm{clip}(\log\pi^{train}_{it} - \log\pi^{roll}_{it}, -20, 20)`
      (at the token level whatever ``level``; verl's ``rollout_corr/kl`` uses the same
      samples; a NaN log-ratio counts 0).
    - ``rollout_is_ess``: normalised effective sample size of :math:`w`,
      :math:`(\sum w)^2 / (N \sum w^2) \in [0, 1]` (1 when all weights are equal;
      verl's ``1 / mean((w / mean w)^2)``, here on the final weights; 0 when every
      weight is 0).

  Examples:
    >>> import jax.numpy as jnp
    >>> log_ratio = jnp.log(jnp.array([[1.0, 3.0, 0.25, 0.5]]))
    >>> mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    >>> w, m = rollout_correction_weights(log_ratio, mask)               # token TIS
    >>> [round(float(x), 4) for x in w[0]]
    [1.0, 2.0, 0.25, 0.0]
    >>> w, m = rollout_correction_weights(log_ratio, mask, lower=0.5)    # IcePop
    >>> [round(float(x), 4) for x in w[0]], round(float(m["rollout_is_clipfrac"]), 4)
    ([1.0, 0.0, 0.0, 0.0], 0.6667)
    >>> w, m = rollout_correction_weights(log_ratio, mask, level="sequence")
    >>> [round(float(x), 4) for x in w[0]]                               # 1 * 3 * 0.25
    [0.75, 0.75, 0.75, 0.0]
  """
  v.check_choice("level", level, ROLLOUT_LEVELS)
  v.check_rank("log_ratio", log_ratio, 2)
  v.check_float("log_ratio", log_ratio)
  v.check_same_shape(("log_ratio", "mask"), (log_ratio, mask))
  check_positive("threshold", threshold)
  high = threshold if v.is_concrete_number(threshold) else None
  v.check_range("lower", lower, low=0.0, high=high)
  dtype = v.out_dtype(log_ratio)
  valid = v.as_f32(mask) > 0
  ell = masked_f32(log_ratio, valid)
  r = jnp.clip(jax.lax.stop_gradient(ell), -_IS_LOG_BOUND, _IS_LOG_BOUND)
  k3 = jnp.exp(r) - 1.0 - r
  k3 = jnp.where(valid & ~jnp.isnan(k3), k3, 0.0)
  if level == "sequence":
    ell = jnp.broadcast_to(segment_sum(ell, segment_ids), v.shape_of(log_ratio))
  ell = jax.lax.stop_gradient(ell)
  rho = jnp.exp(jnp.clip(ell, -_IS_LOG_BOUND, _IS_LOG_BOUND))
  rho_ok = jnp.where(jnp.isnan(rho), 0.0, rho)
  if lower is None:
    weights = jnp.minimum(rho_ok, threshold)
  else:
    weights = jnp.where((rho >= lower) & (rho <= threshold), rho_ok, 0.0)
  weights = jnp.where(valid, weights, 0.0)

  n = jnp.sum(valid).astype(jnp.float32)
  total, total_sq = jnp.sum(weights), jnp.sum(jnp.square(weights))
  metrics = {
      "rollout_is_mean": masked_mean(weights, mask),
      "rollout_is_max": jnp.max(jnp.where(valid, rho_ok, 0.0), initial=0.0),
      "rollout_is_clipfrac": masked_mean(v.as_f32(weights != rho), mask),
      "rollout_mismatch_kl": masked_mean(k3, mask),
      "rollout_is_ess": jnp.where(total_sq > 0, jnp.square(total)
                                  / (jnp.maximum(n, 1.0) * jnp.where(total_sq > 0,
                                                                     total_sq, 1.0)),
                                  0.0),
  }
  return weights.astype(dtype), jax.lax.stop_gradient(metrics)


__all__ = ["rollout_correction_weights"]
