r"""A continuous-batching rollout engine: paged KV cache, shared prompts, keyed draws.

:class:`RolloutEngine` generates completions for a list of :class:`Request` s with a
fixed number of slots (static shapes: nothing recompiles as requests come and go):

* **Continuous batching.** A host-side scheduler (plain Python) admits waiting samples
  into free slots; a jitted ``lax.while_loop`` runs up to ``steps_per_call`` decode
  steps for all slots per device call and returns early when a slot finishes while
  samples are waiting, so the host refills the slot at once. Each request has its own
  ``max_new_tokens``, temperature, filters and stop ids.
* **Paged KV cache.** Keys/values live in a pool of ``num_pages`` pages of
  ``page_size`` tokens per layer; a slot's page table lists its pages. A decode step
  reads keys up to the longest live slot's length n, O(S n)
  (:func:`jaxrl_llm.attention.paged_attention` loops over page chunks with a traced
  trip count), not the slot capacity ``max_len``. A slot's future pages are reserved
  at admission and handed over as its tokens arrive, so the pages in use follow the
  tokens in flight; a finished slot's pages (and its unused reservation) return to the
  pool at once.
* **Shared prompts.** The ``n`` samples of a request prefill its prompt once; they read
  the prompt's full pages (reference-counted), and each gets its own copy of the
  partly filled last page (copy-on-write) before it writes there.
* **Batched prefill of a fixed shape.** Every admission prefill call is
  ``[prefill_rows, prefill_chunk]`` (R rows of c tokens; one compilation whatever the
  prompts): a prompt of ``p`` tokens takes ``ceil(p / c)`` consecutive rows (a later
  row reads the keys an earlier one wrote, in the same call or an earlier one), and
  the prompts of all the groups admitted at one point are packed R rows per call
  (``ceil(N / R)`` calls for ``N`` prompts of at most ``c`` tokens,
  ``stats["prefill_calls"]``). Rows a round leaves free prefill the next waiting
  groups ahead of their admission (``stats["prefill_ahead"]``; while the pool keeps
  ``pages_per_slot + 1`` pages free), so a refill of one slot does not pay R - 1
  padding rows while prompts wait. A row's arithmetic depends on nothing but its own
  tokens, positions and pages at that one shape, which is what keeps the guarantee
  below: the rows beside it are never a reason for other rounding. The default
  ``prefill_rows=1`` is the engine's earlier prefill (each prompt alone, ``[1, c]``,
  one call per prompt and chunk, each reading all the weights) bit for bit: XLA:CPU
  rounds a row of ``[R, c]`` differently from ``[1, c]`` (other matmul sizes), so
  R > 1 gives log-probs some ulps apart, which over a long RL run can flip a sampled
  token and change the run (the default 400-step job: identical to step 112, then
  another trajectory).
* **Batch-invariant sampling.** The token at generated position ``n`` of sample ``j``
  of request ``r`` uses the key ``fold_in(fold_in(fold_in(key(seed), r), j), n)`` and
  an inverse-CDF draw (:mod:`jaxrl_llm.rollout.draw`); the slot computation never
  mixes rows (attention reads only the slot's pages, and chunks past a slot's length
  change nothing bit for bit; a prompt's prefill rows are computed at the one shape
  ``[prefill_rows, prefill_chunk]`` whatever is beside them). So at a given
  ``max_slots`` (and ``prefill_rows``) a request's tokens and log-probs are bitwise the
  same alone or among any other requests, in any slot.
  Another ``max_slots`` is another matmul shape, for which XLA may choose another
  kernel: on CPU (XLA:CPU, jax 0.10) 8 and 16 slots gave bitwise equal results, while
  1, 2, 4 and 64 slots gave the same tokens with log-probs 1-2 ulp apart (a sampled
  token could then differ where ``u`` falls within such a rounding of a CDF step).
* **Decode over the live slots (opt-in).** By default every decode step computes all
  ``max_slots`` rows, finished and empty slots included. ``decode_widths`` (e.g.
  ``(8, 16)`` at 32 slots) adds compiled row counts: a decode call runs its live slots
  compacted into the least width that holds them (their logits rows gathered and
  scattered back: copies), so a heavy-tailed tail of a few long samples stops paying
  for the empty slots (``stats["row_utilisation"]`` against ``slot_utilisation``).
  The bitwise guarantee above then holds only if XLA rounds a row the same at every
  width used, which is a property of the compiler and the machine, not of this code:
  on XLA:CPU (jax 0.10) 8, 16 and 32 rows gave bitwise equal logits (the tiny test
  model at 8/16 with XLA's default threads; SmolLM2-135M at 8/16/32 single-threaded),
  while 1, 2, 4 and 64 did not; check it on the target machine before relying on it
  (``tests/test_engine.py`` pins 8/16 for the CPU). Hence off by default.

**Partial rollouts** (Kimi k1.5, slime, verl; ``generate(..., token_budget=N,
version=v)``). A call with a token budget stops once ``N`` tokens were generated and
returns only the completions that finished; the others stay in flight (their slots,
pages and draws' keys) and the next call continues them first, then admits its own
requests. Every token records the ``version`` of the call that sampled it
(``Completion.versions``), so a completion may span versions; :attr:`in_flight` counts
the unfinished samples and :meth:`reset` drops them (pages returned, pool freed).
The keys/values of in-flight tokens were computed under the parameters of an older
version. With ``on_new_version="recompute"`` (default; what AReaL's interruptible
generation and slime's partial rollouts do: AReaL discards the stale KV cache and
recomputes it under the new weights, slime resubmits prompt + partial response to a
server whose prefix cache the weight update invalidated) a call whose ``version``
differs from the cache's prefills each in-flight group's prompt once and each sample's
own tokens again under the new ``params`` (``stats["recomputed_tokens"]``). So a token
tagged ``v`` is drawn from the model ``v`` given the whole prefix, and its recorded
log-prob is that model's (teacher-forced) log-prob, up to float rounding (the
prefill is another computation order than the decode steps). With ``"keep"`` the stale
keys/values are kept (no recompute): a token tagged ``v`` is then drawn from model
``v``'s layers over a cache partly written by older versions, and its recorded
log-prob is exactly that of the distribution it was drawn from, which no single
version reproduces teacher-forced. With the same ``version`` (or ``"keep"`` and
unchanged ``params``) a rollout cut into budgeted calls gives bitwise the tokens and
log-probs of one unbounded call (at the same ``max_slots``: the draws are keyed and
rows never mix). The draws of a continued sample keep their first call's seed.

Log-prob conventions are those of :func:`jaxrl_llm.rollout.sample`:
``Completion.logprobs[n]`` :math:`= \log\mathrm{softmax}(z_n/\tau)[y_n]` (the full,
temperature-scaled distribution, what a train-side ``token_logprobs`` of the same
tokens gives with logits divided by :math:`\tau`), and ``filtered_logprobs[n]`` is the
log-prob under the top-k/top-p filtered, renormalised distribution the token was drawn
from (0 under greedy decoding). ``temperature=0`` means greedy decoding (argmax;
``logprobs`` then under :math:`\tau = 1`, ``filtered_logprobs`` 0).

Compilations per engine (for a given model, ``params`` structure and request mix): one
prefill forward ``[prefill_rows, prefill_chunk]``, one admission (page copy + logits
row), one decode loop per (any top-k/top-p in the batch, number of stop ids rounded up
to a power of two) combination: 3 for a homogeneous workload (with ``decode_widths``,
a decode loop and a row gather/scatter per width used); partial rollouts that
recompute a new version's cache add prefills of ``[R, prefill_chunk]`` for the
``R = max_slots, max_slots / 4, ...`` their rounds need (3 for 32 slots).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.rollout.draw import draw, row_keys
from jaxrl_llm.rollout.paged_cache import PagePool
from jaxrl_llm.rollout.protocol import PagedDecodeFns

POLICIES = ("longest_first", "fifo")
ON_NEW_VERSION = ("recompute", "keep")


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
  """

  request: int
  sample: int
  tokens: np.ndarray
  logprobs: np.ndarray
  filtered_logprobs: np.ndarray
  finish_reason: str
  versions: np.ndarray | None = None
  tag: Any = None


@dataclasses.dataclass
class _Group:
  """The prefill shared by samples of one request (all ``n``, or one when unshared)."""

  prompt: np.ndarray
  waiting: int                    # samples not yet admitted
  pages: list[int] = dataclasses.field(default_factory=list)
  logits: Any = None              # [V] next-token logits after the prompt (device)


@dataclasses.dataclass
class _Slot:
  call: int                       # the generate call that submitted the request
  request: int
  sample: int
  group: _Group
  shared: list[int]               # full prompt pages (read only)
  own: list[int]                  # pages this slot writes
  reserved: int                   # own pages still to take
  position: int                   # next position to write = tokens in the cache
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  filtered: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _State:
  """What stays in flight between ``generate`` calls of a partial rollout."""

  pool: PagePool
  pages: Any                      # the device page pool (a pytree)
  slots: list                     # [S] of _Slot | None
  queue: collections.deque        # (call, request, sample) not yet admitted
  groups: dict                    # (call, request, sample or 0) -> _Group
  requests: dict                  # call -> its list of Request
  key_data: dict                  # call -> [2] uint32 key data of its seed
  kv_version: int                 # the version the cache was computed under
  logits: Any = None              # [S, V] next-token logits per slot (device)
  first_request: dict = dataclasses.field(default_factory=dict)  # call -> key index of
                                  # its request 0 (a shard of a larger batch)


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


class RolloutEngine:
  """Continuous-batching generation over a paged KV cache (module docstring).

  Args:
    decode_fns: the model's :class:`~jaxrl_llm.rollout.protocol.PagedDecodeFns`
      (:func:`jaxrl_llm.models.make_paged_decode_fns`).
    max_slots: S, the number of sequences decoded together.
    max_len: the most tokens (prompt + completion) of one sample.
    page_size: tokens per page.
    num_pages: pages in the pool (all layers have one pool each of this many pages);
      default ``max_slots * (ceil(max_len / page_size) + 1)``, enough for every slot at
      ``max_len`` with a prompt of its own (a prompt's partial last page is kept for its
      samples' copies beside each sample's own copy: :meth:`pages_needed` is at most
      ``ceil(max_len / page_size) + 1``). The pool's device memory is allocated once
      (``num_pages`` x ``stats["page_bytes"]``); a smaller pool bounds it. A request that needs more
      pages than the whole pool raises ``ValueError``; a sample that needs pages now
      in use waits (it and the samples queued after it) until finished slots return
      them.
    steps_per_call: K, the most decode steps per device call.
    prefill_chunk: c, prompt tokens per prefill row (one compilation for all lengths).
    prefill_rows: R, the rows of every admission prefill call ``[R, c]`` (module
      docstring). 1 (default) prefills each prompt alone, one call per prompt and
      chunk (the numbers of earlier versions, bit for bit). A larger R makes fewer,
      larger calls (the weights read once for R rows; on a CPU, matmuls of more rows
      run faster per token, e.g. ``R c`` near 256 for SmolLM2-135M: benchmarks/
      RESULTS.md) and free rows prefill waiting prompts ahead. Results are bitwise
      reproducible at a given R, not across R (another matmul shape: ulps apart,
      which can flip a sampled token).
    decode_widths: extra row counts a decode call may run at (each in ``[1,
      max_slots]``; ``max_slots`` is always one): the live slots go compacted into the
      least that holds them (module docstring: bitwise only across widths that XLA
      rounds alike, e.g. 8/16/32 on XLA:CPU). None (default): ``max_slots`` rows
      always.
    policy: admission order of the waiting samples: ``"longest_first"`` (largest
      ``max_new_tokens`` first, ties in request order: long samples start early and
      do not form a tail on few slots) or ``"fifo"`` (request order).
    share_prompts: prefill a request's prompt once for its ``n`` samples (default);
      False prefills it per sample (same results: for comparisons).
    on_new_version: what a ``generate`` call with another ``version`` than the
      in-flight samples' cache does with that cache (module docstring, "Partial
      rollouts"): ``"recompute"`` (default) prefills their prompts and generated
      tokens again under the new ``params``; ``"keep"`` keeps the stale keys/values.
    refill_after: while samples wait for a slot, a device call returns to admit them
      once this many slots finished (at most as many as wait). 1 (default) refills a
      slot as soon as it frees; a larger value makes fewer, longer device calls at the
      price of slots idling until the call ends (a host-bound device, as a CPU,
      gains). What is generated does not depend on it (a sample's draws are keyed by
      its request, sample and count).

  Examples:
    >>> from flax import nnx
    >>> from jaxrl_llm.models import (Transformer, TransformerConfig,
    ...                               make_paged_decode_fns, split_model)
    >>> graphdef, params = split_model(
    ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=4, max_len=32,
    ...                        page_size=8)
    >>> out = engine.generate(params, [Request([1, 2, 3], n=2, max_new_tokens=5),
    ...                                Request([4, 5], max_new_tokens=3, temperature=0)],
    ...                       seed=0)
    >>> [(c.request, c.sample, len(c.tokens), c.finish_reason) for c in out]
    [(0, 0, 5, 'length'), (0, 1, 5, 'length'), (1, 0, 3, 'length')]
    >>> engine.stats["pages_in_use_after"]
    0
  """

  def __init__(self, decode_fns: PagedDecodeFns, *, max_slots: int, max_len: int,
               page_size: int = 16, num_pages: int | None = None,
               steps_per_call: int = 16, prefill_chunk: int = 128,
               policy: str = "longest_first", share_prompts: bool = True,
               on_new_version: str = "recompute", refill_after: int = 1,
               prefill_rows: int = 1,
               decode_widths: Sequence[int] | None = None) -> None:
    for name, value in (("max_slots", max_slots), ("max_len", max_len),
                        ("page_size", page_size), ("steps_per_call", steps_per_call),
                        ("prefill_chunk", prefill_chunk), ("refill_after", refill_after),
                        ("prefill_rows", prefill_rows)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if policy not in POLICIES:
      raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}.")
    if on_new_version not in ON_NEW_VERSION:
      raise ValueError(f"`on_new_version` must be one of {ON_NEW_VERSION}, got "
                       f"{on_new_version!r}.")
    self.fns = decode_fns
    self.max_slots = max_slots
    self.max_len = max_len
    self.page_size = page_size
    self.pages_per_slot = _ceil_div(max_len, page_size)
    if num_pages is None:
      num_pages = max_slots * (self.pages_per_slot + 1)
    if not isinstance(num_pages, int) or num_pages < 1:
      raise ValueError(f"`num_pages` must be a positive int, got {num_pages!r}.")
    self.num_pages = num_pages
    self.steps_per_call = steps_per_call
    self.prefill_chunk = prefill_chunk
    self.policy = policy
    self.share_prompts = share_prompts
    self.on_new_version = on_new_version
    self.refill_after = refill_after
    self.prefill_rows = prefill_rows
    widths = () if decode_widths is None else tuple(decode_widths)
    if not all(isinstance(x, (int, np.integer)) and 1 <= x <= max_slots for x in widths):
      raise ValueError(f"`decode_widths` must be ints in [1, max_slots = {max_slots}], got "
                       f"{decode_widths!r}.")
    self.decode_widths = tuple(sorted({int(x) for x in widths} | {max_slots}))
    self.stats: dict[str, Any] = {}
    self._state: _State | None = None       # in-flight samples of a partial rollout
    self._calls = 0
    self._vocab: int | None = None           # the logits' width (vocab_size)
    # Module-level jits with the model's forward as a static argument: engines over
    # the same decode_fns share their compilations.
    self._forward = functools.partial(_prefill_jit, decode_fns.forward)
    self._admit = _admit_jit
    self._decode = functools.partial(_decode_jit, decode_fns.forward)

  def replica(self, **overrides: Any) -> RolloutEngine:
    """A new engine with this one's settings (``overrides`` replace some), sharing its
    compilations and none of its state: for a second thread or a second role.

    >>> from flax import nnx
    >>> from jaxrl_llm.models import (Transformer, TransformerConfig,
    ...                               make_paged_decode_fns, split_model)
    >>> graphdef, _ = split_model(Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=2, max_len=8,
    ...                        prefill_chunk=4)
    >>> copy = engine.replica(on_new_version="keep")
    >>> (copy.prefill_chunk, copy.max_slots, copy.on_new_version)
    (4, 2, 'keep')
    """
    settings = dict(max_slots=self.max_slots, max_len=self.max_len,
                    page_size=self.page_size, num_pages=self.num_pages,
                    steps_per_call=self.steps_per_call, prefill_chunk=self.prefill_chunk,
                    policy=self.policy, share_prompts=self.share_prompts,
                    on_new_version=self.on_new_version, refill_after=self.refill_after,
                    prefill_rows=self.prefill_rows, decode_widths=self.decode_widths)
    copy = RolloutEngine(self.fns, **{**settings, **overrides})
    copy._vocab = self._vocab
    return copy

  # -- validation ------------------------------------------------------------------

  def pages_needed(self, request: Request) -> int:
    """Pages one sample of ``request`` needs alone: its prompt's pages, the prompt's
    last partial page kept for copies while samples wait, and its own pages."""
    p, ps = len(request.prompt), self.page_size
    own = _ceil_div(p + request.max_new_tokens - 1, ps) - p // ps
    return _ceil_div(p, ps) + own

  def vocab_size(self, params: Any) -> int:
    """V, the width of the model's next-token logits for ``params`` (read once from
    the shapes of a one-token ``forward``, :func:`jax.eval_shape`: nothing runs)."""
    if self._vocab is None:
      def probe(p):
        pages = self.fns.init_pages(p, 1, self.page_size)
        one = jnp.zeros((1, 1), jnp.int32)
        return self.fns.forward(p, one, one, one, pages)[0]
      self._vocab = int(jax.eval_shape(probe, params).shape[-1])
    return self._vocab

  def _check(self, requests, params: Any = None) -> None:
    if not isinstance(requests, Sequence) or not all(
        isinstance(r, Request) for r in requests):
      raise ValueError("`requests` must be a sequence of Request.")
    vocab = self.vocab_size(params) if requests and params is not None else None
    for i, r in enumerate(requests):
      if vocab is not None:
        ids = np.asarray(r.prompt)
        bad = np.nonzero((ids < 0) | (ids >= vocab))[0]
        if bad.size:
          j = int(bad[0])
          raise ValueError(f"`requests[{i}].prompt[{j}]` = {int(ids[j])} is outside the "
                           f"vocabulary [0, {vocab}).")
      total = len(r.prompt) + r.max_new_tokens
      if total > self.max_len:
        raise ValueError(
            f"`requests[{i}]`: prompt ({len(r.prompt)} tokens) + max_new_tokens "
            f"({r.max_new_tokens}) = {total} exceeds `max_len` ({self.max_len}).")
      need = self.pages_needed(r)
      if need > self.num_pages:
        raise ValueError(f"`requests[{i}]` needs {need} pages of {self.page_size} tokens, "
                         f"more than the whole pool (`num_pages` = {self.num_pages}).")

  # -- partial rollouts ------------------------------------------------------------

  @property
  def in_flight(self) -> int:
    """Samples submitted but not finished (in a slot or waiting for one): a
    ``generate`` call with a ``token_budget`` leaves them for the next call."""
    st = self._state
    if st is None:
      return 0
    return sum(slot is not None for slot in st.slots) + len(st.queue)

  @property
  def waiting(self) -> int:
    """Samples submitted and not yet in a slot (a part of :attr:`in_flight`)."""
    return 0 if self._state is None else len(self._state.queue)

  @property
  def pages_in_use(self) -> int:
    """Pages held by in-flight samples (0 when nothing is in flight)."""
    return 0 if self._state is None else self._state.pool.in_use

  def reset(self) -> int:
    """Drops every in-flight sample (returns their pages, frees the device pool);
    returns how many were dropped. Their tokens are lost: a caller that aborts a
    partial rollout (a resumed run, a run that ends) submits the requests again."""
    dropped = self.in_flight
    self._state = None
    return dropped

  # -- generation ------------------------------------------------------------------

  def generate(self, params: Any, requests: Sequence[Request], seed: int = 0, *,
               token_budget: int | None = None, version: int = 0,
               first_request: int = 0) -> list[Completion]:
    """Completes every request ``n`` times; returns the completions ordered by
    ``(call, request, sample)``. ``self.stats`` then holds the call's counters: decode
    steps and device calls, prefill calls and tokens (``prefill_rows_padded``: the
    padding rows of the admission prefill calls; ``prefill_ahead``: groups prefilled
    in rows a round left free, before their admission), ``slot_utilisation`` (tokens
    generated in the call / (slots x decode steps)), ``row_utilisation`` (tokens
    generated / rows computed, ``decode_row_steps``: below ``max_slots`` rows a step
    with ``decode_widths``), ``useful_tokens`` (those of the
    returned completions), ``peak_pages`` and ``mean_pages_in_use``
    (weighted by decode steps), ``page_bytes``, host wall times ``prefill_s``,
    ``decode_s``, ``total_s``, and for partial rollouts ``generated_tokens``,
    ``in_flight_after``, ``recomputed_tokens`` and ``recompute_s``.

    Args:
      params: the model's parameters.
      requests: the new requests (may be empty when samples are in flight).
      seed: the draws' seed of these requests (in-flight samples keep theirs).
      token_budget: None: run until every sample (in flight and new) finished. An int
        ``N >= 1``: stop once at least ``N`` tokens were generated in this call (the
        last device call is cut to ``ceil(remaining / live slots)`` steps, so it
        overshoots by less than the live slots); the completions that finished are
        returned, the others stay in flight (their slots and pages kept) and the next
        call continues them first, before new requests are admitted.
      version: the policy version ``params`` are (an int the caller increments when
        the weights change); recorded per generated token (``Completion.versions``).
        When it differs from the in-flight samples' cache, the engine's
        ``on_new_version`` applies (module docstring).
      first_request: the index ``r`` of ``requests[0]`` in the draws' keys (request
        ``i`` draws as request ``first_request + i``): a process that completes its
        share ``[a, b)`` of a batch with ``first_request=a`` draws the tokens that one
        call over the whole batch draws for those requests (multi-host rollouts).
        ``Completion.request`` stays the index in ``requests``.

    Raises:
      ValueError: ``requests`` not a sequence of :class:`Request`, a prompt id outside
        the vocabulary ``[0, V)`` (naming the request and position; the embedding
        lookup would clamp it), or a request whose
        prompt + ``max_new_tokens`` exceeds ``max_len``, or that needs more pages than
        the whole pool; ``token_budget`` not None or an int >= 1; ``version`` not an
        int; ``first_request`` not an int >= 0. Any error raised while generating (a
        ``KeyboardInterrupt`` too) drops the in-flight samples, as :meth:`reset`.
    """
    self._check(requests, params)
    if token_budget is not None and (not isinstance(token_budget, (int, np.integer))
                                     or isinstance(token_budget, bool) or token_budget < 1):
      raise ValueError(f"`token_budget` must be None or an int >= 1, got {token_budget!r}.")
    if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
      raise ValueError(f"`version` must be an int, got {version!r}.")
    if (not isinstance(first_request, (int, np.integer)) or isinstance(first_request, bool)
        or first_request < 0):
      raise ValueError(f"`first_request` must be an int >= 0, got {first_request!r}.")
    try:
      return self._generate(params, requests, seed, token_budget, int(version),
                            int(first_request))
    except BaseException:
      self._state = None       # an interrupted call: its buffers may be donated, gone
      raise

  def _generate(self, params, requests: Sequence[Request], seed: int,
                token_budget: int | None, version: int,
                first_request: int = 0) -> list[Completion]:
    s, ps, k_steps = self.max_slots, self.page_size, self.steps_per_call
    stats: collections.Counter[str] = collections.Counter(dict.fromkeys((
        "decode_calls", "decode_steps", "decode_row_steps", "prefill_calls", "prefill_tokens",
        "prefill_rows_padded", "prefill_ahead", "admit_calls"), 0))
    timers = {"prefill_s": 0.0, "decode_s": 0.0}
    started = time.perf_counter()
    page_steps = 0
    call = self._calls
    self._calls += 1
    st = self._state
    if st is None:
      pool = PagePool(self.num_pages)
      st = _State(pool=pool, pages=self.fns.init_pages(params, self.num_pages, ps),
                  slots=[None] * s, queue=collections.deque(), groups={}, requests={},
                  key_data={}, kv_version=int(version))
    pool, slots, queue, groups = st.pool, st.slots, st.queue, st.groups
    page_bytes = sum(x.nbytes for x in jax.tree.leaves(st.pages)) // self.num_pages
    if requests:
      st.requests[call] = list(requests)
      st.key_data[call] = np.asarray(jax.random.key_data(jax.random.key(seed)))
      st.first_request[call] = first_request
      order = list(range(len(requests)))
      if self.policy == "longest_first":
        order.sort(key=lambda i: -requests[i].max_new_tokens)
      queue.extend((call, i, j) for i in order for j in range(requests[i].n))
    live_requests = [st.requests[c][i] for c, i, _ in queue] + [
        st.requests[slot.call][slot.request] for slot in slots if slot is not None]
    filtered = any(r.temperature > 0 and (r.top_k is not None or (
        r.top_p is not None and r.top_p < 1)) for r in live_requests)
    n_eos = max([len(r.eos_ids) for r in live_requests if r.eos_ids is not None] + [1])
    n_eos = 1 << (n_eos - 1).bit_length()
    done: list[tuple[int, Completion]] = []

    def request_of(c, i) -> Request:
      return st.requests[c][i]

    def group_key(c, i, j):
      key = (c, i, 0) if self.share_prompts else (c, i, j)
      if key not in groups:
        groups[key] = _Group(np.asarray(request_of(c, i).prompt, np.int32),
                             request_of(c, i).n if self.share_prompts else 1)
      return key

    def prefill_rows(jobs, max_rows=s):
      """Writes each job's ``(tokens, start, page ids)`` (its keys/values at positions
      ``start ..`` into those pages), up to ``max_rows`` jobs per forward; returns each
      job's logits after its last token. A round feeds ``prefill_chunk`` tokens of each
      unfinished job (up to ``max_rows`` of them) in ``[R, prefill_chunk]``, ``R`` the
      least of ``max_rows, max_rows / 4, ...`` (down to 1 or 2) that holds them: the
      rounds that only a few long jobs need cost a few rows, in at most
      ``log4(max_rows) + 1`` shapes (a compilation each). Used by :func:`recompute`;
      admissions go through :func:`prefill_packed` (one fixed shape: an admitted
      prompt's logits never depend on what else is admitted with it, while XLA:CPU
      rounds a row differently at other batch sizes)."""
      done_at = [0] * len(jobs)
      last: list[Any] = [None] * len(jobs)
      while True:
        todo = [j for j, (tokens, _, _) in enumerate(jobs)
                if done_at[j] < len(tokens)][:max_rows]
        if not todo:
          return last
        rows, c = max_rows, self.prefill_chunk
        while rows > 1 and rows // 4 >= len(todo):
          rows //= 4
        chunk_tokens = np.zeros((rows, c), np.int32)
        positions = np.full((rows, c), -1, np.int32)
        table = np.zeros((rows, self.pages_per_slot), np.int32)
        for row, j in enumerate(todo):
          tokens, start, ids = jobs[j]
          part = tokens[done_at[j]:done_at[j] + c]
          chunk_tokens[row, :len(part)] = part
          positions[row, :len(part)] = np.arange(len(part)) + start + done_at[j]
          table[row, :len(ids)] = ids
          done_at[j] += len(part)
        logits, st.pages = self._forward(params, chunk_tokens, positions, table, st.pages)
        stats["prefill_calls"] += 1
        for row, j in enumerate(todo):
          if done_at[j] == len(jobs[j][0]):
            last[j] = logits[row]

    def prefill_packed(jobs):
      """Writes each job's ``(tokens, start, page ids)`` and returns its logits after
      its last token, in calls of a FIXED shape ``[R, prefill_chunk]`` (``R`` =
      ``prefill_rows``): a job of ``L`` tokens takes ``ceil(L / prefill_chunk)`` rows
      (consecutive pieces; a later piece reads the keys an earlier one wrote, in the
      same call or an earlier one), and the rows of all jobs are packed in order, ``R``
      per call, the last call padded. A row's arithmetic depends only on its own
      tokens, positions and pages at that shape, so an admitted prompt's keys, values
      and logits are bitwise the same whatever is prefilled beside it, in any row."""
      rows, c = self.prefill_rows, self.prefill_chunk
      pieces = [(j, start + k, tokens[k:k + c], ids, k + c >= len(tokens))
                for j, (tokens, start, ids) in enumerate(jobs)
                for k in range(0, len(tokens), c)]
      last: list[Any] = [None] * len(jobs)
      for first in range(0, len(pieces), rows):
        chunk_tokens = np.zeros((rows, c), np.int32)
        positions = np.full((rows, c), -1, np.int32)
        table = np.zeros((rows, self.pages_per_slot), np.int32)
        batch = pieces[first:first + rows]
        for row, (_, at, part, ids, _) in enumerate(batch):
          chunk_tokens[row, :len(part)] = part
          positions[row, :len(part)] = np.arange(len(part)) + at
          table[row, :len(ids)] = ids
        logits, st.pages = self._forward(params, chunk_tokens, positions, table, st.pages)
        stats["prefill_calls"] += 1
        stats["prefill_rows_padded"] += rows - len(batch)
        for row, (j, _, _, _, is_last) in enumerate(batch):
          if is_last:
            last[j] = logits[row]
      return last

    def set_logits(slot_index, row, src=0, dst=0):
      if st.logits is None:
        st.logits = jnp.zeros((s, row.shape[-1]), jnp.float32)
      st.pages, st.logits = self._admit(st.pages, st.logits, slot_index, row, src, dst)

    def prefill_ahead(opened: list[_Group]) -> list[_Group]:
      """The next waiting groups without a prefill (queue order) that fit in the rows
      ``opened`` leaves free in its last ``[R, prefill_chunk]`` call, their prompt
      pages taken: padding rows do their prefill instead of nothing, so the next
      admissions find it done. A group is taken while the pool keeps
      ``pages_per_slot + 1`` pages free after its prompt's (so the first waiting
      sample always fits once the slots are empty: no deadlock); the first that does
      not fit ends the walk."""
      c, rows = self.prefill_chunk, self.prefill_rows
      free = -sum(_ceil_div(len(g.prompt), c) for g in opened) % rows
      ahead: list[_Group] = []
      for call, i, j in queue:
        if not free:
          break
        group = groups[group_key(call, i, j)]
        if group.pages:
          continue
        need, pieces = _ceil_div(len(group.prompt), ps), _ceil_div(len(group.prompt), c)
        if pieces > free or pool.available - need < self.pages_per_slot + 1:
          break
        group.pages = pool.allocate(need)
        ahead.append(group)
        free -= pieces
      stats["prefill_ahead"] += len(ahead)
      return ahead

    def admit_free_slots() -> None:
      """Admits waiting samples into the free slots, in queue order, while the pool
      holds their pages. A round takes the pages of every sample it admits first, then
      prefills the prompts of the groups it opened all together (:func:`prefill_packed`),
      then hands each admitted sample its group's logits (and its copy of the
      prompt's partial last page); a group whose last sample got in drops its hold on
      the prompt's pages after that. When a sample did not fit and that release freed
      pages, another round tries again."""
      while True:
        admitted: list[tuple[int, int, int]] = []      # (slot index, src, dst)
        opened: list[_Group] = []
        closed: list[_Group] = []
        blocked = False
        for index in range(s):
          if slots[index] is not None or not queue:
            continue
          c, i, j = queue[0]
          r = request_of(c, i)
          key = group_key(c, i, j)
          group = groups[key]
          p = len(r.prompt)
          full, partial = p // ps, p % ps != 0
          own_need = _ceil_div(p + r.max_new_tokens - 1, ps) - full
          prompt_need = 0 if group.pages else _ceil_div(p, ps)
          if pool.available < own_need + prompt_need:
            blocked = True
            break
          queue.popleft()
          if not group.pages:
            group.pages = pool.allocate(prompt_need)
            opened.append(group)
          shared = group.pages[:full]
          pool.incref(shared)
          pool.reserve(own_need)
          own = []
          src = dst = 0
          if partial and own_need:
            own.append(pool.take())
            src, dst = group.pages[full], own[0]
          admitted.append((index, src, dst))
          slots[index] = _Slot(c, i, j, group, shared, own, own_need - len(own), p)
          group.waiting -= 1
          if group.waiting == 0:             # the last sample is in: release it below
            closed.append(group)
            del groups[key]                  # groups holds those with samples waiting
        if opened:
          opened += prefill_ahead(opened)
          start = time.perf_counter()
          for group, logits in zip(opened, prefill_packed(
              [(group.prompt, 0, group.pages) for group in opened])):
            group.logits = logits
            stats["prefill_tokens"] += len(group.prompt)
          jax.block_until_ready([group.logits for group in opened])
          timers["prefill_s"] += time.perf_counter() - start
        for index, src, dst in admitted:
          slot = slots[index]
          assert slot is not None
          set_logits(index, slot.group.logits, src, dst)
          stats["admit_calls"] += 1
        for group in closed:                 # its samples copied the partial page
          pool.decref(group.pages)
          group.logits = None
        if not (blocked and closed and queue):
          return

    def finish(slot_index, reason):
      slot = slots[slot_index]
      assert slot is not None
      pool.decref(slot.shared + slot.own)
      pool.unreserve(slot.reserved)
      done.append((slot.call, Completion(
          slot.request, slot.sample, np.asarray(slot.tokens, np.int32),
          np.asarray(slot.logprobs, np.float32), np.asarray(slot.filtered, np.float32),
          reason, np.asarray(slot.versions, np.int32), request_of(slot.call,
                                                                  slot.request).tag)))
      slots[slot_index] = None

    def recompute():
      """The in-flight cache under the new ``params``: the prompts of the groups in
      flight (each once), then the live slots' own parts (prompt tail + generated
      tokens), both through :func:`prefill_rows`, and their logits."""
      start = time.perf_counter()
      by_group: dict[int, tuple[_Group, list[int]]] = {}
      for index, slot in enumerate(slots):
        if slot is not None:
          by_group.setdefault(id(slot.group), (slot.group, []))[1].append(index)
      for group in groups.values():          # groups with samples still waiting
        by_group.setdefault(id(group), (group, []))
      prompts: list[tuple[np.ndarray, int, list[int]]] = []
      owners: list[_Group | None] = []        # the group that keeps a prompt's logits
      tails: list[tuple[int, np.ndarray, int]] = []
      for group, members in by_group.values():
        full = len(group.prompt) // ps
        if group.waiting > 0:                # it holds all its prompt pages (if any)
          if group.pages:
            prompts.append((group.prompt, 0, group.pages))
            owners.append(group)
        elif full and members:
          prompts.append((group.prompt[:full * ps], 0, slots[members[0]].shared))
          owners.append(None)
        for index in members:
          slot = slots[index]
          seq = np.concatenate([group.prompt, np.asarray(slot.tokens, np.int32)])
          first = min(full * ps, slot.position - 1)
          tails.append((index, seq[first:slot.position], first))
      for owner, logits in zip(owners, prefill_rows(prompts)):
        if owner is not None:
          owner.logits = logits
      tail_logits = prefill_rows([(tail, first, slots[index].shared + slots[index].own)
                                  for index, tail, first in tails])
      for (index, _, _), logits in zip(tails, tail_logits):
        set_logits(index, logits)
      stats["recomputed_tokens"] = sum(len(p) for p, _, _ in prompts) + sum(
          len(t) for _, t, _ in tails)
      timers["recompute_s"] = time.perf_counter() - start

    if int(version) != st.kv_version and self.on_new_version == "recompute" and (
        any(slots) or groups):
      recompute()
    st.kv_version = int(version)

    generated = 0
    while (queue or any(slots)) and (token_budget is None or generated < token_budget):
      admit_free_slots()
      live = [(index, slot) for index, slot in enumerate(slots) if slot is not None]
      if not live:
        raise RuntimeError("no sample could be admitted (internal: pages leaked?).")
      # The call runs W rows, the least of decode_widths that holds the live slots:
      # row == slot at W = S, else the live slots first, then free ones (padding).
      w = min(x for x in self.decode_widths if x >= len(live))
      if w == s:
        row_slots = list(range(s))
      else:
        row_slots = [index for index, _ in live] + [
            index for index in range(s) if slots[index] is None][:w - len(live)]
      row_of = {index: row for row, index in enumerate(row_slots)}
      # Hand each live slot the pages its next K tokens write (from its reservation).
      table = np.zeros((w, self.pages_per_slot), np.int32)
      arrays = {name: np.zeros(w, dtype) for name, dtype in (
          ("position", np.int32), ("count", np.int32), ("max_new", np.int32),
          ("request", np.int32), ("sample", np.int32), ("temperature", np.float32),
          ("top_k", np.int32), ("top_p", np.float32))}
      arrays["position"][:] = -1
      key_data = np.zeros((w, 2), np.uint32)
      eos = np.full((w, n_eos), -1, np.int32)
      for slot_index, slot in live:
        index = row_of[slot_index]
        r = request_of(slot.call, slot.request)
        last = min(slot.position + k_steps - 1, len(r.prompt) + r.max_new_tokens - 2)
        while len(slot.shared) + len(slot.own) <= last // ps:
          slot.own.append(pool.take())
          slot.reserved -= 1
        ids = slot.shared + slot.own
        table[index, :len(ids)] = ids
        arrays["position"][index] = slot.position
        arrays["count"][index] = len(slot.tokens)
        arrays["max_new"][index] = r.max_new_tokens
        arrays["request"][index] = slot.request + st.first_request.get(slot.call, 0)
        arrays["sample"][index] = slot.sample
        arrays["temperature"][index] = r.temperature
        arrays["top_k"][index] = r.top_k or 0
        arrays["top_p"][index] = 1.0 if r.top_p is None else r.top_p
        key_data[index] = st.key_data[slot.call]
        if r.eos_ids is not None:
          eos[index, :len(r.eos_ids)] = r.eos_ids
      limit = k_steps if token_budget is None else min(
          k_steps, _ceil_div(token_budget - generated, len(live)))
      start = time.perf_counter()
      if w == s:
        st.pages, st.logits, out, steps = self._decode(
            params, st.pages, st.logits, table, eos, key_data,
            min(self.refill_after, len(queue)), limit,
            steps=k_steps, filtered=filtered, **arrays)
      else:                                  # the rows' logits out and back: copies
        rows = np.asarray(row_slots, np.int32)
        st.pages, row_logits, out, steps = self._decode(
            params, st.pages, _take_rows_jit(st.logits, rows), table, eos, key_data,
            min(self.refill_after, len(queue)), limit,
            steps=k_steps, filtered=filtered, **arrays)
        st.logits = _put_rows_jit(st.logits, rows, row_logits)
      steps = int(steps)
      timers["decode_s"] += time.perf_counter() - start
      tokens, logps, flogps = (np.asarray(x)[:, :steps] for x in out)
      stats["decode_calls"] += 1
      stats["decode_steps"] += steps
      stats["decode_row_steps"] += w * steps
      page_steps += pool.in_use * steps
      stats["peak_pages"] = max(stats["peak_pages"], pool.in_use)
      for slot_index, slot in live:
        index = row_of[slot_index]
        r = request_of(slot.call, slot.request)
        got = tokens[index] >= 0
        n_new = int(got.sum())
        generated += n_new
        slot.tokens.extend(tokens[index, :n_new].tolist())
        slot.logprobs.extend(logps[index, :n_new].tolist())
        slot.filtered.extend(flogps[index, :n_new].tolist())
        slot.versions.extend([int(version)] * n_new)
        slot.position += n_new
        if n_new and r.eos_ids is not None and slot.tokens[-1] in r.eos_ids:
          finish(slot_index, "eos")
        elif len(slot.tokens) >= r.max_new_tokens:
          finish(slot_index, "length")

    # Requests with nothing left in flight are forgotten; an empty engine frees its pool.
    calls_left = {c for c, _, _ in queue} | {slot.call for slot in slots if slot is not None}
    for c in [c for c in st.requests if c not in calls_left]:
      del st.requests[c], st.key_data[c]
      st.first_request.pop(c, None)
    self._state = st if calls_left else None
    useful = sum(len(c.tokens) for _, c in done)
    steps_total = max(stats["decode_steps"], 1)
    self.stats = {
        **stats, **timers, "total_s": time.perf_counter() - started,
        "useful_tokens": useful, "generated_tokens": generated, "slots": s,
        "prefill_rows": self.prefill_rows,
        "slot_utilisation": generated / (s * steps_total),
        "row_utilisation": generated / max(stats["decode_row_steps"], 1),
        "mean_pages_in_use": page_steps / steps_total, "page_bytes": page_bytes,
        "pool_bytes": page_bytes * self.num_pages, "pages_in_use_after": pool.in_use,
        "pages_reserved_after": pool.reserved, "in_flight_after": self.in_flight,
    }
    done.sort(key=lambda item: (item[0], item[1].request, item[1].sample))
    return [c for _, c in done]


def _admit(pages, logits_state, slot, row, src, dst):
  """Sets the slot's next-token logits and copies page ``src`` to ``dst`` in every
  layer's pool (the copy-on-write of a shared prompt's partial last page)."""
  pages = jax.tree.map(lambda x: x.at[dst].set(x[src]), pages)
  return pages, logits_state.at[slot].set(row.astype(jnp.float32))


def _decode_loop(forward, params, pages, logits, table, eos, key_data, exit_after, limit, *,
                 steps, filtered, position, count, max_new, request, sample, temperature, top_k,
                 top_p):
  """Up to ``steps`` decode steps of all slots (a ``lax.while_loop``).

  Each step draws a token per live slot from its logits (key from the slot's seed's
  ``key_data`` ``[S, 2]`` and ``(request, sample, count)``), records it, marks slots
  that hit a stop id or ``max_new``, and feeds the still-live slots' tokens through
  ``forward`` (writing their keys/values at ``position``). Stops after
  ``min(steps, limit)`` steps (``limit`` traced), when no slot is live, or (``exit_after``
  > 0, traced) once ``exit_after`` slots finished. Returns ``(pages, logits, (tokens,
  logps, flogps) [S, steps] with -1 / 0 where nothing was generated, steps run)``.
  """
  s = position.shape[0]
  live = position >= 0

  def cond(carry):
    step, _, _, _, _, live, ended, _ = carry
    return ((step < jnp.minimum(steps, limit)) & jnp.any(live)
            & ~((exit_after > 0) & (ended >= exit_after)))

  def body(carry):
    step, pages, logits, position, count, live, ended, outs = carry
    keys = row_keys(jax.random.wrap_key_data(key_data), request, sample, count)
    token, logp, flogp = draw(logits, keys, temperature, top_k, top_p, filtered=filtered)
    tok_out, logp_out, flogp_out = outs
    tok_out = tok_out.at[:, step].set(jnp.where(live, token, -1))
    logp_out = logp_out.at[:, step].set(jnp.where(live, logp, 0.0))
    flogp_out = flogp_out.at[:, step].set(jnp.where(live, flogp, 0.0))
    count = count + live
    stop = jnp.any(token[:, None] == eos, axis=1) | (count >= max_new)
    live_ended = live & stop
    live = live & ~stop
    fed = jnp.where(live, position, -1)
    new_logits, pages = forward(params, token[:, None], fed[:, None], table, pages)
    logits = jnp.where(live[:, None], new_logits, logits)
    return (step + 1, pages, logits, position + live, count, live,
            ended + jnp.sum(live_ended), (tok_out, logp_out, flogp_out))

  outs = (jnp.full((s, steps), -1, jnp.int32), jnp.zeros((s, steps), jnp.float32),
          jnp.zeros((s, steps), jnp.float32))
  carry = (jnp.asarray(0, jnp.int32), pages, logits, position, count, live,
           jnp.asarray(0, jnp.int32), outs)
  step, pages, logits, _, _, _, _, outs = jax.lax.while_loop(cond, body, carry)
  return pages, logits, outs, step


_prefill_jit = jax.jit(lambda forward, *args: forward(*args), static_argnums=0,
                       donate_argnums=5)
_admit_jit = jax.jit(_admit, donate_argnums=(0, 1))
_take_rows_jit = jax.jit(lambda x, rows: x[rows])
_put_rows_jit = jax.jit(lambda x, rows, values: x.at[rows].set(values), donate_argnums=0)
_decode_jit = jax.jit(_decode_loop, static_argnames=("forward", "steps", "filtered"),
                      donate_argnums=(2, 3))

__all__ = ["Completion", "ON_NEW_VERSION", "POLICIES", "Request", "RolloutEngine"]
