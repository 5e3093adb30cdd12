"""Decode throughput: KV-cache sampler vs. a no-cache full-recompute loop.

Both sides decode greedily (no EOS) from left-padded random prompts and are fully
jitted, so the comparison isolates the algorithm:

* ``cached``: :func:`jaxrl_llm.rollout.sampler.sample` (one prefill, then a
  ``lax.while_loop`` of one-token decodes against the KV cache).
* ``no_cache``: a ``lax.fori_loop`` that re-runs the full forward over the whole
  ``[B, P + N]`` buffer (future columns masked) at every step and takes the argmax at
  the newest column: O(N (P + N)^2) attention and O(N (P + N)) MLP work instead of
  O(N (P + N)) and O(N).

Reported: compile time, steady-state wall time (median of ``--repeats`` calls),
generated tokens per second (``B * N / time``), the speed-up, and whether the two
produced identical tokens.

Usage::

  python benchmarks/sampler.py --quick
  python benchmarks/sampler.py --json benchmarks/results/sampler_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models.transformer import (
  Transformer,
  get_config,
  make_apply_fn,
  make_decode_fns,
  split_model,
)
from jaxrl_llm.rollout.sampler import sample

VOCAB = 512
FULL_CASES = [  # (config, batch, prompt_len, new_tokens)
    ("tiny", 8, 32, 32),
    ("tiny", 8, 64, 64),
    ("tiny", 32, 64, 64),
    ("tiny", 8, 128, 128),
    ("small", 8, 32, 32),
    ("small", 8, 64, 64),
    ("small", 32, 64, 64),
]
QUICK_CASES = [("tiny", 4, 16, 16), ("small", 4, 32, 32)]


def no_cache_greedy(apply, params, prompts, prompt_mask, *, max_new_tokens):
  """Greedy decoding that recomputes the full forward over the buffer every step."""
  b, p = prompts.shape
  tokens = jnp.concatenate([prompts, jnp.zeros((b, max_new_tokens), jnp.int32)], 1)
  mask = jnp.concatenate([prompt_mask.astype(jnp.float32),
                          jnp.zeros((b, max_new_tokens), jnp.float32)], 1)

  def step(n, carry):
    tokens, mask = carry
    hidden, _, lm_head = apply(params, tokens, None, mask)
    last = jax.lax.dynamic_index_in_dim(hidden, p + n - 1, axis=1, keepdims=False)
    nxt = jnp.argmax(last.astype(jnp.float32) @ lm_head.astype(jnp.float32), -1)
    tokens = jax.lax.dynamic_update_slice(tokens, nxt.astype(jnp.int32)[:, None], (0, p + n))
    mask = jax.lax.dynamic_update_slice(mask, jnp.ones((b, 1), jnp.float32), (0, p + n))
    return tokens, mask

  tokens, _ = jax.lax.fori_loop(0, max_new_tokens, step, (tokens, mask))
  return tokens[:, p:]


def _time(fn, repeats):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  compile_s = time.perf_counter() - start
  runs = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    runs.append(time.perf_counter() - start)
  return out, compile_s, statistics.median(runs)


def bench_case(name, batch, prompt_len, new_tokens, repeats):
  cfg = get_config(name, VOCAB, max_seq_len=max(prompt_len + new_tokens, 128))
  graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  lengths = rng.integers(prompt_len // 2, prompt_len + 1, batch)
  mask = (np.arange(prompt_len)[None] >= prompt_len - lengths[:, None]).astype(np.float32)
  prompts = (rng.integers(1, VOCAB, (batch, prompt_len)) * mask).astype(np.int32)

  cached_fn = jax.jit(functools.partial(sample, make_decode_fns(graphdef)),
                      static_argnames=("max_new_tokens", "greedy"))
  cached, cached_compile, cached_s = _time(
      lambda: cached_fn(params, prompts, mask, None, max_new_tokens=new_tokens,
                        greedy=True).completion, repeats)
  plain_fn = jax.jit(functools.partial(no_cache_greedy, make_apply_fn(graphdef)),
                     static_argnames="max_new_tokens")
  plain, plain_compile, plain_s = _time(
      lambda: plain_fn(params, prompts, mask, max_new_tokens=new_tokens), repeats)
  generated = batch * new_tokens
  return {
      "config": name, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "params": int(sum(x.size for x in jax.tree.leaves(params))),
      "cached_s": cached_s, "no_cache_s": plain_s,
      "cached_tok_s": generated / cached_s, "no_cache_tok_s": generated / plain_s,
      "speedup": plain_s / cached_s,
      "cached_compile_s": cached_compile, "no_cache_compile_s": plain_compile,
      "same_tokens": bool(np.array_equal(np.asarray(cached), np.asarray(plain))),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two small cases only")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--json", default=None, help="write results to this path")
  args = parser.parse_args(argv)
  cases = QUICK_CASES if args.quick else FULL_CASES
  repeats = args.repeats or 2

  header = (f"{'config':<6} {'params':>8} {'B':>3} {'P':>4} {'N':>4} "
            f"{'cached tok/s':>13} {'no-cache tok/s':>15} {'speedup':>8} "
            f"{'compile c/nc (s)':>17} {'same':>5}")
  print(f"backend={jax.default_backend()} devices={jax.devices()} vocab={VOCAB}")
  print(header)
  print("-" * len(header))
  results = []
  for case in cases:
    r = bench_case(*case, repeats)
    results.append(r)
    print(f"{r['config']:<6} {r['params']:>8} {r['batch']:>3} {r['prompt_len']:>4} "
          f"{r['new_tokens']:>4} {r['cached_tok_s']:>13.0f} {r['no_cache_tok_s']:>15.0f} "
          f"{r['speedup']:>7.1f}x {r['cached_compile_s']:>8.1f}/{r['no_cache_compile_s']:<8.1f}"
          f" {r['same_tokens']!s:>5}", flush=True)
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                 "jax": jax.__version__, "machine": platform.platform(),
                 "cpu_count": os.cpu_count(), "vocab": VOCAB, "repeats": repeats,
                 "results": results}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
