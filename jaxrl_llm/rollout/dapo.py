r"""DAPO's rollout-side tricks: dynamic sampling and the soft overlong penalty.

Both come from DAPO (Yu et al., 2025, arXiv 2503.14476, sections 3.2 and 3.4).

* **Dynamic sampling**: a group whose scores are all equal has zero group-relative
  advantage everywhere, so it contributes no policy gradient but still dilutes the
  token-mean. `dynamic_sampling` draws groups, drops the zero-variance ones, and keeps
  drawing until the batch is full, with a hard bound on the number of draws (verl-recipe
  ``algorithm.filter_groups``, ``max_num_gen_batches``). Filter on the verifiable
  accuracy, not on a shaped score (verl-recipe PR#125: filtering on shaped scores
  collapsed the policy).
* **Soft overlong punishment**: a length-dependent penalty added to the reward of
  responses that run into the last ``buffer_length`` tokens of the length budget,
  so truncated rambling is discouraged smoothly (tunix ``dapo_learner``,
  OpenRLHF ``--reward.overlong_buffer_len``, NeMo-RL ``overlong_buffer_length``).

Shapes stay static: the trainer always gets exactly ``num_groups * group_size`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def overlong_penalty(lengths: Any, *, max_length: int, buffer_length: int,
                     penalty: float = 1.0) -> jax.Array:
  r"""DAPO's soft overlong punishment, a reward term ``[B]`` (0 or negative).

  With :math:`L = ` ``max_length``, :math:`C = ` ``buffer_length`` and response
  length :math:`\ell`:

  .. math::

    R_{len}(\ell) = \begin{cases}
      0 & \ell \le L - C \\
      -p\,\dfrac{\ell - (L - C)}{C} & L - C < \ell \le L \\
      -p & \ell > L
    \end{cases}

  i.e. DAPO's :math:`((L - C) - \ell) / C` scaled by ``penalty`` :math:`p` (tunix and
  OpenRLHF call it ``penalty_factor``; 1.0 in DAPO). Add it to the task reward.

  Args:
    lengths: ``[B]`` response lengths in tokens (e.g. ``loss_mask.sum(-1)``).
    max_length: :math:`L`, the generation budget.
    buffer_length: :math:`C`, the soft zone before it, ``1 <= C <= L``.
    penalty: :math:`p \ge 0`, the penalty at and beyond :math:`L`.

  Returns:
    ``[B]`` float32 penalties in ``[-p, 0]``.

  Examples:
    >>> overlong_penalty(jnp.array([10, 12, 15, 16, 20]), max_length=16,
    ...                  buffer_length=4).tolist()
    [0.0, 0.0, -0.75, -1.0, -1.0]
  """
  if not isinstance(max_length, int) or max_length < 1:
    raise ValueError(f"`max_length` must be a positive int, got {max_length!r}.")
  if not isinstance(buffer_length, int) or not 1 <= buffer_length <= max_length:
    raise ValueError(f"`buffer_length` must be an int in [1, max_length={max_length}], "
                     f"got {buffer_length!r}.")
  if isinstance(penalty, (int, float)) and penalty < 0:
    raise ValueError(f"`penalty` must be >= 0, got {penalty!r}.")
  lengths = jnp.asarray(lengths)
  if lengths.ndim != 1:
    raise ValueError(f"`lengths` must be [B], got shape {lengths.shape}.")
  start = max_length - buffer_length
  over = jnp.clip((lengths.astype(jnp.float32) - start) / buffer_length, 0.0, 1.0)
  return (0.0 - over) * jnp.asarray(penalty, jnp.float32)  # +0.0 below the zone


def zero_variance_groups(scores: Any, group_size: int, *, atol: float = 0.0) -> np.ndarray:
  """Which groups have all scores equal (within ``atol``): ``[B // group_size]`` bool.

  Groups are contiguous runs of ``group_size`` rows, as in
  :func:`jaxrl_llm.group_advantages`. A group of one always counts as zero-variance.

  Examples:
    >>> zero_variance_groups(np.array([1., 1., 0., 1., 0., 0.]), 2).tolist()
    [True, False, True]
  """
  scores = np.asarray(scores, dtype=np.float64)
  if scores.ndim != 1:
    raise ValueError(f"`scores` must be [B], got shape {scores.shape}.")
  if not isinstance(group_size, int) or group_size < 1 or scores.shape[0] % group_size:
    raise ValueError(f"`group_size` must be a positive int dividing B={scores.shape[0]}, "
                     f"got {group_size!r}.")
  grouped = scores.reshape(-1, group_size)
  return (grouped.max(axis=1) - grouped.min(axis=1)) <= atol


class DynamicSamplingStats(NamedTuple):
  """What `dynamic_sampling` drew.

  Attributes:
    draws: calls made to ``draw`` (each draws ``groups_per_draw`` groups).
    groups_drawn: groups generated in all.
    groups_kept: groups with signal among them (before trimming to the batch).
    groups_repeated: rows of the batch filled by repeating kept groups because
      ``max_draws`` ran out (0 when the budget sufficed).
  """

  draws: int
  groups_drawn: int
  groups_kept: int
  groups_repeated: int


def _take_rows(batch: dict, rows: np.ndarray) -> dict:
  return {k: np.asarray(x)[rows] for k, x in batch.items()}


def dynamic_sampling(draw: Callable[[int], dict], *, num_groups: int, group_size: int,
                     groups_per_draw: int | None = None, max_draws: int = 4,
                     metric: str = "scores", atol: float = 0.0
                     ) -> tuple[dict | None, DynamicSamplingStats]:
  """Fills a batch with groups whose ``metric`` varies, drawing at most ``max_draws`` times.

  ``draw(n)`` generates ``n`` groups and returns a dict of arrays whose leading axis is
  ``n * group_size`` rows (contiguous groups), including ``batch[metric]`` ``[rows]``.
  Zero-variance groups (`zero_variance_groups`) are dropped; kept groups accumulate in
  draw order until ``num_groups`` are kept (extra ones are dropped, verl's rule) or
  ``max_draws`` calls were made. If the budget runs out with some but too few groups
  kept, the batch is completed by repeating kept groups cyclically (reported in
  ``groups_repeated``: a repeated group doubles its weight, never adds an all-equal
  group). If no group was kept, the result is ``None``: the caller skips the update.

  Returns:
    ``(batch or None, DynamicSamplingStats)``; the batch has exactly
    ``num_groups * group_size`` rows and no zero-variance group.

  Examples:
    >>> rng = np.random.default_rng(0)
    >>> def draw(n):
    ...   return {"scores": rng.integers(0, 2, size=n * 4).astype(np.float32)}
    >>> batch, stats = dynamic_sampling(draw, num_groups=8, group_size=4)
    >>> batch["scores"].shape, bool(zero_variance_groups(batch["scores"], 4).any())
    ((32,), False)
  """
  for name, value in (("num_groups", num_groups), ("group_size", group_size),
                      ("max_draws", max_draws)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
  per_draw = num_groups if groups_per_draw is None else groups_per_draw
  if not isinstance(per_draw, int) or per_draw < 1:
    raise ValueError(f"`groups_per_draw` must be a positive int, got {groups_per_draw!r}.")
  kept: list[dict] = []
  n_kept = drawn = draws = 0
  while n_kept < num_groups and draws < max_draws:
    batch = draw(per_draw)
    draws += 1
    drawn += per_draw
    if metric not in batch:
      raise ValueError(f"`draw` must return a dict with key {metric!r}, got {sorted(batch)}.")
    rows = np.asarray(batch[metric]).shape[0]
    if rows != per_draw * group_size:
      raise ValueError(f"`draw({per_draw})` returned {rows} rows, expected "
                       f"{per_draw} * group_size={group_size}.")
    signal = ~zero_variance_groups(batch[metric], group_size, atol=atol)
    groups = np.flatnonzero(signal)
    if groups.size:
      row_idx = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
      kept.append(_take_rows(batch, row_idx))
      n_kept += groups.size
  if n_kept == 0:
    return None, DynamicSamplingStats(draws, drawn, 0, 0)
  merged = {k: np.concatenate([b[k] for b in kept]) for k in kept[0]}
  order = np.arange(num_groups) % n_kept  # cyclic repeat only if too few were kept
  rows = (order[:, None] * group_size + np.arange(group_size)).reshape(-1)
  repeated = max(num_groups - n_kept, 0)
  return _take_rows(merged, rows), DynamicSamplingStats(draws, drawn, n_kept, repeated)
