"""Packed rows on 8 forced CPU devices: ring attention with segment ids, and a
sequence-sharded packed PPO / GRPO step against the single-device padded step.

``python -m tests.packing_worker OUT.json`` runs every case in one process and writes
the measurements as JSON; ``tests/core/test_packing.py`` asserts on them.
"""

from __future__ import annotations

from tests._devices import force_host_devices

force_host_devices(8)    # before jax is imported; the caller's other XLA flags kept

import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# Compile fast on a 2-core box: changes float rounding only.
jax.config.update("jax_disable_most_optimizations", True)

from jaxrl_llm.attention import dot_product_attention, register_attention
from jaxrl_llm.packing import pack_batch
from jaxrl_llm.parallel import (
  gather_to_host,
  make_mesh,
  ring_attention,
  ring_dot_product_attention,
  shard_batch,
)
from jaxrl_llm.train import (
  TrainConfig,
  init_train_state,
  make_train_step,
  shard_apply_fn,
  shard_train_step,
)
from tests import ring_setup as R

MESHES = {"seq8": dict(data=1, sequence=8), "data2_seq4": dict(data=2, sequence=4)}


def _max_diff(a, b):
  return float(max(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                   for x, y in zip(jax.tree_util.tree_leaves(a),
                                   jax.tree_util.tree_leaves(b))))


def case_ring(results):
  """ring_attention(segment_ids=...) == single-device segment attention (xla), values and
  gradients, zig-zag and contiguous; segments cross the chunk boundaries."""
  rng = np.random.default_rng(0)
  b, t = 2, 64
  q = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
  val = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
  seg = np.zeros((b, t), np.int32)
  seg[0, :13], seg[0, 13:40], seg[0, 40:61] = 1, 2, 3       # padding 61..63
  seg[1, :5], seg[1, 5:64] = 1, 2
  seg = jnp.asarray(seg)
  w = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)

  def loss(fn, *a):
    return jnp.sum(fn(*a) * w)

  single = lambda q_, k_, v_: dot_product_attention(q_, k_, v_, segment_ids=seg,
                                                     implementation="xla")
  want = single(q, k, val)
  want_g = jax.grad(lambda *a: loss(single, *a), argnums=(0, 1, 2))(q, k, val)
  out = {}
  for name, spec in MESHES.items():
    mesh = make_mesh(**spec)
    for layout in ("zigzag", "contiguous"):
      ring = lambda q_, k_, v_, mesh=mesh, lay=layout: ring_attention(
          q_, k_, v_, mesh=mesh, segment_ids=seg, layout=lay)
      got = jax.jit(ring)(q, k, val)
      grads = jax.jit(jax.grad(lambda *a, ring=ring: loss(ring, *a), argnums=(0, 1, 2)))(
          q, k, val)
      out[f"{name}/{layout}"] = dict(value_diff=_max_diff(got, want),
                                     grad_diff=_max_diff(grads, want_g),
                                     grad_scale=float(max(np.abs(g).max() for g in want_g)))
  results["ring"] = out


def _padded_batch(seed, grpo):
  """A padded [8, 24] batch of (prompt, completion) rows of random lengths."""
  rng = np.random.default_rng(seed)
  n, width = 8, 24
  attn = np.zeros((n, width), np.float32)
  loss = np.zeros((n, width), np.float32)
  for i in range(n):
    p = int(rng.integers(1, 4))
    c = int(rng.integers(2, width - p + 1))
    off = int(rng.integers(0, width - p - c + 1)) if i % 2 else 0
    attn[i, off:off + p + c] = 1
    loss[i, off + p:off + p + c] = 1
  tokens = (rng.integers(1, R.V, (n, width)) * attn).astype(np.int32)
  batch = dict(tokens=tokens, attention_mask=attn, loss_mask=loss,
               old_logp=((-np.log(R.V) + 0.1 * rng.normal(size=(n, width))) * loss
                         ).astype(np.float32))
  if grpo:
    batch["advantages"] = rng.normal(size=n).astype(np.float32)
    batch["ref_logp"] = (batch["old_logp"] - 0.02 * loss).astype(np.float32)
  else:
    rewards = np.zeros((n, width), np.float32)
    last = width - 1 - np.argmax(loss[:, ::-1], axis=1)
    rewards[np.arange(n), last] = rng.normal(size=n)
    batch["rewards"] = rewards
    batch["old_values"] = (0.1 * rng.normal(size=(n, width)) * loss).astype(np.float32)
  return batch


CONFIGS = {
    "ppo": TrainConfig(entropy_coef=0.01, lam=0.9, loss_agg_mode="seq-mean-token-mean"),
    "grpo": TrainConfig(use_value=False, whiten_advantages=False, kl_mode="loss",
                        kl_coef=0.1),
}


def case_step(results):
  """A packed step sharded over `sequence` (ring attention in the model) == the padded
  single-device step: metrics and parameters after one SGD update."""
  apply_fn, params, optimizer, _, _ = R.build()
  calls = []

  def counting_ring(*args, **kwargs):
    calls.append(kwargs.get("segment_ids") is not None)
    return ring_dot_product_attention(*args, **kwargs)

  out = {}
  for algo, config in CONFIGS.items():
    apply_fn_ = apply_fn    # GRPO ignores the value head
    batch = _padded_batch(1, grpo=algo == "grpo")
    step = make_train_step(apply_fn_, optimizer, config)
    ref_state, ref_metrics = jax.jit(step)(init_train_state(params, optimizer, config),
                                           batch)
    packed, plan = pack_batch(batch, max_tokens=48, row_multiple=2)
    packed = {k: np.asarray(x) for k, x in packed.items()}
    register_attention("ring", counting_ring)
    name = "seq8" if algo == "ppo" else "data2_seq4"    # one mesh each: compile time
    for spec in (MESHES[name],):
      calls.clear()
      mesh = make_mesh(**spec)
      sstep, state = shard_train_step(
          make_train_step(shard_apply_fn(apply_fn_, mesh), optimizer, config),
          init_train_state(params, optimizer, config), mesh, batch=packed)
      state, metrics = sstep(state, shard_batch(packed, mesh))
      out[f"{algo}/{name}"] = dict(
          param_diff=_max_diff(gather_to_host(state.params), ref_state.params),
          metric_diff={k: abs(float(metrics[k]) - float(ref_metrics[k]))
                       for k in ref_metrics},
          padding_before=float(1 - batch["attention_mask"].mean()),
          padding_after=float((plan.segment_ids == 0).mean()),
          rows=[int(batch["tokens"].shape[0]), int(packed["tokens"].shape[0])],
          ring_with_segments=bool(calls) and all(calls))
    register_attention("ring", ring_dot_product_attention)
  results["step"] = out


def run(out_path):
  results = {"device_count": jax.device_count(), "errors": {}, "seconds": {}}
  for name, fn in (("ring", case_ring), ("step", case_step)):
    start = time.perf_counter()
    try:
      fn(results)
    except Exception:  # recorded for the test to show
      results["errors"][name] = traceback.format_exc()
    results["seconds"][name] = round(time.perf_counter() - start, 2)
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  run(sys.argv[1])
