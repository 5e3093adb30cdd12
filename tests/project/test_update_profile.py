"""The batch and FLOP bookkeeping of ``benchmarks/update_profile.py`` (the timed runs
need the SmolLM2 file and minutes; see benchmarks/RESULTS.md)."""

import types

import numpy as np

from benchmarks.update_profile import make_batch, matmul_flops


def test_make_batch_has_the_loops_layout():
  b = make_batch(6, prompt_width=5, prompt_min=3, new_tokens=4, vocab=50)
  attn, loss = b["attention_mask"], b["loss_mask"]
  assert b["tokens"].shape == attn.shape == loss.shape == (6, 9)
  assert not loss[:, :5].any() and loss[:, 5:].sum(1).min() >= 2    # responses from col 5
  prompt = attn[:, :5]
  assert np.all(np.diff(prompt, axis=1) >= 0)                        # left padded
  assert prompt.sum(1).min() >= 3 and prompt.sum(1).max() <= 5
  np.testing.assert_array_equal(attn[:, 5:], loss[:, 5:])            # right padded
  assert np.all(b["tokens"][attn == 0] == 0) and b["advantages"].shape == (6,)


def test_matmul_flops_by_hand():
  cfg = types.SimpleNamespace(d_model=4, d_ff=8, n_layers=2, head_dim=None, n_heads=2,
                              n_kv_heads=1, vocab_size=10)
  f = matmul_flops(cfg, rows=1, width=3, head_positions=2)
  # q 4x4, k and v 4x2 each, o 4x4: 48 multiply-adds a token and layer
  assert f["attn_proj"] == 2 * 3 * 2 * 48
  assert f["mlp"] == 2 * 3 * 2 * 3 * 4 * 8
  assert f["attn_scores"] == 2 * 2 * 1 * 2 * 2 * 3 * 3 * 2
  assert f["lm_head"] == 2 * 2 * 4 * 10


def test_the_timed_parts_run_at_tiny_sizes():
  """The LM-head and optimizer timings (``_common.timeit``) run end to end on a
  64-token vocabulary: one figure each, in seconds."""
  import jax
  import jax.numpy as jnp
  import optax

  import benchmarks.update_profile as bench
  from jaxrl_llm.logprobs import token_logprobs_from_hidden
  params = {"emb": jnp.ones((64, 16))}
  cfg = types.SimpleNamespace(vocab_size=64, d_model=16)
  head = bench._lm_head_times(jax, token_logprobs_from_hidden, params, 2, 8, 4, cfg, 2)
  assert sorted(head) == ["lm_head_fwd_bwd_s_all", "lm_head_fwd_bwd_s_response"]
  assert all(t >= 0.0 for t in head.values())
  assert bench._optimizer_time(jax, optax.adam(1e-3), params, 2) >= 0.0
