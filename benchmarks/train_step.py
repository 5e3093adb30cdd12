r"""Train-step throughput: tokens/s of a jitted PPO step and model FLOP utilisation.

Run: ``python -m benchmarks.train_step [--quick] [--json out.json]``; on a GPU, e.g.
``python -m benchmarks.train_step --dtype bfloat16 --cases 1b:8:2048 1b:2:8192``.

For the ``tiny`` and ``small`` reference transformers at a few ``(B, L)`` (or
``--cases MODEL:B:L``, where ``1b`` is the 1B-class config of
``benchmarks/long_sequence.py``: d_model 2048, 16 layers, 16/8 heads, d_ff 5632, vocab
32000, every block rematerialised) we time the
jitted :func:`jaxrl_llm.make_ppo_train_step` (value head, GAE, clipped surrogate and
value loss, one epoch, one minibatch) on a synthetic batch (random tokens, the second
half of each row is the response, a score at its last token) and report tokens/s
(``B * L / time``).

Model FLOP utilisation (MFU) compares the model FLOPs the step must do with a matmul
FLOP/s measured in the same process (a jitted square matmul in the model's compute
dtype, ``--dtype``, ``2 n^3`` FLOPs):

.. math::

   \text{FLOPs/token} = \text{passes} \times (6 N + 12\, n_\text{layers}\, d_\text{model}\, L),
   \qquad \mathrm{MFU} = \frac{\text{tokens/s} \times \text{FLOPs/token}}{\text{matmul FLOP/s}}

where ``N`` counts every parameter used in a matmul (the tied embedding counts once,
as the LM head), ``6 N`` is one forward (``2 N``) and backward (``4 N``) pass, ``12
n_layers d_model L`` the attention scores and weighted sum (forward and backward,
non-causal count) and ``passes = num_epochs x num_minibatches`` full forward/backward
passes over the batch (1 here: the old and reference log-probs come with the batch).
Elementwise work (norms, softmax, GAE, losses) is not counted, so MFU is a lower bound
of hardware use; on a CPU it is dominated by small matmuls and dispatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import long_sequence
from benchmarks._common import machine, markdown_table, timeit, write_json
from jaxrl_llm.advantages import default_gae_method
from jaxrl_llm.models.transformer import Transformer, get_config, make_apply_fn, split_model
from jaxrl_llm.train import TrainConfig, init_train_state, make_ppo_train_step

VOCAB = 256
FULL_CASES = [("tiny", 8, 128), ("tiny", 32, 128), ("tiny", 8, 512),
              ("small", 8, 128), ("small", 8, 512), ("small", 2, 2048)]
QUICK_CASES = [("tiny", 4, 64), ("small", 2, 128)]


def matmul_flops(n: int, repeats: int, dtype=jnp.float32) -> float:
  """Measured FLOP/s of a jitted ``[n, n] @ [n, n]`` matmul in ``dtype``."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
  f = jax.jit(jnp.matmul)
  return 2.0 * n ** 3 / timeit(f, a, b, repeats=repeats)


def model_flops_per_token(cfg, n_params: int, length: int, passes: int) -> float:
  """``passes * (6 N + 12 n_layers d_model L)`` (see the module docstring)."""
  return passes * (6.0 * n_params + 12.0 * cfg.n_layers * cfg.d_model * length)


def synthetic_batch(rng, b, length, vocab):
  half = length // 2
  tokens = rng.integers(1, vocab, (b, length)).astype(np.int32)
  loss_mask = np.zeros((b, length), np.float32)
  loss_mask[:, half:] = 1.0
  rewards = np.zeros((b, length), np.float32)
  rewards[:, -1] = rng.uniform(size=b)
  batch = {"tokens": tokens, "attention_mask": np.ones((b, length), np.float32),
           "loss_mask": loss_mask, "rewards": rewards,
           "old_logp": np.full((b, length), -np.log(vocab), np.float32) * loss_mask,
           "old_values": np.zeros((b, length), np.float32)}
  return {k: jnp.asarray(val) for k, val in batch.items()}


def model_config(name: str, length: int, dtype):
  if name == "1b":   # the long-sequence benchmark's 1B-class config, value head on
    return dataclasses.replace(long_sequence.model_config("1b"), max_seq_len=max(length, 8),
                               dtype=dtype, value_head=True)
  return get_config(name, VOCAB, value_head=True, max_seq_len=max(length, 8), dtype=dtype)


def bench_case(name, b, length, repeats, peak, dtype=jnp.float32, gae_method=None):
  cfg = model_config(name, length, dtype)
  graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
  n_params = int(sum(x.size for x in jax.tree.leaves(params)))
  config = TrainConfig(use_value=True, kl_mode="none", gae_method=gae_method)
  optimizer = optax.adam(1e-4)
  step = jax.jit(make_ppo_train_step(make_apply_fn(graphdef), optimizer, config),
                 donate_argnums=0)
  state = init_train_state(params, optimizer, config, rng=jax.random.PRNGKey(0))
  batch = synthetic_batch(np.random.default_rng(0), b, length, cfg.vocab_size)
  t0 = time.perf_counter()
  state, _ = jax.block_until_ready(step(state, batch))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats):   # the state is donated: each step consumes the last one
    t0 = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, batch))
    times.append(time.perf_counter() - t0)
  sec = float(np.median(times))
  tokens_s = b * length / sec
  passes = config.num_epochs * config.num_minibatches
  fpt = model_flops_per_token(cfg, n_params, length, passes)
  return {"model": name, "dtype": jnp.dtype(dtype).name,
          "gae": gae_method or default_gae_method(), "params": n_params, "B": b,
          "L": length,
          "step_ms": 1e3 * sec, "tokens_s": tokens_s, "compile_s": compile_s,
          "model_gflop_per_token": fpt / 1e9,
          "achieved_gflop_s": tokens_s * fpt / 1e9, "mfu": tokens_s * fpt / peak}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="two small cases")
  p.add_argument("--models", default="tiny,small", help="comma-separated subset")
  p.add_argument("--cases", nargs="+", default=None, metavar="MODEL:B:L",
                 help="explicit cases, e.g. 1b:8:2048 (model tiny, small or 1b)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="the models' compute dtype and the matmul's of the MFU peak")
  p.add_argument("--gae-methods", default=None,
                 help="comma-separated GAE solvers to time each case with (default: the "
                      "backend's, jaxrl_llm.advantages.default_gae_method)")
  p.add_argument("--matmul-n", type=int, default=None,
                 help="size of the peak matmul (default 2048; 1024 with --quick)")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  models = args.models.split(",")
  if args.cases:
    cases = [(name, int(b), int(length))
             for name, b, length in (c.split(":") for c in args.cases)]
  else:
    cases = [c for c in (QUICK_CASES if args.quick else FULL_CASES) if c[0] in models]
  repeats = 3 if args.quick else 5
  n = args.matmul_n or (1024 if args.quick else 2048)
  dtype = jnp.dtype(args.dtype)
  peak = matmul_flops(n, repeats, dtype)
  print(f"# PPO train-step throughput ({machine()})")
  print(f"measured matmul: {peak / 1e9:.1f} GFLOP/s ({dtype.name} {n}x{n} @ {n}x{n})",
        flush=True)
  rows = []
  methods = args.gae_methods.split(",") if args.gae_methods else [None]
  for name, b, length in cases:
    for method in methods:
      rows.append(bench_case(name, b, length, repeats, peak, dtype, method))
      print(rows[-1], flush=True)
  cols = ["model", "dtype", "gae", "params", "B", "L", "step_ms", "tokens_s", "compile_s",
          "model_gflop_per_token", "achieved_gflop_s", "mfu"]
  print(markdown_table(rows, cols))
  write_json(args.json, {"benchmark": "train_step", "machine": machine(),
                         "matmul_gflop_s": peak / 1e9, "matmul_n": n,
                         "matmul_dtype": dtype.name, "rows": rows})
  return rows


if __name__ == "__main__":
  main()
