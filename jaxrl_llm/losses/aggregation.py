r"""Reduction of per-token losses to scalars, exact across microbatches and devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _validate as v
from jaxrl_llm._names import AGGREGATION_MODES
from jaxrl_llm.losses._common import ArrayLike, Coef, check_positive, masked_f32
from jaxrl_llm.packing import segment_sum


def aggregate_parts(per_token: ArrayLike, mask: ArrayLike, mode: str = "token-mean", *,
                    norm_length: Coef | None = None,
                    segment_ids: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
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
      ``loss_scale_factor`` / TRL's ``max_completion_length`` across batches; with
      packed rows pass it always: ``T`` is then the token budget).
    segment_ids: ``[B, T]`` int of packed rows (:mod:`jaxrl_llm.packing`): the
      ``seq-*`` modes then reduce per segment (a sequence is a segment, not a row);
      ``token-*`` modes are unchanged.

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
  check_positive("norm_length", norm_length)
  valid = v.as_f32(mask) > 0
  values = masked_f32(per_token, valid)
  if segment_ids is not None and mode.startswith("seq-"):
    # Every valid token carries 1/|o_s| of its segment s: summed, each non-empty
    # segment counts once, and its mean is the sum of values / |o_s|.
    seg_len = segment_sum(valid, segment_ids)
    inv = jnp.where(valid, 1.0 / jnp.maximum(seg_len, 1.0), 0.0)
    seqs = jnp.sum(inv)
    if mode == "seq-mean-token-mean":
      return jnp.sum(values * inv), seqs
    if mode == "seq-mean-token-sum":
      return jnp.sum(values), seqs
    if norm_length is None:
      norm_length = v.shape_of(per_token)[1]
    return jnp.sum(values) / v.as_f32(norm_length), seqs
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
              norm_length: Coef | None = None,
              segment_ids: ArrayLike | None = None) -> jax.Array:
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
    segment_ids: packed rows, as in :func:`aggregate_parts`.

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
  total, denom = aggregate_parts(per_token, mask, mode, norm_length=norm_length,
                                 segment_ids=segment_ids)
  return total / jnp.maximum(denom, 1.0)


__all__ = ["AGGREGATION_MODES", "aggregate_parts", "aggregate"]
