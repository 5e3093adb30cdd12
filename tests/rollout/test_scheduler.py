"""The rollout engine's host-side scheduler (jaxrl_llm/rollout/scheduler.py), with no
model: admission order, page reservation and copy-on-write, finishing, shared-prompt
groups, sampling settings, requests that wait or cannot fit, partial rollouts and the
recompute plan, prefill packing, the prefix cache (reuse, reference counts, LRU
eviction, a key per parameters). Every value is pinned (page ids included: the pool
hands out free pages in a fixed order)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.rollout.paged_cache import PagePool, PrefixCache
from jaxrl_llm.rollout.scheduler import (
    Completion,
    Request,
    Scheduler,
    pack_prefill,
    pages_needed,
    shrink_prefill,
)

KEY = np.array([3, 4], np.uint32)


def make(**kwargs) -> Scheduler:
  settings = dict(max_slots=4, page_size=4, num_pages=16, max_len=16, steps_per_call=4)
  return Scheduler(**{**settings, **kwargs})


def output(rows: list[list[int]], steps: int | None = None):
  """A decode call's (tokens, logps, flogps): row i generated ``rows[i]`` (-1 padded)."""
  steps = steps or max(map(len, rows))
  tokens = np.full((len(rows), steps), -1, np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  logps = np.where(tokens >= 0, -0.5, 0.0).astype(np.float32)
  return tokens, logps, 2 * logps


def slots(sched: Scheduler) -> list:
  return [None if s is None else (s.call, s.request, s.sample) for s in sched.slots]


def test_admission_order_longest_first_and_fifo():
  requests = [Request([1], max_new_tokens=2), Request([2], n=2, max_new_tokens=5),
              Request([3], max_new_tokens=3)]
  sched = make(max_slots=2)
  sched.submit(0, requests, KEY)
  assert list(sched.queue) == [(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 0, 0)]
  sched.schedule(n_eos=1, version=0)
  assert slots(sched) == [(0, 1, 0), (0, 1, 1)]
  assert list(sched.queue) == [(0, 2, 0), (0, 0, 0)] and sched.in_flight == 4
  fifo = make(max_slots=2, policy="fifo")
  fifo.submit(0, requests, KEY)
  fifo.schedule(n_eos=1, version=0)
  assert slots(fifo) == [(0, 0, 0), (0, 1, 0)]
  assert list(fifo.queue) == [(0, 1, 1), (0, 2, 0)]
  with pytest.raises(ValueError, match="policy"):
    make(policy="random")


def test_shared_prompt_pages_and_the_copy_on_write_of_its_last_page():
  # 6 prompt tokens on pages of 4: page 0 is full (shared, read only), page 1 partial
  # (each sample writes its own copy). A sample needs ceil((6 + 5 - 1) / 4) - 1 = 2 own
  # pages: the copy is taken at admission, the other stays reserved.
  sched = make(num_pages=8, max_len=12)
  sched.submit(0, [Request(list(range(10, 16)), n=3, max_new_tokens=5)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  (admission,) = plan.admissions
  assert admission.prefill == ((0, 0, 0),) and admission.prefill_tokens == 6
  assert [(a.slot, a.group, a.src, a.dst) for a in admission.admits] == [
      (0, (0, 0, 0), 1, 2), (1, (0, 0, 0), 1, 3), (2, (0, 0, 0), 1, 4)]
  assert admission.closed == ((0, 0, 0),) and sched.groups == {}
  # One prefill row a call (prefill_rows=1), prefill_chunk 128 here: one call.
  (batch,) = admission.batches
  assert batch.tokens.shape == (1, 128) and batch.tokens[0, :7].tolist() == [
      10, 11, 12, 13, 14, 15, 0]
  assert batch.positions[0, :7].tolist() == [0, 1, 2, 3, 4, 5, -1]
  assert batch.table.tolist() == [[0, 1, 0]] and batch.ends == ((0, 0),)
  # The group's hold on its prompt pages is dropped once its last sample is in: page 1
  # (the partial one, copied by every sample) is free again, page 0 read by three slots.
  # The decode call then hands each slot the page of its next tokens (positions 6..9:
  # page 2) from its reservation; page 1, back on the free list, comes out first.
  assert sched.pool.refs.tolist() == [3, 1, 1, 1, 1, 1, 1, 0]
  decode = plan.decode
  assert decode.rows is None and decode.slots == (0, 1, 2) and decode.rows_of == (0, 1, 2)
  assert decode.table.tolist() == [[0, 2, 1], [0, 3, 5], [0, 4, 6], [0, 0, 0]]
  assert sched.pool.reserved == 0 and sched.pool.in_use == decode.pages_in_use == 7
  assert decode.arrays["position"].tolist() == [6, 6, 6, -1]
  assert decode.arrays["sample"].tolist() == [0, 1, 2, 0]
  assert decode.limit == 4 and decode.exit_after == 0


def test_a_prompt_of_whole_pages_needs_no_copy():
  sched = make()
  sched.submit(0, [Request([1, 2, 3, 4], n=2, max_new_tokens=4)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  assert [(a.slot, a.src, a.dst) for a in plan.admissions[0].admits] == [(0, 0, 0), (1, 0, 0)]
  # Own pages: ceil((4 + 4 - 1) / 4) - 1 = 1 each, taken by the decode (positions 4..6).
  assert plan.decode.table[:2].tolist() == [[0, 1, 0, 0], [0, 2, 0, 0]]
  assert [s.own for s in sched.slots[:2]] == [[1], [2]]
  assert pages_needed(Request([1, 2, 3, 4], max_new_tokens=4), 4) == 2
  assert pages_needed(Request([1] * 6, max_new_tokens=5), 4) == 4


def test_finished_slots_return_their_pages_and_their_completions():
  sched = make(num_pages=8, max_len=12)
  sched.submit(0, [Request([5, 6, 7], n=2, max_new_tokens=3, eos_ids=(9,), tag="t"),
                   Request([8], max_new_tokens=2)], KEY)
  plan = sched.schedule(n_eos=1, version=7)
  # Prompt pages 0 (request 0: freed once both samples copied it) and 3 (request 1);
  # copies 1, 2 and request 1's page 4; the decode hands slots 0 and 1 pages 3 and 0.
  assert [s.own for s in sched.slots[:3]] == [[1, 3], [2, 0], [4]]
  assert sched.pool.in_use == 5 and plan.decode.eos[:, 0].tolist() == [9, 9, -1, -1]
  # Sample 0 ends on the stop id, request 1 reaches max_new_tokens, sample 1 goes on.
  generated, done = sched.apply(plan, output([[4, 9], [4, 4], [2, 3]]))
  assert generated == 6 and slots(sched) == [None, (0, 0, 1), None, None]
  assert [(call, c.request, c.sample, c.tokens.tolist(), c.finish_reason, c.tag)
          for call, c in done] == [(0, 0, 0, [4, 9], "eos", "t"),
                                   (0, 1, 0, [2, 3], "length", None)]
  first = done[0][1]
  assert isinstance(first, Completion) and first.versions.tolist() == [7, 7]
  assert first.logprobs.tolist() == [-0.5, -0.5] and first.filtered_logprobs.tolist() == [
      -1.0, -1.0]
  assert sched.pool.in_use == 2 and sched.slots[1].position == 5
  plan = sched.schedule(n_eos=1, version=7)
  assert plan.admissions == () and plan.decode.arrays["count"].tolist() == [0, 2, 0, 0]
  generated, done = sched.apply(plan, output([[], [6]]))
  assert generated == 1 and [(c.sample, c.tokens.tolist(), c.finish_reason)
                             for _, c in done] == [(1, [4, 4, 6], "length")]
  assert (sched.pool.in_use, sched.pool.reserved, sched.in_flight) == (0, 0, 0)
  assert not sched.has_work() and not sched.end_call() and sched.requests == {}


def test_unshared_prompts_make_one_group_per_sample():
  sched = make(share_prompts=False)
  sched.submit(0, [Request([1, 2, 3, 4, 5], n=2, max_new_tokens=2)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  (admission,) = plan.admissions
  assert admission.prefill == ((0, 0, 0), (0, 0, 1)) and admission.prefill_tokens == 10
  assert [(a.group, a.src, a.dst) for a in admission.admits] == [
      ((0, 0, 0), 1, 2), ((0, 0, 1), 4, 5)]
  assert admission.closed == ((0, 0, 0), (0, 0, 1)) and len(admission.batches) == 2


def test_sampling_settings_per_row():
  sched = make(decode_widths=(2,))
  assert sched.decode_widths == (2, 4)
  sched.submit(3, [Request([1], max_new_tokens=4, temperature=0, top_k=5, eos_ids=(1, 2, 3)),
                   Request([2], max_new_tokens=3, temperature=0.5, top_p=0.9)],
               KEY, first_request=10)
  assert sched.sampling_mode() == (True, 4)       # top_p < 1 when sampling; 3 ids -> 4
  plan = sched.schedule(n_eos=4, version=0)
  d = plan.decode
  assert d.rows.tolist() == [0, 1] and d.rows_of == (0, 1) and d.table.shape == (2, 4)
  assert d.arrays["request"].tolist() == [10, 11] and d.arrays["max_new"].tolist() == [4, 3]
  assert d.arrays["temperature"].tolist() == [0.0, 0.5]
  assert d.arrays["top_k"].tolist() == [5, 0] and d.arrays["top_p"].tolist() == [
      1.0, np.float32(0.9)]
  assert d.key_data.tolist() == [[3, 4], [3, 4]]
  assert d.eos.tolist() == [[1, 2, 3, -1], [-1, -1, -1, -1]]
  greedy = make()
  greedy.submit(0, [Request([1], max_new_tokens=2, temperature=0, top_k=5)], KEY)
  assert greedy.sampling_mode() == (False, 1)     # filters do not apply when greedy


def test_a_sample_waits_for_pages_and_one_that_can_never_fit_raises():
  # 5 pages: a sample of request 0 needs 1 + 3 = 4, so the second waits for the first.
  sched = make(num_pages=5, max_len=16)
  sched.submit(0, [Request([1, 2], n=2, max_new_tokens=10)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  assert slots(sched) == [(0, 0, 0), None, None, None] and list(sched.queue) == [(0, 0, 1)]
  assert sched.pool.available == 1 and sched.groups[(0, 0, 0)].waiting == 1
  assert plan.decode.exit_after == 1               # return as soon as a slot frees
  sched.apply(plan, output([[3] * 10]))
  plan = sched.schedule(n_eos=1, version=0)
  assert slots(sched) == [(0, 0, 1), None, None, None] and not sched.queue
  # Its group's prompt was prefilled with the first sample: admitted without a prefill.
  assert plan.admissions[0].prefill == () and plan.admissions[0].batches == ()
  assert plan.admissions[0].admits[0].src == 0      # page 0 kept for its copy ...
  assert plan.admissions[0].admits[0].dst == 2      # ... into a freed page (1, 2 back)
  whole_pool = make(num_pages=3)
  whole_pool.submit(0, [Request([1, 2], max_new_tokens=12)], KEY)
  with pytest.raises(RuntimeError, match="no sample could be admitted"):
    whole_pool.schedule(n_eos=1, version=0)


def test_prefill_ahead_uses_the_free_rows_of_the_last_call():
  sched = make(max_slots=1, prefill_rows=4, prefill_chunk=4, num_pages=16)
  sched.submit(0, [Request([1, 2, 3], max_new_tokens=4),
                   Request([4, 5, 6, 7, 8], max_new_tokens=4),
                   Request([9], max_new_tokens=4)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  (admission,) = plan.admissions
  # Request 0 takes 1 row of 4; requests 1 (2 rows) and 2 (1 row) fill the other 3.
  assert admission.prefill == ((0, 0, 0), (0, 1, 0), (0, 2, 0)) and admission.ahead == 2
  (batch,) = admission.batches
  assert batch.padded == 0 and batch.ends == ((0, 0), (2, 1), (3, 2))
  assert batch.positions[:, 0].tolist() == [0, 0, 4, 0]
  assert sched.groups[(0, 1, 0)].pages == [2, 3] and sched.groups[(0, 2, 0)].pages == [4]
  sched.apply(plan, output([[1, 1, 1, 1]]))
  plan = sched.schedule(n_eos=1, version=0)
  assert plan.admissions[0].prefill == () and plan.admissions[0].admits[0].group == (0, 1, 0)


def test_a_budget_cuts_the_call_and_leaves_samples_in_flight():
  sched = make(max_slots=2)
  sched.submit(0, [Request([1, 2, 3], n=2, max_new_tokens=6)], KEY)
  plan = sched.schedule(n_eos=1, version=0, budget_left=3)
  assert plan.decode.limit == 2                       # ceil(3 / 2 live slots)
  generated, done = sched.apply(plan, output([[5, 6], [7, 8]]))
  assert (generated, done) == (4, [])
  assert sched.end_call() and sched.in_flight == 2    # call 0's requests kept
  sched.submit(1, [Request([9], max_new_tokens=2)], KEY)
  assert list(sched.queue) == [(1, 0, 0)] and sched.has_cache()
  plan = sched.schedule(n_eos=1, version=1)
  assert plan.admissions == () and plan.decode.arrays["position"].tolist() == [5, 5]
  generated, done = sched.apply(plan, output([[1, 1, 1, 1], [2, 2, 2, 2]]))
  assert [c.versions.tolist() for _, c in done] == [[0, 0, 1, 1, 1, 1]] * 2
  plan = sched.schedule(n_eos=1, version=1)
  assert [a.slot for a in plan.admissions[0].admits] == [0]
  sched.apply(plan, output([[3, 3]]))
  assert not sched.end_call() and sched.requests == {} and sched.key_data == {}


def test_the_recompute_plan_prefills_prompts_and_each_slots_own_part():
  sched = make(max_slots=2, prefill_chunk=4)
  sched.submit(0, [Request([1, 2, 3, 4, 5], n=3, max_new_tokens=6)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  sched.apply(plan, output([[6, 7], [8, 9]]))
  # Two samples in slots (7 tokens in the cache each), the third waits: its group keeps
  # the whole prompt (and its logits); each slot recomputes from its first own page.
  re = sched.recompute()
  assert re.owners == ((0, 0, 0),) and re.tail_slots == (0, 1) and re.tokens == 5 + 3 + 3
  assert [b.tokens.shape for b in re.prompt_batches] == [(2, 4), (2, 4)]
  (tails,) = re.tail_batches
  assert tails.tokens[:, :3].tolist() == [[5, 6, 7], [5, 8, 9]]
  assert tails.positions[:, :4].tolist() == [[4, 5, 6, -1], [4, 5, 6, -1]]
  assert tails.table.tolist() == [[0, 2, 4, 0], [0, 3, 5, 0]] and tails.ends == ((0, 0), (1, 1))
  # Once every sample is in, a prompt's full pages are recomputed once, without owner.
  done = make(max_slots=2, prefill_chunk=4)
  done.submit(0, [Request([1, 2, 3, 4, 5], n=2, max_new_tokens=6)], KEY)
  done.apply(done.schedule(n_eos=1, version=0), output([[6], [7]]))
  re = done.recompute()
  assert re.owners == (None,) and re.prompt_batches[0].tokens[0].tolist() == [1, 2, 3, 4]
  assert re.tokens == 4 + 2 + 2


def test_prefill_packing_shapes():
  jobs = [(np.arange(1, 10), 0, [0, 1, 2]), (np.arange(1, 3), 5, [3, 4])]
  packed = pack_prefill(jobs, rows=2, chunk=4, width=3)
  assert [b.tokens.shape for b in packed] == [(2, 4), (2, 4)]
  assert [b.ends for b in packed] == [(), ((0, 0), (1, 1))]
  assert [b.padded for b in packed] == [0, 0]
  assert packed[1].positions.tolist() == [[8, -1, -1, -1], [5, 6, -1, -1]]
  shrunk = shrink_prefill(jobs, max_rows=16, chunk=4, width=3)
  assert [b.tokens.shape for b in shrunk] == [(4, 4), (1, 4), (1, 4)]
  assert [b.ends for b in shrunk] == [((1, 1),), (), ((0, 0),)]
  assert shrunk[2].positions[0].tolist() == [8, -1, -1, -1]
  assert shrink_prefill([(np.arange(1, 3), 0, [0])] * 5, 16, 4, 1)[0].tokens.shape == (16, 4)


# ----------------------------------------------------------------- the prefix cache


def run_alone(sched: Scheduler, call: int, request: Request, tokens: list[int]):
  """Submits ``request`` and decodes it to ``tokens`` (one slot free, no budget);
  returns the call's admissions and its completion."""
  sched.submit(call, [request], KEY)
  admissions, done = [], []
  while sched.has_work():
    plan = sched.schedule(n_eos=1, version=0)
    admissions += plan.admissions
    slot = sched.slots[plan.decode.slots[0]]
    _, finished = sched.apply(plan, output([tokens[len(slot.tokens):][:4]]))
    done += finished
  sched.end_call()
  return admissions, done[0][1]


def test_prefix_cache_keeps_full_pages_and_a_continuation_prefills_only_the_rest():
  sched = make(prefix_cache=True, max_len=20)
  sched.set_cache_key((0, 1))
  # 6 prompt + 5 generated tokens; the last one was never fed: 10 in the cache, so the
  # 2 full pages (0: tokens 0-3, the shared prompt page; 2: 4-7, the slot's own copy of
  # the prompt's partial page) stay cached, one reference each; page 1 is free again.
  (admission,), first = run_alone(sched, 0, Request([1, 2, 3, 4, 5, 6], max_new_tokens=5),
                                  [7, 8, 9, 10, 11])
  assert (admission.prefill_tokens, admission.reused_tokens, admission.hits) == (6, 0, 0)
  assert first.tokens.tolist() == [7, 8, 9, 10, 11] and first.cached_tokens == 0
  assert len(sched.cache) == 2 and sched.pool.refs[:4].tolist() == [1, 0, 1, 0]
  # The next turn: the sequence, then [12, 13]. Its first 8 tokens are cached (the
  # third block [9 10 11 12] is not: only 10 tokens were); 5 are prefilled at 8..12.
  sched.submit(1, [Request(list(range(1, 14)), max_new_tokens=3)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  (admission,) = plan.admissions
  assert (admission.prefill_tokens, admission.reused_tokens, admission.hits) == (5, 8, 1)
  (batch,) = admission.batches
  assert batch.tokens[0, :6].tolist() == [9, 10, 11, 12, 13, 0]
  assert batch.positions[0, :6].tolist() == [8, 9, 10, 11, 12, -1]
  assert batch.table.tolist() == [[0, 2, 1, 3, 0]]        # cached pages first
  # Cached pages 0 and 2: the cache's reference and the slot's; page 3 (the prompt's
  # partial page) went back once copied to the slot's page 4.
  assert sched.slots[0].shared == [0, 2, 1] and sched.slots[0].own == [4]
  assert sched.pool.refs[:6].tolist() == [2, 1, 2, 0, 1, 0]
  _, done = sched.apply(plan, output([[14, 15, 16]]))
  assert done[0][1].cached_tokens == 8
  # 13 + 3 - 1 = 15 tokens in the cache: 3 full pages, the first two already there.
  assert len(sched.cache) == 3 and sched.pool.in_use == 3
  assert sched.pool.refs[:6].tolist() == [1, 1, 1, 0, 0, 0]
  # At least the prompt's last token is prefilled (its logits start the turn), even
  # when every full page of it is cached.
  sched.submit(2, [Request(list(range(1, 9)), max_new_tokens=2)], KEY)
  (admission,) = sched.schedule(n_eos=1, version=0).admissions
  assert (admission.prefill_tokens, admission.reused_tokens) == (4, 4)


def test_prefix_cache_off_reuses_nothing_and_keeps_no_pages():
  sched = make(max_len=20)
  assert sched.cache is None and sched.set_cache_key((0, 1)) == 0
  (admission,), _ = run_alone(sched, 0, Request([1, 2, 3, 4, 5, 6], max_new_tokens=5),
                              [7, 8, 9, 10, 11])
  sched.submit(1, [Request(list(range(1, 14)), max_new_tokens=3)], KEY)
  (again,) = sched.schedule(n_eos=1, version=0).admissions
  assert (admission.prefill_tokens, again.prefill_tokens, again.reused_tokens) == (6, 13, 0)
  assert sched.pool.refs[:5].tolist() == [1, 1, 1, 0, 1]   # the new prompt's pages only


def test_prefix_cache_tree_refcounts_and_least_recently_used_eviction():
  pool = PagePool(10)
  cache = PrefixCache(pool, page_size=2)
  x, y = pool.allocate(3), pool.allocate(2)                 # pages 0-2 and 3-4
  assert cache.insert(np.array([1, 2, 3, 4, 5, 6]), x) == 3
  # y's first block [1 2] is cached already (page 0): its page 3 is not taken.
  assert cache.insert(np.array([1, 2, 7, 8]), y) == 1
  pool.decref(x + y)
  assert pool.refs[:5].tolist() == [1, 1, 1, 0, 1] and len(cache) == 4
  # Lookups compare ids, block by block, up to `limit` blocks.
  assert cache.match(np.array([1, 2, 3, 4, 9]), limit=2) == [0, 1]
  assert cache.match(np.array([1, 2, 7, 8]), limit=1) == [0]
  assert cache.match(np.array([2, 1, 3, 4]), limit=2) == []
  # Recency, least recent first: [5 6] (x's insert), [7 8] (y's insert), then the
  # matched path [3 4], [1 2] (a path's tail before its head). A page someone else
  # reads is never evicted, nor one with cached children.
  pool.incref([1])
  assert cache.evict(4) == 2 and pool.refs[:5].tolist() == [1, 2, 0, 0, 0]
  assert cache.evictions == 2
  pool.decref([1])
  assert cache.evict(1) == 1 and cache.match(np.array([1, 2, 3, 4]), limit=2) == [0]
  assert cache.clear() == 1 and pool.in_use == 0 and len(cache) == 0


def test_a_full_pool_evicts_cached_pages_before_refusing_admission():
  # 6 pages. A: 4 prompt + 9 generated tokens, 12 in the cache: 3 pages stay cached.
  # B (unrelated) needs 2 prompt pages + 2 own = 4 > the 3 free: without a cache it
  # runs at once, so with one it must too: A's least recent page (its tail) goes.
  outs = {}
  for cached in (False, True):
    sched = make(num_pages=6, prefix_cache=cached)
    run_alone(sched, 0, Request([1, 2, 3, 4], max_new_tokens=9), list(range(5, 14)))
    assert sched.pool.in_use == (3 if cached else 0)
    sched.submit(1, [Request([20, 21, 22, 23, 24], max_new_tokens=8)], KEY)
    plan = sched.schedule(n_eos=1, version=0)
    outs[cached] = [a.slot for adm in plan.admissions for a in adm.admits]
    if cached:
      assert sched.cache.evictions == 1 and len(sched.cache) == 2
      # 2 cached + B's shared page and its 2 own; its prompt's partial page, copied,
      # is free again.
      assert sched.pool.in_use == 5 and sched.pool.available == 1
  assert outs == {False: [0], True: [0]}
  # What is left of A is still found: its first 8 tokens.
  sched.apply(plan, output([[30] * 4]))
  sched.apply(sched.schedule(n_eos=1, version=0), output([[31] * 4]))
  sched.end_call()
  sched.submit(2, [Request(list(range(1, 12)), max_new_tokens=2)], KEY)
  (admission,) = sched.schedule(n_eos=1, version=0).admissions
  assert admission.reused_tokens == 8


def test_eviction_keeps_the_cached_prefixes_of_waiting_prompts_for_last():
  # One slot, 8 pages. B then A leave 2 cached pages each (B's are the least recent).
  # X (5 pages) and B's next turn wait; X goes first and needs 1 page more than the 4
  # free: A's tail goes, not B's, which B's next turn is about to read.
  sched = make(max_slots=1, num_pages=8, prefix_cache=True)
  run_alone(sched, 0, Request([21, 22, 23, 24], max_new_tokens=5), [5, 6, 7, 8, 9])
  run_alone(sched, 1, Request([1, 2, 3, 4], max_new_tokens=5), [5, 6, 7, 8, 9])
  b_next = [21, 22, 23, 24, 5, 6, 7, 8, 9, 30]
  sched.submit(2, [Request([40, 41, 42, 43, 44], max_new_tokens=10),
                   Request(b_next, max_new_tokens=2)], KEY)
  plan = sched.schedule(n_eos=1, version=0)
  assert sched.cache.evictions == 1 and plan.admissions[0].admits[0].group == (2, 0, 0)
  assert sched.cache.match(np.array([1, 2, 3, 4, 5, 6, 7, 8]), 2, touch=False) == [2]
  for _ in range(3):
    sched.apply(plan, output([[50] * 4]))
    plan = sched.schedule(n_eos=1, version=0)
  assert plan.admissions[0].reused_tokens == 8 and plan.admissions[0].prefill_tokens == 2
  # The cache alone: kept paths go last, the last one first, each from its tail.
  pool = PagePool(8)
  cache = PrefixCache(pool, page_size=1)
  for seq in ([1, 2], [3, 4], [5, 6]):
    pages = pool.allocate(2)
    cache.insert(np.array(seq), pages)
    pool.decref(pages)
  assert cache.evict(3, keep=[[0, 1], [4, 5]]) == 3
  assert (cache.match(np.array([1, 2]), 2), cache.match(np.array([3, 4]), 2),
          cache.match(np.array([5, 6]), 2)) == ([0, 1], [], [4])


def test_prefix_cache_is_never_read_under_another_key():
  sched = make(prefix_cache=True, max_len=20)
  prompt, turn = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]
  sched.set_cache_key((0, 1))
  run_alone(sched, 0, Request(prompt, max_new_tokens=5), turn)
  assert sched.set_cache_key((0, 1)) == 0 and len(sched.cache) == 2
  # A new version (or new parameters) empties the cache; the pages go back.
  assert sched.set_cache_key((1, 1)) == 2 and len(sched.cache) == 0
  assert sched.pool.in_use == 0
  (admission,), _ = run_alone(sched, 1, Request(prompt + turn, max_new_tokens=2), [1, 2])
  assert admission.reused_tokens == 0 and len(sched.cache) == 3
  # A sample admitted under one key and finished under another is not cached (its
  # keys/values are the old parameters'), unless its cache was recomputed.
  for recompute, cached in ((False, 0), (True, 3)):
    sched.set_cache_key((2, 1))
    sched.submit(5, [Request([40, 41, 42, 43, 44, 45], max_new_tokens=8)], KEY)
    sched.apply(sched.schedule(n_eos=1, version=2), output([[1, 2, 3, 4]]))
    sched.set_cache_key((3, 1))
    if recompute:
      sched.recompute()
    sched.apply(sched.schedule(n_eos=1, version=3), output([[5, 6, 7, 8]]))
    assert not sched.has_work() and len(sched.cache) == cached
    sched.end_call()
