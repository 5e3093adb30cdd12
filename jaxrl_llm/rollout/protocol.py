"""The decode protocol: what the sampler (:func:`jaxrl_llm.rollout.sample`) consumes.

Any model provides it as three pure functions of its parameters; the reference
transformer's are built by :func:`jaxrl_llm.models.make_decode_fns`. This module
imports nothing from the package, so models can implement the protocol without an
import cycle.

Examples:
  >>> fns = DecodeFns(init_cache=None, prefill=None, decode=None)
  >>> fns._fields
  ('init_cache', 'prefill', 'decode')
"""

from __future__ import annotations

from typing import Callable, NamedTuple


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


__all__ = ["DecodeFns"]
