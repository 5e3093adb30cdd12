r"""Feedback controllers for the KL coefficient and the PPO clip range.

Each controller is a pair of pure functions, ``init`` (Python or traced numbers in,
state out) and ``update`` (state in, state out), in the style of optax. States are
NamedTuples of float32 scalars, so they are pytrees: carry them in a train state,
``jax.jit`` or ``lax.scan`` over updates, checkpoint them. Nothing is static, so
changing any coefficient never recompiles. A non-finite observation (NaN/inf metric
from a skipped step) leaves the state unchanged.

Clip *schedules* are not controllers: use an optax schedule and pass its value as
``clip_low`` of :func:`jaxrl_llm.losses.ppo_policy_loss` ("dynamic clipping",
epsilon from 0.2 early to 0.05 late). The schedule value is traced, so a jitted step
compiles once:

>>> import jax, jax.numpy as jnp, optax
>>> from jaxrl_llm.losses import ppo_policy_loss, aggregate
>>> schedule = optax.cosine_decay_schedule(0.2, decay_steps=100, alpha=0.25)  # 0.2 -> 0.05
>>> @jax.jit
... def loss_at(step, logp, old_logp, adv, mask):
...   per_tok, _ = ppo_policy_loss(logp, old_logp, adv, mask, clip_low=schedule(step))
...   return aggregate(per_tok, mask)
>>> logp, mask, adv = jnp.zeros((2, 4)), jnp.ones((2, 4)), jnp.ones((2,))
>>> [round(float(loss_at(s, logp, logp - 1.0, adv, mask)), 3) for s in (0, 50, 100)]
[-1.2, -1.125, -1.05]
>>> loss_at._cache_size()
1
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v

Coef = float | jax.Array  # a coefficient: a Python number, or a (traced) scalar array

CLIP_METRICS = ("kl", "clipfrac")
_DEFAULT_CLIP_TARGET = {"kl": 0.02, "clipfrac": 0.15}


def _check_positive(name: str, x) -> None:
  """``x > 0`` for a concrete number (traced values pass unchecked)."""
  v.check_range(name, x, low=0.0, low_open=True)


class AdaptiveKLState(NamedTuple):
  """State of :func:`adaptive_kl_update` (float32 scalars, a pytree).

  Examples:
    >>> s = adaptive_kl_init(0.05, target=6.0)
    >>> isinstance(s, AdaptiveKLState), [round(float(x), 4) for x in s]
    (True, [0.05, 6.0, 10000.0])
  """
  coef: jnp.ndarray
  target: jnp.ndarray
  horizon: jnp.ndarray


def adaptive_kl_init(init_coef: Coef = 0.001, *, target: Coef = 0.1,
                     horizon: Coef = 10000) -> AdaptiveKLState:
  r"""Initial state of the adaptive KL controller (Ziegler et al. 2019).

  Defaults are verl's (``kl_coef=0.001, target_kl=0.1, horizon=10000``); OpenRLHF
  starts at ``init_coef=0.01``.

  Python numbers are range-checked (``ValueError`` naming the argument); traced values
  are not.

  Args:
    init_coef: initial KL coefficient :math:`\beta_0` (>= 0; 0 stays 0, since the
      update is multiplicative).
    target: target KL per update (> 0).
    horizon: number of samples over which the coefficient adapts (> 0).

  Returns:
    An :class:`AdaptiveKLState`.

  Examples:
    >>> adaptive_kl_init(0.05, target=6.0).coef
    Array(0.05, dtype=float32)
  """
  v.check_range("init_coef", init_coef, low=0.0)
  _check_positive("target", target)
  _check_positive("horizon", horizon)
  return AdaptiveKLState(coef=v.as_f32(init_coef), target=v.as_f32(target),
                         horizon=v.as_f32(horizon))


def adaptive_kl_update(state: AdaptiveKLState, current_kl: Coef,
                       n_steps: Coef) -> AdaptiveKLState:
  r"""One adaptive-KL step (verl/OpenRLHF ``AdaptiveKLController.update``).

  .. math::

     e = \mathrm{clip}\Big(\frac{\mathrm{KL}}{\mathrm{target}} - 1, -0.2, 0.2\Big),
     \qquad \beta \leftarrow \beta\,\Big(1 + e\,\frac{n}{\mathrm{horizon}}\Big)

  verl calls it with ``n_steps`` = number of sequences in the batch. A non-finite
  ``current_kl`` leaves the state unchanged.

  Args:
    state: an :class:`AdaptiveKLState`.
    current_kl: observed KL (scalar, traced).
    n_steps: number of samples since the last update (scalar, traced; a Python number
      must be >= 0). Under ``pmap``/``shard_map`` pass the global count (``psum``).

  Returns:
    The new :class:`AdaptiveKLState`.

  Examples:
    >>> s = adaptive_kl_init(0.1, target=0.1, horizon=100)
    >>> round(float(adaptive_kl_update(s, 0.5, 10).coef), 6)   # e = 0.2: 0.1 * 1.02
    0.102
  """
  v.check_rank("current_kl", current_kl, 0)
  v.check_rank("n_steps", n_steps, 0)
  v.check_range("n_steps", n_steps, low=0.0)
  kl = v.as_f32(current_kl)
  error = jnp.clip(kl / state.target - 1.0, -0.2, 0.2)
  coef = state.coef * (1.0 + error * v.as_f32(n_steps) / state.horizon)
  coef = jnp.where(jnp.isfinite(kl), coef, state.coef)
  return state._replace(coef=coef)


class AdaptiveClipState(NamedTuple):
  """State of :func:`adaptive_clip_update` (float32 scalars, a pytree).

  Examples:
    >>> s = adaptive_clip_init(0.2)
    >>> s._fields
    ('eps', 'target', 'eps_min', 'eps_max', 'rate')
    >>> [round(float(x), 4) for x in s]
    [0.2, 0.02, 0.05, 0.3, 0.1]
  """
  eps: jnp.ndarray
  target: jnp.ndarray
  eps_min: jnp.ndarray
  eps_max: jnp.ndarray
  rate: jnp.ndarray


def adaptive_clip_init(init_eps: Coef = 0.2, *, target: Coef | None = None,
                       eps_min: Coef = 0.05, eps_max: Coef = 0.3, rate: Coef = 0.1,
                       metric: str = "kl") -> AdaptiveClipState:
  r"""Initial state of the adaptive clip-range controller.

  ``metric`` says what you will feed to :func:`adaptive_clip_update` and only picks
  the default ``target``: ``"kl"`` (the ``approx_kl`` metric of the policy losses,
  default target 0.02) or ``"clipfrac"`` (``pg_clipfrac``, default target 0.15, must
  lie in (0, 1)). It is not stored in the state (the update rule is the same).

  Args:
    init_eps: initial :math:`\epsilon`, in ``[eps_min, eps_max]`` (a Python number
      outside raises ``ValueError``; a traced value is clipped into the range).
    target: target value of the observed metric (> 0); None = the metric's default.
    eps_min: lower bound of :math:`\epsilon` (0.05, the article's late value).
    eps_max: upper bound of :math:`\epsilon`.
    rate: log-step size :math:`\eta` (> 0): one update changes :math:`\epsilon` by a
      factor in :math:`[e^{-\eta}, e^{\eta}]`.
    metric: ``"kl"`` or ``"clipfrac"`` (static).

  Returns:
    An :class:`AdaptiveClipState`.

  Examples:
    >>> s = adaptive_clip_init(0.2, metric="clipfrac")
    >>> round(float(s.eps), 3), round(float(s.target), 3)
    (0.2, 0.15)
  """
  v.check_choice("metric", metric, CLIP_METRICS)
  if target is None:
    target = _DEFAULT_CLIP_TARGET[metric]
  _check_positive("target", target)
  _check_positive("rate", rate)
  _check_positive("eps_min", eps_min)
  if metric == "clipfrac" and v.is_concrete_number(target) and not target < 1:
    raise ValueError(f"`target` must be in (0, 1) for metric='clipfrac', got {target!r}.")
  if (v.is_concrete_number(eps_min) and v.is_concrete_number(eps_max)
      and eps_max < eps_min):
    raise ValueError(f"`eps_max` ({eps_max!r}) must be >= `eps_min` ({eps_min!r}).")
  v.check_range("init_eps", init_eps,
                low=eps_min if v.is_concrete_number(eps_min) else None,
                high=eps_max if v.is_concrete_number(eps_max) else None)
  lo, hi = v.as_f32(eps_min), v.as_f32(eps_max)
  return AdaptiveClipState(eps=jnp.clip(v.as_f32(init_eps), lo, hi),
                           target=v.as_f32(target), eps_min=lo, eps_max=hi,
                           rate=v.as_f32(rate))


def adaptive_clip_update(state: AdaptiveClipState, observed: Coef) -> AdaptiveClipState:
  r"""Moves the clip range :math:`\epsilon` to keep a trust-region metric at target.

  Multiplicative (log-space) update with a bounded step:

  .. math::

     e = \mathrm{clip}\Big(\frac{\text{observed}}{\text{target}} - 1, -1, 1\Big),\qquad
     \epsilon \leftarrow \mathrm{clip}\big(\epsilon\,e^{-\eta e},\
     \epsilon_{min}, \epsilon_{max}\big)

  Observed above target (the policy moved too far) shrinks :math:`\epsilon`, below
  target grows it, at target leaves it; the new :math:`\epsilon` is non-increasing in
  ``observed``. Observations at or beyond twice the target (or at 0) saturate the
  step at :math:`e^{\mp\eta}`. A non-finite ``observed`` leaves the state unchanged.
  Feed the result to ``ppo_policy_loss(..., clip_low=state.eps)`` (traced: no
  recompile).

  Args:
    state: an :class:`AdaptiveClipState`.
    observed: the metric chosen at init (e.g. ``metrics["approx_kl"]``), scalar.

  Returns:
    The new :class:`AdaptiveClipState`.

  Examples:
    >>> s = adaptive_clip_init(0.2, target=0.02, rate=0.1)
    >>> round(float(adaptive_clip_update(s, 0.04).eps), 4)   # 0.2 * exp(-0.1)
    0.181
    >>> round(float(adaptive_clip_update(s, 0.01).eps), 4)   # 0.2 * exp(0.05)
    0.2103
  """
  v.check_rank("observed", observed, 0)
  obs = v.as_f32(observed)
  error = jnp.clip(obs / state.target - 1.0, -1.0, 1.0)
  eps = jnp.clip(state.eps * jnp.exp(-state.rate * error), state.eps_min, state.eps_max)
  eps = jnp.where(jnp.isfinite(obs), eps, state.eps)
  return state._replace(eps=eps)
