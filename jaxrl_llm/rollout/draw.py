r"""Batch-invariant token draws: one key per (seed, request, sample, position).

The engine draws the token of slot ``s`` from its own row of logits with its own key

.. math::

  \kappa = \mathrm{fold\_in}(\mathrm{fold\_in}(\mathrm{fold\_in}(
      \mathrm{key}(\text{seed}), r), j), n)

for request ``r``, sample ``j`` and generated position ``n``, and every operation is
row-wise, so a row's token and log-probs depend on its logits and its key only (not on
the slot it sits in, nor on the other rows).

The draw is an inverse-CDF draw from one uniform per row: with the filtered,
renormalised probabilities :math:`q` and :math:`u \sim U(0, 1]`,

.. math::

  y = \min\{i : \textstyle\sum_{i' \le i} q_{i'} \ge u \sum_{i'} q_{i'}\},

one ``cumsum`` over the vocabulary instead of ``jax.random.categorical``'s Gumbel noise
over all of it (the issue measured 29 ms against 5.8 ms at ``[32, 32000]`` on CPU).
A token of probability 0 is never drawn (its CDF step is empty and ``u > 0``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

_NEG = -1e30


def row_keys(key: jax.Array, request: ArrayLike, sample: ArrayLike,
             position: ArrayLike) -> jax.Array:
  """``[S]`` keys ``fold_in(fold_in(fold_in(key, request), sample), position)``.

  ``key`` is one key, or ``[S]`` keys (one per row: rows of several seeds).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> k = row_keys(jax.random.key(0), jnp.array([0, 0]), jnp.array([0, 1]),
    ...              jnp.array([3, 3]))
    >>> bool(jnp.all(jax.random.key_data(k[0]) == jax.random.key_data(k[1])))
    False
  """
  def one(r, j, n):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, r), j), n)

  if jnp.ndim(key) == 0:
    return jax.vmap(one)(request, sample, position)
  return jax.vmap(lambda k, r, j, n: jax.random.fold_in(
      jax.random.fold_in(jax.random.fold_in(k, r), j), n))(key, request, sample, position)


def filter_rows(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Per-row top-k then top-p filtering of ``scaled`` ``[S, V]`` logits.

  ``top_k`` ``[S]`` int (``<= 0``: off; ties at the k-th value are kept), ``top_p``
  ``[S]`` float (``>= 1``: off; token ``i`` in descending order is kept iff the mass
  before it is ``< top_p``): the rules of :func:`jaxrl_llm.rollout.filter_logits`, with
  per-row values. Filtered logits become ``-1e30``.

  Examples:
    >>> import jax.numpy as jnp
    >>> z = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    >>> out = filter_rows(z, jnp.array([0, 1]), jnp.array([0.7, 1.0]))
    >>> (out > -1e29).astype(int).tolist()
    [[1, 1, 0], [1, 0, 0]]
  """
  vocab = scaled.shape[-1]
  ordered = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
  scaled = jnp.where(scaled < kth, _NEG, scaled)
  ordered = jnp.where(ordered < kth, _NEG, ordered)
  probs = jax.nn.softmax(ordered, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  p = top_p[:, None]
  keep = (before < p) | (p >= 1.0) | (jnp.arange(vocab) == 0)[None]
  threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled < threshold, _NEG, scaled)


def draw(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
         top_p: jax.Array, *, filtered: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""One token per row and its two log-probs.

  Row ``s`` with ``temperature[s] > 0`` draws from
  :math:`\mathrm{softmax}(\mathrm{filter}_{k,p}(z / \tau))` by inverse CDF (module
  docstring) and reports ``logp`` :math:`= \log\mathrm{softmax}(z/\tau)[y]` (the full,
  temperature-scaled distribution: the convention of
  :func:`jaxrl_llm.rollout.sample`) and ``filtered_logp`` under the filtered,
  renormalised distribution it was drawn from. ``temperature[s] == 0`` is greedy:
  :math:`y = \arg\max z`, ``logp`` :math:`= \log\mathrm{softmax}(z)[y]`,
  ``filtered_logp = 0``.

  Args:
    logits: ``[S, V]`` float32.
    keys: ``[S]`` keys (:func:`row_keys`).
    temperature: ``[S]`` float (``0`` = greedy).
    top_k: ``[S]`` int (``<= 0`` = off).
    top_p: ``[S]`` float (``>= 1`` = off).
    filtered: static; False skips the filtering (and its sort over V) for all rows.

  Returns:
    ``(tokens [S] int32, logp [S] float32, filtered_logp [S] float32)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> z = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    >>> keys = row_keys(jax.random.key(0), jnp.array([0, 1]), jnp.zeros(2, int),
    ...                 jnp.zeros(2, int))
    >>> y, logp, flogp = draw(z, keys, jnp.array([0.0, 1.0]), jnp.array([0, 1]),
    ...                       jnp.ones(2), filtered=True)
    >>> y.tolist(), [round(float(x), 4) for x in logp], flogp.tolist()
    ([0, 2], [-0.6931, -0.2231], [0.0, 0.0])
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  greedy = temperature <= 0
  tau = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)[:, None]
  # Shift before scaling: exact 0 at the argmax even for a tiny temperature.
  scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / tau
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  masked = filter_rows(scaled, top_k, top_p) if filtered else scaled
  logq = jax.nn.log_softmax(masked, axis=-1)
  u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # (0, 1]
  cdf = jnp.cumsum(jnp.exp(logq), axis=-1)
  target = u[:, None] * cdf[:, -1:]
  sampled = jnp.minimum(jnp.sum(cdf < target, axis=-1), vocab - 1)
  token = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  logp = jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]
  flogp = jnp.take_along_axis(logq, token[:, None], axis=-1)[:, 0]
  return token, logp, jnp.where(greedy, 0.0, flogp)


__all__ = ["draw", "filter_rows", "row_keys"]
