"""The model, batch and config shared by the parallel tests and their worker processes.

Imported by the pytest process (one device) and by ``tests/parallel_worker.py`` /
``tests/multihost_worker.py`` (forced CPU devices, several processes), so every process
builds bit-identical inputs. Nothing here imports jax at module level: a worker must
set ``XLA_FLAGS`` first.
"""

from __future__ import annotations

import functools

import numpy as np

B, L, V = 16, 12, 32
STEPS = 3
LR = 0.5


def model_config():
  """A 1-layer tiny transformer whose sizes divide 8 (fsdp) and 2 (tensor)."""
  from jaxrl_llm.models.transformer import TransformerConfig
  return TransformerConfig.tiny(V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                d_ff=64, max_seq_len=32)


@functools.cache
def build():
  """``(apply_fn, params, optimizer, train_config, batch)``, built once per process.

  ``params`` (an ``nnx.State``) and ``batch`` hold host numpy arrays, so that a step
  donating its device copies never invalidates them. Do not mutate them.
  """
  import jax
  import optax
  from flax import nnx

  from jaxrl_llm.models.transformer import Transformer, make_apply_fn, split_model
  from jaxrl_llm.train import TrainConfig

  graphdef, params = split_model(Transformer(model_config(), rngs=nnx.Rngs(0)))
  # SGD: Adam's g / sqrt(v) turns float rounding of ~0 gradients into +-lr steps, so a
  # sharded run (other reduction order) would differ by lr, not by rounding.
  optimizer = optax.sgd(LR, momentum=0.9)
  config = TrainConfig(num_microbatches=2, entropy_coef=0.01, kl_mode="loss",
                       kl_coef=0.05)
  params = jax.tree_util.tree_map(np.asarray, params)
  return make_apply_fn(graphdef), params, optimizer, config, make_batch()


def make_batch(seed=0):
  """A PPO batch ``[B, L]``: padding on both sides, a hole, ragged responses."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, V, (B, L)).astype(np.int32)
  attn = np.ones((B, L), np.float32)
  attn[:3, :2] = 0                                   # left padding
  loss_mask = np.zeros((B, L), np.float32)
  loss_mask[:, 5:] = 1
  loss_mask[4, 9:] = 0
  attn[4, 9:] = 0                                    # a shorter, right-padded response
  loss_mask[7, 8] = 0                                # a hole inside a response
  rewards = np.zeros((B, L), np.float32)
  rewards[:, -1] = rng.normal(size=B)
  rewards[4, 8] = 1.0
  # The initial model is near uniform: behaviour log-probs close to -log V keep the
  # PPO ratios near 1 (most tokens inside the clip range) without a forward pass.
  old_logp = (-np.log(V) + 0.1 * rng.normal(size=(B, L))).astype(np.float32)
  return dict(tokens=tokens, attention_mask=attn, loss_mask=loss_mask,
              old_logp=old_logp * loss_mask,
              old_values=(0.1 * rng.normal(size=(B, L))).astype(np.float32),
              rewards=rewards, ref_logp=(old_logp - 0.05).astype(np.float32))


def reference_run(steps=STEPS, *, build_fn=None):
  """Single-device run of ``build_fn()`` (default `build`):
  ``(flat params {path: array}, [metrics per step])``."""
  import jax

  from jaxrl_llm.train import init_train_state, make_train_step

  apply_fn, params, optimizer, config, batch = (build_fn or build)()
  state = init_train_state(params, optimizer, config)
  step = jax.jit(make_train_step(apply_fn, optimizer, config))
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    history.append({k: float(x) for k, x in metrics.items()})
  return flat_params(state.params), history


def flat_params(params) -> dict:
  """``{key path: host float64 array}`` of a (gathered or local) parameter tree."""
  import jax
  return {jax.tree_util.keystr(tuple(path)): np.asarray(x, np.float64)
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def max_abs_diff(a: dict, b: dict) -> float:
  assert sorted(a) == sorted(b), (sorted(a), sorted(b))
  return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)
