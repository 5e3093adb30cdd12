r"""Packed vs padded PPO step on a heavy-tailed batch: time, compiled memory, padding.

Run: ``python -m benchmarks.packing [--scale 16] [--repeats 3] [--memory small,1b]
[--no-time] [--quick] [--json out.json]``.

The batch: 32 (prompt, completion) sequences whose total lengths are log-normal
(median 1000 tokens, :math:`\sigma = 0.6`, seed 0, clipped to [128, 16384]) with the
longest set to 16384 (the tail), prompts of 64 tokens. The padded layout is
``[32, 16384]``; the packed one (:func:`jaxrl_llm.packing.pack_batch`, first-fit
decreasing) has rows of the longest sequence's width (the token budget 16384) and as
many as first-fit decreasing needs.

* **Time** (CPU, the ``small`` config of ``benchmarks/long_sequence.py``: vocabulary
  32000, ``remat=True``, float32): one jitted
  :func:`jaxrl_llm.make_ppo_train_step` step (value head, GAE in the step, clipped
  surrogate and value losses, Adam, one epoch and minibatch; forward, backward, GAE and
  losses). A CPU cannot run ``[32, 16384]`` in reasonable time, so every length is
  divided by ``--scale`` (32: median ~31, tail 512, prompts 2). Padded and packed
  steps alternate in one process (``--repeats`` pairs after one warm-up each) and the
  ratio of the medians is reported.
* **Memory** (nothing runs): the same step at full scale, AOT-compiled for one CPU
  device with the default XLA pipeline, ``memory_analysis()`` (arguments + outputs +
  temporaries - aliased), for the ``small`` and the ``1b`` configs of
  ``benchmarks/long_sequence.py`` (``remat=True``, ``logprob_chunk_size=1024``).
* **Padding**: the share of token slots that hold no real token, before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import long_sequence
from benchmarks._common import machine, markdown_table, write_json
from jaxrl_llm.models.transformer import Transformer, TransformerConfig, make_apply_fn, split_model
from jaxrl_llm.packing import pack_batch, padding_fraction
from jaxrl_llm.train import TrainConfig, init_train_state, make_ppo_train_step

GIB = 2.0 ** 30
N_SEQ, MEDIAN, SIGMA, LONGEST, MIN_LEN, PROMPT = 32, 1000, 0.6, 16384, 128, 64


def heavy_tailed_lengths(scale: int = 1, seed: int = 0) -> np.ndarray:
  """The 32 sequence lengths (prompt included), divided by ``scale``."""
  rng = np.random.default_rng(seed)
  lengths = np.exp(np.log(MEDIAN) + SIGMA * rng.normal(size=N_SEQ))
  lengths = np.clip(np.round(lengths), MIN_LEN, LONGEST).astype(np.int64)
  lengths[int(np.argmax(lengths))] = LONGEST
  return np.maximum(lengths // scale, 2)


def padded_batch(lengths, prompt: int, seed: int = 0) -> dict:
  """A right-padded PPO batch ``[N, max(lengths)]`` (numpy)."""
  rng = np.random.default_rng(seed)
  n, width = len(lengths), int(max(lengths))
  cols = np.arange(width)[None]
  attn = (cols < np.asarray(lengths)[:, None]).astype(np.float32)
  loss = attn * (cols >= prompt)
  rewards = np.zeros((n, width), np.float32)
  rewards[np.arange(n), np.asarray(lengths) - 1] = rng.normal(size=n)
  return {"tokens": (rng.integers(1, 32000, (n, width)) * attn).astype(np.int32),
          "attention_mask": attn, "loss_mask": loss,
          "old_logp": (-10.0 + 0.1 * rng.normal(size=(n, width))).astype(np.float32) * loss,
          "old_values": (0.1 * rng.normal(size=(n, width))).astype(np.float32) * loss,
          "rewards": rewards}


def both_layouts(scale: int) -> tuple[dict, dict, dict]:
  """``(padded, packed, info)`` numpy batches at ``scale``."""
  lengths = heavy_tailed_lengths(scale)
  prompt = max(PROMPT // scale, 1)
  batch = padded_batch(lengths, prompt)
  multiple = max(128 // scale, 8)
  width = -(-int(lengths.max()) // multiple) * multiple    # the token budget of a row
  packed, plan = pack_batch(batch, width)
  packed = {k: np.asarray(x) for k, x in packed.items()}
  info = {"lengths": lengths.tolist(), "padded_shape": list(batch["tokens"].shape),
          "packed_shape": list(packed["tokens"].shape),
          "padding_before": padding_fraction(batch["attention_mask"]),
          "padding_after": padding_fraction(plan.segment_ids),
          "tokens": int(lengths.sum())}
  return batch, packed, info


def _step(cfg: TransformerConfig, config: TrainConfig, abstract: bool):
  make = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = split_model(nnx.eval_shape(make) if abstract else make())
  optimizer = optax.adam(1e-5)
  step = make_ppo_train_step(make_apply_fn(graphdef), optimizer, config)
  init = lambda p: init_train_state(p, optimizer, config)
  state = jax.eval_shape(init, params) if abstract else init(params)
  return jax.jit(step, donate_argnums=0), state


def time_cpu(scale: int, repeats: int) -> dict:
  """Interleaved wall times of the padded and packed steps (small model, float32)."""
  padded, packed, info = both_layouts(scale)
  cfg = long_sequence.model_config("small")     # remat=True: as the memory rows
  config = TrainConfig(logprob_chunk_size=1024)
  times: dict[str, list] = {"padded": [], "packed": []}
  steps = {}
  for name in times:
    steps[name] = _step(cfg, config, abstract=False)
  batches = {"padded": padded, "packed": packed}
  for i in range(repeats + 1):        # the first pair compiles (not counted)
    for name in ("padded", "packed"):
      step, state = steps[name]
      t0 = time.perf_counter()
      state, metrics = step(state, batches[name])
      jax.block_until_ready(metrics)
      steps[name] = (step, state)
      if i:
        times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(x) for k, x in times.items()}
  return {**info, "scale": scale, "padded_s": med["padded"], "packed_s": med["packed"],
          "speedup": med["padded"] / med["packed"], "times": times}


def compiled_memory(model: str) -> dict:
  """``memory_analysis()`` of the full-scale padded and packed steps (nothing runs)."""
  padded, packed, info = both_layouts(1)
  cfg = long_sequence.model_config(model)
  config = TrainConfig(logprob_chunk_size=1024)
  out = {"model": model, **{k: info[k] for k in ("padded_shape", "packed_shape")}}
  for name, batch in (("padded", padded), ("packed", packed)):
    step, state = _step(cfg, config, abstract=True)
    spec = {k: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
            for k, x in batch.items()}
    t0 = time.perf_counter()
    compiled = step.lower(state, spec).compile()
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes
             + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    out[f"{name}_gib"] = total / GIB
    out[f"{name}_temp_gib"] = mem.temp_size_in_bytes / GIB
    out[f"{name}_compile_s"] = time.perf_counter() - t0
  out["ratio"] = out["packed_gib"] / out["padded_gib"]
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--scale", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--memory", default="small,1b",
                 help="models whose full-scale memory is compiled ('' for none)")
  p.add_argument("--no-time", action="store_true")
  p.add_argument("--quick", action="store_true",
                 help="a smoke run: --scale 64 --repeats 1 --memory ''")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.quick:
    args.scale, args.repeats, args.memory = 64, 1, ""
  print(machine())
  _, _, full = both_layouts(1)
  print(f"full scale: padded {full['padded_shape']} -> packed {full['packed_shape']}, "
        f"{full['tokens']} tokens, padding {full['padding_before']:.1%} -> "
        f"{full['padding_after']:.1%}")
  payload: dict = {"machine": machine(), "full": full}
  if not args.no_time:
    t = time_cpu(args.scale, args.repeats)
    payload["time"] = t
    print(f"\nCPU time, small model, lengths / {t['scale']}: padded {t['padded_shape']} "
          f"{t['padded_s']:.3f} s, packed {t['packed_shape']} {t['packed_s']:.3f} s, "
          f"speedup {t['speedup']:.2f}x; padding {t['padding_before']:.1%} -> "
          f"{t['padding_after']:.1%}")
  rows = []
  for model in [m for m in args.memory.split(",") if m]:
    rows.append(compiled_memory(model))
    print(markdown_table(rows[-1:], ["model", "padded_gib", "packed_gib", "ratio",
                                     "padded_temp_gib", "packed_temp_gib",
                                     "padded_compile_s", "packed_compile_s"]))
  payload["memory"] = rows
  write_json(args.json, payload)


if __name__ == "__main__":
  main()
