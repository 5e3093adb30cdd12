"""The decode protocol: what a model provides for generation, and what the sampler
(:func:`jaxrl_llm.rollout.sample`) and the engine consume.

Any model provides it as three pure functions of its parameters; the reference
transformer's are built by :func:`jaxrl_llm.models.make_decode_fns`. The paged variant
(:class:`PagedDecodeFns`, built by :func:`jaxrl_llm.models.make_paged_decode_fns`) is
what the continuous-batching engine consumes; a model with only :class:`DecodeFns`
still generates through ``sample``. It lives with the models, one floor below the
rollout that consumes it (``docs/architecture.md``), and imports nothing from the
package; ``jaxrl_llm.rollout.protocol`` names the same classes.

Examples:
  >>> fns = DecodeFns(init_cache=None, prefill=None, decode=None)
  >>> fns._fields
  ('init_cache', 'prefill', 'decode')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class DecodeFns(NamedTuple):
  """Pure decoding functions of a model; the protocol the sampler consumes.

  Attributes:
    init_cache: ``init_cache(params, batch, max_len) -> cache`` (any pytree).
    prefill: ``prefill(params, tokens [B, P] int, mask [B, P], cache) ->
      (logits [B, V] float32, cache)``; ``logits`` are the next-token logits after each
      row's last real prompt token.
    decode: ``decode(params, tokens [B] int, cache) -> (logits [B, V] float32, cache)``
      appends one real token per row and returns the logits that follow it.
  """

  init_cache: Callable
  prefill: Callable
  decode: Callable


class PagedDecodeFns(NamedTuple):
  """Pure paged-KV decoding functions of a model; what the rollout engine
  (:class:`jaxrl_llm.rollout.RolloutEngine`) consumes.

  The KV cache is a pool of fixed-size pages shared by all rows; a row's page table
  lists its pages in order (position ``p`` lives on page ``page_table[b, p // P]`` at
  slot ``p % P``), so rows of any lengths share one static pool and several rows may
  read the same (prompt) pages.

  Attributes:
    init_pages: ``init_pages(params, num_pages, page_size) -> pages`` (any pytree of
      arrays; all zeros).
    forward: ``forward(params, tokens [B, T] int, positions [B, T] int, page_table
      [B, M] int, pages) -> (logits [B, V] float32, pages)``: writes the keys/values of
      the real tokens (``positions >= 0``; ``< 0`` is padding and writes nothing) at
      their positions, attends each to its row's positions ``<= p``, and returns the
      next-token logits after each row's last real token (largest position). A prompt
      chunk (T > 1) and a decode step (T = 1) are the same call.

  Examples:
    >>> PagedDecodeFns(init_pages=None, forward=None)._fields
    ('init_pages', 'forward')
  """

  init_pages: Callable
  forward: Callable


__all__ = ["DecodeFns", "PagedDecodeFns"]
