r"""Packed batches: several sequences per row, described by segment ids.

A heavy-tailed batch (one 16k-token answer, thirty 500-token ones) padded to
``[B, max_len]`` spends most of the train step on padding. Packing puts the sequences
one after another into rows of a fixed token budget ``T`` (``max_tokens``) and
describes the layout with two ``[R, T]`` arrays:

* ``segment_ids``: ``1, 2, ...`` for the sequences of a row, in order, as contiguous
  runs; ``0`` on padding (which only trails the row);
* ``positions``: the index of each token inside its own sequence (restarting at 0 at
  each segment start), the RoPE positions.

Every piece of the library that mixes tokens takes ``segment_ids``: attention never
attends across segments (:func:`jaxrl_llm.dot_product_attention`, ring attention), GAE
restarts at each segment (a boundary is terminal), log-probs never read across a
boundary, sequence-level reductions (``seq-mean-*`` aggregation, GSPO/GMPO's sequence
ratio, sequence-level rollout correction) reduce per segment. The train step reads
``batch["segment_ids"]`` (:mod:`jaxrl_llm.train.step`).

Packer: **first-fit decreasing** (Johnson 1973): the sequences sorted by length,
longest first (ties by index, so the plan is deterministic), each placed in the first
row with room, a new row opened when none has. It uses at most
:math:`\tfrac{11}{9}\mathrm{OPT} + \tfrac{6}{9}` rows. Rows are then padded (all-zero
rows appended) to a multiple of ``row_multiple`` so minibatch and microbatch splits
divide the row count.

Host side (NumPy, data-dependent shapes): :func:`plan_packing`,
:func:`check_segments`. Device side (pure, jit-able given a plan): :func:`pack`,
:func:`unpack`, :func:`segment_sum`, :func:`segment_positions`,
:func:`segment_starts`.

Examples:
  >>> import numpy as np
  >>> mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])   # lengths 3, 2, 4
  >>> plan = plan_packing(mask, max_tokens=5)
  >>> plan.segment_ids.tolist()      # row 0: seq 2 (4 tokens); row 1: seq 0 then seq 1
  [[1, 1, 1, 1, 0], [1, 1, 1, 2, 2]]
  >>> np.asarray(pack(plan, np.arange(12).reshape(3, 4))).tolist()
  [[8, 9, 10, 11, 0], [0, 1, 2, 4, 5]]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v


class PackPlan(NamedTuple):
  """Where each sequence of a padded ``[N, L]`` batch sits in the packed ``[R, T]`` one.

  Attributes:
    source: ``[R, T]`` int, the flat index ``n * L + l`` into the padded batch of the
      token at each packed slot, ``-1`` on padding.
    segment_ids: ``[R, T]`` int32, 1, 2, ... per sequence of a row, 0 on padding.
    positions: ``[R, T]`` int32, index of the token inside its sequence (0 on padding).
    row: ``[N]`` int, the packed row of each sequence.
    start: ``[N]`` int, its first slot in that row.
    length: ``[N]`` int, its number of real tokens.
    width: ``L``, the padded batch's width.
  """

  source: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  row: np.ndarray
  start: np.ndarray
  length: np.ndarray
  width: int

  @property
  def num_rows(self) -> int:
    return int(self.source.shape[0])

  @property
  def max_tokens(self) -> int:
    return int(self.source.shape[1])


def first_fit_decreasing(lengths: Any, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
  """Bins of capacity ``max_tokens`` for items of ``lengths``, first-fit decreasing.

  Returns ``(row [N], start [N])``: the bin of each item and its offset in it (items of
  a bin lie in placement order, i.e. longest first). Items of length 0 take no room
  (row of the first bin, start 0).

  Raises:
    ValueError: ``max_tokens`` not a positive int, ``lengths`` not a 1-D sequence of
      ints (a float or 2-D one is refused, not rounded or flattened), a negative
      length, or a length above ``max_tokens`` (naming the sequence).

  Examples:
    >>> row, start = first_fit_decreasing([3, 2, 4, 1], 5)
    >>> row.tolist(), start.tolist()
    ([1, 1, 0, 0], [0, 3, 0, 4])
  """
  if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
    raise ValueError(f"`max_tokens` must be a positive int, got {max_tokens!r}.")
  given = np.asarray(lengths)
  if given.ndim != 1 or not (given.size == 0 or (np.issubdtype(given.dtype, np.integer)
                                                 and given.dtype != bool)):
    raise ValueError(f"`lengths` must be a 1-D sequence of ints, got shape {given.shape} "
                     f"dtype {given.dtype}.")
  lengths = given.astype(np.int64)
  if lengths.size and lengths.min() < 0:
    raise ValueError(f"`lengths` must be >= 0, got {lengths.min()}.")
  too_long = np.nonzero(lengths > max_tokens)[0]
  if too_long.size:
    i = int(too_long[0])
    raise ValueError(f"sequence {i} has {int(lengths[i])} tokens, more than the token "
                     f"budget `max_tokens`={max_tokens}: raise `max_tokens` or truncate.")
  order = np.argsort(-lengths, kind="stable")
  row = np.zeros(lengths.shape, np.int64)
  start = np.zeros(lengths.shape, np.int64)
  used: list[int] = []
  for i in order:
    n = int(lengths[i])
    if n == 0:
      continue
    for b, fill in enumerate(used):   # first fit
      if fill + n <= max_tokens:
        row[i], start[i] = b, fill
        used[b] = fill + n
        break
    else:
      row[i], start[i] = len(used), 0
      used.append(n)
  return row, start


def plan_packing(attention_mask: Any, max_tokens: int, *, row_multiple: int = 1,
                 num_rows: int | None = None) -> PackPlan:
  """Packs the real tokens of each row of a padded ``[N, L]`` batch (first-fit
  decreasing) into rows of ``max_tokens`` slots.

  A sequence is the real tokens of a row (``attention_mask != 0``) in order, wherever
  the padding sits (left, right, holes); they are placed contiguously. Host-side
  (NumPy): the number of rows depends on the data.

  Args:
    attention_mask: ``[N, L]``, nonzero on real tokens.
    max_tokens: the token budget of a packed row (its width ``T``).
    row_multiple: pad the row count up to a multiple of this (e.g.
      ``num_minibatches * num_microbatches`` times the data-parallel devices).
    num_rows: a fixed row count (>= the rows needed, a multiple of ``row_multiple``),
      e.g. to keep shapes and so compilations fixed across steps.

  Returns:
    A :class:`PackPlan`.

  Raises:
    ValueError: a sequence longer than ``max_tokens`` (naming it), bad shapes, or
      ``num_rows`` too small.
  """
  mask = np.asarray(attention_mask) != 0
  if mask.ndim != 2:
    raise ValueError(f"`attention_mask` must be [N, L], got shape {mask.shape}.")
  if not isinstance(row_multiple, int) or row_multiple < 1:
    raise ValueError(f"`row_multiple` must be a positive int, got {row_multiple!r}.")
  n, width = mask.shape
  lengths = mask.sum(axis=1)
  row, start = first_fit_decreasing(lengths, max_tokens)
  needed = int(row[lengths > 0].max()) + 1 if (lengths > 0).any() else 1
  rows = -(-needed // row_multiple) * row_multiple
  if num_rows is not None:
    if num_rows < needed or num_rows % row_multiple:
      raise ValueError(f"`num_rows`={num_rows} must be >= the {needed} rows needed and a "
                       f"multiple of `row_multiple`={row_multiple}.")
    rows = num_rows
  source = np.full((rows, max_tokens), -1, np.int64)
  segment_ids = np.zeros((rows, max_tokens), np.int32)
  positions = np.zeros((rows, max_tokens), np.int32)
  # segment id = rank of the sequence among those of its row by start
  seg_of = np.zeros(n, np.int32)
  for r in np.unique(row[lengths > 0]):
    members = np.nonzero((row == r) & (lengths > 0))[0]
    members = members[np.argsort(start[members], kind="stable")]
    seg_of[members] = np.arange(1, members.size + 1)
  for i in np.nonzero(lengths > 0)[0]:
    cols = np.nonzero(mask[i])[0]
    r, s, k = int(row[i]), int(start[i]), cols.size
    source[r, s:s + k] = i * width + cols
    segment_ids[r, s:s + k] = seg_of[i]
    positions[r, s:s + k] = np.arange(k)
  return PackPlan(source=source, segment_ids=segment_ids, positions=positions, row=row,
                  start=start, length=lengths.astype(np.int64), width=width)


def pack(plan: PackPlan, x: ArrayLike, *, fill: Any = 0) -> jax.Array:
  """The packed ``[R, T]`` form of a padded per-token ``[N, L]`` array, or of a
  per-sequence ``[N]`` array (broadcast over the sequence's tokens); ``fill`` on
  padding. Pure in ``x`` (the plan is static data), so it runs under ``jax.jit``.

  Examples:
    >>> import numpy as np
    >>> plan = plan_packing(np.array([[1, 1, 0], [0, 1, 1]]), max_tokens=4)
    >>> np.asarray(pack(plan, np.array([10.0, 20.0]))).tolist()
    [[10.0, 10.0, 20.0, 20.0]]
  """
  x = jnp.asarray(x)
  n = plan.length.shape[0]
  real = plan.source >= 0
  src = np.where(real, plan.source, 0)
  if x.shape == (n,):
    flat = x[src // plan.width]
  elif x.shape[:2] == (n, plan.width):
    flat = x.reshape((n * plan.width,) + x.shape[2:])[src]
  else:
    raise ValueError(f"`x` must have shape [N, L] = {(n, plan.width)} (per token) or "
                     f"[N] = {(n,)} (per sequence), got {tuple(x.shape)}.")
  keep = jnp.asarray(real).reshape(real.shape + (1,) * (flat.ndim - 2))
  return jnp.where(keep, flat, jnp.asarray(fill, x.dtype))


def unpack(plan: PackPlan, y: ArrayLike, *, fill: Any = 0) -> jax.Array:
  """The padded ``[N, L]`` form of a packed per-token ``[R, T]`` array (the inverse of
  :func:`pack` on real tokens; ``fill`` at the padded batch's padding).

  Examples:
    >>> import numpy as np
    >>> mask = np.array([[1, 1, 0], [0, 1, 1]])
    >>> plan = plan_packing(mask, max_tokens=4)
    >>> x = np.array([[1, 2, 0], [0, 3, 4]])
    >>> np.asarray(unpack(plan, pack(plan, x))).tolist()
    [[1, 2, 0], [0, 3, 4]]
  """
  y = jnp.asarray(y)
  if y.shape[:2] != plan.source.shape:
    raise ValueError(f"`y` must have the packed shape [R, T] = {plan.source.shape}, got "
                     f"{tuple(y.shape)}.")
  n = plan.length.shape[0]
  real = plan.source.reshape(-1) >= 0
  dest = plan.source.reshape(-1)[real]
  vals = y.reshape((-1,) + y.shape[2:])[np.nonzero(real)[0]]
  out = jnp.full((n * plan.width,) + y.shape[2:], fill, y.dtype)
  return out.at[dest].set(vals).reshape((n, plan.width) + y.shape[2:])


def check_segments(segment_ids: Any, positions: Any = None, *,
                   attention_mask: Any = None) -> None:
  """Host-side check of a packed layout; raises ``ValueError`` naming the argument.

  * ``segment_ids`` ``[B, T]`` int >= 0: each nonzero id of a row is one contiguous
    run (an id that reappears after another segment is not);
  * ``positions`` (optional, same shape): 0 at each segment start and +1 per token
    inside a segment (positions that do not restart are rejected);
  * ``attention_mask`` (optional): nonzero exactly where ``segment_ids`` is.

  Data-dependent, so it cannot run under ``jax.jit``: call it where the batch is
  built (the train step trusts its input).

  Examples:
    >>> check_segments([[1, 1, 2, 2, 0]], [[0, 1, 0, 1, 0]])
    >>> check_segments([[1, 2, 1, 0]])
    Traceback (most recent call last):
    ...
    ValueError: `segment_ids` row 0: segment 1 is not one contiguous run (at index 2).
  """
  seg = np.asarray(segment_ids)
  if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"`segment_ids` must be an int [B, T] array, got shape {seg.shape} "
                     f"dtype {seg.dtype}.")
  if (seg < 0).any():
    raise ValueError("`segment_ids` must be >= 0 (0 = padding).")
  start = np.ones(seg.shape, bool)
  start[:, 1:] = seg[:, 1:] != seg[:, :-1]
  for b in range(seg.shape[0]):
    seen: set = set()
    for t in np.nonzero(start[b] & (seg[b] > 0))[0]:
      s = int(seg[b, t])
      if s in seen:
        raise ValueError(f"`segment_ids` row {b}: segment {s} is not one contiguous run "
                         f"(at index {t}).")
      seen.add(s)
  if positions is not None:
    pos = np.asarray(positions)
    if pos.shape != seg.shape:
      raise ValueError(f"`positions` must have the shape of `segment_ids` {seg.shape}, got "
                       f"{pos.shape}.")
    want = np.asarray(segment_positions(seg))
    bad = np.argwhere((seg > 0) & (pos != want))
    if bad.size:
      row, col = (int(i) for i in bad[0])
      raise ValueError(f"`positions` must restart at 0 at each segment start and count "
                       f"up by 1 inside it: row {row} index {col} has {int(pos[row, col])}, "
                       f"expected {int(want[row, col])}.")
  if attention_mask is not None:
    m = np.asarray(attention_mask)
    if m.shape != seg.shape or ((m != 0) != (seg > 0)).any():
      raise ValueError("`attention_mask` must be nonzero exactly where `segment_ids` > 0 "
                       f"(shapes {m.shape}, {seg.shape}).")


# ------------------------------------------------------------------ device-side helpers


def segment_starts(segment_ids: ArrayLike) -> jax.Array:
  """``[B, T]`` bool: the first token of each segment (index 0 of a row included).

  Examples:
    >>> segment_starts(jnp.array([[1, 1, 2, 0]])).tolist()
    [[True, False, True, True]]
  """
  seg = jnp.asarray(segment_ids)
  return jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)


def segment_positions(segment_ids: ArrayLike) -> jax.Array:
  """Positions restarting at 0 at each segment start of ``segment_ids`` ``[B, T]``
  (0 on padding): the index of each token inside its own sequence.

  Examples:
    >>> segment_positions(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
  """
  seg = jnp.asarray(segment_ids, jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
  first = jax.lax.cummax(jnp.where(segment_starts(seg), idx, 0), axis=1)
  return jnp.where(seg > 0, idx - first, 0)


def segment_sum(x: ArrayLike, segment_ids: ArrayLike | None) -> jax.Array:
  r"""Each token's segment total, :math:`S_{bt} = \sum_{t' : s_{bt'} = s_{bt}} x_{bt'}`
  (float32, ``[B, T]``; a row's padding forms segment 0 of that row).

  ``segment_ids=None`` is the one-sequence-a-row layout: the row sums
  ``jnp.sum(x, axis=-1, keepdims=True)`` (``[B, 1]``, broadcasting like ``[B, T]``),
  exactly what the unpacked code computes. This is how every sequence-level reduction
  of the library (aggregation, GSPO/GMPO ratios, rollout correction) supports packing.

  Examples:
    >>> segment_sum(jnp.array([[1., 2., 3., 4.]]), jnp.array([[1, 1, 2, 0]])).tolist()
    [[3.0, 3.0, 3.0, 4.0]]
  """
  x = v.as_f32(x)
  if segment_ids is None:
    return jnp.sum(x, axis=-1, keepdims=True)
  seg = jnp.asarray(segment_ids, jnp.int32)
  v.check_same_shape(("x", "segment_ids"), (x, seg))
  b, t = x.shape
  # Ids are global over the batch: row b's segment s is b * (T + 1) + s.
  ids = seg + jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1)
  totals = jax.ops.segment_sum(x.reshape(-1), ids.reshape(-1), num_segments=b * (t + 1))
  return totals[ids]


def padding_fraction(attention_mask: ArrayLike) -> float:
  """The share of slots of a ``[B, T]`` layout that hold no real token (host-side).

  Examples:
    >>> padding_fraction([[1, 1, 0, 0], [1, 1, 1, 1]])
    0.25
  """
  m = np.asarray(attention_mask) != 0
  return float(1.0 - m.mean()) if m.size else 0.0


# The train step's per-token entries ([N, L]) and its per-token-or-sequence ones.
_TOKEN_KEYS = ("tokens", "loss_mask", "old_logp", "rewards", "old_values", "returns",
               "ref_logp", "positions", "rollout_logp")
_TOKEN_OR_SEQUENCE_KEYS = ("advantages", "positive")


def _check_batch(batch: dict) -> None:
  """Raises ``ValueError`` naming the key for an entry that would be packed wrongly or
  passed through unpacked: a per-token entry not of ``attention_mask``'s shape, a
  ``loss_mask`` nonzero on padding (packing drops padding: those tokens would vanish)."""
  mask = np.asarray(batch["attention_mask"])
  if mask.ndim != 2:
    raise ValueError(f"batch['attention_mask'] must be [N, L], got shape {mask.shape}.")
  for key in _TOKEN_KEYS + _TOKEN_OR_SEQUENCE_KEYS:
    if key not in batch:
      continue
    shape = np.shape(batch[key])
    allowed = (mask.shape, mask.shape[:1]) if key in _TOKEN_OR_SEQUENCE_KEYS else (
        mask.shape,)
    if shape not in allowed:
      raise ValueError(f"batch['{key}'] must have shape "
                       f"{' or '.join(str(a) for a in allowed)} (batch['attention_mask'] "
                       f"[N, L]), got {shape}.")
  if "loss_mask" in batch:
    loss_mask = np.asarray(batch["loss_mask"])
    stray = np.argwhere((loss_mask != 0) & (mask == 0))
    if stray.size:
      row, col = (int(i) for i in stray[0])
      raise ValueError(f"batch['loss_mask'] must be 0 where batch['attention_mask'] is 0, "
                       f"got {loss_mask[row, col].item()!r} at [{row}, {col}].")


def pack_batch(batch: dict, max_tokens: int, *, row_multiple: int = 1,
               num_rows: int | None = None) -> tuple[dict, PackPlan]:
  """Packs a padded train batch (:mod:`jaxrl_llm.train.step` keys) into rows of
  ``max_tokens``: ``(packed_batch, plan)``.

  Per-token ``[N, L]`` entries are packed with :func:`pack`; per-sequence ``[N]``
  entries (``advantages``, ``positive``) are broadcast over their sequence's tokens
  (the step reads ``[B, T]`` forms of both). ``segment_ids`` and ``positions`` (each
  sequence's own positions: ``batch["positions"]`` if given, else the index among its
  real tokens, as the padded step's default) are added. Unpack per-token results with
  ``unpack(plan, y)``.

  Raises:
    ValueError: a known per-token entry (``tokens``, ``loss_mask``, ``old_logp``, ...)
      not of ``attention_mask``'s shape ``[N, L]``, ``advantages`` / ``positive`` not
      ``[N, L]`` or ``[N]`` (naming the key), or ``loss_mask`` nonzero where
      ``attention_mask`` is 0 (packing keeps real tokens only).

  Examples:
    >>> import numpy as np
    >>> batch = {"tokens": np.array([[5, 6, 0], [7, 8, 9]]),
    ...          "attention_mask": np.array([[1, 1, 0], [1, 1, 1]]),
    ...          "advantages": np.array([1.0, -1.0])}
    >>> packed, plan = pack_batch(batch, max_tokens=6)
    >>> np.asarray(packed["tokens"]).tolist(), np.asarray(packed["segment_ids"]).tolist()
    ([[7, 8, 9, 5, 6, 0]], [[1, 1, 1, 2, 2, 0]])
  """
  if "attention_mask" not in batch or "tokens" not in batch:
    raise ValueError(f"`batch` needs 'tokens' and 'attention_mask' (has {sorted(batch)}).")
  if "segment_ids" in batch:
    raise ValueError("`batch` is already packed (it has 'segment_ids').")
  _check_batch(batch)
  plan = plan_packing(batch["attention_mask"], max_tokens, row_multiple=row_multiple,
                      num_rows=num_rows)
  n = plan.length.shape[0]
  out = {}
  for key, x in batch.items():
    shape = np.shape(x)
    if shape[:2] == (n, plan.width) or shape == (n,):
      out[key] = pack(plan, x)
    else:
      out[key] = x            # scalars and other per-batch entries pass through
  out["segment_ids"] = jnp.asarray(plan.segment_ids)
  if "positions" not in batch:
    out["positions"] = jnp.asarray(plan.positions)
  return out, plan


__all__ = [
    "PackPlan", "check_segments", "first_fit_decreasing", "pack", "pack_batch",
    "padding_fraction", "plan_packing", "segment_positions", "segment_starts",
    "segment_sum", "unpack",
]
