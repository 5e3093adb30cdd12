r"""Advantage estimators: GAE (sequential and parallel scan), n-step, lambda and
discounted returns, hybrid n-step/GAE, self-critical and group baselines.

Notation. ``rewards``, ``values`` and ``mask`` are ``[B, T]``; ``mask`` is 1 on trainable
response tokens. The *valid steps* of a row are its positions with ``mask == 1``, in
order; every recurrence here runs over valid steps only (verl semantics, "masked
positions are transparent"): a masked position neither decays the discount, nor
provides a bootstrap value, nor contributes its reward (a reward on a masked token is
dropped). The step after the last valid one is terminal with value
``bootstrap_value`` (0 when ``None``), so truncated rows can be bootstrapped.

Outputs are 0 at masked positions. Everything is computed in float32 and cast back to
the dtype of ``rewards``. No estimator whitens: normalisation is the caller's separate
step (:func:`jaxrl_llm.masked_whiten`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm.masked import masked_std, masked_whiten

GAE_METHODS = ("scan", "associative")
GROUP_BASELINES = ("mean", "leave_one_out", "none")
GROUP_SCALES = ("group", "batch", "none")
SINGLETON_MODES = ("raw", "zero")

# ----------------------------------------------------------------------------------
# Checks and the one primitive: a reverse linear recurrence over time.


def _check_token_inputs(rewards, values, mask, bootstrap_value, method=None):
  v.check_rank("rewards", rewards, 2)
  v.check_float("rewards", rewards)
  if values is not None:
    v.check_same_shape(("rewards", "values"), (rewards, values))
    v.check_float("values", values)
  v.check_same_shape(("rewards", "mask"), (rewards, mask))
  if bootstrap_value is not None:
    v.check_batch_vector("bootstrap_value", bootstrap_value, jnp.shape(rewards)[0])
  if method is not None:
    v.check_choice("method", method, GAE_METHODS)


def _coefficient(name, x, shape):
  """A traced coefficient: a scalar, or one value per token ``[B, T]``."""
  if jnp.ndim(x) not in (0, 2) or (jnp.ndim(x) == 2 and v.shape_of(x) != tuple(shape)):
    raise ValueError(f"`{name}` must be a scalar or have the shape of `rewards` "
                     f"{tuple(shape)}, got shape {v.shape_of(x)}.")
  return v.as_f32(x)


def _bootstrap(bootstrap_value, batch):
  if bootstrap_value is None:
    return jnp.zeros((batch,), jnp.float32)
  return v.as_f32(bootstrap_value)


def _compose(later, earlier):
  """Composes affine maps x -> d + c x: returns earlier(later(x))."""
  c_later, d_later = later
  c_earlier, d_earlier = earlier
  return c_earlier * c_later, d_earlier + c_earlier * d_later


def reverse_linear_recurrence(coeffs, inputs, init, *, method="scan", unroll=8):
  r"""Solves :math:`x_t = d_t + c_t\,x_{t+1}` backwards in time, :math:`x_T = \text{init}`.

  Args:
    coeffs: ``c``, ``[B, T]`` float32.
    inputs: ``d``, ``[B, T]`` float32.
    init: ``[B]`` value of :math:`x_T`.
    method: ``"scan"`` runs ``lax.scan`` over time (O(T) depth); ``"associative"``
      runs ``lax.associative_scan`` with the combine
      :math:`(c_1,d_1)\circ(c_2,d_2) = (c_1c_2,\ d_1 + c_1d_2)` (O(log T) depth).
    unroll: ``lax.scan`` unroll factor (scan method only).

  Returns:
    ``x`` of shape ``[B, T]``.
  """
  v.check_choice("method", method, GAE_METHODS)
  if method == "associative":
    c_all, d_all = jax.lax.associative_scan(
        _compose, (coeffs, inputs), reverse=True, axis=1)
    return d_all + c_all * init[:, None]

  def step(x_next, cd):
    c, d = cd
    x = d + c * x_next
    return x, x

  _, xs = jax.lax.scan(step, init, (coeffs.T, inputs.T), reverse=True, unroll=unroll)
  return xs.T


def _next_valid_values(values, mask, bootstrap, method):
  """``y_t``: value of the first valid step strictly after t (or the bootstrap)."""
  y = reverse_linear_recurrence(1.0 - mask, mask * values, bootstrap, method=method)
  return jnp.concatenate([y[:, 1:], bootstrap[:, None]], axis=1)


# ----------------------------------------------------------------------------------
# GAE and returns.


def _gae_fused_scan(rewards, values, mask, gamma, lam, bootstrap, unroll):
  """verl's loop as one ``lax.scan`` carrying (next value, next advantage)."""
  per_token = jnp.ndim(gamma) == 2 or jnp.ndim(lam) == 2
  xs = (rewards.T, values.T, mask.T)
  if per_token:
    xs += (jnp.broadcast_to(gamma, rewards.shape).T,
           jnp.broadcast_to(lam, rewards.shape).T)

  def step(carry, xs_t):
    next_value, next_adv = carry
    r, val, m, *coef = xs_t
    g, l = coef if per_token else (gamma, lam)
    delta = r + g * next_value - val
    adv = delta + g * l * next_adv
    valid = m > 0
    carry = (jnp.where(valid, val, next_value), jnp.where(valid, adv, next_adv))
    return carry, adv

  init = (bootstrap, jnp.zeros_like(bootstrap))
  _, adv = jax.lax.scan(step, init, xs, reverse=True, unroll=unroll)
  return adv.T


def gae(rewards, values, mask, *, gamma=1.0, lam=1.0, bootstrap_value=None,
        method="scan", transparent_mask=True):
  r"""Generalized advantage estimation over the valid steps of each row.

  With :math:`s_0 < s_1 < \dots` the valid positions of a row and
  :math:`V_{\text{next}}(s_j) = V_{s_{j+1}}` (``bootstrap_value`` after the last one):

  .. math::
    \delta_{s_j} &= r_{s_j} + \gamma V_{\text{next}}(s_j) - V_{s_j} \\
    A_{s_j} &= \delta_{s_j} + \gamma\lambda A_{s_{j+1}}, \qquad A_{\text{end}} = 0 \\
    R_{s_j} &= A_{s_j} + V_{s_j}

  This is verl's ``compute_gae_advantage_return`` (masked steps transparent) and, for
  an all-ones mask, rlax's ``truncated_generalized_advantage_estimation`` with
  ``discount_t = gamma`` and ``values[T] = bootstrap_value``. ``lam=1`` gives the
  Monte-Carlo return minus the value, ``lam=0`` the TD(0) error.

  ``transparent_mask=False`` reproduces TRL/OpenRLHF instead: rewards and values are
  zeroed at masked positions and the recurrence runs over every position (a masked hole
  inside a response then decays by :math:`\gamma\lambda` and bootstraps from 0).

  Args:
    rewards: ``[B, T]`` float token rewards (e.g. the score on the last token, minus
      a per-token KL penalty).
    values: ``[B, T]`` float value estimates :math:`V(s_t)`.
    mask: ``[B, T]`` 1 on trainable response tokens.
    gamma: discount (traced): a scalar, or ``[B, T]`` per-step discounts
      (0 terminates an episode inside a row, as rlax's ``discount_t``).
    lam: GAE :math:`\lambda` (traced): a scalar or ``[B, T]``.
    bootstrap_value: optional ``[B]`` value after the last valid step, for truncated
      rows; 0 (terminal) when ``None``.
    method: ``"scan"`` (sequential ``lax.scan``) or ``"associative"`` (parallel
      prefix scan, O(log T) depth). They agree to float32 rounding.
    transparent_mask: masked positions are skipped (verl, default) or zeroed
      (TRL/OpenRLHF).

  Returns:
    ``(advantages, returns)``, both ``[B, T]`` in the dtype of ``rewards``, 0 where
    ``mask`` is 0. Not whitened.

  Examples:
    >>> import jax.numpy as jnp
    >>> adv, ret = gae(jnp.array([[0., 0., 1., 0.]]), jnp.array([[.5, .2, .8, 9.]]),
    ...                jnp.array([[1, 1, 1, 0]]), gamma=1.0, lam=0.95)
    >>> [round(float(a), 4) for a in adv[0]]
    [0.4505, 0.79, 0.2, 0.0]
  """
  _check_token_inputs(rewards, values, mask, bootstrap_value, method)
  dtype = v.out_dtype(rewards)
  m = v.as_f32(mask)
  r, val = v.as_f32(rewards) * m, v.as_f32(values) * m
  gamma = _coefficient("gamma", gamma, r.shape)
  lam = _coefficient("lam", lam, r.shape)
  boot = _bootstrap(bootstrap_value, r.shape[0])

  if not transparent_mask:
    next_val = jnp.concatenate([val[:, 1:], boot[:, None]], axis=1)
    delta = r + gamma * next_val - val
    coeff = jnp.broadcast_to(gamma * lam, r.shape)
    adv = reverse_linear_recurrence(coeff, delta, jnp.zeros_like(boot), method=method)
  elif method == "scan":
    adv = _gae_fused_scan(r, val, m, gamma, lam, boot, unroll=8)
  else:
    next_val = _next_valid_values(val, m, boot, method)
    delta = r + gamma * next_val - val
    coeff = m * gamma * lam + (1.0 - m)
    adv = reverse_linear_recurrence(coeff, m * delta, jnp.zeros_like(boot),
                                    method=method)
  adv = adv * m
  return adv.astype(dtype), (adv + val).astype(dtype)


def lambda_returns(rewards, values, mask, *, gamma=1.0, lam=1.0, bootstrap_value=None,
                   method="scan"):
  r""":math:`\lambda`-returns :math:`G^\lambda_t = A^{\text{GAE}}_t + V_t` over valid steps.

  Equivalently :math:`G^\lambda_t = r_t + \gamma[(1-\lambda)V_{\text{next}} +
  \lambda G^\lambda_{\text{next}}]`. Same conventions as :func:`gae`.
  """
  return gae(rewards, values, mask, gamma=gamma, lam=lam,
             bootstrap_value=bootstrap_value, method=method)[1]


def discounted_returns(rewards, mask, *, gamma=1.0, bootstrap_value=None, method="scan"):
  r"""Reward-to-go over valid steps: :math:`G_{s_j} = r_{s_j} + \gamma G_{s_{j+1}}`.

  The return is carried unchanged across masked positions (current verl REINFORCE++,
  PR #7300) and ends with ``bootstrap_value`` (0 when ``None``). 0 at masked positions.

  Examples:
    >>> import jax.numpy as jnp
    >>> g = discounted_returns(jnp.array([[1., 5., 2., 4.]]), jnp.array([[1, 0, 1, 1]]),
    ...                        gamma=0.5)
    >>> [float(x) for x in g[0]]
    [3.0, 0.0, 4.0, 4.0]
  """
  _check_token_inputs(rewards, None, mask, bootstrap_value, method)
  dtype = v.out_dtype(rewards)
  m = v.as_f32(mask)
  coeff = m * _coefficient("gamma", gamma, m.shape) + (1.0 - m)
  g = reverse_linear_recurrence(coeff, m * v.as_f32(rewards),
                                _bootstrap(bootstrap_value, m.shape[0]), method=method)
  return (g * m).astype(dtype)


def _next_valid_index(mask):
  """For each t, the index of the first valid position strictly after t (T if none)."""
  time = mask.shape[1]
  idx = jnp.where(mask > 0, jnp.arange(time)[None, :], time)
  first_from = jax.lax.cummin(idx, axis=1, reverse=True)
  return jnp.concatenate(
      [first_from[:, 1:], jnp.full((mask.shape[0], 1), time, first_from.dtype)], axis=1)


def nstep_returns(rewards, values, mask, *, n, gamma=1.0, bootstrap_value=None):
  r"""n-step bootstrapped returns over valid steps.

  .. math::
    G^{(n)}_{s_j} = \sum_{k=0}^{n'-1} \gamma^k r_{s_{j+k}} + \gamma^{n'} V_{s_{j+n}},
    \qquad n' = \min(n, N - j)

  where :math:`N` is the number of valid steps of the row; when the episode ends within
  ``n`` steps the tail value is ``bootstrap_value`` (0 when ``None``). ``n`` is static
  (a Python loop of ``n`` gathers, like rlax's ``n_step_bootstrapped_returns``);
  ``n=1`` gives the TD(0) target and ``n >= T`` the Monte-Carlo return.
  """
  _check_token_inputs(rewards, values, mask, bootstrap_value)
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"`n` must be a Python int >= 1, got {n!r}.")
  dtype = v.out_dtype(rewards)
  m = v.as_f32(mask)
  batch, time = m.shape
  boot = _bootstrap(bootstrap_value, batch)
  # Column T holds "past the end": no reward, the bootstrap value, and itself as next.
  r_pad = jnp.concatenate([v.as_f32(rewards) * m, jnp.zeros((batch, 1))], axis=1)
  v_pad = jnp.concatenate([v.as_f32(values) * m, boot[:, None]], axis=1)
  next_pad = jnp.concatenate(
      [_next_valid_index(m), jnp.full((batch, 1), time, jnp.int32)], axis=1)
  gamma_pad = jnp.concatenate(
      [jnp.broadcast_to(_coefficient("gamma", gamma, m.shape), m.shape),
       jnp.ones((batch, 1))], axis=1)

  pos = jnp.broadcast_to(jnp.arange(time, dtype=jnp.int32)[None, :], (batch, time))
  total = jnp.zeros((batch, time), jnp.float32)
  discount = jnp.ones((batch, time), jnp.float32)
  for _ in range(n):
    total = total + discount * jnp.take_along_axis(r_pad, pos, axis=1)
    discount = discount * jnp.take_along_axis(gamma_pad, pos, axis=1)
    pos = jnp.take_along_axis(next_pad, pos, axis=1)
  total = total + discount * jnp.take_along_axis(v_pad, pos, axis=1)
  return (total * m).astype(dtype)


def hybrid_advantages(rewards, values, mask, *, n, gamma=1.0, lam=0.95, mix=0.5,
                      bootstrap_value=None, method="scan"):
  r"""Blend of GAE and n-step advantages ("combined n-step returns with GAE").

  .. math::
    A^{\text{hyb}}_t = \text{mix}\cdot A^{\text{GAE}(\gamma,\lambda)}_t
      + (1 - \text{mix})\,(G^{(n)}_t - V_t)

  ``mix=1`` is :func:`gae`; ``mix=0`` the n-step advantage. ``mix``, ``gamma`` and
  ``lam`` are traced; ``n`` is static.

  Returns:
    ``(advantages, returns)`` with ``returns = advantages + values`` on valid steps.
  """
  adv_gae, _ = gae(rewards, values, mask, gamma=gamma, lam=lam,
                   bootstrap_value=bootstrap_value, method=method)
  g_n = nstep_returns(rewards, values, mask, n=n, gamma=gamma,
                      bootstrap_value=bootstrap_value)
  m = v.as_f32(mask)
  val = v.as_f32(values) * m
  mix = v.as_f32(mix)
  adv = mix * v.as_f32(adv_gae) + (1.0 - mix) * (v.as_f32(g_n) - val) * m
  dtype = v.out_dtype(rewards)
  return adv.astype(dtype), ((adv + val) * m).astype(dtype)


# ----------------------------------------------------------------------------------
# Sequence-level (outcome) estimators: one scalar per row.


def broadcast_to_tokens(seq_values, mask):
  """Broadcasts a per-sequence ``[B]`` value over the ``[B, T]`` response mask."""
  v.check_rank("mask", mask, 2)
  v.check_batch_vector("seq_values", seq_values, jnp.shape(mask)[0])
  out = v.as_f32(seq_values)[:, None] * v.as_f32(mask)
  return out.astype(v.out_dtype(seq_values))


def self_critical_advantages(scores, greedy_scores):
  r"""Self-critical baseline (Rennie et al., 2017): :math:`A_i = s_i - s^{\text{greedy}}_i`.

  ``greedy_scores[i]`` is the reward of the greedy decode of row i's prompt.
  """
  v.check_rank("scores", scores, 1)
  v.check_float("scores", scores)
  v.check_same_shape(("scores", "greedy_scores"), (scores, greedy_scores))
  return (v.as_f32(scores) - v.as_f32(greedy_scores)).astype(v.out_dtype(scores))


def _group_ids(batch, group_size, group_ids, num_groups):
  if (group_size is None) == (group_ids is None):
    raise ValueError("pass exactly one of `group_size` or `group_ids` (with `num_groups`).")
  if group_ids is not None:
    if not isinstance(num_groups, int) or num_groups < 1:
      raise ValueError(f"`num_groups` must be a static int >= 1 with `group_ids`, "
                       f"got {num_groups!r}.")
    v.check_batch_vector("group_ids", group_ids, batch)
    if not jnp.issubdtype(jnp.result_type(group_ids), jnp.integer):
      raise ValueError(f"`group_ids` must be integer, got {jnp.result_type(group_ids)}.")
    return jnp.asarray(group_ids), num_groups
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"`group_size` must be a Python int >= 1, got {group_size!r}.")
  if batch % group_size:
    raise ValueError(f"batch size {batch} (shape of `scores` ({batch},)) is not "
                     f"divisible by `group_size` {group_size}.")
  return jnp.arange(batch) // group_size, batch // group_size


def group_advantages(scores, *, group_size=None, group_ids=None, num_groups=None,
                     baseline="mean", scale="group", eps=1e-6, ddof=1, singleton="raw",
                     valid=None):
  r"""Group-relative advantages for G samples per prompt.

  For row i in group g with :math:`n_g` (valid) members:

  .. math::
    b_i = \begin{cases} \mu_g & \text{mean} \\
          (\sum_{j\in g} s_j - s_i)/(n_g - 1) & \text{leave\_one\_out} \\
          0 & \text{none}\end{cases} \qquad
    A_i = \frac{s_i - b_i}{\sigma + \epsilon}

  with :math:`\sigma` the group std (``scale="group"``), the std of all valid scores of
  the batch (``"batch"``, TRL), or :math:`\sigma + \epsilon := 1` (``"none"``).

  Groups are contiguous runs of ``group_size`` rows, or arbitrary ``group_ids`` ``[B]``
  with a static ``num_groups`` (segment sums; ids outside ``[0, num_groups)`` are
  dropped from statistics and get 0).

  Conventions (default = verl):

  ===================  ===========  =========  ================  ==================
  library              eps          ddof       singleton         call
  ===================  ===========  =========  ================  ==================
  verl ``grpo``        1e-6         1          raw (A = s)       defaults
  TRL GRPO             1e-4         1          NaN in TRL        ``eps=1e-4``
  OpenRLHF group_norm  1e-9         1          asserted n > 1    ``eps=1e-9``
  verl ``rloo``        --           --         raw (A = s)       :func:`rloo_advantages`
  ===================  ===========  =========  ================  ==================

  Edge cases, all finite: a group with zero std gives 0 (numerator is 0); a singleton
  group gives ``s_i`` (``singleton="raw"``, verl: mean 0, std 1) or 0 (``"zero"``,
  verl ``rloo_vectorized`` / TRL eval); rows with ``valid == 0`` (e.g. fully rejected
  responses, verl PR #6452) do not enter any statistic and get 0.

  Args:
    scores: ``[B]`` float sequence rewards.
    group_size: static group size (rows ``[g*G, (g+1)*G)`` form group g).
    group_ids: ``[B]`` int group index, with ``num_groups`` static.
    baseline: ``"mean"``, ``"leave_one_out"`` or ``"none"``.
    scale: ``"group"``, ``"batch"`` or ``"none"``.
    eps: added to the std (traced).
    ddof: delta degrees of freedom of the std (static).
    singleton: ``"raw"`` or ``"zero"``.
    valid: optional ``[B]`` 0/1; invalid rows are excluded and get 0.

  Returns:
    ``[B]`` advantages in the dtype of ``scores``.

  Examples:
    >>> import jax.numpy as jnp
    >>> a = group_advantages(jnp.array([1., 0., 0., 1.]), group_size=4)
    >>> [round(float(x), 6) for x in a]
    [0.866024, -0.866024, -0.866024, 0.866024]
  """
  v.check_rank("scores", scores, 1)
  v.check_float("scores", scores)
  v.check_choice("baseline", baseline, GROUP_BASELINES)
  v.check_choice("scale", scale, GROUP_SCALES)
  v.check_choice("singleton", singleton, SINGLETON_MODES)
  batch = jnp.shape(scores)[0]
  ids, n_groups = _group_ids(batch, group_size, group_ids, num_groups)
  w = jnp.ones((batch,), jnp.float32) if valid is None else v.as_f32(valid)
  if valid is not None:
    v.check_batch_vector("valid", valid, batch)
  w = w * ((ids >= 0) & (ids < n_groups))
  s = jnp.where(w > 0, v.as_f32(scores), 0.0)

  seg = lambda x: jax.ops.segment_sum(x, ids, num_segments=n_groups)
  count_g, sum_g = seg(w), seg(w * s)
  count, total = count_g[ids], sum_g[ids]
  mean = total / jnp.maximum(count, 1.0)
  is_single = count <= 1.0

  if baseline == "mean":
    base = mean
  elif baseline == "leave_one_out":
    base = (total - s) / jnp.maximum(count - 1.0, 1.0)
  else:
    base = jnp.zeros_like(s)

  if scale == "group":
    sq = seg(w * jnp.square(s - mean))[ids]
    dof = count - ddof
    std = jnp.sqrt(jnp.where(dof > 0, sq / jnp.where(dof > 0, dof, 1.0), 0.0))
    denom = std + v.as_f32(eps)
  elif scale == "batch":
    denom = masked_std(s, w, ddof=ddof) + v.as_f32(eps)
  else:
    denom = jnp.ones_like(s)

  adv = (s - base) / denom
  if singleton == "raw":
    # verl: a lone sample keeps its raw score (group mean 0, std 1).
    adv = jnp.where(is_single, s, adv)
  else:
    adv = jnp.where(is_single, 0.0, adv)
  return jnp.where(w > 0, adv, 0.0).astype(v.out_dtype(scores))


def grpo_advantages(scores, *, group_size=None, group_ids=None, num_groups=None,
                    eps=1e-6, ddof=1, singleton="raw", valid=None):
  r"""GRPO: :math:`(s_i - \mu_g)/(\sigma_g + \epsilon)` (verl ``grpo`` defaults)."""
  return group_advantages(scores, group_size=group_size, group_ids=group_ids,
                          num_groups=num_groups, baseline="mean", scale="group", eps=eps,
                          ddof=ddof, singleton=singleton, valid=valid)


def dr_grpo_advantages(scores, *, group_size=None, group_ids=None, num_groups=None,
                       singleton="raw", valid=None):
  r"""Dr.GRPO: :math:`s_i - \mu_g`, no std division (pair with the
  ``seq-mean-token-sum-norm`` aggregation)."""
  return group_advantages(scores, group_size=group_size, group_ids=group_ids,
                          num_groups=num_groups, baseline="mean", scale="none",
                          singleton=singleton, valid=valid)


def rloo_advantages(scores, *, group_size=None, group_ids=None, num_groups=None,
                    singleton="raw", valid=None):
  r"""RLOO: :math:`s_i - \frac{1}{n-1}\sum_{j\ne i} s_j = \frac{n}{n-1}(s_i - \mu_g)`."""
  return group_advantages(scores, group_size=group_size, group_ids=group_ids,
                          num_groups=num_groups, baseline="leave_one_out", scale="none",
                          singleton=singleton, valid=valid)


def reinforce_pp_advantages(rewards, mask, *, gamma=1.0, group_size=None, group_ids=None,
                            num_groups=None, eps=1e-8):
  r"""REINFORCE++ advantages, whitened over all valid tokens of the batch.

  Without groups: :math:`A = \mathrm{whiten}(G)` with :math:`G` the discounted
  reward-to-go (:func:`discounted_returns`). With ``group_size`` or ``group_ids``
  (REINFORCE++-baseline): :math:`A = \mathrm{whiten}(s_i - \mu_g)` broadcast over the
  row's tokens, :math:`s_i = \sum_t m_t r_t`. Normalisation scope is the batch, not
  the group (OpenRLHF #830). Matches verl ``reinforce_plus_plus(_baseline)``.

  Returns:
    ``[B, T]`` advantages, 0 at masked positions.
  """
  _check_token_inputs(rewards, None, mask, None)
  if group_size is None and group_ids is None:
    g = discounted_returns(rewards, mask, gamma=gamma)
  else:
    scores = jnp.sum(v.as_f32(rewards) * v.as_f32(mask), axis=1)
    centred = group_advantages(scores, group_size=group_size, group_ids=group_ids,
                               num_groups=num_groups, baseline="mean", scale="none")
    g = broadcast_to_tokens(centred, mask)
  return masked_whiten(v.as_f32(g), mask, eps=eps).astype(v.out_dtype(rewards))


def remax_advantages(rewards, mask, greedy_scores):
  r"""ReMax: :math:`A_t = \sum_{t' \ge t} m_{t'} r_{t'} - b` with ``b`` the greedy
  rollout's score (``greedy_scores`` ``[B]``); no whitening (verl ``remax``)."""
  _check_token_inputs(rewards, None, mask, None)
  v.check_batch_vector("greedy_scores", greedy_scores, jnp.shape(rewards)[0])
  g = discounted_returns(rewards, mask, gamma=1.0)
  adv = v.as_f32(g) - v.as_f32(greedy_scores)[:, None] * v.as_f32(mask)
  return adv.astype(v.out_dtype(rewards))
