r"""Advantage estimators: GAE (sequential and parallel scan), decoupled and
length-adaptive GAE, n-step, lambda and discounted returns, hybrid n-step/GAE,
self-critical and group baselines.

Notation. ``rewards``, ``values`` and ``mask`` are ``[B, T]``; ``mask`` is 1 on trainable
response tokens. The *valid steps* of a row are its positions with ``mask == 1``, in
order; every recurrence here runs over valid steps only (verl semantics, "masked
positions are transparent"): a masked position neither decays the discount, nor
provides a bootstrap value, nor contributes its reward (a reward on a masked token is
dropped). The step after the last valid one is terminal with value
``bootstrap_value`` (0 when ``None``), so truncated rows can be bootstrapped.

Masking contract. Inputs at masked positions are *selected away* (``jnp.where``) before
any arithmetic, never multiplied by the mask, so any value there (NaN, inf included)
changes nothing, in the outputs or in their gradients; outputs at masked positions are
exactly 0. Everything is computed in float32 and cast back to the dtype of
``rewards``. No estimator whitens: normalisation is the caller's separate step
(:func:`jaxrl_llm.masked_whiten`).

Numeric ranges. ``gamma``, ``lam`` (``lam_policy``, ``lam_value``) and ``mix`` lie in
``[0, 1]``, ``eps >= 0``, ``alpha > 0``, ``n >= 1``. A concrete Python number outside its
range raises ``ValueError``; traced values cannot be checked and are used as given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v
from jaxrl_llm._names import GAE_METHODS
from jaxrl_llm.masked import masked_std, masked_whiten
from jaxrl_llm.packing import segment_sum

GROUP_BASELINES = ("mean", "leave_one_out", "none")
GROUP_SCALES = ("group", "batch", "none")
SINGLETON_MODES = ("raw", "zero")

Array = Any
# Block size of the blocked parallel scan (``method="associative"``): each level folds
# RADIX consecutive steps into one affine map with static slices (one fused kernel).
_RADIX = 8

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
  v.check_choice("method", method, (None,) + GAE_METHODS)


def _coefficient(name, x, shape):
  """A traced coefficient in [0, 1]: a scalar, per row ``[B]`` or per token ``[B, T]``.

  Returns a float32 array that broadcasts against ``[B, T]`` (``[B]`` becomes
  ``[B, 1]``).
  """
  v.check_range(name, x, low=0.0, high=1.0)
  shape = tuple(shape)
  if jnp.ndim(x) == 0:
    return v.as_f32(x)
  if v.shape_of(x) == shape[:1]:
    return v.as_f32(x)[:, None]
  if v.shape_of(x) == shape:
    return v.as_f32(x)
  raise ValueError(f"`{name}` must be a scalar, per row {shape[:1]} or have the shape "
                   f"of `rewards` {shape}, got shape {v.shape_of(x)}.")


def _select_valid(valid, x, fill=0.0):
  """``x`` where valid, ``fill`` elsewhere; a scalar or ``[B, 1]`` passes through."""
  if jnp.ndim(x) == 2 and jnp.shape(x)[1] == jnp.shape(valid)[1]:
    return jnp.where(valid, x, fill)
  return x


def _tokens(rewards, values, mask):
  """float32 ``(valid, rewards, values)`` with masked entries selected to 0."""
  valid = v.as_f32(mask) > 0
  r = jnp.where(valid, v.as_f32(rewards), 0.0)
  val = None if values is None else jnp.where(valid, v.as_f32(values), 0.0)
  return valid, r, val


def _bootstrap(bootstrap_value, batch):
  if bootstrap_value is None:
    return jnp.zeros((batch,), jnp.float32)
  return v.as_f32(bootstrap_value)


def _solve_scan(c, d, init, unroll, shifted):
  """Sequential form: one ``lax.scan`` over time-major ``[T, B]`` with one FMA a step.

  ``[B, T]`` is transposed once into time-major and once back: the loop then reads one
  contiguous ``[B]`` row of each input per step.
  """
  def step(x_next, cd):
    c_t, d_t = cd
    x = d_t + c_t * x_next
    return x, (x_next if shifted else x)

  _, xs = jax.lax.scan(step, init, (c.T, d.T), reverse=True, unroll=unroll)
  return xs.T


def _solve_blocked(c, d, init, shifted):
  r"""Parallel form: a radix-``_RADIX`` tree of affine-map compositions.

  Each level folds ``_RADIX`` consecutive steps of every row into one map
  :math:`x_{\text{start}} = p + h\,x_{\text{after}}` (static slices, one fused kernel),
  solves the ``_RADIX``-times shorter recurrence of the blocks recursively, then
  expands back inside each block. Depth :math:`O(\log T)`, work :math:`O(T)`, no
  loops: on CPU it measured about 7x faster than ``lax.associative_scan``'s odd/even
  interleaving at (B, T) = (16, 32768), with the same composition rule.
  """
  batch, time = c.shape
  if time <= _RADIX:
    outs, x = [], init
    for t in reversed(range(time)):
      x_new = d[:, t] + c[:, t] * x
      outs.append(x if shifted else x_new)
      x = x_new
    return jnp.stack(outs[::-1], axis=1) if outs else jnp.zeros((batch, 0), c.dtype)
  blocks = -(-time // _RADIX)
  pad = blocks * _RADIX - time
  if pad:  # identity maps after the end leave x_T = init unchanged
    c = jnp.pad(c, ((0, 0), (0, pad)), constant_values=1.0)
    d = jnp.pad(d, ((0, 0), (0, pad)))
  c3 = c.reshape(batch, blocks, _RADIX)
  d3 = d.reshape(batch, blocks, _RADIX)
  p, h = d3[..., -1], c3[..., -1]
  for j in reversed(range(_RADIX - 1)):
    p = d3[..., j] + c3[..., j] * p
    h = c3[..., j] * h
  x = _solve_blocked(h, p, init, shifted=True)   # the value after each block
  outs = []
  for j in reversed(range(_RADIX)):
    x_new = d3[..., j] + c3[..., j] * x
    outs.append(x if shifted else x_new)
    x = x_new
  out = jnp.stack(outs[::-1], axis=-1).reshape(batch, blocks * _RADIX)
  return out[:, :time]


def default_gae_method() -> str:
  """The recurrence solver ``method=None`` uses: ``"scan"`` on CPU, ``"associative"`` on
  an accelerator, chosen at trace time from ``jax.default_backend()``.

  On a GPU a sequential ``lax.scan`` costs a kernel launch per step: at (B, T) =
  (16, 32768) on an H200, ``"scan"`` took 578 ms and ``"associative"`` 0.33 ms (rlax's
  own scan 577 ms; ``benchmarks/RESULTS.md``). On CPU the two are within 2x of each
  other (associative ahead at long T, scan at short T), and the default stays the
  scan, which sums in the order of the per-token loops of verl and TRL.

  Examples:
    >>> default_gae_method() in GAE_METHODS
    True
  """
  return "scan" if jax.default_backend() == "cpu" else "associative"


def _solve(c, d, init, method, *, shifted=False, unroll=1, cut=None):
  """``x_t = d_t + c_t x_{t+1}``, ``x_T = init``; ``shifted`` returns ``x_{t+1}``.

  ``cut`` ``[B, T]`` bool (packed rows: the last index of each segment) makes the step
  after a cut terminal: ``x_{t+1}`` reads as 0 there, so no segment reaches into the
  next one. ``None``: the unpacked recurrence, unchanged.
  """
  if cut is not None:
    x = _solve(jnp.where(cut, 0.0, c), d, init, method, unroll=unroll)
    if not shifted:
      return x
    after = jnp.concatenate([x[:, 1:], jnp.broadcast_to(init, x.shape[:1])[:, None]], 1)
    return jnp.where(cut, 0.0, after)
  if (method or default_gae_method()) == "associative":
    return _solve_blocked(c, d, init, shifted)
  return _solve_scan(c, d, init, unroll, shifted)


def reverse_linear_recurrence(coeffs: ArrayLike, inputs: ArrayLike, init: ArrayLike, *,
                              method: str | None = None, unroll: int = 8) -> jax.Array:
  r"""Solves :math:`x_t = d_t + c_t\,x_{t+1}` backwards in time, :math:`x_T = \text{init}`.

  Every estimator of this module reduces to this recurrence (rlax's
  ``discounted_returns`` / ``lambda_returns`` loop written once).

  Args:
    coeffs: ``c``, ``[B, T]`` float.
    inputs: ``d``, ``[B, T]`` float.
    init: ``[B]`` value of :math:`x_T`.
    method: ``"scan"`` runs one ``lax.scan`` over time-major data (O(T) depth, one
      multiply-add per step); ``"associative"`` a blocked parallel scan with the
      composition :math:`(c_1,d_1)\circ(c_2,d_2) = (c_1c_2,\ d_1 + c_1d_2)` (O(log T)
      depth, no sequential loop). They agree to float32 rounding. ``None`` (default):
      :func:`default_gae_method`, the faster one on this backend.
    unroll: ``lax.scan`` unroll factor (scan method only), a static int >= 1.

  Returns:
    ``x`` of shape ``[B, T]`` (float32).

  Examples:
    >>> import jax.numpy as jnp
    >>> x = reverse_linear_recurrence(jnp.array([[.5, .5, .5]]),
    ...                               jnp.array([[1., 2., 4.]]), jnp.array([8.]))
    >>> [float(a) for a in x[0]]
    [4.0, 6.0, 8.0]
  """
  v.check_choice("method", method, (None,) + GAE_METHODS)
  v.check_rank("coeffs", coeffs, 2)
  v.check_float("coeffs", coeffs)
  v.check_same_shape(("coeffs", "inputs"), (coeffs, inputs))
  v.check_float("inputs", inputs)
  v.check_batch_vector("init", init, jnp.shape(coeffs)[0])
  v.check_float("init", init)
  if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
    raise ValueError(f"`unroll` must be a Python int >= 1, got {unroll!r}.")
  return _solve(v.as_f32(coeffs), v.as_f32(inputs), v.as_f32(init), method,
                unroll=unroll)


# ----------------------------------------------------------------------------------
# GAE and returns.


def _segment_cut(segment_ids, shape, bootstrap_value):
  """``[B, T]`` bool, True at the last index of each segment (and of each row), or None.

  A boundary is terminal, so packed rows take no ``bootstrap_value``.
  """
  if segment_ids is None:
    return None
  v.check_same_shape(("rewards", "segment_ids"), (jnp.zeros(shape), segment_ids))
  if bootstrap_value is not None:
    raise ValueError("`bootstrap_value` cannot be combined with `segment_ids`: in a packed "
                     "row every segment ends in a terminal state (value 0).")
  seg = jnp.asarray(segment_ids)
  return jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones_like(seg[:, :1], bool)], 1)


def _lambda_returns_core(r, val, valid, gamma, lams, boot, method, cut=None):
  r"""The :math:`\lambda`-return :math:`G^\lambda = A^{\text{GAE}} + V` for each
  :math:`\lambda` in ``lams``, all solved in one recurrence (rows stacked).

  Inputs are float32 with masked entries already selected away. Entries at masked
  positions of the result are unspecified (finite); callers select them to 0.

  With a per-row :math:`\lambda` (scalar or ``[B, 1]``) one carry suffices. With
  :math:`u_t = V_t + \lambda A_t` on valid steps and :math:`s` the next valid step,

  .. math::
    G_t = r_t + \gamma_t u_s, \qquad
    u_t = (1-\lambda) V_t + \lambda r_t + \lambda\gamma_t u_s, \qquad
    u_{\text{end}} = \text{bootstrap}

  so one multiply-add recurrence, transparent over masked steps (coefficient 1, input
  0), gives everything. A per-token :math:`\lambda_t` needs the next valid value
  first (a second recurrence); the TD errors are then shared by all ``lams``.
  """
  k, batch = len(lams), r.shape[0]
  stack = (lambda xs: xs[0]) if k == 1 else (lambda xs: jnp.concatenate(xs, axis=0))
  split = (lambda x: [x]) if k == 1 else (lambda x: jnp.split(x, k, axis=0))
  if all(jnp.ndim(lam) < 2 or jnp.shape(lam)[1] == 1 for lam in lams):
    c = stack([jnp.where(valid, lam * gamma, 1.0) for lam in lams])
    d = stack([jnp.where(valid, (1.0 - lam) * val + lam * r, 0.0) for lam in lams])
    kcut = None if cut is None else stack([cut] * k)
    z = _solve(c, d, jnp.tile(boot, k), method, shifted=True, cut=kcut)
    return [r + gamma * zi for zi in split(z)]
  y = _solve(jnp.where(valid, 0.0, 1.0), val, boot, method, shifted=True, cut=cut)
  delta = jnp.where(valid, r + gamma * y - val, 0.0)
  c = stack([jnp.where(valid, gamma * lam, 1.0) for lam in lams])
  kcut = None if cut is None else stack([cut] * k)
  adv = _solve(c, stack([delta] * k), jnp.zeros((k * batch,), jnp.float32), method,
               cut=kcut)
  return [a + val for a in split(adv)]


def _gae_setup(rewards, values, mask, gamma, bootstrap_value, method, lams):
  """Shared preamble of gae / decoupled_gae: checks, float32, masked entries selected."""
  _check_token_inputs(rewards, values, mask, bootstrap_value, method)
  valid, r, val = _tokens(rewards, values, mask)
  gamma = _select_valid(valid, _coefficient("gamma", gamma, r.shape))
  lams = [_select_valid(valid, _coefficient(name, lam, r.shape)) for name, lam in lams]
  return valid, r, val, gamma, lams, _bootstrap(bootstrap_value, r.shape[0])


def gae(rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, *, gamma: ArrayLike = 1.0,
        lam: ArrayLike = 1.0, bootstrap_value: ArrayLike | None = None, method: str | None = None,
        transparent_mask: bool = True,
        segment_ids: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
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

  Implementation: with a per-row :math:`\lambda` the whole estimator is one
  multiply-add recurrence on :math:`u = V + \lambda A` (see
  ``_lambda_returns_core``): its coefficients and inputs are computed elementwise in
  ``[B, T]``, transposed once into time-major, and the loop does one multiply-add on a
  contiguous ``[B]`` row per step (``benchmarks/gae.py`` has the timings).

  ``transparent_mask=False`` reproduces TRL/OpenRLHF instead: rewards and values are
  zeroed at masked positions and the recurrence runs over every position (a masked hole
  inside a response then decays by :math:`\gamma\lambda` and bootstraps from 0; per-token
  ``gamma``/``lam`` at masked positions are then used).

  Args:
    rewards: ``[B, T]`` float token rewards (e.g. the score on the last token, minus
      a per-token KL penalty).
    values: ``[B, T]`` float value estimates :math:`V(s_t)`.
    mask: ``[B, T]`` 1 on trainable response tokens.
    gamma: discount in ``[0, 1]`` (traced): a scalar, ``[B]`` per row, or ``[B, T]``
      per-step discounts (0 terminates an episode inside a row, as rlax's
      ``discount_t``).
    lam: GAE :math:`\lambda` in ``[0, 1]`` (traced): a scalar, ``[B]`` or ``[B, T]``.
    bootstrap_value: optional ``[B]`` value after the last valid step, for truncated
      rows; 0 (terminal) when ``None``.
    method: ``"scan"`` (sequential ``lax.scan``) or ``"associative"`` (blocked
      parallel scan, O(log T) depth). They agree to float32 rounding. ``None``
      (default): :func:`default_gae_method` (scan on CPU, associative on GPU/TPU).
    transparent_mask: masked positions are skipped (verl, default) or zeroed
      (TRL/OpenRLHF).
    segment_ids: ``[B, T]`` int, packed rows (:mod:`jaxrl_llm.packing`): the
      recurrence restarts at every segment; the step after a segment's last position
      is terminal (value 0), so no value of the next segment bootstraps it and its
      advantages equal those of the sequence alone. Takes no ``bootstrap_value``.

  Returns:
    ``(advantages, returns)``, both ``[B, T]`` in the dtype of ``rewards``, exactly 0
    where ``mask`` is 0. Not whitened.

  Examples:
    >>> import jax.numpy as jnp
    >>> adv, ret = gae(jnp.array([[0., 0., 1., 0.]]), jnp.array([[.5, .2, .8, 9.]]),
    ...                jnp.array([[1, 1, 1, 0]]), gamma=1.0, lam=0.95)
    >>> [round(float(a), 4) for a in adv[0]]
    [0.4505, 0.79, 0.2, 0.0]
  """
  cut = _segment_cut(segment_ids, v.shape_of(rewards), bootstrap_value)
  if transparent_mask:
    valid, r, val, gamma, (lam,), boot = _gae_setup(
        rewards, values, mask, gamma, bootstrap_value, method, [("lam", lam)])
    (ret,) = _lambda_returns_core(r, val, valid, gamma, [lam], boot, method, cut)
  else:
    _check_token_inputs(rewards, values, mask, bootstrap_value, method)
    valid, r, val = _tokens(rewards, values, mask)
    gamma = _coefficient("gamma", gamma, r.shape)
    lam = _coefficient("lam", lam, r.shape)
    everywhere = jnp.ones(r.shape, bool)
    (ret,) = _lambda_returns_core(r, val, everywhere, gamma, [lam],
                                  _bootstrap(bootstrap_value, r.shape[0]), method, cut)
  dtype = v.out_dtype(rewards)
  adv = jnp.where(valid, ret - val, 0.0)
  return adv.astype(dtype), jnp.where(valid, ret, 0.0).astype(dtype)


def decoupled_gae(rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, *, gamma: ArrayLike = 1.0,
                  lam_policy: ArrayLike, lam_value: ArrayLike,
                  bootstrap_value: ArrayLike | None = None,
                  method: str | None = None,
                  segment_ids: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  r"""GAE with separate :math:`\lambda` for the policy and the critic (VC-PPO, VAPO).

  .. math::
    A = A^{\text{GAE}(\gamma, \lambda_{\text{policy}})}, \qquad
    R = A^{\text{GAE}(\gamma, \lambda_{\text{value}})} + V

  VC-PPO (Yuan et al., 2025, arXiv 2503.01491) trains the critic on
  :math:`\lambda_{\text{value}} = 1` (Monte-Carlo targets, no decay of the terminal
  reward over long responses) and the policy on :math:`\lambda_{\text{policy}} = 0.95`;
  VAPO (arXiv 2504.05118) sets :math:`\lambda_{\text{policy}}` per sequence with
  :func:`length_adaptive_lambda`. NeMo-RL's ``gae_lambda_policy`` /
  ``gae_lambda_value``. Same masking and conventions as :func:`gae`; both estimates
  come out of one recurrence over the stacked rows (they share the TD errors).

  Args:
    rewards: ``[B, T]`` float token rewards.
    values: ``[B, T]`` float values.
    mask: ``[B, T]`` 1 on trainable tokens.
    gamma: discount in ``[0, 1]``: scalar, ``[B]`` or ``[B, T]`` (traced).
    lam_policy: :math:`\lambda` of the advantages, in ``[0, 1]``: scalar, ``[B]`` (e.g.
      :func:`length_adaptive_lambda`) or ``[B, T]`` (traced).
    lam_value: :math:`\lambda` of the value targets, in ``[0, 1]``, same shapes.
    bootstrap_value: optional ``[B]`` value after the last valid step.
    method: ``"scan"``, ``"associative"`` or ``None`` (:func:`default_gae_method`).
    segment_ids: packed rows, as in :func:`gae`.

  Returns:
    ``(advantages, returns)``: ``[B, T]`` in the dtype of ``rewards``, 0 where masked;
    equal to ``gae(..., lam=lam_policy)[0]`` and ``gae(..., lam=lam_value)[1]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> adv, ret = decoupled_gae(jnp.array([[0., 0., 1.]]), jnp.array([[.5, .2, .8]]),
    ...                          jnp.ones((1, 3)), lam_policy=0.5, lam_value=1.0)
    >>> [round(float(a), 4) for a in adv[0]], [float(x) for x in ret[0]]
    ([0.05, 0.7, 0.2], [1.0, 1.0, 1.0])
  """
  cut = _segment_cut(segment_ids, v.shape_of(rewards), bootstrap_value)
  valid, r, val, gamma, lams, boot = _gae_setup(
      rewards, values, mask, gamma, bootstrap_value, method,
      [("lam_policy", lam_policy), ("lam_value", lam_value)])
  ret_policy, ret_value = _lambda_returns_core(r, val, valid, gamma, lams, boot, method,
                                               cut)
  dtype = v.out_dtype(rewards)
  adv = jnp.where(valid, ret_policy - val, 0.0)
  return adv.astype(dtype), jnp.where(valid, ret_value, 0.0).astype(dtype)


def length_adaptive_lambda(mask: ArrayLike, *, alpha: ArrayLike = 0.05,
                           segment_ids: ArrayLike | None = None) -> jax.Array:
  r"""VAPO's length-adaptive policy :math:`\lambda`, one per row.

  .. math:: \lambda_i = \mathrm{clip}\Big(1 - \frac{1}{\max(\alpha\,l_i,\ 1)},\ 0,\ 1\Big)

  with :math:`l_i` the number of valid tokens of row i, so that
  :math:`\sum_t \lambda^t = 1/(1-\lambda) = \alpha l` (VAPO, arXiv 2504.05118, eq. 8;
  the clamp is NeMo-RL's ``length_adaptive_alpha``): at ``alpha=0.05``, l=100 -> 0.80,
  l=1,000 -> 0.98, and rows of at most ``1/alpha`` tokens get 0 (TD(0)). Pass the
  result as ``lam_policy`` of :func:`decoupled_gae` (or ``lam`` of :func:`gae`).

  Args:
    mask: ``[B, T]``, 1 on valid response tokens.
    alpha: ``> 0`` (traced).

  Returns:
    ``[B]`` float32 in ``[0, 1]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> mask = jnp.arange(1000)[None, :] < jnp.array([[100], [1000], [10]])
    >>> [round(float(x), 4) for x in length_adaptive_lambda(mask)]
    [0.8, 0.98, 0.0]
  """
  v.check_rank("mask", mask, 2)
  v.check_range("alpha", alpha, low=0.0, low_open=True)
  if segment_ids is not None:   # packed rows: one lambda per segment, [B, T]
    length = segment_sum(jnp.where(v.as_f32(mask) > 0, 1.0, 0.0), segment_ids)
    lam = 1.0 - 1.0 / jnp.maximum(v.as_f32(alpha) * length, 1.0)
    return jnp.clip(lam, 0.0, 1.0)
  length = jnp.sum(jnp.where(v.as_f32(mask) > 0, 1.0, 0.0), axis=1)
  lam = 1.0 - 1.0 / jnp.maximum(v.as_f32(alpha) * length, 1.0)
  return jnp.clip(lam, 0.0, 1.0)


def lambda_returns(rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, *,
                   gamma: ArrayLike = 1.0, lam: ArrayLike = 1.0,
                   bootstrap_value: ArrayLike | None = None,
                   method: str | None = None) -> jax.Array:
  r""":math:`\lambda`-returns :math:`G^\lambda_t = A^{\text{GAE}}_t + V_t` over valid steps.

  Equivalently :math:`G^\lambda_t = r_t + \gamma[(1-\lambda)V_{\text{next}} +
  \lambda G^\lambda_{\text{next}}]` (rlax ``lambda_returns`` with
  ``values[T] = bootstrap_value``). Same conventions and ranges as :func:`gae`.

  Examples:
    >>> import jax.numpy as jnp
    >>> g = lambda_returns(jnp.array([[0., 0., 1.]]), jnp.array([[.5, .2, .8]]),
    ...                    jnp.ones((1, 3)), lam=0.0)
    >>> [round(float(x), 4) for x in g[0]]
    [0.2, 0.8, 1.0]
  """
  return gae(rewards, values, mask, gamma=gamma, lam=lam,
             bootstrap_value=bootstrap_value, method=method)[1]


def discounted_returns(rewards: ArrayLike, mask: ArrayLike, *, gamma: ArrayLike = 1.0,
                       bootstrap_value: ArrayLike | None = None,
                       method: str | None = None) -> jax.Array:
  r"""Reward-to-go over valid steps: :math:`G_{s_j} = r_{s_j} + \gamma G_{s_{j+1}}`.

  The return is carried unchanged across masked positions (current verl REINFORCE++,
  PR #7300) and ends with ``bootstrap_value`` (0 when ``None``). 0 at masked positions.
  ``gamma`` in ``[0, 1]``: scalar, ``[B]`` or ``[B, T]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> g = discounted_returns(jnp.array([[1., 5., 2., 4.]]), jnp.array([[1, 0, 1, 1]]),
    ...                        gamma=0.5)
    >>> [float(x) for x in g[0]]
    [3.0, 0.0, 4.0, 4.0]
  """
  _check_token_inputs(rewards, None, mask, bootstrap_value, method)
  valid, r, _ = _tokens(rewards, None, mask)
  gamma = _coefficient("gamma", gamma, r.shape)
  g = _solve(jnp.where(valid, gamma, 1.0), r, _bootstrap(bootstrap_value, r.shape[0]),
             method)
  return jnp.where(valid, g, 0.0).astype(v.out_dtype(rewards))


def _next_valid_index(valid):
  """For each t, the index of the first valid position strictly after t (T if none)."""
  time = valid.shape[1]
  idx = jnp.where(valid, jnp.arange(time)[None, :], time)
  first_from = jax.lax.cummin(idx, axis=1, reverse=True)
  return jnp.concatenate(
      [first_from[:, 1:], jnp.full((valid.shape[0], 1), time, first_from.dtype)], axis=1)


def nstep_returns(rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, *, n: int,
                  gamma: ArrayLike = 1.0, bootstrap_value: ArrayLike | None = None) -> jax.Array:
  r"""n-step bootstrapped returns over valid steps.

  .. math::
    G^{(n)}_{s_j} = \sum_{k=0}^{n'-1} \gamma^k r_{s_{j+k}} + \gamma^{n'} V_{s_{j+n}},
    \qquad n' = \min(n, N - j)

  where :math:`N` is the number of valid steps of the row; when the episode ends within
  ``n`` steps the tail value is ``bootstrap_value`` (0 when ``None``). ``n`` is static
  (a Python loop of ``n`` gathers, like rlax's ``n_step_bootstrapped_returns``);
  ``n=1`` gives the TD(0) target and ``n >= T`` the Monte-Carlo return. ``gamma`` in
  ``[0, 1]`` (scalar, ``[B]`` or ``[B, T]``, with the discount of a step applied after
  its reward).

  Examples:
    >>> import jax.numpy as jnp
    >>> g = nstep_returns(jnp.array([[1., 9., 2., 3.]]), jnp.array([[10., 99., 20., 30.]]),
    ...                   jnp.array([[1, 0, 1, 1]]), n=2, gamma=0.5,
    ...                   bootstrap_value=jnp.array([4.]))
    >>> [float(x) for x in g[0]]
    [9.5, 0.0, 4.5, 5.0]
  """
  _check_token_inputs(rewards, values, mask, bootstrap_value)
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"`n` must be a Python int >= 1, got {n!r}.")
  valid, r, val = _tokens(rewards, values, mask)
  batch, time = r.shape
  gamma = _select_valid(valid, _coefficient("gamma", gamma, r.shape), 1.0)
  boot = _bootstrap(bootstrap_value, batch)
  # Column T holds "past the end": no reward, the bootstrap value, and itself as next.
  r_pad = jnp.concatenate([r, jnp.zeros((batch, 1))], axis=1)
  v_pad = jnp.concatenate([val, boot[:, None]], axis=1)
  next_pad = jnp.concatenate(
      [_next_valid_index(valid), jnp.full((batch, 1), time, jnp.int32)], axis=1)
  gamma_pad = jnp.concatenate(
      [jnp.broadcast_to(gamma, r.shape), jnp.ones((batch, 1))], axis=1)

  pos = jnp.broadcast_to(jnp.arange(time, dtype=jnp.int32)[None, :], (batch, time))
  total = jnp.zeros((batch, time), jnp.float32)
  discount = jnp.ones((batch, time), jnp.float32)
  for _ in range(n):
    total = total + discount * jnp.take_along_axis(r_pad, pos, axis=1)
    discount = discount * jnp.take_along_axis(gamma_pad, pos, axis=1)
    pos = jnp.take_along_axis(next_pad, pos, axis=1)
  total = total + discount * jnp.take_along_axis(v_pad, pos, axis=1)
  return jnp.where(valid, total, 0.0).astype(v.out_dtype(rewards))


def hybrid_advantages(rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, *, n: int,
                      gamma: ArrayLike = 1.0, lam: ArrayLike = 0.95, mix: ArrayLike = 0.5,
                      bootstrap_value: ArrayLike | None = None,
                      method: str | None = None) -> tuple[jax.Array, jax.Array]:
  r"""Blend of GAE and n-step advantages ("combined n-step returns with GAE").

  .. math::
    A^{\text{hyb}}_t = \text{mix}\cdot A^{\text{GAE}(\gamma,\lambda)}_t
      + (1 - \text{mix})\,(G^{(n)}_t - V_t)

  ``mix=1`` is :func:`gae`; ``mix=0`` the n-step advantage. ``mix``, ``gamma`` and
  ``lam`` are traced, each in ``[0, 1]``; ``n`` is static.

  Returns:
    ``(advantages, returns)`` with ``returns = advantages + values`` on valid steps,
    0 where masked.

  Examples:
    >>> import jax.numpy as jnp
    >>> adv, _ = hybrid_advantages(jnp.array([[0., 0., 1.]]), jnp.array([[.5, .2, .8]]),
    ...                            jnp.ones((1, 3)), n=1, lam=1.0, mix=0.5)
    >>> [round(float(a), 4) for a in adv[0]]
    [0.1, 0.7, 0.2]
  """
  v.check_range("mix", mix, low=0.0, high=1.0)
  adv_gae, _ = gae(rewards, values, mask, gamma=gamma, lam=lam,
                   bootstrap_value=bootstrap_value, method=method)
  g_n = nstep_returns(rewards, values, mask, n=n, gamma=gamma,
                      bootstrap_value=bootstrap_value)
  valid, _, val = _tokens(rewards, values, mask)
  mix = v.as_f32(mix)
  adv = mix * v.as_f32(adv_gae) + (1.0 - mix) * (v.as_f32(g_n) - val)
  adv = jnp.where(valid, adv, 0.0)
  dtype = v.out_dtype(rewards)
  return adv.astype(dtype), jnp.where(valid, adv + val, 0.0).astype(dtype)


# ----------------------------------------------------------------------------------
# Sequence-level (outcome) estimators: one scalar per row.


def broadcast_to_tokens(seq_values: ArrayLike, mask: ArrayLike) -> jax.Array:
  """Broadcasts a per-sequence ``[B]`` value over the ``[B, T]`` response mask.

  Masked positions are exactly 0 (selected, so a NaN score of a row without valid
  tokens stays out).

  Examples:
    >>> import jax.numpy as jnp
    >>> broadcast_to_tokens(jnp.array([2., -1.]), jnp.array([[1, 1, 0], [1, 0, 0]]))
    Array([[ 2.,  2.,  0.],
           [-1.,  0.,  0.]], dtype=float32)
  """
  v.check_rank("mask", mask, 2)
  v.check_batch_vector("seq_values", seq_values, jnp.shape(mask)[0])
  out = jnp.where(v.as_f32(mask) > 0, v.as_f32(seq_values)[:, None], 0.0)
  return out.astype(v.out_dtype(seq_values))


def self_critical_advantages(scores: ArrayLike, greedy_scores: ArrayLike) -> jax.Array:
  r"""Self-critical baseline (Rennie et al., 2017): :math:`A_i = s_i - s^{\text{greedy}}_i`.

  ``greedy_scores[i]`` is the reward of the greedy decode of row i's prompt.

  Examples:
    >>> import jax.numpy as jnp
    >>> self_critical_advantages(jnp.array([1., 0.]), jnp.array([0.5, 0.5]))
    Array([ 0.5, -0.5], dtype=float32)
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


def group_advantages(scores: ArrayLike, *, group_size: int | None = None,
                     group_ids: ArrayLike | None = None, num_groups: int | None = None,
                     baseline: str = "mean", scale: str = "group", eps: ArrayLike = 1e-6,
                     ddof: int = 1, singleton: str = "raw",
                     valid: ArrayLike | None = None) -> jax.Array:
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
    eps: added to the std, ``>= 0`` (traced).
    ddof: delta degrees of freedom of the std, an int ``>= 0`` (static).
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
  v.check_range("eps", eps, low=0.0)
  v.check_range("ddof", ddof, low=0)
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


def grpo_advantages(scores: ArrayLike, *, group_size: int | None = None,
                    group_ids: ArrayLike | None = None, num_groups: int | None = None,
                    eps: ArrayLike = 1e-6, ddof: int = 1, singleton: str = "raw",
                    valid: ArrayLike | None = None) -> jax.Array:
  r"""GRPO: :math:`(s_i - \mu_g)/(\sigma_g + \epsilon)` (verl ``grpo`` defaults).

  Examples:
    >>> import jax.numpy as jnp
    >>> a = grpo_advantages(jnp.array([1., 0., 2., 2.]), group_size=2)
    >>> [round(float(x), 4) for x in a]
    [0.7071, -0.7071, 0.0, 0.0]
  """
  return group_advantages(scores, group_size=group_size, group_ids=group_ids,
                          num_groups=num_groups, baseline="mean", scale="group", eps=eps,
                          ddof=ddof, singleton=singleton, valid=valid)


def dr_grpo_advantages(scores: ArrayLike, *, group_size: int | None = None,
                       group_ids: ArrayLike | None = None, num_groups: int | None = None,
                       singleton: str = "raw", valid: ArrayLike | None = None) -> jax.Array:
  r"""Dr.GRPO: :math:`s_i - \mu_g`, no std division (pair with the
  ``seq-mean-token-sum-norm`` aggregation).

  Examples:
    >>> import jax.numpy as jnp
    >>> dr_grpo_advantages(jnp.array([1., 0., 2., 2.]), group_size=2)
    Array([ 0.5, -0.5,  0. ,  0. ], dtype=float32)
  """
  return group_advantages(scores, group_size=group_size, group_ids=group_ids,
                          num_groups=num_groups, baseline="mean", scale="none",
                          singleton=singleton, valid=valid)


def rloo_advantages(scores: ArrayLike, *, group_size: int | None = None,
                    group_ids: ArrayLike | None = None, num_groups: int | None = None,
                    singleton: str = "raw", valid: ArrayLike | None = None) -> jax.Array:
  r"""RLOO: :math:`s_i - \frac{1}{n-1}\sum_{j\ne i} s_j = \frac{n}{n-1}(s_i - \mu_g)`.

  Examples:
    >>> import jax.numpy as jnp
    >>> rloo_advantages(jnp.array([1., 0., 0., 1.]), group_size=2)
    Array([ 1., -1., -1.,  1.], dtype=float32)
  """
  return group_advantages(scores, group_size=group_size, group_ids=group_ids,
                          num_groups=num_groups, baseline="leave_one_out", scale="none",
                          singleton=singleton, valid=valid)


def reinforce_pp_advantages(rewards: ArrayLike, mask: ArrayLike, *, gamma: ArrayLike = 1.0,
                            group_size: int | None = None, group_ids: ArrayLike | None = None,
                            num_groups: int | None = None, eps: float = 1e-8) -> jax.Array:
  r"""REINFORCE++ advantages, whitened over all valid tokens of the batch.

  Without groups: :math:`A = \mathrm{whiten}(G)` with :math:`G` the discounted
  reward-to-go (:func:`discounted_returns`). With ``group_size`` or ``group_ids``
  (REINFORCE++-baseline): :math:`A = \mathrm{whiten}(s_i - \mu_g)` broadcast over the
  row's tokens, :math:`s_i = \sum_t m_t r_t`. Normalisation scope is the batch, not
  the group (OpenRLHF #830). Matches verl ``reinforce_plus_plus(_baseline)``.

  ``gamma`` in ``[0, 1]``; ``eps >= 0`` is added to the variance inside the square root.

  Returns:
    ``[B, T]`` advantages, 0 at masked positions.

  Examples:
    >>> import jax.numpy as jnp
    >>> a = reinforce_pp_advantages(jnp.array([[0., 1.], [0., 0.]]), jnp.ones((2, 2)))
    >>> [[round(float(x), 4) for x in row] for row in a]
    [[0.866, 0.866], [-0.866, -0.866]]
  """
  _check_token_inputs(rewards, None, mask, None)
  v.check_range("eps", eps, low=0.0)
  if group_size is None and group_ids is None:
    g = discounted_returns(rewards, mask, gamma=gamma)
  else:
    v.check_range("gamma", gamma, low=0.0, high=1.0)
    _, r, _ = _tokens(rewards, None, mask)
    scores = jnp.sum(r, axis=1)
    centred = group_advantages(scores, group_size=group_size, group_ids=group_ids,
                               num_groups=num_groups, baseline="mean", scale="none")
    g = broadcast_to_tokens(centred, mask)
  return masked_whiten(v.as_f32(g), mask, eps=eps).astype(v.out_dtype(rewards))


def remax_advantages(rewards: ArrayLike, mask: ArrayLike, greedy_scores: ArrayLike) -> jax.Array:
  r"""ReMax: :math:`A_t = \sum_{t' \ge t} m_{t'} r_{t'} - b` with ``b`` the greedy
  rollout's score (``greedy_scores`` ``[B]``); no whitening (verl ``remax``).

  Examples:
    >>> import jax.numpy as jnp
    >>> remax_advantages(jnp.array([[0., 1., 0.]]), jnp.array([[1, 1, 0]]),
    ...                  jnp.array([0.25]))
    Array([[0.75, 0.75, 0.  ]], dtype=float32)
  """
  _check_token_inputs(rewards, None, mask, None)
  v.check_batch_vector("greedy_scores", greedy_scores, jnp.shape(rewards)[0])
  g = discounted_returns(rewards, mask, gamma=1.0)
  adv = jnp.where(v.as_f32(mask) > 0,
                  v.as_f32(g) - v.as_f32(greedy_scores)[:, None], 0.0)
  return adv.astype(v.out_dtype(rewards))
