"""Host-side bookkeeping of the paged KV cache: a free list, reference counts and
reservations (plain Python and NumPy; the pages themselves live on the device).

A page is free when its reference count is 0. Shared prompt pages are referenced once
by their request (while samples remain to be admitted) and once by every slot that
reads them; a slot's own pages are referenced by that slot only. ``reserve`` books
pages for a slot's future tokens (admission control: an admitted slot never waits
for a page), ``take`` turns reserved pages into allocated ones as tokens arrive, so
pages in use follow the tokens in flight.

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


__all__ = ["PagePool"]
