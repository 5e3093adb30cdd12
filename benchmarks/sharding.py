"""Sharded PPO train step per mesh layout: correctness, time, memory, collectives.

Run: ``python -m benchmarks.sharding [--quick] [--json out.json]``.

On 8 devices (8 forced CPU devices unless ``XLA_FLAGS`` already sets a device count;
the flag is set before jax is imported) the ``small`` reference transformer runs one
PPO step config (value head, GAE, 2 microbatches, SGD with momentum) under
:func:`jaxrl_llm.train.shard_train_step`, built from
:func:`jaxrl_llm.train.shard_apply_fn` (batch-sharded activations), for several
mesh layouts, against the same step on one device; ``fsdp8 (no shard_apply_fn)``
shows the FSDP step without the activation constraints. Per layout:

* ``max|dparam|``: largest parameter difference to the single-device run after
  ``--steps`` steps (float32 rounding only if the layout is correct);
* ``compile_s``: ``lower`` + ``compile`` wall time; ``step_ms``: median step time;
* ``state_MB/dev``: bytes of the train state held by device 0 (parameters and
  optimizer state: shrinks with fsdp/tensor), ``temp_MB/dev``: XLA's per-device
  temporary buffer size (``compiled.memory_analysis()``);
* HLO collective counts of the compiled per-device program (``compiled.as_text()``):
  all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute (static
  instruction counts; an op inside the scan over microbatches counts once).

On forced CPU devices all "devices" share the host's cores, so step times measure
the partitioned program's overhead, not multi-accelerator scaling; the collective
counts and per-device memory are what carry over to a real mesh.
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import argparse
import re
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine, markdown_table, write_json
from jaxrl_llm.models.transformer import Transformer, TransformerConfig, make_apply_fn, split_model
from jaxrl_llm.parallel import make_mesh, shard_batch
from jaxrl_llm.train import (
  TrainConfig,
  init_train_state,
  make_train_step,
  shard_apply_fn,
  shard_train_step,
)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
LAYOUTS = {
    "data8": dict(data=8),
    "fsdp8": dict(data=1, fsdp=8),
    "fsdp8 (no shard_apply_fn)": dict(data=1, fsdp=8),
    "data4_tensor2": dict(data=4, tensor=2),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2),
    "data2_tensor4": dict(data=2, tensor=4),
}
QUICK_LAYOUTS = ("data8", "fsdp8", "fsdp8 (no shard_apply_fn)",
                 "data2_fsdp2_tensor2")


def collective_counts(hlo_text: str) -> dict:
  """Number of HLO instructions of each collective kind (async ``-start`` included)."""
  counts = {}
  for name in COLLECTIVES:
    counts[name] = len(re.findall(rf"\s{re.escape(name)}(?:-start)?\(", hlo_text))
  return counts


def make_batch(batch, length, vocab, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, (batch, length)).astype(np.int32)
  attn = np.ones((batch, length), np.float32)
  loss_mask = np.zeros((batch, length), np.float32)
  loss_mask[:, length // 4:] = 1
  rewards = np.zeros((batch, length), np.float32)
  rewards[:, -1] = rng.normal(size=batch)
  old_logp = (-np.log(vocab) + 0.1 * rng.normal(size=(batch, length))) * loss_mask
  return dict(tokens=tokens, attention_mask=attn, loss_mask=loss_mask,
              old_logp=old_logp.astype(np.float32), rewards=rewards,
              old_values=(0.1 * rng.normal(size=(batch, length))).astype(np.float32))


def state_bytes_on(state, device) -> int:
  total = 0
  for x in jax.tree_util.tree_leaves(state):
    for shard in x.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


def flat(tree):
  return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def run_layout(name, sizes, setup, steps, repeats, reference):
  apply_fn, params, optimizer, config, batch = setup
  mesh = make_mesh(**sizes) if sizes is not None else None
  state = init_train_state(params, optimizer, config)
  if mesh is not None and "no shard_apply_fn" not in name:
    apply_fn = shard_apply_fn(apply_fn, mesh)
  step_fn = make_train_step(apply_fn, optimizer, config)
  if mesh is None:
    step = jax.jit(step_fn, donate_argnums=0)
    placed = jax.device_put(batch)
    state = jax.device_put(state)
  else:
    step, state = shard_train_step(step_fn, state, mesh, batch=batch)
    placed = shard_batch(batch, mesh)
  t0 = time.perf_counter()
  compiled = step.lower(state, placed).compile()
  compile_s = time.perf_counter() - t0
  row = {"layout": name, "devices": 1 if mesh is None else mesh.size,
         "compile_s": compile_s}
  for _ in range(steps):
    state, metrics = compiled(state, placed)
  jax.block_until_ready(state)
  params_after = flat(state.params)
  row["loss"] = float(metrics["loss"])
  if reference is not None:
    row["max|dparam|"] = max(float(np.max(np.abs(a - b)))
                             for a, b in zip(params_after, reference))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, metrics = compiled(state, placed)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  row["step_ms"] = 1e3 * statistics.median(times)
  device0 = jax.devices()[0]
  row["state_MB/dev"] = state_bytes_on(state, device0) / 2**20
  mem = compiled.memory_analysis()
  row["temp_MB/dev"] = (mem.temp_size_in_bytes / 2**20 if mem is not None
                        else float("nan"))
  row.update(collective_counts(compiled.as_text()))
  return row, params_after


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--quick", action="store_true", help="smaller batch, 3 layouts")
  p.add_argument("--json", default=None)
  p.add_argument("--steps", type=int, default=2, help="steps compared to 1 device")
  args = p.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit(f"needs 8 devices, found {jax.device_count()}")
  vocab = 512
  batch, length = (16, 64) if args.quick else (32, 128)
  repeats = 2 if args.quick else 5
  layouts = {k: LAYOUTS[k] for k in QUICK_LAYOUTS} if args.quick else LAYOUTS

  cfg = TransformerConfig.small(vocab, max_seq_len=length)
  graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
  params = jax.tree_util.tree_map(np.asarray, params)     # host copy, never donated
  optimizer = optax.sgd(0.1, momentum=0.9)
  config = TrainConfig(num_microbatches=2)
  setup = (make_apply_fn(graphdef), params, optimizer, config,
           make_batch(batch, length, vocab))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

  rows = []
  single, reference = run_layout("single", None, setup, args.steps, repeats, None)
  rows.append(single)
  for name, sizes in layouts.items():
    row, _ = run_layout(name, sizes, setup, args.steps, repeats, reference)
    rows.append(row)
    print(f"  {name}: compile {row['compile_s']:.1f}s, step {row['step_ms']:.0f} ms, "
          f"max|dparam| {row['max|dparam|']:.2e}", file=sys.stderr)

  cols = ["layout", "devices", "max|dparam|", "compile_s", "step_ms", "state_MB/dev",
          "temp_MB/dev", *COLLECTIVES]
  print(f"# Sharded PPO train step ({machine()}; {jax.device_count()} devices)")
  print(f"small model: {n_params / 1e6:.2f}M params, vocab {vocab}, batch {batch} x "
        f"{length} tokens, 2 microbatches, SGD+momentum; max|dparam| after "
        f"{args.steps} steps vs one device.\n")
  print(markdown_table(rows, cols))
  write_json(args.json, {"benchmark": "sharding", "machine": machine(),
                         "params": n_params, "batch": batch, "length": length,
                         "rows": rows})
  return rows


if __name__ == "__main__":
  main()
