r"""Divergences: per-token KL estimators (k1, k2, k3, abs, straight-through) and entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm.losses._common import ArrayLike, Coef, check_positive, finish, masked_f32

_KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
               "low_var_kl": "k3", "k3": "k3"}
KL_KINDS = tuple(_KL_ALIASES) + tuple(k + "+" for k in _KL_ALIASES)


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
  check_positive("clamp", clamp)
  dtype = v.out_dtype(logp)
  straight_through = kind.endswith("+")
  base = _KL_ALIASES[kind.rstrip("+")]
  if mask is None:
    valid = jnp.ones(v.shape_of(logp), bool)
    x = v.as_f32(logp) - v.as_f32(ref_logp)
  else:
    valid = v.as_f32(mask) > 0
    x = masked_f32(logp, valid) - masked_f32(ref_logp, valid)
  kl = _kl_base(x, base)
  if clamp is not None:
    kl = jnp.clip(kl, -clamp, clamp)
  if straight_through:
    k2 = 0.5 * jnp.square(x)
    kl = k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(kl)
  return finish(kl, valid, dtype)


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


__all__ = ["KL_KINDS", "kl_penalty", "entropy_from_logits"]
