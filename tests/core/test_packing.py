"""Packed batches (several sequences per row, segment ids) equal their padded form.

* The packer: a hand-checked first-fit-decreasing fixture, pack/unpack round trips,
  bad input (non-contiguous segments, positions that do not restart, a sequence over
  the budget) raising ``ValueError`` naming the argument.
* Segment-aware pieces against the padded batch: attention (xla, blockwise), the
  Transformer forward, GAE (scan and associative), aggregation, GSPO/GMPO, rollout
  correction; a leak test (perturbing one segment changes no other segment's output).
* One train step, padded vs packed: per-token log-probs, values, advantages, every
  metric and the parameter update, for PPO with a value head (GAE in the step), PPO
  with GSPO + seq-mean-token-mean + sequence-level rollout correction, and GRPO
  (per-sequence advantages, k3 KL in the loss), float32. Tolerances: log-probs,
  entropies, values, advantages, returns 1e-5 absolute; metrics 1e-5 relative (1e-6
  absolute); the update of one SGD step (lr 1, i.e. the gradient) 1e-5 of its largest
  entry.
* Token-budget micro-batches: the update equals the one-chunk update.

The 8-device (``sequence`` sharding, ring attention) checks run in
``tests/packing_worker.py`` (a subprocess forcing 8 CPU devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm import aggregate, gae
from jaxrl_llm.attention import dot_product_attention
from jaxrl_llm.losses import gmpo_policy_loss, gspo_policy_loss, rollout_correction_weights
from jaxrl_llm.models.transformer import Transformer, TransformerConfig, make_apply_fn, split_model
from jaxrl_llm.packing import (
  check_segments,
  first_fit_decreasing,
  pack,
  pack_batch,
  padding_fraction,
  plan_packing,
  segment_positions,
  segment_sum,
  unpack,
)
from jaxrl_llm.train import TrainConfig, make_train_step
from jaxrl_llm.train.step import microbatch_count, policy_forward, prepare_batch
from tests.utils import run_worker, train_two_steps

VOCAB = 32


# ------------------------------------------------------------------------------ packer


def test_first_fit_decreasing_hand_fixture():
  # lengths 5 4 3 3 2 1 into bins of 7: longest first -> [5, 2], [4, 3], [3, 1]
  row, start = first_fit_decreasing([3, 5, 2, 4, 1, 3], 7)
  assert row.tolist() == [1, 0, 0, 1, 2, 2]
  assert start.tolist() == [4, 0, 5, 0, 3, 0]


def test_plan_packing_hand_fixture_and_round_trip():
  # left-padded, right-padded and holed rows: real tokens are packed in order
  mask = np.array([[0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]])
  tokens = np.array([[0, 11, 12, 13], [21, 22, 0, 0], [31, 0, 32, 33], [41, 42, 43, 44]])
  plan = plan_packing(mask, max_tokens=6)
  # lengths 3 2 3 4: 4 -> row 0; 3 (seq 0) -> row 1; 3 (seq 2) -> row 1; 2 -> row 0
  assert np.asarray(pack(plan, tokens)).tolist() == [
      [41, 42, 43, 44, 21, 22], [11, 12, 13, 31, 32, 33]]
  assert plan.segment_ids.tolist() == [[1, 1, 1, 1, 2, 2], [1, 1, 1, 2, 2, 2]]
  assert plan.positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
  assert np.asarray(unpack(plan, pack(plan, tokens))).tolist() == (tokens * mask).tolist()
  assert padding_fraction(mask) == pytest.approx(4 / 16)
  assert padding_fraction(plan.segment_ids) == 0.0


def test_plan_packing_row_multiple_and_num_rows():
  mask = np.ones((3, 4))
  assert plan_packing(mask, 8, row_multiple=4).segment_ids.shape == (4, 8)
  assert plan_packing(mask, 8, num_rows=6, row_multiple=2).num_rows == 6
  with pytest.raises(ValueError, match="num_rows"):
    plan_packing(mask, 8, num_rows=1)


def test_sequence_longer_than_budget_raises_naming_max_tokens():
  with pytest.raises(ValueError, match=r"sequence 1 has 5 tokens.*`max_tokens`=4"):
    plan_packing(np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]), max_tokens=4)
  with pytest.raises(ValueError, match="`max_tokens`"):
    first_fit_decreasing([1], 0)


def test_first_fit_decreasing_refuses_float_or_2d_lengths():
  # np.asarray(lengths, int64).reshape(-1) used to round 2.7 to 2 and flatten [[3, 2]].
  for bad in ([2.7, 1.0], [[3, 2]], [True, False], np.ones((2, 2), np.int64)):
    with pytest.raises(ValueError, match=r"^`lengths` must be a 1-D sequence of ints, got "):
      first_fit_decreasing(bad, 8)
  assert first_fit_decreasing([], 8)[0].tolist() == []
  assert first_fit_decreasing(np.array([3, 2], np.int32), 4)[0].tolist() == [0, 1]


def test_pack_batch_checks_loss_mask_and_advantages_against_attention_mask():
  mask = np.array([[1, 1, 0], [1, 1, 1]])
  good = {"tokens": np.array([[5, 6, 0], [7, 8, 9]]), "attention_mask": mask,
          "loss_mask": np.array([[0, 1, 0], [0, 1, 1]]), "advantages": np.array([1., -1.])}
  packed, _ = pack_batch(good, max_tokens=6)
  assert np.asarray(packed["loss_mask"]).tolist() == [[0, 1, 1, 0, 1, 0]]
  # A wrong shape used to pass through unpacked (a [2, 2] loss_mask beside [1, 6] rows).
  for key, value, want in (
      ("loss_mask", np.ones((2, 2)), r"batch\['loss_mask'\] must have shape \(2, 3\) "),
      ("advantages", np.ones(3), r"batch\['advantages'\] must have shape \(2, 3\) or "
                                 r"\(2,\) "),
      ("tokens", np.ones((3, 3), np.int32), r"batch\['tokens'\] must have shape")):
    with pytest.raises(ValueError, match=want):
      pack_batch({**good, key: value}, max_tokens=6)
  # A trainable token on padding would vanish in the packed batch.
  with pytest.raises(ValueError, match=r"^batch\['loss_mask'\] must be 0 where "
                     r"batch\['attention_mask'\] is 0, got 1 at \[0, 2\]\.$"):
    pack_batch({**good, "loss_mask": np.array([[0, 1, 1], [0, 1, 1]])}, max_tokens=6)


def test_check_segments_rejects_bad_layouts():
  check_segments([[1, 1, 2, 0]], [[0, 1, 0, 0]], attention_mask=[[1, 1, 1, 0]])
  with pytest.raises(ValueError, match="`segment_ids` row 0: segment 1 is not one"):
    check_segments([[1, 1, 2, 1]])
  with pytest.raises(ValueError, match="`positions` must restart"):
    check_segments([[1, 1, 2, 2]], [[0, 1, 2, 3]])
  with pytest.raises(ValueError, match="`attention_mask`"):
    check_segments([[1, 1, 2, 0]], attention_mask=[[1, 1, 1, 1]])
  with pytest.raises(ValueError, match="`segment_ids` must be"):
    check_segments([[1.0, 2.0]])


def test_segment_helpers_pinned():
  seg = jnp.array([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0]])
  assert segment_positions(seg).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 0, 0]]
  x = jnp.arange(12.0).reshape(2, 6)
  assert segment_sum(x, seg).tolist() == [[1, 1, 9, 9, 9, 5], [6, 7, 17, 17, 21, 21]]
  assert segment_sum(x, None).tolist() == [[15.0], [51.0]]


def test_attention_segment_ids_bad_shape_raises_naming_argument():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="`segment_ids` must have shape"):
    dot_product_attention(q, q, q, segment_ids=jnp.ones((1, 3), jnp.int32))
  with pytest.raises(ValueError, match="`segment_ids` must be an integer"):
    dot_product_attention(q, q, q, segment_ids=jnp.ones((1, 4)))


# ----------------------------------------------------------------- random padded batch


def _padded(seed, n=6, width=14, max_prompt=3):
  """A padded batch of ``n`` (prompt, completion) rows, some left-padded."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((n, width), np.int32)
  loss = np.zeros((n, width), np.float32)
  for i in range(n):
    p = int(rng.integers(1, max_prompt + 1))
    c = int(rng.integers(1, width - p + 1))
    off = int(rng.integers(0, width - p - c + 1)) if i % 2 else 0   # odd rows left-padded
    mask[i, off:off + p + c] = 1
    loss[i, off + p:off + p + c] = 1
  tokens = rng.integers(1, VOCAB, (n, width)).astype(np.int32) * mask
  return rng, tokens, mask, loss


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_attention_packed_equals_each_sequence_alone(impl):
  rng = np.random.default_rng(0)
  seg = np.array([[1] * 5 + [2] * 9 + [3] * 3 + [0] * 2, [1] * 19], np.int32)
  q, k, val = (jnp.asarray(rng.normal(size=(2, 19, h, 8)), jnp.float32)
               for h in (4, 2, 2))
  out = dot_product_attention(q, k, val, segment_ids=jnp.asarray(seg), implementation=impl,
                              block_size=8)
  for r in range(2):
    for s in (1, 2, 3):
      idx = np.nonzero(seg[r] == s)[0]
      if idx.size:
        alone = dot_product_attention(q[r:r + 1, idx], k[r:r + 1, idx], val[r:r + 1, idx],
                                      implementation="xla")
        np.testing.assert_allclose(out[r:r + 1, idx], alone, atol=1e-6)
  np.testing.assert_array_equal(out[0, -2:], 0.0)    # padding sees no key


def test_blockwise_block_bounds_of_packed_rows_pinned():
  from jaxrl_llm.attention import _segment_block_bounds, _segment_runs
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3], [1, 1, 2, 2, 0, 0, 0, 0]])
  first, last = _segment_runs(seg)
  assert first.tolist() == [[0, 0, 0, 3, 3, 3, 3, 7], [0, 0, 2, 2, 4, 4, 4, 4]]
  assert last.tolist() == [[2, 2, 2, 6, 6, 6, 6, 7], [1, 1, 3, 3, 7, 7, 7, 7]]
  # Blocks of 2: query block i needs key blocks [q_lo, q_hi); key block j is seen by
  # query blocks [k_lo, k_hi) (min / max over the rows; padding runs count, harmlessly).
  q_lo, q_hi, k_lo, k_hi = _segment_block_bounds(seg, 2, 2, 8, 8)
  assert (q_lo.tolist(), q_hi.tolist()) == ([0, 0, 1, 1], [2, 4, 4, 4])
  assert (k_lo.tolist(), k_hi.tolist()) == ([0, 0, 1, 1], [2, 4, 4, 4])
  # Query blocks of 4, key blocks of 2 (row 0 alone): block 0 (segments 1, 2) needs key
  # blocks 0-3, block 1 (2, 3) blocks 1-3; key block 0 (segment 1) is seen by block 0.
  assert [b.tolist() for b in _segment_block_bounds(seg[:1], 4, 2, 8, 8)] == [
      [0, 1], [4, 4], [0, 0, 0, 0], [1, 2, 2, 2]]
  # Padded blocks (T=7 in blocks of 4) hold no position and bound nothing beyond T.
  assert [b.tolist() for b in _segment_block_bounds(seg[:, :7], 4, 4, 8, 8)] == [
      [0, 0], [2, 2], [0, 0], [2, 2]]


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_skips_other_segments_blocks_bit_identically(causal, monkeypatch):
  """Self-attention over packed rows visits only its segments' key blocks (forward) and
  query blocks (backward): outputs and gradients equal, bit for bit, the computation
  that visits every block and masks (explicit key ids turn the skipping off)."""
  import jaxrl_llm.attention as attention
  rng = np.random.default_rng(3)
  seg = np.zeros((2, 61), np.int32)
  for r in range(2):
    pos, sid = 0, 1
    while pos < 56:
      n = int(rng.integers(1, 20))
      seg[r, pos:pos + n], pos, sid = sid, pos + n, sid + 1
  seg = jnp.asarray(seg)
  q, k, val = (jnp.asarray(rng.normal(size=(2, 61, h, 8)), jnp.float32) for h in (4, 2, 2))
  used = []
  bounds = attention._segment_block_bounds
  monkeypatch.setattr(attention, "_segment_block_bounds",
                      lambda *a: used.append(a[1:3]) or bounds(*a))

  def attend(q, k, val, keys):
    return dot_product_attention(q, k, val, is_causal=causal, implementation="blockwise",
                                 block_size=(16, 8), segment_ids=seg, key_segment_ids=keys)

  def loss(q, k, val, keys):
    return (attend(q, k, val, keys) ** 2).sum()

  skipped = attend(q, k, val, None)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, val, None)
  assert used == [(16, 8), (16, 8)]                     # forward, and inside grad
  masked = attend(q, k, val, seg + 0)
  masked_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, val, seg + 0)
  assert used == [(16, 8), (16, 8)]                     # other key ids: no skipping
  np.testing.assert_array_equal(skipped, masked)
  for a, b in zip(grads, masked_grads):
    np.testing.assert_array_equal(a, b)
  xla = dot_product_attention(q, k, val, is_causal=causal, implementation="xla",
                              segment_ids=seg)
  np.testing.assert_allclose(skipped, xla, atol=1e-6)


@pytest.fixture(scope="module")
def model():
  config = TransformerConfig.tiny(VOCAB, attention="xla")
  graphdef, params = split_model(Transformer(config, rngs=nnx.Rngs(0)))
  return graphdef, params


def test_forward_packed_equals_padded_and_blockwise(model):
  graphdef, params = model
  _, tokens, mask, _ = _padded(1)
  plan = plan_packing(mask, 20)
  h, val, _ = make_apply_fn(graphdef)(params, tokens, None, mask)
  for impl in ("xla", "blockwise"):
    g = nnx.graphdef(nnx.merge(graphdef, params))
    m = nnx.merge(g, params)
    for block in m.blocks:
      block.attn.implementation, block.attn.block_size = impl, 8
    g2, p2 = split_model(m)
    hp, vp, _ = make_apply_fn(g2)(p2, pack(plan, tokens), jnp.asarray(plan.positions), None,
                                  jnp.asarray(plan.segment_ids))
    np.testing.assert_allclose(unpack(plan, hp), h, atol=1e-5)
    np.testing.assert_allclose(unpack(plan, vp), val, atol=1e-5)


def test_no_leak_across_segments(model):
  graphdef, params = model
  _, tokens, mask, _ = _padded(2)
  plan = plan_packing(mask, 30)
  apply = make_apply_fn(graphdef)
  packed = np.asarray(pack(plan, tokens))
  seg = plan.segment_ids
  row = int(np.argmax(seg.max(axis=1)))            # a row with several segments
  assert seg[row].max() >= 2
  changed = packed.copy()
  target = seg[row] == 1
  changed[row, target] = (changed[row, target] + 7) % VOCAB
  batch = {"tokens": None, "attention_mask": jnp.asarray(seg > 0),
           "segment_ids": jnp.asarray(seg)}
  outs = []
  for toks in (packed, changed):
    h, val, _ = apply(params, jnp.asarray(toks), None, None, jnp.asarray(seg))
    logp, ent, _ = policy_forward(apply, params, {**batch, "tokens": jnp.asarray(toks)})
    outs.append((h, val, logp, ent))
  others = seg > 0
  others[row] &= seg[row] != 1
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a)[others], np.asarray(b)[others])
  assert not np.allclose(np.asarray(outs[0][0])[row, target],
                         np.asarray(outs[1][0])[row, target])


# ------------------------------------------------------------------ pure functions


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_gae_packed_equals_padded(method):
  rng, _, mask, loss = _padded(3, n=8, width=12)
  r = rng.normal(size=mask.shape).astype(np.float32)
  val = rng.normal(size=mask.shape).astype(np.float32)
  plan = plan_packing(mask, 16)
  adv, ret = gae(r, val, loss, gamma=0.9, lam=0.8, method=method)
  adv_p, ret_p = gae(pack(plan, r), pack(plan, val), pack(plan, loss), gamma=0.9, lam=0.8,
                     method=method, segment_ids=plan.segment_ids)
  np.testing.assert_allclose(unpack(plan, adv_p), adv, atol=1e-6)
  np.testing.assert_allclose(unpack(plan, ret_p), ret, atol=1e-6)
  with pytest.raises(ValueError, match="`bootstrap_value`"):
    gae(r, val, loss, segment_ids=np.ones(mask.shape, np.int32),
        bootstrap_value=np.zeros(mask.shape[0]))


def test_gae_segment_boundary_is_terminal_hand_fixture():
  # Two one-token-prompt sequences in one row; the first's last value must not bootstrap
  # from the second's: A = r - V at each sequence's last token (gamma = lam = 1).
  r = jnp.array([[0.0, 1.0, 0.0, 0.0, 2.0]])
  val = jnp.array([[0.0, 0.5, 0.0, 0.25, 0.75]])
  mask = jnp.array([[0, 1, 0, 1, 1]])
  seg = jnp.array([[1, 1, 2, 2, 2]])
  adv, _ = gae(r, val, mask, segment_ids=seg)
  assert adv.tolist() == [[0.0, 0.5, 0.0, 1.75, 1.25]]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregate_packed_equals_padded(mode):
  rng, _, mask, loss = _padded(4)
  x = rng.normal(size=mask.shape).astype(np.float32)
  plan = plan_packing(mask, 20)
  want = aggregate(x, loss, mode, norm_length=14.0)
  got = aggregate(pack(plan, x), pack(plan, loss), mode, norm_length=14.0,
                  segment_ids=plan.segment_ids)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_sequence_level_losses_packed_equal_padded():
  rng, _, mask, loss = _padded(5)
  logp = (rng.normal(size=mask.shape) * 0.1).astype(np.float32)
  old = (rng.normal(size=mask.shape) * 0.1).astype(np.float32)
  adv = np.repeat(rng.normal(size=(mask.shape[0], 1)), mask.shape[1], 1).astype(np.float32)
  plan = plan_packing(mask, 20)
  seg = plan.segment_ids
  for fn in (gspo_policy_loss, gmpo_policy_loss):
    want, wm = fn(logp, old, adv, loss)
    got, gm = fn(pack(plan, logp), pack(plan, old), pack(plan, adv), pack(plan, loss),
                 segment_ids=seg)
    np.testing.assert_allclose(unpack(plan, got), want, atol=1e-6)
    for k in wm:
      np.testing.assert_allclose(gm[k], wm[k], rtol=1e-5, atol=1e-7)
  want, _ = rollout_correction_weights(logp - old, loss, level="sequence")
  got, _ = rollout_correction_weights(pack(plan, logp - old), pack(plan, loss),
                                      level="sequence", segment_ids=seg)
  np.testing.assert_allclose(unpack(plan, got), want, atol=1e-6)


# --------------------------------------------------------------------- train step


def _step_batch(seed, graphdef, params, *, grpo):
  rng, tokens, mask, loss = _padded(seed, n=8, width=14)
  apply = make_apply_fn(graphdef)
  logp, _, values = policy_forward(apply, params, {"tokens": tokens, "attention_mask": mask})
  batch = {"tokens": tokens, "attention_mask": mask, "loss_mask": loss,
           "old_logp": np.asarray(logp + 0.05 * rng.normal(size=mask.shape) * loss,
                                  np.float32)}
  if grpo:
    batch["advantages"] = rng.normal(size=(mask.shape[0],)).astype(np.float32)
    batch["ref_logp"] = np.asarray(logp - 0.03 * loss, np.float32)
  else:
    rewards = np.zeros(mask.shape, np.float32)
    last = mask.shape[1] - 1 - np.argmax(loss[:, ::-1], axis=1)
    rewards[np.arange(mask.shape[0]), last] = rng.normal(size=mask.shape[0])
    batch["rewards"] = rewards
    batch["old_values"] = np.asarray(values + 0.1 * rng.normal(size=mask.shape) * loss,
                                     np.float32)
  return batch


CASES = {
    "ppo_value_head": dict(grpo=False, config=TrainConfig(gamma=0.95, lam=0.9)),
    "ppo_seq_mean_gspo": dict(grpo=False, config=TrainConfig(
        policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", lam=0.9,
        rollout_correction="sequence")),
    "grpo": dict(grpo=True, config=TrainConfig(
        use_value=False, whiten_advantages=False, kl_mode="loss", kl_coef=0.1,
        kl_kind="k3")),
}


def _run_step(graphdef, params, config, batch):
  """``(update, metrics)`` of one step with SGD (lr 1): the update is minus the
  gradient. (Adam's first step, ``g / (|g| + eps)``, would turn rounding-level
  differences of near-zero gradient entries into differences of order lr.)"""
  apply = make_apply_fn(graphdef)
  step = make_train_step(apply, optax.sgd(1.0), config)
  state = step.init(params)
  new_state, metrics = jax.jit(step)(state, batch)
  return jax.tree_util.tree_map(jnp.subtract, new_state.params, params), metrics


def _assert_same_update(got, want):
  """Every leaf of the update agrees to 1e-5 of the largest entry of the update."""
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(want))
  assert scale > 0
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(b, a, atol=1e-5 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_train_step_packed_equals_padded(model, case):
  graphdef, params = model
  spec = CASES[case]
  config = spec["config"]
  batch = _step_batch(7, graphdef, params, grpo=spec["grpo"])
  if config.rollout_correction is not None:
    batch["rollout_logp"] = batch["old_logp"] - 0.02 * batch["loss_mask"]
  packed, plan = pack_batch(batch, max_tokens=24, row_multiple=2)
  check_segments(plan.segment_ids, plan.positions, attention_mask=packed["attention_mask"])
  assert packed["tokens"].shape[0] < batch["tokens"].shape[0]
  apply = make_apply_fn(graphdef)

  # per-token log-probs, values and the step's advantages, on trainable tokens
  lp, ent, val = policy_forward(apply, params, batch)
  lp_p, ent_p, val_p = policy_forward(apply, params, packed)
  on = batch["loss_mask"] > 0
  for a, b in ((lp, lp_p), (ent, ent_p)) + (((val, val_p),) if val is not None else ()):
    np.testing.assert_allclose(np.asarray(unpack(plan, b))[on], np.asarray(a)[on],
                               atol=1e-5)
  state = make_train_step(apply, optax.adam(1e-3), config).init(params)
  adv = prepare_batch(batch, state, config)
  adv_p = prepare_batch(packed, state, config)
  for key in ("advantages",) + (("returns",) if config.use_value else ()):
    np.testing.assert_allclose(unpack(plan, adv_p[key]), adv[key], atol=1e-5)

  new, metrics = _run_step(graphdef, params, config, batch)
  new_p, metrics_p = _run_step(graphdef, params, config, packed)
  assert sorted(metrics) == sorted(metrics_p)
  for k in metrics:
    np.testing.assert_allclose(metrics_p[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert float(metrics["skipped"]) == 0.0
  _assert_same_update(new_p, new)


@pytest.mark.slow
def test_token_budget_microbatches_are_exact(model):
  graphdef, params = model
  batch = _step_batch(8, graphdef, params, grpo=False)
  packed, _ = pack_batch(batch, max_tokens=16, row_multiple=4)
  config = TrainConfig(lam=0.9)
  chunked = dataclasses.replace(config, max_tokens_per_microbatch=40)
  rows = packed["tokens"].shape[0]
  assert microbatch_count(rows, 16, chunked) == rows // 2
  new, metrics = _run_step(graphdef, params, config, packed)
  new_c, metrics_c = _run_step(graphdef, params, chunked, packed)
  for k in metrics:
    np.testing.assert_allclose(metrics_c[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  _assert_same_update(new_c, new)
  with pytest.raises(ValueError, match="max_tokens_per_microbatch=8"):
    microbatch_count(4, 16, dataclasses.replace(config, max_tokens_per_microbatch=8))


def test_packed_batch_rejects_per_row_advantages(model):
  graphdef, params = model
  batch = _step_batch(9, graphdef, params, grpo=True)
  packed, _ = pack_batch(batch, max_tokens=24)
  packed["advantages"] = jnp.zeros(packed["tokens"].shape[:1])
  config = TrainConfig(use_value=False, whiten_advantages=False)
  step = make_train_step(make_apply_fn(graphdef), optax.sgd(0.1), config)
  with pytest.raises(ValueError, match=r"batch\['advantages'\].*per token"):
    step(step.init(params), packed)


# ------------------------------------------------------------------ 8 forced devices


@pytest.fixture(scope="module")
def multi():
  """Runs tests/packing_worker.py once on 8 forced CPU devices; returns its JSON."""
  return run_worker("packing_worker")


def _on_8_devices(test):
  return pytest.mark.slow(pytest.mark.xdist_group("packing_worker_8_devices")(test))


@_on_8_devices
@pytest.mark.parametrize("case", ["seq8/zigzag", "seq8/contiguous", "data2_seq4/zigzag",
                                  "data2_seq4/contiguous"])
def test_ring_attention_with_segments_equals_single_device(multi, case):
  assert "ring" not in multi["errors"], multi["errors"]["ring"]
  r = multi["ring"][case]
  assert r["value_diff"] < 2e-5, r
  assert r["grad_diff"] < 2e-5 * max(1.0, r["grad_scale"]), r


@_on_8_devices
@pytest.mark.parametrize("case", ["ppo/seq8", "grpo/data2_seq4"])
def test_sequence_sharded_packed_step_equals_padded_single_device(multi, case):
  """Packed rows over a `sequence` mesh (ring attention with segment ids in the model)
  give the padded single-device update: parameters to 1e-5 (SGD with momentum, lr 0.5),
  every metric to 1e-5."""
  assert "step" not in multi["errors"], multi["errors"]["step"]
  r = multi["step"][case]
  assert r["ring_with_segments"], r
  assert r["param_diff"] < 1e-5, r
  assert max(r["metric_diff"].values()) < 1e-5, r
  assert r["rows"][1] < r["rows"][0], r


# ------------------------------------------------------------------------ the loop


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_trainer_pack_flag_trains_like_padded(algo, tmp_path):
  """``jaxrl-llm train --pack``: the first step (same rollout) reports the padded run's
  loss terms on half as many rows, and the padding fractions are reported."""
  flags = ("--algo", algo, "--task", "countdown")
  padded = train_two_steps(str(tmp_path / "padded"), *flags)
  packed = train_two_steps(str(tmp_path / "packed"), *flags, "--pack", "--pack-tokens",
                           "64")
  assert padded[1]["reward"] == packed[1]["reward"]
  for key in ("loss", "pg_loss", "entropy", "grad_norm", "approx_kl"):
    np.testing.assert_allclose(packed[1][key], padded[1][key], rtol=1e-4, atol=1e-6,
                               err_msg=key)
  assert packed[1]["packed_rows"] <= 4
  assert 0 <= packed[1]["padding_frac"] < 1 and 0 <= packed[1]["padding_frac_packed"] < 1
  assert "padding_frac" not in padded[1]
