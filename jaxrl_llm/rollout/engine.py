r"""A continuous-batching rollout engine: paged KV cache, shared prompts, keyed draws.

:class:`RolloutEngine` generates completions for a list of :class:`Request` s with a
fixed number of slots (static shapes: nothing recompiles as requests come and go):

* **Continuous batching.** A host-side scheduler (plain Python and NumPy:
  :class:`jaxrl_llm.rollout.scheduler.Scheduler`, which plans each step's device calls
  and records their output) admits waiting samples into free slots; a jitted
  ``lax.while_loop`` runs up to ``steps_per_call`` decode steps for all slots per
  device call and returns early when a slot finishes while samples are waiting, so
  the host refills the slot at once. Each request has its own
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
  (``tests/rollout/test_engine.py`` pins 8/16 for the CPU). Hence off by default.

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

**Prefix cache (opt-in, ``prefix_cache=True``; vLLM's automatic prefix caching at page
granularity).** When a sample finishes, the full pages of its sequence (prompt and
generated tokens, less the last token, whose keys/values were never computed) stay in
the pool, held by a :class:`~jaxrl_llm.rollout.paged_cache.PrefixCache`: a tree whose
path from the root spells, page by page, the exact token ids a page's keys/values were
computed for (ids compared, no hash). A new group's prompt maps the pages of its
longest cached prefix (at most ``(len(prompt) - 1) // page_size`` pages: its last
token is always prefilled, for its logits) and prefills only the rest, from that
position on (``Completion.cached_tokens``). A multi-turn episode whose next prompt is
its sequence so far plus the environment's reply then prefills the reply, the last
sampled token and the part of the sequence in its last, partly filled page (not
cached). Pages are reference-counted (the cache holds one reference, every prompt and
slot that reads a page another); a page only the cache holds is evicted, least
recently used first (a path's tail before its head; the cached prefixes of the prompts
waiting in the queue last, the queue's tail first), whenever an admission needs
pages: the cache never makes a sample wait that would run without it (at
``prefill_rows=1`` a call that reuses nothing makes the very device calls of the
engine without it; free prefill rows do not evict cached pages to prefill prompts
ahead of their admission). The pool is kept between calls while the cache holds pages
(``stats["pages_in_use_after"]`` counts them; :meth:`reset` drops them). Pages are
never read under other parameters: the cache is keyed by ``version`` and by the
identity of ``params``' leaves (weak references: new arrays of equal values are other
parameters, the same arrays in another container are not), and a call with another
key empties it first (``stats["prefix_dropped_pages"]``); a sample whose keys/values
are partly another key's (in flight across versions with ``on_new_version="keep"``) is
not cached. Counters per call: ``prefill_tokens`` (prompt tokens prefilled),
``prefix_reused_tokens``, ``prefix_hits`` (groups that found a cached prefix),
``prefix_evictions``, ``prefix_cached_pages`` (after the call). Exactness: a continued
prompt is prefilled in other chunks (from the cached position on) and reads keys that
decode steps wrote, so its log-probs are not bitwise those of the same prompt
prefilled from scratch: in f32 on XLA:CPU they were within 1e-6 on the tiny test
model and 2e-6 on the ``small`` preset (36 continued requests each, greedy and
sampled; no token differed; ``tests/rollout/test_prefix_cache.py`` pins 2e-6), and
within 1e-4 of the teacher-forced log-probs like every sampled token. Batch invariance
holds as above for a given cache content: a request that maps the same cached pages
gives bitwise the same tokens and log-probs alone or among others (which pages it maps
depends on what the cache holds: an eviction, or another sequence that cached the same tokens first
with keys computed in other chunks, can change it by those ulps).

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
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.rollout.backend import draw_seed
from jaxrl_llm.rollout.draw import draw, row_keys
from jaxrl_llm.rollout.protocol import PagedDecodeFns
from jaxrl_llm.rollout.scheduler import (
    POLICIES,
    Admission,
    Completion,
    DecodeBatch,
    PrefillBatch,
    Request,
    Scheduler,
    ceil_div,
    pages_needed,
)

ON_NEW_VERSION = ("recompute", "keep")
_Output = tuple[np.ndarray, np.ndarray, np.ndarray]   # tokens, logps, flogps [W, steps]


@dataclasses.dataclass
class _State:
  """What stays in flight between ``generate`` calls of a partial rollout: the host
  side (the scheduler) and the device side (the page pool, logits)."""

  sched: Scheduler
  pages: Any                      # the device page pool (a pytree)
  kv_version: int                 # the version the cache was computed under
  logits: Any = None              # [S, V] next-token logits per slot (device)
  prompt_logits: dict = dataclasses.field(default_factory=dict)  # group key -> [V]
                                  # next-token logits after its prompt (device)


class RolloutEngine:
  """Continuous-batching generation over a paged KV cache (module docstring); a
  :class:`~jaxrl_llm.rollout.backend.RolloutBackend` (the whole parameter pytree,
  :func:`~jaxrl_llm.rollout.backend.draw_seed` seeds, no step metrics: :attr:`stats`
  holds the last call's counters).

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
      (``num_pages`` x ``stats["page_bytes"]``); a smaller pool bounds it. A
      request that needs more pages than the whole pool raises ``ValueError``; a
      sample that needs pages now in use waits (it and the samples queued after it)
      until finished slots return them.
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
    prefix_cache: keep finished samples' full pages for later prompts that start
      with the same tokens (module docstring, "Prefix cache"). False (default): every
      prompt is prefilled whole, and an engine with nothing in flight frees its pool.

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
               decode_widths: Sequence[int] | None = None,
               prefix_cache: bool = False) -> None:
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
    if not isinstance(prefix_cache, bool):
      raise ValueError(f"`prefix_cache` must be a bool, got {prefix_cache!r}.")
    self.fns = decode_fns
    self.max_slots = max_slots
    self.max_len = max_len
    self.page_size = page_size
    self.pages_per_slot = ceil_div(max_len, page_size)
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
    self.prefix_cache = prefix_cache
    self._params_seen = _Identity()          # which parameters the cached pages are of
    self.stats: dict[str, Any] = {}     # the last generate call's counters
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
                    prefill_rows=self.prefill_rows, decode_widths=self.decode_widths,
                    prefix_cache=self.prefix_cache)
    copy = RolloutEngine(self.fns, **{**settings, **overrides})
    copy._vocab = self._vocab
    return copy

  # -- the rollout-backend protocol ------------------------------------------------

  takes_policy_part = False     # the whole pytree the paged decode functions read

  def take_stats(self) -> dict[str, float]:
    """``{}``: no step metrics (the last call's counters: the :attr:`stats` dict)."""
    return {}

  def seed_from_key(self, key: jax.Array) -> int:
    """:func:`~jaxrl_llm.rollout.backend.draw_seed`: an int seed drawn with ``key``."""
    return draw_seed(key)

  # -- validation ------------------------------------------------------------------

  def pages_needed(self, request: Request) -> int:
    """Pages one sample of ``request`` needs alone: its prompt's pages, the prompt's
    last partial page kept for copies while samples wait, and its own pages."""
    return pages_needed(request, self.page_size)

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
    return 0 if self._state is None else self._state.sched.in_flight

  @property
  def waiting(self) -> int:
    """Samples submitted and not yet in a slot (a part of :attr:`in_flight`)."""
    return 0 if self._state is None else len(self._state.sched.queue)

  @property
  def pages_in_use(self) -> int:
    """Pages held by in-flight samples and the prefix cache (0 when nothing is in
    flight or cached)."""
    return 0 if self._state is None else self._state.sched.pool.in_use

  def reset(self) -> int:
    """Drops every in-flight sample and the prefix cache (returns their pages, frees
    the device pool); returns how many samples were dropped. Their tokens are lost: a
    caller that aborts a partial rollout (a resumed run, a run that ends) submits the
    requests again."""
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
    ``decode_s``, ``total_s``, for partial rollouts ``generated_tokens``,
    ``in_flight_after``, ``recomputed_tokens`` and ``recompute_s``, and with the prefix
    cache ``prefix_reused_tokens``, ``prefix_hits``, ``prefix_evictions``,
    ``prefix_dropped_pages`` and ``prefix_cached_pages`` (module docstring).

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

  def _generate(self, params: Any, requests: Sequence[Request], seed: int,
                token_budget: int | None, version: int,
                first_request: int = 0) -> list[Completion]:
    """One validated ``generate`` call, a step at a time: the scheduler plans the step
    on the host (:meth:`Scheduler.schedule`: admissions, pages, the decode batch),
    the plan's device calls run (:meth:`_run_admission`, :meth:`_run_decode`), and
    :meth:`Scheduler.apply` records the decoded tokens (finished samples out). A call
    with another ``version`` first prefills the in-flight cache again
    (:meth:`_recompute`, ``on_new_version="recompute"``)."""
    started = time.perf_counter()
    stats: collections.Counter[str] = collections.Counter(dict.fromkeys((
        "decode_calls", "decode_steps", "decode_row_steps", "prefill_calls", "prefill_tokens",
        "prefill_rows_padded", "prefill_ahead", "admit_calls"), 0))
    timers = {"prefill_s": 0.0, "decode_s": 0.0}
    call, self._calls = self._calls, self._calls + 1
    st = self._state if self._state is not None else self._new_state(params, version)
    sched = st.sched
    page_bytes = sum(x.nbytes for x in jax.tree.leaves(st.pages)) // self.num_pages
    if requests:
      sched.submit(call, requests, np.asarray(jax.random.key_data(jax.random.key(seed))),
                   first_request)
    filtered, n_eos = sched.sampling_mode()     # one decode compilation for the call
    evicted = 0 if sched.cache is None else sched.cache.evictions
    if sched.cache is not None:      # a new version or new parameters empty the cache
      stats.update(prefix_reused_tokens=0, prefix_hits=0, prefix_dropped_pages=(
          sched.set_cache_key((version, self._params_seen(params)))))
    if (version != st.kv_version and self.on_new_version == "recompute"
        and sched.has_cache()):
      self._recompute(params, st, stats, timers)
    st.kv_version = version
    generated, page_steps, done = 0, 0, []
    while sched.has_work() and (token_budget is None or generated < token_budget):
      plan = sched.schedule(n_eos=n_eos, version=version, budget_left=(
          None if token_budget is None else token_budget - generated))
      for admission in plan.admissions:
        self._run_admission(params, st, admission, stats, timers)
      output, steps = self._run_decode(params, st, plan.decode, filtered, timers)
      stats["decode_calls"] += 1
      stats["decode_steps"] += steps
      stats["decode_row_steps"] += len(plan.decode.table) * steps
      page_steps += plan.decode.pages_in_use * steps
      stats["peak_pages"] = max(stats["peak_pages"], plan.decode.pages_in_use)
      new, finished = sched.apply(plan, output)
      generated += new
      done += finished
    keep = sched.end_call()
    if sched.cache is not None:      # the cache keeps the pool (and the counts)
      keep = keep or len(sched.cache) > 0
      stats["prefix_evictions"] = sched.cache.evictions - evicted
      stats["prefix_cached_pages"] = len(sched.cache)
    self._state = st if keep else None   # an empty engine frees its pool
    steps_total = max(stats["decode_steps"], 1)
    s = self.max_slots
    self.stats = {
        **stats, **timers, "total_s": time.perf_counter() - started,
        "useful_tokens": sum(len(c.tokens) for _, c in done), "generated_tokens": generated,
        "slots": s, "prefill_rows": self.prefill_rows,
        "slot_utilisation": generated / (s * steps_total),
        "row_utilisation": generated / max(stats["decode_row_steps"], 1),
        "mean_pages_in_use": page_steps / steps_total, "page_bytes": page_bytes,
        "pool_bytes": page_bytes * self.num_pages, "pages_in_use_after": sched.pool.in_use,
        "pages_reserved_after": sched.pool.reserved, "in_flight_after": self.in_flight,
    }
    done.sort(key=lambda item: (item[0], item[1].request, item[1].sample))
    return [c for _, c in done]

  # -- the device calls of a plan --------------------------------------------------

  def _new_state(self, params: Any, version: int) -> _State:
    sched = Scheduler(max_slots=self.max_slots, page_size=self.page_size,
                      num_pages=self.num_pages, max_len=self.max_len,
                      steps_per_call=self.steps_per_call, prefill_chunk=self.prefill_chunk,
                      prefill_rows=self.prefill_rows, decode_widths=self.decode_widths,
                      policy=self.policy, share_prompts=self.share_prompts,
                      refill_after=self.refill_after, prefix_cache=self.prefix_cache)
    return _State(sched, self.fns.init_pages(params, self.num_pages, self.page_size),
                  version)

  def _prefill(self, params: Any, st: _State, batches: Sequence[PrefillBatch],
               n_jobs: int, stats: collections.Counter[str]) -> list[Any]:
    """Runs the prefill ``batches`` (writing their keys/values into the pages);
    returns each job's logits after its last token (None for a job of no tokens)."""
    last: list[Any] = [None] * n_jobs
    for batch in batches:
      logits, st.pages = self._forward(params, batch.tokens, batch.positions, batch.table,
                                       st.pages)
      stats["prefill_calls"] += 1
      for row, job in batch.ends:
        last[job] = logits[row]
    return last

  def _set_logits(self, st: _State, slot: int, row: Any, src: int = 0,
                  dst: int = 0) -> None:
    """The slot's next-token logits := ``row``, and page ``src`` copied to ``dst``."""
    if st.logits is None:
      st.logits = jnp.zeros((self.max_slots, row.shape[-1]), jnp.float32)
    st.pages, st.logits = self._admit(st.pages, st.logits, slot, row, src, dst)

  def _run_admission(self, params: Any, st: _State, admission: Admission,
                     stats: collections.Counter[str], timers: dict[str, float]) -> None:
    """One admission round: the packed prefill of the prompts it opened (and of those
    prefilled ahead; their logits kept per group), then each admitted slot's logits
    and copy of its prompt's partial last page; closed groups' logits dropped."""
    if admission.prefill:
      start = time.perf_counter()
      logits = self._prefill(params, st, admission.batches, len(admission.prefill), stats)
      st.prompt_logits.update(zip(admission.prefill, logits))
      stats["prefill_ahead"] += admission.ahead
      stats["prefill_rows_padded"] += sum(batch.padded for batch in admission.batches)
      stats["prefill_tokens"] += admission.prefill_tokens
      if self.prefix_cache:
        stats["prefix_reused_tokens"] += admission.reused_tokens
        stats["prefix_hits"] += admission.hits
      jax.block_until_ready(logits)
      timers["prefill_s"] += time.perf_counter() - start
    for admit in admission.admits:
      self._set_logits(st, admit.slot, st.prompt_logits[admit.group], admit.src, admit.dst)
      stats["admit_calls"] += 1
    for key in admission.closed:
      del st.prompt_logits[key]

  def _run_decode(self, params: Any, st: _State, batch: DecodeBatch, filtered: bool,
                  timers: dict[str, float]) -> tuple[_Output, int]:
    """The decode call of ``batch``; returns ``(tokens, logps, flogps)`` ``[W, steps]``
    and the steps run. Below ``max_slots`` rows, the rows' logits go out and back
    (copies)."""
    start = time.perf_counter()
    args = (batch.table, batch.eos, batch.key_data, batch.exit_after, batch.limit)
    kwargs = dict(steps=self.steps_per_call, filtered=filtered, **batch.arrays)
    if batch.rows is None:
      st.pages, st.logits, out, steps = self._decode(params, st.pages, st.logits, *args,
                                                     **kwargs)
    else:
      st.pages, row_logits, out, steps = self._decode(
          params, st.pages, _take_rows_jit(st.logits, batch.rows), *args, **kwargs)
      st.logits = _put_rows_jit(st.logits, batch.rows, row_logits)
    steps = int(steps)
    timers["decode_s"] += time.perf_counter() - start
    tokens, logps, flogps = (np.asarray(x)[:, :steps] for x in out)
    return (tokens, logps, flogps), steps

  def _recompute(self, params: Any, st: _State, stats: collections.Counter[str],
                 timers: dict[str, float]) -> None:
    """The in-flight cache under the new ``params`` (:meth:`Scheduler.recompute`): the
    prompts of the groups in flight, then the live slots' own parts and their logits."""
    start = time.perf_counter()
    plan = st.sched.recompute()
    prompts = self._prefill(params, st, plan.prompt_batches, len(plan.owners), stats)
    st.prompt_logits.update((key, row) for key, row in zip(plan.owners, prompts)
                            if key is not None)
    tails = self._prefill(params, st, plan.tail_batches, len(plan.tail_slots), stats)
    for slot, row in zip(plan.tail_slots, tails):
      self._set_logits(st, slot, row)
    stats["recomputed_tokens"] = plan.tokens
    timers["recompute_s"] = time.perf_counter() - start


class _Identity:
  """Tells whether a parameter pytree is the one seen last, leaf by leaf (``is``):
  calling it returns a generation number that changes whenever a leaf is another
  object. Leaves are held by weak reference (a strong one for the few objects that
  take none, e.g. Python scalars), so the old parameters' memory is never kept alive
  and a dead leaf's ``id`` reused by a new array can never pass for it.

  >>> seen = _Identity()
  >>> a = {"w": np.ones(2)}
  >>> seen(a), seen(dict(a)), seen({"w": np.ones(2)})
  (1, 1, 2)
  """

  def __init__(self) -> None:
    self._refs: list[Any] | None = None
    self.generation = 0

  def __call__(self, params: Any) -> int:
    leaves = jax.tree.leaves(params)
    if self._refs is None or len(self._refs) != len(leaves) or any(
        ref() is not leaf for ref, leaf in zip(self._refs, leaves)):
      self._refs = [_ref(leaf) for leaf in leaves]
      self.generation += 1
    return self.generation


def _ref(obj: Any) -> Any:
  """A weak reference to ``obj``, or a callable returning it if it takes none."""
  try:
    return weakref.ref(obj)
  except TypeError:
    return lambda: obj


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
