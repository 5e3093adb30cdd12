r"""Per-token policy losses: PPO, GSPO, CISPO, SAPO, GMPO, REINFORCE.

Every policy loss returns ``(per_token_loss, metrics)``:

* ``per_token_loss`` has the shape ``[B, T]`` of ``logp``, the dtype of ``logp``
  (the math is float32 inside) and is exactly 0 wherever ``mask`` is 0. Values at
  masked positions of any input (NaN, inf, garbage) never reach a valid output and
  get a zero gradient.
* ``metrics`` is a dict of float32 scalars (stop-gradient), masked token means over
  the whole batch. Every policy loss reports the same keys, so train steps can log
  them uniformly:

  - ``pg_clipfrac``: fraction of valid tokens where clipping changed the loss
    (loss-specific, see each function; 0 for losses without a clip).
  - ``pg_clipfrac_lower``: fraction where the PPO dual clip was active (GMPO: where
    the log-ratio clip hit a negative-advantage token, as in verl). 0 otherwise.
  - ``approx_kl``: :math:`\mathrm{mean}_m\,\tfrac12(\log\pi-\log\pi_{old})^2`
    (the non-negative "k2" estimator of KL(old || new), computed on the clamped
    log-ratio). Non-negative, so it can drive :mod:`jaxrl_llm.control`.
  - ``ppo_kl``: :math:`\mathrm{mean}_m(\log\pi_{old}-\log\pi)`, verl's
    ``ppo_kl`` (k1, can be negative).
  - ``ratio_mean``: mean importance ratio the loss used (per token, or the sequence
    ratio broadcast over its tokens for GSPO/GMPO).

All policy losses share one signature, ``fn(logp, old_logp, advantages, mask, *,
<hyperparameters>) -> (per_token_loss, metrics)``, except
:func:`reinforce_policy_loss` (``fn(logp, advantages, mask, *, old_logp=None, ...)``,
since its ``old_logp`` is optional). The clip options are named alike wherever the
math allows (None = off; Python numbers are range-checked, traced values are not):

============  ===================  ==================  ==============  ===================
loss          ``clip_low``         ``clip_high``       ``dual_clip``   other
============  ===================  ==================  ==============  ===================
PPO           0.2 (ratio)          None = clip_low     None (verl 3)   DAPO 0.2 / 0.28
GSPO          3e-4 (seq. ratio)    4e-4                None (tunix)    verl's GSPO example
CISPO         None (verl mode)     5.0                 --              ``mode`` trl / verl
SAPO          --                   --                  --              ``tau_pos`` 1.0,
                                                                       ``tau_neg`` 1.05
GMPO          0.4 (log-ratio)      0.4 (log-ratio)     --              GMPO paper
REINFORCE     --                   --                  --              ``is_clip`` None
============  ===================  ==================  ==============  ===================

``dual_clip`` must be > 1 and the epsilons >= 0. CISPO's ``clip_high`` is an absolute
cap on the weight in ``mode="trl"`` (:func:`cispo_trl_policy_loss`; TRL: 5.0) and
relative to 1 in ``mode="verl"`` (:func:`cispo_verl_policy_loss`); REINFORCE's
``is_clip`` is an absolute cap (truncated IS). For the rollout/trainer mismatch use
:func:`~jaxrl_llm.losses.rollout_correction_weights` and multiply the per-token loss by
its weights.

Reduce a per-token loss with :func:`~jaxrl_llm.losses.aggregate` (see
:mod:`jaxrl_llm.losses`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm.losses._common import (
  ArrayLike,
  Coef,
  LossAndMetrics,
  check_nonnegative,
  check_positive,
  check_token_inputs,
  finish,
  masked_f32,
)
from jaxrl_llm.masked import masked_mean
from jaxrl_llm.packing import segment_sum

# ----------------------------------------------------------------------------- helpers


def _check_ratio_clips(clip_low, clip_high, dual_clip, log_ratio_clamp) -> None:
  """The range checks shared by the ratio-clipping losses (concrete numbers only)."""
  check_nonnegative("clip_low", clip_low)
  check_nonnegative("clip_high", clip_high)
  v.check_range("dual_clip", dual_clip, low=1.0, low_open=True)
  check_positive("log_ratio_clamp", log_ratio_clamp)


def _token_advantages(advantages, logp, valid):
  """Float32 advantages [B, T] from a [B, T] or per-sequence [B] input, 0 where masked."""
  batch = v.shape_of(logp)[0]
  if jnp.ndim(advantages) == 1:
    v.check_batch_vector("advantages", advantages, batch)
    adv = jnp.broadcast_to(v.as_f32(advantages)[:, None], v.shape_of(logp))
  elif jnp.ndim(advantages) == 2:
    v.check_same_shape(("logp", "advantages"), (logp, advantages))
    adv = v.as_f32(advantages)
  else:
    raise ValueError(
        f"`advantages` must have shape [B, T] {v.shape_of(logp)} or [B] ({batch},), "
        f"got {v.shape_of(advantages)}.")
  return jnp.where(valid, adv, 0.0)


def _log_ratio(logp, old_logp, valid, clamp):
  """Sanitised float32 log-probs and log-ratio.

  Returns ``(lp, kappa)``: ``lp`` is logp with 0 at masked positions and
  ``kappa = clip(logp - old_logp, -clamp, clamp)`` (no clip when ``clamp`` is None),
  0 at masked positions.
  """
  lp = masked_f32(logp, valid)
  kappa = lp - masked_f32(old_logp, valid)
  if clamp is not None:
    kappa = jnp.clip(kappa, -clamp, clamp)
  return lp, kappa


def _policy_metrics(kappa, ratio, mask, clipfrac=None, clipfrac_lower=None):
  """The metric dict shared by every policy loss (float32, stop-gradient)."""
  zero = jnp.zeros((), jnp.float32)
  metrics = {
      "pg_clipfrac": zero if clipfrac is None else masked_mean(v.as_f32(clipfrac), mask),
      "pg_clipfrac_lower": (zero if clipfrac_lower is None
                            else masked_mean(v.as_f32(clipfrac_lower), mask)),
      "approx_kl": masked_mean(0.5 * jnp.square(kappa), mask),
      "ppo_kl": masked_mean(-kappa, mask),
      "ratio_mean": masked_mean(ratio, mask),
  }
  return jax.lax.stop_gradient(metrics)


def _clipped_surrogate(adv, ratio, clip_low, clip_high, dual_clip):
  """PPO's pessimistic clipped surrogate with optional dual clip (used by PPO and GSPO).

  Returns ``(loss, clipped, lower_active)``: ``clipped`` marks :math:`L_2 > L_1`,
  ``lower_active`` the dual clip binding (None without dual clip).
  """
  if clip_high is None:
    clip_high = clip_low
  loss1 = -adv * ratio
  loss2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  clipped_loss = jnp.maximum(loss1, loss2)
  if dual_clip is None:
    return clipped_loss, loss2 > loss1, None
  loss3 = -adv * dual_clip
  negative = adv < 0
  loss = jnp.where(negative, jnp.minimum(clipped_loss, loss3), clipped_loss)
  return loss, loss2 > loss1, (clipped_loss > loss3) & negative


# ----------------------------------------------------------------------- policy losses


def ppo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                    mask: ArrayLike, *, clip_low: Coef = 0.2, clip_high: Coef | None = None,
                    dual_clip: Coef | None = None,
                    log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""PPO clipped surrogate per token, with clip-higher (DAPO) and dual clip.

  With :math:`\kappa = \mathrm{clip}(\log\pi - \log\pi_{old}, -c_\kappa, c_\kappa)` and
  :math:`\rho = e^{\kappa}`:

  .. math::

     L_1 = -A\rho,\quad L_2 = -A\,\mathrm{clip}(\rho, 1-\epsilon_{lo}, 1+\epsilon_{hi}),
     \quad L_c = \max(L_1, L_2)

     L = \begin{cases} \min(L_c, -A\,c) & A < 0 \text{ and dual clip } c \text{ set}\\
                       L_c & \text{otherwise} \end{cases}

  This is verl's ``vanilla`` loss (``clip_ratio_low/high``, ``clip_ratio_c``) and
  OpenRLHF's ``PolicyLoss``; TRL's ``delta`` is the same dual clip. Unlike verl, the
  dual clip is off by default (verl always applies ``c=3``). Verl fixtures
  (:math:`\epsilon=0.2, c=3`): :math:`(A,\rho)=(-1,5)\to3.0,\ (1,5)\to-1.2,\
  (-1,0.5)\to0.8,\ (1,0.5)\to-0.5,\ (-1,1.1)\to1.1`.

  ``clip_low``, ``clip_high`` and ``dual_clip`` are traced: pass a schedule value
  (dynamic clipping, e.g. ``optax.linear_schedule(0.2, 0.05, n)(step)``: epsilon
  from 0.2 early to 0.05 late) or the state of :func:`jaxrl_llm.control.adaptive_clip_update`
  without recompiling.

  Args:
    logp: log-probs of the sampled tokens under the current policy, [B, T].
    old_logp: log-probs under the behaviour (rollout/old) policy, [B, T].
    advantages: [B, T], or [B] (one advantage per sequence, broadcast over its tokens).
    mask: [B, T], 1 for trainable tokens.
    clip_low: :math:`\epsilon_{lo}` (lower bound ``1 - clip_low``).
    clip_high: :math:`\epsilon_{hi}`; None means ``clip_low`` (symmetric). Set it
      above ``clip_low`` for DAPO clip-higher (0.2 / 0.28).
    dual_clip: :math:`c` for the dual clip, applied only where :math:`A<0`; None
      disables it. A Python number must be > 1 (ValueError otherwise); a traced value
      is not checked (with :math:`c \le 1` it simply caps the loss at :math:`-Ac`).
    log_ratio_clamp: :math:`c_\kappa`, the log-ratio is clipped to
      :math:`[-c_\kappa, c_\kappa]` before ``exp`` (verl/OpenRLHF: 20); None disables.

  Returns:
    ``(per_token_loss, metrics)``. ``pg_clipfrac`` = mean of :math:`[L_2 > L_1]`,
    ``pg_clipfrac_lower`` = mean of :math:`[L_c > -Ac \wedge A<0]` (0 without dual
    clip), plus ``approx_kl``, ``ppo_kl``, ``ratio_mean`` (see the module docstring).

  Examples:
    >>> import jax.numpy as jnp
    >>> logp = jnp.log(jnp.array([[5.0, 5.0, 0.5, 0.5, 1.1]]))
    >>> adv = jnp.array([[-1.0, 1.0, -1.0, 1.0, -1.0]])
    >>> loss, metrics = ppo_policy_loss(logp, jnp.zeros_like(logp), adv,
    ...                                 jnp.ones_like(logp), dual_clip=3.0)
    >>> [round(float(x), 4) for x in loss[0]]
    [3.0, -1.2, 0.8, -0.5, 1.1]
    >>> round(float(metrics["pg_clipfrac"]), 4), round(float(metrics["pg_clipfrac_lower"]), 4)
    (0.4, 0.2)
  """
  check_token_inputs(logp, mask, [("old_logp", old_logp)])
  _check_ratio_clips(clip_low, clip_high, dual_clip, log_ratio_clamp)
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  _, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  adv = _token_advantages(advantages, logp, valid)

  ratio = jnp.exp(kappa)
  loss, clipped, lower_active = _clipped_surrogate(adv, ratio, clip_low, clip_high,
                                                   dual_clip)
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=clipped,
                            clipfrac_lower=lower_active)
  return finish(loss, valid, dtype), metrics


def gspo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                     mask: ArrayLike, *, clip_low: Coef = 3e-4,
                     clip_high: Coef | None = 4e-4, dual_clip: Coef | None = None,
                     log_ratio_clamp: Coef | None = 10.0,
                     segment_ids: ArrayLike | None = None) -> LossAndMetrics:
  r"""GSPO (sequence-level ratio) in its per-token ("GSPO-token") form, as in verl.

  .. math::

     \log s_i = \frac{\sum_t m_{it}(\log\pi_{it} - \log\pi^{old}_{it})}{\max(|o_i|, 1)},
     \qquad \log s_{it} = \mathrm{sg}(\log s_i) + \log\pi_{it} - \mathrm{sg}(\log\pi_{it})

     s_{it} = \exp(\min(\log s_{it}, c)),\qquad
     L^c_{it} = \max(-A_{it}\,s_{it},\ -A_{it}\,\mathrm{clip}(s_{it}, 1-\epsilon_{lo},
     1+\epsilon_{hi}))

     L_{it} = \begin{cases} \min(L^c_{it}, -A_{it}\,c_{dual}) & A_{it} < 0 \text{ and
     dual clip set}\\ L^c_{it} & \text{otherwise} \end{cases}

  The value of :math:`s_{it}` is the sequence ratio :math:`s_i` (geometric mean of the
  token ratios); its gradient is that of :math:`s_i \log\pi_{it}`, so with a
  sequence-level advantage the aggregated gradient equals GSPO's sequence gradient.
  Only an upper clamp is applied to the log-ratio (verl: 10). verl forces the
  aggregation to ``seq-mean-token-mean`` for GSPO whatever ``loss_agg_mode`` says:
  use ``aggregate(loss, mask, "seq-mean-token-mean")`` to reproduce it. Recommended
  epsilons are tiny (3e-4 / 4e-4, verl's GSPO example) because the ratio is a
  length-normalised mean. The dual clip is PPO's (see :func:`ppo_policy_loss`) applied
  to the sequence ratio, as tunix's ``grpo_loss_fn`` does with ``epsilon_c`` for
  ``loss_algo="gspo-token"``; verl and TRL have no dual clip for GSPO, hence off
  by default.

  Args:
    logp: current log-probs, [B, T].
    old_logp: behaviour log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    clip_low: :math:`\epsilon_{lo}` (traced; a Python number must be >= 0).
    clip_high: :math:`\epsilon_{hi}` (traced, >= 0); None means ``clip_low``.
    dual_clip: :math:`c_{dual}` for negative advantages (traced; a Python number must
      be > 1); None disables it.
    log_ratio_clamp: :math:`c`, upper clamp of :math:`\log s_{it}` (> 0); None disables.
    segment_ids: ``[B, T]`` int of packed rows: the sequence ratio is per segment.

  Returns:
    ``(per_token_loss, metrics)``; ``pg_clipfrac`` = mean of :math:`[L_2 > L_1]`,
    ``pg_clipfrac_lower`` = where the dual clip binds (0 without it), ``ratio_mean`` =
    mean of :math:`s_i` over valid tokens; ``approx_kl``/``ppo_kl`` are token-level.

  Examples:
    >>> import jax.numpy as jnp
    >>> logp = jnp.array([[0.1, -0.1, 0.3]])   # old_logp = 0: log s = 0.1
    >>> loss, m = gspo_policy_loss(logp, jnp.zeros_like(logp), jnp.array([1.0]),
    ...                            jnp.array([[1.0, 1.0, 1.0]]))
    >>> [round(float(x), 5) for x in loss[0]]   # -clip(e^0.1, ., 1 + 4e-4)
    [-1.0004, -1.0004, -1.0004]
    >>> loss, m = gspo_policy_loss(jnp.full((1, 2), 2.0), jnp.zeros((1, 2)),
    ...                            jnp.array([-1.0]), jnp.ones((1, 2)), dual_clip=3.0)
    >>> [round(float(x), 4) for x in loss[0]], float(m["pg_clipfrac_lower"])  # e^2 > 3
    ([3.0, 3.0], 1.0)
  """
  check_token_inputs(logp, mask, [("old_logp", old_logp)])
  _check_ratio_clips(clip_low, clip_high, dual_clip, log_ratio_clamp)
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  lp, kappa = _log_ratio(logp, old_logp, valid, None)
  adv = _token_advantages(advantages, logp, valid)

  length = jnp.maximum(segment_sum(valid, segment_ids), 1.0)
  log_seq_ratio = segment_sum(kappa, segment_ids) / length
  log_token_ratio = jax.lax.stop_gradient(log_seq_ratio) + lp - jax.lax.stop_gradient(lp)
  if log_ratio_clamp is not None:
    log_token_ratio = jnp.minimum(log_token_ratio, log_ratio_clamp)
  ratio = jnp.exp(log_token_ratio)
  loss, clipped, lower_active = _clipped_surrogate(adv, ratio, clip_low, clip_high,
                                                   dual_clip)
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=clipped,
                            clipfrac_lower=lower_active)
  return finish(loss, valid, dtype), metrics


def _cispo_loss(logp, old_logp, advantages, mask, weight_fn, log_ratio_clamp):
  """CISPO's body: ``-sg(w(rho)) A log pi`` for a weight rule ``weight_fn(rho)``."""
  check_token_inputs(logp, mask, [("old_logp", old_logp)])
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  lp, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  adv = _token_advantages(advantages, logp, valid)

  ratio = jnp.exp(kappa)
  weight = weight_fn(ratio)
  loss = -jax.lax.stop_gradient(weight) * adv * lp
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=weight != ratio)
  return finish(loss, valid, dtype), metrics


def cispo_trl_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                          mask: ArrayLike, *, clip_high: Coef = 5.0,
                          log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""CISPO in TRL's convention: REINFORCE with an absolutely capped, stop-gradient
  importance weight (MiniMax-M1).

  .. math:: L = -\mathrm{sg}(\min(\rho, \epsilon_{hi}))\,A\,\log\pi

  TRL's ``loss_type="cispo"`` (``epsilon_high`` is the cap, 5.0 recommended): there is
  no lower bound. Every token keeps a gradient (the weight is a constant), unlike
  PPO, which zeroes the gradient of clipped tokens. There is no dual clip: the weight
  is already a bounded constant and the loss is not a ratio surrogate, so PPO's cap
  :math:`-Ac` has nothing to act on. For verl's relative bounds see
  :func:`cispo_verl_policy_loss`.

  Args:
    logp: current log-probs, [B, T].
    old_logp: behaviour log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    clip_high: :math:`\epsilon_{hi}`, the absolute cap on the weight (traced; a Python
      number must be > 0).
    log_ratio_clamp: clip of the log-ratio before ``exp`` (only changes metrics, since
      the weight is capped anyway; > 0); None disables.

  Returns:
    ``(per_token_loss, metrics)``; ``pg_clipfrac`` = fraction of tokens whose weight
    was truncated.

  Examples:
    >>> import jax.numpy as jnp
    >>> logp, old = jnp.log(jnp.array([[0.5, 0.5]])), jnp.log(jnp.array([[0.05, 0.25]]))
    >>> loss, m = cispo_trl_policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)))
    >>> [round(float(x), 4) for x in loss[0]]   # weights min(10, 5)=5 and 2
    [3.4657, 1.3863]
  """
  if clip_high is None:
    raise ValueError("`clip_high` (the absolute cap of TRL's CISPO weight) must be set; "
                     "got None.")
  check_positive("clip_high", clip_high)
  _check_ratio_clips(None, clip_high, None, log_ratio_clamp)
  return _cispo_loss(logp, old_logp, advantages, mask,
                     lambda ratio: jnp.minimum(ratio, clip_high), log_ratio_clamp)


def cispo_verl_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                           mask: ArrayLike, *, clip_low: Coef | None = None,
                           clip_high: Coef | None = 5.0,
                           log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""CISPO in verl's convention: the stop-gradient weight clipped to bounds relative
  to 1 (MiniMax-M1).

  .. math::

     L = -\mathrm{sg}(\mathrm{clip}(\rho, 1-\epsilon_{lo}, 1+\epsilon_{hi}))\,A\,\log\pi

  verl's ``policy_loss.loss_mode="cispo"`` (``clip_ratio_low`` / ``clip_ratio_high``).
  The bounds are relative to 1, so the default ``clip_high=5.0`` caps the weight at
  6.0, and ``clip_low=None`` means no lower bound (the MiniMax-M1 paper's choice;
  verl emulates it with a large ``clip_ratio_low``). As in
  :func:`cispo_trl_policy_loss`, every token keeps a gradient and there is no dual clip.

  Args:
    logp: current log-probs, [B, T].
    old_logp: behaviour log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    clip_low: :math:`\epsilon_{lo}`, traced; None = no lower bound. A Python number
      must be >= 0.
    clip_high: :math:`\epsilon_{hi}`, traced (>= 0); None means ``clip_low``
      (symmetric, as in PPO; then ``clip_low`` must be set).
    log_ratio_clamp: clip of the log-ratio before ``exp`` (> 0); None disables.

  Returns:
    ``(per_token_loss, metrics)``; ``pg_clipfrac`` = fraction of tokens whose weight
    was truncated (either bound).

  Examples:
    >>> import jax.numpy as jnp
    >>> logp, old = jnp.log(jnp.array([[0.5, 0.5]])), jnp.log(jnp.array([[0.05, 0.25]]))
    >>> loss, m = cispo_verl_policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)),
    ...                                  clip_low=0.2, clip_high=0.2)
    >>> [round(float(x), 4) for x in loss[0]]   # weights clip(10 and 2, 0.8, 1.2) = 1.2
    [0.8318, 0.8318]
  """
  if clip_high is None:
    if clip_low is None:
      raise ValueError("`clip_high` may be None only in mode='verl' with `clip_low` set "
                       "(then it means clip_low); got mode='verl', clip_low=None.")
    clip_high = clip_low
  _check_ratio_clips(clip_low, clip_high, None, log_ratio_clamp)
  lower = 0.0 if clip_low is None else 1.0 - clip_low
  return _cispo_loss(logp, old_logp, advantages, mask,
                     lambda ratio: jnp.clip(ratio, lower, 1.0 + clip_high),
                     log_ratio_clamp)


_CISPO_LOSSES = {"trl": cispo_trl_policy_loss, "verl": cispo_verl_policy_loss}


def cispo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                      mask: ArrayLike, *, clip_low: Coef | None = None,
                      clip_high: Coef | None = 5.0, mode: str = "trl",
                      log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1), in
  either library's convention.

  .. math::

     \text{trl:}\quad L = -\mathrm{sg}(\min(\rho, \epsilon_{hi}))\,A\,\log\pi

     \text{verl:}\quad L = -\mathrm{sg}(\mathrm{clip}(\rho, 1-\epsilon_{lo},
     1+\epsilon_{hi}))\,A\,\log\pi

  ``mode`` selects :func:`cispo_trl_policy_loss` or :func:`cispo_verl_policy_loss`.
  The two conventions are not interchangeable: in ``mode="trl"`` ``clip_high`` is an
  *absolute* cap on the weight (TRL recommends 5.0) and there is no lower bound
  (``clip_low`` must be None); in ``mode="verl"`` the bounds are relative to 1, so the
  default ``clip_high=5.0`` caps the weight at 6.0, and ``clip_low=None`` means no
  lower bound (the MiniMax-M1 paper's choice; verl emulates it with a large
  ``clip_ratio_low``). Every token keeps a gradient (the weight is a constant), unlike
  PPO, which zeroes the gradient of clipped tokens. There is no dual clip: the weight
  is already a bounded constant and the loss is not a ratio surrogate, so PPO's cap
  :math:`-Ac` has nothing to act on.

  Args:
    logp: current log-probs, [B, T].
    old_logp: behaviour log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    clip_low: lower relative bound (verl mode only), traced; None = no lower bound. A
      Python number must be >= 0.
    clip_high: absolute cap (trl; a Python number must be > 0) or relative upper bound
      (verl; >= 0; None means ``clip_low``, symmetric as in PPO), traced.
    mode: ``"trl"`` or ``"verl"`` (static).
    log_ratio_clamp: clip of the log-ratio before ``exp`` (only changes metrics, since
      the weight is capped anyway; > 0); None disables.

  Returns:
    ``(per_token_loss, metrics)``; ``pg_clipfrac`` = fraction of tokens whose weight
    was truncated (either bound).

  Examples:
    >>> import jax.numpy as jnp
    >>> logp, old = jnp.log(jnp.array([[0.5, 0.5]])), jnp.log(jnp.array([[0.05, 0.25]]))
    >>> loss, m = cispo_policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)))
    >>> [round(float(x), 4) for x in loss[0]]   # weights min(10, 5)=5 and 2
    [3.4657, 1.3863]
  """
  v.check_choice("mode", mode, tuple(_CISPO_LOSSES))
  if mode == "trl":
    if clip_low is not None:
      raise ValueError("`clip_low` must be None in mode='trl' (TRL's CISPO has no lower "
                       f"bound); got {clip_low!r}. Use mode='verl' for a two-sided clip.")
    if clip_high is None:
      raise ValueError("`clip_high` may be None only in mode='verl' with `clip_low` set "
                       f"(then it means clip_low); got mode='trl', clip_low={clip_low!r}.")
    return cispo_trl_policy_loss(logp, old_logp, advantages, mask, clip_high=clip_high,
                                 log_ratio_clamp=log_ratio_clamp)
  return cispo_verl_policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low,
                                clip_high=clip_high, log_ratio_clamp=log_ratio_clamp)


def sapo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                     mask: ArrayLike, *, tau_pos: Coef = 1.0, tau_neg: Coef = 1.05,
                     log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""SAPO: a smooth sigmoid gate in place of the hard PPO clip (verl, TRL).

  .. math::

     f_\tau(\rho) = \sigma(\tau(\rho - 1))\,\frac{4}{\tau},\qquad
     \tau = \begin{cases}\tau_{pos} & A > 0\\ \tau_{neg} & A \le 0\end{cases},\qquad
     L = -f_\tau(\rho)\,A

  At :math:`\rho=1` the gate's slope is 1, so on-policy the gradient equals the plain
  policy gradient :math:`-A\nabla\log\pi`; far from 1 it decays smoothly.
  verl forces ``seq-mean-token-mean`` aggregation for SAPO. Defaults are verl's and
  TRL's (``tau_pos=1.0``, ``tau_neg=1.05``; a larger :math:`\tau` closes the gate
  faster). The gate replaces the clip, so SAPO takes no ``clip_low``/``clip_high``/
  ``dual_clip``: the temperatures play their role.

  Args:
    logp: current log-probs, [B, T].
    old_logp: behaviour log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    tau_pos: temperature for positive advantages (traced; a Python number must be > 0).
    tau_neg: temperature for non-positive advantages (same).
    log_ratio_clamp: clip of the log-ratio before ``exp`` (> 0); None disables.

  Returns:
    ``(per_token_loss, metrics)``; no hard clip, so ``pg_clipfrac`` is 0.

  Examples:
    >>> import jax.numpy as jnp
    >>> loss, _ = sapo_policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)),
    ...                            jnp.array([[1.0, -1.0]]), jnp.ones((1, 2)))
    >>> [round(float(x), 4) for x in loss[0]]   # rho = 1: f = 2 / tau
    [-2.0, 1.9048]
  """
  check_positive("tau_pos", tau_pos)
  check_positive("tau_neg", tau_neg)
  check_positive("log_ratio_clamp", log_ratio_clamp)
  check_token_inputs(logp, mask, [("old_logp", old_logp)])
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  _, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  adv = _token_advantages(advantages, logp, valid)

  ratio = jnp.exp(kappa)
  tau = jnp.where(adv > 0, v.as_f32(tau_pos), v.as_f32(tau_neg))
  gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
  loss = -gate * adv
  metrics = _policy_metrics(kappa, ratio, mask)
  return finish(loss, valid, dtype), metrics


def gmpo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                     mask: ArrayLike, *, clip_low: Coef = 0.4, clip_high: Coef | None = 0.4,
                     log_ratio_clamp: Coef | None = 20.0,
                     segment_ids: ArrayLike | None = None) -> LossAndMetrics:
  r"""GMPO: geometric-mean policy optimisation (verl ``geo_mean``).

  Token log-ratios are clipped in log space, on the side that matters for the sign of
  the advantage, then averaged over the sequence:

  .. math::

     \kappa^c_{it} = \mathrm{clip}(\kappa_{it}, -\epsilon_{lo}, \epsilon_{hi}),\qquad
     \kappa^*_{it} = \mathrm{sgn}(A_{it})\min(\mathrm{sgn}(A_{it})\kappa_{it},
     \mathrm{sgn}(A_{it})\kappa^c_{it})

     \rho_i = \exp\Big(\frac{\sum_t m_{it}\kappa^*_{it}}{|o_i|}\Big),\qquad
     \bar A_i = \frac{\sum_t m_{it} A_{it}}{|o_i|},\qquad L_i = -\bar A_i\,\rho_i

  Per-token form: each valid token of row :math:`i` carries
  :math:`L_i / |o_i|`, so the row's token *sum* is :math:`L_i` and
  ``aggregate(loss, mask, "seq-mean-token-sum")`` is :math:`\mathrm{mean}_i L_i`,
  GMPO's sequence loss (verl's ``torch.mean`` over rows; here fully-masked rows are
  excluded from the count, verl counts them with :math:`L_i = 0`).

  Differences from verl, both only for degenerate inputs: the raw log-ratio is first
  clipped to :math:`\pm` ``log_ratio_clamp`` (20; verl has none, and for :math:`A<0`
  the clip does not bound large ratios, so ``exp`` could overflow), and
  :math:`|o_i|` is :math:`\max(|o_i|,1)` instead of :math:`|o_i| + 10^{-8}`.
  The clip is in log space, so ``clip_low``/``clip_high`` are not PPO's ratio epsilons
  (0.4 in log space is a ratio range of about :math:`[0.67, 1.49]`); there is no dual
  clip (GMPO's sign-aware clip already bounds the ratio on the side that matters).

  Args:
    logp: current log-probs, [B, T].
    old_logp: behaviour log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    clip_low: :math:`\epsilon_{lo}` in log space (traced; GMPO paper: 0.4; a Python
      number must be >= 0).
    clip_high: :math:`\epsilon_{hi}` in log space (traced; 0.4; >= 0); None means
      ``clip_low``.
    log_ratio_clamp: symmetric clip of the raw log-ratio (> 0); None disables.
    segment_ids: ``[B, T]`` int of packed rows: :math:`\rho_i`, :math:`\bar A_i` and
      :math:`|o_i|` are per segment.

  Returns:
    ``(per_token_loss, metrics)``. As in verl, ``pg_clipfrac`` is the fraction of
    tokens with :math:`\kappa \ne \kappa^c` and :math:`A>0`, ``pg_clipfrac_lower``
    the same with :math:`A<0`; ``ratio_mean`` averages :math:`\rho_i` over valid tokens.

  Examples:
    >>> import jax.numpy as jnp
    >>> logp = jnp.array([[0.2, 0.6, 0.0]])   # old_logp = 0, A = 1: kappa* = [0.2, 0.4]
    >>> loss, _ = gmpo_policy_loss(logp, jnp.zeros_like(logp), jnp.array([1.0]),
    ...                            jnp.array([[1.0, 1.0, 0.0]]))
    >>> [round(float(x), 4) for x in loss[0]]   # -exp(0.3) / 2 on each valid token
    [-0.6749, -0.6749, 0.0]
  """
  check_token_inputs(logp, mask, [("old_logp", old_logp)])
  _check_ratio_clips(clip_low, clip_high, None, log_ratio_clamp)
  if clip_high is None:
    clip_high = clip_low
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  _, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  adv = _token_advantages(advantages, logp, valid)

  kappa_clip = jnp.clip(kappa, -clip_low, clip_high)
  sign = jnp.sign(adv)
  kappa_star = sign * jnp.minimum(sign * kappa, sign * kappa_clip)
  length = jnp.maximum(segment_sum(valid, segment_ids), 1.0)
  seq_ratio = jnp.exp(segment_sum(kappa_star, segment_ids) / length)
  seq_adv = segment_sum(adv, segment_ids) / length
  loss = jnp.broadcast_to(-seq_adv * seq_ratio / length, v.shape_of(logp))
  clipped = kappa != kappa_clip
  metrics = _policy_metrics(kappa, jnp.broadcast_to(seq_ratio, v.shape_of(logp)), mask,
                            clipfrac=clipped & (adv > 0),
                            clipfrac_lower=clipped & (adv < 0))
  return finish(loss, valid, dtype), metrics


def reinforce_policy_loss(logp: ArrayLike, advantages: ArrayLike, mask: ArrayLike, *,
                          old_logp: ArrayLike | None = None, is_clip: Coef | None = None,
                          log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""REINFORCE / GPG policy-gradient loss, optionally importance-weighted.

  .. math::

     L = -A\,\log\pi\,w,\qquad w = \begin{cases}1 & \text{no } \texttt{old\_logp}\\
     \mathrm{sg}(\rho) & \texttt{is\_clip} = \text{None}\\
     \mathrm{sg}(\min(\rho, \texttt{is\_clip})) & \text{otherwise (truncated IS)}
     \end{cases}

  verl's ``gpg`` and ``bypass_mode`` REINFORCE (whose default aggregation is
  ``seq-mean-token-sum``). The loss value itself is not meaningful, only its gradient
  :math:`-wA\nabla\log\pi` is.

  Args:
    logp: current log-probs, [B, T].
    advantages: [B, T] or [B].
    mask: [B, T].
    old_logp: behaviour log-probs [B, T] for the importance weight; None = on-policy.
    is_clip: truncation of the importance weight, an absolute cap like CISPO's
      ``clip_high`` in ``mode="trl"`` (traced; a Python number must be > 0); needs
      ``old_logp``. None: untruncated weight.
    log_ratio_clamp: clip of the log-ratio before ``exp`` (> 0); None disables.

  Returns:
    ``(per_token_loss, metrics)``; ``pg_clipfrac`` = fraction of tokens whose weight was
    truncated.

  Examples:
    >>> import jax.numpy as jnp
    >>> loss, _ = reinforce_policy_loss(jnp.array([[-0.5, -2.0]]), jnp.array([2.0]),
    ...                                 jnp.array([[1.0, 0.0]]))
    >>> [float(x) for x in loss[0]]
    [1.0, 0.0]
  """
  if is_clip is not None and old_logp is None:
    raise ValueError("`is_clip` needs `old_logp` (the importance weight is "
                     "exp(logp - old_logp)); got old_logp=None.")
  check_positive("is_clip", is_clip)
  check_positive("log_ratio_clamp", log_ratio_clamp)
  check_token_inputs(logp, mask, [("old_logp", old_logp)])
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  adv = _token_advantages(advantages, logp, valid)
  if old_logp is None:
    lp = masked_f32(logp, valid)
    kappa = jnp.zeros_like(lp)
  else:
    lp, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  ratio = jnp.exp(kappa)
  weight = ratio if is_clip is None else jnp.minimum(ratio, is_clip)
  loss = -adv * lp * jax.lax.stop_gradient(weight)
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=weight != ratio)
  return finish(loss, valid, dtype), metrics


__all__ = ["ppo_policy_loss", "gspo_policy_loss", "cispo_policy_loss",
           "cispo_trl_policy_loss", "cispo_verl_policy_loss", "sapo_policy_loss",
           "gmpo_policy_loss", "reinforce_policy_loss"]
