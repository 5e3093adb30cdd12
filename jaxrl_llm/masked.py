"""Masked statistics that stay finite for 0 or 1 valid elements.

Every function takes ``x`` and a ``mask`` of the same shape (1 = valid). The math is
done in float32 whatever the input dtype. Unlike verl's ``masked_var`` (which raises on
0 or 1 valid tokens) these never raise on data, because data cannot raise under jit:

* ``masked_mean`` of an all-masked input is 0.
* ``masked_var`` with ``count <= ddof`` is 0.
* ``masked_whiten`` therefore maps a constant or singleton input to 0 (or to the mean
  when ``shift_mean=False``), never NaN.

Invalid entries are *selected* away (``jnp.where``) before any arithmetic, so NaN or
inf there changes no result and no gradient. ``ddof`` is an int ``>= 0`` and ``eps``
``>= 0``: a concrete Python number outside raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v

Axis = int | Sequence[int] | None  # the axes reduced over (None: all)


def _prepare(x, mask, x_name="x"):
  v.check_float(x_name, x)
  if mask is None:
    mask = jnp.ones(jnp.shape(x), jnp.float32)
  v.check_same_shape((x_name, "mask"), (x, mask))
  mask = v.as_f32(mask)
  # Zero invalid entries first so NaN/inf outside the mask never leak in.
  x = jnp.where(mask > 0, v.as_f32(x), 0.0)
  return x, mask


def _check_ddof(ddof):
  v.check_range("ddof", ddof, low=0)


def masked_sum(x: ArrayLike, mask: ArrayLike | None = None, axis: Axis = None,
               keepdims: bool = False) -> jax.Array:
  r"""Sum of the valid elements: :math:`\sum_i m_i x_i` (float32).

  Examples:
    >>> import jax.numpy as jnp
    >>> float(masked_sum(jnp.array([1., 2., 3.]), jnp.array([1, 0, 1])))
    4.0
  """
  x, mask = _prepare(x, mask)
  return jnp.sum(x * mask, axis=axis, keepdims=keepdims)


def masked_count(mask: ArrayLike, axis: Axis = None, keepdims: bool = False) -> jax.Array:
  """Number of valid elements (float32).

  Examples:
    >>> import jax.numpy as jnp
    >>> float(masked_count(jnp.array([1, 0, 1])))
    2.0
  """
  return jnp.sum(v.as_f32(mask), axis=axis, keepdims=keepdims)


def masked_mean(x: ArrayLike, mask: ArrayLike | None = None, axis: Axis = None,
                keepdims: bool = False) -> jax.Array:
  r"""Mean over valid elements: :math:`\sum_i m_i x_i / \max(\sum_i m_i, 1)`.

  An all-masked input gives 0 (verl adds 1e-8 to the count instead; the result is the
  same up to that epsilon whenever at least one element is valid).

  Examples:
    >>> import jax.numpy as jnp
    >>> float(masked_mean(jnp.array([1., 2., 30.]), jnp.array([1, 1, 0])))
    1.5
  """
  x, mask = _prepare(x, mask)
  total = jnp.sum(x * mask, axis=axis, keepdims=keepdims)
  count = jnp.sum(mask, axis=axis, keepdims=keepdims)
  return total / jnp.maximum(count, 1.0)


def masked_var(x: ArrayLike, mask: ArrayLike | None = None, axis: Axis = None,
               keepdims: bool = False, *, ddof: int = 1) -> jax.Array:
  r"""Variance over valid elements, two-pass for accuracy.

  .. math:: \mathrm{var} = \frac{\sum_i m_i (x_i - \mu)^2}{\max(N - \mathrm{ddof}, 0)}

  ``ddof=1`` (default) is the unbiased estimator of verl/TRL; ``ddof=0`` the biased one
  of OpenRLHF. When ``N <= ddof`` the result is 0 (not NaN, not an error).

  Examples:
    >>> import jax.numpy as jnp
    >>> float(masked_var(jnp.array([1., 2., 3., 99.]), jnp.array([1, 1, 1, 0])))
    1.0
  """
  _check_ddof(ddof)
  x, mask = _prepare(x, mask)
  count = jnp.sum(mask, axis=axis, keepdims=True)
  mean = jnp.sum(x * mask, axis=axis, keepdims=True) / jnp.maximum(count, 1.0)
  sq = jnp.sum(jnp.square(x - mean) * mask, axis=axis, keepdims=keepdims)
  if not keepdims:
    count = jnp.sum(mask, axis=axis, keepdims=False)
  dof = count - ddof
  return jnp.where(dof > 0, sq / jnp.where(dof > 0, dof, 1.0), 0.0)


def masked_std(x: ArrayLike, mask: ArrayLike | None = None, axis: Axis = None,
               keepdims: bool = False, *, ddof: int = 1) -> jax.Array:
  """Square root of :func:`masked_var` (0 when ``N <= ddof``).

  Examples:
    >>> import jax.numpy as jnp
    >>> float(masked_std(jnp.array([1., 3., 99.]), jnp.array([1, 1, 0]), ddof=0))
    1.0
  """
  return jnp.sqrt(masked_var(x, mask, axis, keepdims, ddof=ddof))


def masked_whiten(x: ArrayLike, mask: ArrayLike | None = None, *, shift_mean: bool = True,
                  eps: float = 1e-8, ddof: int = 1) -> jax.Array:
  r"""Whiten valid elements with statistics over all of them.

  .. math::
    \hat x_i = (x_i - \mu)\,/\sqrt{\mathrm{var} + \epsilon}
    \;(+\mu \text{ if not shift\_mean})

  Defaults reproduce verl ``masked_whiten`` (ddof=1, eps=1e-8 inside the sqrt).
  OpenRLHF's global whitening is ``ddof=0``. Outputs at masked positions are 0; the
  result has the dtype of ``x``. A constant or single-element input gives 0 (or the
  mean with ``shift_mean=False``), never NaN.

  Examples:
    >>> import jax.numpy as jnp
    >>> y = masked_whiten(jnp.array([1., 2., 3., 99.]), jnp.array([1, 1, 1, 0]))
    >>> [round(float(a), 4) for a in y]
    [-1.0, 0.0, 1.0, 0.0]
  """
  v.check_range("eps", eps, low=0.0)
  _check_ddof(ddof)
  dtype = v.out_dtype(x)
  xf, mf = _prepare(x, mask)
  mean = masked_mean(xf, mf)
  var = masked_var(xf, mf, ddof=ddof)
  out = (xf - mean) * jnp.reciprocal(jnp.sqrt(var + eps))
  if not shift_mean:
    out = out + mean
  return jnp.where(mf > 0, out, 0.0).astype(dtype)


def explained_variance(y_pred: ArrayLike, y_true: ArrayLike,
                       mask: ArrayLike | None = None) -> jax.Array:
  r"""Fraction of the variance of ``y_true`` explained by ``y_pred`` on valid elements.

  .. math:: 1 - \mathrm{var}(y - \hat y) / \mathrm{var}(y)

  Returns 0 when ``var(y)`` is 0 (undefined), so it is always finite. Biased variances
  (ddof=0) on both sides, as in stable-baselines and verl's critic metrics.

  Examples:
    >>> import jax.numpy as jnp
    >>> round(float(explained_variance(jnp.array([1., 2., 2.]), jnp.array([1., 2., 3.]))), 4)
    0.6667
  """
  v.check_same_shape(("y_pred", "y_true"), (y_pred, y_true))
  v.check_float("y_pred", y_pred)
  v.check_float("y_true", y_true)
  var_y = masked_var(y_true, mask, ddof=0)
  var_res = masked_var(v.as_f32(y_true) - v.as_f32(y_pred), mask, ddof=0)
  return jnp.where(var_y > 0, 1.0 - var_res / jnp.where(var_y > 0, var_y, 1.0), 0.0)
