"""Inputs and references shared by tests/parallel/test_ring.py and tests/ring_worker.py.

Nothing here imports jax at module level: the worker must set ``XLA_FLAGS`` first.
"""

from __future__ import annotations

import functools

import numpy as np

from tests import parallel_setup
from tests.parallel_setup import flat_params, max_abs_diff  # noqa: F401  (re-exported)

# Attention: B rows, T tokens (divisible by 8), N query heads over K key/value heads.
B, T, N, K, H = 4, 64, 4, 2, 8
EMPTY_ROW = 3          # a row whose keys are all padding: its output must be 0

# Meshes of 8 devices, and the ring-attention case kinds (causal, layout) run on each:
# the default (causal, zig-zag) on all four, the other kinds on a pure sequence mesh and
# one with a batch axis beside it (each case is two compiles of 8-device programs).
MESHES = {"seq8": dict(data=1, sequence=8), "data2_seq4": dict(data=2, sequence=4),
          "tensor2_seq4": dict(data=1, tensor=2, sequence=4),
          "data4_seq2": dict(data=4, sequence=2)}
KINDS = {"causal": (True, "zigzag"), "causal_contiguous": (True, "contiguous"),
         "full": (False, "zigzag")}
KIND_MESHES = {"causal": tuple(MESHES), "causal_contiguous": ("seq8", "data2_seq4"),
               "full": ("seq8", "data2_seq4")}
RING_CASES = [(mesh, kind) for kind, meshes in KIND_MESHES.items() for mesh in meshes]

# PPO: a tiny model on [PB, PL] tokens.
PB, PL, V = 4, 64, 32
STEPS = 2
LR = 0.5


def attention_inputs(seed=0):
  """``(q, k, v, key_mask, weights)``: left/right padding, a hole, an empty row."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, T, K, H)).astype(np.float32)
  val = rng.normal(size=(B, T, K, H)).astype(np.float32)
  mask = np.ones((B, T), np.float32)
  mask[0, :11] = 0                  # left padding (first queries see no key, causally)
  mask[1, 40:] = 0                  # right padding
  mask[2, 20:30] = 0                # a hole spanning a chunk boundary
  mask[EMPTY_ROW] = 0
  weights = rng.normal(size=(B, T, N, H)).astype(np.float32)
  return q, k, val, mask, weights


def numpy_attention(q, k, val, mask, causal):
  """Plain float64 softmax attention (GQA, key mask, causal); 0 without visible keys."""
  q, k, val = (np.asarray(x, np.float64) for x in (q, k, val))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  out = np.zeros((b, t, n, h))
  for bi in range(b):
    for head in range(n):
      kv = head // (n // kh)
      scores = q[bi, :, head] @ k[bi, :, kv].T / np.sqrt(h)
      allowed = np.broadcast_to(np.asarray(mask[bi]) > 0, (t, s)).copy()
      if causal:
        allowed &= np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)
      for i in range(t):
        if allowed[i].any():
          z = scores[i][allowed[i]]
          p = np.exp(z - z.max())
          out[bi, i, head] = (p / p.sum()) @ val[bi, :, kv][allowed[i]]
  return out


def model_config():
  from jaxrl_llm.models.transformer import TransformerConfig
  return TransformerConfig.tiny(V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=64, max_seq_len=PL)


def make_batch(seed=0):
  """A PPO batch ``[PB, PL]``: left and right padding, a hole, rewards for GAE."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, V, (PB, PL)).astype(np.int32)
  attn = np.ones((PB, PL), np.float32)
  attn[0, :13] = 0                                    # left padding across a chunk
  attn[1, 50:] = 0                                    # right padding
  loss_mask = np.zeros((PB, PL), np.float32)
  loss_mask[:, 20:] = 1
  loss_mask *= attn
  loss_mask[2, 33] = 0                                # a hole inside a response
  rewards = np.zeros((PB, PL), np.float32)
  rewards[:, -1] = rng.normal(size=PB)
  rewards[1, 49] = 1.0
  old_logp = (-np.log(V) + 0.1 * rng.normal(size=(PB, PL))).astype(np.float32)
  return dict(tokens=tokens, attention_mask=attn, loss_mask=loss_mask,
              old_logp=old_logp * loss_mask,
              old_values=(0.1 * rng.normal(size=(PB, PL))).astype(np.float32),
              rewards=rewards)


@functools.cache
def build():
  """``(apply_fn, params, optimizer, train_config, batch)`` with host-array params."""
  import jax
  import optax
  from flax import nnx

  from jaxrl_llm.models.transformer import Transformer, make_apply_fn, split_model
  from jaxrl_llm.train import TrainConfig

  graphdef, params = split_model(Transformer(model_config(), rngs=nnx.Rngs(0)))
  optimizer = optax.sgd(LR, momentum=0.9)   # see tests/parallel_setup.py: not Adam
  config = TrainConfig(num_microbatches=2, entropy_coef=0.01, logprob_chunk_size=16)
  params = jax.tree_util.tree_map(np.asarray, params)
  return make_apply_fn(graphdef), params, optimizer, config, make_batch()


def reference_run(steps=STEPS):
  """Single-device PPO run: ``(flat params, [metrics per step])``."""
  return parallel_setup.reference_run(steps, build_fn=build)


