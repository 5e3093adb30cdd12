"""Host-side bookkeeping of the paged KV cache: a free list, reference counts and
reservations (plain Python and NumPy; the pages themselves live on the device).

A page is free when its reference count is 0. Shared prompt pages are referenced once
by their request (while samples remain to be admitted) and once by every slot that
reads them; a slot's own pages are referenced by that slot only. ``reserve`` books
pages for a slot's future tokens (admission control: an admitted slot never waits
for a page), ``take`` turns reserved pages into allocated ones as tokens arrive, so
pages in use follow the tokens in flight. A :class:`PrefixCache` (the engine's
``prefix_cache=True``) keeps finished sequences' full pages, one reference each, for
later prompts that start with the same tokens.

Examples:
  >>> pool = PagePool(4)
  >>> a = pool.allocate(2)            # e.g. a prompt's pages
  >>> pool.incref(a)                  # a second reader
  >>> pool.reserve(1); pool.available, pool.in_use
  (1, 2)
  >>> b = pool.take()                 # a reserved page arrives
  >>> pool.decref(a); pool.decref(a + [b]); pool.in_use
  0
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np


class PagePool:
  """Free list + reference counts + reservations of ``num_pages`` page ids."""

  def __init__(self, num_pages: int) -> None:
    if not isinstance(num_pages, int) or num_pages < 1:
      raise ValueError(f"`num_pages` must be a positive int, got {num_pages!r}.")
    self.num_pages = num_pages
    self.refs = np.zeros(num_pages, np.int32)
    self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
    self.reserved = 0

  @property
  def in_use(self) -> int:
    """Pages with a reference."""
    return self.num_pages - len(self._free)

  @property
  def available(self) -> int:
    """Free pages not promised to a reservation."""
    return len(self._free) - self.reserved

  def allocate(self, count: int) -> list[int]:
    """``count`` unreserved free pages, each with one reference."""
    if count > self.available:
      raise RuntimeError(f"asked for {count} pages, {self.available} available.")
    return [self._pop() for _ in range(count)]

  def reserve(self, count: int) -> None:
    """Promises ``count`` free pages to later :meth:`take` calls."""
    if count > self.available:
      raise RuntimeError(f"asked to reserve {count} pages, {self.available} available.")
    self.reserved += count

  def unreserve(self, count: int) -> None:
    """Returns ``count`` reserved, never taken pages."""
    if not 0 <= count <= self.reserved:
      raise RuntimeError(f"cannot unreserve {count} of {self.reserved} reserved pages.")
    self.reserved -= count

  def take(self) -> int:
    """One reserved page (now allocated, one reference)."""
    if self.reserved < 1:
      raise RuntimeError("no reserved page to take.")
    self.reserved -= 1
    return self._pop()

  def incref(self, pages: list[int]) -> None:
    for page in pages:
      self.refs[page] += 1

  def decref(self, pages: list[int]) -> None:
    """Drops one reference of each page; a page left with none is free again."""
    for page in pages:
      if self.refs[page] < 1:
        raise RuntimeError(f"page {page} has no reference to drop.")
      self.refs[page] -= 1
      if self.refs[page] == 0:
        self._free.append(page)

  def _pop(self) -> int:
    page = self._free.pop()
    self.refs[page] = 1
    return page


@dataclasses.dataclass(eq=False)
class _Node:
  """A cached page: the keys/values of one full block of ``page_size`` tokens, after
  the blocks of its ancestors (a node is identified by the whole prefix up to it)."""

  page: int
  block: bytes                                    # the block's int32 token ids
  parent: _Node | None
  children: dict[bytes, _Node] = dataclasses.field(default_factory=dict)


class PrefixCache:
  """Full KV pages of finished sequences, found again by the exact token ids before
  them: automatic prefix caching (vLLM's, at page granularity; SGLang's radix tree of
  pages).

  The cache is a tree of pages: a node holds the page of one full block of
  ``page_size`` tokens, and its key in its parent is that block's int32 ids (bytes),
  so the path from the root to a node spells the exact tokens ``[0, (depth + 1)
  page_size)`` whose keys/values the page holds. Lookups compare ids, never a hash:
  a page is reused only for the very tokens, at the very positions, it was computed
  for. A sequence's last, partly filled page is not cached.

  Reference counts are the :class:`PagePool`'s: the cache holds one reference to each
  of its pages, every reader (a prompt, a slot) its own. A page only the cache holds
  (count 1) and that has no cached child is evictable; :meth:`evict` frees them in
  least-recently-used order (a lookup or an insert uses a whole path from the root,
  its deepest page first: a path's tail goes before its head, and a parent never goes
  before its children), keeping for last the pages that prompts about to be admitted
  will read (Belady's rule for what is known: a waiting prompt's pages are read before
  anything a later call may ask for). Keys/values depend on the parameters too: the caller empties
  the cache (:meth:`clear`) when they change (the scheduler's ``set_cache_key``).

  Examples:
    >>> pool = PagePool(6)
    >>> cache = PrefixCache(pool, page_size=2)
    >>> seq = np.array([5, 6, 7, 8, 9], np.int32)
    >>> pages = pool.allocate(3)                 # a finished sequence's pages 0, 1, 2
    >>> cache.insert(seq, pages[:2])             # its 2 full blocks [5 6] [7 8]
    2
    >>> pool.decref(pages); pool.in_use          # the sequence let go: 2 pages cached
    2
    >>> cache.match(np.array([5, 6, 7, 8, 1, 2], np.int32), limit=3)
    [0, 1]
    >>> cache.match(np.array([5, 6, 7, 0], np.int32), limit=3)
    [0]
    >>> cache.evict(1), cache.match(seq, limit=2), pool.in_use   # the tail goes first
    (1, [0], 1)
  """

  def __init__(self, pool: PagePool, page_size: int) -> None:
    self.pool, self.page_size = pool, page_size
    self.root: dict[bytes, _Node] = {}
    self._lru: collections.OrderedDict[int, _Node] = collections.OrderedDict()  # by page
    self.evictions = 0                            # pages evicted so far

  def __len__(self) -> int:
    """Pages cached."""
    return len(self._lru)

  def _blocks(self, tokens: np.ndarray, count: int) -> list[bytes]:
    ps = self.page_size
    ids = np.asarray(tokens, np.int32)
    return [ids[b * ps:(b + 1) * ps].tobytes() for b in range(count)]

  def _touch(self, path: list[_Node]) -> None:
    for node in reversed(path):                   # the deepest is the least recent
      self._lru.move_to_end(node.page)

  def match(self, tokens: np.ndarray, limit: int, touch: bool = True) -> list[int]:
    """The pages of the longest cached prefix of ``tokens``, at most ``limit`` full
    blocks (marked used if ``touch``; no reference taken)."""
    path: list[_Node] = []
    children = self.root
    for block in self._blocks(tokens, min(limit, len(tokens) // self.page_size)):
      node = children.get(block)
      if node is None:
        break
      path.append(node)
      children = node.children
    if touch:
      self._touch(path)
    return [node.page for node in path]

  def insert(self, tokens: np.ndarray, pages: Sequence[int]) -> int:
    """Caches ``pages[b]`` as the keys/values of block ``b`` of ``tokens`` (the first
    ``len(pages)`` full blocks), taking a reference to each page it adds; a block
    already cached keeps its page (``pages[b]`` is then not taken). Returns the pages
    added."""
    path: list[_Node] = []
    parent, children, added = None, self.root, 0
    for block, page in zip(self._blocks(tokens, len(pages)), pages):
      node = children.get(block)
      if node is None:
        node = children[block] = _Node(int(page), block, parent)
        self.pool.incref([node.page])
        self._lru[node.page] = node
        added += 1
      path.append(node)
      parent, children = node, node.children
    self._touch(path)
    return added

  def _drop(self, node: _Node) -> bool:
    """Evicts ``node`` if nothing else holds its page and it has no cached child."""
    if node.children or self.pool.refs[node.page] != 1:
      return False
    siblings = self.root if node.parent is None else node.parent.children
    del siblings[node.block], self._lru[node.page]
    self.pool.decref([node.page])
    self.evictions += 1
    return True

  def evict(self, count: int, keep: Sequence[Sequence[int]] = ()) -> int:
    """Frees up to ``count`` cached pages that nothing else holds (a page with cached
    children waits for them); returns how many. Least recently used first, except the
    pages of the paths ``keep`` (the cached prefixes of prompts about to be admitted,
    soonest first): those go last, the last path's first, each from its tail."""
    kept = {page for path in keep for page in path}
    freed = 0
    for page in list(self._lru):                  # children come before their parent
      if freed >= count:
        return freed
      if page not in kept and self._drop(self._lru[page]):
        freed += 1
    for path in reversed(keep):
      for page in reversed(path):
        if freed >= count or page not in self._lru or not self._drop(self._lru[page]):
          break
        freed += 1
    return freed

  def clear(self) -> int:
    """Drops every cached page (the cache's reference; pages others still read stay
    theirs); returns how many."""
    count = len(self._lru)
    self.pool.decref(list(self._lru))
    self.root, self._lru = {}, collections.OrderedDict()
    return count

__all__ = ["PagePool", "PrefixCache"]
