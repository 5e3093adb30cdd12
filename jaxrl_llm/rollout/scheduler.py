"""The rollout engine's host side: requests in, a plan per device call, completions out.

:class:`Scheduler` is plain Python and NumPy (no JAX): it owns the waiting samples, the
slots, the page pool (:class:`~jaxrl_llm.rollout.paged_cache.PagePool`: free list,
reference counts, reservations) and the bookkeeping of what each slot generated. The
engine (:class:`jaxrl_llm.rollout.engine.RolloutEngine`) drives it in the shape of
vLLM's scheduler, one step at a time:

1. :meth:`Scheduler.schedule` admits waiting samples into free slots (taking their
   pages) and returns a :class:`Plan`: the admission rounds (which prompts to prefill,
   packed into :class:`PrefillBatch` es of one fixed shape; which slot takes which
   prompt's logits and which page copy) and the :class:`DecodeBatch` of the live
   slots (rows, page tables, sampling settings, step limit).
2. The engine runs the plan's device calls in order.
3. :meth:`Scheduler.apply` takes the decode call's tokens and log-probs, extends the
   slots, and returns the :class:`Completion` s of the slots that finished (their
   pages freed at once).

With ``prefix_cache=True`` a finishing slot leaves its full pages to a
:class:`~jaxrl_llm.rollout.paged_cache.PrefixCache`, a group opens on the pages of its
prompt's longest cached prefix and prefills the rest (:class:`Admission`'s
``reused_tokens``), admission evicts cached pages (LRU) before a sample would wait, and
:meth:`Scheduler.set_cache_key` empties the cache when the parameters change.

Admission, page reservation and finishing are therefore testable without a model
(``tests/rollout/test_scheduler.py``). Everything here is decided by host state only, never by
a device result, so a plan may take pages that the device calls before it in the same
plan still read: the engine runs the calls in plan order.

Examples:
  >>> sched = Scheduler(max_slots=2, page_size=4, num_pages=8, max_len=12)
  >>> sched.submit(0, [Request([1, 2, 3, 4, 5], n=2, max_new_tokens=3)],
  ...              np.zeros(2, np.uint32))
  >>> plan = sched.schedule(n_eos=1, version=0)
  >>> [(a.slot, a.src, a.dst) for a in plan.admissions[0].admits]   # copy-on-write
  [(0, 1, 2), (1, 1, 3)]
  >>> out = np.array([[7, 8, 9], [4, 2, 6]]), np.zeros((2, 3)), np.zeros((2, 3))
  >>> generated, done = sched.apply(plan, out)
  >>> generated, [(c.sample, c.tokens.tolist(), c.finish_reason) for _, c in done]
  (6, [(0, [7, 8, 9], 'length'), (1, [4, 2, 6], 'length')])
  >>> sched.pool.in_use, sched.in_flight
  (0, 0)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rollout.paged_cache import PagePool, PrefixCache

POLICIES = ("longest_first", "fifo")

GroupKey = tuple[int, int, int]      # (call, request, sample or 0 when shared)
Job = tuple[np.ndarray, int, list[int]]   # (tokens, first position, page ids)


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt to complete ``n`` times.

  Attributes:
    prompt: the prompt token ids (non-empty).
    n: number of samples (>= 1); they share the prompt's prefill and pages.
    max_new_tokens: the most tokens to generate per sample (>= 1).
    temperature: :math:`\\tau > 0` to sample, ``0`` for greedy decoding.
    top_k: keep the k most likely tokens when sampling (``None``: all).
    top_p: nucleus mass in ``(0, 1]`` when sampling (``None``: 1).
    eos_ids: ids that end a sample (kept as its last token), or ``None``.
    tag: any value, copied to the request's completions (``Completion.tag``): a
      caller's key for completions that finish in a later call of a partial rollout.

  Examples:
    >>> Request([1, 2, 3], n=4, max_new_tokens=8, temperature=0.7, eos_ids=(2,)).n
    4
    >>> Request([], max_new_tokens=8)
    Traceback (most recent call last):
    ...
    ValueError: `prompt` must be a non-empty sequence of token ids, got [].
  """

  prompt: Sequence[int]
  _: dataclasses.KW_ONLY
  n: int = 1
  max_new_tokens: int
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  eos_ids: Sequence[int] | None = None
  tag: Any = None

  def __post_init__(self) -> None:
    prompt = np.asarray(self.prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not (
        np.issubdtype(prompt.dtype, np.integer)):
      raise ValueError(f"`prompt` must be a non-empty sequence of token ids, got "
                       f"{self.prompt!r}.")
    for name in ("n", "max_new_tokens"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
    if not self.temperature >= 0:
      raise ValueError(f"`temperature` must be >= 0 (0 = greedy), got {self.temperature!r}.")
    if self.top_k is not None and (not isinstance(self.top_k, (int, np.integer))
                                   or self.top_k < 1):
      raise ValueError(f"`top_k` must be None or an int >= 1, got {self.top_k!r}.")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ValueError(f"`top_p` must be None or in (0, 1], got {self.top_p!r}.")
    if self.eos_ids is not None and (np.asarray(self.eos_ids).ndim != 1 or not np.issubdtype(
        np.asarray(self.eos_ids).dtype, np.integer)):
      raise ValueError(f"`eos_ids` must be None or a sequence of ints, got "
                       f"{self.eos_ids!r}.")


@dataclasses.dataclass(frozen=True)
class Completion:
  """One generated sample.

  Attributes:
    request: index of its :class:`Request` in the list given to the ``generate`` call
      that submitted it.
    sample: its index among the request's ``n`` samples.
    tokens: ``[L]`` int32 generated ids (the stop id included when it ended on one).
    logprobs: ``[L]`` float32 log-probs under the temperature-scaled full distribution.
    filtered_logprobs: ``[L]`` float32 log-probs under the filtered distribution the
      tokens were drawn from (0 when greedy).
    finish_reason: ``"eos"`` (ended on one of ``eos_ids``) or ``"length"``.
    versions: ``[L]`` int32, the ``version`` of the ``generate`` call that sampled each
      token (a partial rollout continued over calls spans several); None when built by
      hand.
    tag: the :attr:`Request.tag` of its request.
    cached_tokens: the leading prompt tokens whose keys/values came from the engine's
      prefix cache (not prefilled for this request; 0 without ``prefix_cache``).
  """

  request: int
  sample: int
  tokens: np.ndarray
  logprobs: np.ndarray
  filtered_logprobs: np.ndarray
  finish_reason: str
  versions: np.ndarray | None = None
  tag: Any = None
  cached_tokens: int = 0


def ceil_div(a: int, b: int) -> int:
  """``ceil(a / b)`` of positive ints."""
  return -(-a // b)


def pages_needed(request: Request, page_size: int) -> int:
  """Pages one sample of ``request`` needs alone: its prompt's pages (the partly
  filled last one kept for the copies of samples still waiting) and its own pages
  (from the copy of the prompt's last partial page to its last token's).

  >>> pages_needed(Request([1] * 5, max_new_tokens=8), page_size=4)   # 2 prompt + 2 own
  4
  """
  p, ps = len(request.prompt), page_size
  own = ceil_div(p + request.max_new_tokens - 1, ps) - p // ps
  return ceil_div(p, ps) + own


@dataclasses.dataclass
class Group:
  """The prefill shared by samples of one request (all ``n``, or one when unshared)."""

  key: GroupKey
  prompt: np.ndarray
  waiting: int                    # samples not yet admitted
  pages: list[int] = dataclasses.field(default_factory=list)
  reused: int = 0                 # leading prompt tokens whose pages came from the cache
  kv_key: Any = None              # the cache key its prompt pages were computed under


@dataclasses.dataclass
class Slot:
  """A sample being generated: its pages and what it generated so far."""

  call: int                       # the generate call that submitted the request
  request: int
  sample: int
  group: Group
  shared: list[int]               # full prompt pages (read only)
  own: list[int]                  # pages this slot writes
  reserved: int                   # own pages still to take
  position: int                   # next position to write = tokens in the cache
  kv_key: Any = None              # the cache key its pages were computed under
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  filtered: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
  """One prefill forward ``[R, c]``: row ``i`` writes ``tokens[i]`` at ``positions[i]``
  (-1: padding) into the pages ``table[i]``; ``ends`` lists ``(row, job)`` for the rows
  holding a job's last token (the job's logits are that row's)."""

  tokens: np.ndarray              # [R, c] int32
  positions: np.ndarray           # [R, c] int32
  table: np.ndarray               # [R, pages_per_slot] int32
  ends: tuple[tuple[int, int], ...]
  padded: int                     # rows with no token


def _batch(pieces: list, rows: int, chunk: int, width: int) -> PrefillBatch:
  """The batch of ``pieces`` ``(job, first position, tokens, page ids, is_last)``."""
  tokens = np.zeros((rows, chunk), np.int32)
  positions = np.full((rows, chunk), -1, np.int32)
  table = np.zeros((rows, width), np.int32)
  for row, (_, at, part, ids, _) in enumerate(pieces):
    tokens[row, :len(part)] = part
    positions[row, :len(part)] = np.arange(len(part)) + at
    table[row, :len(ids)] = ids
  ends = tuple((row, job) for row, (job, _, _, _, last) in enumerate(pieces) if last)
  return PrefillBatch(tokens, positions, table, ends, rows - len(pieces))


def pack_prefill(jobs: Sequence[Job], rows: int, chunk: int,
                 width: int) -> list[PrefillBatch]:
  """Batches of a FIXED shape ``[rows, chunk]`` writing each job's tokens: a job of
  ``L`` tokens takes ``ceil(L / chunk)`` rows (consecutive pieces; a later piece reads
  the keys an earlier one wrote, in the same call or an earlier one), the rows of all
  jobs packed in order, ``rows`` per batch, the last padded. A row's arithmetic then
  depends only on its own tokens, positions and pages at that shape, so an admitted
  prompt's keys, values and logits are bitwise the same whatever is beside it.

  >>> [b.ends for b in pack_prefill([(np.arange(5), 0, [0, 1]), (np.arange(2), 0, [2])],
  ...                               rows=2, chunk=4, width=2)]
  [((1, 0),), ((0, 1),)]
  """
  pieces = [(j, start + k, tokens[k:k + chunk], ids, k + chunk >= len(tokens))
            for j, (tokens, start, ids) in enumerate(jobs)
            for k in range(0, len(tokens), chunk)]
  return [_batch(pieces[first:first + rows], rows, chunk, width)
          for first in range(0, len(pieces), rows)]


def shrink_prefill(jobs: Sequence[Job], max_rows: int, chunk: int,
                   width: int) -> list[PrefillBatch]:
  """Batches feeding ``chunk`` tokens of each unfinished job (up to ``max_rows`` of
  them) per round in ``[R, chunk]``, ``R`` the least of ``max_rows, max_rows / 4, ...``
  (down to 1 or 2) that holds them: the rounds only a few long jobs need cost a few
  rows, in at most ``log4(max_rows) + 1`` shapes (the recompute of a partial rollout's
  cache; admissions use :func:`pack_prefill`'s one shape).

  >>> [(b.tokens.shape, b.ends) for b in shrink_prefill(
  ...     [(np.arange(5), 0, [0, 1]), (np.arange(2), 0, [2])], 8, chunk=4, width=2)]
  [((2, 4), ((1, 1),)), ((2, 4), ((0, 0),))]
  """
  done_at = [0] * len(jobs)
  batches = []
  while todo := [j for j, (tokens, _, _) in enumerate(jobs)
                 if done_at[j] < len(tokens)][:max_rows]:
    rows = max_rows
    while rows > 1 and rows // 4 >= len(todo):
      rows //= 4
    pieces = []
    for j in todo:
      tokens, start, ids = jobs[j]
      part = tokens[done_at[j]:done_at[j] + chunk]
      pieces.append((j, start + done_at[j], part, ids, done_at[j] + len(part) == len(tokens)))
      done_at[j] += len(part)
    batches.append(_batch(pieces, rows, chunk, width))
  return batches


@dataclasses.dataclass(frozen=True)
class Admit:
  """A sample entering ``slot``: it takes the logits of its group's prompt and a copy
  of page ``src`` into ``dst`` (its own copy of the prompt's partial last page; 0, 0
  when there is none: a copy of page 0 onto itself)."""

  slot: int
  group: GroupKey
  src: int
  dst: int


@dataclasses.dataclass(frozen=True)
class Admission:
  """One admission round: prefill the prompts of ``prefill`` (job ``k`` of ``batches``
  is ``prefill[k]``), then run ``admits`` in order; the groups ``closed`` have no
  sample left to admit (their prompt logits are no longer needed)."""

  prefill: tuple[GroupKey, ...]   # groups opened by this round, then those prefilled ahead
  prefill_tokens: int
  ahead: int                      # groups prefilled ahead of their admission
  batches: tuple[PrefillBatch, ...]
  admits: tuple[Admit, ...]
  closed: tuple[GroupKey, ...]
  reused_tokens: int = 0          # prompt tokens of ``prefill`` read from the prefix cache
  hits: int = 0                   # groups of ``prefill`` that found a cached prefix


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
  """One decode call over ``W`` rows: row ``rows_of[k]`` is live slot ``slots[k]``."""

  slots: tuple[int, ...]          # the live slots, in slot order
  rows_of: tuple[int, ...]        # each live slot's row
  rows: np.ndarray | None         # [W] int32 slot of each row; None: W = max_slots, row = slot
  table: np.ndarray               # [W, pages_per_slot] int32
  arrays: dict[str, np.ndarray]   # position (-1: not live), count, max_new, request, ...
  key_data: np.ndarray            # [W, 2] uint32 key data of each row's seed
  eos: np.ndarray                 # [W, n_eos] int32, -1 padded
  exit_after: int                 # return once this many slots finished (0: never)
  limit: int                      # the most decode steps of the call
  pages_in_use: int               # pool pages in use during the call
  version: int                    # recorded for every token the call generates


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one step of the engine runs on the device, in this order."""

  admissions: tuple[Admission, ...]
  decode: DecodeBatch


@dataclasses.dataclass(frozen=True)
class Recompute:
  """The in-flight cache prefilled again (a new policy version): the prompt jobs
  (``owners[k]``: the group that keeps job ``k``'s logits, None for a prompt whose
  samples are all in slots), then each live slot's own tokens (``tail_slots[k]`` takes
  tail job ``k``'s logits)."""

  owners: tuple[GroupKey | None, ...]
  prompt_batches: tuple[PrefillBatch, ...]
  tail_slots: tuple[int, ...]
  tail_batches: tuple[PrefillBatch, ...]
  tokens: int


class Scheduler:
  """Waiting samples, slots, pages and finished samples of a rollout engine (module
  docstring); the arguments are the engine's of the same names."""

  def __init__(self, *, max_slots: int, page_size: int, num_pages: int, max_len: int,
               steps_per_call: int = 16, prefill_chunk: int = 128, prefill_rows: int = 1,
               decode_widths: Sequence[int] = (), policy: str = "longest_first",
               share_prompts: bool = True, refill_after: int = 1,
               prefix_cache: bool = False) -> None:
    if policy not in POLICIES:
      raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}.")
    self.max_slots, self.page_size, self.steps_per_call = max_slots, page_size, steps_per_call
    self.pages_per_slot = ceil_div(max_len, page_size)
    self.prefill_chunk, self.prefill_rows = prefill_chunk, prefill_rows
    self.decode_widths = tuple(sorted({int(x) for x in decode_widths} | {max_slots}))
    self.policy, self.share_prompts, self.refill_after = policy, share_prompts, refill_after
    self.pool = PagePool(num_pages)
    self.slots: list[Slot | None] = [None] * max_slots
    self.queue: collections.deque[tuple[int, int, int]] = collections.deque()
    self.groups: dict[GroupKey, Group] = {}     # groups with samples waiting
    self.requests: dict[int, list[Request]] = {}
    self.key_data: dict[int, np.ndarray] = {}   # call -> [2] uint32 key data of its seed
    self.first_request: dict[int, int] = {}     # call -> key index of its request 0
    self.cache = PrefixCache(self.pool, page_size) if prefix_cache else None
    self.cache_key: Any = None                  # what the cached pages were computed under

  # -- requests in ------------------------------------------------------------------

  def submit(self, call: int, requests: Sequence[Request], key_data: np.ndarray,
             first_request: int = 0) -> None:
    """Queues the samples of ``requests`` (call ``call``) after those waiting, in the
    order of :attr:`policy`; their draws use ``key_data`` and request indices from
    ``first_request``."""
    self.requests[call] = list(requests)
    self.key_data[call] = key_data
    self.first_request[call] = first_request
    order = list(range(len(requests)))
    if self.policy == "longest_first":
      order.sort(key=lambda i: -requests[i].max_new_tokens)
    self.queue.extend((call, i, j) for i in order for j in range(requests[i].n))

  @property
  def in_flight(self) -> int:
    """Samples submitted and not finished (in a slot or waiting)."""
    return sum(slot is not None for slot in self.slots) + len(self.queue)

  def has_work(self) -> bool:
    """Whether a sample waits or is in a slot."""
    return bool(self.queue or any(self.slots))

  def has_cache(self) -> bool:
    """Whether the device cache holds something a later step reads (a slot's pages,
    or a prompt with samples waiting)."""
    return bool(any(self.slots) or self.groups)

  def sampling_mode(self) -> tuple[bool, int]:
    """``(filtered, n_eos)`` of the samples in flight: whether any uses top-k/top-p,
    and the most stop ids of one (rounded up to a power of two): a decode compilation
    each."""
    live = [self.requests[c][i] for c, i, _ in self.queue] + [
        self.requests[slot.call][slot.request] for slot in self.slots if slot is not None]
    filtered = any(r.temperature > 0 and (r.top_k is not None or (
        r.top_p is not None and r.top_p < 1)) for r in live)
    n_eos = max([len(r.eos_ids) for r in live if r.eos_ids is not None] + [1])
    return filtered, 1 << (n_eos - 1).bit_length()

  def _group(self, call: int, request: int, sample: int) -> Group:
    key = (call, request, 0) if self.share_prompts else (call, request, sample)
    if key not in self.groups:
      r = self.requests[call][request]
      self.groups[key] = Group(key, np.asarray(r.prompt, np.int32),
                               r.n if self.share_prompts else 1)
    return self.groups[key]

  # -- the plan ---------------------------------------------------------------------

  def schedule(self, *, n_eos: int, version: int,
               budget_left: int | None = None) -> Plan:
    """Admits waiting samples into the free slots (rounds, :meth:`_admission_round`)
    and hands the live slots the pages of their next tokens; returns the plan of the
    step. ``budget_left`` (None: no budget) cuts the decode to
    ``ceil(budget_left / live slots)`` steps."""
    admissions = []
    while True:
      admission, again = self._admission_round()
      if admission is not None:
        admissions.append(admission)
      if not again:
        break
    live = [index for index, slot in enumerate(self.slots) if slot is not None]
    if not live:
      raise RuntimeError("no sample could be admitted (internal: pages leaked?).")
    return Plan(tuple(admissions), self._decode_batch(live, n_eos, version, budget_left))

  def _admission_round(self) -> tuple[Admission | None, bool]:
    """Admits waiting samples into the free slots, in queue order, while the pool
    holds their pages (a sample's own pages reserved, its copy of the prompt's partial
    last page taken; cached pages evicted for them if need be); the groups it opens get
    their prompt pages (:meth:`_open`), and rows their prefill leaves free prefill the
    next groups ahead (:meth:`_prefill_ahead`); a group whose last sample got in then
    drops its hold on its prompt pages. Returns the round (None if it admitted
    nothing) and whether to try another (a sample did not fit, and that release freed
    pages)."""
    ps, pool = self.page_size, self.pool
    admits: list[Admit] = []
    opened: list[Group] = []
    closed: list[Group] = []
    blocked = False
    for index in range(self.max_slots):
      if self.slots[index] is not None or not self.queue:
        continue
      c, i, j = self.queue[0]
      p, max_new = len(self.requests[c][i].prompt), self.requests[c][i].max_new_tokens
      group = self._group(c, i, j)
      full, partial = p // ps, p % ps != 0
      own_need = ceil_div(p + max_new - 1, ps) - full
      opening = not group.pages
      if not (self._open(group, self._lookup(group), own_need) if opening
              else self._make_room(own_need)):
        blocked = True
        break
      self.queue.popleft()
      if opening:
        opened.append(group)
      shared = group.pages[:full]
      pool.incref(shared)
      pool.reserve(own_need)
      own = [pool.take()] if partial and own_need else []
      admits.append(Admit(index, group.key, *((group.pages[full], own[0]) if own else (0, 0))))
      self.slots[index] = Slot(c, i, j, group, shared, own, own_need - len(own), p,
                               kv_key=group.kv_key)
      group.waiting -= 1
      if group.waiting == 0:             # the last sample is in: release it below
        closed.append(group)
        del self.groups[group.key]
    ahead = self._prefill_ahead(opened) if opened else []
    for group in closed:                 # its samples' copies are planned before
      pool.decref(group.pages)
    again = bool(blocked and closed and self.queue)
    if not admits:
      return None, again
    return self._admission(opened + ahead, len(ahead), admits, closed), again

  def _admission(self, prefill: list[Group], ahead: int, admits: list[Admit],
                 closed: list[Group]) -> Admission:
    """The round's :class:`Admission`: the prefill of each group's uncached tail."""
    batches = pack_prefill([(g.prompt[g.reused:], g.reused, g.pages) for g in prefill],
                           self.prefill_rows, self.prefill_chunk, self.pages_per_slot)
    reused = sum(g.reused for g in prefill)
    return Admission(tuple(g.key for g in prefill),
                     sum(len(g.prompt) for g in prefill) - reused, ahead, tuple(batches),
                     tuple(admits), tuple(g.key for g in closed), reused,
                     sum(g.reused > 0 for g in prefill))

  def _prefill_ahead(self, opened: list[Group]) -> list[Group]:
    """The next waiting groups without a prefill (queue order) that fit in the rows
    ``opened`` leaves free in its last ``[R, prefill_chunk]`` call, their prompt pages
    taken: padding rows do their prefill instead of nothing, so the next admissions
    find it done. A group is taken while the pool keeps ``pages_per_slot + 1`` pages
    free after its prompt's, without evicting cached pages (so the first waiting
    sample always fits once the slots are empty: no deadlock); the first that does not
    fit ends the walk."""
    c, rows = self.prefill_chunk, self.prefill_rows
    free = -sum(ceil_div(len(g.prompt) - g.reused, c) for g in opened) % rows
    ahead: list[Group] = []
    for call, i, j in self.queue:
      if not free:
        break
      group = self._group(call, i, j)
      if group.pages:
        continue
      matched = self._lookup(group)
      pieces = ceil_div(len(group.prompt) - len(matched) * self.page_size, c)
      if pieces > free or not self._open(group, matched, self.pages_per_slot + 1,
                                         evict=False):
        break
      ahead.append(group)
      free -= pieces
    return ahead

  # -- the prefix cache ---------------------------------------------------------------

  def set_cache_key(self, key: Any) -> int:
    """What the keys/values computed from now on depend on besides their tokens (the
    engine's parameters: their version and identity). Another key than the cache's
    empties the prefix cache (a page is never read under other parameters than it was
    computed with); pages of samples in flight stay theirs, and a slot or prompt
    computed under another key is not cached when it finishes. Returns the pages
    dropped."""
    dropped = 0
    if key != self.cache_key and self.cache is not None:
      dropped = self.cache.clear()
    self.cache_key = key
    return dropped

  def _lookup(self, group: Group) -> list[int]:
    """The cached pages of ``group``'s prompt: the longest cached prefix of full
    pages, leaving at least its last token to prefill (its logits are needed)."""
    if self.cache is None:
      return []
    return self.cache.match(group.prompt, (len(group.prompt) - 1) // self.page_size)

  def _make_room(self, count: int, evict: bool = True) -> bool:
    """Whether ``count`` pages are available, after evicting cached pages for them if
    ``evict``: least recently used first, the cached prefixes of the prompts waiting
    in the queue last (:meth:`PrefixCache.evict`)."""
    short = count - self.pool.available
    if short > 0 and evict and self.cache is not None:
      self.cache.evict(short, keep=self._waiting_prefixes())
    return self.pool.available >= count

  def _waiting_prefixes(self) -> list[list[int]]:
    """The cached pages each waiting group without pages will map, in queue order."""
    assert self.cache is not None
    seen, paths = set(), []
    for c, i, j in self.queue:
      key = (c, i, 0) if self.share_prompts else (c, i, j)
      group = self.groups.get(key)
      if key in seen or (group is not None and group.pages):
        continue
      seen.add(key)
      prompt = self.requests[c][i].prompt
      paths.append(self.cache.match(np.asarray(prompt, np.int32),
                                    (len(prompt) - 1) // self.page_size, touch=False))
    return paths

  def _open(self, group: Group, matched: list[int], extra: int, evict: bool = True) -> bool:
    """Gives ``group`` its prompt pages, the ``matched`` cached ones first and new
    ones for the rest, if the pool then still holds ``extra`` pages (evicting other
    cached pages for them if ``evict``); False, nothing taken, if not."""
    self.pool.incref(matched)
    need = ceil_div(len(group.prompt), self.page_size) - len(matched)
    if not self._make_room(need + extra, evict):
      self.pool.decref(matched)
      return False
    group.pages = matched + self.pool.allocate(need)
    group.reused, group.kv_key = len(matched) * self.page_size, self.cache_key
    return True

  def _decode_batch(self, live: list[int], n_eos: int, version: int,
                    budget_left: int | None) -> DecodeBatch:
    """The decode call of the ``live`` slots over ``W`` rows, the least of
    ``decode_widths`` that holds them (row = slot at ``W = max_slots``, else the live
    slots first, then free ones as padding); each live slot is handed the pages its
    next ``steps_per_call`` tokens write, from its reservation."""
    s, k = self.max_slots, self.steps_per_call
    w = min(x for x in self.decode_widths if x >= len(live))
    rows = None if w == s else np.asarray(
        live + [i for i in range(s) if self.slots[i] is None][:w - len(live)], np.int32)
    rows_of = tuple(live) if rows is None else tuple(range(len(live)))
    table = np.zeros((w, self.pages_per_slot), np.int32)
    arrays = {name: np.zeros(w, dtype) for name, dtype in (
        ("position", np.int32), ("count", np.int32), ("max_new", np.int32),
        ("request", np.int32), ("sample", np.int32), ("temperature", np.float32),
        ("top_k", np.int32), ("top_p", np.float32))}
    arrays["position"][:] = -1
    key_data = np.zeros((w, 2), np.uint32)
    eos = np.full((w, n_eos), -1, np.int32)
    for row, index in zip(rows_of, live):
      slot = self.slots[index]
      assert slot is not None
      r = self.requests[slot.call][slot.request]
      last = min(slot.position + k - 1, len(r.prompt) + r.max_new_tokens - 2)
      while len(slot.shared) + len(slot.own) <= last // self.page_size:
        slot.own.append(self.pool.take())
        slot.reserved -= 1
      ids = slot.shared + slot.own
      table[row, :len(ids)] = ids
      for name, value in (("position", slot.position), ("count", len(slot.tokens)),
                          ("max_new", r.max_new_tokens), ("sample", slot.sample),
                          ("request", slot.request + self.first_request.get(slot.call, 0)),
                          ("temperature", r.temperature), ("top_k", r.top_k or 0),
                          ("top_p", 1.0 if r.top_p is None else r.top_p)):
        arrays[name][row] = value
      key_data[row] = self.key_data[slot.call]
      if r.eos_ids is not None:
        eos[row, :len(r.eos_ids)] = r.eos_ids
    limit = k if budget_left is None else min(k, ceil_div(budget_left, len(live)))
    return DecodeBatch(tuple(live), rows_of, rows, table, arrays, key_data, eos,
                       min(self.refill_after, len(self.queue)), limit, self.pool.in_use,
                       version)

  # -- the device's output in -------------------------------------------------------

  def apply(self, plan: Plan, output: tuple[np.ndarray, np.ndarray, np.ndarray]
            ) -> tuple[int, list[tuple[int, Completion]]]:
    """Records the decode call's ``output`` ``(tokens, logps, flogps)`` ``[W, steps]``
    (token -1 where a row generated nothing) in the plan's slots; a slot that ended on
    a stop id or reached its ``max_new_tokens`` finishes (its pages return to the pool).
    Returns the tokens generated and the ``(call, Completion)`` of the finished."""
    tokens, logps, flogps = output
    decode, generated, finished = plan.decode, 0, []
    for index, row in zip(decode.slots, decode.rows_of):
      slot = self.slots[index]
      assert slot is not None
      r = self.requests[slot.call][slot.request]
      n_new = int((tokens[row] >= 0).sum())
      generated += n_new
      slot.tokens.extend(tokens[row, :n_new].tolist())
      slot.logprobs.extend(logps[row, :n_new].tolist())
      slot.filtered.extend(flogps[row, :n_new].tolist())
      slot.versions.extend([decode.version] * n_new)
      slot.position += n_new
      if n_new and r.eos_ids is not None and slot.tokens[-1] in r.eos_ids:
        finished.append(self._finish(index, "eos"))
      elif len(slot.tokens) >= r.max_new_tokens:
        finished.append(self._finish(index, "length"))
    return generated, finished

  def _finish(self, index: int, reason: str) -> tuple[int, Completion]:
    """Frees slot ``index`` (its full pages cached first, with a prefix cache and
    pages computed under the cache's key: all its tokens but the last, which was never
    fed) and returns its completion."""
    slot = self._slot(index)
    if self.cache is not None and slot.kv_key == self.cache_key:
      seq = np.concatenate([slot.group.prompt, np.asarray(slot.tokens, np.int32)])
      self.cache.insert(seq, (slot.shared + slot.own)[:(slot.position - 1) // self.page_size])
    self.pool.decref(slot.shared + slot.own)
    self.pool.unreserve(slot.reserved)
    self.slots[index] = None
    return slot.call, Completion(
        slot.request, slot.sample, np.asarray(slot.tokens, np.int32),
        np.asarray(slot.logprobs, np.float32), np.asarray(slot.filtered, np.float32),
        reason, np.asarray(slot.versions, np.int32),
        self.requests[slot.call][slot.request].tag, slot.group.reused)

  def end_call(self) -> bool:
    """Forgets the requests of calls with nothing left in flight; returns whether
    anything is (a partial rollout continues it in a later call)."""
    calls_left = {c for c, _, _ in self.queue} | {
        slot.call for slot in self.slots if slot is not None}
    for c in [c for c in self.requests if c not in calls_left]:
      del self.requests[c], self.key_data[c]
      self.first_request.pop(c, None)
    return bool(calls_left)

  # -- a new policy version ---------------------------------------------------------

  def recompute(self) -> Recompute:
    """The plan that prefills the in-flight cache again: the prompts of the groups in
    flight (each once: whole while samples wait, else its full pages), then each live
    slot's own part (prompt tail + generated tokens), both in
    :func:`shrink_prefill` batches of at most ``max_slots`` rows. The engine runs it
    after :meth:`set_cache_key` of the new parameters: the pages are then theirs."""
    by_group: dict[int, tuple[Group, list[int]]] = {}
    for index, slot in enumerate(self.slots):
      if slot is not None:
        by_group.setdefault(id(slot.group), (slot.group, []))[1].append(index)
    for group in self.groups.values():         # groups with samples still waiting
      by_group.setdefault(id(group), (group, []))
    prompts: list[Job] = []
    owners: list[GroupKey | None] = []
    tails: list[tuple[int, Job]] = []
    ps = self.page_size
    for group, members in by_group.values():
      full = len(group.prompt) // ps
      if group.waiting > 0:                     # it holds all its prompt pages (if any)
        if group.pages:
          prompts.append((group.prompt, 0, group.pages))
          owners.append(group.key)
      elif full and members:
        prompts.append((group.prompt[:full * ps], 0, self._slot(members[0]).shared))
        owners.append(None)
      for index in members:
        slot = self._slot(index)
        seq = np.concatenate([group.prompt, np.asarray(slot.tokens, np.int32)])
        first = min(full * ps, slot.position - 1)
        tails.append((index, (seq[first:slot.position], first, slot.shared + slot.own)))
        slot.kv_key = self.cache_key          # recomputed under the current parameters
      group.kv_key = self.cache_key
    args = self.max_slots, self.prefill_chunk, self.pages_per_slot
    return Recompute(tuple(owners), tuple(shrink_prefill(prompts, *args)),
                     tuple(index for index, _ in tails),
                     tuple(shrink_prefill([job for _, job in tails], *args)),
                     sum(len(p) for p, _, _ in prompts) + sum(len(j[0]) for _, j in tails))

  def _slot(self, index: int) -> Slot:
    slot = self.slots[index]
    assert slot is not None
    return slot


__all__ = ["POLICIES", "Admission", "Admit", "Completion", "DecodeBatch", "Group", "Plan",
           "PrefillBatch", "Recompute", "Request", "Scheduler", "Slot", "ceil_div",
           "pack_prefill", "pages_needed", "shrink_prefill"]
