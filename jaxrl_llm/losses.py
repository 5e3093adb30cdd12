r"""Per-token policy losses, value loss, KL estimators, entropy and aggregation.

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
cap on the weight in ``mode="trl"`` (TRL: 5.0) and relative to 1 in ``mode="verl"``;
REINFORCE's ``is_clip`` is an absolute cap (truncated IS). For the rollout/trainer
mismatch use :func:`rollout_correction_weights` and multiply the per-token loss by
its weights.

Reduce a per-token loss with :func:`aggregate` (or :func:`aggregate_parts` for
microbatches and devices). Coefficients (``clip_low``, ``clip_high``, ``dual_clip``,
temperatures, ``clamp``) are ordinary traced arguments, so a schedule or a sweep does
not recompile ("dynamic clipping": epsilon annealed from 0.2 early to 0.05 late):

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

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm._names import AGGREGATION_MODES
from jaxrl_llm.masked import masked_mean

ArrayLike = jax.typing.ArrayLike
Coef = float | jax.Array  # a coefficient: a Python number, or a (traced) scalar array
LossAndMetrics = tuple[jax.Array, dict[str, jax.Array]]


_KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
               "low_var_kl": "k3", "k3": "k3"}
KL_KINDS = tuple(_KL_ALIASES) + tuple(k + "+" for k in _KL_ALIASES)

_CISPO_MODES = ("trl", "verl")
_ROLLOUT_LEVELS = ("token", "sequence")
_IS_LOG_BOUND = 20.0  # verl's SAFETY_BOUND on log importance ratios


# ----------------------------------------------------------------------------- helpers


def _check_positive(name: str, x) -> None:
  """``x > 0`` for a concrete number (traced values and None pass)."""
  v.check_range(name, x, low=0.0, low_open=True)


def _check_nonnegative(name: str, x) -> None:
  """``x >= 0`` for a concrete number (traced values and None pass)."""
  v.check_range(name, x, low=0.0)


def _check_ratio_clips(clip_low, clip_high, dual_clip, log_ratio_clamp) -> None:
  """The range checks shared by the ratio-clipping losses (concrete numbers only)."""
  _check_nonnegative("clip_low", clip_low)
  _check_nonnegative("clip_high", clip_high)
  v.check_range("dual_clip", dual_clip, low=1.0, low_open=True)
  _check_positive("log_ratio_clamp", log_ratio_clamp)


def _check_token_inputs(logp, mask, others=()):
  """Checks logp [B, T], mask [B, T] and extra same-shape float arrays."""
  v.check_rank("logp", logp, 2)
  v.check_float("logp", logp)
  v.check_same_shape(("logp", "mask"), (logp, mask))
  for name, x in others:
    if x is None:
      continue
    v.check_float(name, x)
    v.check_same_shape(("logp", name), (logp, x))


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


def _masked_f32(x, valid):
  """float32 copy of x with masked entries replaced by 0 (so NaN/inf never leak)."""
  return jnp.where(valid, v.as_f32(x), 0.0)


def _log_ratio(logp, old_logp, valid, clamp):
  """Sanitised float32 log-probs and log-ratio.

  Returns ``(lp, kappa)``: ``lp`` is logp with 0 at masked positions and
  ``kappa = clip(logp - old_logp, -clamp, clamp)`` (no clip when ``clamp`` is None),
  0 at masked positions.
  """
  lp = _masked_f32(logp, valid)
  kappa = lp - _masked_f32(old_logp, valid)
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


def _finish(loss, valid, dtype):
  return jnp.where(valid, loss, 0.0).astype(dtype)


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
  _check_token_inputs(logp, mask, [("old_logp", old_logp)])
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
  return _finish(loss, valid, dtype), metrics


def gspo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                     mask: ArrayLike, *, clip_low: Coef = 3e-4,
                     clip_high: Coef | None = 4e-4, dual_clip: Coef | None = None,
                     log_ratio_clamp: Coef | None = 10.0) -> LossAndMetrics:
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
  _check_token_inputs(logp, mask, [("old_logp", old_logp)])
  _check_ratio_clips(clip_low, clip_high, dual_clip, log_ratio_clamp)
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  lp, kappa = _log_ratio(logp, old_logp, valid, None)
  adv = _token_advantages(advantages, logp, valid)

  length = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1).astype(jnp.float32)
  log_seq_ratio = jnp.sum(kappa, axis=-1, keepdims=True) / length
  log_token_ratio = jax.lax.stop_gradient(log_seq_ratio) + lp - jax.lax.stop_gradient(lp)
  if log_ratio_clamp is not None:
    log_token_ratio = jnp.minimum(log_token_ratio, log_ratio_clamp)
  ratio = jnp.exp(log_token_ratio)
  loss, clipped, lower_active = _clipped_surrogate(adv, ratio, clip_low, clip_high,
                                                   dual_clip)
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=clipped,
                            clipfrac_lower=lower_active)
  return _finish(loss, valid, dtype), metrics


def cispo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                      mask: ArrayLike, *, clip_low: Coef | None = None,
                      clip_high: Coef | None = 5.0, mode: str = "trl",
                      log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
  r"""CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1).

  .. math::

     \text{trl:}\quad L = -\mathrm{sg}(\min(\rho, \epsilon_{hi}))\,A\,\log\pi

     \text{verl:}\quad L = -\mathrm{sg}(\mathrm{clip}(\rho, 1-\epsilon_{lo},
     1+\epsilon_{hi}))\,A\,\log\pi

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
  v.check_choice("mode", mode, _CISPO_MODES)
  if mode == "trl" and clip_low is not None:
    raise ValueError("`clip_low` must be None in mode='trl' (TRL's CISPO has no lower "
                     f"bound); got {clip_low!r}. Use mode='verl' for a two-sided clip.")
  if clip_high is None:
    if mode == "trl" or clip_low is None:
      raise ValueError("`clip_high` may be None only in mode='verl' with `clip_low` set "
                       f"(then it means clip_low); got mode={mode!r}, "
                       f"clip_low={clip_low!r}.")
    clip_high = clip_low
  if mode == "trl":
    _check_positive("clip_high", clip_high)
  _check_ratio_clips(clip_low, clip_high, None, log_ratio_clamp)
  _check_token_inputs(logp, mask, [("old_logp", old_logp)])
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  lp, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  adv = _token_advantages(advantages, logp, valid)

  ratio = jnp.exp(kappa)
  if mode == "trl":
    weight = jnp.minimum(ratio, clip_high)
  else:
    lower = 0.0 if clip_low is None else 1.0 - clip_low
    weight = jnp.clip(ratio, lower, 1.0 + clip_high)
  loss = -jax.lax.stop_gradient(weight) * adv * lp
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=weight != ratio)
  return _finish(loss, valid, dtype), metrics


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
  _check_positive("tau_pos", tau_pos)
  _check_positive("tau_neg", tau_neg)
  _check_positive("log_ratio_clamp", log_ratio_clamp)
  _check_token_inputs(logp, mask, [("old_logp", old_logp)])
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  _, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  adv = _token_advantages(advantages, logp, valid)

  ratio = jnp.exp(kappa)
  tau = jnp.where(adv > 0, v.as_f32(tau_pos), v.as_f32(tau_neg))
  gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
  loss = -gate * adv
  metrics = _policy_metrics(kappa, ratio, mask)
  return _finish(loss, valid, dtype), metrics


def gmpo_policy_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike,
                     mask: ArrayLike, *, clip_low: Coef = 0.4, clip_high: Coef | None = 0.4,
                     log_ratio_clamp: Coef | None = 20.0) -> LossAndMetrics:
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
  _check_token_inputs(logp, mask, [("old_logp", old_logp)])
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
  length = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1).astype(jnp.float32)
  seq_ratio = jnp.exp(jnp.sum(kappa_star, axis=-1, keepdims=True) / length)
  seq_adv = jnp.sum(adv, axis=-1, keepdims=True) / length
  loss = jnp.broadcast_to(-seq_adv * seq_ratio / length, v.shape_of(logp))
  clipped = kappa != kappa_clip
  metrics = _policy_metrics(kappa, jnp.broadcast_to(seq_ratio, v.shape_of(logp)), mask,
                            clipfrac=clipped & (adv > 0),
                            clipfrac_lower=clipped & (adv < 0))
  return _finish(loss, valid, dtype), metrics


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
  _check_positive("is_clip", is_clip)
  _check_positive("log_ratio_clamp", log_ratio_clamp)
  _check_token_inputs(logp, mask, [("old_logp", old_logp)])
  dtype = v.out_dtype(logp)
  valid = v.as_f32(mask) > 0
  adv = _token_advantages(advantages, logp, valid)
  if old_logp is None:
    lp = _masked_f32(logp, valid)
    kappa = jnp.zeros_like(lp)
  else:
    lp, kappa = _log_ratio(logp, old_logp, valid, log_ratio_clamp)
  ratio = jnp.exp(kappa)
  weight = ratio if is_clip is None else jnp.minimum(ratio, is_clip)
  loss = -adv * lp * jax.lax.stop_gradient(weight)
  metrics = _policy_metrics(kappa, ratio, mask, clipfrac=weight != ratio)
  return _finish(loss, valid, dtype), metrics


# ------------------------------------------------------------------- rollout correction


def rollout_correction_weights(log_ratio: ArrayLike, mask: ArrayLike, *,
                               level: str = "token", threshold: Coef = 2.0,
                               lower: Coef | None = None) -> LossAndMetrics:
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

  Returns:
    ``(weights, metrics)``: ``weights`` [B, T] with the dtype of ``log_ratio``;
    ``metrics`` float32 scalars (stop-gradient), means over valid tokens (a sequence
    weight counts once per token, as in verl):

    - ``rollout_is_mean``: mean of :math:`w` (the weights the loss gets).
    - ``rollout_is_max``: max of :math:`\rho` before truncation/masking (verl's
      ``rollout_is_max``; 0 without valid tokens).
    - ``rollout_is_clipfrac``: fraction of tokens with :math:`w \ne \rho` (truncated
      or zeroed).
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
  v.check_choice("level", level, _ROLLOUT_LEVELS)
  v.check_rank("log_ratio", log_ratio, 2)
  v.check_float("log_ratio", log_ratio)
  v.check_same_shape(("log_ratio", "mask"), (log_ratio, mask))
  _check_positive("threshold", threshold)
  high = threshold if v.is_concrete_number(threshold) else None
  v.check_range("lower", lower, low=0.0, high=high)
  dtype = v.out_dtype(log_ratio)
  valid = v.as_f32(mask) > 0
  ell = _masked_f32(log_ratio, valid)
  if level == "sequence":
    ell = jnp.broadcast_to(jnp.sum(ell, axis=-1, keepdims=True), v.shape_of(log_ratio))
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
      "rollout_is_ess": jnp.where(total_sq > 0, jnp.square(total)
                                  / (jnp.maximum(n, 1.0) * jnp.where(total_sq > 0,
                                                                     total_sq, 1.0)),
                                  0.0),
  }
  return weights.astype(dtype), jax.lax.stop_gradient(metrics)


# -------------------------------------------------------------------------- value loss


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
  _check_nonnegative("clip", clip)
  dtype = v.out_dtype(values)
  valid = v.as_f32(mask) > 0
  pred = _masked_f32(values, valid)
  target = _masked_f32(returns, valid)
  loss1 = jnp.square(pred - target)
  if clip is None:
    loss, clipfrac = loss1, jnp.zeros((), jnp.float32)
  else:
    old = _masked_f32(old_values, valid)
    pred_clipped = jnp.clip(pred, old - clip, old + clip)
    loss2 = jnp.square(pred_clipped - target)
    loss = jnp.maximum(loss1, loss2)
    clipfrac = masked_mean(v.as_f32(loss2 > loss1), mask)
  metrics = jax.lax.stop_gradient(
      {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(pred, mask)})
  return _finish(0.5 * loss, valid, dtype), metrics


# ---------------------------------------------------------------------- KL and entropy


def _kl_base(x, kind):
  if kind == "k1":
    return x
  if kind == "abs":
    return jnp.abs(x)
  if kind == "k2":
    return 0.5 * jnp.square(x)
  # k3 = exp(-x) + x - 1, with y = -x clipped to [-20, 20] first (verl) so it stays
  # finite. Written expm1(y) - y: a faithfully rounded expm1 never lies below y (the
  # true value exceeds y and y is itself a float), so the difference is >= 0 in
  # float32. The textbook exp(y) - y - 1 rounds to -5.96e-08 near y = 0.
  y = jnp.clip(-x, -20.0, 20.0)
  return jnp.expm1(y) - y


def kl_penalty(logp: ArrayLike, ref_logp: ArrayLike, kind: str = "k1", *,
               clamp: Coef | None = None, mask: ArrayLike | None = None) -> jax.Array:
  r"""Per-token KL estimators between the policy and a reference policy.

  With :math:`x = \log\pi - \log\pi_{ref}` (samples from :math:`\pi`):

  .. math::

     k_1 = x,\quad |x|,\quad k_2 = \tfrac12 x^2,\quad k_3 = e^{-x} + x - 1

  Kinds: ``"k1"`` (alias ``"kl"``), ``"abs"``, ``"k2"`` (``"mse"``), ``"k3"``
  (``"low_var_kl"``), and any of them with a ``"+"`` suffix (verl's straight-through
  estimators): the value of the base estimator with the gradient of :math:`k_2`,
  :math:`k_2 - \mathrm{sg}(k_2) + \mathrm{sg}(k_{base})`.

  :math:`k_3` is evaluated as :math:`\mathrm{expm1}(-x) - (-x)`, which is never
  negative in float32 (``exp(-x) + x - 1`` rounds to -5.96e-08 for some :math:`x`
  near 0; checked for every float32 :math:`-x` in :math:`[-20, 20]` on CPU), so
  :math:`k_2`, :math:`k_3`, ``abs`` and their ``+`` forms are always :math:`\ge 0`.

  Clamps: for :math:`k_3` the exponent :math:`-x` is always clipped to
  :math:`[-20, 20]` (as verl does) so it stays finite. ``clamp=None`` (default, as TRL)
  applies no clamp to the output; ``clamp=c`` clips the base estimator's value to
  :math:`[-c, c]` (verl's ``low_var_kl`` uses ``c=10``, OpenRLHF clamps every kind at
  10). ``clamp`` is traced.

  Fixtures: :math:`\log\pi=-1, \log\pi_{ref}=-2`: k1 1, k2 0.5, k3 0.367879;
  :math:`\log\pi=-2, \log\pi_{ref}=-1`: k1 -1, k2 0.5, k3 0.718282.

  Args:
    logp: policy log-probs, any shape (usually [B, T]).
    ref_logp: reference log-probs, same shape.
    kind: estimator name (static), one of :data:`KL_KINDS`.
    clamp: optional symmetric bound on the estimate (traced; a Python number must be
      > 0).
    mask: optional 0/1 mask of the same shape; outputs there are 0 and masked inputs
      get zero gradients.

  Returns:
    Per-token estimates with the shape and dtype of ``logp``.

  Examples:
    >>> import jax.numpy as jnp
    >>> lp, ref = jnp.array([-1.0, -2.0]), jnp.array([-2.0, -1.0])
    >>> [round(float(x), 6) for x in kl_penalty(lp, ref, "k3")]
    [0.367879, 0.718282]
  """
  v.check_choice("kind", kind, KL_KINDS)
  v.check_float("logp", logp)
  v.check_float("ref_logp", ref_logp)
  v.check_same_shape(("logp", "ref_logp", "mask"), (logp, ref_logp, mask))
  _check_positive("clamp", clamp)
  dtype = v.out_dtype(logp)
  straight_through = kind.endswith("+")
  base = _KL_ALIASES[kind.rstrip("+")]
  if mask is None:
    valid = jnp.ones(v.shape_of(logp), bool)
    x = v.as_f32(logp) - v.as_f32(ref_logp)
  else:
    valid = v.as_f32(mask) > 0
    x = _masked_f32(logp, valid) - _masked_f32(ref_logp, valid)
  kl = _kl_base(x, base)
  if clamp is not None:
    kl = jnp.clip(kl, -clamp, clamp)
  if straight_through:
    k2 = 0.5 * jnp.square(x)
    kl = k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(kl)
  return _finish(kl, valid, dtype)


def entropy_from_logits(logits: ArrayLike) -> jax.Array:
  r"""Entropy of the categorical distribution over the last axis, in float32.

  .. math:: H(z) = \log\sum_j e^{z_j} - \sum_j \mathrm{softmax}(z)_j\, z_j

  computed on :math:`z - \max_j z_j`, so it is exact for huge logits (no cancellation
  between two large terms). Logits may be ``-inf`` (banned tokens contribute 0, with
  zero gradient); a row that is entirely ``-inf`` gives 0. The result is always
  float32 (an entropy is a statistic; cast it yourself if you need to).

  Args:
    logits: [..., V] float array.

  Returns:
    [...] float32 entropies.

  Examples:
    >>> import jax.numpy as jnp
    >>> round(float(entropy_from_logits(jnp.array([1e30, 1e30, -jnp.inf]))), 6)  # ln 2
    0.693147
  """
  v.check_float("logits", logits)
  if jnp.ndim(logits) < 1:
    raise ValueError(f"`logits` must have a vocabulary axis, got shape {v.shape_of(logits)}.")
  z = v.as_f32(logits)
  top = jnp.max(z, axis=-1, keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  shifted = z - top
  finite = jnp.isfinite(shifted)
  exp = jnp.where(finite, jnp.exp(jnp.where(finite, shifted, 0.0)), 0.0)
  total = jnp.sum(exp, axis=-1)
  nonempty = total > 0
  total = jnp.where(nonempty, total, 1.0)
  probs = exp / total[..., None]
  weighted = jnp.sum(probs * jnp.where(finite, shifted, 0.0), axis=-1)
  return jnp.where(nonempty, jnp.log(total) - weighted, 0.0)


# ------------------------------------------------------------------------- aggregation


def aggregate_parts(per_token: ArrayLike, mask: ArrayLike, mode: str = "token-mean", *,
                    norm_length: Coef | None = None) -> tuple[jax.Array, jax.Array]:
  r"""Numerator and denominator of :func:`aggregate`, exact across microbatches.

  Returns ``(total, denom)`` (float32 scalars) with

  .. math:: \mathrm{aggregate} = \frac{\texttt{total}}{\max(\texttt{denom}, 1)}

  Both are sums over rows, so for microbatches (or devices) that split the *batch*
  axis, :math:`\sum_k \texttt{total}_k / \max(\sum_k \texttt{denom}_k, 1)` (``psum``
  both) equals the full-batch :func:`aggregate` exactly (up to float summation
  order). The denominators are counts (the mask is 0/1), which is why dividing by
  :math:`\max(\cdot, 1)` is exact, and they depend only on ``mask``, so a train step
  can compute the global denominator first and scale each microbatch's ``total`` by
  it. Splitting the time axis is exact only for the ``token-*`` modes.

  ===========================  =========================================  ===============
  mode                         total                                      denom
  ===========================  =========================================  ===============
  ``token-mean``               :math:`\sum_{it} m L`                      :math:`\sum m`
  ``token-sum``                :math:`\sum_{it} m L`                      0 (no division)
  ``seq-mean-token-sum``       :math:`\sum_i \sum_t m L`                  non-empty rows
  ``seq-mean-token-mean``      :math:`\sum_i \sum_t m L / |o_i|`          non-empty rows
  ``seq-mean-token-sum-norm``  :math:`\sum_i \sum_t m L / \text{norm}`    non-empty rows
  ===========================  =========================================  ===============

  ``token-sum`` returns ``denom = 0`` so that any number of parts still sums to 0 and
  :math:`\max(0, 1) = 1` leaves the total undivided.

  Args:
    per_token: [B, T] per-token values (any float dtype; summed in float32).
    mask: [B, T], 0/1.
    mode: one of :data:`AGGREGATION_MODES` (static).
    norm_length: divisor of ``seq-mean-token-sum-norm`` (traced); default ``T``, the
      padded width of ``per_token`` (pass the max response length to match verl's
      ``loss_scale_factor`` / TRL's ``max_completion_length`` across batches).

  Returns:
    ``(total, denom)`` float32 scalars.

  Examples:
    >>> import jax.numpy as jnp
    >>> loss = jnp.array([[1., 2., 3., 0.], [4., 0., 0., 0.]])
    >>> mask = jnp.array([[1., 1., 1., 0.], [1., 0., 0., 0.]])
    >>> total, denom = aggregate_parts(loss, mask, "seq-mean-token-mean")
    >>> float(total), float(denom)
    (6.0, 2.0)
  """
  v.check_choice("mode", mode, AGGREGATION_MODES)
  v.check_rank("per_token", per_token, 2)
  v.check_float("per_token", per_token)
  v.check_same_shape(("per_token", "mask"), (per_token, mask))
  _check_positive("norm_length", norm_length)
  valid = v.as_f32(mask) > 0
  values = _masked_f32(per_token, valid)
  row_sum = jnp.sum(values, axis=-1)
  row_len = jnp.sum(valid, axis=-1).astype(jnp.float32)
  if mode == "token-mean":
    return jnp.sum(row_sum), jnp.sum(row_len)
  if mode == "token-sum":
    return jnp.sum(row_sum), jnp.zeros((), jnp.float32)
  rows = jnp.sum(row_len > 0).astype(jnp.float32)
  if mode == "seq-mean-token-sum":
    return jnp.sum(row_sum), rows
  if mode == "seq-mean-token-mean":
    return jnp.sum(row_sum / jnp.maximum(row_len, 1.0)), rows
  if norm_length is None:
    norm_length = v.shape_of(per_token)[1]
  return jnp.sum(row_sum) / v.as_f32(norm_length), rows


def aggregate(per_token: ArrayLike, mask: ArrayLike, mode: str = "token-mean", *,
              norm_length: Coef | None = None) -> jax.Array:
  r"""Reduces a per-token loss to a scalar (verl's ``agg_loss`` modes).

  .. math::

     \text{token-mean} = \frac{\sum_{it} m L}{\sum_{it} m},\qquad
     \text{token-sum} = \sum_{it} m L

     \text{seq-mean-token-sum} = \frac1{B'}\sum_i \sum_t m L,\qquad
     \text{seq-mean-token-mean} = \frac1{B'}\sum_i \frac{\sum_t m L}{|o_i|}

     \text{seq-mean-token-sum-norm} = \frac1{B'}\sum_i \frac{\sum_t m L}{\text{norm}}

  :math:`B'` counts the non-empty rows (fully-masked rows are excluded, as in verl).
  ``seq-mean-token-sum-norm`` is Dr.GRPO's constant-length normaliser (current verl;
  verl before PR #5417 did not divide by :math:`B'`). An all-masked batch gives 0.
  Masked values never matter (NaN included). Fixture
  ``L=[[1,2,3,0],[4,0,0,0]]``, ``m=[[1,1,1,0],[1,0,0,0]]``: token-mean 2.5,
  token-sum 10, seq-mean-token-sum 5, seq-mean-token-mean 3,
  seq-mean-token-sum-norm (T=4) 1.25.

  Args:
    per_token: [B, T] per-token values.
    mask: [B, T], 0/1.
    mode: one of :data:`AGGREGATION_MODES` (static).
    norm_length: divisor for ``seq-mean-token-sum-norm`` (default ``T``).

  Returns:
    A float32 scalar. Use :func:`aggregate_parts` to reduce exactly over microbatches
    or devices.

  Examples:
    >>> import jax.numpy as jnp
    >>> loss = jnp.array([[1., 2., 3., 0.], [4., 0., 0., 0.]])
    >>> mask = jnp.array([[1., 1., 1., 0.], [1., 0., 0., 0.]])
    >>> [float(aggregate(loss, mask, m)) for m in AGGREGATION_MODES]
    [2.5, 10.0, 5.0, 3.0, 1.25]
  """
  total, denom = aggregate_parts(per_token, mask, mode, norm_length=norm_length)
  return total / jnp.maximum(denom, 1.0)
